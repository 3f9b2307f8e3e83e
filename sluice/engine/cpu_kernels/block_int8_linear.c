/* y = x @ W.T (+ bias) on the CPU for int8 weights multiplied as they are stored: codes in blocks
 * of 32 along K with one float16 scale a block (GGUF's Q8_0), never widened to float in memory.
 *
 * Each row of x is quantized the same way at the start of the call (llama.cpp's Q8_0 activations):
 * a block's scale is amax / 127, its codes round(x * 127 / amax) (ties to even). A block's dot
 * product of codes is then exact in int32, and
 *     y[m][n] = sum over blocks b, in order, of  (xs[m][b] * ws[n][b]) * dot_b(xq[m], wq[n])
 * one float32 fused multiply-add a block, then the bias, then one rounding to bfloat16 for a
 * bfloat16 output. Every build computes exactly these float operations in this order, so the
 * AVX512-VNNI code, the AVX2 code and the portable one give the same bits.
 *
 * With AVX512-VNNI one VPDPBUSD multiplies 64 pairs of unsigned by signed bytes and adds them in
 * fours to 16 int32 lanes. The weights are its unsigned operand, stored as code + 128, so the
 * dot product it gives is dot_b + 128 * sum_b(xq), and that sum is taken off again per block.
 * AVX2 (no VNNI) takes the signed codes back (byte ^ 0x80) and multiplies in pairs (`dot4`).
 *
 * Packed layout (`sluice_block_int8_pack`): panels of 16 output columns; in panel p, block b is 8
 * quads j of 64 bytes, byte 4c + i of quad j = W[16p + c][32b + 4j + i] + 128, followed by the 16
 * columns' scales as float16 (544 bytes a block, a panel's blocks one after another). Columns past
 * N and k past K hold code 0 with scale 0. A decode reads each weight byte once, in order.
 *
 * 4-bit codes (`fmt` 1, GGUF's Q4_1): w = d * q + m with q in 0..15 and a float16 d and m a
 * block, so y[m][n] adds, per block in order, (xs * d) * dot_b(xq, q) and then (xs * sum_b(xq)) * m,
 * two fused multiply-adds. A block of a panel is 4 vectors of 64 bytes, byte 4c + i of vector j
 * holding the codes of k = 32b + 4j + i (low nibble) and of k + 16 (high nibble) of column c,
 * then the 16 d, then the 16 m (320 bytes a block); VPDPBUSD takes the codes as they unpack.
 *
 * 5-bit codes (`fmt` 4: GGUF's Q5_0, Q5_1 and Q5_K as one form): w = d * q + m with q in 0..31,
 * computed as the 4-bit codes are. A block of a panel is Q4's nibbles (256 bytes), then the codes'
 * fifth bits in one vector of 64 bytes (byte 4c + i: bit j for k = 4j + i, bit 4 + j for
 * k = 16 + 4j + i), then the 16 d and the 16 m (384 bytes a block: 6 bits a weight).
 *
 * 6-bit codes (`fmt` 3, GGUF's Q6_K): w = d * sc * (q - 32) with q in 0..63, an int8 sc for each
 * 16 values along k and a float16 d for each 256 (repeated here in its eight blocks). A block's two
 * halves are summed apart and joined in int32, exactly:
 *     isum = sc_lo * (dot_lo(xq, q) - 32 * sum_lo(xq)) + sc_hi * (dot_hi(xq, q) - 32 * sum_hi(xq))
 * (|isum| < 2^24, so its float32 conversion is exact too), and y[m][n] adds (xs * d) * isum, one
 * fused multiply-add a block as for Q8_0. A block of a panel is the codes' low four bits as Q4's
 * (4 vectors of 64 bytes, k and k + 16 in one byte), then their top two bits in 2 vectors of 64
 * bytes (vector h, byte 4c + i, bits 2j..2j+1: k = 16h + 4j + i), then the 16 d as float16, the 16
 * sc of k 0..15 and the 16 of k 16..31 as int8 (448 bytes a block: 7 bits a weight).
 *
 * Layouts: x [M, K] with row stride x_stride, bias [N] or NULL, out [M, N] with row stride
 * out_stride; all float32, or all bfloat16 (`bf16`).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(SLUICE_NO_VNNI)
#include <immintrin.h>
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif
#if !HAVE_VNNI && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) &&                    \
    !defined(SLUICE_NO_AVX2)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

#define KB 32                                 /* k of a block */
#define NC 16                                 /* columns of a panel */
#define BLOCK_BYTES (KB * NC + NC * 2)        /* codes, then float16 scales */
#define Q4_BLOCK_BYTES (KB * NC / 2 + NC * 4) /* codes in nibbles, then float16 d and m */
#define Q6_LOW (KB * NC / 2)                  /* where a Q6 block's top bits start */
#define Q6_SCALES (Q6_LOW + KB * NC / 4)      /* ... and its float16 d, then its int8 sc */
#define Q6_BLOCK_BYTES (Q6_SCALES + NC * 4)
#define Q5_TOP (KB * NC / 2)             /* where a Q5 block's fifth bits start */
#define Q5_SCALES (Q5_TOP + KB * NC / 8) /* ... and its float16 d and m */
#define Q5_BLOCK_BYTES (Q5_SCALES + NC * 4)
#define FMT_Q8 0
#define FMT_Q4 1
#define FMT_Q6 3 /* (2 is the fixed-order kernel's, in the layer stack's numbering) */
#define FMT_Q5 4
#define MR 4 /* rows of a tile */
#define NP 2 /* panels of a tile */
#define BLOCK_M (MR * 16)
#define TINY_BLOCK 1e-30f /* activation blocks below this amax are zeros */

static inline int64_t blocks_of(int64_t k) { return (k + KB - 1) / KB; }
static inline int64_t panels_of(int64_t n) { return (n + NC - 1) / NC; }

