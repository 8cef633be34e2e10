/* Attention of decode rows over the paged KV pool: one call for all decode rows of a layer. */
#include "common.h"
#include "rivulet_kernels.h"
#include <stdlib.h>

#define SCORE_CHUNK 64 /* KV positions scored before their softmax update (portable path) */
#define MAX_SPLIT 16      /* position runs of a row when few rows split them */
#define SPLIT_MIN_LEN 256 /* positions from which few rows split them (shorter: the merge costs more) */
#define PREFETCH_L2 512 /* positions of a task asked into L2 when it starts, and of the next task */

/* The KV a task's attend asks into L2 for the task after it: positions [p0, p1) of page-table row
 * ``pages``, ``bytes`` from element ``col`` of each token row. */
struct kv_ahead {
    const int64_t *pages;
    int64_t p0, p1, col;
    int bytes;
};

#if HAVE_AVX512
#define BLOCK 16 /* positions per step: one vector of scores */
#define PAIRED (-1) /* block_scores' mode: bfloat16 q against bfloat16 K (a bfloat16 model's KV) */

/* Dimensions [d, d + 16) of a K or V row of ``kv_dtype`` widened to float32 (zeros past head_dim):
 * bfloat16 by a shift, float16 by vcvtph2ps. */
static inline __m512 load16_kv(const char *row, int kv_dtype, int d, int head_dim) {
    const __mmask16 mask = head_dim - d >= 16 ? 0xffffu : (__mmask16)((1u << (head_dim - d)) - 1);
    if (kv_dtype == DTYPE_F32) return _mm512_maskz_loadu_ps(mask, (const float *)row + d);
    const __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)row + d);
    if (kv_dtype == DTYPE_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* The 16 scores q . K[row at[t]] (unscaled) of one query head, K rows read from kv: for each
 * 32-dimension (PAIRED) or 16-dimension (float32 q) block of q, one partial-sum vector per
 * position, summed by sum16 at the end. at[] must list positions in ORDER16 order. PAIRED: bfloat16
 * pairs go through vdpbf16ps (a product of two bfloat16 is exact in float32, sums are float32);
 * else ``mode`` is the KV dtype, its rows widened to float32 for FMAs with the float32 q. */
static inline __m512 block_scores(const void *q, const void *kv, const int64_t at[16], int mode, int head_dim) {
    __m512 part[16];
    for (int t = 0; t < 16; t++) part[t] = _mm512_setzero_ps();
    if (mode == PAIRED) {
        const uint16_t *k16 = (const uint16_t *)kv;
        for (int d = 0; d < head_dim; d += 32) {
            const __mmask32 mask = head_dim - d >= 32 ? 0xffffffffu : (1u << (head_dim - d)) - 1;
            const __m512bh qb = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const uint16_t *)q + d);
            for (int t = 0; t < 16; t++)
                part[t] = _mm512_dpbf16_ps(part[t], qb, (__m512bh)_mm512_maskz_loadu_epi16(mask, k16 + at[t] + d));
        }
    } else {
        const int elem = mode == DTYPE_F32 ? 4 : 2;
        for (int d = 0; d < head_dim; d += 16) {
            const __mmask16 mask = head_dim - d >= 16 ? 0xffffu : (__mmask16)((1u << (head_dim - d)) - 1);
            const __m512 qb = _mm512_maskz_loadu_ps(mask, (const float *)q + d);
            for (int t = 0; t < 16; t++)
                part[t] = _mm512_fmadd_ps(qb, load16_kv((const char *)kv + at[t] * elem, mode, d, head_dim), part[t]);
        }
    }
    return sum16(part);
}

/* Bit t: whether at[t] of a block in ORDER16 order is one of its first n positions (the rest of a
 * row's last block repeat its last row, and their scores are masked: they need not be computed). */
static inline unsigned live16(int n) {
    unsigned live = 0;
    for (int t = 0; t < 16; t++) live |= (unsigned)(ORDER16[t] < n) << t;
    return live;
}

/* group_scores (below) where the GN heads' q fill 16 vectors (head_dim = 16 ND): q held in registers
 * for the block, not loaded again for each position. The same products in the same order per lane,
 * so the same bits. Not inlined (nor group_values_held): in attend_avx512's frame their registers'
 * spills moved its other arrays, and the Qwen3-MoE shape's steps (which take neither) ran 0.6x. */
static __attribute__((noinline)) void group_scores_held(const float *q, const char *kv, const int64_t at[16],
                                                        unsigned live, int mode, __m512 *raw, const int GN,
                                                        const int ND) {
    const int elem = mode == DTYPE_F32 ? 4 : 2;
    __m512 qr[16], part[4][16];
    for (int i = 0; i < GN; i++)
        for (int c = 0; c < ND; c++) qr[i * ND + c] = _mm512_loadu_ps(q + (i * ND + c) * 16);
    for (int t = 0; t < 16; t++) {
        if (!(live >> t & 1)) { /* a masked lane: any value */
            for (int i = 0; i < GN; i++) part[i][t] = _mm512_setzero_ps();
            continue;
        }
        __m512 k[8];
        for (int c = 0; c < ND; c++) k[c] = load16_kv(kv + at[t] * elem, mode, 16 * c, 16 * ND);
        for (int i = 0; i < GN; i++) {
            __m512 a = _mm512_setzero_ps();
            for (int c = 0; c < ND; c++) a = _mm512_fmadd_ps(qr[i * ND + c], k[c], a);
            part[i][t] = a;
        }
    }
    for (int i = 0; i < GN; i++) raw[i] = sum16(part[i]);
}

/* group_values (below) where the GN heads' accumulators fill 16 vectors (head_dim = 16 ND): all of
 * them held in registers over the block, each V row read and widened once. The same FMAs in the same
 * order per lane, so the same bits. */
static __attribute__((noinline)) void group_values_held(float *acc, int stride, const float (*prob)[BLOCK],
                                                        const char *vh, const int64_t *at, int n, int kv_dtype,
                                                        const int GN, const int ND) {
    const int elem = kv_dtype == DTYPE_F32 ? 4 : 2;
    __m512 sum[16];
    for (int i = 0; i < GN; i++)
        for (int c = 0; c < ND; c++) sum[i * ND + c] = _mm512_loadu_ps(acc + (int64_t)i * stride + 16 * c);
    for (int t = 0; t < n; t++) {
        __m512 v[8];
        for (int c = 0; c < ND; c++) v[c] = load16_kv(vh + at[t] * elem, kv_dtype, 16 * c, 16 * ND);
        for (int i = 0; i < GN; i++) {
            const __m512 p = _mm512_set1_ps(prob[i][t]);
            for (int c = 0; c < ND; c++) sum[i * ND + c] = _mm512_fmadd_ps(p, v[c], sum[i * ND + c]);
        }
    }
    for (int i = 0; i < GN; i++)
        for (int c = 0; c < ND; c++) _mm512_storeu_ps(acc + (int64_t)i * stride + 16 * c, sum[i * ND + c]);
}

/* block_scores of GN query heads that share one KV head (GQA: q the first head's float32 values, the
 * others head_dim apart), into raw[0, GN): each K row's 16 dimensions are read and widened once for
 * all GN heads, where block_scores per head widens them GN times. Per head, every lane sums the
 * same products in the same order as block_scores (and sum16 reduces them alike): the same bits. */
static inline __attribute__((always_inline)) void group_scores(const float *q, const char *kv, const int64_t at[16],
                                                               unsigned live, int mode, int head_dim, __m512 *raw,
                                                               const int GN) {
    if (head_dim == 64 && GN == 4) return group_scores_held(q, kv, at, live, mode, raw, GN, 4);
    if (head_dim == 128 && GN == 2) return group_scores_held(q, kv, at, live, mode, raw, GN, 8);
    const int elem = mode == DTYPE_F32 ? 4 : 2;
    __m512 part[8][16];
    for (int t = 0; t < 16; t++) {
        __m512 a[8];
        if (!(live >> t & 1)) { /* a masked lane: any value */
            for (int i = 0; i < GN; i++) part[i][t] = _mm512_setzero_ps();
            continue;
        }
        for (int i = 0; i < GN; i++) a[i] = _mm512_setzero_ps();
        for (int d = 0; d < head_dim; d += 16) {
            const __mmask16 mask = head_dim - d >= 16 ? 0xffffu : (__mmask16)((1u << (head_dim - d)) - 1);
            const __m512 k = load16_kv(kv + at[t] * elem, mode, d, head_dim);
            for (int i = 0; i < GN; i++)
                a[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, q + (int64_t)i * head_dim + d), k, a[i]);
        }
        for (int i = 0; i < GN; i++) part[i][t] = a[i];
    }
    for (int i = 0; i < GN; i++) raw[i] = sum16(part[i]);
}

