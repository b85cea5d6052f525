"""The processes of one engine: its engine core (a child of this process) and the core's workers.

    launcher ── spawns ──> engine core ── spawns ──> worker × tp
        │                      ▲                        ▲
        └──── watches (pidfd) ─┴────────────────────────┘

`EngineProcesses` starts the engine core, learns the workers' pids from its EngineReady, and
reports the first of them to exit. `kill()` takes the whole engine down and returns only when
every one of its processes is gone, so their memory (GPU memory included) is free before a
restart. The frontend supervises its engines with it (whether to restart is the frontend's
decision: zllm/frontend/restart_policy.py), the offline data-parallel client starts its cores
with it (and stops them with procs/exits.py), and a node agent runs the engine cores placed on its node with it.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess

import psutil

from zllm.config import EngineConfig
from zllm.procs.children import spawn_child
from zllm.procs.exits import describe_exit_code, kill_and_wait, wait_for_any_exit

logger = logging.getLogger(__name__)


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
        exited = f"{names[pid]} (pid {pid}) exited"
        return exited if code is None else f"{exited} with code {describe_exit_code(code)}"

    async def kill(self) -> None:
        """SIGKILL every engine process; return once all are gone (their memory is freed)."""
        pids = self.pids + [pid for pid in self._descendants() if pid not in self.pids]
        # The core is this process's child: killed through its Popen, so that it is reaped too.
        processes = [self.core, *pids[1:]] if self.core is not None else pids
        await asyncio.to_thread(kill_and_wait, processes)
        if pids:
            logger.info("engine processes %s are gone", pids)
        self.core, self.worker_pids = None, []
