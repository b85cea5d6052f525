"""RMSNorm, alone or fused with the residual add before it (csrc/layernorm_kernels.cu), and that
fused norm with the LoRA shrink of the projection after it (decode: fused_add_rms_norm_lora_shrink).
All three wait for the kernel before them (programmatic dependent launch: loader.launch's pdl)."""

from __future__ import annotations

import numpy as np
import torch

from zllm.workers.kernels.checks import (
    MAX_GRID_YZ,
    aligned16,
    check_contiguous,
    check_cuda,
    check_dtype,
    check_rows,
    dtype_suffix,
    fail,
    overlaps,
    ptr,
    threads_for,
)
from zllm.workers.kernels.loader import launch


def rms_norm(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    """out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)) over the last dimension (fp32 inside);
    unit_offset: Gemma's to_dtype(x * rsqrt(...) * (1 + weight)). out may be x itself."""
    op = "rms_norm"
    device = check_cuda(op, out=out, x=x, weight=weight)
    suffix = dtype_suffix(op, x, "x")
    check_dtype(op, x.dtype, out=out, weight=weight)
    hidden = x.shape[-1] if x.dim() else 0
    if tuple(weight.shape) != (hidden,) or not weight.is_contiguous():
        fail(op, f"weight must be a contiguous [{hidden}], got {tuple(weight.shape)}")
    if out.shape != x.shape:
        fail(op, f"out {tuple(out.shape)} must match x {tuple(x.shape)}")
    rows, x_stride = check_rows(op, x, "x")
    _, out_stride = check_rows(op, out, "out")
    if rows == 0 or hidden == 0:
        return out
    per16 = 16 // x.element_size()
    vec = hidden % per16 == 0 and x_stride % per16 == 0 and out_stride % per16 == 0 and aligned16(x, out, weight)
    units = hidden // per16 if vec else hidden
    kernel = f"rms_norm_{suffix}{'_vec' if vec else ''}"
    args = (
        ptr(out),
        ptr(x),
        ptr(weight),
        np.float32(eps),
        np.int32(hidden),
        np.int64(x_stride),
        np.int64(out_stride),
        np.int32(unit_offset),
    )
    launch("layernorm_kernels", kernel, device, (rows,), (threads_for(units, 1024),), args, pdl=True)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual = residual + x (rounded to the dtype), then x = rms_norm(residual)
    (Gemma's with unit_offset)."""
    op = "fused_add_rms_norm"
    device = check_cuda(op, x=x, residual=residual, weight=weight)
    suffix = dtype_suffix(op, x, "x")
    check_dtype(op, x.dtype, residual=residual, weight=weight)
    check_contiguous(op, x=x, residual=residual, weight=weight)
    if x.dim() == 0 or residual.shape != x.shape:
        fail(op, f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have one shape")
    hidden = x.shape[-1]
    if tuple(weight.shape) != (hidden,):
        fail(op, f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if x.data_ptr() == residual.data_ptr() and x.numel():
        fail(op, "x and residual must be different tensors")
    rows = x.numel() // hidden if hidden else 0
    if rows == 0:
        return x, residual
    per16 = 16 // x.element_size()
    vec = hidden % per16 == 0 and aligned16(x, residual, weight)
    units = hidden // per16 if vec else hidden
    kernel = f"fused_add_rms_norm_{suffix}{'_vec' if vec else ''}"
    args = (ptr(x), ptr(residual), ptr(weight), np.float32(eps), np.int32(hidden), np.int32(unit_offset))
    launch("layernorm_kernels", kernel, device, (rows,), (threads_for(units, 1024),), args, pdl=True)
    return x, residual


NORM_SHRINK_COLS = 4  # csrc/layernorm_kernels.cu's kNormShrinkCols: shrink columns a block computes


def norm_shrink_supported(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether fused_add_rms_norm_lora_shrink takes these operands: fp32/fp16/bf16 rows of a
    width of whole 16-byte pieces, contiguous and 16-byte aligned (fused_add_rms_norm's _vec
    build, so the norm is its bits), and a [slots, cols, hidden] with cols a multiple of 4."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or x.dim() != 2:
        return False
    if residual.dtype != x.dtype or weight.dtype != x.dtype or a.dtype != x.dtype or a.dim() != 3:
        return False
    hidden = x.shape[1]
    per16 = 16 // x.element_size()
    return (
        residual.shape == x.shape
        and tuple(weight.shape) == (hidden,)
        and a.shape[2] == hidden
        and hidden % per16 == 0
        and a.shape[1] % NORM_SHRINK_COLS == 0
        and all(t.is_contiguous() for t in (x, residual, weight, a))
        and aligned16(x, residual, weight, a)
    )


def fused_add_rms_norm_lora_shrink(
    out: torch.Tensor,
    residual_out: torch.Tensor,
    t: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    a: torch.Tensor,
    token_slots: torch.Tensor,
    eps: float,
    unit_offset: bool = False,
) -> torch.Tensor:
    """residual_out = residual + x (rounded), out = rms_norm(residual_out), each bit as
    fused_add_rms_norm computes them, and t [rows, cols] (float32) = out @ a[slot]^T per row's
    slot (0 for slot -1; a [S, cols, hidden]), in one launch. Not in place: out and residual_out
    must be other tensors than x and residual."""
    op = "fused_add_rms_norm_lora_shrink"
    device = check_cuda(
        op, out=out, residual_out=residual_out, t=t, x=x, residual=residual, weight=weight, a=a, slots=token_slots
    )
    suffix = dtype_suffix(op, x, "x")
    check_dtype(op, x.dtype, out=out, residual_out=residual_out, residual=residual, weight=weight, a=a)
    check_dtype(op, torch.float32, t=t)
    check_dtype(op, torch.int32, token_slots=token_slots)
    check_contiguous(op, out=out, residual_out=residual_out, t=t, token_slots=token_slots)
    if not norm_shrink_supported(x, residual, weight, a):
        fail(op, f"x {tuple(x.shape)} {x.dtype}, residual, weight and a {tuple(a.shape)} are not a supported shape")
    rows, hidden = x.shape
    cols = a.shape[1]
    if out.shape != x.shape or residual_out.shape != x.shape or tuple(t.shape) != (rows, cols):
        fail(op, f"out {tuple(out.shape)}, residual_out {tuple(residual_out.shape)}, t {tuple(t.shape)}")
    if token_slots.shape != (rows,):
        fail(op, f"token_slots {tuple(token_slots.shape)} must be ({rows},)")
    if not aligned16(out, residual_out):
        fail(op, "out and residual_out must be 16-byte aligned")
    # Block 0 writes them while the other blocks still read x and residual.
    if any(overlaps(o, i) for o in (out, residual_out) for i in (x, residual)) or overlaps(out, residual_out):
        fail(op, "out and residual_out must not overlap x, residual or each other")
    if rows == 0:
        return t
    blocks_y = cols // NORM_SHRINK_COLS
    if blocks_y > MAX_GRID_YZ:
        fail(op, f"{cols} columns are too many")
    # fused_add_rms_norm's block size: the same per-thread order, so the same sum of squares.
    threads = threads_for(hidden // (16 // x.element_size()), 1024)
    args = (
        ptr(out),
        ptr(residual_out),
        ptr(t),
        ptr(x),
        ptr(residual),
        ptr(weight),
        ptr(a),
        ptr(token_slots),
        np.float32(eps),
        np.int32(hidden),
        np.int32(cols),
        np.int32(unit_offset),
    )
    launch("layernorm_kernels", f"{op}_{suffix}", device, (rows, blocks_y), (threads,), args, pdl=True)
    return t
