/*
 * T6K tiles (Q6_K in tiles of 16 rows, quant_tiles.c draws the layout) on AVX2 builds without
 * AVX-512: their product with a few rows of x quantized to int16 per 32 (quant_tiles_avx2.c
 * hands a T6K here; the engine up to 2 rows, quantization.ROWS_MAX_INT16_GEMM_T6K; the int16
 * GEMM takes more, its panels from quant_gemm_i16_tiles.c).
 *
 * Why: Q6_K rows (quant_rows.c) fold each block's sums across lanes and, in the GEMM, decode
 * row by row into a buffer that 8 x 8 transposes turn into the panel, its 16 rows 16 streams
 * far apart in memory. In a tile a word of 32 bytes is 16 rows' pairs of columns, so:
 *
 *   per word t of half h (ql words t and 16 + t, qh word t; columns 32 u + 2 t + e, quarter u):
 *     v_u = (ql's nibble of quarter u) | (qh's bits 2 u, 2 u + 1) << 4      bytes 0..63
 *     widened by vpunpck{l,h}bw with zero: two vectors of int16 pairs, rows {0-3, 8-11} (A)
 *     and {4-7, 12-15} (B) in their int32 lanes; dot[u][A|B] += vpmaddwd(., x's pair)
 *   per 16 columns (scale j), per row of x:
 *     res += (float(dot) * x.d - 32 x.xs) * (d sc_j)        (q - 32 through x's sums per 16)
 *
 * The same integers as the rows (|q| <= 63, |x| <= 32767: 16 products per lane per scale
 * fit an int32), other float order.
 *
 * Measured against the Q6_K rows (Zen 3, 2 threads, 8192 x 2048 and 2048 x 8192, three distinct
 * weights from memory, alternating): 1.04x at 1 row of x (27 against 24 GMAC/s), 1.13x at 2;
 * the GEMM from the tiles 1.24x at 16 rows, 1.17x at 32. At 4-8 rows the tiles lost (0.91-0.95x:
 * passes of 2 decode a tile again each), so those go to the GEMM. The 1B Q4_K_M's decode, one
 * process, libraries alternating: 1.06x at batch 1, 1.11x at 8, 1.03x at 32 (noisy rounds).
 * At one row of x this runs ~12 vector instructions per 32 weights against T4K's ~8.
 */
#include "quant_blocks.h"

#if QK_SIMD && !defined(__AVX512BW__) && defined(__F16C__) && defined(__FMA__)

#define K6_PASS_MAX 2 /* rows of x a pass (quant_tiles_avx2.c's PASS_MAX): 4 int32 sums each */

/* d sc_j of a block's 16 rows in the A / B lane order (rows 0-3, 8-11 / 4-7, 12-15). */
ALWAYS_INLINE void k6_row_scales(const uint8_t *p, int j, __m256 d_ab[2], __m256 s_ab[2]) {
    const __m128i order = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
    const __m128i sc =
        _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + T6K_SC(j))), order);
    for (int ab = 0; ab < 2; ab++)
        s_ab[ab] = _mm256_mul_ps(d_ab[ab], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                               ab ? _mm_srli_si128(sc, 8) : sc)));
}

/* The block's d (f16 per row) in the A / B lane order. */
ALWAYS_INLINE void k6_row_d(const uint8_t *p, __m256 d_ab[2]) {
    const __m256i d = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)p), 0xD8);
    d_ab[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(d));
    d_ab[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(d, 1));
}

/*
 * Block p (block bi) of a tile times NB rows of x, into acc[i][A|B]: per half h and words
 * 8 th .. 8 th + 7, the quarters in pairs (0, 2) from ql words t, (1, 3) from ql words 16 + t.
 */
