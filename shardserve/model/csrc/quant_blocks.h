/*
 * What the quantized-weight kernels share (quant_kernels.c: block decoding, x's quantization, the
 * portable path and the dispatch; quant_rows.c: the SIMD row kernels for small batches): the
 * GGUF type ids and block shapes, x's quantized form, and the in-register decoding of a block.
 * Hashed with the sources by native_kernels.py, so an edit here rebuilds the library.
 */
#ifndef SHARDSERVE_QUANT_BLOCKS_H
#define SHARDSERVE_QUANT_BLOCKS_H

#include <stdint.h>
#include <string.h>

#include "kernels_common.h"

#if defined(__AVX2__)
#include <immintrin.h>
#define QK_SIMD 1
#else
#define QK_SIMD 0
#endif
/* KQ_AVX2: an AVX2 build without AVX-512, whose K-quant rows hold 32 values in two ymm
 * (quant_rows.c's w32_t) and take the byte-lane Q6_K rows at one row of x. */
#if QK_SIMD && !defined(__AVX512BW__)
#define KQ_AVX2 1
#else
#define KQ_AVX2 0
#endif

/* ggml type ids (the GGUF file's numbers). */
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
/* Repacked at load (shardserve's own layouts, row-major, same bytes as their sources): a row of
 * K is  R4: u8 nib[K/2] | f16 d[K/32] | f16 m[K/32]   (from Q4_0 / Q4_1; K % 64 == 0)
 *             nib byte 32 g + l = q(sub 2g, l) | q(sub 2g+1, l) << 4,   w = d * q + m
 *       R8: i8 q[K] | f16 d[K/32]                      (from Q8_0),       w = d * q
 * so that a 32-byte load holds two sub-blocks and 16 scales convert in one instruction. */
#define T_R4 1004
#define T_R8 1008
/* And T4 / T8: Q4_0 / Q4_1 / Q8_0 in tiles of 16 rows (quant_tiles.c draws them), 320 / 544
 * bytes per tile and sub-block of 32, so 20 / 34 bytes a row's 32; row n of a weight lies in
 * the tile at row n - n % 16 (decode_row_at). */
#define T_T4 1104
#define T_T8 1108
#define T_T4K 1112 /* and Q4_K's, per block of 256: 2304 bytes (16 x 144) */
#define T_T6K 1114 /* and Q6_K's, per block of 256: 3360 bytes (16 x 210) */
#define T4_SUB_BYTES 320
#define T8_SUB_BYTES 544
#define T4K_BLOCK_BYTES 2304
#define T4_Q 64  /* T4's nibbles after d, m; T8's values after d */
#define T8_Q 32
#define T4K_NIB 256 /* T4K's nibbles after its scales (the kernel reads them first) */
#define T6K_BLOCK_BYTES 3360
/* T6K's parts of a block (quant_tiles.c draws it): d, the scales in the order the kernel takes
 * them, then per half h and eight words 8 th .. 8 th + 7 the low quarters' ql words, qh's, the
 * high quarters' ql words; a quarter u of half h takes ql words 16 (u & 1) + t. */
#define T6K_SC(j) (32 + 16 * (8 * ((j) / 8) + 4 * ((j) & 1) + (j) % 8 / 2))
#define T6K_PART(h, th) (288 + 768 * (2 * (h) + (th)))
#define T6K_QL(h, t) (T6K_PART(h, (t) % 16 / 8) + 512 * ((t) / 16) + 32 * ((t) % 8))
#define T6K_QH(h, t) (T6K_PART(h, (t) / 8) + 256 + 32 * ((t) % 8))
#define IS_TILED(type) ((type) == T_T4 || (type) == T_T8 || (type) == T_T4K || (type) == T_T6K)

/* Below this many multiply-adds a call runs on one thread (a parallel region costs more). */
#define QPARALLEL_MIN (256 * 1024)

static inline float half_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400u)) {
            man <<= 1;
            exp--;
        }
        u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Elements and bytes per block; 0 for a type this file does not handle. */
