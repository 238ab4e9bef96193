/* A few rows times bf16 weights, on an x86 CPU with AVX2: the decode-step product of
 * `bf16_linear_cpu` and of the C decoder stack's bf16 Linears. Built on first use by
 * infer.kernels.cpu.native.
 *
 * out[r, i] = sum_j x[r, j] * w[i, j], x fp32 [m, k], w bf16 [n, k] (raw 16-bit words), in fp32.
 *
 * Why it is shaped this way: a decode step reads every weight once, so it is bound by the bytes
 * it reads, and bf16 is half of fp32's. A bf16 number is the top half of the fp32 one, so eight
 * weights widen to fp32 exactly in two instructions (zero-extend the 16-bit words to 32 bits,
 * shift left by 16), then one fp32 multiply-add; the products and sums are fp32's, as the fp32
 * path's. Four weight rows share each load of x, and the rows PREFETCH_ROWS ahead are prefetched
 * into L2 a line at a time, as decoder_stack_cpu.c's fp32 product does. Threads split the
 * weight's rows, through the OpenMP runtime torch already loaded.
 */
#include <immintrin.h>
#include <stdint.h>

#define BF16_PREFETCH_ROWS 8

static inline float bf16_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Eight bf16 words at p as eight floats, exactly. */
static inline __m256 bf16_load8(const uint16_t *p) {
    __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
}

static inline float bf16_to_float(uint16_t word) {
    union {
        uint32_t bits;
        float value;
    } u = {(uint32_t)word << 16};
    return u.value;
}

/* Rows [i, i + 4) of w times the m rows of x into out [m, n]. */
static void bf16_four_rows(const float *x, int64_t m, const uint16_t *w, float *out, int64_t i, int64_t n,
                           int64_t k) {
    const uint16_t *w0 = w + i * k;
    int64_t ahead = i + 4 + BF16_PREFETCH_ROWS <= n ? BF16_PREFETCH_ROWS * k : 0;
    int64_t vector_k = k & ~(int64_t)7;
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * k;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < vector_k; j += 8) {
            const uint16_t *p = w0 + j;
            if (r == 0 && (j & 31) == 0) { /* a 64-byte line holds 32 bf16 */
                _mm_prefetch((const char *)(p + ahead), _MM_HINT_T1);
                _mm_prefetch((const char *)(p + ahead + k), _MM_HINT_T1);
                _mm_prefetch((const char *)(p + ahead + 2 * k), _MM_HINT_T1);
                _mm_prefetch((const char *)(p + ahead + 3 * k), _MM_HINT_T1);
            }
            __m256 xv = _mm256_loadu_ps(xr + j);
            a0 = _mm256_fmadd_ps(xv, bf16_load8(p), a0);
            a1 = _mm256_fmadd_ps(xv, bf16_load8(p + k), a1);
            a2 = _mm256_fmadd_ps(xv, bf16_load8(p + 2 * k), a2);
            a3 = _mm256_fmadd_ps(xv, bf16_load8(p + 3 * k), a3);
        }
        float s0 = bf16_hsum(a0), s1 = bf16_hsum(a1), s2 = bf16_hsum(a2), s3 = bf16_hsum(a3);
        for (int64_t j = vector_k; j < k; j++) {
            s0 += xr[j] * bf16_to_float(w0[j]);
            s1 += xr[j] * bf16_to_float(w0[k + j]);
            s2 += xr[j] * bf16_to_float(w0[2 * k + j]);
            s3 += xr[j] * bf16_to_float(w0[3 * k + j]);
        }
        float *o = out + r * n + i;
        o[0] = s0, o[1] = s1, o[2] = s2, o[3] = s3;
    }
}

/* One row i of w times the m rows of x (the last n % 4 rows). */
static void bf16_one_row(const float *x, int64_t m, const uint16_t *w, float *out, int64_t i, int64_t n,
                         int64_t k) {
    const uint16_t *wi = w + i * k;
    int64_t vector_k = k & ~(int64_t)7;
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * k;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < vector_k; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(xr + j), bf16_load8(wi + j), acc);
        float s = bf16_hsum(acc);
        for (int64_t j = vector_k; j < k; j++) s += xr[j] * bf16_to_float(wi[j]);
        out[r * n + i] = s;
    }
}

/* out [m, n] = x [m, k] @ w.T, w bf16 [n, k]; returns 0. */
int bf16_gemv(const float *x, const uint16_t *w, float *out, int64_t m, int64_t n, int64_t k, int threads) {
    int64_t blocks = n / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) bf16_four_rows(x, m, w, out, b * 4, n, k);
    for (int64_t i = blocks * 4; i < n; i++) bf16_one_row(x, m, w, out, i, n, k);
    return 0;
}
