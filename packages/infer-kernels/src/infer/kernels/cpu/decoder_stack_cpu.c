/* A decoder-only model's stack of blocks for a CPU step of decode rows, in one call: the C path of
 * `DecoderStackCpu` (decoder_stack.py). Built on first use by infer.kernels.cpu.native.
 *
 * Why: a CPU pays per op, not per byte. SmolLM2's step through the PyTorch path makes about 80 ops
 * and as many Python calls a layer, 30 layers a token: on the CI-class VM that was 8 of the 20 ms
 * an int8 token took (docs/benchmarks/generation.md#cpu-smollm2-135m-instruct). Here a step is
 * one call, and what is left is reading the weights.
 *
 * Each block, for each row (pre-norm; "sandwich" where pre_feedforward_norm is set, as Gemma 3):
 *   x = norm(residual, input_norm)
 *   q, k, v = x @ qkv.T (+ bias); q, k = per-head norms (q_norm, k_norm, where set); rotate q, k
 *   k, v -> the cache at the row's slot; a = attention(q, cached keys and values)
 *   o = a @ o.T (+ bias)
 *   pre-norm: residual += o;                          x = norm(residual, post_attention_norm)
 *   sandwich: residual += norm(o, post_attention_norm); x = norm(residual, pre_feedforward_norm)
 *   h = act(gate) * up of x @ gate_up.T; d = h @ down.T
 *   pre-norm: residual += d;  sandwich: residual += norm(d, post_feedforward_norm)
 * Every norm scales by (offset + weight). `residual` comes in as the embedded tokens and goes out as
 * the stream after the last block, before the final norm.
 *
 * Linears are float32, bf16 (bf16_gemv_cpu.c's kernel: widened to fp32 in registers), int8 with a
 * float32 scale per output channel (int8_gemv_cpu.c's kernel), or a GGUF file's Q4_0 / Q4_1 / Q8_0
 * blocks (gguf_gemv_cpu.c's kernel); activations are float32 throughout.
 * Attention is decode_attention_cpu.c's. Threads split each product's weight rows and attention's
 * heads; the norms, rotations and activation, a few thousand floats a row, run on one.
 */
#include "bf16_gemv_cpu.c"
#include "decode_attention_cpu.c"
#include "gguf_gemv_cpu.c"
#include "int8_gemv_cpu.c"

#include <string.h>

typedef struct {
    const void *weight; /* [n, k]: float32, bf16 where bf16 is set, int8 where scale is, GGUF blocks where gguf_type is */
    const float *scale; /* [n]: one per output channel; NULL for a float32 weight */
    const float *bias;  /* [n] or NULL */
    int64_t n, k;
    int64_t gguf_type; /* 0, or the ggml type id of the weight's blocks (GGUF_Q4_0, ...) */
    int64_t bf16;      /* 1: the weight is bf16 (16-bit words), 0: another format */
} Linear;

typedef struct {
    const float *input_norm, *post_attention_norm;
    const float *pre_feedforward_norm, *post_feedforward_norm; /* both NULL: pre-norm block */
    const float *q_norm, *k_norm;                              /* both NULL: no QK norm */
    Linear qkv, o, gate_up, down;
    const float *cos, *sin; /* the layer's rotary tables, [max_positions, head_dim / 2] */
    float *k_cache, *v_cache; /* [num_blocks, block_size, num_kv_heads, head_dim] */
    int64_t sliding_window;   /* 0: none */
} Block;

typedef struct {
    int64_t num_blocks, hidden_size, num_q_heads, num_kv_heads, head_dim, intermediate_size;
    int64_t block_size; /* the KV cache's tokens a block */
    float eps, norm_offset, attention_scale;
    int activation; /* 0: silu, 1: gelu (tanh approximation) */
} Stack;

/* out = x / rms(x) * (offset + w), n floats. */
static void rms_norm(const float *x, const float *w, float offset, float eps, int64_t n, float *out) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float squares = sum_ps(acc);
    for (; i < n; i++) squares += x[i] * x[i];
    float inverse = 1.f / sqrtf(squares / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = x[i] * inverse * (offset + w[i]);
}

/* Rows [i, i + 4) of a float32 weight times rows x [m, k] into out [m, n], each row of x reusing
 * the block from L1. The rows PREFETCH_ROWS ahead are prefetched into L2, a line at a time, as
 * int8_gemv_cpu.c does: streamed from 2 threads on the CI-class VM, SmolLM2's shapes read at
 * 27-33 GB/s that way, against 22-29 without and 24-33 for MKL's batched product
 * (docs/benchmarks/generation.md#elsewhere). */
