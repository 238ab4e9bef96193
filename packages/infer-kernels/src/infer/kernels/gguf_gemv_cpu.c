/* A few fp32 rows times a weight stored in GGUF's blocks of 32 (Q4_0, Q4_1, Q8_0), on an x86 CPU
 * with AVX2: the decode-step product of `gguf_linear_cpu`, as llama.cpp computes it. Built on first
 * use by infer.kernels.native_cpu.
 *
 * out[r, i] = sum over blocks b of row i of the weight: dot(w_b, x_b), x fp32 [m, k], k % 32 == 0;
 * the weight [n, k / 32 blocks] is the file's bytes, block after block:
 *   Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles q;  w = (q - 8) d
 *   Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of q;   w = q d + m
 *   Q8_0 (34 bytes): fp16 d, 32 int8 q;                w = q d
 * A nibble byte j holds element j in its low half and element j + 16 in its high half.
 *
 * Why it is shaped this way (llama.cpp's ggml_vec_dot_q4_1_q8_1 and its siblings):
 * - Each block of 32 entries of x is rounded to int8 with its own scale dx = max |x_b| / 127 (fp32
 *   here, fp16 in llama.cpp), and with the sum of its int8 entries, so that a block's dot product is
 *   integer: one vpmaddubsw (unsigned nibbles times signed x, pairs into int16, at most
 *   2 * 15 * 127) and one vpmaddwd against ones (into int32), then one float multiply-add of
 *   dw * dx. Q4_1's offset adds m * dx * sum(qx); Q4_0's -8 subtracts 8 * sum(qx) from the integer
 *   dot, exactly. Q8_0's signed weights take the sign trick: |w| times x carrying w's sign.
 * - A weight block is unpacked once and used for every row of x (decode steps have a few).
 * Threads split the weight's rows, through the OpenMP runtime torch already loaded.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define GGUF_Q4_0 2
#define GGUF_Q4_1 3
#define GGUF_Q8_0 8
#define GGUF_BLOCK 32
#define GGUF_MAX_ROWS 8

/* x's blocks rounded to int8: qs [m, k], and per block its scale and its entries' sum. */
typedef struct {
    int8_t *qs;
    float *d;
    int32_t *sum;
} QuantizedRows;

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    __builtin_memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Rounds x [m, k] block by block (round half away from zero, as llama.cpp's roundf); a block of
 * zeros has scale 0. Returns 0, or -1 where the buffers could not be allocated. */
static int quantize_rows_q8(const float *x, int64_t m, int64_t k, QuantizedRows *q) {
    int64_t blocks = m * (k / GGUF_BLOCK);
    q->qs = malloc(m * k);
    q->d = malloc(sizeof(float) * blocks);
    q->sum = malloc(sizeof(int32_t) * blocks);
    if (q->qs == NULL || q->d == NULL || q->sum == NULL) return -1;
    for (int64_t b = 0; b < blocks; b++) {
        const float *xb = x + b * GGUF_BLOCK;
        float largest = 0.f;
        for (int j = 0; j < GGUF_BLOCK; j++) largest = fmaxf(largest, fabsf(xb[j]));
        float d = largest / 127.f, inverse = d > 0.f ? 1.f / d : 0.f;
        int32_t sum = 0;
        for (int j = 0; j < GGUF_BLOCK; j++) {
            int8_t v = (int8_t)roundf(xb[j] * inverse);
            q->qs[b * GGUF_BLOCK + j] = v;
            sum += v;
        }
        q->d[b] = d, q->sum[b] = sum;
    }
    return 0;
}

static void free_rows(QuantizedRows *q) {
    free(q->qs);
    free(q->d);
    free(q->sum);
}

/* The 32 nibbles of a block as bytes 0..15, in element order. */
static inline __m256i unpack_nibbles(const uint8_t *qs) {
    __m128i packed = _mm_loadu_si128((const __m128i *)qs);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* The 8 int32 partial sums of 32 products of unsigned bytes u and signed bytes s. */
static inline __m256i dot_u8_s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* One weight row (its `blocks` blocks at w) times every row of q, into out[r * n]. */
static void row_times_x(int type, const uint8_t *w, int64_t blocks, const QuantizedRows *q, int64_t m,
                        float *out, int64_t n) {
    __m256 acc[GGUF_MAX_ROWS];
    float offset[GGUF_MAX_ROWS];
    for (int64_t r = 0; r < m; r++) acc[r] = _mm256_setzero_ps(), offset[r] = 0.f;
    if (type == GGUF_Q8_0) {
        for (int64_t b = 0; b < blocks; b++, w += 34) {
            float dw = half_to_float(w);
            __m256i wq = _mm256_loadu_si256((const __m256i *)(w + 2)), magnitude = _mm256_sign_epi8(wq, wq);
            for (int64_t r = 0; r < m; r++) {
                int64_t xb = r * blocks + b;
                __m256i xq = _mm256_loadu_si256((const __m256i *)(q->qs + xb * GGUF_BLOCK));
                __m256 dot = _mm256_cvtepi32_ps(dot_u8_s8(magnitude, _mm256_sign_epi8(xq, wq)));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * q->d[xb]), dot, acc[r]);
            }
        }
    } else {
        int64_t stride = type == GGUF_Q4_1 ? 20 : 18, nibbles = type == GGUF_Q4_1 ? 4 : 2;
        for (int64_t b = 0; b < blocks; b++, w += stride) {
            float dw = half_to_float(w), mw = type == GGUF_Q4_1 ? half_to_float(w + 2) : 0.f;
            __m256i wq = unpack_nibbles(w + nibbles);
            for (int64_t r = 0; r < m; r++) {
                int64_t xb = r * blocks + b;
                __m256i xq = _mm256_loadu_si256((const __m256i *)(q->qs + xb * GGUF_BLOCK));
                __m256i dot = dot_u8_s8(wq, xq);
                float dx = q->d[xb];
                if (type == GGUF_Q4_0) {
                    /* sum (q - 8) x = sum q x - 8 sum x: the -8 taken from lane 0, exactly. */
                    dot = _mm256_sub_epi32(dot, _mm256_setr_epi32(8 * q->sum[xb], 0, 0, 0, 0, 0, 0, 0));
                } else {
                    offset[r] += mw * dx * (float)q->sum[xb];
                }
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx), _mm256_cvtepi32_ps(dot), acc[r]);
            }
        }
    }
    for (int64_t r = 0; r < m; r++) out[r * n] = hsum_ps(acc[r]) + offset[r];
}

