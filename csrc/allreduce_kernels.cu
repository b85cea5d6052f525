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
#include "lamport.cuh"

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

// ---------------------------------------------------------------------------------------------
// lamport_all_reduce (GPU tensor parallelism; ZLLM_ALLREDUCE_LAMPORT, off by default): the sum of
// every rank's tensor without a barrier. The one-shot kernel above and PyTorch's meet their peers
// at a signal-pad barrier before reading (one NVLink round trip each way, ~7 us a decode-sized
// all-reduce at tp 2); here each rank pushes its tensor into every peer's buffer and each reader
// spins on its own, local buffer until every value has arrived. A value has arrived when it is
// no longer the sentinel, negative zero, which the buffer holds wherever nothing is (writers
// store a negative zero as +0: the sum is the same number). Lamport's scheme, as TensorRT-LLM's
// one-shot all-reduce uses it. lamport_all_reduce_add_rms_norm adds the residual and the next
// RMSNorm in the same launch (all_reduce_add_rms_norm's arithmetic, without its barriers).
//
// Each rank's buffer (symmetric memory, mapped into every peer): 3 slots x world sources x
// slot_units 16-byte units. Launch n uses slot n % 3: rank r writes its units to [slot][r] of
// every rank's buffer (its own included), then reads [slot][0..world-1] of its own, sums them in
// fp32 in rank order (every rank gets the same bits) and rounds once. It then clears the slot of
// launch n - 1 back to the sentinel, over as many units as that launch used. Why three slots: a
// peer can run at most one launch ahead (launch n + 1 needs this rank's launch n + 1 data, pushed
// after this launch ends), so while this rank reads slot n % 3, peers may write slot (n + 1) % 3
// (cleared during launch n - 1), and slot (n - 1) % 3 is written by nobody until launch n + 2,
// which no peer reaches before this rank has pushed launch n + 1, after this clear. Every rank
// must launch these kernels in the same order, on one stream: two launches in flight at once on
// one rank would share the slot and the counter.
//
// Memory order: every value is its own flag, so relaxed system-scope accesses suffice
// (st/ld.volatile compile to STG/LDG.E.128.STRONG.SYS, as .relaxed.sys does); a 16-byte store
// may land one 32-bit word at a time, and every element of a unit is checked, so a half-arrived
// unit reads as pending. The clear of slot (n - 1) % 3 reaches this GPU's L2 before the kernel
// completes, and a peer's push into it (launch n + 2) follows this rank's launch n + 1 push.
//
// flags (this rank's device memory, uint32): [0] the slot of the next launch (n % 3), [1] blocks
// of the current launch done, [2 + s] units that slot s's launch used. Every block reads the slot
// first; the last block to finish advances it (and records the sizes), so a CUDA graph replays
// the kernel with no host update, and launches of different sizes and grids share the buffer. The
// slot is kept rather than n: a 32-bit n would wrap after 2^32 launches (days of serving), and
// 2^32 is not a multiple of 3, so two launches in a row would use one slot.
//
// The buffers' addresses come as kernel parameters (own, then b0..b7 by rank; the unused ones
// null), so no launch reads them from memory. A value that never arrives (a peer gone) would
// spin forever: after timeout_ns (globaltimer; 0 means never) the kernel traps, so the worker
// fails with an error instead of hanging.

namespace zllm {

// `in` is not __restrict__: it is read after pdl_wait() (common.cuh: such inputs must not be
// const __restrict__, or the compiler may load them through the non-coherent path before it).
template <typename T, int kWorld>
__device__ __forceinline__ void lamport_all_reduce_impl(T* __restrict__ out, const T* in,
                                                        const LamportBuffers<T>& buffers, unsigned* flags,
                                                        int rank, int units, i64 slot_units,
                                                        unsigned long long timeout_ns) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  pdl_launch_dependents();  // PDL (common.cuh): `in` comes from the kernel before
  pdl_wait();
  const int first = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  const int stride = static_cast<int>(gridDim.x * blockDim.x);
  const uint4* in16 = reinterpret_cast<const uint4*>(in);
  const uint4 head = first < units ? in16[first] : make_uint4(0u, 0u, 0u, 0u);  // in flight with the flags' load
  const LamportLaunch<T, kWorld> lp(buffers, flags, rank, slot_units, timeout_ns);
  if (first < units) lp.push(first, head);  // 1. to every rank
  for (int u = first + stride; u < units; u += stride) lp.push(u, in16[u]);
  const unsigned long long start = timeout_ns ? global_ns() : 0ull;
  for (int u = first; u < units; u += stride) {  // 2. every rank's, summed
    float acc[kVec];
    lp.sum(u, start, acc);
    store_floats<T, kVec>(out + static_cast<i64>(u) * kVec, acc);
  }
  lp.clear_previous(first, stride);  // 3.
  lp.finish(units);                  // 4.
}

