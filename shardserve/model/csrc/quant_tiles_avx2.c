/*
 * T4 / T8 / T4K tiles (Q4_0 / Q4_1 / Q8_0 / Q4_K in tiles of 16 rows, quant_tiles.c draws the
 * layouts) on AVX2 builds without AVX-512: their product with up to 8 rows of x quantized to
 * int16 per 32 (past 8 quant_gemm_i16.c takes the tiles as its panels). T6K (Q6_K's tiles) is
 * handed to quant_tiles_k6_avx2.c.
 *
 * Why: at one row of x the file layout needs a reduction per weight row: quant_rows_avx2.c's
 * strips fold 8 rows' products with six vphaddd per 32 columns, and with the scales gathered
 * row by row they ran ~12 vector instructions per 32 weights, compute-bound at ~39 GMAC/s on
 * Zen 3 (2 threads), from memory or not. In a tile the 16 rows are lanes already:
 *
 *   chunk c of sub-block g (32 bytes): byte 2 r + e = row r's qs[2 c + e]
 *     widened to 16 bits, rows 0-7 in one ymm, 8-15 in the other; in each 32-bit lane the
 *     row's pair of columns (2 c, 2 c + 1) (low nibbles) or (16 + 2 c, 17 + 2 c) (high)
 *   dot[r] += vpmaddwd(pair, x's pair broadcast) + ...     (int32 lanes = rows, no reduction)
 *   per sub-block and row of x:  res += float(dot) * (d[16] * x.d)  +  m[16] * x.xs32
 *
 * ~7 vector instructions per 32 weights at one row of x; T8 the same with each pair of int8
 * columns widened (sign-extended) instead of the nibbles; T4K with a sub-block's 6-bit scale and
 * min applied in the float step, per 16 rows. The same integers as the rows kernels (|w| <= 128,
 * |x| <= 32767: 32 products per lane fit an int32), other float order. Measured against the
 * blocks' own kernels (Zen 3, 2 threads, random blocks, one process): Q4_1 1.33x at 1 row of x,
 * 1.31x at 8; Q8_0 1.17x / 1.14x; Q4_K 1.11x / 1.34-1.38x (README, issue 30's tiles session).
 */
#include "quant_blocks.h"

#if QK_SIMD && !defined(__AVX512BW__) && defined(__F16C__) && defined(__FMA__)

#define PASS_MAX 2 /* rows of x a pass: 2 int32 and 2 float accumulators each, no spill */
#define K4_PASS_MAX 4 /* T4K's, a sub-block at a time (k4_dots) */

static inline __m256 halves8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline __m256i pair_of(const int16_t *x) {
    int32_t pair;
    memcpy(&pair, x, 4);
    return _mm256_set1_epi32(pair);
}

/* Sub-block g (at p) of a T4 / T8 tile times NB rows of x: dot[i][h], rows 8 h .. 8 h + 7. T4
 * goes a chunk (columns 2 c, 2 c + 1 in the low nibbles, 16 + 2 c, 17 + 2 c in the high) a
 * step, T8 a pair of int8 columns (2 q, 2 q + 1). At one row the even and odd steps add into
 * accumulators of their own (two chains of vpaddd, not one). */
ALWAYS_INLINE void tile_dots(int TYPE, int NB, const uint8_t *p, const int16_t *const *x,
                             __m256i (*dot)[2]) {
    const int t8 = TYPE == T_T8, steps = t8 ? 16 : 8;
    const uint8_t *values = p + (t8 ? T8_Q : T4_Q);
    __m256i odd[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int i = 0; i < NB; i++) dot[i][0] = dot[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int k = 0; k < steps; k++) {
        if (k % 2 == 0) _mm_prefetch((const char *)values + 32 * k + 2048, _MM_HINT_T0);
        __m256i lo[2], hi[2]; /* T8: lo only */
        for (int h = 0; h < 2; h++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(values + 32 * k + 16 * h));
            if (t8) {
                lo[h] = _mm256_cvtepi8_epi16(b);
                continue;
            }
            const __m256i v = _mm256_cvtepu8_epi16(b);
            lo[h] = _mm256_and_si256(v, _mm256_set1_epi16(0xF));
            hi[h] = _mm256_srli_epi16(v, 4);
        }
        for (int i = 0; i < NB; i++) {
            const __m256i xl = pair_of(x[i] + 2 * k);
            for (int h = 0; h < 2; h++) {
                __m256i s = _mm256_madd_epi16(lo[h], xl);
                if (!t8)
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(hi[h], pair_of(x[i] + 16 + 2 * k)));
                if (NB == 1 && k % 2)
                    odd[h] = _mm256_add_epi32(odd[h], s);
                else
                    dot[i][h] = _mm256_add_epi32(dot[i][h], s);
            }
        }
    }
    if (NB == 1)
        for (int h = 0; h < 2; h++) dot[0][h] = _mm256_add_epi32(dot[0][h], odd[h]);
}

