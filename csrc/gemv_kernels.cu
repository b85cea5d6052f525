// GEMV for one token: y[n] = sum_k x[k] * w[n, k] (+ bias[n]), the projections of a batch-1
// decode step, where the weights are read once and nothing else matters but streaming them at
// the memory bandwidth (cuBLAS's kernels for these shapes leave 10-20% of it unused and add a
// split-K reduce; benchmarks/gemv.py).
//
//   x [K] contiguous; w [N, K] with contiguous rows of stride K; y [N]; bias [N] or null.
//   K a multiple of 16 / sizeof(T) (16-byte loads); x, w 16-byte aligned.
// Grid ceil(N / kGemvWarps), kGemvWarps * 32 threads. A warp takes one row (kRows); its lanes
// stride over K in 16-byte units with kUnroll units in flight (weights streamed with evict-first
// loads, x from the read-only cache), accumulate in fp32 and finish with a warp sum. fp32
// accumulation in a different order than cuBLAS: results agree to rounding, not bit for bit.
// One row and 8 loads per warp beat two rows and 4 loads on every Llama-3-8B projection (H100,
// benchmarks/gemv.py, 2026-11-22), so only that variant is built.
#include <cuda_fp8.h>

#include "common.cuh"

namespace zllm {

constexpr int kGemvWarps = 4;
constexpr int kGemvThreads = kGemvWarps * 32;

// The 16-byte views of a warp's kRows weight rows (k elements each) from row0 on; rows past n
// repeat the last one and are never stored.
template <typename E, int kRows>
__device__ __forceinline__ void row_pointers(const E* __restrict__ w, int row0, int n, int k,
                                             const uint4* (&w16)[kRows]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    w16[r] = reinterpret_cast<const uint4*>(w + static_cast<i64>(imin(row0 + r, n - 1)) * k);
  }
}

template <typename T>
__device__ __forceinline__ float dot16(uint4 wv, uint4 xv) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  float wf[kVec], xf[kVec];
  unpack<T>(wv, wf);
  unpack<T>(xv, xf);
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < kVec; ++e) s = fmaf(wf[e], xf[e], s);
  return s;
}

template <typename T, int kRows, int kUnroll>
__device__ __forceinline__ void gemv_impl(T* __restrict__ y, const T* __restrict__ x,
                                          const T* __restrict__ w, const T* __restrict__ bias,
                                          int n, int k) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kGemvWarps + warp) * kRows;
  if (row0 >= n) return;
  const int units = k / kVec;
  const uint4* x16 = reinterpret_cast<const uint4*>(x);
  const uint4* w16[kRows];
  row_pointers(w, row0, n, k, w16);
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.f;

  int u = lane;
  for (; u + 32 * (kUnroll - 1) < units; u += 32 * kUnroll) {
    uint4 wv[kRows][kUnroll];
    uint4 xv[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) wv[r][j] = __ldcs(w16[r] + u + 32 * j);
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) xv[j] = __ldg(x16 + u + 32 * j);
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[r] += dot16<T>(wv[r][j], xv[j]);
    }
  }
  for (; u < units; u += 32) {
    const uint4 xv = __ldg(x16 + u);
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] += dot16<T>(__ldcs(w16[r] + u), xv);
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float total = warp_sum(acc[r]);
    if (lane == 0 && row0 + r < n) {
      y[row0 + r] = from_float<T>(bias == nullptr ? total : total + to_float<T>(bias[row0 + r]));
    }
  }
}

}  // namespace zllm

#define ZLLM_GEMV(NAME, T, ROWS, UNROLL)                                                          \
  extern "C" __global__ void __launch_bounds__(zllm::kGemvThreads) NAME(                        \
      T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ w,                      \
      const T* __restrict__ bias, int n, int k) {                                               \
    zllm::gemv_impl<T, ROWS, UNROLL>(y, x, w, bias, n, k);                                      \
  }

ZLLM_GEMV(gemv_f32, float, 1, 8)
ZLLM_GEMV(gemv_f16, __half, 1, 8)
ZLLM_GEMV(gemv_bf16, __nv_bfloat16, 1, 8)

// ---- FP8 weights ----------------------------------------------------------------------------------
// gemv_fp8_<T>[_block]: y[n] = sum_k x[k] * (w8[n, k] * scale) (+ bias[n]), the batch-1 product
// of an FP8 linear layer (zllm/workers/fp8.py): the weights are read as E4M3 bytes and the
// activation stays in T (no quantization launch at this size). scale: per output row
// (scale[n]) or per 128x128 tile (scale[n / 128 * kb + k / 128], kb = ceil(K / 128)).
//   K a multiple of 16 (16 weights per 16-byte load); x, w 16-byte aligned.
// Same layout as the dense GEMV: a warp per row, lanes striding over K in 16-byte weight units.
namespace zllm {

// 16 E4M3 weights dotted with 16 activations already in fp32 registers.
__device__ __forceinline__ float dot_fp8x16(uint4 wv, const float (&xf)[16]) {
  const unsigned words[4] = {wv.x, wv.y, wv.z, wv.w};
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2_raw pair = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>((words[i] >> (16 * h)) & 0xffffu), __NV_E4M3);
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&pair));
      s = fmaf(f.x, xf[4 * i + 2 * h], s);
      s = fmaf(f.y, xf[4 * i + 2 * h + 1], s);
    }
  }
  return s;
}

