/* The quantized matmul's driver: y = residual + x W^T for W in GGUF blocks (quant.h), and the
 * embedding lookup of W's rows. The per-type code (quant_legacy.c, quant_k.c) quantizes activation
 * rows and computes tiles; this file splits the work over threads and writes the outputs.
 *
 * One OpenMP region per call: the activation rows are quantized (split over threads; a single row
 * by the calling thread before the region, which saves the region a barrier), then each thread
 * takes a contiguous run of output columns (all rows) or, when there are fewer column units than
 * threads, a share of the rows too. A thread walks its columns in panels of weight rows that
 * stay in L2 while every chunk of activation rows passes over them: the weights come from memory
 * once per call at any row count (one row: each thread streams its share of W front to back).
 */
#include "quant.h"
#include "rivulet_kernels.h"
#include <stdlib.h>

#define PANEL_BYTES (48 * 1024) /* of weight rows per panel (L2 holds them and the activation chunk) */
#define COL_UNIT 8              /* columns per unit of the thread split and the panel */
#define PANEL_MAX 128           /* columns */
#define BF16X_PANEL 96          /* columns, BF16 | A8's (quant_panel_cols) */
/* Activation rows per tile call: the 8-bit activations' tiles unpack a slice of weights once per call
 * for every row of it (docs/benchmarks-history.md, "Few rows on 8 bits, and the tile's row chunk"). */
#define ROW_CHUNK 128
/* Columns of a one-row panel: the whole of panel_rows' buffer. A row streams its weights through once
 * whatever the panel, and a tile that prepares the activation row per call (AVX2's K-quant split,
 * quant_kx8.c; Q2_K / Q3_K's, quant_k23x8.c) then does it once per thread's columns, not per 48 KB. */
#define ROW1_PANEL (ROW_CHUNK * PANEL_MAX)

void quantize_act16(const float *x, int64_t k, void *xq) {
    act_block16 *out = (act_block16 *)xq;
    for (int64_t b = 0; b < k / ACT_BLOCK; b++) {
        const float *v = x + b * ACT_BLOCK;
        float amax = 0.0f;
#pragma omp simd reduction(max : amax)
        for (int i = 0; i < ACT_BLOCK; i++) {
            const float a = fabsf(v[i]);
            amax = a > amax ? a : amax; /* (fmaxf is a libm call per value here) */
        }
        const float d = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < ACT_BLOCK; i++) {
            const int32_t q = (int32_t)rintf(v[i] * inv); /* |q| <= 32767: v[i] * inv <= 32767 */
            out[b].q[i] = (int16_t)q;
            sum += q;
        }
        out[b].d = d;
        out[b].s = d * (float)sum;
    }
}

/* Values 32j .. 32j + 31 of x (at v) into out: see quant.h. */
static inline void quantize_block8(const float *v, act_block8 *out, int j) {
    float amax = 0.0f, asum = 0.0f;
    int32_t sq[2] = {0, 0}, sr[2] = {0, 0};
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    asum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const int two = amax * 32.0f > ACT8_SPREAD * asum;
    const __m512 ta = _mm512_mul_ps(a, _mm512_set1_ps(inv)), tb = _mm512_mul_ps(b, _mm512_set1_ps(inv));
    const __m512 qa = _mm512_roundscale_ps(ta, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 qb = _mm512_roundscale_ps(tb, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i ia = _mm512_cvtps_epi32(qa), ib = _mm512_cvtps_epi32(qb);
    _mm_storeu_si128((__m128i *)(out->q + 32 * j), _mm512_cvtepi32_epi8(ia));
    _mm_storeu_si128((__m128i *)(out->q + 32 * j + 16), _mm512_cvtepi32_epi8(ib));
    sq[0] = _mm512_reduce_add_epi32(ia);
    sq[1] = _mm512_reduce_add_epi32(ib);
    __m512i ra = _mm512_setzero_si512(), rb = _mm512_setzero_si512();
    if (two) {
        ra = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(ta, qa), _mm512_set1_ps(128.0f)));
        rb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(tb, qb), _mm512_set1_ps(128.0f)));
        sr[0] = _mm512_reduce_add_epi32(ra);
        sr[1] = _mm512_reduce_add_epi32(rb);
    }
    _mm_storeu_si128((__m128i *)(out->r + 32 * j), _mm512_cvtepi32_epi8(ra));
    _mm_storeu_si128((__m128i *)(out->r + 32 * j + 16), _mm512_cvtepi32_epi8(rb));
