"""The frontend process: owns the tokenizer and the client endpoint, spawns the engine core(s).

    clients --DEALER--> [client endpoint] ROUTER  frontend  PUSH --> [core-input]  --> core
    clients <---------- deltas ---------- ROUTER  frontend  PULL <-- [core-output] <-- core
                                                     (one such pair per data-parallel engine)

Clients speak the map-encoded Client*/Server* messages of zllm.ipc.messages. Each request is
validated here (errors go back to that client only), streamed back as text/token deltas (text
that could still turn into a stop string is held back until it can't), and aborted in the core
when its client cancels, vanishes (a send to it fails) or falls silent past client_timeout_s.
The OpenAI HTTP API (zllm/frontend/openai/) is a client inside this process: `open_local_client`.

With --data-parallel-size N the frontend drives N engines (zllm/frontend/engines.py), and each
new request goes to the least loaded one that is up (zllm/frontend/router.py); stats and utility
calls go to every engine, and their answers are merged (zllm/frontend/engine_calls.py).

Engine failures (zllm/frontend/engines.py watches each core and every worker): with
on_failure="restart" the failed engine alone is killed, restarted with back-off, and each of its
requests in flight is re-sent as a continuation of what its client already received
(zllm/frontend/replay.py), so streams simply go on; the other engines serve on meanwhile. With
on_failure="fail", or once an engine's crash loop gives up, every request ends with an
engine_dead error. Each engine start gets its own sockets in its own runtime subdirectory, so
nothing from a dead core can reach its successor.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from zllm.config import EngineConfig
from zllm.frontend.engine_calls import EngineCalls
from zllm.frontend.engine_start import CoreStartError
from zllm.frontend.engines import MAX_REPLAYS, EngineLink
from zllm.frontend.metrics import FrontendMetrics
from zllm.frontend.nodes import NodeFailureError, NodeHub
from zllm.frontend.output_processor import OutputProcessor
from zllm.frontend.processor import InputProcessor
from zllm.frontend.router import LoadBalancer
from zllm.frontend.tokenizer import chat_prompt, load_tokenizer
from zllm.ipc.addresses import default_client_endpoint
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
    EngineOutputs,
    EngineReady,
    ServerError,
    ServerOutput,
    ServerPong,
    ServerToClient,
    UtilityResult,
)
from zllm.ipc.sockets import make_socket
from zllm.lora import LoRARequest
from zllm.outputs import CompletionOutput, RequestOutput
from zllm.pooling import POOLING_SAMPLING, PoolingParams
from zllm.procs.racing import race
from zllm.sampling_params import SamplingParams

logger = logging.getLogger("zllm.frontend")
_FINAL_MESSAGES_LINGER_MS = 2000  # at shutdown, how long queued messages to clients may take to leave


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
    request_id: str  # the client's id; the server's key (and the engine's id) is identity-prefixed
    holdback: int  # characters of text withheld while a stop string could still match
    sent: list[_Sent]  # one per completion (n)
    engine: EngineLink  # the data-parallel engine that serves it
    sent_prompt: bool = False
    sent_prompt_logprobs: bool = False


@dataclass(slots=True)
class _Client:
    last_seen: float
    requests: set[str] = field(default_factory=set)  # the keys of its requests in flight
    # A client inside this process (the HTTP API): its messages go to this queue, not the socket,
    # and it is never timed out for silence (it closes itself).
    inbox: asyncio.Queue | None = None


class FrontendServer:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.client_endpoint = config.client_endpoint or default_client_endpoint()
        self.tokenizer = load_tokenizer(config.tokenizer_path, config.skip_tokenizer_init)
        self.processor = InputProcessor.from_config(config, self.tokenizer)
        self.outputs = OutputProcessor(self.tokenizer, config.pooler)
        self.context = zmq.asyncio.Context()
        self.client_socket: zmq.asyncio.Socket | None = None  # bound once the engines are ready
        self.from_clients: Codec = Codec(ClientToServer)
        self.to_clients: Codec = Codec(ServerToClient)
        self.requests: dict[str, _ClientRequest] = {}  # by request key (_request_key)
        self.clients: dict[bytes, _Client] = {}
        call_ids = itertools.count()  # engine utility call ids, unique across engines
        self.nodes = NodeHub(config) if config.nnodes > 1 else None
        self.engines = [
            EngineLink(config, rank, self.context, call_ids, self._nodes_of(rank))
            for rank in config.frontend_dp_ranks  # all of them, or this API server's share
        ]
        self.calls = EngineCalls(self.engines, call_ids, self._send, self._server_stats)
        self.balancer = LoadBalancer(len(self.engines), config.block_size)
        self.dead_reason: str | None = None
        self.draining = False  # a graceful shutdown began: new requests are refused (/health: 503)
        self.metrics = FrontendMetrics(config.model_name)
        self._answering = asyncio.Event()

    def _nodes_of(self, dp_rank: int) -> NodeHub | None:
        """The hub, for an engine that runs (partly) on other nodes."""
        if self.nodes is not None and (self.config.tp_spans_nodes or self.config.node_of_engine(dp_rank) != 0):
            return self.nodes
        return None

    @property
    def ready(self) -> EngineReady | None:
        """Engine 0's EngineReady (every data-parallel engine serves the same model and shape)."""
        return self.engines[0].ready

    @property
    def recovering(self) -> bool:
        """No engine can take a request now: every one is being restarted after a failure."""
        return all(engine.recovering for engine in self.engines)

    @property
    def num_restarts(self) -> int:
        return sum(engine.num_restarts for engine in self.engines)

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> EngineReady:
        # Before the model loads, so that a key problem fails fast.
        keys = client_endpoint_keys(self.client_endpoint, self.config.curve_dir, self.config.api_key)
        if self.nodes is not None:
            self.nodes.open()
            try:
                await self.nodes.wait_joined()
            except NodeFailureError as error:
                raise CoreStartError(str(error)) from None
        for engine in self.engines:
            await engine.spawn()  # all at once: the engines load their models side by side
        await asyncio.gather(*(engine.wait_ready() for engine in self.engines))
        if keys is not None:
            self._start_authenticator(keys)
        self.client_socket = make_socket(
            self.context,
            zmq.ROUTER,
            self.client_endpoint,
            bind=True,
            hwm=self.config.socket_hwm,
            router_mandatory=True,
            curve_server_keys=keys,
            max_message_bytes=self.config.client_max_message_bytes,
        )
        engines = f" ({len(self.engines)} data-parallel engines)" if len(self.engines) > 1 else ""
        logger.info("serving %s on %s%s%s", self.ready.model, self.client_endpoint, " (CURVE)" if keys else "", engines)
        return self.ready

    async def serve(self) -> None:
        """Serve until cancelled, or until an engine fails for good (dead_reason says why)."""
        background = {
            asyncio.create_task(self._client_loop(), name="clients"),
            asyncio.create_task(self._drop_silent_clients(), name="silent-clients"),
        }
        supervisors = {asyncio.create_task(self._supervise(engine), name=engine.name) for engine in self.engines}
        done = await race(*background, *supervisors)
        for task in done:
            task.result()  # a background task failed: raise its error
        if not done & supervisors:
            raise RuntimeError("the client loop ended")

    async def wait_answering(self) -> None:
        """Return once the server has answered: an engine core replied through the serving loop."""
        await self._answering.wait()

    def engine_responsive(self) -> bool:
        """Is every engine making progress (stepping, or idle and answering), or being restarted
        under the supervisor's bounded policy? What the systemd watchdog is fed from."""
        return self.dead_reason is None and all(engine.responsive() for engine in self.engines)

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

    async def fail_all(self, message: str, kind: str, engine: EngineLink | None = None) -> None:
        """End every request in flight (on `engine`, or on any) with this error."""
        for request_key in [i for i, r in self.requests.items() if engine is None or r.engine is engine]:
            request = self._forget(request_key)
            self.outputs.abort(request_key)
            await self._send(request.identity, ServerError(request.request_id, message, kind))

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        await asyncio.gather(*(engine.shutdown(timeout_s) for engine in self.engines))
        if self.nodes is not None:
            await self.nodes.close("the head shut down")
        # The last errors (engine dead, shutting down) are queued on the client socket just before
        # this: give them a moment to reach the clients, where linger 0 would drop them.
        if self.client_socket is not None:
            self.client_socket.close(linger=_FINAL_MESSAGES_LINGER_MS)
        self.context.destroy(linger=0)

    async def kill_engine(self) -> None:
        """Take every engine process down at once (second signal, or after a failure)."""
        await asyncio.gather(*(engine.kill() for engine in self.engines))

    # ---- the engines: run, recover -------------------------------------------------------------

    async def _supervise(self, engine: EngineLink) -> None:
        """Serve with this engine, restarting it after each failure; return when it failed for
        good (the whole server then gives up: dead_reason)."""
        while True:
            reason = await engine.run(self._on_engine_message)
            if not await self._recover(engine, reason):
                return

    async def _on_engine_message(self, engine: EngineLink, message) -> None:
        if isinstance(message, EngineOutputs):
            self.balancer.report(self._slot(engine), message.num_waiting, message.num_running)
            await self._deliver(engine, message)
        elif isinstance(message, UtilityResult):
            self._answering.set()
            await self.calls.answer(engine, message)

    async def _recover(self, engine: EngineLink, reason: str) -> bool:
        """After an engine failure: restart that engine and replay its requests in flight (True),
        or end every request with an engine_dead error (False: the server cannot go on). The
        other engines serve on meanwhile."""
        failed_at = time.monotonic()
        logger.error("%s failure: %s; %d request(s) in flight", engine.name, reason, len(engine.replay))
        engine.recovering, engine.held_while_recovering = True, 0
        await self.calls.engine_failed(engine)
        await engine.kill()
        if self.config.on_failure == "fail" or self.draining:
            return await self._give_up(f"{engine.name} is dead: {reason}")
        while (delay := engine.restart_policy.next_delay()) is not None:
            logger.warning(
                "restarting the %s%s (restart %d of at most %d within %.0f s)",
                engine.name,
                f" in {delay:.0f} s" if delay else "",
                engine.restart_policy.recent_restarts,
                self.config.max_restarts,
                self.config.restart_window_s,
            )
            await asyncio.sleep(delay)
            try:
                await engine.start()
                break
            except CoreStartError as error:
                reason = str(error)
                logger.error("%s restart failed: %s", engine.name, reason)
                await engine.kill()
        else:
            return await self._give_up(
                f"{engine.name} is dead: {reason}; gave up after {self.config.max_restarts} restart(s) "
                f"within {self.config.restart_window_s:.0f} s"
            )
        engine.recovering = False
        engine.num_restarts += 1
        replayed = await self._replay(engine)
        logger.warning(
            "%s recovered in %.2f s: %d request(s) replayed", engine.name, time.monotonic() - failed_at, replayed
        )
        return True

    async def _give_up(self, reason: str) -> bool:
        self.dead_reason = reason
        logger.error("%s; failing %d request(s)", reason, len(self.requests))
        await self.fail_all(reason, "engine_dead")
        for engine in self.engines:
            engine.recovering = False
        return False

    async def _replay(self, engine: EngineLink) -> int:
        """Send the restarted engine core every unfinished completion it had, continued; returns
        how many requests that continues."""
        resend, given_up = engine.replay.continuations(self.outputs.received_token_ids)
        for request_key in given_up:
            request = self._forget(request_key)
            self.outputs.abort(request_key)
            reason = f"engine is dead: it failed {MAX_REPLAYS + 1} times while this request ran; not retried"
            await self._send(request.identity, ServerError(request.request_id, reason, "engine_dead"))
        for message in resend:
            await self._submit(engine, message)
        return len(engine.replay)

    # ---- in-process clients (the HTTP API) ----------------------------------------------------

    def open_local_client(self) -> tuple[bytes, asyncio.Queue]:
        """Register a client living in this process; the server's messages to it (ServerOutput,
        ServerError, ServerStats) arrive on the returned queue. Submit with `submit`."""
        identity = b"local-" + secrets.token_bytes(8)
        inbox: asyncio.Queue = asyncio.Queue()
        self.clients[identity] = _Client(last_seen=time.monotonic(), inbox=inbox)
        return identity, inbox

    async def submit(self, identity: bytes, message: ClientToServer, mm_inputs: list | None = None) -> None:
        """Handle a message from a local client exactly as one that came over the socket.
        mm_inputs: the images of a ClientGenerate whose prompt_token_ids hold their expanded
        placeholders (the HTTP API processed them)."""
        await self._dispatch(identity, message, mm_inputs)

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
                await self._send(
                    identity, ServerError(request_id, f"internal error: {type(error).__name__}", "internal")
                )

    async def _dispatch(self, identity: bytes, message, mm_inputs: list | None = None) -> None:
        if not self._authorized(identity, message):
            request_id, call_id = getattr(message, "request_id", None), getattr(message, "call_id", None)
            error = "unauthorized: missing or wrong api_key"
            await self._send(identity, ServerError(request_id, error, "unauthorized", call_id))
        elif isinstance(message, ClientGenerate):
            await self._add_request(identity, message, mm_inputs)
        elif isinstance(message, ClientAbort):
            await self._abort([self._request_key(identity, message.request_id)])
        elif isinstance(message, ClientPing):
            await self._send(identity, ServerPong())
        elif isinstance(message, ClientStats):
            await self.calls.stats(identity, message.call_id)
        elif isinstance(message, ClientUtility):
            await self.calls.utility(identity, message)

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

    def _server_stats(self) -> dict:
        """The frontend's own part of every stats answer."""
        state = "draining" if self.draining else "recovering" if self.recovering else "serving"
        stats = {"state": state, "engine_restarts": self.num_restarts, "num_requests": len(self.requests)}
        if len(self.engines) > 1:
            stats["engines_recovering"] = [engine.dp_rank for engine in self.engines if engine.recovering]
        return stats

    async def _add_request(self, identity: bytes, message: ClientGenerate, mm_inputs: list | None = None) -> None:
        request_key = self._request_key(identity, message.request_id)
        refusal = self._refusal()
        if refusal is not None:
            await self._send(identity, ServerError(message.request_id, *refusal))
            return
        try:
            if request_key in self.requests:
                raise ValueError(f"request_id: {message.request_id!r} is already in use by this client")
            pooling = None if message.pooling is None else convert(message.pooling, PoolingParams)
            sampling = POOLING_SAMPLING if pooling is not None else convert(message.sampling, SamplingParams)
            prompt = self._prompt(message)
            if mm_inputs:
                prompt = {"prompt_token_ids": message.prompt_token_ids, "mm_inputs": mm_inputs}
            add, text = self.processor.process(
                request_key,
                prompt,
                sampling,
                priority=message.priority,
                cache_salt=message.cache_salt,
                pooling=pooling,
                lora_request=self._lora_request(message.lora_name),
            )
            core_messages = self.outputs.add_request(add, text)  # n > 1: n children
        except ValueError as error:
            await self._send(identity, ServerError(message.request_id, str(error)))
            return
        holdback = max((len(s) for s in sampling.stop_strings), default=1) - 1
        sent = [_Sent() for _ in range(sampling.n)]
        engine = self._choose_engine(add, len(core_messages))
        self.requests[request_key] = _ClientRequest(identity, message.request_id, holdback, sent, engine)
        self.clients[identity].requests.add(request_key)
        self.metrics.request_added(request_key, len(add.prompt_token_ids))
        engine.replay.record(request_key, core_messages)
        if engine.recovering:
            engine.held_while_recovering += 1  # sent with the replayed requests once the engine is back
            return
        for core_message in core_messages:
            await self._submit(engine, core_message)

    def _lora_request(self, name: str | None) -> LoRARequest | None:
        """The served adapter of that name (None: the base model); ValueError for an unknown one."""
        if name is None:
            return None
        adapters = self.processor.adapters
        lora = adapters.resolve(name) if adapters is not None else None
        if lora is None:
            raise ValueError(f"model: no LoRA adapter named {name!r} is served")
        return lora

    def _choose_engine(self, add: AddRequest, count: int) -> EngineLink:
        """The least loaded engine that is up (all being restarted: the least loaded one)."""
        live = [self._slot(engine) for engine in self.engines if not engine.recovering] or None
        return self.engines[self.balancer.choose(add.prompt_token_ids, add.cache_salt, live, count)]

    def _slot(self, engine: EngineLink) -> int:
        """The engine's index in self.engines (the balancer's numbering): its dp rank less the
        first one this frontend drives (not 0 behind API server k > 0)."""
        return engine.dp_rank - self.engines[0].dp_rank

    def _refusal(self) -> tuple[str, str] | None:
        """(message, kind) when no request can be taken now."""
        if self.dead_reason is not None:
            return f"engine is dead: {self.dead_reason}", "engine_dead"
        if self.draining:
            return "server is shutting down: not accepting new requests; retry on another server or later", "draining"
        held = min(engine.held_while_recovering for engine in self.engines)
        if self.recovering and held >= self.config.max_waiting:
            return (
                f"overloaded: the engine is restarting and {held} requests already wait "
                f"for it (max_waiting={self.config.max_waiting}); retry later",
                "overloaded",
            )
        return None

    async def _submit(self, engine: EngineLink, core_message: AddRequest) -> None:
        if not engine.send(core_message):
            message = "overloaded: the engine core is not keeping up with its input queue; retry later"
            await self._fail(engine, core_message.request_id, message, "overloaded")

    def _prompt(self, message: ClientGenerate):
        given = [x is not None for x in (message.prompt, message.prompt_token_ids, message.messages)]
        if sum(given) != 1:
            raise ValueError("prompt: give exactly one of prompt, prompt_token_ids or messages")
        if message.messages is not None:
            return chat_prompt(self.tokenizer, message.messages, message.add_generation_prompt)
        if message.prompt_pair is not None:
            truncate = (message.pooling or {}).get("truncate_prompt_tokens")
            return self.processor.tokenize_pair(message.prompt, message.prompt_pair, truncate)
        if message.prompt_token_ids is not None:
            return {"prompt_token_ids": message.prompt_token_ids}
        return message.prompt

    @staticmethod
    def _request_key(identity: bytes, request_id: str) -> str:
        """A request's key: its client's identity and the client's own id, so clients cannot
        collide; the id the output processor and the engine cores know the request by."""
        return f"{identity.hex()}/{request_id}"

    async def _send(self, identity: bytes, message) -> bool:
        """Send to one client; False (and its requests aborted) if it is gone."""
        client = self.clients.get(identity)
        if client is not None and client.inbox is not None:
            client.inbox.put_nowait(message)
            return True
        try:
            # Never wait for one client: every client shares this socket, and the engine's output
            # loop is what calls here, so a parked send would stall every stream.
            await self.client_socket.send_multipart([identity, self.to_clients.encode(message)], zmq.NOBLOCK)
            return True
        except zmq.Again:
            await self._drop_client(identity, f"not reading ({self.config.socket_hwm} messages queued for it)")
            return False
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

    async def _abort(self, request_keys: list[str]) -> None:
        core_ids: dict[EngineLink, list[str]] = {}
        for request_key in [i for i in request_keys if i in self.requests]:
            request = self._forget(request_key)
            core_ids.setdefault(request.engine, []).extend(self.outputs.core_request_ids(request_key))
            self.outputs.abort(request_key)
        for engine, ids in core_ids.items():
            if ids and not engine.recovering:
                engine.send(AbortRequests(request_ids=ids))

    def _forget(self, request_key: str) -> _ClientRequest | None:
        request = self.requests.pop(request_key, None)
        self.metrics.request_ended(request_key)
        if request is not None:
            request.engine.replay.forget(request_key)
            if request.identity in self.clients:
                self.clients[request.identity].requests.discard(request_key)
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

    async def _deliver(self, engine: EngineLink, message: EngineOutputs) -> None:
        for failures, kind in ((message.failed, "bad_request"), (message.rejected, "overloaded")):
            for core_id, reason in failures.items():
                await self._fail(engine, core_id, reason, kind)
        for delta in message.outputs:
            if delta.finish_reason == "error":  # failed on the workers, alone; process() skips it now
                await self._fail(engine, delta.request_id, f"the engine failed this request: {delta.error}", "internal")
        # copy=False: _send_deltas takes the new part of each output before anything else runs.
        outputs, to_abort = self.outputs.process(message.outputs, copy=False)
        if to_abort:
            engine.send(AbortRequests(request_ids=to_abort))
        for output in outputs:
            request = self.requests.get(output.request_id)
            if request is not None:
                await self._send_deltas(request, output)

    async def _fail(self, engine: EngineLink, core_id: str, reason: str, kind: str = "bad_request") -> None:
        """The core refused one of a request's completions: the whole request fails."""
        request_key = self.outputs.request_id_of(core_id)
        if request_key is None:
            return
        siblings = [i for i in self.outputs.core_request_ids(request_key) if i != core_id]
        self.outputs.abort(request_key)
        if siblings:
            engine.send(AbortRequests(request_ids=siblings))
        request = self._forget(request_key)
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
            pooled=output.pooled,
        )
        request.sent_prompt = True
        request.sent_prompt_logprobs = prompt_logprobs is not None or request.sent_prompt_logprobs
        sent.text = max(sent.text, len(visible))
        sent.tokens = len(completion.token_ids)
        sent.logprobs = len(completion.logprobs or ())
        sent.finished = completion.finished
        return delta
