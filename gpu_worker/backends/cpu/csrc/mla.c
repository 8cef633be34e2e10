/* Latent attention's absorbed decode (models/mla.py): every query head of a decode row against one
 * shared KV row a position, read in place through the page table, the value the same row's first
 * v_dim values. paged_decode_attention takes heads of up to MAX_HEAD_DIM and MAX_HEADS (a real
 * latent row, 576 values, is past both) and reads each row once per group of query heads, for K and
 * again for V; here a block of positions is widened once and every head scores and accumulates from
 * it, so the pool is read once a row whatever the head count (DeepSeek-V3: 128 heads).
 *
 * Tasks are spans of one row's positions: a long row is split so that few rows still keep every
 * thread busy. Each task leaves per head its running max, its sum of exponentials and its
 * unnormalised float32 sum of values; a second pass merges a row's spans and writes the output. */
#include <stdlib.h>

#include "quant.h"
#include "rivulet_kernels.h"

#define LATENT_BLOCK 16     /* positions widened to float32 at once, every head reading them */
#define LATENT_MIN_SPAN 128 /* positions a task takes at least: below it the merge outweighs the split */

/* A float8 e4m3fn pool byte (--kv-cache-dtype fp8_e4m3: sign, 4 exponent bits of bias 7, 3 mantissa
 * bits; no infinities, 0x7f and 0xff NaN) as float32, exactly as torch's .to(float32) reads it. The
 * magnitude bits shifted to float32's exponent and mantissa place, plus (127 - 7) in the exponent,
 * are a normal value's float32 bits; a subnormal (exponent 0) is its mantissa times 2^-9, converted
 * as an integer so that no float32 subnormal (a microcode assist on some CPUs) is ever formed. */
#define F8_REBIAS (120u << 23)
#define F8_SUBNORMAL 0x1p-9f

static inline float f8e4m3_to_f32(uint8_t b) {
    const uint32_t mag = b & 0x7fu, bits = (mag << 20) + F8_REBIAS;
    float f;
    memcpy(&f, &bits, sizeof f);
    f = mag < 8 ? (float)mag * F8_SUBNORMAL : f;
    f = mag == 0x7f ? NAN : f;
    return b & 0x80u ? -f : f;
}

/* n pool bytes from element ``offset`` on, as float32, 16 or 8 lanes at a time where the build has them. */
static void load_f8(const uint8_t *src, int n, float *dst) {
    int i = 0;
#if HAVE_AVX512
    const __m512i low7 = _mm512_set1_epi32(0x7f), rebias = _mm512_set1_epi32((int)F8_REBIAS);
    for (; i + 16 <= n; i += 16) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        const __m512i mag = _mm512_and_si512(b, low7);
        __m512 f = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), rebias));
        const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(F8_SUBNORMAL));
        f = _mm512_mask_mov_ps(f, _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), sub);
        f = _mm512_mask_mov_ps(f, _mm512_cmpeq_epi32_mask(mag, low7), _mm512_set1_ps(NAN));
        const __m512i sign = _mm512_slli_epi32(_mm512_srli_epi32(b, 7), 31);
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign)));
    }
#elif HAVE_AVX2
    const __m256i low7 = _mm256_set1_epi32(0x7f), rebias = _mm256_set1_epi32((int)F8_REBIAS);
    for (; i + 8 <= n; i += 8) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + i)));
        const __m256i mag = _mm256_and_si256(b, low7);
        __m256 f = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), rebias));
        const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(F8_SUBNORMAL));
        f = _mm256_blendv_ps(f, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
        f = _mm256_blendv_ps(f, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, low7)));
        const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(b, 7), 31);
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(f), sign)));
    }
#endif
    for (; i < n; i++) dst[i] = f8e4m3_to_f32(src[i]);
}

/* n values of a pool row from element ``offset`` on, as float32: load_vec's dtypes and float8 e4m3. */
static inline void load_latent(const void *cache, int kv_dtype, int64_t offset, int n, float *dst) {
    if (kv_dtype == DTYPE_F8E4M3) {
        load_f8((const uint8_t *)cache + offset, n, dst);
    } else {
        load_vec(cache, kv_dtype, offset, n, dst);
    }
}

