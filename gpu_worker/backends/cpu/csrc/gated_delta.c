/* The gated delta rule of Gated DeltaNet layers (Qwen3.5, Qwen3-Next) over a pool of float32
 * recurrent states, and the causal depthwise conv1d in front of it with its own state pool.
 *
 * Per value head h of a request, the state S [d_k, d_v] follows, token by token,
 *     S <- a S + k delta^T,  delta = beta (v - a S^T k),  o = S^T q     (a = exp(g), g <= 0)
 * with q, k the token's key head h / (v_heads / k_heads) (each key head serves consecutive value
 * heads), L2-normed and q scaled when asked (HF's use_qk_l2norm_in_kernel). The state stays float32
 * whatever the activations' dtype; q, k, v and the output are float32 or bfloat16, all math float32.
 *
 * Decode reads S twice (S^T k with S^T q, then the update), the least a token can: the output comes
 * from the first read, o = a S^T q + (k . q) delta, not from a third pass over the new state.
 * Prefill runs the chunked form over blocks of CHUNK tokens: within a block the token-by-token
 * updates fold into a unit lower-triangular system, so the state is read and written once per
 * block, and the work is small matrix products (register-tiled below) instead of T passes over S.
 * Both are the recurrence to float32 rounding (tests/gpu_worker/test_gated_delta_kernels.py). */
#include "common.h"
#include "rivulet_kernels.h"
#include <stdlib.h>

#define CHUNK 64           /* prefill's block of tokens */
#define L2NORM_EPS 1e-6f   /* HF's l2norm (and fla's) */
#define MAX_CONV_KERNEL 8  /* taps of causal_conv1d */
#define CONV_BLOCK 64      /* channels per conv task */
#define CONV_WIDE 512      /* channels per conv task of many tokens (conv_block) */
#ifdef __AVX512F__ /* a gemm tile's rows and columns: 16 of the 32 vector registers accumulate */
#define TM 8
#define TN 32
#else /* 8 of the 16 */
#define TM 4
#define TN 16
#endif

static inline float load_one(const void *base, int dtype, int64_t at) {
    return dtype == DTYPE_BF16 ? bf16_to_f32(((const uint16_t *)base)[at]) : ((const float *)base)[at];
}

/* n elements of q or k as float32, L2-normed (x * rsqrt(sum x^2 + eps), HF's l2norm) when asked,
 * then times scale (HF scales after the norm: two roundings, as here). */
static void load_head(const void *src, int dtype, int64_t at, int n, float *dst, int l2norm, float scale) {
    load_vec(src, dtype, at, n, dst);
    if (l2norm) {
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int i = 0; i < n; i++) sq += dst[i] * dst[i];
        const float inv = 1.0f / sqrtf(sq + L2NORM_EPS);
        for (int i = 0; i < n; i++) dst[i] *= inv;
    }
    if (scale != 1.0f)
        for (int i = 0; i < n; i++) dst[i] *= scale;
}

/* out[i] = exp(x[i]) for x[i] <= 0: common.h's polynomial (about 2e-7 relative), vectorized. */
static void exp_nonpositive_vec(const float *x, float *out, int n) {
    int i = 0;
#if HAVE_AVX512
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, exp512(_mm512_loadu_ps(x + i)));
#elif HAVE_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, exp256(_mm256_loadu_ps(x + i)));
#endif
    for (; i < n; i++) out[i] = exp_nonpositive(x[i]);
}

/* The arguments both forms share, checked once. */
static int check_heads(int dtype, int g_dtype, int beta_dtype, int k_heads, int v_heads, int dk, int dv) {
    if ((dtype != DTYPE_F32 && dtype != DTYPE_BF16) || (g_dtype != DTYPE_F32 && g_dtype != DTYPE_BF16) ||
        (beta_dtype != DTYPE_F32 && beta_dtype != DTYPE_BF16))
        return RV_ERR_DTYPE;
    if (k_heads < 1 || v_heads < k_heads || v_heads % k_heads != 0 || dk < 1 || dv < 1 || dk > MAX_HEAD_DIM ||
        dv > MAX_HEAD_DIM)
        return RV_ERR_HEADS;
    return RV_OK;
}