static inline int block_shape(int type, int *elems, int *bytes) {
    switch (type) {
    case T_Q4_0: *elems = 32; *bytes = 18; return 1;
    case T_Q4_1: *elems = 32; *bytes = 20; return 1;
    case T_Q8_0: *elems = 32; *bytes = 34; return 1;
    case T_Q4_K: *elems = 256; *bytes = 144; return 1;
    case T_Q5_K: *elems = 256; *bytes = 176; return 1;
    case T_Q6_K: *elems = 256; *bytes = 210; return 1;
    case T_R4: *elems = 32; *bytes = 20; return 1;
    case T_R8: *elems = 32; *bytes = 34; return 1;
    case T_T4: *elems = 32; *bytes = 20; return 1;
    case T_T8: *elems = 32; *bytes = 34; return 1;
    case T_T4K: *elems = 256; *bytes = 144; return 1;
    case T_T6K: *elems = 256; *bytes = 210; return 1;
    default: return 0;
    }
}

static inline void scale_min_k4(int j, const uint8_t *sc, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = sc[j] & 63;
        *m = sc[j + 4] & 63;
    } else {
        *d = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
        *m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

/* Quantized activations: int16 q [B, K], per 32 the scale d [B, K/32] and per 16 the scaled
 * sum xs [B, K/16] (xs = d * sum q over the half). With int8 activations (quant_rows_int8.c)
 * q8 holds x instead of q, and d, xs, xs32 are its scales. */
typedef struct {
    int16_t *q;
    float *d;
    float *xs;
    float *xs32; /* [B, K/32]: xs of both halves */
    int8_t *q8;  /* [B, K]; NULL: x is int16 */
    int16_t *xu; /* [B, K]: q with each 32 in vpunpck order (quant_rows.c's AVX2 Q6_K rows at one
                    row of x: unpack_order_x); NULL: not made */
} xquant_t;

/* A decoded weight row: per sub-block of 32 the integers q, per half the scale s and the
 * offset m (w = s * q + m); q is int8 for Q8_0 (`is_signed`), else 0..63 as uint8. */
typedef struct {
    uint8_t *q;  /* [K] */
    float *s;    /* [K / 16] */
    float *m;    /* [K / 16] */
} row_t;

/* The portable decoding of one weight row (quant_kernels.c; quant_decode.c falls back on it):
 * decode_row from the row's bytes, decode_row_at row n of a weight (a T4 row from its tile). */
void decode_row(const uint8_t *w, int64_t K, int type, row_t *r);
void decode_row_at(const uint8_t *w, int64_t row_bytes, int64_t n, int64_t K, int type, row_t *r);
/* quant_tiles.c: row `lane` of a tile's first K columns (blocks of 16 rows from `tile`). */
void decode_tile_row(int type, const uint8_t *tile, int lane, int64_t K, row_t *r);

/* Rows of x multiplied per pass over a weight row (quant_rows.c); quant_matmul takes any B. */
#define FUSED_MAX_B 8

#if QK_SIMD
static inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0xF)); }
static inline __m256i high_nibbles(__m256i v) {
    return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0xF));
}
static inline __m256i load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void store32(uint8_t *p, __m256i v) { _mm256_storeu_si256((__m256i *)p, v); }

/* Q6_K's values (0..63) of quarter u of a half: ql's low (u < 2) or high nibbles, with qh's bits
 * 2u, 2u + 1 above them (the 16-bit shifts' spill into a neighbouring byte is masked off). */
static inline __m256i k6_bytes(__m256i ql, __m256i qh, int u) {
    const __m256i nib = u < 2 ? low_nibbles(ql) : high_nibbles(ql);
    const __m256i top = u == 0 ? _mm256_slli_epi16(qh, 4) : u == 1 ? _mm256_slli_epi16(qh, 2)
                      : u == 2 ? qh : _mm256_srli_epi16(qh, 2);
    return _mm256_or_si256(nib, _mm256_and_si256(top, _mm256_set1_epi8(0x30)));
}

