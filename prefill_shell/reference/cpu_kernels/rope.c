/* Rotary embedding of a packed step's Q and K heads, and its K/V written into the paged pool, in one pass.
 *
 * Per token t: out[t, h] = x[t, h] * cos[t] + swap(x[t, h]) * sin[t] for every Q and K head h, where swap
 * exchanges the two halves of the head (transformers' half-split rotate_half, its minus folded into the
 * first half of `sin`), each product and the sum rounded to the model dtype as transformers rounds them
 * (bfloat16: three roundings; float32: no fused multiply-add). The rotated K heads and the V heads then go
 * to the pool's slot for t (block slots[t] / bs, offset slots[t] % bs; -1 writes nothing), whose layout is
 * [blocks, Hkv, bs, D].
 *
 * Tokens are claimed `TOKENS` at a time from a shared counter by `threads` OpenMP threads, as in flash.c.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define TOKENS 16

typedef struct {
    const void *qk; /* [T, H + Hkv, D] with token stride qk_st, heads D apart */
    int64_t qk_st;
    const void *v; /* [T, Hkv, D] with token stride v_st, heads D apart */
    int64_t v_st;
    const void *cos, *sin; /* [T, D] contiguous, in the model dtype */
    void *out;             /* [T, H + Hkv, D] contiguous */
    void *pool_k, *pool_v; /* one layer of the pool */
    const int64_t *slots;  /* [T] */
    int64_t bs, T, H, Hkv, D;
    int64_t next;
} rope_args;

static inline __m512 widen(__m256i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)); }
static inline __m512 round_bf16(__m512 x) { return widen((__m256i)_mm512_cvtneps_pbh(x)); }

static void rotate_bf16(const uint16_t *x, const uint16_t *c, const uint16_t *s, uint16_t *out, int64_t D) {
    int64_t half = D / 2;
    for (int64_t d = 0; d < D; d += 16) {
        __m512 xv = widen(_mm256_loadu_si256((const __m256i *)(x + d)));
        __m512 sw = widen(_mm256_loadu_si256((const __m256i *)(x + (d < half ? d + half : d - half))));
        __m512 a = round_bf16(_mm512_mul_ps(xv, widen(_mm256_loadu_si256((const __m256i *)(c + d)))));
        __m512 b = round_bf16(_mm512_mul_ps(sw, widen(_mm256_loadu_si256((const __m256i *)(s + d)))));
        _mm256_storeu_si256((__m256i *)(out + d), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a, b)));
    }
}

static void rotate_f32(const float *x, const float *c, const float *s, float *out, int64_t D) {
    int64_t half = D / 2;
    for (int64_t d = 0; d < D; d += 16) {
        __m512 xv = _mm512_loadu_ps(x + d);
        __m512 sw = _mm512_loadu_ps(x + (d < half ? d + half : d - half));
        __m512 a = _mm512_mul_ps(xv, _mm512_loadu_ps(c + d));
        __m512 b = _mm512_mul_ps(sw, _mm512_loadu_ps(s + d));
        _mm512_storeu_ps(out + d, _mm512_add_ps(a, b));
    }
}

/* Head size a multiple of 32 (two 16-lane halves); esize 2: bfloat16, 4: float32. */
static void claim_tokens(rope_args *a, int esize) {
    int64_t heads = a->H + a->Hkv, D = a->D, row = D * esize;
    for (;;) {
        int64_t first = __atomic_fetch_add(&a->next, 1, __ATOMIC_RELAXED) * TOKENS;
        if (first >= a->T) return;
        int64_t last = first + TOKENS < a->T ? first + TOKENS : a->T;
        for (int64_t t = first; t < last; t++) {
            const char *src = (const char *)a->qk + t * a->qk_st * esize;
            const char *c = (const char *)a->cos + t * row, *s = (const char *)a->sin + t * row;
            char *dst = (char *)a->out + t * heads * row;
            for (int64_t h = 0; h < heads; h++) {
                if (esize == 2)
                    rotate_bf16((const uint16_t *)(src + h * row), (const uint16_t *)c, (const uint16_t *)s,
                                (uint16_t *)(dst + h * row), D);
                else
                    rotate_f32((const float *)(src + h * row), (const float *)c, (const float *)s,
                               (float *)(dst + h * row), D);
            }
            int64_t slot = a->slots[t];
            if (slot < 0 || a->pool_k == NULL) continue;
            int64_t block = slot / a->bs, offset = slot % a->bs;
            const char *values = (const char *)a->v + t * a->v_st * esize;
            for (int64_t h = 0; h < a->Hkv; h++) {
                int64_t at = ((block * a->Hkv + h) * a->bs + offset) * row;
                memcpy((char *)a->pool_k + at, dst + (a->H + h) * row, row);
                memcpy((char *)a->pool_v + at, values + h * row, row);
            }
        }
    }
}

void rope_write(rope_args *a, int esize, int threads) {
    if (threads == 1) { /* no parallel region, as in rms_norm.c */
        claim_tokens(a, esize);
        return;
    }
#pragma omp parallel num_threads(threads > 0 ? threads : omp_get_max_threads())
    claim_tokens(a, esize);
}
