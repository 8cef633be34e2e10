/* BF16 weights at many activation rows (batched decode, prefill) on vdpbf16ps: the ops of
 * QTYPE_BF16 | QTYPE_A8 (quant.h), which the driver (quant.c) splits over threads and panels as any
 * type's. Built where the compiler targets AVX-512 BF16 (the avx512_bf16 and amx kinds); elsewhere
 * qtype_bf16x has no ops, so quant.py's tables never send a call here.
 *
 * Precision: each activation is rounded to bf16 (nearest even, as llama.cpp meets BF16 weights),
 * a relative error of at most 2^-8 a value; the weights are the file's bf16, so each product of two
 * 8-bit significands is exact in float32 and the sums are float32 (vdpbf16ps adds a pair of products
 * into a float32 lane; bf16 subnormals read as zero). A row's error is thus within
 * 2^-8 sum |x w| plus float32 summation (tests/gpu_worker/test_quant_bf16x.py bounds it against
 * float64 over gguf-py's values). One row never comes here: it reads W once, so its pace is the
 * memory's, and quant_f16.c's tile keeps x in float32 there.
 *
 * Layout: the file's (row j's k weights in order), no repack. One vdpbf16ps takes 32 weights of a
 * row and the 32 activations of a row at the same k, so a register tile of R activation rows by C
 * weight rows holds R * C accumulators of 16 lanes and costs R + C loads per R * C instructions, as
 * a repacked [k/2][column][2] layout with broadcast activations would; the lanes of each accumulator
 * are summed once at the end of k (four accumulators at a time, a few instructions an output). */
#include "quant.h"
#include "rivulet_kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

#define FB 32 /* weights per "block": one zmm of bf16, the driver's unit of k */
/* The register tile: TR activation rows x TC weight rows, 24 accumulators + 4 weights + 1 activation
 * of the 32 zmm (6 x 4 ran faster than 4 x 4, 5 x 4 and 2 x 8 at 32 and 128 rows:
 * docs/benchmarks-history.md, "BF16 many rows on vdpbf16ps"); TC a multiple of 4 (sum4). */
#define TR 6
#define TC 4

/* One activation row of k float32 (k a multiple of 32) as k bf16, rounded to nearest even. */
static void act_bf16(const float *x, int64_t k, void *xq) {
    uint8_t *out = (uint8_t *)xq;
    for (int64_t i = 0; i < k; i += FB) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
        _mm512_storeu_si512((void *)(out + 2 * i), (__m512i)v);
    }
}

/* The four lane sums of a, b, c, d: [sum a, sum b, sum c, sum d]. */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    /* per 128-bit half: [a0+a1, a2+a3, b0+b1, b2+b3], then [a.., b.., c.., d..] */
    const __m256 ab = _mm256_hadd_ps(a8, b8), cd = _mm256_hadd_ps(c8, d8), abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* Activation rows [0, R) x weight rows [0, C) over nb blocks (R, C constants once inlined; C a
 * multiple of 4). Rows past nr or nc repeat the last valid one (from L1), their sums not stored. */
static inline __attribute__((always_inline)) void micro(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *x,
                                                        int64_t xrb, int64_t nr, int64_t nb, float *out, int64_t ldo,
                                                        const int R, const int C) {
    const uint8_t *wr[TC], *xr[TR];
    for (int c = 0; c < C; c++) wr[c] = w + (c < nc ? c : nc - 1) * wrb;
    for (int r = 0; r < R; r++) xr[r] = x + (r < nr ? r : nr - 1) * xrb;
    __m512 acc[TR][TC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512bh wv[TC];
        for (int c = 0; c < C; c++) wv[c] = (__m512bh)_mm512_loadu_si512((const void *)(wr[c] + 64 * b));
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xr[r] + 64 * b));
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    for (int r = 0; r < R && r < nr; r++)
        for (int c0 = 0; c0 < C && c0 < nc; c0 += 4) {
            float s[4];
            _mm_storeu_ps(s, sum4(acc[r][c0], acc[r][c0 + 1], acc[r][c0 + 2], acc[r][c0 + 3]));
            for (int c = c0; c < c0 + 4 && c < nc; c++) out[r * ldo + c] = s[c - c0];
        }
}

/* The rows in near-equal groups of at most TR (8 rows: 4 + 4), each group over all the columns'
 * tiles in turn: its activation rows stay in L1 while the panel's weights (in L2) pass. */
static void tile_bf16x(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                       int64_t nb, float *out, int64_t ldo) {
    const int64_t groups = (nr + TR - 1) / TR;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t r0 = nr * g / groups, rows = nr * (g + 1) / groups - r0;
        const uint8_t *x = xq + r0 * xrb;
        for (int64_t c0 = 0; c0 < nc; c0 += TC) {
            const uint8_t *wc = w + c0 * wrb;
            float *o = out + r0 * ldo + c0;
            switch (rows) { /* each R its own unrolled code */
            case 1: micro(wc, wrb, nc - c0, x, xrb, rows, nb, o, ldo, 1, TC); break;
            case 2: micro(wc, wrb, nc - c0, x, xrb, rows, nb, o, ldo, 2, TC); break;
            case 3: micro(wc, wrb, nc - c0, x, xrb, rows, nb, o, ldo, 3, TC); break;
            case 4: micro(wc, wrb, nc - c0, x, xrb, rows, nb, o, ldo, 4, TC); break;
            case 5: micro(wc, wrb, nc - c0, x, xrb, rows, nb, o, ldo, 5, TC); break;
            default: micro(wc, wrb, nc - c0, x, xrb, rows, nb, o, ldo, TR, TC);
            }
        }
    }
}

static void dequant_bf16x(const uint8_t *w, int64_t k, float *out) {
    for (int64_t i = 0; i < k; i++) {
        uint16_t h;
        memcpy(&h, w + 2 * i, sizeof h);
        out[i] = bf16_to_f32(h);
    }
}

static const qtype_ops OPS_BF16X = {QTYPE_BF16 | QTYPE_A8, FB, 2 * FB, 2 * FB, act_bf16, tile_bf16x, dequant_bf16x,
                                    NULL, NULL};

const qtype_ops *qtype_bf16x(int type) { return type == (QTYPE_BF16 | QTYPE_A8) ? &OPS_BF16X : NULL; }

#else /* no vdpbf16ps in this build: BF16 keeps quant_f16.c's tiles and the dense path */

const qtype_ops *qtype_bf16x(int type) {
    (void)type;
    return NULL;
}

#endif
