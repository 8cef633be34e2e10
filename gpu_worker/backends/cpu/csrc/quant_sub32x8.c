/* Q5_0, Q5_1, IQ4_NL and IQ4_XS (quant_sub32.c draws the file's blocks) with their weight rows interleaved by 8, the
 * layout the worker holds them in (backends/cpu/layouts.py makes it at load: the same bytes,
 * rearranged). Type code: the ggml type | QTYPE_X8; | QTYPE_A8 for the 8-bit activations' tiles.
 *
 * Rows 8g .. 8g + 7 form group g, stored where the file's rows were; block b of the 8 rows is one
 * group block of 8 * block_bytes at b * 8 * block_bytes:
 *   8 fp16 d (row 0 .. 7) | Q5_1: 8 fp16 m | Q5: qh: byte j (j < 4) of rows 0 .. 7, then byte j + 1
 *   (32) | quant chunks c < 4: bytes 4c .. 4c + 3 of row 0, of row 1, ..., of row 7 (4 x 32).
 *   IQ4_XS (a block of 256, 1088 bytes): 8 fp16 d | 8 x 2 bytes of scale highs | 8 x 4 bytes of scale
 *   lows | per sub-block i < 8 of 32 weights its 4 chunks as above (8 x 128). Its sub-block's scale
 *   d (ls - 32) is made for the 8 rows at once (shifts and masks of the rows' words: exact); the
 *   8-bit tiles make all 8 sub-blocks' for their 16 rows once a block, and on AVX-512 once a panel (the
 *   first activation rows' tiles store them in a table the others read).
 * A chunk's low nibbles are weights 4c .. 4c + 3 of each row, its high nibbles 16 + 4c .. 19 + 4c;
 * their fifth bits are bits 4c .. 4c + 3 of qh byte c / 2 (low) and of byte 2 + c / 2 (high), bit
 * 4 (c % 2) + i for weight i of the four. A chunk is one ymm: 4 bytes (one 32-bit lane) per row.
 * The tiles assemble a chunk's 5-bit weights as bytes in registers: the row's qh byte spread to its
 * lane's 4 bytes by one byte shuffle, tested against the 4 weights' bits, 16 added where set.
 *
 * IQ4_NL's nibbles index its 16 levels (-127 .. 113): one byte shuffle a chunk, signed bytes.
 * Q5's weights meet the activations unsigned (q, 0..31): Q5_0's -16 is taken off once per block as
 * 16 d times the activation block's sum s, and Q5_1 adds m s, as quant_x8.c does for Q4_0 / Q4_1.
 *   16-bit activations (act_block16; few rows, decode): a chunk widened to int16 (rows 0-3, rows
 *     4-7), madd against the activation's 4 matching values broadcast per 64 bits: each (row, pair)
 *     sum in its own lane; per block the pairs folded by one hadd (rows in the order 0 1 4 5 2 3 6 7,
 *     met by the scales permuted alike), converted once and scaled by the 8 rows' d at once. A lane
 *     sums 16 products of q <= 31 and |x| <= 32767: below 2^24, exact in float32 too. AVX-512: the
 *     chunk widened to one zmm (row s's pairs in lanes 2s, 2s + 1), the pairs added in place of the
 *     hadd: the same integers and float steps, so the same bits.
 *   8-bit activations (act8_32, quant.h; many rows): vpdpbusd (maddubs + madd without VNNI) of the
 *     chunk's unsigned bytes against the activation's 4 bytes broadcast, no widening and no fold;
 *     two groups side by side in a zmm (16 weight rows) on AVX-512, one group a ymm against 8
 *     activation rows on AVX2. A lane sums 8 products of q <= 31 by |x| <= 127; maddubs' int16 pair
 *     sums reach 2 * 31 * 127, four of them 31,496, below its saturation: AVX2 adds four before
 *     widening. IQ4_NL's signed levels: vpdpbusd meets them plus 128 (unsigned, a table of their
 *     own), its sums starting at -128 times the activation's integer sum (act8_32's qoff, stored by the
 *     quantizer, so a tile row's start is one broadcast load); maddubs meets |level| and
 *     the activation with the level's sign (pair sums at most 2 * 127 * 127), widened at once: the
 *     same exact integer sum either way.
 * Every build that has the 8-bit tiles sums the same integers and runs the same float steps per
 * (row, column, block), in the same order, so its outputs are the same bits (tested).
 * Portable: the 16-bit tile rebuilds each row in the file's layout for quant_sub32.c's plain tile;
 * the 8-bit tile is plain C over the same integers (a reference; quant.py never routes to it).
 */
#include "quant.h"
#include "rivulet_kernels.h"

#define QB 32
#ifndef S32X8_PF
#define S32X8_PF 2048 /* how far ahead (bytes) the 8-bit tiles prefetch their group's blocks */
#endif
#ifndef S32X8_PF16
#define S32X8_PF16 8192 /* the 16-bit tile's (few rows, each block streamed once a step: further ahead) */
#endif

static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* quantize_act8_32 a block at a time: absmax and sum |x| over the 32 values at once, sum |x| in one
 * order on every build (a tree: value i with i + 16, then + 8, + 4, + 2, + 1), q and r rounded to
 * nearest even as rintf, each 16's integer sums taken from the stored bytes. */
#if defined(__AVX2__)
/* 32 int8 -> the sums of bytes 0-15 and 16-31, exactly (psadbw on the bytes + 128). */
static inline void sums16(__m256i v, int32_t *sum) {
    const __m256i s = _mm256_sad_epu8(_mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)), _mm256_setzero_si256());
    const __m256i t = _mm256_add_epi64(s, _mm256_shuffle_epi32(s, 0x4e));
    sum[0] = _mm256_cvtsi256_si32(t) - 2048;
    sum[1] = _mm_cvtsi128_si32(_mm256_extracti128_si256(t, 1)) - 2048;
}
/* The tree's last steps on lanes i, i + 8 added: lane i with i + 4, + 2, + 1; the max alike. */
static inline float tree8(__m256 t) {
    __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    u = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
}
static inline float max8(__m256 t) {
    __m128 u = _mm_max_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    u = _mm_max_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_max_ss(u, _mm_movehdup_ps(u)));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
static inline __m256i bytes32(__m512 t0, __m512 t1) { /* rint of 32 floats (|t| <= 127) as int8 */
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(_mm512_cvtps_epi32(t0))),
                                   _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(t1)), 1);
}
static inline __m512 left16(__m512 t) { /* (t - rint(t)) * 128: exact */
    return _mm512_mul_ps(_mm512_sub_ps(t, _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT)), _mm512_set1_ps(128.0f));
}
/* One block's q (and r where two) stored, their 16s' sums in sq, sr; returns two. */
static inline int block8(const float *v, float *amax, act8_32 *o, int32_t *sq, int32_t *sr) {
    const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), sign = _mm512_set1_ps(-0.0f);
    const __m512 a0 = _mm512_andnot_ps(sign, v0), a1 = _mm512_andnot_ps(sign, v1);
    const __m512 m = _mm512_max_ps(a0, a1), s = _mm512_add_ps(a0, a1);
    const float mx = max8(_mm256_max_ps(_mm512_castps512_ps256(m), _mm512_extractf32x8_ps(m, 1)));
    const float sum = tree8(_mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1)));
    const __m512 inv = _mm512_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
    const __m512 t0 = _mm512_mul_ps(v0, inv), t1 = _mm512_mul_ps(v1, inv);
    const int two = mx * 32.0f > ACT8_SPREAD * sum;
    const __m256i q = bytes32(t0, t1), r = two ? bytes32(left16(t0), left16(t1)) : _mm256_setzero_si256();
    _mm256_storeu_si256((__m256i *)o->q, q);
    _mm256_storeu_si256((__m256i *)o->r, r);
    sums16(q, sq);
    if (two) sums16(r, sr);
    *amax = mx;
    return two;
}
#elif defined(__AVX2__)
static inline __m256i bytes32(const __m256 *t) { /* rint of 32 floats (|t| <= 127) as int8, in order */
    const __m256i a = _mm256_packs_epi32(_mm256_cvtps_epi32(t[0]), _mm256_cvtps_epi32(t[1]));
    const __m256i b = _mm256_packs_epi32(_mm256_cvtps_epi32(t[2]), _mm256_cvtps_epi32(t[3]));
    return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
static inline int block8(const float *v, float *amax, act8_32 *o, int32_t *sq, int32_t *sr) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 x[4], a[4], t[4];
    for (int j = 0; j < 4; j++) x[j] = _mm256_loadu_ps(v + 8 * j), a[j] = _mm256_andnot_ps(sign, x[j]);
    const float mx = max8(_mm256_max_ps(_mm256_max_ps(a[0], a[2]), _mm256_max_ps(a[1], a[3])));
    const float sum = tree8(_mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3])));
    const __m256 inv = _mm256_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
    for (int j = 0; j < 4; j++) t[j] = _mm256_mul_ps(x[j], inv);
    const int two = mx * 32.0f > ACT8_SPREAD * sum;
    const __m256i q = bytes32(t);
    _mm256_storeu_si256((__m256i *)o->q, q);
    sums16(q, sq);
    for (int j = 0; j < 4 && two; j++)
        t[j] = _mm256_mul_ps(_mm256_sub_ps(t[j], _mm256_round_ps(t[j], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)),
                             _mm256_set1_ps(128.0f));
    const __m256i r = two ? bytes32(t) : _mm256_setzero_si256();
    _mm256_storeu_si256((__m256i *)o->r, r);
    if (two) sums16(r, sr);
    *amax = mx;
    return two;
}
#else
static inline int block8(const float *v, float *amax, act8_32 *o, int32_t *sq, int32_t *sr) {
    float m[16], s[16], mx = 0.0f;
#pragma omp simd
    for (int i = 0; i < 16; i++) {
        const float a = fabsf(v[i]), b = fabsf(v[i + 16]);
        m[i] = a > b ? a : b, s[i] = a + b;
    }
#define TREE_STEP(W)                                                             \
    for (int i = 0; i < (W); i++) s[i] += s[i + (W)], m[i] = m[i] > m[i + (W)] ? m[i] : m[i + (W)];
    TREE_STEP(8) TREE_STEP(4) TREE_STEP(2) TREE_STEP(1)
#undef TREE_STEP
    mx = m[0];
    const float inv = mx > 0.0f ? 127.0f / mx : 0.0f;
    const int two = mx * 32.0f > ACT8_SPREAD * s[0];
    for (int h = 0; h < 2; h++) {
        int32_t a = 0, c = 0;
#pragma omp simd reduction(+ : a, c)
        for (int i = 16 * h; i < 16 * h + 16; i++) {
            const float t = v[i] * inv, q = rintf(t); /* |t| <= 127 */
            const int32_t r = two ? (int32_t)rintf((t - q) * 128.0f) : 0; /* |r| <= 64 */
            o->q[i] = (int8_t)q, o->r[i] = (int8_t)r;
            a += (int32_t)q, c += r;
        }
        sq[h] = a, sr[h] = c;
    }
    *amax = mx;
    return two;
}
#endif