/* acc[i] (GN heads' float32 accumulators, stride apart) += prob[i][t] V[t] over the block's n
 * positions (rows at[t], float32 or widened): each V row's 16 dimensions read and widened once for
 * all GN heads; per head and lane the same FMAs in the same order as one head at a time. */
static inline __attribute__((always_inline)) void group_values(float *acc, int stride, const float (*prob)[BLOCK],
                                                               const char *vh, const int64_t *at, int n, int kv_dtype,
                                                               int head_dim, const int GN) {
    if (head_dim == 64 && GN == 4) return group_values_held(acc, stride, prob, vh, at, n, kv_dtype, GN, 4);
    if (head_dim == 128 && GN == 2) return group_values_held(acc, stride, prob, vh, at, n, kv_dtype, GN, 8);
    const int elem = kv_dtype == DTYPE_F32 ? 4 : 2;
    for (int d = 0; d < head_dim; d += 16) {
        const __mmask16 mask = head_dim - d >= 16 ? 0xffffu : (__mmask16)((1u << (head_dim - d)) - 1);
        __m512 sum[8];
        for (int i = 0; i < GN; i++) sum[i] = _mm512_maskz_loadu_ps(mask, acc + (int64_t)i * stride + d);
        for (int t = 0; t < n; t++) {
            const __m512 v = load16_kv(vh + at[t] * elem, kv_dtype, d, head_dim);
            for (int i = 0; i < GN; i++) sum[i] = _mm512_fmadd_ps(_mm512_set1_ps(prob[i][t]), v, sum[i]);
        }
        for (int i = 0; i < GN; i++) _mm512_mask_storeu_ps(acc + (int64_t)i * stride + d, mask, sum[i]);
    }
}

/* group_scores and group_values over any number of heads, 8 at a time (GN a constant in each). */
#define GROUPS_OF_8(CALL)                                                                                     \
    for (int g0 = 0; g0 < group; g0 += 8) {                                                                   \
        switch (group - g0 < 8 ? group - g0 : 8) {                                                            \
        case 1: CALL(1); break;                                                                               \
        case 2: CALL(2); break;                                                                               \
        case 3: CALL(3); break;                                                                               \
        case 4: CALL(4); break;                                                                               \
        case 5: CALL(5); break;                                                                               \
        case 6: CALL(6); break;                                                                               \
        case 7: CALL(7); break;                                                                               \
        default: CALL(8); break;                                                                              \
        }                                                                                                     \
    }

/* aj[0, 32) += the bfloat16 probability pairs times the pair-interleaved V rows' dimensions
 * [d, d + 32) (vpair: two positions a vector, as attend_avx512 lays them out). */
static inline void add_pairs(float *aj, const uint32_t *pairs, int npairs, __m512i vpair[][MAX_HEAD_DIM / 16],
                             int d) {
    __m512 lo = _mm512_loadu_ps(aj), hi = _mm512_loadu_ps(aj + 16);
    for (int i = 0; i < npairs; i++) {
        const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pairs[i]);
        lo = _mm512_dpbf16_ps(lo, pp, (__m512bh)vpair[i][d / 16]);
        hi = _mm512_dpbf16_ps(hi, pp, (__m512bh)vpair[i][d / 16 + 1]);
    }
    _mm512_storeu_ps(aj, lo);
    _mm512_storeu_ps(aj + 16, hi);
}

/* One task of paged_decode_attention, BLOCK positions at a time: for each KV head, the scores of
 * its query heads (one vector each), their online softmax, and the weighted sum of V.
 *
 * A bfloat16 model's bfloat16 KV (PAIRED) weights V through vdpbf16ps as well: two positions per
 * instruction, their V rows interleaved, the probabilities rounded to bfloat16 (as torch's own CPU
 * flash attention does for bfloat16). The interleave leaves each 32-dimension accumulator in the
 * order [d 0-3, 8-11, 16-19, 24-27 | d 4-7, 12-15, 20-23, 28-31]; the end undoes it. Any other
 * pair of dtypes computes in float32: q widened once, K and V rows as they are read.
 *
 * Its own positions past the first block are asked into L2 at the start when own_l2 (else an earlier
 * task asked for them); ``ahead`` (or NULL): the KV of the task this thread most likely runs next,
 * asked into L2 a slice after each KV head of each block. Asked for all at once, that next task's
 * lines outnumber the misses a core keeps in flight, and the prefetches stalled the thread for about
 * as long as the reads themselves, where in slices they come in while this task computes. */
static void attend_avx512(const char *q, const void *k_cache, const void *v_cache, int dtype, int kv_dtype,
                          const int64_t *pages, int64_t p0, int64_t len, int page_size, int h0, int h1, int group,
                          int head_dim, int64_t kv_row, float scale, float *res, float *stats,
                          const struct kv_ahead *ahead, int own_l2) {
    const int paired = dtype == DTYPE_BF16 && kv_dtype == DTYPE_BF16;
    const int elem = kv_dtype == DTYPE_F32 ? 4 : 2, nq = (h1 - h0) * group, bytes = (h1 - h0) * head_dim * elem;
    const int q_elem = paired ? 2 : 4;
    const int64_t col = (int64_t)h0 * head_dim;
    const int stride = (head_dim + 31) & ~31; /* of acc per head: whole 32-dimension blocks */
    float acc[MAX_QUERY_WIDTH], m[MAX_HEADS], l[MAX_HEADS];
    float prob[MAX_HEADS][BLOCK];
    float qf[MAX_QUERY_WIDTH]; /* q in float32, when not PAIRED */
    uint32_t pairs[MAX_HEADS][BLOCK / 2]; /* bfloat16 probabilities of positions 2i, 2i+1 */
    int64_t at[BLOCK], at_k[BLOCK];        /* element offset of each position's token row; in ORDER16 */
    __m512i vpair[BLOCK / 2][MAX_HEAD_DIM / 16]; /* bfloat16 V rows of a KV head, two positions interleaved */
    if (!paired && dtype != DTYPE_F32) { /* a float32 q is read where it lies */
        load_vec(q, dtype, 0, nq * head_dim, qf);
        q = (const char *)qf;
    }
    memset(acc, 0, (size_t)nq * stride * sizeof(float));
    for (int j = 0; j < nq; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    prefetch_kv(k_cache, v_cache, pages, page_size, p0, len < p0 + BLOCK ? len : p0 + BLOCK, kv_row, col, elem, bytes,
                0);
    if (own_l2)
        prefetch_kv(k_cache, v_cache, pages, page_size, p0 + BLOCK, len < p0 + PREFETCH_L2 ? len : p0 + PREFETCH_L2,
                    kv_row, col, elem, bytes, 1);
    /* the next task's positions [ahead->p0, ahead->p1) in one slice per KV head and block */
    const int64_t slices = (len - p0 + BLOCK - 1) / BLOCK * (h1 - h0);
    int64_t slice = 0;
    for (int64_t start = p0; start < len; start += BLOCK) {
        const int n = (int)(len - start < BLOCK ? len - start : BLOCK);
        const __mmask16 valid = (__mmask16)((1u << n) - 1);
        const unsigned live = n == BLOCK ? 0xffffu : live16(n);
        for (int t = 0; t < BLOCK; t++) { /* past the end: the last row again, its scores masked */
            const int64_t pos = start + (t < n ? t : n - 1);
            at[t] = (pages[pos / page_size] * page_size + pos % page_size) * kv_row;
        }
        for (int t = 0; t < BLOCK; t++) at_k[t] = at[ORDER16[t]];
        const int64_t next = start + BLOCK, next_end = len < next + BLOCK ? len : next + BLOCK;
        prefetch_kv(k_cache, v_cache, pages, page_size, next, next_end, kv_row, col, elem, bytes, 0);
        __m512 raws[MAX_HEADS];
        if (!paired) /* float32 q: each KV head's group of query heads at once */
            for (int h = h0; h < h1; h++) {
                const char *kv = (const char *)k_cache + (int64_t)h * head_dim * elem;
                const float *qh = (const float *)q + (int64_t)(h - h0) * group * head_dim;
#define SCORES(GN) group_scores(qh + (int64_t)g0 * head_dim, kv, at_k, live, kv_dtype, head_dim, raws + (h - h0) * group + g0, GN)
                GROUPS_OF_8(SCORES)
#undef SCORES
            }
        for (int j = 0; j < nq; j++) { /* scores and the softmax update */
            const char *kv = (const char *)k_cache + (col + (int64_t)(j / group) * head_dim) * elem;
            const __m512 raw =
                paired ? block_scores(q + (int64_t)j * head_dim * q_elem, kv, at_k, PAIRED, head_dim) : raws[j];
            const __m512 s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY),
                                                  _mm512_mul_ps(raw, _mm512_set1_ps(scale)));
            const float mx = max_f(m[j], _mm512_reduce_max_ps(s)), drop = m[j] - mx;
            const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
            const float sum = _mm512_reduce_add_ps(p);
            if (drop != 0.0f) { /* else the factor is exp512(0) = 1 exactly: nothing to scale */
                const float corr = _mm512_cvtss_f32(exp512(_mm512_set1_ps(drop))); /* first block: ~0 */
                l[j] = l[j] * corr + sum;
                float *aj = acc + (int64_t)j * stride;
                for (int d = 0; d < stride; d += 16) /* stride: whole vectors */
                    _mm512_storeu_ps(aj + d, _mm512_mul_ps(_mm512_loadu_ps(aj + d), _mm512_set1_ps(corr)));
            } else {
                l[j] = l[j] + sum;
            }
            m[j] = mx;
            if (paired)
                _mm256_storeu_si256((__m256i *)pairs[j], (__m256i)_mm512_cvtneps_pbh(p));
            else
                _mm512_storeu_ps(prob[j], p);
        }
        for (int h = h0; h < h1; h++, slice++) { /* the weighted sum of V, accumulators in registers */
            const int64_t vcol = (int64_t)h * head_dim;
            if (ahead != NULL) {
                const int64_t span = ahead->p1 - ahead->p0;
                prefetch_kv(k_cache, v_cache, ahead->pages, page_size, ahead->p0 + span * slice / slices,
                            ahead->p0 + span * (slice + 1) / slices, kv_row, ahead->col, elem, ahead->bytes, 1);
            }
            const int j0 = (h - h0) * group, npairs = (n + 1) / 2;
            if (paired) {
                const uint16_t *v16 = (const uint16_t *)v_cache + vcol;
                for (int i = 0; i < npairs; i++) /* rows 2i and 2i+1 interleaved (a zero row past the end) */
                    for (int d = 0; d < head_dim; d += 32) {
                        const __mmask32 mask = head_dim - d >= 32 ? 0xffffffffu : (1u << (head_dim - d)) - 1;
                        const __m512i a = _mm512_maskz_loadu_epi16(mask, v16 + at[2 * i] + d);
                        const __m512i b = 2 * i + 1 < n ? _mm512_maskz_loadu_epi16(mask, v16 + at[2 * i + 1] + d)
                                                        : _mm512_setzero_si512();
                        vpair[i][d / 16] = _mm512_unpacklo_epi16(a, b);
                        vpair[i][d / 16 + 1] = _mm512_unpackhi_epi16(a, b);
                    }
                for (int j = j0; j < j0 + group; j++)
                    for (int d = 0; d < stride; d += 32)
                        add_pairs(acc + (int64_t)j * stride + d, pairs[j], npairs, vpair, d);
            } else {
                const char *vh = (const char *)v_cache + vcol * elem;
#define VALUES(GN) group_values(acc + (int64_t)(j0 + g0) * stride, stride, prob + j0 + g0, vh, at, n, kv_dtype, head_dim, GN)
                GROUPS_OF_8(VALUES)
#undef VALUES
            }
        }
    }
    for (int j = 0; j < nq; j++) {
        const float inv = len > p0 ? 1.0f / l[j] : 0.0f;
        const float *aj = acc + (int64_t)j * stride;
        if (stats != NULL) stats[j] = m[j], stats[nq + j] = len > p0 ? l[j] : 0.0f;
        float *rj = res + (int64_t)j * head_dim;
        for (int d = 0; d < head_dim; d++) {
            int from = d; /* where the bfloat16 interleave left dimension d */
            if (paired) {
                const int base = d & ~31, i = d & 31;
                from = base + (i & 4 ? 16 : 0) + (i >> 3) * 4 + (i & 3);
            }
            rj[d] = aj[from] * inv;
        }
    }
}
/* attend_avx512 over positions [p0, len), its softmax max and sum per query head in stats (when given):
 * few long rows split their positions (attend_split), as the AVX2 build does. */