/* One token of one value head: S updated in place, o [dv] written (float32). */
static void decode_head(float *S, const float *q, const float *k, const float *v, float g, float beta, int dk, int dv,
                        float *o) {
    float sk[MAX_HEAD_DIM], sq[MAX_HEAD_DIM], delta[MAX_HEAD_DIM];
    const float a = expf(g);
    float kq = 0.0f;
    for (int j = 0; j < dv; j++) sk[j] = sq[j] = 0.0f;
    for (int i = 0; i < dk; i++) {
        const float *s = S + (int64_t)i * dv;
        const float ki = k[i], qi = q[i];
        kq += ki * qi;
#pragma omp simd
        for (int j = 0; j < dv; j++) {
            sk[j] += ki * s[j];
            sq[j] += qi * s[j];
        }
    }
    for (int j = 0; j < dv; j++) {
        delta[j] = beta * (v[j] - a * sk[j]);
        o[j] = a * sq[j] + kq * delta[j];
    }
    for (int i = 0; i < dk; i++) {
        float *s = S + (int64_t)i * dv;
        const float ki = k[i];
#pragma omp simd
        for (int j = 0; j < dv; j++) s[j] = a * s[j] + ki * delta[j];
    }
}

int gated_delta_decode(const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                       int64_t v_stride, int dtype, const void *g, int64_t g_stride, int g_dtype, const void *beta,
                       int64_t beta_stride, int beta_dtype, float *state, const int64_t *slots,
                       const uint8_t *fresh, void *out, int64_t rows, int k_heads, int v_heads, int dk, int dv,
                       int tiled, int l2norm, float scale) {
    const int status = check_heads(dtype, g_dtype, beta_dtype, k_heads, v_heads, dk, dv);
    if (status != RV_OK) return status;
    const int group = v_heads / k_heads;
    const int64_t head_state = (int64_t)dk * dv;
#pragma omp parallel for collapse(2) schedule(static) if (rows * v_heads * head_state >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        for (int h = 0; h < v_heads; h++) {
            float qv[MAX_HEAD_DIM], kv[MAX_HEAD_DIM], vv[MAX_HEAD_DIM], o[MAX_HEAD_DIM];
            const int hk = tiled ? h % k_heads : h / group;
            float *S = state + (slots[r] * v_heads + h) * head_state;
            if (fresh != NULL && fresh[r]) memset(S, 0, (size_t)head_state * sizeof(float));
            load_head(q, dtype, r * q_stride + (int64_t)hk * dk, dk, qv, l2norm, scale);
            load_head(k, dtype, r * k_stride + (int64_t)hk * dk, dk, kv, l2norm, 1.0f);
            load_vec(v, dtype, r * v_stride + (int64_t)h * dv, dv, vv);
            const float gt = load_one(g, g_dtype, r * g_stride + h);
            const float bt = load_one(beta, beta_dtype, r * beta_stride + h);
            decode_head(S, qv, kv, vv, gt, bt, dk, dv, o);
            store_vec(out, dtype, (r * v_heads + h) * dv, dv, o);
        }
    }
    return RV_OK;
}

