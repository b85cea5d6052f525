"""The engine-core process: `python -m zllm.enginecore.process` (config as JSON on stdin).

    frontend --PUSH--> [core-input]  PULL  ┌ input thread ─> queue ┐
                                           │   busy loop: schedule → execute → update
    frontend <--PULL-- [core-output] PUSH  └ output thread <─ queue ┘

The busy loop is single-threaded and never touches a socket; the two side threads decode and
encode off the hot path. Started workers report ready, the core sizes the KV cache from the
smallest capacity, then sends EngineReady. Any failure of the workers is sent as EngineDead
before the process exits (non-zero).
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
import traceback
from dataclasses import asdict

import zmq

from zllm.config import EngineConfig
from zllm.enginecore.core import EngineCore, QueueFullError
from zllm.enginecore.executor import make_executor
from zllm.ipc.addresses import InternalEndpoints, NodeEndpoints
from zllm.ipc.codec import Codec, MessageError
from zllm.ipc.messages import (
    AbortRequests,
    AddRequest,
    CoreToFrontend,
    EngineDead,
    EngineOutputs,
    EngineReady,
    FrontendToCore,
    Shutdown,
    UtilityCall,
    UtilityResult,
)
from zllm.ipc.sockets import connect_pull_push, send_watching
from zllm.procs.children import die_with_parent, read_config_from_stdin, setup_child_logging
from zllm.procs.gc_heap import freeze_startup_heap

logger = logging.getLogger("zllm.enginecore")

_STOP = object()  # sentinel for the output thread
_FLUSH_MS = 1000  # at exit, how long the last messages (EngineDead) may take to leave


class EngineCoreProcess:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.context = zmq.Context()
        self.inputs: queue.Queue = queue.Queue()
        self.outputs: queue.Queue = queue.Queue()
        self.core: EngineCore | None = None
        self._running = True
        self._closing = threading.Event()  # tells the input thread to close its socket and end

    def run(self) -> int:
        input_socket, output_socket = self._connect_to_frontend()
        receiver = threading.Thread(target=self._receive_loop, args=(input_socket,), daemon=True, name="core-in")
        receiver.start()
        sender = threading.Thread(target=self._send_loop, args=(output_socket,), daemon=True, name="core-out")
        sender.start()
        executor = None
        code = 0
        try:
            executor = make_executor(self.config, self.context)
            self.core = EngineCore(self.config, executor)
            freeze_startup_heap("engine core")
            self.outputs.put(self._ready_message())
            self._busy_loop()
        except Exception as error:
            logger.error("engine core failed:\n%s", traceback.format_exc())
            self.outputs.put(EngineDead(reason=f"{type(error).__name__}: {error}"))
            code = 1
        finally:
            if self.core is not None:
                self.core.shutdown()  # the grammar threads too, so that exit does not wait on queued compiles
            elif executor is not None:
                executor.shutdown()
            # NOTE: each side thread closes its own socket (zmq sockets are not thread-safe; a
            # context destroyed under a thread blocked in recv aborts the process) before the
            # context goes.
            self._closing.set()
            self.outputs.put(_STOP)
            receiver.join(timeout=5.0)
            sender.join(timeout=5.0)
            self.context.destroy(linger=0)
        return code

    def _connect_to_frontend(self) -> tuple[zmq.Socket, zmq.Socket]:
        """ipc on the frontend's node; from another node (data parallelism across nodes) tcp to
        the head, with this node's CURVE keys."""
        config = self.config
        if config.node_rank == 0:
            endpoints = InternalEndpoints(config.runtime_dir)
            inputs, outputs = endpoints.core_input, endpoints.core_output
        else:
            head, rank = NodeEndpoints(config.master_addr, config.master_port), config.data_parallel_rank
            inputs, outputs = head.engine_input(rank), head.engine_output(rank)
        return connect_pull_push(self.context, inputs, outputs, hwm=config.socket_hwm, curve_dir=config.curve_dir)

    def _ready_message(self) -> EngineReady:
        return EngineReady(
            num_kv_blocks=self.core.num_kv_blocks,
            block_size=self.config.block_size,
            max_model_len=self.config.max_model_len,
            tensor_parallel_size=self.config.tensor_parallel_size,
            model=self.config.model_name,
            worker_pids=self.core.executor.worker_pids,
        )

    # ---- the busy loop -------------------------------------------------------------------------

    def _busy_loop(self) -> None:
        core = self.core
        while self._running:
            self._handle_inputs(block=not core.has_unfinished_requests())
            if not self._running:
                break
            if core.has_unfinished_requests():
                deltas = core.step()
                if deltas:
                    self.outputs.put(self._engine_outputs(outputs=deltas))

    def _handle_inputs(self, block: bool) -> None:
        try:
            message = self.inputs.get(timeout=self.config.heartbeat_interval_s) if block else self.inputs.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(message)
            try:
                message = self.inputs.get_nowait()
            except queue.Empty:
                return

    def _handle(self, message) -> None:
        if isinstance(message, AddRequest):
            try:
                self.core.add_request(message)
            except ValueError as error:
                self.outputs.put(self._engine_outputs(failed={message.request_id: str(error)}))
            except QueueFullError as error:
                self.outputs.put(self._engine_outputs(rejected={message.request_id: str(error)}))
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids)
        elif isinstance(message, UtilityCall):
            self.outputs.put(self._utility(message))
        elif isinstance(message, Shutdown):
            logger.info("shutting down (%s)", message.reason or "asked by the frontend")
            self._running = False

    def _engine_outputs(self, outputs: list | None = None, **ended: dict[str, str]) -> EngineOutputs:
        """An EngineOutputs with the scheduler's queue lengths as they are now."""
        scheduler = self.core.scheduler
        return EngineOutputs(
            outputs=outputs or [], **ended, num_waiting=len(scheduler.waiting), num_running=len(scheduler.running)
        )

    def _utility(self, call: UtilityCall) -> UtilityResult:
        if call.method == "stats":
            stats = asdict(self.core.stats())
            stats.update(num_kv_blocks=self.core.num_kv_blocks, num_free_kv_blocks=self.core.num_free_kv_blocks())
            return UtilityResult(call_id=call.call_id, result=stats)
        if call.method == "ping":
            return UtilityResult(call_id=call.call_id, result=time.time())
        if call.method == "reset_prefix_cache":
            return UtilityResult(call_id=call.call_id, result=self.core.reset_prefix_cache())
        return UtilityResult(call_id=call.call_id, error=f"unknown utility method {call.method!r}")

    # ---- side threads --------------------------------------------------------------------------

    def _receive_loop(self, socket: zmq.Socket) -> None:
        # NOTE: the size limit is checked on receipt, not with zmq.MAXMSGSIZE: libzmq ends a
        # connecting socket's session on an oversized frame and never reconnects it.
        codec: Codec = Codec(FrontendToCore, max_frame_bytes=self.config.internal_max_message_bytes)
        poll_ms = int(self.config.heartbeat_interval_s * 1000)
        while not self._closing.is_set():
            if not socket.poll(poll_ms):
                continue
            try:
                self.inputs.put(codec.decode_frames(socket.recv_multipart()))
            except MessageError as error:
                logger.error("dropped a malformed message from the frontend: %s", error)
        socket.close(linger=0)

    def _send_loop(self, socket: zmq.Socket) -> None:
        codec: Codec = Codec(CoreToFrontend)
        poll_ms = int(self.config.heartbeat_interval_s * 1000)

        def give_up_when_closing() -> None:  # the context goes soon after
            if self._closing.is_set():
                raise zmq.Again()

        while (message := self.outputs.get()) is not _STOP:
            try:
                # A frontend that stopped reading fills the pipe: wait for room until closing.
                send_watching(socket, codec.encode(message), poll_ms, give_up_when_closing)
            except zmq.ZMQError:
                break
        socket.close(linger=_FLUSH_MS)


def main() -> int:
    config = read_config_from_stdin()
    die_with_parent(config.heartbeat_interval_s)
    setup_child_logging("enginecore")
    return EngineCoreProcess(config).run()


if __name__ == "__main__":
    sys.exit(main())
