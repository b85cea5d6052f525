"""Fuzzing the wire: decoders only ever answer with a message or MessageError, and a running
server shrugs off garbage on every socket that accepts connections."""

from __future__ import annotations

import random
import time
import typing

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zllm.ipc import messages as m
from zllm.ipc.codec import Codec, MessageError
from zllm.sampling_params import SamplingParams

CHANNELS = m.CHANNELS
CLIENT_CHANNELS = ("ClientToServer", "ServerToClient")

SAMPLING = SamplingParams(temperature=0.5, top_k=5, seed=3, max_tokens=9, stop=["x"], stop_token_ids=[2])

VALID = {
    "FrontendToCore": [
        m.AddRequest("r1", [1, 2, 3], SAMPLING, 1.5, [2], 1),
        m.AbortRequests(["r1", "r2"]),
        m.UtilityCall(1, "stats", [1, "a"]),
        m.Shutdown("bye"),
    ],
    "CoreToFrontend": [
        m.EngineOutputs([m.TokenDelta("r1", [5, 6], "stop", "x", 16)], {"r2": "failed"}),
        m.UtilityResult(1, {"a": 1}, "err"),
        m.EngineReady(10, 16, 2048, 1, "model"),
        m.EngineDead("gone"),
    ],
    "CoreToWorker": [
        m.StepInput(
            7,
            [m.NewRequestData("r1", 3, [1, 2, 3], SAMPLING, [0], 0)],
            [m.CachedRequestData("r2", [1], 5)],
            ["r1", "r2"],
            [3, 1],
            ["r3"],
            ["r4"],
        ),
        m.WorkerCall(1, "init_kv_cache", [10]),
    ],
    "WorkerToCore": [
        m.StepOutput(7, ["r1"], [42]),
        m.WorkerReady(0, 10, 1234),
        m.WorkerCallResult(0, 1, None, "err"),
        m.WorkerFailed(0, "boom"),
    ],
    "NodeToHead": [
        m.NodeJoin(1, 2),
        m.WorkersExited(1, "rank 1 exited"),
        m.EngineExited(1, 2, "stopped"),
        m.NodeHeartbeat(),
        m.NodeLeaving("bye"),
    ],
    "HeadToNode": [
        m.NodeAccepted(b"{}"),
        m.NodeRefused("no"),
        m.StartWorkers(1),
        m.StopWorkers(1),
        m.StartEngine(1, 2),
        m.StopEngine(1, 2),
        m.HeadHeartbeat(),
        m.NodeUnknown(),
        m.NodeShutdown("bye"),
    ],
    "ClientToServer": [
        m.ClientGenerate("c1", prompt="Hi", sampling={"max_tokens": 3}, priority=2),
        m.ClientAbort("c1"),
        m.ClientPing(),
        m.ClientStats(3),
    ],
    "ServerToClient": [
        m.ServerOutput("c1", "text", [1, 2], "stop", "x", [3]),
        m.ServerError("c1", "bad", "internal"),
        m.ServerPong(),
        m.ServerStats(3, {"a": 1}),
    ],
}


def _codec(channel: str) -> Codec:
    return Codec(CHANNELS[channel])


def _tags(channel: str) -> list[str]:
    return [msgspec.inspect.type_info(t).tag for t in typing.get_args(CHANNELS[channel])]


def _field_names(channel: str) -> list[str]:
    return sorted({f.name for t in typing.get_args(CHANNELS[channel]) for f in msgspec.structs.fields(t)})


def _check_decode(channel: str, data) -> None:
    """The contract: a member of the channel's union, or MessageError; nothing else."""
    codec = _codec(channel)
    try:
        message = codec.decode(data)
    except MessageError:
        return
    assert isinstance(message, typing.get_args(CHANNELS[channel]))
    # Whatever was accepted is a whole message: it re-encodes to the same bytes.
    frame = codec.encode(message)
    assert codec.encode(codec.decode(frame)) == frame


# ---- (a) property-based fuzzing of the decoders --------------------------------------------------

FUZZ = settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=16)
)
_keys = st.text(max_size=12) | st.integers(min_value=-5, max_value=5)
structures = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=6) | st.dictionaries(_keys, children, max_size=6),
    max_leaves=25,
)


