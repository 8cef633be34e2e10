/* K-quant blocks (Q4_K, Q5_K, Q6_K: 256 weights a block) against int8 activations.
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
 * Activations (all three types alike, act_k below): per 256 values one float scale d = amax / 127,
 * the values rounded to int8 (x * (127 / amax), to nearest even), and the sums of each 16 of them.
 * A block's dot product is then, exactly in integers up to the last scaling,
 *   d_x * (d * sum_s sc[s] sum_i q_i x_i - dmin * sum_s m[s] (sums of s's x)),
 * and Q6_K's offset 32 is its "min": dmin = 32 d and m = its scales per 16.
 *
 * The tile first unpacks a panel of 4 weight rows x up to 8 blocks into an L1 scratch (unp below:
 * one unsigned byte per weight, the sub-block scales as the int16 vectors _mm256_madd_epi16 wants,
 * the mins as one int16 per 16 values), then runs every activation row of the call over it (4 rows
 * x 2 weight rows of int32 accumulators in registers): the unpacking is paid once per panel and
 * all the call's rows (the driver sends up to 32), and the inner loop is the same for
 * all three types: vpmaddubsw (unsigned weights x signed activations, pairs summed to int16: at
 * most 2 * 63 * 127, no saturation), vpmaddwd with the scales (to int32), vpaddd. */
#include "quant.h"

#define QK 256
#define Q4K_BYTES 144
#define Q5K_BYTES 176
#define Q6K_BYTES 210
#define PANEL 4   /* weight rows unpacked together */
#define KCHUNK 8  /* blocks of each unpacked at a time: 4 x 8 x 576 bytes = 18 KB of scratch */
#define RCHUNK 64 /* activation rows run over one unpacked panel */

/* One activation block: 320 bytes, so that a 64-byte aligned row keeps every qs aligned. */
typedef struct {
    int8_t qs[QK];
    int16_t bsums[QK / 16];
    float d;
    uint8_t pad[320 - QK - QK / 8 - 4];
} act_k;

/* One unpacked weight block. sv[j]: the int16 factor of each of the 16 pair sums of the j-th 32
 * weights; mv[l]: the "min" of values 16l..16l+15, against the activation's bsums. */
typedef struct {
    uint8_t q[QK];
    int16_t sv[8][16];
    int16_t mv[16];
    float d, dmin;
} __attribute__((aligned(32))) unp;

static inline float fp16_to_f32(uint16_t h) {
#if HAVE_AVX2 || HAVE_AVX512
    return _cvtsh_ss(h); /* F16C (x86-64-v3): exact, subnormals included */
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13); /* inf, NaN */
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else { /* zero or subnormal: man * 2^-24, exact in float */
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

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

/* ---- dequantize one row (the embedding lookup, the tests' reference): gguf's float32 values bit
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

/* ---- unpacking into unp: scales and mins (shared by both builds), then the quants */

#if HAVE_AVX2 || HAVE_AVX512
/* shuffle_epi8 controls: lane-wise, int16 element e (of 8 in each 128-bit lane) in all 8 slots */
static inline __m256i bcast16_ctrl(int lo, int hi) {
    return _mm256_setr_epi8(2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1,
                            2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1,
                            2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1,
                            2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1);
}
#endif

static inline void unpack_scales_k4(const uint8_t *w, unp *u) {
    u->d = fp16_to_f32(read_u16(w));
    u->dmin = fp16_to_f32(read_u16(w + 2));
#if HAVE_AVX2 || HAVE_AVX512
    /* scale_min_k4 on 32-bit words: bytes 0-3 (a), 4-7 (b), 8-11 (c) */
    uint32_t a, b, c;
    memcpy(&a, w + 4, 4);
    memcpy(&b, w + 8, 4);
    memcpy(&c, w + 12, 4);
    const uint32_t sc_lo = a & 0x3f3f3f3fu, m_lo = b & 0x3f3f3f3fu;
    const uint32_t sc_hi = (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u);
    const uint32_t m_hi = ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u);
    const __m128i sc16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)(((uint64_t)sc_hi << 32) | sc_lo)));
    const __m128i m16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)(((uint64_t)m_hi << 32) | m_lo)));
    const __m256i sc2 = _mm256_broadcastsi128_si256(sc16);
    for (int s = 0; s < 8; s++) _mm256_store_si256((__m256i *)u->sv[s], _mm256_shuffle_epi8(sc2, bcast16_ctrl(s, s)));
    /* mins 0..7 -> int16 m0 m0 m1 m1 ... */
    _mm256_store_si256((__m256i *)u->mv, _mm256_set_m128i(_mm_unpackhi_epi16(m16, m16), _mm_unpacklo_epi16(m16, m16)));
