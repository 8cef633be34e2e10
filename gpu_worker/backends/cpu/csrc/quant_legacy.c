/* The legacy 32-weight GGUF blocks: Q4_0, Q4_1, Q8_0 (ggml's block layouts, checked against gguf-py's
 * dequantize in tests/gpu_worker/test_quant_kernels.py).
 *
 *   Q4_0, 18 bytes: fp16 d, 16 bytes of nibbles; weight j = d * (q_j - 8)
 *   Q4_1, 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles; weight j = d * q_j + m
 *   Q8_0, 34 bytes: fp16 d, 32 int8; weight j = d * q_j
 * Nibbles: weight j < 16 is the low nibble of byte j, weight j >= 16 the high nibble of byte j - 16.
 *
 * Activations: quant.h's act_block16, one per block of 32 (x_i ~ dx * qx_i, |qx_i| <= 32767, and
 * sx = dx * sum(qx)), quantized by quant.c's quantize_act16.
 *
 * One block of weight row c against activation row r:
 *   Q8_0: dw * dx * dot(qw, qx)                qw int8, sign-extended to int16
 *   Q4_1: dw * dx * dot(qw, qx) + m * sx       qw the nibbles 0..15, zero-extended to int16
 *   Q4_0: dw * dx * dot(qw - 8, qx)            the nibbles zero-extended, then 8 subtracted (-8..7)
 * Q4_0's -8 is applied to the widened weights, once per tile and shared by its activation rows,
 * rather than as a min term -8 dw * sx per (row, column, block): fewer operations, and no
 * cancellation between the dot and a min term of similar size.
 * The weights are widened once per tile to two vectors of 16 int16 (weights 0-15, 16-31), and
 * _mm256_madd_epi16 against the activation's two vectors gives 16 products per instruction, pairs
 * summed into int32; the two results are added (8 int32 lanes, 4 products each), converted to float
 * once and scaled by dw * dx with one FMA per block.
 *
 * No integer sum can overflow, for any bytes in the weight blocks and any activations: a weight is
 * |qw| <= 128 (int8 -128..127; nibbles 0..15) and an activation |qx| <= 32767 (quantize_act16 never
 * makes -32768). madd_epi16 wraps only for both pairs at -32768 * -32768; here a product is at most
 * 128 * 32767 = 4,194,176 in magnitude, a madd lane (2 products) at most 8,388,352, and the sum of
 * the two madds (4 products) at most 16,776,704 < 2^24 = 16,777,216 < 2^31. So every int32 is exact,
 * and so is its conversion to float32 (an integer below 2^24): float rounding starts at the scaling.
 * (The portable path's 32-product int32 dot: at most 32 * 128 * 32767 = 134,213,632 < 2^31.)
 *
 * Q4_1's min terms, m * sx per block, are a dot product over blocks: their m and sx are gathered per
 * chunk of KC blocks and summed at the chunk's end, off the per-block path; the scales dw * dx of
 * every (row, column, block) of a chunk are computed there too, vectorized, so the per-block path only
 * loads one float per pair.
 *
 * The tile blocks registers over MR activation rows x MC weight rows: each weight block is widened
 * once per MR activation rows and each activation vector loaded once per MC weight rows. One
 * activation row is bound by memory: ROW1_W weight rows (streams) at a time, prefetched ahead (row1).
 *
 * The worker holds these types in this layout only where a weight's rows are not a multiple of 8;
 * otherwise interleaved by 8 (quant_x8.c), which is faster at every row count (docs/benchmarks-history.md,
 * the rows interleaved by 8).
 */
#include "quant.h"
#include "rivulet_kernels.h"

#define QB 32 /* weights per block */
#define KC 32 /* blocks per chunk (scales precomputed per chunk) */
#ifndef MR
#define MR 4 /* activation rows per register tile */
#endif
#ifndef MC
#define MC 2 /* weight rows per register tile */
#endif
#ifndef ROW1_W
#define ROW1_W 4 /* weight rows (streams) at a time at one activation row */
#endif
#ifndef PF_BYTES
#define PF_BYTES 512 /* how far ahead the 1-row tile prefetches each weight row */
#endif

