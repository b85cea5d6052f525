"""Paged attention in plain torch: the reference implementation (CPU path, GPU oracle).

KV cache of one layer: a tensor [2, num_blocks, block_size, num_kv_heads, head_dim]; index 0 holds
keys, 1 values. Token t of a request lives in slot block_table[t // block_size] * block_size +
t % block_size.

An FP8 cache (`--kv-cache-dtype fp8`, dtype float8_e4m3fn) stores e4m3(clamp(x / s, ±448)) for
the layer's key or value scale s (KVScales: the checkpoint's, else 1.0) and is read back as the
stored value times s, in fp32, then in the query's dtype. The CUDA kernels store exactly this
(multiplying by the float32 reciprocal of s, as torch does for a division by a scalar); their
decode attention reads the E4M3 values in fp32 without rounding them to the query's dtype, and
folds s into the query scale (keys) and the output (values): equal up to fp32 rounding.

A batch is ordered decodes first: requests 0..num_decodes-1 have exactly one query token each
(attended as one batched call); each remaining request has a run of query tokens that attend
causally to their cached prefix and to each other.

Two per-layer variations, as HF applies them: a sliding `window` (the query at position p sees
the keys at p - window < j <= p: itself and window - 1 before it; Mistral, Phi-3, Gemma's local
layers) and a logit `softcap` (scores <- softcap * tanh(scores / softcap) after the scale, before
the mask; Gemma 2). SDPA has no soft-capping, so a capped layer takes the explicit
softmax(q k^T) v of HF's eager attention. So does a layer with attention sinks (GPT-OSS: a learned
logit per head that joins the softmax as one more column, then is dropped, so the weights of the
real keys sum to less than one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

KV_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0  # the largest finite E4M3 value: stores saturate to it


@dataclass(frozen=True, slots=True)
class KVScales:
    """One layer's FP8 KV cache scales (unused by a model-dtype cache)."""

    k: float = 1.0
    v: float = 1.0


UNSCALED = KVScales()


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as the FP8 cache stores it (float8_e4m3fn): x / scale, saturated, rounded to nearest even."""
    return (x.to(torch.float32) * (1.0 / scale)).clamp(-_FP8_MAX, _FP8_MAX).to(KV_FP8)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cached values in `dtype`: as stored (a model-dtype cache), or fp8 times its scale."""
    if x.dtype != KV_FP8 or scale == 1.0:  # every E4M3 value is exact in fp16, bf16 and fp32
        return x if x.dtype == dtype else x.to(dtype)
    return (x.to(torch.float32) * scale).to(dtype)


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor seen as uint8 (index_copy_ and index_select take no float8 on every
    backend); any other tensor as it is."""
    return t.view(torch.uint8) if t.dtype == KV_FP8 else t


def select_slots(cache_half: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows [len(slots), kv_heads, head_dim] of one half of a layer's cache, in its own dtype."""
    num_kv_heads, head_dim = cache_half.shape[-2], cache_half.shape[-1]
    rows = _byte_view(cache_half).view(-1, num_kv_heads, head_dim).index_select(0, slots)
    return rows.view(cache_half.dtype)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: where each new token's K/V goes
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int: padded block tables
    seq_lens: torch.Tensor  # [num_reqs] long: context length after this step
    seq_lens_list: list[int]
    query_start_loc: list[int]  # [num_reqs + 1]: query tokens of request i are [q[i], q[i+1])
    num_decodes: int
    block_size: int
    # The prefill requests (those after the decodes) packed for one variable-length attention call:
    # the cache slots of every context token of each, in order, and the int32 offsets of each
    # request's queries and keys in the packed rows (None when the step has no prefill).
    prefill: PackedPrefill | None = None
    # A hybrid model's sliding-window layers (zllm/kv_layout.py): the same step over their own
    # block tables (slot_mapping, block_tables and prefill differ); None for other models.
    sliding: AttentionMetadata | None = None

    def for_layer(self, sliding_layer: bool) -> AttentionMetadata:
        return self.sliding if sliding_layer and self.sliding is not None else self


@dataclass(slots=True)
class PackedPrefill:
    context_slots: torch.Tensor  # [sum of seq_lens] long: cache slot of each context token
    cu_seq_q: torch.Tensor  # [num_prefills + 1] int32: query offsets, from the first prefill token
    cu_seq_k: torch.Tensor  # [num_prefills + 1] int32: key offsets into context_slots
    max_q: int
    max_k: int


