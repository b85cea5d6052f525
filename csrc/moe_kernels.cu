// Fused Mixture-of-Experts, following zllm/workers/models/moe.py (Router.route, Experts.forward):
//
//   moe_topk_softmax_<T>   router logits [T, E] -> top-k weights [T, k] (fp32) and expert ids
//                          [T, k] (int32): softmax over all experts in fp32, the k largest in
//                          descending order (ties: the lower expert id), renormalized over the k
//                          if asked, rounded through T if the model casts them (Qwen) or kept in
//                          fp32 (Mixtral). One warp per token, E <= 32 * kMaxExpertsPerLane.
//   moe_align              the (token, slot) pairs sorted by expert into tiles of block_m rows:
//                          every expert's rows start a tile and are padded to whole tiles with
//                          -1; tile_experts[t] is tile t's expert (-1 past the used tiles). The
//                          order of pairs inside an expert is not fixed (atomics), and nothing
//                          depends on it: every row is computed on its own. One block.
//   moe_gate_up_<T>_m<MT>  inter[row] = silu(x[token] @ gate_e^T) * (x[token] @ up_e^T) for each
//                          sorted row (padding rows get 0), rounded to T after each product as
//                          F.linear, F.silu and the product are in the reference.
//   moe_down_<T>_m<MT>     y[pair] = to_T(to_T(inter[row] @ down_e^T) * w[pair]): each pair's
//                          weighted expert output, the addend of the reference's index_add_
//                          (which rounds it to T whether the weights are fp32 or T).
//   moe_gemv_gate_up_<T>_s<S>_b<B>, the same for a few tokens without the sort: each pair's
//   moe_gemv_down_<T>_s<S>_b<B>     expert rows read straight from topk_ids by GEMVs (S warps an
//                                   output), the weighted sum fused into down.
//   moe_sum_<T>            out[t] = sum over the k slots of y[t * k + j], summed in fp32 in slot
//                          order and rounded once (the reference rounds after every expert: the
//                          results agree to rounding).
//
// The two grouped GEMMs run on tensor cores (mma.sync m16n8k16, fp32 accumulation; T is fp16 or
// bf16) straight from registers, no shared memory: a warp owns 8 weight rows (gate_up: 8 gate
// rows and the matching 8 up rows) and 16 * MT token rows of one tile. Each lane loads 16 bytes
// of each of its weight rows per 32 columns, and the mma's K order is permuted to match (the
// same permutation on both operands leaves the dot products unchanged), so a weight byte is read
// exactly once per tile and never staged. Weights are streamed with evict-first loads; at batch 1
// only the chosen experts' rows are read, which is what decode needs, and at larger batches every
// tile of an expert re-reads its rows (block_m = 16 * MT sets how often: the host picks MT from
// the rows per expert).
//   Layouts: x [tokens, H] rows of stride x_stride; gate_up [E, 2I, H] (gate rows, then up);
//   down [E, H, I]; all contiguous where not said, H and I multiples of 8, 16-byte-aligned rows.
// Grids of the GEMMs: (max_tiles, ceil(N / (8 * kMoeWarps))), kMoeWarps * 32 threads; blocks of
// unused tiles return at once, so the grid depends on the batch size only (CUDA graphs).
#include "common.cuh"
#include "mma.cuh"

