"""The Llama-family decoder shared by every registered architecture (models/spec.py): GQA
attention, SwiGLU MLP, RMSNorm, RoPE. The spec's flags carry what differs: Qwen2's q/k/v bias,
Qwen3's per-head q/k RMSNorm, Llama's optional attention/MLP bias.

Parameter names mirror HF's, with q/k/v and gate/up fused into one matrix each; the loader
maps HF's separate tensors onto their shard of the fused one.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from zllm.workers.attention import AttentionMetadata
from zllm.workers.layers import rope_cos_sin_cache, rope_inv_freq
from zllm.workers.models.spec import ModelSpec
from zllm.workers.ops import TorchOps


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: TorchOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With: (norm(x + residual), x + residual)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Rotary(nn.Module):
    def __init__(self, spec: ModelSpec, ops: TorchOps) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        cos, sin = rope_cos_sin_cache(inv_freq, spec.max_position_embeddings)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.ops = ops

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rotary(positions, q, k, self.cos, self.sin)


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, ops: TorchOps) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_proj_bias)
        if spec.qk_norm:  # Qwen3: one RMSNorm over head_dim, shared by all heads
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, ops)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, ops)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        self.ops.write_kv(kv_cache, k, v, meta.slot_mapping)
        out = self.ops.attention(q, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, ops: TorchOps) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately so the add fuses into the norm."""

    def __init__(self, spec: ModelSpec, ops: TorchOps) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec, ops)
        self.mlp = LlamaMLP(spec, ops)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: Rotary,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rotary, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, ops: TorchOps) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, ops) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)
        self.rotary = Rotary(spec, ops)


class LlamaForCausalLM(nn.Module):
    # (fused parameter, HF tensor, shard index): HF keeps these as separate matrices.
    STACKED = (
        ("qkv_proj", "q_proj", 0),
        ("qkv_proj", "k_proj", 1),
        ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, spec: ModelSpec, ops: TorchOps | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.model = LlamaModel(spec, ops or TorchOps())
        if spec.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        x, residual = self.model.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, positions, self.model.rotary, kv_cache, meta)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    # ---- weights -------------------------------------------------------------------------------

    def shard_sizes(self, fused_name: str) -> list[int]:
        spec = self.spec
        if fused_name == "qkv_proj":
            kv = spec.num_kv_heads * spec.head_dim
            return [spec.num_heads * spec.head_dim, kv, kv]
        return [spec.intermediate_size, spec.intermediate_size]

    def checkpoint_targets(self, hf_name: str) -> tuple[str, int | None] | None:
        """Map an HF tensor name to (our parameter name, shard index or None); None: not ours."""
        if "rotary_emb.inv_freq" in hf_name:
            return None
        if hf_name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: the embedding serves as the head
        for fused, part, shard in self.STACKED:
            if f".{part}." in hf_name:
                return hf_name.replace(f".{part}.", f".{fused}."), shard
        return hf_name, None

    def checkpoint_name(self, name: str, shard: int | None) -> str:
        """The HF tensor name that fills (parameter, shard): checkpoint_targets reversed."""
        for fused, part, index in self.STACKED:
            if shard == index and f".{fused}." in name:
                return name.replace(f".{fused}.", f".{part}.")
        return name

    def expected_checkpoint_tensors(self) -> Iterator[tuple[str, int | None]]:
        """Every (parameter, shard) that a checkpoint must provide exactly once."""
        params = dict(self.named_parameters())
        fused = {fused for fused, _, _ in self.STACKED}
        for name in params:
            kind = name.rsplit(".", 2)[-2]
            if kind in fused:
                for shard in range(len(self.shard_sizes(kind))):
                    yield name, shard
            else:
                yield name, None

    def parameter_slice(self, param: torch.Tensor, name: str, shard: int | None) -> torch.Tensor:
        """The part of parameter `name` that one checkpoint tensor fills."""
        if shard is None:
            return param.data
        sizes = self.shard_sizes(name.rsplit(".", 2)[-2])
        return param.data.narrow(0, sum(sizes[:shard]), sizes[shard])

