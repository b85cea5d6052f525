// all_reduce_add_rms_norm (GPU tensor parallelism, decode; ZLLM_ALLREDUCE_NORM, off by default):
// the all-reduce of a row-parallel layer's partial output, the residual add and the next RMSNorm
// in one launch, where the decode step otherwise runs the symmetric-memory one-shot all-reduce
// and then fused_add_rms_norm:
//   x = to_T(sum over ranks 0..world-1 of partial_r, in fp32, in rank order)
//   residual = to_T(residual + x);  out = rms_norm(residual)        (fused_add_rms_norm's bits)
// Every rank sums the same values in the same order, so every rank gets the same bits.
//
// Operands: each rank's symmetric buffer (torch.distributed._symmetric_memory, one allocation
// mapped into every peer over NVLink; `buffers` holds the world's addresses of it, a device
// array of world pointers) and its signal pad (`pads`: the world's signal pads, uint32 words).
// `partial` [rows, hidden] is copied into this rank's buffer first (rows at the buffer's start);
// when it already is the buffer (a GEMV that wrote there), the copy is skipped.
//
// Grid: one block per row (rows <= the pad region's capacity, checked by the host); blockDim a
// multiple of 32 (<= 1024), each thread striding over 16-byte units as fused_add_rms_norm_vec
// does (the same blockDim and per-thread order, so the same sum of squares).
//
// Barrier (per block, between the blocks of the same row on every rank; PyTorch's
// sync_remote_blocks protocol): block b of rank r owns slot pad_base + b * world + p in its pad
// for each peer p. "Put" = CAS 0 -> 1 on the peer's slot for us (release, system scope; it spins
// while the peer has not yet taken the previous put); "take" = CAS 1 -> 0 on our slot for the
// peer (acquire, system scope; spins until the peer has put). Each put is matched by exactly one
// take, so after every launch all slots are 0 again: a CUDA graph can replay the launch any number
// of times with no reset from the host, and launches of different row counts share the slots.
//   1. copy the partial row into our buffer; __syncthreads; put to and take from every peer
//      (start barrier: every peer's row is in its buffer and visible); __syncthreads
//   2. read every peer's row (ld.global.cv: never a stale L1 line of an earlier replay), sum in
//      rank order, add the residual, store it; __syncthreads; put to every peer ("done reading
//      your buffer")
//   3. the norm; then take from every peer (end barrier, split so that the norm overlaps its
//      wait): no rank leaves the launch, and so overwrites its buffer in the next one, while a
//      peer still reads it.
// The signalling threads also fence at system scope around the atomics (belt and braces over
// the release/acquire CAS, as the peers' rows are written by other threads of the block).
#include "common.cuh"

