"""The Python client: talks ZMQ to a running zllm frontend. Light: pyzmq and msgspec only.

    from zllm import Client, SamplingParams
    client = Client()                          # the default endpoint of `vllm-launch`
    out = client.generate("Hello", SamplingParams(max_tokens=16))
    for delta in client.stream("Tell me a story"):
        print(delta.outputs[0].text, end="")
    three = client.generate("Hello", SamplingParams(n=3, seed=1, logprobs=2))  # 3 completions, top-2 logprobs

`AsyncClient` offers the same calls as coroutines and async iterators and runs many requests
concurrently over one connection. Leaving a stream early (break, cancel, close) aborts the
request on the server. While requests are in flight the client pings the server; if nothing
arrives for `timeout` seconds, every pending call fails with ServerGoneError.

A server started with --api-key needs `api_key=`; a tcp:// endpoint secured with CURVE needs
`server_key=` (the path of the server's public key file, server.key) and, unless the server
admits any key holder, `client_key=` (the path of this client's key pair, NAME.key_secret);
see docs/deployment.md. A refused key fails every call at once with AuthenticationError.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from zllm.ipc.addresses import default_client_endpoint
from zllm.ipc.codec import Codec, MessageError
from zllm.ipc.curve import (
    HANDSHAKE_FAILURE_EVENTS,
    describe_handshake_failure,
    load_key_pair,
    load_public_key,
    make_curve_client,
)
from zllm.ipc.messages import (
    ClientAbort,
    ClientGenerate,
    ClientPing,
    ClientStats,
    ClientToServer,
    ClientUtility,
    ServerError,
    ServerOutput,
    ServerStats,
    ServerToClient,
    ServerUtilityResult,
)
from zllm.outputs import CompletionOutput, RequestOutput
from zllm.sampling_params import SamplingParams


class ZllmError(Exception):
    """Base of the client's errors."""


class RequestError(ZllmError, ValueError):
    """The server rejected the request (a 400-style error); the message says why."""


class EngineDeadError(ZllmError):
    """The engine behind the server died; the request is lost."""


class ServerGoneError(ZllmError, ConnectionError):
    """The server stopped answering (not running, or died)."""


class RetryLaterError(ZllmError):
    """The server cannot take this request now; the same request can succeed later."""


class OverloadedError(RetryLaterError):
    """Too many requests are already waiting on the server (its --max-waiting)."""


class ServerDrainingError(RetryLaterError):
    """The server is shutting down: it finishes what it has and takes nothing new."""


class AuthenticationError(ZllmError, PermissionError):
    """Missing or wrong api key, or a CURVE key the server refuses."""


class RequestFailedError(ZllmError):
    """The server failed this request alone (e.g. the engine could not set it up); the others
    it serves go on. The message says why."""


_ERRORS = {
    "bad_request": RequestError,
    "engine_dead": EngineDeadError,
    "overloaded": OverloadedError,
    "draining": ServerDrainingError,
    "unauthorized": AuthenticationError,
    "internal": RequestFailedError,
}

_HWM = 10_000


