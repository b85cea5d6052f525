"""The Python client: talks ZMQ to a running zllm frontend. Light: pyzmq and msgspec only.

    from zllm import Client, SamplingParams
    client = Client()                          # the default endpoint of `vllm-launch`
    out = client.generate("Hello", SamplingParams(max_tokens=16))
    for delta in client.stream("Tell me a story"):
        print(delta.outputs[0].text, end="")
    three = client.generate("Hello", SamplingParams(n=3, seed=1, logprobs=2))  # 3 completions, top-2 logprobs
    vector = client.embed("Hello").outputs.embedding  # a pooling model (also score, classify)

`AsyncClient` offers the same calls as coroutines and async iterators and runs many requests
concurrently over one connection. Leaving a stream early (break, cancel, close) aborts the
request on the server. While requests are in flight the client pings the server; if nothing
arrives for `timeout` seconds, every pending call fails with ServerGoneError.

A server started with --api-key needs `api_key=`; a tcp:// endpoint secured with CURVE needs
`server_key=` (the path of the server's public key file, server.key) and, unless the server
admits any key holder, `client_key=` (the path of this client's key pair, NAME.key_secret);
see docs/deployment.md. A refused key fails every call at once with AuthenticationError.

Lifetimes: close a client (`close()`, `with`, `async with`) when done; calls still in flight then
fail with ClientClosedError. One dropped unclosed is released when collected or at exit, with a
ResourceWarning, as asyncio's objects do. Nothing a client does or leaves behind can hang the
process: not a dropped client, not its event loop closing under it, not a vanished server.
Where each is safe: an AsyncClient serves any number of tasks of one event loop (one thread); a
Client may be shared by threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import threading
import time
import uuid
import warnings
import weakref
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
from zllm.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from zllm.sampling_params import SamplingParams


class ZllmError(Exception):
    """Base of the client's errors."""


class RequestError(ZllmError, ValueError):
    """The server rejected the request (a 400-style error); the message says why."""


class EngineDeadError(ZllmError):
    """Raised by the client (in the user's process) on the server's word: the engine behind it died; the
    request is lost. vLLM's name, kept for its users."""


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


class ClientClosedError(ZllmError, RuntimeError):
    """The client was closed (or its event-loop thread is gone); make a new one."""


_ERRORS = {
    "bad_request": RequestError,
    "engine_dead": EngineDeadError,
    "overloaded": OverloadedError,
    "draining": ServerDrainingError,
    "unauthorized": AuthenticationError,
    "internal": RequestFailedError,
}

_HWM = 10_000
_ABORT_WAIT_S = 1.0  # leaving a stream never waits longer than this to tell the server
_POLL_S = 0.2  # how often a Client call waiting for its answer checks that the loop thread lives

_context: zmq.asyncio.Context | None = None
_context_pid = 0
_context_lock = threading.Lock()


def _shared_context() -> zmq.asyncio.Context:
    """The one zmq context of every client in this process (a forked child makes its own).

    NOTE: shared and never terminated, on purpose. `Context.term()` waits until every socket of
    the context is closed. With a context per client, a client dropped unclosed left its context
    in a garbage cycle; the collector clears weak references before it runs finalizers, so
    pyzmq's `Context.__del__` saw no sockets to close and `term()` waited forever (issue 22).
    Sockets close with linger 0 instead, and two zmq threads serve every client.
    """
    global _context, _context_pid
    with _context_lock:
        if _context is None or _context_pid != os.getpid():
            _context, _context_pid = zmq.asyncio.Context(), os.getpid()
        return _context


