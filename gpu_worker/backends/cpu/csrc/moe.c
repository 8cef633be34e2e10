/* A mixture of experts' experts over one step's rows, in one call, on GGUF blocks
 * (gpu_worker/backends/cpu/experts.py; the model's side is gpu_worker/models/moe.py).
 *
 * The caller hands the (token, expert) pairs sorted by expert: pair i is token tokens[i], routed with
 * probability weights[i]; spans lists (expert, start, count) for each expert with pairs. Per expert
 * with pairs, over all of its rows at once (its weights read once per step):
 *   gu = x_rows [Wgate; Wup]^T (gate and up each a matmul writing its half); a = silu(gate) * up;
 *   y_rows = a Wdown^T
 * each matmul by quant_matmul or, from dense_min_rows rows, quant_matmul_dense (as QuantLinear runs
 * it). Then out[token] += y * weight per pair, pairs in order (experts ascending, as the torch path
 * and HF's eager experts add them), the product rounded to the activations' dtype before the add. */
#include "quant.h"
#include <stdlib.h>

void silu_mul(const void *gate_up, void *out, int64_t rows, int inner, int dtype);
int quant_matmul(int type, const uint8_t *w, int64_t n, int64_t k, const void *x, int64_t x_stride, int x_dtype,
                 int64_t rows, void *scratch, void *y, int64_t y_stride, int y_dtype, const void *residual,
                 int64_t res_stride);
int quant_matmul_dense(int type, const uint8_t *w, int64_t n, int64_t k, const void *x, int64_t x_stride,
                       int x_dtype, int64_t rows, void *y, int64_t y_stride, int y_dtype, const void *residual,
                       int64_t res_stride);
int64_t quant_act_row_bytes(int type, int64_t k);

typedef struct { /* one projection of every expert, stacked: expert e's n rows are rows [e n, (e + 1) n) */
    const uint8_t *w;
    int64_t type;           /* the C kernels' type code */
    int64_t n, row_bytes;   /* an expert's rows; bytes of one row */
    int64_t dense_min_rows; /* from how many rows the dense path */
} moe_projection;

enum { GATE, UP, DOWN, PROJECTIONS };

static int expert_matmul(const moe_projection *p, int64_t e, int64_t k, const void *x, int64_t rows, void *scratch,
                         void *y, int64_t y_stride, int dtype) {
    const uint8_t *w = p->w + e * p->n * p->row_bytes;
    const int type = (int)p->type;
    return rows >= p->dense_min_rows
               ? quant_matmul_dense(type, w, p->n, k, x, k, dtype, rows, y, y_stride, dtype, NULL, 0)
               : quant_matmul(type, w, p->n, k, x, k, dtype, rows, scratch, y, y_stride, dtype, NULL, 0);
}

/* out[tokens[i]] += y[i] * weights[i] over the pairs in order, from zero, each product and each sum
 * rounded to dtype (torch's multiply and index_add_). Returns 0, or 1 (no memory). */
static int combine(const void *y, const int64_t *tokens, const void *weights, int64_t pairs, int64_t tokens_n,
                   int64_t hidden, void *out, int dtype) {
    float *sum = calloc((size_t)(tokens_n * hidden), sizeof(float));
    float *term = malloc((size_t)hidden * sizeof(float));
    if (sum == NULL || term == NULL) {
        free(sum);
        free(term);
        return 1;
    }
    for (int64_t i = 0; i < pairs; i++) {
        float wt;
        load_vec(weights, dtype, i, 1, &wt);
        load_vec(y, dtype, i * hidden, (int)hidden, term);
        float *dst = sum + tokens[i] * hidden;
        for (int64_t j = 0; j < hidden; j++) term[j] *= wt;
        round_vec(dtype, term, (int)hidden);
        for (int64_t j = 0; j < hidden; j++) dst[j] += term[j];
        round_vec(dtype, dst, (int)hidden);
    }
    store_vec(out, dtype, 0, (int)(tokens_n * hidden), sum);
    free(sum);
    free(term);
    return 0;
}

/* out [tokens_n, hidden] (written whole) = each token's experts' outputs, weighted and summed; x
 * [tokens_n, hidden] rows contiguous; weights [pairs] in x's dtype; spans [n_spans][3]. Returns 0, 1
 * (no memory), 7 (an expert size that does not match the projections), or 100 + the status of the
 * matmul that refused. */
int moe_experts(const moe_projection *proj, int64_t hidden, int64_t inner, const void *x, const int64_t *tokens,
                const void *weights, const int64_t *spans, int64_t n_spans, int64_t pairs, int64_t tokens_n,
                void *out, int dtype) {
    if (proj[GATE].n != inner || proj[UP].n != inner || proj[DOWN].n != hidden) return 7;
    const int64_t elem = dtype == DTYPE_BF16 ? 2 : 4;
    int64_t act_bytes = quant_act_row_bytes((int)proj[GATE].type, hidden);
    const int64_t up_bytes = quant_act_row_bytes((int)proj[UP].type, hidden);
    const int64_t down_bytes = quant_act_row_bytes((int)proj[DOWN].type, inner);
    act_bytes = up_bytes > act_bytes ? up_bytes : act_bytes;
    act_bytes = down_bytes > act_bytes ? down_bytes : act_bytes;
    /* one arena: the pairs' rows of x, gate_up, act, y, then the quantized activations */
    const int64_t at_gu = pairs * hidden * elem, at_act = at_gu + pairs * 2 * inner * elem;
    const int64_t at_y = at_act + pairs * inner * elem, at_scratch = (at_y + pairs * hidden * elem + 63) & ~(int64_t)63;
    char *arena = malloc((size_t)(at_scratch + pairs * act_bytes));
    if (arena == NULL) return 1;
    char *rows = arena, *gu = arena + at_gu, *act = arena + at_act, *y = arena + at_y;
    void *scratch = arena + at_scratch;
    for (int64_t i = 0; i < pairs; i++)
        memcpy(rows + i * hidden * elem, (const char *)x + tokens[i] * hidden * elem, (size_t)(hidden * elem));
    int status = 0;
    for (int64_t s = 0; s < n_spans && status == 0; s++) {
        const int64_t e = spans[3 * s], start = spans[3 * s + 1], count = spans[3 * s + 2];
        const char *xs = rows + start * hidden * elem;
        char *gus = gu + start * 2 * inner * elem, *acts = act + start * inner * elem;
        if ((status = expert_matmul(&proj[GATE], e, hidden, xs, count, scratch, gus, 2 * inner, dtype)) != 0) break;
        status = expert_matmul(&proj[UP], e, hidden, xs, count, scratch, gus + inner * elem, 2 * inner, dtype);
        if (status != 0) break;
        silu_mul(gus, acts, count, (int)inner, dtype);
        status = expert_matmul(&proj[DOWN], e, inner, acts, count, scratch, y + start * hidden * elem, hidden, dtype);
    }
    if (status == 0 && combine(y, tokens, weights, pairs, tokens_n, hidden, out, dtype) != 0) status = -99;
    free(arena);
    return status == 0 ? 0 : status == -99 ? 1 : 100 + status;
}
