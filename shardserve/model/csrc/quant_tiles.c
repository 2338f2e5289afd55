/*
 * Weights in tiles of 16 output rows (T4 from Q4_0 / Q4_1, T8 from Q8_0, repacked at load where
 * a weight's rows come in multiples of 16), and their product with a few rows of x.
 *
 * Why tiles: in a row layout (R4) every sub-block of 32 weights ends in a float step per row
 * of x (its integer dot converted, then scaled by d_w * d_x): at batch 1 that is as many
 * instructions as the multiply-adds, and each more row of x pays it again. In a tile the 16
 * rows sit side by side in one vector, a row per 32-bit lane, two columns per lane:
 *
 *   tile = 16 rows x K columns, per sub-block g of 32 columns 320 bytes:
 *     nib[8][32] | f16 d[16] | f16 m[16]        (w[r][k] = d[r] * q[r][k] + m[r], as R4)
 *     nib byte 32 c + 2 r + e:  low nibble q[r][32 g + 2 c + e], high q[r][32 g + 16 + 2 c + e]
 *
 *   (that byte is qs[2 c + e] of row r's Q4_0 / Q4_1 block g: the repack only moves bytes)
 *
 *   T8, per sub-block 544 bytes:  i8 q[16][32] | f16 d[16]     (w[r][k] = d[r] * q[r][k])
 *     q byte 32 p + 2 r + e = q[r][32 g + 2 p + e]            (Q8_0's qs, moved)
 *
 * so a chunk c widened to 16-bit lanes holds, in lane r, row r's pair of columns (2 c, 2 c + 1)
 * (low nibbles) or (16 + 2 c, 17 + 2 c) (high), and one vpdpwssd (VNNI; vpmaddwd + vpaddd
 * without) with x's pair broadcast adds both products for all 16 rows. Per sub-block and row
 * of x the float step is then one conversion and two FMAs for 16 weight rows together. Integer
 * sums per lane: 32 products of <= 128 * 32767, far inside int32.
 *
 * Only AVX-512 builds repack (as R4); other levels take the portable row decode below.
 */
#include <omp.h>

#include "quant_blocks.h"

/* One row's sub-blocks out of its tile, for the portable paths (decode_row_at). */
void decode_t4_row(const uint8_t *tile, int lane, int64_t K, row_t *r) {
    for (int64_t g = 0; g < K / 32; g++) {
        const uint8_t *p = tile + T4_SUB_BYTES * g;
        uint8_t *q = r->q + 32 * g;
        for (int c = 0; c < 8; c++)
            for (int e = 0; e < 2; e++) {
                const uint8_t byte = p[32 * c + 2 * lane + e];
                q[2 * c + e] = byte & 0xF;
                q[16 + 2 * c + e] = byte >> 4;
            }
        const float d = half_to_f32(p + 256 + 2 * lane), m = half_to_f32(p + 288 + 2 * lane);
        r->s[2 * g] = r->s[2 * g + 1] = d;
        r->m[2 * g] = r->m[2 * g + 1] = m;
    }
}

void decode_t8_row(const uint8_t *tile, int lane, int64_t K, row_t *r) {
    for (int64_t g = 0; g < K / 32; g++) {
        const uint8_t *p = tile + T8_SUB_BYTES * g;
        for (int pair = 0; pair < 16; pair++) memcpy(r->q + 32 * g + 2 * pair, p + 32 * pair + 2 * lane, 2);
        r->s[2 * g] = r->s[2 * g + 1] = half_to_f32(p + 512 + 2 * lane);
        r->m[2 * g] = r->m[2 * g + 1] = 0.f;
    }
}

#if QK_SIMD && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define T4_SIMD 1

ALWAYS_INLINE __m512i dot_pairs(__m512i acc, __m512i w, const int16_t *x) {
    int32_t pair;
    memcpy(&pair, x, 4);
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(pair));
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, _mm512_set1_epi32(pair)));
#endif
}

/* Sub-block g's integer dots of a T4 / T8 tile with NB rows of x from b0. */
ALWAYS_INLINE void tile_dots(int TYPE, int NB, const uint8_t *p, const xquant_t *xq, int64_t b0,
                             int64_t K, int64_t g, __m512i *dot) {
    for (int i = 0; i < NB; i++) dot[i] = _mm512_setzero_si512();
    if (TYPE == T_T8) {
#pragma GCC unroll 16
        for (int pair = 0; pair < 16; pair++) {
            const __m512i v = _mm512_cvtepi8_epi16(load32(p + 32 * pair));
            for (int i = 0; i < NB; i++)
                dot[i] = dot_pairs(dot[i], v, xq->q + (b0 + i) * K + 32 * g + 2 * pair);
        }
        return;
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        const __m512i v = _mm512_cvtepu8_epi16(load32(p + 32 * c));
        const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi16(0xF));
        const __m512i hi = _mm512_srli_epi16(v, 4);
        for (int i = 0; i < NB; i++) {
            const int16_t *x = xq->q + (b0 + i) * K + 32 * g + 2 * c;
            dot[i] = dot_pairs(dot_pairs(dot[i], lo, x), hi, x + 16);
        }
    }
}

