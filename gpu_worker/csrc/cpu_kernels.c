/* CPU kernels of the worker, built once per machine by gpu_worker/cpu_kernels.py.
 *
 * Plain C with OpenMP, called through ctypes with raw pointers: no torch headers,
 * so a build takes about a second. Loaded after torch, the library's libgomp.so.1
 * resolves to the copy torch already loaded, so its parallel loops share torch's
 * thread pool and follow torch.set_num_threads.
 *
 * Tensors are float32 (dtype code 0) or bfloat16 (code 1); all math is float32.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512 1 /* attend_avx512: 16 positions at a time in vector registers */
#else
#define HAVE_AVX512 0 /* attend_portable: loops the compiler vectorizes as it can */
#endif

#define DTYPE_F32 0
#define DTYPE_BF16 1
#define SCORE_CHUNK 64 /* KV positions scored before their softmax update (portable path) */
#define MAX_HEADS 64 /* query heads (larger: the caller uses torch) */
#define MAX_HEAD_DIM 256
#define PREFETCH_L2 512 /* positions of a task asked into L2 when it starts, and of the next task */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16; /* round to nearest even */
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded); /* a select: loops vectorize */
}

/* n elements of a float32 or bfloat16 tensor from element ``offset`` on, as float32. */
static inline void load_vec(const void *base, int dtype, int64_t offset, int n, float *dst) {
    if (dtype == DTYPE_BF16) {
        const uint16_t *src = (const uint16_t *)base + offset;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
    }
}

/* exp(x) for x <= 0 with relative error ~2e-7 (Cephes' expf polynomial), for the portable paths.
 * (gcc 12 still keeps loops around it scalar; the AVX-512 paths use exp512.) */
static inline float exp_nonpositive(float x) {
    /* x = max(x, -87), -inf included, on the bits: as a float select, gcc turns the clamp into a
     * branch (a clamped input makes the result a constant) and the loop stays scalar. A negative
     * float of larger magnitude is a larger (less negative) int32, so "below -87" is bits > lim. */
    union { float f; int32_t i; } in = {.f = x};
    const int32_t lim = (int32_t)0xC2AE0000u; /* -87.0f; exp(-87) ~ 1.6e-38 adds nothing to a sum >= 1 */
    in.i = ((in.i < 0) & (in.i > lim)) ? lim : in.i;
    x = in.f;
    const float n = (float)(int32_t)(x * 1.44269504088896341f - 0.5f); /* round(x / ln 2), x <= 0 */
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;          /* x - n ln 2 in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    return (p * r * r + r + 1.0f) * two_n.f;
}

/* Prefetch the K and V of positions [p0, p1): ``bytes`` from column ``col`` of each token row, into
 * L1 or (to_l2) only as far as L2. Pages are scattered through the pool, so the hardware prefetcher
 * loses the stream at every page edge: asked for up front, many misses are in flight at once. */
static inline void prefetch_kv(const void *k_cache, const void *v_cache, const int64_t *pages, int page_size,
                               int64_t p0, int64_t p1, int64_t kv_row, int64_t col, int elem, int bytes, int to_l2) {
    for (int64_t pos = p0; pos < p1; pos++) {
        const char *k = (const char *)k_cache + ((pages[pos / page_size] * page_size + pos % page_size) * kv_row + col) * elem;
        const char *v = (const char *)v_cache + (k - (const char *)k_cache);
        for (int b = 0; b < bytes; b += 64) {
            if (to_l2) {
                __builtin_prefetch(k + b, 0, 2);
                __builtin_prefetch(v + b, 0, 2);
            } else {
                __builtin_prefetch(k + b, 0, 3);
                __builtin_prefetch(v + b, 0, 3);
            }
        }
    }
}

#if HAVE_AVX512
#define BLOCK 16 /* positions per step: one vector of scores */

/* Lane i of the result: the sum of the 16 lanes of v[ORDER16[i]]. Four halving rounds of
 * shuffles and adds: 45 instructions for 16 sums, where 16 separate horizontal sums take ~130. */
static const int ORDER16[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15}; /* its own inverse */

static inline __m512 sum16(const __m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++) /* 256-bit halves */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit quarters */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
    for (int i = 0; i < 2; i++) /* pairs within 128 bits */
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[i], x[i + 2], 0x88), _mm512_shuffle_ps(x[i], x[i + 2], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

/* The 16 scores q . K[row at[t]] (unscaled) of one query head, K rows read from kv: for each
 * 32-dimension (bfloat16) or 16-dimension (float32) block of q, one partial-sum vector per
 * position, summed by sum16 at the end. at[] must list positions in ORDER16 order. bfloat16 pairs
 * go through vdpbf16ps: a product of two bfloat16 is exact in float32, sums are float32. */
static inline __m512 block_scores(const void *q, const void *kv, const int64_t at[16], int dtype, int head_dim) {
    __m512 part[16];
    for (int t = 0; t < 16; t++) part[t] = _mm512_setzero_ps();
    if (dtype == DTYPE_BF16) {
        const uint16_t *k16 = (const uint16_t *)kv;
        for (int d = 0; d < head_dim; d += 32) {
            const __mmask32 mask = head_dim - d >= 32 ? 0xffffffffu : (1u << (head_dim - d)) - 1;
            const __m512bh qb = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const uint16_t *)q + d);
            for (int t = 0; t < 16; t++)
                part[t] = _mm512_dpbf16_ps(part[t], qb, (__m512bh)_mm512_maskz_loadu_epi16(mask, k16 + at[t] + d));
        }
    } else {
        const float *k32 = (const float *)kv;
        for (int d = 0; d < head_dim; d += 16) {
            const __mmask16 mask = head_dim - d >= 16 ? 0xffffu : (__mmask16)((1u << (head_dim - d)) - 1);
            const __m512 qb = _mm512_maskz_loadu_ps(mask, (const float *)q + d);
            for (int t = 0; t < 16; t++)
                part[t] = _mm512_fmadd_ps(qb, _mm512_maskz_loadu_ps(mask, k32 + at[t] + d), part[t]);
        }
    }
    return sum16(part);
}

