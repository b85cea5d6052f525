// reshape_and_cache: store new keys and values into one layer's paged KV cache.
//
//   key, value  [T, KVH, D]   token rows may be strided (views of the fused qkv output); the
//                             KVH * D elements of one token are contiguous
//   kv_cache    [2, num_blocks, block_size, KVH, D]   contiguous; index 0 keys, 1 values
//   slot_mapping [T] int64    slot = block * block_size + offset; negative: padding, skipped
//
// Grid: one block per token. Each thread copies 16-byte units (the _vec entry points, when the
// row size, strides and pointers allow) or single elements.
#include "common.cuh"

namespace zllm {

template <int kBytes>
struct Unit;
template <>
struct Unit<2> {
  typedef unsigned short type;
};
template <>
struct Unit<4> {
  typedef unsigned type;
};
template <>
struct Unit<16> {
  typedef uint4 type;
};

// The copy is dtype-blind: T only fixes the unit when kVec16 is false.
template <typename T, bool kVec16>
__device__ __forceinline__ void reshape_and_cache_impl(
    const T* __restrict__ key, const T* __restrict__ value, T* __restrict__ k_cache,
    T* __restrict__ v_cache, const i64* __restrict__ slot_mapping, i64 key_stride,
    i64 value_stride, int row_elems, i64 num_slots) {
  typedef typename Unit<kVec16 ? 16 : static_cast<int>(sizeof(T))>::type U;
  constexpr int kElemsPerUnit = kVec16 ? 16 / static_cast<int>(sizeof(T)) : 1;

  const i64 token = blockIdx.x;
  const i64 slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;  // padding (or a bad slot: never write outside)

  const int units = row_elems / kElemsPerUnit;
  const U* k_src = reinterpret_cast<const U*>(key + token * key_stride);
  const U* v_src = reinterpret_cast<const U*>(value + token * value_stride);
  U* k_dst = reinterpret_cast<U*>(k_cache + slot * row_elems);
  U* v_dst = reinterpret_cast<U*>(v_cache + slot * row_elems);
  for (int i = threadIdx.x; i < units; i += blockDim.x) {
    k_dst[i] = k_src[i];
    v_dst[i] = v_src[i];
  }
}

}  // namespace zllm

#define ZLLM_RESHAPE_AND_CACHE(NAME, T, VEC16)                                                    \
  extern "C" __global__ void NAME(const T* __restrict__ key, const T* __restrict__ value,       \
                                  T* __restrict__ k_cache, T* __restrict__ v_cache,             \
                                  const long long* __restrict__ slot_mapping,                   \
                                  long long key_stride, long long value_stride, int row_elems,  \
                                  long long num_slots) {                                        \
    zllm::reshape_and_cache_impl<T, VEC16>(key, value, k_cache, v_cache, slot_mapping,         \
                                           key_stride, value_stride, row_elems, num_slots);    \
  }

ZLLM_RESHAPE_AND_CACHE(reshape_and_cache_f32, float, false)
ZLLM_RESHAPE_AND_CACHE(reshape_and_cache_f16, __half, false)
ZLLM_RESHAPE_AND_CACHE(reshape_and_cache_bf16, __nv_bfloat16, false)
ZLLM_RESHAPE_AND_CACHE(reshape_and_cache_f32_vec, float, true)
ZLLM_RESHAPE_AND_CACHE(reshape_and_cache_f16_vec, __half, true)
ZLLM_RESHAPE_AND_CACHE(reshape_and_cache_bf16_vec, __nv_bfloat16, true)
