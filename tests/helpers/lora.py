"""LoRA adapters made by the real `peft` package on a transformers model, with random non-zero
A and B (peft starts B at zero, which would make every adapter the base model)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.models import hf_greedy

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class AdapterSpec:
    r: int
    alpha: float
    targets: list[str] = field(default_factory=lambda: list(ALL_TARGETS))
    rslora: bool = False
    std: float = 0.1  # of A's and B's entries


def save_peft_adapters(
    model, directory: Path, specs: dict[str, AdapterSpec], prompts: list[list[int]], max_new_tokens: int
) -> dict[str, list[list[int]]]:
    """Save each adapter (a PEFT directory under `directory`/name) and return transformers+PEFT's
    greedy tokens per adapter for `prompts`. `model` is left as it was (each adapter is unloaded)."""
    import torch
    from peft import LoraConfig, get_peft_model

    references = {}
    for seed, (name, spec) in enumerate(specs.items()):
        config = LoraConfig(
            r=spec.r, lora_alpha=spec.alpha, target_modules=spec.targets, use_rslora=spec.rslora, lora_dropout=0.0
        )
        peft_model = get_peft_model(model, config)
        generator = torch.Generator().manual_seed(1000 + seed)
        with torch.no_grad():
            for param_name, param in peft_model.named_parameters():
                if "lora_A" in param_name or "lora_B" in param_name:
                    param.copy_(torch.randn(param.shape, generator=generator) * spec.std)
        peft_model.save_pretrained(directory / name)
        peft_model.eval()
        references[name] = [hf_greedy(peft_model.get_base_model(), ids, max_new_tokens, None) for ids in prompts]
        model = peft_model.unload()
    return references


MAX_NEW = 8
# One prompt shorter than a 16-token block, two longer: the prefix cache holds their first blocks.
PROMPTS = [[5, 9, 13], list(range(3, 40)), [7] * 5 + list(range(100, 130))]
# alpha != r everywhere; rsLoRA; ranks 2..16; each kind of target module.
SPECS = {
    "all-r8": AdapterSpec(r=8, alpha=16),
    "qv-rslora": AdapterSpec(r=4, alpha=3, targets=["q_proj", "v_proj"], rslora=True),
    "mlp-r16": AdapterSpec(r=16, alpha=7, targets=["gate_proj", "up_proj", "down_proj"]),
    "ko-r2": AdapterSpec(r=2, alpha=5, targets=["k_proj", "o_proj"], std=0.3),
}


def tiny_llama_with_adapters(root: Path, **config) -> tuple[Path, Path, dict[str, list[list[int]]]]:
    """A tiny random Llama (`config` overrides save_tiny_llama's), SPECS' adapters for it, and
    transformers(+PEFT)'s greedy tokens for PROMPTS per adapter name and for "base"."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers.models import save_tiny_llama

    model_dir = save_tiny_llama(root / "base", **config)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    references = {"base": [hf_greedy(model, ids, MAX_NEW, None) for ids in PROMPTS]}
    references |= save_peft_adapters(model, root / "adapters", SPECS, PROMPTS, MAX_NEW)
    for name in SPECS:
        assert references[name] != references["base"], f"adapter {name} changes nothing: a test would be vacuous"
    return model_dir, root / "adapters", references


# ---- ZLLM_LORA_NORM_SHRINK: one decoder layer with adapters on every projection ----------------

NORM_HIDDEN, NORM_SLOTS, NORM_RANK = 64, 4, 8


def tiny_lora_layer(norm_shrink: bool, rows: int, seed: int, device: str = "cpu", hidden_act: str = "silu"):
    """A random fp32 Llama decoder layer (hidden 64, GQA; the ops of `device`; SwiGLU, or GeGLU
    for hidden_act gelu_pytorch_tanh) with random adapters
    in slots 0-2 of every projection, its rows' slots (-1/0/3/2/...) in the kernel path's
    buffers (the fused expand on, the dense path never). Returns (layer, batch, generator)."""
    import sys

    import torch
    from transformers import LlamaConfig

    from zllm.model_spec import ModelSpec
    from zllm.workers.distributed import TensorParallel
    from zllm.workers.lora import LoRABatch, LoRALayer
    from zllm.workers.models.llama import LlamaDecoderLayer
    from zllm.workers.ops import ops_for

    config = LlamaConfig(
        hidden_size=NORM_HIDDEN,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=128,
        hidden_act=hidden_act,
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.device(device):
        layer = LlamaDecoderLayer(
            ModelSpec.from_hf_config(config), ops_for(torch.device(device)), TensorParallel(), 0, None
        )
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2 + (1.0 if param.dim() == 1 else 0.0))
    slots = [[-1, 0, 3, 2, 0, -1, 1, 3][i % 8] for i in range(rows)]
    batch = LoRABatch(token_slots=torch.tensor(slots, dtype=torch.int32, device=device), dense_from=sys.maxsize)
    batch.fused_expand, batch.norm_shrink = True, norm_shrink
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        lora = linear.lora = LoRALayer(linear, NORM_SLOTS, NORM_RANK, batch)
        with torch.no_grad():
            lora.A[:3].copy_(torch.randn(lora.A[:3].shape, generator=gen) * 0.2)
            lora.B[:, :3].copy_(torch.randn(lora.B[:, :3].shape, generator=gen) * 0.2)
    return layer, batch, gen


class ShrinkCounts:
    """How many LoRA shrinks ran alone (ops.lora_shrink), how many inside a norm
    (add_rms_norm_lora_shrink of the layer's ops class) and how many inside the MLP's activation
    (act_and_mul_lora_shrink), while installed by monkeypatch."""

    def __init__(self, monkeypatch, ops_class) -> None:
        from zllm.workers import ops

        self.alone = self.in_norm = self.in_act = 0
        shrink = ops.lora_shrink

        def counted_shrink(*args):
            self.alone += 1
            return shrink(*args)

        def counting(name: str, counter: str):
            fused = getattr(ops_class, name)

            def counted_fused(*args):
                setattr(self, counter, getattr(self, counter) + 1)
                with monkeypatch.context() as inner:
                    inner.setattr(ops, "lora_shrink", shrink)  # the CPU reference's own shrink is not one alone
                    return fused(*args)

            monkeypatch.setattr(ops_class, name, counted_fused)

        monkeypatch.setattr(ops, "lora_shrink", counted_shrink)
        counting("add_rms_norm_lora_shrink", "in_norm")
        counting("act_and_mul_lora_shrink", "in_act")


def run_lora_layer(layer, x, residual, attended):
    """The decoder layer's two token-parallel halves as the runner calls them, attention itself
    stubbed (project returns q/k/v's output): (qkv, layer output, residual)."""
    layer.self_attn.project = lambda x, *_: layer.self_attn.qkv_proj(x)
    qkv, residual = layer.before_attention(x, residual, None, None, None, None)
    out, residual = layer.after_attention(attended, residual)
    return qkv, out, residual
