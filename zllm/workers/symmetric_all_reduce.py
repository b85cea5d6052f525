"""Small all-reduces through PyTorch's symmetric-memory one-shot kernel (GPU tensor parallelism).

Each rank allocates one buffer in symmetric memory and maps every peer's copy of it over NVLink
(`symm_mem.rendezvous`). `one_shot_all_reduce_copy_out` then copies the local partial sum into
the buffer, meets the peers at a barrier of signal pads, and reads and adds every peer's copy in
the same kernel: ~7 us per decode-sized all-reduce inside a CUDA graph, against ~12 us for NCCL
(benchmarks/all_reduce.py).

The barrier spins on the GPU without a timeout, which makes the protocol stricter than NCCL's:

- every rank must launch the same one-shot kernels in the same order, all on one stream. The
  choice between this path and NCCL depends only on a tensor's shape and dtype, which are the
  same on every rank; no caller may all-reduce on some ranks only;
- a rank must never take this path while a peer takes NCCL, so set-up is agreed: each phase
  that can fail on one rank alone is followed by an NCCL vote (MIN of "it worked here") before
  any rank moves on, and a failed vote puts every rank on NCCL together.

The first engine runs of this path (commit bcdc8fd, removed in 7c2165c) hung one rank at set-up;
nobody saw where. Candidates, from PyTorch's source (torch/csrc/distributed/c10d/symm_mem/) and
not yet confirmed on the GPUs: the set-up fell back to NCCL on a failing rank only (a try/except
per rank), so the ranks parted ways, one spinning in the one-shot barrier or blocked inside the
collective rendezvous while the other waited in NCCL; and rendezvous also set up NVLink
multicast, where a rank that fails cuMulticastAddDevice can leave its peers blocked in
cuMulticastBindMem (pytorch/pytorch#195596, after torch 2.11). The one-shot kernel reads peers'
buffers directly and never needs multicast, so it is switched off here.

ZLLM_ALLREDUCE_NORM (off by default: no faster at tp 2 or 4 on H200s, docs/benchmarks.md) adds a set-up phase and a
self-test, each voted like the others, for zllm's own kernel over the same buffer
(csrc/allreduce_kernels.cu): a row-parallel layer's all-reduce, the residual add and the next
RMSNorm in one launch (TensorParallel.all_reduce_add_rms_norm). It takes the upper half of the
signal pad (PyTorch's kernels use the first words) and leaves every word it uses at 0 after each
launch. A failed vote leaves the one-shot all-reduce as it was, without the fused kernel.

ZLLM_ALLREDUCE_LAMPORT (on by default at tp 2 and 4, where it ran on GPUs; 1 at every tp) replaces the one-shot kernel
for the tensors this path takes with zllm's Lamport kernel (csrc/allreduce_kernels.cu), which
meets no barrier: each rank pushes its tensor into every peer's buffer and waits on its own until
every value has arrived. It needs a buffer of its own (3 slots x world x the size limit, filled
with the "empty" mark on every rank before any rank launches: the vote after the fill is that
barrier), its own launch counter, and a self-test; each phase voted. A failed vote keeps the
one-shot kernel.

ZLLM_GEMV_PUSH (on) adds nothing to set-up: where the Lamport kernel is on, the norm-carrying
decode step's o and down GEMVs store their rows into these buffers themselves and
`lamport_sum_pushed` sums them (`gemv_all_reduce`), with the Lamport all-reduce's bits.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from zllm import envs
from zllm.config import EngineConfig

logger = logging.getLogger(__name__)

# The one-shot kernel is compiled for these dtypes only (CUDASymmetricMemoryOps.cu).
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
# Pointers and sizes the kernel can load in 16-byte vectors; anything else goes to NCCL.
_ALIGNMENT = 16
# The self-test reduces a few numbers: if it has not finished in this time, the barrier never met.
_SELF_TEST_TIMEOUT_S = 60.0


class SymmetricAllReduceHangError(RuntimeError):
    """The one-shot kernel's barrier did not meet; the GPU may still be spinning in it."""


