/* MXFP4 blocks (gpt-oss's experts) with their weight rows interleaved by 8, the layout the worker
 * holds them in (layouts.py's interleave_rows makes it at load; same bytes as the file's). Type
 * code: QTYPE_MXFP4 | QTYPE_X8, | QTYPE_A8 for the 8-bit activations' tiles (below the 16-bit ones).
 * The file's layout and the weights' meaning: quant_sub32.c.
 *
 * Rows 8g .. 8g + 7 form group g, stored where the file's rows 8g .. 8g + 7 were. Within a group,
 * block b of the 8 rows lies at b * 136:
 *   8 E8M0 exponents (row 0 .. 7), then the rows' nibble bytes in chunks of 2 bytes per row:
 *   chunk c = bytes 2c, 2c + 1 of row 0, of row 1, ..., of row 7 (16 bytes; 8 chunks).
 * quant_x8.c's layout for Q4_0 with one exponent byte a row in place of an fp16 d, and its tiles'
 * shape (its top comment says why): one 16-byte chunk holds 2 weights of each of the 8 rows, so one
 * madd against the activation's 2 matching values, broadcast, gives each row's partial sum in its
 * own 32-bit lane, and a block of 8 rows ends as one vector of 8 sums met by one vector of 8 scales
 * (the 8 exponents widened at once). The file layout's tile (quant_sub32.c) paid a horizontal sum
 * and a scalar scale per (row, block) of 17 bytes: well below the memory's pace at one row.
 *
 * The nibbles are looked up in the doubled E2M1 levels (0, 1, 2, 3, 4, 6, 8, 12 and their negatives)
 * by a byte shuffle before they are widened to int16, so the integers are the levels themselves and
 * no offset term is needed. Activations: act_block16 (quant.h), as every one-row tile's.
 *
 * Integer sums: a row's 32 products of one block, |level| <= 12 and |qx| <= 32767, are at most
 * 32 * 12 * 32767 < 2^24 in magnitude: exact in int32 and in their float32 conversion, so each
 * block's term is the float32 product of that exact sum and its scale 2^(e - 128) * d_x, as the
 * file layout's tile computes it.
 */
#include "quant.h"
#include "rivulet_kernels.h"

#define QB 32
#define BB 17         /* bytes of one file block */
#define GB (8 * BB)   /* bytes of one group block */
#define MX_PF 4096    /* how far ahead (bytes) the many-row tiles prefetch their group's blocks */
#define MX_ROW_PF 8192 /* the one-row tile's distance: it takes a block in less time */
#define XR 4          /* activation rows per 8-row tile */

static const int8_t LEVELS[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(e - 128) exactly (e < 2: subnormal), quant_sub32.c's scale of the doubled levels. */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Row s of the group at g (k weights) as float32: level * scale, exact (gguf-py's values). */
static inline void dequant_slot(const uint8_t *g, int s, int64_t k, float *out) {
    for (int64_t b = 0; b < k / QB; b++) {
        const uint8_t *blk = g + b * GB, *q = blk + 8;
        const float d = e8m0_half(blk[s]);
        for (int c = 0; c < 8; c++)
            for (int h = 0; h < 2; h++) {
                const uint8_t byte = q[16 * c + 2 * s + h];
                out[b * QB + 2 * c + h] = d * (float)LEVELS[byte & 0x0f];
                out[b * QB + 16 + 2 * c + h] = d * (float)LEVELS[byte >> 4];
            }
    }
}

static void slot_mxfp4(const uint8_t *g, int s, int64_t k, float *out) { dequant_slot(g, s, k, out); }

static void group_mxfp4(const uint8_t *g, int64_t k, float *out) {
    for (int s = 0; s < 8; s++) dequant_slot(g, s, k, out + s * k);
}

#if HAVE_AVX2 || HAVE_AVX512

static inline __m256i pair(const int16_t *q) { /* q[0], q[1] in every 32-bit lane */
    int32_t v;
    memcpy(&v, q, sizeof v);
    return _mm256_set1_epi32(v);
}

/* The 8 exponents at e as 8 float32 scales 2^(e - 128) (e8m0_half, lane by lane). */
static inline __m256 scales8(const uint8_t *e) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)e));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(v, _mm256_set1_epi32(1)), 23);
    const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), v);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), v);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, small));
}

/* 16 nibble bytes -> their low nibbles' levels (*lo) and high nibbles' (*hi), as int16. */
static inline void levels16(const uint8_t *p, __m256i *lo, __m256i *hi) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p), low4 = _mm_set1_epi8(0x0f);
    const __m128i table = _mm_loadu_si128((const __m128i *)LEVELS);
    *lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(v, low4)));
    *hi = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), low4)));
}

