/* Every decoder layer of a dense Qwen3.5 model (models/qwen35.py: Gated DeltaNet linear layers and
 * gated full attention) for a float32 step whose rows all decode one token, in one call, where each
 * Linear holds GGUF blocks (no bias). Like decode_layers.c for Llama, it calls the kernels the modules
 * call, in their order, on the same inputs, so its output equals theirs bit for bit (a test checks
 * it); what it saves is the Python around them: a one-row step's ~15 module calls a layer, each a
 * ctypes call and a fresh tensor or view, a large share of the step beside its matmuls.
 *
 * Per layer, x the residual stream [rows, hidden], every norm's weight 1 + w (HybridNorm's, folded):
 *   h = rms_norm(x); then the mixer:
 *   Gated DeltaNet: p = h Win^T (mixed q/k/v | z | b | a); y = gated_delta_decode_step(p) (the conv1d,
 *     gates, rule and gated norm, both state pools advanced at the rows' slots); x = x + y Wout^T
 *   gated attention: p = h Wqkv^T (per head [q | gate], then k, v); q, k = rms_norm per head;
 *     partial_rotary on q and k; a = attention(q over the pool, after writing k and v);
 *     x = x + (a * sigmoid(gate)) Wo^T
 *   h = rms_norm(x); gu = h Wgu^T; x = x + (silu(gate) * up) Wdown^T
 * each Linear by decode_linear_run (decode_layers.c: QuantLinear's path per part and row count); an
 * input projection of more parts than a decode_linear holds (Qwen3.5's in_proj of a Q4_K_M file:
 * qkv in Q6_K beside z, b, a in Q4_K) is carried in two, run part by part in order. */
#include "quant.h"
#include "rivulet_kernels.h"
#include <stdlib.h>

/* y [rows, n] = x W^T of a Linear whose parts lie in lins[0 .. count) in order, each part as
 * decode_linear_run runs it (its own columns of y, rows n apart). */
static int run_parts(const decode_linear *lins, int count, int64_t n, int64_t k, const float *x, int64_t rows,
                     void *scratch, float *y) {
    if (count == 1 || lins[1].n[0] == 0) return decode_linear_run(lins, n, k, x, rows, scratch, y, DTYPE_F32, NULL);
    int64_t col = 0;
    for (int i = 0; i < count; i++)
        for (int p = 0; p < MAX_PARTS && lins[i].n[p] > 0; p++) {
            const decode_linear *l = lins + i;
            const int type = (int)l->type[p] | (rows >= l->a8_min_rows[p] ? QTYPE_A8 : 0);
            const int status =
                rows >= l->dense_min_rows[p]
                    ? quant_matmul_dense(type, l->w[p], l->n[p], k, x, k, DTYPE_F32, rows, y + col, n, DTYPE_F32,
                                         NULL, n)
                    : quant_matmul(type, l->w[p], l->n[p], k, x, k, DTYPE_F32, rows, scratch, y + col, n,
                                   DTYPE_F32, NULL, n);
            if (status != 0) return status;
            col += l->n[p];
        }
    return col == n ? RV_OK : RV_ERR_PARTS;
}

/* Row by row, head by head: rotary forks from small_ops.c's PARALLEL_ROWS rows, and a head's rot_dim values
 * of a row cost far less than a fork (Qwen3.5's 16 q heads and 4 k heads: 40 forks a 32-row step). */
void partial_rotary(void *x, int64_t x_stride, int64_t rows, int heads, int head_stride, int rot_dim, const void *cos,
                    const void *sin, int dtype) {
    const int64_t elem = dtype == DTYPE_BF16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++)
            rotary((char *)x + (r * x_stride + h * head_stride) * elem, x_stride, 1, 1, rot_dim,
                   (const char *)cos + r * rot_dim * elem, (const char *)sin + r * rot_dim * elem, dtype);
}

void sigmoid_gate_mul(const void *x, const void *gate, int64_t gate_stride, int64_t gate_head_stride, void *out,
                      int64_t rows, int heads, int dim, int dtype) {
    float v[MAX_HEAD_DIM], g[MAX_HEAD_DIM];
    for (int64_t r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            const int64_t at = (r * heads + h) * dim;
            load_vec(x, dtype, at, dim, v);
            load_vec(gate, dtype, r * gate_stride + h * gate_head_stride, dim, g);
            for (int i = 0; i < dim; i++) { /* exp(-|g|), so that no exponent overflows */
                const float e = exp_nonpositive(-fabsf(g[i]));
                g[i] = g[i] >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
            }
            round_vec(dtype, g, dim); /* torch rounds sigmoid's result, then the product, to the dtype */
            for (int i = 0; i < dim; i++) v[i] *= g[i];
            store_vec(out, dtype, at, dim, v);
        }
}

/* Scratch of a step (float32 buffers, each [rows, its width]: rope holds the rows' cos, then their sin;
 * and the quantized activations). */
typedef struct {
    float *h, *proj, *conv, *y, *q, *k, *attn, *gu, *act, *rope;
    void *act_q;
} hybrid_scratch;