/* A tile's 16 outputs for NB rows of x from b0 (TYPE and NB constants at each call). */
ALWAYS_INLINE void tile_rows(int TYPE, int NB, const uint8_t *tile, const xquant_t *xq,
                             int64_t b0, int64_t K, __m512 *res) {
    const int64_t nsub = K / 32;
    const int qbytes = TYPE == T_T8 ? 512 : 256;
    for (int i = 0; i < NB; i++) res[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < nsub; g++) {
        const uint8_t *p = tile + (TYPE == T_T8 ? T8_SUB_BYTES : T4_SUB_BYTES) * g;
        __m512i dot[FUSED_MAX_B];
        tile_dots(TYPE, NB, p, xq, b0, K, g, dot);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + qbytes)));
        for (int i = 0; i < NB; i++) {
            const int64_t at = (b0 + i) * nsub + g;
            const __m512 s = _mm512_mul_ps(d, _mm512_set1_ps(xq->d[at]));
            res[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), s, res[i]);
            if (TYPE == T_T4) {
                const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 288)));
                res[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xq->xs32[at]), res[i]);
            }
        }
    }
}

typedef void (*tile_fn)(const uint8_t *tile, const xquant_t *xq, int64_t b0, int64_t n0,
                        int64_t K, void *out, int64_t out_stride, int out_dtype);

#define TILE_FN(NAME, T, NB)                                                              \
    static void NAME##_##NB(const uint8_t *tile, const xquant_t *xq, int64_t b0, int64_t n0,  \
                            int64_t K, void *out, int64_t out_stride, int out_dtype) {     \
        __m512 res[NB];                                                                   \
        tile_rows(T, NB, tile, xq, b0, K, res);                                           \
        for (int i = 0; i < NB; i++) {                                                    \
            float v[16];                                                                  \
            _mm512_storeu_ps(v, res[i]);                                                  \
            for (int r = 0; r < 16; r++)                                                  \
                store_out(out, (b0 + i) * out_stride + n0 + r, v[r], out_dtype);          \
        }                                                                                 \
    }
#define TILE_FNS(NAME, T)                                                                 \
    TILE_FN(NAME, T, 1) TILE_FN(NAME, T, 2) TILE_FN(NAME, T, 3) TILE_FN(NAME, T, 4)         \
    TILE_FN(NAME, T, 5) TILE_FN(NAME, T, 6) TILE_FN(NAME, T, 7) TILE_FN(NAME, T, 8)         \
    static const tile_fn NAME##_fns[FUSED_MAX_B] = {NAME##_1, NAME##_2, NAME##_3, NAME##_4, \
                                                    NAME##_5, NAME##_6, NAME##_7, NAME##_8};
TILE_FNS(t4, T_T4)
TILE_FNS(t8, T_T8)

int quant_tiles_simd(const uint8_t *w, int64_t row_bytes, int type, const xquant_t *xq,
                     int64_t B, int64_t N, int64_t K, void *out, int64_t out_stride,
                     int out_dtype, int threads) {
    const tile_fn *fns = type == T_T8 ? t8_fns : t4_fns;
    const int64_t tiles = N / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t b0 = 0; b0 < B; b0 += FUSED_MAX_B) {
            const int64_t nb = B - b0 < FUSED_MAX_B ? B - b0 : FUSED_MAX_B;
            fns[nb - 1](w + 16 * t * row_bytes, xq, b0, 16 * t, K, out, out_stride,
                           out_dtype);
        }
    }
    return 1;
}
#else
int quant_tiles_simd(const uint8_t *w, int64_t row_bytes, int type, const xquant_t *xq,
                     int64_t B, int64_t N, int64_t K, void *out, int64_t out_stride,
                     int out_dtype, int threads) {
    (void)w, (void)row_bytes, (void)type, (void)xq, (void)B, (void)N, (void)K, (void)out, (void)out_stride,
        (void)out_dtype, (void)threads;
    return 0;
}
#endif