#else
    uint8_t sc[8], m[8];
    scale_min_k4(w + 4, sc, m);
    for (int s = 0; s < 8; s++) {
        for (int l = 0; l < 16; l++) u->sv[s][l] = sc[s];
        u->mv[2 * s] = u->mv[2 * s + 1] = m[s];
    }
#endif
}

static inline void unpack_scales_q6(const uint8_t *w, unp *u) {
    const int8_t *scales = (const int8_t *)(w + 192);
    u->d = fp16_to_f32(read_u16(w + 208));
    u->dmin = 32.0f * u->d;
#if HAVE_AVX2 || HAVE_AVX512
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scales));
    _mm256_store_si256((__m256i *)u->mv, s16);
    const __m256i lo2 = _mm256_permute2x128_si256(s16, s16, 0x00), hi2 = _mm256_permute2x128_si256(s16, s16, 0x11);
    for (int j = 0; j < 4; j++) {
        _mm256_store_si256((__m256i *)u->sv[j], _mm256_shuffle_epi8(lo2, bcast16_ctrl(2 * j, 2 * j + 1)));
        _mm256_store_si256((__m256i *)u->sv[j + 4], _mm256_shuffle_epi8(hi2, bcast16_ctrl(2 * j, 2 * j + 1)));
    }
#else
    for (int j = 0; j < 8; j++)
        for (int l = 0; l < 16; l++) u->sv[j][l] = scales[2 * j + l / 8];
    for (int l = 0; l < 16; l++) u->mv[l] = scales[l];
#endif
}

#if HAVE_AVX2 || HAVE_AVX512
static void unpack_q4_k(const uint8_t *w, unp *u) {
    unpack_scales_k4(w, u);
    const __m256i low = _mm256_set1_epi8(15);
    for (int g = 0; g < 4; g++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * g));
        _mm256_store_si256((__m256i *)(u->q + 64 * g), _mm256_and_si256(v, low));
        _mm256_store_si256((__m256i *)(u->q + 64 * g + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
    }
}

static void unpack_q5_k(const uint8_t *w, unp *u) {
    unpack_scales_k4(w, u);
    const __m256i low = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 16));
    for (int g = 0; g < 4; g++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 48 + 32 * g));
        /* bit 2g (2g + 1) of qh -> bit 4: shifts left by 4 - 2g, or right past bit 4 */
        __m256i h0, h1;
        switch (g) {
        case 0: h0 = _mm256_slli_epi16(qh, 4); h1 = _mm256_slli_epi16(qh, 3); break;
        case 1: h0 = _mm256_slli_epi16(qh, 2); h1 = _mm256_slli_epi16(qh, 1); break;
        case 2: h0 = qh; h1 = _mm256_srli_epi16(qh, 1); break;
        default: h0 = _mm256_srli_epi16(qh, 2); h1 = _mm256_srli_epi16(qh, 3); break;
        }
        _mm256_store_si256((__m256i *)(u->q + 64 * g),
                           _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(h0, bit4)));
        _mm256_store_si256((__m256i *)(u->q + 64 * g + 32),
                           _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), _mm256_and_si256(h1, bit4)));
    }
}

static void unpack_q6_k(const uint8_t *w, unp *u) {
    unpack_scales_q6(w, u);
    const __m256i low = _mm256_set1_epi8(15), two = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(w + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32));
        const __m256i hq = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
        uint8_t *q = u->q + 128 * h;
        _mm256_store_si256((__m256i *)q, _mm256_or_si256(_mm256_and_si256(l0, low),
                                                         _mm256_and_si256(_mm256_slli_epi16(hq, 4), two)));
        _mm256_store_si256((__m256i *)(q + 32), _mm256_or_si256(_mm256_and_si256(l1, low),
                                                                _mm256_and_si256(_mm256_slli_epi16(hq, 2), two)));
        _mm256_store_si256((__m256i *)(q + 64), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                                                                _mm256_and_si256(hq, two)));
        _mm256_store_si256((__m256i *)(q + 96), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                                                                _mm256_and_si256(_mm256_srli_epi16(hq, 2), two)));
    }
}
#else
static void unpack_q4_k(const uint8_t *w, unp *u) {
    unpack_scales_k4(w, u);
    for (int s = 0; s < 8; s++)
        for (int i = 0; i < 32; i++) u->q[32 * s + i] = (w[16 + 32 * (s / 2) + i] >> (4 * (s & 1))) & 15;
}

