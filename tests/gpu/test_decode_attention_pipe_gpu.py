"""The pipelined decode attention build (csrc/attention_pipe.cuh, ZLLM_DECODE_ATTENTION=pipe|pipe3)
against the float64 torch reference, as test_kernels.py checks the classic kernel: batches 1, 8
and 256, contexts on and around tile, block and partition edges (1 ... 3000: several partitions),
GQA groups 1/4/8, head sizes 64/128, fp16/bf16 over a cache of that dtype or FP8, small forced
partitions (the reduce), block sizes 8/16/32, inside a CUDA graph; and the fallback: every call
the build does not cover runs the classic kernel, bit for bit. The cache holds NaN outside the
sequences (PagedBatch), so a copy of a wrong row fails the comparison."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cupy")

from tests.helpers.kernels import DEVICE, PagedBatch, assert_close, nan_like, randn  # noqa: E402
from zllm.workers import kernels  # noqa: E402
from zllm.workers.attention import KVScales, dequantize_kv, quantize_kv  # noqa: E402
from zllm.workers.kernels import attention as attention_kernels  # noqa: E402

pytestmark = pytest.mark.gpu

BUILDS = ["pipe", "pipe3"]
CONTEXTS = [1, 15, 16, 17, 400, 513, 1024, 3000]
HALF = [torch.float16, torch.bfloat16]
HALF_IDS = ["f16", "bf16"]


@pytest.fixture
def launched(monkeypatch) -> list[str]:
    """The names of the kernels paged_attention_decode launches."""
    names: list[str] = []
    real = attention_kernels.launch

    def record(module, kernel, *args, **kwargs):
        names.append(kernel)
        return real(module, kernel, *args, **kwargs)

    monkeypatch.setattr(attention_kernels, "launch", record)
    return names


def _pipe_ran(names: list[str], stages: int) -> bool:
    """Only the pipelined build ran (the _loop entry points where fewer partitions launched)."""
    decode = [n for n in names if n.startswith("paged_attention_decode")]
    return bool(decode) and all(
        n.startswith("paged_attention_decode_pipe_") and n.removesuffix("_loop").endswith(f"_s{stages}") for n in decode
    )


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_pipe_batches_1_and_8(build, dtype, head_dim, group, gen, launched):
    """Every context alone (batch 1) and all together (batch 8), the grid sized by the block
    table's capacity (partition 512: up to 6 partitions) and by the longest context."""
    batch = PagedBatch(
        CONTEXTS, num_heads=2 * group, kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype, gen=gen
    )
    expected = batch.reference()
    assert_close(batch.run(build=build), expected, dtype)
    assert_close(batch.run(build=build, max_seq_len=max(CONTEXTS)), expected, dtype)
    for i in range(len(CONTEXTS)):
        out = nan_like(batch.query[i : i + 1])
        kernels.paged_attention_decode(
            out,
            batch.query[i : i + 1],
            batch.cache,
            batch.block_tables[i : i + 1],
            batch.seq_lens_t[i : i + 1],
            batch.scale,
            build=build,
        )
        assert_close(out, expected[i : i + 1], dtype)
    assert _pipe_ran(launched, attention_kernels._PIPE_STAGES[build])


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_pipe_batch_256_llama_shape(build, dtype, gen, launched):
    """W1's shape: 32 query heads over 8 KV heads, head_dim 128, 256 sequences of every context
    (1024-token partitions on an H100 or H200, ZLLM_DECODE_WIDE_PARTITIONS)."""
    lens = [CONTEXTS[i % len(CONTEXTS)] for i in range(256)]
    batch = PagedBatch(lens, num_heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=dtype, gen=gen)
    expected = batch.reference()
    wide, parts = kernels.attention_partitions(256, 32, 8, max(lens), torch.device(DEVICE), block_size=16)
    assert (wide, parts) == (1024, 3), "the default's 1024-token partitions, reduced, run here"
    assert_close(batch.run(build=build), expected, dtype)
    classic = batch.run(build="classic").clone()
    assert_close(batch.run(build=build), classic, dtype)  # the two builds agree to rounding
    assert _pipe_ran(
        [n for n in launched if n.startswith("paged_attention_decode_pipe")], attention_kernels._PIPE_STAGES[build]
    )


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("partition_size", [32, 64, 96])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_pipe_small_partitions_and_block_sizes(build, partition_size, block_size, gen, launched):
    """Partitions that start inside a block, tiles that straddle blocks, many partitions reduced."""
    lens = [1, 31, 32, 33, 64, 65, 96, 97, 200, 700]
    batch = PagedBatch(
        lens, num_heads=8, kv_heads=2, head_dim=128, block_size=block_size, dtype=torch.bfloat16, gen=gen
    )
    expected = batch.reference()
    assert_close(batch.run(build=build, partition_size=partition_size), expected, torch.bfloat16)
    assert_close(batch.run(build=build, partition_size=partition_size, max_seq_len=700), expected, torch.bfloat16)
    assert _pipe_ran(launched, attention_kernels._PIPE_STAGES[build])


