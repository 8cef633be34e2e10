/* K-quant blocks (Q4_K, Q5_K, Q6_K: 256 weights a block) against 16-bit activations (quant.h's
 * act_block16: per 32 values one float scale d_x, int16 q, and s_x = d_x * sum(q)).
 *
 * Weight blocks, as ggml writes them (and gguf-py's dequantize reads them):
 *   Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for the 8 sub-blocks of
 *     32, 128 bytes of nibbles: byte i of 32-byte group g holds weight 64g + i (low nibble) and
 *     64g + 32 + i (high). Weight = d * sc[s] * q - dmin * m[s].
 *   Q5_K (176 bytes): as Q4_K with 32 bytes of fifth bits before the nibbles: bit s of byte i is
 *     the fifth bit of weight 32s + i.
 *   Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16
 *     weights), fp16 d. In each half h of 128 weights, weight 128h + 32s + i (s < 4, i < 32) has
 *     low nibble ql[64h + 32(s & 1) + i] >> 4(s >> 1) and high bits qh[32h + i] >> 2s.
 *     Weight = d * scale[w / 16] * (q - 32).
 *
 * A 256-weight block meets 8 consecutive activation blocks, sub-block j (32 weights) activation
 * block j. Its dot product, exact in integers up to the per-(sub-)block scaling:
 *   Q4_K, Q5_K: sum_j d_x[j] * d * sc[j] * I_j - dmin * m[j] * s_x[j],  I_j = sum_i q_i x_i (q >= 0)
 *   Q6_K:       sum_l d_x[l / 2] * d * scale[l] * I_l,  I_l = sum of 16 (q_i - 32) x_i
 * (Q6_K's offset is folded into the widened weights, so it needs no activation sums).
 *
 * No int32 sum overflows, for any weights and any activations (|x_i| <= 32767, quant.c): the widened
 * weights are Q4_K q <= 15, Q5_K q <= 31, Q6_K |q - 32| <= 32, never scaled in integers. Every int32
 * lane holds products of one sub-block (Q6_K: one 16-half) only: I_j sums 32 products, at most
 * 32 * 31 * 32767 = 32.5e6 (Q5_K; Q4_K 15.7e6), and I_l 16, at most 16 * 32 * 32767 = 16.8e6; every
 * partial sum (a madd pair, a lane, a hadd) is a subset of those terms, so it is smaller still, far
 * below 2^31 = 2147e6. Q4_K's and Q6_K's I are below 2^24 and convert to float exactly; Q5_K's may
 * round once.
 *
 * The tile (AVX2): weights are widened to int16 in registers straight from the block (vpmovzxbw
 * of 16 bytes, then masks and shifts: no scratch), each widened vector multiplied with the same 16
 * activation values of up to 4 rows (_mm256_madd_epi16: 16 products, pairs summed into int32),
 * so the widening is paid once per 4 activation rows. Per row the 8 sub-blocks' int32 vectors are
 * folded by hadds into one vector whose lane j is I_j (Q6_K: two, lanes l), converted once, and
 * scaled by one vector product (d * sc[j]) * d_x[j]; the mins by dmin * m[j] * s_x[j], also a
 * vector. The activation rows' d_x and s_x are gathered per row group and chunk of blocks into a
 * small array first (act_block16 holds them 72 bytes apart). */
#include "quant.h"
#include "rivulet_kernels.h"

#define QK 256
#define Q4K_BYTES 144
#define Q5K_BYTES 176
#define Q6K_BYTES 210
#define ACT_PER_BLOCK (QK / ACT_BLOCK) /* 8 act_block16 per weight block */


