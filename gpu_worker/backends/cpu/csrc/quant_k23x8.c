/* Q2_K and Q3_K (quant_k23.c draws the file's blocks) with their weight rows interleaved by 8, the
 * layout the worker holds them in (backends/cpu/layouts.py makes it at load: the same bytes,
 * rearranged). Type code: the ggml type | QTYPE_X8; | QTYPE_A8 for the 8-bit activations' tiles.
 *
 * Rows 8g .. 8g + 7 form group g, stored where the file's rows were; block b of the 8 rows is one
 * group block of 8 * block_bytes at b * 8 * block_bytes. Its fields, each of the 8 rows side by
 * side (a "chunk": bytes 4c .. 4c + 3 of row 0, of row 1, ..., of row 7):
 *   Q2_K (672 bytes): 8 fp16 d | 8 fp16 dmin | the 16 scale bytes in 4 chunks (128) | the 64
 *     quant bytes in 16 chunks (512).
 *   Q3_K (880 bytes): 8 fp16 d | the 12 scale bytes in 3 chunks (96) | the 32 high-bit bytes in 8
 *     chunks (256) | the 64 quant bytes in 16 chunks (512).
 * A chunk is one ymm, 4 bytes (one 32-bit lane) per row: a row's scales, shifted and masked on its
 * lane, are the 8 rows' scales at once, and a quant chunk shifted to a sub-block's 2 bits is 4
 * weights of each row. Sub-block j (weights 32j .. 32j + 31, one activation block of 32) is quant
 * chunks 8 (j / 4) + 0..7 at bits 2 (j % 4) (groups 2j: chunks 0-3, 2j + 1: 4-7), Q3_K's high bits
 * bit j of high-bit chunks 0..7.
 *
 *   16-bit activations (act_block16; few rows, decode): a group's 4 chunks as signed weights
 *     (Q2_K q, Q3_K q + 4h - 4) widened to int16 (rows 0-3, rows 4-7), madd against the
 *     activation's 4 matching values broadcast per 64 bits, folded by one hadd (rows in the order
 *     0 1 4 5 2 3 6 7, the scales permuted alike), converted once per group and scaled by d times
 *     its scale (float); Q2_K's min term dmin m times the activation's 16-value sum. A lane sums 16
 *     products of |w| <= 4 by |x| <= 32767: exact in float32 too.
 *   8-bit activations (act_block8, type | QTYPE_A8; many rows): vpdpbusd (maddubs + madd without
 *     VNNI) of a chunk's unsigned weights (Q2_K q <= 3, Q3_K q + 4h <= 7) against the activation's
 *     4 bytes broadcast: per (row, group of 16) one int32 lane, no fold. Q3_K's -4 starts the sum at
 *     -4 sum(x) (act_block8's qoff / 8), so the sum is exact as sum((q + 4h - 4) x); each group's sum
 *     times its integer scale (Q3_K s - 32, Q2_K sc), the two of a sub-block added (|sum| <= 2 * 16
 *     * 4 * 127 * 32 < 2^19: exact in int32 and in float), converted, times d and the activation's
 *     step. Q2_K's min: its mins m times the groups' activation sums (-qoff / 32), the same way at
 *     dmin. Where a row's 32 values have the residual pass, r meets the weights too at a 128th of
 *     the step (rows without it add zero products). maddubs' int16 sums of 4 chunks: at most 4 * 2
 *     * 7 * 127, no saturation. On zmm, Q3_K's 16 group scales are made bytes once a block and each
 *     group's picked by one vpshufb. Q3_K from 9 rows on zmm (q3_sliced): a slice of blocks unpacked
 *     once for every row group, as 8 (q + 4h) with the sums starting at qoff (8 times the integers,
 *     d / 8: the same products, so the same bits).
 *   One activation row on 16 bits (decode: quant.py's A8_MIN_ROWS is 2): row16_q2, row16_q3 (their
 *     comments): tile16's integers and float steps per lane, one lane a row, no widening or fold.
 *   One activation row on 8 bits (tile8's R = 1; no table routes there now): the zmm builds
 *     load each quant chunk pair once a block and mask its four sub-blocks' bits where they lie
 *     (row1_q2, row1_q3): the integers come out a power of four times tile8's, d is scaled back, and the
 *     float steps give tile8's bits (tested: a row alone against the rows beside it).
 * Every build that has the 8-bit tiles sums the same integers and runs the same float steps per
 * (row, column, sub-block), in the same order, so its outputs are the same bits (tested).
 * Portable: the 16-bit tile rebuilds each row in the file's layout for quant_k23.c's plain tile;
 * the 8-bit tile is plain C over the same integers (a reference; quant.py never routes to it).
 */
#include "quant.h"
#include "rivulet_kernels.h"

#ifndef K23X8_PF
#define K23X8_PF 2048 /* how far ahead (bytes) the tiles prefetch their group's blocks */
#endif
#ifndef ROW16_AHEAD /* how far ahead the one-row 16-bit form prefetches: the same block of the pass after next */
#define ROW16_AHEAD (16 * wrb)
#endif
int k23_row16_q3 = 1; /* 0: one 16-bit activation row on Q3_K takes tile16 (--toggle k23_row16_q3) */
int k23_row16 = 1; /* 0: one 16-bit activation row on Q2_K takes tile16 as few rows do (--toggle k23_row16) */
int k23_row1 = 1; /* 0: one activation row takes tile8 as many rows do (bench.worker_step --toggle k23_row1) */

/* Where each field lies: per slot s and chunk c < n, unit bytes at file + c unit in the file's block,
 * at x8 + (8c + s) unit in the group block. */
typedef struct {
    int file, x8, unit, n;
} k23_field;
static const k23_field Q2_FIELDS[4] = {{80, 0, 2, 1}, {82, 16, 2, 1}, {0, 32, 4, 4}, {16, 160, 4, 16}};
static const k23_field Q3_FIELDS[4] = {{108, 0, 2, 1}, {96, 16, 4, 3}, {0, 112, 4, 8}, {32, 368, 4, 16}};
#define Q2_SC 32   /* the scale chunks of a Q2_K group block */
#define Q2_QS 160  /* its quant chunks */
#define Q3_SC 16   /* the scale words of a Q3_K group block */
#define Q3_HM 112  /* its high-bit chunks */
#define Q3_QS 368  /* its quant chunks */

static inline int bb_of(const int type) { return type == QTYPE_Q2_K ? 84 : 110; }
static inline int qs_of(const int type) { return type == QTYPE_Q2_K ? Q2_QS : Q3_QS; }

/* Slot s's block (of the group block at blk) rebuilt as the file's block. */
static inline void plain_block(const uint8_t *blk, int s, const int type, uint8_t *plain) {
    const k23_field *f = type == QTYPE_Q2_K ? Q2_FIELDS : Q3_FIELDS;
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < f[i].n; c++) memcpy(plain + f[i].file + c * f[i].unit, blk + f[i].x8 + (8 * c + s) * f[i].unit, (size_t)f[i].unit);
}

/* Row s of the group at g (k weights) as float32: each block rebuilt, then quant_k23.c's own
 * dequantization, so the values are exactly gguf-py's. */
static void dequant_slot(const uint8_t *g, int s, int64_t k, float *out, const int type) {
    const int bb = bb_of(type);
    const qtype_ops *plain_ops = qtype_k23(type);
    uint8_t plain[110];
    for (int64_t b = 0; b < k / 256; b++) {
        plain_block(g + b * 8 * bb, s, type, plain);
        plain_ops->dequant_row(plain, 256, out + b * 256);
    }
}

#if HAVE_AVX2 || HAVE_AVX512

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define XR 4  /* activation rows per 16-bit tile (32 ymm registers) */
#else
#define XR 2  /* (16 ymm registers) */
#endif
#define XR8 4 /* activation rows per 8-bit tile */

typedef int32_t __attribute__((may_alias, aligned(1))) i32_any;
typedef int64_t __attribute__((may_alias, aligned(1))) i64_any;

/* Group g's (0..15) scales of the 8 rows as int32 lanes: Q2_K sc (and its mins m in *m), Q3_K s - 32. */
static inline __m256i group_scales(const uint8_t *blk, int g, const int type, __m256i *m) {
    const __m256i m4 = _mm256_set1_epi32(15);
    if (type == QTYPE_Q2_K) {
        const __m256i w = _mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)(blk + Q2_SC + 32 * (g / 4))), 8 * (g % 4));
        *m = _mm256_and_si256(_mm256_srli_epi32(w, 4), m4);
        return _mm256_and_si256(w, m4);
    }
    const __m256i lw = _mm256_loadu_si256((const __m256i *)(blk + Q3_SC + 32 * ((g % 8) / 4)));
    const __m256i hw = _mm256_loadu_si256((const __m256i *)(blk + Q3_SC + 64));
    const __m256i low = _mm256_and_si256(_mm256_srli_epi32(lw, 8 * (g % 4) + 4 * (g / 8)), m4);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi32(hw, 8 * (g % 4) + 2 * (g / 4)), _mm256_set1_epi32(3));
    *m = _mm256_setzero_si256();
    return _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
}

/* Chunk cc (< 8) of sub-block j of the group block at blk: 4 unsigned weights of each row as bytes,
 * Q2_K q, Q3_K q + 4h. */
static inline __attribute__((always_inline)) __m256i chunk_u(const uint8_t *blk, int j, int cc, const int type) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + qs_of(type) + 32 * (8 * (j / 4) + cc)));
    __m256i u = _mm256_and_si256(_mm256_srli_epi16(v, 2 * (j % 4)), _mm256_set1_epi8(3));
    if (type == QTYPE_Q3_K) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + Q3_HM + 32 * cc));
        const __m256i hb = j >= 2 ? _mm256_srli_epi16(h, j - 2) : _mm256_slli_epi16(h, 2 - j); /* bit j at 2 */
        u = _mm256_or_si256(u, _mm256_and_si256(hb, _mm256_set1_epi8(4)));
    }
    return u;
}

