/*
 * The AVX2 row kernels for Q4_0 and Q4_1 (builds without AVX-512; quant_rows.c takes the
 * other types, and these on AVX-512): out = x @ W^T for up to 8 rows of x quantized to
 * int16 per 32 (quant_kernels.c), the weight blocks read as the file has them.
 *
 * Why not quant_rows.c's fused_row: per block of 32 it converts the block's scales one by one
 * (scalar half -> float, a multiply by x's scale, a broadcast) and converts its two products to
 * float for an FMA of their own: ~30 instructions per 32 weights, where the integer products
 * themselves are six. Here a group of 8 blocks keeps its products in integers:
 *
 *   block t of the group:  w (32 x int16)  = widen(the 16 nibble bytes): low | high nibbles
 *                          p_t (8 x int32) = vpmaddwd(w_lo, x[0:16]) + vpmaddwd(w_hi, x[16:32])
 *   per group:             s = [sum p_0, ..., sum p_7]     (a vphaddd tree, 8 instructions)
 *                          d, m of the 8 blocks: one gather of their first 4 bytes, 2 F16C
 *                          acc  += float(s) * (d * x.d)     macc += m * x.xs32
 *
 * ~9 instructions per 32 weights for one row of x; more rows share the widened weights. The
 * blocks past the last whole group (K = 576 has 18: two left) take the per-block float step.
 * The integer sums are exact (w <= 15, |x| <= 32767: 32 products fit an int32), so these
 * kernels differ from the portable ones only in the order of the float additions.
 *
 * Measured against fused_row (Zen 3, 2 threads, calls alternating in one process, medians of
 * per-round ratios): 1.35-1.52x at 1 row of x, 1.15x at 4 and 8. Q8_0 built the same way gained
 * 1.07x at 1 row and lost 0.73-0.90x at 4-8 (its widened block is 2 registers, its products
 * spill): it takes only the strips below (one row of x), and the K-quants, whose scales were
 * already vectors, lost 0.6-0.85x: they keep quant_rows.c's kernels.
 */
#include "quant_row_tables.h"

#if QK_SIMD && !defined(__AVX512BW__) && defined(__F16C__)

#define GROUP 8

/* The 32 weights of block `blk` as int16: lo = elements 0..15, hi = 16..31 (a Q4 byte holds
 * element l in its low nibble and l + 16 in its high one). */
ALWAYS_INLINE void block_values(int TYPE, const uint8_t *blk, __m256i *lo, __m256i *hi) {
    if (TYPE == T_Q8_0) { /* the strips only: int8 values after d */
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
        return;
    }
    const __m256i b = _mm256_cvtepu8_epi16(
        _mm_loadu_si128((const __m128i *)(blk + (TYPE == T_Q4_1 ? 4 : 2))));
    *lo = _mm256_and_si256(b, _mm256_set1_epi16(0xF));
    *hi = _mm256_srli_epi16(b, 4);
}

/* Blocks g0 .. g0 + 7 of the row, for NB rows of x. */
ALWAYS_INLINE void group(int TYPE, int NB, const uint8_t *row, const xquant_t *xq, int64_t b0,
                         int64_t K, int64_t g0, __m256 *acc, __m256 *macc) {
    const int bytes = TYPE == T_Q4_0 ? 18 : 20;
    const int64_t nsub = K / 32;
    __m256i p[FUSED_MAX_B][GROUP];
    for (int t = 0; t < GROUP; t++) {
        __m256i lo, hi;
        block_values(TYPE, row + (g0 + t) * bytes, &lo, &hi);
        for (int i = 0; i < NB; i++) {
            const int16_t *x = xq->q + (b0 + i) * K + 32 * (g0 + t);
            p[i][t] = _mm256_add_epi32(
                _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
                _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 16))));
        }
    }
    __m256 d, m;
    group_scales(TYPE, row + g0 * bytes, bytes, &d, &m);
    for (int i = 0; i < NB; i++) {
        const int64_t o = (b0 + i) * nsub + g0;
        const __m256 sd = _mm256_mul_ps(d, _mm256_loadu_ps(xq->d + o));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8x8(p[i])), sd, acc[i]);
        macc[i] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xq->xs32 + o), macc[i]);
    }
}

/* Block `sub` alone (a row's last K / 32 % 8): its product to float, its scale a broadcast,
 * its offset's share a scalar. */