/* A tile's 16 outputs for NB rows of x from b0 into res[i][h] (T4: w = d q + m; T8: d q). */
ALWAYS_INLINE void tile_rows(int TYPE, int NB, const uint8_t *tile, const xquant_t *xq,
                             int64_t b0, int64_t K, __m256 (*res)[2]) {
    const int64_t nsub = K / 32;
    for (int i = 0; i < NB; i++) res[i][0] = res[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nsub; g++) {
        const uint8_t *p = tile + (TYPE == T_T8 ? T8_SUB_BYTES : T4_SUB_BYTES) * g;
        const int16_t *x[PASS_MAX];
        for (int i = 0; i < NB; i++) x[i] = xq->q + (b0 + i) * K + 32 * g;
        __m256i dot[PASS_MAX][2];
        tile_dots(TYPE, NB, p, x, dot);
        for (int h = 0; h < 2; h++) {
            const __m256 d = halves8(p + 16 * h);
            for (int i = 0; i < NB; i++) {
                const int64_t at = (b0 + i) * nsub + g;
                res[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][h]),
                                            _mm256_mul_ps(d, _mm256_set1_ps(xq->d[at])), res[i][h]);
                if (TYPE == T_T4)
                    res[i][h] = _mm256_fmadd_ps(halves8(p + 32 + 16 * h),
                                                _mm256_set1_ps(xq->xs32[at]), res[i][h]);
            }
        }
    }
}

/* T4K: sub-block 2 pair + sub of block bi (the pair's low nibbles, sub 0, or high ones) times NB
 * rows of x: dot[i][h] (rows 8 h .. 8 h + 7). A sub-block at a time, so that at 4 rows of x the
 * 8 sums, the values and x's pair fit the 16 registers (both at once took 16 sums). */
ALWAYS_INLINE void k4_dots(int NB, int sub, const uint8_t *nib, const int16_t *const *x,
                           __m256i (*dot)[2]) {
    for (int i = 0; i < NB; i++) dot[i][0] = dot[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int t = 0; t < 16; t++) {
        if (sub == 0 && t % 2 == 0) _mm_prefetch((const char *)nib + 32 * t + 2048, _MM_HINT_T0);
        __m256i v[2];
        for (int h = 0; h < 2; h++) {
            v[h] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(nib + 32 * t + 16 * h)));
            v[h] = sub ? _mm256_srli_epi16(v[h], 4)
                       : _mm256_and_si256(v[h], _mm256_set1_epi16(0xF));
        }
        for (int i = 0; i < NB; i++) {
            const __m256i xp = pair_of(x[i] + 32 * sub + 2 * t);
            for (int h = 0; h < 2; h++)
                dot[i][h] = _mm256_add_epi32(dot[i][h], _mm256_madd_epi16(v[h], xp));
        }
    }
}

/* T4K at one row of x: both sub-blocks of a pair from one widening of the nibbles, dot[s][h]
 * (4 sums; k4_dots's sub-block at a time re-widens them, which ran 0.95x at one row). */
ALWAYS_INLINE void k4_pair_dots(const uint8_t *nib, const int16_t *x, __m256i (*dot)[2]) {
    for (int sub = 0; sub < 2; sub++) dot[sub][0] = dot[sub][1] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int t = 0; t < 16; t++) {
        if (t % 2 == 0) _mm_prefetch((const char *)nib + 32 * t + 2048, _MM_HINT_T0);
        const __m256i xl = pair_of(x + 2 * t), xh = pair_of(x + 32 + 2 * t);
        for (int h = 0; h < 2; h++) {
            const __m256i v =
                _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(nib + 32 * t + 16 * h)));
            dot[0][h] = _mm256_add_epi32(
                dot[0][h], _mm256_madd_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0xF)), xl));
            dot[1][h] = _mm256_add_epi32(dot[1][h], _mm256_madd_epi16(_mm256_srli_epi16(v, 4), xh));
        }
    }
}

