"""The scheduler of a pooling engine (embeddings, classifiers, cross-encoder scores).

A pooling request is one forward over its whole input: bidirectional attention needs every token
at once, so there is no chunking, no KV cache and no sampling. Each step packs waiting inputs
whole under the token budget and `max_num_seqs`; each one ends with that step, its pooled vector
in its TokenDelta, and the workers forget it as soon as they have answered.

    waiting: [a 12 tok][b 40 tok][c 9 tok][d 300 tok] ...   budget 64
    step:    a + b + c (61 tokens, three inputs)  ->  three vectors, three requests finished

A pooling batch (AddPoolingBatch: many inputs under one PoolingParams, LLM.embed's offline
load) stays one unit: no Request per input. Its inputs are admitted in order, as many as fill
what the step's single requests left (one searchsorted over its cumulative lengths), and go to
the workers as one slice of arrays; the slice's vectors come back as one array.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from zllm.enginecore.request import Request, RequestStatus
from zllm.enginecore.scheduler import Scheduler, SchedulerStats
from zllm.ipc.messages import (
    AddPoolingBatch,
    ArrayData,
    NewRequestData,
    PooledSlice,
    PoolingSlice,
    StepInput,
    StepOutput,
    TokenDelta,
)
from zllm.pooling import PoolingParams


@dataclasses.dataclass(slots=True)
class _Batch:
    """A pooling batch in the core: its arrays, and how far it has been scheduled and answered."""

    batch_id: str
    token_ids: np.ndarray  # int32 [total]
    ends: np.ndarray  # int64 [inputs]: input i's tokens end here (cumulative lengths)
    pooling: PoolingParams
    next: int = 0  # the first input not yet scheduled
    answered: int = 0  # inputs whose vectors (or failure) came back

    @property
    def size(self) -> int:
        return len(self.ends)

    def start_of(self, index: int) -> int:
        return int(self.ends[index - 1]) if index else 0


class PoolingScheduler(Scheduler):
    """The generation scheduler's bookkeeping (queues, priorities, stats, aborts) with steps of
    whole inputs and no blocks; pooling batches beside the single requests."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches: dict[str, _Batch] = {}  # in arrival order: scheduled first come, first served
        self._answered_slices: list[PooledSlice] = []  # collected by the core's caller (take_pooled_slices)

    # ---- pooling batches ---------------------------------------------------------------------------

    def add_batch(self, message: AddPoolingBatch) -> None:
        """Queue a batch (checked as one unit: its lengths, not each input)."""
        if message.batch_id in self.batches:
            raise ValueError(f"batch_id: {message.batch_id!r} is already in use")
        lengths = message.lengths.to_numpy()
        token_ids = message.token_ids.to_numpy()
        if not len(lengths):
            raise ValueError("prompts: a pooling batch must not be empty")
        ends = np.cumsum(lengths, dtype=np.int64)
        if int(ends[-1]) != len(token_ids):
            raise ValueError(f"token_ids: {len(token_ids)} ids for inputs of {int(ends[-1])} tokens")
        shortest, longest = int(lengths.min()), int(lengths.max())
        if shortest < 1 or longest > self.max_num_batched_tokens:
            bad = int(np.flatnonzero((lengths < 1) | (lengths > self.max_num_batched_tokens))[0])
            raise ValueError(
                f"input: {int(lengths[bad])} tokens (input {bad} of batch {message.batch_id}); must be between 1 and "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}): a pooling input runs in one step"
            )
        self.batches[message.batch_id] = _Batch(message.batch_id, token_ids, ends, message.pooling)

    def abort_batches(self, batch_ids: list[str]) -> list[str]:
        """Forget the given batches; slices of theirs still in flight are dropped on arrival."""
        return [batch_id for batch_id in batch_ids if self.batches.pop(batch_id, None) is not None]

    def take_pooled_slices(self) -> list[PooledSlice]:
        """The batches' vectors answered since the last call, in the order they came back."""
        answered, self._answered_slices = self._answered_slices, []
        return answered

    @property
    def num_batched_waiting(self) -> int:
        return sum(b.size - b.next for b in self.batches.values())

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.batches)

    def stats(self) -> SchedulerStats:
        stats = super().stats()
        running = sum(b.next - b.answered for b in self.batches.values())
        return dataclasses.replace(
            stats, num_running=stats.num_running + running, num_waiting=stats.num_waiting + self.num_batched_waiting
        )

    def _slices(self, budget: int, seats: int) -> list[PoolingSlice]:
        """Whole inputs of the batches, in order, under the token budget and the seats left."""
        slices = []
        for batch in self.batches.values():
            if batch.next == batch.size:
                continue
            if seats <= 0 or budget <= 0:
                break
            start = batch.start_of(batch.next)
            stop = min(batch.size, batch.next + seats)
            fit = int(np.searchsorted(batch.ends[batch.next : stop], start + budget, side="right"))
            if fit == 0:
                break  # its next input waits for a step with room (first come, first served)
            last = batch.next + fit
            end = int(batch.ends[last - 1])
            lengths = np.diff(batch.ends[batch.next : last], prepend=start).astype(np.int32)
            slices.append(
                PoolingSlice(
                    batch.batch_id,
                    batch.next,
                    ArrayData.of(batch.token_ids[start:end]),
                    ArrayData.of(lengths),
                    batch.pooling,
                )
            )
            batch.next, budget, seats = last, budget - (end - start), seats - fit
            if last < batch.size:
                break  # the rest of this batch goes first next step
        return slices

    def _check_fits(self, request: Request) -> None:
        if request.pooling is None:
            raise ValueError("task: this is a pooling model (embeddings, scores); it cannot generate text")
        if request.num_prompt_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"input: {request.num_prompt_tokens} tokens exceed max_num_batched_tokens "
                f"({self.max_num_batched_tokens}): a pooling input runs in one step"
            )

    def schedule(self) -> StepInput:
        budget, scheduled = self.max_num_batched_tokens, []
        while self.waiting and len(scheduled) < self.max_num_seqs:
            request = self.waiting.peek()
            if request.num_prompt_tokens > budget:
                break
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = request.num_prompt_tokens
            self.running.append(request)
            scheduled.append(request)
            budget -= request.num_prompt_tokens
        slices = self._slices(budget, self.max_num_seqs - len(scheduled)) if self.batches else []
        self._step_id += 1
        return StepInput(
            step_id=self._step_id,
            new_requests=[self._pooling_request_data(r) for r in scheduled],
            cached_requests=[],
            scheduled_ids=[r.request_id for r in scheduled],
            num_scheduled_tokens=[r.num_prompt_tokens for r in scheduled],
            pooling_slices=slices,
        )

    @staticmethod
    def _pooling_request_data(request: Request) -> NewRequestData:
        return NewRequestData(
            request_id=request.request_id,
            prompt_len=request.num_prompt_tokens,
            token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            block_ids=[],
            num_computed_tokens=0,
            pooling=request.pooling,
        )

    def update_from_output(self, output: StepOutput) -> list[TokenDelta]:
        """Every request of the step ends with it: its vector, or the reason it failed."""
        deltas = []
        for request_id in output.request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            failure = output.failed_requests.get(request_id)
            pooled = output.pooled.get(request_id)
            request.status = RequestStatus.FINISHED_STOPPED if failure is None else RequestStatus.FINISHED_ERROR
            deltas.append(TokenDelta(request_id, [], request.status.finish_reason, error=failure, pooled=pooled))
            self._release(request)
        self.running = [r for r in self.running if not r.status.is_finished]
        self._answer_slices(output.pooled_slices)
        return deltas

    def _answer_slices(self, answers: list[PooledSlice]) -> None:
        for answer in answers:
            batch = self.batches.get(answer.batch_id)
            if batch is None:
                continue  # aborted while the step ran
            self._answered_slices.append(answer)
            batch.answered += answer.vectors.shape[0] if answer.vectors is not None else 0
            if answer.error is not None or (batch.answered == batch.size and batch.next == batch.size):
                del self.batches[answer.batch_id]  # done (or failed: its caller gets the error)

    def _release(self, request: Request) -> None:
        # NOTE: the workers drop a pooling request once they answer its step: no finished id.
        del self.requests[request.request_id]
