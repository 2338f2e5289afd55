/*
 * Weight rows decoded to float32 or bfloat16 for the batched GEMM's panels (quant_gemm.c):
 * quant_decode_chunk. With many rows of x the GEMM pays the decode once per weight and the
 * multiply-adds once per weight and row, so at 8-32 rows the decode is most of a K-quant
 * product's time: each sub-block of 32 is decoded in registers (fused_sub), its block's scales
 * unpacked as vectors, and w = s * q + m computed 16 (AVX-512) or 8 (AVX2) at a time in one
 * fused rounding; bfloat16 is rounded to nearest even. Without AVX2 the portable decode_row.
 */
#include "quant_blocks.h"

#if QK_SIMD

/* One weight row of K elements as float32 / bfloat16 (s * q + m in one fused rounding). */
ALWAYS_INLINE void fast_dequant_row(int TYPE, const uint8_t *row, int64_t K, void *out,
                                    int out_dtype) {
    const int elems = (TYPE == T_Q4_K || TYPE == T_Q5_K || TYPE == T_Q6_K) ? 256 : 32;
    const int bytes = TYPE == T_Q4_0 ? 18 : TYPE == T_Q4_1 ? 20 : TYPE == T_Q8_0 ? 34
                    : TYPE == T_Q4_K ? 144 : TYPE == T_Q5_K ? 176 : 210;
    float k_s[16], k_m[8];
    for (int64_t blk_i = 0; blk_i < K / elems; blk_i++) {
        const uint8_t *blk = row + blk_i * bytes;
        fused_block_scales(TYPE, blk, k_s, k_m);
        for (int j = 0; j < elems / 32; j++) {
            const int64_t base = (blk_i * (elems / 32) + j) * 32;
            float s[2], m[2];
            const __m256i w = fused_sub(TYPE, blk, j, k_s, k_m, s, m);
#if defined(__AVX512F__)
            for (int g = 0; g < 2; g++) { /* a half of 16 values: one scale, one offset */
                const __m128i part = g ? _mm256_extracti128_si256(w, 1) : _mm256_castsi256_si128(w);
                const __m512i ints = TYPE == T_Q8_0 ? _mm512_cvtepi8_epi32(part)
                                                    : _mm512_cvtepu8_epi32(part);
                const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), _mm512_set1_ps(s[g]),
                                                 _mm512_set1_ps(m[g]));
                if (out_dtype == DT_F32)
                    _mm512_storeu_ps((float *)out + base + 16 * g, v);
                else
                    _mm256_storeu_si256((__m256i *)((uint16_t *)out + base + 16 * g),
                                        f32x16_to_bf16(v));
            }
#else
            for (int g = 0; g < 4; g++) {
                const __m128i part = g < 2 ? _mm256_castsi256_si128(w) : _mm256_extracti128_si256(w, 1);
                const __m128i bytes8 = (g & 1) ? _mm_srli_si128(part, 8) : part;
                const __m256i ints = TYPE == T_Q8_0 ? _mm256_cvtepi8_epi32(bytes8)
                                                    : _mm256_cvtepu8_epi32(bytes8);
                const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), _mm256_set1_ps(s[g / 2]),
                                                 _mm256_set1_ps(m[g / 2]));
                if (out_dtype == DT_F32)
                    _mm256_storeu_ps((float *)out + base + 8 * g, v);
                else
                    _mm_storeu_si128((__m128i *)((uint16_t *)out + base + 8 * g), f32x8_to_bf16(v));
            }
#endif
        }
    }
}

#endif

/* Blocks [k0, k0 + kc) of a row into r: a GGML row's through decode_row, a tiled one's (row:
 * its tile, `lane` its row there) through its tile's row decode. */
static void decode_part(int type, const uint8_t *row, int lane, int64_t k0, int64_t kc,
                        row_t *r) {
    int elems = 32, bytes = 0;
    block_shape(type, &elems, &bytes);
    if (IS_TILED(type)) /* a tile holds 16 rows' blocks */
        decode_tile_row(type, row + k0 / elems * 16 * bytes, lane, kc, r);
    else
        decode_row(row + k0 / elems * bytes, kc, type, r);
}

/*
 * Elements [k0, k0 + kc) of one weight row of K as float32 or bfloat16 (w = s * q + m, rounded
 * once): k0 and kc whole blocks, kc <= QDECODE_MAX. The portable path (quant_decode_chunk
 * takes the SIMD ones first): the GGML types and tiles through decode_part; the repacked R4 /
 * R8 rows keep their scales at the row's end, so they are read where they lie.
 */
