"""The decode attention grid that launches fewer partitions than the block table's capacity holds
(ZLLM_DECODE_PARTITION_LOOP, csrc/attention_pipe.cuh's _loop entry points): each block attends
partitions i, i + launched, ... of its sequence. A partition's arithmetic does not depend on which
block runs it, so the pipelined build (2 stages, over 16-bit and FP8 caches) must give the bits of
the grid with a block for every partition, for any number launched, and the float64 reference's
values; pipe3, the classic kernels and the window and cap families keep a block for every
partition. Contexts from 0 to 3000 tokens over a table far larger than them (a graph's
capacity)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cupy")

from tests.helpers.kernels import DEVICE, PagedBatch, assert_close, nan_like  # noqa: E402
from zllm.workers import kernels  # noqa: E402
from zllm.workers.attention import KVScales, dequantize_kv, quantize_kv  # noqa: E402
from zllm.workers.kernels import attention as attention_kernels  # noqa: E402

pytestmark = pytest.mark.gpu

LENS = [0, 1, 17, 400, 513, 1024, 1500, 3000]


@pytest.fixture
def grids(monkeypatch) -> list[tuple[int, str]]:
    """Records the partitions each decode launch put in its grid, and the kernel."""
    seen: list[tuple[int, str]] = []
    real = attention_kernels.launch

    def record(module, kernel, device, grid, *args, **kwargs):
        if kernel.startswith("paged_attention_decode"):
            seen.append((grid[0], kernel))
        return real(module, kernel, device, grid, *args, **kwargs)

    monkeypatch.setattr(attention_kernels, "launch", record)
    return seen


def _batch(gen, head_dim=128, group=4, dtype=torch.bfloat16):
    """LENS in a block table of 400 entries: a capacity (a graph's max_model_len) far past them."""
    batch = PagedBatch(LENS, num_heads=2 * group, kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype, gen=gen)
    wide = torch.full((len(LENS), 400), batch.block_tables[0, -1].item(), dtype=torch.int32, device=DEVICE)
    wide[:, : batch.block_tables.shape[1]] = batch.block_tables
    batch.block_tables = wide  # 6400 tokens of capacity; the extra entries point at a NaN spare block
    return batch


def _assert_same_bits(out: torch.Tensor, every: torch.Tensor, what: str) -> None:
    differ = (out != every) & ~(out.isnan() & every.isnan())
    worst = (out.double() - every.double()).abs().nan_to_num(0).max().item()
    assert not differ.any(), f"{what}: {int(differ.sum())} of {out.numel()} values differ, by up to {worst}"


def _assert_matches_reference(out: torch.Tensor, expected: torch.Tensor, scale: float = 1.0) -> None:
    """The float64 reference's values; the empty sequence (LENS[0], where the reference divides 0
    by 0) gives zeros."""
    assert LENS[0] == 0 and torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close(out[1:], expected[1:], torch.bfloat16, scale)


def _run_launching(monkeypatch, batch, launched: int | None, **kwargs) -> torch.Tensor:
    """The kernel with `launched` partitions in its grid (None: every partition of the capacity, as
    ZLLM_DECODE_PARTITION_LOOP=0 launches)."""
    if launched is None:
        monkeypatch.setattr(attention_kernels, "launch_partitions", lambda batch, heads, kv, parts, device: parts)
    else:
        monkeypatch.setattr(
            attention_kernels, "launch_partitions", lambda batch, heads, kv, parts, device: min(parts, launched)
        )
    out = nan_like(batch.query)
    kernels.paged_attention_decode(
        out, batch.query, batch.cache, batch.block_tables, batch.seq_lens_t, batch.scale, **kwargs
    )
    return out


@pytest.mark.parametrize("partition_size", [64, 512, 1024])
@pytest.mark.parametrize("head_dim, group", [(128, 4), (64, 1), (128, 8)])
def test_any_number_launched_gives_the_full_grids_bits(monkeypatch, gen, grids, partition_size, head_dim, group):
    batch = _batch(gen, head_dim, group)
    every = _run_launching(monkeypatch, batch, None, partition_size=partition_size, build="pipe")
    parts, kernel = grids[-1]
    assert parts == -(-batch.block_tables.shape[1] * 16 // partition_size)
    assert kernel.startswith("paged_attention_decode_pipe_") and kernel.endswith("_s2"), kernel
    _assert_matches_reference(every, batch.reference())
    for launched in (1, 2, 3, parts - 1):
        out = _run_launching(monkeypatch, batch, launched, partition_size=partition_size, build="pipe")
        assert grids[-1] == (launched, kernel + "_loop")
        _assert_same_bits(out, every, f"{launched} of {parts} partitions launched")


def test_fp8_cache_loops_too(monkeypatch, gen, grids):
    scales = KVScales(0.37, 0.05)
    batch = _batch(gen)
    batch.cache = torch.stack([quantize_kv(batch.cache[i] * 6, s) for i, s in ((0, scales.k), (1, scales.v))])
    clean = [quantize_kv(batch.clean_cache[i] * 6, s) for i, s in ((0, scales.k), (1, scales.v))]
    batch.clean_cache = torch.stack(
        [dequantize_kv(clean[0], scales.k, torch.float64), dequantize_kv(clean[1], scales.v, torch.float64)]
    )
    kwargs = {"partition_size": 256, "k_scale": scales.k, "v_scale": scales.v, "build": "pipe"}
    every = _run_launching(monkeypatch, batch, None, **kwargs)
    _assert_matches_reference(every, batch.reference(), 1.0)
    for launched in (1, 3):
        _assert_same_bits(_run_launching(monkeypatch, batch, launched, **kwargs), every, f"{launched} launched")
        assert grids[-1][1].endswith("_kvfp8_d128_g4_s2_loop")


@pytest.mark.parametrize(
    "kwargs",
    [{"build": "pipe3"}, {"build": "classic"}, {"window": 700}, {"window": 300, "softcap": 5.0}, {"softcap": 4.0}],
    ids=["pipe3", "classic", "win", "win-cap", "cap"],
)
def test_the_other_builds_launch_every_partition(monkeypatch, gen, grids, kwargs):
    monkeypatch.setenv("ZLLM_DECODE_PARTITION_LOOP", "1")
    batch = _batch(gen)
    layer = {k: v for k, v in kwargs.items() if k != "build"}
    out = nan_like(batch.query)
    kernels.paged_attention_decode(
        out, batch.query, batch.cache, batch.block_tables, batch.seq_lens_t, batch.scale, partition_size=256, **kwargs
    )
    parts, kernel = grids[-1]
    assert parts == -(-min(batch.block_tables.shape[1] * 16, layer.get("window", 1 << 30)) // 256)
    assert not kernel.endswith("_loop")
    _assert_matches_reference(out, batch.reference(**layer))


def test_the_default_launches_few_partitions_over_a_large_capacity(gen, grids, monkeypatch):
    """The policy itself (switched on, no patch): 8 sequences over a 6400-token table; the grid
    holds fewer partitions than the capacity, and the result is the reference's, in a CUDA graph
    too."""
    monkeypatch.setenv("ZLLM_DECODE_PARTITION_LOOP", "1")
    batch = _batch(gen)
    heads = batch.query.shape[1]
    size, parts = kernels.attention_partitions(len(LENS), heads, 2, 6400, torch.device(DEVICE), block_size=16)
    expected = batch.reference()
    out = nan_like(batch.query)
    args = (out, batch.query, batch.cache, batch.block_tables, batch.seq_lens_t, batch.scale)
    kernels.paged_attention_decode(*args)
    _assert_matches_reference(out, expected)
    launched = attention_kernels.launch_partitions(len(LENS), heads, 2, parts, torch.device(DEVICE))
    assert launched < parts and grids[-1] == (launched, grids[-1][1]) and grids[-1][1].endswith("_loop")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.paged_attention_decode(*args)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _assert_matches_reference(out, expected)
