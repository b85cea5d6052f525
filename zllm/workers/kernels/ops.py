"""The CUDA kernels as functions on torch tensors, mirroring the torch references.

Reference (CPU path and oracle)                  Kernel here
attention.write_kv_cache(kv, k, v, slots)        reshape_and_cache(kv, k, v, slots)
attention.decode_attention(q, kv, meta, scale)   paged_attention_decode(out, q, kv, tables, lens, scale)
layers.rms_norm(x, w, eps)                       rms_norm(out, x, w, eps)
x + y, then layers.rms_norm                      fused_add_rms_norm(x, residual, w, eps)  (in place)
layers.apply_rotary on q and k                   rotary_embedding(positions, q, k, cos, sin)  (in place)
apply_rotary, then write_kv_cache                 rotary_embedding_and_cache(positions, q, k, v, cos, sin, kv, slots)
  (an FP8 kv cache: quantize_kv / dequantize_kv)   (the same, with k_scale, v_scale)
F.linear(x, w, b) for one row x                  gemv(out, x, w, b)
layers.silu_and_mul(x)                           silu_and_mul(out, x)

Every function checks shapes, dtypes (float32, float16, bfloat16), devices and layouts and raises
ValueError with the reason; it launches on torch's current stream, never synchronises and
allocates nothing (paged_attention_decode's split-K workspace is passed in, or cached per device
and grown only outside CUDA-graph capture), so the calls can be captured by torch.cuda.graph.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from zllm.workers.attention import KV_FP8
from zllm.workers.kernels.loader import launch

_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_ATTN_THREADS = 128  # kAttnThreads in attention_kernels.cu
_ATTN_HEAD_DIMS = (64, 128)
_MAX_GRID_YZ = 65535
_MAX_REDUCE_PARTS = 48 * 1024 // 4  # the reduce kernel's weights live in 48 KiB of shared memory

_workspaces: dict[int, torch.Tensor] = {}
_num_sms: dict[int, int] = {}


# ---- argument checks ----------------------------------------------------------------------------


def _fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def _suffix(op: str, tensor: torch.Tensor, name: str) -> str:
    suffix = _SUFFIX.get(tensor.dtype)
    if suffix is None:
        _fail(op, f"{name} has dtype {tensor.dtype}; expected float32, float16 or bfloat16")
    return suffix


def _check_cuda(op: str, **tensors: torch.Tensor | None) -> torch.device:
    device = None
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            _fail(op, f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_cuda:
            _fail(op, f"{name} is on {tensor.device}; expected a CUDA tensor")
        if device is None:
            device = tensor.device
        elif tensor.device != device:
            _fail(op, f"{name} is on {tensor.device}, others on {device}")
    assert device is not None
    return device


def _check_dtype(op: str, expected: torch.dtype, **tensors: torch.Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.dtype != expected:
            _fail(op, f"{name} has dtype {tensor.dtype}; expected {expected}")


def _check_dim(op: str, tensor: torch.Tensor, name: str, dim: int) -> None:
    if tensor.dim() != dim:
        _fail(op, f"{name} must have {dim} dimensions, got shape {tuple(tensor.shape)}")


def _check_contiguous(op: str, **tensors: torch.Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and not tensor.is_contiguous():
            _fail(op, f"{name} must be contiguous (strides {tensor.stride()})")


def _check_heads_layout(op: str, tensor: torch.Tensor, name: str) -> None:
    """[tokens, heads, head_dim] with contiguous heads; the token stride is free."""
    _check_dim(op, tensor, name, 3)
    if tensor.stride(2) != 1 or (tensor.shape[1] > 1 and tensor.stride(1) != tensor.shape[2]):
        _fail(
            op,
            f"{name} {tuple(tensor.shape)} needs contiguous heads (strides (*, {tensor.shape[2]}, 1)), got {tensor.stride()}",
        )


def _rows(op: str, tensor: torch.Tensor, name: str) -> tuple[int, int]:
    """(rows, row stride) of a tensor seen as [rows, last dim] with a contiguous last dim."""
    if tensor.dim() == 0:
        _fail(op, f"{name} must have at least one dimension")
    if tensor.stride(-1) != 1 and tensor.shape[-1] > 1:
        _fail(op, f"{name} needs a contiguous last dimension, got strides {tensor.stride()}")
    if tensor.dim() == 1:
        return 1, tensor.shape[0]
    if tensor.dim() == 2:
        return tensor.shape[0], tensor.stride(0)
    if not tensor.is_contiguous():
        _fail(op, f"{name} with more than 2 dimensions must be contiguous (strides {tensor.stride()})")
    return tensor.numel() // tensor.shape[-1], tensor.shape[-1]


def _cache_variant(op: str, kv_cache: torch.Tensor, dtype: torch.dtype) -> str:
    """The entry-point suffix for this cache: "" for a cache of the model dtype, "_kvfp8" for an
    FP8 E4M3 one."""
    if kv_cache.dtype == dtype:
        return ""
    if kv_cache.dtype == KV_FP8:
        return "_kvfp8"
    _fail(op, f"kv_cache has dtype {kv_cache.dtype}; expected {dtype} or {KV_FP8}")


def _kv_scale(op: str, name: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        _fail(op, f"{name} must be finite and positive, got {value}")
    return value


def _ptr(tensor: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if tensor is None else tensor.data_ptr())


def _aligned16(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _threads(units: int, cap: int) -> int:
    """A multiple of 32 covering `units` work items, at most `cap`."""
    return max(32, min(cap, -(-units // 32) * 32))


# ---- KV cache ---------------------------------------------------------------------------------------


def reshape_and_cache(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [T, KVH, D] at their slots of kv_cache [2, blocks, block_size, KVH, D];
    slots < 0 are padding and leave the cache untouched."""
    op = "reshape_and_cache"
    device = _check_cuda(op, kv_cache=kv_cache, key=key, value=value, slot_mapping=slot_mapping)
    _check_dim(op, kv_cache, "kv_cache", 5)
    if kv_cache.shape[0] != 2:
        _fail(op, f"kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    _check_contiguous(op, kv_cache=kv_cache, slot_mapping=slot_mapping)
    suffix = _suffix(op, kv_cache, "kv_cache")
    _check_dtype(op, kv_cache.dtype, key=key, value=value)
    _check_dtype(op, torch.int64, slot_mapping=slot_mapping)
    _check_heads_layout(op, key, "key")
    _check_heads_layout(op, value, "value")
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    tokens = key.shape[0]
    if tuple(key.shape) != (tokens, kv_heads, head_dim) or value.shape != key.shape:
        _fail(op, f"key {tuple(key.shape)} and value {tuple(value.shape)} must be [T, {kv_heads}, {head_dim}]")
    if tuple(slot_mapping.shape) != (tokens,):
        _fail(op, f"slot_mapping must be [{tokens}] (one slot per token), got {tuple(slot_mapping.shape)}")
    if tokens == 0:
        return
    row = kv_heads * head_dim
    per16 = 16 // kv_cache.element_size()
    vec = (
        row % per16 == 0
        and key.stride(0) % per16 == 0
        and value.stride(0) % per16 == 0
        and _aligned16(kv_cache, key, value)
    )
    units = row // per16 if vec else row
    kernel = f"reshape_and_cache_{suffix}{'_vec' if vec else ''}"
    value_cache_ptr = kv_cache.data_ptr() + num_blocks * block_size * row * kv_cache.element_size()
    args = (
        _ptr(key),
        _ptr(value),
        _ptr(kv_cache),
        np.uint64(value_cache_ptr),
        _ptr(slot_mapping),
        np.int64(key.stride(0)),
        np.int64(value.stride(0)),
        np.int32(row),
        np.int64(num_blocks * block_size),
    )
    launch("cache_kernels", kernel, device, (tokens,), (_threads(units, 512),), args)


# ---- paged attention (decode) -------------------------------------------------------------------------


def attention_workspace_numel(batch: int, num_heads: int, head_dim: int, num_partitions: int) -> int:
    """fp32 elements of split-K workspace: partial outputs, then (max, sum) pairs."""
    return batch * num_heads * num_partitions * (head_dim + 2)


def attention_partitions(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    max_seq_len: int,
    device: torch.device | None = None,
    partition_size: int | None = None,
) -> tuple[int, int]:
    """(partition size, number of partitions) that paged_attention_decode will use."""
    if partition_size is None:
        partition_size = _default_partition_size(batch, num_heads, num_kv_heads, max_seq_len, device)
    return partition_size, max(1, -(-max_seq_len // partition_size))


def _group_chunk(group: int) -> int:
    """Query heads per thread block (a compiled variant: 1, 4 or 8)."""
    return 1 if group == 1 else 4 if group <= 4 else 8


def _default_partition_size(batch: int, num_heads: int, num_kv_heads: int, max_seq_len: int, device) -> int:
    # 512 tokens a block; halve (down to 128) while the grid would leave SMs idle.
    group = num_heads // num_kv_heads
    blocks_per_partition = batch * num_kv_heads * -(-group // _group_chunk(group))
    sms = _sm_count(device)
    size = 512
    while size > 128 and blocks_per_partition * -(-max_seq_len // size) < sms:
        size //= 2
    return size


def _sm_count(device: torch.device | None) -> int:
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    count = _num_sms.get(index)
    if count is None:
        count = _num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    index = device.index if device.index is not None else torch.cuda.current_device()
    cached = _workspaces.get(index)
    if cached is None or cached.numel() < numel:
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(
                f"paged_attention_decode: the split-K workspace ({numel} floats) would be allocated during "
                "CUDA-graph capture; pass workspace=, or run the largest shape once before capturing"
            )
        cached = _workspaces[index] = torch.empty(numel, dtype=torch.float32, device=device)
    return cached


def paged_attention_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    workspace: torch.Tensor | None = None,
    partition_size: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context; writes and returns out.

    out, query: [B, H, D] (token stride free, heads contiguous, out must not overlap query);
    kv_cache: [2, num_blocks, block_size, KVH, D] contiguous, H a multiple of KVH, D 64 or 128,
    in the query's dtype or FP8 E4M3 (keys read as stored * k_scale, values * v_scale);
    block_tables: int32 [>= B, max_blocks]; seq_lens: int32 [>= B] (context length including the
    new token). max_seq_len bounds every seq_len (default: the block table's capacity) and sizes
    the grid: pass the batch's real maximum to skip empty partitions. Longer contexts are split
    into partitions (partition_size tokens, a multiple of 32; default 512, smaller for small
    batches) reduced through an fp32 workspace of attention_workspace_numel(...) elements.
    """
    op = "paged_attention_decode"
    device = _check_cuda(
        op, out=out, query=query, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens, workspace=workspace
    )
    suffix = _suffix(op, query, "query")
    _check_dtype(op, query.dtype, out=out)
    variant = _cache_variant(op, kv_cache, query.dtype)
    k_scale, v_scale = _kv_scale(op, "k_scale", k_scale), _kv_scale(op, "v_scale", v_scale)
    if not variant:  # a model-dtype cache holds the values themselves
        k_scale = v_scale = 1.0
    _check_dtype(op, torch.int32, block_tables=block_tables, seq_lens=seq_lens)
    _check_heads_layout(op, query, "query")
    _check_heads_layout(op, out, "out")
    _check_dim(op, kv_cache, "kv_cache", 5)
    _check_contiguous(op, kv_cache=kv_cache, seq_lens=seq_lens)
    _check_dim(op, block_tables, "block_tables", 2)
    _check_dim(op, seq_lens, "seq_lens", 1)
    batch, num_heads, head_dim = query.shape
    two, num_blocks, block_size, kv_heads, cache_head_dim = kv_cache.shape
    if two != 2 or cache_head_dim != head_dim:
        _fail(op, f"kv_cache must be [2, num_blocks, block_size, kv_heads, {head_dim}], got {tuple(kv_cache.shape)}")
    if head_dim not in _ATTN_HEAD_DIMS:
        _fail(op, f"head_dim {head_dim} is not supported (64 or 128)")
    if num_heads % kv_heads:
        _fail(op, f"{num_heads} query heads are not a multiple of {kv_heads} kv heads")
    if out.shape != query.shape:
        _fail(op, f"out {tuple(out.shape)} must match query {tuple(query.shape)}")
    if out.data_ptr() == query.data_ptr() and batch:
        _fail(op, "out must not overlap query")
    if block_tables.shape[0] < batch or seq_lens.shape[0] < batch:
        _fail(op, f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} need >= {batch} rows")
    if block_tables.stride(1) != 1 and block_tables.shape[1] > 1:
        _fail(op, f"block_tables rows must be contiguous, got strides {block_tables.stride()}")
    if not _aligned16(kv_cache):
        _fail(op, "kv_cache must be 16-byte aligned")
    if batch > _MAX_GRID_YZ:
        _fail(op, f"batch {batch} exceeds {_MAX_GRID_YZ}")
    if batch == 0:
        return out
    max_blocks = block_tables.shape[1]
    capacity = max_blocks * block_size
    max_len = capacity if max_seq_len is None else min(int(max_seq_len), capacity)
    max_len = max(max_len, 1)
    if partition_size is not None and (partition_size <= 0 or partition_size % 32):
        _fail(op, f"partition_size {partition_size} must be a positive multiple of 32")
    size, parts = attention_partitions(batch, num_heads, kv_heads, max_len, device, partition_size)
    if parts > _MAX_REDUCE_PARTS:
        _fail(op, f"{max_len} tokens make {parts} partitions of {size}; at most {_MAX_REDUCE_PARTS}")

    group = num_heads // kv_heads
    chunk = _group_chunk(group)
    num_chunks = -(-group // chunk)
    if kv_heads * num_chunks > _MAX_GRID_YZ:
        _fail(op, f"{kv_heads} kv heads x {num_chunks} head chunks exceed the grid's {_MAX_GRID_YZ}")
    ws_out = ws_ml = None
    ws_out_ptr = ws_ml_ptr = np.uint64(0)
    if parts > 1:
        numel = attention_workspace_numel(batch, num_heads, head_dim, parts)
        if workspace is None:
            ws = _workspace(device, numel)
        else:
            _check_dtype(op, torch.float32, workspace=workspace)
            _check_contiguous(op, workspace=workspace)
            if workspace.numel() < numel:
                _fail(op, f"workspace has {workspace.numel()} floats; {numel} needed")
            ws = workspace
        ws_out = ws.data_ptr()
        ws_ml = ws_out + batch * num_heads * parts * head_dim * 4
        ws_out_ptr, ws_ml_ptr = np.uint64(ws_out), np.uint64(ws_ml)

    value_cache_ptr = kv_cache.data_ptr() + num_blocks * block_size * kv_heads * head_dim * kv_cache.element_size()
    args = (
        _ptr(out),
        ws_out_ptr,
        ws_ml_ptr,
        _ptr(query),
        _ptr(kv_cache),
        np.uint64(value_cache_ptr),
        _ptr(block_tables),
        _ptr(seq_lens),
        np.float32(scale * k_scale * math.log2(math.e)),
        np.float32(v_scale),
        np.int32(kv_heads),
        np.int32(group),
        np.int32(num_chunks),
        np.int32(block_size),
        np.int32(max_blocks),
        np.int64(block_tables.stride(0)),
        np.int64(query.stride(0)),
        np.int64(out.stride(0)),
        np.int32(size),
        np.int32(parts),
    )
    kernel = f"paged_attention_decode_{suffix}{variant}_d{head_dim}_g{chunk}"
    launch("attention_kernels", kernel, device, (parts, kv_heads * num_chunks, batch), (_ATTN_THREADS,), args)
    if parts > 1:
        reduce_args = (
            _ptr(out),
            ws_out_ptr,
            ws_ml_ptr,
            _ptr(seq_lens),
            np.int32(num_heads),
            np.int32(block_size),
            np.int32(max_blocks),
            np.int64(out.stride(0)),
            np.int32(size),
            np.int32(parts),
        )
        launch(
            "attention_kernels",
            f"paged_attention_reduce_{suffix}_d{head_dim}",
            device,
            (num_heads, batch),
            (head_dim,),
            reduce_args,
            shared_mem=parts * 4,
        )
    return out


# ---- RMSNorm ---------------------------------------------------------------------------------------------


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)) over the last dimension (fp32 inside).
    out may be x itself."""
    op = "rms_norm"
    device = _check_cuda(op, out=out, x=x, weight=weight)
    suffix = _suffix(op, x, "x")
    _check_dtype(op, x.dtype, out=out, weight=weight)
    hidden = x.shape[-1] if x.dim() else 0
    if tuple(weight.shape) != (hidden,) or not weight.is_contiguous():
        _fail(op, f"weight must be a contiguous [{hidden}], got {tuple(weight.shape)}")
    if out.shape != x.shape:
        _fail(op, f"out {tuple(out.shape)} must match x {tuple(x.shape)}")
    rows, x_stride = _rows(op, x, "x")
    _, out_stride = _rows(op, out, "out")
    if rows == 0 or hidden == 0:
        return out
    per16 = 16 // x.element_size()
    vec = hidden % per16 == 0 and x_stride % per16 == 0 and out_stride % per16 == 0 and _aligned16(x, out, weight)
    units = hidden // per16 if vec else hidden
    kernel = f"rms_norm_{suffix}{'_vec' if vec else ''}"
    args = (
        _ptr(out),
        _ptr(x),
        _ptr(weight),
        np.float32(eps),
        np.int32(hidden),
        np.int64(x_stride),
        np.int64(out_stride),
    )
    launch("layernorm_kernels", kernel, device, (rows,), (_threads(units, 1024),), args)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual = residual + x (rounded to the dtype), then x = rms_norm(residual)."""
    op = "fused_add_rms_norm"
    device = _check_cuda(op, x=x, residual=residual, weight=weight)
    suffix = _suffix(op, x, "x")
    _check_dtype(op, x.dtype, residual=residual, weight=weight)
    _check_contiguous(op, x=x, residual=residual, weight=weight)
    if x.dim() == 0 or residual.shape != x.shape:
        _fail(op, f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have one shape")
    hidden = x.shape[-1]
    if tuple(weight.shape) != (hidden,):
        _fail(op, f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if x.data_ptr() == residual.data_ptr() and x.numel():
        _fail(op, "x and residual must be different tensors")
    rows = x.numel() // hidden if hidden else 0
    if rows == 0:
        return x, residual
    per16 = 16 // x.element_size()
    vec = hidden % per16 == 0 and _aligned16(x, residual, weight)
    units = hidden // per16 if vec else hidden
    kernel = f"fused_add_rms_norm_{suffix}{'_vec' if vec else ''}"
    args = (_ptr(x), _ptr(residual), _ptr(weight), np.float32(eps), np.int32(hidden))
    launch("layernorm_kernels", kernel, device, (rows,), (_threads(units, 1024),), args)
    return x, residual


# ---- rotary embedding ---------------------------------------------------------------------------------------


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate query [T, H, D] and key [T, KVH, D] in place by the float32 cos/sin caches
    [max_pos, D/2] at positions [T] (int64), pairing dims i and i + D/2 (HF's rotate_half).
    A position outside [0, max_pos) leaves its token unrotated."""
    op = "rotary_embedding"
    device = _check_cuda(op, positions=positions, query=query, key=key, cos=cos, sin=sin)
    suffix = _suffix(op, query, "query")
    _check_dtype(op, query.dtype, key=key)
    _check_dtype(op, torch.int64, positions=positions)
    _check_dtype(op, torch.float32, cos=cos, sin=sin)
    _check_contiguous(op, positions=positions, cos=cos, sin=sin)
    _check_heads_layout(op, query, "query")
    tokens, num_heads, head_dim = query.shape
    num_kv_heads, key_stride = 0, 0
    if key is not None:
        _check_heads_layout(op, key, "key")
        if key.shape[0] != tokens or key.shape[2] != head_dim:
            _fail(op, f"key {tuple(key.shape)} must be [{tokens}, kv_heads, {head_dim}]")
        num_kv_heads, key_stride = key.shape[1], key.stride(0)
    if head_dim % 2:
        _fail(op, f"head_dim {head_dim} must be even")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != head_dim // 2:
        _fail(op, f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be [max_pos, {head_dim // 2}]")
    if tuple(positions.shape) != (tokens,):
        _fail(op, f"positions must be [{tokens}], got {tuple(positions.shape)}")
    if tokens == 0:
        return query, key
    pairs = (num_heads + num_kv_heads) * (head_dim // 2)
    args = (
        _ptr(positions),
        _ptr(query),
        _ptr(key),
        _ptr(cos),
        _ptr(sin),
        np.int32(num_heads),
        np.int32(num_kv_heads),
        np.int32(head_dim),
        np.int64(query.stride(0)),
        np.int64(key_stride),
        np.int64(cos.shape[0]),
    )
    launch("pos_encoding_kernels", f"rotary_embedding_{suffix}", device, (tokens,), (_threads(pairs, 256),), args)
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_embedding(positions, query, key, cos, sin) then reshape_and_cache(kv_cache, key,
    value, slot_mapping), in one launch: query and key are rotated in place, and the rotated key
    and value are stored at their slots (slots < 0 are padding). An FP8 E4M3 kv_cache stores
    them quantized as attention.quantize_kv does, by k_scale and v_scale."""
    op = "rotary_embedding_and_cache"
    device = _check_cuda(
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
    suffix = _suffix(op, query, "query")
    _check_dtype(op, query.dtype, key=key, value=value)
    variant = _cache_variant(op, kv_cache, query.dtype)
    k_scale, v_scale = _kv_scale(op, "k_scale", k_scale), _kv_scale(op, "v_scale", v_scale)
    _check_dtype(op, torch.int64, positions=positions, slot_mapping=slot_mapping)
    _check_dtype(op, torch.float32, cos=cos, sin=sin)
    _check_contiguous(op, positions=positions, cos=cos, sin=sin, kv_cache=kv_cache, slot_mapping=slot_mapping)
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        _check_heads_layout(op, tensor, name)
    _check_dim(op, kv_cache, "kv_cache", 5)
    two, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    tokens, num_heads = query.shape[0], query.shape[1]
    if two != 2:
        _fail(op, f"kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    if query.shape[2] != head_dim or head_dim % 2:
        _fail(op, f"query {tuple(query.shape)} needs the cache's even head_dim {head_dim}")
    if tuple(key.shape) != (tokens, kv_heads, head_dim) or value.shape != key.shape:
        _fail(op, f"key {tuple(key.shape)} and value {tuple(value.shape)} must be [{tokens}, {kv_heads}, {head_dim}]")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != head_dim // 2:
        _fail(op, f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be [max_pos, {head_dim // 2}]")
    if tuple(positions.shape) != (tokens,) or tuple(slot_mapping.shape) != (tokens,):
        _fail(op, f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} must be [{tokens}]")
    if num_heads + kv_heads > _MAX_GRID_YZ:
        _fail(op, f"{num_heads} + {kv_heads} heads exceed the grid's {_MAX_GRID_YZ}")
    if tokens == 0:
        return query, key
    slots = num_blocks * block_size
    value_cache_ptr = kv_cache.data_ptr() + slots * kv_heads * head_dim * kv_cache.element_size()
    args = (
        _ptr(positions),
        _ptr(query),
        _ptr(key),
        _ptr(value),
        _ptr(cos),
        _ptr(sin),
        _ptr(kv_cache),
        np.uint64(value_cache_ptr),
        _ptr(slot_mapping),
        np.int32(num_heads),
        np.int32(kv_heads),
        np.int32(head_dim),
        np.int64(query.stride(0)),
        np.int64(key.stride(0)),
        np.int64(value.stride(0)),
        np.int64(cos.shape[0]),
        np.int64(slots),
        np.float32(1.0 / k_scale),
        np.float32(1.0 / v_scale),
    )
    launch(
        "pos_encoding_kernels",
        f"rotary_embedding_and_cache_{suffix}{variant}",
        device,
        (tokens, num_heads + kv_heads),
        (_threads(head_dim // 2, 1024),),
        args,
    )
    return query, key


# ---- GEMV (one token) -------------------------------------------------------------------------------------

_GEMV_ROWS_PER_BLOCK = 4  # kGemvWarps warps of one row each


def gemv_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gemv() takes this product: one CUDA row, a dtype it has, 16-byte-aligned rows."""
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.dtype not in _SUFFIX or weight.dtype != x.dtype:
        return False
    per16 = 16 // x.element_size()
    return (
        x.is_cuda
        and weight.is_cuda
        and x.shape[1] == weight.shape[1]
        and x.shape[1] % per16 == 0
        and x.is_contiguous()
        and weight.is_contiguous()
        and _aligned16(x, weight)
    )


def gemv(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    variant: str | None = None,
) -> torch.Tensor:
    """out [1, N] = x [1, K] @ weight [N, K]^T (+ bias [N]), fp32 accumulation; returns out.
    variant (benchmarks): "" the one-warp-per-row kernel, "b<B>" the split kernel of that bound
    with gemv_split's warps per row, "s<S>_b<B>" a given split; default GEMV_BOUND."""
    op = "gemv"
    device = _check_cuda(op, out=out, x=x, weight=weight, bias=bias)
    suffix = _suffix(op, x, "x")
    _check_dtype(op, x.dtype, out=out, weight=weight, bias=bias)
    if not gemv_supported(x, weight):
        _fail(
            op,
            f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be one contiguous row and "
            f"contiguous 16-byte-aligned rows of a length divisible by {16 // x.element_size()}",
        )
    n = weight.shape[0]
    _check_gemv_out(op, out, bias, n)
    if n == 0:
        return out
    args = (_ptr(out), _ptr(x), _ptr(weight), _ptr(bias), np.int32(n), np.int32(x.shape[1]))
    bound = GEMV_BOUND if variant is None else variant
    if not bound:
        launch("gemv_kernels", f"gemv_{suffix}", device, (-(-n // _GEMV_ROWS_PER_BLOCK),), (128,), args)
        return out
    split_text, _, bound = bound.rpartition("_") if bound.startswith("s") else ("", "", bound)
    split = int(split_text[1:]) if split_text else gemv_split(x.shape[1] // (16 // x.element_size()))
    if bound not in GEMV_BOUNDS or split not in GEMV_SPLITS:
        _fail(op, f"variant {variant!r}: built are splits {GEMV_SPLITS} and bounds {GEMV_BOUNDS}")
    launch(
        "gemv_kernels",
        f"gemv_{suffix}_s{split}_{bound}",
        device,
        (-(-n * split // _GEMV_ROWS_PER_BLOCK),),
        (128,),
        args,
    )
    return out


# The split GEMV's builds (csrc/gemv_kernels.cu gemv_<T>_s<S>_b<B>): S warps per row, B the
# __launch_bounds__ minimum blocks per SM (b0: none; b4, b6: ptxas issues a round's loads
# together). GEMV_BOUND picks the bound of the default GEMV ("": the one-warp-per-row kernel).
# b6 with gemv_split's warps beat the one-warp-per-row kernel on every projection of Llama-3-8B
# (2.41-3.12 -> 2.61-3.17 TB/s) and Qwen3-30B-A3B (o: 1.63 -> 2.16 TB/s) on the H100
# (benchmarks/gemv.py, 2026-11-25); ZLLM_GEMV_BOUND overrides it.
GEMV_SPLITS = (1, 2, 4)
GEMV_BOUNDS = ("b0", "b4", "b6")
GEMV_BOUND = os.environ.get("ZLLM_GEMV_BOUND", "b6")
_GEMV_ROUND_UNITS = 32 * 8  # 16-byte units a warp covers in one round of 8 loads a lane


def gemv_split(units: int) -> int:
    """Warps per row for rows of `units` 16-byte units: the fewest that leave each warp one
    round of loads, at most 4."""
    for split in GEMV_SPLITS:
        if -(-units // split) <= _GEMV_ROUND_UNITS:
            return split
    return GEMV_SPLITS[-1]


def _check_gemv_out(op: str, out: torch.Tensor, bias: torch.Tensor | None, n: int) -> None:
    if tuple(out.shape) != (1, n) or not out.is_contiguous():
        _fail(op, f"out must be a contiguous [1, {n}], got {tuple(out.shape)}")
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        _fail(op, f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")


def fp8_gemv_supported(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether fp8_gemv() takes this product: one CUDA row, E4M3 weights with rows of a multiple
    of 16 bytes, fp32 scales per row [N, 1] or per 128x128 tile."""
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.dtype not in _SUFFIX:
        return False
    if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32 or not scale.is_contiguous():
        return False
    n, k = weight.shape
    per_row = tuple(scale.shape) == (n, 1)
    per_tile = tuple(scale.shape) == (-(-n // 128), -(-k // 128))
    return (
        x.is_cuda
        and weight.is_cuda
        and scale.is_cuda
        and x.shape[1] == k
        and k % 16 == 0
        and (per_row or per_tile)
        and x.is_contiguous()
        and weight.is_contiguous()
        and _aligned16(x, weight)
    )


# (rows per warp, 16-byte loads per row in flight) of each build of gemv_fp8 in csrc/gemv_kernels.cu:
# "" is the default of every dtype; the others exist for bf16 with per-row scales.
_FP8_GEMV_SHAPES = {
    "": (1, 2),
    "_r1u4": (1, 4),
    "_r1u8": (1, 8),
    "_r2u2": (2, 2),
    "_r2u4": (2, 4),
    "_r4u1": (4, 1),
    "_r4u2": (4, 2),
    "_r1u2_b6": (1, 2),
    "_r1u4_b6": (1, 4),
    "_r1u4_b4": (1, 4),
    "_r1u8_b4": (1, 8),
}  # _b<B>: __launch_bounds__' minimum blocks (see GEMV_BOUNDS)
# ZLLM_FP8_GEMV=_r2u2 (say) runs that build for the model's bf16 per-row layers: the A/B switch of
# tests/gpu/run_perf.sh's gemv part.
FP8_GEMV_VARIANT = os.environ.get("ZLLM_FP8_GEMV", "")


def fp8_gemv(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: bool = False,
    variant: str | None = None,
) -> torch.Tensor:
    """out [1, N] = x [1, K] @ (weight [N, K] (E4M3) * scale)^T (+ bias [N]), fp32 accumulation;
    scale [N, 1] per row or, with block, [ceil(N/128), ceil(K/128)] per tile. Returns out. `variant`
    picks another build (a key of _FP8_GEMV_SHAPES; bf16 with per-row scales only; None:
    FP8_GEMV_VARIANT there, the default build elsewhere)."""
    op = "fp8_gemv"
    device = _check_cuda(op, out=out, x=x, weight=weight, scale=scale, bias=bias)
    suffix = _suffix(op, x, "x")
    _check_dtype(op, x.dtype, out=out, bias=bias)
    if not fp8_gemv_supported(x, weight, scale):
        _fail(
            op,
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, scale {tuple(scale.shape)} "
            f"{scale.dtype}: need one contiguous row, contiguous 16-byte-aligned E4M3 rows of a multiple of "
            f"16, and fp32 scales per row [N, 1] or per 128x128 tile",
        )
    n = weight.shape[0]
    _check_gemv_out(op, out, bias, n)
    if n == 0:
        return out
    expected = (-(-n // 128), -(-weight.shape[1] // 128)) if block else (n, 1)
    if tuple(scale.shape) != expected:
        _fail(op, f"scale must be {expected} ({'per tile' if block else 'per row'}), got {tuple(scale.shape)}")
    per_row_bf16 = suffix == "bf16" and not block
    if variant is None:
        variant = FP8_GEMV_VARIANT if per_row_bf16 else ""
    if variant not in _FP8_GEMV_SHAPES or (variant and not per_row_bf16):
        _fail(
            op,
            f"variant {variant!r}: the builds are {sorted(_FP8_GEMV_SHAPES)}, all but '' for bf16 with per-row scales",
        )
    rows_per_warp = _FP8_GEMV_SHAPES[variant][0]
    name = f"gemv_fp8_{suffix}{'_block' if block else ''}{variant}"
    args = (_ptr(out), _ptr(x), _ptr(weight), _ptr(scale), _ptr(bias), np.int32(n), np.int32(weight.shape[1]))
    launch("gemv_kernels", name, device, (-(-n // (_GEMV_ROWS_PER_BLOCK * rows_per_warp)),), (128,), args)
    return out


# ---- FP8 activation quantization -------------------------------------------------------------------


_QUANT_VECS = (1, 2, 4, 8)  # 16-byte pieces per thread of the quant_fp8_rows_vec<V> kernels
_MAX_THREADS = 1024
# ZLLM_QUANT_VEC=0 sends every row through the scalar two-pass kernel: the A/B switch of
# tests/gpu/run_perf.sh's fp8 part.
QUANT_VEC_ENABLED = os.environ.get("ZLLM_QUANT_VEC", "1") != "0"


def quant_fp8_rows(
    q: torch.Tensor,
    scales: torch.Tensor | None,
    x: torch.Tensor,
    static_scale: torch.Tensor | None = None,
    *,
    vectorized: bool | None = None,
) -> torch.Tensor:
    """q [M, K] (E4M3) = x / s per token: s = amax(|row|) / 448 written to scales [M, 1] (fp32),
    or the one fp32 `static_scale` (scales unused). Returns q. Rows of whole, aligned 16-byte
    pieces go through the one-pass kernel; vectorized=False forces the scalar one (the A/B of
    benchmarks/fp8_linear.py; None: QUANT_VEC_ENABLED)."""
    op = "quant_fp8_rows"
    device = _check_cuda(op, q=q, scales=scales, x=x, static_scale=static_scale)
    suffix = _suffix(op, x, "x")
    rows, x_stride = _rows(op, x, "x")
    _check_fp8_out(op, q, x)
    if static_scale is None:
        if scales is None or scales.dtype != torch.float32 or scales.numel() != rows or not scales.is_contiguous():
            _fail(op, f"scales must be a contiguous fp32 tensor of {rows} elements")
    elif static_scale.dtype != torch.float32 or static_scale.numel() != 1:
        _fail(op, "static_scale must be one fp32 value")
    if rows == 0 or x.shape[-1] == 0:
        return q
    k = x.shape[-1]
    args = (_ptr(q), _ptr(scales), _ptr(x), np.int32(k), np.int64(x_stride), _ptr(static_scale))
    per16 = 16 // x.element_size()
    units = k // per16
    vecs = next((v for v in _QUANT_VECS if -(-units // v) <= _MAX_THREADS), None)
    if vectorized is None:
        vectorized = QUANT_VEC_ENABLED
    if vectorized and vecs is not None and k % per16 == 0 and x_stride % per16 == 0 and _aligned16(x, q):
        launch(
            "quant_kernels",
            f"quant_fp8_rows_vec{vecs}_{suffix}",
            device,
            (rows,),
            (_threads(-(-units // vecs), _MAX_THREADS),),
            args,
        )
    else:
        launch("quant_kernels", f"quant_fp8_rows_{suffix}", device, (rows,), (_threads(k // 8, 256),), args)
    return q


def quant_fp8_groups(q: torch.Tensor, scales_t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """q [M, K] (E4M3) = x / s per token and 128 columns; the scales go to scales_t [G, M]
    (G = ceil(K / 128); its transpose is the [M, G] column-major layout of cuBLASLt's 1x128
    scaling). Returns q."""
    op = "quant_fp8_groups"
    device = _check_cuda(op, q=q, scales_t=scales_t, x=x)
    suffix = _suffix(op, x, "x")
    rows, x_stride = _rows(op, x, "x")
    _check_fp8_out(op, q, x)
    groups = -(-x.shape[-1] // 128)
    if scales_t.dtype != torch.float32 or tuple(scales_t.shape) != (groups, rows) or not scales_t.is_contiguous():
        _fail(
            op, f"scales_t must be a contiguous fp32 [{groups}, {rows}], got {tuple(scales_t.shape)} {scales_t.dtype}"
        )
    if rows == 0 or groups == 0:
        return q
    if groups > 4 * _MAX_GRID_YZ:
        _fail(op, f"x has too many columns ({x.shape[-1]})")
    args = (_ptr(q), _ptr(scales_t), _ptr(x), np.int32(rows), np.int32(x.shape[-1]), np.int64(x_stride))
    launch("quant_kernels", f"quant_fp8_groups_{suffix}", device, (rows, -(-groups // 4)), (128,), args)
    return q


def _check_fp8_out(op: str, q: torch.Tensor, x: torch.Tensor) -> None:
    if q.dtype != torch.float8_e4m3fn or tuple(q.shape) != tuple(x.shape) or not q.is_contiguous():
        _fail(
            op,
            f"q must be a contiguous float8_e4m3fn tensor of x's shape {tuple(x.shape)}, got "
            f"{tuple(q.shape)} {q.dtype}",
        )


# ---- SiLU and mul ---------------------------------------------------------------------------------------------


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """out [..., I] = silu(x[..., :I]) * x[..., I:] for x [..., 2I] (dtype rounding as the reference)."""
    op = "silu_and_mul"
    device = _check_cuda(op, out=out, x=x)
    suffix = _suffix(op, x, "x")
    _check_dtype(op, x.dtype, out=out)
    if x.dim() == 0 or x.shape[-1] % 2:
        _fail(op, f"x {tuple(x.shape)} must end in an even dimension")
    d = x.shape[-1] // 2
    if tuple(out.shape) != (*x.shape[:-1], d):
        _fail(op, f"out {tuple(out.shape)} must be {(*x.shape[:-1], d)}")
    rows, x_stride = _rows(op, x, "x")
    _, out_stride = _rows(op, out, "out")
    if rows == 0 or d == 0:
        return out
    per16 = 16 // x.element_size()
    vec = d % per16 == 0 and x_stride % per16 == 0 and out_stride % per16 == 0 and _aligned16(x, out)
    units = d // per16 if vec else d
    threads = _threads(units, 256)
    blocks_y = -(-units // threads)
    if blocks_y > _MAX_GRID_YZ:
        _fail(op, f"intermediate size {d} is too large")
    args = (_ptr(out), _ptr(x), np.int32(d), np.int64(x_stride), np.int64(out_stride))
    launch(
        "activation_kernels",
        f"silu_and_mul_{suffix}{'_vec' if vec else ''}",
        device,
        (rows, blocks_y),
        (threads,),
        args,
    )
    return out