static void unpack_q5_k(const uint8_t *w, unp *u) {
    unpack_scales_k4(w, u);
    for (int s = 0; s < 8; s++)
        for (int i = 0; i < 32; i++)
            u->q[32 * s + i] = (uint8_t)(((w[48 + 32 * (s / 2) + i] >> (4 * (s & 1))) & 15) | (((w[16 + i] >> s) & 1) << 4));
}

static void unpack_q6_k(const uint8_t *w, unp *u) {
    unpack_scales_q6(w, u);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int i = 0; i < 32; i++)
                u->q[128 * h + 32 * s + i] = (uint8_t)(((w[64 * h + 32 * (s & 1) + i] >> (4 * (s >> 1))) & 15) |
                                                       (((w[128 + 32 * h + i] >> (2 * s)) & 3) << 4));
}
#endif

/* ---- activations */

#if HAVE_AVX2 || HAVE_AVX512
static void quantize_act_k(const float *x, int64_t k, void *xq) {
    act_k *a = (act_k *)xq;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < k / QK; b++, x += QK, a++) {
        __m256 mx = _mm256_setzero_ps();
        for (int i = 0; i < QK; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        if (amax == 0.0f) {
            memset(a, 0, sizeof *a);
            continue;
        }
        a->d = amax / 127.0f;
        const __m256 iscale = _mm256_set1_ps(127.0f / amax);
        for (int i = 0; i < QK; i += 32) {
            __m256i v[4];
            for (int j = 0; j < 4; j++) /* to nearest, ties to even (MXCSR's default) */
                v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), iscale));
            /* packs work within 128-bit lanes: 0 1 | 2 3 -> (0lo 1lo 0hi 1hi), then bytes need a
             * dword permutation back to order */
            const __m256i p01 = _mm256_packs_epi32(v[0], v[1]), p23 = _mm256_packs_epi32(v[2], v[3]);
            const __m256i p = _mm256_packs_epi16(p01, p23);
            const __m256i ordered = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(a->qs + i), ordered);
            /* sums of each 16: sign-extend to int16 and madd with ones */
            const __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(ordered));
            const __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(ordered, 1));
            const __m256i ones = _mm256_set1_epi16(1);
            const __m256i s = _mm256_hadd_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
            /* s: lo's 4 pair-sums of lane 0, hi's of lane 0, lo's of lane 1, hi's of lane 1 */
            int32_t t[8];
            _mm256_storeu_si256((__m256i *)t, s);
            a->bsums[i / 16] = (int16_t)(t[0] + t[1] + t[4] + t[5]);
            a->bsums[i / 16 + 1] = (int16_t)(t[2] + t[3] + t[6] + t[7]);
        }
    }
}
#else
static void quantize_act_k(const float *x, int64_t k, void *xq) {
    act_k *a = (act_k *)xq;
    for (int64_t b = 0; b < k / QK; b++, x += QK, a++) {
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(x[i]));
        if (amax == 0.0f) {
            memset(a, 0, sizeof *a);
            continue;
        }
        a->d = amax / 127.0f;
        const float iscale = 127.0f / amax;
        for (int i = 0; i < QK; i++) a->qs[i] = (int8_t)nearbyintf(x[i] * iscale);
        for (int l = 0; l < QK / 16; l++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += a->qs[16 * l + i];
            a->bsums[l] = (int16_t)s;
        }
    }
}
#endif

/* ---- the tile */

typedef void (*unpack_fn)(const uint8_t *w, unp *u);