class SymmetricAllReduce:
    """Sums tensors of one dtype and at most `max_bytes` over the group with the one-shot kernel."""

    def __init__(self, buffer: torch.Tensor, group_name: str) -> None:
        self.buffer = buffer  # 1-D, in symmetric memory, rendezvoused with the group
        self.group_name = group_name
        self.max_bytes = buffer.numel() * buffer.element_size()
        self.norm: NormOperands | None = None  # the fused all-reduce + add-RMSNorm (ZLLM_ALLREDUCE_NORM)
        self.lamport: LamportOperands | None = None  # the barrier-free kernel (ZLLM_ALLREDUCE_LAMPORT)
        self.push = False  # the GEMV pushes into the Lamport buffers itself where it can (ZLLM_GEMV_PUSH)
        self.pushed = False  # whether gemv_all_reduce has run (logged once)

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether `x` can take this path. Depends only on shape, dtype and layout (the same on
        every rank), never on values or timing."""
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype == self.buffer.dtype
            and x.is_contiguous()
            and 0 < nbytes <= self.max_bytes
            and nbytes % _ALIGNMENT == 0
            and (x.storage_offset() * x.element_size()) % _ALIGNMENT == 0
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in a new tensor (`x` is left as it was)."""
        out = torch.empty_like(x)
        lamport = self.lamport
        if lamport is not None:
            from zllm.workers.kernels.allreduce import lamport_all_reduce

            return lamport_all_reduce(
                out,
                x,
                lamport.buffer,
                lamport.peers,
                lamport.flags,
                lamport.rank,
                lamport.slot_bytes,
                lamport.timeout_ns,
            )
        staging = self.buffer[: x.numel()].view_as(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, x, "sum", self.group_name, out)
        return out

    def takes_pushed(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether gemv_all_reduce takes a product of `rows` rows of `dtype` (shape and dtype only:
        the same answer on every rank)."""
        from zllm.workers.kernels.matvec import PUSH_DTYPES

        lamport = self.lamport
        nbytes = rows * dtype.itemsize
        return (
            self.push
            and lamport is not None
            and dtype == self.buffer.dtype
            and dtype in PUSH_DTYPES
            and 0 < nbytes <= lamport.slot_bytes
            and nbytes % _ALIGNMENT == 0
        )

    def gemv_all_reduce(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, add: torch.Tensor | None
    ) -> torch.Tensor:
        """The sum over the ranks of each rank's x [1, K] @ weight^T (+ its bias, + its add), in a
        new [1, N] tensor: the GEMV stores its rows into the Lamport buffers itself, and one launch
        sums them (takes_pushed first). The bits of all_reduce over the same products."""
        if not self.pushed:  # once: the tests look for it in every rank's log
            self.pushed = True
            logger.info(
                "rank %d: a row-parallel GEMV pushes its rows into the Lamport buffers (ZLLM_GEMV_PUSH)",
                self.lamport.rank,
            )
        return self._push_and_sum(x, weight, bias, add)

    def _push_and_sum(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, add: torch.Tensor | None
    ) -> torch.Tensor:
        from zllm.workers.kernels.allreduce import lamport_sum_pushed
        from zllm.workers.kernels.matvec import gemv_push

        lamport = self.lamport
        gemv_push(x, weight, bias, add, lamport.buffer, lamport.peers, lamport.flags, lamport.rank, lamport.slot_bytes)
        out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
        return lamport_sum_pushed(
            out, lamport.buffer, lamport.peers, lamport.flags, lamport.rank, lamport.slot_bytes, lamport.timeout_ns
        )

    def accepts_norm(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether all_reduce_add_rms_norm takes these operands. Like accepts: shape, dtype and
        layout only, the same on every rank."""
        from zllm.workers.kernels.allreduce import slots_needed

        norm = self.norm
        if norm is None or partial.dim() != 2 or not self.accepts(partial):
            return False
        rows, hidden = partial.shape
        return (
            residual.shape == partial.shape
            and residual.dtype == partial.dtype
            and residual.is_contiguous()
            and weight.dtype == partial.dtype
            and tuple(weight.shape) == (hidden,)
            and (hidden * partial.element_size()) % _ALIGNMENT == 0
            and (residual.storage_offset() * residual.element_size()) % _ALIGNMENT == 0
            and norm.pad_base + slots_needed(rows, norm.world_size) <= norm.pad_words
        )

    def all_reduce_add_rms_norm(
        self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + the sum of partial over the ranks), residual): residual updated in
        place, the sum copied through this rank's buffer, all in one launch (accepts_norm first)."""
        from zllm.workers.kernels.allreduce import all_reduce_add_rms_norm

        norm = self.norm
        out = torch.empty_like(partial)
        lamport = self.lamport
        if lamport is not None:  # the same arithmetic, without the barriers
            from zllm.workers.kernels.allreduce import lamport_all_reduce_add_rms_norm

            lamport_all_reduce_add_rms_norm(
                out,
                residual,
                weight.contiguous(),
                partial,
                lamport.buffer,
                lamport.peers,
                lamport.flags,
                lamport.rank,
                lamport.slot_bytes,
                lamport.timeout_ns,
                eps,
                unit_offset,
            )
            return out, residual
        all_reduce_add_rms_norm(
            out,
            residual,
            weight.contiguous(),
            partial,
            self.buffer,
            norm.peer_buffers,
            norm.peer_pads,
            norm.rank,
            norm.pad_base,
            norm.pad_words,
            eps,
            unit_offset,
        )
        return out, residual


