/* Paged prefill attention on the CPU: the new tokens of a prefill chunk attend causally to their
 * sequence's context, all of it read through the block table (the chunk's own K/V were written to
 * the cache first), so a chunk after cached context (chunked prefill, a prefix-cache hit) and one
 * that starts its sequence take the same path.
 *
 * Flash-attention style: one work item is (chunk, KV head, tile of 16 query positions); its
 * 16 x G query rows go over the context one 16-key block at a time with an online softmax (running
 * max, running sum, rescaled accumulator), so no score matrix bigger than a block is ever stored.
 * Only the vectorized form exists (block size 16, D of 64 or 128, G <= 16); the engine uses SDPA
 * otherwise. Queries and outputs are float32 or bfloat16; the cache float32, bfloat16, or int8 with
 * per-(block, KV head) scales; all arithmetic is in float32.
 *
 * Layouts as in paged_decode.c; chunk i has q_lens[i] new tokens from row starts[i] of q and out,
 * at positions seq_lens[i] - q_lens[i] .. seq_lens[i] - 1.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define BLOCK 16
#define TILE 16 /* query positions per work item */
#define MAX_G 16

/* One tile: query positions p0 .. p0+rows-1 of a chunk, KV heads h0 .. h0+nh-1, each as R
 * (<= TILE * G) query rows r = i * G + j (position p0 + i, query head h * G + j; rows past
 * `rows` * G are zero padding).
 * Scores are kept transposed, st[t][r] for the block's 16 keys, so every step of the online
 * softmax runs along the rows in vectors, and q . k needs no horizontal sums: the queries are
 * transposed once per tile (qt[d][r]) and each key element is broadcast against 16 rows.
 * On a bfloat16 cache with the bfloat16 dot instruction (`pairs`), q . k takes pairs of elements
 * at a time (qt then holds pairs of bfloat16 queries) against the block as stored.
 * The blocks go in order in the outer loop and the heads in the inner one, so a decode (one
 * position, all heads in one tile) reads each block's heads as one run of memory, as the decode
 * kernel does; a head's arithmetic is the same whatever the other heads of its tile.
 * Scratch `w`: per head, qt [D][R], st [16][R], acc [R][D], m, l, corr [R] each
 * (`tile_scratch` floats). */
static inline size_t tile_scratch(int R, int d) { return (size_t)R * (2 * (size_t)d + BLOCK + 3); }

