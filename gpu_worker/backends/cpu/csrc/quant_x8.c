/* The legacy 32-weight blocks (Q4_0, Q4_1, Q8_0) with their weight rows interleaved by 8, the layout
 * the worker holds them in (gpu_worker/backends/cpu/layouts.py's interleave_rows makes it at load; same bytes
 * as the file's). Type code: the ggml type | QTYPE_X8.
 *
 * Rows 8g .. 8g + 7 form group g, stored where the file's rows 8g .. 8g + 7 were. Within a group,
 * block b of the 8 rows lies at b * 8 * block_bytes:
 *   8 fp16 d (row 0 .. 7), [Q4_1: 8 fp16 m], then the rows' quant bytes in chunks of 2 bytes per row:
 *   chunk c = bytes 2c, 2c + 1 of row 0, of row 1, ..., of row 7 (16 bytes; Q4: 8 chunks, Q8_0: 16).
 *
 * Why: at one activation row a matmul is bound by the weights' bytes, and with the file's layout
 * each (row, block) costs a horizontal sum or a scalar scale (a half converted, multiplied and
 * broadcast per row): the one-row tile ran well below the memory's pace (docs/benchmarks.md). Here one
 * 16-byte chunk widened to 16 int16 holds 2 weights of each of the 8 rows, so one madd against the
 * activation's 2 matching values, broadcast, gives each row's partial sum in its own 32-bit lane: a
 * block of 8 rows ends as one vector of 8 sums, met by one vector of 8 scales (one conversion of 8
 * halves). Nothing is summed across lanes until the output, which is those lanes as they are.
 *
 * Low nibbles of chunk c's bytes are weights 2c, 2c + 1 of each row, high nibbles weights 16 + 2c,
 * 17 + 2c: a widened chunk masked meets the activation pair (2c, 2c + 1), shifted meets
 * (16 + 2c, 17 + 2c). Q8_0's chunk c is weights 2c, 2c + 1. Q4_0's q - 8 is never formed: the
 * integers meet q, and 8 d times the activation block's sum s is taken off once per block (as Q4_1
 * adds m s), two subtractions a chunk fewer, which at one row is what bounds the tile.
 *
 * Integer sums: a row's 32 products of one block are summed in int32 before the conversion to
 * float: |qw| <= 128 and |qx| <= 32767, so at most 32 * 128 * 32767 = 134,213,632 < 2^31. Above 2^24
 * the conversion rounds (relative 2^-24), far below the activations' 16-bit rounding (quant.h).
 */
#include "quant.h"
#include "rivulet_kernels.h"

#define QB 32
#ifndef X8_PF
#define X8_PF 4096 /* how far ahead (bytes) the tile prefetches its group's blocks (nearer: one row slower) */
#endif
#define XR 4 /* activation rows per tile */
#ifndef XR_Q8
/* Q8_0's rows per tile on AVX2: its weights need no nibble masks, so 6 rows' sums fit the 16 ymm, and
 * each widened chunk meets 6 rows, not 4 (docs/benchmarks-history.md, "Q8_0 on AVX2") */
#define XR_Q8 6
#endif
#define XR_MAX (XR_Q8 > XR ? XR_Q8 : XR)
#ifndef X8_ROW_PF
/* One row's distance (x8_row, AVX2's x8_tile at one row): it takes a block in less time than many
 * rows do, so the same distance in bytes is less time ahead; it looks further (bench.quant_matmul
 * --against; docs/benchmarks.md, and docs/benchmarks-history.md, "Q8_0 on AVX2" for AVX2) */
#define X8_ROW_PF 8192
#endif

static inline int block_bytes(const int type) { return type == QTYPE_Q8_0 ? 34 : type == QTYPE_Q4_1 ? 20 : 18; }

/* Slot s's block (of the group block at blk) rebuilt as the file's block: d [, m], then its quant
 * bytes in order. */