def _tagged(channel: str):
    """Structures that get past the tag: the right shape, arbitrary fields."""
    tags = st.sampled_from(_tags(channel))
    if channel in CLIENT_CHANNELS:
        names = _field_names(channel) + ["sampling_params", "bogus"]
        fields = st.dictionaries(st.sampled_from(names), structures, max_size=6)
        return st.builds(lambda tag, rest: {**rest, "type": tag}, tags, fields)
    return st.builds(lambda tag, rest: [tag, *rest], tags, st.lists(structures, max_size=8))


def _mutated(channel: str):
    """A valid message with one field (or one nested sampling field) replaced by anything."""

    @st.composite
    def strategy(draw):
        raw = msgspec.to_builtins(draw(st.sampled_from(VALID[channel])))
        value = draw(structures)
        if isinstance(raw, dict):
            return {**raw, draw(st.sampled_from(sorted(raw) + ["sampling"])): value}
        raw = list(raw)
        index = draw(st.integers(min_value=1, max_value=len(raw)))
        if index == len(raw):
            raw.append(value)
        elif isinstance(raw[index], dict) and draw(st.booleans()):
            key = draw(st.sampled_from([f.name for f in msgspec.structs.fields(SamplingParams)]))
            raw[index] = {**raw[index], key: value}
        else:
            raw[index] = value
        return raw

    return strategy()


def _check_all_channels(data) -> None:
    for channel in CHANNELS:
        _check_decode(channel, data)


@FUZZ
@given(data=st.binary(max_size=256))
def test_decode_arbitrary_bytes(data):
    _check_all_channels(data)


@FUZZ
@given(value=structures)
def test_decode_arbitrary_msgpack(value):
    _check_all_channels(msgspec.msgpack.encode(value))


@FUZZ
@given(data=st.data())
def test_decode_corrupted_valid_frames(data):
    channel = data.draw(st.sampled_from(list(CHANNELS)))
    frame = bytearray(_codec(channel).encode(data.draw(st.sampled_from(VALID[channel]))))
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        position = data.draw(st.integers(min_value=0, max_value=len(frame) - 1))
        frame[position] = data.draw(st.integers(min_value=0, max_value=255))
    end = data.draw(st.integers(min_value=0, max_value=len(frame)))
    _check_all_channels(bytes(frame[:end]))


@FUZZ
@given(data=st.data())
def test_decode_tagged_msgpack(data):
    channel = data.draw(st.sampled_from(list(CHANNELS)))
    _check_all_channels(msgspec.msgpack.encode(data.draw(_tagged(channel))))


@FUZZ
@given(data=st.data())
def test_decode_mutated_valid_messages(data):
    channel = data.draw(st.sampled_from(list(CHANNELS)))
    _check_all_channels(msgspec.msgpack.encode(data.draw(_mutated(channel))))


@FUZZ
@given(frames=st.lists(st.binary(max_size=32), max_size=5), expected=st.integers(min_value=1, max_value=3))
def test_decode_frames_arbitrary(frames, expected):
    for channel, union in CHANNELS.items():
        try:
            message = _codec(channel).decode_frames(frames, expected=expected)
        except MessageError:
            continue
        assert len(frames) == expected
        assert isinstance(message, typing.get_args(union))


# ---- inputs msgspec rejects with other exceptions than DecodeError -------------------------------

# msgspec raises UnicodeDecodeError (not DecodeError) for a msgpack str that is not UTF-8: in a
# tag, a str field, or a str inside an Any. A 4-byte frame does it; Codec.decode must turn it
# into MessageError.
INVALID_UTF8 = msgspec.Raw(b"\xa2\x00\x80")  # a 2-byte msgpack str holding invalid UTF-8
BAD_UTF8 = {
    "FrontendToCore": [[INVALID_UTF8], ["AbortRequests", [INVALID_UTF8]]],
    "CoreToFrontend": [[INVALID_UTF8], ["EngineDead", INVALID_UTF8]],
    "CoreToWorker": [[INVALID_UTF8], ["WorkerCall", 1, INVALID_UTF8]],
    "WorkerToCore": [[INVALID_UTF8], ["WorkerFailed", 0, INVALID_UTF8]],
    "ClientToServer": [{"type": INVALID_UTF8}, {"type": "abort", "request_id": INVALID_UTF8}],
    "ServerToClient": [{"type": INVALID_UTF8}, {"type": "error", "request_id": None, "message": INVALID_UTF8}],
}
UTF8_CASES = [
    pytest.param(channel, raw, id=f"{channel}-{i}") for channel, raws in BAD_UTF8.items() for i, raw in enumerate(raws)
]


