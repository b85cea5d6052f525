"""The CUDA paths of Gemma 2/3's and Phi-3's variations against the torch references: decode
attention with a sliding window and soft-capped scores (the _win and _cap kernel families, split-K
and inside a CUDA graph), the packed prefill with FlashAttention's window, the per-request path of
capped layers, Gemma's (1 + w) RMSNorm, GeGLU and partial rotary. Tolerances and the NaN-filled
outputs and caches are tests/helpers/kernels.py's (an element read or left unwritten by mistake
fails the comparison)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cupy")

from tests.gpu.test_prefill_attention_gpu import build_step  # noqa: E402
from tests.helpers.kernels import DEVICE, DTYPE_IDS, DTYPES, PagedBatch, assert_close, nan_like, randn  # noqa: E402
from zllm.workers import kernels  # noqa: E402
from zllm.workers.attention import AttentionMetadata, paged_attention, write_kv_cache  # noqa: E402
from zllm.workers.layers import (  # noqa: E402
    apply_rotary,
    gelu_tanh_and_mul,
    rms_norm,
    rope_cos_sin_cache,
    rope_inv_freq,
)
from zllm.workers.ops import CudaOps, flash_varlen_available  # noqa: E402

pytestmark = pytest.mark.gpu

# Contexts shorter than, equal to and longer than the windows below, across block edges.
LENS = [1, 15, 16, 17, 100, 257, 700, 4097]


# ---- decode: window and soft-capping -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("window", [None, 1, 16, 33, 512, 5000])
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["no-cap", "cap"])
def test_decode_window_and_softcap(dtype, window, softcap, gen):
    """Windows of a token, a block, across blocks, of one 512-token partition and longer than every
    context; the grid sized by the block table (as in a graph), by the batch's longest context,
    and cut into 32-token partitions (split-K inside the window)."""
    batch = PagedBatch(LENS, num_heads=8, kv_heads=2, head_dim=128, block_size=16, dtype=dtype, gen=gen)
    batch.query = batch.query * 4  # scores of several units: the cap bends them
    layer = dict(window=window, softcap=softcap)
    expected = batch.reference(**layer)
    assert_close(batch.run(**layer), expected, dtype)
    assert_close(batch.run(max_seq_len=max(LENS), **layer), expected, dtype)
    assert_close(batch.run(partition_size=32, **layer), expected, dtype)
    if window is not None and window < 700 or softcap is not None:  # the variation changes the result
        assert not torch.allclose(expected, batch.reference(), atol=1e-2)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8, 12])
@pytest.mark.parametrize("family", ["win", "cap"])
def test_decode_variant_kernels_over_head_dims_and_groups(head_dim, group, family, gen):
    """Every compiled chunk size (1, 4, 8 query heads a block) of both families."""
    batch = PagedBatch(
        [3, 40, 130, 600],
        num_heads=2 * group,
        kv_heads=2,
        head_dim=head_dim,
        block_size=16,
        dtype=torch.bfloat16,
        gen=gen,
    )
    layer = dict(window=37, softcap=3.0 if family == "cap" else None)
    assert_close(batch.run(**layer), batch.reference(**layer), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [96, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("family", ["plain", "win", "cap"])
def test_decode_head_dims_96_and_256(dtype, head_dim, group, family, gen):
    """Phi-3's head size (each lane's three value dims loaded one by one) and Gemma's (32-byte
    fp32 slices, half the rows in flight), in every family, whole and split into partitions."""
    batch = PagedBatch(
        [1, 17, 100, 700], num_heads=2 * group, kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype, gen=gen
    )
    layer = {"plain": {}, "win": dict(window=90), "cap": dict(window=90, softcap=4.0)}[family]
    expected = batch.reference(**layer)
    assert_close(batch.run(**layer), expected, dtype)
    assert_close(batch.run(partition_size=64, **layer), expected, dtype)


@pytest.mark.parametrize("head_dim", [96, 256])
def test_decode_head_dims_96_and_256_over_fp8_cache(head_dim, gen):
    from zllm.workers.attention import dequantize_kv, quantize_kv

    batch = PagedBatch(LENS, num_heads=8, kv_heads=2, head_dim=head_dim, block_size=16, dtype=torch.bfloat16, gen=gen)
    fp8 = torch.stack([quantize_kv(batch.cache[0], 0.5), quantize_kv(batch.cache[1], 2.0)])
    clean = torch.stack([dequantize_kv(fp8[0], 0.5, torch.float32), dequantize_kv(fp8[1], 2.0, torch.float32)])
    batch.clean_cache, batch.cache = torch.nan_to_num(clean, nan=0.0), fp8
    for layer in ({}, dict(window=100), dict(softcap=4.0)):
        assert_close(batch.run(k_scale=0.5, v_scale=2.0, **layer), batch.reference(**layer), torch.bfloat16)


def test_decode_window_over_fp8_cache(gen):
    """The FP8 cache's _win and _cap kernels: the cache read back as stored times its scale."""
    from zllm.workers.attention import KV_FP8, dequantize_kv, quantize_kv

    batch = PagedBatch(LENS, num_heads=8, kv_heads=2, head_dim=128, block_size=16, dtype=torch.bfloat16, gen=gen)
    k_scale, v_scale = 0.5, 2.0
    fp8 = torch.stack([quantize_kv(batch.cache[0], k_scale), quantize_kv(batch.cache[1], v_scale)])
    assert fp8.dtype == KV_FP8
    clean = torch.stack([dequantize_kv(fp8[0], k_scale, torch.float32), dequantize_kv(fp8[1], v_scale, torch.float32)])
    batch.clean_cache = torch.nan_to_num(clean, nan=0.0)
    batch.cache = fp8
    for layer in (dict(window=100), dict(window=100, softcap=4.0), dict(softcap=4.0)):
        out = batch.run(k_scale=k_scale, v_scale=v_scale, **layer)
        assert_close(out, batch.reference(**layer), torch.bfloat16)


