// Paged attention for decode: one query token per sequence, GQA-aware, split along the context.
// The device code and the macros that instantiate it; attention_kernels.cu compiles the plain
// kernels and the reduce, attention_window_kernels.cu the _win and _cap families (below).
//
//   q            [B, H, D]        token rows may be strided; heads contiguous
//   k/v cache    [num_blocks, block_size, KVH, D]  (the two halves of the [2, ...] layer cache),
//                elements of T, or E4M3 bytes (the _kvfp8 entry points: an FP8 cache, whose keys
//                are scaled by k_scale, folded into scale_log2 by the caller, and whose values
//                by v_scale, applied to each output)
//   block_tables [B, max_blocks] int32 (rows may be strided), seq_lens [B] int32
//   out          [B, H, D]        token rows may be strided; heads contiguous
//   H = KVH * group; query head i reads kv head i / group (torch's enable_gqa convention).
//
// Main kernel, grid (num_partitions, KVH * num_chunks, B), 128 threads (4 warps):
//   a thread block takes one sequence, one kv head, up to kGC of its query heads (one "chunk"
//   of the group; num_chunks = ceil(group / kGC)) and one partition of partition_size tokens,
//   so each K/V row is read once for the kGC heads. It first issues every load that does not
//   depend on another (the sequence length, its queries, the block-table entry of each lane's
//   first token), so a short context costs few memory round trips. The partition is cut into
//   tiles of 32 tokens; warp w takes tiles w, w + 4, ...  Per tile:
//     QK: lane j owns token j: it reads the token's key row (16-byte loads) and dots it with the
//         kGC queries held in shared memory (scaled by scale * log2(e), so exp2 gives exp).
//     softmax: warp max / sum per head, online update of the warp's running (max m, sum l) and
//         rescale of its accumulator.
//     PV: lane j owns D/32 output dims; the warp walks the tile's tokens, reading each value row
//         once (coalesced) and accumulating p * v for the kGC heads.
//   The 4 warps' (m, l, acc) are merged through shared memory. A sequence whose context fits
//   in one partition writes acc / l to out directly; otherwise the block writes its
//   unnormalised acc and (m, l) to the fp32 workspace, and the reduce kernel combines them.
// Reduce kernel, grid (H, B), D threads: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p;
//   up to kFewParts partitions (short contexts) in one round trip to memory.
//   (Combining in the main kernel instead, by the block that finishes a sequence last behind a
//   __threadfence and an atomic counter, measured slower on an H100: 11.0-12.1 vs 9.8 µs per
//   layer at batch 1, benchmarks/attention_decode.py.)
//
// Partitions at or past a sequence's length exit at once. seq_len is clamped to the block
// table's capacity and to the grid's partitions (never a read or write out of bounds);
// seq_len 0 gives zeros.
//
// Per-layer variations (kernel arguments, so a CUDA graph holds them as constants):
//   window > 0: a sliding window: the sequence attends to its last `window` tokens only (the new
//     token and window - 1 before it, HF's mask). The partitions then start at the window's first
//     token, so the grid needs ceil(window / partition_size) of them at most, however long the
//     context.
//   softcap_log2: soft-capped scores (Gemma 2): score <- cap * tanh(score / cap), here on the
//     log2-scaled scores with softcap_log2 = cap * log2(e), before the softmax.
// Each takes registers the plain kernel has none to spare for (a partition origin that depends on
// a load; the tanh), so three families of entry points are compiled: the plain ones (no window,
// no cap: their origin is token 0, recomputed from blockIdx, and the arguments are ignored),
// _win (kWindow: a window), _cap (kWindow and kCap: Gemma 2's layers, windowed or not), the two
// latter with one resident block fewer where they would spill, in a file of their own (a model
// without windows never loads them, and the two files compile in parallel).
#pragma once

#include "common.cuh"
#include "fp8.cuh"

