"""Child processes: how they are started, and how they die with their parent (how a parent
stops them: zllm/procs/exits.py).

Children are fresh interpreters (`python -m <module>`), handed the EngineConfig as JSON on
stdin: no fork of a process with threads, and no pickle anywhere. Each child arranges to die
with its parent twice over: PR_SET_PDEATHSIG (Linux) delivers SIGTERM the moment the parent
goes, and a watchdog thread exits if the process is re-parented (covers the race where the
parent died before prctl ran, and systems without prctl).
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from zllm import envs
from zllm.config import EngineConfig
from zllm.ipc.codec import decode_json, encode_json
from zllm.procs.log import configure_logging

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_TEARDOWN_LIMIT_S = 60  # a child told to stop (SIGTERM) that has not exited by then is killed by SIGALRM


def spawn_child(
    module: str, config: EngineConfig, *args: str, env: dict[str, str] | None = None, new_session: bool = False
) -> subprocess.Popen:
    """Start `python -m module args...` with the config on its stdin (and `env` as its
    environment; None: this process's). new_session: out of this process's process group, so
    that a signal to the group (Ctrl-C in a terminal) reaches it only as the parent forwards it."""
    command = [sys.executable, "-m", module, *args]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, env=env, start_new_session=new_session)
    assert process.stdin is not None
    process.stdin.write(encode_json(config))
    process.stdin.close()
    return process


def read_config_from_stdin() -> EngineConfig:
    return decode_json(sys.stdin.buffer.read(), EngineConfig)


def die_with_parent(check_interval_s: float) -> None:
    """Call first thing in a child process."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the watchdog below still applies
    if os.getppid() != parent:
        os._exit(1)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    thread = threading.Thread(target=_watch_parent, args=(parent, check_interval_s), daemon=True, name="parent-watch")
    thread.start()


def install_hang_dump() -> None:
    """With $ZLLM_DEBUG_HANG_S=N set, dump every thread's stack to stderr every N seconds."""
    value = envs.ZLLM_DEBUG_HANG_S  # read as text: a bad value warns here rather than crashing the process
    if not value:
        return
    try:
        seconds = float(value)
    except ValueError:
        logger.warning("ZLLM_DEBUG_HANG_S=%r is not a number of seconds; no stack dumps", value)
        return
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, repeat=True, file=sys.stderr, exit=False)
        logger.info("ZLLM_DEBUG_HANG_S: dumping every thread's stack to stderr every %.0f s", seconds)


def _exit_on_sigterm(signum, frame) -> None:
    # The exit unwinds through finally blocks and interpreter teardown (process groups, CUDA),
    # where the parent watchdog thread no longer runs: a default-action SIGALRM ends the process
    # if that teardown hangs.
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(_TEARDOWN_LIMIT_S)
    raise SystemExit(128 + signum)


def _watch_parent(parent: int, interval: float) -> None:
    while True:
        time.sleep(interval)
        if os.getppid() != parent:
            logger.error("parent process %d is gone; exiting", parent)
            os._exit(1)


def setup_child_logging(name: str) -> None:
    configure_logging(name)
