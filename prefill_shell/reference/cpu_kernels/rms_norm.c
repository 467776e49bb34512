/* RMSNorm of float32 or bfloat16 rows in one pass, rounded where transformers rounds (AVX-512; AVX512-BF16 for
 * bfloat16).
 *
 * transformers' LlamaRMSNorm: x in float32, x * rsqrt(mean(x^2) + eps), rounded to the model dtype, then times
 * the weight in the model dtype (float32: a second float32 product; bfloat16: a float32 multiply, rounded).
 * torch runs that as five or six passes over the rows; this reads each row once and writes it once. The mean
 * sums in another order than torch's reduction, so a row's scale can differ in its last float32 bit.
 *
 * Rows are claimed `ROWS` at a time from a shared counter by `threads` OpenMP threads (torch's), so the
 * thread count changes no bit.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "vector_math.h"

#define ROWS 32

typedef struct {
    const void *x;
    int64_t x_stride; /* elements between rows */
    const void *weight;
    void *out; /* contiguous [rows, cols] */
    int64_t rows, cols;
    float eps;
    int64_t next; /* shared counter: the next unclaimed chunk of rows */
} norm_args;

static inline __m512 load_row(const void *p, int64_t c, __mmask16 m, int bf16) {
    if (bf16) return widen_bf16(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + c));
    return _mm512_maskz_loadu_ps(m, (const float *)p + c);
}

static void norm_row(const norm_args *a, int64_t r, int bf16) {
    int64_t esize = bf16 ? 2 : 4;
    const char *x = (const char *)a->x + r * a->x_stride * esize;
    char *out = (char *)a->out + r * a->cols * esize;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t c = 0; c < a->cols; c += 16) {
        __m512 v = load_row(x, c, first_lanes(a->cols - c), bf16);
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    __m512 s = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)a->cols + a->eps));
    for (int64_t c = 0; c < a->cols; c += 16) {
        __mmask16 m = first_lanes(a->cols - c);
        __m512 normed = _mm512_mul_ps(load_row(x, c, m, bf16), s), w = load_row(a->weight, c, m, bf16);
        if (bf16) {
            __m512 back = widen_bf16((__m256i)_mm512_cvtneps_pbh(normed));
            _mm256_mask_storeu_epi16((uint16_t *)out + c, m, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(back, w)));
        } else {
            _mm512_mask_storeu_ps((float *)out + c, m, _mm512_mul_ps(normed, w));
        }
    }
}

static void claim_rows(norm_args *a, int bf16) {
    for (;;) {
        int64_t first = __atomic_fetch_add(&a->next, 1, __ATOMIC_RELAXED) * ROWS;
        if (first >= a->rows) return;
        int64_t last = first + ROWS < a->rows ? first + ROWS : a->rows;
        for (int64_t r = first; r < last; r++) norm_row(a, r, bf16);
    }
}

/* bf16: 1 for bfloat16 rows and weight, 0 for float32. */
void rms_norm_rows(norm_args *a, int bf16, int threads) {
    if (threads == 1) { /* no parallel region: a team of one would make libgomp re-form torch's next team */
        claim_rows(a, bf16);
        return;
    }
#pragma omp parallel num_threads(threads > 0 ? threads : omp_get_max_threads())
    claim_rows(a, bf16);
}
