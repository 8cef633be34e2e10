/* A mixture of experts' experts over one step's rows, in one call, on GGUF blocks
 * (gpu_worker/backends/cpu/experts.py; the model's side is gpu_worker/models/moe.py).
 *
 * The caller hands the (token, expert) pairs sorted by expert: pair i is token tokens[i], routed with
 * probability weights[i]; spans lists (expert, start, count) for each expert with pairs. Per expert
 * with pairs, over all of its rows at once (its weights read once per step):
 *   gu = x_rows [Wgate; Wup]^T (gate and up each a matmul writing its half); a = silu(gate) * up;
 *   y_rows = a Wdown^T
 * Then out[token] += y * weight per pair, pairs in order (experts ascending, as the torch path and
 * HF's eager experts add them), the product rounded to the activations' dtype before the add.
 *
 * One OpenMP region runs the whole block: the pairs' rows quantized, every expert's gate and up,
 * silu * up and the quantized act rows, every expert's down and the weighted sum (split by hidden
 * columns). The gate/up and down phases share the (expert, projection, column panel) units out by
 * their cost, rows plus a panel's read, so a thread streams a run of experts' panels whatever the
 * number of experts with rows, each projection's panels in turn (the one-row tiles prefetch ahead
 * within the rows they stream); a matmul per expert and projection had a region each (24 a layer
 * at one row, some 330 at 32). Each output element is computed by the same tile, with the same
 * rounding, as quant_matmul computes it, and summed in the same order, so the result is
 * quant_matmul's, bit for bit, expert by expert.
 *
 * A projection of an expert with its dense_min_rows rows or more (a long prefill) runs as
 * quant_matmul_dense (as QuantLinear runs it), outside the region: gate and up before it; down
 * after it, the region then ending at the quantized act rows and a second running down and the
 * sum. One with its a8_min_rows rows or more meets 8-bit activations (type | QTYPE_A8, as
 * QuantLinear's call): its expert's rows are quantized in that format. */
#include "quant.h"
#include "rivulet_kernels.h"
#include <stdlib.h>

enum { GATE, UP, DOWN, PROJECTIONS };

#define PANEL_ROWS 4 /* a panel's read, in rows' worth of compute, for the split */

/* y rows [count] (dtype, y_stride apart) = the rows' quantized activations xq (xrb apart) times
 * columns [c0, c1) of expert e's projection p, as quant_matmul computes them. */
static void panel_matmul(const moe_projection *p, const qtype_ops *ops, int64_t e, const uint8_t *xq, int64_t xrb,
                         int64_t count, int64_t c0, int64_t c1, void *y, int64_t y_stride, int dtype) {
    const int64_t nb = p->row_bytes / ops->block_bytes; /* in ops' blocks (8-bit legacy ops: 8 blocks of 32) */
    quant_panel(ops, p->w + e * p->n * p->row_bytes, p->row_bytes, nb, c0, c1 - c0, xq, xrb, 0, count, y, y_stride,
                dtype, NULL, 0);
}

/* Thread t of nt's share [*first, *last) of the units u = span * per_span + panel (per_span
 * panels a span; a unit of span s costs its rows + PANEL_ROWS, a span whose bit ``mask`` of
 * dense[s] is set nothing):
 * the units whose cost midpoint falls in its fraction of the total, a contiguous run. */
static void my_units(const int64_t *spans, int64_t n_spans, const char *dense, int mask, int64_t per_span, int t,
                     int nt, int64_t *first, int64_t *last) {
    double total = 0.0;
    for (int64_t s = 0; s < n_spans; s++)
        if ((dense[s] & mask) != mask) total += (double)per_span * (double)(spans[3 * s + 2] + PANEL_ROWS);
    const double lo = total * t / nt, hi = total * (t + 1) / nt;
    double at = 0.0;
    *first = *last = 0;
    int found = 0;
    for (int64_t s = 0; s < n_spans; s++) {
        if ((dense[s] & mask) == mask) continue;
        const double cost = (double)(spans[3 * s + 2] + PANEL_ROWS);
        for (int64_t u = 0; u < per_span; u++, at += cost) {
            const double mid = at + 0.5 * cost;
            if (mid < lo) continue;
            if (mid >= hi) return;
            if (!found) *first = s * per_span + u, found = 1;
            *last = s * per_span + u + 1;
        }
    }
}

/* Rows [start, start + count) of projection p of expert e on the dense path (quant_matmul_dense):
 * y (y_stride apart) = x (k values a row, contiguous) W^T. */
