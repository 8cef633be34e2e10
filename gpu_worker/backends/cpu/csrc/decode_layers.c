/* Every decoder layer of a Llama model for a step whose rows all decode (one new token each), in one
 * call, where each Linear holds GGUF blocks and the attention is the paged C kernel's. It
 * calls the kernels the modules call (gpu_worker/models/llama.py through the CPU backend), in their
 * order, on the same inputs, so its output equals theirs bit for bit (a test checks it). What it
 * saves is the ~10 Python-level calls a layer costs around them (module dispatch, ctypes, a tensor
 * per output), a large share of a one-row step (docs/benchmarks.md, the one-call decode).
 *
 * Per layer, x the residual stream [rows, hidden]:
 *   h = rms_norm(x); qkv = h Wqkv^T; rotary on q and k heads (in place);
 *   attn = attention(q over the pool, after writing k and v at each row's last position);
 *   x = x + attn Wo^T; h = rms_norm(x); gu = h Wgu^T; a = silu(gate) * up; x = x + a Wdown^T
 * each Linear by quant_matmul or, from dense_min_rows rows, quant_matmul_dense (as QuantLinear); gu and
 * a in one quant_matmul_gated call where it fits (the same bits, gu never written), and where the down
 * projection's tile takes 8-bit activations, a never written either: the call writes them quantized
 * (quant_matmul_gated_q8, the same bits as the down's own quantization of a). A
 * merged Linear whose projections differ in type (a Q4_K_M file's q, k in Q4_K and v in Q6_K) is
 * up to MAX_PARTS parts, each a matmul writing its own columns of the output, as QuantLinear runs it.
 *
 * A layer with a window (Mistral's, a per-layer pattern's sliding layers) attends each row's last
 * ``window`` positions, as the modules' attention call does.
 *
 * Qwen3's per-head norms (q_norm, k_norm) run on q's and k's heads in place before the rotary. A
 * layer with a router has a mixture of experts in place of the MLP (Qwen3-MoE's, Mixtral's):
 *   h = rms_norm(x); each row's top-k experts and weights (moe_route); the (row, expert) pairs
 *   grouped by expert, stably (as models/moe.py's ExpertGroups.of sorts them); x = x + the experts'
 *   weighted sum (moe_experts)
 * the calls the modules make through backends/cpu/experts.py, in their order.
 *
 * Gemma 2 and 3 (models/gemma.py): the norms' weights come as 1 + w (decode_gemma.py folds the 1 in
 * at load, in float32, as GemmaRMSNorm's own sum); attn_out_norm and mlp_out_norm norm the
 * attention's and the MLP's outputs before each is added to x (the "sandwich" norms); GELU (tanh)
 * gates the MLP (dims->gelu); each layer takes its rotary table (Gemma 3's local and global bases).
 *
 * A Linear with a bias (gpt-oss's q/k/v and o, Qwen2's q/k/v) has it added after its matmul, and the
 * sum rounded, before the residual add, as QuantLinear adds it. gpt-oss (models/gpt_oss.py): a sink
 * logit per head in the attention's softmax (paged_decode_attention's sinks), a router with a bias
 * whose softmax is over each row's top-k logits (moe_route_topk), experts with biases and the clamped
 * SwiGLU (moe_experts_clamped), YaRN's rotary in the table the caller passes. */
#include "quant.h"
#include "rivulet_kernels.h"
#include <stdlib.h>

enum { QKV, O, GATE_UP, DOWN, LINEARS };
_Static_assert(LINEARS == DECODE_LINEARS, "decode_layer's Linears (rivulet_kernels.h)");

/* y [rows, n] = (residual +) x W^T of one Linear, part by part, each by the path its row count takes
 * (QuantLinear's choice). Other one-call decodes (of other layer kinds) run their Linears by it too. */
int decode_linear_run(const decode_linear *lin, int64_t n, int64_t k, const void *x, int64_t rows, void *scratch,
                      void *y, int dtype, const void *residual) {
    const int64_t elem = dtype == DTYPE_BF16 ? 2 : 4;
    int64_t col = 0;
    for (int p = 0; p < MAX_PARTS && lin->n[p] > 0; p++) {
        void *yp = (char *)y + col * elem;
        const void *rp = residual == NULL ? NULL : (const char *)residual + col * elem;
        const int type = (int)lin->type[p] | (rows >= lin->a8_min_rows[p] ? QTYPE_A8 : 0);
        const int status =
            rows >= lin->dense_min_rows[p]
                ? quant_matmul_dense(type, lin->w[p], lin->n[p], k, x, k, dtype, rows, yp, n, dtype, rp, n)
                : quant_matmul(type, lin->w[p], lin->n[p], k, x, k, dtype, rows, scratch, yp, n, dtype, rp, n);
        if (status != 0) return status;
        col += lin->n[p];
    }
    return col == n ? RV_OK : RV_ERR_PARTS;
}

