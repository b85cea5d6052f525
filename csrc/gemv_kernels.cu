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
#include "common.cuh"

namespace zllm {

constexpr int kGemvWarps = 4;
constexpr int kGemvThreads = kGemvWarps * 32;

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
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = imin(row0 + r, n - 1);  // rows past n repeat the last one; never stored
    w16[r] = reinterpret_cast<const uint4*>(w + static_cast<i64>(row) * k);
  }
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
