/* A few fp32 rows times a weight stored in GGUF's blocks of 32 (Q4_0, Q4_1, Q8_0), on an x86 CPU
 * with AVX2: the decode-step product of `gguf_linear_cpu`, as llama.cpp computes it. Built on first
 * use by infer.kernels.cpu.native.
 *
 * out[r, i] = sum over blocks b of row i of the weight: dot(w_b, x_b), x fp32 [m, k], k % 32 == 0;
 * the weight [n, k / 32 blocks] is the file's bytes, block after block:
 *   Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles q;  w = (q - 8) d
 *   Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of q;   w = q d + m
 *   Q8_0 (34 bytes): fp16 d, 32 int8 q;                w = q d
 * A nibble byte j holds element j in its low half and element j + 16 in its high half. Or Q8_0
 * repacked at load four rows to a stream (GGUF_Q8_0_X4, the layout gguf_gemv_q8x4.c describes).
 *
 * Why it is shaped this way (llama.cpp's ggml_vec_dot_q4_1_q8_1 and its siblings):
 * - Each block of 32 entries of x is rounded to int8 with its own scale dx = max |x_b| / 127 (fp32
 *   here, fp16 in llama.cpp), and with the sum of its int8 entries, so that a block's dot product is
 *   integer: one vpmaddubsw (unsigned nibbles times signed x, pairs into int16, at most
 *   2 * 15 * 127) and one vpmaddwd against ones (into int32), then one float multiply-add of
 *   dw * dx. Q4_1's offset adds m * dx * sum(qx); Q4_0's -8 subtracts 8 * sum(qx) from the integer
 *   dot, exactly. Q8_0's signed weights take the sign trick: |w| times x carrying w's sign.
 * - One row of x (batch-1 decode) meets four weight rows at a time, each block of x loaded once for
 *   the four and the rows ahead prefetched into L2; a few rows of x each meet a weight block
 *   unpacked once for them all.
 * - On a CPU with AVX-512 VNNI the one-row product takes gguf_gemv_avx512.c's two-blocks-a-step
 *   variant instead (gguf_gemv_variants / gguf_gemv_use_variant); the AVX2 one stays for the rest,
 *   and reads GGUF_Q8_0_X4 under either variant (gguf_gemv_q8x4.c).
 * Threads split the weight's rows, through the OpenMP runtime torch already loaded.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define GGUF_Q4_0 2
#define GGUF_Q4_1 3
#define GGUF_Q8_0 8
#define GGUF_Q8_0_X4 108 /* infer's own: Q8_0 four rows interleaved (gguf_gemv_q8x4.c) */
#define GGUF_BLOCK 32
#define GGUF_MAX_ROWS 8

/* x's blocks rounded to int8: qs [m, k], and per block its scale, its entries' sum, and their
 * product (Q4_1's offset term takes m * d * sum). */
typedef struct {
    int8_t *qs;
    float *d;
    int32_t *sum;
    float *scaled_sum;
} QuantizedRows;

#define GGUF_FOUR 4          /* weight rows a one-row pass reads together, sharing each block of x */
#define GGUF_PREFETCH_ROWS 8  /* rows ahead prefetched into L2, as int8_gemv_cpu.c does */

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
    q->scaled_sum = malloc(sizeof(float) * blocks);
    if (q->qs == NULL || q->d == NULL || q->sum == NULL || q->scaled_sum == NULL) return -1;
    for (int64_t b = 0; b < blocks; b++) {
        const float *xb = x + b * GGUF_BLOCK;
        __m256 v[4], largest = _mm256_setzero_ps(), magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            largest = _mm256_max_ps(largest, _mm256_and_ps(v[j], magnitude));
        }
        __m128 top = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
        top = _mm_max_ps(top, _mm_movehl_ps(top, top));
        top = _mm_max_ss(top, _mm_movehdup_ps(top));
        float d = _mm_cvtss_f32(top) / 127.f, inverse = d > 0.f ? 1.f / d : 0.f;
        __m256i ints[4], sum = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            /* roundf (half away from zero) exactly: the truncation plus one, with the sign, where the
             * dropped fraction (exact in fp32) is at least one half. */
            __m256 scaled = _mm256_mul_ps(v[j], _mm256_set1_ps(inverse));
            __m256 whole = _mm256_round_ps(scaled, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            __m256 half_up = _mm256_cmp_ps(_mm256_and_ps(_mm256_sub_ps(scaled, whole), magnitude), _mm256_set1_ps(0.5f),
                                           _CMP_GE_OQ);
            __m256 one = _mm256_or_ps(_mm256_set1_ps(1.f), _mm256_andnot_ps(magnitude, scaled));
            ints[j] = _mm256_cvttps_epi32(_mm256_add_ps(whole, _mm256_and_ps(half_up, one)));
            sum = _mm256_add_epi32(sum, ints[j]);
        }
        /* int32 to int8 in order: the packs interleave 128-bit lanes, the permute undoes it. */
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]), _mm256_packs_epi32(ints[2], ints[3]));
        packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q->qs + b * GGUF_BLOCK), packed);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
        int32_t total = _mm_cvtsi128_si32(s4);
        q->d[b] = d, q->sum[b] = total, q->scaled_sum[b] = d * (float)total;
    }
    return 0;
}

