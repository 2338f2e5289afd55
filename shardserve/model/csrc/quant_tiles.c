/*
 * Weights in tiles of 16 output rows (T4 from Q4_0 / Q4_1, T8 from Q8_0, T4K from Q4_K, T6K
 * from Q6_K, written at load by quant_retile.c where a weight's rows come in multiples of 16),
 * and their product with a few rows of x.
 *
 * Why tiles: in a row layout (R4) every sub-block of 32 weights ends in a float step per row
 * of x (its integer dot converted, then scaled by d_w * d_x): at batch 1 that is as many
 * instructions as the multiply-adds, and each more row of x pays it again. In a tile the 16
 * rows sit side by side in one vector, a row per 32-bit lane, two columns per lane:
 *
 *   tile = 16 rows x K columns, per sub-block g of 32 columns 320 bytes:
 *     f16 d[16] | f16 m[16] | nib[8][32]        (w[r][k] = d[r] * q[r][k] + m[r], as R4)
 *     nib byte 32 c + 2 r + e:  low nibble q[r][32 g + 2 c + e], high q[r][32 g + 16 + 2 c + e]
 *
 *   (that byte is qs[2 c + e] of row r's Q4_0 / Q4_1 block g: the repack only moves bytes)
 *
 *   T8, per sub-block 544 bytes:  f16 d[16] | i8 q[16][32]     (w[r][k] = d[r] * q[r][k])
 *     q byte 32 p + 2 r + e = q[r][32 g + 2 p + e]            (Q8_0's qs, moved)
 *
 *   T4K (from Q4_K), per block of 256 columns 2304 bytes (16 x 144), in the order read:
 *     f16 d[16] | f16 dmin[16] | u32 A[16] | u32 B[16] | u32 C[16] | nib[4][16][32]
 *     nib byte 512 p + 32 t + 2 r + e = row r's qs[32 p + 2 t + e]: low nibble column 2 t + e
 *     of sub-block 2 p, high nibble the same column of sub-block 2 p + 1; A, B, C: row r's
 *     12 scale bytes as three words (k4_unpack's a, b, c), unpacked for 16 rows at once;
 *     w = d sc_j q - dmin m_j as Q4_K's
 *
 *   (Every tile's scales come first: read in the order stored, a block streams from memory
 *   ~1.3x as fast as with its scales at its end, the prefetchers follow it.)
 *
 *   T6K (from Q6_K), per block of 256 columns 3360 bytes (16 x 210), in the order read:
 *     f16 d[16] | i8 sc[16][16] | per half h, words 8 th .. 8 th + 7 (th = 0, 1):
 *       ql words t | qh words t | ql words 16 + t           (each [16 rows x 2 bytes])
 *     ql word c byte 2 r + e = row r's ql[64 h + 2 c + e], qh word t its qh[32 h + 2 t + e];
 *     column 128 h + 32 u + 2 t + e (quarter u) is ql word 16 (u & 1) + t, low nibble (u < 2)
 *     or high, with qh's bits 2u, 2u + 1 above: q in 0..63, w = d sc_j (q - 32), j = column
 *     / 16; the scales in the kernel's order (h, th, u) (quant_blocks.h: T6K_SC, T6K_QL, ...)
 *
 * so a chunk c widened to 16-bit lanes holds, in lane r, row r's pair of columns (2 c, 2 c + 1)
 * (low nibbles) or (16 + 2 c, 17 + 2 c) (high), and one vpdpwssd (VNNI; vpmaddwd + vpaddd
 * without) with x's pair broadcast adds both products for all 16 rows. Per sub-block and row
 * of x the float step is then one conversion and two FMAs for 16 weight rows together. Integer
 * sums per lane: 32 products of <= 128 * 32767, far inside int32.
 *
 * AVX-512 builds tile every type here; AVX2 builds too (quant_tiles_avx2.c and, for T6K,
 * quant_tiles_k6_avx2.c; their int16 GEMM quant_gemm_i16.c); the others compute tiles through
 * the row decode below (the tests do). quant_tile_panels.c decodes tiles for the float GEMM.
 */