static void four_rows_f32(const float *x, int64_t m, const float *w, float *out, int64_t i, int64_t n,
                          int64_t k) {
    const float *w0 = w + i * k;
    int64_t ahead = i + 4 + PREFETCH_ROWS <= n ? PREFETCH_ROWS * k : 0;
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * k;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < k; j += 8) {
            const float *p = w0 + j;
            if (r == 0 && (j & 15) == 0) { /* a 64-byte line holds 16 floats */
                _mm_prefetch((const char *)(p + ahead), _MM_HINT_T1);
                _mm_prefetch((const char *)(p + ahead + k), _MM_HINT_T1);
                _mm_prefetch((const char *)(p + ahead + 2 * k), _MM_HINT_T1);
                _mm_prefetch((const char *)(p + ahead + 3 * k), _MM_HINT_T1);
            }
            __m256 xv = _mm256_loadu_ps(xr + j);
            a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(p), a0);
            a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(p + k), a1);
            a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(p + 2 * k), a2);
            a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(p + 3 * k), a3);
        }
        float *o = out + r * n + i;
        o[0] = sum_ps(a0), o[1] = sum_ps(a1), o[2] = sum_ps(a2), o[3] = sum_ps(a3);
    }
}

/* out [m, n] = x [m, k] @ w.T for a float32 weight, k % 8 == 0. */
static void gemv_f32(const float *x, int64_t m, const float *w, float *out, int64_t n, int64_t k, int threads) {
    int64_t blocks = n / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) four_rows_f32(x, m, w, out, b * 4, n, k);
    for (int64_t i = blocks * 4; i < n; i++)
        for (int64_t r = 0; r < m; r++) out[r * n + i] = dot(x + r * k, w + i * k, k);
}

/* out [m, n] = x [m, k] @ W.T + bias; returns 0, or -1 where int8_gemv or gguf_gemv failed. */
static int linear(const Linear *l, const float *x, int64_t m, float *out, int threads) {
    if (l->bf16) {
        bf16_gemv(x, l->weight, out, m, l->n, l->k, threads);
    } else if (l->gguf_type != 0) {
        if (gguf_gemv((int)l->gguf_type, x, l->weight, out, m, l->n, l->k, threads) != 0) return -1;
    } else if (l->scale == NULL) {
        gemv_f32(x, m, l->weight, out, l->n, l->k, threads);
    } else if (int8_gemv(x, l->weight, l->scale, out, m, l->n, l->k, threads) != 0) {
        return -1;
    }
    if (l->bias != NULL)
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < l->n; i++) out[r * l->n + i] += l->bias[i];
    return 0;
}

/* hidden [n] = act(gate) * up from gate_up [2n]; exponentials of non-positive arguments only. */
static void gated_activation(const float *gate_up, float *hidden, int64_t n, int activation) {
    const float *gate = gate_up, *up = gate_up + n;
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i), act;
        if (activation == 0) {
            /* silu: g * sigmoid(g), sigmoid(g) = 1 / (1 + e) for g >= 0, else e / (1 + e), e = exp(-|g|) */
            __m256 e = exp_ps(_mm256_or_ps(g, sign));
            __m256 numerator = _mm256_blendv_ps(e, one, _mm256_cmp_ps(g, zero, _CMP_GE_OQ));
            act = _mm256_mul_ps(g, _mm256_div_ps(numerator, _mm256_add_ps(one, e)));
        } else {
            /* gelu: 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3), tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|) */
            __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                     _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g));
            __m256 e = exp_ps(_mm256_mul_ps(_mm256_set1_ps(2.f), _mm256_or_ps(y, sign)));
            __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
            t = _mm256_or_ps(t, _mm256_and_ps(y, sign));
            act = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, t));
        }
        _mm256_storeu_ps(hidden + i, _mm256_mul_ps(act, _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) {
        float g = gate[i], act;
        if (activation == 0) {
            act = g / (1.f + expf(-g));
        } else {
            act = 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
        }
        hidden[i] = act * up[i];
    }
}

/* The neox rotation of `heads` heads of d at h: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). */
static void rotate(float *h, int64_t heads, int64_t d, const float *cos, const float *sin) {
    int64_t half = d / 2;
    for (int64_t head = 0; head < heads; head++, h += d)
        for (int64_t i = 0; i < half; i++) {
            float x1 = h[i], x2 = h[i + half];
            h[i] = x1 * cos[i] - x2 * sin[i];
            h[i + half] = x2 * cos[i] + x1 * sin[i];
        }
}

/* residual += out (norm(out, norm) where norm is set, a sandwich block's), rows of hidden_size. */
static void join_stream(const Stack *s, float *residual, float *out, int64_t rows, const float *norm) {
    for (int64_t r = 0; r < rows; r++) {
        float *res = residual + r * s->hidden_size, *o = out + r * s->hidden_size;
        if (norm != NULL) rms_norm(o, norm, s->norm_offset, s->eps, s->hidden_size, o);
        for (int64_t i = 0; i < s->hidden_size; i++) res[i] += o[i];
    }
}

