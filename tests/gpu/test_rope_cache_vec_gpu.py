"""rotary_embedding_and_cache's vectorized kernel (16-byte accesses, ZLLM_ROPE_VEC) against its
scalar kernel: the same bits in q, k and the cache, over the shapes the engine passes (q, k and v
as strided views of one qkv projection), both cache dtypes, padding slots and positions out of
range; and the shapes it cannot take fall back to the scalar kernel, still correct."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cupy")

from tests.helpers.kernels import DEVICE, assert_close, randn  # noqa: E402
from zllm.workers import kernels  # noqa: E402
from zllm.workers.attention import KV_FP8, KVScales  # noqa: E402
from zllm.workers.kernels import pos_encoding  # noqa: E402
from zllm.workers.layers import apply_rotary, rope_cos_sin_cache, rope_inv_freq  # noqa: E402

pytestmark = pytest.mark.gpu

MAX_POS = 4096


@pytest.fixture
def launched(monkeypatch) -> list[str]:
    """The entry points pos_encoding launches, in order."""
    names: list[str] = []
    launch = pos_encoding.launch

    def recorded(file, name, *args, **kwargs):
        names.append(name)
        return launch(file, name, *args, **kwargs)

    monkeypatch.setattr(pos_encoding, "launch", recorded)
    return names


def _case(gen, dtype, tokens, num_heads, kv_heads, head_dim, cache_dtype, rot_dim=None, pad=0):
    """Inputs as the engine has them: q, k, v views of one [tokens, (H + 2 KVH) * D (+ pad)] buffer;
    a padding slot and a position past the table when there are tokens enough."""
    rot_dim = rot_dim or head_dim
    cos, sin = (t.to(DEVICE) for t in rope_cos_sin_cache(rope_inv_freq(rot_dim, 500000.0, {}), MAX_POS))
    block_size, num_blocks = 16, max(8, -(-tokens // 16) * 2)
    positions = torch.randint(0, MAX_POS, (tokens,), generator=gen, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:tokens]
    if tokens > 2:
        slots[1] = -1  # padding: nothing stored
        positions[2] = MAX_POS  # out of range: stored unrotated
    qkv = randn(tokens, (num_heads + 2 * kv_heads) * head_dim + pad, gen=gen, dtype=dtype) * 4
    if cache_dtype == "fp8":
        cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=KV_FP8, device=DEVICE)
    else:
        cache = randn(2, num_blocks, block_size, kv_heads, head_dim, gen=gen, dtype=dtype)
    return positions, slots, qkv, cache, cos, sin


def _views(buffer, num_heads, kv_heads, head_dim):
    tokens = buffer.shape[0]
    q = buffer[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = buffer[:, num_heads * head_dim : (num_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = buffer[:, (num_heads + kv_heads) * head_dim : (num_heads + 2 * kv_heads) * head_dim]
    return q, k, v.view(tokens, kv_heads, head_dim)


def _run(vectorized, positions, slots, qkv, cache, cos, sin, heads, head_dim, scales):
    buffer, out_cache = qkv.clone(), cache.clone()
    q, k, v = _views(buffer, *heads, head_dim)
    kernels.rotary_embedding_and_cache(
        positions, q, k, v, cos, sin, out_cache, slots, scales.k, scales.v, vectorized=vectorized
    )
    return buffer, out_cache


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("cache_dtype", ["model", "fp8"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("heads", [(32, 8), (8, 8), (4, 1)], ids=["gqa4", "mha", "mqa"])
@pytest.mark.parametrize("tokens", [1, 7, 333, 4099])
def test_vectorized_kernel_gives_the_scalar_kernels_bits(dtype, cache_dtype, head_dim, heads, tokens, gen, launched):
    scales = KVScales(0.37, 0.05) if cache_dtype == "fp8" else KVScales()
    case = _case(gen, dtype, tokens, *heads, head_dim, cache_dtype)
    positions, slots, qkv, cache, cos, sin = case
    vec_qkv, vec_cache = _run(True, *case, heads, head_dim, scales)
    scalar_qkv, scalar_cache = _run(False, *case, heads, head_dim, scales)
    suffix = "_kvfp8" if cache_dtype == "fp8" else ""
    dt = "f16" if dtype == torch.float16 else "bf16"
    assert launched == [f"rotary_embedding_and_cache_vec_{dt}{suffix}", f"rotary_embedding_and_cache_{dt}{suffix}"]
    assert torch.equal(vec_qkv, scalar_qkv)
    assert torch.equal(vec_cache.view(torch.uint8), scalar_cache.view(torch.uint8))
    # And against the float64 reference: q rotated where the position is in range, v untouched.
    q0, _, v0 = _views(qkv, *heads, head_dim)
    q, _, v = _views(vec_qkv, *heads, head_dim)
    valid = (positions < MAX_POS).view(-1, 1, 1)
    clamped = positions.clamp(max=MAX_POS - 1)
    expected_q = torch.where(valid, apply_rotary(q0.double(), cos[clamped], sin[clamped]), q0.double())
    assert_close(q, expected_q, dtype)
    assert torch.equal(v, v0)


@pytest.mark.parametrize(
    "shape",
    [
        dict(dtype=torch.float32, head_dim=128),  # 4-byte elements: scalar
        dict(dtype=torch.bfloat16, head_dim=128, rot_dim=64),  # partial rotary: scalar
        dict(dtype=torch.bfloat16, head_dim=72),  # 36 pairs: not groups of eight
        dict(dtype=torch.bfloat16, head_dim=128, pad=4),  # token stride not a multiple of 8 elements
    ],
    ids=["f32", "partial", "d72", "stride"],
)
def test_shapes_the_vectorized_kernel_cannot_take_run_the_scalar_one(shape, gen, launched):
    dtype, head_dim = shape["dtype"], shape["head_dim"]
    heads = (8, 2)
    case = _case(gen, dtype, 37, *heads, head_dim, "model", rot_dim=shape.get("rot_dim"), pad=shape.get("pad", 0))
    positions, slots, qkv, cache, cos, sin = case
    vec_qkv, vec_cache = _run(True, *case, heads, head_dim, KVScales())
    scalar_qkv, scalar_cache = _run(False, *case, heads, head_dim, KVScales())
    assert all("_vec_" not in name for name in launched), launched
    assert len(launched) == 2
    assert torch.equal(vec_qkv, scalar_qkv) and torch.equal(vec_cache, scalar_cache)


def test_the_switch_and_the_token_count_pick_the_default(gen, launched, monkeypatch):
    heads, head_dim = (8, 2), 128
    many = _case(gen, torch.bfloat16, pos_encoding.VEC_MIN_TOKENS, *heads, head_dim, "model")
    few = _case(gen, torch.bfloat16, pos_encoding.VEC_MIN_TOKENS - 1, *heads, head_dim, "model")
    for enabled in (True, False):
        monkeypatch.setattr(pos_encoding, "ROPE_VEC_ENABLED", enabled)
        _run(None, *many, heads, head_dim, KVScales())
        _run(None, *few, heads, head_dim, KVScales())
    vec, scalar = "rotary_embedding_and_cache_vec_bf16", "rotary_embedding_and_cache_bf16"
    assert launched == [vec, scalar, scalar, scalar]


def test_vectorized_kernel_replays_in_a_cuda_graph(gen):
    heads, head_dim = (32, 8), 128
    positions, slots, qkv, cache, cos, sin = _case(gen, torch.bfloat16, 64, *heads, head_dim, "model")
    expected_qkv, expected_cache = _run(True, positions, slots, qkv, cache, cos, sin, heads, head_dim, KVScales())
    buffer, out_cache = qkv.clone(), cache.clone()
    q, k, v = _views(buffer, *heads, head_dim)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm (loads the module) off the capture
        kernels.rotary_embedding_and_cache(positions, q, k, v, cos, sin, out_cache, slots, vectorized=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.rotary_embedding_and_cache(positions, q, k, v, cos, sin, out_cache, slots, vectorized=True)
    buffer.copy_(qkv)
    out_cache.copy_(cache)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(buffer, expected_qkv) and torch.equal(out_cache, expected_cache)
