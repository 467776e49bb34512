/* Causal attention over a paged prefix and fresh keys, for one prefill segment on an AVX-512 CPU.
 *
 * Layout (elements, not bytes): queries q[L, H, D] and the segment's fresh keys and values k, v[L, Hkv, D]
 * are token-major with any token and head strides; the output o[L, H, D] likewise. Keys before `start`
 * (the cached prefix) are read in place from one layer of the paged pool, pool[blocks, Hkv, bs, D]
 * (contiguous), through `blocks`, the row's block ids. Query i (position start + i) sees keys
 * j <= start + i of [prefix | fresh]: no key is ever read at or past start + L, and no pool slot at or past
 * `start`, so filler and stale blocks never meet a query.
 *
 * Two phases on the OpenMP threads torch computes on (the library links the libgomp torch has loaded, so
 * no second pool competes with it for the cores): flash_pack lays each KV head's keys and values out once per call in blocks of BK keys, in
 * the order the dot-product instructions read them (bfloat16: pairs along the reduced dimension, as
 * vdpbf16ps takes them); flash_attend runs blocks of query positions (every query head of one KV head
 * together, so each packed block serves g * bq rows) with an online softmax in float32. A tile of query rows
 * reads a block only through its last row's last visible key, rounded up to 16 keys: on the diagonal a tile
 * skips the chunks of keys none of its rows sees, and the blocks past its last row altogether. Probabilities
 * meet the values at the input precision and accumulate in float32, as torch's CPU flash kernel does.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

#define BK 64   /* keys per packed block: four 16-lane vectors */
#define TILE 4  /* query rows per micro-tile */

/* One segment of the step: `length` tokens at token `offset` of q, k, v and o, at positions start ..
 * start + length - 1; its prefix blocks are block_ids[blocks_at ..]; its packed K/V blocks and its work items
 * begin at `packed_at` and `items_at` of the call's. */
typedef struct {
    int64_t offset, length, start, blocks_at, packed_at, items_at;
} flash_segment;

typedef struct {
    const void *q;
    int64_t q_st, q_sh;
    const void *k, *v;
    int64_t k_st, k_sh, v_st, v_sh;
    const void *pool_k, *pool_v; /* one layer of the pool, [blocks, Hkv, bs, D]; NULL when no segment is cached */
    int64_t bs;
    void *o;
    int64_t o_st, o_sh;
    int64_t H, Hkv, D, bq;
    float scale;
    int64_t nseg;
    const flash_segment *seg;
    const int64_t *block_ids;
    int64_t packed, items;      /* the call's packed blocks (every segment's Hkv * nblocks) and work items */
    int64_t next_pack, next_item; /* shared counters: each caller takes the next unclaimed one */
} flash_args;

static inline int64_t nblocks(const flash_segment *s) { return (s->start + s->length + BK - 1) / BK; }

/* The segment holding global index w, from the cursor on (claimed indices only grow). */
static inline const flash_segment *find(const flash_args *a, int64_t w, int64_t *cursor, int packed) {
    while (*cursor + 1 < a->nseg && (packed ? a->seg[*cursor + 1].packed_at : a->seg[*cursor + 1].items_at) <= w)
        ++*cursor;
    return a->seg + *cursor;
}

/* The row of key j (of [prefix | fresh]) of KV head hk: the pool's slot before `start`, the fresh row after. */
static inline const char *key_row(const flash_args *a, const flash_segment *s, int values, int64_t j, int64_t hk,
                                  int64_t esize) {
    if (j < s->start) {
        int64_t b = a->block_ids[s->blocks_at + j / a->bs];
        const void *pool = values ? a->pool_v : a->pool_k;
        return (const char *)pool + (((b * a->Hkv + hk) * a->bs + j % a->bs) * a->D) * esize;
    }
    int64_t t = s->offset + j - s->start;
    if (values) return (const char *)a->v + (t * a->v_st + hk * a->v_sh) * esize;
    return (const char *)a->k + (t * a->k_st + hk * a->k_sh) * esize;
}
/* Lanes of keys j0 .. j0 + 15 that query position `limit` (its last visible key) may see. */
static inline __mmask16 visible(int64_t j0, int64_t limit) {
    int64_t n = limit - j0 + 1;
    if (n >= 16) return (__mmask16)0xFFFF;
    if (n <= 0) return 0;
    return (__mmask16)((1u << n) - 1u);
}

