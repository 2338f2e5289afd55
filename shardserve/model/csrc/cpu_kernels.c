/*
 * CPU kernels for the decode hot path, built on first use by shardserve/model/native_kernels.py
 * (gcc -O3 -fopenmp and the ISA level's -march: native, x86-64-v3 or x86-64-v2; SHARDSERVE_ISA)
 * and called through ctypes with raw tensor pointers.
 *
 * Threads: OpenMP. torch ships its own libgomp with the same soname (libgomp.so.1) and has loaded
 * it before this library is opened, so these parallel regions run on torch's thread pool: no
 * second pool competes with torch's (spinning) threads.
 *
 * Element types (the `dtype` argument): 0 = float32, 1 = bfloat16. Everything accumulates in
 * float32; bfloat16 results are rounded to nearest even, as torch rounds.
 *
 * All tensors are dense row-major unless a stride argument says otherwise; strides are in
 * elements, not bytes.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_common.h"
#include "kernels_common.h"

/* Elementwise kernels use threads only from this many elements on: below it one thread takes
 * ~10-20 us, and a parallel region costs more than it saves when a thread sleeps or is
 * preempted (an mp worker shares the cores with the engine process). */
#define PARALLEL_MIN (64 * 1024)

static inline float dot_f32(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}


static inline void axpy_f32(float *restrict y, float w, const float *restrict x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += w * x[i];
}

/* Slots per online-softmax step: one AVX-512 vector of scores. */
#define GROUP 16

#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX512 1

/* 16 elements at p (float32 or bfloat16) as float32. */
ALWAYS_INLINE __m512 load16(const void *p, int dtype) {
    if (dtype == DT_F32) return _mm512_loadu_ps(p);
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* Store 16 float32 values at p as float32 or bfloat16 (rounded to nearest even). */
ALWAYS_INLINE void store16(void *p, __m512 x, int dtype) {
    if (dtype == DT_F32) {
        _mm512_storeu_ps(p, x);
        return;
    }
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(x));
#else
    float tmp[16];
    _mm512_storeu_ps(tmp, x);
    store_f32(p, tmp, 16, dtype);
#endif
}

/* x rounded to dtype (identity for float32), back in float32. */
ALWAYS_INLINE __m512 round16(__m512 x, int dtype) {
    if (dtype == DT_F32) return x;
    uint16_t tmp[16];
    store16(tmp, x, dtype);
    return load16(tmp, dtype);
}

/* e^x as 2^n * 2^f with |f| <= 1/2: 2^f by a degree-6 Taylor polynomial (relative error ~1e-7),
 * 2^n applied exactly by scalef. x is clamped to [-87, 88], so results stay finite and normal. */
ALWAYS_INLINE __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

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
    const int use_dp = dtype == DT_BF16 && D % 32 == 0;
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
#define HAVE_AVX512 0
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

/*
 * RMSNorm of T rows of N elements, with an optional residual add first (HF Llama semantics):
 *
 *   residual != NULL:  residual <- x + residual (rounded to dtype, written back in place)
 *                      out <- norm(residual)
 *   residual == NULL:  out <- norm(x)
 *   norm(v) = weight * dtype(v * rsqrt(mean(v^2) + eps)), in float32, rounded as HF rounds
 *
 * Rows are row_stride elements apart in x and out (dense rows in residual).
 */
static void rms_norm_row(void *out, const void *x, void *residual, const void *weight, int64_t N,
                         float eps, int dtype, float *buf) {
    load_f32(buf, x, N, dtype);
    if (residual != NULL) {
        if (dtype == DT_F32) {
            float *r = residual;
            for (int64_t i = 0; i < N; i++) buf[i] = r[i] = buf[i] + r[i];
        } else {
            uint16_t *r = residual;
            for (int64_t i = 0; i < N; i++) {
                r[i] = f32_to_bf16(buf[i] + bf16_to_f32(r[i]));
                buf[i] = bf16_to_f32(r[i]);
            }
        }
    }
    float ss = 0.f;
    for (int64_t i = 0; i < N; i++) ss += buf[i] * buf[i];
    const float inv = 1.f / sqrtf(ss / (float)N + eps);
    if (dtype == DT_F32) {
        const float *w = weight;
        float *o = out;
        for (int64_t i = 0; i < N; i++) o[i] = w[i] * (buf[i] * inv);
    } else {
        const uint16_t *w = weight;
        uint16_t *o = out;
        for (int64_t i = 0; i < N; i++)
            o[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(buf[i] * inv)));
    }
}

