/* gguf_gemv_cpu.c's one-row product (batch-1 decode) with AVX-512 VNNI, included by it and chosen at
 * run time where the CPU reports avx512f/bw/vl/dq and avx512_vnni (gguf_gemv_use_variant).
 *
 * Two blocks a step in one 512-bit register: one vpdpbusd (unsigned weight bytes times signed x,
 * four products into each int32) where AVX2 takes vpmaddubsw + vpmaddwd a block, so a block pair
 * costs about half the AVX2 instructions:
 * - Q4_0 / Q4_1: the two blocks' 16 nibble bytes load as [a, b] and shift into [a, b, a >> 4,
 *   b >> 4]; x is laid out in that order once a call (x_pairs_q4), so no shuffle is needed.
 * - Q8_0: |w| times x carrying w's sign, as AVX2 does. (Offsetting w by 128 into unsigned bytes
 *   and taking 128 * sum(x) off was one op less, but that offset swells each lane before its fp32
 *   scaling, and the rounding of those large lanes did not cancel: x read back through a Q8_0
 *   identity was off by 2^-10.)
 * An odd last block of a row goes through AVX2's block_dot. */

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

/* int32 lanes that hold the second block of a pair: Q8_0's blocks are whole halves; Q4's permuted
 * layout puts block b's bytes 0-15 and 16-31 in lanes 0-3 and 8-11, block b + 1's in 4-7, 12-15. */
#define GGUF_SECOND_Q8 0xFF00
#define GGUF_SECOND_Q4 0xF0F0

/* x's int8 blocks, each pair reordered as the Q4 weights unpack: [x_b 0-15, x_b+1 0-15, x_b 16-31,
 * x_b+1 16-31]; an odd last block stays as it is. */
static void x_pairs_q4(const int8_t *qs, int64_t blocks, int8_t *pairs) {
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        const int8_t *x0 = qs + b * GGUF_BLOCK, *x1 = x0 + GGUF_BLOCK;
        int8_t *out = pairs + b * GGUF_BLOCK;
        __builtin_memcpy(out, x0, 16), __builtin_memcpy(out + 16, x1, 16);
        __builtin_memcpy(out + 32, x0 + 16, 16), __builtin_memcpy(out + 48, x1 + 16, 16);
    }
    if (b < blocks) __builtin_memcpy(pairs + b * GGUF_BLOCK, qs + b * GGUF_BLOCK, GGUF_BLOCK);
}

/* Blocks b and b + 1 of a weight row at p (stride bytes a block) as 64 bytes in the order of x's
 * pair: Q4's nibbles unpacked (unsigned), Q8_0's quants as stored (signed). */
static inline __attribute__((always_inline)) __m512i pair_u8(int type, const uint8_t *p, int64_t stride) {
    if (type == GGUF_Q8_0) {
        __m256i lo = _mm256_loadu_si256((const __m256i *)(p + 2));
        __m256i hi = _mm256_loadu_si256((const __m256i *)(p + stride + 2));
        return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    int64_t q = type == GGUF_Q4_1 ? 4 : 2;
    __m256i ab = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p + q))),
                                         _mm_loadu_si128((const __m128i *)(p + stride + q)), 1);
    __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(ab), _mm256_srli_epi16(ab, 4), 1);
    return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
}

/* One weight row's block pair at p times x's pair xv: dw * dx per lane (dx: the pair's x scales
 * spread over their lanes) times the integer dot, which starts from start (minus the offset
 * correction), into acc; Q4_1's m * dx * sum into *offset. */
static inline __attribute__((always_inline)) void pair_dot(int type, int64_t stride, const uint8_t *p, __m512i xv,
                                                         __m512 dx, __m512i start, float ss0, float ss1,
                                                         __m512 *acc, float *offset) {
    __mmask16 second = type == GGUF_Q8_0 ? GGUF_SECOND_Q8 : GGUF_SECOND_Q4;
    __m512 dw = _mm512_mask_blend_ps(second, _mm512_set1_ps(half_to_float(p)),
                                     _mm512_set1_ps(half_to_float(p + stride)));
    __m512i w = pair_u8(type, p, stride), dot;
    if (type == GGUF_Q8_0) {
        /* |w| times x carrying w's sign (AVX2's vpsignb trick, which AVX-512 lacks, by a mask). */
        __mmask64 negative = _mm512_movepi8_mask(w);
        dot = _mm512_dpbusd_epi32(start, _mm512_abs_epi8(w), _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv));
    } else {
        dot = _mm512_dpbusd_epi32(start, w, xv);
    }
    *acc = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(dot), *acc);
    if (type == GGUF_Q4_1) *offset += half_to_float(p + 2) * ss0 + half_to_float(p + stride + 2) * ss1;
}

/* gguf_four_rows with block pairs: weight rows [i, i + 4) times one row of x (xs: its int8 blocks in
 * the type's pair order), into out[i..]. */