static inline void attend_run(const char *q, const void *k_cache, const void *v_cache, int dtype, int kv_dtype,
                              const int64_t *pages, int64_t p0, int64_t len, int page_size, int h0, int h1, int group,
                              int head_dim, int64_t kv_row, float scale, float *res, float *stats) {
    attend_avx512(q, k_cache, v_cache, dtype, kv_dtype, pages, p0, len, page_size, h0, h1, group, head_dim, kv_row,
                  scale, res, stats, NULL, 1);
}
#define attend attend_run
#define SPLIT_POSITIONS 1

/* The 16 scores q . K[t] of one query against a block's K rows widened to float32 (kf[t], in
 * block_scores' ORDER16 order), summed as block_scores sums them: the same products in the same
 * order, so the same scores. */
static inline __m512 widened_scores(const float *q, float (*kf)[MAX_HEAD_DIM], int head_dim) {
    __m512 part[16];
    for (int t = 0; t < 16; t++) part[t] = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d += 16) {
        const __mmask16 mask = head_dim - d >= 16 ? 0xffffu : (__mmask16)((1u << (head_dim - d)) - 1);
        const __m512 qb = _mm512_maskz_loadu_ps(mask, q + d);
        for (int t = 0; t < 16; t++) part[t] = _mm512_fmadd_ps(qb, _mm512_load_ps(kf[t] + d), part[t]);
    }
    return sum16(part);
}

/* The positions of one verify row (npos adjacent decode rows of one request, lens[p] = lens[0] + p)
 * over heads [h0, h1), attend_avx512's way: every query of every position in one pass over the KV,
 * so each K and V row is read (and widened) once for all of them, and a query's scores past its own
 * position are masked. npos * (h1 - h0) * group <= MAX_HEADS. res: [npos][(h1 - h0) * group][head_dim]. */
