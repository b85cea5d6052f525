// The Lamport protocol's device side (csrc/allreduce_kernels.cu describes it): the world's
// buffers as kernel parameters, the sentinel, and one launch's view of its slot. Shared by the
// all-reduce kernels and the GEMV whose epilogue pushes its rows into the buffers
// (gemv_kernels.cu, the _push builds).
#pragma once

#include "common.cuh"

namespace zllm {

template <typename T>
__device__ __forceinline__ unsigned sentinel_word() {
  return sizeof(T) == 4 ? 0x80000000u : 0x80008000u;  // negative zero in every element
}

// Whether any element of the unit still holds the sentinel.
template <typename T>
__device__ __forceinline__ bool unit_pending(uint4 v) {
  if constexpr (sizeof(T) == 4) {
    return v.x == 0x80000000u || v.y == 0x80000000u || v.z == 0x80000000u || v.w == 0x80000000u;
  } else {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
    bool pending = false;
#pragma unroll
    for (int i = 0; i < 4; ++i) pending |= (w[i] & 0xffffu) == 0x8000u || (w[i] >> 16) == 0x8000u;
    return pending;
  }
}

// The unit with every negative zero made positive, so no real value reads as the sentinel.
template <typename T>
__device__ __forceinline__ unsigned positive_zero_word(unsigned w) {
  if constexpr (sizeof(T) == 4) {
    return w == 0x80000000u ? 0u : w;
  } else {
    const unsigned lo = (w & 0xffffu) == 0x8000u ? 0u : (w & 0xffffu);
    const unsigned hi = (w >> 16) == 0x8000u ? 0u : (w >> 16);
    return lo | (hi << 16);
  }
}

template <typename T>
__device__ __forceinline__ uint4 positive_zeros(uint4 v) {
  return make_uint4(positive_zero_word<T>(v.x), positive_zero_word<T>(v.y), positive_zero_word<T>(v.z),
                    positive_zero_word<T>(v.w));
}

// 16 bytes read from memory every time (never from L1, never hoisted out of the spin loop).
__device__ __forceinline__ uint4 load_volatile16(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ void store_volatile16(uint4* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The world's buffers, by rank, as kernel parameters.
template <typename T>
struct LamportBuffers {
  T* own;
  T* peer[8];
};

// One element of a tensor, stored with st.volatile as the 16-byte units are (a pushed value is its
// own flag), negative zero stored as +0 (the sentinel is never a value).
__device__ __forceinline__ void store_volatile_element(__nv_bfloat16* p, __nv_bfloat16 v) {
  unsigned short bits = __bfloat16_as_ushort(v);
  bits = bits == 0x8000u ? 0u : bits;
  asm volatile("st.volatile.global.b16 [%0], %1;" ::"l"(p), "h"(bits) : "memory");
}

__device__ __forceinline__ void store_volatile_element(float* p, float v) {
  unsigned bits = __float_as_uint(v);
  bits = bits == 0x80000000u ? 0u : bits;
  asm volatile("st.volatile.global.b32 [%0], %1;" ::"l"(p), "r"(bits) : "memory");
}

// The producer's side of a pushed all-reduce (gemv_kernels.cu's _push builds): a kernel that
// computes this rank's tensor stores each element of it straight into every rank's buffer, at
// the slot of the Lamport launch that sums it (lamport_sum_pushed, launched next), instead of
// storing the tensor for an all-reduce to read back and push. Read the slot after pdl_wait():
// the Lamport launch before advanced it.
template <typename T, int kWorld>
struct LamportPush {
  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  LamportBuffers<T> buffers;
  unsigned* flags;
  int rank;
  i64 slot_units;

  __device__ __forceinline__ int slot() const {
    return static_cast<int>(*reinterpret_cast<volatile unsigned*>(flags) % 3u);
  }

  // Element e of this rank's tensor (value) into slot s of every rank's buffer.
  __device__ __forceinline__ void element(int s, i64 e, T value) const {
    const i64 at = (static_cast<i64>(s) * kWorld + rank) * slot_units * kVec + e;
#pragma unroll
    for (int p = 0; p < kWorld; ++p) store_volatile_element(buffers.peer[p] + at, value);
  }
};

// One launch's view of the Lamport protocol: which slot it uses, which it clears and how much.
template <typename T, int kWorld>
struct LamportLaunch {
  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const LamportBuffers<T>& buffers;
  unsigned* flags;
  int rank;
  i64 slot_units;
  unsigned long long timeout_ns;
  int slot, prev, prev_units;

  // Call after pdl_wait(): the slot and the sizes are the previous launch's to write (or, as
  // lamport_sum_pushed does, where the kernel before launched this one only after its own wait).
  __device__ __forceinline__ LamportLaunch(const LamportBuffers<T>& buffers_, unsigned* flags_, int rank_,
                                           i64 slot_units_, unsigned long long timeout_ns_)
      : buffers(buffers_), flags(flags_), rank(rank_), slot_units(slot_units_), timeout_ns(timeout_ns_) {
    slot = static_cast<int>(*reinterpret_cast<volatile unsigned*>(flags) % 3u);  // 0, 1 or 2 (the modulo: never out of range)
    prev = (slot + 2) % 3;
    prev_units = static_cast<int>(reinterpret_cast<volatile unsigned*>(flags)[2 + prev]);
  }

  // Unit u of source `src` in slot s of a rank's buffer.
  __device__ __forceinline__ uint4* at(T* base, int s, int src, i64 u) const {
    return reinterpret_cast<uint4*>(base) + (static_cast<i64>(s) * kWorld + src) * slot_units + u;
  }

  // This rank's unit u (16 bytes of its tensor) into every rank's buffer.
  __device__ __forceinline__ void push(int u, uint4 v) const {
    v = positive_zeros<T>(v);
#pragma unroll
    for (int p = 0; p < kWorld; ++p) store_volatile16(at(buffers.peer[p], slot, rank, u), v);
  }

  // Unit u summed over the ranks in rank order (fp32), once every rank's has arrived here. Each
  // pass issues kGroup ranks' loads together (one L2 round trip) and then checks them; a group
  // that has all arrived is added before the next one is read. kGroup < kWorld only where the
  // whole world's units would not fit the registers (the fused kernel's 1024 threads at tp 8).
  template <int kGroup = kWorld>
  __device__ __forceinline__ void sum(int u, unsigned long long start, float (&acc)[kVec]) const {
    static_assert(kWorld % kGroup == 0, "whole groups of ranks");
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
#pragma unroll
    for (int g = 0; g < kWorld; g += kGroup) {
      uint4 v[kGroup];
      for (;;) {
#pragma unroll
        for (int p = 0; p < kGroup; ++p) v[p] = load_volatile16(at(buffers.own, slot, g + p, u));
        bool pending = false;
#pragma unroll
        for (int p = 0; p < kGroup; ++p) pending |= unit_pending<T>(v[p]);
        if (!pending) break;
        if (timeout_ns && global_ns() - start > timeout_ns) __trap();  // a peer never wrote: fail, don't hang
      }
      float f[kVec];
#pragma unroll
      for (int p = 0; p < kGroup; ++p) {
        unpack<T>(v[p], f);
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] += f[e];
      }
    }
  }

  // The previous launch's slot back to the sentinel (every source, the units it used), spread
  // over the grid's threads.
  __device__ __forceinline__ void clear_previous(int first, int stride) const {
    const uint4 empty = make_uint4(sentinel_word<T>(), sentinel_word<T>(), sentinel_word<T>(), sentinel_word<T>());
#pragma unroll
    for (int src = 0; src < kWorld; ++src) {
      for (int u = first; u < prev_units; u += stride) store_volatile16(at(buffers.own, prev, src, u), empty);
    }
  }

  // The last block to finish advances the slot (every block has read it by then) and records
  // this launch's units for the next one to clear. The next launch reads them after this grid
  // completed, so no fence is needed here.
  __device__ __forceinline__ void finish(int units) const {
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(flags + 1, 1u) == gridDim.x - 1) {
      volatile unsigned* f = flags;
      f[2 + slot] = static_cast<unsigned>(units);
      f[2 + prev] = 0u;
      f[1] = 0u;
      f[0] = static_cast<unsigned>((slot + 1) % 3);
    }
  }
};

}  // namespace zllm

#define ZLLM_LAMPORT_BUFFER_PARAMS(T) T *own, T *b0, T *b1, T *b2, T *b3, T *b4, T *b5, T *b6, T *b7
#define ZLLM_LAMPORT_BUFFERS(T) \
  const zllm::LamportBuffers<T> buffers { own, { b0, b1, b2, b3, b4, b5, b6, b7 } }
