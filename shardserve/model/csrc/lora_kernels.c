/*
 * LoRA adapters' share of a projection, for a batch whose tokens each use one adapter slot (or
 * none): the "shrink" x.A^T and the "expand" (.B^T, scaled) of every adapted token at once,
 * grouped by slot (shardserve/model/lora.py; the fused decode step calls it too).
 *
 *   for every token t with slot s = slots[t] >= 0:
 *       u[r]       = sum_k a[s, r, k] * x[t, k]                       r < R   (shrink)
 *       out[t, n] += sum_{r in seg(n)} u[r] * bt[s, r, n]             n < N   (expand)
 *
 * Layouts (row-major, `wdtype` f32 or bf16; x and out in `dtype`, rows x_stride / out_stride
 * elements apart):
 *   a  [S, R, K]   A of every slot; a merged layer (q|k|v, gate|up) stacks its parts' A along R
 *   bt [S, R, N]   B transposed, the scaling folded in: the expand is then a sum of rows of
 *                  bt, unit stride along n, which vectorises (B's own [N, R] would make it a
 *                  dot product of length R per output, a horizontal sum each)
 *   seg_ends [nseg] output boundaries of a merged layer's parts: part j covers
 *                  n in [seg_ends[j-1], seg_ends[j]) and r in [j R/nseg, (j+1) R/nseg), so the
 *                  zero blocks of the block-diagonal B are skipped (nseg 1: one part).
 *
 * Tokens are visited in slot order (a counting sort), so each slot's A and B are read while they
 * are in cache for all its tokens. float32 accumulation throughout; the order of the sums is
 * fixed by the shapes alone, so a token's result does not depend on its batch.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels_common.h"

/* Below this many multiply-adds a call runs on one thread (a parallel region costs more). */
#define LORA_PARALLEL_MIN (1 << 18)
/* Output columns per unit of parallel work in the expand. */
#define LORA_CHUNK 256

static inline float load_el(const void *p, int64_t i, int dtype) {
    return dtype == DT_F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

/* dst[0..n) = row (f32 or bf16) as float32. */
static void to_f32(float *dst, const void *row, int64_t n, int dtype) {
    if (dtype == DT_F32) {
        memcpy(dst, row, sizeof(float) * (size_t)n);
        return;
    }
    const uint16_t *h = row;
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(h[i]);
}

/* Element i of a weight row, f32 or bf16 (WD a constant at every call: no branch remains). */
ALWAYS_INLINE float wload(int WD, const void *row, int64_t i) {
    return WD == DT_F32 ? ((const float *)row)[i] : bf16_to_f32(((const uint16_t *)row)[i]);
}

/* u[0..4) = rows a, a + K, a + 2K, a + 3K (elements) dotted with x: four independent sums, so
 * the vectorised loop is not bound by one accumulator's latency, and x is loaded once for four.
 * Every row goes through the same code whatever the batch, so a token's sums do not depend on
 * it. */
ALWAYS_INLINE void dot4(int WD, float *u, const void *a, const float *x, int64_t K) {
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    for (int64_t i = 0; i < K; i++) {
        s0 += wload(WD, a, i) * x[i];
        s1 += wload(WD, a, K + i) * x[i];
        s2 += wload(WD, a, 2 * K + i) * x[i];
        s3 += wload(WD, a, 3 * K + i) * x[i];
    }
    u[0] = s0, u[1] = s1, u[2] = s2, u[3] = s3;
}

ALWAYS_INLINE float dot1(int WD, const void *a, const float *x, int64_t K) {
    float acc = 0.f;
    for (int64_t i = 0; i < K; i++) acc += wload(WD, a, i) * x[i];
    return acc;
}

/* u[0..R) = each of the R rows of a dotted with x. */
ALWAYS_INLINE void dot_rows(int WD, float *u, const void *a, const float *x, int64_t K,
                            int64_t R) {
    const size_t ws = WD == DT_F32 ? 4 : 2;
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) dot4(WD, u + r, (const char *)a + (size_t)(r * K) * ws, x, K);
    for (; r < R; r++) u[r] = dot1(WD, (const char *)a + (size_t)(r * K) * ws, x, K);
}

/* acc[0..n) += u * row[0..n) (row f32 or bf16). */
static void axpy(float *acc, float u, const void *row, int64_t n, int wdtype) {
    if (wdtype == DT_F32) {
        const float *w = row;
        for (int64_t i = 0; i < n; i++) acc[i] += u * w[i];
    } else {
        const uint16_t *w = row;
        for (int64_t i = 0; i < n; i++) acc[i] += u * bf16_to_f32(w[i]);
    }
}

/* The adapted tokens in slot order; returns how many (tokens with slot < 0 are left out). */
static int64_t order_by_slot(const int32_t *slots, int64_t T, int64_t S, int64_t *order) {
    int64_t count = 0;
    for (int64_t s = 0; s < S; s++)
        for (int64_t t = 0; t < T; t++)
            if (slots[t] == s) order[count++] = t;
    return count;
}

/* xf: `threads` scratch rows of K floats (x's row as float32). */
static void shrink(float *u, float *xf, const int64_t *order, int64_t n_tok, const int32_t *slots,
                   const void *x, int64_t x_stride, int dtype, const void *a, int wdtype,
                   int64_t R, int64_t K, int threads) {
    const size_t es = dtype == DT_F32 ? 4 : 2, ws = wdtype == DT_F32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n_tok; i++) {
        const int64_t t = order[i];
        float *xt = xf + (size_t)omp_get_thread_num() * (size_t)K;
        to_f32(xt, (const char *)x + (size_t)(t * x_stride) * es, K, dtype);
        const char *as = (const char *)a + (size_t)((int64_t)slots[t] * R * K) * ws;
        if (wdtype == DT_F32)
            dot_rows(DT_F32, u + i * R, as, xt, K, R);
        else
            dot_rows(DT_BF16, u + i * R, as, xt, K, R);
    }
}