void quantize_act8_32(const float *x, int64_t k, void *xq) {
    act8_32 *out = (act8_32 *)xq;
    for (int64_t b = 0; b < k / QB; b++) {
        float amax;
        int32_t sq[2], sr[2] = {0, 0};
        const int two = block8(x + b * QB, &amax, out + b, sq, sr);
        const float d = amax / 127.0f;
        out[b].d = d;
        out[b].s = (d * (float)sq[0] + d / 128.0f * (float)sr[0]) + (d * (float)sq[1] + d / 128.0f * (float)sr[1]);
        out[b].two = two;
        out[b].qsum = sq[0] + sq[1];
        out[b].rsum = sr[0] + sr[1];
        out[b].qoff = -128 * (sq[0] + sq[1]);
    }
}

static inline int bb_of(const int type) {
    return type == QTYPE_Q5_1 ? 24 : type == QTYPE_Q5_0 ? 22 : type == QTYPE_IQ4_XS ? 136 : 18;
}
static inline int is_xs(const int type) { return type == QTYPE_IQ4_XS; }
static inline int subs_of(const int type) { return is_xs(type) ? 8 : 1; } /* sub-blocks of 32 a block */
static inline int head_of(const int type) { return type == QTYPE_Q5_1 ? 32 : 16; } /* d [, m] of a group block */
static inline int is_q5(const int type) { return type == QTYPE_Q5_0 || type == QTYPE_Q5_1; }
static inline int qs_of(const int type) { return head_of(type) + (is_q5(type) ? 32 : 0); } /* the chunks' start */
/* The group block that holds sub-block b (of 32 weights), and where sub-block b's 4 chunks start in it. */
static inline const uint8_t *group_block(const uint8_t *g, int64_t b, const int type) {
    return g + b / subs_of(type) * 8 * bb_of(type);
}
static inline const uint8_t *chunks_at(const uint8_t *blk, int64_t b, const int type) {
    return is_xs(type) ? blk + 64 + b % 8 * 128 : blk + qs_of(type);
}

/* Slot s's block (of the group block at blk) rebuilt as the file's block. */
static inline void plain_block(const uint8_t *blk, int s, const int type, uint8_t *plain) {
    if (is_xs(type)) {
        memcpy(plain, blk + 2 * s, 2);
        memcpy(plain + 2, blk + 16 + 2 * s, 2);
        memcpy(plain + 4, blk + 32 + 4 * s, 4);
        for (int i = 0; i < 8; i++)
            for (int c = 0; c < 4; c++) memcpy(plain + 8 + 16 * i + 4 * c, blk + 64 + 128 * i + 32 * c + 4 * s, 4);
        return;
    }
    const int head = head_of(type), qh_at = type == QTYPE_Q5_1 ? 4 : 2, qs_at = qh_at + (is_q5(type) ? 4 : 0);
    memcpy(plain, blk + 2 * s, 2);
    if (type == QTYPE_Q5_1) memcpy(plain + 2, blk + 16 + 2 * s, 2);
    for (int j = 0; j < 4 && is_q5(type); j++) plain[qh_at + j] = blk[head + 8 * j + s];
    for (int c = 0; c < 4; c++) memcpy(plain + qs_at + 4 * c, blk + qs_of(type) + 32 * c + 4 * s, 4);
}

/* Row s of the group at g (k weights) as float32: each block rebuilt, then quant_sub32.c's own
 * dequantization, so the values are exactly gguf-py's. */
static inline void dequant_slot(const uint8_t *g, int s, int64_t k, float *out, const int type) {
    const int bb = bb_of(type), bw = QB * subs_of(type);
    const qtype_ops *plain_ops = qtype_sub32(type);
    uint8_t plain[136];
    for (int64_t b = 0; b < k / bw; b++) {
        plain_block(g + b * 8 * bb, s, type, plain);
        plain_ops->dequant_row(plain, bw, out + b * bw);
    }
}

#if HAVE_AVX2 || HAVE_AVX512

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define XR 4 /* activation rows per 16-bit tile (32 ymm registers) */
#else
#define XR 2 /* (16 ymm registers) */
#endif

typedef int32_t __attribute__((may_alias, aligned(1))) i32_any;
typedef int64_t __attribute__((may_alias, aligned(1))) i64_any;

/* Per 128-bit lane: the byte of row 4h + t (of the 8 bytes broadcast) in the 4 bytes of lane t. */
static inline __m256i spread_index(void) {
    return _mm256_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7,
                            7, 7);
}
/* The bits of a chunk's 4 weights in their qh byte: weight i at bit 4 (c % 2) + i. */
static inline __m256i bit_pattern(const int odd) { return _mm256_set1_epi32(odd ? (int)0x80402010 : 0x08040201); }

/* Chunk c of the group block at blk as bytes, lane s row s: *lo weights 4c .. 4c + 3, *hi 16 + 4c ..
 * 19 + 4c; Q5's 5-bit unsigned, IQ4_NL's levels (signed). */
static inline __attribute__((always_inline)) void chunk_bytes(const uint8_t *blk, const uint8_t *q, int c,
                                                              const int type, __m256i *lo, __m256i *hi) {
    const uint8_t *qh = blk + head_of(type), *qs = q + 32 * c;
    const __m256i v = _mm256_loadu_si256((const __m256i *)qs), m4 = _mm256_set1_epi8(0x0f);
    if (!is_q5(type)) {
        const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_LEVELS));
        *lo = _mm256_shuffle_epi8(levels, _mm256_and_si256(v, m4));
        *hi = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
        return;
    }
    const __m256i bits = bit_pattern(c % 2), sixteen = _mm256_set1_epi8(16);
    const __m256i hl = _mm256_shuffle_epi8(_mm256_set1_epi64x(*(const i64_any *)(qh + 8 * (c / 2))), spread_index());
    const __m256i hh = _mm256_shuffle_epi8(_mm256_set1_epi64x(*(const i64_any *)(qh + 16 + 8 * (c / 2))), spread_index());
    const __m256i nl = _mm256_and_si256(v, m4), nh = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    *lo = _mm256_mask_add_epi8(nl, _mm256_test_epi8_mask(hl, bits), nl, sixteen);
    *hi = _mm256_mask_add_epi8(nh, _mm256_test_epi8_mask(hh, bits), nh, sixteen);
#else
    *lo = _mm256_or_si256(nl, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hl, bits), bits), sixteen));
    *hi = _mm256_or_si256(nh, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hh, bits), bits), sixteen));
#endif
}

