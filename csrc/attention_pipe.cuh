// Paged decode attention, pipelined build ("pipe", ZLLM_DECODE_ATTENTION=pipe|pipe3): the same
// work split, arguments, workspace and reduce as attention.cuh's kernel, with the K/V stream
// reorganised so that each warp keeps whole tiles of bytes in flight while it computes.
//
// Why: attention.cuh's kernel reads a key row per lane straight into registers (8 16-byte loads
// a lane at a time, then the dot), then the tile's value rows (16 a warp at a time): each tile is
// four or five dependent memory round trips (a block-table load, two of keys, two of values) with
// the softmax between them, and no bytes in flight while the warp computes. At batch 256 it moves
// 2.19 TB/s (73% of the copy bandwidth; docs/benchmarks.md, issue 20).
//
// Grid, block and arguments as attention.cuh's (num_partitions, KVH * num_chunks, B; the _loop
// kernels below: one wave of blocks, 1, 1, and the batch), 128 threads;
// plain layers only (no window, no soft cap: the dispatcher keeps those on attention.cuh's
// families). Per block:
//   - the partition's block-table entries (at most kPipeTableEntries) are staged in shared memory
//     once, with the queries (pre-scaled, fp32);
//   - the partition is cut into tiles of kPipeTile (16) tokens, warp w taking tiles w, w + 4, ...;
//   - each warp owns a ring of kStages shared-memory stages of one tile's key and value rows,
//     filled by cp.async (16 bytes a copy, L1 bypassed, coalesced: 16 lanes cover one 256-byte row)
//     kStages - 1 tiles ahead of the one it computes: while it scores and accumulates tile i, the
//     rows of tiles i + 1 ... i + kStages - 1 are on their way (8 KiB a tile at head_dim 128 in
//     16 bits). No block barrier inside the loop: the warps run independently.
//   - QK: two lanes per token, each dotting half the key row (from shared memory; rows padded by
//     16 bytes so that the 8 lanes of a quarter-warp read 8 different bank groups) with the kGC
//     queries; one shuffle joins the halves. Online softmax per tile as before.
//   - PV: lane j owns D/32 output dims and walks the tile's value rows in shared memory.
//   - the 4 warps' (m, l, acc) merge as before, through shared memory that aliases the stages.
// Dynamic shared memory: kAttnWarps * kStages * kPipeTile * (2 * row bytes + 16) (66 KiB for
// head_dim 128 in 16 bits at 2 stages: 3 blocks an SM; 99 KiB at 3 stages: 2 blocks an SM);
// zllm/workers/kernels/attention.py computes the same figure (pipe_shared_bytes) and opts in.
#pragma once

#include "attention.cuh"

