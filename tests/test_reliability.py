"""Reliability with real processes: kill -9 a worker or the engine core under 64 streams and
every stream completes as if nothing happened; --on-failure fail ends them all with engine-dead;
a crash loop gives up; SIGTERM drains (and speaks sd_notify); CURVE, --api-key and --max-waiting
on the client endpoint."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from tests.helpers.models import save_tiny_llama
from tests.helpers.server import ONE_THREAD, engine_processes, processes_gone, start_server, wait_until
from tests.helpers.streams import Ended, Streamed, run_streams
from zllm import AsyncClient, Client, SamplingParams
from zllm.client import AuthenticationError, EngineDeadError, OverloadedError, ServerDrainingError

pytestmark = pytest.mark.slow

NUM_STREAMS = 64


# ---- helpers -------------------------------------------------------------------------------------


def _log_time(log: str, needle: str) -> float:
    """The wall-clock time of the first log line containing needle."""
    line = next(line for line in log.splitlines() if needle in line)
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random Llama with a word-level tokenizer ("t5 t9" -> [5, 9]): fast steps."""
    from benchmarks.dummy_model import write_placeholder_tokenizer

    directory = save_tiny_llama(tmp_path_factory.mktemp("tiny"), initializer_range=0.2, max_position_embeddings=4096)
    write_placeholder_tokenizer(directory)
    return str(directory)


# ---- crash recovery under 64 streams (SmolLM2) ----------------------------------------------------

# Half the streams carry a stop string that never matches: the frontend holds back the end of
# their text while it could still be one, and that must carry on across the restart too. Every
# eighth asks for 2 seeded samples instead (n > 1, seeded: they too must repeat exactly).
GREEDY = [
    SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=8, ignore_eos=True)
    if i % 8 == 3
    else SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=["@@@@"] if i % 2 else None)
    for i in range(NUM_STREAMS)
]
STORY_PROMPTS = [f"Story number {i}: once upon a time" for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module", params=["--no-async-scheduling", "--async-scheduling"], ids=["sync", "async"])
def supervised(request, tmp_path_factory, smollm2_dir):
    """A server allowed 2 restarts, and its uninterrupted greedy answers to STORY_PROMPTS. Both
    step modes: async scheduling (the default on GPUs) has steps in flight when a process dies."""
    handle = start_server(
        tmp_path_factory.mktemp("supervised"), smollm2_dir, "--max-restarts", "2", request.param, env=ONE_THREAD
    )
    reference, _ = asyncio.run(run_streams(handle.endpoint, STORY_PROMPTS, GREEDY))
    assert all(isinstance(r, Streamed) and len(r.tokens) == 8 and r.text for r in reference)
    assert all(len(r.more[1][0]) == 8 for i, r in enumerate(reference) if i % 8 == 3)
    yield handle, reference
    handle.stop()


@pytest.mark.parametrize("victim", ["worker", "engine core"])
def test_kill9_under_64_streams_loses_nothing(supervised, victim):
    handle, reference = supervised
    offset = len(handle.log())
    core, workers = engine_processes(handle)
    target = workers[0] if victim == "worker" else core
    old_pids = [core.pid] + [w.pid for w in workers]

    results, killed_at = asyncio.run(run_streams(handle.endpoint, STORY_PROMPTS, GREEDY, kill=target.kill))

    assert results == reference  # every stream completed, token for token and text for text
    log = handle.log()[offset:]
    # Detected at once: by the launcher's watch on every engine process (for a killed core, its
    # worker may be seen exiting first, as it goes down with its parent).
    assert _log_time(log, "engine failure: ") - killed_at < 2.0, log
    assert f"engine failure: {victim}" in log or victim == "engine core", log
    recovered = re.search(r"engine recovered in ([0-9.]+) s: (\d+) request\(s\) replayed", log)
    assert recovered and int(recovered.group(2)) == NUM_STREAMS, log
    assert processes_gone(old_pids)  # the whole old engine went, not just the process that was killed
    new_core, new_workers = engine_processes(handle)
    assert new_core.pid not in old_pids and len(new_workers) == len(workers)


def test_crash_loop_gives_up_with_a_clear_error(supervised):
    """Allowed 2 restarts within the window: the failure after them ends every stream."""
    handle, _ = supervised
    params = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)

    seen: set[int] = set()

    def kill_until_given_up():
        """Kill every worker that shows up (restarts included) until the server gives up."""
        while handle.process.poll() is None:
            try:
                core, workers = engine_processes(handle)
                seen.update([core.pid] + [w.pid for w in workers])
                for worker in workers:
                    worker.kill()
            except (StopIteration, psutil.NoSuchProcess):
                pass  # between engines
            time.sleep(0.2)

    async def scenario():
        async with AsyncClient(handle.endpoint, timeout=120) as client:
            stream = client.stream("Count to a thousand:", params)
            await stream.__anext__()
            killer = asyncio.create_task(asyncio.to_thread(kill_until_given_up))
            with pytest.raises(EngineDeadError) as raised:
                async for _ in stream:
                    pass
            await killer
            return str(raised.value)

    message = asyncio.run(scenario())
    assert "gave up after 2 restart(s) within 600 s" in message, message
    assert handle.process.wait(30) == 1
    log = handle.log()
    assert "restarting the engine in 1 s (restart 2 of at most 2" in log  # backed off before the second
    assert wait_until(lambda: processes_gone(list(seen)), 10)


