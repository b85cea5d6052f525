"""`vllm-launch --api-server-count A`: A frontend processes (API servers) instead of one, so that
tokenizing, detokenizing and streaming (~15 us of one CPU per streamed token) are not bound to one
process. This process (vllm-launch) then only supervises them:

    vllm-launch ─┬─> api server 0 (zllm/launch/api_server_process.py) ─> engines dp 0 .. D/A - 1
                 ├─> api server 1                                      ─> engines dp D/A .. 2D/A - 1
                 └─> ...            every one listens on host:port (SO_REUSEPORT): the kernel
                                    spreads new HTTP connections over them

Each API server is today's frontend for its share of the -dp engines (same GPUs, runtime
subdirectories and engine supervision as behind one frontend), started as a fresh interpreter
with the config as JSON on stdin and dying with this process (zllm/procs/children.py). Server k
binds its own client endpoint (zllm.ipc.addresses.api_server_endpoint). Their sd_notify messages
come to a relay here: "zllm ready" and READY=1 once all are ready, WATCHDOG=1 while all feed it.

SIGTERM/SIGINT ─> forwarded to every API server (each drains) ─> 0 once all exited with 0
a second signal ─> every API server and its engines SIGKILLed at once ─> 128 + signal
    (an API server takes every signal as a drain request: under a unit with KillMode=control-group
    it gets the stop signal twice, from systemd and from here)
an API server exits unasked (its engines failed for good, or it crashed) ─> the others are
    stopped (SIGTERM: they drain) ─> 1
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

from zllm.config import EngineConfig
from zllm.frontend.metrics import MULTIPROCESS_DIR_ENV
from zllm.ipc.addresses import api_server_endpoint, default_client_endpoint
from zllm.launch.sd_notify import NotifyRelay, SystemdNotifier
from zllm.launch.service import Signals
from zllm.procs.children import spawn_child
from zllm.procs.exits import describe_exit_code, kill_and_wait, stop_children, wait_for_any_exit
from zllm.procs.racing import cancel_and_wait, race

logger = logging.getLogger("zllm.launch")

_STOP_MARGIN_S = 30.0  # beyond shutdown_timeout_s: an API server's engine shutdown after its drain
_EXIT_POLL_S = 0.1


async def serve_api_servers(config: EngineConfig) -> int:
    """Run config.api_server_count API servers until a signal or a failure; the exit code."""
    signals = Signals()
    notifier = SystemdNotifier()
    relay = NotifyRelay(os.path.join(config.runtime_dir, "api-servers.notify"))
    servers: list[subprocess.Popen] = []
    try:
        with _reserved_port(config.host, config.port) as port:
            env = _server_env(config.runtime_dir, relay.path)
            base = config.client_endpoint or default_client_endpoint()
            for rank in range(config.api_server_count):
                server_config = dataclasses.replace(
                    config, api_server_rank=rank, port=port, client_endpoint=api_server_endpoint(base, rank)
                )
                # Own sessions: a signal to vllm-launch's process group (a terminal's Ctrl-C) reaches
                # the servers as forwarded from here only, and their engine processes not at all.
                servers.append(spawn_child("zllm.launch.api_server_process", server_config, env=env, new_session=True))
            return await _supervise(config, servers, relay, notifier, signals, port)
    finally:
        relay.close()
        # Normally every server has exited by now; after a failure, the others drain first.
        await asyncio.to_thread(stop_children, servers, config.shutdown_timeout_s + _STOP_MARGIN_S)


async def _supervise(
    config: EngineConfig,
    servers: list[subprocess.Popen],
    relay: NotifyRelay,
    notifier: SystemdNotifier,
    signals: Signals,
    port: int,
) -> int:
    pids = {server.pid for server in servers}
    exited = asyncio.create_task(wait_for_any_exit(list(pids)), name="api-server-exit")
    watchdog: asyncio.Task | None = None
    try:
        ready = asyncio.create_task(relay.wait_ready(pids))
        if ready in await race(ready, exited, signals.first, keep=(exited,)):
            _announce_ready(config, port, notifier)
            watchdog = asyncio.create_task(_feed_watchdog(relay, pids, notifier, config.heartbeat_interval_s))
            await race(exited, signals.first, keep=(exited,))
        if not signals.first.is_set():
            return _one_exited(servers, exited.result())
        notifier.stopping(f"stopping {len(servers)} API servers")
        return await _stop_on_signal(servers, signals)
    finally:
        await cancel_and_wait(*(task for task in (exited, watchdog) if task is not None))


def _one_exited(servers: list[subprocess.Popen], pid: int) -> int:
    rank = next(rank for rank, server in enumerate(servers) if server.pid == pid)
    code = servers[rank].poll()
    described = "?" if code is None else describe_exit_code(code)
    logger.error("api server %d (pid %d) exited with code %s: stopping the others", rank, pid, described)
    return 1


async def _stop_on_signal(servers: list[subprocess.Popen], signals: Signals) -> int:
    """Forward the signal; wait for every server to exit (a second signal: kill them all)."""
    logger.info("%s received: stopping %d API servers", signal.Signals(signals.signum).name, len(servers))
    _forward(servers, signals.signum)
    all_exited = asyncio.create_task(_wait_all_exited(servers))
    await race(all_exited, signals.second, keep=(all_exited,))
    if signals.second.is_set():
        await cancel_and_wait(all_exited)
        await asyncio.to_thread(_kill_all, servers)
        return 128 + signals.signum
    codes = [server.returncode for server in servers]
    if any(codes):
        logger.error("api servers exited with codes %s", [describe_exit_code(code) for code in codes])
        return 1
    return 0


def _forward(servers: list[subprocess.Popen], signum: int) -> None:
    for server in servers:
        if server.poll() is None:
            server.send_signal(signum)


def _kill_all(servers: list[subprocess.Popen]) -> None:
    """SIGKILL every API server and everything under it (engine cores, workers); return once all
    are gone (their GPU memory is free)."""
    descendants = []
    for server in servers:
        try:
            descendants += [process.pid for process in psutil.Process(server.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    kill_and_wait([*servers, *descendants])


async def _wait_all_exited(servers: list[subprocess.Popen]) -> None:
    while any(server.poll() is None for server in servers):
        await asyncio.sleep(_EXIT_POLL_S)


def _announce_ready(config: EngineConfig, port: int, notifier: SystemdNotifier) -> None:
    host = f"[{config.host}]" if ":" in config.host else config.host
    url = f"http://{host}:{port}"
    base = config.client_endpoint or default_client_endpoint()
    endpoints = ", ".join(api_server_endpoint(base, rank) for rank in range(config.api_server_count))
    what = f"{config.api_server_count} API servers, {config.data_parallel_size} data-parallel engines"
    print(f"zllm ready: {config.model_name} on {endpoints} and {url} ({what})", flush=True)
    notifier.ready(f"serving {config.model_name} on {url} ({what})")


async def _feed_watchdog(relay: NotifyRelay, pids: set[int], notifier: SystemdNotifier, interval_s: float) -> None:
    """WATCHDOG=1 to systemd each time every API server has fed its own since the last one."""
    if not notifier.watchdog_interval_s:
        return
    while True:
        if relay.take_watchdog(pids):
            notifier.watchdog()
        await asyncio.sleep(min(interval_s, notifier.watchdog_interval_s / 4))


def _server_env(runtime_dir: str, notify_path: str) -> dict[str, str]:
    """The API servers' environment: this relay as their $NOTIFY_SOCKET (the watchdog, if systemd
    set one for this process, is theirs to feed through it), and prometheus_client's
    multiprocess mode in a private directory, so that each /metrics adds up all servers' figures."""
    metrics_dir = os.path.join(runtime_dir, "metrics")
    shutil.rmtree(metrics_dir, ignore_errors=True)  # a given --runtime-dir may hold a killed run's counts
    os.makedirs(metrics_dir, mode=0o700)
    env = {**os.environ, "NOTIFY_SOCKET": notify_path, MULTIPROCESS_DIR_ENV: metrics_dir}
    env.pop("WATCHDOG_PID", None)
    if not SystemdNotifier().watchdog_interval_s:
        env.pop("WATCHDOG_USEC", None)
    return env


@contextmanager
def _reserved_port(host: str, port: int) -> Iterator[int]:
    """Hold host:port (a free one for port 0) with SO_REUSEPORT, so that every API server binds
    the same one; the socket never listens, so no connection comes to it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers' own sockets
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        yield sock.getsockname()[1]
