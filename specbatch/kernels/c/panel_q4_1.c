/* y = x @ W^T (+ bias) with W in GGUF's Q4_1 blocks (each 32 input features of an output feature
 * n: w = d * q + m, q a 4-bit integer, d and m float16) and each input row rounded to bf16, the
 * products summed in float32 by AVX512_BF16's dot-product instruction (vdpbf16ps). Compiled only
 * where the CPU has AVX512_BF16 (specbatch.native.bf16_dot_available()).
 *
 * Why: a step at the few rows of a decode or verify reads every weight once and waits on memory
 * (panel_dpbf16.c: SmolLM2's layers are 212 MB of bf16 a step). The
 * embedded model's layers are Q4_1 in its GGUF file: 5 bits a weight here (nibbles, and each
 * block's d and m), under a third of bf16's bytes. The weights are the file's own values, not a
 * bf16 rounding of them; only the input is rounded, as with bf16 dot products.
 *
 * Arithmetic: a nibble q becomes the bf16 number 128 + q by setting the 16-bit word around it to
 * 0x4300 | q (bf16 0x4300 is 128.0; the low 7 bits are the mantissa): a shift and one ternary
 * logic instruction for 32 weights. So sum_k w_k x_k over a block = d * sum_k (128 + q_k) x_k +
 * (m - 128 d) * sum_k x_k: one vdpbf16ps per pair of input features per row, then two
 * multiply-adds per block and row. The products (128 + q) x are exact in float32; a row's input
 * sum over each block is computed once a call.
 *
 * Layout: W [N, K] (K a multiple of 32) in panels of 16 output features, each panel [K / 32][320
 * bytes]: four 64-byte lines of nibbles, then the 16 features' d, then their m (float16). Line g
 * is 32 16-bit words; word j holds, from its low nibble up, word j (feature j / 2, input feature
 * j % 2 of the pair) of pairs 4g, 4g+1, 4g+2 and 4g+3 of the block, so a shift by 0, 4, 8 or 12
 * and a mask give the operand of one vdpbf16ps (specbatch.native.PanelLinear packs them so).
 *
 * Cost: one row reads 66 MB instead of 212, so a one-row step is far cheaper than bf16 dot products
 * on the same weights; from two rows on each row adds its 16 vdpbf16ps per 512 weights plus the
 * unpacking, where bf16 dot products hide theirs under the weights' stream up to ~8 rows, so the
 * two come close from about eight rows on (docs/decisions/weights-auto.md). No software prefetch:
 * panel_dpbf16.c's prefetches made one row slower here, not faster.
 *
 * Blocks of rows: as panel_dpbf16.c, up to 12 rows in one block (the nibbles are unpacked once for
 * the block's rows), more in blocks of at most 8.
 *
 * Exactness: each output is sum over blocks b = 0, 1, ... of d_b * S_b + (m_b - 128 d_b) * X_b, in
 * that order, S_b the block's 16 vdpbf16ps terms in order and X_b the row's own input sum: never
 * dependent on the other rows, their block or the thread (row-exact), so speculation on it stays
 * bitwise exact.
 */
#ifdef __AVX512BF16__
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define PANEL 16
#define Q4_BLOCK 32        /* input features a d and m cover (GGUF's QK4_1) */
#define Q4_PAIRS 16        /* bf16 pairs of input features a block holds */
#define Q4_BLOCK_BYTES 320 /* a panel's block: 4 lines of nibbles, then 16 d and 16 m (float16) */
#define Q4_MAX_ROWS 12
#define Q4_SPLIT_ROWS 8
#define Q4_PANEL_GROUP 4

void bf16_round_to_pairs(const float *x, int64_t M, int64_t K, int64_t Kp, uint32_t *pairs); /* panel_dpbf16.c */
typedef void (*panel_rows)(const void *call, int64_t panel, int64_t row, int64_t rows, int64_t valid);
void panel_blocks(int64_t M, int64_t N, int64_t max_rows, int64_t split_rows, int64_t group, int threads,
                  panel_rows run, const void *call); /* panel_blocks.c */