static inline __m256i widen(__m128i v, const int type) { /* 16 bytes to int16: Q5's unsigned, IQ4_NL's signed */
    return is_q5(type) ? _mm256_cvtepu8_epi16(v) : _mm256_cvtepi8_epi16(v);
}

static inline __m256i pairs2(const int16_t *q) { /* q[0..3] in every 64-bit lane */
    return _mm256_set1_epi64x(*(const i64_any *)q);
}

/* The 8 rows' scales of sub-block b in the group block at blk: d, or IQ4_XS's d (ls - 32), ls's low 4
 * bits nibble b % 8 of the row's lows word, its high 2 bits bits 2 (b % 8) of its highs. */
static inline __m256 scales8(const uint8_t *blk, int64_t b, const int type) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    if (!is_xs(type)) return d;
    const int i = (int)(b % 8);
    const __m256i lows = _mm256_srl_epi32(_mm256_loadu_si256((const __m256i *)(blk + 32)), _mm_cvtsi32_si128(4 * i));
    const __m256i highs = _mm256_srl_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(blk + 16))),
                                           _mm_cvtsi32_si128(2 * i));
    const __m256i ls = _mm256_or_si256(_mm256_and_si256(lows, _mm256_set1_epi32(15)),
                                       _mm256_slli_epi32(_mm256_and_si256(highs, _mm256_set1_epi32(3)), 4));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#if defined(__AVX512VNNI__)
#define DPW16(acc, a, b) _mm512_dpwssd_epi32((acc), (a), (b))
#else
#define DPW16(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16((a), (b)))
#endif

/* out[r * ldo + s] = dot(row s of the group at g, activation row r), s < 8, r < nr <= R. A chunk's 32
 * bytes widened to one zmm of int16 (lanes 2s, 2s + 1: row s's two pairs), met by the activation's 4
 * matching values broadcast per 64 bits; per block each row's two pair sums added (lane 2s) and met
 * by its scale spread to both lanes: the ymm tile's integers and float steps, so its bits. Two sums a
 * row (low and high nibbles) keep the products' dependency chains short at one row. */
static inline __attribute__((always_inline)) void tile16(const uint8_t *g, int64_t nb, const act_block16 *const *xa,
                                                         int64_t nr, float *out, int64_t ldo, const int type,
                                                         const int R) {
    const int gbb = 8 * bb_of(type);
    const __m512i pair = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
    __m512 acc[XR];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb * subs_of(type); b++) {
        const uint8_t *blk = group_block(g, b, type), *q = chunks_at(blk, b, type);
        if (b % subs_of(type) == 0)
            for (int at = 0; at < gbb; at += 64) prefetch_weights(blk + S32X8_PF16 + at);
        __m512i sl[XR], sh[XR];
        for (int r = 0; r < R; r++) sl[r] = sh[r] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            __m256i lo, hi;
            chunk_bytes(blk, q, c, type, &lo, &hi);
            const __m512i l = is_q5(type) ? _mm512_cvtepu8_epi16(lo) : _mm512_cvtepi8_epi16(lo);
            const __m512i h = is_q5(type) ? _mm512_cvtepu8_epi16(hi) : _mm512_cvtepi8_epi16(hi);
            for (int r = 0; r < R; r++) {
                sl[r] = DPW16(sl[r], l, _mm512_set1_epi64(*(const i64_any *)(xa[r][b].q + 4 * c)));
                sh[r] = DPW16(sh[r], h, _mm512_set1_epi64(*(const i64_any *)(xa[r][b].q + 16 + 4 * c)));
            }
        }
        const __m512 d = _mm512_permutexvar_ps(pair, _mm512_castps256_ps512(scales8(blk, b, type)));
        const __m512 m = type == QTYPE_Q5_1 ? _mm512_permutexvar_ps(pair, _mm512_castps256_ps512(_mm256_cvtph_ps(
                                                                            _mm_loadu_si128((const __m128i *)(blk + 16)))))
                                            : _mm512_mul_ps(d, _mm512_set1_ps(-16.0f));
        for (int r = 0; r < R; r++) {
            const __m512i s = _mm512_add_epi32(sl[r], sh[r]);
            const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(s, _mm512_shuffle_epi32(s, _MM_PERM_CDAB)));
            acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(xa[r][b].d)), acc[r]);
            if (is_q5(type)) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xa[r][b].s), acc[r]);
        }
    }
    for (int r = 0; r < R && r < nr; r++)
        _mm256_storeu_ps(out + r * ldo, _mm512_castps512_ps256(_mm512_permutexvar_ps(even, acc[r])));
}
#else
/* out[r * ldo + s] = dot(row s of the group at g, activation row r), s < 8, r < nr <= R. */
static inline __attribute__((always_inline)) void tile16(const uint8_t *g, int64_t nb, const act_block16 *const *xa,
                                                         int64_t nr, float *out, int64_t ldo, const int type,
                                                         const int R) {
    const int gbb = 8 * bb_of(type);
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7); /* hadd's rows; its own inverse */
    __m256 acc[XR];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb * subs_of(type); b++) {
        const uint8_t *blk = group_block(g, b, type), *q = chunks_at(blk, b, type);
        if (b % subs_of(type) == 0)
            for (int at = 0; at < gbb; at += 64) prefetch_weights(blk + S32X8_PF16 + at);
        __m256i sa[XR], sb[XR];
        for (int r = 0; r < R; r++) sa[r] = sb[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i lo, hi;
            chunk_bytes(blk, q, c, type, &lo, &hi);
            const __m256i la = widen(_mm256_castsi256_si128(lo), type), lb = widen(_mm256_extracti128_si256(lo, 1), type);
            const __m256i ha = widen(_mm256_castsi256_si128(hi), type), hb = widen(_mm256_extracti128_si256(hi, 1), type);
            for (int r = 0; r < R; r++) {
                const __m256i xl = pairs2(xa[r][b].q + 4 * c), xh = pairs2(xa[r][b].q + 16 + 4 * c);
                sa[r] = DPW8(DPW8(sa[r], la, xl), ha, xh);
                sb[r] = DPW8(DPW8(sb[r], lb, xl), hb, xh);
            }
        }
        const __m256 d = _mm256_permutevar8x32_ps(scales8(blk, b, type), order);
        const __m256 m = type == QTYPE_Q5_1
                             ? _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))), order)
                             : _mm256_mul_ps(d, _mm256_set1_ps(-16.0f));
        for (int r = 0; r < R; r++) {
            const __m256 f = _mm256_cvtepi32_ps(_mm256_hadd_epi32(sa[r], sb[r]));
            acc[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(d, _mm256_set1_ps(xa[r][b].d)), acc[r]);
            if (is_q5(type)) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xa[r][b].s), acc[r]);
        }
    }
    for (int r = 0; r < R && r < nr; r++) _mm256_storeu_ps(out + r * ldo, _mm256_permutevar8x32_ps(acc[r], order));
}
#endif

/* Every group (8 weight rows) against every activation row, XR rows at a time. */
static inline __attribute__((always_inline)) void tile16_loop(const uint8_t *w, int64_t wrb, int64_t nc,
                                                              const uint8_t *xq, int64_t xrb, int64_t nr,
                                                              int64_t nb, float *out, int64_t ldo, const int type) {
    for (int64_t r0 = 0; r0 < nr; r0 += XR) {
        const int64_t rows = nr - r0 < XR ? nr - r0 : XR;
        const act_block16 *xa[XR];
        for (int r = 0; r < XR; r++) xa[r] = (const act_block16 *)(xq + (r0 + (r < rows ? r : rows - 1)) * xrb);
        for (int64_t c0 = 0; c0 < nc; c0 += 8) {
            const uint8_t *g = w + c0 * wrb;
            float *o = out + r0 * ldo + c0;
            switch (rows) {
            case 1: tile16(g, nb, xa, rows, o, ldo, type, 1); break;
#if XR > 2
            case 2: tile16(g, nb, xa, rows, o, ldo, type, 2); break;
            case 3: tile16(g, nb, xa, rows, o, ldo, type, 3); break;
#endif
            default: tile16(g, nb, xa, rows, o, ldo, type, XR); break;
            }
        }
    }
}
#define TILE16_LOOP(TYPE) tile16_loop(w, wrb, nc, xq, xrb, nr, nb, out, ldo, TYPE)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define XR8 8 /* activation rows per 8-bit tile */

/* acc + the products of w's bytes (unsigned) and q[0..3] (signed) in every lane, summed by 4. */
static inline __m512i dpb4(__m512i acc, __m512i w, const int8_t *q) {
#if defined(__AVX512VNNI__) /* the broadcast as vpdpbusd's {1to16} operand (gcc does not fold it) */
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const i32_any *)q));
    return acc;
#else /* maddubs' pair sums at most 2 * 31 * 127: no saturation */
    const __m512i p = _mm512_maddubs_epi16(w, _mm512_set1_epi32(*(const i32_any *)q));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
#endif
}

