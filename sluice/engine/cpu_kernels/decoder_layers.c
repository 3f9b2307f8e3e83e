/* A step's decoder layers in one native call: for each layer, in order, the kernels the model's
 * Python forward would call one by one (model.DecoderLayer.forward), with the same arguments, so
 * the results are the same bits; what goes is the interpreter and the tensor bookkeeping between
 * them (~10 calls a layer, which at batch 1 cost as much as the layer's arithmetic).
 *
 *   h, r = add_rmsnorm(x, r, input_norm)     qkv = h @ Wqkv.T (+ b)      rotary(q, k)
 *   write_kv(k, v)                           attn = attend(q)            x = attn @ Wo.T (+ b)
 *   h, r = add_rmsnorm(x, r, post_norm)      x = silu_and_mul(h @ Wgu.T) @ Wdown.T
 *
 * The matmuls are those whose weights are packed for a kernel of this library (block int8/int4
 * or fixed-order); layers with any other weight stay on the Python path (`decoder_layers.py`).
 * Scratch rows are allocated once a call.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

/* The kernels this runs, from the library's other sources. */
int sluice_block_int8_linear(const void *x, int64_t x_stride, const uint8_t *packed,
                             const void *bias, void *out, int64_t out_stride, int64_t M, int64_t N,
                             int64_t K, int bf16, int fmt, int num_threads);
int sluice_fixed_order_linear(const void *x, int64_t x_stride, const void *packed, const void *bias,
                              void *out, int64_t out_stride, int64_t M, int64_t N, int64_t K,
                              int bf16, int num_threads);
void sluice_add_rmsnorm(const void *x, int64_t x_stride, const void *res, int64_t res_stride,
                        void *res_out, int64_t res_out_stride, const void *w, float eps, void *out,
                        int64_t out_stride, int rows, int width, int bf16, int num_threads);
void sluice_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t out_stride, int rows,
                         int inter, int bf16, int num_threads);
void sluice_rotary(void *q, int64_t q_stride, int hq, void *k, int64_t k_stride, int hkv, int d,
                   const float *cos, const float *sin, int rows, int bf16, int num_threads);
void sluice_write_kv_copy(const void *x, int64_t tok_stride, int64_t head_stride, int T, int hkv,
                          int d, const int64_t *slots, void *cache, int bs, int elem_bytes,
                          int num_threads);
int sluice_write_kv_int8(const void *x, int64_t tok_stride, int64_t head_stride, int T, int hkv,
                         int d, const int64_t *slots, int8_t *cache, float *scale, int bs, int bf16,
                         int num_threads);
int sluice_paged_decode(const void *q, int64_t q_stride, void *out, int64_t out_stride,
                        const int64_t *tokens, int n, const void *k_cache, const void *v_cache,
                        const float *k_scale, const float *v_scale, const int32_t *block_tables,
                        int64_t bt_stride, const int32_t *seq_lens, int hkv, int g, int d, int bs,
                        float scale, int window, int max_len, int kind, int bf16, int num_threads);
int sluice_paged_prefill(const void *q, int64_t q_stride, void *out, int64_t out_stride,
                         const int64_t *starts, const int32_t *q_lens, const int32_t *seq_lens,
                         int n, const void *k_cache, const void *v_cache, const float *k_scale,
                         const float *v_scale, const int32_t *block_tables, int64_t bt_stride,
                         int hkv, int g, int d, int bs, float scale, int window, int kind, int bf16,
                         int num_threads);

/* A matmul's weight: how it is packed (`kind`) and where. */
#define W_Q8 0          /* block_int8_linear, fmt 0 */
#define W_Q4 1          /* block_int8_linear, fmt 1 */
#define W_FIXED_ORDER 2 /* fixed_order_linear */
#define W_Q6 3          /* block_int8_linear, fmt 3 */

typedef struct {
    const void *data, *bias; /* bias NULL: none */
    int64_t kind;
} sluice_weight;

/* One layer's tensors (the layer table `decoder_layers.py` builds, one entry a layer). */
typedef struct {
    const void *input_norm, *post_norm;
    sluice_weight qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    float *k_scale, *v_scale; /* an int8 cache's scales; NULL for a cache of the model's type */
} sluice_layer;

