"""The operations a model layer needs, in two implementations with one interface.

`TorchOps` is plain torch, written to match HF transformers' arithmetic: the CPU path and the
oracle (its decode attention takes the C kernel of zllm/workers/kernels/cpu.py where that builds).
`CudaOps` runs the CUDA kernels (zllm/workers/kernels, through cupy) where they exist and keeps
torch for the rest; its decode path has no host synchronisation and no value-dependent Python,
so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zllm import envs
from zllm.workers import attention as ref
from zllm.workers.attention import UNSCALED, AttentionMetadata, KVScales, PackedPrefill, dequantize_kv
from zllm.workers.kernels import cpu as cpu_kernels
from zllm.workers.kernels.matvec import GEMV_ROWS_MAX, LoRAEpilogue, lora_epilogue_supported
from zllm.workers.layers import apply_rotary, gelu_tanh_and_mul, moe_route, rms_norm, silu_and_mul


class TorchOps:
    name = "torch"
    supports_graphs = False

    def packs_prefill(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether attention() takes a step's prefills packed (AttentionMetadata.prefill) for a
        model of this dtype and head size; the runner asks once and packs every step then."""
        return False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
        """unit_offset: Gemma's norm, (1 + w) in fp32 (layers.rms_norm)."""
        return rms_norm(x, weight, eps, unit_offset)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual <- x + residual; returns (rms_norm(residual), residual)."""
        residual = residual + x
        return rms_norm(residual, weight, eps, unit_offset), residual

    def add_rms_norm_lora_shrink(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        unit_offset: bool,
        a: torch.Tensor,
        token_slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """add_rms_norm, then the LoRA shrink of its output for the projection after it
        (lora_shrink: t [rows, cols] float32); CUDA runs both in one launch (norm_shrinks says
        where). Returns (normed, residual, t)."""
        x, residual = self.add_rms_norm(x, residual, weight, eps, unit_offset)
        return x, residual, lora_shrink(x, a, token_slots)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def act_and_mul_lora_shrink(
        self, x: torch.Tensor, gelu: bool, a: torch.Tensor, token_slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated activation (gelu_tanh_and_mul if gelu, else silu_and_mul), then the LoRA
        shrink of its output for the down projection after it (lora_shrink: t [rows, cols]
        float32); CUDA runs both in one launch (act_shrinks says where). Returns (out, t)."""
        out = self.gelu_tanh_and_mul(x) if gelu else self.silu_and_mul(x)
        return out, lora_shrink(out, a, token_slots)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(x)

    def fuses_moe(self, dtype: torch.dtype) -> bool:
        """Whether moe() runs fused kernels for this dtype (no host sync: graphs can hold it)."""
        return False

    def fuses_experts(self, experts: torch.nn.Module, top_k: int) -> bool:
        """Whether moe() and moe_experts() run these experts (models/moe.py's Experts, top_k per
        token) through the fused kernels: then nothing syncs with the host and a CUDA graph can
        hold them. The torch loop picks each expert's tokens on the host (nonzero, tolist)."""
        return False

    def moe(
        self,
        x: torch.Tensor,
        logits: torch.Tensor,
        experts: torch.nn.Module,
        top_k: int,
        renormalize: bool,
        fp32_weights: bool,
    ) -> torch.Tensor:
        """A Mixture-of-Experts block's expert output (this rank's part, unreduced) for tokens x
        [T, H] with router logits [T, E]; `experts` is models/moe.py's Experts, whose forward is
        the reference."""
        weights, ids = moe_route(logits, top_k, renormalize, fp32_weights)
        return experts(x, weights, ids)

    def moe_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: torch.nn.Module
    ) -> torch.Tensor:
        """The experts' output for routing already decided (DeepSeek's grouped routing, layers.
        grouped_route): fp32 weights [T, k], expert ids [T, k]."""
        return experts(x, weights, ids)

    def gpt_oss_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: torch.nn.Module
    ) -> torch.Tensor:
        """GPT-OSS's experts (models/gpt_oss.py GptOssExperts: biases, the clamped SwiGLU) for
        routing weights [T, k] and ids [T, k]: HF's expert loop."""
        return experts(x, weights, ids)

    def rotary_and_write_kv(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVScales = UNSCALED,
    ) -> torch.Tensor:
        """Rotates q and k, stores k and v in the cache (quantized for an FP8 cache); returns the rotated q."""
        cos, sin = cos[positions], sin[positions]
        ref.write_kv_cache(kv_cache, apply_rotary(k, cos, sin), v, slot_mapping, kv_scales)
        return apply_rotary(q, cos, sin)

    def attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales = UNSCALED,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decodes through the CPU kernel (csrc/cpu) where it runs: it reads K/V in place, where
        the reference gathers them first; the reference otherwise (an FP8 cache, sinks), and for
        the prefills. window / softcap / sinks: the layer's sliding window, logit cap and sink
        logits (attention.py)."""
        out = torch.empty_like(q)
        n = meta.num_decodes
        if n and (
            sinks is not None
            or not cpu_kernels.paged_attention_decode(
                out[:n], q[:n], kv_cache, meta.block_tables[:n], meta.seq_lens[:n], scale, window, softcap
            )
        ):
            out[:n] = ref.decode_attention(q[:n], kv_cache, meta, scale, kv_scales, window, softcap, sinks)
        ref.prefill_attention(out, q, kv_cache, meta, scale, kv_scales, window, softcap, sinks)
        return out

    def write_latent(self, kv_cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """MLA: each token's latent [T, latent_dim] into its slot of the latent cache; slot -1
        (a padded row) nowhere."""
        ref.write_latent(kv_cache, latent, slot_mapping)

    def mla_decode(
        self, q_latent: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, kv_lora_rank: int, scale: float
    ) -> torch.Tensor:
        """MLA decode in the latent space (models/deepseek.py): absorbed queries [n, H, latent_dim]
        of the first n = len(q_latent) requests -> [n, H, kv_lora_rank]."""
        n = q_latent.shape[0]
        return ref.mla_decode(
            q_latent,
            kv_cache,
            meta.block_tables[:n],
            meta.seq_lens[:n],
            meta.seq_lens_list[:n],
            meta.block_size,
            kv_lora_rank,
            scale,
        )


class CudaOps(TorchOps):
    name = "cuda"
    supports_graphs = True

    def __init__(self, device: torch.device) -> None:
        from zllm.workers import kernels

        self.k = kernels
        self.workspace: torch.Tensor | None = None
        self.flash_varlen = flash_varlen_available(device)

    def packs_prefill(self, dtype: torch.dtype, head_dim: int) -> bool:
        # FlashAttention-2 (inside PyTorch) takes half precision and these head sizes only; fp32
        # models keep the per-request SDPA path, which the fp32 HF-exactness tests exercise.
        return self.flash_varlen and dtype in (torch.float16, torch.bfloat16) and head_dim in _FLASH_HEAD_DIMS

    def reserve_decode_workspace(
        self,
        max_batch: int,
        num_heads: int,
        head_dim: int,
        max_len: int,
        device,
        graph_sizes: tuple[int, ...] = (),
        kv_heads: int = 1,
        windows: tuple[int, ...] = (),
        eager_shapes: tuple[tuple[int, int, int, int], ...] = (),
    ) -> None:
        """Allocate the split-K scratch once, so no later step reallocates it under a captured CUDA
        graph. max_len: the block table's capacity in tokens (a graph's grid covers it). For up to
        max_batch rows the most any eager step of any longest context (a window's included) may
        ask (default_partitions_bound for every row count); for the decode graphs of more rows (a
        mixed step's prompt tokens, mixed_graph_max_tokens) what their replays use: the
        partitions the kernel picks for that many rows over max_len or a sliding window.
        eager_shapes: (rows, heads, kv heads, head_dim) of other models that decode through these
        ops without graphs (a speculative draft, an EAGLE head), reserved for likewise."""
        shapes = ((max_batch, num_heads, kv_heads, head_dim), *eager_shapes)
        numel = max(self._eager_workspace_numel(r, h, kv, d, max_len, device) for r, h, kv, d in shapes)
        lengths = {max_len, *(w for w in windows if w < max_len)}
        for rows in (size for size in graph_sizes if size > max_batch):
            for length in lengths:
                _, parts = self.k.attention_partitions(rows, num_heads, kv_heads, length, device)
                numel = max(numel, self.k.attention_workspace_numel(rows, num_heads, head_dim, parts))
        self.workspace = torch.empty(numel, dtype=torch.float32, device=device)

    def _eager_workspace_numel(self, max_batch: int, heads: int, kv_heads: int, head_dim: int, max_len: int, device):
        """The most split-K workspace an eager decode of up to max_batch rows asks for, at any
        longest context up to max_len."""
        return max(
            self.k.attention_workspace_numel(
                rows, heads, head_dim, self.k.default_partitions_bound(rows, heads, kv_heads, max_len, device)
            )
            for rows in range(1, max_batch + 1)
        )

    def rms_norm(self, x, weight, eps, unit_offset=False):
        out = torch.empty_like(x)
        self.k.rms_norm(out, x.contiguous(), weight, eps, unit_offset)
        return out

    def add_rms_norm(self, x, residual, weight, eps, unit_offset=False):
        x = x.contiguous()
        self.k.fused_add_rms_norm(x, residual, weight, eps, unit_offset)  # in place: residual += x; x = norm(residual)
        return x, residual

    def add_rms_norm_lora_shrink(self, x, residual, weight, eps, unit_offset, a, token_slots):
        # Not in place: the launch's other blocks read x and residual while block 0 writes the norm.
        rows = x.shape[0]
        out, residual_out = torch.empty_like(x), torch.empty_like(residual)
        t = torch.empty((rows, a.shape[1]), dtype=torch.float32, device=x.device)
        self.k.fused_add_rms_norm_lora_shrink(
            out, residual_out, t, x, residual, weight, a, token_slots[:rows], eps, unit_offset
        )
        return out, residual_out, t

    def silu_and_mul(self, x):
        out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
        self.k.silu_and_mul(out, x.contiguous())
        return out

    def gelu_tanh_and_mul(self, x):
        out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
        self.k.gelu_tanh_and_mul(out, x.contiguous())
        return out

    def act_and_mul_lora_shrink(self, x, gelu, a, token_slots):
        # Not in place: the launch's other blocks read x while block 0 writes the activation.
        rows = x.shape[0]
        out = torch.empty((rows, x.shape[1] // 2), dtype=x.dtype, device=x.device)
        t = torch.empty((rows, a.shape[1]), dtype=torch.float32, device=x.device)
        kernel = self.k.gelu_tanh_and_mul_lora_shrink if gelu else self.k.silu_and_mul_lora_shrink
        kernel(out, t, x, a, token_slots[:rows])
        return out, t

    def fuses_moe(self, dtype):
        return dtype in (torch.float16, torch.bfloat16)

    def fuses_experts(self, experts, top_k):
        # moe()'s own test, on a row of the model's dtype: the same weights take the same path at
        # every token count (the activations' alignment is torch's: 16 bytes and more).
        return self._fuses(experts, experts.compute_dtype, top_k)

    def _fuses(self, experts, dtype: torch.dtype, top_k: int) -> bool:
        """fused_experts_supported for experts that may be stored otherwise (FP8: Fp8Experts,
        multiplied as dequantized copies in `dtype`, the activations')."""
        from zllm.workers.kernels import moe as fused

        gate_up = experts.gate_up_proj
        if not gate_up.is_cuda or not self.fuses_moe(dtype) or top_k > min(gate_up.shape[0], 32):
            return False
        if gate_up.dtype != dtype:  # dequantized into fresh (aligned, contiguous) stacks
            return gate_up.dtype == torch.float8_e4m3fn and fused.fused_shape_supported(*experts.fused_shape())
        row = gate_up.new_empty(1, gate_up.shape[-1])
        return fused.fused_experts_supported(row, gate_up, experts.down_proj)

    def moe(self, x, logits, experts, top_k, renormalize, fp32_weights):
        # fp32 models (and shapes the kernels do not take) keep the reference loop, which syncs.
        from zllm.workers.kernels import moe as fused

        x = x.contiguous()
        if not self._fuses(experts, x.dtype, top_k):
            return super().moe(x, logits, experts, top_k, renormalize, fp32_weights)
        tokens = x.shape[0]
        weights = torch.empty((tokens, top_k), dtype=torch.float32, device=x.device)
        ids = torch.empty((tokens, top_k), dtype=torch.int32, device=x.device)
        fused.moe_topk_softmax(weights, ids, logits.contiguous(), renormalize, round_weights=not fp32_weights)
        gate_up, down, ids = experts.stacked(ids, x.dtype)
        return fused.experts(x, weights, ids, gate_up, down)

    def moe_experts(self, x, weights, ids, experts):
        from zllm.workers.kernels import moe as fused

        x = x.contiguous()
        if not self._fuses(experts, x.dtype, ids.shape[-1]):
            return super().moe_experts(x, weights, ids, experts)
        gate_up, down, ids = experts.stacked(ids.to(torch.int32), x.dtype)
        return fused.experts(x, weights.float().contiguous(), ids, gate_up, down)

    def gpt_oss_experts(self, x, weights, ids, experts):
        # Graph-safe either way: grouped GEMMs over the chosen experts where torch._grouped_mm's
        # CUTLASS kernels run (Hopper, bf16), every expert on every token otherwise.
        from zllm.workers.kernels import moe as fused

        if x.dtype == torch.bfloat16 and fused.grouped_mm_available(x.device):
            return experts.forward_grouped(x.contiguous(), weights, ids)
        return experts.forward_dense(x, weights, ids)

    def rotary_and_write_kv(self, positions, q, k, v, cos, sin, kv_cache, slot_mapping, kv_scales=UNSCALED):
        # One kernel, in place on the strided q/k views of the fused QKV output: at decode, two
        # would each cost a launch and k would round-trip through memory. cos/sin narrower than
        # half a head rotate its first dims only (partial rotary).
        self.k.rotary_embedding_and_cache(
            positions, q, k, v, cos, sin, kv_cache, slot_mapping, kv_scales.k, kv_scales.v
        )
        return q

    def attention(self, q, kv_cache, meta, scale, kv_scales=UNSCALED, window=None, softcap=None, sinks=None):
        """Decodes through the csrc kernel, the layer's window and cap its arguments (constants
        a captured graph holds). Prefills packed into one FlashAttention call (its window_size
        is the sliding window), or per request; FlashAttention has no soft-capping, so a capped
        layer (Gemma 2) takes the reference's per-request path (HF's eager arithmetic). A layer
        with sinks (GPT-OSS) takes the reference throughout (no csrc sinks kernel yet)."""
        if sinks is not None:
            return self._sinks_attention(q, kv_cache, meta, scale, kv_scales, window, softcap, sinks)
        out = torch.empty_like(q)
        num_decodes = meta.num_decodes
        if num_decodes:
            # Eager steps know their longest context and size the grid to it; a graph is captured
            # for the block table's full capacity (seq_lens_list is empty then).
            longest = max(meta.seq_lens_list[:num_decodes]) if meta.seq_lens_list else None
            self.k.paged_attention_decode(
                out[:num_decodes],
                q[:num_decodes],
                kv_cache,
                meta.block_tables[:num_decodes],
                meta.seq_lens[:num_decodes],
                scale,
                max_seq_len=longest,
                workspace=self.workspace,
                k_scale=kv_scales.k,
                v_scale=kv_scales.v,
                window=window,
                softcap=softcap,
            )
        if softcap is not None:
            ref.prefill_attention(out, q, kv_cache, meta, scale, kv_scales, window, softcap)
            return out
        if meta.prefill is not None:
            start = meta.query_start_loc[num_decodes]
            out[start:] = packed_prefill_attention(q[start:], kv_cache, meta.prefill, scale, kv_scales, window)
            return out
        if window is not None:  # SDPA's flash kernels take no window: the reference's explicit mask
            ref.prefill_attention(out, q, kv_cache, meta, scale, kv_scales, window)
            return out
        for i in range(num_decodes, len(meta.query_start_loc) - 1):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = self.prefill_attention(q[start:end], kv_cache, meta, i, scale, kv_scales)
        return out

    def _sinks_attention(self, q, kv_cache, meta, scale, kv_scales, window, softcap, sinks):
        """GPT-OSS: decodes through csrc/mla_kernels.cu's sinks kernel where it takes the layer,
        prefills (and everything else) through the torch reference."""
        from zllm.workers.kernels import mla as mla_kernels

        n = meta.num_decodes
        if not (n and softcap is None and mla_kernels.sinks_decode_supported(q, kv_cache)):
            return ref.paged_attention(q, kv_cache, meta, scale, kv_scales, window, softcap, sinks)
        out = torch.empty_like(q)
        mla_kernels.paged_attention_decode_sinks(
            out[:n], q[:n], kv_cache, meta.block_tables[:n], meta.seq_lens[:n], sinks, scale, window
        )
        ref.prefill_attention(out, q, kv_cache, meta, scale, kv_scales, window, softcap, sinks)
        return out

    def write_latent(self, kv_cache, latent, slot_mapping):
        # The padded rows' slots (-1) are skipped on the device: no host sync inside a graph.
        from zllm.workers.kernels.cache import write_rows

        if kv_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16) or not kv_cache.is_contiguous():
            return super().write_latent(kv_cache, latent, slot_mapping)
        write_rows(kv_cache, latent.to(kv_cache.dtype).contiguous(), slot_mapping.contiguous())

    def mla_decode(self, q_latent, kv_cache, meta, kv_lora_rank, scale):
        from zllm.workers.kernels import mla as mla_kernels

        if not mla_kernels.mla_decode_supported(q_latent, kv_cache, kv_lora_rank):
            return super().mla_decode(q_latent, kv_cache, meta, kv_lora_rank, scale)
        n = q_latent.shape[0]
        out = torch.empty((n, q_latent.shape[1], kv_lora_rank), dtype=q_latent.dtype, device=q_latent.device)
        return mla_kernels.mla_decode(
            out, q_latent.contiguous(), kv_cache, meta.block_tables[:n], meta.seq_lens[:n], scale
        )

    def prefill_attention(self, query, kv_cache, meta, index, scale, kv_scales=UNSCALED):
        """A chunk of new tokens against its request's cached prefix, through PyTorch's fused SDPA.

        NOTE: an explicit boolean mask (the reference's way to offset the causal diagonal) sends
        SDPA to its slow math kernel; the lower-right causal bias and KV heads expanded to the
        query heads keep it on the flash / memory-efficient kernels (benchmarks/prefill_attention.py).
        """
        from torch.nn.attention.bias import causal_lower_right

        query_len, seq_len = query.shape[0], meta.seq_lens_list[index]
        keys, values = ref.gather_context(
            kv_cache, meta.block_tables[index, : -(-seq_len // meta.block_size)], kv_scales, query.dtype
        )
        group = query.shape[1] // keys.shape[1]
        keys = keys[:seq_len].transpose(0, 1).repeat_interleave(group, dim=0)[None]  # [1, H, L, D]
        values = values[:seq_len].transpose(0, 1).repeat_interleave(group, dim=0)[None]
        q = query.transpose(0, 1)[None]  # [1, H, Q, D]
        if query_len == seq_len:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)
        else:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=causal_lower_right(query_len, seq_len), scale=scale
            )
        return out[0].transpose(0, 1)


_FLASH_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)


# ZLLM_PACKED_PREFILL=0 keeps the per-request prefill loop: the A/B switch of
# benchmarks/prefill_attention.py, throughput.py and the real-model check (which sets this
# constant in-process). Read once, at import.
_PACKED_PREFILL_ENABLED = envs.ZLLM_PACKED_PREFILL


def flash_varlen_available(device: torch.device) -> bool:
    """PyTorch was built with FlashAttention and the GPU is Ampere or newer (its minimum)."""
    return (
        _PACKED_PREFILL_ENABLED
        and device.type == "cuda"
        and torch.backends.cuda.is_flash_attention_available()
        and torch.cuda.get_device_capability(device)[0] >= 8
    )


def packed_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    prefill: PackedPrefill,
    scale: float,
    kv_scales: KVScales = UNSCALED,
    window: int | None = None,
) -> torch.Tensor:
    """Every prefill request of the step in one FlashAttention call over variable lengths.

    query [prefill tokens, heads, head_dim], request after request. Each request's context is
    gathered from the paged cache into one packed key/value run (a single index_select for all
    of them; an FP8 cache's rows are dequantized after the gather); FlashAttention aligns the causal diagonal to the bottom right when a request has
    fewer queries than keys, which is a chunk (or a prefix-cache hit) attending to its prefix,
    and takes fewer KV heads than query heads as they are (GQA). Where the per-request loop
    costs a dozen launches per request and layer, this is three per layer. A sliding window is
    FlashAttention's window_size_left, window - 1 keys before the query's own (also aligned to
    the bottom right)."""
    keys, values = (
        dequantize_kv(ref.select_slots(kv_cache[half], prefill.context_slots), s, query.dtype)
        for half, s in ((0, kv_scales.k), (1, kv_scales.v))
    )
    return torch.ops.aten._flash_attention_forward(
        query,
        keys,
        values,
        prefill.cu_seq_q,
        prefill.cu_seq_k,
        prefill.max_q,
        prefill.max_k,
        0.0,
        True,
        False,
        scale=scale,
        window_size_left=None if window is None else window - 1,
        window_size_right=None if window is None else 0,
    )[0]


