"""Multi-node tensor parallelism on one machine: two `vllm-launch` invocations (a head and a
headless node, separate runtime dirs) over loopback tcp with CURVE and gloo serve tp 2 token for
token as tp 1 does, and stop cleanly from either side; a node with a key the head does not know,
or with a wrong --nnodes, is refused with a clear error; a node that never joins fails the head."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.models import save_tiny_llama
from tests.helpers.server import processes_gone, wait_until
from zllm import LLM, AsyncClient, Client, SamplingParams
from zllm.config import EngineConfig
from zllm.ipc.curve import create_client_keys, load_or_create_server_keys
from zllm.launch.node_agent import NodeArgs

pytestmark = pytest.mark.slow

ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}
PROMPTS = [f"Story number {i}: once upon a time" for i in range(8)] + ["The capital of France is"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


# ---- flags ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"nnodes": 2, "tensor_parallel_size": 3, "master_addr": "10.0.0.1", "curve_dir": "/k"},
            "3 ranks do not split evenly over 2 nodes",
        ),
        ({"nnodes": 2, "tensor_parallel_size": 2, "curve_dir": "/k"}, "master_addr: is required"),
        (
            {"nnodes": 2, "tensor_parallel_size": 2, "master_addr": "10.0.0.1"},
            r"nnodes: tcp://10.0.0.1:29501 \(the node",
        ),
        (
            {
                "nnodes": 2,
                "tensor_parallel_size": 2,
                "master_addr": "10.0.0.1",
                "curve_dir": "/k",
                "data_parallel_size": 2,
            },
            "without it the nodes split one engine's tp ranks",
        ),
        (
            {
                "nnodes": 2,
                "master_addr": "10.0.0.1",
                "curve_dir": "/k",
                "data_parallel_size": 4,
                "data_parallel_size_local": 1,
            },
            "1 engines on each of 2 nodes is not --data-parallel-size 4",
        ),
        (
            {"data_parallel_size": 2, "data_parallel_size_local": 1},
            "splits the engines over nodes: it needs --nnodes > 1",
        ),
        (
            {"nnodes": 2, "node_rank": 1, "tensor_parallel_size": 2, "master_addr": "10.0.0.1", "curve_dir": "/k"},
            "the other nodes run `vllm-launch --headless`",
        ),
        ({"nnodes": 2, "node_rank": 2}, r"node_rank: must be in \[0, 2\)"),
    ],
)
def test_bad_node_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", max_model_len=64, **fields).validate()


def test_ranks_and_gpus_per_node():
    head = EngineConfig(model="m", tensor_parallel_size=4, nnodes=2, master_addr="h", curve_dir="/k")
    node = EngineConfig(model="m", tensor_parallel_size=4, nnodes=2, node_rank=1, headless=True, master_addr="h")
    assert list(head.local_ranks()) == [0, 1] and list(node.local_ranks()) == [2, 3]
    assert head.first_gpu == 0 and node.first_gpu == -2  # rank 2 takes GPU 0 of node 1
    spread = dict(
        model="m",
        tensor_parallel_size=2,
        data_parallel_size=4,
        data_parallel_size_local=2,
        nnodes=2,
        master_addr="h",
        curve_dir="/k",
    )
    engine3 = EngineConfig(**spread, node_rank=1, headless=True, data_parallel_rank=3)
    assert engine3.dp_spans_nodes and not engine3.tp_spans_nodes
    assert list(engine3.local_ranks()) == [0, 1] and engine3.first_gpu == 2  # engine 3 = the node's second: GPUs 2, 3
    assert [EngineConfig(**spread).node_of_engine(d) for d in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"nnodes": 1}, "a headless node belongs to a group of >= 2 nodes"),
        ({"node_rank": 0}, r"node_rank: a headless node is 1 \.\. 1"),
        ({"master_addr": ""}, "master_addr: the head node's address is required"),
        ({"curve_dir": "", "allow_insecure_tcp": False}, "zmq_curve_dir: the head's server.key"),
    ],
)
def test_bad_headless_flags_are_refused(fields, message):
    args = dict(
        nnodes=2,
        node_rank=1,
        master_addr="127.0.0.1",
        master_port=29500,
        curve_dir="/k",
        allow_insecure_tcp=False,
        join_timeout_s=5.0,
    )
    with pytest.raises(ValueError, match=message):
        NodeArgs(**{**args, **fields}).validate()


# ---- two nodes on one machine --------------------------------------------------------------------


def _free_port_block(count: int) -> int:
    """A base port with `count` free ports from it (master_port .. master_port + 2 + tp)."""
    for base in range(39000 + os.getpid() % 2000 * 8, 60000, 37):
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sock.bind(("127.0.0.1", port))
                sockets.append(sock)
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no free port block")


class Keys:
    def __init__(self, root: Path) -> None:
        self.head = root / "head-keys"
        load_or_create_server_keys(str(self.head))
        self.node = self._client(root, "node1")
        self.client = self._client(root, "client")
        self.stranger = root / "stranger"  # a key pair the head never authorized
        create_client_keys(str(root / "elsewhere"), "stranger", str(self.stranger))
        (self.stranger / "server.key").write_bytes((self.head / "server.key").read_bytes())

    def _client(self, root: Path, name: str) -> Path:
        directory = root / name
        create_client_keys(str(self.head), name, str(directory))
        (directory / "server.key").write_bytes((self.head / "server.key").read_bytes())
        return directory


class TwoNodes:
    """A head (`--tp 2 --nnodes 2 --node-rank 0`, or other `parallel` flags) and headless nodes, as
    real process trees."""

    def __init__(self, root: Path, model: str, *extra: str, parallel: tuple[str, ...] = ("--tp", "2")) -> None:
        self.root = root
        self.keys = Keys(root)
        self.port = _free_port_block(6)
        self.endpoint = f"ipc://{root}/client.sock"
        self.common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(self.port)]
        self.head_args = [
            "--model",
            model,
            *parallel,
            "--node-rank",
            "0",
            "--zmq-curve-dir",
            str(self.keys.head),
            "--zmq-endpoint",
            self.endpoint,
            "--port",
            "0",
            "--max-model-len",
            "512",
            "--kv-cache-memory",
            "64MiB",
            *extra,
        ]
        self.head = self.start_head("head")
        self.nodes: list[subprocess.Popen] = []

    def start_head(self, name: str) -> subprocess.Popen:
        return self._launch(name, *self.head_args, "--runtime-dir", str(self.root / f"{name}-rt"))

    def _launch(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "wb")
        return subprocess.Popen(
            [sys.executable, "-m", "zllm.launch.cli", *self.common, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=ONE_THREAD,
        )

    def start_node(self, name: str = "node", keys: Path | None = None, *extra: str) -> subprocess.Popen:
        node = self._launch(
            name, "--headless", "--node-rank", "1", "--zmq-curve-dir", str(keys or self.keys.node), *extra
        )
        self.nodes.append(node)
        return node

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def wait_ready(self, name: str = "head", timeout: float = 120.0) -> None:
        assert wait_until(lambda: "zllm ready" in self.log(name) or self.head.poll() is not None, timeout), self.log(
            name
        )[-3000:]
        assert self.head.poll() is None, self.log(name)[-3000:]

    def all_pids(self) -> list[int]:
        pids = []
        for process in [self.head, *self.nodes]:
            try:
                pids += [process.pid] + [c.pid for c in psutil.Process(process.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return pids

    def client(self) -> Client:
        return Client(
            self.endpoint,
            server_key=str(self.keys.head / "server.key"),
            client_key=str(self.keys.client / "client.key_secret"),
            timeout=60,
        )

    def stream_all(self, prompts: list[str], params: SamplingParams, kill=None) -> list[list[int]]:
        """Stream every prompt at once; with `kill`, call it (in a thread) once each stream has 10
        tokens. Returns each stream's tokens."""

        async def scenario():
            counts = [0] * len(prompts)
            async with AsyncClient(
                self.endpoint,
                server_key=str(self.keys.head / "server.key"),
                client_key=str(self.keys.client / "client.key_secret"),
                timeout=120,
            ) as client:

                async def consume(i: int) -> list[int]:
                    tokens = []
                    async for delta in client.stream(prompts[i], params):
                        tokens += delta.outputs[0].token_ids
                        counts[i] = len(tokens)
                    return tokens

                tasks = [asyncio.create_task(consume(i)) for i in range(len(prompts))]
                if kill is not None:
                    while min(counts) < 10:
                        await asyncio.sleep(0.01)
                    await asyncio.to_thread(kill)
                return await asyncio.gather(*tasks)

        return asyncio.run(scenario())

    def kill_all(self) -> None:
        for process in [self.head, *self.nodes]:
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny"), initializer_range=0.2))