/* out[r * ldo + j] = dot(row j of the group at g, activation row r) for j < 8, r < nr <= R. */
static inline __attribute__((always_inline)) void x8_tile(const uint8_t *g, int64_t nb, const act_block16 *const *xa,
                                                          int64_t nr, float *out, int64_t ldo, const int R) {
    __m256 acc[XR];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * GB, *q = blk + 8;
        for (int at = 0; at < GB; at += 64) _mm_prefetch((const char *)(blk + MX_PF + at), _MM_HINT_T0);
        __m256i s[XR];
        for (int r = 0; r < R; r++) s[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int c = 0; c < 8; c++) {
            __m256i lo, hi;
            levels16(q + 16 * c, &lo, &hi);
            for (int r = 0; r < R; r++) s[r] = DPW8(s[r], lo, pair(xa[r][b].q + 2 * c));
            for (int r = 0; r < R; r++) s[r] = DPW8(s[r], hi, pair(xa[r][b].q + 16 + 2 * c));
        }
        const __m256 d = scales8(blk);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_mul_ps(d, _mm256_set1_ps(xa[r][b].d)), acc[r]);
    }
    for (int r = 0; r < R && r < nr; r++) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) /* every AVX-512 kind, as quant_x8.c */
#define ZR 8 /* activation rows per 16-row tile */
#if defined(__AVX512VNNI__)
#define DPW(acc, a, b) _mm512_dpwssd_epi32((acc), (a), (b))
#else
#define DPW(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16((a), (b)))
#endif

static inline __m512i pair16(const int16_t *q) { /* q[0], q[1] in every 32-bit lane of a zmm */
    int32_t v;
    memcpy(&v, q, sizeof v);
    return _mm512_set1_epi32(v);
}

/* 32 nibble bytes -> levels as int16: *lo the low nibbles' (byte i in lane i), *hi the high ones'. */
static inline void levels32(const __m256i v, __m512i *lo, __m512i *hi) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)LEVELS));
    *lo = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(table, _mm256_and_si256(v, low4)));
    *hi = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4)));
}

/* x8_tile over two adjacent groups at once (weight rows 0-15 from g, the second group 8 * wrb
 * further): lane j of a zmm is row j, each activation pair one broadcast for 16 rows, up to ZR
 * activation rows over the weights' bytes once; each lane's operations are x8_tile's, in its order. */
static inline __attribute__((always_inline)) void x16_tile(const uint8_t *g, int64_t wrb, int64_t nb,
                                                           const act_block16 *const *xa, int64_t nr, float *out,
                                                           int64_t ldo, const int R) {
    const uint8_t *g2 = g + 8 * wrb;
    __m512 acc[ZR];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * GB, *blk2 = g2 + b * GB;
        for (int at = 0; at < GB; at += 64) {
            _mm_prefetch((const char *)(blk + MX_PF + at), _MM_HINT_T0);
            _mm_prefetch((const char *)(blk2 + MX_PF + at), _MM_HINT_T0);
        }
        __m512i s[ZR];
        for (int r = 0; r < R; r++) s[r] = _mm512_setzero_si512();
        for (int c = 0; c < 8; c++) {
            __m512i lo, hi;
            const __m128i a = _mm_loadu_si128((const __m128i *)(blk + 8 + 16 * c));
            const __m128i a2 = _mm_loadu_si128((const __m128i *)(blk2 + 8 + 16 * c));
            levels32(_mm256_inserti128_si256(_mm256_castsi128_si256(a), a2, 1), &lo, &hi); /* rows 0-7, 8-15 */
            for (int r = 0; r < R; r++) {
                s[r] = DPW(s[r], lo, pair16(xa[r][b].q + 2 * c));
                s[r] = DPW(s[r], hi, pair16(xa[r][b].q + 16 + 2 * c));
            }
        }
        const __m512 d = _mm512_insertf32x8(_mm512_castps256_ps512(scales8(blk)), scales8(blk2), 1);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(d, _mm512_set1_ps(xa[r][b].d)), acc[r]);
    }
    for (int r = 0; r < R && r < nr; r++) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

/* x8_tile for one activation row, a zmm holding two chunks of the group's block (chunk 2i in lanes
 * 0-7, 2i + 1 in lanes 8-15, each lane one row's pair of weights), the activation's pairs placed to
 * match by one permute of its 32 values each (quant_x8.c's x8_row). The halves' integer sums are
 * added exactly before the float steps: x8_tile's bits. */
static inline __attribute__((always_inline)) void x8_row(const uint8_t *g, int64_t nb, const act_block16 *x,
                                                         float *out) {
    __m512i idx[8]; /* pairs 2i (lanes 0-7) and 2i + 1 (lanes 8-15) of the activation's 16 */
    for (int i = 0; i < 8; i++)
        idx[i] = _mm512_inserti64x4(_mm512_set1_epi32(2 * i), _mm256_set1_epi32(2 * i + 1), 1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * GB, *q = blk + 8;
        for (int at = 0; at < GB; at += 64) _mm_prefetch((const char *)(blk + MX_ROW_PF + at), _MM_HINT_T0);
        const __m512i xv = _mm512_loadu_si512(x[b].q);
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int i = 0; i < 4; i++) { /* low nibbles: pairs 0-7 of the activation, high: 8-15 */
            __m512i lo, hi;
            levels32(_mm256_loadu_si256((const __m256i *)(q + 32 * i)), &lo, &hi);
            s0 = DPW(s0, lo, _mm512_permutexvar_epi32(idx[i], xv));
            s1 = DPW(s1, hi, _mm512_permutexvar_epi32(idx[4 + i], xv));
        }
        const __m512i sum = _mm512_add_epi32(s0, s1);
        const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s8), _mm256_mul_ps(scales8(blk), _mm256_set1_ps(x[b].d)), acc);
    }
    _mm256_storeu_ps(out, acc);
}

