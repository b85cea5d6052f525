"""Workers as processes, seen from the engine core: the Executor protocol over sockets.

Each step goes once to every rank (one PUSH socket per rank); rank 0 answers. While waiting,
the executor checks every `heartbeat_interval_s` that all worker processes are alive, so a
dead worker surfaces as WorkerDiedError instead of a hang.

With nnodes > 1 only this node's ranks are children of the core (ipc sockets); the ranks of the
other nodes are started by their node agent (`vllm-launch --headless`) and reach the core over tcp
(NodeEndpoints, CURVE from curve_dir). A remote rank that dies makes its peers fail in their
next collective, which rank 0 reports; the frontend also watches the nodes themselves.
"""

from __future__ import annotations

import itertools
import logging
import subprocess
import time
from collections import deque

import zmq

from zllm.config import EngineConfig
from zllm.ipc.addresses import InternalEndpoints, NodeEndpoints
from zllm.ipc.codec import Codec, MessageError
from zllm.ipc.curve import ClientKeyCheck, load_or_create_server_keys, start_thread_authenticator
from zllm.ipc.messages import (
    CoreToWorker,
    FlushStep,
    GrammarBitmask,
    StepInput,
    StepOutput,
    WorkerCall,
    WorkerCallResult,
    WorkerFailed,
    WorkerReady,
    WorkerToCore,
)
from zllm.ipc.sockets import make_socket, send_watching
from zllm.procs.children import spawn_child
from zllm.procs.exits import stop_children

logger = logging.getLogger(__name__)

# How long ranks told to shut down get to exit on their own before SIGTERM (the frontend gives a
# core 10 s to stop: this, then up to 5 s after SIGTERM).
_WORKER_EXIT_GRACE_S = 5.0


class WorkerDiedError(RuntimeError):
    """A worker process exited or reported a failure."""


