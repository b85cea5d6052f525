"""A request as the engine core sees it, and its state machine.

WAITING --schedule--> RUNNING --stop/length--> FINISHED_STOPPED / FINISHED_LENGTH
   ^                     |
   +---- PREEMPTED <-----+   (blocks freed; recomputed from scratch when resumed)
any unfinished state --abort--> FINISHED_ABORTED
RUNNING --the workers could not take it--> FINISHED_ERROR   (that request alone)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from zllm.block_hash import ImageSpan
from zllm.ipc.messages import ImageInput
from zllm.lora import LoRARequest
from zllm.pooling import PoolingParams
from zllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from zllm.enginecore.structured_outputs import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",  # vLLM's FinishReason.ERROR
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    on_workers: bool = False  # sent in full since it was last admitted: the workers hold it
    # Tokens being sampled by steps in flight (async scheduling): the next step computes their
    # positions before their values are known here; the workers fill them in on the device. With
    # drafts (async speculative decoding) a step counts 1 + its drafts: the most it may gain.
    num_output_placeholders: int = 0
    # Outputs still to come from steps sent before this request was preempted: dropped on arrival.
    num_stale_outputs: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    cache_salt: str | None = None  # isolates this request's prefix-cache entries (per tenant)
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, extended lazily
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first scheduled
    sequence: int = 0  # admission order; breaks ties between equal priorities and arrival times
    grammar: RequestGrammar | None = None  # SamplingParams.structured_outputs: compiling, then matching
    # Speculative decoding: tokens proposed for the next step, and how many of them the step being
    # scheduled scores; then, per step in flight that samples for it (oldest first), how many
    # drafts it scores (its computed count is rolled back by those the workers reject).
    spec_token_ids: list[int] = field(default_factory=list)
    num_scheduled_drafts: int = 0
    drafts_in_flight: list[int] = field(default_factory=list)
    pooling: PoolingParams | None = None  # a pooling request: one step, no sampling, no KV kept
    # A vision-language model's images (sent to the workers with the request), their token
    # spans, and the ones whose encoder-cache entry it holds (zllm/enginecore/encoder_cache.py).
    mm_inputs: list[ImageInput] = field(default_factory=list)
    image_spans: list[ImageSpan] = field(default_factory=list)
    lora: LoRARequest | None = None  # its adapter (None: the base model)

    @property
    def lora_id(self) -> int:
        """Its adapter's id; 0 for the base model."""
        return 0 if self.lora is None else self.lora.lora_int_id

    def __post_init__(self) -> None:
        # Output tokens may be given up front: a request resumed after an engine restart.
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        self.image_spans = [(image.offset, image.length, image.mm_hash) for image in self.mm_inputs]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_tokens + self.num_output_placeholders

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