static void decode_chunk_f32(int type, const uint8_t *row, int lane, int64_t K, int64_t k0,
                             int64_t kc, float *out) {
    if (type == T_R4 || type == T_R8) {
        const uint8_t *d16 = row + (type == T_R4 ? K / 2 : K), *m16 = d16 + K / 16;
        for (int64_t sub = k0 / 32; sub < (k0 + kc) / 32; sub++) {
            const float d = half_to_f32(d16 + 2 * sub);
            const float m = type == T_R4 ? half_to_f32(m16 + 2 * sub) : 0.f;
            float *o = out + 32 * sub - k0;
            if (type == T_R8) {
                const int8_t *q = (const int8_t *)row + 32 * sub;
                for (int l = 0; l < 32; l++) o[l] = d * (float)q[l];
            } else {
                const uint8_t *nib = row + 32 * (sub / 2);
                const int hi = (int)(sub & 1) * 4;
                for (int l = 0; l < 32; l++) o[l] = d * (float)((nib[l] >> hi) & 0xF) + m;
            }
        }
        return;
    }
    uint8_t q[QDECODE_MAX];
    float s[QDECODE_MAX / 16], m[QDECODE_MAX / 16];
    row_t r = {q, s, m};
    decode_part(type, row, lane, k0, kc, &r);
    const int is_signed = type == T_Q8_0 || type == T_T8;
    for (int64_t k = 0; k < kc; k++) {
        const float v = is_signed ? (float)(int8_t)q[k] : (float)q[k];
        out[k] = s[k / 16] * v + m[k / 16];
    }
}

#if QK_SIMD && defined(__AVX512F__)
/* R4 / R8 rows (only AVX-512 builds repack): 16 values per instruction, scales where they lie;
 * the same arithmetic as decode_chunk_f32's (w = d * q + m fused, R8's d * q). */
static void decode_r_chunk(int type, const uint8_t *row, int64_t K, int64_t k0, int64_t kc,
                           void *out, int out_dtype) {
    const uint8_t *d16 = row + (type == T_R4 ? K / 2 : K), *m16 = d16 + K / 16;
    for (int64_t sub = k0 / 32; sub < (k0 + kc) / 32; sub++) {
        const __m512 d = _mm512_set1_ps(half_to_f32(d16 + 2 * sub));
        const __m512 m = _mm512_set1_ps(type == T_R4 ? half_to_f32(m16 + 2 * sub) : 0.f);
        for (int g = 0; g < 2; g++) {
            __m512 v;
            if (type == T_R8) {
                const __m128i q = _mm_loadu_si128((const __m128i *)(row + 32 * sub + 16 * g));
                v = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
            } else { /* nibble byte 32 p + l: sub-block 2 p low, 2 p + 1 high */
                const __m512i b = _mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i *)(row + 32 * (sub / 2) + 16 * g)));
                const __m512i q = _mm512_and_si512(sub & 1 ? _mm512_srli_epi32(b, 4) : b,
                                                   _mm512_set1_epi32(0xF));
                v = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q), m);
            }
            const int64_t at = 32 * sub - k0 + 16 * g;
            if (out_dtype == DT_F32)
                _mm512_storeu_ps((float *)out + at, v);
            else
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), f32x16_to_bf16(v));
        }
    }
}
#endif

void quant_decode_chunk(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t K,
                        int64_t k0, int64_t kc, void *out, int out_dtype) {
    /* A tiled row (builds that tile decode whole tiles: quant_tile_panels.c, or on AVX2
     * quant_gemm_i16.c) goes portable, from its tile. */
    const int tiled = IS_TILED(type), lane = tiled ? (int)(n % 16) : 0;
    const uint8_t *row = w + (n - lane) * row_bytes;
#if QK_SIMD && defined(__AVX512F__)
    if (type == T_R4 || type == T_R8) {
        decode_r_chunk(type, row, K, k0, kc, out, out_dtype);
        return;
    }
#endif
#if QK_SIMD
    if (type != T_R4 && type != T_R8 && !tiled) { /* the GGML types, decoded in registers */
        int elems = 32, bytes = 0;
        block_shape(type, &elems, &bytes);
        const uint8_t *first = row + k0 / elems * bytes;
        switch (type) {
        case T_Q4_0: fast_dequant_row(T_Q4_0, first, kc, out, out_dtype); return;
        case T_Q4_1: fast_dequant_row(T_Q4_1, first, kc, out, out_dtype); return;
        case T_Q8_0: fast_dequant_row(T_Q8_0, first, kc, out, out_dtype); return;
        case T_Q4_K: fast_dequant_row(T_Q4_K, first, kc, out, out_dtype); return;
        case T_Q5_K: fast_dequant_row(T_Q5_K, first, kc, out, out_dtype); return;
        default: fast_dequant_row(T_Q6_K, first, kc, out, out_dtype); return;
        }
    }
#endif
    if (out_dtype == DT_F32) {
        decode_chunk_f32(type, row, lane, K, k0, kc, (float *)out);
        return;
    }
    float tmp[QDECODE_MAX];
    decode_chunk_f32(type, row, lane, K, k0, kc, tmp);
    for (int64_t k = 0; k < kc; k++) ((uint16_t *)out)[k] = f32_to_bf16(tmp[k]);
}
