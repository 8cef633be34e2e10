/* Matmuls of few rows over plain [out, in] bfloat16 weights: decode steps, which mostly stream the
 * weights. Sums in float32 and one rounding to bfloat16 at the end, bias and residual added before
 * it, as oneDNN's matmul with its add post-op. */
#include "common.h"
#include "rivulet_kernels.h"
#include <stdlib.h>

#if HAVE_AVX512
/* One row x [k]: 16 weight rows at a time (their dot products summed by sum16), threads taking
 * contiguous blocks: each streams its share of W front to back, without the per-call start-up that
 * weighs on oneDNN's time for a matrix of about a megabyte (docs/benchmarks.md). */
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
 * terms in any order; only float32 rounding sees it, far inside the one bf16 rounding at the end).
 *
 * A tile is R x rows by C weight rows: R * C accumulators. 5 x 2 holds 10 accumulators, 4 widened
 * weights and an x vector in the 16 ymm registers, and loads 12 vectors per 20 FMAs; the FMAs set
 * the pace (3 x 3 or 4 x 3 spill, 6 x 2 and 4 x 2 load more per FMA: all measured slower). One x
 * row is memory-bound: 4 weight rows, 4 streams in flight. */
#define TILE_R 5
#define TILE_C 2
#define TILE_C1 4                   /* weight rows per tile at one x row */
#define PANEL_BYTES (128 * 1024)    /* of weight rows: stay in L2 while each group of x rows passes */
#define MAX_C 4
static const int WIDE_HIGH = (int)0xffff0000u;

static void widen_x(const uint16_t *x, int64_t x_stride, int m, int k, int64_t kp, float *xw) {
#pragma omp for schedule(static)
    for (int r = 0; r < m; r++) {
        const uint16_t *src = x + r * x_stride;
        float *dst = xw + r * kp;
        int d = 0;
        for (; d + 16 <= k; d += 16) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(src + d));
            _mm256_store_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
            _mm256_store_ps(dst + d + 8, _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(WIDE_HIGH))));
        }
        for (int i = 0; d < kp && i < 8; i++) { /* the partial last block, zero-padded */
            dst[d + i] = d + 2 * i < k ? bf16_to_f32(src[d + 2 * i]) : 0.0f;
            dst[d + 8 + i] = d + 2 * i + 1 < k ? bf16_to_f32(src[d + 2 * i + 1]) : 0.0f;
        }
    }
}

/* acc[r][c] += widened x block xb (row r at xb + r * kp) times the 16 bf16 weights at wb[c]. */
static inline __attribute__((always_inline)) void block_fma(__m256 acc[TILE_R][MAX_C], const float *xb, int64_t kp,
                                                            const uint16_t *const wb[MAX_C], int R, int C) {
    __m256 even[MAX_C], odd[MAX_C];
    for (int c = 0; c < C; c++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)wb[c]);
        IN_REGISTER(v);
        even[c] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        odd[c] = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(WIDE_HIGH)));
    }
    for (int r = 0; r < R; r++) {
        __m256 xe = _mm256_load_ps(xb + r * kp);
        IN_REGISTER(xe);
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(even[c], xe, acc[r][c]);
    }
    for (int r = 0; r < R; r++) {
        __m256 xo = _mm256_load_ps(xb + r * kp + 8);
        IN_REGISTER(xo);
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(odd[c], xo, acc[r][c]);
    }
}


/* Outputs [n0, n0 + C) of x rows [r0, r0 + R), R and C constants once inlined (the accumulators
 * stay in registers). Weight rows past n_out repeat the last one (from L1), their sums unstored. */
static inline __attribute__((always_inline)) void tile(const float *xw, int64_t kp, const uint16_t *w,
                                                       const uint16_t *bias, const uint16_t *residual,
                                                       int64_t res_stride, uint16_t *out, int r0, int n0,
                                                       int n_out, int k, int R, int C) {
    const uint16_t *rows[MAX_C], *wb[MAX_C];
    for (int c = 0; c < C; c++) rows[c] = w + (int64_t)(n0 + c < n_out ? n0 + c : n_out - 1) * k;
    __m256 acc[TILE_R][MAX_C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const float *xr = xw + r0 * kp;
    const int k16 = k & ~15;
    for (int d = 0; d < k16; d += 16) {
        /* The next tile's rows, a line of each per 2 blocks: in flight while this one computes (the
         * hardware prefetcher alone leaves x rows 2-5 waiting on memory). Past W's end: a no-op. */
        if ((d & 31) == 0)
            for (int c = 0; c < C; c++) _mm_prefetch((const char *)(rows[c] + C * k + d), _MM_HINT_T0);
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
            float s = hsum8(acc[r][c]) + b;
            if (residual != NULL) s += bf16_to_f32(residual[(r0 + r) * res_stride + n0 + c]);
            out[(int64_t)(r0 + r) * n_out + n0 + c] = f32_to_bf16(s);
        }
    }
}

#define TILE_ARGS xw, kp, w, bias, residual, res_stride, out

/* Weight rows [n0, n1) (whole tiles) against every x row: the x rows in near-equal groups of at
 * most TILE_R (16 rows: 4 x 4, not 5 + 5 + 5 + 1), each group over all the tiles in turn. */
static void rows_block(const float *xw, int64_t kp, const uint16_t *w, const uint16_t *bias, const uint16_t *residual,
                       int64_t res_stride, uint16_t *out, int m, int n0, int n1, int n_out, int k) {
    if (m == 1) {
        for (int n = n0; n < n1; n += TILE_C1) tile(TILE_ARGS, 0, n, n_out, k, 1, TILE_C1);
        return;
    }
    const int groups = (m + TILE_R - 1) / TILE_R;
    for (int g = 0; g < groups; g++) {
        const int r0 = m * g / groups, rows = m * (g + 1) / groups - r0;
        for (int n = n0; n < n1; n += TILE_C) {
            switch (rows) { /* each R its own unrolled code */
            case 1: tile(TILE_ARGS, r0, n, n_out, k, 1, TILE_C); break;
            case 2: tile(TILE_ARGS, r0, n, n_out, k, 2, TILE_C); break;
            case 3: tile(TILE_ARGS, r0, n, n_out, k, 3, TILE_C); break;
            case 4: tile(TILE_ARGS, r0, n, n_out, k, 4, TILE_C); break;
            default: tile(TILE_ARGS, r0, n, n_out, k, TILE_R, TILE_C);
            }
        }
    }
}

/* Threads take contiguous runs of tiles, each streaming its share of W once, in panels: from
 * memory for the first group of x rows, from L2 for the others. */
static void matmul_avx2(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                        const uint16_t *residual, int64_t res_stride, uint16_t *out, int m, int n_out, int k) {
    const int64_t kp = (k + 15) & ~15;
    float *xw = aligned_alloc(32, (size_t)(m * kp + 8) * sizeof(float)); /* (never size 0) */
    if (xw == NULL) return;
    const int C = m == 1 ? TILE_C1 : TILE_C, tiles = (n_out + C - 1) / C;
    const int panel = PANEL_BYTES / (2 * k + 2) / C * C > C ? PANEL_BYTES / (2 * k + 2) / C * C : C;
#pragma omp parallel
    {
        widen_x(x, x_stride, m, k, kp, xw); /* (ends in the loop's barrier) */
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int lo = (int)((int64_t)tiles * t / nt) * C, hi = (int)((int64_t)tiles * (t + 1) / nt) * C;
        for (int p0 = lo; p0 < hi; p0 += panel)
            rows_block(TILE_ARGS, m, p0, p0 + panel < hi ? p0 + panel : hi, n_out, k);
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