class AsyncClient:
    def __init__(
        self,
        endpoint: str | None = None,
        timeout: float = 30.0,
        heartbeat_interval: float = 1.0,
        *,
        api_key: str | None = None,
        server_key: str | None = None,
        client_key: str | None = None,
    ) -> None:
        self.endpoint = endpoint or default_client_endpoint()
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        self.api_key = api_key
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, _HWM)
        self._socket.setsockopt(zmq.RCVHWM, _HWM)
        if server_key is not None:
            key_pair = load_key_pair(client_key) if client_key else None
            make_curve_client(self._socket, load_public_key(server_key), key_pair)
        elif client_key is not None:
            raise ValueError("client_key: needs server_key (the server's public key file) too")
        self._monitor = self._socket.get_monitor_socket(HANDSHAKE_FAILURE_EVENTS)
        self._socket.connect(self.endpoint)
        self._encoder: Codec = Codec(ClientToServer)
        self._decoder: Codec = Codec(ServerToClient)
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._last_heard = time.monotonic()
        self._tasks: list[asyncio.Task] = []
        self._gone: ZllmError | None = None
        self._gone_event = asyncio.Event()  # set with _gone: wakes a send that can never complete

    # ---- public calls --------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        """The whole request: all n completions (`outputs[i]`), with logprobs if asked for.
        `timeout` bounds the total time (the request is aborted then)."""
        stream = self.stream(
            prompt, sampling_params, prompt_token_ids=prompt_token_ids, request_id=request_id,
            priority=priority, cache_salt=cache_salt,
        )
        return await asyncio.wait_for(_collect(stream), timeout)

    async def chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        stream = self.chat_stream(messages, sampling_params, request_id=request_id, priority=priority, cache_salt=cache_salt)
        return await asyncio.wait_for(_collect(stream), timeout)

    def stream(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Deltas as they come: each RequestOutput holds one completion (`outputs[0].index` says
        which, for n > 1) with its new text, token ids and logprobs only."""
        message = ClientGenerate(
            request_id or _new_id(),
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            sampling=_fields(sampling_params),
            priority=priority,
            cache_salt=cache_salt,
        )
        return self._stream(message)

    def chat_stream(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        message = ClientGenerate(
            request_id or _new_id(), messages=messages, sampling=_fields(sampling_params), priority=priority,
            cache_salt=cache_salt,
        )
        return self._stream(message)

    async def abort(self, request_id: str) -> None:
        await self._send(ClientAbort(request_id))

    async def stats(self) -> dict[str, Any]:
        """The engine core's counters (running, waiting, KV blocks, preemptions, prefix cache hits)."""
        return await self._call(lambda call_id: ClientStats(call_id=call_id, api_key=self.api_key))

    async def reset_prefix_cache(self) -> bool:
        """Make the engine forget every cached prefix (vLLM's reset_prefix_cache)."""
        return await self._call(
            lambda call_id: ClientUtility(call_id=call_id, method="reset_prefix_cache", api_key=self.api_key)
        )

    async def _call(self, make_message) -> Any:
        self._ensure_started()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._stats_waiters[call_id] = future
        await self._send(make_message(call_id))
        return await asyncio.wait_for(future, self.timeout)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)
        self._context.term()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- internals -----------------------------------------------------------------------------

    async def _stream(self, message: ClientGenerate) -> AsyncIterator[RequestOutput]:
        if self.api_key is not None and message.api_key is None:
            message.api_key = self.api_key
        self._ensure_started()
        if self._gone is not None:
            raise self._gone
        if message.request_id in self._queues:
            raise RequestError(f"request_id: {message.request_id!r} is already in flight on this client")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[message.request_id] = queue
        finished = False
        prompt_token_ids: list[int] = []
        try:
            await self._send(message)
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                if item.prompt_token_ids is not None:
                    prompt_token_ids = item.prompt_token_ids
                finished = item.finished
                yield _to_request_output(item, message.prompt, prompt_token_ids)
        finally:
            self._queues.pop(message.request_id, None)
            if not finished and self._gone is None:
                try:
                    await asyncio.shield(self._send(ClientAbort(message.request_id)))
                except ZllmError:
                    pass  # the server is gone: nothing left to abort

    def _ensure_started(self) -> None:
        if not self._tasks:
            self._last_heard = time.monotonic()
            self._tasks = [
                asyncio.create_task(self._read_loop()),
                asyncio.create_task(self._heartbeat_loop()),
                asyncio.create_task(self._watch_handshakes()),
            ]

    async def _send(self, message) -> None:
        """Send, or raise why it cannot be: a DEALER with no usable connection (server down, or
        a refused handshake) would otherwise wait forever."""
        sending = asyncio.ensure_future(self._socket.send(self._encoder.encode(message)))
        gone = asyncio.ensure_future(self._gone_event.wait())
        await asyncio.wait({sending, gone}, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if sending.done():
            return sending.result()
        sending.cancel()
        if self._gone is None:
            self._fail_all(ServerGoneError(f"could not send to {self.endpoint} for {self.timeout:.0f} s"))
        raise self._gone

    async def _read_loop(self) -> None:
        while True:
            frame = await self._socket.recv()
            self._last_heard = time.monotonic()
            try:
                message = self._decoder.decode(frame)
            except MessageError:
                continue  # not a message from a zllm server: ignore it, keep reading
            self._route(message)

    def _route(self, message) -> None:
        if isinstance(message, ServerOutput):
            queue = self._queues.get(message.request_id)
            if queue is not None:
                queue.put_nowait(message)
        elif isinstance(message, ServerError):
            error = _ERRORS.get(message.kind, ZllmError)(message.message)
            if message.call_id is not None:
                future = self._stats_waiters.pop(message.call_id, None)
                if future is not None and not future.done():
                    future.set_exception(error)
                return
            targets = [message.request_id] if message.request_id is not None else list(self._queues)
            for request_id in targets:
                if request_id in self._queues:
                    self._queues[request_id].put_nowait(error)
        elif isinstance(message, ServerStats):
            future = self._stats_waiters.pop(message.call_id, None)
            if future is not None and not future.done():
                future.set_result(message.stats)
        elif isinstance(message, ServerUtilityResult):
            future = self._stats_waiters.pop(message.call_id, None)
            if future is not None and not future.done():
                if message.error is None:
                    future.set_result(message.result)
                else:
                    future.set_exception(RequestError(message.error))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            busy = bool(self._queues or self._stats_waiters)
            if not busy:
                self._last_heard = time.monotonic()
                continue
            if time.monotonic() - self._last_heard > self.timeout:
                self._fail_all(ServerGoneError(f"no answer from {self.endpoint} for {self.timeout:.0f} s"))
                continue
            try:
                await self._send(ClientPing())
            except ZllmError:
                continue  # every pending call has been failed with the reason

    async def _watch_handshakes(self) -> None:
        """A refused security handshake is final: fail every call now, with the reason."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            reason = describe_handshake_failure(event["event"])
            if reason is not None:
                self._fail_all(AuthenticationError(f"{self.endpoint}: {reason}"))
                return

    def _fail_all(self, error: ZllmError) -> None:
        self._gone = error
        self._gone_event.set()
        for queue in self._queues.values():
            queue.put_nowait(error)
        for future in self._stats_waiters.values():
            if not future.done():
                future.set_exception(error)
        self._stats_waiters.clear()


class Client:
    """The synchronous client: an AsyncClient driven on a private event loop thread."""

    def __init__(
        self, endpoint: str | None = None, timeout: float = 30.0, heartbeat_interval: float = 1.0, **security
    ) -> None:
        """`security`: AsyncClient's api_key, server_key and client_key."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="zllm-client")
        self._thread.start()
        self._async = self._run(_make_async_client(endpoint, timeout, heartbeat_interval, security))
        self.endpoint = self._async.endpoint

    def generate(self, prompt: str | None = None, sampling_params: SamplingParams | None = None, **kwargs) -> RequestOutput:
        return self._run(self._async.generate(prompt, sampling_params, **kwargs))

    def chat(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None, **kwargs) -> RequestOutput:
        return self._run(self._async.chat(messages, sampling_params, **kwargs))

    def stream(self, prompt: str | None = None, sampling_params: SamplingParams | None = None, **kwargs) -> Iterator[RequestOutput]:
        return self._iterate(self._async.stream(prompt, sampling_params, **kwargs))

    def abort(self, request_id: str) -> None:
        self._run(self._async.abort(request_id))

    def stats(self) -> dict[str, Any]:
        return self._run(self._async.stats())

    def reset_prefix_cache(self) -> bool:
        return self._run(self._async.reset_prefix_cache())

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._async.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5.0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _iterate(self, stream: AsyncIterator[RequestOutput]) -> Iterator[RequestOutput]:
        try:
            while True:
                try:
                    yield self._run(stream.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(stream.aclose())  # leaving early aborts the request


async def _make_async_client(endpoint, timeout, heartbeat_interval, security) -> AsyncClient:
    return AsyncClient(endpoint, timeout, heartbeat_interval, **security)


async def _collect(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Merge a stream's deltas into one RequestOutput with every completion in index order."""
    completions: dict[int, CompletionOutput] = {}
    last = None
    prompt_logprobs = None
    async for delta in stream:
        piece = delta.outputs[0]
        whole = completions.setdefault(piece.index, CompletionOutput(piece.index, "", []))
        whole.text += piece.text
        whole.token_ids.extend(piece.token_ids)
        if piece.logprobs is not None:
            whole.logprobs = (whole.logprobs or []) + piece.logprobs
        whole.finish_reason, whole.stop_reason = piece.finish_reason, piece.stop_reason
        whole.cumulative_logprob = piece.cumulative_logprob
        prompt_logprobs = delta.prompt_logprobs or prompt_logprobs
        last = delta
    last.outputs = [completions[i] for i in sorted(completions)]
    last.prompt_logprobs = prompt_logprobs
    return last


def _to_request_output(message: ServerOutput, prompt: str | None, prompt_token_ids: list[int]) -> RequestOutput:
    completion = CompletionOutput(
        index=message.index,
        text=message.text,
        token_ids=list(message.token_ids),
        finish_reason=message.finish_reason,
        stop_reason=message.stop_reason,
        cumulative_logprob=message.cumulative_logprob,
        logprobs=message.logprobs,
    )
    return RequestOutput(
        request_id=message.request_id,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        outputs=[completion],
        finished=message.finished,
        num_cached_tokens=message.num_cached_tokens,
        prompt_logprobs=message.prompt_logprobs,
    )


def _fields(params: SamplingParams | None) -> dict[str, Any]:
    """The fields that differ from the defaults (what the wire carries)."""
    import msgspec

    return msgspec.to_builtins(params) if params is not None else {}


def _new_id() -> str:
    return uuid.uuid4().hex