#if HAVE_AVX512
/* rms_norm_row for N % 16 == 0, same roundings, 16 lanes at a time. */
static void rms_norm_row_avx512(void *out, const void *x, void *residual, const void *weight,
                                int64_t N, float eps, int dtype, float *buf) {
    const size_t esize = dtype == DT_F32 ? 4 : 2;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < N; i += 16) {
        __m512 v = load16((const char *)x + i * esize, dtype);
        if (residual != NULL) {
            char *r = (char *)residual + i * esize;
            v = round16(_mm512_add_ps(v, load16(r, dtype)), dtype);
            store16(r, v, dtype);
        }
        _mm512_storeu_ps(buf + i, v);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)N + eps));
    for (int64_t i = 0; i < N; i += 16) {
        const __m512 normed = round16(_mm512_mul_ps(_mm512_loadu_ps(buf + i), inv), dtype);
        const __m512 w = load16((const char *)weight + i * esize, dtype);
        store16((char *)out + i * esize, _mm512_mul_ps(w, normed), dtype);
    }
}
#endif

#if !HAVE_AVX512 && defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2_NORM 1
/* 8 float32 as bfloat16 bits in 32-bit lanes, as f32_to_bf16 rounds them (NaN stays quiet). */
ALWAYS_INLINE __m256i bf16_bits8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(rounded, quiet, nan);
}

ALWAYS_INLINE void store8_act(void *p, __m256 x, int dtype) {
    if (dtype == DT_F32) {
        _mm256_storeu_ps(p, x);
        return;
    }
    const __m256i b = bf16_bits8(x);
    _mm_storeu_si128((__m128i *)p,
                     _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

/* x rounded to dtype (identity for float32), back in float32. */
ALWAYS_INLINE __m256 round8_act(__m256 x, int dtype) {
    if (dtype == DT_F32) return x;
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(x), 16));
}

/* rms_norm_row for N % 8 == 0, same roundings, 8 lanes at a time (the scalar row's sum of
 * squares is one chain of dependent adds). Zen 3, 576 elements, through ctypes: 3.29 -> 3.21
 * us a call in float32, 3.72 -> 3.55 in bfloat16 (most of a call is the call). */
static void rms_norm_row_avx2(void *out, const void *x, void *residual, const void *weight,
                              int64_t N, float eps, int dtype, float *buf) {
    const size_t esize = dtype == DT_F32 ? 4 : 2;
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < N; i += 8) {
        __m256 v = load8_act((const char *)x + i * esize, dtype);
        if (residual != NULL) {
            char *r = (char *)residual + i * esize;
            v = round8_act(_mm256_add_ps(v, load8_act(r, dtype)), dtype);
            store8_act(r, v, dtype);
        }
        _mm256_storeu_ps(buf + i, v);
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(ss), _mm256_extractf128_ps(ss, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    const float sum = _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
    const __m256 inv = _mm256_set1_ps(1.f / sqrtf(sum / (float)N + eps));
    for (int64_t i = 0; i < N; i += 8) {
        const __m256 normed = round8_act(_mm256_mul_ps(_mm256_loadu_ps(buf + i), inv), dtype);
        const __m256 w = load8_act((const char *)weight + i * esize, dtype);
        store8_act((char *)out + i * esize, _mm256_mul_ps(w, normed), dtype);
    }
}
#endif

/* Row t of rms_norm on this build's widest lanes. */
static void rms_norm_at(void *out, const void *x, int64_t x_stride, void *residual,
                        const void *weight, int64_t t, int64_t N, float eps, int dtype,
                        float *buf) {
    const size_t esize = dtype == DT_F32 ? 4 : 2;
    void *o = (char *)out + (size_t)(t * N) * esize;
    const void *xr = (const char *)x + (size_t)(t * x_stride) * esize;
    void *res = residual ? (char *)residual + (size_t)(t * N) * esize : NULL;
#if HAVE_AVX512
    if (N % 16 == 0) {
        rms_norm_row_avx512(o, xr, res, weight, N, eps, dtype, buf);
        return;
    }
#elif HAVE_AVX2_NORM
    if (N % 8 == 0) {
        rms_norm_row_avx2(o, xr, res, weight, N, eps, dtype, buf);
        return;
    }
#endif
    rms_norm_row(o, xr, res, weight, N, eps, dtype, buf);
}

/* Below PARALLEL_MIN this and the kernels below run their rows without entering OpenMP at
 * all: a parallel region with a false `if` still costs ~0.4 us (Zen 3), and a batch-1 decode
 * step makes five such calls a layer. */
int rms_norm(void *out, const void *x, int64_t x_stride, void *residual, const void *weight,
             int64_t T, int64_t N, float eps, int dtype, int num_threads) {
    const int parallel = T * N >= PARALLEL_MIN && num_threads > 1;
    float *scratch = malloc(sizeof(float) * (size_t)(N * (parallel ? num_threads : 1)));
    if (scratch == NULL) return -1;
    if (!parallel) {
        for (int64_t t = 0; t < T; t++)
            rms_norm_at(out, x, x_stride, residual, weight, t, N, eps, dtype, scratch);
    } else {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t t = 0; t < T; t++)
            rms_norm_at(out, x, x_stride, residual, weight, t, N, eps, dtype,
                        scratch + N * omp_get_thread_num());
    }
    free(scratch);
    return 0;
}