def test_two_nodes_serve_tp2_as_one_node_serves_tp1_and_stop_from_the_head(tmp_path, smollm2_dir, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with LLM(smollm2_dir, max_model_len=512) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    group = TwoNodes(tmp_path, smollm2_dir)
    try:
        node = group.start_node()
        group.wait_ready()
        with group.client() as client:
            outputs = [client.generate(p, GREEDY) for p in PROMPTS]
        assert [o.outputs[0].token_ids for o in outputs] == reference
        assert "rank 1 of 2 joined the gloo group" in group.log("node")  # rank 1 ran on the headless node
        pids = group.all_pids()
        group.head.send_signal(signal.SIGTERM)
        assert group.head.wait(60) == 0 and node.wait(30) == 0
        assert wait_until(lambda: processes_gone(pids), 15)
        assert "the head stops this node" in group.log("node")
    finally:
        group.kill_all()


def test_stopping_the_headless_node_stops_the_service_cleanly(tmp_path, tiny_model):
    group = TwoNodes(tmp_path, tiny_model)
    try:
        node = group.start_node()
        group.wait_ready()
        with group.client() as client:
            assert len(client.generate("t5 t9 t11", GREEDY).outputs[0].token_ids) == 8
        pids = group.all_pids()
        node.send_signal(signal.SIGTERM)
        assert node.wait(60) == 0 and group.head.wait(60) == 0
        assert wait_until(lambda: processes_gone(pids), 15)
        assert "node 1 is stopping" in group.log("head") and "drained: shutting down" in group.log("head")
    finally:
        group.kill_all()


def test_wrong_keys_and_wrong_nnodes_are_refused_and_a_missing_node_fails_the_head(tmp_path, tiny_model):
    group = TwoNodes(tmp_path, tiny_model, "--node-join-timeout", "20")
    try:
        stranger = group.start_node("stranger", group.keys.stranger)
        assert stranger.wait(30) == 2
        assert "refused this client's CURVE key" in group.log("stranger"), group.log("stranger")
        group.common[1] = "3"  # this node says --nnodes 3
        wrong = group.start_node("wrong-nnodes")
        assert wrong.wait(30) == 2
        assert "this node says --nnodes 3, but the head runs 2 nodes" in group.log("wrong-nnodes")
        assert group.head.wait(60) == 1  # nobody else joins
        assert "node(s) [1] of 2 did not join within 20 s" in group.log("head"), group.log("head")[-2000:]
        assert "zllm ready" not in group.log("head")
    finally:
        group.kill_all()


def test_a_node_told_to_stop_while_joining_exits_at_once(tmp_path):
    """SIGTERM before any head answered: nothing runs yet, so the node exits 0 at once instead of
    waiting out --node-join-timeout (and then joining a head only to stop its service)."""
    keys = Keys(tmp_path)
    port = _free_port_block(2)
    log = open(tmp_path / "node.log", "wb")
    node = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zllm.launch.cli",
            "--headless",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--zmq-curve-dir",
            str(keys.node),
            "--node-join-timeout",
            "300",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=ONE_THREAD,
    )
    try:
        assert wait_until(lambda: "joining" in (tmp_path / "node.log").read_text(), 60), (
            tmp_path / "node.log"
        ).read_text()
        started = time.monotonic()
        node.send_signal(signal.SIGTERM)
        assert node.wait(30) == 0
        assert time.monotonic() - started < 10
        assert "stopped before joining" in (tmp_path / "node.log").read_text()
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


