/* Attention for the few query rows of a decode or verify step, float32, on x86 with AVX2+FMA.
 *
 * Why: PyTorch's CPU scaled_dot_product_attention sets up a tiled flash kernel on every call,
 * which at one to six query rows over a few hundred cached columns is most of its time, and grows
 * with every row a verify step adds. The arithmetic is a few microseconds; this does only that.
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
 *
 * Built for AVX-512, head_dim 16-128 take the 512-bit kernels (row_scores_512 and rows_pv_512,
 * below, through attend_grouped): 512-bit vectors and 16 columns' scores summed at once, the query
 * heads of a key/value head together on each key and value loaded, each key and value prefetched a
 * block ahead, faster than the AVX2 form at every shape. From batch 8 on, reading the float32 keys
 * and values from memory is most of it (8 x 1 at 129 columns: 47 MB a step), whichever form.
 *
 * Keys and values may be kept in bfloat16 (`kv_bf16`: the engine's --kv-bf16; layer_ops.c's
 * rope_write rounds them when it writes them): every load widens a bfloat16 to the float32 with
 * the same bits above (exact), and the arithmetic is the float32 arithmetic above, so exactness
 * holds as it does for float32 keys and values. Why: from batch 8 on reading them is most of
 * attention, and bfloat16 halves the bytes.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* How many columns ahead the 512-bit kernels prefetch a key or value (one 16-column block): the
 * hardware's prefetcher alone left a step's rows waiting on the cache's next lines. */
#define PREFETCH_COLUMNS 16

/* Every line of the `bytes` at p into L1. */
#define PREFETCH_LINES(p, bytes)                                                                        \
    do {                                                                                                \
        _Pragma("GCC unroll 8") for (size_t line = 0; line < (bytes); line += 64)                       \
            _mm_prefetch((const char *)(p) + line, _MM_HINT_T0);                                        \
    } while (0)

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
 * where the row may attend; out [D]. `scores`: room for end + 16 floats (the scores, padded to a
 * multiple of 8; the 512-bit form's to 16), then end + 16 int32 (the columns they belong to; the
 * 512-bit form stores 16 at a time). CHUNKS is a compile-time constant
 * so that the query and the output's sums stay in registers. */
/* 8 (16) keys' or values' elements widened to float32: float32 as it is, bfloat16 by its bits. */
#define LOAD8_F32(p) _mm256_loadu_ps(p)
#define LOAD8_BF16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define LOAD16_F32(p) _mm512_loadu_ps(p)
#define LOAD16_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))

#define ATTEND_ROW(CHUNKS, KV, T, LOAD)                                                                 \
    static void attend_row_##KV##_##CHUNKS(const float *q, const void *keys_, const void *values_, int64_t row, \
                                    const uint8_t *seen, int64_t end, float scale, float *scores,       \
                                    float *out) {                                                       \
        const T *keys = keys_, *values = values_;                                                       \
        __m256 qv[CHUNKS], acc[CHUNKS];                                                                 \
        _Pragma("GCC unroll 32") for (int d = 0; d < CHUNKS; d++)                                       \
            qv[d] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * d), _mm256_set1_ps(scale));                   \
        int32_t *columns = (int32_t *)(scores + end + 8);                                               \
        int64_t count = 0;                                                                              \
        float top = -INFINITY;                                                                          \
        for (int64_t c = 0; c < end; c++) {                                                             \
            if (!seen[c]) continue;                                                                     \
            const T *k = keys + c * row;                                                                \
            __m256 even = _mm256_mul_ps(qv[0], LOAD(k)), odd = _mm256_setzero_ps();                     \
            _Pragma("GCC unroll 32") for (int d = 1; d < CHUNKS; d++) {                                 \
                if (d % 2) odd = _mm256_fmadd_ps(qv[d], LOAD(k + 8 * d), odd);                          \
                else even = _mm256_fmadd_ps(qv[d], LOAD(k + 8 * d), even);                              \
            }                                                                                           \
            float s = sum8(_mm256_add_ps(even, odd));                                                   \
            scores[count] = s;                                                                          \
            columns[count++] = (int32_t)c;                                                              \
            top = s > top ? s : top;                                                                    \
        }                                                                                               \
        if (count == 0) {                                                                               \
            _Pragma("GCC unroll 32") for (int d = 0; d < CHUNKS; d++)                                   \
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
        _Pragma("GCC unroll 32") for (int d = 0; d < CHUNKS; d++) acc[d] = _mm256_setzero_ps();         \
        for (int64_t j = 0; j < count; j++) {                                                           \
            const T *v = values + (int64_t)columns[j] * row;                                            \
            __m256 p = _mm256_set1_ps(scores[j]);                                                       \
            _Pragma("GCC unroll 32") for (int d = 0; d < CHUNKS; d++)                                   \
                acc[d] = _mm256_fmadd_ps(p, LOAD(v + 8 * d), acc[d]);                                   \
        }                                                                                               \
        __m256 inverse = _mm256_set1_ps(1.0f / sum8(total));                                            \
        _Pragma("GCC unroll 32") for (int d = 0; d < CHUNKS; d++)                                       \
            _mm256_storeu_ps(out + 8 * d, _mm256_mul_ps(acc[d], inverse));                              \
    }

