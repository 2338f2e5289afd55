/*
 * Batched products with quantized weights, from the blocks, with no dense copy of W anywhere:
 * out[b, n] = sum_k x[b, k] * W[n, k] for B rows of x (a batched decode, a verify step, a
 * prefill) and W [N, K] as GGML blocks (quant_kernels.c's header draws the layouts).
 *
 * Float32 panels (AVX-512 and portable builds): each weight decoded once per call to float32
 * into a small panel (L1/L2-sized) reused by every row of x, so the result is as exact as the
 * dequantized float32 model's; int8 x would be faster but agrees at only ~98% top-1. AVX2
 * builds take int16 x and panels instead (quant_gemm_i16.c: vpmaddwd does twice a float FMA's
 * multiply-adds there, at the batch-1 path's int16 precision), in the same tiles and threads.
 *
 *   threads split the N output columns into tiles of NT weight rows (a tile per task):
 *   for each tile:                          out tile [B, NT] accumulated in float (otile)
 *     for each chunk of KC columns of K:    panel [NT, KC] = decoded W rows (quant_decode_chunk)
 *       AVX2 / AVX-512: panel turned K-major, then for b in steps of BR rows of x:
 *           acc[BR][2] vectors += broadcast x[b.., k] * panel[k][0 .. NT)    (micro_bc)
 *       else, for n in steps of NC panel rows, b in steps of MR rows of x:
 *           acc[MR][NC] vectors += x[b.., k..] * panel[n.., k..]; otile += hsum(acc)
 *     out tile = otile (float32 or bfloat16)
 *
 * Vectors are GCC vector extensions of the build's width (16 floats with AVX-512, 8 with AVX2,
 * 4 otherwise); the compiler emits FMAs where it may. bfloat16 x is multiplied as it is where
 * the CPU has AVX512_BF16 (vdpbf16ps), else converted to a float32 copy first, as is x with a
 * column stride.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"

#if defined(__AVX512F__)
#define VL 16
#define MR_DEFAULT 4
#define NC_DEFAULT 4
#elif defined(__AVX__)
#define VL 8
#define MR_DEFAULT 3
#define NC_DEFAULT 3
#else
#define VL 4
#define MR_DEFAULT 2
#define NC_DEFAULT 3
#endif
/* A micro-kernel's rows of x (MR) and panel rows (NC): MR x NC accumulators, NC weight vectors
 * and one of x in registers; each x vector loaded (from L2) serves NC FMAs. */
#ifndef MR
#define MR MR_DEFAULT
#endif
#ifndef NC
#define NC NC_DEFAULT
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vf_u __attribute__((vector_size(VL * 4), aligned(4))); /* unaligned access */

/* K's chunk per panel, whole blocks of every type (256): NC panel rows of it (16 KB, 4 KB a row
 * in float32 and in bfloat16 alike) stay in L1 while every row of x streams past them from L2,
 * and the accumulators' horizontal sums (once per chunk) cost a few percent. */
#ifndef KC
#define KC 1024
#endif
#define KC_BF16 (2 * KC)
/* A panel row's stride: one cache line past the chunk, so that the NC rows a micro-kernel
 * streams (4 KB apart otherwise) do not all map to the same L1 sets. */
#ifndef PAD
#define PAD 16
#endif
#define PS (KC + PAD)
#define PS_BF16 (KC_BF16 + 2 * PAD)
/* Weight rows per panel: two vectors for the broadcast kernels below (16 AVX2, 32 AVX-512);
 * BR rows of x per micro-kernel call: 2 BR accumulators, 2 weight vectors and a broadcast fill
 * the register file (16 vectors with AVX2, 32 with AVX-512). */
#if defined(__AVX2__) && defined(__FMA__)
#define GEMM_BCAST 1
#define NT (2 * VL)
#define BR (VL == 16 ? 12 : 6)
#else
#define GEMM_BCAST 0
#define NT (NC > 4 ? 2 * NC : 4 * NC)
#endif
/* Below this many multiply-adds a call runs on one thread (a parallel region costs more). */
#define GEMM_PARALLEL_MIN (256 * 1024)

