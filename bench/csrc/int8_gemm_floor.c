/*
 * The multiply-add rate of batched-product inner loops on this CPU, from L1/L2 (no weight
 * decode, no memory traffic): what a quantized GEMM at 32 rows of x could reach at best, per
 * kind of activation. Issue 30 asks 2x llama.cpp's batch-32 decode; this says whether any
 * kernel of a kind could, before one is built into the engine.
 *
 * Every kernel: BR rows of x against a panel of NT = 32 weight rows over K columns, repeated
 * over 36 rows of x and many passes; THREADS threads (OpenMP), each with its own buffers. Kinds:
 *   f32-bcast   float32 x broadcast, K-major float32 panel, FMA     (the AVX2 / AVX-512 f32 GEMM)
 *   bf16-dot    bfloat16 x and panel, vdpbf16ps dot products        (the AVX-512 bf16 GEMM)
 *   i8-vnni     int8 x broadcast by 4s, u8 panel, vpdpbusd, no scales at all (the int8 ceiling)
 *   i8-vnni-32  the same with a K-quant's float step per 32 columns: int32 -> float, times the
 *               16 rows' scales x x's scale, plus the rows' mins x x's sum (per-32 x scales)
 *   i8-avx2     int8 x, u8 panel, vpmaddubsw + vpmaddwd(1), no scales  (AVX2's int8 ceiling)
 *   i8-avx2-32  the same with the float step per 32 columns
 *   i16-avx2    int16 x, int16 panel, vpmaddwd + vpaddd, no scales   (the int16 rows' precision)
 *   i16-avx2-32 the same with the float step per 32 columns
 *   i16-avx2-256 the same with the float step per 256 and the mins per 32 after the products
 *               (the engine's K-quant GEMM, quant_gemm_i16.c)
 *   i16-4x16, i16-6x16 (-32)  the same products, 4 or 6 rows of x a pass, x broadcast from memory
 *   i16-6x8, i16-12x8 (-32)   6 or 12 rows against one panel vector kept in a register
 *   i16-vnni    int16 x and panel, vpdpwssd (AVX-512 VNNI), no scales (the tiles' precision)
 *   i16-vnni-32 the same with the float step per 32 columns
 *
 *   gcc -O3 -march=native -fopenmp [-DFLOOR_UNROLL] bench/csrc/int8_gemm_floor.c -o /tmp/int8_floor
 *   /tmp/int8_floor [THREADS]  prints GMAC/s per kind (kinds this CPU lacks are skipped), at
 *                              THREADS threads (default 2)
 * (bench/_compute_floor.py runs it beside the real-size table, built at the bench's --isa.)
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* -DFLOOR_UNROLL: every inner loop unrolled 4 times, as the engine's micro-kernels are (gcc leaves
 * them rolled at -O3). On Zen 3 that moved loops 1.3-1.5x either way (i16-avx2-256, the engine's
 * shape: 86 -> 129 GMAC/s at 2 threads; i16-4x16-32: 99 -> 80), so the bench builds and runs
 * both and takes each kind's best. */
#ifdef FLOOR_UNROLL
#define UNROLLED _Pragma("GCC unroll 4")
#else
#define UNROLLED
#endif

#define B 36 /* whole blocks of 4 and of 6 rows: every loop's bounds are constants */
#define K 1024
#define NT 32
#define PASSES 4000

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct {
    float xf[B * K], pf[K * NT], dw[K / 32 * NT], mw[K / 32 * NT], dx[B * K / 32], sx[B * K / 32];
    uint16_t xh[B * K], ph[NT * K];
    int8_t x8[B * K];
    uint8_t p8[K * NT];
    float out[B * NT];
} bufs;