/* The model's shapes and the step's plan, as the attention kernels take it. */
typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, inter, block_size;
    float eps, scale;
    int32_t window, cache_kind, bf16, num_threads;
    const float *cos, *sin; /* [rows, D/2] */
    const int64_t *slots;   /* [rows] */
    int64_t num_decodes, decode_bt_stride, max_seq_len;
    const int64_t *decode_tokens;
    const int32_t *decode_block_tables, *decode_seq_lens;
    int64_t num_prefills, prefill_bt_stride;
    const int64_t *prefill_starts;
    const int32_t *prefill_q_lens, *prefill_seq_lens, *prefill_block_tables;
} sluice_step;

static int matmul(const sluice_weight *w, const void *x, int64_t x_stride, void *out, int64_t M,
                  int64_t N, int64_t K, const sluice_step *s) {
    if (w->kind == W_FIXED_ORDER)
        return sluice_fixed_order_linear(x, x_stride, w->data, w->bias, out, N, M, N, K, s->bf16,
                                         s->num_threads);
    return sluice_block_int8_linear(x, x_stride, w->data, w->bias, out, N, M, N, K, s->bf16,
                                    (int)w->kind, s->num_threads);
}

/* k or v rows of the step (strided inside qkv) into one layer's cache. */
static int write_kv(const sluice_step *s, const char *x, int64_t tok_stride, void *cache,
                    float *scale) {
    const int T = (int)s->rows, hkv = (int)s->kv_heads, d = (int)s->head_dim,
              bs = (int)s->block_size;
    if (scale != NULL)
        return sluice_write_kv_int8(x, tok_stride, d, T, hkv, d, s->slots, cache, scale, bs,
                                    s->bf16, s->num_threads);
    sluice_write_kv_copy(x, tok_stride, d, T, hkv, d, s->slots, cache, bs, s->bf16 ? 2 : 4,
                         s->num_threads);
    return 0;
}

/* x [rows, H] and residual [rows, H] (the layer stack's input is x + residual; res_in NULL: x
 * alone) -> the last layer's (x, residual) in x_out and res_out. Returns 0, -1 where scratch
 * memory could not be had, or the first failing kernel's code. */
