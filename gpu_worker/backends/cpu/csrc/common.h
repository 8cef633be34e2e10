/* What the worker's C kernels share: dtype codes, limits, bf16 conversions, exp, prefetch, and which
 * instruction set this build targets (gpu_worker/backends/cpu/build.py compiles every .c file here into one
 * library per CPU kind, with that kind's -march).
 *
 * Plain C with OpenMP, called through ctypes with raw pointers: no torch headers,
 * so a build takes about a second. Loaded after torch, the library's libgomp.so.1
 * resolves to the copy torch already loaded, so its parallel loops share torch's
 * thread pool and follow torch.set_num_threads.
 *
 * Tensors are float32 (dtype code 0) or bfloat16 (code 1); all math is float32. A KV cache may
 * also be float16 (code 2: --kv-cache-dtype), which only the attention reads and writes.
 */
#ifndef RIVULET_COMMON_H
#define RIVULET_COMMON_H
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "rivulet_kernels.h"

/* The instruction set of this build, from the compiler's -march (one per CPU kind):
 * ISA_AVX512_BF16: AVX-512 with vdpbf16ps; ISA_AVX2: AVX2 + FMA (x86-64-v3, also the build for
 * AVX-512 CPUs without BF16); ISA_PORTABLE: plain C the compiler vectorizes as it can. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define ISA ISA_AVX512_BF16
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ISA ISA_AVX2
#else
#define ISA ISA_PORTABLE
#endif
#define HAVE_AVX512 (ISA == ISA_AVX512_BF16)
#define HAVE_AVX2 (ISA == ISA_AVX2)

/* fmaxf's result (a NaN argument yields the other one), inlined: without -ffinite-math-only gcc
 * calls libm's fmaxf through the PLT, once per element in a loop. */
static inline float max_f(float a, float b) { return (b > a || a != a) ? b : a; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16; /* round to nearest even */
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded); /* a select: loops vectorize */
}

/* IEEE half precision <-> float32, round to nearest even, on the bits (F. Giesen's
 * half_to_float and float_to_half_fast3_rtne): no F16C needed, so every build has them. */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t shifted_exp = 0x7c00u << 13; /* the exponent mask, shifted */
    uint32_t o = ((uint32_t)h & 0x7fffu) << 13;
    const uint32_t exp = shifted_exp & o;
    o += (127u - 15u) << 23; /* the exponent bias */
    if (exp == shifted_exp) {
        o += (128u - 16u) << 23; /* inf, NaN */
    } else if (exp == 0) {       /* zero, subnormal: renormalized by a float subtraction */
        const uint32_t magic_bits = 113u << 23;
        float f, magic;
        o += 1u << 23;
        memcpy(&f, &o, sizeof f);
        memcpy(&magic, &magic_bits, sizeof magic);
        f -= magic;
        memcpy(&o, &f, sizeof o);
    }
    o |= ((uint32_t)h & 0x8000u) << 16;
    float out;
    memcpy(&out, &o, sizeof out);
    return out;
}

static inline uint16_t f32_to_f16(float f) {
    const uint32_t f32_inf = 255u << 23, f16_max = (127u + 16u) << 23;
    const uint32_t denorm_magic_bits = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint16_t o;
    if (u >= f16_max) { /* past the largest half: inf (NaN stays NaN) */
        o = u > f32_inf ? 0x7e00 : 0x7c00;
    } else if (u < (113u << 23)) { /* a subnormal half: the float addition rounds it */
        float x, magic;
        memcpy(&x, &u, sizeof x);
        memcpy(&magic, &denorm_magic_bits, sizeof magic);
        x += magic;
        memcpy(&u, &x, sizeof u);
        o = (uint16_t)(u - denorm_magic_bits);
    } else {
        const uint32_t mant_odd = (u >> 13) & 1u;
        u += ((uint32_t)(15 - 127) << 23) + 0xfffu; /* rebias; round half up ... */
        u += mant_odd;                               /* ... to even */
        o = (uint16_t)(u >> 13);
    }
    return o | (uint16_t)(sign >> 16);
}

/* n elements of a float32, bfloat16 or float16 tensor from element ``offset`` on, as float32. */
static inline void load_vec(const void *base, int dtype, int64_t offset, int n, float *dst) {
    if (dtype == DTYPE_BF16) {
        const uint16_t *src = (const uint16_t *)base + offset;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else if (dtype == DTYPE_F16) {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int i = 0; i < n; i++) dst[i] = f16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
    }
}

/* Cephes' expf, shared by exp_nonpositive, exp512 and exp256: x = n ln2 + r with ln2 in two parts
 * (LN2_HI exact in float), then exp(r) = 1 + r + r^2 (((((P0 r + P1) r + P2) r + P3) r + P4) r + P5). */
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO (-2.12194440e-4f)
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

/* exp(x) for x <= 0 with relative error ~2e-7 (Cephes' expf polynomial), for the portable paths.
 * (gcc 12 still keeps loops around it scalar; the AVX-512 paths use exp512.) */
