"""Turns the engine core's token deltas into RequestOutputs: detokenize, apply stop strings,
build logprobs, and merge the n completions of a request (see parallel_sampling).

Stop strings are a text-level rule, so they live here; when one matches, the completion is cut at
the match and the engine core is asked to abort it (its blocks come back at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from zllm.frontend.detokenizer import IncrementalDetokenizer
from zllm.frontend.parallel_sampling import core_request_ids, fan_out
from zllm.ipc.messages import AddRequest, TokenDelta, TokenLogprobs
from zllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from zllm.pooling import PoolerConfig, PoolingParams, finish_pooled
from zllm.sampling_params import SamplingParams


@dataclass(slots=True)
class _Completion:
    """One of a request's n completions (one request in the engine core)."""

    index: int
    core_id: str
    detokenizer: IncrementalDetokenizer | None  # None: without a tokenizer (skip_tokenizer_init), or pooling
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None

    def to_output(self, copy: bool) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids) if copy else self.token_ids,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs) if copy else self.logprobs,
        )


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling: SamplingParams
    completions: list[_Completion]
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    pooling: PoolingParams | None = None
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        for completion in self.completions:  # (a loop: this runs for every request every step)
            if completion.finish_reason is None:
                return False
        return True

    def to_output(self, copy: bool = True) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c.to_output(copy) for c in self.completions],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
            pooled=self.pooled,
        )


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, pooler: PoolerConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.pooler = pooler
        self._requests: dict[str, _Request] = {}
        self._completions: dict[str, tuple[_Request, _Completion]] = {}  # by engine-core request id
        self._token_texts: dict[int, str] = {}

    def add_request(self, message: AddRequest, prompt: str | None) -> list[AddRequest]:
        """Track a validated request; returns the messages for the engine core (its n children
        when n > 1). Raises ValueError, tracking nothing, if one of their ids is in use."""
        sampling = message.sampling
        core_ids = core_request_ids(message.request_id, sampling.n)
        taken = [i for i in [message.request_id, *core_ids] if i in self._requests or i in self._completions]
        if taken:
            raise ValueError(f"request_id: {taken[0]!r} is already in use")
        completions = [
            _Completion(
                index,
                core_id,
                # A pooling request gains no tokens: nothing to detokenize.
                IncrementalDetokenizer(self.tokenizer, message.prompt_token_ids, sampling.skip_special_tokens)
                if self.tokenizer is not None and message.pooling is None
                else None,
            )
            for index, core_id in enumerate(core_ids)
        ]
        request = _Request(
            message.request_id, prompt, message.prompt_token_ids, sampling, completions, pooling=message.pooling
        )
        self._requests[message.request_id] = request
        for completion in completions:
            self._completions[completion.core_id] = (request, completion)
        return fan_out(message)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def received_token_ids(self, core_id: str) -> list[int] | None:
        """The tokens an unfinished completion has received so far (what an engine restart
        continues from); None if it has ended."""
        entry = self._completions.get(core_id)
        return None if entry is None else list(entry[1].token_ids)

    def core_request_ids(self, request_id: str) -> list[str]:
        """The engine-core ids of a tracked request's unfinished completions."""
        request = self._requests.get(request_id)
        if request is None:
            return []
        return [c.core_id for c in request.completions if c.finish_reason is None]

    def request_id_of(self, core_id: str) -> str | None:
        entry = self._completions.get(core_id)
        return None if entry is None else entry[0].request_id

    def process(self, deltas: list[TokenDelta], copy: bool = True) -> tuple[list[RequestOutput], list[str]]:
        """Apply deltas; return the updated outputs (one per request, with all its completions)
        and the engine-core ids to abort (completions this side finished on a stop string).
        copy=False: the outputs' token and logprob lists are this processor's own, which grow
        with later steps; for a caller that reads them at once (the server sends the new part),
        it saves copying every token of every request every step."""
        touched: dict[str, _Request] = {}
        to_abort = []
        for delta in deltas:
            entry = self._completions.get(delta.request_id)
            if entry is None:
                continue  # finished here already (stop string) while the core still ran it
            request, completion = entry
            stopped_here = self._apply_delta(request, completion, delta)
            if stopped_here and delta.finish_reason is None:
                to_abort.append(delta.request_id)
            if completion.finish_reason is not None:
                del self._completions[delta.request_id]
            touched[request.request_id] = request
        outputs = [request.to_output(copy) for request in touched.values()]
        for request in touched.values():
            if request.finished:
                del self._requests[request.request_id]
        return outputs, to_abort

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        for completion in request.completions:
            self._completions.pop(completion.core_id, None)
            if completion.finish_reason is None:
                completion.finish_reason = "abort"
        return request.to_output()

    # ---- one delta -----------------------------------------------------------------------------

    def _apply_delta(self, request: _Request, completion: _Completion, delta: TokenDelta) -> bool:
        """Returns True when a stop string ended the completion."""
        sampling = request.sampling
        request.num_cached_tokens = max(request.num_cached_tokens, delta.num_cached_tokens)
        if delta.pooled is not None and request.pooling is not None:
            request.pooled = finish_pooled(delta.pooled, request.pooling, self.pooler)[0]
        if delta.prompt_logprobs is not None:
            request.prompt_logprobs = [None] + self._logprob_dicts(
                delta.prompt_logprobs, sampling.prompt_logprobs, sampling
            )
        if delta.logprobs is not None:
            self._add_logprobs(completion, delta.logprobs, sampling)
        # vLLM: a stop token (EOS or stop_token_ids) stays in token_ids, but not in the text.
        hide_last = delta.finish_reason == "stop" and not isinstance(delta.stop_reason, str)
        hide_last = hide_last and not sampling.include_stop_str_in_output
        for position, token_id in enumerate(delta.new_token_ids):
            completion.token_ids.append(token_id)
            if completion.detokenizer is None or not sampling.detokenize:
                continue  # token ids only
            if hide_last and position == len(delta.new_token_ids) - 1:
                continue
            checked_from = len(completion.text)
            completion.text += completion.detokenizer.add_token(token_id)
            if self._stop_on_string(sampling, completion, checked_from):
                return True
        if delta.finish_reason is not None:
            completion.finish_reason = delta.finish_reason
            completion.stop_reason = delta.stop_reason
        return False

    def _add_logprobs(self, completion: _Completion, logprobs: TokenLogprobs, sampling: SamplingParams) -> None:
        dicts = self._logprob_dicts(logprobs, sampling.logprobs, sampling)
        if completion.logprobs is None:
            completion.logprobs, completion.cumulative_logprob = [], 0.0
        completion.logprobs.extend(dicts)
        completion.cumulative_logprob += sum(row[0] for row in logprobs.logprobs)

    def _logprob_dicts(
        self, logprobs: TokenLogprobs, num_top: int, sampling: SamplingParams
    ) -> list[dict[int, Logprob]]:
        """vLLM's form: per position, the chosen token (with its rank) then the top `num_top`."""
        dicts = []
        for token_ids, values, rank in zip(logprobs.token_ids, logprobs.logprobs, logprobs.ranks):
            chosen = {token_ids[0]: Logprob(values[0], rank, self._token_text(token_ids[0], sampling))}
            for top_rank, (token_id, value) in enumerate(zip(token_ids[1 : num_top + 1], values[1 : num_top + 1]), 1):
                if token_id not in chosen:
                    chosen[token_id] = Logprob(value, top_rank, self._token_text(token_id, sampling))
            dicts.append(chosen)
        return dicts

    def _token_text(self, token_id: int, sampling: SamplingParams) -> str | None:
        if not sampling.detokenize or self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _stop_on_string(self, sampling: SamplingParams, completion: _Completion, checked_from: int) -> bool:
        stops = sampling.stop_strings
        if not stops or len(completion.token_ids) <= sampling.min_tokens:
            return False
        # A stop string may straddle the old and the new text.
        window_start = max(0, checked_from - max(len(s) for s in stops) + 1)
        best: tuple[int, str] | None = None
        for stop in stops:
            index = completion.text.find(stop, window_start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        end = index + len(stop) if sampling.include_stop_str_in_output else index
        completion.text = completion.text[:end]
        completion.finish_reason = "stop"
        completion.stop_reason = stop
        return True