namespace zllm {

#ifndef ZLLM_QK_BATCH
#define ZLLM_QK_BATCH 8  // 16-byte key loads in flight per lane
#endif
#ifndef ZLLM_PV_BATCH
#define ZLLM_PV_BATCH 16  // value rows in flight per warp
#endif

constexpr int kAttnWarps = 4;
constexpr int kAttnThreads = kAttnWarps * 32;
constexpr int kTile = 32;  // tokens per warp step: one per lane
constexpr int kPvBatch = ZLLM_PV_BATCH;
constexpr int kFewParts = 8;  // the reduce kernel combines up to this many in one round trip

// The 16-byte key loads one lane keeps in flight: the largest divisor of the row's loads up to
// ZLLM_QK_BATCH (head_dim 96 in 16 bits: 12 loads, 6 at a time).
__host__ __device__ constexpr int qk_load_batch(int chunks) {
  int batch = chunks < ZLLM_QK_BATCH ? chunks : ZLLM_QK_BATCH;
  while (chunks % batch) --batch;
  return batch;
}

// Dot of one key row (D elements of T at k, 16-byte aligned) with kGC queries from shared memory.
template <typename T, int D, int kGC>
__device__ __forceinline__ void qk_dot(const T* __restrict__ k, const float (*q_s)[D],
                                       float (&s)[kGC]) {
  constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte load
  static_assert(D % kVecElems == 0, "a key row must be whole 16-byte loads");
  constexpr int kChunks = D / kVecElems;
  constexpr int kBatch = qk_load_batch(kChunks);  // loads in flight
  const uint4* k16 = reinterpret_cast<const uint4*>(k);
  float s2[kGC][2];
#pragma unroll
  for (int g = 0; g < kGC; ++g) s2[g][0] = s2[g][1] = 0.f;
#pragma unroll
  for (int c0 = 0; c0 < kChunks; c0 += kBatch) {
    uint4 raw[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) raw[j] = k16[c0 + j];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      float kf[kVecElems];
      unpack<T>(raw[j], kf);
#pragma unroll
      for (int g = 0; g < kGC; ++g) {
#pragma unroll
        for (int e = 0; e < kVecElems; ++e) {
          s2[g][e & 1] = fmaf(q_s[g][(c0 + j) * kVecElems + e], kf[e], s2[g][e & 1]);
        }
      }
    }
  }
#pragma unroll
  for (int g = 0; g < kGC; ++g) s[g] = s2[g][0] + s2[g][1];
}

// One element of a value row as a float (an E4M3 byte, or any other element type).
template <typename C>
__device__ __forceinline__ float elem_to_float(C x) {
  if constexpr (sizeof(C) == 1) {
    return e4m3x2_to_float2(static_cast<unsigned>(x)).x;
  } else {
    return to_float<C>(x);
  }
}

// One lane's kE consecutive value elements: one load where they are 2, 4, 8 or 16 bytes (kind 0),
// 16-byte loads where a multiple of that (kind 1: fp32 at head_dim 256), one load per element
// otherwise (kind 2: head_dim 96, three a lane); held raw until used.
__host__ __device__ constexpr int lane_slice_kind(int bytes) {
  return bytes == 2 || bytes == 4 || bytes == 8 || bytes == 16 ? 0 : bytes % 16 == 0 ? 1 : 2;
}

template <typename C, int kE, int kKind = lane_slice_kind(kE * static_cast<int>(sizeof(C)))>
struct LaneSlice;

template <typename C, int kE>
struct LaneSlice<C, kE, 0> {
  typedef typename Raw<kE * static_cast<int>(sizeof(C))>::type Word;
  Word raw;
  __device__ __forceinline__ void load(const C* p) { raw = *reinterpret_cast<const Word*>(p); }
  __device__ __forceinline__ void to_floats(float* f) const { unpack<C>(raw, f); }
};