/* Columns the expand keeps in registers across its sum over r (8 AVX2 / 4 AVX-512 vectors). */
#define LORA_REG_COLS 64

/* acc[0..LORA_REG_COLS) += sum_r u[r] * rows[r * N ..]: acc stays in registers. */
ALWAYS_INLINE void expand_block(int WD, float *restrict acc, const float *u, const void *rows,
                                int64_t N, int64_t r0, int64_t r1) {
    const size_t ws = WD == DT_F32 ? 4 : 2;
    float v[LORA_REG_COLS];
    for (int j = 0; j < LORA_REG_COLS; j++) v[j] = acc[j];
    for (int64_t r = r0; r < r1; r++) {
        const float ur = u[r];
        const void *w = (const char *)rows + (size_t)(r * N) * ws;
        for (int j = 0; j < LORA_REG_COLS; j++) v[j] += ur * wload(WD, w, j);
    }
    for (int j = 0; j < LORA_REG_COLS; j++) acc[j] = v[j];
}

/* out[t, n0..n1) += the expand of one token (u: its shrink), for the part whose r range is
 * [r0, r1); bts: its slot's bt. */
static void expand_chunk(void *out, int64_t out_stride, int dtype, int64_t t, const float *u,
                         const char *bts, int wdtype, int64_t N, int64_t n0, int64_t n1,
                         int64_t r0, int64_t r1) {
    const size_t ws = wdtype == DT_F32 ? 4 : 2;
    float acc[LORA_CHUNK];
    const int64_t len = n1 - n0;
    for (int64_t j = 0; j < len; j++) acc[j] = load_el(out, t * out_stride + n0 + j, dtype);
    int64_t j0 = 0;
    for (; j0 + LORA_REG_COLS <= len; j0 += LORA_REG_COLS) {
        const char *rows = bts + (size_t)(n0 + j0) * ws;
        if (wdtype == DT_F32)
            expand_block(DT_F32, acc + j0, u, rows, N, r0, r1);
        else
            expand_block(DT_BF16, acc + j0, u, rows, N, r0, r1);
    }
    for (int64_t r = r0; r < r1 && j0 < len; r++)
        axpy(acc + j0, u[r], bts + (size_t)(r * N + n0 + j0) * ws, len - j0, wdtype);
    if (dtype == DT_F32) {
        memcpy((float *)out + t * out_stride + n0, acc, sizeof(float) * (size_t)len);
    } else {
        uint16_t *o = (uint16_t *)out + t * out_stride + n0;
        for (int64_t j = 0; j < len; j++) o[j] = f32_to_bf16(acc[j]);
    }
}

static void expand(void *out, int64_t out_stride, int dtype, const int64_t *order, int64_t n_tok,
                   const int32_t *slots, const float *u, const void *bt, int wdtype, int64_t R,
                   int64_t N, const int64_t *seg_ends, int64_t nseg, int threads) {
    const size_t ws = wdtype == DT_F32 ? 4 : 2;
    const int64_t chunks = (N + LORA_CHUNK - 1) / LORA_CHUNK, part_r = R / nseg;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t c0 = c * LORA_CHUNK, c1 = c0 + LORA_CHUNK < N ? c0 + LORA_CHUNK : N;
        int64_t seg_start = 0;
        for (int64_t j = 0; j < nseg; j++) {  /* the parts this chunk overlaps */
            const int64_t n0 = c0 > seg_start ? c0 : seg_start;
            const int64_t n1 = c1 < seg_ends[j] ? c1 : seg_ends[j];
            seg_start = seg_ends[j];
            if (n0 >= n1) continue;
            for (int64_t i = 0; i < n_tok; i++) {
                const int64_t t = order[i];
                const char *bts = (const char *)bt + (size_t)((int64_t)slots[t] * R * N) * ws;
                expand_chunk(out, out_stride, dtype, t, u + i * R, bts, wdtype, N, n0, n1,
                             j * part_r, (j + 1) * part_r);
            }
        }
    }
}

/*
 * Adds the adapters' share into out (see the top of this file). slots: int32 [T], -1 for a token
 * without an adapter, else < S. Returns 0, -1 when out of memory, -2 for bad segments.
 */
int lora_add(void *out, int64_t out_stride, int dtype, const void *x, int64_t x_stride,
             const int32_t *slots, int64_t T, const void *a, const void *bt, int wdtype,
             int64_t S, int64_t R, int64_t K, int64_t N, const int64_t *seg_ends, int64_t nseg,
             int num_threads) {
    if (nseg < 1 || R % nseg || seg_ends[nseg - 1] != N) return -2;
    const int64_t rows = T > 0 ? T : 1;
    int64_t *order = malloc(sizeof(int64_t) * (size_t)rows);
    float *u = malloc(sizeof(float) * (size_t)(rows * R));
    float *xf = malloc(sizeof(float) * (size_t)(num_threads > 0 ? num_threads : 1) * (size_t)K);
    if (order == NULL || u == NULL || xf == NULL) {
        free(order);
        free(u);
        free(xf);
        return -1;
    }
    const int64_t n_tok = order_by_slot(slots, T, S, order);
    const int threads = n_tok * R * (K + N / nseg) >= LORA_PARALLEL_MIN ? num_threads : 1;
    if (n_tok > 0) {
        shrink(u, xf, order, n_tok, slots, x, x_stride, dtype, a, wdtype, R, K, threads);
        expand(out, out_stride, dtype, order, n_tok, slots, u, bt, wdtype, R, N, seg_ends, nseg,
               threads);
    }
    free(u);
    free(order);
    free(xf);
    return 0;
}
