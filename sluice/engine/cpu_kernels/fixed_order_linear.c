/* y = x @ W.T (+ bias) on the CPU with every output element summed in one fixed order, whatever
 * the number of rows in the call and the number of threads: the matmul of deterministic mode.
 *
 * A BLAS or oneDNN picks its blocking over K, and its kernel, by the shape of the call, so a row's
 * result can change with the rows beside it (measured: oneDNN's float32 matmul at SmolLM2's down
 * projection, K = 1536, gives row 0 different bits at 5 rows than at 1). Here element (m, n) is
 * one running sum in float32 over k = 0, 1, ..., K - 1 in order, one fused multiply-add a step on
 * every build (`fma_vf`; with the bfloat16 dot instruction, one step per pair k, k + 1, as that
 * instruction adds them);
 * then the bias, then one rounding to bfloat16 for a bfloat16 output. Tiles of rows x 32 columns
 * share their loads; which tile an element falls in, and which thread computes it, change only
 * the speed. Threads split the work by blocks of rows and columns, never along K.
 *
 * W is packed once (`sluice_fixed_order_pack`) into panels of 32 output columns, K-major, so a
 * step of the inner loop reads 32 consecutive weights and broadcasts one element of each row of
 * x (the order of a BLAS micro-kernel, which keeps a tile's sums in registers):
 *   float32, or bfloat16 without the dot instruction: panel p, step k: W[32p + c][k] for c < 32;
 *   bfloat16 with it: panel p, pair j: (W[32p + c][2j], W[32p + c][2j + 1]) for c < 32;
 * columns past N and a last odd k are zeros.
 *
 * Layouts: x [M, K] with row stride x_stride, bias [N] or NULL, out [M, N] with row stride
 * out_stride; all float32, or all bfloat16 (`bf16`), arithmetic in float32.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#define NR 32 /* columns of a panel */
#if defined(__AVX512F__)
#define MR 6  /* rows of a tile: 12 sums, 2 weight vectors and a broadcast in 32 registers */
#define VW 16 /* floats a vector */
typedef v16f vf;
static inline vf load_vf(const float *p) { return load16(p); }
static inline vf widen_vf(const uint16_t *p) { return widen16(p); }
#else
/* AVX2: 8-float vectors, as the registers are (16-float ones in 16 registers went through the
 * stack: ~10x slower); a row's sums take the same steps either way, so the same bits */
#define MR 3 /* 12 sums, 4 weight vectors (one reloaded) and a broadcast */
#define VW 8
typedef float vf __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));
static inline vf load_vf(const float *p) {
    vf x;
    memcpy(&x, p, sizeof x);
    return x;
}
static inline vf widen_vf(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, v8u) << 16);
}
#endif
#define NV (NR / VW) /* vectors a panel row */

/* acc + x w, one rounding, on every build: the FMA instruction where the target has one, else
 * fmaf lane by lane (the same result, slowly: only x86 CPUs from before 2013 lack FMA). Written
 * out because the kernels are compiled without contraction (`cpu_kernels.FLAGS`); the Triton
 * matmul's tl.fma is the same step. */
static inline vf fma_vf(vf acc, float x, vf w) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps(_mm512_set1_ps(x), (__m512)w, (__m512)acc);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps(_mm256_set1_ps(x), (__m256)w, (__m256)acc);
#else
    vf r;
    for (int l = 0; l < VW; l++) r[l] = fmaf(x, w[l], acc[l]);
    return r;
#endif
}
#define BLOCK_M (MR * 16)

/* Whether this build uses the bfloat16 dot instruction (its bfloat16 sums pair k). */
int sluice_bf16_dot(void) { return HAVE_BF16_DOT; }

static inline int64_t panels(int64_t n) { return (n + NR - 1) / NR; }

/* Elements (of 4 or 2 bytes) of one packed panel. */
static inline int64_t panel_elems(int64_t K, int bf16) {
    return (bf16 && HAVE_BF16_DOT ? (K + 1) / 2 * 2 : K) * NR;
}

int64_t sluice_fixed_order_packed_bytes(int64_t N, int64_t K, int bf16) {
    return panels(N) * panel_elems(K, bf16) * (bf16 ? 2 : 4);
}

void sluice_fixed_order_pack(const void *w, int64_t N, int64_t K, int bf16, void *packed) {
    const int64_t P = panels(N), per = panel_elems(K, bf16);
    memset(packed, 0, (size_t)(P * per * (bf16 ? 2 : 4)));
    for (int64_t p = 0; p < P; p++)
        for (int64_t c = 0; c < NR && p * NR + c < N; c++) {
            const int64_t n = p * NR + c;
            for (int64_t k = 0; k < K; k++) {
                if (!bf16)
                    ((float *)packed)[p * per + k * NR + c] = ((const float *)w)[n * K + k];
                else if (HAVE_BF16_DOT)
                    ((uint16_t *)packed)[p * per + (k / 2) * 2 * NR + 2 * c + (k & 1)] =
                        ((const uint16_t *)w)[n * K + k];
                else
                    ((uint16_t *)packed)[p * per + k * NR + c] = ((const uint16_t *)w)[n * K + k];
            }
        }
}

