"""The engine core: owns the scheduler and drives an executor one step at a time.

It never touches tensors: the executor (a worker in this process at tp 1 offline, worker processes
otherwise) runs the model. One `step()` is schedule -> execute -> update; under async scheduling it is
schedule -> submit, then collect the oldest step in flight -> update, with up to two steps in
flight, so the workers run step N while the core schedules step N+1.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Protocol

from zllm.config import EngineConfig
from zllm.enginecore.block_pool import BlockPool
from zllm.enginecore.kv_cache_manager import KVCacheManager
from zllm.enginecore.pooling_scheduler import PoolingScheduler
from zllm.enginecore.request import Request
from zllm.enginecore.scheduler import Scheduler, SchedulerStats
from zllm.enginecore.step_trace import StepTrace
from zllm.enginecore.structured_outputs import StructuredOutputs
from zllm.ipc.messages import (
    AddPoolingBatch,
    AddRequest,
    GrammarBitmask,
    PooledSlice,
    StepInput,
    StepOutput,
    TokenDelta,
)
from zllm.kv_layout import KVGroup, KVLayout
from zllm.model_spec import ModelSpec

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue holds max_waiting requests: the client should retry later."""


class Executor(Protocol):
    """What the engine core needs from whatever runs the model."""

    def determine_num_kv_blocks(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def execute_step(self, step: StepInput) -> StepOutput: ...

    # Async scheduling: steps go out ahead of their answers, which come back in order.
    def submit_step(self, step: StepInput) -> None: ...

    def collect_step(self, flush: bool) -> StepOutput: ...

    # Structured outputs: the bitmask a submitted step's constrained rows sample under (rank 0).
    def send_grammar_bitmask(self, bitmask: GrammarBitmask) -> None: ...

    def shutdown(self) -> None: ...


_PIPELINE_DEPTH = 2  # steps in flight under async scheduling: one running, one queued behind it
_COMPILE_WAIT_S = 0.01  # idle except for compiling grammars: how long to wait before looking at inputs again


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        self.async_scheduling = bool(config.async_scheduling)
        self._in_flight: deque[int] = deque()  # step ids submitted, not yet collected
        self._num_collected = 0  # steps answered so far
        # step id -> its structured_ids and their drafts, mask not sent yet
        self._bitmask_due: dict[int, tuple[list[str], dict[str, list[int]]]] = {}
        self.pooling = config.runner == "pooling"
        self.trace = StepTrace.from_env(config.data_parallel_rank)  # None unless ZLLM_STEP_TRACE
        self.num_kv_blocks = config.num_kv_blocks or executor.determine_num_kv_blocks()
        if self.pooling:
            self._start_pooling(executor)
            return
        layout = KVLayout.of(ModelSpec.from_pretrained(config.model), config)
        self.kv_groups = layout.groups(self.num_kv_blocks)
        _warn_if_a_long_request_cannot_fit(config, layout, self.kv_groups)
        executor.initialize_kv_cache(self.num_kv_blocks)
        self.scheduler = Scheduler(config, _kv_cache_manager(config, self.kv_groups))
        self.structured = StructuredOutputs(config)
        self.max_concurrency = layout.max_concurrency(self.kv_groups)
        logger.info(
            "KV cache (%s): %d blocks of %d tokens (%d tokens)%s; max concurrency at %d tokens each: %.1fx",
            "fp8_e4m3" if config.kv_cache_dtype.startswith("fp8") else "model dtype",
            self.num_kv_blocks,
            config.block_size,
            self.num_kv_blocks * config.block_size,
            _describe_groups(self.kv_groups),
            config.max_model_len,
            self.max_concurrency,
        )

    def _start_pooling(self, executor: Executor) -> None:
        """A pooling model keeps no KV cache: a nominal pool, and steps of whole inputs."""
        executor.initialize_kv_cache(self.num_kv_blocks)
        self.kv_groups: list[KVGroup] = []
        pool = KVCacheManager(BlockPool(self.num_kv_blocks), self.config.block_size, False)
        self.scheduler = PoolingScheduler(self.config, pool)
        self.structured = StructuredOutputs(self.config)
        self.max_concurrency = 0.0
        logger.info("pooling model: no KV cache; inputs of up to %d tokens", self.config.max_model_len)

    def add_request(self, message: AddRequest) -> None:
        """Queue a request. ValueError: it can never run; QueueFullError: not now."""
        num_tokens = len(message.prompt_token_ids) + len(message.output_token_ids)
        longest = self.config.max_model_len if self.pooling else self.config.max_model_len - 1
        if not message.prompt_token_ids or num_tokens > longest:
            raise ValueError(
                f"prompt: {len(message.prompt_token_ids)} tokens; must be between 1 and "
                f"{'max_model_len' if self.pooling else 'max_model_len - 1'} ({longest})"
            )
        if message.lora is not None and not self.config.enable_lora:
            raise ValueError("lora_request: LoRA adapters need enable_lora (--enable-lora)")
        if message.pooling is not None and not self.pooling:
            raise ValueError("task: this model generates text; it serves no pooling requests (embeddings, scores)")
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
            cache_salt=message.cache_salt,
            bad_words_token_ids=message.bad_words_token_ids,
            output_token_ids=list(message.output_token_ids),
            pooling=message.pooling,
            mm_inputs=message.mm_inputs,
            lora=message.lora,
        )
        self.scheduler.add_request(request)
        if self.trace is not None:
            self.trace.arrived()
        if message.sampling.structured_outputs is not None:
            request.grammar = self.structured.start(request, message.sampling.structured_outputs)

    def add_pooling_batch(self, message: AddPoolingBatch) -> None:
        """Queue many pooling inputs under one PoolingParams as one unit (their vectors come back
        through `take_pooled_slices`). ValueError: an input can never run; QueueFullError: not now."""
        if not self.pooling:
            raise ValueError("task: this model generates text; it serves no pooling requests (embeddings, scores)")
        lengths = message.lengths.to_numpy()
        if len(lengths) and (int(lengths.min()) < 1 or int(lengths.max()) > self.config.max_model_len):
            bad = int(((lengths < 1) | (lengths > self.config.max_model_len)).argmax())
            raise ValueError(
                f"prompt: {int(lengths[bad])} tokens; must be between 1 and max_model_len ({self.config.max_model_len})"
            )
        num_waiting = len(self.scheduler.waiting) + self.scheduler.num_batched_waiting
        if num_waiting + len(lengths) > self.config.max_waiting and num_waiting:
            raise QueueFullError(
                f"overloaded: {num_waiting} requests are already waiting (max_waiting={self.config.max_waiting}); "
                "retry later"
            )
        self.scheduler.add_batch(message)

    def abort_pooling_batches(self, batch_ids: list[str]) -> list[str]:
        return self.scheduler.abort_batches(batch_ids) if self.pooling else []

    def take_pooled_slices(self) -> list[PooledSlice]:
        """The pooling batches' vectors that came back since the last call (slices, in order)."""
        return self.scheduler.take_pooled_slices() if self.pooling else []

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        for request_id in request_ids:
            self.structured.forget(request_id)
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or steps in flight whose answers must still be collected."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def num_free_kv_blocks(self) -> int:
        return self.scheduler.kv_cache.pool.num_free_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (later requests recompute them); vLLM's utility call."""
        num_forgotten = self.scheduler.reset_prefix_cache()
        logger.info("prefix cache reset: %d blocks forgotten", num_forgotten)
        return True

    def step(self) -> list[TokenDelta]:
        if self.trace is None:
            return self._step()
        started, collected = time.monotonic(), self._num_collected
        deltas = self._step()
        self.trace.record(started, deltas, self._num_collected - collected, self.scheduler)
        return deltas

    def _step(self) -> list[TokenDelta]:
        deltas = self._start_compiled_grammars()
        if self.async_scheduling:
            return deltas + self._pipelined_step()
        step = self.scheduler.schedule()
        if not _worth_sending(step):
            self._wait_if_only_compiling()
            return deltas
        self._submit(step)
        return deltas + self._collect(flush=True)

    def _pipelined_step(self) -> list[TokenDelta]:
        """Submit the next step if the pipeline has room; then collect the oldest one, unless
        the pipeline was not full yet (a step was just submitted and another may follow)."""
        if len(self._in_flight) < _PIPELINE_DEPTH:
            step = self.scheduler.schedule()
            if _worth_sending(step):
                self._submit(step)
                if len(self._in_flight) < _PIPELINE_DEPTH:
                    return []
        if not self._in_flight:
            self._wait_if_only_compiling()
            return []
        return self._collect(flush=len(self._in_flight) == 1)

    def _submit(self, step: StepInput) -> None:
        self.executor.submit_step(step)
        self._in_flight.append(step.step_id)
        if self.trace is not None:
            self.trace.submitted(step)
        if step.structured_ids:
            self._bitmask_due[step.step_id] = (step.structured_ids, step.spec_token_ids)
        self._send_bitmask_if_due()

    def _collect(self, flush: bool) -> list[TokenDelta]:
        waiting_since = time.monotonic()
        output = self.executor.collect_step(flush)
        if self.trace is not None:
            self.trace.waited(time.monotonic() - waiting_since)
        self._num_collected += 1
        self._in_flight.popleft()
        deltas = self.scheduler.update_from_output(output)
        self._send_bitmask_if_due()  # the next step's grammars have taken this step's tokens now
        return deltas

    def _send_bitmask_if_due(self) -> None:
        """The oldest step in flight samples after every earlier step was answered, so its
        requests' grammars have taken all their tokens: its bitmask can be computed now."""
        if not self._in_flight or self._in_flight[0] not in self._bitmask_due:
            return
        step_id = self._in_flight[0]
        request_ids, spec_token_ids = self._bitmask_due.pop(step_id)
        grammars = [getattr(self.scheduler.requests.get(rid), "grammar", None) for rid in request_ids]
        drafts = [spec_token_ids.get(rid, []) for rid in request_ids]
        rows = self.structured.bitmask(grammars, drafts)
        row_ids = [rid for rid, d in zip(request_ids, drafts) for _ in range(1 + len(d))]
        self.executor.send_grammar_bitmask(GrammarBitmask.of(step_id, row_ids, rows))

    def _start_compiled_grammars(self) -> list[TokenDelta]:
        if not self.structured.has_compiling:
            return []
        return self.scheduler.fail_waiting(self.structured.activate_compiled())

    def _wait_if_only_compiling(self) -> None:
        """Nothing ran: if requests wait for their grammars, wait a little for one (rather than
        spin) before the caller looks at its inputs again."""
        if self.structured.has_compiling:
            self.structured.wait_for_a_compile(_COMPILE_WAIT_S)

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()
        if self.trace is not None:
            self.trace.close()


