/* A few rows times int8 weights with one scale per output channel, on an x86 CPU with AVX2: the
 * decode-step product of `int8_linear_cpu`. Built on first use by infer.kernels.cpu.native.
 *
 * out[r, i] = (sum_j x[r, j] * w[i, j]) * scale[i], x fp32 [m, k], w int8 [n, k], k % 16 == 0.
 *
 * Why it is shaped this way:
 * - Each row of x is rounded to int16 with its own scale (max |x| / 32767), so that sixteen
 *   weights take one sign-extension and one multiply-add of pairs (vpmaddwd) into int32, where
 *   widening them to floats takes five instructions. That rounding is 2^-15 of the row's largest
 *   entry, finer than the bf16 that ATen's kernel rounds x to.
 * - Four weight rows share each load of x, and the rows PREFETCH_ROWS ahead are prefetched: on
 *   the CI-class VM the hardware prefetcher alone read the weights at half the speed. Into L2
 *   (_MM_HINT_T1), not L1: streamed one row at a time from 2 threads, SmolLM2's shapes read at
 *   20-28 GB/s that way, against 12-17 GB/s with _MM_HINT_T0
 *   (docs/benchmarks/quantization.md#cpu-decisions-what-chose-them).
 * - The int32 sums are folded into floats every CHUNK columns: a lane adds CHUNK / 16 pairs of
 *   products of at most 128 * 32767, 2^31 - 65536 at most, which int32 holds.
 * Threads split the weight's rows, through the OpenMP runtime torch already loaded.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define ROWS 4
#define PREFETCH_ROWS 8
#define CHUNK 4096

/* The sum of v's eight int32 lanes, in floats: each lane may hold up to 2^31, their sum not. */
static inline float sum_lanes(__m256i v) {
    __m256 f = _mm256_cvtepi32_ps(v);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 int8 weights at p times the 16 int16 entries of xv, added in pairs to acc's 8 lanes. */
static inline __m256i dot16(__m256i acc, const int8_t *p, __m256i xv) {
    __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w16, xv));
}

/* Rounds row x [k] to int16 in q; returns the scale, or NAN where x holds a NaN or an infinity. */
static float quantize_row(const float *x, int16_t *q, int64_t k) {
    float largest = 0.f;
    for (int64_t j = 0; j < k; j++) {
        float a = fabsf(x[j]);
        if (!isfinite(a)) return NAN;
        largest = a > largest ? a : largest;
    }
    float scale = largest > 0.f ? largest / 32767.f : 1.f, inverse = 1.f / scale;
    for (int64_t j = 0; j < k; j++) q[j] = (int16_t)lrintf(x[j] * inverse);
    return scale;
}

/* Rows [i, i + ROWS) of w times one quantized row xq, into out[i..]. */
static void four_rows(const int16_t *xq, float x_scale, const int8_t *w, const float *scale,
                      float *out, int64_t i, int64_t n, int64_t k) {
    const int8_t *w0 = w + i * k;
    /* Past the last rows, prefetch this block's own (a prefetch never faults, but the pointer
     * must stay inside the tensor). */
    int64_t ahead = i + ROWS + PREFETCH_ROWS <= n ? PREFETCH_ROWS * k : 0;
    float total[ROWS] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t start = 0; start < k; start += CHUNK) {
        int64_t end = start + CHUNK < k ? start + CHUNK : k;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = start; j < end; j += 16) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + j));
            const int8_t *p = w0 + j;
            _mm_prefetch((const char *)(p + ahead), _MM_HINT_T1);
            _mm_prefetch((const char *)(p + ahead + k), _MM_HINT_T1);
            _mm_prefetch((const char *)(p + ahead + 2 * k), _MM_HINT_T1);
            _mm_prefetch((const char *)(p + ahead + 3 * k), _MM_HINT_T1);
            a0 = dot16(a0, p, xv);
            a1 = dot16(a1, p + k, xv);
            a2 = dot16(a2, p + 2 * k, xv);
            a3 = dot16(a3, p + 3 * k, xv);
        }
        total[0] += sum_lanes(a0);
        total[1] += sum_lanes(a1);
        total[2] += sum_lanes(a2);
        total[3] += sum_lanes(a3);
    }
    for (int r = 0; r < ROWS; r++) out[i + r] = total[r] * x_scale * scale[i + r];
}

static void one_row(const int16_t *xq, float x_scale, const int8_t *w, const float *scale,
                    float *out, int64_t i, int64_t k) {
    float total = 0.f;
    for (int64_t start = 0; start < k; start += CHUNK) {
        int64_t end = start + CHUNK < k ? start + CHUNK : k;
        __m256i acc = _mm256_setzero_si256();
        for (int64_t j = start; j < end; j += 16)
            acc = dot16(acc, w + i * k + j, _mm256_loadu_si256((const __m256i *)(xq + j)));
        total += sum_lanes(acc);
    }
    out[i] = total * x_scale * scale[i];
}

/* Returns 0, or -1 where the rows' int16 copy could not be allocated. */
int int8_gemv(const float *x, const int8_t *w, const float *scale, float *out, int64_t m,
              int64_t n, int64_t k, int threads) {
    int16_t *xq = malloc(sizeof(int16_t) * m * k);
    float *x_scale = malloc(sizeof(float) * m);
    if (xq == NULL || x_scale == NULL) {
        free(xq);
        free(x_scale);
        return -1;
    }
    for (int64_t r = 0; r < m; r++) x_scale[r] = quantize_row(x + r * k, xq + r * k, k);
    int64_t blocks = (n + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t i = b * ROWS;
        for (int64_t r = 0; r < m; r++) {
            float *row_out = out + r * n;
            if (isnan(x_scale[r])) {
                for (int64_t t = i; t < n && t < i + ROWS; t++) row_out[t] = NAN;
            } else if (i + ROWS <= n) {
                four_rows(xq + r * k, x_scale[r], w, scale, row_out, i, n, k);
            } else {
                for (int64_t t = i; t < n; t++) one_row(xq + r * k, x_scale[r], w, scale, row_out, t, k);
            }
        }
    }
    free(xq);
    free(x_scale);
    return 0;
}
