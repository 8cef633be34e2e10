/* The decoder layers of a Gemma 4 model (models/gemma4.py) for a float32 step whose rows all decode
 * one token, in one call, where each Linear holds GGUF blocks (no bias). Like decode_layers.c, it
 * calls the kernels the modules call, in their order, on the same inputs, so its output equals
 * theirs bit for bit (tests/gpu_worker/test_decode_gemma4.py checks it); what it saves is the Python
 * around them (docs/benchmarks-history.md, "Gemma 4's decode step: where the time outside the tiles
 * goes"). decode_gemma4.py passes it runs of consecutive layers; a layer it does not take (a MoE
 * block, heads past paged_decode_attention's limits) keeps its modules between two runs.
 *
 * Per layer, x the residual stream [rows, hidden], every norm's weight w (ones on v: no scale):
 *   h = rms_norm(x); p = h Wqkv^T (q alone on a KV-shared layer);
 *   owning its KV: v = rms_norm(v's heads, or k's before their norm where k = v); k = rms_norm(k)
 *   per head; q = rms_norm(q) per head; rotary on q (and k) by the layer's table;
 *   a = attention(q over the layer's pool, after writing k and v; a KV-shared layer reads its
 *   source's pool, written earlier in the step, and writes nothing);
 *   x = x + rms_norm(a Wo^T); h = rms_norm(x); x = x + rms_norm((gelu(gate) * up) Wdown^T);
 *   with a per-layer input e (the step's [rows, layers, dim] slice of this layer):
 *   x = x + rms_norm((gelu(x Wg^T) * e) Wp^T), the gate on a [gate | e] row as the modules' cat;
 *   x = x * the layer's scalar
 * each Linear by decode_linear_run (QuantLinear's path per part and row count). */
#include "quant.h"
#include "rivulet_kernels.h"
#include <stdlib.h>

enum { QKV, O, GATE_UP, DOWN, PL_GATE, PL_PROJ, LINEARS };
_Static_assert(LINEARS == GEMMA4_LINEARS, "gemma4_layer's Linears (rivulet_kernels.h)");

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* The projection's columns: q, then k and v where the layer owns its KV (k alone where k = v). */
static int64_t qkv_width(const gemma4_layer *l) {
    const int64_t kv_out = l->kv_heads * l->head_dim;
    return l->heads * l->head_dim + (l->writes_kv ? (l->k_eq_v ? kv_out : 2 * kv_out) : 0);
}

/* Each row's n heads of d values (rows stride elements apart) RMS-normed by w, from x into out (in
 * place where they are the same), as the modules norm a [rows, heads, d] view. */
static void norm_heads(const float *x, float *out, int64_t stride, int64_t out_stride, int64_t rows, int64_t n,
                       int64_t d, const void *w, float eps) {
    for (int64_t r = 0; r < rows; r++) rms_norm(x + r * stride, d, w, out + r * out_stride, n, (int)d, eps, DTYPE_F32);
}

/* A step's buffers, each float32 [rows, its width] (the widest layer's), and the integer path's quantized
 * activations (scratch). */
typedef struct {
    float *h, *qkv, *v, *attn, *gu, *act;
    void *scratch;
} buffers;

/* out [rows, hidden] += rms_norm(Linear i of x [rows, k]), the product in b->h. */
static int add_normed(const gemma4_layer *l, int i, const gemma4_dims *dims, const buffers *b, int64_t k,
                      const float *x, int64_t rows, float *out, const void *norm) {
    const int64_t n = dims->hidden;
    const int status = decode_linear_run(&l->linear[i], n, k, x, rows, b->scratch, b->h, DTYPE_F32, NULL);
    if (status != 0) return status;
    rms_norm(b->h, n, norm, b->h, rows, (int)n, dims->eps, DTYPE_F32);
    decode_add_into(out, b->h, rows * n, DTYPE_F32);
    return RV_OK;
}

/* The arena holding a step's buffers for a run of layers (NULL: no memory; the caller frees it). */
static char *gemma4_arena(const gemma4_layer *layers, int64_t n_layers, const gemma4_dims *dims, int64_t rows,
                          buffers *b) {
    const int64_t hidden = dims->hidden;
    int64_t qkv_max = 0, q_max = 0, kv_max = 0, inner_max = dims->per_layer_dim, k_max = hidden;
    for (int64_t li = 0; li < n_layers; li++) {
        const gemma4_layer *l = layers + li;
        qkv_max = max64(qkv_max, qkv_width(l));
        q_max = max64(q_max, l->heads * l->head_dim);
        kv_max = max64(kv_max, l->kv_heads * l->head_dim);
        inner_max = max64(inner_max, l->inner);
        k_max = max64(k_max, max64(l->heads * l->head_dim, l->inner));
    }
    /* gu: the MLP's gate_up, or the per-layer block's [gate | e] rows */
    float **bufs[] = {&b->h, &b->qkv, &b->v, &b->attn, &b->gu, &b->act};
    const int64_t widths[] = {hidden, qkv_max, kv_max, q_max, 2 * inner_max, inner_max};
    enum { BUFFERS = sizeof(widths) / sizeof(widths[0]) };
    _Static_assert(sizeof(bufs) / sizeof(bufs[0]) == BUFFERS, "a width for each buffer");
    int64_t total = 0, at[BUFFERS];
    for (int i = 0; i < BUFFERS; i++) at[i] = total, total += rows * widths[i] * (int64_t)sizeof(float);
    const int64_t scratch_at = (total + 63) & ~(int64_t)63;
    char *arena = malloc((size_t)(scratch_at + rows * act_row_bytes_max(k_max)));
    if (arena == NULL) return NULL;
    for (int i = 0; i < BUFFERS; i++) *bufs[i] = (float *)(arena + at[i]);
    b->scratch = arena + scratch_at;
    return arena;
}

