/* y = x @ W.T (+ bias) on the CPU with every output element summed in one fixed order, whatever
 * the number of rows in the call and the number of threads: the matmul of deterministic mode.
 *
 * A BLAS or oneDNN picks its blocking over K, and its kernel, by the shape of the call, so a row's
 * result can change with the rows beside it (measured: oneDNN's float32 matmul at SmolLM2's down
 * projection, K = 1536, gives row 0 different bits at 5 rows than at 1). Here element (m, n) is
 * always the same dot product of x row m and W row n, both contiguous over K:
 *   - 16 lane sums, lane l taking k = 16c + l for c = 0, 1, ... in order (with the bfloat16 dot
 *     instruction, lane l takes the pair k = 32c + 2l, 2l + 1); a last partial chunk is read as
 *     if padded with zeros (adding 0 changes nothing);
 *   - the 16 lanes added in the fixed tree of `transpose_sum16`, then the bias, then one rounding
 *     to bfloat16 for a bfloat16 output.
 * Tiles of up to 4 rows x 4 columns share their loads; the tile an element falls in, the blocks
 * and the thread that computes them change only the speed. Threads split the work by blocks of
 * rows and columns, never along K.
 *
 * Layouts: x [M, K] with row stride x_stride, w [N, K] contiguous, bias [N] or NULL, out [M, N]
 * with row stride out_stride; all float32, or all bfloat16 (`bf16`), arithmetic in float32.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define MR 4 /* rows of a tile */
#define NR 4 /* columns of a tile */
#define BLOCK_M 64

#if HAVE_BF16_DOT
#define CHUNK_BF16 32
#else
#define CHUNK_BF16 16
#endif

/* A chunk of `n` (< chunk) elements from p, zero-padded to the chunk, in `buf`. */
static inline const void *padded(const void *p, int64_t n, int64_t elem, void *buf, int64_t chunk) {
    memset(buf, 0, (size_t)(chunk * elem));
    memcpy(buf, p, (size_t)(n * elem));
    return buf;
}

/* The tile's mr x nr dot products over K; lane i * NR + j of the result is (row i, column j). */
static inline __attribute__((always_inline)) v16f tile_sums(const void *x, int64_t xs, const void *w,
                                                            int64_t K, const int mr, const int nr,
                                                            const int bf16) {
    v16f acc[16];
    for (int i = 0; i < 16; i++) acc[i] = (v16f){0};
    if (!bf16) {
        const float *xf = (const float *)x, *wf = (const float *)w;
        const int64_t full = K / 16 * 16;
        for (int64_t k = 0; k < full; k += 16) {
            v16f xv[MR], wv[NR];
            for (int i = 0; i < mr; i++) xv[i] = load16(xf + i * xs + k);
            for (int j = 0; j < nr; j++) wv[j] = load16(wf + j * K + k);
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++) acc[i * NR + j] += xv[i] * wv[j];
        }
        if (full < K) {
            float bx[MR][16], bw[NR][16];
            for (int i = 0; i < mr; i++) {
                const v16f xv = load16(padded(xf + i * xs + full, K - full, 4, bx[i], 16));
                for (int j = 0; j < nr; j++) {
                    const v16f wv = load16(padded(wf + j * K + full, K - full, 4, bw[j], 16));
                    acc[i * NR + j] += xv * wv;
                }
            }
        }
    } else {
        const uint16_t *xh = (const uint16_t *)x, *wh = (const uint16_t *)w;
        const int64_t full = K / CHUNK_BF16 * CHUNK_BF16;
        uint16_t bx[MR][CHUNK_BF16], bw[NR][CHUNK_BF16];
#if HAVE_BF16_DOT
#define STEP(XP, WP)                                                                                   \
    do {                                                                                               \
        __m512bh xv[MR], wv[NR];                                                                       \
        for (int i = 0; i < mr; i++) xv[i] = (__m512bh)_mm512_loadu_si512(XP);                         \
        for (int j = 0; j < nr; j++) wv[j] = (__m512bh)_mm512_loadu_si512(WP);                         \
        for (int i = 0; i < mr; i++)                                                                   \
            for (int j = 0; j < nr; j++)                                                               \
                acc[i * NR + j] = (v16f)_mm512_dpbf16_ps((__m512)acc[i * NR + j], xv[i], wv[j]);       \
    } while (0)
#else
#define STEP(XP, WP)                                                                                   \
    do {                                                                                               \
        v16f xv[MR], wv[NR];                                                                           \
        for (int i = 0; i < mr; i++) xv[i] = widen16((const uint16_t *)(XP));                          \
        for (int j = 0; j < nr; j++) wv[j] = widen16((const uint16_t *)(WP));                          \
        for (int i = 0; i < mr; i++)                                                                   \
            for (int j = 0; j < nr; j++) acc[i * NR + j] += xv[i] * wv[j];                             \
    } while (0)
#endif
        for (int64_t k = 0; k < full; k += CHUNK_BF16) STEP(xh + i * xs + k, wh + j * K + k);
        if (full < K)
            STEP(padded(xh + i * xs + full, K - full, 2, bx[i], CHUNK_BF16),
                 padded(wh + j * K + full, K - full, 2, bw[j], CHUNK_BF16));
#undef STEP
    }
    return transpose_sum16(acc);
}

