/* Every decoder layer of a latent-attention model (models/deepseek.py: DeepSeek-V2's layers) for a
 * step whose rows all decode, in one C call, where every Linear holds GGUF blocks (no bias), kv_b is
 * the file's attn_k_b / attn_v_b blocks and the router is a softmax top-k (decode_mla.py admits only
 * such models). It calls the kernels the modules call (models/mla.py, deepseek.py, deepseek_moe.py
 * through the CPU backend), in their order, on the same inputs, so its output equals theirs bit for
 * bit (tests/gpu_worker/test_decode_mla.py); what it saves is the ~35 Python-level calls a layer
 * costs around them (module dispatch, ctypes, a tensor per output, the torch rotary and copies).
 *
 * Per layer, x the residual stream [rows, hidden]:
 *   h = rms_norm(x); q = h Wq^T (or q_b(rms_norm(h Wq_a^T))); kv = h Wkv_a^T;
 *   the pool row at each row's last position = [rms_norm(kv's latent), rotary(kv's rope key)];
 *   qa = [each head's q_nope through attn_k_b, rotary(its q_rope)]; att = latent attention of qa
 *   over the pool (mla.c); x = x + (each head's att through attn_v_b) Wo^T; h = rms_norm(x);
 *   then the dense MLP, x = x + down(silu(gate) * up), or DeepSeek's mixture of experts:
 *   the routed experts' weighted sum y (moe_route, the weights times routed_scaling_factor,
 *   moe_group, moe_experts), y = y + the shared experts' MLP of h, x = x + y
 * (HF's order of the adds). The pool is float32, bfloat16, float16 or float8 e4m3. The rotary is
 * DeepSeek-V2's: each (even, odd) pair times a complex factor, in float32 as torch's complex product
 * (each product rounded, then the difference or sum). */
#include "quant.h"
#include "rivulet_kernels.h"
#include <stdlib.h>

enum { Q_A, Q, KV_A, O, GATE_UP, DOWN, LINEARS };
_Static_assert(LINEARS == MLA_LINEARS, "mla_layer's Linears (rivulet_kernels.h)");

/* Keeps a float product rounded on its own: no FMA contracted from it (torch's complex product). */
#if defined(__GNUC__) && defined(__x86_64__)
#define ROUNDED(v) __asm__("" : "+x"(v))
#elif defined(__GNUC__) && defined(__aarch64__)
#define ROUNDED(v) __asm__("" : "+w"(v))
#else
#define ROUNDED(v) (void)0
#endif

/* heads rope vectors of n = 2 pairs values at x (head_stride apart), rotated by the pairs' complex
 * factors f [n] (re, im), in place; rounded to the dtype as torch's cast back. */
static void rotate_pairs(void *x, int64_t offset, int64_t head_stride, int64_t heads, int n, const float *f,
                         int dtype) {
    float v[256];
    for (int64_t h = 0; h < heads; h++) {
        const int64_t at = offset + h * head_stride;
        load_vec(x, dtype, at, n, v);
        for (int i = 0; i < n; i += 2) {
            const float a = v[i], b = v[i + 1], c = f[i], d = f[i + 1];
            float ac = a * c, bd = b * d, ad = a * d, bc = b * c;
            ROUNDED(ac);
            ROUNDED(bd);
            ROUNDED(ad);
            ROUNDED(bc);
            v[i] = ac - bd, v[i + 1] = ad + bc;
        }
        store_vec(x, dtype, at, n, v);
    }
}

/* A float32 value as a float8 e4m3fn pool byte, as kv_cache.py's store_rows writes it: clamped to
 * +-448 (its largest finite), then rounded to nearest even (torch's cast); NaN stays NaN (0x7f). */
static uint8_t f32_to_f8e4m3(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    bits &= 0x7fffffffu;
    if (bits > 0x7f800000u) return sign | 0x7fu;
    float a;
    memcpy(&a, &bits, sizeof a);
    a = a > 448.0f ? 448.0f : a;
    if (a < 0x1p-6f) return sign | (uint8_t)(int)nearbyintf(a * 512.0f); /* a multiple of 2^-9 (8: 2^-6) */
    memcpy(&bits, &a, sizeof bits);
    bits += 0x7ffffu + ((bits >> 20) & 1u); /* the mantissa's top 3 bits, to nearest even */
    return sign | (uint8_t)((bits >> 20) - (120u << 3)); /* the exponent's bias 127 -> 7 */
}