/* Returns 0, or -1 where a buffer could not be allocated. */
int decoder_stack(const Stack *s, const Block *blocks, float *residual, int64_t rows, const int64_t *positions,
                  const int64_t *slots, const int32_t *block_tables, int64_t block_table_stride,
                  const int32_t *seq_lens, int threads) {
    int64_t hidden = s->hidden_size, d = s->head_dim, half = d / 2;
    int64_t q_width = s->num_q_heads * d, kv_width = s->num_kv_heads * d, qkv_width = q_width + 2 * kv_width;
    int64_t inter = s->intermediate_size;
    float *x = malloc(sizeof(float) * rows * hidden), *qkv = malloc(sizeof(float) * rows * qkv_width);
    float *attended = malloc(sizeof(float) * rows * q_width), *projected = malloc(sizeof(float) * rows * hidden);
    float *gate_up = malloc(sizeof(float) * rows * 2 * inter), *mlp = malloc(sizeof(float) * rows * inter);
    int failed = x == NULL || qkv == NULL || attended == NULL || projected == NULL || gate_up == NULL || mlp == NULL;
    float offset = s->norm_offset, eps = s->eps;
    for (int64_t layer = 0; layer < s->num_blocks && !failed; layer++) {
        const Block *b = &blocks[layer];
        int sandwich = b->pre_feedforward_norm != NULL;
        for (int64_t r = 0; r < rows; r++) rms_norm(residual + r * hidden, b->input_norm, offset, eps, hidden, x + r * hidden);
        if (linear(&b->qkv, x, rows, qkv, threads) != 0) {
            failed = 1;
            break;
        }
        for (int64_t r = 0; r < rows; r++) {
            float *q = qkv + r * qkv_width, *k = q + q_width, *v = k + kv_width;
            if (b->q_norm != NULL) {
                for (int64_t h = 0; h < s->num_q_heads; h++) rms_norm(q + h * d, b->q_norm, offset, eps, d, q + h * d);
                for (int64_t h = 0; h < s->num_kv_heads; h++) rms_norm(k + h * d, b->k_norm, offset, eps, d, k + h * d);
            }
            const float *cos = b->cos + positions[r] * half, *sin = b->sin + positions[r] * half;
            rotate(q, s->num_q_heads, d, cos, sin);
            rotate(k, s->num_kv_heads, d, cos, sin);
            memcpy(b->k_cache + slots[r] * kv_width, k, sizeof(float) * kv_width);
            memcpy(b->v_cache + slots[r] * kv_width, v, sizeof(float) * kv_width);
        }
        if (decode_attention(qkv, qkv_width, b->k_cache, b->v_cache, block_tables, block_table_stride, seq_lens,
                             attended, q_width, rows, s->num_q_heads, s->num_kv_heads, d, s->block_size,
                             b->sliding_window, s->attention_scale, threads) != 0 ||
            linear(&b->o, attended, rows, projected, threads) != 0) {
            failed = 1;
            break;
        }
        join_stream(s, residual, projected, rows, sandwich ? b->post_attention_norm : NULL);
        for (int64_t r = 0; r < rows; r++)
            rms_norm(residual + r * hidden, sandwich ? b->pre_feedforward_norm : b->post_attention_norm, offset, eps,
                     hidden, x + r * hidden);
        if (linear(&b->gate_up, x, rows, gate_up, threads) != 0) {
            failed = 1;
            break;
        }
        for (int64_t r = 0; r < rows; r++) gated_activation(gate_up + r * 2 * inter, mlp + r * inter, inter, s->activation);
        if (linear(&b->down, mlp, rows, projected, threads) != 0) {
            failed = 1;
            break;
        }
        join_stream(s, residual, projected, rows, sandwich ? b->post_feedforward_norm : NULL);
    }
    free(x);
    free(qkv);
    free(attended);
    free(projected);
    free(gate_up);
    free(mlp);
    return failed ? -1 : 0;
}

/* decoder_stack, then each row's final norm (final_norm, the stack's offset and eps) and the LM
 * head's product: logits [rows, head->n]. Where the step's last ops run here, no op of the caller's
 * follows the stack's stream of weights, which leaves the caches cold for Python and torch (on the
 * 2-core VM the final norm took 0.14 ms right after the stack, 0.03 ms run again). Returns 0, or -1
 * as decoder_stack does. */
int decoder_stack_logits(const Stack *s, const Block *blocks, const Linear *head, const float *final_norm,
                         float *residual, int64_t rows, const int64_t *positions, const int64_t *slots,
                         const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens,
                         float *logits, int threads) {
    if (decoder_stack(s, blocks, residual, rows, positions, slots, block_tables, block_table_stride, seq_lens,
                      threads) != 0)
        return -1;
    float *x = malloc(sizeof(float) * rows * s->hidden_size);
    if (x == NULL) return -1;
    for (int64_t r = 0; r < rows; r++)
        rms_norm(residual + r * s->hidden_size, final_norm, s->norm_offset, s->eps, s->hidden_size,
                 x + r * s->hidden_size);
    int status = linear(head, x, rows, logits, threads);
    free(x);
    return status;
}