static int dense_part(const moe_projection *p, int64_t e, int64_t k, const char *x, int64_t count, char *y,
                      int64_t y_stride, int dtype) {
    return quant_matmul_dense((int)p->type, p->w + e * p->n * p->row_bytes, p->n, k, x, k, dtype, count, y, y_stride,
                              dtype, NULL, 0);
}

/* xq (one act row) = row ``src`` of n values (dtype) quantized; tmp: n floats. */
static void quantize_row(const qtype_ops *ops, const void *src, int64_t n, int dtype, float *tmp, uint8_t *xq) {
    if (dtype == DTYPE_F32) {
        ops->quantize_act((const float *)src, n, xq);
    } else {
        load_vec(src, dtype, 0, (int)n, tmp);
        ops->quantize_act(tmp, n, xq);
    }
}

/* gpt-oss's experts (moe_experts_clamped): biases on the three projections, the clamped SwiGLU. */
typedef struct {
    const void *gate_up_bias; /* [experts, 2 inner] (dtype): gate's then up's, as the gu rows */
    const void *down_bias;    /* [experts, hidden] (dtype) */
    float alpha, limit;
} clamped_act;

/* The span that pair i falls in (spans sorted by start, covering [0, pairs)). */
static int64_t span_of(const int64_t *spans, int64_t n_spans, int64_t i) {
    int64_t lo = 0, hi = n_spans - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (spans[3 * mid + 1] <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* v[i] = sigmoid(v[i]) = 1 / (1 + exp(-v)), as e / (1 + e) below 0 (e = exp(-|v|), never past 1). */
static void sigmoid_vec(float *v, int n) {
#if HAVE_AVX512
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xffffu : (__mmask16)((1u << (n - i)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(m, v + i), one = _mm512_set1_ps(1.0f);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
        const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 d = _mm512_add_ps(one, e);
        _mm512_mask_storeu_ps(v + i, m, _mm512_mask_div_ps(_mm512_div_ps(one, d), neg, e, d));
    }
#elif HAVE_AVX2
    for (int i = 0; i < n; i += 8) {
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - i), lanes);
        const __m256 x = _mm256_maskload_ps(v + i, m), one = _mm256_set1_ps(1.0f);
        const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x)));
        const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
        const __m256 d = _mm256_add_ps(one, e);
        _mm256_maskstore_ps(v + i, m, _mm256_blendv_ps(_mm256_div_ps(one, d), _mm256_div_ps(e, d), neg));
    }
#else
    for (int i = 0; i < n; i++) {
        const float e = exp_nonpositive(-fabsf(v[i]));
        v[i] = (v[i] < 0.0f ? e : 1.0f) / (1.0f + e);
    }
#endif
}

#define PIECE 256

/* out = (up + 1) * (gate * sigmoid(alpha gate)) of one gu row [gate (inner) | up (inner)] plus its
 * expert's biases, the gate clamped from above at limit and up from both sides; each torch op of
 * models/gpt_oss.py's glu (and QuantLinear's bias add) rounded to the dtype in turn. */
static void clamped_swiglu_row(const void *gate_up, const clamped_act *c, int64_t e, void *out, int64_t inner,
                               int dtype) {
    float g[PIECE], u[PIECE], b[PIECE], t[PIECE];
    const float limit = c->limit;
    for (int64_t i0 = 0; i0 < inner; i0 += PIECE) {
        const int n = inner - i0 < PIECE ? (int)(inner - i0) : PIECE;
        load_vec(gate_up, dtype, i0, n, g);
        load_vec(gate_up, dtype, inner + i0, n, u);
        load_vec(c->gate_up_bias, dtype, e * 2 * inner + i0, n, b);
        for (int i = 0; i < n; i++) g[i] += b[i];
        load_vec(c->gate_up_bias, dtype, e * 2 * inner + inner + i0, n, b);
        for (int i = 0; i < n; i++) u[i] += b[i];
        round_vec(dtype, g, n);
        round_vec(dtype, u, n);
        for (int i = 0; i < n; i++) {
            g[i] = g[i] > limit ? limit : g[i];
            u[i] = u[i] > limit ? limit : u[i] < -limit ? -limit : u[i];
            t[i] = g[i] * c->alpha;
        }
        round_vec(dtype, t, n);
        sigmoid_vec(t, n);
        round_vec(dtype, t, n);
        for (int i = 0; i < n; i++) t[i] *= g[i];
        round_vec(dtype, t, n);
        for (int i = 0; i < n; i++) u[i] += 1.0f;
        round_vec(dtype, u, n);
        for (int i = 0; i < n; i++) t[i] *= u[i];
        store_vec(out, dtype, i0, n, t);
    }
}

