/* The K-quant blocks (Q4_K, Q5_K, Q6_K; quant_k.c draws the file's layouts) with their weight rows
 * interleaved by 8, the layout the worker holds them in (backends/cpu/layouts.py makes it at load:
 * the same bytes, rearranged). Type code: the ggml type | QTYPE_X8.
 *
 * Rows 8g .. 8g + 7 form group g, stored where the file's rows were; block b of the 8 rows is one
 * "group block" of 8 * block_bytes at b * 8 * block_bytes. In it every field of the 8 rows' blocks
 * lies side by side, and the quant bytes in chunks of 32: 4 bytes of slot (row) 0, then of slot 1,
 * ..., of slot 7. A chunk holds the same 4 quant byte positions of the 8 rows:
 *   Q4_K (1152 bytes): 8 fp16 d | 8 fp16 dmin | the 12 scale bytes as 3 words: bytes 0-3 of the 8
 *     rows (32), bytes 4-7 (32), bytes 8-11 (32) | qs chunks (g, c), g < 4 the 32-byte run of
 *     sub-blocks 2g (low nibbles) and 2g + 1 (high), c < 8 its bytes 4c .. 4c + 3 (1024).
 *   Q5_K (1408 bytes): as Q4_K, with the qh chunks c < 8 (qh bytes 4c .. 4c + 3; 256) before the qs.
 *   Q6_K (1680 bytes): 8 fp16 d | the int8 scales, 16 bytes per (h, half, pair p): scale 8h + 4p +
 *     half of the 8 rows, then scale 8h + 4p + 2 + half (128) | ql chunks (h, t, c): ql bytes 64h +
 *     32t + 4c .. + 3 (1024) | qh chunks (h, c): qh bytes 32h + 4c .. + 3 (512).
 *
 * Why (as quant_x8.c for the legacy types): a chunk widened to int16 holds 2 weight pairs of each
 * of the 8 rows, and one madd (vpdpwssd with VNNI) against the activation's 4 matching values,
 * broadcast as a 64-bit pair of pairs, leaves each (row, pair) partial sum in its own 32-bit lane.
 * Per sub-block the pairs are folded (a permute and an add), converted once and scaled by one
 * vector of 8 rows' scales: nothing is summed across a row's lanes per block, as the file layout's
 * tile must. One activation row streams each group's blocks front to back, prefetched ahead.
 *
 * Integer sums, for any weights and activations (|x| <= 32767, quant.c): a lane sums the products
 * of one row and one sub-block (Q6_K: one 16-weight half), Q4_K 32 products of q <= 15 at most
 * 15.7e6, Q5_K 32 of q <= 31 at most 32.5e6, Q6_K 16 of |q - 32| <= 32 at most 16.8e6: all far
 * below 2^31, and the fold of a pair of lanes is one such sum. The scales multiply in float.
 *
 * Builds: AVX-512 (zmm; vpdpwssd where VNNI is there), AVX2 (ymm, each chunk as two 16-byte
 * halves of 4 rows), and portable (each row's blocks rebuilt in the file's layout, then quant_k.c's
 * plain-C tile: the reference the others are tested against, beside gguf-py's dequantization).
 * The AVX-512 builds also have tiles for 8-bit activations (act_block8, type | QTYPE_A8: many
 * rows), which unpack the same layout a slice at a time, and quant_x8.c's legacy layout too (Q4_0,
 * Q4_1; Q8_0 where VNNI is); they are described where they start.
 */
#include "quant.h"
#include "rivulet_kernels.h"

#define QK 256
/* How far ahead, in group blocks, the 16-bit tiles prefetch their group's blocks: about 7 KB
 * (Q4_K 6 x 1152 bytes, Q6_K 4 x 1680): nearer, a few rows' stream falls behind the memory's pace
 * (docs/benchmarks-history.md, "Prefetching further ahead"). */
#define PF_Q45 6
#define PF_Q6 4
/* 256-weight blocks an 8-bit tile sums before adding them to its total (the AVX-512 tiles unpack a slice
 * at a time: 20-24 KB, L1 holds them and XR8 rows' blocks); every build sums in these slices, so
 * every kind that has the tiles gives the same bits. */
#define A8_SLICE 4
typedef int32_t __attribute__((may_alias, aligned(1))) int32_any;
#ifndef KX8_PF
/* How far ahead (bytes) the 8-bit tiles that read blocks in place prefetch their groups' blocks
 * (nearer or further measured slower: bench.quant_matmul, docs/benchmarks.md). */
#define KX8_PF 2048
#endif

static inline int kx8_block_bytes(const int type) {
    return type == QTYPE_Q4_K ? 144 : type == QTYPE_Q5_K ? 176 : 210;
}

/* Slot s's block (of the group block at gb) rebuilt as the file's block. */
static void plain_block_k(const uint8_t *gb, int s, const int type, uint8_t *out) {
    if (type == QTYPE_Q6_K) {
        for (int h = 0; h < 2; h++) {
            for (int t = 0; t < 2; t++)
                for (int c = 0; c < 8; c++) memcpy(out + 64 * h + 32 * t + 4 * c, gb + 144 + ((h * 2 + t) * 8 + c) * 32 + 4 * s, 4);
            for (int c = 0; c < 8; c++) memcpy(out + 128 + 32 * h + 4 * c, gb + 1168 + (h * 8 + c) * 32 + 4 * s, 4);
            for (int half = 0; half < 2; half++)
                for (int j = 0; j < 4; j++) /* scale 8h + 2j + half: pair j / 2, its (j % 2)-th 8 bytes */
                    out[192 + 8 * h + 2 * j + half] = gb[16 + ((h * 2 + half) * 2 + j / 2) * 16 + (j % 2) * 8 + s];
        }
        memcpy(out + 208, gb + 2 * s, 2);
        return;
    }
    const int q5 = type == QTYPE_Q5_K, qs_out = q5 ? 48 : 16, qs_in = q5 ? 384 : 128;
    memcpy(out, gb + 2 * s, 2);
    memcpy(out + 2, gb + 16 + 2 * s, 2);
    for (int word = 0; word < 3; word++) memcpy(out + 4 + 4 * word, gb + 32 + 32 * word + 4 * s, 4);
    if (q5)
        for (int c = 0; c < 8; c++) memcpy(out + 16 + 4 * c, gb + 128 + 32 * c + 4 * s, 4);
    for (int g = 0; g < 4; g++)
        for (int c = 0; c < 8; c++) memcpy(out + qs_out + 32 * g + 4 * c, gb + qs_in + (g * 8 + c) * 32 + 4 * s, 4);
}

/* Row s of the group at g (k weights) as float32: each block rebuilt, then the file layout's own
 * dequantization (quant_k.c), so the values are exactly gguf-py's. */
static inline void dequant_slot_k(const uint8_t *g, int s, int64_t k, float *out, const int type) {
    const int bb = kx8_block_bytes(type);
    const qtype_ops *plain_ops = qtype_k(type);
    uint8_t plain[210];
    for (int64_t b = 0; b < k / QK; b++) {
        plain_block_k(g + b * 8 * bb, s, type, plain);
        plain_ops->dequant_row(plain, QK, out + b * QK);
    }
}

#if HAVE_AVX2 || HAVE_AVX512
static inline __m256i pairs2_256(const int16_t *q) { /* q[0..3] in every 64-bit lane */
    int64_t v;
    memcpy(&v, q, sizeof v);
    return _mm256_set1_epi64x(v);
}

/* Q4_K's 12 scale bytes of the 8 rows as 4 words: lane s of each holds row s's scales 0-3, mins
 * 0-3, scales 4-7, mins 4-7 in its bytes (scale_min_k4 on words). */
static inline void q4k_scale_words(const uint8_t *blk, __m256i words[4]) {
    const __m256i wa = _mm256_loadu_si256((const __m256i *)(blk + 32));
    const __m256i wb = _mm256_loadu_si256((const __m256i *)(blk + 64));
    const __m256i wc = _mm256_loadu_si256((const __m256i *)(blk + 96));
    const __m256i m6 = _mm256_set1_epi32(0x3f3f3f3f), m4 = _mm256_set1_epi32(0x0f0f0f0f), hi2 = _mm256_set1_epi32(0x30303030);
    words[0] = _mm256_and_si256(wa, m6);
    words[1] = _mm256_and_si256(wb, m6);
    words[2] = _mm256_or_si256(_mm256_and_si256(wc, m4), _mm256_and_si256(_mm256_srli_epi32(wa, 2), hi2));
    words[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(wc, 4), m4), _mm256_and_si256(_mm256_srli_epi32(wb, 2), hi2));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KX8_ZMM 1
#define KX8_A8 1 /* the 8-bit activations' tiles */
#define XR 4 /* activation rows per tile */
#if defined(__AVX512VNNI__)
#define DPW(acc, a, b) _mm512_dpwssd_epi32((acc), (a), (b))
#else
#define DPW(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16((a), (b)))
#endif

static inline __m512i pairs2(const int16_t *q) { /* q[0..3] in every 64-bit lane */
    int64_t v;
    memcpy(&v, q, sizeof v);
    return _mm512_set1_epi64(v);
}

static inline __m512i widen32(const uint8_t *p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p)); }

/* Lanes (row s, pair p) at 2s + p of a and of b -> [a's rows 0-7 | b's rows 0-7], pairs summed. */
static inline __m512i fold_pairs(__m512i a, __m512i b) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return _mm512_add_epi32(_mm512_permutex2var_epi32(a, even, b), _mm512_permutex2var_epi32(a, odd, b));
}

/* [u ... (8 lanes) | v ...] */
static inline __m512 two8(float u, float v) {
    return _mm512_insertf32x8(_mm512_set1_ps(u), _mm256_set1_ps(v), 1);
}

static inline __m512 fp16x8_twice(const uint8_t *p) {
    const __m256 h = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    return _mm512_insertf32x8(_mm512_castps256_ps512(h), h, 1);
}

/* Sub-blocks 2sb and 2sb + 1 of the 8 rows: d * scale and dmin * min, [rows of 2sb | rows of 2sb + 1]. */
static inline void q4k_sb_scales(const __m256i words[4], __m512 d, __m512 dmin, int sb, __m512 *dsc, __m512 *dm) {
    const __m256i scw = sb < 2 ? words[0] : words[2], mw = sb < 2 ? words[1] : words[3];
    const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi32(16 * (sb & 1)), _mm256_set1_epi32(16 * (sb & 1) + 8), 1);
    const __m512i byte = _mm512_set1_epi32(0xff);
    *dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(
                                _mm512_srlv_epi32(_mm512_inserti64x4(_mm512_castsi256_si512(scw), scw, 1), shift), byte)));
    *dm = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_and_si512(
                                  _mm512_srlv_epi32(_mm512_inserti64x4(_mm512_castsi256_si512(mw), mw, 1), shift), byte)));
}

/* out[r * ldo + s] = dot(row s of the group at g, activation row r), s < 8, r < nr <= R. */
static inline __attribute__((always_inline)) void q45_tile(const uint8_t *g, int64_t nb, const act_block16 *const *xa,
                                                           int64_t nr, float *out, int64_t ldo, const int type,
                                                           const int R) {
    const int q5 = type == QTYPE_Q5_K, gbb = 8 * kx8_block_bytes(type), qs_at = q5 ? 384 : 128;
    __m512 acc[XR];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * gbb;
        for (int at = 0; at < gbb; at += 64) prefetch_weights(blk + PF_Q45 * gbb + at);
        __m256i words[4];
        q4k_scale_words(blk, words);
        const __m512 d = fp16x8_twice(blk), dmin = fp16x8_twice(blk + 16);
        for (int sb = 0; sb < 4; sb++) { /* sub-blocks 2sb (low nibbles) and 2sb + 1 (high) */
            __m512 dsc, dm;
            q4k_sb_scales(words, d, dmin, sb, &dsc, &dm);
            __m512i lo_acc[XR], hi_acc[XR];
            for (int r = 0; r < R; r++) lo_acc[r] = hi_acc[r] = _mm512_setzero_si512();
            for (int c = 0; c < 8; c++) {
                const __m512i v = widen32(blk + qs_at + (sb * 8 + c) * 32);
                __m512i lo = _mm512_and_si512(v, _mm512_set1_epi16(15)), hi = _mm512_srli_epi16(v, 4);
                if (q5) { /* bit j of qh byte i: the fifth bit of sub-block j's weight i */
                    const __m512i qh4 = _mm512_slli_epi16(widen32(blk + 128 + 32 * c), 4);
                    lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_srl_epi16(qh4, _mm_cvtsi32_si128(2 * sb)), _mm512_set1_epi16(16)));
                    hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srl_epi16(qh4, _mm_cvtsi32_si128(2 * sb + 1)), _mm512_set1_epi16(16)));
                }
                for (int r = 0; r < R; r++) {
                    const act_block16 *x = xa[r] + 8 * b + 2 * sb;
                    lo_acc[r] = DPW(lo_acc[r], lo, pairs2(x[0].q + 4 * c));
                    hi_acc[r] = DPW(hi_acc[r], hi, pairs2(x[1].q + 4 * c));
                }
            }
            for (int r = 0; r < R; r++) {
                const act_block16 *x = xa[r] + 8 * b + 2 * sb;
                const __m512 dots = _mm512_cvtepi32_ps(fold_pairs(lo_acc[r], hi_acc[r]));
                acc[r] = _mm512_fmadd_ps(dots, _mm512_mul_ps(dsc, two8(x[0].d, x[1].d)), acc[r]);
                acc[r] = _mm512_fnmadd_ps(dm, two8(x[0].s, x[1].s), acc[r]);
            }
        }
    }
    for (int r = 0; r < R && r < nr; r++)
        _mm256_storeu_ps(out + r * ldo, _mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm512_extractf32x8_ps(acc[r], 1)));
}

/* Q6_K: each sub-block's 6-bit quants assembled from ql and qh as bytes (32 bytes: 4 quants of each
 * of the 8 rows), made signed (q - 32) there and only then widened: the bit work runs on half-width
 * vectors, one vpternlogd per sub-block merging the nibble and the two high bits. */
static inline __attribute__((always_inline)) void q6_tile(const uint8_t *g, int64_t nb, const act_block16 *const *xa,
                                                          int64_t nr, float *out, int64_t ldo, const int R) {
    const int gbb = 8 * 210;
    const __m256i low = _mm256_set1_epi8(0x0f), high2 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
    __m512 acc[XR];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * gbb;
        for (int at = 0; at < gbb; at += 64) prefetch_weights(blk + PF_Q6 * gbb + at);
        const __m512 d = fp16x8_twice(blk);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++)
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) { /* weights 16 half .. 16 half + 15 of each sub-block */
                __m512i is[XR][4];
                for (int r = 0; r < R; r++)
                    for (int s = 0; s < 4; s++) is[r][s] = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int c = 4 * half; c < 4 * half + 4; c++) {
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 1168 + (h * 8 + c) * 32));
                    const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 144 + (h * 16 + c) * 32));
                    const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 144 + (h * 16 + 8 + c) * 32));
                    /* sub-block s: the low (s < 2) or high nibbles of ql_(s % 2), qh bits 2s, 2s + 1 at 4, 5 */
                    const __m256i nib[4] = {ql0, ql1, _mm256_srli_epi16(ql0, 4), _mm256_srli_epi16(ql1, 4)};
                    const __m256i hb[4] = {_mm256_slli_epi16(qh, 4), _mm256_slli_epi16(qh, 2), qh, _mm256_srli_epi16(qh, 2)};
                    __m512i w[4];
                    for (int s = 0; s < 4; s++) { /* (nibble & 0x0f) | (hb & 0x30), then - 32, widened */
                        const __m256i q = _mm256_ternarylogic_epi32(nib[s], low, _mm256_and_si256(hb[s], high2), 0xEA);
                        w[s] = _mm512_cvtepi8_epi16(_mm256_sub_epi8(q, off));
                    }
                    for (int r = 0; r < R; r++) {
                        const act_block16 *x = xa[r] + 8 * b + 4 * h;
                        for (int s = 0; s < 4; s++) is[r][s] = DPW(is[r][s], w[s], pairs2(x[s].q + 4 * c));
                    }
                }
                for (int p = 0; p < 2; p++) { /* sub-blocks 2p, 2p + 1 */
                    const __m128i s8 = _mm_loadu_si128((const __m128i *)(blk + 16 + ((h * 2 + half) * 2 + p) * 16));
                    const __m512 sc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s8)));
                    for (int r = 0; r < R; r++) {
                        const act_block16 *x = xa[r] + 8 * b + 4 * h + 2 * p;
                        const __m512 dots = _mm512_cvtepi32_ps(fold_pairs(is[r][2 * p], is[r][2 * p + 1]));
                        acc[r] = _mm512_fmadd_ps(dots, _mm512_mul_ps(sc, two8(x[0].d, x[1].d)), acc[r]);
                    }
                }
            }
    }
    for (int r = 0; r < R && r < nr; r++)
        _mm256_storeu_ps(out + r * ldo, _mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm512_extractf32x8_ps(acc[r], 1)));
}

/* The 8-bit activations' tiles (act_block8; many rows). Two groups side by side, 16 weight rows:
 * their blocks are unpacked a slice at a time into unsigned bytes, a zmm holding 4 weights of each
 * of the 16 rows (one chunk of each group), with the sub-blocks' float scales beside them; then
 * every activation row of the call meets the slice: one vpdpbusd per (chunk, row) against the 4
 * activation bytes broadcast, no fold, a scale multiply per sub-block and row. Q6_K's weights read
 * where they lie stay unsigned (q, not q - 32): their sums start at -32 times the activation's 16-value
 * sum (qoff); unpacked they are q - 32 against the activations + 128 (q6_unpack8).
 * Where a tile row's 32 values have the residual pass, r meets the weights too, at a 128th of the
 * scale; a row without it adds r's zero products, so a row's output does not depend on the rows
 * beside it. Integer sums: a lane sums at most 32 products of q <= 31 (Q4_K, Q5_K) or 16 of
 * q <= 63 (Q6_K) by |x| <= 127, below 2^18 (Q8_0's 32 of q <= 255: below 2^21). */
