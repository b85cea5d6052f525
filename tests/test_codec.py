"""The wire format: every message round-trips through its channel's Codec, and every channel's
decoder turns anything that is not one of its messages into MessageError."""

from __future__ import annotations

import dataclasses
import re

import msgspec
import pytest

from zllm.config import EngineConfig, SpeculativeConfig
from zllm.ipc import messages as m
from zllm.ipc.codec import Codec, MessageError, convert, decode_json, encode_json
from zllm.lora import LoRARequest
from zllm.outputs import Logprob
from zllm.pooling import PoolerConfig, PoolingParams
from zllm.sampling_params import SamplingParams, StructuredOutputsParams

# Every field differs from its default, except detokenize (False forbids stop strings; its round
# trip is checked separately).
SAMPLING = SamplingParams(
    n=3,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    seed=1234,
    max_tokens=77,
    min_tokens=3,
    stop=["END", "\n\n"],
    stop_token_ids=[2, 7],
    ignore_eos=True,
    include_stop_str_in_output=True,
    skip_special_tokens=False,
    spaces_between_special_tokens=False,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.3,
    logprobs=5,
    prompt_logprobs=2,
    logit_bias={17: -100.0, 3: 2.5},
    bad_words=["darn", "heck"],
    structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    truncate_prompt_tokens=100,
)

LOGPROBS = m.TokenLogprobs(
    token_ids=[[5, 5, 9], [6, 8, 6]], logprobs=[[-0.5, -0.5, -1.25], [-2.0, -0.1, -2.0]], ranks=[1, 2]
)
PROMPT_LOGPROBS = m.TokenLogprobs(token_ids=[[3, 7]], logprobs=[[-9.5, -0.75]], ranks=[812])
TOKEN_DELTA = m.TokenDelta(
    request_id="ab12/req-1",
    new_token_ids=[5, 6, 49151],
    finish_reason="stop",
    stop_reason="END",
    num_cached_tokens=32,
    logprobs=LOGPROBS,
    prompt_logprobs=PROMPT_LOGPROBS,
    error="(the codec does not care: set for the round trip)",
    pooled=b"\x00\x00\x80?\x00\x00\x00\xc0",
)
TOKEN_DELTA_INT_STOP = m.TokenDelta(
    request_id="ab12/req-2",
    new_token_ids=[2],
    finish_reason="length",
    stop_reason=2,
    num_cached_tokens=16,
    logprobs=m.TokenLogprobs(token_ids=[[2]], logprobs=[[-0.0]], ranks=[1]),
    prompt_logprobs=m.TokenLogprobs([], [], []),
    error="RuntimeError: boom",
    pooled=b"",
)
LORA = LoRARequest("sql-adapter", 3, "/adapters/sql")
POOLING = PoolingParams(
    task="score",
    normalize=False,
    dimensions=8,
    activation=False,
    token_type_ids=[0, 0, 1, 1],
    truncate_prompt_tokens=-1,
)
IMAGE = m.ImageInput(
    mm_hash="9f86d081884c7d65",
    offset=2,
    length=4,
    pixel_values=m.ArrayData(dtype="float32", shape=[4, 2], data=bytes(32)),
    grid_thw=[1, 4, 4],
)
NEW_REQUEST = m.NewRequestData(
    request_id="ab12/req-1",
    prompt_len=3,
    token_ids=[1, 2, 3, 4],
    sampling=SAMPLING,
    block_ids=[0, 7, 9],
    num_computed_tokens=16,
    eos_token_ids=[2, 49152],
    bad_words_token_ids=[[17], [22, 23]],
    pooling=POOLING,
    sliding_block_ids=[0, 5, 6],
    mm_inputs=[IMAGE],
    lora=LORA,
)
CACHED_REQUEST = m.CachedRequestData(
    request_id="ab12/req-3", new_block_ids=[4], num_computed_tokens=17, new_sliding_block_ids=[8]
)

CHANNELS = m.CHANNELS