/* exp(x) for x <= 0, lane-wise: exp_nonpositive's polynomial, with 2^n applied by vscalefps. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* One task of paged_decode_attention, BLOCK positions at a time: for each KV head, the scores of
 * its query heads (one vector each), their online softmax, and the weighted sum of V.
 *
 * bfloat16 weights V through vdpbf16ps as well: two positions per instruction, their V rows
 * interleaved, the probabilities rounded to bfloat16 (as torch's own CPU flash attention does
 * for bfloat16). The interleave leaves each 32-dimension accumulator in the order
 * [d 0-3, 8-11, 16-19, 24-27 | d 4-7, 12-15, 20-23, 28-31]; the end undoes it. */
static void attend_avx512(const char *q, const void *k_cache, const void *v_cache, int dtype, const int64_t *pages,
                          int64_t len, int page_size, int h0, int h1, int group, int head_dim, int64_t kv_row,
                          float scale, float *res) {
    const int elem = dtype == DTYPE_BF16 ? 2 : 4, nq = (h1 - h0) * group, bytes = (h1 - h0) * head_dim * elem;
    const int64_t col = (int64_t)h0 * head_dim;
    const int stride = (head_dim + 31) & ~31; /* of acc per head: whole 32-dimension blocks */
    float acc[MAX_HEADS * MAX_HEAD_DIM], m[MAX_HEADS], l[MAX_HEADS];
    float prob[MAX_HEADS][BLOCK];
    uint32_t pairs[MAX_HEADS][BLOCK / 2]; /* bfloat16 probabilities of positions 2i, 2i+1 */
    int64_t at[BLOCK], at_k[BLOCK];        /* element offset of each position's token row; in ORDER16 */
    __m512i vpair[BLOCK / 2][MAX_HEAD_DIM / 16]; /* bfloat16 V rows of a KV head, two positions interleaved */
    memset(acc, 0, (size_t)nq * stride * sizeof(float));
    for (int j = 0; j < nq; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    prefetch_kv(k_cache, v_cache, pages, page_size, 0, len < BLOCK ? len : BLOCK, kv_row, col, elem, bytes, 0);
    prefetch_kv(k_cache, v_cache, pages, page_size, BLOCK, len < PREFETCH_L2 ? len : PREFETCH_L2, kv_row, col, elem,
                bytes, 1);
    for (int64_t start = 0; start < len; start += BLOCK) {
        const int n = (int)(len - start < BLOCK ? len - start : BLOCK);
        const __mmask16 valid = (__mmask16)((1u << n) - 1);
        for (int t = 0; t < BLOCK; t++) { /* past the end: the last row again, its scores masked */
            const int64_t pos = start + (t < n ? t : n - 1);
            at[t] = (pages[pos / page_size] * page_size + pos % page_size) * kv_row;
        }
        for (int t = 0; t < BLOCK; t++) at_k[t] = at[ORDER16[t]];
        const int64_t next = start + BLOCK, next_end = len < next + BLOCK ? len : next + BLOCK;
        prefetch_kv(k_cache, v_cache, pages, page_size, next, next_end, kv_row, col, elem, bytes, 0);
        for (int j = 0; j < nq; j++) { /* scores and the softmax update */
            const char *kv = (const char *)k_cache + (col + (int64_t)(j / group) * head_dim) * elem;
            const __m512 raw = block_scores(q + (int64_t)j * head_dim * elem, kv, at_k, dtype, head_dim);
            const __m512 s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY),
                                                  _mm512_mul_ps(raw, _mm512_set1_ps(scale)));
            const float mx = fmaxf(m[j], _mm512_reduce_max_ps(s));
            const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
            const float corr = _mm512_cvtss_f32(exp512(_mm512_set1_ps(m[j] - mx))); /* first block: 0 */
            l[j] = l[j] * corr + _mm512_reduce_add_ps(p);
            m[j] = mx;
            float *aj = acc + (int64_t)j * stride;
            for (int d = 0; d < stride; d++) aj[d] *= corr;
            if (dtype == DTYPE_BF16)
                _mm256_storeu_si256((__m256i *)pairs[j], (__m256i)_mm512_cvtneps_pbh(p));
            else
                _mm512_storeu_ps(prob[j], p);
        }
        for (int h = h0; h < h1; h++) { /* the weighted sum of V, accumulators in registers */
            const int64_t vcol = (int64_t)h * head_dim;
            const int j0 = (h - h0) * group, npairs = (n + 1) / 2;
            if (dtype == DTYPE_BF16) {
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
                    for (int d = 0; d < stride; d += 32) {
                        float *aj = acc + (int64_t)j * stride + d;
                        __m512 lo = _mm512_loadu_ps(aj), hi = _mm512_loadu_ps(aj + 16);
                        for (int i = 0; i < npairs; i++) {
                            const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pairs[j][i]);
                            lo = _mm512_dpbf16_ps(lo, pp, (__m512bh)vpair[i][d / 16]);
                            hi = _mm512_dpbf16_ps(hi, pp, (__m512bh)vpair[i][d / 16 + 1]);
                        }
                        _mm512_storeu_ps(aj, lo);
                        _mm512_storeu_ps(aj + 16, hi);
                    }
            } else {
                const float *v32 = (const float *)v_cache + vcol;
                for (int j = j0; j < j0 + group; j++)
                    for (int d = 0; d < head_dim; d += 16) {
                        const __mmask16 mask = head_dim - d >= 16 ? 0xffffu : (__mmask16)((1u << (head_dim - d)) - 1);
                        float *aj = acc + (int64_t)j * stride + d;
                        __m512 sum = _mm512_maskz_loadu_ps(mask, aj);
                        for (int t = 0; t < n; t++)
                            sum = _mm512_fmadd_ps(_mm512_set1_ps(prob[j][t]), _mm512_maskz_loadu_ps(mask, v32 + at[t] + d),
                                                  sum);
                        _mm512_mask_storeu_ps(aj, mask, sum);
                    }
            }
        }
    }
    for (int j = 0; j < nq; j++) {
        const float inv = len > 0 ? 1.0f / l[j] : 0.0f;
        const float *aj = acc + (int64_t)j * stride;
        float *rj = res + (int64_t)j * head_dim;
        for (int d = 0; d < head_dim; d++) {
            int from = d; /* where the bfloat16 interleave left dimension d */
            if (dtype == DTYPE_BF16) {
                const int base = d & ~31, i = d & 31;
                from = base + (i & 4 ? 16 : 0) + (i >> 3) * 4 + (i & 3);
            }
            rj[d] = aj[from] * inv;
        }
    }
}
#define attend attend_avx512