@dataclass(slots=True)
class NormOperands:
    """What the fused kernel needs beyond the buffer: the world's addresses of it and of the
    signal pads (int64 device tensors), and the pad words it may use."""

    peer_buffers: torch.Tensor
    peer_pads: torch.Tensor
    rank: int
    world_size: int
    pad_base: int
    pad_words: int


@dataclass(slots=True)
class LamportOperands:
    """The Lamport kernels' state on this rank: its buffer (symmetric memory, 3 slots x world x
    slot_bytes), the world's addresses of that buffer by rank (kernel parameters), the launch
    flags (int32, this rank's only), the largest tensor in bytes, and the spin limit."""

    buffer: torch.Tensor
    peers: tuple[int, ...]
    flags: torch.Tensor
    rank: int
    slot_bytes: int
    timeout_ns: int


def attach_symmetric_all_reduce(tp, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Give `tp` (a TensorParallel) the one-shot path for all-reduces of `dtype`, or leave it on
    NCCL. Every rank of the group must call this at the same point of its start-up: the early
    returns depend only on the config, the device type and the dtype, which every rank shares."""
    if tp.size == 1 or device.type != "cuda" or not config.custom_all_reduce_max_bytes:
        return
    if dtype not in SUPPORTED_DTYPES:
        logger.warning(
            "rank %d: no symmetric-memory all-reduce for %s (only %s); NCCL for all reduces",
            tp.rank,
            dtype,
            ", ".join(str(d) for d in SUPPORTED_DTYPES),
        )
        return
    # Multicast is never used by the one-shot kernel, and its set-up can block forever (above).
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    buffer = _run_phase(tp, device, "allocate", lambda: _allocate(config.custom_all_reduce_max_bytes, dtype, device))
    if buffer is None:
        return
    group_name = torch.distributed.group.WORLD.group_name
    if _run_phase(tp, device, "rendezvous", lambda: _rendezvous(buffer, group_name)) is None:
        return
    fast = SymmetricAllReduce(buffer, group_name)
    if _run_phase(tp, device, "self-test", lambda: _self_test(fast, tp.rank, tp.size, device)) is None:
        return
    if _switch_on_every_rank(tp, device, "ZLLM_ALLREDUCE_LAMPORT", default=lamport_by_default(tp.size)):
        _attach_lamport(tp, fast, device)
        if fast.lamport is not None:
            _attach_push(tp, fast, device)
    if _switch_on_every_rank(tp, device, "ZLLM_ALLREDUCE_NORM"):
        _attach_norm(tp, fast, device)
    tp.fast = fast
    logger.info(
        "rank %d: symmetric-memory one-shot all-reduce for %s tensors up to %d bytes; NCCL above",
        tp.rank,
        dtype,
        fast.max_bytes,
    )


# The world sizes at which the Lamport kernel has run its GPU tests and beaten the one-shot kernel.
# tp 2 on 2 x H200 (2026-11-28): 2.8 us against 7.2 an 8 KiB all-reduce, Llama-3-8B W2 2.667 ms
# against 2.987. tp 4 on 4 x H200 (2026-11-28): 3.7 us against 8.4 a 16 KiB all-reduce, Llama-3-70B
# W2 10.293 ms against 11.16, and the engine's fp32 tokens equal HF's. tp 8 has not run on GPUs:
# there ZLLM_ALLREDUCE_LAMPORT=1 turns it on.
LAMPORT_DEFAULT_WORLDS = (2, 4)


def lamport_by_default(world: int) -> bool:
    """Whether ZLLM_ALLREDUCE_LAMPORT left at auto turns the Lamport kernel on for this world."""
    return world in LAMPORT_DEFAULT_WORLDS


def _switch_on_every_rank(tp, device: torch.device, name: str, default: bool = False) -> bool:
    """Whether a kernel switch is on, asked of every rank (collective): the phases it adds are
    collective too, so a rank whose environment differs (nodes started apart) must not run them
    alone. Off, with a warning, unless every rank has it on. A switch left at auto (None) takes
    `default`, which every rank computes alike."""
    value = getattr(envs, name)
    mine = default if value is None else bool(value)
    if same_on_every_rank(int(mine), device):
        return mine
    logger.warning("rank %d: %s is %s here but not on every rank; off", tp.rank, name, "on" if mine else "off")
    return False


def _attach_norm(tp, fast: SymmetricAllReduce, device: torch.device) -> None:
    """Set up the fused all-reduce + add-RMSNorm on every rank or on none: the operands, a check
    that every rank's buffer sits at the same offset in its allocation (the kernel reads a peer's
    rows at its allocation + this rank's offset), and a self-test; each voted."""
    norm = _run_phase(tp, device, "fused-norm set-up", lambda: _norm_operands(fast, device))
    if norm is None:
        return
    if not same_on_every_rank(norm[1], device):
        logger.warning("rank %d: symmetric buffers at different offsets; no fused all-reduce + norm", tp.rank)
        return
    fast.norm = norm[0]
    if _run_phase(tp, device, "fused-norm self-test", lambda: _self_test_norm(fast, tp.rank, tp.size, device)) is None:
        fast.norm = None
        return
    logger.info("rank %d: fused all-reduce + add-RMSNorm kernel on (ZLLM_ALLREDUCE_NORM)", tp.rank)


def _attach_lamport(tp, fast: SymmetricAllReduce, device: torch.device) -> None:
    """Set up the Lamport kernel on every rank or on none: its buffer (allocated, then mapped:
    rendezvous is collective, so only after every rank allocated), filled with the "empty" mark
    and synchronized before the vote (so no rank pushes into a peer's buffer before the peer
    filled it), the same offset check as the fused norm's, then a self-test; each voted. A bad
    ZLLM_ALLREDUCE_SPIN_TIMEOUT_S fails here, on every rank alike, not as a vote's warning."""
    envs.ZLLM_ALLREDUCE_SPIN_TIMEOUT_S  # noqa: B018 - parsed (and refused) before any phase
    buffer = _run_phase(tp, device, "Lamport allocate", lambda: _lamport_allocate(fast, tp.size, device))
    if buffer is None:
        return
    lamport = _run_phase(tp, device, "Lamport set-up", lambda: _lamport_operands(fast, buffer, device))
    if lamport is None:
        return
    operands, offset = lamport
    if not same_on_every_rank(offset, device):
        logger.warning("rank %d: Lamport buffers at different offsets; the one-shot all-reduce stays", tp.rank)
        return
    fast.lamport = operands
    if _run_phase(tp, device, "Lamport self-test", lambda: _self_test_lamport(fast, tp.rank, tp.size, device)) is None:
        fast.lamport = None
        return
    logger.info(
        "rank %d: Lamport all-reduce (ZLLM_ALLREDUCE_LAMPORT) for tensors up to %d bytes",
        tp.rank,
        operands.slot_bytes,
    )


def _attach_push(tp, fast: SymmetricAllReduce, device: torch.device) -> None:
    """Turn on the GEMV push (ZLLM_GEMV_PUSH) on every rank or on none: the switch agreed, then
    a self-test of the push builds and the sum, voted."""
    from zllm.workers.kernels.matvec import PUSH_DTYPES

    if fast.buffer.dtype not in PUSH_DTYPES or not _switch_on_every_rank(tp, device, "ZLLM_GEMV_PUSH", default=True):
        return
    if _run_phase(tp, device, "GEMV push self-test", lambda: _self_test_push(fast, tp.rank, tp.size, device)) is None:
        return
    fast.push = True


def _self_test_push(fast: SymmetricAllReduce, rank: int, size: int, device: torch.device) -> bool:
    """Two pushed sums of small integers (exact in bf16) that differ by rank, row and launch, of
    two sizes (the second finds the slot the first cleared), the first rank's with a bias and a
    residual; both launched on every rank before either is checked, then checked exactly."""
    dtype = fast.buffer.dtype
    results = []
    for launch, n in enumerate((64, 16)):
        rows = torch.arange(n, device=device)
        x = torch.ones(1, 256, dtype=dtype, device=device)
        weight = torch.zeros(n, 256, dtype=dtype, device=device)
        weight[rows, rows] = (rank + 1 + rows % 3 + launch).to(dtype)  # row r's product: that value
        first = rank == 0
        bias = (rows % 5).to(dtype) if first else None
        add = torch.ones(1, n, dtype=dtype, device=device) if first else None
        expected = (size * (size + 1) // 2 + size * (rows % 3 + launch) + rows % 5 + 1).to(dtype)[None]
        results.append((launch, fast._push_and_sum(x, weight, bias, add), expected))
    return _all_exact(rank, "GEMV push self-test", results)


def _lamport_allocate(fast: SymmetricAllReduce, world: int, device: torch.device) -> torch.Tensor:
    import torch.distributed._symmetric_memory as symm_mem

    from zllm.workers.kernels.allreduce import WORLD_SIZES, lamport_buffer_numel

    if world not in WORLD_SIZES:
        raise ValueError(f"the Lamport kernel is built for {WORLD_SIZES} ranks, not {world}")
    slot_bytes = fast.max_bytes // 16 * 16
    if slot_bytes == 0:
        raise ValueError(f"a size limit of {fast.max_bytes} bytes holds no 16-byte unit")
    dtype = fast.buffer.dtype
    return symm_mem.empty(lamport_buffer_numel(slot_bytes, world, dtype), dtype=dtype, device=device)


def _lamport_operands(
    fast: SymmetricAllReduce, buffer: torch.Tensor, device: torch.device
) -> tuple[LamportOperands, int]:
    """The kernel's operands (the buffer mapped into every peer, filled with the "empty" mark and
    synchronized) and this rank's buffer offset in its allocation (bytes)."""
    import torch.distributed._symmetric_memory as symm_mem

    from zllm.workers.kernels.allreduce import LAMPORT_FLAG_WORDS, lamport_sentinel_fill

    handle = symm_mem.rendezvous(buffer, fast.group_name)
    if handle is None:
        raise RuntimeError("rendezvous returned no handle (is the buffer in symmetric memory?)")
    rank = handle.rank
    offset = buffer.data_ptr() - handle.buffer_ptrs[rank]
    lamport_sentinel_fill(buffer)
    torch.cuda.synchronize(device)  # filled here before the vote lets any peer push into it
    operands = LamportOperands(
        buffer=buffer,
        peers=tuple(int(p) + offset for p in handle.buffer_ptrs),
        flags=torch.zeros(LAMPORT_FLAG_WORDS, dtype=torch.int32, device=device),
        rank=rank,
        slot_bytes=fast.max_bytes // 16 * 16,
        timeout_ns=int(envs.ZLLM_ALLREDUCE_SPIN_TIMEOUT_S * 1e9),
    )
    return operands, offset


# The self-test's launches, in elements: every slot used twice or more, and smaller launches after
# larger ones (a slot is cleared by its last launch's size).
_LAMPORT_TEST_SIZES = (8, 1024, 64, 8, 1024, 16, 8)


def _self_test_lamport(fast: SymmetricAllReduce, rank: int, size: int, device: torch.device) -> bool:
    """Seven launches of small integers (exact in bf16 and fp32) that differ by rank and launch,
    the first element -0.0 on every rank (the "empty" mark: it must arrive, as a zero). Every rank
    runs all seven before it checks any, so a wrong sum on one rank cannot leave its peers waiting
    for launches it never made; then each result is checked exactly."""
    dtype = fast.buffer.dtype
    limit = fast.lamport.slot_bytes // dtype.itemsize
    results = []
    for launch, numel in enumerate(_LAMPORT_TEST_SIZES):
        numel = min(numel, limit)
        base = torch.arange(numel, device=device, dtype=torch.float32).remainder(7) + launch
        x = (base + (rank + 1)).to(dtype)
        x[0] = -0.0
        expected = (base * size + size * (size + 1) / 2).to(dtype)
        expected[0] = 0.0
        results.append((launch, fast.all_reduce(x), expected))
    return _all_exact(rank, "Lamport all-reduce self-test", results)


def _all_exact(rank: int, what: str, results: list[tuple[int, torch.Tensor, torch.Tensor]]) -> bool:
    """Once every launch of a self-test has finished (or raise, as _wait_or_hang does): True if
    each (launch, result, expected) matches exactly, else RuntimeError naming the first that
    does not."""
    _wait_or_hang(rank, what)
    for launch, got, expected in results:
        if not torch.equal(got, expected):
            raise RuntimeError(
                f"{what}: launch {launch} ({got.numel()} elements) gave {got.flatten()[:4].tolist()}..., "
                f"expected {expected.flatten()[:4].tolist()}..."
            )
    return True


def same_on_every_rank(value: int, device: torch.device) -> bool:
    """Whether every rank passed the same integer (NCCL MIN and MAX of it; collective)."""
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    low, high = mine.clone(), mine.clone()
    torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN)
    torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX)
    return int(low.item()) == int(high.item())


