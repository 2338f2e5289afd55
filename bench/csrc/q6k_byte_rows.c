/*
 * Q6_K rows on AVX2 with the values stored as bytes: the prototype of a load-time layout for
 * issue 30's batch 1 on AVX2 CPUs (>= 1.1x llama.cpp's tg). Today's Q6_K rows spend more
 * than half their instructions putting each 6-bit value together from its low nibble and two
 * high bits. A load-time layout of 256 signed bytes (q - 32), the 16 int8 half-scales and d (274
 * bytes per 256 values against Q6_K's 210) leaves per 32 values two vpmovsxbw from memory, two
 * vpmaddwd and an add; the half-scales' float step stays per 8 halves (sum8x8), as today.
 *
 * Against the engine's own Q6_K rows (its library, given as argument 1, called through
 * quant_matmul on the same values in Q6_K blocks): 2 threads over weight rows, 8 distinct
 * weights (from memory), interleaved rounds, medians of per-round ratios; both results checked
 * against a float64 product of the dequantized weights and x.
 *
 *   gcc -O3 -march=x86-64-v3 -fopenmp -Ishardserve/model/csrc bench/csrc/q6k_byte_rows.c \
 *       -o /tmp/q6kb -ldl -lm && /tmp/q6kb ~/.cache/shardserve/kernels/cpu_kernels-HASH.so [N K]
 *
 * Measured 2026-12-07 on the AVX2-only Zen 3 EPYC (x86-64-v3, 2 threads, 11 interleaved rounds,
 * against the engine at 200132d, whose Q6_K rows already decode in byte lanes): N=8192 K=2048
 * 22.1 against 19.9 GMAC/s, B6 0.92x (0.74-0.98); N=2048 K=8192 16.1 against 15.0, 0.94x
 * (0.86-1.02); in cache (N=512 K=2048, 8 copies: 9 MB) 0.85x. Both within 2e-5 of float64. So
 * with half the instructions and no decode the rows ran no faster: what bounds the one-row Q6_K
 * rows on this CPU is not the decode's instruction count, and the layout (+30% bytes, a new
 * repacked type) was not built.
 */
#include <dlfcn.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "quant_blocks.h"

#define COPIES 8
#define B6 274 /* bytes per 256: q - 32 [256] | sc [16] | d (f16) */

typedef int (*matmul_fn)(void *, int64_t, int, const void *, int64_t, int, const uint8_t *,
                         int64_t, int, int64_t, int64_t, int64_t, int);

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* One block of 256 values v (0..63), half-scales sc, d: as Q6_K (ggml's packing) and as B6. */
static void pack(const uint8_t *v, const int8_t *sc, uint16_t d, uint8_t *q6, uint8_t *b6) {
    uint8_t *ql = q6, *qh = q6 + 128;
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t *u = v + 128 * h + l;
            ql[64 * h + l] = (uint8_t)((u[0] & 0xF) | (u[64] & 0xF) << 4);
            ql[64 * h + 32 + l] = (uint8_t)((u[32] & 0xF) | (u[96] & 0xF) << 4);
            qh[32 * h + l] = (uint8_t)(u[0] >> 4 | (u[32] >> 4) << 2 | (u[64] >> 4) << 4 |
                                       (u[96] >> 4) << 6);
        }
    memcpy(q6 + 192, sc, 16);
    memcpy(q6 + 208, &d, 2);
    for (int i = 0; i < 256; i++) b6[i] = (uint8_t)(int8_t)(v[i] - 32);
    memcpy(b6 + 256, sc, 16);
    memcpy(b6 + 272, &d, 2);
}

/* x per 32 at most 32767 (the engine's int16 rows' scheme). */
static void quantize(const float *x, int64_t K, int16_t *q, float *xd) {
    for (int64_t s = 0; s < K / 32; s++) {
        float amax = 0.f;
        for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(x[32 * s + l]));
        xd[s] = amax / 32767.f;
        const float inv = amax > 0.f ? 32767.f / amax : 0.f;
        for (int l = 0; l < 32; l++) q[32 * s + l] = (int16_t)lrintf(x[32 * s + l] * inv);
    }
}

/* One B6 row times one row of x: per half of 128, 8 vectors of half-sums, one float step. */
static float b6_row(const uint8_t *row, int64_t K, const int16_t *q, const float *xd) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t bi = 0; bi < K / 256; bi++) {
        const uint8_t *blk = row + bi * B6;
        for (int l = 0; l < B6; l += 64) _mm_prefetch((const char *)blk + 2048 + l, _MM_HINT_T0);
        const int8_t *sc = (const int8_t *)(blk + 256);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)(blk + 272)));
        for (int h = 0; h < 2; h++) {
            __m256i p[8];
            for (int t = 0; t < 8; t++) { /* half t of 16 values: sub-block t / 2 */
                const __m256i w = _mm256_cvtepi8_epi16(
                    _mm_loadu_si128((const __m128i *)(blk + 128 * h + 16 * t)));
                p[t] = _mm256_madd_epi16(
                    w, _mm256_loadu_si256((const __m256i *)(q + 256 * bi + 128 * h + 16 * t)));
            }
            const __m256 s = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(sc + 8 * h))));
            const __m256 x4 = _mm256_castps128_ps256(_mm_loadu_ps(xd + 8 * bi + 4 * h));
            const __m256 xs = _mm256_permutevar8x32_ps(x4, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8x8(p)), _mm256_mul_ps(_mm256_mul_ps(s, d), xs),
                                  acc);
        }
    }
    return hsum8(acc);
}

