"""The tensor-parallel group of one worker: rendezvous, all-reduce, gather of logits to rank 0.

NCCL on GPU, gloo on CPU, both through torch.distributed; on GPU, small all-reduces may take
PyTorch's symmetric-memory one-shot kernel instead (zllm/workers/symmetric_all_reduce.py). The
rendezvous is a file in the engine's private runtime directory (or whatever
`distributed_init_method` names), never a fixed port; across nodes, master_addr:master_port.
"""

from __future__ import annotations

import datetime
import logging
import os
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
        if self.size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def rendezvous_method(config: EngineConfig) -> str:
    if config.distributed_init_method:
        return config.distributed_init_method
    if config.tp_spans_nodes:  # rank 0, on the head, hosts the store
        return NodeEndpoints(config.master_addr, config.master_port).rendezvous
    return f"file://{os.path.join(config.runtime_dir, 'tp-rendezvous')}"


def init_tensor_parallel(config: EngineConfig, rank: int, device: torch.device) -> TensorParallel:
    """Join the group of `config.tensor_parallel_size` ranks (returns at once for tp 1)."""
    size = config.tensor_parallel_size
    if size == 1:
        return TensorParallel()
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(
        backend=backend,
        init_method=rendezvous_method(config),
        world_size=size,
        rank=rank,
        timeout=datetime.timedelta(seconds=config.startup_timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    logger.info("rank %d of %d joined the %s group", rank, size, backend)
    return TensorParallel(rank=rank, size=size)
