"""The argument checks every kernel wrapper runs before its launch (ValueError with the reason), and
the small helpers that turn checked tensors into launch arguments."""

from __future__ import annotations

import math

import numpy as np
import torch

from zllm.workers.attention import KV_FP8

DTYPE_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}  # of the entry points' names
MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z dimensions


def fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def dtype_suffix(op: str, tensor: torch.Tensor, name: str) -> str:
    suffix = DTYPE_SUFFIX.get(tensor.dtype)
    if suffix is None:
        fail(op, f"{name} has dtype {tensor.dtype}; expected float32, float16 or bfloat16")
    return suffix


def check_cuda(op: str, **tensors: torch.Tensor | None) -> torch.device:
    device = None
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            fail(op, f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_cuda:
            fail(op, f"{name} is on {tensor.device}; expected a CUDA tensor")
        if device is None:
            device = tensor.device
        elif tensor.device != device:
            fail(op, f"{name} is on {tensor.device}, others on {device}")
    assert device is not None
    return device


def check_dtype(op: str, expected: torch.dtype, **tensors: torch.Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.dtype != expected:
            fail(op, f"{name} has dtype {tensor.dtype}; expected {expected}")


def check_dim(op: str, tensor: torch.Tensor, name: str, dim: int) -> None:
    if tensor.dim() != dim:
        fail(op, f"{name} must have {dim} dimensions, got shape {tuple(tensor.shape)}")


def check_contiguous(op: str, **tensors: torch.Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and not tensor.is_contiguous():
            fail(op, f"{name} must be contiguous (strides {tensor.stride()})")


def check_heads_layout(op: str, tensor: torch.Tensor, name: str) -> None:
    """[tokens, heads, head_dim] with contiguous heads; the token stride is free."""
    check_dim(op, tensor, name, 3)
    if tensor.stride(2) != 1 or (tensor.shape[1] > 1 and tensor.stride(1) != tensor.shape[2]):
        fail(
            op,
            f"{name} {tuple(tensor.shape)} needs contiguous heads (strides (*, {tensor.shape[2]}, 1)), got {tensor.stride()}",
        )


def check_rows(op: str, tensor: torch.Tensor, name: str) -> tuple[int, int]:
    """(rows, row stride) of a tensor seen as [rows, last dim] with a contiguous last dim."""
    if tensor.dim() == 0:
        fail(op, f"{name} must have at least one dimension")
    if tensor.stride(-1) != 1 and tensor.shape[-1] > 1:
        fail(op, f"{name} needs a contiguous last dimension, got strides {tensor.stride()}")
    if tensor.dim() == 1:
        return 1, tensor.shape[0]
    if tensor.dim() == 2:
        return tensor.shape[0], tensor.stride(0)
    if not tensor.is_contiguous():
        fail(op, f"{name} with more than 2 dimensions must be contiguous (strides {tensor.stride()})")
    return tensor.numel() // tensor.shape[-1], tensor.shape[-1]


def cache_variant(op: str, kv_cache: torch.Tensor, dtype: torch.dtype) -> str:
    """The entry-point suffix for this cache: "" for a cache of the model dtype, "_kvfp8" for an
    FP8 E4M3 one."""
    if kv_cache.dtype == dtype:
        return ""
    if kv_cache.dtype == KV_FP8:
        return "_kvfp8"
    fail(op, f"kv_cache has dtype {kv_cache.dtype}; expected {dtype} or {KV_FP8}")


def check_kv_scale(op: str, name: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        fail(op, f"{name} must be finite and positive, got {value}")
    return value


def ptr(tensor: torch.Tensor | None) -> np.uint64:
    """The tensor's device address as a kernel argument (NULL for None)."""
    return np.uint64(0 if tensor is None else tensor.data_ptr())


def aligned16(*tensors: torch.Tensor) -> bool:
    """Whether every tensor starts on a 16-byte boundary (the vectorized kernels' loads)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes of two (contiguous) tensors share any address."""
    return (
        a.nbytes > 0
        and b.nbytes > 0
        and a.data_ptr() < b.data_ptr() + b.nbytes
        and b.data_ptr() < a.data_ptr() + a.nbytes
    )


def threads_for(units: int, cap: int) -> int:
    """A multiple of 32 covering `units` work items, at most `cap`."""
    return max(32, min(cap, -(-units // 32) * 32))
