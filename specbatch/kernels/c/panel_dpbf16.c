/* y = x @ W^T (+ bias) with bf16 weights and bf16-rounded inputs, products of bf16 pairs summed in
 * float32 by AVX512_BF16's dot-product instruction (vdpbf16ps), for the rows of a decode or verify
 * step. Compiled only where the CPU has AVX512_BF16 (the library is built with -mavx512bf16 there;
 * specbatch.native.bf16_dot_available()).
 *
 * Why: panel_sgemm_bf16w (panel_sgemm.c) halves the bytes a step reads, but each weight still
 * costs a widening and two float32 multiply-adds per row, so past four rows it is bound by
 * arithmetic. One vdpbf16ps multiplies and sums 32 bf16 pairs into 16 float32 sums, so a verify
 * row costs a fraction of that arithmetic and the step stays bound by the weights' stream to more
 * rows (docs/cpu-kernels.md).
 *
 * Layout: W [N, K] is packed once into panels of 16 output features by pairs of input features,
 * [ceil(N/16)][ceil(K/2)][16][2] (zero-padded), so one pair of k for a panel is one 64-byte line,
 * the operand of one vdpbf16ps. Each call rounds its input rows to bf16 (round to nearest even)
 * into [M][ceil(K/2)] pairs first; a row's pair is broadcast against the panel's line.
 *
 * Blocks: R rows by one panel (R sums in registers). Up to 12 rows are one block; more rows go in
 * blocks of at most 8, sized evenly. A block spans one panel: blocks over 2-8 panels were slower
 * at every row count. Why one block up to 12: up to ~8 rows a step waits on memory and the
 * multiply-adds hide under the weights' stream; a second block of rows re-reads the panels from L2
 * after the stream has passed, so its arithmetic no longer overlaps anything. From 13 rows on the
 * arithmetic bounds the step anyway, and taller blocks were no faster than two of at most 8
 * (docs/decisions/twelve-row-block.md).
 *
 * Exactness: every output is the sum over pairs q = 0, 1, ..., ceil(K/2)-1 of one vdpbf16ps term
 * each, in that order, whatever the rows of the call, their block, or the thread that runs the
 * panel: a row's result never depends on the other rows or the thread count (row-exact, as the
 * float32 kernel), so speculation on it stays bitwise exact. The instruction treats denormal
 * inputs as zero and flushes denormal sums to zero, the same way every time.
 */
#ifdef __AVX512BF16__
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define PANEL 16
#define DOT_MAX_ROWS 12   /* rows of the tallest block: a call of up to this many rows is one block */
#define DOT_SPLIT_ROWS 8  /* above that, blocks of at most this many */
#define DOT_PANEL_GROUP 4   /* panels a thread takes at a time */
/* Two prefetches a line: far ahead into L2, near ahead into L1. One step at one row reads all the
 * weights once (270 MB for SmolLM2), more than a core's L2/L3 share keeps, so it waits on memory,
 * and the hardware prefetchers alone (or an L1 prefetch alone) left it well short of the stream
 * these two keep up; the distances are not critical (2-16 KB and 0.5-2 KB did alike). The
 * summation order is untouched: results are bitwise the same. */
#define DOT_PREFETCH_L2 8192 /* bytes ahead in a panel (into the next panels past its end) */
#define DOT_PREFETCH_L1 1024

/* Rows x[0..R) (bf16 pairs, Kp apart) against one panel; `valid` of its outputs written. */
#define DOT_BLOCK(R)                                                                                    \
    static void dot_##R(const uint32_t *x, int64_t Kp, const uint16_t *panel, float *y, int64_t N,      \
                        int64_t valid, const float *bias) {                                             \
        __m512 sum[R];                                                                                  \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) sum[i] = _mm512_setzero_ps();              \
        for (int64_t q = 0; q < Kp; q++) {                                                              \
            const uint16_t *w = panel + q * 2 * PANEL;                                                  \
            _mm_prefetch((const char *)w + DOT_PREFETCH_L2, _MM_HINT_T1);                               \
            _mm_prefetch((const char *)w + DOT_PREFETCH_L1, _MM_HINT_T0);                               \
            __m512bh line = (__m512bh)_mm512_loadu_si512(w);                                            \
            _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) {                                     \
                __m512bh pair = (__m512bh)_mm512_set1_epi32((int)x[i * Kp + q]);                        \
                sum[i] = _mm512_dpbf16_ps(sum[i], pair, line);                                          \
            }                                                                                           \
        }                                                                                               \
        __mmask16 keep = (__mmask16)((1u << valid) - 1);                                                \
        __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();                                  \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++)                                           \
            _mm512_mask_storeu_ps(y + i * N, keep, _mm512_add_ps(sum[i], b));                          \
    }