/* x [n] += y [n], each sum rounded to the dtype (torch's add). */
void decode_add_into(void *x, const void *y, int64_t n_all, int dtype) {
    float a[256], b[256];
    for (int64_t i0 = 0; i0 < n_all; i0 += 256) {
        const int n = n_all - i0 < 256 ? (int)(n_all - i0) : 256;
        load_vec(x, dtype, i0, n, a);
        load_vec(y, dtype, i0, n, b);
        for (int i = 0; i < n; i++) a[i] += b[i];
        store_vec(x, dtype, i0, n, a);
    }
}

/* y [rows, n] = x W^T (+ b) of Linear i: its bias, where it has one, added to the product and rounded
 * (QuantLinear's out + bias). */
static int linear(const decode_layer *l, int i, int64_t n, int64_t k, const void *x, int64_t rows, void *scratch,
                  void *y, int dtype) {
    const int status = decode_linear_run(&l->linear[i], n, k, x, rows, scratch, y, dtype, NULL);
    if (status != 0 || l->bias[i] == NULL) return status;
    const int64_t row_bytes = n * (dtype == DTYPE_BF16 ? 2 : 4);
    for (int64_t r = 0; r < rows; r++) decode_add_into((char *)y + r * row_bytes, l->bias[i], n, dtype);
    return RV_OK;
}

/* The down projection's type (with its flags) where quant_matmul_gated_q8 can write its quantized
 * activation rows: one part, no bias, the integer path on 8-bit activations at this row count. Else -1. */
static int down_q8_type(const decode_layer *l, int64_t inner, int64_t rows) {
    const decode_linear *lin = &l->linear[DOWN];
    if (l->bias[DOWN] != NULL || lin->n[1] != 0 || rows >= lin->dense_min_rows[0]) return -1;
    const int type = (int)lin->type[0] | (rows >= lin->a8_min_rows[0] ? QTYPE_A8 : 0);
    return quant_gated_q8_row_bytes(type, inner, rows) > 0 ? type : -1;
}

/* act [rows, inner] = silu(gate) * up (gelu_tanh where ``gelu``) of the gate|up Linear on h, in one
 * quant_matmul_gated call where that runs the kernels linear() and silu_mul would: no bias, gate and
 * up of one type taking the integer path at this row count (one part of 2 inner rows, or one part
 * each); act as the down projection's quantized rows at xq_down where down_type is not -1
 * (quant_matmul_gated_q8). Else -1: the caller runs those two steps. */
static int gated_mlp(const decode_layer *l, int64_t inner, int64_t hidden, const void *h, int64_t rows, void *scratch,
                     void *act, int dtype, int gelu, int down_type, uint8_t *xq_down) {
    const decode_linear *lin = &l->linear[GATE_UP];
    if (l->bias[GATE_UP] != NULL || rows >= lin->dense_min_rows[0]) return -1;
    const qtype_ops *ops = quant_ops((int)lin->type[0]);
    if (ops == NULL || hidden % ops->block != 0) return -1;
    const uint8_t *w_up = NULL;
    _Static_assert(MAX_PARTS == 3, "gated_mlp reads parts 0-2");
    if (lin->n[0] == 2 * inner && lin->n[1] == 0)
        w_up = lin->w[0] + inner * (hidden / ops->block * ops->block_bytes);
    else if (lin->n[0] == inner && lin->n[1] == inner && lin->n[2] == 0 && lin->type[1] == lin->type[0] && lin->a8_min_rows[1] == lin->a8_min_rows[0] &&
             lin->dense_min_rows[1] == lin->dense_min_rows[0])
        w_up = lin->w[1];
    if (w_up == NULL) return -1;
    const int type = (int)lin->type[0] | (rows >= lin->a8_min_rows[0] ? QTYPE_A8 : 0);
    if (down_type != -1)
        return quant_matmul_gated_q8(type, lin->w[0], w_up, inner, hidden, h, hidden, dtype, rows, scratch, dtype,
                                     gelu, down_type, xq_down);
    return quant_matmul_gated(type, lin->w[0], w_up, inner, hidden, h, hidden, dtype, rows, scratch, act, dtype, gelu);
}

