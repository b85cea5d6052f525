"""A worker: one device (or CPU rank), one model shard, one KV cache.

In this process layout the worker is called in-process by the engine core; the worker process
entry point wraps the same object behind a socket.
"""

from __future__ import annotations

import logging

import torch

from zllm.config import EngineConfig
from zllm.ipc.messages import StepInput, StepOutput
from zllm.workers.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but no CUDA device is available")
    return torch.device(name)


class Worker:
    """Implements the engine core's Executor protocol for a single in-process worker."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, self.device)
        self.runner.load_model()
        logger.info("model loaded: %s on %s (%s)", config.model_name, self.device, self.runner.dtype)

    def determine_num_kv_blocks(self) -> int:
        return self.runner.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.capture_graphs()

    def execute_step(self, step: StepInput) -> StepOutput:
        return self.runner.execute_step(step)

    def shutdown(self) -> None:
        self.runner.graphs = None
        self.runner.kv_caches = []
        self.runner.model = None
        if self.device.type == "cuda":
            import gc

            gc.collect()
            torch.cuda.empty_cache()
