// Rotary embedding in place, HF's rotate_half convention (zllm.workers.layers.apply_rotary):
// over the first R = rot_dim dims of each head (R = D but for partial rotary, Phi-4-mini) the
// pairs are (i, i + R/2) for i < R/2, rotated by angle position * inv_freq[i]:
//   x[i]       <- x[i] * cos - x[i + R/2] * sin
//   x[i + R/2] <- x[i + R/2] * cos + x[i] * sin
// and dims R..D-1 pass unchanged.
//
//   q [T, H, D], k [T, KVH, D]   token rows may be strided; heads contiguous (stride D)
//   positions [T] int64; cos, sin float32 [max_pos, R/2] contiguous
//
// Grid: one block per token; threads stride over the (H + KVH) * D/2 pairs. A position outside
// [0, max_pos) leaves the token untouched (a kernel cannot raise; never read out of bounds).
//
// rotary_embedding_and_cache: the same rotation, then the rotated k and the unchanged v stored at
// the token's slot of the paged KV cache (reshape_and_cache's layout and padding rule), in one
// launch: a decode step runs this once per layer, and a second kernel would cost its own launch
// and a round trip through memory for k.
//   v [T, KVH, D] token rows may be strided; k_cache, v_cache [num_slots, KVH, D] contiguous;
//   slot_mapping [T] int64 (negative: padding, nothing stored)
//   The _kvfp8 entry points store into an FP8 cache: e4m3(x * inv_k_scale) for keys and
//   e4m3(x * inv_v_scale) for values (zllm/workers/attention.py quantize_kv); the others ignore
//   the two scales.
// Grid (T, H + KVH), D/2 threads: thread i < R/2 rotates the pair (i, i + R/2) of one head, a
// thread past them owns two neighbouring dims past R (partial rotary: (D - R) / 2 threads); the
// blocks of kv heads also store k (rotated) and v (dims i and i + D/2). All loads are issued
// before the first use, so their latencies overlap.
#include "rope.cuh"  // rotated(), to_cache(): shared with gemv_kernels.cu's q/k/v epilogue