def _norm_operands(fast: SymmetricAllReduce, device: torch.device) -> tuple[NormOperands, int]:
    """The kernel's operands and this rank's buffer offset in its allocation (bytes)."""
    import torch.distributed._symmetric_memory as symm_mem

    from zllm.workers.kernels.allreduce import WORLD_SIZES

    handle = symm_mem.rendezvous(fast.buffer, fast.group_name)  # the buffer's handle, made at set-up
    rank, world = handle.rank, handle.world_size
    if world not in WORLD_SIZES:
        raise ValueError(f"the fused kernel is built for {WORLD_SIZES} ranks, not {world}")
    offset = fast.buffer.data_ptr() - handle.buffer_ptrs[rank]
    pad_words = _signal_pad_bytes() // 4
    operands = NormOperands(
        peer_buffers=torch.tensor([p + offset for p in handle.buffer_ptrs], dtype=torch.int64, device=device),
        peer_pads=torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=device),
        rank=rank,
        world_size=world,
        pad_base=pad_words // 2,  # the upper half: PyTorch's one-shot and barrier use the first words
        pad_words=pad_words,
    )
    return operands, offset


def _signal_pad_bytes() -> int:
    import torch.distributed._symmetric_memory as symm_mem

    return int(symm_mem.get_signal_pad_size())


