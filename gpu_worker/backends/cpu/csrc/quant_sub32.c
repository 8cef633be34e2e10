/* GGUF blocks met 32 weights at a time, each 32 with one scale: Q5_0, Q5_1, IQ4_NL, IQ4_XS and MXFP4
 * (ggml's layouts, checked against gguf-py's dequantize in tests/gpu_worker/test_quant_sub32.py and
 * test_mxfp4.py).
 * llama.cpp's quantizer writes Q5_0 / Q5_1 / IQ4_NL for the tensors of a K-quant file whose rows are
 * not a multiple of 256 (hidden 576, 640, 896, ...), and IQ4_XS / IQ4_NL as types of their own.
 *
 *   Q5_0,  22 bytes: fp16 d, 4 bytes qh, 16 bytes of nibbles; weight j = d * (q_j - 16)
 *   Q5_1,  24 bytes: fp16 d, fp16 m, 4 bytes qh, 16 bytes of nibbles; weight j = d * q_j + m
 *   IQ4_NL, 18 bytes: fp16 d, 16 bytes of nibbles; weight j = d * V[nibble j]
 *   IQ4_XS, 136 bytes per 256 weights: fp16 d, 16 bits of scale highs, 4 bytes of scale lows, 128
 *           bytes of nibbles; 32-weight sub-block i has the 6-bit scale ls_i (low 4 bits: nibble i of
 *           the lows, high 2: bits 2i, 2i + 1 of the highs) and its own 16 bytes of nibbles;
 *           weight j of it = d (ls_i - 32) * V[nibble j]
 *   MXFP4, 17 bytes: E8M0 exponent e, 16 bytes of nibbles; weight j = 2^(e - 128) * F[nibble j], F the
 *           E2M1 values doubled (0, 1, 2, 3, 4, 6, 8, 12 and their negatives: gpt-oss's experts)
 * Nibbles as the legacy types' (quant_legacy.c): weight j < 16 the low nibble of byte j, weight
 * j >= 16 the high nibble of byte j - 16. Q5's q_j = nibble j | bit j of qh (little-endian) << 4.
 * V: the IQ4 types' 16 non-linear levels (-127 .. 113), one 16-byte table, so widening a nibble is
 * one byte shuffle; MXFP4's F likewise.
 *
 * The tiles are quant_legacy.c's: activations in act_block16 (quant.h), each sub-block's weights
 * widened to int16 once per tile, _mm256_madd_epi16 against the activation's 16-bit values, one
 * scale per (row, column, sub-block): the product of the sub-block's scale (d; IQ4_XS: d (ls - 32),
 * exact in float32; MXFP4: a power of 2) and the activation block's d. Q5_0's -16 is applied to the widened weights (no
 * min term, as Q4_0's -8 in quant_legacy.c); Q5_1 adds m times the activation block's sum.
 * |weight integer| <= 127 here (Q5: 0..31 or -16..15, V: -127..113), within quant_legacy.c's bound
 * of 128: every integer sum is exact in int32 and in its float32 conversion.
 *
 * Type codes: ggml's ids. These are held in the file's layout (rows not interleaved).
 */
#include "quant.h"
#include "rivulet_kernels.h"

#define QB 32 /* weights per sub-block */
#define KC 32 /* sub-blocks per chunk (scales precomputed per chunk) */
#define MR 4  /* activation rows per register tile */
#define MC 2  /* weight rows per register tile */
#define ROW1_W 4
#define PF_BYTES 512

