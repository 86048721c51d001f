/* A Llama decoder's layers in one call: the same kernels, in the same order, as specbatch.llama's
 * layer loop calls them one by one from Python.
 *
 * Why: a layer is nine kernel calls (two RMS norms with their residual adds, four multiplies, the
 * rotary embedding with the KV write, attention, the SiLU-gated multiply). From Python each costs
 * its checks, its output tensor and a ctypes call; over SmolLM2's 30 layers those fixed costs are a
 * large share of a one-token step, in every mode: target-only decoding, each verify and each
 * drafted token alike (docs/cpu-kernels.md).
 *
 * Exactness: each kernel is called with the arguments Python passes it, on buffers of the same
 * shapes and layout, so every output is bitwise what the Python loop computes (tests/test_native.py
 * compares them); rows stay independent of each other as each kernel keeps them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The kernels (panel_sgemm.c, panel_dpbf16.c, panel_fp16.c, panel_q4_1.c, panel_q8_0.c,
 * attention.c, layer_ops.c). */
void panel_sgemm(const float *x, int64_t M, int64_t K, const float *packed, int64_t N, const float *bias, float *y,
                 int threads);
void panel_sgemm_bf16w(const float *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N, const float *bias,
                       float *y, int threads);
#ifdef __AVX512BF16__
int panel_dpbf16(const float *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N, const float *bias, float *y,
                 int threads);
#endif
#if defined(__AVX512VNNI__) || defined(__F16C__)
int panel_q8_0(const float *x, int64_t M, int64_t K, const uint8_t *packed, int64_t N, const float *bias, float *y,
               int threads);
int panel_q4_1(const float *x, int64_t M, int64_t K, const uint8_t *packed, int64_t N, const float *bias, float *y,
               int threads);
#endif
#ifdef __AVX512FP16__
int panel_fp16(const float *x, int64_t M, int64_t K, const _Float16 *packed, int64_t N, float weight_unscale,
               const float *bias, float *y, int threads);
#endif
int attend(const float *q, int64_t q_b, int64_t q_h, int64_t q_w, const void *keys, const void *values,
           int64_t kv_b, int64_t kv_h, int kv_bf16, const uint8_t *mask, float *out, int64_t B, int64_t H,
           int64_t KVH, int64_t W, int64_t end, int64_t D, float scale, int threads);
void add_rms_norm(float *x, const float *delta, int64_t rows, int64_t n, const float *weight, float eps, float *out,
                  int threads);
void silu_mul(const float *h, int64_t rows, int64_t n, float *out, int threads);
int rope_write(float *qkv, int64_t B, int64_t W, int64_t H, int64_t KVH, int64_t D, const int64_t *positions,
               const int64_t *columns, const float *cos, const float *signed_sin, void *keys, void *values,
               int64_t kv_b, int64_t kv_h, int kv_bf16, int threads);

/* One linear layer as specbatch.native.PanelLinear packs it; `form` says which kernel reads it. */
enum { FORM_F32 = 0, FORM_BF16_WEIGHTS = 1, FORM_BF16_DOT = 2, FORM_FP16_DOT = 3, FORM_Q4_1 = 5, FORM_Q8_0 = 6 };

typedef struct {
    int32_t form;
    float weight_unscale; /* FORM_FP16_DOT only */
    const void *packed;
    const float *bias; /* or NULL */
    int64_t in_features, out_features;
} panel_linear;

typedef struct {
    panel_linear qkv, o, gate_up, down;
    const float *norm_in, *norm_post;
    float eps, scale;
} decoder_layer;

/* y [M, out] = x [M, in] @ W^T (+ bias) on the kernel of l's form: the one entry for a linear layer,
 * from the layer loop below and from specbatch.native.PanelLinear alike. Nonzero: no memory, or a
 * form this build lacks. */
int panel_linear_multiply(const panel_linear *l, const float *x, int64_t M, float *y, int threads) {
    switch (l->form) {
    case FORM_F32:
        panel_sgemm(x, M, l->in_features, (const float *)l->packed, l->out_features, l->bias, y, threads);
        return 0;
    case FORM_BF16_WEIGHTS:
        panel_sgemm_bf16w(x, M, l->in_features, (const uint16_t *)l->packed, l->out_features, l->bias, y, threads);
        return 0;
#ifdef __AVX512BF16__
    case FORM_BF16_DOT:
        return panel_dpbf16(x, M, l->in_features, (const uint16_t *)l->packed, l->out_features, l->bias, y, threads);
#endif
#if defined(__AVX512VNNI__) || defined(__F16C__)
    case FORM_Q8_0:
        return panel_q8_0(x, M, l->in_features, (const uint8_t *)l->packed, l->out_features, l->bias, y, threads);
    case FORM_Q4_1:
        return panel_q4_1(x, M, l->in_features, (const uint8_t *)l->packed, l->out_features, l->bias, y, threads);
#endif
#ifdef __AVX512FP16__
    case FORM_FP16_DOT:
        return panel_fp16(x, M, l->in_features, (const _Float16 *)l->packed, l->out_features, l->weight_unscale,
                          l->bias, y, threads);
#endif
    default:
        return -1;
    }
}

