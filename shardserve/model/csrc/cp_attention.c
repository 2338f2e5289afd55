/*
 * Context-parallel attention (shardserve/model/context_parallel.py): each rank of a decode
 * context parallel group attends every query row over the keys IT holds (its shard of each
 * request's context) and returns the partial output with its log-sum-exp; the partials of the
 * ranks are then merged exactly. Built into the kernel library with the other sources, once per
 * ISA level (-march=native and the portable x86-64-v2 build), so everything here is plain C
 * with GCC vector types the compiler maps onto either level: the scores and the softmax run
 * 16 query vectors to a vector (one per lane, the queries transposed once per task), the
 * values 16 columns of head_dim at a time. Measured on this VM's Xeon, one thread, Hq 9,
 * Hkv 3, D 64, float32: 256 causal prefill rows over 2,048 keys 13 ms (SDPA on the same keys
 * already gathered contiguous: 15 ms); 8 decode rows over 4,096 keys 5-7 ms (the decode-only
 * decode_attention, which needs no lse: 4-5 ms).
 *
 * Layout (as cpu_kernels.c): cache [num_blocks, bs, 2, Hkv, D], one slot = K heads then V heads;
 * local key j of request r is slot block_table[r][j / bs] * bs + j % bs. Query row t belongs to
 * request row_req[t] and sees its local keys j < num_visible[t] (a prefix: local keys are in
 * position order, so a causal limit is a prefix on every rank).
 *
 * Work split: consecutive rows of one request form tiles of up to TILE rows; a task is
 * (tile, kv head): its TILE x G query vectors (G = H / Hkv heads share the KV head) meet each
 * loaded key once. Decode rows are tiles of one row (G vectors per key). Tasks run over OpenMP
 * (torch's pool, see cpu_kernels.c), dynamically scheduled: causal tiles differ in length.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels_common.h"

/* The v16 helpers below are static inline: no ABI crosses a call, so the warning that a 64-byte
 * vector argument would pass differently without AVX-512 does not apply. */
#pragma GCC diagnostic ignored "-Wpsabi"

#define TILE 16 /* query rows of one request per task */
#define KC 16   /* keys per online-softmax step: one vector of scores */
#define QB 4    /* query vectors accumulated together (one V load feeds QB FMAs) */

/* Sixteen floats as a GCC/clang vector type (as lora_kernels.c): one zmm register on AVX-512,
 * four SSE registers in the portable build; arrays of them indexed by constants stay in
 * registers. */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

typedef struct { /* cp_partial_attention's arguments (see there) */
    float *out, *lse;
    const void *q, *cache;
    int64_t q_stride;
    const int64_t *block_table, *row_req, *num_visible;
    int64_t bt_stride, H, Hkv, D, bs;
    float scale;
    int dtype;
} cp_args;

/* Per-thread scratch of one task, NQ = TILE * G query vectors (a multiple of 16): qt [NQ, D];
 * acc [NQ, D]; m, c, l [NQ]; kb, vb [KC, D]; s [NQ, KC]. */
static int64_t scratch_floats(int64_t G, int64_t D) {
    const int64_t nq = TILE * G;
    return 2 * nq * D + 3 * nq + 2 * KC * D + nq * KC;
}

static inline v16 ld16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void st16(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v16 splat(float x) { return (v16){0} + x; }

static inline v16 vmax(v16 a, v16 b) {
    const v16i gt = a > b;
    return (v16)((gt & (v16i)a) | (~gt & (v16i)b));
}

/* e^x for x <= 0, as 2^n * 2^f (n = round(x log2 e), |f| <= 1/2; degree-6 Taylor, relative
 * error ~1e-7). x is clamped at -87: results stay normal (~1e-38), never denormal. */
static inline v16 vexp_nonpos(v16 x) {
    const v16 t = vmax(x, splat(-87.f)) * 1.44269504088896341f;
    const v16i ni = __builtin_convertvector(t - 0.5f, v16i); /* t <= 0: truncation rounds */
    const v16 f = (t - __builtin_convertvector(ni, v16)) * 0.69314718055994531f;
    v16 p = splat(1.f / 720.f);
    p = p * f + 1.f / 120.f;
    p = p * f + 1.f / 24.f;
    p = p * f + 1.f / 6.f;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    return p * (v16)((ni + 127) << 23);
}

/* n elements of a K or V row (float32 or bfloat16) into dst as float32. */
static inline void load_row(float *restrict dst, const char *src, int64_t n, int dtype) {
    if (dtype == DT_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    const uint16_t *h = (const uint16_t *)src;
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
        v16h x;
        memcpy(&x, h + d, sizeof x);
        const v16i wide = __builtin_convertvector(x, v16i) << 16;
        memcpy(dst + d, &wide, sizeof wide);
    }
    for (; d < n; d++) dst[d] = bf16_to_f32(h[d]);
}

/* A chunk's K and V rows as float32, `stride` elements apart: a float32 cache is read where it
 * lies when the chunk is whole; else rows are converted or copied into kb, vb [KC, D], zero
 * beyond n (finite: they meet q in the scores, then weigh 0). */
typedef struct {
    const float *k, *v;
    int64_t stride, n;
} chunk;

static chunk load_chunk(float *restrict kb, float *restrict vb, const char *k0, const char *v0,
                        int64_t n, int64_t D, size_t slot_bytes, int dtype) {
    if (dtype == DT_F32 && n == KC)
        return (chunk){(const float *)k0, (const float *)v0, (int64_t)(slot_bytes / 4), n};
    for (int64_t k = 0; k < n; k++) {
        load_row(kb + k * D, k0 + k * slot_bytes, D, dtype);
        load_row(vb + k * D, v0 + k * slot_bytes, D, dtype);
    }
    memset(kb + n * D, 0, sizeof(float) * (size_t)((KC - n) * D));
    memset(vb + n * D, 0, sizeof(float) * (size_t)((KC - n) * D));
    return (chunk){kb, vb, D, n};
}

/* Scores of 16 query vectors at a time, one per lane (qt [D, 16] of each group: the queries
 * transposed once per task): s[k] += K_k[d] * qt[d] for the KC keys, so one qt load feeds KC
 * FMAs and every score lands in its vector's lane, with no transpose of K and no horizontal
 * sum. s [groups, KC, 16]. */
static void scores(float *restrict s, const float *restrict qt, chunk c, int64_t groups,
                   int64_t D) {
    for (int64_t g = 0; g < groups; g++) {
        v16 a[KC] = {{0}};
        for (int64_t d = 0; d < D; d++) {
            const v16 qv = ld16(qt + (g * D + d) * 16);
            const float *kp = c.k + d;
            for (int k = 0; k < KC; k++, kp += c.stride) a[k] += *kp * qv;
        }
        for (int k = 0; k < KC; k++) st16(s + (g * KC + k) * 16, a[k]);
    }
}

/* Online-softmax step of 16 query vectors (one per lane) over a chunk's scores s [KC, 16]:
 * lane j sees keys k < vis[j]. Scores become weights p = exp(s - m_new) (0 where not seen),
 * m [16] and l [16] are updated, c [16] is what each accumulator must be scaled by. */
static void softmax_step(float *restrict s, const v16i vis, float *m, float *l, float *c) {
    const v16 m_old = ld16(m), none = splat(-INFINITY);
    v16 mx = m_old;
    for (int k = 0; k < KC; k++) {
        const v16i seen = vis > k;
        mx = vmax(mx, (v16)((seen & (v16i)ld16(s + k * 16)) | (~seen & (v16i)none)));
    }
    v16 sum = splat(0.f);
    for (int k = 0; k < KC; k++) {
        const v16 p = (v16)((vis > k) & (v16i)vexp_nonpos(ld16(s + k * 16) - mx));
        st16(s + k * 16, p);
        sum += p;
    }
    /* m_old = -inf: c ~ 1e-38 (-inf - mx clamps at -87) scales a zero accumulator; a lane that
     * has seen nothing yet keeps mx = -inf and gets NaN - clamped - to the same. */
    const v16 cv = vexp_nonpos(m_old - mx);
    st16(c, cv);
    st16(l, ld16(l) * cv + sum);
    st16(m, mx);
}

/* acc_i = acc_i * c_i + sum_k p_i[k] V_k for QB query vectors at a time, 16 columns kept in
 * registers while the chunk's keys stream by (one V load per QB FMAs); p [groups, KC, 16] as
 * softmax_step leaves it. */
static void add_values(float *restrict acc, const float *restrict c, const float *restrict p,
                       chunk ch, int64_t nq, int64_t D) {
    for (int64_t i = 0; i < nq; i += QB) {
        int64_t d0 = 0;
        for (; d0 + 16 <= D; d0 += 16) {
            v16 a[QB];
            for (int b = 0; b < QB; b++) a[b] = ld16(acc + (i + b) * D + d0) * c[i + b];
            const float *pk = p + (i / 16) * KC * 16 + i % 16;
            for (int64_t k = 0; k < ch.n; k++) {
                const v16 v = ld16(ch.v + k * ch.stride + d0);
                for (int b = 0; b < QB; b++) a[b] += pk[k * 16 + b] * v;
            }
            for (int b = 0; b < QB; b++) st16(acc + (i + b) * D + d0, a[b]);
        }
        for (; d0 < D; d0++)
            for (int b = 0; b < QB; b++) {
                float a = acc[(i + b) * D + d0] * c[i + b];
                for (int64_t k = 0; k < ch.n; k++)
                    a += p[(i / 16) * KC * 16 + k * 16 + i % 16 + b] * ch.v[k * ch.stride + d0];
                acc[(i + b) * D + d0] = a;
            }
    }
}

/* Scratch of one task (scratch_floats). */
typedef struct {
    float *qt, *acc, *m, *c, *l, *kb, *vb, *s;
} tile_buf;

static tile_buf carve(float *buf, int64_t G, int64_t D) {
    const int64_t nq = TILE * G;
    tile_buf b;
    b.qt = buf, b.acc = b.qt + nq * D, b.m = b.acc + nq * D, b.c = b.m + nq, b.l = b.c + nq;
    b.kb = b.l + nq, b.vb = b.kb + KC * D, b.s = b.vb + KC * D;
    return b;
}

/* The scaled float32 queries of rows t0.. (nrows) for the G heads of kv head kvh, transposed
 * into groups of 16 lanes (qt[g][d][j] = vector 16 g + j; padding lanes 0); zeroed sums. */
static void start_tile(const cp_args *a, int64_t t0, int64_t nrows, int64_t kvh, int64_t nq,
                       const tile_buf *b) {
    const int64_t G = a->H / a->Hkv, D = a->D;
    const size_t esize = a->dtype == DT_F32 ? 4 : 2;
    memset(b->qt, 0, sizeof(float) * (size_t)(nq * D));
    for (int64_t r = 0; r < nrows; r++) {
        const char *row = (const char *)a->q + (size_t)((t0 + r) * a->q_stride) * esize;
        load_row(b->acc, row + (size_t)(kvh * G * D) * esize, G * D, a->dtype); /* as a buffer */
        for (int64_t g = 0, i = r * G; g < G; g++, i++)
            for (int64_t d = 0; d < D; d++)
                b->qt[((i / 16) * D + d) * 16 + i % 16] = a->scale * b->acc[g * D + d];
    }
    memset(b->acc, 0, sizeof(float) * (size_t)(nq * D));
    memset(b->l, 0, sizeof(float) * (size_t)nq);
    for (int64_t i = 0; i < nq; i++) b->m[i] = -INFINITY;
}

/* out = acc / l and lse = m + log l per query vector; nothing visible: out 0, lse -inf. */
static void finish_tile(const cp_args *a, int64_t t0, int64_t nrows, int64_t kvh,
                        const tile_buf *b) {
    const int64_t G = a->H / a->Hkv, D = a->D;
    for (int64_t i = 0; i < nrows * G; i++) {
        const int64_t h = (t0 + i / G) * a->H + kvh * G + i % G;
        const float l = b->l[i], inv = l > 0.f ? 1.f / l : 0.f;
        for (int64_t d = 0; d < D; d++) a->out[h * D + d] = b->acc[i * D + d] * inv;
        a->lse[h] = l > 0.f ? b->m[i] + logf(l) : -INFINITY;
    }
}

/* Lane j of group g: how many of the chunk's keys (from `start`, n of them) vector 16 g + j
 * sees; 0 for padding lanes. */
static v16i visible(const cp_args *a, int64_t t0, int64_t real, int64_t g, int64_t start,
                    int64_t n) {
    const int64_t G = a->H / a->Hkv;
    v16i vis;
    for (int j = 0; j < 16; j++) {
        const int64_t i = g * 16 + j, v = i < real ? a->num_visible[t0 + i / G] - start : 0;
        vis[j] = (int32_t)(v < 0 ? 0 : v < n ? v : n);
    }
    return vis;
}

/* Keys the tile's rows see at most: its chunks run to there. */
static int64_t tile_keys(const cp_args *a, int64_t t0, int64_t nrows) {
    int64_t nkeys = 0;
    for (int64_t r = 0; r < nrows; r++)
        if (a->num_visible[t0 + r] > nkeys) nkeys = a->num_visible[t0 + r];
    return nkeys;
}

/* Keys of the chunk from `start`: up to KC, never across a block end. */
static inline int64_t chunk_len(int64_t start, int64_t nkeys, int64_t bs) {
    const int64_t n = nkeys - start < KC ? nkeys - start : KC, in_block = bs - start % bs;
    return n < in_block ? n : in_block;
}

/* Local key j's slot in the cache (blocks: the request's block table row). */
static inline const char *slot_at(const cp_args *a, const int64_t *blocks, int64_t j) {
    const size_t slot_bytes = 2 * a->Hkv * a->D * (a->dtype == DT_F32 ? 4 : 2);
    return (const char *)a->cache + (size_t)(blocks[j / a->bs] * a->bs + j % a->bs) * slot_bytes;
}

/* Ask for the next chunk's K and V rows of kv head kvh while this one computes: blocks lie
 * scattered in the pool, so the hardware prefetcher loses the stream at each block end (as in
 * attention_avx512.c's prefetch_group; into L2). */
static void prefetch_chunk(const cp_args *a, const int64_t *blocks, int64_t start,
                           int64_t nkeys, int64_t kvh) {
    if (start >= nkeys) return;
    const size_t esize = a->dtype == DT_F32 ? 4 : 2, row = (size_t)a->D * esize;
    const size_t slot_bytes = 2 * (size_t)a->Hkv * row;
    const char *k0 = slot_at(a, blocks, start) + kvh * row, *v0 = k0 + a->Hkv * row;
    for (int64_t k = 0; k < chunk_len(start, nkeys, a->bs); k++)
        for (size_t off = 0; off < row; off += 64) {
            __builtin_prefetch(k0 + k * slot_bytes + off, 0, 2);
            __builtin_prefetch(v0 + k * slot_bytes + off, 0, 2);
        }
}

/* One task: rows t0 .. t0+nrows-1 (one request) against kv head kvh of their shard. */
static void tile_task(const cp_args *a, int64_t t0, int64_t nrows, int64_t kvh, float *buf) {
    const int64_t G = a->H / a->Hkv, D = a->D, bs = a->bs, real = nrows * G;
    const int64_t groups = (real + 15) / 16, nkeys = tile_keys(a, t0, nrows);
    const size_t esize = a->dtype == DT_F32 ? 4 : 2, slot_bytes = 2 * a->Hkv * D * esize;
    const tile_buf b = carve(buf, G, D);
    const int64_t *blocks = a->block_table + a->row_req[t0] * a->bt_stride;
    start_tile(a, t0, nrows, kvh, groups * 16, &b);
    for (int64_t start = 0, n; start < nkeys; start += n) {
        n = chunk_len(start, nkeys, bs);
        const char *slot0 = slot_at(a, blocks, start) + (size_t)(kvh * D) * esize;
        prefetch_chunk(a, blocks, start + n, nkeys, kvh);
        const chunk ch = load_chunk(b.kb, b.vb, slot0, slot0 + (size_t)(a->Hkv * D) * esize, n,
                                    D, slot_bytes, a->dtype);
        scores(b.s, b.qt, ch, groups, D);
        for (int64_t g = 0; g < groups; g++)
            softmax_step(b.s + g * KC * 16, visible(a, t0, real, g, start, n), b.m + g * 16,
                         b.l + g * 16, b.c + g * 16);
        add_values(b.acc, b.c, b.s, ch, (real + QB - 1) / QB * QB, D);
    }
    finish_tile(a, t0, nrows, kvh, &b);
}

/* Tile starts: a new tile where the request changes or TILE rows are full; returns the count,
 * with starts[count] = T. */
static int64_t make_tiles(int64_t *starts, const int64_t *row_req, int64_t T) {
    int64_t count = 0;
    for (int64_t t = 0; t < T; t++)
        if (t == 0 || row_req[t] != row_req[t - 1] || t - starts[count - 1] == TILE)
            starts[count++] = t;
    starts[count] = T;
    return count;
}

/* What the kernel would read unchecked, checked once (cheap next to the attention): each row's
 * request < R, its visible keys <= W * bs, and the blocks those reach < NB. 0, or -2, -3, -4. */
static int rows_fit(const cp_args *a, int64_t T, int64_t R, int64_t W, int64_t NB) {
    int64_t done = 0; /* blocks of the previous row's request already checked */
    for (int64_t t = 0; t < T; t++) {
        const int64_t r = a->row_req[t], nv = a->num_visible[t];
        if (r < 0 || r >= R) return -2;
        if (nv < 0 || nv > W * a->bs) return -3;
        if (t == 0 || r != a->row_req[t - 1]) done = 0;
        const int64_t *blocks = a->block_table + r * a->bt_stride;
        for (; done < (nv + a->bs - 1) / a->bs; done++)
            if (blocks[done] < 0 || blocks[done] >= NB) return -4;
    }
    return 0;
}

/*
 * Partial attention with log-sum-exp over this rank's shard of a paged KV cache.
 *   out [T, H, D], lse [T, H]: float32, dense; q [T, H, D] (dtype), rows q_stride apart;
 *   cache [NB, bs, 2, Hkv, D] (dtype); block_table [R, W] int64, rows bt_stride apart;
 *   row_req, num_visible [T] int64.
 * out = softmax(scale q K^T) V over the visible keys, lse = log sum exp(scale q K^T) (natural
 * log); rows with nothing visible get out 0, lse -inf. Returns 0, -1 out of memory, or
 * rows_fit's code (nothing written).
 */
int cp_partial_attention(float *out, float *lse, const void *q, int64_t q_stride,
                         const void *cache, const int64_t *block_table, int64_t bt_stride,
                         const int64_t *row_req, const int64_t *num_visible, int64_t T,
                         int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale, int dtype,
                         int64_t R, int64_t W, int64_t NB, int num_threads) {
    const cp_args a = {out, lse, q, cache, q_stride, block_table, row_req, num_visible,
                       bt_stride, H, Hkv, D, bs, scale, dtype};
    const int fit = rows_fit(&a, T, R, W, NB);
    if (fit != 0) return fit;
    const int64_t per_thread = scratch_floats(H / Hkv, D);
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(T + 1));
    float *scratch = malloc(sizeof(float) * (size_t)(per_thread * num_threads));
    if (starts == NULL || scratch == NULL) {
        free(starts), free(scratch);
        return -1;
    }
    const int64_t tiles = make_tiles(starts, row_req, T), tasks = tiles * Hkv;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (tasks > 1)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t tile = task / Hkv, kvh = task % Hkv;
        tile_task(&a, starts[tile], starts[tile + 1] - starts[tile], kvh,
                  scratch + per_thread * omp_get_thread_num());
    }
    free(starts), free(scratch);
    return 0;
}

