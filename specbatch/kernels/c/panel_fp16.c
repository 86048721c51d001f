/* y = x @ W^T (+ bias) with float16 weights and float16-rounded inputs, the products summed in
 * float16 over runs of FP16_RUN input features and the runs' sums added in float32, for the rows of
 * a decode or verify step. Compiled only where the CPU has AVX512_FP16 (the library is built with
 * -mavx512fp16 there; specbatch.native.fp16_dot_available()).
 *
 * Why: where a CPU has both AVX512_FP16 and AVX512_BF16, a 512-bit vfmadd231ph with an embedded
 * broadcast does well over twice as many multiply-adds a cycle as vdpbf16ps does bf16 products.
 * One row reads the weights at the memory's speed either way (both keep 2 bytes a weight); each
 * further row of a verify step costs arithmetic, and this cuts it by more than half
 * (docs/cpu-kernels.md, docs/decisions/weights-auto.md).
 *
 * Precision: float16 keeps 11 significant bits (bfloat16 8), so the rounded inputs and weights are
 * 8x closer to their float32 values. A float16 sum of up to FP16_RUN products rounds at each add;
 * with runs of 32 the result's error against a float64 reference is under half panel_dpbf16's
 * (relative RMS 7-8e-4 against 1.8-2.1e-3 on random weights).
 * Range: each row is scaled by a power of two (exact) so that its largest |x| lies in [64, 128), and
 * the weight by one (the caller's, `weight_unscale`) so that its largest |w| lies in [1, 2): a run's
 * sum then stays below 32 * 128 * 2 = 8192, far from float16's 65504, and the scales are undone in
 * float32 at the end. Tiny products fall into float16's subnormals, at most 2^-24 off each.
 *
 * Layout: W [N, K] is packed once into panels of 32 output features, [ceil(N/32)][K][32] (zero-
 * padded), so one k of a panel is one 64-byte line, one 32-lane vector. Each row's x[k] enters its
 * multiply-add as an embedded broadcast from memory ({1to32}): a load, no shuffle. (The first form,
 * two 16-lane vectors a k and a vpbroadcastw a row, kept the shuffle port as busy as the multiply-
 * adds and was bound by it, the more so the more rows.) Blocks: up to 24 rows by one panel, 24 sums
 * in registers beside the panel's vector.
 * Past 24 rows a call takes further blocks and goes run by run: the blocks after the first read
 * the run's 2 KB of the panel from L1, so the weights stream from memory once.
 *
 * Exactness: every output is the float32 sum, in order, of its runs' float16 sums, each run summed
 * in order of k, whatever the rows of the call, their block, or the thread that runs the panel; the
 * row's scale depends on that row alone. A row's result never depends on the other rows or the
 * thread count (row-exact), so speculation on it stays bitwise exact.
 */
#ifdef __AVX512FP16__
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FP16_PANEL 32
#define FP16_MAX_ROWS 24  /* 24 rows' float16 sums in registers, with the panel's vector */
#define FP16_RUN 32       /* products summed in float16 before they join the float32 sum */
#define FP16_PREFETCH_L2 8192
#define FP16_PREFETCH_L1 1024

/* One run of a panel (k in [start, end)) for rows x[0..R) (float16, K apart): each row's float16
 * sums of the run added to its float32 totals, total[i * FP16_PANEL ...]. One k of the panel is one
 * 512-bit vector; each row's x[k] reaches its multiply-add as an embedded broadcast ({1to32}, from
 * the load port), so no shuffle shares a port with the multiply-adds. */
#define FP16_BLOCK(R)                                                                                   \
    static void fp16_##R(const _Float16 *x, int64_t K, const _Float16 *panel, int64_t start, int64_t end, \
                         float *total) {                                                                 \
        __m512h run[R];                                                                                  \
        _Pragma("GCC unroll 24") for (int i = 0; i < R; i++) run[i] = _mm512_setzero_ph();              \
        for (int64_t k = start; k < end; k++) {                                                          \
            const _Float16 *w = panel + k * FP16_PANEL;                                                  \
            _mm_prefetch((const char *)w + FP16_PREFETCH_L2, _MM_HINT_T1);                              \
            _mm_prefetch((const char *)w + FP16_PREFETCH_L1, _MM_HINT_T0);                              \
            __m512h weights = _mm512_loadu_ph(w);                                                        \
            _Pragma("GCC unroll 24") for (int i = 0; i < R; i++)                                        \
                run[i] = _mm512_fmadd_ph(weights, _mm512_set1_ph(x[i * K + k]), run[i]);                 \
        }                                                                                                \
        _Pragma("GCC unroll 24") for (int i = 0; i < R; i++) {                                          \
            float *t = total + i * FP16_PANEL;                                                           \
            __m256h low = _mm512_castph512_ph256(run[i]);                                                \
            __m256h high = _mm256_castps_ph(_mm512_extractf32x8_ps(_mm512_castph_ps(run[i]), 1));        \
            _mm512_storeu_ps(t, _mm512_add_ps(_mm512_loadu_ps(t), _mm512_cvtxph_ps(low)));               \
            _mm512_storeu_ps(t + 16, _mm512_add_ps(_mm512_loadu_ps(t + 16), _mm512_cvtxph_ps(high)));    \
        }                                                                                                \
    }

