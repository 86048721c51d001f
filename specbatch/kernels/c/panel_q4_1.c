/* y = x @ W^T (+ bias) with W in GGUF's Q4_1 blocks (each 32 input features of an output feature
 * n: w = d * q + m, q a 4-bit integer, d and m float16) and each input row quantized to Q8_1 blocks
 * of its own (per block of 32: d_x = max|x| / 127, q_x = round(x / d_x), and s_x = d_x * sum q_x),
 * the products summed exactly in int32 by AVX512_VNNI's vpdpbusd: llama.cpp's own Q4_1 x Q8_1 dot
 * product. Without AVX512_VNNI the same sums by AVX2's vpmaddubsw (below), with bitwise the same
 * results (specbatch.kernels.build.blocks_available()).
 *
 * Why: a step at the few rows of a decode or verify reads every weight once and waits on memory; the
 * embedded model's layers are Q4_1 in its GGUF file, 5 bits a weight here (nibbles, and each block's
 * d and m), under a third of bf16's bytes. The weights are the file's own values. Each further row
 * of a call costs its own arithmetic: one vpdpbusd sums 64 products (16 features x 4 inputs), twice
 * bf16 dot products' 32, so the rows of a verify step, a prefill and a batch cost less
 * (docs/decisions/weights-auto.md). Prefetched ahead on AVX2 (below).
 *
 * Arithmetic: the nibbles q (0..15) are the unsigned operand of vpdpbusd as they are, the quantized
 * inputs q_x (-127..127) its signed operand, so S_b = sum_k q_k q_x,k is exact. Then sum_k w_k x_k
 * over a block is d_x (d S_b + m sum_k q_x,k) = float(S_b) * (d * d_x) + m * s_x: two fused
 * multiply-adds a block and row.
 *
 * Layout: W [N, K] (K a multiple of 32) in panels of 16 output features, each panel [K / 32][320
 * bytes]: four 64-byte lines of nibbles, then the 16 features' d, then their m (float16). Byte 4 f +
 * t of line g holds, in its low nibble, feature f's q of input feature 8 g + t, and in its high
 * nibble that of input feature 8 g + 4 + t: a mask, or a shift and a mask, gives the unsigned
 * operand of one vpdpbusd (specbatch.kernels.panel.PanelLinear packs them so).
 *
 * Blocks of rows: up to 12 rows in one block (the nibbles are unpacked once for the block's rows),
 * more in blocks of at most 8 (panel_blocks.c); on AVX2 up to 6 (below).
 *
 * Exactness: each output is sum over blocks b = 0, 1, ... of float(S_b) * (d_b * d_x,b), then
 * + m_b * s_x,b, in that order, from the row's own quantized input: never dependent on the other
 * rows, their block or the thread (row-exact), so speculation on it stays bitwise exact.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define PANEL 16
#define Q4_BLOCK 32        /* input features a d and m cover (GGUF's QK4_1) */
#define Q4_QUADS 8         /* quads of input features a block holds: one vpdpbusd each */
#define Q4_BLOCK_BYTES 320 /* a panel's block: 4 lines of nibbles, then 16 d and 16 m (float16) */
#define Q4_PANEL_GROUP 4

typedef void (*panel_rows)(const void *call, int64_t panel, int64_t row, int64_t rows, int64_t valid);
void panel_blocks(int64_t M, int64_t N, int64_t max_rows, int64_t split_rows, int64_t group, int threads,
                  panel_rows run, const void *call); /* panel_blocks.c */
void panel_store_halves(__m256 low, __m256 high, int64_t valid, const float *bias, float *y); /* panel_blocks.c */

/* One call's operands, for panel_blocks. */
typedef struct {
    const uint32_t *quads;
    const float *xd, *xs;
    int64_t Kq, blocks;
    const uint8_t *packed;
    int64_t N;
    const float *bias;
    float *y;
} q4_call;

#ifdef __AVX512VNNI__
#define Q4_MAX_ROWS 12
#define Q4_SPLIT_ROWS 8

/* One block's eight vpdpbusd against R rows (quantized quads q, Kq apart): acc[i] = S_b of row i. */
#define Q4_BLOCK_SUMS(R, acc, w, q)                                                                     \
    {                                                                                                   \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_si512();           \
        _Pragma("GCC unroll 4") for (int g = 0; g < 4; g++) {                                          \
            __m512i line = _mm512_loadu_si512((w) + 64 * g);                                            \
            __m512i low = _mm512_and_si512(line, nibble);                                               \
            __m512i high = _mm512_and_si512(_mm512_srli_epi16(line, 4), nibble);                        \
            _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) {                                     \
                acc[i] = _mm512_dpbusd_epi32(acc[i], low, _mm512_set1_epi32((int)(q)[i * Kq + 2 * g]));  \
                acc[i] = _mm512_dpbusd_epi32(acc[i], high, _mm512_set1_epi32((int)(q)[i * Kq + 2 * g + 1])); \
            }                                                                                           \
        }                                                                                               \
    }