enum { D_GATE = 1, D_UP = 2, D_DOWN = 4, A_GU = 8, A_DOWN = 16 }; /* a span's bits: dense paths, 8-bit acts */

/* One call's state, shared by its threads. */
typedef struct {
    const moe_projection *proj;
    const qtype_ops *ops[PROJECTIONS], *ops8[PROJECTIONS]; /* ops8: the 8-bit activations' (NULL: none) */
    int64_t hidden, inner, elem, xrb, arb;                  /* xrb, arb: a quantized x / act row's bytes */
    const void *x, *weights;
    const int64_t *tokens, *spans;
    int64_t n_spans, pairs, tokens_n;
    void *out;
    int dtype;
    const clamped_act *clamp;
    int64_t gu_panel, down_panel, gu_units, down_units; /* columns a panel; panels a projection */
    char *gu, *act, *y, *dense, *pair_span;             /* dense: a span's bits; pair_span: its pair's */
    uint8_t *xq, *aq;
    float *sum;
} moe_run;

/* Thread t of nt's gate and up panels: per span every gate panel, then every up panel, so that a
 * run of units streams each projection's rows front to back (the tiles' prefetch runs ahead into
 * the panel that comes next, not into the other projection's). */
static void gate_up_panels(const moe_run *m, int t, int nt) {
    int64_t first, last;
    my_units(m->spans, m->n_spans, m->dense, D_GATE | D_UP, 2 * m->gu_units, t, nt, &first, &last);
    for (int64_t unit = first; unit < last; unit++) {
        const int64_t s = unit / (2 * m->gu_units), u = unit % (2 * m->gu_units);
        const int p = u < m->gu_units ? GATE : UP;
        if (m->dense[s] & (p == GATE ? D_GATE : D_UP)) continue;
        const int64_t e = m->spans[3 * s], start = m->spans[3 * s + 1], count = m->spans[3 * s + 2];
        const int64_t c0 = u % m->gu_units * m->gu_panel, end = c0 + m->gu_panel;
        const qtype_ops *ops = m->dense[s] & A_GU ? m->ops8[p] : m->ops[p];
        char *gus = m->gu + (start * 2 * m->inner + (p == UP ? m->inner : 0)) * m->elem;
        panel_matmul(&m->proj[p], ops, e, m->xq + start * m->xrb, m->xrb, count, c0, end < m->inner ? end : m->inner,
                     gus, 2 * m->inner, m->dtype);
    }
}

/* Inside a region: thread t of nt's down panels, then (all panels done) out[token] += y * weight,
 * pairs in order, each product and sum rounded to dtype, the hidden columns split over threads. */
static void down_and_sum(const moe_run *m, int t, int nt) {
    const int64_t hidden = m->hidden;
    int64_t first, last;
    my_units(m->spans, m->n_spans, m->dense, D_DOWN, m->down_units, t, nt, &first, &last);
    for (int64_t unit = first; unit < last; unit++) {
        const int64_t s = unit / m->down_units, u = unit % m->down_units;
        const int64_t e = m->spans[3 * s], start = m->spans[3 * s + 1], count = m->spans[3 * s + 2];
        const int64_t c0 = u * m->down_panel, c1 = c0 + m->down_panel < hidden ? c0 + m->down_panel : hidden;
        if (!(m->dense[s] & D_DOWN))
            panel_matmul(&m->proj[DOWN], m->dense[s] & A_DOWN ? m->ops8[DOWN] : m->ops[DOWN], e, m->aq + start * m->arb,
                         m->arb, count, c0, c1, m->y + start * hidden * m->elem, hidden, m->dtype);
    }
#pragma omp barrier
    const int64_t h0 = hidden * t / nt / 16 * 16, h1 = t == nt - 1 ? hidden : hidden * (t + 1) / nt / 16 * 16;
    const int hn = (int)(h1 - h0);
    float term[256], bias[256];
    for (int64_t tok = 0; tok < m->tokens_n; tok++) memset(m->sum + tok * hidden + h0, 0, (size_t)hn * sizeof(float));
    for (int64_t i = 0, s = 0; i < m->pairs; i++) {
        while (m->spans[3 * s + 1] + m->spans[3 * s + 2] <= i) s++;
        const int64_t expert = m->spans[3 * s];
        float wt;
        load_vec(m->weights, m->dtype, i, 1, &wt);
        float *dst = m->sum + m->tokens[i] * hidden + h0;
        for (int j0 = 0; j0 < hn; j0 += 256) {
            const int n = hn - j0 < 256 ? hn - j0 : 256;
            load_vec(m->y, m->dtype, i * hidden + h0 + j0, n, term);
            if (m->clamp != NULL) { /* down's bias, rounded as QuantLinear's add */
                load_vec(m->clamp->down_bias, m->dtype, expert * hidden + h0 + j0, n, bias);
                for (int j = 0; j < n; j++) term[j] += bias[j];
                round_vec(m->dtype, term, n);
            }
            for (int j = 0; j < n; j++) term[j] *= wt;
            round_vec(m->dtype, term, n);
            for (int j = 0; j < n; j++) dst[j0 + j] += term[j];
            round_vec(m->dtype, dst + j0, n);
        }
    }
    for (int64_t tok = 0; tok < m->tokens_n && hn > 0; tok++)
        store_vec(m->out, m->dtype, tok * hidden + h0, hn, m->sum + tok * hidden + h0);
}

