"""EAGLE and EAGLE-3 draft heads in their published checkpoint layouts: one Llama decoder layer fed
by the target's hidden states (docs/architecture.md, *Speculative decoding*).

EAGLE-1 (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): `fc` [hidden, 2 * hidden] (+ its bias where the
checkpoint has one) maps concat(embed(token), feature) to the layer's input; `layers.0` is a Llama
decoder layer without its input norm; no final norm; the logits are the target's head over the
layer's output (the checkpoint's own `lm_head` / `embed_tokens` where it has them).

EAGLE-3 (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): `fc` [hidden, 3 * target_hidden] maps the
target's residual stream at three layers to one feature; `midlayer` attends over
concat(input_layernorm(embed(token)), hidden_norm(feature)) (q/k/v take 2 * hidden inputs); a
final `norm`, and an own `lm_head` over a reduced vocabulary whose id i is target token
i + d2t[i].

Both take, at position p, the token at p + 1 and a feature of position p: the target's (its final
hidden state for EAGLE-1, fc of its aux layers for EAGLE-3) for verified positions, the head's own
output (before the final norm) for the positions it drafts itself.
"""

from __future__ import annotations

import torch
from torch import nn

from zllm.eagle_spec import EagleSpec
from zllm.model_spec import ModelSpec
from zllm.partition import Span
from zllm.workers.attention import AttentionMetadata
from zllm.workers.distributed import TensorParallel
from zllm.workers.linear_weights import FusedPart, whole_tensor_target
from zllm.workers.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, RMSNorm, Rotary
from zllm.workers.ops import TorchOps
from zllm.workers.parallel_layers import ColumnParallelLinear, LoadTarget, ParallelLMHead, VocabParallelEmbedding