EXAMPLES: dict[str, list[msgspec.Struct]] = {
    "FrontendToCore": [
        m.AddRequest(
            request_id="ab12/req-1",
            prompt_token_ids=[1, 2, 3, 49151],
            sampling=SAMPLING,
            arrival_time=1712345678.25,
            eos_token_ids=[2, 49152],
            priority=-3,
            cache_salt="tenant-7",
            bad_words_token_ids=[[17], [22, 23]],
            output_token_ids=[17, 18],
            resumed=True,
            pooling=POOLING,
            mm_inputs=[IMAGE],
            lora=LORA,
        ),
        m.AbortRequests(request_ids=["ab12/req-1", "ab12/req-2"]),
        m.UtilityCall(call_id=7, method="stats", args=[1, "two", [3.5, None], {"k": False}, b"\x00\xff"]),
        m.Shutdown(reason="test over"),
    ],
    "CoreToFrontend": [
        m.EngineOutputs(
            outputs=[TOKEN_DELTA, TOKEN_DELTA_INT_STOP],
            failed={"ab12/req-9": "prompt too long"},
            rejected={"ab12/req-10": "overloaded"},
            num_waiting=3,
            num_running=5,
        ),
        m.UtilityResult(call_id=3, result={"num_running": 1, "nested": [1, 2.5, "x"]}, error="partial"),
        m.EngineReady(
            num_kv_blocks=364,
            block_size=32,
            max_model_len=2048,
            tensor_parallel_size=2,
            model="SmolLM2",
            worker_pids=[4242, 4243],
        ),
        m.EngineDead(reason="WorkerDiedError: rank 0 exited"),
    ],
    "CoreToWorker": [
        m.StepInput(
            step_id=42,
            new_requests=[NEW_REQUEST],
            cached_requests=[CACHED_REQUEST],
            scheduled_ids=["ab12/req-1", "ab12/req-3"],
            num_scheduled_tokens=[4, 1],
            finished_ids=["ab12/req-7"],
            preempted_ids=["ab12/req-8"],
            structured_ids=["ab12/req-1"],
            spec_token_ids={"ab12/req-2": [17, 4, 99]},
            encode={"ab12/req-1": [0]},
            freed_mm_hashes=["e3b0c44298fc1c14"],
            pooling_slices=[
                m.PoolingSlice(
                    batch_id="batch-7",
                    first=3,
                    token_ids=m.ArrayData(dtype="int32", shape=[3], data=bytes(12)),
                    lengths=m.ArrayData(dtype="int32", shape=[1], data=b"\x03\x00\x00\x00"),
                    pooling=POOLING,
                )
            ],
        ),
        m.FlushStep(step_id=7),
        m.GrammarBitmask(step_id=42, request_ids=["ab12/req-1", "ab12/req-3"], words=2, bitmask=bytes(range(16))),
        m.WorkerCall(call_id=1, method="init_kv_cache", args=[364, "extra"]),
    ],
    "WorkerToCore": [
        m.StepOutput(
            step_id=42,
            request_ids=["ab12/req-1", "ab12/req-2"],
            sampled_token_ids=[5, 6],
            logprobs=LOGPROBS,
            prompt_logprobs={"ab12/req-2": PROMPT_LOGPROBS},
            failed_requests={"ab12/req-3": "InjectedFaultError: the prompt holds token 77"},
            draft_token_ids={"ab12/req-1": [5, 6]},
            pooled={"ab12/req-2": b"\x00\x00\x80?"},
            pooled_slices=[
                m.PooledSlice(
                    batch_id="batch-7",
                    first=3,
                    vectors=m.ArrayData(dtype="float32", shape=[1, 2], data=bytes(8)),
                    error="partial",
                )
            ],
            num_drafts_scored={"ab12/req-1": 3},
        ),
        m.WorkerReady(rank=1, num_kv_blocks=100, pid=4242),
        m.WorkerCallResult(rank=1, call_id=2, result=[1, "x", {"y": 2}], error="unknown worker method 'x'"),
        m.WorkerFailed(rank=1, error="rank 1: RuntimeError: out of memory"),
    ],
    "NodeToHead": [
        m.NodeJoin(node_rank=1, nnodes=2),
        m.WorkersExited(generation=3, reason="rank 1 (pid 77) exited with code -9"),
        m.EngineExited(dp_rank=3, generation=2, reason="stopped"),
        m.NodeHeartbeat(),
        m.NodeLeaving(reason="SIGTERM"),
    ],
    "HeadToNode": [
        m.NodeAccepted(config_json=b'{"model": "/models/smollm2"}'),
        m.NodeRefused(reason="this node says --nnodes 3; the head runs 2 nodes"),
        m.StartWorkers(generation=2),
        m.StopWorkers(generation=2),
        m.StartEngine(dp_rank=2, generation=4),
        m.StopEngine(dp_rank=2, generation=4),
        m.HeadHeartbeat(),
        m.NodeUnknown(),
        m.NodeShutdown(reason="frontend shutdown"),
    ],
    "ClientToServer": [
        m.ClientGenerate(
            request_id="req-1",
            prompt="Hello",
            prompt_token_ids=[1, 2],
            messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho", "n": 1}],
            add_generation_prompt=False,
            sampling=msgspec.to_builtins(SAMPLING),
            priority=5,
            cache_salt="tenant-7",
            api_key="key",
            pooling={"task": "embed", "dimensions": 8},
            prompt_pair="a second text",
            lora_name="sql-adapter",
        ),
        m.ClientAbort(request_id="req-1"),
        m.ClientPing(),
        m.ClientStats(call_id=9, api_key="key"),
        m.ClientUtility(call_id=10, method="reset_prefix_cache", api_key="key"),
    ],
    "ServerToClient": [
        m.ServerOutput(
            request_id="req-1",
            text="hello wörld",
            token_ids=[1, 2, 3],
            finish_reason="stop",
            stop_reason="END",
            prompt_token_ids=[4, 5],
            index=2,
            finished=True,
            logprobs=[{3: Logprob(-0.25, 1, " wö"), 9: Logprob(-1.5, 2, None)}],
            prompt_logprobs=[None, {4: Logprob(-7.0, 300, "x")}],
            cumulative_logprob=-3.5,
            num_cached_tokens=16,
            pooled=[0.25, -1.5],
        ),
        m.ServerError(request_id="req-1", message="temperature: must be >= 0", kind="internal", call_id=4),
        m.ServerPong(),
        m.ServerStats(call_id=9, stats={"num_running": 2, "num_waiting": 0}),
        m.ServerUtilityResult(call_id=10, result=True, error="not allowed"),
    ],
}

