"""Paged attention of one query token per sequence (decode) over its cached context
(csrc/attention.cuh; the plain kernels in attention_kernels.cu, those of sliding-window and
soft-capped layers in attention_window_kernels.cu): long contexts are split into partitions
(split-K) whose partial results a second kernel reduces, through an fp32 workspace passed in or
cached per device. ZLLM_DECODE_ATTENTION (or build=) picks the pipelined build of
csrc/attention_pipe.cuh instead where it covers the call (same grid, arguments and reduce)."""

from __future__ import annotations

import math

import numpy as np
import torch

from zllm import envs
from zllm.workers.kernels.cache import value_cache_address
from zllm.workers.kernels.checks import (
    MAX_GRID_YZ,
    aligned16,
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
)
from zllm.workers.kernels.loader import allow_shared_memory, launch, resident_blocks

_ATTN_THREADS = 128  # kAttnThreads in attention.cuh
_ATTN_HEAD_DIMS = (64, 96, 128, 256)  # compiled head sizes (Phi-3: 96; Gemma 2/3: 256)
_MAX_REDUCE_PARTS = 48 * 1024 // 4  # the reduce kernel's weights live in 48 KiB of shared memory
_ATTN_WARPS = _ATTN_THREADS // 32
# The pipelined build (csrc/attention_pipe.cuh): its stages per setting value, what it compiles,
# and the constants its shared-memory size and table staging follow (kPipeTile, kPipeTableEntries).
_PIPE_STAGES = {"pipe": 2, "pipe3": 3}
_PIPE_HEAD_DIMS = (64, 128)
_PIPE_SUFFIXES = ("f16", "bf16")
_PIPE_TILE = 16
_PIPE_TABLE_ENTRIES = 128
_STATIC_SHARED_LIMIT = 48 * 1024
_WIDE_PARTITION = 1024  # tokens a decode partition spans in large batches (_wide_partitions_fit)
_WIDE_GRID_WAVES = 3  # a partition's blocks per SM from which it does
_MIN_PARTITION = 64  # tokens: the smallest partition the default picks (_default_partition_size)
_SPLIT_GROUP_MAX_KV_ROWS = 8  # sequences x kv heads up to which 5-8 heads a group take two blocks (_group_chunk)
_LOOP_MAX_BATCH = 1024  # sequences a _loop kernel's blocks each scan (_loops)
_LOOP_MAX_CLAIMS = 1 << 30  # the _loop kernels count claims (and the grid past them) in an int
_PIPE_LOOP_STAGES = (2,)  # the pipelined builds compiled with a _loop twin (csrc/attention_pipe.cuh)

