/* Decode attention over the paged KV cache for the CPU worker, without gathering K/V.
 *
 * Plain C (no torch headers: it compiles in about a second), built and loaded through ctypes by
 * zllm/workers/kernels/cpu.py. The torch reference it must match is decode_attention in
 * zllm/workers/attention.py.
 *
 *   kv_cache  [2, num_blocks, block_size, num_kv_heads, head_dim]  (index 0 keys, 1 values)
 *   query     [num_seqs, num_heads, head_dim]   out: same shape
 *   block_tables [num_seqs, max_blocks] int64, seq_lens [num_seqs] int64
 *
 * Token t of sequence s lives at block block_tables[s][t / block_size], slot t % block_size.
 * The head_dim axis must be contiguous; every other axis goes by the strides passed in (in
 * elements), so views need no copies.
 *
 * One task is one sequence (or, with fewer sequences than threads need, a range of its kv heads): it
 * reads each K and V row of its context once for all the query heads that share it (GQA), in two
 * passes over its fp32 scores: scores = q.k * scale for the whole context, then a max-subtracted
 * softmax, then the probability-weighted sum of the value rows. All arithmetic is fp32.
 *
 * A sliding window (window > 0) keeps the last `window` tokens of the context (the new token and
 * window - 1 before it, as HF's mask does); softcap > 0 caps each score at softcap * tanh(score /
 * softcap) before the softmax (Gemma 2). Both are per layer; 0 turns them off. Tasks run
 * on OpenMP threads; the caller passes torch's thread count, and the library links the libgomp
 * that torch has already loaded, so both share one thread pool. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Strides, in elements, in the order the caller packs them. */
enum {
    S_QUERY_SEQ,
    S_QUERY_HEAD,
    S_OUT_SEQ,
    S_OUT_HEAD,
    S_KV_HALF, /* keys -> values */
    S_KV_BLOCK,
    S_KV_SLOT,
    S_KV_HEAD,
    S_TABLE_ROW,
    NUM_STRIDES
};

typedef struct {
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    const int64_t *strides;
    const int64_t *block_tables, *seq_lens;
    float scale;
    int64_t window; /* > 0: attend to the last `window` tokens only */
    float softcap;  /* > 0: scores <- softcap * tanh(scores / softcap) */
} Shape;

/* Per-thread scratch: the task's query rows, output sums, scores and softmax 1/sums, all fp32. */
typedef struct {
    float *q, *acc, *scores, *inv_sum;
} Scratch;

/* exp(x) for x <= 0, within ~2 ulp of expf; branch-free so that the softmax loop vectorizes
 * (glibc's expf does not without -ffast-math, which this file avoids). Cody-Waite reduction
 * x = n ln2 + r, |r| <= ln2 / 2, and a degree-6 polynomial for e^r (Cephes' coefficients). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x; /* keeps 2^n a normal float; e^-87 is ~0 next to the max's 1 */
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float n = (x * 1.44269504088896341f + shifter) - shifter;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* One task: a sequence and a range of its kv heads (all of them when there are enough sequences to
 * keep every thread busy, so a block's rows are read as one contiguous run). */
typedef struct {
    int64_t seq, kv_begin, kv_end;
} Task;

/* Fetch a row (the task's kv heads of one slot) into the cache ahead of use: blocks are scattered
 * over the pool, so the hardware prefetcher loses the stream at every block boundary. */
static inline void prefetch(const void *start, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)start + i);
}

/* Walk the task's context tokens [first, len) block by block: ROW is the first of the task's kv
 * heads at token first + T, and the same slot of the next block is prefetched meanwhile. */
