/*
 * Decode attention over a paged KV cache: one query token per request.
 *
 *   q      [*, H, D] rows; request r's query is row q_rows[r] (or r when q_rows is NULL), rows
 *          q_row_stride elements apart (q may be a view into the fused qkv output)
 *   cache  [num_blocks, block_size, 2, Hkv, D]; one slot (block, offset) is K then V:
 *
 *            slot s:  | K head 0 | K head 1 | .. | K head Hkv-1 | V head 0 | .. | V head Hkv-1 |
 *                       <-- D --->                                 (2 * Hkv * D elements)
 *
 *   block_table [B, bt_stride] int64, seq_lens [B] int64 (tokens of context, this one included,
 *          whose K/V must already be written)
 *   out    [B, H, D] dense
 *
 * q and out are in `dtype`, the cache in `kv_dtype` (DT_F32 / DT_BF16: a bfloat16 cache under
 * float32 activations, kv_cache_dtype="bfloat16", halves its bytes); every version reads the
 * cache's elements as float32, and takes the bfloat16 dot products from the raw q only where
 * q is bfloat16 too.
 *
 * Query head h reads KV head h / (H / Hkv). A task runs one pass over a span of a request's
 * context in order with an online softmax (as flash-decoding does; the versions are
 * attention_common.h's decode_span_*): a step of slots at a time, the scores of every head, then
 * each head's running max and sum are corrected and the slots' V rows added in. Each slot's
 * 2 * Hkv * D contiguous elements are read once per step, front to back.
 *
 * Tasks: with at least as many requests as threads, one task per request (its whole context),
 * round-robin, writing straight to out. With fewer (batch 1 on 2 threads: the long-chat case),
 * each request's context is split into `parts` spans, one task each, and the spans' normalised
 * outputs are merged by their log-sum-exp (cp_attention.c's cp_merge, the merge of context
 * parallel ranks): otherwise one thread reads the whole context while the others wait. The
 * split changes only the order of float additions. Measured (Zen 3, 2 threads, one request,
 * 9 / 3 heads of 64, float32): see SPLIT_MIN_SLOTS.
 *
 * Returns 0, or -1 when scratch cannot be allocated.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "attention_common.h"
#include "kernels_common.h"

/* Spans of fewer slots than this are not worth a task of their own: a parallel region costs
 * ~1.5 us here, a slot ~0.1 us of one thread (the default model's heads). Zen 3, 2 threads, the
 * default model's decode step (decode_layers in a loop, libraries alternating): split from 64
 * slots 1.05-1.08x at a context of 98 (it was split from 128); split from 16 slots 0.96-0.97x
 * at 20-38. */
#define SPLIT_MIN_SLOTS 32
/* A span's first slot is a multiple of this (every version's step length divides it). */
#define SPAN_ALIGN 16

/* start_request's part, then the versions' own (a step's scores, or a row and G scores). */
static int64_t scratch_floats(int64_t H, int64_t D) { return 2 * H * D + 2 * H + H * 16 + D + H; }

/* Request `qr`'s slots [s0, s1) into buf (qf, acc, m, l, left unnormalised). */
static void attend_span(float *buf, const void *qr, const void *cache, const int64_t *blocks,
                        int64_t s0, int64_t s1, int64_t H, int64_t Hkv, int64_t D,
                        int64_t block_size, float scale, int dtype, int kv_dtype) {
    float *qf = buf, *acc = qf + H * D, *m = acc + H * D, *l = m + H;
    start_request(qf, acc, m, l, qr, H, D, scale, dtype);
    /* The raw q only where it is in the cache's dtype (the AVX-512 bfloat16 dot products). */
    if (decode_span_avx512(buf, dtype == kv_dtype ? qr : NULL, cache, blocks, s0, s1, H, Hkv, D,
                           block_size, scale, kv_dtype))
        return;
    if (decode_span_avx2(buf, cache, blocks, s0, s1, H, Hkv, D, block_size, kv_dtype)) return;
    decode_span_scalar(buf, cache, blocks, s0, s1, H, Hkv, D, block_size, kv_dtype);
}

/* How many spans each request's context is split into (1: not split). */
static int64_t span_parts(const int64_t *seq_lens, int64_t B, int num_threads) {
    if (B >= num_threads) return 1;
    int64_t longest = 0;
    for (int64_t r = 0; r < B; r++) longest = seq_lens[r] > longest ? seq_lens[r] : longest;
    int64_t parts = num_threads / B;
    if (parts > longest / SPLIT_MIN_SLOTS) parts = longest / SPLIT_MIN_SLOTS;
    return parts > 1 ? parts : 1;
}

/* Span p of `parts` over a context of n slots: [*s0, *s1), empty for the parts past its end. */
static void span_of(int64_t n, int64_t p, int64_t parts, int64_t *s0, int64_t *s1) {
    const int64_t len = ((n + parts - 1) / parts + SPAN_ALIGN - 1) / SPAN_ALIGN * SPAN_ALIGN;
    *s0 = p * len < n ? p * len : n;
    *s1 = *s0 + len < n ? *s0 + len : n;
}