/* One block of a panel's weights unpacked against R rows: part[i] += the block's 16 vdpbf16ps terms
 * of row i, pair by pair in order. */
#define Q4_BLOCK_TERMS(R, part, w, pair)                                                                \
    _Pragma("GCC unroll 4") for (int g = 0; g < 4; g++) {                                              \
        __m512i line = _mm512_loadu_si512((w) + 64 * g);                                                \
        __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(line, nibble, exponent, 0xEA);                \
        __m512bh w1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(line, 4), nibble, exponent, 0xEA); \
        __m512bh w2 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(line, 8), nibble, exponent, 0xEA); \
        __m512bh w3 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(line, 12), exponent);                 \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) {                                         \
            const uint32_t *p = (pair) + i * Kp + 4 * g;                                                \
            part[i] = _mm512_dpbf16_ps(part[i], (__m512bh)_mm512_set1_epi32((int)p[0]), w0);            \
            part[i] = _mm512_dpbf16_ps(part[i], (__m512bh)_mm512_set1_epi32((int)p[1]), w1);            \
            part[i] = _mm512_dpbf16_ps(part[i], (__m512bh)_mm512_set1_epi32((int)p[2]), w2);            \
            part[i] = _mm512_dpbf16_ps(part[i], (__m512bh)_mm512_set1_epi32((int)p[3]), w3);            \
        }                                                                                               \
    }

/* sum[i] += d * part[i] + (m - 128 d) * X, for block b's scales (after its nibbles at w). */
#define Q4_BLOCK_SCALE(R, part, w, b)                                                                   \
    {                                                                                                   \
        __m512i scales = _mm512_loadu_si512((w) + 256);                                                 \
        __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(scales));                                     \
        __m512 shift = _mm512_fnmadd_ps(offset, d, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(scales, 1))); \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) {                                         \
            sum[i] = _mm512_fmadd_ps(part[i], d, sum[i]);                                               \
            sum[i] = _mm512_fmadd_ps(shift, _mm512_set1_ps(xsum[i * blocks + (b)]), sum[i]);            \
        }                                                                                               \
    }

/* Rows x[0..R) (bf16 pairs, Kp apart; their block sums, `blocks` apart) against one panel, F blocks
 * at a time: a block's 16 terms are one chain of dependent vdpbf16ps, so with few rows the chains of
 * F blocks run side by side (with one block at a time the instruction's latency, not the weights'
 * stream, bounded one row). Each block's part still starts from zero and joins sum in block order,
 * so F changes no result. */
#define Q4_ROWS(R, F)                                                                                   \
    static void q4_rows_##R(const uint32_t *x, const float *xsum, int64_t Kp, int64_t blocks,           \
                            const uint8_t *panel, float *y, int64_t N, int64_t valid, const float *bias) { \
        const __m512i nibble = _mm512_set1_epi16(0x000F), exponent = _mm512_set1_epi16(0x4300);              \
        const __m512 offset = _mm512_set1_ps(128.0f);                                                   \
        __m512 sum[R];                                                                                  \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) sum[i] = _mm512_setzero_ps();              \
        int64_t b = 0;                                                                                  \
        for (; b + F <= blocks; b += F) {                                                               \
            __m512 part[F][R];                                                                          \
            _Pragma("GCC unroll 4") for (int f = 0; f < F; f++) {                                      \
                _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) part[f][i] = _mm512_setzero_ps();  \
                Q4_BLOCK_TERMS(R, part[f], panel + (b + f) * Q4_BLOCK_BYTES, x + (b + f) * Q4_PAIRS)    \
            }                                                                                           \
            _Pragma("GCC unroll 4") for (int f = 0; f < F; f++)                                        \
                Q4_BLOCK_SCALE(R, part[f], panel + (b + f) * Q4_BLOCK_BYTES, b + f)                    \
        }                                                                                               \
        for (; b < blocks; b++) {                                                                       \
            __m512 part[R];                                                                             \
            _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) part[i] = _mm512_setzero_ps();         \
            Q4_BLOCK_TERMS(R, part, panel + b * Q4_BLOCK_BYTES, x + b * Q4_PAIRS)                       \
            Q4_BLOCK_SCALE(R, part, panel + b * Q4_BLOCK_BYTES, b)                                      \
        }                                                                                               \
        __mmask16 keep = (__mmask16)((1u << valid) - 1);                                                \
        __m512 bias_ = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();                              \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++)                                           \
            _mm512_mask_storeu_ps(y + i * N, keep, _mm512_add_ps(sum[i], bias_));                      \
    }