# ---- readiness while the engine restarts ---------------------------------------------------------


def test_health_is_503_while_the_engine_restarts_then_200(tmp_path, tiny_model):
    """kill -9 a worker: /health answers 503 (engine_restarting) and the client's stats say
    "recovering" until the new engine is up; then 200 and "serving" again, and requests run."""
    import httpx

    handle = start_server(tmp_path, tiny_model, env=ONE_THREAD)
    try:
        with httpx.Client(base_url=handle.http_url, timeout=10) as http, Client(handle.endpoint, timeout=30) as client:
            assert http.get("/health").status_code == 200 and client.stats()["state"] == "serving"
            _, workers = engine_processes(handle)
            workers[0].kill()
            seen, reasons = [], set()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not (seen and seen[-1][0] == 200 and any(s[0] == 503 for s in seen)):
                health = http.get("/health")
                error = health.json()["error"] if health.status_code != 200 else {"code": None}
                reasons.add(error.get("message"))
                seen.append((health.status_code, error["code"], client.stats()["state"]))
                time.sleep(0.05)
            assert seen[-1] == (200, None, "serving"), seen[-5:]
            restarting = [s for s in seen if s[0] == 503]
            assert restarting and all(code == "engine_restarting" for _, code, _ in restarting), seen
            assert (503, "engine_restarting", "recovering") in seen, seen
            assert reasons - {None} == {"the engine is restarting after a failure; retry shortly"}
            assert (
                len(client.generate("t5 t6", SamplingParams(max_tokens=3, ignore_eos=True)).outputs[0].token_ids) == 3
            )
        assert "engine recovered in" in handle.log()
    finally:
        handle.stop()


# ---- --on-failure fail ---------------------------------------------------------------------------


def test_on_failure_fail_ends_every_stream_with_engine_dead(tmp_path, tiny_model):
    handle = start_server(tmp_path, tiny_model, "--on-failure", "fail", env=ONE_THREAD)
    core, workers = engine_processes(handle)
    pids = [core.pid] + [w.pid for w in workers]
    params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    prompts = [f"t{5 + i} t9 t13" for i in range(NUM_STREAMS)]

    results, killed_at = asyncio.run(
        run_streams(handle.endpoint, prompts, params, kill=workers[0].kill, kill_after_tokens=1)
    )

    odd = [r for r in results if not (isinstance(r, Ended) and isinstance(r.error, EngineDeadError))]
    assert not odd, odd[:3]
    assert all("engine is dead: worker rank 0" in str(r.error) for r in results)
    assert max(r.at for r in results) - killed_at < 5.0
    assert handle.process.wait(15) == 1
    assert wait_until(lambda: processes_gone(pids), 10)


# ---- SIGTERM: drain, systemd notifications, second signal ------------------------------------------


def _notifications(sock: socket.socket, until: str, timeout: float) -> list[str]:
    received = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            received.append(sock.recv(4096).decode())
        except TimeoutError:
            break
        if until in received[-1]:
            break
    return received


