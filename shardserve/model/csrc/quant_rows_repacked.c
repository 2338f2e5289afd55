/*
 * The row kernels of R4 / R8 (quant_retile.c's rows of 4- / 8-bit values with their scales
 * gathered per 16 sub-blocks; AVX-512 builds, which repack where a weight comes in pieces of
 * other row counts than the tiles take): quant_rows.c's quant_rows_simd runs them.
 */
#include "quant_row_tables.h"

#if QK_SIMD && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define QK_REPACK 1
/*
 * Rows of R4 / R8 times up to 4 rows of x. Per 16 sub-blocks: the 16 weight scales convert in
 * one instruction, are multiplied by x's 16 scales and parked on the stack (each then feeds a
 * broadcast), and the offsets' share m . xs32 is one vector FMA. Per sub-block what remains is
 * a widen, a load of x, vpmaddwd, a conversion and an FMA.
 */
ALWAYS_INLINE void r_row(int TYPE, int NB, const uint8_t *row, const xquant_t *xq, int64_t b0,
                         int64_t K, float *res) {
    const int64_t nsub = K / 32;
    const uint8_t *d16 = row + (TYPE == T_R4 ? K / 2 : K), *m16 = d16 + K / 16;
    __m512 acc[FUSED_MAX_B], macc[FUSED_MAX_B];
    for (int i = 0; i < NB; i++) acc[i] = macc[i] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < nsub; g0 += 16) {
        const int cnt = nsub - g0 < 16 ? (int)(nsub - g0) : 16;
        const __mmask16 mask = (__mmask16)((1u << cnt) - 1u);
        const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, d16 + 2 * g0));
        float sd[FUSED_MAX_B][16] __attribute__((aligned(64)));
        for (int i = 0; i < NB; i++) {
            const int64_t b = b0 + i;
            const __m512 xd = _mm512_maskz_loadu_ps(mask, xq->d + b * nsub + g0);
            _mm512_store_ps(sd[i], _mm512_mul_ps(dv, xd));
            if (TYPE == T_R4) {
                const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, m16 + 2 * g0));
                macc[i] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(mask, xq->xs32 + b * nsub + g0),
                                          macc[i]);
            }
        }
        for (int t = 0; t < cnt; t += (TYPE == T_R4 ? 2 : 1)) {
            const int64_t sub = g0 + t;
            __m512i w0, w1 = _mm512_setzero_si512();
            if (TYPE == T_R4) {
                const __m256i v = load32(row + 16 * sub); /* sub-blocks sub, sub + 1 */
                w0 = _mm512_cvtepu8_epi16(low_nibbles(v));
                w1 = _mm512_cvtepu8_epi16(high_nibbles(v));
            } else {
                w0 = _mm512_cvtepi8_epi16(load32(row + 32 * sub));
            }
            for (int i = 0; i < NB; i++) {
                const int16_t *x = xq->q + (b0 + i) * K + 32 * sub;
                const __m512 p0 = _mm512_cvtepi32_ps(_mm512_madd_epi16(w0, _mm512_loadu_si512(x)));
                acc[i] = _mm512_fmadd_ps(p0, _mm512_set1_ps(sd[i][t]), acc[i]);
                if (TYPE == T_R4) {
                    const __m512 p1 = _mm512_cvtepi32_ps(_mm512_madd_epi16(w1, _mm512_loadu_si512(x + 32)));
                    acc[i] = _mm512_fmadd_ps(p1, _mm512_set1_ps(sd[i][t + 1]), acc[i]);
                }
            }
        }
    }
    for (int i = 0; i < NB; i++) res[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], macc[i]));
}

ROWS_FNS(r_row, T_R4)
ROWS_FNS(r_row, T_R8)

const rows_fn *repacked_row_fns(int type) {
    static const rows_fn r4[] = ROWS_TABLE(r_row, T_R4);
    static const rows_fn r8[] = ROWS_TABLE(r_row, T_R8);
    return type == T_R4 ? r4 : type == T_R8 ? r8 : NULL;
}
#else
#define QK_REPACK 0
const rows_fn *repacked_row_fns(int type) {
    (void)type;
    return NULL;
}
#endif

/* Whether this build computes R4 / R8 rows on its fast path (else they take the portable one). */
int quant_can_repack(void) { return QK_REPACK; }
