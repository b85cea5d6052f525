"""Workers as Ray actors (`--distributed-executor-backend ray`): Ray places and watches the tp
ranks; the steps go over the same ZeroMQ sockets and msgspec messages as MultiprocExecutor's.

    engine core (a Ray driver) ── placement group: one bundle per rank ──> Ray cluster
        │  PUSH per rank / one PULL                                       actor × tp (procs/ray_actor.py)
        └─────────── ipc on the core's machine, tcp + CURVE from others ──> worker loop (workers/process.py)

The core joins the cluster at `ray_address` (empty: Ray's own choice: RAY_ADDRESS, a cluster
started on this machine, else a new local one it stops at exit) and asks for a placement group of
tp bundles (ZLLM_RAY_RANK_RESOURCES, default one GPU, or one CPU on a cluster without GPUs):
STRICT_PACK (the whole group on one node) where a node can hold it, else PACK (as few nodes as
possible). Ranks are numbered with the core's own node first, so that rank 0 (which answers the
steps) is a neighbour where it can be; torch.distributed meets at rank 0's address.

Failures: a rank's `run` call ends only when its loop does, so a dead actor (killed, its process
gone, its node lost, as Ray sees it) is a finished call, checked whenever the core waits
(MultiprocExecutor._check_alive): an engine failure, handled by the frontend as any other
(restart, replay). Actors belong to the core: if the core dies, Ray ends them.
"""

from __future__ import annotations

import logging
import os
import secrets
import time

import zmq

from zllm import envs
from zllm.config import EngineConfig
from zllm.enginecore.executor import MultiprocExecutor, WorkerDiedError
from zllm.ipc.addresses import InternalEndpoints
from zllm.ipc.codec import encode_json
from zllm.ipc.curve import ServerKeys, start_thread_authenticator
from zllm.ipc.sockets import make_socket

logger = logging.getLogger(__name__)

RAY_NAMESPACE = "zllm"  # the namespace the core joins when it starts Ray's connection itself
ACTOR_PREFIX = "zllm-engine"  # actor names: zllm-engine<dp rank>-<8 hex>-<bundle>
# The environment a rank gets from its engine core (an actor starts in its raylet's environment).
FORWARDED_ENV_PREFIXES = ("ZLLM_", "OMP_NUM_THREADS", "NCCL_", "HF_", "TORCH_")
_WORKER_ENTRY = ("zllm.workers.process", "run_placed_rank")


def import_ray():
    try:
        import ray
    except ImportError as error:  # config.validate says the same; this is the last line of defence
        raise RuntimeError("--distributed-executor-backend ray needs ray: pip install zllm[ray]") from error
    return ray


def rank_resources(config: EngineConfig, cluster_resources: dict[str, float]) -> dict[str, float]:
    """One rank's bundle: ZLLM_RAY_RANK_RESOURCES, else a GPU (a CPU where the device is the CPU,
    or the cluster has no GPU)."""
    chosen = envs.ZLLM_RAY_RANK_RESOURCES
    if chosen:
        return dict(chosen)
    on_gpu = config.device == "cuda" or (config.device == "auto" and cluster_resources.get("GPU", 0) > 0)
    return {"GPU": 1.0} if on_gpu else {"CPU": 1.0}


def pack_strategy(nodes: list[dict], bundle: dict[str, float], count: int) -> str:
    """STRICT_PACK when one live node can hold all `count` bundles (its total resources: the group
    may wait for a restarted engine's old ranks to go), else PACK."""
    for node in nodes:
        if node.get("Alive") and all(node["Resources"].get(k, 0.0) >= v * count for k, v in bundle.items()):
            return "STRICT_PACK"
    return "PACK"


def rank_order(places: list[dict], core_ip: str) -> list[int]:
    """Bundle indices in rank order: the core's machine first, then by node, then by GPU."""

    def key(i: int):
        gpus = places[i]["gpu_ids"]
        return (places[i]["ip"] != core_ip, places[i]["node_id"], _gpu_key(gpus[0]) if gpus else (0, ""), i)

    return sorted(range(len(places)), key=key)


def visible_gpus(places: list[dict], i: int) -> tuple[str | None, int | None]:
    """CUDA_VISIBLE_DEVICES for bundle i (every GPU of this engine's ranks on its node) and its
    own GPU's index among them; (None, None) without GPUs."""
    own = places[i]["gpu_ids"]
    if not own:
        return None, None
    node = places[i]["node_id"]
    ids = sorted({g for p in places if p["node_id"] == node for g in p["gpu_ids"]}, key=_gpu_key)
    return ",".join(ids), ids.index(own[0])


