/*
 * LoRA adapters' share of a projection, for a batch whose tokens each use one adapter slot (or
 * none): the "shrink" x.A^T and the "expand" (.B^T, scaled) of every adapted token at once,
 * grouped by slot (shardserve/model/lora.py; the fused decode step calls it too).
 *
 *   for every token t with slot s = slots[t] >= 0:
 *       u[r]       = sum_k at[s, k, r] * x[t, k]                      r < R   (shrink)
 *       out[t, n] += sum_{r in seg(n)} u[r] * bt[s, r, n]             n < N   (expand)
 *
 * Layouts (row-major, `wdtype` f32 or bf16; x and out in `dtype`, rows x_stride / out_stride
 * elements apart):
 *   at [S, K, R]   A transposed, of every slot; a merged layer (q|k|v, gate|up) stacks its
 *                  parts' A along R
 *   bt [S, R, N]   B transposed, the scaling folded in
 *   seg_ends [nseg] output boundaries of a merged layer's parts: part j covers
 *                  n in [seg_ends[j-1], seg_ends[j]) and r in [j R/nseg, (j+1) R/nseg), so the
 *                  zero blocks of the block-diagonal B are skipped (nseg 1: one part).
 *
 * Both products are then sums of weight rows scaled by one number each (a row of at by x[t, k],
 * a row of bt by u[r]): unit stride along the output, vectorised along it, no horizontal sums.
 * Tokens are visited in slot order (a counting sort) in runs of up to LORA_TOKENS of one slot,
 * and each weight element loaded serves the whole run. Every output element is one float32 sum
 * in the order of its index (k, or r), whatever else shares the run: a token's result does not
 * depend on its batch.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels_common.h"

#if defined(__GNUC__) && !defined(__clang__) && !defined(__AVX2__)
/* GCC 12's loop vectorizer at the SSE4 level (the portable x86-64-v2 build) gives wrong sums in
 * rows_times for runs of two or more tokens (tests/model/test_lora_kernels.py; right at -O1,
 * with the sanitizers, at x86-64-v3 and v4, and without loop vectorisation): off here. */
#pragma GCC optimize("no-tree-loop-vectorize")
#endif

/* Below this many multiply-adds a call runs on one thread (a parallel region costs more). */
#define LORA_PARALLEL_MIN (1 << 14)
/* Units of parallel work in the expand per thread (output column ranges, whole register
 * blocks): several each, so that a few hundred columns still split evenly. */
#define LORA_CHUNKS_PER_THREAD 4
/* Tokens of one slot that share each weight load; output columns held in registers per token
 * (LORA_TOKENS x LORA_COLS floats: 8 AVX-512 or 16 AVX2 registers). */
#define LORA_TOKENS 8
#define LORA_COLS 32
/* Bytes ahead of each weight row read that rows_times prefetches. */
#define LORA_PREFETCH 256
/* Pieces of the shrink's k range (see shrink). */
#define LORA_KSPLIT 2

/* f32_to_bf16 (round to nearest even, NaN kept quiet) without a branch, so that a loop of it
 * vectorises: the outputs of a bfloat16 model are converted back a whole chunk at a time. */
static inline uint16_t round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
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

