/* Shared by the CPU kernels: a vectorizable exp for non-positive arguments. */
#ifndef SLUICE_VEC_EXP_H
#define SLUICE_VEC_EXP_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 in single precision, written so the compiler vectorizes the loops that call
 * it (libm's expf is a scalar call). Range reduction by ln 2 split in two parts, then the Cephes
 * degree-6 polynomial on [-ln2/2, ln2/2]: relative error ~2e-7, like expf. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x; /* exp(-87) is still a normal float; smaller weights are 0 anyway */
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

#endif