/* x8_row over G groups at once (8 G weight rows from g, the groups 8 wrb apart), for more rows a
 * pass of the activation's loads and permutes (x8_row's, made once a block for all G groups). The
 * nibbles are widened by one zero extension of the 32 bytes (byte j to word j) and looked up in
 * place by vpshufb on the complemented nibble: RLEVELS[15 - n] = the level + 12 (unsigned, so the
 * word's high byte, indexing RLEVELS[0] = 0, is its zero extension), and each block's sum starts
 * at xoff[b] = -12 sum(q): the same exact integers as x8_row's (int32 wraps; the true sums stay
 * below 2^24), then its float steps lane by lane. Groups in pairs end in one zmm (lanes 0-7 the
 * first group's rows, 8-15 the second's). The G groups are G streams 8 wrb apart, which the
 * hardware's prefetch served worse than one (docs/benchmarks-history.md, "gpt-oss's one-row layers"): each
 * block fetches its share of the next pass's G groups instead, front to back, one stream ahead. */
static const int8_t RLEVELS[16] = {0, 4, 6, 8, 9, 10, 11, 12, 24, 20, 18, 16, 15, 14, 13, 12};
#define ROW_GROUPS 4  /* groups a pass of the one-row tile */
#define ROW_OFF 12    /* RLEVELS[15 - n] - LEVELS[n] */
#define ROW_BLOCKS 512 /* xoff's room (k <= 16384); longer rows take x8_row alone */
int mxfp4_row_groups = 1; /* 0: x8_row alone (bench.worker_step --toggle times both in one process) */

/* The 16 scales of two groups' blocks at a, b (scales8's lane by lane, the first group's in 0-7). */
static inline __m512 scales16(const uint8_t *a, const uint8_t *b) {
    const __m128i e8 = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
    const __m512i v = _mm512_cvtepu8_epi32(e8);
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(v, _mm512_set1_epi32(1)), 23);
    const __mmask16 small = _mm512_cmplt_epi32_mask(v, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_sllv_epi32(normal, small, _mm512_set1_epi32(0x00200000), v));
}

static inline __attribute__((always_inline)) void row_groups(const uint8_t *g, int64_t wrb, int64_t nb,
                                                             const act_block16 *x, const int32_t *xoff, float *out,
                                                             const int G) {
    const __m512i low4 = _mm512_set1_epi16(0x0f);
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)RLEVELS));
    __m512 acc[ROW_GROUPS / 2];
    for (int p = 0; p < G / 2; p++) acc[p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk[ROW_GROUPS];
        for (int j = 0; j < G; j++) blk[j] = g + 8 * j * wrb + b * GB;
        const uint8_t *next = g + 8 * G * wrb + b * G * GB; /* this block's share of the next pass */
        for (int at = 0; at < G * GB; at += 64) _mm_prefetch((const char *)(next + at), _MM_HINT_T0);
        const __m512i xv = _mm512_loadu_si512(x[b].q);
        __m512i s0[ROW_GROUPS], s1[ROW_GROUPS];
        for (int j = 0; j < G; j++) /* the offset once a row: lanes 0-7 and 8-15 add at the end */
            s0[j] = _mm512_maskz_set1_epi32(0x00ff, xoff[b]), s1[j] = _mm512_setzero_si512();
        for (int i = 0; i < 4; i++) { /* low nibbles: pairs 0-7 of the activation, high: 8-15 */
            const __m512i xlo = _mm512_permutexvar_epi32(
                _mm512_inserti64x4(_mm512_set1_epi32(2 * i), _mm256_set1_epi32(2 * i + 1), 1), xv);
            const __m512i xhi = _mm512_permutexvar_epi32(
                _mm512_inserti64x4(_mm512_set1_epi32(8 + 2 * i), _mm256_set1_epi32(9 + 2 * i), 1), xv);
            for (int j = 0; j < G; j++) {
                const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk[j] + 8 + 32 * i)));
                s0[j] = DPW(s0[j], _mm512_shuffle_epi8(table, _mm512_andnot_si512(w, low4)), xlo);
                s1[j] = DPW(s1[j], _mm512_shuffle_epi8(table, _mm512_andnot_si512(_mm512_srli_epi16(w, 4), low4)), xhi);
            }
        }
        const __m512 dx = _mm512_set1_ps(x[b].d);
        for (int p = 0; p < G / 2; p++) {
            const __m512i a = _mm512_add_epi32(s0[2 * p], s1[2 * p]), c = _mm512_add_epi32(s0[2 * p + 1], s1[2 * p + 1]);
            const __m512i sum = _mm512_add_epi32(_mm512_shuffle_i64x2(a, c, 0x44), _mm512_shuffle_i64x2(a, c, 0xee));
            acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scales16(blk[2 * p], blk[2 * p + 1]), dx),
                                     acc[p]);
        }
    }
    for (int p = 0; p < G / 2; p++) _mm512_storeu_ps(out + 16 * p, acc[p]);
}