#if defined(__AVX512VNNI__)
#define DPB(acc, a, b) _mm512_dpbusd_epi32((acc), (a), (b))
#else /* maddubs' int16 pair sums: 2 * 63 * 127 at most, below its saturation */
#define DPB(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16(_mm512_maddubs_epi16((a), (b)), _mm512_set1_epi16(1)))
#endif
#define XR8 8 /* activation rows per 8-bit tile */
#define U45 80     /* zmm per unpacked Q4_K/Q5_K block: per sub-block pair 8 chunks x (low, high), dsc, dm */
#define U6H 24     /* zmm per (h, 16-value half) of an unpacked Q6_K block: 4 x 4 chunks, dsc x 4, start x 4 */
#define U6 (4 * U6H) /* zmm per unpacked Q6_K block */

/* acc + the products of w's bytes (unsigned) and q[0..3] (signed) in every lane, summed by 4. */
static inline __m512i dpb4(__m512i acc, __m512i w, const int8_t *q) {
#if defined(__AVX512VNNI__) /* the broadcast as vpdpbusd's {1to16} operand: no instruction of its own (gcc does not fold it) */
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_any *)q));
    return acc;
#else
    return DPB(acc, w, _mm512_set1_epi32(*(const int32_any *)q));
#endif
}

static inline __m512i two_chunks(const uint8_t *a, const uint8_t *b) { /* 32 bytes of each group */
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)), _mm256_loadu_si256((const __m256i *)b), 1);
}

/* 8 fp16 of the first group and 8 of the second as 16 floats. */
static inline __m512 fp16x8_pair(const uint8_t *a, const uint8_t *b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)a))),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)), 1);
}

/* How far ahead (bytes of each group's stream) the unpacking tiles prefetch, into L2: a slice's worth
 * of lines a step, a few at a time while the tiles run over the slice unpacked, so the lines come in
 * while the multiplies run; past a group's end its stream goes on into the next tile's same group
 * (16 rows on). Issued all at once as each slice was unpacked (and into L1), the unpacking waited on
 * memory: about a quarter of Q6_K's time at 32 rows (docs/benchmarks-history.md, "Prefetching the
 * 8-bit tiles' slices while they multiply"). */
#define A8_PF_AHEAD (20 * 1024)
typedef struct {
    const uint8_t *p[2]; /* the next line of each group's stream */
    int64_t left, per;   /* lines left of each, lines per step */
} a8_pf;

/* The prefetch of the slice [b0, b0 + sl) (group blocks of gbb bytes, nb a group) A8_PF_AHEAD on, over
 * steps (the tiles' block iterations over the slice). */
static inline a8_pf a8_pf_start(const uint8_t *g0, const uint8_t *g1, int64_t b0, int64_t sl, int64_t nb,
                                int64_t gbb, int64_t steps) {
    const int64_t group = nb * gbb;
    int64_t at = b0 * gbb + A8_PF_AHEAD, base = 0;
    for (; at >= group; at -= group) base += 2 * group;
    const int64_t lines = sl * gbb / 64;
    return (a8_pf){{g0 + base + at, g1 + base + at}, lines, (lines + steps - 1) / steps};
}

static inline void a8_pf_step(a8_pf *pf) {
    for (int64_t i = 0; i < pf->per && pf->left > 0; i++, pf->left--) {
        _mm_prefetch((const char *)pf->p[0], _MM_HINT_T1);
        _mm_prefetch((const char *)pf->p[1], _MM_HINT_T1);
        pf->p[0] += 64;
        pf->p[1] += 64;
    }
}

/* Q4_K/Q5_K blocks [b0, b0 + nb) of the groups at g0 and g1 (tile rows 0-7 and 8-15), unpacked to u. */
__attribute__((noinline)) static void q45_unpack8(const uint8_t *g0, const uint8_t *g1, int64_t b0, int64_t nb, __m512i *u, const int type) {
    const int q5 = type == QTYPE_Q5_K, gbb = 8 * kx8_block_bytes(type), qs_at = q5 ? 384 : 128;
    const __m512i m4 = _mm512_set1_epi8(0x0f), one = _mm512_set1_epi8(1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk[2] = {g0 + (b0 + b) * gbb, g1 + (b0 + b) * gbb};
        __m256i words[2][4];
        __m512 d[2], dmin[2];
        for (int g = 0; g < 2; g++) {
            q4k_scale_words(blk[g], words[g]);
            d[g] = fp16x8_twice(blk[g]);
            dmin[g] = fp16x8_twice(blk[g] + 16);
        }
        for (int sb = 0; sb < 4; sb++) {
            __m512i *p = u + b * U45 + sb * 20;
            for (int c = 0; c < 8; c++) {
                const __m512i v = two_chunks(blk[0] + qs_at + (sb * 8 + c) * 32, blk[1] + qs_at + (sb * 8 + c) * 32);
                __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                if (q5) { /* bit j of qh byte i: the fifth bit of sub-block j's weight i */
                    const __m512i qh = two_chunks(blk[0] + 128 + 32 * c, blk[1] + 128 + 32 * c);
                    lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * sb), one), 4));
                    hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * sb + 1), one), 4));
                }
                _mm512_store_si512(p + 2 * c, lo);
                _mm512_store_si512(p + 2 * c + 1, hi);
            }
            __m512 dsc[2], dm[2]; /* each [rows of 2sb | rows of 2sb + 1] of one group */
            for (int g = 0; g < 2; g++) q4k_sb_scales(words[g], d[g], dmin[g], sb, &dsc[g], &dm[g]);
            _mm512_store_ps((float *)(p + 16), _mm512_shuffle_f32x4(dsc[0], dsc[1], 0x44));
            _mm512_store_ps((float *)(p + 17), _mm512_shuffle_f32x4(dsc[0], dsc[1], 0xEE));
            _mm512_store_ps((float *)(p + 18), _mm512_shuffle_f32x4(dm[0], dm[1], 0x44));
            _mm512_store_ps((float *)(p + 19), _mm512_shuffle_f32x4(dm[0], dm[1], 0xEE));
        }
    }
}

/* Q6_K blocks [b0, b0 + nb) of the groups at g0 and g1, unpacked to u: per (h, half) the weights
 * q - 32 (signed bytes) of sub-blocks s = 0-3 (weights 32 s + 16 half .. + 15 of the 128 at h), 4
 * chunks each, then the dsc of each s, then each s's start: -128 sum(q - 32) of its 16 weights per
 * row. The tile meets them with the activations + 128 (unsigned, q6_block8), so a pass's sums start
 * from the weights' own offset, one load a row group, not from the activation's (a broadcast a row):
 * the loads bound that tile. The same integers: sum((q - 32)(a + 128)) - 128 sum(q - 32). */
__attribute__((noinline)) static void q6_unpack8(const uint8_t *g0, const uint8_t *g1, int64_t b0, int64_t nb, __m512i *u) {
    const int gbb = 8 * 210;
    const __m512i low = _mm512_set1_epi8(0x0f), high2 = _mm512_set1_epi8(0x30), thirty2 = _mm512_set1_epi8(32);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk[2] = {g0 + (b0 + b) * gbb, g1 + (b0 + b) * gbb};
        const __m512 d = fp16x8_pair(blk[0], blk[1]);
        for (int h = 0; h < 2; h++)
            for (int half = 0; half < 2; half++) {
                __m512i *p = u + b * U6 + (h * 2 + half) * U6H;
                __m512i qsum[4];
                for (int ci = 0; ci < 4; ci++) {
                    const int c = 4 * half + ci;
                    const __m512i qh = two_chunks(blk[0] + 1168 + (h * 8 + c) * 32, blk[1] + 1168 + (h * 8 + c) * 32);
                    const __m512i ql0 = two_chunks(blk[0] + 144 + (h * 16 + c) * 32, blk[1] + 144 + (h * 16 + c) * 32);
                    const __m512i ql1 = two_chunks(blk[0] + 144 + (h * 16 + 8 + c) * 32, blk[1] + 144 + (h * 16 + 8 + c) * 32);
                    /* sub-block s: the low (s < 2) or high nibbles of ql_(s % 2), qh bits 2s, 2s + 1 at 4, 5 */
                    const __m512i nib[4] = {ql0, ql1, _mm512_srli_epi16(ql0, 4), _mm512_srli_epi16(ql1, 4)};
                    const __m512i hb[4] = {_mm512_slli_epi16(qh, 4), _mm512_slli_epi16(qh, 2), qh, _mm512_srli_epi16(qh, 2)};
                    for (int sb = 0; sb < 4; sb++) {
                        const __m512i q = _mm512_ternarylogic_epi32(nib[sb], low, _mm512_and_si512(hb[sb], high2), 0xEA);
                        qsum[sb] = ci ? _mm512_add_epi8(qsum[sb], q) : q; /* 4 q <= 63: below 256 */
                        _mm512_store_si512(p + 4 * sb + ci, _mm512_sub_epi8(q, thirty2));
                    }
                }
                for (int sb = 0; sb < 4; sb++) { /* -128 sum(q - 32) of the 16 weights of each row */
                    const __m512i sum = DPB(_mm512_setzero_si512(), qsum[sb], _mm512_set1_epi8(1));
                    _mm512_store_si512(p + 20 + sb, _mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(512), sum), 7));
                }
                const __m128i s0 = _mm_loadu_si128((const __m128i *)(blk[0] + 16 + (h * 2 + half) * 32));
                const __m128i s1 = _mm_loadu_si128((const __m128i *)(blk[1] + 16 + (h * 2 + half) * 32));
                const __m128i s2 = _mm_loadu_si128((const __m128i *)(blk[0] + 16 + (h * 2 + half) * 32 + 16));
                const __m128i s3 = _mm_loadu_si128((const __m128i *)(blk[1] + 16 + (h * 2 + half) * 32 + 16));
                for (int sb = 0; sb < 4; sb++) { /* scale 8h + 2 sb + half: bytes 8 sb .. + 7 of the 32 */
                    const __m128i a = sb < 2 ? s0 : s2, c = sb < 2 ? s1 : s3;
                    const __m128i both = (sb & 1) ? _mm_unpackhi_epi64(a, c) : _mm_unpacklo_epi64(a, c);
                    const __m512 dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(both)));
                    _mm512_store_ps((float *)(p + 16 + sb), dsc);
                }
            }
    }
}

/* The legacy types' blocks (quant_x8.c's layout: per block of 32, 8 fp16 d [, 8 fp16 m], then
 * chunks of 2 quant bytes of each of the 8 rows) on the same tiles: 8 blocks of 32 make one
 * 256-weight block, block j of them sub-block j of Q4_K's slice, with d as its scale and, as its
 * min, 8 d (Q4_0: d (q - 8)), -m (Q4_1: d q + m) or 128 d (Q8_0, its q made unsigned: d (q + 128 -
 * 128)). A zmm of 4 weights of each of 16 rows is two chunks of each group (32 bytes apart in
 * memory: 2 bytes of each row, then the next 2) with their 16-bit words interleaved row by row. */
__attribute__((noinline)) static void legacy_unpack8(const uint8_t *g0, const uint8_t *g1, int64_t b0, int64_t nb, __m512i *u,
                                                     const int type) {
    const int bb = qtype_x8(type | QTYPE_X8)->block_bytes, head = type == QTYPE_Q4_1 ? 32 : 16;
    const int64_t gbb = 64 * bb; /* a group's 8 blocks of 32 */
    const __m512i m4 = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    /* word 2s: row s's word of the first chunk, 2s + 1: of the second; the same for the second group */
    const __m512i order = _mm512_set_epi16(31, 23, 30, 22, 29, 21, 28, 20, 27, 19, 26, 18, 25, 17, 24, 16,
                                           15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
    for (int64_t b = 0; b < nb; b++) {
        for (int j = 0; j < 8; j++) {
            const uint8_t *blk[2] = {g0 + (b0 + b) * gbb + j * 8 * bb, g1 + (b0 + b) * gbb + j * 8 * bb};
            __m512i *p = u + b * U45 + (j / 2) * 20 + (j % 2);
            for (int c = 0; c < (type == QTYPE_Q8_0 ? 8 : 4); c++) {
                const __m512i v = _mm512_permutexvar_epi16(order, two_chunks(blk[0] + head + 32 * c, blk[1] + head + 32 * c));
                if (type == QTYPE_Q8_0) {
                    _mm512_store_si512(p + 2 * c, _mm512_xor_si512(v, flip));
                } else { /* low nibbles: weights 4c .. 4c + 3, high: 16 + 4c .. */
                    _mm512_store_si512(p + 2 * c, _mm512_and_si512(v, m4));
                    _mm512_store_si512(p + 2 * (c + 4), _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
                }
            }
            const __m512 d = fp16x8_pair(blk[0], blk[1]);
            const __m512 dm = type == QTYPE_Q4_1   ? _mm512_sub_ps(_mm512_setzero_ps(), fp16x8_pair(blk[0] + 16, blk[1] + 16))
                              : type == QTYPE_Q8_0 ? _mm512_mul_ps(d, _mm512_set1_ps(128.0f))
                                                   : _mm512_mul_ps(d, _mm512_set1_ps(8.0f));
            _mm512_store_ps((float *)(p + 16), d);
            _mm512_store_ps((float *)(p + 18), dm);
        }
    }
}

/* One pass (q's or r's: FIELD) of Q4_K/Q5_K sub-blocks 2sb, 2sb + 1 of the tile's rows. */
#define Q45_PASS(FIELD)                                                                          \
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm512_setzero_si512();                         \
    for (int c = 0; c < 8; c++) {                                                                \
        const __m512i wl = _mm512_load_si512(p + 2 * c), wh = _mm512_load_si512(p + 2 * c + 1); \
        for (int r = 0; r < R; r++) {                                                            \
            lo[r] = dpb4(lo[r], wl, x[r]->FIELD + 64 * sb + 4 * c);                              \
            hi[r] = dpb4(hi[r], wh, x[r]->FIELD + 64 * sb + 32 + 4 * c);                         \
        }                                                                                        \
    }

/* acc[r] += the integer sums lo[r] and hi[r] of sub-blocks 2sb and 2sb + 1 (q's pass, or r's), each
 * at its weight scale (sc_lo, sc_hi: [16 rows]) times row r's step. */
static inline __attribute__((always_inline)) void q45_scale8(__m512 *acc, const __m512i *lo, const __m512i *hi,
                                                             __m512 sc_lo, __m512 sc_hi, const act_block8 *const *x,
                                                             int sb, const int R) {
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[r]), _mm512_mul_ps(sc_lo, _mm512_set1_ps(x[r]->d[2 * sb])), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[r]), _mm512_mul_ps(sc_hi, _mm512_set1_ps(x[r]->d[2 * sb + 1])), acc[r]);
    }
}

/* acc[r] -= the min terms of sub-blocks 2sb and 2sb + 1: their mins (dm_lo, dm_hi) times row r's sums. */
static inline __attribute__((always_inline)) void q45_mins8(__m512 *acc, __m512 dm_lo, __m512 dm_hi,
                                                            const act_block8 *const *x, int sb, const int R) {
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_fnmadd_ps(dm_lo, _mm512_set1_ps(x[r]->s[2 * sb]), acc[r]);
        acc[r] = _mm512_fnmadd_ps(dm_hi, _mm512_set1_ps(x[r]->s[2 * sb + 1]), acc[r]);
    }
}

/* acc[r] += dot(tile row j, activation row r) for j < 16, r < R, over one unpacked block at u;
 * x[r]: row r's activation block, two: their residual-pass bits or'ed. */
static inline __attribute__((always_inline)) void q45_block8(const __m512i *u, const act_block8 *const *x, int two,
                                                             __m512 *acc, const int R) {
    __m512i lo[XR8], hi[XR8];
    for (int sb = 0; sb < 4; sb++) {
        const __m512i *p = u + sb * 20;
        const __m512 dsc_lo = _mm512_load_ps((const float *)(p + 16)), dsc_hi = _mm512_load_ps((const float *)(p + 17));
        Q45_PASS(q)
        q45_scale8(acc, lo, hi, dsc_lo, dsc_hi, x, sb, R);
        q45_mins8(acc, _mm512_load_ps((const float *)(p + 18)), _mm512_load_ps((const float *)(p + 19)), x, sb, R);
        if ((two >> (2 * sb)) & 3) { /* r's products, at a 128th of q's step */
            __asm__ volatile("" ::: "memory"); /* the weights loaded again, not held across the pass */
            Q45_PASS(r)
            q45_scale8(acc, lo, hi, _mm512_mul_ps(dsc_lo, _mm512_set1_ps(1.0f / 128.0f)),
                       _mm512_mul_ps(dsc_hi, _mm512_set1_ps(1.0f / 128.0f)), x, sb, R);
        }
    }
}

/* One pass (q's or r's: FIELD) of Q4_K/Q5_K sub-blocks 2sb, 2sb + 1 of the tile's rows, each chunk
 * of the two groups unpacked in registers as q45_unpack8 unpacks it to memory. */
#define Q45_DIRECT_PASS(FIELD)                                                                                    \
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm512_setzero_si512();                                         \
    for (int c = 0; c < 8; c++) {                                                                                \
        const __m512i v = two_chunks(blk0 + qs_at + (sb * 8 + c) * 32, blk1 + qs_at + (sb * 8 + c) * 32);          \
        __m512i wl = _mm512_and_si512(v, m4), wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);                 \
        if (q5) {                                                                                                \
            const __m512i qh = two_chunks(blk0 + 128 + 32 * c, blk1 + 128 + 32 * c);                             \
            wl = _mm512_or_si512(wl, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * sb), one), 4));     \
            wh = _mm512_or_si512(wh, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * sb + 1), one), 4)); \
        }                                                                                                        \
        for (int r = 0; r < R; r++) {                                                                            \
            lo[r] = dpb4(lo[r], wl, x[r]->FIELD + 64 * sb + 4 * c);                                              \
            hi[r] = dpb4(hi[r], wh, x[r]->FIELD + 64 * sb + 32 + 4 * c);                                         \
        }                                                                                                        \
    }

/* q45_block8 on block blk0 of the first group and blk1 of the second, read where they lie: for a few
 * rows, which would not repay unpacking a slice to memory first. The same integer sums and float
 * steps in the same order, so the same bits. */