/*
 * Rotary embedding in place on interleaved pairs: for T rows of `heads` heads of D elements
 * (rows row_stride elements apart, heads D apart), pair i of a head at position p becomes
 *   (x0 * c - x1 * s, x0 * s + x1 * c),  (c, s) = table[p][i]  (float32 [P, D/2, 2], cos/sin)
 * computed in float32 and rounded once.
 */
static void rope_row(char *row, const float *cs, int64_t heads, int64_t D, int dtype) {
    const size_t esize = dtype == DT_F32 ? 4 : 2;
    for (int64_t h = 0; h < heads; h++) {
        char *head = row + (size_t)(h * D) * esize;
        if (dtype == DT_F32) {
            float *v = (float *)head;
            for (int64_t i = 0; i < D; i += 2) {
                const float x0 = v[i], x1 = v[i + 1], c = cs[i], s = cs[i + 1];
                v[i] = x0 * c - x1 * s;
                v[i + 1] = x0 * s + x1 * c;
            }
        } else {
            uint16_t *v = (uint16_t *)head;
            for (int64_t i = 0; i < D; i += 2) {
                const float x0 = bf16_to_f32(v[i]), x1 = bf16_to_f32(v[i + 1]);
                const float c = cs[i], s = cs[i + 1];
                v[i] = f32_to_bf16(x0 * c - x1 * s);
                v[i + 1] = f32_to_bf16(x0 * s + x1 * c);
            }
        }
    }
}

int rope_inplace(void *x, int64_t row_stride, const int64_t *positions, const float *table,
                 int64_t T, int64_t heads, int64_t D, int dtype, int num_threads) {
    const size_t esize = dtype == DT_F32 ? 4 : 2;
    if (T * heads * D < PARALLEL_MIN || num_threads < 2) {
        for (int64_t t = 0; t < T; t++)
            rope_row((char *)x + (size_t)(t * row_stride) * esize, table + positions[t] * D,
                     heads, D, dtype);
        return 0;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < T; t++)
        rope_row((char *)x + (size_t)(t * row_stride) * esize, table + positions[t] * D, heads,
                 D, dtype);
    return 0;
}


/*
 * SwiGLU activation: out[t, i] = silu(gate[t, i]) * up[t, i] for the fused [T, 2 * I] gate_up
 * rows (gate first). bfloat16 rounds silu's result before the product, as HF's bf16 ops do.
 */
static void silu_row(char *o, const char *g, const char *u, int64_t I, int dtype) {
    const size_t esize = dtype == DT_F32 ? 4 : 2;
    int64_t i = 0;
#if HAVE_AVX512
    for (; i + 16 <= I; i += 16) {
        const __m512 gv = load16(g + i * esize, dtype);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 act = round16(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                   dtype);
        store16(o + i * esize, _mm512_mul_ps(act, load16(u + i * esize, dtype)), dtype);
    }
#elif HAVE_AVX2_NORM
    /* The scalar steps below 8 lanes at a time, exp8 for expf (float32, what AVX2 CPUs run,
     * and bfloat16, rounded as below). At batch 1 the default model's 30 calls a step took
     * 0.3 ms with expf, 5% of the step; 1536 elements 9.0 -> 2.2 us a call, 8192 43.8 ->
     * 5.2 us (Zen 3, float32). */
    for (; i + 8 <= I; i += 8) {
        const __m256 gx = load8_act(g + i * esize, dtype);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gx));
        const __m256 act = round8_act(
            _mm256_div_ps(gx, _mm256_add_ps(_mm256_set1_ps(1.f), e)), dtype);
        store8_act(o + i * esize, _mm256_mul_ps(act, load8_act(u + i * esize, dtype)), dtype);
    }
#endif
    for (; i < I; i++) {
        float gv, uv;
        load_f32(&gv, g + i * esize, 1, dtype);
        load_f32(&uv, u + i * esize, 1, dtype);
        float act = gv / (1.f + expf(-gv));
        store_f32(o + i * esize, &act, 1, dtype);
        load_f32(&act, o + i * esize, 1, dtype);
        act *= uv;
        store_f32(o + i * esize, &act, 1, dtype);
    }
}