/* T4K's float step of sub-block j of block p (block bi): acc[i] += its dots times d sc_j x.d,
 * less dmin m_j x.xs32, 8 rows of the tile (h) at a time. */
ALWAYS_INLINE void k4_scale_step(int NB, const uint8_t *p, int64_t bi, int j, __m256i (*dot)[2],
                                 const xquant_t *xq, int64_t b0, int64_t nsub, float (*acc)[16]) {
    for (int h = 0; h < 2; h++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(p + 64 + 32 * h));
        const __m256i b = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
        const __m256i c = _mm256_loadu_si256((const __m256i *)(p + 192 + 32 * h));
        const __m256 sc = _mm256_mul_ps(halves8(p + 16 * h),
                                        _mm256_cvtepi32_ps(k4_scale8(j, 0, a, b, c)));
        const __m256 mn = _mm256_mul_ps(halves8(p + 32 + 16 * h),
                                        _mm256_cvtepi32_ps(k4_scale8(j, 1, a, b, c)));
        for (int i = 0; i < NB; i++) {
            const int64_t at = (b0 + i) * nsub + 8 * bi + j;
            __m256 r = _mm256_load_ps(acc[i] + 8 * h);
            r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][h]),
                                _mm256_mul_ps(sc, _mm256_set1_ps(xq->d[at])), r);
            _mm256_store_ps(acc[i] + 8 * h, _mm256_fnmadd_ps(mn, _mm256_set1_ps(xq->xs32[at]), r));
        }
    }
}

/* T4K at one row of x: a pair of sub-blocks at a time from one widening of the nibbles, both
 * float steps right after, in k4_rows's order (the same result). In k4_rows's loop the pair's
 * sums had gone through the stack between its two sub-blocks: 1.07-1.10x at one row of x (Zen
 * 3, 2 threads, random blocks from memory), the 1B's decode step 1.034x. Not unrolled: unrolled
 * over the 4 pairs it ran 0.68x. */
ALWAYS_INLINE void k4_row1(const uint8_t *tile, const xquant_t *xq, int64_t b0, int64_t K,
                           __m256 *res) {
    float acc[1][16] __attribute__((aligned(32))) = {{0}};
    for (int64_t bi = 0; bi < K / 256; bi++) {
        const uint8_t *p = tile + T4K_BLOCK_BYTES * bi;
        for (int jp = 0; jp < 4; jp++) {
            __m256i pair[2][2];
            k4_pair_dots(p + T4K_NIB + 512 * jp, xq->q + b0 * K + 256 * bi + 64 * jp, pair);
            k4_scale_step(1, p, bi, 2 * jp, pair, xq, b0, K / 32, acc);
            k4_scale_step(1, p, bi, 2 * jp + 1, pair + 1, xq, b0, K / 32, acc);
        }
    }
    for (int h = 0; h < 2; h++) res[h] = _mm256_load_ps(acc[0] + 8 * h);
}

/* T4K (quant_tiles.c's layout, w = d sc_j q - dmin m_j): a tile's 16 outputs for NB rows (2-4;
 * one: k4_row1). */
ALWAYS_INLINE void k4_rows(int NB, const uint8_t *tile, const xquant_t *xq, int64_t b0, int64_t K,
                           __m256 (*res)[2]) {
    /* At 2-4 rows of x the float sums wait in memory while the dots run (the registers are the
     * dots'; the asm makes the compiler keep them there). */
    float acc[K4_PASS_MAX][16] __attribute__((aligned(32))) = {{0}};
    for (int64_t bi = 0; bi < K / 256; bi++) {
        const uint8_t *p = tile + T4K_BLOCK_BYTES * bi;
        for (int j = 0; j < 8; j++) {
            const uint8_t *nib = p + T4K_NIB + 512 * (j / 2);
            const int16_t *x[K4_PASS_MAX];
            for (int i = 0; i < NB; i++) x[i] = xq->q + (b0 + i) * K + 256 * bi + 64 * (j / 2);
            __m256i dot[K4_PASS_MAX][2];
            __asm__ volatile("" : : "r"(acc) : "memory");
            k4_dots(NB, j % 2, nib, x, dot);
            k4_scale_step(NB, p, bi, j, dot, xq, b0, K / 32, acc);
        }
    }
    for (int i = 0; i < NB; i++)
        for (int h = 0; h < 2; h++) res[i][h] = _mm256_load_ps(acc[i] + 8 * h);
}