/* The 8 bytes at a (first group) in both 128-bit lanes of the low half, those at b in the high
 * half, each lane's row bytes spread to their 4 bytes. */
static inline __m512i spread2(const uint8_t *a, const uint8_t *b) {
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi64x(*(const i64_any *)a)),
                                         _mm256_set1_epi64x(*(const i64_any *)b), 1);
    return _mm512_shuffle_epi8(v, _mm512_broadcast_i64x4(spread_index()));
}

#if defined(__AVX512VNNI__) /* vpdpbusd meets IQ4_NL's levels + 128 (unsigned bytes): one shuffle each */
static const uint8_t IQ4_ZMM_LEVELS[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
#else
#define IQ4_ZMM_LEVELS IQ4_LEVELS
#endif

/* Chunk c of the two groups' blocks (blk0: tile rows 0-7, blk1: 8-15) as 5-bit unsigned bytes, or
 * IQ4_NL's IQ4_ZMM_LEVELS. */
static inline __attribute__((always_inline)) void chunk_bytes2(const uint8_t *blk0, const uint8_t *blk1, int64_t b,
                                                               int c, const int type, __m512i *lo, __m512i *hi) {
    const int head = head_of(type);
    const __m512i v = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(chunks_at(blk0, b, type) + 32 * c))),
        _mm256_loadu_si256((const __m256i *)(chunks_at(blk1, b, type) + 32 * c)), 1);
    const __m512i m4 = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16);
    if (!is_q5(type)) {
        const __m512i levels = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_ZMM_LEVELS));
        *lo = _mm512_shuffle_epi8(levels, _mm512_and_si512(v, m4));
        *hi = _mm512_shuffle_epi8(levels, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
        return;
    }
    const __m512i bits = _mm512_broadcast_i64x4(bit_pattern(c % 2));
    const __m512i hl = spread2(blk0 + head + 8 * (c / 2), blk1 + head + 8 * (c / 2));
    const __m512i hh = spread2(blk0 + head + 16 + 8 * (c / 2), blk1 + head + 16 + 8 * (c / 2));
    const __m512i nl = _mm512_and_si512(v, m4), nh = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    *lo = _mm512_mask_add_epi8(nl, _mm512_test_epi8_mask(hl, bits), nl, sixteen);
    *hi = _mm512_mask_add_epi8(nh, _mm512_test_epi8_mask(hh, bits), nh, sixteen);
}

/* acc + the products of |w|'s bytes and q[0..3] with w's signs (neg: w's negative bytes), summed by
 * 4 (maddubs' pair sums at most 2 * 127 * 127: no saturation). */
static inline __m512i dps4(__m512i acc, __m512i aw, __mmask64 neg, const int8_t *q) {
    const __m512i x = _mm512_set1_epi32(*(const i32_any *)q);
    const __m512i xs = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(aw, xs), _mm512_set1_epi16(1)));
}

#if defined(__AVX512VNNI__) /* IQ4_NL's levels + 128 (unsigned): the sums start at -128 sum(x) */
#define IQ4_CHUNK(FIELD)                                                                  \
    for (int r = 0; r < R; r++) {                                                         \
        is[r] = dpb4(is[r], lo, xa[r][b].FIELD + 4 * c);                                  \
        is[r] = dpb4(is[r], hi, xa[r][b].FIELD + 16 + 4 * c);                             \
    }
/* q's start is the quantizer's (act8_32's qoff: a broadcast load, no arithmetic in the tile) */
#define IQ4_OFF_q(x) ((x).qoff)
#define IQ4_OFF_r(x) (-128 * (x).rsum)
#define IQ4_START(FIELD) _mm512_set1_epi32(is_q5(type) ? 0 : IQ4_OFF_##FIELD(xa[r][b]))
#else
#define IQ4_CHUNK(FIELD)                                                                  \
    const __mmask64 nl = _mm512_movepi8_mask(lo), nh = _mm512_movepi8_mask(hi);           \
    lo = _mm512_abs_epi8(lo);                                                             \
    hi = _mm512_abs_epi8(hi);                                                             \
    for (int r = 0; r < R; r++) {                                                         \
        is[r] = dps4(is[r], lo, nl, xa[r][b].FIELD + 4 * c);                              \
        is[r] = dps4(is[r], hi, nh, xa[r][b].FIELD + 16 + 4 * c);                         \
    }
#define IQ4_START(FIELD) _mm512_setzero_si512()
#endif

/* One pass (q's or r's: FIELD) of a block's 4 chunks against the tile's rows into is. */
#define A8_PASS(FIELD)                                                          \
    for (int r = 0; r < R; r++) is[r] = IQ4_START(FIELD);                       \
    for (int c = 0; c < 4; c++) {                                               \
        __m512i lo, hi;                                                         \
        chunk_bytes2(blk0, blk1, b, c, type, &lo, &hi);                         \
        if (is_q5(type)) {                                                      \
            for (int r = 0; r < R; r++) {                                       \
                is[r] = dpb4(is[r], lo, xa[r][b].FIELD + 4 * c);                \
                is[r] = dpb4(is[r], hi, xa[r][b].FIELD + 16 + 4 * c);           \
            }                                                                   \
        } else {                                                                \
            IQ4_CHUNK(FIELD)                                                    \
        }                                                                       \
    }

/* 16 bytes at a, then 16 at b (the two groups' halves of a zmm's worth). */
static inline __m256i two16(const uint8_t *a, const uint8_t *b) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                   _mm_loadu_si128((const __m128i *)b), 1);
}

/* IQ4_XS: the 8 sub-blocks' scales d (ls - 32) of the 16 tile rows (blk0: rows 0-7, blk1: 8-15),
 * made once a block of 256: the same float steps as scales8. */
static inline __attribute__((always_inline)) void xs_scales16(const uint8_t *blk0, const uint8_t *blk1, __m512 *ds) {
    const __m512 d = _mm512_cvtph_ps(two16(blk0, blk1));
    __m512i lows = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk0 + 32))),
                                      _mm256_loadu_si256((const __m256i *)(blk1 + 32)), 1);
    __m512i highs = _mm512_slli_epi32(_mm512_cvtepu16_epi32(two16(blk0 + 16, blk1 + 16)), 4);
    const __m512i m4 = _mm512_set1_epi32(15), m6 = _mm512_set1_epi32(0x30), k32 = _mm512_set1_epi32(32);
    for (int i = 0; i < 8; i++) {
        /* ls's low 4 bits from lows' nibble i, its high 2 from highs' bits 2i, 2i + 1 (moved to 4, 5) */
        const __m512i ls = _mm512_ternarylogic_epi32(_mm512_and_si512(lows, m4), highs, m6, 0xf8); /* a | (b & c) */
        ds[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(ls, k32)));
        lows = _mm512_srli_epi32(lows, 4);
        highs = _mm512_srli_epi32(highs, 2);
    }
}

/* The 16 tile rows' d of block b (the blocks at blk0, blk1): IQ4_XS's from its panel's table. */
static inline __attribute__((always_inline)) __m512 scales16(const uint8_t *blk0, const uint8_t *blk1, int64_t b,
                                                              const __m512 *ds, const int type) {
    return is_xs(type) ? ds[b] : _mm512_cvtph_ps(two16(blk0, blk1));
}

/* The residual pass of block b (the blocks at blk0, blk1) for the tile's rows in mask (bit r: row r
 * has it): the 4 chunks decoded once into 8 zmm, then each such row's 8 products in one chain (Zen 5
 * passes a vpdpbusd's sum on to the next fast), its sums stored to rs[r]; the other rows get 0, as the
 * pass over all R rows gave them (their r is all zero). */
static inline __attribute__((always_inline)) void residual_rows(const uint8_t *blk0, const uint8_t *blk1, int64_t b,
                                                                const act8_32 *const *xa, unsigned mask,
                                                                const int type, const int R, __m512i *rs) {
    const act8_32 *xb[XR8]; /* the rows' block b (the q pass's own pointers: no more registers) */
    for (int r = 0; r < R; r++) xb[r] = xa[r] + b, rs[r] = _mm512_setzero_si512();
    __m512i lo[4], hi[4];
    for (int c = 0; c < 4; c++) chunk_bytes2(blk0, blk1, b, c, type, &lo[c], &hi[c]);
#if !defined(__AVX512VNNI__)
    __mmask64 nl[4], nh[4];
    for (int c = 0; c < 4 && !is_q5(type); c++) {
        nl[c] = _mm512_movepi8_mask(lo[c]), nh[c] = _mm512_movepi8_mask(hi[c]);
        lo[c] = _mm512_abs_epi8(lo[c]), hi[c] = _mm512_abs_epi8(hi[c]);
    }
#endif
    for (; mask != 0; mask &= mask - 1) {
        const int r = __builtin_ctz(mask);
        const act8_32 *x = xb[r];
#if defined(__AVX512VNNI__)
        __m512i is = _mm512_set1_epi32(is_q5(type) ? 0 : -128 * x->rsum); /* IQ4's levels + 128 */
#else
        __m512i is = _mm512_setzero_si512();
#endif
        for (int c = 0; c < 4; c++) {
#if !defined(__AVX512VNNI__)
            if (!is_q5(type)) {
                is = dps4(is, lo[c], nl[c], x->r + 4 * c);
                is = dps4(is, hi[c], nh[c], x->r + 16 + 4 * c);
                continue;
            }
#endif
            is = dpb4(is, lo[c], x->r + 4 * c);
            is = dpb4(is, hi[c], x->r + 16 + 4 * c);
        }
        rs[r] = is;
    }
}