static inline __attribute__((always_inline)) void q45_direct8(const uint8_t *blk0, const uint8_t *blk1,
                                                              const act_block8 *const *x, int two, __m512 *acc,
                                                              const int type, const int R) {
    const int q5 = type == QTYPE_Q5_K, qs_at = q5 ? 384 : 128;
    const __m512i m4 = _mm512_set1_epi8(0x0f), one = _mm512_set1_epi8(1);
    __m256i words[2][4];
    q4k_scale_words(blk0, words[0]);
    q4k_scale_words(blk1, words[1]);
    const __m512 d[2] = {fp16x8_twice(blk0), fp16x8_twice(blk1)}, dmin[2] = {fp16x8_twice(blk0 + 16), fp16x8_twice(blk1 + 16)};
    __m512i lo[XR8], hi[XR8];
    for (int sb = 0; sb < 4; sb++) {
        __m512 dsc[2], dm[2];
        for (int g = 0; g < 2; g++) q4k_sb_scales(words[g], d[g], dmin[g], sb, &dsc[g], &dm[g]);
        const __m512 dsc_lo = _mm512_shuffle_f32x4(dsc[0], dsc[1], 0x44), dsc_hi = _mm512_shuffle_f32x4(dsc[0], dsc[1], 0xEE);
        const __m512 dm_lo = _mm512_shuffle_f32x4(dm[0], dm[1], 0x44), dm_hi = _mm512_shuffle_f32x4(dm[0], dm[1], 0xEE);
        Q45_DIRECT_PASS(q)
        q45_scale8(acc, lo, hi, dsc_lo, dsc_hi, x, sb, R);
        q45_mins8(acc, dm_lo, dm_hi, x, sb, R);
        if ((two >> (2 * sb)) & 3) { /* r's products, at a 128th of q's step */
            Q45_DIRECT_PASS(r)
            q45_scale8(acc, lo, hi, _mm512_mul_ps(dsc_lo, _mm512_set1_ps(1.0f / 128.0f)),
                       _mm512_mul_ps(dsc_hi, _mm512_set1_ps(1.0f / 128.0f)), x, sb, R);
        }
    }
}

/* One pass (FIELD) of legacy blocks 2sb and 2sb + 1 (as sub-blocks 2sb, 2sb + 1 of q45_block8's),
 * each chunk of the two groups reordered in registers as legacy_unpack8 reorders it to memory. */
#define LEGACY_DIRECT_PASS(FIELD)                                                                                     \
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm512_setzero_si512();                                            \
    if (type == QTYPE_Q8_0) {                                                                                       \
        for (int c = 0; c < 8; c++) {                                                                               \
            const __m512i wl = _mm512_xor_si512(_mm512_permutexvar_epi16(order, two_chunks(l0[0] + head + 32 * c, l1[0] + head + 32 * c)), flip); \
            const __m512i wh = _mm512_xor_si512(_mm512_permutexvar_epi16(order, two_chunks(l0[1] + head + 32 * c, l1[1] + head + 32 * c)), flip); \
            for (int r = 0; r < R; r++) {                                                                           \
                lo[r] = dpb4(lo[r], wl, x[r]->FIELD + 64 * sb + 4 * c);                                             \
                hi[r] = dpb4(hi[r], wh, x[r]->FIELD + 64 * sb + 32 + 4 * c);                                        \
            }                                                                                                       \
        }                                                                                                           \
    } else { /* low nibbles: weights 4c .. 4c + 3, high: 16 + 4c .. (the integer sums in any order are the same) */ \
        for (int c = 0; c < 4; c++) {                                                                               \
            const __m512i vl = _mm512_permutexvar_epi16(order, two_chunks(l0[0] + head + 32 * c, l1[0] + head + 32 * c)); \
            const __m512i vh = _mm512_permutexvar_epi16(order, two_chunks(l0[1] + head + 32 * c, l1[1] + head + 32 * c)); \
            const __m512i wl0 = _mm512_and_si512(vl, m4), wl1 = _mm512_and_si512(_mm512_srli_epi16(vl, 4), m4);   \
            const __m512i wh0 = _mm512_and_si512(vh, m4), wh1 = _mm512_and_si512(_mm512_srli_epi16(vh, 4), m4);   \
            for (int r = 0; r < R; r++) {                                                                           \
                lo[r] = dpb4(lo[r], wl0, x[r]->FIELD + 64 * sb + 4 * c);                                            \
                lo[r] = dpb4(lo[r], wl1, x[r]->FIELD + 64 * sb + 16 + 4 * c);                                       \
                hi[r] = dpb4(hi[r], wh0, x[r]->FIELD + 64 * sb + 32 + 4 * c);                                       \
                hi[r] = dpb4(hi[r], wh1, x[r]->FIELD + 64 * sb + 48 + 4 * c);                                       \
            }                                                                                                       \
        }                                                                                                           \
    }

/* q45_block8 on the 8 legacy blocks of 32 at g0 (the first group) and g1 (the second) that make one
 * 256-weight block, read where they lie: block j as sub-block j, its d and min as legacy_unpack8 makes
 * them. The same bits as the unpacking tile. */
static inline __attribute__((always_inline)) void legacy_direct8(const uint8_t *g0, const uint8_t *g1,
                                                                 const act_block8 *const *x, int two, __m512 *acc,
                                                                 const int type, const int R) {
    const int bb = qtype_x8(type | QTYPE_X8)->block_bytes, head = type == QTYPE_Q4_1 ? 32 : 16;
    const __m512i m4 = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    const __m512i order = _mm512_set_epi16(31, 23, 30, 22, 29, 21, 28, 20, 27, 19, 26, 18, 25, 17, 24, 16,
                                           15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
    __m512i lo[XR8], hi[XR8];
    for (int sb = 0; sb < 4; sb++) {
        const uint8_t *l0[2] = {g0 + 2 * sb * 8 * bb, g0 + (2 * sb + 1) * 8 * bb};
        const uint8_t *l1[2] = {g1 + 2 * sb * 8 * bb, g1 + (2 * sb + 1) * 8 * bb};
        __m512 dsc[2], dmin[2];
        for (int t = 0; t < 2; t++) {
            dsc[t] = fp16x8_pair(l0[t], l1[t]);
            dmin[t] = type == QTYPE_Q4_1   ? _mm512_sub_ps(_mm512_setzero_ps(), fp16x8_pair(l0[t] + 16, l1[t] + 16))
                      : type == QTYPE_Q8_0 ? _mm512_mul_ps(dsc[t], _mm512_set1_ps(128.0f))
                                           : _mm512_mul_ps(dsc[t], _mm512_set1_ps(8.0f));
        }
        LEGACY_DIRECT_PASS(q)
        q45_scale8(acc, lo, hi, dsc[0], dsc[1], x, sb, R);
        q45_mins8(acc, dmin[0], dmin[1], x, sb, R);
        if ((two >> (2 * sb)) & 3) { /* r's products, at a 128th of q's step */
            LEGACY_DIRECT_PASS(r)
            q45_scale8(acc, lo, hi, _mm512_mul_ps(dsc[0], _mm512_set1_ps(1.0f / 128.0f)),
                       _mm512_mul_ps(dsc[1], _mm512_set1_ps(1.0f / 128.0f)), x, sb, R);
        }
    }
}

/* is[r] = the start of a pass's sums: the weights' offset of 32 times the activation's 16 values,
 * -32 sum(q) (or r's), stored with them (a broadcast load, no instruction of the tile's own); the
 * passes add the unsigned q's products, so the sums come out exact as sum((q - 32) a). */
#define Q6_START(FIELD, HALF) \
    for (int r = 0; r < R; r++) is[r] = _mm512_set1_epi32(x[r]->FIELD##off[2 * j + (HALF)]);

/* One pass (FIELD) of Q6_K sub-block sb's 16 weights at (h, HALF) of the tile's rows into is, each
 * weight vector assembled in registers as q6_unpack8 assembles it to memory. */
#define Q6_DIRECT(FIELD, HALF)                                                                                 \
    Q6_START(FIELD, HALF)                                                                                     \
    for (int ci = 0; ci < 4; ci++) {                                                                          \
        const int c = 4 * (HALF) + ci;                                                                        \
        const __m512i qh = two_chunks(blk0 + 1168 + (h * 8 + c) * 32, blk1 + 1168 + (h * 8 + c) * 32);          \
        const __m512i ql = two_chunks(blk0 + 144 + (h * 16 + 8 * (sb & 1) + c) * 32,                          \
                                      blk1 + 144 + (h * 16 + 8 * (sb & 1) + c) * 32);                          \
        const __m512i nib = sb < 2 ? ql : _mm512_srli_epi16(ql, 4);                                           \
        const __m512i hb = sb == 0   ? _mm512_slli_epi16(qh, 4)                                               \
                           : sb == 1 ? _mm512_slli_epi16(qh, 2)                                               \
                           : sb == 2 ? qh                                                                     \
                                     : _mm512_srli_epi16(qh, 2);                                              \
        const __m512i wq = _mm512_ternarylogic_epi32(nib, low, _mm512_and_si512(hb, high2), 0xEA);           \
        for (int r = 0; r < R; r++) is[r] = dpb4(is[r], wq, x[r]->FIELD + 32 * j + 16 * (HALF) + 4 * ci);    \
    }

/* t[r] (=, or += where not FIRST) the pass's sums in is times the half's scales DSC. */
#define Q6_TERM(HALF, DSC, FIRST)                                                                \
    for (int r = 0; r < R; r++) {                                                               \
        const __m512 v = _mm512_cvtepi32_ps(is[r]);                                              \
        t[r] = (FIRST) ? _mm512_mul_ps(v, (DSC)) : _mm512_fmadd_ps(v, (DSC), t[r]);            \
    }

/* Q6_K's sums of the activation's 32-value block j (the 16-value halves of its sub-block sb at h,
 * each with its scales dsc0, dsc1) into acc: sum over both halves of (q - 32) a dsc, then times the
 * block's step; the residual pass the same at a 128th of it. Each half is assembled in registers
 * (Q6_DIRECT), its integer sums in is, then scaled (Q6_TERM). */
#define Q6_BLOCK_J(dsc0, dsc1)                                                               \
    Q6_DIRECT(q, 0)                                                                          \
    Q6_TERM(0, dsc0, 1)                                                                      \
    Q6_DIRECT(q, 1)                                                                          \
    Q6_TERM(1, dsc1, 0)                                                                      \
    for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(t[r], _mm512_set1_ps(x[r]->d[j]), acc[r]); \
    if ((two >> j) & 1) {                                                                    \
        __asm__ volatile("" ::: "memory"); /* the weights loaded again, not held across the pass */ \
        Q6_DIRECT(r, 0)                                                                      \
        Q6_TERM(0, dsc0, 1)                                                                  \
        Q6_DIRECT(r, 1)                                                                      \
        Q6_TERM(1, dsc1, 0)                                                                  \
        for (int r = 0; r < R; r++)                                                          \
            acc[r] = _mm512_fmadd_ps(t[r], _mm512_set1_ps(x[r]->d[j] * (1.0f / 128.0f)), acc[r]); \
    }

/* q6_block8 on the block of the first group at blk0 and of the second at blk1, read where they lie. */
static inline __attribute__((always_inline)) void q6_direct8(const uint8_t *blk0, const uint8_t *blk1,
                                                             const act_block8 *const *x, int two, __m512 *acc,
                                                             const int R) {
    const __m512i low = _mm512_set1_epi8(0x0f), high2 = _mm512_set1_epi8(0x30);
    const __m512 d = fp16x8_pair(blk0, blk1);
    __m512i is[XR8];
    __m512 t[XR8];
    for (int h = 0; h < 2; h++) {
        __m128i sc[2][4]; /* per half: scale bytes 0-15 and 16-31 of the (h, half) run, of each group */
        for (int half = 0; half < 2; half++)
            for (int i = 0; i < 4; i++)
                sc[half][i] = _mm_loadu_si128((const __m128i *)((i & 1 ? blk1 : blk0) + 16 + (h * 2 + half) * 32 + 16 * (i / 2)));
        for (int sb = 0; sb < 4; sb++) {
            const int j = 4 * h + sb;
            __m512 dsc[2];
            for (int half = 0; half < 2; half++) {
                const __m128i a = sc[half][sb < 2 ? 0 : 2], c2 = sc[half][sb < 2 ? 1 : 3];
                const __m128i both = (sb & 1) ? _mm_unpackhi_epi64(a, c2) : _mm_unpacklo_epi64(a, c2);
                dsc[half] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(both)));
            }
            Q6_BLOCK_J(dsc[0], dsc[1])
        }
    }
}

/* 4 activation bytes in every lane, each + 128 (unsigned: |a| <= 127, r's <= 64; without VNNI
 * maddubs' pair sums at most 2 * 255 * 32, below its saturation). */
static inline __m512i act4_biased(const int8_t *q) {
    return _mm512_xor_si512(_mm512_set1_epi32(*(const int32_any *)q), _mm512_set1_epi8((char)0x80));
}

/* Both halves' passes (FIELD) of the unpacked sub-block sb's 32 weights at p: each half into its own
 * sums (is0, is1), so each row keeps two chains of products in flight, not one; each sum starts at
 * the half's stored start (q6_unpack8) and adds the activations + 128 times q - 32: sum((q - 32) a). */
#define Q6_PASS2(FIELD)                                                                              \
    {                                                                                                \
        const __m512i s0 = _mm512_load_si512(p + 20 + sb), s1 = _mm512_load_si512(p + U6H + 20 + sb); \
        for (int r = 0; r < R; r++) {                                                                \
            is0[r] = s0;                                                                             \
            is1[r] = s1;                                                                             \
        }                                                                                            \
    }                                                                                                \
    for (int ci = 0; ci < 4; ci++) {                                                                 \
        const __m512i w0 = _mm512_load_si512(p + 4 * sb + ci), w1 = _mm512_load_si512(p + U6H + 4 * sb + ci); \
        for (int r = 0; r < R; r++) {                                                                \
            is0[r] = DPB(is0[r], act4_biased(x[r]->FIELD + 32 * j + 4 * ci), w0);                     \
            is1[r] = DPB(is1[r], act4_biased(x[r]->FIELD + 32 * j + 16 + 4 * ci), w1);                \
        }                                                                                            \
    }

/* acc[r] += (the halves' sums at their scales dsc0, dsc1) times STEP (row r's), as Q6_BLOCK_J sums. */
#define Q6_TERM2(STEP)                                                                                          \
    for (int r = 0; r < R; r++) {                                                                              \
        const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is1[r]), dsc1, _mm512_mul_ps(_mm512_cvtepi32_ps(is0[r]), dsc0)); \
        acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(STEP), acc[r]);                                             \
    }

/* The same for Q6_K: its 16-value sub-blocks in pairs, one pair per activation block of 32, both
 * halves of a pair at once (Q6_BLOCK_J's sums in its order, so the same bits). */
static inline __attribute__((always_inline)) void q6_block8(const __m512i *u, const act_block8 *const *x, int two,
                                                            __m512 *acc, const int R) {
    __m512i is0[XR8], is1[XR8];
    for (int h = 0; h < 2; h++) {
        const __m512i *p = u + h * 2 * U6H;
        for (int sb = 0; sb < 4; sb++) { /* the activation's 32-value block 4h + sb */
            const int j = 4 * h + sb;
            const __m512 dsc0 = _mm512_load_ps((const float *)(p + 16 + sb));
            const __m512 dsc1 = _mm512_load_ps((const float *)(p + U6H + 16 + sb));
            Q6_PASS2(q)
            Q6_TERM2(x[r]->d[j])
            if ((two >> j) & 1) {
                __asm__ volatile("" ::: "memory"); /* the weights loaded again, not held across the pass */
                Q6_PASS2(r)
                Q6_TERM2(x[r]->d[j] * (1.0f / 128.0f))
            }
        }
    }
}

/* x[r] = block b of activation row r (r < R); returns their residual-pass bits or'ed. */
static inline __attribute__((always_inline)) int block_rows(const act_block8 *const *xa, int64_t b,
                                                            const act_block8 **x, const int R) {
    int two = 0;
    for (int r = 0; r < R; r++) {
        x[r] = xa[r] + b;
        two |= x[r]->two;
    }
    return two;
}

/* out[r * ldo + j] (+)= the tile's dot products for r < nr <= R, j < width (16, or 8 where the
 * second group repeats the first); first: store, else add to what out holds. */
static inline __attribute__((always_inline)) void tile8(const __m512i *u, int64_t nb, const act_block8 *const *xa,
                                                        int64_t nr, float *out, int64_t ldo, int width, int first,
                                                        a8_pf *pf, const int type, const int R) {
    __m512 acc[XR8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        a8_pf_step(pf);
        const act_block8 *x[XR8];
        const int two = block_rows(xa, b, x, R);
        if (type == QTYPE_Q6_K) {
            q6_block8(u + b * U6, x, two, acc, R);
        } else {
            q45_block8(u + b * U45, x, two, acc, R);
        }
    }
    const __mmask16 keep = width == 16 ? 0xffff : 0x00ff;
    for (int r = 0; r < R && r < nr; r++) {
        const __m512 prev = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(keep, out + r * ldo);
        _mm512_mask_storeu_ps(out + r * ldo, keep, _mm512_add_ps(prev, acc[r]));
    }
}

/* tile8 with the blocks read where they lie (q45_direct8, q6_direct8, legacy_direct8): out[r * ldo + j] = the tile's dot products, summed a slice (A8_SLICE blocks) at a
 * time as tile8 sums them, so the same bits. next (not NULL): a stream it moves on a step a block. */
static inline __attribute__((always_inline)) void tile8_direct(const uint8_t *g0, const uint8_t *g1, int64_t nb,
                                                               const act_block8 *const *xa, int64_t nr, float *out,
                                                               int64_t ldo, int width, a8_pf *next, const int type,
                                                               const int R) {
    const int legacy = type == QTYPE_Q4_0 || type == QTYPE_Q4_1 || type == QTYPE_Q8_0;
    const int64_t gbb = legacy ? 64 * qtype_x8(type | QTYPE_X8)->block_bytes : 8 * kx8_block_bytes(type);
    const int64_t group = nb * gbb; /* a group's bytes; g1 (width 16) is the group after g0 */
    __m512 acc[XR8], total[XR8];
    for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += A8_SLICE) {
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t b = b0; b < nb && b < b0 + A8_SLICE; b++) {
            const uint8_t *blk0 = g0 + b * gbb, *blk1 = g1 + b * gbb;
            if (next != NULL) a8_pf_step(next);
            /* past its group's end g0's prefetch would land in g1, read beside it now: sent two groups
             * on, to the next tile's second group, which no stream fetches ahead (g1's lands in the
             * next tile's first); quant_mxfp4.c's a8_tile does the same */
            const uint8_t *pf0 = blk0 + KX8_PF + (b * gbb + KX8_PF >= group ? 2 * group : 0);
            for (int64_t at = 0; at < gbb; at += 64) {
                _mm_prefetch((const char *)(pf0 + at), _MM_HINT_T0);
                _mm_prefetch((const char *)(blk1 + KX8_PF + at), _MM_HINT_T0);
            }
            const act_block8 *x[XR8];
            const int two = block_rows(xa, b, x, R);
            if (type == QTYPE_Q6_K) {
                q6_direct8(blk0, blk1, x, two, acc, R);
            } else if (legacy) {
                legacy_direct8(blk0, blk1, x, two, acc, type, R);
            } else {
                q45_direct8(blk0, blk1, x, two, acc, type, R);
            }
        }
        for (int r = 0; r < R; r++) total[r] = _mm512_add_ps(total[r], acc[r]);
    }
    const __mmask16 keep = width == 16 ? 0xffff : 0x00ff;
    for (int r = 0; r < R && r < nr; r++) _mm512_mask_storeu_ps(out + r * ldo, keep, total[r]);
}

