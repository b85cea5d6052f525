"""LoRA adapters as the frontend, the engine core and the workers see them: vLLM's `LoRARequest`
(which travels inside the request messages) and the checks of a PEFT adapter directory against
the base model, made before any tensor is read.

A PEFT directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`,
`target_modules`) and `adapter_model.safetensors`, whose tensors are named

    base_model.model.model.layers.<L>.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.<L>.self_attn.q_proj.lora_B.weight   [out, r]

and add `scaling * B @ A @ x` to the projection's output, with scaling = lora_alpha / r
(rsLoRA: lora_alpha / sqrt(r)). The checks read only the config and the safetensors header
(plain JSON), so the frontend refuses a bad adapter without torch.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from zllm.model_spec import ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# HF projection name -> (zllm's fused module, part index in it or None for an unfused one).
TARGET_MODULES: dict[str, tuple[str, int | None]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
}
# One LoRA matrix of one projection in a PEFT checkpoint.
_TENSOR = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """vLLM's LoRARequest(lora_name, lora_int_id, lora_path): which adapter serves a request.
    lora_int_id >= 1 identifies the adapter everywhere (caches, slots, prefix-cache keys)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_request: lora_int_id must be >= 1, got {self.lora_int_id}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True, slots=True)
class LoRATensor:
    """One A or B matrix of an adapter, as the safetensors header names it."""

    name: str
    layer: int
    module: str  # an HF projection name (q_proj ...)
    matrix: str  # "A" or "B"
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """A checked adapter: its tensors and the scaling of each projection (rank from its shape)."""

    path: str
    rank: int  # the largest of its projections
    tensors: tuple[LoRATensor, ...]
    scaling: dict[tuple[int, str], float]  # (layer, HF projection) -> lora_alpha / r (or / sqrt(r))


def projection_shape(spec: ModelSpec, module: str) -> tuple[int, int]:
    """(in, out) features of an HF projection of this model."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    h, inter = spec.hidden_size, spec.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }[module]


def check_adapter(path: str, spec: ModelSpec, max_rank: int) -> AdapterInfo:
    """Read and check a PEFT adapter directory against the base model; ValueError says what is
    wrong (missing or broken files, an unsupported option, a rank above max_rank, a shape the
    base model does not have)."""
    config = _read_config(path)
    tensors = _read_tensors(path)
    rank = 0
    scaling = {}
    by_key: dict[tuple[int, str], dict[str, LoRATensor]] = {}
    for tensor in tensors:
        by_key.setdefault((tensor.layer, tensor.module), {})[tensor.matrix] = tensor
    for (layer, module), pair in sorted(by_key.items()):
        r = _check_pair(path, spec, layer, module, pair, max_rank)
        rank = max(rank, r)
        alpha = float(config.get("lora_alpha", 8))
        scaling[(layer, module)] = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    if not tensors:
        raise ValueError(f"lora adapter {path}: {WEIGHTS_FILE} holds no lora_A/lora_B weights")
    return AdapterInfo(path=path, rank=rank, tensors=tuple(tensors), scaling=scaling)


def _read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"lora adapter {path}: no {CONFIG_FILE} (a PEFT adapter directory has one)") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"lora adapter {path}: cannot read {CONFIG_FILE}: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"lora adapter {path}: {CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora adapter {path}: peft_type {config.get('peft_type')!r} is not LORA")
    unsupported = [
        ("use_dora", bool(config.get("use_dora"))),
        ("alpha_pattern", bool(config.get("alpha_pattern"))),
        ("modules_to_save", bool(config.get("modules_to_save"))),
        ("bias", config.get("bias", "none") != "none"),
    ]
    for option, used in unsupported:
        if used:
            raise ValueError(f"lora adapter {path}: {option} is not supported (got {config.get(option)!r})")
    return config


def _read_tensors(path: str) -> list[LoRATensor]:
    """The adapter's tensors from the safetensors header (8-byte length, then JSON)."""
    file = os.path.join(path, WEIGHTS_FILE)
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise ValueError(f"lora adapter {path}: no {WEIGHTS_FILE}") from None
    except (OSError, struct.error, ValueError) as error:
        raise ValueError(f"lora adapter {path}: {WEIGHTS_FILE} is not a safetensors file: {error}") from None
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        match = _TENSOR.match(name)
        if match is None:
            raise ValueError(
                f"lora adapter {path}: tensor {name!r} is not a LoRA matrix of a supported projection "
                f"({', '.join(TARGET_MODULES)})"
            )
        layer, module, matrix = int(match.group(1)), match.group(2), match.group(3)
        tensors.append(LoRATensor(name, layer, module, matrix, tuple(entry.get("shape", ()))))
    return tensors


def _check_pair(path: str, spec: ModelSpec, layer: int, module: str, pair: dict[str, LoRATensor], max_rank: int):
    """The rank of one projection's A and B, after checking them against the base model."""
    where = f"lora adapter {path}: layers.{layer}.{module}"
    if module not in TARGET_MODULES:
        raise ValueError(f"{where}: target module {module!r} is not supported; targets: {', '.join(TARGET_MODULES)}")
    if not 0 <= layer < spec.num_layers:
        raise ValueError(f"{where}: the base model has {spec.num_layers} layers")
    if set(pair) != {"A", "B"}:
        raise ValueError(f"{where}: has lora_{''.join(pair)} without its other matrix")
    a, b = pair["A"].shape, pair["B"].shape
    if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
        raise ValueError(f"{where}: lora_A {list(a)} and lora_B {list(b)} are not [r, in] and [out, r]")
    rank = a[0]
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} is above max_lora_rank ({max_rank})")
    expected_in, expected_out = projection_shape(spec, module)
    if (a[1], b[0]) != (expected_in, expected_out):
        raise ValueError(
            f"{where}: adapts a {a[1]} -> {b[0]} projection, but the base model's is {expected_in} -> {expected_out} "
            "(an adapter of another base model)"
        )
    return rank