/* The quantized x rows, gate and up, the act rows quantized (and, where no span's down is dense,
 * down and the sum, in the same region); 0, or RV_ERR_NO_MEMORY. */
static int first_region(const moe_run *m, int any_dense_down) {
    int failed = 0;
#pragma omp parallel
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        float *tmp = malloc((size_t)(m->hidden > m->inner ? m->hidden : m->inner) * sizeof(float));
        if (tmp == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* the pairs' rows, quantized from x (rows on the dense path too: cheap, and no branch per pair) */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m->pairs; i++)
            if (tmp != NULL) {
                const char *xi = (const char *)m->x + m->tokens[i] * m->hidden * m->elem;
                quantize_row(m->pair_span[i] & A_GU ? m->ops8[GATE] : m->ops[GATE], xi, m->hidden, m->dtype, tmp,
                             m->xq + i * m->xrb);
            }
        int failed_here;
#pragma omp atomic read
        failed_here = failed;
        if (!failed_here) gate_up_panels(m, t, nt);
#pragma omp barrier
        /* act = silu(gate) * up per pair, then quantized for down */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m->pairs; i++) {
            if (failed_here) continue;
            const char *gu = m->gu + i * 2 * m->inner * m->elem;
            char *act = m->act + i * m->inner * m->elem;
            if (m->clamp != NULL)
                clamped_swiglu_row(gu, m->clamp, m->spans[3 * span_of(m->spans, m->n_spans, i)], act, m->inner,
                                   m->dtype);
            else
                silu_mul_row(gu, act, (int)m->inner, m->dtype);
            quantize_row(m->pair_span[i] & A_DOWN ? m->ops8[DOWN] : m->ops[DOWN], act, m->inner, m->dtype, tmp,
                         m->aq + i * m->arb);
        }
        free(tmp);
        if (!failed_here && !any_dense_down) down_and_sum(m, t, nt);
    }
    return failed ? RV_ERR_NO_MEMORY : 0;
}