/* Which dot-product code this build runs: 2 AVX512-VNNI, 1 AVX2, 0 portable (the same bits). */
int sluice_block_int8_dot_path(void) { return HAVE_VNNI ? 2 : HAVE_AVX2 ? 1 : 0; }

static inline int64_t block_bytes(int fmt) {
    return fmt == FMT_Q4   ? Q4_BLOCK_BYTES
           : fmt == FMT_Q5 ? Q5_BLOCK_BYTES
           : fmt == FMT_Q6 ? Q6_BLOCK_BYTES
                           : BLOCK_BYTES;
}

int64_t sluice_block_int8_packed_bytes(int64_t N, int64_t K) {
    return panels_of(N) * blocks_of(K) * BLOCK_BYTES;
}

int64_t sluice_block_int4_packed_bytes(int64_t N, int64_t K) {
    return panels_of(N) * blocks_of(K) * Q4_BLOCK_BYTES;
}

int64_t sluice_block_q6_packed_bytes(int64_t N, int64_t K) {
    return panels_of(N) * blocks_of(K) * Q6_BLOCK_BYTES;
}

/* codes uint8 in 0..63 [N, nb * 32] (k past K: 32, a zero), d float16 bits [N, nb] (a block's
 * super-block's), sc int8 [N, 2 * nb] (a block's two halves'). */
void sluice_block_q6_pack(const uint8_t *codes, const uint16_t *d, const int8_t *sc, int64_t N,
                          int64_t K, uint8_t *packed) {
    const int64_t nb = blocks_of(K), P = panels_of(N), kp = nb * KB;
#pragma omp parallel for schedule(static) if (P * nb > 256)
    for (int64_t p = 0; p < P; p++) {
        memset(packed + p * nb * Q6_BLOCK_BYTES, 0, (size_t)(nb * Q6_BLOCK_BYTES));
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = packed + (p * nb + b) * Q6_BLOCK_BYTES;
            uint16_t *dd = (uint16_t *)(blk + Q6_SCALES);
            int8_t *ss = (int8_t *)(dd + NC);
            for (int c = 0; c < NC; c++) {
                const int64_t n = p * NC + c;
                if (n >= N) continue;
                dd[c] = d[n * nb + b];
                ss[c] = sc[n * 2 * nb + 2 * b];
                ss[NC + c] = sc[n * 2 * nb + 2 * b + 1];
                for (int t = 0; t < KB; t++) {
                    const uint8_t q = codes[n * kp + b * KB + t] & 0x3f;
                    const int lane = t % 16, half = t / 16, j = lane / 4, at = 4 * c + lane % 4;
                    blk[j * 64 + at] |= (uint8_t)((q & 0x0f) << (4 * half));
                    blk[Q6_LOW + half * 64 + at] |= (uint8_t)((q >> 4) << (2 * j));
                }
            }
        }
    }
}

/* codes uint8 in 0..15 (FMT_Q4) or 0..31 (FMT_Q5) [N, nb * 32] (k past K zero), d and m float16
 * bits [N, nb]. */
static void pack_dm(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t N,
                    int64_t K, uint8_t *packed, int fmt) {
    const int64_t nb = blocks_of(K), P = panels_of(N), kp = nb * KB, bytes = block_bytes(fmt);
    const int scales = fmt == FMT_Q5 ? Q5_SCALES : KB * NC / 2;
    /* panels apart: a large matrix packs on every core (a start packs the whole model) */
#pragma omp parallel for schedule(static) if (P * nb > 256)
    for (int64_t p = 0; p < P; p++) {
        memset(packed + p * nb * bytes, 0, (size_t)(nb * bytes));
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = packed + (p * nb + b) * bytes;
            uint16_t *dd = (uint16_t *)(blk + scales), *mm = dd + NC;
            for (int c = 0; c < NC; c++) {
                const int64_t n = p * NC + c;
                if (n >= N) continue;
                dd[c] = d[n * nb + b];
                mm[c] = m[n * nb + b];
                for (int t = 0; t < KB; t++) {
                    const uint8_t q = codes[n * kp + b * KB + t] & (fmt == FMT_Q5 ? 0x1f : 0x0f);
                    const int lane = t % 16, half = t / 16, at = (lane / 4) * 64 + 4 * c + lane % 4;
                    blk[at] |= (uint8_t)((q & 0x0f) << (4 * half));
                    if (fmt == FMT_Q5)
                        blk[Q5_TOP + 4 * c + lane % 4] |=
                            (uint8_t)((q >> 4) << (4 * half + lane / 4));
                }
            }
        }
    }
}

void sluice_block_int4_pack(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t N,
                            int64_t K, uint8_t *packed) {
    pack_dm(codes, d, m, N, K, packed, FMT_Q4);
}

int64_t sluice_block_q5_packed_bytes(int64_t N, int64_t K) {
    return panels_of(N) * blocks_of(K) * Q5_BLOCK_BYTES;
}

void sluice_block_q5_pack(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t N,
                          int64_t K, uint8_t *packed) {
    pack_dm(codes, d, m, N, K, packed, FMT_Q5);
}

/* codes int8 [N, nb * 32] (k past K zero), scales float16 bits [N, nb]. */
void sluice_block_int8_pack(const int8_t *codes, const uint16_t *scales, int64_t N, int64_t K,
                            uint8_t *packed) {
    const int64_t nb = blocks_of(K), P = panels_of(N), kp = nb * KB;
#pragma omp parallel for schedule(static) if (P * nb > 256)
    for (int64_t p = 0; p < P; p++) {
        memset(packed + p * nb * BLOCK_BYTES, 128, (size_t)(nb * BLOCK_BYTES));
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = packed + (p * nb + b) * BLOCK_BYTES;
            uint16_t *sc = (uint16_t *)(blk + KB * NC);
            for (int c = 0; c < NC; c++) {
                const int64_t n = p * NC + c;
                sc[c] = n < N ? scales[n * nb + b] : 0;
                if (n >= N) continue;
                for (int t = 0; t < KB; t++)
                    blk[(t / 4) * 64 + 4 * c + (t % 4)] =
                        (uint8_t)(codes[n * kp + b * KB + t] + 128);
            }
        }
    }
}

