/* GGUF weights in 16-bit floats, F16 and BF16, computed as they lie (2 bytes a weight, not widened to
 * float32 at load): the qtype_ops of quant.h with a "block" of 32 weights (64 bytes), so the driver
 * (quant.c), the dense path (quant_dense.c), the one-call decode and the experts take them as they
 * take the quantized types. Type codes: ggml's ids (F16 1, BF16 30).
 *
 * Activations are not quantized here: a 16-bit weight is as precise as act_block16's 16-bit
 * activations, and rounding x would add error where the weights add none (so no vdpbf16ps, which
 * would round x to bf16). quantize_act copies the row as float32 (the "activation block": 32
 * floats), and the tile widens the weights in registers and meets them with float32 FMAs: each
 * product exact, each output a float32 sum of them over the vector's lanes, then the lanes' sum.
 * F16: 8 weights a conversion. BF16 (on the x86 builds): a vector of bf16 holds weight 2i in the
 * low half of 32-bit lane i and 2i + 1 in the high half, so a shift left by 16 widens the even
 * weights and a mask of the low half the odd ones; the activation row is copied with each 32's
 * even values first, then its odd ones (x[2i] at i, x[2i + 1] at 16 + i), so both halves meet their
 * x without a shuffle: a 64-byte line of weights costs one load, two integer ops and two FMAs on
 * AVX-512. One activation row (decode) reads each weight row front to back, one after another, so a
 * thread's share of W is one sequential stream; with W on 2 MB pages (the backend copies 16-bit
 * rows into its huge-page arena, layouts.py's in_arena) that runs at the memory's read pace
 * (docs/benchmarks-history.md, "BF16 and F16 one row: a sequential stream on huge pages"). Many
 * rows take the dense path (quant.py's tables), which widens a panel of W at a time into L2 and runs
 * quant_dense.c's float tiles over it.
 */
#include "quant.h"
#include "rivulet_kernels.h"

#define FB 32 /* weights per "block": the driver's unit of k */
#define TR 2  /* activation rows per register tile */
#define TC 4  /* weight rows per register tile */

static inline float f16_at(const uint8_t *w, int64_t i) {
    uint16_t h;
    memcpy(&h, w + 2 * i, sizeof h);
    return fp16_to_f32(h);
}

static inline float bf16_at(const uint8_t *w, int64_t i) {
    uint16_t h;
    memcpy(&h, w + 2 * i, sizeof h);
    return bf16_to_f32(h);
}

/* The activation row as it is: k float32 (k a multiple of 32). */
static void copy_act(const float *x, int64_t k, void *xq) { memcpy(xq, x, (size_t)k * sizeof(float)); }

#if HAVE_AVX2 || HAVE_AVX512
/* BF16's activation row: each 32 values' even ones, then their odd ones (the top comment). */
static void copy_act_eo(const float *x, int64_t k, void *xq) {
    float *out = (float *)xq;
    for (int64_t b = 0; b < k; b += FB)
        for (int i = 0; i < FB / 2; i++) out[b + i] = x[b + 2 * i], out[b + FB / 2 + i] = x[b + 2 * i + 1];
}
#else
#define copy_act_eo copy_act /* the portable tile reads x in order */
#endif

static void dequant_f16(const uint8_t *w, int64_t k, float *out) {
#pragma omp simd
    for (int64_t i = 0; i < k; i++) out[i] = f16_at(w, i);
}

static void dequant_bf16(const uint8_t *w, int64_t k, float *out) {
#pragma omp simd
    for (int64_t i = 0; i < k; i++) out[i] = bf16_at(w, i);
}

#if HAVE_AVX2 || HAVE_AVX512

