// GEMV for one token: y[n] = sum_k x[k] * w[n, k] (+ bias[n]), the projections of a batch-1
// decode step, where the weights are read once and nothing else matters but streaming them at
// the memory bandwidth (cuBLAS's kernels for these shapes leave 10-20% of it unused and add a
// split-K reduce; benchmarks/gemv.py).
//
//   x [K] contiguous; w [N, K] with contiguous rows of stride K; y [N]; bias [N] or null.
//   K a multiple of 16 / sizeof(T) (16-byte loads); x, w 16-byte aligned.
// Grid ceil(N / kGemvWarps), kGemvWarps * 32 threads. A warp takes one row (kRows); its lanes
// stride over K in 16-byte units with kUnroll units in flight (weights streamed with evict-first
// loads, x with ordinary loads: under PDL it may be written while the kernel starts), accumulate
// in fp32 and finish with a warp sum. fp32 accumulation in a different order than cuBLAS: results
// agree to rounding, not bit for bit.
// One row and 8 loads per warp beat two rows and 4 loads on every Llama-3-8B projection (H100,
// benchmarks/gemv.py, 2026-11-22), so only that variant is built; gemv_<T>_s<S>_b<B> (below)
// split each row over S warps and mask their last round.
//
// gemv_lora_* and gemv_rows_lora_* (below): the same products with multi-LoRA's expand fused into
// the epilogue (zllm/workers/lora.py's layout, csrc/lora_kernels.cu's lora_expand): weight row n of
// token r also gets B[n, slot, :] . t[r, p R .. p R + R] (slot = token_slots[r], -1: nothing
// added; p: the fused part n belongs to; t: lora_shrink's fp32 output), added to the fp32 sum
// before its one rounding to T. A projection with LoRA at decode is then two launches (shrink,
// GEMV), not three: the expand's launch and tail were most of LoRA's per-token cost at batch 1.
#include <cuda_fp8.h>

#include "common.cuh"
#include "lamport.cuh"  // the _push builds
#include "mma.cuh"
#include "rope.cuh"  // the q/k/v epilogue (below) rotates and stores as rotary_embedding_and_cache

namespace zllm {

constexpr int kGemvWarps = 4;
constexpr int kGemvThreads = kGemvWarps * 32;

// The fused LoRA expand's operands (see the top of the file). The host checks: rank a multiple of
// 16 / sizeof(T) and at most 32 of those (one 16-byte piece of B a lane: rank <= 256 for fp16 and
// bf16, 128 for fp32), t's and B's rows 16-byte aligned, 1 to 3 parts.
template <typename T>
struct LoraExpand {
  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const float* t;          // [rows, t_cols]: lora_shrink's output (0 in rows of slot -1)
  const T* b;              // [n, slots, rank]
  const int* token_slots;  // [rows]: each row's slot, -1 for the base model
  int slots, rank, t_cols, end0, end1;  // part 0 is weight rows [0, end0), part 1 [end0, end1)

  // Whether a kernel reads B (the split GEMV) or the slots (the fma rows GEMV) before its weight
  // loop, to overlap their round trips with the stream: the fp32 builds read them after it, as the
  // registers held through the loop spill under the launch bounds on sm_80.
  static constexpr bool kEarly = sizeof(T) == 2;

  // The 16-byte piece of B[n, slot, :] at element r (slot clamped to 0: the load may be issued
  // before the slot is tested; its value is only used for slot >= 0).
  __device__ __forceinline__ uint4 b_piece(int n, int slot, int r) const {
    const T* row = b + (static_cast<i64>(n) * slots + (slot < 0 ? 0 : slot)) * rank + r;
    return __ldg(reinterpret_cast<const uint4*>(row));
  }
  // B's piece (kVec elements from r) dotted with t[token, part(n) R + r ..].
  __device__ __forceinline__ float piece_dot(uint4 piece, int token, int n, int r) const {
    const int p = n < end0 ? 0 : (n < end1 ? 1 : 2);
    float bv[kVec], tv[kVec];
    unpack<T>(piece, bv);
    load_floats<float, kVec>(t + static_cast<i64>(token) * t_cols + p * rank + r, tv);
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) s = fmaf(bv[e], tv[e], s);
    return s;
  }
  // The whole B[n, slot, :] . t[token, part(n) ..] in one thread (the tensor-core epilogue, where a
  // lane holds other rows' sums than its neighbours); 0 for slot -1.
  __device__ __forceinline__ float dot(int token, int slot, int n) const {
    float s = 0.f;
    if (slot < 0) return s;
    for (int r = 0; r < rank; r += kVec) s += piece_dot(b_piece(n, slot, r), token, n, r);
    return s;
  }
};

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

// A round of a split kernel's weight loads: kUnroll 16-byte units a lane, base + lane + 32 j,
// clamped to end - 1 (the last round's mask: the caller drops those products), evict-first.
template <int kUnroll>
__device__ __forceinline__ void weight_round(uint4 (&wv)[kUnroll], const uint4* __restrict__ w16, int base,
                                             int end, int lane) {
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) wv[j] = __ldcs(w16 + imin(base + lane + 32 * j, end - 1));
}

template <typename T, int kRows, int kUnroll, bool kLora = false>
__device__ __forceinline__ void gemv_impl(T* __restrict__ y, const T* x,
                                          const T* __restrict__ w, const T* __restrict__ bias,
                                          int n, int k, LoraExpand<T> lora = {}) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kGemvWarps + warp) * kRows;
  // PDL (common.cuh): this build waits before any load (it is not the default one).
  pdl_launch_dependents();
  pdl_wait();
  if (row0 >= n) return;
  const int units = k / kVec;
  const uint4* x16 = reinterpret_cast<const uint4*>(x);
  const uint4* w16[kRows];
  row_pointers(w, row0, n, k, w16);
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
  // LoRA: B's pieces are loaded before the weights, so their round trip overlaps the stream.
  int slot = -1;
  uint4 b_pieces[kRows];
  if constexpr (kLora) {
    slot = *lora.token_slots;
#pragma unroll
    for (int r = 0; r < kRows; ++r) b_pieces[r] = lane * kVec < lora.rank ? lora.b_piece(imin(row0 + r, n - 1), slot, lane * kVec) : zero4();
  }

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
    for (int j = 0; j < kUnroll; ++j) xv[j] = x16[u + 32 * j];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[r] += dot16<T>(wv[r][j], xv[j]);
    }
  }
  for (; u < units; u += 32) {
    const uint4 xv = x16[u];
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] += dot16<T>(__ldcs(w16[r] + u), xv);
  }
  if constexpr (kLora) {
    if (slot >= 0 && lane * kVec < lora.rank) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[r] += lora.piece_dot(b_pieces[r], 0, imin(row0 + r, n - 1), lane * kVec);
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float total = warp_sum(acc[r]);
    if (lane == 0 && row0 + r < n) {
      y[row0 + r] = from_float<T>(bias == nullptr ? total : total + to_float<T>(bias[row0 + r]));
    }
  }
}

// Split-K (kSplit = 1, 2 or 4 warps per row, kGemvWarps / kSplit rows a block): each warp takes a
// contiguous kSplit-th of the row (whole 32-unit strides) in rounds of kUnroll loads, the last
// round masked, and the row's warps add their sums through shared memory. For rows too short
// for a warp to keep kUnroll loads in flight more than once or twice (Qwen3-30B-A3B's attention
// projections: K = 2048 and 4096) and for too few rows to fill the SMs with warps, where the
// one-warp-per-row kernel waits on memory round trips one after another.
// kAdd (gemv_<T>_s<S>_b6_add): y[row] = to_T(add[row] + to_T(sum + bias)), the residual add
// that follows an o or down projection, in its epilogue (models/llama.py's norm-carrying decode
// step, ZLLM_NORM_GEMV); y must not alias add.
// kPushWorld > 0 (gemv_bf16_s<S>_b6_push_w<W>): the row's value, with `add` added as kAdd adds it
// where add is not null (the first rank's residual), is stored into every rank's Lamport buffer
// (lamport.cuh LamportPush) instead of y, for lamport_sum_pushed to sum: a row-parallel layer's
// all-reduce without the kernel that reads the product back and pushes it. This build lets the
// next kernel launch only after its own pdl_wait (that kernel reads the Lamport slot at once).
template <typename T, int kUnroll, int kSplit, bool kLora = false, bool kAdd = false, int kPushWorld = 0>
__device__ __forceinline__ void gemv_split_impl(T* __restrict__ y, const T* x,
                                                const T* __restrict__ w, const T* __restrict__ bias,
                                                int n, int k, LoraExpand<T> lora = {},
                                                const T* add = nullptr,
                                                const LamportPush<T, (kPushWorld > 0 ? kPushWorld : 2)>& push = {}) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  constexpr int kRowsPerBlock = kGemvWarps / kSplit;
  __shared__ float partial[kGemvWarps];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kRowsPerBlock + warp / kSplit;  // may pass n: computed, not stored
  const int units = k / kVec;
  const int span = ((units + kSplit - 1) / kSplit + 31) / 32 * 32;
  const int begin = imin((warp % kSplit) * span, units);
  const int end = imin(begin + span, units);
  const uint4* x16 = reinterpret_cast<const uint4*>(x);
  const uint4* w16 = reinterpret_cast<const uint4*>(w + static_cast<i64>(imin(row, n - 1)) * k);
  float acc = 0.f;
  // PDL (common.cuh): on sm_90+ the first round of weights is in flight before the wait for the
  // previous kernel, whose output x is (and LoRA's t and slots may be); the loop loads each later
  // round at its top, as it did before PDL (loading it at the bottom of the round before lets
  // ptxas hoist it above that round's products: more registers, and spills in some builds).
  if constexpr (kPushWorld == 0) pdl_launch_dependents();
  uint4 wv[kUnroll];
  if (kPdlArch && begin < end) weight_round(wv, w16, begin, end, lane);
  pdl_wait();
  if constexpr (kPushWorld > 0) pdl_launch_dependents();
  // LoRA: the row's first warp adds B[row, slot, :] . t, a 16-byte piece of B a lane, loaded
  // before the weight loop (kEarly) so that its round trip overlaps the weights'.
  const bool lora_lane = kLora && warp % kSplit == 0 && lane * kVec < lora.rank;
  int slot = -1;
  uint4 b_piece = zero4();
  if constexpr (kLora) {
    slot = *lora.token_slots;
    if (LoraExpand<T>::kEarly && lora_lane) b_piece = lora.b_piece(imin(row, n - 1), slot, lane * kVec);
  }
  for (int base = begin; base < end; base += 32 * kUnroll) {
    // The last round is masked by clamping to the last unit and dropping those products (a
    // select: a branch around each load would keep the loads from being in flight together).
    if (!kPdlArch || base != begin) weight_round(wv, w16, base, end, lane);
    uint4 xv[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) xv[j] = x16[imin(base + lane + 32 * j, end - 1)];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const float d = dot16<T>(wv[j], xv[j]);
      acc += base + lane + 32 * j < end ? d : 0.f;
    }
  }
  if constexpr (kLora) {
    if (lora_lane && slot >= 0) {
      if (!LoraExpand<T>::kEarly) b_piece = lora.b_piece(imin(row, n - 1), slot, lane * kVec);
      acc += lora.piece_dot(b_piece, 0, imin(row, n - 1), lane * kVec);
    }
  }
  float total = warp_sum(acc);
  if constexpr (kSplit > 1) {
    if (lane == 0) partial[warp] = total;
    __syncthreads();
    if (warp % kSplit != 0) return;
    total = 0.f;
#pragma unroll
    for (int p = 0; p < kSplit; ++p) total += partial[warp + p];
  }
  if (lane != 0 || row >= n) return;
  const float out = bias == nullptr ? total : total + to_float<T>(bias[row]);
  if constexpr (kPushWorld > 0) {
    const T value = add == nullptr ? from_float<T>(out) : from_float<T>(to_float<T>(add[row]) + round_to<T>(out));
    push.element(push.slot(), row, value);
  } else if constexpr (kAdd) {
    y[row] = from_float<T>(to_float<T>(add[row]) + round_to<T>(out));  // the residual, after the wait
  } else {
    y[row] = from_float<T>(out);
  }
}

}  // namespace zllm

