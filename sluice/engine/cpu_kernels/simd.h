/* Shared by the CPU kernels: a vectorizable exp for non-positive arguments, 16-float vectors
 * (GCC/Clang vector types: one AVX-512 register, two AVX2 ones) with the helpers both attention
 * kernels use, and bfloat16 conversions. */
#ifndef SLUICE_SIMD_H
#define SLUICE_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* CPUs with AVX512-BF16 multiply pairs of bfloat16 and add them to float32 lanes in one
 * instruction (VDPBF16PS): a dot product of bfloat16 vectors without widening them first. The
 * products of two bfloat16 are exact in float32; only the float32 sums round, as in a float32 FMA
 * loop (in another order). They also round 16 floats to bfloat16 in one instruction.
 * -DSLUICE_NO_BF16_DOT builds the portable code instead (the tests check both). */
#if defined(__AVX512BF16__) && !defined(SLUICE_NO_BF16_DOT)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

/* exp(x) for x <= 0 in single precision, written so the compiler vectorizes the loops that call
 * it (libm's expf is a scalar call). Range reduction by ln 2 split in two parts, then the Cephes
 * degree-6 polynomial on [-ln2/2, ln2/2]: relative error ~2e-7, like expf. */
static inline float exp_nonpositive(float x) {
    /* exp(-87) is still a normal float; smaller weights are 0 anyway */
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
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

/* log(x) for a normal positive x, in single precision from its exponent and mantissa (no libm:
 * glibc picks an FMA or a plain logf by CPU, and they may differ in the last bit). x = 2^e m with m
 * in [sqrt(1/2), sqrt(2)); log(m) from the Cephes degree-9 polynomial in m - 1; log 2 split in
 * two parts as in exp_nonpositive. Relative error ~1e-7, like logf. */
static inline float log_positive(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    int e = (int)(bits >> 23) - 126; /* x = 2^e m', m' in [0.5, 1) */
    bits = (bits & 0x007fffffu) | 0x3f000000u;
    float m;
    memcpy(&m, &bits, sizeof m);
    if (m < 0.707106781186547524f) {
        e -= 1;
        m = m + m - 1.0f;
    } else {
        m = m - 1.0f;
    }
    const float z = m * m;
    float y = 7.0376836292e-2f;
    y = y * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z;
    const float fe = (float)e;
    y = y + fe * -2.12194440e-4f;
    y = y - 0.5f * z;
    return m + y + fe * 0.693359375f;
}

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16f load16(const float *p) {
    v16f x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void store16(float *p, v16f x) { memcpy(p, &x, sizeof x); }

static inline v16f pair_sum(v16f a, v16f b, v16i lo, v16i hi) {
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

/* Blocks of a sequence need not be adjacent in memory: ask for the next one while computing on
 * this one, so the hardware prefetcher's stop at a block boundary does not stall the loop. */
static inline void prefetch_bytes(const void *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i);
}

/* Lane t of the result = sum of the lanes of a[t]: 16 horizontal sums at once, the vectors
 * transposed and added pairwise in 4 rounds of shuffles instead of reduced one by one. */
static inline v16f transpose_sum16(const v16f a[16]) {
    const v16i l1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i h1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const v16i l2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const v16i h2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const v16i l3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const v16i h3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const v16i l4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16i h4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16f b[8], c[4], e[2];
    for (int i = 0; i < 8; i++)
        b[i] = pair_sum(a[2 * i], a[2 * i + 1], l1, h1); /* rows 2i, 2i+1: 8 lanes each */
    for (int i = 0; i < 4; i++)
        c[i] = pair_sum(b[2 * i], b[2 * i + 1], l2, h2); /* 4 rows, 4 lanes each */
    for (int i = 0; i < 2; i++)
        e[i] = pair_sum(c[2 * i], c[2 * i + 1], l3, h3); /* 8 rows, 2 lanes each */
    return pair_sum(e[0], e[1], l4, h4);
}

/* bfloat16: the upper half of a float32. Widening is exact; narrowing rounds to nearest, ties to
 * even, as torch does (a NaN stays a quiet NaN). */
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

static inline uint16_t float_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t nan = (bits >> 16) | 0x40u;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

static inline v16f widen16(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    return (v16f)(__builtin_convertvector(h, v16u) << 16);
}

static inline void narrow16(uint16_t *p, v16f x) {
#if HAVE_BF16_DOT
    /* one instruction (VCVTNEPS2BF16: nearest even; it treats float32 denormals as zero) */
    const __m256bh h = _mm512_cvtneps_pbh((__m512)x);
    memcpy(p, &h, sizeof h);
#else
    const v16u bits = (v16u)x;
    const v16u rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const v16u nan = (bits >> 16) | 0x40u;
    const v16u is_nan = (v16u)((bits & 0x7fffffffu) > 0x7f800000u); /* all ones where NaN */
    const v16h h = __builtin_convertvector((nan & is_nan) | (rounded & ~is_nan), v16h);
    memcpy(p, &h, sizeof h);
#endif
}

/* x rounded to the nearest bfloat16, as a float. */
static inline v16f round16_bf16(v16f x) {
    uint16_t h[16];
    narrow16(h, x);
    return widen16(h);
}

/* n bfloat16 <-> float32, 16 at a time, then one by one. */
static inline void widen_n(const uint16_t *src, float *dst, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16) store16(dst + i, widen16(src + i));
    for (; i < n; i++) dst[i] = bf16_to_float(src[i]);
}

static inline void narrow_n(uint16_t *dst, const float *src, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16) narrow16(dst + i, load16(src + i));
    for (; i < n; i++) dst[i] = float_to_bf16(src[i]);
}