/* n values into the pool from element ``offset`` on, rounded to its dtype (float8 e4m3 as above). */
static void store_pool(void *cache, int kv_dtype, int64_t offset, int n, const float *v) {
    if (kv_dtype != DTYPE_F8E4M3) {
        store_vec(cache, kv_dtype, offset, n, v);
        return;
    }
    for (int i = 0; i < n; i++) ((uint8_t *)cache)[offset + i] = f32_to_f8e4m3(v[i]);
}

/* One step's buffers, each [rows, its width] in the activations' dtype, and the kernels' scratch. */
typedef struct {
    char *h, *qa, *q, *kv, *qabs, *att, *vals, *gu, *act, *moe_y, *scratch;
    int64_t *ids, *tokens, *spans;
    char *weights, *w_sorted;
    void *arena;
} mla_buffers;

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static int buffers(mla_buffers *b, const mla_layer *layers, int64_t n_layers, const mla_dims *d, int64_t rows) {
    const int64_t elem = d->dtype == DTYPE_BF16 ? 2 : 4, heads = d->heads, rank = d->kv_lora_rank;
    int64_t inner = 0, top_k = 0, n_experts = 0;
    for (int64_t li = 0; li < n_layers; li++) {
        inner = max64(inner, layers[li].inner);
        if (layers[li].router != NULL) top_k = max64(top_k, layers[li].top_k), n_experts = max64(n_experts, layers[li].n_experts);
    }
    const int64_t widths[10] = {d->hidden, d->q_lora_rank, heads * (d->nope_dim + d->rope_dim), rank + d->rope_dim,
                                heads * (rank + d->rope_dim), heads * rank, heads * d->v_dim, 2 * inner, inner,
                                d->hidden};
    int64_t at[10], total = 0;
    for (int i = 0; i < 10; i++) at[i] = total, total += (rows * widths[i] * elem + 63) & ~(int64_t)63;
    /* the quantized activations: a Linear's (its widest input) or the heads' products' (every head's rows) */
    const int64_t k_max = max64(max64(d->hidden, d->q_lora_rank), max64(heads * d->v_dim, inner));
    const int64_t scratch = max64(rows * act_row_bytes_max(k_max), heads * rows * act_row_bytes_max(max64(rank, d->nope_dim)));
    const int64_t pairs = rows * top_k, ints_at = total + ((scratch + 63) & ~(int64_t)63);
    const int64_t floats_at = ints_at + (2 * pairs + 3 * n_experts) * (int64_t)sizeof(int64_t);
    char *arena = malloc((size_t)(floats_at + 2 * pairs * elem + 64));
    if (arena == NULL) return RV_ERR_NO_MEMORY;
    char **slots[10] = {&b->h, &b->qa, &b->q, &b->kv, &b->qabs, &b->att, &b->vals, &b->gu, &b->act, &b->moe_y};
    for (int i = 0; i < 10; i++) *slots[i] = arena + at[i];
    b->scratch = arena + total;
    b->ids = (int64_t *)(arena + ints_at), b->tokens = b->ids + pairs, b->spans = b->tokens + pairs;
    b->weights = arena + floats_at, b->w_sorted = arena + floats_at + pairs * elem;
    b->arena = arena;
    return RV_OK;
}

/* The step's rows' query and pool rows of layer l from h, the pool rows written at each row's last
 * position: qabs [rows, heads, rank + rope] = [q_nope through attn_k_b, rotated q_rope]. */