#else
#pragma omp simd reduction(max : amax) reduction(+ : asum)
    for (int i = 0; i < 32; i++) {
        amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
        asum += fabsf(v[i]);
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const int two = amax * 32.0f > ACT8_SPREAD * asum;
    for (int i = 0; i < 32; i++) {
        const float t = v[i] * inv; /* |t| <= 127 */
        const float q = rintf(t);
        const int32_t r = two ? (int32_t)rintf((t - q) * 128.0f) : 0; /* |t - q| <= 0.5: |r| <= 64 */
        out->q[32 * j + i] = (int8_t)q;
        out->r[32 * j + i] = (int8_t)r;
        sq[i / 16] += (int32_t)q;
        sr[i / 16] += r;
    }
#endif
    const float d = amax / 127.0f;
    const float h0 = d * (float)sq[0] + d / 128.0f * (float)sr[0], h1 = d * (float)sq[1] + d / 128.0f * (float)sr[1];
    out->d[j] = d;
    out->s[j] = h0 + h1;
    for (int i = 0; i < 2; i++) {
        out->qoff[2 * j + i] = -32 * sq[i];
        out->roff[2 * j + i] = -32 * sr[i];
    }
    out->two |= two << j;
}

/* Values 32j .. 32j + 31 of an act_block8 (at v) as quantize_act8 writes them, the block's
 * flags cleared first where j = 0 (a gated panel's share of a row: quant_matmul_gated_q8). */
static void quantize_act8_sub(const float *v, act_block8 *out, int j) {
    if (j == 0) {
        out->two = 0;
        memset(out->pad, 0, sizeof out->pad);
    }
    quantize_block8(v, out, j);
}

/* sizeof(act_block8), for the Python side's view of the format (quant_kernels.py). */
int64_t quant_act8_block_bytes(void) { return (int64_t)sizeof(act_block8); }

void quantize_act8(const float *x, int64_t k, void *xq) {
    for (int64_t b = 0; b < k / 256; b++) {
        act_block8 *out = (act_block8 *)xq + b;
        out->two = 0;
        memset(out->pad, 0, sizeof out->pad);
        for (int j = 0; j < 8; j++) quantize_block8(x + b * 256 + 32 * j, out, j);
    }
}

/* The ops of ``type`` from whichever file implements it, else NULL. */
const qtype_ops *quant_ops(int type) {
    const qtype_ops *ops = qtype_legacy(type);
    ops = ops != NULL ? ops : qtype_k(type);
    ops = ops != NULL ? ops : qtype_x8(type);
    ops = ops != NULL ? ops : qtype_sub32x8(type);
    ops = ops != NULL ? ops : qtype_sub32(type);
    ops = ops != NULL ? ops : qtype_f16(type);
    ops = ops != NULL ? ops : qtype_k23(type);
    ops = ops != NULL ? ops : qtype_k23x8(type);
    ops = ops != NULL ? ops : qtype_mxfp4x8(type);
    ops = ops != NULL ? ops : qtype_bf16x(type);
    return ops != NULL ? ops : qtype_kx8(type);
}

/* Whether quant_matmul and quant_get_rows take weights of this ggml type. */
int quant_supported(int type) { return quant_ops(type) != NULL; }

/* Bytes of one quantized activation row of k values (scratch of quant_matmul holds rows of these);
 * 0 if the type is unsupported or k is not a whole number of its blocks. */
int64_t quant_act_row_bytes(int type, int64_t k) {
    const qtype_ops *ops = quant_ops(type);
    if (ops == NULL || k <= 0 || k % ops->block != 0) return 0;
    const qtype_ops *a8 = quant_ops(type | QTYPE_A8); /* the same weights on 8-bit activations: the larger */
    const int64_t bytes = k / ops->block * ops->act_block_bytes;
    const int64_t bytes8 = a8 == NULL ? 0 : k / a8->block * a8->act_block_bytes;
    return bytes > bytes8 ? bytes : bytes8;
}

/* Columns per unit of the thread split and the panel for ``ops``' tile: COL_UNIT, or 16 for the
 * 8-bit activations' tiles (quant_kx8.c) and Q2_K / Q3_K's interleaved 16-bit tile (quant_k23x8.c's
 * one-row forms), which take 16 columns at a time (Q3_K at k = 8192: a 48 KB panel is 8 columns). */
static int64_t col_unit(const qtype_ops *ops) {
    const int t = ops->type;
    return (t & QTYPE_A8) || t == (QTYPE_Q2_K | QTYPE_X8) || t == (QTYPE_Q3_K | QTYPE_X8) ? 16 : COL_UNIT;
}

