/* Matmuls of few rows over plain [out, in] bfloat16 weights: decode steps, which mostly stream the
 * weights. Sums in float32 and one rounding to bfloat16 at the end, bias and residual added before
 * it, as oneDNN's matmul with its add post-op. */
#include "common.h"

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

/* out [m, n_out] (contiguous) = bf16(x W^T (+ bias) (+ residual)) of bfloat16 rows x [m, k] (x_stride
 * elements apart) and W [n_out, k] row-major; residual rows res_stride apart. */
void matmul_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                 const uint16_t *residual, int64_t res_stride, uint16_t *out, int m, int n_out, int k) {
#if HAVE_AVX512
    for (int r = 0; r < m; r++)
        gemv_avx512(x + r * x_stride, w, bias, residual == NULL ? NULL : residual + r * res_stride,
                    out + (int64_t)r * n_out, n_out, k);
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