// A warp takes kRows consecutive rows (each 16 activations loaded once serve all of them: the
// activations are T, up to twice the weights' bytes, so reusing them matters) with kUnroll
// 16-byte weight loads per row in flight. kRows divides 128, so a warp's rows share one row of
// block scales.
template <typename T, bool kBlock, int kRows, int kUnroll>
__device__ __forceinline__ void gemv_fp8_impl(T* __restrict__ y, const T* __restrict__ x,
                                              const unsigned char* __restrict__ w,
                                              const float* __restrict__ scale, const T* __restrict__ bias,
                                              int n, int k) {
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kGemvWarps + warp) * kRows;
  if (row0 >= n) return;
  const int units = k / 16;
  const uint4* w16[kRows];
  row_pointers(w, row0, n, k, w16);
  // Block scales: a 128-column group is 8 units; this warp's tiles are one row of the grid.
  const float* tile_scales = kBlock ? scale + static_cast<i64>(row0 / 128) * ((k + 127) / 128) : nullptr;
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
  int u = lane;
  for (; u + 32 * (kUnroll - 1) < units; u += 32 * kUnroll) {
    uint4 wv[kRows][kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) wv[r][j] = __ldcs(w16[r] + u + 32 * j);
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      float xf[16];
      load_floats<T, 16>(x + 16 * (u + 32 * j), xf);
      const float ts = kBlock ? __ldg(tile_scales + ((u + 32 * j) >> 3)) : 1.f;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float d = dot_fp8x16(wv[r][j], xf);
        acc[r] = kBlock ? fmaf(d, ts, acc[r]) : acc[r] + d;
      }
    }
  }
  for (; u < units; u += 32) {
    float xf[16];
    load_floats<T, 16>(x + 16 * u, xf);
    const float ts = kBlock ? __ldg(tile_scales + (u >> 3)) : 1.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float d = dot_fp8x16(__ldcs(w16[r] + u), xf);
      acc[r] = kBlock ? fmaf(d, ts, acc[r]) : acc[r] + d;
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float total = warp_sum(acc[r]);
    const int row = row0 + r;
    if (lane == 0 && row < n) {
      if (!kBlock) total *= scale[row];
      y[row] = from_float<T>(bias == nullptr ? total : total + to_float<T>(bias[row]));
    }
  }
}

}  // namespace zllm

#define ZLLM_GEMV_FP8(NAME, T, BLOCK, ROWS, UNROLL)                                               \
  extern "C" __global__ void __launch_bounds__(zllm::kGemvThreads) NAME(                        \
      T* __restrict__ y, const T* __restrict__ x, const unsigned char* __restrict__ w,          \
      const float* __restrict__ scale, const T* __restrict__ bias, int n, int k) {              \
    zllm::gemv_fp8_impl<T, BLOCK, ROWS, UNROLL>(y, x, w, scale, bias, n, k);                    \
  }

// The default shape (rows per warp, loads per row): zllm/workers/kernels/ops.py's
// _FP8_GEMV_SHAPES must agree.
#define ZLLM_FP8_GEMV_ROWS 1
#define ZLLM_FP8_GEMV_UNROLL 2  // 2 beat 4 by 6% on W2 (3.640 vs 3.874 ms/token, H100, 2026-11-25)
#define ZLLM_GEMV_FP8_DTYPE(SUFFIX, T)                                                                   \
  ZLLM_GEMV_FP8(gemv_fp8_##SUFFIX, T, false, ZLLM_FP8_GEMV_ROWS, ZLLM_FP8_GEMV_UNROLL)                  \
  ZLLM_GEMV_FP8(gemv_fp8_##SUFFIX##_block, T, true, ZLLM_FP8_GEMV_ROWS, ZLLM_FP8_GEMV_UNROLL)

ZLLM_GEMV_FP8_DTYPE(f32, float)
ZLLM_GEMV_FP8_DTYPE(f16, __half)
ZLLM_GEMV_FP8_DTYPE(bf16, __nv_bfloat16)
// Other shapes for benchmarks/fp8_linear.py's comparison and ZLLM_FP8_GEMV (bf16, per-row scales).
ZLLM_GEMV_FP8(gemv_fp8_bf16_r1u4, __nv_bfloat16, false, 1, 4)
ZLLM_GEMV_FP8(gemv_fp8_bf16_r1u8, __nv_bfloat16, false, 1, 8)
ZLLM_GEMV_FP8(gemv_fp8_bf16_r2u2, __nv_bfloat16, false, 2, 2)
ZLLM_GEMV_FP8(gemv_fp8_bf16_r2u4, __nv_bfloat16, false, 2, 4)
ZLLM_GEMV_FP8(gemv_fp8_bf16_r4u1, __nv_bfloat16, false, 4, 1)
ZLLM_GEMV_FP8(gemv_fp8_bf16_r4u2, __nv_bfloat16, false, 4, 2)