#if defined(__AVX512VNNI__)
typedef int32_t __attribute__((may_alias, aligned(1))) i32_row;
static const uint8_t ROW_ULEVELS[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0}; /* levels + 12 */

/* row_groups on the 8-bit dot, P pairs of groups a pass (16 weight rows a zmm, lane j row j's 4 nibble
 * bytes of chunks c, c + 1: the 8-bit tile's rows16 layout), the levels + 12 U looked up as unsigned
 * bytes, never widened. The activation's 16-bit q = 256 h + l (h = q >> 8 signed, l = q & 255
 * unsigned; hl: per block h[32] then l[32]), so sum U q = 256 sum U h + sum U l: vpdpbusd of U
 * (unsigned) against h's bytes (signed), and of l's bytes (unsigned) against U as signed bytes
 * (U <= 24), each activation quad broadcast to the 16 rows. 64 products an instruction against
 * vpdpwssd's 32, twice the instructions: as many, and no widening, sign or permute of the
 * activation a block. Each lane's sum 256 sum U h + sum U l - 12 sum(q) is x8_row's exact integer
 * (int32 wraps; every partial sum stays below 2^31 anyway), then its float steps. */
static inline __attribute__((always_inline)) void row_pairs(const uint8_t *g, int64_t wrb, int64_t nb,
                                                            const act_block16 *x, const int8_t *hl,
                                                            const int32_t *xoff, float *out, const int P) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)ROW_ULEVELS));
    const __m512i order = _mm512_set_epi16(31, 23, 30, 22, 29, 21, 28, 20, 27, 19, 26, 18, 25, 17, 24, 16, 15, 7, 14,
                                           6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
    __m512 acc[ROW_GROUPS / 2];
    for (int p = 0; p < P; p++) acc[p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *next = g + 16 * P * wrb + b * 2 * P * GB; /* this block's share of the next pass */
        for (int at = 0; at < 2 * P * GB; at += 64) _mm_prefetch((const char *)(next + at), _MM_HINT_T0);
        const int8_t *h = hl + 64 * b, *l = h + 32;
        const __m512 dx = _mm512_set1_ps(x[b].d);
        for (int p = 0; p < P; p++) {
            const uint8_t *b0 = g + 16 * p * wrb + b * GB, *b1 = b0 + 8 * wrb;
            __m512i sh0 = _mm512_setzero_si512(), sh1 = _mm512_setzero_si512();
            __m512i sl0 = _mm512_setzero_si512(), sl1 = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) { /* low nibbles: weights 4i .. 4i + 3, high: 16 on */
                const __m512i v = _mm512_permutexvar_epi16(
                    order, _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 8 + 32 * i))),
                                              _mm256_loadu_si256((const __m256i *)(b1 + 8 + 32 * i)), 1));
                const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, m4));
                const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
                sh0 = _mm512_dpbusd_epi32(sh0, lo, _mm512_set1_epi32(*(const i32_row *)(h + 4 * i)));
                sh1 = _mm512_dpbusd_epi32(sh1, hi, _mm512_set1_epi32(*(const i32_row *)(h + 16 + 4 * i)));
                sl0 = _mm512_dpbusd_epi32(sl0, _mm512_set1_epi32(*(const i32_row *)(l + 4 * i)), lo);
                sl1 = _mm512_dpbusd_epi32(sl1, _mm512_set1_epi32(*(const i32_row *)(l + 16 + 4 * i)), hi);
            }
            const __m512i sh = _mm512_add_epi32(sh0, sh1), sl = _mm512_add_epi32(sl0, sl1);
            const __m512i sum =
                _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(sh, 8), sl), _mm512_set1_epi32(xoff[b]));
            acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scales16(b0, b1), dx), acc[p]);
        }
    }
    for (int p = 0; p < P; p++) _mm512_storeu_ps(out + 16 * p, acc[p]);
}
#endif

/* Weight rows [0, nc) against one activation row: ROW_GROUPS groups a pass, then a pair (row_pairs
 * where VNNI is, else row_groups), a last odd group through x8_row (the same bits in every lane). */