static void attend_span_avx512(const char *q, int64_t q_pos_bytes, int npos, const int64_t *lens, const void *k_cache,
                               const void *v_cache, int dtype, int kv_dtype, const int64_t *pages, int page_size,
                               int h0, int h1, int group, int head_dim, int64_t kv_row, float scale, float *res) {
    const int paired = dtype == DTYPE_BF16 && kv_dtype == DTYPE_BF16;
    const int elem = kv_dtype == DTYPE_F32 ? 4 : 2, nq = (h1 - h0) * group, nall = npos * nq;
    const int bytes = (h1 - h0) * head_dim * elem, q_elem = dtype == DTYPE_BF16 ? 2 : 4;
    const int64_t col = (int64_t)h0 * head_dim, len = lens[npos - 1];
    const int stride = (head_dim + 31) & ~31; /* of acc per query: whole 32-dimension blocks */
    float acc[MAX_QUERY_WIDTH], m[MAX_HEADS], l[MAX_HEADS];
    float prob[MAX_HEADS][BLOCK];
    float qf[MAX_QUERY_WIDTH]; /* q in float32, when not PAIRED */
    const char *qp[MAX_HEADS];             /* each query's q row */
    uint32_t pairs[MAX_HEADS][BLOCK / 2];  /* bfloat16 probabilities of positions 2i, 2i+1 */
    int64_t at[BLOCK], at_k[BLOCK];        /* element offset of each position's token row; in ORDER16 */
    __m512i vpair[BLOCK / 2][MAX_HEAD_DIM / 16];
    float kf[BLOCK][MAX_HEAD_DIM] __attribute__((aligned(64))); /* a head's K rows of a block (ORDER16) */
    for (int jq = 0; jq < nall; jq++) {
        const char *src = q + (jq / nq) * q_pos_bytes + (int64_t)(jq % nq) * head_dim * q_elem;
        if (!paired) {
            load_vec(src, dtype, 0, head_dim, qf + (int64_t)jq * head_dim);
            src = (const char *)(qf + (int64_t)jq * head_dim);
        }
        qp[jq] = src;
        m[jq] = -INFINITY;
        l[jq] = 0.0f;
    }
    memset(acc, 0, (size_t)nall * stride * sizeof(float));
    prefetch_kv(k_cache, v_cache, pages, page_size, 0, len < BLOCK ? len : BLOCK, kv_row, col, elem, bytes, 0);
    prefetch_kv(k_cache, v_cache, pages, page_size, BLOCK, len < PREFETCH_L2 ? len : PREFETCH_L2, kv_row, col, elem,
                bytes, 1);
    for (int64_t start = 0; start < len; start += BLOCK) {
        const int n = (int)(len - start < BLOCK ? len - start : BLOCK);
        for (int t = 0; t < BLOCK; t++) { /* past the end: the last row again, its scores masked */
            const int64_t pos = start + (t < n ? t : n - 1);
            at[t] = (pages[pos / page_size] * page_size + pos % page_size) * kv_row;
        }
        for (int t = 0; t < BLOCK; t++) at_k[t] = at[ORDER16[t]];
        const int64_t next = start + BLOCK, next_end = len < next + BLOCK ? len : next + BLOCK;
        prefetch_kv(k_cache, v_cache, pages, page_size, next, next_end, kv_row, col, elem, bytes, 0);
        for (int h = h0; h < h1; h++) { /* scores and the softmax update of the queries still in range */
            const char *kv = (const char *)k_cache + (int64_t)h * head_dim * elem;
            if (!paired) /* the head's K rows of the block, widened once for all its queries */
                for (int t = 0; t < BLOCK; t++)
                    for (int d = 0; d < head_dim; d += 16)
                        _mm512_store_ps(kf[t] + d, load16_kv(kv + at_k[t] * elem, kv_dtype, d, head_dim));
            for (int p = 0; p < npos; p++) {
                const int64_t own = lens[p] - start;
                if (own <= 0) continue;
                const __mmask16 valid = (__mmask16)((1u << (own < n ? (int)own : n)) - 1);
                for (int jj = 0; jj < group; jj++) {
                    const int jq = p * nq + (h - h0) * group + jj;
                    const __m512 raw = paired ? block_scores(qp[jq], kv, at_k, PAIRED, head_dim)
                                              : widened_scores((const float *)qp[jq], kf, head_dim);
                    const __m512 sc = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY),
                                                           _mm512_mul_ps(raw, _mm512_set1_ps(scale)));
                    const float mx = max_f(m[jq], _mm512_reduce_max_ps(sc));
                    const __m512 pr = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(mx))));
                    const float corr = _mm512_cvtss_f32(exp512(_mm512_set1_ps(m[jq] - mx)));
                    l[jq] = l[jq] * corr + _mm512_reduce_add_ps(pr);
                    m[jq] = mx;
                    float *aj = acc + (int64_t)jq * stride;
                    for (int d = 0; d < stride; d++) aj[d] *= corr;
                    if (paired)
                        _mm256_storeu_si256((__m256i *)pairs[jq], (__m256i)_mm512_cvtneps_pbh(pr));
                    else
                        _mm512_storeu_ps(prob[jq], pr);
                }
            }
        }
        for (int h = h0; h < h1; h++) { /* V: each row widened once, weighted for every query of the head */
            const int64_t vcol = (int64_t)h * head_dim;
            const int npairs = (n + 1) / 2;
            if (paired) {
                const uint16_t *v16 = (const uint16_t *)v_cache + vcol;
                for (int i = 0; i < npairs; i++)
                    for (int d = 0; d < head_dim; d += 32) {
                        const __mmask32 mask = head_dim - d >= 32 ? 0xffffffffu : (1u << (head_dim - d)) - 1;
                        const __m512i a = _mm512_maskz_loadu_epi16(mask, v16 + at[2 * i] + d);
                        const __m512i b = 2 * i + 1 < n ? _mm512_maskz_loadu_epi16(mask, v16 + at[2 * i + 1] + d)
                                                        : _mm512_setzero_si512();
                        vpair[i][d / 16] = _mm512_unpacklo_epi16(a, b);
                        vpair[i][d / 16 + 1] = _mm512_unpackhi_epi16(a, b);
                    }
            }
            const char *vh = (const char *)v_cache + vcol * elem;
            for (int d = 0; d < head_dim; d += paired ? 32 : 16) {
                const __mmask16 mask = head_dim - d >= 16 ? 0xffffu : (__mmask16)((1u << (head_dim - d)) - 1);
                __m512 vrow[BLOCK];
                if (!paired)
                    for (int t = 0; t < n; t++) vrow[t] = load16_kv(vh + at[t] * elem, kv_dtype, d, head_dim);
                for (int p = 0; p < npos; p++) {
                    if (lens[p] <= start) continue;
                    for (int jj = 0; jj < group; jj++) {
                        const int jq = p * nq + (h - h0) * group + jj;
                        float *aj = acc + (int64_t)jq * stride + d;
                        if (paired) {
                            add_pairs(aj, pairs[jq], npairs, vpair, d);
                        } else {
                            __m512 sum = _mm512_maskz_loadu_ps(mask, aj);
                            for (int t = 0; t < n; t++) sum = _mm512_fmadd_ps(_mm512_set1_ps(prob[jq][t]), vrow[t], sum);
                            _mm512_mask_storeu_ps(aj, mask, sum);
                        }
                    }
                }
            }
        }
    }
    for (int jq = 0; jq < nall; jq++) {
        const float inv = 1.0f / l[jq]; /* every position sees itself: l > 0 */
        const float *aj = acc + (int64_t)jq * stride;
        float *rj = res + (int64_t)jq * head_dim;
        for (int d = 0; d < head_dim; d++) {
            int from = d; /* where the bfloat16 interleave left dimension d */
            if (paired) {
                const int base = d & ~31, i = d & 31;
                from = base + (i & 4 ? 16 : 0) + (i >> 3) * 4 + (i & 3);
            }
            rj[d] = aj[from] * inv;
        }
    }
}

#elif HAVE_AVX2
#define BLOCK 8 /* positions per vector of scores */
#define STEP 16 /* positions per step: STEP / BLOCK vectors of scores per query head */
#define NV (STEP / BLOCK)
#define MAX_G 4 /* query heads scored and weighted together (their K/V rows widened once) */
#define INLINE static inline __attribute__((always_inline))

