"""FP8 on the GPU: the csrc quantization kernels bit for bit against the torch arithmetic of
zllm/workers/fp8.py, the FP8 GEMV against fp32 products of the dequantized weights, and every
GPU path of fp8_linear (GEMV, row-wise and block-scaled cuBLASLt) against the emulation."""

from __future__ import annotations

import pytest
import torch

from zllm.workers import kernels, ops
from zllm.workers.fp8 import (
    E4M3,
    dequantize,
    emulated_fp8_linear,
    fp8_linear,
    quantize_blocks,
    quantize_groups,
    quantize_rows,
    quantize_static,
)
from zllm.workers.kernels import matvec
from zllm.workers.kernels.matvec import FP8_GEMV_FAMILIES, FP8_GEMV_STAGED_MAX_K, fp8_gemv_variants

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not kernels.is_available(), reason="needs a CUDA GPU and CuPy")]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("vectorized", [True, False], ids=["vec", "scalar"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (7, 4096), (33, 14336), (5, 100), (3, 32768), (2, 40000)])
def test_quant_rows_equals_torch_bit_for_bit(dtype, shape, vectorized, monkeypatch):
    """Every one-pass variant (1, 2, 4 and 8 pieces per thread, by K and dtype) and the scalar
    kernel it falls back to (K of 100 bf16 values; 40000 fp32 values need more than 8 pieces)."""
    from zllm.workers.kernels import quant as kernel_quant  # the module whose launch quant_fp8_rows calls

    launched, launch = [], kernel_quant.launch

    def recorded(module, name, *args, **kwargs):
        launched.append(name)
        return launch(module, name, *args, **kwargs)

    monkeypatch.setattr(kernel_quant, "launch", recorded)
    torch.manual_seed(0)
    x = (torch.randn(shape[0], shape[1] + 8, device="cuda") * 3).to(dtype)[:, : shape[1]]  # strided rows
    x[0, 3] = 0  # zeros and one outlier row
    x[-1] *= 100
    q = torch.empty(shape, dtype=E4M3, device="cuda")
    scales = torch.empty(shape[0], 1, device="cuda")
    kernels.quant_fp8_rows(q, scales, x, vectorized=vectorized)
    ref_q, ref_s = quantize_rows(x)
    assert torch.equal(scales, ref_s)
    assert torch.equal(_bits(q), _bits(ref_q))
    static = torch.tensor([0.02], device="cuda")
    kernels.quant_fp8_rows(q, None, x, static_scale=static, vectorized=vectorized)
    assert torch.equal(_bits(q), _bits(quantize_static(x, static)))  # saturates at +-448
    per16 = 16 // x.element_size()
    takes_vec = vectorized and shape[1] % per16 == 0 and -(-shape[1] // per16) <= 8 * 1024
    assert launched and all(("_vec" in name) == takes_vec for name in launched), launched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4096), (9, 14336), (4, 300)])
def test_quant_groups_equals_torch_bit_for_bit(dtype, shape):
    torch.manual_seed(1)
    x = (torch.randn(shape, device="cuda") * 2).to(dtype)
    groups = -(-shape[1] // 128)
    q = torch.empty(shape, dtype=E4M3, device="cuda")
    scales_t = torch.empty(groups, shape[0], device="cuda")
    kernels.quant_fp8_groups(q, scales_t, x)
    ref_q, ref_s = quantize_groups(x)
    assert torch.equal(scales_t.t(), ref_s)
    assert torch.equal(_bits(q), _bits(ref_q))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (960, 576), (200, 272)])
def test_fp8_gemv_against_fp32_products(dtype, block, n, k):
    torch.manual_seed(2)
    w = torch.randn(n, k, device="cuda") * 0.02
    q, scale = quantize_blocks(w) if block else quantize_rows(w)
    x = torch.randn(1, k, device="cuda").to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype)
    out = torch.empty(1, n, dtype=dtype, device="cuda")
    kernels.fp8_gemv(out, x, q, scale.contiguous(), bias, block=block)
    expected = x.float() @ dequantize(q, scale, block).t() + bias.float()
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())


# N not a multiple of a block's rows (1030, 3, 67); K of 17 and 36 units, not whole rounds or
# 4-unit chunks (the masked last round); K at the staged builds' limit (47.5 KB of shared memory
# with the split's partial sums) and past it (their unstaged fallback).
BUILD_SHAPES = [(4096, 14336), (1030, 576), (3, 272), (67, 16 * 1537), (40, 16 * 36), (33, 16 * 1520)]


def _float64_reference(x, q, scale, bias):
    expected = x.double() @ (q.double() * scale.double()).t()
    return expected if bias is None else expected + bias.double()


