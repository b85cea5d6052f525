"""Model building blocks in plain torch: the CPU path and the oracle for the CUDA kernels.

Each op follows HF transformers' Llama arithmetic step by step (same dtype casts, same order),
so that fp32 results match HF's to the last bit wherever the underlying kernels agree.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from zllm.model_spec import yarn_mscale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """Llama's RMSNorm: normalized in fp32, rounded to the input dtype, times w. unit_offset:
    Gemma's, which multiplies by (1 + w) in fp32 and rounds once, at the end."""
    input_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    if unit_offset:
        return (x * (1.0 + weight.float())).to(input_dtype)
    return weight * x.to(input_dtype)


def rounded_to(value: float, dtype: torch.dtype) -> float:
    """A Python float rounded to `dtype`: multiplying a tensor of that dtype by it gives what HF's
    multiplication by a 0-dim tensor of that dtype gives (Gemma's embedding scale)."""
    return float(torch.tensor(value, dtype=torch.float32).to(dtype))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma's MLP): gelu_pytorch_tanh(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def moe_route(
    logits: torch.Tensor, top_k: int, renormalize: bool, fp32_weights: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Mixture-of-Experts router's choice as transformers makes it: (top-k weights [T, k],
    expert ids [T, k]) from router logits [T, E]; softmax over all experts in fp32, the k largest,
    renormalized if the model says so, cast back to the logits' dtype unless it keeps fp32."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if fp32_weights else weights.to(logits.dtype)), experts


def grouped_route(
    logits: torch.Tensor,
    top_k: int,
    routing: str,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling_factor: float,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's router as transformers has it (DeepseekV2TopkRouter, DeepseekV3TopkRouter):
    (fp32 weights [T, k], expert ids [T, k]) from fp32 router logits [T, E].

    V2 ("greedy", "group_limited_greedy"): softmax scores; grouped, the experts outside the
    topk_group groups whose best expert scores highest are zeroed before the top k. V3
    ("noaux_tc"): sigmoid scores; the choice (not the weights) adds correction_bias, ranks the
    groups by the sum of their two best, masks the others to -inf; the chosen experts' scores,
    renormalized (+1e-20) if asked. Both times scaling_factor."""
    num_experts = logits.shape[-1]
    if routing == "noaux_tc":
        scores = logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias
        grouped = choice.view(-1, n_group, num_experts // n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(~_group_mask(group_scores, topk_group, num_experts), float("-inf"))
        ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * scaling_factor, ids
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if routing == "group_limited_greedy":
        group_scores = scores.view(-1, n_group, num_experts // n_group).max(dim=-1).values
        scores = scores.masked_fill(~_group_mask(group_scores, topk_group, num_experts), 0.0)
    weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return weights * scaling_factor, ids


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """[T, E] bool: the experts of each token's topk_group best groups."""
    n_group = group_scores.shape[-1]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    return mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts).bool()


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any], long_context: bool = False) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding over `rotary_dim` dims, with the configured
    scaling: llama3, linear (Gemma 3's global layers), or longrope (Phi-3), whose long factors
    apply when `long_context` (see rope_uses_long_factors)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "longrope":
        factors = torch.tensor(scaling["long_factor" if long_context else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, theta, scaling)
    raise ValueError(f"model: rope_type {rope_type!r} is not supported (default, llama3, linear, longrope, yarn)")


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (HF's _compute_yarn_parameters): frequencies that turn fewer than beta_slow times over
    the original context are interpolated (divided by factor), those that turn more than
    beta_fast times kept, a linear ramp between."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_uses_long_factors(scaling: dict[str, Any], max_model_len: int) -> bool:
    """Whether a longrope model rotates by its long factors: once for the whole engine, when
    max_model_len exceeds original_max_position_embeddings (as vLLM decides).

    HF switches per forward by the sequence's length, so a sequence that crosses the original
    length keeps keys rotated by the short factors in its cache next to new ones rotated by the
    long. A paged cache shares blocks between requests (prefix caching), so a key's rotation
    must depend on its position alone: with the choice made once, every sequence equals HF's
    when max_model_len <= original_max_position_embeddings (short factors throughout), and the
    sequences longer than that when it is larger (HF's long factors from their first forward)."""
    return scaling.get("rope_type") == "longrope" and max_model_len > scaling["original_max_position_embeddings"]


def rope_attention_factor(scaling: dict[str, Any], max_position_embeddings: int) -> float:
    """The factor cos and sin are multiplied by: longrope's attention_factor, else 1 (HF's
    _compute_longrope_parameters: sqrt(1 + ln(factor) / ln(original)) with factor defaulting
    to max_position_embeddings / original_max_position_embeddings)."""
    if scaling.get("rope_type") == "yarn":
        return _yarn_attention_factor(scaling)
    if scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """YaRN's factor on cos and sin: attention_factor, else mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) where both are set (DeepSeek), else mscale(factor)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin_cache(
    inv_freq: torch.Tensor, max_positions: int, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * inv_freq for every position, times attention_factor (HF's
    attention_scaling): two [max_positions, rotary_dim/2] tensors."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    if attention_factor == 1.0:
        return freqs.cos(), freqs.sin()
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [tokens, heads, head_dim] by per-token cos/sin of shape [tokens, rotary_dim/2]
    (HF's rotate_half convention: the two halves of the rotary dims form the pairs). With
    rotary_dim < head_dim (partial rotary) the dims past rotary_dim pass unchanged."""
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    cos = torch.cat((cos, cos), dim=-1)[:, None, :].to(x.dtype)
    sin = torch.cat((sin, sin), dim=-1)[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos) + (rotated * sin)
