// Tensor-core products straight from registers (mma.sync m16n8k16, fp16/bf16 in, fp32
// accumulation; sm_80 and newer), shared by the kernels that multiply a few activation rows with
// streamed weight rows: the MoE grouped GEMMs (moe_kernels.cu) and the GEMV for 2-8 rows
// (gemv_kernels.cu).
//
// A lane (g = lane / 4, tig = lane % 4) loads 16 bytes, columns 8 * tig ... 8 * tig + 7 of a
// 32-column chunk, of each row it holds: rows g and g + 8 of the A tile (activations) and row g
// of the 8 weight rows (B). mma_chunk turns those into two mmas whose k order is permuted to
// match (the same permutation on both operands leaves the dot products unchanged), so no
// operand is ever staged through shared memory. c (the accumulator, fp32) holds, per lane,
// A rows g and g + 8 times weight rows 2 * tig and 2 * tig + 1: c[0] = (g, 2 tig),
// c[1] = (g, 2 tig + 1), c[2] = (g + 8, 2 tig), c[3] = (g + 8, 2 tig + 1).
#pragma once

#include "common.cuh"

namespace zllm {

template <typename T>
struct Mma;

template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                             unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                             unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

// 32 columns of a 16-row A tile (rows g and g + 8 of this lane: 8 elements each, columns
// 8 * tig ... 8 * tig + 7 of the chunk) times 32 columns of 8 weight rows (row g: the same
// columns), accumulated into c. The mma's k index 2 * tig + {0, 1} stands for columns
// 8 * tig + {0, 1} (+4 in the second mma), and 2 * tig + 8 + {0, 1} for 8 * tig + {2, 3}: A and B
// use the same map, so c gets the plain dot products.
template <typename T>
__device__ __forceinline__ void mma_chunk(float (&c)[4], uint4 lo, uint4 hi, uint4 w) {
  Mma<T>::run(c, lo.x, hi.x, lo.y, hi.y, w.x, w.y);
  Mma<T>::run(c, lo.z, hi.z, lo.w, hi.w, w.z, w.w);
}

__device__ __forceinline__ uint4 zero4() { return make_uint4(0u, 0u, 0u, 0u); }

}  // namespace zllm
