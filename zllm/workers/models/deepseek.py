"""DeepSeek-V2 / V2-Lite / V3: multi-head latent attention (MLA) in the Llama-family decoder of
models/llama.py, whose layers, MoE block (models/moe.py: shared experts, grouped routing) and
loading it shares.

MLA (HF DeepseekV2Attention): each token's keys and values are one latent, kv_a_proj_with_mqa's
kv_lora_rank values (RMS-normed) and one qk_rope_head_dim key that rotary rotates, both shared by
every head. The cache holds exactly these, kv_lora_rank + qk_rope_head_dim values per token per
layer (spec.mla.latent_dim), in a layer cache of shape [1, num_blocks, block_size, 1, latent_dim].
kv_b_proj expands a latent into each head's qk_nope_head_dim key part and v_head_dim value.

- Prefill expands the context's latents through kv_b_proj into per-head keys and values and
  attends as HF does (a chunk or a prefix-cache hit expands its whole cached context).
- Decode attends in the latent space with the absorbed projections: each head's query part
  q_nope goes through its W_UK (kv_b_proj's key rows) into the latent's space, so a score is
  (W_UK^T q_nope) . c + q_pe . k_pe over the cached latent c itself, one shared "KV head" of
  latent_dim values; the softmax-weighted sum of latents goes through W_UV (the value rows). Per
  token and head this reads latent_dim values instead of expanding every cached token.

Tensor parallelism: the heads are split (q_proj/q_b_proj, kv_b_proj and o_proj by head), and
the latent cache is replicated: each rank computes kv_a_proj_with_mqa (replicated, a small
hidden x latent_dim matrix) and caches the whole latent. A score sums over all of the latent's
values, so a latent split across ranks would need a collective inside every attention; the
latent is small (576 values a token for V2/V3 against 2 x 128 heads x 128 for per-head K and V)
and replicating it keeps attention rank-local, as vLLM does.
"""

from __future__ import annotations

import torch
from torch import nn

from zllm.model_spec import ModelSpec
from zllm.partition import Span, head_shards
from zllm.quantization import QuantSpec
from zllm.workers.attention import AttentionMetadata, attend, gather_latents
from zllm.workers.distributed import TensorParallel
from zllm.workers.fp8 import dequantize_stacked
from zllm.workers.layers import apply_rotary
from zllm.workers.linear_weights import DenseWeights, Fp8Weights
from zllm.workers.models.llama import LlamaForCausalLM, RMSNorm, Rotary
from zllm.workers.ops import TorchOps
from zllm.workers.parallel_layers import ColumnParallelLinear, FusedPart, RowParallelLinear

# HF's q_a_layernorm and kv_a_layernorm keep DeepseekV2RMSNorm's default eps, not rms_norm_eps.
_LORA_NORM_EPS = 1e-6


def _head_rows(heads: Span, per_head: int) -> Span:
    return Span(heads.start * per_head, heads.count * per_head)


def _replicated(input_size: int, output_size: int, bias: bool, quant: QuantSpec | None) -> ColumnParallelLinear:
    """A linear layer every rank holds whole."""
    return ColumnParallelLinear(input_size, [FusedPart(output_size, Span(0, output_size))], bias=bias, quant=quant)