namespace zllm {

constexpr int kMaxExpertsPerLane = 16;  // E <= 512
constexpr int kMoeWarps = 4;
constexpr int kMoeThreads = kMoeWarps * 32;
constexpr int kAlignThreads = 1024;

// ---- routing --------------------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ void topk_softmax_impl(float* __restrict__ topk_weights, int* __restrict__ topk_ids,
                                                  const T* __restrict__ logits, int tokens, int num_experts,
                                                  int top_k, int renormalize, int round_weights) {
  const int lane = threadIdx.x & 31;
  const int token = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (token >= tokens) return;
  const T* row = logits + static_cast<i64>(token) * num_experts;
  float p[kMaxExpertsPerLane];
  float row_max = neg_inf();
#pragma unroll
  for (int i = 0; i < kMaxExpertsPerLane; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < num_experts ? to_float<T>(row[e]) : neg_inf();
    row_max = fmaxf(row_max, p[i]);
  }
  row_max = warp_max(row_max);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxExpertsPerLane; ++i) {
    p[i] = lane + 32 * i < num_experts ? expf(p[i] - row_max) : 0.f;
    sum += p[i];
  }
  const float inv = 1.f / warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kMaxExpertsPerLane; ++i) p[i] = lane + 32 * i < num_experts ? p[i] * inv : -1.f;

  float chosen_sum = 0.f;
  float chosen = 0.f;  // lane j keeps the j-th weight
  int chosen_id = 0;
  for (int j = 0; j < top_k; ++j) {
    float best = -1.f;
    int best_id = num_experts;
#pragma unroll
    for (int i = 0; i < kMaxExpertsPerLane; ++i) {
      if (p[i] > best) best = p[i], best_id = lane + 32 * i;  // ascending ids: ties keep the lower
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, best, o);
      const int other_id = __shfl_xor_sync(0xffffffffu, best_id, o);
      if (other > best || (other == best && other_id < best_id)) best = other, best_id = other_id;
    }
#pragma unroll
    for (int i = 0; i < kMaxExpertsPerLane; ++i) {
      if (lane + 32 * i == best_id) p[i] = -1.f;  // taken (a register array: no dynamic index)
    }
    chosen_sum += best;
    if (lane == j) chosen = best, chosen_id = best_id;
  }
  if (lane < top_k) {
    float w = renormalize ? chosen / chosen_sum : chosen;
    if (round_weights) w = round_to<T>(w);
    topk_weights[static_cast<i64>(token) * top_k + lane] = w;
    topk_ids[static_cast<i64>(token) * top_k + lane] = chosen_id;
  }
}

// ---- sorting the pairs by expert ------------------------------------------------------------------

// Inclusive prefix sum over the block of one value per thread (blockDim.x == kAlignThreads).
__device__ __forceinline__ int block_inclusive_scan(int v, int* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += other;
  }
  if (lane == 31) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int w = scratch[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += other;
    }
    scratch[lane] = w;
  }
  __syncthreads();
  return warp == 0 ? v : v + scratch[warp - 1];
}

__device__ __forceinline__ void align_impl(int* __restrict__ sorted_pairs, int* __restrict__ tile_experts,
                                           int* __restrict__ num_tiles_out, const int* __restrict__ topk_ids,
                                           int pairs, int num_experts, int block_m, int max_tiles) {
  extern __shared__ int smem[];
  int* counts = smem;                  // [num_experts], then the cursor of each expert
  int* starts = smem + num_experts;    // [num_experts]: first row of each expert
  __shared__ int scratch[32];
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) counts[e] = 0;
  for (int r = threadIdx.x; r < max_tiles * block_m; r += blockDim.x) sorted_pairs[r] = -1;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) atomicAdd(&counts[topk_ids[p]], 1);
  __syncthreads();
  // Tiles per expert, scanned in chunks of kAlignThreads experts.
  int carried = 0;
  for (int base = 0; base < num_experts; base += blockDim.x) {
    const int e = base + threadIdx.x;
    const int tiles = e < num_experts ? (counts[e] + block_m - 1) / block_m : 0;
    const int end = carried + block_inclusive_scan(tiles, scratch);
    if (e < num_experts) {
      starts[e] = (end - tiles) * block_m;
      for (int t = end - tiles; t < end; ++t) tile_experts[t] = e;
    }
    carried += scratch[31];  // the chunk's total: the scan of all 32 warps' sums
    __syncthreads();         // before the next chunk's scan writes scratch again
  }
  for (int t = carried + threadIdx.x; t < max_tiles; t += blockDim.x) tile_experts[t] = -1;
  if (threadIdx.x == 0) *num_tiles_out = carried;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = topk_ids[p];
    sorted_pairs[starts[e] + atomicAdd(&counts[e], 1)] = p;
  }
}

