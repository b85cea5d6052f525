"""FP8 references computed by other code than zllm's: compressed-tensors checkpoints with that
library's own fake-quantized outputs, per-token fake quantization, transformers' model with its
keys and values rounded as the FP8 KV cache stores them, and a passage's perplexity."""

from __future__ import annotations

import contextlib
import math
import shutil
from pathlib import Path

import torch

from tests.helpers.engine import PROMPTS
from tests.helpers.models import hf_greedy
from zllm.workers.attention import KV_FP8
from zllm.workers.fp8 import E4M3

MAX_TOKENS = 20  # the greedy tokens of each reference here
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# ---- compressed-tensors checkpoints, written and run by compressed-tensors itself ---------------


def write_compressed_tensors(src: Path, out: Path, scheme: str, ignore: list[str]) -> list[list[int]]:
    """Quantize the HF model in `src` with compressed-tensors' preset `scheme` ("FP8_DYNAMIC":
    per-channel weights, dynamic per-token activations; "FP8": per-tensor weights and static
    input scales), save it compressed to `out`, and return compressed-tensors' own greedy outputs
    (its fake-quantized forward) for PROMPTS: the reference."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams, is_module_quantized
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    apply_quantization_config(model, QuantizationConfig(config_groups={scheme: ["Linear"]}, ignore=ignore))
    quantized = {name: m for name, m in model.named_modules() if is_module_quantized(m)}
    input_amax = _calibrate_input_amax(model, quantized) if scheme == "FP8" else {}
    for name, module in quantized.items():
        scheme_args, w = module.quantization_scheme, module.weight.detach()
        if scheme_args.weights.strategy == "channel":
            low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:
            low, high = w.amin().reshape(1), w.amax().reshape(1)
        scale, zero = calculate_qparams(low, high, scheme_args.weights)
        update_offload_parameter(module, "weight_scale", scale)
        update_offload_parameter(module, "weight_zero_point", zero)
        if name in input_amax:
            amax = input_amax[name].reshape(1)
            scale, zero = calculate_qparams(-amax, amax, scheme_args.input_activations)
            update_offload_parameter(module, "input_scale", scale)
            update_offload_parameter(module, "input_zero_point", zero)
        module.quantization_status = QuantizationStatus.FROZEN
    reference = [hf_greedy(model, p, MAX_TOKENS, eos_token_id=None) for p in PROMPTS]
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    copy_tokenizer(src, out)
    return reference


def _calibrate_input_amax(model, quantized: dict) -> dict[str, torch.Tensor]:
    """Static input scales: each quantized layer's largest input over the prompts (the observer
    llm-compressor would run), with quantization off meanwhile."""
    amax, hooks = {}, []
    for name, module in quantized.items():

        def record(mod, args, name=name):
            value = args[0].detach().abs().amax().float()
            amax[name] = torch.maximum(amax.get(name, value), value)

        hooks.append(module.register_forward_pre_hook(record))
        module.quantization_enabled = False
    with torch.no_grad():
        for prompt in PROMPTS:
            model(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    for module in quantized.values():
        module.quantization_enabled = True
    return amax


def copy_tokenizer(src: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)


def token_fake_quant(x: torch.Tensor, ranks: int) -> torch.Tensor:
    """Per-token FP8 quantization of each rank's columns: a row-parallel layer's ranks each
    quantize the slice of the activation they hold (as vLLM's do), so at tp 2 a token has one
    scale per half of o_proj's and down_proj's input."""
    parts = []
    for part in x.chunk(ranks, dim=-1):
        scale = part.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
        parts.append((part / scale).clamp(-448, 448).to(E4M3).float() * scale)
    return torch.cat(parts, dim=-1)


# ---- the FP8 KV cache's rounding, in transformers ------------------------------------------------


def _fake_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x through an E4M3 store and load with this scale (plain torch, the cache's arithmetic)."""
    return ((x.float() * (1.0 / scale)).clamp(-448, 448).to(KV_FP8).float() * scale).to(x.dtype)


@contextlib.contextmanager
def fp8_kv_rounding(model, scales: list[tuple[float, float]] | None = None):
    """Within the block, every layer's rotated keys and its values go through FP8 (scales per
    layer: (k, v)) before they reach attention or HF's cache."""
    from transformers.models.llama import modeling_llama

    scales = scales or [(1.0, 1.0)] * len(model.model.layers)
    layer = [0]
    rotary = modeling_llama.apply_rotary_pos_emb

    def rotary_then_round_keys(q, k, cos, sin, *args, **kwargs):
        q, k = rotary(q, k, cos, sin, *args, **kwargs)
        return q, _fake_fp8(k, scales[layer[0]][0])

    hooks = []
    for index, decoder in enumerate(model.model.layers):
        hooks.append(
            decoder.self_attn.register_forward_pre_hook(lambda mod, args, index=index: layer.__setitem__(0, index))
        )
        hooks.append(
            decoder.self_attn.v_proj.register_forward_hook(
                lambda mod, args, out, index=index: _fake_fp8(out, scales[index][1])
            )
        )
    modeling_llama.apply_rotary_pos_emb = rotary_then_round_keys
    try:
        yield model
    finally:
        modeling_llama.apply_rotary_pos_emb = rotary
        for hook in hooks:
            hook.remove()


# ---- the real model ------------------------------------------------------------------------------


PASSAGE = (
    "The river starts as snowmelt high in the mountains, where thin streams gather in a stony basin before "
    "spilling over a ledge into the valley. Farmers along its banks have drawn water from it for centuries, "
    "building small channels that carry it to orchards and fields of barley. In spring the current grows fast "
    "and brown with silt; by late summer it slows, clears, and children wade across the shallows."
)


def perplexity(model_dir: str, **engine_args) -> float:
    from zllm import LLM, SamplingParams

    llm = LLM(model_dir, **engine_args)
    try:
        ids = llm.get_tokenizer().encode(PASSAGE)
        [out] = llm.generate(
            [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
        )
    finally:
        llm.shutdown()
    nll = -sum(entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])) / (len(ids) - 1)
    return math.exp(nll)