static char *hybrid_arena(const hybrid_dims *d, int64_t rows, int64_t in_n, hybrid_scratch *s) {
    const int64_t q_out = d->heads * d->head_dim, kv_out = d->kv_heads * d->head_dim;
    const int64_t channels = 2 * d->k_heads * d->dk + d->v_heads * d->dv, v_out = d->v_heads * d->dv;
    const int64_t proj = in_n > 2 * q_out + 2 * kv_out ? in_n : 2 * q_out + 2 * kv_out;
    const int64_t widths[10] = {d->hidden, proj, channels, v_out > q_out ? v_out : q_out, q_out, kv_out, q_out,
                                2 * d->inner, d->inner, 2 * d->rotary_dim};
    int64_t at[10], total = 0, k_max = d->hidden;
    for (int i = 0; i < 10; i++) at[i] = total, total += (rows * widths[i] + 15) / 16 * 16;
    const int64_t ks[3] = {v_out, q_out, d->inner};
    for (int i = 0; i < 3; i++) k_max = ks[i] > k_max ? ks[i] : k_max;
    float *arena = malloc((size_t)total * sizeof(float) + (size_t)(rows * act_row_bytes_max(k_max)) + 64);
    if (arena == NULL) return NULL;
    float **bufs[10] = {&s->h, &s->proj, &s->conv, &s->y, &s->q, &s->k, &s->attn, &s->gu, &s->act, &s->rope};
    for (int i = 0; i < 10; i++) *bufs[i] = arena + at[i];
    s->act_q = arena + total;
    return (char *)arena;
}

/* The Gated DeltaNet mixer of one layer: out += (its block after in_proj on h) Wout^T. */
static int linear_mixer(const hybrid_layer *l, const hybrid_dims *d, int64_t rows, int64_t in_n, const int64_t *slots,
                        const hybrid_scratch *s, float *out) {
    const int64_t channels = 2 * d->k_heads * d->dk + d->v_heads * d->dv, v_out = d->v_heads * d->dv;
    int status = run_parts(l->in_proj, HYBRID_IN_LINEARS, in_n, d->hidden, s->h, rows, s->act_q, s->proj);
    if (status != 0) return status;
    const float *z = s->proj + channels, *b = z + v_out, *a = b + d->v_heads;
    status = gated_delta_decode_step(s->proj, in_n, z, in_n, b, in_n, a, in_n, (const float *)l->conv_w, (int)d->conv_kernel,
                                     (float *)l->conv_state, d->conv_kernel - 1, (float *)l->state, d->pool_slots, slots, rows,
                                     (const float *)l->a_log, (const float *)l->dt_bias, (const float *)l->norm_w, d->eps, (int)d->k_heads, (int)d->v_heads, (int)d->dk,
                                     (int)d->dv, (int)d->tiled, d->delta_scale, s->conv, s->y);
    if (status != 0) return status;
    return decode_linear_run(&l->out_proj, d->hidden, v_out, s->y, rows, s->act_q, out, DTYPE_F32, out);
}

/* The gated full-attention mixer of one layer: out += (attention * sigmoid(gate)) Wo^T. */
static int attention_mixer(const hybrid_layer *l, const hybrid_dims *d, int64_t rows, const float *cos,
                           const float *sin, const int64_t *q_rows, const int64_t *req_pool_idx,
                           const int64_t *kv_lens, const int64_t *page_table, int64_t pt_stride, int64_t page_size,
                           const hybrid_scratch *s, float *out) {
    const int heads = (int)d->heads, kv_heads = (int)d->kv_heads, hd = (int)d->head_dim;
    const int64_t q_out = heads * d->head_dim, kv_out = kv_heads * d->head_dim, n = 2 * q_out + 2 * kv_out;
    int status = run_parts(l->in_proj, HYBRID_IN_LINEARS, n, d->hidden, s->h, rows, s->act_q, s->proj);
    if (status != 0) return status;
    /* each row's q heads (strided by [q | gate]), then its k heads, a head a call: rms_norm forks from
     * small_ops.c's PARALLEL_ROWS rows, and a head's few hundred values cost less than a fork (16 q heads:
     * two forks a step at one row, 64 at 32 rows); the same rows, the same bits */
    for (int64_t r = 0; r < rows; r++) {
        const float *row = s->proj + r * n;
        for (int h = 0; h < heads; h++)
            rms_norm(row + h * 2 * hd, 2 * hd, l->q_norm, s->q + r * q_out + h * hd, 1, hd, d->eps, DTYPE_F32);
        for (int h = 0; h < kv_heads; h++)
            rms_norm(row + 2 * q_out + h * hd, hd, l->k_norm, s->k + r * kv_out + h * hd, 1, hd, d->eps, DTYPE_F32);
    }
    partial_rotary(s->q, q_out, rows, heads, hd, (int)d->rotary_dim, cos, sin, DTYPE_F32);
    partial_rotary(s->k, kv_out, rows, kv_heads, hd, (int)d->rotary_dim, cos, sin, DTYPE_F32);
    status = paged_decode_attention(s->q, q_out, l->k_cache, l->v_cache, s->attn, DTYPE_F32, (int)d->kv_dtype, q_rows,
                                    req_pool_idx, kv_lens, page_table, pt_stride, rows, heads, kv_heads, hd,
                                    (int)page_size, d->attn_scale, s->k, kv_out, s->proj + 2 * q_out + kv_out, n, 0,
                                    NULL);
    if (status != 0) return status;
    sigmoid_gate_mul(s->attn, s->proj + hd, n, 2 * hd, s->y, rows, heads, hd, DTYPE_F32);
    return decode_linear_run(&l->out_proj, d->hidden, q_out, s->y, rows, s->act_q, out, DTYPE_F32, out);
}

