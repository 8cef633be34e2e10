/* The dense layer's small ops, each one call instead of 2-8 torch ops, and the greedy argmax.
 *
 * Each reproduces its torch expression's roundings (noted per function), so swapping one in keeps
 * the model's numbers. Rows go to threads only when there are enough of them to pay for it. */
#include "common.h"
#include "rivulet_kernels.h"

#define PARALLEL_ROWS 16
#define PIECE 256 /* elements per step: each op converts a piece to float32, computes, stores back */

/* out[r] = w * (x[r] * rsqrt(mean(x[r]^2) + eps)), statistics in float32 (HF's RMSNorm). bfloat16
 * rounds x * rsqrt(...) to bfloat16 before the weight multiplies it, as HF's `.to(dtype)` does.
 * x rows are x_stride elements apart; out is contiguous [rows, dim]. */
void rms_norm(const void *x, int64_t x_stride, const void *w, void *out, int64_t rows, int dim, float eps, int dtype) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float v[PIECE], wv[PIECE], sq = 0.0f;
        for (int i0 = 0; i0 < dim; i0 += PIECE) {
            const int n = dim - i0 < PIECE ? dim - i0 : PIECE;
            load_vec(x, dtype, r * x_stride + i0, n, v);
#pragma omp simd reduction(+ : sq)
            for (int i = 0; i < n; i++) sq += v[i] * v[i];
        }
        const float inv = 1.0f / sqrtf(sq / (float)dim + eps);
        for (int i0 = 0; i0 < dim; i0 += PIECE) {
            const int n = dim - i0 < PIECE ? dim - i0 : PIECE;
            load_vec(x, dtype, r * x_stride + i0, n, v);
            load_vec(w, dtype, i0, n, wv);
            for (int i = 0; i < n; i++) v[i] *= inv;
            round_vec(dtype, v, n);
            for (int i = 0; i < n; i++) v[i] *= wv[i];
            store_vec(out, dtype, r * dim + i0, n, v);
        }
    }
}

/* In place, heads [0, heads) of each row of x ([rows, >= heads, head_dim], rows x_stride apart):
 * x = x * cos[r] + cat(x2, x1) * signed_sin[r] (HF's rotate_half with the sign folded into sin, as
 * RotaryCache stores it; cos, sin: [rows, head_dim] in x's dtype, gathered at the rows' positions).
 * Each product and the sum round to the dtype, as the three torch ops do. */
void rotary(void *x, int64_t x_stride, int64_t rows, int heads, int head_dim, const void *cos, const void *sin,
            int dtype) {
    const int half = head_dim / 2;
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float c[MAX_HEAD_DIM], sn[MAX_HEAD_DIM], v[MAX_HEAD_DIM], a[MAX_HEAD_DIM], b[MAX_HEAD_DIM];
        load_vec(cos, dtype, r * head_dim, head_dim, c);
        load_vec(sin, dtype, r * head_dim, head_dim, sn);
        for (int h = 0; h < heads; h++) {
            const int64_t at = r * x_stride + (int64_t)h * head_dim;
            load_vec(x, dtype, at, head_dim, v);
            for (int i = 0; i < half; i++) {
                a[i] = v[i] * c[i];
                a[i + half] = v[i + half] * c[i + half];
                b[i] = v[i + half] * sn[i];
                b[i + half] = v[i] * sn[i + half];
            }
            round_vec(dtype, a, head_dim);
            round_vec(dtype, b, head_dim);
            for (int i = 0; i < head_dim; i++) a[i] += b[i];
            store_vec(x, dtype, at, head_dim, a);
        }
    }
}

/* In place, g[i] = x / (1 + exp(-t)) for x = g[i], n values: silu (t = x) or, where ``gelu``, gelu_tanh
 * (t = 2 sqrt(2 / pi) (x + 0.044715 x^3), since 0.5 x (1 + tanh(t / 2)) is the same function; within a
 * few float32 ulps of torch's tanh form). exp(-t) is e = exp(-|t|) for t >= 0, 1 / e below. */