# A pooling batch (LLM's offline path hands it to an in-process core) and its slices.
POOLING_BATCH = m.AddPoolingBatch(
    batch_id="batch-7",
    token_ids=m.ArrayData(dtype="int32", shape=[5], data=bytes(20)),
    lengths=m.ArrayData(dtype="int32", shape=[2], data=b"\x02\x00\x00\x00\x03\x00\x00\x00"),
    pooling=POOLING,
    arrival_time=1712345678.5,
)
POOLED_SLICE_ERROR = m.PooledSlice(
    batch_id="batch-7",
    first=2,
    vectors=m.ArrayData(dtype="float32", shape=[1, 1], data=bytes(4)),
    error="RuntimeError: out of memory",
)

# Messages that only travel inside another one.
NESTED = [
    SAMPLING,
    TOKEN_DELTA,
    TOKEN_DELTA_INT_STOP,
    NEW_REQUEST,
    CACHED_REQUEST,
    LOGPROBS,
    IMAGE,
    IMAGE.pixel_values,
    POOLING_BATCH,
    POOLED_SLICE_ERROR,
    m.PoolingSlice(
        batch_id="batch-7", first=1, token_ids=POOLING_BATCH.token_ids, lengths=POOLING_BATCH.lengths, pooling=POOLING
    ),
]

ALL = [(channel, message) for channel, examples in EXAMPLES.items() for message in examples]
CLIENT_FACING = [(c, msg) for c, msg in ALL if c in ("ClientToServer", "ServerToClient")]
INTERNAL = [(c, msg) for c, msg in ALL if c not in ("ClientToServer", "ServerToClient")]


def _id(value) -> str:
    return type(value).__name__


def _codec(channel: str) -> Codec:
    return Codec(CHANNELS[channel])


def _message_classes() -> set[type]:
    return {
        value
        for name, value in vars(m).items()
        if isinstance(value, type)
        and issubclass(value, msgspec.Struct)
        and value.__module__ == m.__name__
        and not name.startswith("_")
    }


# ---- the examples cover everything, with non-default values ------------------------------------


def test_examples_cover_every_message_class():
    covered = {type(msg) for _, msg in ALL} | {type(x) for x in NESTED}
    missing = _message_classes() - covered
    assert not missing, f"no round-trip example for {sorted(c.__name__ for c in missing)}"


def test_examples_cover_every_member_of_every_channel():
    import typing

    for channel, union in CHANNELS.items():
        assert set(typing.get_args(union)) == {type(x) for x in EXAMPLES[channel]}, channel


