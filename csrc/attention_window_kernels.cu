// The paged decode attention kernels of the layers with a sliding window (_win: Mistral, Phi-3,
// Gemma's local layers) or soft-capped scores (_cap, windowed or not: Gemma 2), for queries in
// fp32, fp16 and bf16 over a cache of the query's dtype and over an FP8 cache (_kvfp8). Their
// partial results go through attention_kernels.cu's reduce. The device code is attention.cuh's.
#include "attention.cuh"

#define ZLLM_PAGED_ATTENTION_VARIANTS(SUFFIX, T, MIN_BLOCKS, MIN_BLOCKS_G8)                               \
  ZLLM_PAGED_ATTENTION_CACHE(paged_attention_decode_##SUFFIX##_win, T, T, true, false, MIN_BLOCKS,      \
                             MIN_BLOCKS_G8)                                                             \
  ZLLM_PAGED_ATTENTION_CACHE(paged_attention_decode_##SUFFIX##_kvfp8_win, T, zllm::fp8_t, true, false,  \
                             ZLLM_ATTN_MIN_BLOCKS_FP8_VARIANT, ZLLM_ATTN_MIN_BLOCKS_FP8_VARIANT_G8)     \
  ZLLM_PAGED_ATTENTION_CACHE(paged_attention_decode_##SUFFIX##_cap, T, T, true, true, MIN_BLOCKS,       \
                             MIN_BLOCKS_G8)                                                             \
  ZLLM_PAGED_ATTENTION_CACHE(paged_attention_decode_##SUFFIX##_kvfp8_cap, T, zllm::fp8_t, true, true,   \
                             ZLLM_ATTN_MIN_BLOCKS_FP8_VARIANT, ZLLM_ATTN_MIN_BLOCKS_FP8_VARIANT_G8)

ZLLM_PAGED_ATTENTION_VARIANTS(f32, float, 2, 2)
ZLLM_PAGED_ATTENTION_VARIANTS(f16, __half, ZLLM_ATTN_MIN_BLOCKS_VARIANT, ZLLM_ATTN_MIN_BLOCKS_VARIANT_G8)
ZLLM_PAGED_ATTENTION_VARIANTS(bf16, __nv_bfloat16, ZLLM_ATTN_MIN_BLOCKS_VARIANT, ZLLM_ATTN_MIN_BLOCKS_VARIANT_G8)