/* The step's rows as paged_decode_attention reads them, and their rotary tables (decode_gemma4's). */
typedef struct {
    const float *cos, *sin;
    const int64_t *q_rows, *req_pool_idx, *kv_lens, *page_table;
    int64_t pt_stride, page_size;
} step_rows;

/* The attention block of one layer: out += rms_norm(attention(...) Wo^T). */
static int attention_block(const gemma4_layer *l, const gemma4_dims *dims, const buffers *b, const step_rows *s,
                           float *out, int64_t rows) {
    const int64_t hidden = dims->hidden, d = l->head_dim, q_out = l->heads * d, kv_out = l->kv_heads * d;
    const int64_t qkv_n = qkv_width(l);
    rms_norm(out, hidden, l->input_norm, b->h, rows, (int)hidden, dims->eps, DTYPE_F32);
    int status = decode_linear_run(&l->linear[QKV], qkv_n, hidden, b->h, rows, b->scratch, b->qkv, DTYPE_F32, NULL);
    if (status != 0) return status;
    float *k = b->qkv + q_out;
    if (l->writes_kv) { /* v from its own heads, or k's before their norm (k = v) */
        norm_heads(l->k_eq_v ? k : k + kv_out, b->v, qkv_n, kv_out, rows, l->kv_heads, d, l->v_norm, dims->eps);
        norm_heads(k, k, qkv_n, qkv_n, rows, l->kv_heads, d, l->k_norm, dims->eps);
    }
    norm_heads(b->qkv, b->qkv, qkv_n, qkv_n, rows, l->heads, d, l->q_norm, dims->eps);
    const int64_t table = rows * l->rope_at;
    rotary(b->qkv, qkv_n, rows, (int)(l->heads + (l->writes_kv ? l->kv_heads : 0)), (int)d, s->cos + table,
           s->sin + table, DTYPE_F32);
    status = paged_decode_attention(b->qkv, qkv_n, l->k_cache, l->v_cache, b->attn, DTYPE_F32, (int)dims->kv_dtype,
                                    s->q_rows, s->req_pool_idx, s->kv_lens, s->page_table, s->pt_stride, rows,
                                    (int)l->heads, (int)l->kv_heads, (int)d, (int)s->page_size, l->scale,
                                    l->writes_kv ? k : NULL, qkv_n, l->writes_kv ? b->v : NULL, kv_out, l->window,
                                    NULL);
    if (status != 0) return status;
    return add_normed(l, O, dims, b, q_out, b->attn, rows, out, l->attn_out_norm);
}

/* The MLP block of one layer: out += rms_norm((gelu(gate) * up) Wdown^T), gate and up of rms_norm(out). */
static int mlp_block(const gemma4_layer *l, const gemma4_dims *dims, const buffers *b, float *out, int64_t rows) {
    const int64_t hidden = dims->hidden;
    rms_norm(out, hidden, l->post_norm, b->h, rows, (int)hidden, dims->eps, DTYPE_F32);
    const int status =
        decode_linear_run(&l->linear[GATE_UP], 2 * l->inner, hidden, b->h, rows, b->scratch, b->gu, DTYPE_F32, NULL);
    if (status != 0) return status;
    gelu_tanh_mul(b->gu, b->act, rows, (int)l->inner, DTYPE_F32);
    return add_normed(l, DOWN, dims, b, l->inner, b->act, rows, out, l->mlp_out_norm);
}

/* The per-layer input's gate: out += rms_norm((gelu(out Wg^T) * e) Wp^T), e row r at per_layer + r *
 * per_layer_stride; the gate and e side by side in gu ([gate | e] a row), act the product. */
