/* The softmax arithmetic of deterministic mode's sampler, over rows of float32 logits: each row's
 * log-sum-exp, exp(x - shift) per element, and running sums, in one order fixed by this file
 * (torch's own kernels sum in the lanes of the CPU's widest vectors, so their bits depend on the
 * CPU: AVX-512, AVX2 and plain builds of torch give three answers for one softmax).
 *
 * Sums of exponentials go into 16 lanes, element i into lane i % 16 (a last partial vector padded
 * with zeros), then the lanes are added in order; exp and log are simd.h's own. -inf logits (what
 * truncation masks) weigh exactly 0. Rows are independent, so threads split rows only.
 *
 * x [rows, width] with row stride `stride` (elements); outputs are contiguous. */
#include <math.h>
#include <stdint.h>

#include "simd.h"

/* Below this many elements one thread does the work: waking the team costs more. */
#define PARALLEL_MIN_ELEMS (1 << 16)

/* exp(v) for v <= 0, and exactly 0 for -inf (exp_nonpositive clamps below -87) */
static inline float weight_of(float v) { return v == -INFINITY ? 0.0f : exp_nonpositive(v); }

static float logsumexp_row(const float *x, int64_t width) {
    float m = -INFINITY;
    for (int64_t i = 0; i < width; i++) m = x[i] > m ? x[i] : m;
    if (m == -INFINITY || m == INFINITY) return m;
    v16f acc = {0};
    for (int64_t i = 0; i < width; i += 16) {
        float w[16];
        for (int c = 0; c < 16; c++) w[c] = i + c < width ? weight_of(x[i + c] - m) : 0.0f;
        acc += load16(w);
    }
    float sum = 0.0f;
    for (int c = 0; c < 16; c++) sum += acc[c];
    return m + log_positive(sum); /* sum >= 1: the maximum weighs exp(0) */
}

void sluice_row_logsumexp(const float *x, int64_t stride, int64_t rows, int64_t width, float *out,
                          int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows > 1 &&                                  \
                                                      rows * width >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) out[r] = logsumexp_row(x + r * stride, width);
}

/* out[r][i] = exp(x[r][i] - shift[r]), for shifts at least each row's maximum (a log-sum-exp) */
void sluice_row_exp_shifted(const float *x, int64_t stride, const float *shift, int64_t rows,
                            int64_t width, float *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows > 1 &&                                  \
                                                      rows * width >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * stride;
        float *o = out + r * width;
        const float s = shift[r];
        for (int64_t i = 0; i < width; i++) {
            const float v = xr[i] - s;
            o[i] = weight_of(v > 0.0f ? 0.0f : v);
        }
    }
}

/* out[r][i] = x[r][0] + ... + x[r][i], added left to right */
void sluice_row_cumsum(const float *x, int64_t stride, int64_t rows, int64_t width, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < width; i++) out[r * width + i] = acc += x[r * stride + i];
    }
}