ATTEND_ROW(1, f32, float, LOAD8_F32)   /* head_dim 8 (and 16 without AVX-512): small test models */
ATTEND_ROW(1, bf16, uint16_t, LOAD8_BF16)
#ifndef __AVX512F__ /* there, the 512-bit kernels below take head_dim 16-128 */
ATTEND_ROW(2, f32, float, LOAD8_F32)
ATTEND_ROW(4, f32, float, LOAD8_F32)   /* 32 */
ATTEND_ROW(8, f32, float, LOAD8_F32)   /* 64: SmolLM2, Llama 3.2 1B */
ATTEND_ROW(16, f32, float, LOAD8_F32)  /* 128: most larger models */
ATTEND_ROW(2, bf16, uint16_t, LOAD8_BF16)
ATTEND_ROW(4, bf16, uint16_t, LOAD8_BF16)
ATTEND_ROW(8, bf16, uint16_t, LOAD8_BF16)
ATTEND_ROW(16, bf16, uint16_t, LOAD8_BF16)
#endif

#ifdef __AVX512F__
/* The AVX-512 form of attend_row for head_dim 16-128, 512-bit vectors. Scores go 16 columns at a
 * time: each column's 16-lane partial dot product (its q . k over 16-lane pieces of the head, two
 * chains) goes into one of 16 vectors, and one transposing sum (sum16x16) turns the 16 vectors
 * into the 16 columns' scores, ~3 shuffles and adds a column instead of a horizontal sum of its
 * own (~8). Columns the row does not see are computed with their block and dropped (compress-
 * stored away); blocks with none seen are skipped.
 *
 * Exactness, as attend_row: every column's score is summed in the same order whatever its place
 * in its block (sum16x16 adds every vector's lanes in one association, (a_i + a_i+8) + (a_i+4 +
 * a_i+12), then pairs, then the last pair), so a score depends on its query and key alone; the
 * seen scores are then compacted in column order and the rest is a function of that list. */
static inline __m512 exp16(__m512 x) {
    const __m512 lowest = _mm512_set1_ps(-87.0f);
    __mmask16 underflow = _mm512_cmp_ps_mask(x, lowest, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lowest);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~underflow, p, _mm512_castsi512_ps(bits));
}

/* Lane j of the result: the sum of the 16 lanes of v[4 * (j % 4) + j / 4]. */
static inline __m512 sum16x16(const __m512 *v) {
    __m512 halves[8], quarters[4], eighths[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: v[2i]'s i + (i+8); 8-15: v[2i+1]'s */
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++) /* quarter q: v[4i + q]'s (i + (i+8)) + ((i+4) + (i+12)), i < 4 */
        quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++) /* quarter q, lanes 0-1: v[8i + q]'s two sums; 2-3: v[8i + 4 + q]'s */
        eighths[i] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(quarters[2 * i]), _mm512_castps_pd(quarters[2 * i + 1]))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(quarters[2 * i]), _mm512_castps_pd(quarters[2 * i + 1]))));
    return _mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The attention weights of G query heads at one query row that see the same columns (the heads
 * of one key/value head), for rows_pv_512 below: head g's query at q + g * q_h, its scores over the
 * columns the row sees, exponentiated (p_c = exp(s_c - max s)), at scores + g * stride, and those
 * columns (the same for every head) into `columns` (room for end + 16 each), in increasing c;
 * returns how many, and the reciprocal of head g's sum in inverse[g]. Each key is loaded (and
 * widened) once for the G heads, where one head at a time loaded it G times; each head's score is
 * the same operations in the same order as alone, so the same bits. */
