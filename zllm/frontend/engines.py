"""One engine core (and its workers) as the frontend drives it; a data-parallel frontend holds one
per dp rank.

    FrontendServer ──> EngineLink(dp 0): processes, sockets, send queue, replay log, restart policy
                   └─> EngineLink(dp 1): ...                          (each supervised on its own)

An `EngineLink` starts its engine core in a fresh runtime subdirectory (fresh sockets every
start), queues messages for it (one sender task is the only writer of its input socket, so a
client never blocks on a dead engine), hands every message the core sends to the server's
handler, pings it every heartbeat, and reports the first failure: a process exits, the core
says EngineDead, or it falls silent past engine_hang_timeout_s. What to do about a failure
(restart and replay, or give up) is the server's decision: it owns the requests.

Across nodes (zllm/frontend/nodes.py) an engine's tp ranks on other nodes are started and
stopped with its core, and a node failure is one of its failures; a *remote* engine (data
parallelism across nodes) has its core on another node: its sockets are tcp on the head, and its
node starts, watches and stops the core.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import itertools
import logging
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from zllm.config import EngineConfig
from zllm.frontend.engine_start import CoreStartError, start_local_core, wait_until_ready
from zllm.frontend.nodes import NodeFailureError, NodeHub
from zllm.frontend.replay import ReplayLog
from zllm.frontend.restart_policy import RestartPolicy
from zllm.ipc.addresses import NodeEndpoints, engine_runtime_dir
from zllm.ipc.codec import Codec, MessageError
from zllm.ipc.messages import CoreToFrontend, EngineDead, EngineReady, FrontendToCore, Shutdown, UtilityCall
from zllm.ipc.sockets import make_socket
from zllm.procs.engine_processes import EngineProcesses
from zllm.procs.exits import stop_children
from zllm.procs.racing import first_result

logger = logging.getLogger("zllm.frontend")

# A request in flight through this many failures of its engine is failed alone rather than
# replayed again: it may be what crashes the engine.
MAX_REPLAYS = 2


MessageHandler = Callable[["EngineLink", object], Awaitable[None]]


class EngineLink:
    """Everything the frontend keeps of one engine (dp rank), across its restarts."""

    def __init__(
        self,
        config: EngineConfig,
        dp_rank: int,
        context: zmq.asyncio.Context,
        call_ids: itertools.count,
        nodes: NodeHub | None = None,
    ) -> None:
        self.config = dataclasses.replace(config, data_parallel_rank=dp_rank)
        self.dp_rank = dp_rank
        self.context = context
        self.nodes = nodes  # the other nodes' workers (multi-node tp), started with each core
        # Data parallelism across nodes: this engine's core runs on another node, started there by
        # its agent, and reaches this frontend over tcp (CURVE: the hub's context checks the keys).
        self.remote = nodes is not None and self.config.node_of_engine(dp_rank) != 0
        if self.remote:
            self.context = nodes.context
        self.processes = EngineProcesses()
        self.restart_policy = RestartPolicy(config.max_restarts, config.restart_window_s)
        self.replay = ReplayLog(MAX_REPLAYS)  # the requests this engine serves, until they end
        self.ready: EngineReady | None = None
        self.recovering = False  # being restarted: its new requests are held meanwhile
        self.held_while_recovering = 0
        self.num_restarts = 0
        self.last_message = 0.0
        self._call_ids = call_ids  # shared with the server: utility call ids are unique across engines
        self._generation = 0
        self._to_core = Codec(FrontendToCore)
        self._from_core = Codec(CoreToFrontend)
        self._queue: asyncio.Queue = asyncio.Queue(config.socket_hwm)
        self._core_in: zmq.asyncio.Socket | None = None
        self._core_out: zmq.asyncio.Socket | None = None

    @property
    def name(self) -> str:
        """How logs name it: "engine", or "engine 1" behind a data-parallel frontend."""
        return "engine" if self.config.data_parallel_size == 1 else f"engine {self.dp_rank}"

    @property
    def runtime_dir(self) -> str:
        return engine_runtime_dir(self.config.runtime_dir, self._generation, self.dp_rank)

    # ---- start, run, stop ----------------------------------------------------------------------

    async def spawn(self) -> None:
        """Bind fresh sockets in a fresh runtime subdirectory and start the engine core there
        (and, across nodes, have every node start its ranks for it)."""
        # NOTE: from the main thread (the event loop's): PR_SET_PDEATHSIG fires when the *thread*
        # that spawned the child exits.
        self._generation += 1
        self._close_sockets()
        self._queue = asyncio.Queue(self.config.socket_hwm)
        if self.remote:
            await self._bind_tcp()
        else:
            self._core_in, self._core_out = start_local_core(
                self.processes, self.context, self.config, self.runtime_dir
            )
        if self.nodes is not None:
            await self.nodes.start(self.dp_rank, self._generation)

    async def _bind_tcp(self) -> None:
        """The remote core's sockets, on the same ports every generation (the core's node is told
        to stop the last one, and has, before these are bound again)."""
        head = NodeEndpoints(self.config.master_addr, self.config.master_port)
        hwm, keys = self.config.socket_hwm, self.nodes.server_keys
        deadline = time.monotonic() + 5.0
        while True:
            try:
                self._core_in = make_socket(
                    self.context, zmq.PUSH, head.engine_input(self.dp_rank), bind=True, hwm=hwm, curve_server_keys=keys
                )
                self._core_out = make_socket(
                    self.context,
                    zmq.PULL,
                    head.engine_output(self.dp_rank),
                    bind=True,
                    hwm=hwm,
                    curve_server_keys=keys,
                    max_message_bytes=self.config.internal_max_message_bytes,
                )
                return
            except zmq.ZMQError as error:  # the last generation's listener may still be closing
                self._close_sockets()
                if error.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise CoreStartError(f"{self.name}: cannot listen for its core: {error}") from None
                await asyncio.sleep(0.05)

    async def wait_ready(self) -> EngineReady:
        """Wait for the core's EngineReady (its workers are up and the KV cache sized)."""
        node_failure = (lambda: self.nodes.pending_failure(self.dp_rank)) if self.nodes is not None else lambda: None
        ready = await wait_until_ready(
            self.name, self._receive_one, self.processes, self.config.startup_timeout_s, node_failure
        )
        self.ready = ready
        if not self.remote:  # a remote engine's pids are its node's to watch
            self.processes.adopt_workers(ready.worker_pids)
        self.last_message = time.monotonic()
        return ready

    async def _receive_one(self):
        """The core's next message, or None after a heartbeat without one."""
        if await self._core_out.poll(int(self.config.heartbeat_interval_s * 1000)):
            return self._decode(await self._core_out.recv_multipart())
        return None

    async def start(self) -> EngineReady:
        if self.nodes is not None:
            try:
                await self.nodes.wait_joined()
            except NodeFailureError as error:
                raise CoreStartError(str(error)) from None
        await self.spawn()
        return await self.wait_ready()

    async def run(self, handle: MessageHandler) -> str:
        """Serve until the engine fails; returns the reason. Every message from the core but
        EngineDead goes to `handle`."""
        tasks = {
            asyncio.create_task(self._receive_loop(handle), name=f"{self.name}-out"),
            asyncio.create_task(self._send_loop(), name=f"{self.name}-in"),
            asyncio.create_task(self._liveness_loop(), name=f"{self.name}-liveness"),
        }
        if not self.remote:
            tasks.add(asyncio.create_task(self.processes.wait_for_exit(), name=f"{self.name}-supervise"))
        if self.nodes is not None:
            tasks.add(asyncio.create_task(self.nodes.wait_for_failure(self.dp_rank), name=f"{self.name}-nodes"))
        return await first_result(tasks)

    def send(self, message) -> bool:
        """Queue a message for the engine core; False if the queue is full."""
        try:
            self._queue.put_nowait(message)
            return True
        except asyncio.QueueFull:
            return False

    def responsive(self) -> bool:
        """Stepping or answering, or being restarted under the bounded policy."""
        return self.recovering or time.monotonic() - self.last_message < self.config.engine_hang_timeout_s

    async def kill(self) -> None:
        """Take every process of this engine down at once; return when all are gone (on other
        nodes: when their agents say so)."""
        if self.nodes is not None:
            await self.nodes.stop(self.dp_rank)
        if not self.remote:
            await self.processes.kill()
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    async def shutdown(self, timeout_s: float) -> None:
        """Ask the core to stop (it stops its workers); SIGTERM, then SIGKILL, what lingers."""
        if self.remote:
            await self._shutdown_remote(timeout_s)
            return
        core = self.processes.core
        if core is not None and core.poll() is None:
            try:
                await self._core_in.send(self._to_core.encode(Shutdown(reason="frontend shutdown")), zmq.NOBLOCK)
                await asyncio.to_thread(core.wait, timeout_s)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                pass
            await asyncio.to_thread(stop_children, [core], 5.0)
        self._close_sockets()

    async def _shutdown_remote(self, timeout_s: float) -> None:
        if self._core_in is not None:
            try:
                await self._core_in.send(self._to_core.encode(Shutdown(reason="frontend shutdown")), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            await self.nodes.wait_exited(self.dp_rank, timeout_s)
        await self.nodes.stop(self.dp_rank)  # if it did not exit by itself
        self._close_sockets()

    # ---- the loops of a running engine ---------------------------------------------------------

    async def _receive_loop(self, handle: MessageHandler) -> str:
        while True:
            message = self._decode(await self._core_out.recv_multipart())
            if message is None:
                continue
            self.last_message = time.monotonic()
            if isinstance(message, EngineDead):
                return f"{self.name} core reported: {message.reason}"
            await handle(self, message)

    async def _send_loop(self) -> str:
        """The only writer of core_in."""
        while True:
            message = await self._queue.get()
            await self._core_in.send(self._to_core.encode(message))

    async def _liveness_loop(self) -> str:
        """Ping the core every heartbeat; an answer proves its busy loop still turns."""
        interval = self.config.heartbeat_interval_s
        while True:
            self.send(UtilityCall(call_id=next(self._call_ids), method="ping"))
            await asyncio.sleep(interval)
            silent = time.monotonic() - self.last_message
            if silent > self.config.engine_hang_timeout_s:
                return f"{self.name} core unresponsive for {silent:.0f} s"

    def _decode(self, frames: list[bytes]):
        try:
            return self._from_core.decode_frames(frames)
        except MessageError as error:
            logger.error("dropped a malformed message from the %s core: %s", self.name, error)
            return None

    def _close_sockets(self) -> None:
        for socket in (self._core_in, self._core_out):
            if socket is not None:
                socket.close(linger=0)
        self._core_in = self._core_out = None
