"""The tensor-parallel group of one worker: rendezvous, all-reduce, gather of logits to rank 0.

NCCL on GPU, gloo on CPU, both through torch.distributed. The rendezvous is a file in the engine's
private runtime directory (or whatever `distributed_init_method` names), never a fixed port.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch

from zllm.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # GPU: a buffer in symmetric memory (mapped into every rank over NVLink) for small all-reduces.
    symmetric: torch.Tensor | None = None
    group_name: str = ""

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (`x` itself on one rank; may be reused as the result).

        Decode-sized tensors go through PyTorch's one-shot symmetric-memory all-reduce: each rank
        reads its peers' partial sums directly over NVLink in one kernel, several times faster
        than NCCL's ring at these sizes (benchmarks/all_reduce.py). Larger ones go to NCCL."""
        if self.size == 1:
            return x
        if self.symmetric is not None and x.numel() <= self.symmetric.numel() and x.dtype == self.symmetric.dtype:
            staging = self.symmetric[: x.numel()].view_as(x)
            out = torch.empty_like(x)
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, x.contiguous(), "sum", self.group_name, out)
            return out
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

    def destroy(self) -> None:
        if self.size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def rendezvous_method(config: EngineConfig) -> str:
    if config.distributed_init_method:
        return config.distributed_init_method
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


def attach_symmetric_buffer(tp: TensorParallel, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
    """GPU, tp > 1: set up the fast path for all-reduces of `dtype` (the model's activations).
    Best effort: without peer access (no NVLink/P2P) or an older torch, NCCL does every reduce."""
    if tp.size == 1 or device.type != "cuda" or config.custom_all_reduce_max_bytes == 0:
        return
    try:
        import torch.distributed._symmetric_memory as symm_mem

        group_name = torch.distributed.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
        buffer = symm_mem.empty(config.custom_all_reduce_max_bytes // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, group_name)
        probe = torch.full((8,), float(tp.rank + 1), dtype=dtype, device=device)
        tp.symmetric, tp.group_name = buffer, group_name
        summed = tp.all_reduce(probe)
        expected = tp.size * (tp.size + 1) / 2
        if not bool((summed == expected).all()):
            raise RuntimeError(f"probe all-reduce gave {summed.tolist()}, expected {expected}")
        logger.info("rank %d: symmetric-memory all-reduce for tensors up to %d bytes", tp.rank,
                    config.custom_all_reduce_max_bytes)
    except Exception as error:  # noqa: BLE001 - any failure means: use NCCL
        tp.symmetric, tp.group_name = None, ""
        logger.warning("rank %d: symmetric-memory all-reduce unavailable (%s); NCCL for all reduces", tp.rank, error)
