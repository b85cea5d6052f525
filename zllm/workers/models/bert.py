"""Encoder-only models: BERT and XLM-RoBERTa (post-LayerNorm layers, GELU MLP, learned absolute
positions, token types), with their sequence-classification heads.

The linear layers run on the step's packed tokens [N, hidden] (no padding), built from the same
tensor-parallel layers as the decoder (q/k/v fused and split by heads, the MLP by columns, each
block ending in one all-reduce). Only attention sees a padded batch: each group of inputs of
similar length (zllm/workers/pooling_runner.py) is scattered to [B, heads, T, head_dim] and
attends bidirectionally through torch's scaled_dot_product_attention with a key-padding mask
(the reference path, and fp32), then is gathered back to packed rows. On a GPU in half precision
the packed rows go straight to FlashAttention's variable-length kernel instead (`PackedInputs`).
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
from zllm.workers.linear_weights import FusedPart, LoadTarget, whole_tensor_target
from zllm.workers.parallel_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


@dataclass(slots=True)
class PaddedGroup:
    """Inputs of one attention call: packed rows [start, stop) scattered to [B, T] by `index`
    (padding points at row 0 and is masked out by `valid`), and gathered back from the flattened
    [B * T] positions `rows` (an index, not a boolean mask: no host sync on a GPU)."""

    start: int
    stop: int
    index: torch.Tensor  # [B, T] row within the group
    valid: torch.Tensor  # [B, T] bool
    rows: torch.Tensor  # [stop - start] positions of the valid entries in index.flatten()

    def unpadded(self, out: torch.Tensor) -> torch.Tensor:
        """[B, heads, T, d] attention output -> the group's packed rows [stop - start, heads * d]."""
        batch, heads, length, dim = out.shape
        return out.transpose(1, 2).reshape(batch * length, heads * dim)[self.rows]


@dataclass(slots=True)
class PackedInputs:
    """A step's inputs packed back to back for FlashAttention's variable-length kernel (CUDA,
    half precision): no padding and no gathers, one call per layer."""

    cu_seqlens: torch.Tensor  # [inputs + 1] int32 offsets
    max_len: int


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packed: PackedInputs,
    causal: bool,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """[N, heads, d] (k/v may have fewer heads: GQA) -> [N, heads * d], each input attending to
    itself only. window (bidirectional, ModernBERT's local layers): a query sees the keys less
    than `window` positions away on either side, FlashAttention's window_size (window - 1, both)."""
    side = None if window is None else window - 1
    out = torch.ops.aten._flash_attention_forward(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        packed.cu_seqlens,
        packed.cu_seqlens,
        packed.max_len,
        packed.max_len,
        0.0,
        causal,
        False,
        scale=scale,
        window_size_left=side,
        window_size_right=side,
    )[0]
    return out.reshape(q.shape[0], -1)


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None  # ModernBERT's have none
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class EncoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel) -> None:
        super().__init__()
        hidden, head_dim = spec.hidden_size, spec.head_dim
        heads = head_shards(spec.num_heads, spec.num_heads, tp.size)[tp.rank].q_heads
        rows = Span(heads.start * head_dim, heads.count * head_dim)
        self.num_heads, self.head_dim = heads.count, head_dim
        self.qkv = ColumnParallelLinear(hidden, [FusedPart(hidden, rows)] * 3, bias=True)
        self.attention_output = RowParallelLinear(hidden, hidden, rows, bias=True, tp=tp)
        self.attention_norm = LayerNorm(hidden, spec.rms_norm_eps)
        columns = even_split(spec.intermediate_size, tp.size, tp.rank)
        self.intermediate = ColumnParallelLinear(hidden, [FusedPart(spec.intermediate_size, columns)], bias=True)
        self.output = RowParallelLinear(spec.intermediate_size, hidden, columns, bias=True, tp=tp)
        self.output_norm = LayerNorm(hidden, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, groups: list[PaddedGroup] | PackedInputs) -> torch.Tensor:
        qkv = self.qkv(x)
        if isinstance(groups, PackedInputs):
            q, k, v = qkv.view(-1, 3, self.num_heads, self.head_dim).unbind(1)
            attended = varlen_attention(q, k, v, groups, causal=False, scale=self.head_dim**-0.5)
        else:
            attended = torch.cat([self._attend(qkv, group) for group in groups])
        x = self.attention_norm(x + self.attention_output(attended))
        return self.output_norm(x + self.output(F.gelu(self.intermediate(x))))

    def _attend(self, qkv: torch.Tensor, group: PaddedGroup) -> torch.Tensor:
        """One gather of the group's q/k/v rows to [B, T, 3, heads, d], bidirectional attention
        under the key-padding mask, and the valid rows back."""
        rows = qkv[group.start : group.stop][group.index]
        q, k, v = rows.view(*group.index.shape, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.valid[:, None, None, :])
        return group.unpadded(out)