/* Weights [i, i + 8) of a row as float32. */
static inline __m256 widen8(const uint8_t *row, int64_t i, const int type) {
    const __m128i h = _mm_loadu_si128((const __m128i *)(row + 2 * i));
    if (type == QTYPE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Activation rows [0, R) x weight rows [0, C) (rows past nr / nc repeat the last valid one, their
 * sums not stored): per 8 weights of each row one widening, met by each activation row. */
static inline __attribute__((always_inline)) void micro(const uint8_t *w, int64_t wrb, int64_t nc, const float *x,
                                                        int64_t xs, int64_t nr, int64_t k, float *out, int64_t ldo,
                                                        const int type, const int R, const int C) {
    const uint8_t *wr[TC];
    const float *xr[TR];
    for (int c = 0; c < C; c++) wr[c] = w + (c < nc ? c : nc - 1) * wrb;
    for (int r = 0; r < R; r++) xr[r] = x + (r < nr ? r : nr - 1) * xs;
    __m256 acc[TR][TC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
        __m256 wv[TC];
        for (int c = 0; c < C; c++) {
            _mm_prefetch((const char *)(wr[c] + 2 * i + 1024), _MM_HINT_T0);
            wv[c] = widen8(wr[c], i, type);
        }
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(xr[r] + i);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < R && r < nr; r++)
        for (int c = 0; c < C && c < nc; c++) out[r * ldo + c] = hsum8(acc[r][c]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
typedef __m512 vec;
#define VZERO _mm512_setzero_ps
#define VSUM _mm512_reduce_add_ps
#define VADD _mm512_add_ps
#else
typedef __m256 vec;
#define VZERO _mm256_setzero_ps
#define VSUM hsum8
#define VADD _mm256_add_ps
#endif
#define BF16_PF 1024 /* bytes ahead of each weight row's read: a prefetch per 64-byte block */
/* One row's stream: bytes ahead of the block read, and blocks a step (sums kept apart). AVX-512, on the
 * arena's 2 MB pages, 4 KB ahead: at k = 8192 x (32 KB of float32) and a row (16 KB) fill L1 alone,
 * and lines fetched 8 KB ahead pushed x out; at k <= 4096 the two ran alike. The AVX2 loop, with twice
 * the instructions a block, keeps 8 KB (docs/benchmarks-history.md, "BF16 one row: the prefetch
 * distance, and the read pace at two threads"). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define ROW1_PF 4096
#else
#define ROW1_PF 8192
#endif
#define ROW1_U 4
/* Past ROW1_PAIR_K (k) a thread's rows go two at a time, row c beside row c + half of them: two
 * sequential streams, each x load serving both rows. At k = 8192 x (32 KB of float32) and a row
 * (16 KB) fill L1, so one row at a time missed x's lines every row; two far-apart streams come
 * nearer a plain read's pace there, and not at k = 2048 (docs/benchmarks-history.md, "BF16 one row
 * at k = 8192: two streams a thread"). Each row's sums are its own, in row1's order: the same bits.
 * The AVX2 loop's two rows' sums outnumber its 16 registers; the spills cost less than the missed x
 * lines (docs/benchmarks-history.md, "BF16 one row at two threads"). The AVX-512 builds run the pair
 * on 256-bit halves (rows2_halves). */
#define ROW1_PAIR_K 4096

/* *even += the even weights of the 32 at p times xb[0, 16), *odd += the odd ones times xb[16, 32). */
static inline __attribute__((always_inline)) void bf16_block(const uint8_t *p, const float *xb, vec *even, vec *odd) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512i v = _mm512_loadu_si512((const void *)p);
    *even = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), _mm512_loadu_ps(xb), *even);
    *odd = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u))),
                           _mm512_loadu_ps(xb + 16), *odd);
#else
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 * h));
        *even = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), _mm256_loadu_ps(xb + 8 * h), *even);
        *odd = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, high)), _mm256_loadu_ps(xb + 16 + 8 * h), *odd);
    }
#endif
}

/* *a += weights [0, 16) of the F16 block at p times xb[0, 16), *b += weights [16, 32) times xb[16, 32). */
static inline __attribute__((always_inline)) void f16_block(const uint8_t *p, const float *xb, vec *a, vec *b) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    *a = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)), _mm512_loadu_ps(xb), *a);
    *b = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32))), _mm512_loadu_ps(xb + 16), *b);
