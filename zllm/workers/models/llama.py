"""The Llama-family decoder shared by every registered architecture (zllm/model_spec.py): GQA
attention, SwiGLU MLP, RMSNorm, RoPE. The spec's fields carry what differs: Qwen2's q/k/v bias,
Qwen3's per-head q/k RMSNorm, Llama's optional attention/MLP bias; sliding-window layers
(Mistral, Phi-3, Gemma's local layers, each with its own rotary in Gemma 3), attention and final
logit soft-capping and query_pre_attn_scalar (Gemma 2), GeGLU, the (1 + w) RMSNorm, four norms a
layer and scaled embeddings (Gemma 2/3), LongRoPE and partial rotary (Phi-3/Phi-4).

Parameter names mirror HF's, with q/k/v and gate/up fused into one matrix each; the weight
loader (zllm/workers/weight_loader.py) maps HF's separate tensors onto their shard of the fused
one, and Phi-3's fused tensors onto every shard they hold.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from zllm import envs
from zllm.model_spec import ModelSpec
from zllm.partition import Span, even_split, head_shards
from zllm.quantization import QuantSpec
from zllm.workers.attention import UNSCALED, AttentionMetadata, KVScales
from zllm.workers.distributed import TensorParallel
from zllm.workers.layers import (
    rope_attention_factor,
    rope_cos_sin_cache,
    rope_inv_freq,
    rope_uses_long_factors,
    rounded_to,
)
from zllm.workers.linear_weights import DenseWeights
from zllm.workers.models.gpt_oss import GptOssMoeBlock
from zllm.workers.models.moe import Experts, SparseMoeBlock
from zllm.workers.ops import TorchOps
from zllm.workers.parallel_layers import (
    ColumnParallelLinear,
    FusedPart,
    LoadTarget,
    ParallelLMHead,
    PendingSum,
    RowParallelLinear,
    VocabParallelEmbedding,
    whole_tensor_target,
)

if TYPE_CHECKING:
    from zllm.workers.lora import LoRALayer

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: TorchOps, unit_offset: bool = False) -> None:
        """unit_offset: Gemma's norm, which scales by (1 + w) (the checkpoint holds w)."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, lora: LoRALayer | None = None):
        """Without residual: norm(x). With: (norm(x + residual), x + residual). lora: the adapter
        slots of the projection the output feeds, whose shrink the same launch may compute
        (LoRALayer.norm_shrinks, ZLLM_LORA_NORM_SHRINK), held for that projection. x may be a
        row-parallel layer's PendingSum (ZLLM_ALLREDUCE_NORM): its all-reduce runs in the norm's
        launch where the fused kernel takes the operands, else before the norm as usual."""
        if isinstance(x, PendingSum):
            if residual is not None and lora is None and x.tp.fuses_add_rms_norm(x.partial, residual, self.weight):
                return x.tp.all_reduce_add_rms_norm(x.partial, residual, self.weight, self.eps, self.unit_offset)
            x = x.resolve()
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps, self.unit_offset)
        if lora is not None and lora.norm_shrinks(x, residual, self.weight):
            return lora.add_rms_norm(self.ops, x, residual, self.weight, self.eps, self.unit_offset)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)