/* The next panel's weights (the bytes after this call's columns: a thread's panels lie one after the
 * other), fetched into L2 by the row groups after the first as they run over this panel, a few lines
 * a block. Otherwise each panel's first row group waits on memory, S32X8_PF ahead being too near for
 * lines from DRAM (measured in docs/benchmarks-history.md, "IQ4_XS at 32 rows: the next panel's
 * weights"). */
typedef struct {
    const uint8_t *at;
    int64_t left, per; /* lines left, lines a block */
} next_panel;

/* out[r * ldo + j] = dot(tile row j, activation row r) for j < width (16, or 8: g1 is g0 again and
 * only its lanes are stored), r < R. A block's per-row scales are made again for the residual pass
 * (the same products), not kept: R more registers live across it spilled the accumulators. IQ4_XS's
 * scales d (ls - 32): ds[b] for sub-block b, made there first where make_ds (tile8_loop's table). */
static inline __attribute__((always_inline)) void tile8(const uint8_t *g0, const uint8_t *g1, int width, int64_t nb,
                                                        const act8_32 *const *xa, float *out, int64_t ldo,
                                                        __m512 *ds, int make_ds, next_panel *next, const int type,
                                                        const int R, const int fetch_next) {
    const int gbb = 8 * bb_of(type), subs = subs_of(type);
    __m512 acc[XR8];
    __m512i is[XR8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t *next_at = fetch_next ? next->at : NULL;
    int64_t next_left = fetch_next ? next->left : 0;
    const int64_t next_per = fetch_next ? next->per : 0;
    for (int64_t b = 0; b < nb * subs; b++) {
        const uint8_t *blk0 = group_block(g0, b, type), *blk1 = group_block(g1, b, type);
        if (b % subs == 0) {
            for (int64_t i = 0; fetch_next && i < next_per && next_left > 0; i++, next_left--, next_at += 64)
                _mm_prefetch((const char *)next_at, _MM_HINT_T1);
            for (int at = 0; at < gbb; at += 64) {
                _mm_prefetch((const char *)(blk0 + S32X8_PF + at), _MM_HINT_T0);
                _mm_prefetch((const char *)(blk1 + S32X8_PF + at), _MM_HINT_T0);
            }
            if (is_xs(type) && make_ds) xs_scales16(blk0, blk1, ds + b);
        }
        unsigned two = 0; /* bit r: row r has the residual pass */
        for (int r = 0; r < R; r++) two |= (unsigned)xa[r][b].two << r;
        A8_PASS(q)
        const __m512 d = scales16(blk0, blk1, b, ds, type);
        const __m512 m = type == QTYPE_Q5_1 ? _mm512_cvtph_ps(two16(blk0 + 16, blk1 + 16))
                                            : _mm512_mul_ps(d, _mm512_set1_ps(-16.0f));
        for (int r = 0; r < R; r++) {
            const __m512 sc = _mm512_mul_ps(d, _mm512_set1_ps(xa[r][b].d));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r]), sc, acc[r]);
            if (is_q5(type)) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xa[r][b].s), acc[r]);
        }
        if (two) { /* r's products at a 128th of q's step, made for the rows with the pass only */
            __m512i rs[XR8];
            residual_rows(blk0, blk1, b, xa, two, type, R, rs);
            for (int r = 0; r < R; r++) {
                const __m512 sc = _mm512_mul_ps(d, _mm512_set1_ps(xa[r][b].d)); /* the same product again */
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(rs[r]), _mm512_mul_ps(sc, _mm512_set1_ps(1.0f / 128.0f)), acc[r]);
            }
        }
    }
    if (fetch_next) next->at = next_at, next->left = next_left;
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out + r * ldo, _mm512_castps512_ps256(acc[r]));
        if (width == 16) _mm256_storeu_ps(out + r * ldo + 8, _mm512_extractf32x8_ps(acc[r], 1));
    }
}

#if defined(__AVX512VNNI__)
/* IQ4_NL with VNNI, 32 weight rows (four groups, two zmm) a tile against 4 activation rows: each
 * activation's 4 bytes broadcast once into a register for both zmm, not once per zmm as vpdpbusd's
 * {1to16} operand (the 16-row tile's). IQ4_XS (its scales per 256 made twice) ran no faster so, nor
 * with them read from the panel's table (0.99 the 16-row tile's time at 256 rows, 1.02-1.15 at 8-128);
 * Q5's were not tried. The same integer sums and float steps per (row, column, block): the same bits. */
#define XR32 4 /* activation rows per 32-row tile */
/* One pass (FIELD) of block b of the four groups (blk[0..3]) against the tile's rows. */
#define A8_PASS32(FIELD)                                                                         \
    for (int r = 0; r < R; r++) is[0][r] = is[1][r] = IQ4_START(FIELD);                          \
    for (int c = 0; c < 4; c++) {                                                                \
        __m512i lo0, hi0, lo1, hi1;                                                              \
        chunk_bytes2(blk[0], blk[1], b, c, type, &lo0, &hi0);                                    \
        chunk_bytes2(blk[2], blk[3], b, c, type, &lo1, &hi1);                                    \
        for (int r = 0; r < R; r++) {                                                            \
            const __m512i xl = _mm512_set1_epi32(*(const i32_any *)(xa[r][b].FIELD + 4 * c));    \
            const __m512i xh = _mm512_set1_epi32(*(const i32_any *)(xa[r][b].FIELD + 16 + 4 * c)); \
            is[0][r] = _mm512_dpbusd_epi32(is[0][r], lo0, xl);                                   \
            is[1][r] = _mm512_dpbusd_epi32(is[1][r], lo1, xl);                                   \
            is[0][r] = _mm512_dpbusd_epi32(is[0][r], hi0, xh);                                   \
            is[1][r] = _mm512_dpbusd_epi32(is[1][r], hi1, xh);                                   \
        }                                                                                        \
    }

/* out[r * ldo + j] = dot(tile row j, activation row r) for j < 32 (the groups at g, g + 8 wrb, g + 16 wrb,
 * g + 24 wrb), r < R. */
static inline __attribute__((always_inline)) void tile32(const uint8_t *g, int64_t wrb, int64_t nb,
                                                         const act8_32 *const *xa, float *out, int64_t ldo,
                                                         const int type, const int R) {
    const int gbb = 8 * bb_of(type), subs = subs_of(type);
    __m512 acc[2][XR32], ds[2][8];
    __m512i is[2][XR32];
    for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb * subs; b++) {
        const uint8_t *blk[4];
        for (int i = 0; i < 4; i++) blk[i] = group_block(g + i * 8 * wrb, b, type);
        if (b % subs == 0) {
            for (int i = 0; i < 4; i++)
                for (int at = 0; at < gbb; at += 64) _mm_prefetch((const char *)(blk[i] + S32X8_PF + at), _MM_HINT_T0);
            if (is_xs(type)) xs_scales16(blk[0], blk[1], ds[0]), xs_scales16(blk[2], blk[3], ds[1]);
        }
        int two = 0;
        for (int r = 0; r < R; r++) two |= xa[r][b].two;
        A8_PASS32(q)
        __m512 d[2], m[2];
        for (int h = 0; h < 2; h++) {
            d[h] = scales16(blk[2 * h], blk[2 * h + 1], b % 8, ds[h], type); /* (its own 8 a block) */
            m[h] = type == QTYPE_Q5_1 ? _mm512_cvtph_ps(two16(blk[2 * h] + 16, blk[2 * h + 1] + 16))
                                      : _mm512_mul_ps(d[h], _mm512_set1_ps(-16.0f));
        }
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++) {
                const __m512 sc = _mm512_mul_ps(d[h], _mm512_set1_ps(xa[r][b].d));
                acc[h][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[h][r]), sc, acc[h][r]);
                if (is_q5(type)) acc[h][r] = _mm512_fmadd_ps(m[h], _mm512_set1_ps(xa[r][b].s), acc[h][r]);
            }
        if (two) {
            A8_PASS32(r)
            for (int r = 0; r < R; r++)
                for (int h = 0; h < 2; h++) {
                    const __m512 sc = _mm512_mul_ps(d[h], _mm512_set1_ps(xa[r][b].d));
                    acc[h][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[h][r]), _mm512_mul_ps(sc, _mm512_set1_ps(1.0f / 128.0f)), acc[h][r]);
                }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(out + r * ldo, acc[0][r]);
        _mm512_storeu_ps(out + r * ldo + 16, acc[1][r]);
    }
}
#endif