ALWAYS_INLINE void tail_block(int TYPE, int NB, const uint8_t *row, const xquant_t *xq,
                              int64_t b0, int64_t K, int64_t sub, __m256 *acc, float *tail) {
    const int bytes = TYPE == T_Q4_0 ? 18 : 20;
    const uint8_t *blk = row + sub * bytes;
    const float d = half_to_f32(blk);
    const float m = TYPE == T_Q4_1 ? half_to_f32(blk + 2) : -8.f * d;
    __m256i lo, hi;
    block_values(TYPE, blk, &lo, &hi);
    for (int i = 0; i < NB; i++) {
        const int64_t o = (b0 + i) * (K / 32) + sub;
        const int16_t *x = xq->q + (b0 + i) * K + 32 * sub;
        const __m256i p = _mm256_add_epi32(
            _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
            _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 16))));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xq->d[o]), acc[i]);
        tail[i] += m * xq->xs32[o];
    }
}

ALWAYS_INLINE void avx2_row(int TYPE, int NB, const uint8_t *row, const xquant_t *xq,
                            int64_t b0, int64_t K, float *res) {
    const int64_t nsub = K / 32;
    __m256 acc[FUSED_MAX_B], macc[FUSED_MAX_B];
    for (int i = 0; i < NB; i++) acc[i] = macc[i] = _mm256_setzero_ps();
    int64_t g0 = 0;
    for (; g0 + GROUP <= nsub; g0 += GROUP) group(TYPE, NB, row, xq, b0, K, g0, acc, macc);
    float tail[FUSED_MAX_B] = {0};
    for (; g0 < nsub; g0++) tail_block(TYPE, NB, row, xq, b0, K, g0, acc, tail);
    for (int i = 0; i < NB; i++) res[i] = hsum8(_mm256_add_ps(acc[i], macc[i])) + tail[i];
}

/*
 * One row of x (the batch-1 decode step) against 8 weight rows at once: per block, the 8 rows'
 * integer products reduce to one vector whose lanes are the 8 rows, scaled by their 8 scales
 * (strip_scales: eight loads across the rows) and x's one: the lanes are the 8 outputs, with no
 * per-row reduction, no row tail (a short K, 576 at the default model, is 18 whole blocks), and
 * x's 32 values loaded once for the 8 rows.
 */
ALWAYS_INLINE void strip8(int TYPE, const uint8_t *w, int64_t row_bytes, const xquant_t *xq,
                          int64_t b0, int64_t K, float *res) {
    const int bytes = TYPE == T_Q4_0 ? 18 : TYPE == T_Q4_1 ? 20 : 34;
    const int64_t nsub = K / 32;
    const int16_t *xrow = xq->q + b0 * K;
    __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
    /* The next strip's bytes, a share each step (see strips). */
    const char *next = (const char *)(w + 8 * row_bytes);
    const int64_t per_step = (8 * row_bytes / 64 + nsub) / nsub;
    for (int64_t t = 0; t < nsub; t++) {
        for (int64_t l = t * per_step; l < (t + 1) * per_step; l++)
            _mm_prefetch(next + 64 * l, _MM_HINT_T0);
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xrow + 32 * t));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xrow + 32 * t + 16));
        /* Each pair of rows' products is folded at once (sum8x8's first level): 4 vectors
         * live instead of 8, so nothing spills (the 8 spilled to the stack at -O3). */
        __m256i h[4];
        for (int r = 0; r < 8; r += 2) {
            __m256i p[2];
            for (int i = 0; i < 2; i++) {
                __m256i lo, hi;
                block_values(TYPE, w + (r + i) * row_bytes + t * bytes, &lo, &hi);
                p[i] = _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1));
            }
            h[r / 2] = _mm256_hadd_epi32(p[0], p[1]);
        }
        __m256 d, m;
        strip_scales(TYPE, w + t * bytes, row_bytes, &d, &m);
        const int64_t o = b0 * nsub + t;
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum4x8_pairs(h)),
                              _mm256_mul_ps(d, _mm256_set1_ps(xq->d[o])), acc);
        if (TYPE != T_Q8_0) macc = _mm256_fmadd_ps(m, _mm256_set1_ps(xq->xs32[o]), macc);
    }
    _mm256_storeu_ps(res, _mm256_add_ps(acc, macc));
}

