"""All-reduces over symmetric memory (csrc/allreduce_kernels.cu): a row-parallel layer's partial
output fused with the residual add and the next RMSNorm (ZLLM_ALLREDUCE_NORM, off by default), and
the barrier-free Lamport all-reduce (ZLLM_ALLREDUCE_LAMPORT, on by default at tp 2 and 4), and
its second half alone after a GEMV that pushed its rows itself (lamport_sum_pushed, ZLLM_GEMV_PUSH).

Checked on GPUs by tests/gpu/test_allreduce_norm_gpu.py and test_lamport_all_reduce_gpu.py (2 and 4
H200s, 2026-11-28). The fused norm's barrier kernel meets
the peers at a barrier that spins without a timeout: every rank of the group must launch it with
the same rows, in the same order (zllm/workers/symmetric_all_reduce.py says why and how the
set-up keeps them together)."""

from __future__ import annotations

import numpy as np
import torch

from zllm.workers.kernels.checks import (
    aligned16,
    check_contiguous,
    check_cuda,
    check_dtype,
    fail,
    overlaps,
    ptr,
    threads_for,
)
from zllm.workers.kernels.loader import launch

WORLD_SIZES = (2, 4, 8)  # the entry points' world sizes (_w2, _w4, _w8)
DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the symmetric buffer's dtypes


LAMPORT_SLOTS = 3  # the buffer's slots: launch n uses n % 3 (csrc/allreduce_kernels.cu says why three)
LAMPORT_FLAG_WORDS = 8  # the next launch's slot, the blocks done, the units each slot used (5 used)
LAMPORT_THREADS = 256  # a block's threads (the kernel's launch bound); one 16-byte unit a thread per round
LAMPORT_MAX_BLOCKS = 64  # more units than blocks x threads: each thread takes several
# At least this many blocks, whatever the size: a launch also clears the previous launch's slot,
# which after a prefill's all-reduce (up to the size limit) is far larger than a decode's tensor.
LAMPORT_MIN_BLOCKS = 8
LAMPORT_MAX_WORLD = 8  # the kernels take b0..b7


