/* The small operations of a decoder layer between its matrix multiplies, float32, on x86 with AVX2:
 * residual add with RMS norm, rotary embedding with the write of the new keys and values into the
 * KV pool, and SiLU-gated multiply.
 *
 * Why: at the few rows of a step each of these is microseconds of arithmetic, but as PyTorch
 * operators they are ~25 calls a layer, each with its dispatch, allocation and checks, and in a
 * step (between multiplies that stream megabytes of weights out of the cache) even an RMS norm of
 * one row costs many times its arithmetic. Three calls a layer do the same work here.
 *
 * Exactness: every output row depends only on its own input row (and, for the rotary embedding,
 * its position), computed in a fixed order whatever the number of rows or threads: a token
 * verified beside drafts gets what it gets alone, as float32 speculation needs. The rotary
 * embedding is bitwise PyTorch's x * cos + rotate_half(x) * sin (each product rounded, then the
 * sum: no contraction into a fused multiply-add, hence the pragmas); the norm and the SiLU are
 * within a few ulp of PyTorch's, not bitwise.
 */
#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* Below this many floats a call runs on one thread: a step's few rows are not worth a team. */
#define PARALLEL_FLOATS (1 << 16)

__m256 specbatch_exp8(__m256 x); /* attention.c: exp of 8 floats <= 0 */

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* x [rows, n] += delta (unless NULL), in place; then out = weight * (x / sqrt(mean(x^2) + eps)),
 * the normalisation as LlamaRMSNorm orders it (x times the inverse root, then times the weight).
 * The squares are summed 8 lanes at a time over k, the lanes then added: a fixed order per row. */
void add_rms_norm(float *x, const float *delta, int64_t rows, int64_t n, const float *weight, float eps, float *out,
                  int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * n >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * n, *yr = out + r * n;
        if (delta) {
            const float *dr = delta + r * n;
            for (int64_t j = 0; j < n; j++) xr[j] = xr[j] + dr[j];
        }
        __m256 lanes = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            __m256 v = _mm256_loadu_ps(xr + j);
            lanes = _mm256_add_ps(lanes, _mm256_mul_ps(v, v));
        }
        float squares = sum8(lanes);
        for (; j < n; j++) squares += xr[j] * xr[j];
        float inverse = 1.0f / sqrtf(squares / (float)n + eps);
        for (j = 0; j < n; j++) yr[j] = weight[j] * (xr[j] * inverse);
    }
}

/* out [rows, n] = silu(h[:, :n]) * h[:, n:], h [rows, 2n] (gate, then up). silu(g) = g * sigmoid(g),
 * the sigmoid from exp(-|g|) so that the exponential never overflows. */
void silu_mul(const float *h, int64_t rows, int64_t n, float *out, int threads) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * n >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = h + r * 2 * n, *up = gate + n;
        float *o = out + r * n;
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            __m256 g = _mm256_loadu_ps(gate + j);
            __m256 e = specbatch_exp8(_mm256_or_ps(g, sign)); /* exp(-|g|) */
            __m256 denominator = _mm256_add_ps(one, e);
            /* g >= 0: 1 / (1 + e); g < 0: e / (1 + e) */
            __m256 numerator = _mm256_blendv_ps(one, e, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
            __m256 silu = _mm256_mul_ps(g, _mm256_div_ps(numerator, denominator));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(silu, _mm256_loadu_ps(up + j)));
        }
        for (; j < n; j++) {
            float g = gate[j], e = expf(-fabsf(g));
            o[j] = g * ((g >= 0 ? 1.0f : e) / (1.0f + e)) * up[j];
        }
    }
}

/* Rotary embedding of one head in place: x[j] * cos[j] + x[j +- D/2] * signed_sin[j], where
 * signed_sin is sin with its first half negated (rotate_half's signs). */