#if defined(__AVX2__) && defined(__FMA__)
/* 6 rows x 16 outputs a call (AVX2 float32; the engine's micro_bc). */
static void f32_bcast(bufs *u) {
    for (int b = 0; b < B; b += 6) {
        __m256 acc[6][2];
        for (int r = 0; r < 6; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int h = 0; h < NT; h += 16)
            UNROLLED
            for (int k = 0; k < K; k++) {
                const __m256 w0 = _mm256_load_ps(u->pf + k * NT + h), w1 = _mm256_load_ps(u->pf + k * NT + h + 8);
                for (int r = 0; r < 6; r++) {
                    const __m256 xb = _mm256_broadcast_ss(u->xf + (b + r) * K + k);
                    acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
                }
            }
        for (int r = 0; r < 6; r++) _mm256_storeu_ps(u->out + (b + r) * NT, _mm256_add_ps(acc[r][0], acc[r][1]));
    }
}

/* int8 x (4 columns a broadcast word) times u8 panel words [K/4][NT] (4 columns a lane):
 * vpmaddubsw pairs to int16, vpmaddwd by 1 to int32; with `scaled`, a float step per 32. */
static void i8_avx2(bufs *u, int scaled) {
    const __m256i one = _mm256_set1_epi16(1);
    for (int b = 0; b < B; b += 4)
        for (int h = 0; h < NT; h += 8) {
            __m256 accf[4];
            __m256i acc[4];
            for (int r = 0; r < 4; r++) accf[r] = _mm256_setzero_ps(), acc[r] = _mm256_setzero_si256();
            for (int g = 0; g < K / 32; g++) {
                UNROLLED
                for (int q = 0; q < 8; q++) {
                    const __m256i w = _mm256_load_si256((const __m256i *)(u->p8 + ((g * 8 + q) * NT + h) * 4));
                    for (int r = 0; r < 4; r++) {
                        int32_t xw;
                        memcpy(&xw, u->x8 + (b + r) * K + 32 * g + 4 * q, 4);
                        const __m256i p = _mm256_maddubs_epi16(w, _mm256_set1_epi32(xw));
                        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(p, one));
                    }
                }
                if (scaled) {
                    const __m256 dw = _mm256_loadu_ps(u->dw + g * NT + h), mw = _mm256_loadu_ps(u->mw + g * NT + h);
                    for (int r = 0; r < 4; r++) {
                        const int o = (b + r) * (K / 32) + g;
                        accf[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]),
                                                  _mm256_mul_ps(dw, _mm256_set1_ps(u->dx[o])), accf[r]);
                        accf[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(u->sx[o]), accf[r]);
                        acc[r] = _mm256_setzero_si256();
                    }
                }
            }
            for (int r = 0; r < 4; r++)
                _mm256_storeu_ps(u->out + (b + r) * NT + h,
                                 _mm256_add_ps(accf[r], _mm256_cvtepi32_ps(acc[r])));
        }
}

/* int16 x (2 columns a broadcast word) times int16 panel words [K/2][NT] (2 columns a lane):
 * vpmaddwd + vpaddd, 3 rows x 16 outputs; with `scaled`, a float step per 32 columns. The
 * precision of the engine's int16 rows (x int16 per 32) at twice float32 FMA's products per
 * instruction: AVX2 has no fused int16 multiply-accumulate, so each product costs an add. */
