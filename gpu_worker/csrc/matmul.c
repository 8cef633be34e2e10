/* Matmuls of few rows over plain [out, in] bfloat16 weights: decode steps, which mostly stream the
 * weights. Sums in float32 and one rounding to bfloat16 at the end, bias and residual added before
 * it, as oneDNN's matmul with its add post-op. */
#include "common.h"
#include <stdlib.h>

#if HAVE_AVX512
/* One row x [k]: 16 weight rows at a time (their dot products summed by sum16), threads taking
 * contiguous blocks: each streams its share of W front to back, without the per-call start-up that
 * costs oneDNN ~30% on matrices of ~1 MB. */
static void gemv_avx512(const uint16_t *x, const uint16_t *w, const uint16_t *bias, const uint16_t *residual,
                        uint16_t *out, int n_out, int k) {
    const int blocks = (n_out + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < blocks; b++) {
        const int n0 = b * 16;
        const uint16_t *rows[16];
        for (int t = 0; t < 16; t++) { /* past the end: the last row again, its sum not stored */
            const int n = n0 + ORDER16[t];
            rows[t] = w + (int64_t)(n < n_out ? n : n_out - 1) * k;
        }
        __m512 acc[16];
        for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
        for (int d = 0; d < k; d += 32) {
            const __mmask32 mask = k - d >= 32 ? 0xffffffffu : (1u << (k - d)) - 1;
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + d);
            for (int t = 0; t < 16; t++)
                acc[t] = _mm512_dpbf16_ps(acc[t], xv, (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[t] + d));
        }
        __m512 s = sum16(acc);
        const __mmask16 valid = n_out - n0 >= 16 ? 0xffffu : (__mmask16)((1u << (n_out - n0)) - 1);
        if (bias != NULL)
            s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, bias + n0)), 16)));
        if (residual != NULL)
            s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, residual + n0)), 16)));
        _mm256_mask_storeu_epi16(out + n0, valid, (__m256i)_mm512_cvtneps_pbh(s));
    }
}
#endif

#if HAVE_AVX2
/* AVX2 has no bf16 dot product: weights are widened in registers. One 256-bit load of 16 bf16
 * holds element 2i in the low half of 32-bit lane i and element 2i+1 in the high half, so two
 * integer ops widen it: shift left 16 (the even elements) and mask the low half off (the odd ones).
 * x is widened once per call into the same order: each 16-element block as its 8 even elements,
 * then its 8 odd ones, rows padded with zeros to kp, a multiple of 16 (a dot product takes its
 * terms in any order; only float32 rounding sees it, far inside the one bf16 rounding at the end). */
#ifndef TILE_R
#define TILE_R 4 /* x rows per tile */
#endif
#ifndef TILE_C
#define TILE_C 3 /* weight rows per tile: R * C accumulators + C widened weights in 16 ymm registers */
#endif
#ifndef TILE_C1
#define TILE_C1 4 /* weight rows per tile at one x row */
#endif
#ifndef PANEL_BYTES
#define PANEL_BYTES (128 * 1024)
#endif
#ifndef SPLIT
#define SPLIT 1
#endif
#define MAX_R 6
#define MAX_C 4

static void widen_x(const uint16_t *x, int64_t x_stride, int m, int k, int kp, float *xw) {
#pragma omp for schedule(static)
    for (int r = 0; r < m; r++) {
        const uint16_t *src = x + r * x_stride;
        float *dst = xw + (int64_t)r * kp;
        for (int d = 0; d < kp; d += 16)
            for (int i = 0; i < 8; i++) {
                dst[d + i] = d + 2 * i < k ? bf16_to_f32(src[d + 2 * i]) : 0.0f;
                dst[d + 8 + i] = d + 2 * i + 1 < k ? bf16_to_f32(src[d + 2 * i + 1]) : 0.0f;
            }
    }
}

/* acc[r][c] += widened x block xb (row r at xb + r * kp) times the 16 bf16 weights at wb[c]. */
static inline __attribute__((always_inline)) void block_fma(__m256 acc[MAX_R][MAX_C], const float *xb, int64_t kp,
                                                            const uint16_t *const wb[MAX_C], int R, int C) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
#if SPLIT
    __m256 h[MAX_C];
    for (int c = 0; c < C; c++) h[c] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)wb[c]), 16));
    for (int r = 0; r < R; r++) {
        const __m256 xe = _mm256_load_ps(xb + r * kp);
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(h[c], xe, acc[r][c]);
    }
    for (int c = 0; c < C; c++) h[c] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)wb[c]), high));
    for (int r = 0; r < R; r++) {
        const __m256 xo = _mm256_load_ps(xb + r * kp + 8);
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(h[c], xo, acc[r][c]);
    }
#else
    __m256 even[MAX_C], odd[MAX_C];
    for (int c = 0; c < C; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)wb[c]);
        even[c] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        odd[c] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
    }
    for (int r = 0; r < R; r++) {
        const __m256 xe = _mm256_load_ps(xb + r * kp), xo = _mm256_load_ps(xb + r * kp + 8);
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(odd[c], xo, _mm256_fmadd_ps(even[c], xe, acc[r][c]));
    }
#endif
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Outputs [n0, n0 + C) of x rows [r0, r0 + R): each weight block is widened once for all R rows.
 * Weight rows past n_out repeat the last one (from L1), their sums not stored. */