static inline void plain_block(const uint8_t *blk, int s, const int type, uint8_t *plain) {
    const int head = type == QTYPE_Q4_1 ? 4 : 2, chunks = type == QTYPE_Q8_0 ? 16 : 8;
    memcpy(plain, blk + 2 * s, 2);
    if (type == QTYPE_Q4_1) memcpy(plain + 2, blk + 16 + 2 * s, 2);
    const uint8_t *q = blk + 8 * head;
    for (int c = 0; c < chunks; c++) memcpy(plain + head + 2 * c, q + 16 * c + 2 * s, 2);
}

/* Row s of the group at g (k weights) as float32: each block rebuilt, then the file layout's own
 * dequantization (quant_legacy.c), so the values are exactly gguf-py's. */
static inline void dequant_slot(const uint8_t *g, int s, int64_t k, float *out, const int type) {
    const int bb = block_bytes(type);
    const qtype_ops *plain_ops = qtype_legacy(type);
    uint8_t plain[34];
    for (int64_t b = 0; b < k / QB; b++) {
        plain_block(g + b * 8 * bb, s, type, plain);
        plain_ops->dequant_row(plain, QB, out + b * QB);
    }
}

#if HAVE_AVX2 || HAVE_AVX512

#if defined(__AVX512F__)
#define DPW8_ACC(acc, a, b) DPW8(acc, a, b)
#else /* in asm: gcc reassociated Q8_0's 16 adds a block, made every product first and spilled them */
static inline __m256i dpw8_acc(__m256i acc, __m256i a, __m256i b) {
    __m256i t;
    __asm__("vpmaddwd %[b], %[a], %[t]\n\tvpaddd %[t], %[acc], %[acc]"
            : [acc] "+x"(acc), [t] "=&x"(t)
            : [a] "x"(a), [b] "x"(b));
    return acc;
}
#define DPW8_ACC(acc, a, b) dpw8_acc(acc, a, b)
#endif

static inline __m256i pair(const int16_t *q) { /* q[0], q[1] in every 32-bit lane */
    int32_t v;
    memcpy(&v, q, sizeof v);
    return _mm256_set1_epi32(v);
}

/* out[r * ldo + j] = dot(row j of the group at g, activation row r) for j < 8, r < nr <= R. */
static inline __attribute__((always_inline)) void x8_tile(const uint8_t *g, int64_t nb, const act_block16 *const *xa,
                                                          int64_t nr, float *out, int64_t ldo, const int type,
                                                          const int R) {
    const int bb = block_bytes(type), head = type == QTYPE_Q4_1 ? 32 : 16;
    __m256 acc[XR_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * 8 * bb, *q = blk + head;
        const int pf = R == 1 ? X8_ROW_PF : X8_PF;
        for (int at = 0; at < 8 * bb; at += 64) _mm_prefetch((const char *)(blk + pf + at), _MM_HINT_T0);
        __m256i s[XR_MAX];
        for (int r = 0; r < R; r++) s[r] = _mm256_setzero_si256();
        if (type == QTYPE_Q8_0) {
#if !defined(__AVX512F__)
#pragma GCC unroll 4
#endif
            for (int c = 0; c < 16; c++) {
                const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16 * c)));
                for (int r = 0; r < R; r++)
                    s[r] = DPW8_ACC(s[r], v, pair(xa[r][b].q + 2 * c));
            }
        } else {
#pragma GCC unroll 2 /* fully unrolled, gcc 12 spills the accumulators (docs/benchmarks.md) */
            for (int c = 0; c < 8; c++) {
                const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + 16 * c)));
                const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0f)), hi = _mm256_srli_epi16(v, 4);
                for (int r = 0; r < R; r++)
                    s[r] = DPW8(s[r], lo, pair(xa[r][b].q + 2 * c));
                for (int r = 0; r < R; r++)
                    s[r] = DPW8(s[r], hi, pair(xa[r][b].q + 16 + 2 * c));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_mul_ps(d, _mm256_set1_ps(xa[r][b].d)), acc[r]);
        if (type == QTYPE_Q4_1) {
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
            for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xa[r][b].s), acc[r]);
        } else if (type == QTYPE_Q4_0) {
            const __m256 m = _mm256_mul_ps(d, _mm256_set1_ps(8.0f));
            for (int r = 0; r < R; r++) acc[r] = _mm256_fnmadd_ps(m, _mm256_set1_ps(xa[r][b].s), acc[r]);
        }
    }
    for (int r = 0; r < R && r < nr; r++) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

