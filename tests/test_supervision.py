"""The parts of supervision that need no server: restart policy, replay bookkeeping, resumed
requests in the engine core (greedy and seeded), the bounded waiting queue, process watching,
sd_notify, journald logging, CURVE key files, and the systemd unit file."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.models import save_tiny_llama
from zllm.frontend.replay import ReplayLog
from zllm.frontend.restart_policy import RestartPolicy
from zllm.ipc.messages import AddRequest
from zllm.launch.sd_notify import SystemdNotifier
from zllm.procs.exits import kill_and_wait, wait_for_any_exit
from zllm.procs.racing import first_result, race
from zllm.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parent.parent


# ---- restart policy ------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_restart_policy_backs_off_then_gives_up():
    clock = FakeClock()
    policy = RestartPolicy(max_restarts=4, window_s=600, max_backoff_s=3.0, clock=clock)
    assert [policy.next_delay() for _ in range(5)] == [0.0, 1.0, 2.0, 3.0, None]
    assert policy.recent_restarts == 4


def test_restart_policy_forgets_restarts_outside_its_window():
    clock = FakeClock()
    policy = RestartPolicy(max_restarts=2, window_s=60, clock=clock)
    assert policy.next_delay() == 0.0
    assert policy.next_delay() == 1.0
    assert policy.next_delay() is None
    clock.now += 61.5
    assert policy.recent_restarts == 0
    assert policy.next_delay() == 0.0  # a crash long after the last one restarts at once again


def test_restart_policy_zero_restarts_never_restarts():
    assert RestartPolicy(max_restarts=0, window_s=60).next_delay() is None


# ---- replay bookkeeping --------------------------------------------------------------------------


def _add(request_id: str, arrival: float, **sampling) -> AddRequest:
    return AddRequest(request_id, [1, 2, 3], SamplingParams(**sampling), arrival, eos_token_ids=[2], priority=1)


def test_continuations_resume_each_completion_from_what_its_client_received():
    log = ReplayLog(max_replays=2)
    log.record("b", [_add("b", 2.0, seed=7, max_tokens=10)])
    log.record("a", [_add("a", 1.0, temperature=0.0)])
    log.record("n", [_add("0_n", 3.0, prompt_logprobs=2), _add("1_n", 3.0), _add("2_n", 3.0)])  # n=3 children
    log.record("c", [_add("c", 4.0)])
    log.forget("c")
    received = {"a": [5, 6], "b": [], "0_n": [9], "1_n": None, "2_n": []}  # 1_n already finished
    resend, given_up = log.continuations(received.__getitem__)
    assert given_up == []
    assert [m.request_id for m in resend] == ["a", "b", "0_n", "2_n"]  # arrival order; ended ones skipped
    a, b, n0, n2 = resend
    assert a.output_token_ids == [5, 6] and a.resumed and a.prompt_token_ids == [1, 2, 3]
    assert b.output_token_ids == [] and b.resumed
    # Everything else is the original request, untouched (max_tokens counts outputs already given).
    original = (SamplingParams(seed=7, max_tokens=10), [2], 1, 2.0)
    assert (b.sampling, b.eos_token_ids, b.priority, b.arrival_time) == original
    # Prompt logprobs came with the first token: once it was received they are not asked again.
    assert n0.sampling.prompt_logprobs is None and n0.output_token_ids == [9]
    assert n2.sampling == SamplingParams()


def test_a_request_in_flight_through_too_many_failures_is_given_up():
    log = ReplayLog(max_replays=2)
    log.record("poison", [_add("poison", 1.0)])
    for _ in range(2):
        resend, given_up = log.continuations(lambda _: [])
        assert [m.request_id for m in resend] == ["poison"] and given_up == []
    log.record("innocent", [_add("innocent", 2.0)])
    resend, given_up = log.continuations(lambda _: [])
    assert [m.request_id for m in resend] == ["innocent"] and given_up == ["poison"]
    assert "poison" not in log and len(log) == 1


# ---- resumed requests in the engine core: what a replay relies on -------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny"), initializer_range=0.2))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices on a shared 2-core machine: a second thread only spins against the first."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_core(tiny_model, one_torch_thread):
    from zllm.config import EngineConfig
    from zllm.launch.inprocess import build_inprocess_core

    return build_inprocess_core(EngineConfig.create(tiny_model, dtype="float32", max_model_len=256))


def _run_core(core, messages: list[AddRequest]) -> dict[str, list[int]]:
    for message in messages:
        core.add_request(message)
    tokens: dict[str, list[int]] = {m.request_id: [] for m in messages}
    while core.has_unfinished_requests():
        for delta in core.step():
            tokens[delta.request_id] += delta.new_token_ids
    return tokens


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=1234, top_k=50)], ids=["greedy", "seeded"]
)
def test_resumed_request_continues_exactly(tiny_core, sampling):
    """A request re-sent with its first k outputs produces exactly the uninterrupted rest: greedy
    trivially, seeded sampling because each token's generator is seeded by (seed, output index)."""
    params = SamplingParams(max_tokens=24, ignore_eos=True, **sampling)
    prompt = [5, 9, 13, 40, 41]
    full = _run_core(tiny_core, [AddRequest("full", prompt, params, 0.0)])["full"]
    assert len(full) == 24
    cuts = (1, 9, 23)
    resumed = [AddRequest(f"cut{k}", prompt, params, 0.0, output_token_ids=full[:k], resumed=True) for k in cuts]
    rests = _run_core(tiny_core, resumed)  # batched together, and with other lengths than the first run
    for k in cuts:
        assert full[:k] + rests[f"cut{k}"] == full, k