static void free_rows(QuantizedRows *q) {
    free(q->qs);
    free(q->d);
    free(q->sum);
    free(q->scaled_sum);
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

/* One block of a weight row at p times the int8 block xv of x (scale dx, entries' sum sum): its
 * integer dot into acc as dw * dx * dot; Q4_1's offset m * scaled_sum (dx * sum) into *offset. `type` is a
 * constant where it is inlined, so each format's loop carries its own code only. */
static inline __attribute__((always_inline)) void block_dot(int type, const uint8_t *p, __m256i xv, float dx,
                                                             int32_t sum, float scaled_sum, __m256 *acc,
                                                             float *offset) {
    float dw = half_to_float(p);
    __m256i dot;
    if (type == GGUF_Q8_0) {
        __m256i wq = _mm256_loadu_si256((const __m256i *)(p + 2));
        dot = dot_u8_s8(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xv, wq));
    } else if (type == GGUF_Q4_1) {
        dot = dot_u8_s8(unpack_nibbles(p + 4), xv);
        *offset += half_to_float(p + 2) * scaled_sum;
    } else {
        /* sum (q - 8) x = sum q x - 8 sum x: the -8 taken from lane 0, exactly. */
        dot = _mm256_sub_epi32(dot_u8_s8(unpack_nibbles(p + 2), xv), _mm256_setr_epi32(8 * sum, 0, 0, 0, 0, 0, 0, 0));
    }
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx), _mm256_cvtepi32_ps(dot), *acc);
}

/* Weight rows [i, i + GGUF_FOUR) times one row of x, into out[i..]: four independent sums, each block
 * of x loaded once for the four, and the rows GGUF_PREFETCH_ROWS ahead prefetched (n_rows: the weight's,
 * so that a prefetch stays inside it). */
static inline __attribute__((always_inline)) void gguf_four_rows(int type, int64_t stride, const uint8_t *w,
                                                            int64_t row_bytes, int64_t blocks, const QuantizedRows *q,
                                                            float *out, int64_t i, int64_t n_rows) {
    const uint8_t *w0 = w + i * row_bytes;
    int64_t ahead = i + GGUF_FOUR + GGUF_PREFETCH_ROWS <= n_rows ? GGUF_PREFETCH_ROWS * row_bytes : 0;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    float o0 = 0.f, o1 = 0.f, o2 = 0.f, o3 = 0.f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = w0 + b * stride;
        /* Every block: rows do not start on a line, so "once a line" by the offset in the row
         * skipped lines, and a miss costs more than the repeated hints. */
        for (int r = 0; r < GGUF_FOUR; r++) _mm_prefetch((const char *)(p + ahead + r * row_bytes), _MM_HINT_T1);
        __m256i xv = _mm256_loadu_si256((const __m256i *)(q->qs + b * GGUF_BLOCK));
        float dx = q->d[b];
        int32_t sum = q->sum[b];
        float scaled = q->scaled_sum[b];
        block_dot(type, p, xv, dx, sum, scaled, &a0, &o0);
        block_dot(type, p + row_bytes, xv, dx, sum, scaled, &a1, &o1);
        block_dot(type, p + 2 * row_bytes, xv, dx, sum, scaled, &a2, &o2);
        block_dot(type, p + 3 * row_bytes, xv, dx, sum, scaled, &a3, &o3);
    }
    out[i] = hsum_ps(a0) + o0, out[i + 1] = hsum_ps(a1) + o1;
    out[i + 2] = hsum_ps(a2) + o2, out[i + 3] = hsum_ps(a3) + o3;
}