#else
/* One task of paged_decode_attention: SCORE_CHUNK positions at a time, all heads of a position
 * together (one contiguous read of its token row). */
static void attend_portable(const char *q, const void *k_cache, const void *v_cache, int dtype, const int64_t *pages,
                            int64_t len, int page_size, int h0, int h1, int group, int head_dim, int64_t kv_row,
                            float scale, float *res) {
    const int elem = dtype == DTYPE_BF16 ? 2 : 4, nq = (h1 - h0) * group, width = (h1 - h0) * head_dim;
    const int64_t col = (int64_t)h0 * head_dim;
    float qf[MAX_HEADS * MAX_HEAD_DIM], acc[MAX_HEADS * MAX_HEAD_DIM], kv[MAX_HEADS * MAX_HEAD_DIM];
    float scores[MAX_HEADS][SCORE_CHUNK], m[MAX_HEADS], l[MAX_HEADS];
    int64_t at[SCORE_CHUNK];
    load_vec(q, dtype, 0, nq * head_dim, qf);
    for (int i = 0; i < nq * head_dim; i++) qf[i] *= scale;
    memset(acc, 0, (size_t)nq * head_dim * sizeof(float));
    for (int j = 0; j < nq; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    for (int64_t start = 0; start < len; start += SCORE_CHUNK) {
        const int n = (int)(len - start < SCORE_CHUNK ? len - start : SCORE_CHUNK);
        for (int t = 0; t < n; t++)
            at[t] = (pages[(start + t) / page_size] * page_size + (start + t) % page_size) * kv_row + col;
        prefetch_kv(k_cache, v_cache, pages, page_size, start, start + n, kv_row, col, elem, width * elem, 0);
        for (int t = 0; t < n; t++) { /* scores of this chunk */
            load_vec(k_cache, dtype, at[t], width, kv);
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
            load_vec(v_cache, dtype, at[t], width, kv);
            for (int j = 0; j < nq; j++) {
                const float p = scores[j][t], *vj = kv + (int64_t)(j / group) * head_dim;
                float *aj = acc + (int64_t)j * head_dim;
#pragma omp simd
                for (int d = 0; d < head_dim; d++) aj[d] += p * vj[d];
            }
        }
    }
    for (int j = 0; j < nq; j++) {
        const float inv = len > 0 ? 1.0f / l[j] : 0.0f;
        for (int d = 0; d < head_dim; d++) res[(int64_t)j * head_dim + d] = acc[(int64_t)j * head_dim + d] * inv;
    }
}
#define attend attend_portable
#endif

/* Attention of decode rows over their paged KV.
 *
 * q: [*, num_heads, head_dim] with row stride q_row_stride (elements); row r of this call
 * reads q row q_rows[r] and writes out row q_rows[r] (out: [*, num_heads, head_dim], contiguous).
 * Row r attends positions [0, kv_lens[r]) of request slot slots[r]: position p lives at
 * KV row page_table[slots[r] * pt_stride + p / page_size] * page_size + p % page_size of
 * k_cache / v_cache ([pool tokens, kv_heads, head_dim]). The num_heads / kv_heads query heads
 * of one KV head share its K/V rows (GQA, HF's repeat_kv order). Returns 0, or -1 on bad sizes.
 *
 * k_new / v_new (or NULL): the rows' new K/V ([*, kv_heads, head_dim], rows k_new_stride /
 * v_new_stride elements apart, read at q_rows[r]), written first at the row's last position; a
 * task writes exactly the heads it then reads, so no task waits for another.
 *
 * A task is one row and a run of its KV heads. (One task per (row, head) read 1/kv_heads of every
 * token row and ran 3x slower once the KV was out of cache, as it always is in a forward.) With
 * few rows, heads are split so all threads work.
 */
int paged_decode_attention(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                           void *out, int dtype, const int64_t *q_rows, const int64_t *slots,
                           const int64_t *kv_lens, const int64_t *page_table, int64_t pt_stride, int64_t rows,
                           int num_heads, int kv_heads, int head_dim, int page_size, float scale,
                           const void *k_new, int64_t k_new_stride, const void *v_new, int64_t v_new_stride) {
    if (kv_heads < 1 || num_heads % kv_heads || num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM) return -1;
    const int group = num_heads / kv_heads;
    const int64_t kv_row = (int64_t)kv_heads * head_dim; /* elements per pool token */
    const int splits = rows < 2 * omp_get_max_threads() ? kv_heads : 1;
    const int elem = dtype == DTYPE_BF16 ? 2 : 4;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < rows * splits; task++) {
        const int64_t r = task / splits;
        const int h0 = (int)(task % splits) * kv_heads / splits, h1 = (int)(task % splits + 1) * kv_heads / splits;
        const int q0 = h0 * group, nq = (h1 - h0) * group;
        float res[MAX_HEADS * MAX_HEAD_DIM];
        if (k_new != NULL && kv_lens[r] > 0) {
            const int64_t pos = kv_lens[r] - 1, *pages = page_table + slots[r] * pt_stride;
            const int64_t at = ((pages[pos / page_size] * page_size + pos % page_size) * kv_row + (int64_t)h0 * head_dim);
            const size_t bytes = (size_t)(h1 - h0) * head_dim * elem;
            memcpy((char *)k_cache + at * elem, (const char *)k_new + (q_rows[r] * k_new_stride + (int64_t)h0 * head_dim) * elem, bytes);
            memcpy((char *)v_cache + at * elem, (const char *)v_new + (q_rows[r] * v_new_stride + (int64_t)h0 * head_dim) * elem, bytes);
        }
        const int64_t next = task + omp_get_num_threads(); /* most likely this thread's next task */
        if (next < rows * splits) {
            const int64_t r2 = next / splits;
            const int g0 = (int)(next % splits) * kv_heads / splits, g1 = (int)(next % splits + 1) * kv_heads / splits;
            prefetch_kv(k_cache, v_cache, page_table + slots[r2] * pt_stride, page_size, 0,
                        kv_lens[r2] < PREFETCH_L2 ? kv_lens[r2] : PREFETCH_L2, kv_row, (int64_t)g0 * head_dim, elem,
                        (g1 - g0) * head_dim * elem, 1);
        }
        attend((const char *)q + (q_rows[r] * q_row_stride + (int64_t)q0 * head_dim) * elem, k_cache, v_cache, dtype,
               page_table + slots[r] * pt_stride, kv_lens[r], page_size, h0, h1, group, head_dim, kv_row, scale, res);
        const int64_t o_off = (q_rows[r] * num_heads + q0) * head_dim;
        if (dtype == DTYPE_BF16) {
            uint16_t *dst = (uint16_t *)out + o_off;
            for (int i = 0; i < nq * head_dim; i++) dst[i] = f32_to_bf16(res[i]);
        } else {
            memcpy((float *)out + o_off, res, (size_t)nq * head_dim * sizeof(float));
        }
    }
    return 0;
}