#define ZLLM_GEMV(NAME, T, ROWS, UNROLL)                                                          \
  extern "C" __global__ void __launch_bounds__(zllm::kGemvThreads) NAME(                        \
      T* __restrict__ y, const T* x, const T* __restrict__ w,                                   \
      const T* __restrict__ bias, int n, int k) {                                               \
    zllm::gemv_impl<T, ROWS, UNROLL>(y, x, w, bias, n, k);                                      \
  }

ZLLM_GEMV(gemv_f32, float, 1, 8)
ZLLM_GEMV(gemv_f16, __half, 1, 8)
ZLLM_GEMV(gemv_bf16, __nv_bfloat16, 1, 8)

// The fused LoRA expand's arguments after a GEMV's own (zllm/workers/kernels/matvec.py's
// _lora_args passes them in this order).
#define ZLLM_LORA_PARAMS(T)                                                                      \
  const float *lora_t, const T *__restrict__ lora_b,                                             \
      const int *token_slots, int lora_slots, int lora_rank, int lora_t_cols,                    \
      int lora_end0, int lora_end1
#define ZLLM_LORA_STRUCT(T) \
  zllm::LoraExpand<T> { lora_t, lora_b, token_slots, lora_slots, lora_rank, lora_t_cols, lora_end0, lora_end1 }

#define ZLLM_GEMV_LORA(NAME, T, ROWS, UNROLL)                                                     \
  extern "C" __global__ void __launch_bounds__(zllm::kGemvThreads) NAME(                        \
      T* __restrict__ y, const T* x, const T* __restrict__ w,                                   \
      const T* __restrict__ bias, int n, int k, ZLLM_LORA_PARAMS(T)) {                          \
    zllm::gemv_impl<T, ROWS, UNROLL, true>(y, x, w, bias, n, k, ZLLM_LORA_STRUCT(T));           \
  }

ZLLM_GEMV_LORA(gemv_lora_f32, float, 1, 8)
ZLLM_GEMV_LORA(gemv_lora_f16, __half, 1, 8)
ZLLM_GEMV_LORA(gemv_lora_bf16, __nv_bfloat16, 1, 8)

// gemv_<T>_s<S>_b<B>: S warps a row; B = __launch_bounds__' minimum blocks per SM (b0: none).
// The bound decides how ptxas schedules the loop: without one it interleaves each load with the
// products of the one before (few registers, ~2-5 loads in flight, latency hidden only by a
// full SM of warps); with 4 or 6 it issues a round's loads (8-16) before the first product.
#define ZLLM_GEMV_BOUNDS_b0 __launch_bounds__(zllm::kGemvThreads)
#define ZLLM_GEMV_BOUNDS_b4 __launch_bounds__(zllm::kGemvThreads, 4)
#define ZLLM_GEMV_BOUNDS_b6 __launch_bounds__(zllm::kGemvThreads, 6)
#define ZLLM_GEMV_SPLIT(SUFFIX, T, SPLIT, BOUND)                                                  \
  extern "C" __global__ void ZLLM_GEMV_BOUNDS_##BOUND gemv_##SUFFIX##_s##SPLIT##_##BOUND(        \
      T* __restrict__ y, const T* x, const T* __restrict__ w,                                    \
      const T* __restrict__ bias, int n, int k) {                                               \
    zllm::gemv_split_impl<T, 8, SPLIT>(y, x, w, bias, n, k);                                    \
  }
// gemv_lora_<T>_s<S>_b<B>: the same with LoRA's expand in the epilogue.
#define ZLLM_GEMV_SPLIT_LORA(SUFFIX, T, SPLIT, BOUND)                                             \
  extern "C" __global__ void ZLLM_GEMV_BOUNDS_##BOUND gemv_lora_##SUFFIX##_s##SPLIT##_##BOUND(   \
      T* __restrict__ y, const T* x, const T* __restrict__ w,                                    \
      const T* __restrict__ bias, int n, int k, ZLLM_LORA_PARAMS(T)) {                          \
    zllm::gemv_split_impl<T, 8, SPLIT, true>(y, x, w, bias, n, k, ZLLM_LORA_STRUCT(T));         \
  }
#define ZLLM_GEMV_SPLITS(SUFFIX, T, BOUND)      \
  ZLLM_GEMV_SPLIT(SUFFIX, T, 1, BOUND)          \
  ZLLM_GEMV_SPLIT(SUFFIX, T, 2, BOUND)          \
  ZLLM_GEMV_SPLIT(SUFFIX, T, 4, BOUND)          \
  ZLLM_GEMV_SPLIT_LORA(SUFFIX, T, 1, BOUND)     \
  ZLLM_GEMV_SPLIT_LORA(SUFFIX, T, 2, BOUND)     \
  ZLLM_GEMV_SPLIT_LORA(SUFFIX, T, 4, BOUND)
#define ZLLM_GEMV_SPLITS_DTYPE(SUFFIX, T) \
  ZLLM_GEMV_SPLITS(SUFFIX, T, b0)         \
  ZLLM_GEMV_SPLITS(SUFFIX, T, b4)         \
  ZLLM_GEMV_SPLITS(SUFFIX, T, b6)

ZLLM_GEMV_SPLITS_DTYPE(f32, float)
ZLLM_GEMV_SPLITS_DTYPE(f16, __half)
ZLLM_GEMV_SPLITS_DTYPE(bf16, __nv_bfloat16)

// gemv_<T>_s<S>_b6_add: the b6 build with the residual add in its epilogue (kAdd above); 16-bit
// types only (ZLLM_NORM_GEMV carries the norms of fp16 and bf16 models).
#define ZLLM_GEMV_SPLIT_ADD(SUFFIX, T, SPLIT)                                                     \
  extern "C" __global__ void ZLLM_GEMV_BOUNDS_b6 gemv_##SUFFIX##_s##SPLIT##_b6_add(               \
      T* __restrict__ y, const T* x, const T* __restrict__ w, const T* __restrict__ bias, int n,  \
      int k, const T* add) {                                                                      \
    zllm::gemv_split_impl<T, 8, SPLIT, false, true>(y, x, w, bias, n, k, {}, add);              \
  }
#define ZLLM_GEMV_SPLIT_ADDS(SUFFIX, T) \
  ZLLM_GEMV_SPLIT_ADD(SUFFIX, T, 1)     \
  ZLLM_GEMV_SPLIT_ADD(SUFFIX, T, 2)     \
  ZLLM_GEMV_SPLIT_ADD(SUFFIX, T, 4)
ZLLM_GEMV_SPLIT_ADDS(f16, __half)
ZLLM_GEMV_SPLIT_ADDS(bf16, __nv_bfloat16)

// gemv_bf16_s<S>_b6_push_w<W>: the b6 build whose rows go into the world's Lamport buffers (kPushWorld
// above), the residual added first where add is not null; bf16 only, the Lamport kernels' 16-bit type.
#define ZLLM_GEMV_SPLIT_PUSH(SUFFIX, T, SPLIT, WORLD)                                             \
  extern "C" __global__ void ZLLM_GEMV_BOUNDS_b6 gemv_##SUFFIX##_s##SPLIT##_b6_push_w##WORLD(     \
      const T* x, const T* __restrict__ w, const T* __restrict__ bias, int n, int k,             \
      const T* add, ZLLM_LAMPORT_BUFFER_PARAMS(T), unsigned* flags, int rank,                     \
      long long slot_units) {                                                                     \
    const zllm::LamportPush<T, WORLD> push{{own, {b0, b1, b2, b3, b4, b5, b6, b7}}, flags, rank, slot_units}; \
    zllm::gemv_split_impl<T, 8, SPLIT, false, false, WORLD>(nullptr, x, w, bias, n, k, {}, add, push); \
  }
#define ZLLM_GEMV_SPLIT_PUSHES(SUFFIX, T, WORLD) \
  ZLLM_GEMV_SPLIT_PUSH(SUFFIX, T, 1, WORLD)      \
  ZLLM_GEMV_SPLIT_PUSH(SUFFIX, T, 2, WORLD)      \
  ZLLM_GEMV_SPLIT_PUSH(SUFFIX, T, 4, WORLD)
ZLLM_GEMV_SPLIT_PUSHES(bf16, __nv_bfloat16, 2)
ZLLM_GEMV_SPLIT_PUSHES(bf16, __nv_bfloat16, 4)
ZLLM_GEMV_SPLIT_PUSHES(bf16, __nv_bfloat16, 8)

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

// A full round of gemv_fp8_impl's weight loads: kUnroll 16-byte units of each of kRows rows from u.
template <int kRows, int kUnroll>
__device__ __forceinline__ void fp8_weight_round(uint4 (&wv)[kRows][kUnroll], const uint4* (&w16)[kRows], int u) {
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) wv[r][j] = __ldcs(w16[r] + u + 32 * j);
  }
}