def test_unseeded_sampling_resumes_with_the_tokens_given(tiny_core):
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0)
    given = [7, 7, 7]
    rest = _run_core(tiny_core, [AddRequest("r", [5, 9], params, 0.0, output_token_ids=given, resumed=True)])["r"]
    assert len(rest) == 12 - len(given)  # max_tokens counts the tokens already produced


def test_waiting_queue_is_bounded_but_resumed_requests_get_in(tiny_model, one_torch_thread):
    from zllm.config import EngineConfig
    from zllm.enginecore.core import QueueFullError
    from zllm.launch.inprocess import build_inprocess_core

    core = build_inprocess_core(EngineConfig.create(tiny_model, dtype="float32", max_model_len=256, max_waiting=2))
    params = SamplingParams(max_tokens=4)
    core.add_request(AddRequest("a", [5], params, 0.0))
    core.add_request(AddRequest("b", [5], params, 0.0))
    with pytest.raises(QueueFullError, match=r"^overloaded: 2 requests are already waiting \(max_waiting=2\)"):
        core.add_request(AddRequest("c", [5], params, 0.0))
    core.add_request(AddRequest("d", [5], params, 0.0, output_token_ids=[6], resumed=True))
    assert core.stats().num_waiting == 3
    with pytest.raises(ValueError, match="^prompt:"):
        core.add_request(AddRequest("e", [5] * 200, params, 0.0, output_token_ids=[6] * 56, resumed=True))


# ---- watching processes --------------------------------------------------------------------------


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polling"])
def test_wait_for_any_exit_sees_a_kill_9_at_once(monkeypatch, pidfd):
    if not pidfd:
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    elif not hasattr(os, "pidfd_open"):
        pytest.skip("os.pidfd_open needs Linux >= 5.3 and Python >= 3.9")
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)]
    try:

        async def scenario() -> tuple[int, float]:
            watch = asyncio.create_task(wait_for_any_exit([p.pid for p in sleepers]))
            await asyncio.sleep(0.3)
            assert not watch.done()
            sleepers[1].kill()
            killed = time.monotonic()
            pid = await asyncio.wait_for(watch, 5)
            return pid, time.monotonic() - killed

        pid, delay = asyncio.run(scenario())
        assert pid == sleepers[1].pid
        assert delay < 2.0
    finally:
        for process in sleepers:
            process.kill()
            process.wait()


def test_kill_and_wait_returns_once_children_and_other_processes_are_gone():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    # A grandchild is no child of this process: it is killed and waited for by pid.
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)']); print(p.pid, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    grandchild = int(parent.stdout.readline())
    try:
        kill_and_wait([child, grandchild])
        assert child.returncode == -9  # reaped
        assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    finally:
        for process in (child, parent):
            process.kill()
            process.wait()