#if HAVE_AVX2 || HAVE_AVX512
/* The sum of v's 8 lanes (common.h's hsum8 is in the AVX2 build only). */
static inline float hsum8_k(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* out[r][c] += dot over nb unpacked blocks (u[c * KCHUNK + b]) of activation rows xr[r] (act_k
 * pointers at the chunk's first block), R x C accumulators in registers. */
static inline __attribute__((always_inline)) void micro(const unp *u, const act_k *const xr[4], int nb, float *out,
                                                        int64_t ldo, int R, int C, int cvalid) {
    __m256 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i isum[4][4];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) isum[r][c] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            __m256i wq[4], sv[4];
            for (int c = 0; c < C; c++) {
                wq[c] = _mm256_load_si256((const __m256i *)(u[c * KCHUNK + b].q + 32 * j));
                sv[c] = _mm256_load_si256((const __m256i *)u[c * KCHUNK + b].sv[j]);
            }
            for (int r = 0; r < R; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xr[r][b].qs + 32 * j));
                for (int c = 0; c < C; c++)
                    isum[r][c] = _mm256_add_epi32(isum[r][c], _mm256_madd_epi16(_mm256_maddubs_epi16(wq[c], xv), sv[c]));
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256i bs = _mm256_loadu_si256((const __m256i *)xr[r][b].bsums);
            const __m256 dx = _mm256_set1_ps(xr[r][b].d);
            for (int c = 0; c < C; c++) {
                const unp *ub = &u[c * KCHUNK + b];
                const __m256 m = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_load_si256((const __m256i *)ub->mv), bs));
                const __m256 f = _mm256_fmsub_ps(_mm256_cvtepi32_ps(isum[r][c]), _mm256_set1_ps(ub->d),
                                                 _mm256_mul_ps(m, _mm256_set1_ps(ub->dmin)));
                acc[r][c] = _mm256_fmadd_ps(f, dx, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C && c < cvalid; c++) out[r * ldo + c] += hsum8_k(acc[r][c]);
}
#else
static void micro(const unp *u, const act_k *const xr[4], int nb, float *out, int64_t ldo, int R, int C, int cvalid) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C && c < cvalid; c++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const unp *ub = &u[c * KCHUNK + b];
                const act_k *a = &xr[r][b];
                int32_t isum = 0, msum = 0;
                for (int j = 0; j < 8; j++) {
                    int32_t s = 0;
                    for (int i = 0; i < 32; i++) s += ub->sv[j][i / 2] * (ub->q[32 * j + i] * a->qs[32 * j + i]);
                    isum += s;
                }
                for (int l = 0; l < 16; l++) msum += ub->mv[l] * a->bsums[l];
                acc += ((float)isum * ub->d - (float)msum * ub->dmin) * a->d;
            }
            out[r * ldo + c] += acc;
        }
}
#endif

/* Activation rows [r0, r1) over an unpacked panel (weight rows c0 + [0, cvalid), blocks b0 + [0, nb)):
 * out += their dot products. Rows in fours against two weight rows at a time (4 x 2 int32
 * accumulators, 2 weight and 2 scale vectors, 1 activation vector: 13 of the 16 ymm registers),
 * the rest one at a time against all four. */
static void panel_rows(const unp *u, const uint8_t *xq, int64_t xq_row_bytes, int64_t r0, int64_t r1, int64_t b0,
                       int nb, float *out, int64_t ldo, int64_t c0, int cvalid) {
    const act_k *xr[4];
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        for (int i = 0; i < 4; i++) xr[i] = (const act_k *)(xq + (r + i) * xq_row_bytes) + b0;
        float *o = out + r * ldo + c0;
        micro(u, xr, nb, o, ldo, 4, 2, cvalid);
        if (cvalid > 2) micro(u + 2 * KCHUNK, xr, nb, o + 2, ldo, 4, 2, cvalid - 2);
    }
    for (; r < r1; r++) {
        xr[0] = (const act_k *)(xq + r * xq_row_bytes) + b0;
        micro(u, xr, nb, out + r * ldo + c0, ldo, 1, 4, cvalid);
    }
}

/* Weight rows c0 + [0, PANEL), blocks b0 + [0, nb) -> u; rows past cvalid repeat the last valid one
 * (their sums are not stored). ``ahead``: also prefetch the same blocks of the next panel, past the
 * tile's last row too: the driver's next tile call most likely starts there. */
static inline void unpack_panel(unpack_fn unpack, int block_bytes, const uint8_t *w, int64_t w_row_bytes,
                                int64_t c0, int cvalid, int64_t b0, int nb, int ahead, unp *u) {
    for (int c = 0; c < PANEL; c++) {
        const uint8_t *row = w + (c0 + (c < cvalid ? c : cvalid - 1)) * w_row_bytes + b0 * block_bytes;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (int64_t)b * block_bytes;
            if (ahead) /* a prefetch past the end of W is a no-op, never a fault */
                for (int off = 0; off < block_bytes; off += 64)
                    __builtin_prefetch(blk + PANEL * w_row_bytes + off, 0, 3);
            unpack(blk, &u[c * KCHUNK + b]);
        }
    }
}

