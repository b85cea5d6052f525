"""A worker: one device (or CPU rank), one model shard, one KV cache.

Each rank's worker process (zllm/workers/process.py) serves one of these behind its sockets; at
tp 1 the in-process engine (offline use and tests) calls one directly, through the Executor
protocol it also implements.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

import torch

from zllm.config import EngineConfig
from zllm.ipc.messages import GrammarBitmask, StepInput, StepOutput
from zllm.step_trace import TraceFile
from zllm.workers.distributed import init_tensor_parallel
from zllm.workers.model_runner import LaunchedStep, ModelRunner
from zllm.workers.pooling_runner import PoolingRunner
from zllm.workers.symmetric_all_reduce import attach_symmetric_all_reduce

logger = logging.getLogger(__name__)


def resolve_device(name: str, rank: int = 0, first_gpu: int = 0, gpu_index: int | None = None) -> torch.device:
    """Rank R of a tensor-parallel group uses GPU first_gpu + R (first_gpu: the data-parallel
    engine's first GPU), unless its placement names the GPU (`gpu_index`, the Ray backend)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but no CUDA device is available")
    index = first_gpu + rank if gpu_index is None else gpu_index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device: rank {rank} needs GPU {index}, but only {torch.cuda.device_count()} are visible")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class Worker:
    """One rank's model shard. Also implements the engine core's Executor protocol, so that a
    single worker can run in-process (tp 1).

    Steps are pipelined one deep: `advance(step N+1)` launches step N+1's forward before it waits
    for step N's tokens, so the device has work queued while the host finishes step N, answers
    it and samples step N+1 (whose inputs take step N's tokens straight from the device).
    """

    def __init__(
        self, config: EngineConfig, rank: int = 0, gpu_index: int | None = None, init_method: str | None = None
    ) -> None:
        """gpu_index, init_method: where a cluster manager placed this rank (the Ray backend);
        None: derived from the config and the rank."""
        self.config = config
        self.device = resolve_device(config.device, rank, config.first_gpu, gpu_index)
        self.tp = init_tensor_parallel(config, rank, self.device, init_method)
        sharers = config.ranks_per_node * config.local_engines
        if self.device.type == "cpu" and sharers > 1:
            # Ranks (of every engine) share the machine's cores; without a cap each would start
            # one thread per core.
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // sharers))
        torch.manual_seed(config.seed)
        self._pending: LaunchedStep | None = None  # sampled (or awaiting its bitmask), not yet answered
        self.awaiting_bitmask = False  # rank 0: the pending step samples once its GrammarBitmask arrives
        self._answers: deque[StepOutput] = deque()  # answered here, not yet collected (in-process)
        # ZLLM_STEP_TRACE: a line per step this rank advances (None: off)
        self.trace = TraceFile.open(f"dp{config.data_parallel_rank}.worker{rank}")
        self._trace_times: dict[str, float] = {}
        self._last_advanced = time.monotonic()
        runner_class = PoolingRunner if config.runner == "pooling" else ModelRunner
        self.runner = runner_class(config, self.device, self.tp)
        self.runner.load_model()
        # Before the memory profile (the buffer counts against the KV cache) and before any graph
        # captures an all-reduce; every rank gets here, so its agreement votes line up.
        attach_symmetric_all_reduce(self.tp, config, self.device, self.runner.dtype)
        logger.info("rank %d: model loaded: %s on %s (%s)", rank, config.model_name, self.device, self.runner.dtype)

    def determine_num_kv_blocks(self) -> int:
        return self.runner.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.capture_graphs()

    def advance(self, step: StepInput) -> list[StepOutput]:
        """Launch `step`, then answer the step before it (if one is pending), then sample `step`
        and keep it pending. Returns the answers this produced.

        A step with structured requests is sampled on rank 0 only once its GrammarBitmask arrives
        (`apply_grammar_bitmask`): the core computes it after it has the answer given here. The
        other ranks sample at once: they only receive rank 0's tokens.

        Speculative decoding: a step that scores drafts, or follows one that did, is launched only
        after the step before it is answered. Its drafts are proposed here from that step's
        tokens, and how many drafts that step accepted sets where its requests stand (each
        request's tokens, positions and slots); the core's own steps still overlap the device.
        An EAGLE head reads the target's hidden states of the step it drafts after, which the next
        launch overwrites (the graphs' fixed buffers): with one, every step is answered first."""
        if self.trace is None:
            return self._advance(step)
        started = time.monotonic()
        self._trace_times = {"launch_s": 0.0, "finish_s": 0.0, "sync_s": 0.0, "sample_s": 0.0}
        answers = self._advance(step)
        self._trace_step(step, started, len(answers))
        return answers

    def _advance(self, step: StepInput) -> list[StepOutput]:
        if self._pending is not None and self._answer_pending_first(step):
            answers = self._timed("finish_s", self.finish_pending)
            launched = self._timed("launch_s", self.runner.launch_step, step)
        else:
            launched = self._timed("launch_s", self.runner.launch_step, step)
            answers = self._timed("finish_s", self.finish_pending)
        self._pending = launched
        if step.structured_ids and self.tp.is_first:
            self.awaiting_bitmask = True
        else:
            self._timed("sample_s", self.runner.sample_step, launched)
        return answers

    def _timed(self, key: str, call, *args):
        """call(*args), its duration added to this step's trace line when tracing."""
        if self.trace is None:
            return call(*args)
        started = time.monotonic()
        result = call(*args)
        self._trace_times[key] += time.monotonic() - started
        if key == "finish_s" and result:  # the runner timed its wait for the answered step's tokens
            self._trace_times["sync_s"] += getattr(self.runner, "sync_wait_s", 0.0)
        return result

    def _trace_step(self, step: StepInput, started: float, answered: int) -> None:
        """One line: the step advanced, the time since the last one (waiting for it, answers
        sent, flushes), and within it: launch (inputs, forward queued), finish (the pending
        step's answer; sync_s of it blocked on its tokens: the device was still busy), sample."""
        ended = time.monotonic()
        line = {
            "dp": self.config.data_parallel_rank,
            "rank": self.tp.rank,
            "t": round(time.time(), 6),
            "step_id": step.step_id,
            "rows": len(step.scheduled_ids),
            "tokens": sum(step.num_scheduled_tokens),
            "idle_s": round(started - self._last_advanced, 6),
            "busy_s": round(ended - started, 6),
            **{key: round(value, 6) for key, value in self._trace_times.items()},
            "answered": answered,
        }
        self.trace.write(line)
        self._last_advanced = ended

    def _answer_pending_first(self, step: StepInput) -> bool:
        """Whether the pending step is answered before `step` launches: `step` scores drafts, the
        pending one did (a pooling runner's steps never do), or an EAGLE head reads the pending
        step's hidden states, which the launch would overwrite."""
        if step.spec_token_ids or getattr(self._pending, "layout", None) is not None:
            return True
        proposer = getattr(self.runner, "proposer", None)
        return proposer is not None and proposer.needs_features

    def apply_grammar_bitmask(self, bitmask: GrammarBitmask) -> None:
        """Sample the pending step under its grammars' bitmask."""
        if not self.awaiting_bitmask or self._pending is None or self._pending.step_id != bitmask.step_id:
            pending = None if self._pending is None else self._pending.step_id
            raise RuntimeError(f"a grammar bitmask for step {bitmask.step_id}, but the step awaiting one is {pending}")
        self.awaiting_bitmask = False
        self.runner.sample_step(self._pending, bitmask)

    def finish_pending(self) -> list[StepOutput]:
        """Answer the pending step now (nothing follows it yet)."""
        if self._pending is None:
            return []
        if self.awaiting_bitmask:
            raise RuntimeError(f"step {self._pending.step_id} cannot be answered: its grammar bitmask has not arrived")
        launched, self._pending = self._pending, None
        return [self.runner.finish_step(launched)]

    # ---- the Executor protocol, in-process ------------------------------------------------------

    def execute_step(self, step: StepInput) -> StepOutput:
        self.submit_step(step)
        return self.collect_step(flush=True)

    def submit_step(self, step: StepInput) -> None:
        self._answers.extend(self.advance(step))

    def collect_step(self, flush: bool) -> StepOutput:
        """The oldest submitted step's answer; `flush`: it is the last submitted one."""
        if not self._answers:
            self._answers.extend(self.finish_pending())
        return self._answers.popleft()

    def send_grammar_bitmask(self, bitmask: GrammarBitmask) -> None:
        self.apply_grammar_bitmask(bitmask)

    def shutdown(self) -> None:
        """Drop the model, graphs and KV cache, then leave the tensor-parallel group (bounded:
        distributed.leave_process_group). Safe to call again."""
        self._pending, self.awaiting_bitmask = None, False
        if self.trace is not None:
            self.trace.close()
            self.trace = None
        self.runner.release_device_memory()
        if self.device.type == "cuda":
            import gc

            gc.collect()
            torch.cuda.empty_cache()
        self.tp.destroy()
