"""The head's side of multi-node tensor parallelism: the nodes that run the other tp ranks.

    head:  vllm-launch --tp 4 --nnodes 2 --node-rank 0 --master-addr H --master-port P
             frontend ── NodeHub (ROUTER, tcp://H:P+1, CURVE) <── DEALER ── node 1's agent
             engine core ── workers 0, 1 (ipc)   <── tcp P+2, P+3+r ──  workers 2, 3 (node 1)
    node:  vllm-launch --headless --nnodes 2 --node-rank 1 --master-addr H --master-port P

A node joins with NodeJoin; the hub checks it (its --nnodes and --node-rank against the head's,
one agent per node) and answers with the head's EngineConfig, or NodeRefused and the reason.
Each start of the engine tells every node to start its ranks for that generation
(StartWorkers), each failure or stop to kill them (StopWorkers, confirmed with WorkersExited
"stopped" before the next core binds the same ports). With data parallelism across
nodes (--data-parallel-size-local) a node runs whole engines instead: StartEngine(d) /
StopEngine(d) for the engines it holds, answered by EngineExited; those engines' cores talk to
the frontend over tcp (their EngineLinks bind on this hub's context, whose ZAP handler checks
the nodes' keys). Both sides send a heartbeat
every heartbeat_interval_s; a node silent for engine_hang_timeout_s, or one whose worker
exited, is an engine failure (the supervisor restarts the engine once every node has joined
again, within node_join_timeout_s, or gives up). A node asked to stop (NodeLeaving) stops the
whole service as SIGTERM does: drain, then shut down, which ends every node (NodeShutdown).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from zllm.config import EngineConfig
from zllm.ipc.addresses import NodeEndpoints
from zllm.ipc.codec import Codec, MessageError, encode_json
from zllm.ipc.curve import ClientKeyCheck, load_or_create_server_keys, start_authenticator
from zllm.ipc.messages import (
    EngineExited,
    HeadHeartbeat,
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

logger = logging.getLogger("zllm.frontend.nodes")


class NodeFailureError(RuntimeError):
    pass


@dataclass(slots=True)
class _Node:
    identity: bytes
    last_seen: float


class NodeHub:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # A context of its own: ZeroMQ allows one authentication handler per context, and the
        # client endpoint's may use other keys.
        self.context = zmq.asyncio.Context()
        self.nodes: dict[int, _Node] = {}  # node rank -> its agent, once joined
        self.server_keys = None  # the CURVE keys the node channel and remote engines bind with
        self._to_node = Codec(HeadToNode)
        self._from_node = Codec(NodeToHead)
        # Per engine (dp rank): the generation the nodes should run, its failures, its exit.
        self._generations: dict[int, int] = {}
        self._failures: dict[int, asyncio.Queue[str]] = {}
        self._exited: dict[int, asyncio.Event] = {}
        self._stopping: set[int] = set()  # nodes yet to confirm StopWorkers (multi-node tp)
        self._stopped = asyncio.Event()
        self._stopping_generation = -1  # the generation the last StopWorkers named
        self._joined = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._socket: zmq.asyncio.Socket | None = None

    @property
    def expected(self) -> set[int]:
        return set(range(1, self.config.nnodes))

    def open(self) -> None:
        """Listen for nodes on master_port + 1 (CURVE unless allow_insecure_tcp)."""
        endpoint = NodeEndpoints(self.config.master_addr, self.config.master_port).node_channel
        keys = None
        if self.config.curve_dir:
            keys = self.server_keys = load_or_create_server_keys(self.config.curve_dir)
            self._authenticator = start_authenticator(self.context, ClientKeyCheck(keys.clients_dir, False))
        self._socket = make_socket(
            self.context,
            zmq.ROUTER,
            endpoint,
            bind=True,
            hwm=self.config.socket_hwm,
            router_mandatory=True,
            curve_server_keys=keys,
            max_message_bytes=1 << 20,
        )
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="nodes-in"),
            asyncio.create_task(self._heartbeat_loop(), name="nodes-heartbeat"),
        ]
        logger.info("waiting for %d node(s) on %s%s", len(self.expected), endpoint, " (CURVE)" if keys else "")

    async def wait_joined(self) -> None:
        """Return once every node has joined; CoreStartError-worthy NodeFailureError after
        node_join_timeout_s."""
        deadline = time.monotonic() + self.config.node_join_timeout_s
        while set(self.nodes) != self.expected:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(self.expected - set(self.nodes))
                raise NodeFailureError(
                    f"node(s) {missing} of {self.config.nnodes} did not join within {self.config.node_join_timeout_s:.0f} s: "
                    f"start `vllm-launch --headless --nnodes {self.config.nnodes} --node-rank N --master-addr "
                    f"{self.config.master_addr} --master-port {self.config.master_port}` there (and check its keys)"
                )
            self._joined.clear()
            try:
                await asyncio.wait_for(self._joined.wait(), min(left, self.config.heartbeat_interval_s))
            except asyncio.TimeoutError:
                pass

    async def start(self, dp_rank: int, generation: int) -> None:
        """Have the nodes run engine `dp_rank`'s part: their tp ranks, or the whole engine."""
        self._generations[dp_rank] = generation
        self._failures[dp_rank] = asyncio.Queue()  # an earlier generation's are moot
        self._exited[dp_rank] = asyncio.Event()
        if self.config.tp_spans_nodes:
            await self._broadcast(StartWorkers(generation=generation))
        elif not await self._send_to_node(self.config.node_of_engine(dp_rank), StartEngine(dp_rank, generation)):
            self._fail(dp_rank, f"node {self.config.node_of_engine(dp_rank)} has not joined")

    async def stop(self, dp_rank: int) -> None:
        """Kill what the nodes run of engine `dp_rank`; for a whole engine, until its node says it
        is gone (or is lost itself, or engine_hang_timeout_s passes)."""
        generation = self._generations.get(dp_rank, 0)
        if self.config.tp_spans_nodes:
            # Until every node has its workers gone: the next core binds the same ports, and an
            # old worker must not connect to it.
            self._stopping, self._stopped = set(self.nodes), asyncio.Event()
            self._stopping_generation = generation
            await self._broadcast(StopWorkers(generation=generation))
            if self._stopping:
                try:
                    await asyncio.wait_for(self._stopped.wait(), self.config.engine_hang_timeout_s)
                except asyncio.TimeoutError:
                    logger.error("node(s) %s did not confirm that their workers stopped", sorted(self._stopping))
            return
        exited = self._exited.setdefault(dp_rank, asyncio.Event())
        if not exited.is_set() and await self._send_to_node(
            self.config.node_of_engine(dp_rank), StopEngine(dp_rank, generation)
        ):
            await self.wait_exited(dp_rank, self.config.engine_hang_timeout_s)

    async def wait_exited(self, dp_rank: int, timeout_s: float) -> bool:
        """Wait until a remote engine's node reports its core gone (or the node is lost)."""
        try:
            await asyncio.wait_for(self._exited.setdefault(dp_rank, asyncio.Event()).wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def wait_for_failure(self, dp_rank: int = 0) -> str:
        """The first node failure of engine `dp_rank`'s current generation, in words."""
        return await self._failures.setdefault(dp_rank, asyncio.Queue()).get()

    def pending_failure(self, dp_rank: int = 0) -> str | None:
        """A failure reported while the engine was starting (it ends that start)."""
        failures = self._failures.setdefault(dp_rank, asyncio.Queue())
        return None if failures.empty() else failures.get_nowait()

    def _stop_confirmed(self, node_rank: int) -> None:
        """A node's workers are gone (it said so, or the node itself is)."""
        self._stopping.discard(node_rank)
        if not self._stopping:
            self._stopped.set()

    def _engines_on(self, node_rank: int) -> list[int]:
        if self.config.tp_spans_nodes:
            return [0]
        local = self.config.local_engines
        return list(range(node_rank * local, (node_rank + 1) * local))

    def _fail(self, dp_rank: int, reason: str) -> None:
        self._failures.setdefault(dp_rank, asyncio.Queue()).put_nowait(reason)

    async def close(self, reason: str) -> None:
        await self._broadcast(NodeShutdown(reason=reason))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if getattr(self, "_authenticator", None) is not None:
            self._authenticator.stop()
        self.context.destroy(linger=500)  # NodeShutdown is worth a moment to leave

    # ---- the node channel ----------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            if len(frames) != 2:
                continue
            identity, body = frames
            try:
                message = self._from_node.decode(body)
            except MessageError as error:
                logger.warning("dropped a malformed message from a node: %s", error)
                continue
            try:
                await self._handle(identity, message)
            except Exception:  # one bad exchange must not stop every node's channel
                logger.exception("failed to handle %s from a node", type(message).__name__)

    async def _handle(self, identity: bytes, message) -> None:
        node_rank = next((rank for rank, node in self.nodes.items() if node.identity == identity), None)
        if isinstance(message, NodeJoin):
            await self._join(identity, message)
        elif node_rank is None:
            if isinstance(message, NodeHeartbeat):  # a node of an earlier head process, or one dropped as lost
                await self._send(identity, NodeUnknown())
        elif isinstance(message, NodeHeartbeat):
            self.nodes[node_rank].last_seen = time.monotonic()
        elif isinstance(message, WorkersExited):
            if message.reason == "stopped":
                if message.generation == self._stopping_generation:  # not a late answer to an earlier stop
                    self._stop_confirmed(node_rank)
            elif message.generation == self._generations.get(0):
                self._fail(0, f"node {node_rank}: {message.reason}")
        elif isinstance(message, EngineExited):
            if message.generation == self._generations.get(message.dp_rank):
                self._exited.setdefault(message.dp_rank, asyncio.Event()).set()
                if message.reason != "stopped":
                    self._fail(message.dp_rank, f"node {node_rank}: {message.reason}")
        elif isinstance(message, NodeLeaving):
            logger.warning("node %d is stopping (%s): stopping the service", node_rank, message.reason)
            os.kill(os.getpid(), signal.SIGTERM)  # the service's own drain and shutdown

    async def _join(self, identity: bytes, join: NodeJoin) -> None:
        present = self.nodes.get(join.node_rank)
        if present is not None and present.identity != identity:
            await self._send(present.identity, HeadHeartbeat())  # a probe: is the agent it replaces gone?
        refusal = self._refusal(identity, join)
        if refusal is not None:
            logger.error("refused node %d: %s", join.node_rank, refusal)
            await self._send(identity, NodeRefused(reason=refusal))
            return
        self.nodes[join.node_rank] = _Node(identity, time.monotonic())
        await self._send(identity, NodeAccepted(config_json=encode_json(self.config)))
        logger.info("node %d joined (%d of %d)", join.node_rank, len(self.nodes), len(self.expected))
        self._joined.set()

    def _refusal(self, identity: bytes, join: NodeJoin) -> str | None:
        if join.nnodes != self.config.nnodes:
            return f"this node says --nnodes {join.nnodes}, but the head runs {self.config.nnodes} nodes"
        if join.node_rank not in self.expected:
            return f"--node-rank {join.node_rank} is not one of the head's headless nodes {sorted(self.expected)}"
        present = self.nodes.get(join.node_rank)
        if present is not None and present.identity != identity and self._fresh(present):
            return f"node {join.node_rank} has already joined from another process"
        return None

    def _fresh(self, node: _Node) -> bool:
        return time.monotonic() - node.last_seen < self.config.engine_hang_timeout_s

    async def _heartbeat_loop(self) -> None:
        """Send heartbeats; a node silent for engine_hang_timeout_s is lost."""
        while True:
            await self._broadcast(HeadHeartbeat())
            for node in list(self.nodes.values()):
                if not self._fresh(node):
                    self._lose(node.identity, f"silent for over {self.config.engine_hang_timeout_s:.0f} s")
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def _broadcast(self, message) -> None:
        for node in list(self.nodes.values()):
            await self._send(node.identity, message)

    async def _send(self, identity: bytes, message) -> None:
        try:
            await self._socket.send_multipart([identity, self._to_node.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as error:
            if error.errno == errno.EHOSTUNREACH:  # its connection closed: the agent is gone
                self._lose(identity, "disconnected")
            # else (EAGAIN) it is not reading: the heartbeat check finds it silent

    def _lose(self, identity: bytes, why: str) -> None:
        for rank, node in list(self.nodes.items()):
            if node.identity == identity:
                del self.nodes[rank]
                logger.error("node %d %s", rank, why)
                self._stop_confirmed(rank)
                for dp_rank in self._engines_on(rank):
                    self._exited.setdefault(dp_rank, asyncio.Event()).set()
                    self._fail(dp_rank, f"node {rank} {why}")

    async def _send_to_node(self, node_rank: int, message) -> bool:
        """False if that node is not (or no longer) joined."""
        node = self.nodes.get(node_rank)
        if node is not None:
            await self._send(node.identity, message)
        return node is not None and node_rank in self.nodes