#define FOR_EACH_ROW(s, base, table, first, len, task, ROW, T, BODY)                                \
    do {                                                                                            \
        const int64_t *st_ = (s)->strides;                                                          \
        const int64_t bs_ = (s)->block_size, nblocks_ = ((len) + bs_ - 1) / bs_;                    \
        const int64_t row_bytes_ = ((task)->kv_end - (task)->kv_begin) * st_[S_KV_HEAD] *           \
                                   (int64_t)sizeof(*(base));                                        \
        for (int64_t b_ = (first) / bs_; b_ < nblocks_; b_++) {                                     \
            const __typeof__(base) block_ = (base) + (table)[b_] * st_[S_KV_BLOCK];                \
            const __typeof__(base) next_ =                                                          \
                b_ + 1 < nblocks_ ? (base) + (table)[b_ + 1] * st_[S_KV_BLOCK] : NULL;              \
            const int64_t n_ = (len) - b_ * bs_ < bs_ ? (len) - b_ * bs_ : bs_;                     \
            for (int64_t o_ = b_ * bs_ < (first) ? (first) - b_ * bs_ : 0; o_ < n_; o_++) {        \
                if (next_) prefetch(next_ + o_ * st_[S_KV_SLOT], row_bytes_);                       \
                const __typeof__(base) ROW = block_ + o_ * st_[S_KV_SLOT];                          \
                const int64_t T = b_ * bs_ + o_ - (first);                                          \
                BODY                                                                                \
            }                                                                                       \
        }                                                                                           \
    } while (0)

/* In place: scores[t] <- exp(scores[t] - max); returns 1 / sum. */
static float softmax_unnormalised(float *scores, int64_t len) {
    float max = scores[0];
    for (int64_t t = 1; t < len; t++) max = scores[t] > max ? scores[t] : max;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; t++) {
        scores[t] = exp_nonpositive(scores[t] - max);
        sum += scores[t];
    }
    return 1.0f / sum;
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
#define STORE_F32(x) (x)
#define STORE_BF16(x) f32_to_bf16(x)

/* The kernel for one element type. `dim` is a compile-time constant where the dispatch can make it
 * one (64, 128), so the head_dim loops unroll fully. Query head i of the task (i = local kv head *
 * group + g) keeps the score of context token first + t at scores[i * n + t] (n = len - first
 * tokens seen) and its output sums at acc[i * dim]. */