/* Elements [k0, k0 + kc) of weight row n, decoded QDECODE_MAX at a time. */
static void decode_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t K,
                        int64_t k0, int64_t kc, void *out, int out_dtype) {
    const size_t esize = out_dtype == DT_F32 ? 4 : 2;
    for (int64_t k = 0; k < kc; k += QDECODE_MAX) {
        const int64_t cnt = kc - k < QDECODE_MAX ? kc - k : QDECODE_MAX;
        quant_decode_chunk(type, w, row_bytes, n, K, k0 + k, cnt,
                           (char *)out + (size_t)k * esize, out_dtype);
    }
}

#define MICRO_NC(F, MRV)                                                                   \
    switch (nc) {                                                                          \
    case 1: F(MRV, 1, x, xs, p, kc, otile); break;                                         \
    case 2: F(MRV, 2, x, xs, p, kc, otile); break;                                         \
    case 3: F(MRV, 3 < NC ? 3 : NC, x, xs, p, kc, otile); break;                           \
    case 4: F(MRV, 4 < NC ? 4 : NC, x, xs, p, kc, otile); break;                           \
    case 5: F(MRV, 5 < NC ? 5 : NC, x, xs, p, kc, otile); break;                           \
    case 6: F(MRV, 6 < NC ? 6 : NC, x, xs, p, kc, otile); break;                           \
    case 7: F(MRV, 7 < NC ? 7 : NC, x, xs, p, kc, otile); break;                           \
    default: F(MRV, NC, x, xs, p, kc, otile); break;                                       \
    }

#define MICRO_MR(F)                                                                        \
    switch (mr) {                                                                          \
    case 1: MICRO_NC(F, 1) break;                                                          \
    case 2: MICRO_NC(F, 2 < MR ? 2 : MR) break;                                            \
    case 3: MICRO_NC(F, 3 < MR ? 3 : MR) break;                                            \
    default: MICRO_NC(F, MR) break;                                                        \
    }

#if !GEMM_BCAST
/* The portable build's micro-kernel (and a pre-AVX2 one's): dot products along K. */
ALWAYS_INLINE float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* otile[r * NT + c] += x[r] . panel[c] over kc columns, for mr <= MR rows and nc <= NC panel
 * rows: mr and nc are constants at every call site, so each pair compiles to its own
 * fully-unrolled loop with the accumulators in registers. */
ALWAYS_INLINE void micro(int mr, int nc, const float *x, int64_t xs, const float *p, int64_t kc,
                         float *otile) {
    vf acc[MR][NC];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) acc[r][c] = (vf){0};
    for (int64_t k = 0; k < kc; k += VL) {
        vf w[NC];
        for (int c = 0; c < nc; c++) w[c] = *(const vf_u *)(p + c * PS + k);
        for (int r = 0; r < mr; r++) {
            const vf xv = *(const vf_u *)(x + r * xs + k);
            for (int c = 0; c < nc; c++) acc[r][c] += xv * w[c];
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) otile[r * NT + c] += hsum(acc[r][c]);
}

