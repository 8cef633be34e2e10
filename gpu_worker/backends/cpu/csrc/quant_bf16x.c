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
/* Register tiles of R activation rows x C weight rows: 24 accumulators + C weights + 1 activation of
 * the 32 zmm. Few rows: TR x TC = 6 x 4, its group's activations in L1 while the weights stream
 * (docs/benchmarks-history.md, "BF16 many rows on vdpbf16ps"). Many rows: MR x MC = 4 x 6, the
 * weights in L1 while the activations pass from L2, which is what bounds the pace there: 4 loads
 * from L2 per 24 vdpbf16ps, not 6 ("BF16 at many rows: the weights in L1"). C is any count (the
 * lane sums take 4 accumulators at a time). */
#define TR 6
#define TC 4
#define MR 4
#define MC 6
/* Past FEW_ROWS rows k is taken KC blocks at a time (4 KB of a row): a column tile's chunk (24 KB)
 * stays in L1 while every row group passes, and a row block's activations (at most KB_ROWS rows, all
 * chunks) stay in L2 across the column tiles. Between chunks each (row, column) pair's 16 lanes wait
 * in memory, so the sums add in the same order as in one pass over k. */
#define KC 64
#define KB_ROWS 32
#define FEW_ROWS 13 /* up to here each group reads the weights from memory (few_rows; 13: 4 + 4 + 5) */
#define FEW_SPAN_BYTES (384 * 1024) /* of weights in a span of few_rows' columns (L2 holds them) */

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

/* Activation rows [0, R) x weight rows [0, C) over nb blocks (R, C, P constants once inlined). The
 * accumulators start from part where load (row r's column c at part + 16 (r C + c)), else zero; they
 * end in out as lane sums where sums, else back in part. Rows past nr or nc repeat the last valid
 * one (from L1), their sums not stored. With P the first npf steps each prefetch one line of pf into
 * L1 (on this AMD core the hint's level made no difference). */
static inline __attribute__((always_inline)) void micro(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *x,
                                                        int64_t xrb, int64_t nr, int64_t nb, float *part, int load,
                                                        int sums, float *out, int64_t ldo, const uint8_t *pf,
                                                        int64_t npf, const int R, const int C, const int P) {
    const uint8_t *wr[MC], *xr[TR];
    for (int c = 0; c < C; c++) wr[c] = w + (c < nc ? c : nc - 1) * wrb;
    for (int r = 0; r < R; r++) xr[r] = x + (r < nr ? r : nr - 1) * xrb;
    __m512 acc[TR][MC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = load ? _mm512_loadu_ps(part + 16 * (r * C + c)) : _mm512_setzero_ps();
#define STEP(b)                                                                                                  \
    do {                                                                                                         \
        __m512bh wv[MC];                                                                                         \
        for (int c = 0; c < C; c++) wv[c] = (__m512bh)_mm512_loadu_si512((const void *)(wr[c] + 64 * (b)));    \
        for (int r = 0; r < R; r++) {                                                                            \
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xr[r] + 64 * (b)));                 \
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);                     \
        }                                                                                                        \
    } while (0)
    const int64_t np = npf < nb ? npf : nb;
    int64_t b = 0;
    for (; P && b < np; b++) {
        _mm_prefetch((const char *)(pf + 64 * b), _MM_HINT_T0);
        STEP(b);
    }
    for (; b < nb; b++) STEP(b);
#undef STEP
    if (!sums) {
        for (int r = 0; r < R && r < nr; r++)
            for (int c = 0; c < C; c++) _mm512_storeu_ps(part + 16 * (r * C + c), acc[r][c]);
        return;
    }
    for (int r = 0; r < R && r < nr; r++)
        for (int c0 = 0; c0 < C && c0 < nc; c0 += 4) { /* (past C: the last again, not stored) */
            const int c1 = c0 + 1 < C ? c0 + 1 : C - 1, c2 = c0 + 2 < C ? c0 + 2 : C - 1;
            const __m128 s4 = sum4(acc[r][c0], acc[r][c1], acc[r][c2], acc[r][c0 + 3 < C ? c0 + 3 : C - 1]);
            const int64_t left = (C < nc ? C : nc) - c0;
            _mm_mask_storeu_ps(out + r * ldo + c0, (__mmask8)(left >= 4 ? 15 : (1 << left) - 1), s4);
        }
}

/* Few rows (at most FEW_ROWS: a group or two): memory's pace. The rows in near-equal groups of at
 * most TR, each group over the columns' tiles in turn, its activations in L1 while the weights pass
 * once from memory (the hardware's stream prefetch keeps up there; more of our own only cost), a
 * span of columns whose weights L2 holds for the next group at a time. */
static void few_rows(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                     int64_t nb, float *out, int64_t ldo) {
    const int64_t groups = (nr + TR - 1) / TR, fit = FEW_SPAN_BYTES / wrb / TC * TC, span = fit > TC ? fit : TC;
    for (int64_t s0 = 0; s0 < nc; s0 += span) {
        const int64_t s1 = nc - s0 < span ? nc : s0 + span;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t r0 = nr * g / groups, rows = nr * (g + 1) / groups - r0;
            const uint8_t *x = xq + r0 * xrb;
            for (int64_t c0 = s0; c0 < s1; c0 += TC) {
                const uint8_t *wc = w + c0 * wrb;
                float *o = out + r0 * ldo + c0;
                switch (rows) { /* each R its own unrolled code */
                case 1: micro(wc, wrb, s1 - c0, x, xrb, rows, nb, NULL, 0, 1, o, ldo, NULL, 0, 1, TC, 0); break;
                case 2: micro(wc, wrb, s1 - c0, x, xrb, rows, nb, NULL, 0, 1, o, ldo, NULL, 0, 2, TC, 0); break;
                case 3: micro(wc, wrb, s1 - c0, x, xrb, rows, nb, NULL, 0, 1, o, ldo, NULL, 0, 3, TC, 0); break;
                case 4: micro(wc, wrb, s1 - c0, x, xrb, rows, nb, NULL, 0, 1, o, ldo, NULL, 0, 4, TC, 0); break;
                case 5: micro(wc, wrb, s1 - c0, x, xrb, rows, nb, NULL, 0, 1, o, ldo, NULL, 0, 5, TC, 0); break;
                default: micro(wc, wrb, s1 - c0, x, xrb, rows, nb, NULL, 0, 1, o, ldo, NULL, 0, TR, TC, 0);
                }
            }
        }
    }
}