/* 8 vectors of 8 uint16 (a[c] = chunk c: 2 bytes of each row) -> r[s] = row s's 8 chunks in order:
 * the 8 x 8 transpose of 16-bit elements, in three rounds of unpacks. */
static inline void transpose8x16(const __m128i a[8], __m128i r[8]) {
    __m128i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
        t[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm_unpacklo_epi32(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm_unpackhi_epi32(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm_unpacklo_epi32(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm_unpackhi_epi32(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[2 * i] = _mm_unpacklo_epi64(u[i], u[4 + i]);
        r[2 * i + 1] = _mm_unpackhi_epi64(u[i], u[4 + i]);
    }
}

/* 16 int16 -> 16 float32 d * q + m at out (one rounding, as gguf-py's d * q + m). */
static inline void put16(__m256i q, __m256 d, __m256 m, float *out) {
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(q)));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(q, 1)));
    _mm256_storeu_ps(out, _mm256_fmadd_ps(d, lo, m));
    _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(d, hi, m));
}

/* The 8 rows of the group at g (k weights each) as float32 at out + s * ldo: per block, the chunks
 * transposed back to each row's bytes, then widened as quant_legacy.c's dequant_block (same values). */
static inline void dequant_group(const uint8_t *g, int64_t k, float *out, int64_t ldo, const int type) {
    const int bb = block_bytes(type), head = type == QTYPE_Q4_1 ? 32 : 16;
    for (int64_t b = 0; b < k / QB; b++) {
        const uint8_t *blk = g + b * 8 * bb, *q = blk + head;
        float d[8], m[8] = {0};
        _mm256_storeu_ps(d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk)));
        if (type == QTYPE_Q4_1) _mm256_storeu_ps(m, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))));
        __m128i a[8], r[8], r2[8];
        for (int c = 0; c < 8; c++) a[c] = _mm_loadu_si128((const __m128i *)(q + 16 * c));
        transpose8x16(a, r);
        if (type == QTYPE_Q8_0) {
            for (int c = 0; c < 8; c++) a[c] = _mm_loadu_si128((const __m128i *)(q + 128 + 16 * c));
            transpose8x16(a, r2);
        }
        for (int s = 0; s < 8; s++) {
            float *o = out + s * ldo + b * QB;
            const __m256 ds = _mm256_set1_ps(d[s]), ms = _mm256_set1_ps(m[s]);
            if (type == QTYPE_Q8_0) {
                put16(_mm256_cvtepi8_epi16(r[s]), ds, ms, o);
                put16(_mm256_cvtepi8_epi16(r2[s]), ds, ms, o + 16);
            } else {
                const __m256i v = _mm256_cvtepu8_epi16(r[s]);
                __m256i lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0f)), hi = _mm256_srli_epi16(v, 4);
                if (type == QTYPE_Q4_0) {
                    lo = _mm256_sub_epi16(lo, _mm256_set1_epi16(8));
                    hi = _mm256_sub_epi16(hi, _mm256_set1_epi16(8));
                }
                put16(lo, ds, ms, o);
                put16(hi, ds, ms, o + 16);
            }
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) /* every AVX-512 kind, as quant_kx8.c */
#define ZR 8 /* activation rows per 16-row tile */
#if defined(__AVX512VNNI__)
#define DPW(acc, a, b) _mm512_dpwssd_epi32((acc), (a), (b))
#else
#define DPW(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16((a), (b)))
#endif

/* Two groups side by side: 16 bytes at a in lanes 0-7 (as int16), 16 at b in lanes 8-15. */
static inline __m512i widen_two(const uint8_t *a, const uint8_t *b, const int is_signed) {
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                              _mm_loadu_si128((const __m128i *)b), 1);
    return is_signed ? _mm512_cvtepi8_epi16(v) : _mm512_cvtepu8_epi16(v);
}