def test_a_lost_node_restarts_the_engine_once_it_is_back(tmp_path, tiny_model):
    """kill -9 of the headless node under load (its worker goes with it): an engine failure; the
    head restarts the engine when a node has joined again and every stream completes exactly."""
    group = TwoNodes(tmp_path, tiny_model, "--node-join-timeout", "60")
    prompts = [f"t{3 + i} t{40 + i} t{90 + i}" for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)

    def kill_the_node_then_start_another():
        group.nodes[0].kill()
        # Either side may report it first: the head's node channel ("engine failure: node 1"), or
        # the head's own worker, whose gloo all-reduce with the dead rank fails ("engine failure:
        # worker rank 0 ... exited"). Both are this one engine failure; the restart waits for a node.
        assert wait_until(lambda: "engine failure:" in group.log("head"), 30), group.log("head")[-2000:]
        group.start_node("node-again")

    try:
        group.start_node()
        group.wait_ready()
        reference = group.stream_all(prompts, params)
        results = group.stream_all(prompts, params, kill_the_node_then_start_another)
        assert results == reference
        log = group.log("head")
        assert "engine recovered in" in log and "8 request(s) replayed" in log, log[-3000:]
        assert log.count("node 1 joined (1 of 1)") == 2
    finally:
        group.kill_all()


