/*
 * quant_gemm.c's tiles at the int16 rows' precision on AVX2 builds: x quantized per 32 values to
 * int16 (at most 16383), each weight decoded once per call into an int16 panel with every scale
 * finer than 32 columns folded into its values, multiplied by vpmaddwd.
 *
 * Why: on AVX2 a float32 FMA does 8 multiply-adds per instruction, vpmaddwd + vpaddd 16 on the
 * same pipes (bench/csrc/int8_gemm_floor.c, Zen 4 at x86-64-v3: float32 113 GMAC/s, int16 245
 * with the float step per 32), and int16 x is the default batch-1 path's precision already.
 * (AVX-512 builds keep the float32 / bfloat16 panels: their tiles decode there.)
 *
 * Group g of 32 columns of weight row n: int16 values v and two floats, dg (the scale) and mg
 * (the offset's coefficient on the group's sum of x):
 *     Q4_0  v = q - 8                          dg = d    mg = 0
 *     Q4_1  v = q                              dg = d    mg = m
 *     Q8_0  v = q                              dg = d    mg = 0
 *     Q4_K  v = q sc_j          (<= 945)       dg = d    mg = -dmin m_j
 *     Q5_K  v = q sc_j          (<= 1953)      dg = d    mg = -dmin m_j
 *     Q6_K  v = (q - 32) sc     (|v| <= 4096, a scale per 16)   dg = d   mg = 0
 *     T4    v = q                              dg = d    mg = m    (Q4_0 / Q4_1 tiles: m = -8 d
 *                                                                      for Q4_0)
 *     T8    v = q                              dg = d    mg = 0    (Q8_0 tiles)
 *     T4K   v = q sc_j                         dg = d    mg = -dmin m_j  (Q4_K tiles)
 * and x's group as dx * qx with |qx| <= 16383, so that 32 products (|v qx| <= 4096 * 16383)
 * stay within an int32:
 *     out[b, n] = sum_g  dg dx[b, g] (sum_k qx v)  +  mg xs32[b, g]
 * The K-quants' dg is one d per block of 256, so a run of R groups shares one int32 sum where x
 * has one scale per run too, at most 8191 (Q4_K / T4K: R = 8, 256 x 945 x 8191 < 2^31; Q5_K
 * R = 4, 128 x 1953 x 8191; Q6_K R = 2, 64 x 4096 x 8191): one float step per run instead of
 * per 32, and the mins' FMAs in a loop of their own after the products (in the products' loop
 * they held 8 more registers live: 1.2x the products' rate without them, int8_gemm_floor.c's
 * loop shape on Zen 3). x per 256 at 8191 moves an output by 2^-14 of its 256's largest |x|
 * (per 32 at 16383: 2^-15 of its 32's).
 *
 *   x (once per call): q per chunk of KC columns, per block of BR rows, per pair of columns,
 *     the BR rows' pairs as int32 words side by side: a micro-kernel's x is one stream
 *   per tile of 16 weight rows (quant_gemm.c's threads), per chunk of KC columns:
 *     rows [16][KC] int16 <- each weight row decoded;   dg, mg [KC / 32][16]
 *     panel [KC / 2][16] int32 <- 8 x 8 transposes of rows (a pair of columns is one int32)
 *       (T4 / T8 / T4K / T6K tiles: the panel straight from the tile, no rows, no transposes:
 *        quant_gemm_i16_tiles.c)
 *     per BR rows of x, per pair of columns:  w0 w1 = panel[pair][0 .. 16)
 *         per row r:  acc[r][h] += vpmaddwd(w_h, x[r]'s pair broadcast)          (int32)
 *       per group of 32, per row:  facc[r][h] += cvt(acc[r][h]) * dg dx + mg xs32   (float)
 */
#include <stdlib.h>

#include "quant_blocks.h"

