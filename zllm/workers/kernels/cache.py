"""The KV cache write: key/value rows into their paged-cache slots (csrc/cache_kernels.cu)."""

from __future__ import annotations

import numpy as np
import torch

from zllm.workers.kernels.checks import (
    aligned16,
    check_contiguous,
    check_cuda,
    check_dim,
    check_dtype,
    check_heads_layout,
    dtype_suffix,
    fail,
    ptr,
    threads_for,
)
from zllm.workers.kernels.loader import launch


def value_cache_address(kv_cache: torch.Tensor) -> np.uint64:
    """The address of the value half of a contiguous [2, num_blocks, block_size, kv_heads, head_dim]
    layer cache: the kernels take the key and value caches as two pointers."""
    return np.uint64(kv_cache.data_ptr() + kv_cache.shape[1:].numel() * kv_cache.element_size())


def reshape_and_cache(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [T, KVH, D] at their slots of kv_cache [2, blocks, block_size, KVH, D];
    slots < 0 are padding and leave the cache untouched."""
    op = "reshape_and_cache"
    device = check_cuda(op, kv_cache=kv_cache, key=key, value=value, slot_mapping=slot_mapping)
    check_dim(op, kv_cache, "kv_cache", 5)
    if kv_cache.shape[0] != 2:
        fail(op, f"kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    check_contiguous(op, kv_cache=kv_cache, slot_mapping=slot_mapping)
    suffix = dtype_suffix(op, kv_cache, "kv_cache")
    check_dtype(op, kv_cache.dtype, key=key, value=value)
    check_dtype(op, torch.int64, slot_mapping=slot_mapping)
    check_heads_layout(op, key, "key")
    check_heads_layout(op, value, "value")
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    tokens = key.shape[0]
    if tuple(key.shape) != (tokens, kv_heads, head_dim) or value.shape != key.shape:
        fail(op, f"key {tuple(key.shape)} and value {tuple(value.shape)} must be [T, {kv_heads}, {head_dim}]")
    if tuple(slot_mapping.shape) != (tokens,):
        fail(op, f"slot_mapping must be [{tokens}] (one slot per token), got {tuple(slot_mapping.shape)}")
    if tokens == 0:
        return
    row = kv_heads * head_dim
    per16 = 16 // kv_cache.element_size()
    vec = (
        row % per16 == 0
        and key.stride(0) % per16 == 0
        and value.stride(0) % per16 == 0
        and aligned16(kv_cache, key, value)
    )
    units = row // per16 if vec else row
    kernel = f"reshape_and_cache_{suffix}{'_vec' if vec else ''}"
    args = (
        ptr(key),
        ptr(value),
        ptr(kv_cache),
        value_cache_address(kv_cache),
        ptr(slot_mapping),
        np.int64(key.stride(0)),
        np.int64(value.stride(0)),
        np.int32(row),
        np.int64(num_blocks * block_size),
    )
    launch("cache_kernels", kernel, device, (tokens,), (threads_for(units, 512),), args)


def write_rows(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store rows [T, D] at their slots of a one-row-per-slot cache (MLA's latent cache [1,
    num_blocks, block_size, 1, D], contiguous); slots < 0 are padding and leave it untouched, with
    no host sync (a decode graph's padded rows). reshape_and_cache's kernel with the rows as both
    key and value and the cache as both halves: each thread stores the same unit twice to one
    address, so no new kernel is needed."""
    op = "write_rows"
    device = check_cuda(op, cache=cache, rows=rows, slot_mapping=slot_mapping)
    check_contiguous(op, cache=cache, rows=rows, slot_mapping=slot_mapping)
    suffix = dtype_suffix(op, cache, "cache")
    check_dtype(op, cache.dtype, rows=rows)
    check_dtype(op, torch.int64, slot_mapping=slot_mapping)
    check_dim(op, rows, "rows", 2)
    row = rows.shape[1]
    tokens = rows.shape[0]
    if cache.shape[-1] != row or cache.numel() % row:
        fail(op, f"rows {tuple(rows.shape)} do not fit cache {tuple(cache.shape)}")
    if tuple(slot_mapping.shape) != (tokens,):
        fail(op, f"slot_mapping must be [{tokens}] (one slot per row), got {tuple(slot_mapping.shape)}")
    if tokens == 0:
        return
    per16 = 16 // cache.element_size()
    vec = row % per16 == 0 and aligned16(cache, rows)
    units = row // per16 if vec else row
    args = (
        ptr(rows),
        ptr(rows),
        ptr(cache),
        np.uint64(cache.data_ptr()),
        ptr(slot_mapping),
        np.int64(row),
        np.int64(row),
        np.int32(row),
        np.int64(cache.numel() // row),
    )
    kernel = f"reshape_and_cache_{suffix}{'_vec' if vec else ''}"
    launch("cache_kernels", kernel, device, (tokens,), (threads_for(units, 512),), args)