static void i16_avx2(bufs *u, int scaled) {
    for (int b = 0; b < B; b += 3)
        for (int h = 0; h < NT; h += 16) { /* 16 outputs a pass: two vectors of 8 pairs */
            __m256 accf[3][2];
            __m256i acc[3][2];
            for (int r = 0; r < 3; r++)
                for (int v = 0; v < 2; v++) accf[r][v] = _mm256_setzero_ps(), acc[r][v] = _mm256_setzero_si256();
            for (int g = 0; g < K / 32; g++) {
                UNROLLED
                for (int q = 0; q < 16; q++) {
                    const int16_t *p = (const int16_t *)u->ph + (g * 16 + q) * NT * 2 + 2 * h;
                    const __m256i w0 = _mm256_load_si256((const __m256i *)p);
                    const __m256i w1 = _mm256_load_si256((const __m256i *)(p + 16));
                    for (int r = 0; r < 3; r++) {
                        int32_t xw;
                        memcpy(&xw, u->xh + (b + r) * K + 32 * g + 2 * q, 4);
                        const __m256i xb = _mm256_set1_epi32(xw);
                        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, xb));
                        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, xb));
                    }
                }
                if (scaled)
                    for (int v = 0; v < 2; v++) {
                        const int c = g * NT + h + 8 * v;
                        const __m256 dw = _mm256_loadu_ps(u->dw + c), mw = _mm256_loadu_ps(u->mw + c);
                        for (int r = 0; r < 3; r++) {
                            const int o = (b + r) * (K / 32) + g;
                            accf[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][v]),
                                                         _mm256_mul_ps(dw, _mm256_set1_ps(u->dx[o])), accf[r][v]);
                            accf[r][v] = _mm256_fmadd_ps(mw, _mm256_set1_ps(u->sx[o]), accf[r][v]);
                            acc[r][v] = _mm256_setzero_si256();
                        }
                    }
            }
            for (int r = 0; r < 3; r++)
                for (int v = 0; v < 2; v++)
                    _mm256_storeu_ps(u->out + (b + r) * NT + h + 8 * v,
                                     _mm256_add_ps(accf[r][v], _mm256_cvtepi32_ps(acc[r][v])));
        }
}

/* i16_avx2's products as the engine's K-quant GEMM runs them (quant_gemm_i16.c): one int32 sum
 * per 256 columns (x with one scale per 256), its float step, and the mins' FMAs per 32 in a
 * loop of their own after the products (in the products' loop they cost ~1.2x here). */
static void i16_avx2_256(bufs *u, int unused) {
    (void)unused;
    for (int b = 0; b < B; b += 3)
        for (int h = 0; h < NT; h += 16) {
            __m256 accf[3][2];
            for (int r = 0; r < 3; r++) accf[r][0] = accf[r][1] = _mm256_setzero_ps();
            for (int g0 = 0; g0 < K / 32; g0 += 8) {
                __m256i acc[3][2];
                for (int r = 0; r < 3; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
                UNROLLED
                for (int q = 0; q < 16 * 8; q++) {
                    const int16_t *p = (const int16_t *)u->ph + (g0 * 16 + q) * NT * 2 + 2 * h;
                    const __m256i w0 = _mm256_load_si256((const __m256i *)p);
                    const __m256i w1 = _mm256_load_si256((const __m256i *)(p + 16));
                    for (int r = 0; r < 3; r++) {
                        int32_t xw;
                        memcpy(&xw, u->xh + (b + r) * K + 32 * g0 + 2 * q, 4);
                        const __m256i xb = _mm256_set1_epi32(xw);
                        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, xb));
                        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, xb));
                    }
                }
                for (int v = 0; v < 2; v++) {
                    const __m256 dw = _mm256_loadu_ps(u->dw + g0 * NT + h + 8 * v);
                    for (int r = 0; r < 3; r++)
                        accf[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][v]),
                                                     _mm256_mul_ps(dw, _mm256_set1_ps(u->dx[(b + r) * (K / 32) + g0])),
                                                     accf[r][v]);
                }
            }
            for (int g = 0; g < K / 32; g++)
                for (int v = 0; v < 2; v++) {
                    const __m256 mw = _mm256_loadu_ps(u->mw + g * NT + h + 8 * v);
                    for (int r = 0; r < 3; r++)
                        accf[r][v] = _mm256_fmadd_ps(mw, _mm256_set1_ps(u->sx[(b + r) * (K / 32) + g]), accf[r][v]);
                }
            for (int r = 0; r < 3; r++)
                for (int v = 0; v < 2; v++) _mm256_storeu_ps(u->out + (b + r) * NT + h + 8 * v, accf[r][v]);
        }
}

/* The same products as i16_avx2, R rows of x a pass (R = 4 or 6: 2R accumulators, the two
 * panel vectors and a broadcast in the 16 registers), x's pair broadcast straight from memory
 * (a load, no vector-pipe work): per pair of columns 2R vpmaddwd and 2R vpaddd against 2 + R
 * loads. Zen 3 runs vpmaddwd and vpaddd 2 and 3.3 a cycle on register operands: with one add
 * per multiply the 4 vector pipes cap this at 32 products a cycle. */