namespace zllm {

constexpr int kPipeTile = 16;            // tokens per warp step: two lanes a token
constexpr int kPipeTableEntries = 128;   // block-table entries one partition may span

__host__ __device__ constexpr int pipe_stage_bytes(int row_bytes) { return kPipeTile * (2 * row_bytes + 16); }

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Max and sum over the kPipeTile lanes of a half-warp (each token's score is held by two lanes,
// l and l + 16, so reducing over one half gives the tile's value, in both halves).
__device__ __forceinline__ float tile_max(float v) {
#pragma unroll
  for (int o = kPipeTile / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float tile_sum(float v) {
#pragma unroll
  for (int o = kPipeTile / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Dot of half a key row (kHalf elements of C in shared memory, 16-byte aligned) with kGC queries'
// matching halves (q[g][0..kHalf) in shared memory).
template <typename C, int kHalf, int kGC, int kQStride>
__device__ __forceinline__ void qk_half_dot(const C* k, const float (*q)[2][kQStride], int half, float (&s)[kGC]) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(C));
  static_assert(kHalf % kVec == 0, "half a key row must be whole 16-byte reads");
  constexpr int kLoads = kHalf / kVec;
  const uint4* k16 = reinterpret_cast<const uint4*>(k);
  uint4 raw[kLoads];
#pragma unroll
  for (int c = 0; c < kLoads; ++c) raw[c] = k16[c];
  float s2[kGC][2];
#pragma unroll
  for (int g = 0; g < kGC; ++g) s2[g][0] = s2[g][1] = 0.f;
#pragma unroll
  for (int c = 0; c < kLoads; ++c) {
    float kf[kVec];
    unpack<C>(raw[c], kf);
#pragma unroll
    for (int g = 0; g < kGC; ++g) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) s2[g][e & 1] = fmaf(q[g][half][c * kVec + e], kf[e], s2[g][e & 1]);
    }
  }
#pragma unroll
  for (int g = 0; g < kGC; ++g) s[g] = s2[g][0] + s2[g][1];
}

// Attends partition `part` of sequence `b` for head slot `slot` (kv head * num_chunks + chunk;
// ZLLM_PAGED_ATTENTION_PIPE: the block's own, blockIdx.z, blockIdx.x and blockIdx.y; the _loop
// kernels below hand a block one claimed unit after another).
template <typename T, typename C, int D, int kGC, int kStages>
__device__ __forceinline__ void paged_attention_pipe_impl(
    T* __restrict__ out, float* __restrict__ ws_out, float* __restrict__ ws_ml, const T* __restrict__ q,
    const C* __restrict__ k_cache, const C* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, float scale_log2, float v_scale, int num_kv_heads, int group, int num_chunks,
    int block_size, int max_blocks, i64 bt_stride, i64 q_stride, i64 out_stride, int partition_size,
    int max_parts, int b, int part, int slot) {
  static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
  static_assert(kStages >= 2, "a pipeline needs two stages");
  constexpr int kE = D / 32;                                     // output dims per lane
  constexpr int kRowBytes = D * static_cast<int>(sizeof(C));     // one key or value row
  static_assert(kRowBytes % 32 == 0, "half a row must be whole 16-byte copies");
  constexpr int kChunks = kRowBytes / 16;                        // 16-byte copies per row
  static_assert(kPipeTile * kChunks % 32 == 0, "a tile's rows must be whole copies per lane");
  constexpr int kCopies = kPipeTile * kChunks / 32;              // per lane, of keys (and of values)
  constexpr int kKStride = kRowBytes + 16;                       // padded key row: conflict-free reads
  constexpr int kVOffset = kPipeTile * kKStride;                 // the value rows, after the keys
  constexpr int kStageBytes = pipe_stage_bytes(kRowBytes);
  constexpr int kHalf = D / 2;                                   // key elements one lane dots
  constexpr int kQStride = kHalf + 4;                            // padded: the halves' lanes read other banks
  static_assert(kAttnWarps * kGC * D * 4 <= kAttnWarps * kStages * kStageBytes,
                "the warps' accumulators must fit in the stages they alias");

  extern __shared__ __align__(16) unsigned char pipe_smem[];
  __shared__ __align__(16) float q_s[kGC][2][kQStride];
  __shared__ __align__(16) float p_s[kAttnWarps][kPipeTile][kGC];
  __shared__ int table_s[kPipeTableEntries];
  __shared__ float m_s[kAttnWarps][kGC];
  __shared__ float l_s[kAttnWarps][kGC];

  const int kv_head = slot / num_chunks;
  const int chunk = slot - kv_head * num_chunks;
  const int num_heads = num_kv_heads * group;
  const int head0 = kv_head * group + chunk * kGC;
  const int heads_here = imin(kGC, group - chunk * kGC);
  T* out_b = out + static_cast<i64>(b) * out_stride;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int* table = block_tables + static_cast<i64>(b) * bt_stride;

  // Independent loads first, together: the length, the partition's block-table entries (in
  // bounds of the table; the dispatcher guarantees a partition spans at most kPipeTableEntries),
  // the queries.
  const int raw_len = seq_lens[b];
  const int start = part * partition_size;
  const int first_logical = start / block_size;
  for (int i = threadIdx.x; i < kPipeTableEntries; i += kAttnThreads) {
    const int logical = first_logical + i;
    table_s[i] = logical < max_blocks ? table[logical] : 0;
  }
  const T* q_b = q + static_cast<i64>(b) * q_stride + static_cast<i64>(head0) * D;
  for (int i = threadIdx.x; i < kGC * D; i += kAttnThreads) {
    const int g = i / D;
    const int d = i - g * D;
    const int h = d / kHalf;
    q_s[g][h][d - h * kHalf] = g < heads_here ? to_float<T>(q_b[i]) * scale_log2 : 0.f;
  }

  const int len = clamped_end(raw_len, 0, max_blocks, block_size, partition_size, max_parts);
  const int num_parts = (len + partition_size - 1) / partition_size;
  if (start >= len) {
    if (part == 0) {  // empty sequence: zeros rather than 0/0
      for (int i = threadIdx.x; i < heads_here * D; i += kAttnThreads) {
        out_b[static_cast<i64>(head0) * D + i] = from_float<T>(0.f);
      }
    }
    return;
  }
  const int end = imin(start + partition_size, len);
  __syncthreads();  // table_s, q_s
  const i64 slot_stride = static_cast<i64>(num_kv_heads) * D;  // elements between slots
  const i64 head_offset = static_cast<i64>(kv_head) * D;
  const unsigned char* k_bytes = reinterpret_cast<const unsigned char*>(k_cache + head_offset);
  const unsigned char* v_bytes = reinterpret_cast<const unsigned char*>(v_cache + head_offset);
  const i64 slot_bytes = slot_stride * static_cast<i64>(sizeof(C));

  const int num_tiles = (end - start + kPipeTile - 1) / kPipeTile;
  const int my_tiles = num_tiles > warp ? (num_tiles - warp + kAttnWarps - 1) / kAttnWarps : 0;
  unsigned char* warp_smem = pipe_smem + warp * (kStages * kStageBytes);

  // Issue the copies of this warp's i-th tile into stage i % kStages (all lanes call it: the
  // slots are computed once a lane, one token each, and shuffled to the lanes that copy them).
  auto issue = [&](int i) {
    const int t0 = start + (warp + i * kAttnWarps) * kPipeTile;
    const int count = imin(kPipeTile, end - t0);
    int my_slot = 0;
    if (lane < count) {
      const int t = t0 + lane;
      const int logical = t / block_size;
      my_slot = table_s[logical - first_logical] * block_size + (t - logical * block_size);
    }
    unsigned char* stage = warp_smem + (i % kStages) * kStageBytes;
#pragma unroll
    for (int j = 0; j < kCopies; ++j) {
      const int c = j * 32 + lane;
      const int r = c / kChunks;
      const int col = c - r * kChunks;
      const int slot = __shfl_sync(0xffffffffu, my_slot, r);
      if (r < count) {
        const i64 src = static_cast<i64>(slot) * slot_bytes + col * 16;
        cp_async16(stage + r * kKStride + col * 16, k_bytes + src);
        cp_async16(stage + kVOffset + r * kRowBytes + col * 16, v_bytes + src);
      }
    }
  };

  float m[kGC], l[kGC], acc[kGC][kE];
#pragma unroll
  for (int g = 0; g < kGC; ++g) {
    m[g] = neg_inf();
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < kE; ++e) acc[g][e] = 0.f;
  }
  const int r_lane = lane & (kPipeTile - 1);  // the token this lane scores
  const int h_lane = lane / kPipeTile;        // and which half of its key row

  // One commit group per tile (empty past the warp's last), so that "all but the newest
  // kStages - 1 groups" is always the tile about to be computed.
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < my_tiles) issue(i);
    cp_async_commit();
  }
  for (int i = 0; i < my_tiles; ++i) {
    // The stage this refills held tile i - 1, which every lane finished with before the
    // __syncwarp that ended the last iteration.
    if (i + kStages - 1 < my_tiles) issue(i + kStages - 1);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    __syncwarp();  // every lane's copies of tile i are visible to the warp

    const int t0 = start + (warp + i * kAttnWarps) * kPipeTile;
    const int count = imin(kPipeTile, end - t0);  // >= 1
    const unsigned char* stage = warp_smem + (i % kStages) * kStageBytes;

    // QK: lanes l and l + 16 score token l, each over half the row.
    float s[kGC];
    if (r_lane < count) {
      const C* krow = reinterpret_cast<const C*>(stage + r_lane * kKStride) + h_lane * kHalf;
      qk_half_dot<C, kHalf, kGC, kQStride>(krow, q_s, h_lane, s);
    } else {
#pragma unroll
      for (int g = 0; g < kGC; ++g) s[g] = 0.f;
    }
#pragma unroll
    for (int g = 0; g < kGC; ++g) {
      s[g] += __shfl_xor_sync(0xffffffffu, s[g], kPipeTile);
      if (r_lane >= count) s[g] = neg_inf();
    }

    // Online softmax over the tile (token 0 is always valid, so the tile's max is finite).
#pragma unroll
    for (int g = 0; g < kGC; ++g) {
      const float m_new = fmaxf(m[g], tile_max(s[g]));
      const float alpha = m[g] == neg_inf() ? 0.f : exp2f(m[g] - m_new);
      s[g] = exp2f(s[g] - m_new);  // the weight p (0 for empty lanes)
      l[g] = l[g] * alpha + tile_sum(s[g]);
      m[g] = m_new;
#pragma unroll
      for (int e = 0; e < kE; ++e) acc[g][e] *= alpha;
    }
    if (h_lane == 0) {
#pragma unroll
      for (int g = 0; g < kGC; ++g) p_s[warp][r_lane][g] = s[g];
    }
    __syncwarp();

    // PV: lane owns dims [lane * kE, lane * kE + kE) of each value row.
    const C* v_lane = reinterpret_cast<const C*>(stage + kVOffset) + lane * kE;
#pragma unroll
    for (int r = 0; r < kPipeTile; ++r) {
      if (r < count) {
        LaneSlice<C, kE> slice;
        slice.load(v_lane + r * D);
        float v[kE];
        slice.to_floats(v);
#pragma unroll
        for (int g = 0; g < kGC; ++g) {
          const float p = p_s[warp][r][g];
#pragma unroll
          for (int e = 0; e < kE; ++e) acc[g][e] = fmaf(p, v[e], acc[g][e]);
        }
      }
    }
    __syncwarp();  // the stage and p_s are rewritten by the next iteration
  }
  cp_async_wait<0>();  // nothing is left in flight (the last groups are empty); the stages are reused below

  // Merge the warps (a warp without a tile has m = -inf, l = 0, acc = 0 and weighs nothing),
  // through shared memory that aliases the stages once every warp is done with them.
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < kGC; ++g) {
      m_s[warp][g] = m[g];
      l_s[warp][g] = l[g];
    }
  }
  __syncthreads();
  float(*acc_s)[kGC][D] = reinterpret_cast<float(*)[kGC][D]>(pipe_smem);