/* ---- the dense layer's small ops, each one call instead of 2-8 torch ops ----
 *
 * Each reproduces its torch expression's roundings (noted per function), so swapping one in keeps
 * the model's numbers. Rows go to threads only when there are enough of them to pay for it. */
#define PARALLEL_ROWS 16
#define PIECE 256 /* elements per step: each op converts a piece to float32, computes, stores back */

/* n float32 values stored to a float32 or bfloat16 tensor at element ``offset``. */
static inline void store_vec(void *base, int dtype, int64_t offset, int n, const float *src) {
    if (dtype == DTYPE_BF16) {
        uint16_t *dst = (uint16_t *)base + offset;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)base + offset, src, (size_t)n * sizeof(float));
    }
}

/* v as a torch op in ``dtype`` would leave it: rounded to bfloat16 (and back), or as is. */
static inline void round_vec(int dtype, float *v, int n) {
    if (dtype != DTYPE_BF16) return;
#pragma omp simd
    for (int i = 0; i < n; i++) v[i] = bf16_to_f32(f32_to_bf16(v[i]));
}

/* out[r] = w * (x[r] * rsqrt(mean(x[r]^2) + eps)), statistics in float32 (HF's RMSNorm). bfloat16
 * rounds x * rsqrt(...) to bfloat16 before the weight multiplies it, as HF's `.to(dtype)` does.
 * x rows are x_stride elements apart; out is contiguous [rows, dim]. */