static void x8_rows1(const uint8_t *w, int64_t wrb, int64_t nc, const act_block16 *x, int64_t nb, float *out) {
    int64_t c0 = 0;
    if (nb <= ROW_BLOCKS && mxfp4_row_groups) {
        int32_t xoff[ROW_BLOCKS];
        for (int64_t b = 0; b < nb; b++)
            xoff[b] = -ROW_OFF * _mm512_reduce_add_epi32(_mm512_madd_epi16(_mm512_loadu_si512(x[b].q), _mm512_set1_epi16(1)));
#if defined(__AVX512VNNI__)
        int8_t hl[ROW_BLOCKS * 64];
        for (int64_t b = 0; b < nb; b++) {
            const __m512i q = _mm512_loadu_si512(x[b].q);
            _mm256_storeu_si256((__m256i *)(hl + 64 * b), _mm512_cvtepi16_epi8(_mm512_srai_epi16(q, 8)));
            _mm256_storeu_si256((__m256i *)(hl + 64 * b + 32), _mm512_cvtepi16_epi8(_mm512_and_si512(q, _mm512_set1_epi16(0xff))));
        }
        for (; c0 + 8 * ROW_GROUPS <= nc; c0 += 8 * ROW_GROUPS)
            row_pairs(w + c0 * wrb, wrb, nb, x, hl, xoff, out + c0, ROW_GROUPS / 2);
        for (; c0 + 16 <= nc; c0 += 16) row_pairs(w + c0 * wrb, wrb, nb, x, hl, xoff, out + c0, 1);
#endif
        for (; c0 + 8 * ROW_GROUPS <= nc; c0 += 8 * ROW_GROUPS)
            row_groups(w + c0 * wrb, wrb, nb, x, xoff, out + c0, ROW_GROUPS);
        for (; c0 + 16 <= nc; c0 += 16) row_groups(w + c0 * wrb, wrb, nb, x, xoff, out + c0, 2);
    }
    for (; c0 < nc; c0 += 8) x8_row(w + c0 * wrb, nb, x, out + c0);
}

/* One group of at most ZR activation rows over weight rows [0, nc): one row through x8_rows1, more
 * through x16_tile on pairs of groups, a last odd group through x8_tile. */
static void x16_rows(const uint8_t *w, int64_t wrb, int64_t nc, const act_block16 *const *xa, int64_t rows,
                     int64_t nb, float *out, int64_t ldo) {
    int64_t c0 = 0;
    if (rows == 1) {
        x8_rows1(w, wrb, nc, xa[0], nb, out);
        return;
    }
    for (; c0 + 16 <= nc; c0 += 16) {
        const uint8_t *g = w + c0 * wrb;
        float *o = out + c0;
        switch (rows) {
        case 2: x16_tile(g, wrb, nb, xa, rows, o, ldo, 2); break;
        case 3: x16_tile(g, wrb, nb, xa, rows, o, ldo, 3); break;
        case 4: x16_tile(g, wrb, nb, xa, rows, o, ldo, 4); break;
        case 5: x16_tile(g, wrb, nb, xa, rows, o, ldo, 5); break;
        case 6: x16_tile(g, wrb, nb, xa, rows, o, ldo, 6); break;
        case 7: x16_tile(g, wrb, nb, xa, rows, o, ldo, 7); break;
        default: x16_tile(g, wrb, nb, xa, rows, o, ldo, ZR); break;
        }
    }
    for (; c0 < nc; c0 += 8)
        for (int64_t r0 = 0; r0 < rows; r0 += XR) {
            const int64_t n = rows - r0 < XR ? rows - r0 : XR;
            const act_block16 *xb[XR];
            for (int r = 0; r < XR; r++) xb[r] = xa[r0 + (r < n ? r : 0)];
            switch (n) {
            case 1: x8_tile(w + c0 * wrb, nb, xb, n, out + r0 * ldo + c0, ldo, 1); break;
            case 2: x8_tile(w + c0 * wrb, nb, xb, n, out + r0 * ldo + c0, ldo, 2); break;
            case 3: x8_tile(w + c0 * wrb, nb, xb, n, out + r0 * ldo + c0, ldo, 3); break;
            default: x8_tile(w + c0 * wrb, nb, xb, n, out + r0 * ldo + c0, ldo, XR); break;
            }
        }
}

/* Weight rows [0, nc) (a multiple of 8, from a group's start) x activation rows [0, nr): activation
 * rows in near-equal groups of at most ZR, each over every weight group in turn. */
static void tile_mxfp4(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                       int64_t nb, float *out, int64_t ldo) {
    const int64_t groups = (nr + ZR - 1) / ZR;
    for (int64_t ag = 0; ag < groups; ag++) {
        const int64_t r0 = nr * ag / groups, rows = nr * (ag + 1) / groups - r0;
        const act_block16 *xa[ZR];
        for (int r = 0; r < ZR; r++) xa[r] = (const act_block16 *)(xq + (r0 + (r < rows ? r : 0)) * xrb);
        x16_rows(w, wrb, nc, xa, rows, nb, out + r0 * ldo, ldo);
    }
}

#else /* AVX2: 8 weight rows a tile, XR activation rows */

static void tile_mxfp4(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                       int64_t nb, float *out, int64_t ldo) {
    const int64_t groups = (nr + XR - 1) / XR;
    for (int64_t ag = 0; ag < groups; ag++) {
        const int64_t r0 = nr * ag / groups, rows = nr * (ag + 1) / groups - r0;
        const act_block16 *xa[XR];
        for (int r = 0; r < XR; r++) xa[r] = (const act_block16 *)(xq + (r0 + (r < rows ? r : 0)) * xrb);
        for (int64_t c0 = 0; c0 < nc; c0 += 8) {
            const uint8_t *g = w + c0 * wrb;
            float *o = out + r0 * ldo + c0;
            switch (rows) {
            case 1: x8_tile(g, nb, xa, rows, o, ldo, 1); break;
            case 2: x8_tile(g, nb, xa, rows, o, ldo, 2); break;
            case 3: x8_tile(g, nb, xa, rows, o, ldo, 3); break;
            default: x8_tile(g, nb, xa, rows, o, ldo, XR); break;
            }
        }
    }
}
#endif /* AVX-512 */