// ---- tensor-core tiles from registers (Mma, mma_chunk: mma.cuh) -----------------------------------

// One lane's 16 bytes of a row at column col, or zeros past the end (k a multiple of 8).
template <bool kStream, typename T>
__device__ __forceinline__ uint4 load_piece(const T* row, int col, int k) {
  if (row == nullptr || col >= k) return zero4();
  const uint4* p = reinterpret_cast<const uint4*>(row + col);
  return kStream ? __ldcs(p) : __ldg(p);
}

// The products of one warp: rows of A (kM tiles of 16, pointers per lane: rows g and g + 8 of
// each, null for padding) times kN groups of 8 weight rows (one row per lane group), over k,
// with the weight loads of kUnroll 32-column chunks in flight together.
template <typename T, int kM, int kN, int kUnroll>
__device__ __forceinline__ void warp_tile(float (&acc)[kM][kN][4], const T* const (&a_rows)[kM][2],
                                          const T* const (&w_rows)[kN], int begin, int end) {
  const int tig = threadIdx.x & 3;
#pragma unroll
  for (int m = 0; m < kM; ++m)
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][n][i] = 0.f;
  const int full = begin + (end - begin) / (32 * kUnroll) * (32 * kUnroll);
  int col = begin + 8 * tig;
  for (; col < full; col += 32 * kUnroll) {
    uint4 w[kUnroll][kN];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int n = 0; n < kN; ++n) w[u][n] = __ldcs(reinterpret_cast<const uint4*>(w_rows[n] + col + 32 * u));
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        const uint4 lo = load_piece<false>(a_rows[m][0], col + 32 * u, end);
        const uint4 hi = load_piece<false>(a_rows[m][1], col + 32 * u, end);
#pragma unroll
        for (int n = 0; n < kN; ++n) mma_chunk<T>(acc[m][n], lo, hi, w[u][n]);
      }
    }
  }
  for (; col - 8 * tig < end; col += 32) {  // the last chunks, masked per lane
    uint4 w[kN];
#pragma unroll
    for (int n = 0; n < kN; ++n) w[n] = load_piece<true>(w_rows[n], col, end);
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      const uint4 lo = load_piece<false>(a_rows[m][0], col, end);
      const uint4 hi = load_piece<false>(a_rows[m][1], col, end);
#pragma unroll
      for (int n = 0; n < kN; ++n) mma_chunk<T>(acc[m][n], lo, hi, w[n]);
    }
  }
}