/* The activation ops of each projection (m->ops, m->ops8), checked against the sizes; 0 or a status. */
static int expert_ops(moe_run *m) {
    const moe_projection *proj = m->proj;
    const int64_t hidden = m->hidden, inner = m->inner;
    if (proj[GATE].n != inner || proj[UP].n != inner || proj[DOWN].n != hidden) return RV_ERR_EXPERT_SIZE;
    if (proj[GATE].a8_min_rows != proj[UP].a8_min_rows) return RV_ERR_EXPERT_FORMATS;
    for (int p = 0; p < PROJECTIONS; p++)
        if ((m->ops[p] = quant_ops((int)proj[p].type)) == NULL) return RV_ERR_EXPERT_FORMATS;
    const qtype_ops *gate_ops = m->ops[GATE], *up_ops = m->ops[UP], *down_ops = m->ops[DOWN];
    if (gate_ops->quantize_act != up_ops->quantize_act || gate_ops->act_block_bytes != up_ops->act_block_bytes ||
        gate_ops->block != up_ops->block || hidden % gate_ops->block != 0 || inner % down_ops->block != 0)
        return RV_ERR_EXPERT_FORMATS;
    if (((gate_ops->type | up_ops->type | down_ops->type) & QTYPE_X8) && (inner % 8 != 0 || hidden % 8 != 0))
        return RV_ERR_EXPERT_FORMATS;
    /* the 8-bit activations' ops, where some span takes them (NULL: none does) */
    int64_t most = 0;
    for (int64_t s = 0; s < m->n_spans; s++) most = m->spans[3 * s + 2] > most ? m->spans[3 * s + 2] : most;
    m->ops8[GATE] = m->ops8[UP] = m->ops8[DOWN] = NULL;
    if (proj[GATE].a8_min_rows <= most) {
        m->ops8[GATE] = quant_ops((int)proj[GATE].type | QTYPE_A8), m->ops8[UP] = quant_ops((int)proj[UP].type | QTYPE_A8);
        if (m->ops8[GATE] == NULL || m->ops8[UP] == NULL || hidden % m->ops8[GATE]->block != 0)
            return RV_ERR_EXPERT_FORMATS;
    }
    if (proj[DOWN].a8_min_rows <= most &&
        ((m->ops8[DOWN] = quant_ops((int)proj[DOWN].type | QTYPE_A8)) == NULL || inner % m->ops8[DOWN]->block != 0))
        return RV_ERR_EXPERT_FORMATS;
    m->xrb = m->ops8[GATE] != NULL ? act_row_bytes_max(hidden) : hidden / gate_ops->block * gate_ops->act_block_bytes;
    m->arb = m->ops8[DOWN] != NULL ? act_row_bytes_max(inner) : inner / down_ops->block * down_ops->act_block_bytes;
    /* panels in the 8-bit tiles' units where some span runs them */
    const int64_t gu_bytes = proj[GATE].row_bytes > proj[UP].row_bytes ? proj[GATE].row_bytes : proj[UP].row_bytes;
    m->gu_panel = quant_panel_cols(m->ops8[GATE] != NULL ? m->ops8[GATE] : gate_ops, gu_bytes);
    m->down_panel = quant_panel_cols(m->ops8[DOWN] != NULL ? m->ops8[DOWN] : down_ops, proj[DOWN].row_bytes);
    m->gu_units = (inner + m->gu_panel - 1) / m->gu_panel, m->down_units = (hidden + m->down_panel - 1) / m->down_panel;
    return 0;
}

/* Each span's bits (dense paths, 8-bit activations), and gate and up of the spans whose rows take
 * the dense path (their rows of x copied side by side into ``rows``); 0 or a dense matmul's status. */
static int dense_spans(const moe_run *m, char *rows, int *any_dense_down) {
    const moe_projection *proj = m->proj;
    const int64_t hidden = m->hidden, inner = m->inner, elem = m->elem;
    *any_dense_down = 0;
    for (int64_t s = 0; s < m->n_spans; s++) {
        const int64_t e = m->spans[3 * s], start = m->spans[3 * s + 1], count = m->spans[3 * s + 2];
        m->dense[s] = (char)((count >= proj[GATE].dense_min_rows ? D_GATE : 0) |
                             (count >= proj[UP].dense_min_rows ? D_UP : 0) |
                             (count >= proj[DOWN].dense_min_rows ? D_DOWN : 0) |
                             (m->ops8[GATE] != NULL && count >= proj[GATE].a8_min_rows ? A_GU : 0) |
                             (m->ops8[DOWN] != NULL && count >= proj[DOWN].a8_min_rows ? A_DOWN : 0));
        memset(m->pair_span + start, m->dense[s], (size_t)count);
        *any_dense_down |= (m->dense[s] & D_DOWN) != 0;
        if (!(m->dense[s] & (D_GATE | D_UP))) continue;
        /* the dense path reads its span's rows of x side by side; the integer path quantizes each
         * pair's row from x where it is */
        for (int64_t i = start; i < start + count; i++)
            memcpy(rows + i * hidden * elem, (const char *)m->x + m->tokens[i] * hidden * elem, (size_t)(hidden * elem));
        const char *xs = rows + start * hidden * elem;
        char *gus = m->gu + start * 2 * inner * elem;
        int status = 0;
        if (m->dense[s] & D_GATE) status = dense_part(&proj[GATE], e, hidden, xs, count, gus, 2 * inner, m->dtype);
        if ((m->dense[s] & D_UP) && status == 0)
            status = dense_part(&proj[UP], e, hidden, xs, count, gus + inner * elem, 2 * inner, m->dtype);
        if (status != 0) return status;
    }
    return 0;
}

/* Down of the spans whose rows take the dense path, then every other's down and the sum. */
static int dense_down_then_rest(const moe_run *m) {
    for (int64_t s = 0; s < m->n_spans; s++)
        if (m->dense[s] & D_DOWN) {
            const int64_t start = m->spans[3 * s + 1];
            const int status = dense_part(&m->proj[DOWN], m->spans[3 * s], m->inner, m->act + start * m->inner * m->elem,
                                          m->spans[3 * s + 2], m->y + start * m->hidden * m->elem, m->hidden, m->dtype);
            if (status != 0) return status;
        }
#pragma omp parallel
    down_and_sum(m, omp_get_thread_num(), omp_get_num_threads());
    return 0;
}