/* IEEE half to float, exactly (the portable path's reading of the scales). */
static inline float f16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) { /* zero or subnormal: m x 2^-24, exact */
        const float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    float v;
    const uint32_t bits =
        sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    memcpy(&v, &bits, 4);
    return v;
}

/* Column c of a packed block (any format), dequantized: w[t] for k = 32b + t. The products are
 * exact in float32 (a code times a float16 scale; Q6: sc (q - 32), |.| <= 4096, times d), so the
 * values are the codes' own. */
static inline void block_column(const uint8_t *blk, int fmt, int c, float w[KB]) {
    /* the column's bytes are gathered in k order first, four from each 64-byte vector, so the
     * conversions run on whole vectors */
    if (fmt == FMT_Q6) {
        const uint16_t *dd = (const uint16_t *)(blk + Q6_SCALES);
        const int8_t *ss = (const int8_t *)(dd + NC);
        const float d = f16_to_float(dd[c]);
        uint8_t nibbles[KB / 2], top[2][KB / 2];
        for (int j = 0; j < KB / 8; j++) {
            memcpy(nibbles + 4 * j, blk + j * 64 + 4 * c, 4);
            for (int h = 0; h < 2; h++) memcpy(top[h] + 4 * j, blk + Q6_LOW + h * 64 + 4 * c, 4);
        }
        for (int t = 0; t < KB; t++) {
            const int lane = t % 16, h = t / 16, j = lane / 4;
            const int q =
                ((nibbles[lane] >> (4 * h)) & 0x0f) | (((top[h][lane] >> (2 * j)) & 3) << 4);
            w[t] = (float)(ss[h * NC + c] * (q - 32)) * d;
        }
        return;
    }
    if (fmt == FMT_Q4 || fmt == FMT_Q5) {
        const uint16_t *dd = (const uint16_t *)(blk + (fmt == FMT_Q5 ? Q5_SCALES : KB * NC / 2));
        const float d = f16_to_float(dd[c]), m = f16_to_float(dd[NC + c]);
        uint8_t nibbles[KB / 2], top[4] = {0, 0, 0, 0};
        for (int j = 0; j < KB / 8; j++) memcpy(nibbles + 4 * j, blk + j * 64 + 4 * c, 4);
        if (fmt == FMT_Q5) memcpy(top, blk + Q5_TOP + 4 * c, 4);
        for (int t = 0; t < KB / 2; t++) {
            const int i = t % 4, j = t / 4;
            const int lo = (nibbles[t] & 0x0f) | (((top[i] >> j) & 1) << 4);
            const int hi = (nibbles[t] >> 4) | (((top[i] >> (4 + j)) & 1) << 4);
            w[t] = (float)lo * d + m;
            w[t + KB / 2] = (float)hi * d + m;
        }
        return;
    }
    const float scale = f16_to_float(((const uint16_t *)(blk + KB * NC))[c]);
    uint8_t q[KB];
    for (int j = 0; j < KB / 4; j++) memcpy(q + 4 * j, blk + j * 64 + 4 * c, 4);
    for (int t = 0; t < KB; t++) w[t] = (float)((int)q[t] - 128) * scale;
}

/* Rows ids[0..T-1] of the packed [N, K] weight (format `fmt`), dequantized (exact in float32)
 * into out [T, K] (float32, or bfloat16 rounded once): an embedding lookup on a tied LM head's
 * weight, so the two share one copy. Returns 0, or -2 for an id outside [0, N). */
int sluice_block_int8_rows(const uint8_t *packed, int64_t N, int64_t K, int fmt, const int64_t *ids,
                           int64_t T, void *out, int bf16) {
    const int64_t nb = blocks_of(K), bytes = block_bytes(fmt);
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return -2;
    for (int64_t t = 0; t < T; t++) {
        const int64_t n = ids[t];
        const uint8_t *panel = packed + (n / NC) * nb * bytes;
        for (int64_t b = 0; b < nb; b++) {
            float w[KB];
            block_column(panel + b * bytes, fmt, (int)(n % NC), w);
            const int64_t k0 = b * KB, kn = K - k0 < KB ? K - k0 : KB;
            if (bf16)
                narrow_n((uint16_t *)out + t * K + k0, w, (int)kn);
            else
                memcpy((float *)out + t * K + k0, w, (size_t)kn * sizeof(float));
        }
    }
    return 0;
}

/* The whole packed [N, K] weight dequantized into out [N, K] (float32, or bfloat16 rounded once),
 * for a step with enough rows that a float matmul on the widened copy beats this kernel (a CPU
 * with AMX at a prefill's row counts: the caller measures). */
void sluice_block_widen(const uint8_t *packed, int64_t N, int64_t K, int fmt, void *out, int bf16,
                        int num_threads) {
    const int64_t nb = blocks_of(K), P = panels_of(N), bytes = block_bytes(fmt);
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (N * K > 65536)
    for (int64_t p = 0; p < P; p++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = packed + (p * nb + b) * bytes;
            const int64_t k0 = b * KB, kn = K - k0 < KB ? K - k0 : KB;
            for (int c = 0; c < NC && p * NC + c < N; c++) {
                float w[KB];
                block_column(blk, fmt, c, w);
                const int64_t at = (p * NC + c) * K + k0;
                if (bf16)
                    narrow_n((uint16_t *)out + at, w, (int)kn);
                else
                    memcpy((float *)out + at, w, (size_t)kn * sizeof(float));
            }
        }
}