static void act_f32(float *g, int n, int gelu) {
    const float c1 = 1.5957691216057308f, c3 = 0.0713548162726f; /* 2 sqrt(2 / pi), times 0.044715 */
#if HAVE_AVX512 /* gcc leaves the scalar loop below unvectorized */
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xffffu : (__mmask16)((1u << (n - i)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(m, g + i), one = _mm512_set1_ps(1.0f);
        const __m512 t = gelu ? _mm512_mul_ps(x, _mm512_add_ps(_mm512_set1_ps(c1),
                                                               _mm512_mul_ps(_mm512_set1_ps(c3), _mm512_mul_ps(x, x))))
                              : x;
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(t)));
        const __mmask16 neg = _mm512_cmp_ps_mask(t, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 exp_minus_t = _mm512_mask_div_ps(e, neg, one, e);
        _mm512_mask_storeu_ps(g + i, m, _mm512_div_ps(x, _mm512_add_ps(one, exp_minus_t)));
    }
#elif HAVE_AVX2 /* as the AVX-512 path, the last partial vector under a mask */
    for (int i = 0; i < n; i += 8) {
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - i), lanes);
        const __m256 x = _mm256_maskload_ps(g + i, m), one = _mm256_set1_ps(1.0f);
        const __m256 t = gelu ? _mm256_mul_ps(x, _mm256_add_ps(_mm256_set1_ps(c1),
                                                               _mm256_mul_ps(_mm256_set1_ps(c3), _mm256_mul_ps(x, x))))
                              : x;
        const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), t)));
        const __m256 neg = _mm256_cmp_ps(t, _mm256_setzero_ps(), _CMP_LT_OQ);
        const __m256 exp_minus_t = _mm256_blendv_ps(e, _mm256_div_ps(one, e), neg);
        _mm256_maskstore_ps(g + i, m, _mm256_div_ps(x, _mm256_add_ps(one, exp_minus_t)));
    }
#else
    for (int i = 0; i < n; i++) {
        const float t = gelu ? g[i] * (c1 + c3 * (g[i] * g[i])) : g[i];
        const float e = exp_nonpositive(-fabsf(t));
        g[i] = g[i] / (1.0f + (t < 0.0f ? 1.0f / e : e));
    }
#endif
}

/* In place, g[i] = act(g[i]) rounded to the dtype, times u[i] (act: silu, or gelu_tanh where ``gelu``),
 * n values as loaded from tensors of that dtype: act_mul_row's operations, a
 * lane's result independent of n and of where the pieces start, so the same bits. quant.c's gated
 * matmul runs it on the rows of each panel. */
void act_mul_f32(float *g, const float *u, int n, int dtype, int gelu) {
    act_f32(g, n, gelu);
    round_vec(dtype, g, n);
    for (int i = 0; i < n; i++) g[i] *= u[i];
}

/* out[i] = act(gate[i]) * up[i] of one gate_up row [gate (inner) | up (inner)] (act: silu, or gelu_tanh
 * where ``gelu``: Gemma's MLP), act's result rounded to the dtype before the product, as torch's two ops do. */
static void act_mul_row(const void *gate_up, void *out, int inner, int dtype, int gelu) {
    float g[PIECE], u[PIECE];
    for (int i0 = 0; i0 < inner; i0 += PIECE) {
        const int n = inner - i0 < PIECE ? inner - i0 : PIECE;
        load_vec(gate_up, dtype, i0, n, g);
        load_vec(gate_up, dtype, inner + i0, n, u);
        act_mul_f32(g, u, n, dtype, gelu);
        store_vec(out, dtype, i0, n, g);
    }
}

void silu_mul_row(const void *gate_up, void *out, int inner, int dtype) { act_mul_row(gate_up, out, inner, dtype, 0); }