def pack_prefill(
    block_tables: np.ndarray, seq_lens: list[int], query_start_loc: list[int], num_decodes: int, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Host side of PackedPrefill: the cache slot of every context token of the prefill requests
    (the rows after the decodes), request after request, and their offsets: cu_seq_q then cu_seq_k."""
    lens = np.asarray(seq_lens[num_decodes:], dtype=np.int64)
    cu_k = np.concatenate(([0], np.cumsum(lens)))
    rows = np.repeat(np.arange(num_decodes, len(seq_lens)), lens)
    positions = np.arange(cu_k[-1]) - np.repeat(cu_k[:-1], lens)
    slots = block_tables[rows, positions // block_size] * block_size + positions % block_size
    cu_q = np.asarray(query_start_loc[num_decodes:], dtype=np.int64) - query_start_loc[num_decodes]
    return slots, np.concatenate((cu_q, cu_k))


def packed_prefill_of(
    context_slots: torch.Tensor,
    cu_seqs: torch.Tensor,
    seq_lens: list[int],
    query_start_loc: list[int],
    num_decodes: int,
) -> PackedPrefill:
    """PackedPrefill from pack_prefill's arrays once on the device (cu_seqs as one tensor)."""
    cu = cu_seqs.to(torch.int32)
    half = cu.shape[0] // 2
    query_lens = np.diff(query_start_loc[num_decodes:])
    return PackedPrefill(
        context_slots=context_slots,
        cu_seq_q=cu[:half],
        cu_seq_k=cu[half:],
        max_q=int(query_lens.max()),
        max_k=max(seq_lens[num_decodes:]),
    )


def write_kv_cache(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: KVScales = UNSCALED,
) -> None:
    """Store [tokens, kv_heads, head_dim] keys and values at their slots (quantized for an FP8 cache).
    A slot of -1 (a padded row) is written nowhere, as in the CUDA kernel."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    if slot_mapping.numel() and bool(slot_mapping.min() < 0):  # (a host sync: the torch path only)
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if kv_cache.dtype == KV_FP8:
        key, value = quantize_kv(key, scales.k), quantize_kv(value, scales.v)
    for half, rows in ((0, key), (1, value)):
        _byte_view(kv_cache[half]).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, _byte_view(rows))


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: KVScales = UNSCALED,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [tokens, heads, head_dim] -> [tokens, heads, head_dim], over the paged cache."""
    out = torch.empty_like(query)
    num_decodes = meta.num_decodes
    if num_decodes:
        out[:num_decodes] = decode_attention(
            query[:num_decodes], kv_cache, meta, scale, kv_scales, window, softcap, sinks
        )
    prefill_attention(out, query, kv_cache, meta, scale, kv_scales, window, softcap, sinks)
    return out


def prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: KVScales = UNSCALED,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Fill the rows of `out` that belong to the requests after the decodes."""
    for i in range(meta.num_decodes, len(meta.seq_lens_list)):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        out[start:end] = _prefill_attention(
            query[start:end], kv_cache, meta, i, scale, kv_scales, window, softcap, sinks
        )


def gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, kv_scales: KVScales, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the given blocks, in `dtype`: [..., num_blocks * block_size, kv_heads, head_dim]."""
    # index_select copies whole contiguous blocks: ~2x faster on CPU than advanced indexing.
    flat = block_table.reshape(-1)
    keys = torch.index_select(_byte_view(kv_cache[0]), 0, flat).view(kv_cache.dtype)
    values = torch.index_select(_byte_view(kv_cache[1]), 0, flat).view(kv_cache.dtype)
    shape = (*block_table.shape[:-1], -1, *keys.shape[-2:])
    return (
        dequantize_kv(keys, kv_scales.k, dtype).reshape(shape),
        dequantize_kv(values, kv_scales.v, dtype).reshape(shape),
    )


def window_start(seq_len: int, query_len: int, window: int | None) -> int:
    """The first key position any of a sequence's last query_len queries sees."""
    return 0 if window is None else max(0, seq_len - query_len - window + 1)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale, capped, masked) v for queries [..., H, Q, D] and keys/values
    [..., KVH, L, D] (query head h reads kv head h // (H / KVH)); mask [..., Q, L] bool, True
    where a key is seen, or None for the causal mask aligned to the last key. sinks [H]: each
    head's sink logit joins its softmax as one more key whose value is zero (GPT-OSS)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    if mask is None:
        query_len, seq_len = q.shape[-2], k.shape[-2]
        mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - query_len)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    rows = q.shape[-2]
    chunks = [slice(i, i + _CAPPED_ROWS) for i in range(0, rows, _CAPPED_ROWS)]
    return torch.cat(
        [_explicit_attention(q[..., r, :], k, v, mask[..., r, :], scale, softcap, sinks) for r in chunks], dim=-2
    )


# Query rows per capped score matrix: bounds its memory on a long prefill (heads x rows x keys).
_CAPPED_ROWS = 1024


