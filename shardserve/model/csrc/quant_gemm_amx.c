/*
 * The panel GEMM's bfloat16 products on AMX (Intel's tile unit: Sapphire Rapids and later),
 * where the build has AMX-BF16 and the kernel grants this process the tile data.
 *
 * One TDPBF16PS multiplies a 16 x 32 bfloat16 tile by a 32 x 16 one into 16 x 16 float32 sums
 * (8192 multiply-adds: 256 vdpbf16ps' worth), so past a few rows of x the products cost little
 * beside decoding the weights into the panel. The roles: the decoded weight rows are the left
 * tile as they lie (row-major, 64 bytes of a row per tile row), and x is the right one, laid
 * out once per call in AMX's pair order (a 32-bit word = two bfloat16 of one row of x):
 *
 *   xv, per block of 16 rows of x (B rounded up to 16, the padding zero):
 *     word [kp][r] = x[16 blk + r][2 kp], x[16 blk + r][2 kp + 1]     (kp < K / 2, r < 16)
 *   so the right tile of columns k .. k + 31 is the 1 KB at word [k / 2][0], rows 64 bytes.
 *
 *   C[m][r] += sum_k panel[m][k] * x[r][k]   (m a weight row, r a row of x: out transposed)
 *
 * Tiles: 0-3 the sums (weight rows 0-15 / 16-31 x the two blocks of x), 4-5 the panel, 6-7 x.
 * The sums are float32 as vdpbf16ps' (micro_bf16), in another order: within tolerance of it,
 * not bit-identical.
 */
#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"

/* x's layout (plain C: every build has it; only AMX builds call it). */
size_t gemm_amx_x_bytes(int64_t B, int64_t K) { return (size_t)((B + 15) / 16 * 16 * K * 2); }

/* Row b of x (bfloat16, unit column stride) into xv; the rows past B of the last block are
 * zeroed by the caller of row B - 1 (each row's thread writes only its own lanes). */
void gemm_amx_pack_x(const uint16_t *x, int64_t xs, int64_t b, int64_t B, int64_t K,
                     uint32_t *xv) {
    uint32_t *blk = xv + b / 16 * 16 * (K / 2);
    const uint16_t *row = x + b * xs;
    for (int64_t kp = 0; kp < K / 2; kp++) memcpy(blk + kp * 16 + b % 16, row + 2 * kp, 4);
    if (b == B - 1)
        for (int64_t r = b % 16 + 1; r < 16; r++)
            for (int64_t kp = 0; kp < K / 2; kp++) blk[kp * 16 + r] = 0;
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512F__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out the tile data (8 KB of state a thread) only on request, once per process;
 * -1 not asked yet, 0 refused (an old kernel, a signal stack too small) or turned off
 * (gemm_amx_set: SHARDSERVE_AMX=0), 1 granted. */
static int amx_granted = -1;

int gemm_amx_ready(void) {
    int g = __atomic_load_n(&amx_granted, __ATOMIC_ACQUIRE);
    if (g < 0) {
        g = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        __atomic_store_n(&amx_granted, g, __ATOMIC_RELEASE);
    }
    return g;
}

/* 0 turns AMX off for this process (its products then take the vdpbf16ps panels); 1 asks for
 * it again. Returns whether it is on. */
int gemm_amx_set(int on) {
    __atomic_store_n(&amx_granted, on ? -1 : 0, __ATOMIC_RELEASE);
    return gemm_amx_ready();
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config_t;

/* Every tile 16 rows of 64 bytes. The configuration is a thread's state: each thread of a
 * parallel region loads it before its first tile and releases it after its last. A constant
 * in memory: GCC 12 does not see ldtilecfg read its operand and dropped the stores of a
 * configuration built on the stack (the unit then faulted on the half-written one). */
static const tile_config_t tile_config __attribute__((aligned(64))) = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

void gemm_amx_begin(void) { _tile_loadconfig(&tile_config); }

void gemm_amx_end(void) { _tile_release(); }

/* otile[r * nt_stride + m] += sums[m][r] for the rows of x and weight rows that exist. */
static void add_transposed(const float *sums, float *otile, int64_t nt_stride, int64_t rows,
                           int64_t m_rows) {
    for (int64_t m = 0; m < m_rows; m++)
        for (int64_t r = 0; r < rows; r++) otile[r * nt_stride + m] += sums[m * 16 + r];
}

#define STORE_ADD(T, R0, M0)                                                                 \
    do {                                                                                     \
        _tile_stored(T, sums, 64);                                                           \
        if ((R0) < B && (M0) < nt)                                                           \
            add_transposed(sums, otile + (R0) * nt_stride + (M0), nt_stride,                 \
                           B - (R0) < 16 ? B - (R0) : 16, nt - (M0) < 16 ? nt - (M0) : 16);  \
    } while (0)

/* otile[b][m] += x[b] . panel[m] over columns [k0, k0 + kc) of the call (kc a multiple of 32)
 * for b < B, m < nt (<= 32): the panel's rows ps elements apart, from its column 0; xv as
 * packed for K columns. Weight rows past nt are read (the panel holds 32) and their sums
 * dropped. */
void gemm_amx_chunk(const uint16_t *panel, int64_t ps, const uint32_t *xv, int64_t B, int64_t K,
                    int64_t k0, int64_t kc, float *otile, int64_t nt, int64_t nt_stride) {
    float sums[16 * 16] __attribute__((aligned(64)));
    const int64_t blocks = (B + 15) / 16, blk_words = 16 * (K / 2);
    for (int64_t bb = 0; bb < blocks; bb += 2) {
        const uint32_t *x0 = xv + bb * blk_words + k0 / 2 * 16;
        const uint32_t *x1 = bb + 1 < blocks ? x0 + blk_words : x0;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < kc; k += 32) {
            _tile_loadd(4, panel + k, ps * 2);
            _tile_loadd(5, panel + 16 * ps + k, ps * 2);
            _tile_loadd(6, x0 + k / 2 * 16, 64);
            _tile_loadd(7, x1 + k / 2 * 16, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        const int64_t r0 = bb * 16, r1 = bb + 1 < blocks ? r0 + 16 : B;
        STORE_ADD(0, r0, 0);
        STORE_ADD(1, r1, 0);
        STORE_ADD(2, r0, 16);
        STORE_ADD(3, r1, 16);
    }
}

#else
int gemm_amx_ready(void) { return 0; }
int gemm_amx_set(int on) { return (void)on, 0; }
void gemm_amx_begin(void) {}
void gemm_amx_end(void) {}
void gemm_amx_chunk(const uint16_t *panel, int64_t ps, const uint32_t *xv, int64_t B, int64_t K,
                    int64_t k0, int64_t kc, float *otile, int64_t nt, int64_t nt_stride) {
    (void)panel, (void)ps, (void)xv, (void)B, (void)K, (void)k0, (void)kc, (void)otile,
        (void)nt, (void)nt_stride;
}
#endif