namespace zllm {

__device__ __forceinline__ void put_flag(unsigned* slot) {
  unsigned old;
  do {
    asm volatile("atom.release.sys.global.cas.b32 %0, [%1], 0, 1;" : "=r"(old) : "l"(slot) : "memory");
  } while (old != 0u);
}

__device__ __forceinline__ void take_flag(unsigned* slot) {
  unsigned old;
  do {
    asm volatile("atom.acquire.sys.global.cas.b32 %0, [%1], 1, 0;" : "=r"(old) : "l"(slot) : "memory");
  } while (old != 1u);
}

// 16 bytes of a peer's buffer, fetched again from memory (ld.global.cv), never from L1.
__device__ __forceinline__ uint4 load_peer(const void* p) {
  return __ldcv(reinterpret_cast<const uint4*>(p));
}

template <typename T, int kVec, int kWorld>
__device__ __forceinline__ void all_reduce_add_rms_norm_impl(
    T* __restrict__ out, T* residual, const T* __restrict__ weight, const T* partial,
    T* const* buffers, unsigned* const* pads, int rank, int pad_base, float eps, int hidden,
    bool unit_offset) {
  static_assert(kVec * sizeof(T) == 16, "16-byte units");
  __shared__ float scratch[32];
  const i64 row = static_cast<i64>(blockIdx.x) * hidden;
  const int units = hidden / kVec;
  const int peer = threadIdx.x;  // the peer a signalling thread (threadIdx.x < kWorld) talks to
  const int mine = pad_base + static_cast<int>(blockIdx.x) * kWorld;  // this block's slots
  pdl_launch_dependents();  // PDL (common.cuh): partial and residual come from the kernels before
  pdl_wait();

  // 1. our partial row into our buffer, then the start barrier.
  T* own = buffers[rank] + row;
  if (partial + row != own) {
    for (int i = threadIdx.x; i < units; i += blockDim.x) {
      *reinterpret_cast<uint4*>(own + i * kVec) = *reinterpret_cast<const uint4*>(partial + row + i * kVec);
    }
  }
  __syncthreads();
  if (peer < kWorld) {
    __threadfence_system();
    put_flag(pads[peer] + mine + rank);
    take_flag(pads[rank] + mine + peer);
    __threadfence_system();
  }
  __syncthreads();

  // 2. the sum in rank order, the residual add.
  T* rr = residual + row;
  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < units; i += blockDim.x) {
    uint4 raw[kWorld];
#pragma unroll
    for (int p = 0; p < kWorld; ++p) raw[p] = load_peer(buffers[p] + row + i * kVec);
    float acc[kVec], v[kVec], r[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
#pragma unroll
    for (int p = 0; p < kWorld; ++p) {
      unpack<T>(raw[p], v);
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] += v[e];
    }
    load_floats<T, kVec>(rr + i * kVec, r);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      r[e] = round_to<T>(r[e] + round_to<T>(acc[e]));  // the all-reduced x, then the stored residual
      sum_sq += r[e] * r[e];
    }
    store_floats<T, kVec>(rr + i * kVec, r);
  }
  __syncthreads();  // every thread of the block is done reading the peers' buffers
  if (peer < kWorld) {
    __threadfence_system();
    put_flag(pads[peer] + mine + rank);
  }

  // 3. the norm (fused_add_rms_norm's second pass), then the end barrier's wait.
  sum_sq = block_sum(sum_sq, scratch);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(hidden) + eps);
  for (int i = threadIdx.x; i < units; i += blockDim.x) {
    float r[kVec], w[kVec];
    load_floats<T, kVec>(rr + i * kVec, r);
    load_floats<T, kVec>(weight + i * kVec, w);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      r[e] = unit_offset ? (r[e] * inv_rms) * (1.f + w[e]) : w[e] * round_to<T>(r[e] * inv_rms);
    }
    store_floats<T, kVec>(out + row + i * kVec, r);
  }
  if (peer < kWorld) take_flag(pads[rank] + mine + peer);
}

}  // namespace zllm

#define ZLLM_ALL_REDUCE_ADD_RMS_NORM(NAME, T, VEC, WORLD)                                          \
  extern "C" __global__ void __launch_bounds__(1024)                                             \
      NAME(T* __restrict__ out, T* residual, const T* __restrict__ weight, const T* partial,      \
           T* const* buffers, unsigned* const* pads, int rank, int pad_base, float eps,           \
           int hidden, int unit_offset) {                                                        \
    zllm::all_reduce_add_rms_norm_impl<T, VEC, WORLD>(out, residual, weight, partial, buffers,   \
                                                      pads, rank, pad_base, eps, hidden,         \
                                                      unit_offset != 0);                         \
  }

ZLLM_ALL_REDUCE_ADD_RMS_NORM(all_reduce_add_rms_norm_f32_w2, float, 4, 2)
ZLLM_ALL_REDUCE_ADD_RMS_NORM(all_reduce_add_rms_norm_f32_w4, float, 4, 4)
ZLLM_ALL_REDUCE_ADD_RMS_NORM(all_reduce_add_rms_norm_f32_w8, float, 4, 8)
ZLLM_ALL_REDUCE_ADD_RMS_NORM(all_reduce_add_rms_norm_bf16_w2, __nv_bfloat16, 8, 2)
ZLLM_ALL_REDUCE_ADD_RMS_NORM(all_reduce_add_rms_norm_bf16_w4, __nv_bfloat16, 8, 4)
ZLLM_ALL_REDUCE_ADD_RMS_NORM(all_reduce_add_rms_norm_bf16_w8, __nv_bfloat16, 8, 8)
