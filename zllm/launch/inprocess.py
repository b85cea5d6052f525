"""Assemble an engine core and its worker in the calling process (offline use and tests)."""

from __future__ import annotations

from zllm.config import EngineConfig
from zllm.enginecore.core import EngineCore


def build_inprocess_core(config: EngineConfig) -> EngineCore:
    from zllm.workers.worker import Worker

    return EngineCore(config, Worker(config))