template <typename C, int kE>
struct LaneSlice<C, kE, 1> {
  static constexpr int kLoads = kE * static_cast<int>(sizeof(C)) / 16;
  uint4 raw[kLoads];
  __device__ __forceinline__ void load(const C* p) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) raw[i] = reinterpret_cast<const uint4*>(p)[i];
  }
  __device__ __forceinline__ void to_floats(float* f) const {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) unpack<C>(raw[i], f + i * (16 / static_cast<int>(sizeof(C))));
  }
};

template <typename C, int kE>
struct LaneSlice<C, kE, 2> {
  C raw[kE];
  __device__ __forceinline__ void load(const C* p) {
#pragma unroll
    for (int e = 0; e < kE; ++e) raw[e] = p[e];
  }
  __device__ __forceinline__ void to_floats(float* f) const {
#pragma unroll
    for (int e = 0; e < kE; ++e) f[e] = elem_to_float<C>(raw[e]);
  }
};

// The first token a sequence attends to: 0, or the first of its sliding window.
__device__ __forceinline__ int window_origin(int raw_len, int window, int max_blocks, int block_size) {
  const i64 table_cap = static_cast<i64>(max_blocks) * block_size;
  const i64 len = raw_len < table_cap ? raw_len : table_cap;
  return window > 0 && len > window ? static_cast<int>(len - window) : 0;
}

// The end of the tokens the kernels may use, [origin, end): within the block table and the
// launched partitions.
__device__ __forceinline__ int clamped_end(int raw_len, int origin, int max_blocks, int block_size,
                                           int partition_size, int max_parts) {
  i64 len = raw_len;
  const i64 table_cap = static_cast<i64>(max_blocks) * block_size;
  const i64 grid_cap = origin + static_cast<i64>(max_parts) * partition_size;
  len = len < table_cap ? len : table_cap;
  len = len < grid_cap ? len : grid_cap;
  return len > origin ? static_cast<int>(len) : origin;
}