#define DEFINE_KERNEL(SUFFIX, T, LOAD, STORE)                                                       \
    static inline __attribute__((always_inline)) void scores_##SUFFIX(                              \
        const Shape *s, const Task *task, const T *keys, const int64_t *table, int64_t first,      \
        int64_t len, const int64_t dim, const float *q, float *scores) {                            \
        const int64_t group = s->num_heads / s->num_kv_heads, nkv = task->kv_end - task->kv_begin; \
        const int64_t head_stride = s->strides[S_KV_HEAD], n = len - first;                         \
        const float cap = s->softcap;                                                               \
        FOR_EACH_ROW(s, keys, table, first, len, task, row, t, {                                    \
            for (int64_t h = 0; h < nkv; h++) {                                                     \
                const T *k = row + h * head_stride;                                                 \
                for (int64_t g = 0; g < group; g++) {                                               \
                    const int64_t i = h * group + g;                                                \
                    const float *qi = q + i * dim;                                                  \
                    float dot = 0.0f;                                                               \
                    _Pragma("omp simd reduction(+ : dot)") for (int64_t d = 0; d < dim; d++) dot += \
                        qi[d] * LOAD(k[d]);                                                         \
                    const float score = dot * s->scale;                                             \
                    scores[i * n + t] = cap > 0.0f ? tanhf(score / cap) * cap : score;              \
                }                                                                                   \
            }                                                                                       \
        });                                                                                         \
    }                                                                                               \
                                                                                                    \
    static inline __attribute__((always_inline)) void weighted_sum_##SUFFIX(                        \
        const Shape *s, const Task *task, const T *values, const int64_t *table, int64_t first,    \
        int64_t len, const int64_t dim, const float *probs, float *acc) {                           \
        const int64_t group = s->num_heads / s->num_kv_heads, nkv = task->kv_end - task->kv_begin; \
        const int64_t head_stride = s->strides[S_KV_HEAD], n = len - first;                         \
        memset(acc, 0, (size_t)(nkv * group * dim) * sizeof(float));                               \
        FOR_EACH_ROW(s, values, table, first, len, task, row, t, {                                  \
            for (int64_t h = 0; h < nkv; h++) {                                                     \
                const T *v = row + h * head_stride;                                                 \
                for (int64_t g = 0; g < group; g++) {                                               \
                    const int64_t i = h * group + g;                                                \
                    const float p = probs[i * n + t];                                               \
                    float *a = acc + i * dim;                                                       \
                    _Pragma("omp simd") for (int64_t d = 0; d < dim; d++) a[d] += p * LOAD(v[d]);   \
                }                                                                                   \
            }                                                                                       \
        });                                                                                         \
    }                                                                                               \
                                                                                                    \
    static inline __attribute__((always_inline)) void run_task_##SUFFIX(                            \
        const Shape *s, const Task *task, T *out, const T *query, const T *kv_cache,               \
        const int64_t dim, Scratch *w) {                                                            \
        const int64_t *st = s->strides;                                                             \
        const int64_t group = s->num_heads / s->num_kv_heads;                                       \
        const int64_t nq = (task->kv_end - task->kv_begin) * group, head0 = task->kv_begin * group; \
        const int64_t len = s->seq_lens[task->seq];                                                 \
        const int64_t *table = s->block_tables + task->seq * st[S_TABLE_ROW];                       \
        const T *q_row = query + task->seq * st[S_QUERY_SEQ] + head0 * st[S_QUERY_HEAD];            \
        T *out_row = out + task->seq * st[S_OUT_SEQ] + head0 * st[S_OUT_HEAD];                      \
        if (len <= 0) { /* nothing to attend to: zeros rather than NaN */                           \
            for (int64_t i = 0; i < nq; i++)                                                        \
                for (int64_t d = 0; d < dim; d++) out_row[i * st[S_OUT_HEAD] + d] = STORE(0.0f);    \
            return;                                                                                 \
        }                                                                                           \
        for (int64_t i = 0; i < nq; i++)                                                            \
            for (int64_t d = 0; d < dim; d++) w->q[i * dim + d] = LOAD(q_row[i * st[S_QUERY_HEAD] + d]); \
        const int64_t first = s->window > 0 && len > s->window ? len - s->window : 0;               \
        const T *keys = kv_cache + task->kv_begin * st[S_KV_HEAD];                                  \
        scores_##SUFFIX(s, task, keys, table, first, len, dim, w->q, w->scores);                    \
        for (int64_t i = 0; i < nq; i++)                                                            \
            w->inv_sum[i] = softmax_unnormalised(w->scores + i * (len - first), len - first);       \
        weighted_sum_##SUFFIX(s, task, keys + st[S_KV_HALF], table, first, len, dim, w->scores, w->acc); \
        for (int64_t i = 0; i < nq; i++)                                                            \
            for (int64_t d = 0; d < dim; d++)                                                       \
                out_row[i * st[S_OUT_HEAD] + d] = STORE(w->acc[i * dim + d] * w->inv_sum[i]);       \
    }                                                                                               \
                                                                                                    \
    static void run_task_any_dim_##SUFFIX(const Shape *s, const Task *task, T *out, const T *query, \
                                          const T *kv_cache, Scratch *w) {                          \
        switch (s->head_dim) {                                                                      \
        case 64: run_task_##SUFFIX(s, task, out, query, kv_cache, 64, w); break;                    \
        case 128: run_task_##SUFFIX(s, task, out, query, kv_cache, 128, w); break;                  \
        default: run_task_##SUFFIX(s, task, out, query, kv_cache, s->head_dim, w); break;           \
        }                                                                                           \
    }                                                                                               \
                                                                                                    \
    int paged_attention_decode_##SUFFIX(                                                            \
        T *out, const T *query, const T *kv_cache, const int64_t *block_tables,                     \
        const int64_t *seq_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,         \
        int64_t head_dim, int64_t block_size, const int64_t *strides, float scale, int64_t window,  \
        float softcap, int num_threads) {                                                           \
        const Shape s = {num_seqs, num_heads, num_kv_heads, head_dim, block_size,                  \
                         strides,  block_tables, seq_lens, scale, window, softcap};                 \
        const Split split = split_tasks(num_seqs, num_kv_heads, num_threads);                       \
        const int64_t heads_per_task = split.kv_heads_per_task * (num_heads / num_kv_heads);        \
        int64_t longest = longest_context(seq_lens, num_seqs);                                      \
        if (window > 0 && longest > window) longest = window; /* scores kept per task */            \
        int failed = 0;                                                                             \
        _Pragma("omp parallel num_threads(num_threads) reduction(| : failed)") {                    \
            Scratch w;                                                                              \
            failed = scratch_alloc(&w, heads_per_task, head_dim, longest);                          \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t i = 0; i < split.num_tasks; i++) { \
                if (failed) continue;                                                               \
                const Task task = task_at(&split, num_kv_heads, i);                       \
                run_task_any_dim_##SUFFIX(&s, &task, out, query, kv_cache, &w);                     \
            }                                                                                       \
            scratch_free(&w);                                                                       \
        }                                                                                           \
        return failed ? -1 : 0;                                                                     \
    }