# ZLLM_GEMV=0 sends single rows to cuBLAS too (dense and FP8 layers), and 2-8 rows; ZLLM_GEMV_ROWS=0
# only the 2-8 rows: the A/B switches of benchmarks/gemv.py, latency.py and spec_verify_cost.py.
# Read once, at import.
GEMV_ENABLED = envs.ZLLM_GEMV
GEMV_ROWS_ENABLED = envs.ZLLM_GEMV_ROWS
_gemv_kernels = None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, weight_is_parameter: bool = True
) -> torch.Tensor:
    """F.linear. One CUDA row (a batch-1 decode step) goes through the csrc GEMV instead, which
    streams the weights closer to the memory bandwidth than cuBLAS does at that shape
    (benchmarks/gemv.py), and 2 to 8 rows (small decode batches, a speculative step's verified
    tokens padded to the graph's 8) through its few-row form, which reads the weights once for
    all of them (benchmarks/gemv.py --rows). weight_is_parameter=False: a weight computed in this
    step, which the one-row GEMV must not start loading before its producer finished (PDL)."""
    global _gemv_kernels
    if GEMV_ENABLED and x.is_cuda and x.dim() == 2:
        rows = x.shape[0]
        if rows == 1 or (GEMV_ROWS_ENABLED and 2 <= rows <= GEMV_ROWS_MAX):
            if _gemv_kernels is None:
                from zllm.workers import kernels as _gemv_kernels
            if rows == 1:
                if _gemv_kernels.gemv_supported(x, weight):
                    out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
                    return _gemv_kernels.gemv(out, x, weight, bias, pdl=weight_is_parameter)
            elif _gemv_kernels.gemv_rows_supported(x, weight):
                out = torch.empty((rows, weight.shape[0]), dtype=x.dtype, device=x.device)
                return _gemv_kernels.gemv_rows(out, x, weight, bias)
    return F.linear(x, weight, bias)