// A full round's products of gemv_fp8_impl: x's 16-element units u + 32 j against the weights.
template <typename T, bool kBlock, int kRows, int kUnroll>
__device__ __forceinline__ void fp8_round_products(float (&acc)[kRows], const uint4 (&wv)[kRows][kUnroll],
                                                   const T* x, const float* __restrict__ tile_scales,
                                                   int u) {
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

// A warp's sums over its kRows weight rows (w16) against x, per lane into acc (gemv_fp8_impl's
// order, which the fused gate_up kernel below shares to give its bits): kUnroll 16-byte loads a
// row in flight, a 32-unit tail; the caller has called pdl_launch_dependents.
template <typename T, bool kBlock, int kRows, int kUnroll>
__device__ __forceinline__ void fp8_rows_stream(float (&acc)[kRows], const uint4* (&w16)[kRows], const T* x,
                                                const float* __restrict__ tile_scales, int units, int lane) {
  // PDL: the first full round of weights is in flight before the wait for the previous kernel
  // (x is its output); that round is peeled off the loop, which stays as it was (before sm_90,
  // where there is no wait, nothing is peeled: the peeled build spills in gemv_fp8_bf16_r1u8).
  int u = lane;
  const bool first_round = kPdlArch && u + 32 * (kUnroll - 1) < units;
  uint4 wv[kRows][kUnroll];
  if (first_round) fp8_weight_round(wv, w16, u);
  pdl_wait();
  if (first_round) {
    fp8_round_products<T, kBlock>(acc, wv, x, tile_scales, u);
    u += 32 * kUnroll;
  }
  for (; u + 32 * (kUnroll - 1) < units; u += 32 * kUnroll) {
    fp8_weight_round(wv, w16, u);
    fp8_round_products<T, kBlock>(acc, wv, x, tile_scales, u);
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
}

// A row's output before its store to T: the warp's sum times the row's scale (per-row scales;
// block scales, kScaled false, are in the sum already), plus the bias. Each operation rounded
// (__fmul_rn, __fadd_rn) so that no compiler contraction into one FMA makes the kernels that
// share this value (gemv_fp8_impl, the fused epilogues below) differ in the last bit.
template <typename T, bool kScaled = true>
__device__ __forceinline__ float fp8_row_output(float total, const float* scale, const T* bias, int row) {
  if constexpr (kScaled) total = __fmul_rn(total, scale[row]);
  return bias == nullptr ? total : __fadd_rn(total, to_float<T>(bias[row]));
}

// A warp takes kRows consecutive rows (each 16 activations loaded once serve all of them: the
// activations are T, up to twice the weights' bytes, so reusing them matters) with kUnroll
// 16-byte weight loads per row in flight. kRows divides 128, so a warp's rows share one row of
// block scales.
template <typename T, bool kBlock, int kRows, int kUnroll>
__device__ __forceinline__ void gemv_fp8_impl(T* __restrict__ y, const T* x,
                                              const unsigned char* __restrict__ w,
                                              const float* __restrict__ scale, const T* __restrict__ bias,
                                              int n, int k) {
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kGemvWarps + warp) * kRows;
  pdl_launch_dependents();  // PDL: common.cuh
  if (row0 >= n) {
    pdl_wait();  // every thread waits (a warp with no rows too)
    return;
  }
  const int units = k / 16;
  const uint4* w16[kRows];
  row_pointers(w, row0, n, k, w16);
  // Block scales: a 128-column group is 8 units; this warp's tiles are one row of the grid.
  const float* tile_scales = kBlock ? scale + static_cast<i64>(row0 / 128) * ((k + 127) / 128) : nullptr;
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
  fp8_rows_stream<T, kBlock, kRows, kUnroll>(acc, w16, x, tile_scales, units, lane);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float total = warp_sum(acc[r]);
    const int row = row0 + r;
    if (lane == 0 && row < n) {
      y[row] = from_float<T>(fp8_row_output<T, !kBlock>(total, scale, bias, row));
    }
  }
}

}  // namespace zllm

#define ZLLM_GEMV_FP8(NAME, T, BLOCK, ROWS, UNROLL)                                               \
  extern "C" __global__ void __launch_bounds__(zllm::kGemvThreads) NAME(                        \
      T* __restrict__ y, const T* x, const unsigned char* __restrict__ w,                       \
      const float* __restrict__ scale, const T* __restrict__ bias, int n, int k) {              \
    zllm::gemv_fp8_impl<T, BLOCK, ROWS, UNROLL>(y, x, w, scale, bias, n, k);                    \
  }

// The default shape (rows per warp, loads per row): zllm/workers/kernels/matvec.py's
// _FP8_GEMV_SHAPES must agree.
#define ZLLM_FP8_GEMV_ROWS 1
#define ZLLM_FP8_GEMV_UNROLL 2  // 2 beat 4 by 6% on W2 (3.640 vs 3.874 ms/token, H100, 2026-11-25)
#define ZLLM_GEMV_FP8_DTYPE(SUFFIX, T)                                                                   \
  ZLLM_GEMV_FP8(gemv_fp8_##SUFFIX, T, false, ZLLM_FP8_GEMV_ROWS, ZLLM_FP8_GEMV_UNROLL)                  \
  ZLLM_GEMV_FP8(gemv_fp8_##SUFFIX##_block, T, true, ZLLM_FP8_GEMV_ROWS, ZLLM_FP8_GEMV_UNROLL)

ZLLM_GEMV_FP8_DTYPE(f32, float)
ZLLM_GEMV_FP8_DTYPE(f16, __half)
ZLLM_GEMV_FP8_DTYPE(bf16, __nv_bfloat16)
// Other shapes for benchmarks/fp8_linear.py's comparison and ZLLM_FP8_GEMV (bf16, per-row scales);
// _b<B>: __launch_bounds__ with B minimum blocks per SM (ptxas then issues a round's loads
// together; see ZLLM_GEMV_BOUNDS_b4 above).
#define ZLLM_GEMV_FP8_BOUND(NAME, T, ROWS, UNROLL, BOUND)                                          \
  extern "C" __global__ void ZLLM_GEMV_BOUNDS_##BOUND NAME(                                       \
      T* __restrict__ y, const T* x, const unsigned char* __restrict__ w,                         \
      const float* __restrict__ scale, const T* __restrict__ bias, int n, int k) {              \
    zllm::gemv_fp8_impl<T, false, ROWS, UNROLL>(y, x, w, scale, bias, n, k);                    \
  }
ZLLM_GEMV_FP8_BOUND(gemv_fp8_bf16_r1u2_b6, __nv_bfloat16, 1, 2, b6)
ZLLM_GEMV_FP8_BOUND(gemv_fp8_bf16_r1u4_b6, __nv_bfloat16, 1, 4, b6)
ZLLM_GEMV_FP8_BOUND(gemv_fp8_bf16_r1u4_b4, __nv_bfloat16, 1, 4, b4)
ZLLM_GEMV_FP8_BOUND(gemv_fp8_bf16_r1u8_b4, __nv_bfloat16, 1, 8, b4)
ZLLM_GEMV_FP8(gemv_fp8_bf16_r1u4, __nv_bfloat16, false, 1, 4)
ZLLM_GEMV_FP8(gemv_fp8_bf16_r1u8, __nv_bfloat16, false, 1, 8)
ZLLM_GEMV_FP8(gemv_fp8_bf16_r2u2, __nv_bfloat16, false, 2, 2)
ZLLM_GEMV_FP8(gemv_fp8_bf16_r2u4, __nv_bfloat16, false, 2, 4)
ZLLM_GEMV_FP8(gemv_fp8_bf16_r4u1, __nv_bfloat16, false, 4, 1)
ZLLM_GEMV_FP8(gemv_fp8_bf16_r4u2, __nv_bfloat16, false, 4, 2)

// ---- FP8 weights, second generation (issue 40): rows split over warps, tensor cores ----------------
// Two more layouts of the same product (bf16 activations, E4M3 weights, per-row scales), picked by
// ZLLM_FP8_GEMV (zllm/workers/kernels/matvec.py) for the A/B; gemv_fp8_impl above stays the default.
//
// gemv_fp8_bf16_split_s<S>: gemv_split_impl's layout with the FP8 dot: S warps (1, 2, 4) a row, each a
//   contiguous S-th of it in whole 32-unit strides, rounds of kFp8SplitUnroll 16-byte weight loads a
//   lane issued before the first product (__launch_bounds__ minimum 4 blocks), the last round
//   masked by a select, the warps' sums added through shared memory.
// gemv_fp8_bf16_mma_g<G>u<U>_s<S>: tensor cores. Why: a 16-byte unit of FP8 weights is 16 products,
//   and on CUDA cores each costs an fp8 -> f32 conversion, a bf16 -> f32 unpack of x and an fma:
//   ~58 instructions a lane per 16 bytes against the bf16 GEMV's ~26, so at 3 TB/s the FP8 kernel
//   spends a third of the SMs' issue slots on arithmetic, between its loads. Here the weights are
//   the A operand of mma.m16n8k16 (f16 in, f32 accumulation): a warp owns G tiles of 16 rows, a
//   lane (g = lane / 4, tig = lane % 4) loads 16 bytes (16 columns) of rows g and g + 8 of each
//   tile, at unit base + 4 j + tig of the row (so a row's four lanes read 64 contiguous bytes),
//   U such units a row in flight a round: 2 G U 16-byte loads a lane. Each pair of E4M3 bytes is
//   one hardware conversion to f16x2 (exact: every E4M3 value is an f16), and four mmas consume a
//   unit (4 columns a lane each). The k order inside an mma is permuted (mma k 2 tig + {0, 1} is
//   the unit's columns 4 i + {0, 1}, k 2 tig + 8 + {0, 1} its columns 4 i + {2, 3}) and B, the
//   activations, follows the same map: every column of B holds x (B's columns are independent, so
//   this costs nothing and needs no select), and every lane gets its rows' full dot products in
//   c[0] (row g) and c[2] (row g + 8). x is converted bf16 -> f16 in registers, once a unit for
//   all G tiles (3 instructions a pair: G = 2 halves that cost a byte); the conversion is exact
//   for |x| in f16's normal range, rounds to f16's subnormal grid (absolute error <= 3e-8) below
//   6.1e-5 and saturates at +-65504 (x past that is not seen in bf16 activations). Per 16 bytes a
//   lane: 8 conversions, 2 mmas and 12 / G instructions for x, ~16-22 against ~58. S warps split
//   K as gemv_rows_mma_impl does (whole 4-unit chunks), full rounds unmasked and one masked last
//   round (x zeroed past the range), the split's sums added through shared memory; the per-row
//   scale is applied once at the end.
namespace zllm {

constexpr int kFp8SplitUnroll = 4;

// 16 E4M3 weights dotted with 16 bf16 activations (two raw 16-byte loads), in fp32.
__device__ __forceinline__ float dot_fp8x16_bf16(uint4 wv, uint4 x0, uint4 x1) {
  float xf[16];
  unpack<__nv_bfloat16>(x0, xf);
  unpack<__nv_bfloat16>(x1, xf + 8);
  return dot_fp8x16(wv, xf);
}

template <int kUnroll, int kSplit>
__device__ __forceinline__ void gemv_fp8_split_impl(__nv_bfloat16* __restrict__ y, const __nv_bfloat16* x,
                                                    const unsigned char* __restrict__ w,
                                                    const float* __restrict__ scale,
                                                    const __nv_bfloat16* __restrict__ bias, int n, int k) {
  constexpr int kRowsPerBlock = kGemvWarps / kSplit;
  __shared__ float partial[kGemvWarps];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kRowsPerBlock + warp / kSplit;  // may pass n: computed, not stored
  const int units = k / 16;
  const int span = ((units + kSplit - 1) / kSplit + 31) / 32 * 32;
  const int begin = imin((warp % kSplit) * span, units);
  const int end = imin(begin + span, units);
  const uint4* x16 = reinterpret_cast<const uint4*>(x);  // unit u: x16[2 u], x16[2 u + 1]
  const uint4* w16 = reinterpret_cast<const uint4*>(w + static_cast<i64>(imin(row, n - 1)) * k);
  float acc = 0.f;
  // PDL (common.cuh): as gemv_split_impl, the first round of weights before the wait.
  pdl_launch_dependents();
  uint4 wv[kUnroll];
  if (kPdlArch && begin < end) weight_round(wv, w16, begin, end, lane);
  pdl_wait();
  for (int base = begin; base < end; base += 32 * kUnroll) {
    if (!kPdlArch || base != begin) weight_round(wv, w16, base, end, lane);
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int u = imin(base + lane + 32 * j, end - 1);
      const float d = dot_fp8x16_bf16(wv[j], x16[2 * u], x16[2 * u + 1]);
      acc += base + lane + 32 * j < end ? d : 0.f;
    }
  }
  float total = warp_sum(acc);
  if constexpr (kSplit > 1) {
    if (lane == 0) partial[warp] = total;
    __syncthreads();
    if (warp % kSplit != 0) return;
    total = 0.f;
#pragma unroll
    for (int p = 0; p < kSplit; ++p) total += partial[warp + p];
  }
  if (lane != 0 || row >= n) return;
  total *= scale[row];
  y[row] = __float2bfloat16_rn(bias == nullptr ? total : total + __bfloat162float(bias[row]));
}

// Four E4M3 weights (one word) as two f16x2 registers, lo = bytes 0-1 and hi = bytes 2-3, each
// weight times kFp8MmaWeightScale (exact; the kernel divides it out with the row scale).
// sm_89 and newer convert a pair in one instruction and read the high half in place (SASS
// F2FP.F16.E4M3.UNPACK_B R, R.H1). sm_80 has no FP8 hardware, and cuda_fp8.h's software path
// costs registers the 16-load builds do not have (they spill), so there the bits are moved: an
// E4M3 byte s eeee mmm put in an f16 as s 0eeee mmm0000000 is the weight times 2^-8 (f16's
// exponent bias is 8 more than E4M3's; E4M3's subnormals land on f16's, so this is exact).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
constexpr float kFp8MmaWeightScale = 1.f / 256.f;
#else
constexpr float kFp8MmaWeightScale = 1.f;
#endif
__device__ __forceinline__ void e4m3x4_to_f16x2(unsigned bits, unsigned& lo, unsigned& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
      : "=r"(lo), "=r"(hi)
      : "r"(bits));
#else
  const unsigned v_lo = __byte_perm(bits, 0u, 0x1404);  // byte 0 -> bits 15-8, byte 1 -> bits 31-24
  const unsigned v_hi = __byte_perm(bits, 0u, 0x3424);  // bytes 2 and 3 the same way
  lo = (v_lo & 0x80008000u) | ((v_lo & 0x7f007f00u) >> 1);
  hi = (v_hi & 0x80008000u) | ((v_hi & 0x7f007f00u) >> 1);
#endif
}