/* Lane i of the result: the sum of the 8 lanes of v[i]. */
static inline __m256 sum8(const __m256 v[8]) {
    /* hadd(hadd(v0, v1), hadd(v2, v3)): per 128-bit half, the half-sums of v0..v3 */
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* Lanes [0, n) all ones, the rest zero. */
static inline __m256i first_lanes(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Dimensions [d, d + 16) of a K or V row as two float32 vectors. bfloat16 is widened the way
 * matmul.c does it: one 256-bit load holds dimension d + 2i in the low half of 32-bit lane i and
 * d + 2i + 1 in the high half, so lo gets the even dimensions (shift left 16) and hi the odd ones
 * (low half masked off). float32 and float16 (vcvtph2ps): lo = d..d+7, hi = d+8..d+15. Past
 * head_dim: zeros, and nothing read (the row may end the pool, and what follows it is not ours to
 * multiply by zero: NaN). */
INLINE void load16(const char *row, int dtype, int d, int head_dim, __m256 *lo, __m256 *hi) {
    const int n = head_dim - d;
    if (dtype == DTYPE_F16) {
        const uint16_t *p = (const uint16_t *)row + d;
        uint16_t tail[16] = {0};
        if (n < 16) {
            memcpy(tail, p, (size_t)n * sizeof(uint16_t));
            p = tail;
        }
        *lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        *hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    } else if (dtype == DTYPE_BF16) {
        const uint16_t *p = (const uint16_t *)row + d;
        __m256i v;
        if (n >= 16) {
            v = _mm256_loadu_si256((const __m256i *)p);
        } else if (n % 2 == 0) {
            v = _mm256_maskload_epi32((const int *)p, first_lanes(n / 2));
        } else { /* an odd head_dim: no 32-bit mask covers it */
            uint16_t tail[16] = {0};
            memcpy(tail, p, (size_t)n * sizeof(uint16_t));
            v = _mm256_loadu_si256((const __m256i *)tail);
        }
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        *hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    } else {
        const float *p = (const float *)row + d;
        if (n >= 16) {
            *lo = _mm256_loadu_ps(p);
            *hi = _mm256_loadu_ps(p + 8);
        } else {
            *lo = _mm256_maskload_ps(p, first_lanes(n));
            *hi = _mm256_maskload_ps(p + 8, first_lanes(n - 8));
        }
    }
}

/* at[t]: the element offset of the token row of position start + t; past len, the last row again.
 * Returns how many are in [start, len). One division per step (page_size is a runtime value). */
static inline int step_rows(const int64_t *pages, int page_size, int64_t start, int64_t len, int64_t kv_row,
                            int64_t at[STEP]) {
    const int n = (int)(len - start < STEP ? len - start : STEP);
    int64_t page = start / page_size;
    int off = (int)(start - page * page_size);
    for (int t = 0; t < STEP; t++) {
        at[t] = (pages[page] * page_size + off) * kv_row;
        if (t + 1 < n && ++off == page_size) {
            off = 0;
            page++;
        }
    }
    return n;
}

/* Prefetch into L1 ``bytes`` from element ``col`` of the K and V rows at[0..n). */
static inline void prefetch_rows(const char *k_cache, const char *v_cache, const int64_t *at, int n, int64_t col,
                                 int elem, int bytes) {
    for (int t = 0; t < n; t++)
        for (int b = 0; b < bytes; b += 64) {
            __builtin_prefetch(k_cache + (at[t] + col) * elem + b, 0, 3);
            __builtin_prefetch(v_cache + (at[t] + col) * elem + b, 0, 3);
        }
}

/* s[g]: the 8 scores of query head g (its q at qf + g * stride, in load16's order and pre-scaled)
 * against the K rows at k + at[t] elements. P positions at a time, P * G = 6 or 8 accumulators
 * (q is read by the FMAs from L1): enough independent FMA chains to keep both FMA units busy. */
INLINE void block_scores(const float *qf, int stride, const char *k, const int64_t at[BLOCK], int dtype, int head_dim,
                         int G, __m256 s[MAX_G]) {
    const int elem = dtype == DTYPE_F32 ? 4 : 2, P = G == 1 ? 8 : G == 2 ? 4 : 2;
    __m256 part[MAX_G][BLOCK];
    for (int t = 0; t < BLOCK; t += P) {
        __m256 a[BLOCK][MAX_G];
        for (int i = 0; i < P; i++)
            for (int g = 0; g < G; g++) a[i][g] = _mm256_setzero_ps();
        for (int d = 0; d < head_dim; d += 16)
            for (int i = 0; i < P; i++) {
                __m256 lo, hi;
                load16(k + at[t + i] * elem, dtype, d, head_dim, &lo, &hi);
                for (int g = 0; g < G; g++)
                    a[i][g] = _mm256_fmadd_ps(hi, _mm256_load_ps(qf + g * stride + d + 8),
                                              _mm256_fmadd_ps(lo, _mm256_load_ps(qf + g * stride + d), a[i][g]));
            }
        for (int i = 0; i < P; i++)
            for (int g = 0; g < G; g++) part[g][t + i] = a[i][g];
    }
    for (int g = 0; g < G; g++) s[g] = sum8(part[g]);
}

/* The online softmax of one query head's step of scores s[i] (positions 8i..8i+7; at or past n:
 * ignored): updates its max m and its lane-wise sums lsum (added up at the end), stores the
 * probabilities (zero past n), and returns the factor its earlier accumulators take. */
static inline float softmax_step(__m256 s[NV], int n, float *m, float *lsum, float prob[STEP]) {
    __m256 valid[NV], top = _mm256_set1_ps(-INFINITY);
    for (int i = 0; i < NV; i++) {
        valid[i] = _mm256_castsi256_ps(first_lanes(n - BLOCK * i));
        s[i] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s[i], valid[i]);
        top = _mm256_max_ps(top, s[i]);
    }
    const float step_max = hmax8(top), mx = step_max > *m ? step_max : *m;
    /* Once a few steps are in, the max seldom moves: a factor of 1, no exp. (First step: m = -inf,
     * a factor ~0 times sums of 0.) */
    const float corr = mx > *m ? exp_nonpositive(*m - mx) : 1.0f;
    __m256 sum = _mm256_mul_ps(_mm256_load_ps(lsum), _mm256_set1_ps(corr));
    for (int i = 0; i < NV; i++) {
        const __m256 p = _mm256_and_ps(exp256(_mm256_sub_ps(s[i], _mm256_set1_ps(mx))), valid[i]);
        sum = _mm256_add_ps(sum, p);
        _mm256_store_ps(prob + BLOCK * i, p);
    }
    _mm256_store_ps(lsum, sum);
    *m = mx;
    return corr;
}

/* Dimensions [d, d + 16 * DB) of the accumulators of G query heads (head g at acc + g * stride):
 * acc = corr[g] * acc + the n V rows at v + at[t] elements weighted by prob[g][t], all 2 * DB * G
 * of them in registers over the step, each V block widened once for the G heads. */
INLINE void value_pass(float *acc, int stride, const float prob[][STEP], const float *corr, const char *v,
                       const int64_t at[STEP], int n, int dtype, int head_dim, int d, int G, int DB) {
    const int elem = dtype == DTYPE_F32 ? 4 : 2;
    __m256 lo[MAX_G][4], hi[MAX_G][4];
    for (int g = 0; g < G; g++)
        for (int b = 0; b < DB; b++) {
            const __m256 c = _mm256_set1_ps(corr[g]);
            lo[g][b] = _mm256_mul_ps(_mm256_load_ps(acc + g * stride + d + 16 * b), c);
            hi[g][b] = _mm256_mul_ps(_mm256_load_ps(acc + g * stride + d + 16 * b + 8), c);
        }
    for (int t = 0; t < n; t++)
        for (int b = 0; b < DB; b++) {
            __m256 vl, vh;
            load16(v + at[t] * elem, dtype, d + 16 * b, head_dim, &vl, &vh);
            for (int g = 0; g < G; g++) {
                const __m256 p = _mm256_broadcast_ss(&prob[g][t]);
                lo[g][b] = _mm256_fmadd_ps(p, vl, lo[g][b]);
                hi[g][b] = _mm256_fmadd_ps(p, vh, hi[g][b]);
            }
        }
    for (int g = 0; g < G; g++)
        for (int b = 0; b < DB; b++) {
            _mm256_store_ps(acc + g * stride + d + 16 * b, lo[g][b]);
            _mm256_store_ps(acc + g * stride + d + 16 * b + 8, hi[g][b]);
        }
}

/* One step of G query heads sharing a KV head (k, v: its column): scores, softmax, V. Fewer heads
 * take more dimensions per V pass, so each pass has at least 6 independent FMA chains. */
INLINE void step_heads(const float *qf, float *acc, int stride, const char *k, const char *v, const int64_t at[STEP],
                       int n, int dtype, int head_dim, float *m, float (*lsum)[BLOCK], int G) {
    const int DB = G == 1 ? 4 : G == 2 ? 2 : 1; /* 16-dimension blocks per V pass */
    __m256 s[MAX_G][NV];
    float prob[MAX_G][STEP] __attribute__((aligned(32))), corr[MAX_G];
    for (int i = 0; i < NV; i++) {
        __m256 si[MAX_G];
        block_scores(qf, stride, k, at + BLOCK * i, dtype, head_dim, G, si);
        for (int g = 0; g < G; g++) s[g][i] = si[g];
    }
    for (int g = 0; g < G; g++) corr[g] = softmax_step(s[g], n, m + g, lsum[g], prob[g]);
    int d = 0;
    for (; d + 16 * DB <= head_dim; d += 16 * DB)
        value_pass(acc, stride, prob, corr, v, at, n, dtype, head_dim, d, G, DB);
    for (; d < head_dim; d += 16) /* what is left: one block at a time */
        value_pass(acc, stride, prob, corr, v, at, n, dtype, head_dim, d, G, 1);
}

/* All steps of one task, for one dtype (a constant here: each dtype its own code). The rows of the
 * next step are found one step early and asked into L1, half before the first KV head, half after. */
INLINE void attend_steps(const float *qf, float *acc, int stride, const void *k_cache, const void *v_cache, int dtype,
                         const int64_t *pages, int64_t p0, int64_t len, int page_size, int h0, int h1, int group,
                         int head_dim, int64_t kv_row, float *m, float (*lsum)[BLOCK]) {
    const int elem = dtype == DTYPE_F32 ? 4 : 2, bytes = (h1 - h0) * head_dim * elem;
    const int64_t col = (int64_t)h0 * head_dim;
    int64_t at[STEP], next_at[STEP]; /* element offset of each position's token row */
    if (len <= p0) return;
    int n = step_rows(pages, page_size, p0, len, kv_row, at);
    prefetch_rows(k_cache, v_cache, at, n, col, elem, bytes);
    for (int64_t start = p0; start < len; start += STEP) {
        const int next_n = start + STEP < len ? step_rows(pages, page_size, start + STEP, len, kv_row, next_at) : 0;
        prefetch_rows(k_cache, v_cache, next_at, next_n < BLOCK ? next_n : BLOCK, col, elem, bytes);
        for (int h = h0; h < h1; h++) {
            const char *k = (const char *)k_cache + (int64_t)h * head_dim * elem;
            const char *v = (const char *)v_cache + (int64_t)h * head_dim * elem;
            for (int j = (h - h0) * group; j < (h - h0 + 1) * group; j += MAX_G) {
                const int rest = (h - h0 + 1) * group - j;
                const float *qj = qf + j * stride;
                float *aj = acc + j * stride;
                switch (rest < MAX_G ? rest : MAX_G) { /* each G its own unrolled code */
                case 1: step_heads(qj, aj, stride, k, v, at, n, dtype, head_dim, m + j, lsum + j, 1); break;
                case 2: step_heads(qj, aj, stride, k, v, at, n, dtype, head_dim, m + j, lsum + j, 2); break;
                case 3: step_heads(qj, aj, stride, k, v, at, n, dtype, head_dim, m + j, lsum + j, 3); break;
                default: step_heads(qj, aj, stride, k, v, at, n, dtype, head_dim, m + j, lsum + j, MAX_G);
                }
            }
            if (h == h0 && next_n > BLOCK)
                prefetch_rows(k_cache, v_cache, next_at + BLOCK, next_n - BLOCK, col, elem, bytes);
        }
        memcpy(at, next_at, sizeof at);
        n = next_n;
    }
}

/* One task of paged_decode_attention, STEP positions at a time: for each KV head, its query heads
 * MAX_G at a time, scored and weighted together. q (of ``dtype``) and the accumulators are float32
 * in load16's order for the KV's ``kv_dtype`` (bfloat16: each 16 dimensions as the 8 even, then the
 * 8 odd ones); the end undoes it. */
static void attend_avx2(const char *q, const void *k_cache, const void *v_cache, int dtype, int kv_dtype,
                        const int64_t *pages, int64_t p0, int64_t len, int page_size, int h0, int h1, int group,
                        int head_dim, int64_t kv_row, float scale, float *res, float *stats) {
    const int nq = (h1 - h0) * group;
    const int stride = (head_dim + 15) & ~15; /* of qf and acc per head: whole 16-dimension blocks */
    float qf[MAX_QUERY_WIDTH] __attribute__((aligned(32)));
    float acc[MAX_QUERY_WIDTH] __attribute__((aligned(32)));
    float m[MAX_HEADS], lsum[MAX_HEADS][BLOCK] __attribute__((aligned(32)));
    for (int j = 0; j < nq; j++) {
        float row[MAX_HEAD_DIM];
        load_vec(q, dtype, (int64_t)j * head_dim, head_dim, row);
        for (int i = 0; i < stride; i++) { /* qf[j][i]: the dimension load16 puts at i for kv_dtype */
            const int d = i & ~15, w = i & 15;
            const int from = kv_dtype == DTYPE_BF16 ? d + (w < 8 ? 2 * w : 2 * (w - 8) + 1) : i;
            qf[j * stride + i] = from < head_dim ? row[from] * scale : 0.0f;
        }
        m[j] = -INFINITY;
        _mm256_store_ps(lsum[j], _mm256_setzero_ps());
    }
    memset(acc, 0, (size_t)nq * stride * sizeof(float));
    if (kv_dtype == DTYPE_BF16)
        attend_steps(qf, acc, stride, k_cache, v_cache, DTYPE_BF16, pages, p0, len, page_size, h0, h1, group,
                     head_dim, kv_row, m, lsum);
    else if (kv_dtype == DTYPE_F16)
        attend_steps(qf, acc, stride, k_cache, v_cache, DTYPE_F16, pages, p0, len, page_size, h0, h1, group,
                     head_dim, kv_row, m, lsum);
    else
        attend_steps(qf, acc, stride, k_cache, v_cache, DTYPE_F32, pages, p0, len, page_size, h0, h1, group,
                     head_dim, kv_row, m, lsum);
    for (int j = 0; j < nq; j++) {
        const float l = hsum8(_mm256_load_ps(lsum[j])), inv = len > p0 ? 1.0f / l : 0.0f;
        if (stats != NULL) stats[j] = m[j], stats[nq + j] = len > p0 ? l : 0.0f;
        for (int d = 0; d < head_dim; d++) { /* bfloat16: dimension d is where load16 put it */
            const int from = kv_dtype == DTYPE_BF16 ? (d & ~15) + (d & 1) * 8 + (d & 15) / 2 : d;
            res[(int64_t)j * head_dim + d] = acc[j * stride + from] * inv;
        }
    }
}
#define attend attend_avx2
#define SPLIT_POSITIONS 1

#else
/* One task of paged_decode_attention: SCORE_CHUNK positions at a time, all heads of a position
 * together (one contiguous read of its token row). */
static void attend_portable(const char *q, const void *k_cache, const void *v_cache, int dtype, int kv_dtype,
                            const int64_t *pages, int64_t p0, int64_t len, int page_size, int h0, int h1, int group,
                            int head_dim, int64_t kv_row, float scale, float *res, float *stats) {
    const int elem = kv_dtype == DTYPE_F32 ? 4 : 2, nq = (h1 - h0) * group, width = (h1 - h0) * head_dim;
    const int64_t col = (int64_t)h0 * head_dim;
    float qf[MAX_QUERY_WIDTH], acc[MAX_QUERY_WIDTH], kv[MAX_QUERY_WIDTH];
    float scores[MAX_HEADS][SCORE_CHUNK], m[MAX_HEADS], l[MAX_HEADS];
    int64_t at[SCORE_CHUNK];
    load_vec(q, dtype, 0, nq * head_dim, qf);
    for (int i = 0; i < nq * head_dim; i++) qf[i] *= scale;
    memset(acc, 0, (size_t)nq * head_dim * sizeof(float));
    for (int j = 0; j < nq; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    for (int64_t start = p0; start < len; start += SCORE_CHUNK) {
        const int n = (int)(len - start < SCORE_CHUNK ? len - start : SCORE_CHUNK);
        for (int t = 0; t < n; t++)
            at[t] = (pages[(start + t) / page_size] * page_size + (start + t) % page_size) * kv_row + col;
        prefetch_kv(k_cache, v_cache, pages, page_size, start, start + n, kv_row, col, elem, width * elem, 0);
        for (int t = 0; t < n; t++) { /* scores of this chunk */
            load_vec(k_cache, kv_dtype, at[t], width, kv);
            for (int j = 0; j < nq; j++) {
                const float *qj = qf + (int64_t)j * head_dim, *kj = kv + (int64_t)(j / group) * head_dim;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < head_dim; d++) s += qj[d] * kj[d];
                scores[j][t] = s;
            }
        }
        for (int j = 0; j < nq; j++) { /* online softmax: rescale what came before */
            float mx = m[j];
            for (int t = 0; t < n; t++) mx = scores[j][t] > mx ? scores[j][t] : mx;
            const float corr = exp_nonpositive(m[j] - mx); /* m = -inf on the first chunk: ~0 */
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int t = 0; t < n; t++) {
                scores[j][t] = exp_nonpositive(scores[j][t] - mx);
                sum += scores[j][t];
            }
            l[j] = l[j] * corr + sum;
            m[j] = mx;
            float *aj = acc + (int64_t)j * head_dim;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) aj[d] *= corr;
        }
        for (int t = 0; t < n; t++) { /* accumulate V */
            load_vec(v_cache, kv_dtype, at[t], width, kv);
            for (int j = 0; j < nq; j++) {
                const float p = scores[j][t], *vj = kv + (int64_t)(j / group) * head_dim;
                float *aj = acc + (int64_t)j * head_dim;
#pragma omp simd
                for (int d = 0; d < head_dim; d++) aj[d] += p * vj[d];
            }
        }
    }
    for (int j = 0; j < nq; j++) {
        const float inv = len > p0 ? 1.0f / l[j] : 0.0f;
        if (stats != NULL) stats[j] = m[j], stats[nq + j] = len > p0 ? l[j] : 0.0f;
        for (int d = 0; d < head_dim; d++) res[(int64_t)j * head_dim + d] = acc[(int64_t)j * head_dim + d] * inv;
    }
}
#define attend attend_portable
#define SPLIT_POSITIONS 1
#endif