@pytest.mark.parametrize(("channel", "raw"), UTF8_CASES)
def test_invalid_utf8_is_a_message_error(channel, raw):
    frame = msgspec.msgpack.encode(raw)
    with pytest.raises(MessageError):
        _codec(channel).decode(frame)


# Every channel carries an `Any` somewhere (args, result, sampling, stats), and msgspec decodes
# Any recursively: ~1,000 nested one-element arrays (1 KB) raise RecursionError, which
# Codec.decode must turn into MessageError.
_DEEP = msgspec.Raw(b"\x91" * 5000 + b"\xc0")
DEEP = {
    "FrontendToCore": ["UtilityCall", 1, "stats", [_DEEP]],
    "CoreToFrontend": ["UtilityResult", 1, _DEEP],
    "CoreToWorker": ["WorkerCall", 1, "init_kv_cache", [_DEEP]],
    "WorkerToCore": ["WorkerCallResult", 0, 1, _DEEP],
    "NodeToHead": ["NodeLeaving", _DEEP],  # (no Any here: a typed field refuses the nesting at once)
    "HeadToNode": ["NodeRefused", _DEEP],
    "ClientToServer": {"type": "generate", "request_id": "deep", "prompt": "x", "sampling": {"seed": _DEEP}},
    "ServerToClient": {"type": "stats_result", "call_id": 1, "stats": {"a": _DEEP}},
}


@pytest.mark.parametrize("channel", CHANNELS)
def test_deeply_nested_frame_is_a_message_error(channel):
    frame = msgspec.msgpack.encode(DEEP[channel])
    assert len(frame) < 6000
    with pytest.raises(MessageError):
        _codec(channel).decode(frame)


# ---- (b) live fuzzing of a running server --------------------------------------------------------

PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _generate(endpoint: str) -> list[int]:
    from zllm import Client

    with Client(endpoint, timeout=60.0) as client:
        output = client.generate(PROMPT, GREEDY, timeout=120.0)
    assert output.outputs[0].finish_reason in ("length", "stop")
    return list(output.outputs[0].token_ids)


def _garbage(channel: str, rng: random.Random) -> list[list[bytes]]:
    """A bounded pile of bad multipart messages for a socket that carries `channel`."""
    batches: list[list[bytes]] = []
    batches += [[rng.randbytes(rng.randint(1, 300))] for _ in range(40)]
    batches += [[b""], [b"\x00"], [b"\xc1"], [b"\xff" * 64], [b"\x91" * 20 + b"\xc0"]]
    # Valid msgpack, wrong type: plain values, and every message of every other channel.
    batches += [
        [msgspec.msgpack.encode(v)]
        for v in (
            None,
            42,
            "AddRequest",
            {"a": 1},
            [1, 2, 3],
            [],
            {},
            ["EngineDead"],
            {"type": "generate"},
            [b"\x00" * 8],
        )
    ]
    for other, examples in VALID.items():
        if other != channel:
            batches += [[_codec(other).encode(message)] for message in examples]
    # Truncated messages of the right channel (never a whole one: a valid message would be acted on).
    for message in VALID[channel]:
        frame = _codec(channel).encode(message)
        batches += [[frame[:end]] for end in sorted(rng.sample(range(len(frame)), min(6, len(frame))))]
    # Right tag, wrong field types.
    if channel in CLIENT_CHANNELS:
        batches += [
            [msgspec.msgpack.encode({"type": "generate", "request_id": 5})],
            [msgspec.msgpack.encode({"type": "abort", "request_id": "x", "extra": 1})],
        ]
    else:
        batches += [[msgspec.msgpack.encode([tag, "not an int", None, {"x": [1]}])] for tag in _tags(channel)]
    # Multipart: the wrong number of frames, some of them valid-looking.
    batches += [
        [b"", b""],
        [b"x"] * 20,
        [rng.randbytes(10) for _ in range(3)],
        [b"", _codec(channel).encode(VALID[channel][0])[:-1]],
    ]
    return [frames for frames in batches if len(frames) > 1 or _rejected_cleanly(channel, frames[0])]


def _rejected_cleanly(channel: str, frame: bytes) -> bool:
    """True if the decoder answers MessageError (a frame that decodes would be acted on)."""
    try:
        _codec(channel).decode(frame)
    except MessageError:
        return True
    return False