#if QK_SIMD && defined(__F16C__) && defined(__FMA__) && !defined(__AVX512F__)
#define NT 16   /* weight rows per tile: quant_gemm.c's NT on AVX2 */
#define KC 512 /* columns per chunk: a 16 KB panel */
#define SL 256   /* columns of the decoded rows at a time: 8 KB that stay in L1 */
#define RS (SL + 16) /* the decoded rows' stride (int16): 32 bytes past the slice, so that the
                      * transposes' 8 rows do not share L1 sets */
#define BR 3    /* rows of x per micro-kernel: 6 int32 and 6 float accumulators, 2 weights */
#define XMAX 16383.f    /* x per 32 */
#define XMAX_RUN 8191.f /* x per run of 32s (run_groups > 1) */

/* Groups of 32 columns one int32 sum takes (x's scale and the float step per run). */
static int run_groups(int type) {
    return type == T_Q4_K || type == T_T4K           ? 8
           : type == T_Q5_K                          ? 4
           : type == T_Q6_K || type == T_T6K         ? 2
                                                     : 1;
}

int gemm_i16_takes(int type) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0 || type == T_Q4_K ||
           type == T_Q5_K || type == T_Q6_K || type == T_T4 || type == T_T8 || type == T_T4K ||
           type == T_T6K;
}

size_t gemm_i16_scratch_bytes(void) {
    return sizeof(int16_t) * NT * RS + sizeof(int32_t) * NT * KC / 2 +
           2 * sizeof(float) * NT * KC / 32 + 64;
}

size_t gemm_i16_x_bytes(int64_t B, int64_t K) {
    return sizeof(int16_t) * (size_t)((B + BR - 1) / BR * BR * K);
}

/* x's int16 values as the micro-kernel reads them, one stream per chunk of KC columns: chunk
 * by chunk, in it block by block of BR rows, pair of columns by pair, BR rows' pairs side by
 * side (int32 words): 1.07-1.18x at 512 rows over row-major x (1B's shapes, Zen 4 at
 * x86-64-v3), whose chunk is B pieces of 1 KB, K apart. */
static inline int64_t x_pair_at(int64_t B, int64_t K, int64_t b, int64_t k0) {
    const int64_t kc = K - k0 < KC ? K - k0 : KC;
    return k0 / 2 * BR * ((B + BR - 1) / BR) + b / BR * (kc / 2) * BR + b % BR;
}

void gemm_i16_quantize_x(const void *x, int64_t x_stride, int dtype, int type, int64_t b,
                         int64_t B, int64_t K, const xquant_t *xq) {
    const size_t es = dtype == DT_F32 ? 4 : 2;
    const int run = run_groups(type);
    int16_t row[K];
    quantize_x_row_i16((const char *)x + (size_t)(b * x_stride) * es, K, dtype, row,
                       run > 1 ? XMAX_RUN : XMAX, run, xq->d + b * (K / 32),
                       xq->xs32 + b * (K / 32));
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int32_t *dst = (int32_t *)xq->q + x_pair_at(B, K, b, k0);
        for (int64_t p = 0; p < (K - k0 < KC ? K - k0 : KC) / 2; p++)
            memcpy(dst + p * BR, row + k0 + 2 * p, 4);
    }
}

/* 32 values (bytes, signed or not) as int16 (v - off) * sc, the first 16 times sc0, the rest
 * times sc1 (`scaled`: else as they are). */
ALWAYS_INLINE void emit32(int16_t *dst, __m256i bytes, int sgn, int off, int scaled, int sc0,
                          int sc1) {
    const __m128i b0 = _mm256_castsi256_si128(bytes), b1 = _mm256_extracti128_si256(bytes, 1);
    __m256i lo = sgn ? _mm256_cvtepi8_epi16(b0) : _mm256_cvtepu8_epi16(b0);
    __m256i hi = sgn ? _mm256_cvtepi8_epi16(b1) : _mm256_cvtepu8_epi16(b1);
    if (off) {
        lo = _mm256_sub_epi16(lo, _mm256_set1_epi16((short)off));
        hi = _mm256_sub_epi16(hi, _mm256_set1_epi16((short)off));
    }
    if (scaled) {
        lo = _mm256_mullo_epi16(lo, _mm256_set1_epi16((short)sc0));
        hi = _mm256_mullo_epi16(hi, _mm256_set1_epi16((short)sc1));
    }
    _mm256_storeu_si256((__m256i *)dst, lo);
    _mm256_storeu_si256((__m256i *)(dst + 16), hi);
}