def _self_test_norm(fast: SymmetricAllReduce, rank: int, size: int, device: torch.device) -> bool:
    """Three launches (the second and third find the signal pads, or the Lamport slots, as the
    ones before left them), all launched on every rank before any is checked (a wrong result on
    one rank must not leave its peers waiting for a launch it never made): residual exactly
    1 + sum(rank + 1), the norm of a constant row 1 to 1e-2."""
    rows, hidden = 2, 256
    dtype = fast.buffer.dtype
    weight = torch.ones(hidden, dtype=dtype, device=device)
    expected = 1 + size * (size + 1) / 2
    results = []
    for _ in range(3):
        partial = torch.full((rows, hidden), float(rank + 1), dtype=dtype, device=device)
        residual = torch.ones((rows, hidden), dtype=dtype, device=device)
        results.append(fast.all_reduce_add_rms_norm(partial, residual, weight, 1e-6, False))
    _wait_or_hang(rank, "fused all-reduce + norm self-test")
    for out, residual in results:
        if not bool((residual == expected).all()) or not bool(((out.float() - 1).abs() < 1e-2).all()):
            raise RuntimeError(f"fused self-test gave residual {residual[0, :2].tolist()}, out {out[0, :2].tolist()}")
    return True


_HANG_ADVICE = (
    "start without --custom-all-reduce-max-size (NCCL only), or without ZLLM_ALLREDUCE_LAMPORT / "
    "ZLLM_ALLREDUCE_NORM (the kernel whose self-test this was)"
)