// lamport_sum_pushed: lamport_all_reduce's second half, after a kernel that pushed this rank's
// tensor into every rank's buffer itself (a GEMV's _push build, gemv_kernels.cu): the sum of
// `units` units, in rank order, the same bits as lamport_all_reduce of the same tensors. That
// GEMV lets this launch start (PDL) only after its own pdl_wait(), so every launch before it,
// the previous Lamport launch included, has completed and the slot is current: the sums start
// at once, spinning while the GEMVs of this rank and its peers still run, with no wait for this
// rank's GEMV to complete and no read of its output. The wait comes before the first store: `out`
// may be memory the kernels before still used (the stream-ordered allocator's view), and every
// launch waits somewhere (common.cuh's chain).
template <typename T, int kWorld>
__device__ __forceinline__ void lamport_sum_pushed_impl(T* __restrict__ out, const LamportBuffers<T>& buffers,
                                                        unsigned* flags, int rank, int units, i64 slot_units,
                                                        unsigned long long timeout_ns) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  pdl_launch_dependents();
  const int first = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  const int stride = static_cast<int>(gridDim.x * blockDim.x);
  const LamportLaunch<T, kWorld> lp(buffers, flags, rank, slot_units, timeout_ns);
  const unsigned long long start = timeout_ns ? global_ns() : 0ull;
  bool waited = false;
  for (int u = first; u < units; u += stride) {
    float acc[kVec];
    lp.sum(u, start, acc);
    if (!waited) {
      pdl_wait();
      waited = true;
    }
    store_floats<T, kVec>(out + static_cast<i64>(u) * kVec, acc);
  }
  if (!waited) pdl_wait();
  // The slot is read before the wait only because the kernel before launched this one after its
  // own wait; any other kernel between them would break that. Once waited on, the slot can no
  // longer move (only this launch's last block advances it, after every block got here): a slot
  // read early that differs now was stale, and its sums (the previous launch's values) wrong.
  if (threadIdx.x == 0 && static_cast<int>(*reinterpret_cast<volatile unsigned*>(flags) % 3u) != lp.slot) __trap();
  lp.clear_previous(first, stride);
  lp.finish(units);
}

// The all-reduce of a row-parallel layer's partial output, the residual add and the next RMSNorm
// in one launch, with all_reduce_add_rms_norm's arithmetic (the same bits). One block a row (the
// norm needs the row's sum of squares), blockDim as fused_add_rms_norm_vec's for the same
// per-thread order. `partial` and `residual` come from the kernels before (read after pdl_wait).
template <typename T, int kWorld>
__device__ __forceinline__ void lamport_all_reduce_add_rms_norm_impl(
    T* __restrict__ out, T* residual, const T* __restrict__ weight, const T* partial,
    const LamportBuffers<T>& buffers, unsigned* flags, int rank, i64 slot_units, unsigned long long timeout_ns,
    float eps, int hidden, bool unit_offset) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  __shared__ float scratch[32];
  pdl_launch_dependents();
  pdl_wait();
  const int row_units = hidden / kVec;
  const int row0 = static_cast<int>(blockIdx.x) * row_units;  // the row's first unit
  const uint4* partial16 = reinterpret_cast<const uint4*>(partial);
  const int i0 = static_cast<int>(threadIdx.x);
  const uint4 head = i0 < row_units ? partial16[row0 + i0] : make_uint4(0u, 0u, 0u, 0u);
  const LamportLaunch<T, kWorld> lp(buffers, flags, rank, slot_units, timeout_ns);
  if (i0 < row_units) lp.push(row0 + i0, head);
  for (int i = i0 + blockDim.x; i < row_units; i += blockDim.x) lp.push(row0 + i, partial16[row0 + i]);

  const unsigned long long start = timeout_ns ? global_ns() : 0ull;
  T* rr = residual + static_cast<i64>(blockIdx.x) * hidden;
  float sum_sq = 0.f;
  for (int i = i0; i < row_units; i += blockDim.x) {
    float acc[kVec], r[kVec];
    lp.template sum<(kWorld > 4 ? 4 : kWorld)>(row0 + i, start, acc);
    load_floats<T, kVec>(rr + i * kVec, r);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      r[e] = round_to<T>(r[e] + round_to<T>(acc[e]));  // the all-reduced x, then the stored residual
      sum_sq += r[e] * r[e];
    }
    store_floats<T, kVec>(rr + i * kVec, r);
  }
  sum_sq = block_sum(sum_sq, scratch);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(hidden) + eps);
  T* orow = out + static_cast<i64>(blockIdx.x) * hidden;
  for (int i = i0; i < row_units; i += blockDim.x) {
    float r[kVec], w[kVec];
    load_floats<T, kVec>(rr + i * kVec, r);
    load_floats<T, kVec>(weight + i * kVec, w);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      r[e] = unit_offset ? (r[e] * inv_rms) * (1.f + w[e]) : w[e] * round_to<T>(r[e] * inv_rms);
    }
    store_floats<T, kVec>(orow + i * kVec, r);
  }
  lp.clear_previous(static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x), static_cast<int>(gridDim.x * blockDim.x));
  lp.finish(static_cast<int>(gridDim.x) * row_units);
}

}  // namespace zllm

