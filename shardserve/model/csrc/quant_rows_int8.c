/*
 * Opt-in int8 activations for the row kernels (SHARDSERVE_INT8_ACTIVATIONS, envs.py): x
 * quantized to int8 per 32 values instead of int16, so a sub-block's 32 products are one
 * vpmaddubsw (unsigned weight values times signed x, pairs summed to int16) and one vpmaddwd
 * (pairs of pairs to int32), where the int16 rows widen the weights to two registers and take
 * two vpmaddwd. llama.cpp's AVX2 build does the same (with one x scale per 256, Q8_K; here one
 * per 32, as the int16 rows): the trade is precision (an int8 x carries ~0.4% of its largest
 * value as rounding error, int16 ~0.002%), so it is never the default.
 *
 *   x (float / bf16, per 32)  d = amax / 127   q = round(x / d) as int8   xs = d * sum q per 16
 *   sub-block j of a row:     v (32 x u8)   = fused_sub (values 0..63; Q8_0 int8, signs moved
 *                                             onto x so vpmaddubsw's first operand is |v|)
 *                             p (8 x int32) = vpmaddwd(vpmaddubsw(v, q), 1)   (lanes 0-3: the
 *                                             first half's 16 products, 4-7 the second's)
 *                             acc += float(p) * [s0 d x4 | s1 d x4]      off += m0 xs0 + m1 xs1
 *
 * At one row of x the float step is paid once per 8 sub-blocks: a K-quant block's eight (Q6_K's
 * int8 half-scales multiplied in by vpmaddwd), eight 32-value blocks' (int8_group); their
 * integer sums go through one horizontal-add tree to a vector of 8.
 *
 * The integer sums are exact (|v| <= 128, |q| <= 127: a pair <= 32512 fits int16), so the
 * levels differ only in the order of the float additions. Applies to the row layouts
 * (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) up to the row kernels' rows of x; the tiles and
 * repacked rows a build makes at load (AVX-512: every tiled type; AVX2: Q4_0, Q4_1, Q8_0, Q4_K)
 * keep int16 (native_kernels.py says so at start; SHARDSERVE_TILES=0 keeps the row layouts).
 *
 * Measured (Zen 4 EPYC, x86-64-v3 build, 2 threads, 6 distinct weights from memory, alternating
 * with int16 in one process, medians of 5; bench/int8_rows.py): 1 x 2048 -> 8192 / 8192 -> 2048
 * Q4_K 1.40x / 1.70x (~36 GB/s), Q6_K 1.46x / 1.96-2.2x, Q8_0 1.03x / 1.36-1.8x; 8 rows Q4_K
 * 1.3-1.7x, Q6_K 1.5-1.6x. Not faster: Q4_0 / Q4_1 at small K (the default model's 576: 0.9x
 * on one thread), where the AVX2 int16 rows take strips of 8 weight rows a pass.
 */
#include "quant_row_tables.h"

static int int8_wanted;

/* The mode every later quant_matmul call of this process takes (0 = int16, 1 = int8). */
int quant_set_int8_activations(int on) {
    int8_wanted = on != 0;
    return 0;
}

int quant_int8_activations(void) { return int8_wanted; }

int quant_int8_takes(int type) {
    return int8_wanted && (type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0 ||
                           type == T_Q4_K || type == T_Q5_K || type == T_Q6_K);
}

#if QK_SIMD && defined(__F16C__)
/* Sub-block values times x's int8: 8 int32 sums (lanes 0-3 the first 16 values, 4-7 the rest). */
ALWAYS_INLINE __m256i int8_sub_dot(int TYPE, __m256i v, const int8_t *x) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    if (TYPE == T_Q8_0) { /* vpmaddubsw takes unsigned first: |w| . (x with w's sign) */
        xv = _mm256_sign_epi8(xv, v);
        v = _mm256_abs_epi8(v);
    }
    return _mm256_madd_epi16(_mm256_maddubs_epi16(v, xv), _mm256_set1_epi16(1));
}

/* Q4_K / Q5_K's block times NB rows of x. Per row the eight sub-block scales times x's eight
 * are one vector (parked, each then a broadcast), the mins' share one FMA with x's sums. */
