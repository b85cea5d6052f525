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
    Shutdown,
    UtilityCall,
    UtilityResult,
)
from zllm.ipc.sockets import make_socket
from zllm.launch.children import spawn_child, stop_children
from zllm.outputs import RequestOutput
from zllm.sampling_params import SamplingParams

logger = logging.getLogger("zllm.frontend")


class EngineStartError(RuntimeError):
    pass


@dataclass(slots=True)
class _ClientRequest:
    identity: bytes
    request_id: str  # the client's id; the engine sees identity-prefixed ids
    holdback: int  # characters of text withheld while a stop string could still match
    sent_text: int = 0
    sent_tokens: int = 0


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

    async def _add_request(self, identity: bytes, message: ClientGenerate) -> None:
        engine_id = self._engine_id(identity, message.request_id)
        if self.dead_reason is not None:
            await self._send(identity, ServerError(message.request_id, f"engine is dead: {self.dead_reason}", "engine_dead"))
            return
        try:
            if engine_id in self.requests:
                raise ValueError(f"request_id: {message.request_id!r} is already in use by this client")
            sampling = convert(message.sampling, SamplingParams)
            add, text = self.processor.process(engine_id, self._prompt(message), sampling, priority=message.priority)
        except ValueError as error:
            await self._send(identity, ServerError(message.request_id, str(error)))
            return
        holdback = max((len(s) for s in sampling.stop_strings), default=1) - 1
        self.requests[engine_id] = _ClientRequest(identity, message.request_id, holdback)
        self.clients[identity].requests.add(engine_id)
        self.outputs.add_request(engine_id, text, add.prompt_token_ids, sampling)
        self.metrics.request_added(engine_id, len(add.prompt_token_ids))
        await self.core_in.send(self.to_core.encode(add))

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
        live = [i for i in engine_ids if i in self.requests]
        for engine_id in live:
            self._forget(engine_id)
            self.outputs.abort(engine_id)
        if live:
            await self.core_in.send(self.to_core.encode(AbortRequests(request_ids=live)))

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
                await self._answer_stats(message)
            elif isinstance(message, EngineDead):
                await self._engine_died(message.reason)
                return

    async def _deliver(self, message: EngineOutputs) -> None:
        for engine_id, reason in message.failed.items():
            request = self._forget(engine_id)
            self.outputs.abort(engine_id)
            if request is not None:
                await self._send(request.identity, ServerError(request.request_id, reason))
        outputs, to_abort = self.outputs.process(message.outputs)
        if to_abort:
            await self.core_in.send(self.to_core.encode(AbortRequests(request_ids=to_abort)))
        for output in outputs:
            request = self.requests.get(output.request_id)
            if request is not None:
                await self._send_delta(request, output)

    async def _send_delta(self, request: _ClientRequest, output: RequestOutput) -> None:
        completion = output.outputs[0]
        visible = completion.text if output.finished else completion.text[: len(completion.text) - request.holdback]
        first = request.sent_tokens == 0
        delta = ServerOutput(
            request_id=request.request_id,
            text=visible[request.sent_text :],
            token_ids=completion.token_ids[request.sent_tokens :],
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            prompt_token_ids=output.prompt_token_ids if first else None,
        )
        self.metrics.tokens_generated(output.request_id, len(delta.token_ids), completion.finish_reason)
        request.sent_text = max(request.sent_text, len(visible))
        request.sent_tokens = len(completion.token_ids)
        if output.finished:
            self._forget(output.request_id)
        await self._send(request.identity, delta)

    async def _answer_stats(self, result: UtilityResult) -> None:
        waiter = self.stats_waiters.pop(result.call_id, None)
        if waiter is not None:
            identity, call_id = waiter
            await self._send(identity, ServerStats(call_id=call_id, stats=result.result or {}))

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