/* One tile's softmax step over a block of scores s[r][0..16 nc - 1] (scaled here): updates the running max m and
 * sum l, returns each row's factor for its earlier output, and leaves the block's probabilities in s (zero in
 * the chunks from nc on). */
static inline __attribute__((always_inline)) void online_softmax(__m512 s[TILE][4], const int64_t limit[TILE],
                                                                 int64_t kb, float scale, float *m, float *l,
                                                                 float alpha[TILE], int nc) {
    for (int r = 0; r < TILE; r++) {
        __mmask16 mask[4];
        __m512 best = _mm512_set1_ps(-INFINITY);
        for (int c = 0; c < nc; c++) {
            mask[c] = visible(kb + 16 * c, limit[r]);
            s[r][c] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), mask[c], s[r][c], _mm512_set1_ps(scale));
            best = _mm512_max_ps(best, s[r][c]);
        }
        float m_new = fmaxf(m[r], _mm512_reduce_max_ps(best));
        __m512 shift = _mm512_set1_ps(m_new);
        __m512 sum = _mm512_setzero_ps();
        for (int c = 0; c < nc; c++) {
            s[r][c] = _mm512_maskz_mov_ps(mask[c], exp_ps(_mm512_sub_ps(s[r][c], shift)));
            sum = _mm512_add_ps(sum, s[r][c]);
        }
        for (int c = nc; c < 4; c++) s[r][c] = _mm512_setzero_ps(); /* chunks past every row's last key */
        alpha[r] = m[r] == -INFINITY ? 0.0f : expf(m[r] - m_new);
        l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
        m[r] = m_new;
    }
}

/* One work item: `bq` query positions of one segment (position-major, then the g query heads of KV head hk). */
typedef struct {
    const flash_segment *s;
    int64_t pos0, rows, g, hk;
} item_rows;

static inline item_rows item(const flash_args *a, const flash_segment *s, int64_t w) {
    int64_t nq = (s->length + a->bq - 1) / a->bq, local = w - s->items_at;
    item_rows it;
    it.s = s;
    it.g = a->H / a->Hkv;
    it.hk = local % a->Hkv;
    it.pos0 = (nq - 1 - local / a->Hkv) * a->bq; /* a segment's longest items first */
    int64_t n = s->length - it.pos0 < a->bq ? s->length - it.pos0 : a->bq;
    it.rows = n * it.g;
    return it;
}

/* Element offset of row r's query (or output) vector. */
static inline int64_t row_offset(const item_rows *it, int64_t r, int64_t st, int64_t sh) {
    int64_t pos = it->s->offset + it->pos0 + r / it->g, head = it->hk * it->g + r % it->g;
    return pos * st + head * sh;
}

/* ------------------------------------------------------------------ packing */

/* Transposes a 16 x 16 tile of 32-bit words in place: r[i] holds row i, then column i. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + j], 128-bit lane L: column 4L + j of rows 4i .. 4i + 3 */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    __m512i c[16];
    for (int j = 0; j < 4; j++) {
        __m512i a = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88), b = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);
        __m512i e = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88), f = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
        c[j] = _mm512_shuffle_i32x4(a, e, 0x88);
        c[8 + j] = _mm512_shuffle_i32x4(a, e, 0xdd);
        c[4 + j] = _mm512_shuffle_i32x4(b, f, 0x88);
        c[12 + j] = _mm512_shuffle_i32x4(b, f, 0xdd);
    }
    for (int i = 0; i < 16; i++) r[i] = c[i];
}

/* bfloat16, per KV head and block: keys as uint32 [D/2][BK], word (d2, n) = key n's elements 2*d2 and
 * 2*d2 + 1 (vdpbf16ps's pairs); values as uint32 [BK/2][D], word (k2, d) = element d of keys 2*k2 and
 * 2*k2 + 1. float32: keys as [D][BK] (transposed), values as [BK][D]. Zero past the segment's last key.
 * Keys are transposed 16 x 16 words at a time (bfloat16 pairs and float32 values are both 32-bit words). */