static int project(const mla_layer *l, const mla_dims *d, mla_buffers *b, int64_t rows, const float *rope,
                   const int64_t *req_pool_idx, const int64_t *kv_lens, const int64_t *page_table, int64_t pt_stride,
                   int64_t page_size) {
    const int dtype = (int)d->dtype;
    const int64_t hidden = d->hidden, heads = d->heads, rank = d->kv_lora_rank, rd = d->rope_dim;
    const int64_t qd = d->nope_dim + rd, q_n = heads * qd, kv_n = rank + rd, row_n = heads * (rank + rd);
    int status;
    if (d->q_lora_rank > 0) {
        const int64_t r = d->q_lora_rank;
        if ((status = decode_linear_run(&l->linear[Q_A], r, hidden, b->h, rows, b->scratch, b->qa, dtype, NULL)) != 0)
            return status;
        rms_norm(b->qa, r, l->q_a_norm, b->qa, rows, (int)r, d->latent_eps, dtype);
        status = decode_linear_run(&l->linear[Q], q_n, r, b->qa, rows, b->scratch, b->q, dtype, NULL);
    } else {
        status = decode_linear_run(&l->linear[Q], q_n, hidden, b->h, rows, b->scratch, b->q, dtype, NULL);
    }
    if (status != 0) return status;
    if ((status = decode_linear_run(&l->linear[KV_A], kv_n, hidden, b->h, rows, b->scratch, b->kv, dtype, NULL)) != 0)
        return status;
    float v[1024];
    for (int64_t r = 0; r < rows; r++) {
        const float *f = rope + r * rd;
        rotate_pairs(b->kv, r * kv_n + rank, 0, 1, (int)rd, f, dtype);
        rotate_pairs(b->q, r * q_n + d->nope_dim, qd, heads, (int)rd, f, dtype);
        /* the latent normed in place; then the row, rounded to the pool's dtype, at its position */
        char *kv_row = b->kv + r * kv_n * (dtype == DTYPE_BF16 ? 2 : 4);
        rms_norm(kv_row, kv_n, l->kv_a_norm, kv_row, 1, (int)rank, d->latent_eps, dtype);
        const int64_t pos = kv_lens[r] - 1, slot = page_table[req_pool_idx[r] * pt_stride + pos / page_size];
        const int64_t dst = (slot * page_size + pos % page_size) * kv_n;
        for (int64_t i0 = 0; i0 < kv_n; i0 += 1024) {
            const int n = kv_n - i0 < 1024 ? (int)(kv_n - i0) : 1024;
            load_vec(b->kv, dtype, r * kv_n + i0, n, v);
            store_pool(l->cache, (int)d->kv_dtype, dst + i0, n, v);
        }
        for (int64_t hd = 0; hd < heads; hd++) { /* each head's rotated q_rope after its latent part */
            load_vec(b->q, dtype, r * q_n + hd * qd + d->nope_dim, (int)rd, v);
            store_vec(b->qabs, dtype, r * row_n + hd * (rank + rd) + rank, (int)rd, v);
        }
    }
    return latent_heads_matmul((int)l->k_b_type, l->k_b, heads, rank, d->nope_dim, b->q, q_n, qd, rows, b->scratch,
                               b->qabs, row_n, rank + rd, dtype);
}

/* x += the attention's output: att (each head's attended latent) through attn_v_b, then o. */
static int attend_out(const mla_layer *l, const mla_dims *d, mla_buffers *b, void *x, int64_t rows,
                      const int64_t *q_rows, const int64_t *req_pool_idx, const int64_t *kv_lens,
                      const int64_t *page_table, int64_t pt_stride, int64_t page_size) {
    const int dtype = (int)d->dtype;
    const int64_t heads = d->heads, rank = d->kv_lora_rank, dim = rank + d->rope_dim, vd = d->v_dim;
    int status = latent_decode_attention(b->qabs, heads * dim, l->cache, b->att, heads * rank, dtype, (int)d->kv_dtype,
                                         q_rows, req_pool_idx, kv_lens, page_table, pt_stride, rows, (int)heads,
                                         (int)dim, (int)rank, (int)page_size, d->scale);
    if (status != 0) return status;
    status = latent_heads_matmul((int)l->v_b_type, l->v_b, heads, vd, rank, b->att, heads * rank, rank, rows,
                                 b->scratch, b->vals, heads * vd, vd, dtype);
    if (status != 0) return status;
    return decode_linear_run(&l->linear[O], d->hidden, heads * vd, b->vals, rows, b->scratch, x, dtype, x);
}

/* y = y + down(silu(gate) * up) of h (the dense MLP into x, the shared experts into the routed sum). */
static int mlp_into(const mla_layer *l, const mla_dims *d, mla_buffers *b, int64_t rows, void *y) {
    const int dtype = (int)d->dtype;
    const int64_t inner = l->inner;
    int status = decode_linear_run(&l->linear[GATE_UP], 2 * inner, d->hidden, b->h, rows, b->scratch, b->gu, dtype, NULL);
    if (status != 0) return status;
    silu_mul(b->gu, b->act, rows, (int)inner, dtype);
    return decode_linear_run(&l->linear[DOWN], d->hidden, inner, b->act, rows, b->scratch, y, dtype, y);
}

