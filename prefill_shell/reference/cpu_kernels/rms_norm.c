/* RMSNorm of bfloat16 rows in one pass, rounded where transformers rounds (AVX512-BF16).
 *
 * transformers' LlamaRMSNorm at bfloat16: x in float32, x * rsqrt(mean(x^2) + eps), rounded to bfloat16,
 * then times the bfloat16 weight (a bfloat16 product: float32 multiply, rounded). torch runs that as six
 * passes over the rows; this reads each row once and writes it once. The mean sums in another order than
 * torch's reduction, so a row's scale can differ in its last float32 bit.
 *
 * Rows are claimed `ROWS` at a time from a shared counter by `threads` OpenMP threads (torch's), so the
 * thread count changes no bit.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define ROWS 32

typedef struct {
    const uint16_t *x;
    int64_t x_stride; /* elements between rows */
    const uint16_t *weight;
    uint16_t *out; /* contiguous [rows, cols] */
    int64_t rows, cols;
    float eps;
    int64_t next; /* shared counter: the next unclaimed chunk of rows */
} norm_args;

static inline __m512 load_bf16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u); }

static void claim_rows(norm_args *a) {
    for (;;) {
        int64_t first = __atomic_fetch_add(&a->next, 1, __ATOMIC_RELAXED) * ROWS;
        if (first >= a->rows) return;
        int64_t last = first + ROWS < a->rows ? first + ROWS : a->rows;
        for (int64_t r = first; r < last; r++) {
            const uint16_t *x = a->x + r * a->x_stride;
            uint16_t *out = a->out + r * a->cols;
            __m512 squares = _mm512_setzero_ps();
            for (int64_t c = 0; c < a->cols; c += 16) {
                __m512 v = load_bf16(x + c, lanes(a->cols - c));
                squares = _mm512_fmadd_ps(v, v, squares);
            }
            float scale = 1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)a->cols + a->eps);
            __m512 s = _mm512_set1_ps(scale);
            for (int64_t c = 0; c < a->cols; c += 16) {
                __mmask16 m = lanes(a->cols - c);
                __m256bh normed = _mm512_cvtneps_pbh(_mm512_mul_ps(load_bf16(x + c, m), s));
                __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)normed), 16));
                __m256bh scaled = _mm512_cvtneps_pbh(_mm512_mul_ps(back, load_bf16(a->weight + c, m)));
                _mm256_mask_storeu_epi16(out + c, m, (__m256i)scaled);
            }
        }
    }
}

void rms_norm_bf16(norm_args *a, int threads) {
    if (threads == 1) { /* no parallel region: a team of one would make libgomp re-form torch's next team */
        claim_rows(a);
        return;
    }
#pragma omp parallel num_threads(threads > 0 ? threads : omp_get_max_threads())
    claim_rows(a);
}
