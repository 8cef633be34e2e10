/* The screened greedy head: a 16-bit LM head's one-row argmax from an 8-bit copy of it, exact.
 *
 * A greedy row needs only the argmax of the head's logits (quant.c's quant_matmul_argmax). A BF16 or
 * F16 head reads 2 bytes a weight a step; gpt-oss's 201088 x 2880 head is 1.16 GB, over half a
 * one-row step's bytes. The screen keeps beside it, from load, an int8 copy with one float scale a
 * row (q_i, s_i: w_i ~ s_i q_i, s_i = max |w_i| / 127) and a radius a row, and a step
 * 1. computes approx_i = s_i (q_i . x) in float32 (1 byte a weight: half the reads),
 * 2. bounds |exact_i - approx_i| <= b_i = R_i ||x||, exact_i the value quant_matmul_argmax computes
 *    for row i (quant_f16.c's one-row tile: x as float32, products exact, float32 sums). By
 *    Cauchy-Schwarz, with e_i = w_i - s_i q_i (float64 at load):
 *      |w_i.x - (s_i q_i).x| <= ||e_i|| ||x||                 (the copy's rounding)
 *      |exact_i - w_i.x|     <= gamma_k ||w_i|| ||x||         (the tile's float32 sums, any order)
 *      |approx_i - (s_i q_i).x| <= gamma_(k+1) ||s_i q_i|| ||x|| (this file's sums and the scaling)
 *    so R_i = ||e_i|| + g (||w_i|| + ||s_i q_i||), g = 2 gamma_(k+4) (generous), each rounded up;
 *    plus, for sums that underflow (a float32 operation's error there is absolute, up to 2^-150),
 *    8 k 2^-149 whatever the row;
 * 3. keeps the candidates, rows with approx_i + b_i >= T = max_j (approx_j - b_j): the exact argmax
 *    M = max exact_j >= T, and any row with exact_i >= M has approx_i + b_i >= exact_i >= T. (bf16
 *    logits are rounded before the argmax: every row whose value rounds to round(M) is kept by
 *    lowering T by 2^-6 |T|, more than a bf16 step.) The bounds are added in float64, b_i inflated
 *    by 2^-30 of itself, far above float64's rounding of those sums;
 * 4. computes the candidates' exact values by the head's own tile on that one row (quant_f16.c's
 *    one-row tile gives each row the same sums whatever rows beside it: its tests and
 *    tests/gpu_worker/test_head_screen.py check those bits against the full route), rounds them to
 *    x's dtype as argmax_panel does, and takes the largest, the first index on ties.
 * The token is the full route's, bit for bit, on every input. Where x is not finite, its norm
 * could overflow, more than max_cand rows are candidates, or head_screen is 0, the full route runs
 * (quant_matmul_argmax). How many rows are candidates: docs/benchmarks-history.md, "The screened greedy head".
 *
 * One int8 row is read front to back (widened to float32 in registers, float32 FMAs): a thread's
 * rows are one sequential stream, as quant_f16.c's one-row tile reads its rows. */
#include <stdlib.h>

#include "common.h"
#include "quant.h"
#include "rivulet_kernels.h"

int head_screen = 1;

static inline float w16_at(int type, const uint8_t *row, int64_t j) {
    uint16_t h;
    memcpy(&h, row + 2 * j, sizeof h);
    return type == QTYPE_F16 ? f16_to_f32(h) : bf16_to_f32(h);
}

/* float64 v rounded up to a float32 (v >= 0, finite as a float). */
static inline float up_f32(double v) {
    float f = (float)v;
    return (double)f < v ? nextafterf(f, INFINITY) : f;
}

/* gamma_m = m u / (1 - m u), u = 2^-24: the bound on a float32 sum of m terms' error over their |.| sum. */
static inline double gamma_f32(int64_t m) {
    const double mu = (double)m * 0x1p-24;
    return mu / (1.0 - mu);
}

int head_screen_build(int type, const uint8_t *w, int64_t n, int64_t k, void *q, float *scale, float *radius) {
    if (type != QTYPE_BF16 && type != QTYPE_F16) return RV_ERR_TYPE;
    if (k <= 0 || k % 32 != 0) return RV_ERR_K;
    const double g = 2.0 * gamma_f32(k + 4);
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = w + i * 2 * k;
        int8_t *qi = (int8_t *)q + i * k;
        float top = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            const float v = w16_at(type, row, j);
            if (!isfinite(v)) bad = 1;
            top = fabsf(v) > top ? fabsf(v) : top;
        }
        const float s = top / 127.0f;
        double ee = 0.0, dd = 0.0, ww = 0.0;
        for (int64_t j = 0; j < k; j++) {
            const float v = w16_at(type, row, j);
            long r = s > 0.0f ? lrintf(v / s) : 0;
            r = r > 127 ? 127 : r < -127 ? -127 : r;
            qi[j] = (int8_t)r;
            const double d = (double)s * (double)r, e = (double)v - d; /* (both exact in float64) */
            ee += e * e, dd += d * d, ww += (double)v * v;
        }
        scale[i] = s;
        const double r = (sqrt(ee) + g * (sqrt(dd) + sqrt(ww))) * (1.0 + 0x1p-20);
        radius[i] = up_f32(r);
        if (!isfinite(radius[i])) bad = 1;
    }
    return bad ? RV_ERR_DTYPE : RV_OK;
}

/* Bytes ahead of the read that the copy's stream prefetches (a row of the next rows). */
#define SCREEN_PF 4096