static inline __attribute__((always_inline)) void four_rows_avx512(int type, int64_t stride, const uint8_t *w,
                                                                 int64_t row_bytes, int64_t blocks,
                                                                 const QuantizedRows *q, const int8_t *xs,
                                                                 float *out, int64_t i, int64_t n_rows) {
    const uint8_t *w0 = w + i * row_bytes;
    int64_t ahead = i + GGUF_FOUR + GGUF_PREFETCH_ROWS <= n_rows ? GGUF_PREFETCH_ROWS * row_bytes : 0;
    __mmask16 second = type == GGUF_Q8_0 ? GGUF_SECOND_Q8 : GGUF_SECOND_Q4;
    /* Q4_0's integer correction, 8 * sum, sits in one lane of each block. */
    int32_t times = type == GGUF_Q4_0 ? 8 : 0;
    __mmask16 lane1 = 1 << 4;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    float o0 = 0.f, o1 = 0.f, o2 = 0.f, o3 = 0.f;
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        const uint8_t *p = w0 + b * stride;
        /* Both lines from the pair's first byte: a pair advances up to 68 bytes, one line a step
         * would leave a line in 16 unfetched (Q8_0), and a miss costs more than the extra hints. */
        for (int r = 0; r < GGUF_FOUR; r++) {
            _mm_prefetch((const char *)(p + ahead + r * row_bytes), _MM_HINT_T1);
            _mm_prefetch((const char *)(p + ahead + r * row_bytes + 64), _MM_HINT_T1);
        }
        __m512i xv = _mm512_loadu_si512((const void *)(xs + b * GGUF_BLOCK));
        __m512 dx = _mm512_mask_blend_ps(second, _mm512_set1_ps(q->d[b]), _mm512_set1_ps(q->d[b + 1]));
        __m512i start = _mm512_setzero_si512();
        if (times)
            start = _mm512_mask_set1_epi32(_mm512_maskz_set1_epi32(1, -times * q->sum[b]), lane1,
                                           -times * q->sum[b + 1]);
        float ss0 = q->scaled_sum[b], ss1 = q->scaled_sum[b + 1];
        pair_dot(type, stride, p, xv, dx, start, ss0, ss1, &a0, &o0);
        pair_dot(type, stride, p + row_bytes, xv, dx, start, ss0, ss1, &a1, &o1);
        pair_dot(type, stride, p + 2 * row_bytes, xv, dx, start, ss0, ss1, &a2, &o2);
        pair_dot(type, stride, p + 3 * row_bytes, xv, dx, start, ss0, ss1, &a3, &o3);
    }
    float t0 = 0.f, t1 = 0.f, t2 = 0.f, t3 = 0.f;
    if (b < blocks) { /* an odd last block */
        __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
        const uint8_t *p = w0 + b * stride;
        __m256i xv = _mm256_loadu_si256((const __m256i *)(q->qs + b * GGUF_BLOCK));
        float dx = q->d[b], ss = q->scaled_sum[b];
        int32_t sum = q->sum[b];
        block_dot(type, p, xv, dx, sum, ss, &c0, &o0);
        block_dot(type, p + row_bytes, xv, dx, sum, ss, &c1, &o1);
        block_dot(type, p + 2 * row_bytes, xv, dx, sum, ss, &c2, &o2);
        block_dot(type, p + 3 * row_bytes, xv, dx, sum, ss, &c3, &o3);
        t0 = hsum_ps(c0), t1 = hsum_ps(c1), t2 = hsum_ps(c2), t3 = hsum_ps(c3);
    }
    out[i] = _mm512_reduce_add_ps(a0) + t0 + o0, out[i + 1] = _mm512_reduce_add_ps(a1) + t1 + o1;
    out[i + 2] = _mm512_reduce_add_ps(a2) + t2 + o2, out[i + 3] = _mm512_reduce_add_ps(a3) + t3 + o3;
}

/* one_x_row with AVX-512 VNNI: the rows GGUF_FOUR at a time; the last few (n % 4) through AVX2's
 * one_x_row. Returns -1 where x's reordered copy could not be allocated. */
static int one_x_row_avx512(int type, const uint8_t *w, int64_t row_bytes, int64_t blocks, const QuantizedRows *q,
                            float *out, int64_t n, int threads) {
    int8_t *pairs = NULL;
    const int8_t *xs = q->qs;
    if (type != GGUF_Q8_0) {
        if ((pairs = malloc(blocks * GGUF_BLOCK)) == NULL) return -1;
        x_pairs_q4(q->qs, blocks, pairs);
        xs = pairs;
    }
    int64_t groups = n / GGUF_FOUR;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        if (type == GGUF_Q4_1) four_rows_avx512(GGUF_Q4_1, 20, w, row_bytes, blocks, q, xs, out, g * GGUF_FOUR, n);
        else if (type == GGUF_Q8_0) four_rows_avx512(GGUF_Q8_0, 34, w, row_bytes, blocks, q, xs, out, g * GGUF_FOUR, n);
        else four_rows_avx512(GGUF_Q4_0, 18, w, row_bytes, blocks, q, xs, out, g * GGUF_FOUR, n);
    }
    free(pairs);
    int64_t done = groups * GGUF_FOUR;
    if (done < n) one_x_row(type, w + done * row_bytes, row_bytes, blocks, q, out + done, n - done, 1);
    return 0;
}

#pragma GCC pop_options
