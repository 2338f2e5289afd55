/*
 * The int16 GEMM's panels (quant_gemm_i16.c, AVX2 builds) straight from the tiles of 16 rows
 * (T4 / T8 / T4K / T6K, quant_tiles.c draws them): a tile's chunk of 32 bytes is already 16
 * rows' pair of columns, so widened it is a panel line, with no rows decoded and no transposes.
 * The panel: pair of columns p of the chunk, row r at panel[p * NT + r] (int32: two int16
 * values); per group g of 32 columns the scale dg and the offset's coefficient mg at
 * [NT * g + r] (quant_gemm_i16.c's header lists each type's v, dg, mg).
 */
#include "quant_blocks.h"

#if QK_SIMD && defined(__F16C__) && defined(__FMA__) && !defined(__AVX512F__)
#define NT 16 /* a tile's rows: the panel's stride */

/* T4 / T8 (quant_tiles_avx2.c): the tile of 16 rows at `tile`, columns [k0, k0 + kc), straight
 * into the panel: T4's chunk c of a sub-block widened is already 16 rows' pairs of columns
 * (2 c, 2 c + 1) (low nibbles) and (16 + 2 c, 17 + 2 c) (high), T8's pair c (2 c, 2 c + 1), so
 * no transposes. v = q, dg = d, mg = m (T8: 0). */
static void decode_tile_panel(int type, const uint8_t *tile, int64_t k0, int64_t kc,
                              int32_t *panel, float *dg, float *mg) {
    const int t8 = type == T_T8;
    for (int64_t g = 0; g < kc / 32; g++) {
        const uint8_t *p = tile + (t8 ? T8_SUB_BYTES : T4_SUB_BYTES) * (k0 / 32 + g);
        for (int h = 0; h < 2; h++) {
            const __m128i *dh = (const __m128i *)(p + 16 * h);
            const __m128i *mh = (const __m128i *)(p + 32 + 16 * h);
            _mm256_store_ps(dg + NT * g + 8 * h, _mm256_cvtph_ps(_mm_loadu_si128(dh)));
            _mm256_store_ps(mg + NT * g + 8 * h,
                            t8 ? _mm256_setzero_ps() : _mm256_cvtph_ps(_mm_loadu_si128(mh)));
        }
        for (int c = 0; c < (t8 ? 16 : 8); c++)
            for (int h = 0; h < 2; h++) {
                const uint8_t *chunk = p + (t8 ? T8_Q : T4_Q) + 32 * c + 16 * h;
                const __m128i b = _mm_loadu_si128((const __m128i *)chunk);
                if (t8) {
                    _mm256_store_si256((__m256i *)(panel + (16 * g + c) * NT + 8 * h),
                                       _mm256_cvtepi8_epi16(b));
                    continue;
                }
                const __m256i v = _mm256_cvtepu8_epi16(b);
                _mm256_store_si256((__m256i *)(panel + (16 * g + c) * NT + 8 * h),
                                   _mm256_and_si256(v, _mm256_set1_epi16(0xF)));
                _mm256_store_si256((__m256i *)(panel + (16 * g + 8 + c) * NT + 8 * h),
                                   _mm256_srli_epi16(v, 4));
            }
    }
}

/* T4K: the tile's blocks of columns [k0, k0 + kc) into the panel, each sub-block's values times
 * its 6-bit scale (v = q sc_j <= 945, as decode_k's Q4_K), dg = d, mg = -dmin m_j. A pair of
 * sub-blocks (the low and high nibbles of the same bytes) from one widening. */
