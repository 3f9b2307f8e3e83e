/* The small per-layer operations of a decoder layer on the CPU, fused: residual add + RMSNorm,
 * rotary embedding in place, SiLU(gate) * up. With a few dozen tokens in a step these tensors are
 * tiny and torch spends more time per operation dispatching it (and waking its threads) than
 * computing; each function here is one call over the whole batch. Semantics are those of the
 * torch references in sluice/engine/kernels/ (norm.py, rotary.py, activation.py): tensors are
 * float32 or bfloat16 (`bf16`, for all of a call's tensors but cos and sin, which are float32),
 * arithmetic is in float32, and bfloat16 results are rounded where the references round.
 *
 * All matrices are row-major with the given row strides (in elements) and contiguous rows.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* Below this many elements one thread does the work: waking the team costs more. A decode batch
 * of 64 rows of 576 (~37 K) is worth both threads: RMSNorm ~53 -> ~42 us a call in the model. */
#define PARALLEL_MIN_ELEMS (1 << 14)

static void add_rmsnorm_row_f32(const float *restrict x, const float *restrict res,
                                float *restrict res_out, const float *restrict w, float eps,
                                float *restrict out, int width) {
    const float *r = x;
    if (res != NULL) {
#pragma omp simd
        for (int i = 0; i < width; i++) res_out[i] = x[i] + res[i];
        r = res_out;
    }
    /* 16 lanes whatever the vector width (an OpenMP simd reduction would take the register's
     * lane count: other bits on an AVX-512, an AVX2 and an SSE2 build), then the lanes in order */
    const int vec = width - width % 16;
    v16f ssv = {0};
    for (int i = 0; i < vec; i += 16) {
        const v16f v = load16(r + i);
        ssv += v * v;
    }
    float ss = 0.0f;
    for (int c = 0; c < 16; c++) ss += ssv[c];
    for (int i = vec; i < width; i++) ss += r[i] * r[i];
    const float inv = 1.0f / sqrtf(ss / (float)width + eps);
#pragma omp simd
    for (int i = 0; i < width; i++) out[i] = w[i] * (r[i] * inv);
}

/* bfloat16 rows in explicit 16-wide vectors (the rounding is one instruction where the CPU has
 * AVX512-BF16), the last width % 16 elements one by one. The sum is rounded before the norm reads
 * it, and the normalized value before the weight multiplies it, as in HF. */
static void add_rmsnorm_row_bf16(const uint16_t *x, const uint16_t *res, uint16_t *res_out,
                                 const uint16_t *w, float eps, uint16_t *out, int width) {
    const int vec = width - width % 16;
    const uint16_t *r = x;
    if (res != NULL) {
        for (int i = 0; i < vec; i += 16) narrow16(res_out + i, widen16(x + i) + widen16(res + i));
        for (int i = vec; i < width; i++)
            res_out[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(res[i]));
        r = res_out;
    }
    v16f ssv = {0};
    for (int i = 0; i < vec; i += 16) {
        const v16f v = widen16(r + i);
        ssv += v * v;
    }
    float ss = 0.0f;
    for (int c = 0; c < 16; c++) ss += ssv[c];
    for (int i = vec; i < width; i++) ss += bf16_to_float(r[i]) * bf16_to_float(r[i]);
    const float inv = 1.0f / sqrtf(ss / (float)width + eps);
    for (int i = 0; i < vec; i += 16)
        narrow16(out + i, widen16(w + i) * round16_bf16(widen16(r + i) * inv));
    for (int i = vec; i < width; i++)
        out[i] = float_to_bf16(bf16_to_float(w[i]) *
                               bf16_to_float(float_to_bf16(bf16_to_float(r[i]) * inv)));
}

