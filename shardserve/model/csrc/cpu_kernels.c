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
 * slots[t]. Small (one slot per token), so one thread and plain copies. src is in `dtype`, the
 * cache in `cache_dtype`: the same, or float32 rows into a bfloat16 cache (kv_cache_dtype
 * "bfloat16"); -2 for any other pair.
 */
int cache_write(void *cache, const void *src, int64_t src_row_stride, const int64_t *slots,
                int64_t T, int64_t slot_elems, int dtype, int cache_dtype) {
    const size_t esize = dtype == DT_F32 ? 4 : 2, cesize = cache_dtype == DT_F32 ? 4 : 2;
    if (cache_dtype != dtype && !(dtype == DT_F32 && cache_dtype == DT_BF16)) return -2;
    for (int64_t t = 0; t < T; t++) {
        char *dst = (char *)cache + (size_t)slots[t] * slot_elems * cesize;
        const char *row = (const char *)src + (size_t)(t * src_row_stride) * esize;
        if (cache_dtype == dtype) memcpy(dst, row, (size_t)slot_elems * esize);
        else store_f32(dst, (const float *)row, slot_elems, DT_BF16); /* nearest even */
    }
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
