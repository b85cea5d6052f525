"""Starting one engine core and waiting until it is ready: the server's `EngineLink` (asyncio) and
the offline `DataParallelCoreClient` (blocking) both start their cores with these.

    start_local_core   private runtime dir -> bind core-input (PUSH) and core-output (PULL) -> spawn the core
    wait_until_ready   EngineReady, or CoreStartError: the core said EngineDead, exited, a node
                       failed, or startup_timeout_s passed

`wait_until_ready` is a coroutine over a `receive` the caller gives: the server awaits it with a
zmq.asyncio socket; the offline client runs it with `run_blocking` over a blocking socket, so both
follow the same start-up rules without the offline client needing an event loop.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import zmq

from zllm.config import EngineConfig
from zllm.ipc.addresses import InternalEndpoints
from zllm.ipc.messages import EngineDead, EngineReady
from zllm.ipc.sockets import make_socket
from zllm.procs.engine_processes import EngineProcesses

T = TypeVar("T")


class CoreStartError(RuntimeError):
    """Raised by the frontend when an engine core (and its workers) did not come up."""


def start_local_core(
    processes: EngineProcesses, context: zmq.Context, config: EngineConfig, runtime_dir: str
) -> tuple[zmq.Socket, zmq.Socket]:
    """Bind the core's two sockets in runtime_dir (made private) and start the core process there;
    returns (to the core, from the core). With a zmq.asyncio context the sockets are asyncio ones."""
    os.makedirs(runtime_dir, mode=0o700, exist_ok=True)  # left by a killed instance: make_socket checks it
    os.chmod(runtime_dir, 0o700)
    endpoints = InternalEndpoints(runtime_dir)
    hwm = config.socket_hwm
    to_core = make_socket(context, zmq.PUSH, endpoints.core_input, bind=True, hwm=hwm)
    from_core = make_socket(
        context,
        zmq.PULL,
        endpoints.core_output,
        bind=True,
        hwm=hwm,
        max_message_bytes=config.internal_max_message_bytes,
    )
    try:
        processes.spawn_core(dataclasses.replace(config, runtime_dir=runtime_dir))
    except BaseException:
        to_core.close(linger=0)
        from_core.close(linger=0)
        raise
    return to_core, from_core


async def wait_until_ready(
    name: str,
    receive: Callable[[], Awaitable[object | None]],
    processes: EngineProcesses,
    timeout_s: float,
    node_failure: Callable[[], str | None] = lambda: None,
) -> EngineReady:
    """Wait for the core's EngineReady (its workers are up and the KV cache sized). `receive`
    returns the core's next message, or None after a heartbeat without one; in a silence the
    core's process (none for a core on another node) and `node_failure` are checked."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        message = await receive()
        if isinstance(message, EngineReady):
            return message
        if isinstance(message, EngineDead):
            raise CoreStartError(f"{name} failed to start: {message.reason}")
        if message is None:
            if (code := processes.core_exit_code()) is not None:
                raise CoreStartError(f"{name} core exited with code {code} during start-up")
            if (failure := node_failure()) is not None:
                raise CoreStartError(f"{name} failed to start: {failure}")
    raise CoreStartError(f"{name} not ready after {timeout_s:.0f} s")


def run_blocking(coroutine: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine whose awaits never suspend (they wrap blocking calls), run
    without an event loop: so it also works in a thread whose loop is running (a notebook)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("run_blocking: the coroutine suspended; it must only await blocking calls")