/* Up to how many rows a call takes a type by tile8_direct: unpacking a slice to memory first pays for
 * itself only over more row groups than these (docs/benchmarks-history.md, "Few rows on 8 bits"; Q6_K's 6-bit
 * weights, the most work to assemble per row group, from 9 rows since its unpacked passes start from
 * the stored starts and its slices are prefetched while it multiplies: "Prefetching the 8-bit tiles'
 * slices while they multiply"). */
static inline int64_t direct_rows(const int type) { return type == QTYPE_Q4_K ? 32 : 8; }

/* Up to how many bytes a tile's weights (16 rows of wrb) are for tile8_direct's later row groups to
 * fetch the next tile's into L2 while they run (from 3 row groups): the first row group of each tile
 * otherwise waits on memory (KX8_PF is too near for lines from DRAM). Only where the tile stays in L1
 * for the later row groups; with one later row group (9-16 rows), or a tile read from L2, measured
 * slower (docs/benchmarks-history.md, "Q4_K at 24-32 rows: the next tile's weights"). */
#define KX8_NEXT_MAX (32 * 1024)

/* Weight rows [0, nc) x activation rows [0, nr) on 8-bit activations (rows of act_block8): each pair
 * of groups unpacked a slice of blocks at a time, every activation row over the slice; or, for a few
 * rows (direct_rows), each row group over the blocks as they lie (the same bits either way). */
static inline __attribute__((always_inline)) void kx8_loop8(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq,
                                                            int64_t xrb, int64_t nr, int64_t nb, float *out, int64_t ldo,
                                                            const int type) {
    __m512i u[A8_SLICE * U6]; /* the slice unpacked (24 KB; zmm-aligned) */
    const int legacy = type == QTYPE_Q4_0 || type == QTYPE_Q4_1 || type == QTYPE_Q8_0;
    const int64_t gbb = legacy ? 64 * qtype_x8(type | QTYPE_X8)->block_bytes : 8 * kx8_block_bytes(type);
    const int64_t groups = (nr + XR8 - 1) / XR8;
    if (nr <= direct_rows(type)) { /* each row group reads the group blocks where they lie */
        for (int64_t c0 = 0; c0 < nc; c0 += 16) {
            const int width = nc - c0 >= 16 ? 16 : 8;
            const uint8_t *g0 = w + c0 * wrb, *g1 = width == 16 ? g0 + 8 * wrb : g0;
            /* the next tile's two groups (past the call's columns: the thread's next panel), a few lines a block */
            const int64_t lines = 8 * wrb / 64, steps = groups >= 3 && 16 * wrb <= KX8_NEXT_MAX ? (groups - 1) * nb : 0;
            a8_pf next = {{g0 + width * wrb, g0 + (width + 8) * wrb}, steps > 0 ? lines : 0,
                          steps > 0 ? (lines + steps - 1) / steps : 0};
            for (int64_t ag = 0; ag < groups; ag++) {
                const int64_t r0 = nr * ag / groups, rows = nr * (ag + 1) / groups - r0;
                const act_block8 *xa[XR8];
                for (int r = 0; r < XR8; r++) xa[r] = (const act_block8 *)(xq + (r0 + (r < rows ? r : 0)) * xrb);
                float *o = out + r0 * ldo + c0;
                a8_pf *nx = ag > 0 && next.left > 0 ? &next : NULL;
                switch (rows) {
                case 1: tile8_direct(g0, g1, nb, xa, rows, o, ldo, width, nx, type, 1); break;
                case 2: tile8_direct(g0, g1, nb, xa, rows, o, ldo, width, nx, type, 2); break;
                case 3: tile8_direct(g0, g1, nb, xa, rows, o, ldo, width, nx, type, 3); break;
                case 4: tile8_direct(g0, g1, nb, xa, rows, o, ldo, width, nx, type, 4); break;
                case 5: tile8_direct(g0, g1, nb, xa, rows, o, ldo, width, nx, type, 5); break;
                case 6: tile8_direct(g0, g1, nb, xa, rows, o, ldo, width, nx, type, 6); break;
                case 7: tile8_direct(g0, g1, nb, xa, rows, o, ldo, width, nx, type, 7); break;
                default: tile8_direct(g0, g1, nb, xa, rows, o, ldo, width, nx, type, XR8); break;
                }
            }
        }
        return;
    }
    for (int64_t c0 = 0; c0 < nc; c0 += 16) {
        const int width = nc - c0 >= 16 ? 16 : 8;
        const uint8_t *g0 = w + c0 * wrb, *g1 = width == 16 ? g0 + 8 * wrb : g0;
        for (int64_t b0 = 0; b0 < nb; b0 += A8_SLICE) {
            const int64_t sl = nb - b0 < A8_SLICE ? nb - b0 : A8_SLICE;
            if (type == QTYPE_Q6_K) {
                q6_unpack8(g0, g1, b0, sl, u);
            } else if (legacy) {
                legacy_unpack8(g0, g1, b0, sl, u, type);
            } else {
                q45_unpack8(g0, g1, b0, sl, u, type);
            }
            a8_pf pf = a8_pf_start(g0, g1, b0, sl, nb, gbb, groups * sl);
            for (int64_t ag = 0; ag < groups; ag++) {
                const int64_t r0 = nr * ag / groups, rows = nr * (ag + 1) / groups - r0;
                const act_block8 *xa[XR8];
                for (int r = 0; r < XR8; r++) xa[r] = (const act_block8 *)(xq + (r0 + (r < rows ? r : 0)) * xrb) + b0;
                float *o = out + r0 * ldo + c0;
                switch (rows) {
                case 1: tile8(u, sl, xa, rows, o, ldo, width, b0 == 0, &pf, type, 1); break;
                case 2: tile8(u, sl, xa, rows, o, ldo, width, b0 == 0, &pf, type, 2); break;
                case 3: tile8(u, sl, xa, rows, o, ldo, width, b0 == 0, &pf, type, 3); break;
                case 4: tile8(u, sl, xa, rows, o, ldo, width, b0 == 0, &pf, type, 4); break;
                default: tile8(u, sl, xa, rows, o, ldo, width, b0 == 0, &pf, type, XR8); break;
                }
            }
        }
    }
}

/* tile_<type>_a8: kx8_loop8 with the type a constant in each copy */
#define A8_TILE(NAME, TYPE)                                                                                    \
    static void NAME(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,  \
                     int64_t nb, float *out, int64_t ldo) {                                                    \
        kx8_loop8(w, wrb, nc, xq, xrb, nr, nb, out, ldo, TYPE);                                                \
    }
A8_TILE(tile_q4_k_a8, QTYPE_Q4_K)
A8_TILE(tile_q5_k_a8, QTYPE_Q5_K)
A8_TILE(tile_q6_k_a8, QTYPE_Q6_K)
A8_TILE(tile_q4_0_a8, QTYPE_Q4_0)
A8_TILE(tile_q4_1_a8, QTYPE_Q4_1)
#if defined(__AVX512VNNI__)
A8_TILE(tile_q8_0_a8, QTYPE_Q8_0)
#endif

#elif HAVE_AVX2 || HAVE_AVX512
#define XR 2 /* activation rows per tile (16 ymm registers) */

static inline __m256i widen16(const uint8_t *p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)); }

/* a: lanes (row s, pair p) at 2s + p for rows 0-3, b for rows 4-7 -> rows 0-7, pairs summed. */
static inline __m256i fold_pairs(__m256i a, __m256i b) {
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(a, b), 0xD8); /* hadd: rows 0 1 4 5 | 2 3 6 7 */
}

/* Bytes of a chunk (4 of each of the 8 rows) widened to int16 within 128-bit lanes, *lo: rows 0, 1,
 * 4, 5 and *hi: rows 2, 3, 6, 7 (each row's 4 weights side by side, as the madd against pairs2_256
 * needs them): two instructions, no lane crossing, where vpmovzxbw from a register takes three. */
static inline void widen_rows(__m256i v, __m256i *lo, __m256i *hi) {
    *lo = _mm256_unpacklo_epi8(v, _mm256_setzero_si256());
    *hi = _mm256_unpackhi_epi8(v, _mm256_setzero_si256());
}

/* a: lanes (row s, pair p) for rows 0, 1, 4, 5 (widen_rows' lo), b for rows 2, 3, 6, 7 -> rows
 * 0-7, pairs summed: the hadd alone leaves them in order. */
static inline __m256i fold_rows(__m256i a, __m256i b) { return _mm256_hadd_epi32(a, b); }

/* Bit j of each byte of qh at its bit 4 (its other bits: any). The shifts run on 16-bit lanes, so a
 * left shift of 4 would push the high byte's bits 4-7 out of the lane: each bit moves by 4 - j. */
static inline __m256i bit_to4(__m256i qh, int j) {
    return j <= 4 ? _mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - j)) : _mm256_srl_epi16(qh, _mm_cvtsi32_si128(j - 4));
}

/* acc + the madd of a and b, in asm: gcc reassociates a sub-block's adds, makes the products first and
 * spills them (16 ymm) */
static inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
    __m256i t;
    __asm__("vpmaddwd %[b], %[a], %[t]\n\tvpaddd %[t], %[acc], %[acc]"
            : [acc] "+x"(acc), [t] "=&x"(t)
            : [a] "x"(a), [b] "x"(b));
    return acc;
}

/* Sub-blocks j and j + 1's scales times d and mins times dmin (lane s: row s), from q4k_scale_words. */
static inline __attribute__((always_inline)) void q4k_pair_scales_y(const __m256i words[4], __m256 d, __m256 dmin, int j,
                                                                  __m256 *dsc0, __m256 *dsc1, __m256 *dm0, __m256 *dm1) {
    const __m256i scw = j < 4 ? words[0] : words[2], mw = j < 4 ? words[1] : words[3], byte = _mm256_set1_epi32(0xff);
    const __m128i sh0 = _mm_cvtsi32_si128(8 * (j % 4)), sh1 = _mm_cvtsi32_si128(8 * (j % 4) + 8);
    *dsc0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(scw, sh0), byte)));
    *dsc1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(scw, sh1), byte)));
    *dm0 = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(mw, sh0), byte)));
    *dm1 = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(mw, sh1), byte)));
}

static inline __attribute__((always_inline)) void q45_tile(const uint8_t *g, int64_t nb, const act_block16 *const *xa,
                                                           int64_t nr, float *out, int64_t ldo, const int type,
                                                           const int R) {
    const int q5 = type == QTYPE_Q5_K, gbb = 8 * kx8_block_bytes(type), qs_at = q5 ? 384 : 128;
    __m256 acc[XR];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * gbb;
        for (int at = 0; at < gbb; at += 64) prefetch_weights(blk + PF_Q45 * gbb + at);
        __m256i words[4]; /* scales 0-3, mins 0-3, scales 4-7, mins 4-7 */
        q4k_scale_words(blk, words);
        const __m256i m4 = _mm256_set1_epi32(0x0f0f0f0f);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        for (int j = 0; j < 8; j += 2) { /* sub-blocks j (low nibbles) and j + 1 (high) */
            __m256 dsc0, dsc1, dm0, dm1;
            q4k_pair_scales_y(words, d, dmin, j, &dsc0, &dsc1, &dm0, &dm1);
            __m256i ia[XR][4]; /* low nibbles rows 0-3, rows 4-7, high nibbles rows 0-3, rows 4-7 */
            for (int r = 0; r < R; r++)
                for (int i = 0; i < 4; i++) ia[r][i] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const uint8_t *chunk = blk + qs_at + (j / 2 * 8 + c) * 32;
                if (q5) { /* the fifth bits merged on the bytes (once per chunk, not per half), then widened */
                    const __m256i v = _mm256_loadu_si256((const __m256i *)chunk), b5 = _mm256_set1_epi8(16);
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * c));
                    const __m256i lob = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(bit_to4(qh, j), b5));
                    const __m256i hib = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_and_si256(bit_to4(qh, j + 1), b5));
                    __m256i lo[2], hi[2];
                    widen_rows(lob, &lo[0], &lo[1]);
                    widen_rows(hib, &hi[0], &hi[1]);
                    for (int r = 0; r < R; r++) {
                        const act_block16 *x = xa[r] + 8 * b + j;
                        const __m256i p0 = pairs2_256(x[0].q + 4 * c), p1 = pairs2_256(x[1].q + 4 * c);
                        for (int hf = 0; hf < 2; hf++) {
                            ia[r][hf] = _mm256_add_epi32(ia[r][hf], _mm256_madd_epi16(lo[hf], p0));
                            ia[r][2 + hf] = _mm256_add_epi32(ia[r][2 + hf], _mm256_madd_epi16(hi[hf], p1));
                        }
                    }
                    continue;
                }
                for (int hf = 0; hf < 2; hf++) {
                    const __m256i v = widen16(chunk + 16 * hf);
                    const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi16(15)), hi = _mm256_srli_epi16(v, 4);
                    for (int r = 0; r < R; r++) {
                        const act_block16 *x = xa[r] + 8 * b + j;
                        ia[r][hf] = madd_acc(ia[r][hf], lo, pairs2_256(x[0].q + 4 * c));
                        ia[r][2 + hf] = madd_acc(ia[r][2 + hf], hi, pairs2_256(x[1].q + 4 * c));
                    }
                }
            }
            for (int r = 0; r < R; r++) {
                const act_block16 *x = xa[r] + 8 * b + j;
                const __m256 i0 = _mm256_cvtepi32_ps(q5 ? fold_rows(ia[r][0], ia[r][1]) : fold_pairs(ia[r][0], ia[r][1]));
                const __m256 i1 = _mm256_cvtepi32_ps(q5 ? fold_rows(ia[r][2], ia[r][3]) : fold_pairs(ia[r][2], ia[r][3]));
                acc[r] = _mm256_fmadd_ps(i0, _mm256_mul_ps(dsc0, _mm256_set1_ps(x[0].d)), acc[r]);
                acc[r] = _mm256_fmadd_ps(i1, _mm256_mul_ps(dsc1, _mm256_set1_ps(x[1].d)), acc[r]);
                acc[r] = _mm256_fnmadd_ps(dm0, _mm256_set1_ps(x[0].s), acc[r]);
                acc[r] = _mm256_fnmadd_ps(dm1, _mm256_set1_ps(x[1].s), acc[r]);
            }
        }
    }
    for (int r = 0; r < R && r < nr; r++) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

static inline __attribute__((always_inline)) void q6_tile(const uint8_t *g, int64_t nb, const act_block16 *const *xa,
                                                          int64_t nr, float *out, int64_t ldo, const int R) {
    const int gbb = 8 * 210;
    const __m256i low = _mm256_set1_epi8(0x0f), bits = _mm256_set1_epi8(0x30), off = _mm256_set1_epi16(32);
    __m256 acc[XR];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * gbb;
        for (int at = 0; at < gbb; at += 64) prefetch_weights(blk + PF_Q6 * gbb + at);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        for (int h = 0; h < 2; h++)
            for (int half = 0; half < 2; half++)
                for (int t = 0; t < 2; t++) { /* sub-blocks t (low nibbles) and t + 2 (high) */
                    __m256i is[XR][4]; /* sub-block t (widen_rows' lo, hi), sub-block t + 2 (lo, hi) */
                    for (int r = 0; r < R; r++)
                        for (int i = 0; i < 4; i++) is[r][i] = _mm256_setzero_si256();
                    for (int c = 4 * half; c < 4 * half + 4; c++) {
                        /* the 6-bit quants of sub-blocks t (low nibbles, qh bits 2t, 2t + 1) and t + 2 (high
                         * nibbles, bits 2t + 4, 2t + 5) assembled on the chunk's bytes, then widened and
                         * made signed: half the bit work of assembling them on int16 */
                        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 1168 + (h * 8 + c) * 32));
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 144 + ((h * 2 + t) * 8 + c) * 32));
                        const __m256i hb0 = t == 0 ? _mm256_slli_epi16(qh, 4) : _mm256_slli_epi16(qh, 2);
                        const __m256i hb1 = t == 0 ? qh : _mm256_srli_epi16(qh, 2);
                        const __m256i q0 = _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(hb0, bits));
                        const __m256i q1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), _mm256_and_si256(hb1, bits));
                        __m256i w0[2], w1[2];
                        widen_rows(q0, &w0[0], &w0[1]);
                        widen_rows(q1, &w1[0], &w1[1]);
                        for (int hf = 0; hf < 2; hf++) {
                            w0[hf] = _mm256_sub_epi16(w0[hf], off);
                            w1[hf] = _mm256_sub_epi16(w1[hf], off);
                        }
                        for (int r = 0; r < R; r++) {
                            const act_block16 *x = xa[r] + 8 * b + 4 * h;
                            const __m256i p0 = pairs2_256(x[t].q + 4 * c), p1 = pairs2_256(x[t + 2].q + 4 * c);
                            for (int hf = 0; hf < 2; hf++) {
                                is[r][hf] = madd_acc(is[r][hf], w0[hf], p0);
                                is[r][2 + hf] = madd_acc(is[r][2 + hf], w1[hf], p1);
                            }
                        }
                    }
                    /* the scales of sub-block t (pair 0's t-th 8 bytes) and t + 2 (pair 1's) */
                    const uint8_t *s8 = blk + 16 + (h * 2 + half) * 32 + 8 * t;
                    const __m256 sc0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)s8))));
                    const __m256 sc1 =
                        _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(s8 + 16)))));
                    for (int r = 0; r < R; r++) {
                        const act_block16 *x = xa[r] + 8 * b + 4 * h;
                        const __m256 i0 = _mm256_cvtepi32_ps(fold_rows(is[r][0], is[r][1]));
                        const __m256 i1 = _mm256_cvtepi32_ps(fold_rows(is[r][2], is[r][3]));
                        acc[r] = _mm256_fmadd_ps(i0, _mm256_mul_ps(sc0, _mm256_set1_ps(x[t].d)), acc[r]);
                        acc[r] = _mm256_fmadd_ps(i1, _mm256_mul_ps(sc1, _mm256_set1_ps(x[t + 2].d)), acc[r]);
                    }
                }
    }
    for (int r = 0; r < R && r < nr; r++) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