// Split-K (kSplit = kMoeWarps): the block's warps take one quarter of k each (whole 32-column
// chunks) for the same 8 weight rows, and warp 0 sums their accumulators through shared memory;
// at batch 1 a layer has too few (tile, row group) pairs to spread over the SMs otherwise.
// kSplit = 1: each warp takes its own rows over all of k. Returns whether this warp holds the
// block's sums (the one to store them).
template <typename T, int kM, int kN, int kUnroll, int kSplit>
__device__ __forceinline__ bool block_tile(float (&acc)[kM][kN][4], const T* const (&a_rows)[kM][2],
                                           const T* const (&w_rows)[kN], int k) {
  if constexpr (kSplit == 1) {
    warp_tile<T, kM, kN, kUnroll>(acc, a_rows, w_rows, 0, k);
    return true;
  } else {
    constexpr int kValues = kM * kN * 4;
    __shared__ float partial[kSplit - 1][kValues][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int span = ((k + 31) / 32 + kSplit - 1) / kSplit * 32;
    const int begin = imin(warp * span, k);
    warp_tile<T, kM, kN, kUnroll>(acc, a_rows, w_rows, begin, imin(begin + span, k));
    float* flat = &acc[0][0][0];
    if (warp > 0) {
#pragma unroll
      for (int i = 0; i < kValues; ++i) partial[warp - 1][i][lane] = flat[i];
    }
    __syncthreads();
    if (warp > 0) return false;
#pragma unroll
    for (int w = 0; w < kSplit - 1; ++w)
#pragma unroll
      for (int i = 0; i < kValues; ++i) flat[i] += partial[w][i][lane];
    return true;
  }
}

// This warp's tile and its first weight row, or false when it has no work (for the whole block
// under split-K, whose warps share their rows).
template <int kSplit>
__device__ __forceinline__ bool warp_work(const int* __restrict__ tile_experts, int n, int& expert, int& row0) {
  expert = tile_experts[blockIdx.x];
  row0 = (blockIdx.y * (kMoeWarps / kSplit) + (kSplit == 1 ? threadIdx.x >> 5 : 0)) * 8;
  return expert >= 0 && row0 < n;
}

template <typename T>
__device__ __forceinline__ void store2(T* p, float a, float b) {
  const float pair[2] = {a, b};
  store_floats<T, 2>(p, pair);
}

template <typename T, int kM, int kUnroll, int kSplit>
__device__ __forceinline__ void gate_up_impl(T* __restrict__ inter, const T* __restrict__ x,
                                             const T* __restrict__ gate_up, const int* __restrict__ sorted_pairs,
                                             const int* __restrict__ tile_experts, int top_k, int inter_size,
                                             int hidden, i64 x_stride) {
  int expert, row0;
  if (!warp_work<kSplit>(tile_experts, inter_size, expert, row0)) return;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;
  const int first = blockIdx.x * 16 * kM;  // the tile's first sorted row
  const T* a_rows[kM][2];
#pragma unroll
  for (int m = 0; m < kM; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int pair = sorted_pairs[first + 16 * m + 8 * h + g];
      a_rows[m][h] = pair < 0 ? nullptr : x + static_cast<i64>(pair / top_k) * x_stride;
    }
  const T* experts = gate_up + static_cast<i64>(expert) * 2 * inter_size * hidden;
  const int w_row = imin(row0 + g, inter_size - 1);
  const T* const w_rows[2] = {experts + static_cast<i64>(w_row) * hidden,
                              experts + static_cast<i64>(inter_size + w_row) * hidden};
  float acc[kM][2][4];
  if (!block_tile<T, kM, 2, kUnroll, kSplit>(acc, a_rows, w_rows, hidden)) return;
  const int col = row0 + 2 * tig;
  if (col >= inter_size) return;  // inter_size is even: col + 1 is in range too
#pragma unroll
  for (int m = 0; m < kM; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float out[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float gate = round_to<T>(acc[m][0][2 * h + j]);
        const float up = round_to<T>(acc[m][1][2 * h + j]);
        out[j] = round_to<T>(gate / (1.f + expf(-gate))) * up;
      }
      store2(inter + static_cast<i64>(first + 16 * m + 8 * h + g) * inter_size + col, out[0], out[1]);
    }
}

template <typename T, int kM, int kUnroll, int kSplit>
__device__ __forceinline__ void down_impl(T* __restrict__ y, const T* __restrict__ inter,
                                          const T* __restrict__ down, const int* __restrict__ sorted_pairs,
                                          const int* __restrict__ tile_experts,
                                          const float* __restrict__ topk_weights, int hidden, int inter_size) {
  int expert, row0;
  if (!warp_work<kSplit>(tile_experts, hidden, expert, row0)) return;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;
  const int first = blockIdx.x * 16 * kM;
  int pairs[kM][2];
  const T* a_rows[kM][2];
#pragma unroll
  for (int m = 0; m < kM; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = first + 16 * m + 8 * h + g;
      pairs[m][h] = sorted_pairs[row];
      a_rows[m][h] = pairs[m][h] < 0 ? nullptr : inter + static_cast<i64>(row) * inter_size;
    }
  const T* const w_rows[1] = {down + (static_cast<i64>(expert) * hidden + imin(row0 + g, hidden - 1)) * inter_size};
  float acc[kM][1][4];
  if (!block_tile<T, kM, 1, kUnroll, kSplit>(acc, a_rows, w_rows, inter_size)) return;
  const int col = row0 + 2 * tig;
  if (col >= hidden) return;
#pragma unroll
  for (int m = 0; m < kM; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int pair = pairs[m][h];
      if (pair < 0) continue;
      const float w = topk_weights[pair];
      store2(y + static_cast<i64>(pair) * hidden + col, round_to<T>(acc[m][0][2 * h]) * w,
             round_to<T>(acc[m][0][2 * h + 1]) * w);
    }
}

// out[t] = sum_j y[t * top_k + j], 8 columns a thread (hidden a multiple of 8).
template <typename T>
__device__ __forceinline__ void sum_impl(T* __restrict__ out, const T* __restrict__ y, int top_k, int hidden) {
  const int col = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
  if (col >= hidden) return;
  const i64 token = blockIdx.x;
  float total[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int j = 0; j < top_k; ++j) {
    float v[8];
    load_floats<T, 8>(y + (token * top_k + j) * hidden + col, v);
#pragma unroll
    for (int e = 0; e < 8; ++e) total[e] += v[e];
  }
  store_floats<T, 8>(out + token * hidden + col, total);
}

// ---- a few tokens: GEMVs straight from the routing --------------------------------------------
// No sort and no tiles: each (token, slot) pair reads its own expert's rows, as the dense GEMV
// (gemv_kernels.cu) reads a weight matrix: lanes stride over k in 16-byte units, kGemvUnroll
// loads per row in flight a round (the last round masked), weights streamed with evict-first
// loads, fp32 sums. kSplit warps share an output element, each taking a contiguous kSplit-th of
// its k (whole 32-unit strides), and add their sums through shared memory: with few outputs
// (batch 1) that keeps more warps, each with fewer rounds, on the SMs. A pair re-reads an
// expert that another token also chose, so this is the path for a handful of tokens (decode at
// small batch), where that is rare and the tiles' padding and the sort and sum launches cost
// more than it. Grids: (ceil(outputs / (kMoeWarps / kSplit)), pairs or tokens).
constexpr int kGemvUnroll = 8;

// The last round of a warp's range is masked by clamping its units to the last one and
// dropping their products (a select, not a branch around the load: every load of a round is
// issued before the first product waits on one).
template <typename T>
__device__ __forceinline__ float masked_dot(bool live, uint4 wv, uint4 xv) {
  const float d = dot16<T>(wv, xv);
  return live ? d : 0.f;
}

// [begin, end) of this warp's kSplit-th of `units` 16-byte units, whole 32-unit strides each.
template <int kSplit>
__device__ __forceinline__ void split_range(int units, int& begin, int& end) {
  const int span = ((units + kSplit - 1) / kSplit + 31) / 32 * 32;
  begin = imin(((threadIdx.x >> 5) % kSplit) * span, units);
  end = imin(begin + span, units);
}

// The sum over the kSplit warps of an output of each warp's `value` (warp-summed already), in the
// first of them (returns whether this thread holds it: lane 0 of that warp).
template <int kSplit>
__device__ __forceinline__ bool split_sum(float& value, float* partial) {
  const int warp = threadIdx.x >> 5;
  if constexpr (kSplit == 1) {
    return (threadIdx.x & 31) == 0;
  } else {
    if ((threadIdx.x & 31) == 0) partial[warp] = value;
    __syncthreads();
    if ((threadIdx.x & 31) != 0 || warp % kSplit != 0) return false;
    value = 0.f;
#pragma unroll
    for (int p = 0; p < kSplit; ++p) value += partial[warp + p];
    return true;
  }
}

// inter[p] = silu(x[p / k] @ gate_e^T) * (x[p / k] @ up_e^T), e = topk_ids[p], rounded to T
// after each product as moe_gate_up. Output element: intermediate column i of pair blockIdx.y.
template <typename T, int kSplit>
__device__ __forceinline__ void gemv_gate_up_impl(T* __restrict__ inter, const T* __restrict__ x,
                                                  const T* __restrict__ gate_up, const int* __restrict__ topk_ids,
                                                  int top_k, int inter_size, int hidden, i64 x_stride) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  __shared__ float partial[2][kMoeWarps];
  const int lane = threadIdx.x & 31;
  const int col = blockIdx.x * (kMoeWarps / kSplit) + (threadIdx.x >> 5) / kSplit;  // may pass I
  const int pair = blockIdx.y;
  const T* gate_row = gate_up + (static_cast<i64>(topk_ids[pair]) * 2 * inter_size + imin(col, inter_size - 1)) * hidden;
  const uint4* g16 = reinterpret_cast<const uint4*>(gate_row);
  const uint4* u16 = reinterpret_cast<const uint4*>(gate_row + static_cast<i64>(inter_size) * hidden);
  const uint4* x16 = reinterpret_cast<const uint4*>(x + static_cast<i64>(pair / top_k) * x_stride);
  int begin, end;
  split_range<kSplit>(hidden / kVec, begin, end);
  float gate = 0.f, up = 0.f;
  for (int base = begin; base < end; base += 32 * kGemvUnroll) {
    uint4 gv[kGemvUnroll], uv[kGemvUnroll], xv[kGemvUnroll];
#pragma unroll
    for (int j = 0; j < kGemvUnroll; ++j) {
      const int u = imin(base + lane + 32 * j, end - 1);  // see masked_dot
      gv[j] = __ldcs(g16 + u);
      uv[j] = __ldcs(u16 + u);
    }
#pragma unroll
    for (int j = 0; j < kGemvUnroll; ++j) xv[j] = __ldg(x16 + imin(base + lane + 32 * j, end - 1));
#pragma unroll
    for (int j = 0; j < kGemvUnroll; ++j) {
      const bool live = base + lane + 32 * j < end;
      gate += masked_dot<T>(live, gv[j], xv[j]);
      up += masked_dot<T>(live, uv[j], xv[j]);
    }
  }
  gate = warp_sum(gate);
  up = warp_sum(up);
  const bool gate_held = split_sum<kSplit>(gate, partial[0]);
  if (!split_sum<kSplit>(up, partial[1]) || !gate_held || col >= inter_size) return;
  gate = round_to<T>(gate);
  up = round_to<T>(up);
  inter[static_cast<i64>(pair) * inter_size + col] = from_float<T>(round_to<T>(gate / (1.f + expf(-gate))) * up);
}