static inline __attribute__((always_inline)) void i16_rows(bufs *u, int scaled, const int R) {
    for (int b = 0; b < B; b += R)
        for (int h = 0; h < NT; h += 16) {
            __m256 accf[6][2];
            __m256i acc[6][2];
            for (int r = 0; r < R; r++)
                for (int v = 0; v < 2; v++) accf[r][v] = _mm256_setzero_ps(), acc[r][v] = _mm256_setzero_si256();
            for (int g = 0; g < K / 32; g++) {
                UNROLLED
                for (int q = 0; q < 16; q++) {
                    const int16_t *p = (const int16_t *)u->ph + (g * 16 + q) * NT * 2 + 2 * h;
                    const __m256i w0 = _mm256_load_si256((const __m256i *)p);
                    const __m256i w1 = _mm256_load_si256((const __m256i *)(p + 16));
                    for (int r = 0; r < R; r++) {
                        const __m256i xb = _mm256_castps_si256(_mm256_broadcast_ss(
                            (const float *)(u->xh + (b + r) * K + 32 * g + 2 * q)));
                        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, xb));
                        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, xb));
                    }
                }
                if (scaled)
                    for (int v = 0; v < 2; v++) {
                        const int c = g * NT + h + 8 * v;
                        const __m256 dw = _mm256_loadu_ps(u->dw + c), mw = _mm256_loadu_ps(u->mw + c);
                        for (int r = 0; r < R; r++) {
                            const int o = (b + r) * (K / 32) + g;
                            accf[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][v]),
                                                         _mm256_mul_ps(dw, _mm256_set1_ps(u->dx[o])), accf[r][v]);
                            accf[r][v] = _mm256_fmadd_ps(mw, _mm256_set1_ps(u->sx[o]), accf[r][v]);
                            acc[r][v] = _mm256_setzero_si256();
                        }
                    }
            }
            for (int r = 0; r < R; r++)
                for (int v = 0; v < 2; v++)
                    _mm256_storeu_ps(u->out + (b + r) * NT + h + 8 * v,
                                     _mm256_add_ps(accf[r][v], _mm256_cvtepi32_ps(acc[r][v])));
        }
}
/* R rows x one panel vector (8 outputs): the panel vector stays in a register, R broadcasts
 * of x a pair, R vpmaddwd and R vpaddd on registers (R = 12: 12 accumulators). */
