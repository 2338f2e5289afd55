/*
 * Matrix products with GGUF-quantized weights, computed from the blocks as the file stores them.
 * Built with cpu_kernels.c into one library (see native_kernels.py for the build and threads).
 *
 * out[b, n] = sum_k x[b, k] * W[n, k] for a weight W [N, K] held as GGML blocks, row by row
 * (a row of K elements is K / (elements per block) blocks, `row_bytes` apart).
 *
 * How (llama.cpp's scheme on CPUs, written afresh here, with 16-bit activations):
 *   1. x is quantized per 32 elements to int16:  x ~ xd * xq,  xd = max|x| / 32767, and the
 *      sums of xq per half (16 elements) and per 32 are kept scaled: xs = xd * sum(xq)
 *      (quant_activations.c). (int8 activations, as llama.cpp uses, agreed with float32 at
 *      98.05% top-1 on the default model; int16 at 100%: int8 is opt-in, quant_rows_int8.c.)
 *   2. Each weight row is read as "sub-blocks" of 32 small integers q with, per half of 16, a
 *      scale s and an offset m:  w = s * q + m  (every GGUF type fits that form exactly:
 *      Q4_0 m = -8 d; Q4_1 m = min; Q8_0 m = 0 with q signed; Q4_K/Q5_K s = d * sc_j,
 *      m = -dmin * m_j; Q6_K s = d * sc, m = -32 s).
 *   3. Per sub-block and row of x:  sum w x = xd * (s . int_dot(q, xq)) + m . xs, the integer
 *      dot product by vpmaddwd (AVX-512 or AVX2 registers) or plain C.
 * With SIMD each weight row is decoded in registers while it is multiplied with up to 4 rows
 * of x (fused_row; r_row for the repacked R4 / R8 rows); the portable path decodes a row into
 * scratch once (decode_row) and reuses it for every row of x.
 *
 * GGML block layouts (little-endian; f16 = IEEE half):
 *   Q4_0  18 B / 32:  f16 d | u8 qs[16]      element i: qs[i] & 15, element i+16: qs[i] >> 4
 *   Q4_1  20 B / 32:  f16 d | f16 m | u8 qs[16]                      (same nibble order)
 *   Q8_0  34 B / 32:  f16 d | i8 qs[32]
 *   Q4_K 144 B / 256: f16 d | f16 dmin | u8 scales[12] | u8 qs[128]
 *         sub-block j (32 elements): nibbles of qs[32 (j/2) ..], low for even j, high for odd;
 *         6-bit scale sc_j and min m_j packed in `scales` (see scale_min_k4)
 *   Q5_K 176 B / 256: f16 d | f16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]
 *         as Q4_K plus a fifth bit: bit j of qh[l] for element l of sub-block j
 *   Q6_K 210 B / 256: u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d
 *         sub-block j = 4 h + k: low 4 bits from ql[64 h + 32 (k & 1) + l] (low nibble for
 *         k < 2), high 2 bits (qh[32 h + l] >> 2 k) & 3; scales[8 h + 2 k + l / 16]; q - 32
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_row_tables.h"


static void set_halves(row_t *r, int64_t sub, float s, float m) {
    r->s[2 * sub] = r->s[2 * sub + 1] = s;
    r->m[2 * sub] = r->m[2 * sub + 1] = m;
}

static void decode_q4(const uint8_t *blk, int64_t sub, row_t *r, int type) {
    const float d = half_to_f32(blk);
    const uint8_t *qs = blk + (type == T_Q4_1 ? 4 : 2);
    uint8_t *q = r->q + 32 * sub;
#if QK_SIMD
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(0xF);
    store32(q, _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4)));
#else
    for (int l = 0; l < 16; l++) {
        q[l] = qs[l] & 0xF;
        q[l + 16] = qs[l] >> 4;
    }
#endif
    set_halves(r, sub, d, type == T_Q4_1 ? half_to_f32(blk + 2) : -8.f * d);
}

static void decode_q8_0(const uint8_t *blk, int64_t sub, row_t *r) {
    memcpy(r->q + 32 * sub, blk + 2, 32);
    set_halves(r, sub, half_to_f32(blk), 0.f);
}

/* The 32 values of Q4_K/Q5_K sub-block j (0..7) into q. */
static inline void k_quant_values(const uint8_t *qs, const uint8_t *qh, int j, uint8_t *q) {
#if QK_SIMD
    const __m256i v = load32(qs + 32 * (j / 2));
    __m256i vals = (j & 1) ? high_nibbles(v) : low_nibbles(v);
    if (qh != NULL) {
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(load32(qh), j), _mm256_set1_epi8(1));
        vals = _mm256_or_si256(vals, _mm256_slli_epi16(bit, 4));
    }
    store32(q, vals);
