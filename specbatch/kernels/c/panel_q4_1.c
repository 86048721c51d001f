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

/* ---- The same blocks and the same sums on AVX2 and FMA (any x86-64 CPU the kernels build for) -----
 *
 * Why: a CPU without AVX512_BF16 (an AVX2-only EPYC) otherwise reads bf16 weights, 16 bits a weight
 * against Q4_1's 5, at the few rows of a decode step where the weights' stream bounds the step.
 *
 * Bitwise the kernel above: vdpbf16ps adds a pair's two products to its lane one after the other,
 * the odd input feature's first, each rounded to float32 (to nearest even, denormals flushed); a
 * product of a bf16 input and 128 + q is exact in float32, so one FMA per product, in that order,
 * gives the same sums. The input is rounded to bf16 as vcvtneps2bf16 rounds it (bf16_round below),
 * and a row's block sums repeat the instruction's pair sums and _mm512_reduce_add_ps's tree. So the
 * q4_1 form is one model on every CPU (tests/test_native.py compares the two kernels).
 *
 * Layout: panel_q4_1's, read 8 output features at a time (a 256-bit half of each 64-byte line):
 * the 32-bit word of feature n holds, from its low nibble up, the even input features of the
 * line's four pairs, then the odd ones; a shift puts one nibble at bits 16-19, and with the
 * exponent of 128.0 around it the word is the float32 number 128 + q. Rows run in blocks of up to
 * four (AVX2's 16 registers: a row holds a block's part and its sum). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define Q4F_PANEL 16
#define Q4F_BLOCK 32
#define Q4F_BLOCK_BYTES 320
#define Q4F_MAX_ROWS 4
#define Q4F_PANEL_GROUP 4

typedef void (*panel_rows_fn)(const void *call, int64_t panel, int64_t row, int64_t rows, int64_t valid);
void panel_blocks(int64_t M, int64_t N, int64_t max_rows, int64_t split_rows, int64_t group, int threads,
                  panel_rows_fn run, const void *call); /* panel_blocks.c */

/* x rounded to bf16 as vcvtneps2bf16 does (nearest even; a denormal becomes a zero of its sign; a
 * NaN stays a quiet NaN), returned as the float32 number it is. */
static inline float bf16_round(float x) {
    union { float f; uint32_t u; } v = {x};
    if ((v.u & 0x7F800000u) == 0)
        v.u &= 0x80000000u;
    else if ((v.u & 0x7FFFFFFFu) > 0x7F800000u)
        v.u = (v.u | 0x00400000u) & 0xFFFF0000u;
    else
        v.u = (v.u + 0x7FFFu + ((v.u >> 16) & 1u)) & 0xFFFF0000u;
    return v.f;
}

/* A row's sum over one block of 32 rounded inputs, as panel_q4_1 computes it: vdpbf16ps against
 * ones (lane j: 0 + x[2j + 1], then + x[2j]), then _mm512_reduce_add_ps's tree (the upper eight
 * lanes onto the lower, then four, then the pairs (0, 2) and (1, 3), then the two). */
static float q4f_block_sum(const float *x) {
    float lane[16], t8[8], t4[4];
    for (int j = 0; j < 16; j++) {
        float t = 0.0f + x[2 * j + 1];
        lane[j] = t + x[2 * j];
    }
    for (int i = 0; i < 8; i++) t8[i] = lane[i + 8] + lane[i];
    for (int i = 0; i < 4; i++) t4[i] = t8[i + 4] + t8[i];
    return (t4[2] + t4[0]) + (t4[3] + t4[1]);
}

/* One block's 32 products of R rows into part[0..R), in pair order, the odd feature first: 8 output
 * features (half h of the panel) at w, the rows' rounded inputs at xb, K apart. */
#define Q4F_BLOCK_TERMS(R, part, w, xb)                                                                 \
    for (int g = 0; g < 4; g++) {                                                                       \
        _Pragma("GCC unroll 4") for (int s = 0; s < 4; s++) {                                          \
            __m256i line = _mm256_loadu_si256((const __m256i *)((w) + 64 * g + 32 * h));                \
            int k = 8 * g + 2 * s; /* pair 4g + s: input features k (even) and k + 1 */                 \
            __m256 odd = _mm256_castsi256_ps(                                                           \
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(line, 4 * s), field), exponent));    \
            __m256 even = _mm256_castsi256_ps(                                                          \
                _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(line, 16 - 4 * s), field), exponent)); \
            _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {                                      \
                part[i] = _mm256_fmadd_ps(odd, _mm256_broadcast_ss((xb) + i * K + k + 1), part[i]);     \
                part[i] = _mm256_fmadd_ps(even, _mm256_broadcast_ss((xb) + i * K + k), part[i]);        \
            }                                                                                           \
        }                                                                                               \
    }

/* sum[i] += d * part[i] + (m - 128 d) * X, block b's scales (after its nibbles at w). */
#define Q4F_BLOCK_SCALE(R, part, w, b)                                                                  \
    {                                                                                                   \
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((w) + 256 + 16 * h)));             \
        __m256 shift = _mm256_fnmadd_ps(offset, d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((w) + 288 + 16 * h)))); \
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {                                          \
            sum[i] = _mm256_fmadd_ps(part[i], d, sum[i]);                                               \
            sum[i] = _mm256_fmadd_ps(shift, _mm256_broadcast_ss(xsum + i * blocks + (b)), sum[i]);      \
        }                                                                                               \
    }