static void decode_t4k_panel(const uint8_t *tile, int64_t k0, int64_t kc, int32_t *panel,
                             float *dg, float *mg) {
    for (int64_t bi = k0 / 256; bi < (k0 + kc) / 256; bi++) {
        const uint8_t *p = tile + T4K_BLOCK_BYTES * bi;
        const int64_t g0 = bi * 8 - k0 / 32;
        for (int h = 0; h < 2; h++) {
            const __m128i *dh = (const __m128i *)(p + 16 * h), *mh = dh + 2;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(dh));
            const __m256 ndmin =
                _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(_mm_loadu_si128(mh)));
            const __m256i a = _mm256_loadu_si256((const __m256i *)(p + 64 + 32 * h));
            const __m256i b = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
            const __m256i c = _mm256_loadu_si256((const __m256i *)(p + 192 + 32 * h));
            __m256i sc2[8]; /* sub-block j's scale in both int16 of each row's lane */
            for (int j = 0; j < 8; j++) {
                const __m256i sc = k4_scale8(j, 0, a, b, c);
                sc2[j] = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
                _mm256_store_ps(dg + NT * (g0 + j) + 8 * h, d);
                const __m256 m = _mm256_cvtepi32_ps(k4_scale8(j, 1, a, b, c));
                _mm256_store_ps(mg + NT * (g0 + j) + 8 * h, _mm256_mul_ps(ndmin, m));
            }
            for (int jp = 0; jp < 4; jp++) {
                const uint8_t *nib = p + T4K_NIB + 512 * jp + 16 * h;
                int32_t *lo = panel + 16 * (g0 + 2 * jp) * NT + 8 * h, *hi = lo + 16 * NT;
                for (int t = 0; t < 16; t++) {
                    const __m256i v =
                        _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(nib + 32 * t)));
                    const __m256i q0 = _mm256_and_si256(v, _mm256_set1_epi16(0xF));
                    const __m256i q1 = _mm256_srli_epi16(v, 4);
                    _mm256_store_si256((__m256i *)(lo + t * NT),
                                       _mm256_mullo_epi16(q0, sc2[2 * jp]));
                    _mm256_store_si256((__m256i *)(hi + t * NT),
                                       _mm256_mullo_epi16(q1, sc2[2 * jp + 1]));
                }
            }
        }
    }
}

/* T6K: the tile's blocks of columns [k0, k0 + kc) into the panel, v = (q - 32) sc_j (|v| <= 4096,
 * as decode_k's Q6_K), dg = d, mg = 0. */
static void decode_t6k_panel(const uint8_t *tile, int64_t k0, int64_t kc, int32_t *panel, float *dg,
                        float *mg) {
    for (int64_t bi = k0 / 256; bi < (k0 + kc) / 256; bi++) {
        const uint8_t *p = tile + T6K_BLOCK_BYTES * bi;
        const int64_t g0 = bi * 8 - k0 / 32; /* the block's first group of 32 in the chunk */
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));
        for (int g = 0; g < 8; g++) {
            _mm256_store_ps(dg + NT * (g0 + g), d0);
            _mm256_store_ps(dg + NT * (g0 + g) + 8, d1);
            _mm256_store_ps(mg + NT * (g0 + g), _mm256_setzero_ps());
            _mm256_store_ps(mg + NT * (g0 + g) + 8, _mm256_setzero_ps());
        }
        for (int h = 0; h < 2; h++)
            for (int u = 0; u < 4; u++)
                for (int th = 0; th < 2; th++) {
                    const int j = 8 * h + 2 * u + th;
                    const __m128i sc = _mm_loadu_si128((const __m128i *)(p + T6K_SC(j)));
                    __m256i s2[2]; /* rows 8 r .. 8 r + 7's scale in both int16 of a lane */
                    for (int r = 0; r < 2; r++) {
                        const __m256i s = _mm256_cvtepi8_epi32(r ? _mm_srli_si128(sc, 8) : sc);
                        s2[r] = _mm256_or_si256(_mm256_and_si256(s, _mm256_set1_epi32(0xFFFF)),
                                                _mm256_slli_epi32(s, 16));
                    }
                    const uint8_t *ql = p + T6K_QL(h, 16 * (u & 1) + 8 * th);
                    const uint8_t *qh = p + T6K_QH(h, 8 * th);
                    /* Column 128 h + 32 u + 16 th + 2 t: pair 64 h + 16 u + 8 th + t. */
                    int32_t *dst = panel + (64 * h + 16 * u + 8 * th + 128 * bi - k0 / 2) * NT;
                    for (int t = 0; t < 8; t++) {
                        const __m256i v = _mm256_sub_epi8(
                            k6_bytes(load32(ql + 32 * t), load32(qh + 32 * t), u),
                            _mm256_set1_epi8(32));
                        for (int r = 0; r < 2; r++) {
                            const __m128i half = r ? _mm256_extracti128_si256(v, 1)
                                                   : _mm256_castsi256_si128(v);
                            _mm256_store_si256(
                                (__m256i *)(dst + 16 * t + 8 * r),
                                _mm256_mullo_epi16(_mm256_cvtepi8_epi16(half), s2[r]));
                        }
                    }
                }
    }
}
void gemm_i16_tile_panel(int type, const uint8_t *tile, int64_t k0, int64_t kc, int32_t *panel,
                         float *dg, float *mg) {
    if (type == T_T4K) decode_t4k_panel(tile, k0, kc, panel, dg, mg);
    else if (type == T_T6K) decode_t6k_panel(tile, k0, kc, panel, dg, mg);
    else decode_tile_panel(type, tile, k0, kc, panel, dg, mg);
}
#endif
