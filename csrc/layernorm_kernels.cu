// RMSNorm, following zllm.workers.layers.rms_norm step by step:
//   y = to_T(x * rsqrt(mean(x^2) + eps));  out = to_T(w * y)      (x, w, y read as fp32)
// or, with unit_offset (Gemma's norm: the checkpoint holds w, the norm scales by 1 + w), rounded
// once:  out = to_T((x * rsqrt(mean(x^2) + eps)) * (1 + w))
// fused_add_rms_norm (in place):
//   residual = to_T(residual + x);  x = rms_norm(residual)
//
// fused_add_rms_norm_lora_shrink (decode, LoRA on the projection after the norm; not in place):
//   residual_out = to_T(residual + x);  out = rms_norm(residual_out)      (as fused_add_rms_norm)
//   t [rows, cols] (fp32) = out @ A[slot]^T   (A [slots, cols, hidden]; 0 in rows of slot -1)
//   Grid (rows, cols / kNormShrinkCols): every block re-computes its row's sum of squares (a
//   4096-wide row is 16 KB from L2, less than the block's 4 columns of A) and the shrink of its
//   4 columns; block y = 0 also writes out and residual_out. Not in place: the other blocks
//   still read x and residual. Same blockDim as fused_add_rms_norm's launch and the same
//   per-thread order, so the sum of squares and the normalized row are bit-identical to it; the
//   shrink sums the rounded normalized row like lora_shrink (its fp32 order differs).
//
// Grid: one block per row; blockDim a multiple of 32 (at most 1024). Each thread strides over
// the row in units of kVec elements (16 bytes for the _vec entry points, whose row length and
// pointers the host checks; 1 otherwise). The second pass re-reads the row (from L1/L2) instead
// of holding it, so any hidden size works.
// All three wait for the previous kernel first (programmatic dependent launch, common.cuh): there
// is nothing to load before it but the small weight (and the shrink's A); x, residual and the
// slots are read after it.
#include "common.cuh"

namespace zllm {

// One normalized element times its weight, in either norm's arithmetic.
template <typename T>
__device__ __forceinline__ float scaled(float x, float inv_rms, float w, bool unit_offset) {
  return unit_offset ? (x * inv_rms) * (1.f + w) : w * round_to<T>(x * inv_rms);
}

template <typename T, int kVec>
__device__ __forceinline__ void rms_norm_impl(T* out, const T* x, const T* __restrict__ weight,
                                              float eps, int hidden, i64 x_stride,
                                              i64 out_stride, bool unit_offset) {
  __shared__ float scratch[32];
  const T* xr = x + static_cast<i64>(blockIdx.x) * x_stride;
  T* outr = out + static_cast<i64>(blockIdx.x) * out_stride;
  const int units = hidden / kVec;
  pdl_launch_dependents();  // PDL (common.cuh): x is the previous kernel's output
  pdl_wait();

  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < units; i += blockDim.x) {
    float v[kVec];
    load_floats<T, kVec>(xr + i * kVec, v);
#pragma unroll
    for (int e = 0; e < kVec; ++e) sum_sq += v[e] * v[e];
  }
  sum_sq = block_sum(sum_sq, scratch);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(hidden) + eps);

  // out may alias x: each thread reads a unit before it writes the same unit.
  for (int i = threadIdx.x; i < units; i += blockDim.x) {
    float v[kVec], w[kVec];
    load_floats<T, kVec>(xr + i * kVec, v);
    load_floats<T, kVec>(weight + i * kVec, w);
#pragma unroll
    for (int e = 0; e < kVec; ++e) v[e] = scaled<T>(v[e], inv_rms, w[e], unit_offset);
    store_floats<T, kVec>(outr + i * kVec, v);
  }
}

template <typename T, int kVec>
__device__ __forceinline__ void fused_add_rms_norm_impl(T* x, T* residual,
                                                        const T* __restrict__ weight, float eps,
                                                        int hidden, bool unit_offset) {
  __shared__ float scratch[32];
  const i64 row = static_cast<i64>(blockIdx.x) * hidden;
  T* xr = x + row;
  T* rr = residual + row;
  const int units = hidden / kVec;
  pdl_launch_dependents();  // PDL (common.cuh): x (and residual) come from the kernels before
  pdl_wait();

  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < units; i += blockDim.x) {
    float a[kVec], r[kVec];
    load_floats<T, kVec>(xr + i * kVec, a);
    load_floats<T, kVec>(rr + i * kVec, r);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      r[e] = round_to<T>(r[e] + a[e]);  // the stored residual, as the reference rounds it
      sum_sq += r[e] * r[e];
    }
    store_floats<T, kVec>(rr + i * kVec, r);
  }
  sum_sq = block_sum(sum_sq, scratch);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(hidden) + eps);

  // Each thread re-reads only the residual units it wrote itself.
  for (int i = threadIdx.x; i < units; i += blockDim.x) {
    float r[kVec], w[kVec];
    load_floats<T, kVec>(rr + i * kVec, r);
    load_floats<T, kVec>(weight + i * kVec, w);
#pragma unroll
    for (int e = 0; e < kVec; ++e) r[e] = scaled<T>(r[e], inv_rms, w[e], unit_offset);
    store_floats<T, kVec>(xr + i * kVec, r);
  }
}

constexpr int kNormShrinkCols = 4;