def _wait_or_hang(rank: int, what: str) -> None:
    """Wait for the stream's work so far, or raise SymmetricAllReduceHangError after
    _SELF_TEST_TIMEOUT_S (a barrier that never met) or on a CUDA error (a Lamport kernel's spin
    limit traps, which leaves the context unusable: no vote could run on it)."""
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + _SELF_TEST_TIMEOUT_S
    while True:
        try:
            if done.query():
                return
        except RuntimeError as exc:  # torch raises CUDA errors (a trap's among them) as RuntimeError
            raise SymmetricAllReduceHangError(
                f"rank {rank}: the {what} failed on the GPU ({exc}); {_HANG_ADVICE}"
            ) from exc
        if time.monotonic() > deadline:
            raise SymmetricAllReduceHangError(
                f"rank {rank}: the {what} did not finish within {_SELF_TEST_TIMEOUT_S:.0f} s; {_HANG_ADVICE}"
            )
        time.sleep(0.001)


def _run_phase(tp, device: torch.device, name: str, phase):
    """Run one set-up phase on this rank, then vote: its result if it worked on every rank,
    None on every rank otherwise (with the reason logged where it failed)."""
    try:
        result, error = phase(), None
    except SymmetricAllReduceHangError:
        raise  # the stream is stuck behind the kernel: no vote can run; the worker fails instead
    except Exception as exc:  # noqa: BLE001 - any other failure here means: NCCL, on every rank
        result, error = None, exc
    if error is not None:
        logger.warning(
            "rank %d: symmetric-memory all-reduce %s failed: %s: %s", tp.rank, name, type(error).__name__, error
        )
    if not all_ranks_agree(error is None, device):
        if error is None:
            logger.warning("rank %d: symmetric-memory all-reduce %s failed on another rank", tp.rank, name)
        logger.warning("rank %d: NCCL for all reduces", tp.rank)
        return None
    return result