// T: the queries' and outputs' type; C: the cache's (T, or fp8_t); kWindow: a sliding window
// (window > 0) is honoured; kCap: soft-capped scores.
template <typename T, typename C, int D, int kGC, bool kWindow, bool kCap>
__device__ __forceinline__ void paged_attention_impl(
    T* __restrict__ out, float* __restrict__ ws_out, float* __restrict__ ws_ml,
    const T* __restrict__ q, const C* __restrict__ k_cache, const C* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens, float scale_log2,
    float v_scale, int num_kv_heads, int group, int num_chunks, int block_size, int max_blocks, i64 bt_stride,
    i64 q_stride, i64 out_stride, int partition_size, int max_parts, int window, float softcap_log2) {
  static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
  constexpr int kE = D / 32;  // output dims per lane
  // Value rows in flight per warp: half as many for head_dim 256, whose slices take twice the
  // registers, and for 96, whose slices are loaded (and held) element by element.
  constexpr int kRows = D > 128 || D % 64 ? kPvBatch / 2 : kPvBatch;

  __shared__ __align__(16) float q_s[kGC][D];
  __shared__ __align__(16) float p_s[kAttnWarps][kTile][kGC];
  __shared__ i64 row_s[kAttnWarps][kTile];
  __shared__ float m_s[kAttnWarps][kGC];
  __shared__ float l_s[kAttnWarps][kGC];
  __shared__ __align__(16) float acc_s[kAttnWarps][kGC][D];
  __shared__ int first_block_s[kAttnWarps][kTile];

  const int part = blockIdx.x;
  const int kv_head = blockIdx.y / num_chunks;
  const int chunk = blockIdx.y - kv_head * num_chunks;
  const int b = blockIdx.z;
  const int num_heads = num_kv_heads * group;
  const int head0 = kv_head * group + chunk * kGC;  // first query head of this block
  const int heads_here = imin(kGC, group - chunk * kGC);
  T* out_b = out + static_cast<i64>(b) * out_stride;

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int* table = block_tables + static_cast<i64>(b) * bt_stride;

  // Loads that depend on nothing else, issued together: the length, the block of each lane's
  // token in the warp's first tile (in bounds of the table, used or not; kept in shared memory,
  // where it holds no register through the loop) and this block's queries (pre-scaled; rows past
  // the group stay zero). A sliding window's origin depends on the length: only its layers wait.
  const int raw_len = seq_lens[b];
  int origin = 0;
  if constexpr (kWindow) {
    if (window > 0) origin = window_origin(raw_len, window, max_blocks, block_size);
  }
  const int start = origin + part * partition_size;
  const int first_logical = (start + warp * kTile + lane) / block_size;
  first_block_s[warp][lane] = first_logical < max_blocks ? table[first_logical] : 0;
  const T* q_b = q + static_cast<i64>(b) * q_stride + static_cast<i64>(head0) * D;
  for (int i = threadIdx.x; i < kGC * D; i += kAttnThreads) {
    (&q_s[0][0])[i] = i < heads_here * D ? to_float<T>(q_b[i]) * scale_log2 : 0.f;
  }

  const int len = clamped_end(raw_len, origin, max_blocks, block_size, partition_size, max_parts);
  const int num_parts = (len - origin + partition_size - 1) / partition_size;
  if (start >= len) {
    if (part == 0) {  // empty sequence: zeros rather than 0/0
      for (int i = threadIdx.x; i < heads_here * D; i += kAttnThreads) {
        out_b[static_cast<i64>(head0) * D + i] = from_float<T>(0.f);
      }
    }
    return;
  }
  const int end = imin(start + partition_size, len);
  __syncthreads();  // q_s, first_block_s
  const i64 slot_stride = static_cast<i64>(num_kv_heads) * D;  // elements between slots
  const i64 head_offset = static_cast<i64>(kv_head) * D;

  float m[kGC], l[kGC], acc[kGC][kE];
#pragma unroll
  for (int g = 0; g < kGC; ++g) {
    m[g] = neg_inf();
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < kE; ++e) acc[g][e] = 0.f;
  }

  const int num_tiles = (end - start + kTile - 1) / kTile;
  for (int tile = warp; tile < num_tiles; tile += kAttnWarps) {
    const int t0 = start + tile * kTile;
    const int count = imin(kTile, end - t0);  // >= 1: valid tokens in this tile
    const int t = t0 + lane;

    // QK: lane owns token t.
    float s[kGC];
    i64 row = 0;
    if (lane < count) {
      const int logical = t / block_size;
      const int block = tile == warp ? first_block_s[warp][lane] : table[logical];
      const i64 slot = static_cast<i64>(block) * block_size + (t - logical * block_size);
      row = slot * slot_stride + head_offset;
      qk_dot<C, D, kGC>(k_cache + row, q_s, s);
      if constexpr (kCap) {
#pragma unroll
        for (int g = 0; g < kGC; ++g) s[g] = softcap_log2 * tanhf(s[g] / softcap_log2);
      }
    } else {
#pragma unroll
      for (int g = 0; g < kGC; ++g) s[g] = neg_inf();
    }
    row_s[warp][lane] = row;

    // Online softmax over the tile (lane 0 always holds a valid token, so tile_max is finite).
#pragma unroll
    for (int g = 0; g < kGC; ++g) {
      const float m_new = fmaxf(m[g], warp_max(s[g]));
      const float alpha = m[g] == neg_inf() ? 0.f : exp2f(m[g] - m_new);
      s[g] = exp2f(s[g] - m_new);  // now the probability weight p (0 for empty lanes)
      l[g] = l[g] * alpha + warp_sum(s[g]);
      m[g] = m_new;
#pragma unroll
      for (int e = 0; e < kE; ++e) acc[g][e] *= alpha;
    }
#pragma unroll
    for (int g = 0; g < kGC; ++g) p_s[warp][lane][g] = s[g];
    __syncwarp();

    // PV: lane owns dims [lane * kE, lane * kE + kE); kRows value rows in flight.
    const C* v_lane = v_cache + lane * kE;
    for (int tt = 0; tt < count; tt += kRows) {
      LaneSlice<C, kE> raw[kRows];
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        if (tt + j < count) raw[j].load(v_lane + row_s[warp][tt + j]);
      }
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        if (tt + j < count) {
          float v[kE];
          raw[j].to_floats(v);
#pragma unroll
          for (int g = 0; g < kGC; ++g) {
            const float p = p_s[warp][tt + j][g];
#pragma unroll
            for (int e = 0; e < kE; ++e) acc[g][e] = fmaf(p, v[e], acc[g][e]);
          }
        }
      }
    }
    __syncwarp();  // p_s and row_s are rewritten by the next tile
  }

  // Merge the warps. A warp that had no tile has m = -inf, l = 0, acc = 0 and weighs nothing.
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < kGC; ++g) {
      m_s[warp][g] = m[g];
      l_s[warp][g] = l[g];
    }
  }
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

