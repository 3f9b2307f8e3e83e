/* The small per-layer operations of a decoder layer on the CPU, fused: residual add + RMSNorm,
 * rotary embedding in place, SiLU(gate) * up. With a few dozen tokens in a step these tensors are
 * tiny and torch spends more time per operation dispatching it (and waking its threads) than
 * computing; each function here is one call over the whole batch. Semantics are those of the
 * torch references in sluice/engine/kernels/ (norm.py, rotary.py, activation.py), in float32.
 *
 * All matrices are row-major with the given row strides (in floats) and contiguous rows.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* Below this many elements one thread does the work: waking the team costs more. */
#define PARALLEL_MIN_ELEMS (1 << 16)

/* res_out = x + res (res NULL: res_out is x itself and is not written); out = w * rmsnorm(res_out). */
void sluice_add_rmsnorm_f32(const float *x, int64_t x_stride, const float *res, int64_t res_stride, float *res_out,
                            int64_t res_out_stride, const float *w, float eps, float *out, int64_t out_stride, int rows,
                            int width, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * width >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int t = 0; t < rows; t++) {
        const float *xt = x + t * x_stride;
        const float *r = xt;
        if (res != NULL) {
            const float *rt = res + t * res_stride;
            float *ro = res_out + t * res_out_stride;
#pragma omp simd
            for (int i = 0; i < width; i++) ro[i] = xt[i] + rt[i];
            r = ro;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < width; i++) ss += r[i] * r[i];
        const float inv = 1.0f / sqrtf(ss / (float)width + eps);
        float *o = out + t * out_stride;
#pragma omp simd
        for (int i = 0; i < width; i++) o[i] = w[i] * (r[i] * inv);
    }
}

/* out[i] = silu(gate[i]) * up[i]; silu(g) = g * sigmoid(g), the sigmoid from exp(-|g|) so the
 * exponent never overflows. */
static void silu_and_mul_row(const float *restrict gate, const float *restrict up, float *restrict out, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) {
        const float g = gate[i];
        const float e = exp_nonpositive(-fabsf(g));
        const float sig = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
        out[i] = g * sig * up[i];
    }
}

/* x [T, 2I] = (gate | up) -> out [T, I] */
void sluice_silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t out_stride, int rows, int inter,
                             int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * inter >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int t = 0; t < rows; t++) silu_and_mul_row(x + t * x_stride, x + t * x_stride + inter, out + t * out_stride, inter);
}

/* Rotate the pairs (i, i + D/2) of every head of q [T, Hq, D] and k [T, Hkv, D] in place:
 * (x1 cos - x2 sin, x2 cos + x1 sin); cos, sin [T, D/2]. */
void sluice_rotary_f32(float *q, int64_t q_stride, int hq, float *k, int64_t k_stride, int hkv, int d,
                       const float *cos, const float *sin, int rows, int num_threads) {
    const int half = d / 2;
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * (hq + hkv) * d >= PARALLEL_MIN_ELEMS) \
    schedule(static)
    for (int t = 0; t < rows; t++) {
        const float *c = cos + (int64_t)t * half;
        const float *s = sin + (int64_t)t * half;
        for (int h = 0; h < hq + hkv; h++) {
            float *x = h < hq ? q + t * q_stride + (int64_t)h * d : k + t * k_stride + (int64_t)(h - hq) * d;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}