// Two bf16 activations (one word) as f16x2: exact in f16's normal range, saturated past it.
__device__ __forceinline__ unsigned bf16x2_to_f16x2(unsigned bits) {
  const float lo = __uint_as_float(bits << 16);
  const float hi = __uint_as_float(bits & 0xffff0000u);
  unsigned out;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
}

__device__ __forceinline__ unsigned word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Where a lane's x comes from: kStaged, f16 in shared memory (converted once a block); else bf16
// from global memory through the read-only cache, converted by every lane that uses it.
template <bool kStaged>
struct Fp8MmaX {
  const uint4* p;  // unit u: p[2 u], p[2 u + 1] (16 f16 or bf16 values)
  __device__ __forceinline__ void load(int u, uint4& a, uint4& b) const {
    if constexpr (kStaged) {
      a = p[2 * u];
      b = p[2 * u + 1];
    } else {
      a = __ldg(p + 2 * u);
      b = __ldg(p + 2 * u + 1);
    }
  }
  __device__ __forceinline__ unsigned f16x2(const uint4& a, const uint4& b, int pair) const {
    const unsigned bits = word(pair < 4 ? a : b, pair & 3);
    if constexpr (kStaged) {
      return bits;
    } else {
      return bf16x2_to_f16x2(bits);
    }
  }
};

// The 16-byte weight loads of one round: kUnroll units of each of the warp's 2 kTiles rows a lane,
// from unit base + tig on in steps of 4 (kMasked: units at or past end load end - 1).
template <int kTiles, int kUnroll, bool kMasked>
__device__ __forceinline__ void gemv_fp8_mma_loads(uint4 (&wv)[kUnroll][kTiles][2], const uint4* (&w16)[kTiles][2],
                                                   int base, int end, int tig) {
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    const int u = kMasked ? imin(base + 4 * j + tig, end - 1) : base + 4 * j + tig;
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int h = 0; h < 2; ++h) wv[j][t][h] = __ldcs(w16[t][h] + u);
    }
  }
}

// The products of one round (kMasked: units at or past end enter with x = 0).
template <int kTiles, int kUnroll, bool kMasked, bool kStaged>
__device__ __forceinline__ void gemv_fp8_mma_products(float (&acc)[2][kTiles][4], const uint4 (&wv)[kUnroll][kTiles][2],
                                                      const Fp8MmaX<kStaged>& xs, int base, int end, int tig) {
  uint4 xv[kUnroll][2];
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    xs.load(kMasked ? imin(base + 4 * j + tig, end - 1) : base + 4 * j + tig, xv[j][0], xv[j][1]);
  }
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    const bool valid = !kMasked || base + 4 * j + tig < end;
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // word i of the unit: columns 4 i ... 4 i + 3
      const unsigned b0 = valid ? xs.f16x2(xv[j][0], xv[j][1], 2 * i) : 0u;  // x[4 i], x[4 i + 1]
      const unsigned b1 = valid ? xs.f16x2(xv[j][0], xv[j][1], 2 * i + 1) : 0u;
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        unsigned g_lo, g_hi, g8_lo, g8_hi;  // rows g and g + 8
        e4m3x4_to_f16x2(word(wv[j][t][0], i), g_lo, g_hi);
        e4m3x4_to_f16x2(word(wv[j][t][1], i), g8_lo, g8_hi);
        Mma<__half>::run(acc[i & 1][t], g_lo, g8_lo, g_hi, g8_hi, b0, b1);
      }
    }
  }
}

// kStaged: the block first converts x to f16 in dynamic shared memory (k * 2 bytes; the first
// round's weight loads are issued before, so they are in flight while it does).
template <int kTiles, int kUnroll, int kSplit, bool kStaged>
__device__ __forceinline__ void gemv_fp8_mma_impl(__nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ x,
                                                  const unsigned char* __restrict__ w,
                                                  const float* __restrict__ scale,
                                                  const __nv_bfloat16* __restrict__ bias, int n, int k) {
  constexpr int kTilesPerBlock = kGemvWarps / kSplit;
  constexpr int kRound = 4 * kUnroll;  // units of a row a round covers
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;
  const int row0 = (blockIdx.x * kTilesPerBlock + warp / kSplit) * 16 * kTiles;  // may pass n: not stored
  const int units = k / 16;
  const int span = ((units + kSplit - 1) / kSplit + 3) / 4 * 4;  // whole 4-unit chunks
  const int begin = imin((warp % kSplit) * span, units);
  const int end = imin(begin + span, units);
  const uint4* w16[kTiles][2];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = imin(row0 + 16 * t + 8 * h + g, n - 1);
      w16[t][h] = reinterpret_cast<const uint4*>(w + static_cast<i64>(row) * k);
    }
  }
  // Two accumulators a tile, for even and odd words: two chains of dependent mmas, not one.
  float acc[2][kTiles][4];
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int t = 0; t < kTiles; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[c][t][i] = 0.f;
  int base = begin;
  uint4 wv[kUnroll][kTiles][2];
  bool loaded = false;
  Fp8MmaX<kStaged> xs;
  if constexpr (kStaged) {
    extern __shared__ uint4 x_f16[];  // k / 8 16-byte pieces
    if (base + kRound <= end) {
      gemv_fp8_mma_loads<kTiles, kUnroll, false>(wv, w16, base, end, tig);
      loaded = true;
    }
    const uint4* x16 = reinterpret_cast<const uint4*>(x);
    for (int i = threadIdx.x; i < k / 8; i += kGemvThreads) {
      const uint4 v = __ldg(x16 + i);
      x_f16[i] = make_uint4(bf16x2_to_f16x2(v.x), bf16x2_to_f16x2(v.y), bf16x2_to_f16x2(v.z), bf16x2_to_f16x2(v.w));
    }
    __syncthreads();
    xs.p = x_f16;
  } else {
    xs.p = reinterpret_cast<const uint4*>(x);
  }
  if (loaded) {
    gemv_fp8_mma_products<kTiles, kUnroll, false>(acc, wv, xs, base, end, tig);
    base += kRound;
  }
  for (; base + kRound <= end; base += kRound) {
    gemv_fp8_mma_loads<kTiles, kUnroll, false>(wv, w16, base, end, tig);
    gemv_fp8_mma_products<kTiles, kUnroll, false>(acc, wv, xs, base, end, tig);
  }
  if (base < end) {
    gemv_fp8_mma_loads<kTiles, kUnroll, true>(wv, w16, base, end, tig);
    gemv_fp8_mma_products<kTiles, kUnroll, true>(acc, wv, xs, base, end, tig);
  }
  // sums[t][h]: row row0 + 16 t + 8 h + g (every column of c holds it; lanes tig > 0 repeat it).
  float sums[kTiles][2];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    sums[t][0] = acc[0][t][0] + acc[1][t][0];
    sums[t][1] = acc[0][t][2] + acc[1][t][2];
  }
  if constexpr (kSplit > 1) {
    __shared__ float partial[kGemvWarps][kTiles][2][8];
    if (tig == 0) {
#pragma unroll
      for (int t = 0; t < kTiles; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) partial[warp][t][h][g] = sums[t][h];
    }
    __syncthreads();
    if (warp % kSplit != 0) return;
#pragma unroll
    for (int t = 0; t < kTiles; ++t)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float total = 0.f;
#pragma unroll
        for (int p = 0; p < kSplit; ++p) total += partial[warp + p][t][h][g];
        sums[t][h] = total;
      }
  }
  if (tig != 0) return;
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 16 * t + 8 * h + g;
      if (row < n) {
        const float total = sums[t][h] * (scale[row] / kFp8MmaWeightScale);
        y[row] = __float2bfloat16_rn(bias == nullptr ? total : total + __bfloat162float(bias[row]));
      }
    }
}

}  // namespace zllm