static inline __m256i pairs2(const int16_t *q) { /* q[0..3] in every 64-bit lane */
    return _mm256_set1_epi64x(*(const i64_any *)q);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#if defined(__AVX512VNNI__)
#define DPW(acc, a, b) _mm512_dpwssd_epi32((acc), (a), (b))
#else
#define DPW(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16((a), (b)))
#endif

static inline __m512i two256i(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }

/* Lanes (row s, pair p) at 2s + p of a and of b -> [a's rows 0-7 | b's rows 0-7], pairs summed. */
static inline __m512i fold_pairs(__m512i a, __m512i b) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return _mm512_add_epi32(_mm512_permutex2var_epi32(a, even, b), _mm512_permutex2var_epi32(a, odd, b));
}

/* chunk_u for two chunks at once: chunk c0 of the group block at b0 (lanes 0-7) and c1 of b1 (8-15). */
static inline __attribute__((always_inline)) __m512i chunk_u2(const uint8_t *b0, int c0, const uint8_t *b1, int c1,
                                                              int j, const int type) {
    const int qs = qs_of(type) + 32 * 8 * (j / 4);
    const __m512i v = two256i(_mm256_loadu_si256((const __m256i *)(b0 + qs + 32 * c0)),
                              _mm256_loadu_si256((const __m256i *)(b1 + qs + 32 * c1)));
    const __m512i q = _mm512_and_si512(_mm512_srli_epi16(v, 2 * (j % 4)), _mm512_set1_epi8(3));
    if (type == QTYPE_Q2_K) return q;
    const __m512i h = two256i(_mm256_loadu_si256((const __m256i *)(b0 + Q3_HM + 32 * c0)),
                              _mm256_loadu_si256((const __m256i *)(b1 + Q3_HM + 32 * c1)));
    const __m512i hb = j >= 2 ? _mm512_srli_epi16(h, j - 2) : _mm512_slli_epi16(h, 2 - j); /* bit j at 2 */
    return _mm512_ternarylogic_epi32(q, hb, _mm512_set1_epi8(4), 0xF8); /* q | (hb & 4) */
}

/* The 16-bit tile on zmm: sub-block j's two groups side by side, [group 2j's 8 rows | group 2j + 1's]:
 * a chunk of each widened to a zmm (lanes: row, pair), madd, one fold per sub-block, one float
 * scaling of both groups; the halves added at the end. */
static inline __attribute__((always_inline)) void tile16(const uint8_t *g, int64_t nb, const act_block16 *const *xa,
                                                         const float *const *ms, float *out, int64_t ldo,
                                                         const int type, const int R) {
    const int gbb = 8 * bb_of(type);
    __m512 acc[XR];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * gbb;
        for (int at = 0; at < gbb; at += 64) prefetch_weights(blk + K23X8_PF + at);
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m512 d = _mm512_insertf32x8(_mm512_castps256_ps512(d8), d8, 1);
        const __m256 dm8 = type == QTYPE_Q2_K ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))) : d8;
        const __m512 dmin = _mm512_insertf32x8(_mm512_castps256_ps512(dm8), dm8, 1);
        for (int j = 0; j < 8; j++) {
            __m512i sa[XR], sb[XR];
            __m256i m0, m1;
            const __m256i s0 = group_scales(blk, 2 * j, type, &m0), s1 = group_scales(blk, 2 * j + 1, type, &m1);
            for (int r = 0; r < R; r++) sa[r] = sb[r] = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                __m512i u = chunk_u2(blk, c, blk, 4 + c, j, type);
                if (type == QTYPE_Q3_K) u = _mm512_sub_epi8(u, _mm512_set1_epi8(4));
                const __m512i wa = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(u));
                const __m512i wb = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(u, 1));
                for (int r = 0; r < R; r++) {
                    const int16_t *x = xa[r][8 * b + j].q + 4 * c;
                    sa[r] = DPW(sa[r], wa, _mm512_set1_epi64(*(const i64_any *)x));
                    sb[r] = DPW(sb[r], wb, _mm512_set1_epi64(*(const i64_any *)(x + 16)));
                }
            }
            const __m512 dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(two256i(s0, s1)));
            const __m512 dm = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(two256i(m0, m1)));
            for (int r = 0; r < R; r++) {
                const __m512 f = _mm512_cvtepi32_ps(fold_pairs(sa[r], sb[r]));
                acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(dsc, _mm512_set1_ps(xa[r][8 * b + j].d)), acc[r]);
                if (type == QTYPE_Q2_K) {
                    const float *m = ms[r] + 16 * b + 2 * j;
                    const __m512 mm = _mm512_insertf32x8(_mm512_set1_ps(m[0]), _mm256_set1_ps(m[1]), 1);
                    acc[r] = _mm512_fnmadd_ps(dm, mm, acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        _mm256_storeu_ps(out + r * ldo, _mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm512_extractf32x8_ps(acc[r], 1)));
}

/* Two weight groups' fp16 values at a and b (8 each) as one zmm, a's in the low half. */
static inline __m512 halves_pair(const uint8_t *a, const uint8_t *b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)a))),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)), 1);
}

/* Both groups' block, ahead bytes on, toward the caches. */
static inline void prefetch_pair_at(const uint8_t *blk0, const uint8_t *blk1, int gbb, int64_t ahead) {
    for (int at = 0; at < gbb; at += 64) {
        prefetch_weights(blk0 + ahead + at);
        prefetch_weights(blk1 + ahead + at);
    }
}

/* One activation row on Q2_K, 16 bits (row16_q2): two groups' 16 rows a zmm, one int32 lane a row. Each
 * quant chunk pair is loaded once a block; its words hold weights 0 and 2 of a row's four in their low
 * bytes, weights 1 and 3 in their high bytes (shifted down once), and sub-block k of four is the 2 bits
 * at 2k, masked in place: weights 4^k q against the activation's pairs (x0, x2) and (x1, x3) (xp: the
 * row's values in that order), summed exactly (|sum| <= 16 * 192 * 32767 < 2^31) and shifted back by
 * 2k, so each group's integer is tile16's. Then tile16's float steps per lane: even groups in one
 * chain, odd in another, added at the end: the same bits. */
#if defined(__AVX512VNNI__) /* the pair as vpdpwssd's {1to16} operand (gcc does not fold the broadcast) */
static inline __m512i dpw_pair(__m512i acc, __m512i w, const int16_t *x) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const i32_any *)x));
    return acc;
}
#else
static inline __m512i dpw_pair(__m512i acc, __m512i w, const int16_t *x) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, _mm512_set1_epi32(*(const i32_any *)x)));
}
#endif

static inline __m512i two_chunks(const uint8_t *blk0, const uint8_t *blk1, int at) {
    return two256i(_mm256_loadu_si256((const __m256i *)(blk0 + at)), _mm256_loadu_si256((const __m256i *)(blk1 + at)));
}

static inline __attribute__((always_inline)) void row16_q2(const uint8_t *g0, const uint8_t *g1, int64_t nb,
                                                           const act_block16 *xa, const int16_t *xp, const float *ms,
                                                           float *out, int64_t ahead) {
    const int gbb = 8 * 84;
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512i byte_of[4];
    for (int i = 0; i < 4; i++)
        byte_of[i] = _mm512_add_epi32(_mm512_set1_epi32((int)(0x80808000u | (uint32_t)i)),
                                      _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12));
    __m512 acca = _mm512_setzero_ps(), accb = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk0 = g0 + b * gbb, *blk1 = g1 + b * gbb;
        prefetch_pair_at(blk0, blk1, gbb, ahead);
        const __m512 d = halves_pair(blk0, blk1);
        const __m512 dmin = halves_pair(blk0 + 16, blk1 + 16);
        __m512i sl[4], sh[4]; /* group g's sc (m) of the 16 rows: byte g % 4 of each word of sl[g / 4] (sh) */
        for (int t = 0; t < 4; t++) {
            const __m512i sw = two_chunks(blk0, blk1, Q2_SC + 32 * t);
            sl[t] = _mm512_and_si512(sw, m4);
            sh[t] = _mm512_and_si512(_mm512_srli_epi32(sw, 4), m4);
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m512i v[8], o[8];
            for (int c = 0; c < 8; c++) {
                v[c] = two_chunks(blk0, blk1, Q2_QS + 32 * (8 * h + c));
                o[c] = _mm512_srli_epi16(v[c], 8);
            }
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const int j = 4 * h + k;
                const __m512i mk = _mm512_set1_epi16((short)(3 << (2 * k)));
                const int16_t *x = xp + 32 * (8 * b + j);
                __m512i isa = _mm512_setzero_si512(), isb = _mm512_setzero_si512();
                for (int c = 0; c < 4; c++) {
                    isa = dpw_pair(isa, _mm512_and_si512(v[c], mk), x + 4 * c);
                    isa = dpw_pair(isa, _mm512_and_si512(o[c], mk), x + 4 * c + 2);
                    isb = dpw_pair(isb, _mm512_and_si512(v[4 + c], mk), x + 16 + 4 * c);
                    isb = dpw_pair(isb, _mm512_and_si512(o[4 + c], mk), x + 16 + 4 * c + 2);
                }
                isa = _mm512_srai_epi32(isa, 2 * k);
                isb = _mm512_srai_epi32(isb, 2 * k);
                const __m512i pa = byte_of[2 * (j % 2)], pb = byte_of[2 * (j % 2) + 1];
                const __m512 xd = _mm512_set1_ps(xa[8 * b + j].d);
                const __m512 dsa = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_shuffle_epi8(sl[j / 2], pa)));
                const __m512 dsb = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_shuffle_epi8(sl[j / 2], pb)));
                const __m512 dma = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_shuffle_epi8(sh[j / 2], pa)));
                const __m512 dmb = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_shuffle_epi8(sh[j / 2], pb)));
                acca = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isa), _mm512_mul_ps(dsa, xd), acca);
                acca = _mm512_fnmadd_ps(dma, _mm512_set1_ps(ms[16 * b + 2 * j]), acca);
                accb = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isb), _mm512_mul_ps(dsb, xd), accb);
                accb = _mm512_fnmadd_ps(dmb, _mm512_set1_ps(ms[16 * b + 2 * j + 1]), accb);
            }
        }
    }
    _mm512_storeu_ps(out, _mm512_add_ps(acca, accb));
}

