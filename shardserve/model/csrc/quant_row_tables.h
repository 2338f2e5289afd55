/*
 * The row kernels' tables (quant_rows.c, quant_rows_avx2.c, quant_rows_int8.c; quant_kernels.c
 * picks from them): one function per block type and count of x's rows, and who provides which.
 * Hashed with the sources by kernel_build.py, as quant_blocks.h.
 */
#ifndef SHARDSERVE_QUANT_ROW_TABLES_H
#define SHARDSERVE_QUANT_ROW_TABLES_H

#include "quant_blocks.h"

/*
 * Each (type, rows of x) pair is a function of its own over a range of weight rows, picked from
 * a table: in one function the eight row counts' loops made the compiler allocate registers
 * for all of them (batch 1 ran ~40% slower when the cases went from 4 to 8).
 */
typedef void (*rows_fn)(const uint8_t *w, int64_t row_bytes, const xquant_t *xq, int64_t b0,
                        int64_t n0, int64_t n1, int64_t K, void *out, int64_t out_stride,
                        int out_dtype);

#define ROWS_FN(KERNEL, T, NB)                                                           \
    static void KERNEL##_##T##_##NB(const uint8_t *w, int64_t row_bytes, const xquant_t *xq, \
                                    int64_t b0, int64_t n0, int64_t n1, int64_t K, void *out, \
                                    int64_t out_stride, int out_dtype) {                  \
        for (int64_t n = n0; n < n1; n++) {                                               \
            float res[NB];                                                                \
            KERNEL(T, NB, w + n * row_bytes, xq, b0, K, res);                             \
            for (int i = 0; i < NB; i++)                                                  \
                store_out(out, (b0 + i) * out_stride + n, res[i], out_dtype);             \
        }                                                                                 \
    }
#define ROWS_FNS(KERNEL, T)                                                              \
    ROWS_FN(KERNEL, T, 1) ROWS_FN(KERNEL, T, 2) ROWS_FN(KERNEL, T, 3) ROWS_FN(KERNEL, T, 4) \
    ROWS_FN(KERNEL, T, 5) ROWS_FN(KERNEL, T, 6) ROWS_FN(KERNEL, T, 7) ROWS_FN(KERNEL, T, 8)
#define ROWS_TABLE(KERNEL, T) ROWS_TABLE_(KERNEL, T) /* T expanded first, as in ROWS_FNS */
#define ROWS_TABLE_(KERNEL, T)                                                           \
    {KERNEL##_##T##_1, KERNEL##_##T##_2, KERNEL##_##T##_3, KERNEL##_##T##_4,              \
     KERNEL##_##T##_5, KERNEL##_##T##_6, KERNEL##_##T##_7, KERNEL##_##T##_8}
/* `const rows_fn *NAME(int type)`: KERNEL's table for each block type (Q4_0 ... Q6_K; ROWS_FNS of
 * each defined before), NULL for another type. */
#define ROWS_TABLES_BY_TYPE(NAME, KERNEL)                                                 \
    const rows_fn *NAME(int type) {                                                       \
        static const rows_fn q4_0[] = ROWS_TABLE(KERNEL, T_Q4_0);                         \
        static const rows_fn q4_1[] = ROWS_TABLE(KERNEL, T_Q4_1);                         \
        static const rows_fn q8_0[] = ROWS_TABLE(KERNEL, T_Q8_0);                         \
        static const rows_fn q4_k[] = ROWS_TABLE(KERNEL, T_Q4_K);                         \
        static const rows_fn q5_k[] = ROWS_TABLE(KERNEL, T_Q5_K);                         \
        static const rows_fn q6_k[] = ROWS_TABLE(KERNEL, T_Q6_K);                         \
        switch (type) {                                                                   \
        case T_Q4_0: return q4_0;                                                         \
        case T_Q4_1: return q4_1;                                                         \
        case T_Q8_0: return q8_0;                                                         \
        case T_Q4_K: return q4_k;                                                         \
        case T_Q5_K: return q5_k;                                                         \
        case T_Q6_K: return q6_k;                                                         \
        default: return NULL;                                                             \
        }                                                                                 \
    }

/* quant_rows_avx2.c: the AVX2 (no AVX-512) row kernels' table for `type`, and its kernel for one
 * row of x where only that one is its own; NULL where it has none (quant_rows.c's then take it). */
const rows_fn *avx2_row_fns(int type);
rows_fn avx2_one_row_fn(int type);
/* quant_rows.c: its own row kernels' table for a block type (Q4_0 ... Q6_K); NULL for others. */
const rows_fn *fused_row_fns(int type);
/* quant_rows.c: a table's kernels over N weight rows, tasks of 16 rows split among threads. */
void run_rows(const rows_fn *fns, const uint8_t *w, int64_t row_bytes, const xquant_t *xq,
              int64_t B, int64_t N, int64_t K, void *out, int64_t out_stride, int out_dtype,
              int threads);
/* quant_rows_repacked.c: the R4 / R8 rows' table (NULL for other types, or where this build
 * has none: it has them where quant_can_repack says so). */
const rows_fn *repacked_row_fns(int type);
/* quant_rows_int8.c: whether quant_matmul takes `type` with int8 x (the mode is on and it has
 * int8 rows for it); the SIMD rows (NULL where this build has none). */
int quant_int8_takes(int type);
const rows_fn *int8_row_fns(int type);

#endif