#include <omp.h>

#include "quant_blocks.h"

/* One row's sub-blocks out of its tile, for the portable paths (decode_row_at). */
static void decode_t4_row(const uint8_t *tile, int lane, int64_t K, row_t *r) {
    for (int64_t g = 0; g < K / 32; g++) {
        const uint8_t *p = tile + T4_SUB_BYTES * g;
        uint8_t *q = r->q + 32 * g;
        for (int c = 0; c < 8; c++)
            for (int e = 0; e < 2; e++) {
                const uint8_t byte = p[T4_Q + 32 * c + 2 * lane + e];
                q[2 * c + e] = byte & 0xF;
                q[16 + 2 * c + e] = byte >> 4;
            }
        const float d = half_to_f32(p + 2 * lane), m = half_to_f32(p + 32 + 2 * lane);
        r->s[2 * g] = r->s[2 * g + 1] = d;
        r->m[2 * g] = r->m[2 * g + 1] = m;
    }
}

static void decode_t4k_row(const uint8_t *tile, int lane, int64_t K, row_t *r) {
    for (int64_t bi = 0; bi < K / 256; bi++) {
        const uint8_t *p = tile + T4K_BLOCK_BYTES * bi;
        uint8_t scales[12];
        for (int w = 0; w < 3; w++) memcpy(scales + 4 * w, p + 64 + 64 * w + 4 * lane, 4);
        const float d = half_to_f32(p + 2 * lane), dmin = half_to_f32(p + 32 + 2 * lane);
        for (int j = 0; j < 8; j++) {
            uint8_t sc, mn;
            scale_min_k4(j, scales, &sc, &mn);
            const int64_t sub = 8 * bi + j;
            r->s[2 * sub] = r->s[2 * sub + 1] = d * (float)sc;
            r->m[2 * sub] = r->m[2 * sub + 1] = -dmin * (float)mn;
            for (int t = 0; t < 16; t++)
                for (int e = 0; e < 2; e++) {
                    const uint8_t byte = p[T4K_NIB + 512 * (j / 2) + 32 * t + 2 * lane + e];
                    r->q[32 * sub + 2 * t + e] = (j & 1) ? byte >> 4 : byte & 0xF;
                }
        }
    }
}

static void decode_t6k_row(const uint8_t *tile, int lane, int64_t K, row_t *r) {
    for (int64_t bi = 0; bi < K / 256; bi++) {
        const uint8_t *p = tile + T6K_BLOCK_BYTES * bi;
        const float d = half_to_f32(p + 2 * lane);
        for (int j = 0; j < 16; j++) {
            r->s[16 * bi + j] = d * (float)(int8_t)p[T6K_SC(j) + lane];
            r->m[16 * bi + j] = -32.f * r->s[16 * bi + j];
        }
        for (int col = 0; col < 256; col++) {
            const int h = col / 128, u = col % 128 / 32, l = col % 32, t = l / 2, e = l % 2;
            const uint8_t ql = p[T6K_QL(h, 16 * (u & 1) + t) + 2 * lane + e];
            const uint8_t qh = p[T6K_QH(h, t) + 2 * lane + e];
            r->q[256 * bi + col] = (u < 2 ? ql & 0xF : ql >> 4) | ((qh >> (2 * u)) & 3) << 4;
        }
    }
}

static void decode_t8_row(const uint8_t *tile, int lane, int64_t K, row_t *r) {
    for (int64_t g = 0; g < K / 32; g++) {
        const uint8_t *p = tile + T8_SUB_BYTES * g;
        for (int pair = 0; pair < 16; pair++)
            memcpy(r->q + 32 * g + 2 * pair, p + T8_Q + 32 * pair + 2 * lane, 2);
        r->s[2 * g] = r->s[2 * g + 1] = half_to_f32(p + 2 * lane);
        r->m[2 * g] = r->m[2 * g + 1] = 0.f;
    }
}