#pragma unroll
  for (int g = 0; g < kGC; ++g) {
#pragma unroll
    for (int e = 0; e < kE; ++e) acc_s[warp][g][lane * kE + e] = acc[g][e];
  }
  __syncthreads();

  for (int i = threadIdx.x; i < heads_here * D; i += kAttnThreads) {
    const int g = i / D;
    const int d = i - g * D;
    float m_max = neg_inf();
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) m_max = fmaxf(m_max, m_s[w][g]);
    float l_sum = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) {
      const float f = m_s[w][g] == neg_inf() ? 0.f : exp2f(m_s[w][g] - m_max);
      l_sum = fmaf(f, l_s[w][g], l_sum);
      o = fmaf(f, acc_s[w][g][d], o);
    }
    o *= v_scale;  // 1 unless the cache is FP8
    if (num_parts == 1) {
      out_b[static_cast<i64>(head0 + g) * D + d] = from_float<T>(o / l_sum);
    } else {
      const i64 idx = (static_cast<i64>(b) * num_heads + head0 + g) * max_parts + part;
      ws_out[idx * D + d] = o;
      if (d == 0) {
        ws_ml[idx * 2] = m_max;
        ws_ml[idx * 2 + 1] = l_sum;
      }
    }
  }
}

// Exclusive prefix sum of v over the block's threads, and the block's total. Two barriers:
// warp_sums may be reused as soon as it returns.
__device__ __forceinline__ int block_exclusive_sum(int v, int& total, int* warp_sums) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int inclusive = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += n;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  int before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < kAttnWarps; ++w) {
    const int sum = warp_sums[w];
    before += w < warp ? sum : 0;
    total += sum;
  }
  __syncthreads();
  return before + inclusive - v;
}

