// Decode attention for the attention kinds of issue 32 (zllm/workers/kernels/mla.py launches them):
//
//   mla_decode_<dt>_d576_v512: DeepSeek's multi-head latent attention in the latent space. Every
//     head of a sequence reads the same cached latents (kv_lora_rank + qk_rope_head_dim = 512 + 64
//     values a token): one block per (sequence, group of heads) loads a tile of latents into
//     shared memory once, in fp32, and each warp (one head) scores them against its absorbed
//     query, with an online softmax, accumulating the first 512 values (the latent) as its output.
//     Reference: zllm/workers/models/deepseek.py mla_decode.
//
//   paged_attention_decode_sinks_<dt>_d<64|128>: per-head K/V paged attention whose softmax has
//     one more logit per head, the sink (GPT-OSS), within an optional sliding window. One block
//     per (sequence, query head); its warps split the tokens and merge their partial softmaxes.
//     Reference: zllm/workers/attention.py decode_attention(sinks=...).
//
// Both compute in fp32 and write the output dtype once. Lane l of a warp holds dims l, l + 32, ...
#include "common.cuh"

namespace zllm {

// ---- MLA decode ---------------------------------------------------------------------------------

constexpr int kMlaTile = 8;  // latents per shared-memory tile

// grid (batch, ceil(heads / heads_per_block)); block 32 * heads_per_block threads.
// q [B, H, D] (row stride q_stride), cache [slots, D] contiguous (the layer's latent cache),
// block_tables int32 [B, max_blocks] (row stride bt_stride), seq_lens int32 [B], out [B, H, V]
// (row stride out_stride).
template <typename T, int D, int V>
__device__ void mla_decode(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ cache,
                           const int* __restrict__ block_tables, const int* __restrict__ seq_lens, float scale,
                           int num_heads, int heads_per_block, int block_size, i64 bt_stride, i64 q_stride,
                           i64 out_stride) {
  static_assert(D % 32 == 0 && V % 32 == 0 && V <= D, "dims must be multiples of 32");
  constexpr int DL = D / 32;  // query dims a lane holds
  constexpr int VL = V / 32;  // output dims a lane accumulates
  __shared__ float tile[kMlaTile][D];
  const int b = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int h = blockIdx.y * heads_per_block + warp;
  const bool active = h < num_heads;
  const int len = seq_lens[b];
  const int* table = block_tables + b * bt_stride;

  float qr[DL];
  float acc[VL];
#pragma unroll
  for (int i = 0; i < DL; ++i) qr[i] = active ? to_float(q[b * q_stride + (i64)h * D + lane + 32 * i]) * scale : 0.f;
#pragma unroll
  for (int i = 0; i < VL; ++i) acc[i] = 0.f;
  float m = neg_inf(), l = 0.f;

  for (int t0 = 0; t0 < len; t0 += kMlaTile) {
    const int count = imin(kMlaTile, len - t0);
    __syncthreads();  // the previous tile is read
    for (int idx = threadIdx.x; idx < count * D; idx += blockDim.x) {
      const int tt = idx / D, d = idx - tt * D;
      const int t = t0 + tt;
      const i64 slot = (i64)table[t / block_size] * block_size + t % block_size;
      tile[tt][d] = to_float(cache[slot * D + d]);
    }
    __syncthreads();
    if (!active) continue;
    for (int tt = 0; tt < count; ++tt) {
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < DL; ++i) s += qr[i] * tile[tt][lane + 32 * i];
      s = warp_sum(s);
      const float m_new = fmaxf(m, s);
      const float correction = expf(m - m_new);
      const float p = expf(s - m_new);
      l = l * correction + p;
#pragma unroll
      for (int i = 0; i < VL; ++i) acc[i] = acc[i] * correction + p * tile[tt][lane + 32 * i];
      m = m_new;
    }
  }
  if (!active) return;
  const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int i = 0; i < VL; ++i) out[b * out_stride + (i64)h * V + lane + 32 * i] = from_float<T>(acc[i] * inv);
}

// ---- decode attention with sinks (and an optional window) ---------------------------------------

constexpr int kSinkWarps = 4;