static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t MXFP4_LEVELS[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* The types whose nibbles index a table of levels, and that table. */
static inline int has_levels(const int type) {
    return type == QTYPE_IQ4_NL || type == QTYPE_IQ4_XS || type == QTYPE_MXFP4;
}
static inline const int8_t *levels_of(const int type) { return type == QTYPE_MXFP4 ? MXFP4_LEVELS : IQ4_LEVELS; }

/* MXFP4's E8M0 exponent as the scale of its doubled levels, 2^(e - 128), exactly (e < 2: subnormal). */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Bytes of one file block; sub-blocks of 32 in it. */
static inline int block_bytes(const int type) {
    switch (type) {
    case QTYPE_Q5_0: return 22;
    case QTYPE_Q5_1: return 24;
    case QTYPE_IQ4_NL: return 18;
    case QTYPE_MXFP4: return 17;
    default: return 136;
    }
}
static inline int subs(const int type) { return type == QTYPE_IQ4_XS ? 8 : 1; }

/* Sub-block b's scale: d, or IQ4_XS's d (ls - 32) (an fp16 times an integer below 2^6: exact). */
static inline float sub_scale(const uint8_t *row, int64_t b, const int type) {
    if (type == QTYPE_MXFP4) return e8m0_half(row[b * 17]);
    if (type != QTYPE_IQ4_XS) return half_at(row + b * block_bytes(type));
    const uint8_t *blk = row + b / 8 * 136;
    const int i = (int)(b % 8);
    uint16_t high;
    memcpy(&high, blk + 2, sizeof high);
    const int ls = ((blk[4 + i / 2] >> (4 * (i % 2))) & 0x0f) | (((high >> (2 * i)) & 3) << 4);
    return half_at(blk) * (float)(ls - 32);
}

/* Sub-block b's 16 bytes of nibbles. */
static inline const uint8_t *sub_nibbles(const uint8_t *row, int64_t b, const int type) {
    switch (type) {
    case QTYPE_Q5_0: return row + b * 22 + 6;
    case QTYPE_Q5_1: return row + b * 24 + 8;
    case QTYPE_IQ4_NL: return row + b * 18 + 2;
    case QTYPE_MXFP4: return row + b * 17 + 1;
    default: return row + b / 8 * 136 + 8 + 16 * (b % 8);
    }
}

/* Q5's 32 high bits (bit j: weight j's fifth bit). */
static inline uint32_t q5_high(const uint8_t *row, int64_t b, const int type) {
    uint32_t qh;
    memcpy(&qh, row + b * block_bytes(type) + (type == QTYPE_Q5_0 ? 2 : 4), sizeof qh);
    return qh;
}

/* The 32 weight integers of sub-block b (the values the tiles multiply: Q5_0 already minus 16). */
static inline void sub_ints(const uint8_t *row, int64_t b, const int type, int32_t q[QB]) {
    const uint8_t *nib = sub_nibbles(row, b, type);
    if (has_levels(type)) {
        const int8_t *lv = levels_of(type);
        for (int j = 0; j < 16; j++) q[j] = lv[nib[j] & 0x0f], q[16 + j] = lv[nib[j] >> 4];
        return;
    }
    const uint32_t qh = q5_high(row, b, type);
    const int32_t off = type == QTYPE_Q5_0 ? 16 : 0;
    for (int j = 0; j < 16; j++) {
        q[j] = ((nib[j] & 0x0f) | (int32_t)((qh >> j) & 1) << 4) - off;
        q[16 + j] = ((nib[j] >> 4) | (int32_t)((qh >> (16 + j)) & 1) << 4) - off;
    }
}

/* ---- dequantization (embedding rows, the dense path's panels, the tests' reference): scale * q
 * (exact in float32 but IQ4_XS's, rounded once as gguf-py's), plus Q5_1's m in one rounding. ---- */
static inline void dequant_rows(const uint8_t *w, int64_t k, float *out, const int type) {
    for (int64_t b = 0; b < k / QB; b++) {
        int32_t q[QB];
        sub_ints(w, b, type, q);
        const float d = sub_scale(w, b, type), m = type == QTYPE_Q5_1 ? half_at(w + b * 24 + 2) : 0.0f;
#pragma omp simd
        for (int j = 0; j < QB; j++) out[b * QB + j] = d * (float)q[j] + m;
    }
}

static void dequant_q5_0(const uint8_t *w, int64_t k, float *out) { dequant_rows(w, k, out, QTYPE_Q5_0); }
static void dequant_q5_1(const uint8_t *w, int64_t k, float *out) { dequant_rows(w, k, out, QTYPE_Q5_1); }
static void dequant_iq4_nl(const uint8_t *w, int64_t k, float *out) { dequant_rows(w, k, out, QTYPE_IQ4_NL); }
static void dequant_iq4_xs(const uint8_t *w, int64_t k, float *out) { dequant_rows(w, k, out, QTYPE_IQ4_XS); }
static void dequant_mxfp4(const uint8_t *w, int64_t k, float *out) { dequant_rows(w, k, out, QTYPE_MXFP4); }

#if HAVE_AVX2 || HAVE_AVX512

/* Sub-block b's 32 weight integers as int16: *lo weights 0-15, *hi 16-31. IQ4: each nibble looked
 * up in the levels by a byte shuffle, then sign-extended; Q5: the nibbles zero-extended, each
 * lane's high bit tested in qh (lane j against bit j) and 16 added where set (Q5_0: minus 16). */
static inline void widen(const uint8_t *row, int64_t b, const int type, __m256i *lo, __m256i *hi) {
    const __m128i v = _mm_loadu_si128((const __m128i *)sub_nibbles(row, b, type)), low4 = _mm_set1_epi8(0x0f);
    if (has_levels(type)) {
        const __m128i levels = _mm_loadu_si128((const __m128i *)levels_of(type));
        *lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(levels, _mm_and_si128(v, low4)));
        *hi = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(levels, _mm_and_si128(_mm_srli_epi16(v, 4), low4)));
        return;
    }
    const uint32_t qh = q5_high(row, b, type);
    const __m256i bit = _mm256_setr_epi16(0x1, 0x2, 0x4, 0x8, 0x10, 0x20, 0x40, 0x80, 0x100, 0x200, 0x400, 0x800,
                                          0x1000, 0x2000, 0x4000, (short)0x8000);
    const __m256i sixteen = _mm256_set1_epi16(16);
    const __m256i h0 = _mm256_and_si256(bit, _mm256_set1_epi16((short)(qh & 0xffffu)));
    const __m256i h1 = _mm256_and_si256(bit, _mm256_set1_epi16((short)(qh >> 16)));
    const __m256i n = _mm256_cvtepu8_epi16(v);
    *lo = _mm256_or_si256(_mm256_and_si256(n, _mm256_set1_epi16(0x0f)),
                          _mm256_and_si256(_mm256_cmpeq_epi16(h0, bit), sixteen));
    *hi = _mm256_or_si256(_mm256_srli_epi16(n, 4), _mm256_and_si256(_mm256_cmpeq_epi16(h1, bit), sixteen));
    if (type == QTYPE_Q5_0) {
        *lo = _mm256_sub_epi16(*lo, sixteen);
        *hi = _mm256_sub_epi16(*hi, sixteen);
    }
}

