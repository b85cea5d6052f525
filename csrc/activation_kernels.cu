// Gated activations, following zllm.workers.layers (act(gate) * up in dtype T):
//   x [T, 2I] (rows may be strided) -> out [T, I] = to_T(to_T(act(gate)) * up)
//   silu_and_mul: act = silu (SwiGLU); gelu_tanh_and_mul: act = gelu with the tanh approximation,
//   PyTorch's formula (Gemma's GeGLU, gelu_pytorch_tanh).
//
// Grid: (tokens, ceil(I / kVec / blockDim.x)); each thread handles kVec consecutive elements
// (16 bytes for the _vec entry points, which the host picks when I, strides and pointers allow).
//
// silu_and_mul_lora_shrink / gelu_tanh_and_mul_lora_shrink (decode, LoRA on the down projection
// after the activation; not in place):
//   out [rows, I] = act(gate) * up     (each bit as the _vec entry point computes it)
//   t [rows, cols] (fp32) = out @ A[slot]^T   (A [slots, cols, I]; 0 in rows of slot -1)
//   Grid (rows, cols / kActShrinkCols): every block re-computes its row's activation (the gate and
//   up rows are 2 * I elements from L2, less than the block's 4 columns of A) and the shrink of
//   its 4 columns of the rounded row (lora_shrink's input; its fp32 order differs); block y = 0
//   also writes out. Not in place: the other blocks still read x. The activation is elementwise,
//   so any block size gives the _vec kernel's bits.
// Every kernel here waits for the previous kernel first (programmatic dependent launch,
// common.cuh); the shrink's A is a weight, x and the slots are read after the wait.
#include "common.cuh"  // Act and activation(): gemv_kernels.cu's fused gate_up epilogue shares them

namespace zllm {

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

constexpr int kActShrinkCols = 4;

// Vector loads only (I % kVec == 0, contiguous 16-byte aligned rows and A; checked by the host).
template <typename T, int kVec, Act kAct>
__device__ __forceinline__ void act_and_mul_lora_shrink_impl(T* __restrict__ out, float* __restrict__ t,
                                                             const T* x, const T* __restrict__ a,
                                                             const int* token_slots, int d, int cols) {
  __shared__ float partial[32][kActShrinkCols];
  const int token = blockIdx.x;
  const bool writes = blockIdx.y == 0;  // the block that writes the row's activation
  const int col0 = blockIdx.y * kActShrinkCols;
  float* tr = t + static_cast<i64>(token) * cols + col0;
  pdl_launch_dependents();  // PDL (common.cuh): x is the previous kernel's output
  pdl_wait();
  const int slot = token_slots[token];  // uniform over the block, like the early return below
  if (slot < 0 && !writes) {
    if (threadIdx.x < kActShrinkCols) tr[threadIdx.x] = 0.f;
    return;
  }
  const bool shrinks = slot >= 0;
  const T* gate = x + static_cast<i64>(token) * 2 * d;
  T* outr = out + static_cast<i64>(token) * d;
  const T* ar = a + (static_cast<i64>(shrinks ? slot : 0) * cols + col0) * d;
  float acc[kActShrinkCols];
#pragma unroll
  for (int c = 0; c < kActShrinkCols; ++c) acc[c] = 0.f;
  const int units = d / kVec;
  for (int i = threadIdx.x; i < units; i += blockDim.x) {
    float g[kVec], u[kVec];
    load_floats<T, kVec>(gate + i * kVec, g);
    load_floats<T, kVec>(gate + d + i * kVec, u);
#pragma unroll
    for (int e = 0; e < kVec; ++e) g[e] = round_to<T>(activation<kAct>(g[e])) * u[e];
    if (writes) store_floats<T, kVec>(outr + i * kVec, g);
    if (shrinks) shrink_accumulate<T, kVec, kActShrinkCols>(g, ar, d, i, acc);
  }
  shrink_store<kActShrinkCols>(acc, shrinks, partial, tr);
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

#define ZLLM_ACT_LORA_SHRINK(NAME, T, VEC, ACT)                                                        \
  extern "C" __global__ void __launch_bounds__(1024)                                                 \
      NAME(T* __restrict__ out, float* __restrict__ t, const T* x, const T* __restrict__ a,           \
           const int* slots, int d, int cols) {                                                       \
    zllm::act_and_mul_lora_shrink_impl<T, VEC, ACT>(out, t, x, a, slots, d, cols);                    \
  }

#define ZLLM_ACT_LORA_SHRINK_DTYPES(NAME, ACT)                                                         \
  ZLLM_ACT_LORA_SHRINK(NAME##_f32, float, 4, ACT)                                                      \
  ZLLM_ACT_LORA_SHRINK(NAME##_f16, __half, 8, ACT)                                                     \
  ZLLM_ACT_LORA_SHRINK(NAME##_bf16, __nv_bfloat16, 8, ACT)

ZLLM_ACT_LORA_SHRINK_DTYPES(silu_and_mul_lora_shrink, zllm::Act::kSilu)
ZLLM_ACT_LORA_SHRINK_DTYPES(gelu_tanh_and_mul_lora_shrink, zllm::Act::kGeluTanh)
