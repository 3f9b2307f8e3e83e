/* Writing one step's new K (or V) into the paged cache: a plain copy into a cache of its own type, or into
 * an int8 cache with one float32 scale per (block, KV head), following the rule of sluice/engine/kernels/kv_cache.py exactly (same float32 operations
 * in the same order, rounding half to even): per block touched this step and head, with `first`
 * its smallest offset written,
 *   s = max(first > 0 ? s_old : 0, absmax(new values) / 127, SCALE_FLOOR);
 *   if first > 0 and s > s_old: entries [0, first) become rint(q * (s_old / s)), clamped;
 *   new entries are rint(x / s) clamped to [-127, 127]; the scale becomes s.
 * The tokens a step writes to one block are consecutive in the slot mapping (the engine's layout),
 * so a block's work is one run of tokens; runs and heads are independent work items.
 *
 * x: [T, Hkv, D] float32 or bfloat16 (`bf16`, widened exactly to float32 first) at element
 * t * tok_stride + h * head_stride (+ e); slots [T] int64 (negative: skipped); cache
 * [num_blocks, Hkv, bs, D] int8; scale [num_blocks, Hkv].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define SCALE_FLOOR 1e-8f
#define PARALLEL_MIN_ELEMS (1 << 16)

static inline int8_t quant(float y) {
    y = rintf(y); /* the default rounding mode: half to even, as torch.round */
    y = y < -127.0f ? -127.0f : (y > 127.0f ? 127.0f : y);
    return (int8_t)y;
}

/* Returns 0, or -1 when scratch memory could not be allocated. */
int sluice_write_kv_int8(const void *x, int64_t tok_stride, int64_t head_stride, int T, int hkv,
                         int d, const int64_t *slots, int8_t *cache, float *scale, int bs, int bf16,
                         int num_threads) {
    /* runs of consecutive tokens writing the same block: tokens run_start[r] .. run_end[r] - 1 */
    int *run_start = malloc(sizeof(int) * 2 * (size_t)(T + 1));
    if (run_start == NULL) return -1;
    int *run_end = run_start + T + 1;
    int runs = 0;
    for (int t = 0; t < T;) {
        if (slots[t] < 0) {
            t++;
            continue;
        }
        int u = t + 1;
        while (u < T && slots[u] >= 0 && slots[u] / bs == slots[t] / bs) u++;
        run_start[runs] = t;
        run_end[runs++] = u;
        t = u;
    }
    const int64_t items = (int64_t)runs * hkv;
#pragma omp parallel for num_threads(num_threads) if ((int64_t)T * hkv * d >= PARALLEL_MIN_ELEMS)  \
    schedule(static)
    for (int64_t it = 0; it < items; it++) {
        const int r = (int)(it / hkv), h = (int)(it % hkv);
        const int t0 = run_start[r], t1 = run_end[r];
        const int64_t blk = slots[t0] / bs;
        int first = bs;
        float amax = 0.0f;
        for (int t = t0; t < t1; t++) {
            const int off = (int)(slots[t] % bs);
            first = off < first ? off : first;
            const int64_t xt = t * tok_stride + h * head_stride;
            for (int e = 0; e < d; e++) {
                const float a = fabsf(load_act(x, xt + e, bf16));
                amax = a > amax ? a : amax;
            }
        }
        float *sp = scale + blk * hkv + h;
        const float s_old = *sp;
        float s = first > 0 ? s_old : 0.0f;
        const float by_amax = amax / 127.0f;
        s = by_amax > s ? by_amax : s;
        s = s < SCALE_FLOOR ? SCALE_FLOOR : s;
        int8_t *base = cache + (blk * hkv + h) * (int64_t)bs * d;
        if (first > 0 && s > s_old) {
            const float ratio = s_old / s;
            for (int64_t e = 0; e < (int64_t)first * d; e++)
                base[e] = quant((float)base[e] * ratio);
        }
        for (int t = t0; t < t1; t++) {
            const int64_t xt = t * tok_stride + h * head_stride;
            int8_t *row = base + (slots[t] % bs) * d;
            for (int e = 0; e < d; e++) row[e] = quant(load_act(x, xt + e, bf16) / s);
        }
        *sp = s;
    }
    free(run_start);
    return 0;
}

/* The plain copy into a cache of x's own type (float32 or bfloat16: elem_bytes 4 or 2): token t's
 * K (or V) rows go to slot slots[t] (negative: skipped), one [D] row per head. */
void sluice_write_kv_copy(const void *x, int64_t tok_stride, int64_t head_stride, int T, int hkv,
                          int d, const int64_t *slots, void *cache, int bs, int elem_bytes,
                          int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((int64_t)T * hkv * d >= PARALLEL_MIN_ELEMS)  \
    schedule(static)
    for (int t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        const int64_t blk = slots[t] / bs, off = slots[t] % bs;
        for (int h = 0; h < hkv; h++)
            memcpy((char *)cache + ((blk * hkv + h) * bs + off) * d * elem_bytes,
                   (const char *)x + (t * tok_stride + h * head_stride) * elem_bytes,
                   (size_t)elem_bytes * d);
    }
}
