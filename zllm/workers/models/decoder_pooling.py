"""A causal decoder as a pooling model: Qwen3-Embedding's `Qwen3Model`, a generative checkpoint
served with `--runner pooling`, and the `*ForSequenceClassification` heads over the last token.

The layers are the generative decoder's own (models/llama.py), so every variation its spec
carries (q/k norms, biases, rotary scaling, MoE blocks) is the same code. Per layer,
`before_attention` normalizes, projects, rotates and writes k/v into a scratch "cache" of one
slot per token (block size 1, slot = row): the step keeps no KV cache. Attention is causal over
groups of similar length (right-padded, so a query never sees padding), through torch's
scaled_dot_product_attention; bidirectional under a key-padding mask where the config says
`is_causal: false` (gte-Qwen2's embedders), as FlashAttention's varlen call is on CUDA.

A generative checkpoint served with --convert classify (vLLM's as_seq_cls_model) has its
`score.weight` as the head, or one made from rows of its LM head (the embedding where tied):
"from_2_way_softmax" (Qwen3-Reranker) keeps row[true] - row[false], one logit whose sigmoid is
the softmax of the two tokens' logits; "no_post_processing" keeps the tokens' rows as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zllm.model_spec import ModelSpec
from zllm.pooling import PoolerConfig
from zllm.workers.distributed import TensorParallel
from zllm.workers.linear_weights import LoadTarget
from zllm.workers.models.bert import PackedInputs, PaddedGroup, varlen_attention
from zllm.workers.models.llama import LlamaForCausalLM
from zllm.workers.ops import TorchOps


class DecoderForPooling(LlamaForCausalLM):
    head_pooling = "last"  # a classifier's head reads the last token

    def __init__(
        self,
        spec: ModelSpec,
        ops: TorchOps | None = None,
        tp: TensorParallel | None = None,
        pooler: PoolerConfig | None = None,
    ) -> None:
        super().__init__(spec, ops, tp)
        self.lm_head = None  # hidden states are the output
        # A converted generative decoder's labels are the pooler's (its spec has none).
        num_labels = pooler.num_labels if pooler is not None and pooler.kind == "classify" else spec.num_labels
        self.head = nn.Linear(spec.hidden_size, num_labels, bias=False) if num_labels else None
        self.head_tokens = list(pooler.classifier_token_ids) if pooler is not None else []
        self.head_method = pooler.classifier_method if pooler is not None else ""
        self.causal = not spec.bidirectional

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_types: torch.Tensor,
        groups: list[PaddedGroup] | PackedInputs,
    ) -> torch.Tensor:
        """Final (normed) hidden states of the packed tokens [N, hidden]."""
        x, residual = self.model.embed(input_ids), None
        slots = torch.arange(len(input_ids), device=input_ids.device)  # int64, as the csrc rotary-and-cache takes
        for index, layer in enumerate(self.model.layers):
            attention = layer.self_attn
            scratch = x.new_empty(2, len(input_ids), 1, attention.num_kv_heads, attention.head_dim)
            q, residual = layer.before_attention(x, residual, positions, self.model.rotary_of(index), scratch, slots)
            k, v = scratch[0, :, 0], scratch[1, :, 0]
            if isinstance(groups, PackedInputs):
                attended = varlen_attention(q, k, v, groups, causal=self.causal, scale=attention.scale)
            else:
                attended = torch.cat([_grouped(q, k, v, g, attention.scale, self.causal) for g in groups])
            x, residual = layer.after_attention(attended, residual)
        x, _ = self.model.norm(x, residual)
        return x

    # ---- weights: a `*Model` checkpoint has no "model." prefix; a generative one has an lm_head ---

    def checkpoint_targets(self, hf_name: str) -> list[tuple[str, int | None]]:
        if hf_name == "lm_head.weight":  # a generative checkpoint: the head's rows, or nothing
            return [("head.weight", None)] if self._head_from(hf_name) else []
        if hf_name == "score.weight":
            return [("head.weight", None)] if self.head is not None and not self.head_tokens else []
        if not hf_name.startswith("model."):
            hf_name = "model." + hf_name
        targets = super().checkpoint_targets(hf_name)
        return targets + [("head.weight", None)] if self._head_from(hf_name) else targets

    def _head_from(self, hf_name: str) -> bool:
        """Whether the head is made from this tensor's rows: the LM head, or the embedding where tied."""
        if not self.head_tokens:
            return False
        tied = self.spec.tie_word_embeddings
        return hf_name == ("model.embed_tokens.weight" if tied else "lm_head.weight")

    def load_target(self, name: str, shard: int | None) -> LoadTarget:
        if name != "head.weight" or not self.head_tokens:
            return super().load_target(name, shard)
        # Only the rows from the lowest token to the highest are read from the checkpoint.
        low, high = min(self.head_tokens), max(self.head_tokens) + 1
        rows = torch.tensor([t - low for t in self.head_tokens])
        full_shape = (self.spec.vocab_size, self.spec.hidden_size)

        def store(values: torch.Tensor) -> None:
            if values.shape[0] != high - low:  # dummy weights (load_format dummy): the head's own shape
                self.head.weight.data.copy_(values)
                return
            picked = values[rows].float()  # [tokens, hidden]; the difference in fp32, as vLLM takes it
            head = picked[1:2] - picked[0:1] if self.head_method == "from_2_way_softmax" else picked
            self.head.weight.data.copy_(head)

        return LoadTarget(self.head.weight.data, full_shape, (slice(low, high), slice(None)), store)

    def checkpoint_name(self, name: str, shard: int | None) -> str:
        if name != "head.weight":
            return super().checkpoint_name(name, shard)
        if not self.head_tokens:
            return "score.weight"
        return "model.embed_tokens.weight" if self.spec.tie_word_embeddings else "lm_head.weight"


def _grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: PaddedGroup, scale: float, causal: bool
) -> torch.Tensor:
    """One group's attention: [rows, heads, d] scattered to [B, heads, T, d] and back. Causal
    needs no mask (padding is on the right, after every query); bidirectional masks the padding."""

    def padded(t: torch.Tensor) -> torch.Tensor:
        return t[group.start : group.stop][group.index].transpose(1, 2)

    queries, keys, values = padded(q), padded(k), padded(v)
    repeat = queries.shape[1] // keys.shape[1]
    if repeat > 1:  # grouped-query attention: each KV head serves `repeat` query heads
        keys, values = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1)
    if causal:
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)
    else:
        mask = group.valid[:, None, None, :]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    return group.unpadded(out)
