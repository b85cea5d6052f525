"""Rotary position embedding in place on q and k (csrc/pos_encoding_kernels.cu), alone or fused
with the KV cache write that follows it."""

from __future__ import annotations

import numpy as np
import torch

from zllm import envs
from zllm.workers.kernels.cache import value_cache_address
from zllm.workers.kernels.checks import (
    MAX_GRID_YZ,
    cache_variant,
    check_contiguous,
    check_cuda,
    check_dim,
    check_dtype,
    check_heads_layout,
    check_kv_scale,
    dtype_suffix,
    fail,
    ptr,
    threads_for,
)
from zllm.workers.kernels.loader import launch

# ZLLM_ROPE_VEC=0 keeps rotary_embedding_and_cache on its scalar kernel: the A/B switch.
ROPE_VEC_ENABLED = envs.ZLLM_ROPE_VEC
_VEC_THREADS = 256  # per block of the vectorized kernel, whose threads run over (token, head, 8 pairs)
# Fewer tokens take the scalar kernel by default: its 64-thread block per head finished first up
# to 16 tokens (1.46 against 1.58 µs a call on an H200), the vectorized one from 32 (1.98 against
# 1.59 µs; benchmarks/rope_cache.py, docs/benchmarks.md).
VEC_MIN_TOKENS = 32


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate query [T, H, D] and key [T, KVH, D] in place by the float32 cos/sin caches
    [max_pos, R/2] at positions [T] (int64), pairing dims i and i + R/2 (HF's rotate_half) of
    the first R dims; R < D is partial rotary (the dims past R pass unchanged). A position
    outside [0, max_pos) leaves its token unrotated."""
    op = "rotary_embedding"
    device = check_cuda(op, positions=positions, query=query, key=key, cos=cos, sin=sin)
    suffix = dtype_suffix(op, query, "query")
    check_dtype(op, query.dtype, key=key)
    check_dtype(op, torch.int64, positions=positions)
    check_dtype(op, torch.float32, cos=cos, sin=sin)
    check_contiguous(op, positions=positions, cos=cos, sin=sin)
    check_heads_layout(op, query, "query")
    tokens, num_heads, head_dim = query.shape
    num_kv_heads, key_stride = 0, 0
    if key is not None:
        check_heads_layout(op, key, "key")
        if key.shape[0] != tokens or key.shape[2] != head_dim:
            fail(op, f"key {tuple(key.shape)} must be [{tokens}, kv_heads, {head_dim}]")
        num_kv_heads, key_stride = key.shape[1], key.stride(0)
    if head_dim % 2:
        fail(op, f"head_dim {head_dim} must be even")
    rot_dim = _rotary_dim(op, cos, sin, head_dim)
    if tuple(positions.shape) != (tokens,):
        fail(op, f"positions must be [{tokens}], got {tuple(positions.shape)}")
    if tokens == 0:
        return query, key
    pairs = (num_heads + num_kv_heads) * (rot_dim // 2)
    args = (
        ptr(positions),
        ptr(query),
        ptr(key),
        ptr(cos),
        ptr(sin),
        np.int32(num_heads),
        np.int32(num_kv_heads),
        np.int32(head_dim),
        np.int32(rot_dim),
        np.int64(query.stride(0)),
        np.int64(key_stride),
        np.int64(cos.shape[0]),
    )
    launch("pos_encoding_kernels", f"rotary_embedding_{suffix}", device, (tokens,), (threads_for(pairs, 256),), args)
    return query, key


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    vectorized: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_embedding(positions, query, key, cos, sin) then reshape_and_cache(kv_cache, key,
    value, slot_mapping), in one launch: query and key are rotated in place, and the rotated key
    and value are stored at their slots (slots < 0 are padding). An FP8 E4M3 kv_cache stores
    them quantized as attention.quantize_kv does, by k_scale and v_scale. cos/sin narrower than
    head_dim / 2 rotate the first dims only (partial rotary), as in rotary_embedding.

    vectorized (None: ZLLM_ROPE_VEC, from VEC_MIN_TOKENS tokens): where the shapes allow
    (_fits_vectorized), the kernel with 16-byte accesses; it gives the scalar kernel's bits."""
    op = "rotary_embedding_and_cache"
    device = check_cuda(
        op,
        positions=positions,
        query=query,
        key=key,
        value=value,
        cos=cos,
        sin=sin,
        kv_cache=kv_cache,
        slot_mapping=slot_mapping,
    )
    suffix = dtype_suffix(op, query, "query")
    check_dtype(op, query.dtype, key=key, value=value)
    variant = cache_variant(op, kv_cache, query.dtype)
    k_scale, v_scale = check_kv_scale(op, "k_scale", k_scale), check_kv_scale(op, "v_scale", v_scale)
    check_dtype(op, torch.int64, positions=positions, slot_mapping=slot_mapping)
    check_dtype(op, torch.float32, cos=cos, sin=sin)
    check_contiguous(op, positions=positions, cos=cos, sin=sin, kv_cache=kv_cache, slot_mapping=slot_mapping)
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        check_heads_layout(op, tensor, name)
    check_dim(op, kv_cache, "kv_cache", 5)
    two, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    tokens, num_heads = query.shape[0], query.shape[1]
    if two != 2:
        fail(op, f"kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    if query.shape[2] != head_dim or head_dim % 2:
        fail(op, f"query {tuple(query.shape)} needs the cache's even head_dim {head_dim}")
    if tuple(key.shape) != (tokens, kv_heads, head_dim) or value.shape != key.shape:
        fail(op, f"key {tuple(key.shape)} and value {tuple(value.shape)} must be [{tokens}, {kv_heads}, {head_dim}]")
    rot_dim = _rotary_dim(op, cos, sin, head_dim)
    if tuple(positions.shape) != (tokens,) or tuple(slot_mapping.shape) != (tokens,):
        fail(op, f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} must be [{tokens}]")
    if num_heads + kv_heads > MAX_GRID_YZ:
        fail(op, f"{num_heads} + {kv_heads} heads exceed the grid's {MAX_GRID_YZ}")
    if tokens == 0:
        return query, key
    slots = num_blocks * block_size
    pointers = (ptr(positions), ptr(query), ptr(key), ptr(value), ptr(cos), ptr(sin), ptr(kv_cache))
    operands = (*pointers, value_cache_address(kv_cache), ptr(slot_mapping))
    heads = (np.int32(num_heads), np.int32(kv_heads), np.int32(head_dim))
    strides = (np.int64(query.stride(0)), np.int64(key.stride(0)), np.int64(value.stride(0)))
    extents = (*strides, np.int64(cos.shape[0]), np.int64(slots))
    inverse_scales = (np.float32(1.0 / k_scale), np.float32(1.0 / v_scale))
    if vectorized is None:
        vectorized = ROPE_VEC_ENABLED and tokens >= VEC_MIN_TOKENS
    if vectorized and _fits_vectorized(query, key, value, cos, sin, kv_cache, rot_dim):
        threads = tokens * (num_heads + kv_heads) * (head_dim // 16)  # one per eight pairs of a head
        launch(
            "pos_encoding_kernels",
            f"rotary_embedding_and_cache_vec_{suffix}{variant}",
            device,
            (-(-threads // _VEC_THREADS),),
            (_VEC_THREADS,),
            (*operands, np.int32(tokens), *heads, *extents, *inverse_scales),
            pdl=True,
        )
        return query, key
    args = (*operands, *heads, *extents, np.int32(rot_dim), *inverse_scales)
    launch(
        "pos_encoding_kernels",
        f"rotary_embedding_and_cache_{suffix}{variant}",
        device,
        (tokens, num_heads + kv_heads),
        (threads_for(head_dim // 2, 1024),),
        args,
        pdl=True,  # waits for the qkv projection (csrc/common.cuh pdl_wait); rotary_embedding does not
    )
    return query, key


def _fits_vectorized(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    rot_dim: int,
) -> bool:
    """Whether rotary_embedding_and_cache_vec can take these: 16-bit heads rotated whole, head_dim
    a multiple of 16, every row it loads or stores 8 elements at a time aligned to its width."""
    head_dim = query.shape[2]
    if query.dtype not in (torch.float16, torch.bfloat16) or rot_dim != head_dim or head_dim % 16:
        return False
    rows_aligned = all(t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0 for t in (query, key, value))
    tables_aligned = cos.data_ptr() % 32 == 0 and sin.data_ptr() % 32 == 0  # 8 floats a load
    cache_aligned = kv_cache.data_ptr() % 16 == 0 and value_cache_address(kv_cache) % 16 == 0
    return rows_aligned and tables_aligned and cache_aligned


def _rotary_dim(op: str, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> int:
    """The dims rotated: twice the caches' width, at most head_dim (less: partial rotary)."""
    if cos.dim() != 2 or cos.shape != sin.shape or not 0 < cos.shape[1] <= head_dim // 2:
        fail(
            op,
            f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be [max_pos, rotary_dim / 2 <= {head_dim // 2}]",
        )
    return 2 * cos.shape[1]