// out[t, n] = sum_j w[t, j] * (inter[t * k + j] . down_{e_j}[n]), in fp32 and rounded once (the
// reference rounds each expert's output, its weighted addend and every partial sum to T: the
// results agree to rounding). Output element: hidden row n of token blockIdx.y. A token's k
// intermediate rows are contiguous, so the warps of an output walk them as one run of k * I
// columns, each unit taking its slot's expert row: a short I (Qwen3: 768) still fills a round.
template <typename T, int kSplit>
__device__ __forceinline__ void gemv_down_impl(T* __restrict__ out, const T* __restrict__ inter,
                                               const T* __restrict__ down, const int* __restrict__ topk_ids,
                                               const float* __restrict__ topk_weights, int top_k, int hidden,
                                               int inter_size) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  __shared__ const T* experts[32];  // top_k <= 32 (moe_topk_softmax's bound)
  __shared__ float weights[32];
  __shared__ float partial[kMoeWarps];
  const int token = blockIdx.y;
  if (threadIdx.x < top_k) {
    const i64 pair = static_cast<i64>(token) * top_k + threadIdx.x;
    experts[threadIdx.x] = down + static_cast<i64>(topk_ids[pair]) * hidden * inter_size;
    weights[threadIdx.x] = topk_weights[pair];
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * (kMoeWarps / kSplit) + (threadIdx.x >> 5) / kSplit;  // may pass H
  const int units = inter_size / kVec;
  const i64 row_offset = static_cast<i64>(imin(row, hidden - 1)) * inter_size;
  const uint4* x16 = reinterpret_cast<const uint4*>(inter + static_cast<i64>(token) * top_k * inter_size);
  int begin, end;
  split_range<kSplit>(top_k * units, begin, end);
  float acc = 0.f;
  for (int base = begin; base < end; base += 32 * kGemvUnroll) {
    uint4 wv[kGemvUnroll], xv[kGemvUnroll];
    float w[kGemvUnroll];
#pragma unroll
    for (int j = 0; j < kGemvUnroll; ++j) {
      const int unit = imin(base + lane + 32 * j, end - 1);  // see masked_dot
      const int slot = unit / units;
      wv[j] = __ldcs(reinterpret_cast<const uint4*>(experts[slot] + row_offset) + (unit - slot * units));
      w[j] = weights[slot];
    }
#pragma unroll
    for (int j = 0; j < kGemvUnroll; ++j) xv[j] = __ldg(x16 + imin(base + lane + 32 * j, end - 1));
#pragma unroll
    for (int j = 0; j < kGemvUnroll; ++j) {
      acc = fmaf(w[j], masked_dot<T>(base + lane + 32 * j < end, wv[j], xv[j]), acc);
    }
  }
  acc = warp_sum(acc);
  if (split_sum<kSplit>(acc, partial) && row < hidden) out[static_cast<i64>(token) * hidden + row] = from_float<T>(acc);
}

}  // namespace zllm