@pytest.mark.parametrize("message", [msg for _, msg in ALL] + NESTED, ids=_id)
def test_examples_set_every_field_to_a_non_default(message):
    for field in msgspec.structs.fields(message):
        value = getattr(message, field.name)
        if isinstance(message, SamplingParams) and field.name == "detokenize":
            continue  # detokenize=False excludes the stop strings set here
        if field.default is not msgspec.NODEFAULT:
            assert value != field.default, f"{_id(message)}.{field.name} is its default"
        if field.default_factory is not msgspec.NODEFAULT:
            assert value != field.default_factory(), f"{_id(message)}.{field.name} is its default"


# ---- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("channel", "message"), ALL, ids=[f"{c}-{_id(x)}" for c, x in ALL])
def test_round_trip(channel, message):
    codec = _codec(channel)
    frame = codec.encode(message)
    decoded = codec.decode(frame)
    assert type(decoded) is type(message)
    assert decoded == message
    assert codec.decode(memoryview(frame)) == message
    assert codec.decode_frames([frame]) == message
    assert codec.decode_frames([b"identity", frame], expected=2) == message
    # Encoding is deterministic, so a peer re-encoding a message gets the same bytes.
    assert codec.encode(decoded) == frame


@pytest.mark.parametrize("message", NESTED, ids=_id)
def test_round_trip_nested(message):
    codec: Codec = Codec(type(message))
    decoded = codec.decode(codec.encode(message))
    assert decoded == message
    assert type(decoded) is type(message)


def test_round_trip_keeps_nested_sampling_params():
    (add, *_) = EXAMPLES["FrontendToCore"]
    decoded = _codec("FrontendToCore").decode(_codec("FrontendToCore").encode(add))
    assert isinstance(decoded.sampling, SamplingParams)
    assert msgspec.structs.asdict(decoded.sampling) == msgspec.structs.asdict(SAMPLING)
    (step, *_) = EXAMPLES["CoreToWorker"]
    decoded = _codec("CoreToWorker").decode(_codec("CoreToWorker").encode(step))
    assert decoded.new_requests[0].sampling == SAMPLING
    assert decoded.total_num_scheduled_tokens == 5


def test_defaults_are_omitted_and_restored():
    codec = _codec("FrontendToCore")
    message = m.AddRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingParams(), arrival_time=1.0)
    frame = codec.encode(message)
    assert msgspec.msgpack.decode(frame)[:5] == ["AddRequest", "r", [1], {}, 1.0]  # default sampling: {}
    assert codec.decode(frame) == message


# ---- each channel accepts only its own messages --------------------------------------------------

CROSS = [
    pytest.param(
        channel,
        other,
        message,
        id=f"{channel}<-{_id(message)}",
    )
    for channel in CHANNELS
    for other, message in ALL
    if other != channel
]


@pytest.mark.parametrize(("channel", "other", "message"), CROSS)
def test_channel_rejects_another_channels_message(channel, other, message):
    frame = _codec(other).encode(message)
    with pytest.raises(MessageError):
        _codec(channel).decode(frame)


@pytest.mark.parametrize("channel", CHANNELS)
@pytest.mark.parametrize("message", NESTED, ids=_id)
def test_channel_rejects_a_bare_nested_message(channel, message):
    with pytest.raises(MessageError):
        _codec(channel).decode(msgspec.msgpack.encode(message))


@pytest.mark.parametrize(("channel", "message"), ALL, ids=[f"{c}-{_id(x)}" for c, x in ALL])
def test_every_truncated_frame_is_rejected(channel, message):
    codec = _codec(channel)
    frame = codec.encode(message)
    union = CHANNELS[channel]
    import typing

    rejected = 0
    for end in range(len(frame)):
        prefix = frame[:end]
        try:
            decoded = codec.decode(prefix)
        except MessageError:
            rejected += 1
            continue
        # A prefix that happens to be a complete message must still be a whole, valid one.
        assert isinstance(decoded, typing.get_args(union))
    assert rejected == len(frame), "a strict prefix of a msgpack message decoded"
    with pytest.raises(MessageError):
        codec.decode(frame + b"\x00")  # trailing bytes