/* moe_experts (below), silu(gate) * up where clamp is NULL, else moe_experts_clamped's biases and act.
 * One region runs the whole block where no span's down takes the dense path (few rows a span), two
 * otherwise, that down between them. */
static int run_experts(const moe_projection *proj, int64_t hidden, int64_t inner, const void *x,
                       const int64_t *tokens, const void *weights, const int64_t *spans, int64_t n_spans,
                       int64_t pairs, int64_t tokens_n, void *out, int dtype, const clamped_act *clamp) {
    moe_run m = {.proj = proj, .hidden = hidden, .inner = inner, .elem = dtype == DTYPE_BF16 ? 2 : 4, .x = x,
                 .weights = weights, .tokens = tokens, .spans = spans, .n_spans = n_spans, .pairs = pairs,
                 .tokens_n = tokens_n, .out = out, .dtype = dtype, .clamp = clamp};
    int status = expert_ops(&m);
    if (status != 0) return status;
    const int64_t elem = m.elem;
    /* one arena: the pairs' rows of x (copied for dense spans only), gate_up, act, y; the quantized x
     * and act rows; the sums; the spans' and pairs' bits */
    const int64_t at_gu = pairs * hidden * elem, at_act = at_gu + pairs * 2 * inner * elem;
    const int64_t at_y = at_act + pairs * inner * elem, at_xq = (at_y + pairs * hidden * elem + 63) & ~(int64_t)63;
    const int64_t at_aq = at_xq + pairs * m.xrb, at_sum = (at_aq + pairs * m.arb + 63) & ~(int64_t)63;
    const int64_t at_bits = at_sum + tokens_n * hidden * (int64_t)sizeof(float);
    char *arena = malloc((size_t)(at_bits + n_spans + pairs));
    if (arena == NULL) return RV_ERR_NO_MEMORY;
    m.gu = arena + at_gu, m.act = arena + at_act, m.y = arena + at_y;
    m.xq = (uint8_t *)arena + at_xq, m.aq = (uint8_t *)arena + at_aq, m.sum = (float *)(arena + at_sum);
    m.dense = arena + at_bits, m.pair_span = m.dense + n_spans;
    int any_dense_down;
    status = dense_spans(&m, arena, &any_dense_down);
    if (status == 0) status = first_region(&m, any_dense_down);
    if (status == 0 && any_dense_down) status = dense_down_then_rest(&m);
    free(arena);
    return status;
}

/* out [tokens_n, hidden] (written whole) = each token's experts' outputs, weighted and summed; x
 * [tokens_n, hidden] rows contiguous; weights [pairs] in x's dtype; spans [n_spans][3]. Returns RV_OK,
 * RV_ERR_NO_MEMORY, RV_ERR_EXPERT_SIZE (an expert size that does not match the projections),
 * RV_ERR_EXPERT_FORMATS (projections whose activation formats differ, or unsupported types or
 * sizes), or the status of a dense matmul that refused. */
int moe_experts(const moe_projection *proj, int64_t hidden, int64_t inner, const void *x, const int64_t *tokens,
                const void *weights, const int64_t *spans, int64_t n_spans, int64_t pairs, int64_t tokens_n,
                void *out, int dtype) {
    return run_experts(proj, hidden, inner, x, tokens, weights, spans, n_spans, pairs, tokens_n, out, dtype, NULL);
}

/* moe_experts for gpt-oss's experts: gu = x [Wgate; Wup]^T + gate_up_bias[e] ([experts, 2 inner],
 * gate's then up's, dtype), a = the clamped SwiGLU of gu (clamped_swiglu_row), y = a Wdown^T +
 * down_bias[e] ([experts, hidden], dtype), each bias added and rounded as QuantLinear adds it. */
int moe_experts_clamped(const moe_projection *proj, int64_t hidden, int64_t inner, const void *x,
                        const int64_t *tokens, const void *weights, const int64_t *spans, int64_t n_spans,
                        int64_t pairs, int64_t tokens_n, void *out, int dtype, const void *gate_up_bias,
                        const void *down_bias, float alpha, float limit) {
    const clamped_act clamp = {gate_up_bias, down_bias, alpha, limit};
    return run_experts(proj, hidden, inner, x, tokens, weights, spans, n_spans, pairs, tokens_n, out, dtype,
                       &clamp);
}