/* Blocks in flight by rows: enough independent chains, within the 32 vector registers. */
Q4_ROWS(1, 4) Q4_ROWS(2, 4) Q4_ROWS(3, 4) Q4_ROWS(4, 2) Q4_ROWS(5, 2) Q4_ROWS(6, 2) Q4_ROWS(7, 1) Q4_ROWS(8, 1)
Q4_ROWS(9, 1) Q4_ROWS(10, 1) Q4_ROWS(11, 1) Q4_ROWS(12, 1)

typedef void (*q4_block)(const uint32_t *, const float *, int64_t, int64_t, const uint8_t *, float *, int64_t,
                         int64_t, const float *);
static const q4_block q4_blocks[Q4_MAX_ROWS + 1] = {
    0, q4_rows_1, q4_rows_2, q4_rows_3, q4_rows_4, q4_rows_5, q4_rows_6,
    q4_rows_7, q4_rows_8, q4_rows_9, q4_rows_10, q4_rows_11, q4_rows_12};

/* One call's operands, for panel_blocks. */
typedef struct {
    const uint32_t *pairs;
    const float *xsum;
    int64_t Kp, blocks;
    const uint8_t *packed;
    int64_t N;
    const float *bias;
    float *y;
} q4_call;

static void q4_call_rows(const void *call, int64_t p, int64_t m, int64_t rows, int64_t valid) {
    const q4_call *c = call;
    q4_blocks[rows](c->pairs + m * c->Kp, c->xsum + m * c->blocks, c->Kp, c->blocks,
                    c->packed + p * c->blocks * Q4_BLOCK_BYTES, c->y + m * c->N + p * PANEL, c->N, valid,
                    c->bias ? c->bias + p * PANEL : 0);
}

/* y [M, N] = x [M, K] @ W^T (+ bias), W packed as the header says (K a multiple of 32); the bias (or
 * NULL) padded with zeros to the panels' width. Nonzero: K is not a multiple of 32, or no memory
 * for the input's bf16 copy. */
int panel_q4_1(const float *x, int64_t M, int64_t K, const uint8_t *packed, int64_t N, const float *bias, float *y,
               int threads) {
    if (K % Q4_BLOCK)
        return -1;
    int64_t Kp = K / 2, blocks = K / Q4_BLOCK;
    uint32_t *pairs = malloc((size_t)(M * Kp) * sizeof(uint32_t) + (size_t)(M * blocks) * sizeof(float));
    if (!pairs)
        return 1;
    float *xsum = (float *)(pairs + M * Kp);
    bf16_round_to_pairs(x, M, K, Kp, pairs);
    /* Each row's input sum over each block, of the rounded values: 16 pair sums, then a fixed tree. */
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < blocks; b++) {
            __m512bh line = (__m512bh)_mm512_loadu_si512(pairs + m * Kp + b * Q4_PAIRS);
            xsum[m * blocks + b] = _mm512_reduce_add_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), line, ones));
        }
    q4_call call = {pairs, xsum, Kp, blocks, packed, N, bias, y};
    panel_blocks(M, N, Q4_MAX_ROWS, Q4_SPLIT_ROWS, Q4_PANEL_GROUP, threads, q4_call_rows, &call);
    free(pairs);
    return 0;
}
#endif