/* sum[i] += float(S_b) * (d * d_x[i]), then += m * s_x[i], for block b (its nibbles at w). */
#define Q4_BLOCK_SCALE(R, acc, w, b)                                                                    \
    {                                                                                                   \
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((w) + 256)));                    \
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((w) + 288)));                    \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) {                                         \
            __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xd[i * blocks + (b)]));                      \
            sum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), scale, sum[i]);                        \
            sum[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[i * blocks + (b)]), sum[i]);                  \
        }                                                                                               \
    }

/* Rows x[0..R) (quantized quads, Kq apart; their d_x and s_x, `blocks` apart) against one panel, F
 * blocks at a time: a block's eight vpdpbusd are one dependent chain per row, so with few rows the
 * chains of F blocks run side by side. Each block's terms still join the sum in block order, so F
 * changes no result. */
#define Q4_ROWS(R, F)                                                                                   \
    static void q4_rows_##R(const uint32_t *x, const float *xd, const float *xs, int64_t Kq, int64_t blocks, \
                            const uint8_t *panel, float *y, int64_t N, int64_t valid, const float *bias) { \
        const __m512i nibble = _mm512_set1_epi8(0x0F);                                                  \
        __m512 sum[R];                                                                                  \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) sum[i] = _mm512_setzero_ps();              \
        int64_t b = 0;                                                                                  \
        for (; b + F <= blocks; b += F) {                                                               \
            __m512i acc[F][R];                                                                          \
            _Pragma("GCC unroll 4") for (int f = 0; f < F; f++)                                        \
                Q4_BLOCK_SUMS(R, acc[f], panel + (b + f) * Q4_BLOCK_BYTES, x + (b + f) * Q4_QUADS)      \
            _Pragma("GCC unroll 4") for (int f = 0; f < F; f++)                                        \
                Q4_BLOCK_SCALE(R, acc[f], panel + (b + f) * Q4_BLOCK_BYTES, b + f)                     \
        }                                                                                               \
        for (; b < blocks; b++) {                                                                       \
            __m512i acc[R];                                                                             \
            Q4_BLOCK_SUMS(R, acc, panel + b * Q4_BLOCK_BYTES, x + b * Q4_QUADS)                         \
            Q4_BLOCK_SCALE(R, acc, panel + b * Q4_BLOCK_BYTES, b)                                       \
        }                                                                                               \
        __mmask16 keep = (__mmask16)((1u << valid) - 1);                                                \
        __m512 bias_ = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();                  \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++)                                           \
            _mm512_mask_storeu_ps(y + i * N, keep, _mm512_add_ps(sum[i], bias_));                      \
    }

/* Blocks in flight by rows: enough independent chains, within the 32 vector registers. */
Q4_ROWS(1, 4) Q4_ROWS(2, 4) Q4_ROWS(3, 2) Q4_ROWS(4, 2) Q4_ROWS(5, 2) Q4_ROWS(6, 2) Q4_ROWS(7, 1) Q4_ROWS(8, 1)
Q4_ROWS(9, 1) Q4_ROWS(10, 1) Q4_ROWS(11, 1) Q4_ROWS(12, 1)

typedef void (*q4_block)(const uint32_t *, const float *, const float *, int64_t, int64_t, const uint8_t *, float *,
                         int64_t, int64_t, const float *);
static const q4_block q4_blocks[Q4_MAX_ROWS + 1] = {
    0, q4_rows_1, q4_rows_2, q4_rows_3, q4_rows_4, q4_rows_5, q4_rows_6,
    q4_rows_7, q4_rows_8, q4_rows_9, q4_rows_10, q4_rows_11, q4_rows_12};


static void q4_call_rows(const void *call, int64_t p, int64_t m, int64_t rows, int64_t valid) {
    const q4_call *c = call;
    q4_blocks[rows](c->quads + m * c->Kq, c->xd + m * c->blocks, c->xs + m * c->blocks, c->Kq, c->blocks,
                    c->packed + p * c->blocks * Q4_BLOCK_BYTES, c->y + m * c->N + p * PANEL, c->N, valid,
                    c->bias ? c->bias + p * PANEL : 0);
}