def test_sigterm_drains_in_flight_refuses_new_and_notifies_systemd(tmp_path, tiny_model):
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "2000000", **ONE_THREAD}
    handle = start_server(tmp_path, tiny_model, "--shutdown-timeout", "120", env=env)

    first = _notifications(notify, "READY=1", 10)
    assert first and first[0].startswith("READY=1\nSTATUS=serving"), first
    with Client(handle.endpoint) as client:  # READY=1 means it answers
        assert len(client.generate("t5 t6", SamplingParams(max_tokens=3, ignore_eos=True)).outputs[0].token_ids) == 3
    assert any("WATCHDOG=1" in n for n in _notifications(notify, "WATCHDOG=1", 5))

    # Internal sockets live in private (0700) directories.
    engine_dir = Path(handle.runtime_dir) / "engine-1"
    assert (engine_dir / "core-input").exists()
    for directory in (Path(handle.runtime_dir), engine_dir):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory

    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    prompts = [f"t{5 + i} t9" for i in range(8)]

    async def scenario():
        async with AsyncClient(handle.endpoint, timeout=60) as client:
            streams = asyncio.create_task(
                run_streams(handle.endpoint, prompts, params, kill=lambda: handle.process.send_signal(signal.SIGTERM))
            )
            received = await asyncio.to_thread(_notifications, notify, "STOPPING=1", 30)
            assert any(n.startswith("STOPPING=1") for n in received), received
            with pytest.raises(ServerDrainingError, match="shutting down"):
                await client.generate("t7 t8", SamplingParams(max_tokens=3))
            return await streams

    (results, _) = asyncio.run(scenario())
    assert all(isinstance(r, Streamed) and len(r.tokens) == 300 for r in results), results
    assert handle.process.wait(60) == 0
    assert "drained: shutting down" in handle.log()


# ---- a client that stops reading -------------------------------------------------------------------


def test_a_client_that_stops_reading_is_dropped_and_the_others_stream_on(tmp_path, tiny_model):
    """A raw client asks for 64 x 300 tokens (one message each) and never reads: once its
    socket_hwm (10,000) messages are queued it loses its requests, instead of the server waiting
    for it, which would stall every other client on the shared socket (or crash the server)."""
    import zmq

    from zllm.ipc.codec import Codec
    from zllm.ipc.messages import ClientGenerate, ClientToServer

    handle = start_server(tmp_path, tiny_model, env=ONE_THREAD)
    context = zmq.Context()
    try:
        stuck = context.socket(zmq.DEALER)
        stuck.setsockopt(zmq.LINGER, 0)
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.setsockopt(zmq.RCVBUF, 4096)
        stuck.connect(handle.endpoint)
        encode = Codec(ClientToServer).encode
        sampling = {"max_tokens": 300, "ignore_eos": True, "temperature": 0.0}
        for i in range(64):
            stuck.send(encode(ClientGenerate(request_id=f"stuck-{i}", prompt=f"t{5 + i} t9", sampling=sampling)))
        prompts = [f"t{7 + i} t8" for i in range(16)]
        params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
        results, _ = asyncio.run(run_streams(handle.endpoint, prompts, params))
        assert all(isinstance(r, Streamed) and len(r.tokens) == 300 for r in results), results[:2]
        assert wait_until(lambda: "not reading (10000 messages queued for it)" in handle.log(), 60), handle.log()[
            -2000:
        ]
        with Client(handle.endpoint) as client:
            assert wait_until(lambda: client.stats()["num_running"] == 0, 30)  # its requests were aborted
        assert handle.process.poll() is None
    finally:
        context.destroy(linger=0)
        handle.stop()


# ---- the client endpoint: CURVE, api key, bounded waiting queue ------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def secured(tmp_path_factory, tiny_model):
    """A tcp server with CURVE (one authorized client, "alice"), an api key, 2 running + 2 waiting."""
    directory = tmp_path_factory.mktemp("secured")
    curve = directory / "curve"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "zllm.launch.keys",
            "new-client",
            "--curve-dir",
            str(curve),
            "--name",
            "alice",
            "--out",
            str(directory / "alice"),
        ],
        check=True,
        capture_output=True,
    )
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    handle = start_server(
        directory,
        tiny_model,
        "--zmq-curve-dir",
        str(curve),
        "--api-key",
        "sesame",
        "--max-num-seqs",
        "2",
        "--max-waiting",
        "2",
        endpoint=endpoint,
        env=ONE_THREAD,
    )
    keys = dict(server_key=str(curve / "server.key"), client_key=str(directory / "alice" / "alice.key_secret"))
    yield handle, keys
    handle.stop()