@pytest.mark.parametrize("channel", CHANNELS)
@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",
        b"\x00",
        b"\x90",
        b"\x80",
        b"\xc0",
        msgspec.msgpack.encode("AddRequest"),
        msgspec.msgpack.encode(["NoSuchMessage", 1]),
        msgspec.msgpack.encode({"type": "nope"}),
        msgspec.msgpack.encode({}),
        msgspec.msgpack.encode([]),
        b"\x80\x04\x95",
    ],
    ids=repr,
)
def test_garbage_is_rejected(channel, frame):
    with pytest.raises(MessageError):
        _codec(channel).decode(frame)


# ---- wrong field types -----------------------------------------------------------------------------

_CANDIDATES = ["a string", 12345, -1.5, [1, 2], {"k": 1}, True, None, b"\x00\x01", [["nested"]]]


def _wrong_values(type_) -> list:
    """Candidate values that msgspec refuses for `type_` (none for Any)."""
    wrong = []
    for candidate in _CANDIDATES:
        try:
            msgspec.msgpack.decode(msgspec.msgpack.encode(candidate), type=type_)
        except msgspec.ValidationError:
            wrong.append(candidate)
    return wrong


def _wrong_type_cases():
    for channel, message in ALL:
        builtins = msgspec.to_builtins(message, builtin_types=(bytes,))  # bytes stay bytes in msgpack
        for index, field in enumerate(msgspec.structs.fields(message)):
            for value in _wrong_values(field.type):
                if isinstance(builtins, list):  # array_like: [tag, field0, field1, ...]
                    mutated = list(builtins)
                    mutated[index + 1] = value
                    where = f"$[{index + 1}]"
                else:
                    mutated = dict(builtins, **{field.name: value})
                    where = f"$.{field.name}"
                yield pytest.param(channel, mutated, where, id=f"{_id(message)}.{field.name}={value!r}")
        # The SamplingParams nested in an internal message.
        if isinstance(builtins, list) and hasattr(message, "sampling"):
            index = [f.name for f in msgspec.structs.fields(message)].index("sampling") + 1
            for field in msgspec.structs.fields(SamplingParams):
                for value in _wrong_values(field.type)[:3]:
                    mutated = list(builtins)
                    mutated[index] = dict(mutated[index], **{field.name: value})
                    where = f"$[{index}].{field.name}"
                    yield pytest.param(channel, mutated, where, id=f"{_id(message)}.sampling.{field.name}={value!r}")


@pytest.mark.parametrize(("channel", "raw", "where"), list(_wrong_type_cases()))
def test_wrong_field_type_is_rejected(channel, raw, where):
    frame = msgspec.msgpack.encode(raw)
    with pytest.raises(MessageError) as info:
        _codec(channel).decode(frame)
    assert where in str(info.value)


def test_missing_required_field_is_rejected():
    with pytest.raises(MessageError, match="request_id"):
        _codec("ClientToServer").decode(msgspec.msgpack.encode({"type": "generate", "prompt": "x"}))
    with pytest.raises(MessageError):
        _codec("FrontendToCore").decode(msgspec.msgpack.encode(["AddRequest", "r", [1]]))
    with pytest.raises(MessageError):
        _codec("WorkerToCore").decode(msgspec.msgpack.encode(["WorkerReady", 0, 1]))


def test_extra_trailing_array_fields_are_ignored():
    """Fields are append-only: an older peer ignores fields a newer one appended."""
    message = m.WorkerReady(rank=0, num_kv_blocks=1, pid=2)
    builtins = msgspec.to_builtins(message)
    assert _codec("WorkerToCore").decode(msgspec.msgpack.encode([*builtins, "a newer field"])) == message


# ---- frame counts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("channel", CHANNELS)
def test_decode_frames_rejects_wrong_frame_counts(channel):
    codec = _codec(channel)
    frame = codec.encode(EXAMPLES[channel][0])
    for frames, expected in [
        ([], 1),
        ([frame, frame], 1),
        ([b"", frame], 1),
        ([frame] * 5, 1),
        ([frame], 2),
        ([], 2),
        ([b"id", b"x", frame], 2),
    ]:
        with pytest.raises(MessageError, match=f"expected {expected} frame"):
            codec.decode_frames(frames, expected=expected)
    with pytest.raises(MessageError):
        codec.decode_frames([frame[:-1]])


# ---- client-facing messages: unknown fields are named ----------------------------------------------