static void b6_product(const uint8_t *w, int64_t N, int64_t K, const float *x, float *out,
                       int16_t *q, float *xd) {
    quantize(x, K, q, xd); /* per product, as quant_matmul does */
#pragma omp parallel for num_threads(2) schedule(guided)
    for (int64_t t = 0; t < N / 16; t++)
        for (int64_t n = 16 * t; n < 16 * t + 16; n++) out[n] = b6_row(w + n * (K / 256) * B6, K, q, xd);
}

static double max_rel(const float *a, const double *ref, int64_t n) {
    double err = 0, top = 0;
    for (int64_t i = 0; i < n; i++) {
        err = fmax(err, fabs(a[i] - ref[i]));
        top = fmax(top, fabs(ref[i]));
    }
    return err / top;
}

static int cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc < 2) return fprintf(stderr, "usage: %s ENGINE.so [N K [rounds]]\n", argv[0]), 2;
    void *lib = dlopen(argv[1], RTLD_NOW);
    matmul_fn matmul = lib ? (matmul_fn)dlsym(lib, "quant_matmul") : NULL;
    if (!matmul) return fprintf(stderr, "%s: no quant_matmul (%s)\n", argv[1], dlerror()), 1;
    const int64_t N = argc > 3 ? atoll(argv[2]) : 8192, K = argc > 3 ? atoll(argv[3]) : 2048;
    const int rounds = argc > 4 ? atoi(argv[4]) : 15, nb = (int)(K / 256);
    uint8_t *q6[COPIES], *b6[COPIES];
    uint8_t *v = malloc(256);
    double *ref = calloc(N, sizeof(double));
    float *x = malloc(sizeof(float) * K), *o6 = malloc(sizeof(float) * N), *ob = malloc(sizeof(float) * N);
    int16_t *q = malloc(sizeof(int16_t) * K);
    float *xd = malloc(sizeof(float) * (K / 32));
    srand(1);
    for (int64_t k = 0; k < K; k++) x[k] = (float)rand() / RAND_MAX * 2.f - 1.f;
    for (int c = 0; c < COPIES; c++) {
        q6[c] = aligned_alloc(64, (size_t)(N * nb * 210 + 63) / 64 * 64);
        b6[c] = aligned_alloc(64, (size_t)(N * nb * B6 + 63) / 64 * 64);
        for (int64_t n = 0; n < N; n++)
            for (int b = 0; b < nb; b++) {
                int8_t sc[16];
                for (int i = 0; i < 256; i++) v[i] = (uint8_t)(rand() & 63);
                for (int i = 0; i < 16; i++) sc[i] = (int8_t)(rand() % 255 - 127);
                const float d = 1e-3f * (1 + rand() % 100) / 100.f;
                pack(v, sc, _cvtss_sh(d, 0), q6[c] + (n * nb + b) * 210, b6[c] + (n * nb + b) * B6);
                if (c == 0)
                    for (int i = 0; i < 256; i++)
                        ref[n] += (double)_cvtsh_ss(_cvtss_sh(d, 0)) * sc[i / 16] * (v[i] - 32) *
                                  x[256 * b + i];
            }
    }
    double *ratio = malloc(sizeof(double) * rounds), t6 = 0, tb = 0;
    for (int r = 0; r < rounds; r++) {
        double a = now_s();
        for (int c = 0; c < COPIES; c++)
            matmul(o6, N, 0, x, K, 0, q6[c], nb * 210, T_Q6_K, 1, N, K, 2);
        const double m = now_s();
        for (int c = 0; c < COPIES; c++) b6_product(b6[c], N, K, x, ob, q, xd);
        const double e = now_s();
        ratio[r] = (m - a) / (e - m);
        t6 += m - a, tb += e - m;
    }
    matmul(o6, N, 0, x, K, 0, q6[0], nb * 210, T_Q6_K, 1, N, K, 2); /* copy 0: the reference's */
    b6_product(b6[0], N, K, x, ob, q, xd);
    qsort(ratio, rounds, sizeof(double), cmp);
    const double macs = (double)N * K * COPIES * rounds;
    printf("N=%lld K=%lld: Q6_K rows (engine) %.1f GMAC/s, B6 rows %.1f GMAC/s, B6/Q6_K median "
           "%.2fx (%.2f..%.2f); max rel error vs float64 %.1e / %.1e\n",
           (long long)N, (long long)K, macs / t6 / 1e9, macs / tb / 1e9, ratio[rounds / 2],
           ratio[0], ratio[rounds - 1], max_rel(o6, ref, N), max_rel(ob, ref, N));
    return 0;
}