static inline float half_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return fp16_to_f32(h);
}

/* ---- tiles ---- */

#if HAVE_AVX2 || HAVE_AVX512

/* The 32 weights of the block at blk as int16: *lo weights 0-15, *hi weights 16-31. Q8_0: its int8
 * sign-extended; Q4: the 16 bytes zero-extended, then the low nibble (weights 0-15) masked and the
 * high nibble (weights 16-31) shifted down (Q4_0: minus 8). */
static inline void widen(const uint8_t *blk, const int type, __m256i *lo, __m256i *hi) {
    if (type == QTYPE_Q8_0) {
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
    } else {
        const __m256i v =
            _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + (type == QTYPE_Q4_1 ? 4 : 2))));
        *lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0f));
        *hi = _mm256_srli_epi16(v, 4);
        if (type == QTYPE_Q4_0) { /* the -8 applied here (once per tile): no min term to sum */
            *lo = _mm256_sub_epi16(*lo, _mm256_set1_epi16(8));
            *hi = _mm256_sub_epi16(*hi, _mm256_set1_epi16(8));
        }
    }
}

/* ---- dequantization (embedding rows, the dense path's panels, the tests' reference) ---- */

/* The block's 32 weights as float32, widened as the tiles widen them: d * q (exact in float32: an
 * fp16 times an integer below 2^8) plus, for Q4_1, m in the same FMA (one rounding, as gguf-py's
 * d * q + m). The portable code below computes the same values. */
static inline void dequant_block(const uint8_t *blk, const int type, float *out) {
    __m256i lo, hi;
    widen(blk, type, &lo, &hi);
    const __m256 d = _mm256_set1_ps(half_to_f32(blk));
    const __m256 m = type == QTYPE_Q4_1 ? _mm256_set1_ps(half_to_f32(blk + 2)) : _mm256_setzero_ps();
    const __m128i q[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1), _mm256_castsi256_si128(hi),
                          _mm256_extracti128_si256(hi, 1)};
    for (int i = 0; i < 4; i++)
        _mm256_storeu_ps(out + 8 * i, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(q[i])), m));
}

static void dequant_q4_0(const uint8_t *w, int64_t k, float *out) {
    for (int64_t b = 0; b < k / QB; b++) dequant_block(w + b * 18, QTYPE_Q4_0, out + b * QB);
}

static void dequant_q4_1(const uint8_t *w, int64_t k, float *out) {
    for (int64_t b = 0; b < k / QB; b++) dequant_block(w + b * 20, QTYPE_Q4_1, out + b * QB);
}

static void dequant_q8_0(const uint8_t *w, int64_t k, float *out) {
    for (int64_t b = 0; b < k / QB; b++) dequant_block(w + b * 34, QTYPE_Q8_0, out + b * QB);
}

/* The fp16 d (the blocks' first 2 bytes) of blocks [b0, b0 + len) of a weight row (blocks bb bytes
 * apart) as float32, zero from len to the next multiple of 8: scalar 16-bit moves, then 8 conversions
 * per instruction, so that the per-block path only loads floats. */
static inline void chunk_halves(const uint8_t *row, int64_t b0, int len, int bb, float *out) {
    uint16_t h[KC];
    for (int i = 0; i < len; i++) memcpy(&h[i], row + (b0 + i) * bb, sizeof h[i]);
    for (int i = len; i < ((len + 7) & ~7); i++) h[i] = 0;
    for (int i = 0; i < len; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
}

/* chunk_halves of Q4_1's d and m (bytes 0-3 of its 20-byte blocks): one 32-bit move per block, and
 * the conversion of 4 (d, m) pairs split into 4 d and 4 m. */
static inline void chunk_half_pairs(const uint8_t *row, int64_t b0, int len, float *d, float *m) {
    uint32_t h[KC];
    for (int i = 0; i < len; i++) memcpy(&h[i], row + (b0 + i) * 20, sizeof h[i]);
    for (int i = len; i < ((len + 7) & ~7); i++) h[i] = 0;
    const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int i = 0; i < len; i += 4) {
        const __m256 v = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))), split);
        _mm_storeu_ps(d + i, _mm256_castps256_ps128(v));
        _mm_storeu_ps(m + i, _mm256_extractf128_ps(v, 1));
    }
}

