// Multi-LoRA shrink and expand over a batch whose rows belong to different adapters (slots),
// CUDA-graph compatible: every shape is fixed by the launch (a padded token count), and which
// adapter a row uses is read from a device buffer (token_slots, -1: the base model), never from
// the host. zllm/workers/lora.py holds the torch reference and the slot layout:
//   A [slots, P * R, in]   (P fused parts: q/k/v or gate/up, each part's A in its own R rows,
//                           times the part's scale: lora_alpha / r is folded in at load)
//   B [out, slots, R]      (part p owns output rows part_start[p] .. part_start[p + 1]; slots in
//                           the middle so a part's rows over every slot are one [rows, S * R]
//                           matrix for the dense path's GEMM)
// These kernels serve steps of few tokens (decode); a step of many runs lora.py's dense path.
// Both wait for the previous kernel first (programmatic dependent launch, common.cuh): x, t, out
// and the slots are read after the wait (never `const __restrict__`), only A and B are weights.
//
// lora_shrink: t [T, P * R] (fp32) = x [T, in] @ A[slot]^T     (0 for rows of the base model)
//   Grid (T, ceil(P * R / kShrinkCols)); a block of 256 threads splits `in` between its threads,
//   each loads its x chunk once (16 bytes) and reuses it for the block's kShrinkCols columns, then
//   a warp sum and a sum over the 8 warps in shared memory. At batch 1 a column's `in` is walked
//   by 256 threads at once (the decode step is latency-bound: the old one-warp-a-column kernel
//   walked in=14336 in 56 dependent steps); 4 columns a block keep 4 blocks on the 16 columns of
//   a rank-16 o/down projection.
// lora_expand: out [T, out] += t[:, p R .. p R + R] @ B[rows of p, slot]^T
//   Grid (T, ceil(out / 256)); one output element a thread, its R weights in 16-byte loads; the
//   token's P * R t-values are staged in shared memory once per block.
#include "common.cuh"

namespace zllm {

constexpr int kShrinkThreads = 256;
constexpr int kShrinkCols = 4;
constexpr int kExpandThreads = 256;

// kVec elements per 16-byte load; in % kVec == 0, 16-byte aligned rows, and cols % kShrinkCols == 0
// (the rank is a multiple of kVec >= 4; all checked by the host), so every load is unconditional
// and the compiler can issue a step's five at once.
template <typename T, int kVec>
__device__ __forceinline__ void lora_shrink_impl(float* __restrict__ t, const T* x,
                                                 const T* __restrict__ a, const int* token_slots,
                                                 int in, int cols, i64 x_stride) {
  constexpr int kWarps = kShrinkThreads / 32;
  __shared__ float partial[kWarps][kShrinkCols];
  const int token = blockIdx.x;
  const int col0 = blockIdx.y * kShrinkCols;
  pdl_launch_dependents();  // PDL (common.cuh): x is the previous kernel's output
  pdl_wait();
  const int slot = token_slots[token];  // the same for the whole block: its early return is uniform
  float* tr = t + static_cast<i64>(token) * cols + col0;
  if (slot < 0) {
    if (threadIdx.x < kShrinkCols) tr[threadIdx.x] = 0.f;
    return;
  }
  const T* xr = x + static_cast<i64>(token) * x_stride;
  const T* ar = a + (static_cast<i64>(slot) * cols + col0) * in;
  float acc[kShrinkCols];
#pragma unroll
  for (int c = 0; c < kShrinkCols; ++c) acc[c] = 0.f;
  // Unrolled so that a thread has several steps' loads in flight (in = 14336: 7 steps a thread).
#pragma unroll 4
  for (int k = threadIdx.x * kVec; k < in; k += kShrinkThreads * kVec) {
    float xv[kVec];
    load_floats<T, kVec>(xr + k, xv);
#pragma unroll
    for (int c = 0; c < kShrinkCols; ++c) {
      float av[kVec];
      load_floats<T, kVec>(ar + static_cast<i64>(c) * in + k, av);
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[c] = fmaf(xv[e], av[e], acc[c]);
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int c = 0; c < kShrinkCols; ++c) {
    const float s = warp_sum(acc[c]);
    if (lane == 0) partial[warp][c] = s;
  }
  __syncthreads();
  if (threadIdx.x < kShrinkCols) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += partial[w][threadIdx.x];
    tr[threadIdx.x] = s;
  }
}

// R % kVec == 0 (R = max_lora_rank, checked by the host). Dynamic shared memory: parts * rank floats.
template <typename T, int kVec>
__device__ __forceinline__ void lora_expand_impl(T* out, const float* t,
                                                 const T* __restrict__ b, const int* token_slots,
                                                 int out_cols, int slots,
                                                 int rank, int parts, int end0, int end1, i64 out_stride) {
  extern __shared__ float t_shared[];
  const int token = blockIdx.x;
  pdl_launch_dependents();  // PDL (common.cuh): t (the shrink's) and out (the projection's) come before
  pdl_wait();
  const int slot = token_slots[token];  // uniform over the block
  if (slot < 0) return;
  const float* tr = t + static_cast<i64>(token) * parts * rank;
  for (int i = threadIdx.x; i < parts * rank; i += kExpandThreads) t_shared[i] = tr[i];
  __syncthreads();
  const int o = blockIdx.y * kExpandThreads + threadIdx.x;
  if (o >= out_cols) return;
  const int p = o < end0 ? 0 : (o < end1 ? 1 : 2);
  const float* tp = t_shared + p * rank;
  const T* br = b + (static_cast<i64>(o) * slots + slot) * rank;
  float acc = 0.f;
  for (int r = 0; r < rank; r += kVec) {
    float bv[kVec];
    load_floats<T, kVec>(br + r, bv);
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc = fmaf(tp[r + e], bv[e], acc);
  }
  T* dst = out + static_cast<i64>(token) * out_stride + o;
  *dst = from_float<T>(to_float<T>(*dst) + acc);
}

}  // namespace zllm

#define ZLLM_LORA(SUFFIX, T, VEC)                                                                              \
  extern "C" __global__ void __launch_bounds__(zllm::kShrinkThreads)                                          \
      lora_shrink_##SUFFIX(float* __restrict__ t, const T* x, const T* __restrict__ a,                        \
                           const int* slots, int in, int cols, long long x_stride) {                          \
    zllm::lora_shrink_impl<T, VEC>(t, x, a, slots, in, cols, x_stride);                                       \
  }                                                                                                           \
  extern "C" __global__ void __launch_bounds__(zllm::kExpandThreads)                                          \
      lora_expand_##SUFFIX(T* out, const float* t, const T* __restrict__ b,                                   \
                           const int* slots, int out_cols, int num_slots, int rank, int parts,                \
                           int end0, int end1, long long out_stride) {                                        \
    zllm::lora_expand_impl<T, VEC>(out, t, b, slots, out_cols, num_slots, rank, parts, end0, end1, out_stride); \
  }

ZLLM_LORA(f32, float, 4)
ZLLM_LORA(f16, __half, 8)
ZLLM_LORA(bf16, __nv_bfloat16, 8)