static inline void q3_scale_bytes(const uint8_t *blk0, const uint8_t *blk1, __m512i st[4]);
static inline __m512i q3_scale_of(const __m512i st[4], int g);

/* The same for Q3_K (row16_q3): q + 4h of sub-block k at bits 2k .. 2k + 2 of each word (the high bit
 * j moved there by one shift, merged by one vpternlogd), so the sums are 4^k sum((q + 4h) x) (|sum| <=
 * 16 * 448 * 32767 < 2^31); shifted back, less 4 times the group's integer sum of x (s4: tile16's
 * -4 folded in), they are tile16's integers; its float steps per lane as tile16's (no min term). */
static inline __attribute__((always_inline)) void row16_q3(const uint8_t *g0, const uint8_t *g1, int64_t nb,
                                                           const act_block16 *xa, const int16_t *xp, const int32_t *s4,
                                                           float *out, int64_t ahead) {
    const int gbb = 8 * 110;
    __m512 acca = _mm512_setzero_ps(), accb = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk0 = g0 + b * gbb, *blk1 = g1 + b * gbb;
        prefetch_pair_at(blk0, blk1, gbb, ahead);
        const __m512 d = halves_pair(blk0, blk1);
        __m512i st[4];
        q3_scale_bytes(blk0, blk1, st);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m512i v[8], o[8];
            for (int c = 0; c < 8; c++) {
                v[c] = two_chunks(blk0, blk1, Q3_QS + 32 * (8 * h + c));
                o[c] = _mm512_srli_epi16(v[c], 8);
            }
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const int j = 4 * h + k, se = 2 * k + 2 - j; /* bit j of a word's low byte to 2k + 2 */
                const __m512i mk = _mm512_set1_epi16((short)(3 << (2 * k))), hbit = _mm512_set1_epi16((short)(1 << (2 * k + 2)));
                const int16_t *x = xp + 32 * (8 * b + j);
                __m512i isa = _mm512_setzero_si512(), isb = _mm512_setzero_si512();
                for (int c = 0; c < 8; c++) {
                    const __m512i hm = two_chunks(blk0, blk1, Q3_HM + 32 * c);
                    const __m512i he = se > 0 ? _mm512_slli_epi16(hm, se) : se < 0 ? _mm512_srli_epi16(hm, -se) : hm;
                    const __m512i ho = _mm512_srli_epi16(hm, 8 - se); /* the high byte's bit j */
                    const __m512i e = _mm512_ternarylogic_epi32(_mm512_and_si512(v[c], mk), he, hbit, 0xF8);
                    const __m512i od = _mm512_ternarylogic_epi32(_mm512_and_si512(o[c], mk), ho, hbit, 0xF8);
                    if (c < 4) {
                        isa = dpw_pair(isa, e, x + 4 * c);
                        isa = dpw_pair(isa, od, x + 4 * c + 2);
                    } else {
                        isb = dpw_pair(isb, e, x + 4 * c);
                        isb = dpw_pair(isb, od, x + 4 * c + 2);
                    }
                }
                isa = _mm512_sub_epi32(_mm512_srai_epi32(isa, 2 * k), _mm512_set1_epi32(s4[16 * b + 2 * j]));
                isb = _mm512_sub_epi32(_mm512_srai_epi32(isb, 2 * k), _mm512_set1_epi32(s4[16 * b + 2 * j + 1]));
                const __m512 xd = _mm512_set1_ps(xa[8 * b + j].d);
                const __m512 dsa = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q3_scale_of(st, 2 * j)));
                const __m512 dsb = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q3_scale_of(st, 2 * j + 1)));
                acca = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isa), _mm512_mul_ps(dsa, xd), acca);
                accb = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isb), _mm512_mul_ps(dsb, xd), accb);
            }
        }
    }
    _mm512_storeu_ps(out, _mm512_add_ps(acca, accb));
}

#else /* AVX2: one group a ymm */
/* out[r * ldo + s] = dot(row s of the group at g, activation row r), s < 8, r < R; ms[r][2i + h]:
 * row r's 16-value sums of sub-block i at its step (Q2_K's min terms). */
static inline __attribute__((always_inline)) void tile16(const uint8_t *g, int64_t nb, const act_block16 *const *xa,
                                                         const float *const *ms, float *out, int64_t ldo,
                                                         const int type, const int R) {
    const int gbb = 8 * bb_of(type);
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7); /* hadd's rows; its own inverse */
    __m256 acc[XR];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * gbb;
        for (int at = 0; at < gbb; at += 64) prefetch_weights(blk + K23X8_PF + at);
        const __m256 d = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk)), order);
        const __m256 dmin = type == QTYPE_Q2_K
                                ? _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))), order)
                                : _mm256_setzero_ps();
        for (int j = 0; j < 8; j++)
            for (int h = 0; h < 2; h++) { /* group 2j + h */
                __m256i sa[XR], sb[XR], mv;
                for (int r = 0; r < R; r++) sa[r] = sb[r] = _mm256_setzero_si256();
                const __m256i sc = group_scales(blk, 2 * j + h, type, &mv);
                for (int c = 0; c < 4; c++) {
                    __m256i u = chunk_u(blk, j, 4 * h + c, type);
                    if (type == QTYPE_Q3_K) u = _mm256_sub_epi8(u, _mm256_set1_epi8(4));
                    const __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(u));
                    const __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(u, 1));
                    for (int r = 0; r < R; r++) {
                        const __m256i xp = pairs2(xa[r][8 * b + j].q + 16 * h + 4 * c);
                        sa[r] = DPW8(sa[r], lo, xp);
                        sb[r] = DPW8(sb[r], hi, xp);
                    }
                }
                const __m256 dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(sc, order)));
                const __m256 dm = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(mv, order)));
                for (int r = 0; r < R; r++) {
                    const __m256 f = _mm256_cvtepi32_ps(_mm256_hadd_epi32(sa[r], sb[r]));
                    acc[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(dsc, _mm256_set1_ps(xa[r][8 * b + j].d)), acc[r]);
                    if (type == QTYPE_Q2_K)
                        acc[r] = _mm256_fnmadd_ps(dm, _mm256_set1_ps(ms[r][16 * b + 2 * j + h]), acc[r]);
                }
            }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * ldo, _mm256_permutevar8x32_ps(acc[r], order));
}

#endif

/* One activation row on Q2_K, 16 bits, one group's 8 rows a ymm (AVX2; the zmm builds' last group of
 * an odd count): row16_q2's integers; CHAINS 1: one float chain a row, groups in turn (the ymm
 * tile16's order), 2: even and odd groups apart, added at the end (the zmm tile16's). */
static inline __attribute__((always_inline)) void row16_q2_y(const uint8_t *g, int64_t nb, const act_block16 *xa,
                                                             const int16_t *xp, const float *ms, float *out,
                                                             int64_t ahead, const int CHAINS) {
    const int gbb = 8 * 84;
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256i byte_of[4];
    for (int i = 0; i < 4; i++)
        byte_of[i] = _mm256_add_epi32(_mm256_set1_epi32((int)(0x80808000u | (uint32_t)i)),
                                      _mm256_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12));
    __m256 acca = _mm256_setzero_ps(), accb = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * gbb;
        for (int at = 0; at < gbb; at += 64) prefetch_weights(blk + ahead + at);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const int k = j % 4;
            const __m256i mk = _mm256_set1_epi16((short)(3 << (2 * k)));
            const int16_t *x = xp + 32 * (8 * b + j);
            const uint8_t *qs = blk + Q2_QS + 32 * 8 * (j / 4);
            __m256i isa = _mm256_setzero_si256(), isb = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                const __m256i va = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                const __m256i vb = _mm256_loadu_si256((const __m256i *)(qs + 32 * (4 + c)));
                isa = DPW8(isa, _mm256_and_si256(va, mk), _mm256_set1_epi32(*(const i32_any *)(x + 4 * c)));
                isa = DPW8(isa, _mm256_and_si256(_mm256_srli_epi16(va, 8), mk),
                           _mm256_set1_epi32(*(const i32_any *)(x + 4 * c + 2)));
                isb = DPW8(isb, _mm256_and_si256(vb, mk), _mm256_set1_epi32(*(const i32_any *)(x + 16 + 4 * c)));
                isb = DPW8(isb, _mm256_and_si256(_mm256_srli_epi16(vb, 8), mk),
                           _mm256_set1_epi32(*(const i32_any *)(x + 16 + 4 * c + 2)));
            }
            isa = _mm256_srai_epi32(isa, 2 * k);
            isb = _mm256_srai_epi32(isb, 2 * k);
            const __m256i sw = _mm256_loadu_si256((const __m256i *)(blk + Q2_SC + 32 * (j / 2)));
            const __m256i sl = _mm256_and_si256(sw, m4), sh = _mm256_and_si256(_mm256_srli_epi32(sw, 4), m4);
            const __m256i pa = byte_of[2 * (j % 2)], pb = byte_of[2 * (j % 2) + 1];
            const __m256 xd = _mm256_set1_ps(xa[8 * b + j].d);
            const __m256 dsa = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(sl, pa)));
            const __m256 dsb = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(sl, pb)));
            const __m256 dma = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(sh, pa)));
            const __m256 dmb = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(sh, pb)));
            acca = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isa), _mm256_mul_ps(dsa, xd), acca);
            acca = _mm256_fnmadd_ps(dma, _mm256_set1_ps(ms[16 * b + 2 * j]), acca);
            if (CHAINS == 1) {
                acca = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isb), _mm256_mul_ps(dsb, xd), acca);
                acca = _mm256_fnmadd_ps(dmb, _mm256_set1_ps(ms[16 * b + 2 * j + 1]), acca);
            } else {
                accb = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isb), _mm256_mul_ps(dsb, xd), accb);
                accb = _mm256_fnmadd_ps(dmb, _mm256_set1_ps(ms[16 * b + 2 * j + 1]), accb);
            }
        }
    }
    _mm256_storeu_ps(out, CHAINS == 1 ? acca : _mm256_add_ps(acca, accb));
}

