"""The gated MLP's activation of the gate times the up projection (csrc/activation_kernels.cu):
SiLU (SwiGLU) or GELU with the tanh approximation (Gemma's GeGLU)."""

from __future__ import annotations

import numpy as np
import torch

from zllm.workers.kernels.checks import (
    MAX_GRID_YZ,
    aligned16,
    check_cuda,
    check_dtype,
    check_rows,
    dtype_suffix,
    fail,
    ptr,
    threads_for,
)
from zllm.workers.kernels.loader import launch


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """out [..., I] = silu(x[..., :I]) * x[..., I:] for x [..., 2I] (dtype rounding as the reference)."""
    return _act_and_mul("silu_and_mul", out, x)


def gelu_tanh_and_mul(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """out [..., I] = gelu_tanh(x[..., :I]) * x[..., I:] for x [..., 2I] (layers.gelu_tanh_and_mul)."""
    return _act_and_mul("gelu_tanh_and_mul", out, x)


def _act_and_mul(op: str, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    device = check_cuda(op, out=out, x=x)
    suffix = dtype_suffix(op, x, "x")
    check_dtype(op, x.dtype, out=out)
    if x.dim() == 0 or x.shape[-1] % 2:
        fail(op, f"x {tuple(x.shape)} must end in an even dimension")
    d = x.shape[-1] // 2
    if tuple(out.shape) != (*x.shape[:-1], d):
        fail(op, f"out {tuple(out.shape)} must be {(*x.shape[:-1], d)}")
    rows, x_stride = check_rows(op, x, "x")
    _, out_stride = check_rows(op, out, "out")
    if rows == 0 or d == 0:
        return out
    per16 = 16 // x.element_size()
    vec = d % per16 == 0 and x_stride % per16 == 0 and out_stride % per16 == 0 and aligned16(x, out)
    units = d // per16 if vec else d
    threads = threads_for(units, 256)
    blocks_y = -(-units // threads)
    if blocks_y > MAX_GRID_YZ:
        fail(op, f"intermediate size {d} is too large")
    args = (ptr(out), ptr(x), np.int32(d), np.int64(x_stride), np.int64(out_stride))
    launch(
        "activation_kernels",
        f"{op}_{suffix}{'_vec' if vec else ''}",
        device,
        (rows, blocks_y),
        (threads,),
        args,
        pdl=True,  # the kernels wait for the one before them (csrc/common.cuh pdl_wait)
    )
    return out