/* One activation row (decode) on AVX2, Q4_K and Q6_K: the 16-bit activations split once per call
 * into their bytes, a = 256 hi + lo (lo unsigned, hi signed: exact for every int16), so each chunk's
 * 4-bit (6-bit) weights, left as bytes, meet them in maddubs: maddubs(lo, q) with q as its signed operand
 * (q >= 0), maddubs(q, hi) with q unsigned. A maddubs gives 32 byte products where the 16-bit
 * tile's madd gives 16 word products: the same multiplies per weight, without the weights' widening,
 * and each (row, pair) int16 lane summed over chunks before one madd widens it (by 1 for lo, by 256
 * for hi) into row s's own int32 lane: no fold of pairs. int16 adds wrap, so only each final sum
 * must fit 16 bits (signed; lo's unsigned from -32768 in q4k_row1): pair sums lo * q <= 2 * 255 * 15
 * (Q4_K; 63 Q6_K), hi * q <= 2 * 128 * 15 (63), summed over as many chunks as that allows (the tiles
 * say). Q6_K's q - 32: q as bytes, the -32 * sum(a)
 * of each 16 values added to the int32 sums (act_split's off16). Every sum is the 16-bit tile's
 * integer, and every float step as there in the same order: the same bits. */
#define KX8_ROW1 1
/* Weight rows a call needs for the split to pay: below 16 it costs about what one group's pass gains
 * (docs/benchmarks-history.md, "AVX2's one-row Q4_K / Q6_K tiles on maddubs"). At one row quant.c gives a call all of a thread's columns (ROW1_PANEL), so the split is paid
 * once per thread and matmul, and the down projection (k = 8192, 48 KB panels of 8 columns at many
 * rows) takes this tile too. */
#define ROW1_MIN_COLS 16
typedef struct {
    uint8_t lo[32]; /* the 32 values' low bytes */
    int8_t hi[32];  /* their high bytes (a >> 8) */
    float d, s;     /* act_block16's */
    int32_t off16[2]; /* -32 * the sum of values 0-15, of 16-31 (Q6_K's q - 32) */
} act_split;

/* n blocks of x split (off16 only where ``sums``: Q6_K): per block, the even and odd bytes of each
 * lane gathered by a vpshufb, then the two halves' qwords placed by a permute each. */
static inline __attribute__((always_inline)) void split_act16(const act_block16 *x, int64_t n, act_split *out, const int sums) {
    const __m256i even_odd = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10,
                                              12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int64_t i = 0; i < n; i++) {
        const __m256i q0 = _mm256_loadu_si256((const __m256i *)x[i].q), q1 = _mm256_loadu_si256((const __m256i *)(x[i].q + 16));
        /* lo 0-7, lo 8-15, hi 0-7, hi 8-15 (and 16-31) */
        const __m256i a = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(q0, even_odd), 0xD8);
        const __m256i b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(q1, even_odd), 0xD8);
        _mm256_storeu_si256((__m256i *)out[i].lo, _mm256_permute2x128_si256(a, b, 0x20));
        _mm256_storeu_si256((__m256i *)out[i].hi, _mm256_permute2x128_si256(a, b, 0x31));
        out[i].d = x[i].d;
        out[i].s = x[i].s;
        if (sums) { /* the sums of values 0-15 and 16-31 at lanes 0 and 1, times -32 */
            const __m256i ones = _mm256_set1_epi16(1);
            const __m256i h = _mm256_hadd_epi32(_mm256_madd_epi16(q0, ones), _mm256_madd_epi16(q1, ones));
            const __m256i h2 = _mm256_hadd_epi32(h, h);
            const __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(h2), _mm256_extracti128_si256(h2, 1));
            _mm_storel_epi64((__m128i *)out[i].off16, _mm_sub_epi32(_mm_setzero_si128(), _mm_slli_epi32(s2, 5)));
        }
    }
}

static inline __m256i bcast4(const void *p) { return _mm256_set1_epi32(*(const int32_any *)p); }

/* s16 + maddubs(a, b), in asm so that gcc keeps each chain an add at a time (as madd_acc) */
static inline __m256i ubs_acc(__m256i s16, __m256i a, __m256i b) {
    __m256i t;
    __asm__("vpmaddubsw %[b], %[a], %[t]\n\tvpaddw %[t], %[acc], %[acc]"
            : [acc] "+x"(s16), [t] "=&x"(t)
            : [a] "x"(a), [b] "x"(b));
    return s16;
}

/* Q4_K: lo's sums over a sub-block's 8 chunks, at most 2 * 255 * 15 * 8 = 61200, fit 16 bits
 * unsigned: the int16 sum starts at -32768 (so it ends in int16's range) and the madd's -65536 is
 * given back by hi's, which starts at 128 a lane (256 * (128 + 128)); hi sums 8 chunks too (2 * 128
 * * 15 * 8 + 128). One madd each per sub-block. */
static inline __attribute__((always_inline)) void q4k_row1(const uint8_t *g, int64_t nb, const act_split *xs, float *out) {
    const int gbb = 8 * 144;
    const __m256i m4 = _mm256_set1_epi32(0x0f0f0f0f), ones = _mm256_set1_epi16(1), k256 = _mm256_set1_epi16(256);
    const __m256i lo_start = _mm256_set1_epi16(-32768), hi_start = _mm256_set1_epi16(128);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * gbb;
        for (int at = 0; at < gbb; at += 64) prefetch_weights(blk + PF_Q45 * gbb + at);
        __m256i words[4]; /* scales 0-3, mins 0-3, scales 4-7, mins 4-7 */
        q4k_scale_words(blk, words);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        for (int j = 0; j < 8; j += 2) { /* sub-blocks j (low nibbles) and j + 1 (high) */
            __m256 dsc0, dsc1, dm0, dm1;
            q4k_pair_scales_y(words, d, dmin, j, &dsc0, &dsc1, &dm0, &dm1);
            const act_split *x = xs + 8 * b + j;
            __m256i l0 = lo_start, l1 = lo_start, h0 = hi_start, h1 = hi_start;
            for (int c = 0; c < 8; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 128 + (j / 2 * 8 + c) * 32));
                const __m256i w0 = _mm256_and_si256(v, m4), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                l0 = ubs_acc(l0, bcast4(x[0].lo + 4 * c), w0);
                l1 = ubs_acc(l1, bcast4(x[1].lo + 4 * c), w1);
                h0 = ubs_acc(h0, w0, bcast4(x[0].hi + 4 * c));
                h1 = ubs_acc(h1, w1, bcast4(x[1].hi + 4 * c));
            }
            const __m256i i0 = _mm256_add_epi32(_mm256_madd_epi16(l0, ones), _mm256_madd_epi16(h0, k256));
            const __m256i i1 = _mm256_add_epi32(_mm256_madd_epi16(l1, ones), _mm256_madd_epi16(h1, k256));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(dsc0, _mm256_set1_ps(x[0].d)), acc);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(dsc1, _mm256_set1_ps(x[1].d)), acc);
            acc = _mm256_fnmadd_ps(dm0, _mm256_set1_ps(x[0].s), acc);
            acc = _mm256_fnmadd_ps(dm1, _mm256_set1_ps(x[1].s), acc);
        }
    }
    _mm256_storeu_ps(out, acc);
}

static inline __attribute__((always_inline)) void q6_chunk_y(const uint8_t *blk, int h, int c, __m256i w[4]);

/* Q6_K: sub-block sb's q (0-63) of a chunk as maddubs' signed operand against lo (its pair sums up
 * to 2 * 255 * 63: widened at once) and as its unsigned one against hi (2 * 63 * 128: two chunks per
 * int16 sum); the 16 values' -32 * sum(a) start each int32 sum. (Lo summed over two chunks as
 * q4k_row1's, from -32768, measured 1.09x slower: the two chunks' 8 vectors spill.) */
static inline __attribute__((always_inline)) void q6_row1(const uint8_t *g, int64_t nb, const act_split *xs, float *out) {
    const int gbb = 8 * 210;
    const __m256i ones = _mm256_set1_epi16(1), k256 = _mm256_set1_epi16(256);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * gbb;
        for (int at = 0; at < gbb; at += 64) prefetch_weights(blk + PF_Q6 * gbb + at);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        for (int h = 0; h < 2; h++)
            for (int half = 0; half < 2; half++) {
                const act_split *x = xs + 8 * b + 4 * h;
                __m256i is[4], hs[4];
                for (int sb = 0; sb < 4; sb++) is[sb] = _mm256_set1_epi32(x[sb].off16[half]);
                for (int c = 4 * half; c < 4 * half + 4; c++) {
                    __m256i w[4];
                    q6_chunk_y(blk, h, c, w);
                    for (int sb = 0; sb < 4; sb++) {
                        const __m256i p = _mm256_maddubs_epi16(w[sb], bcast4(x[sb].hi + 4 * c));
                        hs[sb] = c % 2 ? _mm256_add_epi16(hs[sb], p) : p;
                        is[sb] = madd_acc(is[sb], _mm256_maddubs_epi16(bcast4(x[sb].lo + 4 * c), w[sb]), ones);
                        if (c % 2) is[sb] = madd_acc(is[sb], hs[sb], k256);
                    }
                }
                for (int t = 0; t < 2; t++) { /* sub-blocks t and t + 2, as q6_tile */
                    const uint8_t *s8 = blk + 16 + (h * 2 + half) * 32 + 8 * t;
                    const __m256 sc0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)s8))));
                    const __m256 sc1 =
                        _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(s8 + 16)))));
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[t]), _mm256_mul_ps(sc0, _mm256_set1_ps(x[t].d)), acc);
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[t + 2]), _mm256_mul_ps(sc1, _mm256_set1_ps(x[t + 2].d)), acc);
                }
            }
    }
    _mm256_storeu_ps(out, acc);
}

/* Weight rows [0, nc) x the one activation row at xq (Q4_K or Q6_K): its blocks split once
 * (act_split), then each group in turn. */
static void kx8_row1(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t nb, float *out, const int type) {
    act_split xs[8 * nb];
    split_act16((const act_block16 *)xq, 8 * nb, xs, type == QTYPE_Q6_K);
    for (int64_t c0 = 0; c0 < nc; c0 += 8) {
        if (type == QTYPE_Q6_K)
            q6_row1(w + c0 * wrb, nb, xs, out + c0);
        else
            q4k_row1(w + c0 * wrb, nb, xs, out + c0);
    }
}

/* The 8-bit activations' tiles (act_block8; many rows) on AVX2: the AVX-512 tiles' sums, one group
 * (8 weight rows) at a time, a ymm holding one chunk (4 weights of each of the 8 rows) as unsigned
 * bytes, read where it lies (tile8_direct's way), or for Q4_K and Q6_K from UNPACK_ROWS rows
 * unpacked a slice at a time to memory (kx8_loop_u below). Each (chunk, activation row) is one
 * maddubs against the row's 4 bytes
 * broadcast, its int16 sums added up over a few chunks (dpb16), then a madd by ones into int32
 * lanes (AVX2 has no vpdpbusd): 32 products in a bit over one multiply, where the 16-bit tiles'
 * madd takes 16, and the weights need no widening. Q4_K, Q4_0 and Q4_1 at two rows and more take
 * two groups a pass (tile8_yg: each broadcast meets 16 weight rows).
 * Integer sums as the AVX-512 tiles' (maddubs' int16 pair sums at most 2 * 63 * 127: no
 * saturation; Q8_0, whose unsigned q reach 255, has no tile here), and every float step in the
 * same order per lane, so each output is the AVX-512 builds' bits. */
#define KX8_A8 1
#define XR8 4 /* activation rows per 8-bit tile: 3 vectors each (two sums, one total) in 16 ymm */

/* s16 + the products of w's bytes (unsigned) and q[0..3] (signed) in every lane, summed by 2 into
 * int16: maddubs alone. Its int16 sums take up to 32767 / (2 * 63 * 127) = 2 (Q6_K's q <= 63), 4
 * (Q5_K's q <= 31) or 8 (Q4_K's, Q4_0's, Q4_1's q <= 15) such adds before they must be widened
 * (add16_widen): the multiplier ports, which maddubs and madd share, run half the instructions of a
 * madd per maddubs. */
static inline __m256i dpb16(__m256i s16, __m256i w, const int8_t *q) {
    return _mm256_add_epi16(s16, _mm256_maddubs_epi16(w, _mm256_set1_epi32(*(const int32_any *)q)));
}

/* acc + s16's pairs summed into int32 lanes. */
static inline __m256i add16_widen(__m256i acc, __m256i s16) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
}

/* d * (byte at ``shift`` of each lane of words), lane s: row s; the shift a constant (no shift for
 * the low byte, no mask for the high one). */
static inline __m256 byte_at(__m256i words, const int shift, __m256 d) {
    __m256i b = shift ? _mm256_srli_epi32(words, shift) : words;
    if (shift < 24) b = _mm256_and_si256(b, _mm256_set1_epi32(0xff));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(b));
}

/* acc[r] += the integer sums lo[r], hi[r] (two 32-value blocks) at their scales times row r's steps
 * d[j0], d[j0 + 1] (q45_scale8's order). */
static inline __attribute__((always_inline)) void scale8_y(__m256 *acc, const __m256i *lo, const __m256i *hi, __m256 sc_lo,
                                                           __m256 sc_hi, const act_block8 *const *x, int j0, const int R) {
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[r]), _mm256_mul_ps(sc_lo, _mm256_set1_ps(x[r]->d[j0])), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[r]), _mm256_mul_ps(sc_hi, _mm256_set1_ps(x[r]->d[j0 + 1])), acc[r]);
    }
}

/* acc[r] -= the mins dm_lo, dm_hi times row r's sums s[j0], s[j0 + 1] (q45_mins8's order). */
static inline __attribute__((always_inline)) void mins8_y(__m256 *acc, __m256 dm_lo, __m256 dm_hi, const act_block8 *const *x,
                                                          int j0, const int R) {
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_fnmadd_ps(dm_lo, _mm256_set1_ps(x[r]->s[j0]), acc[r]);
        acc[r] = _mm256_fnmadd_ps(dm_hi, _mm256_set1_ps(x[r]->s[j0 + 1]), acc[r]);
    }
}

/* One pass (FIELD) of Q4_K/Q5_K sub-blocks 2sb, 2sb + 1 (Q45_DIRECT_PASS on one group). */
#define Q45_Y_PASS(FIELD)                                                                                         \
    for (int r = 0; r < R; r++) lo[r] = hi[r] = l16[r] = h16[r] = _mm256_setzero_si256();                        \
    for (int c = 0; c < 8; c++) {                                                                                \
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + qs_at + (sb * 8 + c) * 32));                 \
        __m256i wl = _mm256_and_si256(v, m4), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);                 \
        if (q5) {                                                                                                \
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * c));                        \
            wl = _mm256_or_si256(wl, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * sb), one), 4));     \
            wh = _mm256_or_si256(wh, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * sb + 1), one), 4)); \
        }                                                                                                        \
        for (int r = 0; r < R; r++) {                                                                            \
            l16[r] = dpb16(l16[r], wl, x[r]->FIELD + 64 * sb + 4 * c);                                           \
            h16[r] = dpb16(h16[r], wh, x[r]->FIELD + 64 * sb + 32 + 4 * c);                                      \
            if (c % (q5 ? 4 : 8) == (q5 ? 3 : 7)) { /* (dpb16's limits) */                                        \
                lo[r] = add16_widen(lo[r], l16[r]);                                                              \
                hi[r] = add16_widen(hi[r], h16[r]);                                                              \
                l16[r] = h16[r] = _mm256_setzero_si256();                                                        \
            }                                                                                                    \
        }                                                                                                        \
    }

/* q45_direct8 on one group's block at blk. */
static inline __attribute__((always_inline)) void q45_direct_y(const uint8_t *blk, const act_block8 *const *x, int two,
                                                               __m256 *acc, const int type, const int R) {
    const int q5 = type == QTYPE_Q5_K, qs_at = q5 ? 384 : 128;
    const __m256i m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    __m256i words[4];
    q4k_scale_words(blk, words);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
    __m256i lo[XR8], hi[XR8], l16[XR8], h16[XR8];
#pragma GCC unroll 4
    for (int sb = 0; sb < 4; sb++) {
        const __m256i scw = sb < 2 ? words[0] : words[2], mw = sb < 2 ? words[1] : words[3];
        const int sh = 16 * (sb & 1);
        const __m256 dsc_lo = byte_at(scw, sh, d), dsc_hi = byte_at(scw, sh + 8, d);
        Q45_Y_PASS(q)
        scale8_y(acc, lo, hi, dsc_lo, dsc_hi, x, 2 * sb, R);
        mins8_y(acc, byte_at(mw, sh, dmin), byte_at(mw, sh + 8, dmin), x, 2 * sb, R);
        if ((two >> (2 * sb)) & 3) { /* r's products, at a 128th of q's step */
            Q45_Y_PASS(r)
            scale8_y(acc, lo, hi, _mm256_mul_ps(dsc_lo, _mm256_set1_ps(1.0f / 128.0f)),
                     _mm256_mul_ps(dsc_hi, _mm256_set1_ps(1.0f / 128.0f)), x, 2 * sb, R);
        }
    }
}