def test_decode_window_and_softcap_rejects_bad_values(gen):
    batch = PagedBatch([5], num_heads=4, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, gen=gen)
    with pytest.raises(ValueError, match="window 0 must be positive"):
        batch.run(window=0)
    with pytest.raises(ValueError, match="softcap -1.0 must be finite and positive"):
        batch.run(softcap=-1.0)


def test_windowed_capped_decode_in_a_cuda_graph(gen):
    """A layer's window and cap are kernel arguments a captured graph holds: replays with new
    lengths (past the window, within it) equal the eager call and the reference."""
    dtype, num_heads, kv_heads, head_dim, block_size = torch.bfloat16, 8, 2, 128, 16
    batch, max_blocks, num_blocks = 4, 128, 600  # capacity 2048 tokens
    cache = randn(2, num_blocks, block_size, kv_heads, head_dim, gen=gen, dtype=dtype)
    query = randn(batch, num_heads, head_dim, gen=gen, dtype=dtype) * 4
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.ones(batch, dtype=torch.int32, device=DEVICE)
    out = nan_like(query)
    layer = dict(window=300, softcap=5.0)
    workspace = torch.empty(
        kernels.attention_workspace_numel(batch, num_heads, head_dim, 16), dtype=torch.float32, device=DEVICE
    )

    def step() -> None:
        kernels.paged_attention_decode(
            out, query, cache, tables, seq_lens, head_dim**-0.5, partition_size=64, workspace=workspace, **layer
        )

    kernels.preload()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: loads the module
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([5, 299, 300, 301], [2048, 1000, 1, 640], [17, 2047, 300, 64]):
        pool = torch.randperm(num_blocks, generator=gen, device=DEVICE).tolist()
        tables.zero_()
        for i, n in enumerate(lens):
            ids = [pool.pop() for _ in range(-(-n // block_size))]
            tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        query.copy_(randn(*query.shape, gen=gen, dtype=dtype) * 4)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        step()
        assert torch.equal(replayed, out)
        meta = AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.long, device=DEVICE),
            block_tables=tables.long(),
            seq_lens=seq_lens.long(),
            seq_lens_list=lens,
            query_start_loc=list(range(batch + 1)),
            num_decodes=batch,
            block_size=block_size,
        )
        expected = paged_attention(query.double(), cache.double(), meta, head_dim**-0.5, **layer)
        assert_close(replayed, expected, dtype)


# ---- prefill: FlashAttention's window, the capped per-request path ---------------------------------------------


PREFILL_STEP = [(7, 1), (130, 1), (1000, 1), (0, 64), (96, 32), (0, 5), (1, 127), (300, 212)]


def _reference(query, clean, meta, scale, **layer):
    ref_meta = AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        block_tables=meta.block_tables.long(),
        seq_lens=meta.seq_lens.long(),
        seq_lens_list=meta.seq_lens_list,
        query_start_loc=meta.query_start_loc,
        num_decodes=meta.num_decodes,
        block_size=meta.block_size,
    )
    return paged_attention(query.double(), clean.double(), ref_meta, scale, **layer)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("window", [1, 16, 100, 4096])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_packed_prefill_window_matches_reference(dtype, window, head_dim):
    """FlashAttention's window_size_left = window - 1, aligned to the bottom right with the causal
    mask, on whole prompts and on chunks after a cached prefix (and the decodes beside them)."""
    if not flash_varlen_available(torch.device(DEVICE)):
        pytest.skip("PyTorch's FlashAttention is not available on this GPU")
    requests = sorted(PREFILL_STEP, key=lambda r: r[1] != 1)
    query, holes, clean, meta = build_step(
        requests, num_heads=8, kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype, qkv_view=True
    )
    scale = head_dim**-0.5
    ops = CudaOps(torch.device(DEVICE))
    assert meta.prefill is not None
    out = ops.attention(query, holes, meta, scale, window=window)
    torch.testing.assert_close(out.double(), _reference(query, clean, meta, scale, window=window), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [None, 50])
