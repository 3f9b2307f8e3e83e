/* Paged decode attention on the CPU: one new query token per sequence attends to its whole
 * context, read in place through the block table.
 *
 * Why C: in torch this step is thousands of tiny matmuls (a few query rows against one 16-token
 * block) plus gathers, softmax and sums over padded score tensors, and on two cores it cost
 * about as much as all the decode step's matmuls. Here each sequence is one work item: scores of
 * its query heads against every cached key, a softmax, then the weighted sum of the values. K and
 * V are read once, in place, block by block with all KV heads of a block together (one contiguous
 * run of memory): on this path the step is bound by memory bandwidth, not by arithmetic.
 *
 * Threads come from OpenMP. Loaded into a process that already holds torch's libgomp (same
 * soname), the kernel runs on torch's own thread team instead of starting a second one.
 *
 * Layouts (strides in elements of the data type; q and out float32 or bfloat16):
 *   q    [tokens, Hq, D]: row stride q_stride, query head hq = h * G + j uses KV head h;
 *   out  [tokens, Hq, D]: row stride out_stride;
 *   k/v  [num_blocks, Hkv, block_size, D] contiguous (one block of one head is a [bs, D] matrix),
 *        float32, bfloat16, or int8 with float32 scales k_scale / v_scale [num_blocks, Hkv];
 *   block_tables [n, bt_stride] int32, seq_lens [n] int32, tokens [n] int64: decode i is the
 *   row tokens[i] of q and out, its context is seq_lens[i] tokens.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int d) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < d; i++) acc += a[i] * b[i];
    return acc;
}

/* The generic path (any block size and D), one KV head of one sequence: q and out point at its G
 * query heads ([G, D] rows). scores: scratch of g * len floats; acc: g * d floats. */
static inline __attribute__((always_inline)) void
decode_item(const float *q, float *out, const float *k_cache, const float *v_cache,
            const int32_t *table, int first, int len, int hkv, int h, int g, int d, int bs,
            float scale, float *scores, float *acc) {
    const int64_t block_elems = (int64_t)bs * d;
    const int count = len - first;

    /* scores[j][p] = q_j . k_p * scale, for context positions p = first .. len-1 */
    for (int p = first; p < len;) {
        const int blk = table[p / bs];
        const int off = p % bs;
        const int n = (bs - off) < (len - p) ? (bs - off) : (len - p);
        const float *k = k_cache + ((int64_t)blk * hkv + h) * block_elems + (int64_t)off * d;
        for (int t = 0; t < n; t++)
            for (int j = 0; j < g; j++)
                scores[(int64_t)j * count + (p - first) + t] =
                    dot(q + j * d, k + (int64_t)t * d, d) * scale;
        p += n;
    }

    /* softmax per query head; the division is left to the end */
    float inv_sum[64];
    for (int j = 0; j < g; j++) {
        float *s = scores + (int64_t)j * count;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int i = 0; i < count; i++) m = s[i] > m ? s[i] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < count; i++) {
            const float e = exp_nonpositive(s[i] - m);
            s[i] = e;
            sum += e;
        }
        inv_sum[j] = 1.0f / sum;
    }

    /* acc[j] = sum_p w[j][p] * v_p */
    memset(acc, 0, sizeof(float) * (size_t)g * d);
    for (int p = first; p < len;) {
        const int blk = table[p / bs];
        const int off = p % bs;
        const int n = (bs - off) < (len - p) ? (bs - off) : (len - p);
        const float *v = v_cache + ((int64_t)blk * hkv + h) * block_elems + (int64_t)off * d;
        for (int t = 0; t < n; t++) {
            const float *vt = v + (int64_t)t * d;
            for (int j = 0; j < g; j++) {
                const float w = scores[(int64_t)j * count + (p - first) + t];
                float *a = acc + j * d;
#pragma omp simd
                for (int i = 0; i < d; i++) a[i] += w * vt[i];
            }
        }
        p += n;
    }
    for (int j = 0; j < g; j++) {
        float *o = out + j * d;
        const float c = inv_sum[j];
#pragma omp simd
        for (int i = 0; i < d; i++) o[i] = acc[j * d + i] * c;
    }
}

