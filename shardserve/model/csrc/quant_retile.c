/*
 * GGML blocks rewritten as tiles of 16 rows (T4 from Q4_0 / Q4_1, T8 from Q8_0, T4K from Q4_K,
 * T6K from Q6_K; quant_tiles.c draws the layouts) at load: the same values, bytes moved, Q4_0's
 * m = -8 d computed in fp16 as the kernels would. The values' 16-bit words move 8 words x 16
 * rows at a time (words8), the scales a row at a time: ~1.3 GB/s, most of it the page faults of
 * the new memory (the numpy transposes this replaced took ~1 s for a 1B model's 0.47 GB of
 * Q4_K). Runs on the calling thread (the loader repacks several weights at once on a thread
 * pool; ctypes releases the GIL).
 */
#include "quant_blocks.h"

#if defined(__F16C__)
/* Q4_0's offset -8 d as an fp16 (exact: a power-of-two multiple; an overflow gives inf, as
 * fp16 arithmetic would). */
static void q4_0_min(const uint8_t *d, uint8_t *m) {
    const uint16_t h = _cvtss_sh(-8.f * half_to_f32(d), 0);
    memcpy(m, &h, 2);
}
#else
static void q4_0_min(const uint8_t *d, uint8_t *m) {
    (void)d, (void)m;
}
#endif

/* Words [0, 8) of 16 rows (16 bytes at src + r * stride) as the tiles' 8 chunks at dst: chunk
 * w holds row r's word w at bytes 2 r, 2 r + 1 (an 8 x 8 transpose of words per half). */
static void words8(const uint8_t *src, int64_t stride, uint8_t *dst) {
#if QK_SIMD
    __m256i v[8], x[8];
    for (int j = 0; j < 8; j++)
        v[j] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(src + (j + 8) * stride)),
                                _mm_loadu_si128((const __m128i *)(src + j * stride)));
    transpose8x8_epi16(v, x);
    for (int w = 0; w < 8; w++) store32(dst + 32 * w, x[w]);
#else
    for (int r = 0; r < 16; r++)
        for (int w = 0; w < 8; w++) memcpy(dst + 32 * w + 2 * r, src + r * stride + 2 * w, 2);
#endif
}

/* Q6_K's blocks of 16 rows as T6K (quant_blocks.h's T6K_ offsets). */
static void retile_k6(const uint8_t *src, int64_t row_bytes, int64_t cols, uint8_t *dst) {
    for (int64_t bi = 0; bi < cols / 256; bi++) {
        uint8_t *o = dst + T6K_BLOCK_BYTES * bi;
        const uint8_t *blk0 = src + 210 * bi;
        for (int h = 0; h < 2; h++) {
            for (int g = 0; g < 4; g++)
                words8(blk0 + 64 * h + 16 * g, row_bytes, o + T6K_QL(h, 8 * g));
            for (int g = 0; g < 2; g++)
                words8(blk0 + 128 + 32 * h + 16 * g, row_bytes, o + T6K_QH(h, 8 * g));
        }
        for (int r = 0; r < 16; r++) {
            const uint8_t *blk = blk0 + r * row_bytes;
            for (int j = 0; j < 16; j++) o[T6K_SC(j) + r] = blk[192 + j];
            memcpy(o + 2 * r, blk + 208, 2);
        }
    }
}

/* One tile of 16 rows (src rows `row_bytes` apart) into `dst`. */
static void retile(int src_type, const uint8_t *src, int64_t row_bytes, int64_t cols, uint8_t *dst) {
    if (src_type == T_Q6_K) {
        retile_k6(src, row_bytes, cols, dst);
        return;
    }
    if (src_type == T_Q4_K) {
        for (int64_t bi = 0; bi < cols / 256; bi++) {
            uint8_t *o = dst + T4K_BLOCK_BYTES * bi;
            for (int g = 0; g < 8; g++) /* words 8 g .. 8 g + 7: pair g / 2 */
                words8(src + 144 * bi + 16 + 16 * g, row_bytes, o + T4K_NIB + 256 * g);
            for (int r = 0; r < 16; r++) {
                const uint8_t *blk = src + r * row_bytes + 144 * bi;
                memcpy(o + 2 * r, blk, 2);
                memcpy(o + 32 + 2 * r, blk + 2, 2);
                for (int w = 0; w < 3; w++)
                    memcpy(o + 64 + 64 * w + 4 * r, blk + 4 + 4 * w, 4);
            }
        }
        return;
    }
    const int t8 = src_type == T_Q8_0, bytes = t8 ? 34 : src_type == T_Q4_1 ? 20 : 18;
    const int qs = t8 || src_type == T_Q4_0 ? 2 : 4, words = t8 ? 16 : 8;
    const int sub_bytes = t8 ? T8_SUB_BYTES : T4_SUB_BYTES, q_at = t8 ? T8_Q : T4_Q;
    for (int64_t g = 0; g < cols / 32; g++) {
        uint8_t *o = dst + sub_bytes * g;
        for (int w = 0; w < words; w += 8)
            words8(src + bytes * g + qs + 2 * w, row_bytes, o + q_at + 32 * w);
        for (int r = 0; r < 16; r++) {
            const uint8_t *blk = src + r * row_bytes + bytes * g;
            memcpy(o + 2 * r, blk, 2);
            if (src_type == T_Q4_1)
                memcpy(o + 32 + 2 * r, blk + 2, 2);
            else if (src_type == T_Q4_0)
                q4_0_min(blk, o + 32 + 2 * r);
        }
    }
}

/* rows (a multiple of 16) of `src_type` blocks into tiles at dst (rows x the same bytes a row);
 * 0, or -2 for what this build does not tile (no F16C, another type, a stray row count). */
int quant_retile(int src_type, const uint8_t *src, int64_t src_row_bytes, uint8_t *dst,
                 int64_t rows, int64_t cols) {
#if !defined(__F16C__)
    return -2;
#endif
    int elems, bytes;
    if ((src_type != T_Q4_0 && src_type != T_Q4_1 && src_type != T_Q8_0 && src_type != T_Q4_K &&
         src_type != T_Q6_K) ||
        rows % 16 || !block_shape(src_type, &elems, &bytes) || cols % elems)
        return -2;
    const int64_t dst_row_bytes = cols / elems * (src_type == T_Q4_0 ? 20 : bytes);
    for (int64_t t = 0; t < rows / 16; t++)
        retile(src_type, src + 16 * t * src_row_bytes, src_row_bytes, cols,
               dst + 16 * t * dst_row_bytes);
    return 0;
}