namespace zllm {

template <typename T>
__device__ __forceinline__ void rotate_pair(T* head, int i, int half, float c, float s) {
  rotated<T>(to_float<T>(head[i]), to_float<T>(head[i + half]), c, s, head[i], head[i + half]);
}

template <typename T>
__device__ __forceinline__ void rotary_embedding_impl(const i64* __restrict__ positions,
                                                      T* __restrict__ q, T* __restrict__ k,
                                                      const float* __restrict__ cos_cache,
                                                      const float* __restrict__ sin_cache,
                                                      int num_heads, int num_kv_heads,
                                                      int head_dim, int rot_dim, i64 q_stride,
                                                      i64 k_stride, i64 max_pos) {
  const i64 token = blockIdx.x;
  const i64 pos = positions[token];
  if (pos < 0 || pos >= max_pos) return;
  const int half = rot_dim / 2;  // dims past rot_dim are left as they are
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

template <typename T, typename C>
__device__ __forceinline__ void rotary_embedding_and_cache_impl(
    const i64* positions, T* q, T* k, const T* v, const float* __restrict__ cos_cache,
    const float* __restrict__ sin_cache, C* __restrict__ k_cache, C* __restrict__ v_cache,
    const i64* slot_mapping, int num_heads, int num_kv_heads,
    int head_dim, i64 q_stride, i64 k_stride, i64 v_stride, i64 max_pos, i64 num_slots,
    int rot_dim, float inv_k_scale, float inv_v_scale) {
  const int half = head_dim / 2;
  const int rot_half = rot_dim / 2;
  const int i = threadIdx.x;
  pdl_launch_dependents();  // PDL (common.cuh): q, k and v are the previous kernel's output
  pdl_wait();
  if (i >= half) return;
  const i64 token = blockIdx.x;
  const int head = blockIdx.y;
  const bool is_q = head < num_heads;
  const int kv_head = head - num_heads;
  T* x = is_q ? q + token * q_stride + static_cast<i64>(head) * head_dim
              : k + token * k_stride + static_cast<i64>(kv_head) * head_dim;

  const i64 pos = positions[token];
  const i64 slot = is_q ? -1 : slot_mapping[token];
  // This thread's two dims of x: a rotary pair, or two neighbours past rot_dim, passed unchanged.
  const bool rotates = i < rot_half;
  const int e1 = rotates ? i : rot_dim + 2 * (i - rot_half);
  const int e2 = rotates ? i + rot_half : e1 + 1;
  const T x1 = x[e1];
  const T x2 = x[e2];
  T v1 = x1, v2 = x2;
  if (!is_q) {
    const T* v_row = v + token * v_stride + static_cast<i64>(kv_head) * head_dim;
    v1 = v_row[i];
    v2 = v_row[i + half];
  }

  T y1 = x1, y2 = x2;
  if (rotates && pos >= 0 && pos < max_pos) {
    rotated<T>(to_float<T>(x1), to_float<T>(x2), cos_cache[pos * rot_half + i], sin_cache[pos * rot_half + i],
               y1, y2);
    x[e1] = y1;
    x[e2] = y2;
  }
  if (slot >= 0 && slot < num_slots) {  // padding (or a bad slot: never write outside)
    const i64 base = (slot * num_kv_heads + kv_head) * head_dim;
    k_cache[base + e1] = to_cache<C>(y1, inv_k_scale);
    k_cache[base + e2] = to_cache<C>(y2, inv_k_scale);
    v_cache[base + i] = to_cache<C>(v1, inv_v_scale);
    v_cache[base + i + half] = to_cache<C>(v2, inv_v_scale);
  }
}

// Eight elements in one load or store: 16 bytes of a 16-bit type, 32 of float, 8 of FP8.
template <typename E>
struct alignas(8 * sizeof(E)) Pack8 {
  E v[8];
};

// rotary_embedding_and_cache_vec: the same rotation and stores as rotary_embedding_and_cache, for
// 16-bit q/k/v rotated over the whole head (R = D, D a multiple of 16): one thread per eight pairs
// (i..i+7, i+D/2..i+D/2+7) of one head of one token, with 16-byte loads and stores, threads
// numbered over (token, head, eight-pair group) so that blocks are full whatever the shape. The
// scalar kernel's 2-byte accesses and 64-thread blocks move ~0.55 TB/s from 256 tokens up on an
// H200, this one 1.9-3.5 TB/s (benchmarks/rope_cache.py). Each pair goes through rotated() as
// there, so both produce the same bits. Needs 16-byte aligned rows (token strides multiples of
// 8 elements) and cos/sin rows of D/2 floats (the Python side checks, else the scalar kernel).
template <typename T, typename C>
__device__ __forceinline__ void rotary_embedding_and_cache_vec_impl(
    const i64* positions, T* q, T* k, const T* v, const float* __restrict__ cos_cache,
    const float* __restrict__ sin_cache, C* __restrict__ k_cache, C* __restrict__ v_cache,
    const i64* slot_mapping, int num_tokens, int num_heads, int num_kv_heads, int head_dim,
    i64 q_stride, i64 k_stride, i64 v_stride, i64 max_pos, i64 num_slots, float inv_k_scale,
    float inv_v_scale) {
  pdl_launch_dependents();  // PDL (common.cuh): q, k and v are the previous kernel's output
  pdl_wait();
  const int half = head_dim / 2;
  const int groups = half / 8;  // eight-pair groups per head
  const i64 item = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  const i64 per_token = static_cast<i64>(num_heads + num_kv_heads) * groups;
  if (item >= per_token * num_tokens) return;
  const i64 token = item / per_token;
  const int rest = static_cast<int>(item - token * per_token);
  const int head = rest / groups;
  const int i = (rest - head * groups) * 8;
  const bool is_q = head < num_heads;
  const int kv_head = head - num_heads;
  T* x = is_q ? q + token * q_stride + static_cast<i64>(head) * head_dim
              : k + token * k_stride + static_cast<i64>(kv_head) * head_dim;
  const i64 pos = positions[token];
  const i64 slot = is_q ? -1 : slot_mapping[token];

  Pack8<T> x1 = *reinterpret_cast<const Pack8<T>*>(x + i);
  Pack8<T> x2 = *reinterpret_cast<const Pack8<T>*>(x + i + half);
  Pack8<T> v1, v2;
  if (!is_q) {
    const T* v_row = v + token * v_stride + static_cast<i64>(kv_head) * head_dim;
    v1 = *reinterpret_cast<const Pack8<T>*>(v_row + i);
    v2 = *reinterpret_cast<const Pack8<T>*>(v_row + i + half);
  }
  if (pos >= 0 && pos < max_pos) {
    const Pack8<float> c = *reinterpret_cast<const Pack8<float>*>(cos_cache + pos * half + i);
    const Pack8<float> s = *reinterpret_cast<const Pack8<float>*>(sin_cache + pos * half + i);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      rotated<T>(to_float<T>(x1.v[j]), to_float<T>(x2.v[j]), c.v[j], s.v[j], x1.v[j], x2.v[j]);
    }
    *reinterpret_cast<Pack8<T>*>(x + i) = x1;
    *reinterpret_cast<Pack8<T>*>(x + i + half) = x2;
  }
  if (slot >= 0 && slot < num_slots) {  // padding (or a bad slot: never write outside)
    const i64 base = (slot * num_kv_heads + kv_head) * head_dim;
    Pack8<C> k1, k2, w1, w2;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      k1.v[j] = to_cache<C>(x1.v[j], inv_k_scale);
      k2.v[j] = to_cache<C>(x2.v[j], inv_k_scale);
      w1.v[j] = to_cache<C>(v1.v[j], inv_v_scale);
      w2.v[j] = to_cache<C>(v2.v[j], inv_v_scale);
    }
    *reinterpret_cast<Pack8<C>*>(k_cache + base + i) = k1;
    *reinterpret_cast<Pack8<C>*>(k_cache + base + i + half) = k2;
    *reinterpret_cast<Pack8<C>*>(v_cache + base + i) = w1;
    *reinterpret_cast<Pack8<C>*>(v_cache + base + i + half) = w2;
  }
}

}  // namespace zllm