def _explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """HF's eager attention with soft-capped scores (Gemma 2) or sinks (GPT-OSS: each head's
    sink logit is one more column of the softmax, dropped after it), on kv heads already
    repeated to the queries'. The scores are formed in fp32 whatever the model's dtype: a bf16
    score carries an absolute error of ~0.4% of its size, which the softmax turns into a
    relative error of each weight."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    sink = sinks.float().reshape(-1, 1, 1).expand(*scores.shape[:-1], 1)  # [..., H, Q, 1]
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)
    return torch.matmul(probs[..., :-1].to(q.dtype), v)


_DECODE_GROUP = 16  # decodes per attention call: each group is padded to its own longest context


def decode_blocks(lens: list[int], table_width: int, block_size: int, window: int | None = None) -> tuple[int, int]:
    """The block-table columns [first, stop) a group of decodes reads. An eager step knows its
    lengths (`lens`, from the host) and reads up to its longest context, from the first block
    its window leaves visible; a decode graph's metadata has none (seq_lens_list empty: the
    lengths live on the device only) and reads the table's whole width, masked by seq_lens, so
    the shapes a captured graph holds never depend on a step's values."""
    if not lens:
        return 0, table_width
    # A window leaves the blocks before the group's earliest visible key unread.
    first_block = min(window_start(n, 1, window) for n in lens) // block_size
    return first_block, -(-max(lens) // block_size)


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: KVScales = UNSCALED,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The first meta.num_decodes requests' single queries [num_decodes, heads, head_dim]."""
    groups = [
        _decode_group(query[i : i + _DECODE_GROUP], kv_cache, meta, i, scale, kv_scales, window, softcap, sinks)
        for i in range(0, query.shape[0], _DECODE_GROUP)
    ]
    return groups[0] if len(groups) == 1 else torch.cat(groups)


def _decode_group(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    first: int,
    scale: float,
    kv_scales: KVScales,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    rows = slice(first, first + query.shape[0])
    seq_lens = meta.seq_lens[rows]
    first_block, num_blocks = decode_blocks(
        meta.seq_lens_list[rows], meta.block_tables.shape[1], meta.block_size, window
    )
    table = meta.block_tables[rows, first_block:num_blocks]
    keys, values = gather_context(kv_cache, table, kv_scales, query.dtype)
    positions = torch.arange(first_block * meta.block_size, num_blocks * meta.block_size, device=query.device)
    mask = positions[None, :] < seq_lens[:, None]
    if window is not None:
        mask &= positions[None, :] >= seq_lens[:, None] - window
    out = attend(
        query[:, :, None, :],  # [B, H, 1, D]
        keys.transpose(1, 2),  # [B, KVH, L, D]
        values.transpose(1, 2),
        mask[:, None, None, :],  # [B, 1, 1, L]
        scale,
        softcap,
        sinks,
    )
    return out[:, :, 0, :]


def _prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    index: int,
    scale: float,
    kv_scales: KVScales = UNSCALED,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    query_len = query.shape[0]
    seq_len = meta.seq_lens_list[index]
    first_block = window_start(seq_len, query_len, window) // meta.block_size
    num_blocks = -(-seq_len // meta.block_size)
    keys, values = gather_context(kv_cache, meta.block_tables[index, first_block:num_blocks], kv_scales, query.dtype)
    offset = first_block * meta.block_size
    keys, values = keys[: seq_len - offset].transpose(0, 1), values[: seq_len - offset].transpose(0, 1)  # [KVH, L, D]
    q = query.transpose(0, 1)  # [H, Q, D]
    mask = None  # the causal mask: query i sits at position seq_len - query_len + i
    if window is not None or query_len != seq_len:
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(offset, seq_len, device=query.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= q_pos - k_pos < window
    return attend(q, keys, values, mask, scale, softcap, sinks).transpose(0, 1)


# ---- multi-head latent attention (models/deepseek.py) ---------------------------------------------


def write_latent(kv_cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store [tokens, latent_dim] at their slots of MLA's latent cache; a slot of -1 (a padded
    row) is written nowhere. Reads the slots on the host (a sync): the CPU path; CudaOps writes
    through a kernel that skips them on the device."""
    if slot_mapping.numel() and bool(slot_mapping.min() < 0):
        keep = slot_mapping >= 0
        latent, slot_mapping = latent[keep], slot_mapping[keep]
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slot_mapping, latent.to(kv_cache.dtype))


def gather_latents(kv_cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The latents of the given blocks: [..., num_blocks * block_size, latent_dim]."""
    rows = torch.index_select(kv_cache[0], 0, block_table.reshape(-1))
    return rows.reshape(*block_table.shape[:-1], -1, kv_cache.shape[-1])


def mla_decode(
    q_latent: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_list: list[int],
    block_size: int,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """Decode attention over the latent cache (the reference of the CUDA MLA decode kernel):
    absorbed queries [B, H, latent_dim] (W_UK^T q_nope, then the rotated q_pe) -> the
    softmax-weighted sum of each sequence's latents [B, H, kv_lora_rank]. Every head reads the
    same latents: multi-query attention with keys of latent_dim values and values of the first
    kv_lora_rank of them."""
    outs = []
    for first in range(0, q_latent.shape[0], _DECODE_GROUP):
        rows = slice(first, first + _DECODE_GROUP)
        q = q_latent[rows]
        _, num_blocks = decode_blocks(seq_lens_list[rows], block_tables.shape[1], block_size)
        latents = gather_latents(kv_cache, block_tables[rows, :num_blocks]).to(q.dtype)  # [B, L, D]
        positions = torch.arange(num_blocks * block_size, device=q.device)
        mask = positions[None, :] < seq_lens[rows, None]
        out = attend(
            q[:, :, None, :],  # [B, H, 1, D]
            latents[:, None],  # [B, 1, L, D]
            latents[:, None, :, :kv_lora_rank],
            mask[:, None, None, :],
            scale,
        )
        outs.append(out[:, :, 0, :])
    return outs[0] if len(outs) == 1 else torch.cat(outs)