/* Q4_0 / Q4_1 / Q8_0: the blocks of columns [k0, k0 + kc) of one row. */
static void decode_32(int type, const uint8_t *row, int64_t k0, int64_t kc, int16_t *v,
                      float *dg, float *mg) {
    const int bytes = type == T_Q8_0 ? 34 : type == T_Q4_1 ? 20 : 18;
    for (int64_t g = 0; g < kc / 32; g++) {
        const uint8_t *blk = row + (k0 / 32 + g) * bytes;
        dg[NT * g] = half_to_f32(blk);
        mg[NT * g] = type == T_Q4_1 ? half_to_f32(blk + 2) : 0.f;
        if (type == T_Q8_0)
            emit32(v + 32 * g, load32(blk + 2), 1, 0, 0, 1, 1);
        else
            emit32(v + 32 * g, q4_block_values(type, blk), 0, type == T_Q4_0 ? 8 : 0, 0, 1, 1);
    }
}

/* Q4_K / Q5_K / Q6_K: the blocks of 256 of columns [k0, k0 + kc) of one row. */
static void decode_k(int type, const uint8_t *row, int64_t k0, int64_t kc, int16_t *v,
                     float *dg, float *mg) {
    const int bytes = type == T_Q6_K ? 210 : type == T_Q5_K ? 176 : 144;
    for (int64_t bi = k0 / 256; bi < (k0 + kc) / 256; bi++) {
        const uint8_t *blk = row + bi * bytes;
        const int64_t g0 = bi * 8 - k0 / 32;
        if (type == T_Q6_K) {
            const float d = half_to_f32(blk + 208);
            const int8_t *sc = (const int8_t *)(blk + 192);
            for (int j = 0; j < 8; j++) { /* half j / 4, quarter j % 4: scales 2 j, 2 j + 1 */
                const int h = j / 4, u = j % 4;
                const __m256i q = k6_bytes(load32(blk + 64 * h + 32 * (u & 1)),
                                           load32(blk + 128 + 32 * h), u);
                dg[NT * (g0 + j)] = d;
                mg[NT * (g0 + j)] = 0.f;
                emit32(v + 32 * (g0 + j), q, 0, 32, 1, sc[2 * j], sc[2 * j + 1]);
            }
            continue;
        }
        uint64_t sc, mn;
        k4_unpack(blk, &sc, &mn);
        const float d = half_to_f32(blk), dmin = half_to_f32(blk + 2);
        for (int j = 0; j < 8; j++) {
            const int s = (int)(sc >> (8 * j) & 0xFF);
            dg[NT * (g0 + j)] = d;
            mg[NT * (g0 + j)] = -dmin * (float)(mn >> (8 * j) & 0xFF);
            emit32(v + 32 * (g0 + j), k45_sub_values(type, blk, j), 0, 0, 1, s, s);
        }
    }
}

/* facc[r][h] (otile's rows) += x rows [mr] times the panel's kc columns, one int32 sum per run
 * of groups; `mins`: then add mg xs32. */
