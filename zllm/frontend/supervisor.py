"""Supervision of the engine's processes, run by the frontend process (the launcher).

    launcher ── spawns ──> engine core ── spawns ──> worker × tp
        │                      ▲                        ▲
        └──── watches (pidfd) ─┴────────────────────────┘

`EngineProcesses` starts the engine core, learns the workers' pids from its EngineReady, and
reports the first of them to exit: at once where the kernel offers pidfds (Linux >= 5.3),
else within `_POLL_INTERVAL_S`. `kill()` takes the whole engine down and returns only when every one
of its processes is gone, so their memory (GPU memory included) is free before a restart.
`RestartPolicy` decides whether to restart after a failure and how long to back off before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from collections import deque

import psutil

from zllm.config import EngineConfig
from zllm.procs.children import KILL_WAIT_S, spawn_child

logger = logging.getLogger(__name__)

_POLL_INTERVAL_S = 0.5  # without pidfds: how often the watched processes are polled


class EngineProcesses:
    """The engine core (a child of this process) and its workers (children of the core)."""

    def __init__(self) -> None:
        self.core: subprocess.Popen | None = None
        self.worker_pids: list[int] = []

    def spawn_core(self, config: EngineConfig) -> subprocess.Popen:
        """Start an engine core with this config (its own runtime dir); it starts the workers."""
        # NOTE: call from the main thread: PR_SET_PDEATHSIG fires when the *thread* that spawned
        # the child exits, so a child spawned from a pool thread could be killed at random.
        self.core = spawn_child("zllm.enginecore.process", config)
        self.worker_pids = []
        return self.core

    def adopt_workers(self, pids: list[int]) -> None:
        self.worker_pids = list(pids)

    def _descendants(self) -> list[int]:
        """Workers not reported yet (the engine failed while starting) and their own children."""
        try:
            return [p.pid for p in psutil.Process(self.core.pid).children(recursive=True)] if self.core else []
        except psutil.NoSuchProcess:
            return []

    @property
    def pids(self) -> list[int]:
        return ([self.core.pid] if self.core is not None else []) + self.worker_pids

    def core_exit_code(self) -> int | None:
        return None if self.core is None else self.core.poll()

    async def wait_for_exit(self) -> str:
        """Wait until the engine core or any worker exits; returns which one, in words."""
        names = {self.core.pid: "engine core"} if self.core is not None else {}
        names.update({pid: f"worker rank {rank}" for rank, pid in enumerate(self.worker_pids)})
        pid = await wait_for_any_exit(list(names))
        code = self.core_exit_code() if pid == self.core.pid else None
        return f"{names[pid]} (pid {pid}) exited" + (f" with code {_describe_code(code)}" if code is not None else "")

    async def kill(self) -> None:
        """SIGKILL every engine process; return once all are gone (their memory is freed)."""
        pids = self.pids + [pid for pid in self._descendants() if pid not in self.pids]
        for pid in pids:
            _kill(pid)
        if self.core is not None:
            await asyncio.to_thread(_reap, self.core)
        others = [pid for pid in pids if self.core is None or pid != self.core.pid]  # the core is reaped
        await asyncio.to_thread(_wait_gone, others, KILL_WAIT_S)
        if pids:
            logger.info("engine processes %s are gone", pids)
        self.core, self.worker_pids = None, []


class RestartPolicy:
    """A bounded crash loop: at most `max_restarts` restarts within `window_s` seconds.

    The first restart in a window is immediate (a one-off crash costs only the restart time);
    each further one waits twice as long as the one before (1 s, 2 s, 4 s, ... up to
    `max_backoff_s`), so a crash loop neither spins nor hammers the GPU driver.
    """

    def __init__(self, max_restarts: int, window_s: float, max_backoff_s: float = 30.0, clock=time.monotonic) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._restarts: deque[float] = deque()

    @property
    def recent_restarts(self) -> int:
        self._forget_old()
        return len(self._restarts)

    def next_delay(self) -> float | None:
        """Record a restart and return how long to wait before it; None: give up."""
        self._forget_old()
        if len(self._restarts) >= self.max_restarts:
            return None
        delay = 0.0 if not self._restarts else min(self.max_backoff_s, 2.0 ** (len(self._restarts) - 1))
        self._restarts.append(self._clock() + delay)
        return delay

    def _forget_old(self) -> None:
        cutoff = self._clock() - self.window_s
        while self._restarts and self._restarts[0] < cutoff:
            self._restarts.popleft()


async def first_result(tasks: set[asyncio.Task]):
    """The result (or error) of whichever task finishes first; the others are cancelled."""
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        return done.pop().result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def wait_for_any_exit(pids: list[int]) -> int:
    """Wait until one of `pids` has exited (or is a zombie); return it. Works for non-children."""
    if not pids:
        await asyncio.Event().wait()  # nothing to watch: wait until cancelled
    try:
        return await _wait_pidfds(pids)
    except (AttributeError, OSError):  # no os.pidfd_open (not Linux, kernel < 5.3): poll
        return await _poll_exit(pids)


async def _wait_pidfds(pids: list[int]) -> int:
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[int] = loop.create_future()
    fds: list[int] = []
    try:
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                return pid  # already gone
            fds.append(fd)
            # A pidfd turns readable when its process exits.
            loop.add_reader(fd, lambda p=pid: exited.done() or exited.set_result(p))
        return await exited
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)


async def _poll_exit(pids: list[int]) -> int:
    while True:
        for pid in pids:
            if not _alive(pid):
                return pid
        await asyncio.sleep(_POLL_INTERVAL_S)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_and_wait(pids: list[int]) -> None:
    """SIGKILL these processes (not children of this one) and wait until they are gone."""
    for pid in pids:
        _kill(pid)
    _wait_gone(pids, KILL_WAIT_S)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(process: subprocess.Popen) -> None:
    try:
        process.wait(KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        logger.error("engine core (pid %d) survived SIGKILL for %.0f s", process.pid, KILL_WAIT_S)


def _wait_gone(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            logger.error("processes %s survived SIGKILL for %.0f s", [p for p in pids if _alive(p)], timeout_s)
            return
        time.sleep(0.05)


def _describe_code(code: int) -> str:
    if code >= 0:
        return str(code)
    try:
        return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
        return str(code)