static void pack_block(const flash_args *a, const flash_segment *s, int64_t local, void *kp, void *vp, int bf16) {
    int64_t nb = nblocks(s), hk = local / nb, b = local % nb, D = a->D, n_keys = s->start + s->length;
    int64_t at = s->packed_at + local, esize = bf16 ? 2 : 4, words = bf16 ? D / 2 : D;
    uint32_t *kb = (uint32_t *)kp + at * words * BK;
    const char *rows[BK];
    for (int64_t n = 0; n < BK; n++) rows[n] = b * BK + n < n_keys ? key_row(a, s, 0, b * BK + n, hk, esize) : NULL;
    for (int64_t n0 = 0; n0 < BK; n0 += 16)
        for (int64_t w0 = 0; w0 < words; w0 += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = rows[n0 + i] ? _mm512_loadu_si512((const uint32_t *)rows[n0 + i] + w0) : _mm512_setzero_si512();
            transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(kb + (w0 + i) * BK + n0, r[i]);
        }
    if (bf16) {
        uint32_t *vb = (uint32_t *)vp + at * (BK / 2) * D;
        /* element i of the even row, then of the odd row, for i in a half of 16 (bit 5 picks the odd row) */
        uint16_t lo[32], hi[32];
        for (int i = 0; i < 16; i++) lo[2 * i] = i, lo[2 * i + 1] = 32 + i, hi[2 * i] = 16 + i, hi[2 * i + 1] = 48 + i;
        __m512i pick_lo = _mm512_loadu_si512(lo), pick_hi = _mm512_loadu_si512(hi);
        for (int64_t k2 = 0; k2 < BK / 2; k2++) {
            int64_t j = b * BK + 2 * k2;
            const uint16_t *even = j < n_keys ? (const uint16_t *)key_row(a, s, 1, j, hk, 2) : NULL;
            const uint16_t *odd = j + 1 < n_keys ? (const uint16_t *)key_row(a, s, 1, j + 1, hk, 2) : NULL;
            for (int64_t d = 0; d < D; d += 32) {
                __m512i e = even ? _mm512_loadu_si512(even + d) : _mm512_setzero_si512();
                __m512i o = odd ? _mm512_loadu_si512(odd + d) : _mm512_setzero_si512();
                _mm512_storeu_si512(vb + k2 * D + d, _mm512_permutex2var_epi16(e, pick_lo, o));
                _mm512_storeu_si512(vb + k2 * D + d + 16, _mm512_permutex2var_epi16(e, pick_hi, o));
            }
        }
        return;
    }
    float *vb = (float *)vp + at * BK * D;
    for (int64_t n = 0; n < BK; n++) {
        const float *vrow = b * BK + n < n_keys ? (const float *)key_row(a, s, 1, b * BK + n, hk, 4) : NULL;
        if (vrow)
            memcpy(vb + n * D, vrow, sizeof(float) * D);
        else
            memset(vb + n * D, 0, sizeof(float) * D);
    }
}

/* Packs every segment's keys and values (phase one); each thread claims blocks until none are left. */
static void flash_pack(flash_args *a, void *kp, void *vp, int bf16) {
    int64_t cursor = 0;
    for (;;) {
        int64_t w = __atomic_fetch_add(&a->next_pack, 1, __ATOMIC_RELAXED);
        if (w >= a->packed) return;
        const flash_segment *s = find(a, w, &cursor, 1);
        pack_block(a, s, w - s->packed_at, kp, vp, bf16);
    }
}

/* ------------------------------------------------------------------ tiles */

static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

/* Scores of TILE query rows against the first nc chunks (16 keys each) of one packed key block; the chunks past
 * them are left unset. */
static inline __attribute__((always_inline)) void qk_tile(const flash_args *a, const void *q[TILE], const void *kb,
                                                          __m512 s[TILE][4], int bf16, int nc) {
    for (int r = 0; r < TILE; r++)
        for (int c = 0; c < nc; c++) s[r][c] = _mm512_setzero_ps();
    if (bf16) {
        const uint32_t *k = kb;
        for (int64_t d2 = 0; d2 < a->D / 2; d2++) {
            __m512bh kv[4];
            for (int c = 0; c < nc; c++) kv[c] = as_bh(_mm512_loadu_si512(k + d2 * BK + 16 * c));
            for (int r = 0; r < TILE; r++) {
                __m512bh qq = as_bh(_mm512_set1_epi32((int)((const uint32_t *)q[r])[d2]));
                for (int c = 0; c < nc; c++) s[r][c] = _mm512_dpbf16_ps(s[r][c], qq, kv[c]);
            }
        }
        return;
    }
    const float *k = kb;
    for (int64_t d = 0; d < a->D; d++) {
        __m512 kv[4];
        for (int c = 0; c < nc; c++) kv[c] = _mm512_loadu_ps(k + d * BK + 16 * c);
        for (int r = 0; r < TILE; r++) {
            __m512 qq = _mm512_set1_ps(((const float *)q[r])[d]);
            for (int c = 0; c < nc; c++) s[r][c] = _mm512_fmadd_ps(qq, kv[c], s[r][c]);
        }
    }
}

