/* y = x @ W^T (+ bias) in float32 for the few rows of a decode or verify step, on x86 with AVX2+FMA.
 *
 * Why: a step of a small model at batch 1 is bound by reading its weights from memory, and the
 * rows beside the first (the drafts a verify step checks) should ride along for free. oneDNN's
 * float32 kernels on an AVX2-only EPYC read SmolLM2's 540 MB of weights in ~50 ms for one row but
 * take ~70 ms for five; MKL's take 2.6x at two rows. This kernel reads the weights once for up to
 * six rows, in the order they lie in memory, and keeps every row's sums in registers: ~36 ms for
 * one to five rows there (docs/engine.md, "A float32 kernel of our own").
 *
 * Layout: W [N, K] is packed once into panels of 16 output features, [ceil(N/16)][K][16] (the last
 * panel zero-padded), so a panel streams contiguously while the k loop broadcasts one input value
 * per row against two 8-float vectors of the panel.
 *
 * Exactness: every output is the sum over k = 0, 1, ..., K-1 of x[m][k] * W[n][k], accumulated in
 * that order with one fused multiply-add per term, whatever the number of rows, how they are
 * split into register blocks, or which thread computes the panel. So a row's result never depends
 * on the other rows of the call or on the thread count, which is what makes float32 speculation
 * bitwise exact (a row verified beside drafts gets what it gets alone).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define PANEL 16
#define MAX_ROWS 6        /* 12 accumulators + 2 weight vectors + 1 broadcast: 15 of 16 ymm registers */
#define PREFETCH_AHEAD 256 /* floats (16 k steps) ahead in the panel; the next panel past its end */

/* One register block: rows x[0..R) against one panel, R a compile-time constant so that the
 * accumulators stay in registers. */
#define ROW_BLOCK(R)                                                                                   \
    static void row_block_##R(const float *x, int64_t K, const float *panel, float *y, int64_t N,     \
                              int64_t valid, const float *bias) {                                     \
        __m256 lo[R], hi[R];                                                                           \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                         \
            lo[i] = _mm256_setzero_ps();                                                               \
            hi[i] = _mm256_setzero_ps();                                                               \
        }                                                                                              \
        for (int64_t k = 0; k < K; k++) {                                                              \
            const float *w = panel + k * PANEL;                                                        \
            _mm_prefetch((const char *)(w + PREFETCH_AHEAD), _MM_HINT_T0);                             \
            __m256 w_lo = _mm256_loadu_ps(w), w_hi = _mm256_loadu_ps(w + 8);                           \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                     \
                __m256 xi = _mm256_broadcast_ss(x + i * K + k);                                        \
                lo[i] = _mm256_fmadd_ps(xi, w_lo, lo[i]);                                              \
                hi[i] = _mm256_fmadd_ps(xi, w_hi, hi[i]);                                              \
            }                                                                                          \
        }                                                                                              \
        __m256 b_lo = _mm256_setzero_ps(), b_hi = _mm256_setzero_ps();                                 \
        if (bias) {                                                                                    \
            b_lo = _mm256_loadu_ps(bias);                                                              \
            b_hi = _mm256_loadu_ps(bias + 8);                                                          \
        }                                                                                              \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                         \
            float out[PANEL];                                                                          \
            _mm256_storeu_ps(out, _mm256_add_ps(lo[i], b_lo));                                         \
            _mm256_storeu_ps(out + 8, _mm256_add_ps(hi[i], b_hi));                                     \
            memcpy(y + i * N, out, (size_t)valid * sizeof(float));                                     \
        }                                                                                              \
    }

ROW_BLOCK(1)
ROW_BLOCK(2)
ROW_BLOCK(3)
ROW_BLOCK(4)
ROW_BLOCK(5)
ROW_BLOCK(6)

typedef void (*row_block_fn)(const float *, int64_t, const float *, float *, int64_t, int64_t, const float *);
static const row_block_fn ROW_BLOCKS[MAX_ROWS + 1] = {0, row_block_1, row_block_2, row_block_3,
                                                       row_block_4, row_block_5, row_block_6};

/* y [M, N] = x [M, K] @ W^T (+ bias); x and y row-major and contiguous; the bias (or NULL) padded
 * with zeros to the panels' width, as the panels are. Panels are split
 * among `threads` threads; each panel's rows go in register blocks of at most MAX_ROWS, sized
 * evenly (7 rows: 4 + 3), the panel staying in cache between blocks. */
void panel_sgemm(const float *x, int64_t M, int64_t K, const float *packed, int64_t N, const float *bias,
                 float *y, int threads) {
    int64_t panels = (N + PANEL - 1) / PANEL;
    int64_t blocks = (M + MAX_ROWS - 1) / MAX_ROWS;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t p = 0; p < panels; p++) {
        const float *panel = packed + p * K * PANEL;
        int64_t valid = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
        for (int64_t b = 0, m = 0; b < blocks; b++) {
            int64_t rows = (M - m + (blocks - b) - 1) / (blocks - b);
            ROW_BLOCKS[rows](x + m * K, K, panel, y + m * N + p * PANEL, N, valid, bias ? bias + p * PANEL : 0);
            m += rows;
        }
    }
}