/* Columns of an 8 x 8 matrix of 16-bit values in each 128-bit lane: x[i] element j -> v[j]
 * element i (lane by lane: both lanes' matrices at once). */
static inline void transpose8x8_epi16(const __m256i *x, __m256i *v) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi16(x[2 * i], x[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi16(x[2 * i], x[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) { /* x[0..3] then x[4..7] */
        u[4 * h] = _mm256_unpacklo_epi32(t[4 * h], t[4 * h + 2]);
        u[4 * h + 1] = _mm256_unpackhi_epi32(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi32(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi32(t[4 * h + 1], t[4 * h + 3]);
    }
    for (int j = 0; j < 4; j++) {
        v[2 * j] = _mm256_unpacklo_epi64(u[j], u[4 + j]);
        v[2 * j + 1] = _mm256_unpackhi_epi64(u[j], u[4 + j]);
    }
}

/* The 8 x 8 float32 (or int32: a pair of int16) matrix at src (rows ss apart) transposed to dst
 * (rows ds apart, 32-byte aligned): the GEMMs' K-major panels (quant_gemm.c, quant_gemm_i16.c). */
static inline void transpose8x8_ps(const float *src, int64_t ss, float *dst, int64_t ds) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ss);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_store_ps(dst + i * ds, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_store_ps(dst + (i + 4) * ds, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}

/* 8 floats to bfloat16, rounded to nearest even (weights are finite: no NaN case). */
static inline __m128i f32x8_to_bf16(__m256 v) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    return (__m128i)_mm256_cvtneps_pbh(v); /* the same rounding (see f32x16_to_bf16) */
#endif
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* sum8x8 from its first level: h[i] = hadd(v[2i], v[2i + 1]). */
static inline __m256i sum4x8_pairs(const __m256i *h) {
    const __m256i q0 = _mm256_hadd_epi32(h[0], h[1]), q1 = _mm256_hadd_epi32(h[2], h[3]);
    /* q0 = [v0..v3 low-lane sums | v0..v3 high-lane sums], q1 the same for v4..v7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x21),
                            _mm256_blend_epi32(q0, q1, 0xF0));
}

/* 8 vectors of 8 int32 -> [sum v[0], ..., sum v[7]]. */
static inline __m256i sum8x8(const __m256i *v) {
    const __m256i h[4] = {_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]),
                          _mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7])};
    return sum4x8_pairs(h);
}

#if defined(__F16C__)
/* d (and Q4_1's m; Q4_0's -8 d; Q8_0's 0) of 8 blocks, from their first 4 bytes each (dm). */
ALWAYS_INLINE void scales_of(int TYPE, __m256i dm, __m256 *d, __m256 *m) {
    /* per 128-bit lane: the four d halves, then the four m halves; then d's, m's together */
    const __m256i split = _mm256_shuffle_epi8(
        dm, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                             0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m256i both = _mm256_permute4x64_epi64(split, 0xD8);
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(both));
    *m = TYPE == T_Q4_1 ? _mm256_cvtph_ps(_mm256_extracti128_si256(both, 1))
                        : _mm256_mul_ps(*d, _mm256_set1_ps(TYPE == T_Q4_0 ? -8.f : 0.f));
}

/* The scales of the 8 blocks from `first`, `bytes` apart (one row's run of blocks): a gather. */
ALWAYS_INLINE void group_scales(int TYPE, const uint8_t *first, int bytes, __m256 *d, __m256 *m) {
    const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                           _mm256_set1_epi32(bytes));
    scales_of(TYPE, _mm256_i32gather_epi32((const int *)first, idx, 1), d, m);
}

/* The same for 8 blocks a row apart (a strip's column of blocks): eight 4-byte loads put
 * together. A gather there ran as Zen 3's microcode with the strips waiting on it (perf: a
 * third of strips_q4_1's samples on it and the conversions behind it); these loads ran the
 * Q4_1 strips 1.07-1.20x and the Q8_0 ones (the LM head) 0.99-1.10x across runs, where
 * group_scales' contiguous blocks kept the gather (0.96x with these loads). */
