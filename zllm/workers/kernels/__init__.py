"""zllm's CUDA kernels (csrc/) on torch tensors, loaded through CuPy, and its CPU kernels.

One module per kernel file, named after it (csrc/<name>_kernels.cu -> kernels/<name>.py), but for
csrc/gemv_kernels.cu -> kernels/matvec.py (`kernels.gemv` is the function) and
csrc/attention_window_kernels.cu, whose kernels kernels/attention.py launches too:

Reference (CPU path and oracle)                  Kernel here
attention.write_kv_cache(kv, k, v, slots)        cache.reshape_and_cache(kv, k, v, slots)
attention.decode_attention(q, kv, meta, scale,   attention.paged_attention_decode(out, q, kv, tables, lens, scale,
  window, softcap)                                 window=, softcap=)
layers.rms_norm(x, w, eps, unit_offset)          layernorm.rms_norm(out, x, w, eps, unit_offset)
x + y, then layers.rms_norm                      layernorm.fused_add_rms_norm(x, residual, w, eps, unit_offset)
                                                   (in place)
x + y, layers.rms_norm, then ops.lora_shrink     layernorm.fused_add_rms_norm_lora_shrink(out, residual_out, t, x,
  (decode rows; ZLLM_LORA_NORM_SHRINK)             residual, w, a, slots, eps, unit_offset)
layers.apply_rotary on q and k                   pos_encoding.rotary_embedding(positions, q, k, cos, sin)  (in place)
apply_rotary, then write_kv_cache                pos_encoding.rotary_embedding_and_cache(positions, q, k, v, cos, sin,
  (an FP8 kv cache: quantize_kv / dequantize_kv)   kv, slots)  (the same, with k_scale, v_scale)
F.linear(x, w, b) for one row x                  matvec.gemv(out, x, w, b); matvec.fp8_gemv for E4M3 weights
F.linear(x, w, b) for 2 to 8 rows x              matvec.gemv_rows(out, x, w, b)
ops.linear_lora_reference (the above plus LoRA's  matvec.gemv / gemv_rows(out, x, w, b, lora=LoRAEpilogue(t, b_lora,
  expand for each row's slot, one rounding)         slots, part_ends))
fp8.quantize_rows, fp8.quantize_groups           quant.quant_fp8_rows, quant.quant_fp8_groups
layers.silu_and_mul(x)                           activation.silu_and_mul(out, x)
q/k/v of one row x, then apply_rotary and the    matvec.gemv_rope_cache(out, x, w, b, RopeCache(...));
  cache write (full rotary)                        fp8_gemv_rope_cache for E4M3 weights
gate_up of one row x, then the activation        matvec.gemv_act_and_mul(out, x, w, b, gelu); fp8_gemv_act_and_mul
either of the two above after layers.rms_norm    the same with norm_eps=eps: x the residual row, the norm's
  (its weight folded into w's columns)             weight folded into w (fp16/bf16)
residual + F.linear(x, w, b) for one row x       matvec.gemv_add(out, x, w, b, residual) (fp16/bf16)
layers.gelu_tanh_and_mul(x)                      activation.gelu_tanh_and_mul(out, x)
the above, then ops.lora_shrink                  activation.silu_and_mul_lora_shrink(out, t, x, a, slots),
  (decode rows; ZLLM_LORA_NORM_SHRINK)             activation.gelu_tanh_and_mul_lora_shrink (the same)
models/moe.py's routing and expert loop          moe.* (its own docstring)
attention.mla_decode(q_latent, cache, ...)       mla.mla_decode(out, q_latent, cache, tables, lens, scale)
attention.decode_attention(..., sinks=)          mla.paged_attention_decode_sinks(out, q, kv, tables, lens, sinks, scale,
                                                   window)
lora.LoRALayer.apply_slot per row's slot       lora.lora_shrink(t, x, a, slots), lora.lora_expand(out, t, b, scale,
                                                   slots, part_ends)  (in place)

`checks` holds the argument checks they share; `loader` finds, builds and launches the CUDA
modules; `pdl` launches the batch-1 kernels that wait for their predecessor with programmatic
dependent launch (ZLLM_PDL, sm_90+); `cpu` is the C kernel the CPU path decodes with (csrc/cpu/,
ctypes).

Every CUDA wrapper checks shapes, dtypes (float32, float16, bfloat16), devices and layouts and
raises ValueError with the reason; it launches on torch's current stream, never synchronises and
allocates nothing (paged_attention_decode's split-K workspace is passed in, or cached per device
and grown only outside CUDA-graph capture), so the calls can be captured by torch.cuda.graph.
The package re-exports them: `kernels.rms_norm(...)`.

Importing this package needs neither CuPy nor a GPU; calling a CUDA kernel needs both (see
`is_available`). The torch references in zllm.workers.layers / zllm.workers.attention stay the
CPU path and the oracle of tests/gpu/test_kernels.py.
"""

from __future__ import annotations

from zllm.workers.kernels.activation import (
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_lora_shrink,
    silu_and_mul,
    silu_and_mul_lora_shrink,
)
from zllm.workers.kernels.attention import (
    attention_partitions,
    attention_workspace_numel,
    default_partitions_bound,
    paged_attention_decode,
)
from zllm.workers.kernels.cache import reshape_and_cache
from zllm.workers.kernels.layernorm import fused_add_rms_norm, fused_add_rms_norm_lora_shrink, rms_norm
from zllm.workers.kernels.loader import KernelUnavailableError, cupy_available, preload
from zllm.workers.kernels.matvec import (
    LoRAEpilogue,
    RopeCache,
    fp8_gemv,
    fp8_gemv_act_and_mul,
    fp8_gemv_rope_cache,
    fp8_gemv_supported,
    gemv,
    gemv_act_and_mul,
    gemv_add,
    gemv_rope_cache,
    gemv_rows,
    gemv_rows_supported,
    gemv_supported,
    lora_epilogue_supported,
)
from zllm.workers.kernels.pos_encoding import rotary_embedding, rotary_embedding_and_cache
from zllm.workers.kernels.quant import quant_fp8_groups, quant_fp8_rows

__all__ = [
    "KernelUnavailableError",
    "LoRAEpilogue",
    "RopeCache",
    "attention_partitions",
    "attention_workspace_numel",
    "default_partitions_bound",
    "fp8_gemv",
    "fp8_gemv_act_and_mul",
    "fp8_gemv_rope_cache",
    "fp8_gemv_supported",
    "fused_add_rms_norm",
    "fused_add_rms_norm_lora_shrink",
    "gelu_tanh_and_mul",
    "gelu_tanh_and_mul_lora_shrink",
    "gemv",
    "gemv_act_and_mul",
    "gemv_add",
    "gemv_rope_cache",
    "gemv_rows",
    "gemv_rows_supported",
    "gemv_supported",
    "is_available",
    "lora_epilogue_supported",
    "paged_attention_decode",
    "preload",
    "quant_fp8_groups",
    "quant_fp8_rows",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "rotary_embedding_and_cache",
    "silu_and_mul",
    "silu_and_mul_lora_shrink",
]


def is_available() -> bool:
    """True when the CUDA kernels can run here: a CUDA device and an importable CuPy."""
    import torch

    return torch.cuda.is_available() and cupy_available()
