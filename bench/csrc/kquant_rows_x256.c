/*
 * Q4_K rows at 8 rows of x on AVX2, the prototype issue 30's forced-avx2 batch 8 (1.5x
 * llama.cpp's S_TG) was tried with: x quantized per 32 (the engine's rows: a float step per
 * sub-block of 32 and row of x, 8 rows as two passes of 4) against x quantized per block of 256
 * at most 16383 with the sub-block scales folded into the int16 weights (q * sc <= 945: a lane's
 * 32 products < 2^31), so a block's products accumulate as int32 and one float step per block
 * and row remains (p0/p1 work per 32 products and row: 2 vpmaddwd instead of 2 vpmaddwd, a
 * conversion and an FMA). Same random weights (6 copies, from memory), 2 threads over weight
 * rows, 15 interleaved rounds; both kernels' results checked against a float64 product of the
 * dequantized weights and x (argument 4: a K chunk, so x's chunk stays in L1 across 16 rows).
 *
 * Measured 2026-12-06 on the AMX Xeon (x86-64-v3 build, 2 threads), medians of per-round ratios
 * per-256 / per-32, several runs each: N=8192 K=2048 1.10-1.45x (best 71.5 GMAC/s); N=2048
 * K=8192 0.80-0.94x (x's 8 rows, 128 KB, read from L2 per weight row; chunks of 1024 / 2048
 * columns did not help: 0.94x); N=2048 K=2048 1.17x. Weighted by the 1B model's shapes about
 * 1.1x on the Q4_K rows, at 4x the error of x per 32 (activations with outliers): far from the
 * ~1.45x batch 8 needs, so not built into the engine.
 *
 *   gcc -O3 -march=x86-64-v3 -fopenmp -Ishardserve/model/csrc \
 *       bench/csrc/kquant_rows_x256.c -o /tmp/kq256 -lm && /tmp/kq256 [N K NB]
 */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "quant_blocks.h"

#define NBMAX 8
#define QB 144 /* Q4_K block bytes */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint16_t f32_to_half(float f) { return _cvtss_sh(f, 0); }

/* x per `group` values: q int16 at most qmax, d per group, xs32 = d * sum per 32. */
static void quantize(const float *x, int64_t K, int group, float qmax, int16_t *q, float *d,
                     float *xs32) {
    for (int64_t g = 0; g < K / group; g++) {
        float amax = 0.f;
        for (int l = 0; l < group; l++) amax = fmaxf(amax, fabsf(x[g * group + l]));
        const float inv = amax > 0.f ? qmax / amax : 0.f, s = amax / qmax;
        for (int l = 0; l < group; l++) q[g * group + l] = (int16_t)nearbyintf(x[g * group + l] * inv);
        for (int l = 0; l < group; l += 32) {
            int sum = 0;
            for (int t = 0; t < 32; t++) sum += q[g * group + l + t];
            d[(g * group + l) / 32] = s;
            xs32[(g * group + l) / 32] = s * (float)sum;
        }
    }
}

/* per-32: the engine's kquant_row at NB rows (k4_scales + k_mac per sub-block). */
ALWAYS_INLINE void row32(int NB, int64_t XS, const uint8_t *row, const int16_t *xq, const float *xd,
                         const float *xs32, int64_t K, float *res) {
    const int64_t nsub = XS / 32;
    __m256 acc[NBMAX], macc[NBMAX];
    for (int i = 0; i < NB; i++) acc[i] = macc[i] = _mm256_setzero_ps();
    for (int64_t bi = 0; bi < K / 256; bi++) {
        const uint8_t *blk = row + bi * QB;
        float sd[NBMAX][8] __attribute__((aligned(32)));
        uint64_t sc, mn;
        k4_unpack(blk, &sc, &mn);
        const __m256 s = _mm256_mul_ps(_mm256_set1_ps(half_to_f32(blk)), bytes8_to_f32(sc, 0));
        const __m256 m = _mm256_mul_ps(_mm256_set1_ps(half_to_f32(blk + 2)), bytes8_to_f32(mn, 0));
        for (int i = 0; i < NB; i++) {
            _mm256_store_ps(sd[i], _mm256_mul_ps(s, _mm256_loadu_ps(xd + i * nsub + 8 * bi)));
            macc[i] = _mm256_fnmadd_ps(m, _mm256_loadu_ps(xs32 + i * nsub + 8 * bi), macc[i]);
        }
        const uint8_t *qs = blk + 16;
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m256i v0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 32 * (j / 2))));
            const __m256i v1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 32 * (j / 2) + 16)));
            const __m256i lo = (j & 1) ? _mm256_srli_epi16(v0, 4) : _mm256_and_si256(v0, _mm256_set1_epi16(15));
            const __m256i hi = (j & 1) ? _mm256_srli_epi16(v1, 4) : _mm256_and_si256(v1, _mm256_set1_epi16(15));
            for (int i = 0; i < NB; i++) {
                const int16_t *x = xq + i * XS + 256 * bi + 32 * j;
                const __m256i p = _mm256_add_epi32(
                    _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
                    _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 16))));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sd[i][j]), acc[i]);
            }
        }
    }
    for (int i = 0; i < NB; i++) res[i] += hsum8(acc[i]) + hsum8(macc[i]);
}