static void micro_any(int mr, int nc, const float *x, int64_t xs, const float *p, int64_t kc,
                      float *otile) {
    MICRO_MR(micro)
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define GEMM_BF16 1
/*
 * bfloat16 x (a bfloat16 model's activations) on CPUs with AVX512_BF16: the panel is decoded to
 * bfloat16 (the weights rounded as a bfloat16 dense copy would be) and vdpbf16ps multiplies 32
 * pairs per instruction into float32 sums: twice the float32 FMA's rate, same accumulation.
 */
ALWAYS_INLINE void micro_bf16(int mr, int nc, const uint16_t *x, int64_t xs, const uint16_t *p,
                              int64_t kc, float *otile) {
    __m512 acc[MR][NC];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; k += 32) {
        __m512bh w[NC];
        for (int c = 0; c < nc; c++) w[c] = (__m512bh)_mm512_loadu_si512(p + c * PS_BF16 + k);
        for (int r = 0; r < mr; r++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * xs + k);
            for (int c = 0; c < nc; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, w[c]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) otile[r * NT + c] += _mm512_reduce_add_ps(acc[r][c]);
}

static void micro_bf16_any(int mr, int nc, const uint16_t *x, int64_t xs, const uint16_t *p,
                           int64_t kc, float *otile) {
    MICRO_MR(micro_bf16)
}

#else
#define GEMM_BF16 0
#endif

#if GEMM_BCAST
#include <immintrin.h>
/*
 * The AVX2 and AVX-512 builds' micro-kernels: the lanes run along the NT weight rows of a tile,
 * not along K. The panel is turned K-major (pt[k][NT], from the decoded rows by 8x8 transposes)
 * and each step loads its NT weights once (two vectors) for BR rows of x, whose element is
 * broadcast: 2 loads and BR broadcasts feed 2 BR FMAs, no horizontal sums, and a row of x is
 * read 4 bytes a step where a dot-product kernel reads a vector of it per few FMAs (which, for a
 * prefill's x beyond L2, streamed from L3: ~58% of the FMA peak on Zen 3).
 *
 *   step k:   w0 w1 = pt[k][0 .. VL), pt[k][VL .. NT)
 *             acc[r][0] += x[r][k] * w0,  acc[r][1] += x[r][k] * w1     for r < BR
 * (bfloat16 x keeps micro_bf16's dot products: measured with pairs broadcast into vdpbf16ps on
 * Zen 4, 0.87-0.93x at 16-32 rows, 1.01-1.06x at 512, where micro_bf16 is at the peak already.)
 */
/* otile[r * NT + 0 .. NT) += x[r] . pt[.][0 .. NT) over kc columns, for mr <= BR rows. */
ALWAYS_INLINE void micro_bc(int mr, const float *x, int64_t xs, const float *pt, int64_t kc,
                            float *otile) {
    vf acc[BR][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = (vf){0};
    for (int64_t k = 0; k < kc; k++) {
        const vf w0 = *(const vf *)(pt + k * NT), w1 = *(const vf *)(pt + k * NT + VL);
        for (int r = 0; r < mr; r++) {
            const float xb = x[r * xs + k];
            acc[r][0] += xb * w0;
            acc[r][1] += xb * w1;
        }
    }
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) *(vf_u *)(otile + r * NT + VL * h) += acc[r][h];
}

static void micro_bc_any(int mr, const float *x, int64_t xs, const float *pt, int64_t kc,
                         float *otile) {
    switch (mr) {
    case 1: micro_bc(1, x, xs, pt, kc, otile); break;
    case 2: micro_bc(2, x, xs, pt, kc, otile); break;
    case 3: micro_bc(3, x, xs, pt, kc, otile); break;
    case 4: micro_bc(4, x, xs, pt, kc, otile); break;
    case 5: micro_bc(5, x, xs, pt, kc, otile); break;
#if BR > 6
    case 6: micro_bc(6, x, xs, pt, kc, otile); break;
    case 7: micro_bc(7, x, xs, pt, kc, otile); break;
    case 8: micro_bc(8, x, xs, pt, kc, otile); break;
    case 9: micro_bc(9, x, xs, pt, kc, otile); break;
    case 10: micro_bc(10, x, xs, pt, kc, otile); break;
    case 11: micro_bc(11, x, xs, pt, kc, otile); break;
#endif
    default: micro_bc(BR, x, xs, pt, kc, otile); break;
    }
}

/* The rows of a chunk decoded (rm, rows PS apart; rows past nt zeroed here) turned K-major
 * into pt. */
static void panel_k_major(float *rm, int64_t nt, int64_t kc, float *pt) {
    for (int64_t c = nt; c < NT; c++) memset(rm + c * PS, 0, sizeof(float) * (size_t)kc);
    for (int64_t k = 0; k < kc; k += 8)
        for (int64_t c = 0; c < NT; c += 8)
            transpose8x8_ps(rm + c * PS + k, PS, pt + k * NT + c, NT);
}
#endif

/* One tile of nt weight rows from n0: decode chunk by chunk, multiply with every row of x
 * (bfloat16 x and panels where `bf16`, else float32). */
static void gemm_tile(const uint8_t *w, int64_t row_bytes, int type, const void *x, int64_t xs,
                      int64_t B, int64_t K, int64_t n0, int64_t nt, void *panel, float *otile,
                      int bf16, const uint32_t *xv) {
    const int64_t chunk = bf16 ? KC_BF16 : KC, ps = bf16 ? PS_BF16 : PS;
    const size_t es = bf16 ? 2 : 4;
    memset(otile, 0, sizeof(float) * (size_t)(B * NT));
    for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        const int64_t kc = K - k0 < chunk ? K - k0 : chunk;
        if (!quant_decode_tiled_panel(type, w, row_bytes, n0, nt, k0, kc, panel, ps,
                                      bf16 ? DT_BF16 : DT_F32))
            for (int64_t c = 0; c < nt; c++)
                decode_rows(type, w, row_bytes, n0 + c, K, k0, kc,
                            (char *)panel + (size_t)(c * ps) * es, bf16 ? DT_BF16 : DT_F32);
#if GEMM_BF16
        if (xv != NULL) { /* AMX (quant_gemm_amx.c) */
            gemm_amx_chunk(panel, PS_BF16, xv, B, K, k0, kc, otile, nt, NT);
            continue;
        }
        if (bf16) {
            for (int64_t c = 0; c < nt; c += NC)
                for (int64_t b = 0; b < B; b += MR)
                    micro_bf16_any((int)(B - b < MR ? B - b : MR), (int)(nt - c < NC ? nt - c : NC),
                                   (const uint16_t *)x + b * xs + k0, xs,
                                   (const uint16_t *)panel + c * ps, kc, otile + b * NT + c);
            continue;
        }
#endif
#if GEMM_BCAST
        float *pt = (float *)panel + NT * PS; /* the K-major panel, 64-byte aligned */
        panel_k_major(panel, nt, kc, pt);
        for (int64_t b = 0; b < B; b += BR)
            micro_bc_any((int)(B - b < BR ? B - b : BR), (const float *)x + b * xs + k0, xs, pt,
                         kc, otile + b * NT);
#else
        for (int64_t c = 0; c < nt; c += NC)
            for (int64_t b = 0; b < B; b += MR)
                micro_any((int)(B - b < MR ? B - b : MR), (int)(nt - c < NC ? nt - c : NC),
                          (const float *)x + b * xs + k0, xs, (const float *)panel + c * ps, kc,
                          otile + b * NT + c);
#endif
    }
}