/* logits [rows, n_experts] (float32) = x [rows, hidden] (dtype) w^T (w [n_experts, hidden], dtype),
 * each summed in float32. Returns RV_OK or RV_ERR_NO_MEMORY. */
static int router_logits(const void *x, int64_t rows, int64_t hidden, const void *w, int64_t n_experts,
                         float *logits, int dtype) {
    float *xf = malloc((size_t)(rows * hidden) * sizeof(float)); /* x as float32, once */
    if (xf == NULL) return RV_ERR_NO_MEMORY;
    load_vec(x, dtype, 0, (int)(rows * hidden), xf);
    int failed = 0;
#if HAVE_AVX512
    if (dtype == DTYPE_F32 && hidden % 16 == 0) { /* 4 experts against every row in turn: 4 FMA chains, not 1, and
                                                    * the 4 experts' weights stay in L1 while the rows pass */
        const int64_t quads = (n_experts + 3) / 4;
#pragma omp parallel for schedule(static) if (rows * n_experts * hidden >= 1 << 16)
        for (int64_t i = 0; i < rows * quads; i++) {
            const int64_t r = i % rows, e0 = i / rows * 4, ne = n_experts - e0 < 4 ? n_experts - e0 : 4;
            const float *xr = xf + r * hidden, *we = (const float *)w + e0 * hidden;
            __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int64_t j = 0; j < hidden; j += 16) {
                const __m512 xv = _mm512_loadu_ps(xr + j);
                for (int k = 0; k < 4; k++)
                    if (k < ne) a[k] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(we + k * hidden + j), a[k]);
            }
            for (int k = 0; k < ne; k++) logits[r * n_experts + e0 + k] = _mm512_reduce_add_ps(a[k]);
        }
    } else
#endif
#pragma omp parallel if (rows * n_experts * hidden >= 1 << 16)
    {
        /* bf16 router rows widened here; float32 ones read in place */
        float *wr = dtype == DTYPE_F32 ? NULL : malloc((size_t)hidden * sizeof(float));
        if (dtype != DTYPE_F32 && wr == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows * n_experts; i++) {
            const int64_t r = i / n_experts, e = i % n_experts;
            const float *we = (const float *)w + e * hidden;
            if (dtype != DTYPE_F32) {
                if (wr == NULL) continue;
                load_vec(w, dtype, e * hidden, (int)hidden, wr);
                we = wr;
            }
            const float *xr = xf + r * hidden;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < hidden; j++) sum += xr[j] * we[j];
            logits[i] = sum;
        }
        free(wr);
    }
    free(xf);
    return failed ? RV_ERR_NO_MEMORY : RV_OK;
}

/* ids [top_k] = the top_k largest of p [n] (the larger first, the lower index on a tie), top their
 * values; returns their sum. */