// The _loop kernels' claim counters (paged_attention_pipe_claimed): claims handed out past the
// grid's first, and the blocks that found none left. Module memory, zero at load; the last block
// of every launch puts both back to zero, so launches that follow each other on a stream each
// start from zero. One pair for the module: two _loop launches must not run at once on one device
// (the engine runs a device's layers on one stream; the split-K workspace has the same rule).
// Unmangled, so that a test can read it (cuModuleGetGlobal).
}  // namespace zllm
extern "C" {
__device__ int g_attention_claims[2];
}
namespace zllm {

// The _loop kernels' work: every (sequence, partition, head slot) of the batch, claimed one at a
// time by a grid of one wave of blocks (the dispatcher sizes it: zllm/workers/kernels/attention.py,
// loop_grid_blocks). Claim c is head slot c % slots of unit c / slots, the units in
// sequence-then-partition order (an empty sequence still has its partition 0, which writes its
// zeros). Block i walks claim i first, then asks the counter for the next whenever it is free.
// Why claimed: a block for every partition of the capacity is mostly dead at short contexts, and
// dealing the units round-robin over one wave made each block walk a fixed share whatever its
// SM's pace: where every context fills the capacity, the whole grid waited for the slowest block
// (one H200, us a call, 256 x 8000 tokens over 8192: 2678 dealt, 2490 claimed, 2463 the full
// grid; 88 x 8000: 890, 872, 773). What is left there is mostly the _loop body's own cost: with
// a block for every claim (one each, no counter) 88 x 8000 took 830 against the full grid's 791.
// A unit's slots are claimed together, so the kv heads of the same tokens are read at about the
// same time; the first claims need no counter, so a batch smaller than the grid lands on blocks
// spread over the SMs. The next claim is not asked for ahead (while this one is walked): a block
// that had just started a long unit would already hold a second, and one 32000-token context
// among 87 of 400 went from 108 to 135 us.
// Each block keeps a window of kAttnThreads sequences' first units in shared memory and moves it
// only forward (its claims only grow), so it reads the batch's lengths once.
template <typename T, typename C, int D, int kGC, int kStages>
__device__ __forceinline__ void paged_attention_pipe_claimed(
    T* __restrict__ out, float* __restrict__ ws_out, float* __restrict__ ws_ml, const T* __restrict__ q,
    const C* __restrict__ k_cache, const C* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, float scale_log2, float v_scale, int num_kv_heads, int group, int num_chunks,
    int block_size, int max_blocks, i64 bt_stride, i64 q_stride, i64 out_stride, int partition_size,
    int max_parts, int batch) {
  __shared__ int first_unit_s[kAttnThreads + 1];  // the window's sequences' first units, and its end
  __shared__ int warp_sums_s[kAttnWarps];
  __shared__ int claim_s;
  __shared__ int2 unit_s;
  const int slots = num_kv_heads * num_chunks;
  const int grid = static_cast<int>(gridDim.x);
  int window = -kAttnThreads;  // the window's first sequence (uniform over the block)
  int scanned = 0;             // units before the sequence after the window (uniform)
  for (int claim = static_cast<int>(blockIdx.x);;) {
    const int unit = claim / slots;
    while (unit >= scanned && window + kAttnThreads < batch) {
      window += kAttnThreads;
      const int s = window + static_cast<int>(threadIdx.x);
      int count = 0;
      if (s < batch) {
        const int len = clamped_end(seq_lens[s], 0, max_blocks, block_size, partition_size, max_parts);
        count = max((len + partition_size - 1) / partition_size, 1);
      }
      int round_total;
      first_unit_s[threadIdx.x] = scanned + block_exclusive_sum(count, round_total, warp_sums_s);
      scanned += round_total;
      if (threadIdx.x == 0) first_unit_s[kAttnThreads] = scanned;
      __syncthreads();  // first_unit_s
    }
    if (unit >= scanned) break;  // every unit is claimed (uniform: claim and scanned are)
    const int i = static_cast<int>(threadIdx.x);
    if (first_unit_s[i] <= unit && unit < first_unit_s[i + 1]) unit_s = make_int2(window + i, unit - first_unit_s[i]);
    __syncthreads();  // unit_s
    const int2 mine = unit_s;
    paged_attention_pipe_impl<T, C, D, kGC, kStages>(
        out, ws_out, ws_ml, q, k_cache, v_cache, block_tables, seq_lens, scale_log2, v_scale, num_kv_heads, group,
        num_chunks, block_size, max_blocks, bt_stride, q_stride, out_stride, partition_size, max_parts, mine.x,
        mine.y, claim - unit * slots);
    if (threadIdx.x == 0) claim_s = grid + atomicAdd(&g_attention_claims[0], 1);
    __syncthreads();  // claim_s; this unit's shared memory is free
    claim = claim_s;
  }
  if (threadIdx.x == 0) {
    __threadfence();  // this block's last claim is ordered before it counts itself done
    if (atomicAdd(&g_attention_claims[1], 1) == grid - 1) {
      __threadfence();  // every block has taken its last claim: the reset comes after them all
      atomicExch(&g_attention_claims[0], 0);
      atomicExch(&g_attention_claims[1], 0);
    }
  }
}

}  // namespace zllm