// grid (batch, num_heads); block 32 * kSinkWarps threads. q/out [B, H, D] (row strides),
// kv_cache [2, blocks, block_size, KVH, D] contiguous (keys at key_cache, values at value_cache),
// sinks fp32 [H]; window 0: none.
template <typename T, int D>
__device__ void sinks_decode(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ key_cache,
                             const T* __restrict__ value_cache, const int* __restrict__ block_tables,
                             const int* __restrict__ seq_lens, const float* __restrict__ sinks, float scale,
                             int kv_heads, int group, int block_size, i64 bt_stride, i64 q_stride, i64 out_stride,
                             int window) {
  constexpr int DL = D / 32;
  __shared__ float part_m[kSinkWarps], part_l[kSinkWarps];
  __shared__ float part_acc[kSinkWarps][D];
  const int b = blockIdx.x, h = blockIdx.y;
  const int kvh = h / group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int len = seq_lens[b];
  const int start = window > 0 && len > window ? len - window : 0;
  const int* table = block_tables + b * bt_stride;

  float qr[DL], acc[DL];
#pragma unroll
  for (int i = 0; i < DL; ++i) {
    qr[i] = to_float(q[b * q_stride + (i64)h * D + lane + 32 * i]) * scale;
    acc[i] = 0.f;
  }
  float m = neg_inf(), l = 0.f;
  for (int t = start + warp; t < len; t += kSinkWarps) {
    const i64 slot = (i64)table[t / block_size] * block_size + t % block_size;
    const i64 base = (slot * kv_heads + kvh) * D;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < DL; ++i) s += qr[i] * to_float(key_cache[base + lane + 32 * i]);
    s = warp_sum(s);
    const float m_new = fmaxf(m, s);
    const float correction = expf(m - m_new);
    const float p = expf(s - m_new);
    l = l * correction + p;
#pragma unroll
    for (int i = 0; i < DL; ++i) acc[i] = acc[i] * correction + p * to_float(value_cache[base + lane + 32 * i]);
    m = m_new;
  }
  if (lane == 0) {
    part_m[warp] = m;
    part_l[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < DL; ++i) part_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  if (warp != 0) return;
  // The sink is one more logit of the softmax, with no value.
  float total_m = sinks[h];
  for (int w = 0; w < kSinkWarps; ++w) total_m = fmaxf(total_m, part_m[w]);
  float total_l = expf(sinks[h] - total_m);
  float weights[kSinkWarps];
  for (int w = 0; w < kSinkWarps; ++w) {
    weights[w] = part_l[w] > 0.f ? expf(part_m[w] - total_m) : 0.f;
    total_l += part_l[w] * weights[w];
  }
  const float inv = 1.f / total_l;
#pragma unroll
  for (int i = 0; i < DL; ++i) {
    float sum = 0.f;
    for (int w = 0; w < kSinkWarps; ++w) sum += part_acc[w][lane + 32 * i] * weights[w];
    out[b * out_stride + (i64)h * D + lane + 32 * i] = from_float<T>(sum * inv);
  }
}

}  // namespace zllm

#define ZLLM_MLA_DECODE(NAME, T, D, V)                                                                         \
  extern "C" __global__ void __launch_bounds__(256, 1)                                                        \
      NAME(T* out, const T* q, const T* cache, const int* block_tables, const int* seq_lens, float scale,      \
           int num_heads, int heads_per_block, int block_size, zllm::i64 bt_stride, zllm::i64 q_stride,        \
           zllm::i64 out_stride) {                                                                             \
    zllm::mla_decode<T, D, V>(out, q, cache, block_tables, seq_lens, scale, num_heads, heads_per_block,        \
                              block_size, bt_stride, q_stride, out_stride);                                    \
  }

ZLLM_MLA_DECODE(mla_decode_f32_d576_v512, float, 576, 512)
ZLLM_MLA_DECODE(mla_decode_f16_d576_v512, __half, 576, 512)
ZLLM_MLA_DECODE(mla_decode_bf16_d576_v512, __nv_bfloat16, 576, 512)

#define ZLLM_SINKS_DECODE(NAME, T, D)                                                                          \
  extern "C" __global__ void __launch_bounds__(128)                                                          \
      NAME(T* out, const T* q, const T* key_cache, const T* value_cache, const int* block_tables,              \
           const int* seq_lens, const float* sinks, float scale, int kv_heads, int group, int block_size,      \
           zllm::i64 bt_stride, zllm::i64 q_stride, zllm::i64 out_stride, int window) {                        \
    zllm::sinks_decode<T, D>(out, q, key_cache, value_cache, block_tables, seq_lens, sinks, scale, kv_heads,   \
                             group, block_size, bt_stride, q_stride, out_stride, window);                      \
  }

ZLLM_SINKS_DECODE(paged_attention_decode_sinks_f32_d64, float, 64)
ZLLM_SINKS_DECODE(paged_attention_decode_sinks_f16_d64, __half, 64)
ZLLM_SINKS_DECODE(paged_attention_decode_sinks_bf16_d64, __nv_bfloat16, 64)
ZLLM_SINKS_DECODE(paged_attention_decode_sinks_f32_d128, float, 128)
ZLLM_SINKS_DECODE(paged_attention_decode_sinks_f16_d128, __half, 128)
ZLLM_SINKS_DECODE(paged_attention_decode_sinks_bf16_d128, __nv_bfloat16, 128)