/* The fast path: block_size 16, D 64 or 128, G <= 16, in 16-float vectors (simd.h). A block's 16
 * scores for one query are 16 dot products, summed across lanes together by transpose_sum16. */
#define FAST_BLOCK 16
#define FAST_MAX_G 16
#define MAX_PARTS 64 /* a context is split over at most this many threads */

/* How far ahead of the block being computed on its K (then V) blocks are asked for, when they lie
 * elsewhere in memory: a block of all heads is a few KiB, read in a fraction of the time memory
 * takes to deliver it, so only many requests in flight keep the bus busy when a sequence's blocks
 * are scattered, as they come to be in a long-running server. A block that follows the one before
 * it in memory (as in a fresh cache) is left to the hardware prefetcher, which streams a run of
 * adjacent blocks by itself: asking for it too only costs instructions. Measured on SmolLM2's
 * shapes, a decode step's 30 layers: scattered blocks ~39-42 ms with 48 KiB ahead, ~43 with no
 * prefetching; blocks in order ~17.7 ms, ~26 when every block was prefetched too. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES (48 << 10)
#endif

/* Whether block b of a sequence lies right after block b - 1 in memory. */
static inline int follows(const int32_t *table, int b) { return table[b] == table[b - 1] + 1; }

/* One sequence's positions first .. len-1, its KV heads h0 .. h1-1 (all of them, or one where
 * a few sequences are spread over the threads by head), for block_size 16 and D = 16 * nv: a
 * block's K (then V) rows of every KV head are one contiguous run of memory, read once and used
 * by all G queries of each head. kind: what the cache holds (simd.h); an int8 one has one float32
 * scale per (block, KV head) in k_scale / v_scale ([num_blocks, Hkv]): the K scale multiplies a
 * block's scores, the V scale its weights. bf16: q and out are bfloat16 (else float32). Scratch: qs, Hq * D floats (the
 * queries, scaled); acc, Hq * D floats (the outputs before the division); scores, Hq rows of
 * `stride` floats, kept per whole block from base = first rounded down to the block. With `part`
 * (a part of a context split over threads, see `merge_parts`), the rows' float32 sums before the
 * division go to `part` ([Hq, D]) and each row's maximum score and sum of weights to `part_stats`
 * ([Hq, 2]) instead of the output to `out`. */