/* per-256: q * sc_j in int16 (<= 945), x <= 16383 per block: a lane's 32 products < 2^31. */
ALWAYS_INLINE void row256(int NB, int64_t XS, const uint8_t *row, const int16_t *xq, const float *xd,
                          const float *xs32, int64_t K, float *res) {
    /* The float sums live in memory, touched once per block: in registers (2 x NB) they and
     * the NB int32 sums would not fit 16 ymm. */
    const int64_t nsub = XS / 32;
    float facc[NBMAX][8] __attribute__((aligned(32)));
    memset(facc, 0, sizeof facc);
    for (int64_t bi = 0; bi < K / 256; bi++) {
        const uint8_t *blk = row + bi * QB;
        for (int l = 0; l < QB; l += 64) _mm_prefetch((const char *)blk + 2048 + l, _MM_HINT_T0);
        uint64_t sc, mn;
        k4_unpack(blk, &sc, &mn);
        const float d = half_to_f32(blk);
        __m256i ia[NBMAX];
        for (int i = 0; i < NB; i++) ia[i] = _mm256_setzero_si256();
        const uint8_t *qs = blk + 16;
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m256i scj = _mm256_set1_epi16((short)((sc >> (8 * j)) & 0xFF));
            const __m256i v0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 32 * (j / 2))));
            const __m256i v1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 32 * (j / 2) + 16)));
            const __m256i lo = _mm256_mullo_epi16(scj, (j & 1) ? _mm256_srli_epi16(v0, 4) : _mm256_and_si256(v0, _mm256_set1_epi16(15)));
            const __m256i hi = _mm256_mullo_epi16(scj, (j & 1) ? _mm256_srli_epi16(v1, 4) : _mm256_and_si256(v1, _mm256_set1_epi16(15)));
            for (int i = 0; i < NB; i++) {
                const int16_t *x = xq + i * XS + 256 * bi + 32 * j;
                ia[i] = _mm256_add_epi32(ia[i], _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x)));
                ia[i] = _mm256_add_epi32(ia[i], _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 16))));
            }
        }
        const __m256 m = _mm256_mul_ps(_mm256_set1_ps(half_to_f32(blk + 2)), bytes8_to_f32(mn, 0));
        for (int i = 0; i < NB; i++) {
            __m256 f = _mm256_load_ps(facc[i]);
            f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[i]), _mm256_set1_ps(d * xd[i * nsub + 8 * bi]), f);
            f = _mm256_fnmadd_ps(m, _mm256_loadu_ps(xs32 + i * nsub + 8 * bi), f);
            _mm256_store_ps(facc[i], f);
        }
    }
    for (int i = 0; i < NB; i++) res[i] += hsum8(_mm256_load_ps(facc[i]));
}

typedef void (*kern)(int64_t, const uint8_t *, const int16_t *, const float *, const float *, int64_t, float *);
#define K32(NB) static void k32_##NB(int64_t XS, const uint8_t *w, const int16_t *q, const float *d, const float *s, int64_t K, float *r) { row32(NB, XS, w, q, d, s, K, r); }
#define K256(NB) static void k256_##NB(int64_t XS, const uint8_t *w, const int16_t *q, const float *d, const float *s, int64_t K, float *r) { row256(NB, XS, w, q, d, s, K, r); }
K32(4) K32(8) K256(4) K256(8)

static int64_t CHUNK = 0; /* 0: whole rows */
static double run(kern f, int nb_call, int NB, const uint8_t *w, int64_t N, int64_t K,
                  const int16_t *q, const float *d, const float *s, float *out) {
    const int64_t rb = K / 256 * QB, nsub = K / 32, kc = CHUNK ? CHUNK : K;
    const double t0 = now_s();
#pragma omp parallel for num_threads(2) schedule(guided)
    for (int64_t t = 0; t < N / 16; t++) {
        float r[16][NBMAX];
        memset(r, 0, sizeof r);
        for (int64_t c = 0; c < K; c += kc)
            for (int64_t n = 16 * t; n < 16 * t + 16; n++)
                for (int b0 = 0; b0 < NB; b0 += nb_call)
                    f(K, w + n * rb + c / 256 * QB, q + b0 * K + c, d + b0 * nsub + c / 32,
                      s + b0 * nsub + c / 32, kc, r[n - 16 * t] + b0);
        for (int64_t n = 16 * t; n < 16 * t + 16; n++)
            for (int i = 0; i < NB; i++) out[i * N + n] = r[n - 16 * t][i];
    }
    return now_s() - t0;
}

