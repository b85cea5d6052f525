"""The norm-carrying decode step's GEMVs (csrc/gemv_kernels.cu kAdd, kNorm; ZLLM_NORM_GEMV):
gemv_add is the b6 GEMV then the residual add, bit for bit; the _norm builds of the gate_up +
activation and q/k/v + rotary + cache GEMVs, over weights with the norm's weight folded in,
match a float64 reference of their product and are as near the unfolded, unfused kernels'
truth as those kernels are (not their bits: the fold rounds w * gamma, the norm's two roundings
are skipped); all of them in a CUDA graph; and a batch-1 decode of bf16 and fp16 models with
the step on against off."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_fused_act_gemv_gpu import _record_launches
from tests.helpers.engine import batch_one_decode
from zllm.workers import kernels, ops
from zllm.workers.attention import KV_FP8
from zllm.workers.kernels import RopeCache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not kernels.is_available(), reason="needs a CUDA GPU and CuPy")]

DTYPES = [torch.bfloat16, torch.float16]
EPS = 1e-5
TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}
# (N, K): 70B tp 4's o and down, Llama-3-8B's down (K past 4 rounds), a small model, odd N and
# K not a whole round (the split kernel's masked last round).
ADD_SHAPES = [(8192, 2048), (8192, 7168), (4096, 14336), (576, 1536), (3, 272), (515, 16 * 37), (33, 8200)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == KV_FP8 else t.view(torch.int16)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), ADD_SHAPES, ids=[f"{n}x{k}" for n, k in ADD_SHAPES])
def test_gemv_add_is_the_gemv_then_the_add_bit_for_bit(n, k, dtype, bias):
    g = _gen(n + k)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.05).to(dtype)
    x = torch.randn(1, k, generator=g, device="cuda").to(dtype)
    residual = (torch.randn(1, n, generator=g, device="cuda") * 4).to(dtype)
    b = (torch.randn(n, generator=g, device="cuda") * 0.5).to(dtype) if bias else None
    out = torch.full((1, n), float("nan"), dtype=dtype, device="cuda")
    kernels.gemv_add(out, x, w, b, residual)
    product = torch.empty(1, n, dtype=dtype, device="cuda")
    kernels.gemv(product, x, w, b, variant="b6")
    expected = product + residual  # one rounding of the exact sum of two dtype values
    assert not expected.isnan().any()
    assert torch.equal(_bits(out), _bits(expected))


def _stream_and_norm(k: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual stream row (large, like a deep layer's) and an RMSNorm weight near 1."""
    x = (torch.randn(1, k, generator=g, device="cuda") * 6).to(dtype)
    gamma = (1 + 0.2 * torch.randn(k, generator=g, device="cuda")).to(dtype)
    return x, gamma


def _normed_product(x, gamma, w, bias) -> torch.Tensor:
    """rms_norm(x, gamma) @ w^T (+ bias) in float64, no rounding in between (gamma None: 1)."""
    xf = x.double()
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    h = xf * inv_rms if gamma is None else xf * inv_rms * gamma.double()
    y = h @ w.double().t()
    return y if bias is None else y + bias.double()


def _folded(w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """w's columns times the norm's weight, rounded once (ColumnParallelLinear.fold_norm)."""
    return w * gamma


# (d, K): 70B tp 4's gate_up (4 warps a row), Llama-3-8B's (2), a small model (1), d not a
# multiple of a block's pairs, K not a whole round.
ACT_SHAPES = [(7168, 8192), (14336, 4096), (1030, 576), (3, 272), (515, 16 * 37), (33, 8200)]


@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("d", "k"), ACT_SHAPES, ids=[f"{d}x{k}" for d, k in ACT_SHAPES])
def test_act_and_mul_norm_is_silu_and_mul_of_the_normed_product(d, k, dtype, bias):
    g = _gen(3 * d + k)
    x, gamma = _stream_and_norm(k, dtype, g)
    w = (torch.randn(2 * d, k, generator=g, device="cuda") * 0.05).to(dtype)
    b = (torch.randn(2 * d, generator=g, device="cuda") * 0.5).to(dtype) if bias else None
    fused = torch.full((1, d), float("nan"), dtype=dtype, device="cuda")
    kernels.gemv_act_and_mul(fused, x, _folded(w, gamma), b, norm_eps=EPS)

    def silu_and_mul(gate_up):
        return torch.nn.functional.silu(gate_up[:, :d]) * gate_up[:, d:]

    reference = silu_and_mul(_normed_product(x, None, _folded(w, gamma), b))
    tol = TOL[dtype]
    torch.testing.assert_close(fused.double(), reference, rtol=tol, atol=tol * reference.abs().max().item())
    # and as near the truth (unfolded, unrounded) as the unfused kernels are: the norm kernel
    # with gamma, then the fused act GEMV over w
    truth = silu_and_mul(_normed_product(x, gamma, w, b))
    normed = torch.empty_like(x)
    kernels.rms_norm(normed, x, gamma, EPS)
    unfused = torch.empty_like(fused)
    kernels.gemv_act_and_mul(unfused, normed, w, b)
    fused_error = (fused.double() - truth).abs().mean().item()
    unfused_error = (unfused.double() - truth).abs().mean().item()
    assert fused_error <= 1.5 * unfused_error + 1e-6, (fused_error, unfused_error)


