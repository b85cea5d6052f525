// Shared device helpers for zllm's kernels: dtype conversion, vector loads/stores, reductions.
//
// Kept NVRTC-compatible (the loader compiles the .cu files at run time when no cubin fits the
// device): device code only, no host code, no STL, and no headers besides cuda_fp16.h and
// cuda_bf16.h. The loader inlines this file into each .cu before handing it to NVRTC.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace zllm {

typedef long long i64;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

// ---- programmatic dependent launch (sm_90+) ----------------------------------------------------
// Launched with the PDL attribute (zllm/workers/kernels/loader.py, ZLLM_PDL=1), a kernel may start
// while the kernel before it in the stream still runs. pdl_wait() blocks until that whole grid has
// completed and its memory is visible to this grid, so a kernel reads nothing the previous one
// wrote, and writes nothing at all, before it: only its weights (read-only during the step) may
// be loaded earlier. pdl_launch_dependents() lets the next kernel launch once every block of this
// one has issued it (or exited): a hint, since the next kernel waits anyway. Every kernel that
// loader.launch(..., pdl=True) starts calls pdl_wait() in at least one thread of the grid before
// the grid ends, so "the previous grid completed" stays transitive down the chain. Both are
// no-ops without the attribute and compile to nothing before sm_90. The "memory" clobber keeps
// the compiler from moving loads of the previous kernel's output above the wait, but only for
// pointers it must assume the asm may write: what a kernel reads after the wait is never
// `const __restrict__` nor read by __ldg (both promise the data read-only for the kernel's whole
// life, and licence hoisting the load above the wait: CCCL's review rule
// correctness.pdl-restrict-aliasing), only its weights are.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kPdlArch = true;  // whether pdl_wait() does anything: kernels load ahead of it only then
#else
constexpr bool kPdlArch = false;
#endif

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// pdl_wait(), then a zero the compiler cannot know: a kernel whose inputs are `const __restrict__`
// (promised read-only for the kernel's life, so loads through them may be hoisted) adds it to each
// pointer the kernel before wrote, and every load through those then depends on a value the asm
// produced after the wait (volatile asms keep their order). One register, where laundering each
// 64-bit pointer would hold two apiece (the decode attention then spills at its 128-register cap).
__device__ __forceinline__ int pdl_wait_zero() {
  pdl_wait();
  int zero = 0;
  asm volatile("" : "+r"(zero)::"memory");
  return zero;
}

// ---- scalar conversions: every kernel computes in fp32 ---------------------------------------

template <typename T>
struct Cvt;

template <>
struct Cvt<float> {
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float from_float(float x) { return x; }
};

template <>
struct Cvt<__half> {
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <>
struct Cvt<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return Cvt<T>::to_float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  return Cvt<T>::from_float(x);
}

// x rounded to T and back: reproduces the reference's intermediate casts.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float<T>(from_float<T>(x));
}

// ---- 32-bit words <-> floats (element 0 sits in the low bits: little endian) ------------------

template <typename T>
struct Word;

template <>
struct Word<float> {
  static constexpr int kPerWord = 1;
  static __device__ __forceinline__ void unpack(unsigned w, float* f) { f[0] = __uint_as_float(w); }
  static __device__ __forceinline__ unsigned pack(const float* f) { return __float_as_uint(f[0]); }
};