/* Linear i of x into out as a residual add: in place (out + x W^T) where it has neither a bias nor
 * a norm, else out + (x W^T + b), or out + rms_norm(x W^T) (Gemma's), y [rows, n] the product's
 * scratch (QuantLinear.add_to: one rounding without a bias, the biased product's then the sum's).
 * x given as quantized rows xq of q8_type (down_q8_type's; -1: x itself): quant_matmul_q. */
static int linear_add(const decode_layer *l, int i, const decode_dims *dims, int64_t k, const void *x, int64_t rows,
                      void *scratch, void *y, void *out, const void *norm, int q8_type, const uint8_t *xq) {
    const int dtype = (int)dims->dtype;
    const int64_t n = dims->hidden;
    /* out = out + x W^T in place: each output element is read (as the residual) and then written by
     * the same thread, once, and no other output is read after */
    if (q8_type != -1 && norm == NULL)
        return quant_matmul_q(q8_type, l->linear[i].w[0], n, k, xq, rows, out, n, dtype, out, n);
    if (norm == NULL && l->bias[i] == NULL)
        return decode_linear_run(&l->linear[i], n, k, x, rows, scratch, out, dtype, out);
    const int status = q8_type != -1 ? quant_matmul_q(q8_type, l->linear[i].w[0], n, k, xq, rows, y, n, dtype, NULL, 0)
                                     : linear(l, i, n, k, x, rows, scratch, y, dtype);
    if (status != 0) return status;
    if (norm != NULL) rms_norm(y, n, norm, y, rows, (int)n, dims->eps, dtype);
    decode_add_into(out, y, rows * n, dtype);
    return RV_OK;
}

/* out [rows, hidden] = the residual stream after every layer, from x [rows, hidden] (the embedding
 * rows; not written). cos / sin: [tables, rows, head_dim] at the rows' positions (a layer's rope
 * picks its table). The attention arguments
 * are paged_decode_attention's (q_rows: the rows in order). Returns RV_OK, RV_ERR_NO_MEMORY, or the
 * status of the kernel call that refused. */
