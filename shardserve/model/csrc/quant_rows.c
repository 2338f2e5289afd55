/*
 * The SIMD row kernels for small batches (quant_matmul with B <= FUSED_MAX_B per pass; the
 * batch-1 decode step is this path): each weight row is decoded in registers while it is
 * multiplied with up to 8 rows of x, so a row costs one pass over its blocks and no scratch.
 * `TYPE` is constant at each call site (a loop per type); scheme: quant_kernels.c (x int16).
 */
#include <omp.h>

#include "quant_row_tables.h"

#if QK_SIMD
/* One sub-block's share (Q4_0, Q4_1, Q8_0): acc += (w . x per pair of int16) * scale. Pairs:
 * |w| <= 128, |x| <= 32767, so a pair (and two pairs) fit an int32 and convert to float exactly.
 * AVX-512 does the 32 values in one register, AVX2 in two. */
#if defined(__AVX512BW__)
typedef __m512 acc_t;
typedef __m512i wide_t;
static inline acc_t acc_zero(void) { return _mm512_setzero_ps(); }
static inline float acc_sum(acc_t a) { return _mm512_reduce_add_ps(a); }
ALWAYS_INLINE wide_t widen(int TYPE, __m256i w) {
    return TYPE == T_Q8_0 ? _mm512_cvtepi8_epi16(w) : _mm512_cvtepu8_epi16(w);
}
ALWAYS_INLINE acc_t mac_sub(acc_t acc, wide_t w, const int16_t *x, float scale) {
    const __m512 p = _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512(x)));
    return _mm512_fmadd_ps(p, _mm512_set1_ps(scale), acc);
}
#else
typedef __m256 acc_t;
typedef struct { __m256i lo, hi; } wide_t;
static inline acc_t acc_zero(void) { return _mm256_setzero_ps(); }
static inline float acc_sum(acc_t a) { return hsum8(a); }
ALWAYS_INLINE wide_t widen(int TYPE, __m256i w) {
    const __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
    wide_t out;
    out.lo = TYPE == T_Q8_0 ? _mm256_cvtepi8_epi16(lo) : _mm256_cvtepu8_epi16(lo);
    out.hi = TYPE == T_Q8_0 ? _mm256_cvtepi8_epi16(hi) : _mm256_cvtepu8_epi16(hi);
    return out;
}
ALWAYS_INLINE acc_t mac_sub(acc_t acc, wide_t w, const int16_t *x, float scale) {
    const __m256i p0 = _mm256_madd_epi16(w.lo, _mm256_loadu_si256((const __m256i *)x));
    const __m256i p1 = _mm256_madd_epi16(w.hi, _mm256_loadu_si256((const __m256i *)(x + 16)));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), _mm256_set1_ps(scale), acc);
}
#endif

/*
 * K-quant rows (Q4_K, Q5_K, Q6_K). Per block of 256 the scales are vector work: Q4_K/Q5_K's
 * eight 6-bit scales and mins unpack from their 12 bytes with integer ops on three words,
 * Q6_K's sixteen int8 half-scales convert as two vectors; times d and x's per-32 scales they
 * are parked on the stack, each sub-block then taking its scale by a broadcast (per half for
 * Q6_K), and the offsets' share (mins, Q6_K's -32) is one or two vector FMAs per block into a
 * second accumulator. Per sub-block what remains: the values out of their nibbles (and Q5_K's
 * fifth bit, Q6_K's two high bits) in 16-bit lanes, vpmaddwd with x, a conversion and an FMA.
 */
