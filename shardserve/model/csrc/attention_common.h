/*
 * What decode attention's versions share (cpu_kernels.c: the portable and AVX-512 ones and the
 * dispatch; attention_avx2.c: the AVX2 one): float32 loads and stores of either dtype, a
 * request's scratch (start_request / finish_request) and where a slot lies in the paged cache.
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

/* attention_avx2.c: one request's decode attention (as decode_request_avx512 in cpu_kernels.c,
 * 8 slots a step); 0 where this build or D (not a multiple of 8) has no AVX2 version, 1 done. */
int decode_request_avx2(void *out, const void *q, const void *cache, const int64_t *blocks,
                        int64_t seq_len, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                        float scale, int dtype, float *scratch);

#endif