// NAME_loop: a grid of (one wave of blocks, 1, 1) whose blocks claim every (sequence, partition,
// head slot) of the batch (paged_attention_pipe_claimed), with the batch as one more argument.
// Why: a decode graph is captured for the block table's whole capacity (max_model_len), and a
// grid with a block for every partition of it launches mostly dead blocks for short contexts (at
// max_model_len 32768, 31 of 32 partitions of a 400-token context). Its own entry point, since a
// loop in the plain kernel cost its body 4-7% on an H200 where the grid is whole anyway (a
// 1024-token capacity).
// Same signature as ZLLM_PAGED_ATTENTION's (window and softcap_log2 accepted and ignored: the
// dispatcher sends windowed and capped layers to the other families), so one argument tuple
// launches either build; the _loop kernels take the batch after it.
#define ZLLM_PAGED_ATTENTION_PIPE_LOOP(NAME, T, C, D, GC, STAGES, MIN_BLOCKS)                     \
  extern "C" __global__ void __launch_bounds__(zllm::kAttnThreads, MIN_BLOCKS) NAME##_loop(       \
      T* __restrict__ out, float* __restrict__ ws_out, float* __restrict__ ws_ml,               \
      const T* __restrict__ q, const C* __restrict__ k_cache, const C* __restrict__ v_cache,    \
      const int* __restrict__ block_tables, const int* __restrict__ seq_lens, float scale_log2, \
      float v_scale, int num_kv_heads, int group, int num_chunks, int block_size,              \
      int max_blocks, long long bt_stride, long long q_stride, long long out_stride,           \
      int partition_size, int max_parts, int, float, int batch) {                              \
    ZLLM_DECODE_ATTENTION_PDL_WAIT();                                                           \
    zllm::paged_attention_pipe_claimed<T, C, D, GC, STAGES>(                                   \
        out, ws_out, ws_ml, q, k_cache, v_cache, block_tables, seq_lens, scale_log2, v_scale,  \
        num_kv_heads, group, num_chunks, block_size, max_blocks, bt_stride, q_stride,          \
        out_stride, partition_size, max_parts, batch);                                         \
  }
