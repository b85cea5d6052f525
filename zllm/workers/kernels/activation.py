"""The gated MLP's activation of the gate times the up projection (csrc/activation_kernels.cu):
SiLU (SwiGLU) or GELU with the tanh approximation (Gemma's GeGLU); and that activation with the
LoRA shrink of the down projection after it (decode: *_and_mul_lora_shrink). Every kernel waits
for the one before it (programmatic dependent launch: loader.launch's pdl)."""

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


ACT_SHRINK_COLS = 4  # csrc/activation_kernels.cu's kActShrinkCols: shrink columns a block computes


def act_shrink_supported(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether the *_and_mul_lora_shrink kernels take these operands: fp32/fp16/bf16 rows
    x [rows, 2I] of an I of whole 16-byte pieces, contiguous and 16-byte aligned (the activation
    kernel's _vec build, so the activation is its bits), and a [slots, cols, I] of x's dtype with
    cols a multiple of 4."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or x.dim() != 2 or x.shape[1] % 2:
        return False
    if a.dtype != x.dtype or a.dim() != 3:
        return False
    d = x.shape[1] // 2
    return (
        a.shape[2] == d
        and d % (16 // x.element_size()) == 0
        and a.shape[1] % ACT_SHRINK_COLS == 0
        and x.is_contiguous()
        and a.is_contiguous()
        and aligned16(x, a)
    )


def silu_and_mul_lora_shrink(
    out: torch.Tensor, t: torch.Tensor, x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """out = silu_and_mul(x) (its bits) and t [rows, cols] (float32) = out @ a[slot]^T per row's
    slot (0 for slot -1; a [S, cols, I]), in one launch. Not in place: out is another tensor than x."""
    return _act_and_mul_lora_shrink("silu_and_mul_lora_shrink", out, t, x, a, token_slots)


def gelu_tanh_and_mul_lora_shrink(
    out: torch.Tensor, t: torch.Tensor, x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """gelu_tanh_and_mul(x) into out and its LoRA shrink into t, as silu_and_mul_lora_shrink."""
    return _act_and_mul_lora_shrink("gelu_tanh_and_mul_lora_shrink", out, t, x, a, token_slots)


def _act_and_mul_lora_shrink(
    op: str, out: torch.Tensor, t: torch.Tensor, x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    device = check_cuda(op, out=out, t=t, x=x, a=a, token_slots=token_slots)
    suffix = dtype_suffix(op, x, "x")
    check_dtype(op, x.dtype, out=out, a=a)
    check_dtype(op, torch.float32, t=t)
    check_dtype(op, torch.int32, token_slots=token_slots)
    check_contiguous(op, out=out, t=t, token_slots=token_slots)
    if not act_shrink_supported(x, a):
        fail(op, f"x {tuple(x.shape)} {x.dtype} and a {tuple(a.shape)} {a.dtype} are not a supported shape")
    rows, d = x.shape[0], x.shape[1] // 2
    cols = a.shape[1]
    if tuple(out.shape) != (rows, d) or tuple(t.shape) != (rows, cols):
        fail(op, f"out {tuple(out.shape)} must be {(rows, d)}, t {tuple(t.shape)} {(rows, cols)}")
    if token_slots.shape != (rows,):
        fail(op, f"token_slots {tuple(token_slots.shape)} must be ({rows},)")
    if not aligned16(out):
        fail(op, "out must be 16-byte aligned")
    if overlaps(out, x):  # the other blocks still read x
        fail(op, "out must not overlap x")
    if rows == 0:
        return t
    blocks_y = cols // ACT_SHRINK_COLS
    if blocks_y > MAX_GRID_YZ:
        fail(op, f"{cols} columns are too many")
    threads = threads_for(d // (16 // x.element_size()), 1024)
    args = (ptr(out), ptr(t), ptr(x), ptr(a), ptr(token_slots), np.int32(d), np.int32(cols))
    launch("activation_kernels", f"{op}_{suffix}", device, (rows, blocks_y), (threads,), args, pdl=True)
    return t