/* Rows n0 .. n1 - 1 against one row of x: strips of 8 weight rows, the last (n1 - n0) % 8 rows
 * by `one_by_one`. From K = 2048 on, every row by `one_by_one`: there the strips' 8 streams of
 * blocks ran 0.92-0.99x the rows (Zen 3, 1 and 2 threads, weights in cache), where at K = 576
 * they ran 1.14-1.35x and at 1536 1.02-1.09x. From memory (the default model's 30 layers, 66 MB)
 * the strips ran 0.65x until each step prefetched a share of the next strip's bytes (a strip
 * reads its 8 rows 360 bytes apart: not a pattern the hardware prefetcher follows): 1.08x then,
 * and the default model's fused decode step 1.09x (median of 6 rounds, libraries alternating). */
#define STRIPS_MAX_K 2048
ALWAYS_INLINE void strips(int TYPE, rows_fn one_by_one, const uint8_t *w, int64_t row_bytes,
                          const xquant_t *xq, int64_t b0, int64_t n0, int64_t n1, int64_t K,
                          void *out, int64_t out_stride, int out_dtype) {
    int64_t n = n0;
    for (; K < STRIPS_MAX_K && n + 8 <= n1; n += 8) {
        float res[8];
        strip8(TYPE, w + n * row_bytes, row_bytes, xq, b0, K, res);
        for (int r = 0; r < 8; r++) store_out(out, b0 * out_stride + n + r, res[r], out_dtype);
    }
    if (n < n1) one_by_one(w, row_bytes, xq, b0, n, n1, K, out, out_stride, out_dtype);
}

ROWS_FNS(avx2_row, T_Q4_0)
ROWS_FNS(avx2_row, T_Q4_1)

static void strips_q4_0(const uint8_t *w, int64_t row_bytes, const xquant_t *xq, int64_t b0,
                        int64_t n0, int64_t n1, int64_t K, void *out, int64_t out_stride,
                        int out_dtype) {
    strips(T_Q4_0, avx2_row_2_1, w, row_bytes, xq, b0, n0, n1, K, out, out_stride, out_dtype);
}
static void strips_q4_1(const uint8_t *w, int64_t row_bytes, const xquant_t *xq, int64_t b0,
                        int64_t n0, int64_t n1, int64_t K, void *out, int64_t out_stride,
                        int out_dtype) {
    strips(T_Q4_1, avx2_row_3_1, w, row_bytes, xq, b0, n0, n1, K, out, out_stride, out_dtype);
}

static void strips_q8_0(const uint8_t *w, int64_t row_bytes, const xquant_t *xq, int64_t b0,
                        int64_t n0, int64_t n1, int64_t K, void *out, int64_t out_stride,
                        int out_dtype) {
    strips(T_Q8_0, fused_row_fns(T_Q8_0)[0], w, row_bytes, xq, b0, n0, n1, K, out, out_stride,
           out_dtype);
}

/* Q8_0's rows of 2-8 rows of x stay quant_rows.c's (see the header's measurements): one row of x
 * takes the strips here (the default model's tied Q8_0 LM head, 49152 x 576: 1.31x, from memory,
 * 2 threads; 4096 x 576 1.24x, 576 x 1536 1.15x). */
rows_fn avx2_one_row_fn(int type) { return type == T_Q8_0 ? strips_q8_0 : NULL; }

/* One row of x takes the strips, 2-8 rows the rows (avx2_row_<type id>_<rows>, from ROWS_FNS). */
const rows_fn *avx2_row_fns(int type) {
    static const rows_fn q4_0[] = {strips_q4_0, avx2_row_2_2, avx2_row_2_3, avx2_row_2_4,
                                   avx2_row_2_5, avx2_row_2_6, avx2_row_2_7, avx2_row_2_8};
    static const rows_fn q4_1[] = {strips_q4_1, avx2_row_3_2, avx2_row_3_3, avx2_row_3_4,
                                   avx2_row_3_5, avx2_row_3_6, avx2_row_3_7, avx2_row_3_8};
    switch (type) {
    case T_Q4_0: return q4_0;
    case T_Q4_1: return q4_1;
    default: return NULL;
    }
}
#elif QK_SIMD
const rows_fn *avx2_row_fns(int type) {
    (void)type;
    return NULL;
}
rows_fn avx2_one_row_fn(int type) {
    (void)type;
    return NULL;
}
#endif