#define ZLLM_ROTARY_AND_CACHE_VEC(NAME, T, C)                                                     \
  extern "C" __global__ void NAME(                                                              \
      const long long* positions, T* q, T* k, const T* v, const float* __restrict__ cos_cache,   \
      const float* __restrict__ sin_cache, C* __restrict__ k_cache, C* __restrict__ v_cache,    \
      const long long* slot_mapping, int num_tokens, int num_heads, int num_kv_heads,           \
      int head_dim, long long q_stride, long long k_stride, long long v_stride,                 \
      long long max_pos, long long num_slots, float inv_k_scale, float inv_v_scale) {           \
    zllm::rotary_embedding_and_cache_vec_impl<T, C>(                                            \
        positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, num_tokens,   \
        num_heads, num_kv_heads, head_dim, q_stride, k_stride, v_stride, max_pos, num_slots,    \
        inv_k_scale, inv_v_scale);                                                              \
  }

#define ZLLM_ROTARY_AND_CACHE(NAME, T, C)                                                         \
  extern "C" __global__ void NAME(                                                              \
      const long long* positions, T* q, T* k, const T* v, const float* __restrict__ cos_cache,   \
      const float* __restrict__ sin_cache, C* __restrict__ k_cache, C* __restrict__ v_cache,    \
      const long long* slot_mapping, int num_heads, int num_kv_heads, int head_dim,             \
      long long q_stride, long long k_stride, long long v_stride, long long max_pos,            \
      long long num_slots, int rot_dim, float inv_k_scale, float inv_v_scale) {                 \
    zllm::rotary_embedding_and_cache_impl<T, C>(positions, q, k, v, cos_cache, sin_cache,       \
                                                k_cache, v_cache, slot_mapping, num_heads,      \
                                                num_kv_heads, head_dim, q_stride, k_stride,     \
                                                v_stride, max_pos, num_slots, rot_dim,          \
                                                inv_k_scale, inv_v_scale);                      \
  }

#define ZLLM_ROTARY(NAME, T)                                                                     \
  extern "C" __global__ void NAME(const long long* __restrict__ positions, T* __restrict__ q,    \
                                  T* __restrict__ k, const float* __restrict__ cos_cache,       \
                                  const float* __restrict__ sin_cache, int num_heads,           \
                                  int num_kv_heads, int head_dim, int rot_dim,                  \
                                  long long q_stride, long long k_stride, long long max_pos) {  \
    zllm::rotary_embedding_impl<T>(positions, q, k, cos_cache, sin_cache, num_heads,            \
                                   num_kv_heads, head_dim, rot_dim, q_stride, k_stride,         \
                                   max_pos);                                                    \
  }

ZLLM_ROTARY(rotary_embedding_f32, float)
ZLLM_ROTARY(rotary_embedding_f16, __half)
ZLLM_ROTARY(rotary_embedding_bf16, __nv_bfloat16)

ZLLM_ROTARY_AND_CACHE(rotary_embedding_and_cache_f32, float, float)
ZLLM_ROTARY_AND_CACHE(rotary_embedding_and_cache_f16, __half, __half)
ZLLM_ROTARY_AND_CACHE(rotary_embedding_and_cache_bf16, __nv_bfloat16, __nv_bfloat16)
ZLLM_ROTARY_AND_CACHE(rotary_embedding_and_cache_f32_kvfp8, float, zllm::fp8_t)
ZLLM_ROTARY_AND_CACHE(rotary_embedding_and_cache_f16_kvfp8, __half, zllm::fp8_t)
ZLLM_ROTARY_AND_CACHE(rotary_embedding_and_cache_bf16_kvfp8, __nv_bfloat16, zllm::fp8_t)
ZLLM_ROTARY_AND_CACHE_VEC(rotary_embedding_and_cache_vec_f16, __half, __half)
ZLLM_ROTARY_AND_CACHE_VEC(rotary_embedding_and_cache_vec_bf16, __nv_bfloat16, __nv_bfloat16)
ZLLM_ROTARY_AND_CACHE_VEC(rotary_embedding_and_cache_vec_f16_kvfp8, __half, zllm::fp8_t)
ZLLM_ROTARY_AND_CACHE_VEC(rotary_embedding_and_cache_vec_bf16_kvfp8, __nv_bfloat16, zllm::fp8_t)
