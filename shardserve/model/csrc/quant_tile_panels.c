/*
 * The GEMM's panels (quant_gemm.c) decoded from a whole tile at once (quant_tiles.c draws the
 * T4 / T8 / T4K / T6K layouts): a row's bytes of a sub-block are one 16-bit word of each chunk, so
 * the chunks are transposed as 8 x 8 blocks of words in registers (row by row they would be
 * gathered a word at a time), then 16 values at a time are written as w = s * q + m in one
 * fused rounding, float32 or bfloat16. AVX-512 builds (those that tile every type); AVX2 builds
 * decode their tiles into int16 panels (quant_gemm_i16.c), the others row by row
 * (quant_decode.c).
 */
#include "quant_blocks.h"

#if QK_SIMD && defined(__AVX512F__)
/* Row r's 16 bytes of the transposed words (lane r / 8 of v[r % 8]). */
static inline __m128i row_bytes16(const __m256i *v, int r) {
    return r < 8 ? _mm256_castsi256_si128(v[r]) : _mm256_extracti128_si256(v[r - 8], 1);
}

enum { LOW4, HIGH4, SIGNED8, UNSIGNED8 };

/* 16 values from 16 bytes (their low or high nibbles, or the signed bytes) as s * q + m to a
 * panel row at element `at`. */
static inline void emit16(void *row, int64_t at, __m128i bytes, int kind, float s, float m,
                          int out_dtype) {
    __m512i q = kind == SIGNED8 ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
    /* UNSIGNED8: the bytes as they are */
    if (kind == HIGH4) q = _mm512_srli_epi32(q, 4);
    if (kind == LOW4) q = _mm512_and_si512(q, _mm512_set1_epi32(0xF));
    const __m512 v = _mm512_fmadd_ps(_mm512_set1_ps(s), _mm512_cvtepi32_ps(q), _mm512_set1_ps(m));
    if (out_dtype == DT_F32)
        _mm512_storeu_ps((float *)row + at, v);
    else
        _mm256_storeu_si256((__m256i *)((uint16_t *)row + at), f32x16_to_bf16(v));
}

/* The words of 8 chunks 32 bytes apart from p, transposed: row r's 16 bytes. */
static inline void load_transposed(const uint8_t *p, __m256i *v) {
    __m256i x[8];
    for (int c = 0; c < 8; c++) x[c] = load32(p + 32 * c);
    transpose8x8_epi16(x, v);
}

#if defined(__AVX512BW__)
/* bfloat16 panels (the AMX GEMM's, quant_gemm_amx.c) from 4-bit values by table: two
 * sub-blocks' 16 possible values s q + m each, computed once (rounded as emit16 rounds them)
 * into one vector's lower and upper halves, then each 32 nibbles one vpermw: ~0.25
 * instructions a weight against emit16's ~0.55. */
static inline __m512i bf16_tables(float s0, float m0, float s1, float m1) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 t0 = _mm512_fmadd_ps(_mm512_set1_ps(s0), q, _mm512_set1_ps(m0));
    const __m512 t1 = _mm512_fmadd_ps(_mm512_set1_ps(s1), q, _mm512_set1_ps(m1));
#if defined(__AVX512BF16__)
    return (__m512i)_mm512_cvtne2ps_pbh(t1, t0); /* t0 in the lower half */
#else
    return _mm512_inserti64x4(_mm512_castsi256_si512(f32x16_to_bf16(t0)), f32x16_to_bf16(t1), 1);
#endif
}

/* A row's 32 bytes (columns 0-15 in b0, 16-31 in b1): low nibbles sub-block (s0, m0) to
 * out[0 .. 32), high nibbles sub-block (s1, m1) to out[32 .. 64) (indices 16-31). */
static inline void emit64_bf16(uint16_t *out, __m128i b0, __m128i b1, float s0, float m0,
                               float s1, float m1) {
    const __m512i w =
        _mm512_cvtepu8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(b0), b1, 1));
    const __m512i lo = _mm512_and_si512(w, _mm512_set1_epi16(0xF));
    const __m512i hi = _mm512_or_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi16(16));
    const __m512i t = bf16_tables(s0, m0, s1, m1);
    _mm512_storeu_si512(out, _mm512_permutexvar_epi16(lo, t));
    _mm512_storeu_si512(out + 32, _mm512_permutexvar_epi16(hi, t));
}
#define TABLE_BF16 1
#else
#define TABLE_BF16 0
#endif

