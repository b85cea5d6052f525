"""The Ray backend (`--distributed-executor-backend ray`) on a two-node Ray cluster started on this
machine (ray.cluster_utils.Cluster: a head and a second raylet on loopback): tp 2 with one rank on
each node gives tp 1's greedy tokens on the real SmolLM2; `-dp 2` places each engine's ranks
together on one node; killing one rank's actor under 8 streams restarts the engine and every
stream completes exactly; SIGTERM of the launcher leaves no actor and no process behind."""

from __future__ import annotations

import asyncio
import re
import time

import psutil
import pytest
import zmq

from tests.helpers.models import save_tiny_llama
from tests.helpers.server import processes_gone, start_server, wait_until
from zllm import LLM, AsyncClient, SamplingParams
from zllm.config import EngineConfig

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [f"Story number {i}: once upon a time" for i in range(4)]
# Each node has 2 CPUs: a rank of 2 CPUs fits once per node (one engine spreads over both nodes,
# PACK); a rank of 1 CPU twice (a tp 2 engine fits one node, STRICT_PACK).
ONE_RANK_PER_NODE = '{"CPU": 2}'
TWO_RANKS_PER_NODE = '{"CPU": 1}'


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    started = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        started.add_node(num_cpus=2)
        started.wait_for_nodes(timeout=60)
        ray.init(address=started.address, namespace="zllm", log_to_driver=False)
        yield started
    finally:
        ray.shutdown()
        started.shutdown()  # every raylet, also after a failure


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny"), initializer_range=0.2, max_position_embeddings=4096))


def zllm_actors(state: str = "ALIVE") -> list[dict]:
    """Our rank actors in that state, as the GCS knows them (ray.util.state needs the dashboard,
    which the test cluster leaves out)."""
    from ray._private import state as gcs

    return [
        actor
        for actor in gcs.actors().values()
        if actor["State"] == state and (actor.get("Name") or "").startswith("zllm-engine")
    ]


def actor_nodes_by_engine() -> dict[str, set[str]]:
    """Engine tag (zllm-engine<dp>-<hex>) -> the Ray nodes of its ranks' actors."""
    engines: dict[str, set[str]] = {}
    for actor in zllm_actors():
        engines.setdefault(actor["Name"].rpartition("-")[0], set()).add(actor["Address"]["NodeID"])
    return engines


def test_the_flag_reaches_the_config_and_an_unknown_backend_is_refused():
    from zllm.launch.args import engine_kwargs, node_kwargs
    from zllm.launch.cli import build_parser

    args = build_parser().parse_args(["--distributed-executor-backend", "ray", "--ray-address", "auto"])
    kwargs = {**engine_kwargs(args), **node_kwargs(args)}
    assert (kwargs["distributed_executor_backend"], kwargs["ray_address"]) == ("ray", "auto")
    with pytest.raises(ValueError, match="distributed_executor_backend: must be one of"):
        EngineConfig(model="", max_model_len=16, distributed_executor_backend="slurm").validate()
    with pytest.raises(ValueError, match="ray_address: is for --distributed-executor-backend ray"):
        EngineConfig(model="", max_model_len=16, ray_address="auto").validate()


def test_without_ray_the_flag_says_how_to_install_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match=re.escape("pip install zllm[ray]")):
        EngineConfig(model="", max_model_len=16, distributed_executor_backend="ray").validate()


def test_a_group_is_packed_on_one_node_where_one_holds_it():
    from zllm.enginecore.ray_executor import pack_strategy

    nodes = [{"Alive": True, "Resources": {"GPU": 4.0}}, {"Alive": True, "Resources": {"GPU": 8.0}}]
    assert pack_strategy(nodes, {"GPU": 1.0}, 8) == "STRICT_PACK"
    assert pack_strategy(nodes, {"GPU": 1.0}, 16) == "PACK"  # 16 ranks: over both nodes
    nodes[1]["Alive"] = False  # a lost node holds nothing
    assert pack_strategy(nodes, {"GPU": 1.0}, 8) == "PACK"