def test_capped_layers_take_the_reference_prefill(dtype, window):
    """FlashAttention has no soft-capping: a capped layer's prefills run HF's eager arithmetic
    (the reference's per-request path, in query-row chunks), packed metadata or not."""
    requests = sorted(PREFILL_STEP, key=lambda r: r[1] != 1)
    query, holes, clean, meta = build_step(
        requests, num_heads=8, kv_heads=2, head_dim=128, block_size=16, dtype=dtype, seed=4
    )
    query = query * 4
    scale = 128**-0.5
    ops = CudaOps(torch.device(DEVICE))
    layer = dict(window=window, softcap=5.0)
    out = ops.attention(query, clean, meta, scale, **layer)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), _reference(query, clean, meta, scale, **layer), rtol=tol, atol=tol)


def test_fp32_windowed_prefill_is_the_reference():
    """fp32 (no FlashAttention) prefills of a windowed layer: the reference's masked SDPA."""
    requests = sorted(PREFILL_STEP, key=lambda r: r[1] != 1)
    query, holes, clean, meta = build_step(
        requests, num_heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, seed=6
    )
    meta.prefill = None
    out = CudaOps(torch.device(DEVICE)).attention(query, holes, meta, 0.125, window=40)
    torch.testing.assert_close(out.double(), _reference(query, clean, meta, 0.125, window=40), rtol=1e-5, atol=1e-5)