/* store_vec of a new K or V row: a float16 pool's 8 values at a time by vcvtps2ph, which rounds to
 * nearest even as f32_to_f16 does (the same bits; a NaN, which it would keep its payload of, as
 * f32_to_f16 writes it), where the scalar conversions cost a visible share of a many-row step's
 * attention (docs/benchmarks-history.md, "The 1B IQ4_XS file's 32-row decode attention"). */
static inline void store_kv_row(void *base, int kv_dtype, int64_t offset, int n, const float *src) {
#if HAVE_AVX2 || HAVE_AVX512
    if (kv_dtype == DTYPE_F16) {
        uint16_t *dst = (uint16_t *)base + offset;
        int i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 x = _mm256_loadu_ps(src + i);
            _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)))
                for (int t = i; t < i + 8; t++) dst[t] = f32_to_f16(src[t]);
        }
        for (; i < n; i++) dst[i] = f32_to_f16(src[i]);
        return;
    }
#endif
    store_vec(base, kv_dtype, offset, n, src);
}

/* Row r's new K and V (heads [h0, h1)), of ``dtype``, written at its last position in the KV's
 * ``kv_dtype`` (rounded to it), by the task that then reads it. */
static inline void write_new_kv(void *k_cache, void *v_cache, const int64_t *pages, int page_size, int64_t pos,
                                int64_t kv_row, int h0, int h1, int head_dim, int dtype, int kv_dtype,
                                const void *k_new, const void *v_new, int64_t k_off, int64_t v_off) {
    const int64_t at = (pages[pos / page_size] * page_size + pos % page_size) * kv_row + (int64_t)h0 * head_dim;
    const int n = (h1 - h0) * head_dim;
    k_off += (int64_t)h0 * head_dim;
    v_off += (int64_t)h0 * head_dim;
    if (dtype == kv_dtype) {
        const int elem = dtype == DTYPE_F32 ? 4 : 2;
        memcpy((char *)k_cache + at * elem, (const char *)k_new + k_off * elem, (size_t)n * elem);
        memcpy((char *)v_cache + at * elem, (const char *)v_new + v_off * elem, (size_t)n * elem);
        return;
    }
    if (dtype == DTYPE_F32) { /* rounded from where they lie */
        store_kv_row(k_cache, kv_dtype, at, n, (const float *)k_new + k_off);
        store_kv_row(v_cache, kv_dtype, at, n, (const float *)v_new + v_off);
        return;
    }
    float row[MAX_QUERY_WIDTH];
    load_vec(k_new, dtype, k_off, n, row);
    store_kv_row(k_cache, kv_dtype, at, n, row);
    load_vec(v_new, dtype, v_off, n, row);
    store_kv_row(v_cache, kv_dtype, at, n, row);
}