/* T4K: blocks [k0, k0 + kc) / 256 of a tile's rows [r0, r1); s = d sc_j, m = -dmin m_j. */
static void decode_tile_k4(const uint8_t *tile, int r0, int r1, int64_t k0, int64_t kc, void *out,
                           int64_t stride, int out_dtype) {
    const size_t es = out_dtype == DT_F32 ? 4 : 2;
    for (int64_t bi = k0 / 256; bi < (k0 + kc) / 256; bi++) {
        const uint8_t *p = tile + T4K_BLOCK_BYTES * bi;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
        const __m512i a = _mm512_loadu_si512(p + 64), b = _mm512_loadu_si512(p + 128);
        const __m512i c = _mm512_loadu_si512(p + 192);
        float s[8][16], m[8][16];
        for (int j = 0; j < 8; j++) {
            _mm512_storeu_ps(s[j], _mm512_mul_ps(d, k4_scale(j, 0, a, b, c)));
            _mm512_storeu_ps(m[j], _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), dmin),
                                                 k4_scale(j, 1, a, b, c)));
        }
        for (int pair = 0; pair < 4; pair++) {
            __m256i lo[8], hi[8]; /* words t = 0-7 (columns 0-15), 8-15 (16-31) */
            load_transposed(p + T4K_NIB + 512 * pair, lo);
            load_transposed(p + T4K_NIB + 512 * pair + 256, hi);
            for (int r = r0; r < r1; r++) {
                char *row = (char *)out + (size_t)((r - r0) * stride) * es;
                const int64_t at = 256 * bi + 64 * pair - k0;
#if TABLE_BF16
                if (out_dtype == DT_BF16) {
                    emit64_bf16((uint16_t *)row + at, row_bytes16(lo, r), row_bytes16(hi, r),
                                s[2 * pair][r], m[2 * pair][r], s[2 * pair + 1][r],
                                m[2 * pair + 1][r]);
                    continue;
                }
#endif
                for (int h = 0; h < 2; h++) { /* sub-block 2 pair + h: low nibbles, then high */
                    const int kind = h ? HIGH4 : LOW4, j = 2 * pair + h;
                    emit16(row, at + 32 * h, row_bytes16(lo, r), kind, s[j][r], m[j][r], out_dtype);
                    emit16(row, at + 32 * h + 16, row_bytes16(hi, r), kind, s[j][r], m[j][r], out_dtype);
                }
            }
        }
    }
}

/* T6K: blocks [k0, k0 + kc) / 256 of a tile's rows [r0, r1); s = d sc_j, m = -32 s. */
static void decode_tile_k6(const uint8_t *tile, int r0, int r1, int64_t k0, int64_t kc, void *out,
                           int64_t stride, int out_dtype) {
    const size_t es = out_dtype == DT_F32 ? 4 : 2;
    for (int64_t bi = k0 / 256; bi < (k0 + kc) / 256; bi++) {
        const uint8_t *p = tile + T6K_BLOCK_BYTES * bi;
        for (int h = 0; h < 2; h++)
            for (int half = 0; half < 2; half++) { /* words 8 half .. 8 half + 7: l in 16 half + */
                __m256i a[8], b[8], hi[8];
                load_transposed(p + T6K_QL(h, 8 * half), a);
                load_transposed(p + T6K_QL(h, 16 + 8 * half), b);
                load_transposed(p + T6K_QH(h, 8 * half), hi);
                for (int r = r0; r < r1; r++) {
                    char *row = (char *)out + (size_t)((r - r0) * stride) * es;
                    const float d = half_to_f32(p + 2 * r);
                    /* ql's bytes of the low quarters, then the high ones', and qh's */
                    const __m256i ql[2] = {_mm256_castsi128_si256(row_bytes16(a, r)),
                                           _mm256_castsi128_si256(row_bytes16(b, r))};
                    const __m256i qh = _mm256_castsi128_si256(row_bytes16(hi, r));
                    for (int u = 0; u < 4; u++) {
                        const int j = 8 * h + 2 * u + half;
                        const float s = d * (float)(int8_t)p[T6K_SC(j) + r];
                        const __m128i q = _mm256_castsi256_si128(k6_bytes(ql[u & 1], qh, u));
                        emit16(row, 256 * bi + 16 * j - k0, q, UNSIGNED8, s, -32.f * s, out_dtype);
                    }
                }
            }
    }
}