/* Each row's blocks of 32 quantized as llama.cpp's Q8_0 and Q8_1 do it: d_x = max|x| / 127 in
 * float32, q_x = x * (1 / d_x) rounded to nearest even (d_x = 0 and q_x = 0 for a block of zeros),
 * stored as signed bytes in quads; and, where `xs` is not NULL, s_x = d_x * sum q_x (Q8_1's).
 * Shared with panel_q8_0.c. */
void q8_quantize_rows(const float *x, int64_t M, int64_t K, uint32_t *quads, float *xd, float *xs) {
    int64_t blocks = K / Q4_BLOCK;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *v = x + m * K + b * Q4_BLOCK;
            __m512 lo = _mm512_loadu_ps(v), hi = _mm512_loadu_ps(v + 16);
            float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            float d = largest / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
            __m512 scale = _mm512_set1_ps(inverse);
            __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, scale));
            __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, scale));
            int8_t *out = (int8_t *)(quads + m * (K / 4) + b * Q4_QUADS);
            _mm_storeu_si128((__m128i *)out, _mm512_cvtsepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtsepi32_epi8(qhi));
            xd[m * blocks + b] = d;
            if (xs)
                xs[m * blocks + b] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        }
}

#elif defined(__F16C__)
/* AVX2 (no VNNI): the same integer sums by vpmaddubsw (pairs of unsigned nibble x signed input,
 * each at most 2 * 15 * 127 in magnitude, so the eight of a block add up in int16 without
 * overflow) and one vpmaddwd with ones a block; then the same float32 operations in the same
 * order, so the results are bitwise the AVX512_VNNI kernel's. A panel's 16 features are two
 * halves of eight in one pass over the panel, so each line is read once and each row's quads are
 * broadcast once for both (two passes, the second from the cache, were slower). Up to six rows a
 * block: five or six rows in one block beat two blocks of them by an eighth; blocks of eight
 * spilled registers and gained nothing. Each product joins its row's int16 sum as it comes (at most
 * eight of 2 * 15 * 127 a block: no overflow, so the order of the integer adds moves no result). */
#define Q4_MAX_ROWS 6
#define Q4_SPLIT_ROWS 6
/* How far ahead of the block it multiplies the AVX2 kernel prefetches into L1: about three blocks.
 * A one-row step waits on memory, and between the layers' short streams the hardware prefetchers
 * alone left lines still on their way (benchmarks: docs/decisions/avx2-blocks-prefetch.md). A
 * prefetch moves no result. */
#define Q4_PREFETCH_L1 1024

/* One panel against R rows in one pass: each line's two halves (features 0-7 and 8-15) side by
 * side, each row's quad broadcast once for both. */
#define Q4_AVX2(R)                                                                                      \
    static void q4_rows_##R(const uint32_t *x, const float *xd, const float *xs, int64_t Kq, int64_t blocks, \
                            const uint8_t *panel, float *y, int64_t N, int64_t valid, const float *bias) { \
        const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);                      \
        __m256 sum[R][2];                                                                               \
        for (int i = 0; i < R; i++) sum[i][0] = sum[i][1] = _mm256_setzero_ps();                        \
        for (int64_t b = 0; b < blocks; b++) {                                                          \
            const uint8_t *w = panel + b * Q4_BLOCK_BYTES;                                              \
            const uint32_t *q = x + b * Q4_QUADS;                                                       \
            for (int l = 0; l < Q4_BLOCK_BYTES; l += 64)                                                \
                _mm_prefetch((const char *)w + Q4_PREFETCH_L1 + l, _MM_HINT_T0);                        \
            __m256i acc[R][2];                                                                          \
            for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();                 \
            /* Not unrolled: unrolled, GCC hoisted every line's unpacking and spilled it. */            \
            _Pragma("GCC unroll 1") for (int g = 0; g < 4; g++)                                         \
                for (int h = 0; h < 2; h++) {                                                           \
                    __m256i line = _mm256_loadu_si256((const __m256i *)(w + 64 * g + 32 * h));          \
                    __m256i low = _mm256_and_si256(line, nibble);                                       \
                    __m256i high = _mm256_and_si256(_mm256_srli_epi16(line, 4), nibble);                \
                    for (int i = 0; i < R; i++) {                                                       \
                        acc[i][h] = _mm256_add_epi16(acc[i][h],                                         \
                            _mm256_maddubs_epi16(low, _mm256_set1_epi32((int)q[i * Kq + 2 * g])));      \
                        acc[i][h] = _mm256_add_epi16(acc[i][h],                                         \
                            _mm256_maddubs_epi16(high, _mm256_set1_epi32((int)q[i * Kq + 2 * g + 1]))); \
                    }                                                                                   \
                }                                                                                       \
            for (int h = 0; h < 2; h++) {                                                               \
                __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 256 + 16 * h)));       \
                __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 288 + 16 * h)));       \
                for (int i = 0; i < R; i++) {                                                           \
                    __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xd[i * blocks + b]));                \
                    sum[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(acc[i][h], ones)), scale, \
                                                sum[i][h]);                                             \
                    sum[i][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[i * blocks + b]), sum[i][h]);      \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        for (int i = 0; i < R; i++)                                                                     \
            panel_store_halves(sum[i][0], sum[i][1], valid, bias, y + i * N);                           \
    }