#define ROW_SCORES_512(CHUNKS, KV, T, LOAD, G)                                                          \
    static int64_t row_scores_512_##KV##_##CHUNKS##_##G(const float *q, int64_t q_h, const void *keys_, \
                                                        int64_t row, const uint8_t *seen, int64_t end,  \
                                                        float scale, float *scores, int64_t stride,     \
                                                        int32_t *columns, float *inverse) {             \
        const T *keys = keys_;                                                                          \
        __m512 qv[G][CHUNKS];                                                                           \
        _Pragma("GCC unroll 4") for (int g = 0; g < G; g++)                                             \
            _Pragma("GCC unroll 8") for (int d = 0; d < CHUNKS; d++)                                    \
                qv[g][d] = _mm512_mul_ps(_mm512_loadu_ps(q + g * q_h + 16 * d), _mm512_set1_ps(scale)); \
        int64_t count = 0;                                                                              \
        __m512 top[G];                                                                                  \
        _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) top[g] = _mm512_set1_ps(-INFINITY);         \
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);   \
        for (int64_t c0 = 0; c0 < end; c0 += 16) {                                                      \
            int64_t width = end - c0 < 16 ? end - c0 : 16;                                              \
            __mmask16 in = (__mmask16)(width == 16 ? 0xffff : (1u << width) - 1);                       \
            __mmask16 visible = _mm_mask_cmpneq_epi8_mask(in, _mm_maskz_loadu_epi8(in, seen + c0),      \
                                                          _mm_setzero_si128());                         \
            if (!visible) continue;                                                                     \
            __m512 part[G][16];                                                                         \
            for (int j = 0; j < 16; j++) {                                                              \
                int slot = 4 * (j % 4) + j / 4;                                                         \
                if (j >= width) {                                                                       \
                    _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) part[g][slot] = _mm512_setzero_ps(); \
                    continue;                                                                           \
                }                                                                                       \
                const T *k = keys + (c0 + j) * row;                                                     \
                PREFETCH_LINES(k + PREFETCH_COLUMNS * row, CHUNKS * 16 * sizeof(T));                    \
                __m512 key[CHUNKS];                                                                     \
                _Pragma("GCC unroll 8") for (int d = 0; d < CHUNKS; d++) key[d] = LOAD(k + 16 * d);     \
                _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) {                                   \
                    __m512 even = _mm512_mul_ps(qv[g][0], key[0]), odd = _mm512_setzero_ps();           \
                    _Pragma("GCC unroll 8") for (int d = 1; d < CHUNKS; d++) {                          \
                        if (d % 2) odd = _mm512_fmadd_ps(qv[g][d], key[d], odd);                        \
                        else even = _mm512_fmadd_ps(qv[g][d], key[d], even);                            \
                    }                                                                                   \
                    part[g][slot] = _mm512_add_ps(even, odd);                                           \
                }                                                                                       \
            }                                                                                           \
            /* compressed in registers, then stored whole (lanes past the seen ones are junk that  \
             * the next block or the -inf padding overwrites): a compressing store to memory is     \
             * microcoded on Zen 4, and two a block were a third of a prefill's attention there.    \
             * The same values land in the same places. */                                          \
            _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) {                                       \
                __m512 s = sum16x16(part[g]);                                                           \
                _mm512_storeu_ps(scores + g * stride + count, _mm512_maskz_compress_ps(visible, s));    \
                top[g] = _mm512_mask_max_ps(top[g], visible, top[g], s);                                \
            }                                                                                           \
            _mm512_storeu_si512(columns + count, _mm512_maskz_compress_epi32(                           \
                visible, _mm512_add_epi32(lane, _mm512_set1_epi32((int32_t)c0))));                       \
            count += __builtin_popcount(visible);                                                       \
        }                                                                                               \
        if (count == 0) return 0;                                                                       \
        /* p_c = exp(s_c - top), 16 at a time (the tail padded with -inf, whose exp is 0) */            \
        int64_t padded = (count + 15) & ~(int64_t)15;                                                   \
        _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) {                                           \
            float *head = scores + g * stride;                                                          \
            __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top[g]));                                 \
            for (int64_t j = count; j < padded; j++) head[j] = -INFINITY;                               \
            __m512 total = _mm512_setzero_ps();                                                         \
            for (int64_t j = 0; j < padded; j += 16) {                                                  \
                __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(head + j), most));                       \
                _mm512_storeu_ps(head + j, p);                                                          \
                total = _mm512_add_ps(total, p);                                                        \
            }                                                                                           \
            inverse[g] = 1.0f / _mm512_reduce_add_ps(total);                                            \
        }                                                                                               \
        return count;                                                                                   \
    }

