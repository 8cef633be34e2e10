/* GGUF weights computed in their quantized blocks: what the per-type code (quant_legacy.c: Q4_0,
 * Q4_1, Q8_0; quant_k.c: Q4_K, Q5_K, Q6_K; quant_sub32.c: Q5_0, Q5_1, IQ4_NL, IQ4_XS; quant_k23.c:
 * Q2_K, Q3_K; quant_f16.c: F16, BF16 weights) gives the driver (quant.c).
 *
 * A weight matrix [n, k] is n rows of k / block weights' blocks, exactly as the GGUF file holds
 * them (row j's blocks at w + j * (k / block) * block_bytes), or | QTYPE_X8 the same bytes with
 * each 8 rows interleaved (quant_x8.c draws the legacy types' layout, quant_kx8.c the K-quants'). Activations meet the
 * blocks much as llama.cpp's do: each activation row is quantized per block of 32 (act_block16
 * below: 16 bits, one float scale, the block's sum), then dot products run on integers and are
 * scaled once per (sub-)block.
 *
 * Type codes are ggml's type ids (gguf.GGMLQuantizationType).
 */
#ifndef RIVULET_QUANT_H
#define RIVULET_QUANT_H
#include "common.h"
#include "rivulet_kernels.h"

#define QTYPE_F16 1
#define QTYPE_Q4_0 2
#define QTYPE_Q4_1 3
#define QTYPE_Q5_0 6
#define QTYPE_Q5_1 7
#define QTYPE_Q8_0 8
#define QTYPE_Q2_K 10
#define QTYPE_Q3_K 11
#define QTYPE_Q4_K 12
#define QTYPE_Q5_K 13
#define QTYPE_Q6_K 14
#define QTYPE_IQ4_NL 20
#define QTYPE_IQ4_XS 23
#define QTYPE_BF16 30
#define QTYPE_MXFP4 39
/* QTYPE_X8, QTYPE_A8: flags on these, rivulet_kernels.h */

/* Activations, one format for every weight type: per 32 values, 16-bit integers with one float
 * scale (x ~ d * q, d = absmax / 32767, q rounded to nearest even) and the block's sum s = d * sum(q)
 * for the types' min/offset terms. A row of k values is k / 32 of these, in order (a 256-weight
 * K-quant block meets 8 consecutive ones). Why 16 bits, not llama.cpp's 8: SmolLM2's hidden states
 * carry channels 30-80x the others, and 8 bits per block of 32 leave the block's other values a
 * few steps, enough to change the embedded model's greedy answers (docs/benchmarks.md).
 * _mm256_madd_epi16 multiplies 16 pairs of int16 per instruction, as many products per instruction
 * as int8's maddubs + madd pair, so the precision costs no multiply throughput there. (vpdpbusd does
 * multiply twice vpdpwssd's products: act_block8 below, for many rows, where multiplies bound the
 * step, keeps 8 bits and gives the outlier blocks a second pass.) */
#define ACT_BLOCK 32
typedef struct {
    float d;
    float s;
    int16_t q[ACT_BLOCK];
} act_block16; /* 72 bytes */

/* quantize_act16 (rivulet_kernels.h): one activation row of k float32 values (k a multiple of 32)
 * -> k / 32 act_block16 at xq. */

/* Activations for many rows on the K-quants (act_block8: 256 values, a K-quant block's): per 32
 * values, 8-bit integers q with one float step (x ~ d q, d = absmax / 127) and, where the 32 need
 * more, a second 8-bit pass r of what is left, at a 128th of the step (x ~ d q + d / 128 r, |r| <=
 * 64): about 14 bits there. The 32 need it when their absmax stands ACT8_SPREAD times above their
 * mean |x|: one channel far above the rest, as SmolLM2's hidden states carry, where 8 bits alone
 * leave the others a few steps (act_block16's note above); elsewhere r is all zero and skipped.
 * vpdpbusd multiplies 64 byte pairs an instruction, vpdpwssd 32 word pairs: many rows are bound by
 * those multiplies, so 8 bits halve them. */
#define ACT8_SPREAD 6.0f
typedef struct {
    float d[8];         /* per 32 values: q's step (r's: d / 128) */
    float s[8];         /* per 32 values: their sum as quantized, d sum(q) + d / 128 sum(r) */
    int32_t qoff[16];   /* per 16 values: -32 sum(q), a Q6_K pass's first sums (its weights are q - 32) */
    int32_t roff[16];   /* per 16 values: -32 sum(r) */
    int32_t two;        /* bit j: values 32j .. 32j + 31 have the residual pass */
    int32_t pad[3];
    int8_t q[256];
    int8_t r[256];
} act_block8; /* 720 bytes; quantize_act8 (rivulet_kernels.h) writes a row of them */