class ClassifierHead(nn.Module):
    """The sequence-classification head over the first token: BERT's pooler (dense + tanh) and
    classifier; XLM-RoBERTa's classifier.dense (+ tanh) and classifier.out_proj."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.dense = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.out_proj = nn.Linear(spec.hidden_size, spec.num_labels)

    def forward(self, first_tokens: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first_tokens)))


class BertModel(nn.Module):
    """An encoder (and, for a *ForSequenceClassification checkpoint, its head)."""

    head_pooling = "cls"  # the classifier reads the first token (CLS, <s>)

    # Our parameter -> the HF checkpoint's name (after the "bert." / "roberta." prefix).
    _RENAMES = (
        (".qkv.", (".attention.self.query.", ".attention.self.key.", ".attention.self.value.")),
        (".attention_output.", (".attention.output.dense.",)),
        (".attention_norm.", (".attention.output.LayerNorm.",)),
        (".intermediate.", (".intermediate.dense.",)),
        (".output.", (".output.dense.",)),
        (".output_norm.", (".output.LayerNorm.",)),
    )

    def __init__(self, spec: ModelSpec, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.spec = spec
        hidden = spec.hidden_size
        self.word_embeddings = VocabParallelEmbedding(spec.vocab_size, hidden, tp)
        self.position_embeddings = nn.Parameter(
            torch.zeros(spec.max_position_embeddings + spec.position_offset, hidden)
        )
        self.token_type_embeddings = nn.Parameter(torch.zeros(max(spec.type_vocab_size, 1), hidden))
        self.embeddings_norm = LayerNorm(hidden, spec.rms_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(spec, tp) for _ in range(spec.num_layers))
        self.head = ClassifierHead(spec) if spec.num_labels else None
        self._xlm = spec.pooling.family == "xlm-roberta"

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_types: torch.Tensor,
        groups: list[PaddedGroup] | PackedInputs,
    ) -> torch.Tensor:
        """Final hidden states of the packed tokens [N, hidden]."""
        x = self.word_embeddings(input_ids) + self.position_embeddings[positions + self.spec.position_offset]
        if self.spec.type_vocab_size:
            x = x + self.token_type_embeddings[token_types]
        x = self.embeddings_norm(x)
        for layer in self.layers:
            x = layer(x, groups)
        return x

    # ---- weights -------------------------------------------------------------------------------

    def checkpoint_targets(self, hf_name: str) -> list[tuple[str, int | None]]:
        name = hf_name.removeprefix("bert.").removeprefix("roberta.")
        if name.startswith("embeddings."):
            return self._embedding_target(name)
        if name.startswith("encoder.layer."):
            return [self._layer_target(name.removeprefix("encoder.layer."))]
        if self.head is not None and (name.startswith("pooler.dense.") or name.startswith("classifier.")):
            if not (self._xlm and name.startswith("pooler.")):  # XLM-R's head is classifier.* alone
                return [self._head_target(name)]
        return []  # BertModel's unused pooler, buffers (position_ids): not ours

    def _embedding_target(self, name: str) -> list[tuple[str, int | None]]:
        part = name.removeprefix("embeddings.")
        renamed = {
            "word_embeddings.weight": "word_embeddings.weight",
            "position_embeddings.weight": "position_embeddings",
            "token_type_embeddings.weight": "token_type_embeddings",
            "LayerNorm.weight": "embeddings_norm.weight",
            "LayerNorm.bias": "embeddings_norm.bias",
        }.get(part)
        return [] if renamed is None else [(renamed, None)]

    def _layer_target(self, name: str) -> tuple[str, int | None]:
        name = "layers." + name
        for ours, theirs in self._RENAMES:
            for shard, part in enumerate(theirs):
                if part in name:
                    return name.replace(part, ours), (shard if len(theirs) > 1 else None)
        return name, None  # unknown: the loader names it as matching no parameter

    def _head_target(self, name: str) -> tuple[str, int | None]:
        if self._xlm:  # classifier.dense.*, classifier.out_proj.*
            return "head." + name.removeprefix("classifier."), None
        if name.startswith("pooler."):
            return "head." + name.removeprefix("pooler."), None
        return "head.out_proj." + name.removeprefix("classifier."), None

    def checkpoint_name(self, name: str, shard: int | None) -> str:
        for target in self._all_checkpoint_names():
            if self.checkpoint_targets(target) == [(name, shard)]:
                return target
        return name

    def _all_checkpoint_names(self) -> Iterator[str]:
        yield from (
            f"embeddings.{n}"
            for n in ("word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight")
        )
        yield from ("embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias")
        for index in range(self.spec.num_layers):
            for _, theirs in self._RENAMES:
                for part in theirs:
                    for param in ("weight", "bias"):
                        yield f"encoder.layer.{index}{part}{param}"
        for prefix in ("pooler.dense.", "classifier.", "classifier.dense.", "classifier.out_proj."):
            yield from (prefix + "weight", prefix + "bias")

    def expected_checkpoint_tensors(self) -> Iterator[tuple[str, int | None]]:
        for name, shard in parameter_shards(self):
            if name != "token_type_embeddings" or self.spec.type_vocab_size:
                yield name, shard

    def load_target(self, name: str, shard: int | None) -> LoadTarget:
        return parameter_target(self, name, shard)


def parameter_shards(model: nn.Module) -> Iterator[tuple[str, int | None]]:
    """Every (parameter, shard) of an encoder: one per part of a fused linear layer."""
    for name, _ in model.named_parameters():
        module = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        if isinstance(module, ColumnParallelLinear) and len(module.parts) > 1:
            yield from ((name, shard) for shard in range(len(module.parts)))
        else:
            yield name, None


def parameter_target(model: nn.Module, name: str, shard: int | None) -> LoadTarget:
    """Where checkpoint tensor (name, shard) goes: the module's own load_target (its rank's
    part), else the whole parameter."""
    if "." not in name:
        return whole_tensor_target(getattr(model, name))
    module_name, param_name = name.rsplit(".", 1)
    module = model.get_submodule(module_name)
    if hasattr(module, "load_target"):
        return module.load_target(param_name, shard)
    return whole_tensor_target(getattr(module, param_name))