/* Row m of x into nb blocks of codes (xq, nb * 32 bytes), their scales, their code sums and the
 * sums of each block's first 16 codes (xlo: Q6's halves). */
#if HAVE_VNNI
/* Two vectors a block: the same products, rounded the same way (VCVTPS2DQ rounds to nearest even
 * as nearbyintf does in the default mode), so the same codes as the portable loop below. */
static void quantize_row(const void *x, int64_t K, int64_t nb, int bf16, int8_t *xq, float *xs,
                         int32_t *xsum, int32_t *xlo) {
    for (int64_t b = 0; b < nb; b++) {
        const int64_t k0 = b * KB, n = K - k0 < KB ? K - k0 : KB;
        const __mmask32 in = n == KB ? 0xffffffffu : (1u << n) - 1; /* k past K reads as 0 */
        __m512 v[2];
        for (int h = 0; h < 2; h++) {
            const __mmask16 m = (__mmask16)(in >> (16 * h));
            if (bf16) {
                const __m256i raw = _mm256_maskz_loadu_epi16(m, (const uint16_t *)x + k0 + 16 * h);
                v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
            } else {
                v[h] = _mm512_maskz_loadu_ps(m, (const float *)x + k0 + 16 * h);
            }
        }
        const float amax =
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        const __m512 inv = _mm512_set1_ps(amax >= TINY_BLOCK ? 127.0f / amax : 0.0f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v[0], inv));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v[1], inv));
        _mm_storeu_si128((__m128i *)(xq + k0), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(xq + k0 + 16), _mm512_cvtepi32_epi8(q1));
        xs[b] = amax >= TINY_BLOCK ? amax / 127.0f : 0.0f;
        xlo[b] = _mm512_reduce_add_epi32(q0);
        xsum[b] = xlo[b] + _mm512_reduce_add_epi32(q1);
    }
}
#else
static void quantize_row(const void *x, int64_t K, int64_t nb, int bf16, int8_t *xq, float *xs,
                         int32_t *xsum, int32_t *xlo) {
    for (int64_t b = 0; b < nb; b++) {
        float v[KB];
        for (int t = 0; t < KB; t++) {
            const int64_t k = b * KB + t;
            v[t] = k < K ? load_act(x, k, bf16) : 0.0f;
        }
        float amax = 0.0f;
        for (int t = 0; t < KB; t++) amax = fabsf(v[t]) > amax ? fabsf(v[t]) : amax;
        /* a block this small counts as zeros (127 / amax would overflow near the float minimum) */
        const float inv = amax >= TINY_BLOCK ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int t = 0; t < KB; t++) {
            const int q = (int)nearbyintf(v[t] * inv);
            xq[b * KB + t] = (int8_t)q;
            sum += q;
            if (t == KB / 2 - 1) xlo[b] = sum;
        }
        xs[b] = amax >= TINY_BLOCK ? amax / 127.0f : 0.0f;
        xsum[b] = sum;
    }
}
#endif