static inline __attribute__((always_inline)) void
prefill_tile(const void *q, int64_t q_stride, void *out, int64_t out_stride, const void *k_cache,
             const void *v_cache, const float *k_scale, const float *v_scale, const int32_t *table,
             int p0, int rows, int window, int hkv, int h0, int nh, int g, const int nv,
             const int kind, const int bf16, float scale, float *w) {
    const int quantized = kind == CACHE_I8;
    const int d = 16 * nv;
    const int64_t block_elems = (int64_t)BLOCK * d;
    /* rows, padded to whole 16-wide vectors (a decode run as a chunk of one position then costs
     * one vector of rows, not 16 * G); each row is a lane of its own, so padding changes no row */
    const int R = (rows * g + 15) / 16 * 16, nrv = R / 16;
    const size_t per_head = tile_scratch(R, d);
#define HEAD_STATE(hh)                                                                             \
    float *qt = w + (size_t)(hh)*per_head, *st = qt + (size_t)d * R,                               \
          *acc = st + (size_t)BLOCK * R;                                                           \
    float *m = acc + (size_t)R * d, *l = m + R, *corr = l + R;                                     \
    uint32_t *qt2 = (uint32_t *)qt;                                                                \
    (void)qt2;                                                                                     \
    (void)st
    int qpos[TILE * MAX_G];
    /* a bfloat16 or int8 block of the head widened to floats */
    float kw[BLOCK * 128], vw[BLOCK * 128];
    /* pairs: qt2[e / 2][r] = (q_r[e], q_r[e + 1]) unscaled (the scale multiplies the scores) */
    const int pairs = HAVE_BF16_DOT && kind == CACHE_BF16;
    for (int r = 0; r < R; r++) qpos[r] = p0 + r / g;
    for (int hh = 0; hh < nh; hh++) {
        HEAD_STATE(hh);
        const int h = h0 + hh;
        for (int r = 0; r < R; r++) {
            const int i = r / g, j = r % g;
            const int64_t row = (int64_t)i * q_stride + (int64_t)(h * g + j) * d;
            if (pairs)
                for (int e = 0; e < d; e += 2)
                    qt2[(size_t)(e / 2) * R + r] =
                        i < rows ? ((const uint16_t *)q)[row + e] |
                                       (uint32_t)((const uint16_t *)q)[row + e + 1] << 16
                                 : 0u;
            else
                for (int e = 0; e < d; e++)
                    qt[(size_t)e * R + r] = i < rows ? load_act(q, row + e, bf16) * scale : 0.0f;
            m[r] = -1e30f; /* finite: a row with no visible key yet never computes inf - inf */
            l[r] = 0.0f;
        }
        memset(acc, 0, sizeof(float) * (size_t)R * d);
    }
    const int last = p0 + rows - 1;
    const int first_any = window > 0 ? (p0 - window + 1 > 0 ? p0 - window + 1 : 0) : 0;
    for (int b = first_any / BLOCK; b <= last / BLOCK; b++) {
        const int kp0 = b * BLOCK;
        /* keys past the tile's last query are unused */
        const int nk = last - kp0 + 1 < BLOCK ? last - kp0 + 1 : BLOCK;
        /* causal (and window) mask: only where the block reaches past a row's position or before its window */
        const int masked = kp0 + nk - 1 > p0 || (window > 0 && kp0 <= last - window);
        for (int hh = 0; hh < nh; hh++) {
            HEAD_STATE(hh);
            const int h = h0 + hh;
            const int64_t at = ((int64_t)table[b] * hkv + h) * block_elems;
            const float *k = pairs ? NULL : block_as_float(k_cache, at, block_elems, kind, kw);
            const float *v = block_as_float(v_cache, at, block_elems, kind, vw);
            const float ks = quantized ? k_scale[(int64_t)table[b] * hkv + h] : 1.0f;
            const float vs = quantized ? v_scale[(int64_t)table[b] * hkv + h] : 1.0f;
            /* st[t][r] = q_r . k_t, computed for all 16 keys of the block (a constant count keeps the 16
             * partial sums in registers; the block is allocated whole) and kept for the first nk */
#if HAVE_BF16_DOT
            if (pairs) {
                /* each pair of key elements, one 32-bit word, broadcast against the pairs of 16 rows */
                const uint32_t *k2 = (const uint32_t *)((const uint16_t *)k_cache + at);
                for (int rv = 0; rv < nrv; rv++) {
                    __m512 part[BLOCK];
                    for (int t = 0; t < BLOCK; t++) part[t] = _mm512_setzero_ps();
                    for (int e2 = 0; e2 < d / 2; e2++) {
                        const __m512bh qe =
                            (__m512bh)_mm512_loadu_si512(qt2 + (size_t)e2 * R + 16 * rv);
                        for (int t = 0; t < BLOCK; t++)
                            part[t] = _mm512_dpbf16_ps(
                                part[t], qe, (__m512bh)_mm512_set1_epi32((int)k2[t * d / 2 + e2]));
                    }
                    for (int t = 0; t < BLOCK; t++)
                        if (t < nk) store16(st + (size_t)t * R + 16 * rv, (v16f)part[t] * scale);
                }
            } else
#endif
                for (int rv = 0; rv < nrv; rv++) {
                    v16f part[BLOCK];
                    for (int t = 0; t < BLOCK; t++) part[t] = (v16f){0};
                    for (int e = 0; e < d; e++) {
                        const v16f qe = load16(qt + (size_t)e * R + 16 * rv);
                        for (int t = 0; t < BLOCK; t++) part[t] += qe * k[t * d + e];
                    }
                    for (int t = 0; t < BLOCK; t++)
                        if (t < nk)
                            store16(st + (size_t)t * R + 16 * rv,
                                    quantized ? part[t] * ks : part[t]);
                }
            if (masked)
                for (int t = 0; t < nk; t++)
                    for (int r = 0; r < R; r++)
                        if (kp0 + t > qpos[r] || (window > 0 && kp0 + t <= qpos[r] - window))
                            st[(size_t)t * R + r] = -INFINITY;
            /* online softmax along the rows */
            for (int r = 0; r < R; r++) corr[r] = m[r];
            for (int t = 0; t < nk; t++) {
                const float *sr = st + (size_t)t * R;
#pragma omp simd
                for (int r = 0; r < R; r++) corr[r] = sr[r] > corr[r] ? sr[r] : corr[r];
            }
#pragma omp simd
            for (int r = 0; r < R; r++) {
                const float mn = corr[r];
                corr[r] = exp_nonpositive(m[r] - mn);
                m[r] = mn;
                l[r] *= corr[r];
            }
            for (int t = 0; t < nk; t++) {
                float *sr = st + (size_t)t * R;
#pragma omp simd
                for (int r = 0; r < R; r++) {
                    const float e = sr[r] == -INFINITY ? 0.0f : exp_nonpositive(sr[r] - m[r]);
                    sr[r] = e;
                    l[r] += e;
                }
            }
            /* acc[r] = acc[r] * corr[r] + sum_t p[t][r] v_t, a few rows at a time */
            add_weighted_v(acc, corr, st, 1, R, v, 0, 0, nk, rows * g, nv, quantized, vs);
        }
    }
    for (int hh = 0; hh < nh; hh++) {
        HEAD_STATE(hh);
        const int h = h0 + hh;
        (void)corr;
        for (int r = 0; r < rows * g; r++) {
            const int i = r / g, j = r % g;
            const float inv = 1.0f / l[r];
            const int64_t dst = (int64_t)i * out_stride + (int64_t)(h * g + j) * d;
            for (int c = 0; c < nv; c++)
                store16_act(out, dst + 16 * c, load16(acc + (size_t)r * d + 16 * c) * inv, bf16);
        }
    }
#undef HEAD_STATE
}

