"""`LLMEngine.from_engine_args`: the offline engine, assembled (which is launcher work).

The frontend's `LLMEngine` (zllm/frontend/llm_engine.py) is the request loop over an engine-core
client it is given; it never builds one, so the frontend imports nothing above it. This subclass
adds vLLM's constructor from engine arguments, which builds that client:

    data_parallel_size 1  an engine core and its workers in this process (zllm/launch/inprocess.py)
    data_parallel_size N  N engine-core processes, driven from here (DataParallelCoreClient)

It is the `LLMEngine` that `from zllm import LLMEngine` gives, and the one `LLM` uses.
"""

from __future__ import annotations

from zllm.config import EngineConfig
from zllm.frontend import llm_engine


class LLMEngine(llm_engine.LLMEngine):
    @classmethod
    def from_engine_args(cls, model: str | None = None, **kwargs) -> LLMEngine:
        """An engine whose core and worker run in this process; with data_parallel_size > 1, one
        engine-core process per data-parallel rank instead."""
        config = EngineConfig.create(model, usage="offline", **kwargs)
        return cls(config, build_core_client(config))


def build_core_client(config: EngineConfig) -> llm_engine.EngineCoreClient:
    """The engine core(s) an offline engine drives. Imported only now: the engine core and the
    workers (torch) load when an engine is built, not when `zllm.LLMEngine` is named."""
    if config.data_parallel_size > 1:
        from zllm.frontend.core_client import DataParallelCoreClient

        return DataParallelCoreClient(config)
    from zllm.launch.inprocess import build_inprocess_core

    return build_inprocess_core(config)