#else
    for (int h = 0; h < 2; h++) {
        *a = _mm256_fmadd_ps(widen8(p, 16 * h, QTYPE_F16), _mm256_loadu_ps(xb + 16 * h), *a);
        *b = _mm256_fmadd_ps(widen8(p, 16 * h + 8, QTYPE_F16), _mm256_loadu_ps(xb + 16 * h + 8), *b);
    }
#endif
}

/* Weight rows p[0, S) (S 1 or 2) against one activation row, out[i] for p[i]: each read front to
 * back, ROW1_U blocks a step, each block into its own pair of sums (an FMA's latency covered), then
 * the pairs added in order. The rows share x's loads; each row's sums are the same whatever S. nta:
 * weight_prefetch_nta's value as a constant (two rows: with the test in the loop the compiler's pair
 * loop spilled and ran no faster than one row), or -1: prefetch_weights tests it. */
static inline __attribute__((always_inline)) void rows_front_to_back(const uint8_t *const *p, const float *x,
                                                                     int64_t nb, float *const *out, const int type,
                                                                     const int S, const int nta) {
    vec s0[2][ROW1_U], s1[2][ROW1_U];
    for (int i = 0; i < S; i++)
        for (int u = 0; u < ROW1_U; u++) s0[i][u] = VZERO(), s1[i][u] = VZERO();
    int64_t b = 0;
    for (; b + ROW1_U <= nb; b += ROW1_U)
        for (int u = 0; u < ROW1_U; u++)
            for (int i = 0; i < S; i++) {
                const uint8_t *q = p[i] + 2 * FB * (b + u);
                if (nta < 0)
                    prefetch_weights(q + ROW1_PF);
                else if (nta)
                    __builtin_prefetch(q + ROW1_PF, 0, 0);
                else
                    __builtin_prefetch(q + ROW1_PF, 0, 3);
                if (type == QTYPE_BF16) bf16_block(q, x + FB * (b + u), &s0[i][u], &s1[i][u]);
                else f16_block(q, x + FB * (b + u), &s0[i][u], &s1[i][u]);
            }
    for (; b < nb; b++)
        for (int i = 0; i < S; i++) {
            if (type == QTYPE_BF16) bf16_block(p[i] + 2 * FB * b, x + FB * b, &s0[i][0], &s1[i][0]);
            else f16_block(p[i] + 2 * FB * b, x + FB * b, &s0[i][0], &s1[i][0]);
        }
    for (int i = 0; i < S; i++) {
        for (int u = 1; u < ROW1_U; u++) s0[i][0] = VADD(s0[i][0], s0[i][u]), s1[i][0] = VADD(s1[i][0], s1[i][u]);
        *out[i] = VSUM(VADD(s0[i][0], s1[i][0]));
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* rows_front_to_back's two rows (nta 0 or 1) in the AVX-512 builds, each 16-lane sum held as two 8-lane
 * halves (its lanes [0, 8) and [8, 16)), each 64-byte block read as two 32-byte ones: every lane meets
 * the same products in the same order as in the zmm loop, and the halves join into that loop's vectors
 * before its lane sums, so the bits are the same. Past ROW1_PAIR_K the zmm pair read the weights below a
 * plain read's pace and these halves at it (docs/benchmarks-history.md, "BF16 one row at k = 8192: the
 * pair on 256-bit halves"); one row on halves ran as the zmm loop, which stays. */
static inline __attribute__((always_inline)) void rows2_halves(const uint8_t *const *p, const float *x, int64_t nb,
                                                               float *const *out, const int type, const int nta) {
    __m256 s[2][2][ROW1_U][2]; /* [row][its even (F16: first 16) or odd (last 16) sums][u][lanes 0-7, 8-15] */
    for (int i = 0; i < 2; i++)
        for (int e = 0; e < 2; e++)
            for (int u = 0; u < ROW1_U; u++) s[i][e][u][0] = _mm256_setzero_ps(), s[i][e][u][1] = _mm256_setzero_ps();
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
/* row i's block at q (x at xb) into its sums u: bf16_block's and f16_block's lanes, 8 at a time */
#define HALVES(i, q, xb, u)                                                                                        \
    for (int h = 0; h < 2; h++) {                                                                                  \
        __m256 lo, hi;                                                                                             \
        if (type == QTYPE_BF16) {                                                                                  \
            const __m256i v = _mm256_loadu_si256((const __m256i *)((q) + 32 * h));                                 \
            lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), hi = _mm256_castsi256_ps(_mm256_and_si256(v, high)); \
        } else {                                                                                                   \
            lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((q) + 16 * h)));                                \
            hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((q) + 32 + 16 * h)));                           \
        }                                                                                                          \
        s[i][0][u][h] = _mm256_fmadd_ps(lo, _mm256_loadu_ps((xb) + 8 * h), s[i][0][u][h]);                         \
        s[i][1][u][h] = _mm256_fmadd_ps(hi, _mm256_loadu_ps((xb) + 16 + 8 * h), s[i][1][u][h]);                    \
    }
    int64_t b = 0;
    for (; b + ROW1_U <= nb; b += ROW1_U)
        for (int u = 0; u < ROW1_U; u++)
            for (int i = 0; i < 2; i++) {
                const uint8_t *q = p[i] + 2 * FB * (b + u);
                if (nta)
                    __builtin_prefetch(q + ROW1_PF, 0, 0);
                else
                    __builtin_prefetch(q + ROW1_PF, 0, 3);
                HALVES(i, q, x + FB * (b + u), u)
            }
    for (; b < nb; b++)
        for (int i = 0; i < 2; i++) HALVES(i, p[i] + 2 * FB * b, x + FB * b, 0)
