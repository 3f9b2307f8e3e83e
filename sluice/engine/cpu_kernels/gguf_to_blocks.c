/* A GGUF tensor's blocks as the int8 blocks of `block_int8_linear.c` (codes in -127..127, one
 * scale a block of 32 along a row), read straight from the file's bytes: no float copy of the
 * matrix is ever made, and a start does in a second what numpy's dequantization and a quantization
 * in torch did in tens.
 *
 * - Q8_0 and Q5_0 hold int8 blocks of 32 already (Q5_0: w = d (q - 16)): their codes and scales
 *   are taken as stored, so the engine multiplies the file's own values.
 * - The others (Q6_K, Q4_K, Q4_0, Q4_1) are decoded to their float32 values as llama.cpp decodes
 *   them, then quantized by GGUF's Q8_0 rule as `block_int8_linear.quantize_blocks` does:
 *   d = amax / 127, codes sign(v) floor(|v| / d + 0.5) with 1 / d taken first, clamped to 127.
 *   The same float operations in the same order as that Python path and numpy's decoders, so the
 *   bits are theirs on every CPU: this file is compiled without contracting a multiply and an add
 *   into one fused operation (the pragma below), and every operation is a plain IEEE one.
 *
 * Scales are returned as float32 (the caller rounds them to float16, as the Python path does).
 *
 * `sluice_gguf_to_dm_blocks` reads a 4- or 5-bit tensor's own codes (0..15, 0..31) with each
 * block of 32's d and m (w = d q + m), the 4-bit ones as `loader/gguf_blocks.int4_blocks` does
 * with numpy: Q4_1's and Q5_1's as stored, Q4_0's m = -8 d, Q5_0's m = -16 d, Q4_K's and Q5_K's
 * d sc and -(dmin mn) (float32 products, exact; rounded to float16 by the caller).
 *
 * `sluice_gguf_to_q6_blocks` reads a Q6_K tensor's own codes (0..63), int8 scales and float16 d,
 * for `block_int8_linear.c`'s 6-bit format: the file's values, not quantized again.
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define KB 32 /* values of an output block */

enum {
    T_Q8_0 = 8,
    T_Q5_0 = 6,
    T_Q5_1 = 7,
    T_Q4_0 = 2,
    T_Q4_1 = 3,
    T_Q4_K = 12,
    T_Q5_K = 13,
    T_Q6_K = 14
}; /* GGML's */