// gemv_fp8_bf16_split_s<S> and gemv_fp8_bf16_mma_g<G>u<U>_s<S> (above); zllm/workers/kernels/
// matvec.py's FP8_GEMV_SPLIT_BUILDS / FP8_GEMV_MMA_BUILDS must agree. Bound as ZLLM_GEMV_BOUNDS_b4.
#define ZLLM_GEMV_FP8_SPLIT(SPLIT)                                                                 \
  extern "C" __global__ void ZLLM_GEMV_BOUNDS_b4 gemv_fp8_bf16_split_s##SPLIT(                    \
      __nv_bfloat16* __restrict__ y, const __nv_bfloat16* x,                                      \
      const unsigned char* __restrict__ w, const float* __restrict__ scale,                       \
      const __nv_bfloat16* __restrict__ bias, int n, int k) {                                     \
    zllm::gemv_fp8_split_impl<zllm::kFp8SplitUnroll, SPLIT>(y, x, w, scale, bias, n, k);          \
  }
// _x<S>: x staged as f16 in shared memory (k * 2 bytes of dynamic shared memory a block).
#define ZLLM_GEMV_FP8_MMA(TILES, UNROLL, SPLIT, STAGED, TAG)                                       \
  extern "C" __global__ void ZLLM_GEMV_BOUNDS_b4 gemv_fp8_bf16_mma_g##TILES##u##UNROLL##TAG##_s##SPLIT( \
      __nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ x,                         \
      const unsigned char* __restrict__ w, const float* __restrict__ scale,                       \
      const __nv_bfloat16* __restrict__ bias, int n, int k) {                                     \
    zllm::gemv_fp8_mma_impl<TILES, UNROLL, SPLIT, STAGED>(y, x, w, scale, bias, n, k);            \
  }
#define ZLLM_GEMV_FP8_MMA_SPLITS(TILES, UNROLL, STAGED, TAG) \
  ZLLM_GEMV_FP8_MMA(TILES, UNROLL, 1, STAGED, TAG)           \
  ZLLM_GEMV_FP8_MMA(TILES, UNROLL, 2, STAGED, TAG)           \
  ZLLM_GEMV_FP8_MMA(TILES, UNROLL, 4, STAGED, TAG)

ZLLM_GEMV_FP8_SPLIT(1)
ZLLM_GEMV_FP8_SPLIT(2)
ZLLM_GEMV_FP8_SPLIT(4)
ZLLM_GEMV_FP8_MMA_SPLITS(1, 4, false, )
ZLLM_GEMV_FP8_MMA_SPLITS(2, 2, false, )
ZLLM_GEMV_FP8_MMA_SPLITS(1, 4, true, x)
ZLLM_GEMV_FP8_MMA_SPLITS(2, 2, true, x)
ZLLM_GEMV_FP8_MMA_SPLITS(1, 8, true, x)
ZLLM_GEMV_FP8_MMA_SPLITS(2, 4, true, x)

// ---- 2 to 8 rows ----------------------------------------------------------------------------------
// Y[r, n] = sum_k X[r, k] * w[n, k] (+ bias[n]) for r < m, 2 <= m <= 8: a speculative step's
// verified tokens (1 + k, padded to the decode graph's 8) and small decode batches. The weights
// are still read once, so the cost should stay that of the one-row GEMV.
//   X [m, K] and Y [m, N] contiguous; w as above; K a multiple of 16 / sizeof(T); X, w 16-byte
//   aligned. Rows of X past m are never read, rows of Y past m never written.
// Two families, one grid shape (ceil(N / rows a block) blocks of kGemvWarps warps, the split-K of
// gemv_split_impl: kSplit warps share a row range, each a contiguous kSplit-th of K in rounds of
// up to 8 16-byte weight loads a lane, evict-first, the last round masked; fp32 sums, added
// across the split through shared memory):
//
// gemv_rows_<T>_mma_g<G>_s<S> (fp16, bf16): tensor cores. A warp owns G groups of 8 weight rows;
//   X's m rows are the A tile (rows m ... 15 zero) and each weight row group one B tile of an
//   mma.m16n8k16 (mma.cuh): a lane loads 16 bytes of its weight row(s) and 16 bytes of its X row
//   per 32-column chunk, which is the one-row split kernel's access pattern (one 16-byte X load
//   per 16-byte weight load, X from L1/L2), and 2 mmas replace its 8 fmas and 16 unpacks, for
//   any m <= 8. Why not CUDA cores for these dtypes: at m = 8 a 16-byte weight unit (8 weights)
//   costs 64 fmas, 64 unpacked X elements and 8 X loads, ~140 instructions a lane; streaming
//   3 TB/s of weights is ~190 G units/s, i.e. ~27 T lane-instructions/s against the H100's ~30 T
//   issue rate: the kernel would be bound by issue, not by memory, well before m = 8.
// gemv_rows_<T>_fma_t<R>_s<S> (all three dtypes; the only one for fp32, where an mma would be
//   TF32): gemv_split_impl with R accumulators a lane (R = 2, 4, 8 covers m <= R). Only the
//   weight loads are batched a round (kUnroll of them, the DRAM traffic); X is loaded as each
//   product needs it, one 16-byte load per row per weight unit from the read-only cache (X is at
//   most 8 x K elements, in L1/L2 once the first warps touched it). Holding X for a round instead
//   would take R x kUnroll x 16 bytes of registers a lane (256 registers at R = 8, kUnroll = 8);
//   staging it in shared memory would cost each block a full copy of X (8 x 14336 x 2 = 224 KB
//   for Llama-3-8B's down projection) for the K range of one split. kUnroll is 8 for R <= 4 and 4
//   at R = 8: with 8 the fp32 build at R = 8 spills under the 128 registers of
//   __launch_bounds__(128, 4) (52 bytes, ptxas 13.0, sm_90). A lane adds its units in the same
//   order as gemv_split_impl (and a row's products do not depend on the other rows), so a row's
//   result is that of the one-row split kernel of the same split, bit for bit, whatever m.
// Both: a row's result does not depend on m (rows past m are zeros or skipped, never mixed into
// the others), so padding a batch does not change the other rows' bits.
namespace zllm {

template <typename T, int kGroups, int kSplit, bool kLora = false>
__device__ __forceinline__ void gemv_rows_mma_impl(T* __restrict__ y, const T* __restrict__ x,
                                                   const T* __restrict__ w, const T* __restrict__ bias,
                                                   int m, int n, int k, LoraExpand<T> lora = {}) {
  constexpr int kUnroll = 8 / kGroups;  // 16-byte weight loads a lane a round: 8, as the one-row kernel
  constexpr int kTileRows = 8 * kGroups;
  constexpr int kTilesPerBlock = kGemvWarps / kSplit;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;
  const int row0 = (blockIdx.x * kTilesPerBlock + warp / kSplit) * kTileRows;  // may pass n: not stored
  const int units = k / 8;
  // A warp's range: whole chunks of 4 units (32 columns, one 16-byte unit per lane of a row).
  const int span = ((units + kSplit - 1) / kSplit + 3) / 4 * 4;
  const int begin = imin((warp % kSplit) * span, units);
  const int end = imin(begin + span, units);
  const uint4* w16[kGroups];
#pragma unroll
  for (int q = 0; q < kGroups; ++q) {
    w16[q] = reinterpret_cast<const uint4*>(w + static_cast<i64>(imin(row0 + 8 * q + g, n - 1)) * k);
  }
  const bool has_x = g < m;  // lanes of A rows past m feed zeros
  const uint4* x16 = reinterpret_cast<const uint4*>(x + static_cast<i64>(has_x ? g : 0) * k);
  // LoRA: the slot of this lane's X row g, read now; B's rows are read in the epilogue (a lane
  // there holds sums of rows its neighbours do not, so it adds each one's whole dot itself).
  const int slot = kLora && has_x ? __ldg(lora.token_slots + g) : -1;
  // Two accumulators a row group, for even and odd chunks: a round is then two chains of 8
  // dependent mmas, not one of 16 (~30 cycles each on the H100), so a warp gets back to its next
  // round's loads sooner.
  float acc[2][kGroups][4];
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int q = 0; q < kGroups; ++q)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[c][q][i] = 0.f;
  for (int base = begin; base < end; base += 4 * kUnroll) {
    // Masked as gemv_split_impl's last round: units past the range load the last one (a select,
    // so a round's loads stay in flight together) and enter the mma as zeros.
    uint4 wv[kUnroll][kGroups], xv[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
#pragma unroll
      for (int q = 0; q < kGroups; ++q) wv[j][q] = __ldcs(w16[q] + imin(base + 4 * j + tig, end - 1));
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) xv[j] = has_x ? __ldg(x16 + imin(base + 4 * j + tig, end - 1)) : zero4();
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const bool valid = base + 4 * j + tig < end;
      const uint4 xj = valid ? xv[j] : zero4();
#pragma unroll
      for (int q = 0; q < kGroups; ++q) mma_chunk<T>(acc[j & 1][q], xj, zero4(), valid ? wv[j][q] : zero4());
    }
  }
  // sums[q][i]: X row g times weight row row0 + 8 q + 2 tig + i (acc[.][q][2, 3]: A rows 8-15, zero).
  float sums[kGroups][2];