static inline uint16_t read_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* Q4_K / Q5_K's 12 bytes -> 8 scales and 8 mins of 6 bits. */
static inline void scale_min_k4(const uint8_t *s, uint8_t sc[8], uint8_t m[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
        m[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/* Q4_K / Q5_K's 12 bytes of scales -> the 8 scales (low word: sc 0-3, high: 4-7) and the 8 mins,
 * one byte each, as scale_min_k4 but on 32-bit words. */
static inline void scales_k4_words(const uint8_t *s, uint64_t *sc, uint64_t *m) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    const uint32_t sc_lo = a & 0x3f3f3f3fu, m_lo = b & 0x3f3f3f3fu;
    const uint32_t sc_hi = (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u);
    const uint32_t m_hi = ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u);
    *sc = ((uint64_t)sc_hi << 32) | sc_lo;
    *m = ((uint64_t)m_hi << 32) | m_lo;
}

#if HAVE_AVX2 || HAVE_AVX512
#define RG 4           /* activation rows per register tile */
#define AX_BLOCKS 32   /* blocks whose d_x / s_x one row group gathers (x rows of up to ~18 KB stay in L1) */

static inline __m256i widen16(const uint8_t *p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)); }

/* The two int16 vectors (weights 16h..16h+15, h = 0, 1) of sub-block j of one block. */
static inline __attribute__((always_inline)) void widen_sub(int type, const uint8_t *blk, int j, __m256i wv[2]) {
    const __m256i low = _mm256_set1_epi16(15);
    for (int h = 0; h < 2; h++) {
        if (type == QTYPE_Q6_K) {
            const int half = j / 4, s = j % 4;
            const __m256i ql = widen16(blk + 64 * half + 32 * (s & 1) + 16 * h);
            const __m256i qh = widen16(blk + 128 + 32 * half + 16 * h);
            const __m256i lo = (s >> 1) ? _mm256_srli_epi16(ql, 4) : _mm256_and_si256(ql, low);
            __m256i hi; /* bits 2s, 2s + 1 of qh -> bits 4, 5 */
            switch (s) {
            case 0: hi = _mm256_slli_epi16(qh, 4); break;
            case 1: hi = _mm256_slli_epi16(qh, 2); break;
            case 2: hi = qh; break;
            default: hi = _mm256_srli_epi16(qh, 2); break;
            }
            hi = _mm256_and_si256(hi, _mm256_set1_epi16(0x30));
            wv[h] = _mm256_sub_epi16(_mm256_or_si256(lo, hi), _mm256_set1_epi16(32));
        } else {
            const int off = type == QTYPE_Q5_K ? 48 : 16;
            const __m256i b = widen16(blk + off + 32 * (j / 2) + 16 * h);
            __m256i v = (j & 1) ? _mm256_srli_epi16(b, 4) : _mm256_and_si256(b, low);
            if (type == QTYPE_Q5_K) { /* bit j of qh -> bit 4 */
                const __m256i qh = widen16(blk + 16 + 16 * h);
                const __m256i t = j < 4 ? _mm256_slli_epi16(qh, 4 - j) : j == 4 ? qh : _mm256_srli_epi16(qh, j - 4);
                v = _mm256_or_si256(v, _mm256_and_si256(t, _mm256_set1_epi16(16)));
            }
            wv[h] = v;
        }
    }
}

/* ---- dequantize one row (the embedding lookup, the dense path's panels, the tests' reference):
 * gguf's float32 values bit for bit. Q4_K / Q5_K: d * sc and dmin * m are exact in float32 (fp16's
 * 11 bits x 6), and so is d * sc * q (x 5 bits), so the one rounding is the subtraction's, fused or
 * not, as numpy's. Q6_K: (d * scale) exact (11 x 8 bits), times q - 32 rounded once, as numpy's. */

/* Weights 16h..16h+15 of sub-block j, widened by widen_sub, as two float32 vectors. */
static inline void int16_to_f32(__m256i v, __m256 *lo, __m256 *hi) {
    *lo = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(v)));
    *hi = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(v, 1)));
}