@pytest.mark.parametrize("build", ["classic", "pipe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [5, 6, 8])
def test_tiny_grids_split_groups_of_five_to_eight(build, dtype, group, gen, launched):
    """At most _SPLIT_GROUP_MAX_KV_ROWS sequences x kv heads (2 kv heads: batch 1 to 4), a group
    of 5-8 heads runs as two blocks of 4 (the g4 kernels, the second chunk padded for 5 and 6),
    over the default partitions (64 tokens over a 1024 capacity); past it, one block of 8. fp32
    runs the classic kernel whatever the build."""
    for lens, chunk in (([1], 4), ([300], 4), ([17, 700], 4), ([5, 17, 300, 700], 4), ([1, 5, 17, 300, 700], 8)):
        batch = PagedBatch(lens, num_heads=2 * group, kv_heads=2, head_dim=128, block_size=16, dtype=dtype, gen=gen)
        launched.clear()
        assert_close(batch.run(build=build, max_seq_len=1024), batch.reference(), dtype)
        decode = [n for n in launched if n.startswith("paged_attention_decode")]
        assert decode and all(f"_g{chunk}" in n for n in decode), (lens, decode)


def test_pipe_strided_query_out_and_empty_sequences(gen, launched):
    """q a view of a fused qkv buffer, out of a wider one; empty sequences give zeros."""
    num_heads, kv_heads, head_dim = 8, 2, 128
    batch = PagedBatch(
        [0, 77, 600, 0],
        num_heads=num_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=torch.bfloat16,
        gen=gen,
    )
    width = (num_heads + 2 * kv_heads) * head_dim
    query = randn(4, width, gen=gen, dtype=torch.bfloat16)[:, : num_heads * head_dim].view(4, num_heads, head_dim)
    wide = torch.full((4, 2 * num_heads * head_dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = wide[:, num_heads * head_dim :].view(4, num_heads, head_dim)
    for partition_size in (64, 512):
        batch.run(query=query, out=out, partition_size=partition_size, build="pipe")
        assert_close(out[[1, 2]], batch.reference(query)[[1, 2]], torch.bfloat16)
        assert torch.equal(out[[0, 3]], torch.zeros_like(out[[0, 3]]))
        assert torch.isnan(wide[:, : num_heads * head_dim]).all()
    assert _pipe_ran(launched, 2)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_pipe_over_fp8_cache(build, dtype, head_dim, group, gen, launched):
    scales = KVScales(0.37, 0.05)
    batch = PagedBatch(
        CONTEXTS, num_heads=2 * group, kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype, gen=gen
    )
    # As test_kv_cache_fp8_gpu.py: values ~6 randn (E4M3's range), NaN outside the sequences.
    batch.cache = torch.stack([quantize_kv(batch.cache[i] * 6, s) for i, s in ((0, scales.k), (1, scales.v))])
    clean = [quantize_kv(batch.clean_cache[i] * 6, s) for i, s in ((0, scales.k), (1, scales.v))]
    batch.clean_cache = torch.stack(
        [dequantize_kv(clean[0], scales.k, torch.float64), dequantize_kv(clean[1], scales.v, torch.float64)]
    )
    expected = batch.reference()
    for kwargs in ({}, {"partition_size": 64, "max_seq_len": max(CONTEXTS)}):
        out = kernels.paged_attention_decode(
            nan_like(batch.query),
            batch.query,
            batch.cache,
            batch.block_tables,
            batch.seq_lens_t,
            batch.scale,
            k_scale=scales.k,
            v_scale=scales.v,
            build=build,
            **kwargs,
        )
        assert_close(out, expected, dtype, 1.0)
    assert _pipe_ran(launched, attention_kernels._PIPE_STAGES[build])
    assert all("_kvfp8_" in n for n in launched if n.startswith("paged_attention_decode_pipe"))


@pytest.mark.parametrize("build", BUILDS)
def test_pipe_in_a_cuda_graph(build, gen, launched):
    """Captured once for the table's capacity (3 partitions of 512), replayed over new lengths,
    tables and queries: each replay matches the reference."""
    dtype, num_heads, kv_heads, head_dim, block_size = torch.bfloat16, 32, 8, 128, 16
    batch, max_blocks = 256, 96  # capacity 1536 tokens
    num_blocks = batch * max_blocks + 1
    cache = randn(2, num_blocks, block_size, kv_heads, head_dim, gen=gen, dtype=dtype)
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.ones(batch, dtype=torch.int32, device=DEVICE)
    query = randn(batch, num_heads, head_dim, gen=gen, dtype=dtype)
    out = nan_like(query)
    scale = head_dim**-0.5

    def step() -> None:
        kernels.paged_attention_decode(out, query, cache, tables, seq_lens, scale, build=build)

    def new_inputs() -> None:
        lens = torch.randint(1, max_blocks * block_size + 1, (batch,), generator=gen, device=DEVICE)
        lens[:8] = torch.tensor([1, 15, 16, 17, 400, 513, 1024, 1536])
        pool = torch.randperm(num_blocks, generator=gen, device=DEVICE)[: batch * max_blocks]
        tables.copy_(pool.view(batch, max_blocks).to(torch.int32))
        seq_lens.copy_(lens.to(torch.int32))
        query.copy_(randn(*query.shape, gen=gen, dtype=dtype))

    def reference() -> torch.Tensor:
        k, v = cache[0].view(-1, kv_heads, head_dim), cache[1].view(-1, kv_heads, head_dim)
        group = num_heads // kv_heads
        rows = []
        for i, n in enumerate(seq_lens.tolist()):
            pos = torch.arange(n, device=DEVICE)
            slots = tables[i].long()[pos // block_size] * block_size + pos % block_size
            keys = k[slots].double().repeat_interleave(group, dim=1)  # [n, H, D]
            values = v[slots].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,nhd->hn", query[i].double(), keys) * scale
            rows.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values))
        return torch.stack(rows)

    new_inputs()
    kernels.preload()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: loads the module, opts in to the shared memory, sizes the workspace
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        new_inputs()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, reference(), dtype)
    assert _pipe_ran(launched, attention_kernels._PIPE_STAGES[build])


@pytest.mark.parametrize(
    "case",
    ["f32", "head_dim_96", "head_dim_256", "window", "softcap", "block_size_4_partition_512"],
)
def test_pipe_falls_back_to_classic(case, gen, launched):
    """What the pipelined build does not compile or cover runs the classic kernel: the same bits
    as build="classic", and no _pipe_ kernel launched."""
    dtype = torch.float32 if case == "f32" else torch.bfloat16
    head_dim = {"head_dim_96": 96, "head_dim_256": 256}.get(case, 128)
    block_size = 4 if case.startswith("block_size") else 16
    layer = {"window": {"window": 100}, "softcap": {"softcap": 30.0}}.get(case, {})
    batch = PagedBatch(
        [1, 17, 300, 700], num_heads=8, kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype, gen=gen
    )
    classic = batch.run(build="classic", partition_size=512, **layer).clone()
    pipe = batch.run(build="pipe", partition_size=512, **layer)
    assert torch.equal(pipe, classic)
    assert_close(pipe, batch.reference(**layer), dtype)
    assert not any("_pipe_" in n for n in launched)


def test_setting_selects_the_build(gen, launched, monkeypatch):
    batch = PagedBatch([40, 600], num_heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16, gen=gen)
    monkeypatch.setenv("ZLLM_DECODE_ATTENTION", "pipe3")
    assert_close(batch.run(), batch.reference(), torch.float16)
    assert _pipe_ran(launched, 3)
    launched.clear()
    monkeypatch.setenv("ZLLM_DECODE_ATTENTION", "classic")
    batch.run()
    assert launched and not any("_pipe_" in n for n in launched)
    launched.clear()
    monkeypatch.delenv("ZLLM_DECODE_ATTENTION")
    assert_close(batch.run(), batch.reference(), torch.float16)
    assert _pipe_ran(launched, 2)  # default: pipe