template <>
struct Word<__half> {
  static constexpr int kPerWord = 2;
  static __device__ __forceinline__ void unpack(unsigned w, float* f) {
    f[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
    f[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
  static __device__ __forceinline__ unsigned pack(const float* f) {
    unsigned lo = __half_as_ushort(__float2half_rn(f[0]));
    unsigned hi = __half_as_ushort(__float2half_rn(f[1]));
    return lo | (hi << 16);
  }
};

template <>
struct Word<__nv_bfloat16> {
  static constexpr int kPerWord = 2;
  static __device__ __forceinline__ void unpack(unsigned w, float* f) {
    f[0] = __uint_as_float(w << 16);  // a bf16 is the top half of an fp32
    f[1] = __uint_as_float(w & 0xffff0000u);
  }
  static __device__ __forceinline__ unsigned pack(const float* f) {
    unsigned lo = __bfloat16_as_ushort(__float2bfloat16_rn(f[0]));
    unsigned hi = __bfloat16_as_ushort(__float2bfloat16_rn(f[1]));
    return lo | (hi << 16);
  }
};

// Raw loads: 4, 8 or 16 bytes as one access, unpacked to floats only where they are used (keeps
// register pressure down while several loads are in flight).
template <int kBytes>
struct Raw;
template <>
struct Raw<2> {
  typedef unsigned short type;
};
template <>
struct Raw<4> {
  typedef unsigned type;
};
template <>
struct Raw<8> {
  typedef uint2 type;
};
template <>
struct Raw<16> {
  typedef uint4 type;
};

template <typename T>
__device__ __forceinline__ void unpack(unsigned u, float* f) {
  Word<T>::unpack(u, f);
}
template <typename T>
__device__ __forceinline__ void unpack(uint2 u, float* f) {
  Word<T>::unpack(u.x, f);
  Word<T>::unpack(u.y, f + Word<T>::kPerWord);
}
template <typename T>
__device__ __forceinline__ void unpack(uint4 u, float* f) {
  Word<T>::unpack(u.x, f);
  Word<T>::unpack(u.y, f + Word<T>::kPerWord);
  Word<T>::unpack(u.z, f + 2 * Word<T>::kPerWord);
  Word<T>::unpack(u.w, f + 3 * Word<T>::kPerWord);
}

// Load N consecutive elements of T as floats. The address must be aligned to the access width:
// N * sizeof(T) bytes when that is 4, 8 or a multiple of 16 (callers guarantee it); other sizes
// fall back to element loads.
template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[N]) {
  constexpr int kBytes = N * static_cast<int>(sizeof(T));
  if constexpr (kBytes % 16 == 0) {
    const uint4* v = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) unpack<T>(v[i], out + i * (16 / static_cast<int>(sizeof(T))));
  } else if constexpr (kBytes == 8 || kBytes == 4) {
    unpack<T>(*reinterpret_cast<const typename Raw<kBytes>::type*>(p), out);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float<T>(p[i]);
  }
}

// Store N floats as consecutive elements of T (rounded to nearest even); alignment as above.
template <typename T, int N>
__device__ __forceinline__ void store_floats(T* p, const float (&in)[N]) {
  constexpr int kBytes = N * static_cast<int>(sizeof(T));
  constexpr int kPer = Word<T>::kPerWord;
  if constexpr (kBytes % 16 == 0) {
    uint4* v = reinterpret_cast<uint4*>(p);
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      uint4 u;
      u.x = Word<T>::pack(in + (4 * i + 0) * kPer);
      u.y = Word<T>::pack(in + (4 * i + 1) * kPer);
      u.z = Word<T>::pack(in + (4 * i + 2) * kPer);
      u.w = Word<T>::pack(in + (4 * i + 3) * kPer);
      v[i] = u;
    }
  } else if constexpr (kBytes == 8) {
    uint2 u;
    u.x = Word<T>::pack(in);
    u.y = Word<T>::pack(in + kPer);
    *reinterpret_cast<uint2*>(p) = u;
  } else if constexpr (kBytes == 4) {
    *reinterpret_cast<unsigned*>(p) = Word<T>::pack(in);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = from_float<T>(in[i]);
  }
}

// The dot product of two 16-byte runs of T (8 fp16/bf16 or 4 fp32), in fp32.
template <typename T>
__device__ __forceinline__ float dot16(uint4 wv, uint4 xv) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  float wf[kVec], xf[kVec];
  unpack<T>(wv, wf);
  unpack<T>(xv, xf);
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < kVec; ++e) s = fmaf(wf[e], xf[e], s);
  return s;
}

// ---- reductions -------------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block, returned to every thread. blockDim.x must be a multiple of 32 (at most
// 1024); `scratch` holds 32 floats of shared memory, free again when this returns.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : 0.f;
  v = warp_sum(v);
  __syncthreads();
  return v;
}

// Maximum over the block, returned to every thread; same contract as block_sum.
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  v = warp_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : neg_inf();
  v = warp_max(v);
  __syncthreads();
  return v;
}

// ---- a LoRA shrink fused into the kernel that produces its input (decode, one row a block) ----
// t[c] = row . a[c] over the row's units, for the kCols shrink columns a block owns (a: kCols rows
// of `width` values). The row is rounded to T first: lora_shrink reads the row as it is stored.

template <typename T, int kVec, int kCols>
__device__ __forceinline__ void shrink_accumulate(float (&row)[kVec], const T* a, int width, int i, float (&acc)[kCols]) {
#pragma unroll
  for (int e = 0; e < kVec; ++e) row[e] = round_to<T>(row[e]);
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    float av[kVec];
    load_floats<T, kVec>(a + static_cast<i64>(c) * width + i * kVec, av);
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[c] = fmaf(row[e], av[e], acc[c]);
  }
}

// The block's partial sums into t's kCols values (zeros for a row without an adapter: shrinks false).
template <int kCols>
__device__ __forceinline__ void shrink_store(const float (&acc)[kCols], bool shrinks, float (*partial)[kCols], float* t) {
  if (!shrinks) {  // block 0 of a row of the base model
    if (threadIdx.x < kCols) t[threadIdx.x] = 0.f;
    return;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const float s = warp_sum(acc[c]);
    if (lane == 0) partial[warp][c] = s;
  }
  __syncthreads();
  if (threadIdx.x < kCols) {
    float s = 0.f;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) s += partial[w][threadIdx.x];
    t[threadIdx.x] = s;
  }
}

// ---- gated activations (activation_kernels.cu; gemv_kernels.cu's fused gate_up epilogue) ------------
// One definition for both, so the fused launch computes each bit as silu_and_mul does.
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

}  // namespace zllm