def lamport_buffer_numel(max_bytes: int, world_size: int, dtype: torch.dtype) -> int:
    """Elements of `dtype` one rank's Lamport buffer holds: 3 slots x world sources x max_bytes."""
    return LAMPORT_SLOTS * world_size * (max_bytes // 16) * 16 // dtype.itemsize


def lamport_sentinel_fill(buffer: torch.Tensor) -> None:
    """Every element of `buffer` to negative zero, the "nothing here yet" mark the kernel waits past."""
    words = buffer.view(torch.int16 if buffer.element_size() == 2 else torch.int32)
    words.fill_(-(1 << (8 * buffer.element_size() - 1)))  # the sign bit alone


def lamport_common_checks(
    op: str, dtype: torch.dtype, buffer: torch.Tensor, peers: tuple[int, ...], flags, rank, slot_bytes, timeout_ns
) -> tuple[str, int]:
    """The checks both Lamport entry points share; returns (dtype suffix, world size)."""
    suffix = DTYPE_SUFFIX.get(dtype)
    if suffix is None:
        fail(op, f"the tensors have dtype {dtype}; expected float32 or bfloat16")
    check_dtype(op, dtype, buffer=buffer)
    check_dtype(op, torch.int32, flags=flags)
    check_contiguous(op, buffer=buffer, flags=flags)
    world = len(peers)
    if world not in WORLD_SIZES:
        fail(op, f"{world} buffers; expected a world of {WORLD_SIZES}")
    if not 0 <= rank < world:
        fail(op, f"rank {rank} is not in a world of {world}")
    if peers[rank] != buffer.data_ptr():
        fail(op, f"peer address {rank} is not this rank's buffer")
    if flags.numel() < LAMPORT_FLAG_WORDS:
        fail(op, f"flags holds {flags.numel()} words; it needs {LAMPORT_FLAG_WORDS}")
    if slot_bytes <= 0 or slot_bytes % 16:
        fail(op, f"slot_bytes {slot_bytes} must be a positive multiple of 16")
    if buffer.nbytes < LAMPORT_SLOTS * world * slot_bytes:
        fail(op, f"the buffer holds {buffer.nbytes} bytes; 3 slots x {world} ranks x {slot_bytes} need more")
    if timeout_ns < 0:
        fail(op, f"timeout_ns {timeout_ns} must be >= 0")
    return suffix, world


def lamport_buffer_args(buffer: torch.Tensor, peers: tuple[int, ...]) -> tuple:
    """own, b0..b7: the kernels take the world's buffers as parameters (unused ones null)."""
    padded = list(peers) + [0] * (LAMPORT_MAX_WORLD - len(peers))
    return (ptr(buffer), *(np.uint64(p) for p in padded))


def lamport_all_reduce(
    out: torch.Tensor,
    x: torch.Tensor,
    buffer: torch.Tensor,
    peers: tuple[int, ...],
    flags: torch.Tensor,
    rank: int,
    slot_bytes: int,
    timeout_ns: int,
) -> torch.Tensor:
    """out = the sum of every rank's x (fp32 in rank order, rounded once: the same bits on every
    rank), through the Lamport buffers: this rank's `buffer` (symmetric memory, filled with
    lamport_sentinel_fill before the first launch, on every rank, before any rank launches) and
    `peers`, the world's addresses of it by rank (this rank's is buffer's). `flags`: this rank's
    int32 launch state (LAMPORT_FLAG_WORDS zeros at first, then the kernels' own). slot_bytes: the
    largest tensor, a multiple of 16. A value that has not arrived after timeout_ns traps the
    kernel (0: wait forever). Collective: every rank must call the Lamport kernels with the same
    shapes in the same order, on one stream."""
    op = "lamport_all_reduce"
    device = check_cuda(op, out=out, x=x, buffer=buffer, flags=flags)
    suffix, world = lamport_common_checks(op, x.dtype, buffer, peers, flags, rank, slot_bytes, timeout_ns)
    check_dtype(op, x.dtype, out=out)
    check_contiguous(op, out=out, x=x)
    if out.shape != x.shape:
        fail(op, f"out {tuple(out.shape)} and x {tuple(x.shape)} differ")
    if x.nbytes % 16 or x.nbytes > slot_bytes or not aligned16(out, x, buffer):
        fail(op, f"x ({x.nbytes} bytes) must be whole 16-byte units, at most {slot_bytes}, and 16-byte aligned")
    if overlaps(out, x) or overlaps(out, buffer) or overlaps(x, buffer):
        fail(op, "out, x and the buffer must not overlap")
    units = x.nbytes // 16
    if units:
        _launch_over_units(
            f"{op}_{suffix}_w{world}",
            device,
            (ptr(out), ptr(x)),
            units,
            buffer,
            peers,
            flags,
            rank,
            slot_bytes,
            timeout_ns,
        )
    return out


def _launch_over_units(
    name: str,
    device: torch.device,
    head: tuple,
    units: int,
    buffer: torch.Tensor,
    peers: tuple[int, ...],
    flags: torch.Tensor,
    rank: int,
    slot_bytes: int,
    timeout_ns: int,
) -> None:
    """Launch a Lamport kernel whose threads stride over `units` 16-byte units: its own leading
    arguments (`head`), then the buffers, flags, rank, units, slot size and spin limit."""
    blocks = min(LAMPORT_MAX_BLOCKS, max(LAMPORT_MIN_BLOCKS, -(-units // LAMPORT_THREADS)))
    args = (
        *head,
        *lamport_buffer_args(buffer, peers),
        ptr(flags),
        np.int32(rank),
        np.int32(units),
        np.int64(slot_bytes // 16),
        np.uint64(timeout_ns),
    )
    launch("allreduce_kernels", name, device, (blocks,), (LAMPORT_THREADS,), args, pdl=True)


def lamport_sum_pushed(
    out: torch.Tensor,
    buffer: torch.Tensor,
    peers: tuple[int, ...],
    flags: torch.Tensor,
    rank: int,
    slot_bytes: int,
    timeout_ns: int,
) -> torch.Tensor:
    """out = the sum of every rank's tensor that matvec.gemv_push, launched just before on every
    rank, stored into the Lamport buffers (lamport_all_reduce's sum and bits, without its read and
    push of the tensor). The operands as lamport_all_reduce takes them; collective, as it is.
    bf16 only, as the push build."""
    op = "lamport_sum_pushed"
    device = check_cuda(op, out=out, buffer=buffer, flags=flags)
    suffix, world = lamport_common_checks(op, out.dtype, buffer, peers, flags, rank, slot_bytes, timeout_ns)
    if out.dtype != torch.bfloat16:
        fail(op, f"the pushed sum is built for bfloat16, got {out.dtype}")
    check_contiguous(op, out=out)
    if out.nbytes % 16 or out.nbytes > slot_bytes or not aligned16(out, buffer):
        fail(op, f"out ({out.nbytes} bytes) must be whole 16-byte units, at most {slot_bytes}, and 16-byte aligned")
    if overlaps(out, buffer):
        fail(op, "out and the buffer must not overlap")
    units = out.nbytes // 16
    if units:
        _launch_over_units(
            f"{op}_{suffix}_w{world}", device, (ptr(out),), units, buffer, peers, flags, rank, slot_bytes, timeout_ns
        )
    return out


def lamport_all_reduce_add_rms_norm(
    out: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    partial: torch.Tensor,
    buffer: torch.Tensor,
    peers: tuple[int, ...],
    flags: torch.Tensor,
    rank: int,
    slot_bytes: int,
    timeout_ns: int,
    eps: float,
    unit_offset: bool = False,
) -> torch.Tensor:
    """all_reduce_add_rms_norm's result (the same bits: out = rms_norm(residual + the rank-order
    fp32 sum of partial), residual updated in place) through the Lamport buffers, as
    lamport_all_reduce takes them, in one launch of one block a row. Collective, as that one."""
    op = "lamport_all_reduce_add_rms_norm"
    device = check_cuda(op, out=out, residual=residual, weight=weight, partial=partial, buffer=buffer, flags=flags)
    suffix, world = lamport_common_checks(op, partial.dtype, buffer, peers, flags, rank, slot_bytes, timeout_ns)
    check_dtype(op, partial.dtype, out=out, residual=residual, weight=weight)
    check_contiguous(op, out=out, residual=residual, weight=weight, partial=partial)
    if partial.dim() != 2 or residual.shape != partial.shape or out.shape != partial.shape:
        fail(
            op,
            f"partial {tuple(partial.shape)}, residual {tuple(residual.shape)}, out {tuple(out.shape)}: one [rows, hidden]",
        )
    rows, hidden = partial.shape
    if tuple(weight.shape) != (hidden,):
        fail(op, f"weight must be [{hidden}], got {tuple(weight.shape)}")
    per16 = 16 // partial.element_size()
    if hidden == 0 or hidden % per16 or not aligned16(out, residual, weight, partial, buffer):
        fail(op, f"hidden {hidden} must be a multiple of {per16} and every tensor 16-byte aligned")
    if partial.nbytes > slot_bytes:
        fail(op, f"partial ({partial.nbytes} bytes) is larger than a slot ({slot_bytes})")
    if any(overlaps(a, b) for a, b in ((out, residual), (out, partial), (residual, partial))) or any(
        overlaps(t, buffer) for t in (out, residual, partial)
    ):
        fail(op, "out, residual, partial and the buffer must not overlap")
    if rows == 0:
        return out
    args = (
        ptr(out),
        ptr(residual),
        ptr(weight),
        ptr(partial),
        *lamport_buffer_args(buffer, peers),
        ptr(flags),
        np.int32(rank),
        np.int64(slot_bytes // 16),
        np.uint64(timeout_ns),
        np.float32(eps),
        np.int32(hidden),
        np.int32(unit_offset),
    )
    # fused_add_rms_norm_vec's block size: the same per-thread order, so the same sum of squares.
    threads = threads_for(hidden // per16, 1024)
    launch("allreduce_kernels", f"{op}_{suffix}_w{world}", device, (rows,), (threads,), args, pdl=True)
    return out


def slots_needed(rows: int, world_size: int) -> int:
    """Signal-pad words one launch of `rows` rows uses on every rank: a slot per block and peer."""
    return rows * world_size


def all_reduce_add_rms_norm(
    out: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    partial: torch.Tensor,
    buffer: torch.Tensor,
    peer_buffers: torch.Tensor,
    peer_pads: torch.Tensor,
    rank: int,
    pad_base: int,
    pad_words: int,
    eps: float,
    unit_offset: bool = False,
) -> torch.Tensor:
    """out = rms_norm(residual + sum of every rank's partial), residual updated in place to
    residual + that sum (each rounded to the dtype as fused_add_rms_norm rounds; the sum in fp32,
    ranks 0..world-1 in order, so every rank gets the same bits). partial [rows, hidden] is copied
    into this rank's symmetric `buffer` first (nothing to copy when it is the buffer's start).
    peer_buffers / peer_pads: int64 device tensors of the world's buffer and signal-pad addresses
    (the buffer's start on every rank); the launch uses pad words [pad_base, pad_base + rows *
    world) of the pads, which hold pad_words each. Collective: every rank must call it alike."""
    op = "all_reduce_add_rms_norm"
    device = check_cuda(
        op,
        out=out,
        residual=residual,
        weight=weight,
        partial=partial,
        buffer=buffer,
        peers=peer_buffers,
        pads=peer_pads,
    )
    suffix = DTYPE_SUFFIX.get(partial.dtype)
    if suffix is None:
        fail(op, f"partial has dtype {partial.dtype}; expected float32 or bfloat16")
    check_dtype(op, partial.dtype, out=out, residual=residual, weight=weight, buffer=buffer)
    check_dtype(op, torch.int64, peer_buffers=peer_buffers, peer_pads=peer_pads)
    check_contiguous(op, out=out, residual=residual, weight=weight, partial=partial, peers=peer_buffers, pads=peer_pads)
    world = peer_buffers.numel()
    if world not in WORLD_SIZES or peer_pads.numel() != world:
        fail(op, f"{world} buffers and {peer_pads.numel()} pads; expected one each for a world of {WORLD_SIZES}")
    if not 0 <= rank < world:
        fail(op, f"rank {rank} is not in a world of {world}")
    if partial.dim() != 2 or residual.shape != partial.shape or out.shape != partial.shape:
        fail(
            op,
            f"partial {tuple(partial.shape)}, residual {tuple(residual.shape)}, out {tuple(out.shape)}: one [rows, hidden]",
        )
    rows, hidden = partial.shape
    if tuple(weight.shape) != (hidden,):
        fail(op, f"weight must be [{hidden}], got {tuple(weight.shape)}")
    per16 = 16 // partial.element_size()
    if hidden == 0 or hidden % per16 or not aligned16(out, residual, weight, partial, buffer):
        fail(op, f"hidden {hidden} must be a multiple of {per16} and every tensor 16-byte aligned")
    if partial.numel() > buffer.numel():
        fail(op, f"partial {tuple(partial.shape)} does not fit the symmetric buffer ({buffer.numel()} elements)")
    if not 0 <= pad_base or pad_base + slots_needed(rows, world) > pad_words:
        fail(
            op,
            f"{rows} rows need {slots_needed(rows, world)} signal-pad words from {pad_base}; the pad has {pad_words}",
        )
    if partial.data_ptr() != buffer.data_ptr() and overlaps(partial, buffer):
        fail(op, "partial must be the buffer's start or lie outside it")
    if overlaps(out, residual) or any(overlaps(t, buffer) for t in (out, residual)):
        fail(op, "out, residual and the symmetric buffer must not overlap")
    if rows == 0:
        return out
    args = (
        ptr(out),
        ptr(residual),
        ptr(weight),
        ptr(partial),
        ptr(peer_buffers),
        ptr(peer_pads),
        np.int32(rank),
        np.int32(pad_base),
        np.float32(eps),
        np.int32(hidden),
        np.int32(unit_offset),
    )
    # fused_add_rms_norm_vec's block size: the same per-thread order, so the same sum of squares.
    threads = threads_for(hidden // per16, 1024)
    launch("allreduce_kernels", f"{op}_{suffix}_w{world}", device, (rows,), (threads,), args, pdl=True)
    return out