#define X_RESIDENT_BYTES (128 * 1024) /* activation rows that stay in L2 while the weights stream by */

static void tile_k(unpack_fn unpack, int block_bytes, const uint8_t *w, int64_t w_row_bytes, int64_t nc,
                   const uint8_t *xq, int64_t xq_row_bytes, int64_t nr, int64_t nblocks, float *out, int64_t ldo) {
    unp u[PANEL * KCHUNK];
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < nc; c++) out[r * ldo + c] = 0.0f;
    if (nr <= RCHUNK && nr * xq_row_bytes <= X_RESIDENT_BYTES) {
        /* Few rows (decode): each panel's rows read front to back, the next panel prefetched. */
        for (int64_t c0 = 0; c0 < nc; c0 += PANEL) {
            const int cvalid = (int)(nc - c0 < PANEL ? nc - c0 : PANEL);
            for (int64_t b0 = 0; b0 < nblocks; b0 += KCHUNK) {
                const int nb = (int)(nblocks - b0 < KCHUNK ? nblocks - b0 : KCHUNK);
                unpack_panel(unpack, block_bytes, w, w_row_bytes, c0, cvalid, b0, nb, 1, u);
                panel_rows(u, xq, xq_row_bytes, 0, nr, b0, nb, out, ldo, c0, cvalid);
            }
        }
        return;
    }
    /* Many rows: a chunk of activation rows x blocks stays in L2 while every panel passes over it. */
    for (int64_t r0 = 0; r0 < nr; r0 += RCHUNK) {
        const int64_t r1 = nr - r0 < RCHUNK ? nr : r0 + RCHUNK;
        for (int64_t b0 = 0; b0 < nblocks; b0 += KCHUNK) {
            const int nb = (int)(nblocks - b0 < KCHUNK ? nblocks - b0 : KCHUNK);
            for (int64_t c0 = 0; c0 < nc; c0 += PANEL) {
                const int cvalid = (int)(nc - c0 < PANEL ? nc - c0 : PANEL);
                unpack_panel(unpack, block_bytes, w, w_row_bytes, c0, cvalid, b0, nb, 0, u);
                panel_rows(u, xq, xq_row_bytes, r0, r1, b0, nb, out, ldo, c0, cvalid);
            }
        }
    }
}

static void tile_q4_k(const uint8_t *w, int64_t w_row_bytes, int64_t nc, const uint8_t *xq, int64_t xq_row_bytes,
                      int64_t nr, int64_t nblocks, float *out, int64_t ldo) {
    tile_k(unpack_q4_k, Q4K_BYTES, w, w_row_bytes, nc, xq, xq_row_bytes, nr, nblocks, out, ldo);
}

static void tile_q5_k(const uint8_t *w, int64_t w_row_bytes, int64_t nc, const uint8_t *xq, int64_t xq_row_bytes,
                      int64_t nr, int64_t nblocks, float *out, int64_t ldo) {
    tile_k(unpack_q5_k, Q5K_BYTES, w, w_row_bytes, nc, xq, xq_row_bytes, nr, nblocks, out, ldo);
}

static void tile_q6_k(const uint8_t *w, int64_t w_row_bytes, int64_t nc, const uint8_t *xq, int64_t xq_row_bytes,
                      int64_t nr, int64_t nblocks, float *out, int64_t ldo) {
    tile_k(unpack_q6_k, Q6K_BYTES, w, w_row_bytes, nc, xq, xq_row_bytes, nr, nblocks, out, ldo);
}

static const qtype_ops OPS_Q4_K = {QTYPE_Q4_K, QK, Q4K_BYTES, sizeof(act_k), quantize_act_k, tile_q4_k, dequant_q4_k};
static const qtype_ops OPS_Q5_K = {QTYPE_Q5_K, QK, Q5K_BYTES, sizeof(act_k), quantize_act_k, tile_q5_k, dequant_q5_k};
static const qtype_ops OPS_Q6_K = {QTYPE_Q6_K, QK, Q6K_BYTES, sizeof(act_k), quantize_act_k, tile_q6_k, dequant_q6_k};

const qtype_ops *qtype_k(int type) {
    switch (type) {
    case QTYPE_Q4_K: return &OPS_Q4_K;
    case QTYPE_Q5_K: return &OPS_Q5_K;
    case QTYPE_Q6_K: return &OPS_Q6_K;
    default: return NULL;
    }
}