ALWAYS_INLINE void k6_block(int NB, const uint8_t *p, int64_t bi, const xquant_t *xq, int64_t b0,
                            int64_t K, __m256 (*acc)[2]) {
    const __m256i zero = _mm256_setzero_si256();
    __m256 d_ab[2];
    k6_row_d(p, d_ab);
    for (int h = 0; h < 2; h++)
        for (int th = 0; th < 2; th++)
            for (int odd = 0; odd < 2; odd++) { /* quarters odd and 2 + odd */
                const uint8_t *ql = p + T6K_QL(h, 16 * odd + 8 * th), *qh = p + T6K_QH(h, 8 * th);
                __m256i dot[K6_PASS_MAX][2][2]; /* [row of x][quarter pair][A|B] */
                for (int i = 0; i < NB; i++)
                    dot[i][0][0] = dot[i][0][1] = dot[i][1][0] = dot[i][1][1] = zero;
#pragma GCC unroll 8
                for (int t = 0; t < 8; t++) {
                    if (odd == 0 && t < 6) /* this part of the next block: 12 lines */
                        for (int l = 0; l < 2; l++)
                            _mm_prefetch((const char *)p + T6K_BLOCK_BYTES + T6K_PART(h, th) +
                                             128 * t + 64 * l, _MM_HINT_T0);
                    const __m256i l = load32(ql + 32 * t), hb = load32(qh + 32 * t);
                    for (int s = 0; s < 2; s++) {
                        const int u = odd + 2 * s;
                        const __m256i v = k6_bytes(l, hb, u);
                        const __m256i va = _mm256_unpacklo_epi8(v, zero);
                        const __m256i vb = _mm256_unpackhi_epi8(v, zero);
                        for (int i = 0; i < NB; i++) {
                            int32_t pair;
                            memcpy(&pair, xq->q + (b0 + i) * K + 256 * bi + 128 * h + 32 * u +
                                              16 * th + 2 * t, 4);
                            const __m256i xp = _mm256_set1_epi32(pair);
                            __m256i *d = dot[i][s];
                            d[0] = _mm256_add_epi32(d[0], _mm256_madd_epi16(va, xp));
                            d[1] = _mm256_add_epi32(d[1], _mm256_madd_epi16(vb, xp));
                        }
                    }
                }
                for (int s = 0; s < 2; s++) {
                    const int j = 8 * h + 2 * (odd + 2 * s) + th; /* column / 16 in the block */
                    __m256 s_ab[2];
                    k6_row_scales(p, j, d_ab, s_ab);
                    for (int i = 0; i < NB; i++) {
                        const int64_t r = b0 + i;
                        const __m256 xd = _mm256_set1_ps(xq->d[r * (K / 32) + 8 * bi + j / 2]);
                        const __m256 xm =
                            _mm256_set1_ps(-32.f * xq->xs[r * (K / 16) + 16 * bi + j]);
                        for (int ab = 0; ab < 2; ab++)
                            acc[i][ab] = _mm256_fmadd_ps(
                                _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][s][ab]), xd, xm),
                                s_ab[ab], acc[i][ab]);
                    }
                }
            }
}

/* A tile's 16 outputs for NB rows of x from b0. */
ALWAYS_INLINE void k6_pass(int NB, const uint8_t *tile, const xquant_t *xq, int64_t b0,
                           int64_t n0, int64_t K, void *out, int64_t out_stride, int out_dtype) {
    __m256 acc[K6_PASS_MAX][2];
    for (int i = 0; i < NB; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t bi = 0; bi < K / 256; bi++)
        k6_block(NB, tile + T6K_BLOCK_BYTES * bi, bi, xq, b0, K, acc);
    static const int lane_row[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
    for (int i = 0; i < NB; i++) {
        float v[16];
        _mm256_storeu_ps(v, acc[i][0]);
        _mm256_storeu_ps(v + 8, acc[i][1]);
        for (int l = 0; l < 16; l++)
            store_out(out, (b0 + i) * out_stride + n0 + lane_row[l], v[l], out_dtype);
    }
}

/* quant_tiles_avx2.c's passes of 1 and 2 rows (its loop hands out the tiles and passes). */
void k6_avx2_pass1(const uint8_t *tile, const xquant_t *xq, int64_t b0, int64_t n0, int64_t K,
                   void *out, int64_t out_stride, int out_dtype) {
    k6_pass(1, tile, xq, b0, n0, K, out, out_stride, out_dtype);
}
void k6_avx2_pass2(const uint8_t *tile, const xquant_t *xq, int64_t b0, int64_t n0, int64_t K,
                   void *out, int64_t out_stride, int out_dtype) {
    k6_pass(2, tile, xq, b0, n0, K, out, out_stride, out_dtype);
}

#endif