/* Bytes of one row of a weight of `type` with k columns; 0 for a type this file does not take. */
static int64_t gguf_row_bytes(int type, int64_t k) {
    int64_t blocks = k / GGUF_BLOCK;
    switch (type) {
    case GGUF_Q4_0: return blocks * 18;
    case GGUF_Q4_1: return blocks * 20;
    case GGUF_Q8_0: return blocks * 34;
    default: return 0;
    }
}

/* out [m, n] = x [m, k] @ W.T for W [n, k] in blocks of `type`, k % 32 == 0; GGUF_MAX_ROWS rows of
 * x a pass over the weight. Returns 0, -1 where x's int8 copy could not be allocated, -2 for a type
 * or a k it does not take. */
int gguf_gemv(int type, const float *x, const uint8_t *w, float *out, int64_t m, int64_t n, int64_t k,
              int threads) {
    int64_t row_bytes = gguf_row_bytes(type, k);
    if (row_bytes == 0 || k % GGUF_BLOCK) return -2;
    QuantizedRows q;
    if (quantize_rows_q8(x, m, k, &q) != 0) {
        free_rows(&q);
        return -1;
    }
    int64_t blocks = k / GGUF_BLOCK;
    for (int64_t first = 0; first < m; first += GGUF_MAX_ROWS) {
        int64_t rows = m - first < GGUF_MAX_ROWS ? m - first : GGUF_MAX_ROWS;
        QuantizedRows part = {q.qs + first * k, q.d + first * blocks, q.sum + first * blocks};
        float *part_out = out + first * n;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < n; i++)
            row_times_x(type, w + i * row_bytes, blocks, &part, rows, part_out + i, n);
    }
    free_rows(&q);
    return 0;
}
