"""The tensor-parallel group of one worker: rendezvous, all-reduce, gather of logits to rank 0.

NCCL on GPU, gloo on CPU, both through torch.distributed; on GPU, small all-reduces may take
PyTorch's symmetric-memory one-shot kernel instead (zllm/workers/symmetric_all_reduce.py). The
rendezvous is a file in the engine's private runtime directory (or whatever
`distributed_init_method` names), never a fixed port; across nodes, master_addr:master_port.
A worker leaves its group before it exits (`leave_process_group`), after its model and graphs
are gone: otherwise NCCL's process group warns at exit that destroy_process_group() was not called.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from zllm.config import EngineConfig
from zllm.ipc.addresses import NodeEndpoints

if TYPE_CHECKING:
    from zllm.workers.symmetric_all_reduce import SymmetricAllReduce

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # GPU: the one-shot path for small all-reduces, set on every rank or on none (agreed at set-up).
    fast: SymmetricAllReduce | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks: `x` itself, summed in place (NCCL/gloo, or one rank), or a
        new tensor (the one-shot path, for tensors it accepts). Callers use the return value."""
        if self.size == 1:
            return x
        if self.fast is not None and self.fast.accepts(x):
            return self.fast.all_reduce(x)
        torch.distributed.all_reduce(x)
        return x

    def fuses_add_rms_norm(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether all_reduce_add_rms_norm takes these operands (shape, dtype and layout only: the
        same answer on every rank)."""
        return self.size > 1 and self.fast is not None and self.fast.accepts_norm(partial, residual, weight)

    def all_reduce_add_rms_norm(
        self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + sum of partial over the ranks), that residual, updated in place) in
        one launch (ZLLM_ALLREDUCE_NORM); only where fuses_add_rms_norm says so."""
        return self.fast.all_reduce_add_rms_norm(partial, residual, weight, eps, unit_offset)

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's `x` along the last dim on rank 0; other ranks get None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        torch.distributed.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.is_first else None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (the sampled tokens: every rank feeds them to its
        next step without waiting for the engine core)."""
        if self.size > 1:
            torch.distributed.broadcast(x, src=0)
        return x

    def destroy(self) -> None:
        self.fast = None  # unmaps the peers' buffers while the group still exists
        if self.size > 1:
            leave_process_group()


LEAVE_LIMIT_S = 10.0  # how long destroy_process_group may take before SIGALRM ends the process


def leave_process_group(limit_s: float = LEAVE_LIMIT_S) -> bool:
    """Destroy this process's default process group, if it has one; True if it did.

    Never raises (a failure is logged) and, called from the main thread, never hangs: NCCL can
    block in it on a peer that is gone, so a default-action SIGALRM ends the process if the call
    has not returned within `limit_s` (an alarm set earlier and due sooner stays as it is; one
    due later is set again afterwards). Only worker processes have a group (tp > 1), so this
    never touches an application's own."""
    distributed = torch.distributed
    if not distributed.is_available() or not distributed.is_initialized():
        return False
    try:
        rank, backend = distributed.get_rank(), distributed.get_backend()
    except Exception:  # a group in a bad state: leaving it is still worth trying
        rank, backend = -1, "?"
    with _alarm_after(limit_s):
        try:
            distributed.destroy_process_group()
        except Exception:
            logger.warning("rank %d: destroy_process_group() failed", rank, exc_info=True)
            return False
    logger.info("rank %d: left the %s group", rank, backend)
    return True


@contextlib.contextmanager
def _alarm_after(seconds: float):
    """End the process (SIGALRM, default action) unless the block is done within `seconds`. An
    alarm due sooner is left as it is, with its own handler; one due later is set again after
    the block. Outside the main thread (where no handler can be set) the block just runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    earlier, interval = signal.getitimer(signal.ITIMER_REAL)
    if 0 < earlier <= seconds:
        yield
        return
    handler = signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if handler is not None:  # None: a handler set outside Python, which cannot be restored
            signal.signal(signal.SIGALRM, handler)
        if earlier:
            signal.setitimer(signal.ITIMER_REAL, max(earlier - (time.monotonic() - started), 0.001), interval)


def rendezvous_method(config: EngineConfig) -> str:
    if config.distributed_init_method:
        return config.distributed_init_method
    if config.tp_spans_nodes:  # rank 0, on the head, hosts the store
        return NodeEndpoints(config.master_addr, config.master_port).rendezvous
    return f"file://{os.path.join(config.runtime_dir, 'tp-rendezvous')}"


def init_tensor_parallel(
    config: EngineConfig, rank: int, device: torch.device, init_method: str | None = None
) -> TensorParallel:
    """Join the group of `config.tensor_parallel_size` ranks (returns at once for tp 1) at
    `init_method`, or where the config says (rendezvous_method)."""
    size = config.tensor_parallel_size
    if size == 1:
        return TensorParallel()
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(
        backend=backend,
        init_method=init_method or rendezvous_method(config),
        world_size=size,
        rank=rank,
        timeout=datetime.timedelta(seconds=config.startup_timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    logger.info("rank %d of %d joined the %s group", rank, size, backend)
    return TensorParallel(rank=rank, size=size)