#if HAVE_VNNI
/* mr rows of quantized x against np panels: 16 * np columns of those rows. */
static inline __attribute__((always_inline)) void
tile(const int8_t *xq, const float *xs, const int32_t *xsum, const int32_t *xlo, int64_t nb,
     const uint8_t *w, int64_t panel_stride, const void *bias, void *out, int64_t os, int ncols,
     const int mr, const int np, int bf16, const int fmt) {
    __m512 acc[MR][NP];
    for (int i = 0; i < mr; i++)
        for (int p = 0; p < np; p++) acc[i][p] = _mm512_setzero_ps();
    const int64_t kp = nb * KB;
    for (int64_t b = 0; b < nb; b++) {
        __m512i d[MR][NP];
        for (int i = 0; i < mr; i++)
            for (int p = 0; p < np; p++) d[i][p] = _mm512_setzero_si512();
        if (fmt == FMT_Q6) {
            const uint8_t *blk = w + b * Q6_BLOCK_BYTES;
            const __m512i low = _mm512_set1_epi8(0x0f), two = _mm512_set1_epi8(0x03);
            __m512i top[NP][2], e[MR][NP]; /* d: the first halves' sums, e: the second's */
            for (int p = 0; p < np; p++)
                for (int h = 0; h < 2; h++)
                    top[p][h] = _mm512_loadu_si512(blk + p * panel_stride + Q6_LOW + h * 64);
            for (int i = 0; i < mr; i++)
                for (int p = 0; p < np; p++) e[i][p] = _mm512_setzero_si512();
            for (int j = 0; j < KB / 8; j++) {
                __m512i lo[NP], hi[NP];
                for (int p = 0; p < np; p++) {
                    const __m512i v = _mm512_loadu_si512(blk + p * panel_stride + j * 64);
                    const __m512i t0 = _mm512_and_si512(_mm512_srli_epi16(top[p][0], 2 * j), two);
                    const __m512i t1 = _mm512_and_si512(_mm512_srli_epi16(top[p][1], 2 * j), two);
                    lo[p] = _mm512_or_si512(_mm512_and_si512(v, low), _mm512_slli_epi16(t0, 4));
                    hi[p] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                                            _mm512_slli_epi16(t1, 4));
                }
                for (int i = 0; i < mr; i++) {
                    int32_t qa, qb;
                    memcpy(&qa, xq + i * kp + b * KB + 4 * j, 4);
                    memcpy(&qb, xq + i * kp + b * KB + 16 + 4 * j, 4);
                    const __m512i xa = _mm512_set1_epi32(qa), xb = _mm512_set1_epi32(qb);
                    for (int p = 0; p < np; p++) {
                        d[i][p] = _mm512_dpbusd_epi32(d[i][p], lo[p], xa);
                        e[i][p] = _mm512_dpbusd_epi32(e[i][p], hi[p], xb);
                    }
                }
            }
            __m512 wd[NP];
            __m512i slo[NP], shi[NP];
            for (int p = 0; p < np; p++) {
                const uint8_t *sc = blk + p * panel_stride + Q6_SCALES;
                wd[p] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
                slo[p] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + 2 * NC)));
                shi[p] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + 3 * NC)));
            }
            for (int i = 0; i < mr; i++) {
                const int32_t lo_sum = xlo[i * nb + b], hi_sum = xsum[i * nb + b] - lo_sum;
                const __m512i clo = _mm512_set1_epi32(32 * lo_sum),
                              chi = _mm512_set1_epi32(32 * hi_sum);
                const __m512 s = _mm512_set1_ps(xs[i * nb + b]);
                for (int p = 0; p < np; p++) {
                    const __m512i isum = _mm512_add_epi32(
                        _mm512_mullo_epi32(slo[p], _mm512_sub_epi32(d[i][p], clo)),
                        _mm512_mullo_epi32(shi[p], _mm512_sub_epi32(e[i][p], chi)));
                    acc[i][p] = _mm512_fmadd_ps(_mm512_mul_ps(s, wd[p]), _mm512_cvtepi32_ps(isum),
                                                acc[i][p]);
                }
            }
            continue;
        }
        if (fmt == FMT_Q4 || fmt == FMT_Q5) {
            const uint8_t *blk = w + b * block_bytes(fmt);
            const __m512i low = _mm512_set1_epi8(0x0f), one = _mm512_set1_epi8(0x01);
            __m512i top[NP];
            for (int p = 0; p < np; p++)
                top[p] = fmt == FMT_Q5 ? _mm512_loadu_si512(blk + p * panel_stride + Q5_TOP)
                                       : _mm512_setzero_si512();
            for (int j = 0; j < KB / 8; j++) {
                __m512i lo[NP], hi[NP];
                for (int p = 0; p < np; p++) {
                    const __m512i v = _mm512_loadu_si512(blk + p * panel_stride + j * 64);
                    lo[p] = _mm512_and_si512(v, low);
                    hi[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                    if (fmt == FMT_Q5) {
                        const __m512i t0 = _mm512_and_si512(_mm512_srli_epi16(top[p], j), one);
                        const __m512i t1 = _mm512_and_si512(_mm512_srli_epi16(top[p], 4 + j), one);
                        lo[p] = _mm512_or_si512(lo[p], _mm512_slli_epi16(t0, 4));
                        hi[p] = _mm512_or_si512(hi[p], _mm512_slli_epi16(t1, 4));
                    }
                }
                for (int i = 0; i < mr; i++) {
                    int32_t qa, qb;
                    memcpy(&qa, xq + i * kp + b * KB + 4 * j, 4);
                    memcpy(&qb, xq + i * kp + b * KB + 16 + 4 * j, 4);
                    const __m512i xa = _mm512_set1_epi32(qa), xb = _mm512_set1_epi32(qb);
                    for (int p = 0; p < np; p++) {
                        d[i][p] = _mm512_dpbusd_epi32(d[i][p], lo[p], xa);
                        d[i][p] = _mm512_dpbusd_epi32(d[i][p], hi[p], xb);
                    }
                }
            }
            __m512 wd[NP], wm[NP];
            for (int p = 0; p < np; p++) {
                const uint8_t *sc =
                    blk + p * panel_stride + (fmt == FMT_Q5 ? Q5_SCALES : KB * NC / 2);
                wd[p] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
                wm[p] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 2 * NC)));
            }
            for (int i = 0; i < mr; i++) {
                const float sx = xs[i * nb + b];
                const __m512 s = _mm512_set1_ps(sx),
                             sm = _mm512_set1_ps(sx * (float)xsum[i * nb + b]);
                for (int p = 0; p < np; p++) {
                    acc[i][p] = _mm512_fmadd_ps(_mm512_mul_ps(s, wd[p]),
                                                _mm512_cvtepi32_ps(d[i][p]), acc[i][p]);
                    acc[i][p] = _mm512_fmadd_ps(wm[p], sm, acc[i][p]);
                }
            }
            continue;
        }
        const uint8_t *blk = w + b * BLOCK_BYTES;
        for (int j = 0; j < KB / 4; j++) {
            __m512i wv[NP];
            for (int p = 0; p < np; p++)
                wv[p] = _mm512_loadu_si512(blk + p * panel_stride + j * 64);
            for (int i = 0; i < mr; i++) {
                int32_t quad;
                memcpy(&quad, xq + i * kp + b * KB + 4 * j, 4);
                const __m512i xb = _mm512_set1_epi32(quad);
                for (int p = 0; p < np; p++) d[i][p] = _mm512_dpbusd_epi32(d[i][p], wv[p], xb);
            }
        }
        __m512 ws[NP];
        for (int p = 0; p < np; p++)
            ws[p] = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)(blk + p * panel_stride + KB * NC)));
        for (int i = 0; i < mr; i++) {
            const __m512i c = _mm512_set1_epi32(128 * xsum[i * nb + b]);
            const __m512 s = _mm512_set1_ps(xs[i * nb + b]);
            for (int p = 0; p < np; p++) {
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(d[i][p], c));
                acc[i][p] = _mm512_fmadd_ps(_mm512_mul_ps(s, ws[p]), dot, acc[i][p]);
            }
        }
    }
    for (int i = 0; i < mr; i++) {
        float row[NC * NP];
        for (int p = 0; p < np; p++) _mm512_storeu_ps(row + p * NC, acc[i][p]);
        store_row_act((char *)out + i * os * (bf16 ? 2 : 4), row, ncols, bias, bf16);
    }
}
#elif HAVE_AVX2
/* Eight int32 sums of four byte products each (columns c of one half panel): VPMADDUBSW takes
 * unsigned by signed bytes into pairs of int16 and VPMADDWD adds the pairs. The pairs never
 * saturate: a Q8 code meets |x| with x's sign moved onto it (|q| and |x| <= 127, so a pair is at
 * most 2 * 127 * 127), and a Q4 code (0..15) meets x as it is. */
static inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc,
                            _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

/* mr rows of quantized x against np panels, each panel as two halves of 8 columns. */
static inline __attribute__((always_inline)) void
tile(const int8_t *xq, const float *xs, const int32_t *xsum, const int32_t *xlo, int64_t nb,
     const uint8_t *w, int64_t panel_stride, const void *bias, void *out, int64_t os, int ncols,
     const int mr, const int np, int bf16, const int fmt) {
    __m256 acc[MR][NP * 2];
    for (int i = 0; i < mr; i++)
        for (int h = 0; h < 2 * np; h++) acc[i][h] = _mm256_setzero_ps();
    const int64_t kp = nb * KB;
    for (int64_t b = 0; b < nb; b++) {
        __m256i d[MR][NP * 2];
        for (int i = 0; i < mr; i++)
            for (int h = 0; h < 2 * np; h++) d[i][h] = _mm256_setzero_si256();
        if (fmt == FMT_Q6) {
            const uint8_t *blk = w + b * Q6_BLOCK_BYTES;
            const __m256i low = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(0x03);
            for (int h = 0; h < 2 * np; h++) {
                const uint8_t *half = blk + (h / 2) * panel_stride + (h % 2) * 32;
                const __m256i top0 = _mm256_loadu_si256((const __m256i *)(half + Q6_LOW));
                const __m256i top1 = _mm256_loadu_si256((const __m256i *)(half + Q6_LOW + 64));
                __m256i e[MR]; /* d[i][h]: the first halves' sums, e: the second's */
                for (int i = 0; i < mr; i++) e[i] = _mm256_setzero_si256();
                for (int j = 0; j < KB / 8; j++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(half + j * 64));
                    const __m256i t0 = _mm256_and_si256(_mm256_srli_epi16(top0, 2 * j), two);
                    const __m256i t1 = _mm256_and_si256(_mm256_srli_epi16(top1, 2 * j), two);
                    const __m256i lo =
                        _mm256_or_si256(_mm256_and_si256(v, low), _mm256_slli_epi16(t0, 4));
                    const __m256i hi = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(v, 4), low), _mm256_slli_epi16(t1, 4));
                    for (int i = 0; i < mr; i++) {
                        int32_t qa, qb;
                        memcpy(&qa, xq + i * kp + b * KB + 4 * j, 4);
                        memcpy(&qb, xq + i * kp + b * KB + 16 + 4 * j, 4);
                        d[i][h] = dot4(d[i][h], lo, _mm256_set1_epi32(qa));
                        e[i] = dot4(e[i], hi, _mm256_set1_epi32(qb));
                    }
                }
                /* this half's 8 columns: their d (float16), then their sc of each half of k */
                const uint8_t *sc = blk + (h / 2) * panel_stride + Q6_SCALES;
                const __m256 wd =
                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + (h % 2) * 16)));
                const __m256i slo = _mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(sc + 2 * NC + (h % 2) * 8)));
                const __m256i shi = _mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(sc + 3 * NC + (h % 2) * 8)));
                for (int i = 0; i < mr; i++) {
                    const int32_t lo_sum = xlo[i * nb + b], hi_sum = xsum[i * nb + b] - lo_sum;
                    const __m256i isum = _mm256_add_epi32(
                        _mm256_mullo_epi32(
                            slo, _mm256_sub_epi32(d[i][h], _mm256_set1_epi32(32 * lo_sum))),
                        _mm256_mullo_epi32(shi,
                                           _mm256_sub_epi32(e[i], _mm256_set1_epi32(32 * hi_sum))));
                    const __m256 s = _mm256_set1_ps(xs[i * nb + b]);
                    acc[i][h] =
                        _mm256_fmadd_ps(_mm256_mul_ps(s, wd), _mm256_cvtepi32_ps(isum), acc[i][h]);
                }
            }
            continue;
        }
        if (fmt == FMT_Q4 || fmt == FMT_Q5) {
            const uint8_t *blk = w + b * block_bytes(fmt);
            const __m256i low = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(0x01);
            for (int j = 0; j < KB / 8; j++)
                for (int h = 0; h < 2 * np; h++) {
                    const uint8_t *half = blk + (h / 2) * panel_stride + (h % 2) * 32;
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(half + j * 64));
                    __m256i lo = _mm256_and_si256(v, low);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    if (fmt == FMT_Q5) {
                        const __m256i top = _mm256_loadu_si256((const __m256i *)(half + Q5_TOP));
                        const __m256i t0 = _mm256_and_si256(_mm256_srli_epi16(top, j), one);
                        const __m256i t1 = _mm256_and_si256(_mm256_srli_epi16(top, 4 + j), one);
                        lo = _mm256_or_si256(lo, _mm256_slli_epi16(t0, 4));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi16(t1, 4));
                    }
                    for (int i = 0; i < mr; i++) {
                        int32_t qa, qb;
                        memcpy(&qa, xq + i * kp + b * KB + 4 * j, 4);
                        memcpy(&qb, xq + i * kp + b * KB + 16 + 4 * j, 4);
                        d[i][h] = dot4(d[i][h], lo, _mm256_set1_epi32(qa));
                        d[i][h] = dot4(d[i][h], hi, _mm256_set1_epi32(qb));
                    }
                }
            for (int h = 0; h < 2 * np; h++) {
                const uint8_t *sc = blk + (h / 2) * panel_stride + (h % 2) * 16 +
                                    (fmt == FMT_Q5 ? Q5_SCALES : KB * NC / 2);
                const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sc));
                const __m256 wm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 2 * NC)));
                for (int i = 0; i < mr; i++) {
                    const float sx = xs[i * nb + b];
                    const __m256 s = _mm256_set1_ps(sx),
                                 sm = _mm256_set1_ps(sx * (float)xsum[i * nb + b]);
                    acc[i][h] = _mm256_fmadd_ps(_mm256_mul_ps(s, wd), _mm256_cvtepi32_ps(d[i][h]),
                                                acc[i][h]);
                    acc[i][h] = _mm256_fmadd_ps(wm, sm, acc[i][h]);
                }
            }
            continue;
        }
        const uint8_t *blk = w + b * BLOCK_BYTES;
        const __m256i flip = _mm256_set1_epi8((char)0x80); /* code + 128 -> the signed code */
        for (int j = 0; j < KB / 4; j++) {
            __m256i xa[MR], xv[MR];
            for (int i = 0; i < mr; i++) {
                int32_t quad;
                memcpy(&quad, xq + i * kp + b * KB + 4 * j, 4);
                xv[i] = _mm256_set1_epi32(quad);
                xa[i] = _mm256_sign_epi8(xv[i], xv[i]);
            }
            for (int h = 0; h < 2 * np; h++) {
                const __m256i q = _mm256_xor_si256(
                    _mm256_loadu_si256(
                        (const __m256i *)(blk + (h / 2) * panel_stride + j * 64 + (h % 2) * 32)),
                    flip);
                for (int i = 0; i < mr; i++)
                    d[i][h] = dot4(d[i][h], xa[i], _mm256_sign_epi8(q, xv[i]));
            }
        }
        for (int h = 0; h < 2 * np; h++) {
            const uint8_t *sc = blk + (h / 2) * panel_stride + KB * NC + (h % 2) * 16;
            const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sc));
            for (int i = 0; i < mr; i++) {
                const __m256 s = _mm256_set1_ps(xs[i * nb + b]);
                acc[i][h] =
                    _mm256_fmadd_ps(_mm256_mul_ps(s, ws), _mm256_cvtepi32_ps(d[i][h]), acc[i][h]);
            }
        }
    }
    for (int i = 0; i < mr; i++) {
        float row[NC * NP];
        for (int h = 0; h < 2 * np; h++) _mm256_storeu_ps(row + h * 8, acc[i][h]);
        store_row_act((char *)out + i * os * (bf16 ? 2 : 4), row, ncols, bias, bf16);
    }
}
#else
/* The same sums without SIMD: each block's dot product in int32, then the same float steps. */
static inline void tile(const int8_t *xq, const float *xs, const int32_t *xsum, const int32_t *xlo,
                        int64_t nb, const uint8_t *w, int64_t panel_stride, const void *bias,
                        void *out, int64_t os, int ncols, const int mr, const int np, int bf16,
                        const int fmt) {
    const int64_t kp = nb * KB;
    for (int i = 0; i < mr; i++) {
        float acc[NC * NP] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *xr = xq + i * kp + b * KB;
            const float s = xs[i * nb + b];
            for (int p = 0; p < np; p++) {
                if (fmt == FMT_Q6) {
                    const uint8_t *blk = w + p * panel_stride + b * Q6_BLOCK_BYTES;
                    const uint16_t *dd = (const uint16_t *)(blk + Q6_SCALES);
                    const int8_t *ss = (const int8_t *)(dd + NC);
                    const int32_t lo_sum = xlo[i * nb + b], hi_sum = xsum[i * nb + b] - lo_sum;
                    int32_t dlo[NC] = {0}, dhi[NC] = {0};
                    for (int j = 0; j < KB / 8; j++)
                        for (int c = 0; c < NC; c++)
                            for (int t = 0; t < 4; t++) {
                                const int lane = 4 * c + t, shift = 2 * j;
                                const uint8_t v = blk[j * 64 + lane];
                                const uint8_t top0 = blk[Q6_LOW + lane],
                                              top1 = blk[Q6_LOW + 64 + lane];
                                const int q0 = (v & 0x0f) | (((top0 >> shift) & 3) << 4);
                                const int q1 = (v >> 4) | (((top1 >> shift) & 3) << 4);
                                dlo[c] += q0 * xr[4 * j + t];
                                dhi[c] += q1 * xr[16 + 4 * j + t];
                            }
                    for (int c = 0; c < NC; c++) {
                        const int32_t isum =
                            ss[c] * (dlo[c] - 32 * lo_sum) + ss[NC + c] * (dhi[c] - 32 * hi_sum);
                        acc[p * NC + c] =
                            fmaf(s * f16_to_float(dd[c]), (float)isum, acc[p * NC + c]);
                    }
                    continue;
                }
                if (fmt == FMT_Q4 || fmt == FMT_Q5) {
                    const uint8_t *blk = w + p * panel_stride + b * block_bytes(fmt);
                    const uint16_t *dd = (const uint16_t *)(blk + (fmt == FMT_Q5 ? Q5_SCALES
                                                                                 : KB * NC / 2)),
                                   *mm = dd + NC;
                    const float sm = s * (float)xsum[i * nb + b];
                    int32_t d[NC] = {0};
                    for (int j = 0; j < KB / 8; j++)
                        for (int c = 0; c < NC; c++)
                            for (int t = 0; t < 4; t++) {
                                const uint8_t v = blk[j * 64 + 4 * c + t];
                                const uint8_t top = fmt == FMT_Q5 ? blk[Q5_TOP + 4 * c + t] : 0;
                                const int lo = (v & 0x0f) | (((top >> j) & 1) << 4);
                                const int hi = (v >> 4) | (((top >> (4 + j)) & 1) << 4);
                                d[c] += lo * xr[4 * j + t] + hi * xr[16 + 4 * j + t];
                            }
                    for (int c = 0; c < NC; c++) {
                        float a = fmaf(s * f16_to_float(dd[c]), (float)d[c], acc[p * NC + c]);
                        acc[p * NC + c] = fmaf(f16_to_float(mm[c]), sm, a);
                    }
                    continue;
                }
                const uint8_t *blk = w + p * panel_stride + b * BLOCK_BYTES;
                const uint16_t *sc = (const uint16_t *)(blk + KB * NC);
                int32_t d[NC] = {0};
                for (int j = 0; j < KB / 4; j++)
                    for (int c = 0; c < NC; c++)
                        for (int t = 0; t < 4; t++)
                            d[c] += (int32_t)blk[j * 64 + 4 * c + t] * xr[4 * j + t];
                for (int c = 0; c < NC; c++)
                    acc[p * NC + c] = fmaf(s * f16_to_float(sc[c]),
                                           (float)(d[c] - 128 * xsum[i * nb + b]), acc[p * NC + c]);
            }
        }
        store_row_act((char *)out + i * os * (bf16 ? 2 : 4), acc, ncols, bias, bf16);
    }
}
#endif