def test_curve_lets_only_authorized_clients_in(secured, tmp_path):
    handle, keys = secured
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with Client(handle.endpoint, api_key="sesame", **keys) as client:
        assert len(client.generate("t5 t6", params).outputs[0].token_ids) == 4

    from zllm.ipc.curve import create_client_keys

    _, stranger = create_client_keys(str(tmp_path / "elsewhere"), "mallory", str(tmp_path / "mallory"))
    refused = [
        (dict(), "security handshake failed: the server uses CURVE and this client does not"),
        (dict(server_key=keys["server_key"], client_key=stranger), "refused this client's CURVE key"),
        (dict(server_key=keys["client_key"], client_key=keys["client_key"]), "security handshake failed"),
    ]
    for security, reason in refused:
        started = time.monotonic()
        with Client(handle.endpoint, timeout=20, api_key="sesame", **security) as client:
            with pytest.raises(AuthenticationError, match=reason):
                client.generate("t5 t6", params)
        assert time.monotonic() - started < 10
    assert "refused a client: CURVE key" in handle.log()
    with Client(handle.endpoint, api_key="sesame", **keys) as client:  # still serving
        assert client.generate("t5 t6", params).finished


def test_api_key_guards_the_zmq_endpoint(secured):
    handle, keys = secured
    for api_key in (None, "open sesame"):
        with Client(handle.endpoint, api_key=api_key, **keys) as client:
            with pytest.raises(AuthenticationError, match="unauthorized: missing or wrong api_key"):
                client.generate("t5 t6", SamplingParams(max_tokens=2))
            with pytest.raises(AuthenticationError, match="unauthorized"):
                client.stats()
    with Client(handle.endpoint, api_key="sesame", **keys) as client:
        assert client.stats()["state"] == "serving"


def test_oversized_client_frame_drops_that_connection_only(secured):
    import zmq

    from zllm.ipc.codec import Codec
    from zllm.ipc.curve import load_key_pair, load_public_key, make_curve_client
    from zllm.ipc.messages import ClientPing, ClientToServer

    handle, keys = secured
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        make_curve_client(dealer, load_public_key(keys["server_key"]), load_key_pair(keys["client_key"]))
        dealer.connect(handle.endpoint)
        ping = Codec(ClientToServer).encode(ClientPing())
        dealer.send(ping)
        assert dealer.poll(10_000), "an authorized raw client is answered"
        dealer.recv()
        dealer.send(b"\x00" * (65 << 20))  # over the 64 MiB default
        assert not dealer.poll(2000)  # no reply: the connection was dropped before buffering it all
    finally:
        context.destroy(linger=0)
    with Client(handle.endpoint, api_key="sesame", **keys) as client:
        assert client.generate("t5 t6", SamplingParams(max_tokens=2)).finished
    assert handle.process.poll() is None


def test_overload_gets_retry_later_errors_not_unbounded_queues(secured):
    """2 running + 2 waiting allowed; 40 requests at once (10x): the rest are told to retry later."""
    handle, keys = secured
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    prompts = [f"t{5 + i} t9" for i in range(40)]
    results, _ = asyncio.run(run_streams(handle.endpoint, prompts, params, api_key="sesame", **keys))
    done = [r for r in results if isinstance(r, Streamed)]
    overloaded = [r.error for r in results if isinstance(r, Ended)]
    assert all(isinstance(e, OverloadedError) for e in overloaded), overloaded[:3]
    assert all(len(r.tokens) == 200 for r in done)
    # Accepted: at least the 2 that fit the waiting queue (all a burst gets when the core reads
    # the whole burst before its first step), at most those plus the ones that moved up to the 2
    # running slots while the burst came in.
    assert len(done) + len(overloaded) == 40 and 2 <= len(done) <= 10, (len(done), len(overloaded))
    assert "max_waiting=2" in str(overloaded[0]) and "retry later" in str(overloaded[0])
    with Client(handle.endpoint, api_key="sesame", **keys) as client:
        stats = client.stats()
        assert stats["num_waiting"] == 0 and stats["num_running"] == 0
    assert handle.process.poll() is None


def test_second_signal_exits_at_once(secured):
    """(Last of the tests on this server: it stops it.)"""
    handle, keys = secured
    core, workers = engine_processes(handle)
    pids = [core.pid] + [w.pid for w in workers]

    async def scenario():
        async with AsyncClient(handle.endpoint, timeout=60, api_key="sesame", **keys) as client:
            stream = client.stream("t5 t6", SamplingParams(max_tokens=2000, ignore_eos=True))
            await stream.__anext__()
            handle.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            signalled = time.monotonic()
            handle.process.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(handle.process.wait, 30)
            return code, time.monotonic() - signalled

    code, took = asyncio.run(scenario())
    assert code == 128 + signal.SIGTERM
    assert took < 10  # the interpreter's own teardown is most of it
    assert wait_until(lambda: processes_gone(pids), 10)