#if defined(__AVX512BW__)
typedef __m512i w32_t; /* 32 weight values as int16 */
ALWAYS_INLINE w32_t w_load(const uint8_t *p) { return _mm512_cvtepu8_epi16(load32(p)); }
ALWAYS_INLINE w32_t w_and(w32_t a, short m) { return _mm512_and_si512(a, _mm512_set1_epi16(m)); }
ALWAYS_INLINE w32_t w_srl(w32_t a, int n) { return _mm512_srli_epi16(a, (unsigned)n); }
ALWAYS_INLINE w32_t w_sll(w32_t a, int n) { return _mm512_slli_epi16(a, (unsigned)n); }
ALWAYS_INLINE w32_t w_or(w32_t a, w32_t b) { return _mm512_or_si512(a, b); }
ALWAYS_INLINE __m512 w_dot(w32_t w, const int16_t *x) {
    return _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512(x)));
}
/* acc += w . x scaled by sd[j] (all 32) or by sd[2j], sd[2j + 1] (per half of 16). */
ALWAYS_INLINE acc_t k_mac(int per_half, acc_t acc, w32_t w, const int16_t *x, const float *sd,
                          int j) {
    if (!per_half) return _mm512_fmadd_ps(w_dot(w, x), _mm512_set1_ps(sd[j]), acc);
    const __m512i idx = _mm512_set_epi32(2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                         2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j, 2 * j, 2 * j,
                                         2 * j, 2 * j, 2 * j, 2 * j, 2 * j);
    return _mm512_fmadd_ps(w_dot(w, x), _mm512_permutexvar_ps(idx, _mm512_load_ps(sd)), acc);
}
#else
typedef struct { __m256i lo, hi; } w32_t;
ALWAYS_INLINE w32_t w_load(const uint8_t *p) {
    w32_t w = {_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)),
               _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)))};
    return w;
}
ALWAYS_INLINE w32_t w_and(w32_t a, short m) {
    const __m256i v = _mm256_set1_epi16(m);
    w32_t w = {_mm256_and_si256(a.lo, v), _mm256_and_si256(a.hi, v)};
    return w;
}
ALWAYS_INLINE w32_t w_srl(w32_t a, int n) {
    w32_t w = {_mm256_srli_epi16(a.lo, n), _mm256_srli_epi16(a.hi, n)};
    return w;
}
ALWAYS_INLINE w32_t w_sll(w32_t a, int n) {
    w32_t w = {_mm256_slli_epi16(a.lo, n), _mm256_slli_epi16(a.hi, n)};
    return w;
}
ALWAYS_INLINE w32_t w_or(w32_t a, w32_t b) {
    w32_t w = {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)};
    return w;
}
ALWAYS_INLINE acc_t k_mac(int per_half, acc_t acc, w32_t w, const int16_t *x, const float *sd,
                          int j) {
    const __m256i p0 = _mm256_madd_epi16(w.lo, _mm256_loadu_si256((const __m256i *)x));
    const __m256i p1 = _mm256_madd_epi16(w.hi, _mm256_loadu_si256((const __m256i *)(x + 16)));
    if (!per_half)
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)),
                               _mm256_set1_ps(sd[j]), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(sd[2 * j]), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(sd[2 * j + 1]), acc);
}
#endif

/* Q4_K/Q5_K: sd[i][j] = d * sc_j * xd_j; macc[i] -= dmin * mn_j * xs32_j (the mins' share). */
ALWAYS_INLINE void k4_scales(int NB, const uint8_t *blk, const xquant_t *xq, int64_t first,
                             int64_t nsub, float (*sd)[16], __m256 *macc) {
    uint64_t sc, mn;
    k4_unpack(blk, &sc, &mn);
    const __m256 s = _mm256_mul_ps(_mm256_set1_ps(half_to_f32(blk)), bytes8_to_f32(sc, 0));
    const __m256 m = _mm256_mul_ps(_mm256_set1_ps(half_to_f32(blk + 2)), bytes8_to_f32(mn, 0));
    for (int i = 0; i < NB; i++) {
        const int64_t o = i * nsub + first;
        _mm256_store_ps(sd[i], _mm256_mul_ps(s, _mm256_loadu_ps(xq->d + o)));
        macc[i] = _mm256_fnmadd_ps(m, _mm256_loadu_ps(xq->xs32 + o), macc[i]);
    }
}

/* Q6_K: sd[i][h] = d * sc_h * xd (h: half of 16, xd of its 32), or with SCALED (k6_scaled's
 * values) sd[i][j] = d * xd (j: sub-block of 32); offsets -32 * s per half. */