#pragma unroll
  for (int q = 0; q < kGroups; ++q)
#pragma unroll
    for (int i = 0; i < 2; ++i) sums[q][i] = acc[0][q][i] + acc[1][q][i];
  if constexpr (kSplit > 1) {
    __shared__ float partial[kGemvWarps][kGroups][2][32];
#pragma unroll
    for (int q = 0; q < kGroups; ++q)
#pragma unroll
      for (int i = 0; i < 2; ++i) partial[warp][q][i][lane] = sums[q][i];
    __syncthreads();
    if (warp % kSplit != 0) return;
#pragma unroll
    for (int q = 0; q < kGroups; ++q)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float total = 0.f;
#pragma unroll
        for (int p = 0; p < kSplit; ++p) total += partial[warp + p][q][i][lane];
        sums[q][i] = total;
      }
  }
  if (!has_x) return;
  T* y_row = y + static_cast<i64>(g) * n;
#pragma unroll
  for (int q = 0; q < kGroups; ++q)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = row0 + 8 * q + 2 * tig + i;
      if (row >= n) continue;
      float total = bias == nullptr ? sums[q][i] : sums[q][i] + to_float<T>(bias[row]);
      if constexpr (kLora) total += lora.dot(g, slot, row);
      y_row[row] = from_float<T>(total);
    }
}

template <typename T, int kTokens, int kSplit, bool kLora = false>
__device__ __forceinline__ void gemv_rows_fma_impl(T* __restrict__ y, const T* __restrict__ x,
                                                   const T* __restrict__ w, const T* __restrict__ bias,
                                                   int m, int n, int k, LoraExpand<T> lora = {}) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  // 4 at kTokens = 8 and for the fp32 LoRA build at 4 (the LoRA operands' registers spill it on
  // sm_80 at 8): the order a lane adds its units in is the same either way.
  constexpr bool kNarrow = kTokens > 4 || (kTokens == 4 && kLora && sizeof(T) == 4);
  constexpr int kUnroll = kNarrow ? 4 : 8;
  constexpr int kRowsPerBlock = kGemvWarps / kSplit;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kRowsPerBlock + warp / kSplit;  // may pass n: computed, not stored
  const int units = k / kVec;
  const int span = ((units + kSplit - 1) / kSplit + 31) / 32 * 32;
  const int begin = imin((warp % kSplit) * span, units);
  const int end = imin(begin + span, units);
  const uint4* x16 = reinterpret_cast<const uint4*>(x);
  const uint4* w16 = reinterpret_cast<const uint4*>(w + static_cast<i64>(imin(row, n - 1)) * k);
  float acc[kTokens];
#pragma unroll
  for (int t = 0; t < kTokens; ++t) acc[t] = 0.f;
  // LoRA: the rows' slots now (kEarly), B's pieces after the weights (holding a piece a row during
  // the loop would cost kTokens x 4 registers under the bound).
  int slots[kTokens];
#pragma unroll
  for (int t = 0; t < kTokens; ++t) {
    slots[t] = kLora && LoraExpand<T>::kEarly && t < m ? __ldg(lora.token_slots + t) : -1;
  }
  for (int base = begin; base < end; base += 32 * kUnroll) {
    uint4 wv[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) wv[j] = __ldcs(w16 + imin(base + lane + 32 * j, end - 1));
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int u = imin(base + lane + 32 * j, end - 1);
      const bool valid = base + lane + 32 * j < end;
#pragma unroll
      for (int t = 0; t < kTokens; ++t) {
        if (t < m) {  // uniform over the warp
          const float d = dot16<T>(wv[j], __ldg(x16 + static_cast<i64>(t) * units + u));
          acc[t] += valid ? d : 0.f;
        }
      }
    }
  }
  if constexpr (kLora) {
    // The row's first warp adds B[row, slot, :] . t, a 16-byte piece of B a lane.
    if (warp % kSplit == 0 && lane * kVec < lora.rank) {
      const int r = imin(row, n - 1);
      if (!LoraExpand<T>::kEarly) {
#pragma unroll
        for (int t = 0; t < kTokens; ++t) slots[t] = t < m ? __ldg(lora.token_slots + t) : -1;
      }
#pragma unroll
      for (int t = 0; t < kTokens; ++t) {
        if (slots[t] >= 0) acc[t] += lora.piece_dot(lora.b_piece(r, slots[t], lane * kVec), t, r, lane * kVec);
      }
    }
  }
  float total[kTokens];
#pragma unroll
  for (int t = 0; t < kTokens; ++t) total[t] = warp_sum(acc[t]);
  if constexpr (kSplit > 1) {
    __shared__ float partial[kGemvWarps][kTokens];
    if (lane == 0) {
#pragma unroll
      for (int t = 0; t < kTokens; ++t) partial[warp][t] = total[t];
    }
    __syncthreads();
    if (warp % kSplit != 0) return;
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      total[t] = 0.f;
#pragma unroll
      for (int p = 0; p < kSplit; ++p) total[t] += partial[warp + p][t];
    }
  }
  if (lane != 0 || row >= n) return;
  const float b = bias == nullptr ? 0.f : to_float<T>(bias[row]);
#pragma unroll
  for (int t = 0; t < kTokens; ++t) {
    if (t < m) y[static_cast<i64>(t) * n + row] = from_float<T>(bias == nullptr ? total[t] : total[t] + b);
  }
}

}  // namespace zllm

// gemv_rows_<T>_mma_g<G>_s<S> and gemv_rows_<T>_fma_t<R>_s<S> (above); zllm/workers/kernels/
// matvec.py's GEMV_ROWS_* tables must agree. Bound as ZLLM_GEMV_BOUNDS_b4: a round's loads issued
// together.
#define ZLLM_GEMV_ROWS_MMA(SUFFIX, T, GROUPS, SPLIT)                                              \
  extern "C" __global__ void ZLLM_GEMV_BOUNDS_b4 gemv_rows_##SUFFIX##_mma_g##GROUPS##_s##SPLIT( \
      T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ w,                      \
      const T* __restrict__ bias, int m, int n, int k) {                                        \
    zllm::gemv_rows_mma_impl<T, GROUPS, SPLIT>(y, x, w, bias, m, n, k);                         \
  }
#define ZLLM_GEMV_ROWS_FMA(SUFFIX, T, TOKENS, SPLIT)                                              \
  extern "C" __global__ void ZLLM_GEMV_BOUNDS_b4 gemv_rows_##SUFFIX##_fma_t##TOKENS##_s##SPLIT( \
      T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ w,                      \
      const T* __restrict__ bias, int m, int n, int k) {                                        \
    zllm::gemv_rows_fma_impl<T, TOKENS, SPLIT>(y, x, w, bias, m, n, k);                         \
  }
// gemv_rows_lora_*: the same with LoRA's expand in the epilogue.
#define ZLLM_GEMV_ROWS_MMA_LORA(SUFFIX, T, GROUPS, SPLIT)                                                  \
  extern "C" __global__ void ZLLM_GEMV_BOUNDS_b4 gemv_rows_lora_##SUFFIX##_mma_g##GROUPS##_s##SPLIT(      \
      T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ w,                               \
      const T* __restrict__ bias, int m, int n, int k, ZLLM_LORA_PARAMS(T)) {                            \
    zllm::gemv_rows_mma_impl<T, GROUPS, SPLIT, true>(y, x, w, bias, m, n, k, ZLLM_LORA_STRUCT(T));       \
  }
#define ZLLM_GEMV_ROWS_FMA_LORA(SUFFIX, T, TOKENS, SPLIT)                                                  \
  extern "C" __global__ void ZLLM_GEMV_BOUNDS_b4 gemv_rows_lora_##SUFFIX##_fma_t##TOKENS##_s##SPLIT(      \
      T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ w,                               \
      const T* __restrict__ bias, int m, int n, int k, ZLLM_LORA_PARAMS(T)) {                            \
    zllm::gemv_rows_fma_impl<T, TOKENS, SPLIT, true>(y, x, w, bias, m, n, k, ZLLM_LORA_STRUCT(T));       \
  }
#define ZLLM_GEMV_ROWS_MMA_BOTH(SUFFIX, T, GROUPS, SPLIT) \
  ZLLM_GEMV_ROWS_MMA(SUFFIX, T, GROUPS, SPLIT)            \
  ZLLM_GEMV_ROWS_MMA_LORA(SUFFIX, T, GROUPS, SPLIT)
#define ZLLM_GEMV_ROWS_FMA_BOTH(SUFFIX, T, TOKENS, SPLIT) \
  ZLLM_GEMV_ROWS_FMA(SUFFIX, T, TOKENS, SPLIT)            \
  ZLLM_GEMV_ROWS_FMA_LORA(SUFFIX, T, TOKENS, SPLIT)
#define ZLLM_GEMV_ROWS_MMA_DTYPE(SUFFIX, T) \
  ZLLM_GEMV_ROWS_MMA_BOTH(SUFFIX, T, 1, 1)       \
  ZLLM_GEMV_ROWS_MMA_BOTH(SUFFIX, T, 1, 2)       \
  ZLLM_GEMV_ROWS_MMA_BOTH(SUFFIX, T, 1, 4)       \
  ZLLM_GEMV_ROWS_MMA_BOTH(SUFFIX, T, 2, 1)       \
  ZLLM_GEMV_ROWS_MMA_BOTH(SUFFIX, T, 2, 2)       \
  ZLLM_GEMV_ROWS_MMA_BOTH(SUFFIX, T, 2, 4)
#define ZLLM_GEMV_ROWS_FMA_SPLITS(SUFFIX, T, TOKENS) \
  ZLLM_GEMV_ROWS_FMA_BOTH(SUFFIX, T, TOKENS, 1)           \
  ZLLM_GEMV_ROWS_FMA_BOTH(SUFFIX, T, TOKENS, 2)           \
  ZLLM_GEMV_ROWS_FMA_BOTH(SUFFIX, T, TOKENS, 4)