#else /* portable: the same integer sums per (row, block), one row at a time */

static void tile_mxfp4(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                       int64_t nb, float *out, int64_t ldo) {
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *g = w + c / 8 * 8 * wrb;
        const int s = (int)(c % 8);
        for (int64_t r = 0; r < nr; r++) out[r * ldo + c] = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = g + b * GB, *q = blk + 8;
            int32_t lv[QB];
            for (int i = 0; i < 8; i++)
                for (int h = 0; h < 2; h++) {
                    const uint8_t byte = q[16 * i + 2 * s + h];
                    lv[2 * i + h] = LEVELS[byte & 0x0f], lv[16 + 2 * i + h] = LEVELS[byte >> 4];
                }
            const float d = e8m0_half(blk[s]);
            for (int64_t r = 0; r < nr; r++) {
                const act_block16 *xb = (const act_block16 *)(xq + r * xrb) + b;
                int32_t dot = 0; /* exact: see the top of the file */
                for (int j = 0; j < QB; j++) dot += lv[j] * xb->q[j];
                out[r * ldo + c] += (float)dot * (d * xb->d);
            }
        }
    }
}
#endif

/* 8-bit activations (act8_32, quant.h; many rows: quant.py's A8_MIN_ROWS). The nibbles are looked up
 * in the doubled levels plus 12 (0 .. 24, unsigned: ULEVELS), so vpdpbusd (maddubs + madd without
 * VNNI) meets them against the activation's signed bytes, and 12 times the activation block's
 * integer sum is taken off per block: the exact integer dot of the levels themselves. A 32-bit lane
 * holds 4 weights of one row, 2 from each of two adjacent chunks (their 16-bit words interleaved row
 * by row), against the activation's 4 matching bytes broadcast; a block of 8 rows ends as 8 sums in
 * 8 lanes, scaled once by the rows' 2^(e - 128) times the activation's step, and where the block's
 * activations carry the residual pass (two), its bytes r the same way at a 128th of that step.
 * Integers: a lane's maddubs pair sums at most 2 * 24 * 127 = 6096, four of them 24,384, below
 * int16's saturation (AVX2 and AVX-512 without VNNI add four before widening); a block's sum at most
 * 32 * 24 * 127 < 2^24, exact in its float32 conversion. Every build sums the same integers and runs
 * the same float steps per (row, column, block) in the same order, so the same bits (tested). */
static const uint8_t ULEVELS[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
#define LEVEL_OFF 12 /* ULEVELS[i] - LEVELS[i] */
#define XR8 8         /* activation rows per 8-bit tile */

#if HAVE_AVX2 || HAVE_AVX512
typedef int32_t __attribute__((may_alias, aligned(1))) i32_any;

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* Chunks c, c + 1 of one group's block at a and of another's at b (32 bytes each) -> lane j the 4
 * nibble bytes of row j (rows 8-15: the second group's). */
static inline __m512i rows16(const uint8_t *a, const uint8_t *b) {
    const __m512i order = _mm512_set_epi16(31, 23, 30, 22, 29, 21, 28, 20, 27, 19, 26, 18, 25, 17, 24, 16, 15, 7, 14,
                                           6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                                         _mm256_loadu_si256((const __m256i *)b), 1);
    return _mm512_permutexvar_epi16(order, v);
}

/* One pass (the activation bytes q, or r where resid) of block b of the groups at blk0, blk1 into
 * is[r]: sum over the block of (level + 12) * x, less 12 sum(x). */
static inline __attribute__((always_inline)) void pass16(const uint8_t *blk0, const uint8_t *blk1,
                                                         const act8_32 *const *xa, int64_t b, int resid, __m512i *is,
                                                         const int R) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)ULEVELS));
    const int8_t *x[XR8];
    for (int r = 0; r < R; r++) {
        x[r] = resid ? xa[r][b].r : xa[r][b].q;
        is[r] = _mm512_set1_epi32(-LEVEL_OFF * (resid ? xa[r][b].rsum : xa[r][b].qsum));
    }
#if defined(__AVX512VNNI__)
    for (int cp = 0; cp < 4; cp++) {
        const __m512i v = rows16(blk0 + 8 + 32 * cp, blk1 + 8 + 32 * cp);
        const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, m4));
        const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
        for (int r = 0; r < R; r++) { /* the broadcast as vpdpbusd's {1to16} operand (gcc does not fold it) */
            __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(is[r]) : "v"(lo), "m"(*(const i32_any *)(x[r] + 4 * cp)));
            __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(is[r]) : "v"(hi), "m"(*(const i32_any *)(x[r] + 16 + 4 * cp)));
        }
    }