typedef struct { /* decode_attention's arguments */
    void *out;
    const void *q, *cache;
    const int64_t *q_rows, *block_table, *seq_lens;
    int64_t q_row_stride, bt_stride, B, H, Hkv, D, block_size;
    float scale;
    int dtype, kv_dtype, num_threads;
} decode_args;

static const void *query_of(const decode_args *a, int64_t r) {
    const size_t esize = a->dtype == DT_F32 ? 4 : 2;
    const int64_t row = a->q_rows ? a->q_rows[r] : r;
    return (const char *)a->q + (size_t)(row * a->q_row_stride) * esize;
}

/* Request r's whole context into out, with buf as its scratch. */
static void whole_request(const decode_args *a, int64_t r, float *buf) {
    const int64_t H = a->H, D = a->D;
    const size_t esize = a->dtype == DT_F32 ? 4 : 2;
    const size_t slot_bytes = 2 * a->Hkv * D * (a->kv_dtype == DT_F32 ? 4 : 2);
    const int64_t next = r + a->num_threads;
    if (next < a->B)
        decode_prefetch_start(a->cache, a->block_table + next * a->bt_stride, a->seq_lens[next],
                              a->block_size, slot_bytes);
    attend_span(buf, query_of(a, r), a->cache, a->block_table + r * a->bt_stride, 0,
                a->seq_lens[r], H, a->Hkv, D, a->block_size, a->scale, a->dtype, a->kv_dtype);
    finish_request((char *)a->out + (size_t)(r * H * D) * esize, buf + H * D,
                   buf + 2 * H * D + H, H, D, a->dtype);
}

/* One task per request. Round-robin, so a thread knows its next request and can prefetch that
 * one's first slots (the in-span prefetch only runs ahead within a span). One request (batch
 * 1 with a short context) runs without entering OpenMP: a region with a false `if` still
 * costs ~0.4 us, once a layer. */
static int whole_requests(const decode_args *a) {
    const int64_t per_thread = scratch_floats(a->H, a->D);
    /* Allocated before the parallel region: every thread must reach the `omp for`. */
    float *scratch = malloc(sizeof(float) * (size_t)(per_thread * a->num_threads));
    if (scratch == NULL) return -1;
    if (a->B == 1) {
        whole_request(a, 0, scratch);
    } else {
#pragma omp parallel for num_threads(a->num_threads) schedule(static, 1)
        for (int64_t r = 0; r < a->B; r++)
            whole_request(a, r, scratch + per_thread * omp_get_thread_num());
    }
    free(scratch);
    return 0;
}

/* `parts` tasks per request; task (p, r) leaves its span's output normalised in outs [p, r]
 * and its log-sum-exp in lses [p, r] (-inf for an empty span), then cp_merge combines them. */
static int split_requests(const decode_args *a, int64_t parts) {
    const int64_t H = a->H, D = a->D, B = a->B, N = B * H, per_task = scratch_floats(H, D);
    float *outs = malloc(sizeof(float) * (size_t)(parts * N * D + parts * N + N * D));
    float *scratch = malloc(sizeof(float) * (size_t)(per_task * parts * B));
    if (outs == NULL || scratch == NULL) {
        free(outs), free(scratch);
        return -1;
    }
    float *lses = outs + parts * N * D, *merged = lses + parts * N;
#pragma omp parallel for num_threads(a->num_threads) schedule(static, 1)
    for (int64_t task = 0; task < parts * B; task++) {
        const int64_t p = task / B, r = task % B;
        float *buf = scratch + per_task * task, *acc = buf + H * D, *m = acc + H * D, *l = m + H;
        int64_t s0, s1;
        span_of(a->seq_lens[r], p, parts, &s0, &s1);
        attend_span(buf, query_of(a, r), a->cache, a->block_table + r * a->bt_stride, s0, s1, H,
                    a->Hkv, D, a->block_size, a->scale, a->dtype, a->kv_dtype);
        for (int64_t h = 0; h < H; h++) {
            const int64_t n = p * N + r * H + h;
            lses[n] = l[h] > 0.f ? m[h] + logf(l[h]) : -INFINITY;
            for (int64_t d = 0; d < D; d++)
                outs[n * D + d] = l[h] > 0.f ? acc[h * D + d] / l[h] : 0.f;
        }
    }
    cp_merge(merged, outs, lses, parts, N, D, 1);
    store_f32(a->out, merged, N * D, a->dtype);
    free(outs), free(scratch);
    return 0;
}

int decode_attention(void *out, const void *q, const int64_t *q_rows, int64_t q_row_stride,
                     const void *cache, const int64_t *block_table, int64_t bt_stride,
                     const int64_t *seq_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                     int64_t block_size, float scale, int dtype, int kv_dtype,
                     int num_threads) {
    const decode_args a = {out,  q, cache, q_rows, block_table, seq_lens, q_row_stride,
                           bt_stride, B, H, Hkv, D, block_size, scale, dtype, kv_dtype,
                           num_threads};
    const int64_t parts = span_parts(seq_lens, B, num_threads);
    return parts > 1 ? split_requests(&a, parts) : whole_requests(&a);
}
