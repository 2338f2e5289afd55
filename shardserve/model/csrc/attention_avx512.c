/*
 * Decode attention's AVX-512 version and its portable one (decode_attention.c dispatches; the
 * AVX2 version is attention_avx2.c). What they share with it is attention_common.h.
 *
 * AVX-512: a group of up to 16 slots a step (one vector of scores per head): each head's
 * scores by a transpose-and-add tree (bfloat16 dot products from the raw q where the CPU has
 * them), one online-softmax fold per group, the values added per KV head for its G query
 * heads, the next group's slots prefetched. Portable: one slot at a time.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention_common.h"
#include "kernels_common.h"

static inline float dot_f32(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Slots per online-softmax step: one AVX-512 vector of scores. */
#define GROUP 16

#if defined(__AVX512F__)
/* r[i] = sum of the 16 lanes of a[i]: a transpose-and-add tree, 45 instructions for 16 sums
 * instead of 16 separate horizontal reductions. */
ALWAYS_INLINE __m512 hsum16x16(const __m512 a[16]) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++) /* 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int j = 0; j < 4; j++) /* 128-bit lane: partial sums of a[4j .. 4j+3] */
        c[j] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* add the four 128-bit lanes of c[j] and put the result in lane j */
    const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* One head's scores over n <= 16 slots: dot(q, K_t) for t < n, 0 beyond. q is the head's
 * float32 query, already scaled; k0 is its K row in slot 0, slot_bytes apart. */
ALWAYS_INLINE __m512 head_scores_f32(const float *q, const char *k0, int64_t n, int64_t D,
                                     size_t slot_bytes, int dtype, size_t esize) {
    __m512 part[GROUP];
#pragma GCC unroll 16
    for (int t = 0; t < GROUP; t++) {
        __m512 acc = _mm512_setzero_ps();
        if (t < n) {
            const char *k = k0 + t * slot_bytes;
            for (int64_t d = 0; d < D; d += 16)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d * esize, dtype), acc);
        }
        part[t] = acc;
    }
    return hsum16x16(part);
}

#if defined(__AVX512BF16__)
/* The same for bfloat16 q and K (D % 32 == 0): exact bf16 products summed in float32. */
ALWAYS_INLINE __m512 head_scores_bf16(const uint16_t *q, const char *k0, int64_t n, int64_t D,
                                      size_t slot_bytes) {
    __m512 part[GROUP];
#pragma GCC unroll 16
    for (int t = 0; t < GROUP; t++) {
        __m512 acc = _mm512_setzero_ps();
        if (t < n) {
            const uint16_t *k = (const uint16_t *)(k0 + t * slot_bytes);
            for (int64_t d = 0; d < D; d += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d),
                                       (__m512bh)_mm512_loadu_si512(k + d));
        }
        part[t] = acc;
    }
    return hsum16x16(part);
}
#endif

/* Online softmax step for one head: fold scores s[0..n) into (max m, sum l) and rescale its
 * accumulator acc [D] to the new max; leaves p[t] = exp(s[t] - m_new) in s (0 beyond n). */
static void fold_scores(float *s, int64_t n, float *m, float *l, float *acc, int64_t D) {
    const __mmask16 valid = (__mmask16)((1u << n) - 1u);
    const __m512 sv = _mm512_loadu_ps(s);
    const float block_max = _mm512_mask_reduce_max_ps(valid, sv);
    const float new_max = block_max > *m ? block_max : *m;
    const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(new_max))));
    _mm512_storeu_ps(s, e);
    const float correction = expf(*m - new_max); /* exp(-inf) = 0 on the first group */
    *l = *l * correction + _mm512_reduce_add_ps(e);
    *m = new_max;
    if (correction != 1.f) {
        const __m512 cv = _mm512_set1_ps(correction);
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(acc + d, _mm512_mul_ps(cv, _mm512_loadu_ps(acc + d)));
    }
}

/* acc[g] += sum_{t<n} p[g][t] * V_t for the G query heads of one KV head; v0 is that head's V row
 * in slot 0. G is a constant in each instantiation, so the G accumulators of a 16-wide column
 * stay in registers for the whole group. */
ALWAYS_INLINE void kv_head_values(float *acc, const float *p, const char *v0, int64_t n,
                                  int64_t D, size_t slot_bytes, int dtype, size_t esize,
                                  const int G) {
    for (int64_t d = 0; d < D; d += 16) {
        __m512 a[G];
        for (int g = 0; g < G; g++) a[g] = _mm512_loadu_ps(acc + g * D + d);
        for (int64_t t = 0; t < n; t++) {
            const __m512 v = load16(v0 + t * slot_bytes + d * esize, dtype);
            for (int g = 0; g < G; g++)
                a[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * GROUP + t]), v, a[g]);
        }
        for (int g = 0; g < G; g++) _mm512_storeu_ps(acc + g * D + d, a[g]);
    }
}

static void group_values(float *acc, const float *p, const char *v0, int64_t n, int64_t D,
                         size_t slot_bytes, int dtype, size_t esize, int64_t G) {
    switch (G) {
#define CASE(g) case g: kv_head_values(acc, p, v0, n, D, slot_bytes, dtype, esize, g); return;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    default: /* wider groups: the heads in chunks of 8 */
        for (int64_t g0 = 0; g0 < G; g0 += 8) {
            const int64_t rest = G - g0 < 8 ? G - g0 : 8;
            group_values(acc + g0 * D, p + g0 * GROUP, v0, n, D, slot_bytes, dtype, esize, rest);
        }
    }
}

/* Slots of the group starting at `start`: up to GROUP, never across a block end. */
ALWAYS_INLINE int64_t group_len(int64_t start, int64_t seq_len, int64_t block_size) {
    const int64_t n = seq_len - start < GROUP ? seq_len - start : GROUP;
    const int64_t in_block = block_size - start % block_size;
    return n < in_block ? n : in_block;
}

/* Ask for the slots of the group starting at `start` (the next one) while this one computes:
 * blocks are scattered through the pool, so the hardware prefetcher loses the stream at every
 * block boundary, and the context of a step does not fit in the caches. Into L2 (T1): measured
 * 20% faster than into L1 here, where 192 lines of a group would evict the group in use. */
ALWAYS_INLINE void prefetch_group(const void *cache, const int64_t *blocks, int64_t start,
                                  int64_t seq_len, int64_t block_size, size_t slot_bytes) {
    if (start >= seq_len) return;
    const int64_t n = group_len(start, seq_len, block_size);
    const char *p = slot_at(cache, blocks, start, block_size, slot_bytes);
    for (size_t off = 0; off < (size_t)n * slot_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

/* Slots [s0, s1) of one request on AVX-512 (D % 16 == 0; 0 otherwise, 1 done). */
int decode_span_avx512(float *scratch, const void *q, const void *cache, const int64_t *blocks,
                       int64_t s0, int64_t s1, int64_t H, int64_t Hkv, int64_t D,
                       int64_t block_size, float scale, int dtype) {
    if (D % 16) return 0;
    (void)q, (void)scale; /* the bfloat16 dot products' (the float32 scores use qf) */
    const int64_t G = H / Hkv;
    const size_t esize = dtype == DT_F32 ? 4 : 2, slot_bytes = 2 * Hkv * D * esize;
    float *qf = scratch, *acc = qf + H * D, *m = acc + H * D, *l = m + H, *s = l + H;
#if defined(__AVX512BF16__)
    const int use_dp = dtype == DT_BF16 && D % 32 == 0 && q != NULL; /* q: bfloat16 too */
#endif
    int64_t cnt;
    for (int64_t start = s0; start < s1; start += cnt) {
        cnt = group_len(start, s1, block_size);
        const char *slot0 = slot_at(cache, blocks, start, block_size, slot_bytes);
        prefetch_group(cache, blocks, start + cnt, s1, block_size, slot_bytes);
        for (int64_t h = 0; h < H; h++) {
            const char *k0 = slot0 + (size_t)((h / G) * D) * esize;
            __m512 sv;
#if defined(__AVX512BF16__)
            if (use_dp)
                sv = _mm512_mul_ps(_mm512_set1_ps(scale),
                                   head_scores_bf16((const uint16_t *)q + h * D, k0, cnt, D,
                                                    slot_bytes));
            else
#endif
                sv = head_scores_f32(qf + h * D, k0, cnt, D, slot_bytes, dtype, esize);
            _mm512_storeu_ps(s + h * GROUP, sv);
            fold_scores(s + h * GROUP, cnt, m + h, l + h, acc + h * D, D);
        }
        for (int64_t kvh = 0; kvh < Hkv; kvh++)
            group_values(acc + kvh * G * D, s + kvh * G * GROUP,
                         slot0 + (size_t)((Hkv + kvh) * D) * esize, cnt, D, slot_bytes, dtype,
                         esize, G);
    }
    return 1;
}

void decode_prefetch_start(const void *cache, const int64_t *blocks, int64_t seq_len,
                           int64_t block_size, size_t slot_bytes) {
    prefetch_group(cache, blocks, 0, seq_len, block_size, slot_bytes);
}
#else
int decode_span_avx512(float *scratch, const void *q, const void *cache, const int64_t *blocks,
                       int64_t s0, int64_t s1, int64_t H, int64_t Hkv, int64_t D,
                       int64_t block_size, float scale, int dtype) {
    (void)scratch, (void)q, (void)cache, (void)blocks, (void)s0, (void)s1, (void)H, (void)Hkv;
    (void)D, (void)block_size, (void)scale, (void)dtype;
    return 0;
}

void decode_prefetch_start(const void *cache, const int64_t *blocks, int64_t seq_len,
                           int64_t block_size, size_t slot_bytes) {
    (void)cache, (void)blocks, (void)seq_len, (void)block_size, (void)slot_bytes;
}
#endif

/* Portable version: any D, any CPU; one slot at a time, rescaling the running sums per slot. */
void decode_span_scalar(float *scratch, const void *cache, const int64_t *blocks, int64_t s0,
                        int64_t s1, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                        int dtype) {
    const int64_t G = H / Hkv;
    const size_t esize = dtype == DT_F32 ? 4 : 2, slot_bytes = 2 * Hkv * D * esize;
    float *qf = scratch, *acc = qf + H * D, *m = acc + H * D, *l = m + H, *row = l + H;
    float *score = row + D;
    for (int64_t t = s0; t < s1; t++) {
        const char *slot = slot_at(cache, blocks, t, block_size, slot_bytes);
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            load_f32(row, slot + (size_t)(kvh * D) * esize, D, dtype);
            for (int64_t g = 0; g < G; g++) score[g] = dot_f32(qf + (kvh * G + g) * D, row, D);
            load_f32(row, slot + (size_t)((Hkv + kvh) * D) * esize, D, dtype);
            for (int64_t g = 0; g < G; g++) {
                const int64_t h = kvh * G + g;
                const float new_max = score[g] > m[h] ? score[g] : m[h];
                const float correction = expf(m[h] - new_max), w = expf(score[g] - new_max);
                l[h] = l[h] * correction + w;
                m[h] = new_max;
                for (int64_t d = 0; d < D; d++) acc[h * D + d] = acc[h * D + d] * correction
                                                                 + w * row[d];
            }
        }
    }
}