def all_ranks_agree(ok: bool, device: torch.device) -> bool:
    """True on every rank if `ok` is true on every rank (an NCCL all-reduce of the flags, MIN)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def _allocate(max_bytes: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    import torch.distributed._symmetric_memory as symm_mem

    numel = max_bytes // dtype.itemsize
    if numel * dtype.itemsize < _ALIGNMENT:
        raise ValueError(f"custom_all_reduce_max_bytes: {max_bytes} bytes cannot hold one aligned {dtype} tensor")
    return symm_mem.empty(numel, dtype=dtype, device=device)


def _rendezvous(buffer: torch.Tensor, group_name: str) -> torch.Tensor:
    """Map every peer's buffer here (collective; bounded by the process group's store timeout)."""
    import torch.distributed._symmetric_memory as symm_mem

    handle = symm_mem.rendezvous(buffer, group_name)
    if handle is None:
        raise RuntimeError("rendezvous returned no handle (is the buffer in symmetric memory?)")
    return buffer


def _self_test(fast: SymmetricAllReduce, rank: int, size: int, device: torch.device) -> bool:
    """One small one-shot all-reduce, checked exactly. A barrier that never meets (peer memory
    mapped but not reachable) raises after _SELF_TEST_TIMEOUT_S instead of hanging start-up; the
    kernel may still spin, so the worker then fails and exits (its error names the remedy)."""
    probe = torch.full((64,), float(rank + 1), dtype=fast.buffer.dtype, device=device)
    summed = fast.all_reduce(probe)
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + _SELF_TEST_TIMEOUT_S
    while not done.query():
        if time.monotonic() > deadline:
            raise SymmetricAllReduceHangError(
                f"rank {rank}: the symmetric-memory all-reduce self-test did not finish within "
                f"{_SELF_TEST_TIMEOUT_S:.0f} s; start with --custom-all-reduce-max-size 0 (NCCL only)"
            )
        time.sleep(0.001)
    expected = size * (size + 1) / 2
    if not bool((summed == expected).all()):
        raise RuntimeError(f"self-test all-reduce gave {summed[:4].tolist()}..., expected {expected}")
    return True