static inline __attribute__((always_inline)) void dequant_k(int type, int block_bytes, const uint8_t *w, int64_t k,
                                                            float *out) {
    for (int64_t b = 0; b < k / QK; b++, w += block_bytes, out += QK) {
        uint8_t sc[8], m[8];
        float d, dmin = 0.0f;
        if (type == QTYPE_Q6_K) {
            d = fp16_to_f32(read_u16(w + 208));
        } else {
            d = fp16_to_f32(read_u16(w));
            dmin = fp16_to_f32(read_u16(w + 2));
            scale_min_k4(w + 4, sc, m);
        }
        for (int j = 0; j < 8; j++) {
            __m256i wv[2];
            widen_sub(type, w, j, wv);
            for (int h = 0; h < 2; h++) {
                __m256 lo, hi;
                int16_to_f32(wv[h], &lo, &hi);
                float *dst = out + 32 * j + 16 * h;
                if (type == QTYPE_Q6_K) {
                    const __m256 scale = _mm256_set1_ps(d * (float)((const int8_t *)(w + 192))[2 * j + h]);
                    _mm256_storeu_ps(dst, _mm256_mul_ps(scale, lo));
                    _mm256_storeu_ps(dst + 8, _mm256_mul_ps(scale, hi));
                } else {
                    const __m256 ds = _mm256_set1_ps(d * (float)sc[j]), dm = _mm256_set1_ps(dmin * (float)m[j]);
                    _mm256_storeu_ps(dst, _mm256_fmsub_ps(ds, lo, dm));
                    _mm256_storeu_ps(dst + 8, _mm256_fmsub_ps(ds, hi, dm));
                }
            }
        }
    }
}

static void dequant_q4_k(const uint8_t *w, int64_t k, float *out) { dequant_k(QTYPE_Q4_K, Q4K_BYTES, w, k, out); }
static void dequant_q5_k(const uint8_t *w, int64_t k, float *out) { dequant_k(QTYPE_Q5_K, Q5K_BYTES, w, k, out); }
static void dequant_q6_k(const uint8_t *w, int64_t k, float *out) { dequant_k(QTYPE_Q6_K, Q6K_BYTES, w, k, out); }

/* (A's 128-bit lanes: [a0 a1 a2 a3 | a0' a1' a2' a3'], B's likewise) -> [a0+a0' .. a3+a3', b0+b0' .. b3+b3'] */
static inline __m256i fold_lanes(__m256i a, __m256i b) {
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* out[r * ldo] += dot(weight row wb (nb blocks), activation rows xr[r] (nb * 8 act_block16)), r < R.
 * ax[r][b]: 16 floats per block: Q4_K/Q5_K d_x[0..7], s_x[0..7]; Q6_K d_x[l / 2] for l < 16. */
static inline __attribute__((always_inline)) void micro(int type, int R, int block_bytes, const uint8_t *wb,
                                                        const act_block16 *const xr[RG],
                                                        const float (*ax)[AX_BLOCKS][16], int nb, float *out,
                                                        int64_t ldo) {
    __m256 acc[RG];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = wb + (int64_t)b * block_bytes;
        __m256i part[RG][4]; /* per pair g of sub-blocks (2g, 2g + 1): after one hadd */
        for (int g = 0; g < 4; g++) {
            __m256i wa[2], wc[2];
            widen_sub(type, blk, 2 * g, wa);
            widen_sub(type, blk, 2 * g + 1, wc);
            for (int r = 0; r < R; r++) {
                const act_block16 *xa = xr[r] + ACT_PER_BLOCK * b + 2 * g, *xc = xa + 1;
                const __m256i pa0 = _mm256_madd_epi16(wa[0], _mm256_loadu_si256((const __m256i *)xa->q));
                const __m256i pa1 = _mm256_madd_epi16(wa[1], _mm256_loadu_si256((const __m256i *)(xa->q + 16)));
                const __m256i pc0 = _mm256_madd_epi16(wc[0], _mm256_loadu_si256((const __m256i *)xc->q));
                const __m256i pc1 = _mm256_madd_epi16(wc[1], _mm256_loadu_si256((const __m256i *)(xc->q + 16)));
                if (type == QTYPE_Q6_K) /* lanes per 128: [a lo, a hi, c lo, c hi] (lo/hi: the 16-halves) */
                    part[r][g] = _mm256_hadd_epi32(_mm256_hadd_epi32(pa0, pa1), _mm256_hadd_epi32(pc0, pc1));
                else /* lanes per 128: [a, a, c, c] */
                    part[r][g] = _mm256_hadd_epi32(_mm256_add_epi32(pa0, pa1), _mm256_add_epi32(pc0, pc1));
            }
        }
        if (type == QTYPE_Q6_K) {
            const float d = fp16_to_f32(read_u16(blk + 208));
            const __m128i s8 = _mm_loadu_si128((const __m128i *)(blk + 192));
            const __m256 dsc0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)), _mm256_set1_ps(d));
            const __m256 dsc1 =
                _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8))), _mm256_set1_ps(d));
            for (int r = 0; r < R; r++) {
                /* lanes l = 0..7 (sub-blocks 0-3's halves), then 8..15 */
                const __m256i v0 = fold_lanes(part[r][0], part[r][1]), v1 = fold_lanes(part[r][2], part[r][3]);
                const float *a = ax[r][b];
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v0), _mm256_mul_ps(dsc0, _mm256_load_ps(a)), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v1), _mm256_mul_ps(dsc1, _mm256_load_ps(a + 8)), acc[r]);
            }
        } else {
            const float d = fp16_to_f32(read_u16(blk)), dmin = fp16_to_f32(read_u16(blk + 2));
            uint64_t sc, m;
            scales_k4_words(blk + 4, &sc, &m);
            const __m256 dsc =
                _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)sc))), _mm256_set1_ps(d));
            const __m256 dm =
                _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)m))), _mm256_set1_ps(dmin));
            for (int r = 0; r < R; r++) {
                /* hadd(part 0, part 1): per 128 lane [I0, I1, I2, I3] partials; lanes folded: I0..I7 */
                const __m256i s = fold_lanes(_mm256_hadd_epi32(part[r][0], part[r][1]),
                                             _mm256_hadd_epi32(part[r][2], part[r][3]));
                const float *a = ax[r][b];
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dsc, _mm256_load_ps(a)), acc[r]);
                acc[r] = _mm256_fnmadd_ps(dm, _mm256_load_ps(a + 8), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r * ldo] += hsum8(acc[r]);
}