static void store_tile(void *out, int64_t out_stride, int out_dtype, const float *otile,
                       int64_t B, int64_t n0, int64_t nt) {
    for (int64_t b = 0; b < B; b++) {
        const float *src = otile + b * NT;
        if (out_dtype == DT_F32) {
            memcpy((float *)out + b * out_stride + n0, src, sizeof(float) * (size_t)nt);
        } else {
            uint16_t *dst = (uint16_t *)out + b * out_stride + n0;
            for (int64_t c = 0; c < nt; c++) dst[c] = f32_to_bf16(src[c]);
        }
    }
}

/* x as float32 rows of unit column stride: itself where it is one, else a converted copy. */
static const float *x_as_f32(const void *x, int64_t x_stride, int dtype, int64_t B, int64_t K,
                             float **copy, int64_t *xs) {
    *copy = NULL;
    *xs = x_stride;
    if (dtype == DT_F32 && K % VL == 0) return (const float *)x;
    *copy = malloc(sizeof(float) * (size_t)(B * K));
    if (*copy == NULL) return NULL;
    for (int64_t b = 0; b < B; b++)
        for (int64_t k = 0; k < K; k++)
            (*copy)[b * K + k] = dtype == DT_F32 ? ((const float *)x)[b * x_stride + k]
                                                 : bf16_to_f32(((const uint16_t *)x)[b * x_stride + k]);
    *xs = K;
    return *copy;
}

/* Whether quant_gemm multiplies weights of this type with int16 x (quant_gemm_i16.c). */
int quant_gemm_int16(int type) { return gemm_i16_takes(type); }