/* c[m, n] = a[m, kk] b[kk, n] (+ c when accumulate): TM x TN tiles of register accumulators. */
static void gemm(int m, int n, int kk, const float *a, int lda, const float *b, int ldb, float *c, int ldc,
                 int accumulate) {
    for (int i0 = 0; i0 < m; i0 += TM) {
        for (int j0 = 0; j0 < n; j0 += TN) {
            float acc[TM][TN];
            float *ct = c + (int64_t)i0 * ldc + j0;
            const float *at = a + (int64_t)i0 * lda;
            if (m - i0 >= TM && n - j0 >= TN) {
                for (int r = 0; r < TM; r++)
                    for (int jj = 0; jj < TN; jj++) acc[r][jj] = accumulate ? ct[r * ldc + jj] : 0.0f;
                for (int d = 0; d < kk; d++) {
                    const float *bd = b + (int64_t)d * ldb + j0;
                    for (int r = 0; r < TM; r++) {
                        const float ar = at[r * lda + d];
#pragma omp simd
                        for (int jj = 0; jj < TN; jj++) acc[r][jj] += ar * bd[jj];
                    }
                }
                for (int r = 0; r < TM; r++)
                    for (int jj = 0; jj < TN; jj++) ct[r * ldc + jj] = acc[r][jj];
                continue;
            }
            const int mi = m - i0 < TM ? m - i0 : TM, nj = n - j0 < TN ? n - j0 : TN; /* an edge tile */
            for (int r = 0; r < mi; r++)
                for (int jj = 0; jj < nj; jj++) acc[r][jj] = accumulate ? ct[r * ldc + jj] : 0.0f;
            for (int d = 0; d < kk; d++)
                for (int r = 0; r < mi; r++)
                    for (int jj = 0; jj < nj; jj++) acc[r][jj] += at[r * lda + d] * b[(int64_t)d * ldb + j0 + jj];
            for (int r = 0; r < mi; r++)
                for (int jj = 0; jj < nj; jj++) ct[r * ldc + jj] = acc[r][jj];
        }
    }
}

/* A thread's scratch for one block of one head (sizes in floats). */
typedef struct {
    float *kq;  /* [2 CHUNK, dk]: the block's L k rows, then its L q rows */
    float *kt;  /* [dk, CHUNK]: k transposed, then weighted for the state update */
    float *pq;  /* [2 CHUNK, dv]: K S then Q S; Q S becomes the output */
    float *u;   /* [CHUNK, dv]: v, then the block's deltas */
    float *gram; /* [2 CHUNK, CHUNK]: K K^T then Q K^T, then the masked, decayed systems */
    float gc[CHUNK], beta[CHUNK];
} chunk_scratch;

/* ui[c] -= a[j] u[j][c] for j < i in order (the forward substitution's row i), 64 columns at a time
 * in registers where the vectors allow: the same fused multiply-subtracts, in the same order, as the
 * row's read-modify-write per j. */
#define SUB_W 64
static void substitute_row(float *ui, const float *u, const float *a, int i, int dv) {
    int c0 = 0;
#if HAVE_AVX512
    for (; c0 + SUB_W <= dv; c0 += SUB_W) {
        __m512 r0 = _mm512_loadu_ps(ui + c0), r1 = _mm512_loadu_ps(ui + c0 + 16), r2 = _mm512_loadu_ps(ui + c0 + 32),
               r3 = _mm512_loadu_ps(ui + c0 + 48);
        for (int j = 0; j < i; j++) {
            const float *uj = u + (int64_t)j * dv + c0;
            const __m512 aj = _mm512_set1_ps(a[j]);
            r0 = _mm512_fnmadd_ps(aj, _mm512_loadu_ps(uj), r0);
            r1 = _mm512_fnmadd_ps(aj, _mm512_loadu_ps(uj + 16), r1);
            r2 = _mm512_fnmadd_ps(aj, _mm512_loadu_ps(uj + 32), r2);
            r3 = _mm512_fnmadd_ps(aj, _mm512_loadu_ps(uj + 48), r3);
        }
        _mm512_storeu_ps(ui + c0, r0), _mm512_storeu_ps(ui + c0 + 16, r1);
        _mm512_storeu_ps(ui + c0 + 32, r2), _mm512_storeu_ps(ui + c0 + 48, r3);
    }
#elif HAVE_AVX2
    for (; c0 + SUB_W <= dv; c0 += SUB_W) {
        __m256 r[8];
        for (int v = 0; v < 8; v++) r[v] = _mm256_loadu_ps(ui + c0 + 8 * v);
        for (int j = 0; j < i; j++) {
            const float *uj = u + (int64_t)j * dv + c0;
            const __m256 aj = _mm256_set1_ps(a[j]);
            for (int v = 0; v < 8; v++) r[v] = _mm256_fnmadd_ps(aj, _mm256_loadu_ps(uj + 8 * v), r[v]);
        }
        for (int v = 0; v < 8; v++) _mm256_storeu_ps(ui + c0 + 8 * v, r[v]);
    }
#endif
    for (int j = 0; j < i; j++) {
        const float *uj = u + (int64_t)j * dv;
#pragma omp simd
        for (int c = c0; c < dv; c++) ui[c] -= a[j] * uj[c];
    }
}