/* The residual stream x [B, W, hidden] through `count` decoder layers and the final RMS norm, as
 * specbatch.llama.LlamaForward's loop: x is updated in place (the residual stream, last layer's
 * MLP output not yet added), `out` [B, W, hidden] receives the final norm of x after it. Layer i's
 * keys and values live at kv + i * kv_layer and kv + i * kv_layer + kv_values, [B, KVH, columns, D]
 * with strides kv_b, kv_h (all in elements: float32, or bfloat16 where kv_bf16; a column D
 * elements on); token (b, i) sits at positions[b, i], writes
 * column columns[b, i] and attends where seen[b, i, :end] is nonzero. Every layer has H query and
 * KVH key/value heads of D, and `intermediate` MLP features. Returns 0, or nonzero where a kernel
 * refuses (a head_dim attention.c or rope_write lacks, a form this build lacks) or memory runs out. */
int decoder_layers(float *x, int64_t B, int64_t W, const decoder_layer *layers, int64_t count, int64_t H,
                   int64_t KVH, int64_t D, int64_t intermediate, const int64_t *positions, const int64_t *columns,
                   const float *cos, const float *signed_sin, void *kv, int64_t kv_layer, int64_t kv_values,
                   int64_t kv_b, int64_t kv_h, int kv_bf16, const uint8_t *seen, int64_t end, const float *final_norm,
                   float final_eps, float *out, int threads) {
    if (count < 1) return -1;
    int64_t M = B * W, hidden = layers[0].qkv.in_features, width = (H + 2 * KVH) * D;
    size_t floats = (size_t)M * (size_t)(hidden + width + H * D + hidden + 2 * intermediate + intermediate + hidden);
    float *scratch = malloc(floats * sizeof(float));
    if (!scratch) return 1;
    float *h = scratch, *qkv = h + M * hidden, *attn = qkv + M * width, *projected = attn + M * H * D;
    float *gate_up = projected + M * hidden, *act = gate_up + M * 2 * intermediate, *delta = act + M * intermediate;
    int status = 0;
    const float *added = NULL; /* what the last layer adds to x (none before the first) */
    size_t element = kv_bf16 ? sizeof(uint16_t) : sizeof(float); /* of the KV pool */
    for (int64_t i = 0; i < count && !status; i++) {
        const decoder_layer *layer = layers + i;
        char *keys = (char *)kv + (size_t)(i * kv_layer) * element, *values = keys + (size_t)kv_values * element;
        add_rms_norm(x, added, M, hidden, layer->norm_in, layer->eps, h, threads);
        if ((status = panel_linear_multiply(&layer->qkv, h, M, qkv, threads))) break;
        if ((status = rope_write(qkv, B, W, H, KVH, D, positions, columns, cos, signed_sin, keys, values, kv_b, kv_h,
                                 kv_bf16, threads)))
            break;
        /* The rotated queries in place in qkv: [B, H, W, D] with strides (W * width, D, width). */
        if ((status = attend(qkv, W * width, D, width, keys, values, kv_b, kv_h, kv_bf16, seen, attn, B, H, KVH, W,
                             end, D, layer->scale, threads)))
            break;
        if ((status = panel_linear_multiply(&layer->o, attn, M, projected, threads))) break;
        add_rms_norm(x, projected, M, hidden, layer->norm_post, layer->eps, h, threads);
        if ((status = panel_linear_multiply(&layer->gate_up, h, M, gate_up, threads))) break;
        silu_mul(gate_up, M, intermediate, act, threads);
        if ((status = panel_linear_multiply(&layer->down, act, M, delta, threads))) break;
        added = delta;
    }
    if (!status) add_rms_norm(x, added, M, hidden, final_norm, final_eps, out, threads);
    free(scratch);
    return status;
}

void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out); /* layer_ops.c */

/* The greedy tokens of `rows` hidden states [rows, hidden]: the head's argmax, mapped through
 * to_token (a head over a token subset; NULL: the column is the token), written every `stride`. */
static int greedy_tokens(const panel_linear *head, const int64_t *to_token, const float *hidden, int64_t rows,
                         float *logits, int64_t *tokens, int64_t stride, int threads) {
    int status = panel_linear_multiply(head, hidden, rows, logits, threads);
    if (status) return status;
    for (int64_t b = 0; b < rows; b++) {
        int64_t column;
        argmax_rows(logits + b * head->out_features, 1, head->out_features, &column);
        tokens[b * stride] = to_token ? to_token[column] : column;
    }
    return 0;
}

/* Each row's embedded token, beside its feature row where the model fuses them ([embedding |
 * feature] through `fuse`, as specbatch.llama's forward does), into x [M, hidden]; `pair` [M,
 * 2 hidden] is scratch. */