def test_race_returns_the_first_to_finish_and_cancels_the_rest_but_those_kept():
    async def scenario() -> None:
        event = asyncio.Event()
        quick = asyncio.create_task(asyncio.sleep(0.01, "quick"))
        slow = asyncio.create_task(asyncio.sleep(60))
        kept = asyncio.create_task(asyncio.sleep(60))
        assert await race(quick, slow, kept, event, keep=(kept,)) == {quick}
        assert slow.cancelled() and not kept.done()
        assert await first_result([kept, asyncio.create_task(asyncio.sleep(0, "first"))]) == "first"
        assert kept.cancelled()
        waiting = asyncio.create_task(asyncio.sleep(60))
        asyncio.get_running_loop().call_later(0.01, event.set)
        assert await race(waiting, event) == {event}
        assert waiting.cancelled()

    asyncio.run(scenario())


# ---- systemd: notify protocol, journald lines, the unit file -------------------------------------


def _listen(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    return sock


def test_sd_notify_writes_datagrams_to_the_notify_socket(tmp_path):
    listener = _listen(tmp_path / "notify")
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "3000000"})
    assert notifier.enabled and notifier.watchdog_interval_s == 3.0
    notifier.ready("serving m")
    notifier.watchdog()
    notifier.stopping("draining 2 request(s)")
    assert [listener.recv(4096) for _ in range(3)] == [
        b"READY=1\nSTATUS=serving m",
        b"WATCHDOG=1",
        b"STOPPING=1\nSTATUS=draining 2 request(s)",
    ]


def test_sd_notify_abstract_socket_and_watchdog_for_another_pid():
    name = f"zllm-test-{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(b"\0" + name.encode())
    listener.settimeout(5)
    notifier = SystemdNotifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert notifier.watchdog_interval_s is None  # the watchdog is for pid 1, not for us
    notifier.status("x")
    assert listener.recv(100) == b"STATUS=x"


def test_sd_notify_is_a_no_op_outside_systemd():
    notifier = SystemdNotifier({})
    assert not notifier.enabled and notifier.watchdog_interval_s is None
    notifier.ready("nothing happens")


def test_log_lines_carry_syslog_priorities_under_journald(tmp_path):
    code = (
        "import logging, os, sys\n"
        "st = os.fstat(sys.stderr.fileno()); os.environ['JOURNAL_STREAM'] = f'{st.st_dev}:{st.st_ino}'\n"
        "from zllm.procs.log import configure_logging\n"
        "configure_logging('frontend', 'INFO')\n"
        "log = logging.getLogger('zllm.test')\n"
        "log.info('hello'); log.warning('careful')\n"
        "try:\n    1 / 0\nexcept ZeroDivisionError:\n    log.exception('failed')\n"
    )
    with open(tmp_path / "stderr", "wb") as stderr:
        subprocess.run([sys.executable, "-c", code], stderr=stderr, check=True)
    lines = (tmp_path / "stderr").read_text().splitlines()
    assert lines[0] == f"<6>frontend[{lines[0].split('[')[1].split(']')[0]}] zllm.test: hello"
    assert lines[1].startswith("<4>frontend[") and lines[1].endswith("careful")
    assert all(line.startswith("<3>") for line in lines[2:]) and any("ZeroDivisionError" in x for x in lines[2:])


