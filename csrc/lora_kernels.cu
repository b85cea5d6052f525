// Multi-LoRA shrink and expand over a batch whose rows belong to different adapters (slots),
// CUDA-graph compatible: every shape is fixed by the launch (a padded token count), and which
// adapter a row uses is read from a device buffer (token_slots, -1: the base model), never from
// the host. zllm/workers/lora.py holds the torch reference and the slot layout:
//   A [slots, P * R, in]   (P fused parts: q/k/v or gate/up, each part's A in its own R rows)
//   B [slots, out, R]      (part p owns output rows part_start[p] .. part_start[p + 1])
//
// lora_shrink: t [T, P * R] (fp32) = x [T, in] @ A[slot]^T     (0 for rows of the base model)
//   Grid (T, ceil(P * R / 8)); 8 warps a block, one output column a warp, 16-byte loads.
// lora_expand: out [T, out] += scale[slot, p] * t[:, p R .. p R + R] @ B[slot, rows of p]^T
//   Grid (T, ceil(out / 256)); one output element a thread, its R weights in 16-byte loads.
#include "common.cuh"

namespace zllm {

constexpr int kShrinkWarps = 8;
constexpr int kExpandThreads = 256;

// kVec elements per 16-byte load; in % kVec == 0 and 16-byte aligned rows (checked by the host).
template <typename T, int kVec>
__device__ __forceinline__ void lora_shrink_impl(float* __restrict__ t, const T* __restrict__ x,
                                                 const T* __restrict__ a, const int* __restrict__ token_slots,
                                                 int in, int cols, i64 x_stride) {
  const int token = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int col = blockIdx.y * kShrinkWarps + warp;
  if (col >= cols) return;
  const int slot = token_slots[token];
  float acc = 0.f;
  if (slot >= 0) {
    const T* xr = x + static_cast<i64>(token) * x_stride;
    const T* ar = a + (static_cast<i64>(slot) * cols + col) * in;
    for (int k = lane * kVec; k < in; k += 32 * kVec) {
      float xv[kVec], av[kVec];
      load_floats<T, kVec>(xr + k, xv);
      load_floats<T, kVec>(ar + k, av);
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc += xv[e] * av[e];
    }
    acc = warp_sum(acc);
  }
  if (lane == 0) t[static_cast<i64>(token) * cols + col] = acc;
}

// R % kVec == 0 (R = max_lora_rank, checked by the host).
template <typename T, int kVec>
__device__ __forceinline__ void lora_expand_impl(T* __restrict__ out, const float* __restrict__ t,
                                                 const T* __restrict__ b, const float* __restrict__ scale,
                                                 const int* __restrict__ token_slots, int out_cols, int rank,
                                                 int parts, int end0, int end1, i64 out_stride) {
  const int token = blockIdx.x;
  const int o = blockIdx.y * kExpandThreads + threadIdx.x;
  const int slot = token_slots[token];
  if (o >= out_cols || slot < 0) return;
  const int p = o < end0 ? 0 : (o < end1 ? 1 : 2);
  const float* tr = t + static_cast<i64>(token) * parts * rank + p * rank;
  const T* br = b + (static_cast<i64>(slot) * out_cols + o) * rank;
  float acc = 0.f;
  for (int r = 0; r < rank; r += kVec) {
    float bv[kVec];
    load_floats<T, kVec>(br + r, bv);
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc += tr[r + e] * bv[e];
  }
  T* dst = out + static_cast<i64>(token) * out_stride + o;
  *dst = from_float<T>(to_float<T>(*dst) + scale[slot * parts + p] * acc);
}

}  // namespace zllm

#define ZLLM_LORA(SUFFIX, T, VEC)                                                                          \
  extern "C" __global__ void lora_shrink_##SUFFIX(float* __restrict__ t, const T* __restrict__ x,         \
                                                  const T* __restrict__ a, const int* __restrict__ slots, \
                                                  int in, int cols, long long x_stride) {                 \
    zllm::lora_shrink_impl<T, VEC>(t, x, a, slots, in, cols, x_stride);                                   \
  }                                                                                                       \
  extern "C" __global__ void lora_expand_##SUFFIX(T* __restrict__ out, const float* __restrict__ t,       \
                                                  const T* __restrict__ b, const float* __restrict__ scale, \
                                                  const int* __restrict__ slots, int out_cols, int rank,  \
                                                  int parts, int end0, int end1, long long out_stride) {  \
    zllm::lora_expand_impl<T, VEC>(out, t, b, scale, slots, out_cols, rank, parts, end0, end1, out_stride); \
  }

ZLLM_LORA(f32, float, 4)
ZLLM_LORA(f16, __half, 8)
ZLLM_LORA(bf16, __nv_bfloat16, 8)
