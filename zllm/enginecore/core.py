"""The engine core: owns the scheduler and drives an executor one step at a time.

It never touches tensors: the executor (in-process worker now, worker processes later) runs the
model. One `step()` is schedule -> execute -> update.
"""

from __future__ import annotations

import logging
from typing import Protocol

from zllm.config import EngineConfig
from zllm.enginecore.block_pool import BlockPool
from zllm.enginecore.kv_cache_manager import KVCacheManager
from zllm.enginecore.request import Request
from zllm.enginecore.scheduler import Scheduler, SchedulerStats
from zllm.ipc.messages import AddRequest, StepInput, StepOutput, TokenDelta

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue holds max_waiting requests: the client should retry later."""


class Executor(Protocol):
    """What the engine core needs from whatever runs the model."""

    def determine_num_kv_blocks(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def execute_step(self, step: StepInput) -> StepOutput: ...

    def shutdown(self) -> None: ...


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        self.num_kv_blocks = config.num_kv_blocks or executor.determine_num_kv_blocks()
        _check_kv_capacity(config, self.num_kv_blocks)
        executor.initialize_kv_cache(self.num_kv_blocks)
        pool = BlockPool(self.num_kv_blocks)
        self.scheduler = Scheduler(config, KVCacheManager(pool, config.block_size))
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens); max concurrency at %d tokens each: %.1fx",
            self.num_kv_blocks,
            config.block_size,
            self.num_kv_blocks * config.block_size,
            config.max_model_len,
            self.num_kv_blocks * config.block_size / config.max_model_len,
        )

    def add_request(self, message: AddRequest) -> None:
        """Queue a request. ValueError: it can never run; QueueFullError: not now."""
        num_tokens = len(message.prompt_token_ids) + len(message.output_token_ids)
        if not message.prompt_token_ids or num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt: {len(message.prompt_token_ids)} tokens; must be between 1 and "
                f"max_model_len - 1 ({self.config.max_model_len - 1})"
            )
        num_waiting = len(self.scheduler.waiting)
        if num_waiting >= self.config.max_waiting and not message.resumed:
            raise QueueFullError(
                f"overloaded: {num_waiting} requests are already waiting (max_waiting={self.config.max_waiting}); "
                "retry later"
            )
        request = Request(
            request_id=message.request_id,
            prompt_token_ids=list(message.prompt_token_ids),
            sampling=message.sampling,
            arrival_time=message.arrival_time,
            eos_token_ids=frozenset(message.eos_token_ids),
            priority=message.priority,
            output_token_ids=list(message.output_token_ids),
        )
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def num_free_kv_blocks(self) -> int:
        return self.scheduler.kv_cache.pool.num_free_blocks

    def step(self) -> list[TokenDelta]:
        step = self.scheduler.schedule()
        if step.is_empty and not (step.finished_ids or step.preempted_ids):
            return []
        # NOTE: an empty step still goes out when it carries finished/preempted ids, or the
        # workers would keep those requests' state forever.
        output = self.executor.execute_step(step)
        return self.scheduler.update_from_output(output)

    def shutdown(self) -> None:
        self.executor.shutdown()


def _check_kv_capacity(config: EngineConfig, num_blocks: int) -> None:
    """Every request must fit alone, or one could wait forever."""
    needed = config.blocks_for_tokens(config.max_model_len)
    if num_blocks < needed:
        raise ValueError(
            f"KV cache too small: {num_blocks} blocks of {config.block_size} tokens hold "
            f"{num_blocks * config.block_size} tokens, but max_model_len={config.max_model_len} needs "
            f"{needed} blocks; raise the KV cache memory or lower max_model_len"
        )