static inline __attribute__((always_inline)) void tile_k(int type, int block_bytes, const uint8_t *w,
                                                         int64_t w_row_bytes, int64_t nc, const uint8_t *xq,
                                                         int64_t xq_row_bytes, int64_t nr, int64_t nblocks,
                                                         float *out, int64_t ldo) {
    float ax[RG][AX_BLOCKS][16] __attribute__((aligned(32)));
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < nc; c++) out[r * ldo + c] = 0.0f;
    for (int64_t r0 = 0; r0 < nr; r0 += RG) {
        const int R = (int)(nr - r0 < RG ? nr - r0 : RG);
        const int kc = AX_BLOCKS / R > AX_BLOCKS / 4 ? AX_BLOCKS / R : AX_BLOCKS / 4; /* ~18 KB of x */
        const act_block16 *xr[RG];
        for (int64_t b0 = 0; b0 < nblocks; b0 += kc) {
            const int nb = (int)(nblocks - b0 < kc ? nblocks - b0 : kc);
            for (int r = 0; r < R; r++) {
                xr[r] = (const act_block16 *)(xq + (r0 + r) * xq_row_bytes) + ACT_PER_BLOCK * b0;
                for (int b = 0; b < nb; b++)
                    for (int j = 0; j < ACT_PER_BLOCK; j++) {
                        const act_block16 *a = xr[r] + ACT_PER_BLOCK * b + j;
                        if (type == QTYPE_Q6_K) {
                            ax[r][b][2 * j] = ax[r][b][2 * j + 1] = a->d;
                        } else {
                            ax[r][b][j] = a->d;
                            ax[r][b][8 + j] = a->s;
                        }
                    }
            }
            for (int64_t c = 0; c < nc; c++) {
                const uint8_t *wb = w + c * w_row_bytes + b0 * block_bytes;
                float *o = out + r0 * ldo + c;
                switch (R) {
                case 1: micro(type, 1, block_bytes, wb, xr, ax, nb, o, ldo); break;
                case 2: micro(type, 2, block_bytes, wb, xr, ax, nb, o, ldo); break;
                case 3: micro(type, 3, block_bytes, wb, xr, ax, nb, o, ldo); break;
                default: micro(type, 4, block_bytes, wb, xr, ax, nb, o, ldo); break;
                }
            }
        }
    }
}
#else /* portable */

