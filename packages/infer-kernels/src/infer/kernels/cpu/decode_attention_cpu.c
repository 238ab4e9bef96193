/* Decode rows' attention over the paged KV cache, fp32, on an x86 CPU with AVX2 and FMA: the
 * decode path of `paged_attention_cpu`. Built on first use by infer.kernels.cpu.native.
 *
 * For each decode row b and query head h (its KV head h / (num_q_heads / num_kv_heads)):
 *   out[b, h] = softmax(scale * q[b, h] . K[t], t in [first, seq_len)) @ V[t]
 * with K[t], V[t] read through row b's block table, first = seq_len - sliding_window (or 0).
 *
 * One call does what the PyTorch path does in a dozen ops a row (slot arithmetic, views, SDPA,
 * a copy out), which on a CPU cost more than the arithmetic. Threads take (row, query head)
 * pairs; the heads of one KV head's group read its keys from the cache the first one filled.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_HEAD_DIM 512

/* e^x for x <= 0, the Cephes polynomial after range reduction (within 2 ulp of expf). */
static inline __m256 exp_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(two_n));
}

static inline float sum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float dot(const float *a, const float *b, int64_t d) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return sum_ps(acc);
}

/* Returns 0, or -1 where a scores buffer could not be allocated. head_dim % 8 == 0, <= MAX_HEAD_DIM. */
int decode_attention(const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache,
                     const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens,
                     float *out, int64_t out_row_stride, int64_t rows, int64_t num_q_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t sliding_window,
                     float scale, int threads) {
    int64_t group = num_q_heads / num_kv_heads, slot_stride = num_kv_heads * head_dim;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : failed)
    for (int64_t task = 0; task < rows * num_q_heads; task++) {
        int64_t b = task / num_q_heads, h = task % num_q_heads, kv_head = h / group;
        int64_t seq_len = seq_lens[b];
        int64_t first = sliding_window > 0 && seq_len > sliding_window ? seq_len - sliding_window : 0;
        int64_t n = seq_len - first;
        const float *qh = q + b * q_row_stride + h * head_dim;
        const int32_t *table = block_tables + b * block_table_stride;
        float *oh = out + b * out_row_stride + h * head_dim;
        float *scores = malloc(sizeof(float) * (n > 0 ? n : 1));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        const float *keys = k_cache + kv_head * head_dim, *values = v_cache + kv_head * head_dim;
        float largest = -INFINITY;
        int nan = 0;
        /* The key slots, block by block (a division a token would cost more than the dot); four
         * keys at a time, so that four chains of multiply-adds run side by side. */
        int64_t block = first / block_size, offset = first % block_size, t = 0;
        const float *key[4];
        for (; t < n; t++) {
            key[t % 4] = keys + ((int64_t)table[block] * block_size + offset) * slot_stride;
            if (++offset == block_size) offset = 0, block++;
            if (t % 4 != 3) continue;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t i = 0; i < head_dim; i += 8) {
                __m256 x = _mm256_loadu_ps(qh + i);
                a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(key[0] + i), a0);
                a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(key[1] + i), a1);
                a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(key[2] + i), a2);
                a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(key[3] + i), a3);
            }
            scores[t - 3] = sum_ps(a0) * scale;
            scores[t - 2] = sum_ps(a1) * scale;
            scores[t - 1] = sum_ps(a2) * scale;
            scores[t] = sum_ps(a3) * scale;
        }
        for (int64_t u = n - n % 4; u < n; u++) scores[u] = dot(qh, key[u % 4], head_dim) * scale;
        for (int64_t u = 0; u < n; u++) {
            nan |= scores[u] != scores[u];
            largest = scores[u] > largest ? scores[u] : largest;
        }
        __m256 total = _mm256_setzero_ps();
        for (t = 0; t + 8 <= n; t += 8) {
            __m256 p = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(scores + t), _mm256_set1_ps(largest)));
            _mm256_storeu_ps(scores + t, p);
            total = _mm256_add_ps(total, p);
        }
        float sum = sum_ps(total);
        for (; t < n; t++) {
            scores[t] = expf(scores[t] - largest);
            sum += scores[t];
        }
        /* The weighted values, 64 of a head's dims at a time in eight registers. */
        float acc[MAX_HEAD_DIM] __attribute__((aligned(32)));
        for (int64_t d = 0; d < head_dim; d += 64) {
            int64_t width = head_dim - d < 64 ? head_dim - d : 64;
            __m256 v[8];
            for (int r = 0; r < 8; r++) v[r] = _mm256_setzero_ps();
            block = first / block_size, offset = first % block_size;
            for (int64_t u = 0; u < n; u++) {
                const float *row = values + ((int64_t)table[block] * block_size + offset) * slot_stride + d;
                __m256 p = _mm256_set1_ps(scores[u]);
                for (int r = 0; r < 8; r++)
                    if (r * 8 < width) v[r] = _mm256_fmadd_ps(p, _mm256_loadu_ps(row + r * 8), v[r]);
                if (++offset == block_size) offset = 0, block++;
            }
            for (int r = 0; r * 8 < width; r++) _mm256_store_ps(acc + d + r * 8, v[r]);
        }
        __m256 inverse = _mm256_set1_ps(nan || n == 0 ? NAN : 1.0f / sum);
        for (int64_t i = 0; i < head_dim; i += 8) _mm256_storeu_ps(oh + i, _mm256_mul_ps(_mm256_load_ps(acc + i), inverse));
        free(scores);
    }
    return failed ? -1 : 0;
}