/* The weighted sums of the values for G query heads that see the same columns (the heads of one
 * key/value head at one query row): out_g = inverse_g * sum_j p_gj v_(columns j), in increasing j,
 * head g's weights `stride` floats after head g-1's, its output `out_stride` floats after. The
 * heads' chains run side by side on each value loaded once: one head alone waits on its own
 * multiply-adds' latency a column. Each head's sums are the same operations in the same order as
 * alone, so the same bits. */
#define ROWS_PV_512(CHUNKS, KV, T, LOAD, G)                                                             \
    static void rows_pv_512_##KV##_##CHUNKS##_##G(const void *values_, int64_t row, const int32_t *columns, \
                                                  int64_t count, const float *scores, int64_t stride,   \
                                                  const float *inverse, float *out, int64_t out_stride) {\
        const T *values = values_;                                                                      \
        __m512 acc[G][CHUNKS];                                                                          \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; g++)                                             \
            _Pragma("GCC unroll 8") for (int d = 0; d < CHUNKS; d++) acc[g][d] = _mm512_setzero_ps();   \
        for (int64_t j = 0; j < count; j++) {                                                           \
            const T *v = values + (int64_t)columns[j] * row;                                            \
            if (j + PREFETCH_COLUMNS < count)                                                           \
                PREFETCH_LINES(values + (int64_t)columns[j + PREFETCH_COLUMNS] * row, CHUNKS * 16 * sizeof(T)); \
            __m512 value[CHUNKS];                                                                       \
            _Pragma("GCC unroll 8") for (int d = 0; d < CHUNKS; d++) value[d] = LOAD(v + 16 * d);       \
            _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {                                       \
                __m512 p = _mm512_set1_ps(scores[g * stride + j]);                                      \
                _Pragma("GCC unroll 8") for (int d = 0; d < CHUNKS; d++)                                \
                    acc[g][d] = _mm512_fmadd_ps(p, value[d], acc[g][d]);                                \
            }                                                                                           \
        }                                                                                               \
        _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {                                           \
            __m512 scale = _mm512_set1_ps(inverse[g]);                                                  \
            _Pragma("GCC unroll 8") for (int d = 0; d < CHUNKS; d++)                                    \
                _mm512_storeu_ps(out + g * out_stride + 16 * d, _mm512_mul_ps(acc[g][d], scale));       \
        }                                                                                               \
    }

#define ATTENTION_512(CHUNKS, KV, T, LOAD)                                                              \
    ROW_SCORES_512(CHUNKS, KV, T, LOAD, 1)                                                              \
    ROW_SCORES_512(CHUNKS, KV, T, LOAD, 2)                                                              \
    ROW_SCORES_512(CHUNKS, KV, T, LOAD, 3)                                                              \
    ROW_SCORES_512(CHUNKS, KV, T, LOAD, 4)                                                              \
    ROWS_PV_512(CHUNKS, KV, T, LOAD, 1)                                                                 \
    ROWS_PV_512(CHUNKS, KV, T, LOAD, 2)                                                                 \
    ROWS_PV_512(CHUNKS, KV, T, LOAD, 3)                                                                 \
    ROWS_PV_512(CHUNKS, KV, T, LOAD, 4)