/* Each of nq heads' outputs in res ([nq, head_dim], normalized over its positions, whose softmax max
 * and sum attend left in stats: [nq] maxima, then [nq] sums) renormalized with its sink's logit in the
 * denominator: out * l / (l + exp(sink - m)). */
static void add_sinks(float *res, const float *stats, const float *sinks, int nq, int head_dim) {
    for (int j = 0; j < nq; j++) {
        const float m = stats[j], l = stats[nq + j], keep = l > 0.0f ? l / (l + expf(sinks[j] - m)) : 0.0f;
        for (int d = 0; d < head_dim; d++) res[(int64_t)j * head_dim + d] *= keep;
    }
}

/* The first position a row of ``len`` positions attends: its last ``window`` ones (0: all). */
static inline int64_t window_start(int64_t len, int64_t window) { return window > 0 && len > window ? len - window : 0; }

/* Few rows, every head of a row in one task but its positions split in ``parts`` runs (whole STEPs
 * of 16): each task leaves its heads' outputs normalized over its run with their softmax max and
 * sum (part: [rows * parts][num_heads * head_dim + 2 * num_heads]), then each (row, head) is the
 * runs' outputs weighted by sum * exp(max - the largest max), over the weights' total. Splitting
 * heads instead left 3 KV heads on 2 threads (one idle a third of the time), each reading a third
 * of every token row. */
static void attend_split(const void *q, int64_t q_row_stride, void *k_cache, void *v_cache, void *out, int dtype,
                         int kv_dtype, const int64_t *q_rows, const int64_t *req_pool_idx, const int64_t *kv_lens,
                         const int64_t *page_table, int64_t pt_stride, int64_t rows, int num_heads, int kv_heads,
                         int head_dim, int page_size, float scale, const void *k_new, int64_t k_new_stride,
                         const void *v_new, int64_t v_new_stride, int64_t window, const float *sinks, int parts,
                         float *part) {
    const int group = num_heads / kv_heads, elem = dtype == DTYPE_BF16 ? 2 : 4;
    const int64_t kv_row = (int64_t)kv_heads * head_dim, width = (int64_t)num_heads * (head_dim + 2);
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < rows * parts; task++) {
            const int64_t r = task / parts, c = task % parts, len = kv_lens[r], first = window_start(len, window);
            const int64_t *pages = page_table + req_pool_idx[r] * pt_stride, span = len - first;
            const int64_t run = ((span + parts - 1) / parts + 15) / 16 * 16;
            const int64_t p0 = first + (c * run < span ? c * run : span), p1 = p0 + run < len ? p0 + run : len;
            float *res = part + task * width;
            if (k_new != NULL && p0 < len && len <= p1)
                write_new_kv(k_cache, v_cache, pages, page_size, len - 1, kv_row, 0, kv_heads, head_dim, dtype, kv_dtype,
                             k_new, v_new, q_rows[r] * k_new_stride, q_rows[r] * v_new_stride);
            attend((const char *)q + q_rows[r] * q_row_stride * elem, k_cache, v_cache, dtype, kv_dtype, pages, p0, p1,
                   page_size, 0, kv_heads, group, head_dim, kv_row, scale, res, res + (int64_t)num_heads * head_dim);
        }
#pragma omp for schedule(static)
        for (int64_t rh = 0; rh < rows * num_heads; rh++) {
            const int64_t r = rh / num_heads, j = rh % num_heads;
            const float *first = part + r * parts * width, *stats = first + (int64_t)num_heads * head_dim;
            float top = -INFINITY, w[MAX_SPLIT], total = 0.0f, o[MAX_HEAD_DIM];
            memset(o, 0, (size_t)head_dim * sizeof(float));
            for (int c = 0; c < parts; c++) top = max_f(top, stats[c * width + j]);
            for (int c = 0; c < parts; c++) {
                const float m = stats[c * width + j], l = stats[c * width + num_heads + j];
                w[c] = l > 0.0f ? l * exp_nonpositive(m - top) : 0.0f;
                total += w[c];
            }
            if (sinks != NULL) total += expf(sinks[j] - top); /* the sink's share: a weight, no value */
            for (int c = 0; c < parts; c++) {
                const float wc = total > 0.0f ? w[c] / total : 0.0f, *rc = first + c * width + j * head_dim;
                for (int d = 0; d < head_dim; d++) o[d] += wc * rc[d];
            }
            store_vec(out, dtype, (q_rows[r] * num_heads + j) * head_dim, head_dim, o);
        }
    }
}

#if HAVE_AVX512
/* The decode rows as runs of adjacent rows of one request at consecutive positions (a verify row's,
 * or a lone decode row), each run in chunks of at most MAX_HEADS queries a task (attend_span_avx512),
 * their accumulators within MAX_QUERY_WIDTH: a task per chunk and KV head where there are few chunks,
 * else per chunk with all its heads (a task reading a third of each token row ran slower once the KV
 * was out of cache, as it is in a forward). The rows' new K/V are already in the pool. */
static int attend_spans(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache, void *out,
                        int dtype, int kv_dtype, const int64_t *q_rows, const int64_t *req_pool_idx,
                        const int64_t *kv_lens, const int64_t *page_table, int64_t pt_stride, int64_t rows,
                        int num_heads, int kv_heads, int head_dim, int page_size, float scale) {
    const int group = num_heads / kv_heads, elem = dtype == DTYPE_BF16 ? 2 : 4;
    const int64_t kv_row = (int64_t)kv_heads * head_dim;
    int64_t runs = 0;
    for (int64_t r = 0; r < rows; r++)
        runs += r == 0 || req_pool_idx[r] != req_pool_idx[r - 1] || kv_lens[r] != kv_lens[r - 1] + 1 ||
                q_rows[r] != q_rows[r - 1] + 1;
    /* a task's queries: at most MAX_HEADS, and their accumulators (whole 32-dimension blocks each) in
     * MAX_QUERY_WIDTH floats (fewer than MAX_HEADS only past 256-wide heads) */
    const int splits = runs < 2 * omp_get_max_threads() ? kv_heads : 1, heads_a_task = num_heads / splits;
    const int by_width = MAX_QUERY_WIDTH / (heads_a_task * ((head_dim + 31) & ~31));
    const int per_task = MAX_HEADS / heads_a_task < by_width ? MAX_HEADS / heads_a_task : by_width;
    int64_t *chunks = malloc((size_t)(2 * rows) * sizeof(int64_t)); /* (first row, positions) */
    if (chunks == NULL) return RV_ERR_NO_MEMORY;
    int64_t count = 0;
    for (int64_t r = 0, end; r < rows; r = end) {
        for (end = r + 1; end < rows && req_pool_idx[end] == req_pool_idx[r] && kv_lens[end] == kv_lens[end - 1] + 1 &&
                          q_rows[end] == q_rows[end - 1] + 1;
             end++) {
        }
        for (int64_t c = r; c < end; c += per_task, count++) {
            chunks[2 * count] = c;
            chunks[2 * count + 1] = end - c < per_task ? end - c : per_task;
        }
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < count * splits; task++) {
        const int64_t c0 = chunks[2 * (task / splits)], npos = chunks[2 * (task / splits) + 1];
        const int h0 = (int)(task % splits) * kv_heads / splits, h1 = (int)(task % splits + 1) * kv_heads / splits;
        const int q0 = h0 * group, nq = (h1 - h0) * group;
        float res[MAX_QUERY_WIDTH];
        attend_span_avx512((const char *)q + (q_rows[c0] * q_row_stride + (int64_t)q0 * head_dim) * elem,
                           q_row_stride * elem, (int)npos, kv_lens + c0, k_cache, v_cache, dtype, kv_dtype,
                           page_table + req_pool_idx[c0] * pt_stride, page_size, h0, h1, group, head_dim, kv_row, scale,
                           res);
        for (int64_t p = 0; p < npos; p++)
            store_vec(out, dtype, (q_rows[c0 + p] * num_heads + q0) * head_dim, nq * head_dim,
                      res + p * nq * head_dim);
    }
    free(chunks);
    return 0;
}
#endif