class Rotary(nn.Module):
    """cos and sin of every position for one kind of layer (Gemma 3's local layers have their
    own). LongRoPE's short or long factors are chosen once, by max_model_len
    (layers.rope_uses_long_factors)."""

    def __init__(self, spec: ModelSpec, ops: TorchOps, max_model_len: int | None = None, local: bool = False) -> None:
        super().__init__()
        theta, scaling = (
            (spec.local_rope_theta, spec.local_rope_scaling) if local else (spec.rope_theta, spec.rope_scaling)
        )
        long_context = rope_uses_long_factors(scaling, max_model_len or spec.max_position_embeddings)
        inv_freq = rope_inv_freq(spec.rotary_dim, theta, scaling, long_context)
        factor = rope_attention_factor(scaling, spec.max_position_embeddings)
        cos, sin = rope_cos_sin_cache(inv_freq, spec.max_position_embeddings, factor)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.ops = ops

    def apply_and_cache(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVScales = UNSCALED,
    ) -> torch.Tensor:
        """Rotates q and k and stores k and v at their cache slots; returns the rotated q."""
        return self.ops.rotary_and_write_kv(positions, q, k, v, self.cos, self.sin, kv_cache, slot_mapping, kv_scales)

    def for_qkv_epilogue(
        self,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
        kv_scales: KVScales,
    ):
        """apply_and_cache's work for a q/k/v GEMV that does it in its epilogue (kernels.RopeCache),
        or None where this class's apply_and_cache is not the plain one (Qwen2-VL's M-RoPE) or the
        token is not on a GPU."""
        if positions.dim() != 1 or not positions.is_cuda or type(self).apply_and_cache is not Rotary.apply_and_cache:
            return None
        if self.ops.name != "cuda":  # the epilogue writes the csrc rotary kernel's bits, not torch's
            return None
        from zllm.workers.kernels.matvec import RopeCache

        return RopeCache(positions, self.cos, self.sin, kv_cache, slot_mapping, num_heads, kv_scales.k, kv_scales.v)


