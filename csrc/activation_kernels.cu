// Gated activations, following zllm.workers.layers (act(gate) * up in dtype T):
//   x [T, 2I] (rows may be strided) -> out [T, I] = to_T(to_T(act(gate)) * up)
//   silu_and_mul: act = silu (SwiGLU); gelu_tanh_and_mul: act = gelu with the tanh approximation,
//   PyTorch's formula (Gemma's GeGLU, gelu_pytorch_tanh).
//
// Grid: (tokens, ceil(I / kVec / blockDim.x)); each thread handles kVec consecutive elements
// (16 bytes for the _vec entry points, which the host picks when I, strides and pointers allow).
#include "common.cuh"

namespace zllm {

enum class Act { kSilu, kGeluTanh };

template <Act kAct>
__device__ __forceinline__ float activation(float g) {
  if constexpr (kAct == Act::kSilu) {
    return g / (1.f + expf(-g));
  } else {
    constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi), as PyTorch's M_SQRT2 * M_2_SQRTPI / 2
    constexpr float kKappa = 0.044715f;
    const float inner = kBeta * (g + kKappa * (g * g * g));
    return 0.5f * g * (1.f + tanhf(inner));
  }
}

template <typename T, int kVec, Act kAct>
__device__ __forceinline__ void act_and_mul_impl(T* __restrict__ out, const T* x, int d,
                                                 i64 x_stride, i64 out_stride) {
  const int unit = blockIdx.y * blockDim.x + threadIdx.x;
  pdl_launch_dependents();  // PDL (common.cuh): x is the previous kernel's output
  pdl_wait();
  if (unit >= d / kVec) return;
  const T* gate = x + static_cast<i64>(blockIdx.x) * x_stride + unit * kVec;
  float g[kVec], u[kVec];
  load_floats<T, kVec>(gate, g);
  load_floats<T, kVec>(gate + d, u);
#pragma unroll
  for (int e = 0; e < kVec; ++e) g[e] = round_to<T>(activation<kAct>(g[e])) * u[e];
  store_floats<T, kVec>(out + static_cast<i64>(blockIdx.x) * out_stride + unit * kVec, g);
}

}  // namespace zllm

#define ZLLM_ACT_AND_MUL(NAME, T, VEC, ACT)                                                     \
  extern "C" __global__ void NAME(T* __restrict__ out, const T* x, int d,                     \
                                  long long x_stride, long long out_stride) {                 \
    zllm::act_and_mul_impl<T, VEC, ACT>(out, x, d, x_stride, out_stride);                      \
  }

#define ZLLM_ACT_AND_MUL_DTYPES(NAME, ACT)                                                      \
  ZLLM_ACT_AND_MUL(NAME##_f32, float, 1, ACT)                                                   \
  ZLLM_ACT_AND_MUL(NAME##_f16, __half, 1, ACT)                                                  \
  ZLLM_ACT_AND_MUL(NAME##_bf16, __nv_bfloat16, 1, ACT)                                          \
  ZLLM_ACT_AND_MUL(NAME##_f32_vec, float, 4, ACT)                                               \
  ZLLM_ACT_AND_MUL(NAME##_f16_vec, __half, 8, ACT)                                              \
  ZLLM_ACT_AND_MUL(NAME##_bf16_vec, __nv_bfloat16, 8, ACT)

ZLLM_ACT_AND_MUL_DTYPES(silu_and_mul, zllm::Act::kSilu)
ZLLM_ACT_AND_MUL_DTYPES(gelu_tanh_and_mul, zllm::Act::kGeluTanh)
