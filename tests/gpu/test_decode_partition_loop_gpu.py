"""The decode attention grid of one wave of blocks, whatever the block table's capacity
(ZLLM_DECODE_PARTITION_LOOP, csrc/attention_pipe.cuh's _loop entry points): the blocks claim every
(sequence, partition, head slot) of the batch, block i claim i first and the rest from a counter in
the module's memory. A partition's arithmetic does not depend on which block runs it, so the
pipelined build (2 stages, over 16-bit and FP8 caches) must give the bits of the grid with a block
for every partition, for any number of blocks launched (fewer or more than the claims), and the
float64 reference's values, launch after launch (the last block of each puts the counter back to
zero); pipe3, the classic kernels and the window and cap families keep a block for every partition.
Contexts from 0 to 3000 tokens over a table far larger than them (a graph's capacity), and one long
context among short ones or alone (a block then walks many units)."""

from __future__ import annotations

import pytest
import torch

cupy = pytest.importorskip("cupy")

from tests.helpers.kernels import DEVICE, PagedBatch, assert_close, nan_like  # noqa: E402
from zllm.workers import kernels  # noqa: E402
from zllm.workers.attention import KVScales, dequantize_kv, quantize_kv  # noqa: E402
from zllm.workers.kernels import attention as attention_kernels  # noqa: E402
from zllm.workers.kernels.loader import load_module, resident_blocks  # noqa: E402

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


def _batch(gen, head_dim=128, group=4, dtype=torch.bfloat16, lens=LENS):
    """lens in a block table of 400 entries: a capacity (a graph's max_model_len) far past them."""
    batch = PagedBatch(lens, num_heads=2 * group, kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype, gen=gen)
    wide = torch.full((len(lens), 400), batch.block_tables[0, -1].item(), dtype=torch.int32, device=DEVICE)
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


def _claim_counters() -> list[int]:
    """The _loop kernels' counters (csrc/attention_pipe.cuh, g_attention_claims): the claims
    handed out past the grid's first, and the blocks done."""
    device = torch.device(DEVICE)
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.synchronize(device)
    with cupy.cuda.Device(index):
        pointer = load_module("attention_kernels", index).module.get_global("g_attention_claims")
        return cupy.ndarray((2,), cupy.int32, pointer).get().tolist()


def _run_launching(monkeypatch, batch, launched: int | None, **kwargs) -> torch.Tensor:
    """The _loop kernel with `launched` blocks in its grid, whatever the batch (None: the plain
    kernel, a block for every partition of the capacity, as ZLLM_DECODE_PARTITION_LOOP=0); after
    it, its counters are back at zero."""
    monkeypatch.setattr(attention_kernels, "_loops", lambda *args: launched is not None)
    monkeypatch.setattr(attention_kernels, "loop_grid_blocks", lambda *args: launched)
    out = nan_like(batch.query)
    kernels.paged_attention_decode(
        out, batch.query, batch.cache, batch.block_tables, batch.seq_lens_t, batch.scale, **kwargs
    )
    assert _claim_counters() == [0, 0]
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
    for launched in (1, 2, 3, parts - 1, 100):  # 100: more blocks than claims (22 at 1024 tokens)
        out = _run_launching(monkeypatch, batch, launched, partition_size=partition_size, build="pipe")
        assert grids[-1] == (launched, kernel + "_loop")
        _assert_same_bits(out, every, f"{launched} blocks a head slot")


@pytest.mark.parametrize(
    "lens, launched",
    [
        ([3000], 1),  # 47 partitions of 64: one block walks all 94 claims
        ([3000], 2),
        ([3000] + [1] * 39, 40),  # the long context's partitions over 40 blocks
        ([5, 400, 2999, 7] * 40, 7),  # 160 sequences: two windows of lengths (128 a window)
        ([0, 6000, 6000, 3, 1500], 3),
        ([5, 0, 17] * 200, 600),  # 1200 claims: a block's second claim skips a whole window of 128
    ],
    ids=["alone-1", "alone-2", "among-39", "rounds", "two-long", "window-jumps"],
)
def test_long_contexts_are_shared_out_with_the_full_grids_bits(monkeypatch, gen, grids, lens, launched):
    batch = _batch(gen, lens=lens)
    every = _run_launching(monkeypatch, batch, None, partition_size=64, build="pipe")
    assert_close(every, batch.reference(), torch.bfloat16)
    out = _run_launching(monkeypatch, batch, launched, partition_size=64, build="pipe")
    assert grids[-1][0] == launched and grids[-1][1].endswith("_loop")
    _assert_same_bits(out, every, f"{launched} launched over {lens[:5]}...")


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
    monkeypatch.setattr(attention_kernels, "_loops", lambda *args: True)
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


def test_the_default_launches_one_wave_over_a_large_capacity(gen, grids, monkeypatch):
    """The policy itself (the default, no patch): 40 sequences over a 6400-token table; the grid
    holds one wave of the _loop kernel's blocks, and the result is the reference's, in a CUDA graph too."""
    monkeypatch.delenv("ZLLM_DECODE_PARTITION_LOOP", raising=False)
    lens = LENS * 5
    batch = _batch(gen, lens=lens)
    heads = batch.query.shape[1]
    device = torch.device(DEVICE)
    assert kernels.attention_partitions(len(lens), heads, 2, 6400, device, block_size=16) == (512, 13)
    expected = batch.reference()
    out = nan_like(batch.query)
    args = (out, batch.query, batch.cache, batch.block_tables, batch.seq_lens_t, batch.scale)
    kernels.paged_attention_decode(*args)
    assert_close(out[1:], expected[1:], torch.bfloat16)
    kernel = grids[-1][1]
    assert kernel == "paged_attention_decode_pipe_bf16_d128_g4_s2_loop"
    resident = resident_blocks("attention_kernels", kernel, device, 128, 4 * 2 * 16 * (2 * 256 + 16))
    assert resident >= 3 and grids[-1][0] == attention_kernels.loop_grid_blocks(device, resident)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.paged_attention_decode(*args)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out[1:], expected[1:], torch.bfloat16)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert _claim_counters() == [0, 0]  # each replay puts the counters back for the next
