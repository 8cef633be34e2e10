/* The 2- and 3-bit K-quants, Q2_K and Q3_K, computed in their blocks (ggml's layouts, checked against
 * gguf-py's dequantize in tests/gpu_worker/test_quant_k23.py): the small files people pick for bigger
 * models (Q2_K, Q3_K_S, Q3_K_M). 256 weights a block, in 16 groups of 16 with a scale each.
 *
 *   Q2_K,  84 bytes: 16 bytes of group scales (low nibble sc, high nibble m), 64 bytes of 2-bit
 *          quants, fp16 d, fp16 dmin; weight = d sc q - dmin m
 *   Q3_K, 110 bytes: 32 bytes of high bits, 64 bytes of 2-bit quants, 12 bytes of 6-bit group
 *          scales s (packed as gguf-py draws them), fp16 d; weight = d (s - 32) (q - 4 (1 - h))
 * The 2-bit quants as both types hold them: weight w of a block is bits 2i, 2i + 1 of byte
 * 32 (w / 128) + w % 32, i = (w % 128) / 32; Q3_K's high bit h of weight w is bit w / 32 of byte
 * w % 32 of the high bits.
 *
 * Each 32 weights (two groups) meet one activation block of quant.h's act_block16, as in
 * quant_sub32.c, with each group's scale folded into the integers the tiles multiply: Q2_K sc q
 * (0 .. 45), Q3_K (s - 32)(q - 4 + 4h) (-128 .. 128), so one float scale, d times the activation
 * block's, per 32. Q2_K's min term, dmin m times the sum of a group's activations, is a second
 * integer dot (the group's m broadcast over its 16 lanes) at dmin times the activation block's d.
 * |integer| <= 128: quant_legacy.c's bound, every sum exact in int32 and in its float conversion.
 *
 * Type codes: ggml's ids. Held in the file's layout (rows not interleaved).
 */
#include "quant.h"
#include "rivulet_kernels.h"

#define QB 32  /* weights per sub-block (two groups of 16) */
#define KC 32  /* sub-blocks per chunk (scales precomputed per chunk) */
#define MR 4   /* activation rows per register tile */
#define MC 2   /* weight rows per register tile */
#define ROW1_W 4
#define PF_BYTES 512

static inline int block_bytes(const int type) { return type == QTYPE_Q2_K ? 84 : 110; }
static inline const uint8_t *block_of(const uint8_t *row, int64_t b, const int type) {
    return row + b / 8 * block_bytes(type);
}

/* Sub-block b's d (the folded integers' scale) and Q2_K's dmin. */
static inline float sub_d(const uint8_t *row, int64_t b, const int type) {
    return half_at(block_of(row, b, type) + (type == QTYPE_Q2_K ? 80 : 108));
}
static inline float sub_dmin(const uint8_t *row, int64_t b) { return half_at(block_of(row, b, QTYPE_Q2_K) + 82); }

/* Group g's (0..15) scale as the integer it multiplies: Q2_K sc, Q3_K s - 32; Q2_K's m. */
static inline int group_scale(const uint8_t *blk, int g, const int type) {
    if (type == QTYPE_Q2_K) return blk[g] & 0x0f;
    const int low = g < 8 ? blk[96 + g] & 0x0f : blk[96 + g - 8] >> 4;
    const int high = (blk[104 + g % 4] >> (2 * (g / 4))) & 3;
    return (low | high << 4) - 32;
}
static inline int group_min(const uint8_t *blk, int g) { return blk[g] >> 4; }

/* The 32 integers of sub-block b, scales folded in, and (Q2_K) the group mins lane by lane. */
static inline void sub_ints(const uint8_t *row, int64_t b, const int type, int32_t q[QB], int32_t m[QB]) {
    const uint8_t *blk = block_of(row, b, type), *qs = blk + (type == QTYPE_Q2_K ? 16 : 32);
    const int s = (int)(b % 8), half = s / 4, shift = 2 * (s % 4);
    for (int j = 0; j < QB; j++) {
        const int g = 2 * s + j / 16;
        int v = (qs[32 * half + j] >> shift) & 3;
        if (type == QTYPE_Q3_K) v -= ((blk[j] >> s) & 1) ? 0 : 4;
        q[j] = group_scale(blk, g, type) * v;
        m[j] = type == QTYPE_Q2_K ? group_min(blk, g) : 0;
    }
}

/* ---- dequantization (embedding rows, the dense path's panels): d times the folded integer (exact),
 * minus Q2_K's dmin m (exact): one rounding, as gguf-py's. ---- */