#define ZLLM_GEMV_ROWS_FMA_DTYPE(SUFFIX, T)  \
  ZLLM_GEMV_ROWS_FMA_SPLITS(SUFFIX, T, 2)    \
  ZLLM_GEMV_ROWS_FMA_SPLITS(SUFFIX, T, 4)    \
  ZLLM_GEMV_ROWS_FMA_SPLITS(SUFFIX, T, 8)

ZLLM_GEMV_ROWS_MMA_DTYPE(f16, __half)
ZLLM_GEMV_ROWS_MMA_DTYPE(bf16, __nv_bfloat16)
ZLLM_GEMV_ROWS_FMA_DTYPE(f32, float)
ZLLM_GEMV_ROWS_FMA_DTYPE(f16, __half)
ZLLM_GEMV_ROWS_FMA_DTYPE(bf16, __nv_bfloat16)

// ---- Pairs of rows with an epilogue: gate_up + activation, q/k/v + rotary + KV cache ------------
// A batch-1 decode layer runs its gate_up GEMV and then the gated activation, and its q/k/v GEMV
// and then the rotary + cache kernel. Each second kernel reads pairs of the first's output
// rows (gate i and up i; a head's dims i and i + D/2) and nothing else of it, so the GEMV can
// compute both rows of a pair and finish the job in its epilogue: one launch a layer fewer for
// each, and the product never goes through memory. The sums are the unfused GEMV's, to the bit
// (the same loads, split and order per row), rounded to T as it stores them; the epilogue then
// computes what the second kernel would from those rounded values, with the same functions.
//
//   gemv_fp8_<T>_<epi>            FP8 weights, per-row scales: a warp a pair (gemv_fp8_<T>'s rows:
//                                 2 loads of 16 bytes a lane a round each)
//   gemv_<T>_s<S>_b6_<epi>        dense weights: 2 S warps a pair, S warps a row as gemv_<T>_s<S>_b6
//                                 (gemv_split's S from K); 4 warps a block (two pairs at S = 1, one
//                                 at S = 2), 8 at S = 4, and 6 (3) blocks an SM: 24 warps, as b6
//   <epi>: silu_and_mul, gelu_tanh_and_mul (ActPairs); rope_cache (RopeCachePairs, C = T) and
//   rope_cache_kvfp8 (an FP8 cache).
namespace zllm {

// gate_up [2 d, K] -> y [d] = to_T(to_T(act(g)) * u): pair i is rows i and d + i
// (activation_kernels.cu's act_and_mul on the stored product).
template <typename T, Act kAct>
struct ActPairs {
  T* y;
  int d;
  __device__ __forceinline__ int pairs() const { return d; }
  __device__ __forceinline__ int row1(int p) const { return p; }
  __device__ __forceinline__ int row2(int p) const { return d + p; }
  __device__ __forceinline__ void finish(int p, T g, T u) const {
    y[p] = from_float<T>(round_to<T>(activation<kAct>(to_float<T>(g))) * to_float<T>(u));
  }
};

// q/k/v [(H + 2 KVH) D, K] -> the product y [(H + 2 KVH) D] with q and k rotated in place, and k
// and v stored at the token's slot of the paged cache: rotary_embedding_and_cache (full rotary,
// rot_dim = D, one token) on the stored product. Pair p is dims i and i + D/2 of head p / (D/2)
// (q's heads, then k's, then v's).
template <typename T, typename C>
struct RopeCachePairs {
  T* y;
  const i64* positions;  // [1]
  const float* cos_cache;  // [max_pos, D / 2]
  const float* sin_cache;
  C* k_cache;  // [num_slots, KVH, D]
  C* v_cache;
  const i64* slot_mapping;  // [1]
  int num_heads, num_kv_heads, head_dim;
  i64 max_pos, num_slots;
  float inv_k_scale, inv_v_scale;

  __device__ __forceinline__ int pairs() const { return (num_heads + 2 * num_kv_heads) * (head_dim / 2); }
  __device__ __forceinline__ int row1(int p) const {
    const int half = head_dim / 2;
    return (p / half) * head_dim + p % half;
  }
  __device__ __forceinline__ int row2(int p) const { return row1(p) + head_dim / 2; }
  __device__ __forceinline__ void finish(int p, T x1, T x2) const {
    const int half = head_dim / 2;
    const int head = p / half;
    const int i = p - head * half;
    const bool is_v = head >= num_heads + num_kv_heads;
    const i64 pos = positions[0];
    T y1 = x1, y2 = x2;
    if (!is_v && pos >= 0 && pos < max_pos) {
      rotated<T>(to_float<T>(x1), to_float<T>(x2), cos_cache[pos * half + i], sin_cache[pos * half + i], y1, y2);
    }
    y[row1(p)] = y1;
    y[row1(p) + half] = y2;
    if (head < num_heads) return;
    const i64 slot = slot_mapping[0];
    if (slot < 0 || slot >= num_slots) return;  // padding (or a bad slot: never write outside)
    const int kv_head = head - num_heads - (is_v ? num_kv_heads : 0);
    C* cache = is_v ? v_cache : k_cache;
    const float inv_scale = is_v ? inv_v_scale : inv_k_scale;
    const i64 base = (slot * num_kv_heads + kv_head) * head_dim;
    cache[base + i] = to_cache<C>(y1, inv_scale);
    cache[base + i + half] = to_cache<C>(y2, inv_scale);
  }
};

template <typename T, typename Epi>
__device__ __forceinline__ void gemv_fp8_pairs_impl(const T* x, const unsigned char* __restrict__ w,
                                                    const float* __restrict__ scale,
                                                    const T* __restrict__ bias, int k, const Epi& epi) {
  constexpr int kRows = 2;
  constexpr int kUnroll = ZLLM_FP8_GEMV_UNROLL;
  const int lane = threadIdx.x & 31;
  const int p = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  pdl_launch_dependents();  // PDL: as gemv_fp8_impl
  if (p >= epi.pairs()) {
    pdl_wait();
    return;
  }
  const int rows[kRows] = {epi.row1(p), epi.row2(p)};
  const int units = k / 16;
  const uint4* w16[kRows] = {reinterpret_cast<const uint4*>(w + static_cast<i64>(rows[0]) * k),
                             reinterpret_cast<const uint4*>(w + static_cast<i64>(rows[1]) * k)};
  float acc[kRows] = {0.f, 0.f};
  fp8_rows_stream<T, false, kRows, kUnroll>(acc, w16, x, nullptr, units, lane);
  float total[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) total[r] = warp_sum(acc[r]);
  if (lane != 0) return;
  T stored[kRows];  // what gemv_fp8_<T> stores for the two rows
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    // gemv_fp8_impl's arithmetic (left to the compiler, it was contracted into one FMA here in
    // some instantiations: a last-bit difference the H200 suite found with a bias).
    stored[r] = from_float<T>(fp8_row_output<T>(total[r], scale, bias, rows[r]));
  }
  epi.finish(p, stored[0], stored[1]);
}

template <int kSplit>
struct PairBlock {
  static constexpr int kPairWarps = 2 * kSplit;
  static constexpr int kWarps = kPairWarps < kGemvWarps ? kGemvWarps : kPairWarps;
  static constexpr int kPairs = kWarps / kPairWarps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMinBlocks = 6 * kGemvWarps / kWarps;
};

// 16 bytes of weights against x, and x's sum of squares.
template <typename T>
__device__ __forceinline__ void dot16_squares(uint4 wv, uint4 xv, float& dot, float& sum_sq) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  float wf[kVec], xf[kVec];
  unpack<T>(wv, wf);
  unpack<T>(xv, xf);
  float d = 0.f, s = 0.f;
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    d = fmaf(wf[e], xf[e], d);
    s = fmaf(xf[e], xf[e], s);
  }
  dot = d;
  sum_sq = s;
}

// kNorm (the _norm builds): x is a residual stream row and the products are those of its RMSNorm
// whose weight was folded into the weight matrix's columns at load (models/llama.py
// fold_norms): y = (sum_k x_k w'_k) * rsqrt(mean(x^2) + norm_eps), the scale applied to the fp32
// sums before the bias and the one rounding to T. Every warp adds x's squares beside its
// products (one FMA an element; keeping them to the warps whose squares are used, the block's
// first kSplit warps, which cover all of x, spilled under b6's registers), and the block scales
// its pairs by those first warps' sum. So the norm's launch, and its boundary with the
// product's, are gone from a batch-1 step.
template <typename T, int kUnroll, int kSplit, bool kNorm = false, typename Epi>
__device__ __forceinline__ void gemv_split_pairs_impl(const T* x, const T* __restrict__ w,
                                                      const T* __restrict__ bias, int k, const Epi& epi,
                                                      float norm_eps = 0.f) {
  using Block = PairBlock<kSplit>;
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  __shared__ float partial[Block::kWarps];
  __shared__ float partial_sq[kNorm ? kSplit : 1];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int n_pairs = epi.pairs();
  const int p = blockIdx.x * Block::kPairs + warp / Block::kPairWarps;  // may pass n_pairs: computed, not stored
  const int pc = imin(p, n_pairs - 1);
  const bool second = (warp / kSplit) % 2 == 1;  // the pair's second row
  const int row = second ? epi.row2(pc) : epi.row1(pc);
  const int units = k / kVec;
  const int span = ((units + kSplit - 1) / kSplit + 31) / 32 * 32;
  const int begin = imin((warp % kSplit) * span, units);
  const int end = imin(begin + span, units);
  const uint4* x16 = reinterpret_cast<const uint4*>(x);
  const uint4* w16 = reinterpret_cast<const uint4*>(w + static_cast<i64>(row) * k);
  float acc = 0.f;
  // PDL: as gemv_split_impl, the first round of weights before the wait.
  pdl_launch_dependents();
  uint4 wv[kUnroll];
  if (kPdlArch && begin < end) weight_round(wv, w16, begin, end, lane);
  pdl_wait();
  float sum_sq = 0.f;
  const bool squares = kNorm && warp < kSplit;  // the warps whose squares the block keeps
  for (int base = begin; base < end; base += 32 * kUnroll) {
    if (!kPdlArch || base != begin) weight_round(wv, w16, base, end, lane);
    uint4 xv[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) xv[j] = x16[imin(base + lane + 32 * j, end - 1)];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const bool in = base + lane + 32 * j < end;
      if constexpr (kNorm) {
        float dot, sq;
        dot16_squares<T>(wv[j], xv[j], dot, sq);
        acc += in ? dot : 0.f;
        sum_sq += in ? sq : 0.f;
      } else {
        const float dot = dot16<T>(wv[j], xv[j]);
        acc += in ? dot : 0.f;
      }
    }
  }
  const float total = warp_sum(acc);
  if (lane == 0) partial[warp] = total;
  if constexpr (kNorm) {
    sum_sq = warp_sum(sum_sq);
    if (lane == 0 && squares) partial_sq[warp] = sum_sq;
  }
  __syncthreads();
  if (lane != 0 || warp % Block::kPairWarps != 0 || p >= n_pairs) return;
  // gemv_split_impl's sums: its one warp's total, or 0 plus each warp's, in order.
  float sums[2] = {partial[warp], partial[warp + kSplit]};
  if constexpr (kSplit > 1) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sums[r] = 0.f;
