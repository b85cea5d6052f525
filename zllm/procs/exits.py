"""Process exits: waiting for them and forcing them, for children and for any other process.

`stop_children` asks children to stop (SIGTERM; after a grace period where they were told
another way) and kills those that do not in time.
`wait_for_any_exit` reports the first of some processes to exit: at once where the kernel offers
pidfds (Linux >= 5.3), else within `_POLL_INTERVAL_S`. `kill_and_wait` is the one SIGKILL in
zllm: it returns once every process it killed is gone, so their memory (GPU memory included) is
free, or after `KILL_WAIT_S`, reporting those left rather than hanging.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence

import psutil

logger = logging.getLogger(__name__)

KILL_WAIT_S = 30.0  # a process SIGKILLed and still present after this long is reported, not waited on
_POLL_INTERVAL_S = 0.5  # without pidfds: how often the watched processes are polled


def stop_children(processes: list[subprocess.Popen], timeout_s: float, grace_s: float = 0.0) -> None:
    """Wait up to grace_s for them to exit by themselves (children already told to stop some
    other way), then SIGTERM, wait up to timeout_s, then SIGKILL whatever is left."""
    if grace_s > 0:
        grace_end = time.monotonic() + grace_s
        processes = [process for process in processes if not _reaped(process, grace_end)]
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout_s
    kill_and_wait([process for process in processes if not _reaped(process, deadline)])


def kill_and_wait(processes: Sequence[subprocess.Popen | int]) -> None:
    """SIGKILL these processes (children as Popen, which are reaped; others by pid) and return
    once all are gone, or after KILL_WAIT_S (e.g. one stuck in the GPU driver), reporting those left."""
    for process in processes:
        _sigkill(process)
    deadline = time.monotonic() + KILL_WAIT_S
    children = [p for p in processes if isinstance(p, subprocess.Popen)]
    others = [p for p in processes if not isinstance(p, subprocess.Popen)]
    survivors = [child.pid for child in children if not _reaped(child, deadline)]
    while any(_alive(pid) for pid in others) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors += [pid for pid in others if _alive(pid)]
    if survivors:
        logger.error("processes %s survived SIGKILL for %.0f s", survivors, KILL_WAIT_S)


async def wait_for_any_exit(pids: list[int]) -> int:
    """Wait until one of `pids` has exited (or is a zombie); return it. Works for non-children."""
    if not pids:
        await asyncio.Event().wait()  # nothing to watch: wait until cancelled
    try:
        return await _wait_pidfds(pids)
    except (AttributeError, OSError):  # no os.pidfd_open (not Linux, kernel < 5.3): poll
        return await _poll_exit(pids)


def describe_exit_code(code: int) -> str:
    """A return code in words: a negative one names the signal that ended the process."""
    if code >= 0:
        return str(code)
    try:
        return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
        return str(code)


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


def _sigkill(process: subprocess.Popen | int) -> None:
    if isinstance(process, subprocess.Popen):
        process.kill()  # a no-op once the child has been reaped
        return
    try:
        os.kill(process, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reaped(child: subprocess.Popen, deadline: float) -> bool:
    try:
        child.wait(max(0.0, deadline - time.monotonic()))
        return True
    except subprocess.TimeoutExpired:
        return False