def make_executor(config: EngineConfig, context: zmq.Context) -> MultiprocExecutor:
    """The executor of config.distributed_executor_backend: worker processes (mp), or Ray actors."""
    if config.distributed_executor_backend == "ray":
        from zllm.enginecore.ray_executor import RayExecutor

        return RayExecutor(config, context)
    return MultiprocExecutor(config, context)


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, context: zmq.Context) -> None:
        self.config = config
        self._authenticator = None
        self.inputs, self.outputs = self._bind_sockets(config, context)
        self.outbound: Codec = Codec(CoreToWorker)
        self.inbound: Codec = Codec(WorkerToCore)
        self._call_ids = itertools.count()
        self._submitted: deque[int] = deque()  # step ids sent and not yet answered
        self.processes: dict[int, subprocess.Popen] = {}
        try:
            self._start_ranks()
            ready = self._gather(WorkerReady, config.tensor_parallel_size, config.startup_timeout_s)
        except BaseException:
            # One rank failed to start: the others may be blocked in a collective waiting for it.
            self._stop_local()
            raise
        # Every rank must hold the same blocks, so the smallest capacity is the capacity.
        self._num_kv_blocks = min(r.num_kv_blocks for r in ready)
        logger.info("%d worker(s) ready: pids %s", len(ready), [r.pid for r in ready])

    def _start_ranks(self) -> None:
        """This node's ranks as child processes (another node's agent starts that node's own)."""
        self.processes = {
            r: spawn_child("zllm.workers.process", self.config, "--rank", str(r)) for r in self.config.local_ranks(0)
        }

    def _bind_sockets(self, config: EngineConfig, context: zmq.Context) -> tuple[list[zmq.Socket], list[zmq.Socket]]:
        """A PUSH per rank and the PULL(s) the ranks answer on: ipc for this node's ranks, tcp
        (with CURVE unless allow_insecure_tcp) for the other nodes'."""
        endpoints = InternalEndpoints(config.runtime_dir)
        hwm = config.socket_hwm
        limit = config.internal_max_message_bytes
        outputs = [make_socket(context, zmq.PULL, endpoints.worker_output, bind=True, hwm=hwm, max_message_bytes=limit)]
        if not config.tp_spans_nodes:
            inputs = [
                make_socket(context, zmq.PUSH, endpoints.worker_input(r), bind=True, hwm=hwm)
                for r in range(config.tensor_parallel_size)
            ]
            return inputs, outputs
        nodes = NodeEndpoints(config.master_addr, config.master_port)
        keys = None
        inputs: list[zmq.Socket] = []
        try:
            if config.curve_dir:
                keys = load_or_create_server_keys(config.curve_dir)
                self._authenticator = start_thread_authenticator(context, ClientKeyCheck(keys.clients_dir, False))
            local = config.local_ranks(0)
            for r in range(config.tensor_parallel_size):
                inputs.append(
                    make_socket(context, zmq.PUSH, endpoints.worker_input(r), bind=True, hwm=hwm)
                    if r in local
                    else make_socket(
                        context, zmq.PUSH, nodes.worker_input(r), bind=True, hwm=hwm, curve_server_keys=keys
                    )
                )
            outputs.append(
                make_socket(
                    context,
                    zmq.PULL,
                    nodes.worker_output,
                    bind=True,
                    hwm=hwm,
                    max_message_bytes=limit,
                    curve_server_keys=keys,
                )
            )
        except BaseException:
            # e.g. a port still taken: nothing of this attempt may outlive it, least of all the
            # authenticator's thread, whose sockets the core's context teardown would close under it.
            for socket in inputs + outputs:
                socket.close(linger=0)
            if self._authenticator is not None:
                self._authenticator.stop()
                self._authenticator = None
            raise
        return inputs, outputs

    @property
    def worker_pids(self) -> list[int]:
        """This node's workers (another node's agent supervises that node's own)."""
        return [process.pid for process in self.processes.values()]

    def determine_num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call_all("init_kv_cache", [num_blocks])

    def execute_step(self, step: StepInput) -> StepOutput:
        self.submit_step(step)
        return self.collect_step(flush=True)

    def submit_step(self, step: StepInput) -> None:
        self._broadcast(step)
        self._submitted.append(step.step_id)

    def collect_step(self, flush: bool) -> StepOutput:
        """Rank 0's answer to the oldest submitted step; `flush`: no step follows it, so an async
        worker must be told to answer without waiting for one."""
        step_id = self._submitted.popleft()
        if flush and self.config.async_scheduling:
            self._broadcast(FlushStep(step_id=step_id))
        (output,) = self._gather(StepOutput, 1, timeout_s=None)
        if output.step_id != step_id:
            raise WorkerDiedError(f"rank 0 answered step {output.step_id}, expected {step_id}")
        return output

    def send_grammar_bitmask(self, bitmask: GrammarBitmask) -> None:
        """To rank 0 alone: it samples and shares the tokens with the other ranks."""
        self._send_watching(self.inputs[0], self.outbound.encode(bitmask))

    def shutdown(self) -> None:
        told = False
        try:
            # Never block: a dead rank's socket has no reader, and the rest are stopped below anyway.
            self._broadcast(WorkerCall(call_id=next(self._call_ids), method="shutdown"), flags=zmq.NOBLOCK)
            told = True
        except zmq.ZMQError:
            pass
        # Ranks told to stop release their model and leave the process group before they exit
        # (a SIGTERM at once would race that); once one rank is gone, the others may be stuck in a
        # collective with it, so they get no grace.
        everyone_alive = not self._dead_ranks()
        self._stop_local(grace_s=_WORKER_EXIT_GRACE_S if told and everyone_alive else 0.0)

    def _stop_local(self, grace_s: float = 0.0) -> None:
        stop_children(list(self.processes.values()), timeout_s=5.0, grace_s=grace_s)
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None

    # ---- plumbing ------------------------------------------------------------------------------

    def _call_all(self, method: str, args: list) -> None:
        call = WorkerCall(call_id=next(self._call_ids), method=method, args=args)
        self._broadcast(call)
        for result in self._gather(WorkerCallResult, self.config.tensor_parallel_size, self.config.startup_timeout_s):
            if result.error:
                raise WorkerDiedError(f"rank {result.rank}: {method} failed: {result.error}")

    def _broadcast(self, message, flags: int = 0) -> None:
        frame = self.outbound.encode(message)
        for socket in self.inputs:
            if not flags & zmq.NOBLOCK:
                self._send_watching(socket, frame)
                continue
            try:
                socket.send(frame, flags=flags, copy=False)
            except zmq.Again:
                continue  # that rank is gone; only shutdown sends without blocking

    def _send_watching(self, socket: zmq.Socket, frame: bytes) -> None:
        """Waits for room (the rank is busy, or still connecting), not for a rank that died."""
        send_watching(socket, frame, int(self.config.heartbeat_interval_s * 1000), self._check_alive)

    def _gather(self, kind: type, count: int, timeout_s: float | None) -> list:
        """Receive `count` messages of `kind`, watching the workers' health meanwhile."""
        received = []
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        poll_ms = int(self.config.heartbeat_interval_s * 1000)
        poller = zmq.Poller()
        for socket in self.outputs:
            poller.register(socket, zmq.POLLIN)
        while len(received) < count:
            ready = poller.poll(poll_ms)
            for socket, _ in ready:
                message = self._receive(socket)
                if isinstance(message, WorkerFailed):
                    raise WorkerDiedError(self._root_cause(message))
                if isinstance(message, kind):
                    received.append(message)
                elif message is not None:
                    logger.warning("unexpected %s while waiting for %s", type(message).__name__, kind.__name__)
            if ready:
                continue
            self._check_alive()
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerDiedError(
                    f"workers did not answer with {kind.__name__} within {timeout_s:.0f} s"
                    f" ({len(received)} of {count} did)"
                )
        return received

    def _receive(self, socket: zmq.Socket):
        try:
            return self.inbound.decode_frames(socket.recv_multipart())
        except MessageError as error:
            logger.error("dropped a malformed message from a worker: %s", error)
            return None

    def _check_alive(self) -> None:
        dead = self._dead_ranks()
        if dead:
            raise WorkerDiedError("; ".join(dead))

    def _dead_ranks(self, except_rank: int | None = None) -> list[str]:
        return [
            f"rank {rank} (pid {process.pid}) exited with code {process.poll()}"
            for rank, process in self.processes.items()
            if rank != except_rank and process.poll() is not None
        ]

    def _root_cause(self, failure: WorkerFailed) -> str:
        """When one rank dies, its peers fail in their next collective and report that; name the
        rank that died first, if any did, so the error points at the cause."""
        deadline = time.monotonic() + self.config.heartbeat_interval_s
        while True:
            dead = self._dead_ranks(except_rank=failure.rank)
            if dead or time.monotonic() > deadline:
                return "; ".join([*dead, failure.error]) if dead else failure.error
            time.sleep(0.05)
