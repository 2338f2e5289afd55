/*
 * What the kernel sources share (cpu_kernels.c, quant_kernels.c, decode_layers.c, lora_kernels.c;
 * all built into one library by shardserve/model/native_kernels.py, which hashes this header with
 * them so an edit here rebuilds the library): the element types, the bfloat16 conversions, the AVX-512
 * element loads, stores and exp, the AVX2 ones, and the prototypes of the functions one file calls from another. Declaring them once
 * here, included by the file that defines them too, lets the compiler check every caller against
 * the definition.
 */
#ifndef SHARDSERVE_KERNELS_COMMON_H
#define SHARDSERVE_KERNELS_COMMON_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Element types (the `dtype` arguments; native_kernels.py's _DTYPES). */
#define DT_F32 0
#define DT_BF16 1

/* For the small helpers of the SIMD paths, which must inline into their loops to be fast. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Rounded to nearest even, as torch rounds; a NaN stays a (quiet) NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__AVX2__)
/* 8 activations at p (float32 or bfloat16) as float32. */
ALWAYS_INLINE __m256 load8_act(const void *p, int dtype) {
    if (dtype == DT_F32) return _mm256_loadu_ps(p);
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
#endif

#if defined(__AVX512F__)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

#if defined(__AVX512F__)
/* 16 elements at p (float32 or bfloat16) as float32. */
ALWAYS_INLINE __m512 load16(const void *p, int dtype) {
    if (dtype == DT_F32) return _mm512_loadu_ps(p);
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* Store 16 float32 values at p as float32 or bfloat16 (rounded to nearest even). */
ALWAYS_INLINE void store16(void *p, __m512 x, int dtype) {
    if (dtype == DT_F32) {
        _mm512_storeu_ps(p, x);
        return;
    }
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(x));
#else
    float tmp[16];
    _mm512_storeu_ps(tmp, x);
    for (int i = 0; i < 16; i++) ((uint16_t *)p)[i] = f32_to_bf16(tmp[i]);
#endif
}

/* x rounded to dtype (identity for float32), back in float32. */
ALWAYS_INLINE __m512 round16(__m512 x, int dtype) {
    if (dtype == DT_F32) return x;
    uint16_t tmp[16];
    store16(tmp, x, dtype);
    return load16(tmp, dtype);
}

/* e^x as 2^n * 2^f with |f| <= 1/2: 2^f by a degree-6 Taylor polynomial (relative error ~1e-7),
 * 2^n applied exactly by scalef. x is clamped to [-87, 88], so results stay finite and normal. */
ALWAYS_INLINE __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* e^x as 2^n * 2^f, |f| <= 1/2 (exp16 above on 8 lanes; attention_avx2.c's softmax
 * and cpu_kernels.c's AVX2 SiLU): 2^f by a degree-6 Taylor
 * polynomial, 2^n put in the exponent bits. x clamped to [-87, 88]: results finite, normal. */
ALWAYS_INLINE __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718055994531f));
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* decode_attention.c */
int decode_attention(void *out, const void *q, const int64_t *q_rows, int64_t q_row_stride,
                     const void *cache, const int64_t *block_table, int64_t bt_stride,
                     const int64_t *seq_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                     int64_t block_size, float scale, int dtype, int kv_dtype,
                     int num_threads);

/* cpu_kernels.c */
int rms_norm(void *out, const void *x, int64_t x_stride, void *residual, const void *weight,
             int64_t T, int64_t N, float eps, int dtype, int num_threads);
int rope_inplace(void *x, int64_t row_stride, const int64_t *positions, const float *table,
                 int64_t T, int64_t heads, int64_t D, int dtype, int num_threads);
int silu_mul(void *out, const void *gate_up, int64_t T, int64_t I, int dtype, int num_threads);
int cache_write(void *cache, const void *src, int64_t src_row_stride, const int64_t *slots,
                int64_t T, int64_t slot_elems, int dtype, int cache_dtype);
int add_bias(void *out, const void *bias, int64_t T, int64_t N, int dtype);

/* cp_attention.c: the exact merge of partial attention outputs by their log-sum-exp */
int cp_merge(float *out, const float *outs, const float *lses, int64_t S, int64_t N, int64_t D,
             int num_threads);

/* quant_kernels.c */
int quant_matmul(void *out, int64_t out_stride, int out_dtype, const void *x, int64_t x_stride,
                 int dtype, const uint8_t *w, int64_t row_bytes, int type, int64_t B, int64_t N,
                 int64_t K, int num_threads);
#define QDECODE_MAX 1024 /* the most elements quant_decode_chunk decodes at once */
/* Elements [k0, k0 + kc) of row n of a weight (rows row_bytes apart from w). */
void quant_decode_chunk(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t K,
                        int64_t k0, int64_t kc, void *out, int out_dtype);
/* Rows [r0, r1) of a tile of 16 (quant_tile_panels.c), row r to out + (r - r0) * stride
 * elements; 0 where this build cannot (the caller then decodes row by row). */
int quant_decode_tile(int type, const uint8_t *tile, int r0, int r1, int64_t k0, int64_t kc,
                      void *out, int64_t stride, int out_dtype);
/* The same for a weight's rows [n0, n0 + nt) over the tiles they lie in, row n0 + i to
 * panel + i * ps elements. */
int quant_decode_tiled_panel(int type, const uint8_t *w, int64_t row_bytes, int64_t n0,
                             int64_t nt, int64_t k0, int64_t kc, void *panel, int64_t ps,
                             int out_dtype);
int quant_block_shape(int type, int *elems, int *bytes);

/* quant_gemm_amx.c: the panel GEMM's bfloat16 products on AMX (its header draws x's layout):
 * whether this process may use it (or turn it off), x's bytes there, row b of x packed, a
 * thread's tile configuration loaded / released, and otile [B, nt_stride] += x @ panel^T over
 * one chunk. */
int gemm_amx_ready(void);
int gemm_amx_set(int on);
size_t gemm_amx_x_bytes(int64_t B, int64_t K);
void gemm_amx_pack_x(const uint16_t *x, int64_t xs, int64_t b, int64_t B, int64_t K,
                     uint32_t *xv);
void gemm_amx_begin(void);
void gemm_amx_end(void);
void gemm_amx_chunk(const uint16_t *panel, int64_t ps, const uint32_t *xv, int64_t B, int64_t K,
                    int64_t k0, int64_t kc, float *otile, int64_t nt, int64_t nt_stride);
/* quant_gemm.c */
int quant_gemm(void *out, int64_t out_stride, int out_dtype, const void *x, int64_t x_stride,
               int dtype, const uint8_t *w, int64_t row_bytes, int type, int64_t B, int64_t N,
               int64_t K, int num_threads);
int quant_gemm_int16(int type);

/* lora_kernels.c */
int lora_add(void *out, int64_t out_stride, int dtype, const void *x, int64_t x_stride,
             const int32_t *slots, int64_t T, const void *at, const void *bt, int wdtype,
             int64_t S, int64_t R, int64_t K, int64_t N, const int64_t *seg_ends, int64_t nseg,
             int num_threads);

#endif