/* The row's 16-value sums at its step (ms, nb * 16 floats: tile16_loop's), 4 times its integer sums (s4:
 * Q3_K's -4 terms) and its values with each four in the order row16 reads them (x0, x2, x1, x3). */
static void row16_prep(const act_block16 *xa, int64_t nb, int16_t *xp, float *ms, int32_t *s4) {
    const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15, 0, 1, 4, 5, 2, 3, 6, 7,
                                           8, 9, 12, 13, 10, 11, 14, 15);
    for (int64_t i = 0; i < nb * 8; i += 2) { /* two activation blocks: groups 2i .. 2i + 3 */
        __m256i s[4];
        for (int t = 0; t < 2; t++)
            for (int h = 0; h < 2; h++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(xa[i + t].q + 16 * h));
                _mm256_storeu_si256((__m256i *)(xp + 32 * (i + t) + 16 * h), _mm256_shuffle_epi8(q, order));
                s[2 * t + h] = _mm256_madd_epi16(q, _mm256_set1_epi16(1)); /* exact: any order sums alike */
            }
        const __m256i h4 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
        const __m128i g4 = _mm_add_epi32(_mm256_castsi256_si128(h4), _mm256_extracti128_si256(h4, 1));
        const __m128 dd = _mm_setr_ps(xa[i].d, xa[i].d, xa[i + 1].d, xa[i + 1].d);
        _mm_storeu_ps(ms + 2 * i, _mm_mul_ps(dd, _mm_cvtepi32_ps(g4)));
        _mm_storeu_si128((__m128i *)(s4 + 2 * i), _mm_slli_epi32(g4, 2));
    }
}

/* One activation row on Q2_K or Q3_K: its sums and pairs once, then every group: two a zmm where the
 * build has them, else (and Q2_K's odd last one) one a ymm; Q3_K's odd last one tile16's. */
static void row16_loop(const uint8_t *w, int64_t wrb, int64_t nc, const act_block16 *xa, int64_t nb, float *out,
                       const int type) {
    int16_t xp[nb * 256];
    float ms[nb * 16];
    int32_t s4[nb * 16];
    row16_prep(xa, nb, xp, ms, s4);
    int64_t c0 = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (type == QTYPE_Q3_K) {
        for (; c0 + 16 <= nc; c0 += 16) row16_q3(w + c0 * wrb, w + (c0 + 8) * wrb, nb, xa, xp, s4, out + c0, ROW16_AHEAD);
        if (c0 < nc) {
            const float *no_ms[1] = {ms};
            tile16(w + c0 * wrb, nb, &xa, no_ms, out + c0, 0, QTYPE_Q3_K, 1);
        }
        return;
    }
    for (; c0 + 16 <= nc; c0 += 16) row16_q2(w + c0 * wrb, w + (c0 + 8) * wrb, nb, xa, xp, ms, out + c0, ROW16_AHEAD);
    if (c0 < nc) row16_q2_y(w + c0 * wrb, nb, xa, xp, ms, out + c0, ROW16_AHEAD, 2);
#else
    (void)type;
    for (; c0 < nc; c0 += 8) row16_q2_y(w + c0 * wrb, nb, xa, xp, ms, out + c0, ROW16_AHEAD, 1);
#endif
}

/* Every group (8 weight rows) against every activation row, XR rows at a time. */
static inline __attribute__((always_inline)) void tile16_loop(const uint8_t *w, int64_t wrb, int64_t nc,
                                                              const uint8_t *xq, int64_t xrb, int64_t nr,
                                                              int64_t nb, float *out, int64_t ldo, const int type) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    /* Q3_K's form on zmm only, from 16 columns (a panel of 8, as at k = 8192, runs tile16: a ymm form
     * with the row's sums made per call ran 1.3x tile16's time) */
    const int row16 = type == QTYPE_Q2_K ? k23_row16 : k23_row16_q3 && nc >= 16;
#else
    const int row16 = type == QTYPE_Q2_K && k23_row16;
#endif
    if (nr == 1 && row16) {
        row16_loop(w, wrb, nc, (const act_block16 *)xq, nb, out, type);
        return;
    }
    float sums[XR][type == QTYPE_Q2_K ? nb * 16 : 1];
    for (int64_t r0 = 0; r0 < nr; r0 += XR) {
        const int64_t rows = nr - r0 < XR ? nr - r0 : XR;
        const act_block16 *xa[XR];
        const float *ms[XR];
        for (int r = 0; r < XR; r++) {
            xa[r] = (const act_block16 *)(xq + (r0 + (r < rows ? r : rows - 1)) * xrb);
            ms[r] = sums[r];
            for (int64_t i = 0; i < nb * 16 && type == QTYPE_Q2_K; i++) {
                const int16_t *q = xa[r][i / 2].q + 16 * (i % 2);
                int32_t s = 0;
                for (int t = 0; t < 16; t++) s += q[t];
                sums[r][i] = xa[r][i / 2].d * (float)s;
            }
        }
        for (int64_t c0 = 0; c0 < nc; c0 += 8) {
            const uint8_t *g = w + c0 * wrb;
            float *o = out + r0 * ldo + c0;
            switch (rows) {
            case 1: tile16(g, nb, xa, ms, o, ldo, type, 1); break;
#if XR > 2
            case 2: tile16(g, nb, xa, ms, o, ldo, type, 2); break;
            case 3: tile16(g, nb, xa, ms, o, ldo, type, 3); break;
#endif
            default: tile16(g, nb, xa, ms, o, ldo, type, XR); break;
            }
        }
    }
}
#define TILE16_LOOP(TYPE) tile16_loop(w, wrb, nc, xq, xrb, nr, nb, out, ldo, TYPE)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* The 8-bit tile on zmm: two groups side by side (16 weight rows: g0's in lanes 0-7, g1's in 8-15),
 * up to 8 activation rows; each lane runs the ymm tile's integer sums and float steps. */
#undef XR8
#define XR8 8

static inline __m512i two256(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
static inline __m512 two256f(__m256 a, __m256 b) { return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1); }
static inline __m512i chunk_pair(const uint8_t *blk0, const uint8_t *blk1, int at) { /* 32 bytes at at of each */
    return two256(_mm256_loadu_si256((const __m256i *)(blk0 + at)), _mm256_loadu_si256((const __m256i *)(blk1 + at)));
}

/* acc + the products of u's bytes (unsigned) and q[0..3] (signed) in every lane, summed by 4. */
static inline __m512i dpb16(__m512i acc, __m512i u, const int8_t *q) {
#if defined(__AVX512VNNI__) /* the broadcast as vpdpbusd's {1to16} operand (gcc does not fold it) */
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const i32_any *)q));
    return acc;
#else
    const __m512i p = _mm512_maddubs_epi16(u, _mm512_set1_epi32(*(const i32_any *)q));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
#endif
}

/* v in every lane, made in a register: gcc would fold it into the multiply as a {1to16} operand,
 * which costs the multiply's pipes more than a broadcast load (q3_sliced 1.05-1.10x faster with it
 * apart; tile8, 8 rows at most, no faster, so it keeps the folded form). */
static inline __m512 bcast_ps(float v) {
    __m512 b = _mm512_set1_ps(v);
    __asm__("" : "+v"(b));
    return b;
}

