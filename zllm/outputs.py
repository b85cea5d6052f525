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


class _Vector:
    """A result vector, given as a list or as a row of a batch's array (anything with `tolist`:
    LLM's pooling batches finish all their vectors in one array). A row becomes its list of
    floats the first time it is read, so a batch of 10,000 embeddings does not build 3.8 million
    Python floats before returning, and one that is read gets them once."""

    __slots__ = ("_values",)
    _name = "values"

    def __init__(self, values) -> None:
        self._values = values

    def _list(self) -> list[float]:
        if not isinstance(self._values, list):
            self._values = self._values.tolist()
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and self._list() == other._list()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._name}={self._list()!r})"


class PoolingOutput(_Vector):
    """The raw pooled vector (LLM.encode). vLLM holds a tensor here; zllm a list (torch-free)."""

    __slots__ = ()
    _name = "data"

    def __init__(self, data) -> None:
        self._values = data

    @property
    def data(self) -> list[float]:
        return self._list()


class EmbeddingOutput(_Vector):
    __slots__ = ()
    _name = "embedding"

    def __init__(self, embedding) -> None:
        self._values = embedding

    @property
    def embedding(self) -> list[float]:
        return self._list()

    @property
    def hidden_size(self) -> int:
        return len(self)


class ClassificationOutput(_Vector):
    __slots__ = ()
    _name = "probs"

    def __init__(self, probs) -> None:
        self._values = probs

    @property
    def probs(self) -> list[float]:
        return self._list()

    @property
    def num_classes(self) -> int:
        return len(self)


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
