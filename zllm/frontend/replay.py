"""What the frontend keeps so that an engine restart loses no request.

Every request the frontend submits is recorded, with the AddRequests it became (one per
completion when n > 1), until it ends. When the engine core is restarted, each unfinished
completion is re-submitted as a continuation: the same prompt, with the tokens its client
already received as `output_token_ids`. The new engine core treats it
like a request resumed after preemption: it recomputes the KV cache of prompt + outputs, and
`max_tokens`, `min_tokens` and the seeded sampler's output index all count the tokens already
produced. The frontend's own per-request state (incremental detokenizer, stop-string holdback,
what was sent to the client) never left this process, so the client's stream just continues.

What comes out after a restart:
- greedy requests: exactly the tokens an uninterrupted run gives (up to float rounding between
  a prefill over prompt + outputs and the decode steps that produced them);
- seeded requests (`seed=`): the same tokens too, as each sampled token draws from a generator
  seeded by (seed, output index), whatever process draws it; penalties, min_tokens and bad words
  see the same output tokens (the workers take them from prompt + outputs);
- unseeded random sampling: the tokens already streamed stay; the rest is a fresh sample from
  the same distribution (nothing promised which one).
Tokens the dead engine sampled but the frontend never received are simply sampled again.
Logprobs continue with the new tokens; prompt logprobs, which came with the first token, are not
asked for again once that token was received.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from zllm.ipc.messages import AddRequest


@dataclass(slots=True)
class _Submitted:
    messages: list[AddRequest]  # what the engine core got: the request, or its n children
    replays: int = 0


class ReplayLog:
    def __init__(self, max_replays: int) -> None:
        # A request in flight through this many engine failures may be what kills the engine:
        # it is failed alone instead of being replayed once more.
        self.max_replays = max_replays
        self._submitted: dict[str, _Submitted] = {}

    def __len__(self) -> int:
        return len(self._submitted)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._submitted

    def record(self, request_id: str, core_messages: list[AddRequest]) -> None:
        """A request of the frontend and the AddRequests it became (one per completion)."""
        self._submitted[request_id] = _Submitted(list(core_messages))

    def forget(self, request_id: str) -> None:
        self._submitted.pop(request_id, None)

    def continuations(self, received_tokens: Callable[[str], list[int] | None]) -> tuple[list[AddRequest], list[str]]:
        """After an engine failure: the AddRequests that continue every recorded request's
        unfinished completions, in arrival order, and the ids of the requests replayed
        `max_replays` times already (dropped here). `received_tokens(core_id)` gives the tokens a
        completion's client has so far, or None once that completion has ended."""
        resend, given_up = [], []
        for request_id, submitted in sorted(self._submitted.items(), key=lambda item: item[1].messages[0].arrival_time):
            if submitted.replays >= self.max_replays:
                given_up.append(request_id)
                continue
            submitted.replays += 1
            for message in submitted.messages:
                received = received_tokens(message.request_id)
                if received is not None:
                    resend.append(_continuation(message, received))
        for request_id in given_up:
            self.forget(request_id)
        return resend, given_up


def _continuation(message: AddRequest, received: list[int]) -> AddRequest:
    sampling = message.sampling
    if received and sampling.prompt_logprobs is not None:
        # They came with the first token, and the client has them: not computed again.
        sampling = msgspec.structs.replace(sampling, prompt_logprobs=None)
    return msgspec.structs.replace(message, output_token_ids=list(received), resumed=True, sampling=sampling)