#define K23_PASS16(FIELD)                                                                                          \
    for (int r = 0; r < R; r++) {                                                                                 \
        const act_block8 *x = xa[r] + b;                                                                           \
        __m512i isa = type == QTYPE_Q3_K ? _mm512_set1_epi32(x->FIELD##off[2 * j] / 8) : _mm512_setzero_si512();  \
        __m512i isb = type == QTYPE_Q3_K ? _mm512_set1_epi32(x->FIELD##off[2 * j + 1] / 8) : _mm512_setzero_si512(); \
        for (int c = 0; c < 4; c++) {                                                                              \
            isa = dpb16(isa, u[c], x->FIELD + 32 * j + 4 * c);                                                     \
            isb = dpb16(isb, u[4 + c], x->FIELD + 32 * j + 16 + 4 * c);                                            \
        }                                                                                                          \
        I[r] = _mm512_add_epi32(_mm512_mullo_epi32(isa, sca), _mm512_mullo_epi32(isb, scb));                       \
        if (type == QTYPE_Q2_K)                                                                                    \
            M[r] = _mm512_add_epi32(_mm512_mullo_epi32(ma, _mm512_set1_epi32(-x->FIELD##off[2 * j] / 32)),         \
                                    _mm512_mullo_epi32(mb, _mm512_set1_epi32(-x->FIELD##off[2 * j + 1] / 32)));    \
    }

#define K23_TERM16(STEP)                                                                                           \
    for (int r = 0; r < R; r++) {                                                                                 \
        const float step = (STEP);                                                                                 \
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[r]), _mm512_mul_ps(d, _mm512_set1_ps(step)), acc[r]);         \
        if (type == QTYPE_Q2_K)                                                                                    \
            acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(M[r]), _mm512_mul_ps(dmin, _mm512_set1_ps(step)), acc[r]); \
    }

/* Q3_K's 16 group scales of both groups as bytes (group g at byte g % 4 of st[g / 4], 0..63), and
 * group g's as int32 lanes minus 32 (vpshufb: byte g % 4 of each word, zero-extended). */
static inline void q3_scale_bytes(const uint8_t *blk0, const uint8_t *blk1, __m512i st[4]) {
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    const __m512i l0 = two256(_mm256_loadu_si256((const __m256i *)(blk0 + Q3_SC)),
                              _mm256_loadu_si256((const __m256i *)(blk1 + Q3_SC)));
    const __m512i l1 = two256(_mm256_loadu_si256((const __m256i *)(blk0 + Q3_SC + 32)),
                              _mm256_loadu_si256((const __m256i *)(blk1 + Q3_SC + 32)));
    const __m512i hw = two256(_mm256_loadu_si256((const __m256i *)(blk0 + Q3_SC + 64)),
                              _mm256_loadu_si256((const __m256i *)(blk1 + Q3_SC + 64)));
    st[0] = _mm512_ternarylogic_epi32(_mm512_and_si512(l0, m4), _mm512_slli_epi16(hw, 4), m30, 0xF8);
    st[1] = _mm512_ternarylogic_epi32(_mm512_and_si512(l1, m4), _mm512_slli_epi16(hw, 2), m30, 0xF8);
    st[2] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4), hw, m30, 0xF8);
    st[3] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4), _mm512_srli_epi16(hw, 2), m30, 0xF8);
}
static inline __m512i q3_scale_of(const __m512i st[4], int g) {
    const __m512i pick = _mm512_add_epi32(_mm512_set1_epi32((int)(0x80808000u | (uint32_t)(g % 4))),
                                          _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12));
    return _mm512_sub_epi32(_mm512_shuffle_epi8(st[g / 4], pick), _mm512_set1_epi32(32));
}

/* out[r * ldo + j] = dot(tile row j, activation row r) for j < width (16, or 8: g1 is g0 again and
 * only its lanes are stored), r < R. */
static inline __attribute__((always_inline)) void tile8(const uint8_t *g0, const uint8_t *g1, int width, int64_t nb,
                                                        const act_block8 *const *xa, float *out, int64_t ldo,
                                                        const int type, const int R) {
    const int gbb = 8 * bb_of(type);
    __m512 acc[XR8];
    __m512i I[XR8], M[XR8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk0 = g0 + b * gbb, *blk1 = g1 + b * gbb;
        for (int at = 0; at < gbb; at += 64) {
            _mm_prefetch((const char *)(blk0 + K23X8_PF + at), _MM_HINT_T0);
            _mm_prefetch((const char *)(blk1 + K23X8_PF + at), _MM_HINT_T0);
        }
        const __m512 d = two256f(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk0)),
                                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk1)));
        const __m512 dmin = type == QTYPE_Q2_K ? two256f(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk0 + 16))),
                                                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk1 + 16))))
                                               : _mm512_setzero_ps();
        int two = 0;
        for (int r = 0; r < R; r++) two |= xa[r][b].two;
        __m512i st[4];
        if (type == QTYPE_Q3_K) q3_scale_bytes(blk0, blk1, st);
        for (int j = 0; j < 8; j++) {
            __m256i m0, m1;
            __m512i sca, ma, scb, mb;
            if (type == QTYPE_Q3_K) {
                sca = q3_scale_of(st, 2 * j), scb = q3_scale_of(st, 2 * j + 1);
                ma = mb = _mm512_setzero_si512();
            } else {
                sca = two256(group_scales(blk0, 2 * j, type, &m0), group_scales(blk1, 2 * j, type, &m1));
                ma = two256(m0, m1);
                scb = two256(group_scales(blk0, 2 * j + 1, type, &m0), group_scales(blk1, 2 * j + 1, type, &m1));
                mb = two256(m0, m1);
            }
            __m512i u[8];
            for (int c = 0; c < 8; c++) u[c] = chunk_u2(blk0, c, blk1, c, j, type);
            K23_PASS16(q)
            K23_TERM16(xa[r][b].d[j])
            if ((two >> j) & 1) {
                K23_PASS16(r)
                K23_TERM16(xa[r][b].d[j] * (1.0f / 128.0f))
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out + r * ldo, _mm512_castps512_ps256(acc[r]));
        if (width == 16) _mm256_storeu_ps(out + r * ldo + 8, _mm512_extractf32x8_ps(acc[r], 1));
    }
}

/* One activation row (decode) on Q2_K: each quant zmm (a chunk of both groups) is loaded once per
 * block and its four sub-blocks' bits masked where they lie, so a sub-block k of four meets the
 * activations at 4^k its weights (vpdpbusd takes up to 192; maddubs' int16 pair sums up to 48, so
 * without VNNI the top bits are shifted down). Integers times a power of two convert to the same
 * float times it, and d times 4^-k times the step is d times the step times 4^-k: the same float steps
 * as tile8's, so the same bits. */
#if defined(__AVX512VNNI__)
#define K23_KEEP 3 /* sub-blocks 0..K23_KEEP keep their bits in place */
#else
#define K23_KEEP 2
#endif

static inline __m512i bits_at(__m512i v, int k) {
    if (k <= K23_KEEP) return _mm512_and_si512(v, _mm512_set1_epi8((char)(3 << (2 * k))));
    return _mm512_and_si512(_mm512_srli_epi16(v, 2 * k), _mm512_set1_epi8(3));
}

/* One pass (FIELD: q's or r's) of sub-block j = 4 h + k against the 8 quant zmm of half h in v. */
#define Q2_ROW1_PASS(FIELD, STEP)                                                                                  \
    {                                                                                                              \
        __m512i isa = _mm512_setzero_si512(), isb = _mm512_setzero_si512();                                       \
        for (int c = 0; c < 4; c++) {                                                                              \
            isa = dpb16(isa, bits_at(v[c], k), x->FIELD + 32 * j + 4 * c);                                         \
            isb = dpb16(isb, bits_at(v[4 + c], k), x->FIELD + 32 * j + 16 + 4 * c);                                \
        }                                                                                                          \
        const __m512i I = _mm512_add_epi32(_mm512_mullo_epi32(isa, sca), _mm512_mullo_epi32(isb, scb));           \
        const __m512i M = _mm512_add_epi32(_mm512_mullo_epi32(ma, _mm512_set1_epi32(-x->FIELD##off[2 * j] / 32)),  \
                                           _mm512_mullo_epi32(mb, _mm512_set1_epi32(-x->FIELD##off[2 * j + 1] / 32))); \
        const float step = (STEP);                                                                                 \
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(dk[k], _mm512_set1_ps(step)), acc);             \
        acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(M), _mm512_mul_ps(dmin, _mm512_set1_ps(step)), acc);             \
    }

/* vpshufb's picks for the one-row forms: byte i of each word, zero-extended to its word. */
static inline __attribute__((always_inline)) void byte_picks(__m512i byte_of[4]) {
    for (int i = 0; i < 4; i++)
        byte_of[i] = _mm512_add_epi32(_mm512_set1_epi32((int)(0x80808000u | (uint32_t)i)),
                                      _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12));
}

/* Both 8-row groups' block, K23X8_PF bytes ahead. */
static inline __attribute__((always_inline)) void prefetch_pair(const uint8_t *blk0, const uint8_t *blk1, int gbb) {
    for (int at = 0; at < gbb; at += 64) {
        _mm_prefetch((const char *)(blk0 + K23X8_PF + at), _MM_HINT_T0);
        _mm_prefetch((const char *)(blk1 + K23X8_PF + at), _MM_HINT_T0);
    }
}

/* The 8 halves at byte ``at`` of each group's block, as 16 floats (group 0's rows first). */
static inline __attribute__((always_inline)) __m512 halves_at(const uint8_t *blk0, const uint8_t *blk1, int at) {
    return two256f(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk0 + at))),
                   _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk1 + at))));
}

static inline __attribute__((always_inline)) void row1_q2(const uint8_t *g0, const uint8_t *g1, int width, int64_t nb,
                                                          const act_block8 *xa, float *out) {
    const int gbb = 8 * 84;
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512i byte_of[4];
    byte_picks(byte_of);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk0 = g0 + b * gbb, *blk1 = g1 + b * gbb;
        prefetch_pair(blk0, blk1, gbb);
        const act_block8 *x = xa + b;
        const __m512 d = halves_at(blk0, blk1, 0);
        const __m512 dmin = halves_at(blk0, blk1, 16);
        __m512 dk[4];
        for (int k = 0; k < 4; k++) dk[k] = k <= K23_KEEP ? _mm512_mul_ps(d, _mm512_set1_ps(1.0f / (float)(1 << (2 * k)))) : d;
        /* the 16 groups' scales (low nibbles) and mins (high) of both groups, byte g % 4 of word g / 4 */
        __m512i sl[4], sh[4];
        for (int t = 0; t < 4; t++) {
            const __m512i sw = two256(_mm256_loadu_si256((const __m256i *)(blk0 + Q2_SC + 32 * t)),
                                      _mm256_loadu_si256((const __m256i *)(blk1 + Q2_SC + 32 * t)));
            sl[t] = _mm512_and_si512(sw, m4);
            sh[t] = _mm512_and_si512(_mm512_srli_epi32(sw, 4), m4);
        }
        for (int h = 0; h < 2; h++) {
            __m512i v[8];
            for (int c = 0; c < 8; c++)
                v[c] = two256(_mm256_loadu_si256((const __m256i *)(blk0 + Q2_QS + 32 * (8 * h + c))),
                              _mm256_loadu_si256((const __m256i *)(blk1 + Q2_QS + 32 * (8 * h + c))));
            for (int k = 0; k < 4; k++) {
                const int j = 4 * h + k;
                const __m512i pa = byte_of[2 * (j % 2)], pb = byte_of[2 * (j % 2) + 1];
                const __m512i sca = _mm512_shuffle_epi8(sl[j / 2], pa), ma = _mm512_shuffle_epi8(sh[j / 2], pa);
                const __m512i scb = _mm512_shuffle_epi8(sl[j / 2], pb), mb = _mm512_shuffle_epi8(sh[j / 2], pb);
                Q2_ROW1_PASS(q, x->d[j])
                if ((x->two >> j) & 1) Q2_ROW1_PASS(r, x->d[j] * (1.0f / 128.0f))
            }
        }
    }
    _mm256_storeu_ps(out, _mm512_castps512_ps256(acc));
    if (width == 16) _mm256_storeu_ps(out + 8, _mm512_extractf32x8_ps(acc, 1));
}

