"""The frontend process: owns the tokenizer and the client endpoint, spawns the engine core.

    clients --DEALER--> [client endpoint] ROUTER  frontend  PUSH --> [core-input]  --> core
    clients <---------- deltas ---------- ROUTER  frontend  PULL <-- [core-output] <-- core

Clients speak the map-encoded Client*/Server* messages of zllm.ipc.messages. Each request is
validated here (errors go back to that client only), streamed back as text/token deltas (text
that could still turn into a stop string is held back until it can't), and aborted in the core
when its client cancels, vanishes (a send to it fails) or falls silent past client_timeout_s.
The OpenAI HTTP API (api_server.py) is a client inside this process: `open_local_client`.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import secrets
import subprocess
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from zllm.config import EngineConfig
from zllm.frontend.metrics import FrontendMetrics
from zllm.frontend.output_processor import OutputProcessor
from zllm.frontend.processor import InputProcessor
from zllm.frontend.tokenizer import chat_prompt, load_tokenizer
from zllm.ipc.addresses import InternalEndpoints, default_client_endpoint
from zllm.ipc.codec import Codec, MessageError, convert
from zllm.ipc.messages import (
    AbortRequests,
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
from zllm.launch.children import spawn_child, stop_children
from zllm.outputs import CompletionOutput, RequestOutput
from zllm.sampling_params import SamplingParams

logger = logging.getLogger("zllm.frontend")


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
        self.core_process: subprocess.Popen | None = None
        self.ready: EngineReady | None = None
        self.dead_reason: str | None = None
        self.draining = False  # shutting down gracefully: /health answers 503
        self.metrics = FrontendMetrics(config.model_name)

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> EngineReady:
        endpoints = InternalEndpoints(self.config.runtime_dir)
        hwm = self.config.socket_hwm
        self.core_in = make_socket(self.context, zmq.PUSH, endpoints.core_input, bind=True, hwm=hwm)
        self.core_out = make_socket(self.context, zmq.PULL, endpoints.core_output, bind=True, hwm=hwm)
        self.core_process = spawn_child("zllm.enginecore.process", self.config)
        self.ready = await self._wait_ready()
        self.client_socket = make_socket(
            self.context, zmq.ROUTER, self.client_endpoint, bind=True, hwm=hwm, router_mandatory=True
        )
        logger.info("serving %s on %s", self.ready.model, self.client_endpoint)
        return self.ready

    async def _wait_ready(self) -> EngineReady:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if await self.core_out.poll(int(self.config.heartbeat_interval_s * 1000)):
                message = self.from_core.decode_frames(await self.core_out.recv_multipart())
                if isinstance(message, EngineReady):
                    return message
                if isinstance(message, EngineDead):
                    raise EngineStartError(f"engine failed to start: {message.reason}")
            elif self.core_process.poll() is not None:
                raise EngineStartError(f"engine core exited with code {self.core_process.returncode} during start-up")
        raise EngineStartError(f"engine not ready after {self.config.startup_timeout_s:.0f} s")

    async def serve(self) -> None:
        """Serve until the engine core dies (then fail every request) or the task is cancelled."""
        tasks = [
            asyncio.create_task(self._client_loop(), name="clients"),
            asyncio.create_task(self._engine_loop(), name="engine"),
            asyncio.create_task(self._watch(), name="watch"),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        if self.core_process is not None and self.core_process.poll() is None:
            try:
                await self.core_in.send(self.to_core.encode(Shutdown(reason="frontend shutdown")))
                await asyncio.to_thread(self.core_process.wait, timeout_s)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                pass
            stop_children([self.core_process], timeout_s=5.0)
        self.context.destroy(linger=0)

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
        if isinstance(message, ClientGenerate):
            await self._add_request(identity, message)
        elif isinstance(message, ClientAbort):
            await self._abort([self._engine_id(identity, message.request_id)])
        elif isinstance(message, ClientPing):
            await self._send(identity, ServerPong())
        elif isinstance(message, ClientStats):
            call_id = next(self._call_ids)
            self.stats_waiters[call_id] = (identity, message.call_id)
            await self.core_in.send(self.to_core.encode(UtilityCall(call_id=call_id, method="stats")))
        elif isinstance(message, ClientUtility):
            await self._call_utility(identity, message)

    async def _call_utility(self, identity: bytes, message: ClientUtility) -> None:
        if message.method not in _CLIENT_UTILITIES:
            error = f"method: {message.method!r} is not one of {list(_CLIENT_UTILITIES)}"
            await self._send(identity, ServerUtilityResult(call_id=message.call_id, error=error))
            return
        call_id = next(self._call_ids)
        self.utility_waiters[call_id] = (identity, message.call_id)
        await self.core_in.send(self.to_core.encode(UtilityCall(call_id=call_id, method=message.method)))

    async def _add_request(self, identity: bytes, message: ClientGenerate) -> None:
        engine_id = self._engine_id(identity, message.request_id)
        if self.dead_reason is not None:
            await self._send(identity, ServerError(message.request_id, f"engine is dead: {self.dead_reason}", "engine_dead"))
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
        for core_message in core_messages:
            await self.core_in.send(self.to_core.encode(core_message))

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
        if core_ids:
            await self.core_in.send(self.to_core.encode(AbortRequests(request_ids=core_ids)))

    def _forget(self, engine_id: str) -> _ClientRequest | None:
        request = self.requests.pop(engine_id, None)
        self.metrics.request_ended(engine_id)
        if request is not None and request.identity in self.clients:
            self.clients[request.identity].requests.discard(engine_id)
        return request

    # ---- engine core ---------------------------------------------------------------------------

    async def _engine_loop(self) -> None:
        while True:
            frames = await self.core_out.recv_multipart()
            try:
                message = self.from_core.decode_frames(frames)
            except MessageError as error:
                logger.error("dropped a malformed message from the engine core: %s", error)
                continue
            if isinstance(message, EngineOutputs):
                await self._deliver(message)
            elif isinstance(message, UtilityResult):
                await self._answer_utility(message)
            elif isinstance(message, EngineDead):
                await self._engine_died(message.reason)
                return

    async def _deliver(self, message: EngineOutputs) -> None:
        for core_id, reason in message.failed.items():
            await self._fail(core_id, reason)
        outputs, to_abort = self.outputs.process(message.outputs)
        if to_abort:
            await self.core_in.send(self.to_core.encode(AbortRequests(request_ids=to_abort)))
        for output in outputs:
            request = self.requests.get(output.request_id)
            if request is not None:
                await self._send_deltas(request, output)

    async def _fail(self, core_id: str, reason: str) -> None:
        """The core refused one of a request's completions: the whole request fails."""
        engine_id = self.outputs.request_id_of(core_id)
        if engine_id is None:
            return
        siblings = [i for i in self.outputs.core_request_ids(engine_id) if i != core_id]
        self.outputs.abort(engine_id)
        if siblings:
            await self.core_in.send(self.to_core.encode(AbortRequests(request_ids=siblings)))
        request = self._forget(engine_id)
        if request is not None:
            await self._send(request.identity, ServerError(request.request_id, reason))

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
            await self._send(identity, ServerStats(call_id=call_id, stats=result.result or {}))
        elif (waiter := self.utility_waiters.pop(result.call_id, None)) is not None:
            identity, call_id = waiter
            await self._send(identity, ServerUtilityResult(call_id=call_id, result=result.result, error=result.error))

    async def _engine_died(self, reason: str) -> None:
        self.dead_reason = reason
        logger.error("engine core is dead: %s; failing %d request(s)", reason, len(self.requests))
        for engine_id in list(self.requests):
            request = self._forget(engine_id)
            self.outputs.abort(engine_id)
            await self._send(request.identity, ServerError(request.request_id, f"engine is dead: {reason}", "engine_dead"))

    # ---- health --------------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Notice a dead engine core and clients that fell silent."""
        interval = self.config.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval)
            code = self.core_process.poll()
            if code is not None:
                await self._engine_died(f"engine core exited with code {code}")
                return
            cutoff = time.monotonic() - self.config.client_timeout_s
            for identity in [i for i, c in self.clients.items() if c.inbox is None and c.last_seen < cutoff]:
                await self._drop_client(identity, f"silent for over {self.config.client_timeout_s:.0f} s")