static inline __m512i pair16(const int16_t *q) { /* q[0], q[1] in every 32-bit lane of a zmm */
    int32_t v;
    memcpy(&v, q, sizeof v);
    return _mm512_set1_epi32(v);
}

static inline __m512 halves_two(const uint8_t *a, const uint8_t *b) { /* 8 fp16 at a, then 8 at b */
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}

/* x8_tile over two adjacent groups at once (weight rows 0-15 from g, the second group 8 * wrb
 * further): lane j of a zmm is row j, so each activation pair is one broadcast for 16 rows, and
 * up to ZR activation rows pass over the weights' bytes once. Each lane does x8_tile's integer
 * and float operations in x8_tile's order, so the sums are the same bits. */
static inline __attribute__((always_inline)) void x16_tile(const uint8_t *g, int64_t wrb, int64_t nb,
                                                           const act_block16 *const *xa, int64_t nr, float *out,
                                                           int64_t ldo, const int type, const int R) {
    const int bb = block_bytes(type), head = type == QTYPE_Q4_1 ? 32 : 16;
    const uint8_t *g2 = g + 8 * wrb;
    __m512 acc[ZR];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * 8 * bb, *blk2 = g2 + b * 8 * bb, *q = blk + head, *q2 = blk2 + head;
        for (int at = 0; at < 8 * bb; at += 64) {
            _mm_prefetch((const char *)(blk + X8_PF + at), _MM_HINT_T0);
            _mm_prefetch((const char *)(blk2 + X8_PF + at), _MM_HINT_T0);
        }
        __m512i s[ZR];
        for (int r = 0; r < R; r++) s[r] = _mm512_setzero_si512();
        if (type == QTYPE_Q8_0) {
            for (int c = 0; c < 16; c++) {
                const __m512i v = widen_two(q + 16 * c, q2 + 16 * c, 1);
                for (int r = 0; r < R; r++) s[r] = DPW(s[r], v, pair16(xa[r][b].q + 2 * c));
            }
        } else {
            for (int c = 0; c < 8; c++) {
                const __m512i v = widen_two(q + 16 * c, q2 + 16 * c, 0);
                const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi16(0x0f)), hi = _mm512_srli_epi16(v, 4);
                for (int r = 0; r < R; r++) {
                    s[r] = DPW(s[r], lo, pair16(xa[r][b].q + 2 * c));
                    s[r] = DPW(s[r], hi, pair16(xa[r][b].q + 16 + 2 * c));
                }
            }
        }
        const __m512 d = halves_two(blk, blk2);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(d, _mm512_set1_ps(xa[r][b].d)), acc[r]);
        if (type == QTYPE_Q4_1) {
            const __m512 m = halves_two(blk + 16, blk2 + 16);
            for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xa[r][b].s), acc[r]);
        } else if (type == QTYPE_Q4_0) {
            const __m512 m = _mm512_mul_ps(d, _mm512_set1_ps(8.0f));
            for (int r = 0; r < R; r++) acc[r] = _mm512_fnmadd_ps(m, _mm512_set1_ps(xa[r][b].s), acc[r]);
        }
    }
    for (int r = 0; r < R && r < nr; r++) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

/* x8_tile for one activation row, a zmm holding two chunks of the group's block (chunk 2i in lanes
 * 0-7, 2i + 1 in lanes 8-15, each lane one row's pair of weights), the activation's pairs placed to
 * match by one permute of its 32 values each: half the multiplies and loads of x8_tile's ymm. The
 * two halves' integer sums are added (exactly) before x8_tile's float steps, in its order: the same
 * bits. */