void decode_tile_row(int type, const uint8_t *tile, int lane, int64_t K, row_t *r) {
    if (type == T_T4K)
        decode_t4k_row(tile, lane, K, r);
    else if (type == T_T6K)
        decode_t6k_row(tile, lane, K, r);
    else if (type == T_T8)
        decode_t8_row(tile, lane, K, r);
    else
        decode_t4_row(tile, lane, K, r);
}

#if QK_SIMD && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
/*
 * A tile's 16 rows as 16 lanes of int32 and of float, in one register. (An AVX2 build with two
 * registers a tile measured no faster than its row kernels: without VNNI and embedded
 * broadcasts a pair of columns costs a broadcast, two vpmaddwd and two vpaddd for 16 rows, as
 * many instructions as the row kernels' multiply-adds, and 8 rows of x spill its 16
 * registers.)
 */
/* T6K blocks ahead whose lines a block's kernel prefetches (a quarter-KB each step of 16): its
 * reads within a block jump between ql and qh parts, and from memory (1 row of x, 20 distinct
 * 8192 x 2048 weights, 2 threads, Zen 4) it streamed 26-33 GB/s where T4K streams 31-50;
 * prefetching 2 blocks ahead: 1.18-1.27x (1 block 1.13x, 4 1.15x), the 1B model's batch-1
 * step 1.08x. T4K's sequential reads lost 0.9x with the same prefetch: it has none. */
#ifndef TILE_PREFETCH
#define TILE_PREFETCH 2
#endif
/* T4K and T4 tiles read front to back, a line prefetched 2 KB ahead every 64 bytes: 1 row of
 * x from memory (6 distinct 1B-shaped weights, 2 threads, Sapphire Rapids) T4K 1.32-1.45x,
 * 4 rows 1.26x, 1 KB and 4 KB ahead alike; T4 at the default model's shapes 1.13-1.31x. (On
 * Zen 4 T4K lost 0.9x with T6K's prefetch of whole blocks 2 ahead: not measured there with
 * this one yet.) 0 turns it off. */