/* Whether n floats are all +0.0 (a slot the pool zeroed for a request's first tokens), on the bits. */
static int all_zero(const float *x, int64_t n) {
    for (int64_t i0 = 0; i0 < n; i0 += 64) {
        uint32_t any = 0;
        const int64_t end = n - i0 < 64 ? n : i0 + 64;
        for (int64_t i = i0; i < end; i++) {
            uint32_t bits;
            memcpy(&bits, x + i, sizeof bits);
            any |= bits;
        }
        if (any) return 0;
    }
    return 1;
}

/* The block of L tokens [t0, t0 + L) of head h (key head hk): out rows written, S advanced by L.
 * zero: S holds zeros (a request's first block), so K S and Q S are zeros and the new S is the
 * block's own sum alone: the same values as the products over the zeros, without them. */
static void chunk_block(float *S, const chunk_scratch *w, int L, int dk, int dv, int zero) {
    float *kq = w->kq, *kt = w->kt, *pq = w->pq, *u = w->u, *gram = w->gram;
    const float *gc = w->gc, *beta = w->beta;
    for (int i = 0; i < L; i++)
        for (int d = 0; d < dk; d++) kt[d * CHUNK + i] = kq[i * dk + d];
    /* pq = [K; Q] S and gram = [K; Q] K^T */
    if (zero)
        memset(pq, 0, (size_t)(2 * L) * (size_t)dv * sizeof(float));
    else
        gemm(2 * L, dv, dk, kq, dk, S, dv, pq, dv, 0);
    gemm(2 * L, L, dk, kq, dk, kt, CHUNK, gram, CHUNK, 0);
    float *ps = pq, *qs = pq + (int64_t)L * dv, *kk = gram, *qk = gram + (int64_t)L * CHUNK;
    /* row by row: the decays exp(gc_i - gc_j), j <= i (exponents <= 0: g <= 0); U's row i from the
     * right-hand side beta_i (v_i - exp(gc_i) k_i S) less sum_{j<i} A_ij u_j (forward substitution
     * of (I + A) U = rhs, A_ij = beta_i exp(gc_i - gc_j) k_i . k_j); the output's weights
     * exp(gc_i - gc_j) q_i . k_j and exp(gc_i) on q_i S */
    for (int i = 0; i < L; i++) {
        float diff[CHUNK], decay[CHUNK], aij[CHUNK];
        for (int j = 0; j <= i; j++) diff[j] = gc[i] - gc[j];
        exp_nonpositive_vec(diff, decay, i + 1);
        const float e = expf(gc[i]);
        float *ui = u + (int64_t)i * dv, *qsi = qs + (int64_t)i * dv;
        for (int j = 0; j < dv; j++) ui[j] = beta[i] * (ui[j] - e * ps[(int64_t)i * dv + j]);
        for (int j = 0; j < i; j++) aij[j] = beta[i] * decay[j] * kk[i * CHUNK + j];
        substitute_row(ui, u, aij, i, dv);
        for (int j = 0; j < dv; j++) qsi[j] *= e;
        for (int j = 0; j < L; j++) qk[i * CHUNK + j] = j <= i ? qk[i * CHUNK + j] * decay[j] : 0.0f;
    }
    gemm(L, dv, L, qk, CHUNK, u, dv, qs, dv, 1);
    /* S = exp(gc_last) S + sum_j exp(gc_last - gc_j) k_j u_j^T */
    const float last = gc[L - 1], e_last = expf(last);
    float wts[CHUNK];
    for (int j = 0; j < L; j++) wts[j] = expf(last - gc[j]);
    for (int d = 0; d < dk; d++)
#pragma omp simd
        for (int j = 0; j < L; j++) kt[d * CHUNK + j] *= wts[j];
    if (!zero)
        for (int64_t i = 0; i < (int64_t)dk * dv; i++) S[i] *= e_last;
    gemm(dk, dv, L, kt, CHUNK, u, dv, S, dv, !zero);
}