ALWAYS_INLINE void int8_k4(int TYPE, int NB, const uint8_t *b, const xquant_t *xq, int64_t b0,
                           int64_t K, int64_t blk, __m256 *acc) {
    const int64_t nsub = K / 32;
    uint64_t sc, mn;
    k4_unpack(b, &sc, &mn);
    const __m256 ds = _mm256_mul_ps(_mm256_set1_ps(half_to_f32(b)), bytes8_to_f32(sc, 0));
    const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(-half_to_f32(b + 2)), bytes8_to_f32(mn, 0));
    float sd[FUSED_MAX_B][8] __attribute__((aligned(32)));
    for (int i = 0; i < NB; i++) {
        const int64_t at = (b0 + i) * nsub + 8 * blk;
        _mm256_store_ps(sd[i], _mm256_mul_ps(ds, _mm256_loadu_ps(xq->d + at)));
        acc[i] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(xq->xs32 + at), acc[i]);
    }
    const uint8_t *qs = b + (TYPE == T_Q5_K ? 48 : 16);
    if (NB == 1 && TYPE == T_Q4_K) { /* the sub-blocks' sums as integers, one float step */
        const int8_t *x = xq->q8 + b0 * K + 256 * blk;
        __m256i p[8];
        for (int j = 0; j < 8; j += 2) {
            const __m256i v = load32(qs + 16 * j);
            p[j] = int8_sub_dot(TYPE, low_nibbles(v), x + 32 * j);
            p[j + 1] = int8_sub_dot(TYPE, high_nibbles(v), x + 32 * j + 32);
        }
        acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8x8(p)), _mm256_load_ps(sd[0]), acc[0]);
        return;
    }
    for (int j = 0; j < 8; j++) {
        const __m256i vals = k45_sub_values(TYPE, b, j);
        for (int i = 0; i < NB; i++) {
            const int8_t *x = xq->q8 + (b0 + i) * K + 256 * blk + 32 * j;
            const __m256 p = _mm256_cvtepi32_ps(int8_sub_dot(TYPE, vals, x));
            acc[i] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(&sd[i][j]), acc[i]);
        }
    }
}

/* Q6_K's block times NB rows of x: its sixteen int8 half-scales stay integers, multiplied into
 * the pairs' sums by vpmaddwd (a sub-block's two halves in one register); per row d times x's
 * eight scales is one vector, the -32's share two FMAs with x's sums per 16. */
ALWAYS_INLINE void int8_k6(int NB, const uint8_t *b, const xquant_t *xq, int64_t b0, int64_t K,
                           int64_t blk, __m256 *acc) {
    const int64_t nsub = K / 32;
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)(b + 192));
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
    const __m256 d = _mm256_set1_ps(half_to_f32(b + 208));
    const __m256 m32 = _mm256_mul_ps(d, _mm256_set1_ps(-32.f));
    const __m256 off_lo = _mm256_mul_ps(m32, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)));
    const __m256 off_hi = _mm256_mul_ps(m32, _mm256_cvtepi32_ps(
                                                 _mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8))));
    float sd[FUSED_MAX_B][8] __attribute__((aligned(32)));
    __m256i p[8]; /* one row of x: the sub-blocks' scaled sums, one float step for all */
    for (int i = 0; i < NB; i++) {
        const int64_t at = (b0 + i) * nsub + 8 * blk;
        _mm256_store_ps(sd[i], _mm256_mul_ps(d, _mm256_loadu_ps(xq->d + at)));
        const float *xs = xq->xs + 2 * at;
        acc[i] = _mm256_fmadd_ps(off_lo, _mm256_loadu_ps(xs), acc[i]);
        acc[i] = _mm256_fmadd_ps(off_hi, _mm256_loadu_ps(xs + 8), acc[i]);
    }
    for (int h = 0; h < 2; h++) {
        /* scales 8h .. 8h + 7 in both lanes; sub-block 4h + k takes 8h + 2k low, 8h + 2k + 1 high */
        const __m256i half = h ? _mm256_permute4x64_epi64(sc16, 0xEE)
                                : _mm256_permute4x64_epi64(sc16, 0x44);
        const __m256i ql0 = load32(b + 64 * h), ql1 = load32(b + 64 * h + 32);
        const __m256i qh = load32(b + 128 + 32 * h);
        for (int k = 0; k < 4; k++) {
            const __m256i pick = _mm256_setr_epi8(
                4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k,
                4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k + 2,
                4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3,
                4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2,
                4 * k + 3);
            const __m256i scv = _mm256_shuffle_epi8(half, pick);
            const __m256i vals = k6_bytes((k & 1) ? ql1 : ql0, qh, k);
            for (int i = 0; i < NB; i++) {
                const int8_t *x = xq->q8 + (b0 + i) * K + 256 * blk + 32 * (4 * h + k);
                const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
                const __m256i pk = _mm256_madd_epi16(_mm256_maddubs_epi16(vals, xv), scv);
                if (NB == 1)
                    p[4 * h + k] = pk;
                else
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pk),
                                             _mm256_broadcast_ss(&sd[i][4 * h + k]), acc[i]);
            }
        }
    }
    if (NB == 1)
        acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8x8(p)), _mm256_load_ps(sd[0]), acc[0]);
}

