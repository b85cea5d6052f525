"""ModernBERT encoders (HF ModernBertModel, its MaskedLM checkpoints' encoder, and
ModernBertForSequenceClassification): pre-norm layers (LayerNorms without a bias where
norm_bias is false, none before layer 0's attention: the embedding norm serves), a GeGLU MLP
(`Wi` holds the input then the gate), rotary positions, and every global_attn_every_n_layers-th
layer global, the others local: a query sees the keys less than `sliding_window` positions away
on either side, rotated by their own rope theta. A final norm, then for a classifier the head
(dense, GELU, norm) over the first token or the mean of all, and `classifier`.

The packed rows, the tensor-parallel layers and the attention paths are BERT's
(zllm/workers/models/bert.py): torch's SDPA over padded groups under a key-padding mask (and, in
local layers, the window's band), or FlashAttention's variable-length kernel with its
window_size on a GPU in half precision.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zllm.model_spec import ModelSpec
from zllm.partition import Span, even_split, head_shards
from zllm.workers.distributed import TensorParallel
from zllm.workers.layers import apply_rotary, rope_attention_factor, rope_cos_sin_cache, rope_inv_freq
from zllm.workers.linear_weights import FusedPart, LoadTarget
from zllm.workers.models.bert import (
    LayerNorm,
    PackedInputs,
    PaddedGroup,
    parameter_shards,
    parameter_target,
    varlen_attention,
)
from zllm.workers.parallel_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


@dataclass(slots=True)
class LayerKindInputs:
    """What every layer of one kind (global or local) attends with, built once a step: cos/sin
    at each token's position, and the grouped path's masks or the packed inputs."""

    cos: torch.Tensor  # [N, head_dim / 2]
    sin: torch.Tensor
    groups: list[PaddedGroup] | PackedInputs
    masks: list[torch.Tensor]  # per group: [B, 1, 1 or T, T] bool; empty when packed
    window: int | None  # keys less than this far away on either side; None: the whole input


class Rotary(nn.Module):
    """cos and sin of every position for one kind of layer (HF's ModernBertRotaryEmbedding)."""

    def __init__(self, spec: ModelSpec, local: bool) -> None:
        super().__init__()
        theta, scaling = (
            (spec.local_rope_theta, spec.local_rope_scaling) if local else (spec.rope_theta, spec.rope_scaling)
        )
        inv_freq = rope_inv_freq(spec.head_dim, theta, scaling)
        factor = rope_attention_factor(scaling, spec.max_position_embeddings)
        cos, sin = rope_cos_sin_cache(inv_freq, spec.max_position_embeddings, factor)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)


class Embeddings(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel) -> None:
        super().__init__()
        self.tok_embeddings = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        self.norm = LayerNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class Attention(nn.Module):
    """This rank's heads: q/k/v fused (and so in the checkpoint), rotated, attended, and `Wo`'s
    partial product all-reduced."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel) -> None:
        super().__init__()
        hidden, head_dim = spec.hidden_size, spec.head_dim
        heads = head_shards(spec.num_heads, spec.num_heads, tp.size)[tp.rank].q_heads
        rows = Span(heads.start * head_dim, heads.count * head_dim)
        self.num_heads, self.head_dim = heads.count, head_dim
        self.Wqkv = ColumnParallelLinear(hidden, [FusedPart(hidden, rows)] * 3, spec.qkv_bias, fused_in_checkpoint=True)
        self.Wo = RowParallelLinear(hidden, hidden, rows, bias=spec.o_proj_bias, tp=tp)

    def forward(self, x: torch.Tensor, kind: LayerKindInputs) -> torch.Tensor:
        q, k, v = self.Wqkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotated(q, kind), _rotated(k, kind)
        scale = self.head_dim**-0.5
        if isinstance(kind.groups, PackedInputs):
            attended = varlen_attention(q, k, v, kind.groups, causal=False, scale=scale, window=kind.window)
        else:
            attended = torch.cat([_attend(q, k, v, g, m, scale) for g, m in zip(kind.groups, kind.masks)])
        return self.Wo(attended)


class Mlp(nn.Module):
    """GeGLU: Wo(gelu(input) * gate), `Wi` holding the input's rows then the gate's (so in the
    checkpoint), each split by columns across ranks."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel) -> None:
        super().__init__()
        columns = even_split(spec.intermediate_size, tp.size, tp.rank)
        part = FusedPart(spec.intermediate_size, columns)
        self.Wi = ColumnParallelLinear(spec.hidden_size, [part, part], spec.mlp_bias, fused_in_checkpoint=True)
        self.Wo = RowParallelLinear(spec.intermediate_size, spec.hidden_size, columns, bias=spec.mlp_bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(F.gelu(value) * gate)


class EncoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel, index: int) -> None:
        super().__init__()
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        # Layer 0 has no norm before attention (HF: Identity): the embedding norm serves.
        self.attn_norm = LayerNorm(hidden, eps, spec.norm_bias) if index else None
        self.attn = Attention(spec, tp)
        self.mlp_norm = LayerNorm(hidden, eps, spec.norm_bias)
        self.mlp = Mlp(spec, tp)

    def forward(self, x: torch.Tensor, kind: LayerKindInputs) -> torch.Tensor:
        x = x + self.attn(x if self.attn_norm is None else self.attn_norm(x), kind)
        return x + self.mlp(self.mlp_norm(x))


