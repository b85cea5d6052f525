"""FP8 E4M3 weights for the linear layers (zllm/quantization.py says which scheme a model uses).

A quantized linear layer holds `weight` in float8_e4m3fn and fp32 scales: one per output row
(`weight_scale` [rows, 1]: the "channel" scheme, and the "tensor" scheme loaded per row so fused
q/k/v and gate/up parts keep their own), or one per 128x128 tile (`weight_scale` or, in the
Qwen3/DeepSeek format, `weight_scale_inv`, [ceil(rows/128), ceil(cols/128)]). Static activation
scales (`input_scale`, one per fused part) are reduced to their maximum after loading, as vLLM
does: the parts share one input.

One arithmetic everywhere: activations are quantized (per token, per 1x128 group or with the
static scale: x / s rounded to nearest-even E4M3 after clamping to +-448), the FP8 products are
summed in fp32, and the sum is scaled by both scales and rounded to the model dtype. The CPU
emulates it with fp32 matmuls of the FP8 values (exact products; only the summation order
differs from the GPU's); the GPU runs it through cuBLASLt (torch._scaled_mm). A CUDA step of a
single token goes through the csrc FP8 GEMV instead, which multiplies the FP8 weights with the
unquantized activation: at that size only the weight bytes matter, and a separate quantization
launch would cost more than it saves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zllm import envs
from zllm.quantization import BLOCK
from zllm.workers import ops

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite E4M3 value
_MIN_SCALE = 1e-12  # an all-zero row or group gets this scale instead of 0 (0/0 would be NaN)


# ---- the arithmetic ------------------------------------------------------------------------------


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row (a token of activations, an output channel of weights): (q, scale [.., 1])."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=_MIN_SCALE) / FP8_MAX
    return _to_e4m3(x.float() / scale), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """With a fixed scale (the checkpoint's input_scale)."""
    return _to_e4m3(x.float() / scale)


def quantize_groups(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row and `group` columns (the last group may be shorter): (q, scale [rows, groups])."""
    rows, cols = x.shape
    groups = -(-cols // group)
    padded = F.pad(x.float(), (0, groups * group - cols)).view(rows, groups, group)
    scale = padded.abs().amax(dim=-1).clamp(min=_MIN_SCALE) / FP8_MAX
    q = _to_e4m3(padded / scale[..., None]).view(rows, groups * group)[:, :cols]
    return q, scale


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per block x block tile (edge tiles may be smaller): (q, scale [ceil(rows/b), ceil(cols/b)])."""
    rows, cols = w.shape
    br, bc = -(-rows // block), -(-cols // block)
    padded = F.pad(w.float(), (0, bc * block - cols, 0, br * block - rows)).view(br, block, bc, block)
    scale = padded.abs().amax(dim=(1, 3)).clamp(min=_MIN_SCALE) / FP8_MAX
    q = _to_e4m3(padded / scale[:, None, :, None]).view(br * block, bc * block)[:rows, :cols]
    return q.contiguous(), scale


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, block: int = BLOCK) -> torch.Tensor:
    """A per-tile scale grid as one scale per element [rows, cols]."""
    return scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: bool) -> torch.Tensor:
    """fp32 values of FP8 weights: scale [rows, 1] per row, or with block a per-tile grid."""
    return q.float() * (expand_blocks(scale, *q.shape) if block else scale)


# dequantize_stacked converts at most this many elements at a time, bounding its fp32 scratch
# (256 MiB) whatever the stack (a DeepSeek-V3 layer's experts are 1.4 G elements at tp 8).
_DEQUANT_CHUNK_ELEMENTS = 1 << 26


def dequantize_stacked(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [N, rows, cols] (any float dtype) <- q [N, rows, cols] E4M3 times its per-tile scales
    [N, ceil(rows/128), ceil(cols/128)]: dequantize's fp32 values, rounded once to out's dtype
    (what the dequantize-at-load path holds), a few matrices at a time."""
    n, rows, cols = q.shape
    step = max(1, _DEQUANT_CHUNK_ELEMENTS // max(rows * cols, 1))
    whole_tiles = rows % BLOCK == 0 and cols % BLOCK == 0  # (DeepSeek-V3's every matrix, at tp 8 too)
    for first in range(0, n, step):
        chunk = slice(first, min(first + step, n))
        if whole_tiles:  # the scales broadcast over the tiles: no expanded copy of them
            tiles = q[chunk].view(-1, rows // BLOCK, BLOCK, cols // BLOCK, BLOCK).float()
            out[chunk] = (tiles * scale[chunk][:, :, None, :, None]).view(-1, rows, cols)
        else:
            tiles = scale[chunk].repeat_interleave(BLOCK, 1)[:, :rows].repeat_interleave(BLOCK, 2)[:, :, :cols]
            out[chunk] = q[chunk].float() * tiles
    return out


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    # Clamp first: a cast of a value beyond +-448 gives NaN in E4M3 (it has no infinity).
    return x.clamp(-FP8_MAX, FP8_MAX).to(E4M3)


def emulated_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    activation: str,
    block: bool,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The FP8 GEMM's arithmetic in fp32 on any device (the CPU path and the GPU tests' oracle).
    activation: "token", "tensor" (input_scale), "group" or "none"; block: per-tile weight scales."""
    w = dequantize(weight, weight_scale, block)
    if activation == "token":
        xq, xs = quantize_rows(x)
        xf = xq.float() * xs
    elif activation == "tensor":
        xf = quantize_static(x, input_scale).float() * input_scale
    elif activation == "group":
        xq, xs = quantize_groups(x)
        xf = xq.float() * xs.repeat_interleave(BLOCK, 1)[:, : x.shape[1]]
    else:
        xf = x.float()
    out = (xf @ w.t()).to(x.dtype)
    return out if bias is None else out + bias


# ---- the GPU path ----------------------------------------------------------------------------------

_kernels = None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    activation: str,
    block: bool,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [M, K] @ FP8 weight [N, K]^T with its scales (+ bias): the emulation on the CPU, the
    csrc GEMV for one CUDA row, cuBLASLt's scaled GEMM for more."""
    if not x.is_cuda or (activation == "none" and block and x.dtype == torch.float32):
        # (fp32 with weight-only tiles: a kept DeepSeek-V3 checkpoint computes exactly what its
        # dequantized model computes, the GEMV's summation order would not.)
        return emulated_fp8_linear(x, weight, weight_scale, input_scale, activation, block, bias)
    global _kernels
    if _kernels is None:
        from zllm.workers import kernels as _kernels
    if ops.GEMV_ENABLED and x.shape[0] == 1 and _kernels.fp8_gemv_supported(x, weight, weight_scale):
        out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
        return _kernels.fp8_gemv(out, x, weight, weight_scale, bias, block=block)
    n, k = weight.shape
    if activation == "none" and block and x.dtype != torch.float32:
        # Weight-only 128x128 tiles (a DeepSeek-V3 checkpoint kept in FP8): this layer's weights
        # dequantized to the model dtype right before the GEMM, the values and the GEMM of the
        # dequantize-at-load path; the scratch lives for this one product.
        w = dequantize_stacked(weight[None], weight_scale[None], torch.empty((1, n, k), dtype=x.dtype, device=x.device))
        return ops.linear(x, w[0], bias, weight_is_parameter=False)
    if activation == "none" or k % 16 or n % 16 or (activation == "group" and (k % BLOCK or n % BLOCK)):
        # Shapes cuBLASLt's FP8 GEMM does not take (and weight-only checkpoints): the same
        # arithmetic in fp32, slow but exact.
        return emulated_fp8_linear(x, weight, weight_scale, input_scale, activation, block, bias)
    x = x.contiguous()
    if activation == "group":
        return _block_scaled_mm(x, weight, weight_scale, bias)
    q = torch.empty(x.shape, dtype=E4M3, device=x.device)
    if activation == "token":
        scale_a = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
        _kernels.quant_fp8_rows(q, scale_a, x)
    else:
        _kernels.quant_fp8_rows(q, None, x, static_scale=input_scale)
        scale_a = input_scale.expand(x.shape[0], 1).contiguous()
    # Row-wise scaling in cuBLASLt needs a bf16 output; a bias is added in it before the rounding.
    out = torch._scaled_mm(
        q,
        weight.t(),
        scale_a=scale_a,
        scale_b=weight_scale.view(1, -1),
        bias=None if bias is None else bias.to(torch.bfloat16),
        out_dtype=torch.bfloat16,
    )
    return out if x.dtype == torch.bfloat16 else out.to(x.dtype)


def fp8_linear_act_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: bool,
    bias: torch.Tensor | None,
    gelu: bool,
) -> torch.Tensor | None:
    """A gate_up projection (weight [2d, K]: the gate's rows, then the up's) and its gated
    activation in one csrc launch for one CUDA row with per-row scales (ZLLM_FUSED_ACT_GEMV: the
    batch-1 decode step's MLP, one kernel fewer a layer); None where that launch does not take it
    (the caller runs fp8_linear and the activation), which gives the same bits."""
    global _kernels
    if x.shape[0] != 1 or block or not x.is_cuda or not ops.GEMV_ENABLED or not envs.ZLLM_FUSED_ACT_GEMV:
        return None
    if _kernels is None:
        from zllm.workers import kernels as _kernels
    n = weight.shape[0]
    # Only where the unfused product would take fp8_gemv's default build (the fused one shares its
    # loads and order): another ZLLM_FP8_GEMV build sums in another order.
    if n % 2 or not _kernels.fp8_gemv_supported(x, weight, weight_scale) or tuple(weight_scale.shape) != (n, 1):
        return None
    from zllm.workers.kernels.matvec import fp8_gemv_variant_for

    if x.dtype == torch.bfloat16 and fp8_gemv_variant_for(n):
        return None
    out = torch.empty((1, n // 2), dtype=x.dtype, device=x.device)
    return _kernels.fp8_gemv_act_and_mul(out, x, weight, weight_scale, bias, gelu=gelu)


def fp8_linear_rope_cache(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: bool,
    bias: torch.Tensor | None,
    rope,
) -> torch.Tensor | None:
    """The q/k/v product of one token with q and k rotated and k and v stored in the cache
    (rope: kernels.RopeCache) in one csrc launch, for per-row scales and fp8_gemv's default build
    (ZLLM_FUSED_ROPE_GEMV); None where that launch does not take it (the caller runs fp8_linear
    and rotary_and_write_kv, which give the same bits)."""
    global _kernels
    if x.shape[0] != 1 or block or not x.is_cuda or not ops.GEMV_ENABLED or not envs.ZLLM_FUSED_ROPE_GEMV:
        return None
    if _kernels is None:
        from zllm.workers import kernels as _kernels
    from zllm.workers.kernels.matvec import fp8_gemv_variant_for, rope_cache_supported

    n = weight.shape[0]
    if not _kernels.fp8_gemv_supported(x, weight, weight_scale) or tuple(weight_scale.shape) != (n, 1):
        return None
    if (x.dtype == torch.bfloat16 and fp8_gemv_variant_for(n)) or not rope_cache_supported(x, n, rope):
        return None
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    return _kernels.fp8_gemv_rope_cache(out, x, weight, weight_scale, bias, rope)


# cuBLASLt refuses block-scaled GEMMs of very few rows (CUBLAS_STATUS_NOT_SUPPORTED at 2 on the
# H100); such batches are padded with zero rows.
_MIN_BLOCK_SCALED_ROWS = 16


def _block_scaled_mm(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """1x128 activation groups times 128x128 weight tiles through F.scaled_mm."""
    m, k = x.shape
    rows = max(m, _MIN_BLOCK_SCALED_ROWS)
    dtype = x.dtype
    if rows != m:
        x = F.pad(x, (0, 0, 0, rows - m))
    q = torch.empty(x.shape, dtype=E4M3, device=x.device)
    scales_t = torch.empty((k // BLOCK, rows), dtype=torch.float32, device=x.device)
    _kernels.quant_fp8_groups(q, scales_t, x)
    out = F.scaled_mm(
        q,
        weight.t(),
        scale_a=scales_t.t(),
        scale_recipe_a=F.ScalingType.BlockWise1x128,
        scale_b=weight_scale.t(),
        scale_recipe_b=F.ScalingType.BlockWise128x128,
        output_dtype=torch.bfloat16,
    )[:m].to(dtype)
    return out if bias is None else out + bias