/* The 8-bit activations per 32 values (not act_block8's 256, so a Linear's k need only be a multiple
 * of 32: Gemma 3 270M's 640, SmolLM's 576, gpt-oss's 2880), of the sub-32 types' 8-bit tiles
 * (quant_sub32x8.c) and MXFP4's (quant_mxfp4.c), quantized as act_block8 quantizes each 32 of its
 * values: q at step d = absmax / 127, and where the 32's absmax stands ACT8_SPREAD times above their
 * mean |x| a second pass r of what is left at d / 128 (two = 1). */
typedef struct {
    float d;   /* q's step (r's: d / 128) */
    float s;   /* the 32 values' sum as quantized: d sum(q) + d / 128 sum(r) */
    int32_t two;
    int32_t qsum, rsum; /* sum(q), sum(r) */
    int32_t qoff;       /* -128 sum(q): where IQ4_NL / IQ4_XS's 8-bit sums start (quant_sub32x8.c) */
    int8_t q[ACT_BLOCK];
    int8_t r[ACT_BLOCK];
} act8_32; /* 88 bytes */

/* One activation row of k float32 values (k a multiple of 32) -> k / 32 act8_32 at xq. */
void quantize_act8_32(const float *x, int64_t k, void *xq);

/* Bytes of the largest activation format for a row of k values: act_block16's, act_block8's, or the
 * 16-bit float weights' float32 row (quant_f16.c). */
static inline int64_t act_row_bytes_max(int64_t k) {
    const int64_t b16 = k / ACT_BLOCK * (int64_t)sizeof(act_block16), b8 = k / 256 * (int64_t)sizeof(act_block8);
    const int64_t b32 = k / ACT_BLOCK * ACT_BLOCK * (int64_t)sizeof(float), b = b16 > b8 ? b16 : b8;
    return b > b32 ? b : b32;
}

/* A GGUF block's fp16 scale as float32, exactly (F16C on x86-64-v3 and up; subnormals included). */
static inline float fp16_to_f32(uint16_t h) {
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

/* A GGUF block's fp16 scale at any byte address (blocks lie unaligned) as float32. */
static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return fp16_to_f32(h);
}

/* acc plus the int16 pairs of a and b multiplied and summed into int32 lanes: one vpdpwssd where the
 * build has AVX-512 VNNI on ymm, madd + add elsewhere (the same sums). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPW8(acc, a, b) _mm256_dpwssd_epi32((acc), (a), (b))
#else
#define DPW8(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#endif

typedef struct {
    int type;            /* ggml type id */
    int block;           /* weights per block: 32 or 256 */
    int block_bytes;     /* bytes of one weight block */
    int act_block_bytes; /* bytes of one quantized activation block (this type's activation format) */
    /* One activation row of k float32 values (k a multiple of block) -> k / block activation blocks. */
    void (*quantize_act)(const float *x, int64_t k, void *xq);
    /* out[r * ldo + j] = dot(weight row j, activation row r) for j < nc, r < nr, as float32.
     * w: nc weight rows, w_row_bytes apart; xq: nr quantized activation rows, xq_row_bytes apart;
     * nblocks = k / block. Single-threaded: the driver splits rows and columns over threads. */
    void (*tile)(const uint8_t *w, int64_t w_row_bytes, int64_t nc, const uint8_t *xq, int64_t xq_row_bytes,
                 int64_t nr, int64_t nblocks, float *out, int64_t ldo);
    /* One weight row of k weights -> float32 (the embedding lookup, the dense path's panels);
     * NULL for the interleaved types, which give dequant_slot: row s of the 8 at group g, and
     * dequant_group: all 8 (out: 8 rows of k). */
    void (*dequant_row)(const uint8_t *w, int64_t k, float *out);
    void (*dequant_slot)(const uint8_t *g, int s, int64_t k, float *out);
    void (*dequant_group)(const uint8_t *g, int64_t k, float *out);
} qtype_ops;

/* Weight row ``row`` of W (rows wrb bytes apart, in either layout) as k float32. */
static inline void dequant_row_at(const qtype_ops *ops, const uint8_t *w, int64_t wrb, int64_t row, int64_t k,
                                  float *out) {
    if (ops->dequant_slot != NULL) {
        ops->dequant_slot(w + row / 8 * 8 * wrb, (int)(row % 8), k, out);
    } else {
        ops->dequant_row(w + row * wrb, k, out);
    }
}

/* tile_q4_0, tile_q4_1, tile_q8_0 (qtype_ops' tile of each legacy type): each LOOP(its type), the
 * file's tile loop macro, so the type is a constant in each copy. */
#define LEGACY_TILES(LOOP)                                                                                    \
    static void tile_q4_0(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb,        \
                          int64_t nr, int64_t nb, float *out, int64_t ldo) {                                  \
        LOOP(QTYPE_Q4_0);                                                                                     \
    }                                                                                                         \
    static void tile_q4_1(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb,        \
                          int64_t nr, int64_t nb, float *out, int64_t ldo) {                                  \
        LOOP(QTYPE_Q4_1);                                                                                     \
    }                                                                                                         \
    static void tile_q8_0(const uint8_t *w, int64_t wrb, int64_t nc, const uint8_t *xq, int64_t xrb,        \
                          int64_t nr, int64_t nb, float *out, int64_t ldo) {                                  \
        LOOP(QTYPE_Q8_0);                                                                                     \
    }