void rms_norm(const void *x, int64_t x_stride, const void *w, void *out, int64_t rows, int dim, float eps, int dtype) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float v[PIECE], wv[PIECE], sq = 0.0f;
        for (int i0 = 0; i0 < dim; i0 += PIECE) {
            const int n = dim - i0 < PIECE ? dim - i0 : PIECE;
            load_vec(x, dtype, r * x_stride + i0, n, v);
#pragma omp simd reduction(+ : sq)
            for (int i = 0; i < n; i++) sq += v[i] * v[i];
        }
        const float inv = 1.0f / sqrtf(sq / (float)dim + eps);
        for (int i0 = 0; i0 < dim; i0 += PIECE) {
            const int n = dim - i0 < PIECE ? dim - i0 : PIECE;
            load_vec(x, dtype, r * x_stride + i0, n, v);
            load_vec(w, dtype, i0, n, wv);
            for (int i = 0; i < n; i++) v[i] *= inv;
            round_vec(dtype, v, n);
            for (int i = 0; i < n; i++) v[i] *= wv[i];
            store_vec(out, dtype, r * dim + i0, n, v);
        }
    }
}

/* In place, heads [0, heads) of each row of x ([rows, >= heads, head_dim], rows x_stride apart):
 * x = x * cos[r] + cat(x2, x1) * signed_sin[r] (HF's rotate_half with the sign folded into sin, as
 * RotaryCache stores it; cos, sin: [rows, head_dim] in x's dtype, gathered at the rows' positions).
 * Each product and the sum round to the dtype, as the three torch ops do. */