ALWAYS_INLINE void k6_scales(int SCALED, int NB, const uint8_t *blk, const xquant_t *xq,
                             int64_t first, int64_t nsub, float (*sd)[16], __m256 *macc) {
    uint64_t lo, hi;
    memcpy(&lo, blk + 192, 8);
    memcpy(&hi, blk + 200, 8);
    const __m256 d = _mm256_set1_ps(half_to_f32(blk + 208));
    const __m256 s0 = _mm256_mul_ps(d, bytes8_to_f32(lo, 1)), s1 = _mm256_mul_ps(d, bytes8_to_f32(hi, 1));
    const __m256 m32 = _mm256_set1_ps(32.f);
    for (int i = 0; i < NB; i++) {
        const int64_t o = i * nsub + first;
        const __m256 xd = _mm256_loadu_ps(xq->d + o);
        if (SCALED) _mm256_store_ps(sd[i], _mm256_mul_ps(d, xd));
        else _mm256_store_ps(sd[i], _mm256_mul_ps(s0, _mm256_permutevar8x32_ps(
                                   xd, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3))));
        if (!SCALED) _mm256_store_ps(sd[i] + 8, _mm256_mul_ps(s1, _mm256_permutevar8x32_ps(
                                       xd, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7))));
        const float *xs = xq->xs + 2 * o;
        macc[i] = _mm256_fnmadd_ps(_mm256_mul_ps(m32, s0), _mm256_loadu_ps(xs), macc[i]);
        macc[i] = _mm256_fnmadd_ps(_mm256_mul_ps(m32, s1), _mm256_loadu_ps(xs + 8), macc[i]);
    }
}

/* Sub-block j's values: Q4_K/Q5_K from the nibbles of pair j / 2 (v, widened), Q5_K's fifth
 * bit from qh (bit j of each byte); Q6_K from its low nibbles (l0 / l1) and two high bits. */
ALWAYS_INLINE w32_t k45_values(int TYPE, w32_t v, w32_t qh, int j) {
    w32_t w = (j & 1) ? w_srl(v, 4) : w_and(v, 0xF);
    if (TYPE == T_Q5_K) w = w_or(w, w_and(j <= 4 ? w_sll(qh, 4 - j) : w_srl(qh, j - 4), 0x10));
    return w;
}
ALWAYS_INLINE w32_t k6_values(w32_t l0, w32_t l1, w32_t qh, int k) {
    const w32_t nib = k == 0 ? w_and(l0, 0xF) : k == 1 ? w_and(l1, 0xF)
                    : k == 2 ? w_srl(l0, 4) : w_srl(l1, 4);
    const w32_t top = k == 0 ? w_sll(qh, 4) : k == 1 ? w_sll(qh, 2) : k == 2 ? qh : w_srl(qh, 2);
    return w_or(nib, w_and(top, 0x30));
}

/* Q6_K on AVX2 at 2-8 rows of x: sub-block j's two int8 half-scales multiplied into its values
 * once for all rows (|q sc| <= 63 * 128 fits an int16; a lane's 4 products < 2^31), so a row
 * takes one float step per 32 (k_mac's whole-32 form, d * x's scale) instead of two. */
ALWAYS_INLINE w32_t k6_scaled(w32_t w, const uint8_t *blk, int j) {
#if KQ_AVX2
    const int8_t *sc = (const int8_t *)(blk + 192);
    w.lo = _mm256_mullo_epi16(w.lo, _mm256_set1_epi16(sc[2 * j]));
    w.hi = _mm256_mullo_epi16(w.hi, _mm256_set1_epi16(sc[2 * j + 1]));
#endif
    (void)blk, (void)j;
    return w;
}