ALWAYS_INLINE void strip_scales(int TYPE, const uint8_t *first, int64_t stride, __m256 *d,
                                __m256 *m) {
    uint32_t w[8];
    for (int i = 0; i < 8; i++) memcpy(&w[i], first + (size_t)(i * stride), 4);
    scales_of(TYPE, _mm256_setr_epi32((int)w[0], (int)w[1], (int)w[2], (int)w[3], (int)w[4],
                                      (int)w[5], (int)w[6], (int)w[7]), d, m);
}

#endif

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* A Q4_0 / Q4_1 block's 32 values (0..15) as bytes, in element order. */
ALWAYS_INLINE __m256i q4_block_values(int TYPE, const uint8_t *blk) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(blk + (TYPE == T_Q4_1 ? 4 : 2)));
    const __m128i m4 = _mm_set1_epi8(0xF);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
}

/* Q4_K / Q5_K sub-block j's 32 values (0..31) as bytes. */
ALWAYS_INLINE __m256i k45_sub_values(int TYPE, const uint8_t *blk, int j) {
    const __m256i v = load32(blk + (TYPE == T_Q5_K ? 48 : 16) + 32 * (j / 2));
    __m256i vals = (j & 1) ? high_nibbles(v) : low_nibbles(v);
    if (TYPE == T_Q5_K) {
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(load32(blk + 16), j),
                                             _mm256_set1_epi8(1));
        vals = _mm256_or_si256(vals, _mm256_slli_epi16(bit, 4));
    }
    return vals;
}

/* Sub-block j's values and per-half scales / offsets; k_s / k_m hold a K-quant block's eight
 * sub-block scales and offsets (filled by the caller once per block). */
ALWAYS_INLINE __m256i fused_sub(
    int TYPE, const uint8_t *blk, int j, const float *k_s, const float *k_m, float *s, float *m) {
    if (TYPE == T_Q4_0 || TYPE == T_Q4_1) {
        const float d = half_to_f32(blk);
        s[0] = s[1] = d;
        m[0] = m[1] = TYPE == T_Q4_1 ? half_to_f32(blk + 2) : -8.f * d;
        return q4_block_values(TYPE, blk);
    }
    if (TYPE == T_Q8_0) {
        s[0] = s[1] = half_to_f32(blk);
        m[0] = m[1] = 0.f;
        return load32(blk + 2);
    }
    if (TYPE == T_Q4_K || TYPE == T_Q5_K) {
        s[0] = s[1] = k_s[j];
        m[0] = m[1] = k_m[j];
        return k45_sub_values(TYPE, blk, j);
    }
    /* Q6_K */
    const int h = j / 4, k = j % 4;
    s[0] = k_s[2 * j];
    s[1] = k_s[2 * j + 1];
    m[0] = -32.f * s[0];
    m[1] = -32.f * s[1];
    return k6_bytes(load32(blk + 64 * h + 32 * (k & 1)), load32(blk + 128 + 32 * h), k);
}