/* The scratch's floats for dk, dv (one allocation per thread). */
static int64_t scratch_floats(int dk, int dv) {
    return 2 * CHUNK * (int64_t)dk + (int64_t)dk * CHUNK + 2 * CHUNK * (int64_t)dv + CHUNK * (int64_t)dv +
           2 * CHUNK * CHUNK;
}

/* Tokens [t0, t1) of one row through one value head: S advanced, outputs written; fresh: S starts
 * from zeros whatever it holds. */
static void prefill_head(float *S, chunk_scratch *w, const void *q, int64_t q_stride, const void *k,
                         int64_t k_stride, const void *v, int64_t v_stride, int dtype, const void *g,
                         int64_t g_stride, int g_dtype, const void *beta, int64_t beta_stride, int beta_dtype,
                         void *out, int64_t t0, int64_t t1, int h, int hk, int v_heads, int dk, int dv, int l2norm,
                         float scale, int fresh) {
    int zero = fresh || all_zero(S, (int64_t)dk * dv);
    for (int64_t b0 = t0; b0 < t1; b0 += CHUNK, zero = 0) {
        const int L = (int)(t1 - b0 < CHUNK ? t1 - b0 : CHUNK);
        float cum = 0.0f;
        for (int i = 0; i < L; i++) {
            const int64_t t = b0 + i;
            load_head(k, dtype, t * k_stride + (int64_t)hk * dk, dk, w->kq + (int64_t)i * dk, l2norm, 1.0f);
            load_head(q, dtype, t * q_stride + (int64_t)hk * dk, dk, w->kq + (int64_t)(L + i) * dk, l2norm,
                      scale);
            load_vec(v, dtype, t * v_stride + (int64_t)h * dv, dv, w->u + (int64_t)i * dv);
            cum += load_one(g, g_dtype, t * g_stride + h);
            w->gc[i] = cum;
            w->beta[i] = load_one(beta, beta_dtype, t * beta_stride + h);
        }
        chunk_block(S, w, L, dk, dv, zero);
        const float *o = w->pq + (int64_t)L * dv;
        for (int i = 0; i < L; i++) store_vec(out, dtype, ((b0 + i) * v_heads + h) * dv, dv, o + (int64_t)i * dv);
    }
}

int gated_delta_prefill(const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                        int64_t v_stride, int dtype, const void *g, int64_t g_stride, int g_dtype, const void *beta,
                        int64_t beta_stride, int beta_dtype, float *state, const int64_t *slots,
                        const uint8_t *fresh, const int64_t *cu_seqlens, int64_t seqs, void *out, int k_heads,
                        int v_heads, int dk, int dv, int tiled, int l2norm, float scale) {
    int status = check_heads(dtype, g_dtype, beta_dtype, k_heads, v_heads, dk, dv);
    if (status != RV_OK) return status;
    const int group = v_heads / k_heads;
    const int64_t head_state = (int64_t)dk * dv;
#pragma omp parallel
    {
        float *mem = malloc((size_t)scratch_floats(dk, dv) * sizeof(float));
        chunk_scratch w = {0};
        if (mem == NULL) {
#pragma omp atomic write
            status = RV_ERR_NO_MEMORY;
        } else {
            w.kq = mem;
            w.kt = w.kq + 2 * CHUNK * (int64_t)dk;
            w.pq = w.kt + (int64_t)dk * CHUNK;
            w.u = w.pq + 2 * CHUNK * (int64_t)dv;
            w.gram = w.u + CHUNK * (int64_t)dv;
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t r = 0; r < seqs; r++) {
            for (int h = 0; h < v_heads; h++) {
                if (mem == NULL) continue;
                float *S = state + (slots[r] * v_heads + h) * head_state;
                const int zero = fresh != NULL && fresh[r];
                if (zero && cu_seqlens[r + 1] == cu_seqlens[r])
                    memset(S, 0, (size_t)head_state * sizeof(float));
                prefill_head(S, &w, q, q_stride, k, k_stride, v, v_stride, dtype, g, g_stride, g_dtype, beta,
                             beta_stride, beta_dtype, out, cu_seqlens[r], cu_seqlens[r + 1], h,
                             tiled ? h % k_heads : h / group, v_heads, dk, dv, l2norm, scale, zero);
            }
        }
        free(mem);
    }
    return status;
}