/* The 32-value blocks (Q4_0, Q4_1, Q8_0) times NB rows of x. */
ALWAYS_INLINE void int8_b32(int TYPE, int NB, const uint8_t *b, const xquant_t *xq, int64_t b0,
                            int64_t K, int64_t sub, __m256 *acc, float *off) {
    float s[2], m[2];
    const __m256i v = fused_sub(TYPE, b, 0, NULL, NULL, s, m);
    for (int i = 0; i < NB; i++) {
        const int64_t xb = b0 + i;
        const __m256 p = _mm256_cvtepi32_ps(int8_sub_dot(TYPE, v, xq->q8 + xb * K + 32 * sub));
        acc[i] = _mm256_fmadd_ps(p, _mm256_set1_ps(s[0] * xq->d[xb * (K / 32) + sub]), acc[i]);
        off[i] += m[0] * xq->xs32[xb * (K / 32) + sub];
    }
}

/* One row of x times blocks g0 .. g0 + 7 of a row of 32-value blocks: their sums stay integers
 * to one float step for the 8 (quant_rows_avx2.c's grouping, with vpmaddubsw). */
ALWAYS_INLINE void int8_group(int TYPE, const uint8_t *row, const xquant_t *xq, int64_t b0,
                              int64_t K, int64_t g0, __m256 *acc) {
    int elems, bytes;
    block_shape(TYPE, &elems, &bytes);
    const int8_t *x = xq->q8 + b0 * K + 32 * g0;
    __m256i p[8];
    for (int t = 0; t < 8; t++) {
        const uint8_t *b = row + (g0 + t) * bytes;
        const __m256i v = TYPE == T_Q8_0 ? load32(b + 2) : q4_block_values(TYPE, b);
        p[t] = int8_sub_dot(TYPE, v, x + 32 * t);
    }
    __m256 d, m;
    group_scales(TYPE, row + g0 * bytes, bytes, &d, &m);
    const int64_t at = b0 * (K / 32) + g0;
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8x8(p)),
                           _mm256_mul_ps(d, _mm256_loadu_ps(xq->d + at)), *acc);
    if (TYPE != T_Q8_0) *acc = _mm256_fmadd_ps(m, _mm256_loadu_ps(xq->xs32 + at), *acc);
}

/* NB rows of x (b0..) times one weight row, block by block: each block's values are decoded
 * once for all NB rows (in a register of bytes, as the int16 rows' fused_sub). */
ALWAYS_INLINE void int8_row(int TYPE, int NB, const uint8_t *row, const xquant_t *xq, int64_t b0,
                            int64_t K, float *res) {
    int elems, bytes;
    block_shape(TYPE, &elems, &bytes);
    const int kq = elems == 256;
    const int64_t blocks = K / elems;
    __m256 acc[FUSED_MAX_B]; /* the offsets' share too: 8 rows of x fill 8 of 16 registers */
    float off[FUSED_MAX_B];
    for (int i = 0; i < NB; i++) {
        acc[i] = _mm256_setzero_ps();
        off[i] = 0.f;
    }
    int64_t blk = 0;
    if (NB == 1 && !kq)
        for (; blk + 8 <= blocks; blk += 8) int8_group(TYPE, row, xq, b0, K, blk, acc);
    for (; blk < blocks; blk++) {
        const uint8_t *b = row + blk * bytes;
        for (int l = 0; NB == 1 && l < bytes; l += 64) /* 1.00-1.06x, as the int16 rows' */
            _mm_prefetch((const char *)b + 2048 + l, _MM_HINT_T0);
        if (TYPE == T_Q6_K)
            int8_k6(NB, b, xq, b0, K, blk, acc);
        else if (kq)
            int8_k4(TYPE, NB, b, xq, b0, K, blk, acc);
        else
            int8_b32(TYPE, NB, b, xq, b0, K, blk, acc, off);
    }
    for (int i = 0; i < NB; i++) res[i] = hsum8(acc[i]) + off[i];
}

ROWS_FNS(int8_row, T_Q4_0)
ROWS_FNS(int8_row, T_Q4_1)
ROWS_FNS(int8_row, T_Q8_0)
ROWS_FNS(int8_row, T_Q4_K)
ROWS_FNS(int8_row, T_Q5_K)
ROWS_FNS(int8_row, T_Q6_K)

/* The int8 rows of a type (NULL for one they do not take). */
ROWS_TABLES_BY_TYPE(int8_row_fns, int8_row)
#else
const rows_fn *int8_row_fns(int type) {
    (void)type;
    return NULL;
}
#endif