extern __shared__ float dyn_smem[];

// Combine the partitions of sequences with more than one. Dynamic shared memory: max_parts floats.
template <typename T, int D>
__device__ __forceinline__ void paged_attention_reduce_impl(
    T* __restrict__ out, const float* __restrict__ ws_out, const float* __restrict__ ws_ml,
    const int* __restrict__ seq_lens, int num_heads, int block_size, int max_blocks,
    i64 out_stride, int partition_size, int max_parts, int window) {
  __shared__ float scratch[32];
  float* weight_s = dyn_smem;
  const int head = blockIdx.x;
  const int b = blockIdx.y;
  const int raw_len = seq_lens[b];
  const int origin = window_origin(raw_len, window, max_blocks, block_size);
  const int len = clamped_end(raw_len, origin, max_blocks, block_size, partition_size, max_parts);
  const int num_parts = (len - origin + partition_size - 1) / partition_size;
  if (num_parts <= 1) return;  // written directly by the main kernel (or zeros for len 0)

  const i64 base = (static_cast<i64>(b) * num_heads + head) * max_parts;
  T* out_row = out + static_cast<i64>(b) * out_stride + static_cast<i64>(head) * D;
  if (num_parts <= kFewParts) {
    // Short contexts: each thread loads every partition's (m, l) and its dims at once.
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
      float m[kFewParts], l[kFewParts], a[kFewParts];
#pragma unroll
      for (int p = 0; p < kFewParts; ++p) {
        if (p < num_parts) {
          m[p] = ws_ml[(base + p) * 2];
          l[p] = ws_ml[(base + p) * 2 + 1];
          a[p] = ws_out[(base + p) * D + d];
        }
      }
      float m_max = m[0];
#pragma unroll
      for (int p = 1; p < kFewParts; ++p) m_max = p < num_parts ? fmaxf(m_max, m[p]) : m_max;
      float l_sum = 0.f, o = 0.f;
#pragma unroll
      for (int p = 0; p < kFewParts; ++p) {
        if (p < num_parts) {
          const float w = exp2f(m[p] - m_max);
          l_sum = fmaf(w, l[p], l_sum);
          o = fmaf(w, a[p], o);
        }
      }
      out_row[d] = from_float<T>(o / l_sum);
    }
    return;
  }
  float m_max = neg_inf();
  for (int p = threadIdx.x; p < num_parts; p += blockDim.x) {
    m_max = fmaxf(m_max, ws_ml[(base + p) * 2]);
  }
  m_max = block_max(m_max, scratch);
  float l_sum = 0.f;
  for (int p = threadIdx.x; p < num_parts; p += blockDim.x) {
    const float w = exp2f(ws_ml[(base + p) * 2] - m_max);
    weight_s[p] = w;
    l_sum = fmaf(w, ws_ml[(base + p) * 2 + 1], l_sum);
  }
  l_sum = block_sum(l_sum, scratch);  // its barrier also publishes weight_s
  const float inv = 1.f / l_sum;

  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    const float* src = ws_out + base * D + d;
    float o = 0.f;