def _verify_unit(tmp_path: Path, name: str) -> str:
    """systemd-analyze verify on deploy/<name>, its ExecStart pointed at this vllm-launch."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd; .ci/run does)")
    unit = (REPO / "deploy" / name).read_text()
    # verify checks that ExecStart exists: point it at the vllm-launch installed here.
    launcher = shutil.which("vllm-launch") or str(Path(sys.executable).parent / "vllm-launch")
    if not os.access(launcher, os.X_OK):
        pytest.skip("vllm-launch is not installed (pip install -e .)")
    assert "/opt/zllm/venv/bin/vllm-launch" in unit
    (tmp_path / name).write_text(unit.replace("/opt/zllm/venv/bin/vllm-launch", launcher))
    result = subprocess.run([analyze, "verify", str(tmp_path / name)], capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    return unit


def test_unit_file_passes_systemd_analyze_verify(tmp_path):
    unit = _verify_unit(tmp_path, "zllm.service")
    for line in (
        "Type=notify",
        "KillMode=mixed",  # SIGTERM to the launcher only: it drains, then stops its engines itself
        "Restart=on-failure",
        "WatchdogSec=",
        "TimeoutStopSec=90",
        "--shutdown-timeout 60",
    ):
        assert line in unit
    # TimeoutStopSec must leave the drain its time.
    assert int(unit.split("TimeoutStopSec=")[1].split()[0]) > int(unit.split("--shutdown-timeout ")[1].split()[0])


def test_headless_node_unit_passes_systemd_analyze_verify(tmp_path):
    unit = _verify_unit(tmp_path, "zllm-node.service")
    for line in (
        "--headless $ZLLM_NODE_ARGS",
        "KillMode=control-group",
        "Restart=on-failure",
        "RestartPreventExitStatus=2",
    ):  # a refused node (exit 2) must not loop
        assert line in unit


# ---- CURVE key files -----------------------------------------------------------------------------


def test_keys_cli_makes_private_key_pairs(tmp_path):
    from zllm.ipc.curve import authorized_client_keys, load_key_pair, load_or_create_server_keys

    curve = tmp_path / "curve"
    run = [sys.executable, "-m", "zllm.launch.keys"]
    out = subprocess.run([*run, "server", "--curve-dir", str(curve)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(curve / "server.key")
    subprocess.run(
        [*run, "new-client", "--curve-dir", str(curve), "--name", "alice", "--out", str(tmp_path / "alice")],
        check=True,
        capture_output=True,
    )
    for secret in (curve / "server.key_secret", tmp_path / "alice" / "alice.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(curve.stat().st_mode) == 0o700
    alice_public, _ = load_key_pair(str(tmp_path / "alice" / "alice.key_secret"))
    assert authorized_client_keys(str(curve / "clients")) == {alice_public}
    keys = load_or_create_server_keys(str(curve))  # loads, does not regenerate
    assert keys.public == load_key_pair(str(curve / "server.key_secret"))[0]
    os.chmod(curve / "server.key_secret", 0o644)
    with pytest.raises(ValueError, match="readable by its owner only"):
        load_or_create_server_keys(str(curve))


def test_network_endpoints_need_authentication(tmp_path):
    from zllm.config import EngineConfig
    from zllm.ipc.curve import client_endpoint_keys

    with pytest.raises(ValueError, match=r"^client_endpoint: tcp://0.0.0.0:5555 is reachable from the network"):
        EngineConfig(model="m", max_model_len=16, client_endpoint="tcp://0.0.0.0:5555").validate()
    EngineConfig(model="m", max_model_len=16, client_endpoint="tcp://0.0.0.0:5555", curve_dir="/k").validate()
    EngineConfig(model="m", max_model_len=16, client_endpoint="tcp://0.0.0.0:5555", allow_insecure_tcp=True).validate()
    for loopback in ("tcp://127.0.0.1:5555", "tcp://localhost:5555", "tcp://[::1]:5555", "tcp://127.0.0.2:5555"):
        # Only this machine reaches it, but any user of it can: said so, and still refused.
        with pytest.raises(ValueError, match=r"^client_endpoint: \S+ without CURVE lets any local user connect"):
            EngineConfig(model="m", max_model_len=16, client_endpoint=loopback).validate()
        EngineConfig(model="m", max_model_len=16, client_endpoint=loopback, allow_insecure_tcp=True).validate()
    for network in ("tcp://*:5555", "tcp://eth0:5555", "tcp://10.0.0.1:5555", "tcp://[::]:5555"):
        with pytest.raises(ValueError, match="is reachable from the network"):
            EngineConfig(model="m", max_model_len=16, client_endpoint=network).validate()
    assert client_endpoint_keys("ipc:///run/zllm.sock", "", None) is None
    # CURVE keys but no authorized client and no api key: nobody could ever be authenticated.
    with pytest.raises(ValueError, match="no client is authorized"):
        client_endpoint_keys("tcp://0.0.0.0:5555", str(tmp_path / "curve"), None)
    assert client_endpoint_keys("tcp://0.0.0.0:5555", str(tmp_path / "curve"), "api key").secret