/* Columns in a panel of weight rows of row_bytes each for ``ops``' tile: whole units, PANEL_BYTES at
 * most (L2 holds them and a chunk of activation rows), and at most PANEL_MAX. BF16 | A8's tile blocks
 * its own columns for the caches (a 6-column tile's weights in L1 from 14 rows; spans L2 holds below):
 * BF16X_PANEL columns, 16 of those tiles, none short, 2-14% faster than 16 columns at 2-256 rows
 * (docs/benchmarks-history.md, "BF16 at many rows: the weights in L1"). */
int64_t quant_panel_cols(const qtype_ops *ops, int64_t row_bytes) {
    if (ops->type == (QTYPE_BF16 | QTYPE_A8)) return BF16X_PANEL;
    const int64_t unit = col_unit(ops), panel = PANEL_BYTES / row_bytes / unit * unit;
    return panel < unit ? unit : panel > PANEL_MAX ? PANEL_MAX : panel;
}

/* Outputs of at least STREAM_BYTES (the vocabulary-wide logits of a many-row head) go to memory by
 * streaming stores: a panel row's whole 64-byte lines, with no read of the lines first (a store
 * that misses reads its line before writing it), where the output would not stay in the caches
 * anyway. quant_y_stream (0: never) for timing both in one process (bench.worker_step --toggle). */
#define STREAM_BYTES (24 << 20)
int quant_y_stream = 1;

/* v [n] (n a multiple of 16) to the float32 dst (64-byte aligned) by streaming stores. */
static inline void stream_row(float *dst, const float *v, int64_t n) {
#if HAVE_AVX512
    for (int64_t j = 0; j < n; j += 16) _mm512_stream_ps(dst + j, _mm512_loadu_ps(v + j));
#elif HAVE_AVX2
    for (int64_t j = 0; j < n; j += 8) _mm256_stream_ps(dst + j, _mm256_loadu_ps(v + j));
#else
    memcpy(dst, v, (size_t)n * sizeof(float));
#endif
}

/* v [n] to dst (float32) by vector loads and stores: a panel's rows are 32-512 bytes, where a call of
 * memcpy a row costs about what its copy does. */
static inline void copy_row(float *dst, const float *v, int64_t n) {
#if HAVE_AVX512
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(dst + j, _mm512_loadu_ps(v + j));
    if (j < n) {
        const __mmask16 m = (__mmask16)((1u << (n - j)) - 1);
        _mm512_mask_storeu_ps(dst + j, m, _mm512_maskz_loadu_ps(m, v + j));
    }
#elif HAVE_AVX2
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dst + j, _mm256_loadu_ps(v + j));
    for (; j < n; j++) dst[j] = v[j];
#else
    memcpy(dst, v, (size_t)n * sizeof(float));
#endif
}

/* The head's argmax route (quant_matmul_argmax, quant.h's head_argmax): each value as y would hold
 * it (rounded to the dtype, then soft-capped as softcap_f32 over the whole [rows, n] y), each row's
 * largest with its first column, kept where strictly larger than the thread's earlier columns'. */
void argmax_panel(const head_argmax *am, int t, float *v, int64_t ld, int64_t r0, int64_t nr, int64_t c0, int64_t pw) {
    float *best = am->best + t * am->rows;
    int64_t *best_at = am->best_at + t * am->rows;
    /* softcap_f32 takes its scalar form only for the values past the logits' last whole vector (of 16
     * or 8): the rows before the one holding the first of them take the vector form throughout, and
     * where the panel's rows lie one after another, in one call (a call a row costs more than the
     * 16-column panels' caps). */
    const int64_t total = am->rows * am->n, tail_row = (total - total % 16) / am->n;
    const int64_t bulk = tail_row - r0 < 0 ? 0 : tail_row - r0 > nr ? nr : tail_row - r0;
    if (am->cap > 0.0f && ld == pw && am->dtype == DTYPE_F32 && bulk > 0) {
        const int64_t len = bulk * pw;
        softcap_at(v, len, 0, (len + 15) / 16 * 16, am->cap); /* (every value before the tensor's end: vector) */
    }
    for (int64_t r = 0; r < nr; r++) {
        float *row = v + r * ld;
        if (am->dtype == DTYPE_BF16)
            for (int64_t j = 0; j < pw; j++) row[j] = bf16_to_f32(f32_to_bf16(row[j]));
        if (am->cap > 0.0f && !(ld == pw && am->dtype == DTYPE_F32 && r < bulk))
            softcap_at(row, pw, (r0 + r) * am->n + c0, total, am->cap);
        float top = -INFINITY;
#pragma omp simd reduction(max : top)
        for (int64_t j = 0; j < pw; j++) top = row[j] > top ? row[j] : top; /* (a NaN never wins) */
        if (!(top > best[r0 + r])) continue;
        int64_t j = 0;
        while (row[j] != top) j++;
        best[r0 + r] = top;
        best_at[r0 + r] = c0 + j;
    }
}