/* Attention of decode rows over their paged KV.
 *
 * q: [*, num_heads, head_dim] with row stride q_row_stride (elements); row r of this call
 * reads q row q_rows[r] and writes out row q_rows[r] (out: [*, num_heads, head_dim], contiguous).
 * Row r attends positions [0, kv_lens[r]) of page-table row req_pool_idx[r] (with ``window`` > 0 only the last
 * ``window`` of them: a sliding-window layer, as HF's mask keeps p > last - window; ``sinks`` (or NULL):
 * [num_heads] float32 logits, one more term in each head's softmax with no value: gpt-oss's). Position
 * p lives at
 * KV row page_table[req_pool_idx[r] * pt_stride + p / page_size] * page_size + p % page_size of
 * k_cache / v_cache ([pool tokens, kv_heads, head_dim], of ``kv_dtype``: float32, bfloat16 or
 * float16, whatever the ``dtype`` of q and out). The num_heads / kv_heads query heads of one KV
 * head share its K/V rows (GQA, HF's repeat_kv order). Returns RV_OK, RV_ERR_HEADS, RV_ERR_DTYPE or
 * RV_ERR_NO_MEMORY.
 *
 * k_new / v_new (or NULL): the rows' new K/V ([*, kv_heads, head_dim], rows k_new_stride /
 * v_new_stride elements apart, read at q_rows[r], of ``dtype``), written first at the row's last
 * position (rounded to ``kv_dtype``); a task writes exactly the heads it then reads, so no task waits
 * for another. Rows of one request (a verify row's positions, one row per position) must be adjacent:
 * where any are, every row's new K/V are written before any row attends.
 *
 * A task is one row with all its KV heads. (One task per (row, head) reads 1/kv_heads of every
 * token row, which is far slower once the KV is out of cache, as it always is in a forward:
 * docs/benchmarks.md.) With
 * fewer rows than twice the threads, a row's positions are split (attend_split) once some row has
 * SPLIT_MIN_LEN of them, else its heads.
 */
int paged_decode_attention(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                           void *out, int dtype, int kv_dtype, const int64_t *q_rows, const int64_t *req_pool_idx,
                           const int64_t *kv_lens, const int64_t *page_table, int64_t pt_stride, int64_t rows,
                           int num_heads, int kv_heads, int head_dim, int page_size, float scale,
                           const void *k_new, int64_t k_new_stride, const void *v_new, int64_t v_new_stride,
                           int64_t window, const float *sinks) {
    if (kv_heads < 1 || num_heads % kv_heads || num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM ||
        num_heads * ((head_dim + 31) & ~31) > MAX_QUERY_WIDTH)
        return RV_ERR_HEADS;
    if ((dtype != DTYPE_F32 && dtype != DTYPE_BF16) || kv_dtype < DTYPE_F32 || kv_dtype > DTYPE_F16) return RV_ERR_DTYPE;
    const int group = num_heads / kv_heads;
    const int64_t kv_row = (int64_t)kv_heads * head_dim; /* elements per pool token */
    int shared = 0; /* adjacent rows of one request: a verify row's positions, each reading the others' K/V */
    for (int64_t r = 1; r < rows && !shared; r++) shared = req_pool_idx[r] == req_pool_idx[r - 1];
    if (k_new != NULL && shared) {
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            if (kv_lens[r] > 0)
                write_new_kv((void *)k_cache, (void *)v_cache, page_table + req_pool_idx[r] * pt_stride, page_size,
                             kv_lens[r] - 1, kv_row, 0, kv_heads, head_dim, dtype, kv_dtype, k_new, v_new,
                             q_rows[r] * k_new_stride, q_rows[r] * v_new_stride);
        k_new = v_new = NULL;
    }
#if HAVE_AVX512
    /* a verify row's positions read its KV once (no window, no sinks: they share it) */
    if (shared && window == 0 && sinks == NULL)
        return attend_spans(q, q_row_stride, k_cache, v_cache, out, dtype, kv_dtype, q_rows, req_pool_idx, kv_lens,
                            page_table, pt_stride, rows, num_heads, kv_heads, head_dim, page_size, scale);
#endif
    const int threads = omp_get_max_threads(), elem = dtype == DTYPE_BF16 ? 2 : 4;
    const int kv_elem = kv_dtype == DTYPE_F32 ? 4 : 2;
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t span = kv_lens[r] - window_start(kv_lens[r], window);
        longest = span > longest ? span : longest;
    }
    if (SPLIT_POSITIONS && rows < 2 * threads && longest >= SPLIT_MIN_LEN) {
        int parts = (int)((2 * threads + rows - 1) / rows); /* about 2 runs a thread */
        parts = parts < MAX_SPLIT ? parts : MAX_SPLIT;
        float *part = malloc((size_t)(rows * parts * num_heads * (head_dim + 2)) * sizeof(float));
        if (part != NULL) {
            attend_split(q, q_row_stride, (void *)k_cache, (void *)v_cache, out, dtype, kv_dtype, q_rows, req_pool_idx,
                         kv_lens, page_table, pt_stride, rows, num_heads, kv_heads, head_dim, page_size, scale, k_new,
                         k_new_stride, v_new, v_new_stride, window, sinks, parts, part);
            free(part);
            return 0;
        }
    }
    const int splits = rows < 2 * threads ? kv_heads : 1; /* few rows, short or in an AVX-512 build */
#pragma omp parallel
    {
#if HAVE_AVX512
        int64_t asked = -1; /* the task whose KV this thread's last task asked into L2 */
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < rows * splits; task++) {
            const int64_t r = task / splits;
            const int h0 = (int)(task % splits) * kv_heads / splits, h1 = (int)(task % splits + 1) * kv_heads / splits;
            const int q0 = h0 * group, nq = (h1 - h0) * group;
            float task_res[MAX_QUERY_WIDTH], stats[2 * MAX_HEADS];
            if (k_new != NULL && kv_lens[r] > 0)
                write_new_kv((void *)k_cache, (void *)v_cache, page_table + req_pool_idx[r] * pt_stride, page_size,
                             kv_lens[r] - 1, kv_row, h0, h1, head_dim, dtype, kv_dtype, k_new, v_new,
                             q_rows[r] * k_new_stride, q_rows[r] * v_new_stride);
            const int64_t next = task + omp_get_num_threads(); /* most likely this thread's next task */
            struct kv_ahead ahead = {NULL, 0, 0, 0, 0};
            if (next < rows * splits) {
                const int64_t r2 = next / splits, from = window_start(kv_lens[r2], window);
                const int g0 = (int)(next % splits) * kv_heads / splits;
                const int g1 = (int)(next % splits + 1) * kv_heads / splits;
                ahead = (struct kv_ahead){page_table + req_pool_idx[r2] * pt_stride, from,
                                          kv_lens[r2] < from + PREFETCH_L2 ? kv_lens[r2] : from + PREFETCH_L2,
                                          (int64_t)g0 * head_dim, (g1 - g0) * head_dim * kv_elem};
            }
            const char *qr = (const char *)q + (q_rows[r] * q_row_stride + (int64_t)q0 * head_dim) * elem;
            const int64_t *pages = page_table + req_pool_idx[r] * pt_stride;
            const int64_t o_off = (q_rows[r] * num_heads + q0) * head_dim;
            /* float32 without sinks: the outputs written where they go (attend reads q before it writes) */
            float *res = dtype == DTYPE_F32 && sinks == NULL ? (float *)out + o_off : task_res;
            const int64_t from = window_start(kv_lens[r], window);
#if HAVE_AVX512
            attend_avx512(qr, k_cache, v_cache, dtype, kv_dtype, pages, from, kv_lens[r], page_size, h0, h1, group,
                          head_dim, kv_row, scale, res, sinks != NULL ? stats : NULL,
                          ahead.pages != NULL ? &ahead : NULL, asked != task);
            asked = ahead.pages != NULL && kv_lens[r] > from ? next : -1; /* (none: no block to ask it in) */
#else
            if (ahead.pages != NULL)
                prefetch_kv(k_cache, v_cache, ahead.pages, page_size, ahead.p0, ahead.p1, kv_row, ahead.col, kv_elem,
                            ahead.bytes, 1);
            attend(qr, k_cache, v_cache, dtype, kv_dtype, pages, from, kv_lens[r], page_size, h0, h1, group, head_dim,
                   kv_row, scale, res, sinks != NULL ? stats : NULL);
#endif
            if (sinks != NULL) add_sinks(res, stats, sinks + q0, nq, head_dim);
            if (dtype == DTYPE_BF16) {
                uint16_t *dst = (uint16_t *)out + o_off;
                for (int i = 0; i < nq * head_dim; i++) dst[i] = f32_to_bf16(res[i]);
            } else if (res != (float *)out + o_off) {
                memcpy((float *)out + o_off, res, (size_t)nq * head_dim * sizeof(float));
            }
        }
    }
    return 0;
}