/*
 * The exact merge of S partials: out[n] = sum_s w_s outs[s, n], w_s = exp(lse_s - LSE),
 * LSE = log sum_s exp(lse_s), in shard order s = 0.. (fixed, so every rank gets the same bits);
 * a row whose every lse is -inf (no shard saw a key) gets 0.
 *   out [N, D], outs [S, N, D], lses [S, N]: float32, dense (N = rows x heads).
 */
int cp_merge(float *out, const float *outs, const float *lses, int64_t S, int64_t N, int64_t D,
             int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (N * S * D >= 65536)
    for (int64_t n = 0; n < N; n++) {
        float mx = -INFINITY, den = 0.f;
        for (int64_t s = 0; s < S; s++) mx = lses[s * N + n] > mx ? lses[s * N + n] : mx;
        float *o = out + n * D;
        memset(o, 0, sizeof(float) * (size_t)D);
        if (mx == -INFINITY) continue;
        for (int64_t s = 0; s < S; s++) den += expf(lses[s * N + n] - mx);
        for (int64_t s = 0; s < S; s++) {
            const float w = expf(lses[s * N + n] - mx) / den;
            const float *src = outs + (s * N + n) * D;
            for (int64_t d = 0; d < D; d++) o[d] += w * src[d];
        }
    }
    return 0;
}
