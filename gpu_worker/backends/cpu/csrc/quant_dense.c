/* The quantized matmul at many activation rows: y = residual + x W^T with W in GGUF blocks, each
 * thread dequantizing a panel of W's rows to float32 (it stays in L2) and passing every activation
 * row over it with float32 FMAs.
 *
 * Why a second path: at one row a matmul streams W once and its bytes set the pace, so the integer
 * path (quant.c) reads the blocks as they are. At many rows each weight meets every row, and the
 * integer tile pays per (row, weight row, block) a widening, two madds, an add, a conversion and a
 * scaled FMA for 32 products, where a float tile pays 4 FMAs; the blocks are widened once per
 * panel here, not once per group of activation rows. python -m bench.quant_matmul measures where the
 * paths cross per CPU kind (gpu_worker/backends/cpu/quant.py holds the table).
 *
 * Numerics: activations are not quantized (bf16 activations widen exactly to float32); weights are
 * dequantized as gguf-py does (d * q + m, one rounding); products summed in float32, one rounding
 * to the output dtype at the end, the residual added before it. */
#include "quant.h"
#include "rivulet_kernels.h"
#include <stdlib.h>

#define PANEL_BYTES (96 * 1024) /* of float32 weight rows per panel: in L2 beside a group's x rows */
#define TR 4                    /* activation rows per register tile */
#define TC 3                    /* weight rows per register tile */
#define COL_UNIT (4 * TC)       /* weight rows per unit of the thread split */

/* The output (r, c) = s + residual, rounded once to y's dtype. */
static inline void put(void *y, int y_dtype, int64_t at, float s, const void *residual, int64_t res_at) {
    if (residual != NULL)
        s += y_dtype == DTYPE_BF16 ? bf16_to_f32(((const uint16_t *)residual)[res_at]) : ((const float *)residual)[res_at];
    if (y_dtype == DTYPE_BF16) {
        ((uint16_t *)y)[at] = f32_to_bf16(s);
    } else {
        ((float *)y)[at] = s;
    }
}

typedef struct {
    void *y;
    int y_dtype;
    const void *residual;
    int64_t res_stride, y_stride;
} outputs;

#if HAVE_AVX2 || HAVE_AVX512
/* Rows [r0, r0 + R) of x (float32, kx apart) times panel rows [c0, c0 + C) (float32, k apart),
 * R, C constants once inlined; k a multiple of 32. 12 accumulators, 3 weight vectors and one x
 * vector fill the 16 ymm registers: 7 loads per 12 FMAs. Rows or columns past the end repeat the
 * last valid one (from L1), their sums not stored. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t nr, const float *wp, int64_t nc,
                                                       int64_t k, int64_t r0, int64_t c0, int64_t col0,
                                                       const outputs *o, const int R, const int C) {
    const float *xr[TR], *wr[TC];
    for (int r = 0; r < R; r++) xr[r] = x + (r0 + r < nr ? r0 + r : nr - 1) * k;
    for (int c = 0; c < C; c++) wr[c] = wp + (c0 + c < nc ? c0 + c : nc - 1) * k;
    __m256 acc[TR][TC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < k; d += 8) {
        __m256 wv[TC];
        for (int c = 0; c < C; c++) {
            wv[c] = _mm256_load_ps(wr[c] + d);
            IN_REGISTER(wv[c]);
        }
        for (int r = 0; r < R; r++) {
            __m256 xv = _mm256_load_ps(xr[r] + d);
            IN_REGISTER(xv);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < R && r0 + r < nr; r++)
        for (int c = 0; c < C && c0 + c < nc; c++) {
            const int64_t row = r0 + r, col = col0 + c0 + c;
            put(o->y, o->y_dtype, row * o->y_stride + col, hsum8(acc[r][c]), o->residual, row * o->res_stride + col);
        }
}
#else
/* Portable: the same tile shape in plain C (the compiler vectorizes the d loop as it can). */
static inline void tile(const float *x, int64_t nr, const float *wp, int64_t nc, int64_t k, int64_t r0, int64_t c0,
                        int64_t col0, const outputs *o, const int R, const int C) {
    for (int r = 0; r < R && r0 + r < nr; r++)
        for (int c = 0; c < C && c0 + c < nc; c++) {
            const float *a = x + (r0 + r) * k, *b = wp + (c0 + c) * k;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < k; d++) s += a[d] * b[d];
            const int64_t row = r0 + r, col = col0 + c0 + c;
            put(o->y, o->y_dtype, row * o->y_stride + col, s, o->residual, row * o->res_stride + col);
        }
}
#endif

/* Every x row against panel rows [0, nc): the rows in near-equal groups of at most TR (7 rows: 4 + 3),
 * each group over all the panel's tiles in turn (its rows stay in L1, the panel in L2). */