/* sum(a[i] * b[i]) for i < len. */
static inline float dot_f32(const float *a, const float *b, int len) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < len; i++) s += a[i] * b[i];
    return s;
}

/* Weight rows [0, C) x activation rows [0, R), as quant_legacy.c's legacy_micro: per chunk of KC
 * sub-blocks the scales of every (row, column, sub-block) first, then per sub-block the C weight
 * rows widened once and met by the R activation rows. Rows past nc / nr repeat the last valid one,
 * their sums not stored. */
static inline __attribute__((always_inline)) void micro(const uint8_t *w, int64_t wrb, int64_t nc,
                                                        const uint8_t *xq, int64_t xrb, int64_t nr, int64_t ns,
                                                        float *out, int64_t ldo, const int type, const int R,
                                                        const int C) {
    const uint8_t *wr[MC];
    const act_block16 *xa[MR];
    for (int c = 0; c < C; c++) wr[c] = w + (c < nc ? c : nc - 1) * wrb;
    for (int r = 0; r < R; r++) xa[r] = (const act_block16 *)(xq + (r < nr ? r : nr - 1) * xrb);
    __m256 acc[MR][MC];
    float msum[MR][MC];
    float dw[MC][KC], mf[MC][KC], xd[MR][KC], xs[MR][KC], sc[MR][MC][KC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps(), msum[r][c] = 0.0f;
    for (int64_t b0 = 0; b0 < ns; b0 += KC) {
        const int len = ns - b0 < KC ? (int)(ns - b0) : KC;
        for (int c = 0; c < C; c++)
            for (int i = 0; i < len; i++) dw[c][i] = sub_scale(wr[c], b0 + i, type);
        if (type == QTYPE_Q5_1)
            for (int c = 0; c < C; c++)
                for (int i = 0; i < len; i++) mf[c][i] = half_at(wr[c] + (b0 + i) * 24 + 2);
        for (int r = 0; r < R; r++)
            for (int i = 0; i < len; i++) xd[r][i] = xa[r][b0 + i].d, xs[r][i] = xa[r][b0 + i].s;
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
#pragma omp simd
                for (int i = 0; i < len; i++) sc[r][c][i] = dw[c][i] * xd[r][i];
        for (int i = 0; i < len; i++) {
            const int64_t b = b0 + i;
            __m256i lo[MC], hi[MC];
            for (int c = 0; c < C; c++) widen(wr[c], b, type, &lo[c], &hi[c]);
            for (int r = 0; r < R; r++) {
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)xa[r][b].q);
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xa[r][b].q + 16));
                for (int c = 0; c < C; c++) {
                    const __m256i p = DPW8(_mm256_madd_epi16(lo[c], x0), hi[c], x1);
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&sc[r][c][i]), acc[r][c]);
                }
            }
        }
        if (type == QTYPE_Q5_1)
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C; c++) msum[r][c] += dot_f32(mf[c], xs[r], len);
    }
    for (int r = 0; r < R && r < nr; r++)
        for (int c = 0; c < C && c < nc; c++) out[r * ldo + c] = hsum8(acc[r][c]) + msum[r][c];
}