/* The same for Q3_K: sub-block k of four keeps its 2 bits in place up to k = 2, the fourth shifted
 * to the third's place (4^min(k, 2) its weights), and the high bit j moved beside them; at most
 * 7 * 16 = 112 (maddubs' pair sums take it). The offset -4 sum(x) starts the sums at the same power. */
static inline __m512i q3_bits_at(__m512i v, __m512i hm, int h, int k) {
    const int e = k < 2 ? k : 2, at = 2 * e + 2, s = at - (4 * h + k); /* hm's bit j to bit at */
    const __m512i a = k < 3 ? v : _mm512_srli_epi16(v, 2);
    const __m512i hb = s > 0 ? _mm512_slli_epi16(hm, s) : s < 0 ? _mm512_srli_epi16(hm, -s) : hm;
    return _mm512_ternarylogic_epi32(_mm512_and_si512(a, _mm512_set1_epi8((char)(3 << (2 * e)))), hb,
                                     _mm512_set1_epi8((char)(1 << at)), 0xF8); /* a | (hb & bit) */
}

#define Q3_ROW1_PASS(FIELD, STEP)                                                                                  \
    {                                                                                                              \
        const int e = k < 2 ? k : 2;                                                                               \
        __m512i isa = _mm512_set1_epi32((x->FIELD##off[2 * j] / 8) * (1 << (2 * e)));                                   \
        __m512i isb = _mm512_set1_epi32((x->FIELD##off[2 * j + 1] / 8) * (1 << (2 * e)));                               \
        for (int c = 0; c < 4; c++) {                                                                              \
            isa = dpb16(isa, u[c], x->FIELD + 32 * j + 4 * c);                                                     \
            isb = dpb16(isb, u[4 + c], x->FIELD + 32 * j + 16 + 4 * c);                                            \
        }                                                                                                          \
        const __m512i I = _mm512_add_epi32(_mm512_mullo_epi32(isa, sca), _mm512_mullo_epi32(isb, scb));           \
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(dk[e], _mm512_set1_ps(STEP)), acc);             \
    }

static inline __attribute__((always_inline)) void row1_q3(const uint8_t *g0, const uint8_t *g1, int width, int64_t nb,
                                                          const act_block8 *xa, float *out) {
    const int gbb = 8 * 110;
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30), s32 = _mm512_set1_epi32(32);
    __m512i byte_of[4];
    byte_picks(byte_of);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk0 = g0 + b * gbb, *blk1 = g1 + b * gbb;
        prefetch_pair(blk0, blk1, gbb);
        const act_block8 *x = xa + b;
        const __m512 d = halves_at(blk0, blk1, 0);
        const __m512 dk[3] = {d, _mm512_mul_ps(d, _mm512_set1_ps(0.25f)), _mm512_mul_ps(d, _mm512_set1_ps(0.0625f))};
        /* the 16 groups' 6-bit scales as bytes: group g at byte g % 4 of st[g / 4] */
        const __m512i l0 = two256(_mm256_loadu_si256((const __m256i *)(blk0 + Q3_SC)),
                                  _mm256_loadu_si256((const __m256i *)(blk1 + Q3_SC)));
        const __m512i l1 = two256(_mm256_loadu_si256((const __m256i *)(blk0 + Q3_SC + 32)),
                                  _mm256_loadu_si256((const __m256i *)(blk1 + Q3_SC + 32)));
        const __m512i hw = two256(_mm256_loadu_si256((const __m256i *)(blk0 + Q3_SC + 64)),
                                  _mm256_loadu_si256((const __m256i *)(blk1 + Q3_SC + 64)));
        const __m512i st[4] = {
            _mm512_ternarylogic_epi32(_mm512_and_si512(l0, m4), _mm512_slli_epi16(hw, 4), m30, 0xF8),
            _mm512_ternarylogic_epi32(_mm512_and_si512(l1, m4), _mm512_slli_epi16(hw, 2), m30, 0xF8),
            _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4), hw, m30, 0xF8),
            _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4), _mm512_srli_epi16(hw, 2), m30,
                                      0xF8)};
        __m512i hm[8];
        for (int c = 0; c < 8; c++)
            hm[c] = two256(_mm256_loadu_si256((const __m256i *)(blk0 + Q3_HM + 32 * c)),
                           _mm256_loadu_si256((const __m256i *)(blk1 + Q3_HM + 32 * c)));
        for (int h = 0; h < 2; h++) {
            __m512i v[8];
            for (int c = 0; c < 8; c++)
                v[c] = two256(_mm256_loadu_si256((const __m256i *)(blk0 + Q3_QS + 32 * (8 * h + c))),
                              _mm256_loadu_si256((const __m256i *)(blk1 + Q3_QS + 32 * (8 * h + c))));
            for (int k = 0; k < 4; k++) {
                const int j = 4 * h + k;
                const __m512i sca = _mm512_sub_epi32(_mm512_shuffle_epi8(st[j / 2], byte_of[2 * (j % 2)]), s32);
                const __m512i scb = _mm512_sub_epi32(_mm512_shuffle_epi8(st[j / 2], byte_of[2 * (j % 2) + 1]), s32);
                __m512i u[8];
                for (int c = 0; c < 8; c++) u[c] = q3_bits_at(v[c], hm[c], h, k);
                Q3_ROW1_PASS(q, x->d[j])
                if ((x->two >> j) & 1) Q3_ROW1_PASS(r, x->d[j] * (1.0f / 128.0f))
            }
        }
    }
    _mm256_storeu_ps(out, _mm512_castps512_ps256(acc));
    if (width == 16) _mm256_storeu_ps(out + 8, _mm512_extractf32x8_ps(acc, 1));
}

/* Q3_K on many rows, a slice of blocks unpacked once for every row group (tile8 assembles each
 * chunk again per group of 8 rows): per block and sub-block j, its 8 chunks as 8 (q + 4h) (bits
 * 3-5), then its two groups' s - 32, all 16 rows; the block's d / 8 last. The weights at 8 times
 * let a pass start its sums from the activation's qoff itself (-32 sum(x) = 8 times -4 sum(x)), no
 * division per row: the integers are 8 times tile8's (|8 I| < 2^22, exact in float), and d / 8
 * times the step is d times the step over 8, so each product, and the sums, are tile8's bits.
 * maddubs' int16 pair sums: 2 * 56 * 127, below saturation. */
#define K23_SLICE 4 /* blocks a slice (K23_SLICE * Q3U zmm, 20 KB, stays in L1 across the row groups) */
#define Q3U 81      /* zmm per unpacked Q3_K block: per sub-block 8 chunks and 2 scales; d / 8 */
int k23_sliced = 1; /* 0: Q3_K's many rows take tile8 per row group (bench.worker_step --toggle k23_sliced) */
#define K23_SLICED_ROWS 8
#ifndef Q3S_ROWS
#define Q3S_ROWS 6 /* activation rows per sliced tile at most */
#endif /* from more rows than these: sliced (fewer: one row group, nothing to share) */

/* Blocks [b0, b0 + nb) of the Q3_K groups at g0 and g1 (tile rows 0-7, 8-15) unpacked to u. */
__attribute__((noinline)) static void q3_unpack8(const uint8_t *g0, const uint8_t *g1, int64_t b0, int64_t nb,
                                                 __m512i *u) {
    const int gbb = 8 * 110;
    const __m512i m18 = _mm512_set1_epi8(0x18), m20 = _mm512_set1_epi8(0x20);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk0 = g0 + (b0 + b) * gbb, *blk1 = g1 + (b0 + b) * gbb;
        prefetch_pair(blk0, blk1, gbb);
        __m512i *p = u + b * Q3U, st[4], hm[8];
        q3_scale_bytes(blk0, blk1, st);
        for (int c = 0; c < 8; c++) hm[c] = chunk_pair(blk0, blk1, Q3_HM + 32 * c);
        for (int h = 0; h < 2; h++) {
            __m512i v[8];
            for (int c = 0; c < 8; c++) v[c] = chunk_pair(blk0, blk1, Q3_QS + 32 * (8 * h + c));
            for (int k = 0; k < 4; k++) {
                const int j = 4 * h + k, sq = 3 - 2 * k, sh = 5 - j; /* q's bits to 3-4, h's bit j to 5 */
                for (int c = 0; c < 8; c++) {
                    const __m512i q = sq > 0 ? _mm512_slli_epi16(v[c], sq) : _mm512_srli_epi16(v[c], -sq);
                    const __m512i hb = sh > 0 ? _mm512_slli_epi16(hm[c], sh) : sh < 0 ? _mm512_srli_epi16(hm[c], -sh) : hm[c];
                    _mm512_store_si512(p + 10 * j + c, _mm512_ternarylogic_epi32(_mm512_and_si512(q, m18), hb, m20, 0xF8));
                }
                _mm512_store_si512(p + 10 * j + 8, q3_scale_of(st, 2 * j));
                _mm512_store_si512(p + 10 * j + 9, q3_scale_of(st, 2 * j + 1));
            }
        }
        _mm512_store_ps((float *)(p + 80), _mm512_mul_ps(halves_at(blk0, blk1, 0), _mm512_set1_ps(0.125f)));
    }
}

