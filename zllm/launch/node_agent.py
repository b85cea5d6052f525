"""`vllm-launch --headless`: a node that runs tp ranks (or whole engines) for the head, and nothing else.

    vllm-launch --headless --nnodes 2 --node-rank 1 --master-addr HEAD --master-port P --zmq-curve-dir DIR

The node agent joins the head's node channel (tcp://HEAD:P+1, CURVE with the keys in DIR: the
head's server.key and this node's own key pair), takes the head's EngineConfig, and from then
on runs this node's ranks (tp / nnodes of them, GPUs 0, 1, ...) for every start of the head's
engine (StartWorkers), killing them when the engine goes (StopWorkers). It reports a worker
that exits (WorkersExited). With data parallelism across nodes it runs whole engine cores
instead (StartEngine / StopEngine, answered with EngineExited), whose sockets reach the head's
frontend over tcp. It exits itself when the head says so (NodeShutdown: 0), when the
head refuses it (a wrong --nnodes or --node-rank, or a key the head does not know: 2), or when
the head falls silent for engine_hang_timeout_s (1). SIGTERM/SIGINT asks the head to stop the
whole service (NodeLeaving); the node's workers serve until the head's drain ends them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from zllm.config import EngineConfig
from zllm.ipc.addresses import NodeEndpoints, make_private_runtime_dir
from zllm.ipc.codec import Codec, MessageError, decode_json
from zllm.ipc.curve import HANDSHAKE_FAILURE_EVENTS, describe_handshake_failure, load_node_keys
from zllm.ipc.messages import (
    EngineExited,
    HeadToNode,
    NodeAccepted,
    NodeHeartbeat,
    NodeJoin,
    NodeLeaving,
    NodeRefused,
    NodeShutdown,
    NodeToHead,
    NodeUnknown,
    StartEngine,
    StartWorkers,
    StopEngine,
    StopWorkers,
    WorkersExited,
)
from zllm.ipc.sockets import make_socket
from zllm.procs.children import spawn_child
from zllm.procs.engine_processes import EngineProcesses
from zllm.procs.exits import stop_children, wait_for_any_exit
from zllm.procs.racing import cancel_and_wait, first_result, race

logger = logging.getLogger("zllm.node")

_HEARTBEAT_S = 1.0  # before the head's config (and its heartbeat interval) arrives
_REJOIN = -1  # what serving returns when the head asks this node to join again


class NodeRefusedError(RuntimeError):
    """The head will not have this node: exit 2 with the reason."""


class HeadLostError(RuntimeError):
    """The head never answered, or fell silent: exit 1."""


@dataclasses.dataclass(slots=True)
class NodeArgs:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    curve_dir: str
    allow_insecure_tcp: bool
    join_timeout_s: float

    def validate(self) -> None:
        if self.nnodes < 2:
            raise ValueError(f"nnodes: a headless node belongs to a group of >= 2 nodes, got {self.nnodes}")
        if not 1 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank: a headless node is 1 .. {self.nnodes - 1} (0 is the head), got {self.node_rank}"
            )
        if not self.master_addr:
            raise ValueError("master_addr: the head node's address is required")
        if not self.curve_dir and not self.allow_insecure_tcp:
            raise ValueError(
                "zmq_curve_dir: the head's server.key and this node's key pair are required "
                "(or --allow-insecure-tcp, on a trusted network only)"
            )


class NodeAgent:
    def __init__(self, args: NodeArgs) -> None:
        self.args = args
        self.keys = load_node_keys(args.curve_dir) if args.curve_dir else None
        self.context = zmq.asyncio.Context()
        self.head = NodeEndpoints(args.master_addr, args.master_port)
        self.to_head = Codec(NodeToHead)
        self.from_head = Codec(HeadToNode)
        self.config: EngineConfig | None = None
        self.runtime_dir = make_private_runtime_dir()
        self.workers: dict[int, subprocess.Popen] = {}
        self.generation = 0
        self.engines: dict[
            int, tuple[int, EngineProcesses, asyncio.Task]
        ] = {}  # dp rank -> (generation, core, watcher)
        self.last_heard = time.monotonic()
        self.leaving = asyncio.Event()

    async def run(self) -> int:
        self.socket = make_socket(
            self.context, zmq.DEALER, self.head.node_channel, bind=False, hwm=1000, curve_client_keys=self.keys
        )
        self.monitor = self.socket.get_monitor_socket(HANDSHAKE_FAILURE_EVENTS)
        try:
            while True:
                if not await self._join():
                    logger.info("node %d: stopped before joining", self.args.node_rank)
                    return 0
                code = await self._serve()
                if code != _REJOIN:
                    return code
                await self._stop_everything()
                logger.warning(
                    "the head no longer counts this node as a member (it restarted, or lost this node): joining again"
                )
        finally:
            await self._stop_everything()
            self.socket.disable_monitor()
            self.context.destroy(linger=200)
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    # ---- joining -------------------------------------------------------------------------------

    async def _join(self) -> bool:
        """True once the head accepted this node; False if this node was told to stop first."""
        await self._send(NodeJoin(node_rank=self.args.node_rank, nnodes=self.args.nnodes))
        logger.info(
            "node %d of %d: joining %s%s",
            self.args.node_rank,
            self.args.nnodes,
            self.head.node_channel,
            " (CURVE)" if self.keys else "",
        )
        deadline = time.monotonic() + self.args.join_timeout_s
        poller = zmq.asyncio.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while time.monotonic() < deadline:
            if self.leaving.is_set():  # SIGTERM while joining: nothing runs yet, so there is nothing to drain
                return False
            for socket, _ in await poller.poll(int(_HEARTBEAT_S * 1000)):
                if socket is self.monitor:
                    self._check_handshake(await self.monitor.recv_multipart())
                    continue
                message = await self._receive()
                if isinstance(message, NodeRefused):
                    raise NodeRefusedError(f"the head refused this node: {message.reason}")
                if isinstance(message, NodeAccepted):
                    self._take_config(message)
                    return True
        raise HeadLostError(
            f"no answer from the head at {self.head.node_channel} within {self.args.join_timeout_s:.0f} s"
        )

    def _check_handshake(self, frames: list[bytes]) -> None:
        reason = describe_handshake_failure(parse_monitor_message(frames)["event"])
        if reason is not None:
            raise NodeRefusedError(f"the head at {self.head.node_channel} refused the connection: {reason}")

    def _take_config(self, accepted: NodeAccepted) -> None:
        head = decode_json(accepted.config_json, EngineConfig)
        self.config = dataclasses.replace(
            head,
            node_rank=self.args.node_rank,
            headless=True,
            curve_dir=self.args.curve_dir,
            runtime_dir=self.runtime_dir,
        )
        self.last_heard = time.monotonic()
        if self.config.dp_spans_nodes:
            local = self.config.local_engines
            here = f"engines {list(range(self.args.node_rank * local, (self.args.node_rank + 1) * local))}"
        else:
            here = f"tp ranks {list(self.config.local_ranks())}"
        logger.info("joined: %s, %s here", self.config.model_name, here)

    # ---- serving -------------------------------------------------------------------------------

    async def _serve(self) -> int:
        tasks = {
            asyncio.create_task(self._receive_loop(), name="from-head"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._leave_when_asked(), name="leave"),
        }
        return await first_result(tasks)

    async def _receive_loop(self) -> int:
        watcher: asyncio.Task | None = None
        try:
            while True:
                message = await self._receive()
                self.last_heard = time.monotonic()
                if isinstance(message, StartWorkers):
                    if watcher is not None:
                        watcher.cancel()
                    await self._start_workers(message.generation)
                    watcher = asyncio.create_task(self._watch_workers(message.generation), name="workers")
                elif isinstance(message, StopWorkers):
                    if watcher is not None:
                        watcher.cancel()  # their exit now is no failure to report
                    await self._stop_workers()
                    await self._send(WorkersExited(message.generation, "stopped"))  # the head waits for this
                elif isinstance(message, StartEngine):
                    await self._start_engine(message.dp_rank, message.generation)
                elif isinstance(message, StopEngine):
                    await self._stop_engine(message.dp_rank)
                    await self._send(EngineExited(message.dp_rank, message.generation, "stopped"))
                elif isinstance(message, NodeShutdown):
                    logger.info("the head stops this node (%s): exiting", message.reason)
                    return 0
                elif isinstance(message, NodeUnknown):
                    return _REJOIN
        finally:
            if watcher is not None:
                watcher.cancel()

    async def _heartbeat_loop(self) -> int:
        interval = self.config.heartbeat_interval_s
        while True:
            await self._send(NodeHeartbeat())
            await asyncio.sleep(interval)
            silent = time.monotonic() - self.last_heard
            if silent > self.config.engine_hang_timeout_s:
                raise HeadLostError(f"the head has been silent for {silent:.0f} s")

    async def _leave_when_asked(self) -> int:
        """On the first SIGTERM/SIGINT ask the head to stop the service; its drain ends this node."""
        await self.leaving.wait()
        await self._send(NodeLeaving(reason="the node was asked to stop"))
        logger.info("asked the head to stop the service; serving until it does")
        await asyncio.Event().wait()  # until NodeShutdown (another task) or a second signal

    async def _start_workers(self, generation: int) -> None:
        await self._stop_workers()
        self.generation = generation
        self.workers = {
            r: spawn_child("zllm.workers.process", self.config, "--rank", str(r)) for r in self.config.local_ranks()
        }
        logger.info(
            "engine %d: started ranks %s (pids %s)",
            generation,
            list(self.workers),
            [p.pid for p in self.workers.values()],
        )

    async def _watch_workers(self, generation: int) -> None:
        pids = {p.pid: rank for rank, p in self.workers.items()}
        pid = await wait_for_any_exit(list(pids))
        code = self.workers[pids[pid]].poll()
        if code == 0:  # told to shut down by its engine core: the head stops this node next
            logger.info("engine %d: rank %d shut down", generation, pids[pid])
            return
        reason = f"rank {pids[pid]} (pid {pid}) exited with code {code}"
        logger.error("engine %d: %s", generation, reason)
        await self._send(WorkersExited(generation=generation, reason=reason))

    async def _start_engine(self, dp_rank: int, generation: int) -> None:
        await self._stop_engine(dp_rank)
        runtime_dir = os.path.join(self.runtime_dir, f"engine-{dp_rank}-{generation}")
        os.makedirs(runtime_dir, mode=0o700)
        core = EngineProcesses()
        core.spawn_core(dataclasses.replace(self.config, data_parallel_rank=dp_rank, runtime_dir=runtime_dir))
        watcher = asyncio.create_task(self._watch_engine(dp_rank, generation, core), name=f"engine-{dp_rank}")
        self.engines[dp_rank] = (generation, core, watcher)
        logger.info("engine %d (start %d): core pid %d", dp_rank, generation, core.core.pid)

    async def _watch_engine(self, dp_rank: int, generation: int, core: EngineProcesses) -> None:
        reason = await core.wait_for_exit()
        code = core.core_exit_code()
        (logger.info if code == 0 else logger.error)("engine %d: %s", dp_rank, reason)
        await self._send(EngineExited(dp_rank, generation, reason))

    async def _stop_engine(self, dp_rank: int) -> None:
        """Kill engine `dp_rank`'s core and workers, if it runs here; return once all are gone."""
        if dp_rank in self.engines:
            _, core, watcher = self.engines.pop(dp_rank)
            watcher.cancel()
            await core.kill()

    async def _stop_everything(self) -> None:
        await self._stop_workers()
        for dp_rank in list(self.engines):
            await self._stop_engine(dp_rank)

    async def _stop_workers(self) -> None:
        if self.workers:
            workers, self.workers = list(self.workers.values()), {}
            await asyncio.to_thread(stop_children, workers, 5.0)

    async def _send(self, message) -> None:
        await self.socket.send(self.to_head.encode(message))

    async def _receive(self):
        while True:
            try:
                return self.from_head.decode(await self.socket.recv())
            except MessageError as error:
                logger.warning("dropped a malformed message from the head: %s", error)


async def _run_until_signal(agent: NodeAgent) -> int:
    loop = asyncio.get_running_loop()
    second = asyncio.Event()

    def received(signum: int) -> None:
        (second if agent.leaving.is_set() else agent.leaving).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, received, sig)
    running = asyncio.create_task(agent.run())
    if running in await race(running, second, keep=(running,)):
        return running.result()
    logger.warning("second signal: stopping the workers and exiting now")
    await cancel_and_wait(running)  # its clean-up stops the workers and engines
    return 130


def run_node_agent(args: argparse.Namespace) -> int:
    node = NodeArgs(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        curve_dir=args.zmq_curve_dir,
        allow_insecure_tcp=args.allow_insecure_tcp,
        join_timeout_s=args.node_join_timeout,
    )
    node.validate()
    try:
        return asyncio.run(_run_until_signal(NodeAgent(node)))
    except NodeRefusedError as error:
        logger.error("%s", error)
        return 2
    except HeadLostError as error:
        logger.error("%s", error)
        return 1