def _push(endpoint: str, batches: list[list[bytes]]) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.PUSH)
    try:
        socket.setsockopt(zmq.SNDHWM, 100_000)
        socket.setsockopt(zmq.SNDTIMEO, 5000)
        socket.connect(endpoint)
        for frames in batches:
            try:
                socket.send_multipart(frames)
            except zmq.Again:
                # The receiver cut the connection (a frame over its size limit) and the send timed
                # out waiting for it: what is left cannot be handed over, which is the point.
                break
    finally:
        # Closed before term(), also after a failed send: term() waits forever on an open socket.
        socket.close(linger=5000)  # returns once everything is handed over, or after 5 s
        context.term()


def _wait_for_log(server, offset: int, needles: list[str], timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        log = server.log()[offset:]
        if all(n in log for n in needles) or time.monotonic() > deadline:
            return log
        time.sleep(0.1)


def _alive(processes) -> bool:
    import psutil

    try:
        return all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes)
    except psutil.NoSuchProcess:
        return False


def _receive_all(socket: zmq.Socket, count: int, timeout: float = 20.0) -> list:
    codec = _codec("ServerToClient")
    replies = []
    deadline = time.monotonic() + timeout
    while len(replies) < count and time.monotonic() < deadline:
        if socket.poll(100):
            replies.append(codec.decode(socket.recv()))
    return replies


@pytest.mark.slow
def test_live_server_survives_garbage_on_every_open_socket(server):
    rng = random.Random(20240611)
    before = _generate(server.endpoint)
    children = server.children()
    assert len(children) >= 2, "expected an engine core and a worker"
    offset = len(server.log())

    # Clients: a DEALER sends garbage; each single-frame message gets its own bad_request reply.
    client_batches = _garbage("ClientToServer", rng)
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(server.endpoint)
        for frames in client_batches:
            dealer.send_multipart(frames)
        single = sum(1 for frames in client_batches if len(frames) == 1)
        replies = _receive_all(dealer, single)
        assert len(replies) == single
        for reply in replies:
            assert isinstance(reply, m.ServerError), reply
            assert reply.kind == "bad_request"
            assert reply.request_id is None
            assert reply.message.startswith("malformed message")
        assert not dealer.poll(300), "multi-frame garbage must be dropped without a reply"
        # Well-formed but invalid requests are answered with an error naming the request.
        encode = _codec("ClientToServer").encode
        dealer.send(encode(m.ClientGenerate("bad-temp", prompt="Hi", sampling={"temperature": -1})))
        dealer.send(encode(m.ClientGenerate("bad-ids", prompt_token_ids=[1, 10**9])))
        dealer.send(encode(m.ClientGenerate("bad-field", prompt="Hi", sampling={"temprature": 1.0})))
        dealer.send(encode(m.ClientPing()))
        replies = _receive_all(dealer, 4)
        errors = {r.request_id: r for r in replies if isinstance(r, m.ServerError)}
        assert set(errors) == {"bad-temp", "bad-ids", "bad-field"}, replies
        assert all(e.kind == "bad_request" for e in errors.values())
        assert "temperature" in errors["bad-temp"].message
        assert "prompt_token_ids" in errors["bad-ids"].message
        assert "temprature" in errors["bad-field"].message
        assert any(isinstance(r, m.ServerPong) for r in replies), "the connection still serves"
    finally:
        context.destroy(linger=0)

    # Internal PULL sockets: the frontend's (engine-core output) and the core's (worker output).
    _push(f"ipc://{server.engine_dir()}/core-output", _garbage("CoreToFrontend", rng))
    _push(f"ipc://{server.engine_dir()}/worker-output", _garbage("WorkerToCore", rng))

    # The core reads worker output only while it waits on a step: this generate drains it.
    after = _generate(server.endpoint)
    assert after == before
    assert server.process.poll() is None
    assert _alive(children)
    assert {p.pid for p in server.children()} == {p.pid for p in children}

    needles = [
        "malformed client message",
        "dropped a client message with",
        "dropped a malformed message from the engine core",
        "dropped a malformed message from a worker",
    ]
    log = _wait_for_log(server, offset, needles)
    for needle in needles:
        assert needle in log, f"{needle!r} not in the server log:\n{log[-3000:]}"
    assert "Traceback" not in log
    assert _generate(server.endpoint) == before