#else
    for (int h = 0; h < 2; h++) {
        __m512i lo[2], hi[2];
        for (int i = 0; i < 2; i++) {
            const __m512i v = rows16(blk0 + 8 + 64 * h + 32 * i, blk1 + 8 + 64 * h + 32 * i);
            lo[i] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, m4));
            hi[i] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
        }
        for (int r = 0; r < R; r++) {
            __m512i s = _mm512_setzero_si512();
            for (int i = 0; i < 2; i++) {
                const int at = 8 * h + 4 * i;
                s = _mm512_add_epi16(s, _mm512_maddubs_epi16(lo[i], _mm512_set1_epi32(*(const i32_any *)(x[r] + at))));
                s = _mm512_add_epi16(s, _mm512_maddubs_epi16(hi[i], _mm512_set1_epi32(*(const i32_any *)(x[r] + 16 + at))));
            }
            is[r] = _mm512_add_epi32(is[r], _mm512_madd_epi16(s, _mm512_set1_epi16(1)));
        }
    }
#endif
}

/* out[r * ldo + j] = dot(tile row j, activation row r) for j < width (16, or 8: g1 is g0 again and
 * only its lanes are stored), r < R. */
static inline __attribute__((always_inline)) void a8_tile(const uint8_t *g0, const uint8_t *g1, int width, int64_t nb,
                                                          const act8_32 *const *xa, float *out, int64_t ldo,
                                                          const int R) {
    const int64_t group = nb * GB; /* a group's bytes; g1 is the group after g0 */
    __m512 acc[XR8];
    __m512i is[XR8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk0 = g0 + b * GB, *blk1 = g1 + b * GB;
        /* past its group's end the first group's prefetch would land in the second (read beside it
         * now): sent two groups on, to the next tile's second group, which no stream fetches ahead
         * (the second's lands in the next tile's first) */
        const uint8_t *pf0 = blk0 + MX_PF + (b * GB + MX_PF >= group ? 2 * group : 0);
        for (int at = 0; at < GB; at += 64) {
            _mm_prefetch((const char *)(pf0 + at), _MM_HINT_T0);
            _mm_prefetch((const char *)(blk1 + MX_PF + at), _MM_HINT_T0);
        }
        int two = 0;
        for (int r = 0; r < R; r++) two |= xa[r][b].two;
        pass16(blk0, blk1, xa, b, 0, is, R);
        const __m512 d = _mm512_insertf32x8(_mm512_castps256_ps512(scales8(blk0)), scales8(blk1), 1);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r]), _mm512_mul_ps(d, _mm512_set1_ps(xa[r][b].d)), acc[r]);
        if (two) { /* r's products at a 128th of q's step (zero for the rows without the pass) */
            pass16(blk0, blk1, xa, b, 1, is, R);
            for (int r = 0; r < R; r++) {
                const __m512 sc = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(xa[r][b].d)), _mm512_set1_ps(1.0f / 128.0f));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r]), sc, acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out + r * ldo, _mm512_castps512_ps256(acc[r]));
        if (width == 16) _mm256_storeu_ps(out + r * ldo + 8, _mm512_extractf32x8_ps(acc[r], 1));
    }
}
#define A8_COLS 16 /* weight rows a tile */
#define A8_TILE(G, WIDTH, R) a8_tile((G), (WIDTH) == 16 ? (G) + 8 * wrb : (G), (WIDTH), nb, xa, o, ldo, (R))

#else /* AVX2: one group a ymm, vpdpbusd where AVX-VNNI is, else maddubs + madd */

/* Chunks c, c + 1 of a group's block at p -> lane j the 4 nibble bytes of row j. */
static inline __m256i rows8(const uint8_t *p) {
    const __m128i a = _mm_loadu_si128((const __m128i *)p), b = _mm_loadu_si128((const __m128i *)(p + 16));
    return _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b));
}

/* pass16's sums for the 8 rows of one group's block. */
static inline __attribute__((always_inline)) void pass8(const uint8_t *blk, const act8_32 *const *xa, int64_t b,
                                                        int resid, __m256i *is, const int R) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)ULEVELS));
    const int8_t *x[XR8];
    for (int r = 0; r < R; r++) {
        x[r] = resid ? xa[r][b].r : xa[r][b].q;
        is[r] = _mm256_set1_epi32(-LEVEL_OFF * (resid ? xa[r][b].rsum : xa[r][b].qsum));
    }
    for (int h = 0; h < 2; h++) {
        __m256i lo[2], hi[2];
        for (int i = 0; i < 2; i++) {
            const __m256i v = rows8(blk + 8 + 64 * h + 32 * i);
            lo[i] = _mm256_shuffle_epi8(table, _mm256_and_si256(v, m4));
            hi[i] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
        }
        for (int r = 0; r < R; r++) {
#if defined(__AVXVNNI__)
            for (int i = 0; i < 2; i++) {
                const int at = 8 * h + 4 * i;
                is[r] = _mm256_dpbusd_avx_epi32(is[r], lo[i], _mm256_set1_epi32(*(const i32_any *)(x[r] + at)));
                is[r] = _mm256_dpbusd_avx_epi32(is[r], hi[i], _mm256_set1_epi32(*(const i32_any *)(x[r] + 16 + at)));
            }
#else
            __m256i s = _mm256_setzero_si256();
            for (int i = 0; i < 2; i++) {
                const int at = 8 * h + 4 * i;
                s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[i], _mm256_set1_epi32(*(const i32_any *)(x[r] + at))));
                s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[i], _mm256_set1_epi32(*(const i32_any *)(x[r] + 16 + at))));
            }
            is[r] = _mm256_add_epi32(is[r], _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
#endif
        }
    }
}

