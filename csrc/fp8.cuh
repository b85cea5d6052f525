// FP8 E4M3 helpers shared by the kernels that store or read FP8 values (the FP8 KV cache, the
// activation quantization): conversions, and Word<fp8_t> so that common.cuh's unpack/load_floats
// read four E4M3 bytes per 32-bit word like any other element type.
#pragma once

#include <cuda_fp8.h>

#include "common.cuh"

namespace zllm {

typedef __nv_fp8_storage_t fp8_t;  // one E4M3 byte

// Round to nearest even, saturating to +-448 (torch's clamp-then-cast; NaN stays NaN).
__device__ __forceinline__ fp8_t to_e4m3(float v) { return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }

// Two E4M3 bytes (element 0 in the low byte) as floats: exact (every E4M3 value is a half).
__device__ __forceinline__ float2 e4m3x2_to_float2(unsigned pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

template <>
struct Word<fp8_t> {
  static constexpr int kPerWord = 4;
  static __device__ __forceinline__ void unpack(unsigned w, float* f) {
    const float2 lo = e4m3x2_to_float2(w);
    const float2 hi = e4m3x2_to_float2(w >> 16);
    f[0] = lo.x;
    f[1] = lo.y;
    f[2] = hi.x;
    f[3] = hi.y;
  }
  static __device__ __forceinline__ unsigned pack(const float* f) {
    return static_cast<unsigned>(to_e4m3(f[0])) | (static_cast<unsigned>(to_e4m3(f[1])) << 8) |
           (static_cast<unsigned>(to_e4m3(f[2])) << 16) | (static_cast<unsigned>(to_e4m3(f[3])) << 24);
  }
};

// Two E4M3 bytes in a 16-bit load (a lane's slice of a 64-wide value row).
template <typename T>
__device__ __forceinline__ void unpack(unsigned short u, float* f) {
  static_assert(sizeof(T) == 1, "16-bit raw loads carry FP8 pairs only");
  const float2 v = e4m3x2_to_float2(u);
  f[0] = v.x;
  f[1] = v.y;
}

}  // namespace zllm