/* What a call's panels share: W (wrb bytes a row, nb blocks), its quantized activation rows xq (xrb
 * bytes apart) and where the outputs go. ``stream``: y float32 without a residual, rows and panels whole
 * lines (see STREAM_BYTES); ``am`` (not NULL): each panel folded into the thread's argmax, y not
 * written; ``w_up`` (not NULL): a gated call, y = act(x W^T) * (x W_up^T), W_up's rows as W's (see
 * quant_matmul_gated; ``gelu``: gelu_tanh, else silu); ``xq_out`` (not NULL, gated only): y's rows not
 * written but quantized as the next matmul's activation rows (xq_rb bytes apart; ``block8``: act_block8,
 * else act8_32), see quant_matmul_gated_q8; ``xq_in`` (not NULL): x given as quantized rows. */
typedef struct {
    const qtype_ops *ops;
    const uint8_t *w, *w_up;
    int64_t wrb, nb;
    const uint8_t *xq;
    int64_t xrb;
    void *y;
    int64_t y_stride;
    int y_dtype;
    const void *residual;
    int64_t res_stride;
    int stream, gelu;
    const head_argmax *am;
    uint8_t *xq_out;
    int64_t xq_rb;
    int block8;
    const uint8_t *xq_in;
} panel_job;

/* Rows [0, qr) of a tile's output v (pw columns a row) to y's rows from q0 on, columns [c0, c0 + pw):
 * streamed, or plus the residual, rounded once to y's dtype. */
static void store_panel(const panel_job *job, float *v_all, int64_t q0, int64_t qr, int64_t c0, int64_t pw) {
    const void *residual = job->residual;
    const int64_t y_stride = job->y_stride, res_stride = job->res_stride;
    float res[PANEL_MAX];
    for (int64_t r = 0; r < qr; r++) {
        float *v = v_all + r * pw;
        if (job->stream) {
            stream_row((float *)job->y + (q0 + r) * y_stride + c0, v, pw);
            continue;
        }
        if (job->y_dtype == DTYPE_F32 && residual == NULL) {
            copy_row((float *)job->y + (q0 + r) * y_stride + c0, v, pw);
            continue;
        }
        if (job->y_dtype == DTYPE_F32 && residual != NULL) { /* the residual read where it lies: one pass */
            float *dst = (float *)job->y + (q0 + r) * y_stride + c0;
            const float *add = (const float *)residual + (q0 + r) * res_stride + c0;
#pragma omp simd
            for (int64_t j = 0; j < pw; j++) dst[j] = v[j] + add[j];
            continue;
        }
        for (int64_t j0 = 0; residual != NULL && j0 < pw; j0 += PANEL_MAX) { /* (a one-row panel: wider) */
            const int64_t m = pw - j0 < PANEL_MAX ? pw - j0 : PANEL_MAX;
            load_vec(residual, job->y_dtype, (q0 + r) * res_stride + c0 + j0, (int)m, res);
#pragma omp simd
            for (int64_t j = 0; j < m; j++) v[j0 + j] += res[j];
        }
        store_vec(job->y, job->y_dtype, (q0 + r) * y_stride + c0, (int)pw, v);
    }
}

/* A gated panel's rows: act(gate) * up on each row of the two tiles' outputs (pw columns a row), each
 * value first rounded to y's dtype as quant_matmul's gate|up output holds it, then as silu_mul (or
 * gelu_tanh_mul) computes it (small_ops.c's act_mul_f32), into gate's rows. */
static void gate_panel(const panel_job *job, float *gate, float *up, int64_t qr, int64_t pw) {
    for (int64_t r = 0; r < qr; r++) {
        float *g = gate + r * pw, *u = up + r * pw;
        round_vec(job->y_dtype, g, (int)pw);
        round_vec(job->y_dtype, u, (int)pw);
        act_mul_f32(g, u, (int)pw, job->y_dtype, job->gelu);
    }
}