static inline uint32_t word_at(const uint16_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* mr rows of x against one panel: out columns 0 .. ncols-1 of those rows. */
static inline __attribute__((always_inline)) void tile(const void *x, int64_t xs, const void *wp,
                                                       int64_t K, const void *bias, void *out,
                                                       int64_t os, int ncols, const int mr,
                                                       const int bf16) {
    vf acc[MR][NV];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < NV; v++) acc[i][v] = (vf){0};
    if (!bf16) {
        const float *xf = (const float *)x, *w = (const float *)wp;
        for (int64_t k = 0; k < K; k++) {
            vf wv[NV];
            for (int v = 0; v < NV; v++) wv[v] = load_vf(w + k * NR + v * VW);
            for (int i = 0; i < mr; i++) {
                const float xv = xf[i * xs + k];
                for (int v = 0; v < NV; v++) acc[i][v] = fma_vf(acc[i][v], xv, wv[v]);
            }
        }
    } else {
        const uint16_t *xh = (const uint16_t *)x, *w = (const uint16_t *)wp;
#if HAVE_BF16_DOT
        /* a step per pair of k: both x elements broadcast as one 32-bit word; a last odd k
         * pairs with zero */
#define PAIR_STEP(J, PAIR_OF_ROW)                                                                  \
    do {                                                                                           \
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + (J)*2 * NR);                          \
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + (J)*2 * NR + NR);                     \
        for (int i = 0; i < mr; i++) {                                                             \
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)(PAIR_OF_ROW));                   \
            acc[i][0] = (v16f)_mm512_dpbf16_ps((__m512)acc[i][0], xb, w0);                         \
            acc[i][1] = (v16f)_mm512_dpbf16_ps((__m512)acc[i][1], xb, w1);                         \
        }                                                                                          \
    } while (0)
        for (int64_t j = 0; j < K / 2; j++) PAIR_STEP(j, word_at(xh + i * xs + 2 * j));
        if (K & 1) PAIR_STEP(K / 2, (uint32_t)xh[i * xs + K - 1]);
#undef PAIR_STEP
#else
        for (int64_t k = 0; k < K; k++) {
            vf wv[NV];
            for (int v = 0; v < NV; v++) wv[v] = widen_vf(w + k * NR + v * VW);
            for (int i = 0; i < mr; i++) {
                const float xv = bf16_to_float(xh[i * xs + k]);
                for (int v = 0; v < NV; v++) acc[i][v] = fma_vf(acc[i][v], xv, wv[v]);
            }
        }
#endif
    }
    for (int i = 0; i < mr; i++) {
        float row[NR];
        memcpy(row, acc[i], sizeof row);
        store_row_act((char *)out + i * os * (bf16 ? 2 : 4), row, ncols, bias, bf16);
    }
}

/* A tile of mr rows, mr made a constant so the sums stay in registers. */
static void tile_rows(const void *x, int64_t xs, const void *wp, int64_t K, const void *bias,
                      void *out, int64_t os, int ncols, int mr, int bf16) {
#define T(R)                                                                                       \
    case R:                                                                                        \
        if (bf16)                                                                                  \
            tile(x, xs, wp, K, bias, out, os, ncols, (R) < MR ? (R) : MR, 1);                      \
        else                                                                                       \
            tile(x, xs, wp, K, bias, out, os, ncols, (R) < MR ? (R) : MR, 0);                      \
        return;
    switch (mr) { T(1) T(2) T(3) T(4) T(5) T(6) default : return; }
#undef T
}

/* Returns 0, or -2 for shapes it does not take. */
int sluice_fixed_order_linear(const void *x, int64_t x_stride, const void *packed, const void *bias,
                              void *out, int64_t out_stride, int64_t M, int64_t N, int64_t K,
                              int bf16, int num_threads) {
    if (M < 0 || N < 0 || K < 1) return -2;
    if (num_threads < 1) num_threads = 1;
    const int64_t elem = bf16 ? 2 : 4, per = panel_elems(K, bf16), P = panels(N);
    /* about 8 groups of panels a thread, so a decode step's few rows still keep every thread busy */
    int64_t group = P / (8 * (int64_t)num_threads);
    group = group < 1 ? 1 : group > 8 ? 8 : group;
    const int64_t ng = (P + group - 1) / group, mb = (M + BLOCK_M - 1) / BLOCK_M;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads) if (ng * mb > 1)
    for (int64_t g = 0; g < ng; g++)
        for (int64_t bm = 0; bm < mb; bm++) {
            const int64_t m1 = (bm + 1) * BLOCK_M < M ? (bm + 1) * BLOCK_M : M;
            const int64_t p1 = (g + 1) * group < P ? (g + 1) * group : P;
            for (int64_t p = g * group; p < p1; p++) {
                const int64_t n = p * NR;
                const int ncols = N - n < NR ? (int)(N - n) : NR;
                for (int64_t m = bm * BLOCK_M; m < m1; m += MR) {
                    const int mr = m1 - m < MR ? (int)(m1 - m) : MR;
                    tile_rows((const char *)x + m * x_stride * elem, x_stride,
                              (const char *)packed + p * per * elem, K,
                              bias == NULL ? NULL : (const char *)bias + n * elem,
                              (char *)out + (m * out_stride + n) * elem, out_stride, ncols, mr,
                              bf16);
                }
            }
        }
    return 0;
}