#undef HALVES
    for (int i = 0; i < 2; i++) {
        vec z[2][ROW1_U];
        for (int e = 0; e < 2; e++)
            for (int u = 0; u < ROW1_U; u++)
                z[e][u] = _mm512_insertf32x8(_mm512_castps256_ps512(s[i][e][u][0]), s[i][e][u][1], 1);
        for (int u = 1; u < ROW1_U; u++) z[0][0] = VADD(z[0][0], z[0][u]), z[1][0] = VADD(z[1][0], z[1][u]);
        *out[i] = VSUM(VADD(z[0][0], z[1][0]));
    }
}
#define ROWS2 rows2_halves
#else
#define ROWS2(p, x, nb, o, type, nta) rows_front_to_back(p, x, nb, o, type, 2, nta)
#endif

/* One activation row against weight rows [0, nc) (out[c]), each row read front to back in turn: the
 * rows lie one after another, so a thread's columns are one sequential stream, the case the hardware
 * prefetcher follows best (TC rows side by side are TC streams, each a row long); past ROW1_PAIR_K
 * two such streams (rows c and c + nc / 2 at once). */
static inline __attribute__((always_inline)) void row1(const uint8_t *w, int64_t wrb, int64_t nc, const float *x,
                                                       int64_t nb, float *out, const int type) {
    int64_t c = 0;
    if (ROW1_PAIR_K > 0 && nb * FB > ROW1_PAIR_K) {
        const int64_t half = nc / 2;
        for (; c < half; c++) {
            const uint8_t *p[2] = {w + c * wrb, w + (c + half) * wrb};
            float *o[2] = {out + c, out + c + half};
            if (weight_prefetch_nta)
                ROWS2(p, x, nb, o, type, 1);
            else
                ROWS2(p, x, nb, o, type, 0);
        }
        c = 2 * half;
    }
    for (; c < nc; c++) {
        const uint8_t *p[1] = {w + c * wrb};
        float *o[1] = {out + c};
        rows_front_to_back(p, x, nb, o, type, 1, -1);
    }
}

/* BF16's micro: activation rows [0, R) (each in copy_act_eo's order) x weight rows [0, C), as
 * micro's, each (row, column) summing its even and odd products apart. */