static inline __attribute__((always_inline)) void x8_row(const uint8_t *g, int64_t nb, const act_block16 *x,
                                                         float *out, const int type) {
    const int bb = block_bytes(type), head = type == QTYPE_Q4_1 ? 32 : 16;
    __m512i idx[8]; /* pairs 2i (lanes 0-7) and 2i + 1 (lanes 8-15) of the activation's 16 */
    for (int i = 0; i < 8; i++)
        idx[i] = _mm512_inserti64x4(_mm512_set1_epi32(2 * i), _mm256_set1_epi32(2 * i + 1), 1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * 8 * bb, *q = blk + head;
        for (int at = 0; at < 8 * bb; at += 64) _mm_prefetch((const char *)(blk + X8_ROW_PF + at), _MM_HINT_T0);
        const __m512i xv = _mm512_loadu_si512(x[b].q);
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        if (type == QTYPE_Q8_0) {
            for (int i = 0; i < 8; i += 2) {
                s0 = DPW(s0, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * i))),
                         _mm512_permutexvar_epi32(idx[i], xv));
                s1 = DPW(s1, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * i + 32))),
                         _mm512_permutexvar_epi32(idx[i + 1], xv));
            }
        } else { /* low nibbles: pairs 0-7 of the activation, high: 8-15 */
            for (int i = 0; i < 4; i++) {
                const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * i)));
                s0 = DPW(s0, _mm512_and_si512(v, _mm512_set1_epi16(0x0f)), _mm512_permutexvar_epi32(idx[i], xv));
                s1 = DPW(s1, _mm512_srli_epi16(v, 4), _mm512_permutexvar_epi32(idx[4 + i], xv));
            }
        }
        const __m512i sum = _mm512_add_epi32(s0, s1);
        const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s8), _mm256_mul_ps(d, _mm256_set1_ps(x[b].d)), acc);
        if (type == QTYPE_Q4_1) {
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
            acc = _mm256_fmadd_ps(m, _mm256_set1_ps(x[b].s), acc);
        } else if (type == QTYPE_Q4_0) {
            acc = _mm256_fnmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(8.0f)), _mm256_set1_ps(x[b].s), acc);
        }
    }
    _mm256_storeu_ps(out, acc);
}

/* One group of at most ZR activation rows over weight rows [0, nc): one row through x8_row, a group
 * at a time; more rows through x16_tile, pairs of groups, a last odd group through x8_tile (at most
 * XR activation rows a call). */
static inline __attribute__((always_inline)) void x16_rows(const uint8_t *w, int64_t wrb, int64_t nc,
                                                           const act_block16 *const *xa, int64_t rows,
                                                           int64_t nb, float *out, int64_t ldo, const int type) {
    int64_t c0 = 0;
    if (rows == 1) { /* one row: a group at a time, one stream per group, reads memory faster (bench.quant_matmul) */
        for (; c0 < nc; c0 += 8) x8_row(w + c0 * wrb, nb, xa[0], out + c0, type);
        return;
    }
    for (; c0 + 16 <= nc; c0 += 16) {
        const uint8_t *g = w + c0 * wrb;
        float *o = out + c0;
        switch (rows) {
        case 1: x16_tile(g, wrb, nb, xa, rows, o, ldo, type, 1); break;
        case 2: x16_tile(g, wrb, nb, xa, rows, o, ldo, type, 2); break;
        case 3: x16_tile(g, wrb, nb, xa, rows, o, ldo, type, 3); break;
        case 4: x16_tile(g, wrb, nb, xa, rows, o, ldo, type, 4); break;
        case 5: x16_tile(g, wrb, nb, xa, rows, o, ldo, type, 5); break;
        case 6: x16_tile(g, wrb, nb, xa, rows, o, ldo, type, 6); break;
        case 7: x16_tile(g, wrb, nb, xa, rows, o, ldo, type, 7); break;
        default: x16_tile(g, wrb, nb, xa, rows, o, ldo, type, ZR); break;
        }
    }
    for (; c0 < nc; c0 += 8) /* an odd group (or one row): XR activation rows at a time */
        for (int64_t r0 = 0; r0 < rows; r0 += XR) {
            const int64_t n = rows - r0 < XR ? rows - r0 : XR;
            const act_block16 *xb[XR];
            for (int r = 0; r < XR; r++) xb[r] = xa[r0 + (r < n ? r : 0)];
            switch (n) {
            case 1: x8_tile(w + c0 * wrb, nb, xb, n, out + r0 * ldo + c0, ldo, type, 1); break;
            case 2: x8_tile(w + c0 * wrb, nb, xb, n, out + r0 * ldo + c0, ldo, type, 2); break;
            case 3: x8_tile(w + c0 * wrb, nb, xb, n, out + r0 * ldo + c0, ldo, type, 3); break;
            default: x8_tile(w + c0 * wrb, nb, xb, n, out + r0 * ldo + c0, ldo, type, XR); break;
            }
        }
}

