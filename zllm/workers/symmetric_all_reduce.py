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
"""

from __future__ import annotations

import logging
import os
import time

import torch

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
        staging = self.buffer[: x.numel()].view_as(x)
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, x, "sum", self.group_name, out)
        return out


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
    tp.fast = fast
    logger.info(
        "rank %d: symmetric-memory one-shot all-reduce for %s tensors up to %d bytes; NCCL above",
        tp.rank,
        dtype,
        fast.max_bytes,
    )


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
