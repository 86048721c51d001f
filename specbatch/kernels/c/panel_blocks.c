/* How a multiply's rows and output panels are shared out, for the kernels that run a block of rows
 * against one panel of 16 output features at a time (panel_dpbf16.c, panel_q4_1.c, panel_q8_0.c).
 *
 * Panels go to the threads in groups of `group` (a thread's panels stay together in its cache
 * while it runs each block of rows over them). Within a group the rows run in blocks: all of them
 * in one block up to `max_rows`, else blocks of at most `split_rows`, sized evenly (why one block
 * up to 12 for the bf16 kernels: panel_dpbf16.c). Which rows share a block never changes a result,
 * as every kernel sums each output in one order whatever the block (row-exact): it only sets how
 * often the weights are read. With one block a panel is read once whatever its group, so the
 * panels are shared out one by one: a layer of 36 or 60 panels in groups of 4 gave one thread a
 * group more than the other (20 and 16 panels), which the other then waited for at every layer.
 */
#include <immintrin.h>
#include <stdint.h>

#define PANEL 16

/* Rows [row, row + rows) against panel `panel`, whose first `valid` outputs exist. */
typedef void (*panel_rows)(const void *call, int64_t panel, int64_t row, int64_t rows, int64_t valid);

void panel_blocks(int64_t M, int64_t N, int64_t max_rows, int64_t split_rows, int64_t group, int threads,
                  panel_rows run, const void *call) {
    int64_t panels = (N + PANEL - 1) / PANEL;
    int64_t blocks = M <= max_rows ? 1 : (M + split_rows - 1) / split_rows;
    if (blocks == 1) group = 1;
    int64_t groups = (panels + group - 1) / group;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t g = 0; g < groups; g++) {
        int64_t first = g * group, end = first + group < panels ? first + group : panels;
        for (int64_t b = 0, m = 0; b < blocks; b++) {
            int64_t rows = (M - m + (blocks - b) - 1) / (blocks - b);
            for (int64_t p = first; p < end; p++)
                run(call, p, m, rows, N - p * PANEL < PANEL ? N - p * PANEL : PANEL);
            m += rows;
        }
    }
}

/* An AVX2 kernel's sums of one row against a panel, its two halves of eight features (`low`, `high`),
 * plus their bias (or none), stored where the panel's first `valid` outputs exist (y: the panel's
 * part of the row). */
void panel_store_halves(__m256 low, __m256 high, int64_t valid, const float *bias, float *y) {
    float out[PANEL];
    _mm256_storeu_ps(out, low);
    _mm256_storeu_ps(out + 8, high);
    for (int f = 0; f < valid; f++)
        y[f] = out[f] + (bias ? bias[f] : 0.0f);
}