void rotary(void *x, int64_t x_stride, int64_t rows, int heads, int head_dim, const void *cos, const void *sin,
            int dtype) {
    const int half = head_dim / 2;
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float c[MAX_HEAD_DIM], sn[MAX_HEAD_DIM], v[MAX_HEAD_DIM], a[MAX_HEAD_DIM], b[MAX_HEAD_DIM];
        load_vec(cos, dtype, r * head_dim, head_dim, c);
        load_vec(sin, dtype, r * head_dim, head_dim, sn);
        for (int h = 0; h < heads; h++) {
            const int64_t at = r * x_stride + (int64_t)h * head_dim;
            load_vec(x, dtype, at, head_dim, v);
            for (int i = 0; i < half; i++) {
                a[i] = v[i] * c[i];
                a[i + half] = v[i + half] * c[i + half];
                b[i] = v[i + half] * sn[i];
                b[i + half] = v[i] * sn[i + half];
            }
            round_vec(dtype, a, head_dim);
            round_vec(dtype, b, head_dim);
            for (int i = 0; i < head_dim; i++) a[i] += b[i];
            store_vec(x, dtype, at, head_dim, a);
        }
    }
}

/* out[r, i] = silu(gate[r, i]) * up[r, i] of gate_up rows [gate (inner) | up (inner)], silu's result
 * rounded to the dtype before the product, as torch's two ops do. */
void silu_mul(const void *gate_up, void *out, int64_t rows, int inner, int dtype) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float g[PIECE], u[PIECE];
        for (int i0 = 0; i0 < inner; i0 += PIECE) {
            const int n = inner - i0 < PIECE ? inner - i0 : PIECE;
            load_vec(gate_up, dtype, r * 2 * inner + i0, n, g);
            load_vec(gate_up, dtype, r * 2 * inner + inner + i0, n, u);
#if HAVE_AVX512 /* gcc leaves the scalar loop below unvectorized */
            for (int i = 0; i < n; i += 16) {
                const __mmask16 m = n - i >= 16 ? 0xffffu : (__mmask16)((1u << (n - i)) - 1);
                const __m512 x = _mm512_maskz_loadu_ps(m, g + i), one = _mm512_set1_ps(1.0f);
                const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
                const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
                const __m512 exp_minus_x = _mm512_mask_div_ps(e, neg, one, e);
                _mm512_mask_storeu_ps(g + i, m, _mm512_div_ps(x, _mm512_add_ps(one, exp_minus_x)));
            }
#else
            for (int i = 0; i < n; i++) {
                const float e = exp_nonpositive(-fabsf(g[i])); /* exp(-g) is e for g >= 0, 1 / e below */
                g[i] = g[i] / (1.0f + (g[i] < 0.0f ? 1.0f / e : e));
            }
#endif
            round_vec(dtype, g, n);
            for (int i = 0; i < n; i++) g[i] *= u[i];
            store_vec(out, dtype, r * inner + i0, n, g);
        }
    }
}

