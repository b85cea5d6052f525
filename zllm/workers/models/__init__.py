"""Model architectures, picked by the HF config's `architectures` (registry in zllm/model_spec.py)."""

from __future__ import annotations

from zllm.model_spec import MODEL_REGISTRY, ModelSpec, unsupported_architecture

__all__ = ["MODEL_REGISTRY", "ModelSpec", "build_model"]


def build_model(spec: ModelSpec, ops=None, tp=None, quant=None, max_model_len: int | None = None):
    """This rank's model for `spec`. Every registered architecture is the shared Llama-family
    decoder (DeepSeek's with MLA attention, models/deepseek.py; a vision-language model adds its
    vision tower: qwen2_vl.py, llava.py); the spec's fields (biases, q/k norm, windows, Gemma's
    norms, ...) carry what differs.
    quant: a QuantSpec for the linear layers (zllm/quantization.py), None for the model dtype;
    max_model_len: the engine's context length (picks LongRoPE's factors)."""
    from zllm.workers.models.llama import LlamaForCausalLM

    if spec.architecture not in MODEL_REGISTRY:
        raise unsupported_architecture(repr(spec.architecture))
    if spec.mla is not None:
        from zllm.workers.models.deepseek import DeepseekForCausalLM

        return DeepseekForCausalLM(spec, ops, tp, quant, max_model_len)
    if spec.vision is not None and spec.vision.kind == "llava":
        from zllm.workers.models.llava import LlavaForConditionalGeneration

        return LlavaForConditionalGeneration(spec, ops, tp, quant, max_model_len)
    if spec.vision is not None:
        from zllm.workers.models.qwen2_vl import Qwen2VLForConditionalGeneration

        return Qwen2VLForConditionalGeneration(spec, ops, tp, quant, max_model_len)
    return LlamaForCausalLM(spec, ops, tp, quant, max_model_len)