/* x += DeepSeek's mixture of experts of h: the routed experts' weighted sum plus the shared experts'. */
static int experts_into(const mla_layer *l, const mla_dims *d, mla_buffers *b, void *x, int64_t rows) {
    const int dtype = (int)d->dtype;
    const int64_t hidden = d->hidden, pairs = rows * l->top_k;
    int status = moe_route(b->h, rows, hidden, l->router, l->n_experts, l->top_k, 0, b->ids, b->weights, dtype);
    if (status != 0) return status;
    if (l->route_scale != 1.0f) { /* the weights times routed_scaling_factor, rounded (torch's mul) */
        float w[64];
        for (int64_t i0 = 0; i0 < pairs; i0 += 64) {
            const int n = pairs - i0 < 64 ? (int)(pairs - i0) : 64;
            load_vec(b->weights, dtype, i0, n, w);
            for (int i = 0; i < n; i++) w[i] *= l->route_scale;
            store_vec(b->weights, dtype, i0, n, w);
        }
    }
    int64_t n_spans = 0;
    status = moe_group(b->ids, b->weights, rows, l->top_k, l->n_experts, b->tokens, b->w_sorted, b->spans, &n_spans,
                       dtype);
    if (status != 0) return status;
    status = moe_experts(l->experts, hidden, l->expert_inner, b->h, b->tokens, b->w_sorted, b->spans, n_spans, pairs,
                         rows, b->moe_y, dtype);
    if (status != 0) return status;
    if (l->inner > 0 && (status = mlp_into(l, d, b, rows, b->moe_y)) != 0) return status;
    decode_add_into(x, b->moe_y, rows * hidden, dtype);
    return RV_OK;
}

/* out [rows, hidden] = the residual stream after every layer, from x [rows, hidden] (the embedding
 * rows; not written). rope: [rows, rope_dim] float32, each row's complex factors (re, im) at its
 * position. The attention arguments are latent_decode_attention's (q_rows: the rows in order, each
 * row's new pool row written at position kv_lens - 1). Returns RV_OK, RV_ERR_NO_MEMORY, or the
 * status of the kernel call that refused. */
int decode_mla(const mla_layer *layers, int64_t n_layers, const mla_dims *dims, const void *x, void *out,
               int64_t rows, const float *rope, const int64_t *q_rows, const int64_t *req_pool_idx,
               const int64_t *kv_lens, const int64_t *page_table, int64_t pt_stride, int64_t page_size) {
    const int dtype = (int)dims->dtype;
    const int kv = (int)dims->kv_dtype;
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return RV_ERR_DTYPE;
    if (kv != DTYPE_F32 && kv != DTYPE_BF16 && kv != DTYPE_F16 && kv != DTYPE_F8E4M3) return RV_ERR_DTYPE;
    if (dims->rope_dim > 256 || dims->rope_dim % 2 != 0 || dims->kv_lora_rank + dims->rope_dim > 1024)
        return RV_ERR_HEADS;
    mla_buffers b;
    int status = buffers(&b, layers, n_layers, dims, rows);
    if (status != 0) return status;
    const int64_t hidden = dims->hidden;
    memcpy(out, x, (size_t)(rows * hidden * (dtype == DTYPE_BF16 ? 2 : 4)));
    for (int64_t li = 0; li < n_layers && status == 0; li++) {
        const mla_layer *l = layers + li;
        rms_norm(out, hidden, l->input_norm, b.h, rows, (int)hidden, dims->eps, dtype);
        status = project(l, dims, &b, rows, rope, req_pool_idx, kv_lens, page_table, pt_stride, page_size);
        if (status == 0)
            status = attend_out(l, dims, &b, out, rows, q_rows, req_pool_idx, kv_lens, page_table, pt_stride, page_size);
        if (status != 0) break;
        rms_norm(out, hidden, l->post_norm, b.h, rows, (int)hidden, dims->eps, dtype);
        status = l->router != NULL ? experts_into(l, dims, &b, out, rows) : mlp_into(l, dims, &b, rows, out);
    }
    free(b.arena);
    return status;
}
