"""Every message that crosses a process boundary, as msgspec Structs.

Internal messages (frontend <-> engine core <-> workers) are `array_like` (encoded as arrays,
no field names on the wire), tagged with their class name so one channel can carry several
kinds, and `omit_defaults`. Client-facing messages are maps with explicit tags, and reject
unknown fields, so a client mistake gets a precise error.

NOTE: fields are append-only. Add new fields last, with a default, or old peers break.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

import msgspec

from zllm.lora import LoRARequest
from zllm.outputs import Logprob
from zllm.pooling import PoolingParams
from zllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np


class _Message(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


# ---- multimodal inputs (frontend -> engine core -> workers) ------------------------------------


class ArrayData(_Message):
    """A numpy array as raw little-endian bytes: dtype name ("float32"), shape, data."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, array: np.ndarray) -> ArrayData:
        import numpy as np

        array = np.ascontiguousarray(array)
        return cls(
            array.dtype.name, list(array.shape), array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        )

    def to_numpy(self) -> np.ndarray:
        """The array (read-only, over the message's bytes)."""
        import numpy as np

        dtype = np.dtype(self.dtype).newbyteorder("<")
        count = 1
        for size in self.shape:
            count *= size
        if len(self.data) != count * dtype.itemsize:
            raise ValueError(f"ArrayData: {len(self.data)} bytes for shape {self.shape} of {self.dtype}")
        return np.frombuffer(self.data, dtype=dtype).reshape(self.shape)


class ImageInput(_Message):
    """One image of a prompt, processed by the model's image processor in the frontend: its
    placeholder tokens are prompt_token_ids[offset : offset + length]; `mm_hash` (hex SHA-256 of
    the pixel values and grid) keys the workers' encoder cache and enters the prefix-cache hashes
    of the blocks that hold its tokens."""

    mm_hash: str
    offset: int
    length: int
    pixel_values: ArrayData  # [patches, channels * temporal * patch * patch]
    grid_thw: list[int]  # patches along time, height, width


# ---- frontend -> engine core ------------------------------------------------------------------


