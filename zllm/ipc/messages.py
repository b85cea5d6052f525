"""Every message that crosses a process boundary, as msgspec Structs.

All structs are `array_like` (encoded as arrays, no field names on the wire) and `omit_defaults`.
NOTE: fields are append-only. Add new fields last, with a default, or old peers break.
"""

from __future__ import annotations

import msgspec

from zllm.sampling_params import SamplingParams


class _Message(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    pass


# ---- frontend -> engine core ------------------------------------------------------------------


class AddRequest(_Message):
    """A validated, tokenized request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    eos_token_ids: list[int] = []
    priority: int = 0


# ---- engine core -> frontend ------------------------------------------------------------------


class TokenDelta(_Message):
    """New tokens of one request since its last delta; finish_reason set when it ended."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


# ---- engine core -> workers (one per step) ----------------------------------------------------


class NewRequestData(_Message):
    """A request the workers have not seen (or see again after preemption): sent in full."""

    request_id: str
    prompt_len: int
    token_ids: list[int]  # the prompt, plus any output tokens when resumed after preemption
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


class CachedRequestData(_Message):
    """A request the workers already hold: only what changed since the last step."""

    request_id: str
    new_token_ids: list[int]  # tokens appended since the workers last saw it (the sampled ones)
    new_block_ids: list[int]
    num_computed_tokens: int


class StepInput(_Message):
    """One scheduler step, as a diff against the workers' persistent batch.

    `scheduled_ids[i]` computes `num_scheduled_tokens[i]` tokens starting at its
    `num_computed_tokens`. Finished and preempted requests are dropped by the workers.
    """

    step_id: int
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    scheduled_ids: list[str]
    num_scheduled_tokens: list[int]
    finished_ids: list[str] = []
    preempted_ids: list[str] = []

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_ids


class StepOutput(_Message):
    """Rank 0's answer to a step: one sampled token for each request that reached its end."""

    step_id: int
    request_ids: list[str]
    sampled_token_ids: list[int]