/* act_mul_row over rows [rows, 2 * inner] -> [rows, inner]. */
static void act_mul(const void *gate_up, void *out, int64_t rows, int inner, int dtype, int gelu) {
    const int64_t elem = dtype == DTYPE_BF16 ? 2 : 4;
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++)
        act_mul_row((const char *)gate_up + r * 2 * inner * elem, (char *)out + r * inner * elem, inner, dtype, gelu);
}

void gelu_tanh_mul(const void *gate_up, void *out, int64_t rows, int inner, int dtype) {
    act_mul(gate_up, out, rows, inner, dtype, 1);
}

void silu_mul(const void *gate_up, void *out, int64_t rows, int inner, int dtype) {
    act_mul(gate_up, out, rows, inner, dtype, 0);
}

/* tanh's odd Taylor terms past y (y^3 .. y^11) for |y| < SOFTCAP_SMALL, where (1 - e) / (1 + e)
 * loses digits to the cancellation in 1 - e; the first left out is below 1e-10 of tanh there. */
#define SOFTCAP_SMALL 0.25f
#define TANH_T3 (-3.33333333e-1f)
#define TANH_T5 1.33333333e-1f
#define TANH_T7 (-5.39682540e-2f)
#define TANH_T9 2.18694885e-2f
#define TANH_T11 (-8.86323552e-3f)

/* cap * tanh(x / cap) of one value (softcap_f32's scalar form). */
static inline float softcap1(float x, float cap) {
    const float y = x / cap, a = fabsf(y), a2 = a * a;
    const float e = exp_nonpositive(-2.0f * a);
    float t = (1.0f - e) / (1.0f + e);
    if (a < SOFTCAP_SMALL)
        t = a + a * a2 * ((((TANH_T11 * a2 + TANH_T9) * a2 + TANH_T7) * a2 + TANH_T5) * a2 + TANH_T3);
    t = copysignf(t, y); /* tanh is odd */
    return t * cap;
}

#if HAVE_AVX512
/* cap * tanh(x / cap), lane-wise (softcap_f32's). */
static inline __m512 softcap512(__m512 x, __m512 cap) {
    const __m512 y = _mm512_div_ps(x, cap), one = _mm512_set1_ps(1.0f), a = _mm512_abs_ps(y);
    const __m512 e = exp512(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
    __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __m512 a2 = _mm512_mul_ps(a, a);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(TANH_T11), a2, _mm512_set1_ps(TANH_T9));
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(TANH_T7));
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(TANH_T5));
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(TANH_T3));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, a2), a, a);
    t = _mm512_mask_mov_ps(t, _mm512_cmp_ps_mask(a, _mm512_set1_ps(SOFTCAP_SMALL), _CMP_LT_OQ), small);
    t = _mm512_or_ps(t, _mm512_and_ps(y, _mm512_set1_ps(-0.0f))); /* tanh is odd: y's sign */
    return _mm512_mul_ps(t, cap);
}
#elif HAVE_AVX2
/* cap * tanh(x / cap), lane-wise (softcap_f32's). */
static inline __m256 softcap256(__m256 x, __m256 cap) {
    const __m256 y = _mm256_div_ps(x, cap), one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    const __m256 a = _mm256_andnot_ps(sign, y);
    const __m256 e = exp256(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f)));
    __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    const __m256 a2 = _mm256_mul_ps(a, a);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(TANH_T11), a2, _mm256_set1_ps(TANH_T9));
    p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(TANH_T7));
    p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(TANH_T5));
    p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(TANH_T3));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, a2), a, a);
    t = _mm256_blendv_ps(t, small, _mm256_cmp_ps(a, _mm256_set1_ps(SOFTCAP_SMALL), _CMP_LT_OQ));
    t = _mm256_or_ps(t, _mm256_and_ps(y, sign)); /* tanh is odd: y's sign */
    return _mm256_mul_ps(t, cap);
}
#endif