class AddRequest(_Message):
    """A validated, tokenized request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    eos_token_ids: list[int] = []
    priority: int = 0
    cache_salt: str | None = None
    bad_words_token_ids: list[list[int]] = []  # SamplingParams.bad_words, tokenized by the frontend
    # Appended for crash recovery: a request re-sent to a restarted engine core continues from
    # the tokens its client already has (they count toward max_tokens and the seeded sampler's
    # output index), and is admitted even past max_waiting since it was admitted once.
    output_token_ids: list[int] = []
    resumed: bool = False
    # Appended: a pooling request (embedding, classification, score): no sampling, one step.
    pooling: PoolingParams | None = None
    # Appended: a vision-language model's images, in prompt order.
    mm_inputs: list[ImageInput] = []
    # Appended: the LoRA adapter that serves it (None: the base model).
    lora: LoRARequest | None = None


class AddPoolingBatch(_Message):
    """Many pooling inputs that share one PoolingParams, as one unit (LLM.embed's offline batch):
    their token ids concatenated (int32 [total]) and their lengths (int32 [inputs]); input i of
    the batch is its i-th. The frontend checked the shared parameters once and every length."""

    batch_id: str
    token_ids: ArrayData
    lengths: ArrayData
    pooling: PoolingParams
    arrival_time: float

    @classmethod
    def of(
        cls, batch_id: str, token_ids: np.ndarray, lengths: np.ndarray, pooling: PoolingParams, arrival_time: float
    ) -> AddPoolingBatch:
        return cls(batch_id, ArrayData.of(token_ids), ArrayData.of(lengths), pooling, arrival_time)


class AbortRequests(_Message):
    request_ids: list[str]


class UtilityCall(_Message):
    """Ask the engine core something outside the step loop ("stats", "ping", "reset_prefix_cache")."""

    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(_Message):
    reason: str = ""


# ---- engine core -> frontend ------------------------------------------------------------------


class TokenLogprobs(_Message):
    """Logprobs of consecutive positions (log-softmax of the raw logits).

    Row i: token_ids[i] = [chosen token, top-1, ..., top-k] with their logprobs[i]; ranks[i] is
    the chosen token's rank in its position's distribution (1 = most likely). The chosen token
    is the sampled one, or for prompt logprobs the prompt's next token.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def rows(self, first: int, count: int, num_top: int) -> TokenLogprobs:
        """`count` positions from `first`, each cut to the chosen token and its first `num_top`
        alternatives."""
        width = num_top + 1
        rows = slice(first, first + count)
        return TokenLogprobs(
            [ids[:width] for ids in self.token_ids[rows]],
            [values[:width] for values in self.logprobs[rows]],
            self.ranks[rows],
        )


class TokenDelta(_Message):
    """New tokens of one request since its last delta; finish_reason set when it ended."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: TokenLogprobs | None = None  # one row per new token (SamplingParams.logprobs)
    prompt_logprobs: TokenLogprobs | None = None  # prompt positions 1..P-1, with the first token
    error: str | None = None  # appended: why the request failed (finish_reason "error")
    pooled: bytes | None = None  # appended: a pooling request's vector (float32, little-endian)


class EngineOutputs(_Message):
    outputs: list[TokenDelta]
    # Requests the core ended on its own without a token (e.g. a failure), with the reason.
    failed: dict[str, str] = {}
    # Requests refused because the waiting queue is full (max_waiting): the client may retry.
    rejected: dict[str, str] = {}
    # Appended: the scheduler's queue lengths when the message was made, the load a frontend in
    # front of several engines (data parallelism) balances on.
    num_waiting: int = 0
    num_running: int = 0


class UtilityResult(_Message):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineReady(_Message):
    """The engine core's first message: it is serving, with this KV capacity."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    tensor_parallel_size: int
    model: str
    worker_pids: list[int] = []  # appended: the launcher watches these processes too


class EngineDead(_Message):
    """The engine core is going away because of an error; every request is lost."""

    reason: str


# ---- engine core -> workers (one per step) ----------------------------------------------------


class NewRequestData(_Message):
    """A request the workers have not seen (or see again after preemption): sent in full."""

    request_id: str
    prompt_len: int
    token_ids: list[int]  # the prompt, plus any output tokens when resumed after preemption
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: list[int] = []  # masked until min_tokens (unless ignore_eos)
    bad_words_token_ids: list[list[int]] = []
    pooling: PoolingParams | None = None  # appended: a pooling request (its token types, if any)
    # A hybrid model's sliding-window layers' table (zllm/kv_layout.py); [] for other models.
    sliding_block_ids: list[int] = []
    mm_inputs: list[ImageInput] = []  # appended: its images (encoded when StepInput.encode says)
    lora: LoRARequest | None = None  # appended: its adapter (None: the base model)


class PoolingSlice(_Message):
    """Inputs first .. first + len(lengths) - 1 of a pooling batch (AddPoolingBatch), scheduled
    together: their token ids concatenated (int32) and their lengths (int32)."""

    batch_id: str
    first: int
    token_ids: ArrayData
    lengths: ArrayData
    pooling: PoolingParams


class PooledSlice(_Message):
    """A PoolingSlice's answer: its inputs' pooled vectors (float32 [inputs, width]), in order,
    or why the workers could not pool them."""

    batch_id: str
    first: int
    vectors: ArrayData | None = None
    error: str | None = None


class CachedRequestData(_Message):
    """A request the workers already hold: only what changed since the last step. No token ids:
    the only tokens a held request gains are the ones the workers sampled and appended themselves."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    new_sliding_block_ids: list[int] = []  # a hybrid model's sliding-window layers' new blocks


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
    # Appended: requests that sample this step under a grammar (SamplingParams.structured_outputs).
    # Rank 0 samples the step only once the GrammarBitmask with its step_id has arrived.
    structured_ids: list[str] = []
    # Appended: speculative decoding. Request id -> the draft tokens this step scores after the
    # request's last known token; they are part of its num_scheduled_tokens (1 + len(drafts)).
    # Under async scheduling they are -1 placeholders: the workers score up to that many drafts of
    # their own proposing (fewer when they have fewer, the request's count shrinking to match).
    spec_token_ids: dict[str, list[int]] = {}
    # Appended: the encoder cache (zllm/enginecore/encoder_cache.py). Request id -> indices of its
    # images to encode this step (before the forward); hashes to drop first, the core having
    # evicted them.
    encode: dict[str, list[int]] = {}
    freed_mm_hashes: list[str] = []
    # Appended: slices of pooling batches (a pooling engine), pooled beside new_requests.
    pooling_slices: list[PoolingSlice] = []

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_ids and not self.pooling_slices


class FlushStep(_Message):
    """Answer the step in flight now. Under async scheduling a worker answers step N once it has
    launched step N+1 (so the device never waits for the host); the core sends this when it has
    no step N+1 to send and must wait for step N's tokens."""

    step_id: int


class GrammarBitmask(_Message):
    """The tokens each structured request of a step may sample next (to rank 0, which samples).

    Row i belongs to request_ids[i] (the step's structured_ids): `words` little-endian int32
    words, bit j of word w allowing token 32 * w + j (xgrammar's layout). A request scored with
    drafts has one row per position on consecutive rows (its id repeated): the tokens allowed
    after its first j drafts. The core sends it once
    every step before this one has been answered, so that the grammars have taken every token
    sampled so far; under async scheduling the worker runs the step's forward meanwhile."""

    step_id: int
    request_ids: list[str]
    words: int  # int32 words per row
    bitmask: bytes  # len(request_ids) * words * 4 bytes

    @classmethod
    def of(cls, step_id: int, request_ids: list[str], rows: np.ndarray) -> GrammarBitmask:
        """From an int32 array [len(request_ids), words]."""
        return cls(step_id, request_ids, int(rows.shape[1]), rows.astype("<i4", copy=False).tobytes())

    def rows(self) -> np.ndarray:
        """The int32 array [len(request_ids), words] (read-only, over the message's bytes)."""
        import numpy as np

        expected = len(self.request_ids) * self.words * 4
        if len(self.bitmask) != expected:
            raise ValueError(f"GrammarBitmask: {len(self.bitmask)} bytes, expected {expected}")
        return np.frombuffer(self.bitmask, dtype="<i4").reshape(len(self.request_ids), self.words)


class WorkerCall(_Message):
    """A set-up or control call to every worker: "init_kv_cache", "shutdown"."""

    call_id: int
    method: str
    args: list[Any] = []


# ---- workers -> engine core ---------------------------------------------------------------------


class StepOutput(_Message):
    """Rank 0's answer to a step: the tokens sampled for each request that reached its end, one
    row each. A request with draft tokens has one row per token it gained (the drafts accepted,
    then the target's own), in order, on consecutive rows; every other request has one row."""

    step_id: int
    request_ids: list[str]
    sampled_token_ids: list[int]
    # Row i belongs to request_ids[i]; present when any of them asked for logprobs (the core
    # keeps the rows of those that did).
    logprobs: TokenLogprobs | None = None
    # Requests whose prefill completed this step and asked for prompt logprobs.
    prompt_logprobs: dict[str, TokenLogprobs] = {}
    # Appended: requests the workers could not take (request id -> why). They failed alone: the
    # workers dropped them, the rest of the step ran; the core ends them with finish_reason "error".
    failed_requests: dict[str, str] = {}
    # Appended: speculative decoding. Request id -> the tokens proposed for its next step.
    draft_token_ids: dict[str, list[int]] = {}
    # Appended: pooling requests. Request id -> its pooled vector (float32, little-endian bytes).
    pooled: dict[str, bytes] = {}
    # Appended: the step's pooling slices, answered in the step's order.
    pooled_slices: list[PooledSlice] = []
    # Appended: speculative decoding. Request id -> how many drafts this step scored for it (its
    # acceptance counts; under async scheduling the workers choose them, up to what was asked).
    num_drafts_scored: dict[str, int] = {}


class WorkerReady(_Message):
    """A worker loaded its model; it can hold this many KV blocks."""

    rank: int
    num_kv_blocks: int
    pid: int


class WorkerCallResult(_Message):
    rank: int
    call_id: int
    result: Any = None
    error: str | None = None


class WorkerFailed(_Message):
    rank: int
    error: str


# ---- head node <-> headless nodes (multi-node tensor parallelism) -------------------------------


class NodeJoin(_Message):
    """A headless node offers its workers (`vllm-launch --headless`)."""

    node_rank: int
    nnodes: int


class NodeAccepted(_Message):
    """The head's EngineConfig (JSON; the node's own node_rank and keys are filled in there)."""

    config_json: bytes


class NodeRefused(_Message):
    reason: str


class StartWorkers(_Message):
    """Start this node's tp ranks for the engine core started as `generation`."""

    generation: int


class StopWorkers(_Message):
    """The engine of `generation` is gone (failed or stopped): kill this node's workers of it."""

    generation: int


class WorkersExited(_Message):
    """A worker of this node exited while its engine ran."""

    generation: int
    reason: str


class StartEngine(_Message):
    """Start engine core `dp_rank` (data parallelism across nodes) as `generation`."""

    dp_rank: int
    generation: int


class StopEngine(_Message):
    """Kill engine core `dp_rank` of `generation` and its workers; answered with EngineExited."""

    dp_rank: int
    generation: int


class EngineExited(_Message):
    """Engine core `dp_rank` of `generation` exited (or was stopped: reason "stopped")."""

    dp_rank: int
    generation: int
    reason: str


class NodeHeartbeat(_Message):
    """A node is alive (every heartbeat): a node silent for engine_hang_timeout_s is lost."""


class HeadHeartbeat(_Message):
    """The head is alive (every heartbeat): a node whose head is silent that long stops."""


class NodeLeaving(_Message):
    """The node was asked to stop (SIGTERM): the head drains and shuts the whole engine down."""

    reason: str


class NodeUnknown(_Message):
    """To a node that is not a member (it joined an earlier head process, or was dropped as
    lost): join again."""


class NodeShutdown(_Message):
    """The head is shutting down: stop the workers and exit."""

    reason: str


# ---- client <-> frontend (the public ZMQ protocol) ----------------------------------------------


class _ClientMessage(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True, tag_field="type"):
    pass


class ClientGenerate(_ClientMessage, tag="generate"):
    """Generate from a prompt (text or token ids) or a chat conversation."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    sampling: dict[str, Any] = {}  # SamplingParams fields; validated by the frontend
    priority: int = 0
    cache_salt: str | None = None
    api_key: str | None = None  # required when the server runs with --api-key
    # A pooling request (PoolingParams fields: task, normalize, dimensions, ...) to a pooling
    # model; its answer is one ServerOutput with `pooled` set.
    pooling: dict[str, Any] | None = None
    # A text pair (cross-encoder score): tokenized together with `prompt`.
    prompt_pair: str | None = None
    # The served LoRA adapter that generates (a --lora-modules name, or one loaded at run time);
    # None: the base model.
    lora_name: str | None = None


class ClientAbort(_ClientMessage, tag="abort"):
    request_id: str


class ClientPing(_ClientMessage, tag="ping"):
    pass


class ClientStats(_ClientMessage, tag="stats"):
    call_id: int
    api_key: str | None = None


class ClientUtility(_ClientMessage, tag="utility"):
    """Call an engine utility by name (the server allows "reset_prefix_cache")."""

    call_id: int
    method: str
    api_key: str | None = None


class ServerOutput(_ClientMessage, tag="output"):
    """What one completion (`index`, of n) of a request produced since its last ServerOutput
    (text, token ids and logprobs are deltas)."""

    request_id: str
    text: str = ""
    token_ids: list[int] = []
    finish_reason: str | None = None  # this completion ended
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # sent with the first output only
    index: int = 0
    finished: bool = False  # the whole request (all n completions) ended: nothing more follows
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # with the first output only
    cumulative_logprob: float | None = None
    num_cached_tokens: int = 0
    pooled: list[float] | None = None  # a pooling request's result: the embedding or the scores


class ServerError(_ClientMessage, tag="error"):
    """A request (or a stats call) failed. kind says what the client may do about it:
    "bad_request" (fix the request), "unauthorized" (wrong or missing api_key), "overloaded"
    (the waiting queue is full: retry later), "draining" (the server is shutting down: retry
    elsewhere or later), "engine_dead" (the engine failed; the request is lost), "internal" (the
    server failed this request alone, e.g. the workers could not set it up; others go on)."""

    request_id: str | None
    message: str
    kind: str = "bad_request"
    call_id: int | None = None  # set when the failed call was a ClientStats


class ServerPong(_ClientMessage, tag="pong"):
    pass


class ServerStats(_ClientMessage, tag="stats_result"):
    call_id: int
    stats: dict[str, Any] = {}


class ServerUtilityResult(_ClientMessage, tag="utility_result"):
    call_id: int
    result: Any = None
    error: str | None = None


FrontendToCore = Union[AddRequest, AbortRequests, UtilityCall, Shutdown]
CoreToFrontend = Union[EngineOutputs, UtilityResult, EngineReady, EngineDead]
CoreToWorker = Union[StepInput, FlushStep, WorkerCall, GrammarBitmask]
WorkerToCore = Union[StepOutput, WorkerReady, WorkerCallResult, WorkerFailed]
NodeToHead = Union[NodeJoin, WorkersExited, EngineExited, NodeHeartbeat, NodeLeaving]
HeadToNode = Union[
    NodeAccepted,
    NodeRefused,
    StartWorkers,
    StopWorkers,
    StartEngine,
    StopEngine,
    HeadHeartbeat,
    NodeUnknown,
    NodeShutdown,
]
ClientToServer = Union[ClientGenerate, ClientAbort, ClientPing, ClientStats, ClientUtility]
ServerToClient = Union[ServerOutput, ServerError, ServerPong, ServerStats, ServerUtilityResult]

# Every channel by name: what each socket's decoder accepts.
CHANNELS = {
    "FrontendToCore": FrontendToCore,
    "CoreToFrontend": CoreToFrontend,
    "CoreToWorker": CoreToWorker,
    "WorkerToCore": WorkerToCore,
    "NodeToHead": NodeToHead,
    "HeadToNode": HeadToNode,
    "ClientToServer": ClientToServer,
    "ServerToClient": ServerToClient,
}