/* One pass (FIELD) of Q6_K's 16 weights of sub-block sb at (h, HALF) into is (Q6_DIRECT on one group). */
#define Q6_Y_PASS(FIELD, HALF)                                                                                 \
    for (int r = 0; r < R; r++) is[r] = _mm256_set1_epi32(x[r]->FIELD##off[2 * j + (HALF)]);                  \
    for (int ci = 0; ci < 4; ci++) {                                                                          \
        const int c = 4 * (HALF) + ci;                                                                        \
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 1168 + (h * 8 + c) * 32));              \
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 144 + (h * 16 + 8 * (sb & 1) + c) * 32)); \
        const __m256i nib = sb < 2 ? ql : _mm256_srli_epi16(ql, 4);                                           \
        const __m256i hb = sb == 0   ? _mm256_slli_epi16(qh, 4)                                               \
                           : sb == 1 ? _mm256_slli_epi16(qh, 2)                                               \
                           : sb == 2 ? qh                                                                     \
                                     : _mm256_srli_epi16(qh, 2);                                              \
        const __m256i wq = _mm256_or_si256(_mm256_and_si256(nib, low), _mm256_and_si256(hb, high2));         \
        for (int r = 0; r < R; r++) {                                                                         \
            s16[r] = dpb16(ci % 2 ? s16[r] : _mm256_setzero_si256(), wq, x[r]->FIELD + 32 * j + 16 * (HALF) + 4 * ci); \
            if (ci % 2) is[r] = add16_widen(is[r], s16[r]); /* (dpb16's limits) */                         \
        }                                                                                                     \
    }

/* Both halves' passes (FIELD) of the activation's block j at their scales, times STEP (Q6_BLOCK_J's order). */
#define Q6_Y_BLOCK(FIELD, STEP)                                                                                \
    Q6_Y_PASS(FIELD, 0)                                                                                       \
    for (int r = 0; r < R; r++) t[r] = _mm256_mul_ps(_mm256_cvtepi32_ps(is[r]), dsc[0]);                     \
    Q6_Y_PASS(FIELD, 1)                                                                                       \
    for (int r = 0; r < R; r++) t[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), dsc[1], t[r]);             \
    for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(t[r], _mm256_set1_ps(STEP), acc[r]);

/* q6_direct8 on one group's block at blk. */
static inline __attribute__((always_inline)) void q6_direct_y(const uint8_t *blk, const act_block8 *const *x, int two,
                                                              __m256 *acc, const int R) {
    const __m256i low = _mm256_set1_epi8(0x0f), high2 = _mm256_set1_epi8(0x30);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    __m256i is[XR8], s16[XR8];
    __m256 t[XR8];
    for (int h = 0; h < 2; h++)
        for (int sb = 0; sb < 4; sb++) {
            const int j = 4 * h + sb;
            __m256 dsc[2]; /* the scales of sub-block sb's halves: 8 bytes of the (h, half) run */
            for (int half = 0; half < 2; half++) {
                const uint8_t *s8 = blk + 16 + (h * 2 + half) * 32 + 16 * (sb >> 1) + 8 * (sb & 1);
                dsc[half] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)s8))));
            }
            Q6_Y_BLOCK(q, x[r]->d[j])
            if ((two >> j) & 1) {
                Q6_Y_BLOCK(r, x[r]->d[j] * (1.0f / 128.0f))
            }
        }
}

/* One activation row (decode) on a block without the residual pass: the same integer sums and float
 * steps as q45_direct_y / q6_direct_y at R = 1 (so the same bits), in fewer instructions: each
 * sub-block's scale bytes picked with constant shifts, the accumulator held in a register, and (Q6_K)
 * each ql and qh chunk read once for the four sub-blocks it holds, whose sums the float steps then
 * take in q6_direct_y's order. (With the residual pass the compiler kept a pass's weights for the
 * other, spilling them.) */
static inline __attribute__((always_inline)) __m256 q4k_direct_y1(const uint8_t *blk, const act_block8 *x, __m256 acc) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256i words[4];
    q4k_scale_words(blk, words);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
#pragma GCC unroll 4
    for (int sb = 0; sb < 4; sb++) {
        const __m256i scw = sb < 2 ? words[0] : words[2], mw = sb < 2 ? words[1] : words[3];
        const int sh = 16 * (sb & 1);
        const uint8_t *q = blk + 128 + sb * 256;
        const int8_t *xq = x->q + 64 * sb;
        __m256i l16 = _mm256_setzero_si256(), h16 = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) { /* 8 maddubs of q <= 15 per int16 sum: within dpb16's limits */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
            l16 = dpb16(l16, _mm256_and_si256(v, m4), xq + 4 * c);
            h16 = dpb16(h16, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), xq + 32 + 4 * c);
        }
        const __m256i lo = _mm256_madd_epi16(l16, ones), hi = _mm256_madd_epi16(h16, ones);
        const float *xd = x->d + 2 * sb, *xs = x->s + 2 * sb;
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(byte_at(scw, sh, d), _mm256_set1_ps(xd[0])), acc);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(byte_at(scw, sh + 8, d), _mm256_set1_ps(xd[1])), acc);
        acc = _mm256_fnmadd_ps(byte_at(mw, sh, dmin), _mm256_set1_ps(xs[0]), acc);
        acc = _mm256_fnmadd_ps(byte_at(mw, sh + 8, dmin), _mm256_set1_ps(xs[1]), acc);
    }
    return acc;
}

/* Q6_K's chunk c of h as the 6-bit q of its four sub-blocks, bytes (w[sb]: the low (sb < 2) or high
 * nibbles of ql_(sb % 2), qh's bits 2 sb, 2 sb + 1 at 4, 5). */
static inline __attribute__((always_inline)) void q6_chunk_y(const uint8_t *blk, int h, int c, __m256i w[4]) {
    const __m256i low = _mm256_set1_epi8(0x0f), high2 = _mm256_set1_epi8(0x30);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 1168 + (h * 8 + c) * 32));
    const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 144 + (h * 16 + c) * 32));
    const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 144 + (h * 16 + 8 + c) * 32));
    w[0] = _mm256_or_si256(_mm256_and_si256(ql0, low), _mm256_and_si256(_mm256_slli_epi16(qh, 4), high2));
    w[1] = _mm256_or_si256(_mm256_and_si256(ql1, low), _mm256_and_si256(_mm256_slli_epi16(qh, 2), high2));
    w[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), _mm256_and_si256(qh, high2));
    w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low), _mm256_and_si256(_mm256_srli_epi16(qh, 2), high2));
}

/* Q6_K's 16-weight sums of the four sub-blocks (32 values each) of one h at half ``half`` of their
 * chunks: is[sb] = qoff + sum over the 4 chunks, two maddubs per int16 sum (dpb16's limits). */
static inline __attribute__((always_inline)) void q6_half_y1(const uint8_t *blk, const act_block8 *x, int h, int half,
                                                             __m256i is[4]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int sb = 0; sb < 4; sb++) is[sb] = _mm256_set1_epi32(x->qoff[2 * (4 * h + sb) + half]);
#pragma GCC unroll 2
    for (int cp = 0; cp < 4; cp += 2) {
        __m256i s16[4];
#pragma GCC unroll 2
        for (int ci = cp; ci < cp + 2; ci++) {
            __m256i w[4];
            q6_chunk_y(blk, h, 4 * half + ci, w);
            for (int sb = 0; sb < 4; sb++)
                s16[sb] = dpb16(ci == cp ? _mm256_setzero_si256() : s16[sb], w[sb], x->q + 32 * (4 * h + sb) + 16 * half + 4 * ci);
        }
        for (int sb = 0; sb < 4; sb++) is[sb] = _mm256_add_epi32(is[sb], _mm256_madd_epi16(s16[sb], ones));
    }
}

static inline __attribute__((always_inline)) __m256 q6_direct_y1(const uint8_t *blk, const act_block8 *x, __m256 acc) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    for (int h = 0; h < 2; h++) {
        __m256i is[4];
        __m256 t[4];
        for (int half = 0; half < 2; half++) {
            q6_half_y1(blk, x, h, half, is);
            for (int sb = 0; sb < 4; sb++) { /* the scales of sub-block sb's half: 8 bytes of the (h, half) run */
                const uint8_t *s8 = blk + 16 + (h * 2 + half) * 32 + 16 * (sb >> 1) + 8 * (sb & 1);
                const __m256 dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)s8))));
                t[sb] = half ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[sb]), dsc, t[sb]) : _mm256_mul_ps(_mm256_cvtepi32_ps(is[sb]), dsc);
            }
        }
        for (int sb = 0; sb < 4; sb++) acc = _mm256_fmadd_ps(t[sb], _mm256_set1_ps(x->d[4 * h + sb]), acc);
    }
    return acc;
}

/* Two chunks of the legacy layout (2 bytes of each row, then the next 2) as 4 bytes of each row in
 * turn: legacy_direct8's word order, on one group. */
static inline __m256i legacy_rows(const uint8_t *p) {
    const __m128i a = _mm_loadu_si128((const __m128i *)p), b = _mm_loadu_si128((const __m128i *)(p + 16));
    return _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b));
}

/* One pass (FIELD) of legacy blocks 2sb, 2sb + 1 (LEGACY_DIRECT_PASS for Q4_0, Q4_1 on one group). */
#define LEGACY_Y_PASS(FIELD)                                                                               \
    for (int r = 0; r < R; r++) l16[r] = h16[r] = _mm256_setzero_si256();                                 \
    for (int c = 0; c < 4; c++) {                                                                          \
        const __m256i vl = legacy_rows(l[0] + head + 32 * c), vh = legacy_rows(l[1] + head + 32 * c);     \
        const __m256i wl0 = _mm256_and_si256(vl, m4), wl1 = _mm256_and_si256(_mm256_srli_epi16(vl, 4), m4); \
        const __m256i wh0 = _mm256_and_si256(vh, m4), wh1 = _mm256_and_si256(_mm256_srli_epi16(vh, 4), m4); \
        for (int r = 0; r < R; r++) { /* 8 maddubs of q <= 15 per int16 sum: within dpb16's limits */        \
            l16[r] = dpb16(l16[r], wl0, x[r]->FIELD + 64 * sb + 4 * c);                                    \
            l16[r] = dpb16(l16[r], wl1, x[r]->FIELD + 64 * sb + 16 + 4 * c);                               \
            h16[r] = dpb16(h16[r], wh0, x[r]->FIELD + 64 * sb + 32 + 4 * c);                               \
            h16[r] = dpb16(h16[r], wh1, x[r]->FIELD + 64 * sb + 48 + 4 * c);                               \
        }                                                                                                  \
    }                                                                                                      \
    for (int r = 0; r < R; r++) {                                                                          \
        lo[r] = add16_widen(_mm256_setzero_si256(), l16[r]);                                               \
        hi[r] = add16_widen(_mm256_setzero_si256(), h16[r]);                                               \
    }

/* legacy_direct8 on the 8 legacy blocks of 32 of one group at g that make one 256-weight block. */
static inline __attribute__((always_inline)) void legacy_direct_y(const uint8_t *g, const act_block8 *const *x, int two,
                                                                  __m256 *acc, const int type, const int R) {
    const int bb = qtype_x8(type | QTYPE_X8)->block_bytes, head = type == QTYPE_Q4_1 ? 32 : 16;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i lo[XR8], hi[XR8], l16[XR8], h16[XR8];
    for (int sb = 0; sb < 4; sb++) {
        const uint8_t *l[2] = {g + 2 * sb * 8 * bb, g + (2 * sb + 1) * 8 * bb};
        __m256 dsc[2], dmin[2];
        for (int t = 0; t < 2; t++) {
            dsc[t] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)l[t]));
            dmin[t] = type == QTYPE_Q4_1 ? _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(l[t] + 16))))
                                         : _mm256_mul_ps(dsc[t], _mm256_set1_ps(8.0f));
        }
        LEGACY_Y_PASS(q)
        scale8_y(acc, lo, hi, dsc[0], dsc[1], x, 2 * sb, R);
        mins8_y(acc, dmin[0], dmin[1], x, 2 * sb, R);
        if ((two >> (2 * sb)) & 3) { /* r's products, at a 128th of q's step */
            LEGACY_Y_PASS(r)
            scale8_y(acc, lo, hi, _mm256_mul_ps(dsc[0], _mm256_set1_ps(1.0f / 128.0f)),
                     _mm256_mul_ps(dsc[1], _mm256_set1_ps(1.0f / 128.0f)), x, 2 * sb, R);
        }
    }
}

/* One row's maddubs of a chunk's weights (both groups') against its broadcast activation bytes b,
 * added to its int16 sums s0 (group 0), s1 (group 1). In asm: gcc otherwise adds into a new register
 * and copies it back each chunk, spilling a sum where 8 are live. */
#define YG_DPB(S0, S1, W0, W1, B)                                                                              \
    do {                                                                                                      \
        __m256i t_;                                                                                           \
        if (G > 1)                                                                                            \
            __asm__("vpmaddubsw %[b], %[wa], %[t]\n\tvpaddw %[t], %[sa], %[sa]\n\t"                             \
                    "vpmaddubsw %[b], %[wb], %[t]\n\tvpaddw %[t], %[sb], %[sb]"                                 \
                    : [sa] "+x"(S0), [sb] "+x"(S1), [t] "=&x"(t_) : [wa] "x"(W0), [wb] "x"(W1), [b] "x"(B));  \
        else                                                                                                  \
            __asm__("vpmaddubsw %[b], %[wa], %[t]\n\tvpaddw %[t], %[sa], %[sa]"                                 \
                    : [sa] "+x"(S0), [t] "=&x"(t_) : [wa] "x"(W0), [b] "x"(B));                                \
    } while (0)

/* Row r's sums (s0r, s1r) of one chunk: Q4_K one broadcast (its 4 bytes at a), the legacy types two
 * (a, a + 16: a chunk's low and high nibbles are weights 16 apart). */
#define YG_ROW(r, a)                                                                                          \
    if (R > r) {                                                                                              \
        YG_DPB(s0##r, s1##r, w0, w1, _mm256_set1_epi32(*(const int32_any *)((a) + 4 * c)));                   \
        if (legacy) YG_DPB(s0##r, s1##r, u0, u1, _mm256_set1_epi32(*(const int32_any *)((a) + 16 + 4 * c)));  \
    }

/* Blocks without the residual pass (Q4_K, Q4_0, Q4_1) of G (1-2) groups at once against R rows:
 * each activation broadcast meets both groups' chunks (half the broadcasts a maddubs), and each
 * 32-weight sub-block's int16 sums are widened and scaled as soon as its chunks are in, in
 * q45_direct_y's and legacy_direct_y's order (the first sub-block's term, the second's, then both
 * mins), so no pass keeps its sums: the same bits. blk[g]: group g's 256-weight block. */
static inline __attribute__((always_inline)) void direct_yg(const uint8_t *const *blk, const act_block8 *const *x,
                                                            __m256 (*acc)[XR8], const int type, const int G, const int R) {
    const int legacy = type == QTYPE_Q4_0 || type == QTYPE_Q4_1;
    const int bb = legacy ? qtype_x8(type | QTYPE_X8)->block_bytes : 0, head = type == QTYPE_Q4_1 ? 32 : 16;
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256i words[2][4];
    __m256 d[2], dmin[2];
    if (!legacy)
        for (int g = 0; g < G; g++) {
            q4k_scale_words(blk[g], words[g]);
            d[g] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk[g]));
            dmin[g] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk[g] + 16)));
        }
#pragma GCC unroll 4
    for (int sb = 0; sb < 4; sb++) {
        const int sh = 16 * (sb & 1);
        __m256 dm[2][2]; /* [g][half]: the mins' steps */
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++) { /* sub-block 2 sb + half */
            __m256i s00 = _mm256_setzero_si256(), s01 = s00, s02 = s00, s03 = s00;
            __m256i s10 = s00, s11 = s00, s12 = s00, s13 = s00;
            const uint8_t *q[2];
            for (int g = 0; g < G; g++)
                q[g] = legacy ? blk[g] + (2 * sb + half) * 8 * bb + head : blk[g] + 128 + sb * 256;
            const int at = 64 * sb + 32 * half;
            const int8_t *a0 = x[0]->q + at, *a1 = x[R > 1 ? 1 : 0]->q + at;
            const int8_t *a2 = x[R > 2 ? 2 : 0]->q + at, *a3 = x[R > 3 ? 3 : 0]->q + at;
            const int chunks = legacy ? 4 : 8;
#pragma GCC unroll 1
            for (int c = 0; c < chunks; c++) { /* 8 maddubs of q <= 15 per int16 sum: dpb16's limits */
                __m256i w0, w1 = _mm256_setzero_si256(), u0 = w1, u1 = w1;
                if (legacy) {
                    const __m256i v0 = legacy_rows(q[0] + 32 * c);
                    w0 = _mm256_and_si256(v0, m4);
                    u0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
                    if (G > 1) {
                        const __m256i v1 = legacy_rows(q[G - 1] + 32 * c);
                        w1 = _mm256_and_si256(v1, m4);
                        u1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
                    }
                } else {
                    const __m256i v0 = _mm256_loadu_si256((const __m256i *)(q[0] + 32 * c));
                    w0 = _mm256_and_si256(half ? _mm256_srli_epi16(v0, 4) : v0, m4);
                    if (G > 1) {
                        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(q[G - 1] + 32 * c));
                        w1 = _mm256_and_si256(half ? _mm256_srli_epi16(v1, 4) : v1, m4);
                    }
                }
                YG_ROW(0, a0)
                YG_ROW(1, a1)
                YG_ROW(2, a2)
                YG_ROW(3, a3)
            }
            const __m256i s16[2][XR8] = {{s00, s01, s02, s03}, {s10, s11, s12, s13}};
            for (int g = 0; g < G; g++) {
                __m256 dsc;
                if (legacy) {
                    const uint8_t *l = blk[g] + (2 * sb + half) * 8 * bb;
                    dsc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)l));
                    dm[g][half] = type == QTYPE_Q4_1 ? _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(l + 16))))
                                                     : _mm256_mul_ps(dsc, _mm256_set1_ps(8.0f));
                } else {
                    dsc = byte_at(sb < 2 ? words[g][0] : words[g][2], sh + 8 * half, d[g]);
                    dm[g][half] = byte_at(sb < 2 ? words[g][1] : words[g][3], sh + 8 * half, dmin[g]);
                }
                for (int r = 0; r < R; r++) {
                    const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[g][r], ones));
                    acc[g][r] = _mm256_fmadd_ps(sum, _mm256_mul_ps(dsc, _mm256_set1_ps(x[r]->d[2 * sb + half])), acc[g][r]);
                }
            }
        }
        for (int g = 0; g < G; g++)
            for (int r = 0; r < R; r++) {
                acc[g][r] = _mm256_fnmadd_ps(dm[g][0], _mm256_set1_ps(x[r]->s[2 * sb]), acc[g][r]);
                acc[g][r] = _mm256_fnmadd_ps(dm[g][1], _mm256_set1_ps(x[r]->s[2 * sb + 1]), acc[g][r]);
            }
    }
}
#undef YG_ROW
#undef YG_DPB