#if !defined(__AVX512BW__)
/* w . x per pair of 16-value halves: lanes 0-3 the first half's sums, 4-7 the second's. */
ALWAYS_INLINE __m256i halves_dot(w32_t w, const int16_t *x) {
    return _mm256_add_epi32(_mm256_madd_epi16(w.lo, _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(w.hi, _mm256_loadu_si256((const __m256i *)(x + 16))));
}

/* One row of x (the batch-1 decode step) on AVX2: a block's products stay int32 until one
 * float step per 8 scales (sum8x8 puts sub-block j's sum in lane j; Q6_K keeps its halves
 * apart, 4 sub-blocks a step), where k_mac converts and FMAs per sub-block. Exact: |w| <= 63,
 * |x| <= 32767, a half's 16 products < 2^31. The blocks 2 KB ahead prefetched:
 * from memory (Zen 4, x86-64-v3, 2 threads; bench/quant_gemm_ab.py --product rows --distinct 6)
 * 2048 -> 8192 / 8192 -> 2048 / 2048 -> 2048 Q4_K 1.07x / 1.18x / 1.08x, Q6_K 1.29x / 1.58x /
 * 1.29x the per-sub-block rows; without the prefetch Q4_K 0.96-0.99x, Q6_K 1.07-1.12x. */
ALWAYS_INLINE void kquant_block1(int TYPE, const uint8_t *blk, int bytes, const int16_t *x,
                                 const float *sd, acc_t *acc) {
    for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char *)blk + 2048 + l, _MM_HINT_T0);
    __m256i p[8];
    if (TYPE == T_Q6_K) {
        for (int h = 0; h < 2; h++) {
            const w32_t l0 = w_load(blk + 64 * h), l1 = w_load(blk + 64 * h + 32);
            const w32_t qh = w_load(blk + 128 + 32 * h);
            for (int k = 0; k < 4; k++) {
                const w32_t w = k6_values(l0, l1, qh, k);
                const __m256i *xj = (const __m256i *)(x + 32 * (4 * h + k)); /* 2 x 16 */
                p[2 * k] = _mm256_madd_epi16(w.lo, _mm256_loadu_si256(xj));
                p[2 * k + 1] = _mm256_madd_epi16(w.hi, _mm256_loadu_si256(xj + 1));
            }
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8x8(p)), _mm256_load_ps(sd + 8 * h), *acc);
        }
        return;
    }
    const uint8_t *qs = blk + (TYPE == T_Q5_K ? 48 : 16);
    const w32_t qh = TYPE == T_Q5_K ? w_load(blk + 16) : w_load(qs); /* unused: Q4_K */
    __m256i h[4]; /* sum8x8's first level as each pair is made: 4 vectors live, not 8 */
    for (int j = 0; j < 8; j += 2) { /* sub-blocks j, j + 1: the low, high nibbles of 32 bytes */
        const w32_t v = w_load(qs + 16 * j);
        h[j / 2] = _mm256_hadd_epi32(halves_dot(k45_values(TYPE, v, qh, j), x + 32 * j),
                                     halves_dot(k45_values(TYPE, v, qh, j + 1), x + 32 * j + 32));
    }
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum4x8_pairs(h)), _mm256_load_ps(sd), *acc);
}

/* 32 byte values (0..63) times x in xu's order (vpunpck{l,h}bw with zero: values 0-7 and 16-23
 * in the low one, 8-15 and 24-31 in the high one). Lanes 0-3: sums of the first 16 values, 4-7
 * of the rest: the same integers as halves_dot's, from one register of bytes. */
ALWAYS_INLINE __m256i unpack_dot(__m256i w, const int16_t *xu) {
    const __m256i z = _mm256_setzero_si256(), *x = (const __m256i *)xu;
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_unpacklo_epi8(w, z), _mm256_loadu_si256(x)),
                            _mm256_madd_epi16(_mm256_unpackhi_epi8(w, z), _mm256_loadu_si256(x + 1)));
}

/* Q6_K at one row of x (unpack_dot): the values in byte lanes (quant_blocks.h's k6_bytes),
 * where kquant_block1 puts them together on 16-bit lanes, two registers per 32; per half of 128
 * three horizontal adds and a permute put the 8 sums in kquant_block1's order (half h of
 * sub-block k in lane 2k + h), so the float step and the result are the same. ~20% fewer
 * instructions than kquant_block1's Q6_K, the same vpmaddwd: 1.08-1.12x from memory on Zen 3
 * (x86-64-v3, 2 threads); what was tried beside it: README, issue 30's Zen 3 paragraph. */
ALWAYS_INLINE void k6_block1_unpack(const uint8_t *blk, const int16_t *xu, const float *sd,
                                    acc_t *acc) {
    for (int l = 0; l < 210; l += 64) _mm_prefetch((const char *)blk + 2048 + l, _MM_HINT_T0);
    for (int h = 0; h < 2; h++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        const int16_t *a = xu + 128 * h;
        const __m256i v0 = k6_bytes(l0, qh, 0), v1 = k6_bytes(l1, qh, 1);
        const __m256i v2 = k6_bytes(l0, qh, 2), v3 = k6_bytes(l1, qh, 3);
        const __m256i s0 = unpack_dot(v0, a), s1 = unpack_dot(v1, a + 32);
        const __m256i s2 = unpack_dot(v2, a + 64), s3 = unpack_dot(v3, a + 96);
        /* [s0..s3 first halves | s0..s3 second halves] -> [s0 first, s0 second, s1 first, ...] */
        const __m256i q = _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s3));
        const __m256i sums =
            _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_load_ps(sd + 8 * h), *acc);
    }
}