class MlaAttention(nn.Module):
    """This rank's heads of one MLA layer; project / attend / output as LlamaAttention's."""

    def __init__(
        self, spec: ModelSpec, ops: TorchOps, tp: TensorParallel, quant: QuantSpec | None, index: int = 0
    ) -> None:
        super().__init__()
        mla = spec.mla
        self.mla = mla
        self.ops = ops
        heads = head_shards(spec.num_heads, spec.num_kv_heads, tp.size)[tp.rank].q_heads
        self.num_heads = heads.count
        self.scale = mla.softmax_scale
        qk, nope_v = mla.qk_head_dim, mla.qk_nope_head_dim + mla.v_head_dim
        bias = spec.o_proj_bias  # HF's attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj
        q_part = [FusedPart(spec.num_heads * qk, _head_rows(heads, qk))]
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(spec.hidden_size, q_part, bias=False, quant=quant)
        else:
            self.q_a_proj = _replicated(spec.hidden_size, mla.q_lora_rank, bias, quant)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LORA_NORM_EPS, ops)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, q_part, bias=False, quant=quant)
        self.kv_a_proj_with_mqa = _replicated(spec.hidden_size, mla.latent_dim, bias, quant)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LORA_NORM_EPS, ops)
        self.kv_b_proj = ColumnParallelLinear(
            mla.kv_lora_rank, [FusedPart(spec.num_heads * nope_v, _head_rows(heads, nope_v))], bias=False, quant=quant
        )
        v_rows = _head_rows(heads, mla.v_head_dim)
        self.o_proj = RowParallelLinear(
            spec.num_heads * mla.v_head_dim, spec.hidden_size, v_rows, bias, tp, quant=quant
        )

    def finish_loading(self) -> None:
        """The absorbed decode multiplies by kv_b_proj's matrix itself, so a block-FP8 kv_b_proj
        (a checkpoint kept in FP8: ZLLM_FP8_BLOCKS) becomes the model dtype here, the values the
        dequantize-at-load path holds; it is 0.3% of DeepSeek-V3's weights."""
        weights = self.kv_b_proj.weights
        if isinstance(weights, DenseWeights):
            return
        if not (isinstance(weights, Fp8Weights) and weights.spec.block and weights.spec.activation == "none"):
            raise ValueError("model: MLA's kv_b_proj takes model-dtype or weight-only block-FP8 weights")
        layer, dtype = self.kv_b_proj, self.kv_a_layernorm.weight.dtype
        rows, cols = layer.weight.shape
        dense = torch.empty((1, rows, cols), dtype=dtype, device=layer.weight.device)
        dequantize_stacked(layer.weight.data[None], weights.weight_scale(layer).data[None], dense)
        layer.use_dense_weights()
        layer.weight = nn.Parameter(dense[0])

    def _pairs(self, x: torch.Tensor) -> torch.Tensor:
        """DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...: laid out as two halves, the
        rotation is rotate_half's (V3's apply_rotary_pos_emb_interleave gives exactly this layout;
        V2's keeps the pairs interleaved, the same dot products)."""
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if self.mla.rope_interleave else x

    def project(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """The queries [tokens, heads, qk_head_dim] (q_nope, then the rotated q_pe); each token's
        latent and rotated shared key go to its cache slot."""
        mla = self.mla
        if mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(-1, self.num_heads, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1
        )
        c, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        cos, sin = rotary.cos[positions], rotary.sin[positions]
        q_pe = apply_rotary(self._pairs(q_pe), cos, sin)
        k_pe = apply_rotary(self._pairs(k_pe)[:, None, :], cos, sin)[:, 0]
        self.ops.write_latent(kv_cache, torch.cat((c, k_pe), dim=-1), slot_mapping)
        return torch.cat((q_nope, q_pe), dim=-1)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """[tokens, heads, v_head_dim]: the decodes in the latent space, the prefills expanded."""
        out = q.new_empty(q.shape[0], self.num_heads, self.mla.v_head_dim)
        n = meta.num_decodes
        if n:
            out[:n] = self._decode(q[:n], kv_cache, meta)
        for i in range(n, len(meta.seq_lens_list)):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = self._prefill(q[start:end], kv_cache, meta, i)
        return out

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attended.reshape(-1, self.num_heads * self.mla.v_head_dim))

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, qk_nope_head_dim, kv_lora_rank] and W_UV [heads, v_head_dim, kv_lora_rank]."""
        mla = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return w[:, : mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim :]

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        mla = self.mla
        w_uk, w_uv = self._kv_b()
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        q_latent = torch.cat((torch.einsum("bhn,hnc->bhc", q_nope, w_uk), q_pe), dim=-1)
        attended = self.ops.mla_decode(q_latent, kv_cache, meta, mla.kv_lora_rank, self.scale)
        return torch.einsum("bhc,hvc->bhv", attended, w_uv)

    def _prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, index: int) -> torch.Tensor:
        """One request's queries against its whole context, expanded through kv_b_proj as HF does."""
        mla = self.mla
        seq_len, query_len = meta.seq_lens_list[index], q.shape[0]
        table = meta.block_tables[index, : -(-seq_len // meta.block_size)]
        latents = gather_latents(kv_cache, table)[:seq_len].to(q.dtype)
        c, k_pe = latents.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c).view(seq_len, self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        keys = torch.cat((k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)), dim=-1)
        mask = None  # causal, aligned to the last key
        if query_len != seq_len:
            q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos
        return attend(q.transpose(0, 1), keys.transpose(0, 1), v.transpose(0, 1), mask, self.scale).transpose(0, 1)


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepseekV2ForCausalLM / DeepseekV3ForCausalLM: q_proj is its own matrix (no fused q/k/v);
    the dense MLPs and the shared experts fuse gate and up as Llama's."""

    STACKED = (
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )
