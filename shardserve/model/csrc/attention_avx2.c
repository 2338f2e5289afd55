/*
 * Decode attention on AVX2 (builds without AVX-512, or a head size that is a multiple of 8 but
 * not of 16): one request's query against a span of its paged context, as decode_span_avx512 in
 * attention_avx512.c computes it, 8 slots a step instead of 16. Before it these builds ran the
 * portable loop: one slot at a time, two scalar expf per slot and head. Measured (Zen 3, one
 * request, 9 / 3 heads of 64, float32, a context of 2000 tokens): 567 -> 292 us a layer, 1.92x.
 *
 * Per step of up to 8 slots (never across a block end): each head's 8 scores (dot products
 * over D, 8 lanes, one transpose-and-add tree), the online softmax's fold (the group's max, a
 * vector exp, the running sum and the accumulator rescaled when the max moved), then per KV
 * head the slots' V rows added into its G query heads' accumulators, kept in registers per
 * 8-wide column. The next group's slots are prefetched into L2 meanwhile (blocks are scattered
 * through the pool: the hardware prefetcher loses the stream at every block boundary).
 */
#include "attention_common.h"
#include "kernels_common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define STEP 8

/* [sum v[0], ..., sum v[7]]. */
ALWAYS_INLINE __m256 hsum8x8_ps(const __m256 *v) {
    const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x21), _mm256_blend_ps(q0, q1, 0xF0));
}

static inline float hsum8_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8_ps(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* One head's scores over n <= 8 slots: dot(q, K_t) for t < n, 0 beyond (q already scaled).
 * A full step (n = 8: every step but a context's last) takes a path without the per-slot
 * checks, q's D / 8 vectors held while each K row is read once: with the checks inside the
 * unrolled loops the compiler kept the slots' addresses on the stack, a reload per FMA. */
ALWAYS_INLINE __m256 head_scores(const float *q, const char *k0, int64_t n, int64_t D,
                                 size_t slot_bytes, int dtype, size_t esize) {
    __m256 part[STEP];
    if (n == STEP) {
#pragma GCC unroll 8
        for (int t = 0; t < STEP; t++) part[t] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 qd = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
            for (int t = 0; t < STEP; t++)
                part[t] = _mm256_fmadd_ps(qd, load8_act(k0 + t * slot_bytes + d * esize, dtype),
                                          part[t]);
        }
        return hsum8x8_ps(part);
    }
#pragma GCC unroll 8
    for (int t = 0; t < STEP; t++) {
        __m256 acc = _mm256_setzero_ps();
        if (t < n) {
            const char *k = k0 + t * slot_bytes;
            for (int64_t d = 0; d < D; d += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8_act(k + d * esize, dtype), acc);
        }
        part[t] = acc;
    }
    return hsum8x8_ps(part);
}

/* The online softmax's step for one head: scores sv of n slots into (max m, sum l), acc [D]
 * rescaled to the new max; p (8 floats) gets exp(s - m_new), 0 beyond n. */
ALWAYS_INLINE void fold(__m256 sv, int64_t n, float *p, float *m, float *l, float *acc, int64_t D) {
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
        _mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    const float group_max = hmax8_ps(_mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sv, valid));
    const float new_max = group_max > *m ? group_max : *m;
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(sv, _mm256_set1_ps(new_max))), valid);
    _mm256_storeu_ps(p, e);
    /* exp(-inf) = 0 on the first step; no call while the max stands (most steps). */
    const float correction = new_max > *m ? expf(*m - new_max) : 1.f;
    *l = *l * correction + hsum8_ps(e);
    *m = new_max;
    if (correction != 1.f) {
        const __m256 cv = _mm256_set1_ps(correction);
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(acc + d, _mm256_mul_ps(cv, _mm256_loadu_ps(acc + d)));
    }
}

/* acc[g] += sum_{t<n} p[g][t] * V_t for the G (a constant per instance) query heads of one KV
 * head; v0: its V row in the step's first slot. */
ALWAYS_INLINE void kv_values(float *acc, const float *p, const char *v0, int64_t n, int64_t D,
                             size_t slot_bytes, int dtype, size_t esize, const int G) {
    for (int64_t d = 0; d < D; d += 8) {
        __m256 a[G];
        for (int g = 0; g < G; g++) a[g] = _mm256_loadu_ps(acc + g * D + d);
        for (int64_t t = 0; t < n; t++) {
            const __m256 v = load8_act(v0 + t * slot_bytes + d * esize, dtype);
            for (int g = 0; g < G; g++)
                a[g] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * STEP + t]), v, a[g]);
        }
        for (int g = 0; g < G; g++) _mm256_storeu_ps(acc + g * D + d, a[g]);
    }
}

/* kv_values for 1 <= G <= 8 heads (a constant in each case). */
ALWAYS_INLINE void values_upto8(float *acc, const float *p, const char *v0, int64_t n, int64_t D,
                                size_t slot_bytes, int dtype, size_t esize, int64_t G) {
    switch (G) {
#define CASE(g) case g: kv_values(acc, p, v0, n, D, slot_bytes, dtype, esize, g); return;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    default: return;
    }
}

ALWAYS_INLINE void values(float *acc, const float *p, const char *v0, int64_t n, int64_t D,
                          size_t slot_bytes, int dtype, size_t esize, int64_t G) {
    /* wider groups: the heads in chunks of 8 */
    for (int64_t g0 = 0; g0 < G; g0 += 8)
        values_upto8(acc + g0 * D, p + g0 * STEP, v0, n, D, slot_bytes, dtype, esize,
                     G - g0 < 8 ? G - g0 : 8);
}

/* Slots of the step starting at `start`: up to 8, never across a block end. */
static inline int64_t step_len(int64_t start, int64_t seq_len, int64_t block_size) {
    const int64_t n = seq_len - start < STEP ? seq_len - start : STEP;
    const int64_t in_block = block_size - start % block_size;
    return n < in_block ? n : in_block;
}

/* The span's steps; inlined per head size below, so that with D a constant (64, 128: the Llama
 * heads) every loop over D unrolls (a run-time D left a compare and branch per 8 elements of
 * every dot product: 1.3-1.5x slower). */
ALWAYS_INLINE void span_steps(float *scratch, const void *cache, const int64_t *blocks,
                              int64_t s0, int64_t s1, int64_t H, int64_t Hkv, const int64_t D,
                              int64_t block_size, int dtype) {
    const int64_t G = H / Hkv;
    const size_t esize = dtype == DT_F32 ? 4 : 2, slot_bytes = 2 * Hkv * D * esize;
    /* the caller's scratch: qf, acc [H, D], m, l [H], then p [H, 8] (it holds H x 16) */
    float *qf = scratch, *acc = qf + H * D, *m = acc + H * D, *l = m + H, *p = l + H;
    int64_t cnt;
    for (int64_t start = s0; start < s1; start += cnt) {
        cnt = step_len(start, s1, block_size);
        const char *slot0 = slot_at(cache, blocks, start, block_size, slot_bytes);
        if (start + cnt < s1) {
            const int64_t next = step_len(start + cnt, s1, block_size);
            const char *n1 = slot_at(cache, blocks, start + cnt, block_size, slot_bytes);
            for (size_t off = 0; off < (size_t)next * slot_bytes; off += 64)
                _mm_prefetch(n1 + off, _MM_HINT_T1);
        }
        /* Every head's scores first, then the folds: each fold is a chain of dependent steps
         * (max, exp, sum), and folds of different heads in a row overlap out of order. Zen 3,
         * 2 threads, libraries alternating, bit-identical: caches in L3 1.06-1.2x; caches past
         * it (400 MB cycled) float32 1.00-1.05x, bfloat16 1.10-1.18x (B=8 x 1,500 slots of
         * 32 / 8 heads, B=64 x 192 and B=1 x 3,000 of 9 / 3). Not kept: the G heads of a KV
         * head scored together, each K row loaded once for them (0.84-1.0x); steps of 16
         * slots, one fold per 16 (0.90-1.02x). */
        for (int64_t h = 0; h < H; h++)
            _mm256_storeu_ps(p + h * STEP, head_scores(qf + h * D,
                                                       slot0 + (size_t)((h / G) * D) * esize,
                                                       cnt, D, slot_bytes, dtype, esize));
        for (int64_t h = 0; h < H; h++)
            fold(_mm256_loadu_ps(p + h * STEP), cnt, p + h * STEP, m + h, l + h, acc + h * D, D);
        for (int64_t kvh = 0; kvh < Hkv; kvh++)
            values(acc + kvh * G * D, p + kvh * G * STEP, slot0 + (size_t)((Hkv + kvh) * D) * esize,
                   cnt, D, slot_bytes, dtype, esize, G);
    }
}

int decode_span_avx2(float *scratch, const void *cache, const int64_t *blocks, int64_t s0,
                     int64_t s1, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                     int dtype) {
    if (D % 8) return 0;
    if (D == 64)
        span_steps(scratch, cache, blocks, s0, s1, H, Hkv, 64, block_size, dtype);
    else if (D == 128)
        span_steps(scratch, cache, blocks, s0, s1, H, Hkv, 128, block_size, dtype);
    else
        span_steps(scratch, cache, blocks, s0, s1, H, Hkv, D, block_size, dtype);
    return 1;
}
#else
int decode_span_avx2(float *scratch, const void *cache, const int64_t *blocks, int64_t s0,
                     int64_t s1, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                     int dtype) {
    (void)scratch, (void)cache, (void)blocks, (void)s0, (void)s1, (void)H, (void)Hkv, (void)D;
    (void)block_size, (void)dtype;
    return 0;
}
#endif