static float top_k_of(const float *p, int64_t n, int64_t top_k, int64_t *ids, float *top) {
    float chosen = 0.0f;
    for (int64_t k = 0; k < top_k; k++) { /* the k-th largest: a pass each (top_k is small) */
        int64_t best = -1;
        for (int64_t e = 0; e < n; e++) {
            int taken = 0;
            for (int64_t j = 0; j < k; j++) taken |= ids[j] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        ids[k] = best;
        top[k] = p[best];
        chosen += p[best];
    }
    return chosen;
}

/* The router of rows x [rows, hidden] (dtype): per row the logits against w [n_experts, hidden]
 * (dtype; summed in float32), their softmax in float32, the top_k experts (the larger probability
 * first, the lower expert on a tie) into ids [rows, top_k], and their probabilities, divided by
 * their sum where norm_topk, rounded to dtype into weights [rows, top_k]. The module path
 * (models/moe.py's route, through backends/cpu/experts.py) and decode_layers.c both route with this
 * call, so the one-call decode picks the modules' experts with the modules' weights, bit for bit.
 * Returns RV_OK, RV_ERR_NO_MEMORY, or RV_ERR_TOP_K. */
int moe_route(const void *x, int64_t rows, int64_t hidden, const void *w, int64_t n_experts, int64_t top_k,
              int norm_topk, int64_t *ids, void *weights, int dtype) {
    if (top_k < 1 || top_k > n_experts) return RV_ERR_TOP_K;
    float *logits = malloc((size_t)(rows * n_experts) * sizeof(float));
    if (logits == NULL) return RV_ERR_NO_MEMORY;
    const int failed = router_logits(x, rows, hidden, w, n_experts, logits, dtype);
#pragma omp parallel for schedule(static) if (rows >= 8 && !failed)
    for (int64_t r = 0; r < rows; r++) {
        if (failed) continue;
        float *p = logits + r * n_experts, top[top_k];
        float max = p[0], total = 0.0f;
        for (int64_t e = 1; e < n_experts; e++) max = p[e] > max ? p[e] : max;
        for (int64_t e = 0; e < n_experts; e++) total += p[e] = expf(p[e] - max);
        for (int64_t e = 0; e < n_experts; e++) p[e] /= total;
        const float chosen = top_k_of(p, n_experts, top_k, ids + r * top_k, top);
        if (norm_topk)
            for (int64_t k = 0; k < top_k; k++) top[k] /= chosen;
        store_vec(weights, dtype, r * top_k, (int)top_k, top);
    }
    free(logits);
    return failed;
}

/* gpt-oss's router (models/gpt_oss.py's TopKSoftmaxMoeBlock): per row the logits against w (as
 * moe_route's) plus bias [n_experts] (dtype), the top_k logits (the larger first, the lower expert on
 * a tie) into ids, and the softmax of those k alone in float32, rounded to dtype into weights. The
 * modules (backends/cpu/clamped_experts.py's TopKRouter) and decode_layers.c both route by it.
 * Returns RV_OK, RV_ERR_NO_MEMORY, or RV_ERR_TOP_K. */
int moe_route_topk(const void *x, int64_t rows, int64_t hidden, const void *w, const void *bias, int64_t n_experts,
                   int64_t top_k, int64_t *ids, void *weights, int dtype) {
    if (top_k < 1 || top_k > n_experts) return RV_ERR_TOP_K;
    float *logits = malloc((size_t)(rows * n_experts + n_experts) * sizeof(float));
    if (logits == NULL) return RV_ERR_NO_MEMORY;
    float *b = logits + rows * n_experts;
    load_vec(bias, dtype, 0, (int)n_experts, b);
    const int failed = router_logits(x, rows, hidden, w, n_experts, logits, dtype);
#pragma omp parallel for schedule(static) if (rows >= 8 && !failed)
    for (int64_t r = 0; r < rows; r++) {
        if (failed) continue;
        float *p = logits + r * n_experts, top[top_k];
        for (int64_t e = 0; e < n_experts; e++) p[e] += b[e];
        top_k_of(p, n_experts, top_k, ids + r * top_k, top);
        const float max = top[0];
        float total = 0.0f;
        for (int64_t k = 0; k < top_k; k++) total += top[k] = expf(top[k] - max);
        for (int64_t k = 0; k < top_k; k++) top[k] /= total;
        store_vec(weights, dtype, r * top_k, (int)top_k, top);
    }
    free(logits);
    return failed;
}

/* The pairs of each row's top_k experts ids [rows, top_k] (weights alike, in dtype) sorted by expert
 * as moe_experts takes them, stably (experts ascending, rows ascending within one; what
 * models/moe.py's ExpertGroups.of computes in torch): pair i is row tokens[i] with weight
 * w_sorted[i]; spans [*n_spans][3] (expert, start, count) for each expert with pairs. Returns RV_OK,
 * RV_ERR_NO_MEMORY, or RV_ERR_EXPERT_SIZE (an id outside [0, n_experts); nothing written). */
int moe_group(const int64_t *ids, const void *weights, int64_t rows, int64_t top_k, int64_t n_experts,
              int64_t *tokens, void *w_sorted, int64_t *spans, int64_t *n_spans, int dtype) {
    const int64_t pairs = rows * top_k, elem = dtype == DTYPE_BF16 ? 2 : 4;
    for (int64_t i = 0; i < pairs; i++)
        if (ids[i] < 0 || ids[i] >= n_experts) return RV_ERR_EXPERT_SIZE;
    int64_t *next = calloc((size_t)n_experts, sizeof(int64_t)); /* per expert: its next pair's slot */
    if (next == NULL) return RV_ERR_NO_MEMORY;
    for (int64_t i = 0; i < pairs; i++) next[ids[i]]++;
    int64_t spans_n = 0, at = 0;
    for (int64_t e = 0; e < n_experts; e++) {
        const int64_t count = next[e];
        next[e] = at;
        if (count == 0) continue;
        spans[3 * spans_n] = e, spans[3 * spans_n + 1] = at, spans[3 * spans_n + 2] = count;
        spans_n++, at += count;
    }
    for (int64_t i = 0; i < pairs; i++) {
        const int64_t j = next[ids[i]]++;
        tokens[j] = i / top_k;
        memcpy((char *)w_sorted + j * elem, (const char *)weights + i * elem, (size_t)elem);
    }
    free(next);
    *n_spans = spans_n;
    return RV_OK;
}