@pytest.mark.parametrize(("channel", "message"), CLIENT_FACING, ids=[f"{c}-{_id(x)}" for c, x in CLIENT_FACING])
def test_client_message_rejects_unknown_field_by_name(channel, message):
    raw = msgspec.to_builtins(message)
    raw["no_such_field"] = 1
    with pytest.raises(MessageError, match="no_such_field"):
        _codec(channel).decode(msgspec.msgpack.encode(raw))


def test_client_message_typo_is_named():
    raw = {"type": "generate", "request_id": "r", "prompt": "hi", "sampling_params": {"max_tokens": 3}}
    with pytest.raises(MessageError, match="sampling_params"):
        _codec("ClientToServer").decode(msgspec.msgpack.encode(raw))


# ---- SamplingParams values ----------------------------------------------------------------------

BAD_SAMPLING = [
    ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"logit_bias": {"7": 101.0}}, "logit_bias"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"bad_words": [""]}, "bad_words"),
    ({"seed": -1}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"stop": [1]}, "stop"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"temprature": 0.5}, "temprature"),
]


@pytest.mark.parametrize(("fields", "name"), BAD_SAMPLING, ids=[repr(f) for f, _ in BAD_SAMPLING])
def test_bad_sampling_params_fail_naming_the_field(fields, name):
    named = re.compile(rf"\b{name}\b")
    # What the frontend does with a client's `sampling` map.
    with pytest.raises(ValueError) as info:
        convert(fields, SamplingParams)
    assert named.search(str(info.value)), str(info.value)
    # A SamplingParams frame on its own.
    frame = msgspec.msgpack.encode(fields)
    with pytest.raises(MessageError) as info:
        Codec(SamplingParams).decode(frame)
    assert named.search(str(info.value)), str(info.value)
    # Nested in an internal message: the whole message is rejected.
    raw = ["AddRequest", "r", [1], fields, 1.0]
    with pytest.raises(MessageError) as info:
        _codec("FrontendToCore").decode(msgspec.msgpack.encode(raw))
    assert named.search(str(info.value)), str(info.value)


def test_sampling_params_decode_normalizes_like_the_constructor():
    decoded = Codec(SamplingParams).decode(msgspec.msgpack.encode({"stop": "END", "top_k": -1}))
    assert decoded == SamplingParams(stop=["END"], top_k=0)
    assert decoded.stop == ["END"] and decoded.top_k == 0


# ---- EngineConfig over JSON (how children get their config) ----------------------------------------