#define ZLLM_PAGED_ATTENTION_PIPE(NAME, T, C, D, GC, STAGES, MIN_BLOCKS)                          \
  extern "C" __global__ void __launch_bounds__(zllm::kAttnThreads, MIN_BLOCKS) NAME(              \
      T* __restrict__ out, float* __restrict__ ws_out, float* __restrict__ ws_ml,               \
      const T* __restrict__ q, const C* __restrict__ k_cache, const C* __restrict__ v_cache,    \
      const int* __restrict__ block_tables, const int* __restrict__ seq_lens, float scale_log2, \
      float v_scale, int num_kv_heads, int group, int num_chunks, int block_size,              \
      int max_blocks, long long bt_stride, long long q_stride, long long out_stride,           \
      int partition_size, int max_parts, int, float) {                                         \
    ZLLM_DECODE_ATTENTION_PDL_WAIT();                                                           \
    zllm::paged_attention_pipe_impl<T, C, D, GC, STAGES>(                                      \
        out, ws_out, ws_ml, q, k_cache, v_cache, block_tables, seq_lens, scale_log2, v_scale,  \
        num_kv_heads, group, num_chunks, block_size, max_blocks, bt_stride, q_stride,          \
        out_stride, partition_size, max_parts, blockIdx.z, blockIdx.x, blockIdx.y);                \
  }