/* In place, x[i] = cap * tanh(x[i] / cap) over n contiguous float32 values: soft-capped logits
 * (Gemma 2's and 4's final ones) in one pass where torch takes three over the whole vocabulary.
 * tanh(y) as (1 - e) / (1 + e), e = exp(-2 |y|) (silu_mul_row's exp), with y's sign, and the odd
 * series below SOFTCAP_SMALL: within a few float32 ulps of torch's tanh, not its bits. */
void softcap_f32(float *x, int64_t n, float cap) {
    const int64_t chunk = 4096;
#pragma omp parallel for if (n >= 16 * chunk)
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
        const int64_t c1 = n - c0 < chunk ? n : c0 + chunk;
        int64_t i = c0;
#if HAVE_AVX512
        for (; i + 16 <= c1; i += 16) _mm512_storeu_ps(x + i, softcap512(_mm512_loadu_ps(x + i), _mm512_set1_ps(cap)));
#elif HAVE_AVX2
        for (; i + 8 <= c1; i += 8) _mm256_storeu_ps(x + i, softcap256(_mm256_loadu_ps(x + i), _mm256_set1_ps(cap)));
#endif
        for (; i < c1; i++) x[i] = softcap1(x[i], cap);
    }
}

/* softcap_f32's operations on x[0, n), the values at offsets at .. at + n - 1 of a tensor of
 * ``total`` values that one softcap_f32 call would cap: each value by the form that call gives it
 * (the vector form, but the scalar one past total's last whole vector; lanes are independent), so
 * the same bits. The LM head's argmax route caps each panel it computes so (quant.c). */
void softcap_at(float *x, int64_t n, int64_t at, int64_t total, float cap) {
#if HAVE_AVX512
    const int64_t width = 16;
#elif HAVE_AVX2
    const int64_t width = 8;
#else
    const int64_t width = 0;
#endif
    int64_t vec = width ? total - total % width - at : 0; /* x[0, vec): the vector form */
    vec = vec < 0 ? 0 : vec > n ? n : vec;
    int64_t i = 0;
#if HAVE_AVX512
    for (; i < vec; i += 16) {
        const __mmask16 m = vec - i >= 16 ? 0xffffu : (__mmask16)((1u << (vec - i)) - 1);
        _mm512_mask_storeu_ps(x + i, m, softcap512(_mm512_maskz_loadu_ps(m, x + i), _mm512_set1_ps(cap)));
    }
    i = vec; /* (the loop steps past a part-vector's end) */
#elif HAVE_AVX2
    for (; i + 8 <= vec; i += 8) _mm256_storeu_ps(x + i, softcap256(_mm256_loadu_ps(x + i), _mm256_set1_ps(cap)));
    if (i < vec) { /* the last part-vector: its lanes in a zeroed vector */
        float part[8] = {0};
        memcpy(part, x + i, (size_t)(vec - i) * sizeof(float));
        _mm256_storeu_ps(part, softcap256(_mm256_loadu_ps(part), _mm256_set1_ps(cap)));
        memcpy(x + i, part, (size_t)(vec - i) * sizeof(float));
        i = vec;
    }
#endif
    for (; i < n; i++) x[i] = softcap1(x[i], cap);
}

#if HAVE_AVX2
/* 8 values of a float32 or bfloat16 tensor from element i on, as float32. */
static inline __m256 load8(const void *x, int dtype, int64_t i) {
    if (dtype == DTYPE_BF16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16));
    return _mm256_loadu_ps((const float *)x + i);
}

/* Row x (n values from base on), 8 at a time into 4 independent running maxima (a blend chain
 * each, so one compare's latency does not pace the loop); then the least index among the 32
 * lanes holding the maximum, and the scalar tail (later indices: they win only when larger). */