FP16_BLOCK(1) FP16_BLOCK(2) FP16_BLOCK(3) FP16_BLOCK(4) FP16_BLOCK(5) FP16_BLOCK(6)
FP16_BLOCK(7) FP16_BLOCK(8) FP16_BLOCK(9) FP16_BLOCK(10) FP16_BLOCK(11) FP16_BLOCK(12)
FP16_BLOCK(13) FP16_BLOCK(14) FP16_BLOCK(15) FP16_BLOCK(16) FP16_BLOCK(17) FP16_BLOCK(18)
FP16_BLOCK(19) FP16_BLOCK(20) FP16_BLOCK(21) FP16_BLOCK(22) FP16_BLOCK(23) FP16_BLOCK(24)

typedef void (*fp16_block)(const _Float16 *, int64_t, const _Float16 *, int64_t, int64_t, float *);
static const fp16_block fp16_blocks[FP16_MAX_ROWS + 1] = {
    0,       fp16_1,  fp16_2,  fp16_3,  fp16_4,  fp16_5,  fp16_6,  fp16_7,  fp16_8,  fp16_9,  fp16_10, fp16_11, fp16_12,
    fp16_13, fp16_14, fp16_15, fp16_16, fp16_17, fp16_18, fp16_19, fp16_20, fp16_21, fp16_22, fp16_23, fp16_24};

/* Row m of x [M, K] float32, times 2^e so its largest |x| lies in [64, 128), rounded to float16
 * (nearest even); unscale[m] = 2^-e * weight_unscale. A zero row keeps scale 1. */
static void scale_to_fp16(const float *x, int64_t M, int64_t K, float weight_unscale, _Float16 *out, float *unscale) {
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        __m512 most = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 16 <= K; k += 16)
            most = _mm512_max_ps(most, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
        float largest = _mm512_reduce_max_ps(most);
        for (; k < K; k++)
            largest = fabsf(row[k]) > largest ? fabsf(row[k]) : largest;
        int e = 0;
        if (largest > 0 && isfinite(largest)) {
            frexpf(largest, &e); /* largest = f * 2^e, f in [0.5, 1): times 2^(7 - e) lies in [64, 128) */
            e = 7 - e;
        }
        __m512 scale = _mm512_set1_ps(ldexpf(1.0f, e));
        _Float16 *dst = out + m * K;
        for (k = 0; k + 16 <= K; k += 16)
            _mm256_storeu_ph(dst + k, _mm512_cvtxps_ph(_mm512_mul_ps(_mm512_loadu_ps(row + k), scale)));
        for (; k < K; k++)
            dst[k] = (_Float16)(row[k] * ldexpf(1.0f, e));
        unscale[m] = ldexpf(weight_unscale, -e);
    }
}

/* y [M, N] = x [M, K] @ W^T (+ bias), W packed as the header says and multiplied by 1 / weight_unscale
 * (a power of two); the bias (or NULL) unpadded. Returns nonzero where the input's float16 copy
 * cannot be allocated. */
int panel_fp16(const float *x, int64_t M, int64_t K, const _Float16 *packed, int64_t N, float weight_unscale,
               const float *bias, float *y, int threads) {
    _Float16 *rows = malloc((size_t)(M * K) * sizeof(_Float16));
    float *unscale = malloc((size_t)M * sizeof(float));
    float *totals = malloc((size_t)(threads > 1 ? threads : 1) * (size_t)M * FP16_PANEL * sizeof(float));
    if (!rows || !unscale || !totals) {
        free(rows);
        free(unscale);
        free(totals);
        return 1;
    }
    scale_to_fp16(x, M, K, weight_unscale, rows, unscale);
    int64_t panels = (N + FP16_PANEL - 1) / FP16_PANEL;
    int64_t blocks = (M + FP16_MAX_ROWS - 1) / FP16_MAX_ROWS;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *total = totals + (size_t)omp_get_thread_num() * (size_t)M * FP16_PANEL;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const _Float16 *panel = packed + p * K * FP16_PANEL;
            memset(total, 0, (size_t)M * FP16_PANEL * sizeof(float));
            /* Run by run, every row block: a run's 2 KB of the panel stay in L1 for the blocks after
             * the first, and the weights stream from memory once whatever the row count. */
            for (int64_t start = 0; start < K; start += FP16_RUN) {
                int64_t end = start + FP16_RUN < K ? start + FP16_RUN : K;
                for (int64_t b = 0, m = 0; b < blocks; b++) {
                    int64_t count = (M - m + (blocks - b) - 1) / (blocks - b);
                    fp16_blocks[count](rows + m * K, K, panel, start, end, total + m * FP16_PANEL);
                    m += count;
                }
            }
            int64_t valid = N - p * FP16_PANEL < FP16_PANEL ? N - p * FP16_PANEL : FP16_PANEL;
            for (int64_t m = 0; m < M; m++) {
                __m512 scale = _mm512_set1_ps(unscale[m]);
                for (int j = 0; j < 2; j++) {
                    int64_t n = valid - 16 * j;
                    if (n <= 0)
                        break;
                    __mmask16 keep = (__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1);
                    __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + p * FP16_PANEL + 16 * j) : _mm512_setzero_ps();
                    __m512 sum = _mm512_loadu_ps(total + m * FP16_PANEL + 16 * j);
                    _mm512_mask_storeu_ps(y + m * N + p * FP16_PANEL + 16 * j, keep, _mm512_fmadd_ps(sum, scale, b));
                }
            }
        }
    }
    free(rows);
    free(unscale);
    free(totals);
    return 0;
}
#endif
