"""When the frontend restarts a failed engine: a bounded crash loop with back-off.

How an engine's processes are started, watched and killed is zllm/procs/engine_processes.py;
whether and when to start them again after a failure is this frontend decision.
"""

from __future__ import annotations

import time
from collections import deque


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
