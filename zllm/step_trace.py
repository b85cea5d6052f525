"""Where `ZLLM_STEP_TRACE` lines go: one JSON-lines file per process that traces its steps.

`ZLLM_STEP_TRACE=PATH` makes each engine core write `PATH.dp<rank>.jsonl`
(zllm/enginecore/step_trace.py) and each of its workers `PATH.dp<rank>.worker<tp rank>.jsonl`
(zllm/workers/worker.py), so no two processes share a file. Unset, nothing is opened and the
tracing code is skipped (`benchmarks/step_trace_summary.py` reads the files).
"""

from __future__ import annotations

import json
from typing import IO

from zllm import envs


class TraceFile:
    """One process's trace: a dict per line, line-buffered so a killed process leaves whole lines."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 (lives with its process's engine)

    @classmethod
    def open(cls, name: str) -> TraceFile | None:
        """PATH.<name>.jsonl when ZLLM_STEP_TRACE=PATH is set; None (tracing off) otherwise."""
        prefix = envs.ZLLM_STEP_TRACE
        return cls(f"{prefix}.{name}.jsonl") if prefix else None

    def write(self, line: dict) -> None:
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()