/* One pass (FIELD: q's or r's) of sub-block j over the unpacked chunks at p: row r's two groups' sums,
 * each starting at its offset, a chunk of both groups at a time over every row (2R chains). */
#define Q3S_PASS(FIELD)                                                                                   \
    for (int r = 0; r < R; r++) {                                                                         \
        isa[r] = _mm512_set1_epi32(x[r]->FIELD##off[2 * j]);                                              \
        isb[r] = _mm512_set1_epi32(x[r]->FIELD##off[2 * j + 1]);                                          \
    }                                                                                                     \
    for (int c = 0; c < 4; c++) {                                                                         \
        const __m512i wa = _mm512_load_si512(p + c), wb = _mm512_load_si512(p + 4 + c);                  \
        for (int r = 0; r < R; r++) {                                                                     \
            isa[r] = dpb16(isa[r], wa, x[r]->FIELD + 32 * j + 4 * c);                                     \
            isb[r] = dpb16(isb[r], wb, x[r]->FIELD + 32 * j + 16 + 4 * c);                                \
        }                                                                                                 \
    }

/* acc[r] += (the sums at their scales) times d / 8 times STEP (row r's), as K23_TERM16. */
#define Q3S_TERM(STEP)                                                                                    \
    for (int r = 0; r < R; r++) {                                                                         \
        const __m512i I = _mm512_add_epi32(_mm512_mullo_epi32(isa[r], sca), _mm512_mullo_epi32(isb[r], scb)); \
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(d8, bcast_ps(STEP)), acc[r]);       \
    }

/* out[r * ldo + j] (r < nr <= R, j < the lanes in keep) = its sums so far (first: none) + the tile's
 * products over the sl unpacked blocks at u; xa[r]: row r's activation blocks of the slice. */
static inline __attribute__((always_inline)) void q3_tile_slice(const __m512i *u, int64_t sl, const act_block8 *const *xa,
                                                                int64_t nr, float *out, int64_t ldo, __mmask16 keep,
                                                                int first, const int R) {
    __m512 acc[XR8];
    __m512i isa[XR8], isb[XR8];
    for (int r = 0; r < R; r++) acc[r] = first || r >= nr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(keep, out + r * ldo);
    for (int64_t b = 0; b < sl; b++) {
        const act_block8 *x[XR8];
        int two = 0;
        for (int r = 0; r < R; r++) {
            x[r] = xa[r] + b;
            two |= x[r]->two;
        }
        const __m512 d8 = _mm512_load_ps((const float *)(u + b * Q3U + 80));
        for (int j = 0; j < 8; j++) {
            const __m512i *p = u + b * Q3U + 10 * j;
            const __m512i sca = _mm512_load_si512(p + 8), scb = _mm512_load_si512(p + 9);
            Q3S_PASS(q)
            Q3S_TERM(x[r]->d[j])
            if ((two >> j) & 1) {
                Q3S_PASS(r)
                Q3S_TERM(x[r]->d[j] * (1.0f / 128.0f))
            }
        }
    }
    for (int r = 0; r < R && r < nr; r++) _mm512_mask_storeu_ps(out + r * ldo, keep, acc[r]);
}

/* Q3_K's weight rows [0, nc) x activation rows [0, nr): each pair of groups a slice at a time, every
 * row group (balanced, at most Q3S_ROWS rows) over the slice, its sums carried in out from slice to slice (the
 * same order as tile8's, so the same bits). */
static void q3_sliced(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr, int64_t nb,
                      float *out, int64_t ldo) {
    __m512i u[K23_SLICE * Q3U];
    const int64_t groups = (nr + Q3S_ROWS - 1) / Q3S_ROWS;
    for (int64_t c0 = 0; c0 < nc; c0 += 16) {
        const int width = nc - c0 >= 16 ? 16 : 8;
        const uint8_t *g0 = w + c0 * wrb, *g1 = width == 16 ? g0 + 8 * wrb : g0;
        const __mmask16 keep = width == 16 ? 0xffff : 0x00ff;
        for (int64_t b0 = 0; b0 < nb; b0 += K23_SLICE) {
            const int64_t sl = nb - b0 < K23_SLICE ? nb - b0 : K23_SLICE;
            q3_unpack8(g0, g1, b0, sl, u);
            for (int64_t ag = 0; ag < groups; ag++) {
                const int64_t r0 = nr * ag / groups, rows = nr * (ag + 1) / groups - r0;
                const act_block8 *xa[XR8];
                for (int r = 0; r < XR8; r++) xa[r] = (const act_block8 *)(xq + (r0 + (r < rows ? r : 0)) * xrb) + b0;
                float *o = out + r0 * ldo + c0;
                switch (rows) {
                case 3: q3_tile_slice(u, sl, xa, rows, o, ldo, keep, b0 == 0, 3); break;
                case 4: q3_tile_slice(u, sl, xa, rows, o, ldo, keep, b0 == 0, 4); break;
                case 5: q3_tile_slice(u, sl, xa, rows, o, ldo, keep, b0 == 0, 5); break;
#if Q3S_ROWS > 6
                case 7: q3_tile_slice(u, sl, xa, rows, o, ldo, keep, b0 == 0, 7); break;
#endif
                default: q3_tile_slice(u, sl, xa, rows, o, ldo, keep, b0 == 0, Q3S_ROWS); break;
                }
            }
        }
    }
}

static inline __attribute__((always_inline)) void tile8_loop(const uint8_t *w, int64_t wrb, int64_t nc,
                                                             const uint8_t *xq, int64_t xrb, int64_t nr, int64_t nb,
                                                             float *out, int64_t ldo, const int type) {
    if (type == QTYPE_Q3_K && nr > K23_SLICED_ROWS && k23_sliced) {
        q3_sliced(w, wrb, nc, xq, xrb, nr, nb, out, ldo);
        return;
    }
    for (int64_t r0 = 0; r0 < nr;) {
        const int64_t left = nr - r0;
        const int R = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const act_block8 *xa[XR8];
        for (int r = 0; r < R; r++) xa[r] = (const act_block8 *)(xq + (r0 + r) * xrb);
        for (int64_t c0 = 0; c0 < nc; c0 += 16) {
            const uint8_t *g0 = w + c0 * wrb;
            const int width = nc - c0 >= 16 ? 16 : 8;
            const uint8_t *g1 = width == 16 ? g0 + 8 * wrb : g0;
            float *o = out + r0 * ldo + c0;
            if (R == 1 && k23_row1) {
                if (type == QTYPE_Q2_K) row1_q2(g0, g1, width, nb, xa[0], o);
                else row1_q3(g0, g1, width, nb, xa[0], o);
                continue;
            }
            switch (R) {
            case 8: tile8(g0, g1, width, nb, xa, o, ldo, type, 8); break;
            case 4: tile8(g0, g1, width, nb, xa, o, ldo, type, 4); break;
            case 2: tile8(g0, g1, width, nb, xa, o, ldo, type, 2); break;
            default: tile8(g0, g1, width, nb, xa, o, ldo, type, 1); break;
            }
        }
        r0 += R;
    }
}

#else /* AVX2: one group a ymm */
/* is + the products of a chunk's unsigned weight bytes u and the activation's 4 bytes at q, summed
 * by 4 per row lane (the maddubs build: one chunk's int16 pair sums, widened at once). */
static inline __m256i dpb(__m256i is, __m256i u, const int8_t *q) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(is, u, _mm256_set1_epi32(*(const i32_any *)q));
#else
    return _mm256_add_epi32(is, _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_set1_epi32(*(const i32_any *)q)),
                                                  _mm256_set1_epi16(1)));
#endif
}

/* One pass (FIELD: q's or r's) of sub-block j: row r's sums of the two groups times their scales
 * into I[r], Q2_K's min sums into M[r]. */