/* A tile with mr and np made constants, so its sums stay in registers. */
static void tile_of(const int8_t *xq, const float *xs, const int32_t *xsum, const int32_t *xlo,
                    int64_t nb, const uint8_t *w, int64_t panel_stride, const void *bias, void *out,
                    int64_t os, int ncols, int mr, int np, int bf16, int fmt) {
#define T(R, P)                                                                                    \
    if (mr == (R) && np == (P)) {                                                                  \
        if (fmt == FMT_Q4)                                                                         \
            tile(xq, xs, xsum, xlo, nb, w, panel_stride, bias, out, os, ncols, R, P, bf16,         \
                 FMT_Q4);                                                                          \
        else if (fmt == FMT_Q5)                                                                    \
            tile(xq, xs, xsum, xlo, nb, w, panel_stride, bias, out, os, ncols, R, P, bf16,         \
                 FMT_Q5);                                                                          \
        else if (fmt == FMT_Q6)                                                                    \
            tile(xq, xs, xsum, xlo, nb, w, panel_stride, bias, out, os, ncols, R, P, bf16,         \
                 FMT_Q6);                                                                          \
        else                                                                                       \
            tile(xq, xs, xsum, xlo, nb, w, panel_stride, bias, out, os, ncols, R, P, bf16,         \
                 FMT_Q8);                                                                          \
        return;                                                                                    \
    }
    T(1, 1) T(2, 1) T(3, 1) T(4, 1) T(1, 2) T(2, 2) T(3, 2) T(4, 2)
#undef T
}

