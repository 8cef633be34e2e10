/* The legacy 32-weight GGUF blocks: Q4_0, Q4_1, Q8_0 (ggml's block layouts, checked against gguf-py's
 * dequantize in tests/gpu_worker/test_quant_kernels.py).
 *
 *   Q4_0, 18 bytes: fp16 d, 16 bytes of nibbles; weight j = d * (q_j - 8)
 *   Q4_1, 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles; weight j = d * q_j + m
 *   Q8_0, 34 bytes: fp16 d, 32 int8; weight j = d * q_j
 * Nibbles: weight j < 16 is the low nibble of byte j, weight j >= 16 the high nibble of byte j - 16.
 *
 * Activations, one format for all three: each block of 32 quantized to int8 with its own scale,
 * d = max|x| / 127, q = round-to-nearest-even(x * (127 / max|x|)), and s = d * sum(q). A quantized row
 * of nb blocks holds its nb * 32 int8 first, then nb float d, then nb float s (40 bytes a block):
 * the int8 of a block load as one 256-bit vector, and the s of consecutive blocks are contiguous for
 * the min term below.
 *
 * One block of weight row c against activation row r, x_i ~ dx * qx_i:
 *   Q8_0: dw * dx * dot(qw, qx)                  (s8 x s8: |qw| times qx signed by qw, maddubs)
 *   Q4_1: dw * dx * dot(qw, qx) + m * s           (u4 x s8: maddubs directly)
 *   Q4_0: dw * dx * dot(qw, qx) + (-8 dw) * s     (the same kernel, the nibbles unsigned, m = -8 dw)
 * The integer dot of 32 products is exact (maddubs' pairs stay below 2^15: 15 * 127 * 2, 128 * 127 * 2),
 * then converted and scaled once per block. The Q4 min terms, m * s per block, are a dot product
 * over blocks: their m are kept per chunk of blocks and summed with the chunk's s at its end, off the
 * per-block path.
 *
 * The tile blocks registers over MR activation rows x MC weight rows: each weight block is unpacked
 * once per MR rows and each activation vector loaded once per MC weight rows. One activation row is
 * bound by memory: 4 weight rows (4 streams) per pass.
 */
#include "quant.h"

#define QB 32          /* weights per block */
#define ACT_BYTES 40   /* 32 int8 + float d + float s */
#define KC 32          /* blocks per chunk (scales precomputed per chunk) */
#ifndef MR
#define MR 6 /* activation rows per register tile */
#endif
#ifndef MC
#define MC 2 /* weight rows per register tile */
#endif
#ifndef MC1
#define MC1 4 /* weight rows per tile at one activation row */
#endif

static inline float half_bits_to_f32(uint16_t h) {
#if HAVE_AVX2 || HAVE_AVX512
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7fffu;
    uint32_t bits;
    if (em >= 0x7c00u) {
        bits = sign | 0x7f800000u | ((em & 0x3ffu) << 13); /* inf, NaN */
    } else if (em >= 0x0400u) {
        bits = sign | ((em << 13) + ((uint32_t)(127 - 15) << 23)); /* normal */
    } else {
        const float f = (float)em * 5.9604644775390625e-8f; /* subnormal: em * 2^-24, exact */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static inline float half_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return half_bits_to_f32(h);
}

/* The parts of a quantized activation row of nb blocks. */
static inline const int8_t *act_q(const uint8_t *xq) { return (const int8_t *)xq; }
static inline const float *act_d(const uint8_t *xq, int64_t nb) { return (const float *)(xq + nb * QB); }
static inline const float *act_s(const uint8_t *xq, int64_t nb) { return (const float *)(xq + nb * (QB + 4)); }

/* ---- activations ---- */

static void quantize_act(const float *x, int64_t k, void *out) {
    const int64_t nb = k / QB;
    int8_t *q = (int8_t *)out;
    float *ds = (float *)((uint8_t *)out + nb * QB), *ss = ds + nb;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QB;
        int8_t *qb = q + b * QB;
#if HAVE_AVX2 || HAVE_AVX512
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                 _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m256 idv = _mm256_set1_ps(id);
        __m256i qi[4];
        for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv)); /* nearest even */
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        /* packs interleave the 128-bit lanes: 0-3 8-11 4-7 12-15 (x2 for the bytes); a permute of
         * 32-bit groups puts them back in order */
        const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
        const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        _mm256_storeu_si256((__m256i *)qb, _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        ds[b] = d;
        ss[b] = d * (float)_mm_cvtsi128_si32(s4);
#else
        float amax = 0.0f;
        for (int i = 0; i < QB; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < QB; i++) {
            const int qv = (int)lrintf(xb[i] * id); /* nearest even, as cvtps2dq */
            qb[i] = (int8_t)qv;
            sum += qv;
        }
        ds[b] = d;
        ss[b] = d * (float)sum;
#endif
    }
}

/* ---- dequantization (embedding rows, and the reference) ---- */

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