/* out[r] = dot(weight row r, the activation row xa) for r < R: one activation row, bound by the
 * weights' bytes, R rows streamed side by side and prefetched ahead. */
static inline __attribute__((always_inline)) void row1_group(const uint8_t *w, int64_t wrb, const act_block16 *xa,
                                                             int64_t ns, float *out, const int type, const int R) {
    const int64_t sub_bytes = block_bytes(type) / subs(type); /* on average: for the prefetch only */
    __m256 acc[ROW1_W];
    float m[ROW1_W];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), m[r] = 0.0f;
    for (int64_t b = 0; b < ns; b++) {
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)xa[b].q);
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xa[b].q + 16));
        const float xd = xa[b].d, xs = xa[b].s;
        for (int r = 0; r < R; r++) {
            const uint8_t *row = w + r * wrb;
            _mm_prefetch((const char *)(row + b * sub_bytes + PF_BYTES), _MM_HINT_T0);
            __m256i lo, hi;
            widen(row, b, type, &lo, &hi);
            const __m256i p = DPW8(_mm256_madd_epi16(lo, x0), hi, x1);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sub_scale(row, b, type) * xd), acc[r]);
            if (type == QTYPE_Q5_1) m[r] += half_at(row + b * 24 + 2) * xs;
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]) + m[r];
}

#define TILE_ARGS(c0, r0) w + (c0) * wrb, wrb, nc - (c0), xq + (r0) * xrb, xrb, rows, ns, out + (r0) * ldo + (c0), ldo

/* One activation row: ROW1_W weight rows at a time. Several: activation rows in near-equal groups
 * of at most MR, each group over every MC weight rows in turn (quant_legacy.c's TILE_LOOP). */