/* a8_tile for one group (8 weight rows). */
static inline __attribute__((always_inline)) void a8_tile8(const uint8_t *g, int64_t nb, const act8_32 *const *xa,
                                                           float *out, int64_t ldo, const int R) {
    __m256 acc[XR8];
    __m256i is[XR8];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * GB;
        for (int at = 0; at < GB; at += 64) _mm_prefetch((const char *)(blk + MX_PF + at), _MM_HINT_T0);
        int two = 0;
        for (int r = 0; r < R; r++) two |= xa[r][b].two;
        pass8(blk, xa, b, 0, is, R);
        const __m256 d = scales8(blk);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), _mm256_mul_ps(d, _mm256_set1_ps(xa[r][b].d)), acc[r]);
        if (two) {
            pass8(blk, xa, b, 1, is, R);
            for (int r = 0; r < R; r++) {
                const __m256 sc = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(xa[r][b].d)), _mm256_set1_ps(1.0f / 128.0f));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), sc, acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * ldo, acc[r]);
}
#define A8_COLS 8
#define A8_TILE(G, WIDTH, R) ((void)(WIDTH), a8_tile8((G), nb, xa, o, ldo, (R)))
#endif

/* Weight rows [0, nc) x activation rows [0, nr): per tile of A8_COLS weight rows (its blocks streamed
 * from memory once), the activation rows in near-equal groups of at most XR8 (rows past the first
 * group meet the tile's blocks again from cache). */
static void tile_mxfp4_a8(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                          int64_t nb, float *out, int64_t ldo) {
    const int64_t groups = (nr + XR8 - 1) / XR8;
    for (int64_t c0 = 0; c0 < nc; c0 += A8_COLS) {
        const uint8_t *g = w + c0 * wrb;
        const int width = nc - c0 >= A8_COLS ? A8_COLS : 8;
        for (int64_t ag = 0; ag < groups; ag++) {
            const int64_t r0 = nr * ag / groups, rows = nr * (ag + 1) / groups - r0;
            const act8_32 *xa[XR8];
            for (int r = 0; r < XR8; r++) xa[r] = (const act8_32 *)(xq + (r0 + (r < rows ? r : 0)) * xrb);
            float *o = out + r0 * ldo + c0;
            switch (rows) {
            case 1: A8_TILE(g, width, 1); break;
            case 2: A8_TILE(g, width, 2); break;
            case 3: A8_TILE(g, width, 3); break;
            case 4: A8_TILE(g, width, 4); break;
            case 5: A8_TILE(g, width, 5); break;
            case 6: A8_TILE(g, width, 6); break;
            case 7: A8_TILE(g, width, 7); break;
            default: A8_TILE(g, width, 8); break;
            }
        }
    }
}

#else /* portable: the same integers and float steps, plain C (a reference; quant.py never routes here) */

static void tile_mxfp4_a8(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                          int64_t nb, float *out, int64_t ldo) {
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *g = w + c / 8 * 8 * wrb;
        const int s = (int)(c % 8);
        for (int64_t r = 0; r < nr; r++) {
            const act8_32 *xa = (const act8_32 *)(xq + r * xrb);
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = g + b * GB, *q = blk + 8;
                int32_t iq = 0, ir = 0;
                for (int i = 0; i < QB / 2; i++) {
                    const uint8_t byte = q[16 * (i / 2) + 2 * s + i % 2];
                    const int32_t lo = LEVELS[byte & 0x0f], hi = LEVELS[byte >> 4];
                    iq += lo * xa[b].q[i] + hi * xa[b].q[16 + i];
                    ir += lo * xa[b].r[i] + hi * xa[b].r[16 + i];
                }
                const float sc = e8m0_half(blk[s]) * xa[b].d;
                acc = fmaf((float)iq, sc, acc);
                if (xa[b].two) acc = fmaf((float)ir, sc * (1.0f / 128.0f), acc);
            }
            out[r * ldo + c] = acc;
        }
    }
}
#endif

static const qtype_ops OPS_MXFP4_X8 = {QTYPE_MXFP4 | QTYPE_X8, QB, BB, (int)sizeof(act_block16), quantize_act16,
                                       tile_mxfp4, NULL, slot_mxfp4, group_mxfp4};
static const qtype_ops OPS_MXFP4_X8_A8 = {QTYPE_MXFP4 | QTYPE_X8 | QTYPE_A8, QB, BB, (int)sizeof(act8_32),
                                          quantize_act8_32, tile_mxfp4_a8, NULL, slot_mxfp4, group_mxfp4};

const qtype_ops *qtype_mxfp4x8(int type) {
    switch (type) {
    case QTYPE_MXFP4 | QTYPE_X8: return &OPS_MXFP4_X8;
    case QTYPE_MXFP4 | QTYPE_X8 | QTYPE_A8: return &OPS_MXFP4_X8_A8;
    default: return NULL;
    }
}