#define ZLLM_MOE_TOPK(NAME, T)                                                                          \
  extern "C" __global__ void NAME(float* __restrict__ topk_weights, int* __restrict__ topk_ids,          \
                                  const T* __restrict__ logits, int tokens, int num_experts, int top_k,  \
                                  int renormalize, int round_weights) {                                  \
    zllm::topk_softmax_impl<T>(topk_weights, topk_ids, logits, tokens, num_experts, top_k, renormalize,  \
                               round_weights);                                                           \
  }

#define ZLLM_MOE_SUM(NAME, T)                                                                           \
  extern "C" __global__ void NAME(T* __restrict__ out, const T* __restrict__ y, int top_k, int hidden) { \
    zllm::sum_impl<T>(out, y, top_k, hidden);                                                            \
  }

#define ZLLM_MOE_GEMMS(SUFFIX, NAME, T, M, U, SPLIT)                                                                \
  extern "C" __global__ void __launch_bounds__(zllm::kMoeThreads) moe_gate_up_##SUFFIX##_##NAME(            \
      T* __restrict__ inter, const T* __restrict__ x, const T* __restrict__ gate_up,                        \
      const int* __restrict__ sorted_pairs, const int* __restrict__ tile_experts, int top_k, int inter_size, \
      int hidden, long long x_stride) {                                                                      \
    zllm::gate_up_impl<T, M, U, SPLIT>(inter, x, gate_up, sorted_pairs, tile_experts, top_k, inter_size, hidden,      \
                             x_stride);                                                                      \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(zllm::kMoeThreads) moe_down_##SUFFIX##_##NAME(               \
      T* __restrict__ y, const T* __restrict__ inter, const T* __restrict__ down,                           \
      const int* __restrict__ sorted_pairs, const int* __restrict__ tile_experts,                           \
      const float* __restrict__ topk_weights, int hidden, int inter_size) {                                 \
    zllm::down_impl<T, M, U, SPLIT>(y, inter, down, sorted_pairs, tile_experts, topk_weights, hidden, inter_size);    \
  }