static inline __attribute__((always_inline)) void
decode_seq_fast(const void *q, void *out, const void *k_cache, const void *v_cache,
                const float *k_scale, const float *v_scale, const int32_t *table, int first,
                int len, int hkv, int h0, int h1, int g, const int nv, const int kind,
                const int bf16, float scale, float *qs, float *acc_all, float *scores, float *part,
                float *part_stats) {
    const int d = 16 * nv, hq = hkv * g;
    const int64_t block_elems = (int64_t)FAST_BLOCK * d;
    const int64_t elem_bytes = cache_elem_bytes(kind);
    const int quantized = kind == CACHE_I8;
    const int b0 = first / FAST_BLOCK, b1 = (len + FAST_BLOCK - 1) / FAST_BLOCK;
    const int64_t stride = (int64_t)(b1 - b0) * FAST_BLOCK;
    const int lo = first - b0 * FAST_BLOCK, hi = len - b0 * FAST_BLOCK;
    float widened[FAST_BLOCK * 128]; /* a widened block of one head, read by all its queries */

    /* that path reads the bfloat16 queries as they are */
    if (!(HAVE_BF16_DOT && kind == CACHE_BF16))
        for (int r = h0 * g; r < h1 * g; r++)
            for (int c = 0; c < nv; c++)
                store16(qs + r * d + 16 * c, load16_act(q, r * d + 16 * c, bf16) * scale);

    const int64_t block_bytes = hkv * block_elems * elem_bytes; /* all heads of a block: one run */
    const int ahead = block_bytes >= PREFETCH_BYTES ? 1 : (int)(PREFETCH_BYTES / block_bytes);
    for (int b = b0 + 1; b < b0 + ahead && b < b1; b++)
        if (!follows(table, b))
            prefetch_bytes((const char *)k_cache + (int64_t)table[b] * block_bytes, block_bytes);
    for (int b = b0; b < b1; b++) {
        const int64_t kb = (int64_t)table[b] * hkv * block_elems;
        if (b + ahead < b1 && !follows(table, b + ahead))
            prefetch_bytes((const char *)k_cache + (int64_t)table[b + ahead] * block_bytes,
                           block_bytes);
        for (int h = h0; h < h1; h++) {
#if HAVE_BF16_DOT
            if (kind == CACHE_BF16) {
                /* bfloat16 queries against the bfloat16 block as stored; the scale comes after */
                const uint16_t *k = (const uint16_t *)k_cache + kb + h * block_elems;
                for (int j = 0; j < g; j++) {
                    const uint16_t *qr = (const uint16_t *)q + (h * g + j) * d;
                    v16f part[16];
                    for (int t = 0; t < FAST_BLOCK; t++)
                        part[t] = dot_bf16_partial(qr, k + t * d, nv / 2);
                    store16(scores + (h * g + j) * stride + (b - b0) * FAST_BLOCK,
                            transpose_sum16(part) * scale);
                }
                continue;
            }
#endif
            const float *k =
                block_as_float(k_cache, kb + h * block_elems, block_elems, kind, widened);
            const float ks = quantized ? k_scale[(int64_t)table[b] * hkv + h] : 1.0f;
            for (int j = 0; j < g; j++) {
                const float *qr = qs + (h * g + j) * d;
                v16f part[16];
                for (int t = 0; t < FAST_BLOCK; t++) {
                    v16f acc = load16(qr) * load16(k + t * d);
                    for (int c = 1; c < nv; c++)
                        acc += load16(qr + 16 * c) * load16(k + t * d + 16 * c);
                    part[t] = acc;
                }
                v16f sc = transpose_sum16(part);
                if (quantized) sc *= ks;
                store16(scores + (h * g + j) * stride + (b - b0) * FAST_BLOCK, sc);
            }
        }
    }

    /* in flight during the softmax; the first starts a run */
    for (int b = b0; b < b0 + ahead && b < b1; b++)
        if (b == b0 || !follows(table, b))
            prefetch_bytes((const char *)v_cache + (int64_t)table[b] * block_bytes, block_bytes);

    /* softmax over positions first .. len-1 (rows of the first and last block outside are unused);
     * the outputs start at zero and are divided by the sums at the end */
    for (int r = h0 * g; r < h1 * g; r++) {
        float *s = scores + r * stride;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int i = lo; i < hi; i++) m = s[i] > m ? s[i] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int i = lo; i < hi; i++) {
            const float e = exp_nonpositive(s[i] - m);
            s[i] = e;
            sum += e;
        }
        qs[r] = 1.0f / sum; /* the queries are no longer needed: qs keeps the Hq inverse sums */
        if (part_stats != NULL) part_stats[2 * r] = m, part_stats[2 * r + 1] = sum;
        for (int c = 0; c < nv; c++) store16(acc_all + r * d + 16 * c, (v16f){0});
    }

    for (int b = b0; b < b1; b++) {
        const int64_t vb = (int64_t)table[b] * hkv * block_elems;
        if (b + ahead < b1 && !follows(table, b + ahead))
            prefetch_bytes((const char *)v_cache + (int64_t)table[b + ahead] * block_bytes,
                           block_bytes);
        const int t0 = b == b0 ? lo : 0;
        const int t1 = b == b1 - 1 ? hi - (b - b0) * FAST_BLOCK : FAST_BLOCK;
        for (int h = h0; h < h1; h++) {
            /* bfloat16 V rows are widened in registers as read; int8 blocks once, into `widened` */
            const void *v = kind == CACHE_BF16
                                ? (const void *)((const uint16_t *)v_cache + vb + h * block_elems)
                                : (const void *)block_as_float(v_cache, vb + h * block_elems,
                                                               block_elems, kind, widened);
            const float vs = quantized ? v_scale[(int64_t)table[b] * hkv + h] : 1.0f;
            add_weighted_v(acc_all + h * g * d, NULL,
                           scores + h * g * stride + (b - b0) * FAST_BLOCK, stride, 1, v,
                           kind == CACHE_BF16, t0, t1, g, nv, quantized, vs);
        }
    }
    if (part != NULL) {
        memcpy(part + h0 * g * d, acc_all + h0 * g * d,
               sizeof(float) * (size_t)((h1 - h0) * g * d));
        return;
    }
    for (int r = h0 * g; r < h1 * g; r++) {
        const float c_r = qs[r];
        for (int c = 0; c < nv; c++)
            store16_act(out, r * d + 16 * c, load16(acc_all + r * d + 16 * c) * c_r, bf16);
    }
}