# ---- oversized frames and raw bytes on the sockets a server binds ----------------------------------

OVERSIZED = b"\x00" * (2 << 20)  # over the 1 MiB internal limit of the servers below
SMALL_LIMITS = ("--max-client-message-size", "64KiB", "--max-internal-message-size", "1MiB")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from tests.helpers.models import save_tiny_llama

    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny"), initializer_range=0.2, max_position_embeddings=4096))


def _raw_bytes(path: str, rng: random.Random) -> None:
    """Not even ZMTP: random bytes straight into a unix socket, then hang up."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(path)
        raw.sendall(rng.randbytes(4096))


@pytest.mark.slow
def test_live_server_drops_oversized_frames_and_raw_bytes_on_bound_sockets(tmp_path, tiny_model):
    from tests.helpers.server import start_server

    server = start_server(tmp_path, tiny_model, *SMALL_LIMITS, env={"OMP_NUM_THREADS": "1"})
    rng = random.Random(7)
    try:
        before = _generate(server.endpoint)
        children = server.children()
        engine = server.engine_dir()
        for endpoint in (f"ipc://{engine}/core-output", f"ipc://{engine}/worker-output", server.endpoint):
            _push(endpoint, [[OVERSIZED]])
            _raw_bytes(endpoint[len("ipc://") :], rng)
        assert _generate(server.endpoint) == before  # the core drains worker output while it steps
        assert server.process.poll() is None and _alive(children)
        assert {p.pid for p in server.children()} == {p.pid for p in children}
        assert "Traceback" not in server.log() and "engine failure" not in server.log()
    finally:
        server.stop()


# ---- the sockets a process connects: the test plays the peer that binds them ----------------------


class _Peer:
    """Binds a PUSH and a PULL where zllm's process expects its peer (frontend or engine core)."""

    def __init__(self, push_endpoint: str, pull_endpoint: str, pull_channel: str, push_channel: str) -> None:
        self.context = zmq.Context()
        self.push = self.context.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.bind(push_endpoint)
        self.pull = self.context.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(pull_endpoint)
        self.inbound, self.outbound = _codec(pull_channel), _codec(push_channel)

    def send(self, message) -> None:
        self.push.send(self.outbound.encode(message))

    def receive(self, kind: type, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pull.poll(100):
                message = self.inbound.decode(self.pull.recv())
                if isinstance(message, kind):
                    return message
        raise AssertionError(f"no {kind.__name__} within {timeout} s")

    def send_garbage(self, batches: list[list[bytes]]) -> None:
        for frames in batches:
            self.push.send_multipart(frames)
        self.push.send(OVERSIZED)  # refused by its size, on a connection that must survive it

    def call(self, message, kind: type):
        self.send(message)
        return self.receive(kind, timeout=30.0)

    def close(self) -> None:
        self.context.destroy(linger=0)


def _peer_config(tiny_model: str, runtime_dir) -> EngineConfig:  # noqa: F821
    from zllm.config import EngineConfig

    runtime_dir.mkdir(mode=0o700)
    return EngineConfig.create(
        tiny_model,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=16 << 20,
        runtime_dir=str(runtime_dir),
        client_max_message_bytes=64 << 10,
        internal_max_message_bytes=1 << 20,
    )


@pytest.mark.slow
def test_engine_core_input_survives_garbage_truncated_and_oversized_frames(tmp_path, tiny_model, capfd, monkeypatch):
    from zllm.ipc.addresses import InternalEndpoints
    from zllm.procs.children import spawn_child
    from zllm.procs.exits import stop_children

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = _peer_config(tiny_model, tmp_path / "rt")
    endpoints = InternalEndpoints(config.runtime_dir)
    frontend = _Peer(endpoints.core_input, endpoints.core_output, "CoreToFrontend", "FrontendToCore")
    core = spawn_child("zllm.enginecore.process", config)
    try:
        frontend.receive(m.EngineReady)

        def generate(request_id: str) -> list[int]:
            frontend.send(m.AddRequest(request_id, [5, 9, 13, 40], GREEDY, time.time()))
            tokens = []
            while True:
                for delta in frontend.receive(m.EngineOutputs).outputs:
                    tokens += delta.new_token_ids
                    if delta.finish_reason is not None:
                        return tokens

        before = generate("before")
        frontend.send_garbage(_garbage("FrontendToCore", random.Random(11)))
        assert isinstance(frontend.call(m.UtilityCall(1, "ping"), m.UtilityResult).result, float)
        assert generate("after") == before and len(before) == 8
        assert core.poll() is None
        frontend.send(m.Shutdown("test over"))
        assert core.wait(30) == 0
    finally:
        stop_children([core], timeout_s=5.0)
        frontend.close()
    log = capfd.readouterr().err
    assert "dropped a malformed message from the frontend: a frame of 2097152 bytes exceeds the limit" in log
    assert "dropped a malformed message from the frontend: DecodeError" in log


@pytest.mark.slow
def test_worker_input_survives_garbage_truncated_and_oversized_frames(tmp_path, tiny_model, capfd, monkeypatch):
    from zllm.ipc.addresses import InternalEndpoints
    from zllm.procs.children import spawn_child
    from zllm.procs.exits import stop_children

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = _peer_config(tiny_model, tmp_path / "rt")
    endpoints = InternalEndpoints(config.runtime_dir)
    core = _Peer(endpoints.worker_input(0), endpoints.worker_output, "WorkerToCore", "CoreToWorker")
    worker = spawn_child("zllm.workers.process", config, "--rank", "0")
    step_ids = iter(range(1, 100))
    try:
        core.receive(m.WorkerReady)
        core.send(m.WorkerCall(0, "init_kv_cache", [8]))
        assert core.receive(m.WorkerCallResult).error is None

        def first_token(request_id: str) -> int:
            prompt = [5, 9, 13, 40]
            core.send(
                m.StepInput(
                    next(step_ids), [m.NewRequestData(request_id, 4, prompt, GREEDY, [0], 0)], [], [request_id], [4]
                )
            )
            output = core.receive(m.StepOutput)
            core.send(m.StepInput(next(step_ids), [], [], [], [], finished_ids=[request_id]))
            core.receive(m.StepOutput)
            return output.sampled_token_ids[0]

        before = first_token("before")
        core.send_garbage(_garbage("CoreToWorker", random.Random(13)))
        answer = core.call(m.WorkerCall(1, "ping"), m.WorkerCallResult)
        assert answer.error == "unknown worker method 'ping'"  # answered: it serves again
        assert first_token("after") == before
        assert worker.poll() is None
        core.send(m.WorkerCall(2, "shutdown"))
        assert worker.wait(30) == 0
    finally:
        stop_children([worker], timeout_s=5.0)
        core.close()
    log = capfd.readouterr().err
    assert "rank 0: dropped a malformed message: a frame of 2097152 bytes exceeds the limit" in log
    assert "rank 0: dropped a malformed message: DecodeError" in log


# ---- one bad frame must not take a whole server down ---------------------------------------------


@pytest.mark.slow
def test_live_invalid_utf8_from_a_client_is_answered_not_fatal(tmp_path, smollm2_dir):
    from tests.helpers.server import start_server

    private = start_server(tmp_path, smollm2_dir)  # a private server: the shared one stays untouched
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(private.endpoint)
        dealer.send(msgspec.msgpack.encode({"type": "abort", "request_id": INVALID_UTF8}))  # 15 bytes
        replies = _receive_all(dealer, 1, timeout=10.0)
        assert replies and isinstance(replies[0], m.ServerError) and replies[0].kind == "bad_request", replies
        dealer.send(_codec("ClientToServer").encode(m.ClientPing()))
        assert [type(r) for r in _receive_all(dealer, 1, timeout=10.0)] == [m.ServerPong]
        assert private.process.poll() is None
    finally:
        context.destroy(linger=0)
        private.stop()


@pytest.mark.slow
@pytest.mark.parametrize(
    "conversation",
    [
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
        [{"role": 5, "content": "x"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": {"a": 1}}],
    ],
    ids=["no-content", "int-content", "int-role", "null-content", "dict-content"],
)
def test_malformed_chat_messages_are_a_value_error(smollm2_tokenizer, conversation):
    """What the frontend does with ClientGenerate.messages: it must raise ValueError naming the field."""
    from zllm.frontend.tokenizer import apply_chat_template

    try:
        apply_chat_template(smollm2_tokenizer, conversation)
    except ValueError as error:
        assert str(error).startswith("messages:")
    else:
        pytest.fail("accepted a malformed conversation")
