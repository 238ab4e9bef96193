/* gguf_gemv_cpu.c's products on Q8_0 repacked four rows to a stream (GGUF_Q8_0_X4, gguf_linear.py's
 * "q8_0x4", made once at load by repack_gguf), with AVX2; included by gguf_gemv_cpu.c.
 *
 * For each group of four weight rows and each block index b, GGUF_X4_BLOCK bytes: the four rows'
 * fp16 scales (8 bytes), then the four rows' 32 int8 quants (128 bytes). A group is 4 * row_bytes,
 * the same bytes as the file's four rows; rows past the last whole group (n % 4) stay in the file's
 * layout after the groups, and take the file layout's code.
 *
 * Why (docs/benchmarks/quantization.md#where-a-decode-step-goes-avx2-only-vm): in the file's layout
 * a one-row pass reads four 612-byte rows side by side, 34-byte blocks at unaligned addresses, and
 * converts each block's scale alone; it streamed at 9-10 GB/s. Here the four rows are one stream,
 * the four scales convert in one vcvtph2ps, and the four rows' integer dots reduce to one vector of
 * four sums before a single fp32 multiply-add, which gives the four outputs as they are.
 *
 * The AVX-512 VNNI variant reads this layout through these AVX2 passes too: a pass of its own is
 * not written yet (it wants testing on a CPU with AVX-512). */

#define GGUF_X4_BLOCK 136 /* a group's bytes a block index: 4 fp16 scales, 4 x 32 quants */

/* The four rows' integer dots of their quants at p + 8 with x's block xv, as [r0, r1, r2, r3]. */
static inline __m128i x4_dots(const uint8_t *p, __m256i xv) {
    __m256i d[GGUF_FOUR];
    for (int r = 0; r < GGUF_FOUR; r++) {
        __m256i wq = _mm256_loadu_si256((const __m256i *)(p + 8 + 32 * r));
        d[r] = dot_u8_s8(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xv, wq));
    }
    /* Two levels of pairwise sums leave each row's sum split over the two 128-bit halves. */
    __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

/* The four scales dw at p times dx, one a row. */
static inline __m128 x4_scales(const uint8_t *p, float dx) {
    return _mm_mul_ps(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)p)), _mm_set1_ps(dx));
}

/* The group of four weight rows at g times one row of x (q), into out[0..3]; the group `ahead` bytes
 * on (0: none) prefetched into L2, a line at a time. */
static inline void four_rows_q8x4(const uint8_t *g, int64_t blocks, int64_t ahead, const QuantizedRows *q,
                                  float *out) {
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = g + b * GGUF_X4_BLOCK;
        /* 136 bytes a step: three hints cover every line of it wherever it starts. Without them the
         * pass was slower (docs/benchmarks/quantization.md#where-a-decode-step-goes-avx2-only-vm). */
        for (int line = 0; line < 3; line++) _mm_prefetch((const char *)(p + ahead + 64 * line), _MM_HINT_T1);
        __m256i xv = _mm256_loadu_si256((const __m256i *)(q->qs + b * GGUF_BLOCK));
        acc = _mm_fmadd_ps(x4_scales(p, q->d[b]), _mm_cvtepi32_ps(x4_dots(p, xv)), acc);
    }
    _mm_storeu_ps(out, acc);
}

/* out [n] = one row of x (q) times a GGUF_Q8_0_X4 weight: its groups, then its last n % 4 rows
 * through the file layout's one_x_row. The prefetch runs GGUF_PREFETCH_ROWS rows ahead, as there. */
static void one_x_row_q8x4(const uint8_t *w, int64_t row_bytes, int64_t blocks, const QuantizedRows *q,
                           float *out, int64_t n, int threads) {
    int64_t groups = n / GGUF_FOUR, group_bytes = GGUF_FOUR * row_bytes;
    int64_t ahead_groups = GGUF_PREFETCH_ROWS / GGUF_FOUR;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++)
        four_rows_q8x4(w + g * group_bytes, blocks, g + ahead_groups < groups ? ahead_groups * group_bytes : 0, q,
                       out + g * GGUF_FOUR);
    int64_t done = groups * GGUF_FOUR;
    if (done < n) one_x_row(GGUF_Q8_0, w + done * row_bytes, row_bytes, blocks, q, out + done, n - done, 1);
}

/* The group of four weight rows at g times every row of q (m <= GGUF_MAX_ROWS), into
 * out[r * n + 0..3]: each block index's 136 bytes read from L1 for the rows after the first. */
static void group_times_rows(const uint8_t *g, int64_t blocks, const QuantizedRows *q, int64_t m, float *out,
                             int64_t n) {
    __m128 acc[GGUF_MAX_ROWS];
    for (int64_t r = 0; r < m; r++) acc[r] = _mm_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = g + b * GGUF_X4_BLOCK;
        __m128 dw = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)p));
        for (int64_t r = 0; r < m; r++) {
            int64_t xb = r * blocks + b;
            __m256i xv = _mm256_loadu_si256((const __m256i *)(q->qs + xb * GGUF_BLOCK));
            acc[r] = _mm_fmadd_ps(_mm_mul_ps(dw, _mm_set1_ps(q->d[xb])), _mm_cvtepi32_ps(x4_dots(p, xv)), acc[r]);
        }
    }
    for (int64_t r = 0; r < m; r++) _mm_storeu_ps(out + r * n, acc[r]);
}