static inline __attribute__((always_inline)) void tile(const float *xw, int64_t kp, const uint16_t *w, const uint16_t *bias,
                                                       const uint16_t *residual, int64_t res_stride, uint16_t *out,
                                                       int r0, int n0, int n_out, int k, int R, int C) {
    const uint16_t *rows[MAX_C], *wb[MAX_C];
    for (int c = 0; c < C; c++) rows[c] = w + (int64_t)(n0 + c < n_out ? n0 + c : n_out - 1) * k;
    __m256 acc[MAX_R][MAX_C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const float *xr = xw + r0 * kp;
    const int k16 = k & ~15;
    for (int d = 0; d < k16; d += 16) {
        for (int c = 0; c < C; c++) wb[c] = rows[c] + d;
        block_fma(acc, xr + d, kp, wb, R, C);
    }
    if (k16 < k) { /* the partial last block from zero-padded copies: a full load could read past W */
        uint16_t tail[MAX_C][16] = {{0}};
        for (int c = 0; c < C; c++) {
            memcpy(tail[c], rows[c] + k16, (size_t)(k - k16) * sizeof(uint16_t));
            wb[c] = tail[c];
        }
        block_fma(acc, xr + k16, kp, wb, R, C);
    }
    for (int c = 0; c < C && n0 + c < n_out; c++) {
        const float b = bias != NULL ? bf16_to_f32(bias[n0 + c]) : 0.0f;
        for (int r = 0; r < R; r++) {
            float s = hsum256(acc[r][c]) + b;
            if (residual != NULL) s += bf16_to_f32(residual[(r0 + r) * res_stride + n0 + c]);
            out[(int64_t)(r0 + r) * n_out + n0 + c] = f32_to_bf16(s);
        }
    }
}

#define TILE_ARGS xw, kp, w, bias, residual, res_stride, out

/* Threads take contiguous runs of C weight rows, each streaming its share of W once. Within a run,
 * a panel of rows (PANEL_BYTES, kept in L2) takes every group of R x rows (kept in L1) in turn. */
static void matmul_avx2(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                        const uint16_t *residual, int64_t res_stride, uint16_t *out, int m, int n_out, int k) {
    const int64_t kp = (k + 15) & ~15;
    float *xw = aligned_alloc(32, (size_t)(m * kp) * sizeof(float));
    if (xw == NULL) return;
    const int C = m == 1 ? TILE_C1 : TILE_C, tiles = (n_out + C - 1) / C;
    int panel = PANEL_BYTES / (2 * k) / C * C;
    panel = panel < C ? C : panel;
#pragma omp parallel
    {
        widen_x(x, x_stride, m, k, (int)kp, xw); /* (ends in the loop's barrier) */
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int lo = (int)((int64_t)tiles * t / nt) * C, hi = (int)((int64_t)tiles * (t + 1) / nt) * C;
        for (int p0 = lo; p0 < hi; p0 += panel) {
            const int p1 = p0 + panel < hi ? p0 + panel : hi;
            if (m == 1) {
                for (int n0 = p0; n0 < p1; n0 += TILE_C1) tile(TILE_ARGS, 0, n0, n_out, k, 1, TILE_C1);
                continue;
            }
            for (int r0 = 0; r0 < m; r0 += TILE_R)
                for (int n0 = p0; n0 < p1; n0 += TILE_C) {
                    switch (m - r0 < TILE_R ? m - r0 : TILE_R) { /* each R its own unrolled code */
                    case 1: tile(TILE_ARGS, r0, n0, n_out, k, 1, TILE_C); break;
                    case 2: tile(TILE_ARGS, r0, n0, n_out, k, 2, TILE_C); break;
                    case 3: tile(TILE_ARGS, r0, n0, n_out, k, 3, TILE_C); break;
#if TILE_R > 4
                    case 4: tile(TILE_ARGS, r0, n0, n_out, k, 4, TILE_C); break;
#endif
#if TILE_R > 5
                    case 5: tile(TILE_ARGS, r0, n0, n_out, k, 5, TILE_C); break;
#endif
                    default: tile(TILE_ARGS, r0, n0, n_out, k, TILE_R, TILE_C);
                    }
                }
        }
    }
    free(xw);
}
#endif

/* out [m, n_out] (contiguous) = bf16(x W^T (+ bias) (+ residual)) of bfloat16 rows x [m, k] (x_stride
 * elements apart) and W [n_out, k] row-major; residual rows res_stride apart. */
void matmul_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                 const uint16_t *residual, int64_t res_stride, uint16_t *out, int m, int n_out, int k) {
#if HAVE_AVX512
    for (int r = 0; r < m; r++)
        gemv_avx512(x + r * x_stride, w, bias, residual == NULL ? NULL : residual + r * res_stride,
                    out + (int64_t)r * n_out, n_out, k);
#elif HAVE_AVX2
    matmul_avx2(x, x_stride, w, bias, residual, res_stride, out, m, n_out, k);
#else
#pragma omp parallel for schedule(static)
    for (int n = 0; n < n_out; n++) {
        const uint16_t *wn = w + (int64_t)n * k;
        for (int r = 0; r < m; r++) {
            const uint16_t *xr = x + r * x_stride;
            float s = 0.0f;
            for (int d = 0; d < k; d++) s += bf16_to_f32(xr[d]) * bf16_to_f32(wn[d]);
            if (bias != NULL) s += bf16_to_f32(bias[n]);
            if (residual != NULL) s += bf16_to_f32(residual[r * res_stride + n]);
            out[(int64_t)r * n_out + n] = f32_to_bf16(s);
        }
    }
#endif
}