static inline __attribute__((always_inline)) void tile8_loop(const uint8_t *w, int64_t wrb, int64_t nc,
                                                             const uint8_t *xq, int64_t xrb, int64_t nr, int64_t nb,
                                                             float *out, int64_t ldo, const int type) {
    /* IQ4_XS: every sub-block's scales of the panel's 16-row tiles, tab[(c0 / 16) nb 8 + b] for sub-block b
     * of columns c0 .. c0 + 15, made by the first rows' tiles as they pass (behind their prefetches; a
     * pass of its own before the tiles waited on memory: 8 rows 1.3x the time), read by the rest: the
     * same floats, 2-3% of a 256-row call. (12 KB at most, or nb / 2 KB in a 16-column panel: quant.c's
     * PANEL_BYTES; NULL: the other types.) */
    __m512 xs_tab[is_xs(type) ? (nc + 15) / 16 * nb * 8 : 1], *tab = is_xs(type) ? xs_tab : NULL;
#define XS_TAB(C0) (tab == NULL ? NULL : tab + (C0) / 16 * nb * 8)
#if defined(__AVX512VNNI__) /* IQ4_NL: whole 32-row tiles first, the rest by the 16-row tile */
    const int64_t n32 = type == QTYPE_IQ4_NL ? nc / 32 * 32 : 0;
    for (int64_t r0 = 0; r0 < nr && n32 > 0;) {
        const int64_t left = nr - r0;
        const int R = left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const act8_32 *xa[XR32];
        for (int r = 0; r < R; r++) xa[r] = (const act8_32 *)(xq + (r0 + r) * xrb);
        for (int64_t c0 = 0; c0 < n32; c0 += 32) {
            float *o = out + r0 * ldo + c0;
            switch (R) {
            case 4: tile32(w + c0 * wrb, wrb, nb, xa, o, ldo, type, 4); break;
            case 2: tile32(w + c0 * wrb, wrb, nb, xa, o, ldo, type, 2); break;
            default: tile32(w + c0 * wrb, wrb, nb, xa, o, ldo, type, 1); break;
            }
        }
        r0 += R;
    }
    const int64_t c32 = n32;
#else
    const int64_t c32 = 0;
#endif
    /* the row groups after the first: at least `later` (a rest of 4, 2, 1 rows is more, done sooner) */
    const int64_t first = nr >= 8 ? 8 : nr >= 4 ? 4 : nr >= 2 ? 2 : 1, later = (nr - first + 7) / 8;
    const int64_t lines = later > 0 ? (nc - c32) * wrb / 64 : 0, steps = later * ((nc - c32 + 15) / 16) * nb;
    next_panel next = {w + nc * wrb, lines, lines > 0 ? (lines + steps - 1) / steps : 0};
    for (int64_t r0 = 0; r0 < nr;) {
        const int64_t left = nr - r0;
        const int R = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const act8_32 *xa[XR8];
        for (int r = 0; r < R; r++) xa[r] = (const act8_32 *)(xq + (r0 + r) * xrb);
        for (int64_t c0 = c32; c0 < nc; c0 += 16) {
            const uint8_t *g0 = w + c0 * wrb;
            const int width = nc - c0 >= 16 ? 16 : 8;
            const uint8_t *g1 = width == 16 ? g0 + 8 * wrb : g0;
            float *o = out + r0 * ldo + c0;
            __m512 *ds = XS_TAB(c0);
            if (r0 > 0 && next.left > 0) {
                switch (R) {
                case 8: tile8(g0, g1, width, nb, xa, o, ldo, ds, 0, &next, type, 8, 1); break;
                case 4: tile8(g0, g1, width, nb, xa, o, ldo, ds, 0, &next, type, 4, 1); break;
                case 2: tile8(g0, g1, width, nb, xa, o, ldo, ds, 0, &next, type, 2, 1); break;
                default: tile8(g0, g1, width, nb, xa, o, ldo, ds, 0, &next, type, 1, 1); break;
                }
                continue;
            }
            switch (R) {
            case 8: tile8(g0, g1, width, nb, xa, o, ldo, ds, r0 == 0, &next, type, 8, 0); break;
            case 4: tile8(g0, g1, width, nb, xa, o, ldo, ds, r0 == 0, &next, type, 4, 0); break;
            case 2: tile8(g0, g1, width, nb, xa, o, ldo, ds, r0 == 0, &next, type, 2, 0); break;
            default: tile8(g0, g1, width, nb, xa, o, ldo, ds, r0 == 0, &next, type, 1, 0); break;
            }
        }
        r0 += R;
    }
#undef XS_TAB
}
#define TILE8_LOOP(TYPE) tile8_loop(w, wrb, nc, xq, xrb, nr, nb, out, ldo, TYPE)

#else /* AVX2: one group a ymm, maddubs + madd */
#define XR8 8 /* activation rows a pass: each chunk assembled once for 8 */

/* One pass (FIELD) of a block's 4 chunks against the tile's rows into is: Q5's maddubs' int16 sums
 * of a pair of chunks (4 of them, at most 31,496) widened once; IQ4_NL's |level| against the
 * activation with the level's sign, each widened at once. */
#define A8_PASS(FIELD)                                                                                             \
    for (int r = 0; r < R; r++) is[r] = _mm256_setzero_si256();                                                   \
    for (int c = 0; c < 4 && !is_q5(type); c++) {                                                                  \
        __m256i lo, hi;                                                                                            \
        chunk_bytes(blk, q, c, type, &lo, &hi);                                                                    \
        const __m256i al = _mm256_abs_epi8(lo), ah = _mm256_abs_epi8(hi), one = _mm256_set1_epi16(1);              \
        for (int r = 0; r < R; r++) {                                                                              \
            const int8_t *x = xa[r][b].FIELD;                                                                      \
            const __m256i xl = _mm256_sign_epi8(_mm256_set1_epi32(*(const i32_any *)(x + 4 * c)), lo);            \
            const __m256i xh = _mm256_sign_epi8(_mm256_set1_epi32(*(const i32_any *)(x + 16 + 4 * c)), hi);       \
            is[r] = _mm256_add_epi32(is[r], _mm256_madd_epi16(_mm256_maddubs_epi16(al, xl), one));               \
            is[r] = _mm256_add_epi32(is[r], _mm256_madd_epi16(_mm256_maddubs_epi16(ah, xh), one));               \
        }                                                                                                          \
    }                                                                                                              \
    for (int c2 = 0; c2 < 4 && is_q5(type); c2 += 2) {                                                             \
        __m256i lo0, hi0, lo1, hi1;                                                                                \
        chunk_bytes(blk, q, c2, type, &lo0, &hi0);                                                                 \
        chunk_bytes(blk, q, c2 + 1, type, &lo1, &hi1);                                                             \
        for (int r = 0; r < R; r++) {                                                                              \
            const int8_t *x = xa[r][b].FIELD;                                                                      \
            __m256i s = _mm256_maddubs_epi16(lo0, _mm256_set1_epi32(*(const i32_any *)(x + 4 * c2)));             \
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi0, _mm256_set1_epi32(*(const i32_any *)(x + 16 + 4 * c2)))); \
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo1, _mm256_set1_epi32(*(const i32_any *)(x + 4 * c2 + 4)))); \
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi1, _mm256_set1_epi32(*(const i32_any *)(x + 20 + 4 * c2)))); \
            is[r] = _mm256_add_epi32(is[r], _mm256_madd_epi16(s, _mm256_set1_epi16(1)));                          \
        }                                                                                                          \
    }

/* A row's sum of a block's 4 chunks (lo[c], hi[c]: 5-bit bytes) against its 32 bytes x: per pair of
 * chunks 4 maddubs added in int16 (at most 4 * 2 * 31 * 127 = 31,496), widened once. */
static inline __attribute__((always_inline)) __m256i q5_sum(const __m256i *lo, const __m256i *hi, const int8_t *x) {
    __m256i is = _mm256_setzero_si256();
    for (int c2 = 0; c2 < 4; c2 += 2) {
        __m256i s = _mm256_maddubs_epi16(lo[c2], _mm256_set1_epi32(*(const i32_any *)(x + 4 * c2)));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[c2], _mm256_set1_epi32(*(const i32_any *)(x + 16 + 4 * c2))));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[c2 + 1], _mm256_set1_epi32(*(const i32_any *)(x + 4 * c2 + 4))));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[c2 + 1], _mm256_set1_epi32(*(const i32_any *)(x + 20 + 4 * c2))));
        is = _mm256_add_epi32(is, _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
    }
    return is;
}