/* A gated panel's rows [0, qr) (pw columns, from c0 on: whole blocks of 32) as the next matmul's
 * activation rows q0 on hold them: each value rounded to y's dtype as y would hold it, then each 32
 * quantized in place in the row by its format's own function (act8_32's quantize_act8_32, or
 * act_block8's per 32 as quantize_act8). Every block of the formats is its own 32 values'. */
static void quant_out_rows(const panel_job *job, float *v, int64_t q0, int64_t qr, int64_t c0, int64_t pw) {
    for (int64_t r = 0; r < qr; r++) {
        float *row = v + r * pw;
        uint8_t *dst = job->xq_out + (q0 + r) * job->xq_rb;
        round_vec(job->y_dtype, row, (int)pw);
        if (!job->block8) {
            quantize_act8_32(row, pw, dst + c0 / ACT_BLOCK * (int64_t)sizeof(act8_32));
            continue;
        }
        for (int64_t j = 0; j < pw; j += ACT_BLOCK)
            quantize_act8_sub(row + j, (act_block8 *)dst + (c0 + j) / 256, (int)((c0 + j) % 256 / ACT_BLOCK));
    }
}

/* quant_panel's work for thread t: y rows [r0, r1) of columns [c0, c0 + pw), a tile of ROW_CHUNK rows
 * at a time (two where gated: W's and W_up's same columns), then stored (store_panel) or folded into
 * the argmax. */
static void panel_rows(const panel_job *job, int64_t c0, int64_t pw, int64_t r0, int64_t r1, int t) {
    float buf[ROW_CHUNK * PANEL_MAX], up[ROW_CHUNK * PANEL_MAX]; /* (up: where gated) */
    const qtype_ops *ops = job->ops;
    const int64_t wrb = job->wrb, nb = job->nb, xrb = job->xrb;
    for (int64_t q0 = r0; q0 < r1; q0 += ROW_CHUNK) {
        const int64_t qr = r1 - q0 < ROW_CHUNK ? r1 - q0 : ROW_CHUNK;
        ops->tile(job->w + c0 * wrb, wrb, pw, job->xq + q0 * xrb, xrb, qr, nb, buf, pw);
        if (job->w_up != NULL) {
            ops->tile(job->w_up + c0 * wrb, wrb, pw, job->xq + q0 * xrb, xrb, qr, nb, up, pw);
            gate_panel(job, buf, up, qr, pw);
        }
        if (job->xq_out != NULL)
            quant_out_rows(job, buf, q0, qr, c0, pw);
        else if (job->am != NULL)
            argmax_panel(job->am, t, buf, pw, q0, qr, c0, pw);
        else
            store_panel(job, buf, q0, qr, c0, pw);
    }
}

/* y rows [r0, r1) of columns [c0, c0 + pw) (pw <= PANEL_MAX): W's rows there (wrb bytes each, nb
 * blocks) met by the quantized activation rows xq (xrb bytes apart) in tiles of ROW_CHUNK rows,
 * residual (NULL: none) added, each stored once in y_dtype. One thread's work: the panel's weights
 * stay in L2 while the chunks pass. */
void quant_panel(const qtype_ops *ops, const uint8_t *w, int64_t wrb, int64_t nb, int64_t c0, int64_t pw,
                 const uint8_t *xq, int64_t xrb, int64_t r0, int64_t r1, void *y, int64_t y_stride, int y_dtype,
                 const void *residual, int64_t res_stride) {
    const panel_job job = {ops, w, NULL, wrb, nb, xq, xrb, y, y_stride, y_dtype, residual, res_stride, 0, 0, NULL};
    panel_rows(&job, c0, pw, r0, r1, 0);
}

/* y [rows, n] (y_dtype, rows y_stride elements apart) = residual (rows res_stride elements apart,
 * y_dtype; NULL: none) + x W^T, x [rows, k] (x_dtype, rows x_stride elements apart), W [n, k] in
 * blocks of ``type``. (A strided y lets a merged Linear's parts write their columns in place.)
 * Summed in float32, one rounding to y_dtype at the end. scratch: rows * quant_act_row_bytes(type, k)
 * bytes (of the type without QTYPE_A8: that size fits both formats). ``job``: W, the outputs' fields
 * (w, w_up, y, y_stride, y_dtype, residual, res_stride, gelu, am); the rest is filled here. Returns
 * RV_OK, or (nothing written) RV_ERR_TYPE, RV_ERR_K (k not a whole number of blocks), RV_ERR_DTYPE,
 * RV_ERR_NO_MEMORY, or RV_ERR_X8_ROWS (an interleaved type with n not a multiple of 8). */