static inline __attribute__((always_inline)) void tile_loop(const uint8_t *w, int64_t wrb, int64_t nc,
                                                            const uint8_t *xq, int64_t xrb, int64_t nr, int64_t nb,
                                                            float *out, int64_t ldo, const int type) {
    const int64_t ns = nb * subs(type);
    if (nr == 1) {
        int64_t c = 0;
        for (; c + ROW1_W <= nc; c += ROW1_W)
            row1_group(w + c * wrb, wrb, (const act_block16 *)xq, ns, out + c, type, ROW1_W);
        for (; c < nc; c++) row1_group(w + c * wrb, wrb, (const act_block16 *)xq, ns, out + c, type, 1);
        return;
    }
    const int64_t groups = (nr + MR - 1) / MR;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t r0 = nr * g / groups, rows = nr * (g + 1) / groups - r0;
        for (int64_t c0 = 0; c0 < nc; c0 += MC) {
            switch (rows) {
            case 1: micro(TILE_ARGS(c0, r0), type, 1, MC); break;
            case 2: micro(TILE_ARGS(c0, r0), type, 2, MC); break;
            case 3: micro(TILE_ARGS(c0, r0), type, 3, MC); break;
            default: micro(TILE_ARGS(c0, r0), type, MR, MC);
            }
        }
    }
}

#else /* portable: plain C, one sub-block widened to int and met by each activation row */

static inline void tile_loop(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                             int64_t nb, float *out, int64_t ldo, const int type) {
    const int64_t ns = nb * subs(type);
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *row = w + c * wrb;
        for (int64_t r = 0; r < nr; r++) out[r * ldo + c] = 0.0f;
        for (int64_t b = 0; b < ns; b++) {
            int32_t q[QB];
            sub_ints(row, b, type, q);
            const float dw = sub_scale(row, b, type), m = type == QTYPE_Q5_1 ? half_at(row + b * 24 + 2) : 0.0f;
            for (int64_t r = 0; r < nr; r++) {
                const act_block16 *xb = (const act_block16 *)(xq + r * xrb) + b;
                int32_t dot = 0; /* exact: see the top of the file */
                for (int j = 0; j < QB; j++) dot += q[j] * xb->q[j];
                out[r * ldo + c] += dw * xb->d * (float)dot + m * xb->s;
            }
        }
    }
}
#endif

#define SUB32_TILE(name, TYPE)                                                                                \
    static void name(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,  \
                     int64_t nb, float *out, int64_t ldo) {                                                   \
        tile_loop(w, wrb, nc, xq, xrb, nr, nb, out, ldo, TYPE);                                               \
    }
SUB32_TILE(tile_q5_0, QTYPE_Q5_0)
SUB32_TILE(tile_q5_1, QTYPE_Q5_1)
SUB32_TILE(tile_iq4_nl, QTYPE_IQ4_NL)
SUB32_TILE(tile_iq4_xs, QTYPE_IQ4_XS)
SUB32_TILE(tile_mxfp4, QTYPE_MXFP4)

#define ACT_BYTES ((int)sizeof(act_block16))
static const qtype_ops OPS_Q5_0 = {QTYPE_Q5_0, QB, 22, ACT_BYTES, quantize_act16, tile_q5_0, dequant_q5_0, NULL, NULL};
static const qtype_ops OPS_Q5_1 = {QTYPE_Q5_1, QB, 24, ACT_BYTES, quantize_act16, tile_q5_1, dequant_q5_1, NULL, NULL};
static const qtype_ops OPS_IQ4_NL = {QTYPE_IQ4_NL, QB,      18,  ACT_BYTES, quantize_act16, tile_iq4_nl,
                                     dequant_iq4_nl, NULL, NULL};
static const qtype_ops OPS_IQ4_XS = {QTYPE_IQ4_XS, 256,     136, 8 * ACT_BYTES, quantize_act16, tile_iq4_xs,
                                     dequant_iq4_xs, NULL, NULL};

static const qtype_ops OPS_MXFP4 = {QTYPE_MXFP4, QB, 17, ACT_BYTES, quantize_act16, tile_mxfp4, dequant_mxfp4,
                                    NULL, NULL};

const qtype_ops *qtype_sub32(int type) {
    switch (type) {
    case QTYPE_Q5_0: return &OPS_Q5_0;
    case QTYPE_Q5_1: return &OPS_Q5_1;
    case QTYPE_IQ4_NL: return &OPS_IQ4_NL;
    case QTYPE_IQ4_XS: return &OPS_IQ4_XS;
    case QTYPE_MXFP4: return &OPS_MXFP4;
    default: return NULL;
    }
}