#pragma unroll 4
    for (int p = 0; p < num_parts; ++p) o = fmaf(weight_s[p], src[static_cast<i64>(p) * D], o);
    out_row[d] = from_float<T>(o * inv);
  }
}

}  // namespace zllm

// PDL (ZLLM_PDL_ATTENTION launches these with it): the next kernel (the reduce, or the o
// projection's GEMV, which then has its first weights in flight) may launch at once. q and the
// cache come from the rotary kernel before: read after the wait, through pointers offset by
// pdl_wait_zero() (common.cuh; the kernels' inputs are const __restrict__). The block tables and
// lengths come from the step's copies, which every kernel of the step follows.
#define ZLLM_DECODE_ATTENTION_PDL_WAIT()      \
  zllm::pdl_launch_dependents();              \
  const int pdl_zero = zllm::pdl_wait_zero(); \
  q += pdl_zero;                              \
  k_cache += pdl_zero;                        \
  v_cache += pdl_zero

#define ZLLM_PAGED_ATTENTION(NAME, T, C, D, GC, WIN, CAP, MIN_BLOCKS)                             \
  extern "C" __global__ void __launch_bounds__(zllm::kAttnThreads, MIN_BLOCKS) NAME(              \
      T* __restrict__ out, float* __restrict__ ws_out, float* __restrict__ ws_ml,               \
      const T* __restrict__ q, const C* __restrict__ k_cache, const C* __restrict__ v_cache,    \
      const int* __restrict__ block_tables, const int* __restrict__ seq_lens, float scale_log2, \
      float v_scale, int num_kv_heads, int group, int num_chunks, int block_size,              \
      int max_blocks, long long bt_stride, long long q_stride, long long out_stride,           \
      int partition_size, int max_parts, int window, float softcap_log2) {                     \
    ZLLM_DECODE_ATTENTION_PDL_WAIT();                                                           \
    zllm::paged_attention_impl<T, C, D, GC, WIN, CAP>(out, ws_out, ws_ml, q, k_cache, v_cache,  \
                                            block_tables, seq_lens, scale_log2, v_scale,       \
                                            num_kv_heads, group, num_chunks, block_size,       \
                                            max_blocks, bt_stride, q_stride, out_stride,       \
                                            partition_size, max_parts, window, softcap_log2);  \
  }

#define ZLLM_PAGED_ATTENTION_REDUCE(NAME, T, D)                                                   \
  extern "C" __global__ void __launch_bounds__(D) NAME(                                         \
      T* __restrict__ out, const float* __restrict__ ws_out, const float* __restrict__ ws_ml,   \
      const int* __restrict__ seq_lens, int num_heads, int block_size, int max_blocks,          \
      long long out_stride, int partition_size, int max_parts, int window) {                    \
    zllm::pdl_launch_dependents(); /* PDL: the partitions come from the kernel before */        \
    const int pdl_zero = zllm::pdl_wait_zero();                                                 \
    ws_out += pdl_zero;                                                                         \
    ws_ml += pdl_zero;                                                                          \
    zllm::paged_attention_reduce_impl<T, D>(out, ws_out, ws_ml, seq_lens, num_heads,            \
                                            block_size, max_blocks, out_stride,                 \
                                            partition_size, max_parts, window);                 \
  }