static int matmul_run(int type, int64_t n, int64_t k, const void *x, int64_t x_stride, int x_dtype, int64_t rows,
                      void *scratch, panel_job *job) {
    const qtype_ops *ops = quant_ops(type);
    if (ops == NULL) return RV_ERR_TYPE;
    if (k <= 0 || k % ops->block != 0) return RV_ERR_K;
    const int y_dtype = job->y_dtype;
    if ((x_dtype != DTYPE_F32 && x_dtype != DTYPE_BF16) || (y_dtype != DTYPE_F32 && y_dtype != DTYPE_BF16)) return RV_ERR_DTYPE;
    if ((type & QTYPE_X8) && n % 8 != 0) return RV_ERR_X8_ROWS;
    if (n <= 0 || rows <= 0) return 0;
    const int64_t nb = k / ops->block, wrb = nb * ops->block_bytes, xrb = nb * ops->act_block_bytes;
    int64_t panel = rows == 1 ? ROW1_PANEL : quant_panel_cols(ops, wrb), unit = col_unit(ops);
    if (job->xq_out != NULL) { /* whole blocks of 32 a panel, whole act_block8 a thread (see quant_out_rows) */
        panel = panel < ACT_BLOCK ? ACT_BLOCK : panel / ACT_BLOCK * ACT_BLOCK;
        unit = job->block8 ? 256 : ACT_BLOCK;
    }
    const int64_t units = (n + unit - 1) / unit;
    uint8_t *xq = job->xq_in != NULL ? (uint8_t *)job->xq_in : (uint8_t *)scratch;
    int failed = 0;
    job->ops = ops, job->wrb = wrb, job->nb = nb, job->xq = xq, job->xrb = xrb;
    /* streaming stores take whole 64-byte lines: y aligned, its rows and the panels whole lines */
    job->stream = job->am == NULL && job->xq_out == NULL && quant_y_stream && y_dtype == DTYPE_F32 && job->residual == NULL &&
                  rows * n * 4 >= STREAM_BYTES && (uintptr_t)job->y % 64 == 0 && job->y_stride % 16 == 0 &&
                  n % 16 == 0 && panel % 16 == 0 && unit % 16 == 0;
    if (rows == 1 && job->xq_in == NULL) { /* one row (decode): quantized here, so the region below has no barrier but its end */
        if (x_dtype == DTYPE_BF16) {
            float *xf = malloc((size_t)k * sizeof(float));
            if (xf == NULL) return RV_ERR_NO_MEMORY;
            const uint16_t *src = (const uint16_t *)x;
#pragma omp simd
            for (int64_t i = 0; i < k; i++) xf[i] = bf16_to_f32(src[i]);
            ops->quantize_act(xf, k, xq);
            free(xf);
        } else {
            ops->quantize_act((const float *)x, k, xq);
        }
    }
#pragma omp parallel
    {
        if (rows > 1 && job->xq_in == NULL) {
            float *xf = NULL;
            if (x_dtype == DTYPE_BF16 && (xf = malloc((size_t)k * sizeof(float))) == NULL) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                if (x_dtype == DTYPE_BF16) {
                    if (xf == NULL) continue;
                    const uint16_t *src = (const uint16_t *)x + r * x_stride;
#pragma omp simd
                    for (int64_t i = 0; i < k; i++) xf[i] = bf16_to_f32(src[i]);
                    ops->quantize_act(xf, k, xq + r * xrb);
                } else {
                    ops->quantize_act((const float *)x + r * x_stride, k, xq + r * xrb);
                }
            } /* (its barrier: every row quantized, ``failed`` seen by all) */
            free(xf);
        }
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t col_parts = units < nt ? units : nt;
        int64_t row_parts = nt / col_parts;
        row_parts = row_parts > rows ? rows : row_parts;
        const int64_t cp = t % col_parts, rp = t / col_parts;
        int failed_here;
#pragma omp atomic read
        failed_here = failed;
        if (!failed_here && rp < row_parts) {
            const int64_t c0 = units * cp / col_parts * unit, c1_units = units * (cp + 1) / col_parts * unit;
            const int64_t c1 = c1_units < n ? c1_units : n;
            const int64_t r0 = rows * rp / row_parts, r1 = rows * (rp + 1) / row_parts;
            for (int64_t p0 = c0; p0 < c1; p0 += panel)
                panel_rows(job, p0, c1 - p0 < panel ? c1 - p0 : panel, r0, r1, t);
        }
#if HAVE_AVX512 || HAVE_AVX2
        if (job->stream) _mm_sfence(); /* the streamed lines before the region's end, as its other stores */
#endif
    }
    return failed ? RV_ERR_NO_MEMORY : RV_OK;
}

