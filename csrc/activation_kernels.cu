// silu_and_mul, following zllm.workers.layers.silu_and_mul (F.silu(gate) * up in dtype T):
//   x [T, 2I] (rows may be strided) -> out [T, I] = to_T(to_T(silu(gate)) * up)
//
// Grid: (tokens, ceil(I / kVec / blockDim.x)); each thread handles kVec consecutive elements
// (16 bytes for the _vec entry points, which the host picks when I, strides and pointers allow).
#include "common.cuh"

namespace zllm {

template <typename T, int kVec>
__device__ __forceinline__ void silu_and_mul_impl(T* __restrict__ out, const T* __restrict__ x,
                                                  int d, i64 x_stride, i64 out_stride) {
  const int unit = blockIdx.y * blockDim.x + threadIdx.x;
  if (unit >= d / kVec) return;
  const T* gate = x + static_cast<i64>(blockIdx.x) * x_stride + unit * kVec;
  float g[kVec], u[kVec];
  load_floats<T, kVec>(gate, g);
  load_floats<T, kVec>(gate + d, u);
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const float silu = round_to<T>(g[e] / (1.f + expf(-g[e])));
    g[e] = silu * u[e];
  }
  store_floats<T, kVec>(out + static_cast<i64>(blockIdx.x) * out_stride + unit * kVec, g);
}

}  // namespace zllm

#define ZLLM_SILU_AND_MUL(NAME, T, VEC)                                                         \
  extern "C" __global__ void NAME(T* __restrict__ out, const T* __restrict__ x, int d,        \
                                  long long x_stride, long long out_stride) {                 \
    zllm::silu_and_mul_impl<T, VEC>(out, x, d, x_stride, out_stride);                          \
  }

ZLLM_SILU_AND_MUL(silu_and_mul_f32, float, 1)
ZLLM_SILU_AND_MUL(silu_and_mul_f16, __half, 1)
ZLLM_SILU_AND_MUL(silu_and_mul_bf16, __nv_bfloat16, 1)
ZLLM_SILU_AND_MUL(silu_and_mul_f32_vec, float, 4)
ZLLM_SILU_AND_MUL(silu_and_mul_f16_vec, __half, 8)
ZLLM_SILU_AND_MUL(silu_and_mul_bf16_vec, __nv_bfloat16, 8)