int sluice_decoder_layers(const sluice_layer *layers, int num_layers, const sluice_step *s,
                          const void *x_in, const void *res_in, void *x_out, void *res_out) {
    const int64_t T = s->rows, H = s->hidden, D = s->head_dim, I = s->inter, elem = s->bf16 ? 2 : 4;
    const int64_t q_size = s->heads * D, kv_size = s->kv_heads * D, qkv_n = q_size + 2 * kv_size;
    const int g = (int)(s->heads / s->kv_heads), nt = s->num_threads;
    if (T == 0 || num_layers == 0) return 0;
    /* h [T, H], the residual between a layer's two norms [T, H], qkv [T, qkv_n], attn [T, q_size],
     * gate_up [T, 2I], act [T, I] */
    const int64_t widths[6] = {H, H, qkv_n, q_size, 2 * I, I};
    int64_t total = 0;
    for (int i = 0; i < 6; i++) total += T * widths[i];
    char *scratch = malloc((size_t)(total * elem));
    if (scratch == NULL) return -1;
    char *h = scratch, *mid = h + T * H * elem, *qkv = mid + T * H * elem,
         *attn = qkv + T * qkv_n * elem;
    char *gu = attn + T * q_size * elem, *act = gu + T * 2 * I * elem;

    /* The residual goes res -> mid (first norm) -> res_out (second norm), so no norm writes the
     * buffer it reads; without a residual the first norm's is x itself, as in the Python path. */
    const void *x = x_in, *res = res_in;
    int rc = 0;
    for (int l = 0; l < num_layers; l++) {
        const sluice_layer *L = &layers[l];
        const void *r1 = res == NULL ? x : mid;
        sluice_add_rmsnorm(x, H, res, H, mid, H, L->input_norm, s->eps, h, H, (int)T, (int)H,
                           s->bf16, nt);
        if ((rc = matmul(&L->qkv, h, H, qkv, T, qkv_n, H, s)) != 0) break;
        sluice_rotary(qkv, qkv_n, (int)s->heads, qkv + q_size * elem, qkv_n, (int)s->kv_heads,
                      (int)D, s->cos, s->sin, (int)T, s->bf16, nt);
        if ((rc = write_kv(s, qkv + q_size * elem, qkv_n, L->k_cache, L->k_scale)) != 0) break;
        if ((rc = write_kv(s, qkv + (q_size + kv_size) * elem, qkv_n, L->v_cache, L->v_scale)) != 0)
            break;
        if (s->num_decodes > 0 &&
            (rc = sluice_paged_decode(
                 qkv, qkv_n, attn, q_size, s->decode_tokens, (int)s->num_decodes, L->k_cache,
                 L->v_cache, L->k_scale, L->v_scale, s->decode_block_tables, s->decode_bt_stride,
                 s->decode_seq_lens, (int)s->kv_heads, g, (int)D, (int)s->block_size, s->scale,
                 s->window, (int)s->max_seq_len, s->cache_kind, s->bf16, nt)) != 0)
            break;
        if (s->num_prefills > 0 &&
            (rc = sluice_paged_prefill(
                 qkv, qkv_n, attn, q_size, s->prefill_starts, s->prefill_q_lens,
                 s->prefill_seq_lens, (int)s->num_prefills, L->k_cache, L->v_cache, L->k_scale,
                 L->v_scale, s->prefill_block_tables, s->prefill_bt_stride, (int)s->kv_heads, g,
                 (int)D, (int)s->block_size, s->scale, s->window, s->cache_kind, s->bf16, nt)) != 0)
            break;
        if ((rc = matmul(&L->o, attn, q_size, x_out, T, H, q_size, s)) != 0) break;
        sluice_add_rmsnorm(x_out, H, r1, H, res_out, H, L->post_norm, s->eps, h, H, (int)T, (int)H,
                           s->bf16, nt);
        if ((rc = matmul(&L->gate_up, h, H, gu, T, 2 * I, H, s)) != 0) break;
        sluice_silu_and_mul(gu, 2 * I, act, I, (int)T, (int)I, s->bf16, nt);
        if ((rc = matmul(&L->down, act, I, x_out, T, H, I, s)) != 0) break;
        x = x_out, res = res_out;
    }
    free(scratch);
    return rc;
}

int sluice_block_int8_rows(const uint8_t *packed, int64_t N, int64_t K, int fmt, const int64_t *ids,
                           int64_t T, void *out, int bf16);
int sluice_gguf_rows(const uint8_t *raw, int type, int64_t N, int64_t K, const int64_t *ids,
                     int64_t T, float *out);

/* Where a step's token embeddings come from. */
#define EMBED_TABLE 0     /* a [vocab, H] table in the activations' type: rows copied */
#define EMBED_BLOCKS 1    /* a tied LM head's packed [vocab, H] blocks: rows dequantized */
#define EMBED_ROWS_INT8 2 /* int8 codes [vocab, H] and a float32 scale a row (`Int8Embedding`) */
#define EMBED_FILE 3      /* a GGUF tensor's own blocks (`FileEmbedding`): rows decoded */

typedef struct {
    const void *data;
    const float *scales; /* EMBED_ROWS_INT8's */
    int64_t vocab, kind;
    int64_t file_type; /* EMBED_FILE's: GGML's number of the tensor's type; EMBED_BLOCKS's: the
                        * blocks' format (block_int8_linear's fmt) */
} sluice_embedding;

/* Rows of an EMBED_FILE table into x in the activations' type: decoded to float32 (gguf_to_blocks.c)
 * and, for bfloat16, rounded once, as torch's cast of those rows rounds them. */
static int file_rows(const sluice_embedding *e, const int64_t *ids, int64_t T, int64_t H, int bf16,
                     char *x) {
    float *rows = bf16 ? malloc(sizeof(float) * (size_t)(T * H)) : (float *)x;
    if (rows == NULL) return -1;
    int rc = sluice_gguf_rows(e->data, (int)e->file_type, e->vocab, H, ids, T, rows);
    if (bf16) {
        for (int64_t i = 0; rc == 0 && i < T * H; i++) ((uint16_t *)x)[i] = float_to_bf16(rows[i]);
        free(rows);
    }
    return rc == 0 ? 0 : -3;
}