/* T4 / T8: sub-blocks [k0, k0 + kc) / 32 of a tile's rows [r0, r1). */
static void decode_tile_32(int type, const uint8_t *tile, int r0, int r1, int64_t k0, int64_t kc,
                           void *out, int64_t stride, int out_dtype) {
    const size_t es = out_dtype == DT_F32 ? 4 : 2;
    const int t8 = type == T_T8;
    for (int64_t g = k0 / 32; g < (k0 + kc) / 32; g++) {
        const uint8_t *p = tile + (t8 ? T8_SUB_BYTES : T4_SUB_BYTES) * g;
        __m256i lo[8], hi[8]; /* T4: chunks 0-7; T8: pairs 0-7, then 8-15 */
        load_transposed(p + (t8 ? T8_Q : T4_Q), lo);
        if (t8) load_transposed(p + T8_Q + 256, hi);
        for (int r = r0; r < r1; r++) {
            char *row = (char *)out + (size_t)((r - r0) * stride) * es;
            const int64_t at = 32 * g - k0;
            const float d = half_to_f32(p + 2 * r);
            if (t8) {
                emit16(row, at, row_bytes16(lo, r), SIGNED8, d, 0.f, out_dtype);
                emit16(row, at + 16, row_bytes16(hi, r), SIGNED8, d, 0.f, out_dtype);
            } else {
                const float m = half_to_f32(p + 32 + 2 * r);
                emit16(row, at, row_bytes16(lo, r), LOW4, d, m, out_dtype);
                emit16(row, at + 16, row_bytes16(lo, r), HIGH4, d, m, out_dtype);
            }
        }
    }
}

int quant_decode_tile(int type, const uint8_t *tile, int r0, int r1, int64_t k0, int64_t kc,
                      void *out, int64_t stride, int out_dtype) {
    if (type == T_T4K)
        decode_tile_k4(tile, r0, r1, k0, kc, out, stride, out_dtype);
    else if (type == T_T6K)
        decode_tile_k6(tile, r0, r1, k0, kc, out, stride, out_dtype);
    else if (type == T_T4 || type == T_T8)
        decode_tile_32(type, tile, r0, r1, k0, kc, out, stride, out_dtype);
    else
        return 0;
    return 1;
}
#else
int quant_decode_tile(int type, const uint8_t *tile, int r0, int r1, int64_t k0, int64_t kc,
                      void *out, int64_t stride, int out_dtype) {
    (void)type, (void)tile, (void)r0, (void)r1, (void)k0, (void)kc, (void)out, (void)stride,
        (void)out_dtype;
    return 0;
}
#endif

/* A tiled weight's rows [n0, n0 + nt) from the tiles of 16 they lie in, each tile's rows at
 * once, row n0 + i to panel + i * ps elements; 0 where this build cannot. */
int quant_decode_tiled_panel(int type, const uint8_t *w, int64_t row_bytes, int64_t n0,
                             int64_t nt, int64_t k0, int64_t kc, void *panel, int64_t ps,
                             int out_dtype) {
    const size_t es = out_dtype == DT_F32 ? 4 : 2;
    for (int64_t t = n0 / 16; t * 16 < n0 + nt; t++) {
        const int64_t first = t * 16 > n0 ? t * 16 : n0;
        const int64_t end = t * 16 + 16 < n0 + nt ? t * 16 + 16 : n0 + nt;
        if (!quant_decode_tile(type, w + 16 * t * row_bytes, (int)(first - 16 * t),
                               (int)(end - 16 * t), k0, kc,
                               (char *)panel + (size_t)((first - n0) * ps) * es, ps, out_dtype))
            return 0;
    }
    return 1;
}
