"""Assemble an engine core and its workers in the calling process (offline use and tests).

At tp 1 the single worker runs right here. At tp > 1 every rank is a worker process (each GPU
needs its own process; with the Ray backend a Ray actor, at any tp), driven from here by the same
executor the engine-core process uses, over sockets in a private runtime directory that lives as long as the engine.
"""

from __future__ import annotations

import dataclasses
import shutil

import zmq

from zllm.config import EngineConfig
from zllm.enginecore.core import EngineCore
from zllm.enginecore.executor import make_executor
from zllm.ipc.addresses import make_private_runtime_dir
from zllm.ipc.messages import GrammarBitmask, StepInput, StepOutput


def build_inprocess_core(config: EngineConfig) -> EngineCore:
    if config.tensor_parallel_size == 1 and config.distributed_executor_backend == "mp":
        from zllm.workers.worker import Worker

        return EngineCore(config, Worker(config))
    workers = WorkerProcessGroup(config)
    try:
        return EngineCore(config, workers)
    except BaseException:
        workers.shutdown()
        raise


class WorkerProcessGroup:
    """An Executor over worker processes that also owns their sockets' context and directory."""

    def __init__(self, config: EngineConfig) -> None:
        self.runtime_dir = make_private_runtime_dir()
        self.context = zmq.Context()
        try:
            self.executor = make_executor(dataclasses.replace(config, runtime_dir=self.runtime_dir), self.context)
        except BaseException:
            self._release()
            raise

    def determine_num_kv_blocks(self) -> int:
        return self.executor.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.executor.initialize_kv_cache(num_blocks)

    def execute_step(self, step: StepInput) -> StepOutput:
        return self.executor.execute_step(step)

    def submit_step(self, step: StepInput) -> None:
        self.executor.submit_step(step)

    def collect_step(self, flush: bool) -> StepOutput:
        return self.executor.collect_step(flush)

    def send_grammar_bitmask(self, bitmask: GrammarBitmask) -> None:
        self.executor.send_grammar_bitmask(bitmask)

    def shutdown(self) -> None:
        self.executor.shutdown()
        self._release()

    def _release(self) -> None:
        self.context.destroy(linger=0)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
