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
 * per row against two 8-float vectors of the panel. A register block is R rows by P panels: with
 * one or two rows, several panels go at once, so that at least 8 independent sums are in flight
 * (a fused multiply-add's result is ready 4 cycles after it issues, and two issue per cycle; with
 * one row and one panel, 2 sums, the core would wait 3 cycles in 4 where weights are in cache).
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
#define MAX_ROWS 6     /* 12 accumulators + 2 weight vectors + 1 broadcast: 15 of 16 ymm registers */
#define PANEL_GROUP 4  /* panels a thread takes at a time; a multiple of every block's panel count */
#define PREFETCH_BYTES 1024 /* how far ahead in a panel to prefetch (the next panel past its end) */

/* Panels per register block, by rows: 2 * R * P sums in flight, at least 8, and 2 to 4 panels
 * streaming from memory at once where the registers allow (one stream alone, with its prefetch
 * 1 KB ahead, reads slower: SmolLM2's 121 weights at 4 rows took 40 ms in 4x1 blocks, 33 ms in
 * 4x2, whose 16 sums leave one to spill; 5x2 and 6x2 spill more and lose). */
static const int PANELS_FOR_ROWS[MAX_ROWS + 1] = {0, 4, 2, 2, 2, 1, 1};

/* One register block: rows x[0..R) against panels [0..P) (each K * PANEL floats apart), R and P
 * compile-time constants so that the sums stay in registers. Output features at y; `valid` of
 * them in the last panel (P is 1 wherever a panel is partial). */
#define BLOCK(R, P)                                                                                     \
    static void block_##R##x##P(const float *x, int64_t K, const float *panel, float *y, int64_t N,     \
                                int64_t valid, const float *bias) {                                    \
        __m256 lo[P][R], hi[P][R];                                                                      \
        _Pragma("GCC unroll 8") for (int j = 0; j < P; j++)                                            \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) lo[j][i] = hi[j][i] = _mm256_setzero_ps(); \
        for (int64_t k = 0; k < K; k++) {                                                               \
            _Pragma("GCC unroll 8") for (int j = 0; j < P; j++) {                                      \
                const float *w = panel + j * K * PANEL + k * PANEL; /* one 64-byte line */             \
                _mm_prefetch((const char *)w + PREFETCH_BYTES, _MM_HINT_T0);                            \
                __m256 w_lo = _mm256_loadu_ps(w), w_hi = _mm256_loadu_ps(w + 8);                        \
                _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                  \
                    __m256 xi = _mm256_broadcast_ss(x + i * K + k);                                     \
                    lo[j][i] = _mm256_fmadd_ps(xi, w_lo, lo[j][i]);                                     \
                    hi[j][i] = _mm256_fmadd_ps(xi, w_hi, hi[j][i]);                                     \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        _Pragma("GCC unroll 8") for (int j = 0; j < P; j++) {                                          \
            __m256 b_lo = _mm256_setzero_ps(), b_hi = _mm256_setzero_ps();                              \
            if (bias) {                                                                                 \
                b_lo = _mm256_loadu_ps(bias + j * PANEL);                                               \
                b_hi = _mm256_loadu_ps(bias + j * PANEL + 8);                                           \
            }                                                                                           \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                      \
                float out[PANEL];                                                                       \
                _mm256_storeu_ps(out, _mm256_add_ps(lo[j][i], b_lo));                                   \
                _mm256_storeu_ps(out + 8, _mm256_add_ps(hi[j][i], b_hi));                               \
                memcpy(y + i * N + j * PANEL, out, (size_t)(P == 1 ? valid : PANEL) * sizeof(float));   \
            }                                                                                           \
        }                                                                                               \
    }

BLOCK(1, 1) BLOCK(2, 1) BLOCK(3, 1) BLOCK(4, 1) BLOCK(5, 1) BLOCK(6, 1)
BLOCK(1, 4) BLOCK(2, 2) BLOCK(3, 2) BLOCK(4, 2)

typedef void (*block_fn)(const float *, int64_t, const float *, float *, int64_t, int64_t, const float *);
/* By rows: the block over PANELS_FOR_ROWS[R] panels, and the one over a single panel. */
static const block_fn WIDE_BLOCKS[MAX_ROWS + 1] = {0, block_1x4, block_2x2, block_3x2, block_4x2, block_5x1, block_6x1};
static const block_fn ONE_PANEL_BLOCKS[MAX_ROWS + 1] = {0, block_1x1, block_2x1, block_3x1, block_4x1, block_5x1,
                                                         block_6x1};

/* y [M, N] = x [M, K] @ W^T (+ bias); x and y row-major and contiguous; the bias (or NULL) padded
 * with zeros to the panels' width, as the panels are. Groups of PANEL_GROUP panels are split
 * among `threads` threads; within a group each row block (at most MAX_ROWS rows, sized evenly:
 * 7 rows go 4 + 3) takes its panels PANELS_FOR_ROWS at a time, the last partial panel alone. */
void panel_sgemm(const float *x, int64_t M, int64_t K, const float *packed, int64_t N, const float *bias, float *y,
                 int threads) {
    int64_t panels = (N + PANEL - 1) / PANEL, full = N / PANEL;
    int64_t groups = (panels + PANEL_GROUP - 1) / PANEL_GROUP;
    int64_t blocks = (M + MAX_ROWS - 1) / MAX_ROWS;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t g = 0; g < groups; g++) {
        int64_t first = g * PANEL_GROUP, end = first + PANEL_GROUP < panels ? first + PANEL_GROUP : panels;
        for (int64_t b = 0, m = 0; b < blocks; b++) {
            int64_t rows = (M - m + (blocks - b) - 1) / (blocks - b);
            int64_t width = PANELS_FOR_ROWS[rows];
            for (int64_t p = first; p < end;) {
                int64_t take = p + width <= end && p + width <= full ? width : 1;
                int64_t valid = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
                (take > 1 ? WIDE_BLOCKS : ONE_PANEL_BLOCKS)[rows](x + m * K, K, packed + p * K * PANEL,
                                                                  y + m * N + p * PANEL, N, valid,
                                                                  bias ? bias + p * PANEL : 0);
                p += take;
            }
            m += rows;
        }
    }
}
