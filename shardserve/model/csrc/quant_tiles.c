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
 *   T4K (from Q4_K), per block of 256 columns 2304 bytes (16 x 144):
 *     nib[4][16][32] | f16 d[16] | f16 dmin[16] | u32 A[16] | u32 B[16] | u32 C[16]
 *     nib byte 512 p + 32 t + 2 r + e = row r's qs[32 p + 2 t + e]: low nibble column 2 t + e
 *     of sub-block 2 p, high nibble the same column of sub-block 2 p + 1; A, B, C: row r's
 *     12 scale bytes as three words (k4_unpack's a, b, c), unpacked for 16 rows at once;
 *     w = d sc_j q - dmin m_j as Q4_K's
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

void decode_t4k_row(const uint8_t *tile, int lane, int64_t K, row_t *r) {
    for (int64_t bi = 0; bi < K / 256; bi++) {
        const uint8_t *p = tile + T4K_BLOCK_BYTES * bi;
        uint8_t scales[12];
        for (int w = 0; w < 3; w++) memcpy(scales + 4 * w, p + 2112 + 64 * w + 4 * lane, 4);
        const float d = half_to_f32(p + 2048 + 2 * lane), dmin = half_to_f32(p + 2080 + 2 * lane);
        for (int j = 0; j < 8; j++) {
            uint8_t sc, mn;
            scale_min_k4(j, scales, &sc, &mn);
            const int64_t sub = 8 * bi + j;
            r->s[2 * sub] = r->s[2 * sub + 1] = d * (float)sc;
            r->m[2 * sub] = r->m[2 * sub + 1] = -dmin * (float)mn;
            for (int t = 0; t < 16; t++)
                for (int e = 0; e < 2; e++) {
                    const uint8_t byte = p[512 * (j / 2) + 32 * t + 2 * lane + e];
                    r->q[32 * sub + 2 * t + e] = (j & 1) ? byte >> 4 : byte & 0xF;
                }
        }
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

/* T4K: a tile's 16 outputs for NB rows of x, block by block (TYPE's tile_rows for Q4_K). */
ALWAYS_INLINE void tile_rows_k4(int NB, const uint8_t *tile, const xquant_t *xq, int64_t b0,
                                int64_t K, __m512 *res) {
    const int64_t nsub = K / 32;
    for (int i = 0; i < NB; i++) res[i] = _mm512_setzero_ps();
    for (int64_t bi = 0; bi < K / 256; bi++) {
        const uint8_t *p = tile + T4K_BLOCK_BYTES * bi;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2048)));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2080)));
        const __m512i a = _mm512_loadu_si512(p + 2112), b = _mm512_loadu_si512(p + 2176);
        const __m512i c = _mm512_loadu_si512(p + 2240);
        for (int pair = 0; pair < 4; pair++) { /* sub-blocks 2 pair (low nibbles), 2 pair + 1 */
            __m512i lo_dot[FUSED_MAX_B], hi_dot[FUSED_MAX_B];
            for (int i = 0; i < NB; i++) lo_dot[i] = hi_dot[i] = _mm512_setzero_si512();
#pragma GCC unroll 16
            for (int t = 0; t < 16; t++) {
                const __m512i v = _mm512_cvtepu8_epi16(load32(p + 512 * pair + 32 * t));
                const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi16(0xF));
                const __m512i hi = _mm512_srli_epi16(v, 4);
                for (int i = 0; i < NB; i++) {
                    const int16_t *x = xq->q + (b0 + i) * K + 256 * bi + 64 * pair + 2 * t;
                    lo_dot[i] = dot_pairs(lo_dot[i], lo, x);
                    hi_dot[i] = dot_pairs(hi_dot[i], hi, x + 32);
                }
            }
            for (int half = 0; half < 2; half++) {
                const int j = 2 * pair + half;
                const __m512 s = _mm512_mul_ps(d, k4_scale(j, 0, a, b, c));
                const __m512 m = _mm512_mul_ps(dmin, k4_scale(j, 1, a, b, c));
                for (int i = 0; i < NB; i++) {
                    const int64_t at = (b0 + i) * nsub + 8 * bi + j;
                    const __m512i dot = half ? hi_dot[i] : lo_dot[i];
                    res[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                             _mm512_mul_ps(s, _mm512_set1_ps(xq->d[at])), res[i]);
                    res[i] = _mm512_fnmadd_ps(m, _mm512_set1_ps(xq->xs32[at]), res[i]);
                }
            }
        }
    }
}