/* One task's spans per head: [heads][v_dim + 2], the value sum then the max and the exponentials' sum. */
static void attend_span(const float *qf, const void *cache, int kv_dtype, const int64_t *pages, int page_size,
                        int64_t p0, int64_t p1, int heads, int dim, int v_dim, float scale, float *kv,
                        float *part) {
    const int64_t stride = v_dim + 2;
    for (int h = 0; h < heads; h++) {
        float *acc = part + h * stride;
        for (int i = 0; i < v_dim; i++) acc[i] = 0.0f;
        acc[v_dim] = -INFINITY;
        acc[v_dim + 1] = 0.0f;
    }
    for (int64_t b = p0; b < p1; b += LATENT_BLOCK) {
        const int n = (int)(p1 - b < LATENT_BLOCK ? p1 - b : LATENT_BLOCK);
        for (int j = 0; j < n; j++) {
            const int64_t pos = b + j, row = pages[pos / page_size] * page_size + pos % page_size;
            load_latent(cache, kv_dtype, row * dim, dim, kv + (int64_t)j * dim);
        }
        for (int h = 0; h < heads; h++) {
            const float *qh = qf + (int64_t)h * dim;
            float *acc = part + h * stride, s[LATENT_BLOCK], top = acc[v_dim];
            for (int j = 0; j < n; j++) {
                const float *kj = kv + (int64_t)j * dim;
                float d = 0.0f;
#pragma omp simd reduction(+ : d)
                for (int i = 0; i < dim; i++) d += qh[i] * kj[i];
                s[j] = d * scale;
                top = max_f(top, s[j]);
            }
            const float corr = exp_nonpositive(acc[v_dim] - top);
            float sum = acc[v_dim + 1] * corr;
#pragma omp simd
            for (int i = 0; i < v_dim; i++) acc[i] *= corr;
            for (int j = 0; j < n; j++) {
                const float p = exp_nonpositive(s[j] - top), *vj = kv + (int64_t)j * dim;
                sum += p;
#pragma omp simd
                for (int i = 0; i < v_dim; i++) acc[i] += p * vj[i];
            }
            acc[v_dim] = top;
            acc[v_dim + 1] = sum;
        }
    }
}