int quant_matmul(int type, const uint8_t *w, int64_t n, int64_t k, const void *x, int64_t x_stride, int x_dtype,
                 int64_t rows, void *scratch, void *y, int64_t y_stride, int y_dtype, const void *residual,
                 int64_t res_stride) {
    panel_job job = {.w = w, .y = y, .y_stride = y_stride, .y_dtype = y_dtype, .residual = residual,
                     .res_stride = res_stride};
    return matmul_run(type, n, k, x, x_stride, x_dtype, rows, scratch, &job);
}

/* Whether quant_matmul_gated runs fused (1, the default) or as the unfused calls it stands for (0: both
 * timed in one process by bench.worker_step --toggle quant_gated). */
int quant_gated = 1;

/* quant_matmul_gated as the calls it replaces: quant_matmul's gate|up output [rows, 2 inner] (one call
 * where W_up's rows follow W's, as a merged Linear's one part), then silu_mul's (gelu_tanh_mul's) pass. */
static int gated_unfused(const qtype_ops *ops, int type, const uint8_t *w_gate, const uint8_t *w_up, int64_t inner,
                         int64_t k, const void *x, int64_t x_stride, int x_dtype, int64_t rows, void *scratch, void *y,
                         int y_dtype, int gelu) {
    const int64_t elem = y_dtype == DTYPE_BF16 ? 2 : 4, wrb = k / ops->block * ops->block_bytes;
    const int merged = w_up == w_gate + inner * wrb;
    char *gu = malloc((size_t)(rows * 2 * inner * elem));
    if (gu == NULL) return RV_ERR_NO_MEMORY;
    int status = quant_matmul(type, w_gate, merged ? 2 * inner : inner, k, x, x_stride, x_dtype, rows, scratch, gu,
                              2 * inner, y_dtype, NULL, 0);
    if (status == RV_OK && !merged)
        status = quant_matmul(type, w_up, inner, k, x, x_stride, x_dtype, rows, scratch, gu + inner * elem, 2 * inner,
                              y_dtype, NULL, 0);
    if (status == RV_OK && gelu) gelu_tanh_mul(gu, y, rows, (int)inner, y_dtype);
    if (status == RV_OK && !gelu) silu_mul(gu, y, rows, (int)inner, y_dtype);
    free(gu);
    return status;
}

int quant_matmul_gated(int type, const uint8_t *w_gate, const uint8_t *w_up, int64_t inner, int64_t k,
                       const void *x, int64_t x_stride, int x_dtype, int64_t rows, void *scratch, void *y, int y_dtype,
                       int gelu) {
    const qtype_ops *ops = quant_ops(type);
    if (!quant_gated && ops != NULL && k > 0 && k % ops->block == 0)
        return gated_unfused(ops, type, w_gate, w_up, inner, k, x, x_stride, x_dtype, rows, scratch, y, y_dtype, gelu);
    panel_job job = {.w = w_gate, .w_up = w_up, .y = y, .y_stride = inner, .y_dtype = y_dtype, .gelu = gelu};
    return matmul_run(type, inner, k, x, x_stride, x_dtype, rows, scratch, &job);
}

/* Whether quant_matmul_gated_q8 runs where it fits (1, the default; 0: the gated call writes y and the
 * next matmul quantizes it, both timed in one process by bench.worker_step --toggle quant_gated_q8). */
int quant_gated_q8 = 1;

/* The activation format of ``type``'s tile (type with its flags): 1 act8_32, 2 act_block8 (what
 * quant_matmul_gated_q8 can write), else 0. */
static int q8_format(int type) {
    const qtype_ops *ops = quant_ops(type);
    if (ops == NULL || !(type & QTYPE_A8)) return 0;
    return ops->quantize_act == quantize_act8_32 ? 1 : ops->quantize_act == quantize_act8 ? 2 : 0;
}

int64_t quant_gated_q8_row_bytes(int next_type, int64_t inner, int64_t rows) {
    const qtype_ops *ops = quant_ops(next_type);
    if (!quant_gated_q8 || rows < 2 || q8_format(next_type) == 0 || inner <= 0 || inner % ops->block != 0) return 0;
    return inner / ops->block * ops->act_block_bytes;
}

