/*
 * What decode attention's versions share (attention_avx512.c: the AVX-512 and portable ones;
 * attention_avx2.c: the AVX2 one; decode_attention.c: the dispatch and the split of a context):
 * float32 loads and stores of either dtype, a request's scratch (start_request /
 * finish_request), where a slot lies in the paged cache, and the versions' entry points.
 * Hashed with the sources (kernel_build.py), so an edit here rebuilds the library.
 */
#ifndef SHARDSERVE_ATTENTION_COMMON_H
#define SHARDSERVE_ATTENTION_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels_common.h"

/* Load n elements of type `dtype` starting at p[0] into dst as float32. */
static inline void load_f32(float *restrict dst, const void *restrict p, int64_t n, int dtype) {
    if (dtype == DT_F32) {
        memcpy(dst, p, (size_t)n * sizeof(float));
    } else {
        const uint16_t *h = (const uint16_t *)p;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(h[i]);
    }
}

static inline void store_f32(void *restrict p, const float *restrict src, int64_t n, int dtype) {
    if (dtype == DT_F32) {
        memcpy(p, src, (size_t)n * sizeof(float));
    } else {
        uint16_t *h = (uint16_t *)p;
        for (int64_t i = 0; i < n; i++) h[i] = f32_to_bf16(src[i]);
    }
}

/* Per-request scratch of decode attention, shared by every version: the scaled float32 query
 * qf [H, D], the output accumulators acc [H, D], each head's running max m [H] and sum l [H]. */
static inline void start_request(float *qf, float *acc, float *m, float *l, const void *q,
                                 int64_t H, int64_t D, float scale, int dtype) {
    load_f32(qf, q, H * D, dtype);
    for (int64_t i = 0; i < H * D; i++) qf[i] *= scale;
    memset(acc, 0, sizeof(float) * (size_t)(H * D));
    for (int64_t h = 0; h < H; h++) {
        m[h] = -INFINITY;
        l[h] = 0.f;
    }
}

static inline void finish_request(void *out, float *acc, const float *l, int64_t H,
                                  int64_t D, int dtype) {
    for (int64_t h = 0; h < H; h++)
        for (int64_t d = 0; d < D; d++) acc[h * D + d] /= l[h];
    store_f32(out, acc, H * D, dtype);
}

/* Slot t of a request's context (blocks: its block table row) in the paged cache. */
static inline const char *slot_at(const void *cache, const int64_t *blocks, int64_t t,
                                  int64_t block_size, size_t slot_bytes) {
    return (const char *)cache
           + (size_t)(blocks[t / block_size] * block_size + t % block_size) * slot_bytes;
}

/* One request's slots [s0, s1) folded into the scratch start_request prepared (qf, acc, m, l;
 * then each version's own: the scores of a step, at most H x 16 + D + H floats), left
 * unnormalised (finish_request, or decode_attention.c's merge of spans, divides by l):
 * decode_span_avx512 (attention_avx512.c; D % 16 == 0, bfloat16 dot products from the raw q and
 * scale where the CPU has them) and decode_span_avx2 (attention_avx2.c; D % 8 == 0) return 0
 * where the build or D has no such version, 1 done; decode_span_scalar (attention_avx512.c) takes
 * any D. */
int decode_span_avx512(float *scratch, const void *q, const void *cache, const int64_t *blocks,
                       int64_t s0, int64_t s1, int64_t H, int64_t Hkv, int64_t D,
                       int64_t block_size, float scale, int dtype);
int decode_span_avx2(float *scratch, const void *cache, const int64_t *blocks, int64_t s0,
                     int64_t s1, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                     int dtype);
void decode_span_scalar(float *scratch, const void *cache, const int64_t *blocks, int64_t s0,
                        int64_t s1, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                        int dtype);
/* Ask for a request's first slots (AVX-512 builds; a no-op elsewhere). */
void decode_prefetch_start(const void *cache, const int64_t *blocks, int64_t seq_len,
                           int64_t block_size, size_t slot_bytes);

#endif