/* row[0..n) (f32 or bf16) = src. */
static void from_f32(void *row, const float *src, int64_t n, int dtype) {
    if (dtype == DT_F32) {
        memcpy(row, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *h = row;
    for (int64_t i = 0; i < n; i++) h[i] = round_bf16(src[i]);
}

/* Element i of a weight row, f32 or bf16 (WD a constant at every call: no branch remains). */
ALWAYS_INLINE float wload(int WD, const void *w, int64_t i) {
    return WD == DT_F32 ? ((const float *)w)[i] : bf16_to_f32(((const uint16_t *)w)[i]);
}

/*
 * acc[t][0..NC) += sum_{i < n} coef[t][i] * w[i * ld .. + NC), for NT tokens: the one step both
 * products are made of (shrink: w = at's rows k, coef = x; expand: w = bt's rows r, coef = u).
 * coef[t] is coef + t * coef_ld. NT and NC are constants at each call: acc lives in registers.
 */
/* Eight floats, and eight bfloat16s, as GCC/clang vector types: the compiler maps them onto
 * whatever the build has (AVX-512, AVX2, SSE pairs) and keeps an array of them indexed by
 * constants in registers, which a plain float array of this size is not. */
typedef float vf8 __attribute__((vector_size(32)));
typedef uint32_t vu8 __attribute__((vector_size(32)));
typedef uint16_t vh8 __attribute__((vector_size(16)));

/* Weights row[8q .. 8q + 8) as float32. */
ALWAYS_INLINE vf8 wload8(int WD, const void *row, int q) {
    vf8 out;
    if (WD == DT_F32) {
        memcpy(&out, (const float *)row + 8 * q, sizeof out);
    } else {
        vh8 h;
        memcpy(&h, (const uint16_t *)row + 8 * q, sizeof h);
        const vu8 wide = __builtin_convertvector(h, vu8) << 16;
        memcpy(&out, &wide, sizeof out);
    }
    return out;
}

ALWAYS_INLINE void rows_times(int WD, int NT, int NC, float acc[LORA_TOKENS][LORA_COLS],
                              const float *coef, int64_t coef_ld, const void *w, int64_t ld,
                              int64_t n) {
    const size_t ws = WD == DT_F32 ? 4 : 2;
    if (NC % 8) {  /* the one-column edge case: plain floats */
        for (int64_t i = 0; i < n; i++) {
            const void *row = (const char *)w + (size_t)(i * ld) * ws;
            for (int t = 0; t < NT; t++)
                for (int j = 0; j < NC; j++) acc[t][j] += coef[t * coef_ld + i] * wload(WD, row, j);
        }
        return;
    }
    vf8 v[LORA_TOKENS][LORA_COLS / 8];
    for (int t = 0; t < NT; t++)
        for (int q = 0; q < NC / 8; q++) memcpy(&v[t][q], &acc[t][8 * q], sizeof(vf8));
    for (int64_t i = 0; i < n; i++) {
        const void *row = (const char *)w + (size_t)(i * ld) * ws;
        /* The expand reads R rows ld apart, more streams than the hardware prefetcher follows:
         * ask for this row's next columns now (the next call's block, or the next k rows). */
        __builtin_prefetch((const char *)row + LORA_PREFETCH, 0, 3);
        vf8 wq[LORA_COLS / 8];
        for (int q = 0; q < NC / 8; q++) wq[q] = wload8(WD, row, q);
        for (int t = 0; t < NT; t++) {
            const float c = coef[t * coef_ld + i];
            for (int q = 0; q < NC / 8; q++) v[t][q] += c * wq[q];
        }
    }
    for (int t = 0; t < NT; t++)
        for (int q = 0; q < NC / 8; q++) memcpy(&acc[t][8 * q], &v[t][q], sizeof(vf8));
}

/* rows_times with NT and NC constants (NC = LORA_COLS, 16 or 8: adapter ranks; else one column
 * at a time, for the few left at an edge). */
static void rows_times_any(int wdtype, int nt, int nc, float acc[LORA_TOKENS][LORA_COLS],
                           const float *coef, int64_t coef_ld, const void *w, int64_t ld,
                           int64_t n) {
#define RT(WD, T)                                                                          \
    do {                                                                                   \
        if (nc == LORA_COLS) rows_times(WD, T, LORA_COLS, acc, coef, coef_ld, w, ld, n);   \
        else if (nc == 16) rows_times(WD, T, 16, acc, coef, coef_ld, w, ld, n);            \
        else if (nc == 8) rows_times(WD, T, 8, acc, coef, coef_ld, w, ld, n);              \
        else for (int c = 0; c < nc; c++)                                                  \
            rows_times(WD, T, 1, (float(*)[LORA_COLS])((float *)acc + c), coef, coef_ld,   \
                       (const char *)w + (size_t)c * (WD == DT_F32 ? 4 : 2), ld, n);       \
    } while (0)
#define RT_T(T) case T: if (wdtype == DT_F32) RT(DT_F32, T); else RT(DT_BF16, T); break;
    switch (nt) { RT_T(1) RT_T(2) RT_T(3) RT_T(4) RT_T(5) RT_T(6) RT_T(7) RT_T(8) default: break; }
#undef RT_T
#undef RT
}

/* The adapted tokens in slot order; returns how many (tokens with slot < 0 are left out). */
static int64_t order_by_slot(const int32_t *slots, int64_t T, int64_t S, int64_t *order) {
    int64_t count = 0;
    for (int64_t s = 0; s < S; s++)
        for (int64_t t = 0; t < T; t++)
            if (slots[t] == s) order[count++] = t;
    return count;
}

/* The runs of at most LORA_TOKENS consecutive tokens (in slot order) of one slot: run j is
 * order[start[j] .. start[j + 1]). Returns how many. */
static int64_t token_runs(const int64_t *order, int64_t n_tok, const int32_t *slots,
                          int64_t *start) {
    int64_t runs = 0;
    for (int64_t i = 0; i < n_tok; runs++) {
        start[runs] = i;
        const int32_t s = slots[order[i]];
        for (int n = 0; i < n_tok && n < LORA_TOKENS && slots[order[i]] == s; n++) i++;
    }
    start[runs] = n_tok;
    return runs;
}

typedef struct {
    const int64_t *order, *run_start;
    int64_t n_tok, runs;
    const int32_t *slots;
    int wdtype;
} lora_batch_t;

/* u [n_tok, R] (rows in slot order) = xf [n_tok, K] (float32) times each token's slot's at.
 * The k range is always cut in LORA_KSPLIT fixed pieces (summed in order at the end), so one
 * token's shrink still gives every thread work, and the sums do not depend on the batch. */
static void shrink(const lora_batch_t *b, float *u, float *parts, const float *xf,
                   const void *at, int64_t R, int64_t K, int threads) {
    const size_t ws = b->wdtype == DT_F32 ? 4 : 2;
    const int64_t col_blocks = (R + LORA_COLS - 1) / LORA_COLS, items = col_blocks * LORA_KSPLIT;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t w = 0; w < b->runs * items; w++) {
        const int64_t j = w / items, r0 = (w % items / LORA_KSPLIT) * LORA_COLS;
        const int64_t h = w % LORA_KSPLIT, k0 = K * h / LORA_KSPLIT, k1 = K * (h + 1) / LORA_KSPLIT;
        const int64_t i0 = b->run_start[j];
        const int nt = (int)(b->run_start[j + 1] - i0);
        const int nc = (int)(R - r0 < LORA_COLS ? R - r0 : LORA_COLS);
        const int64_t slot = b->slots[b->order[i0]];
        const char *w0 = (const char *)at + (size_t)((slot * K + k0) * R + r0) * ws;
        float acc[LORA_TOKENS][LORA_COLS] = {{0.f}};
        rows_times_any(b->wdtype, nt, nc, acc, xf + i0 * K + k0, K, w0, R, k1 - k0);
        float *dst = parts + h * b->n_tok * R;
        for (int t = 0; t < nt; t++) memcpy(dst + (i0 + t) * R + r0, acc[t], sizeof(float) * nc);
    }
    for (int64_t i = 0; i < b->n_tok * R; i++) {
        float sum = parts[i];
        for (int h = 1; h < LORA_KSPLIT; h++) sum += parts[h * b->n_tok * R + i];
        u[i] = sum;
    }
}

/* out[t, n0..n1) += the expand of run j's tokens, for the part whose r range is [r0, r1). */
static void expand_run(const lora_batch_t *b, int64_t j, void *out, int64_t out_stride,
                       int dtype, const float *u, const void *bt, int64_t R, int64_t N,
                       int64_t n0, int64_t n1, int64_t r0, int64_t r1) {
    const size_t ws = b->wdtype == DT_F32 ? 4 : 2, es = dtype == DT_F32 ? 4 : 2;
    const int64_t i0 = b->run_start[j];
    const int nt = (int)(b->run_start[j + 1] - i0);
    const char *bts = (const char *)bt + (size_t)((int64_t)b->slots[b->order[i0]] * R * N) * ws;
    for (int64_t c0 = n0; c0 < n1; c0 += LORA_COLS) {
        const int nc = (int)(n1 - c0 < LORA_COLS ? n1 - c0 : LORA_COLS);
        float acc[LORA_TOKENS][LORA_COLS];
        for (int t = 0; t < nt; t++)
            to_f32(acc[t], (const char *)out + (size_t)(b->order[i0 + t] * out_stride + c0) * es,
                   nc, dtype);
        rows_times_any(b->wdtype, nt, nc, acc, u + i0 * R + r0, R,
                       bts + (size_t)(r0 * N + c0) * ws, N, r1 - r0);
        for (int t = 0; t < nt; t++)
            from_f32((char *)out + (size_t)(b->order[i0 + t] * out_stride + c0) * es, acc[t], nc,
                     dtype);
    }
}

static void expand(const lora_batch_t *b, void *out, int64_t out_stride, int dtype,
                   const float *u, const void *bt, int64_t R, int64_t N, const int64_t *seg_ends,
                   int64_t nseg, int threads) {
    const int64_t part_r = R / nseg, want = (int64_t)LORA_CHUNKS_PER_THREAD * threads;
    const int64_t width = ((N + want - 1) / want + LORA_COLS - 1) / LORA_COLS * LORA_COLS;
    const int64_t chunks = (N + width - 1) / width;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t c0 = c * width, c1 = c0 + width < N ? c0 + width : N;
        int64_t seg_start = 0;
        for (int64_t p = 0; p < nseg; p++) {  /* the parts this chunk overlaps */
            const int64_t n0 = c0 > seg_start ? c0 : seg_start;
            const int64_t n1 = c1 < seg_ends[p] ? c1 : seg_ends[p];
            seg_start = seg_ends[p];
            if (n0 >= n1) continue;
            for (int64_t j = 0; j < b->runs; j++)
                expand_run(b, j, out, out_stride, dtype, u, bt, R, N, n0, n1, p * part_r,
                           (p + 1) * part_r);
        }
    }
}