/* The step's inputs, looked up from the tables the model holds (in the step rather than by the modules'
 * calls before it: after a step has streamed the weights through the caches those few calls ran cold,
 * ~0.15 ms of Python a step): each row's embedding row into out (ids in [0, vocab) of a table of blocks
 * of embed_type, dequantized as quant_get_rows does; embed NULL: out holds the rows already), and its
 * cos / sin rows (positions in [0, table_rows) of the rotary tables [table_rows, rotary_dim]) into
 * rope [2, rows, rotary_dim]. */
static int hybrid_inputs(const hybrid_dims *d, const int64_t *ids, const uint8_t *embed, int embed_type,
                         int64_t vocab, const int64_t *positions, int64_t table_rows, const float *cos_table,
                         const float *sin_table, int64_t rows, float *out, float *rope) {
    const int64_t rd = d->rotary_dim;
    for (int64_t r = 0; r < rows; r++)
        if ((embed != NULL && (ids[r] < 0 || ids[r] >= vocab)) || positions[r] < 0 || positions[r] >= table_rows)
            return RV_ERR_HEADS;
    if (embed != NULL && rows == 1) { /* quant_get_rows' own dequantization, without its fork for one row */
        const qtype_ops *ops = quant_ops(embed_type);
        if (ops == NULL || d->hidden % ops->block != 0) return RV_ERR_TYPE;
        dequant_row_at(ops, embed, d->hidden / ops->block * ops->block_bytes, ids[0], d->hidden, out);
    } else if (embed != NULL) {
        quant_get_rows(embed_type, embed, d->hidden, ids, rows, out, DTYPE_F32);
    }
    for (int64_t r = 0; r < rows; r++) {
        memcpy(rope + r * rd, cos_table + positions[r] * rd, (size_t)rd * sizeof(float));
        memcpy(rope + (rows + r) * rd, sin_table + positions[r] * rd, (size_t)rd * sizeof(float));
    }
    return RV_OK;
}

int decode_hybrid(const hybrid_layer *layers, int64_t n_layers, const hybrid_dims *dims, const int64_t *ids,
                  const uint8_t *embed, int embed_type, int64_t vocab, const int64_t *positions, int64_t table_rows,
                  const float *cos_table, const float *sin_table, float *out, int64_t rows, const int64_t *slots,
                  const int64_t *q_rows, const int64_t *req_pool_idx, const int64_t *kv_lens,
                  const int64_t *page_table, int64_t pt_stride, int64_t page_size, const float *final_norm,
                  float final_eps, float *normed) {
    const int64_t hidden = dims->hidden, inner = dims->inner, in_n = dims->linear_in;
    hybrid_scratch s;
    char *arena = hybrid_arena(dims, rows, in_n, &s);
    if (arena == NULL) return RV_ERR_NO_MEMORY;
    float *rope = s.rope;
    const float *cos = rope, *sin = rope + rows * dims->rotary_dim;
    int status = hybrid_inputs(dims, ids, embed, embed_type, vocab, positions, table_rows, cos_table, sin_table,
                               rows, out, rope);
    for (int64_t li = 0; li < n_layers && status == 0; li++) {
        const hybrid_layer *l = layers + li;
        rms_norm(out, hidden, l->input_norm, s.h, rows, (int)hidden, dims->eps, DTYPE_F32);
        status = l->linear ? linear_mixer(l, dims, rows, in_n, slots, &s, out)
                           : attention_mixer(l, dims, rows, cos, sin, q_rows, req_pool_idx, kv_lens, page_table,
                                             pt_stride, page_size, &s, out);
        if (status != 0) break;
        rms_norm(out, hidden, l->post_norm, s.h, rows, (int)hidden, dims->eps, DTYPE_F32);
        if ((status = decode_linear_run(&l->gate_up, 2 * inner, hidden, s.h, rows, s.act_q, s.gu, DTYPE_F32, NULL)) != 0)
            break;
        silu_mul(s.gu, s.act, rows, (int)inner, DTYPE_F32);
        status = decode_linear_run(&l->down, hidden, inner, s.act, rows, s.act_q, out, DTYPE_F32, out);
    }
    /* the final norm of the rows, while they are in the caches (the model's norm module after the call
     * runs on cold ones: docs/benchmarks-history.md, "Qwen3.5-4B's one-row step outside its C calls"),
     * as that module computes it */
    if (status == 0 && final_norm != NULL)
        rms_norm(out, hidden, final_norm, normed, rows, (int)hidden, final_eps, DTYPE_F32);
    free(arena);
    return status;
}