class _Resources:
    """What a client must give back: its DEALER, its handshake monitor and the tasks reading them,
    held apart from the client so that its finalizer can release them after it is gone."""

    def __init__(self, socket: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        self.socket = socket
        self.monitor = monitor
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop reading them, once one does
        self.tasks: list[asyncio.Task] = []

    def release(self) -> None:
        """Stop the tasks and close the sockets without blocking, from any thread. While their
        loop runs, that is done on the loop's thread: an asyncio socket unregisters from its loop
        as it closes."""
        loop = self.loop
        if loop is not None and loop.is_running():
            try:
                loop.call_soon_threadsafe(self.close_now)
                return
            except RuntimeError:
                pass  # the loop closed meanwhile: nobody reads them any more
        self.close_now()

    def close_now(self) -> None:
        self.cancel_tasks()
        if not self.socket.closed:
            self.socket.disable_monitor()
        for socket in (self.monitor, self.socket):
            if not socket.closed:
                socket.close(linger=0)

    def cancel_tasks(self) -> list[asyncio.Task]:
        tasks, self.tasks = self.tasks, []
        for task in tasks:
            _cancel_quietly(task)
        return tasks


class AsyncClient:
    """Requests as coroutines and async iterators, any number at once over one connection.

    Safe to share between the tasks of one event loop. It belongs to the loop it is first used
    in; once that loop has stopped or closed (e.g. after one `asyncio.run`), the next call moves
    it to the running loop. It is not thread-safe: for threads, use `Client`.
    """

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
        self._closed = True  # until it holds sockets
        self._warn_unclosed = True  # a Client warns for the AsyncClient it drives
        self.endpoint = endpoint or default_client_endpoint()
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        self.api_key = api_key
        self._socket = _connect(self.endpoint, server_key, client_key)
        self._monitor = self._socket.get_monitor_socket(HANDSHAKE_FAILURE_EVENTS)
        self._owned = _Resources(self._socket, self._monitor)
        self._release = weakref.finalize(self, self._owned.release)  # dropped unclosed: no leak
        self._closed = False
        self._encoder: Codec = Codec(ClientToServer)
        self._decoder: Codec = Codec(ServerToClient)
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._last_heard = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gone: ZllmError | None = None
        self._gone_event = asyncio.Event()  # set with _gone: wakes a send that can never complete

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.endpoint}{' closed' if self._closed else ''}>"

    def __del__(self, _warn=warnings.warn) -> None:
        # As asyncio's transports and loops do; the finalizer (weakref.finalize) does the closing.
        if not getattr(self, "_closed", True) and self._warn_unclosed:
            _warn(f"unclosed {self!r}", ResourceWarning, source=self)

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
        lora_name: str | None = None,
    ) -> RequestOutput:
        """The whole request: all n completions (`outputs[i]`), with logprobs if asked for.
        `timeout` bounds the total time (the request is aborted then). `lora_name`: a LoRA
        adapter the server serves (--lora-modules); None: the base model."""
        stream = self.stream(
            prompt,
            sampling_params,
            prompt_token_ids=prompt_token_ids,
            request_id=request_id,
            priority=priority,
            cache_salt=cache_salt,
            lora_name=lora_name,
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
        lora_name: str | None = None,
    ) -> RequestOutput:
        stream = self.chat_stream(
            messages,
            sampling_params,
            request_id=request_id,
            priority=priority,
            cache_salt=cache_salt,
            lora_name=lora_name,
        )
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
        lora_name: str | None = None,
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
            lora_name=lora_name,
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
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        message = ClientGenerate(
            request_id or _new_id(),
            messages=messages,
            sampling=_fields(sampling_params),
            priority=priority,
            cache_salt=cache_salt,
            lora_name=lora_name,
        )
        return self._stream(message)

    async def abort(self, request_id: str) -> None:
        self._ensure_started()
        await self._send(ClientAbort(request_id))

    async def stats(self) -> dict[str, Any]:
        """The engine core's counters (running, waiting, KV blocks, preemptions, prefix cache hits)."""
        return await self._call(lambda call_id: ClientStats(call_id=call_id, api_key=self.api_key))

    # ---- pooling models (embeddings, cross-encoder scores, classes) --------------------------------

    async def embed(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> EmbeddingRequestOutput:
        """One embedding from a pooling model (normalized as the model declares unless `normalize`).
        truncate_prompt_tokens (vLLM's): the input's last k tokens; -1: max_model_len."""
        pooling = {"task": "embed", "dimensions": dimensions, "normalize": normalize}
        pooling["truncate_prompt_tokens"] = truncate_prompt_tokens
        out = await self._pool(pooling, prompt, prompt_token_ids, None, request_id, timeout)
        return EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.pooled), out.prompt_token_ids)

    async def score(
        self,
        text_1: str,
        text_2: str,
        *,
        truncate_prompt_tokens: int | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> ScoringRequestOutput:
        """A cross-encoder's relevance of the pair (for an embedding model, embed both and take the
        cosine)."""
        pooling = {"task": "score", "truncate_prompt_tokens": truncate_prompt_tokens}
        out = await self._pool(pooling, text_1, None, text_2, request_id, timeout)
        return ScoringRequestOutput(out.request_id, ScoringOutput(out.pooled[0]), out.prompt_token_ids)

    async def classify(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        truncate_prompt_tokens: int | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> ClassificationRequestOutput:
        pooling = {"task": "classify", "truncate_prompt_tokens": truncate_prompt_tokens}
        out = await self._pool(pooling, prompt, prompt_token_ids, None, request_id, timeout)
        return ClassificationRequestOutput(out.request_id, ClassificationOutput(out.pooled), out.prompt_token_ids)

    async def _pool(self, pooling, prompt, prompt_token_ids, pair, request_id, timeout) -> RequestOutput:
        message = ClientGenerate(
            request_id or _new_id(),
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            pooling={k: v for k, v in pooling.items() if v is not None},
            prompt_pair=pair,
        )
        return await asyncio.wait_for(_collect(self._stream(message)), timeout)

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
        """Fail every call in flight with ClientClosedError, stop reading, close the sockets.
        Never waits on the server; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._release.detach()
        try:
            self._enter_running_loop()
        except RuntimeError:  # its loop runs in another thread: let that thread close it
            self._owned.release()
            return
        for request_id in list(self._queues):
            await self._abort_quietly(request_id)
        self._fail_all(ClientClosedError(f"{self!r}: closed"))
        await asyncio.gather(*self._owned.cancel_tasks(), return_exceptions=True)
        self._owned.close_now()

    async def __aenter__(self) -> AsyncClient:
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
                await self._abort_quietly(message.request_id)

    def _ensure_started(self) -> None:
        if self._closed:
            raise ClientClosedError(f"{self!r}: closed")
        self._enter_running_loop()
        if not self._owned.tasks:
            self._last_heard = time.monotonic()
            me = weakref.ref(self)  # NOTE: the tasks must not keep a dropped client alive
            self._owned.tasks = [
                asyncio.create_task(_read_replies(self._socket, me), name="zllm-client-read"),
                asyncio.create_task(_keep_alive(me, self.heartbeat_interval), name="zllm-client-ping"),
                asyncio.create_task(_watch_handshakes(self._monitor, me), name="zllm-client-handshakes"),
            ]

    def _enter_running_loop(self) -> None:
        """Bind to the running loop at first use. After the bound loop has stopped or closed,
        start over in the running one: the old loop's tasks and callers are dead."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        if self._loop is not None and self._loop.is_running():
            raise RuntimeError(
                f"{self!r} is in use by an event loop in another thread; an AsyncClient serves one loop "
                "(zllm.Client may be shared by threads)"
            )
        orphans = self._forget_loop()
        self._loop = self._owned.loop = loop
        self._gone_event = asyncio.Event()
        if self._gone is not None:
            self._gone_event.set()
        for request_id in orphans:  # requests whose streams died with the old loop
            loop.create_task(self._abort_quietly(request_id))

    def _forget_loop(self) -> list[str]:
        """Drop what belonged to the previous loop; return its requests still in flight."""
        self._owned.cancel_tasks()
        orphans = list(self._queues)
        self._queues.clear()
        self._stats_waiters.clear()
        return orphans

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

    async def _abort_quietly(self, request_id: str) -> None:
        """Best effort, and quick: when the socket cannot take the abort now there is no
        connection, and the server drops the requests of a client it lost by itself."""
        if self._socket.closed:
            return
        frame = self._encoder.encode(ClientAbort(request_id))
        try:
            await asyncio.wait_for(self._socket.send(frame, flags=zmq.NOBLOCK), _ABORT_WAIT_S)
        except (zmq.ZMQError, asyncio.TimeoutError):
            pass

    def _on_frame(self, frame: bytes) -> None:
        self._last_heard = time.monotonic()
        try:
            message = self._decoder.decode(frame)
        except MessageError:
            return  # not a message from a zllm server: ignore it, keep reading
        self._route(message)

    def _route(self, message) -> None:
        if isinstance(message, ServerOutput):
            queue = self._queues.get(message.request_id)
            if queue is not None:
                queue.put_nowait(message)
        elif isinstance(message, ServerError):
            error = _ERRORS.get(message.kind, ZllmError)(message.message)
            if message.call_id is not None:
                self._settle(message.call_id, error=error)
                return
            targets = [message.request_id] if message.request_id is not None else list(self._queues)
            for request_id in targets:
                if request_id in self._queues:
                    self._queues[request_id].put_nowait(error)
        elif isinstance(message, ServerStats):
            self._settle(message.call_id, result=message.stats)
        elif isinstance(message, ServerUtilityResult):
            error = None if message.error is None else RequestError(message.error)
            self._settle(message.call_id, result=message.result, error=error)

    def _settle(self, call_id: int, result: Any = None, error: Exception | None = None) -> None:
        future = self._stats_waiters.pop(call_id, None)
        if future is None or future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    async def _heartbeat(self) -> None:
        busy = bool(self._queues or self._stats_waiters)
        if not busy:
            self._last_heard = time.monotonic()
            return
        if time.monotonic() - self._last_heard > self.timeout:
            self._fail_all(ServerGoneError(f"no answer from {self.endpoint} for {self.timeout:.0f} s"))
            return
        try:
            await self._send(ClientPing())
        except ZllmError:
            pass  # every pending call has been failed with the reason

    def _fail_all(self, error: ZllmError) -> None:
        self._gone = error
        self._gone_event.set()
        for queue in self._queues.values():
            queue.put_nowait(error)
        for future in self._stats_waiters.values():
            if not future.done():
                future.set_exception(error)
        self._stats_waiters.clear()


def _connect(endpoint: str, server_key: str | None, client_key: str | None) -> zmq.asyncio.Socket:
    socket = _shared_context().socket(zmq.DEALER)
    try:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, _HWM)
        socket.setsockopt(zmq.RCVHWM, _HWM)
        if server_key is not None:
            key_pair = load_key_pair(client_key) if client_key else None
            make_curve_client(socket, load_public_key(server_key), key_pair)
        elif client_key is not None:
            raise ValueError("client_key: needs server_key (the server's public key file) too")
    except BaseException:
        socket.close(linger=0)
        raise
    socket.connect(endpoint)
    return socket


# The client's background tasks hold it by a weak reference, and strongly only while handling
# one event: a client dropped unclosed is then collected (and its finalizer closes the sockets)
# even while its event loop runs on.


async def _read_replies(socket: zmq.asyncio.Socket, client_ref: weakref.ref) -> None:
    while True:
        try:
            frame = await socket.recv()
        except zmq.ZMQError:
            return  # closed
        client = client_ref()
        if client is None:
            return
        client._on_frame(frame)
        del client


async def _keep_alive(client_ref: weakref.ref, interval: float) -> None:
    """Ping while calls are in flight; fail them when the server has been silent too long."""
    while True:
        await asyncio.sleep(interval)
        client = client_ref()
        if client is None:
            return
        await client._heartbeat()
        del client


async def _watch_handshakes(monitor: zmq.asyncio.Socket, client_ref: weakref.ref) -> None:
    """A refused security handshake is final: fail every call now, with the reason."""
    while True:
        try:
            event = parse_monitor_message(await monitor.recv_multipart())
        except zmq.ZMQError:
            return  # closed
        reason = describe_handshake_failure(event["event"])
        client = client_ref()
        if client is None:
            return
        if reason is not None:
            client._fail_all(AuthenticationError(f"{client.endpoint}: {reason}"))
            return
        del client


def _cancel_quietly(task: asyncio.Task) -> None:
    try:
        task.cancel()
    except RuntimeError:
        pass  # its loop is closed: the task will never run again anyway


class Client:
    """The synchronous client: an AsyncClient driven on a private event-loop thread.

    Thread-safe: every call runs on that one thread, so threads may share a Client (each
    iterating its own `stream`). `close()` (or leaving `with`) stops the thread; calls still in
    flight, in any thread, then fail with ClientClosedError. A Client dropped unclosed stops its
    thread when collected, with a ResourceWarning.
    """

    def __init__(
        self, endpoint: str | None = None, timeout: float = 30.0, heartbeat_interval: float = 1.0, **security
    ) -> None:
        """`security`: AsyncClient's api_key, server_key and client_key."""
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=_run_until_stopped, args=(self._loop,), daemon=True, name="zllm-client")
        self._thread.start()
        self._stop = weakref.finalize(self, _stop_soon, self._loop)  # dropped unclosed: the thread ends
        try:
            self._async = self._run(_make_async_client(endpoint, timeout, heartbeat_interval, security))
        except BaseException:
            self.close()
            raise
        self._async._warn_unclosed = False  # this Client warns for both
        self.endpoint = self._async.endpoint

    def __repr__(self) -> str:
        return f"<Client {getattr(self, 'endpoint', '?')}{' closed' if self._closed else ''}>"

    def __del__(self, _warn=warnings.warn) -> None:
        if not getattr(self, "_closed", True):
            _warn(f"unclosed {self!r}", ResourceWarning, source=self)

    def generate(
        self, prompt: str | None = None, sampling_params: SamplingParams | None = None, **kwargs
    ) -> RequestOutput:
        return self._run(self._async.generate(prompt, sampling_params, **kwargs))

    def chat(
        self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None, **kwargs
    ) -> RequestOutput:
        return self._run(self._async.chat(messages, sampling_params, **kwargs))

    def stream(
        self, prompt: str | None = None, sampling_params: SamplingParams | None = None, **kwargs
    ) -> Iterator[RequestOutput]:
        return self._iterate(self._async.stream(prompt, sampling_params, **kwargs))

    def embed(self, prompt: str | None = None, **kwargs) -> EmbeddingRequestOutput:
        return self._run(self._async.embed(prompt, **kwargs))

    def score(self, text_1: str, text_2: str, **kwargs) -> ScoringRequestOutput:
        return self._run(self._async.score(text_1, text_2, **kwargs))

    def classify(self, prompt: str | None = None, **kwargs) -> ClassificationRequestOutput:
        return self._run(self._async.classify(prompt, **kwargs))

    def abort(self, request_id: str) -> None:
        self._run(self._async.abort(request_id))

    def stats(self) -> dict[str, Any]:
        return self._run(self._async.stats())

    def reset_prefix_cache(self) -> bool:
        return self._run(self._async.reset_prefix_cache())

    def close(self) -> None:
        """Close the connection and stop the loop thread (at once, even with the server gone)."""
        if self._closed:
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError("Client.close() from its own event-loop thread would wait for itself")
        self._closed = True
        inner = getattr(self, "_async", None)
        if inner is not None and self._thread.is_alive():
            try:
                self._wait(asyncio.run_coroutine_threadsafe(inner.close(), self._loop))
            except (ZllmError, RuntimeError):
                pass  # the loop thread stopped meanwhile: nothing is left to close
        self._stop()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, coroutine):
        """Run on the loop thread and wait for the result (or a ClientClosedError, never forever)."""
        if self._closed or threading.current_thread() is self._thread:
            coroutine.close()
            if self._closed:
                raise ClientClosedError(f"{self!r}: closed")
            raise RuntimeError("a Client call from its own event-loop thread would wait for itself")
        try:
            future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        except RuntimeError as error:  # its loop is closed
            coroutine.close()
            raise ClientClosedError(f"{self!r}: closed") from error
        return self._wait(future)

    def _wait(self, future: concurrent.futures.Future):
        while not concurrent.futures.wait([future], timeout=_POLL_S).done:
            if not self._thread.is_alive():  # stopped under the call (closed from another thread)
                future.cancel()
                raise ClientClosedError(f"{self!r}: closed")
        return future.result()

    def _iterate(self, stream: AsyncIterator[RequestOutput]) -> Iterator[RequestOutput]:
        try:
            while True:
                try:
                    yield self._run(stream.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._close_stream(stream)

    def _close_stream(self, stream: AsyncIterator[RequestOutput]) -> None:
        """Leaving a stream early aborts its request. A generator collected on the loop thread
        itself cannot wait for that: it is scheduled instead."""
        if threading.current_thread() is self._thread:
            self._loop.create_task(stream.aclose())
            return
        try:
            self._run(stream.aclose())
        except ClientClosedError:
            pass  # closed: its requests went with it


def _run_until_stopped(loop: asyncio.AbstractEventLoop) -> None:
    """The Client's loop thread: run until stopped, then end what is left and close the loop."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def _stop_soon(loop: asyncio.AbstractEventLoop) -> None:
    try:
        loop.call_soon_threadsafe(loop.stop)
    except RuntimeError:
        pass  # already closed


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
        pooled=message.pooled,
    )


def _fields(params: SamplingParams | None) -> dict[str, Any]:
    """The fields that differ from the defaults (what the wire carries)."""
    import msgspec

    return msgspec.to_builtins(params) if params is not None else {}


def _new_id() -> str:
    return uuid.uuid4().hex
