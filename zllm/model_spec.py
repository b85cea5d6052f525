"""The shape of a model, read once from its HF config, and the registry of supported architectures.

Plain Python (no torch, no worker code), below every process: `EngineConfig.create` reads the
spec in the frontend to refuse an unsupported architecture, to size `max_model_len` and to check
the tensor-parallel split before any worker starts; the workers build their model from it
(zllm/workers/models/).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zllm.quantization import QuantSpec, checkpoint_quantization

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True, slots=True)
class Architecture:
    """How one HF architecture differs from plain Llama. A bias flag left None follows the
    config (`attention_bias` for q/k/v and o, `mlp_bias` for the MLP), as HF's Llama does."""

    qkv_bias: bool | None = None
    o_proj_bias: bool | None = None
    mlp_bias: bool | None = None
    qk_norm: bool = False  # RMSNorm over head_dim on each query and key head, before rotary
    moe: MoeFormat | None = None  # a Mixture-of-Experts model: how its config and checkpoint say so


@dataclass(frozen=True, slots=True)
class MoeFormat:
    """Where an MoE architecture keeps its experts: the config's field names and the checkpoint's
    tensor names (`model.layers.N.<block>.experts.E.<gate|up|down>.weight`)."""

    block: str  # the MoE block's name in a layer: "block_sparse_moe" (Mixtral) or "mlp" (Qwen)
    expert_parts: tuple[str, str, str]  # gate, up, down projections of one expert
    num_experts_key: str
    intermediate_key: str
    always_renormalize: bool = False  # Mixtral renormalizes the top-k always; Qwen per norm_topk_prob
    fp32_routing_weights: bool = False  # Mixtral keeps the weights fp32; Qwen casts them to the model dtype
    sparse_layer_keys: bool = False  # Qwen: decoder_sparse_step and mlp_only_layers pick the MoE layers


_MIXTRAL = MoeFormat(
    "block_sparse_moe",
    ("w1", "w3", "w2"),
    "num_local_experts",
    "intermediate_size",
    always_renormalize=True,
    fp32_routing_weights=True,
)
_QWEN_MOE = MoeFormat(
    "mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", "moe_intermediate_size", sparse_layer_keys=True
)


# Keyed by `config.architectures`; every entry is the shared decoder in models/llama.py.
MODEL_REGISTRY: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(),  # Llama 2, 3, 3.1, 3.2; SmolLM2
    "MistralForCausalLM": Architecture(qkv_bias=False, o_proj_bias=False, mlp_bias=False),
    "Qwen2ForCausalLM": Architecture(qkv_bias=True, o_proj_bias=False, mlp_bias=False),  # Qwen2, Qwen2.5
    "Qwen3ForCausalLM": Architecture(mlp_bias=False, qk_norm=True),
    "MixtralForCausalLM": Architecture(qkv_bias=False, o_proj_bias=False, mlp_bias=False, moe=_MIXTRAL),
    "Qwen2MoeForCausalLM": Architecture(qkv_bias=True, o_proj_bias=False, mlp_bias=False, moe=_QWEN_MOE),
    "Qwen3MoeForCausalLM": Architecture(mlp_bias=False, qk_norm=True, moe=_QWEN_MOE),
}
# Configs without `architectures` (hand-written, or converted from GGUF by older zllm).
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Tokens a query may look back (HF: key kept when query - key < sliding_window); None: all.
    sliding_window: int | None = None
    checkpoint_dtype: str | None = None  # the config's torch_dtype, e.g. "bfloat16"
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    moe: MoeSpec | None = None  # None: a dense model
    quantization: QuantSpec | None = None  # the checkpoint's (config.json quantization_config); None: none

    @classmethod
    def from_hf_config(cls, hf_config) -> ModelSpec:
        architecture = pick_architecture(hf_config)
        arch = MODEL_REGISTRY[architecture]
        num_heads = hf_config.num_attention_heads
        rope = _rope_parameters(hf_config)
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"model: hidden_act {act!r} is not supported (only silu)")
        if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"model: rope_type {rope['rope_type']!r} is not supported {SUPPORTED_ROPE_TYPES}")
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return cls(
            architecture=architecture,
            model_type=hf_config.model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
            intermediate_size=hf_config.intermediate_size,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=attention_bias if arch.qkv_bias is None else arch.qkv_bias,
            o_proj_bias=attention_bias if arch.o_proj_bias is None else arch.o_proj_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)) if arch.mlp_bias is None else arch.mlp_bias,
            qk_norm=arch.qk_norm,
            sliding_window=_sliding_window(hf_config),
            checkpoint_dtype=_checkpoint_dtype(hf_config),
            rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"},
            moe=None if arch.moe is None else MoeSpec.from_hf_config(hf_config, arch.moe),
            quantization=checkpoint_quantization(hf_config),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str) -> ModelSpec:
        from transformers import AutoConfig

        return cls.from_hf_config(AutoConfig.from_pretrained(model_dir))


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """The experts of an MoE model. Routing as transformers does it: softmax over all experts in
    fp32, the top k, renormalized if `renormalize`; layers outside `layers` keep a dense MLP of
    the config's `intermediate_size`."""

    format: MoeFormat
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    shared_expert_intermediate_size: int  # 0: no shared expert (Qwen2-MoE has one, with a sigmoid gate)
    renormalize: bool
    layers: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, hf_config, fmt: MoeFormat) -> MoeSpec:
        num_experts = int(getattr(hf_config, fmt.num_experts_key))
        num_layers = hf_config.num_hidden_layers
        layers = tuple(range(num_layers))
        if fmt.sparse_layer_keys:
            step = getattr(hf_config, "decoder_sparse_step", 1) or 1
            dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
            layers = tuple(i for i in layers if i not in dense and num_experts > 0 and (i + 1) % step == 0)
        top_k = int(hf_config.num_experts_per_tok)
        if layers and not 0 < top_k <= num_experts:
            raise ValueError(f"model: num_experts_per_tok {top_k} must be in 1..{num_experts} (the number of experts)")
        return cls(
            format=fmt,
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=int(getattr(hf_config, fmt.intermediate_key)),
            shared_expert_intermediate_size=int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0),
            renormalize=fmt.always_renormalize or bool(getattr(hf_config, "norm_topk_prob", False)),
            layers=layers,
        )


def pick_architecture(hf_config) -> str:
    """The first of the config's `architectures` that zllm implements (as vLLM picks)."""
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names and getattr(hf_config, "model_type", None) in _BY_MODEL_TYPE:
        names = [_BY_MODEL_TYPE[hf_config.model_type]]
    for name in names:
        if name in MODEL_REGISTRY:
            return name
    raise unsupported_architecture(names or f"none (model_type {getattr(hf_config, 'model_type', None)!r})")


def unsupported_architecture(found) -> ValueError:
    return ValueError(
        f"model: architecture {found} is not supported; supported architectures: {', '.join(sorted(MODEL_REGISTRY))}"
    )


def _sliding_window(hf_config) -> int | None:
    """The window of the model's sliding-window layers, None when every layer attends to all.

    Mistral sets `sliding_window` for every layer (null in v0.2 and later); Qwen2/Qwen3 keep it
    only with `use_sliding_window`, for the layers `layer_types` marks "sliding_attention".
    """
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _checkpoint_dtype(hf_config) -> str | None:
    """The config's dtype as a name ("bfloat16"); transformers 5 calls it `dtype`, 4.x `torch_dtype`."""
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _rope_parameters(hf_config) -> dict[str, Any]:
    """transformers >= 5 keeps rope settings in `rope_parameters`; 4.x in rope_theta/rope_scaling."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    return params