/* Row t of silu_mul. */
static void silu_at(void *out, const void *gate_up, int64_t t, int64_t I, int dtype) {
    const size_t esize = dtype == DT_F32 ? 4 : 2;
    const char *g = (const char *)gate_up + (size_t)(t * 2 * I) * esize;
    silu_row((char *)out + (size_t)(t * I) * esize, g, g + (size_t)I * esize, I, dtype);
}

int silu_mul(void *out, const void *gate_up, int64_t T, int64_t I, int dtype, int num_threads) {
    if (T * I < PARALLEL_MIN || num_threads < 2) {
        for (int64_t t = 0; t < T; t++) silu_at(out, gate_up, t, I, dtype);
        return 0;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < T; t++) silu_at(out, gate_up, t, I, dtype);
    return 0;
}

/*
 * out[t, n] += bias[n] for T dense rows of N, rounded once to dtype (as torch's add_ rounds).
 */
int add_bias(void *out, const void *bias, int64_t T, int64_t N, int dtype) {
    const size_t esize = dtype == DT_F32 ? 4 : 2;
    for (int64_t t = 0; t < T; t++) {
        char *row = (char *)out + (size_t)(t * N) * esize;
        for (int64_t n = 0; n < N; n++) {
            float a, b;
            load_f32(&a, row + n * esize, 1, dtype);
            load_f32(&b, (const char *)bias + n * esize, 1, dtype);
            a += b;
            store_f32(row + n * esize, &a, 1, dtype);
        }
    }
    return 0;
}

/*
 * Write this step's K/V into the paged cache: row t of src (src_row_stride elements apart;
 * slot_elems = 2 * Hkv * D elements, K then V, the cache's own slot layout) goes to slot
 * slots[t]. Small (one slot per token), so one thread and plain copies.
 */
int cache_write(void *cache, const void *src, int64_t src_row_stride, const int64_t *slots,
                int64_t T, int64_t slot_elems, int dtype) {
    const size_t esize = dtype == DT_F32 ? 4 : 2, bytes = (size_t)slot_elems * esize;
    for (int64_t t = 0; t < T; t++)
        memcpy((char *)cache + (size_t)slots[t] * bytes,
               (const char *)src + (size_t)(t * src_row_stride) * esize, bytes);
    return 0;
}

/*
 * Structured outputs, in place: logits[rows[r], t] = -inf for every token t < V whose bit is
 * clear in bitmask row r (int32 words; token t is bit t % 32 of word t / 32, xgrammar's layout).
 * A word with every bit set (all 32 tokens allowed, as inside free text) is skipped. torch's
 * masked_fill takes ~3 ms for 32 rows of a 49,152-token vocabulary; this, a fraction of that.
 */
int apply_token_bitmask(float *logits, int64_t row_stride, const int64_t *rows,
                        const int32_t *bitmask, int64_t R, int64_t words, int64_t V,
                        int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (R * V >= PARALLEL_MIN)
    for (int64_t r = 0; r < R; r++) {
        float *row = logits + rows[r] * row_stride;
        const int32_t *bits = bitmask + r * words;
        for (int64_t w = 0; w < words; w++) {
            const uint32_t b = (uint32_t)bits[w];
            if (b == 0xFFFFFFFFu)
                continue;
            const int64_t base = w * 32, n = V - base < 32 ? V - base : 32;
            for (int64_t j = 0; j < n; j++)
                if (!((b >> j) & 1u))
                    row[base + j] = -INFINITY;
        }
    }
    return 0;
}

/*
 * The instruction sets this library was compiled for, one bit each (native_kernels.isa_report
 * names them; kernel_levels.py's ISA_BITS holds the same order): what the build really runs,
 * whatever -march said.
 */
int kernel_isa(void) {
    int bits = 0;
#if defined(__AVX2__)
    bits |= 1 << 0;
#endif
#if defined(__FMA__)
    bits |= 1 << 1;
#endif
#if defined(__F16C__)
    bits |= 1 << 2;
#endif
#if defined(__AVX512F__)
    bits |= 1 << 3;
#endif
#if defined(__AVX512BW__)
    bits |= 1 << 4;
#endif
#if defined(__AVX512VL__)
    bits |= 1 << 5;
#endif
#if defined(__AVX512VNNI__)
    bits |= 1 << 6;
#endif
#if defined(__AVX512BF16__)
    bits |= 1 << 7;
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    bits |= 1 << 8;
#endif
    return bits;
}
