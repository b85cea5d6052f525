"""The gate_up GEMVs with the gated activation in their epilogue (csrc/gemv_kernels.cu
gemv_fp8_<T>_<act>_and_mul for FP8 weights, gemv_<T>_s<S>_b6_<act>_and_mul for dense ones;
ZLLM_FUSED_ACT_GEMV): bit for bit what the two kernels each replaces write (the default GEMV
build, then silu_and_mul / gelu_tanh_and_mul), eager and in a CUDA graph, and the decode steps of
FP8 and bf16 models the same with the switch on and off."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engine import batch_one_decode
from zllm.workers import kernels, ops
from zllm.workers.fp8 import dequantize, fp8_linear_act_and_mul, quantize_rows
from zllm.workers.kernels import matvec
from zllm.workers.kernels.matvec import gemv_split

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not kernels.is_available(), reason="needs a CUDA GPU and CuPy")]

# (d, K): Llama-3-8B's gate_up at tp 1 and 70B's at tp 4; d not a multiple of a block's 4 warps;
# K of 17 and 37 units (not whole rounds of 2 units a lane: the tail loop).
SHAPES = [(14336, 4096), (7168, 8192), (1030, 576), (3, 272), (515, 16 * 37)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _operands(d: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, scale = quantize_rows(torch.randn(2 * d, k, generator=g, device="cuda") * 0.05)
    x = torch.randn(1, k, generator=g, device="cuda").to(dtype)
    b = (torch.randn(2 * d, generator=g, device="cuda") * 0.5).to(dtype) if bias else None
    return x, q, scale.contiguous(), b


def _two_kernels(x, q, scale, bias, gelu):
    """What a step runs without the switch: the default FP8 GEMV, then the activation kernel."""
    gate_up = torch.empty(1, q.shape[0], dtype=x.dtype, device="cuda")
    kernels.fp8_gemv(gate_up, x, q, scale, bias, variant="" if x.dtype == torch.bfloat16 else None)
    out = torch.empty(1, q.shape[0] // 2, dtype=x.dtype, device="cuda")
    (kernels.gelu_tanh_and_mul if gelu else kernels.silu_and_mul)(out, gate_up)
    return out


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("d", "k"), SHAPES, ids=[f"{d}x{k}" for d, k in SHAPES])
def test_fused_act_gemv_equals_the_two_kernels_bit_for_bit(d, k, dtype, bias, gelu):
    x, q, scale, b = _operands(d, k, dtype, bias)
    fused = torch.full((1, d), float("nan"), dtype=dtype, device="cuda")
    kernels.fp8_gemv_act_and_mul(fused, x, q, scale, b, gelu=gelu)
    expected = _two_kernels(x, q, scale, b, gelu)
    assert not expected.isnan().any()
    assert torch.equal(_bits(fused), _bits(expected))
    # and both near float64 (a check that the pair is the right pair of rows, not only the same bits)
    gate_up = x.double() @ dequantize(q, scale, False).double().t()
    if b is not None:
        gate_up = gate_up + b.double()
    gate, up = gate_up[:, :d], gate_up[:, d:]
    act = torch.nn.functional.gelu(gate, approximate="tanh") if gelu else torch.nn.functional.silu(gate)
    reference = act * up
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(fused.double(), reference, rtol=tol, atol=tol * reference.abs().max().item())


# Dense shapes: the split GEMV's 1, 2 and 4 warps a row (bf16 K = 576, 4096, 8192; K past 4
# rounds at 8200), odd d, K not a whole round.
DENSE_SHAPES = [(14336, 4096), (7168, 8192), (1030, 576), (3, 272), (515, 16 * 37), (33, 8200)]


def _dense_two_kernels(x, w, bias, gelu):
    gate_up = torch.empty(1, w.shape[0], dtype=x.dtype, device="cuda")
    kernels.gemv(gate_up, x, w, bias, variant="b6")
    out = torch.empty(1, w.shape[0] // 2, dtype=x.dtype, device="cuda")
    (kernels.gelu_tanh_and_mul if gelu else kernels.silu_and_mul)(out, gate_up)
    return out


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("d", "k"), DENSE_SHAPES, ids=[f"{d}x{k}" for d, k in DENSE_SHAPES])
def test_dense_fused_act_gemv_equals_the_two_kernels_bit_for_bit(d, k, dtype, bias, gelu):
    if k % (16 // torch.empty((), dtype=dtype).element_size()):
        pytest.skip("K is not whole 16-byte units in this dtype")
    g = torch.Generator(device="cuda").manual_seed(4)
    w = (torch.randn(2 * d, k, generator=g, device="cuda") * 0.05).to(dtype)
    x = torch.randn(1, k, generator=g, device="cuda").to(dtype)
    b = (torch.randn(2 * d, generator=g, device="cuda") * 0.5).to(dtype) if bias else None
    fused = torch.full((1, d), float("nan"), dtype=dtype, device="cuda")
    kernels.gemv_act_and_mul(fused, x, w, b, gelu=gelu)
    expected = _dense_two_kernels(x, w, b, gelu)
    assert not expected.isnan().any()
    assert torch.equal(_bits(fused), _bits(expected)), gemv_split(k * x.element_size() // 16)
    gate_up = x.double() @ w.double().t()
    if b is not None:
        gate_up = gate_up + b.double()
    gate, up = gate_up[:, :d], gate_up[:, d:]
    act = torch.nn.functional.gelu(gate, approximate="tanh") if gelu else torch.nn.functional.silu(gate)
    reference = act * up
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(fused.double(), reference, rtol=tol, atol=tol * reference.abs().max().item())


@pytest.mark.parametrize("k", [576, 4096, 8192], ids=["s1", "s2", "s4"])
def test_dense_fused_act_gemv_replays_in_a_cuda_graph(k):
    d = 1030
    w = (torch.randn(2 * d, k, device="cuda") * 0.05).to(torch.bfloat16)
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    out = torch.empty(1, d, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kernels.gemv_act_and_mul(out, x, w)  # loads the module outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            kernels.gemv_act_and_mul(out, x, w)
    x.copy_(torch.randn(1, k, device="cuda").to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(_bits(out), _bits(_dense_two_kernels(x, w, None, False)))


def test_linear_act_and_mul_follows_the_switches(monkeypatch):
    w = (torch.randn(128, 256, device="cuda") * 0.05).to(torch.bfloat16)
    x = torch.randn(1, 256, device="cuda").to(torch.bfloat16)
    monkeypatch.setenv("ZLLM_FUSED_ACT_GEMV", "1")
    out = ops.linear_act_and_mul(x, w, None, gelu=True)
    assert out is not None and torch.equal(_bits(out), _bits(_dense_two_kernels(x, w, None, True)))
    assert ops.linear_act_and_mul(torch.cat([x, x]), w, None, gelu=True) is None
    assert ops.linear_act_and_mul(x, w[:127], None, gelu=True) is None
    monkeypatch.setattr(matvec, "GEMV_BOUND", "b4")
    assert ops.linear_act_and_mul(x, w, None, gelu=True) is None
    monkeypatch.setattr(matvec, "GEMV_BOUND", "b6")
    monkeypatch.setenv("ZLLM_FUSED_ACT_GEMV", "0")
    assert ops.linear_act_and_mul(x, w, None, gelu=True) is None


def test_fused_act_gemv_replays_in_a_cuda_graph():
    d, k = 1030, 4096 + 16 * 3
    x, q, scale, b = _operands(d, k, torch.bfloat16, True, seed=1)
    out = torch.empty(1, d, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kernels.fp8_gemv_act_and_mul(out, x, q, scale, b)  # loads the module outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            kernels.fp8_gemv_act_and_mul(out, x, q, scale, b)
    x.copy_(torch.randn(1, k, device="cuda").to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(_bits(out), _bits(_two_kernels(x, q, scale, b, False)))


def test_fused_act_gemv_refuses_what_it_does_not_take():
    x, q, scale, _ = _operands(8, 64, torch.bfloat16, False)
    out = torch.empty(1, 8, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="even number"):
        kernels.fp8_gemv_act_and_mul(torch.empty(1, 7, dtype=torch.bfloat16, device="cuda"), x, q[:15], scale[:15])
    with pytest.raises(ValueError, match="out must be"):
        kernels.fp8_gemv_act_and_mul(out[:, :4], x, q, scale)
    with pytest.raises(ValueError, match="bias must be"):
        kernels.fp8_gemv_act_and_mul(out, x, q, scale, torch.zeros(8, dtype=torch.bfloat16, device="cuda"))


def test_fp8_linear_act_and_mul_follows_the_switches(monkeypatch):
    """The layer's entry point launches the fused kernel for one row with per-row scales and the
    default build, and hands back None (the caller's two kernels) for the switch off, more rows,
    tiles, or another ZLLM_FP8_GEMV build."""
    x, q, scale, b = _operands(64, 256, torch.bfloat16, True, seed=2)
    monkeypatch.setenv("ZLLM_FUSED_ACT_GEMV", "1")
    out = fp8_linear_act_and_mul(x, q, scale, False, b, gelu=False)
    assert out is not None and torch.equal(_bits(out), _bits(_two_kernels(x, q, scale, b, False)))
    assert fp8_linear_act_and_mul(torch.cat([x, x]), q, scale, False, b, gelu=False) is None
    assert fp8_linear_act_and_mul(x, q, scale, True, b, gelu=False) is None
    monkeypatch.setattr(matvec, "FP8_GEMV_VARIANT", "_split")
    assert fp8_linear_act_and_mul(x, q, scale, False, b, gelu=False) is None
    monkeypatch.setattr(matvec, "FP8_GEMV_VARIANT", "")
    monkeypatch.setenv("ZLLM_FUSED_ACT_GEMV", "0")
    assert fp8_linear_act_and_mul(x, q, scale, False, b, gelu=False) is None


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
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
        initializer_range=0.2,
    )
    llama = tmp_path_factory.mktemp("fused-act-llama")
    save_tiny_model(llama, "llama", **shape)
    gemma2 = tmp_path_factory.mktemp("fused-act-gemma2")  # GeGLU (gelu_pytorch_tanh)
    save_tiny_model(gemma2, "gemma2", **shape)
    return {"llama": str(llama), "gemma2": str(gemma2)}


@pytest.mark.parametrize("quantization", ["fp8", None], ids=["fp8", "bf16"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_decode_steps_are_bit_identical_with_the_fused_epilogues(
    tiny_models, arch, enforce_eager, quantization, monkeypatch
):
    """Both epilogues (the activation after gate_up, rotary and the cache write after q/k/v:
    tests/gpu/test_fused_rope_gemv_gpu.py) on against both off. Each layer forward of one token
    launches the fused kernels in place of the pair; the prompts' steps of several tokens launch
    the pair in both runs, so the fused run's rotary and activation launches are the unfused
    run's less one per fused launch."""
    launched = _record_launches(monkeypatch)
    # The norm-carrying step (its own test: test_norm_gemv_gpu.py) takes dense Llama layers with
    # other launches; these runs compare the epilogues of the usual step.
    monkeypatch.setenv("ZLLM_NORM_GEMV", "0")
    args = dict(dtype="bfloat16", enforce_eager=enforce_eager, quantization=quantization)
    act = "gelu_tanh" if arch == "gemma2" else "silu"
    prefix = "gemv_fp8_bf16" if quantization else "gemv_bf16_s1_b6"  # hidden 1024: one warp a row
    monkeypatch.setenv("ZLLM_FUSED_ACT_GEMV", "0")
    monkeypatch.setenv("ZLLM_FUSED_ROPE_GEMV", "0")
    tokens, logprobs = batch_one_decode(tiny_models[arch], **args)
    unfused = _launch_counts(launched, prefix, act)
    assert unfused["fused_act"] == unfused["fused_rope"] == 0, unfused
    assert unfused["rotary"] > 0 and unfused["act"] > 0, unfused
    launched.clear()
    monkeypatch.setenv("ZLLM_FUSED_ACT_GEMV", "1")
    monkeypatch.setenv("ZLLM_FUSED_ROPE_GEMV", "1")
    tokens_fused, logprobs_fused = batch_one_decode(tiny_models[arch], **args)
    fused = _launch_counts(launched, prefix, act)
    assert fused["fused_act"] > 0 and fused["fused_rope"] > 0, fused
    assert fused["fused_act"] + fused["act"] == unfused["act"], (unfused, fused)
    assert fused["fused_rope"] + fused["rotary"] == unfused["rotary"], (unfused, fused)
    assert tokens_fused == tokens
    assert logprobs_fused == logprobs


def _launch_counts(launched: list[str], prefix: str, act: str) -> dict[str, int]:
    """How often a run launched the fused kernels and the unfused epilogues' kernels."""
    return {
        "fused_act": launched.count(f"{prefix}_{act}_and_mul"),
        "fused_rope": launched.count(f"{prefix}_rope_cache"),
        "act": sum(name.startswith(f"{act}_and_mul") for name in launched),
        "rotary": sum(name.startswith("rotary_embedding_and_cache") for name in launched),
    }


def test_fp8_kv_cache_decode_steps_are_bit_identical_with_the_fused_epilogues(tiny_models, monkeypatch):
    launched = _record_launches(monkeypatch)
    monkeypatch.setenv("ZLLM_NORM_GEMV", "0")  # the usual step's epilogues (as above)
    args = dict(dtype="bfloat16", enforce_eager=False, kv_cache_dtype="fp8")
    monkeypatch.setenv("ZLLM_FUSED_ACT_GEMV", "0")
    monkeypatch.setenv("ZLLM_FUSED_ROPE_GEMV", "0")
    expected = batch_one_decode(tiny_models["llama"], **args)
    monkeypatch.setenv("ZLLM_FUSED_ACT_GEMV", "1")
    monkeypatch.setenv("ZLLM_FUSED_ROPE_GEMV", "1")
    assert batch_one_decode(tiny_models["llama"], **args) == expected
    assert "gemv_bf16_s1_b6_rope_cache_kvfp8" in launched


def _record_launches(monkeypatch) -> list[str]:
    """The entry points launched through the GEMV, rotary and activation modules (one name each)."""
    from zllm.workers.kernels import activation, pos_encoding

    launched: list[str] = []
    for module in (matvec, pos_encoding, activation):
        launch = module.launch

        def recorded(file, name, *args, launch=launch, **kwargs):
            launched.append(name)
            return launch(file, name, *args, **kwargs)

        monkeypatch.setattr(module, "launch", recorded)
    return launched
