"""What the frontend keeps so that an engine restart loses no request.

Every AddRequest the frontend submits is recorded until its request ends. When the engine core
is restarted, each recorded request is re-submitted as a continuation: the same prompt, with
the tokens its client already received as `output_token_ids`. The new engine core treats it
like a request resumed after preemption: it recomputes the KV cache of prompt + outputs, and
`max_tokens`, `min_tokens` and the seeded sampler's output index all count the tokens already
produced. The frontend's own per-request state (incremental detokenizer, stop-string holdback,
what was sent to the client) never left this process, so the client's stream just continues.

What comes out after a restart:
- greedy requests: exactly the tokens an uninterrupted run gives (up to float rounding between
  a prefill over prompt + outputs and the decode steps that produced them);
- seeded requests (`seed=`): the same tokens too, as each sampled token draws from a generator
  seeded by (seed, output index), whatever process draws it;
- unseeded random sampling: the tokens already streamed stay; the rest is a fresh sample from
  the same distribution (nothing promised which one).
Tokens the dead engine sampled but the frontend never received are simply sampled again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from zllm.ipc.messages import AddRequest


@dataclass(slots=True)
class _Submitted:
    message: AddRequest
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

    def record(self, message: AddRequest) -> None:
        self._submitted[message.request_id] = _Submitted(message)

    def forget(self, request_id: str) -> None:
        self._submitted.pop(request_id, None)

    def continuations(self, received_tokens: Callable[[str], list[int]]) -> tuple[list[AddRequest], list[str]]:
        """After an engine failure: the AddRequests that continue every recorded request (in
        arrival order), and the ids of those replayed `max_replays` times already (dropped here)."""
        resend, given_up = [], []
        for request_id, submitted in sorted(self._submitted.items(), key=lambda item: item[1].message.arrival_time):
            if submitted.replays >= self.max_replays:
                given_up.append(request_id)
                continue
            submitted.replays += 1
            resend.append(_continuation(submitted.message, received_tokens(request_id)))
        for request_id in given_up:
            self.forget(request_id)
        return resend, given_up


def _continuation(message: AddRequest, received: list[int]) -> AddRequest:
    return msgspec.structs.replace(message, output_token_ids=list(received), resumed=True)