#ifndef NIBBLE_PREFETCH
#define NIBBLE_PREFETCH 2048
#endif
typedef __m512i ivec;
typedef __m512 fvec;
static inline ivec i_zero(void) { return _mm512_setzero_si512(); }
static inline ivec i_u8(const uint8_t *p) { return _mm512_cvtepu8_epi16(load32(p)); }
static inline ivec i_s8(const uint8_t *p) { return _mm512_cvtepi8_epi16(load32(p)); }
static inline ivec i_low4(ivec v) { return _mm512_and_si512(v, _mm512_set1_epi16(0xF)); }
static inline ivec i_high4(ivec v) { return _mm512_srli_epi16(v, 4); }
static inline ivec i_words(const uint8_t *p) { return _mm512_loadu_si512(p); }
ALWAYS_INLINE ivec dot_pairs(ivec acc, ivec w, const int16_t *x) {
    int32_t pair;
    memcpy(&pair, x, 4);
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(pair));
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, _mm512_set1_epi32(pair)));
#endif
}
static inline fvec f_zero(void) { return _mm512_setzero_ps(); }
static inline fvec f_set1(float v) { return _mm512_set1_ps(v); }
static inline fvec f_cvt(ivec v) { return _mm512_cvtepi32_ps(v); }
static inline fvec f_mul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
static inline fvec f_fmadd(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
static inline fvec f_fnmadd(fvec a, fvec b, fvec c) { return _mm512_fnmadd_ps(a, b, c); }
static inline fvec f_halves(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline void f_store(float *out, fvec v) { _mm512_storeu_ps(out, v); }

/* Sub-block g's integer dots of a T4 / T8 tile with NB rows of x from b0. */
ALWAYS_INLINE void tile_dots(int TYPE, int NB, const uint8_t *p, const xquant_t *xq, int64_t b0,
                             int64_t K, int64_t g, ivec *dot) {
    for (int i = 0; i < NB; i++) dot[i] = i_zero();
    if (TYPE == T_T8) {
#pragma GCC unroll 16
        for (int pair = 0; pair < 16; pair++) {
            const ivec v = i_s8(p + T8_Q + 32 * pair);
            for (int i = 0; i < NB; i++)
                dot[i] = dot_pairs(dot[i], v, xq->q + (b0 + i) * K + 32 * g + 2 * pair);
        }
        return;
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        if (NIBBLE_PREFETCH && c % 2 == 0)
            __builtin_prefetch(p + T4_Q + 32 * c + NIBBLE_PREFETCH, 0, 3);
        const ivec v = i_u8(p + T4_Q + 32 * c), lo = i_low4(v), hi = i_high4(v);
        for (int i = 0; i < NB; i++) {
            const int16_t *x = xq->q + (b0 + i) * K + 32 * g + 2 * c;
            dot[i] = dot_pairs(dot_pairs(dot[i], lo, x), hi, x + 16);
        }
    }
}

/* T4K: a tile's 16 outputs for NB rows of x, block by block (tile_rows for Q4_K). */
ALWAYS_INLINE void tile_rows_k4(int NB, const uint8_t *tile, const xquant_t *xq, int64_t b0,
                                int64_t K, fvec *res) {
    const int64_t nsub = K / 32;
    for (int i = 0; i < NB; i++) res[i] = f_zero();
    for (int64_t bi = 0; bi < K / 256; bi++) {
        const uint8_t *p = tile + T4K_BLOCK_BYTES * bi;
        const fvec d = f_halves(p), dmin = f_halves(p + 32);
        const ivec a = i_words(p + 64), b = i_words(p + 128), c = i_words(p + 192);
        for (int pair = 0; pair < 4; pair++) { /* sub-blocks 2 pair (low nibbles), 2 pair + 1 */
            ivec lo_dot[FUSED_MAX_B], hi_dot[FUSED_MAX_B];
            for (int i = 0; i < NB; i++) lo_dot[i] = hi_dot[i] = i_zero();
#pragma GCC unroll 16
            for (int t = 0; t < 16; t++) {
                if (NIBBLE_PREFETCH && t % 2 == 0)
                    __builtin_prefetch(p + T4K_NIB + 512 * pair + 32 * t + NIBBLE_PREFETCH, 0, 3);
                const ivec v = i_u8(p + T4K_NIB + 512 * pair + 32 * t);
                const ivec lo = i_low4(v), hi = i_high4(v);
                for (int i = 0; i < NB; i++) {
                    const int16_t *x = xq->q + (b0 + i) * K + 256 * bi + 64 * pair + 2 * t;
                    lo_dot[i] = dot_pairs(lo_dot[i], lo, x);
                    hi_dot[i] = dot_pairs(hi_dot[i], hi, x + 32);
                }
            }
            for (int half = 0; half < 2; half++) {
                const int j = 2 * pair + half;
                const fvec s = f_mul(d, k4_scale(j, 0, a, b, c));
                const fvec m = f_mul(dmin, k4_scale(j, 1, a, b, c));
                for (int i = 0; i < NB; i++) {
                    const int64_t at = (b0 + i) * nsub + 8 * bi + j;
                    const fvec sx = f_mul(s, f_set1(xq->d[at]));
                    res[i] = f_fmadd(f_cvt(half ? hi_dot[i] : lo_dot[i]), sx, res[i]);
                    res[i] = f_fnmadd(m, f_set1(xq->xs32[at]), res[i]);
                }
            }
        }
    }
}

/* T6K's 16 rows of words t and t + 1 of quarter u, widened to 16 bits (w[0], w[1]); combined
 * as bytes, both words in one register: a quarter of the work of 16-bit lanes. */
ALWAYS_INLINE void k6_words2(const uint8_t *ql, const uint8_t *qh, int u, ivec *w) {
    const __m512i l = _mm512_loadu_si512(ql), h = _mm512_loadu_si512(qh);
    const __m512i nib = _mm512_and_si512(u < 2 ? l : _mm512_srli_epi16(l, 4), _mm512_set1_epi8(0xF));
    const __m512i top = u == 0 ? _mm512_slli_epi16(h, 4) : u == 1 ? _mm512_slli_epi16(h, 2)
                      : u == 2 ? h : _mm512_srli_epi16(h, 2);
    const __m512i v = _mm512_ternarylogic_epi32(nib, top, _mm512_set1_epi8(0x30), 0xF8);
    w[0] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(v));
    w[1] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(v, 1));
}