/* quant.c's panel of a matmul, for drivers that share out their own panels (moe.c): the columns in
 * a panel of weight rows of row_bytes each for ops' tile, and y rows [r0, r1) of columns [c0, c0 + pw). */
int64_t quant_panel_cols(const qtype_ops *ops, int64_t row_bytes);
void quant_panel(const qtype_ops *ops, const uint8_t *w, int64_t wrb, int64_t nb, int64_t c0, int64_t pw,
                 const uint8_t *xq, int64_t xrb, int64_t r0, int64_t r1, void *y, int64_t y_stride, int y_dtype,
                 const void *residual, int64_t res_stride);

/* The gated MLP's output straight into the next matmul's (the down projection's) quantized activation
 * rows (quant.c, for decode_layers.c): quant_matmul_gated (rivulet_kernels.h) whose [rows, inner]
 * output is never written, each panel's rows rounded to y_dtype as y would hold them and quantized
 * in place by the format of next_type's tile (next_type with its flags), at xq_out, rows
 * quant_gated_q8_row_bytes apart; quant_matmul_q is then quant_matmul on those rows. The same bits as
 * the two calls: each 32 values' quantization is theirs alone. quant_gated_q8_row_bytes: 0 where it
 * does not run (one row; a tile on 16-bit activations or the dense path's; quant_gated_q8 0), and
 * quant_matmul_gated_q8 then refuses (RV_ERR_TYPE). */
int64_t quant_gated_q8_row_bytes(int next_type, int64_t inner, int64_t rows);
int quant_matmul_gated_q8(int type, const uint8_t *w_gate, const uint8_t *w_up, int64_t inner, int64_t k,
                          const void *x, int64_t x_stride, int x_dtype, int64_t rows, void *scratch, int y_dtype,
                          int gelu, int next_type, uint8_t *xq_out);
int quant_matmul_q(int type, const uint8_t *w, int64_t n, int64_t k, const uint8_t *xq, int64_t rows, void *y,
                   int64_t y_stride, int y_dtype, const void *residual, int64_t res_stride);

/* quant_matmul_argmax's running best per (thread, row): best[t * rows + r], best_at[...] (-1: none
 * yet); argmax_panel folds in rows [r0, r0 + nr) of columns [c0, c0 + pw) (v, ld apart, overwritten),
 * computed by thread t in ascending columns. quant_dense_run: quant_matmul_dense, with am not NULL
 * folding its panels into am instead of writing y. */
typedef struct {
    float *best;
    int64_t *best_at;
    int64_t rows, n;
    int dtype;
    float cap;
} head_argmax;
void argmax_panel(const head_argmax *am, int t, float *v, int64_t ld, int64_t r0, int64_t nr, int64_t c0, int64_t pw);
int quant_dense_run(int type, const uint8_t *w, int64_t n, int64_t k, const void *x, int64_t x_stride, int x_dtype,
                    int64_t rows, void *y, int64_t y_stride, int y_dtype, const void *residual, int64_t res_stride,
                    const head_argmax *am);

/* decode_layers.c's steps, for every one-call decode: one Linear (its parts, each by the path its row
 * count takes) into y, plus residual where not NULL; and x += y rounded to the dtype (torch's add). */
int decode_linear_run(const decode_linear *lin, int64_t n, int64_t k, const void *x, int64_t rows, void *scratch,
                      void *y, int dtype, const void *residual);
void decode_add_into(void *x, const void *y, int64_t n_all, int dtype);

/* The ops of ``type`` if the file implements it, else NULL. */
const qtype_ops *qtype_legacy(int type);
const qtype_ops *qtype_k(int type);
const qtype_ops *qtype_x8(int type);
const qtype_ops *qtype_kx8(int type);
const qtype_ops *qtype_sub32x8(int type); /* quant_sub32x8.c: Q5_0, Q5_1, IQ4_NL | X8 (and | A8) */
const qtype_ops *qtype_sub32(int type); /* quant_sub32.c: Q5_0, Q5_1, IQ4_NL, IQ4_XS, MXFP4 */
const qtype_ops *qtype_k23(int type);   /* quant_k23.c: Q2_K, Q3_K */
const qtype_ops *qtype_k23x8(int type); /* quant_k23x8.c: Q2_K, Q3_K | X8 (and | A8) */
const qtype_ops *qtype_f16(int type);   /* quant_f16.c: F16, BF16 (activations as float32) */
const qtype_ops *qtype_mxfp4x8(int type); /* quant_mxfp4.c: MXFP4 | X8 */
const qtype_ops *qtype_bf16x(int type);   /* quant_bf16x.c: BF16 | A8 (vdpbf16ps; NULL without it) */
const qtype_ops *quant_ops(int type); /* any of them */

#endif