ZLLM_MOE_TOPK(moe_topk_softmax_f32, float)
ZLLM_MOE_TOPK(moe_topk_softmax_f16, __half)
ZLLM_MOE_TOPK(moe_topk_softmax_bf16, __nv_bfloat16)

extern "C" __global__ void __launch_bounds__(zllm::kAlignThreads)
    moe_align(int* __restrict__ sorted_pairs, int* __restrict__ tile_experts, int* __restrict__ num_tiles,
              const int* __restrict__ topk_ids, int pairs, int num_experts, int block_m, int max_tiles) {
  zllm::align_impl(sorted_pairs, tile_experts, num_tiles, topk_ids, pairs, num_experts, block_m, max_tiles);
}

// _m<MT>: tiles of 16 * MT rows (zllm/workers/kernels/moe.py's tile_rows picks one); their
// launch geometry (rows per block) is zllm/workers/kernels/moe.py's _SPLIT_K. Tiles of 16
// (decode) split k over the block's warps and keep 8 chunks of weight loads in flight: at batch 1
// a layer has few (tile, row group) pairs to spread over the SMs.
#define ZLLM_MOE_GEMMS_DTYPE(SUFFIX, T)   \
  ZLLM_MOE_GEMMS(SUFFIX, m1, T, 1, 8, 4)  \
  ZLLM_MOE_GEMMS(SUFFIX, m2, T, 2, 4, 1)  \
  ZLLM_MOE_GEMMS(SUFFIX, m4, T, 4, 4, 1)