class EagleLayer(nn.Module):
    """The head's decoder layer; parameter names as in the checkpoints (self_attn.*, mlp.*, norms)."""

    def __init__(self, spec: EagleSpec, ops: TorchOps, tp: TensorParallel) -> None:
        super().__init__()
        layer = spec.layer
        self.eagle3 = spec.method == "eagle3"
        self.self_attn = LlamaAttention(layer, ops, tp, None)
        if self.eagle3:  # q/k/v read concat(embedding, feature): twice the hidden width
            attn = self.self_attn
            attn.qkv_proj = ColumnParallelLinear(2 * layer.hidden_size, attn.qkv_proj.parts, bias=layer.qkv_bias)
            self.input_layernorm = RMSNorm(layer.hidden_size, layer.rms_norm_eps, ops)
            self.hidden_norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps, ops)
        # EAGLE-1's layer has no input norm (the published checkpoints hold none).
        self.post_attention_layernorm = RMSNorm(layer.hidden_size, layer.rms_norm_eps, ops)
        self.mlp = LlamaMLP(layer, ops, tp, None)

    def forward(
        self,
        embeds: torch.Tensor,
        feature: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream): their sum is the layer's output."""
        residual = feature
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1) if self.eagle3 else feature
        x = self.self_attn(x, positions, rotary, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class EagleHead(nn.Module):
    """One rank's head: its attention and MLP split over the ranks as the target's layers are;
    fc (and EAGLE-3's d2t) replicated; its own embeddings / lm_head vocabulary-parallel, or the
    target's (`target`)."""

    STACKED = LlamaForCausalLM.STACKED

    def __init__(
        self,
        spec: EagleSpec,
        target: LlamaForCausalLM,
        ops: TorchOps,
        tp: TensorParallel,
        max_model_len: int,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp
        layer = spec.layer
        hidden = layer.hidden_size
        fc_in = spec.feature_inputs * spec.target_hidden_size + (hidden if spec.method == "eagle" else 0)
        self.fc = ColumnParallelLinear(fc_in, [FusedPart(hidden, Span(0, hidden))], bias="fc.bias" in spec.tensor_names)
        if spec.method == "eagle3":
            self.midlayer = EagleLayer(spec, ops, tp)
            self.norm = RMSNorm(hidden, layer.rms_norm_eps, ops)
            self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long), persistent=False)
        else:
            self.layers = nn.ModuleList([EagleLayer(spec, ops, tp)])
            self.norm = None
        # Positions are the target's: the rotary table must reach max_model_len.
        rope_spec = _with_positions(layer, max_model_len)
        self.rotary = Rotary(rope_spec, ops, max_model_len)
        self.embed_tokens = VocabParallelEmbedding(layer.vocab_size, hidden, tp) if spec.own_embeddings else None
        vocab = spec.draft_vocab_size if spec.method == "eagle3" else layer.vocab_size
        self.lm_head = ParallelLMHead(vocab, hidden, tp) if spec.own_lm_head else None
        # Not a submodule: the target's weights are the target's (and loaded by it).
        self._target = (target,)

    # ---- forward ---------------------------------------------------------------------------------

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(token_ids)
        return self._target[0].model.embed(token_ids)

    def combine_target_features(self, features: torch.Tensor) -> torch.Tensor:
        """The feature the head takes for a verified position: EAGLE-3's fc over the three aux
        layers; EAGLE-1 takes the target's final hidden state as it is (fc comes with the token)."""
        return self.fc(features) if self.spec.method == "eagle3" else features

    def forward(
        self,
        token_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the hidden state the logits read, the feature of the next position: the output
        before the final norm)."""
        embeds = self.embed(token_ids)
        x = self.fc(torch.cat([embeds, features], dim=-1)) if self.spec.method == "eagle" else features
        layer = self.midlayer if self.norm is not None else self.layers[0]
        out, residual = layer(embeds, x, positions, self.rotary, kv_cache, meta)
        if self.norm is None:
            out = out + residual
            return out, out
        return self.norm(out, residual)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The head's most likely next target token per row, on rank 0 (None elsewhere)."""
        if self.lm_head is None:
            logits = self._target[0].compute_logits(hidden)
        else:
            logits = self.lm_head.logits(hidden)
        if logits is None:
            return None
        tokens = logits.argmax(dim=-1)
        return tokens + self.d2t[tokens] if self.spec.method == "eagle3" else tokens

    # ---- weights (the protocol of zllm/workers/weight_loader.py) -----------------------------------

    def checkpoint_targets(self, hf_name: str) -> list[tuple[str, int | None]]:
        if hf_name in ("d2t", "t2d") or "rotary_emb.inv_freq" in hf_name:
            return []  # d2t is read by load_d2t; t2d (which target tokens the head can draft) is unused
        if self.spec.method == "eagle" and hf_name.endswith(".input_layernorm.weight"):
            return []  # EAGLE-1's layer runs without an input norm, whatever the checkpoint holds
        for fused, part, shard in self.STACKED:
            if f".{part}." in hf_name:
                return [(hf_name.replace(f".{part}.", f".{fused}."), shard)]
        return [(hf_name, None)]

    def checkpoint_name(self, name: str, shard: int | None) -> str:
        for fused, part, index in self.STACKED:
            if shard == index and f".{fused}." in name:
                return name.replace(f".{fused}.", f".{part}.")
        return name

    def expected_checkpoint_tensors(self):
        for name, _ in self.named_parameters():
            module = self.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(module, ColumnParallelLinear) and len(module.parts) > 1:
                for shard in range(len(module.parts)):
                    yield name, shard
            else:
                yield name, None

    def load_target(self, name: str, shard: int | None) -> LoadTarget:
        module_name, param_name = name.rsplit(".", 1)
        module = self.get_submodule(module_name)
        if hasattr(module, "load_target"):
            return module.load_target(param_name, shard)
        return whole_tensor_target(getattr(module, param_name))

    def load_d2t(self, head_dir: str) -> None:
        """EAGLE-3's draft-to-target offsets (target id = draft id + d2t[draft id]); zeros (the
        identity) for a head whose vocabulary is the target's and that ships none."""
        if self.spec.method != "eagle3" or "d2t" not in self.spec.tensor_names:
            return
        from zllm.workers.weight_loader import read_whole_tensor

        d2t = read_whole_tensor(head_dir, "d2t", torch_file=True)
        if tuple(d2t.shape) != (self.spec.draft_vocab_size,):
            raise ValueError(
                f"speculative_config.model: d2t has shape {tuple(d2t.shape)}, expected ({self.spec.draft_vocab_size},)"
            )
        targets = torch.arange(d2t.shape[0]) + d2t.long()
        if int(targets.min()) < 0 or int(targets.max()) >= self.spec.layer.vocab_size:
            raise ValueError("speculative_config.model: d2t maps draft tokens outside the target's vocabulary")
        self.d2t.copy_(d2t.long())


def _with_positions(spec: ModelSpec, max_model_len: int) -> ModelSpec:
    import dataclasses

    return dataclasses.replace(spec, max_position_embeddings=max(spec.max_position_embeddings, max_model_len))