/* sum(a[i] * b[i]) for i < len: 8 lanes, the tail masked. */
static inline float dot_f32(const float *a, const float *b, int len) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= len; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    if (i < len) {
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(len - i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, mask), _mm256_maskload_ps(b + i, mask), acc);
    }
    return hsum8(acc);
}

/* Weight rows [0, C) x activation rows [0, R) (R, C constants once inlined: the accumulators stay in
 * registers). Rows past nc / nr repeat the last valid one (from cache), their sums not stored.
 * Per chunk of KC blocks, first the scales of every (row, column, block), d_w * d_x, as floats (and
 * for Q4_1 the m of each weight block and s of each activation block); then per block: the C weight
 * blocks widened once, and per pair only madd, add, convert, FMA with the scale loaded from L1; at
 * the chunk's end Q4_1's min terms, dot(m, s) over its blocks. */
static inline __attribute__((always_inline)) void legacy_micro(const uint8_t *w, int64_t wrb, int64_t nc,
                                                               const uint8_t *xq, int64_t xrb, int64_t nr,
                                                               int64_t nb, float *out, int64_t ldo, const int type,
                                                               const int R, const int C) {
    const int bb = type == QTYPE_Q8_0 ? 34 : type == QTYPE_Q4_1 ? 20 : 18;
    const uint8_t *wr[MC];
    const act_block16 *xa[MR];
    for (int c = 0; c < C; c++) wr[c] = w + (c < nc ? c : nc - 1) * wrb;
    for (int r = 0; r < R; r++) xa[r] = (const act_block16 *)(xq + (r < nr ? r : nr - 1) * xrb);
    __m256 acc[MR][MC];
    float msum[MR][MC];
    float dw[MC][KC], mf[MC][KC], xd[MR][KC], xs[MR][KC], sc[MR][MC][KC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps(), msum[r][c] = 0.0f;
    for (int64_t b0 = 0; b0 < nb; b0 += KC) {
        const int len = nb - b0 < KC ? (int)(nb - b0) : KC;
        for (int c = 0; c < C; c++) {
            if (type == QTYPE_Q4_1) {
                chunk_half_pairs(wr[c], b0, len, dw[c], mf[c]);
            } else {
                chunk_halves(wr[c], b0, len, bb, dw[c]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int i = 0; i < len; i++) xd[r][i] = xa[r][b0 + i].d;
        if (type == QTYPE_Q4_1)
            for (int r = 0; r < R; r++)
                for (int i = 0; i < len; i++) xs[r][i] = xa[r][b0 + i].s;
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
#pragma omp simd
                for (int i = 0; i < len; i++) sc[r][c][i] = dw[c][i] * xd[r][i];
        for (int i = 0; i < len; i++) {
            const int64_t b = b0 + i;
            __m256i lo[MC], hi[MC];
            for (int c = 0; c < C; c++) {
                widen(wr[c] + b * bb, type, &lo[c], &hi[c]);
            }
            for (int r = 0; r < R; r++) {
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)xa[r][b].q);
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xa[r][b].q + 16));
                for (int c = 0; c < C; c++) {
                    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo[c], x0), _mm256_madd_epi16(hi[c], x1));
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&sc[r][c][i]), acc[r][c]);
                }
            }
        }
        if (type == QTYPE_Q4_1)
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C; c++) msum[r][c] += dot_f32(mf[c], xs[r], len);
    }
    for (int r = 0; r < R && r < nr; r++)
        for (int c = 0; c < C && c < nc; c++) out[r * ldo + c] = hsum8(acc[r][c]) + msum[r][c];
}