/* ---- dequantize one row, in plain C: gguf's float32 values bit
 * for bit. Every product is exact in float32 (fp16 d: 11 bits, x 6-bit scale, x <= 6-bit quant),
 * so fused or not, the one rounding is the subtraction's, as numpy's. */

static void dequant_q4_k(const uint8_t *w, int64_t k, float *out) {
    for (int64_t b = 0; b < k / QK; b++, w += Q4K_BYTES, out += QK) {
        const float d = fp16_to_f32(read_u16(w)), dmin = fp16_to_f32(read_u16(w + 2));
        uint8_t sc[8], m[8];
        scale_min_k4(w + 4, sc, m);
        const uint8_t *qs = w + 16;
        for (int s = 0; s < 8; s++) {
            const float ds = d * (float)sc[s], dm = dmin * (float)m[s];
            const uint8_t *src = qs + 32 * (s / 2);
            const int shift = 4 * (s & 1);
            for (int i = 0; i < 32; i++) out[32 * s + i] = ds * (float)((src[i] >> shift) & 15) - dm;
        }
    }
}

static void dequant_q5_k(const uint8_t *w, int64_t k, float *out) {
    for (int64_t b = 0; b < k / QK; b++, w += Q5K_BYTES, out += QK) {
        const float d = fp16_to_f32(read_u16(w)), dmin = fp16_to_f32(read_u16(w + 2));
        uint8_t sc[8], m[8];
        scale_min_k4(w + 4, sc, m);
        const uint8_t *qh = w + 16, *qs = w + 48;
        for (int s = 0; s < 8; s++) {
            const float ds = d * (float)sc[s], dm = dmin * (float)m[s];
            const uint8_t *src = qs + 32 * (s / 2);
            const int shift = 4 * (s & 1);
            for (int i = 0; i < 32; i++) {
                const int q = ((src[i] >> shift) & 15) | (((qh[i] >> s) & 1) << 4);
                out[32 * s + i] = ds * (float)q - dm;
            }
        }
    }
}

static void dequant_q6_k(const uint8_t *w, int64_t k, float *out) {
    for (int64_t b = 0; b < k / QK; b++, w += Q6K_BYTES, out += QK) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *scales = (const int8_t *)(w + 192);
        const float d = fp16_to_f32(read_u16(w + 208));
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int i = 0; i < 32; i++) {
                    const int lo = (ql[64 * h + 32 * (s & 1) + i] >> (4 * (s >> 1))) & 15;
                    const int hi = (qh[32 * h + i] >> (2 * s)) & 3;
                    const int idx = 128 * h + 32 * s + i;
                    out[idx] = (d * (float)scales[idx / 16]) * (float)((lo | (hi << 4)) - 32);
                }
    }
}


/* Portable: per block, the weights as ints (Q6_K: q - 32) and a scale per 16, then per 16 values an
 * int dot product, scaled as the AVX2 tile does. */