def _worth_sending(step: StepInput) -> bool:
    # NOTE: an empty step still goes out when it carries finished/preempted ids, or the workers
    # would keep those requests' state forever.
    return not step.is_empty or bool(step.finished_ids or step.preempted_ids)


def _describe_groups(groups: list[KVGroup]) -> str:
    if len(groups) == 1 and groups[0].window is None:
        return ""
    return "; " + ", ".join(
        f"{len(g.layers)} {'full' if g.window is None else f'{g.window}-token window'} layers: {g.num_blocks} blocks"
        for g in groups
    )


def _kv_cache_manager(config: EngineConfig, groups: list[KVGroup]) -> KVCacheManager:
    """One pool per group of layers (zllm/kv_layout.py); a window group's reserves its null block."""
    pools = [BlockPool(g.num_blocks, reserve_null_block=g.window is not None) for g in groups]
    sliding = groups[1] if len(groups) > 1 else None
    return KVCacheManager(
        pools[0],
        config.block_size,
        config.enable_prefix_caching,
        window=groups[0].window,
        sliding_pool=pools[1] if sliding else None,
        sliding_window=sliding.window if sliding else None,
    )


def _warn_if_a_long_request_cannot_fit(config: EngineConfig, layout: KVLayout, groups: list[KVGroup]) -> None:
    """The scheduler refuses each request that could outgrow a whole pool (with an error that
    says so); warn at start-up when that includes requests up to max_model_len. A sliding-window
    group holds only the blocks its window reaches (zllm/kv_layout.py)."""
    for group in groups:
        needed = layout.blocks_held(config.max_model_len, group.window)
        usable = group.num_blocks - (group.window is not None)
        if usable < needed:
            logger.warning(
                "KV cache of %d blocks of %d tokens (layers %s) holds less than one sequence of max_model_len=%d "
                "(%d blocks): requests whose prompt + max_tokens exceed it will be refused; raise the KV cache "
                "memory or lower max_model_len",
                usable,
                config.block_size,
                "all" if len(groups) == 1 else f"{group.layers[0]}..{group.layers[-1]} ({len(group.layers)})",
                config.max_model_len,
                needed,
            )