static inline __attribute__((always_inline)) void i16_rows1(bufs *u, int scaled, const int R) {
    for (int b = 0; b < B; b += R)
        for (int h = 0; h < NT; h += 8) {
            __m256 accf[12];
            __m256i acc[12];
            for (int r = 0; r < R; r++) accf[r] = _mm256_setzero_ps(), acc[r] = _mm256_setzero_si256();
            for (int g = 0; g < K / 32; g++) {
                UNROLLED
                for (int q = 0; q < 16; q++) {
                    const int16_t *p = (const int16_t *)u->ph + (g * 16 + q) * NT * 2 + 2 * h;
                    const __m256i w = _mm256_load_si256((const __m256i *)p);
                    for (int r = 0; r < R; r++) {
                        const __m256i xb = _mm256_castps_si256(_mm256_broadcast_ss(
                            (const float *)(u->xh + (b + r) * K + 32 * g + 2 * q)));
                        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(w, xb));
                    }
                }
                if (scaled) {
                    const int c = g * NT + h;
                    const __m256 dw = _mm256_loadu_ps(u->dw + c), mw = _mm256_loadu_ps(u->mw + c);
                    for (int r = 0; r < R; r++) {
                        const int o = (b + r) * (K / 32) + g;
                        accf[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]),
                                                  _mm256_mul_ps(dw, _mm256_set1_ps(u->dx[o])), accf[r]);
                        accf[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(u->sx[o]), accf[r]);
                        acc[r] = _mm256_setzero_si256();
                    }
                }
            }
            for (int r = 0; r < R; r++)
                _mm256_storeu_ps(u->out + (b + r) * NT + h, _mm256_add_ps(accf[r], _mm256_cvtepi32_ps(acc[r])));
        }
}
static void i16_rows12x1(bufs *u, int scaled) { i16_rows1(u, scaled, 12); }
static void i16_rows6x1(bufs *u, int scaled) { i16_rows1(u, scaled, 6); }
static void i16_rows4(bufs *u, int scaled) { i16_rows(u, scaled, 4); }
static void i16_rows6(bufs *u, int scaled) { i16_rows(u, scaled, 6); }
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
/* 4 rows of x x 4 panel rows a call, dot products along K (the engine's micro_bf16). */
static void bf16_dot(bufs *u) {
    for (int b = 0; b < B; b += 4)
        for (int c = 0; c < NT; c += 4) {
            __m512 acc[4][4];
            for (int r = 0; r < 4; r++)
                for (int n = 0; n < 4; n++) acc[r][n] = _mm512_setzero_ps();
            UNROLLED
            for (int k = 0; k < K; k += 32) {
                __m512bh w[4];
                for (int n = 0; n < 4; n++) w[n] = (__m512bh)_mm512_loadu_si512(u->ph + (c + n) * K + k);
                for (int r = 0; r < 4; r++) {
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512(u->xh + (b + r) * K + k);
                    for (int n = 0; n < 4; n++) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], xv, w[n]);
                }
            }
            for (int r = 0; r < 4; r++)
                for (int n = 0; n < 4; n++) u->out[(b + r) * NT + c + n] = _mm512_reduce_add_ps(acc[r][n]);
        }
}

/* 6 rows of x x 32 outputs (two vectors of 16 lanes): int8 x and u8 panel words [K/4][NT],
 * vpdpbusd over 4 columns a lane; or (i16) int16 x and int16 panel words [K/2][NT], vpdpwssd
 * over 2 (the int16 rows' precision on AVX-512 VNNI: what the engine's tiles compute). */
static inline __attribute__((always_inline)) void vnni_6x32(bufs *u, int scaled, int i16) {
    for (int b = 0; b < B; b += 6) {
        __m512 accf[6][2];
        __m512i acc[6][2];
        for (int r = 0; r < 6; r++)
            for (int h = 0; h < 2; h++) accf[r][h] = _mm512_setzero_ps(), acc[r][h] = _mm512_setzero_si512();
        for (int g = 0; g < K / 32; g++) {
            UNROLLED
            for (int q = 0; q < (i16 ? 16 : 8); q++) {
                const uint8_t *p = i16 ? (const uint8_t *)(u->ph + (g * 16 + q) * NT * 2)
                                       : u->p8 + (g * 8 + q) * NT * 4;
                const __m512i w0 = _mm512_load_si512(p), w1 = _mm512_load_si512(p + 64);
                for (int r = 0; r < 6; r++) {
                    int32_t xw;
                    memcpy(&xw, i16 ? (const void *)(u->xh + (b + r) * K + 32 * g + 2 * q)
                                    : (const void *)(u->x8 + (b + r) * K + 32 * g + 4 * q), 4);
                    const __m512i xb = _mm512_set1_epi32(xw);
                    for (int h = 0; h < 2; h++)
                        acc[r][h] = i16 ? _mm512_dpwssd_epi32(acc[r][h], h ? w1 : w0, xb)
                                        : _mm512_dpbusd_epi32(acc[r][h], h ? w1 : w0, xb);
                }
            }
            if (scaled)
                for (int h = 0; h < 2; h++) {
                    const __m512 dw = _mm512_loadu_ps(u->dw + g * NT + 16 * h), mw = _mm512_loadu_ps(u->mw + g * NT + 16 * h);
                    for (int r = 0; r < 6; r++) {
                        const int o = (b + r) * (K / 32) + g;
                        accf[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][h]),
                                                     _mm512_mul_ps(dw, _mm512_set1_ps(u->dx[o])), accf[r][h]);
                        accf[r][h] = _mm512_fmadd_ps(mw, _mm512_set1_ps(u->sx[o]), accf[r][h]);
                        acc[r][h] = _mm512_setzero_si512();
                    }
                }
        }
        for (int r = 0; r < 6; r++)
            for (int h = 0; h < 2; h++)
                _mm512_storeu_ps(u->out + (b + r) * NT + 16 * h,
                                 _mm512_add_ps(accf[r][h], _mm512_cvtepi32_ps(acc[r][h])));
    }
}