ALWAYS_INLINE void micro(int mr, int mins, int run, const int16_t *x, int64_t K, const float *dx,
                         const float *sx, const int32_t *panel, const float *dg, const float *mg,
                         int64_t kc, float *otile) {
    __m256 facc[BR][2];
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) facc[r][h] = _mm256_loadu_ps(otile + r * NT + 8 * h);
    for (int64_t g = 0; g < kc / 32; g += run) {
        __m256i acc[BR][2];
        for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int q = 0; q < 16 * run; q++) {
            const int32_t *p = panel + (16 * g + q) * NT;
            const __m256i w0 = _mm256_load_si256((const __m256i *)p);
            const __m256i w1 = _mm256_load_si256((const __m256i *)(p + 8));
            for (int r = 0; r < mr; r++) {
                int32_t pair;
                memcpy(&pair, x + 2 * (BR * (16 * g + q) + r), 4);
                const __m256i xb = _mm256_set1_epi32(pair);
                acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, xb));
                acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, xb));
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_load_ps(dg + NT * g + 8 * h);
            for (int r = 0; r < mr; r++) {
                const __m256 s = _mm256_mul_ps(d, _mm256_set1_ps(dx[r * (K / 32) + g]));
                facc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), s, facc[r][h]);
            }
        }
    }
    if (mins)
        for (int64_t g = 0; g < kc / 32; g++)
            for (int h = 0; h < 2; h++) {
                const __m256 m = _mm256_load_ps(mg + NT * g + 8 * h);
                for (int r = 0; r < mr; r++)
                    facc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * (K / 32) + g]),
                                                 facc[r][h]);
            }
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(otile + r * NT + 8 * h, facc[r][h]);
}

/* micro with its row count, mins and run as constants (the types' combinations). */
static void micro_any(int mr, int type, const int16_t *x, int64_t K, const float *dx,
                      const float *sx, const int32_t *panel, const float *dg, const float *mg,
                      int64_t kc, float *otile) {
#define MICRO(MINS, RUN)                                                                      \
    do {                                                                                     \
        if (mr == 1) micro(1, MINS, RUN, x, K, dx, sx, panel, dg, mg, kc, otile);            \
        else if (mr == 2) micro(2, MINS, RUN, x, K, dx, sx, panel, dg, mg, kc, otile);       \
        else micro(BR, MINS, RUN, x, K, dx, sx, panel, dg, mg, kc, otile);                   \
    } while (0)
    switch (run_groups(type)) {
    case 8: MICRO(1, 8); break; /* Q4_K, T4K */
    case 4: MICRO(1, 4); break; /* Q5_K */
    case 2: MICRO(0, 2); break; /* Q6_K */
    default:
        if (type == T_Q4_1 || type == T_T4) MICRO(1, 1);
        else MICRO(0, 1); /* Q4_0, Q8_0, T8 */
    }
#undef MICRO
}

/* The decoded rows [16][sl] (rows past nt zeroed here) turned into int32 pairs [sl / 2][16]. */
static void panel_pairs(int16_t *rows, int64_t nt, int64_t sl, float *dg, float *mg,
                        int32_t *panel) {
    for (int64_t c = nt; c < NT; c++) {
        memset(rows + c * RS, 0, sizeof(int16_t) * (size_t)sl);
        for (int64_t g = 0; g < sl / 32; g++) dg[NT * g + c] = mg[NT * g + c] = 0.f;
    }
    for (int64_t k = 0; k < sl; k += 16)
        for (int64_t c = 0; c < NT; c += 8)
            transpose8x8_ps((const float *)(rows + c * RS + k), RS / 2,
                            (float *)(panel + k / 2 * NT + c), NT);
}

/* One byte of every cache line of the nt rows' blocks of columns [k0, k0 + kc), loaded: the
 * rows are 16 streams far apart, visited a chunk each in turn with micro-kernels between, that
 * the hardware prefetcher does not follow. The decode's loads came one miss at a time (57% of
 * its perf samples on each block's first load, Q6_K at 32 rows of x, Zen 3); these independent
 * loads overlap. (prefetcht0 / prefetcht1 of the same lines, burst or spread over the micro-
 * kernels, changed nothing there: 1.00x.) */
