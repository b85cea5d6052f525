"""Multi-LoRA shrink and expand for rows of different adapters (csrc/lora_kernels.cu), the CUDA
path of zllm/workers/lora.py's LoRALayer (whose `apply_slot` is the reference). Which slot each
row uses is a device buffer (-1: the base model), so a CUDA graph can hold the launches. Both
kernels wait for the one before them (programmatic dependent launch: loader.launch's pdl)."""

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
    ptr,
)
from zllm.workers.kernels.loader import launch

SHRINK_THREADS = 256  # csrc/lora_kernels.cu's kShrinkThreads
SHRINK_COLS = 4  # kShrinkCols: output columns a shrink block computes
EXPAND_THREADS = 256  # and kExpandThreads


def vector_width(dtype: torch.dtype) -> int:
    """Elements per 16-byte load: `in` and the rank must be multiples of it."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def supports(dtype: torch.dtype, in_features: int, rank: int) -> bool:
    """Whether the kernels take a projection of this input width and slot rank."""
    width = vector_width(dtype)
    return dtype in (torch.float32, torch.float16, torch.bfloat16) and in_features % width == 0 and rank % width == 0


def lora_shrink(t: torch.Tensor, x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """t [T, C] (float32) = x [T, in] @ a[slot]^T for each row's slot, 0 for slot -1; a [S, C, in]."""
    op = "lora_shrink"
    device = check_cuda(op, t=t, x=x, a=a, token_slots=token_slots)
    suffix = dtype_suffix(op, x, "x")
    check_dtype(op, x.dtype, a=a)
    check_dtype(op, torch.float32, t=t)
    check_dtype(op, torch.int32, token_slots=token_slots)
    check_contiguous(op, t=t, a=a, token_slots=token_slots)
    rows, x_stride = check_rows(op, x, "x")
    slots, cols, in_features = a.shape
    if x.shape[-1] != in_features or tuple(t.shape) != (rows, cols) or token_slots.shape != (rows,):
        fail(op, f"x {tuple(x.shape)}, a {tuple(a.shape)}, t {tuple(t.shape)}, slots {tuple(token_slots.shape)}")
    width = vector_width(x.dtype)
    if in_features % width or x_stride % width or not aligned16(x, a):
        fail(op, f"in ({in_features}) and x's row stride must be multiples of {width}, x and a 16-byte aligned")
    if cols % SHRINK_COLS:  # a block's columns are all real (parts * rank, the rank a multiple of 4 or 8)
        fail(op, f"a's rows ({cols}) must be a multiple of {SHRINK_COLS}")
    blocks_y = -(-cols // SHRINK_COLS)
    if rows == 0:
        return t
    if blocks_y > MAX_GRID_YZ:
        fail(op, f"{cols} columns are too many")
    args = (ptr(t), ptr(x), ptr(a), ptr(token_slots), np.int32(in_features), np.int32(cols), np.int64(x_stride))
    launch("lora_kernels", f"{op}_{suffix}", device, (rows, blocks_y), (SHRINK_THREADS,), args, pdl=True)
    return t


def lora_expand(
    out: torch.Tensor,
    t: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    part_ends: list[int],
) -> torch.Tensor:
    """In place: out[:, cols of part p] += t[:, p R .. p R + R] @ b[cols of p, slot]^T for each row's
    slot (rows of slot -1 unchanged; the scale is folded into A). b [out, S, R],
    part_ends: the end column of each of the P <= 3 parts (the last is out)."""
    op = "lora_expand"
    device = check_cuda(op, out=out, t=t, b=b, token_slots=token_slots)
    suffix = dtype_suffix(op, out, "out")
    check_dtype(op, out.dtype, b=b)
    check_dtype(op, torch.float32, t=t)
    check_dtype(op, torch.int32, token_slots=token_slots)
    check_contiguous(op, t=t, b=b, token_slots=token_slots)
    rows, out_stride = check_rows(op, out, "out")
    out_cols, slots, rank = b.shape
    parts = len(part_ends)
    if not 1 <= parts <= 3 or part_ends[-1] != out_cols or list(part_ends) != sorted(part_ends):
        fail(op, f"part_ends {part_ends} must be 1 to 3 increasing ends, the last {out_cols}")
    if out.shape[-1] != out_cols or tuple(t.shape) != (rows, parts * rank):
        fail(op, f"out {tuple(out.shape)}, t {tuple(t.shape)}, b {tuple(b.shape)}")
    if token_slots.shape != (rows,):
        fail(op, f"token_slots {tuple(token_slots.shape)} must be ({rows},)")
    width = vector_width(out.dtype)
    if rank % width or not aligned16(b):
        fail(op, f"the rank ({rank}) must be a multiple of {width} and b 16-byte aligned")
    if rows == 0:
        return out
    blocks_y = -(-out_cols // EXPAND_THREADS)
    ends = [*part_ends, out_cols, out_cols][:2]
    args = (
        ptr(out),
        ptr(t),
        ptr(b),
        ptr(token_slots),
        np.int32(out_cols),
        np.int32(slots),
        np.int32(rank),
        np.int32(parts),
        np.int32(ends[0]),
        np.int32(ends[1]),
        np.int64(out_stride),
    )
    shared = parts * rank * 4  # the token's t-values, staged once per block
    launch(
        "lora_kernels", f"{op}_{suffix}", device, (rows, blocks_y), (EXPAND_THREADS,), args, shared_mem=shared, pdl=True
    )
    return out