static inline __attribute__((always_inline)) void bf16_micro(const uint8_t *w, int64_t wrb, int64_t nc, const float *x,
                                                             int64_t xs, int64_t nr, int64_t nb, float *out,
                                                             int64_t ldo, const int R, const int C) {
    const uint8_t *wr[TC];
    const float *xr[TR];
    for (int c = 0; c < C; c++) wr[c] = w + (c < nc ? c : nc - 1) * wrb;
    for (int r = 0; r < R; r++) xr[r] = x + (r < nr ? r : nr - 1) * xs;
    vec even[TR][TC], odd[TR][TC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) even[r][c] = VZERO(), odd[r][c] = VZERO();
    for (int64_t b = 0; b < nb; b++) {
        for (int c = 0; c < C; c++) _mm_prefetch((const char *)(wr[c] + 2 * FB * b + BF16_PF), _MM_HINT_T0);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) bf16_block(wr[c] + 2 * FB * b, xr[r] + FB * b, &even[r][c], &odd[r][c]);
    }
    for (int r = 0; r < R && r < nr; r++)
        for (int c = 0; c < C && c < nc; c++) out[r * ldo + c] = VSUM(even[r][c]) + VSUM(odd[r][c]);
}

static inline __attribute__((always_inline)) void tile_loop(const uint8_t *w, int64_t wrb, int64_t nc,
                                                            const uint8_t *xq, int64_t xrb, int64_t nr, int64_t nb,
                                                            float *out, int64_t ldo, const int type) {
    const float *x = (const float *)xq;
    const int64_t xs = xrb / (int64_t)sizeof(float), k = nb * FB;
    if (nr == 1) {
        row1(w, wrb, nc, x, nb, out, type);
        return;
    }
    for (int64_t r0 = 0; r0 < nr; r0 += TR)
        for (int64_t c0 = 0; c0 < nc; c0 += TC) {
            const float *xr = x + r0 * xs;
            float *o = out + r0 * ldo + c0;
            if (type == QTYPE_BF16) {
                if (nr - r0 == 1) bf16_micro(w + c0 * wrb, wrb, nc - c0, xr, xs, 1, nb, o, ldo, 1, TC);
                else bf16_micro(w + c0 * wrb, wrb, nc - c0, xr, xs, nr - r0, nb, o, ldo, TR, TC);
            } else if (nr - r0 == 1) {
                micro(w + c0 * wrb, wrb, nc - c0, xr, xs, 1, k, o, ldo, type, 1, TC);
            } else {
                micro(w + c0 * wrb, wrb, nc - c0, xr, xs, nr - r0, k, o, ldo, type, TR, TC);
            }
        }
}

#else /* portable: plain C, the compiler vectorizes the k loop as it can */

static inline void tile_loop(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                             int64_t nb, float *out, int64_t ldo, const int type) {
    const int64_t xs = xrb / (int64_t)sizeof(float), k = nb * FB;
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *row = w + c * wrb;
        for (int64_t r = 0; r < nr; r++) {
            const float *x = (const float *)xq + r * xs;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < k; i++) s += (type == QTYPE_F16 ? f16_at(row, i) : bf16_at(row, i)) * x[i];
            out[r * ldo + c] = s;
        }
    }
}
#endif

static void tile_f16(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                     int64_t nb, float *out, int64_t ldo) {
    tile_loop(w, wrb, nc, xq, xrb, nr, nb, out, ldo, QTYPE_F16);
}

static void tile_bf16(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                      int64_t nb, float *out, int64_t ldo) {
    tile_loop(w, wrb, nc, xq, xrb, nr, nb, out, ldo, QTYPE_BF16);
}

#define ACT_BYTES (FB * (int)sizeof(float))
static const qtype_ops OPS_F16 = {QTYPE_F16, FB, 2 * FB, ACT_BYTES, copy_act, tile_f16, dequant_f16, NULL, NULL};
static const qtype_ops OPS_BF16 = {QTYPE_BF16, FB,           2 * FB,      ACT_BYTES, copy_act_eo,
                                    tile_bf16,  dequant_bf16, NULL, NULL};

const qtype_ops *qtype_f16(int type) {
    switch (type) {
    case QTYPE_F16: return &OPS_F16;
    case QTYPE_BF16: return &OPS_BF16;
    default: return NULL;
    }
}
