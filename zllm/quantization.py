"""Which quantization a model's linear layers use, read from its HF config and the engine flags.

Plain Python (no torch), below every process: the frontend refuses an unsupported
`quantization_config` before any worker starts, and each worker builds its layers from the
resolved `QuantSpec` (zllm/workers/fp8.py holds the arithmetic).

Supported, all FP8 E4M3 weights:
- `--quantization fp8` on an unquantized checkpoint: quantized while loading, one scale per
  output channel; activations quantized per token on the fly ("online").
- compressed-tensors "float-quantized" checkpoints (RedHatAI *-FP8, *-FP8-dynamic, FP8_BLOCK):
  weight scales per tensor, per channel or per 128x128 block; activations dynamic per token,
  static per tensor (`input_scale`), dynamic per 1x128 group, or not quantized (weight-only).
- `quant_method: "fp8"` with `weight_block_size: [128, 128]` (Qwen3 / DeepSeek FP8 releases):
  `weight_scale_inv` per block, activations dynamic per 1x128 group.
A compressed-tensors `kv_cache_scheme` (static per-tensor FP8) adds per-layer key and value
scales, which `--kv-cache-dtype fp8` uses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

QUANTIZATION_METHODS = ("fp8",)  # values of --quantization
CHECKPOINT_FORMATS = ("compressed-tensors (float-quantized, 8-bit float weights)", "fp8 (weight_block_size [128, 128])")
WEIGHT_SCHEMES = ("tensor", "channel", "block")
ACTIVATION_SCHEMES = ("token", "tensor", "group", "none")
BLOCK = 128  # the one block size the block formats use


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """How a model's linear layers hold and multiply their weights.

    weight: "channel" (a scale per output row), "tensor" (one per checkpoint tensor; loaded as a
    scale per row, so fused q/k/v or gate/up parts keep their own), "block" (per 128x128 tile).
    activation: "token" (dynamic, a scale per token), "tensor" (the checkpoint's static
    `input_scale`), "group" (dynamic, a scale per token and 128 input columns), "none" (weight-only).
    """

    source: str  # "online", "compressed-tensors" or "fp8"
    weight: str
    activation: str
    ignore: tuple[str, ...] = ()  # HF module names (or "re:<regex>") left unquantized
    # The checkpoint has a per-tensor FP8 scale for each layer's keys and values
    # (`self_attn.k_scale` / `v_scale`, compressed-tensors' kv_cache_scheme); an FP8 KV cache
    # (--kv-cache-dtype fp8) divides by them, the model-dtype cache ignores them.
    kv_cache_scales: bool = False

    @property
    def serialized(self) -> bool:
        """The checkpoint holds FP8 weights and their scales (not quantized while loading)."""
        return self.source != "online"

    @property
    def block(self) -> bool:
        return self.weight == "block"

    def ignores(self, module_name: str) -> bool:
        """Whether the checkpoint leaves this HF module (e.g. model.layers.0.mlp.down_proj) unquantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], module_name):
                    return True
            elif entry == module_name:
                return True
        return False

    def for_dummy_weights(self) -> QuantSpec:
        """Random weights are quantized while loading: a checkpoint's scheme becomes online,
        per block where the checkpoint is block-scaled, per channel otherwise."""
        weight = "block" if self.block else "channel"
        activation = "group" if self.block else "token"
        return QuantSpec("online", weight, activation)


ONLINE_FP8 = QuantSpec("online", "channel", "token")


def weight_only_blocks(checkpoint: QuantSpec, dummy_weights: bool) -> QuantSpec:
    """A block-FP8 checkpoint of an MoE or MLA model held as stored (ModelSpec.block_fp8 with
    ZLLM_FP8_BLOCKS keep): FP8 weights and 128x128 scales, activations not quantized, so a layer
    computes what the dequantize-at-load path computes; dummy weights are quantized per block."""
    return QuantSpec("online" if dummy_weights else "fp8", "block", "none", checkpoint.ignore)


FP8_BLOCK_MODES = ("auto", "keep", "dequantize")  # values of ZLLM_FP8_BLOCKS


def keeps_fp8_blocks(mode: str, cuda: bool) -> bool:
    """Whether a worker keeps a block-FP8 MoE/MLA checkpoint in FP8 (ZLLM_FP8_BLOCKS): on CUDA by
    default, where its model-dtype copy would not fit (DeepSeek-V3: 1.34 TB in bf16); on CPU the
    dequantized model is the reference."""
    if mode not in FP8_BLOCK_MODES:
        raise ValueError(f"ZLLM_FP8_BLOCKS: {mode!r} is not one of {', '.join(FP8_BLOCK_MODES)}")
    return mode == "keep" or (mode == "auto" and cuda)