/* One block of channels [c0, c0 + n) of one row's tokens [t0, t1): outputs, then the state. Taps
 * are rows (wt[m][c], win[.][c]) so that every loop runs along the channels; win is a ring of the
 * last `kernel` inputs, token t's window (oldest first) in rows p, p + 1, ... (mod kernel), its own
 * input the last, so no row moves from one token to the next. A task's channels are CONV_WIDE wide:
 * each token's inputs are rows of x far apart, which the hardware prefetcher does not follow in
 * short pieces, and the next token's are prefetched. */
static void conv_block(const void *x, int64_t x_stride, int dtype, void *out, void *conv_state, int state_dtype,
                       int64_t state_len, int64_t slot, int zero, const void *w, const void *bias, int64_t channels,
                       int kernel, int silu, int64_t t0, int64_t t1, int64_t c0, int n) {
    float wt[MAX_CONV_KERNEL][CONV_WIDE], win[MAX_CONV_KERNEL][CONV_WIDE], bv[CONV_WIDE], o[2 * CONV_WIDE],
        row[MAX_CONV_KERNEL];
    const int taps = kernel - 1, elem = dtype == DTYPE_BF16 ? 2 : 4;
    const int64_t base = slot * channels * state_len;
    for (int c = 0; c < n; c++) {
        load_vec(w, dtype, (c0 + c) * kernel, kernel, row);
        for (int m = 0; m < kernel; m++) wt[m][c] = row[m];
        bv[c] = bias != NULL ? load_one(bias, dtype, c0 + c) : 0.0f;
        load_vec(conv_state, state_dtype, base + (c0 + c) * state_len + state_len - taps, taps, row);
        for (int m = 0; m < taps; m++) win[m][c] = zero ? 0.0f : row[m];
    }
    int p = 0; /* the ring's oldest row */
    for (int64_t t = t0; t < t1; t++) {
        float *xv = win[p + taps < kernel ? p + taps : p + taps - kernel];
        if (t + 1 < t1)
            for (int at = 0; at < n * elem; at += 64) __builtin_prefetch((const char *)x + ((t + 1) * x_stride + c0) * elem + at);
        load_vec(x, dtype, t * x_stride + c0, n, xv);
        for (int c = 0; c < n; c++) o[c] = bv[c];
        for (int m = 0; m < taps; m++) {
            const float *h = win[p + m < kernel ? p + m : p + m - kernel];
#pragma omp simd
            for (int c = 0; c < n; c++) o[c] += wt[m][c] * h[c];
        }
#pragma omp simd
        for (int c = 0; c < n; c++) o[c] += wt[taps][c] * xv[c];
        p = p + 1 < kernel ? p + 1 : 0;
        if (silu) { /* torch rounds the conv's output, then silu's, to the dtype */
            round_vec(dtype, o, n);
            for (int c = 0; c < n; c++) o[n + c] = 1.0f; /* [gate | up] with up = 1 */
            silu_mul_row(o, o, n, DTYPE_F32);            /* small_ops.c's vectorized silu */
        }
        store_vec(out, dtype, t * channels + c0, n, o);
    }
    /* the state keeps the last state_len inputs: older ones shifted down, the row's tokens after */
    const int64_t T = t1 - t0;
    for (int c = 0; c < n; c++) {
        const int64_t at = base + (c0 + c) * state_len;
        load_vec(conv_state, state_dtype, at, (int)state_len, row);
        for (int64_t m = 0; m < state_len; m++) {
            const int64_t from = m + T; /* position in [old state, tokens] */
            if (from < state_len) {
                row[m] = zero ? 0.0f : row[from];
            } else {
                row[m] = load_one(x, dtype, (t0 + from - state_len) * x_stride + c0 + c);
            }
        }
        store_vec(conv_state, state_dtype, at, (int)state_len, row);
    }
}

/* conv_block for one token (t) of channels [c0, c0 + n) of a row whose state holds its last K - 1
 * inputs (HF's decode; K = CONV_TAPS, Qwen3.5's), no bias: the same sums in the same order and the
 * same roundings, in one pass over the channels in place of conv_block's per-channel loads. */