#if HAVE_BF16_DOT
/* 16 partial sums of the dot product of two bfloat16 vectors of 32 * n elements. */
static inline v16f dot_bf16_partial(const uint16_t *a, const uint16_t *b, const int n) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i++)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + 32 * i),
                               (__m512bh)_mm512_loadu_si512(b + 32 * i));
    return (v16f)acc;
}

#endif

/* Activations (queries, outputs, hidden states) are float32 or bfloat16 (`bf16` a constant flag):
 * element i of a buffer as a float, and 16 of them as a vector, whichever the type. */
static inline float load_act(const void *p, int64_t i, const int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* A matmul tile's row of float32 sums into out[0 .. n-1]: plus the bias (when not NULL), then
 * rounded once to bfloat16 for a bfloat16 output. */
static inline void store_row_act(void *out, const float *sums, int n, const void *bias,
                                 const int bf16) {
    for (int c = 0; c < n; c++) {
        const float y = bias == NULL ? sums[c] : sums[c] + load_act(bias, c, bf16);
        if (bf16)
            ((uint16_t *)out)[c] = float_to_bf16(y);
        else
            ((float *)out)[c] = y;
    }
}

static inline v16f load16_act(const void *p, int64_t i, const int bf16) {
    return bf16 ? widen16((const uint16_t *)p + i) : load16((const float *)p + i);
}

static inline void store16_act(void *p, int64_t i, v16f x, const int bf16) {
    if (bf16)
        narrow16((uint16_t *)p + i, x);
    else
        store16((float *)p + i, x);
}

/* What a K/V cache holds. */
enum { CACHE_F32 = 0, CACHE_BF16 = 1, CACHE_I8 = 2 };

static inline int64_t cache_elem_bytes(const int kind) {
    return kind == CACHE_F32 ? 4 : kind == CACHE_BF16 ? 2 : 1;
}

/* The query and cache types the attention kernels pair (the table in attention_args.py): float32
 * queries on a float32 or int8 cache, bfloat16 ones on a bfloat16 or int8 cache; scales come with
 * an int8 cache and only with it. */
static inline int attention_types_served(int kind, int bf16, const float *k_scale) {
    const int pairs =
        kind == CACHE_I8 || (kind == CACHE_F32 && !bf16) || (kind == CACHE_BF16 && bf16);
    return pairs && (kind == CACHE_I8) == (k_scale != NULL);
}

/* CALL(NV, KIND, BF16) for head size d (64 -> NV 4, 128 -> NV 8) and the served types, every
 * argument a constant: the compiler makes one specialized copy of the kernel per case. */
#define CALL_SPECIALIZED(CALL, d, kind, bf16)                                                      \
    do {                                                                                           \
        if ((kind) == CACHE_F32)                                                                   \
            (d) == 64 ? CALL(4, CACHE_F32, 0) : CALL(8, CACHE_F32, 0);                             \
        else if ((kind) == CACHE_BF16)                                                             \
            (d) == 64 ? CALL(4, CACHE_BF16, 1) : CALL(8, CACHE_BF16, 1);                           \
        else if (bf16)                                                                             \
            (d) == 64 ? CALL(4, CACHE_I8, 1) : CALL(8, CACHE_I8, 1);                               \
        else                                                                                       \
            (d) == 64 ? CALL(4, CACHE_I8, 0) : CALL(8, CACHE_I8, 0);                               \
    } while (0)

/* The attention output's weighted sum of V, for n rows of outputs (query heads or query
 * positions) over V rows t0 .. t1-1 of one block of one head:
 *   acc[j] = acc[j] * corr[j] + sum_t w[j * w_row + t * w_key] * vs * v_t   (corr NULL: 1; vs: an
 *   int8 block's scale, used when `scaled`).
 * acc is [n, 16 * nv] floats; v is the block as bfloat16 (`v_bf16`: widened in registers as read)
 * or as floats. Rows go in groups whose sums stay in registers, each V row read once for a whole
 * group: read again for every row, loading V rather than multiplying bounded the loop. */
#define V_GROUP_ROWS(nv) ((nv) == 4 ? 4 : 2) /* group * nv sums + nv V rows fit in 32 registers */
static inline __attribute__((always_inline)) void
add_weighted_v_group(float *acc, const float *corr, const float *w, int64_t w_row, int64_t w_key,
                     const void *v, const int v_bf16, int t0, int t1, const int nq, const int nv,
                     const int scaled, float vs) {
    const int d = 16 * nv;
    v16f o[4][8];
    for (int j = 0; j < nq; j++)
        for (int c = 0; c < nv; c++) {
            o[j][c] = load16(acc + (size_t)j * d + 16 * c);
            if (corr != NULL) o[j][c] *= corr[j];
        }
    for (int t = t0; t < t1; t++) {
        v16f vt[8];
        for (int c = 0; c < nv; c++)
            vt[c] = v_bf16 ? widen16((const uint16_t *)v + t * d + 16 * c)
                           : load16((const float *)v + t * d + 16 * c);
        for (int j = 0; j < nq; j++) {
            const float wt = scaled ? w[j * w_row + t * w_key] * vs : w[j * w_row + t * w_key];
            for (int c = 0; c < nv; c++) o[j][c] += wt * vt[c];
        }
    }
    for (int j = 0; j < nq; j++)
        for (int c = 0; c < nv; c++) store16(acc + (size_t)j * d + 16 * c, o[j][c]);
}

static inline __attribute__((always_inline)) void
add_weighted_v(float *acc, const float *corr, const float *w, int64_t w_row, int64_t w_key,
               const void *v, const int v_bf16, int t0, int t1, int n, const int nv,
               const int scaled, float vs) {
    for (int j = 0; j < n;) {
        const int nq = n - j < V_GROUP_ROWS(nv) ? n - j : V_GROUP_ROWS(nv);
        float *a = acc + (size_t)j * 16 * nv;
        const float *cj = corr == NULL ? NULL : corr + j, *wj = w + j * w_row;
#define GROUP(NQ)                                                                                  \
    add_weighted_v_group(a, cj, wj, w_row, w_key, v, v_bf16, t0, t1, NQ, nv, scaled, vs)
        if (nq == 1)
            GROUP(1); /* a constant group size per call: the sums stay in registers */
        else if (nq == 2)
            GROUP(2);
        else if (nq == 3)
            GROUP(3);
        else
            GROUP(4);
#undef GROUP
        j += nq;
    }
}

/* One block of one head as floats: the cache itself when float32; a bfloat16 or int8 block
 * widened into `buf` (once, then read by every query of the head; an int8 block's scale is applied
 * by the caller). */
static inline const float *block_as_float(const void *cache, int64_t idx, int64_t elems,
                                          const int kind, float *restrict buf) {
    if (kind == CACHE_F32) return (const float *)cache + idx;
    if (kind == CACHE_BF16) {
        const uint16_t *src = (const uint16_t *)cache + idx;
        for (int64_t i = 0; i < elems; i += 16) store16(buf + i, widen16(src + i));
        return buf;
    }
    const int8_t *restrict src = (const int8_t *)cache + idx;
#pragma omp simd
    for (int64_t i = 0; i < elems; i++) buf[i] = (float)src[i];
    return buf;
}

#endif