#define ZLLM_LAMPORT_ALL_REDUCE(NAME, T, WORLD)                                                    \
  extern "C" __global__ void __launch_bounds__(256)                                              \
      NAME(T* __restrict__ out, const T* in, ZLLM_LAMPORT_BUFFER_PARAMS(T), unsigned* flags,      \
           int rank, int units, long long slot_units, unsigned long long timeout_ns) {            \
    ZLLM_LAMPORT_BUFFERS(T);                                                                     \
    zllm::lamport_all_reduce_impl<T, WORLD>(out, in, buffers, flags, rank, units, slot_units,     \
                                            timeout_ns);                                         \
  }

#define ZLLM_LAMPORT_ALL_REDUCE_ADD_RMS_NORM(NAME, T, WORLD)                                       \
  extern "C" __global__ void __launch_bounds__(1024)                                             \
      NAME(T* __restrict__ out, T* residual, const T* __restrict__ weight, const T* partial,      \
           ZLLM_LAMPORT_BUFFER_PARAMS(T), unsigned* flags, int rank, long long slot_units,        \
           unsigned long long timeout_ns, float eps, int hidden, int unit_offset) {               \
    ZLLM_LAMPORT_BUFFERS(T);                                                                     \
    zllm::lamport_all_reduce_add_rms_norm_impl<T, WORLD>(out, residual, weight, partial, buffers, \
                                                         flags, rank, slot_units, timeout_ns,    \
                                                         eps, hidden, unit_offset != 0);         \
  }

#define ZLLM_LAMPORT_SUM_PUSHED(NAME, T, WORLD)                                                    \
  extern "C" __global__ void __launch_bounds__(256)                                              \
      NAME(T* __restrict__ out, ZLLM_LAMPORT_BUFFER_PARAMS(T), unsigned* flags, int rank,         \
           int units, long long slot_units, unsigned long long timeout_ns) {                      \
    ZLLM_LAMPORT_BUFFERS(T);                                                                     \
    zllm::lamport_sum_pushed_impl<T, WORLD>(out, buffers, flags, rank, units, slot_units,         \
                                            timeout_ns);                                         \
  }

ZLLM_LAMPORT_ALL_REDUCE(lamport_all_reduce_f32_w2, float, 2)
ZLLM_LAMPORT_ALL_REDUCE(lamport_all_reduce_f32_w4, float, 4)
ZLLM_LAMPORT_ALL_REDUCE(lamport_all_reduce_f32_w8, float, 8)
ZLLM_LAMPORT_ALL_REDUCE(lamport_all_reduce_bf16_w2, __nv_bfloat16, 2)
ZLLM_LAMPORT_ALL_REDUCE(lamport_all_reduce_bf16_w4, __nv_bfloat16, 4)
ZLLM_LAMPORT_ALL_REDUCE(lamport_all_reduce_bf16_w8, __nv_bfloat16, 8)
ZLLM_LAMPORT_ALL_REDUCE_ADD_RMS_NORM(lamport_all_reduce_add_rms_norm_f32_w2, float, 2)
ZLLM_LAMPORT_ALL_REDUCE_ADD_RMS_NORM(lamport_all_reduce_add_rms_norm_f32_w4, float, 4)
ZLLM_LAMPORT_ALL_REDUCE_ADD_RMS_NORM(lamport_all_reduce_add_rms_norm_f32_w8, float, 8)
ZLLM_LAMPORT_ALL_REDUCE_ADD_RMS_NORM(lamport_all_reduce_add_rms_norm_bf16_w2, __nv_bfloat16, 2)
ZLLM_LAMPORT_ALL_REDUCE_ADD_RMS_NORM(lamport_all_reduce_add_rms_norm_bf16_w4, __nv_bfloat16, 4)
ZLLM_LAMPORT_ALL_REDUCE_ADD_RMS_NORM(lamport_all_reduce_add_rms_norm_bf16_w8, __nv_bfloat16, 8)
// bf16 only: the _push GEMV builds (bf16: the Lamport kernels' one 16-bit type) are its producers.
ZLLM_LAMPORT_SUM_PUSHED(lamport_sum_pushed_bf16_w2, __nv_bfloat16, 2)
ZLLM_LAMPORT_SUM_PUSHED(lamport_sum_pushed_bf16_w4, __nv_bfloat16, 4)
ZLLM_LAMPORT_SUM_PUSHED(lamport_sum_pushed_bf16_w8, __nv_bfloat16, 8)
