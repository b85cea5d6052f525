"""Turns the engine core's token deltas into RequestOutputs: detokenize, apply stop strings.

Stop strings are a text-level rule, so they live here; when one matches, the request is cut at
the match and the engine core is asked to abort it (its blocks come back at once).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from zllm.frontend.detokenizer import IncrementalDetokenizer
from zllm.ipc.messages import TokenDelta
from zllm.outputs import CompletionOutput, RequestOutput
from zllm.sampling_params import SamplingParams


@dataclass(slots=True)
class _Tracked:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.text,
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finish_reason is not None,
        )


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _Tracked] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, sampling.skip_special_tokens)
        self._requests[request_id] = _Tracked(request_id, prompt, prompt_token_ids, sampling, detokenizer, [])

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def received_token_ids(self, request_id: str) -> list[int]:
        """The output tokens received for a request so far (what an engine restart continues)."""
        tracked = self._requests.get(request_id)
        return list(tracked.token_ids) if tracked is not None else []

    def process(self, deltas: list[TokenDelta]) -> tuple[list[RequestOutput], list[str]]:
        """Apply deltas; return the updated outputs and the ids the engine core must abort
        (requests this side finished on a stop string)."""
        outputs, to_abort = [], []
        for delta in deltas:
            tracked = self._requests.get(delta.request_id)
            if tracked is None:
                continue  # finished here already (stop string) while the core still ran it
            stopped_here = self._apply_delta(tracked, delta)
            if stopped_here and delta.finish_reason is None:
                to_abort.append(delta.request_id)
            outputs.append(tracked.to_output())
            if tracked.finish_reason is not None:
                del self._requests[delta.request_id]
        return outputs, to_abort

    def abort(self, request_id: str) -> RequestOutput | None:
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return None
        tracked.finish_reason = "abort"
        return tracked.to_output()

    def _apply_delta(self, tracked: _Tracked, delta: TokenDelta) -> bool:
        """Returns True when a stop string ended the request."""
        for token_id in delta.new_token_ids:
            tracked.token_ids.append(token_id)
            if not tracked.sampling.detokenize:
                continue
            checked_from = len(tracked.text)
            tracked.text += tracked.detokenizer.add_token(token_id)
            if self._stop_on_string(tracked, checked_from):
                return True
        if delta.finish_reason is not None:
            tracked.finish_reason = delta.finish_reason
            tracked.stop_reason = delta.stop_reason
        return False

    def _stop_on_string(self, tracked: _Tracked, checked_from: int) -> bool:
        stops = tracked.sampling.stop_strings
        if not stops or len(tracked.token_ids) <= tracked.sampling.min_tokens:
            return False
        # A stop string may straddle the old and the new text.
        window_start = max(0, checked_from - max(len(s) for s in stops) + 1)
        best: tuple[int, str] | None = None
        for stop in stops:
            index = tracked.text.find(stop, window_start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        end = index + len(stop) if tracked.sampling.include_stop_str_in_output else index
        tracked.text = tracked.text[:end]
        tracked.finish_reason = "stop"
        tracked.stop_reason = stop
        return True