#else
    const uint8_t *src = qs + 32 * (j / 2);
    for (int l = 0; l < 32; l++) q[l] = (j & 1) ? src[l] >> 4 : src[l] & 0xF;
    if (qh != NULL)
        for (int l = 0; l < 32; l++) q[l] |= ((qh[l] >> j) & 1) << 4;
#endif
}

static void decode_q45_k(const uint8_t *blk, int64_t sub0, row_t *r, int type) {
    const float d = half_to_f32(blk), dmin = half_to_f32(blk + 2);
    const uint8_t *scales = blk + 4;
    const uint8_t *qh = type == T_Q5_K ? blk + 16 : NULL;
    const uint8_t *qs = blk + (type == T_Q5_K ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        uint8_t sc, mn;
        scale_min_k4(j, scales, &sc, &mn);
        k_quant_values(qs, qh, j, r->q + 32 * (sub0 + j));
        set_halves(r, sub0 + j, d * (float)sc, -dmin * (float)mn);
    }
}

static void decode_q6_k(const uint8_t *blk, int64_t sub0, row_t *r) {
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t *scales = (const int8_t *)(blk + 192);
    const float d = half_to_f32(blk + 208);
    for (int j = 0; j < 8; j++) {
        const int h = j / 4, k = j % 4;
        const uint8_t *lo = ql + 64 * h + 32 * (k & 1), *hi = qh + 32 * h;
        uint8_t *q = r->q + 32 * (sub0 + j);
#if QK_SIMD
        const __m256i nib = k < 2 ? low_nibbles(load32(lo)) : high_nibbles(load32(lo));
        const __m256i top = _mm256_and_si256(_mm256_srli_epi16(load32(hi), 2 * k),
                                             _mm256_set1_epi8(3));
        store32(q, _mm256_or_si256(nib, _mm256_slli_epi16(top, 4)));
#else
        for (int l = 0; l < 32; l++) {
            const uint8_t nib = k < 2 ? lo[l] & 0xF : lo[l] >> 4;
            q[l] = nib | (((hi[l] >> (2 * k)) & 3) << 4);
        }
#endif
        for (int half = 0; half < 2; half++) {
            const float s = d * (float)scales[8 * h + 2 * k + half];
            r->s[2 * (sub0 + j) + half] = s;
            r->m[2 * (sub0 + j) + half] = -32.f * s;
        }
    }
}

static void decode_r_row(const uint8_t *w, int64_t K, int type, row_t *r) {
    const uint8_t *scales = w + (type == T_R4 ? K / 2 : K);
    for (int64_t sub = 0; sub < K / 32; sub++) {
        const float d = half_to_f32(scales + 2 * sub);
        const float m = type == T_R4 ? half_to_f32(scales + K / 16 + 2 * sub) : 0.f;
        set_halves(r, sub, d, m);
        uint8_t *q = r->q + 32 * sub;
        if (type == T_R8) {
            memcpy(q, w + 32 * sub, 32);
        } else {
            const uint8_t *nib = w + 32 * (sub / 2);
            for (int l = 0; l < 32; l++) q[l] = (sub & 1) ? nib[l] >> 4 : nib[l] & 0xF;
        }
    }
}

void decode_row_at(const uint8_t *w, int64_t row_bytes, int64_t n, int64_t K, int type, row_t *r) {
    if (IS_TILED(type))
        decode_tile_row(type, w + (n - n % 16) * row_bytes, (int)(n % 16), K, r);
    else
        decode_row(w + n * row_bytes, K, type, r);
}

/* Decode one weight row of K elements (K a multiple of the type's block). */
void decode_row(const uint8_t *w, int64_t K, int type, row_t *r) {
    if (type == T_R4 || type == T_R8) {
        decode_r_row(w, K, type, r);
        return;
    }
    int elems = 32, bytes = 0;
    block_shape(type, &elems, &bytes);
    for (int64_t b = 0; b < K / elems; b++) {
        const uint8_t *blk = w + b * bytes;
        const int64_t sub = b * elems / 32;
        switch (type) {
        case T_Q4_0:
        case T_Q4_1: decode_q4(blk, sub, r, type); break;
        case T_Q8_0: decode_q8_0(blk, sub, r); break;
        case T_Q4_K:
        case T_Q5_K: decode_q45_k(blk, sub, r, type); break;
        default: decode_q6_k(blk, sub, r); break;
        }
    }
}