static int per_layer_block(const gemma4_layer *l, const gemma4_dims *dims, const buffers *b, float *out, int64_t rows,
                           const float *per_layer) {
    const int64_t hidden = dims->hidden, dim = dims->per_layer_dim;
    int status = decode_linear_run(&l->linear[PL_GATE], dim, hidden, out, rows, b->scratch, b->act, DTYPE_F32, NULL);
    if (status != 0) return status;
    for (int64_t r = 0; r < rows; r++) {
        memcpy(b->gu + r * 2 * dim, b->act + r * dim, (size_t)dim * sizeof(float));
        memcpy(b->gu + r * 2 * dim + dim, per_layer + r * dims->per_layer_stride + l->per_layer * dim,
               (size_t)dim * sizeof(float));
    }
    gelu_tanh_mul(b->gu, b->act, rows, (int)dim, DTYPE_F32);
    return add_normed(l, PL_PROJ, dims, b, dim, b->act, rows, out, l->per_layer_norm);
}

/* out [rows, hidden] = the residual stream after the layers, from x [rows, hidden] (copied first; x may
 * be out). cos / sin: the step's rotary tables, each [rows, its head_dim] at the rows' positions, one
 * after another (a layer's rope_at: the widths of the tables before its own). per_layer: [rows,
 * per_layer_stride] (NULL where no layer takes one). The attention arguments are
 * paged_decode_attention's. Returns RV_OK, RV_ERR_DTYPE (a pool not float32 / bfloat16 / float16),
 * RV_ERR_NO_MEMORY, or the status of the kernel call that refused. */
int decode_gemma4(const gemma4_layer *layers, int64_t n_layers, const gemma4_dims *dims, const float *x, float *out,
                  int64_t rows, const float *cos, const float *sin, const float *per_layer, const int64_t *q_rows,
                  const int64_t *req_pool_idx, const int64_t *kv_lens, const int64_t *page_table, int64_t pt_stride,
                  int64_t page_size) {
    buffers b;
    char *arena = gemma4_arena(layers, n_layers, dims, rows, &b);
    if (arena == NULL) return RV_ERR_NO_MEMORY;
    const step_rows s = {cos, sin, q_rows, req_pool_idx, kv_lens, page_table, pt_stride, page_size};
    const int64_t hidden = dims->hidden;
    if (out != x) memcpy(out, x, (size_t)(rows * hidden) * sizeof(float));
    int status = RV_OK;
    for (int64_t li = 0; li < n_layers; li++) {
        const gemma4_layer *l = layers + li;
        status = attention_block(l, dims, &b, &s, out, rows);
        if (status == RV_OK) status = mlp_block(l, dims, &b, out, rows);
        if (status == RV_OK && l->per_layer >= 0) status = per_layer_block(l, dims, &b, out, rows, per_layer);
        if (status != RV_OK) break;
        const float scalar = l->layer_scalar;
        for (int64_t i = 0; i < rows * hidden; i++) out[i] *= scalar;
    }
    free(arena);
    return status;
}

/* The step's inputs (Gemma4ForCausalLM.embedded without images or media placeholders): x [rows,
 * hidden] = the token table's rows times embed_scale; per_layer [rows, per_layer_stride] = (rms_norm
 * per layer of (x Wp^T) times projection_scale + the per-layer table's rows times per_layer_scale)
 * times mean_scale, each product and sum rounded to float32 as the modules' in-place torch ops round
 * them, the lookups by quant_get_rows and the projection by decode_linear_run (QuantEmbedding's and
 * QuantLinear's kernels). ids: in both tables (the runner's batch checks). Returns RV_OK,
 * RV_ERR_NO_MEMORY or the projection's status. */
int decode_gemma4_inputs(const gemma4_inputs *in, const gemma4_dims *dims, const int64_t *ids, int64_t rows, float *x,
                         float *per_layer) {
    const int64_t hidden = dims->hidden, width = dims->per_layer_stride;
    quant_get_rows((int)in->embed_type, in->embed, hidden, ids, rows, x, DTYPE_F32);
    for (int64_t i = 0; i < rows * hidden; i++) x[i] *= in->embed_scale;
    float *y = malloc((size_t)(rows * width) * sizeof(float));
    const size_t scratch_bytes = (size_t)((rows * act_row_bytes_max(hidden) + 63) & ~(int64_t)63);
    void *scratch = aligned_alloc(64, scratch_bytes);
    int status = y == NULL || scratch == NULL ? RV_ERR_NO_MEMORY : RV_OK;
    if (status == RV_OK)
        status = decode_linear_run(&in->projection, width, hidden, x, rows, scratch, y, DTYPE_F32, NULL);
    if (status == RV_OK) {
        quant_get_rows((int)in->per_layer_type, in->per_layer_table, width, ids, rows, per_layer, DTYPE_F32);
        for (int64_t i = 0; i < rows * width; i++) per_layer[i] *= in->per_layer_scale;
        for (int64_t i = 0; i < rows * width; i++) y[i] *= in->projection_scale;
        const int64_t dim = dims->per_layer_dim;
        rms_norm(y, dim, in->per_layer_norm, y, rows * (width / dim), (int)dim, in->eps, DTYPE_F32);
        for (int64_t i = 0; i < rows * width; i++) per_layer[i] = (y[i] + per_layer[i]) * in->mean_scale;
    }
    free(y);
    free(scratch);
    return status;
}