int decode_layers(const decode_layer *layers, int64_t n_layers, const decode_dims *dims, const void *x, void *out,
                  int64_t rows, const void *cos, const void *sin, const int64_t *q_rows, const int64_t *req_pool_idx,
                  const int64_t *kv_lens, const int64_t *page_table, int64_t pt_stride, int64_t page_size) {
    const int dtype = (int)dims->dtype, elem = dtype == DTYPE_BF16 ? 2 : 4;
    const int64_t hidden = dims->hidden, d = dims->head_dim, inner = dims->inner;
    const int64_t q_out = dims->heads * d, kv_out = dims->kv_heads * d, qkv_n = q_out + 2 * kv_out;
    /* one arena: h, qkv, attn, gate_up, act (each [rows, its width]) and the integer path's
     * quantized activations (the widest input, in the larger format) */
    const int64_t widths[5] = {hidden, qkv_n, q_out, 2 * inner, inner};
    int64_t total = 0, at[5];
    for (int i = 0; i < 5; i++) at[i] = total, total += rows * widths[i] * elem;
    int64_t k_max = hidden > q_out ? hidden : q_out; /* the Linears' inputs: hidden, q_out, hidden, inner */
    k_max = k_max > inner ? k_max : inner;
    const int64_t scratch_at = (total + 63) & ~(int64_t)63;
    /* the mixtures of experts': y [rows, hidden], then ids, the sorted tokens and spans (int64),
     * the weights and the sorted weights (dtype), at the layers' largest sizes */
    int64_t top_k = 0, n_experts = 0;
    for (int64_t li = 0; li < n_layers; li++)
        if (layers[li].router != NULL) {
            top_k = layers[li].top_k > top_k ? layers[li].top_k : top_k;
            n_experts = layers[li].n_experts > n_experts ? layers[li].n_experts : n_experts;
        }
    const int64_t moe_at = scratch_at + rows * act_row_bytes_max(k_max);
    const int64_t pairs_max = rows * top_k, ints_at = moe_at + rows * hidden * elem;
    const int64_t floats_at = ints_at + (2 * pairs_max + 3 * n_experts) * (int64_t)sizeof(int64_t);
    char *arena = malloc((size_t)(floats_at + 2 * pairs_max * elem));
    if (arena == NULL) return RV_ERR_NO_MEMORY;
    void *h = arena + at[0], *qkv = arena + at[1], *attn = arena + at[2], *gu = arena + at[3], *act = arena + at[4];
    void *scratch = arena + scratch_at, *moe_y = arena + moe_at;
    int64_t *ids = (int64_t *)(arena + ints_at), *tokens = ids + pairs_max, *spans = tokens + pairs_max;
    void *weights = arena + floats_at, *w_sorted = arena + floats_at + pairs_max * elem;
    memcpy(out, x, (size_t)(rows * hidden * elem));
    int status = 0;
    for (int64_t li = 0; li < n_layers && status == 0; li++) {
        const decode_layer *l = layers + li;
        rms_norm(out, hidden, l->input_norm, h, rows, (int)hidden, dims->eps, dtype);
        if ((status = linear(l, QKV, qkv_n, hidden, h, rows, scratch, qkv, dtype)) != 0) break;
        if (l->q_norm != NULL) /* each row's q heads, then its k heads, normed in place */
            for (int64_t r = 0; r < rows; r++) {
                char *row = (char *)qkv + r * qkv_n * elem;
                rms_norm(row, d, l->q_norm, row, dims->heads, (int)d, dims->eps, dtype);
                rms_norm(row + q_out * elem, d, l->k_norm, row + q_out * elem, dims->kv_heads, (int)d, dims->eps, dtype);
            }
        const int64_t table = l->rope * rows * d * elem;
        rotary(qkv, qkv_n, rows, (int)(dims->heads + dims->kv_heads), (int)d, (const char *)cos + table,
               (const char *)sin + table, dtype);
        status = paged_decode_attention(qkv, qkv_n, l->k_cache, l->v_cache, attn, dtype, (int)dims->kv_dtype, q_rows,
                                        req_pool_idx, kv_lens, page_table, pt_stride, rows, (int)dims->heads,
                                        (int)dims->kv_heads, (int)d, (int)page_size, dims->scale,
                                        (const char *)qkv + q_out * elem, qkv_n,
                                        (const char *)qkv + (q_out + kv_out) * elem, qkv_n,
                                        l->window, (const float *)l->sinks);
        if (status != 0) break;
        if ((status = linear_add(l, O, dims, q_out, attn, rows, scratch, h, out, l->attn_out_norm, -1, NULL)) != 0) break;
        rms_norm(out, hidden, l->post_norm, h, rows, (int)hidden, dims->eps, dtype);
        if (l->router != NULL) {
            const int64_t pairs = rows * l->top_k;
            status = l->router_bias != NULL
                         ? moe_route_topk(h, rows, hidden, l->router, l->router_bias, l->n_experts, l->top_k, ids,
                                          weights, dtype)
                         : moe_route(h, rows, hidden, l->router, l->n_experts, l->top_k, (int)l->norm_topk, ids,
                                     weights, dtype);
            if (status != 0) break;
            int64_t n_spans = 0;
            status = moe_group(ids, weights, rows, l->top_k, l->n_experts, tokens, w_sorted, spans, &n_spans, dtype);
            if (status != 0) break;
            status = l->gate_up_bias != NULL
                         ? moe_experts_clamped(l->experts, hidden, l->expert_inner, h, tokens, w_sorted, spans, n_spans,
                                               pairs, rows, moe_y, dtype, l->gate_up_bias, l->down_bias,
                                               l->swiglu_alpha, l->swiglu_limit)
                         : moe_experts(l->experts, hidden, l->expert_inner, h, tokens, w_sorted, spans, n_spans, pairs,
                                       rows, moe_y, dtype);
            if (status != 0) break;
            decode_add_into(out, moe_y, rows * hidden, dtype);
            continue;
        }
        /* (the down's quantized rows where gu would be: 2.82 bytes a value at most, gu's 4 or 8) */
        uint8_t *xq_down = (uint8_t *)arena + ((at[3] + 63) & ~(int64_t)63);
        int down_type = down_q8_type(l, inner, rows);
        status = gated_mlp(l, inner, hidden, h, rows, scratch, act, dtype, (int)dims->gelu, down_type, xq_down);
        if (status == -1) down_type = -1;
        if (status == -1 && (status = linear(l, GATE_UP, 2 * inner, hidden, h, rows, scratch, gu, dtype)) == 0) {
            if (dims->gelu)
                gelu_tanh_mul(gu, act, rows, (int)inner, dtype);
            else
                silu_mul(gu, act, rows, (int)inner, dtype);
        }
        if (status != 0) break;
        status = linear_add(l, DOWN, dims, inner, act, rows, scratch, h, out, l->mlp_out_norm, down_type, xq_down);
    }
    free(arena);
    return status;
}