static inline __attribute__((always_inline)) void tile(const void *x, int64_t xs, const void *w, const void *bias,
                                                       void *out, int64_t os, int64_t K, const int mr,
                                                       const int nr, const int bf16) {
    float sums[16];
    store16(sums, tile_sums(x, xs, w, K, mr, nr, bf16));
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float y = sums[i * NR + j];
            if (bias != NULL) y += load_act(bias, j, bf16);
            if (bf16)
                ((uint16_t *)out)[i * os + j] = float_to_bf16(y);
            else
                ((float *)out)[i * os + j] = y;
        }
}

/* One tile of mr rows and nr columns, mr and nr made constants so the sums stay in registers. */
static void tile_any(const void *x, int64_t xs, const void *w, const void *bias, void *out, int64_t os, int64_t K,
                     int mr, int nr, int bf16) {
#define T(MR_, NR_)                                                          \
    case MR_ * 8 + NR_:                                                      \
        if (bf16)                                                            \
            tile(x, xs, w, bias, out, os, K, MR_, NR_, 1);                   \
        else                                                                 \
            tile(x, xs, w, bias, out, os, K, MR_, NR_, 0);                   \
        return;
    switch (mr * 8 + nr) {
        T(1, 1) T(1, 2) T(1, 3) T(1, 4) T(2, 1) T(2, 2) T(2, 3) T(2, 4)
        T(3, 1) T(3, 2) T(3, 3) T(3, 4) T(4, 1) T(4, 2) T(4, 3) T(4, 4)
        default: return;
    }
#undef T
}

/* Returns 0, or -2 for shapes it does not take. */
int sluice_fixed_order_linear(const void *x, int64_t x_stride, const void *w, const void *bias, void *out,
                              int64_t out_stride, int64_t M, int64_t N, int64_t K, int bf16, int num_threads) {
    if (M < 0 || N < 0 || K < 1) return -2;
    if (num_threads < 1) num_threads = 1;
    const int64_t elem = bf16 ? 2 : 4;
    /* about 8 column blocks a thread, so a decode step's few rows still keep every thread busy */
    int64_t block_n = N / (8 * (int64_t)num_threads) / NR * NR;
    block_n = block_n < 16 ? 16 : block_n > 128 ? 128 : block_n;
    const int64_t nb = (N + block_n - 1) / block_n, mb = (M + BLOCK_M - 1) / BLOCK_M;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads) if (nb * mb > 1)
    for (int64_t bn = 0; bn < nb; bn++)
        for (int64_t bm = 0; bm < mb; bm++) {
            const int64_t m1 = (bm + 1) * BLOCK_M < M ? (bm + 1) * BLOCK_M : M;
            const int64_t n1 = (bn + 1) * block_n < N ? (bn + 1) * block_n : N;
            for (int64_t m = bm * BLOCK_M; m < m1; m += MR)
                for (int64_t n = bn * block_n; n < n1; n += NR) {
                    const int mr = m1 - m < MR ? (int)(m1 - m) : MR, nr = n1 - n < NR ? (int)(n1 - n) : NR;
                    tile_any((const char *)x + m * x_stride * elem, x_stride, (const char *)w + n * K * elem,
                             bias == NULL ? NULL : (const char *)bias + n * elem,
                             (char *)out + (m * out_stride + n) * elem, out_stride, K, mr, nr, bf16);
                }
        }
    return 0;
}