_workspaces: dict[int, torch.Tensor] = {}
_num_sms: dict[int, int] = {}


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
    block_size: int | None = None,
) -> tuple[int, int]:
    """(partition size, number of partitions) that paged_attention_decode will use over a cache of
    block_size-token blocks. Without block_size, the default's count for any block size: an upper
    bound (what a workspace reserved ahead must hold)."""
    if partition_size is None:
        partition_size = _default_partition_size(batch, num_heads, num_kv_heads, max_seq_len, device, block_size)
    return partition_size, max(1, -(-max_seq_len // partition_size))


def default_partitions_bound(
    batch: int, num_heads: int, num_kv_heads: int, max_seq_len: int, device: torch.device | None = None
) -> int:
    """At most how many partitions the default picks for `batch` sequences at any longest context
    up to max_seq_len. An eager step sizes its grid to its longest context, a CUDA graph to the
    block table's capacity, which the caller passes (max_model_len in whole blocks: with blocks
    over 64 tokens, ceil(capacity / 64) may pass ceil(max_model_len / 64)). A size below 512 is
    chosen only where twice it left SMs idle (fewer than sms / blocks partitions), so it makes
    fewer than 2 sms / blocks; 512 and 1024 make at most max_seq_len / 512; none more than
    max_seq_len / _MIN_PARTITION."""
    blocks = _blocks_per_partition(batch, num_heads, num_kv_heads)
    split = -(-2 * _sm_count(device) // blocks)
    return max(1, min(-(-max_seq_len // _MIN_PARTITION), max(-(-max_seq_len // 512), split)))


def loop_grid_blocks(device: torch.device | None, blocks_per_sm: int) -> int:
    """Blocks of a _loop kernel's grid (ZLLM_DECODE_PARTITION_LOOP): one wave of blocks
    (`blocks_per_sm` resident blocks on every SM), whatever the batch and the capacity. They
    claim every (sequence, partition, head slot) of the batch from a counter
    (csrc/attention_pipe.cuh, paged_attention_pipe_claimed), so one long context among short ones
    is spread over the grid and a block that is free takes the next. One wave, since a block
    holds its SM slot until nothing is left to claim. Why not a block a partition: a graph sizes
    the partitions for the block table's capacity, and a block for each of them is mostly dead
    at short contexts: one H200, 400-token contexts, 88 rows, 49.9 us a call at max_model_len
    1024, 69.0 at 8192, 110.6 at 32768, 276.8 at 131072 (docs/benchmarks.md)."""
    return max(1, blocks_per_sm * _sm_count(device))


def _loops(batch: int, num_heads: int, num_kv_heads: int, device: torch.device | None) -> bool:
    """Whether a decode call that splits contexts runs the _loop kernel (loop_grid_blocks):
    ZLLM_DECODE_PARTITION_LOOP on, one partition's blocks at least half the SMs (9 rows of
    Llama-3-8B's heads on 132 SMs: from there a partition is 512 tokens or more whatever the
    capacity, so the sizes are the full grid's) and at most _LOOP_MAX_BATCH sequences. Smaller
    batches keep the full grid: sized for short contexts, their 64-256-token partitions cut a long
    one so finely that one row of 32000 tokens took 100.4 us a call against the full grid's 61.1
    (512-token partitions over a 131072 capacity, one H200). The _loop kernel's blocks each scan
    the batch's lengths, hence the upper bound (no decode graph is that large)."""
    if not envs.ZLLM_DECODE_PARTITION_LOOP or batch > _LOOP_MAX_BATCH:
        return False
    return 2 * _blocks_per_partition(batch, num_heads, num_kv_heads) >= _sm_count(device)


def loop_claims_fit(batch: int, parts: int, head_slots: int) -> bool:
    """Whether a _loop kernel's claims (a claim for every partition of every sequence in every
    head slot, at most) fit the int it counts them in, with room for the grid past the last."""
    return batch * parts * head_slots < _LOOP_MAX_CLAIMS


def _group_chunk(group: int, batch: int, num_kv_heads: int) -> int:
    """Query heads per thread block (a compiled variant: 1, 4 or 8). A group of 5-8 heads takes
    one block of 8, or two blocks of 4 in a grid of at most _SPLIT_GROUP_MAX_KV_ROWS sequences x kv
    heads: there a call is a few blocks' latency, and halving each block's heads beats reading
    the K/V tiles once (the second block reads them from L2). One H200, contexts 129-384 over
    1024, us a call (docs/benchmarks.md): 2 kv heads (a tp 4 rank of Llama-3-70B) at batch 1-4
    8.1-9.1 -> 6.8-8.6; 4 kv heads at batch 1-2 and 8 at batch 1 likewise faster; 8 kv heads at
    batch 2 (16 rows) no better (9.7-10.6 against 10.3-10.5)."""
    if group == 1:
        return 1
    if group <= 4 or (group <= 8 and batch * num_kv_heads <= _SPLIT_GROUP_MAX_KV_ROWS):
        return 4
    return 8


def _blocks_per_partition(batch: int, num_heads: int, num_kv_heads: int) -> int:
    """Thread blocks one partition of every sequence takes: a block per kv head and head chunk."""
    group = num_heads // num_kv_heads
    return batch * num_kv_heads * -(-group // _group_chunk(group, batch, num_kv_heads))


def _default_partition_size(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    max_seq_len: int,
    device,
    block_size: int | None = None,
) -> int:
    # 512 tokens a block; halve (down to _MIN_PARTITION) while a context of max_seq_len tokens
    # would leave SMs idle. At batch 1 a call is a few blocks' latency, not bandwidth: 64-token
    # partitions against 128 took Llama-3-8B's heads from 8.5-8.9 to 6.9-7.6 us a call, and a tp 4
    # rank of Llama-3-70B (16 heads, 2 kv heads) from 10.6 to 8.3-8.5 us (one H200, contexts
    # 129-384 over 1024; benchmarks/attention_decode.py, docs/benchmarks.md).
    blocks_per_partition = _blocks_per_partition(batch, num_heads, num_kv_heads)
    sms = _sm_count(device)
    size = 512
    while size > _MIN_PARTITION and blocks_per_partition * -(-max_seq_len // size) < sms:
        size //= 2
    if max_seq_len > size and _wide_partitions_fit(blocks_per_partition, sms, block_size):
        return _WIDE_PARTITION
    return size


def _wide_partitions_fit(blocks_per_partition: int, sms: int, block_size: int | None) -> bool:
    """Whether a decode call takes 1024-token partitions: where one partition's blocks already fill
    the SMs _WIDE_GRID_WAVES times over (large batches), splitting a context buys no parallelism and
    each split costs a block's fixed work, its share of the dead partitions' blocks and the reduce's
    workspace round trip. Llama-3-8B's heads, contexts of 400, pipe, one H200
    (benchmarks/attention_decode.py): 64 rows 48.8 -> 46.5 us a call, 128 rows 76.6 -> 70.6, 256
    rows 142.5 -> 128.1 over a 1024-token capacity, 209.2 -> 171.0 over 8192. Only where the
    pipelined build still stages a partition's block-table entries (16-token blocks and larger), so
    the default build keeps running; unknown block sizes keep 512 (an upper bound on the
    partitions)."""
    return (
        block_size is not None
        and blocks_per_partition >= _WIDE_GRID_WAVES * sms
        and _pipe_stages_table(_WIDE_PARTITION, block_size)
        and envs.ZLLM_DECODE_WIDE_PARTITIONS  # read last: an eager decode reads it once a layer
    )


def _pipe_stages_table(partition_size: int, block_size: int) -> bool:
    """Whether the pipelined build's shared-memory copy of the block table holds a partition's
    entries (one more for a partition that starts inside a block)."""
    return -(-partition_size // block_size) + 1 <= _PIPE_TABLE_ENTRIES


def _sm_count(device: torch.device | None) -> int:
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    count = _num_sms.get(index)
    if count is None:
        count = _num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def pipe_shared_bytes(head_dim: int, element_size: int, stages: int) -> int:
    """Dynamic shared memory of one block of the pipelined build: each warp's ring of stages, one
    16-token tile of key rows (padded by 16 bytes) and value rows each (attention_pipe.cuh)."""
    return _ATTN_WARPS * stages * _PIPE_TILE * (2 * head_dim * element_size + 16)


def decode_build_stages(
    build: str,
    query_dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    partition_size: int,
    num_slots: int,
    window: int | None,
    softcap: float | None,
) -> int:
    """Stages of the pipelined build that runs a call, 0 where the classic kernel does: the build
    asked for is a pipelined one and it covers the call (fp16/bf16 queries, head_dim 64 or 128, no
    window or cap, the partition's block-table entries within what it stages, slot numbers in 32
    bits); anything else falls back to the classic kernel."""
    stages = _PIPE_STAGES.get(build, 0)
    covered = (
        query_dtype in (torch.float16, torch.bfloat16)
        and head_dim in _PIPE_HEAD_DIMS
        and window is None
        and softcap is None
        and _pipe_stages_table(partition_size, block_size)
        and num_slots < 2**31
    )
    return stages if covered else 0


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
    window: int | None = None,
    softcap: float | None = None,
    build: str | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context; writes and returns out.

    out, query: [B, H, D] (token stride free, heads contiguous, out must not overlap query);
    kv_cache: [2, num_blocks, block_size, KVH, D] contiguous, H a multiple of KVH, D 64, 96, 128 or 256,
    in the query's dtype or FP8 E4M3 (keys read as stored * k_scale, values * v_scale);
    block_tables: int32 [>= B, max_blocks]; seq_lens: int32 [>= B] (context length including the
    new token). max_seq_len bounds every seq_len (default: the block table's capacity) and sizes
    the partitions' workspace; the pipelined build (2 stages) launches one wave of blocks that
    claim every partition (loop_grid_blocks) where its batch is large enough (_loops); the classic
    kernels and pipe3 launch a block for every partition. Longer contexts are split
    into partitions (partition_size tokens, a multiple of 32; default 512, smaller for small
    batches, 1024 for large ones: _wide_partitions_fit) reduced through an fp32 workspace of
    attention_workspace_numel(...) elements.
    window: a sliding window, the last `window` tokens only (the partitions then cover at most
    the window); softcap: scores capped at softcap * tanh(score / softcap). None: off.
    build: "classic", "pipe" or "pipe3" (default: ZLLM_DECODE_ATTENTION); a pipelined build runs
    where it covers the call (decode_build_stages), the classic kernel elsewhere.
    """
    op = "paged_attention_decode"
    device = check_cuda(
        op, out=out, query=query, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens, workspace=workspace
    )
    suffix = dtype_suffix(op, query, "query")
    check_dtype(op, query.dtype, out=out)
    variant = cache_variant(op, kv_cache, query.dtype)
    k_scale, v_scale = check_kv_scale(op, "k_scale", k_scale), check_kv_scale(op, "v_scale", v_scale)
    if not variant:  # a model-dtype cache holds the values themselves
        k_scale = v_scale = 1.0
    check_dtype(op, torch.int32, block_tables=block_tables, seq_lens=seq_lens)
    check_heads_layout(op, query, "query")
    check_heads_layout(op, out, "out")
    check_dim(op, kv_cache, "kv_cache", 5)
    check_contiguous(op, kv_cache=kv_cache, seq_lens=seq_lens)
    check_dim(op, block_tables, "block_tables", 2)
    check_dim(op, seq_lens, "seq_lens", 1)
    batch, num_heads, head_dim = query.shape
    two, num_blocks, block_size, kv_heads, cache_head_dim = kv_cache.shape
    if two != 2 or cache_head_dim != head_dim:
        fail(op, f"kv_cache must be [2, num_blocks, block_size, kv_heads, {head_dim}], got {tuple(kv_cache.shape)}")
    if head_dim not in _ATTN_HEAD_DIMS:
        fail(op, f"head_dim {head_dim} is not supported {_ATTN_HEAD_DIMS}")
    if num_heads % kv_heads:
        fail(op, f"{num_heads} query heads are not a multiple of {kv_heads} kv heads")
    if out.shape != query.shape:
        fail(op, f"out {tuple(out.shape)} must match query {tuple(query.shape)}")
    if out.data_ptr() == query.data_ptr() and batch:
        fail(op, "out must not overlap query")
    if block_tables.shape[0] < batch or seq_lens.shape[0] < batch:
        fail(op, f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} need >= {batch} rows")
    if block_tables.stride(1) != 1 and block_tables.shape[1] > 1:
        fail(op, f"block_tables rows must be contiguous, got strides {block_tables.stride()}")
    if not aligned16(kv_cache):
        fail(op, "kv_cache must be 16-byte aligned")
    if batch > MAX_GRID_YZ:
        fail(op, f"batch {batch} exceeds {MAX_GRID_YZ}")
    if batch == 0:
        return out
    max_blocks = block_tables.shape[1]
    capacity = max_blocks * block_size
    max_len = capacity if max_seq_len is None else min(int(max_seq_len), capacity)
    if window is not None and window <= 0:
        fail(op, f"window {window} must be positive (None: no window)")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        fail(op, f"softcap {softcap} must be finite and positive (None: no cap)")
    max_len = max(min(max_len, window or max_len), 1)  # the tokens one sequence attends to
    if partition_size is not None and (partition_size <= 0 or partition_size % 32):
        fail(op, f"partition_size {partition_size} must be a positive multiple of 32")
    size, parts = attention_partitions(batch, num_heads, kv_heads, max_len, device, partition_size, block_size)
    if parts > _MAX_REDUCE_PARTS:
        fail(op, f"{max_len} tokens make {parts} partitions of {size}; at most {_MAX_REDUCE_PARTS}")

    group = num_heads // kv_heads
    chunk = _group_chunk(group, batch, kv_heads)
    num_chunks = -(-group // chunk)
    if kv_heads * num_chunks > MAX_GRID_YZ:
        fail(op, f"{kv_heads} kv heads x {num_chunks} head chunks exceed the grid's {MAX_GRID_YZ}")
    ws_out = ws_ml = None
    ws_out_ptr = ws_ml_ptr = np.uint64(0)
    if parts > 1:
        numel = attention_workspace_numel(batch, num_heads, head_dim, parts)
        if workspace is None:
            ws = _workspace(device, numel)
        else:
            check_dtype(op, torch.float32, workspace=workspace)
            check_contiguous(op, workspace=workspace)
            if workspace.numel() < numel:
                fail(op, f"workspace has {workspace.numel()} floats; {numel} needed")
            ws = workspace
        ws_out = ws.data_ptr()
        ws_ml = ws_out + batch * num_heads * parts * head_dim * 4
        ws_out_ptr, ws_ml_ptr = np.uint64(ws_out), np.uint64(ws_ml)

    args = (
        ptr(out),
        ws_out_ptr,
        ws_ml_ptr,
        ptr(query),
        ptr(kv_cache),
        value_cache_address(kv_cache),
        ptr(block_tables),
        ptr(seq_lens),
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
        np.int32(window or 0),
        np.float32(softcap * math.log2(math.e) if softcap else 0.0),
    )
    grid_yz = (kv_heads * num_chunks, batch)  # a partition's blocks: kv heads x chunks, sequences
    # ZLLM_PDL_ATTENTION: the decode kernels and the reduce wait for the kernel before them
    # (csrc/attention.cuh ZLLM_DECODE_ATTENTION_PDL_WAIT), so the next one (the o projection's
    # GEMV at batch 1) can launch early and load its first weights while attention runs.
    pdl = envs.ZLLM_PDL_ATTENTION
    if build is None:
        build = envs.ZLLM_DECODE_ATTENTION
    elif build not in envs.DECODE_ATTENTION_BUILDS:
        fail(op, f"build {build!r} is not one of {envs.DECODE_ATTENTION_BUILDS}")
    stages = decode_build_stages(
        build, query.dtype, head_dim, block_size, size, num_blocks * block_size, window, softcap
    )
    if stages:
        kernel = f"paged_attention_decode_pipe_{suffix}{variant}_d{head_dim}_g{chunk}_s{stages}"
        shared = pipe_shared_bytes(head_dim, kv_cache.element_size(), stages)
        looped = (
            parts > 1
            and stages in _PIPE_LOOP_STAGES
            and _loops(batch, num_heads, kv_heads, device)
            and loop_claims_fit(batch, parts, grid_yz[0])
        )
        if looped:
            kernel += "_loop"  # one wave of blocks that claim every partition (csrc/attention_pipe.cuh)
        if shared > _STATIC_SHARED_LIMIT:
            allow_shared_memory("attention_kernels", kernel, device, shared)
        grid = (parts, *grid_yz)
        if looped:
            resident = resident_blocks("attention_kernels", kernel, device, _ATTN_THREADS, shared)
            grid = (loop_grid_blocks(device, resident), 1, 1)
            args = (*args, np.int32(batch))
        launch("attention_kernels", kernel, device, grid, (_ATTN_THREADS,), args, shared_mem=shared, pdl=pdl)
    else:
        # The plain kernels have no registers to spare for a window or a cap: their own families,
        # in a module of their own. A block a partition (only the pipelined build loops).
        family = "_cap" if softcap else "_win" if window else ""
        kernel = f"paged_attention_decode_{suffix}{variant}{family}_d{head_dim}_g{chunk}"
        module = "attention_window_kernels" if family else "attention_kernels"
        launch(module, kernel, device, (parts, *grid_yz), (_ATTN_THREADS,), args, pdl=pdl)
    if parts > 1:
        reduce_args = (
            ptr(out),
            ws_out_ptr,
            ws_ml_ptr,
            ptr(seq_lens),
            np.int32(num_heads),
            np.int32(block_size),
            np.int32(max_blocks),
            np.int64(out.stride(0)),
            np.int32(size),
            np.int32(parts),
            np.int32(window or 0),
        )
        launch(
            "attention_kernels",
            f"paged_attention_reduce_{suffix}_d{head_dim}",
            device,
            (num_heads, batch),
            (head_dim,),
            reduce_args,
            shared_mem=parts * 4,
            pdl=pdl,
        )
    return out