/* out[r] = dot(weight row r, the activation row xa) for r < R (ROW1_W once inlined). */
static inline __attribute__((always_inline)) void row1_group(const uint8_t *w, int64_t wrb, const act_block16 *xa,
                                                             int64_t nb, float *out, const int type, const int R) {
    const int bb = type == QTYPE_Q8_0 ? 34 : type == QTYPE_Q4_1 ? 20 : 18;
    __m256 acc[ROW1_W];
    float m[ROW1_W];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), m[r] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)xa[b].q);
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xa[b].q + 16));
        const float xd = xa[b].d, xs = xa[b].s;
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = w + r * wrb + b * bb;
            _mm_prefetch((const char *)(blk + PF_BYTES), _MM_HINT_T0);
            __m256i lo, hi;
            widen(blk, type, &lo, &hi);
            const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(half_to_f32(blk) * xd), acc[r]);
            if (type == QTYPE_Q4_1) m[r] += half_to_f32(blk + 2) * xs;
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]) + m[r];
}

/* One activation row against nc weight rows, ROW1_W at a time: decode at one stream, bound by the
 * weights' bytes. Each block's weights are widened and met by the row's 32 int16 in registers; its
 * scale d_w * d_x is a scalar broadcast, Q4_1's min term m * s_x a scalar FMA; nothing is gathered or
 * precomputed per chunk (that bookkeeping cost the generic tile a third of its speed at one row). */
static inline __attribute__((always_inline)) void row1(const uint8_t *w, int64_t wrb, int64_t nc,
                                                       const act_block16 *xa, int64_t nb, float *out,
                                                       const int type) {
    int64_t c = 0;
    for (; c + ROW1_W <= nc; c += ROW1_W) row1_group(w + c * wrb, wrb, xa, nb, out + c, type, ROW1_W);
    for (; c < nc; c++) row1_group(w + c * wrb, wrb, xa, nb, out + c, type, 1);
}

#define TILE_ARGS(c0, r0) w + (c0) * wrb, wrb, nc - (c0), xq + (r0) * xrb, xrb, rows, nb, out + (r0) * ldo + (c0), ldo
#define MR_(n) ((n) < MR ? (n) : MR)

/* One activation row: row1. Several: activation rows in near-equal
 * groups of at most MR (7 rows with MR 4: 4 + 3, not 4 + 4 with one wasted), each group over every
 * MC weight rows in turn: the group's activations stay in L1, the weights come from L2 (the driver
 * passes a panel of them). */