GEOMETRIES = [(16, 2, 128, 8192), (32, 8, 128, 4096), (4, 2, 64, 16 * 37)]  # (heads, kv heads, head_dim, K)
MAX_POS, BLOCKS, BLOCK_SIZE = 64, 6, 16


def _cos_sin(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    angles = torch.arange(MAX_POS, device="cuda").float()[:, None] * inv_freq[None, :]
    return angles.cos().contiguous(), angles.sin().contiguous()


@pytest.mark.parametrize("cache", ["model", "fp8"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[f"h{g[0]}kv{g[1]}d{g[2]}k{g[3]}" for g in GEOMETRIES])
def test_rope_cache_norm_rotates_and_stores_the_normed_product(geometry, dtype, bias, cache):
    heads, kv_heads, head_dim, k = geometry
    n = (heads + 2 * kv_heads) * head_dim
    g = _gen(heads + k)
    x, gamma = _stream_and_norm(k, dtype, g)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.05).to(dtype)
    b = (torch.randn(n, generator=g, device="cuda") * 0.5).to(dtype) if bias else None
    cache_dtype = KV_FP8 if cache == "fp8" else dtype
    kv_cache = torch.randn(2, BLOCKS, BLOCK_SIZE, kv_heads, head_dim, generator=g, device="cuda").to(cache_dtype)
    cos, sin = _cos_sin(head_dim)
    positions = torch.tensor([37], device="cuda", dtype=torch.int64)
    slots = torch.tensor([21], device="cuda", dtype=torch.int64)
    scales = (0.75, 1.5) if cache == "fp8" else (1.0, 1.0)
    fused_cache = kv_cache.clone()
    fused = torch.full((1, n), float("nan"), dtype=dtype, device="cuda")
    rope = RopeCache(positions, cos, sin, fused_cache, slots, heads, *scales)
    kernels.gemv_rope_cache(fused, x, _folded(w, gamma), b, rope, norm_eps=EPS)
    # The reference: the float64 product rounded once, then the rotary + cache kernel.
    expected = _normed_product(x, None, _folded(w, gamma), b).to(dtype)
    q, kk, v = expected.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    kernels.rotary_embedding_and_cache(
        positions,
        q.view(1, heads, head_dim),
        kk.view(1, kv_heads, head_dim),
        v.view(1, kv_heads, head_dim),
        cos,
        sin,
        kv_cache,
        slots,
        *scales,
    )
    tol = TOL[dtype]
    scale = expected.double().abs().max().item()
    torch.testing.assert_close(fused.double(), expected.double(), rtol=tol, atol=tol * scale)
    cache_tol = 0.13 if cache == "fp8" else tol  # E4M3: 3 mantissa bits
    written = kv_cache[:, 21 // BLOCK_SIZE, 21 % BLOCK_SIZE].double()
    torch.testing.assert_close(
        fused_cache[:, 21 // BLOCK_SIZE, 21 % BLOCK_SIZE].double(),
        written,
        rtol=cache_tol,
        atol=cache_tol * written.abs().max().item(),
    )
    untouched = torch.ones(BLOCKS * BLOCK_SIZE, dtype=torch.bool, device="cuda")
    untouched[21] = False
    flat = (c.view(2, BLOCKS * BLOCK_SIZE, kv_heads, head_dim) for c in (fused_cache, kv_cache))
    before, after = next(flat), next(flat)
    assert torch.equal(_bits(before[:, untouched]), _bits(after[:, untouched]))  # no other slot written


def test_the_three_builds_replay_in_a_cuda_graph():
    dtype, k, d = torch.bfloat16, 8192, 1024
    g = _gen(11)
    x, gamma = _stream_and_norm(k, dtype, g)
    w_up = _folded((torch.randn(2 * d, k, generator=g, device="cuda") * 0.05).to(dtype), gamma)
    w_down = (torch.randn(k, d, generator=g, device="cuda") * 0.05).to(dtype)
    act = torch.empty(1, d, dtype=dtype, device="cuda")
    stream_out = torch.empty(1, k, dtype=dtype, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()

    def step():
        kernels.gemv_act_and_mul(act, x, w_up, norm_eps=EPS)
        kernels.gemv_add(stream_out, act, w_down, None, x)

    with torch.cuda.stream(side):
        step()  # loads the module outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            step()
    x.copy_(_stream_and_norm(k, dtype, _gen(12))[0])
    graph.replay()
    torch.cuda.synchronize()
    expected_act = torch.empty_like(act)
    kernels.gemv_act_and_mul(expected_act, x, w_up, norm_eps=EPS)
    expected = torch.empty_like(stream_out)
    kernels.gemv_add(expected, expected_act, w_down, None, x)
    assert torch.equal(_bits(act), _bits(expected_act))
    assert torch.equal(_bits(stream_out), _bits(expected))


def test_the_wrappers_refuse_what_they_do_not_take():
    x = torch.randn(1, 256, device="cuda").to(torch.bfloat16)
    w = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
    out = torch.empty(1, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="must not be add"):
        kernels.gemv_add(out, x, w, None, out)
    with pytest.raises(ValueError, match="add must be"):
        kernels.gemv_add(out, x, w, None, torch.zeros(1, 63, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="fp16 and bf16"):
        kernels.gemv_add(out.float(), x.float(), w.float(), None, torch.zeros(1, 64, device="cuda"))
    half = torch.empty(1, 32, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="fp16 and bf16"):
        kernels.gemv_act_and_mul(half.float(), x.float(), w.float(), norm_eps=EPS)
    with pytest.raises(ValueError, match="silu only"):
        kernels.gemv_act_and_mul(half, x, w, gelu=True, norm_eps=EPS)
    with pytest.raises(ValueError, match="norm_eps"):
        kernels.gemv_act_and_mul(half, x, w, norm_eps=float("nan"))
    # the layer entry points hand back None (the caller's unfused ops) where the builds do not take it
    assert ops.linear_add(x.float(), w.float(), None, torch.zeros(1, 64, device="cuda")) is None
    assert ops.linear_add(torch.cat([x, x]), w, None, out) is None
    assert ops.linear_act_and_mul_normed(x.float(), w.float(), None, EPS) is None
    assert ops.linear_act_and_mul_normed(x, w, None, EPS) is not None


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from tests.helpers.models import save_tiny_model

    shape = dict(
        vocab_size=256,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=4096,
        attention_bias=True,
    )
    return str(save_tiny_model(tmp_path_factory.mktemp("norm_gemv") / "m", **shape))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_batch_one_decode_with_the_norms_carried_matches_the_unfused_step(tiny_model, dtype, monkeypatch):
    """The step on against off: the same greedy tokens nearly everywhere and logprobs within the
    dtype's noise (the fold rounds w * gamma, the carried norm skips two roundings), and the
    step did run (a spy on the model's carried forward in this in-process worker)."""
    from zllm.workers.models.llama import LlamaForCausalLM

    calls = []
    carried = LlamaForCausalLM._forward_carrying_norms

    def spied(self, *args):
        calls.append(1)
        return carried(self, *args)

    monkeypatch.setattr(LlamaForCausalLM, "_forward_carrying_norms", spied)
    launched = _record_launches(monkeypatch)
    monkeypatch.setenv("ZLLM_NORM_GEMV", "0")
    off_tokens, off_logprobs = batch_one_decode(tiny_model, dtype=dtype)
    assert not calls
    assert not [name for name in launched if name.endswith(("_norm", "_b6_add"))]
    launched.clear()
    monkeypatch.setenv("ZLLM_NORM_GEMV", "auto")
    on_tokens, on_logprobs = batch_one_decode(tiny_model, dtype=dtype)
    assert calls, "the carried step never ran"
    # ... with the carrying kernels, not the fallbacks: hidden 1024 takes one warp a row
    suffix = "bf16" if dtype == "bfloat16" else "f16"
    for build in ("rope_cache_norm", "silu_and_mul_norm", "add"):
        assert f"gemv_{suffix}_s1_b6_{build}" in launched, build
    for off, on, off_lp, on_lp in zip(off_tokens, on_tokens, off_logprobs, on_logprobs):
        same = next((i for i, (a, b) in enumerate(zip(off, on)) if a != b), len(off))
        assert same >= 8, (off, on)  # greedy paths may part once two logits are within noise
        for a, b in zip(off_lp[:same], on_lp[:same]):
            top = max(a, key=a.get)
            assert abs(a[top] - b[top]) < 0.05, (a, b)