/* out [n] = one row of x (q) times the weight's rows, GGUF_FOUR at a time, the last few one by one. */
static void one_x_row(int type, const uint8_t *w, int64_t row_bytes, int64_t blocks, const QuantizedRows *q,
                      float *out, int64_t n, int threads) {
    int64_t stride = type == GGUF_Q8_0 ? 34 : type == GGUF_Q4_1 ? 20 : 18, groups = n / GGUF_FOUR;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        if (type == GGUF_Q4_1) gguf_four_rows(GGUF_Q4_1, 20, w, row_bytes, blocks, q, out, g * GGUF_FOUR, n);
        else if (type == GGUF_Q8_0) gguf_four_rows(GGUF_Q8_0, 34, w, row_bytes, blocks, q, out, g * GGUF_FOUR, n);
        else gguf_four_rows(GGUF_Q4_0, 18, w, row_bytes, blocks, q, out, g * GGUF_FOUR, n);
    }
    for (int64_t i = groups * GGUF_FOUR; i < n; i++) {
        __m256 acc = _mm256_setzero_ps();
        float offset = 0.f;
        for (int64_t b = 0; b < blocks; b++)
            block_dot(type, w + i * row_bytes + b * stride, _mm256_loadu_si256((const __m256i *)(q->qs + b * GGUF_BLOCK)),
                      q->d[b], q->sum[b], q->scaled_sum[b], &acc, &offset);
        out[i] = hsum_ps(acc) + offset;
    }
}

#include "gguf_gemv_q8x4.c"

#include "gguf_gemv_avx512.c"

/* The one-row kernels, by what they need of the CPU (bits of gguf_gemv_variants). */
#define GGUF_VARIANT_AVX2 0
#define GGUF_VARIANT_AVX512_VNNI 1

static int gguf_cpu_has_avx512_vnni(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
}

/* A bit a variant this CPU runs: 1 << GGUF_VARIANT_AVX2 always (the library needs AVX2 to load). */
int gguf_gemv_variants(void) {
    return 1 << GGUF_VARIANT_AVX2 | (gguf_cpu_has_avx512_vnni() ? 1 << GGUF_VARIANT_AVX512_VNNI : 0);
}

/* The variant gguf_gemv's one-row product takes: the best the CPU runs until gguf_gemv_use_variant
 * picks one (the tests run each). */
static int gguf_variant = -1;

/* Picks `variant` (GGUF_VARIANT_*), or the best one the CPU runs for -1. Returns 0, or -1 for a
 * variant this CPU does not run. */
int gguf_gemv_use_variant(int variant) {
    if (variant == -1) variant = gguf_cpu_has_avx512_vnni() ? GGUF_VARIANT_AVX512_VNNI : GGUF_VARIANT_AVX2;
    if (variant < 0 || !(gguf_gemv_variants() >> variant & 1)) return -1;
    gguf_variant = variant;
    return 0;
}

/* One weight row (its `blocks` blocks at w) times every row of q, into out[r * n]: each weight
 * block unpacked once a row of x, read from L1 for the others. */
static inline __attribute__((always_inline)) void row_times_rows(int type, int64_t stride, const uint8_t *w,
                                                                 int64_t blocks, const QuantizedRows *q,
                                                                 int64_t m, float *out, int64_t n) {
    __m256 acc[GGUF_MAX_ROWS];
    float offset[GGUF_MAX_ROWS];
    for (int64_t r = 0; r < m; r++) acc[r] = _mm256_setzero_ps(), offset[r] = 0.f;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t r = 0; r < m; r++) {
            int64_t xb = r * blocks + b;
            block_dot(type, w + b * stride, _mm256_loadu_si256((const __m256i *)(q->qs + xb * GGUF_BLOCK)), q->d[xb],
                      q->sum[xb], q->scaled_sum[xb], &acc[r], &offset[r]);
        }
    for (int64_t r = 0; r < m; r++) out[r * n] = hsum_ps(acc[r]) + offset[r];
}