/* Weight rows [0, nc) (nc a multiple of 8, the first at a group's start) x activation rows [0, nr):
 * activation rows in near-equal groups of at most ZR, each group over every weight group in turn. */
#define X8_LOOP(TYPE)                                                                                         \
    do {                                                                                                      \
        const int64_t groups = (nr + ZR - 1) / ZR;                                                            \
        for (int64_t ag = 0; ag < groups; ag++) {                                                             \
            const int64_t r0 = nr * ag / groups, rows = nr * (ag + 1) / groups - r0;                          \
            const act_block16 *xa[ZR];                                                                        \
            for (int r = 0; r < ZR; r++) xa[r] = (const act_block16 *)(xq + (r0 + (r < rows ? r : 0)) * xrb); \
            x16_rows(w, wrb, nc, xa, rows, nb, out + r0 * ldo, ldo, TYPE);                                    \
        }                                                                                                     \
    } while (0)

#else
/* Weight rows [0, nc) (nc a multiple of 8, the first at a group's start) x activation rows [0, nr):
 * activation rows in near-equal groups of at most XR (Q8_0: XR_Q8), each group over every weight
 * group in turn. */
#define X8_LOOP(TYPE)                                                                                         \
    do {                                                                                                      \
        const int xr = (TYPE) == QTYPE_Q8_0 ? XR_Q8 : XR;                                                     \
        const int64_t groups = (nr + xr - 1) / xr;                                                            \
        for (int64_t ag = 0; ag < groups; ag++) {                                                             \
            const int64_t r0 = nr * ag / groups, rows = nr * (ag + 1) / groups - r0;                          \
            const act_block16 *xa[XR_MAX];                                                                    \
            for (int r = 0; r < xr; r++) xa[r] = (const act_block16 *)(xq + (r0 + (r < rows ? r : 0)) * xrb); \
            for (int64_t c0 = 0; c0 < nc; c0 += 8) {                                                          \
                const uint8_t *g = w + c0 * wrb;                                                              \
                float *o = out + r0 * ldo + c0;                                                               \
                switch (rows < xr ? rows : xr) {                                                              \
                case 1: x8_tile(g, nb, xa, rows, o, ldo, TYPE, 1); break;                                     \
                case 2: x8_tile(g, nb, xa, rows, o, ldo, TYPE, 2); break;                                     \
                case 3: x8_tile(g, nb, xa, rows, o, ldo, TYPE, 3); break;                                     \
                case XR: x8_tile(g, nb, xa, rows, o, ldo, TYPE, XR); break;                                   \
                case XR + 1: x8_tile(g, nb, xa, rows, o, ldo, TYPE, (TYPE) == QTYPE_Q8_0 ? XR + 1 : XR); break; \
                default: x8_tile(g, nb, xa, rows, o, ldo, TYPE, (TYPE) == QTYPE_Q8_0 ? XR_Q8 : XR); break;    \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    } while (0)
#endif /* AVX-512 */

#else /* portable: each row of a group rebuilt in the file's layout, then quant_legacy.c's plain-C tile */

static inline void dequant_group(const uint8_t *g, int64_t k, float *out, int64_t ldo, const int type) {
    for (int s = 0; s < 8; s++) dequant_slot(g, s, k, out + s * ldo, type);
}

/* The 8 rows of each group against every activation row, one row at a time through the file
 * layout's tile (the same integer dot products the AVX2 tile computes). */
static inline void x8_plain(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                            int64_t nb, float *out, int64_t ldo, const int type) {
    const int bb = block_bytes(type);
    const qtype_ops *plain_ops = qtype_legacy(type);
    uint8_t row[wrb];
    for (int64_t c0 = 0; c0 < nc; c0 += 8)
        for (int s = 0; s < 8; s++) {
            for (int64_t b = 0; b < nb; b++) plain_block(w + c0 * wrb + b * 8 * bb, s, type, row + b * bb);
            plain_ops->tile(row, wrb, 1, xq, xrb, nr, nb, out + c0 + s, ldo);
        }
}
#define X8_LOOP(TYPE) x8_plain(w, wrb, nc, xq, xrb, nr, nb, out, ldo, TYPE)
#endif

LEGACY_TILES(X8_LOOP)

static void slot_q4_0(const uint8_t *g, int s, int64_t k, float *out) { dequant_slot(g, s, k, out, QTYPE_Q4_0); }
static void slot_q4_1(const uint8_t *g, int s, int64_t k, float *out) { dequant_slot(g, s, k, out, QTYPE_Q4_1); }
static void slot_q8_0(const uint8_t *g, int s, int64_t k, float *out) { dequant_slot(g, s, k, out, QTYPE_Q8_0); }
static void group_q4_0(const uint8_t *g, int64_t k, float *out) { dequant_group(g, k, out, k, QTYPE_Q4_0); }
static void group_q4_1(const uint8_t *g, int64_t k, float *out) { dequant_group(g, k, out, k, QTYPE_Q4_1); }
static void group_q8_0(const uint8_t *g, int64_t k, float *out) { dequant_group(g, k, out, k, QTYPE_Q8_0); }

#define ACT_BYTES ((int)sizeof(act_block16))
static const qtype_ops OPS_Q4_0 = {QTYPE_Q4_0 | QTYPE_X8, QB, 18, ACT_BYTES, quantize_act16, tile_q4_0,
                                   NULL, slot_q4_0, group_q4_0};
static const qtype_ops OPS_Q4_1 = {QTYPE_Q4_1 | QTYPE_X8, QB, 20, ACT_BYTES, quantize_act16, tile_q4_1,
                                   NULL, slot_q4_1, group_q4_1};
static const qtype_ops OPS_Q8_0 = {QTYPE_Q8_0 | QTYPE_X8, QB, 34, ACT_BYTES, quantize_act16, tile_q8_0,
                                   NULL, slot_q8_0, group_q8_0};

#if HAVE_AVX2 || HAVE_AVX512
/* The 8-bit activations' tiles of these types (quant_kx8.c, type | QTYPE_A8) take whole 256s of k,
 * act_block8's; a row of any other multiple of 32 (Gemma 3's 640, most of whose weights a Q4_K_M
 * file holds as Q5_0 and Q8_0) meets them here: its whole 256s on 8 bits, the rest (fewer than 8
 * blocks of 32) on the 16-bit tile above, the two sums added. An activation row is then its k / 256
 * act_block8, followed by the rest as act_block16; A8_ANY_ACT per 32 values leaves room for either.
 * Where k is whole 256s this is quant_kx8.c's tile alone: the same bits. */
#define A8_ANY_ACT ((int)sizeof(act_block8) / 8)
#define A8_REST_COLS 64 /* columns of the rest's partial sums at a time (on the stack) */

static void quantize_act8_any(const float *x, int64_t k, void *xq) {
    const int64_t whole = k / 256 * 256;
    quantize_act8(x, whole, xq);
    if (k > whole) quantize_act16(x + whole, k - whole, (uint8_t *)xq + whole / 256 * (int64_t)sizeof(act_block8));
}

typedef void (*tile_fn)(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                        int64_t nb, float *out, int64_t ldo);

static inline void a8_any(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                          int64_t nb, float *out, int64_t ldo, const int type, tile_fn rest_tile) {
    const int64_t whole = nb / 8, rest = nb % 8;
    if (whole > 0) qtype_kx8(type | QTYPE_X8 | QTYPE_A8)->tile(w, wrb, nc, xq, xrb, nr, whole, out, ldo);
    if (rest == 0) return;
    const uint8_t *wr = w + whole * 64 * block_bytes(type), *xr = xq + whole * (int64_t)sizeof(act_block8);
    float part[8 * A8_REST_COLS];
    for (int64_t c0 = 0; c0 < nc; c0 += A8_REST_COLS) {
        const int64_t cw = nc - c0 < A8_REST_COLS ? nc - c0 : A8_REST_COLS;
        for (int64_t r0 = 0; r0 < nr; r0 += 8) {
            const int64_t rn = nr - r0 < 8 ? nr - r0 : 8;
            rest_tile(wr + c0 * wrb, wrb, cw, xr + r0 * xrb, xrb, rn, rest, part, cw);
            for (int64_t r = 0; r < rn; r++) {
                float *o = out + (r0 + r) * ldo + c0;
                const float *p = part + r * cw;
                if (whole > 0) {
                    for (int64_t j = 0; j < cw; j++) o[j] += p[j];
                } else {
                    memcpy(o, p, (size_t)cw * sizeof(float));
                }
            }
        }
    }
}

static void tile_q4_0_a8(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                         int64_t nb, float *out, int64_t ldo) {
    a8_any(w, wrb, nc, xq, xrb, nr, nb, out, ldo, QTYPE_Q4_0, tile_q4_0);
}
static void tile_q4_1_a8(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                         int64_t nb, float *out, int64_t ldo) {
    a8_any(w, wrb, nc, xq, xrb, nr, nb, out, ldo, QTYPE_Q4_1, tile_q4_1);
}
static void tile_q8_0_a8(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                         int64_t nb, float *out, int64_t ldo) {
    a8_any(w, wrb, nc, xq, xrb, nr, nb, out, ldo, QTYPE_Q8_0, tile_q8_0);
}
static const qtype_ops OPS_Q4_0_A8 = {QTYPE_Q4_0 | QTYPE_X8 | QTYPE_A8, QB, 18, A8_ANY_ACT, quantize_act8_any,
                                      tile_q4_0_a8, NULL, slot_q4_0, group_q4_0};
static const qtype_ops OPS_Q4_1_A8 = {QTYPE_Q4_1 | QTYPE_X8 | QTYPE_A8, QB, 20, A8_ANY_ACT, quantize_act8_any,
                                      tile_q4_1_a8, NULL, slot_q4_1, group_q4_1};
static const qtype_ops OPS_Q8_0_A8 = {QTYPE_Q8_0 | QTYPE_X8 | QTYPE_A8, QB, 34, A8_ANY_ACT, quantize_act8_any,
                                      tile_q8_0_a8, NULL, slot_q8_0, group_q8_0};

/* ``ops`` where quant_kx8.c has the type's 8-bit tile on this build, else NULL. */
static const qtype_ops *where_a8(int type, const qtype_ops *ops) { return qtype_kx8(type) != NULL ? ops : NULL; }
#endif

const qtype_ops *qtype_x8(int type) {
    switch (type) {
    case QTYPE_Q4_0 | QTYPE_X8: return &OPS_Q4_0;
    case QTYPE_Q4_1 | QTYPE_X8: return &OPS_Q4_1;
    case QTYPE_Q8_0 | QTYPE_X8: return &OPS_Q8_0;
#if HAVE_AVX2 || HAVE_AVX512
    case QTYPE_Q4_0 | QTYPE_X8 | QTYPE_A8: return where_a8(type, &OPS_Q4_0_A8);
    case QTYPE_Q4_1 | QTYPE_X8 | QTYPE_A8: return where_a8(type, &OPS_Q4_1_A8);
    case QTYPE_Q8_0 | QTYPE_X8 | QTYPE_A8: return where_a8(type, &OPS_Q8_0_A8);
#endif
    default: return NULL;
    }
}