/* One chunk of k (kb blocks) of one column tile (C weight rows) against rows [0, nr) (more than
 * FEW_ROWS) in near-equal groups of 3 or MR rows, each group's partial lanes at part + 16 C (its
 * first row). Meanwhile the groups prefetch what the tile reads next, C rows' nkb lines at next (wrb
 * apart): in one chunk (k <= KC blocks) those rows lie end to end and the groups share them out; in
 * chunks each of the first C groups takes a row. That keeps memory's latency off the next tile's
 * first group, which the hardware's prefetch alone left waiting. */
static inline __attribute__((always_inline)) void chunk_rows(const uint8_t *w, int64_t wrb, int64_t nc,
                                                             const uint8_t *x, int64_t xrb, int64_t nr, int64_t kb,
                                                             float *part, int first, int last, float *out,
                                                             int64_t ldo, const uint8_t *next, int64_t nkb,
                                                             int whole, const int C) {
    const int64_t groups = (nr + MR - 1) / MR, lines = C * nkb, per = whole ? (lines + groups - 1) / groups : nkb;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t r0 = nr * g / groups, rows = nr * (g + 1) / groups - r0;
        const uint8_t *xg = x + r0 * xrb, *pf = whole ? next + 64 * per * g : next + g * wrb;
        const int64_t npf = whole ? (lines - per * g < per ? lines - per * g : per) : g < C ? nkb : 0;
        float *pg = part + 16 * C * r0, *o = out + r0 * ldo;
        if (rows == 3)
            micro(w, wrb, nc, xg, xrb, rows, kb, pg, !first, last, o, ldo, pf, npf, 3, C, 1);
        else
            micro(w, wrb, nc, xg, xrb, rows, kb, pg, !first, last, o, ldo, pf, npf, MR, C, 1);
    }
}

/* More than FEW_ROWS rows: column tiles of MC weight rows in turn, each over k in chunks against
 * every row of a row block. One chunk (k <= KC blocks) takes all nr rows at once (the driver's chunk
 * of rows fits L2 at that k); more, near-equal row blocks of at most KB_ROWS (13 rows at least).
 * Apart from few_rows: in one function, with part on its stack, few_rows ran a few percent slower. */
static __attribute__((noinline)) void many_rows(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq,
                                                 int64_t xrb, int64_t nr, int64_t nb, float *out, int64_t ldo) {
    float part[KB_ROWS * MC * 16];
    const int64_t blocks = nb <= KC ? 1 : (nr + KB_ROWS - 1) / KB_ROWS;
    for (int64_t q = 0; q < blocks; q++) {
        const int64_t q0 = nr * q / blocks, qr = nr * (q + 1) / blocks - q0;
        for (int64_t c0 = 0; c0 < nc; c0 += MC) {
            const uint8_t *wc = w + c0 * wrb;
            const int64_t tc = nc - c0 < MC ? nc - c0 : MC;
            for (int64_t k0 = 0; k0 < nb; k0 += KC) {
                const int64_t kb = nb - k0 < KC ? nb - k0 : KC;
                /* what the tile reads next: its next chunk, else the next tile's first (past nc: the
                 * next panel's, which this thread's next call starts on) */
                const int64_t nk0 = k0 + KC < nb ? k0 + KC : 0, nkb = nb - nk0 < KC ? nb - nk0 : KC;
                const uint8_t *next = (k0 + KC < nb ? wc : wc + tc * wrb) + 64 * nk0;
                const uint8_t *xk = xq + q0 * xrb + 64 * k0;
                float *o = out + q0 * ldo + c0;
                if (nb <= KC && tc > 4) /* (each its own code: no partial lanes in one chunk) */
                    chunk_rows(wc, wrb, tc, xk, xrb, qr, kb, part, 1, 1, o, ldo, next, nkb, 1, MC);
                else if (nb <= KC)
                    chunk_rows(wc, wrb, tc, xk, xrb, qr, kb, part, 1, 1, o, ldo, next, nkb, 1, 4);
                else if (tc > 4)
                    chunk_rows(wc + 64 * k0, wrb, tc, xk, xrb, qr, kb, part, k0 == 0, k0 + kb == nb, o, ldo, next,
                               nkb, 0, MC);
                else
                    chunk_rows(wc + 64 * k0, wrb, tc, xk, xrb, qr, kb, part, k0 == 0, k0 + kb == nb, o, ldo, next,
                               nkb, 0, 4);
            }
        }
    }
}

static void tile_bf16x(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                       int64_t nb, float *out, int64_t ldo) {
    if (nr <= FEW_ROWS)
        few_rows(w, wrb, nc, xq, xrb, nr, nb, out, ldo);
    else
        many_rows(w, wrb, nc, xq, xrb, nr, nb, out, ldo);
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