def linear_act_and_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool
) -> torch.Tensor | None:
    """act(gate) * up of a gate_up product (weight [2d, K]: the gate's rows, then the up's) in one
    launch (ZLLM_FUSED_ACT_GEMV) where linear() would take the one-row GEMV's default build;
    None elsewhere: the caller runs linear() and the activation, which give the same bits."""
    global _gemv_kernels
    if x.dim() != 2 or x.shape[0] != 1 or not x.is_cuda or not GEMV_ENABLED or not envs.ZLLM_FUSED_ACT_GEMV:
        return None
    if _gemv_kernels is None:
        from zllm.workers import kernels as _gemv_kernels
    from zllm.workers.kernels import matvec

    if weight.shape[0] % 2 or matvec.GEMV_BOUND != "b6" or not _gemv_kernels.gemv_supported(x, weight):
        return None
    out = torch.empty((1, weight.shape[0] // 2), dtype=x.dtype, device=x.device)
    return _gemv_kernels.gemv_act_and_mul(out, x, weight, bias, gelu=gelu)


def linear_rope_cache(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rope) -> torch.Tensor | None:
    """The q/k/v product of one token with q and k rotated and k and v stored in the cache
    (rope: kernels.RopeCache) in one launch (ZLLM_FUSED_ROPE_GEMV), where linear() would take the
    one-row GEMV's default build and the epilogue takes the cache; None elsewhere: the caller
    runs linear() and rotary_and_write_kv, which give the same bits."""
    global _gemv_kernels
    if x.dim() != 2 or x.shape[0] != 1 or not x.is_cuda or not GEMV_ENABLED or not envs.ZLLM_FUSED_ROPE_GEMV:
        return None
    if _gemv_kernels is None:
        from zllm.workers import kernels as _gemv_kernels
    from zllm.workers.kernels import matvec

    n = weight.shape[0]
    if matvec.GEMV_BOUND != "b6" or not _gemv_kernels.gemv_supported(x, weight):
        return None
    if not matvec.rope_cache_supported(x, n, rope):
        return None
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    return _gemv_kernels.gemv_rope_cache(out, x, weight, bias, rope)


# ---- the norm-carrying decode step (ZLLM_NORM_GEMV; models/llama.py forward_carrying_norms) -------


def _norm_gemv_takes(x: torch.Tensor, weight: torch.Tensor):
    """csrc's matvec module where the norm-carrying and residual-adding one-row GEMVs take this
    product (one fp16/bf16 CUDA row, the b6 build, gemv()'s layout), else None."""
    global _gemv_kernels
    if x.dim() != 2 or x.shape[0] != 1 or not x.is_cuda or not GEMV_ENABLED:
        return None
    if _gemv_kernels is None:
        from zllm.workers import kernels as _gemv_kernels
    from zllm.workers.kernels import matvec

    if matvec.GEMV_BOUND != "b6" or x.dtype not in matvec.NORM_GEMV_DTYPES or not matvec.gemv_supported(x, weight):
        return None
    return matvec


def gemv_takes_one_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the one-row b6 GEMV builds that carry the norm step's adds and norms (and push a
    row-parallel product into the Lamport buffers) take x @ weight^T."""
    return _norm_gemv_takes(x, weight) is not None


def linear_add(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, add: torch.Tensor
) -> torch.Tensor | None:
    """add + linear(x, weight, bias) (the product rounded to the dtype first, as add's own
    kernel would see it) in the product's launch where the one-row b6 GEMV takes it; None
    elsewhere: the caller adds."""
    matvec = _norm_gemv_takes(x, weight)
    if matvec is None or tuple(add.shape) != (1, weight.shape[0]) or not add.is_contiguous() or add.dtype != x.dtype:
        return None
    out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    return matvec.gemv_add(out, x, weight, bias, add)


def linear_act_and_mul_normed(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor | None:
    """silu(gate) * up of the gate_up product of rms_norm(x, eps), x a residual stream row and
    the norm's weight folded into `weight` (csrc kNorm), in one launch; None where that launch
    does not take it (the caller norms, projects and activates)."""
    matvec = _norm_gemv_takes(x, weight)
    if matvec is None or not envs.ZLLM_FUSED_ACT_GEMV or weight.shape[0] % 2:
        return None
    out = torch.empty((1, weight.shape[0] // 2), dtype=x.dtype, device=x.device)
    return matvec.gemv_act_and_mul(out, x, weight, bias, norm_eps=eps)


def linear_rope_cache_normed(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rope, eps: float
) -> torch.Tensor | None:
    """linear_rope_cache of rms_norm(x, eps), x a residual stream row and the norm's weight
    folded into `weight` (csrc kNorm), in one launch; None where that launch does not take it
    (the caller norms and projects)."""
    matvec = _norm_gemv_takes(x, weight)
    if matvec is None or not envs.ZLLM_FUSED_ROPE_GEMV or not matvec.rope_cache_supported(x, weight.shape[0], rope):
        return None
    out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    return matvec.gemv_rope_cache(out, x, weight, bias, rope, norm_eps=eps)


# ---- LoRA's expand fused into the GEMV (zllm/workers/lora.py's decode path) ---------------------


def fuses_lora(x: torch.Tensor, weight: torch.Tensor, lora_b: torch.Tensor) -> bool:
    """Whether linear_lora takes this product in one launch: on CUDA where linear() would take a
    GEMV kernel (1 row; 2-8 with ZLLM_GEMV_ROWS) and the kernels take the LoRA's rank; on the
    CPU (the torch reference: tests of the wiring) the same row counts."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= GEMV_ROWS_MAX:
        return False
    if not x.is_cuda:
        return True
    rows = x.shape[0]
    if (
        not GEMV_ENABLED
        or not (rows == 1 or GEMV_ROWS_ENABLED)
        or not lora_epilogue_supported(x.dtype, lora_b.shape[2])
    ):
        return False
    from zllm.workers.kernels import matvec

    return matvec.gemv_supported(x, weight) if rows == 1 else matvec.gemv_rows_supported(x, weight)


def linear_lora(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora: LoRAEpilogue) -> torch.Tensor:
    """linear(x, weight, bias) plus each row's LoRA expand (LoRAEpilogue: b[n, slot, :] . t[row,
    part(n) R ..], nothing for slot -1), for the rows fuses_lora takes: on CUDA one GEMV launch
    adds both (csrc/gemv_kernels.cu gemv_lora_* / gemv_rows_lora_*), elsewhere the torch reference."""
    if not x.is_cuda:
        return linear_lora_reference(x, weight, bias, lora)
    from zllm.workers.kernels import matvec

    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    if x.shape[0] == 1:
        return matvec.gemv(out, x, weight, bias, lora=lora)
    return matvec.gemv_rows(out, x, weight, bias, lora=lora)


def linear_lora_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora: LoRAEpilogue
) -> torch.Tensor:
    """The fused kernels' math in torch (any device): x W^T + bias + the expand, summed in fp32 and
    rounded once to x's dtype (the separate expand rounds the product first)."""
    t, b, token_slots, part_ends = lora
    rows, rank = x.shape[0], b.shape[2]
    slots = token_slots[:rows].long()
    out_rows = torch.arange(weight.shape[0], device=x.device)
    part = torch.bucketize(out_rows, torch.tensor(part_ends[:-1], device=x.device), right=True)
    t_rows = t.view(rows, len(part_ends), rank)[:, part]  # [rows, N, R]: each output's part
    b_rows = b[:, slots.clamp(min=0)].transpose(0, 1).float()  # [rows, N, R]: each row's slot
    delta = torch.where((slots >= 0)[:, None], (t_rows * b_rows).sum(-1), 0.0)
    base = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return (base + delta).to(x.dtype)


