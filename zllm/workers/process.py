"""The worker process: `python -m zllm.workers.process --rank R` (config as JSON on stdin).

    engine core --PUSH--> [worker-R-input]  PULL  worker  PUSH --> [worker-output] --PULL--> core

Loads the model, reports its KV capacity (WorkerReady), then serves calls and steps until told
to shut down (a "shutdown" call, or SIGTERM: either way the model and its graphs go first, then
the process group, then the process exits). Only rank 0 answers steps. An exception is reported
as WorkerFailed naming the rank, then the process exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from dataclasses import dataclass
from typing import NoReturn

import zmq

from zllm.config import EngineConfig
from zllm.ipc.addresses import InternalEndpoints, NodeEndpoints
from zllm.ipc.codec import Codec, MessageError, decode_json
from zllm.ipc.curve import ClientKeys
from zllm.ipc.messages import (
    CoreToWorker,
    FlushStep,
    GrammarBitmask,
    StepInput,
    WorkerCall,
    WorkerCallResult,
    WorkerFailed,
    WorkerReady,
    WorkerToCore,
)
from zllm.ipc.sockets import connect_pull_push, make_socket
from zllm.procs.children import die_with_parent, install_hang_dump, read_config_from_stdin, setup_child_logging
from zllm.procs.gc_heap import freeze_startup_heap

logger = logging.getLogger("zllm.worker")
_FLUSH_MS = 1000  # at exit, how long the last message (WorkerFailed) may take to leave


@dataclass(frozen=True, slots=True)
class RankLinks:
    """Where a rank placed by a cluster manager (the Ray backend: zllm/workers/ray_actor.py) meets
    its engine core and its peers: handed to it, not derived from the config."""

    worker_input: str  # the engine core's PUSH to this rank
    worker_output: str  # the engine core's PULL
    curve: ClientKeys | None  # tcp from another machine: the core's public key and this rank's pair
    init_method: str  # torch.distributed's rendezvous (rank 0's address)
    gpu_index: int | None  # among the GPUs this process sees; None: CPU


class WorkerProcess:
    def __init__(self, config: EngineConfig, rank: int, links: RankLinks | None = None) -> None:
        self.config = config
        self.rank = rank
        self.links = links
        self.context = zmq.Context()
        self.input, self.output = self._connect(config, rank)
        # NOTE: the size limit is checked on receipt, not with zmq.MAXMSGSIZE: libzmq ends a
        # connecting socket's session on an oversized frame and never reconnects it.
        self.inbound: Codec = Codec(CoreToWorker, max_frame_bytes=config.internal_max_message_bytes)
        self.outbound: Codec = Codec(WorkerToCore)
        self.worker = None

    def _connect(self, config: EngineConfig, rank: int) -> tuple[zmq.Socket, zmq.Socket]:
        """To the engine core: over ipc on its node, over tcp (CURVE) from another node."""
        if self.links is not None:
            links, hwm = self.links, config.socket_hwm
            return (
                make_socket(
                    self.context, zmq.PULL, links.worker_input, bind=False, hwm=hwm, curve_client_keys=links.curve
                ),
                make_socket(
                    self.context, zmq.PUSH, links.worker_output, bind=False, hwm=hwm, curve_client_keys=links.curve
                ),
            )
        if not config.tp_spans_nodes or config.node_rank == 0:
            endpoints = InternalEndpoints(config.runtime_dir)
            inputs, outputs = endpoints.worker_input(rank), endpoints.worker_output
        else:
            head = NodeEndpoints(config.master_addr, config.master_port)
            inputs, outputs = head.worker_input(rank), head.worker_output
        return connect_pull_push(self.context, inputs, outputs, hwm=config.socket_hwm, curve_dir=config.curve_dir)

    def run(self) -> int:
        failed = False
        try:
            self._start()
            self._serve()
            return 0
        except Exception as error:  # reported to the core, which decides what happens next
            failed = True
            logger.error("rank %d failed:\n%s", self.rank, traceback.format_exc())
            self._send(WorkerFailed(rank=self.rank, error=f"rank {self.rank}: {type(error).__name__}: {error}"))
            return 1
        finally:
            # Flush what is queued (a WorkerFailed names the cause), briefly: the core may be gone.
            self.output.close(linger=_FLUSH_MS)
            self.context.destroy(linger=0)
            if not failed:
                # Told to stop, by a shutdown call or by SIGTERM (SystemExit, e.g. from the core's
                # stop_children): one teardown for both. After a failure the engine kills every
                # rank anyway, and a peer may still hold the group mid-collective.
                self._shut_down()

    def _shut_down(self) -> None:
        """Release the model, graphs and cache, then leave the process group; never raises."""
        try:
            if self.worker is not None:
                self.worker.shutdown()
            else:  # stopped while starting: the group may exist already
                from zllm.workers.distributed import leave_process_group

                leave_process_group()
        except Exception:
            logger.warning("rank %d: shutdown failed", self.rank, exc_info=True)

    def _start(self) -> None:
        from zllm.workers.worker import Worker

        links = self.links
        if links is None:
            self.worker = Worker(self.config, self.rank)
        else:
            self.worker = Worker(self.config, self.rank, links.gpu_index, links.init_method)
        num_blocks = self.worker.determine_num_kv_blocks()
        self._send(WorkerReady(rank=self.rank, num_kv_blocks=num_blocks, pid=os.getpid()))

    def _serve(self) -> None:
        while True:
            try:
                message = self.inbound.decode_frames(self.input.recv_multipart(copy=True))
            except MessageError as error:
                logger.error("rank %d: dropped a malformed message: %s", self.rank, error)
                continue
            if isinstance(message, StepInput):
                answers = self.worker.advance(message)
                if not self.config.async_scheduling and not self.worker.awaiting_bitmask:
                    answers += self.worker.finish_pending()
                self._answer(answers)
            elif isinstance(message, GrammarBitmask):
                self.worker.apply_grammar_bitmask(message)
                if not self.config.async_scheduling:
                    self._answer(self.worker.finish_pending())
            elif isinstance(message, FlushStep):
                self._answer(self.worker.finish_pending())
            elif isinstance(message, WorkerCall):
                if message.method == "shutdown":
                    return  # run() shuts the worker down
                self._send(self._call(message))

    def _answer(self, outputs: list) -> None:
        if self.rank == 0:  # every rank holds the same tokens; one answer is enough
            for output in outputs:
                self._send(output)

    def _call(self, call: WorkerCall) -> WorkerCallResult:
        if call.method == "init_kv_cache":
            self.worker.initialize_kv_cache(int(call.args[0]))
            freeze_startup_heap(f"worker{self.rank}")  # started: the model, its cache and graphs live until exit
            return WorkerCallResult(rank=self.rank, call_id=call.call_id)
        return WorkerCallResult(rank=self.rank, call_id=call.call_id, error=f"unknown worker method {call.method!r}")

    def _send(self, message) -> None:
        self.output.send(self.outbound.encode(message), copy=False)


def run_placed_rank(
    config_json: bytes,
    rank: int,
    worker_input: str,
    worker_output: str,
    curve_keys: str | None,
    init_method: str,
    visible_gpus: str | None,
    gpu_index: int | None,
) -> int:
    """A rank placed by Ray (zllm/procs/ray_actor.py runs this in its actor): the same loop as a
    worker process, on the sockets and rendezvous its engine core named. curve_keys: "server
    public,client public,client secret" (z85) when the core is on another machine. visible_gpus:
    every GPU Ray gave this engine's ranks on this node (set before CUDA starts, so that peers
    on one node see each other's GPUs); gpu_index: this rank's among them."""
    if visible_gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus
    config = decode_json(config_json, EngineConfig)
    setup_child_logging(f"worker{rank}")
    install_hang_dump()
    curve = None
    if curve_keys:
        server_public, public, secret = (key.encode() for key in curve_keys.split(","))
        curve = ClientKeys(server_public=server_public, key_pair=(public, secret))
    links = RankLinks(worker_input, worker_output, curve, init_method, gpu_index)
    return WorkerProcess(config, rank, links).run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zllm-worker")
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args(argv)
    config = read_config_from_stdin()
    die_with_parent(config.heartbeat_interval_s)
    setup_child_logging(f"worker{args.rank}")
    install_hang_dump()
    return WorkerProcess(config, args.rank).run()


def exit_without_finalizing(code: int | str | None) -> NoReturn:
    """End the worker process with `code` (as sys.exit reads it) once its logs are flushed, without
    the interpreter's finalization. By then run() has released the model, left the process group
    and closed its sockets; finalization would only add the C++ destructors of libraries'
    background threads, and one of those can abort the process ("terminate called without an
    active exception", SIGABRT): a rank that left its gloo group cleanly exited -6 instead of 0
    in a CI run under load. zllm registers no atexit work a worker needs."""
    if isinstance(code, str):  # sys.exit("message"): the message to stderr, status 1
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    try:
        status = main()
    except SystemExit as stop:  # SIGTERM's handler, argparse: the same exit, without finalizing
        status = stop.code
    exit_without_finalizing(status)
