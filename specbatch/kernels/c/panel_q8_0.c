/* y = x @ W^T (+ bias) with W in GGUF's Q8_0 blocks (each 32 input features of an output feature
 * n: w = d * q, q an int8 in [-127, 127], d float16) and each input row quantized the same way
 * (per block of 32: d_x = max|x| / 127, q_x = round(x / d_x)), the products summed exactly in int32
 * by AVX512_VNNI's vpdpbusd: llama.cpp's own Q8_0 x Q8_0 dot product. Without AVX512_VNNI the same
 * sums by AVX2's vpmaddubsw (below), with bitwise the same results.
 *
 * Why: the embedded model's output head (its tied embedding, 49,152 x 576) is Q8_0 in its GGUF
 * file. A one-row step reads the whole head, so the head's bytes are a large share of every step:
 * 9 bits a weight here (the int8 values, each block's d and its values' sum) against bf16's 16.
 * The weights are the file's own values (recovered bit for bit from the dequantized weight:
 * specbatch.kernels.gguf_blocks), multiplied without rounding. Widening the int8 weights to bf16 in
 * registers for bf16 dot products instead costs more arithmetic than the bytes it saves.
 *
 * Arithmetic: vpdpbusd multiplies unsigned bytes by signed ones, so each input is stored offset by
 * 128 (q_x + 128 in 0..255) and, per block, 128 times the block's weight sum (kept beside its d) is
 * taken back: S_b = sum_k q_x q_w, exact. Each output is then sum over blocks b = 0, 1, ... of
 * float(S_b) * (d_w[b] * d_x[b]), one fused multiply-add a block, in that order.
 *
 * Layout: W [N, K] (K a multiple of 32) in panels of 16 output features, each panel [K / 32][576
 * bytes]: eight 64-byte lines (line j: each of the 16 features' four weights of input features
 * 4j..4j+3 of the block, the signed operand of one vpdpbusd), then the 16 features' d (float16),
 * then their blocks' weight sums (int16) (specbatch.kernels.panel.PanelLinear packs them so).
 *
 * Blocks of rows: up to 12 rows in one block (each line loaded once for them), more in blocks of
 * at most 8, as panel_q4_1.c.
 *
 * Exactness: each output depends only on its own row's input (its own block scales), the weights
 * and the fixed block order: never on the other rows, their block or the thread (row-exact).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define PANEL 16
#define Q8_BLOCK 32        /* input features a d covers (GGUF's QK8_0) */
#define Q8_QUADS 8         /* quads of input features a block holds: one vpdpbusd each */
#define Q8_BLOCK_BYTES 576 /* a panel's block: 8 lines of int8, then 16 d (float16) and 16 sums (int16) */
#define Q8_PANEL_GROUP 4

void q8_quantize_rows(const float *x, int64_t M, int64_t K, uint32_t *quads, float *xd, float *xs); /* panel_q4_1.c */
typedef void (*panel_rows)(const void *call, int64_t panel, int64_t row, int64_t rows, int64_t valid);
void panel_blocks(int64_t M, int64_t N, int64_t max_rows, int64_t split_rows, int64_t group, int threads,
                  panel_rows run, const void *call); /* panel_blocks.c */
void panel_store_halves(__m256 low, __m256 high, int64_t valid, const float *bias, float *y); /* panel_blocks.c */

/* One call's operands, for panel_blocks. */
typedef struct {
    const uint32_t *quads;
    const uint32_t *magnitudes; /* AVX2 only: |q_x|, as the quads (vpmaddubsw's unsigned operand) */
    const float *xscale;
    int64_t Kq, blocks;
    const uint8_t *packed;
    int64_t N;
    const float *bias;
    float *y;
} q8_call;

#ifdef __AVX512VNNI__
#define Q8_OFFSET_INPUTS 1 /* vpdpbusd's unsigned operand: the inputs offset by 128 */
#define Q8_MAX_ROWS 12
#define Q8_SPLIT_ROWS 8

/* One block's eight vpdpbusd against R rows: acc[i] = the block's offset sum of row i. */
#define Q8_BLOCK_SUMS(R, acc, w, q)                                                                     \
    {                                                                                                   \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_si512();           \
        _Pragma("GCC unroll 8") for (int j = 0; j < Q8_QUADS; j++) {                                   \
            __m512i line = _mm512_loadu_si512((w) + 64 * j);                                            \
            _Pragma("GCC unroll 12") for (int i = 0; i < R; i++)                                       \
                acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32((int)(q)[i * Kq + j]), line);    \
        }                                                                                               \
    }

/* sum[i] += float(acc[i] - 128 * the block's weight sums) * (d * d_x[i]), for block b (at w). */
#define Q8_BLOCK_SCALE(R, acc, w, b)                                                                    \
    {                                                                                                   \
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((w) + 512)));                    \
        __m512i offset = _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)((w) + 544))), 7); \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) {                                         \
            __m512 s = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i], offset));                            \
            sum[i] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(xscale[i * blocks + (b)])), sum[i]); \
        }                                                                                               \
    }

