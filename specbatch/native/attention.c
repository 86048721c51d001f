/* Attention for the few query rows of a decode or verify step, float32, on x86 with AVX2+FMA.
 *
 * Why: PyTorch's CPU scaled_dot_product_attention sets up a tiled flash kernel on every call,
 * which at one to six query rows over a few hundred cached columns is most of its time: on
 * SmolLM2's shape (9 query heads over 3 key/value heads, head_dim 64) ~50 us a layer at one row
 * and ~100 at three, 1.5 and 3 ms of a 30-layer step, growing with every row a verify step adds.
 * The arithmetic is a few microseconds; this does only that.
 *
 * For each query row (batch b, head h, row i): scores s_c = scale * q . k_c over the columns c its
 * mask lets it see, in increasing c; p_c = exp(s_c - max s); out = sum_c p_c v_c / sum_c p_c, both
 * sums in increasing c. Query head h reads key/value head h / (heads / kv_heads), as repeat_kv
 * and SDPA's enable_gqa have it.
 *
 * Exactness: a row's result depends only on its query, the columns it sees and their keys and
 * values, computed in a fixed order whatever the other rows of the call, the row count or the
 * thread count. A token verified beside drafts, or as a leaf whose keys/values sit in a scratch
 * column past the chain, sees the same columns in the same order as when it is decoded alone,
 * so it gets bitwise the same output: what float32 speculation needs to stay exact.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* exp(x) for 8 floats (x <= 0 here): 2^n * e^r with n = round(x / ln 2), |r| <= ln2 / 2, e^r by a
 * degree-6 polynomial (Cephes' expf: ~1 ulp); below -87 it flushes to 0, as expf underflows. */
static inline __m256 exp8(__m256 x) {
    const __m256 lowest = _mm256_set1_ps(-87.0f);
    __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lowest);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln2, ln2 split in two so that n * its high part is exact */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

/* For layer_ops.c (its SiLU). */
__m256 specbatch_exp8(__m256 x) { return exp8(x); }

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One query row: q [D] (D = 8 * CHUNKS), keys/values rows `row` floats apart, `seen` [end] nonzero
 * where the row may attend; out [D]. `scores`: room for end + 8 floats (the scores, padded to a
 * multiple of 8), then end int32 (the columns they belong to). CHUNKS is a compile-time constant
 * so that the query and the output's sums stay in registers. */
#define ATTEND_ROW(CHUNKS)                                                                              \
    static void attend_row_##CHUNKS(const float *q, const float *keys, const float *values, int64_t row, \
                                    const uint8_t *seen, int64_t end, float scale, float *scores,        \
                                    float *out) {                                                       \
        __m256 qv[CHUNKS], acc[CHUNKS];                                                                 \
        _Pragma("GCC unroll 32") for (int d = 0; d < CHUNKS; d++)                                      \
            qv[d] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * d), _mm256_set1_ps(scale));                   \
        int32_t *columns = (int32_t *)(scores + end + 8);                                               \
        int64_t count = 0;                                                                              \
        float top = -INFINITY;                                                                          \
        for (int64_t c = 0; c < end; c++) {                                                             \
            if (!seen[c]) continue;                                                                     \
            const float *k = keys + c * row;                                                            \
            __m256 even = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k)), odd = _mm256_setzero_ps();          \
            _Pragma("GCC unroll 32") for (int d = 1; d < CHUNKS; d++) {                                \
                if (d % 2) odd = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(k + 8 * d), odd);               \
                else even = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(k + 8 * d), even);                   \
            }                                                                                           \
            float s = sum8(_mm256_add_ps(even, odd));                                                   \
            scores[count] = s;                                                                          \
            columns[count++] = (int32_t)c;                                                              \
            top = s > top ? s : top;                                                                    \
        }                                                                                               \
        if (count == 0) {                                                                               \
            _Pragma("GCC unroll 32") for (int d = 0; d < CHUNKS; d++)                                  \
                _mm256_storeu_ps(out + 8 * d, _mm256_setzero_ps());                                     \
            return;                                                                                     \
        }                                                                                               \
        /* p_c = exp(s_c - top), eight at a time (the tail padded with -inf, whose exp is 0) */         \
        int64_t padded = (count + 7) & ~(int64_t)7;                                                     \
        for (int64_t j = count; j < padded; j++) scores[j] = -INFINITY;                                 \
        __m256 total = _mm256_setzero_ps();                                                             \
        for (int64_t j = 0; j < padded; j += 8) {                                                       \
            __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(top)));           \
            _mm256_storeu_ps(scores + j, p);                                                            \
            total = _mm256_add_ps(total, p);                                                            \
        }                                                                                               \
        _Pragma("GCC unroll 32") for (int d = 0; d < CHUNKS; d++) acc[d] = _mm256_setzero_ps();        \
        for (int64_t j = 0; j < count; j++) {                                                           \
            const float *v = values + (int64_t)columns[j] * row;                                        \
            __m256 p = _mm256_set1_ps(scores[j]);                                                       \
            _Pragma("GCC unroll 32") for (int d = 0; d < CHUNKS; d++)                                  \
                acc[d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * d), acc[d]);                        \
        }                                                                                               \
        __m256 inverse = _mm256_set1_ps(1.0f / sum8(total));                                            \
        _Pragma("GCC unroll 32") for (int d = 0; d < CHUNKS; d++)                                      \
            _mm256_storeu_ps(out + 8 * d, _mm256_mul_ps(acc[d], inverse));                              \
    }