/* q_i . x in float32: int8 widened to float32, FMAs, k a multiple of 32. */
static inline float dot_i8(const int8_t *q, const float *x, int64_t k) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t j = 0;
    for (; j + 64 <= k; j += 64) {
        _mm_prefetch((const char *)(q + j + SCREEN_PF), _MM_HINT_T0);
        a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + j)))),
                             _mm512_loadu_ps(x + j), a0);
        a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + j + 16)))),
                             _mm512_loadu_ps(x + j + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + j + 32)))),
                             _mm512_loadu_ps(x + j + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + j + 48)))),
                             _mm512_loadu_ps(x + j + 48), a3);
    }
    for (; j < k; j += 16)
        a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + j)))),
                             _mm512_loadu_ps(x + j), a0);
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0; j < k; j += 32) {
        _mm_prefetch((const char *)(q + j + SCREEN_PF), _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + j));
        const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), _mm256_loadu_ps(x + j), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))),
                             _mm256_loadu_ps(x + j + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), _mm256_loadu_ps(x + j + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))),
                             _mm256_loadu_ps(x + j + 24), a3);
    }
    const __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
#else
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < k; j++) s += (float)q[j] * x[j];
    return s;
#endif
}

/* The full route (quant_matmul_argmax, one row) into out[0]; out[1] = -1. */
static int full_route(int type, const uint8_t *w, int64_t n, int64_t k, const void *x, int x_dtype, int64_t *out) {
    void *scratch = malloc((size_t)quant_act_row_bytes(type, k));
    if (scratch == NULL) return RV_ERR_NO_MEMORY;
    const int status = quant_matmul_argmax(type, w, n, k, x, k, x_dtype, 1, scratch, 0, 0.0f, out);
    free(scratch);
    out[1] = -1;
    return status;
}

int head_screen_argmax(int type, const uint8_t *w, int64_t n, int64_t k, const void *q, const float *scale,
                       const float *radius, const void *x, int x_dtype, int64_t max_cand, float *approx,
                       int64_t *cand, float *exact, int64_t *out) {
    const qtype_ops *ops = quant_ops(type);
    if ((type != QTYPE_BF16 && type != QTYPE_F16) || ops == NULL) return RV_ERR_TYPE;
    if (k <= 0 || k % 32 != 0) return RV_ERR_K;
    if (x_dtype != DTYPE_F32 && x_dtype != DTYPE_BF16) return RV_ERR_DTYPE;
    if (n <= 0) {
        out[0] = 0, out[1] = 0;
        return RV_OK;
    }
    if (!head_screen) return full_route(type, w, n, k, x, x_dtype, out);
    float *xf = malloc((size_t)k * sizeof(float));
    uint8_t *xq = malloc((size_t)quant_act_row_bytes(type, k));
    if (xf == NULL || xq == NULL) {
        free(xf), free(xq);
        return RV_ERR_NO_MEMORY;
    }
    if (x_dtype == DTYPE_BF16)
        for (int64_t j = 0; j < k; j++) xf[j] = bf16_to_f32(((const uint16_t *)x)[j]);
    else
        memcpy(xf, x, (size_t)k * sizeof(float));
    double xx = 0.0;
    for (int64_t j = 0; j < k; j++) xx += (double)xf[j] * xf[j];
    const double xn = sqrt(xx) * (1.0 + 0x1p-40), inflate = 1.0 + 0x1p-30, tiny = 8.0 * (double)k * 0x1p-149;
    /* The exact sums' partial sums stay below ||w_i|| ||x|| <= R_i ||x|| / g: far from FLT_MAX here. */
    int fits = isfinite(xn) && xn < 1e30;
    double lo = -INFINITY;
    if (fits) {
#pragma omp parallel for schedule(static) reduction(max : lo)
        for (int64_t i = 0; i < n; i++) {
            const float a = scale[i] * dot_i8((const int8_t *)q + i * k, xf, k);
            approx[i] = a;
            const double l = (double)a - ((double)radius[i] * xn * inflate + tiny);
            lo = l > lo ? l : lo;
        }
        fits = isfinite(lo);
    }
    int64_t count = 0;
    if (fits) {
        const double t = x_dtype == DTYPE_BF16 ? lo - fabs(lo) * 0x1p-6 - 0x1p-120 : lo;
        for (int64_t i = 0; i < n; i++) {
            if ((double)approx[i] + ((double)radius[i] * xn * inflate + tiny) >= t) {
                if (count < max_cand) cand[count] = i;
                count++;
            }
        }
    }
    if (!fits || count > max_cand || count == 0) {
        free(xf), free(xq);
        return full_route(type, w, n, k, x, x_dtype, out);
    }
    ops->quantize_act(xf, k, xq);
    const int64_t wrb = 2 * k, nb = k / ops->block, xrb = nb * ops->act_block_bytes;
#pragma omp parallel for schedule(static) if (count >= 64)
    for (int64_t c = 0; c < count; c++) {
        float v;
        ops->tile(w + cand[c] * wrb, wrb, 1, xq, xrb, 1, nb, &v, 1);
        exact[c] = x_dtype == DTYPE_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v;
    }
    int64_t best = 0;
    for (int64_t c = 1; c < count; c++)
        if (exact[c] > exact[best]) best = c; /* (candidates ascend: the first index on ties) */
    out[0] = cand[best];
    out[1] = count;
    free(xf), free(xq);
    return RV_OK;
}