/* Rows x[0..R) (offset quads, Kq apart; their block scales, `blocks` apart) against one panel, F
 * blocks at a time: a block's eight vpdpbusd are one dependent chain per row, so with few rows the
 * chains of F blocks run side by side. Each block's sum still joins the output in block order, so F
 * changes no result. */
#define Q8_ROWS(R, F)                                                                                   \
    static void q8_rows_##R(const uint32_t *x, const float *xscale, int64_t Kq, int64_t blocks,         \
                            const uint8_t *panel, float *y, int64_t N, int64_t valid, const float *bias) { \
        __m512 sum[R];                                                                                  \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) sum[i] = _mm512_setzero_ps();              \
        int64_t b = 0;                                                                                  \
        for (; b + F <= blocks; b += F) {                                                               \
            __m512i acc[F][R];                                                                          \
            _Pragma("GCC unroll 4") for (int f = 0; f < F; f++)                                        \
                Q8_BLOCK_SUMS(R, acc[f], panel + (b + f) * Q8_BLOCK_BYTES, x + (b + f) * Q8_QUADS)      \
            _Pragma("GCC unroll 4") for (int f = 0; f < F; f++)                                        \
                Q8_BLOCK_SCALE(R, acc[f], panel + (b + f) * Q8_BLOCK_BYTES, b + f)                     \
        }                                                                                               \
        for (; b < blocks; b++) {                                                                       \
            __m512i acc[R];                                                                             \
            Q8_BLOCK_SUMS(R, acc, panel + b * Q8_BLOCK_BYTES, x + b * Q8_QUADS)                         \
            Q8_BLOCK_SCALE(R, acc, panel + b * Q8_BLOCK_BYTES, b)                                       \
        }                                                                                               \
        __mmask16 keep = (__mmask16)((1u << valid) - 1);                                                \
        __m512 bias_ = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();                  \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++)                                           \
            _mm512_mask_storeu_ps(y + i * N, keep, _mm512_add_ps(sum[i], bias_));                      \
    }

/* Blocks in flight by rows: enough independent chains, within the 32 vector registers. */
Q8_ROWS(1, 4) Q8_ROWS(2, 4) Q8_ROWS(3, 2) Q8_ROWS(4, 2) Q8_ROWS(5, 2) Q8_ROWS(6, 2) Q8_ROWS(7, 1) Q8_ROWS(8, 1)
Q8_ROWS(9, 1) Q8_ROWS(10, 1) Q8_ROWS(11, 1) Q8_ROWS(12, 1)

typedef void (*q8_block)(const uint32_t *, const float *, int64_t, int64_t, const uint8_t *, float *, int64_t,
                         int64_t, const float *);
static const q8_block q8_blocks[Q8_MAX_ROWS + 1] = {
    0, q8_rows_1, q8_rows_2, q8_rows_3, q8_rows_4, q8_rows_5, q8_rows_6,
    q8_rows_7, q8_rows_8, q8_rows_9, q8_rows_10, q8_rows_11, q8_rows_12};

static void q8_call_rows(const void *call, int64_t p, int64_t m, int64_t rows, int64_t valid) {
    const q8_call *c = call;
    q8_blocks[rows](c->quads + m * c->Kq, c->xscale + m * c->blocks, c->Kq, c->blocks,
                    c->packed + p * c->blocks * Q8_BLOCK_BYTES, c->y + m * c->N + p * PANEL, c->N, valid,
                    c->bias ? c->bias + p * PANEL : 0);
}


#elif defined(__F16C__)
/* AVX2 (no VNNI): vpmaddubsw needs an unsigned operand, and offset inputs would overflow its int16
 * pair sums, so as llama.cpp does: |q_x| times the weight with q_x's sign (vpsignb), each pair at
 * most 2 * 127 * 127, widened to int32 by vpmaddwd with ones a quad. |q_x| is taken once a call
 * (`magnitudes`), not once a panel. The same exact S_b and the same float32 operations in the same
 * order as the AVX512_VNNI kernel: bitwise its results. */
#define Q8_OFFSET_INPUTS 0
/* Two blocks ahead into L1, as panel_q4_1.c's AVX2 kernel does (docs/decisions/avx2-blocks-prefetch.md). */
#define Q8_PREFETCH_L1 (2 * Q8_BLOCK_BYTES)
#define Q8_MAX_ROWS 4
#define Q8_SPLIT_ROWS 4

/* One panel against R rows in one pass: each line's two halves (features 0-7 and 8-15) side by
 * side, each row's quad and its magnitude broadcast once for both. The loop over a block's quads is
 * unrolled for one row only: unrolled at two, GCC spilled the rows' sums to the stack, and two rows
 * cost more than three (docs/decisions/avx2-blocks-prefetch.md). */
