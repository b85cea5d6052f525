// FP8 E4M3 activation quantization for the FP8 linear layers, following zllm/workers/fp8.py:
//   q = e4m3(clamp(x / s, -448, 448)), rounded to nearest even (the cast's saturating mode is
//   the clamp), with s = max(amax, 1e-12) / 448 over the row or group, or a given static scale.
//   The division by 448 is a product with its fp32 reciprocal, as torch computes it on CUDA, so
//   the kernels equal the torch reference on the same GPU bit for bit.
//
// quant_fp8_rows_<T>(q [M, K], scales [M], x [M, K] rows of stride x_stride, k, static_scale):
//   grid M, one block per token; static_scale null: each row's amax first, its scale written to
//   scales; otherwise *static_scale for every row (scales untouched). Scalar loads, two passes
//   over the row: the fallback for rows the _vec kernels do not take.
// quant_fp8_rows_vec<V>_<T>: the same result in one pass. Each thread holds V 16-byte pieces of
//   the row in registers (raw, unpacked when used): all its loads are in flight at once, and the
//   row is read once. Needs K and the row stride to be multiples of 16 bytes' elements, 16-byte
//   aligned rows, and K <= 1024 threads x V pieces (the caller picks V).
// quant_fp8_groups_<T>(q [M, K], scales_t [G, M], x, m, k, x_stride): a scale per token and 128
//   columns (G = ceil(K / 128)), written transposed: [G, M] row-major is the [M, G] column-major
//   layout cuBLASLt's 1x128 block scaling takes. Grid (M, ceil(G / 4)), 4 warps, one group each.
#include <cuda_fp8.h>

#include "fp8.cuh"

namespace zllm {

constexpr float kInvFp8Max = 1.f / 448.f;  // times, not divided: torch's CUDA `tensor / 448.0` multiplies by the reciprocal
constexpr float kMinScale = 1e-12f;
constexpr int kGroup = 128;
constexpr int kGroupWarps = 4;

template <typename T>
__device__ __forceinline__ void quant_rows_impl(__nv_fp8_storage_t* __restrict__ q, float* __restrict__ scales,
                                                const T* __restrict__ x, int k, i64 x_stride,
                                                const float* __restrict__ static_scale) {
  __shared__ float scratch[32];
  const int row = blockIdx.x;
  const T* xr = x + static_cast<i64>(row) * x_stride;
  __nv_fp8_storage_t* qr = q + static_cast<i64>(row) * k;
  float scale;
  if (static_scale != nullptr) {
    scale = *static_scale;
  } else {
    float amax = 0.f;
    for (int i = threadIdx.x; i < k; i += blockDim.x) amax = fmaxf(amax, fabsf(to_float<T>(xr[i])));
    scale = fmaxf(block_max(amax, scratch), kMinScale) * kInvFp8Max;
    if (threadIdx.x == 0) scales[row] = scale;
  }
  for (int i = threadIdx.x; i < k; i += blockDim.x) qr[i] = to_e4m3(to_float<T>(xr[i]) / scale);
}

template <typename T, int kVecs>
__device__ __forceinline__ void quant_rows_vec_impl(fp8_t* __restrict__ q, float* __restrict__ scales,
                                                    const T* __restrict__ x, int k, i64 x_stride,
                                                    const float* __restrict__ static_scale) {
  constexpr int kPer = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte piece
  __shared__ float scratch[32];
  const int row = blockIdx.x;
  const uint4* xr = reinterpret_cast<const uint4*>(x + static_cast<i64>(row) * x_stride);
  const int units = k / kPer;
  uint4 raw[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int u = threadIdx.x + j * blockDim.x;
    if (u < units) raw[j] = xr[u];
  }
  float scale;
  if (static_scale != nullptr) {
    scale = *static_scale;
  } else {
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (threadIdx.x + j * blockDim.x < units) {
        float v[kPer];
        unpack<T>(raw[j], v);
#pragma unroll
        for (int e = 0; e < kPer; ++e) amax = fmaxf(amax, fabsf(v[e]));
      }
    }
    scale = fmaxf(block_max(amax, scratch), kMinScale) * kInvFp8Max;
    if (threadIdx.x == 0) scales[row] = scale;
  }
  fp8_t* qr = q + static_cast<i64>(row) * k;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int u = threadIdx.x + j * blockDim.x;
    if (u < units) {
      float v[kPer];
      unpack<T>(raw[j], v);
#pragma unroll
      for (int e = 0; e < kPer; ++e) v[e] = v[e] / scale;
      if constexpr (kPer == 8) {
        *reinterpret_cast<uint2*>(qr + u * kPer) = make_uint2(Word<fp8_t>::pack(v), Word<fp8_t>::pack(v + 4));
      } else {
        *reinterpret_cast<unsigned*>(qr + u * kPer) = Word<fp8_t>::pack(v);
      }
    }
  }
}