#endif

ALWAYS_INLINE void kquant_row(int TYPE, int NB, const uint8_t *row, const xquant_t *xq,
                              int64_t b0, int64_t K, float *res) {
    const int bytes = TYPE == T_Q4_K ? 144 : TYPE == T_Q5_K ? 176 : 210;
    const int64_t nsub = K / 32;
    const xquant_t x = {xq->q + b0 * K, xq->d + b0 * nsub, xq->xs + b0 * (K / 16),
                        xq->xs32 + b0 * nsub, NULL, xq->xu ? xq->xu + b0 * K : NULL};
    acc_t acc[FUSED_MAX_B];
    __m256 macc[FUSED_MAX_B];
    for (int i = 0; i < NB; i++) acc[i] = acc_zero(), macc[i] = _mm256_setzero_ps();
    for (int64_t bi = 0; bi < K / 256; bi++) {
        const uint8_t *blk = row + bi * bytes;
        float sd[FUSED_MAX_B][16] __attribute__((aligned(64)));
        if (TYPE == T_Q6_K)
            k6_scales(KQ_AVX2 && NB > 1, NB, blk, &x, 8 * bi, nsub, sd, macc);
        else
            k4_scales(NB, blk, &x, 8 * bi, nsub, sd, macc);
#if !defined(__AVX512BW__)
        if (NB == 1 && TYPE == T_Q6_K && x.xu != NULL) {
            k6_block1_unpack(blk, x.xu + 256 * bi, sd[0], &acc[0]);
            continue;
        }
        if (NB == 1) {
            kquant_block1(TYPE, blk, bytes, x.q + 256 * bi, sd[0], &acc[0]);
            continue;
        }
#endif
        if (TYPE == T_Q6_K) {
            for (int h = 0; h < 2; h++) {
                const w32_t l0 = w_load(blk + 64 * h), l1 = w_load(blk + 64 * h + 32);
                const w32_t qh = w_load(blk + 128 + 32 * h);
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    const int j = 4 * h + k;
                    const w32_t w = k6_scaled(k6_values(l0, l1, qh, k), blk, j);
                    for (int i = 0; i < NB; i++)
                        acc[i] = k_mac(!KQ_AVX2, acc[i], w, x.q + i * K + 256 * bi + 32 * j,
                                       sd[i], j);
                }
            }
        } else {
            const uint8_t *qs = blk + (TYPE == T_Q5_K ? 48 : 16);
            const w32_t qh = TYPE == T_Q5_K ? w_load(blk + 16) : w_load(qs); /* unused: Q4_K */
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const w32_t w = k45_values(TYPE, w_load(qs + 32 * (j / 2)), qh, j);
                for (int i = 0; i < NB; i++)
                    acc[i] = k_mac(0, acc[i], w, x.q + i * K + 256 * bi + 32 * j, sd[i], j);
            }
        }
    }
    for (int i = 0; i < NB; i++) res[i] = acc_sum(acc[i]) + hsum8(macc[i]);
}