# ---- Gemma's norm, GeGLU, partial rotary ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [64, 1000, 2304, 3584])
@pytest.mark.parametrize("tokens", [1, 7, 333])
def test_gemma_rms_norm(dtype, hidden, tokens, gen):
    x = randn(tokens, hidden, gen=gen, dtype=dtype) * 3
    weight = randn(hidden, gen=gen, dtype=dtype) * 0.3
    out = nan_like(x)
    kernels.rms_norm(out, x, weight, 1e-6, unit_offset=True)
    expected = rms_norm(x.double(), weight.double(), 1e-6, unit_offset=True)
    assert_close(out, expected, dtype)
    assert not torch.allclose(out.double(), rms_norm(x.double(), weight.double(), 1e-6), atol=0.1)
    residual = randn(tokens, hidden, gen=gen, dtype=dtype)
    expected_residual = residual + x
    kernels.fused_add_rms_norm(x, residual, weight, 1e-6, unit_offset=True)
    assert torch.equal(residual, expected_residual)
    assert_close(x, rms_norm(expected_residual.double(), weight.double(), 1e-6, unit_offset=True), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("size", [7, 1001, 9216])
@pytest.mark.parametrize("tokens", [1, 333])
def test_gelu_tanh_and_mul(dtype, size, tokens, gen):
    x = randn(tokens, 2 * size, gen=gen, dtype=dtype) * 3
    out = torch.full((tokens, size), float("nan"), dtype=dtype, device=DEVICE)
    kernels.gelu_tanh_and_mul(out, x)
    assert_close(out, gelu_tanh_and_mul(x.double()), dtype)
    wide = randn(9, 2 * 512 + 5, gen=gen, dtype=dtype)  # strided rows
    out = torch.full((9, 512), float("nan"), dtype=dtype, device=DEVICE)
    kernels.gelu_tanh_and_mul(out, wide[:, : 2 * 512])
    assert_close(out, gelu_tanh_and_mul(wide[:, : 2 * 512].double()), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dims", [(128, 96), (96, 96), (128, 64), (64, 16)], ids=lambda d: "d{}_r{}".format(*d))
def test_partial_rotary_and_cache(dtype, dims, gen):
    """Rotary over the first R dims of each head (Phi-4-mini: 96 of 128), the rest passed through,
    in both kernels; the fused one stores the rotated keys and the values at their slots."""
    head_dim, rot_dim = dims
    num_heads, kv_heads, tokens, block_size, num_blocks, max_pos = 8, 2, 37, 16, 16, 4096
    cos, sin = (t.to(DEVICE) for t in rope_cos_sin_cache(rope_inv_freq(rot_dim, 10000.0, {}), max_pos, 1.19))
    positions = torch.randint(0, max_pos, (tokens,), generator=gen, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:tokens]
    slots[3] = -1  # padding
    qkv = randn(tokens, (num_heads + 2 * kv_heads) * head_dim, gen=gen, dtype=dtype)
    cache = randn(2, num_blocks, block_size, kv_heads, head_dim, gen=gen, dtype=dtype)

    def views(buffer):
        q, k, v = buffer.split([num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return (
            q.view(tokens, num_heads, head_dim),
            k.view(tokens, kv_heads, head_dim),
            v.view(tokens, kv_heads, head_dim),
        )

    q0, k0, v0 = views(qkv)
    expected_q = apply_rotary(q0.double(), cos[positions], sin[positions])
    expected_k = apply_rotary(k0.double(), cos[positions], sin[positions])
    fused = qkv.clone()
    q, k, v = views(fused)
    out_cache = cache.clone()
    kernels.rotary_embedding_and_cache(positions, q, k, v, cos, sin, out_cache, slots)
    assert_close(q, expected_q, dtype)
    assert_close(k, expected_k, dtype)
    assert torch.equal(q[..., rot_dim:], q0[..., rot_dim:]) and torch.equal(v, v0)
    expected_cache = cache.double().clone()
    keep = slots >= 0
    write_kv_cache(expected_cache, k.double()[keep], v0.double()[keep], slots[keep])
    assert torch.equal(out_cache.double(), expected_cache)  # stores copy the rotated values exactly
    alone = qkv.clone()
    q2, k2, _ = views(alone)
    kernels.rotary_embedding(positions, q2, k2, cos, sin)
    assert torch.equal(alone, fused)
