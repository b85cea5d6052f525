"""An opt-in per-step trace of one engine core: `ZLLM_STEP_TRACE=PATH` (docs/configuration.md).

Each engine core appends one JSON line per `EngineCore.step()` to `PATH.dp<rank>.jsonl` (one file
per data-parallel engine; zllm/step_trace.py). A line says when the step ran, how
long the core spent in it and waited for the workers, how long it had been away since the last
one (idle, or busy elsewhere: the offline loop's own work at dp 1), what it submitted, what it
collected, and the queues after it:

    {"dp": 0, "t": 1764223151.2041, "gap_s": 0.0002, "busy_s": 0.0141, "wait_s": 0.0113,
     "arrived": 0, "step_id": 57, "reqs": 250, "tokens": 250, "new": 0, "prefill_tokens": 0,
     "collected": 1, "deltas": 250, "finished": 0, "running": 250, "waiting": 0, "preemptions": 0}

`arrived` counts the requests added since the previous line (`arrived_t0`, `arrived_t1`: the
first's and the last's time.time(), present when any came): where they cluster shows how the
frontend fed this engine. `step_id` and the fields after it up to `prefill_tokens` describe the
step submitted in this call (absent when none was); under async scheduling a call may submit
without collecting, or collect without submitting. Off (the default) the core holds None and
each step pays one `is None` test.
"""

from __future__ import annotations

import time

from zllm.ipc.messages import StepInput, TokenDelta
from zllm.step_trace import TraceFile


class StepTrace:
    """Collects what one engine core's step did and writes it as one line."""

    def __init__(self, file: TraceFile, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self._file = file
        self._last_end = time.monotonic()
        self._arrived = 0
        self._first_arrival = self._last_arrival = 0.0  # time.time() of the first and last of them
        self._submitted: StepInput | None = None
        self._wait_s = 0.0

    @classmethod
    def from_env(cls, dp_rank: int) -> StepTrace | None:
        """The trace ZLLM_STEP_TRACE asks for, or None (off)."""
        file = TraceFile.open(f"dp{dp_rank}")
        return None if file is None else cls(file, dp_rank)

    def arrived(self) -> None:
        now = time.time()
        if not self._arrived:
            self._first_arrival = now
        self._arrived, self._last_arrival = self._arrived + 1, now

    def submitted(self, step: StepInput) -> None:
        self._submitted = step

    def waited(self, seconds: float) -> None:
        """Time this step spent waiting for the workers' answer (collect)."""
        self._wait_s += seconds

    def record(self, started: float, deltas: list[TokenDelta], collected: int, scheduler) -> None:
        """One line for the step() call that began at `started` (time.monotonic())."""
        ended = time.monotonic()
        line = {
            "dp": self.dp_rank,
            "t": round(time.time(), 6),
            "gap_s": round(started - self._last_end, 6),
            "busy_s": round(ended - started, 6),
            "wait_s": round(self._wait_s, 6),
            "arrived": self._arrived,
            **self._arrivals(),
            **_describe(self._submitted),
            "collected": collected,
            "deltas": len(deltas),
            "finished": sum(d.finish_reason is not None for d in deltas),
            "running": len(getattr(scheduler, "running", ())),
            "waiting": len(scheduler.waiting),
            "preemptions": getattr(scheduler, "num_preemptions", 0),
        }
        self._file.write(line)
        self._last_end, self._arrived, self._submitted, self._wait_s = ended, 0, None, 0.0

    def _arrivals(self) -> dict[str, float]:
        if not self._arrived:
            return {}
        return {"arrived_t0": round(self._first_arrival, 6), "arrived_t1": round(self._last_arrival, 6)}

    def close(self) -> None:
        self._file.close()


def _describe(step: StepInput | None) -> dict[str, int]:
    if step is None:
        return {}
    tokens = step.num_scheduled_tokens
    return {
        "step_id": step.step_id,
        "reqs": len(step.scheduled_ids),
        "tokens": sum(tokens),
        "new": len(step.new_requests),
        "prefill_tokens": sum(n for n in tokens if n > 1),
    }