static inline void dequant_rows(const uint8_t *w, int64_t k, float *out, const int type) {
    for (int64_t b = 0; b < k / QB; b++) {
        int32_t q[QB], m[QB];
        sub_ints(w, b, type, q, m);
        const float d = sub_d(w, b, type), dmin = type == QTYPE_Q2_K ? sub_dmin(w, b) : 0.0f;
        for (int j = 0; j < QB; j++) out[b * QB + j] = d * (float)q[j] - dmin * (float)m[j];
    }
}

static void dequant_q2_k(const uint8_t *w, int64_t k, float *out) { dequant_rows(w, k, out, QTYPE_Q2_K); }
static void dequant_q3_k(const uint8_t *w, int64_t k, float *out) { dequant_rows(w, k, out, QTYPE_Q3_K); }

#if HAVE_AVX2 || HAVE_AVX512

/* Sub-block b's folded integers as int16 (*lo weights 0-15, *hi 16-31; a group each), and Q2_K's two
 * group mins in *m0, *m1: the 32 quant bytes shifted to the sub-block's 2 bits, Q3_K's high bits
 * merged in (q + 4h, then minus 4), each group multiplied by its scale. */
static inline void widen(const uint8_t *row, int64_t b, const int type, __m256i *lo, __m256i *hi, int *m0,
                         int *m1) {
    const uint8_t *blk = block_of(row, b, type), *qs = blk + (type == QTYPE_Q2_K ? 16 : 32);
    const int s = (int)(b % 8), shift = 2 * (s % 4);
    __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * (s / 4)));
    q = _mm256_and_si256(_mm256_srli_epi16(q, shift), _mm256_set1_epi8(3));
    if (type == QTYPE_Q3_K) {
        const __m256i h = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)blk), s),
                                           _mm256_set1_epi8(1));
        q = _mm256_or_si256(q, _mm256_slli_epi16(h, 2));
    }
    __m256i l16 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(q)), h16 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1));
    if (type == QTYPE_Q3_K) {
        l16 = _mm256_sub_epi16(l16, _mm256_set1_epi16(4));
        h16 = _mm256_sub_epi16(h16, _mm256_set1_epi16(4));
    }
    *lo = _mm256_mullo_epi16(l16, _mm256_set1_epi16((short)group_scale(blk, 2 * s, type)));
    *hi = _mm256_mullo_epi16(h16, _mm256_set1_epi16((short)group_scale(blk, 2 * s + 1, type)));
    if (type == QTYPE_Q2_K) *m0 = group_min(blk, 2 * s), *m1 = group_min(blk, 2 * s + 1);
}

/* Q2_K's min dot of one activation block: m0 times the sum of its values 0-15, m1 of 16-31. */
static inline __m256i min_dot(int m0, int m1, __m256i x0, __m256i x1) {
    return DPW8(_mm256_madd_epi16(_mm256_set1_epi16((short)m0), x0), _mm256_set1_epi16((short)m1), x1);
}

/* Weight rows [0, C) x activation rows [0, R) (quant_sub32.c's micro): per chunk of KC sub-blocks the
 * scales of every (row, column, sub-block) first, then per sub-block the C weight rows widened once. */
static inline __attribute__((always_inline)) void micro(const uint8_t *w, int64_t wrb, int64_t nc,
                                                        const uint8_t *xq, int64_t xrb, int64_t nr, int64_t ns,
                                                        float *out, int64_t ldo, const int type, const int R,
                                                        const int C) {
    const uint8_t *wr[MC];
    const act_block16 *xa[MR];
    for (int c = 0; c < C; c++) wr[c] = w + (c < nc ? c : nc - 1) * wrb;
    for (int r = 0; r < R; r++) xa[r] = (const act_block16 *)(xq + (r < nr ? r : nr - 1) * xrb);
    __m256 acc[MR][MC];
    float dw[MC][KC], dm[MC][KC], sc[MR][MC][KC], sm[MR][MC][KC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < ns; b0 += KC) {
        const int len = ns - b0 < KC ? (int)(ns - b0) : KC;
        for (int c = 0; c < C; c++)
            for (int i = 0; i < len; i++) {
                dw[c][i] = sub_d(wr[c], b0 + i, type);
                dm[c][i] = type == QTYPE_Q2_K ? sub_dmin(wr[c], b0 + i) : 0.0f;
            }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                for (int i = 0; i < len; i++) {
                    sc[r][c][i] = dw[c][i] * xa[r][b0 + i].d;
                    sm[r][c][i] = dm[c][i] * xa[r][b0 + i].d;
                }
        for (int i = 0; i < len; i++) {
            const int64_t b = b0 + i;
            __m256i lo[MC], hi[MC];
            int m0[MC] = {0}, m1[MC] = {0};
            for (int c = 0; c < C; c++) widen(wr[c], b, type, &lo[c], &hi[c], &m0[c], &m1[c]);
            for (int r = 0; r < R; r++) {
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)xa[r][b].q);
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xa[r][b].q + 16));
                for (int c = 0; c < C; c++) {
                    const __m256i p = DPW8(_mm256_madd_epi16(lo[c], x0), hi[c], x1);
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&sc[r][c][i]), acc[r][c]);
                    if (type == QTYPE_Q2_K)
                        acc[r][c] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(min_dot(m0[c], m1[c], x0, x1)),
                                                     _mm256_broadcast_ss(&sm[r][c][i]), acc[r][c]);
                }
            }
        }
    }
    for (int r = 0; r < R && r < nr; r++)
        for (int c = 0; c < C && c < nc; c++) out[r * ldo + c] = hsum8(acc[r][c]);
}