# The decode launches (as the GEMV's) whose add-RMSNorm (and gated activation) may also run the
# next projection's LoRA shrink: each of the kernel's blocks re-reads its row, which pays while
# launches, not bytes, cost.
NORM_SHRINK_ROWS_MAX = GEMV_ROWS_MAX


def norm_shrinks(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether add_rms_norm_lora_shrink takes this norm in one launch: 1 to NORM_SHRINK_ROWS_MAX
    rows, and on CUDA operands the kernel takes (the CPU, the torch reference: tests of the
    wiring, the same row counts)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= NORM_SHRINK_ROWS_MAX:
        return False
    if not x.is_cuda:
        return True
    from zllm.workers.kernels.layernorm import norm_shrink_supported

    return norm_shrink_supported(x, residual, weight, a)


def act_shrinks(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether act_and_mul_lora_shrink takes this activation (x [rows, 2I], gate then up) in one
    launch: 1 to NORM_SHRINK_ROWS_MAX rows (norm_shrinks' decode launches), a's width I, and on
    CUDA operands the kernel takes (the CPU, the torch reference: tests of the wiring)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= NORM_SHRINK_ROWS_MAX or x.shape[1] != 2 * a.shape[-1]:
        return False
    if not x.is_cuda:
        return True
    from zllm.workers.kernels.activation import act_shrink_supported

    return act_shrink_supported(x, a)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """t [rows, C] float32 = x [rows, in] @ a[slot]^T per row's slot (a [S, C, in]; 0 for slot -1):
    csrc/lora_kernels.cu's lora_shrink on CUDA, its torch reference elsewhere."""
    rows = x.shape[0]
    if x.is_cuda:
        from zllm.workers.kernels.lora import lora_shrink as kernel

        t = torch.empty((rows, a.shape[1]), dtype=torch.float32, device=x.device)
        return kernel(t, x, a, token_slots[:rows])
    slots = token_slots[:rows].long()
    t = torch.bmm(a[slots.clamp(min=0)].float(), x.float().unsqueeze(-1)).squeeze(-1)
    return torch.where((slots >= 0)[:, None], t, 0.0)


def ops_for(device: torch.device) -> TorchOps:
    return CudaOps(device) if device.type == "cuda" else TorchOps()