static float f16_to_f32(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        exp = 113;
        while (!(mant & 0x400)) {
            mant <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Values of one output block by the Q8_0 rule: codes and the float32 scale. */
static void quantize_block(const float *v, int8_t *codes, float *scale) {
    float amax = 0.0f;
    for (int i = 0; i < KB; i++) amax = fmaxf(amax, fabsf(v[i]));
    const float d = amax / 127.0f;
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < KB; i++) {
        const float x = v[i] * inv;
        float q = floorf(fabsf(x) + 0.5f);
        q = q > 127.0f ? 127.0f : q;
        codes[i] = (int8_t)(x < 0.0f ? -q : q);
    }
    *scale = d;
}

/* Q4_K's packed 6-bit scale and minimum of sub-block j (0..7). */
static void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Values of a type's unit: a block of 32, or a K-quant's super-block of 256. */
static int unit_of(int type) {
    return (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) ? 256 : 32;
}

/* Whether `decode_unit` decodes the type (what the int8 blocks and the rows are read from). */
static int decoded(int type) {
    return type == T_Q8_0 || type == T_Q5_0 || type == T_Q4_0 || type == T_Q4_1 || type == T_Q4_K ||
           type == T_Q6_K;
}

/* Unit `u` of a row's bytes decoded to its float32 values, as numpy's decoders compute them. */
static void decode_unit(const uint8_t *raw, int type, int64_t u, float *v) {
    switch (type) {
    case T_Q8_0: {
        const uint8_t *blk = raw + 34 * u;
        const float d = f16_to_f32(blk);
        for (int j = 0; j < KB; j++) v[j] = (float)(int8_t)blk[2 + j] * d;
        return;
    }
    case T_Q5_0: {
        const uint8_t *blk = raw + 22 * u;
        const float d = f16_to_f32(blk);
        uint32_t qh;
        memcpy(&qh, blk + 2, 4);
        for (int j = 0; j < 16; j++) {
            const int lo = (blk[6 + j] & 0x0f) | (((qh >> j) & 1) << 4);
            const int hi = (blk[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            v[j] = d * (float)(lo - 16);
            v[j + 16] = d * (float)(hi - 16);
        }
        return;
    }
    case T_Q4_0:
    case T_Q4_1: {
        const int size = type == T_Q4_0 ? 18 : 20;
        const uint8_t *blk = raw + size * u, *qs = blk + size - 16;
        const float d = f16_to_f32(blk);
        for (int j = 0; j < 16; j++) {
            if (type == T_Q4_0) {
                v[j] = d * (float)((qs[j] & 0x0f) - 8);
                v[j + 16] = d * (float)((qs[j] >> 4) - 8);
            } else {
                const float m = f16_to_f32(blk + 2);
                v[j] = d * (float)(qs[j] & 0x0f) + m;
                v[j + 16] = d * (float)(qs[j] >> 4) + m;
            }
        }
        return;
    }
    case T_Q4_K: {
        const uint8_t *blk = raw + 144 * u;
        const float d = f16_to_f32(blk), dmin = f16_to_f32(blk + 2);
        for (int g = 0; g < 4; g++) { /* 64 values: low nibbles, then high */
            const uint8_t *qs = blk + 16 + 32 * g;
            for (int half = 0; half < 2; half++) {
                int sc, mn;
                k_scale_min(blk + 4, 2 * g + half, &sc, &mn);
                const float ds = d * (float)sc, dm = dmin * (float)mn;
                for (int l = 0; l < 32; l++) {
                    const int q = half ? qs[l] >> 4 : qs[l] & 0x0f;
                    v[64 * g + 32 * half + l] = ds * (float)q - dm;
                }
            }
        }
        return;
    }
    case T_Q6_K: {
        const uint8_t *blk = raw + 210 * u;
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = f16_to_f32(blk + 208);
        for (int half = 0; half < 2; half++) {
            for (int l = 0; l < 32; l++) {
                const int is = 8 * half + l / 16;
                const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                float *y = v + 128 * half;
                y[l] = (d * (float)sc[is]) * (float)q1;
                y[l + 32] = (d * (float)sc[is + 2]) * (float)q2;
                y[l + 64] = (d * (float)sc[is + 4]) * (float)q3;
                y[l + 96] = (d * (float)sc[is + 6]) * (float)q4;
            }
            ql += 64;
            qh += 32;
        }
        return;
    }
    }
}

/* One row: `nb` output blocks from the row's bytes. */
static void row_blocks(const uint8_t *raw, int type, int64_t nb, int8_t *codes, float *scales) {
    if (type == T_Q8_0) { /* int8 blocks already: as stored */
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = raw + 34 * b;
            scales[b] = f16_to_f32(blk);
            memcpy(codes + KB * b, blk + 2, KB);
        }
        return;
    }
    if (type == T_Q5_0) { /* w = d (q - 16): the codes q - 16 with d */
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = raw + 22 * b;
            uint32_t qh;
            memcpy(&qh, blk + 2, 4);
            for (int j = 0; j < 16; j++) {
                const int lo = (blk[6 + j] & 0x0f) | (((qh >> j) & 1) << 4);
                const int hi = (blk[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
                codes[KB * b + j] = (int8_t)(lo - 16);
                codes[KB * b + j + 16] = (int8_t)(hi - 16);
            }
            scales[b] = f16_to_f32(blk);
        }
        return;
    }
    float v[256];
    const int unit = unit_of(type), per_unit = unit / KB;
    for (int64_t u = 0; u < nb / per_unit; u++) {
        decode_unit(raw, type, u, v);
        for (int b = 0; b < per_unit; b++) {
            const int64_t at = u * per_unit + b;
            quantize_block(v + KB * b, codes + KB * at, scales + at);
        }
    }
}

/* Bytes of one row of K values in `type`; 0 for a type this file does not read. */
int64_t sluice_gguf_row_bytes(int type, int64_t K) {
    switch (type) {
    case T_Q8_0:
        return K / 32 * 34;
    case T_Q5_0:
        return K / 32 * 22;
    case T_Q4_0:
        return K / 32 * 18;
    case T_Q4_1:
        return K / 32 * 20;
    case T_Q4_K:
        return K / 256 * 144;
    case T_Q5_1:
        return K / 32 * 24;
    case T_Q5_K:
        return K / 256 * 176;
    case T_Q6_K:
        return K / 256 * 210;
    default:
        return 0;
    }
}

/* rows x K values of `type` (K a multiple of the type's block) -> codes int8 [rows, K] and
 * scales float32 [rows, K / 32]. Returns -1 for a type or K it cannot read, else 0. */
int sluice_gguf_to_int8_blocks(const uint8_t *raw, int type, int64_t rows, int64_t K, int8_t *codes,
                               float *scales, int num_threads) {
    const int64_t row_bytes = sluice_gguf_row_bytes(type, K);
    if (!decoded(type) || K % unit_of(type) != 0) return -1;
    const int64_t nb = K / KB;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * K > 65536)
    for (int64_t r = 0; r < rows; r++)
        row_blocks(raw + r * row_bytes, type, nb, codes + r * K, scales + r * nb);
    return 0;
}

/* rows x K values of a type stored as codes with a d and an m a block of 32 (w = d q + m): the
 * 4-bit Q4_0, Q4_1, Q4_K (codes 0..15) and the 5-bit Q5_0, Q5_1, Q5_K (0..31) -> codes uint8
 * [rows, K], d and m float32 [rows, K / 32]. Returns -1 for another type or a K it cannot read,
 * else 0. */
int sluice_gguf_to_dm_blocks(const uint8_t *raw, int type, int64_t rows, int64_t K, uint8_t *codes,
                             float *d_out, float *m_out, int num_threads) {
    const int five = type == T_Q5_0 || type == T_Q5_1 || type == T_Q5_K;
    const int four = type == T_Q4_0 || type == T_Q4_1 || type == T_Q4_K;
    if (!(four || five) || K % unit_of(type) != 0) return -1;
    const int64_t row_bytes = sluice_gguf_row_bytes(type, K), nb = K / KB;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * K > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = raw + r * row_bytes;
        uint8_t *q = codes + r * K;
        float *d = d_out + r * nb, *m = m_out + r * nb;
        if (type == T_Q4_K || type == T_Q5_K) { /* d, dmin, 12 bytes of scales, Q5_K's qh, qs */
            const int size = five ? 176 : 144, qs_at = five ? 48 : 16;
            for (int64_t s = 0; s < nb / 8; s++) {
                const uint8_t *blk = row + size * s, *qh = blk + 16;
                const float sd = f16_to_f32(blk), smin = f16_to_f32(blk + 2);
                for (int j = 0; j < 8; j++) { /* block j: group j / 2, low or high nibbles */
                    int sc, mn;
                    k_scale_min(blk + 4, j, &sc, &mn);
                    d[8 * s + j] = sd * (float)sc;
                    m[8 * s + j] = -(smin * (float)mn);
                    const uint8_t *qs = blk + qs_at + 32 * (j / 2);
                    for (int l = 0; l < 32; l++) {
                        const int low = (j & 1) ? qs[l] >> 4 : qs[l] & 0x0f;
                        const int top = five ? ((qh[l] >> j) & 1) << 4 : 0;
                        q[KB * (8 * s + j) + l] = (uint8_t)(low | top);
                    }
                }
            }
        } else { /* d, Q4_1's and Q5_1's m, the 5-bit types' 32 top bits, 16 bytes of nibbles */
            const int size = (int)(row_bytes / nb);
            const float m_of_d = type == T_Q4_0 ? -8.0f : type == T_Q5_0 ? -16.0f : 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = row + size * b, *qs = blk + size - 16;
                uint32_t qh = 0;
                if (five) memcpy(&qh, blk + size - 20, 4);
                d[b] = f16_to_f32(blk);
                m[b] = m_of_d != 0.0f ? m_of_d * d[b] : f16_to_f32(blk + 2);
                for (int j = 0; j < 16; j++) {
                    q[KB * b + j] = (uint8_t)((qs[j] & 0x0f) | (((qh >> j) & 1) << 4));
                    q[KB * b + j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
                }
            }
        }
    }
    return 0;
}

/* rows x K values of Q6_K -> codes uint8 [rows, K] in 0..63 (w = d sc (q - 32)), d as float16
 * bits [rows, K / 32] (each block of 32 its super-block's) and sc int8 [rows, K / 16]. Returns -1
 * for a K it cannot read, else 0. */
int sluice_gguf_to_q6_blocks(const uint8_t *raw, int64_t rows, int64_t K, uint8_t *codes,
                             uint16_t *d_out, int8_t *sc_out, int num_threads) {
    if (K % 256 != 0) return -1;
    const int64_t row_bytes = sluice_gguf_row_bytes(T_Q6_K, K), units = K / 256;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * K > 65536)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t u = 0; u < units; u++) {
            const uint8_t *blk = raw + r * row_bytes + 210 * u;
            uint8_t *q = codes + r * K + 256 * u;
            uint16_t d;
            memcpy(&d, blk + 208, 2);
            for (int b = 0; b < 8; b++) d_out[r * (K / KB) + 8 * u + b] = d;
            memcpy(sc_out + r * (K / 16) + 16 * u, blk + 192, 16);
            for (int half = 0; half < 2; half++) { /* as decode_unit reads them */
                const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
                uint8_t *y = q + 128 * half;
                for (int l = 0; l < 32; l++) {
                    y[l] = (uint8_t)((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4));
                    y[l + 32] = (uint8_t)((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4));
                    y[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                    y[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
                }
            }
        }
    return 0;
}

/* Rows ids[0..T-1] of a [N, K] tensor of `type` decoded to float32 into out [T, K]: the values
 * numpy's decoders give. An embedding looked up in the file's own blocks. Returns -1 for a type
 * or K it cannot read, -2 for an id outside [0, N), else 0. */
int sluice_gguf_rows(const uint8_t *raw, int type, int64_t N, int64_t K, const int64_t *ids,
                     int64_t T, float *out) {
    const int64_t row_bytes = sluice_gguf_row_bytes(type, K);
    if (!decoded(type) || K % unit_of(type) != 0) return -1;
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return -2;
    const int unit = unit_of(type);
    for (int64_t t = 0; t < T; t++)
        for (int64_t u = 0; u < K / unit; u++)
            decode_unit(raw + ids[t] * row_bytes, type, u, out + t * K + u * unit);
    return 0;
}