static void panel_rows(const float *x, int64_t nr, const float *wp, int64_t nc, int64_t k, int64_t col0,
                       const outputs *o) {
    const int64_t groups = (nr + TR - 1) / TR;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t r0 = nr * g / groups, rows = nr * (g + 1) / groups - r0;
        for (int64_t c0 = 0; c0 < nc; c0 += TC) {
            switch (rows) { /* each R its own unrolled code */
            case 1: tile(x, nr, wp, nc, k, r0, c0, col0, o, 1, TC); break;
            case 2: tile(x, nr, wp, nc, k, r0, c0, col0, o, 2, TC); break;
            case 3: tile(x, nr, wp, nc, k, r0, c0, col0, o, 3, TC); break;
            /* Every full group. ``default`` is never reached (rows <= TR), but with the full tile under
             * it alone gcc 12 built that tile much slower (python -m bench.quant_matmul;
             * docs/benchmarks-history.md, the dense path's compiler regression). */
            case 4: tile(x, nr, wp, nc, k, r0, c0, col0, o, 4, TC); break;
            default: tile(x, nr, wp, nc, k, r0, c0, col0, o, TR, TC);
            }
        }
    }
}

/* quant_matmul's contract (quant.c) without its scratch: y [rows, n] (rows y_stride apart) = residual
 * + x W^T; its statuses too (RV_ERR_NO_MEMORY: y partly written). */
int quant_matmul_dense(int type, const uint8_t *w, int64_t n, int64_t k, const void *x, int64_t x_stride,
                       int x_dtype, int64_t rows, void *y, int64_t y_stride, int y_dtype, const void *residual,
                       int64_t res_stride) {
    return quant_dense_run(type, w, n, k, x, x_stride, x_dtype, rows, y, y_stride, y_dtype, residual, res_stride, NULL);
}

/* (quant.h) am not NULL: each panel's outputs, float32 in a buffer of the thread's, folded into am. */
int quant_dense_run(int type, const uint8_t *w, int64_t n, int64_t k, const void *x, int64_t x_stride, int x_dtype,
                    int64_t rows, void *y, int64_t y_stride, int y_dtype, const void *residual, int64_t res_stride,
                    const head_argmax *am) {
    const qtype_ops *ops = quant_ops(type);
    if (ops == NULL) return RV_ERR_TYPE;
    if (k <= 0 || k % ops->block != 0 || k % ACT_BLOCK != 0) return RV_ERR_K;
    if ((x_dtype != DTYPE_F32 && x_dtype != DTYPE_BF16) || (y_dtype != DTYPE_F32 && y_dtype != DTYPE_BF16)) return RV_ERR_DTYPE;
    if ((type & QTYPE_X8) && n % 8 != 0) return RV_ERR_X8_ROWS;
    if (n <= 0 || rows <= 0) return 0;
    /* interleaved rows: units and panels of whole groups of 8 (24 = 8 groups of TC), dequantized a
     * group at a time */
    const int64_t unit = ops->dequant_group != NULL ? 2 * COL_UNIT : COL_UNIT, step = ops->dequant_group != NULL ? unit : TC;
    const int64_t wrb = k / ops->block * ops->block_bytes, units = (n + unit - 1) / unit;
    int64_t panel = PANEL_BYTES / (k * (int64_t)sizeof(float)) / step * step;
    panel = panel < step ? step : panel;
    float *xf = aligned_alloc(32, (size_t)(rows * k) * sizeof(float));
    if (xf == NULL) return RV_ERR_NO_MEMORY;
    const outputs o = {y, y_dtype, residual, res_stride, y_stride};
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) load_vec(x, x_dtype, r * x_stride, (int)k, xf + r * k);
        /* (the loop's barrier: every row widened) */
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t c0 = units * t / nt * unit, c1_units = units * (t + 1) / nt * unit;
        const int64_t c1 = c1_units < n ? c1_units : n;
        float *wp = c0 < c1 ? aligned_alloc(32, (size_t)(panel * k) * sizeof(float)) : NULL;
        float *part = am != NULL && c0 < c1 ? malloc((size_t)(rows * panel) * sizeof(float)) : NULL;
        if (c0 < c1 && (wp == NULL || (am != NULL && part == NULL))) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t p0 = c0; wp != NULL && (am == NULL || part != NULL) && p0 < c1; p0 += panel) {
            const int64_t pw = c1 - p0 < panel ? c1 - p0 : panel;
            if (ops->dequant_group != NULL) {
                for (int64_t j = 0; j < pw; j += 8) ops->dequant_group(w + (p0 + j) * wrb, k, wp + j * k);
            } else {
                for (int64_t j = 0; j < pw; j++) dequant_row_at(ops, w, wrb, p0 + j, k, wp + j * k);
            }
            if (am == NULL) {
                panel_rows(xf, rows, wp, pw, k, p0, &o);
                continue;
            }
            const outputs to_part = {part, DTYPE_F32, NULL, 0, pw}; /* y's float32 sums, not yet rounded */
            panel_rows(xf, rows, wp, pw, k, 0, &to_part);
            argmax_panel(am, t, part, pw, 0, rows, p0, pw);
        }
        free(part);
        free(wp);
    }
    free(xf);
    return failed ? 4 : 0;
}