/* The residual pass of the block at blk (chunks at q) for the tile's rows in mask (bit r: row r has it):
 * the 4 chunks decoded once, then each such row's sums in turn, stored to rs[r]; the other rows get 0,
 * as the pass over all R rows gave them (their r is all zero). The same integers: Q5's pairs of chunks
 * as q5_sum, IQ4's |level| against the activation with the level's sign as A8_PASS. */
static inline __attribute__((always_inline)) void residual_rows(const uint8_t *blk, const uint8_t *q, int64_t b,
                                                                const act8_32 *const *xa, unsigned mask,
                                                                const int type, const int R, __m256i *rs) {
    const act8_32 *xb[XR8];
    for (int r = 0; r < R; r++) xb[r] = xa[r] + b, rs[r] = _mm256_setzero_si256();
    __m256i lo[4], hi[4], al[4], ah[4];
    for (int c = 0; c < 4; c++) {
        chunk_bytes(blk, q, c, type, &lo[c], &hi[c]);
        al[c] = _mm256_abs_epi8(lo[c]), ah[c] = _mm256_abs_epi8(hi[c]);
    }
    const __m256i one = _mm256_set1_epi16(1);
    for (; mask != 0; mask &= mask - 1) {
        const int r = __builtin_ctz(mask);
        const int8_t *x = xb[r]->r;
        if (is_q5(type)) {
            rs[r] = q5_sum(lo, hi, x);
            continue;
        }
        __m256i is = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i xl = _mm256_sign_epi8(_mm256_set1_epi32(*(const i32_any *)(x + 4 * c)), lo[c]);
            const __m256i xh = _mm256_sign_epi8(_mm256_set1_epi32(*(const i32_any *)(x + 16 + 4 * c)), hi[c]);
            is = _mm256_add_epi32(is, _mm256_madd_epi16(_mm256_maddubs_epi16(al[c], xl), one));
            is = _mm256_add_epi32(is, _mm256_madd_epi16(_mm256_maddubs_epi16(ah[c], xh), one));
        }
        rs[r] = is;
    }
}

static inline __attribute__((always_inline)) void tile8(const uint8_t *g, int64_t nb, const act8_32 *const *xa,
                                                        float *out, int64_t ldo, const int type, const int R) {
    const int gbb = 8 * bb_of(type);
    __m256 acc[XR8];
    __m256i is[XR8];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb * subs_of(type); b++) {
        const uint8_t *blk = group_block(g, b, type), *q = chunks_at(blk, b, type);
        for (int at = 0; at < gbb && b % subs_of(type) == 0; at += 64)
            _mm_prefetch((const char *)(blk + S32X8_PF + at), _MM_HINT_T0);
        unsigned two = 0; /* bit r: row r has the residual pass */
        for (int r = 0; r < R; r++) two |= (unsigned)xa[r][b].two << r;
        A8_PASS(q)
        const __m256 d = scales8(blk, b, type);
        const __m256 m = type == QTYPE_Q5_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)))
                                            : _mm256_mul_ps(d, _mm256_set1_ps(-16.0f));
        __m256 sc[XR8];
        for (int r = 0; r < R; r++) {
            sc[r] = _mm256_mul_ps(d, _mm256_set1_ps(xa[r][b].d));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), sc[r], acc[r]);
            if (is_q5(type)) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xa[r][b].s), acc[r]);
        }
        if (two && R == XR8) { /* r's products at a 128th of q's step, made for the rows with the pass only */
            __m256i rs[XR8];
            residual_rows(blk, q, b, xa, two, type, R, rs);
            for (int r = 0; r < R; r++)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rs[r]), _mm256_mul_ps(sc[r], _mm256_set1_ps(1.0f / 128.0f)), acc[r]);
        } else if (two) { /* 2 or 4 rows: all of them (rows-only ran no faster: docs/benchmarks-history.md) */
            A8_PASS(r)
            for (int r = 0; r < R; r++)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), _mm256_mul_ps(sc[r], _mm256_set1_ps(1.0f / 128.0f)), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

#ifndef XR8_Q5
#define XR8_Q5 16 /* activation rows a pass of Q5's many-row tile */
#endif
#ifndef Q5_MANY_FROM
/* Q5's rows from which it takes q5_tile8 (and at 3, which tile8 takes as 2 + 1): at 2 and 4 tile8's
 * sums in registers are the faster (docs/benchmarks-history.md, "Q5_0's AVX2 tile row by row") */
#define Q5_MANY_FROM 5
#endif

/* Q5_0 / Q5_1 at many rows: a block's 4 chunks assembled once (8 ymm of 5-bit bytes) for up to
 * XR8_Q5 activation rows (xq, xrb bytes apart), each row's sums then made whole and met by its float
 * total at once (the totals in memory, touched once a block), so no row's sums wait in registers and
 * the rows a pass are not bound by the 16 ymm. tile8's integers and float steps per (row, column,
 * block), in its order: the same bits. */
static inline __attribute__((always_inline)) void q5_tile8(const uint8_t *g, int64_t nb, const uint8_t *xq, int64_t xrb,
                                                           int R, float *out, int64_t ldo, const int type) {
    const int gbb = 8 * bb_of(type);
    float tot[XR8_Q5 * 8] __attribute__((aligned(32)));
    for (int r = 0; r < R; r++) _mm256_store_ps(tot + 8 * r, _mm256_setzero_ps());
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * gbb, *q = blk + qs_of(type);
        for (int at = 0; at < gbb; at += 64) _mm_prefetch((const char *)(blk + S32X8_PF + at), _MM_HINT_T0);
        int two = 0;
        for (int r = 0; r < R; r++) two |= ((const act8_32 *)(xq + r * xrb))[b].two;
        __m256i lo[4], hi[4];
        for (int c = 0; c < 4; c++) chunk_bytes(blk, q, c, type, &lo[c], &hi[c]);
        const __m256 d = scales8(blk, b, type);
        const __m256 m = type == QTYPE_Q5_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)))
                                            : _mm256_mul_ps(d, _mm256_set1_ps(-16.0f));
#pragma GCC unroll 1
        for (int r = 0; r < R; r++) {
            const act8_32 *x = (const act8_32 *)(xq + r * xrb) + b;
            const __m256 sc = _mm256_mul_ps(d, _mm256_set1_ps(x->d));
            __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q5_sum(lo, hi, x->q)), sc, _mm256_load_ps(tot + 8 * r));
            t = _mm256_fmadd_ps(m, _mm256_set1_ps(x->s), t);
            if (two)
                t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q5_sum(lo, hi, x->r)), _mm256_mul_ps(sc, _mm256_set1_ps(1.0f / 128.0f)), t);
            _mm256_store_ps(tot + 8 * r, t);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * ldo, _mm256_load_ps(tot + 8 * r));
}

static inline __attribute__((always_inline)) void tile8_loop(const uint8_t *w, int64_t wrb, int64_t nc,
                                                             const uint8_t *xq, int64_t xrb, int64_t nr, int64_t nb,
                                                             float *out, int64_t ldo, const int type) {
    if (is_q5(type) && (nr == 3 || nr >= Q5_MANY_FROM)) { /* near-equal passes of at most XR8_Q5 rows */
        const int64_t passes = (nr + XR8_Q5 - 1) / XR8_Q5;
        for (int64_t p = 0; p < passes; p++) {
            const int64_t r0 = nr * p / passes, rows = nr * (p + 1) / passes - r0;
            for (int64_t c0 = 0; c0 < nc; c0 += 8)
                q5_tile8(w + c0 * wrb, nb, xq + r0 * xrb, xrb, (int)rows, out + r0 * ldo + c0, ldo, type);
        }
        return;
    }
    for (int64_t r0 = 0; r0 < nr;) {
        const int64_t left = nr - r0;
        const int R = left >= XR8 ? XR8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const act8_32 *xa[XR8];
        for (int r = 0; r < R; r++) xa[r] = (const act8_32 *)(xq + (r0 + r) * xrb);
        for (int64_t c0 = 0; c0 < nc; c0 += 8) {
            const uint8_t *g = w + c0 * wrb;
            float *o = out + r0 * ldo + c0;
            switch (R) {
#if XR8 > 4
            case XR8: tile8(g, nb, xa, o, ldo, type, XR8); break;
#endif
            case 4: tile8(g, nb, xa, o, ldo, type, 4); break;
            case 2: tile8(g, nb, xa, o, ldo, type, 2); break;
            default: tile8(g, nb, xa, o, ldo, type, 1); break;
            }
        }
        r0 += R;
    }
}
#define TILE8_LOOP(TYPE) tile8_loop(w, wrb, nc, xq, xrb, nr, nb, out, ldo, TYPE)
#endif

#else /* portable */