/* Row `id` of an EMBED_ROWS_INT8 table as torch computes it in the model's type: code and scale
 * each in that type, their product rounded to it. */
static void int8_row(const sluice_embedding *e, int64_t id, int64_t H, int bf16, void *out) {
    const int8_t *codes = (const int8_t *)e->data + id * H;
    if (bf16) {
        const float scale = bf16_to_float(float_to_bf16(e->scales[id]));
        for (int64_t k = 0; k < H; k++)
            ((uint16_t *)out)[k] = float_to_bf16((float)codes[k] * scale);
    } else {
        for (int64_t k = 0; k < H; k++) ((float *)out)[k] = (float)codes[k] * e->scales[id];
    }
}

/* A step of decodes from token ids to the final norm's output, in one call: what the model's
 * forward does around the layer stack (the embedding lookup, the rotary tables' rows, the final
 * norm, and the LM head where `head` is not NULL) with the same kernels, so the same bits, and none
 * of the Python between them. `step` as for sluice_decoder_layers but for cos and sin, which are
 * taken here from the rotary tables ([positions, D/2], float32) at each token's position. out:
 * [rows, H]; logits: [rows, vocab], in the activations' type. Returns 0, -1 where
 * scratch memory could not be had, -3 for a token id outside the vocabulary, or the first
 * failing kernel's code. */
int sluice_decode_forward(const sluice_layer *layers, int num_layers, const sluice_step *step,
                          const sluice_embedding *embed, const int64_t *ids,
                          const int64_t *positions, const float *cos_table, const float *sin_table,
                          const void *final_norm, void *out, const sluice_weight *head,
                          int64_t vocab, void *logits) {
    const int64_t T = step->rows, H = step->hidden, half = step->head_dim / 2,
                  elem = step->bf16 ? 2 : 4;
    if (T == 0) return 0;
    /* x, the last layer's x, its residual [T, H]; then cos and sin [T, D/2] */
    char *scratch = malloc((size_t)(3 * T * H * elem) + sizeof(float) * (size_t)(2 * T * half));
    if (scratch == NULL) return -1;
    char *x = scratch, *x_last = x + T * H * elem, *res = x_last + T * H * elem;
    float *cos = (float *)(res + T * H * elem), *sin = cos + T * half;
    int rc = 0;
    if (embed->kind == EMBED_BLOCKS) {
        if (sluice_block_int8_rows(embed->data, embed->vocab, H, (int)embed->file_type, ids, T, x,
                                   step->bf16) != 0)
            rc = -3;
    } else if (embed->kind == EMBED_FILE) {
        rc = file_rows(embed, ids, T, H, step->bf16, x);
    } else {
        for (int64_t t = 0; t < T && rc == 0; t++) {
            if (ids[t] < 0 || ids[t] >= embed->vocab)
                rc = -3;
            else if (embed->kind == EMBED_ROWS_INT8)
                int8_row(embed, ids[t], H, step->bf16, x + t * H * elem);
            else
                memcpy(x + t * H * elem, (const char *)embed->data + ids[t] * H * elem,
                       (size_t)(H * elem));
        }
    }
    if (rc == 0) {
        for (int64_t t = 0; t < T; t++) {
            memcpy(cos + t * half, cos_table + positions[t] * half, sizeof(float) * (size_t)half);
            memcpy(sin + t * half, sin_table + positions[t] * half, sizeof(float) * (size_t)half);
        }
        sluice_step s = *step;
        s.cos = cos, s.sin = sin;
        rc = sluice_decoder_layers(layers, num_layers, &s, x, NULL, x_last, res);
        /* the final norm of x + residual; the sum it also gives goes to x, no longer needed */
        if (rc == 0)
            sluice_add_rmsnorm(x_last, H, res, H, x, H, final_norm, s.eps, out, H, (int)T, (int)H,
                               s.bf16, s.num_threads);
        if (rc == 0 && head != NULL) rc = matmul(head, out, H, logits, T, vocab, H, &s);
    }
    free(scratch);
    return rc;
}