// MIN_BLOCKS (resident blocks per SM that the register budget must allow): more resident warps
// keep more loads in flight, which is what this latency-bound kernel needs; 16-bit caches get 4
// (at most 128 registers) where that compiles without spills (kGC 1 and 4), 3 for kGC 8; fp32
// needs more registers and gets 2.
#ifndef ZLLM_ATTN_MIN_BLOCKS_16BIT
#define ZLLM_ATTN_MIN_BLOCKS_16BIT 4
#endif
#ifndef ZLLM_ATTN_MIN_BLOCKS_16BIT_G8
#define ZLLM_ATTN_MIN_BLOCKS_16BIT_G8 3
#endif
#define ZLLM_PAGED_ATTENTION_DIM(NAME, T, C, D, WIN, CAP, MIN_BLOCKS, MIN_BLOCKS_G8)      \
  ZLLM_PAGED_ATTENTION(NAME##_d##D##_g1, T, C, D, 1, WIN, CAP, MIN_BLOCKS)               \
  ZLLM_PAGED_ATTENTION(NAME##_d##D##_g4, T, C, D, 4, WIN, CAP, MIN_BLOCKS)               \
  ZLLM_PAGED_ATTENTION(NAME##_d##D##_g8, T, C, D, 8, WIN, CAP, MIN_BLOCKS_G8)

// Head sizes: 64 and 128 (Llama, Qwen, Mistral, Phi-4), 96 (Phi-3 mini and medium: values
// loaded element by element) and 256 (Gemma 2 and 3: larger rows), whose slices hold more
// registers: one resident block fewer (at least 2).
#define ZLLM_ATTN_FEWER(BLOCKS) ((BLOCKS) > 2 ? (BLOCKS) - 1 : 2)
#define ZLLM_PAGED_ATTENTION_CACHE(NAME, T, C, WIN, CAP, MIN_BLOCKS, MIN_BLOCKS_G8)                  \
  ZLLM_PAGED_ATTENTION_DIM(NAME, T, C, 64, WIN, CAP, MIN_BLOCKS, MIN_BLOCKS_G8)                     \
  ZLLM_PAGED_ATTENTION_DIM(NAME, T, C, 96, WIN, CAP, ZLLM_ATTN_FEWER(MIN_BLOCKS),                   \
                           ZLLM_ATTN_FEWER(MIN_BLOCKS_G8))                                          \
  ZLLM_PAGED_ATTENTION_DIM(NAME, T, C, 128, WIN, CAP, MIN_BLOCKS, MIN_BLOCKS_G8)                    \
  ZLLM_PAGED_ATTENTION_DIM(NAME, T, C, 256, WIN, CAP, ZLLM_ATTN_FEWER(MIN_BLOCKS),                  \
                           ZLLM_ATTN_FEWER(MIN_BLOCKS_G8))

// The FP8-cache kernels take the 16-bit register budget (their rows are smaller), except where
// the E4M3 conversion has no instruction (before sm_89, so in the compute_80 PTX as well): the
// software conversion needs more registers and spills under 128 (sm_80: 48 bytes at kGC 4).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#define ZLLM_ATTN_MIN_BLOCKS_FP8 2
#define ZLLM_ATTN_MIN_BLOCKS_FP8_G8 2
#define ZLLM_ATTN_MIN_BLOCKS_FP8_VARIANT 2
#define ZLLM_ATTN_MIN_BLOCKS_FP8_VARIANT_G8 2
#else
#define ZLLM_ATTN_MIN_BLOCKS_FP8 ZLLM_ATTN_MIN_BLOCKS_16BIT
#define ZLLM_ATTN_MIN_BLOCKS_FP8_G8 ZLLM_ATTN_MIN_BLOCKS_16BIT_G8
#define ZLLM_ATTN_MIN_BLOCKS_FP8_VARIANT ZLLM_ATTN_MIN_BLOCKS_VARIANT
#define ZLLM_ATTN_MIN_BLOCKS_FP8_VARIANT_G8 ZLLM_ATTN_MIN_BLOCKS_VARIANT_G8
#endif

// The windowed and soft-capped kernels hold more registers: one resident block fewer than the
// plain ones (16-bit caches), so that they compile without spills.
#define ZLLM_ATTN_MIN_BLOCKS_VARIANT 3
#define ZLLM_ATTN_MIN_BLOCKS_VARIANT_G8 2
