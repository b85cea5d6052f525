"""Decode attention for issue 32's attention kinds (csrc/mla_kernels.cu): DeepSeek's latent
(MLA) attention over the latent cache, and GPT-OSS's per-head attention with sinks."""

from __future__ import annotations

import numpy as np
import torch

from zllm.workers.kernels.cache import value_cache_address
from zllm.workers.kernels.checks import (
    MAX_GRID_YZ,
    check_contiguous,
    check_cuda,
    check_dim,
    check_dtype,
    check_heads_layout,
    dtype_suffix,
    fail,
    ptr,
)
from zllm.workers.kernels.loader import launch

MLA_LATENT_DIM = 576  # kv_lora_rank 512 + qk_rope_head_dim 64: DeepSeek-V2, V2-Lite, V3
MLA_KV_LORA_RANK = 512
_MLA_HEADS_PER_BLOCK = 8  # warps of a block: one head each, sharing each tile of latents
SINKS_HEAD_DIMS = (64, 128)
_SINKS_THREADS = 128


def mla_decode_supported(q_latent: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """Whether mla_decode takes this model: DeepSeek's 512 + 64 latent, a model-dtype cache, CUDA."""
    return (
        q_latent.is_cuda
        and q_latent.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and kv_cache.dtype == q_latent.dtype
        and q_latent.shape[-1] == MLA_LATENT_DIM
        and kv_lora_rank == MLA_KV_LORA_RANK
    )


def _check_tables(op: str, block_tables: torch.Tensor, seq_lens: torch.Tensor, batch: int) -> None:
    check_dtype(op, torch.int32, block_tables=block_tables, seq_lens=seq_lens)
    check_dim(op, block_tables, "block_tables", 2)
    check_dim(op, seq_lens, "seq_lens", 1)
    check_contiguous(op, seq_lens=seq_lens)
    if block_tables.shape[0] < batch or seq_lens.shape[0] < batch:
        fail(op, f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} need >= {batch} rows")
    if block_tables.stride(1) != 1 and block_tables.shape[1] > 1:
        fail(op, f"block_tables rows must be contiguous, got strides {block_tables.stride()}")


def mla_decode(
    out: torch.Tensor,
    q_latent: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """out [B, H, 512] = softmax(q_latent . latents * scale) . latents[:, :512] per sequence and
    head (models/deepseek.py mla_decode, the reference): q_latent [B, H, 576] (heads contiguous),
    kv_cache the layer's latent cache [1, num_blocks, block_size, 1, 576] contiguous in the
    query's dtype, block_tables int32 [>= B, max_blocks], seq_lens int32 [>= B]."""
    op = "mla_decode"
    device = check_cuda(op, out=out, q_latent=q_latent, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens)
    suffix = dtype_suffix(op, q_latent, "q_latent")
    check_dtype(op, q_latent.dtype, out=out, kv_cache=kv_cache)
    check_heads_layout(op, q_latent, "q_latent")
    check_heads_layout(op, out, "out")
    check_dim(op, kv_cache, "kv_cache", 5)
    check_contiguous(op, kv_cache=kv_cache)
    batch, num_heads, dim = q_latent.shape
    if dim != MLA_LATENT_DIM or tuple(kv_cache.shape[::3]) != (1, 1) or kv_cache.shape[-1] != dim:
        fail(
            op,
            f"q_latent {tuple(q_latent.shape)} and kv_cache {tuple(kv_cache.shape)} must hold {MLA_LATENT_DIM} values",
        )
    if tuple(out.shape) != (batch, num_heads, MLA_KV_LORA_RANK):
        fail(op, f"out {tuple(out.shape)} must be {(batch, num_heads, MLA_KV_LORA_RANK)}")
    _check_tables(op, block_tables, seq_lens, batch)
    if batch == 0 or num_heads == 0:
        return out
    heads_per_block = min(_MLA_HEADS_PER_BLOCK, num_heads)
    args = (
        ptr(out),
        ptr(q_latent),
        ptr(kv_cache),
        ptr(block_tables),
        ptr(seq_lens),
        np.float32(scale),
        np.int32(num_heads),
        np.int32(heads_per_block),
        np.int32(kv_cache.shape[2]),
        np.int64(block_tables.stride(0)),
        np.int64(q_latent.stride(0)),
        np.int64(out.stride(0)),
    )
    grid = (batch, -(-num_heads // heads_per_block))
    launch(
        "mla_kernels",
        f"mla_decode_{suffix}_d{MLA_LATENT_DIM}_v{MLA_KV_LORA_RANK}",
        device,
        grid,
        (32 * heads_per_block,),
        args,
    )
    return out


def sinks_decode_supported(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (
        query.is_cuda
        and query.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and kv_cache.dtype == query.dtype
        and query.shape[-1] in SINKS_HEAD_DIMS
    )


def paged_attention_decode_sinks(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence over its paged K/V with each head's sink logit joining the
    softmax (attention.decode_attention(sinks=...), the reference), within the last `window`
    tokens if given: out, query [B, H, D] (D 64 or 128, heads contiguous); kv_cache [2,
    num_blocks, block_size, KVH, D] contiguous in the query's dtype; sinks [H] (any float dtype,
    read as fp32)."""
    op = "paged_attention_decode_sinks"
    device = check_cuda(op, out=out, query=query, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens)
    suffix = dtype_suffix(op, query, "query")
    check_dtype(op, query.dtype, out=out, kv_cache=kv_cache)
    check_heads_layout(op, query, "query")
    check_heads_layout(op, out, "out")
    check_dim(op, kv_cache, "kv_cache", 5)
    check_contiguous(op, kv_cache=kv_cache)
    batch, num_heads, head_dim = query.shape
    two, num_blocks, block_size, kv_heads, cache_dim = kv_cache.shape
    if two != 2 or cache_dim != head_dim:
        fail(op, f"kv_cache must be [2, num_blocks, block_size, kv_heads, {head_dim}], got {tuple(kv_cache.shape)}")
    if head_dim not in SINKS_HEAD_DIMS:
        fail(op, f"head_dim {head_dim} is not supported {SINKS_HEAD_DIMS}")
    if num_heads % kv_heads:
        fail(op, f"{num_heads} query heads are not a multiple of {kv_heads} kv heads")
    if out.shape != query.shape:
        fail(op, f"out {tuple(out.shape)} must match query {tuple(query.shape)}")
    if tuple(sinks.shape) != (num_heads,):
        fail(op, f"sinks {tuple(sinks.shape)} must hold one value per head ({num_heads})")
    if num_heads > MAX_GRID_YZ:
        fail(op, f"{num_heads} heads exceed the grid's {MAX_GRID_YZ}")
    if window is not None and window <= 0:
        fail(op, f"window {window} must be positive (None: no window)")
    _check_tables(op, block_tables, seq_lens, batch)
    if batch == 0:
        return out
    sinks = sinks.to(device=device, dtype=torch.float32).contiguous()
    args = (
        ptr(out),
        ptr(query),
        ptr(kv_cache),
        value_cache_address(kv_cache),
        ptr(block_tables),
        ptr(seq_lens),
        ptr(sinks),
        np.float32(scale),
        np.int32(kv_heads),
        np.int32(num_heads // kv_heads),
        np.int32(block_size),
        np.int64(block_tables.stride(0)),
        np.int64(query.stride(0)),
        np.int64(out.stride(0)),
        np.int32(window or 0),
    )
    launch(
        "mla_kernels",
        f"paged_attention_decode_sinks_{suffix}_d{head_dim}",
        device,
        (batch, num_heads),
        (_SINKS_THREADS,),
        args,
    )
    return out