/* T6K: a tile's 16 outputs for NB rows of x, 16 columns (a scale) at a time; q's -32 through
 * x's sums per 16 (xs). */
ALWAYS_INLINE void tile_rows_k6(int NB, const uint8_t *tile, const xquant_t *xq, int64_t b0,
                                int64_t K, fvec *res) {
    const int64_t nsub = K / 32, nhalf = K / 16;
    for (int i = 0; i < NB; i++) res[i] = f_zero();
    for (int64_t bi = 0; bi < K / 256; bi++) {
        const uint8_t *p = tile + T6K_BLOCK_BYTES * bi;
        const fvec d = f_halves(p);
        for (int hu = 0; hu < 16; hu++) { /* half h, words 8 th .. 8 th + 7, quarter u */
            const int h = hu / 8, th = hu % 8 / 4, u = hu % 4, j = 8 * h + 2 * u + th;
            for (int l = 0; l < 4; l++)
                __builtin_prefetch(p + TILE_PREFETCH * T6K_BLOCK_BYTES + 256 * hu + 64 * l, 0, 3);
            const uint8_t *ql = p + T6K_QL(h, 16 * (u & 1) + 8 * th);
            const uint8_t *qh = p + T6K_QH(h, 8 * th);
            /* Few rows of x: two chains of dots a row (one would wait on VNNI's latency). */
            ivec dot[FUSED_MAX_B], odd[FUSED_MAX_B];
            for (int i = 0; i < NB; i++) dot[i] = odd[i] = i_zero();
#pragma GCC unroll 4
            for (int t = 0; t < 8; t += 2) {
                ivec w[2];
                k6_words2(ql + 32 * t, qh + 32 * t, u, w);
                for (int i = 0; i < NB; i++) {
                    const int16_t *x = xq->q + (b0 + i) * K + 256 * bi + 16 * j + 2 * t;
                    if (NB <= 4) {
                        dot[i] = dot_pairs(dot[i], w[0], x);
                        odd[i] = dot_pairs(odd[i], w[1], x + 2);
                    } else {
                        dot[i] = dot_pairs(dot_pairs(dot[i], w[0], x), w[1], x + 2);
                    }
                }
            }
            if (NB <= 4)
                for (int i = 0; i < NB; i++) dot[i] = _mm512_add_epi32(dot[i], odd[i]);
            const fvec s = f_mul(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                        _mm_loadu_si128((const __m128i *)(p + T6K_SC(j))))));
            const fvec m = f_mul(s, f_set1(-32.f));
            for (int i = 0; i < NB; i++) {
                const int64_t at = (b0 + i) * nsub + 8 * bi + j / 2;
                res[i] = f_fmadd(f_cvt(dot[i]), f_mul(s, f_set1(xq->d[at])), res[i]);
                res[i] = f_fmadd(m, f_set1(xq->xs[(b0 + i) * nhalf + 16 * bi + j]), res[i]);
            }
        }
    }
}