/* Row r's output per head from its spans' parts [spans][heads][v_dim + 2]. */
static void merge_spans(const float *parts, int64_t spans, int heads, int v_dim, float *o, void *out, int dtype,
                        int64_t offset) {
    const int64_t stride = v_dim + 2, span_size = heads * stride;
    for (int h = 0; h < heads; h++) {
        float top = -INFINITY, total = 0.0f;
        for (int64_t s = 0; s < spans; s++) top = max_f(top, parts[s * span_size + h * stride + v_dim]);
        for (int i = 0; i < v_dim; i++) o[i] = 0.0f;
        for (int64_t s = 0; s < spans; s++) {
            const float *acc = parts + s * span_size + h * stride;
            const float w = exp_nonpositive(acc[v_dim] - top);
            total += w * acc[v_dim + 1];
#pragma omp simd
            for (int i = 0; i < v_dim; i++) o[i] += w * acc[i];
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
#pragma omp simd
        for (int i = 0; i < v_dim; i++) o[i] *= inv;
        store_vec(out, dtype, offset + (int64_t)h * v_dim, v_dim, o);
    }
}

/* Each row's span length: about two tasks a thread over all rows' positions, none under LATENT_MIN_SPAN. */
static int64_t span_length(const int64_t *kv_lens, int64_t rows) {
    int64_t total = 0;
    for (int64_t r = 0; r < rows; r++) total += kv_lens[r] > 0 ? kv_lens[r] : 0;
    const int64_t tasks = 2 * (int64_t)omp_get_max_threads(), span = (total + tasks - 1) / tasks;
    return span < LATENT_MIN_SPAN ? LATENT_MIN_SPAN : span;
}

int latent_decode_attention(const void *q, int64_t q_row_stride, const void *cache, void *out,
                            int64_t out_row_stride, int dtype, int kv_dtype, const int64_t *q_rows,
                            const int64_t *req_pool_idx, const int64_t *kv_lens, const int64_t *page_table,
                            int64_t pt_stride, int64_t rows, int num_heads, int dim, int v_dim, int page_size,
                            float scale) {
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return RV_ERR_DTYPE;
    if (kv_dtype != DTYPE_F32 && kv_dtype != DTYPE_BF16 && kv_dtype != DTYPE_F16 && kv_dtype != DTYPE_F8E4M3)
        return RV_ERR_DTYPE;
    if (num_heads < 1 || dim < 1 || v_dim < 1 || v_dim > dim || page_size < 1) return RV_ERR_HEADS;
    if (rows < 1) return RV_OK;
    const int64_t span = span_length(kv_lens, rows);
    /* row r's tasks: [first[r], first[r + 1]); task t's row: row_of[t] */
    int64_t *first = malloc((size_t)(rows + 1) * sizeof(int64_t)), tasks = 0;
    if (first == NULL) return RV_ERR_NO_MEMORY;
    first[0] = 0;
    for (int64_t r = 0; r < rows; r++) first[r + 1] = first[r] + (kv_lens[r] > 0 ? (kv_lens[r] + span - 1) / span : 0);
    tasks = first[rows];
    const int64_t part_size = (int64_t)num_heads * (v_dim + 2);
    float *parts = malloc((size_t)(tasks > 0 ? tasks : 1) * (size_t)part_size * sizeof(float));
    int64_t *row_of = malloc((size_t)(tasks > 0 ? tasks : 1) * sizeof(int64_t));
    if (parts == NULL || row_of == NULL) {
        free(parts);
        free(row_of);
        free(first);
        return RV_ERR_NO_MEMORY;
    }
    int failed = 0; /* a thread's scratch not allocated */
    for (int64_t r = 0; r < rows; r++)
        for (int64_t t = first[r]; t < first[r + 1]; t++) row_of[t] = r;
#pragma omp parallel if (tasks > 1) reduction(| : failed)
    {
        float *qf = malloc(((size_t)num_heads + LATENT_BLOCK) * (size_t)dim * sizeof(float));
        failed |= qf == NULL;
#pragma omp for schedule(dynamic)
        for (int64_t t = 0; t < tasks; t++) {
            if (qf == NULL) continue;
            const int64_t r = row_of[t], p0 = (t - first[r]) * span, end = p0 + span;
            load_vec(q, dtype, q_rows[r] * q_row_stride, num_heads * dim, qf);
            attend_span(qf, cache, kv_dtype, page_table + req_pool_idx[r] * pt_stride, page_size, p0,
                        end < kv_lens[r] ? end : kv_lens[r], num_heads, dim, v_dim, scale,
                        qf + (int64_t)num_heads * dim, parts + t * part_size);
        }
        free(qf);
    }
    if (!failed) {
#pragma omp parallel if (rows > 1) reduction(| : failed)
    {
        float *o = malloc((size_t)v_dim * sizeof(float));
        failed |= o == NULL;
#pragma omp for schedule(dynamic)
        for (int64_t r = 0; r < rows; r++) {
            if (o == NULL) continue;
            merge_spans(parts + first[r] * part_size, first[r + 1] - first[r], num_heads, v_dim, o, out, dtype,
                        q_rows[r] * out_row_stride);
        }
        free(o);
    }
    }
    free(row_of);
    free(parts);
    free(first);
    return failed ? RV_ERR_NO_MEMORY : RV_OK;
}

/* The absorbed form's per-head products on kv_b's GGUF blocks (a file's attn_k_b: q_nope into latent
 * space; attn_v_b: the attended latents to each head's values), all heads in one region where a
 * quant_matmul a head would open one each. Every head's rows are quantized as quant_matmul quantizes
 * them, then the (head, column panel) units are shared out; each output element is quant_panel's, as
 * quant_matmul's is. */
int latent_heads_matmul(int type, const uint8_t *w, int64_t heads, int64_t n, int64_t k, const void *x,
                        int64_t x_stride, int64_t x_head, int64_t rows, void *scratch, void *y, int64_t y_stride,
                        int64_t y_head, int dtype) {
    const qtype_ops *ops = quant_ops(type);
    if (ops == NULL || (type & (QTYPE_X8 | QTYPE_A8))) return RV_ERR_TYPE;
    if (k <= 0 || k % ops->block != 0) return RV_ERR_K;
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return RV_ERR_DTYPE;
    if (heads <= 0 || n <= 0 || rows <= 0) return RV_OK;
    const int64_t nb = k / ops->block, wrb = nb * ops->block_bytes, xrb = nb * ops->act_block_bytes;
    const int64_t panel = quant_panel_cols(ops, wrb), panels = (n + panel - 1) / panel;
    const size_t esize = dtype == DTYPE_F32 ? sizeof(float) : sizeof(uint16_t);
    uint8_t *xq = (uint8_t *)scratch;
    int failed = 0;
#pragma omp parallel if (heads * rows * n * k >= 1 << 16) reduction(| : failed)
    {
        float *xf = malloc((size_t)k * sizeof(float));
        failed |= xf == NULL;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < heads * rows; i++) { /* i: head i / rows, row i % rows */
            if (xf == NULL) continue;
            load_vec(x, dtype, i % rows * x_stride + i / rows * x_head, (int)k, xf);
            ops->quantize_act(xf, k, xq + i * xrb);
        }
        free(xf);
#pragma omp for schedule(static)
        for (int64_t u = 0; u < heads * panels; u++) {
            const int64_t h = u / panels, p0 = u % panels * panel, pw = n - p0 < panel ? n - p0 : panel;
            quant_panel(ops, w + h * n * wrb, wrb, nb, p0, pw, xq + h * rows * xrb, xrb, 0, rows,
                        (char *)y + (size_t)(h * y_head) * esize, y_stride, dtype, NULL, 0);
        }
    }
    return failed ? RV_ERR_NO_MEMORY : RV_OK;
}