/* Returns 0, -1 where the workspace could not be allocated, -2 for shapes it does not take. */
int sluice_block_int8_linear(const void *x, int64_t x_stride, const uint8_t *packed,
                             const void *bias, void *out, int64_t out_stride, int64_t M, int64_t N,
                             int64_t K, int bf16, int fmt, int num_threads) {
    if (M < 0 || N < 0 || K < 1 || fmt < FMT_Q8 || fmt > FMT_Q5 || fmt == 2) return -2;
    if (M == 0 || N == 0) return 0;
    if (num_threads < 1) num_threads = 1;
    const int64_t nb = blocks_of(K), kp = nb * KB, P = panels_of(N), elem = bf16 ? 2 : 4;
    int8_t *xq = malloc((size_t)(M * kp));
    float *xs = malloc((size_t)(M * nb) * sizeof(float));
    int32_t *xsum = malloc((size_t)(2 * M * nb) * sizeof(int32_t)), *xlo = xsum + M * nb;
    if (xq == NULL || xs == NULL || xsum == NULL) {
        free(xq), free(xs), free(xsum);
        return -1;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++)
        quantize_row((const char *)x + m * x_stride * elem, K, nb, bf16, xq + m * kp, xs + m * nb,
                     xsum + m * nb, xlo + m * nb);

    /* Tiles of two panels share each x broadcast, which pays where a tile has several rows; with
     * a few rows (decode) one panel a tile is faster (measured: ~9 % at SmolLM2's shapes, one row:
     * one weight stream a thread instead of two). */
    const int tp = M <= MR || !HAVE_VNNI ? 1 : NP; /* AVX2 has half the registers: one panel */
    const int64_t units = (P + tp - 1) / tp, panel_stride = nb * block_bytes(fmt);
    /* about 8 groups of tiles' panels a thread, so a decode's one row still keeps every thread
     * busy */
    int64_t group = units / (8 * (int64_t)num_threads);
    group = group < 1 ? 1 : group > 8 ? 8 : group;
    const int64_t ng = (units + group - 1) / group, mb = (M + BLOCK_M - 1) / BLOCK_M;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads) if (ng * mb > 1)
    for (int64_t g = 0; g < ng; g++)
        for (int64_t bm = 0; bm < mb; bm++) {
            const int64_t m1 = (bm + 1) * BLOCK_M < M ? (bm + 1) * BLOCK_M : M;
            const int64_t q1 = (g + 1) * group < units ? (g + 1) * group : units;
            for (int64_t q = g * group; q < q1; q++) {
                const int64_t p = q * tp, n = p * NC;
                const int np = P - p < tp ? (int)(P - p) : tp;
                const int ncols = N - n < NC * np ? (int)(N - n) : NC * np;
                for (int64_t m = bm * BLOCK_M; m < m1; m += MR) {
                    const int mr = m1 - m < MR ? (int)(m1 - m) : MR;
                    tile_of(xq + m * kp, xs + m * nb, xsum + m * nb, xlo + m * nb, nb,
                            packed + p * panel_stride, panel_stride,
                            bias == NULL ? NULL : (const char *)bias + n * elem,
                            (char *)out + (m * out_stride + n) * elem, out_stride, ncols, mr, np,
                            bf16, fmt);
                }
            }
        }
    free(xq), free(xs), free(xsum);
    return 0;
}