ZLLM_MOE_GEMMS_DTYPE(f16, __half)
ZLLM_MOE_GEMMS_DTYPE(bf16, __nv_bfloat16)
// The 16-row tiles without split-K, for benchmarks/moe_kernels.py's comparison (bf16).
ZLLM_MOE_GEMMS(bf16, m1nosplit, __nv_bfloat16, 1, 8, 1)

// _s<S>_b<B>: S warps per output element, B the minimum blocks per SM of __launch_bounds__ (b0:
// none), which decides whether ptxas issues a round's loads together (see gemv_kernels.cu; b6
// and up spill here).
#define ZLLM_MOE_BOUNDS_b0 __launch_bounds__(zllm::kMoeThreads)
#define ZLLM_MOE_BOUNDS_b4 __launch_bounds__(zllm::kMoeThreads, 4)
#define ZLLM_MOE_GEMV(SUFFIX, T, SPLIT, BOUND)                                                              \
  extern "C" __global__ void ZLLM_MOE_BOUNDS_##BOUND moe_gemv_gate_up_##SUFFIX##_s##SPLIT##_##BOUND(         \
      T* __restrict__ inter, const T* __restrict__ x, const T* __restrict__ gate_up,                          \
      const int* __restrict__ topk_ids, int top_k, int inter_size, int hidden, long long x_stride) {          \
    zllm::gemv_gate_up_impl<T, SPLIT>(inter, x, gate_up, topk_ids, top_k, inter_size, hidden, x_stride);     \
  }                                                                                                            \
  extern "C" __global__ void ZLLM_MOE_BOUNDS_##BOUND moe_gemv_down_##SUFFIX##_s##SPLIT##_##BOUND(            \
      T* __restrict__ out, const T* __restrict__ inter, const T* __restrict__ down,                           \
      const int* __restrict__ topk_ids, const float* __restrict__ topk_weights, int top_k, int hidden,        \
      int inter_size) {                                                                                        \
    zllm::gemv_down_impl<T, SPLIT>(out, inter, down, topk_ids, topk_weights, top_k, hidden, inter_size);     \
  }
// s1_b4 is the default; s1_b0 and s4_b4 stay for benchmarks/moe_kernels.py's comparison (H100:
// on Qwen3-30B-A3B's layer at batch 1, 29.7 us against 34.0 and 38.1).
#define ZLLM_MOE_GEMV_DTYPE(SUFFIX, T) \
  ZLLM_MOE_GEMV(SUFFIX, T, 1, b4)      \
  ZLLM_MOE_GEMV(SUFFIX, T, 1, b0)      \
  ZLLM_MOE_GEMV(SUFFIX, T, 4, b4)

ZLLM_MOE_GEMV_DTYPE(f16, __half)
ZLLM_MOE_GEMV_DTYPE(bf16, __nv_bfloat16)

ZLLM_MOE_SUM(moe_sum_f16, __half)
ZLLM_MOE_SUM(moe_sum_bf16, __nv_bfloat16)
