"""The shape of a model, read once from its HF config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelSpec:
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
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hf_config(cls, hf_config) -> "ModelSpec":
        num_heads = hf_config.num_attention_heads
        rope = _rope_parameters(hf_config)
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"model: hidden_act {act!r} is not supported (only silu)")
        return cls(
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
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"},
        )

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "ModelSpec":
        from transformers import AutoConfig

        return cls.from_hf_config(AutoConfig.from_pretrained(model_dir))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


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
