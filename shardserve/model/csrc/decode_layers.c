/*
 * A decode step through a stack of decoder layers in one call (shardserve/model/fused_decode.py).
 *
 * Why: with quantized weights a batch-1 decode step of the default model spends ~3.3 ms in the
 * 120 matrix products and ~2.3 ms in Python between them (module calls, argument checks, tensor
 * allocation: eight kernel calls a layer, 30 layers). This file runs the same kernels, in the
 * same order, on the same buffers, from C: the results are bit-identical to the layer-by-layer
 * path, only the Python between the calls is gone.
 *
 * Per layer (HF Llama semantics, the residual stream carried beside the hidden state):
 *
 *   h        = rms_norm(x + residual)        residual <- x + residual    (layer 0 of a fresh
 *                                                                          stream: residual <- x)
 *   qkv      = h @ Wqkv^T (+ bias)           [B, (H + 2 Hkv) D]
 *   rope_inplace(q and k rows of qkv)        cache_write(k, v of qkv -> slots)
 *   attn     = decode_attention(q, cache)    [B, H D]
 *   x        = attn @ Wo^T
 *   h        = rms_norm(x + residual)        residual <- x + residual
 *   gate_up  = h @ Wgu^T                     act = silu(gate) * up
 *   x        = act @ Wdown^T
 *
 * With LoRA adapters (model/lora.py) each of the four products is followed by its adapters'
 * share for the rows that have one (lora_add, csrc/lora_kernels.c; after the bias), as the
 * layer-by-layer path adds it: the same kernel in the same order, so still bit-identical.
 *
 * On return x and residual hold the stack's output pair (the caller applies the final norm).
 * Every buffer is dense row-major in `dtype`; scratch buffers are the caller's.
 */
#include <stdint.h>
#include <string.h>

#include "kernels_common.h"

/* One quantized weight: row ranges (segments) one after another, each `rows` rows of ggml
 * `type` blocks, row_bytes apart, multiplied by the row kernels (quant_matmul) up to rows_max
 * rows of x and by the panel GEMM (quant_gemm) past them, as quantization.py chooses. Several
 * where a fused weight's pieces differ in type (a Q4_K_M file's q/k in Q4_K beside a Q6_K v) or
 * lie apart in the file. */
#define DL_MAX_SEGMENTS 3
typedef struct {
    const uint8_t *w;
    int64_t row_bytes;
    int64_t rows;
    int32_t type, rows_max;
} dl_segment_t;

typedef struct {
    dl_segment_t seg[DL_MAX_SEGMENTS];
    int64_t nseg, rows;
} dl_matrix_t;

/* One weight's adapter slots (lora_kernels.c's at, bt and segments); at == NULL: not adapted. */
typedef struct {
    const void *at, *bt;
    const int64_t *seg_ends;
    int64_t slots, rank, nseg, wdtype;
} dl_lora_t;

/* One decoder layer's weights and KV cache ([num_blocks, block_size, 2, Hkv, D]). */
typedef struct {
    const void *input_norm;
    const void *post_norm;
    const void *qkv_bias; /* NULL: none */
    void *kv_cache;
    dl_matrix_t qkv, o, gate_up, down;
    dl_lora_t lora_qkv, lora_o, lora_gate_up, lora_down;
} dl_layer_t;

/* One step: B decode rows (one token per request), their metadata and the buffers. */
typedef struct {
    int64_t B, hidden, heads, kv_heads, head_dim, inter, block_size, bt_stride;
    const int64_t *positions, *slots, *block_table, *seq_lens;
    const float *rope_table; /* float32 [P, D/2, 2] (cos, sin) */
    void *x, *residual;      /* [B, hidden] each: in and out */
    void *h, *qkv, *attn, *gate_up, *act; /* scratch */
    float eps, scale;
    int32_t dtype, has_residual, num_threads, kv_dtype; /* kv_dtype: the caches' */
    const int32_t *lora_slots; /* [B] adapter slot per row (-1: none); NULL: no adapters */
} dl_step_t;

/* out [B, N] += the adapters' share of x [B, K] through l (nothing without adapters). */
static int add_lora(const dl_lora_t *l, const dl_step_t *s, void *out, int64_t N, const void *x,
                    int64_t K) {
    if (s->lora_slots == NULL || l->at == NULL) return 0;
    return lora_add(out, N, s->dtype, x, K, s->lora_slots, s->B, l->at, l->bt, (int)l->wdtype,
                    l->slots, l->rank, K, N, l->seg_ends, l->nseg, s->num_threads);
}