# ---- data parallelism across nodes ---------------------------------------------------------------


def test_engines_spread_over_two_nodes_serve_exactly_and_restart_where_they_run(tmp_path, tiny_model, monkeypatch):
    """-dp 2 -dpl 1 --nnodes 2: engine 0 on the head, engine 1 (a whole engine core) on the
    headless node, talking to the head's frontend over tcp with CURVE. Concurrent streams equal
    one engine's answers and use both engines; kill -9 of the remote engine's core restarts it on
    its node and its streams complete exactly; stopping the head stops the node."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    prompts = [f"t{3 + i} t{40 + i} t{90 + i}" for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    with LLM(tiny_model, max_model_len=512) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    group = TwoNodes(tmp_path, tiny_model, parallel=("-dp", "2", "-dpl", "1"))

    def remote_core() -> psutil.Process:
        agent = psutil.Process(group.nodes[0].pid)
        return next(p for p in agent.children() if "zllm.enginecore.process" in " ".join(p.cmdline()))

    try:
        node = group.start_node()
        group.wait_ready()
        assert group.stream_all(prompts, params) == reference
        with group.client() as client:
            engines = client.stats()["engines"]
        assert [e["prefix_cache_queries"] > 0 for e in engines] == [True, True], engines
        assert "engines [1] here" in group.log("node")

        victim = remote_core()
        assert group.stream_all(prompts, params, victim.kill) == reference
        log = group.log("head")
        assert "engine 1 failure: node 1: engine core" in log and "engine 0 failure" not in log, log[-3000:]
        assert "engine 1 recovered in" in log
        assert remote_core().pid != victim.pid  # restarted on the node

        pids = group.all_pids()
        group.head.send_signal(signal.SIGTERM)
        assert group.head.wait(60) == 0 and node.wait(30) == 0
        assert wait_until(lambda: processes_gone(pids), 15)
    finally:
        group.kill_all()


def test_a_restarted_head_gets_its_node_back(tmp_path, tiny_model):
    """kill -9 of the head (its engine goes with it); a new head on the same ports: the node, which
    never stopped, is told it is unknown there, stops its workers, joins again and serves."""
    group = TwoNodes(tmp_path, tiny_model)
    try:
        node = group.start_node()
        group.wait_ready()
        with group.client() as client:
            before = client.generate("t5 t9 t11", GREEDY).outputs[0].token_ids
        head_tree = [group.head.pid] + [c.pid for c in psutil.Process(group.head.pid).children(recursive=True)]
        group.head.kill()
        group.head.wait()
        assert wait_until(lambda: processes_gone(head_tree), 15)
        group.head = group.start_head("head-again")
        group.wait_ready("head-again")
        with group.client() as client:
            assert client.generate("t5 t9 t11", GREEDY).outputs[0].token_ids == before
        assert node.poll() is None and "joining again" in group.log("node")
    finally:
        group.kill_all()


def test_a_remote_worker_that_dies_restarts_the_engine_with_its_node(tmp_path, tiny_model):
    """kill -9 of the headless node's worker (its agent lives on) under 8 streams: an engine
    failure; the node confirms its old workers are gone before the new core starts, and every
    stream completes exactly."""
    group = TwoNodes(tmp_path, tiny_model)
    prompts = [f"t{3 + i} t{40 + i} t{90 + i}" for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)

    def kill_the_remote_worker():
        psutil.Process(group.nodes[0].pid).children()[0].kill()

    try:
        group.start_node()
        group.wait_ready()
        reference = group.stream_all(prompts, params)
        assert group.stream_all(prompts, params, kill_the_remote_worker) == reference
        log = group.log("head")
        assert "engine failure: " in log and "8 request(s) replayed" in log, log[-3000:]
        assert "did not confirm" not in log and group.nodes[0].poll() is None
    finally:
        group.kill_all()