/* tile8_y for Q4_K, Q4_0, Q4_1 on the G (1-2) groups at g, g + gstride together: blocks with the
 * residual pass take q45_direct_y / legacy_direct_y per group, the others direct_yg. */
static inline __attribute__((always_inline)) void tile8_yg(const uint8_t *g, int64_t gstride, int64_t nb,
                                                           const act_block8 *const *xa, int64_t nr, float *out,
                                                           int64_t ldo, const int type, const int G, const int R) {
    const int legacy = type == QTYPE_Q4_0 || type == QTYPE_Q4_1;
    const int64_t gbb = legacy ? 64 * qtype_x8(type | QTYPE_X8)->block_bytes : 8 * kx8_block_bytes(type);
    __m256 acc[2][XR8], total[2][XR8];
    for (int q = 0; q < G; q++)
        for (int r = 0; r < R; r++) total[q][r] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += A8_SLICE) {
        for (int q = 0; q < G; q++)
            for (int r = 0; r < R; r++) acc[q][r] = _mm256_setzero_ps();
        for (int64_t b = b0; b < nb && b < b0 + A8_SLICE; b++) {
            const uint8_t *blk[2] = {g + b * gbb, g + gstride + b * gbb};
            for (int q = 0; q < G; q++) {
#pragma GCC unroll 32
                for (int64_t at = 0; at < gbb; at += 64) _mm_prefetch((const char *)(blk[q] + KX8_PF + at), _MM_HINT_T0);
            }
            const act_block8 *x[XR8];
            int two = 0;
            for (int r = 0; r < R; r++) {
                x[r] = xa[r] + b;
                two |= x[r]->two;
            }
            if (!two) {
                direct_yg(blk, x, acc, type, G, R);
            } else if (legacy) {
                for (int q = 0; q < G; q++) legacy_direct_y(blk[q], x, two, acc[q], type, R);
            } else {
                for (int q = 0; q < G; q++) q45_direct_y(blk[q], x, two, acc[q], type, R);
            }
        }
        for (int q = 0; q < G; q++)
            for (int r = 0; r < R; r++) total[q][r] = _mm256_add_ps(total[q][r], acc[q][r]);
    }
    for (int q = 0; q < G; q++)
        for (int r = 0; r < R && r < nr; r++) _mm256_storeu_ps(out + 8 * q + r * ldo, total[q][r]);
}

/* out[r * ldo + s] = dot(row s of the group at g, activation row r) for s < 8, r < nr <= R, summed
 * a slice (A8_SLICE blocks) at a time as the AVX-512 tiles sum. */
static inline __attribute__((always_inline)) void tile8_y(const uint8_t *g, int64_t nb, const act_block8 *const *xa,
                                                          int64_t nr, float *out, int64_t ldo, const int type, const int R) {
    const int legacy = type == QTYPE_Q4_0 || type == QTYPE_Q4_1;
    const int64_t gbb = legacy ? 64 * qtype_x8(type | QTYPE_X8)->block_bytes : 8 * kx8_block_bytes(type);
    const int64_t pf1 = (type == QTYPE_Q6_K ? PF_Q6 : PF_Q45) * gbb;
    __m256 acc[XR8], total[XR8];
    for (int r = 0; r < R; r++) total[r] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += A8_SLICE) {
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = b0; b < nb && b < b0 + A8_SLICE; b++) {
            const uint8_t *blk = g + b * gbb;
            if (R == 1) { /* one row streams W from memory: the 16-bit tiles' distance and hint */
#pragma GCC unroll 32
                for (int64_t at = 0; at < gbb; at += 64) prefetch_weights(blk + pf1 + at);
            } else {
#pragma GCC unroll 32
                for (int64_t at = 0; at < gbb; at += 64) _mm_prefetch((const char *)(blk + KX8_PF + at), _MM_HINT_T0);
            }
            const act_block8 *x[XR8];
            int two = 0;
            for (int r = 0; r < R; r++) {
                x[r] = xa[r] + b;
                two |= x[r]->two;
            }
            if (R == 1 && !two && type == QTYPE_Q4_K) {
                acc[0] = q4k_direct_y1(blk, x[0], acc[0]);
            } else if (R == 1 && !two && type == QTYPE_Q6_K) {
                acc[0] = q6_direct_y1(blk, x[0], acc[0]);
            } else if (type == QTYPE_Q6_K) { /* each with a copy for blocks without the residual */
                if (two) {                    /* pass, where no pass's weights are kept for the other */
                    q6_direct_y(blk, x, two, acc, R);
                } else {
                    q6_direct_y(blk, x, 0, acc, R);
                }
            } else if (legacy) {
                if (two) {
                    legacy_direct_y(blk, x, two, acc, type, R);
                } else {
                    legacy_direct_y(blk, x, 0, acc, type, R);
                }
            } else if (two) {
                q45_direct_y(blk, x, two, acc, type, R);
            } else {
                q45_direct_y(blk, x, 0, acc, type, R);
            }
        }
        for (int r = 0; r < R; r++) total[r] = _mm256_add_ps(total[r], acc[r]);
    }
    for (int r = 0; r < R && r < nr; r++) _mm256_storeu_ps(out + r * ldo, total[r]);
}

/* Many rows (UNPACK_ROWS and up) on Q4_K and Q6_K: each group pair's blocks unpacked a slice
 * (A8_SLICE blocks) at a time to bytes in L1 (Q4_K: the nibbles; Q6_K: the 6-bit q), each with its
 * sub-blocks' float scales, and every row group of the call passes over the slice before the next:
 * the nibble masks and shifts (Q6_K: the bit assembly, ~5 instructions a chunk) and the scale bytes'
 * conversion run once a slice, not once a row group, and a pass's chunk loop is loads, maddubs and
 * adds. The same integer sums and, per output lane, the same float steps in the same order as
 * direct_yg and q45_direct_y / q6_direct_y, summed into out a slice at a time as tile8_yg's totals:
 * the same bits. Blocks with the residual pass take it from the slice too (its r bytes against the
 * same unpacked weights): read where they lie, a row group's pass unpacked the block again and
 * broadcast each activation word to one maddubs (~30% of the Llama-1B Q4_K_M decode32 step's Q4_K
 * tile acting as avx2; docs/benchmarks-history.md, "AVX2's many-row K-quant tiles: the residual
 * pass from the unpacked slice"). */
#define U_BLOCK 160 /* ymm per unpacked block of a group pair: 8 activation blocks (j) x 20 */

/* Prefetches (into L2) of the next slice's lines of both groups, a few per block pass, so they come in
 * while the slice multiplies (an unpacking that waits on memory runs no maddubs). */
typedef struct {
    const uint8_t *p[2];
    int64_t left, per;
} u_pf;

static inline u_pf u_pf_next(const uint8_t *g0, const uint8_t *g1, int64_t b0, int64_t sl, int64_t nb, int64_t gbb,
                             int64_t steps) {
    const int64_t group = nb * gbb, next = b0 + sl;
    /* past the pair's last slice: the next pair's first (its groups two groups on) */
    const int64_t at = next < nb ? next * gbb : 2 * group, lines = (next < nb ? (nb - next < A8_SLICE ? nb - next : A8_SLICE) : A8_SLICE) * gbb / 64;
    return (u_pf){{g0 + at, g1 + at}, lines, (lines + steps - 1) / steps};
}

static inline void u_pf_step(u_pf *pf) {
    for (int64_t i = 0; i < pf->per && pf->left > 0; i++, pf->left--) {
        _mm_prefetch((const char *)pf->p[0], _MM_HINT_T1);
        _mm_prefetch((const char *)pf->p[1], _MM_HINT_T1);
        pf->p[0] += 64;
        pf->p[1] += 64;
    }
}

/* Q4_K blocks [b0, b0 + sl) of the groups at g0, g1 unpacked to u: per block and activation block j
 * (sub-block j of the 8 rows), chunk c of group g at 2c + g (its 4 weights of each row as bytes), then
 * group g's d * scale at 16 + 2g and dmin * min at 17 + 2g (byte_at, as direct_yg takes them). */
__attribute__((noinline)) static void q4k_unpack_y(const uint8_t *g0, const uint8_t *g1, int64_t b0, int64_t sl, __m256i *u) {
    const int gbb = 8 * 144;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < sl; b++)
        for (int g = 0; g < 2; g++) {
            const uint8_t *blk = (g ? g1 : g0) + (b0 + b) * gbb;
            __m256i words[4];
            q4k_scale_words(blk, words);
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
            for (int sb = 0; sb < 4; sb++) {
                __m256i *lo = u + b * U_BLOCK + (2 * sb) * 20, *hi = lo + 20;
                for (int c = 0; c < 8; c++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 128 + sb * 256 + 32 * c));
                    _mm256_store_si256(lo + 2 * c + g, _mm256_and_si256(v, m4));
                    _mm256_store_si256(hi + 2 * c + g, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
                }
                const int sh = 16 * (sb & 1);
                const __m256i scw = sb < 2 ? words[0] : words[2], mw = sb < 2 ? words[1] : words[3];
                _mm256_store_ps((float *)(lo + 16 + 2 * g), byte_at(scw, sh, d));
                _mm256_store_ps((float *)(lo + 17 + 2 * g), byte_at(mw, sh, dmin));
                _mm256_store_ps((float *)(hi + 16 + 2 * g), byte_at(scw, sh + 8, d));
                _mm256_store_ps((float *)(hi + 17 + 2 * g), byte_at(mw, sh + 8, dmin));
            }
        }
}

/* Q6_K blocks [b0, b0 + sl) of the groups at g0, g1 unpacked to u: per block, activation block j = 4h
 * + sb and half (its 16 values), chunk ci < 4 of group g at 10 half + 2 ci + g (the 6-bit q as bytes,
 * q6_direct_y's assembly), then group g's d * scale at 10 half + 8 + g. */
__attribute__((noinline)) static void q6_unpack_y(const uint8_t *g0, const uint8_t *g1, int64_t b0, int64_t sl, __m256i *u) {
    const int gbb = 8 * 210;
    for (int64_t b = 0; b < sl; b++)
        for (int g = 0; g < 2; g++) {
            const uint8_t *blk = (g ? g1 : g0) + (b0 + b) * gbb;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            for (int h = 0; h < 2; h++)
                for (int c = 0; c < 8; c++) {
                    const int half = c / 4, ci = c % 4;
                    __m256i w[4];
                    q6_chunk_y(blk, h, c, w);
                    for (int sb = 0; sb < 4; sb++)
                        _mm256_store_si256(u + b * U_BLOCK + (4 * h + sb) * 20 + 10 * half + 2 * ci + g, w[sb]);
                }
            for (int j = 0; j < 8; j++)
                for (int half = 0; half < 2; half++) {
                    const int h = j / 4, sb = j % 4;
                    const uint8_t *s8 = blk + 16 + (h * 2 + half) * 32 + 16 * (sb >> 1) + 8 * (sb & 1);
                    const __m256 dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)s8))));
                    _mm256_store_ps((float *)(u + b * U_BLOCK + j * 20 + 10 * half + 8 + g), dsc);
                }
        }
}

/* s + the maddubs of w and b, in asm (YG_DPB's reason). */
#define U_DPB(S, W, B)                                                                              \
    do {                                                                                            \
        __m256i t_;                                                                                 \
        __asm__("vpmaddubsw %[b], %[w], %[t]\n\tvpaddw %[t], %[s], %[s]"                            \
                : [s] "+x"(S), [t] "=&x"(t_) : [w] "x"(W), [b] "x"(B));                              \
    } while (0)
#define U_BCAST(p) _mm256_set1_epi32(*(const int32_any *)(p))

/* Row r's maddubs of chunk c (both groups) against its FIELD (q, or r: the residual pass) bytes of
 * activation block jj */
