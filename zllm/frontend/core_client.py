"""Engine cores in processes of their own, driven synchronously: `LLM(data_parallel_size=N)`.

    LLMEngine ── add_request ──> the least loaded core (LoadBalancer) ── PUSH ──> engine core d
              <── step() ───── TokenDeltas of whichever cores answered ── PULL <── (its workers)

Each core runs its own tp group of workers (GPUs d*tp ... d*tp+tp-1), exactly as under
`vllm-launch --data-parallel-size N`, so N engines step at once instead of taking turns on this
process's interpreter. There is no supervision here: a core that dies fails the `LLM` call with
an error naming it (the server restarts engines; an offline batch is simply run again).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import shutil
import subprocess
import time

import zmq

from zllm.config import EngineConfig
from zllm.frontend.engine_start import CoreStartError, run_blocking, start_local_core, wait_until_ready
from zllm.frontend.router import LoadBalancer
from zllm.ipc.addresses import engine_runtime_dir, make_private_runtime_dir
from zllm.ipc.codec import Codec
from zllm.ipc.messages import (
    AbortRequests,
    AddRequest,
    CoreToFrontend,
    EngineDead,
    EngineOutputs,
    EngineReady,
    FrontendToCore,
    Shutdown,
    TokenDelta,
    UtilityCall,
    UtilityResult,
)
from zllm.ipc.sockets import send_watching
from zllm.procs.engine_processes import EngineProcesses
from zllm.procs.exits import kill_and_wait, stop_children

logger = logging.getLogger(__name__)


_SHUTDOWN_GRACE_S = 10.0  # how long cores told to stop get before SIGTERM


class CoreClientError(RuntimeError):
    """Raised by the offline core client (in the user's process): an engine-core process failed or exited."""


@dataclasses.dataclass(slots=True)
class _Core:
    rank: int
    processes: EngineProcesses
    to_core: zmq.Socket
    from_core: zmq.Socket
    ready: EngineReady | None = None


class DataParallelCoreClient:
    """The EngineCoreClient of LLMEngine over `data_parallel_size` engine-core processes."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runtime_dir = make_private_runtime_dir()
        self.context = zmq.Context()
        self.balancer = LoadBalancer(config.data_parallel_size, config.block_size)
        self.owner: dict[str, int] = {}  # core request id -> the rank serving it
        self._encode = Codec(FrontendToCore).encode
        self._decode = Codec(CoreToFrontend).decode_frames
        self._call_ids = itertools.count()
        self._pending_deltas: list[TokenDelta] = []  # received while waiting for a utility result
        self.cores: list[_Core] = []
        try:
            for rank in range(config.data_parallel_size):
                self.cores.append(self._spawn(rank))
            for core in self.cores:
                core.ready = self._wait_ready(core)
        except BaseException:
            self.shutdown()
            raise
        self.num_kv_blocks = min(core.ready.num_kv_blocks for core in self.cores)

    # ---- EngineCoreClient ----------------------------------------------------------------------

    def add_request(self, message: AddRequest) -> None:
        rank = self.balancer.choose(message.prompt_token_ids, message.cache_salt)
        self.owner[message.request_id] = rank
        self._send(self.cores[rank], message)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            if (rank := self.owner.pop(request_id, None)) is not None:
                by_rank.setdefault(rank, []).append(request_id)
        for rank, ids in by_rank.items():
            self._send(self.cores[rank], AbortRequests(request_ids=ids))
        return [i for ids in by_rank.values() for i in ids]

    def step(self) -> list[TokenDelta]:
        """The deltas the cores have sent; waits for some while any request is unfinished."""
        deltas, self._pending_deltas = self._pending_deltas, []
        while not deltas and self.owner:
            deltas = self._receive(timeout_ms=int(self.config.heartbeat_interval_s * 1000))
            if not deltas:
                self._check_alive()
        return deltas

    def reset_prefix_cache(self) -> bool:
        results = self._call_all("reset_prefix_cache")
        return all(results)

    def stats(self) -> list[dict]:
        """Each core's stats, by dp rank."""
        return self._call_all("stats")

    def shutdown(self) -> None:
        live = [
            c.processes.core for c in self.cores if c.processes.core is not None and c.processes.core.poll() is None
        ]
        for core in self.cores:
            if core.processes.core in live:
                try:
                    core.to_core.send(self._encode(Shutdown(reason="LLM shut down")), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        # A core told to stop stops its workers first; a SIGTERM in the middle of that would
        # leave them to notice their parent's death on their own.
        deadline = time.monotonic() + _SHUTDOWN_GRACE_S
        for process in live:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        stop_children([c.processes.core for c in self.cores if c.processes.core is not None], timeout_s=10.0)
        kill_and_wait([pid for c in self.cores for pid in c.processes.worker_pids])  # what a core left behind
        self.cores = []
        self.context.destroy(linger=0)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)

    # ---- processes and sockets -----------------------------------------------------------------

    def _spawn(self, rank: int) -> _Core:
        processes = EngineProcesses()
        config = dataclasses.replace(self.config, data_parallel_rank=rank)
        runtime_dir = engine_runtime_dir(self.runtime_dir, 1, rank)
        to_core, from_core = start_local_core(processes, self.context, config, runtime_dir)
        return _Core(rank, processes, to_core, from_core)

    def _send(self, core: _Core, message) -> None:
        """Sends to one core; fails, rather than waits, once that core has exited."""

        def check_core() -> None:
            if (code := core.processes.core_exit_code()) is not None:
                raise CoreClientError(f"engine {core.rank} core exited with code {code}")

        send_watching(core.to_core, self._encode(message), int(self.config.heartbeat_interval_s * 1000), check_core)

    def _wait_ready(self, core: _Core) -> EngineReady:
        async def receive():  # blocks: run_blocking needs awaits that never suspend
            if core.from_core.poll(int(self.config.heartbeat_interval_s * 1000)):
                return self._decode(core.from_core.recv_multipart())
            return None

        name, timeout_s = f"engine {core.rank}", self.config.startup_timeout_s
        try:
            ready = run_blocking(wait_until_ready(name, receive, core.processes, timeout_s))
        except CoreStartError as error:
            raise CoreClientError(str(error)) from None
        core.processes.adopt_workers(ready.worker_pids)
        return ready

    def _receive(self, timeout_ms: int, results: dict[int, UtilityResult] | None = None) -> list[TokenDelta]:
        """Everything the cores have sent within timeout_ms: deltas returned, utility results
        filed into `results` by call id."""
        poller = zmq.Poller()
        for core in self.cores:
            poller.register(core.from_core, zmq.POLLIN)
        deltas: list[TokenDelta] = []
        for socket, _ in poller.poll(timeout_ms):
            core = next(c for c in self.cores if c.from_core is socket)
            while socket.poll(0):
                deltas += self._handle(core, self._decode(socket.recv_multipart()), results)
        return deltas

    def _handle(self, core: _Core, message, results: dict[int, UtilityResult] | None) -> list[TokenDelta]:
        if isinstance(message, EngineDead):
            raise CoreClientError(f"engine {core.rank} failed: {message.reason}")
        if isinstance(message, UtilityResult):
            if results is not None:
                results[message.call_id] = message
            return []
        if not isinstance(message, EngineOutputs):
            return []
        self.balancer.report(core.rank, message.num_waiting, message.num_running)
        # A request the core refused ends with an error, as one the workers failed does.
        refused = {**message.failed, **message.rejected}
        deltas = [
            TokenDelta(request_id=i, new_token_ids=[], finish_reason="error", error=reason)
            for i, reason in refused.items()
        ] + message.outputs
        for delta in deltas:
            if delta.finish_reason is not None:
                self.owner.pop(delta.request_id, None)
        return deltas

    def _call_all(self, method: str) -> list:
        """A utility call to every core; their results in dp rank order. Deltas that arrive
        meanwhile are kept for the next step."""
        call_ids = [next(self._call_ids) for _ in self.cores]
        for core, call_id in zip(self.cores, call_ids):
            self._send(core, UtilityCall(call_id=call_id, method=method))
        results: dict[int, UtilityResult] = {}
        while not all(i in results for i in call_ids):
            self._pending_deltas += self._receive(int(self.config.heartbeat_interval_s * 1000), results)
            self._check_alive()
        errors = [results[i].error for i in call_ids if results[i].error]
        if errors:
            raise CoreClientError("; ".join(errors))
        return [results[i].result for i in call_ids]

    def _check_alive(self) -> None:
        for core in self.cores:
            if (code := core.processes.core_exit_code()) is not None:
                raise CoreClientError(f"engine {core.rank} core exited with code {code}")
