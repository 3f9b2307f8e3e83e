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

/* Below this many elements one thread does the work: waking the team costs more. */
#define PARALLEL_MIN_ELEMS (1 << 16)

static inline __attribute__((always_inline)) void add_rmsnorm_row(const void *x, const void *res, void *res_out,
                                                                 const void *w, float eps, void *out, int width,
                                                                 const int bf16) {
    const void *r = x;
    if (res != NULL) {
#pragma omp simd
        for (int i = 0; i < width; i++) store_act(res_out, i, load_act(x, i, bf16) + load_act(res, i, bf16), bf16);
        r = res_out;
    }
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < width; i++) {
        const float ri = load_act(r, i, bf16);
        ss += ri * ri;
    }
    const float inv = 1.0f / sqrtf(ss / (float)width + eps);
    if (bf16) {
        /* the normalized value is rounded to bfloat16 before the weight multiplies it, as in HF */
#pragma omp simd
        for (int i = 0; i < width; i++)
            store_act(out, i, load_act(w, i, 1) * bf16_to_float(float_to_bf16(load_act(r, i, 1) * inv)), 1);
    } else {
#pragma omp simd
        for (int i = 0; i < width; i++) store_act(out, i, load_act(w, i, 0) * (load_act(r, i, 0) * inv), 0);
    }
}

/* res_out = x + res (res NULL: res_out is x itself and is not written); out = w * rmsnorm(res_out). */
void sluice_add_rmsnorm(const void *x, int64_t x_stride, const void *res, int64_t res_stride, void *res_out,
                        int64_t res_out_stride, const void *w, float eps, void *out, int64_t out_stride, int rows,
                        int width, int bf16, int num_threads) {
    const int64_t b = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * width >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int t = 0; t < rows; t++) {
        const char *xt = (const char *)x + t * x_stride * b;
        const char *rt = res == NULL ? NULL : (const char *)res + t * res_stride * b;
        char *ro = res == NULL ? NULL : (char *)res_out + t * res_out_stride * b;
        char *o = (char *)out + t * out_stride * b;
        if (bf16)
            add_rmsnorm_row(xt, rt, ro, w, eps, o, width, 1);
        else
            add_rmsnorm_row(xt, rt, ro, w, eps, o, width, 0);
    }
}

/* out[i] = silu(gate[i]) * up[i]; silu(g) = g * sigmoid(g), the sigmoid from exp(-|g|) so the
 * exponent never overflows. */
static inline __attribute__((always_inline)) void silu_and_mul_row(const void *gate, const void *up, void *out, int n,
                                                                  const int bf16) {
#pragma omp simd
    for (int i = 0; i < n; i++) {
        const float g = load_act(gate, i, bf16);
        const float e = exp_nonpositive(-fabsf(g));
        const float sig = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
        store_act(out, i, g * sig * load_act(up, i, bf16), bf16);
    }
}

/* x [T, 2I] = (gate | up) -> out [T, I] */
void sluice_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t out_stride, int rows, int inter, int bf16,
                         int num_threads) {
    const int64_t b = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * inter >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int t = 0; t < rows; t++) {
        const char *xt = (const char *)x + t * x_stride * b;
        char *o = (char *)out + t * out_stride * b;
        if (bf16)
            silu_and_mul_row(xt, xt + inter * b, o, inter, 1);
        else
            silu_and_mul_row(xt, xt + inter * b, o, inter, 0);
    }
}

static inline __attribute__((always_inline)) void rotate_head(void *x, const float *c, const float *s, int half,
                                                             const int bf16) {
#pragma omp simd
    for (int i = 0; i < half; i++) {
        const float x1 = load_act(x, i, bf16), x2 = load_act(x, i + half, bf16);
        store_act(x, i, x1 * c[i] - x2 * s[i], bf16);
        store_act(x, i + half, x2 * c[i] + x1 * s[i], bf16);
    }
}

/* Rotate the pairs (i, i + D/2) of every head of q [T, Hq, D] and k [T, Hkv, D] in place:
 * (x1 cos - x2 sin, x2 cos + x1 sin); cos, sin [T, D/2] float32. */
void sluice_rotary(void *q, int64_t q_stride, int hq, void *k, int64_t k_stride, int hkv, int d, const float *cos,
                   const float *sin, int rows, int bf16, int num_threads) {
    const int half = d / 2;
    const int64_t b = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * (hq + hkv) * d >= PARALLEL_MIN_ELEMS) \
    schedule(static)
    for (int t = 0; t < rows; t++) {
        const float *c = cos + (int64_t)t * half;
        const float *s = sin + (int64_t)t * half;
        for (int h = 0; h < hq + hkv; h++) {
            char *x = h < hq ? (char *)q + (t * q_stride + (int64_t)h * d) * b
                             : (char *)k + (t * k_stride + (int64_t)(h - hq) * d) * b;
            if (bf16)
                rotate_head(x, c, s, half, 1);
            else
                rotate_head(x, c, s, half, 0);
        }
    }
}
