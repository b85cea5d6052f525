"""Matrix-vector products for one token (csrc/gemv_kernels.cu): the f32/f16/bf16 GEMV, one warp
a row or split over a few warps a row, the same for 2 to 8 rows (gemv_rows: tensor cores for
fp16/bf16), and the GEMV over FP8 E4M3 weights. Not named gemv.py: the package's `kernels.gemv`
function would shadow the module.

gemv and gemv_rows take `lora` (a LoRAEpilogue): the same product plus multi-LoRA's expand for
each row's adapter slot, in the kernel's epilogue (zllm/workers/lora.py's layout; the shrink runs
before, csrc/lora_kernels.cu), so a projection with LoRA at decode saves the expand's launch.

GEMV_BOUND, GEMV_ROWS_VARIANT and FP8_GEMV_VARIANT are read from zllm.envs once, at import (A/B
switches a benchmark sets in the environment; a test or benchmark in-process patches the
constants here)."""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np
import torch

from zllm import envs
from zllm.workers.attention import KV_FP8
from zllm.workers.kernels.allreduce import lamport_buffer_args, lamport_common_checks
from zllm.workers.kernels.cache import value_cache_address
from zllm.workers.kernels.checks import (
    DTYPE_SUFFIX,
    aligned16,
    cache_variant,
    check_cuda,
    check_dtype,
    check_kv_scale,
    dtype_suffix,
    fail,
    overlaps,
    ptr,
)
from zllm.workers.kernels.loader import launch

_GEMV_ROWS_PER_BLOCK = 4  # kGemvWarps warps of one row each
_GEMV_WARPS = 4  # kGemvWarps: the warps of a block of every build


def gemv_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gemv() takes this product: one CUDA row, a dtype it has, 16-byte-aligned rows."""
    return x.dim() == 2 and x.shape[0] == 1 and _dense_layout_ok(x, weight)


def _dense_layout_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x [M, K] and weight [N, K]: CUDA, one dtype the kernels have, contiguous rows starting on
    16 bytes, K a whole number of 16-byte units."""
    if x.dim() != 2 or weight.dim() != 2 or x.dtype not in DTYPE_SUFFIX or weight.dtype != x.dtype:
        return False
    per16 = 16 // x.element_size()
    return (
        x.is_cuda
        and weight.is_cuda
        and x.shape[1] == weight.shape[1]
        and x.shape[1] % per16 == 0
        and x.is_contiguous()
        and weight.is_contiguous()
        and aligned16(x, weight)
    )


class LoRAEpilogue(NamedTuple):
    """Multi-LoRA's expand for a GEMV's epilogue: weight row n of x's row r also gets
    b[n, slot, :] . t[r, p R .. p R + R] (slot = token_slots[r], -1: nothing; p: the part of n).

    t [rows, P * R] float32: lora_shrink's output; b [N, slots, R] in x's dtype; token_slots
    [rows] int32 on the device (read by the kernel: CUDA graphs may hold the launch); part_ends:
    the end row of each of the P <= 3 fused parts (the last is N)."""

    t: torch.Tensor
    b: torch.Tensor
    token_slots: torch.Tensor
    part_ends: list[int]


def lora_epilogue_supported(dtype: torch.dtype, rank: int) -> bool:
    """Whether the fused kernels take a LoRA of this dtype and rank: whole 16-byte pieces of a
    B row, one a lane of a warp (rank <= 256 for fp16 / bf16, 128 for fp32)."""
    if dtype not in DTYPE_SUFFIX:
        return False
    per16 = 16 // torch.empty((), dtype=dtype).element_size()
    return rank > 0 and rank % per16 == 0 and rank <= 32 * per16


def _lora_args(op: str, x: torch.Tensor, n: int, lora: LoRAEpilogue) -> tuple:
    """The fused expand's launch arguments (csrc/gemv_kernels.cu's ZLLM_LORA_PARAMS order), checked."""
    t, b, token_slots, part_ends = lora
    check_cuda(op, x=x, t=t, b=b, token_slots=token_slots)
    check_dtype(op, x.dtype, b=b)
    check_dtype(op, torch.float32, t=t)
    check_dtype(op, torch.int32, token_slots=token_slots)
    rows, parts = x.shape[0], len(part_ends)
    if b.dim() != 3 or b.shape[0] != n or not lora_epilogue_supported(b.dtype, b.shape[2]):
        fail(op, f"b {tuple(b.shape)} must be [{n}, slots, R], R a whole number of 16-byte pieces, at most 32")
    rank = b.shape[2]
    if not 1 <= parts <= 3 or part_ends[-1] != n or list(part_ends) != sorted(part_ends):
        fail(op, f"part_ends {part_ends} must be 1 to 3 increasing ends, the last {n}")
    if tuple(t.shape) != (rows, parts * rank) or tuple(token_slots.shape) != (rows,):
        fail(
            op, f"t {tuple(t.shape)} must be ({rows}, {parts * rank}), token_slots {tuple(token_slots.shape)} ({rows},)"
        )
    if not (t.is_contiguous() and b.is_contiguous() and token_slots.is_contiguous() and aligned16(t, b)):
        fail(op, "t, b and token_slots must be contiguous, t and b 16-byte aligned")
    ends = [*part_ends, n, n][:2]
    return (
        ptr(t),
        ptr(b),
        ptr(token_slots),
        np.int32(b.shape[1]),
        np.int32(rank),
        np.int32(parts * rank),
        np.int32(ends[0]),
        np.int32(ends[1]),
    )