int quant_matmul_gated_q8(int type, const uint8_t *w_gate, const uint8_t *w_up, int64_t inner, int64_t k,
                          const void *x, int64_t x_stride, int x_dtype, int64_t rows, void *scratch, int y_dtype,
                          int gelu, int next_type, uint8_t *xq_out) {
    const int64_t xq_rb = quant_gated_q8_row_bytes(next_type, inner, rows);
    if (xq_rb == 0) return RV_ERR_TYPE;
    panel_job job = {.w = w_gate, .w_up = w_up, .y_dtype = y_dtype, .gelu = gelu, .xq_out = xq_out,
                     .xq_rb = xq_rb, .block8 = q8_format(next_type) == 2};
    return matmul_run(type, inner, k, x, x_stride, x_dtype, rows, scratch, &job);
}

int quant_matmul_q(int type, const uint8_t *w, int64_t n, int64_t k, const uint8_t *xq, int64_t rows, void *y,
                   int64_t y_stride, int y_dtype, const void *residual, int64_t res_stride) {
    panel_job job = {.w = w, .y = y, .y_stride = y_stride, .y_dtype = y_dtype, .residual = residual,
                     .res_stride = res_stride, .xq_in = xq};
    return matmul_run(type, n, k, NULL, 0, DTYPE_F32, rows, NULL, &job);
}

/* The LM head's greedy draw without its logits (rivulet_kernels.h): quant_matmul's (or the dense
 * path's) panels folded into each thread's running best per row as they are computed (in L1/L2,
 * where the logits, 33.5 MB at 32 rows of a 262144-token vocabulary, would go to memory and be read
 * back by the soft-cap and the argmax), then the threads' bests merged: the larger value, the lower
 * column on a tie, so the first index of the largest as argmax_rows picks it (none: 0, as there). */
int quant_matmul_argmax(int type, const uint8_t *w, int64_t n, int64_t k, const void *x, int64_t x_stride,
                        int x_dtype, int64_t rows, void *scratch, int dense, float cap, int64_t *out) {
    if (x_dtype == DTYPE_BF16 && cap > 0.0f) return RV_ERR_DTYPE; /* (the model caps bf16 logits in torch) */
    if (rows <= 0) return RV_OK;
    const int64_t slots = (int64_t)omp_get_max_threads() * rows;
    head_argmax am = {malloc((size_t)slots * sizeof(float)), malloc((size_t)slots * sizeof(int64_t)), rows, n,
                      x_dtype, cap};
    int status = RV_ERR_NO_MEMORY;
    if (am.best != NULL && am.best_at != NULL) {
        for (int64_t i = 0; i < slots; i++) am.best[i] = -INFINITY, am.best_at[i] = -1;
        panel_job job = {.w = w, .y_dtype = x_dtype, .am = &am};
        status = dense ? quant_dense_run(type, w, n, k, x, x_stride, x_dtype, rows, NULL, 0, x_dtype, NULL, 0, &am)
                       : matmul_run(type, n, k, x, x_stride, x_dtype, rows, scratch, &job);
    }
    for (int64_t r = 0; status == RV_OK && r < rows; r++) {
        float top = -INFINITY;
        int64_t top_at = -1;
        for (int64_t i = r; i < slots; i += rows)
            if (am.best_at[i] >= 0 && (am.best[i] > top || (am.best[i] == top && am.best_at[i] < top_at)))
                top = am.best[i], top_at = am.best_at[i];
        out[r] = top_at < 0 ? 0 : top_at;
    }
    free(am.best);
    free(am.best_at);
    return status;
}

/* out [count, k] (out_dtype, contiguous) = the rows ids[i] of W [?, k] in blocks of ``type``,
 * dequantized (the embedding lookup). An unsupported type or k writes nothing. */
void quant_get_rows(int type, const uint8_t *w, int64_t k, const int64_t *ids, int64_t count, void *out,
                    int out_dtype) {
    const qtype_ops *ops = quant_ops(type);
    if (ops == NULL || k <= 0 || k % ops->block != 0 || count <= 0) return;
    const int64_t wrb = k / ops->block * ops->block_bytes;
#pragma omp parallel
    {
        float *tmp = out_dtype == DTYPE_F32 ? NULL : malloc((size_t)k * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++) {
            if (out_dtype == DTYPE_F32) {
                dequant_row_at(ops, w, wrb, ids[i], k, (float *)out + i * k);
            } else if (tmp != NULL) {
                dequant_row_at(ops, w, wrb, ids[i], k, tmp);
                store_vec(out, out_dtype, i * k, (int)k, tmp);
            }
        }
        free(tmp);
    }
}