def test_ranks_are_numbered_from_the_cores_machine_and_see_their_nodes_gpus():
    from zllm.enginecore.ray_executor import rank_order, visible_gpus

    places = [
        {"ip": "10.0.0.2", "node_id": "b", "gpu_ids": ["1"]},
        {"ip": "10.0.0.1", "node_id": "a", "gpu_ids": ["3"]},
        {"ip": "10.0.0.2", "node_id": "b", "gpu_ids": ["0"]},
        {"ip": "10.0.0.1", "node_id": "a", "gpu_ids": ["2"]},
    ]
    assert rank_order(places, core_ip="10.0.0.1") == [3, 1, 2, 0]
    assert [visible_gpus(places, i) for i in range(4)] == [("0,1", 1), ("2,3", 1), ("0,1", 0), ("2,3", 0)]
    assert visible_gpus([{"ip": "x", "node_id": "a", "gpu_ids": []}], 0) == (None, None)


def test_tp2_with_a_rank_on_each_node_equals_tp1(cluster, smollm2_dir, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with LLM(smollm2_dir, max_model_len=512) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    monkeypatch.setenv("ZLLM_RAY_RANK_RESOURCES", ONE_RANK_PER_NODE)
    # Both nodes are this machine: count every rank as another machine's, so that the steps take
    # the tcp + CURVE path that real clusters do (the engine core runs in this process).
    from zllm.enginecore import ray_executor

    monkeypatch.setattr(ray_executor, "crosses_machines", lambda place, core_ip: True)
    with LLM(smollm2_dir, max_model_len=512, tensor_parallel_size=2, distributed_executor_backend="ray") as llm:
        executor = llm.engine.core.executor.executor
        links = [socket.getsockopt_string(zmq.LAST_ENDPOINT) for socket in executor.inputs + executor.outputs]
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        placed = actor_nodes_by_engine()
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert [len(nodes) for nodes in placed.values()] == [2], placed  # one engine, its two ranks on two nodes
    assert [link.split(":")[0] for link in links] == ["tcp"] * 2 + ["ipc", "tcp"], links
    assert wait_until(lambda: not zllm_actors(), timeout=30), zllm_actors()  # shutdown killed them


def test_dp2_places_each_engines_ranks_together(cluster, tiny_model, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    prompts = [f"t{3 + i} t{40 + i} t{90 + i}" for i in range(6)]
    with LLM(tiny_model, max_model_len=256) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    monkeypatch.setenv("ZLLM_RAY_RANK_RESOURCES", TWO_RANKS_PER_NODE)
    with LLM(
        tiny_model,
        max_model_len=256,
        tensor_parallel_size=2,
        data_parallel_size=2,
        distributed_executor_backend="ray",
        ray_address=cluster.address,
    ) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        placed = actor_nodes_by_engine()
    assert [o.outputs[0].token_ids for o in outputs] == reference
    # Two engines (dp ranks 0 and 1), each with both ranks on one node: STRICT_PACK; a node holds
    # one engine's two ranks and no more, so the engines took a node each.
    assert sorted(tag.split("-")[1] for tag in placed) == ["engine0", "engine1"], placed
    assert [len(nodes) for nodes in placed.values()] == [1, 1], placed
    assert len(set.union(*placed.values())) == 2, placed
    assert wait_until(lambda: not zllm_actors(), timeout=30), zllm_actors()


# ---- served: an actor killed under 8 streams; SIGTERM ---------------------------------------------


async def _stream_all(endpoint: str, prompts: list[str], params: SamplingParams, on_progress=None):
    async with AsyncClient(endpoint, timeout=120) as client:

        async def consume(i: int):
            tokens, text = [], ""
            async for delta in client.stream(prompts[i], params):
                tokens += delta.outputs[0].token_ids
                text += delta.outputs[0].text
                if on_progress is not None:
                    on_progress(i, len(tokens))
            return tokens, text

        return await asyncio.gather(*[consume(i) for i in range(len(prompts))])


@pytest.fixture(scope="module")
def ray_server(cluster, tiny_model, tmp_path_factory):
    handle = start_server(
        tmp_path_factory.mktemp("ray-server"),
        tiny_model,
        "--tp",
        "2",
        "--distributed-executor-backend",
        "ray",
        "--ray-address",
        cluster.address,
        env={**ONE_THREAD, "ZLLM_RAY_RANK_RESOURCES": ONE_RANK_PER_NODE},
    )
    try:
        yield handle
    finally:
        handle.stop()


def test_a_killed_rank_actor_restarts_the_engine_and_every_stream_completes(ray_server):
    prompts = [f"t{3 + i} t{40 + i} t{90 + i}" for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    reference = asyncio.run(_stream_all(ray_server.endpoint, prompts, params))
    (victim,) = [a for a in zllm_actors() if a["Name"].endswith("-1")]
    counts = [0] * len(prompts)
    killed: list[float] = []

    def kill_once_all_are_streaming(i: int, count: int) -> None:
        counts[i] = count
        if not killed and min(counts) >= 20:
            killed.append(time.monotonic())
            ray.kill(ray.get_actor(victim["Name"], namespace="zllm"), no_restart=True)

    results = asyncio.run(_stream_all(ray_server.endpoint, prompts, params, kill_once_all_are_streaming))
    assert killed
    assert results == reference  # every stream, token for token
    log = ray_server.log()
    recovered = re.search(r"engine recovered in ([0-9.]+) s: (\d+) request\(s\) replayed", log)
    assert recovered and int(recovered.group(2)) > 0, log[-4000:]
    print(f"Ray backend: recovered in {recovered.group(1)} s, {recovered.group(2)} request(s) replayed")
    assert re.search(r"engine failure: .*rank \d \(Ray actor, pid \d+ on node \w+\) died", log), log[-4000:]
    assert processes_gone([victim["Pid"]])
    assert len(zllm_actors()) == 2  # the restarted engine's ranks


def test_sigterm_leaves_no_actor_and_no_process(ray_server):
    actors = zllm_actors()
    assert len(actors) == 2
    pids = [ray_server.process.pid] + [p.pid for p in ray_server.children()] + [a["Pid"] for a in actors]
    assert ray_server.stop() == 0
    assert wait_until(lambda: not zllm_actors(), timeout=30), zllm_actors()
    assert wait_until(lambda: processes_gone(pids), timeout=30), [p for p in pids if psutil.pid_exists(p)]
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if "ray::ModuleActor" in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, leftovers


def test_a_lost_node_restarts_the_engine_and_every_stream_completes(cluster, tiny_model, tmp_path):
    """The worker node holding one of the ranks is taken out of the cluster under 8 streams (its raylet and every
    process it started killed, as when a machine goes away): Ray fails the rank's call, the engine
    restarts on the node that joins in its place, and every stream completes exactly."""
    handle = start_server(
        tmp_path,
        tiny_model,
        "--tp",
        "2",
        "--distributed-executor-backend",
        "ray",
        "--ray-address",
        cluster.address,
        env={**ONE_THREAD, "ZLLM_RAY_RANK_RESOURCES": ONE_RANK_PER_NODE},
    )
    try:
        prompts = [f"t{5 + i} t{50 + i} t{95 + i}" for i in range(8)]
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        reference = asyncio.run(_stream_all(handle.endpoint, prompts, params))
        workers = {n.node_id: n for n in cluster.worker_nodes}  # not the head, where the core's Ray client is
        (victim,) = [a for a in zllm_actors() if a["Address"]["NodeID"] in workers]
        node = workers[victim["Address"]["NodeID"]]
        counts = [0] * len(prompts)
        lost: list[float] = []

        def lose_the_node_once_all_are_streaming(i: int, count: int) -> None:
            counts[i] = count
            if not lost and min(counts) >= 20:
                lost.append(time.monotonic())
                cluster.remove_node(node, allow_graceful=False)
                cluster.add_node(num_cpus=2)  # where the restarted engine's rank 1 can go

        results = asyncio.run(_stream_all(handle.endpoint, prompts, params, lose_the_node_once_all_are_streaming))
        assert lost
        assert results == reference  # every stream, token for token
        log = handle.log()
        assert re.search(r"engine recovered in [0-9.]+ s: [1-9]\d* request\(s\) replayed", log), log[-4000:]
        # Named by Ray (the actor died with its node: "rank r (Ray actor, ... on node <id>) died")
        # or, first, by the surviving rank's collective with it ("rank r: RuntimeError: ...").
        lost_node = node.node_id[:12]
        assert re.search(rf"engine failure: .*(on node {lost_node}\) died|rank \d: RuntimeError)", log), log[-4000:]
        assert len(zllm_actors()) == 2
    finally:
        handle.stop()
    assert wait_until(lambda: not zllm_actors(), timeout=30), zllm_actors()