def crosses_machines(place: dict, core_ip: str) -> bool:
    """Whether a rank's link to the core leaves the machine (tcp + CURVE) or not (ipc): Ray nodes
    started on one machine share its address."""
    return place["ip"] != core_ip


class _OneClientKey:
    """ZAP: only the key pair handed to this engine's ranks gets through the handshake."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, client_key: bytes) -> bool:
        return secrets.compare_digest(client_key, self.public)


class RayExecutor(MultiprocExecutor):
    def __init__(self, config: EngineConfig, context: zmq.Context) -> None:
        self.ray = import_ray()
        self._owns_ray = False
        self._group = None
        self._actors: list = []  # in rank order
        self._places: list[dict] = []
        self._runs: list = []  # each rank's `run` call: done only when its loop ended or its actor died
        self._curve_client: str | None = None
        try:
            self._join_cluster(config)
            self._place(config)
        except BaseException:
            self._release()
            raise
        try:
            super().__init__(config, context)
        except BaseException:
            self._release()  # e.g. a socket that would not bind: the actors must not outlive this start
            raise

    # ---- placement -----------------------------------------------------------------------------

    def _join_cluster(self, config: EngineConfig) -> None:
        ray = self.ray
        if ray.is_initialized():  # offline, in a program that joined a cluster itself
            return
        kwargs = {"namespace": RAY_NAMESPACE, "log_to_driver": True}
        if config.ray_address:
            ray.init(address=config.ray_address, **kwargs)
        else:
            ray.init(include_dashboard=False, **kwargs)
        self._owns_ray = True
        logger.info("joined the Ray cluster: %s", ray.cluster_resources())

    def _place(self, config: EngineConfig) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, tp = self.ray, config.tensor_parallel_size
        bundle = rank_resources(config, ray.cluster_resources())
        strategy = pack_strategy(ray.nodes(), bundle, tp)
        self._group = placement_group([dict(bundle) for _ in range(tp)], strategy=strategy)
        ready, _ = ray.wait([self._group.ready()], timeout=config.startup_timeout_s)
        if not ready:
            raise WorkerDiedError(
                f"the Ray cluster found no room for {tp} rank(s) of {bundle} ({strategy}) within "
                f"{config.startup_timeout_s:.0f} s; free now: {ray.available_resources()}"
            )
        actor_class = ray.remote(_actor_class())
        tag = f"{ACTOR_PREFIX}{config.data_parallel_rank}-{secrets.token_hex(4)}"
        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
        custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        actors = [
            actor_class.options(
                name=f"{tag}-{i}",
                num_cpus=bundle.get("CPU", 0.0),
                num_gpus=bundle.get("GPU", 0.0),
                resources=custom,
                max_restarts=0,  # a rank that dies is an engine failure: the frontend restarts the engine
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=i
                ),
            ).remote()
            for i in range(tp)
        ]
        self._actors = actors  # released on failure, even before they are ordered
        places = ray.get([actor.where.remote() for actor in actors], timeout=config.startup_timeout_s)
        order = rank_order(places, ray.util.get_node_ip_address())
        self._actors = [actors[i] for i in order]
        self._places = [places[i] for i in order]
        self._visible = [visible_gpus(places, i) for i in order]
        for rank, place in enumerate(self._places):
            logger.info(
                "rank %d: Ray node %s (%s), pid %s, GPUs %s (%s)",
                rank,
                place["node_id"][:12],
                place["ip"],
                place["pid"],
                place["gpu_ids"] or "none",
                strategy,
            )

    # ---- MultiprocExecutor's hooks ---------------------------------------------------------------

    def _bind_sockets(self, config: EngineConfig, context: zmq.Context) -> tuple[list[zmq.Socket], list[zmq.Socket]]:
        """ipc for ranks on the core's machine; tcp with CURVE (a key pair made for this engine
        start, handed to its ranks through Ray) for the others."""
        core_ip = self.ray.util.get_node_ip_address()
        endpoints = InternalEndpoints(config.runtime_dir)
        hwm, limit = config.socket_hwm, config.internal_max_message_bytes
        remote = [crosses_machines(place, core_ip) for place in self._places]
        sockets: list[zmq.Socket] = []
        try:
            outputs = [
                make_socket(context, zmq.PULL, endpoints.worker_output, bind=True, hwm=hwm, max_message_bytes=limit)
            ]
            sockets += outputs
            keys = None
            if any(remote):
                public, secret = zmq.curve_keypair()
                client_public, client_secret = zmq.curve_keypair()
                keys = ServerKeys(public=public, secret=secret, clients_dir="")
                self._curve_client = b",".join([public, client_public, client_secret]).decode()
                self._authenticator = start_thread_authenticator(context, _OneClientKey(client_public))
                outputs.append(
                    make_socket(
                        context,
                        zmq.PULL,
                        f"tcp://{_host(core_ip)}:*",
                        bind=True,
                        hwm=hwm,
                        max_message_bytes=limit,
                        curve_server_keys=keys,
                    )
                )
                sockets.append(outputs[-1])
            inputs = []
            for rank in range(config.tensor_parallel_size):
                endpoint = f"tcp://{_host(core_ip)}:*" if remote[rank] else endpoints.worker_input(rank)
                inputs.append(
                    make_socket(
                        context,
                        zmq.PUSH,
                        endpoint,
                        bind=True,
                        hwm=hwm,
                        curve_server_keys=keys if remote[rank] else None,
                    )
                )
                sockets.append(inputs[-1])
        except BaseException:
            for socket in sockets:
                socket.close(linger=0)
            if self._authenticator is not None:
                self._authenticator.stop()
                self._authenticator = None
            raise
        return inputs, outputs

    def _start_ranks(self) -> None:
        """Each actor runs the worker loop on the sockets bound for its rank."""
        ray, config = self.ray, self.config
        port = ray.get(self._actors[0].free_port.remote(), timeout=config.startup_timeout_s)
        init_method = f"tcp://{_host(self._places[0]['ip'])}:{port}"
        config_json = encode_json(config)
        output = self.outputs[-1].getsockopt_string(zmq.LAST_ENDPOINT)
        local_output = self.outputs[0].getsockopt_string(zmq.LAST_ENDPOINT)
        for rank, actor in enumerate(self._actors):
            worker_input = self.inputs[rank].getsockopt_string(zmq.LAST_ENDPOINT)
            remote = worker_input.startswith("tcp://")
            gpus, gpu_index = self._visible[rank]
            self._runs.append(
                actor.run.remote(
                    *_WORKER_ENTRY,
                    config_json,
                    rank,
                    worker_input,
                    output if remote else local_output,
                    self._curve_client if remote else None,
                    init_method,
                    gpus,
                    gpu_index,
                )
            )

    @property
    def worker_pids(self) -> list[int]:
        """None: Ray watches the ranks (their pids may be another machine's); the core reports a
        dead one as its own failure."""
        return []

    def _dead_ranks(self, except_rank: int | None = None) -> list[str]:
        if not self._runs:
            return []
        done, _ = self.ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        finished = set(done)
        return [
            self._describe_end(rank, ref)
            for rank, ref in enumerate(self._runs)
            if rank != except_rank and ref in finished
        ]

    def _describe_end(self, rank: int, ref) -> str:
        place = self._places[rank]
        where = f"rank {rank} (Ray actor, pid {place['pid']} on node {place['node_id'][:12]})"
        try:
            return f"{where} exited with code {self.ray.get(ref, timeout=0)}"
        except Exception as error:  # RayActorError: killed, its process died, or its node was lost
            return f"{where} died: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"

    def _stop_local(self, grace_s: float = 0.0) -> None:
        """Ranks told to shut down get grace_s to end their loop; then every actor is killed and
        the placement group removed (its resources free for the next start)."""
        if grace_s > 0 and self._runs:
            self.ray.wait(self._runs, num_returns=len(self._runs), timeout=grace_s)
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        self._release()

    def _release(self) -> None:
        ray = self.ray
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        deadline = time.monotonic() + 5.0
        if self._runs:  # a killed actor's call fails once its process is gone
            ray.wait(self._runs, num_returns=len(self._runs), timeout=max(0.0, deadline - time.monotonic()))
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._group)
            except Exception:
                logger.warning("could not remove the placement group", exc_info=True)
        self._actors, self._runs, self._group = [], [], None
        if self._owns_ray:
            self._owns_ray = False
            ray.shutdown()


def _actor_class() -> type:
    # The actor's code is shared (zllm/procs): the worker loop is named by module (_WORKER_ENTRY),
    # as spawn_child names the worker process's.
    from zllm.procs.ray_actor import ModuleActor

    return ModuleActor


def _gpu_key(gpu_id: str) -> tuple[int, str]:
    """Numeric order for indices ("2" < "10"), a stable one for GPU UUIDs."""
    return (len(gpu_id), gpu_id)


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip
