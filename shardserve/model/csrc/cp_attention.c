/*
 * Context-parallel attention (shardserve/model/context_parallel.py): each rank of a decode
 * context parallel group attends every query row over the keys IT holds (its shard of each
 * request's context) and returns the partial output with its log-sum-exp; the partials of the
 * ranks are then merged exactly. Built into the kernel library with the other sources, once per
 * ISA level (-march=native and the portable x86-64-v2 build), so everything here is plain C
 * whose inner loops the compiler vectorises at either level: 16-wide loops over keys for the
 * scores (K of a chunk transposed once), over head_dim for the values.
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
#define QB 4    /* query vectors scored and accumulated together (one K/V load feeds QB FMAs) */
#define TRANSPOSE_MIN 8 /* from this many query vectors a task transposes K (see scores_t) */

/* Sixteen floats as a GCC/clang vector type (as lora_kernels.c): one zmm register on AVX-512,
 * four SSE registers in the portable build; arrays of them indexed by constants stay in
 * registers. */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

typedef struct {
    float *out;   /* [T, H, D] float32 */
    float *lse;   /* [T, H] float32 */
    const void *q; /* [T, H, D] rows q_stride elements apart */
    int64_t q_stride;
    const void *cache;
    const int64_t *block_table, *row_req, *num_visible;
    int64_t bt_stride, H, Hkv, D, bs;
    float scale;
    int dtype;
} cp_args;

/* Query vectors of a task, rounded up to QB (the padding vectors are zero and never stored). */
static int64_t padded_vectors(int64_t G) { return (TILE * G + QB - 1) / QB * QB; }

/* Per-thread scratch of one task: qf, acc [NQ, D]; m, c [NQ]; l [NQ, KC]; kb, vb [KC, D];
 * kt [D, KC]; s [NQ, KC] (NQ = padded_vectors). */
static int64_t scratch_floats(int64_t G, int64_t D) {
    const int64_t nq = padded_vectors(G);
    return 2 * nq * D + 2 * nq + nq * KC + 3 * KC * D + nq * KC;
}

static inline v16 ld16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void st16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline v16 splat(float x) { return (v16){0} + x; }

static inline v16 vmax(v16 a, v16 b) {
    const v16i gt = a > b;
    return (v16)((gt & (v16i)a) | (~gt & (v16i)b));
}