template <typename T>
__device__ __forceinline__ void quant_groups_impl(__nv_fp8_storage_t* __restrict__ q, float* __restrict__ scales_t,
                                                  const T* __restrict__ x, int m, int k, i64 x_stride) {
  const int row = blockIdx.x;
  const int group = blockIdx.y * kGroupWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  const int first = group * kGroup;
  if (first >= k) return;
  constexpr int kPerLane = kGroup / 32;
  const T* xr = x + static_cast<i64>(row) * x_stride + first;
  float v[kPerLane];
  float amax = 0.f;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int col = lane * kPerLane + e;
    v[e] = first + col < k ? to_float<T>(xr[col]) : 0.f;
    amax = fmaxf(amax, fabsf(v[e]));
  }
  const float scale = fmaxf(warp_max(amax), kMinScale) * kInvFp8Max;
  __nv_fp8_storage_t* qr = q + static_cast<i64>(row) * k + first;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int col = lane * kPerLane + e;
    if (first + col < k) qr[col] = to_e4m3(v[e] / scale);
  }
  if (lane == 0) scales_t[static_cast<i64>(group) * m + row] = scale;
}

}  // namespace zllm

#define ZLLM_QUANT(SUFFIX, T)                                                                        \
  extern "C" __global__ void quant_fp8_rows_##SUFFIX(__nv_fp8_storage_t* __restrict__ q,            \
                                                     float* __restrict__ scales,                    \
                                                     const T* __restrict__ x, int k, long long x_stride, \
                                                     const float* __restrict__ static_scale) {      \
    zllm::quant_rows_impl<T>(q, scales, x, k, x_stride, static_scale);                             \
  }                                                                                                  \
  extern "C" __global__ void __launch_bounds__(zllm::kGroupWarps * 32)                              \
      quant_fp8_groups_##SUFFIX(__nv_fp8_storage_t* __restrict__ q, float* __restrict__ scales_t,   \
                                const T* __restrict__ x, int m, int k, long long x_stride) {        \
    zllm::quant_groups_impl<T>(q, scales_t, x, m, k, x_stride);                                     \
  }

#define ZLLM_QUANT_VEC(SUFFIX, T, V)                                                                  \
  extern "C" __global__ void __launch_bounds__(1024)                                                 \
      quant_fp8_rows_vec##V##_##SUFFIX(__nv_fp8_storage_t* __restrict__ q, float* __restrict__ scales, \
                                       const T* __restrict__ x, int k, long long x_stride,          \
                                       const float* __restrict__ static_scale) {                    \
    zllm::quant_rows_vec_impl<T, V>(q, scales, x, k, x_stride, static_scale);                       \
  }
#define ZLLM_QUANT_VECS(SUFFIX, T) \
  ZLLM_QUANT_VEC(SUFFIX, T, 1)     \
  ZLLM_QUANT_VEC(SUFFIX, T, 2)     \
  ZLLM_QUANT_VEC(SUFFIX, T, 4)     \
  ZLLM_QUANT_VEC(SUFFIX, T, 8)

ZLLM_QUANT_VECS(f32, float)
ZLLM_QUANT_VECS(f16, __half)
ZLLM_QUANT_VECS(bf16, __nv_bfloat16)
ZLLM_QUANT(f32, float)
ZLLM_QUANT(f16, __half)
ZLLM_QUANT(bf16, __nv_bfloat16)