/* A tile's 16 outputs for NB rows of x from b0 (TYPE and NB constants at each call). */
ALWAYS_INLINE void tile_rows(int TYPE, int NB, const uint8_t *tile, const xquant_t *xq,
                             int64_t b0, int64_t K, __m512 *res) {
    if (TYPE == T_T4K) {
        tile_rows_k4(NB, tile, xq, b0, K, res);
        return;
    }
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
TILE_FNS(t4k, T_T4K)

int quant_tiles_simd(const uint8_t *w, int64_t row_bytes, int type, const xquant_t *xq,
                     int64_t B, int64_t N, int64_t K, void *out, int64_t out_stride,
                     int out_dtype, int threads) {
    const tile_fn *fns = type == T_T8 ? t8_fns : type == T_T4K ? t4k_fns : t4_fns;
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

/* The GEMM's panels (quant_gemm.c) from a whole tile at once. */
#if QK_SIMD && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* Columns of an 8 x 8 matrix of 16-bit values in each 128-bit lane: x[i] element j -> v[j]
 * element i (lane by lane: both lanes' matrices at once). */
static inline void transpose8x8_epi16(const __m256i *x, __m256i *v) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi16(x[2 * i], x[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi16(x[2 * i], x[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) { /* x[0..3] then x[4..7] */
        u[4 * h] = _mm256_unpacklo_epi32(t[4 * h], t[4 * h + 2]);
        u[4 * h + 1] = _mm256_unpackhi_epi32(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi32(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi32(t[4 * h + 1], t[4 * h + 3]);
    }
    for (int j = 0; j < 4; j++) {
        v[2 * j] = _mm256_unpacklo_epi64(u[j], u[4 + j]);
        v[2 * j + 1] = _mm256_unpackhi_epi64(u[j], u[4 + j]);
    }
}

/* 16 floats (w = d * q + m, or d * q) to a panel row as float32 or bfloat16. */
static inline void store16(void *row, int64_t at, __m512 v, int out_dtype) {
    if (out_dtype == DT_F32)
        _mm512_storeu_ps((float *)row + at, v);
    else
        _mm256_storeu_si256((__m256i *)((uint16_t *)row + at), f32x16_to_bf16(v));
}

/* A whole T4 / T8 tile's columns [k0, k0 + kc): row r to out + r * stride elements. A row's
 * bytes of a sub-block are one 16-bit word of each chunk, so the chunks are transposed as 8 x 8
 * blocks of words in registers (the per-row path gathers them one word at a time). */
/* 16 values (bytes' low nibbles, or high with `high`) as s * q + m to a panel row at `at`. */
static inline void store_nibbles(void *row, int64_t at, __m128i bytes, int high, float s, float m,
                                 int out_dtype) {
    const __m512i b = _mm512_cvtepu8_epi32(bytes);
    const __m512i q = high ? _mm512_srli_epi32(b, 4) : _mm512_and_si512(b, _mm512_set1_epi32(0xF));
    store16(row, at, _mm512_fmadd_ps(_mm512_set1_ps(s), _mm512_cvtepi32_ps(q), _mm512_set1_ps(m)),
            out_dtype);
}

/* T4K: blocks [k0, k0 + kc) / 256 of a tile, as decode_tile's. */
static void decode_tile_k4(const uint8_t *tile, int64_t k0, int64_t kc, void *out, int64_t stride,
                           int out_dtype) {
    const size_t es = out_dtype == DT_F32 ? 4 : 2;
    for (int64_t bi = k0 / 256; bi < (k0 + kc) / 256; bi++) {
        const uint8_t *p = tile + T4K_BLOCK_BYTES * bi;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2048)));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2080)));
        const __m512i a = _mm512_loadu_si512(p + 2112), b = _mm512_loadu_si512(p + 2176);
        const __m512i c = _mm512_loadu_si512(p + 2240);
        float s[8][16], m[8][16];
        for (int j = 0; j < 8; j++) {
            _mm512_storeu_ps(s[j], _mm512_mul_ps(d, k4_scale(j, 0, a, b, c)));
            _mm512_storeu_ps(m[j], _mm512_sub_ps(_mm512_setzero_ps(),
                                                 _mm512_mul_ps(dmin, k4_scale(j, 1, a, b, c))));
        }
        for (int pair = 0; pair < 4; pair++) {
            __m256i x[8], lo[8], hi[8]; /* words t = 0-7 (columns 0-15), 8-15 (16-31) */
            for (int t = 0; t < 8; t++) x[t] = load32(p + 512 * pair + 32 * t);
            transpose8x8_epi16(x, lo);
            for (int t = 0; t < 8; t++) x[t] = load32(p + 512 * pair + 256 + 32 * t);
            transpose8x8_epi16(x, hi);
            for (int r = 0; r < 16; r++) {
                char *row = (char *)out + (size_t)(r * stride) * es;
                const int64_t at = 256 * bi + 64 * pair - k0;
                const __m128i wa = r < 8 ? _mm256_castsi256_si128(lo[r]) : _mm256_extracti128_si256(lo[r - 8], 1);
                const __m128i wb = r < 8 ? _mm256_castsi256_si128(hi[r]) : _mm256_extracti128_si256(hi[r - 8], 1);
                for (int h = 0; h < 2; h++) { /* sub-block 2 pair + h: low nibbles, then high */
                    const float sv = s[2 * pair + h][r], mv = m[2 * pair + h][r];
                    store_nibbles(row, at + 32 * h, wa, h, sv, mv, out_dtype);
                    store_nibbles(row, at + 32 * h + 16, wb, h, sv, mv, out_dtype);
                }
            }
        }
    }
}

static void decode_tile(int type, const uint8_t *tile, int64_t k0, int64_t kc, void *out,
                        int64_t stride, int out_dtype) {
    if (type == T_T4K) {
        decode_tile_k4(tile, k0, kc, out, stride, out_dtype);
        return;
    }
    const size_t es = out_dtype == DT_F32 ? 4 : 2;
    const int t8 = type == T_T8;
    for (int64_t g = k0 / 32; g < (k0 + kc) / 32; g++) {
        const uint8_t *p = tile + (t8 ? T8_SUB_BYTES : T4_SUB_BYTES) * g;
        __m256i x[8], lo[8], hi[8]; /* lo: chunks 0-7 (T4: all), hi: T8's 8-15 */
        for (int c = 0; c < 8; c++) x[c] = load32(p + 32 * c);
        transpose8x8_epi16(x, lo);
        if (t8) {
            for (int c = 0; c < 8; c++) x[c] = load32(p + 256 + 32 * c);
            transpose8x8_epi16(x, hi);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + (t8 ? 512 : 256))));
        const __m512 m = t8 ? _mm512_setzero_ps()
                            : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 288)));
        float dr[16], mr[16];
        _mm512_storeu_ps(dr, d);
        _mm512_storeu_ps(mr, m);
        for (int r = 0; r < 16; r++) { /* lo[r % 8]'s lane r / 8 holds row r */
            char *row = (char *)out + (size_t)(r * stride) * es;
            const int64_t at = 32 * g - k0;
            const __m128i a = r < 8 ? _mm256_castsi256_si128(lo[r]) : _mm256_extracti128_si256(lo[r - 8], 1);
            const __m512 dv = _mm512_set1_ps(dr[r]);
            if (t8) {
                const __m128i b = r < 8 ? _mm256_castsi256_si128(hi[r]) : _mm256_extracti128_si256(hi[r - 8], 1);
                store16(row, at, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a))), out_dtype);
                store16(row, at + 16, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))), out_dtype);
            } else {
                const __m512i q = _mm512_cvtepu8_epi32(a), mv = _mm512_set1_epi32(0xF);
                const __m512 mm = _mm512_set1_ps(mr[r]);
                store16(row, at, _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(_mm512_and_si512(q, mv)), mm), out_dtype);
                store16(row, at + 16, _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), mm), out_dtype);
            }
        }
    }
}

int quant_decode_tile(int type, const uint8_t *tile, int64_t K, int64_t k0, int64_t kc,
                      void *out, int64_t stride, int out_dtype) {
    (void)K;
    if (!IS_TILED(type)) return 0;
    decode_tile(type, tile, k0, kc, out, stride, out_dtype);
    return 1;
}
#else
int quant_decode_tile(int type, const uint8_t *tile, int64_t K, int64_t k0, int64_t kc,
                      void *out, int64_t stride, int out_dtype) {
    (void)type, (void)tile, (void)K, (void)k0, (void)kc, (void)out, (void)stride, (void)out_dtype;
    return 0;
}
#endif