ATTENTION_512(1, f32, float, LOAD16_F32)  /* 16 */
ATTENTION_512(2, f32, float, LOAD16_F32)  /* 32 */
ATTENTION_512(4, f32, float, LOAD16_F32)  /* 64 */
ATTENTION_512(8, f32, float, LOAD16_F32)  /* 128 */
ATTENTION_512(1, bf16, uint16_t, LOAD16_BF16)
ATTENTION_512(2, bf16, uint16_t, LOAD16_BF16)
ATTENTION_512(4, bf16, uint16_t, LOAD16_BF16)
ATTENTION_512(8, bf16, uint16_t, LOAD16_BF16)

/* The grouped form of a head size: up to 4 heads' weights and sums at once. */
typedef int64_t (*row_scores_fn)(const float *, int64_t, const void *, int64_t, const uint8_t *, int64_t, float,
                                 float *, int64_t, int32_t *, float *);
typedef void (*rows_pv_fn)(const void *, int64_t, const int32_t *, int64_t, const float *, int64_t, const float *,
                           float *, int64_t);
#define PV_GROUP_MAX 4
typedef struct {
    row_scores_fn scores[PV_GROUP_MAX + 1]; /* by how many heads */
    rows_pv_fn pv[PV_GROUP_MAX + 1];
} grouped_kernels;
#define GROUPED(KV, CHUNKS)                                                                             \
    (grouped_kernels) {                                                                                 \
        {0, row_scores_512_##KV##_##CHUNKS##_1, row_scores_512_##KV##_##CHUNKS##_2,                     \
         row_scores_512_##KV##_##CHUNKS##_3, row_scores_512_##KV##_##CHUNKS##_4},                       \
        {0, rows_pv_512_##KV##_##CHUNKS##_1, rows_pv_512_##KV##_##CHUNKS##_2,                           \
         rows_pv_512_##KV##_##CHUNKS##_3, rows_pv_512_##KV##_##CHUNKS##_4}                              \
    }

static int grouped_kernel(int64_t D, int kv_bf16, grouped_kernels *out) {
    switch (D) {
    case 16: *out = kv_bf16 ? GROUPED(bf16, 1) : GROUPED(f32, 1); return 1;
    case 32: *out = kv_bf16 ? GROUPED(bf16, 2) : GROUPED(f32, 2); return 1;
    case 64: *out = kv_bf16 ? GROUPED(bf16, 4) : GROUPED(f32, 4); return 1;
    case 128: *out = kv_bf16 ? GROUPED(bf16, 8) : GROUPED(f32, 8); return 1;
    default: return 0;
    }
}
#endif

typedef void (*attend_row_fn)(const float *, const void *, const void *, int64_t, const uint8_t *, int64_t, float,
                              float *, float *);

static attend_row_fn row_kernel(int64_t D, int kv_bf16) {
#ifdef __AVX512F__ /* head_dim 16-128 go to attend_grouped */
    if (D != 8) return 0;
    return kv_bf16 ? attend_row_bf16_1 : attend_row_f32_1;
#else
    if (kv_bf16)
        return D == 8 ? attend_row_bf16_1 : D == 16 ? attend_row_bf16_2 : D == 32 ? attend_row_bf16_4
             : D == 64 ? attend_row_bf16_8 : D == 128 ? attend_row_bf16_16 : 0;
    return D == 8 ? attend_row_f32_1 : D == 16 ? attend_row_f32_2 : D == 32 ? attend_row_f32_4
         : D == 64 ? attend_row_f32_8 : D == 128 ? attend_row_f32_16 : 0;
#endif
}

/* Query rows a sequence must have in a call for its bfloat16 keys and values to be widened once per
 * key/value head rather than at every use: a prefill's hundreds of rows read each column hundreds
 * of times, while at a step's few rows (3 query heads a key/value head, 1-5 rows) writing and
 * re-reading the float32 copy cost more than the widening it saved. */
#define WIDEN_FROM_ROWS 16

/* rows [end, D] of bfloat16 (D contiguous) widened to float32 [end, D]: each by its bits. */
static void widen_bf16(const void *from, int64_t end, int64_t D, float *to) {
    const uint16_t *in = from;
    int64_t n = end * D, j = 0;
#ifdef __AVX512F__
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(to + j, LOAD16_BF16(in + j));
#endif
    for (; j < n; j++) {
        uint32_t bits = (uint32_t)in[j] << 16;
        memcpy(to + j, &bits, sizeof bits);
    }
}

/* A thread's scratch (free it): score_bytes, then, where it widens, room for one key/value head's
 * keys and values in float32, 64-byte aligned, at *wide_keys and *wide_values (else, or where
 * malloc fails, NULL). */
static float *thread_scratch(size_t score_bytes, int widen, int64_t end, int64_t D, float **wide_keys,
                             float **wide_values) {
    float *scores = (float *)malloc(score_bytes + (widen ? 2 * (size_t)(end * D) * sizeof(float) + 64 : 0));
    *wide_keys = widen && scores ? (float *)(((uintptr_t)scores + score_bytes + 63) & ~(uintptr_t)63) : 0;
    *wide_values = *wide_keys ? *wide_keys + end * D : 0;
    return scores;
}

/* Where a thread widens (wide_keys), point *k and *v at its float32 copy of the keys and values of
 * (batch, key/value head) `pair`, widening them first unless the copy holds that pair already. */
static void read_widened(int64_t pair, const void **k, const void **v, int64_t end, int64_t D, float *wide_keys,
                         float *wide_values, int64_t *widened) {
    if (!wide_keys) return;
    if (*widened != pair) {
        widen_bf16(*k, end, D, wide_keys);
        widen_bf16(*v, end, D, wide_values);
        *widened = pair;
    }
    *k = wide_keys, *v = wide_values;
}

#ifdef __AVX512F__
/* attend (below) on the 512-bit kernels. A unit is a (sequence, key/value head, query row) and a
 * run of its query heads: their weights (row_scores_512, up to four heads on each key loaded),
 * then their sums side by side (rows_pv_512, each value loaded once for them). The heads of a
 * key/value head see the same columns at a row, so this is faster at prefill, verify and decode
 * shapes alike, and bitwise the same as one head at a time. A key/value head's query heads are
 * one run, unless the call has too few (sequence, key/value head, row) to share among the
 * threads: a decode step at batch 1 has three key/value heads for two threads, so one thread did
 * twice the other's work; its heads are then split into runs of fewer. */
static int attend_grouped(const grouped_kernels *kernels, const float *q, int64_t q_b, int64_t q_h, int64_t q_w,
                          const void *keys, const void *values, int64_t kv_b, int64_t kv_h, int kv_bf16, int widen,
                          const uint8_t *mask, float *out, int64_t B, int64_t H, int64_t KVH, int64_t W, int64_t end,
                          int64_t D, float scale, int threads) {
    int64_t group = H / KVH, stride = end + 16, rows = B * KVH * W;
    int64_t runs = threads > 1 && rows < 2 * threads ? (2 * threads + rows - 1) / rows : 1; /* a group's */
    if (runs > group) runs = group;
    int64_t run = (group + runs - 1) / runs; /* heads a run (the last may have fewer) */
    runs = (group + run - 1) / run;
    size_t element = kv_bf16 ? sizeof(uint16_t) : sizeof(float);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        /* per thread: each head's weights, their columns and sums' reciprocals, and where it
         * widens, one key/value head's keys and values (see attend) */
        size_t score_bytes = (size_t)stride * ((size_t)group * sizeof(float) + sizeof(int32_t)) + (size_t)group * sizeof(float);
        float *wide_keys, *wide_values;
        float *scores = thread_scratch(score_bytes, widen, end, D, &wide_keys, &wide_values);
        int32_t *columns = scores ? (int32_t *)(scores + group * stride) : 0;
        float *inverse = scores ? (float *)(columns + stride) : 0;
        int64_t widened = -1;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < rows * runs; u++) {
            if (!scores) {
                failed = 1;
                continue;
            }
            int64_t unit = u / runs, first = u % runs * run, last = first + run < group ? first + run : group;
            int64_t b = unit / (KVH * W), kvh = unit / W % KVH, i = unit % W;
            size_t at = (size_t)(b * kv_b + kvh * kv_h) * element;
            const void *k = (const char *)keys + at, *v = (const char *)values + at;
            read_widened(b * KVH + kvh, &k, &v, end, D, wide_keys, wide_values, &widened);
            const uint8_t *seen = mask + (b * W + i) * end;
            float *row_out = out + ((b * W + i) * H + kvh * group) * D;
            const float *row_q = q + b * q_b + kvh * group * q_h + i * q_w;
            for (int64_t h = first; h < last; h += PV_GROUP_MAX) {
                int64_t heads = last - h < PV_GROUP_MAX ? last - h : PV_GROUP_MAX;
                /* the same columns for every head: the same count */
                int64_t count = kernels->scores[heads](row_q + h * q_h, q_h, k, D, seen, end, scale, scores, stride,
                                                       columns, inverse);
                if (count == 0)
                    memset(row_out + h * D, 0, (size_t)(heads * D) * sizeof(float));
                else
                    kernels->pv[heads](v, D, columns, count, scores, stride, inverse, row_out + h * D, D);
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
#endif

/* out [B, W, H, D] (contiguous: the layout the output projection reads) from q [B, H, W, D] (strides
 * q_b, q_h, q_w; D contiguous), keys and values [B, KVH, columns, D] (strides kv_b, kv_h in
 * elements: float32, or bfloat16 where kv_bf16; a column D elements on, D contiguous), mask
 * [B, W, end] (contiguous, nonzero: may attend). Returns 0, or -1 where D is not 8, 16, 32, 64 or
 * 128 (native.HEAD_DIMS), or scratch memory runs out. The work is split among `threads` threads in
 * contiguous runs of rows: (batch, key/value head, query row) on the 512-bit kernels
 * (attend_grouped), else (batch, head, query row), in that order, so each thread's rows mostly share
 * their key/value heads. By row rather than by (batch, key/value head), as it was: a prefill at
 * batch 1 has three key/value heads for two threads, so one thread did twice the other's work.
 * Each row is computed alike whichever thread runs it, so results do not change (bitwise, tests).
 * The widening below speeds a prefill over bf16 keys and values and leaves decode and verify
 * shapes as they were. */
int attend(const float *q, int64_t q_b, int64_t q_h, int64_t q_w, const void *keys, const void *values,
           int64_t kv_b, int64_t kv_h, int kv_bf16, const uint8_t *mask, float *out, int64_t B, int64_t H,
           int64_t KVH, int64_t W, int64_t end, int64_t D, float scale, int threads) {
    /* bfloat16 keys and values are widened once per (batch, key/value head) a thread meets, into
     * float32 scratch its rows then read (the widening is exact: the same operands as widening
     * them at every use, so the same bits). */
    int widen = kv_bf16 && W >= WIDEN_FROM_ROWS;
    if (KVH < 1 || H % KVH) return -1;
#ifdef __AVX512F__
    grouped_kernels grouped;
    if (grouped_kernel(D, kv_bf16 && !widen, &grouped))
        return attend_grouped(&grouped, q, q_b, q_h, q_w, keys, values, kv_b, kv_h, kv_bf16, widen, mask, out, B, H,
                              KVH, W, end, D, scale, threads);
#endif
    attend_row_fn attend_row = row_kernel(D, kv_bf16 && !widen);
    if (!attend_row) return -1;
    int64_t group = H / KVH;
    size_t element = kv_bf16 ? sizeof(uint16_t) : sizeof(float);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        /* per thread: the scores of one row (padded to a multiple of 16) and their columns, and
         * where it widens, one key/value head's keys and values. Every thread enters the loop (a
         * worksharing loop some threads skipped would hang the rest at its barrier); one without
         * scratch memory only reports it. */
        size_t score_bytes = (size_t)(end + 16) * (sizeof(float) + sizeof(int32_t));
        float *wide_keys, *wide_values;
        float *scores = thread_scratch(score_bytes, widen, end, D, &wide_keys, &wide_values);
        int64_t widened = -1; /* the (batch, key/value head) in wide_keys and wide_values */
#pragma omp for schedule(static)
        for (int64_t u = 0; u < B * H * W; u++) {
            if (!scores) {
                failed = 1;
                continue;
            }
            int64_t b = u / (H * W), h = u / W % H, i = u % W, kvh = h / group;
            size_t at = (size_t)(b * kv_b + kvh * kv_h) * element;
            const void *k = (const char *)keys + at, *v = (const char *)values + at;
            read_widened(b * KVH + kvh, &k, &v, end, D, wide_keys, wide_values, &widened);
            attend_row(q + b * q_b + h * q_h + i * q_w, k, v, D, mask + (b * W + i) * end, end, scale, scores,
                       out + ((b * W + i) * H + h) * D);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
