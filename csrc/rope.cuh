// The rotary pair and the cache store that rotary_embedding_and_cache (pos_encoding_kernels.cu)
// and the q/k/v GEMV with both in its epilogue (gemv_kernels.cu, gemv_*_rope_cache) share, so
// the two compute each bit alike.
#pragma once

#include "common.cuh"
#include "fp8.cuh"

namespace zllm {

// A rotated key or a value as the cache holds it: unchanged in a cache of T, else quantized.
template <typename C, typename T>
__device__ __forceinline__ C to_cache(T x, float inv_scale) {
  if constexpr (sizeof(C) == 1) {
    return to_e4m3(to_float<T>(x) * inv_scale);
  } else {
    return x;
  }
}

// The pair (x1, x2) rotated by (c, s), rounded to T: the one formula every rotary kernel uses,
// with the multiply-adds spelled out so that no compiler contraction choice makes them differ.
template <typename T>
__device__ __forceinline__ void rotated(float x1, float x2, float c, float s, T& y1, T& y2) {
  y1 = from_float<T>(fmaf(x1, c, -__fmul_rn(x2, s)));
  y2 = from_float<T>(fmaf(x2, c, __fmul_rn(x1, s)));
}

}  // namespace zllm