ATTEND_ROW(1)   /* head_dim 8 and 16: small test models */
ATTEND_ROW(2)
ATTEND_ROW(4)   /* 32 */
ATTEND_ROW(8)   /* 64: SmolLM2, Llama 3.2 1B */
ATTEND_ROW(16)  /* 128: most larger models */

typedef void (*attend_row_fn)(const float *, const float *, const float *, int64_t, const uint8_t *, int64_t, float,
                              float *, float *);

/* out [B, W, H, D] (contiguous: the layout the output projection reads) from q [B, H, W, D] (strides
 * q_b, q_h, q_w; D contiguous), keys and values [B, KVH, columns, D] (strides kv_b, kv_h; a column
 * D floats on, D contiguous), mask [B, W, end] (contiguous, nonzero: may attend). Returns 0, or -1
 * where D is not 8, 16, 32, 64 or 128 (native.HEAD_DIMS), or scratch memory runs out. Rows are
 * split among `threads` threads by (batch, key/value head). */
int attend(const float *q, int64_t q_b, int64_t q_h, int64_t q_w, const float *keys, const float *values,
           int64_t kv_b, int64_t kv_h, const uint8_t *mask, float *out, int64_t B, int64_t H, int64_t KVH, int64_t W,
           int64_t end, int64_t D, float scale, int threads) {
    attend_row_fn attend_row = D == 8 ? attend_row_1 : D == 16 ? attend_row_2 : D == 32 ? attend_row_4
                              : D == 64 ? attend_row_8 : D == 128 ? attend_row_16 : 0;
    if (!attend_row || H % KVH) return -1;
    int64_t group = H / KVH;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        /* per thread: the scores of one row (padded to a multiple of 8) and their columns. Every
         * thread enters the loop (a worksharing loop some threads skipped would hang the rest at
         * its barrier); one without scratch memory only reports it. */
        float *scores = (float *)malloc((size_t)(end + 8) * sizeof(float) + (size_t)end * sizeof(int32_t));
#pragma omp for schedule(static)
        for (int64_t bk = 0; bk < B * KVH; bk++) {
            if (!scores) {
                failed = 1;
                continue;
            }
            int64_t b = bk / KVH, kvh = bk % KVH;
            const float *k = keys + b * kv_b + kvh * kv_h, *v = values + b * kv_b + kvh * kv_h;
            for (int64_t h = kvh * group; h < (kvh + 1) * group; h++)
                for (int64_t i = 0; i < W; i++)
                    attend_row(q + b * q_b + h * q_h + i * q_w, k, v, D, mask + (b * W + i) * end, end, scale,
                               scores, out + ((b * W + i) * H + h) * D);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
