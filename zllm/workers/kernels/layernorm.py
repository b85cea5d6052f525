"""RMSNorm, alone or fused with the residual add before it (csrc/layernorm_kernels.cu). Both kernels
wait for the kernel before them (programmatic dependent launch: loader.launch's pdl)."""

from __future__ import annotations

import numpy as np
import torch

from zllm.workers.kernels.checks import (
    aligned16,
    check_contiguous,
    check_cuda,
    check_dtype,
    check_rows,
    dtype_suffix,
    fail,
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
