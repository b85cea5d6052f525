"""The frontend process: owns the tokenizer and the client endpoint, spawns the engine core.

    clients --DEALER--> [client endpoint] ROUTER  frontend  PUSH --> [core-input]  --> core
    clients <---------- deltas ---------- ROUTER  frontend  PULL <-- [core-output] <-- core

Clients speak the map-encoded Client*/Server* messages of zllm.ipc.messages. Each request is
validated here (errors go back to that client only), streamed back as text/token deltas (text
that could still turn into a stop string is held back until it can't), and aborted in the core
when its client cancels, vanishes (a send to it fails) or falls silent past client_timeout_s.
The OpenAI HTTP API (api_server.py) is a client inside this process: `open_local_client`.

Engine failures (zllm/frontend/supervisor.py watches the core and every worker): with
on_failure="restart" the engine is killed, restarted with back-off, and every request in flight
is re-sent as a continuation of what its client already received (zllm/frontend/replay.py), so
streams simply go on; with on_failure="fail", or once the crash loop gives up, every request
ends with an engine_dead error. Each engine start gets its own sockets in its own runtime
subdirectory, so nothing from a dead core can reach its successor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import hmac
import itertools
import logging
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from zllm.config import EngineConfig
from zllm.frontend.metrics import FrontendMetrics
from zllm.frontend.output_processor import OutputProcessor
from zllm.frontend.processor import InputProcessor
from zllm.frontend.replay import ReplayLog
from zllm.frontend.supervisor import EngineProcesses, RestartPolicy
from zllm.frontend.tokenizer import chat_prompt, load_tokenizer
from zllm.ipc.addresses import InternalEndpoints, default_client_endpoint, engine_runtime_dir
from zllm.ipc.codec import Codec, MessageError, convert
from zllm.ipc.curve import ClientKeyCheck, ServerKeys, client_endpoint_keys, start_authenticator
from zllm.ipc.messages import (
    AbortRequests,
    AddRequest,
    ClientAbort,
    ClientGenerate,
    ClientPing,
    ClientStats,
    ClientToServer,
    ClientUtility,
    CoreToFrontend,
    EngineDead,
    EngineOutputs,
    EngineReady,
    FrontendToCore,
    ServerError,
    ServerOutput,
    ServerPong,
    ServerStats,
    ServerToClient,
    ServerUtilityResult,
    Shutdown,
    UtilityCall,
    UtilityResult,
)
from zllm.ipc.sockets import make_socket
from zllm.outputs import CompletionOutput, RequestOutput
from zllm.procs.children import stop_children
from zllm.sampling_params import SamplingParams

logger = logging.getLogger("zllm.frontend")


# A request in flight through this many engine failures is failed alone rather than replayed
# again: it may be what crashes the engine.
_MAX_REPLAYS = 2


class EngineStartError(RuntimeError):
    pass


# Engine utilities a client may call by name (ClientUtility).
_CLIENT_UTILITIES = ("reset_prefix_cache",)


@dataclass(slots=True)
class _Sent:
    """How much of one completion a client has received."""

    text: int = 0
    tokens: int = 0
    logprobs: int = 0
    finished: bool = False


@dataclass(slots=True)
class _ClientRequest:
    identity: bytes
    request_id: str  # the client's id; the engine sees identity-prefixed ids
    holdback: int  # characters of text withheld while a stop string could still match
    sent: list[_Sent]  # one per completion (n)
    sent_prompt: bool = False
    sent_prompt_logprobs: bool = False


@dataclass(slots=True)
class _Client:
    last_seen: float
    requests: set[str] = field(default_factory=set)
    # A client inside this process (the HTTP API): its messages go to this queue, not the socket,
    # and it is never timed out for silence (it closes itself).
    inbox: asyncio.Queue | None = None


class FrontendServer:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.client_endpoint = config.client_endpoint or default_client_endpoint()
        self.tokenizer = load_tokenizer(config.tokenizer_path)
        self.processor = InputProcessor.from_config(config, self.tokenizer)
        self.outputs = OutputProcessor(self.tokenizer)
        self.context = zmq.asyncio.Context()
        self.to_core: Codec = Codec(FrontendToCore)
        self.from_core: Codec = Codec(CoreToFrontend)
        self.from_clients: Codec = Codec(ClientToServer)
        self.to_clients: Codec = Codec(ServerToClient)
        self.requests: dict[str, _ClientRequest] = {}
        self.clients: dict[bytes, _Client] = {}
        self.stats_waiters: dict[int, tuple[bytes, int]] = {}
        self.utility_waiters: dict[int, tuple[bytes, int]] = {}
        self._call_ids = itertools.count()
        self.engine = EngineProcesses()
        self.restart_policy = RestartPolicy(config.max_restarts, config.restart_window_s)
        self.replay = ReplayLog(_MAX_REPLAYS)
        self.ready: EngineReady | None = None
        self.dead_reason: str | None = None
        self.num_restarts = 0
        self.recovering = False  # the engine is being restarted: new requests are held meanwhile
        self.draining = False  # a graceful shutdown began: new requests are refused (/health: 503)
        self.metrics = FrontendMetrics(config.model_name)
        self._generation = 0
        self._core_queue: asyncio.Queue = asyncio.Queue(config.socket_hwm)
        self._held_while_recovering = 0
        self._last_engine_message = 0.0
        self._answering = asyncio.Event()

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> EngineReady:
        # Before the model loads, so that a key problem fails fast.
        keys = client_endpoint_keys(self.client_endpoint, self.config.curve_dir, self.config.api_key)
        self.ready = await self._start_engine()
        if keys is not None:
            self._start_authenticator(keys)
        self.client_socket = make_socket(
            self.context, zmq.ROUTER, self.client_endpoint, bind=True, hwm=self.config.socket_hwm,
            router_mandatory=True, curve_server_keys=keys, max_message_bytes=self.config.client_max_message_bytes,
        )
        logger.info("serving %s on %s%s", self.ready.model, self.client_endpoint, " (CURVE)" if keys else "")
        return self.ready

    async def serve(self) -> None:
        """Serve until cancelled, or until the engine fails for good (dead_reason says why)."""
        background = {
            asyncio.create_task(self._client_loop(), name="clients"),
            asyncio.create_task(self._drop_silent_clients(), name="silent-clients"),
        }
        try:
            while True:
                reason = await self._run_engine(background)
                if not await self._recover(reason):
                    return
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)

    async def wait_answering(self) -> None:
        """Return once the server has answered: the engine core replied through the serving loop."""
        await self._answering.wait()

    def engine_responsive(self) -> bool:
        """Is the engine making progress (stepping, or idle and answering), or being restarted
        under the supervisor's bounded policy? What the systemd watchdog is fed from."""
        if self.recovering:
            return True
        silent = time.monotonic() - self._last_engine_message
        return self.dead_reason is None and silent < self.config.engine_hang_timeout_s

    def begin_drain(self) -> None:
        """Stop accepting requests (they get a "draining" error); those in flight go on."""
        if not self.draining:
            self.draining = True
            logger.info("draining: refusing new requests; %d in flight", len(self.requests))

    async def wait_drained(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False if some still are after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.requests

    async def fail_all(self, message: str, kind: str) -> None:
        """End every request in flight with this error."""
        for engine_id in list(self.requests):
            request = self._forget(engine_id)
            self.outputs.abort(engine_id)
            await self._send(request.identity, ServerError(request.request_id, message, kind))

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        core = self.engine.core
        if core is not None and core.poll() is None:
            try:
                await self.core_in.send(self.to_core.encode(Shutdown(reason="frontend shutdown")), zmq.NOBLOCK)
                await asyncio.to_thread(core.wait, timeout_s)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                pass
            stop_children([core], timeout_s=5.0)
        self.context.destroy(linger=0)

    async def kill_engine(self) -> None:
        """Take every engine process down at once (second signal, or after a failure)."""
        await self.engine.kill()
        shutil.rmtree(engine_runtime_dir(self.config.runtime_dir, self._generation), ignore_errors=True)

    # ---- the engine: start, run, recover -------------------------------------------------------

    async def _start_engine(self) -> EngineReady:
        """Start a new engine core (which starts its workers) with fresh sockets; wait until ready."""
        self._generation += 1
        runtime_dir = engine_runtime_dir(self.config.runtime_dir, self._generation)
        os.makedirs(runtime_dir, mode=0o700, exist_ok=True)  # left by a killed instance: make_socket checks it
        os.chmod(runtime_dir, 0o700)
        endpoints = InternalEndpoints(runtime_dir)
        hwm = self.config.socket_hwm
        for name in ("core_in", "core_out"):
            if hasattr(self, name):
                getattr(self, name).close(linger=0)
        self.core_in = make_socket(self.context, zmq.PUSH, endpoints.core_input, bind=True, hwm=hwm)
        self.core_out = make_socket(self.context, zmq.PULL, endpoints.core_output, bind=True, hwm=hwm,
                                    max_message_bytes=self.config.internal_max_message_bytes)
        self._core_queue = asyncio.Queue(hwm)
        self.engine.spawn_core(dataclasses.replace(self.config, runtime_dir=runtime_dir))
        ready = await self._wait_ready()
        self.engine.adopt_workers(ready.worker_pids)
        self._last_engine_message = time.monotonic()
        return ready

    async def _wait_ready(self) -> EngineReady:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if await self.core_out.poll(int(self.config.heartbeat_interval_s * 1000)):
                try:
                    message = self.from_core.decode_frames(await self.core_out.recv_multipart())
                except MessageError as error:
                    logger.error("dropped a malformed message from the engine core: %s", error)
                    continue
                if isinstance(message, EngineReady):
                    return message
                if isinstance(message, EngineDead):
                    raise EngineStartError(f"engine failed to start: {message.reason}")
            elif (code := self.engine.core_exit_code()) is not None:
                raise EngineStartError(f"engine core exited with code {code} during start-up")
        raise EngineStartError(f"engine not ready after {self.config.startup_timeout_s:.0f} s")

    async def _run_engine(self, background: set[asyncio.Task]) -> str:
        """Serve with the current engine until it fails; returns the reason."""
        tasks = {
            asyncio.create_task(self._engine_loop(), name="engine"),
            asyncio.create_task(self._send_loop(), name="to-core"),
            asyncio.create_task(self.engine.wait_for_exit(), name="supervise"),
            asyncio.create_task(self._liveness_loop(), name="liveness"),
        }
        try:
            done, _ = await asyncio.wait(tasks | background, return_when=asyncio.FIRST_COMPLETED)
            for task in done - background:
                return task.result()
            for task in done:
                task.result()  # a background task failed: raise its error
            raise RuntimeError("the client loop ended")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _recover(self, reason: str) -> bool:
        """After an engine failure: restart it and replay the requests in flight (True), or end
        them all with an engine_dead error (False: the server cannot go on)."""
        failed_at = time.monotonic()
        logger.error("engine failure: %s; %d request(s) in flight", reason, len(self.requests))
        self.recovering, self._held_while_recovering = True, 0
        await self._answer_calls_locally()
        await self.kill_engine()
        if self.config.on_failure == "fail" or self.draining:
            return await self._give_up(f"engine is dead: {reason}")
        while (delay := self.restart_policy.next_delay()) is not None:
            logger.warning("restarting the engine%s (restart %d of at most %d within %.0f s)",
                           f" in {delay:.0f} s" if delay else "", self.restart_policy.recent_restarts,
                           self.config.max_restarts, self.config.restart_window_s)
            await asyncio.sleep(delay)
            try:
                self.ready = await self._start_engine()
                break
            except EngineStartError as error:
                reason = str(error)
                logger.error("engine restart failed: %s", reason)
                await self.kill_engine()
        else:
            return await self._give_up(
                f"engine is dead: {reason}; gave up after {self.config.max_restarts} restart(s) "
                f"within {self.config.restart_window_s:.0f} s"
            )
        self.recovering = False
        self.num_restarts += 1
        replayed = await self._replay()
        logger.warning("engine recovered in %.2f s: %d request(s) replayed", time.monotonic() - failed_at, replayed)
        return True

    async def _give_up(self, reason: str) -> bool:
        self.dead_reason, self.recovering = reason, False
        logger.error("%s; failing %d request(s)", reason, len(self.requests))
        await self.fail_all(reason, "engine_dead")
        return False

    async def _replay(self) -> int:
        """Send the new engine core every unfinished completion, continued; returns how many
        requests that continues."""
        resend, given_up = self.replay.continuations(self.outputs.received_token_ids)
        for engine_id in given_up:
            request = self._forget(engine_id)
            self.outputs.abort(engine_id)
            reason = f"engine is dead: it failed {_MAX_REPLAYS + 1} times while this request ran; not retried"
            await self._send(request.identity, ServerError(request.request_id, reason, "engine_dead"))
        for message in resend:
            await self._submit(message)
        return len(self.replay)

    async def _liveness_loop(self) -> str:
        """Ping the engine core every heartbeat; an answer proves its busy loop still turns."""
        interval = self.config.heartbeat_interval_s
        while True:
            await self._to_core(UtilityCall(call_id=next(self._call_ids), method="ping"))
            await asyncio.sleep(interval)
            silent = time.monotonic() - self._last_engine_message
            if silent > self.config.engine_hang_timeout_s:
                return f"engine core unresponsive for {silent:.0f} s"

    async def _send_loop(self) -> str:
        """The only writer of core_in: the client loop never blocks on a dead engine."""
        while True:
            message = await self._core_queue.get()
            await self.core_in.send(self.to_core.encode(message))

    async def _to_core(self, message) -> bool:
        """Queue a message for the current engine core; False if the queue is full."""
        try:
            self._core_queue.put_nowait(message)
            return True
        except asyncio.QueueFull:
            return False

    # ---- in-process clients (the HTTP API) ----------------------------------------------------

    def open_local_client(self) -> tuple[bytes, asyncio.Queue]:
        """Register a client living in this process; the server's messages to it (ServerOutput,
        ServerError, ServerStats) arrive on the returned queue. Submit with `submit`."""
        identity = b"local-" + secrets.token_bytes(8)
        inbox: asyncio.Queue = asyncio.Queue()
        self.clients[identity] = _Client(last_seen=time.monotonic(), inbox=inbox)
        return identity, inbox

    async def submit(self, identity: bytes, message: ClientToServer) -> None:
        """Handle a message from a local client exactly as one that came over the socket."""
        await self._dispatch(identity, message)

    async def close_local_client(self, identity: bytes) -> None:
        """Forget a local client and abort its unfinished requests."""
        await self._drop_client(identity, "closed")

    # ---- clients -------------------------------------------------------------------------------

    async def _client_loop(self) -> None:
        while True:
            frames = await self.client_socket.recv_multipart()
            if len(frames) != 2:
                logger.warning("dropped a client message with %d frames (expected 2)", len(frames))
                continue
            identity, body = frames
            client = self.clients.setdefault(identity, _Client(last_seen=time.monotonic()))
            client.last_seen = time.monotonic()
            try:
                message = self.from_clients.decode(body)
            except MessageError as error:
                logger.warning("malformed client message: %s", error)
                await self._send(identity, ServerError(request_id=None, message=f"malformed message: {error}"))
                continue
            try:
                await self._dispatch(identity, message)
            except Exception as error:  # one bad request must never take the server down
                logger.exception("failed to handle a client message")
                request_id = getattr(message, "request_id", None)
                await self._send(identity, ServerError(request_id, f"internal error: {type(error).__name__}", "internal"))

    async def _dispatch(self, identity: bytes, message) -> None:
        if not self._authorized(identity, message):
            request_id, call_id = getattr(message, "request_id", None), getattr(message, "call_id", None)
            error = "unauthorized: missing or wrong api_key"
            await self._send(identity, ServerError(request_id, error, "unauthorized", call_id))
        elif isinstance(message, ClientGenerate):
            await self._add_request(identity, message)
        elif isinstance(message, ClientAbort):
            await self._abort([self._engine_id(identity, message.request_id)])
        elif isinstance(message, ClientPing):
            await self._send(identity, ServerPong())
        elif isinstance(message, ClientStats):
            await self._stats(identity, message.call_id)
        elif isinstance(message, ClientUtility):
            await self._call_utility(identity, message)

    def _authorized(self, identity: bytes, message) -> bool:
        """Requests and calls must carry the api key, if there is one (pings and aborts of one's
        own requests need none). A local client (the HTTP API) checked the key itself."""
        client = self.clients.get(identity)
        if self.config.api_key is None or not isinstance(message, (ClientGenerate, ClientStats, ClientUtility)):
            return True
        if client is not None and client.inbox is not None:
            return True
        given = (message.api_key or "").encode()
        return message.api_key is not None and hmac.compare_digest(given, self.config.api_key.encode())

    async def _stats(self, identity: bytes, client_call_id: int) -> None:
        call_id = next(self._call_ids)
        if self.recovering or not await self._to_core(UtilityCall(call_id=call_id, method="stats")):
            await self._send(identity, ServerStats(call_id=client_call_id, stats=self._server_stats()))
            return
        self.stats_waiters[call_id] = (identity, client_call_id)

    def _server_stats(self) -> dict:
        state = "draining" if self.draining else "recovering" if self.recovering else "serving"
        return {"state": state, "engine_restarts": self.num_restarts, "num_requests": len(self.requests)}

    async def _call_utility(self, identity: bytes, message: ClientUtility) -> None:
        if message.method not in _CLIENT_UTILITIES:
            error = f"method: {message.method!r} is not one of {list(_CLIENT_UTILITIES)}"
            await self._send(identity, ServerUtilityResult(call_id=message.call_id, error=error))
            return
        call_id = next(self._call_ids)
        if self.recovering or not await self._to_core(UtilityCall(call_id=call_id, method=message.method)):
            error = "the engine is restarting after a failure; retry later"
            await self._send(identity, ServerUtilityResult(call_id=message.call_id, error=error))
            return
        self.utility_waiters[call_id] = (identity, message.call_id)

    async def _add_request(self, identity: bytes, message: ClientGenerate) -> None:
        engine_id = self._engine_id(identity, message.request_id)
        refusal = self._refusal()
        if refusal is not None:
            await self._send(identity, ServerError(message.request_id, *refusal))
            return
        try:
            if engine_id in self.requests:
                raise ValueError(f"request_id: {message.request_id!r} is already in use by this client")
            sampling = convert(message.sampling, SamplingParams)
            add, text = self.processor.process(
                engine_id, self._prompt(message), sampling, priority=message.priority, cache_salt=message.cache_salt
            )
            core_messages = self.outputs.add_request(add, text)  # n > 1: n children
        except ValueError as error:
            await self._send(identity, ServerError(message.request_id, str(error)))
            return
        holdback = max((len(s) for s in sampling.stop_strings), default=1) - 1
        sent = [_Sent() for _ in range(sampling.n)]
        self.requests[engine_id] = _ClientRequest(identity, message.request_id, holdback, sent)
        self.clients[identity].requests.add(engine_id)
        self.metrics.request_added(engine_id, len(add.prompt_token_ids))
        self.replay.record(engine_id, core_messages)
        if self.recovering:
            self._held_while_recovering += 1  # sent with the replayed requests once the engine is back
            return
        for core_message in core_messages:
            await self._submit(core_message)

    def _refusal(self) -> tuple[str, str] | None:
        """(message, kind) when no request can be taken now."""
        if self.dead_reason is not None:
            return f"engine is dead: {self.dead_reason}", "engine_dead"
        if self.draining:
            return "server is shutting down: not accepting new requests; retry on another server or later", "draining"
        if self.recovering and self._held_while_recovering >= self.config.max_waiting:
            return (f"overloaded: the engine is restarting and {self._held_while_recovering} requests already wait "
                    f"for it (max_waiting={self.config.max_waiting}); retry later", "overloaded")
        return None

    async def _submit(self, core_message: AddRequest) -> None:
        if not await self._to_core(core_message):
            message = "overloaded: the engine core is not keeping up with its input queue; retry later"
            await self._fail(core_message.request_id, message, "overloaded")

    def _prompt(self, message: ClientGenerate):
        given = [x is not None for x in (message.prompt, message.prompt_token_ids, message.messages)]
        if sum(given) != 1:
            raise ValueError("prompt: give exactly one of prompt, prompt_token_ids or messages")
        if message.messages is not None:
            return chat_prompt(self.tokenizer, message.messages, message.add_generation_prompt)
        if message.prompt_token_ids is not None:
            return {"prompt_token_ids": message.prompt_token_ids}
        return message.prompt

    @staticmethod
    def _engine_id(identity: bytes, request_id: str) -> str:
        return f"{identity.hex()}/{request_id}"

    async def _send(self, identity: bytes, message) -> bool:
        """Send to one client; False (and its requests aborted) if it is gone."""
        client = self.clients.get(identity)
        if client is not None and client.inbox is not None:
            client.inbox.put_nowait(message)
            return True
        try:
            await self.client_socket.send_multipart([identity, self.to_clients.encode(message)])
            return True
        except zmq.ZMQError as error:
            if error.errno != errno.EHOSTUNREACH:
                raise
            await self._drop_client(identity, "disconnected")
            return False

    async def _drop_client(self, identity: bytes, why: str) -> None:
        client = self.clients.pop(identity, None)
        if client and client.requests:
            logger.info("client %s %s: aborting %d request(s)", identity.hex(), why, len(client.requests))
            await self._abort(list(client.requests))

    async def _abort(self, engine_ids: list[str]) -> None:
        core_ids = []
        for engine_id in [i for i in engine_ids if i in self.requests]:
            self._forget(engine_id)
            core_ids += self.outputs.core_request_ids(engine_id)
            self.outputs.abort(engine_id)
        if core_ids and not self.recovering:
            await self._to_core(AbortRequests(request_ids=core_ids))

    def _forget(self, engine_id: str) -> _ClientRequest | None:
        request = self.requests.pop(engine_id, None)
        self.replay.forget(engine_id)
        self.metrics.request_ended(engine_id)
        if request is not None and request.identity in self.clients:
            self.clients[request.identity].requests.discard(engine_id)
        return request

    async def _drop_silent_clients(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            cutoff = time.monotonic() - self.config.client_timeout_s
            for identity in [i for i, c in self.clients.items() if c.inbox is None and c.last_seen < cutoff]:
                await self._drop_client(identity, f"silent for over {self.config.client_timeout_s:.0f} s")

    # ---- client endpoint security --------------------------------------------------------------

    def _start_authenticator(self, keys: ServerKeys) -> None:
        # With no client key on file, any CURVE client gets through the handshake and each
        # request is then checked against the api key (client_endpoint_keys requires one then).
        check = ClientKeyCheck(keys.clients_dir, allow_any_when_empty=self.config.api_key is not None)
        self._authenticator = start_authenticator(self.context, check)

    # ---- engine core ---------------------------------------------------------------------------

    async def _engine_loop(self) -> str:
        while True:
            frames = await self.core_out.recv_multipart()
            try:
                message = self.from_core.decode_frames(frames)
            except MessageError as error:
                logger.error("dropped a malformed message from the engine core: %s", error)
                continue
            self._last_engine_message = time.monotonic()
            if isinstance(message, EngineOutputs):
                await self._deliver(message)
            elif isinstance(message, UtilityResult):
                self._answering.set()
                await self._answer_utility(message)
            elif isinstance(message, EngineDead):
                return f"engine core reported: {message.reason}"

    async def _deliver(self, message: EngineOutputs) -> None:
        for failures, kind in ((message.failed, "bad_request"), (message.rejected, "overloaded")):
            for core_id, reason in failures.items():
                await self._fail(core_id, reason, kind)
        for delta in message.outputs:
            if delta.finish_reason == "error":  # failed on the workers, alone; process() skips it now
                await self._fail(delta.request_id, f"the engine failed this request: {delta.error}", "internal")
        outputs, to_abort = self.outputs.process(message.outputs)
        if to_abort:
            await self._to_core(AbortRequests(request_ids=to_abort))
        for output in outputs:
            request = self.requests.get(output.request_id)
            if request is not None:
                await self._send_deltas(request, output)

    async def _fail(self, core_id: str, reason: str, kind: str = "bad_request") -> None:
        """The core refused one of a request's completions: the whole request fails."""
        engine_id = self.outputs.request_id_of(core_id)
        if engine_id is None:
            return
        siblings = [i for i in self.outputs.core_request_ids(engine_id) if i != core_id]
        self.outputs.abort(engine_id)
        if siblings:
            await self._to_core(AbortRequests(request_ids=siblings))
        request = self._forget(engine_id)
        if request is not None:
            await self._send(request.identity, ServerError(request.request_id, reason, kind))

    async def _send_deltas(self, request: _ClientRequest, output: RequestOutput) -> None:
        """One ServerOutput per completion that advanced; the last one says if the request ended."""
        deltas = [d for c in output.outputs if (d := self._completion_delta(request, output, c)) is not None]
        finish_reason = (output.outputs[0].finish_reason or "stop") if output.finished else None
        self.metrics.tokens_generated(output.request_id, sum(len(d.token_ids) for d in deltas), finish_reason)
        if output.finished:
            self._forget(output.request_id)
            if deltas:
                deltas[-1].finished = True
        for delta in deltas:
            await self._send(request.identity, delta)

    def _completion_delta(
        self, request: _ClientRequest, output: RequestOutput, completion: CompletionOutput
    ) -> ServerOutput | None:
        sent = request.sent[completion.index]
        if sent.finished or (len(completion.token_ids) == sent.tokens and not completion.finished):
            return None
        text = completion.text
        visible = text if completion.finished else text[: len(text) - request.holdback]
        first = not request.sent_prompt
        # Prompt logprobs come with completion 0's first token, which may not be the first sent.
        prompt_logprobs = None if request.sent_prompt_logprobs else output.prompt_logprobs
        delta = ServerOutput(
            request_id=request.request_id,
            text=visible[sent.text :],
            token_ids=completion.token_ids[sent.tokens :],
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            prompt_token_ids=output.prompt_token_ids if first else None,
            index=completion.index,
            logprobs=None if completion.logprobs is None else completion.logprobs[sent.logprobs :],
            prompt_logprobs=prompt_logprobs,
            cumulative_logprob=completion.cumulative_logprob,
            num_cached_tokens=output.num_cached_tokens,
        )
        request.sent_prompt = True
        request.sent_prompt_logprobs = prompt_logprobs is not None or request.sent_prompt_logprobs
        sent.text = max(sent.text, len(visible))
        sent.tokens = len(completion.token_ids)
        sent.logprobs = len(completion.logprobs or ())
        sent.finished = completion.finished
        return delta

    async def _answer_utility(self, result: UtilityResult) -> None:
        if (waiter := self.stats_waiters.pop(result.call_id, None)) is not None:
            identity, call_id = waiter
            stats = {**(result.result or {}), **self._server_stats()}
            await self._send(identity, ServerStats(call_id=call_id, stats=stats))
        elif (waiter := self.utility_waiters.pop(result.call_id, None)) is not None:
            identity, call_id = waiter
            await self._send(identity, ServerUtilityResult(call_id=call_id, result=result.result, error=result.error))

    async def _answer_calls_locally(self) -> None:
        """Calls the failed engine will never answer: stats get the frontend's own view, other
        utilities an error."""
        waiters, self.stats_waiters = self.stats_waiters, {}
        for identity, call_id in waiters.values():
            await self._send(identity, ServerStats(call_id=call_id, stats=self._server_stats()))
        waiters, self.utility_waiters = self.utility_waiters, {}
        for identity, call_id in waiters.values():
            error = "the engine failed before answering; retry later"
            await self._send(identity, ServerUtilityResult(call_id=call_id, error=error))