/* A context split into `parts` runs of positions, each with its own softmax (`decode_seq_fast`
 * with `part`): the output is the parts' sums rescaled to the largest maximum score M,
 *   out = sum_p acc_p * exp(m_p - M) / sum_p sum_p * exp(m_p - M),
 * a part without positions counting for nothing. rows: Hq; d: 16 * nv. */
static void merge_parts(void *out, const float *part, const float *stats, int parts, int rows,
                        const int nv, const int bf16) {
    const int d = 16 * nv;
    for (int r = 0; r < rows; r++) {
        float m = -INFINITY, total = 0.0f, w[MAX_PARTS];
        for (int p = 0; p < parts; p++)
            if (stats[(p * rows + r) * 2 + 1] > 0.0f && stats[(p * rows + r) * 2] > m)
                m = stats[(p * rows + r) * 2];
        for (int p = 0; p < parts; p++) {
            const float sum = stats[(p * rows + r) * 2 + 1];
            w[p] = sum > 0.0f ? exp_nonpositive(stats[(p * rows + r) * 2] - m) : 0.0f;
            total += w[p] * sum;
        }
        for (int c = 0; c < nv; c++) {
            v16f o = {0};
            for (int p = 0; p < parts; p++)
                if (w[p] > 0.0f) o += load16(part + ((int64_t)p * rows + r) * d + 16 * c) * w[p];
            store16_act(out, r * d + 16 * c, o * (1.0f / total), bf16);
        }
    }
}

/* Decode attention. kind (simd.h): a float32 cache, a bfloat16 one, or int8 with per-(block, KV
 * head) scales k_scale / v_scale (else NULL); bf16: q and out are bfloat16, else float32. Float32
 * queries read float32 or int8 caches, bfloat16 ones bfloat16 or int8 caches. The generic path
 * serves only float32 queries on a float32 cache; every other case needs the vectorized shapes
 * (block 16, D 64 or 128, G <= 16). Returns 0, or -1 when scratch memory could not be allocated,
 * -2 for a case without a path. */
