"""zllm: a multi-process LLM inference and serving engine.

Public names follow vLLM's offline API (`LLM`, `SamplingParams`, `RequestOutput`). They are
resolved lazily so that importing a light name (e.g. `SamplingParams`) never pulls in torch or
transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY_NAMES = {
    "LLM": "zllm.launch.llm",
    "LLMEngine": "zllm.launch.llm_engine",
    "SamplingParams": "zllm.sampling_params",
    "StructuredOutputsParams": "zllm.sampling_params",
    "RequestOutput": "zllm.outputs",
    "CompletionOutput": "zllm.outputs",
    "Logprob": "zllm.outputs",
    "PoolingParams": "zllm.pooling",
    "PoolingRequestOutput": "zllm.outputs",
    "EmbeddingRequestOutput": "zllm.outputs",
    "ClassificationRequestOutput": "zllm.outputs",
    "ScoringRequestOutput": "zllm.outputs",
    "EngineConfig": "zllm.config",
    "LoRARequest": "zllm.lora",
    "Client": "zllm.client",
    "AsyncClient": "zllm.client",
}

__all__ = list(_LAZY_NAMES) + ["__version__"]

if TYPE_CHECKING:
    from zllm.client import AsyncClient, Client
    from zllm.config import EngineConfig
    from zllm.launch.llm import LLM
    from zllm.launch.llm_engine import LLMEngine
    from zllm.lora import LoRARequest
    from zllm.outputs import (
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingRequestOutput,
        Logprob,
        PoolingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from zllm.pooling import PoolingParams
    from zllm.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'zllm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
