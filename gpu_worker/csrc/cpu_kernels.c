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

#define DTYPE_F32 0
#define DTYPE_BF16 1
#define SCORE_CHUNK 64 /* KV positions scored before their softmax update */
#define MAX_HEADS 64 /* query heads (larger: the caller uses torch) */
#define MAX_HEAD_DIM 256

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                           /* round to nearest even */
    return (uint16_t)(u >> 16);
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

/* exp(x) for x <= 0 with relative error ~2e-7 (Cephes' expf polynomial), written so that it
 * vectorizes under omp simd, where libm's expf does not. */
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

/* Attention of decode rows over their paged KV.
 *
 * q: [*, num_heads, head_dim] with row stride q_row_stride (elements); row r of this call
 * reads q row q_rows[r] and writes out row q_rows[r] (out: [*, num_heads, head_dim], contiguous).
 * Row r attends positions [0, kv_lens[r]) of request slot slots[r]: position p lives at
 * KV row page_table[slots[r] * pt_stride + p / page_size] * page_size + p % page_size of
 * k_cache / v_cache ([pool tokens, kv_heads, head_dim]). The num_heads / kv_heads query heads
 * of one KV head share its K/V rows (GQA, HF's repeat_kv order). Returns 0, or -1 on bad sizes.
 *
 * A task is one row and a run of its KV heads, reading each position's K (then V) of those heads
 * as one contiguous run, front to back within a page: the access the hardware prefetcher follows.
 * (One task per (row, head) read 1/kv_heads of every token row and ran 3x slower once the KV was
 * out of cache, as it always is in a forward.) With few rows, heads are split so all threads work.
 */
int paged_decode_attention(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                           void *out, int dtype, const int64_t *q_rows, const int64_t *slots,
                           const int64_t *kv_lens, const int64_t *page_table, int64_t pt_stride, int64_t rows,
                           int num_heads, int kv_heads, int head_dim, int page_size, float scale) {
    if (kv_heads < 1 || num_heads % kv_heads || num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM) return -1;
    const int group = num_heads / kv_heads;
    const int64_t kv_row = (int64_t)kv_heads * head_dim; /* elements per pool token */
    const int splits = rows < 2 * omp_get_max_threads() ? kv_heads : 1;
    const int elem = dtype == DTYPE_BF16 ? 2 : 4;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < rows * splits; task++) {
        const int64_t r = task / splits;
        const int h0 = (int)(task % splits) * kv_heads / splits, h1 = (int)(task % splits + 1) * kv_heads / splits;
        const int q0 = h0 * group, nq = (h1 - h0) * group, width = (h1 - h0) * head_dim;
        const int64_t len = kv_lens[r];
        const int64_t *pages = page_table + slots[r] * pt_stride;
        float qf[MAX_HEADS * MAX_HEAD_DIM], acc[MAX_HEADS * MAX_HEAD_DIM], kv[MAX_HEADS * MAX_HEAD_DIM];
        float scores[MAX_HEADS][SCORE_CHUNK], m[MAX_HEADS], l[MAX_HEADS];
        load_vec(q, dtype, q_rows[r] * q_row_stride + (int64_t)q0 * head_dim, nq * head_dim, qf);
        for (int i = 0; i < nq * head_dim; i++) qf[i] *= scale;
        memset(acc, 0, (size_t)nq * head_dim * sizeof(float));
        for (int j = 0; j < nq; j++) {
            m[j] = -INFINITY;
            l[j] = 0.0f;
        }
        for (int64_t start = 0; start < len; start += SCORE_CHUNK) {
            const int n = (int)(len - start < SCORE_CHUNK ? len - start : SCORE_CHUNK);
            for (int t = 0; t < n; t++) { /* scores of this chunk */
                const int64_t pos = start + t;
                const int64_t loc = pages[pos / page_size] * page_size + pos % page_size;
                if (pos % page_size == 0 && pos + page_size < len) /* the next page: its first token row */
                    __builtin_prefetch((const char *)k_cache + (pages[pos / page_size + 1] * page_size * kv_row) * elem);
                load_vec(k_cache, dtype, loc * kv_row + (int64_t)h0 * head_dim, width, kv);
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
                const int64_t pos = start + t;
                const int64_t loc = pages[pos / page_size] * page_size + pos % page_size;
                load_vec(v_cache, dtype, loc * kv_row + (int64_t)h0 * head_dim, width, kv);
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
            const int64_t o_off = (q_rows[r] * num_heads + q0 + j) * head_dim;
            const float *aj = acc + (int64_t)j * head_dim;
            if (dtype == DTYPE_BF16) {
                uint16_t *dst = (uint16_t *)out + o_off;
                for (int d = 0; d < head_dim; d++) dst[d] = f32_to_bf16(aj[d] * inv);
            } else {
                float *dst = (float *)out + o_off;
                for (int d = 0; d < head_dim; d++) dst[d] = aj[d] * inv;
            }
        }
    }
    return 0;
}
