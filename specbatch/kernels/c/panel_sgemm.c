/* y = x @ W^T (+ bias) in float32 for the few rows of a decode or verify step, on x86 with AVX2+FMA.
 *
 * Why: a step of a small model at batch 1 is bound by reading its weights from memory, and the
 * rows beside the first (the drafts a verify step checks) should ride along for free. oneDNN's and
 * MKL's float32 kernels grow markedly from one row to a few. This kernel reads the weights once for
 * up to six rows, in the order they lie in memory, and keeps every row's sums in registers, so one
 * to five rows cost about what one does (docs/cpu-kernels.md).
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
 *
 * bf16 weights (panel_sgemm_bf16w): the same kernel reading each weight as a bfloat16, half the
 * bytes of a step, widened to float32 in registers (a bf16 is a float32's upper 16 bits) and
 * multiplied with float32 inputs in the same order: the exact float32 product of the inputs with
 * the bf16-rounded weights, row-exact as above. A panel's 16 bf16 per k (32 bytes) are stored
 * permuted, [0-3, 8-11, 4-7, 12-15], so that interleaving them with zeros within each 128-bit lane
 * (two instructions) gives outputs 0-7 and 8-15 in order.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define PANEL 16
#define MAX_ROWS 6     /* 12 accumulators + 2 weight vectors + 1 broadcast: 15 of 16 ymm registers */
#define PANEL_GROUP 4  /* panels a thread takes at a time; a multiple of every block's panel count */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024 /* how far ahead in a panel to prefetch (the next panel past its end) */
#endif

/* Panels per register block, by rows (the row counts 1 to MAX_ROWS; BLOCKS names them per weight
 * type): 2 * R * P sums in flight, at least 8, and 2 to 4 panels streaming from memory at once
 * where the registers allow (one stream alone, with its prefetch 1 KB ahead, reads slower; 4x2
 * beat 4x1 though its 16 sums leave one to spill on AVX2, while 5x2 and 6x2 spill more and lose).
 * Built for AVX-512 (32 vector registers, the 16 the code names and 16 more for the compiler),
 * bf16 weights take wider blocks: widening a panel's bf16 costs two instructions and a register,
 * which wider blocks share among more rows. */
#define F32_PANELS 2, 2, 2, 1, 1
#ifdef __AVX512F__
#define BF16_PANELS 4, 2, 4, 2, 2
#else
#define BF16_PANELS 2, 2, 2, 1, 1
#endif

/* One register block: rows x[0..R) against panels [0..P) (each K * PANEL floats apart), R and P
 * compile-time constants so that the sums stay in registers. Output features at y; `valid` of
 * them in the last panel (P is 1 wherever a panel is partial). */
#define BLOCK(NAME, WEIGHT, LOAD, R, P)                                                                                     \
    static __attribute__((unused)) void NAME##_##R##x##P(const float *x, int64_t K, const WEIGHT *panel, float *y, int64_t N,  \
                                int64_t valid, const float *bias) {                                    \
        __m256 lo[P][R], hi[P][R];                                                                      \
        _Pragma("GCC unroll 8") for (int j = 0; j < P; j++)                                            \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) lo[j][i] = hi[j][i] = _mm256_setzero_ps(); \
        for (int64_t k = 0; k < K; k++) {                                                               \
            _Pragma("GCC unroll 8") for (int j = 0; j < P; j++) {                                      \
                const WEIGHT *w = panel + j * K * PANEL + k * PANEL;                                    \
                _mm_prefetch((const char *)w + PREFETCH_BYTES, _MM_HINT_T0);                            \
                __m256 w_lo, w_hi;                                                                      \
                LOAD(w, w_lo, w_hi);                                                                    \
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

/* A panel's 16 weights at one k as two 8-float vectors: float32 (one 64-byte line), or bf16 stored
 * permuted as the header says (32 bytes), widened by placing each above 16 zero bits. */
#define LOAD_F32(w, lo, hi) (lo = _mm256_loadu_ps(w), hi = _mm256_loadu_ps((w) + 8))
#define LOAD_BF16(w, lo, hi)                                                                            \
    do {                                                                                                \
        __m256i raw = _mm256_loadu_si256((const __m256i *)(w)), zero = _mm256_setzero_si256();          \
        lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));                                     \
        hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));                                     \
    } while (0)

