/*
 * x's quantization per 32 values for the integer products (quant_kernels.c step 1): int16 (xd =
 * max|x| / 32767) or, with the opt-in int8 activations (quant_rows_int8.c), int8 (max|x| / 127);
 * the int16 GEMM's (quant_gemm_i16.c) at most 16383 per 32, or 8191 per run of 32s for the
 * K-quants, so that a run's products fit an int32;
 * the SIMD path computes what the portable loop does, bit for bit.
 */
#include <math.h>

#include "quant_blocks.h"

#if QK_SIMD
/* x's elements [i, i + 8) as float32. */
static inline __m256 load8_x(const void *x, int64_t i, int dtype) {
    return load8_act((const char *)x + i * (dtype == DT_F32 ? 4 : 2), dtype);
}

static inline int hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* The largest |x| of sub-block `sub`. */
static float amax_sub(const void *x, int64_t sub, int dtype) {
    __m256 amax8 = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int l = 0; l < 4; l++)
        amax8 = _mm256_max_ps(amax8, _mm256_and_ps(load8_x(x, 32 * sub + 8 * l, dtype), abs_mask));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* The 32 values of sub-block `sub` as the portable loop below computes them (the same product
 * rounded to nearest even): it ran once per product, serially, ~4 ns a value. Into q (int16)
 * or, where q8 is given, q8 (int8), each value times inv; sum: each half's sum. */
static void quantize_sub(const void *x, int64_t sub, int dtype, int16_t *q, int8_t *q8,
                         float inv_f, int *sum) {
    const __m256 inv = _mm256_set1_ps(inv_f);
    __m256i qi[4], packed[2];
    for (int l = 0; l < 4; l++)
        qi[l] = _mm256_cvtps_epi32(_mm256_mul_ps(load8_x(x, 32 * sub + 8 * l, dtype), inv));
    for (int h = 0; h < 2; h++) {
        packed[h] = _mm256_packs_epi32(qi[2 * h], qi[2 * h + 1]); /* 8-value lanes 0 2 1 3 */
        if (!q8)
            _mm256_storeu_si256((__m256i *)(q + 32 * sub + 16 * h),
                                _mm256_permute4x64_epi64(packed[h], 0xD8));
        sum[h] = hsum8_epi32(_mm256_add_epi32(qi[2 * h], qi[2 * h + 1]));
    }
    if (q8) { /* 4-value groups 0 2 4 6 1 3 5 7 after the two packs */
        const __m256i bytes = _mm256_packs_epi16(packed[0], packed[1]);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        _mm256_storeu_si256((__m256i *)(q8 + 32 * sub), _mm256_permutevar8x32_epi32(bytes, order));
    }
}
#else
static float amax_sub(const void *x, int64_t sub, int dtype) {
    float amax = 0.f;
    for (int64_t i = 32 * sub; i < 32 * sub + 32; i++)
        amax = fmaxf(amax, fabsf(dtype == DT_F32 ? ((const float *)x)[i]
                                                 : bf16_to_f32(((const uint16_t *)x)[i])));
    return amax;
}

static void quantize_sub(const void *x, int64_t sub, int dtype, int16_t *q, int8_t *q8,
                         float inv, int *sum) {
    for (int l = 0; l < 32; l++) {
        const int64_t i = 32 * sub + l;
        const float v = dtype == DT_F32 ? ((const float *)x)[i] : bf16_to_f32(((const uint16_t *)x)[i]);
        const int qi = (int)nearbyintf(v * inv);
        if (q8)
            q8[i] = (int8_t)qi;
        else
            q[i] = (int16_t)qi;
        sum[l / 16] += qi;
    }
}
#endif

/* One row of x, `run` values of 32 a scale, at most qmax: q (int16) or, where q8 is given, q8
 * (int8), with d, xs (where given), xs32 as xquant_t's (d repeated for each 32 of a run). */
static void quantize_row(const void *x, int64_t K, int dtype, int16_t *q, int8_t *q8, float *d,
                         float *xs, float *xs32, float qmax, int run) {
    for (int64_t s0 = 0; s0 < K / 32; s0 += run) {
        float amax = 0.f;
        for (int64_t sub = s0; sub < s0 + run; sub++) amax = fmaxf(amax, amax_sub(x, sub, dtype));
        const float inv = amax > 0.f ? qmax / amax : 0.f, scale = amax / qmax;
        for (int64_t sub = s0; sub < s0 + run; sub++) {
            int sum[2] = {0, 0};
            quantize_sub(x, sub, dtype, q, q8, inv, sum);
            d[sub] = scale;
            if (xs != NULL) {
                xs[2 * sub] = scale * (float)sum[0];
                xs[2 * sub + 1] = scale * (float)sum[1];
            }
            xs32[sub] = scale * (float)(sum[0] + sum[1]);
        }
    }
}

void quantize_x_row(const void *x, int64_t K, int dtype, int16_t *q, int8_t *q8, float *d,
                    float *xs, float *xs32) {
    quantize_row(x, K, dtype, q, q8, d, xs, xs32, q8 ? 127.f : 32767.f, 1);
}

void quantize_x_row_i16(const void *x, int64_t K, int dtype, int16_t *q, float qmax, int run,
                        float *d, float *xs32) {
    quantize_row(x, K, dtype, q, NULL, d, NULL, xs32, qmax, run);
}

int rows_take_unpack_x(int type, int64_t B) { return KQ_AVX2 && B == 1 && type == T_Q6_K; }

/* Each 32 of x as x[0:8] x[16:24] x[8:16] x[24:32]: vpunpck{l,h}bw's order (quant_rows.c). */
void unpack_order_x(const int16_t *q, int64_t n, int16_t *xu) {
    for (int64_t i = 0; i < n; i += 32) {
        memcpy(xu + i, q + i, 16);
        memcpy(xu + i + 8, q + i + 16, 16);
        memcpy(xu + i + 16, q + i + 8, 16);
        memcpy(xu + i + 24, q + i + 24, 16);
    }
}