/* out[r] = dot(weight row r, the activation row xa) for r < R: one activation row, bound by the
 * weights' bytes, R rows streamed side by side and prefetched ahead. */
static inline __attribute__((always_inline)) void row1_group(const uint8_t *w, int64_t wrb, const act_block16 *xa,
                                                             int64_t ns, float *out, const int type, const int R) {
    const int64_t sub_bytes = block_bytes(type) / 8; /* on average: for the prefetch only */
    __m256 acc[ROW1_W];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < ns; b++) {
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)xa[b].q);
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xa[b].q + 16));
        const float xd = xa[b].d;
        for (int r = 0; r < R; r++) {
            const uint8_t *row = w + r * wrb;
            _mm_prefetch((const char *)(row + b * sub_bytes + PF_BYTES), _MM_HINT_T0);
            __m256i lo, hi;
            int m0 = 0, m1 = 0;
            widen(row, b, type, &lo, &hi, &m0, &m1);
            const __m256i p = DPW8(_mm256_madd_epi16(lo, x0), hi, x1);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sub_d(row, b, type) * xd), acc[r]);
            if (type == QTYPE_Q2_K)
                acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(min_dot(m0, m1, x0, x1)),
                                          _mm256_set1_ps(sub_dmin(row, b) * xd), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

#define TILE_ARGS(c0, r0) w + (c0) * wrb, wrb, nc - (c0), xq + (r0) * xrb, xrb, rows, ns, out + (r0) * ldo + (c0), ldo

static inline __attribute__((always_inline)) void tile_loop(const uint8_t *w, int64_t wrb, int64_t nc,
                                                            const uint8_t *xq, int64_t xrb, int64_t nr, int64_t nb,
                                                            float *out, int64_t ldo, const int type) {
    const int64_t ns = nb * 8;
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
    const int64_t ns = nb * 8;
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *row = w + c * wrb;
        for (int64_t r = 0; r < nr; r++) out[r * ldo + c] = 0.0f;
        for (int64_t b = 0; b < ns; b++) {
            int32_t q[QB], m[QB];
            sub_ints(row, b, type, q, m);
            const float dw = sub_d(row, b, type), dmin = type == QTYPE_Q2_K ? sub_dmin(row, b) : 0.0f;
            for (int64_t r = 0; r < nr; r++) {
                const act_block16 *xb = (const act_block16 *)(xq + r * xrb) + b;
                int32_t dot = 0, mdot = 0; /* exact: see the top of the file */
                for (int j = 0; j < QB; j++) dot += q[j] * xb->q[j], mdot += m[j] * xb->q[j];
                out[r * ldo + c] += dw * xb->d * (float)dot - dmin * xb->d * (float)mdot;
            }
        }
    }
}
#endif

static void tile_q2_k(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                      int64_t nb, float *out, int64_t ldo) {
    tile_loop(w, wrb, nc, xq, xrb, nr, nb, out, ldo, QTYPE_Q2_K);
}

static void tile_q3_k(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                      int64_t nb, float *out, int64_t ldo) {
    tile_loop(w, wrb, nc, xq, xrb, nr, nb, out, ldo, QTYPE_Q3_K);
}

#define ACT_BYTES (8 * (int)sizeof(act_block16)) /* per 256 weights */
static const qtype_ops OPS_Q2_K = {QTYPE_Q2_K, 256, 84, ACT_BYTES, quantize_act16, tile_q2_k, dequant_q2_k, NULL, NULL};
static const qtype_ops OPS_Q3_K = {QTYPE_Q3_K, 256, 110, ACT_BYTES, quantize_act16, tile_q3_k, dequant_q3_k, NULL, NULL};

const qtype_ops *qtype_k23(int type) {
    switch (type) {
    case QTYPE_Q2_K: return &OPS_Q2_K;
    case QTYPE_Q3_K: return &OPS_Q3_K;
    default: return NULL;
    }
}