// Builds: head_dim 64 and 128, groups 1/4/8, 2 and 3 stages (2 also as _loop). MIN_BLOCKS only
// caps the registers (shared memory bounds the resident blocks: 3 an SM at head_dim 128 in 16 bits, 2 stages).
#define ZLLM_PAGED_ATTENTION_PIPE_STAGES(NAME, T, C, D, GC, MIN_BLOCKS)                 \
  ZLLM_PAGED_ATTENTION_PIPE(NAME##_d##D##_g##GC##_s2, T, C, D, GC, 2, MIN_BLOCKS)      \
  ZLLM_PAGED_ATTENTION_PIPE_LOOP(NAME##_d##D##_g##GC##_s2, T, C, D, GC, 2, MIN_BLOCKS) \
  ZLLM_PAGED_ATTENTION_PIPE(NAME##_d##D##_g##GC##_s3, T, C, D, GC, 3, MIN_BLOCKS)
#define ZLLM_PAGED_ATTENTION_PIPE_DIM(NAME, T, C, D, MIN_BLOCKS, MIN_BLOCKS_G8) \
  ZLLM_PAGED_ATTENTION_PIPE_STAGES(NAME, T, C, D, 1, MIN_BLOCKS)               \
  ZLLM_PAGED_ATTENTION_PIPE_STAGES(NAME, T, C, D, 4, MIN_BLOCKS)               \
  ZLLM_PAGED_ATTENTION_PIPE_STAGES(NAME, T, C, D, 8, MIN_BLOCKS_G8)
#define ZLLM_PAGED_ATTENTION_PIPE_CACHE(NAME, T, C, MIN_BLOCKS, MIN_BLOCKS_G8) \
  ZLLM_PAGED_ATTENTION_PIPE_DIM(NAME, T, C, 64, MIN_BLOCKS, MIN_BLOCKS_G8)    \
  ZLLM_PAGED_ATTENTION_PIPE_DIM(NAME, T, C, 128, MIN_BLOCKS, MIN_BLOCKS_G8)