Q4_AVX2(1) Q4_AVX2(2) Q4_AVX2(3) Q4_AVX2(4) Q4_AVX2(5) Q4_AVX2(6)

typedef void (*q4_block)(const uint32_t *, const float *, const float *, int64_t, int64_t, const uint8_t *, float *,
                         int64_t, int64_t, const float *);
static const q4_block q4_blocks[Q4_MAX_ROWS + 1] = {0, q4_rows_1, q4_rows_2, q4_rows_3, q4_rows_4, q4_rows_5, q4_rows_6};

static void q4_call_rows(const void *call, int64_t p, int64_t m, int64_t rows, int64_t valid) {
    const q4_call *c = call;
    q4_blocks[rows](c->quads + m * c->Kq, c->xd + m * c->blocks, c->xs + m * c->blocks, c->Kq, c->blocks,
                    c->packed + p * c->blocks * Q4_BLOCK_BYTES, c->y + m * c->N + p * PANEL, c->N, valid,
                    c->bias ? c->bias + p * PANEL : 0);
}

/* As the AVX-512 quantizer: the same float32 operations, element by element. */
void q8_quantize_rows(const float *x, int64_t M, int64_t K, uint32_t *quads, float *xd, float *xs) {
    int64_t blocks = K / Q4_BLOCK;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *v = x + m * K + b * Q4_BLOCK;
            __m256 a0 = _mm256_loadu_ps(v), a1 = _mm256_loadu_ps(v + 8), a2 = _mm256_loadu_ps(v + 16),
                   a3 = _mm256_loadu_ps(v + 24);
            __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(a0, magnitude), _mm256_and_ps(a1, magnitude)),
                                       _mm256_max_ps(_mm256_and_ps(a2, magnitude), _mm256_and_ps(a3, magnitude)));
            __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
            top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
            top4 = _mm_max_ss(top4, _mm_movehdup_ps(top4));
            float d = _mm_cvtss_f32(top4) / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
            __m256 scale = _mm256_set1_ps(inverse);
            __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(a0, scale)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(a1, scale));
            __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(a2, scale)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(a3, scale));
            /* packs interleave the 128-bit lanes: the permutation puts the 32 bytes back in order. */
            __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
            bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(quads + m * (K / 4) + b * Q4_QUADS), bytes);
            xd[m * blocks + b] = d;
            if (xs) {
                __m256i s = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
                __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
                xs[m * blocks + b] = d * (float)_mm_cvtsi128_si32(s4);
            }
        }
}

#endif

#if defined(__AVX512VNNI__) || defined(__F16C__)
/* y [M, N] = x [M, K] @ W^T (+ bias), W packed as the header says (K a multiple of 32); the bias (or
 * NULL) padded with zeros to the panels' width. Nonzero: K is not a multiple of 32, or no memory
 * for the quantized input. */
int panel_q4_1(const float *x, int64_t M, int64_t K, const uint8_t *packed, int64_t N, const float *bias, float *y,
               int threads) {
    if (K % Q4_BLOCK)
        return -1;
    int64_t Kq = K / 4, blocks = K / Q4_BLOCK;
    uint32_t *quads = malloc((size_t)(M * Kq) * sizeof(uint32_t) + 2 * (size_t)(M * blocks) * sizeof(float));
    if (!quads)
        return 1;
    float *xd = (float *)(quads + M * Kq), *xs = xd + M * blocks;
    q8_quantize_rows(x, M, K, quads, xd, xs);
    q4_call call = {quads, xd, xs, Kq, blocks, packed, N, bias, y};
    panel_blocks(M, N, Q4_MAX_ROWS, Q4_SPLIT_ROWS, Q4_PANEL_GROUP, threads, q4_call_rows, &call);
    free(quads);
    return 0;
}
#endif