/* Prefill attention. kind (simd.h): a float32 cache, a bfloat16 one, or int8 with per-(block, KV
 * head) scales k_scale / v_scale (else NULL); bf16: q and out are bfloat16, else float32 (float32
 * queries read float32 or int8 caches, bfloat16 ones bfloat16 or int8 caches). Returns 0; -1 when
 * scratch memory could not be allocated; -2 for a case without a path (block size not 16, D not
 * 64 or 128, G over 16, another pairing of types). */
int sluice_paged_prefill(const void *q, int64_t q_stride, void *out, int64_t out_stride,
                         const int64_t *starts, const int32_t *q_lens, const int32_t *seq_lens,
                         int n, const void *k_cache, const void *v_cache, const float *k_scale,
                         const float *v_scale, const int32_t *block_tables, int64_t bt_stride,
                         int hkv, int g, int d, int bs, float scale, int window, int kind, int bf16,
                         int num_threads) {
    if (bs != BLOCK || g > MAX_G || (d != 64 && d != 128)) return -2;
    if (!attention_types_served(kind, bf16, k_scale)) return -2;
    if (num_threads < 1) num_threads = 1;
    const int64_t act_bytes = bf16 ? 2 : 4;
    /* work items: a decode (a chunk of one position) is one item with all its heads; a longer
     * chunk is an item per (tile of TILE positions, head) */
    int64_t count = 0;
    for (int i = 0; i < n; i++)
        count += q_lens[i] == 1 ? 1 : (int64_t)(q_lens[i] + TILE - 1) / TILE * hkv;
    /* chunk, tile, head */
    int32_t(*items)[3] = malloc(sizeof(*items) * (size_t)(count > 0 ? count : 1));
    if (items == NULL) return -1;
    int64_t at = 0;
    for (int i = 0; i < n; i++) {
        if (q_lens[i] == 1) {
            items[at][0] = i, items[at][1] = 0, items[at][2] = -1;
            at++;
            continue;
        }
        for (int ti = 0; ti < (q_lens[i] + TILE - 1) / TILE; ti++)
            for (int h = 0; h < hkv; h++) {
                items[at][0] = i, items[at][1] = ti, items[at][2] = h;
                at++;
            }
    }
    const int tile_rows = TILE * g, decode_rows = hkv * ((g + 15) / 16 * 16);
    const size_t per_thread =
        tile_scratch(1, d) * (size_t)(tile_rows > decode_rows ? tile_rows : decode_rows);
    float *scratch = malloc(sizeof(float) * per_thread * num_threads);
    if (scratch == NULL) {
        free(items);
        return -1;
    }
    /* later tiles see more context: hand them out first so the threads finish together */
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t it = count - 1; it >= 0; it--) {
        float *w = scratch + per_thread * omp_get_thread_num();
        const int i = items[it][0], ti = items[it][1];
        const int h0 = items[it][2] < 0 ? 0 : items[it][2], nh = items[it][2] < 0 ? hkv : 1;
        const int rows = q_lens[i] - ti * TILE < TILE ? q_lens[i] - ti * TILE : TILE;
        const int p0 = seq_lens[i] - q_lens[i] + ti * TILE;
        const void *qi = (const char *)q + (starts[i] + (int64_t)ti * TILE) * q_stride * act_bytes;
        void *oi = (char *)out + (starts[i] + (int64_t)ti * TILE) * out_stride * act_bytes;
        const int32_t *table = block_tables + (int64_t)i * bt_stride;
#define TILE_OF(NV, KIND, BF16)                                                                    \
    prefill_tile(qi, q_stride, oi, out_stride, k_cache, v_cache, k_scale, v_scale, table, p0,      \
                 rows, window, hkv, h0, nh, g, NV, KIND, BF16, scale, w)
        CALL_SPECIALIZED(TILE_OF, d, kind, bf16);
#undef TILE_OF
    }
    free(scratch);
    free(items);
    return 0;
}