/*
 * out[b * out_stride + n] = sum_k x[b * x_stride + k] * W[n, k] for b < B, n < N: quant_matmul's
 * contract (same arguments, dtypes 0 f32 / 1 bf16), for any B. Returns 0, -1 when out of
 * memory, -2 for a type or K it cannot handle (K must be whole blocks and a multiple of VL).
 */
int quant_gemm(void *out, int64_t out_stride, int out_dtype, const void *x, int64_t x_stride,
               int dtype, const uint8_t *w, int64_t row_bytes, int type, int64_t B, int64_t N,
               int64_t K, int num_threads) {
    int elems, bytes;
    if (!quant_block_shape(type, &elems, &bytes) || K % elems || K % VL || KC % elems ||
        row_bytes < K / elems * bytes)
        return -2;
    /* AVX2 builds: int16 x and panels (quant_gemm_i16.c). Else bfloat16 x with unit stride on
     * a bfloat16-dot CPU multiplied as it is; else float32 x. */
    const int i16 = gemm_i16_takes(type);
    const int bf16 = !i16 && GEMM_BF16 && dtype == DT_BF16 && K % 32 == 0;
    float *copy = NULL;
    int64_t xs = x_stride;
    const float *xf = bf16 || i16 ? NULL : x_as_f32(x, x_stride, dtype, B, K, &copy, &xs);
    xquant_t xq = {i16 ? malloc(gemm_i16_x_bytes(B, K)) : NULL,
                   i16 ? malloc(sizeof(float) * (size_t)(B * K / 16)) : NULL, NULL, NULL, NULL};
    if (i16 ? xq.q == NULL || xq.d == NULL : !bf16 && xf == NULL) {
        free(xq.q), free(xq.d);
        return -1;
    }
    xq.xs32 = i16 ? xq.d + B * K / 32 : NULL;
    /* AMX where the build and the kernel allow it: x in its pair order, once per call. */
    uint32_t *xv = bf16 && gemm_amx_ready() ? aligned_alloc(64, gemm_amx_x_bytes(B, K)) : NULL;
    const int64_t tiles = (N + NT - 1) / NT;
    const int threads = B * N * K >= GEMM_PARALLEL_MIN ? num_threads : 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        if (i16) {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++) gemm_i16_quantize_x(x, x_stride, dtype, type, b, B, K, &xq);
        }
        if (xv != NULL) {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++) gemm_amx_pack_x(x, x_stride, b, B, K, xv);
            gemm_amx_begin();
        }
        /* The decoded rows; then (GEMM_BCAST) their K-major copy. Or quant_gemm_i16.c's. */
        const size_t fbytes = sizeof(float) * (size_t)(NT * PS + GEMM_BCAST * NT * KC);
        void *panel = i16 ? malloc(gemm_i16_scratch_bytes()) : aligned_alloc(64, fbytes);
        float *otile = malloc(sizeof(float) * (size_t)(B * NT));
        /* Every thread enters the loop (a worksharing loop skipped by one would hang the
         * others at its barrier); one without scratch only records the failure. */
        /* Guided: a static split left one thread waiting for the other (quant_rows.c's
         * run_rows); guided, 1.02-1.19x at 32 rows (Zen 3, AVX2, 1B shapes). */
#pragma omp for schedule(guided)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * NT, nt = N - n0 < NT ? N - n0 : NT;
            if (panel == NULL || otile == NULL) {
                failed = 1;
                continue;
            }
            if (i16)
                gemm_i16_tile(w, row_bytes, type, &xq, B, K, n0, nt, panel, otile);
            else
                gemm_tile(w, row_bytes, type, bf16 ? x : (const void *)xf, xs, B, K, n0, nt,
                          panel, otile, bf16, xv);
            store_tile(out, out_stride, out_dtype, otile, B, n0, nt);
        }
        if (xv != NULL) gemm_amx_end();
        free(panel);
        free(otile);
    }
    free(copy), free(xv);
    free(xq.q), free(xq.d);
    return failed ? -1 : 0;
}