DOT_BLOCK(1) DOT_BLOCK(2) DOT_BLOCK(3) DOT_BLOCK(4) DOT_BLOCK(5) DOT_BLOCK(6) DOT_BLOCK(7) DOT_BLOCK(8)
DOT_BLOCK(9) DOT_BLOCK(10) DOT_BLOCK(11) DOT_BLOCK(12)

typedef void (*dot_block)(const uint32_t *, int64_t, const uint16_t *, float *, int64_t, int64_t, const float *);
typedef void (*panel_rows)(const void *call, int64_t panel, int64_t row, int64_t rows, int64_t valid);
void panel_blocks(int64_t M, int64_t N, int64_t max_rows, int64_t split_rows, int64_t group, int threads,
                  panel_rows run, const void *call); /* panel_blocks.c */

static const dot_block dot_blocks[DOT_MAX_ROWS + 1] = {0,     dot_1, dot_2, dot_3,  dot_4,  dot_5, dot_6,
                                                       dot_7, dot_8, dot_9, dot_10, dot_11, dot_12};

/* x [M, K] float32 rounded to bf16 pairs [M][Kp], the odd K's last pair padded with zero (also
 * panel_q4_1.c's input). */
void bf16_round_to_pairs(const float *x, int64_t M, int64_t K, int64_t Kp, uint32_t *pairs) {
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        uint16_t *out = (uint16_t *)(pairs + m * Kp);
        int64_t k = 0;
        for (; k + 16 <= K; k += 16)
            _mm256_storeu_si256((__m256i *)(out + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + k)));
        if (k < 2 * Kp) { /* K - k < 16 values left, 2 * Kp - k <= 16 slots */
            __m256i last = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps((__mmask16)((1u << (K - k)) - 1), row + k));
            _mm256_mask_storeu_epi16(out + k, (__mmask16)((1u << (2 * Kp - k)) - 1), last);
        }
    }
}

/* One call's operands, for panel_blocks. */
typedef struct {
    const uint32_t *pairs;
    int64_t Kp;
    const uint16_t *packed;
    int64_t N;
    const float *bias;
    float *y;
} dot_call;

static void dot_rows(const void *call, int64_t p, int64_t m, int64_t rows, int64_t valid) {
    const dot_call *c = call;
    dot_blocks[rows](c->pairs + m * c->Kp, c->Kp, c->packed + p * c->Kp * 2 * PANEL, c->y + m * c->N + p * PANEL,
                     c->N, valid, c->bias ? c->bias + p * PANEL : 0);
}

/* y [M, N] = x [M, K] @ W^T (+ bias), W packed as the header says; the bias (or NULL) padded with
 * zeros to the panels' width. Returns nonzero where the input's bf16 copy cannot be allocated. */
int panel_dpbf16(const float *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N, const float *bias,
                 float *y, int threads) {
    int64_t Kp = (K + 1) / 2;
    uint32_t *pairs = malloc((size_t)(M * Kp) * sizeof(uint32_t));
    if (!pairs)
        return 1;
    bf16_round_to_pairs(x, M, K, Kp, pairs);
    dot_call call = {pairs, Kp, packed, N, bias, y};
    panel_blocks(M, N, DOT_MAX_ROWS, DOT_SPLIT_ROWS, DOT_PANEL_GROUP, threads, dot_rows, &call);
    free(pairs);
    return 0;
}
#endif