/* sum over the row's halves of m * xs: the offsets' share of the dot product. */
static inline float offset_dot(const float *m, const float *xs, int64_t halves) {
    float acc = 0.f;
    for (int64_t i = 0; i < halves; i++) acc += m[i] * xs[i];
    return acc;
}

/* Portable path: the row decoded by decode_row, times one row of x (int16, or int8: q8). */
static float dot_row_scalar(const row_t *r, const xquant_t *xq, int64_t b, int64_t K,
                            int is_signed) {
    const int16_t *x = xq->q8 ? NULL : xq->q + b * K;
    const int8_t *x8 = xq->q8 ? xq->q8 + b * K : NULL;
    float acc = 0.f;
    for (int64_t h = 0; h < K / 16; h++) {
        int32_t dot = 0;
        for (int l = 0; l < 16; l++) {
            const int32_t w = is_signed ? (int32_t)(int8_t)r->q[16 * h + l] : r->q[16 * h + l];
            dot += w * (int32_t)(x8 ? x8[16 * h + l] : x[16 * h + l]);
        }
        acc += r->s[h] * xq->d[b * (K / 32) + h / 2] * (float)dot;
    }
    return acc + offset_dot(r->m, xq->xs + b * (K / 16), K / 16);
}

static void row_times_x(const row_t *r, const xquant_t *xq, int64_t B, int64_t K, int is_signed,
                        void *out, int64_t out_stride, int64_t n, int out_dtype) {
    for (int64_t b = 0; b < B; b++)
        store_out(out, b * out_stride + n, dot_row_scalar(r, xq, b, K, is_signed), out_dtype);
}

/* quant_gemm.c's view of block_shape. */
int quant_block_shape(int type, int *elems, int *bytes) { return block_shape(type, elems, bytes); }

static void free_rows(row_t *rows, int threads) {
    for (int t = 0; t < threads; t++) {
        free(rows[t].q);
        free(rows[t].s);
        free(rows[t].m);
    }
    free(rows);
}

/* One decoded-row scratch per thread; NULL when out of memory. */
static row_t *alloc_rows(int threads, int64_t K) {
    row_t *rows = calloc((size_t)threads, sizeof(row_t));
    if (rows == NULL) return NULL;
    int ok = 1;
    for (int t = 0; t < threads; t++) {
        rows[t].q = malloc((size_t)K);
        rows[t].s = malloc(sizeof(float) * (size_t)(K / 16));
        rows[t].m = malloc(sizeof(float) * (size_t)(K / 16));
        ok = ok && rows[t].q && rows[t].s && rows[t].m;
    }
    if (ok) return rows;
    free_rows(rows, threads);
    return NULL;
}

/*
 * out[b * out_stride + n] = sum_k x[b * x_stride + k] * W[n, k] for b < B, n < N.
 * w: N rows of K elements of ggml `type`, row_bytes apart. x: dtype (0 f32, 1 bf16) rows;
 * out: out_dtype rows. Returns 0, -1 when out of memory, -2 for a type or K it cannot handle.
 */