#pragma unroll
      for (int s = 0; s < kSplit; ++s) sums[r] += partial[warp + r * kSplit + s];
    }
  }
  if constexpr (kNorm) {
    float x_squares = 0.f;
#pragma unroll
    for (int s = 0; s < kSplit; ++s) x_squares += partial_sq[s];
    const float inv_rms = rsqrtf(x_squares / static_cast<float>(k) + norm_eps);
    sums[0] *= inv_rms;
    sums[1] *= inv_rms;
  }
  const int rows[2] = {epi.row1(p), epi.row2(p)};
  T stored[2];  // what gemv_<T>_s<S>_b6 stores for the two rows
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    stored[r] = from_float<T>(bias == nullptr ? sums[r] : sums[r] + to_float<T>(bias[rows[r]]));
  }
  epi.finish(p, stored[0], stored[1]);
}

}  // namespace zllm

// The entry points. Activation: (y, x, w[, scale], bias, d, k). Rotary + cache: (y, x, w[, scale],
// bias, k, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
// head_dim, max_pos, num_slots, inv_k_scale, inv_v_scale).
#define ZLLM_ROPE_PARAMS(T, C)                                                                    \
  const long long *positions, const float *__restrict__ cos_cache,                               \
      const float *__restrict__ sin_cache, C *__restrict__ k_cache, C *__restrict__ v_cache,     \
      const long long *slot_mapping, int num_heads, int num_kv_heads, int head_dim,              \
      long long max_pos, long long num_slots, float inv_k_scale, float inv_v_scale
#define ZLLM_ROPE_EPI(T, C)                                                                       \
  zllm::RopeCachePairs<T, C> {                                                                    \
    y, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,  \
        head_dim, max_pos, num_slots, inv_k_scale, inv_v_scale                                    \
  }

#define ZLLM_GEMV_FP8_ACT(SUFFIX, T, ACT_NAME, ACT)                                                 \
  extern "C" __global__ void __launch_bounds__(zllm::kGemvThreads) gemv_fp8_##SUFFIX##_##ACT_NAME##_and_mul( \
      T* __restrict__ y, const T* x, const unsigned char* __restrict__ w,                         \
      const float* __restrict__ scale, const T* __restrict__ bias, int d, int k) {                \
    zllm::gemv_fp8_pairs_impl<T>(x, w, scale, bias, k, zllm::ActPairs<T, ACT>{y, d});             \
  }
#define ZLLM_GEMV_FP8_ROPE(SUFFIX, T, C, CACHE)                                                     \
  extern "C" __global__ void __launch_bounds__(zllm::kGemvThreads) gemv_fp8_##SUFFIX##_rope_cache##CACHE( \
      T* __restrict__ y, const T* x, const unsigned char* __restrict__ w,                         \
      const float* __restrict__ scale, const T* __restrict__ bias, int k, ZLLM_ROPE_PARAMS(T, C)) { \
    zllm::gemv_fp8_pairs_impl<T>(x, w, scale, bias, k, ZLLM_ROPE_EPI(T, C));                      \
  }
#define ZLLM_GEMV_FP8_PAIRS_DTYPE(SUFFIX, T)                  \
  ZLLM_GEMV_FP8_ACT(SUFFIX, T, silu, zllm::Act::kSilu)        \
  ZLLM_GEMV_FP8_ACT(SUFFIX, T, gelu_tanh, zllm::Act::kGeluTanh) \
  ZLLM_GEMV_FP8_ROPE(SUFFIX, T, T, )                          \
  ZLLM_GEMV_FP8_ROPE(SUFFIX, T, zllm::fp8_t, _kvfp8)
ZLLM_GEMV_FP8_PAIRS_DTYPE(f32, float)
ZLLM_GEMV_FP8_PAIRS_DTYPE(f16, __half)
ZLLM_GEMV_FP8_PAIRS_DTYPE(bf16, __nv_bfloat16)

#define ZLLM_GEMV_PAIR_BOUNDS(SPLIT) \
  __launch_bounds__(zllm::PairBlock<SPLIT>::kThreads, zllm::PairBlock<SPLIT>::kMinBlocks)
#define ZLLM_GEMV_SPLIT_ACT(SUFFIX, T, SPLIT, ACT_NAME, ACT)                                        \
  extern "C" __global__ void ZLLM_GEMV_PAIR_BOUNDS(SPLIT) gemv_##SUFFIX##_s##SPLIT##_b6_##ACT_NAME##_and_mul( \
      T* __restrict__ y, const T* x, const T* __restrict__ w, const T* __restrict__ bias, int d, int k) { \
    zllm::gemv_split_pairs_impl<T, 8, SPLIT>(x, w, bias, k, zllm::ActPairs<T, ACT>{y, d});        \
  }
#define ZLLM_GEMV_SPLIT_ROPE(SUFFIX, T, SPLIT, C, CACHE)                                            \
  extern "C" __global__ void ZLLM_GEMV_PAIR_BOUNDS(SPLIT) gemv_##SUFFIX##_s##SPLIT##_b6_rope_cache##CACHE( \
      T* __restrict__ y, const T* x, const T* __restrict__ w, const T* __restrict__ bias, int k,  \
      ZLLM_ROPE_PARAMS(T, C)) {                                                                   \
    zllm::gemv_split_pairs_impl<T, 8, SPLIT>(x, w, bias, k, ZLLM_ROPE_EPI(T, C));                 \
  }
#define ZLLM_GEMV_SPLIT_PAIRS(SUFFIX, T, SPLIT)                         \
  ZLLM_GEMV_SPLIT_ACT(SUFFIX, T, SPLIT, silu, zllm::Act::kSilu)         \
  ZLLM_GEMV_SPLIT_ACT(SUFFIX, T, SPLIT, gelu_tanh, zllm::Act::kGeluTanh) \
  ZLLM_GEMV_SPLIT_ROPE(SUFFIX, T, SPLIT, T, )                           \
  ZLLM_GEMV_SPLIT_ROPE(SUFFIX, T, SPLIT, zllm::fp8_t, _kvfp8)
#define ZLLM_GEMV_SPLIT_PAIRS_DTYPE(SUFFIX, T) \
  ZLLM_GEMV_SPLIT_PAIRS(SUFFIX, T, 1)          \
  ZLLM_GEMV_SPLIT_PAIRS(SUFFIX, T, 2)          \
  ZLLM_GEMV_SPLIT_PAIRS(SUFFIX, T, 4)
ZLLM_GEMV_SPLIT_PAIRS_DTYPE(f32, float)
ZLLM_GEMV_SPLIT_PAIRS_DTYPE(f16, __half)
ZLLM_GEMV_SPLIT_PAIRS_DTYPE(bf16, __nv_bfloat16)

// ..._norm: the same with the RMSNorm before the product carried in the launch (kNorm above),
// for 16-bit types: (..., norm_eps) after the entry point's own arguments.
#define ZLLM_NORM_PARAMS(T) float norm_eps
#define ZLLM_GEMV_SPLIT_ACT_NORM(SUFFIX, T, SPLIT, ACT_NAME, ACT)                                   \
  extern "C" __global__ void ZLLM_GEMV_PAIR_BOUNDS(SPLIT)                                         \
      gemv_##SUFFIX##_s##SPLIT##_b6_##ACT_NAME##_and_mul_norm(                                    \
          T* __restrict__ y, const T* x, const T* __restrict__ w, const T* __restrict__ bias,     \
          int d, int k, ZLLM_NORM_PARAMS(T)) {                                                    \
    zllm::gemv_split_pairs_impl<T, 8, SPLIT, true>(x, w, bias, k, zllm::ActPairs<T, ACT>{y, d},   \
                                                   norm_eps);                                     \
  }
#define ZLLM_GEMV_SPLIT_ROPE_NORM(SUFFIX, T, SPLIT, C, CACHE)                                       \
  extern "C" __global__ void ZLLM_GEMV_PAIR_BOUNDS(SPLIT)                                         \
      gemv_##SUFFIX##_s##SPLIT##_b6_rope_cache##CACHE##_norm(                                     \
          T* __restrict__ y, const T* x, const T* __restrict__ w, const T* __restrict__ bias,     \
          int k, ZLLM_ROPE_PARAMS(T, C), ZLLM_NORM_PARAMS(T)) {                                   \
    zllm::gemv_split_pairs_impl<T, 8, SPLIT, true>(x, w, bias, k, ZLLM_ROPE_EPI(T, C),            \
                                                   norm_eps);                                     \
  }
#define ZLLM_GEMV_SPLIT_PAIRS_NORM(SUFFIX, T, SPLIT)                    \
  ZLLM_GEMV_SPLIT_ACT_NORM(SUFFIX, T, SPLIT, silu, zllm::Act::kSilu)    \
  ZLLM_GEMV_SPLIT_ROPE_NORM(SUFFIX, T, SPLIT, T, )                      \
  ZLLM_GEMV_SPLIT_ROPE_NORM(SUFFIX, T, SPLIT, zllm::fp8_t, _kvfp8)
#define ZLLM_GEMV_SPLIT_PAIRS_NORM_DTYPE(SUFFIX, T) \
  ZLLM_GEMV_SPLIT_PAIRS_NORM(SUFFIX, T, 1)          \
  ZLLM_GEMV_SPLIT_PAIRS_NORM(SUFFIX, T, 2)          \
  ZLLM_GEMV_SPLIT_PAIRS_NORM(SUFFIX, T, 4)
ZLLM_GEMV_SPLIT_PAIRS_NORM_DTYPE(f16, __half)
ZLLM_GEMV_SPLIT_PAIRS_NORM_DTYPE(bf16, __nv_bfloat16)