// Vector entry points only (hidden % kVec == 0, 16-byte aligned rows and A; checked by the host).
template <typename T, int kVec>
__device__ __forceinline__ void fused_add_rms_norm_lora_shrink_impl(
    T* __restrict__ out, T* __restrict__ residual_out, float* __restrict__ t, const T* x,
    const T* residual, const T* __restrict__ weight, const T* __restrict__ a,
    const int* token_slots, float eps, int hidden, int cols, bool unit_offset) {
  __shared__ float scratch[32];
  __shared__ float partial[32][kNormShrinkCols];
  const int token = blockIdx.x;
  const bool writes = blockIdx.y == 0;  // the block that writes the row's norm and residual
  const int col0 = blockIdx.y * kNormShrinkCols;
  pdl_launch_dependents();  // PDL (common.cuh): x and residual come from the kernels before
  pdl_wait();
  const int slot = token_slots[token];  // uniform over the block, like the early return below
  float* tr = t + static_cast<i64>(token) * cols + col0;
  if (slot < 0 && !writes) {
    if (threadIdx.x < kNormShrinkCols) tr[threadIdx.x] = 0.f;
    return;
  }
  const i64 row = static_cast<i64>(token) * hidden;
  const T* xr = x + row;
  const T* rr = residual + row;
  const int units = hidden / kVec;

  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < units; i += blockDim.x) {
    float v[kVec], r[kVec];
    load_floats<T, kVec>(xr + i * kVec, v);
    load_floats<T, kVec>(rr + i * kVec, r);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      r[e] = round_to<T>(r[e] + v[e]);  // fused_add_rms_norm's stored residual
      sum_sq += r[e] * r[e];
    }
    if (writes) store_floats<T, kVec>(residual_out + row + i * kVec, r);
  }
  sum_sq = block_sum(sum_sq, scratch);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(hidden) + eps);

  const bool shrinks = slot >= 0;
  const T* ar = a + (static_cast<i64>(shrinks ? slot : 0) * cols + col0) * hidden;
  float acc[kNormShrinkCols];
#pragma unroll
  for (int c = 0; c < kNormShrinkCols; ++c) acc[c] = 0.f;
  for (int i = threadIdx.x; i < units; i += blockDim.x) {
    float v[kVec], r[kVec], w[kVec];
    load_floats<T, kVec>(xr + i * kVec, v);
    load_floats<T, kVec>(rr + i * kVec, r);
    load_floats<T, kVec>(weight + i * kVec, w);
#pragma unroll
    for (int e = 0; e < kVec; ++e) r[e] = scaled<T>(round_to<T>(r[e] + v[e]), inv_rms, w[e], unit_offset);
    if (writes) store_floats<T, kVec>(out + row + i * kVec, r);
    if (shrinks) shrink_accumulate<T, kVec, kNormShrinkCols>(r, ar, hidden, i, acc);
  }
  shrink_store<kNormShrinkCols>(acc, shrinks, partial, tr);
}

}  // namespace zllm

#define ZLLM_RMS_NORM(NAME, T, VEC)                                                             \
  extern "C" __global__ void __launch_bounds__(1024)                                          \
      NAME(T* out, const T* x, const T* __restrict__ weight, float eps, int hidden,           \
           long long x_stride, long long out_stride, int unit_offset) {                       \
    zllm::rms_norm_impl<T, VEC>(out, x, weight, eps, hidden, x_stride, out_stride,            \
                                unit_offset != 0);                                            \
  }

#define ZLLM_FUSED_ADD_RMS_NORM(NAME, T, VEC)                                                   \
  extern "C" __global__ void __launch_bounds__(1024)                                          \
      NAME(T* x, T* residual, const T* __restrict__ weight, float eps, int hidden,             \
           int unit_offset) {                                                                 \
    zllm::fused_add_rms_norm_impl<T, VEC>(x, residual, weight, eps, hidden, unit_offset != 0); \
  }

ZLLM_RMS_NORM(rms_norm_f32, float, 1)
ZLLM_RMS_NORM(rms_norm_f16, __half, 1)
ZLLM_RMS_NORM(rms_norm_bf16, __nv_bfloat16, 1)
ZLLM_RMS_NORM(rms_norm_f32_vec, float, 4)
ZLLM_RMS_NORM(rms_norm_f16_vec, __half, 8)
ZLLM_RMS_NORM(rms_norm_bf16_vec, __nv_bfloat16, 8)

ZLLM_FUSED_ADD_RMS_NORM(fused_add_rms_norm_f32, float, 1)
ZLLM_FUSED_ADD_RMS_NORM(fused_add_rms_norm_f16, __half, 1)
ZLLM_FUSED_ADD_RMS_NORM(fused_add_rms_norm_bf16, __nv_bfloat16, 1)
ZLLM_FUSED_ADD_RMS_NORM(fused_add_rms_norm_f32_vec, float, 4)
ZLLM_FUSED_ADD_RMS_NORM(fused_add_rms_norm_f16_vec, __half, 8)
ZLLM_FUSED_ADD_RMS_NORM(fused_add_rms_norm_bf16_vec, __nv_bfloat16, 8)

#define ZLLM_NORM_LORA_SHRINK(NAME, T, VEC)                                                          \
  extern "C" __global__ void __launch_bounds__(1024)                                               \
      NAME(T* __restrict__ out, T* __restrict__ residual_out, float* __restrict__ t,                \
           const T* x, const T* residual, const T* __restrict__ weight,                             \
           const T* __restrict__ a, const int* slots, float eps, int hidden, int cols,              \
           int unit_offset) {                                                                      \
    zllm::fused_add_rms_norm_lora_shrink_impl<T, VEC>(out, residual_out, t, x, residual, weight, a, \
                                                      slots, eps, hidden, cols, unit_offset != 0);  \
  }

ZLLM_NORM_LORA_SHRINK(fused_add_rms_norm_lora_shrink_f32, float, 4)
ZLLM_NORM_LORA_SHRINK(fused_add_rms_norm_lora_shrink_f16, __half, 8)
ZLLM_NORM_LORA_SHRINK(fused_add_rms_norm_lora_shrink_bf16, __nv_bfloat16, 8)