/* ---- tiles ---- */

#if HAVE_AVX2 || HAVE_AVX512
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The 32 nibbles of a Q4 block (at q) as bytes in weight order: the 16 bytes in both 128-bit lanes,
 * the high lane shifted right by 4, then masked. */
static inline __m256i unpack_nibbles(const uint8_t *q) {
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
    return _mm256_and_si256(_mm256_srlv_epi64(raw, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0f));
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
    return hsum256(acc);
}

/* Weight rows [0, C) x activation rows [0, R) (R, C constants once inlined: the accumulators stay in
 * registers). Rows past nc / nr repeat the last valid one (from cache), their sums not stored.
 * Per chunk of KC blocks, first the scales of every (row, column, block), d_w * d_x, as floats (and
 * for Q4 the m of each weight block); then per block and pair only integer dot, convert, FMA with
 * the scale loaded from L1; at the chunk's end the Q4 min terms, dot(m, s) over its blocks. */
static inline __attribute__((always_inline)) void legacy_micro(const uint8_t *w, int64_t wrb, int64_t nc,
                                                               const uint8_t *xq, int64_t xrb, int64_t nr,
                                                               int64_t nb, float *out, int64_t ldo, const int type,
                                                               const int R, const int C) {
    const int bb = type == QTYPE_Q8_0 ? 34 : type == QTYPE_Q4_1 ? 20 : 18;
    const int qoff = type == QTYPE_Q4_1 ? 4 : 2;
    const uint8_t *wr[MC1], *xr[MR];
    const float *xd[MR], *xs[MR];
    for (int c = 0; c < C; c++) wr[c] = w + (c < nc ? c : nc - 1) * wrb;
    for (int r = 0; r < R; r++) {
        xr[r] = xq + (r < nr ? r : nr - 1) * xrb;
        xd[r] = act_d(xr[r], nb);
        xs[r] = act_s(xr[r], nb);
    }
    __m256 acc[MR][MC1];
    float msum[MR][MC1];
    float dw[MC1][KC], mf[MC1][KC], sc[MR][MC1][KC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps(), msum[r][c] = 0.0f;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b0 = 0; b0 < nb; b0 += KC) {
        const int len = nb - b0 < KC ? (int)(nb - b0) : KC;
        for (int c = 0; c < C; c++) {
            if (type == QTYPE_Q4_1) {
                chunk_half_pairs(wr[c], b0, len, dw[c], mf[c]);
            } else {
                chunk_halves(wr[c], b0, len, bb, dw[c]);
                if (type == QTYPE_Q4_0)
                    for (int i = 0; i < len; i++) mf[c][i] = -8.0f * dw[c][i];
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
#pragma omp simd
                for (int i = 0; i < len; i++) sc[r][c][i] = dw[c][i] * xd[r][b0 + i];
        for (int i = 0; i < len; i++) {
            const int64_t b = b0 + i;
            __m256i wq[MC1], wa[MC1];
            for (int c = 0; c < C; c++) {
                if (type == QTYPE_Q8_0) {
                    wq[c] = _mm256_loadu_si256((const __m256i *)(wr[c] + b * bb + 2));
                    wa[c] = _mm256_abs_epi8(wq[c]);
                } else {
                    wq[c] = unpack_nibbles(wr[c] + b * bb + qoff);
                }
            }
            for (int r = 0; r < R; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xr[r] + b * QB));
                for (int c = 0; c < C; c++) {
                    /* s8 x s8 (Q8_0): |w| times x signed by w, so maddubs' unsigned side is |w| */
                    const __m256i p16 = type == QTYPE_Q8_0 ? _mm256_maddubs_epi16(wa[c], _mm256_sign_epi8(xv, wq[c]))
                                                           : _mm256_maddubs_epi16(wq[c], xv);
                    const __m256i p = _mm256_madd_epi16(p16, ones);
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&sc[r][c][i]), acc[r][c]);
                }
            }
        }
        if (type != QTYPE_Q8_0)
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C; c++) msum[r][c] += dot_f32(mf[c], xs[r] + b0, len);
    }
    for (int r = 0; r < R && r < nr; r++)
        for (int c = 0; c < C && c < nc; c++) out[r * ldo + c] = hsum256(acc[r][c]) + msum[r][c];
}

#define Q4_ARGS(c0, r0) w + (c0) * wrb, wrb, nc - (c0), xq + (r0) * xrb, xrb, rows, nb, out + (r0) * ldo + (c0), ldo

/* Activation rows in near-equal groups of at most MR (7 rows: 4 + 3, not 4 + 4 with one wasted),
 * each group over every MC weight rows in turn: the group's activations stay in L1, the weights
 * come from L2 (the driver passes a panel of them). */