class LlamaAttention(nn.Module):
    """This rank's heads: a slice of q/k/v in, a partial o_proj product all-reduced out."""

    def __init__(
        self, spec: ModelSpec, ops: TorchOps, tp: TensorParallel, quant: QuantSpec | None, index: int = 0
    ) -> None:
        super().__init__()
        self.ops = ops
        shard = head_shards(spec.num_heads, spec.num_kv_heads, tp.size)[tp.rank]
        d = spec.head_dim
        self.num_heads = shard.q_heads.count
        self.num_heads_total = spec.num_heads
        self.num_kv_heads = shard.kv_heads.count
        self.head_dim = d
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.scale = d**-0.5 if spec.attention_scale is None else spec.attention_scale
        # Constants of the layer, so a captured CUDA graph holds them too.
        self.window = spec.window_of(index)
        self.softcap = spec.attn_logit_softcap
        q_rows = _scaled(shard.q_heads, d)
        kv_rows = _scaled(shard.kv_heads, d)
        parts = [
            FusedPart(spec.num_heads * d, q_rows),
            FusedPart(spec.num_kv_heads * d, kv_rows),
            FusedPart(spec.num_kv_heads * d, kv_rows),
        ]
        self.qkv_proj = ColumnParallelLinear(
            spec.hidden_size, parts, bias=spec.qkv_bias, quant=quant, fused_in_checkpoint=spec.fused_checkpoint
        )
        self.o_proj = RowParallelLinear(spec.num_heads * d, spec.hidden_size, q_rows, spec.o_proj_bias, tp, quant=quant)
        if spec.qk_norm:  # Qwen3, Gemma 3: one RMSNorm over head_dim for all heads (replicated on every rank)
            self.q_norm = RMSNorm(d, spec.rms_norm_eps, ops, spec.norm_unit_offset)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps, ops, spec.norm_unit_offset)
        else:
            self.q_norm = self.k_norm = None
        # The checkpoint's FP8 KV cache scales, one value each, required of every layer when its
        # config declares a kv_cache_scheme; 1.0 for other checkpoints.
        if quant is not None and quant.kv_cache_scales:
            self.k_scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
            self.v_scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
        self.kv_scales = UNSCALED
        # GPT-OSS: one learned sink logit per head (this rank's heads).
        self.q_heads = shard.q_heads
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if spec.attention_sinks else None

    def load_target(self, param_name: str, shard: int | None) -> LoadTarget:
        """k_scale / v_scale: one value each, the same on every rank; sinks: this rank's heads'."""
        param = getattr(self, param_name)
        if param_name == "sinks":
            heads = self.q_heads
            return LoadTarget(param.data, (self.num_heads_total,), (slice(heads.start, heads.stop),))
        return LoadTarget(param.data, None, ())

    def finish_loading(self) -> None:
        if hasattr(self, "k_scale"):
            k, v = float(self.k_scale), float(self.v_scale)
            if not (math.isfinite(k) and math.isfinite(v) and k > 0 and v > 0):
                raise ValueError(f"model: KV cache scales must be finite and positive, got k_scale {k}, v_scale {v}")
            self.kv_scales = KVScales(k, v)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q = self.project(x, positions, rotary, kv_cache, meta.slot_mapping)
        return self.output(self.attend(q, kv_cache, meta))

    # The three parts of forward. project and output are token-parallel (each row alone, the
    # cache written at its slot), so CUDA graphs can hold them at a padded token count; attend
    # depends on how the step's tokens group into sequences (zllm/workers/piecewise_graphs.py).

    def project(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """q, k, v of each token; k and v go to the cache; returns the rotated q [tokens, heads, dim]."""
        if self.q_norm is None and x.shape[0] == 1:
            rope = rotary.for_qkv_epilogue(positions, kv_cache, slot_mapping, self.num_heads, self.kv_scales)
            qkv = self.qkv_proj.rope_cache(x, rope) if rope is not None else None
            if qkv is not None:  # one launch: the product, rotary and the cache write (ZLLM_FUSED_ROPE_GEMV)
                return qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim)
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return rotary.apply_and_cache(positions, q, k, v, kv_cache, slot_mapping, self.kv_scales)

    def project_normed(
        self,
        stream: torch.Tensor,
        norm: RMSNorm,
        positions: torch.Tensor,
        rotary: Rotary,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """project(norm(stream)) for one token, the norm in the q/k/v GEMV's launch where it takes
        it (ColumnParallelLinear.rope_cache_normed; the norm's weight is folded into q/k/v's and
        its own is 1), else norm, then project."""
        rope = rotary.for_qkv_epilogue(positions, kv_cache, slot_mapping, self.num_heads, self.kv_scales)
        qkv = None if rope is None else self.qkv_proj.rope_cache_normed(stream, rope, norm.eps)
        if qkv is not None:
            return qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim)
        return self.project(norm(stream), positions, rotary, kv_cache, slot_mapping)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.ops.attention(q, kv_cache, meta, self.scale, self.kv_scales, self.window, self.softcap, self.sinks)

    def output(self, attended: torch.Tensor, defer: bool = False) -> torch.Tensor | PendingSum:
        """defer: the caller norms the output next and takes a PendingSum (RowParallelLinear.forward)."""
        return self.o_proj(attended.reshape(-1, self.q_size), defer)


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, ops: TorchOps, tp: TensorParallel, quant: QuantSpec | None) -> None:
        super().__init__()
        self.ops = ops
        rows = even_split(spec.intermediate_size, tp.size, tp.rank)
        part = FusedPart(spec.intermediate_size, rows)
        self.gate_up_proj = ColumnParallelLinear(
            spec.hidden_size, [part, part], bias=spec.mlp_bias, quant=quant, fused_in_checkpoint=spec.fused_checkpoint
        )
        self.down_proj = RowParallelLinear(
            spec.intermediate_size, spec.hidden_size, rows, spec.mlp_bias, tp, quant=quant
        )
        # SwiGLU, or GeGLU (Gemma): act(gate) * up.
        self.gelu = spec.hidden_act == "gelu_pytorch_tanh"
        self.act_and_mul = ops.gelu_tanh_and_mul if self.gelu else ops.silu_and_mul

    def forward(self, x: torch.Tensor, defer: bool = False) -> torch.Tensor | PendingSum:
        """defer: the caller norms the output next and takes a PendingSum (RowParallelLinear.forward)."""
        return self.down_proj(self.activated(x), defer)

    def activated(self, x: torch.Tensor):
        """act(gate) * up of x's gate_up product: down_proj's input."""
        # The fused launch writes the csrc kernels' bits: only where the layer runs those (CudaOps).
        takes_fused = self.ops.name == "cuda" and self.down_proj.lora is None
        fused = self.gate_up_proj.act_and_mul(x, self.gelu) if takes_fused else None
        if fused is not None:  # one row: the product and the activation in one launch
            return fused
        gate_up = self.gate_up_proj(x)
        lora = self.down_proj.lora
        if lora is not None and lora.act_shrinks(gate_up):  # ZLLM_LORA_NORM_SHRINK at decode
            return lora.act_and_mul(self.ops, gate_up, self.gelu)
        return self.act_and_mul(gate_up)

    def add_to_stream(self, stream: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """stream + mlp(norm(stream)) for one token (the norm-carrying decode step): the norm in
        gate_up's launch and the add in down_proj's where they take them."""
        x = self.gate_up_proj.act_and_mul_normed(stream, norm.eps)
        return self.down_proj.add_to(self.activated(norm(stream)) if x is None else x, stream)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately so the add fuses into the norm.

    Gemma's "sandwich" layer norms the attention and MLP outputs too before each joins the
    residual stream; its names follow HF's: post_attention_layernorm norms the attention output
    there (the MLP's input norm in Llama), pre_feedforward_layernorm is the MLP's input norm."""

    def __init__(self, spec: ModelSpec, ops: TorchOps, tp: TensorParallel, index: int, quant: QuantSpec | None) -> None:
        super().__init__()
        self.index = index
        if spec.mla is not None:
            from zllm.workers.models.deepseek import MlaAttention  # deepseek.py builds on this module

            self.self_attn = MlaAttention(spec, ops, tp, quant, index)
        else:
            self.self_attn = LlamaAttention(spec, ops, tp, quant, index)
        if spec.moe is not None and index in spec.moe.layers and spec.moe.format.gpt_oss:
            self.mlp = GptOssMoeBlock(spec, ops, tp)
        elif spec.moe is not None and index in spec.moe.layers:
            self.mlp = SparseMoeBlock(spec, ops, tp, quant)
        else:
            self.mlp = LlamaMLP(spec, ops, tp, quant)

        def norm() -> RMSNorm:
            return RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops, spec.norm_unit_offset)

        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        # ZLLM_ALLREDUCE_NORM (read when the model is built): o_proj's and down_proj's all-reduces
        # may run in the launch of the add-RMSNorm after them (RMSNorm.forward). Plain layers only:
        # a sandwich norm takes o_proj's output without the residual, and MLA or MoE blocks reduce
        # their own way.
        self.defers_reduce = (
            envs.ZLLM_ALLREDUCE_NORM
            and tp.size > 1
            and not self.sandwich
            and type(self.self_attn) is LlamaAttention
            and type(self.mlp) is LlamaMLP
        )

        # The norm-carrying decode step (forward_carrying_norms) takes plain Llama-family layers:
        # silu MLP, no q/k norm, no sandwich or (1 + w) norms, no deferred all-reduce. LoRA is
        # checked when the step is chosen (carries_norms): adapters are attached after building.
        self.plain = (
            not self.sandwich
            and not spec.norm_unit_offset
            and not self.defers_reduce
            and type(self.self_attn) is LlamaAttention
            and self.self_attn.q_norm is None
            and type(self.mlp) is LlamaMLP
            and not self.mlp.gelu
        )

    def carries_norms(self) -> bool:
        """Whether forward_carrying_norms takes this layer (plain; model-dtype projections without LoRA)."""
        if not self.plain:
            return False
        attn, mlp = self.self_attn, self.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return all(p.lora is None and isinstance(p.weights, DenseWeights) for p in projections)

    def fold_norms(self) -> None:
        """Fold the input and post-attention norms' weights into q/k/v's and gate_up's columns
        (their norms then scale by 1): what forward_carrying_norms' GEMVs need, and every other
        path (more rows, the unfused fallbacks) computes the same products with them."""
        for norm, linear in (
            (self.input_layernorm, self.self_attn.qkv_proj),
            (self.post_attention_layernorm, self.mlp.gate_up_proj),
        ):
            linear.fold_norm(norm.weight.data)
            norm.weight.data.fill_(1)

    def forward_carrying_norms(
        self,
        stream: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """forward for one token with the residual stream kept whole (ZLLM_NORM_GEMV): the stream
        in (the embedding, or the layer before's output plus its residual), this layer's out.
        Each RMSNorm runs in the launch of the GEMV after it and each residual add in the one
        before it (csrc/gemv_kernels.cu kNorm, kAdd): two launches fewer than forward's
        add-RMSNorms. Where a launch does not take its product, the unfused ops give the stream
        forward would over the same folded weights (at tp 1, the same bits)."""
        attn = self.self_attn
        q = attn.project_normed(stream, self.input_layernorm, positions, rotary, kv_cache, meta.slot_mapping)
        attended = attn.attend(q, kv_cache, meta).reshape(-1, attn.q_size)
        stream = attn.o_proj.add_to(attended, stream)
        return self.mlp.add_to_stream(stream, self.post_attention_layernorm)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: Rotary,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        defer_output: bool = False,
    ) -> tuple[torch.Tensor | PendingSum, torch.Tensor]:
        """defer_output: the caller feeds the output to the next layer's norm or the final norm,
        so it may be a PendingSum (after_attention)."""
        q, residual = self.before_attention(x, residual, positions, rotary, kv_cache, meta.slot_mapping)
        return self.after_attention(self.self_attn.attend(q, kv_cache, meta), residual, defer_output)

    def before_attention(
        self,
        x: torch.Tensor | PendingSum,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: Rotary,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Norm, q/k/v, rotary, cache write: (rotated q, residual)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual, _lora_of(self.self_attn, "qkv_proj"))
        return self.self_attn.project(x, positions, rotary, kv_cache, slot_mapping), residual

    def after_attention(
        self, attended: torch.Tensor, residual: torch.Tensor, defer_output: bool = False
    ) -> tuple[torch.Tensor | PendingSum, torch.Tensor]:
        """o_proj, norm, MLP: (this layer's output, residual). With defers_reduce, o_proj's
        all-reduce runs in the norm's launch, and so does down_proj's in the next norm's where
        defer_output says the caller takes a PendingSum."""
        mlp_lora = _lora_of(self.mlp, "gate_up_proj")
        if self.sandwich:
            x = self.self_attn.output(attended)
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual, mlp_lora)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        if not self.defers_reduce:
            x, residual = self.post_attention_layernorm(self.self_attn.output(attended), residual, mlp_lora)
            return self.mlp(x), residual
        x, residual = self.post_attention_layernorm(self.self_attn.output(attended, defer=True), residual, mlp_lora)
        return self.mlp(x, defer=defer_output), residual


def _lora_of(module: nn.Module, projection: str) -> LoRALayer | None:
    """The adapter slots of module's projection (None: no LoRA, or a module without it: MLA
    attention, MoE blocks)."""
    linear = getattr(module, projection, None)
    return None if linear is None else linear.lora


class LlamaModel(nn.Module):
    def __init__(
        self, spec: ModelSpec, ops: TorchOps, tp: TensorParallel, quant: QuantSpec | None, max_model_len: int | None
    ) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, ops, tp, i, quant) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops, spec.norm_unit_offset)
        self.rotary = Rotary(spec, ops, max_model_len)
        self.local_rotary = Rotary(spec, ops, max_model_len, local=True) if spec.local_rope_theta is not None else None
        self.sliding_layers = frozenset(spec.sliding_layers)

    def rotary_of(self, layer: int) -> Rotary:
        """The rotary of layer `layer`: Gemma 3's local layers have their own."""
        return self.local_rotary if self.spec.uses_local_rope(layer) else self.rotary

    def meta_of(self, layer: int, meta: AttentionMetadata) -> AttentionMetadata:
        """The attention metadata of layer `layer`: a hybrid model's sliding layers have their own
        block tables (zllm/kv_layout.py)."""
        return meta.for_layer(layer in self.sliding_layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings; Gemma's times sqrt(hidden_size), rounded to the model dtype first
        as HF does."""
        x = self.embed_tokens(input_ids)
        return x if self.spec.embed_scale is None else x * rounded_to(self.spec.embed_scale, x.dtype)


class LlamaForCausalLM(nn.Module):
    # EAGLE-3 speculation (zllm/workers/spec_decode/eagle.py) sets the target layers whose input it
    # reads; each forward then leaves them in aux_hidden_states, [tokens, 3 * hidden].
    aux_hidden_layers: tuple[int, ...] = ()
    aux_hidden_states: torch.Tensor | None = None
    # (fused parameter, HF tensor, shard index): HF keeps these as separate matrices.
    STACKED = (
        ("qkv_proj", "q_proj", 0),
        ("qkv_proj", "k_proj", 1),
        ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(
        self,
        spec: ModelSpec,
        ops: TorchOps | None = None,
        tp: TensorParallel | None = None,
        quant: QuantSpec | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """quant: how the attention and MLP projections hold their weights (None: the model
        dtype); embeddings, norms, routers, experts and the head always stay in the model dtype.
        max_model_len: the engine's context length (None: max_position_embeddings), which picks
        LongRoPE's factors."""
        super().__init__()
        self.spec = spec
        tp = tp or TensorParallel()
        self.tp = tp
        self.model = LlamaModel(spec, ops or TorchOps(), tp, quant, max_model_len)
        # Whether one-token forwards carry the norms in the GEMVs: carry_norms, after loading.
        self._norm_gemv = False
        if spec.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, tp)
        if quant is not None and quant.ignore:
            self._keep_ignored_modules_dense(quant)

    def _keep_ignored_modules_dense(self, quant: QuantSpec) -> None:
        """The modules a checkpoint's `ignore` list names keep model-dtype weights; a fused layer
        must be ignored in all of its parts or none."""
        for name, module in self.named_modules():
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            shards = (
                range(len(module.parts))
                if isinstance(module, ColumnParallelLinear) and len(module.parts) > 1
                else [None]
            )
            hf_modules = [self.checkpoint_name(f"{name}.weight", shard).removesuffix(".weight") for shard in shards]
            ignored = [quant.ignores(hf) for hf in hf_modules]
            if all(ignored):
                module.use_dense_weights()
            elif any(ignored):
                raise ValueError(
                    f"model: the checkpoint quantizes some of {', '.join(hf_modules)} but not all; "
                    f"zllm fuses them into one matrix"
                )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.forward_embeds(self.model.embed(input_ids), positions, kv_caches, meta)

    def forward_embeds(
        self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """The layers over given input embeddings (a vision-language model's, images placed in)."""
        if self.aux_hidden_layers:
            return self._forward_keeping_aux(x, positions, kv_caches, meta)
        if self._norm_gemv and x.shape[0] == 1:
            return self._forward_carrying_norms(x, positions, kv_caches, meta)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            # defer_output: x only ever reaches the next layer's norm or the final norm.
            x, residual = layer(
                x, residual, positions, self.model.rotary_of(i), kv_cache, self.model.meta_of(i, meta), True
            )
        x, _ = self.model.norm(x, residual)
        return x

    def carry_norms(self, enable_lora: bool) -> bool:
        """Set up the norm-carrying one-token forward (ZLLM_NORM_GEMV) where every layer takes it
        and no LoRA adapter may join the projections: folds the norms' weights into the
        projections after them (the weights change, so call once, after loading). auto: on where
        CUDA's kernels would carry every norm and add (fp16/bf16, the one-row GEMV's b6 build and
        its fused epilogues on, a hidden size of whole 16-byte units); elsewhere the fallbacks
        would launch more than the usual step. Returns whether it is on."""
        if self._norm_gemv:  # folded already: a second fold would scale by gamma twice
            return True
        setting = envs.ZLLM_NORM_GEMV
        if setting is None:
            setting = self._norm_kernels_take_every_layer()
        if not setting or enable_lora or not all(layer.carries_norms() for layer in self.model.layers):
            return False
        with torch.no_grad():
            for layer in self.model.layers:
                layer.fold_norms()
        self._norm_gemv = True
        logger.info(
            "ZLLM_NORM_GEMV: the norms of %d layers folded into their projections; one-token forwards carry them",
            len(self.model.layers),
        )
        return True

    def _norm_kernels_take_every_layer(self) -> bool:
        """auto's test: the _norm and _add GEMV builds would take every one-token layer here."""
        from zllm.workers import ops as ops_module
        from zllm.workers.kernels import matvec

        norm = self.model.norm
        dtype = norm.weight.dtype
        return (
            norm.ops.name == "cuda"
            and dtype in matvec.NORM_GEMV_DTYPES
            and ops_module.GEMV_ENABLED
            and matvec.GEMV_BOUND == "b6"
            and envs.ZLLM_FUSED_ACT_GEMV
            and envs.ZLLM_FUSED_ROPE_GEMV
            and self.spec.hidden_size % (16 // dtype.itemsize) == 0
        )

    def _forward_carrying_norms(
        self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """forward_embeds for one token through LlamaDecoderLayer.forward_carrying_norms."""
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            x = layer.forward_carrying_norms(
                x, positions, self.model.rotary_of(i), kv_cache, self.model.meta_of(i, meta)
            )
        return self.model.norm(x)

    def _forward_keeping_aux(
        self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """forward_embeds that also keeps the residual stream entering each of aux_hidden_layers
        (EAGLE-3's features), concatenated in that order, in `aux_hidden_states`. A loop of its
        own, so the plain forward pays one attribute test."""
        residual, aux = None, {}
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            if i in self.aux_hidden_layers:
                aux[i] = x if residual is None else x + residual
            x, residual = layer(x, residual, positions, self.model.rotary_of(i), kv_cache, self.model.meta_of(i, meta))
        self.aux_hidden_states = torch.cat([aux[i] for i in self.aux_hidden_layers], dim=-1)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole vocabulary on rank 0 (Gemma 2's soft-capped); None on the other ranks."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = head.logits(hidden)
        cap = self.spec.final_logit_softcap
        if cap is None or logits is None:
            return logits
        return torch.tanh(logits / cap) * cap

    # ---- weights -------------------------------------------------------------------------------

    def checkpoint_targets(self, hf_name: str) -> list[tuple[str, int | None]]:
        """The (our parameter name, shard index or None) that an HF tensor fills: one, or every
        part of a fused parameter for Phi-3's fused tensors; none when the tensor is not ours."""
        if "rotary_emb.inv_freq" in hf_name:
            return []
        if hf_name == "lm_head.weight" and self.lm_head is None:
            return []  # tied: the embedding serves as the head
        if self.spec.fused_checkpoint:
            module_name = hf_name.rsplit(".", 1)[0]
            module = self._fused_module(module_name)
            if module is not None:
                return [(hf_name, shard) for shard in range(len(module.parts))]
        target = self._checkpoint_target(hf_name)
        return [] if target is None else [target]

    def _fused_module(self, module_name: str) -> ColumnParallelLinear | None:
        """The fused linear layer of that name, if the model has one."""
        try:
            module = self.get_submodule(module_name)
        except AttributeError:
            return None
        return module if isinstance(module, ColumnParallelLinear) and len(module.parts) > 1 else None

    def _checkpoint_target(self, hf_name: str) -> tuple[str, int | None] | None:
        if self.spec.moe is not None:
            hf_name = hf_name.replace(f".{self.spec.moe.format.block}.", ".mlp.")
            if ".shared_expert" in hf_name and not self.spec.moe.shared_expert_intermediate_size:
                return None  # HF builds a zero-width shared expert: its output is 0, whatever its gate says
            expert = _EXPERT_TENSOR.search(hf_name)
            if expert is not None:
                return self._expert_target(hf_name, expert)
        for fused, part, shard in self.STACKED:
            if f".{part}." in hf_name:
                return hf_name.replace(f".{part}.", f".{fused}."), shard
        return hf_name, None

    def _expert_target(self, hf_name: str, match: re.Match) -> tuple[str, int] | None:
        """experts.E.<gate|up>.weight -> (experts.gate_up_proj, 2E | 2E + 1); <down> -> (down_proj, E).
        A block-FP8 checkpoint's weight_scale_inv goes to the matching *_scale_inv (Fp8Experts)."""
        expert, part, suffix = int(match.group(1)), match.group(2), match.group(3)
        gate, up, down = self.spec.moe.format.expert_parts
        prefix = hf_name[: match.start()]
        scale = "_scale_inv" if suffix else ""
        if part in (gate, up):
            return f"{prefix}.experts.gate_up_proj{scale}", 2 * expert + (part == up)
        if part == down:
            return f"{prefix}.experts.down_proj{scale}", expert
        return hf_name, None  # an unknown part: the loader names it as matching no parameter

    def checkpoint_name(self, name: str, shard: int | None) -> str:
        """The HF tensor name that fills (parameter, shard): checkpoint_targets reversed."""
        if self.spec.fused_checkpoint:
            return name
        if self.spec.moe is not None and ".experts." in name and shard is not None:
            gate, up, down = self.spec.moe.format.expert_parts
            prefix, param = name.rsplit(".experts.", 1)
            scale = "_scale_inv" if param.endswith("_scale_inv") else ""
            stacked = param.removesuffix("_scale_inv")
            expert, part = (shard // 2, (gate, up)[shard % 2]) if stacked == "gate_up_proj" else (shard, down)
            name = f"{prefix}.experts.{expert}.{part}.weight{scale}"
        if self.spec.moe is not None:
            name = name.replace(".mlp.", f".{self.spec.moe.format.block}.")
        for fused, part, index in self.STACKED:
            if shard == index and f".{fused}." in name:
                return name.replace(f".{fused}.", f".{part}.")
        return name

    def expected_checkpoint_tensors(self) -> Iterator[tuple[str, int | None]]:
        """Every (parameter, shard) that a checkpoint must provide exactly once."""
        for name, _ in self.named_parameters():
            module_name, param_name = name.rsplit(".", 1)
            module = self.get_submodule(module_name)
            if hasattr(module, "checkpoint_params") and param_name not in module.checkpoint_params():
                continue  # derived while loading (the scales of weights quantized online)
            if isinstance(module, ColumnParallelLinear) and len(module.parts) > 1:
                for shard in range(len(module.parts)):
                    yield name, shard
            elif isinstance(module, Experts):
                for shard in range(module.num_shards(name.rsplit(".", 1)[1])):
                    yield name, shard
            else:
                yield name, None

    def load_target(self, name: str, shard: int | None) -> LoadTarget:
        """Which part of which checkpoint tensor fills (this rank's slice of) parameter `name`."""
        module_name, param_name = name.rsplit(".", 1)
        module = self.get_submodule(module_name)
        if hasattr(module, "load_target"):
            return module.load_target(param_name, shard)
        return whole_tensor_target(getattr(module, param_name))


# One expert's matrix in an HF MoE checkpoint: ...experts.<expert>.<part>.weight
_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight(_scale_inv)?$")


def _scaled(heads: Span, head_dim: int) -> Span:
    """A span of heads as a span of rows (head_dim rows per head)."""
    return Span(heads.start * head_dim, heads.count * head_dim)
