"""A causal decoder as a pooling model: Qwen3-Embedding's `Qwen3Model`, a generative checkpoint
served with `--runner pooling`, and the `*ForSequenceClassification` heads over the last token.

The layers are the generative decoder's own (models/llama.py), so every variation its spec
carries (q/k norms, biases, rotary scaling, MoE blocks) is the same code. Per layer,
`before_attention` normalizes, projects, rotates and writes k/v into a scratch "cache" of one
slot per token (block size 1, slot = row): the step keeps no KV cache. Attention is causal over
groups of similar length (right-padded, so a query never sees padding), through torch's
scaled_dot_product_attention; bidirectional under a key-padding mask where the config says
`is_causal: false` (gte-Qwen2's embedders), as FlashAttention's varlen call is on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zllm.model_spec import ModelSpec
from zllm.workers.distributed import TensorParallel
from zllm.workers.models.bert import PackedInputs, PaddedGroup, varlen_attention
from zllm.workers.models.llama import LlamaForCausalLM
from zllm.workers.ops import TorchOps


class DecoderForPooling(LlamaForCausalLM):
    head_reads_first = False  # a classifier's head reads the last token

    def __init__(self, spec: ModelSpec, ops: TorchOps | None = None, tp: TensorParallel | None = None) -> None:
        super().__init__(spec, ops, tp)
        self.lm_head = None  # hidden states are the output
        self.head = nn.Linear(spec.hidden_size, spec.num_labels, bias=False) if spec.num_labels else None
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
        if hf_name == "lm_head.weight":
            return []  # a generative checkpoint served for its hidden states
        if hf_name == "score.weight":
            return [("head.weight", None)] if self.head is not None else []
        if not hf_name.startswith("model."):
            hf_name = "model." + hf_name
        return super().checkpoint_targets(hf_name)

    def checkpoint_name(self, name: str, shard: int | None) -> str:
        return "score.weight" if name == "head.weight" else super().checkpoint_name(name, shard)


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