/* Q4_0, Q4_1, Q8_0 rows (the K-quants take kquant_row): a block is one sub-block of 32. */
ALWAYS_INLINE void fused_row(
    int TYPE, int NB, const uint8_t *row, const xquant_t *xq, int64_t b0, int64_t K, float *res) {
    if (TYPE == T_Q4_K || TYPE == T_Q5_K || TYPE == T_Q6_K) {
        kquant_row(TYPE, NB, row, xq, b0, K, res);
        return;
    }
    const int bytes = TYPE == T_Q4_0 ? 18 : TYPE == T_Q4_1 ? 20 : 34;
    /* NB is a constant at each call: the accumulators stay in registers. */
    acc_t acc[FUSED_MAX_B];
    float macc[FUSED_MAX_B];
    for (int i = 0; i < NB; i++) {
        acc[i] = acc_zero();
        macc[i] = 0.f;
    }
    for (int64_t sub = 0; sub < K / 32; sub++) {
        float s[2], m[2];
        const wide_t w = widen(TYPE, fused_sub(TYPE, row + sub * bytes, 0, NULL, NULL, s, m));
        for (int i = 0; i < NB; i++) {
            const int64_t b = b0 + i;
            acc[i] = mac_sub(acc[i], w, xq->q + b * K + 32 * sub, s[0] * xq->d[b * (K / 32) + sub]);
            if (TYPE != T_Q8_0) {
                const float *xs = xq->xs + b * (K / 16) + 2 * sub;
                macc[i] += m[0] * xs[0] + m[1] * xs[1];
            }
        }
    }
    for (int i = 0; i < NB; i++) res[i] = acc_sum(acc[i]) + macc[i];
}

ROWS_FNS(fused_row, T_Q4_0)
ROWS_FNS(fused_row, T_Q4_1)
ROWS_FNS(fused_row, T_Q8_0)
ROWS_FNS(fused_row, T_Q4_K)
ROWS_FNS(fused_row, T_Q5_K)
ROWS_FNS(fused_row, T_Q6_K)

/* Weight rows a task takes (all passes over x on them while cached). Guided, not static: in
 * equal halves one thread waited 17% of a 1B batch-1 step (Zen 3; guided 10%, 1.06-1.16x). */
#define ROWS_TILE 16

static void run_rows_by(const rows_fn *fns, const uint8_t *w, int64_t row_bytes,
                        const xquant_t *xq, int64_t B, int64_t N, int64_t K, void *out,
                        int64_t out_stride, int out_dtype, int threads, int64_t pass_max) {
    const int64_t tiles = (N + ROWS_TILE - 1) / ROWS_TILE;
    const int64_t passes = (B + pass_max - 1) / pass_max, per = (B + passes - 1) / passes;
#pragma omp parallel for num_threads(threads) schedule(guided)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * ROWS_TILE, n1 = N - n0 < ROWS_TILE ? N : n0 + ROWS_TILE;
        for (int64_t b0 = 0; b0 < B; b0 += per) {
            const int64_t nb = B - b0 < per ? B - b0 : per;
            fns[nb - 1](w, row_bytes, xq, b0, n0, n1, K, out, out_stride, out_dtype);
        }
    }
}

void run_rows(const rows_fn *fns, const uint8_t *w, int64_t row_bytes, const xquant_t *xq,
              int64_t B, int64_t N, int64_t K, void *out, int64_t out_stride, int out_dtype,
              int threads) {
    run_rows_by(fns, w, row_bytes, xq, B, N, K, out, out_stride, out_dtype, threads, FUSED_MAX_B);
}

ROWS_TABLES_BY_TYPE(fused_row_fns, fused_row)

int quant_rows_simd(const uint8_t *w, int64_t row_bytes, int type, const xquant_t *xq,
                    int64_t B, int64_t N, int64_t K, void *out, int64_t out_stride,
                    int out_dtype, int threads) {
    const rows_fn *fns = NULL;
    const rows_fn one = avx2_one_row_fn(type); /* lives until run_rows returns */
    if (type == T_R4 || type == T_R8) {
        fns = repacked_row_fns(type);
    } else if (B == 1 && one != NULL) {
        fns = &one;
    } else {
        fns = avx2_row_fns(type); /* NULL on AVX-512 builds and for the K-quants */
        if (fns == NULL) fns = fused_row_fns(type);
    }
    if (fns == NULL) return 0;
    /* AVX2 K-quant rows take 8 rows of x as two passes of 4: at 8 their accumulators spill
     * (16 ymm registers), at 7 they do not (Zen 3, 2 threads, 1B shapes from memory: 8 rows of
     * Q4_K / Q6_K 1.12-1.29x as 4 + 4; 7 rows as 4 + 3 0.97-1.10x, so 7 stays one pass). */
    const int kq = type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
    run_rows_by(fns, w, row_bytes, xq, B, N, K, out, out_stride, out_dtype, threads,
                KQ_AVX2 && kq ? FUSED_MAX_B - 1 : FUSED_MAX_B);
    return 1;
}
#endif