static void i8_vnni(bufs *u, int scaled) { vnni_6x32(u, scaled, 0); }
static void i16_vnni(bufs *u, int scaled) { vnni_6x32(u, scaled, 1); }
#endif

static void fill(bufs *u) {
    for (int i = 0; i < B * K; i++) {
        u->xf[i] = (float)(i % 13) - 6.f;
        u->xh[i] = 0x3f80;
        u->x8[i] = (int8_t)(i % 17 - 8);
    }
    for (int i = 0; i < K * NT; i++) u->pf[i] = (float)(i % 7), u->ph[i] = 0x3f80, u->p8[i] = (uint8_t)(i % 16);
    for (int i = 0; i < K / 32 * NT; i++) u->dw[i] = 0.01f, u->mw[i] = -0.02f;
    for (int i = 0; i < B * K / 32; i++) u->dx[i] = 0.1f, u->sx[i] = 3.f;
}

static int threads = 2;

static void measure(const char *name, void (*fn)(bufs *, int), int arg) {
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = 0, t1 = 0;
#pragma omp parallel num_threads(threads)
        {
            bufs *u = aligned_alloc(64, sizeof(bufs));
            fill(u);
            fn(u, arg); /* warm */
#pragma omp barrier
#pragma omp master
            t0 = now_s();
            for (int p = 0; p < PASSES; p++) fn(u, arg);
#pragma omp barrier
#pragma omp master
            t1 = now_s();
            free(u);
        }
        const double rate = (double)threads * PASSES * (double)B * K * NT / (t1 - t0) / 1e9;
        best = rate > best ? rate : best;
    }
    printf("%-11s %7.1f GMAC/s (%d threads, best of 3)\n", name, best, threads);
}

#if defined(__AVX2__) && defined(__FMA__)
static void f32_bcast_(bufs *u, int a) { (void)a; f32_bcast(u); }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
static void bf16_dot_(bufs *u, int a) { (void)a; bf16_dot(u); }
#endif

int main(int argc, char **argv) {
    if (argc > 1) threads = atoi(argv[1]) > 0 ? atoi(argv[1]) : 1;
#if defined(__AVX2__) && defined(__FMA__)
    measure("f32-bcast", f32_bcast_, 0);
    measure("i8-avx2", i8_avx2, 0);
    measure("i8-avx2-32", i8_avx2, 1);
    measure("i16-avx2", i16_avx2, 0);
    measure("i16-avx2-32", i16_avx2, 1);
    measure("i16-avx2-256", i16_avx2_256, 0);
    measure("i16-4x16", i16_rows4, 0);
    measure("i16-4x16-32", i16_rows4, 1);
    measure("i16-6x16", i16_rows6, 0);
    measure("i16-6x16-32", i16_rows6, 1);
    measure("i16-6x8", i16_rows6x1, 0);
    measure("i16-6x8-32", i16_rows6x1, 1);
    measure("i16-12x8", i16_rows12x1, 0);
    measure("i16-12x8-32", i16_rows12x1, 1);
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
    measure("bf16-dot", bf16_dot_, 0);
    measure("i8-vnni", i8_vnni, 0);
    measure("i8-vnni-32", i8_vnni, 1);
    measure("i16-vnni", i16_vnni, 0);
    measure("i16-vnni-32", i16_vnni, 1);
#endif
    return 0;
}