int sluice_paged_decode(const void *q, int64_t q_stride, void *out, int64_t out_stride,
                        const int64_t *tokens, int n, const void *k_cache, const void *v_cache,
                        const float *k_scale, const float *v_scale, const int32_t *block_tables,
                        int64_t bt_stride, const int32_t *seq_lens, int hkv, int g, int d, int bs,
                        float scale, int window, int max_len, int kind, int bf16, int num_threads) {
    if (g > 64) return -2;
    if (num_threads < 1) num_threads = 1;
    const int hq = hkv * g;
    const int fast = bs == FAST_BLOCK && g <= FAST_MAX_G && (d == 64 || d == 128);
    if (!attention_types_served(kind, bf16, k_scale) || (!fast && (kind != CACHE_F32 || bf16)))
        return -2;
    const int64_t act_bytes = bf16 ? 2 : 4;
    /* Work items: one sequence each, all its heads, so its blocks are read front to back. With
     * fewer sequences than threads (a lone request decoding), each context is cut instead into
     * `parts` runs of whole blocks, one a work item, merged at the end (`merge_parts`): every
     * thread then streams one stretch of memory, all heads of each block, however few heads
     * there are to share out (on the generic path, one KV head a work item instead). With fewer
     * sequences than two a thread, one (sequence, KV head) a work item, so every thread has a
     * share; a head's arithmetic is the same either way. */
    int parts = 1;
    if (fast && n < num_threads)
        parts = (num_threads + n - 1) / n < MAX_PARTS ? (num_threads + n - 1) / n : MAX_PARTS;
    const int items_per_seq = parts > 1 ? parts : n < 2 * num_threads ? hkv : 1;
    /* per thread: scores of every head (with room for whole first and last blocks), then the
     * scaled queries and the outputs (fast path) or one head's accumulator (generic path); then,
     * for a split context, each part's sums and statistics */
    const size_t scores_len = (size_t)hq * (max_len + 2 * (size_t)bs);
    const size_t per_thread = scores_len + 2 * (size_t)hq * d;
    const size_t part_len = parts > 1 ? (size_t)n * parts * hq * (d + 2) : 0;
    float *scratch = malloc(sizeof(float) * (per_thread * num_threads + part_len));
    if (scratch == NULL) return -1;
    float *part_sums = scratch + per_thread * num_threads,
          *part_stats = part_sums + (size_t)n * parts * hq * d;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int item = 0; item < n * items_per_seq; item++) {
        const int i = item / items_per_seq, k = item % items_per_seq;
        float *scores = scratch + per_thread * omp_get_thread_num();
        float *qs = scores + scores_len, *acc = qs + (size_t)hq * d;
        const int len = seq_lens[i];
        const int window_first = (window > 0 && len > window) ? len - window : 0;
        int first = window_first, last = len, h0 = parts > 1 || items_per_seq == 1 ? 0 : k;
        const int h1 = parts > 1 || items_per_seq == 1 ? hkv : h0 + 1;
        float *part = NULL, *stats = NULL;
        if (parts > 1) { /* part k: its share of the context's blocks, and of its positions */
            const int b0 = window_first / bs, nb = (len + bs - 1) / bs - b0;
            const int p0 = (b0 + nb * k / parts) * bs, p1 = (b0 + nb * (k + 1) / parts) * bs;
            first = p0 > window_first ? p0 : window_first;
            last = p1 < len ? p1 : len;
            part = part_sums + ((size_t)i * parts + k) * hq * d;
            stats = part_stats + ((size_t)i * parts + k) * hq * 2;
            if (first >= last) { /* no positions: it counts for nothing in the merge */
                for (int r = 0; r < hq; r++) stats[2 * r] = -INFINITY, stats[2 * r + 1] = 0.0f;
                continue;
            }
        }
        const void *qi = (const char *)q + tokens[i] * q_stride * act_bytes;
        void *oi = (char *)out + tokens[i] * out_stride * act_bytes;
        const int32_t *table = block_tables + (int64_t)i * bt_stride;
#define FAST(NV, KIND, BF16)                                                                       \
    decode_seq_fast(qi, oi, k_cache, v_cache, k_scale, v_scale, table, first, last, hkv, h0, h1,   \
                    g, NV, KIND, BF16, scale, qs, acc, scores, part, stats)
        if (!fast)
            /* query heads h*G .. h*G+G-1 are consecutive [D] rows of the token's q (and out) */
            for (int h = h0; h < h1; h++)
                decode_item((const float *)qi + (int64_t)h * g * d,
                            (float *)oi + (int64_t)h * g * d, (const float *)k_cache,
                            (const float *)v_cache, table, first, len, hkv, h, g, d, bs, scale,
                            scores, qs);
        else
            CALL_SPECIALIZED(FAST, d, kind, bf16);
#undef FAST
    }
    if (parts > 1)
        for (int i = 0; i < n; i++)
            merge_parts((char *)out + tokens[i] * out_stride * act_bytes,
                        part_sums + (size_t)i * parts * hq * d,
                        part_stats + (size_t)i * parts * hq * 2, parts, hq, d / 16, bf16);
    free(scratch);
    return 0;
}