class ClassifierHead(nn.Module):
    """ModernBertPredictionHead (dense, GELU, norm), then `classifier`."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        hidden = spec.hidden_size
        self.dense = nn.Linear(hidden, hidden, bias=spec.classifier_bias)
        self.norm = LayerNorm(hidden, spec.rms_norm_eps, spec.norm_bias)
        self.classifier = nn.Linear(hidden, spec.num_labels)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.norm(F.gelu(self.dense(pooled))))


class ModernBertModel(nn.Module):
    """The encoder (and, for a ModernBertForSequenceClassification checkpoint, its head). Our
    parameters carry the checkpoint's names, less its "model." prefix (the classifier's are under
    "head.")."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.spec = spec
        self.embeddings = Embeddings(spec, tp)
        self.layers = nn.ModuleList(EncoderLayer(spec, tp, i) for i in range(spec.num_layers))
        self.final_norm = LayerNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_bias)
        self.global_rotary = Rotary(spec, local=False)
        self.local_rotary = Rotary(spec, local=True)
        self.head = ClassifierHead(spec) if spec.num_labels else None
        self.head_pooling = spec.classifier_pooling  # "cls" or "mean" (the pooling runner's)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_types: torch.Tensor,
        groups: list[PaddedGroup] | PackedInputs,
    ) -> torch.Tensor:
        """Final (normed) hidden states of the packed tokens [N, hidden]; no token types."""
        kinds = (
            _kind_inputs(self.global_rotary, positions, groups, None),
            _kind_inputs(self.local_rotary, positions, groups, self.spec.sliding_window),
        )
        x = self.embeddings(input_ids)
        for index, layer in enumerate(self.layers):
            x = layer(x, kinds[index in self.spec.sliding_layers])
        return self.final_norm(x)

    # ---- weights -------------------------------------------------------------------------------

    def checkpoint_targets(self, hf_name: str) -> list[tuple[str, int | None]]:
        name = hf_name.removeprefix("model.")
        if name.startswith(("head.", "decoder.", "classifier.")) and self.head is None:
            return []  # a MaskedLM checkpoint's head: not served
        if name.startswith("classifier."):
            name = "head." + name
        fused = self._fused_parts(name)
        return [(name, shard) for shard in range(fused)] if fused else [(name, None)]

    def _fused_parts(self, name: str) -> int:
        """How many parts the checkpoint tensor fills (Wqkv: 3, Wi: 2); 0 where it is one."""
        if ".Wqkv." in name or ".Wi." in name:
            module = self.get_submodule(name.rsplit(".", 1)[0])
            return len(module.parts)
        return 0

    def checkpoint_name(self, name: str, shard: int | None) -> str:
        return name.removeprefix("head.") if name.startswith("head.classifier.") else name

    def expected_checkpoint_tensors(self) -> Iterator[tuple[str, int | None]]:
        return parameter_shards(self)

    def load_target(self, name: str, shard: int | None) -> LoadTarget:
        return parameter_target(self, name, shard)


def _kind_inputs(
    rotary: Rotary, positions: torch.Tensor, groups: list[PaddedGroup] | PackedInputs, window: int | None
) -> LayerKindInputs:
    cos, sin = rotary.cos[positions], rotary.sin[positions]
    if isinstance(groups, PackedInputs):
        return LayerKindInputs(cos, sin, groups, [], window)
    return LayerKindInputs(cos, sin, groups, [_mask(g, window) for g in groups], window)


def _mask(group: PaddedGroup, window: int | None) -> torch.Tensor:
    """The keys each query of a padded group sees: the valid ones, within the window if any.
    (A padding query may see none; its row is dropped.)"""
    keys = group.valid[:, None, None, :]
    if window is None:
        return keys
    columns = torch.arange(group.valid.shape[1], device=group.valid.device)
    band = (columns[:, None] - columns[None, :]).abs() < window
    return keys & band


def _rotated(x: torch.Tensor, kind: LayerKindInputs) -> torch.Tensor:
    """Rotary in fp32 (HF's apply_rotary_pos_emb upcasts q and k), back in the model's dtype."""
    return apply_rotary(x.float(), kind.cos, kind.sin).to(x.dtype)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: PaddedGroup, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One group's attention: [rows, heads, d] scattered to [B, heads, T, d] under the mask."""

    def padded(t: torch.Tensor) -> torch.Tensor:
        return t[group.start : group.stop][group.index].transpose(1, 2)

    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask, scale=scale)
    return group.unpadded(out)
