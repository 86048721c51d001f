/* y = x @ W^T (+ bias) with int8 weights (one scale per output feature) and each input row
 * quantized to int8 with a scale of its own, products summed exactly in int32 by AVX512_VNNI's
 * vpdpbusd: a draft's linear layers. Compiled only where the CPU has AVX512_VNNI (the library is
 * built with -mavx512vnni there; specbatch.native.int8_dot_available()).
 *
 * Why: a draft's forward is bound by reading its weights (the target's 270 MB evict them from the
 * cache every step), so int8 weights are half bf16's bytes; fbgemm's dynamic int8 layer, which
 * the draft used, quantizes the whole call's input with one scale (a row's result then depends on
 * the other rows) and costs a Python call a layer. Here each row has its own scale, so a row's
 * drafts never depend on the batch it is in, and the layer joins decoder.c's one call.
 *
 * Layout: W [N, K] quantized per output feature n (scale s_w[n] = max|W[n]| / 127, values in
 * [-127, 127]) and packed into panels of 16 features by quads of input features,
 * [ceil(N/16)][ceil(K/4)][16][4] (zero-padded): one quad of a panel is one 64-byte line, the
 * signed operand of one vpdpbusd. Each call quantizes its input rows (scale s_x = max|x| / 127,
 * rounded to nearest even) and stores them offset by 128 as unsigned bytes, the instruction's
 * other operand; the offset's share, 128 * sum_k W_q[n, k], is taken back from each sum once.
 *
 * Exactness: each output is s_x * s_w[n] * (an exact int32 sum) + bias, computed the same way
 * whatever the other rows of the call, their block or the thread: row-exact. (The sum cannot
 * overflow: 255 * 127 * 4 a term, K / 4 terms: below 2^31 for K up to 66,000.)
 */
#ifdef __AVX512VNNI__
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define PANEL 16
#define INT8_MAX_ROWS 8
#define INT8_PANEL_GROUP 4 /* panels a thread takes at a time */
#define INT8_PREFETCH_L2 8192
#define INT8_PREFETCH_L1 1024

/* Rows x[0..R) (offset quads, Kq apart; their scales) against one panel; `valid` outputs written. */
#define INT8_BLOCK(R)                                                                                   \
    static void int8_##R(const uint32_t *x, const float *x_scale, int64_t Kq, const int8_t *panel,      \
                         const float *w_scale, const int32_t *offset, float *y, int64_t N, int64_t valid, \
                         const float *bias) {                                                           \
        __m512i sum[R];                                                                                 \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) sum[i] = _mm512_setzero_si512();            \
        for (int64_t q = 0; q < Kq; q++) {                                                              \
            const int8_t *w = panel + q * 4 * PANEL;                                                    \
            _mm_prefetch((const char *)w + INT8_PREFETCH_L2, _MM_HINT_T1);                              \
            _mm_prefetch((const char *)w + INT8_PREFETCH_L1, _MM_HINT_T0);                              \
            __m512i line = _mm512_loadu_si512(w);                                                       \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++)                                        \
                sum[i] = _mm512_dpbusd_epi32(sum[i], _mm512_set1_epi32((int)x[i * Kq + q]), line);      \
        }                                                                                               \
        __mmask16 keep = (__mmask16)((1u << valid) - 1);                                                \
        __m512 ws = _mm512_maskz_loadu_ps(keep, w_scale), b = bias ? _mm512_maskz_loadu_ps(keep, bias)  \
                                                                    : _mm512_setzero_ps();              \
        __m512i off = _mm512_maskz_loadu_epi32(keep, offset);                                           \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                          \
            __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum[i], off));                           \
            __m512 scaled = _mm512_mul_ps(_mm512_mul_ps(exact, _mm512_set1_ps(x_scale[i])), ws);        \
            _mm512_mask_storeu_ps(y + i * N, keep, _mm512_add_ps(scaled, b));                          \
        }                                                                                               \
    }

INT8_BLOCK(1) INT8_BLOCK(2) INT8_BLOCK(3) INT8_BLOCK(4) INT8_BLOCK(5) INT8_BLOCK(6) INT8_BLOCK(7) INT8_BLOCK(8)

typedef void (*int8_block)(const uint32_t *, const float *, int64_t, const int8_t *, const float *, const int32_t *,
                           float *, int64_t, int64_t, const float *);
typedef void (*panel_rows)(const void *call, int64_t panel, int64_t row, int64_t rows, int64_t valid);
void panel_blocks(int64_t M, int64_t N, int64_t max_rows, int64_t split_rows, int64_t group, int threads,
                  panel_rows run, const void *call); /* panel_blocks.c */

static const int8_block int8_blocks[INT8_MAX_ROWS + 1] = {0,      int8_1, int8_2, int8_3, int8_4,
                                                           int8_5, int8_6, int8_7, int8_8};

/* x [M, K] float32 quantized by rows: quads [M][Kq] of (round(x / s) + 128) bytes, and each
 * row's s (0 rows: s = 0, every byte 128). */
static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t Kq, uint32_t *quads, float *scale) {
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        float largest = 0.0f;
        for (int64_t k = 0; k < K; k++) largest = fmaxf(largest, fabsf(row[k]));
        float s = largest / 127.0f, inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
        scale[m] = s;
        uint8_t *out = (uint8_t *)(quads + m * Kq);
        for (int64_t k = 0; k < 4 * Kq; k++)
            out[k] = (uint8_t)(128 + (k < K ? (int)nearbyintf(row[k] * inverse) : 0));
    }
}

/* One call's operands, for panel_blocks. */
typedef struct {
    const uint32_t *quads;
    const float *x_scale;
    int64_t Kq;
    const int8_t *packed;
    const float *w_scale;
    const int32_t *offset;
    int64_t N;
    const float *bias;
    float *y;
} int8_call;

static void int8_rows(const void *call, int64_t p, int64_t m, int64_t rows, int64_t valid) {
    const int8_call *c = call;
    int8_blocks[rows](c->quads + m * c->Kq, c->x_scale + m, c->Kq, c->packed + p * c->Kq * 4 * PANEL,
                      c->w_scale + p * PANEL, c->offset + p * PANEL, c->y + m * c->N + p * PANEL, c->N, valid,
                      c->bias ? c->bias + p * PANEL : 0);
}

/* y [M, N] = x [M, K] @ W^T (+ bias), W packed and scaled as the header says; `offset` [N] =
 * 128 * sum_k W_q[n, k]; w_scale, offset and bias (or NULL) padded to the panels' width. Returns
 * nonzero where the input's quantized copy cannot be allocated. */
int panel_int8(const float *x, int64_t M, int64_t K, const int8_t *packed, const float *w_scale,
               const int32_t *offset, int64_t N, const float *bias, float *y, int threads) {
    int64_t Kq = (K + 3) / 4;
    uint32_t *quads = malloc((size_t)(M * Kq) * sizeof(uint32_t) + (size_t)M * sizeof(float));
    if (!quads)
        return 1;
    float *x_scale = (float *)(quads + M * Kq);
    quantize_rows(x, M, K, Kq, quads, x_scale);
    int8_call call = {quads, x_scale, Kq, packed, w_scale, offset, N, bias, y};
    panel_blocks(M, N, INT8_MAX_ROWS, INT8_MAX_ROWS, INT8_PANEL_GROUP, threads, int8_rows, &call);
    free(quads);
    return 0;
}
#endif
