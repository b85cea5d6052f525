"""Model architectures, picked by the HF config's `architectures` / `model_type`."""

from __future__ import annotations

from zllm.workers.models.spec import ModelSpec

_SUPPORTED = {"llama", "mistral"}


def build_model(spec: ModelSpec, ops=None, tp=None):
    from zllm.workers.models.llama import LlamaForCausalLM

    if spec.model_type not in _SUPPORTED:
        raise ValueError(f"model: architecture {spec.model_type!r} is not supported (supported: {sorted(_SUPPORTED)})")
    return LlamaForCausalLM(spec, ops, tp)
