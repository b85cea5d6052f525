// Rotary embedding in place, HF's rotate_half convention (zllm.workers.layers.apply_rotary):
// the pairs are (i, i + D/2) for i < D/2, rotated by angle position * inv_freq[i]:
//   x[i]       <- x[i] * cos - x[i + D/2] * sin
//   x[i + D/2] <- x[i + D/2] * cos + x[i] * sin
//
//   q [T, H, D], k [T, KVH, D]   token rows may be strided; heads contiguous (stride D)
//   positions [T] int64; cos, sin float32 [max_pos, D/2] contiguous
//
// Grid: one block per token; threads stride over the (H + KVH) * D/2 pairs. A position outside
// [0, max_pos) leaves the token untouched (a kernel cannot raise; never read out of bounds).
#include "common.cuh"

namespace zllm {

template <typename T>
__device__ __forceinline__ void rotate_pair(T* head, int i, int half, float c, float s) {
  const float x1 = to_float<T>(head[i]);
  const float x2 = to_float<T>(head[i + half]);
  head[i] = from_float<T>(x1 * c - x2 * s);
  head[i + half] = from_float<T>(x2 * c + x1 * s);
}

template <typename T>
__device__ __forceinline__ void rotary_embedding_impl(const i64* __restrict__ positions,
                                                      T* __restrict__ q, T* __restrict__ k,
                                                      const float* __restrict__ cos_cache,
                                                      const float* __restrict__ sin_cache,
                                                      int num_heads, int num_kv_heads,
                                                      int head_dim, i64 q_stride, i64 k_stride,
                                                      i64 max_pos) {
  const i64 token = blockIdx.x;
  const i64 pos = positions[token];
  if (pos < 0 || pos >= max_pos) return;
  const int half = head_dim / 2;
  const float* cos_row = cos_cache + pos * half;
  const float* sin_row = sin_cache + pos * half;
  T* q_row = q + token * q_stride;
  T* k_row = k + token * k_stride;

  const int q_pairs = num_heads * half;
  const int all_pairs = (num_heads + num_kv_heads) * half;
  for (int p = threadIdx.x; p < all_pairs; p += blockDim.x) {
    const bool is_q = p < q_pairs;
    const int r = is_q ? p : p - q_pairs;
    const int head = r / half;
    const int i = r - head * half;
    T* base = is_q ? q_row + head * head_dim : k_row + head * head_dim;
    rotate_pair<T>(base, i, half, cos_row[i], sin_row[i]);
  }
}

}  // namespace zllm

#define ZLLM_ROTARY(NAME, T)                                                                     \
  extern "C" __global__ void NAME(const long long* __restrict__ positions, T* __restrict__ q,    \
                                  T* __restrict__ k, const float* __restrict__ cos_cache,       \
                                  const float* __restrict__ sin_cache, int num_heads,           \
                                  int num_kv_heads, int head_dim, long long q_stride,           \
                                  long long k_stride, long long max_pos) {                      \
    zllm::rotary_embedding_impl<T>(positions, q, k, cos_cache, sin_cache, num_heads,            \
                                   num_kv_heads, head_dim, q_stride, k_stride, max_pos);        \
  }

ZLLM_ROTARY(rotary_embedding_f32, float)
ZLLM_ROTARY(rotary_embedding_f16, __half)
ZLLM_ROTARY(rotary_embedding_bf16, __nv_bfloat16)