#define BLOCKS_(NAME, WEIGHT, LOAD, W2, W3, W4, W5, W6)                                                                      \
    BLOCK(NAME, WEIGHT, LOAD, 1, 1) BLOCK(NAME, WEIGHT, LOAD, 2, 1) BLOCK(NAME, WEIGHT, LOAD, 3, 1)     \
    BLOCK(NAME, WEIGHT, LOAD, 4, 1) BLOCK(NAME, WEIGHT, LOAD, 5, 1) BLOCK(NAME, WEIGHT, LOAD, 6, 1)     \
    BLOCK(NAME, WEIGHT, LOAD, 1, 4) BLOCK(NAME, WEIGHT, LOAD, 2, 2) BLOCK(NAME, WEIGHT, LOAD, 3, 2)     \
    BLOCK(NAME, WEIGHT, LOAD, 4, 2) BLOCK(NAME, WEIGHT, LOAD, 2, 4) BLOCK(NAME, WEIGHT, LOAD, 4, 4)     \
    BLOCK(NAME, WEIGHT, LOAD, 5, 2) BLOCK(NAME, WEIGHT, LOAD, 6, 2)                                     \
    static const int NAME##_panels[MAX_ROWS + 1] = {0, 4, W2, W3, W4, W5, W6};                          \
    /* By rows: the block over NAME##_panels[R] panels, and the one over a single panel. */             \
    static void (*const NAME##_wide[MAX_ROWS + 1])(const float *, int64_t, const WEIGHT *, float *,     \
                                                   int64_t, int64_t, const float *) = {                 \
        0, NAME##_1x4, NAME##_2x##W2, NAME##_3x##W3, NAME##_4x##W4, NAME##_5x##W5, NAME##_6x##W6};      \
    static void (*const NAME##_one[MAX_ROWS + 1])(const float *, int64_t, const WEIGHT *, float *,      \
                                                  int64_t, int64_t, const float *) = {                  \
        0, NAME##_1x1, NAME##_2x1, NAME##_3x1, NAME##_4x1, NAME##_5x1, NAME##_6x1};

#define BLOCKS(NAME, WEIGHT, LOAD, ...) BLOCKS_(NAME, WEIGHT, LOAD, __VA_ARGS__) /* expands the widths */
BLOCKS(f32, float, LOAD_F32, F32_PANELS)
BLOCKS(bf16w, uint16_t, LOAD_BF16, BF16_PANELS)

/* y [M, N] = x [M, K] @ W^T (+ bias); x and y row-major and contiguous; the bias (or NULL) padded
 * with zeros to the panels' width, as the panels are. Groups of PANEL_GROUP panels are split
 * among `threads` threads; within a group each row block (at most MAX_ROWS rows, sized evenly:
 * 7 rows go 4 + 3) takes its panels NAME##_panels at a time, the last partial panel alone. */
#define GEMM(FUNCTION, NAME, WEIGHT)                                                                    \
    void FUNCTION(const float *x, int64_t M, int64_t K, const WEIGHT *packed, int64_t N, const float *bias, \
                  float *y, int threads) {                                                              \
        int64_t panels = (N + PANEL - 1) / PANEL, full = N / PANEL;                                     \
        int64_t groups = (panels + PANEL_GROUP - 1) / PANEL_GROUP;                                      \
        int64_t blocks = (M + MAX_ROWS - 1) / MAX_ROWS;                                                 \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")              \
        for (int64_t g = 0; g < groups; g++) {                                                          \
            int64_t first = g * PANEL_GROUP, end = first + PANEL_GROUP < panels ? first + PANEL_GROUP : panels; \
            for (int64_t b = 0, m = 0; b < blocks; b++) {                                               \
                int64_t rows = (M - m + (blocks - b) - 1) / (blocks - b);                               \
                int64_t width = NAME##_panels[rows];                                                    \
                for (int64_t p = first; p < end;) {                                                     \
                    int64_t take = p + width <= end && p + width <= full ? width : 1;                   \
                    int64_t valid = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;                      \
                    (take > 1 ? NAME##_wide : NAME##_one)[rows](x + m * K, K, packed + p * K * PANEL,   \
                                                               y + m * N + p * PANEL, N, valid,         \
                                                               bias ? bias + p * PANEL : 0);            \
                    p += take;                                                                          \
                }                                                                                       \
                m += rows;                                                                              \
            }                                                                                           \
        }                                                                                               \
    }

GEMM(panel_sgemm, f32, float)
GEMM(panel_sgemm_bf16w, bf16w, uint16_t)