/*
 * Adds the adapters' share into out (see the top of this file). slots: int32 [T], -1 for a token
 * without an adapter, else < S. Returns 0, -1 when out of memory, -2 for bad segments.
 */
int lora_add(void *out, int64_t out_stride, int dtype, const void *x, int64_t x_stride,
             const int32_t *slots, int64_t T, const void *at, const void *bt, int wdtype,
             int64_t S, int64_t R, int64_t K, int64_t N, const int64_t *seg_ends, int64_t nseg,
             int num_threads) {
    if (nseg < 1 || R % nseg || seg_ends[nseg - 1] != N) return -2;
    const int64_t rows = T > 0 ? T : 1;
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(2 * rows + 1));
    float *u = malloc(sizeof(float) * (size_t)((1 + LORA_KSPLIT) * rows * R));
    float *xf = malloc(sizeof(float) * (size_t)(rows * K));
    int rc = -1;
    if (order == NULL || u == NULL || xf == NULL) goto done;
    lora_batch_t b = {order, order + rows, 0, 0, slots, wdtype};
    b.n_tok = order_by_slot(slots, T, S, order);
    b.runs = token_runs(order, b.n_tok, slots, order + rows);
    const size_t es = dtype == DT_F32 ? 4 : 2;
    for (int64_t i = 0; i < b.n_tok; i++)
        to_f32(xf + i * K, (const char *)x + (size_t)(order[i] * x_stride) * es, K, dtype);
    const int threads = b.n_tok * R * (K + N / nseg) >= LORA_PARALLEL_MIN ? num_threads : 1;
    if (b.n_tok > 0) {
        shrink(&b, u, u + rows * R, xf, at, R, K, threads);
        expand(&b, out, out_stride, dtype, u, bt, R, N, seg_ends, nseg, threads);
    }
    rc = 0;
done:
    free(order);
    free(u);
    free(xf);
    return rc;
}