ALWAYS_INLINE __m256 bytes8_to_f32(uint64_t v, int is_signed) {
    const __m128i b = _mm_cvtsi64_si128((long long)v);
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

/* Q4_K/Q5_K: the eight 6-bit scales and mins of a block, one per byte, with integer ops on the
 * three words that hold them (scale_min_k4's arithmetic for all eight at once). */
ALWAYS_INLINE void k4_unpack(const uint8_t *blk, uint64_t *sc, uint64_t *mn) {
    uint32_t a, b, c; /* scales[0..3]: sc 0-3 (+ high bits of sc 4-7), [4..7]: mins likewise */
    memcpy(&a, blk + 4, 4);
    memcpy(&b, blk + 8, 4);
    memcpy(&c, blk + 12, 4); /* [8..11]: low nibble sc 4-7, high nibble mins 4-7 */
    *sc = (a & 0x3F3F3F3Fu) | (uint64_t)((c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u)) << 32;
    *mn = (b & 0x3F3F3F3Fu) |
          (uint64_t)(((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u)) << 32;
}

/* A K-quant block's sub-block scales (8 for Q4_K/Q5_K, 16 half-scales for Q6_K). */
ALWAYS_INLINE void fused_block_scales(int TYPE, const uint8_t *blk, float *k_s, float *k_m) {
    if (TYPE == T_Q4_K || TYPE == T_Q5_K) {
        uint64_t sc, mn;
        k4_unpack(blk, &sc, &mn);
        _mm256_storeu_ps(k_s, _mm256_mul_ps(_mm256_set1_ps(half_to_f32(blk)), bytes8_to_f32(sc, 0)));
        _mm256_storeu_ps(k_m, _mm256_mul_ps(_mm256_set1_ps(-half_to_f32(blk + 2)),
                                            bytes8_to_f32(mn, 0)));
    } else if (TYPE == T_Q6_K) {
        /* sub-block j = 4 h + k uses scales[8 h + 2 k + half] = scales[2 j + half] */
        uint64_t lo, hi;
        memcpy(&lo, blk + 192, 8);
        memcpy(&hi, blk + 200, 8);
        const __m256 d = _mm256_set1_ps(half_to_f32(blk + 208));
        _mm256_storeu_ps(k_s, _mm256_mul_ps(d, bytes8_to_f32(lo, 1)));
        _mm256_storeu_ps(k_s + 8, _mm256_mul_ps(d, bytes8_to_f32(hi, 1)));
    }
}

/* T4K on AVX2 (quant_tiles_avx2.c, quant_gemm_i16.c): k4_scale below for 8 rows of a tile, as
 * int32 lanes (h: rows 8 h .. 8 h + 7; a, b, c: their A, B, C words). */
ALWAYS_INLINE __m256i k4_scale8(int j, int min, __m256i a, __m256i b, __m256i c) {
    const __m256i lo6 = min ? b : a;
    if (j < 4) return _mm256_and_si256(_mm256_srli_epi32(lo6, 8 * j), _mm256_set1_epi32(63));
    const __m256i low = _mm256_and_si256(_mm256_srli_epi32(c, 8 * (j - 4) + 4 * min),
                                         _mm256_set1_epi32(0xF));
    const __m256i top = _mm256_and_si256(_mm256_srli_epi32(lo6, 8 * (j - 4) + 2),
                                         _mm256_set1_epi32(0x30));
    return _mm256_or_si256(low, top);
}

#if defined(__AVX512F__)
/* 16 floats to bfloat16, rounded as f32x8_to_bf16 rounds. */
static inline __m256i f32x16_to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
    /* One instruction, the same rounding (it treats denormals as zero: decoded weights, d * q
     * with an fp16 d, are never float32 denormals). */
    return (__m256i)_mm512_cvtneps_pbh(v);
#endif
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* T4K: sub-block j's 6-bit scale (mins: `min`) for a tile's 16 rows from their A, B, C words
 * (k4_unpack's arithmetic, a row per lane). */
ALWAYS_INLINE __m512 k4_scale(int j, int min, __m512i a, __m512i b, __m512i c) {
    const __m512i lo6 = min ? b : a; /* j < 4: 6 bits of byte j; else 4 bits of C, 2 of lo6 */
    const __m512i m6 = _mm512_set1_epi32(63), m4 = _mm512_set1_epi32(0xF);
    if (j < 4) return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(lo6, 8 * j), m6));
    const __m512i low = _mm512_and_si512(_mm512_srli_epi32(c, 8 * (j - 4) + 4 * min), m4);
    const __m512i top = _mm512_and_si512(_mm512_srli_epi32(lo6, 8 * (j - 4) + 2),
                                         _mm512_set1_epi32(0x30));
    return _mm512_cvtepi32_ps(_mm512_or_si512(low, top));
}
#endif
#endif

/* quant_rows.c: out = x @ W^T for the types it has a SIMD path for; 0 where it has none (the
 * caller then takes the portable path), 1 when done. */
int quant_rows_simd(const uint8_t *w, int64_t row_bytes, int type, const xquant_t *xq,
                    int64_t B, int64_t N, int64_t K, void *out, int64_t out_stride,
                    int out_dtype, int threads);
/* quant_gemm_i16.c: quant_gemm's tiles with int16 x (AVX2 builds): whether it takes a type,
 * its scratch per thread, the bytes of x's int16 values (xq->q, laid out as its micro-kernel
 * reads them), row b of x quantized into xq (d and xs32 [B, K / 32]), and a tile's
 * otile [B, 16] = x @ W[n0 .. n0 + nt)^T. */
int gemm_i16_takes(int type);
size_t gemm_i16_scratch_bytes(void);
size_t gemm_i16_x_bytes(int64_t B, int64_t K);
void gemm_i16_quantize_x(const void *x, int64_t x_stride, int dtype, int type, int64_t b,
                         int64_t B, int64_t K, const xquant_t *xq);
void gemm_i16_tile(const uint8_t *w, int64_t row_bytes, int type, const xquant_t *xq, int64_t B,
                   int64_t K, int64_t n0, int64_t nt, void *scratch, float *otile);
/* quant_gemm_i16_tiles.c: a tile's columns [k0, k0 + kc) as quant_gemm_i16.c's panel. */
void gemm_i16_tile_panel(int type, const uint8_t *tile, int64_t k0, int64_t kc, int32_t *panel,
                         float *dg, float *mg);
/* quant_tiles.c: whether this build computes every tile type on its SIMD path (AVX-512 BW/VL,
 * F16C). */
int quant_can_tile(void);
/* quant_tiles.c: whether this build tiles weights of a ggml type at load (the AVX-512 builds
 * every tiled type; AVX2 builds Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K, quant_tiles_avx2.c's); those
 * AVX2 kernels; and quant_tiles_k6_avx2.c's T6K passes of 1 and 2 rows of x (AVX2 builds). */
int quant_tile_takes(int ggml_type);
int quant_tiles_avx2_takes(int ggml_type);
int quant_tiles_avx2(const uint8_t *w, int64_t row_bytes, int type, const xquant_t *xq,
                     int64_t B, int64_t N, int64_t K, void *out, int64_t out_stride,
                     int out_dtype, int threads);
void k6_avx2_pass1(const uint8_t *tile, const xquant_t *xq, int64_t b0, int64_t n0, int64_t K,
                   void *out, int64_t out_stride, int out_dtype);
void k6_avx2_pass2(const uint8_t *tile, const xquant_t *xq, int64_t b0, int64_t n0, int64_t K,
                   void *out, int64_t out_stride, int out_dtype);
/* quant_tiles.c: the same for tiled weights (N a multiple of 16); 0 where this build has no
 * SIMD path for them. */
int quant_tiles_simd(const uint8_t *w, int64_t row_bytes, int type, const xquant_t *xq,
                     int64_t B, int64_t N, int64_t K, void *out, int64_t out_stride,
                     int out_dtype, int threads);

static inline void store_out(void *out, int64_t idx, float v, int out_dtype) {
    if (out_dtype == DT_F32)
        ((float *)out)[idx] = v;
    else
        ((uint16_t *)out)[idx] = f32_to_bf16(v);
}

/* quant_activations.c: one row of x quantized per 32 values into q (int16) or, where q8 is
 * given, q8 (int8), with d, xs, xs32 as xquant_t's. */
void quantize_x_row(const void *x, int64_t K, int dtype, int16_t *q, int8_t *q8, float *d,
                    float *xs, float *xs32);
/* The same into q (int16) at most qmax with one scale per `run` 32s (d repeated for each), with
 * d and xs32 only (quant_gemm_i16.c). */
void quantize_x_row_i16(const void *x, int64_t K, int dtype, int16_t *q, float qmax, int run,
                        float *d, float *xs32);
/* Whether the row kernels take x of `B` rows in xquant_t's xu too (quant_rows.c's AVX2 Q6_K rows
 * at one row of x), and n int16 of q (a multiple of 32) into xu's order. */
int rows_take_unpack_x(int type, int64_t B);
void unpack_order_x(const int16_t *q, int64_t n, int16_t *xu);
#endif