static inline float exp_nonpositive(float x) {
    /* x = max(x, -87), -inf included, on the bits: as a float select, gcc turns the clamp into a
     * branch (a clamped input makes the result a constant) and the loop stays scalar. A negative
     * float of larger magnitude is a larger (less negative) int32, so "below -87" is bits > lim. */
    union { float f; int32_t i; } in = {.f = x};
    const int32_t lim = (int32_t)0xC2AE0000u; /* -87.0f; exp(-87) ~ 1.6e-38 adds nothing to a sum >= 1 */
    in.i = ((in.i < 0) & (in.i > lim)) ? lim : in.i;
    x = in.f;
    const float n = (float)(int32_t)(x * LOG2E - 0.5f); /* round(x / ln 2), x <= 0 */
    const float r = x - n * LN2_HI - n * LN2_LO;          /* x - n ln 2 in two parts */
    float p = EXP_P0;
    p = p * r + EXP_P1;
    p = p * r + EXP_P2;
    p = p * r + EXP_P3;
    p = p * r + EXP_P4;
    p = p * r + EXP_P5;
    union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    return (p * r * r + r + 1.0f) * two_n.f;
}

/* Prefetch the K and V of positions [p0, p1): ``bytes`` from column ``col`` of each token row, into
 * L1 or (to_l2) only as far as L2. Pages are scattered through the pool, so the hardware prefetcher
 * loses the stream at every page edge: asked for up front, many misses are in flight at once. */
static inline void prefetch_kv(const void *k_cache, const void *v_cache, const int64_t *pages, int page_size,
                               int64_t p0, int64_t p1, int64_t kv_row, int64_t col, int elem, int bytes, int to_l2) {
    for (int64_t pos = p0; pos < p1; pos++) {
        const char *k = (const char *)k_cache + ((pages[pos / page_size] * page_size + pos % page_size) * kv_row + col) * elem;
        const char *v = (const char *)v_cache + (k - (const char *)k_cache);
        for (int b = 0; b < bytes; b += 64) {
            if (to_l2) {
                __builtin_prefetch(k + b, 0, 2);
                __builtin_prefetch(v + b, 0, 2);
            } else {
                __builtin_prefetch(k + b, 0, 3);
                __builtin_prefetch(v + b, 0, 3);
            }
        }
    }
}

/* weight_prefetch_nta (rivulet_kernels.h; kind.weight_prefetch_nta) says whether the K-quants'
 * 16-bit tiles, which read each weight block once a step, prefetch it non-temporally: an ordinary
 * prefetch leaves the line in L2, and a victim-cache L3 (AMD's Zen) then fills with weights and
 * drops what the step reads again (KV, routers, activations). The legacy types' tiles (quant_x8.c)
 * and Intel's caches keep the ordinary prefetch. Measured: docs/benchmarks-history.md, "Weights
 * prefetched non-temporally". */

/* One line of streamed K-quant weights, prefetched as weight_prefetch_nta says. */
static inline void prefetch_weights(const void *p) {
    if (weight_prefetch_nta) {
        __builtin_prefetch(p, 0, 0);
    } else {
        __builtin_prefetch(p, 0, 3);
    }
}

/* n float32 values stored to a float32, bfloat16 or float16 tensor at element ``offset``. */
static inline void store_vec(void *base, int dtype, int64_t offset, int n, const float *src) {
    if (dtype == DTYPE_BF16) {
        uint16_t *dst = (uint16_t *)base + offset;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    } else if (dtype == DTYPE_F16) {
        uint16_t *dst = (uint16_t *)base + offset;
        for (int i = 0; i < n; i++) dst[i] = f32_to_f16(src[i]);
    } else {
        memcpy((float *)base + offset, src, (size_t)n * sizeof(float));
    }
}

/* v as a torch op in ``dtype`` would leave it: rounded to bfloat16 (and back), or as is. */
static inline void round_vec(int dtype, float *v, int n) {
    if (dtype != DTYPE_BF16) return;
#pragma omp simd
    for (int i = 0; i < n; i++) v[i] = bf16_to_f32(f32_to_bf16(v[i]));
}

#if HAVE_AVX512
/* Lane i of the result: the sum of the 16 lanes of v[ORDER16[i]]. Four halving rounds of
 * shuffles and adds: 45 instructions for 16 sums, where 16 separate horizontal sums take ~130. */
static const int ORDER16[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15}; /* its own inverse */

static inline __m512 sum16(const __m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++) /* 256-bit halves */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit quarters */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
    for (int i = 0; i < 2; i++) /* pairs within 128 bits */
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[i], x[i + 2], 0x88), _mm512_shuffle_ps(x[i], x[i + 2], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

/* exp(x) for x <= 0, lane-wise: exp_nonpositive's polynomial, with 2^n applied by vscalefps. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif

#if HAVE_AVX2 || HAVE_AVX512
/* Keeps vector v in a register: without it gcc folds a load into every FMA that uses it (a tile's
 * x vector once per weight row), and on CPUs with two load ports the loads, not the FMAs, set the
 * pace (matmul.c, quant_dense.c). */
#define IN_REGISTER(v) __asm__("" : "+x"(v))

/* The sum of v's 8 lanes (the quantized kernels' AVX2 code runs in the AVX-512 build too). */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#if HAVE_AVX2

/* exp(x) for x <= 0, lane-wise: exp_nonpositive's polynomial. AVX2 has no vscalefps: 2^n is built
 * from its bits, n + 127 in the exponent field (n in [-126, 0] after the clamp: a normal float). */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256i ni = _mm256_cvtps_epi32(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E))); /* nearest */
    const __m256 n = _mm256_cvtepi32_ps(ni);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#endif

#endif
