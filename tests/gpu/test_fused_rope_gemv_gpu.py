"""The q/k/v GEMVs with rotary and the KV cache write in their epilogue (csrc/gemv_kernels.cu
gemv_fp8_<T>_rope_cache[_kvfp8], gemv_<T>_s<S>_b6_rope_cache[_kvfp8]; ZLLM_FUSED_ROPE_GEMV):
the product (q and k rotated) and the whole cache are bit for bit what the default GEMV build
then rotary_embedding_and_cache leave, for dense and FP8 weights, caches of the model dtype and
FP8, with and without bias, a position past the cos/sin table (nothing rotated) and a padding
slot (nothing stored); eager and in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from zllm.workers import kernels, ops
from zllm.workers.attention import KV_FP8
from zllm.workers.fp8 import fp8_linear_rope_cache, quantize_rows
from zllm.workers.kernels import RopeCache, matvec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not kernels.is_available(), reason="needs a CUDA GPU and CuPy")]

# (q heads, kv heads, head_dim, K): Llama-3-8B (its K takes the dense build's 2 warps a row),
# 70B at tp 4 (4 warps a row), a small model (1 warp a row; K not a whole round).
GEOMETRIES = [(32, 8, 128, 4096), (16, 2, 128, 8192), (4, 2, 64, 16 * 37)]
MAX_POS, BLOCKS, BLOCK_SIZE = 64, 6, 16


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == KV_FP8:
        return t.view(torch.uint8)
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _cos_sin(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    angles = torch.arange(MAX_POS, device="cuda").float()[:, None] * inv_freq[None, :]
    return angles.cos().contiguous(), angles.sin().contiguous()


def _case(geometry, dtype, cache_dtype, bias, fp8, seed):
    heads, kv_heads, head_dim, k = geometry
    n = (heads + 2 * kv_heads) * head_dim
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, generator=g, device="cuda") * 0.05
    weights = quantize_rows(w) if fp8 else (w.to(dtype), None)
    x = torch.randn(1, k, generator=g, device="cuda").to(dtype)
    b = (torch.randn(n, generator=g, device="cuda") * 0.5).to(dtype) if bias else None
    cache = torch.randn(2, BLOCKS, BLOCK_SIZE, kv_heads, head_dim, generator=g, device="cuda").to(cache_dtype)
    return x, weights, b, cache


def _unfused(x, weights, bias, cache, rope: RopeCache, heads: int):
    """The two kernels a step runs without the switch: the default GEMV, then rotary + cache."""
    w, scale = weights
    n = w.shape[0]
    out = torch.empty(1, n, dtype=x.dtype, device="cuda")
    if scale is None:
        kernels.gemv(out, x, w, bias, variant="b6")
    else:
        kernels.fp8_gemv(out, x, w, scale.contiguous(), bias, variant="" if x.dtype == torch.bfloat16 else None)
    kv_heads, head_dim = cache.shape[3], cache.shape[4]
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q, k, v = out.split([q_size, kv_size, kv_size], dim=-1)
    kernels.rotary_embedding_and_cache(
        rope.positions,
        q.view(1, heads, head_dim),
        k.view(1, kv_heads, head_dim),
        v.view(1, kv_heads, head_dim),
        rope.cos,
        rope.sin,
        cache,
        rope.slot_mapping,
        rope.k_scale,
        rope.v_scale,
    )
    return out


def _fused(x, weights, bias, rope: RopeCache):
    w, scale = weights
    out = torch.full((1, w.shape[0]), float("nan"), dtype=x.dtype, device="cuda")
    if scale is None:
        return kernels.gemv_rope_cache(out, x, w, bias, rope)
    return kernels.fp8_gemv_rope_cache(out, x, w, scale.contiguous(), bias, rope)


CACHES = {"model": None, "fp8": KV_FP8}


@pytest.mark.parametrize(
    ("position", "slot"),
    [(37, 21), (MAX_POS, 5), (-1, 6), (3, -1), (4, BLOCKS * BLOCK_SIZE)],
    ids=["in", "past_table", "negative", "padding", "past_cache"],
)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("cache", sorted(CACHES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8", [False, True], ids=["dense", "fp8"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[f"h{g[0]}kv{g[1]}d{g[2]}k{g[3]}" for g in GEOMETRIES])
def test_fused_rope_gemv_equals_the_two_kernels_bit_for_bit(geometry, fp8, dtype, cache, bias, position, slot):
    heads, _, head_dim, _ = geometry
    cache_dtype = CACHES[cache] or dtype
    x, weights, b, kv_cache = _case(geometry, dtype, cache_dtype, bias, fp8, seed=position + 7 * slot)
    cos, sin = _cos_sin(head_dim)
    positions = torch.tensor([position], device="cuda", dtype=torch.int64)
    slots = torch.tensor([slot], device="cuda", dtype=torch.int64)
    scales = (0.75, 1.5) if cache == "fp8" else (1.0, 1.0)
    fused_cache = kv_cache.clone()
    fused = _fused(x, weights, b, RopeCache(positions, cos, sin, fused_cache, slots, heads, *scales))
    expected = _unfused(x, weights, b, kv_cache, RopeCache(positions, cos, sin, kv_cache, slots, heads, *scales), heads)
    assert not expected.float().isnan().any()
    assert torch.equal(_bits(fused), _bits(expected))
    assert torch.equal(_bits(fused_cache), _bits(kv_cache))
    if 0 <= slot < BLOCKS * BLOCK_SIZE:  # the token's slot was written (k rotated at positions in the table)
        assert not torch.equal(
            _bits(fused_cache), _bits(_case(geometry, dtype, cache_dtype, bias, fp8, seed=position + 7 * slot)[3])
        )


@pytest.mark.parametrize("fp8", [False, True], ids=["dense", "fp8"])
def test_fused_rope_gemv_replays_in_a_cuda_graph(fp8):
    geometry = GEOMETRIES[0]
    heads, _, head_dim, k = geometry
    x, weights, _, kv_cache = _case(geometry, torch.bfloat16, torch.bfloat16, False, fp8, seed=3)
    cos, sin = _cos_sin(head_dim)
    positions = torch.tensor([5], device="cuda", dtype=torch.int64)
    slots = torch.tensor([9], device="cuda", dtype=torch.int64)
    graph_cache = kv_cache.clone()
    rope = RopeCache(positions, cos, sin, graph_cache, slots, heads)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        _fused(x, weights, None, rope)  # loads the module outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = _fused(x, weights, None, rope)
    x.copy_(torch.randn(1, k, device="cuda").to(torch.bfloat16))
    positions.fill_(41)
    slots.fill_(30)
    graph.replay()
    torch.cuda.synchronize()
    expected = _unfused(x, weights, None, kv_cache, RopeCache(positions, cos, sin, kv_cache, slots, heads), heads)
    assert torch.equal(_bits(out), _bits(expected))
    assert torch.equal(_bits(graph_cache[:, 1, 14]), _bits(kv_cache[:, 1, 14]))  # slot 30


def test_the_layer_entry_points_follow_the_switch_and_refuse_partial_rotary(monkeypatch):
    monkeypatch.setattr(matvec, "FP8_GEMV_VARIANT", "")  # the defaults, whatever the environment says
    monkeypatch.setattr(matvec, "FP8_GEMV_WIDE", None)
    monkeypatch.setattr(matvec, "GEMV_BOUND", "b6")
    heads, kv_heads, head_dim, k = GEOMETRIES[2]
    positions = torch.tensor([3], device="cuda", dtype=torch.int64)
    slots = torch.tensor([2], device="cuda", dtype=torch.int64)
    cos, sin = _cos_sin(head_dim)
    for fp8 in (False, True):
        x, weights, _, kv_cache = _case(GEOMETRIES[2], torch.bfloat16, torch.bfloat16, False, fp8, seed=1)
        rope = RopeCache(positions, cos, sin, kv_cache, slots, heads)
        partial = RopeCache(positions, cos[:, :16].contiguous(), sin[:, :16].contiguous(), kv_cache, slots, heads)

        def call(r):
            if fp8:
                return fp8_linear_rope_cache(x, weights[0], weights[1].contiguous(), False, None, r)
            return ops.linear_rope_cache(x, weights[0], None, r)

        monkeypatch.setenv("ZLLM_FUSED_ROPE_GEMV", "1")
        assert call(rope) is not None
        assert call(partial) is None
        monkeypatch.setenv("ZLLM_FUSED_ROPE_GEMV", "0")
        assert call(rope) is None
    with pytest.raises(ValueError, match="full rotary"):
        x, weights, _, kv_cache = _case(GEOMETRIES[2], torch.bfloat16, torch.bfloat16, False, False, seed=1)
        out = torch.empty(1, weights[0].shape[0], dtype=torch.bfloat16, device="cuda")
        kernels.gemv_rope_cache(
            out, x, weights[0], None, RopeCache(positions, cos[:, :16], sin[:, :16], kv_cache, slots, heads)
        )
    monkeypatch.setenv("ZLLM_FUSED_ROPE_GEMV", "1")
    x, weights, _, kv_cache = _case(GEOMETRIES[2], torch.bfloat16, torch.bfloat16, False, False, seed=1)
    rope = RopeCache(positions, cos, sin, kv_cache, slots, heads)
    monkeypatch.setattr(matvec, "GEMV_BOUND", "b4")  # another dense build: the two kernels
    assert ops.linear_rope_cache(x, weights[0], None, rope) is None
    monkeypatch.setattr(matvec, "GEMV_BOUND", "b6")
    fp8_x, (q, scale), _, _ = _case(GEOMETRIES[2], torch.bfloat16, torch.bfloat16, False, True, seed=1)
    monkeypatch.setattr(matvec, "FP8_GEMV_VARIANT", "_split")  # another FP8 build: the two kernels
    assert fp8_linear_rope_cache(fp8_x, q, scale.contiguous(), False, None, rope) is None
    monkeypatch.setattr(matvec, "FP8_GEMV_VARIANT", "")
    half_cache = RopeCache(positions, cos, sin, kv_cache.half(), slots, heads)  # not the model dtype, not FP8
    assert ops.linear_rope_cache(x, weights[0], None, half_cache) is None