static void row_times_x(int type, const uint8_t *w, int64_t blocks, const QuantizedRows *q, int64_t m, float *out,
                        int64_t n) {
    if (type == GGUF_Q4_1) row_times_rows(GGUF_Q4_1, 20, w, blocks, q, m, out, n);
    else if (type == GGUF_Q8_0) row_times_rows(GGUF_Q8_0, 34, w, blocks, q, m, out, n);
    else row_times_rows(GGUF_Q4_0, 18, w, blocks, q, m, out, n);
}

/* Rows [first, first + rows) of q, as a QuantizedRows of their own. */
static QuantizedRows rows_from(const QuantizedRows *q, int64_t first, int64_t k, int64_t blocks) {
    QuantizedRows part = {q->qs + first * k, q->d + first * blocks, q->sum + first * blocks,
                          q->scaled_sum + first * blocks};
    return part;
}

/* out [m, n] = x (q, m rows) times the weight: each weight row (each group of four, for
 * GGUF_Q8_0_X4) a task, which takes x GGUF_MAX_ROWS rows at a time, its blocks unpacked once for
 * them. One parallel region and one pass over the weight for any m: a prompt's rows in chunks
 * each a region would cost a fork and a join a chunk, and under a busy CPU each waits for both
 * threads to be scheduled. */
static void many_x_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t blocks, int64_t k,
                        const QuantizedRows *q, int64_t m, float *out, int64_t n, int threads) {
    int64_t groups = type == GGUF_Q8_0_X4 ? n / GGUF_FOUR : 0, tasks = groups + (n - groups * GGUF_FOUR);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        for (int64_t first = 0; first < m; first += GGUF_MAX_ROWS) {
            int64_t rows = m - first < GGUF_MAX_ROWS ? m - first : GGUF_MAX_ROWS;
            QuantizedRows part = rows_from(q, first, k, blocks);
            if (t < groups) {
                group_times_rows(w + t * GGUF_FOUR * row_bytes, blocks, &part, rows, out + first * n + t * GGUF_FOUR, n);
            } else {
                int64_t i = groups * GGUF_FOUR + (t - groups); /* X4: the rows past the last group are Q8_0 */
                row_times_x(type == GGUF_Q8_0_X4 ? GGUF_Q8_0 : type, w + i * row_bytes, blocks, &part, rows,
                            out + first * n + i, n);
            }
        }
    }
}

/* Bytes of one row of a weight of `type` with k columns; 0 for a type this file does not take. */
static int64_t gguf_row_bytes(int type, int64_t k) {
    int64_t blocks = k / GGUF_BLOCK;
    switch (type) {
    case GGUF_Q4_0: return blocks * 18;
    case GGUF_Q4_1: return blocks * 20;
    case GGUF_Q8_0:
    case GGUF_Q8_0_X4: return blocks * 34;
    default: return 0;
    }
}

/* out [m, n] = x [m, k] @ W.T for W [n, k] in blocks of `type`, k % 32 == 0. Returns 0, -1 where
 * x's int8 copy could not be allocated, -2 for a type or a k it does not take. */
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
    if (m == 1) {
        if (gguf_variant < 0) gguf_gemv_use_variant(-1);
        int status = 0;
        /* GGUF_Q8_0_X4 takes its AVX2 pass under either variant: an AVX-512 one is not written yet. */
        if (type == GGUF_Q8_0_X4) one_x_row_q8x4(w, row_bytes, blocks, &q, out, n, threads);
        else if (gguf_variant == GGUF_VARIANT_AVX512_VNNI) status = one_x_row_avx512(type, w, row_bytes, blocks, &q, out, n, threads);
        else one_x_row(type, w, row_bytes, blocks, &q, out, n, threads);
        free_rows(&q);
        return status;
    }
    many_x_rows(type, w, row_bytes, blocks, k, &q, m, out, n, threads);
    free_rows(&q);
    return 0;
}