/* out[r] = out[r] * alpha[r] + p[r] V over the first 16 nc values of one packed value block, for `rows` rows (the
 * rest compute nothing that is kept). p: the tile's probabilities, left in s by online_softmax. */
static inline __attribute__((always_inline)) void pv_tile(const flash_args *a, __m512 s[TILE][4],
                                                          const float alpha[TILE], const void *vb, float *out,
                                                          int rows, int bf16, int nc) {
    int64_t D = a->D;
    uint16_t pb[TILE][BK] __attribute__((aligned(64)));
    float pf[TILE][BK] __attribute__((aligned(64)));
    for (int r = 0; r < TILE; r++) {
        if (bf16) {
            _mm512_storeu_si512(pb[r], (__m512i)_mm512_cvtne2ps_pbh(s[r][1], s[r][0]));
            _mm512_storeu_si512(pb[r] + 32, (__m512i)_mm512_cvtne2ps_pbh(s[r][3], s[r][2]));
        } else {
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(pf[r] + 16 * c, s[r][c]);
        }
    }
    for (int64_t dv = 0; dv < D; dv += 64) {
        __m512 acc[TILE][4];
        for (int r = 0; r < TILE; r++)
            for (int c = 0; c < 4; c++)
                acc[r][c] = r < rows ? _mm512_mul_ps(_mm512_loadu_ps(out + r * D + dv + 16 * c), _mm512_set1_ps(alpha[r]))
                                     : _mm512_setzero_ps();
        if (bf16) {
            const uint32_t *v = vb;
            for (int64_t k2 = 0; k2 < nc * 8; k2++) {
                __m512bh vv[4];
                for (int c = 0; c < 4; c++) vv[c] = as_bh(_mm512_loadu_si512(v + k2 * D + dv + 16 * c));
                for (int r = 0; r < TILE; r++) {
                    __m512bh pp = as_bh(_mm512_set1_epi32(((const int *)pb[r])[k2]));
                    for (int c = 0; c < 4; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pp, vv[c]);
                }
            }
        } else {
            const float *v = vb;
            for (int64_t k = 0; k < nc * 16; k++) {
                __m512 vv[4];
                for (int c = 0; c < 4; c++) vv[c] = _mm512_loadu_ps(v + k * D + dv + 16 * c);
                for (int r = 0; r < TILE; r++) {
                    __m512 pp = _mm512_set1_ps(pf[r][k]);
                    for (int c = 0; c < 4; c++) acc[r][c] = _mm512_fmadd_ps(pp, vv[c], acc[r][c]);
                }
            }
        }
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(out + r * D + dv + 16 * c, acc[r][c]);
    }
}

/* ------------------------------------------------------------------ attention */

/* One tile against one block, over its first nc chunks of 16 keys (past them no row of the tile sees a key). */
static inline __attribute__((always_inline)) void tile_block_n(const flash_args *a, const void *q[TILE],
                                                               const int64_t limit[TILE], int64_t kb0,
                                                               const void *kb, const void *vb, float *mt, float *lt,
                                                               float *out, int rows, int bf16, int nc) {
    __m512 sc[TILE][4];
    float alpha[TILE];
    qk_tile(a, q, kb, sc, bf16, nc);
    online_softmax(sc, limit, kb0, a->scale, mt, lt, alpha, nc);
    pv_tile(a, sc, alpha, vb, out, rows, bf16, nc);
}

/* A tile against the block on its diagonal, where even its last row sees fewer than 48 of the block's keys: a
 * copy of the tile's work per chunk count, kept apart from the full blocks' (inlined there, the full blocks'
 * loop ran slower). */
static __attribute__((noinline)) void tile_block_part(const flash_args *a, const void *q[TILE],
                                                      const int64_t limit[TILE], int64_t kb0, const void *kb,
                                                      const void *vb, float *mt, float *lt, float *out, int rows,
                                                      int bf16, int nc) {
    switch (nc) {
    case 1: tile_block_n(a, q, limit, kb0, kb, vb, mt, lt, out, rows, bf16, 1); break;
    case 2: tile_block_n(a, q, limit, kb0, kb, vb, mt, lt, out, rows, bf16, 2); break;
    default: tile_block_n(a, q, limit, kb0, kb, vb, mt, lt, out, rows, bf16, 3); break;
    }
}