#define K23_PASS(FIELD)                                                                                            \
    for (int r = 0; r < R; r++) {                                                                                 \
        const act_block8 *x = xa[r] + b;                                                                           \
        __m256i isa = type == QTYPE_Q3_K ? _mm256_set1_epi32(x->FIELD##off[2 * j] / 8) : _mm256_setzero_si256();  \
        __m256i isb = type == QTYPE_Q3_K ? _mm256_set1_epi32(x->FIELD##off[2 * j + 1] / 8) : _mm256_setzero_si256(); \
        for (int c = 0; c < 4; c++) {                                                                              \
            isa = dpb(isa, u[c], x->FIELD + 32 * j + 4 * c);                                                       \
            isb = dpb(isb, u[4 + c], x->FIELD + 32 * j + 16 + 4 * c);                                              \
        }                                                                                                          \
        I[r] = _mm256_add_epi32(_mm256_mullo_epi32(isa, sca), _mm256_mullo_epi32(isb, scb));                       \
        if (type == QTYPE_Q2_K)                                                                                    \
            M[r] = _mm256_add_epi32(_mm256_mullo_epi32(ma, _mm256_set1_epi32(-x->FIELD##off[2 * j] / 32)),         \
                                    _mm256_mullo_epi32(mb, _mm256_set1_epi32(-x->FIELD##off[2 * j + 1] / 32)));    \
    }

/* acc[r] += I[r] d STEP - M[r] dmin STEP (STEP row r's). */
#define K23_TERM(STEP)                                                                                             \
    for (int r = 0; r < R; r++) {                                                                                 \
        const float step = (STEP);                                                                                 \
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[r]), _mm256_mul_ps(d, _mm256_set1_ps(step)), acc[r]);         \
        if (type == QTYPE_Q2_K)                                                                                    \
            acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(M[r]), _mm256_mul_ps(dmin, _mm256_set1_ps(step)), acc[r]); \
    }

/* out[r * ldo + s] = dot(row s of the group at g, activation row r), s < 8, r < R (8-bit). */
static inline __attribute__((always_inline)) void tile8(const uint8_t *g, int64_t nb, const act_block8 *const *xa,
                                                        float *out, int64_t ldo, const int type, const int R) {
    const int gbb = 8 * bb_of(type);
    __m256 acc[XR8];
    __m256i I[XR8], M[XR8];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * gbb;
        for (int at = 0; at < gbb; at += 64) _mm_prefetch((const char *)(blk + K23X8_PF + at), _MM_HINT_T0);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 dmin =
            type == QTYPE_Q2_K ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))) : _mm256_setzero_ps();
        int two = 0;
        for (int r = 0; r < R; r++) two |= xa[r][b].two;
        for (int j = 0; j < 8; j++) {
            __m256i ma, mb, u[8];
            const __m256i sca = group_scales(blk, 2 * j, type, &ma), scb = group_scales(blk, 2 * j + 1, type, &mb);
            for (int c = 0; c < 8; c++) u[c] = chunk_u(blk, j, c, type);
            K23_PASS(q)
            K23_TERM(xa[r][b].d[j])
            if ((two >> j) & 1) {
                K23_PASS(r)
                K23_TERM(xa[r][b].d[j] * (1.0f / 128.0f))
            }
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

static inline __attribute__((always_inline)) void tile8_loop(const uint8_t *w, int64_t wrb, int64_t nc,
                                                             const uint8_t *xq, int64_t xrb, int64_t nr, int64_t nb,
                                                             float *out, int64_t ldo, const int type) {
    for (int64_t r0 = 0; r0 < nr;) {
        const int64_t left = nr - r0;
        const int R = left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const act_block8 *xa[XR8];
        for (int r = 0; r < R; r++) xa[r] = (const act_block8 *)(xq + (r0 + r) * xrb);
        for (int64_t c0 = 0; c0 < nc; c0 += 8) {
            const uint8_t *g = w + c0 * wrb;
            float *o = out + r0 * ldo + c0;
            switch (R) {
            case 4: tile8(g, nb, xa, o, ldo, type, 4); break;
            case 2: tile8(g, nb, xa, o, ldo, type, 2); break;
            default: tile8(g, nb, xa, o, ldo, type, 1); break;
            }
        }
        r0 += R;
    }
}
#endif
#define TILE8_LOOP(TYPE) tile8_loop(w, wrb, nc, xq, xrb, nr, nb, out, ldo, TYPE)

#else /* portable */

/* Each row of a group rebuilt in the file's layout, then quant_k23.c's plain tile. */
static inline void tile16_plain(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                                int64_t nb, float *out, int64_t ldo, const int type) {
    const int bb = bb_of(type);
    const qtype_ops *plain_ops = qtype_k23(type);
    uint8_t row[wrb];
    for (int64_t c0 = 0; c0 < nc; c0 += 8)
        for (int s = 0; s < 8; s++) {
            for (int64_t b = 0; b < nb; b++) plain_block(w + c0 * wrb + b * 8 * bb, s, type, row + b * bb);
            plain_ops->tile(row, wrb, 1, xq, xrb, nr, nb, out + c0 + s, ldo);
        }
}
#define TILE16_LOOP(TYPE) tile16_plain(w, wrb, nc, xq, xrb, nr, nb, out, ldo, TYPE)

/* Weight i (< 32) of sub-block j of slot s in the group block at blk, unsigned (Q2_K q, Q3_K q + 4h). */
static inline int32_t weight_u(const uint8_t *blk, int s, int j, int i, const int type) {
    const int c = i / 4;
    const int32_t q = (blk[qs_of(type) + 32 * (8 * (j / 4) + c) + 4 * s + i % 4] >> (2 * (j % 4))) & 3;
    if (type == QTYPE_Q2_K) return q;
    return q | ((blk[Q3_HM + 32 * c + 4 * s + i % 4] >> j) & 1) << 2;
}

/* Group g's integer scale of slot s (Q2_K sc, Q3_K s - 32) and Q2_K's min. */
static inline int32_t scale_of(const uint8_t *blk, int s, int g, const int type, int32_t *m) {
    if (type == QTYPE_Q2_K) {
        const uint8_t byte = blk[Q2_SC + 32 * (g / 4) + 4 * s + g % 4];
        *m = byte >> 4;
        return byte & 15;
    }
    const uint8_t *sc = blk + Q3_SC + 4 * s; /* byte i of the row's 12 at sc + 32 (i / 4) + i % 4 */
    const int lo = (sc[32 * ((g % 8) / 4) + g % 4] >> (4 * (g / 8))) & 15, hi = (sc[64 + g % 4] >> (2 * (g / 4))) & 3;
    *m = 0;
    return (lo | hi << 4) - 32;
}

/* The 8-bit tiles' integers and float steps, plain C. */
static inline void tile8_plain(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                               int64_t nb, float *out, int64_t ldo, const int type) {
    const int gbb = 8 * bb_of(type);
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *g = w + c / 8 * 8 * wrb;
        const int s = (int)(c % 8);
        for (int64_t rr = 0; rr < nr; rr++) {
            const act_block8 *xa = (const act_block8 *)(xq + rr * xrb);
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = g + b * gbb;
                const act_block8 *x = xa + b;
                const float d = half_at(blk + 2 * s), dmin = type == QTYPE_Q2_K ? half_at(blk + 16 + 2 * s) : 0.0f;
                for (int j = 0; j < 8; j++)
                    for (int pass = 0; pass < 1 + ((x->two >> j) & 1); pass++) {
                        const int8_t *xv = pass ? x->r : x->q;
                        const int32_t *off = pass ? x->roff : x->qoff;
                        int32_t I = 0, M = 0;
                        for (int h = 0; h < 2; h++) {
                            int32_t m, is = type == QTYPE_Q3_K ? off[2 * j + h] / 8 : 0;
                            const int32_t sc = scale_of(blk, s, 2 * j + h, type, &m);
                            for (int i = 16 * h; i < 16 * h + 16; i++) is += weight_u(blk, s, j, i, type) * xv[32 * j + i];
                            I += is * sc;
                            M += m * (-off[2 * j + h] / 32);
                        }
                        const float step = pass ? x->d[j] * (1.0f / 128.0f) : x->d[j];
                        acc = fmaf((float)I, d * step, acc);
                        if (type == QTYPE_Q2_K) acc = fmaf(-(float)M, dmin * step, acc);
                    }
            }
            out[rr * ldo + c] = acc;
        }
    }
}
#define TILE8_LOOP(TYPE) tile8_plain(w, wrb, nc, xq, xrb, nr, nb, out, ldo, TYPE)
#endif

#define K23X8_TILES(T16, T8, TYPE)                                                                              \
    static void T16(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,      \
                    int64_t nb, float *out, int64_t ldo) {                                                      \
        TILE16_LOOP(TYPE);                                                                                      \
    }                                                                                                           \
    static void T8(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,       \
                   int64_t nb, float *out, int64_t ldo) {                                                       \
        TILE8_LOOP(TYPE);                                                                                       \
    }
K23X8_TILES(tile_q2_k, tile_q2_k_a8, QTYPE_Q2_K)
K23X8_TILES(tile_q3_k, tile_q3_k_a8, QTYPE_Q3_K)

static void slot_q2_k(const uint8_t *g, int s, int64_t k, float *out) { dequant_slot(g, s, k, out, QTYPE_Q2_K); }
static void slot_q3_k(const uint8_t *g, int s, int64_t k, float *out) { dequant_slot(g, s, k, out, QTYPE_Q3_K); }
static void group_q2_k(const uint8_t *g, int64_t k, float *out) {
    for (int s = 0; s < 8; s++) dequant_slot(g, s, k, out + s * k, QTYPE_Q2_K);
}
static void group_q3_k(const uint8_t *g, int64_t k, float *out) {
    for (int s = 0; s < 8; s++) dequant_slot(g, s, k, out + s * k, QTYPE_Q3_K);
}

#define ACT16 (8 * (int)sizeof(act_block16)) /* per 256 weights */
#define ACT8 ((int)sizeof(act_block8))
static const qtype_ops OPS_Q2_K = {QTYPE_Q2_K | QTYPE_X8, 256, 84, ACT16, quantize_act16, tile_q2_k, NULL, slot_q2_k,
                                   group_q2_k};
static const qtype_ops OPS_Q3_K = {QTYPE_Q3_K | QTYPE_X8, 256, 110, ACT16, quantize_act16, tile_q3_k, NULL, slot_q3_k,
                                   group_q3_k};
static const qtype_ops OPS_Q2_K_A8 = {QTYPE_Q2_K | QTYPE_X8 | QTYPE_A8, 256, 84, ACT8, quantize_act8, tile_q2_k_a8,
                                      NULL, slot_q2_k, group_q2_k};
static const qtype_ops OPS_Q3_K_A8 = {QTYPE_Q3_K | QTYPE_X8 | QTYPE_A8, 256, 110, ACT8, quantize_act8, tile_q3_k_a8,
                                      NULL, slot_q3_k, group_q3_k};

const qtype_ops *qtype_k23x8(int type) {
    switch (type) {
    case QTYPE_Q2_K | QTYPE_X8: return &OPS_Q2_K;
    case QTYPE_Q3_K | QTYPE_X8: return &OPS_Q3_K;
    case QTYPE_Q2_K | QTYPE_X8 | QTYPE_A8: return &OPS_Q2_K_A8;
    case QTYPE_Q3_K | QTYPE_X8 | QTYPE_A8: return &OPS_Q3_K_A8;
    default: return NULL;
    }
}