/* out [B, m->rows] (row stride out_stride) = x [B, K] @ W^T, segment by segment. */
static int matmul(const dl_matrix_t *m, const dl_step_t *s, void *out, int64_t out_stride,
                  const void *x, int64_t K) {
    const size_t es = s->dtype == 0 ? 4 : 2;
    int64_t row = 0;
    for (int64_t i = 0; i < m->nseg; i++) {
        const dl_segment_t *g = m->seg + i;
        const int rc = (s->B <= g->rows_max ? quant_matmul : quant_gemm)(
            (char *)out + (size_t)row * es, out_stride, s->dtype, x, K, s->dtype, g->w,
            g->row_bytes, g->type, s->B, g->rows, K, s->num_threads);
        if (rc) return rc;
        row += g->rows;
    }
    return 0;
}

static int attention_half(const dl_layer_t *L, const dl_step_t *s, int first) {
    const int64_t B = s->B, D = s->head_dim, qkv_n = L->qkv.rows;
    const size_t es = s->dtype == 0 ? 4 : 2;
    const int dt = s->dtype, thr = s->num_threads;
    int rc;
    if (first && !s->has_residual) {
        memcpy(s->residual, s->x, (size_t)(B * s->hidden) * es);
        rc = rms_norm(s->h, s->x, s->hidden, NULL, L->input_norm, B, s->hidden, s->eps, dt, thr);
    } else {
        rc = rms_norm(s->h, s->x, s->hidden, s->residual, L->input_norm, B, s->hidden, s->eps,
                      dt, thr);
    }
    if (rc) return rc;
    rc = matmul(&L->qkv, s, s->qkv, qkv_n, s->h, s->hidden);
    if (rc) return rc;
    if (L->qkv_bias) add_bias(s->qkv, L->qkv_bias, B, qkv_n, dt);
    if ((rc = add_lora(&L->lora_qkv, s, s->qkv, qkv_n, s->h, s->hidden))) return rc;
    rope_inplace(s->qkv, qkv_n, s->positions, s->rope_table, B, s->heads + s->kv_heads, D, dt,
                 thr);
    rc = cache_write(L->kv_cache, (char *)s->qkv + (size_t)(s->heads * D) * es, qkv_n, s->slots,
                     B, 2 * s->kv_heads * D, dt, s->kv_dtype);
    if (rc) return rc;
    rc = decode_attention(s->attn, s->qkv, NULL, qkv_n, L->kv_cache, s->block_table,
                          s->bt_stride, s->seq_lens, B, s->heads, s->kv_heads, D, s->block_size,
                          s->scale, dt, s->kv_dtype, thr);
    if (rc) return rc;
    rc = matmul(&L->o, s, s->x, s->hidden, s->attn, s->heads * D);
    return rc ? rc : add_lora(&L->lora_o, s, s->x, s->hidden, s->attn, s->heads * D);
}

static int mlp_half(const dl_layer_t *L, const dl_step_t *s) {
    const int64_t B = s->B, I = s->inter;
    const int dt = s->dtype, thr = s->num_threads;
    int rc = rms_norm(s->h, s->x, s->hidden, s->residual, L->post_norm, B, s->hidden, s->eps, dt,
                      thr);
    if (rc) return rc;
    rc = matmul(&L->gate_up, s, s->gate_up, 2 * I, s->h, s->hidden);
    if (rc || (rc = add_lora(&L->lora_gate_up, s, s->gate_up, 2 * I, s->h, s->hidden))) return rc;
    silu_mul(s->act, s->gate_up, B, I, dt, thr);
    rc = matmul(&L->down, s, s->x, s->hidden, s->act, I);
    return rc ? rc : add_lora(&L->lora_down, s, s->x, s->hidden, s->act, I);
}

/* Runs layers [0, n_layers) on s; returns 0, or the first failing kernel's code. */
int decode_layers(const dl_layer_t *layers, int64_t n_layers, const dl_step_t *s) {
    for (int64_t l = 0; l < n_layers; l++) {
        int rc = attention_half(layers + l, s, l == 0);
        if (rc == 0) rc = mlp_half(layers + l, s);
        if (rc) return rc;
    }
    return 0;
}