CONFIG = EngineConfig(
    model="/models/smollm2",
    tokenizer="/models/tok",
    dtype="float16",
    device="cpu",
    seed=7,
    load_format="dummy",
    quantization="fp8",
    kv_cache_dtype="fp8",
    max_model_len=1024,
    block_size=32,
    num_kv_blocks=99,
    kv_cache_memory_bytes=123_456_789,
    gpu_memory_utilization=0.5,
    max_num_seqs=3,
    max_num_batched_tokens=512,
    tensor_parallel_size=2,
    data_parallel_size=3,
    data_parallel_rank=2,
    nnodes=3,
    node_rank=1,
    master_addr="10.0.0.1",
    master_port=29600,
    headless=True,
    node_join_timeout_s=12.5,
    data_parallel_size_local=1,
    enforce_eager=True,
    piecewise_cuda_graphs=True,
    mixed_graph_max_tokens=96,
    async_scheduling=True,
    speculative_config=SpeculativeConfig(
        method="draft_model",
        num_speculative_tokens=5,
        model="/models/draft",
        prompt_lookup_min=2,
        prompt_lookup_max=6,
        draft_tensor_parallel_size=2,
        disable_by_batch_size=32,
    ),
    served_model_name="served",
    enable_prefix_caching=False,
    disable_hybrid_kv_cache_manager=True,
    scheduling_policy="priority",
    max_logprobs=5,
    max_n=4,
    distributed_init_method="tcp://127.0.0.1:29500",
    custom_all_reduce_max_bytes=4 << 20,
    runtime_dir="/run/user/1000/zllm-abc",
    client_endpoint="tcp://127.0.0.1:5555",
    socket_hwm=10,
    heartbeat_interval_s=0.25,
    startup_timeout_s=60.5,
    client_timeout_s=5.0,
    on_failure="fail",
    max_restarts=2,
    restart_window_s=60.0,
    engine_hang_timeout_s=9.5,
    shutdown_timeout_s=3.0,
    max_waiting=7,
    api_key="secret",
    curve_dir="/etc/zllm/curve",
    allow_insecure_tcp=True,
    client_max_message_bytes=1 << 20,
    internal_max_message_bytes=16 << 20,
    enable_auto_tool_choice=True,
    tool_call_parser="hermes",
    reasoning_parser="qwen3",
    skip_tokenizer_init=True,
    enable_responses_store=True,
    grammar_cache_size=8,
    grammar_threads=2,
    limit_mm_per_prompt={"image": 2},
    mm_processor_kwargs={"max_pixels": 1003520},
    allowed_local_media_path="/srv/images",
    media_fetch_timeout_s=3.0,
    max_media_bytes=1 << 20,
    host="0.0.0.0",
    port=8123,
    api_server_count=2,
    api_server_rank=1,
    max_request_body_bytes=1 << 20,
    runner="pooling",
    convert="embed",
    hf_overrides={"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True},
    pooler=PoolerConfig(
        kind="embed",
        pooling_type="mean",
        normalize=True,
        num_labels=2,
        max_seq_length=256,
        hidden_size=384,
        matryoshka=True,
        labels=["a", "b"],
        classifier_token_ids=[2152, 9693],
        classifier_method="from_2_way_softmax",
    ),
    enable_lora=True,
    lora_modules={"sql": "/adapters/sql", "chat": "/adapters/chat"},
    max_loras=4,
    max_lora_rank=64,
    max_cpu_loras=8,
    distributed_executor_backend="ray",
    ray_address="ray://head:10001",
)


def test_engine_config_json_round_trip():
    defaults = EngineConfig(model="")
    for field in dataclasses.fields(EngineConfig):
        assert getattr(CONFIG, field.name) != getattr(defaults, field.name), f"{field.name} is its default"
    data = encode_json(CONFIG)
    decoded = decode_json(data, EngineConfig)
    assert isinstance(decoded, EngineConfig)
    assert decoded == CONFIG
    assert decode_json(data.decode(), EngineConfig) == CONFIG
    minimal = decode_json(b'{"model": "/m"}', EngineConfig)
    assert minimal == EngineConfig(model="/m")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{",
        b"[]",
        b"null",
        b'{"tokenizer": "/t"}',
        b'{"model": 5}',
        b'{"model": "/m", "block_size": "16"}',
        b'{"model": "/m", "seed": 1.5}',
        b"\x80\x04\x95",
    ],
    ids=repr,
)
def test_engine_config_bad_json_is_a_message_error(data):
    with pytest.raises(MessageError):
        decode_json(data, EngineConfig)


def test_token_ids_only_sampling_params_round_trip():
    params = SamplingParams(max_tokens=5, detokenize=False, ignore_eos=True)
    codec = Codec(m.FrontendToCore)
    message = m.AddRequest("r", [1, 2], params, 0.0)
    assert codec.decode(codec.encode(message)).sampling == params
    with pytest.raises(ValueError, match="^stop:"):
        SamplingParams(stop=["x"], detokenize=False)


def test_frame_over_the_size_limit_is_rejected_before_decoding():
    codec = Codec(m.FrontendToCore, max_frame_bytes=64)
    small = codec.encode(m.AbortRequests(["r1"]))
    assert codec.decode(small) == m.AbortRequests(["r1"])
    with pytest.raises(MessageError, match=r"^a frame of 2\d\d bytes exceeds the limit of 64 bytes$"):
        codec.decode(codec.encode(m.AbortRequests(["r" * 200])))


def test_internal_frame_limit_leaves_room_for_any_client_frame():
    with pytest.raises(ValueError, match=r"^internal_max_message_bytes: must be >= 8 x client_max_message_bytes"):
        EngineConfig(
            model="m", max_model_len=16, client_max_message_bytes=1 << 20, internal_max_message_bytes=4 << 20
        ).validate()


def test_array_data_round_trips_an_array():
    import numpy as np

    array = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7
    data = m.ArrayData.of(array)
    assert data.dtype == "float32" and data.shape == [2, 3, 4]
    assert np.array_equal(Codec(m.ArrayData).decode(Codec(m.ArrayData).encode(data)).to_numpy(), array)
    with pytest.raises(ValueError, match="bytes for shape"):
        m.ArrayData("float32", [5], bytes(8)).to_numpy()