static inline void rotate(float *x, const float *cos, const float *signed_sin, int64_t D) {
    int64_t half = D / 2;
    float rotated[256];
    for (int64_t j = 0; j < half; j++) {
        float a = x[j] * cos[j], b = x[j + half] * signed_sin[j];
        rotated[j] = a + b;
    }
    for (int64_t j = half; j < D; j++) {
        float a = x[j] * cos[j], b = x[j - half] * signed_sin[j];
        rotated[j] = a + b;
    }
    for (int64_t j = 0; j < D; j++) x[j] = rotated[j];
}

/* float32 -> bfloat16, rounded to nearest, ties to even (as torch's .to(torch.bfloat16)); a NaN
 * stays a (quiet) NaN. */
static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    __builtin_memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* For a fused QKV projection's output qkv [B, W, (H + 2 KVH) * D] (queries, keys, values): rotate
 * the queries in place, and write the rotated keys and the values of token (b, i) into column
 * columns[b, i] of keys and values [B, KVH, columns, D] (strides kv_b, kv_h in elements; a column
 * D elements on), as float32, or rounded to bfloat16 where kv_bf16. The angles of token (b, i) are
 * row positions[b, i] of cos and signed_sin [positions, D]. Returns 0, or -1 where D is odd or
 * over 256. */
int rope_write(float *qkv, int64_t B, int64_t W, int64_t H, int64_t KVH, int64_t D, const int64_t *positions,
               const int64_t *columns, const float *cos, const float *signed_sin, void *keys, void *values,
               int64_t kv_b, int64_t kv_h, int kv_bf16, int threads) {
    if (D % 2 || D > 256) return -1;
    int64_t width = (H + 2 * KVH) * D;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && B * W * width >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < B * W; t++) {
        int64_t b = t / W;
        float *row = qkv + t * width;
        const float *c = cos + positions[t] * D, *s = signed_sin + positions[t] * D;
        for (int64_t h = 0; h < H + KVH; h++) rotate(row + h * D, c, s, D);
        for (int64_t g = 0; g < KVH; g++) {
            int64_t at = b * kv_b + g * kv_h + columns[t] * D;
            const float *k = row + (H + g) * D, *v = row + (H + KVH + g) * D;
            if (kv_bf16) {
                uint16_t *key = (uint16_t *)keys + at, *value = (uint16_t *)values + at;
                for (int64_t j = 0; j < D; j++) {
                    key[j] = to_bf16(k[j]);
                    value[j] = to_bf16(v[j]);
                }
            } else {
                float *key = (float *)keys + at, *value = (float *)values + at;
                for (int64_t j = 0; j < D; j++) {
                    key[j] = k[j];
                    value[j] = v[j];
                }
            }
        }
    }
    return 0;
}

/* out[r] = the index of the largest of x [rows, n] row r, the first where several are equal, and a
 * row's first NaN where it holds one: torch.argmax's rule. Why: PyTorch's CPU argmax over a
 * 49152-token vocabulary is slow for float32 rows, and a verify step pays it once a row; a max
 * pass and a find pass, 8 floats at a time, cost a small fraction of it. The greedy verdict of
 * every step reads it, target-only decoding's too. */
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        __m256 most = _mm256_set1_ps(-INFINITY);
        __m256 unordered = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= n; k += 8) {
            __m256 v = _mm256_loadu_ps(row + k);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            most = _mm256_max_ps(most, v);
        }
        float top = -INFINITY;
        int nan = _mm256_movemask_ps(unordered) != 0;
        float lanes[8];
        _mm256_storeu_ps(lanes, most);
        for (int j = 0; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
        for (int64_t j = k; j < n; j++) {
            if (row[j] != row[j]) nan = 1;
            else if (row[j] > top) top = row[j];
        }
        int64_t at = 0; /* a row of -inf only (or of nothing): index 0, as torch */
        if (nan) {
            for (at = 0; at < n && row[at] == row[at]; at++) {
            }
        } else {
            __m256 target = _mm256_set1_ps(top);
            for (k = 0; k + 8 <= n; k += 8) {
                int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + k), target, _CMP_EQ_OQ));
                if (hits) break;
            }
            for (at = k; at < n && row[at] != top; at++) {
            }
            if (at == n) at = 0;
        }
        out[r] = at;
    }
}