def checkpoint_quantization(hf_config) -> QuantSpec | None:
    """The quantization a checkpoint's config.json declares; None for an unquantized one. Any
    method or scheme zllm cannot run is refused here, naming it and what is supported."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    method = config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "fp8":
        return _fp8_block(config)
    if method == "gguf":
        # transformers dequantizes a GGUF file as it loads it, and save_pretrained then writes
        # plain float safetensors, keeping this note in config.json: the model is unquantized.
        return None
    raise _unsupported(f"quant_method {method!r}")


def resolve_quantization(
    checkpoint: QuantSpec | None, requested: str | None, dummy_weights: bool, moe: bool = False
) -> QuantSpec | None:
    """The scheme the workers build: the checkpoint's, else online FP8 when `--quantization fp8`."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: {requested!r} is not supported; supported: {', '.join(QUANTIZATION_METHODS)}")
    spec = checkpoint if checkpoint is not None else (ONLINE_FP8 if requested == "fp8" else None)
    if spec is not None and moe:
        raise ValueError(
            "quantization: FP8 weights for Mixture-of-Experts models are not supported yet (serve the bf16 checkpoint)"
        )
    if spec is not None and spec.serialized and dummy_weights:
        return spec.for_dummy_weights()
    return spec


def _compressed_tensors(config: dict[str, Any]) -> QuantSpec:
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise _unsupported(f"compressed-tensors with {len(groups)} config groups (zllm reads exactly one)")
    group = next(iter(groups.values()))
    fmt = group.get("format") or config.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _unsupported(f"compressed-tensors format {fmt!r}")
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise _unsupported(f'compressed-tensors targets {targets!r} (zllm reads ["Linear"])')
    weights = group.get("weights") or {}
    if not _is_fp8(weights) or weights.get("dynamic"):
        raise _unsupported(f"compressed-tensors weights {_describe(weights)}")
    weight = weights.get("strategy")
    if weight not in WEIGHT_SCHEMES:
        raise _unsupported(f"compressed-tensors weight strategy {weight!r}")
    if weight == "block" and list(weights.get("block_structure") or []) != [BLOCK, BLOCK]:
        raise _unsupported(f"compressed-tensors block_structure {weights.get('block_structure')!r}")
    activation = _compressed_tensors_activation(group.get("input_activations"))
    if (weight == "block") != (activation == "group") and activation != "none":
        raise _unsupported(
            f"compressed-tensors {weight} weight scales with {activation} activation scales "
            f"(zllm pairs 128x128 weight blocks with 1x128 activation groups)"
        )
    kv_scheme = config.get("kv_cache_scheme")
    if kv_scheme and not (
        _is_fp8(kv_scheme) and kv_scheme.get("strategy") == "tensor" and not kv_scheme.get("dynamic")
    ):
        raise _unsupported(
            f"compressed-tensors kv_cache_scheme {_describe(kv_scheme)} "
            "(zllm reads static per-tensor 8-bit float key/value scales)"
        )
    return QuantSpec("compressed-tensors", weight, activation, tuple(config.get("ignore") or ()), bool(kv_scheme))


def _compressed_tensors_activation(acts: dict[str, Any] | None) -> str:
    if not acts:
        return "none"
    if not _is_fp8(acts):
        raise _unsupported(f"compressed-tensors input activations {_describe(acts)}")
    strategy, dynamic = acts.get("strategy"), bool(acts.get("dynamic"))
    if dynamic and strategy == "token":
        return "token"
    if not dynamic and strategy == "tensor":
        return "tensor"
    if dynamic and strategy == "group" and acts.get("group_size") == BLOCK:
        return "group"
    raise _unsupported(f"compressed-tensors input activations {_describe(acts)}")


def _fp8_block(config: dict[str, Any]) -> QuantSpec:
    block = list(config.get("weight_block_size") or [])
    if block != [BLOCK, BLOCK]:
        raise _unsupported(f"quant_method 'fp8' with weight_block_size {block or None} (zllm reads [128, 128])")
    if config.get("fmt", "e4m3") != "e4m3" or config.get("activation_scheme", "dynamic") != "dynamic":
        raise _unsupported(
            f"quant_method 'fp8' with fmt {config.get('fmt')!r}, activation_scheme {config.get('activation_scheme')!r}"
        )
    ignore = config.get("modules_to_not_convert") or config.get("ignored_layers") or ()
    return QuantSpec("fp8", "block", "group", tuple(ignore))


def _is_fp8(args: dict[str, Any]) -> bool:
    return args.get("type") == "float" and args.get("num_bits") == 8 and args.get("symmetric", True)


def _describe(args: dict[str, Any]) -> str:
    keys = ("type", "num_bits", "strategy", "dynamic", "group_size", "symmetric")
    return "{" + ", ".join(f"{k}: {args.get(k)!r}" for k in keys if k in args) + "}"


def _unsupported(what: str) -> ValueError:
    return ValueError(
        f"model: quantization_config {what} is not supported; zllm reads {' and '.join(CHECKPOINT_FORMATS)} "
        f"checkpoints, and quantizes unquantized ones with --quantization fp8"
    )
