"""The fused Mixture-of-Experts kernels (csrc/moe_kernels.cu) on torch tensors.

Reference (zllm/workers/models/moe.py)            Kernels here
layers.moe_route (softmax, top-k, renormalize)  moe_topk_softmax(weights, ids, logits, ...)
Experts.forward (the expert loop)                 fused_experts(x, weights, ids, gate_up, down):
                                                  moe_align, moe_gate_up, moe_down, moe_sum
                                                  gemv_experts(...): moe_gemv_gate_up and
                                                  moe_gemv_down, no sort (a few tokens)
                                                  grouped_mm_experts(...): the same through
                                                  torch._grouped_mm (CUTLASS) for large batches

Like the other wrappers in zllm.workers.kernels: arguments are checked (ValueError with the
reason), launches go to torch's current stream, nothing synchronises with the host, and every
shape depends on the number of tokens only, never on the routing, so a decode step with MoE
layers can be captured in a CUDA graph. fused_experts allocates its scratch with torch (the
graph's pool under capture). GEMV_PAIRS_PER_EXPERT and GROUPED_MM_MIN_ROWS are read from
zllm.envs once, at import.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from zllm import envs
from zllm.workers.kernels.activation import silu_and_mul
from zllm.workers.kernels.checks import check_contiguous, check_cuda, check_dim, check_dtype, dtype_suffix, fail, ptr
from zllm.workers.kernels.loader import launch

_FILE = "moe_kernels"
MAX_EXPERTS = 512  # kMaxExpertsPerLane * 32 in csrc/moe_kernels.cu
_GEMM_DTYPES = (torch.float16, torch.bfloat16)
_GEMM_WARPS = 4  # kMoeWarps
_ALIGN_THREADS = 1024  # kAlignThreads
_TILE_MULTIPLES = (1, 2, 4)  # the built MT: tiles of 16, 32 or 64 rows
_MAX_GRID_Y = 65535  # CUDA's grid limit in y: gemv_experts' pairs
_SPLIT_K = {"m1": True, "m2": False, "m4": False, "m1nosplit": False}  # csrc: the block's warps share rows


def moe_topk_softmax(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, logits: torch.Tensor, renormalize: bool, round_weights: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill topk_weights (fp32 [T, k]) and topk_ids (int32 [T, k]) from router logits [T, E]:
    softmax in fp32, the k largest in descending order, renormalized if asked, rounded through
    the logits' dtype if round_weights (the models that cast the routing weights)."""
    op = "moe_topk_softmax"
    device = check_cuda(op, topk_weights=topk_weights, topk_ids=topk_ids, logits=logits)
    suffix = dtype_suffix(op, logits, "logits")
    check_dtype(op, torch.float32, topk_weights=topk_weights)
    check_dtype(op, torch.int32, topk_ids=topk_ids)
    check_dim(op, logits, "logits", 2)
    check_contiguous(op, topk_weights=topk_weights, topk_ids=topk_ids, logits=logits)
    tokens, num_experts = logits.shape
    if not 1 <= num_experts <= MAX_EXPERTS:
        fail(op, f"{num_experts} experts; 1 to {MAX_EXPERTS} are supported")
    if topk_weights.dim() != 2 or topk_weights.shape[0] != tokens or topk_ids.shape != topk_weights.shape:
        fail(op, f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} must be [{tokens}, k]")
    top_k = topk_weights.shape[1]
    if not 1 <= top_k <= min(num_experts, 32):
        fail(op, f"top_k {top_k} must be between 1 and min({num_experts} experts, 32)")
    if tokens:
        warps = 4
        args = (
            ptr(topk_weights),
            ptr(topk_ids),
            ptr(logits),
            np.int32(tokens),
            np.int32(num_experts),
            np.int32(top_k),
            np.int32(renormalize),
            np.int32(round_weights),
        )
        launch(_FILE, f"moe_topk_softmax_{suffix}", device, (-(-tokens // warps),), (32 * warps,), args)
    return topk_weights, topk_ids


def tile_rows(pairs: int, num_experts: int) -> int:
    """Rows per tile (16, 32 or 64) for `pairs` (token, expert) rows over num_experts: the
    smallest that holds an expert's average share, so a decode batch reads each chosen expert's
    weights about once, and large batches (prefill) reuse each weight load for 64 rows."""
    per_expert = pairs / max(num_experts, 1)
    for multiple in _TILE_MULTIPLES:
        if per_expert <= 16 * multiple:
            return 16 * multiple
    return 16 * _TILE_MULTIPLES[-1]


def max_tiles(pairs: int, num_experts: int, block_m: int) -> int:
    """Tiles the sorted rows can take whatever the routing: each expert used pads to whole tiles."""
    return -(-pairs // block_m) + min(num_experts, pairs)


def moe_align(
    sorted_pairs: torch.Tensor,
    tile_experts: torch.Tensor,
    num_tiles: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
) -> None:
    """Sort the (token, slot) pairs of topk_ids [T, k] (int32, flattened: pair = token * k + slot)
    by expert into tiles of block_m rows: sorted_pairs [tiles * block_m] holds pair indices, each
    expert's from the start of a tile, padded with -1; tile_experts [tiles] each tile's expert (-1
    for the unused); num_tiles [1] the tiles used. tiles >= max_tiles(pairs, E, block_m)."""
    op = "moe_align"
    device = check_cuda(
        op, sorted_pairs=sorted_pairs, tile_experts=tile_experts, num_tiles=num_tiles, topk_ids=topk_ids
    )
    check_dtype(
        op, torch.int32, sorted_pairs=sorted_pairs, tile_experts=tile_experts, num_tiles=num_tiles, topk_ids=topk_ids
    )
    check_contiguous(op, sorted_pairs=sorted_pairs, tile_experts=tile_experts, topk_ids=topk_ids)
    pairs = topk_ids.numel()
    tiles = tile_experts.numel()
    if not 1 <= num_experts <= MAX_EXPERTS or block_m % 16 or block_m <= 0:
        fail(op, f"{num_experts} experts (1 to {MAX_EXPERTS}) and tiles of {block_m} rows (a multiple of 16)")
    if tiles < max_tiles(pairs, num_experts, block_m) or sorted_pairs.numel() != tiles * block_m:
        fail(op, f"{tiles} tiles and {sorted_pairs.numel()} rows cannot hold {pairs} pairs in tiles of {block_m}")
    launch(
        _FILE,
        "moe_align",
        device,
        (1,),
        (_ALIGN_THREADS,),
        (
            ptr(sorted_pairs),
            ptr(tile_experts),
            ptr(num_tiles),
            ptr(topk_ids),
            np.int32(pairs),
            np.int32(num_experts),
            np.int32(block_m),
            np.int32(tiles),
        ),
        shared_mem=2 * num_experts * 4,
    )


def fused_experts_supported(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether fused_experts takes these: CUDA fp16/bf16 tensors, contiguous stacked weights
    [E, 2I, H] and [E, H, I], H and I multiples of 8 (16-byte rows), E <= MAX_EXPERTS."""
    if x.dtype not in _GEMM_DTYPES or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        return False
    if not (x.is_cuda and gate_up.is_cuda and down.is_cuda) or gate_up.dim() != 3 or down.dim() != 3:
        return False
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    return (
        tuple(down.shape) == (num_experts, hidden, inter)
        and two_inter % 2 == 0
        and fused_shape_supported(num_experts, hidden, inter)
        and gate_up.is_contiguous()
        and down.is_contiguous()
        and gate_up.data_ptr() % 16 == 0
        and down.data_ptr() % 16 == 0
    )


def fused_shape_supported(num_experts: int, hidden: int, inter: int) -> bool:
    """The sizes fused_experts takes: H and I multiples of 8 (16-byte rows), 1 <= E <= MAX_EXPERTS."""
    return 1 <= num_experts <= MAX_EXPERTS and hidden % 8 == 0 and inter % 8 == 0 and inter > 0


class _Experts(NamedTuple):
    """The sizes of a valid experts() call."""

    device: torch.device
    suffix: str  # the dtype's kernel suffix
    top_k: int
    num_experts: int
    hidden: int
    inter: int
    tokens: int
    pairs: int  # tokens * top_k


def _check_experts(op: str, x, topk_weights, topk_ids, gate_up, down) -> _Experts:
    """The sizes of valid gemv_experts / fused_experts / grouped_mm_experts arguments."""
    device = check_cuda(op, x=x, topk_weights=topk_weights, topk_ids=topk_ids, gate_up=gate_up, down=down)
    suffix = dtype_suffix(op, x, "x")
    check_dim(op, x, "x", 2)
    if not fused_experts_supported(x, gate_up, down):
        fail(
            op,
            f"x {tuple(x.shape)} {x.dtype}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}: need fp16 or "
            f"bf16, contiguous [E, 2I, H] and [E, H, I] of one dtype, H and I multiples of 8, 1 to {MAX_EXPERTS} experts",
        )
    hidden = gate_up.shape[2]
    if x.shape[1] != hidden or x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        fail(
            op, f"x {tuple(x.shape)} (strides {x.stride()}) must be [T, {hidden}] with 16-byte-aligned contiguous rows"
        )
    check_dtype(op, torch.float32, topk_weights=topk_weights)
    check_dtype(op, torch.int32, topk_ids=topk_ids)
    check_contiguous(op, topk_weights=topk_weights, topk_ids=topk_ids)
    tokens = x.shape[0]
    if topk_weights.dim() != 2 or topk_weights.shape[0] != tokens or topk_ids.shape != topk_weights.shape:
        fail(op, f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} must be [{tokens}, k]")
    top_k = topk_weights.shape[1]
    return _Experts(device, suffix, top_k, gate_up.shape[0], hidden, gate_up.shape[1] // 2, tokens, tokens * top_k)


def _weighted_sum(out: torch.Tensor, weighted: torch.Tensor, top_k: int, suffix: str, device) -> torch.Tensor:
    """out [T, H] = the sum over each token's k rows of weighted [T * k, H] (pair order)."""
    tokens, hidden = out.shape
    threads = min(256, max(32, -(-hidden // 8 // 32) * 32))
    launch(
        _FILE,
        f"moe_sum_{suffix}",
        device,
        (tokens, -(-hidden // (8 * threads))),
        (threads,),
        (ptr(out), ptr(weighted), np.int32(top_k), np.int32(hidden)),
    )
    return out


def grouped_mm_available(device: torch.device) -> bool:
    """torch._grouped_mm's CUTLASS kernels run here (Hopper, a torch that has them)."""
    return hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device) == (9, 0)


def grouped_mm_experts(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """fused_experts' result through torch._grouped_mm: the pairs sorted by expert (torch.sort,
    no host sync), one grouped GEMM for gate_up, the SiLU-and-mul kernel, one grouped GEMM for
    down, then the weighted sum. Tensor-core tiles of CUTLASS's size: the path for prefill-sized
    batches, where fused_experts' register tiles run short of the matmul rate."""
    op = "grouped_mm_experts"
    device, suffix, top_k, num_experts, hidden, _, tokens, _ = _check_experts(
        op, x, topk_weights, topk_ids, gate_up, down
    )
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=device)
    if out.numel() == 0:
        return out
    flat = topk_ids.flatten()
    order = torch.sort(flat, stable=True).indices  # pair indices, grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat))  # bincount would sync for its size
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = x.index_select(0, order // top_k)
    hidden_states = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=ends)
    inter = torch.empty((rows.shape[0], hidden_states.shape[1] // 2), dtype=x.dtype, device=device)
    silu_and_mul(inter, hidden_states)
    expert_out = torch._grouped_mm(inter, down.transpose(1, 2), offs=ends)
    weighted = torch.empty_like(expert_out)
    # bf16 output times the fp32 weight, rounded: the reference's index_add_ addend.
    weighted[order] = (expert_out * topk_weights.flatten()[order, None]).to(x.dtype)
    return _weighted_sum(out, weighted, top_k, suffix, device)


# The sort-free GEMVs' builds (csrc: moe_gemv_*_s<S>_b<B>): S warps per output element, B the
# __launch_bounds__ minimum blocks per SM (b0: none; b4: ptxas issues a round's loads together).
# s1_b4, the default, was fastest on the H100 (benchmarks/moe_kernels.py; the others stay built
# for that comparison).
GEMV_BUILDS = ((1, "b4"), (1, "b0"), (4, "b4"))


def gemv_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    split: int | None = None,
    bound: str | None = None,
) -> torch.Tensor:
    """fused_experts' result without the sort, for a few tokens: moe_gemv_gate_up reads each
    (token, slot) pair's expert rows straight from topk_ids, moe_gemv_down adds the k weighted
    expert outputs of a token in the same pass. Two launches; a pair re-reads an expert that
    another token also chose, which only a handful of tokens can afford. split (warps per
    output) and bound pick another of GEMV_BUILDS; for benchmarks."""
    op = "gemv_experts"
    device, suffix, top_k, _, hidden, inter, tokens, pairs = _check_experts(
        op, x, topk_weights, topk_ids, gate_up, down
    )
    split, bound = split or GEMV_BUILDS[0][0], bound or GEMV_BUILDS[0][1]
    if (split, bound) not in GEMV_BUILDS:
        fail(op, f"split {split} and bound {bound!r}: the builds are {GEMV_BUILDS}")
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=device)
    if pairs == 0:
        return out
    if pairs > _MAX_GRID_Y:
        fail(op, f"{pairs} (token, expert) pairs; at most {_MAX_GRID_Y} (use fused_experts)")
    inter_rows = torch.empty((pairs, inter), dtype=x.dtype, device=device)
    name = f"{suffix}_s{split}_{bound}"
    launch(
        _FILE,
        f"moe_gemv_gate_up_{name}",
        device,
        (-(-inter * split // _GEMM_WARPS), pairs),
        (32 * _GEMM_WARPS,),
        (
            ptr(inter_rows),
            ptr(x),
            ptr(gate_up),
            ptr(topk_ids),
            np.int32(top_k),
            np.int32(inter),
            np.int32(hidden),
            np.int64(x.stride(0)),
        ),
    )
    launch(
        _FILE,
        f"moe_gemv_down_{name}",
        device,
        (-(-hidden * split // _GEMM_WARPS), tokens),
        (32 * _GEMM_WARPS,),
        (
            ptr(out),
            ptr(inter_rows),
            ptr(down),
            ptr(topk_ids),
            ptr(topk_weights),
            np.int32(top_k),
            np.int32(hidden),
            np.int32(inter),
        ),
    )
    return out


# experts() takes gemv_experts while the pairs number at most GEMV_PAIRS_PER_EXPERT times the
# experts (or one token's k): past that, tokens share experts often enough that re-reading them
# costs more than the sort. H100, benchmarks/moe_kernels.py: Qwen3-30B-A3B's layer (128
# experts, top 8) gains up to batch 8 (64 pairs: 192 vs 251 us) and loses at 16 (378 vs 341);
# Mixtral's (8, top 2) gains up to batch 4 (8 pairs: 895 vs 1016) and loses at 8. Half the
# experts keeps both on the safe side. ZLLM_MOE_GEMV_PAIRS overrides it (0: never).
GEMV_PAIRS_PER_EXPERT = envs.ZLLM_MOE_GEMV_PAIRS


def takes_gemv(tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether experts() runs gemv_experts for this batch."""
    pairs = tokens * top_k
    return GEMV_PAIRS_PER_EXPERT > 0 and pairs <= max(top_k, GEMV_PAIRS_PER_EXPERT * num_experts)


# Rows per expert (on average) from which experts() takes torch._grouped_mm over fused_experts.
# H100, benchmarks/moe_kernels.py, Qwen3-30B-A3B's layer: even at 0.5 rows per expert (batch 8:
# 258 vs 255 us), ahead from 4 (batch 64: 526 vs 574 us; batch 256: 575 vs 616 us; batch 2048:
# 134 vs 69 TFLOP/s). ZLLM_MOE_GROUPED_MM_ROWS overrides it (0: never).
GROUPED_MM_MIN_ROWS = envs.ZLLM_MOE_GROUPED_MM_ROWS


def experts(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The MoE experts' output by the faster path for this batch: gemv_experts for a few
    tokens (takes_gemv), fused_experts' register tiles while each expert sees few rows
    (decode), torch._grouped_mm from GROUPED_MM_MIN_ROWS rows per expert on (prefill), where it
    is available. All are graph-safe."""
    if takes_gemv(x.shape[0], topk_ids.shape[-1], gate_up.shape[0]):
        return gemv_experts(x, topk_weights, topk_ids, gate_up, down)
    per_expert = topk_ids.numel() / gate_up.shape[0]
    if 0 < GROUPED_MM_MIN_ROWS <= per_expert and grouped_mm_available(x.device):
        return grouped_mm_experts(x, topk_weights, topk_ids, gate_up, down)
    return fused_experts(x, topk_weights, topk_ids, gate_up, down)


def fused_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    variant: str = "",
) -> torch.Tensor:
    """sum over each token's k experts e of topk_weights * down_e(silu(gate_e x) * up_e x):
    x [T, H] (fp16/bf16, row stride free, 16-byte-aligned rows), topk_weights fp32 [T, k],
    topk_ids int32 [T, k] (each in [0, E)), gate_up [E, 2I, H], down [E, H, I]. Returns [T, H].
    `variant` "nosplit" runs the 16-row tiles without split-K (bf16; benchmarks only)."""
    op = "fused_experts"
    device, suffix, top_k, num_experts, hidden, inter, tokens, pairs = _check_experts(
        op, x, topk_weights, topk_ids, gate_up, down
    )
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=device)
    if pairs == 0:
        return out
    block_m = tile_rows(pairs, num_experts)
    tiles = max_tiles(pairs, num_experts, block_m)
    rows = tiles * block_m
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=device)
    tile_experts = torch.empty(tiles, dtype=torch.int32, device=device)
    num_tiles = torch.empty(1, dtype=torch.int32, device=device)
    moe_align(sorted_pairs, tile_experts, num_tiles, topk_ids, num_experts, block_m)

    name = f"m{block_m // 16}{variant if block_m == 16 else ''}"
    rows_per_block = 8 if _SPLIT_K[name] else 8 * _GEMM_WARPS
    inter_rows = torch.empty((rows, inter), dtype=x.dtype, device=device)
    launch(
        _FILE,
        f"moe_gate_up_{suffix}_{name}",
        device,
        (tiles, -(-inter // rows_per_block)),
        (32 * _GEMM_WARPS,),
        (
            ptr(inter_rows),
            ptr(x),
            ptr(gate_up),
            ptr(sorted_pairs),
            ptr(tile_experts),
            np.int32(top_k),
            np.int32(inter),
            np.int32(hidden),
            np.int64(x.stride(0)),
        ),
    )
    weighted = torch.empty((pairs, hidden), dtype=x.dtype, device=device)
    launch(
        _FILE,
        f"moe_down_{suffix}_{name}",
        device,
        (tiles, -(-hidden // rows_per_block)),
        (32 * _GEMM_WARPS,),
        (
            ptr(weighted),
            ptr(inter_rows),
            ptr(down),
            ptr(sorted_pairs),
            ptr(tile_experts),
            ptr(topk_weights),
            np.int32(hidden),
            np.int32(inter),
        ),
    )
    return _weighted_sum(out, weighted, top_k, suffix, device)