static int embed_rows(const float *embed, const panel_linear *fuse, const int64_t *ids, const float *features,
                      int64_t M, int64_t hidden, float *pair, float *x, int threads) {
    size_t row = (size_t)hidden * sizeof(float);
    if (!fuse) {
        for (int64_t m = 0; m < M; m++) memcpy(x + m * hidden, embed + ids[m] * hidden, row);
        return 0;
    }
    for (int64_t m = 0; m < M; m++) {
        memcpy(pair + 2 * m * hidden, embed + ids[m] * hidden, row);
        memcpy(pair + (2 * m + 1) * hidden, features + m * hidden, row);
    }
    return panel_linear_multiply(fuse, pair, M, x, threads);
}

/* A greedy draft's proposal in one call: specbatch.draft_service's loop (a forward over the call's
 * fed tokens, then `steps` forwards of one token each, every one taking the head's argmax) without
 * a Python round per token. The first forward's tokens come as decoder_layers takes them (ids,
 * features, positions, columns, seen, end [B, W]); each further token (b) sits at next_positions[b]
 * plus the tokens drafted before it, writes that column and sees its row's columns up to it, and
 * reads (where `fuse` is given) the final hidden state of the token before it as its feature.
 * tokens [B, steps + 1] receives the drafted tokens, and first_logits (unless NULL) [B, vocab] the
 * head's logits at the first (where the caller ranks leaves). Each kernel gets what the Python
 * loop gives it, so every token is bitwise the loop's. Returns 0, or nonzero as decoder_layers. */
int draft_chain(const float *embed, const panel_linear *fuse, const int64_t *ids, const float *features, int64_t B,
                int64_t W, const decoder_layer *layers, int64_t count, int64_t H, int64_t KVH, int64_t D,
                int64_t intermediate, const int64_t *positions, const int64_t *columns, const uint8_t *seen,
                int64_t end, const int64_t *next_positions, int64_t steps, const float *cos, const float *signed_sin,
                void *kv, int64_t kv_layer, int64_t kv_values, int64_t kv_b, int64_t kv_h, int kv_bf16,
                const float *final_norm, float final_eps, const panel_linear *head, const int64_t *to_token,
                int64_t *tokens, float *first_logits, int threads) {
    if (count < 1 || B < 1 || W < 1 || steps < 0) return -1;
    int64_t M = B * W, hidden = layers[0].qkv.in_features, vocab = head->out_features, last_end = end;
    for (int64_t b = 0; b < B; b++)
        if (next_positions[b] + steps > last_end) last_end = next_positions[b] + steps;
    size_t floats = (size_t)M * (size_t)(4 * hidden) + (size_t)B * (size_t)(hidden + vocab);
    float *scratch = malloc(floats * sizeof(float));
    int64_t *at = malloc((size_t)(2 * B) * sizeof(int64_t));
    uint8_t *sees = malloc((size_t)(B * last_end));
    int status = scratch && at && sees ? 0 : 1;
    float *pair = scratch, *x = pair + 2 * M * hidden, *out = x + M * hidden, *last = out + M * hidden;
    float *logits = last + B * hidden;
    int64_t *ids_now = at + B;
    if (!status) status = embed_rows(embed, fuse, ids, features, M, hidden, pair, x, threads);
    if (!status)
        status = decoder_layers(x, B, W, layers, count, H, KVH, D, intermediate, positions, columns, cos, signed_sin,
                                kv, kv_layer, kv_values, kv_b, kv_h, kv_bf16, seen, end, final_norm, final_eps, out,
                                threads);
    for (int64_t b = 0; b < B && !status; b++) /* the last column's hidden states: the head's rows */
        memcpy(last + b * hidden, out + (b * W + W - 1) * hidden, (size_t)hidden * sizeof(float));
    if (!status) status = greedy_tokens(head, to_token, last, B, logits, tokens, steps + 1, threads);
    if (!status && first_logits) memcpy(first_logits, logits, (size_t)(B * vocab) * sizeof(float));
    for (int64_t s = 1; s <= steps && !status; s++) {
        int64_t *where = at, step_end = 0; /* positions, which are the columns too */
        for (int64_t b = 0; b < B; b++) {
            where[b] = next_positions[b] + s - 1;
            ids_now[b] = tokens[b * (steps + 1) + s - 1];
            if (where[b] + 1 > step_end) step_end = where[b] + 1;
        }
        for (int64_t b = 0; b < B; b++)
            for (int64_t c = 0; c < step_end; c++) sees[b * step_end + c] = c <= where[b];
        status = embed_rows(embed, fuse, ids_now, last, B, hidden, pair, x, threads);
        if (!status)
            status = decoder_layers(x, B, 1, layers, count, H, KVH, D, intermediate, where, where, cos, signed_sin, kv,
                                    kv_layer, kv_values, kv_b, kv_h, kv_bf16, sees, step_end, final_norm, final_eps,
                                    last, threads);
        if (!status) status = greedy_tokens(head, to_token, last, B, logits, tokens + s, steps + 1, threads);
    }
    free(scratch);
    free(at);
    free(sees);
    return status;
}