static void touch_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t nt, int64_t k0,
                       int64_t kc) {
    int elems = 32, per = 18; /* (set for every type this file takes) */
    block_shape(type, &elems, &per);
    const int64_t from = k0 / elems * per, bytes = (kc + elems - 1) / elems * per;
    uint32_t acc = 0;
    for (int64_t c = 0; c < nt; c++)
        for (int64_t o = 0; o < bytes; o += 64) acc += w[c * row_bytes + from + o];
    __asm__ volatile("" : : "r"(acc)); /* keeps the loads */
}

/* The file's blocks of the tile's nt rows, columns [k0, k0 + kc), into the panel, SL columns at
 * a time: the decoded rows stay in L1, where the whole chunk's (16 KB) went out beside the
 * panel and x's chunk (perf, Q6_K at 32 rows of x, Zen 3: the decode's share of the GEMM
 * 0.66 -> 0.53 of the micro-kernels', before touch_rows took most of the rest). */
static void decode_rows_panel(int type, const uint8_t *w, int64_t row_bytes, int64_t nt,
                              int64_t k0, int64_t kc, int16_t *rows, int32_t *panel, float *dg,
                              float *mg) {
    const int kquant = type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
    touch_rows(type, w, row_bytes, nt, k0, kc);
    for (int64_t s0 = 0; s0 < kc; s0 += SL) {
        const int64_t sl = kc - s0 < SL ? kc - s0 : SL;
        float *sdg = dg + NT * (s0 / 32), *smg = mg + NT * (s0 / 32);
        for (int64_t c = 0; c < nt; c++)
            (kquant ? decode_k : decode_32)(type, w + c * row_bytes, k0 + s0, sl, rows + c * RS,
                                            sdg + c, smg + c);
        panel_pairs(rows, nt, sl, sdg, smg, panel + s0 / 2 * NT);
    }
}

void gemm_i16_tile(const uint8_t *w, int64_t row_bytes, int type, const xquant_t *xq, int64_t B,
                   int64_t K, int64_t n0, int64_t nt, void *scratch, float *otile) {
    char *base = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    int32_t *panel = (int32_t *)base; /* 32-byte aligned: the micro-kernel's loads */
    float *dg = (float *)(panel + NT * KC / 2), *mg = dg + NT * KC / 32;
    int16_t *rows = (int16_t *)(mg + NT * KC / 32);
    memset(otile, 0, sizeof(float) * (size_t)(B * NT));
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        if (IS_TILED(type)) /* n0 is a tile's first row (NT = 16), nt = 16 */
            gemm_i16_tile_panel(type, w + n0 * row_bytes, k0, kc, panel, dg, mg);
        else
            decode_rows_panel(type, w + n0 * row_bytes, row_bytes, nt, k0, kc, rows, panel, dg,
                              mg);
        for (int64_t b = 0; b < B; b += BR)
            micro_any((int)(B - b < BR ? B - b : BR), type,
                      xq->q + 2 * x_pair_at(B, K, b, k0), K,
                      xq->d + b * (K / 32) + k0 / 32, xq->xs32 + b * (K / 32) + k0 / 32, panel,
                      dg, mg, kc, otile + b * NT);
    }
}
#else
int gemm_i16_takes(int type) {
    (void)type;
    return 0;
}

size_t gemm_i16_scratch_bytes(void) { return 0; }

size_t gemm_i16_x_bytes(int64_t B, int64_t K) {
    (void)B, (void)K;
    return 0;
}

void gemm_i16_quantize_x(const void *x, int64_t x_stride, int dtype, int type, int64_t b,
                         int64_t B, int64_t K, const xquant_t *xq) {
    (void)x, (void)x_stride, (void)dtype, (void)type, (void)b, (void)B, (void)K, (void)xq;
}

void gemm_i16_tile(const uint8_t *w, int64_t row_bytes, int type, const xquant_t *xq, int64_t B,
                   int64_t K, int64_t n0, int64_t nt, void *scratch, float *otile) {
    (void)w, (void)row_bytes, (void)type, (void)xq, (void)B, (void)K, (void)n0, (void)nt,
        (void)scratch, (void)otile;
}
#endif
