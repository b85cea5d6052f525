"""Results handed to users: vLLM's `RequestOutput`, `CompletionOutput` and `Logprob` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """The log-probability of one token at one position, as in vLLM.

    rank: 1 for the most likely token of the position's distribution, 2 for the next, ...
    decoded_token: the token's own text (None when the request asked for detokenize=False).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position, token id -> Logprob: the chosen token plus the top-k of the position.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (with logprobs=k)
    logprobs: SampleLogprobs | None = None  # with SamplingParams.logprobs=k: one dict per token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request: its prompt and its completions so far (n of them)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs=k
    # A pooling request's result (zllm/pooling.py): the embedding, or the class probabilities.
    pooled: list[float] | None = None


# ---- pooling models (LLM.embed / classify / score / encode): vLLM's output types ------------------


@dataclass(slots=True)
class PoolingOutput:
    """The raw pooled vector (LLM.encode). vLLM holds a tensor here; zllm a list (torch-free)."""

    data: list[float]


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class PoolingRequestOutput:
    """One input's result from a pooling model; `outputs` is one of the four kinds above."""

    request_id: str
    outputs: PoolingOutput | EmbeddingOutput | ClassificationOutput | ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput):
    __slots__ = ()


class ClassificationRequestOutput(PoolingRequestOutput):
    __slots__ = ()


class ScoringRequestOutput(PoolingRequestOutput):
    __slots__ = ()
