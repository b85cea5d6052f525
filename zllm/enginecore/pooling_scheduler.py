"""The scheduler of a pooling engine (embeddings, classifiers, cross-encoder scores).

A pooling request is one forward over its whole input: bidirectional attention needs every token
at once, so there is no chunking, no KV cache and no sampling. Each step packs waiting inputs
whole under the token budget and `max_num_seqs`; each one ends with that step, its pooled vector
in its TokenDelta, and the workers forget it as soon as they have answered.

    waiting: [a 12 tok][b 40 tok][c 9 tok][d 300 tok] ...   budget 64
    step:    a + b + c (61 tokens, three inputs)  ->  three vectors, three requests finished
"""

from __future__ import annotations

from zllm.enginecore.request import Request, RequestStatus
from zllm.enginecore.scheduler import Scheduler
from zllm.ipc.messages import NewRequestData, StepInput, StepOutput, TokenDelta


class PoolingScheduler(Scheduler):
    """The generation scheduler's bookkeeping (queues, priorities, stats, aborts) with steps of
    whole inputs and no blocks."""

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
        self._step_id += 1
        return StepInput(
            step_id=self._step_id,
            new_requests=[self._pooling_request_data(r) for r in scheduled],
            cached_requests=[],
            scheduled_ids=[r.request_id for r in scheduled],
            num_scheduled_tokens=[r.num_prompt_tokens for r in scheduled],
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
        return deltas

    def _release(self, request: Request) -> None:
        # NOTE: the workers drop a pooling request once they answer its step: no finished id.
        del self.requests[request.request_id]