/* Rows x[0..R) (rounded inputs, K apart; their block sums, `blocks` apart) against 8 output features
 * (half h of a panel), F blocks at a time: a block's 32 products are one chain of dependent FMAs, so
 * with few rows the chains of F blocks run side by side. Each block's part starts from zero and
 * joins sum in block order, so F changes no result. */
#define Q4F_ROWS(R, F)                                                                                  \
    static void q4f_rows_##R(const float *x, const float *xsum, int64_t K, int64_t blocks,             \
                             const uint8_t *panel, int h, float *y, int64_t N, int64_t valid,           \
                             const float *bias) {                                                       \
        const __m256i field = _mm256_set1_epi32(0x000F0000), exponent = _mm256_set1_epi32(0x43000000); \
        const __m256 offset = _mm256_set1_ps(128.0f);                                                   \
        __m256 sum[R];                                                                                  \
        for (int i = 0; i < R; i++) sum[i] = _mm256_setzero_ps();                                       \
        int64_t b = 0;                                                                                  \
        for (; b + F <= blocks; b += F) {                                                               \
            __m256 part[F][R];                                                                          \
            _Pragma("GCC unroll 4") for (int f = 0; f < F; f++) {                                      \
                for (int i = 0; i < R; i++) part[f][i] = _mm256_setzero_ps();                           \
                Q4F_BLOCK_TERMS(R, part[f], panel + (b + f) * Q4F_BLOCK_BYTES, x + (b + f) * Q4F_BLOCK) \
            }                                                                                           \
            _Pragma("GCC unroll 4") for (int f = 0; f < F; f++)                                        \
                Q4F_BLOCK_SCALE(R, part[f], panel + (b + f) * Q4F_BLOCK_BYTES, b + f)                  \
        }                                                                                               \
        for (; b < blocks; b++) {                                                                       \
            __m256 part[R];                                                                             \
            for (int i = 0; i < R; i++) part[i] = _mm256_setzero_ps();                                  \
            Q4F_BLOCK_TERMS(R, part, panel + b * Q4F_BLOCK_BYTES, x + b * Q4F_BLOCK)                    \
            Q4F_BLOCK_SCALE(R, part, panel + b * Q4F_BLOCK_BYTES, b)                                    \
        }                                                                                               \
        int64_t here = valid - 8 * h < 8 ? valid - 8 * h : 8;                                           \
        __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)here), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); \
        __m256 bias_ = bias ? _mm256_maskload_ps(bias + 8 * h, keep) : _mm256_setzero_ps();           \
        for (int i = 0; i < R; i++)                                                                     \
            _mm256_maskstore_ps(y + i * N + 8 * h, keep, _mm256_add_ps(sum[i], bias_));                 \
    }

Q4F_ROWS(1, 6) Q4F_ROWS(2, 3) Q4F_ROWS(3, 2) Q4F_ROWS(4, 1)

typedef void (*q4f_block)(const float *, const float *, int64_t, int64_t, const uint8_t *, int, float *, int64_t,
                          int64_t, const float *);
static const q4f_block q4f_blocks[Q4F_MAX_ROWS + 1] = {0, q4f_rows_1, q4f_rows_2, q4f_rows_3, q4f_rows_4};

typedef struct {
    const float *x, *xsum;
    int64_t K, blocks;
    const uint8_t *packed;
    int64_t N;
    const float *bias;
    float *y;
} q4f_call;

static void q4f_call_rows(const void *call, int64_t p, int64_t m, int64_t rows, int64_t valid) {
    const q4f_call *c = call;
    for (int h = 0; h < 2 && 8 * h < valid; h++)
        q4f_blocks[rows](c->x + m * c->K, c->xsum + m * c->blocks, c->K, c->blocks,
                         c->packed + p * c->blocks * Q4F_BLOCK_BYTES, h, c->y + m * c->N + p * Q4F_PANEL, c->N,
                         valid, c->bias ? c->bias + p * Q4F_PANEL : 0);
}

/* panel_q4_1's multiply on AVX2 and FMA: the same arguments, the same packed weights, the same bits.
 * Nonzero: K is not a multiple of 32, or no memory for the rounded input. */
int panel_q4_1_fma(const float *x, int64_t M, int64_t K, const uint8_t *packed, int64_t N, const float *bias,
                   float *y, int threads) {
    if (K % Q4F_BLOCK)
        return -1;
    int64_t blocks = K / Q4F_BLOCK;
    float *rounded = malloc((size_t)(M * K + M * blocks) * sizeof(float));
    if (!rounded)
        return 1;
    float *xsum = rounded + M * K;
    for (int64_t i = 0; i < M * K; i++) rounded[i] = bf16_round(x[i]);
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < blocks; b++) xsum[m * blocks + b] = q4f_block_sum(rounded + m * K + b * Q4F_BLOCK);
    q4f_call call = {rounded, xsum, K, blocks, packed, N, bias, y};
    panel_blocks(M, N, Q4F_MAX_ROWS, Q4F_MAX_ROWS, Q4F_PANEL_GROUP, threads, q4f_call_rows, &call);
    free(rounded);
    return 0;
}