/* res_out = x + res (res NULL: res_out is x itself and is not written); out = w * rmsnorm(res_out). */
void sluice_add_rmsnorm(const void *x, int64_t x_stride, const void *res, int64_t res_stride,
                        void *res_out, int64_t res_out_stride, const void *w, float eps, void *out,
                        int64_t out_stride, int rows, int width, int bf16, int num_threads) {
    const int64_t b = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * width >= PARALLEL_MIN_ELEMS) \
    schedule(static)
    for (int t = 0; t < rows; t++) {
        const char *xt = (const char *)x + t * x_stride * b;
        const char *rt = res == NULL ? NULL : (const char *)res + t * res_stride * b;
        char *ro = res == NULL ? NULL : (char *)res_out + t * res_out_stride * b;
        char *o = (char *)out + t * out_stride * b;
        if (bf16)
            add_rmsnorm_row_bf16((const uint16_t *)xt, (const uint16_t *)rt, (uint16_t *)ro, w, eps,
                                 (uint16_t *)o, width);
        else
            add_rmsnorm_row_f32((const float *)xt, (const float *)rt, (float *)ro, w, eps,
                                (float *)o, width);
    }
}

/* out[i] = silu(gate[i]) * up[i]; silu(g) = g * sigmoid(g), the sigmoid from exp(-|g|) so the
 * exponent never overflows. bfloat16 rows pass through float buffers of STAGE elements. */
#define STAGE 256

static void silu_and_mul_f32(const float *restrict gate, const float *restrict up,
                             float *restrict out, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) {
        const float g = gate[i];
        const float e = exp_nonpositive(-fabsf(g));
        const float sig = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
        out[i] = g * sig * up[i];
    }
}

static void silu_and_mul_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int n) {
    float g[STAGE], u[STAGE], o[STAGE];
    for (int i = 0; i < n; i += STAGE) {
        const int m = n - i < STAGE ? n - i : STAGE;
        widen_n(gate + i, g, m);
        widen_n(up + i, u, m);
        silu_and_mul_f32(g, u, o, m);
        narrow_n(out + i, o, m);
    }
}

/* x [T, 2I] = (gate | up) -> out [T, I] */
void sluice_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t out_stride, int rows,
                         int inter, int bf16, int num_threads) {
    const int64_t b = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * inter >= PARALLEL_MIN_ELEMS) \
    schedule(static)
    for (int t = 0; t < rows; t++) {
        const char *xt = (const char *)x + t * x_stride * b;
        char *o = (char *)out + t * out_stride * b;
        if (bf16)
            silu_and_mul_bf16((const uint16_t *)xt, (const uint16_t *)(xt + inter * b),
                              (uint16_t *)o, inter);
        else
            silu_and_mul_f32((const float *)xt, (const float *)(xt + inter * b), (float *)o, inter);
    }
}

static void rotate_f32(float *restrict x1, float *restrict x2, const float *c, const float *s,
                       int half) {
#pragma omp simd
    for (int i = 0; i < half; i++) {
        const float a = x1[i], b = x2[i];
        x1[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i] + a * s[i];
    }
}

/* One head in place; a bfloat16 one through float buffers (head size up to 2 * STAGE). */
static void rotate_head(void *x, const float *c, const float *s, int half, int bf16) {
    if (!bf16) {
        rotate_f32(x, (float *)x + half, c, s, half);
        return;
    }
    float x1[STAGE], x2[STAGE];
    widen_n(x, x1, half);
    widen_n((const uint16_t *)x + half, x2, half);
    rotate_f32(x1, x2, c, s, half);
    narrow_n(x, x1, half);
    narrow_n((uint16_t *)x + half, x2, half);
}

/* Rotate the pairs (i, i + D/2) of every head of q [T, Hq, D] and k [T, Hkv, D] in place:
 * (x1 cos - x2 sin, x2 cos + x1 sin); cos, sin [T, D/2] float32. */
void sluice_rotary(void *q, int64_t q_stride, int hq, void *k, int64_t k_stride, int hkv, int d,
                   const float *cos, const float *sin, int rows, int bf16, int num_threads) {
    const int half = d / 2;
    const int64_t b = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * (hq + hkv) * d >=            \
                                                      PARALLEL_MIN_ELEMS) schedule(static)
    for (int t = 0; t < rows; t++) {
        const float *c = cos + (int64_t)t * half;
        const float *s = sin + (int64_t)t * half;
        for (int h = 0; h < hq + hkv; h++) {
            char *x = h < hq ? (char *)q + (t * q_stride + (int64_t)h * d) * b
                             : (char *)k + (t * k_stride + (int64_t)(h - hq) * d) * b;
            rotate_head(x, c, s, half, bf16);
        }
    }
}