static void attend_item(const flash_args *a, const item_rows *it, const void *kp, const void *vp, float *out, float *m,
                        float *l, int bf16) {
    int64_t D = a->D, esize = bf16 ? 2 : 4;
    const flash_segment *s = it->s;
    int64_t block_words = bf16 ? (D / 2) * BK : D * BK; /* elements of one packed block (K and V alike) */
    for (int64_t r = 0; r < it->rows; r++) m[r] = -INFINITY, l[r] = 0.0f;
    memset(out, 0, sizeof(float) * it->rows * D);
    int64_t blocks = (s->start + it->pos0 + it->rows / it->g - 1) / BK + 1; /* through the item's last visible key */
    for (int64_t b = 0; b < blocks; b++) {
        int64_t at = s->packed_at + it->hk * nblocks(s) + b;
        const char *kb = (const char *)kp + at * block_words * 4, *vb = (const char *)vp + at * block_words * 4;
        for (int64_t r0 = 0; r0 < it->rows; r0 += TILE) {
            int rows = it->rows - r0 < TILE ? (int)(it->rows - r0) : TILE;
            int64_t top = s->start + it->pos0 + (r0 + rows - 1) / it->g; /* the tile's last row sees furthest */
            if (top < b * BK) continue; /* no row of this tile sees the block (a later tile may) */
            const void *q[TILE];
            int64_t limit[TILE];
            float mt[TILE], lt[TILE];
            for (int r = 0; r < TILE; r++) {
                int64_t rr = r < rows ? r0 + r : r0; /* a short tile repeats its first row, and keeps nothing of it */
                q[r] = (const char *)a->q + row_offset(it, rr, a->q_st, a->q_sh) * esize;
                limit[r] = s->start + it->pos0 + rr / it->g;
                mt[r] = m[rr], lt[r] = l[rr];
            }
            int nc = top - b * BK >= 3 * 16 ? 4 : (int)((top - b * BK) / 16) + 1;
            if (nc == 4)
                tile_block_n(a, q, limit, b * BK, kb, vb, mt, lt, out + r0 * D, rows, bf16, 4);
            else
                tile_block_part(a, q, limit, b * BK, kb, vb, mt, lt, out + r0 * D, rows, bf16, nc);
            for (int r = 0; r < rows; r++) m[r0 + r] = mt[r], l[r0 + r] = lt[r];
        }
    }
    for (int64_t r = 0; r < it->rows; r++) {
        __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        char *dst = (char *)a->o + row_offset(it, r, a->o_st, a->o_sh) * esize;
        for (int64_t d = 0; d < D; d += 16) {
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(out + r * D + d), inv);
            if (bf16)
                _mm256_storeu_si256((__m256i *)(dst + 2 * d), (__m256i)_mm512_cvtneps_pbh(x));
            else
                _mm512_storeu_ps((float *)dst + d, x);
        }
    }
}

/* Runs the step's work items (phase two, after flash_pack); each thread claims items until none are left. */
static void flash_attend(flash_args *a, const void *kp, const void *vp, int bf16) {
    int64_t rows = a->bq * (a->H / a->Hkv) + TILE, cursor = 0;
    float *out = aligned_alloc(64, sizeof(float) * rows * a->D);
    float *m = malloc(sizeof(float) * rows), *l = malloc(sizeof(float) * rows);
    for (;;) {
        int64_t w = __atomic_fetch_add(&a->next_item, 1, __ATOMIC_RELAXED);
        if (w >= a->items) break;
        const flash_segment *s = find(a, w, &cursor, 0);
        item_rows it = item(a, s, w);
        attend_item(a, &it, kp, vp, out, m, l, bf16);
    }
    free(out);
    free(m);
    free(l);
}

/* The whole call on `threads` OpenMP threads (0: the runtime's default, torch's thread count): pack, wait for
 * every thread, attend. */
void flash_run(flash_args *a, void *kp, void *vp, int bf16, int threads) {
    if (threads == 1) { /* no parallel region, as in rms_norm.c */
        flash_pack(a, kp, vp, bf16);
        flash_attend(a, kp, vp, bf16);
        return;
    }
#pragma omp parallel num_threads(threads > 0 ? threads : omp_get_max_threads())
    {
        flash_pack(a, kp, vp, bf16);
#pragma omp barrier
        flash_attend(a, kp, vp, bf16);
    }
}