/* Each row of a group rebuilt in the file's layout, then quant_sub32.c's plain tile. */
static inline void tile16_plain(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                                int64_t nb, float *out, int64_t ldo, const int type) {
    const int bb = bb_of(type);
    const qtype_ops *plain_ops = qtype_sub32(type);
    uint8_t row[wrb];
    for (int64_t c0 = 0; c0 < nc; c0 += 8)
        for (int s = 0; s < 8; s++) {
            for (int64_t b = 0; b < nb; b++) plain_block(w + c0 * wrb + b * 8 * bb, s, type, row + b * bb);
            plain_ops->tile(row, wrb, 1, xq, xrb, nr, nb, out + c0 + s, ldo);
        }
}
#define TILE16_LOOP(TYPE) tile16_plain(w, wrb, nc, xq, xrb, nr, nb, out, ldo, TYPE)

/* Weight i (< 32) of slot s in the group block at blk, unsigned. */
static inline int32_t weight_at(const uint8_t *blk, const uint8_t *q, int s, int i, const int type) {
    const uint8_t *qh = blk + head_of(type), byte = q[32 * (i % 16 / 4) + 4 * s + i % 4];
    const int32_t nib = i < 16 ? byte & 0x0f : byte >> 4;
    if (!is_q5(type)) return IQ4_LEVELS[nib];
    return nib | ((qh[8 * (i / 8) + s] >> (i % 8)) & 1) << 4;
}

/* IQ4_XS's 6-bit scale of slot s's sub-block b % 8. */
static inline int xs_ls(const uint8_t *blk, int s, int64_t b) {
    const int i = (int)(b % 8), high = blk[16 + 2 * s + i / 4] >> (2 * (i % 4)) & 3;
    return (blk[32 + 4 * s + i / 2] >> (4 * (i % 2)) & 15) | high << 4;
}

/* The 8-bit tiles' integers and float steps, plain C. */
static inline void tile8_plain(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                               int64_t nb, float *out, int64_t ldo, const int type) {
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *g = w + c / 8 * 8 * wrb;
        const int s = (int)(c % 8);
        for (int64_t r = 0; r < nr; r++) {
            const act8_32 *xa = (const act8_32 *)(xq + r * xrb);
            float acc = 0.0f;
            for (int64_t b = 0; b < nb * subs_of(type); b++) {
                const uint8_t *blk = group_block(g, b, type), *qs = chunks_at(blk, b, type);
                int32_t iq = 0, ir = 0;
                for (int i = 0; i < QB; i++) {
                    const int32_t q = weight_at(blk, qs, s, i, type);
                    iq += q * xa[b].q[i];
                    ir += q * xa[b].r[i];
                }
                const float d = half_at(blk + 2 * s) * (is_xs(type) ? (float)(xs_ls(blk, s, b) - 32) : 1.0f);
                const float sc = d * xa[b].d;
                const float m = type == QTYPE_Q5_1 ? half_at(blk + 16 + 2 * s) : d * -16.0f;
                acc = fmaf((float)iq, sc, acc);
                if (is_q5(type)) acc = fmaf(m, xa[b].s, acc);
                if (xa[b].two) acc = fmaf((float)ir, sc * (1.0f / 128.0f), acc);
            }
            out[r * ldo + c] = acc;
        }
    }
}
#define TILE8_LOOP(TYPE) tile8_plain(w, wrb, nc, xq, xrb, nr, nb, out, ldo, TYPE)
#endif

#define S32X8_TILES(T16, T8, TYPE)                                                                              \
    static void T16(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,      \
                    int64_t nb, float *out, int64_t ldo) {                                                      \
        TILE16_LOOP(TYPE);                                                                                      \
    }                                                                                                           \
    static void T8(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,       \
                   int64_t nb, float *out, int64_t ldo) {                                                       \
        TILE8_LOOP(TYPE);                                                                                       \
    }
S32X8_TILES(tile_q5_0, tile_q5_0_a8, QTYPE_Q5_0)
S32X8_TILES(tile_q5_1, tile_q5_1_a8, QTYPE_Q5_1)
S32X8_TILES(tile_iq4_nl, tile_iq4_nl_a8, QTYPE_IQ4_NL)
S32X8_TILES(tile_iq4_xs, tile_iq4_xs_a8, QTYPE_IQ4_XS)

static void slot_q5_0(const uint8_t *g, int s, int64_t k, float *out) { dequant_slot(g, s, k, out, QTYPE_Q5_0); }
static void slot_q5_1(const uint8_t *g, int s, int64_t k, float *out) { dequant_slot(g, s, k, out, QTYPE_Q5_1); }
static void group_q5_0(const uint8_t *g, int64_t k, float *out) {
    for (int s = 0; s < 8; s++) dequant_slot(g, s, k, out + s * k, QTYPE_Q5_0);
}
static void group_q5_1(const uint8_t *g, int64_t k, float *out) {
    for (int s = 0; s < 8; s++) dequant_slot(g, s, k, out + s * k, QTYPE_Q5_1);
}
static void slot_iq4_nl(const uint8_t *g, int s, int64_t k, float *out) { dequant_slot(g, s, k, out, QTYPE_IQ4_NL); }
static void group_iq4_nl(const uint8_t *g, int64_t k, float *out) {
    for (int s = 0; s < 8; s++) dequant_slot(g, s, k, out + s * k, QTYPE_IQ4_NL);
}
static void slot_iq4_xs(const uint8_t *g, int s, int64_t k, float *out) { dequant_slot(g, s, k, out, QTYPE_IQ4_XS); }
static void group_iq4_xs(const uint8_t *g, int64_t k, float *out) {
    for (int s = 0; s < 8; s++) dequant_slot(g, s, k, out + s * k, QTYPE_IQ4_XS);
}

#define ACT16 ((int)sizeof(act_block16))
#define ACT8 ((int)sizeof(act8_32))
static const qtype_ops OPS_Q5_0 = {QTYPE_Q5_0 | QTYPE_X8, QB, 22, ACT16, quantize_act16, tile_q5_0, NULL,
                                   slot_q5_0, group_q5_0};
static const qtype_ops OPS_Q5_1 = {QTYPE_Q5_1 | QTYPE_X8, QB, 24, ACT16, quantize_act16, tile_q5_1, NULL,
                                   slot_q5_1, group_q5_1};
static const qtype_ops OPS_Q5_0_A8 = {QTYPE_Q5_0 | QTYPE_X8 | QTYPE_A8, QB, 22, ACT8, quantize_act8_32, tile_q5_0_a8,
                                      NULL, slot_q5_0, group_q5_0};
static const qtype_ops OPS_Q5_1_A8 = {QTYPE_Q5_1 | QTYPE_X8 | QTYPE_A8, QB, 24, ACT8, quantize_act8_32, tile_q5_1_a8,
                                      NULL, slot_q5_1, group_q5_1};
static const qtype_ops OPS_IQ4_NL = {QTYPE_IQ4_NL | QTYPE_X8, QB, 18, ACT16, quantize_act16, tile_iq4_nl, NULL,
                                     slot_iq4_nl, group_iq4_nl};
static const qtype_ops OPS_IQ4_NL_A8 = {QTYPE_IQ4_NL | QTYPE_X8 | QTYPE_A8, QB, 18, ACT8, quantize_act8_32,
                                        tile_iq4_nl_a8, NULL, slot_iq4_nl, group_iq4_nl};
static const qtype_ops OPS_IQ4_XS = {QTYPE_IQ4_XS | QTYPE_X8, 256, 136, 8 * ACT16, quantize_act16, tile_iq4_xs, NULL,
                                     slot_iq4_xs, group_iq4_xs};
static const qtype_ops OPS_IQ4_XS_A8 = {QTYPE_IQ4_XS | QTYPE_X8 | QTYPE_A8, 256, 136, 8 * ACT8, quantize_act8_32,
                                        tile_iq4_xs_a8, NULL, slot_iq4_xs, group_iq4_xs};

const qtype_ops *qtype_sub32x8(int type) {
    switch (type) {
    case QTYPE_Q5_0 | QTYPE_X8: return &OPS_Q5_0;
    case QTYPE_Q5_1 | QTYPE_X8: return &OPS_Q5_1;
    case QTYPE_Q5_0 | QTYPE_X8 | QTYPE_A8: return &OPS_Q5_0_A8;
    case QTYPE_Q5_1 | QTYPE_X8 | QTYPE_A8: return &OPS_Q5_1_A8;
    case QTYPE_IQ4_NL | QTYPE_X8: return &OPS_IQ4_NL;
    case QTYPE_IQ4_NL | QTYPE_X8 | QTYPE_A8: return &OPS_IQ4_NL_A8;
    case QTYPE_IQ4_XS | QTYPE_X8: return &OPS_IQ4_XS;
    case QTYPE_IQ4_XS | QTYPE_X8 | QTYPE_A8: return &OPS_IQ4_XS_A8;
    default: return NULL;
    }
}