#define U4_ROW(r, FIRST, FIELD)                                                                     \
    if (R > r) {                                                                                    \
        const __m256i b_ = U_BCAST(x[r]->FIELD + 32 * jj + 4 * c);                                  \
        if (FIRST) {                                                                                \
            s0##r = _mm256_maddubs_epi16(w0, b_);                                                   \
            s1##r = _mm256_maddubs_epi16(w1, b_);                                                   \
        } else {                                                                                    \
            U_DPB(s0##r, w0, b_);                                                                   \
            U_DPB(s1##r, w1, b_);                                                                   \
        }                                                                                           \
    }
#define U4_CHUNK(FIRST, FIELD)                                                                      \
    {                                                                                               \
        const __m256i w0 = _mm256_load_si256(q + 2 * c), w1 = _mm256_load_si256(q + 2 * c + 1);    \
        U4_ROW(0, FIRST, FIELD)                                                                     \
        U4_ROW(1, FIRST, FIELD)                                                                     \
        U4_ROW(2, FIRST, FIELD)                                                                     \
        U4_ROW(3, FIRST, FIELD)                                                                     \
    }
/* Sub-block jj's (unpacked at q) int16 sums s<g><r> against FIELD: 8 maddubs of q <= 15 (by |q| <=
 * 127 or |r| <= 64) per int16 sum, within dpb16's limits; then acc[g][r] += their int32 sums at
 * SC<g> times row r's step (direct_yg's and q45_direct_y's terms). */
#define U4_PASS(FIELD, SC0, SC1)                                                                    \
    {                                                                                               \
        __m256i s00, s01, s02, s03, s10, s11, s12, s13;                                             \
        s01 = s02 = s03 = s11 = s12 = s13 = _mm256_setzero_si256();                                 \
        {                                                                                           \
            const int c = 0;                                                                        \
            U4_CHUNK(1, FIELD)                                                                      \
        }                                                                                           \
        _Pragma("GCC unroll 1") for (int c = 1; c < 8; c++) U4_CHUNK(0, FIELD)                      \
        const __m256 sc0_ = (SC0), sc1_ = (SC1);                                                    \
        U4_TERM(0, 0) U4_TERM(0, 1) U4_TERM(0, 2) U4_TERM(0, 3)                                     \
        U4_TERM(1, 0) U4_TERM(1, 1) U4_TERM(1, 2) U4_TERM(1, 3)                                     \
    }
#define U4_TERM(g, r)                                                                               \
    if (R > r)                                                                                      \
        acc[g][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s##g##r, ones)),          \
                                    _mm256_mul_ps(sc##g##_, _mm256_set1_ps(x[r]->d[jj])), acc[g][r]);

/* One unpacked Q4_K block (p) of a group pair against R rows: direct_yg's sums and float steps, per
 * lane in its order (each sub-block's term, then after each pair both mins); where the rows' two
 * marks the pair (2sb, 2sb + 1), then the residual pass's terms of both at a 128th of q's scale,
 * q45_direct_y's order: so the blocks with the residual pass are summed from the unpacked slice too,
 * with q45_direct_y's bits. */
static inline __attribute__((always_inline)) void q4k_block_u(const __m256i *p, const act_block8 *const *x, int two,
                                                              __m256 (*acc)[XR8], const int R) {
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 1
    for (int j = 0; j < 8; j++) {
        {
            const int jj = j;
            const __m256i *q = p + 20 * jj;
            U4_PASS(q, _mm256_load_ps((const float *)(q + 16)), _mm256_load_ps((const float *)(q + 18)))
        }
        if (j & 1) { /* both mins of the pair j - 1, j */
            const __m256i *q = p + 20 * j;
            for (int g = 0; g < 2; g++) {
                const __m256 dm_lo = _mm256_load_ps((const float *)(q - 20 + 17 + 2 * g));
                const __m256 dm_hi = _mm256_load_ps((const float *)(q + 17 + 2 * g));
                for (int r = 0; r < R; r++) {
                    acc[g][r] = _mm256_fnmadd_ps(dm_lo, _mm256_set1_ps(x[r]->s[j - 1]), acc[g][r]);
                    acc[g][r] = _mm256_fnmadd_ps(dm_hi, _mm256_set1_ps(x[r]->s[j]), acc[g][r]);
                }
            }
            if ((two >> (j - 1)) & 3) { /* r's products, at a 128th of q's step */
                const __m256 k128 = _mm256_set1_ps(1.0f / 128.0f);
#pragma GCC unroll 1
                for (int jj = j - 1; jj <= j; jj++) {
                    const __m256i *q = p + 20 * jj;
                    U4_PASS(r, _mm256_mul_ps(_mm256_load_ps((const float *)(q + 16)), k128),
                            _mm256_mul_ps(_mm256_load_ps((const float *)(q + 18)), k128))
                }
            }
        }
    }
}
#undef U4_TERM
#undef U4_PASS
#undef U4_CHUNK
#undef U4_ROW

/* One pass (q, or the residual r: res) of an unpacked Q6_K activation block j of group g against R
 * rows at row r's step times STEP: q6_direct_y's Q6_Y_BLOCK. */
static inline __attribute__((always_inline)) void q6_pass_u(const __m256i *p, int g, int j, const act_block8 *const *x,
                                                            __m256 *acc, const int res, const int R) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 t[XR8];
#pragma GCC unroll 2
    for (int half = 0; half < 2; half++) {
        const __m256i *q = p + 20 * j + 10 * half;
        __m256i is[XR8];
        for (int r = 0; r < R; r++) is[r] = _mm256_set1_epi32(res ? x[r]->roff[2 * j + half] : x[r]->qoff[2 * j + half]);
#pragma GCC unroll 2
        for (int cp = 0; cp < 4; cp += 2) { /* two maddubs of q <= 63 per int16 sum: dpb16's limits */
            const __m256i w0 = _mm256_load_si256(q + 2 * cp + g), w1 = _mm256_load_si256(q + 2 * cp + 2 + g);
            for (int r = 0; r < R; r++) {
                const int8_t *a = (res ? x[r]->r : x[r]->q) + 32 * j + 16 * half + 4 * cp;
                __m256i s = _mm256_maddubs_epi16(w0, U_BCAST(a));
                U_DPB(s, w1, U_BCAST(a + 4));
                is[r] = _mm256_add_epi32(is[r], _mm256_madd_epi16(s, ones));
            }
        }
        const __m256 dsc = _mm256_load_ps((const float *)(q + 8 + g));
        for (int r = 0; r < R; r++)
            t[r] = half ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), dsc, t[r]) : _mm256_mul_ps(_mm256_cvtepi32_ps(is[r]), dsc);
    }
    for (int r = 0; r < R; r++)
        acc[r] = _mm256_fmadd_ps(t[r], _mm256_set1_ps(res ? x[r]->d[j] * (1.0f / 128.0f) : x[r]->d[j]), acc[r]);
}

/* One unpacked Q6_K block (p) of one group (g) against R rows: q6_direct_y's sums and float steps,
 * per lane in its order (each activation block's q pass, then its residual pass where the rows' two
 * marks it), so the blocks with the residual pass are summed from the unpacked slice too. */
static inline __attribute__((always_inline)) void q6_block_u(const __m256i *p, int g, const act_block8 *const *x, int two,
                                                             __m256 *acc, const int R) {
    for (int j = 0; j < 8; j++) {
        q6_pass_u(p, g, j, x, acc, 0, R);
        if ((two >> j) & 1) q6_pass_u(p, g, j, x, acc, 1, R);
    }
}

/* out[r * ldo + 8g + s] (+)= the dot products of a slice (sl blocks, unpacked at u) for r < nr <= R,
 * g < G; first: store, else add to what out holds (tile8_yg's slice totals). */
static inline __attribute__((always_inline)) void tile8_u(const __m256i *u, int64_t b0, int64_t sl, const act_block8 *const *xa,
                                                          int64_t nr, float *out, int64_t ldo, int first, u_pf *pf,
                                                          const int type, const int G, const int R) {
    __m256 acc[2][XR8];
    for (int g = 0; g < G; g++)
        for (int r = 0; r < R; r++) acc[g][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < sl; b++) {
        u_pf_step(pf);
        const act_block8 *x[XR8];
        int two = 0;
        for (int r = 0; r < R; r++) {
            x[r] = xa[r] + b0 + b;
            two |= x[r]->two;
        }
        if (type == QTYPE_Q6_K) { /* each with a copy for blocks without the residual pass */
            if (two) {
                for (int g = 0; g < G; g++) q6_block_u(u + b * U_BLOCK, g, x, two, acc[g], R);
            } else {
                for (int g = 0; g < G; g++) q6_block_u(u + b * U_BLOCK, g, x, 0, acc[g], R);
            }
        } else if (two) {
            q4k_block_u(u + b * U_BLOCK, x, two, acc, R);
        } else {
            q4k_block_u(u + b * U_BLOCK, x, 0, acc, R);
        }
    }
    for (int g = 0; g < G; g++)
        for (int r = 0; r < R && r < nr; r++) {
            float *o = out + r * ldo + 8 * g;
            _mm256_storeu_ps(o, _mm256_add_ps(first ? _mm256_setzero_ps() : _mm256_loadu_ps(o), acc[g][r]));
        }
}
#undef U_DPB
#undef U_BCAST

/* From how many rows Q4_K and Q6_K unpack their slices (below: the blocks read where they lie): from
 * avx2's A8_MIN_ROWS (quant.py), the fewest rows it takes them on 8 bits, the unpacked slices ran the
 * faster (docs/benchmarks-history.md, "AVX2's K-quants: slices unpacked once"). */
#define UNPACK_ROWS 5

/* kx8_loop8 for Q4_K and Q6_K from UNPACK_ROWS rows: per pair of groups (a last lone group: its
 * unpacked slice holds it twice, G = 1 reads the first), a slice unpacked, then every row group. */
static inline __attribute__((always_inline)) void kx8_loop_u(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq,
                                                             int64_t xrb, int64_t nr, int64_t nb, float *out, int64_t ldo,
                                                             const int type) {
    __m256i u[A8_SLICE * U_BLOCK]; /* 20 KB */
    const int64_t gbb = 8 * kx8_block_bytes(type), groups = (nr + XR8 - 1) / XR8;
    for (int64_t c0 = 0; c0 < nc; c0 += 16) {
        const int pair = c0 + 16 <= nc;
        const uint8_t *g0 = w + c0 * wrb, *g1 = pair ? g0 + 8 * wrb : g0;
        for (int64_t b0 = 0; b0 < nb; b0 += A8_SLICE) {
            const int64_t sl = nb - b0 < A8_SLICE ? nb - b0 : A8_SLICE;
            if (type == QTYPE_Q6_K) {
                q6_unpack_y(g0, g1, b0, sl, u);
            } else {
                q4k_unpack_y(g0, g1, b0, sl, u);
            }
            u_pf pf = u_pf_next(g0, g1, b0, sl, nb, gbb, groups * sl);
            for (int64_t ag = 0; ag < groups; ag++) {
                const int64_t r0 = nr * ag / groups, rows = nr * (ag + 1) / groups - r0;
                const act_block8 *xa[XR8];
                for (int r = 0; r < XR8; r++) xa[r] = (const act_block8 *)(xq + (r0 + (r < rows ? r : 0)) * xrb);
                float *o = out + r0 * ldo + c0;
                if (pair) {
                    switch (rows) {
                    case 1: tile8_u(u, b0, sl, xa, rows, o, ldo, b0 == 0, &pf, type, 2, 1); break;
                    case 2: tile8_u(u, b0, sl, xa, rows, o, ldo, b0 == 0, &pf, type, 2, 2); break;
                    case 3: tile8_u(u, b0, sl, xa, rows, o, ldo, b0 == 0, &pf, type, 2, 3); break;
                    default: tile8_u(u, b0, sl, xa, rows, o, ldo, b0 == 0, &pf, type, 2, XR8); break;
                    }
                } else {
                    switch (rows) {
                    case 1: tile8_u(u, b0, sl, xa, rows, o, ldo, b0 == 0, &pf, type, 1, 1); break;
                    case 2: tile8_u(u, b0, sl, xa, rows, o, ldo, b0 == 0, &pf, type, 1, 2); break;
                    case 3: tile8_u(u, b0, sl, xa, rows, o, ldo, b0 == 0, &pf, type, 1, 3); break;
                    default: tile8_u(u, b0, sl, xa, rows, o, ldo, b0 == 0, &pf, type, 1, XR8); break;
                    }
                }
            }
        }
    }
}

/* Weight rows [0, nc) (whole groups) x activation rows [0, nr) on 8-bit activations: per group,
 * the activation rows in near-equal groups of at most XR8 (the group's blocks stay in L1/L2 while
 * they pass). */
static inline __attribute__((always_inline)) void kx8_loop8(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq,
                                                            int64_t xrb, int64_t nr, int64_t nb, float *out, int64_t ldo,
                                                            const int type) {
    if ((type == QTYPE_Q4_K || type == QTYPE_Q6_K) && nr >= UNPACK_ROWS) {
        kx8_loop_u(w, wrb, nc, xq, xrb, nr, nb, out, ldo, type);
        return;
    }
    const int64_t groups = (nr + XR8 - 1) / XR8;
    for (int64_t c0 = 0; c0 < nc; c0 += 8) {
        const uint8_t *g = w + c0 * wrb;
        const int yg = type != QTYPE_Q6_K && type != QTYPE_Q5_K && nr > 1, pair = yg && c0 + 16 <= nc; /* two groups a pass */
        for (int64_t ag = 0; ag < groups; ag++) {
            const int64_t r0 = nr * ag / groups, rows = nr * (ag + 1) / groups - r0;
            const act_block8 *xa[XR8];
            for (int r = 0; r < XR8; r++) xa[r] = (const act_block8 *)(xq + (r0 + (r < rows ? r : 0)) * xrb);
            float *o = out + r0 * ldo + c0;
            if (pair) {
                switch (rows) {
                case 2: tile8_yg(g, 8 * wrb, nb, xa, rows, o, ldo, type, 2, 2); break;
                case 3: tile8_yg(g, 8 * wrb, nb, xa, rows, o, ldo, type, 2, 3); break;
                default: tile8_yg(g, 8 * wrb, nb, xa, rows, o, ldo, type, 2, XR8); break;
                }
                continue;
            }
            if (yg && rows > 1) {
                switch (rows) {
                case 2: tile8_yg(g, 0, nb, xa, rows, o, ldo, type, 1, 2); break;
                case 3: tile8_yg(g, 0, nb, xa, rows, o, ldo, type, 1, 3); break;
                default: tile8_yg(g, 0, nb, xa, rows, o, ldo, type, 1, XR8); break;
                }
                continue;
            }
            switch (rows) {
            case 1: tile8_y(g, nb, xa, rows, o, ldo, type, 1); break;
            case 2: tile8_y(g, nb, xa, rows, o, ldo, type, 2); break;
            case 3: tile8_y(g, nb, xa, rows, o, ldo, type, 3); break;
            default: tile8_y(g, nb, xa, rows, o, ldo, type, XR8); break;
            }
        }
        c0 += pair ? 8 : 0;
    }
}

/* tile_<type>_a8: kx8_loop8 with the type a constant in each copy */
#define A8_TILE(NAME, TYPE)                                                                                    \
    static void NAME(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,  \
                     int64_t nb, float *out, int64_t ldo) {                                                    \
        kx8_loop8(w, wrb, nc, xq, xrb, nr, nb, out, ldo, TYPE);                                                \
    }
A8_TILE(tile_q4_k_a8, QTYPE_Q4_K)
A8_TILE(tile_q5_k_a8, QTYPE_Q5_K)
A8_TILE(tile_q6_k_a8, QTYPE_Q6_K)
A8_TILE(tile_q4_0_a8, QTYPE_Q4_0)
A8_TILE(tile_q4_1_a8, QTYPE_Q4_1)
#endif

#ifdef XR
/* Weight rows [0, nc) (nc a multiple of 8, the first at a group's start) x activation rows [0, nr):
 * activation rows in near-equal groups of at most XR, each group over every weight group in turn. */
static inline __attribute__((always_inline)) void kx8_loop(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq,
                                                           int64_t xrb, int64_t nr, int64_t nb, float *out, int64_t ldo,
                                                           const int type) {
#ifdef KX8_ROW1 /* (Q5_K stays on the 16-bit tile: its fifth bits' merge leaves the split no gain, measured slower) */
    if (nr == 1 && type != QTYPE_Q5_K && nc >= ROW1_MIN_COLS) {
        kx8_row1(w, wrb, nc, xq, nb, out, type);
        return;
    }
#endif
    const int64_t groups = (nr + XR - 1) / XR;
    for (int64_t ag = 0; ag < groups; ag++) {
        const int64_t r0 = nr * ag / groups, rows = nr * (ag + 1) / groups - r0;
        const act_block16 *xa[XR];
        for (int r = 0; r < XR; r++) xa[r] = (const act_block16 *)(xq + (r0 + (r < rows ? r : 0)) * xrb);
        for (int64_t c0 = 0; c0 < nc; c0 += 8) {
            const uint8_t *g = w + c0 * wrb;
            float *o = out + r0 * ldo + c0;
            if (type == QTYPE_Q6_K) {
                switch (rows) {
                case 1: q6_tile(g, nb, xa, rows, o, ldo, 1); break;
#if XR > 2
                case 2: q6_tile(g, nb, xa, rows, o, ldo, 2); break;
                case 3: q6_tile(g, nb, xa, rows, o, ldo, 3); break;
#endif
                default: q6_tile(g, nb, xa, rows, o, ldo, XR); break;
                }
            } else {
                switch (rows) {
                case 1: q45_tile(g, nb, xa, rows, o, ldo, type, 1); break;
#if XR > 2
                case 2: q45_tile(g, nb, xa, rows, o, ldo, type, 2); break;
                case 3: q45_tile(g, nb, xa, rows, o, ldo, type, 3); break;
#endif
                default: q45_tile(g, nb, xa, rows, o, ldo, type, XR); break;
                }
            }
        }
    }
}
#define KX8_LOOP(TYPE) kx8_loop(w, wrb, nc, xq, xrb, nr, nb, out, ldo, TYPE)

#else /* portable: each row of a group rebuilt in the file's layout, then quant_k.c's plain-C tile */

static inline void kx8_plain(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                             int64_t nb, float *out, int64_t ldo, const int type) {
    const int bb = kx8_block_bytes(type);
    const qtype_ops *plain_ops = qtype_k(type);
    uint8_t row[wrb];
    for (int64_t c0 = 0; c0 < nc; c0 += 8)
        for (int s = 0; s < 8; s++) {
            for (int64_t b = 0; b < nb; b++) plain_block_k(w + c0 * wrb + b * 8 * bb, s, type, row + b * bb);
            plain_ops->tile(row, wrb, 1, xq, xrb, nr, nb, out + c0 + s, ldo);
        }
}
#define KX8_LOOP(TYPE) kx8_plain(w, wrb, nc, xq, xrb, nr, nb, out, ldo, TYPE)
#endif

static void tile_q4_k(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                      int64_t nb, float *out, int64_t ldo) {
    KX8_LOOP(QTYPE_Q4_K);
}
static void tile_q5_k(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                      int64_t nb, float *out, int64_t ldo) {
    KX8_LOOP(QTYPE_Q5_K);
}
static void tile_q6_k(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                      int64_t nb, float *out, int64_t ldo) {
    KX8_LOOP(QTYPE_Q6_K);
}

static void slot_q4_k(const uint8_t *g, int s, int64_t k, float *out) { dequant_slot_k(g, s, k, out, QTYPE_Q4_K); }
static void slot_q5_k(const uint8_t *g, int s, int64_t k, float *out) { dequant_slot_k(g, s, k, out, QTYPE_Q5_K); }
static void slot_q6_k(const uint8_t *g, int s, int64_t k, float *out) { dequant_slot_k(g, s, k, out, QTYPE_Q6_K); }
static void group_q4_k(const uint8_t *g, int64_t k, float *out) {
    for (int s = 0; s < 8; s++) dequant_slot_k(g, s, k, out + s * k, QTYPE_Q4_K);
}
static void group_q5_k(const uint8_t *g, int64_t k, float *out) {
    for (int s = 0; s < 8; s++) dequant_slot_k(g, s, k, out + s * k, QTYPE_Q5_K);
}
static void group_q6_k(const uint8_t *g, int64_t k, float *out) {
    for (int s = 0; s < 8; s++) dequant_slot_k(g, s, k, out + s * k, QTYPE_Q6_K);
}

#define ACT_BYTES (8 * (int)sizeof(act_block16)) /* per 256 weights */
static const qtype_ops OPS_Q4_K = {QTYPE_Q4_K | QTYPE_X8, QK, 144, ACT_BYTES, quantize_act16, tile_q4_k,
                                   NULL, slot_q4_k, group_q4_k};
static const qtype_ops OPS_Q5_K = {QTYPE_Q5_K | QTYPE_X8, QK, 176, ACT_BYTES, quantize_act16, tile_q5_k,
                                   NULL, slot_q5_k, group_q5_k};
static const qtype_ops OPS_Q6_K = {QTYPE_Q6_K | QTYPE_X8, QK, 210, ACT_BYTES, quantize_act16, tile_q6_k,
                                   NULL, slot_q6_k, group_q6_k};

#ifdef KX8_A8
#define A8_OPS(NAME, TYPE, BYTES, TILE, SLOT, GROUP)                                                             \
    static const qtype_ops NAME = {TYPE | QTYPE_X8 | QTYPE_A8, QK, BYTES, (int)sizeof(act_block8), quantize_act8, \
                                   TILE, NULL, SLOT, GROUP};
A8_OPS(OPS_Q4_K_A8, QTYPE_Q4_K, 144, tile_q4_k_a8, slot_q4_k, group_q4_k)
A8_OPS(OPS_Q5_K_A8, QTYPE_Q5_K, 176, tile_q5_k_a8, slot_q5_k, group_q5_k)
A8_OPS(OPS_Q6_K_A8, QTYPE_Q6_K, 210, tile_q6_k_a8, slot_q6_k, group_q6_k)
/* the legacy types: a "block" of 8 blocks of 32 (the act_block8's 256), dequantized by quant_x8.c */
static void slot_x8(const uint8_t *g, int s, int64_t k, float *out, int type) { qtype_x8(type | QTYPE_X8)->dequant_slot(g, s, k, out); }
static void group_x8(const uint8_t *g, int64_t k, float *out, int type) { qtype_x8(type | QTYPE_X8)->dequant_group(g, k, out); }
static void slot_q4_0(const uint8_t *g, int s, int64_t k, float *out) { slot_x8(g, s, k, out, QTYPE_Q4_0); }
static void slot_q4_1(const uint8_t *g, int s, int64_t k, float *out) { slot_x8(g, s, k, out, QTYPE_Q4_1); }
static void group_q4_0(const uint8_t *g, int64_t k, float *out) { group_x8(g, k, out, QTYPE_Q4_0); }
static void group_q4_1(const uint8_t *g, int64_t k, float *out) { group_x8(g, k, out, QTYPE_Q4_1); }
A8_OPS(OPS_Q4_0_A8, QTYPE_Q4_0, 8 * 18, tile_q4_0_a8, slot_q4_0, group_q4_0)
A8_OPS(OPS_Q4_1_A8, QTYPE_Q4_1, 8 * 20, tile_q4_1_a8, slot_q4_1, group_q4_1)
#if defined(__AVX512VNNI__) /* Q8_0's unsigned q (up to 255) would saturate maddubs' pair sums */
static void slot_q8_0(const uint8_t *g, int s, int64_t k, float *out) { slot_x8(g, s, k, out, QTYPE_Q8_0); }
static void group_q8_0(const uint8_t *g, int64_t k, float *out) { group_x8(g, k, out, QTYPE_Q8_0); }
A8_OPS(OPS_Q8_0_A8, QTYPE_Q8_0, 8 * 34, tile_q8_0_a8, slot_q8_0, group_q8_0)
#endif
#endif

const qtype_ops *qtype_kx8(int type) {
    switch (type) {
#ifdef KX8_A8
    case QTYPE_Q4_K | QTYPE_X8 | QTYPE_A8: return &OPS_Q4_K_A8;
    case QTYPE_Q5_K | QTYPE_X8 | QTYPE_A8: return &OPS_Q5_K_A8;
    case QTYPE_Q6_K | QTYPE_X8 | QTYPE_A8: return &OPS_Q6_K_A8;
    case QTYPE_Q4_0 | QTYPE_X8 | QTYPE_A8: return &OPS_Q4_0_A8;
    case QTYPE_Q4_1 | QTYPE_X8 | QTYPE_A8: return &OPS_Q4_1_A8;
#if defined(__AVX512VNNI__)
    case QTYPE_Q8_0 | QTYPE_X8 | QTYPE_A8: return &OPS_Q8_0_A8;
#endif
#endif
    case QTYPE_Q4_K | QTYPE_X8: return &OPS_Q4_K;
    case QTYPE_Q5_K | QTYPE_X8: return &OPS_Q5_K;
    case QTYPE_Q6_K | QTYPE_X8: return &OPS_Q6_K;
    default: return NULL;
    }
}