#define CONV_TAPS 4
static void conv_decode(const void *x, int64_t x_stride, int dtype, void *out, void *conv_state, int state_dtype,
                        int64_t slot, const void *w, int64_t channels, int64_t t, int64_t c0, int n) {
    float o[2 * CONV_BLOCK], wt[CONV_TAPS * CONV_BLOCK], hist[(CONV_TAPS - 1) * CONV_BLOCK], xv[CONV_BLOCK];
    const int64_t at = (slot * channels + c0) * (CONV_TAPS - 1);
    load_vec(w, dtype, c0 * CONV_TAPS, n * CONV_TAPS, wt);
    load_vec(conv_state, state_dtype, at, n * (CONV_TAPS - 1), hist);
    load_vec(x, dtype, t * x_stride + c0, n, xv);
    for (int c = 0; c < n; c++) {
        float acc = 0.0f;
        for (int m = 0; m < CONV_TAPS - 1; m++) acc += wt[c * CONV_TAPS + m] * hist[c * (CONV_TAPS - 1) + m];
        o[c] = acc + wt[c * CONV_TAPS + CONV_TAPS - 1] * xv[c];
        o[n + c] = 1.0f; /* [gate | up] with up = 1 */
        for (int m = 0; m + 1 < CONV_TAPS - 1; m++) hist[c * (CONV_TAPS - 1) + m] = hist[c * (CONV_TAPS - 1) + m + 1];
        hist[c * (CONV_TAPS - 1) + CONV_TAPS - 2] = xv[c];
    }
    store_vec(conv_state, state_dtype, at, n * (CONV_TAPS - 1), hist);
    round_vec(dtype, o, n); /* torch rounds the conv's output, then silu's, to the dtype */
    silu_mul_row(o, o, n, DTYPE_F32);
    store_vec(out, dtype, t * channels + c0, n, o);
}

int causal_conv1d(const void *x, int64_t x_stride, int dtype, void *out, void *conv_state, int state_dtype,
                  int64_t state_len, const int64_t *slots, const uint8_t *fresh, const int64_t *cu_seqlens,
                  int64_t seqs, const void *w, const void *bias, int64_t channels, int kernel, int silu) {
    if ((dtype != DTYPE_F32 && dtype != DTYPE_BF16) || (state_dtype != DTYPE_F32 && state_dtype != DTYPE_BF16))
        return RV_ERR_DTYPE;
    if (kernel < 1 || kernel > MAX_CONV_KERNEL || state_len < kernel - 1 || state_len > MAX_CONV_KERNEL)
        return RV_ERR_HEADS;
    const int64_t blocks = (channels + CONV_WIDE - 1) / CONV_WIDE;
#pragma omp parallel for collapse(2) schedule(static) if (seqs * channels >= (1 << 14))
    for (int64_t r = 0; r < seqs; r++) {
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t c0 = b * CONV_WIDE;
            const int n = (int)(channels - c0 < CONV_WIDE ? channels - c0 : CONV_WIDE);
            const int zero = fresh != NULL && fresh[r];
            if (cu_seqlens[r + 1] - cu_seqlens[r] == 1 && kernel == CONV_TAPS && state_len == CONV_TAPS - 1 && !zero &&
                bias == NULL && silu)
                for (int64_t c = c0; c < c0 + n; c += CONV_BLOCK) /* its own blocks */
                    conv_decode(x, x_stride, dtype, out, conv_state, state_dtype, slots[r], w, channels, cu_seqlens[r],
                                c, (int)(c0 + n - c < CONV_BLOCK ? c0 + n - c : CONV_BLOCK));
            else
                conv_block(x, x_stride, dtype, out, conv_state, state_dtype, state_len, slots[r], zero, w, bias,
                           channels, kernel, silu, cu_seqlens[r], cu_seqlens[r + 1], c0, n);
        }
    }
    return RV_OK;
}

/* softplus as torch's (threshold 20: the input itself above it). */
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* One value head of one decode row after its conv: q, k L2-normed and q scaled, the gates from a
 * and b, the rule on S, then the gated RMSNorm w * norm(o) * silu(z) into y [dv]. */