static void tile_k(int type, int block_bytes, const uint8_t *w, int64_t w_row_bytes, int64_t nc, const uint8_t *xq,
                   int64_t xq_row_bytes, int64_t nr, int64_t nblocks, float *out, int64_t ldo) {
    for (int64_t c = 0; c < nc; c++)
        for (int64_t r = 0; r < nr; r++) {
            const act_block16 *x = (const act_block16 *)(xq + r * xq_row_bytes);
            float acc = 0.0f;
            for (int64_t b = 0; b < nblocks; b++, x += ACT_PER_BLOCK) {
                const uint8_t *blk = w + c * w_row_bytes + b * block_bytes;
                int q[QK];
                float dsc[16], dm[8] = {0};
                if (type == QTYPE_Q6_K) {
                    const float d = fp16_to_f32(read_u16(blk + 208));
                    for (int h = 0; h < 2; h++)
                        for (int s = 0; s < 4; s++)
                            for (int i = 0; i < 32; i++)
                                q[128 * h + 32 * s + i] = (((blk[64 * h + 32 * (s & 1) + i] >> (4 * (s >> 1))) & 15) |
                                                           (((blk[128 + 32 * h + i] >> (2 * s)) & 3) << 4)) - 32;
                    for (int l = 0; l < 16; l++) dsc[l] = d * (float)(int8_t)blk[192 + l];
                } else {
                    const float d = fp16_to_f32(read_u16(blk)), dmin = fp16_to_f32(read_u16(blk + 2));
                    uint8_t sc[8], m[8];
                    scale_min_k4(blk + 4, sc, m);
                    const uint8_t *qs = blk + (type == QTYPE_Q5_K ? 48 : 16);
                    for (int s = 0; s < 8; s++) {
                        dsc[2 * s] = dsc[2 * s + 1] = d * (float)sc[s];
                        dm[s] = dmin * (float)m[s];
                        for (int i = 0; i < 32; i++) {
                            int v = (qs[32 * (s / 2) + i] >> (4 * (s & 1))) & 15;
                            if (type == QTYPE_Q5_K) v |= ((blk[16 + i] >> s) & 1) << 4;
                            q[32 * s + i] = v;
                        }
                    }
                }
                for (int j = 0; j < ACT_PER_BLOCK; j++) {
                    for (int h = 0; h < 2; h++) {
                        int32_t dot = 0;
                        for (int i = 0; i < 16; i++) dot += q[32 * j + 16 * h + i] * x[j].q[16 * h + i];
                        acc += (float)dot * (dsc[2 * j + h] * x[j].d);
                    }
                    acc -= dm[j] * x[j].s;
                }
            }
            out[r * ldo + c] = acc;
        }
}
#endif

static void tile_q4_k(const uint8_t *w, int64_t w_row_bytes, int64_t nc, const uint8_t *xq, int64_t xq_row_bytes,
                      int64_t nr, int64_t nblocks, float *out, int64_t ldo) {
    tile_k(QTYPE_Q4_K, Q4K_BYTES, w, w_row_bytes, nc, xq, xq_row_bytes, nr, nblocks, out, ldo);
}

static void tile_q5_k(const uint8_t *w, int64_t w_row_bytes, int64_t nc, const uint8_t *xq, int64_t xq_row_bytes,
                      int64_t nr, int64_t nblocks, float *out, int64_t ldo) {
    tile_k(QTYPE_Q5_K, Q5K_BYTES, w, w_row_bytes, nc, xq, xq_row_bytes, nr, nblocks, out, ldo);
}

static void tile_q6_k(const uint8_t *w, int64_t w_row_bytes, int64_t nc, const uint8_t *xq, int64_t xq_row_bytes,
                      int64_t nr, int64_t nblocks, float *out, int64_t ldo) {
    tile_k(QTYPE_Q6_K, Q6K_BYTES, w, w_row_bytes, nc, xq, xq_row_bytes, nr, nblocks, out, ldo);
}

#define ACT_BYTES (ACT_PER_BLOCK * (int)sizeof(act_block16)) /* per 256 weights: 8 x 72 = 576 */
static const qtype_ops OPS_Q4_K = {QTYPE_Q4_K, QK, Q4K_BYTES, ACT_BYTES, quantize_act16, tile_q4_k, dequant_q4_k, NULL, NULL};
static const qtype_ops OPS_Q5_K = {QTYPE_Q5_K, QK, Q5K_BYTES, ACT_BYTES, quantize_act16, tile_q5_k, dequant_q5_k, NULL, NULL};
static const qtype_ops OPS_Q6_K = {QTYPE_Q6_K, QK, Q6K_BYTES, ACT_BYTES, quantize_act16, tile_q6_k, dequant_q6_k, NULL, NULL};

const qtype_ops *qtype_k(int type) {
    switch (type) {
    case QTYPE_Q4_K: return &OPS_Q4_K;
    case QTYPE_Q5_K: return &OPS_Q5_K;
    case QTYPE_Q6_K: return &OPS_Q6_K;
    default: return NULL;
    }
}