@pytest.mark.parametrize("variant", fp8_gemv_variants())
@pytest.mark.parametrize("n,k", BUILD_SHAPES)
def test_fp8_gemv_builds_agree(variant, n, k):
    """Every build (bf16, per-row scales; issue 40's families at each split), with a bias, against
    float64 products of the dequantized weights: within the tolerance of the first FP8 test, and
    no further from float64 than twice the default build's error (a bf16 rounding of the output);
    and the builds refused elsewhere."""
    if k > FP8_GEMV_STAGED_MAX_K and not variant.startswith("_mma"):
        pytest.skip("the long row is there for the staged builds' fallback")
    torch.manual_seed(3)
    q, scale = quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
    scale = scale.contiguous()
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16) if n % 2 == 0 else None
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.fp8_gemv(out, x, q, scale, bias, variant=variant)
    expected = _float64_reference(x, q, scale, bias)
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    default = torch.empty_like(out)
    kernels.fp8_gemv(default, x, q, scale, bias, variant="")
    error, default_error = (out.double() - expected).abs().max(), (default.double() - expected).abs().max()
    assert error <= 2 * default_error + 1e-5 * expected.abs().max(), (error.item(), default_error.item())
    if variant:
        with pytest.raises(ValueError, match="variant"):
            kernels.fp8_gemv(out.half(), x.half(), q, scale, variant=variant)


@pytest.mark.parametrize("variant", ["", *FP8_GEMV_FAMILIES])
def test_fp8_gemv_builds_replay_in_a_cuda_graph(variant):
    """Issue 40's builds (the staged ones with their dynamic shared memory) captured in a CUDA
    graph: the replay, on new activations, equals an eager launch bit for bit."""
    torch.manual_seed(5)
    n, k = 1030, 4096 + 16 * 3
    q, scale = quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
    scale = scale.contiguous()
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kernels.fp8_gemv(out, x, q, scale, variant=variant)  # loads the module outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            kernels.fp8_gemv(out, x, q, scale, variant=variant)
    x.copy_(torch.randn(1, k, device="cuda").to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    eager = torch.empty_like(out)
    kernels.fp8_gemv(eager, x, q, scale, variant=variant)
    assert torch.equal(out, eager)
    expected = _float64_reference(x, q, scale, None)
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.parametrize("variant", list(FP8_GEMV_FAMILIES))
def test_fp8_gemv_builds_follow_the_switch(variant, monkeypatch):
    """ZLLM_FP8_GEMV's value (matvec.FP8_GEMV_VARIANT) is what fp8_linear's GEMV runs for bf16
    per-row layers: the model's result is the chosen build's, bit for bit."""
    torch.manual_seed(6)
    q, scale = quantize_rows(torch.randn(2048, 1024, device="cuda") * 0.02)
    scale = scale.contiguous()
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    direct = torch.empty(1, 2048, dtype=torch.bfloat16, device="cuda")
    kernels.fp8_gemv(direct, x, q, scale, variant=variant)
    monkeypatch.setattr(matvec, "FP8_GEMV_VARIANT", variant)
    monkeypatch.setattr(ops, "GEMV_ENABLED", True)
    assert torch.equal(fp8_linear(x, q, scale, None, "token", False, None), direct)


CASES = {  # activation scheme: (weight quantizer, block)
    "token": (quantize_rows, False),
    "tensor": (quantize_rows, False),
    "group": (quantize_blocks, True),
    "none": (quantize_rows, False),
}


@pytest.mark.parametrize("activation", sorted(CASES))
@pytest.mark.parametrize("m", [1, 2, 16, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_linear_gpu_paths_against_the_emulation(activation, m, dtype):
    torch.manual_seed(3)
    n, k = 1024, 2048
    quantizer, block = CASES[activation]
    q, scale = quantizer(torch.randn(n, k, device="cuda") * 0.02)
    scale = scale.contiguous()
    x = torch.randn(m, k, device="cuda").to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype)
    input_scale = (x.abs().amax().float() / 448).reshape(1, 1) if activation == "tensor" else None
    out = fp8_linear(x, q, scale, input_scale, activation, block, bias)
    if m == 1:  # the GEMV: unquantized activations times the FP8 weights
        expected = emulated_fp8_linear(x, q, scale, None, "none", block, bias)
    else:
        expected = emulated_fp8_linear(x, q, scale, input_scale, activation, block, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def test_fp8_linear_is_captured_by_a_cuda_graph():
    torch.manual_seed(4)
    q, scale = quantize_rows(torch.randn(512, 1024, device="cuda") * 0.02)
    for m in (1, 8):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        eager = fp8_linear(x, q, scale, None, "token", False, None)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            fp8_linear(x, q, scale, None, "token", False, None)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                out = fp8_linear(x, q, scale, None, "token", False, None)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