def gemv(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    variant: str | None = None,
    lora: LoRAEpilogue | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """out [1, N] = x [1, K] @ weight [N, K]^T (+ bias [N]) (+ LoRA's expand: `lora`), fp32
    accumulation; returns out. variant (benchmarks): "" the one-warp-per-row kernel, "b<B>" the
    split kernel of that bound with gemv_split's warps per row, "s<S>_b<B>" a given split;
    default GEMV_BOUND. pdl=False for a weight the kernel before wrote (the split builds load their
    first round of weights before they wait for it)."""
    op = "gemv"
    device = check_cuda(op, out=out, x=x, weight=weight, bias=bias)
    suffix = dtype_suffix(op, x, "x")
    check_dtype(op, x.dtype, out=out, weight=weight, bias=bias)
    if not gemv_supported(x, weight):
        fail(
            op,
            f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be one contiguous row and "
            f"contiguous 16-byte-aligned rows of a length divisible by {16 // x.element_size()}",
        )
    n = weight.shape[0]
    _check_gemv_out(op, out, bias, n)
    if n == 0:
        return out
    args = (ptr(out), ptr(x), ptr(weight), ptr(bias), np.int32(n), np.int32(x.shape[1]))
    if lora is not None:
        args += _lora_args(op, x, n, lora)
    name = "gemv_lora" if lora is not None else "gemv"
    bound = GEMV_BOUND if variant is None else variant
    if not bound:
        launch("gemv_kernels", f"{name}_{suffix}", device, (-(-n // _GEMV_ROWS_PER_BLOCK),), (128,), args, pdl=pdl)
        return out
    split_text, _, bound = bound.rpartition("_") if bound.startswith("s") else ("", "", bound)
    split = int(split_text[1:]) if split_text else gemv_split(x.shape[1] // (16 // x.element_size()))
    if bound not in GEMV_BOUNDS or split not in GEMV_SPLITS:
        fail(op, f"variant {variant!r}: built are splits {GEMV_SPLITS} and bounds {GEMV_BOUNDS}")
    launch(
        "gemv_kernels",
        f"{name}_{suffix}_s{split}_{bound}",
        device,
        (-(-n * split // _GEMV_ROWS_PER_BLOCK),),
        (128,),
        args,
        pdl=pdl,  # every gemv build waits for the kernel before it (csrc/common.cuh pdl_wait)
    )
    return out


def gemv_add(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, add: torch.Tensor
) -> torch.Tensor:
    """out [1, N] = add + (x [1, K] @ weight [N, K]^T (+ bias)), the product rounded to the dtype
    before the add as a separate add would see it: a residual add in the epilogue of the b6 build
    (gemv_split's warps a row), fp16 and bf16. out must not share memory with add. Returns out."""
    op = "gemv_add"
    device = check_cuda(op, out=out, x=x, weight=weight, bias=bias, add=add)
    suffix = dtype_suffix(op, x, "x")
    check_dtype(op, x.dtype, out=out, weight=weight, bias=bias, add=add)
    if x.dtype not in NORM_GEMV_DTYPES:
        fail(op, f"the _add builds take fp16 and bf16, got {x.dtype}")
    if not gemv_supported(x, weight):
        fail(op, f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be one row and 16-byte-aligned rows")
    n = weight.shape[0]
    _check_gemv_out(op, out, bias, n)
    if tuple(add.shape) != (1, n) or not add.is_contiguous():
        fail(op, f"add must be a contiguous [1, {n}], got {tuple(add.shape)}")
    if out.data_ptr() == add.data_ptr():
        fail(op, "out must not be add: the other blocks still read it")
    if n == 0:
        return out
    split = gemv_split(x.shape[1] // (16 // x.element_size()))
    args = (ptr(out), ptr(x), ptr(weight), ptr(bias), np.int32(n), np.int32(x.shape[1]), ptr(add))
    grid = (-(-n * split // _GEMV_ROWS_PER_BLOCK),)
    launch("gemv_kernels", f"gemv_{suffix}_s{split}_b6_add", device, grid, (128,), args, pdl=True)
    return out


def _check_one_row(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """The one-row builds' operands (x one row, weight's rows 16-byte aligned, bias [n] or None);
    returns n, weight's rows."""
    if not gemv_supported(x, weight):
        fail(op, f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be one row and 16-byte-aligned rows")
    n = weight.shape[0]
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        fail(op, f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")
    return n


# The _push builds' dtype (csrc/gemv_kernels.cu): the Lamport kernels' one 16-bit type.
PUSH_DTYPES = (torch.bfloat16,)


def gemv_push(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    add: torch.Tensor | None,
    buffer: torch.Tensor,
    peers: tuple[int, ...],
    flags: torch.Tensor,
    rank: int,
    slot_bytes: int,
) -> None:
    """This rank's x [1, K] @ weight [N, K]^T (+ bias) (+ add, rounded as gemv_add rounds it),
    stored by the b6 build's epilogue straight into every rank's Lamport buffer (`buffer`, `peers`,
    `flags`, `rank`, `slot_bytes` as allreduce.lamport_all_reduce takes them) for
    allreduce.lamport_sum_pushed, launched next, to sum: a row-parallel layer's product and its
    all-reduce without a launch between them that reads the product back. bf16 (the Lamport
    kernels' 16-bit type). Collective: every rank launches it, then the sum, in the same order."""
    op = "gemv_push"
    device = check_cuda(op, x=x, weight=weight, bias=bias, add=add, buffer=buffer, flags=flags)
    _, world = lamport_common_checks(op, x.dtype, buffer, peers, flags, rank, slot_bytes, 0)
    if x.dtype not in PUSH_DTYPES:
        fail(op, f"the _push builds take bfloat16, got {x.dtype}")
    check_dtype(op, x.dtype, weight=weight, bias=bias, add=add)
    n = _check_one_row(op, x, weight, bias)
    if add is not None and (tuple(add.shape) != (1, n) or not add.is_contiguous()):
        fail(op, f"add must be a contiguous [1, {n}], got {tuple(add.shape)}")
    if (n * x.element_size()) % 16 or n * x.element_size() > slot_bytes:
        fail(op, f"{n} rows must be whole 16-byte units and at most {slot_bytes} bytes (a Lamport slot)")
    if any(t is not None and overlaps(t, buffer) for t in (x, weight, bias, add)):
        fail(op, "x, weight, bias and add must not overlap the Lamport buffer")
    if n == 0:
        return
    split = gemv_split(x.shape[1] // (16 // x.element_size()))
    args = (
        ptr(x),
        ptr(weight),
        ptr(bias),
        np.int32(n),
        np.int32(x.shape[1]),
        ptr(add),
        *lamport_buffer_args(buffer, peers),
        ptr(flags),
        np.int32(rank),
        np.int64(slot_bytes // 16),
    )
    grid = (-(-n * split // _GEMV_ROWS_PER_BLOCK),)
    launch("gemv_kernels", f"gemv_bf16_s{split}_b6_push_w{world}", device, grid, (128,), args, pdl=True)


def _check_pair_output(op: str, out: torch.Tensor, bias: torch.Tensor | None, n: int) -> int:
    """The act-and-mul GEMVs' output [1, n / 2] and bias [n] (both contiguous); returns n / 2."""
    d = n // 2
    if tuple(out.shape) != (1, d) or not out.is_contiguous():
        fail(op, f"out must be a contiguous [1, {d}], got {tuple(out.shape)}")
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        fail(op, f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")
    return d


def _norm_args(op: str, x: torch.Tensor, eps: float) -> tuple:
    """The launch argument of a _norm build's RMSNorm epsilon (checked: x of a 16-bit dtype the
    builds have, eps finite and >= 0)."""
    if x.dtype not in NORM_GEMV_DTYPES:
        fail(op, f"the norm-carrying builds take fp16 and bf16, got {x.dtype}")
    if not np.isfinite(eps) or eps < 0:
        fail(op, f"norm_eps must be finite and >= 0, got {eps}")
    return (np.float32(eps),)


# The dtypes of the _norm and _add builds (csrc/gemv_kernels.cu kNorm, kAdd).
NORM_GEMV_DTYPES = (torch.float16, torch.bfloat16)


def gemv_act_and_mul(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gelu: bool = False,
    norm_eps: float | None = None,
) -> torch.Tensor:
    """out [1, d] = act(g) * u, g and u the halves of x [1, K] @ weight [2d, K]^T (+ bias [2d]): a
    gate_up projection (the gate's rows, then the up's) and its gated activation (silu, or gelu
    with the tanh approximation) in one launch, bit for bit what gemv's b6 build (gemv_split's
    warps a row) then silu_and_mul / gelu_tanh_and_mul write. norm_eps: x is a residual stream
    row and the product is of its RMSNorm, whose weight is folded into weight's columns: each
    sum times rsqrt(mean(x^2) + norm_eps) before the bias (silu only). Returns out."""
    op = "gemv_act_and_mul"
    device = check_cuda(op, out=out, x=x, weight=weight, bias=bias)
    suffix = dtype_suffix(op, x, "x")
    check_dtype(op, x.dtype, out=out, weight=weight, bias=bias)
    if norm_eps is not None and gelu:
        fail(op, "the norm-carrying build has silu only")
    n = weight.shape[0] if weight.dim() == 2 else 0
    if not gemv_supported(x, weight) or n % 2:
        fail(
            op,
            f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be one contiguous row and an even number "
            f"of contiguous 16-byte-aligned rows of a length divisible by {16 // x.element_size()}",
        )
    d = _check_pair_output(op, out, bias, n)
    if d == 0:
        return out
    split = gemv_split(x.shape[1] // (16 // x.element_size()))
    warps = max(_GEMV_WARPS, 2 * split)  # csrc PairBlock: a pair of rows is 2 split warps
    pairs = warps // (2 * split)
    name = f"gemv_{suffix}_s{split}_b6_{'gelu_tanh' if gelu else 'silu'}_and_mul"
    args = (ptr(out), ptr(x), ptr(weight), ptr(bias), np.int32(d), np.int32(x.shape[1]))
    if norm_eps is not None:
        name, args = f"{name}_norm", args + _norm_args(op, x, norm_eps)
    launch("gemv_kernels", name, device, (-(-d // pairs),), (32 * warps,), args, pdl=True)
    return out


class RopeCache(NamedTuple):
    """What rotary_embedding_and_cache takes besides q, k and v, for the q/k/v GEMV that does its
    work in the epilogue (gemv_rope_cache, fp8_gemv_rope_cache): one token at `positions[0]`,
    full rotary (cos and sin [max_pos, head_dim / 2]), k and v stored at `slot_mapping[0]` of
    kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] (of x's dtype, or FP8 E4M3
    quantized by k_scale and v_scale)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_heads: int
    k_scale: float = 1.0
    v_scale: float = 1.0


def rope_cache_supported(x: torch.Tensor, n: int, rope: RopeCache) -> bool:
    """Whether the q/k/v GEMVs with the rotary + cache epilogue take this token: full rotary, a
    cache of x's dtype or FP8 in the usual layout, n rows of q, k and v of its heads."""
    cache = rope.kv_cache
    if cache.dim() != 5 or cache.shape[0] != 2 or not cache.is_contiguous() or cache.dtype not in (x.dtype, KV_FP8):
        return False
    kv_heads, head_dim = cache.shape[3], cache.shape[4]
    return (
        head_dim % 2 == 0
        and n == (rope.num_heads + 2 * kv_heads) * head_dim
        and rope.cos.dim() == 2
        and rope.cos.shape == rope.sin.shape
        and rope.cos.shape[1] == head_dim // 2
        and rope.cos.is_contiguous()
        and rope.sin.is_contiguous()
        and rope.cos.dtype == torch.float32
        and rope.positions.dtype == torch.int64
        and rope.slot_mapping.dtype == torch.int64
        and rope.positions.numel() == 1
        and rope.slot_mapping.numel() == 1
    )


def _rope_cache_args(op: str, x: torch.Tensor, out: torch.Tensor, n: int, rope: RopeCache) -> tuple[str, int, tuple]:
    """(entry-point suffix, pairs, the epilogue's launch arguments) for a q/k/v product of n rows."""
    positions, cos, sin, kv_cache, slot_mapping, num_heads, k_scale, v_scale = rope
    check_cuda(op, positions=positions, cos=cos, sin=sin, kv_cache=kv_cache, slot_mapping=slot_mapping)
    check_dtype(op, torch.int64, positions=positions, slot_mapping=slot_mapping)
    check_dtype(op, torch.float32, cos=cos, sin=sin)
    variant = cache_variant(op, kv_cache, x.dtype)
    k_scale, v_scale = check_kv_scale(op, "k_scale", k_scale), check_kv_scale(op, "v_scale", v_scale)
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
        fail(
            op,
            f"kv_cache must be a contiguous [2, num_blocks, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}",
        )
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    if head_dim % 2 or n != (num_heads + 2 * kv_heads) * head_dim:
        fail(
            op,
            f"{n} rows are not q, k and v of {num_heads} + 2 x {kv_heads} heads of the cache's even head_dim {head_dim}",
        )
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != head_dim // 2:
        fail(op, f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be [max_pos, {head_dim // 2}] (full rotary)")
    if not (cos.is_contiguous() and sin.is_contiguous()) or positions.numel() != 1 or slot_mapping.numel() != 1:
        fail(op, "cos and sin must be contiguous, positions and slot_mapping [1]: the one token's")
    if tuple(out.shape) != (1, n) or not out.is_contiguous():
        fail(op, f"out must be a contiguous [1, {n}], got {tuple(out.shape)}")
    slots = num_blocks * block_size
    args = (
        ptr(positions),
        ptr(cos),
        ptr(sin),
        ptr(kv_cache),
        value_cache_address(kv_cache),
        ptr(slot_mapping),
        np.int32(num_heads),
        np.int32(kv_heads),
        np.int32(head_dim),
        np.int64(cos.shape[0]),
        np.int64(slots),
        np.float32(1.0 / k_scale),
        np.float32(1.0 / v_scale),
    )
    return variant, n // 2, args


def gemv_rope_cache(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rope: RopeCache,
    norm_eps: float | None = None,
) -> torch.Tensor:
    """out [1, n] = x [1, K] @ weight [n, K]^T (+ bias), the q/k/v projection of one token, with
    q and k rotated and k and v stored in the cache (RopeCache) in the same launch: bit for bit
    gemv's b6 build then rotary_embedding_and_cache on out's q, k and v. norm_eps: as
    gemv_act_and_mul's. Returns out."""
    op = "gemv_rope_cache"
    device = check_cuda(op, out=out, x=x, weight=weight, bias=bias)
    suffix = dtype_suffix(op, x, "x")
    check_dtype(op, x.dtype, out=out, weight=weight, bias=bias)
    n = _check_one_row(op, x, weight, bias)
    variant, pairs, rope_args = _rope_cache_args(op, x, out, n, rope)
    split = gemv_split(x.shape[1] // (16 // x.element_size()))
    warps = max(_GEMV_WARPS, 2 * split)  # csrc PairBlock
    args = (ptr(out), ptr(x), ptr(weight), ptr(bias), np.int32(x.shape[1]), *rope_args)
    name = f"gemv_{suffix}_s{split}_b6_rope_cache{variant}"
    if norm_eps is not None:
        name, args = f"{name}_norm", args + _norm_args(op, x, norm_eps)
    launch("gemv_kernels", name, device, (-(-pairs // (warps // (2 * split))),), (32 * warps,), args, pdl=True)
    return out


# The split GEMV's builds (csrc/gemv_kernels.cu gemv_<T>_s<S>_b<B>): S warps per row, B the
# __launch_bounds__ minimum blocks per SM (b0: none; b4, b6: ptxas issues a round's loads
# together). GEMV_BOUND picks the bound of the default GEMV ("": the one-warp-per-row kernel).
# b6 with gemv_split's warps beat the one-warp-per-row kernel on every projection of Llama-3-8B
# (2.41-3.12 -> 2.61-3.17 TB/s) and Qwen3-30B-A3B (o: 1.63 -> 2.16 TB/s) on the H100
# (benchmarks/gemv.py, 2026-11-25); ZLLM_GEMV_BOUND overrides it.
GEMV_SPLITS = (1, 2, 4)
GEMV_BOUNDS = ("b0", "b4", "b6")
GEMV_BOUND = envs.ZLLM_GEMV_BOUND
_GEMV_ROUND_UNITS = 32 * 8  # 16-byte units a warp covers in one round of 8 loads a lane


def gemv_split(units: int) -> int:
    """Warps per row for rows of `units` 16-byte units: the fewest that leave each warp one
    round of loads, at most 4."""
    for split in GEMV_SPLITS:
        if -(-units // split) <= _GEMV_ROUND_UNITS:
            return split
    return GEMV_SPLITS[-1]


def _check_gemv_out(op: str, out: torch.Tensor, bias: torch.Tensor | None, n: int, rows: int = 1) -> None:
    if tuple(out.shape) != (rows, n) or not out.is_contiguous():
        fail(op, f"out must be a contiguous [{rows}, {n}], got {tuple(out.shape)}")
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        fail(op, f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")


# ---- 2 to 8 rows (csrc/gemv_kernels.cu gemv_rows_*) -----------------------------------------------
# The builds: gemv_rows_<T>_mma_g<G>_s<S> (fp16, bf16: tensor cores, G groups of 8 weight rows a
# warp) and gemv_rows_<T>_fma_t<R>_s<S> (every dtype: CUDA cores, R accumulators a lane), S warps
# a row range; both take any m <= 8 (rows past m masked). A variant names one: "mma_g<G>_s<S>",
# "fma_s<S>" (R from m), or "mma" / "fma" with the default split; "" or None: the default (mma for
# fp16/bf16, fma for fp32).
GEMV_ROWS_MAX = 8
GEMV_ROWS_GROUPS = (1, 2)
GEMV_ROWS_TOKENS = (2, 4, 8)
GEMV_ROWS_SPLITS = (1, 2, 4)
_ELEMENT_SIZE = {"f32": 4, "f16": 2, "bf16": 2}
# The mma default splits a row range over the fewest warps (1, 2 or 4) that give a launch at least
# this many warps: 16 a SM on the H100's 132, each with a round of 8 16-byte weight loads a lane
# in flight (Llama-3-8B: qkv, o and down split 4 ways, gate_up and the head not at all). A guess
# from the one-row kernel's loads in flight, to be checked by `benchmarks/gemv.py --rows`.
GEMV_ROWS_MIN_WARPS = 2048
# ZLLM_GEMV_ROWS_VARIANT=mma_g2_s4 (say) runs that build for every 2-8-row product: the A/B
# switch of a model-level benchmark.
GEMV_ROWS_VARIANT = envs.ZLLM_GEMV_ROWS_VARIANT


def gemv_rows_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gemv_rows() takes this product: 2 to 8 CUDA rows, a dtype it has, and gemv()'s
    layout (contiguous 16-byte-aligned rows of a whole number of 16-byte units)."""
    return x.dim() == 2 and 2 <= x.shape[0] <= GEMV_ROWS_MAX and _dense_layout_ok(x, weight)


def gemv_rows_kernel(suffix: str, m: int, n: int, k: int, variant: str | None = None) -> tuple[str, int]:
    """(entry point, weight rows a block) of gemv_rows for m rows of x against an [n, k] weight of
    dtype suffix (f32, f16, bf16); variant as above. Raises ValueError for a variant not built."""
    if not 1 <= m <= GEMV_ROWS_MAX:
        fail("gemv_rows", f"{m} rows: the kernels take 1 to {GEMV_ROWS_MAX}")
    if not variant:
        variant = "fma" if suffix == "f32" else "mma"
    match = re.fullmatch(r"(mma|fma)(?:_g(\d+))?(?:_s(\d+))?", variant)
    family = match.group(1) if match else ""
    groups = int(match.group(2)) if match and match.group(2) else 1
    split = int(match.group(3)) if match and match.group(3) else None
    if (
        family not in ("mma", "fma")
        or (family == "mma" and suffix == "f32")
        or (family == "fma" and match.group(2))
        or groups not in GEMV_ROWS_GROUPS
        or split not in (None, *GEMV_ROWS_SPLITS)
    ):
        fail(
            "gemv_rows",
            f"variant {variant!r} for {suffix}: the builds are mma_g<G>_s<S> (f16, bf16; G in {GEMV_ROWS_GROUPS}) "
            f"and fma_s<S> (every dtype), S in {GEMV_ROWS_SPLITS}, or 'mma' / 'fma' with the default split",
        )
    if family == "mma":
        tiles = -(-n // (8 * groups))
        if split is None:
            split = next((s for s in GEMV_ROWS_SPLITS if tiles * s >= GEMV_ROWS_MIN_WARPS), GEMV_ROWS_SPLITS[-1])
        return f"gemv_rows_{suffix}_mma_g{groups}_s{split}", 8 * groups * (_GEMV_WARPS // split)
    tokens = next(t for t in GEMV_ROWS_TOKENS if t >= m)
    if split is None:  # the one-row kernel's split: a row's sums are then that kernel's, bit for bit
        split = gemv_split(k * _ELEMENT_SIZE[suffix] // 16)
    return f"gemv_rows_{suffix}_fma_t{tokens}_s{split}", _GEMV_WARPS // split


def gemv_rows(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    variant: str | None = None,
    lora: LoRAEpilogue | None = None,
) -> torch.Tensor:
    """out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]) (+ LoRA's expand: `lora`) for
    2 <= M <= 8, fp32 accumulation, the weights read once for all M rows; returns out. A row's
    result does not depend on M. variant (benchmarks): a build (see gemv_rows_kernel); default
    GEMV_ROWS_VARIANT, else the shape's."""
    op = "gemv_rows"
    device = check_cuda(op, out=out, x=x, weight=weight, bias=bias)
    suffix = dtype_suffix(op, x, "x")
    check_dtype(op, x.dtype, out=out, weight=weight, bias=bias)
    if not gemv_rows_supported(x, weight):
        fail(
            op,
            f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be 2 to {GEMV_ROWS_MAX} contiguous rows and "
            f"contiguous 16-byte-aligned rows of a length divisible by {16 // x.element_size()}",
        )
    m, k = x.shape
    n = weight.shape[0]
    _check_gemv_out(op, out, bias, n, rows=m)
    if n == 0:
        return out
    name, rows_per_block = gemv_rows_kernel(suffix, m, n, k, GEMV_ROWS_VARIANT if variant is None else variant)
    args = (ptr(out), ptr(x), ptr(weight), ptr(bias), np.int32(m), np.int32(n), np.int32(k))
    if lora is not None:
        args += _lora_args(op, x, n, lora)
        name = name.replace("gemv_rows_", "gemv_rows_lora_", 1)
    launch("gemv_kernels", name, device, (-(-n // rows_per_block),), (128,), args)
    return out


def fp8_gemv_supported(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether fp8_gemv() takes this product: one CUDA row, E4M3 weights with rows of a multiple
    of 16 bytes, fp32 scales per row [N, 1] or per 128x128 tile."""
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.dtype not in DTYPE_SUFFIX:
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
        and aligned16(x, weight)
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
# Issue 40's builds (csrc/gemv_kernels.cu, bf16 with per-row scales), by family: (tiles of 16 rows
# a warp, 0 for the CUDA-core split build of one row; 16-byte units a row a round; x staged as f16
# in shared memory). "_split": gemv_fp8_bf16_split_s<S> (S warps a row, 4 loads a lane in flight);
# "_mma_g<G>u<U>[x]": gemv_fp8_bf16_mma_g<G>u<U>[x]_s<S> on tensor cores, 2 G U loads a lane in
# flight, "x" staging x once a block (fewer instructions a byte: see the kernel's comment). A
# variant is a family, with "_s<S>" for a given split or without for the shape's (fp8_gemv_kernel).
FP8_GEMV_FAMILIES = {
    "_split": (0, 4, False),
    "_mma_g1u4": (1, 4, False),
    "_mma_g2u2": (2, 2, False),
    "_mma_g1u4x": (1, 4, True),
    "_mma_g2u2x": (2, 2, True),
    "_mma_g1u8x": (1, 8, True),
    "_mma_g2u4x": (2, 4, True),
}
FP8_GEMV_SPLITS = (1, 2, 4)
# The staged builds keep x in dynamic shared memory (K * 2 bytes); past this K they give way to the
# unstaged build of the same tiles (Llama-3-70B's down projection, K = 28672, runs _mma_g<G>u<U'>
# there). A launch gets 48 KB of shared memory without an opt-in, static (the split's partial
# sums, up to 512 bytes) and dynamic together: 47.5 KB of x.
FP8_GEMV_STAGED_MAX_K = 24320
# The tensor-core builds' default split: the fewest warps a 16-row tile (1, 2, 4) that give the
# launch at least this many warps (gemv_rows' rule: 16 a SM on the H100's 132). Llama-3-8B:
# gate_up splits 2 ways with G = 1 (1792 tiles), qkv, o and down 4 ways.
FP8_GEMV_MMA_MIN_WARPS = 2048
_FP8_SPLIT_ROUND_UNITS = 32 * 4  # 16-byte units a warp of the split build covers in one round
# ZLLM_FP8_GEMV=_r2u2 (say) runs that build for the model's bf16 per-row layers: the A/B switch of
# benchmarks/gpu/run_perf.sh's gemv and fp8gemv2 parts. Any variant of fp8_gemv_variants() goes,
# so this is also the switch that makes one of issue 40's builds the model's FP8 GEMV.
FP8_GEMV_VARIANT = envs.ZLLM_FP8_GEMV


def parse_fp8_gemv_wide(raw: str) -> tuple[int, str] | None:
    """ZLLM_FP8_GEMV_WIDE's "MIN_N:VARIANT" (say "16384:_split"): the build for the wide layers
    (gate_up), whose best build differs from the narrow ones' (issue 40's GB/s table). None: unset."""
    if not raw:
        return None
    min_n, sep, variant = raw.partition(":")
    if not sep or not min_n.strip().isdigit() or int(min_n) < 1:
        raise ValueError(f"ZLLM_FP8_GEMV_WIDE={raw!r}: expected MIN_N:VARIANT, e.g. 16384:_split")
    variant = variant.strip()
    if variant not in ("", *fp8_gemv_variants()):
        raise ValueError(f"ZLLM_FP8_GEMV_WIDE={raw!r}: {variant!r} is not one of {fp8_gemv_variants()}")
    return int(min_n), variant


def fp8_gemv_variant_for(n: int) -> str:
    """The build a bf16 per-row FP8 layer of n output rows runs: ZLLM_FP8_GEMV_WIDE's past its
    MIN_N, else ZLLM_FP8_GEMV's."""
    if FP8_GEMV_WIDE is not None and n >= FP8_GEMV_WIDE[0]:
        return FP8_GEMV_WIDE[1]
    return FP8_GEMV_VARIANT


def fp8_gemv_variants(with_splits: bool = True) -> list[str]:
    """Every variant fp8_gemv takes: the rows-per-warp builds, then issue 40's families (and, with
    with_splits, each of their splits)."""
    families = list(FP8_GEMV_FAMILIES)
    splits = [f"{family}_s{s}" for family in families for s in FP8_GEMV_SPLITS] if with_splits else []
    return sorted(_FP8_GEMV_SHAPES) + families + splits


def fp8_gemv_kernel(variant: str, n: int, k: int) -> tuple[str, int, int]:
    """(entry point, weight rows a block, dynamic shared memory bytes) of fp8_gemv's bf16 per-row
    build `variant` for an [n, k] weight. Raises ValueError for a variant not built."""
    if variant in _FP8_GEMV_SHAPES:
        return f"gemv_fp8_bf16{variant}", _GEMV_ROWS_PER_BLOCK * _FP8_GEMV_SHAPES[variant][0], 0
    match = re.fullmatch(r"(_\w+?)(?:_s(\d+))?", variant)
    family = match.group(1) if match else ""
    split = int(match.group(2)) if match and match.group(2) else None
    if family not in FP8_GEMV_FAMILIES or split not in (None, *FP8_GEMV_SPLITS):
        fail(
            "fp8_gemv",
            f"variant {variant!r}: the builds are {sorted(_FP8_GEMV_SHAPES)}, and {sorted(FP8_GEMV_FAMILIES)} "
            f"with an optional _s<S> (S in {FP8_GEMV_SPLITS}), all but '' for bf16 with per-row scales",
        )
    tiles, unroll, staged = FP8_GEMV_FAMILIES[family]
    units = k // 16
    if tiles == 0:
        if split is None:
            split = next((s for s in FP8_GEMV_SPLITS if -(-units // s) <= _FP8_SPLIT_ROUND_UNITS), FP8_GEMV_SPLITS[-1])
        return f"gemv_fp8_bf16_split_s{split}", _GEMV_WARPS // split, 0
    if staged and k > FP8_GEMV_STAGED_MAX_K:
        staged, unroll = False, 8 // (2 * tiles)  # the unstaged build of these tiles: 8 loads a lane
    if split is None:
        row_tiles = -(-n // (16 * tiles))
        split = next((s for s in FP8_GEMV_SPLITS if row_tiles * s >= FP8_GEMV_MMA_MIN_WARPS), FP8_GEMV_SPLITS[-1])
    name = f"gemv_fp8_bf16_mma_g{tiles}u{unroll}{'x' if staged else ''}_s{split}"
    return name, 16 * tiles * (_GEMV_WARPS // split), 2 * k if staged else 0


FP8_GEMV_WIDE = parse_fp8_gemv_wide(envs.ZLLM_FP8_GEMV_WIDE)


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
    picks another build (one of fp8_gemv_variants(); bf16 with per-row scales only; None:
    fp8_gemv_variant_for(N) there, the default build elsewhere)."""
    op = "fp8_gemv"
    device = check_cuda(op, out=out, x=x, weight=weight, scale=scale, bias=bias)
    suffix = dtype_suffix(op, x, "x")
    check_dtype(op, x.dtype, out=out, bias=bias)
    if not fp8_gemv_supported(x, weight, scale):
        fail(
            op,
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, scale {tuple(scale.shape)} "
            f"{scale.dtype}: need one contiguous row, contiguous 16-byte-aligned E4M3 rows of a multiple of "
            f"16, and fp32 scales per row [N, 1] or per 128x128 tile",
        )
    n, k = weight.shape
    _check_gemv_out(op, out, bias, n)
    if n == 0:
        return out
    expected = (-(-n // 128), -(-k // 128)) if block else (n, 1)
    if tuple(scale.shape) != expected:
        fail(op, f"scale must be {expected} ({'per tile' if block else 'per row'}), got {tuple(scale.shape)}")
    per_row_bf16 = suffix == "bf16" and not block
    if variant is None:
        variant = fp8_gemv_variant_for(n) if per_row_bf16 else ""
    if variant and not per_row_bf16:
        fail(op, f"variant {variant!r}: the builds other than '' are for bf16 with per-row scales")
    if variant:
        name, rows_per_block, shared = fp8_gemv_kernel(variant, n, k)
    else:
        name, rows_per_block, shared = f"gemv_fp8_{suffix}{'_block' if block else ''}", _GEMV_ROWS_PER_BLOCK, 0
    args = (ptr(out), ptr(x), ptr(weight), ptr(scale), ptr(bias), np.int32(n), np.int32(k))
    # The rows-per-warp builds and _split wait for the kernel before them (programmatic dependent
    # launch, csrc/common.cuh); the tensor-core builds do not, so they never launch with PDL.
    pdl = "_mma_" not in name
    launch("gemv_kernels", name, device, (-(-n // rows_per_block),), (128,), args, shared_mem=shared, pdl=pdl)
    return out


def fp8_gemv_act_and_mul(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    gelu: bool = False,
) -> torch.Tensor:
    """out [1, d] = act(g) * u, g and u the halves of x [1, K] @ (weight [2d, K] (E4M3) * scale)^T
    (+ bias [2d]): a gate_up projection (the gate's rows, then the up's) and its gated activation
    (silu, or gelu with the tanh approximation) in one launch, bit for bit what fp8_gemv's default
    build then silu_and_mul / gelu_tanh_and_mul write. Per-row scales [2d, 1] only. Returns out."""
    op = "fp8_gemv_act_and_mul"
    device = check_cuda(op, out=out, x=x, weight=weight, scale=scale, bias=bias)
    suffix = dtype_suffix(op, x, "x")
    check_dtype(op, x.dtype, out=out, bias=bias)
    n, k = weight.shape
    if not fp8_gemv_supported(x, weight, scale) or tuple(scale.shape) != (n, 1) or n % 2:
        fail(
            op,
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, scale {tuple(scale.shape)} "
            f"{scale.dtype}: need one contiguous row, an even number of contiguous 16-byte-aligned E4M3 rows "
            f"of a multiple of 16, and fp32 scales per row [N, 1]",
        )
    d = _check_pair_output(op, out, bias, n)
    if d == 0:
        return out
    name = f"gemv_fp8_{suffix}_{'gelu_tanh' if gelu else 'silu'}_and_mul"
    args = (ptr(out), ptr(x), ptr(weight), ptr(scale), ptr(bias), np.int32(d), np.int32(k))
    launch("gemv_kernels", name, device, (-(-d // _GEMV_WARPS),), (128,), args, pdl=True)
    return out


def fp8_gemv_rope_cache(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    rope: RopeCache,
) -> torch.Tensor:
    """out [1, n] = x [1, K] @ (weight [n, K] (E4M3) * scale [n, 1])^T (+ bias), the q/k/v
    projection of one token, with q and k rotated and k and v stored in the cache (RopeCache) in
    the same launch: bit for bit fp8_gemv's default build then rotary_embedding_and_cache on
    out's q, k and v. Returns out."""
    op = "fp8_gemv_rope_cache"
    device = check_cuda(op, out=out, x=x, weight=weight, scale=scale, bias=bias)
    suffix = dtype_suffix(op, x, "x")
    check_dtype(op, x.dtype, out=out, bias=bias)
    n, k = weight.shape
    if not fp8_gemv_supported(x, weight, scale) or tuple(scale.shape) != (n, 1):
        fail(
            op, f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, scale {tuple(scale.shape)}: one row, per-row scales"
        )
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        fail(op, f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")
    variant, pairs, rope_args = _rope_cache_args(op, x, out, n, rope)
    args = (ptr(out), ptr(x), ptr(weight), ptr(scale), ptr(bias), np.int32(k), *rope_args)
    name = f"gemv_fp8_{suffix}_rope_cache{variant}"
    launch("gemv_kernels", name, device, (-(-pairs // _GEMV_WARPS),), (128,), args, pdl=True)
    return out