/* out = bf16(x W^T (+ bias) (+ residual)) of one bfloat16 row x [k] and W [n_out, k] row-major: a
 * decode step's matmul at one row, which only streams W. Sums in float32 and one rounding at the
 * end, as oneDNN's matmul with its add post-op. With AVX-512, 16 weight rows at a time (their dot
 * products summed by sum16), threads taking contiguous blocks: each streams its share of W front
 * to back, without the per-call start-up that costs oneDNN ~30% on matrices of ~1 MB. */
void gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, const uint16_t *residual, uint16_t *out,
               int n_out, int k) {
#if HAVE_AVX512
    const int blocks = (n_out + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < blocks; b++) {
        const int n0 = b * 16;
        const uint16_t *rows[16];
        for (int t = 0; t < 16; t++) { /* past the end: the last row again, its sum not stored */
            const int n = n0 + ORDER16[t];
            rows[t] = w + (int64_t)(n < n_out ? n : n_out - 1) * k;
        }
        __m512 acc[16];
        for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
        for (int d = 0; d < k; d += 32) {
            const __mmask32 mask = k - d >= 32 ? 0xffffffffu : (1u << (k - d)) - 1;
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + d);
            for (int t = 0; t < 16; t++)
                acc[t] = _mm512_dpbf16_ps(acc[t], xv, (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[t] + d));
        }
        __m512 s = sum16(acc);
        const __mmask16 valid = n_out - n0 >= 16 ? 0xffffu : (__mmask16)((1u << (n_out - n0)) - 1);
        if (bias != NULL)
            s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, bias + n0)), 16)));
        if (residual != NULL)
            s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, residual + n0)), 16)));
        _mm256_mask_storeu_epi16(out + n0, valid, (__m256i)_mm512_cvtneps_pbh(s));
    }
#else
#pragma omp parallel for schedule(static)
    for (int n = 0; n < n_out; n++) {
        float s = 0.0f;
        for (int d = 0; d < k; d++) s += bf16_to_f32(x[d]) * bf16_to_f32(w[(int64_t)n * k + d]);
        if (bias != NULL) s += bf16_to_f32(bias[n]);
        if (residual != NULL) s += bf16_to_f32(residual[n]);
        out[n] = f32_to_bf16(s);
    }
#endif
}

/* out[r] = the first index of row r's largest value (x: [rows, n], rows row_stride apart): the
 * greedy pick. NaN-free rows assumed (a NaN is never picked, where torch's max would pick it). */
void argmax_rows(const void *x, int64_t row_stride, int64_t rows, int n, int dtype, int64_t *out) {
#pragma omp parallel for if (rows >= 4)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * row_stride;
#if HAVE_AVX512
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i best_at = _mm512_setzero_si512();
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (int i = 0; i < n; i += 16) {
            const __mmask16 m = n - i >= 16 ? 0xffffu : (__mmask16)((1u << (n - i)) - 1);
            const __m512 v =
                dtype == DTYPE_BF16
                    ? _mm512_castsi512_ps(_mm512_slli_epi32(
                          _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)x + base + i)), 16))
                    : _mm512_maskz_loadu_ps(m, (const float *)x + base + i);
            const __mmask16 better = _mm512_mask_cmp_ps_mask(m, v, best, _CMP_GT_OQ); /* strictly: first wins */
            best = _mm512_mask_mov_ps(best, better, v);
            best_at = _mm512_mask_mov_epi32(best_at, better, at);
            at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
        }
        const __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)), _CMP_EQ_OQ);
        out[r] = top ? _mm512_mask_reduce_min_epi32(top, best_at) : 0;
#else
        float best = -INFINITY;
        int64_t best_at = 0;
        for (int i = 0; i < n; i++) {
            const float v = dtype == DTYPE_BF16 ? bf16_to_f32(((const uint16_t *)x)[base + i]) : ((const float *)x)[base + i];
            if (v > best) {
                best = v;
                best_at = i;
            }
        }
        out[r] = best_at;
#endif
    }
}

/* 1 where this build has the AVX-512 path (attend_avx512), 0 for the portable one. */
int vector_path(void) { return HAVE_AVX512; }