static inline float hmax(v16 v) {
    v = vmax(v, __builtin_shuffle(v, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    v = vmax(v, __builtin_shuffle(v, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
    v = vmax(v, __builtin_shuffle(v, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
    v = vmax(v, __builtin_shuffle(v, (v16i){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
    return v[0];
}

static inline float hsum(v16 v) {
    v += __builtin_shuffle(v, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (v16i){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v[0];
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

/* A chunk's K and V rows as float32, `stride` elements apart: float32 caches are read where
 * they lie; bfloat16 rows are converted into kb, vb [KC, D]. */
typedef struct {
    const float *k, *v;
    int64_t stride, n;
} chunk;

static chunk load_chunk(float *restrict kb, float *restrict vb, const char *k0, const char *v0,
                        int64_t n, int64_t D, size_t slot_bytes, int dtype) {
    if (dtype == DT_F32)
        return (chunk){(const float *)k0, (const float *)v0, (int64_t)(slot_bytes / 4), n};
    for (int64_t k = 0; k < n; k++) {
        load_row(kb + k * D, k0 + k * slot_bytes, D, dtype);
        load_row(vb + k * D, v0 + k * slot_bytes, D, dtype);
    }
    return (chunk){kb, vb, D, n};
}

/* Scores of many query vectors: K transposed once (kt [D, KC], zero beyond n), then QB vectors
 * at a time s_i += q_i[d] * kt[d], one kt row load per QB FMAs, no horizontal sums. */
static void scores_t(float *restrict s, const float *restrict q, float *restrict kt, chunk c,
                     int64_t nq, int64_t D) {
    for (int64_t k = 0; k < KC; k++)
        for (int64_t d = 0; d < D; d++) kt[d * KC + k] = k < c.n ? c.k[k * c.stride + d] : 0.f;
    for (int64_t i = 0; i < nq; i += QB) {
        v16 a[QB] = {{0}};
        for (int64_t d = 0; d < D; d++) {
            const v16 k = ld16(kt + d * KC);
            for (int b = 0; b < QB; b++) a[b] += q[(i + b) * D + d] * k;
        }
        for (int b = 0; b < QB; b++) st16(s + (i + b) * KC, a[b]);
    }
}

/* Lanes of x and y reduced pairwise in groups of g: lanes [2jg, 2jg + g) of the 32 lanes of
 * (x, y) plus the g lanes after them. Four rounds (g = 8, 4, 2, 1) turn 16 vectors into one
 * whose lane k is the sum of vector k: 15 rounds of 2 shuffles and an add, not 16 trees. */
#define HALVES(x, y, g)                                                                        \
    (__builtin_shuffle(x, y, LANES(g, 0)) + __builtin_shuffle(x, y, LANES(g, 1)))
#define L(g, h, j) (((j) / (g)) * 2 * (g) + (h) * (g) + (j) % (g))
#define LANES(g, h)                                                                            \
    ((v16i){L(g, h, 0), L(g, h, 1), L(g, h, 2), L(g, h, 3), L(g, h, 4), L(g, h, 5),            \
            L(g, h, 6), L(g, h, 7), L(g, h, 8), L(g, h, 9), L(g, h, 10), L(g, h, 11),          \
            L(g, h, 12), L(g, h, 13), L(g, h, 14), L(g, h, 15)})

static inline v16 transpose_sums(v16 a[KC]) {
    for (int j = 0; j < 8; j++) a[j] = HALVES(a[2 * j], a[2 * j + 1], 8);
    for (int j = 0; j < 4; j++) a[j] = HALVES(a[2 * j], a[2 * j + 1], 4);
    for (int j = 0; j < 2; j++) a[j] = HALVES(a[2 * j], a[2 * j + 1], 2);
    return HALVES(a[0], a[1], 1);
}

/* Scores of a few query vectors (decode: G per task), where a transpose would cost more than
 * it saves: per key a dot product 16 columns a step, then one transpose_sums. D % 16 == 0. */
static void scores_rows(float *restrict s, const float *restrict q, chunk c, int64_t nq,
                        int64_t D) {
    for (int64_t i = 0; i < nq; i++) {
        v16 a[KC];
        for (int k = 0; k < KC; k++) {
            a[k] = splat(0.f);
            if (k < c.n)
                for (int64_t d = 0; d < D; d += 16)
                    a[k] += ld16(q + i * D + d) * ld16(c.k + k * c.stride + d);
        }
        st16(s + i * KC, transpose_sums(a));
    }
}

/* Online-softmax step of one query vector: its first `vis` scores of s become weights
 * p = exp(s - m_new) (0 beyond), its lane sums l [KC] and max m are updated, and c is the
 * factor its accumulator must be scaled by. vis <= 0: weights 0, c = 1. */
static void softmax_step(float *restrict s, int64_t vis, float *m, float *restrict l, float *c) {
    const v16i visible = (v16i){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} < (int)vis;
    if (vis <= 0) {
        st16(s, splat(0.f));
        *c = 1.f;
        return;
    }
    const v16 sv = ld16(s);
    const v16 masked = (v16)((visible & (v16i)sv) | (~visible & (v16i)splat(-INFINITY)));
    const float mx = fmaxf(*m, hmax(masked));
    const v16 p = (v16)(visible & (v16i)vexp_nonpos(sv - mx));
    *c = expf(*m - mx); /* 0 on the first chunk (m = -inf) */
    *m = mx;
    st16(l, ld16(l) * *c + p);
    st16(s, p);
}

/* acc_i = acc_i * c_i + sum_k p_i[k] V_k for QB query vectors at a time, 16 columns kept in
 * registers while the chunk's keys stream by (one V load per QB FMAs). */
static void add_values(float *restrict acc, const float *restrict c, const float *restrict p,
                       chunk ch, int64_t nq, int64_t D) {
    for (int64_t i = 0; i < nq; i += QB) {
        int64_t d0 = 0;
        for (; d0 + 16 <= D; d0 += 16) {
            v16 a[QB];
            for (int b = 0; b < QB; b++) a[b] = ld16(acc + (i + b) * D + d0) * c[i + b];
            for (int64_t k = 0; k < ch.n; k++) {
                const v16 v = ld16(ch.v + k * ch.stride + d0);
                for (int b = 0; b < QB; b++) a[b] += p[(i + b) * KC + k] * v;
            }
            for (int b = 0; b < QB; b++) st16(acc + (i + b) * D + d0, a[b]);
        }
        for (; d0 < D; d0++)
            for (int b = 0; b < QB; b++) {
                float a = acc[(i + b) * D + d0] * c[i + b];
                for (int64_t k = 0; k < ch.n; k++) a += p[(i + b) * KC + k] * ch.v[k * ch.stride + d0];
                acc[(i + b) * D + d0] = a;
            }
    }
}

/* Scratch of one task (scratch_floats); nq = its query vectors rounded up to QB. */
typedef struct {
    float *qf, *acc, *m, *c, *l, *kb, *vb, *kt, *s;
} tile_buf;

static tile_buf carve(float *buf, int64_t G, int64_t D) {
    const int64_t nq = padded_vectors(G);
    tile_buf b;
    b.qf = buf, b.acc = b.qf + nq * D, b.m = b.acc + nq * D, b.c = b.m + nq;
    b.l = b.c + nq, b.kb = b.l + nq * KC, b.vb = b.kb + KC * D, b.kt = b.vb + KC * D;
    b.s = b.kt + KC * D;
    return b;
}

/* Scaled float32 queries of rows t0.. (nrows) for the G heads of kv head kvh, zero padding
 * vectors up to nq; zeroed accumulators and sums. */
static void start_tile(const cp_args *a, int64_t t0, int64_t nrows, int64_t kvh, int64_t nq,
                       const tile_buf *b) {
    const int64_t G = a->H / a->Hkv, D = a->D;
    const size_t esize = a->dtype == DT_F32 ? 4 : 2;
    memset(b->qf, 0, sizeof(float) * (size_t)(nq * D));
    for (int64_t r = 0; r < nrows; r++) {
        const char *row = (const char *)a->q + (size_t)((t0 + r) * a->q_stride) * esize;
        float *dst = b->qf + r * G * D;
        load_row(dst, row + (size_t)(kvh * G * D) * esize, G * D, a->dtype);
        for (int64_t e = 0; e < G * D; e++) dst[e] *= a->scale;
    }
    memset(b->acc, 0, sizeof(float) * (size_t)(nq * D));
    memset(b->l, 0, sizeof(float) * (size_t)(nq * KC));
    for (int64_t i = 0; i < nq; i++) b->m[i] = -INFINITY;
}

/* out = acc / l and lse = m + log l per query vector; nothing visible: out 0, lse -inf. */
static void finish_tile(const cp_args *a, int64_t t0, int64_t nrows, int64_t kvh,
                        const tile_buf *b) {
    const int64_t G = a->H / a->Hkv, D = a->D;
    for (int64_t i = 0; i < nrows * G; i++) {
        const int64_t h = (t0 + i / G) * a->H + kvh * G + i % G;
        const float l = hsum(ld16(b->l + i * KC)), inv = l > 0.f ? 1.f / l : 0.f;
        for (int64_t d = 0; d < D; d++) a->out[h * D + d] = b->acc[i * D + d] * inv;
        a->lse[h] = l > 0.f ? b->m[i] + logf(l) : -INFINITY;
    }
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
 * cpu_kernels.c's decode_attention; into L2). */
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
    const int64_t nq = (real + QB - 1) / QB * QB, nkeys = tile_keys(a, t0, nrows);
    const size_t esize = a->dtype == DT_F32 ? 4 : 2, slot_bytes = 2 * a->Hkv * D * esize;
    const tile_buf b = carve(buf, G, D);
    const int64_t *blocks = a->block_table + a->row_req[t0] * a->bt_stride;
    start_tile(a, t0, nrows, kvh, nq, &b);
    for (int64_t start = 0, n; start < nkeys; start += n) {
        n = chunk_len(start, nkeys, bs);
        const char *slot0 = slot_at(a, blocks, start) + (size_t)(kvh * D) * esize;
        prefetch_chunk(a, blocks, start + n, nkeys, kvh);
        const chunk ch = load_chunk(b.kb, b.vb, slot0, slot0 + (size_t)(a->Hkv * D) * esize, n,
                                    D, slot_bytes, a->dtype);
        if (nq >= TRANSPOSE_MIN || D % 16)
            scores_t(b.s, b.qf, b.kt, ch, nq, D);
        else
            scores_rows(b.s, b.qf, ch, nq, D);
        for (int64_t i = 0; i < nq; i++) {
            const int64_t vis = i < real ? a->num_visible[t0 + i / G] - start : 0;
            softmax_step(b.s + i * KC, vis < n ? vis : n, b.m + i, b.l + i * KC, b.c + i);
        }
        add_values(b.acc, b.c, b.s, ch, nq, D);
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

/*
 * Partial attention with log-sum-exp over this rank's shard of a paged KV cache.
 *   out [T, H, D], lse [T, H]: float32, dense; q [T, H, D] (dtype), rows q_stride apart;
 *   cache [NB, bs, 2, Hkv, D] (dtype); block_table [R, bt_stride] int64; row_req, num_visible
 *   [T] int64 (validated by the caller: row_req < R, num_visible <= W * bs).
 * out = softmax(scale q K^T) V over the visible keys, lse = log sum exp(scale q K^T) (natural
 * log); rows with nothing visible get out 0, lse -inf. Returns 0, or -1 out of memory.
 */
int cp_partial_attention(float *out, float *lse, const void *q, int64_t q_stride,
                         const void *cache, const int64_t *block_table, int64_t bt_stride,
                         const int64_t *row_req, const int64_t *num_visible, int64_t T,
                         int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale, int dtype,
                         int num_threads) {
    const cp_args a = {out, lse, q, q_stride, cache, block_table, row_req, num_visible,
                       bt_stride, H, Hkv, D, bs, scale, dtype};
    const int64_t per_thread = scratch_floats(H / Hkv, D);
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(T + 1));
    float *scratch = malloc(sizeof(float) * (size_t)(per_thread * num_threads));
    if (starts == NULL || scratch == NULL) {
        free(starts);
        free(scratch);
        return -1;
    }
    const int64_t tiles = make_tiles(starts, row_req, T), tasks = tiles * Hkv;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (tasks > 1)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t tile = task / Hkv, kvh = task % Hkv;
        tile_task(&a, starts[tile], starts[tile + 1] - starts[tile], kvh,
                  scratch + per_thread * omp_get_thread_num());
    }
    free(starts);
    free(scratch);
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