int quant_matmul(void *out, int64_t out_stride, int out_dtype, const void *x, int64_t x_stride,
                 int dtype, const uint8_t *w, int64_t row_bytes, int type, int64_t B, int64_t N,
                 int64_t K, int num_threads) {
    int elems, bytes;
    if (!block_shape(type, &elems, &bytes) || K % elems || row_bytes < K / elems * bytes ||
        (IS_TILED(type) && N % 16))
        return -2;
    const int int8 = quant_int8_takes(type); /* else int16 */
#if QK_SIMD
    const int unpack = !int8 && rows_take_unpack_x(type, B);
#else
    const int unpack = 0;
#endif
    /* x's quantized parts in one allocation (a decode step makes four products a layer, and
     * five allocations a product showed in its profile), each part 64-byte aligned. */
    const size_t parts[6] = {int8 ? 0 : sizeof(int16_t) * (size_t)(B * K),
                             sizeof(float) * (size_t)(B * (K / 32)),
                             sizeof(float) * (size_t)(B * (K / 16)),
                             sizeof(float) * (size_t)(B * (K / 32)),
                             int8 ? (size_t)(B * K) : 0,
                             unpack ? sizeof(int16_t) * (size_t)K : 0};
    size_t offs[6], total = 0;
    for (int i = 0; i < 6; i++) {
        offs[i] = total;
        total += (parts[i] + 63) / 64 * 64;
    }
    char *xbuf = aligned_alloc(64, total); /* a multiple of 64, never 0 (K >= 32) */
    if (xbuf == NULL) return -1;
    xquant_t xq = {int8 ? NULL : (int16_t *)(xbuf + offs[0]), (float *)(xbuf + offs[1]),
                   (float *)(xbuf + offs[2]), (float *)(xbuf + offs[3]),
                   int8 ? (int8_t *)(xbuf + offs[4]) : NULL,
                   unpack ? (int16_t *)(xbuf + offs[5]) : NULL};
    int rc = 0;
    const size_t esize = dtype == DT_F32 ? 4 : 2;
    for (int64_t b = 0; b < B; b++) {
        const void *xb = (const char *)x + (size_t)(b * x_stride) * esize;
        float *d = xq.d + b * (K / 32), *xs = xq.xs + b * (K / 16), *xs32 = xq.xs32 + b * (K / 32);
        quantize_x_row(xb, K, dtype, int8 ? NULL : xq.q + b * K, int8 ? xq.q8 + b * K : NULL, d,
                       xs, xs32);
    }
    const int threads = B * N * K >= QPARALLEL_MIN ? num_threads : 1;
#if QK_SIMD
    if (unpack) unpack_order_x(xq.q, K, xq.xu);
    const rows_fn *int8_fns = int8 ? int8_row_fns(type) : NULL;
    if (int8_fns != NULL) {
        run_rows(int8_fns, w, row_bytes, &xq, B, N, K, out, out_stride, out_dtype, threads);
        goto done;
    }
    if (!int8 && (IS_TILED(type) ? quant_tiles_simd(w, row_bytes, type, &xq, B, N, K, out,
                                                   out_stride, out_dtype, threads)
                                : quant_rows_simd(w, row_bytes, type, &xq, B, N, K, out,
                                                  out_stride, out_dtype, threads)))
        goto done;
#endif
    const int is_signed = type == T_Q8_0 || type == T_R8 || type == T_T8;
    row_t *rows = alloc_rows(threads, K);
    if (rows == NULL) {
        rc = -1;
        goto done;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        row_t *r = rows + omp_get_thread_num();
        decode_row_at(w, row_bytes, n, K, type, r);
        row_times_x(r, &xq, B, K, is_signed, out, out_stride, n, out_dtype);
    }
    free_rows(rows, threads);
done:
    free(xbuf);
    return rc;
}

/*
 * out[i, :] = dequantized row ids[i] of W (the embedding lookup of a quantized table), as
 * w = s * (q + qoff) + m' per half, the order in which the gguf package dequantizes, so the
 * result equals its float32 values. Returns like quant_matmul.
 */
int quant_dequantize_rows(void *out, int out_dtype, const uint8_t *w, int64_t row_bytes,
                          int type, const int64_t *ids, int64_t n_ids, int64_t K,
                          int num_threads) {
    int elems, bytes;
    if (!block_shape(type, &elems, &bytes) || K % elems || row_bytes < K / elems * bytes)
        return -2;
    const int is_signed = type == T_Q8_0 || type == T_R8 || type == T_T8;
    /* Q4_0 and Q6_K keep their -8 / -32 on the integer, as the reference does. */
    const int qoff = type == T_Q4_0 ? -8 : type == T_Q6_K || type == T_T6K ? -32 : 0;
    const int threads = n_ids * K >= QPARALLEL_MIN ? num_threads : 1;
    row_t *rows = alloc_rows(threads, K);
    if (rows == NULL) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n_ids; i++) {
        row_t *r = rows + omp_get_thread_num();
        decode_row_at(w, row_bytes, ids[i], K, type, r);
        for (int64_t k = 0; k < K; k++) {
            const int32_t q = is_signed ? (int32_t)(int8_t)r->q[k] : r->q[k];
            const float m = qoff ? 0.f : r->m[k / 16];
            store_out(out, i * K + k, r->s[k / 16] * (float)(q + qoff) + m, out_dtype);
        }
    }
    free_rows(rows, threads);
    return 0;
}