int main(int argc, char **argv) {
    const int64_t N = argc > 1 ? atol(argv[1]) : 8192, K = argc > 2 ? atol(argv[2]) : 2048;
    const int NB = argc > 3 ? atoi(argv[3]) : 8, copies = 6;
    CHUNK = argc > 4 ? atol(argv[4]) : 0;
    const int64_t rb = K / 256 * QB, nsub = K / 32;
    uint8_t *w = aligned_alloc(64, copies * N * rb);
    srand(1);
    for (int64_t b = 0; b < copies * N * K / 256; b++) {
        uint8_t *blk = w + b * QB;
        for (int l = 0; l < QB; l++) blk[l] = (uint8_t)rand();
        const uint16_t dh = f32_to_half(0.001f * (1 + rand() % 100)), mh = f32_to_half(0.0005f * (1 + rand() % 100));
        memcpy(blk, &dh, 2), memcpy(blk + 2, &mh, 2);
    }
    float *x = malloc(sizeof(float) * NB * K);
    for (int64_t i = 0; i < NB * K; i++) x[i] = (float)(rand() % 20001 - 10000) / 5000.f * ((i % 97) == 0 ? 20.f : 1.f);
    int16_t *q32 = malloc(2 * NB * K), *q256 = malloc(2 * NB * K);
    float *d32 = malloc(4 * NB * nsub), *s32 = malloc(4 * NB * nsub), *d256 = malloc(4 * NB * nsub), *s256 = malloc(4 * NB * nsub);
    for (int i = 0; i < NB; i++) {
        quantize(x + i * K, K, 32, 32767.f, q32 + i * K, d32 + i * nsub, s32 + i * nsub);
        quantize(x + i * K, K, 256, 16383.f, q256 + i * K, d256 + i * nsub, s256 + i * nsub);
    }
    /* reference on copy 0: float64 of dequantized weights x float x */
    double maxref = 0, e32 = 0, e256 = 0;
    float *o32 = malloc(4 * NB * N), *o256 = malloc(4 * NB * N);
    run(NB == 8 ? k32_4 : k32_4, 4, NB, w, N, K, q32, d32, s32, o32);
    run(NB == 8 ? k256_8 : k256_4, NB, NB, w, N, K, q256, d256, s256, o256);
    for (int64_t n = 0; n < N; n += 97) {
        const uint8_t *row = w + n * rb;
        for (int i = 0; i < NB; i++) {
            double acc = 0;
            for (int64_t bi = 0; bi < K / 256; bi++) {
                const uint8_t *blk = row + bi * QB;
                const float dd = half_to_f32(blk), dm = half_to_f32(blk + 2);
                for (int j = 0; j < 8; j++) {
                    uint8_t s, mm;
                    scale_min_k4(j, blk + 4, &s, &mm);
                    for (int l = 0; l < 32; l++) {
                        const uint8_t byte = blk[16 + 32 * (j / 2) + l];
                        const int qv = (j & 1) ? byte >> 4 : byte & 15;
                        acc += (dd * s * qv - dm * mm) * (double)x[i * K + 256 * bi + 32 * j + l];
                    }
                }
            }
            maxref = fmax(maxref, fabs(acc));
            e32 = fmax(e32, fabs(o32[i * N + n] - acc));
            e256 = fmax(e256, fabs(o256[i * N + n] - acc));
        }
    }
    printf("N=%ld K=%ld rows=%d: max |ref| %.3g, max error per-32 %.3g, per-256 %.3g\n",
           (long)N, (long)K, NB, maxref, e32, e256);
    double r32[15], r256[15];
    for (int r = 0; r < 15; r++) {
        const uint8_t *wc = w + (r % copies) * N * rb;
        r32[r] = run(NB == 8 ? k32_4 : k32_4, 4, NB, wc, N, K, q32, d32, s32, o32);
        const uint8_t *wc2 = w + ((r + 3) % copies) * N * rb;
        r256[r] = run(getenv("P4") ? k256_4 : k256_8, getenv("P4") ? 4 : 8, NB, wc2, N, K, q256, d256, s256, o256);
    }
    double rat[15];
    for (int r = 0; r < 15; r++) rat[r] = r32[r] / r256[r];
    for (int a = 0; a < 15; a++) for (int b = a + 1; b < 15; b++) if (rat[b] < rat[a]) { double t = rat[a]; rat[a] = rat[b]; rat[b] = t; }
    double b32 = 1e9, b256 = 1e9;
    for (int r = 0; r < 15; r++) b32 = fmin(b32, r32[r]), b256 = fmin(b256, r256[r]);
    const double macs = (double)N * K * NB;
    printf("per-32 (passes of 4) %.1f GMAC/s, per-256 (one pass of %d) %.1f GMAC/s; median ratio %.2fx (%.2f-%.2f)\n",
           macs / b32 / 1e9, NB, macs / b256 / 1e9, rat[7], rat[0], rat[14]);
    return 0;
}
