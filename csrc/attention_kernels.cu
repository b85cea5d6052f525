// The plain paged decode attention kernels (no sliding window, no soft-capping) and the reduce
// kernels every family shares: for queries in fp32, fp16 and bf16, over a cache of the query's
// dtype and over an FP8 cache (_kvfp8). The device code is attention.cuh's; the pipelined build
// (paged_attention_decode_pipe_*: fp16/bf16 queries, head_dim 64 and 128) attention_pipe.cuh's.
#include "attention_pipe.cuh"

#define ZLLM_PAGED_ATTENTION_PLAIN(SUFFIX, T, MIN_BLOCKS, MIN_BLOCKS_G8)                                  \
  ZLLM_PAGED_ATTENTION_CACHE(paged_attention_decode_##SUFFIX, T, T, false, false, MIN_BLOCKS, MIN_BLOCKS_G8) \
  ZLLM_PAGED_ATTENTION_CACHE(paged_attention_decode_##SUFFIX##_kvfp8, T, zllm::fp8_t, false, false,     \
                             ZLLM_ATTN_MIN_BLOCKS_FP8, ZLLM_ATTN_MIN_BLOCKS_FP8_G8)                    \
  ZLLM_PAGED_ATTENTION_REDUCE(paged_attention_reduce_##SUFFIX##_d64, T, 64)                            \
  ZLLM_PAGED_ATTENTION_REDUCE(paged_attention_reduce_##SUFFIX##_d96, T, 96)                            \
  ZLLM_PAGED_ATTENTION_REDUCE(paged_attention_reduce_##SUFFIX##_d128, T, 128)                          \
  ZLLM_PAGED_ATTENTION_REDUCE(paged_attention_reduce_##SUFFIX##_d256, T, 256)

ZLLM_PAGED_ATTENTION_PLAIN(f32, float, 2, 2)
ZLLM_PAGED_ATTENTION_PLAIN(f16, __half, ZLLM_ATTN_MIN_BLOCKS_16BIT, ZLLM_ATTN_MIN_BLOCKS_16BIT_G8)
ZLLM_PAGED_ATTENTION_PLAIN(bf16, __nv_bfloat16, ZLLM_ATTN_MIN_BLOCKS_16BIT, ZLLM_ATTN_MIN_BLOCKS_16BIT_G8)

#define ZLLM_PAGED_ATTENTION_PIPE_DTYPE(SUFFIX, T)                                                    \
  ZLLM_PAGED_ATTENTION_PIPE_CACHE(paged_attention_decode_pipe_##SUFFIX, T, T, ZLLM_ATTN_MIN_BLOCKS_16BIT, \
                                  ZLLM_ATTN_MIN_BLOCKS_16BIT_G8)                                      \
  ZLLM_PAGED_ATTENTION_PIPE_CACHE(paged_attention_decode_pipe_##SUFFIX##_kvfp8, T, zllm::fp8_t,       \
                                  ZLLM_ATTN_MIN_BLOCKS_FP8, ZLLM_ATTN_MIN_BLOCKS_FP8_G8)

ZLLM_PAGED_ATTENTION_PIPE_DTYPE(f16, __half)
ZLLM_PAGED_ATTENTION_PIPE_DTYPE(bf16, __nv_bfloat16)