static void step_head(float *S, const float *conv_row, const float *z, float a, float b, float a_log,
                      float dt_bias, const float *norm_w, float eps, int hk, int h, int key_dim, int dk, int dv,
                      float scale, float *y) {
    float qv[MAX_HEAD_DIM], kv[MAX_HEAD_DIM], o[MAX_HEAD_DIM], gate_up[2 * MAX_HEAD_DIM];
    load_head(conv_row, DTYPE_F32, (int64_t)hk * dk, dk, qv, 1, scale);
    load_head(conv_row, DTYPE_F32, key_dim + (int64_t)hk * dk, dk, kv, 1, 1.0f);
    const float g = -expf(a_log) * softplus(a + dt_bias);
    const float beta = 1.0f / (1.0f + expf(-b));
    decode_head(S, qv, kv, conv_row + 2 * (int64_t)key_dim + (int64_t)h * dv, g, beta, dk, dv, o);
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int j = 0; j < dv; j++) sq += o[j] * o[j];
    const float inv = 1.0f / sqrtf(sq / (float)dv + eps);
    for (int j = 0; j < dv; j++) {
        gate_up[j] = z[j];
        gate_up[dv + j] = norm_w[j] * (o[j] * inv);
    }
    silu_mul_row(gate_up, y, dv, DTYPE_F32);
}

int gated_delta_decode_step(const float *mixed, int64_t mixed_stride, const float *z, int64_t z_stride,
                            const float *b, int64_t b_stride, const float *a, int64_t a_stride, const float *conv_w,
                            int kernel, float *conv_state, int64_t state_len, float *state, int64_t pool_slots,
                            const int64_t *slots, int64_t rows, const float *a_log, const float *dt_bias,
                            const float *norm_w, float eps, int k_heads, int v_heads, int dk, int dv, int tiled,
                            float scale, float *scratch, float *out) {
    const int status = check_heads(DTYPE_F32, DTYPE_F32, DTYPE_F32, k_heads, v_heads, dk, dv);
    if (status != RV_OK) return status;
    if (kernel < 1 || kernel > MAX_CONV_KERNEL || state_len < kernel - 1 || state_len > MAX_CONV_KERNEL)
        return RV_ERR_HEADS;
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= pool_slots) return RV_ERR_HEADS;
    const int group = v_heads / k_heads, key_dim = k_heads * dk;
    const int64_t channels = 2 * (int64_t)key_dim + (int64_t)v_heads * dv, head_state = (int64_t)dk * dv;
    const int64_t blocks = (channels + CONV_BLOCK - 1) / CONV_BLOCK;
#pragma omp parallel if (rows * v_heads * head_state >= (1 << 16))
    {
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t blk = 0; blk < blocks; blk++) {
                const int64_t c0 = blk * CONV_BLOCK;
                const int n = (int)(channels - c0 < CONV_BLOCK ? channels - c0 : CONV_BLOCK);
                /* row r's one token is token r of mixed (x) and of scratch (out) */
                if (kernel == CONV_TAPS && state_len == CONV_TAPS - 1)
                    conv_decode(mixed, mixed_stride, DTYPE_F32, scratch, conv_state, DTYPE_F32, slots[r], conv_w,
                                channels, r, c0, n);
                else
                    conv_block(mixed, mixed_stride, DTYPE_F32, scratch, conv_state, DTYPE_F32, state_len, slots[r],
                               0, conv_w, NULL, channels, kernel, 1, r, r + 1, c0, n);
            }
        }
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            for (int h = 0; h < v_heads; h++) {
                const int hk = tiled ? h % k_heads : h / group;
                step_head(state + (slots[r] * v_heads + h) * head_state, scratch + r * channels,
                          z + r * z_stride + (int64_t)h * dv, a[r * a_stride + h], b[r * b_stride + h], a_log[h],
                          dt_bias[h], norm_w, eps, hk, h, key_dim, dk, dv, scale,
                          out + (r * v_heads + h) * dv);
            }
        }
    }
    return RV_OK;
}
