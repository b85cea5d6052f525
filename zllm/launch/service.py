"""The server's life as a service: start, readiness, watchdog, graceful drain, exit code.

start engine ─> bind client endpoint ─> HTTP API ─> engine answers ─> "zllm ready" + READY=1
    │ every heartbeat: WATCHDOG=1 while the engine steps or answers (or is being restarted)
SIGTERM/SIGINT ─> STOPPING=1, refuse new requests ("draining"), wait for those in flight
    up to shutdown_timeout_s, end the rest ─> exit 0
a second signal ─> kill the engine at once ─> exit 128 + signal
the engine failed for good (on_failure=fail, or the crash loop gave up) ─> exit 1
"""

from __future__ import annotations

import asyncio
import logging
import signal

from zllm.config import EngineConfig
from zllm.launch.sd_notify import SystemdNotifier
from zllm.procs.gc_heap import freeze_startup_heap
from zllm.procs.racing import cancel_and_wait, race

logger = logging.getLogger("zllm.launch")


class Signals:
    """SIGINT/SIGTERM as two events: the first asks for a drain, the second for an exit now.

    second_stops=False (one of several API servers): every signal asks for the drain. Such a
    server may get one signal twice: from systemd, where a unit's KillMode=control-group signals
    the whole group, and forwarded by vllm-launch. vllm-launch itself ends everything at its own
    second signal."""

    def __init__(self, second_stops: bool = True) -> None:
        self.first = asyncio.Event()
        self.second = asyncio.Event()
        self.signum = 0
        self._second_stops = second_stops
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._received, sig)

    def _received(self, signum: int) -> None:
        if self.first.is_set() and not self._second_stops:
            logger.info("%s again: already draining", signal.Signals(signum).name)
            return
        self.signum = signum
        (self.second if self.first.is_set() else self.first).set()
        if self.second.is_set():
            logger.warning("second %s: exiting now", signal.Signals(signum).name)


async def serve_until_signal(config: EngineConfig) -> int:
    """Run the frontend server as a service; returns the process exit code."""
    from zllm.frontend.openai.api_server import ApiServer
    from zllm.frontend.server import CoreStartError, FrontendServer

    server = FrontendServer(config)
    api = ApiServer(server)
    notifier = SystemdNotifier()
    signals = Signals(second_stops=config.api_server_count == 1)
    tasks: list[asyncio.Task] = []
    try:
        starting = asyncio.create_task(server.start())
        if starting not in await race(starting, signals.first):
            logger.info("signal received during start-up: exiting")
            await server.kill_engine()
            return 0
        starting.result()  # raises CoreStartError if the engine could not start
        url = await api.start()
        serving = asyncio.create_task(server.serve(), name="serve")
        answering = asyncio.create_task(server.wait_answering())
        tasks += [serving, answering]
        if answering not in await race(answering, serving, signals.first, keep=(serving,)):
            return await _after_serving(serving, server, signals)
        _announce_ready(server, url, notifier)
        freeze_startup_heap("frontend")
        tasks.append(asyncio.create_task(_report_to_systemd(server, notifier), name="systemd"))
        await race(serving, signals.first, keep=(serving,))
        if serving.done():
            return await _after_serving(serving, server, signals)
        return await _drain(server, serving, signals, notifier)
    except CoreStartError as error:
        logger.error("%s", error)
        return 1
    finally:
        await cancel_and_wait(*tasks)
        await api.stop()
        await server.shutdown()


async def _drain(server, serving: asyncio.Task, signals: Signals, notifier: SystemdNotifier) -> int:
    timeout = server.config.shutdown_timeout_s
    logger.info(
        "%s received: draining %d request(s) (up to %.0f s)",
        signal.Signals(signals.signum).name,
        len(server.requests),
        timeout,
    )
    notifier.stopping(f"draining {len(server.requests)} request(s)")
    server.begin_drain()
    drained = asyncio.create_task(server.wait_drained(timeout))
    await race(drained, serving, signals.second, keep=(serving,))  # drained is cancelled unless it finished
    if signals.second.is_set():
        await server.kill_engine()
        return 128 + signals.signum
    if serving.done():
        return await _after_serving(serving, server, signals)
    if not drained.result():
        left = len(server.requests)
        await server.fail_all(
            f"server shut down before the request finished (shutdown timeout {timeout:.0f} s)", "draining"
        )
        logger.warning("shutdown timeout: ended %d unfinished request(s)", left)
    await cancel_and_wait(serving)
    logger.info("drained: shutting down")
    return 0


async def _after_serving(serving: asyncio.Task, server, signals: Signals) -> int:
    """serve() returned or raised: the engine failed for good, or the frontend itself failed."""
    if not serving.done():
        await cancel_and_wait(serving)  # a signal arrived before the server answered
        return 0
    error = serving.exception()
    if error is not None:
        logger.error("frontend failed", exc_info=error)
    else:
        logger.error("exiting: %s", server.dead_reason)
    return 1


def _announce_ready(server, url: str, notifier: SystemdNotifier) -> None:
    ready = server.ready
    # One of several API servers: vllm-launch says "zllm ready" once all of them are (their
    # READY=1 reaches it, zllm/launch/api_servers.py).
    config = server.config
    who = "zllm" if config.api_server_count == 1 else f"api server {config.api_server_rank}"
    line = (
        f"{who} ready: {ready.model} on {server.client_endpoint} and {url} "
        f"({ready.num_kv_blocks} KV blocks of {ready.block_size} tokens)"
    )
    print(line, flush=True)
    notifier.ready(f"serving {ready.model} on {server.client_endpoint} and {url}")


async def _report_to_systemd(server, notifier: SystemdNotifier) -> None:
    """WATCHDOG=1 while the engine makes progress; STATUS= when the server's state changes."""
    if not notifier.enabled:
        return
    interval = server.config.heartbeat_interval_s
    if notifier.watchdog_interval_s:
        interval = min(interval, notifier.watchdog_interval_s / 2)
    status = ""
    while True:
        if notifier.watchdog_interval_s and server.engine_responsive():
            notifier.watchdog()
        state = _state(server)
        if state != status:
            notifier.status(state)
            status = state
        await asyncio.sleep(interval)


def _state(server) -> str:
    if server.draining:
        return f"draining {len(server.requests)} request(s)"
    if server.recovering:
        return "restarting the engine after a failure"
    return f"serving {server.ready.model} on {server.client_endpoint} ({server.num_restarts} engine restart(s))"