ALWAYS_INLINE void tile_pass(int TYPE, int NB, const uint8_t *tile, const xquant_t *xq,
                             int64_t b0, int64_t n0, int64_t K, void *out, int64_t out_stride,
                             int out_dtype) {
    __m256 res[K4_PASS_MAX][2];
    if (TYPE == T_T4K && NB == 1)
        k4_row1(tile, xq, b0, K, res[0]);
    else if (TYPE == T_T4K)
        k4_rows(NB, tile, xq, b0, K, res);
    else
        tile_rows(TYPE, NB, tile, xq, b0, K, res);
    for (int i = 0; i < NB; i++) {
        float v[16];
        _mm256_storeu_ps(v, res[i][0]);
        _mm256_storeu_ps(v + 8, res[i][1]);
        for (int r = 0; r < 16; r++)
            store_out(out, (b0 + i) * out_stride + n0 + r, v[r], out_dtype);
    }
}

typedef void (*pass_fn)(const uint8_t *tile, const xquant_t *xq, int64_t b0, int64_t n0,
                        int64_t K, void *out, int64_t out_stride, int out_dtype);
#define PASS_FN(NAME, TYPE, NB)                                                                \
    static void NAME(const uint8_t *tile, const xquant_t *xq, int64_t b0, int64_t n0, int64_t K, \
                     void *out, int64_t out_stride, int out_dtype) {                         \
        tile_pass(TYPE, NB, tile, xq, b0, n0, K, out, out_stride, out_dtype);                  \
    }
PASS_FN(t4_pass1, T_T4, 1)
PASS_FN(t4_pass2, T_T4, 2)
PASS_FN(t8_pass1, T_T8, 1)
PASS_FN(t8_pass2, T_T8, 2)
PASS_FN(k4_pass1, T_T4K, 1)
PASS_FN(k4_pass2, T_T4K, 2)
PASS_FN(k4_pass3, T_T4K, 3)
PASS_FN(k4_pass4, T_T4K, 4)

int quant_tiles_avx2_takes(int ggml_type) {
    return ggml_type == T_Q4_0 || ggml_type == T_Q4_1 || ggml_type == T_Q8_0 ||
           ggml_type == T_Q4_K || ggml_type == T_Q6_K;
}

/*
 * out = x @ W^T for W in T4 / T8 / T4K / T6K tiles (N a multiple of 16), B rows of x in passes
 * of up to PASS_MAX (T4K: K4_PASS_MAX); 0 for another type (the caller decodes it).
 */
int quant_tiles_avx2(const uint8_t *w, int64_t row_bytes, int type, const xquant_t *xq,
                     int64_t B, int64_t N, int64_t K, void *out, int64_t out_stride,
                     int out_dtype, int threads) {
    static const pass_fn t4[] = {t4_pass1, t4_pass2}, t8[] = {t8_pass1, t8_pass2};
    static const pass_fn k4[] = {k4_pass1, k4_pass2, k4_pass3, k4_pass4};
    static const pass_fn k6[] = {k6_avx2_pass1, k6_avx2_pass2}; /* quant_tiles_k6_avx2.c */
    const pass_fn *fns = type == T_T4    ? t4
                         : type == T_T8  ? t8
                         : type == T_T4K ? k4
                         : type == T_T6K ? k6
                                         : NULL;
    if (fns == NULL) return 0;
    if (B <= 0) return 1;
    /* Passes of equal rows (5 = 3 + 2, not 4 + 1): each pass re-reads the tile from L1. */
    const int64_t most = type == T_T4K ? K4_PASS_MAX : PASS_MAX;
    const int64_t passes = (B + most - 1) / most, per = (B + passes - 1) / passes;
    const int64_t tiles = N / 16;
#pragma omp parallel for num_threads(threads) schedule(guided)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t b0 = 0; b0 < B; b0 += per) {
            const int64_t nb = B - b0 < per ? B - b0 : per;
            fns[nb - 1](w + 16 * t * row_bytes, xq, b0, 16 * t, K, out, out_stride, out_dtype);
        }
    return 1;
}
#else
int quant_tiles_avx2_takes(int ggml_type) {
    (void)ggml_type;
    return 0;
}

int quant_tiles_avx2(const uint8_t *w, int64_t row_bytes, int type, const xquant_t *xq,
                     int64_t B, int64_t N, int64_t K, void *out, int64_t out_stride,
                     int out_dtype, int threads) {
    (void)w, (void)row_bytes, (void)type, (void)xq, (void)B, (void)N, (void)K, (void)out,
        (void)out_stride, (void)out_dtype, (void)threads;
    return 0;
}
#endif