#define Q8_AVX2(R, UNROLL)                                                                              \
    static void q8_rows_##R(const uint32_t *x, const uint32_t *xa, const float *xscale, int64_t Kq,      \
                            int64_t blocks, const uint8_t *panel, float *y, int64_t N, int64_t valid,   \
                            const float *bias) {                                                        \
        const __m256i ones = _mm256_set1_epi16(1);                                                      \
        __m256 sum[R][2];                                                                               \
        for (int i = 0; i < R; i++) sum[i][0] = sum[i][1] = _mm256_setzero_ps();                        \
        for (int64_t b = 0; b < blocks; b++) {                                                          \
            const uint8_t *w = panel + b * Q8_BLOCK_BYTES;                                              \
            const uint32_t *q = x + b * Q8_QUADS, *a = xa + b * Q8_QUADS;                               \
            for (int l = 0; l < Q8_BLOCK_BYTES; l += 64)                                                \
                _mm_prefetch((const char *)w + Q8_PREFETCH_L1 + l, _MM_HINT_T0);                        \
            __m256i acc[R][2];                                                                          \
            for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();                 \
            _Pragma(UNROLL) for (int j = 0; j < Q8_QUADS; j++) {                                        \
                __m256i lines[2] = {_mm256_loadu_si256((const __m256i *)(w + 64 * j)),                  \
                                    _mm256_loadu_si256((const __m256i *)(w + 64 * j + 32))};            \
                for (int i = 0; i < R; i++) {                                                           \
                    __m256i xq = _mm256_set1_epi32((int)q[i * Kq + j]);                                 \
                    __m256i xm = _mm256_set1_epi32((int)a[i * Kq + j]);                                 \
                    for (int h = 0; h < 2; h++)                                                         \
                        acc[i][h] = _mm256_add_epi32(                                                   \
                            acc[i][h],                                                                  \
                            _mm256_madd_epi16(_mm256_maddubs_epi16(xm, _mm256_sign_epi8(lines[h], xq)), ones)); \
                }                                                                                       \
            }                                                                                           \
            for (int h = 0; h < 2; h++) {                                                               \
                __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 512 + 16 * h)));       \
                for (int i = 0; i < R; i++)                                                             \
                    sum[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][h]),                          \
                                                _mm256_mul_ps(d, _mm256_set1_ps(xscale[i * blocks + b])), sum[i][h]); \
            }                                                                                           \
        }                                                                                               \
        for (int i = 0; i < R; i++)                                                                     \
            panel_store_halves(sum[i][0], sum[i][1], valid, bias, y + i * N);                           \
    }

Q8_AVX2(1, "GCC unroll 8") Q8_AVX2(2, "GCC unroll 1") Q8_AVX2(3, "GCC unroll 1") Q8_AVX2(4, "GCC unroll 1")

typedef void (*q8_block)(const uint32_t *, const uint32_t *, const float *, int64_t, int64_t, const uint8_t *, float *,
                         int64_t, int64_t, const float *);
static const q8_block q8_blocks[Q8_MAX_ROWS + 1] = {0, q8_rows_1, q8_rows_2, q8_rows_3, q8_rows_4};

static void q8_call_rows(const void *call, int64_t p, int64_t m, int64_t rows, int64_t valid) {
    const q8_call *c = call;
    q8_blocks[rows](c->quads + m * c->Kq, c->magnitudes + m * c->Kq, c->xscale + m * c->blocks, c->Kq, c->blocks,
                    c->packed + p * c->blocks * Q8_BLOCK_BYTES, c->y + m * c->N + p * PANEL, c->N, valid,
                    c->bias ? c->bias + p * PANEL : 0);
}
#endif

#if defined(__AVX512VNNI__) || defined(__F16C__)
/* y [M, N] = x [M, K] @ W^T (+ bias), W packed as the header says (K a multiple of 32); the bias (or
 * NULL) padded with zeros to the panels' width. Nonzero: K is not a multiple of 32, or no memory
 * for the quantized input. */
int panel_q8_0(const float *x, int64_t M, int64_t K, const uint8_t *packed, int64_t N, const float *bias, float *y,
               int threads) {
    if (K % Q8_BLOCK)
        return -1;
    int64_t Kq = K / 4, blocks = K / Q8_BLOCK;
    int64_t arrays = Q8_OFFSET_INPUTS ? 1 : 2; /* the quads, and on AVX2 their magnitudes */
    uint32_t *quads = malloc((size_t)(arrays * M * Kq) * sizeof(uint32_t) + (size_t)(M * blocks) * sizeof(float));
    if (!quads)
        return 1;
    uint32_t *magnitudes = Q8_OFFSET_INPUTS ? NULL : quads + M * Kq;
    float *xscale = (float *)(quads + arrays * M * Kq);
    q8_quantize_rows(x, M, K, quads, xscale, NULL);
#if Q8_OFFSET_INPUTS
    for (int64_t i = 0; i < M * Kq; i++) /* each byte offset by 128: flipping its sign bit adds 128 */
        quads[i] ^= 0x80808080u;
#else
    for (int64_t i = 0; i < M * Kq; i += 8) /* Kq is a multiple of 8 */
        _mm256_storeu_si256((__m256i *)(magnitudes + i), _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(quads + i))));
#endif
    q8_call call = {quads, magnitudes, xscale, Kq, blocks, packed, N, bias, y};
    panel_blocks(M, N, Q8_MAX_ROWS, Q8_SPLIT_ROWS, Q8_PANEL_GROUP, threads, q8_call_rows, &call);
    free(quads);
    return 0;
}
#endif