/* A tile's 16 outputs for NB rows of x from b0 (TYPE and NB constants at each call). */
ALWAYS_INLINE void tile_rows(int TYPE, int NB, const uint8_t *tile, const xquant_t *xq,
                             int64_t b0, int64_t K, fvec *res) {
    if (TYPE == T_T4K) {
        tile_rows_k4(NB, tile, xq, b0, K, res);
        return;
    }
    if (TYPE == T_T6K) {
        tile_rows_k6(NB, tile, xq, b0, K, res);
        return;
    }
    const int64_t nsub = K / 32;
    for (int i = 0; i < NB; i++) res[i] = f_zero();
    for (int64_t g = 0; g < nsub; g++) {
        const uint8_t *p = tile + (TYPE == T_T8 ? T8_SUB_BYTES : T4_SUB_BYTES) * g;
        ivec dot[FUSED_MAX_B];
        tile_dots(TYPE, NB, p, xq, b0, K, g, dot);
        const fvec d = f_halves(p);
        for (int i = 0; i < NB; i++) {
            const int64_t at = (b0 + i) * nsub + g;
            res[i] = f_fmadd(f_cvt(dot[i]), f_mul(d, f_set1(xq->d[at])), res[i]);
            if (TYPE == T_T4)
                res[i] = f_fmadd(f_halves(p + 32), f_set1(xq->xs32[at]), res[i]);
        }
    }
}

typedef void (*tile_fn)(const uint8_t *tile, const xquant_t *xq, int64_t b0, int64_t n0,
                        int64_t K, void *out, int64_t out_stride, int out_dtype);

#define TILE_FN(NAME, T, NB)                                                              \
    static void NAME##_##NB(const uint8_t *tile, const xquant_t *xq, int64_t b0, int64_t n0,  \
                            int64_t K, void *out, int64_t out_stride, int out_dtype) {     \
        fvec res[NB];                                                                     \
        tile_rows(T, NB, tile, xq, b0, K, res);                                           \
        for (int i = 0; i < NB; i++) {                                                    \
            float v[16];                                                                  \
            f_store(v, res[i]);                                                           \
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
TILE_FNS(t6k, T_T6K)

int quant_can_tile(void) { return 1; }

int quant_tile_takes(int ggml_type) {
    return ggml_type == T_Q4_0 || ggml_type == T_Q4_1 || ggml_type == T_Q8_0 ||
           ggml_type == T_Q4_K || ggml_type == T_Q6_K;
}

int quant_tiles_simd(const uint8_t *w, int64_t row_bytes, int type, const xquant_t *xq,
                     int64_t B, int64_t N, int64_t K, void *out, int64_t out_stride,
                     int out_dtype, int threads) {
    const tile_fn *fns = type == T_T8    ? t8_fns
                         : type == T_T4K ? t4k_fns
                         : type == T_T6K ? t6k_fns
                                         : t4_fns;
    const int64_t tiles = N / 16;
#pragma omp parallel for num_threads(threads) schedule(guided)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t b0 = 0; b0 < B; b0 += FUSED_MAX_B) {
            const int64_t nb = B - b0 < FUSED_MAX_B ? B - b0 : FUSED_MAX_B;
            fns[nb - 1](w + 16 * t * row_bytes, xq, b0, 16 * t, K, out, out_stride, out_dtype);
        }
    }
    return 1;
}
#else
/* Builds without AVX-512: AVX2 ones tile Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K (quant_tiles_avx2.c),
 * others nothing. */
int quant_can_tile(void) { return 0; }

int quant_tile_takes(int ggml_type) { return quant_tiles_avx2_takes(ggml_type); }

int quant_tiles_simd(const uint8_t *w, int64_t row_bytes, int type, const xquant_t *xq,
                     int64_t B, int64_t N, int64_t K, void *out, int64_t out_stride,
                     int out_dtype, int threads) {
    return quant_tiles_avx2(w, row_bytes, type, xq, B, N, K, out, out_stride, out_dtype,
                            threads);
}
#endif