#define TILE_LOOP(TYPE)                                                                                       \
    do {                                                                                                      \
        if (nr == 1) {                                                                                        \
            row1(w, wrb, nc, (const act_block16 *)xq, nb, out, TYPE);                                         \
            break;                                                                                            \
        }                                                                                                     \
        const int64_t groups = (nr + MR - 1) / MR;                                                            \
        for (int64_t g = 0; g < groups; g++) {                                                                \
            const int64_t r0 = nr * g / groups, rows = nr * (g + 1) / groups - r0;                            \
            for (int64_t c0 = 0; c0 < nc; c0 += MC) {                                                         \
                switch (rows) {                                                                               \
                case 1: legacy_micro(TILE_ARGS(c0, r0), TYPE, MR_(1), MC); break;                          \
                case 2: legacy_micro(TILE_ARGS(c0, r0), TYPE, MR_(2), MC); break;                          \
                case 3: legacy_micro(TILE_ARGS(c0, r0), TYPE, MR_(3), MC); break;                          \
                case 4: legacy_micro(TILE_ARGS(c0, r0), TYPE, MR_(4), MC); break;                          \
                case 5: legacy_micro(TILE_ARGS(c0, r0), TYPE, MR_(5), MC); break;                          \
                case 6: legacy_micro(TILE_ARGS(c0, r0), TYPE, MR_(6), MC); break;                          \
                default: legacy_micro(TILE_ARGS(c0, r0), TYPE, MR, MC);                                    \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    } while (0)

LEGACY_TILES(TILE_LOOP)

#else /* portable: plain C, one weight block widened to int and met by each activation row */

/* ---- dequantization: dequant_block's values, in plain C ---- */

static void dequant_q4_0(const uint8_t *w, int64_t k, float *out) {
    for (int64_t b = 0; b < k / QB; b++) {
        const uint8_t *blk = w + b * 18;
        const float d = half_to_f32(blk);
        for (int j = 0; j < 16; j++) {
            out[b * QB + j] = d * (float)((blk[2 + j] & 0x0f) - 8);
            out[b * QB + 16 + j] = d * (float)((blk[2 + j] >> 4) - 8);
        }
    }
}

static void dequant_q4_1(const uint8_t *w, int64_t k, float *out) {
    for (int64_t b = 0; b < k / QB; b++) {
        const uint8_t *blk = w + b * 20;
        const float d = half_to_f32(blk), m = half_to_f32(blk + 2);
        for (int j = 0; j < 16; j++) { /* d * q is exact in float32 (11 x 4 bits): one rounding, as gguf's */
            out[b * QB + j] = d * (float)(blk[4 + j] & 0x0f) + m;
            out[b * QB + 16 + j] = d * (float)(blk[4 + j] >> 4) + m;
        }
    }
}

static void dequant_q8_0(const uint8_t *w, int64_t k, float *out) {
    for (int64_t b = 0; b < k / QB; b++) {
        const uint8_t *blk = w + b * 34;
        const float d = half_to_f32(blk);
        for (int j = 0; j < QB; j++) out[b * QB + j] = d * (float)(int8_t)blk[2 + j];
    }
}


static inline void tile_generic(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb,
                                int64_t nr, int64_t nb, float *out, int64_t ldo, int type) {
    const int bb = type == QTYPE_Q8_0 ? 34 : type == QTYPE_Q4_1 ? 20 : 18;
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *wr = w + c * wrb;
        for (int64_t r = 0; r < nr; r++) out[r * ldo + c] = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = wr + b * bb;
            int32_t q[QB];
            const float dw = half_to_f32(blk);
            float m = 0.0f;
            if (type == QTYPE_Q8_0) {
                for (int j = 0; j < QB; j++) q[j] = (int8_t)blk[2 + j];
            } else {
                const uint8_t *nib = blk + (type == QTYPE_Q4_1 ? 4 : 2);
                const int32_t off = type == QTYPE_Q4_0 ? 8 : 0; /* Q4_0: -8 on the weights, as the AVX2 tile */
                for (int j = 0; j < 16; j++) q[j] = (nib[j] & 0x0f) - off, q[16 + j] = (nib[j] >> 4) - off;
                if (type == QTYPE_Q4_1) m = half_to_f32(blk + 2);
            }
            for (int64_t r = 0; r < nr; r++) {
                const act_block16 *xb = (const act_block16 *)(xq + r * xrb) + b;
                int32_t dot = 0; /* exact: see the top of the file */
                for (int j = 0; j < QB; j++) dot += q[j] * xb->q[j];
                out[r * ldo + c] += dw * xb->d * (float)dot + m * xb->s;
            }
        }
    }
}

#define GENERIC_LOOP(TYPE) tile_generic(w, wrb, nc, xq, xrb, nr, nb, out, ldo, TYPE)
LEGACY_TILES(GENERIC_LOOP)
#endif

#define ACT_BYTES ((int)sizeof(act_block16))
static const qtype_ops OPS_Q4_0 = {QTYPE_Q4_0, QB, 18, ACT_BYTES, quantize_act16, tile_q4_0, dequant_q4_0, NULL, NULL};
static const qtype_ops OPS_Q4_1 = {QTYPE_Q4_1, QB, 20, ACT_BYTES, quantize_act16, tile_q4_1, dequant_q4_1, NULL, NULL};
static const qtype_ops OPS_Q8_0 = {QTYPE_Q8_0, QB, 34, ACT_BYTES, quantize_act16, tile_q8_0, dequant_q8_0, NULL, NULL};

const qtype_ops *qtype_legacy(int type) {
    switch (type) {
    case QTYPE_Q4_0: return &OPS_Q4_0;
    case QTYPE_Q4_1: return &OPS_Q4_1;
    case QTYPE_Q8_0: return &OPS_Q8_0;
    default: return NULL;
    }
}
