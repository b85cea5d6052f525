"""A worker: one device (or CPU rank), one model shard, one KV cache.

In this process layout the worker is called in-process by the engine core; the worker process
entry point wraps the same object behind a socket.
"""

from __future__ import annotations

import logging
import os

import torch

from zllm.config import EngineConfig
from zllm.ipc.messages import StepInput, StepOutput
from zllm.workers.distributed import init_tensor_parallel
from zllm.workers.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """Rank R of a tensor-parallel group uses GPU R."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but no CUDA device is available")
    if rank >= torch.cuda.device_count():
        raise ValueError(f"device: rank {rank} needs GPU {rank}, but only {torch.cuda.device_count()} are visible")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


class Worker:
    """One rank's model shard. Also implements the engine core's Executor protocol, so that a
    single worker can run in-process (tp 1)."""

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.device = resolve_device(config.device, rank)
        self.tp = init_tensor_parallel(config, rank, self.device)
        if self.device.type == "cpu" and self.tp.size > 1:
            # Ranks share the machine's cores; without a cap each would start one thread per core.
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // self.tp.size))
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, self.device, self.tp)
        self.runner.load_model()
        logger.info(
            "rank %d: model loaded: %s on %s (%s)", rank, config.model_name, self.device, self.runner.dtype
        )

    def determine_num_kv_blocks(self) -> int:
        return self.runner.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.capture_graphs()

    def execute_step(self, step: StepInput) -> StepOutput:
        output = self.runner.execute_step(step)
        output.failed_requests = self.runner.failures.take()  # new requests it could not take
        return output

    def shutdown(self) -> None:
        self.runner.graphs = None
        self.runner.kv_caches = []
        self.runner.model = None
        if self.device.type == "cuda":
            import gc

            gc.collect()
            torch.cuda.empty_cache()
        self.tp.destroy()