#define TILE_LOOP(MICRO, ...)                                                                               \
    do {                                                                                                   \
        if (nr == 1) {                                                                                     \
            const int64_t rows = 1;                                                                        \
            for (int64_t c0 = 0; c0 < nc; c0 += MC1) MICRO(Q4_ARGS(c0, 0), __VA_ARGS__ 1, MC1);            \
            break;                                                                                         \
        }                                                                                                  \
        const int64_t groups = (nr + MR - 1) / MR;                                                         \
        for (int64_t g = 0; g < groups; g++) {                                                             \
            const int64_t r0 = nr * g / groups, rows = nr * (g + 1) / groups - r0;                         \
            for (int64_t c0 = 0; c0 < nc; c0 += MC) {                                                      \
                switch (rows) {                                                                            \
                case 1: MICRO(Q4_ARGS(c0, r0), __VA_ARGS__ 1 < MR ? 1 : MR, MC); break;                                  \
                case 2: MICRO(Q4_ARGS(c0, r0), __VA_ARGS__ 2 < MR ? 2 : MR, MC); break;                                  \
                case 3: MICRO(Q4_ARGS(c0, r0), __VA_ARGS__ 3 < MR ? 3 : MR, MC); break;                                  \
                case 4: MICRO(Q4_ARGS(c0, r0), __VA_ARGS__ 4 < MR ? 4 : MR, MC); break;                                  \
                case 5: MICRO(Q4_ARGS(c0, r0), __VA_ARGS__ 5 < MR ? 5 : MR, MC); break;                                  \
                default: MICRO(Q4_ARGS(c0, r0), __VA_ARGS__ MR, MC);                                       \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
    } while (0)

static void tile_q4_0(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                      int64_t nb, float *out, int64_t ldo) {
    TILE_LOOP(legacy_micro, QTYPE_Q4_0, );
}

static void tile_q4_1(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                      int64_t nb, float *out, int64_t ldo) {
    TILE_LOOP(legacy_micro, QTYPE_Q4_1, );
}

static void tile_q8_0(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                      int64_t nb, float *out, int64_t ldo) {
    TILE_LOOP(legacy_micro, QTYPE_Q8_0, );
}

#else /* portable: plain C, one weight block unpacked to int8 and met by each activation row */

static inline void tile_generic(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb,
                                int64_t nr, int64_t nb, float *out, int64_t ldo, int type) {
    const int bb = type == QTYPE_Q8_0 ? 34 : type == QTYPE_Q4_1 ? 20 : 18;
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *wr = w + c * wrb;
        for (int64_t r = 0; r < nr; r++) out[r * ldo + c] = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = wr + b * bb;
            int8_t q[QB];
            float dw = half_to_f32(blk), m = 0.0f;
            if (type == QTYPE_Q8_0) {
                memcpy(q, blk + 2, QB);
            } else {
                const uint8_t *nib = blk + (type == QTYPE_Q4_1 ? 4 : 2);
                for (int j = 0; j < 16; j++) q[j] = (int8_t)(nib[j] & 0x0f), q[16 + j] = (int8_t)(nib[j] >> 4);
                m = type == QTYPE_Q4_1 ? half_to_f32(blk + 2) : -8.0f * dw;
            }
            for (int64_t r = 0; r < nr; r++) {
                const uint8_t *xr = xq + r * xrb;
                const int8_t *qx = act_q(xr) + b * QB;
                int dot = 0;
                for (int j = 0; j < QB; j++) dot += q[j] * qx[j];
                out[r * ldo + c] += dw * act_d(xr, nb)[b] * (float)dot + m * act_s(xr, nb)[b];
            }
        }
    }
}

static void tile_q4_0(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                      int64_t nb, float *out, int64_t ldo) {
    tile_generic(w, wrb, nc, xq, xrb, nr, nb, out, ldo, QTYPE_Q4_0);
}

static void tile_q4_1(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                      int64_t nb, float *out, int64_t ldo) {
    tile_generic(w, wrb, nc, xq, xrb, nr, nb, out, ldo, QTYPE_Q4_1);
}

static void tile_q8_0(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb, int64_t nr,
                      int64_t nb, float *out, int64_t ldo) {
    tile_generic(w, wrb, nc, xq, xrb, nr, nb, out, ldo, QTYPE_Q8_0);
}
#endif

static const qtype_ops OPS_Q4_0 = {QTYPE_Q4_0, QB, 18, ACT_BYTES, quantize_act, tile_q4_0, dequant_q4_0};
static const qtype_ops OPS_Q4_1 = {QTYPE_Q4_1, QB, 20, ACT_BYTES, quantize_act, tile_q4_1, dequant_q4_1};
static const qtype_ops OPS_Q8_0 = {QTYPE_Q8_0, QB, 34, ACT_BYTES, quantize_act, tile_q8_0, dequant_q8_0};

const qtype_ops *qtype_legacy(int type) {
    switch (type) {
    case QTYPE_Q4_0: return &OPS_Q4_0;
    case QTYPE_Q4_1: return &OPS_Q4_1;
    case QTYPE_Q8_0: return &OPS_Q8_0;
    default: return NULL;
    }
}