/* How the (sequence, kv head) grid is cut into tasks. */
typedef struct {
    int64_t kv_heads_per_task, tasks_per_seq, num_tasks;
} Split;

static Split split_tasks(int64_t num_seqs, int64_t num_kv_heads, int num_threads) {
    /* Whole sequences while there are a few tasks per thread, else split the kv heads. */
    int64_t per_seq = 1;
    while (per_seq < num_kv_heads && num_seqs * per_seq < 4 * (int64_t)num_threads) per_seq++;
    const int64_t heads = (num_kv_heads + per_seq - 1) / per_seq;
    per_seq = (num_kv_heads + heads - 1) / heads;
    return (Split){heads, per_seq, num_seqs * per_seq};
}

static Task task_at(const Split *split, int64_t num_kv_heads, int64_t i) {
    /* Longest contexts first (the runner sorts decodes shortest first): a shorter idle tail. */
    const int64_t index = split->num_tasks - 1 - i;
    const int64_t seq = index / split->tasks_per_seq, part = index % split->tasks_per_seq;
    const int64_t begin = part * split->kv_heads_per_task;
    const int64_t end = begin + split->kv_heads_per_task < num_kv_heads ? begin + split->kv_heads_per_task
                                                                       : num_kv_heads;
    return (Task){seq, begin, end};
}

static int64_t longest_context(const int64_t *seq_lens, int64_t num_seqs) {
    int64_t longest = 1;
    for (int64_t i = 0; i < num_seqs; i++) longest = seq_lens[i] > longest ? seq_lens[i] : longest;
    return longest;
}

static int scratch_alloc(Scratch *w, int64_t heads, int64_t head_dim, int64_t longest) {
    w->q = malloc((size_t)(heads * head_dim) * sizeof(float));
    w->acc = malloc((size_t)(heads * head_dim) * sizeof(float));
    w->inv_sum = malloc((size_t)heads * sizeof(float));
    w->scores = malloc((size_t)(heads * longest) * sizeof(float));
    return !w->q || !w->acc || !w->inv_sum || !w->scores;
}

static void scratch_free(Scratch *w) {
    free(w->q);
    free(w->acc);
    free(w->inv_sum);
    free(w->scores);
}

DEFINE_KERNEL(f32, float, LOAD_F32, STORE_F32)
DEFINE_KERNEL(bf16, uint16_t, LOAD_BF16, STORE_BF16)