static int64_t argmax_avx2(const void *x, int64_t base, int n, int dtype) {
    __m256 best[4];
    __m256i best_at[4], at[4];
    for (int j = 0; j < 4; j++) {
        best[j] = _mm256_set1_ps(-INFINITY);
        best_at[j] = _mm256_setzero_si256();
        at[j] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * j));
    }
    int i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 4; j++) {
            const __m256 v = load8(x, dtype, base + i + 8 * j);
            const __m256 better = _mm256_cmp_ps(v, best[j], _CMP_GT_OQ); /* strictly: the first wins */
            best[j] = _mm256_blendv_ps(best[j], v, better);
            best_at[j] = _mm256_castps_si256(
                _mm256_blendv_ps(_mm256_castsi256_ps(best_at[j]), _mm256_castsi256_ps(at[j]), better));
            at[j] = _mm256_add_epi32(at[j], _mm256_set1_epi32(32));
        }
    float lane[32], top = -INFINITY;
    int32_t lane_at[32];
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_ps(lane + 8 * j, best[j]);
        _mm256_storeu_si256((__m256i *)(lane_at + 8 * j), best_at[j]);
    }
    for (int l = 0; l < 32; l++) top = lane[l] > top ? lane[l] : top;
    int64_t top_at = INT64_MAX; /* some lane holds top (all -inf: index 0, as torch) */
    for (int l = 0; l < 32; l++)
        if (lane[l] == top && lane_at[l] < top_at) top_at = lane_at[l];
    for (; i < n; i++) {
        const int64_t at_i = base + i;
        const float v = dtype == DTYPE_BF16 ? bf16_to_f32(((const uint16_t *)x)[at_i]) : ((const float *)x)[at_i];
        if (v > top) top = v, top_at = i;
    }
    return top_at;
}
#endif

/* out[r] = the first index of row r's largest value (x: [rows, n], rows row_stride apart): the
 * greedy pick. NaN-free rows assumed (a NaN is never picked, where torch's max would pick it). */
void argmax_rows(const void *x, int64_t row_stride, int64_t rows, int n, int dtype, int64_t *out) {
#pragma omp parallel for if (rows >= 4)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * row_stride;
#if HAVE_AVX512
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i best_at = _mm512_setzero_si512();
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (int i = 0; i < n; i += 16) {
            const __mmask16 m = n - i >= 16 ? 0xffffu : (__mmask16)((1u << (n - i)) - 1);
            const __m512 v =
                dtype == DTYPE_BF16
                    ? _mm512_castsi512_ps(_mm512_slli_epi32(
                          _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)x + base + i)), 16))
                    : _mm512_maskz_loadu_ps(m, (const float *)x + base + i);
            const __mmask16 better = _mm512_mask_cmp_ps_mask(m, v, best, _CMP_GT_OQ); /* strictly: first wins */
            best = _mm512_mask_mov_ps(best, better, v);
            best_at = _mm512_mask_mov_epi32(best_at, better, at);
            at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
        }
        const __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)), _CMP_EQ_OQ);
        out[r] = top ? _mm512_mask_reduce_min_epi32(top, best_at) : 0;
#elif HAVE_AVX2
        out[r] = argmax_avx2(x, base, n, dtype);
#else
        float best = -INFINITY;
        int64_t best_at = 0;
        for (int i = 0; i < n; i++) {
            const float v = dtype == DTYPE_BF16 ? bf16_to_f32(((const uint16_t *)x)[base + i]) : ((const float *)x)[base + i];
            if (v > best) {
                best = v;
                best_at = i;
            }
        }
        out[r] = best_at;
#endif
    }
}

/* The instruction set this build targets (ISA_* in common.h): the loader checks it is the one it asked for. */
int kernel_isa(void) { return ISA; }

/* rivulet_kernels.h's: set by the loader (kernels.py, from kind.weight_prefetch_nta) before any call. */
int weight_prefetch_nta = 0;
