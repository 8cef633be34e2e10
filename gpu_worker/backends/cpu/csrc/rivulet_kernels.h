/* The C ABI of the CPU kernels' library: every function another file calls (Python through ctypes,
 * or another .c file), every struct passed across, and every constant the Python side mirrors.
 * Each .c file includes this header, so the compiler checks each definition against its
 * declaration here; none re-declares another file's function. At load, abi.py parses this file and
 * checks the ctypes bindings (kernels.py, quant_kernels.py) and the Python mirrors of the structs
 * and constants against it: a mismatch fails the load with the name.
 *
 * abi.py's parser reads this file's own plain style, so keep every declaration in it:
 *   #define NAME <integer>                                   (a constant; one to a line)
 *   NAME = <integer>,                                        (a status, inside enum rv_status)
 *   typedef struct { <type> <name>; <type> <name>[<CONSTANT>]; ... } <name>;  (one field a line)
 *   <type> <name>(<type> <name>, ...);                       (a function; may span lines)
 * with types int, int64_t, float, void, uint16_t, uint8_t, a struct named here, and pointers.
 * The qtype_ops interface of the GGUF-block files (quant.h) is shared between .c files only. */
#ifndef RIVULET_KERNELS_H
#define RIVULET_KERNELS_H
#include <stdint.h>

/* The instruction set a build targets (kernel_isa; build.py's ISA_* per CPU kind). */
#define ISA_PORTABLE 0
#define ISA_AVX2 1
#define ISA_AVX512_BF16 2

/* Tensor dtypes (build.py's DTYPE_CODES, KV_DTYPE_CODES); all math is float32. */
#define DTYPE_F32 0
#define DTYPE_BF16 1
#define DTYPE_F16 2 /* KV caches only */
#define DTYPE_F8E4M3 3 /* latent KV caches only (mla.c): torch.float8_e4m3fn, no scale */

#define MAX_HEADS 64 /* query heads of paged_decode_attention (larger: the caller uses torch) */
#define MAX_HEAD_DIM 512 /* head_dim of paged_decode_attention and rotary (Gemma 4's global heads) */
#define MAX_QUERY_WIDTH 16384 /* paged_decode_attention's heads times head_dim, each head in whole 32-dimension
                               * blocks: MAX_HEADS heads of 256, or 32 of 512 (a task's per-head arrays) */

/* Flags on a ggml type id (layouts.py's X8, A8). */
#define QTYPE_X8 0x100 /* | a type: its rows interleaved by 8 (quant_x8.c, quant_kx8.c), n a multiple of 8 */
#define QTYPE_A8 0x200 /* | an interleaved type: its activations in act_block8 (quant_kx8.c; k a multiple of 256) */

#define MAX_PARTS 3      /* a decode_linear's parts: q, k, v of three types (decode_layers.py) */
#define DECODE_LINEARS 4 /* a decode_layer's Linears: qkv, o, gate_up, down (decode_layers.c) */
#define MLA_LINEARS 6    /* an mla_layer's Linears: q_a, q, kv_a, o, gate_up, down (decode_mla.c) */

/* What a kernel returns: 0 or the first thing it refused (abi.py names them in Python's errors).
 * A refused call writes nothing unless its comment says otherwise. */
enum rv_status {
    RV_OK = 0,
    RV_ERR_TYPE = 1,           /* a weight type no kernel takes */
    RV_ERR_K = 2,              /* k not a whole number of the type's blocks */
    RV_ERR_DTYPE = 3,          /* an activation or KV dtype the kernel does not take */
    RV_ERR_NO_MEMORY = 4,      /* an allocation failed (output may be partly written) */
    RV_ERR_X8_ROWS = 5,        /* an interleaved type with n not a multiple of 8 */
    RV_ERR_PARTS = 6,          /* a Linear's parts do not add up to its columns */
    RV_ERR_EXPERT_SIZE = 7,    /* experts' projections that do not match hidden / inner */
    RV_ERR_EXPERT_FORMATS = 8, /* experts' projections of differing or unsupported formats or sizes */
    RV_ERR_TOP_K = 9,          /* top_k outside [1, n_experts] */
    RV_ERR_HEADS = 10,         /* head counts or head_dim outside the attention's limits */
    RV_ERR_TIMEOUT = 11,       /* a tensor-parallel rank never reached the all-reduce */
};

/* One projection of every expert of a mixture of experts, stacked (moe.c): expert e's n rows are
 * rows [e n, (e + 1) n) (experts.py's MoeProjection). */
typedef struct {
    const uint8_t *w;
    int64_t type;           /* the C kernels' type code */
    int64_t n;              /* an expert's rows */
    int64_t row_bytes;      /* bytes of one row */
    int64_t dense_min_rows; /* from how many rows the dense path */
    int64_t a8_min_rows;    /* from how many rows 8-bit activations (type | QTYPE_A8); gate's and up's alike */
} moe_projection;

/* One Linear of the one-call decode: its parts' blocks, each [n[i], row bytes], output columns in
 * order (decode_layers.py's DecodeLinear). */
typedef struct {
    const uint8_t *w[MAX_PARTS];
    int64_t type[MAX_PARTS];           /* the C kernels' type codes */
    int64_t n[MAX_PARTS];              /* output columns; 0: no such part */
    int64_t dense_min_rows[MAX_PARTS]; /* from how many rows the dense path */
    int64_t a8_min_rows[MAX_PARTS];    /* from how many rows 8-bit activations (type | QTYPE_A8) */
} decode_linear;

/* One layer, as decode_layers.py's DecodeLayer fills it. */
typedef struct {
    const void *input_norm;               /* [hidden], the activations' dtype */
    const void *post_norm;                /* [hidden] */
    decode_linear linear[DECODE_LINEARS]; /* GATE_UP and DOWN unused (n = 0) where a router is */
    void *k_cache;                        /* [pool tokens, kv_heads, head_dim] */
    void *v_cache;                        /* as k_cache */
    const void *q_norm;                   /* [head_dim]: Qwen3's norms per head; NULL: none */
    const void *k_norm;                   /* as q_norm */
    const void *router;                   /* [n_experts, hidden]: a mixture of experts; NULL: the MLP */
    const moe_projection *experts;        /* [3]: the experts' gate, up, down (moe.c) */
    int64_t n_experts;
    int64_t top_k;
    int64_t norm_topk;
    int64_t expert_inner;
    int64_t window; /* > 0: a sliding-window layer, attending each row's last window positions; 0: all */
    const void *attn_out_norm; /* [hidden]: Gemma's norm of the attention's output before its add; NULL: none */
    const void *mlp_out_norm;  /* [hidden]: Gemma's norm of the MLP's output before its add; NULL: none */
    int64_t rope;              /* the step's rotary table this layer takes (Gemma 3: global 0, local 1) */
    const void *bias[DECODE_LINEARS]; /* [the Linear's n] (dtype): added after its matmul (QuantLinear's); NULL: none */
    const void *sinks;                /* [heads] float32: gpt-oss's sink logit per head; NULL: none */
    const void *router_bias;          /* [n_experts] (dtype): gpt-oss's router (moe_route_topk); NULL: moe_route's */
    const void *gate_up_bias;         /* [n_experts, 2 expert_inner] (dtype): gpt-oss's experts (moe_experts_clamped) */
    const void *down_bias;            /* [n_experts, hidden] (dtype), with gate_up_bias */
    float swiglu_alpha;               /* the clamped SwiGLU's, with gate_up_bias */
    float swiglu_limit;
} decode_layer;

/* The model's sizes (decode_layers.py's DecodeDims). */
typedef struct {
    int64_t hidden;
    int64_t heads;
    int64_t kv_heads;
    int64_t head_dim;
    int64_t inner;
    float eps;   /* RMSNorm's epsilon */
    float scale; /* attention's 1 / sqrt(head_dim) */
    int64_t dtype;
    int64_t kv_dtype; /* the KV pool's (--kv-cache-dtype) */
    int64_t gelu;     /* 1: GELU (tanh) gates the MLP (Gemma); 0: SiLU */
} decode_dims;

/* One latent-attention layer of decode_mla.c (decode_mla.py's MlaLayer). */
typedef struct {
    const void *input_norm;            /* [hidden], the activations' dtype */
    const void *post_norm;             /* [hidden] */
    decode_linear linear[MLA_LINEARS]; /* q_a (n = 0: no q_lora_rank), q (q_b or q_proj), kv_a, o, gate_up, down */
    const void *q_a_norm;              /* [q_lora_rank]; NULL without it */
    const void *kv_a_norm;             /* [kv_lora_rank] */
    const uint8_t *k_b;                /* attn_k_b: [heads rank, nope] blocks */
    const uint8_t *v_b;                /* attn_v_b: [heads v_dim, rank] blocks */
    int64_t k_b_type;
    int64_t v_b_type;
    void *cache;                   /* the layer's latent pool [pool tokens, 1, rank + rope] */
    const void *router;            /* [n_experts, hidden]: a mixture of experts; NULL: the dense MLP */
    const moe_projection *experts; /* [3]: the routed experts' gate, up, down (moe.c) */
    int64_t n_experts;
    int64_t top_k;
    int64_t expert_inner;
    float route_scale;             /* routed_scaling_factor */
    int64_t inner;                 /* gate_up / down's inner width: the dense MLP's or the shared experts' (0: none) */
} mla_layer;

/* A latent-attention model's sizes (decode_mla.py's MlaDims). */
typedef struct {
    int64_t hidden;
    int64_t heads;
    int64_t q_lora_rank;
    int64_t kv_lora_rank;
    int64_t nope_dim;
    int64_t rope_dim;
    int64_t v_dim;
    float eps;        /* the decoder's RMSNorm epsilon */
    float latent_eps; /* q_a's and kv_a's norms' */
    float scale;      /* the attention's softmax scale */
    int64_t dtype;
    int64_t kv_dtype;
} mla_dims;

#define HYBRID_IN_LINEARS 2 /* a hybrid_layer's input projection: its parts over up to two decode_linears */

/* One layer of a dense Qwen3.5 model for its one-call decode (decode_hybrid.c; decode_hybrid.py's
 * HybridLayer), float32 throughout. */
typedef struct {
    const void *input_norm;                   /* [hidden]: 1 + w, as HybridNorm folds it */
    const void *post_norm;                    /* [hidden] */
    decode_linear in_proj[HYBRID_IN_LINEARS]; /* in_proj (mixed | z | b | a) or qkv_proj ([q | gate] a head, k, v) */
    decode_linear out_proj;                   /* out_proj or o_proj */
    decode_linear gate_up;
    decode_linear down;
    int64_t linear;          /* 1: Gated DeltaNet; 0: gated full attention */
    void *k_cache;           /* full attention: its layer of the KV pool [pool tokens, kv_heads, head_dim] */
    void *v_cache;           /* as k_cache */
    const void *q_norm;      /* [head_dim]: 1 + w */
    const void *k_norm;      /* as q_norm */
    const void *conv_w;      /* Gated DeltaNet: [channels, conv_kernel] */
    void *conv_state;        /* [pool_slots, channels, conv_kernel - 1] */
    void *state;             /* [pool_slots, v_heads, dk, dv] */
    const void *a_log;       /* [v_heads] */
    const void *dt_bias;     /* [v_heads] */
    const void *norm_w;      /* [dv]: the gated norm's w */
} hybrid_layer;

/* A dense Qwen3.5 model's sizes for its one-call decode (decode_hybrid.py's HybridDims). */
typedef struct {
    int64_t hidden;
    int64_t inner;
    int64_t heads;       /* full attention */
    int64_t kv_heads;
    int64_t head_dim;
    int64_t rotary_dim;  /* the rotated first dims of each head */
    int64_t kv_dtype;    /* the KV pool's */
    int64_t k_heads;     /* Gated DeltaNet */
    int64_t v_heads;
    int64_t dk;
    int64_t dv;
    int64_t conv_kernel;
    int64_t tiled;       /* 1: value head h reads key head h % k_heads */
    int64_t linear_in;   /* the linear layers' in_proj columns */
    int64_t pool_slots;  /* rows of the state pools */
    float eps;           /* every RMSNorm's, the gated norm's too */
    float attn_scale;    /* the attention's scale */
    float delta_scale;   /* q's scale in the gated delta rule */
} hybrid_dims;

#define GEMMA4_LINEARS 6 /* a gemma4_layer's Linears: qkv, o, gate_up, down, per-layer gate, per-layer projection */

/* One Gemma 4 layer of decode_gemma4.c (decode_gemma4.py's Gemma4Layer), float32 throughout. */
typedef struct {
    const void *input_norm;               /* [hidden]: w (Gemma 4 scales by w) */
    const void *attn_out_norm;            /* [hidden]: the attention's output's, before its add */
    const void *post_norm;                /* [hidden]: before the MLP */
    const void *mlp_out_norm;             /* [hidden]: the MLP's output's, before its add */
    const void *per_layer_norm;           /* [hidden]: the per-layer input's projection's (with per_layer) */
    const void *q_norm;                   /* [head_dim] */
    const void *k_norm;                   /* [head_dim] (with writes_kv) */
    const void *v_norm;                   /* [head_dim]: ones (v is normed without a scale) */
    decode_linear linear[GEMMA4_LINEARS]; /* qkv is q alone where the layer shares its source's KV */
    void *k_cache;                        /* its pool layer (its source's, KV-shared) [pool tokens, kv_heads, head_dim] */
    void *v_cache;                        /* as k_cache */
    int64_t heads;
    int64_t kv_heads;
    int64_t head_dim;
    int64_t inner;      /* the MLP's width (twice the config's on a double-wide layer) */
    int64_t window;     /* > 0: a sliding layer's window; 0: all positions */
    int64_t rope_at;    /* its rotary table's place: the widths of the step's tables before it */
    int64_t writes_kv;  /* 1: projects, norms and writes its K/V; 0: KV-shared, q alone over the pool */
    int64_t k_eq_v;     /* 1: no v projection, v from k's (before k's norm) */
    int64_t per_layer;  /* its slice of the step's per-layer inputs; -1: none */
    float scale;        /* the attention's */
    float layer_scalar; /* the layer's output times it */
} gemma4_layer;

/* A Gemma 4 model's sizes for decode_gemma4 (decode_gemma4.py's Gemma4Dims). */
typedef struct {
    int64_t hidden;
    int64_t per_layer_dim;    /* the per-layer inputs' width (0: none) */
    int64_t per_layer_stride; /* elements between rows of the step's per-layer inputs (layers * dim) */
    int64_t kv_dtype;         /* the KV pool's */
    float eps;                /* every RMSNorm's */
} gemma4_dims;

/* decode_gemma4.c: a run of a Gemma 4 model's decoder layers over float32 decode rows, one token each,
 * as decode_layers (x may be out); per_layer [rows, per_layer_stride] or NULL. */
int decode_gemma4(const gemma4_layer *layers, int64_t n_layers, const gemma4_dims *dims, const float *x, float *out,
                  int64_t rows, const float *cos, const float *sin, const float *per_layer, const int64_t *q_rows,
                  const int64_t *req_pool_idx, const int64_t *kv_lens, const int64_t *page_table, int64_t pt_stride,
                  int64_t page_size);

/* A Gemma 4 model's input embeddings for decode_gemma4_inputs (decode_gemma4.py's Gemma4Inputs). */
typedef struct {
    const uint8_t *embed;           /* the token table's blocks [vocab, hidden] */
    const uint8_t *per_layer_table; /* the per-layer table's blocks [vocab, per_layer_stride] */
    const void *per_layer_norm;     /* [per_layer_dim]: the projection's per-layer RMSNorm */
    decode_linear projection;       /* hidden -> per_layer_stride */
    int64_t embed_type;             /* the tables' kernel types (layouts.py's kernel_type) */
    int64_t per_layer_type;
    float embed_scale;      /* sqrt(hidden), as the model's buffer holds it */
    float per_layer_scale;  /* sqrt(per_layer_dim), as above */
    float projection_scale; /* 1 / sqrt(hidden) */
    float mean_scale;       /* 1 / sqrt(2) */
    float eps;              /* the per-layer norm's */
} gemma4_inputs;

/* decode_gemma4.c: Gemma 4's step inputs, x [rows, hidden] and per_layer [rows, per_layer_stride], from
 * the token ids (decode_gemma4 then takes them). */
int decode_gemma4_inputs(const gemma4_inputs *in, const gemma4_dims *dims, const int64_t *ids, int64_t rows, float *x,
                         float *per_layer);

/* small_ops.c */
int kernel_isa(void);
void rms_norm(const void *x, int64_t x_stride, const void *w, void *out, int64_t rows, int dim, float eps, int dtype);
void rotary(void *x, int64_t x_stride, int64_t rows, int heads, int head_dim, const void *cos, const void *sin,
            int dtype);
void silu_mul_row(const void *gate_up, void *out, int inner, int dtype);
void silu_mul(const void *gate_up, void *out, int64_t rows, int inner, int dtype);
void act_mul_f32(float *g, const float *u, int n, int dtype, int gelu);
void gelu_tanh_mul(const void *gate_up, void *out, int64_t rows, int inner, int dtype);
void argmax_rows(const void *x, int64_t row_stride, int64_t rows, int n, int dtype, int64_t *out);
void softcap_f32(float *x, int64_t n, float cap);
void softcap_at(float *x, int64_t n, int64_t at, int64_t total, float cap);

/* matmul.c */
void matmul_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                 const uint16_t *residual, int64_t res_stride, uint16_t *out, int m, int n_out, int k);

/* attention.c: RV_ERR_HEADS, RV_ERR_DTYPE or RV_ERR_NO_MEMORY */
int paged_decode_attention(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                           void *out, int dtype, int kv_dtype, const int64_t *q_rows, const int64_t *req_pool_idx,
                           const int64_t *kv_lens, const int64_t *page_table, int64_t pt_stride, int64_t rows,
                           int num_heads, int kv_heads, int head_dim, int page_size, float scale,
                           const void *k_new, int64_t k_new_stride, const void *v_new, int64_t v_new_stride,
                           int64_t window, const float *sinks);

/* mla.c: latent attention's absorbed decode, every head over one shared KV row a position (the value
 * its first v_dim values; the cache float32, bfloat16, float16 or float8 e4m3). RV_ERR_HEADS, RV_ERR_DTYPE or
 * RV_ERR_NO_MEMORY */
int latent_decode_attention(const void *q, int64_t q_row_stride, const void *cache, void *out,
                            int64_t out_row_stride, int dtype, int kv_dtype, const int64_t *q_rows,
                            const int64_t *req_pool_idx, const int64_t *kv_lens, const int64_t *page_table,
                            int64_t pt_stride, int64_t rows, int num_heads, int dim, int v_dim, int page_size,
                            float scale);
/* Per head h < heads: y_h [rows, n] = x_h [rows, k] W_h^T, W_h the rows [h n, (h + 1) n) of w (blocks of
 * ``type`` in the file's layout); x_h's row r at r * x_stride + h * x_head elements of x, y_h's at
 * r * y_stride + h * y_head of y, one dtype. scratch: heads * rows * quant_act_row_bytes(type, k) bytes.
 * RV_ERR_TYPE, RV_ERR_K, RV_ERR_DTYPE or RV_ERR_NO_MEMORY */
int latent_heads_matmul(int type, const uint8_t *w, int64_t heads, int64_t n, int64_t k, const void *x,
                        int64_t x_stride, int64_t x_head, int64_t rows, void *scratch, void *y, int64_t y_stride,
                        int64_t y_head, int dtype);

/* quant.c, quant_dense.c */
int quant_supported(int type);
int64_t quant_act_row_bytes(int type, int64_t k);
int64_t quant_act8_block_bytes(void);
void quantize_act16(const float *x, int64_t k, void *xq);
void quantize_act8(const float *x, int64_t k, void *xq);
int quant_matmul(int type, const uint8_t *w, int64_t n, int64_t k, const void *x, int64_t x_stride, int x_dtype,
                 int64_t rows, void *scratch, void *y, int64_t y_stride, int y_dtype, const void *residual,
                 int64_t res_stride);
/* y [rows, inner] (contiguous) = act(x W_gate^T) * (x W_up^T), act silu or, where gelu, gelu_tanh:
 * quant_matmul's gate|up output [rows, 2 inner] in y_dtype and then silu_mul's (gelu_tanh_mul's) pass
 * over it, the same bits, in one call that never writes the gate|up output (each panel of gate's and
 * up's columns combined while in L1). W_gate, W_up: inner rows each of ``type`` blocks, laid out alike
 * (a merged gate|up's one part: W_up = W_gate + inner rows). scratch and statuses: quant_matmul's */
int quant_matmul_gated(int type, const uint8_t *w_gate, const uint8_t *w_up, int64_t inner, int64_t k,
                       const void *x, int64_t x_stride, int x_dtype, int64_t rows, void *scratch, void *y, int y_dtype,
                       int gelu);
int quant_matmul_dense(int type, const uint8_t *w, int64_t n, int64_t k, const void *x, int64_t x_stride,
                       int x_dtype, int64_t rows, void *y, int64_t y_stride, int y_dtype, const void *residual,
                       int64_t res_stride);
void quant_get_rows(int type, const uint8_t *w, int64_t k, const int64_t *ids, int64_t count, void *out,
                    int out_dtype);
/* out[r] = the first index of the largest value of row r of quant_matmul's (dense: quant_matmul_dense's)
 * y in x's dtype, soft-capped as softcap_f32 caps it where cap > 0 (float32 only), without writing y
 * (the LM head's greedy draw). scratch: quant_matmul's (NULL where dense). RV_ERR_DTYPE: bfloat16 with a cap */
int quant_matmul_argmax(int type, const uint8_t *w, int64_t n, int64_t k, const void *x, int64_t x_stride,
                        int x_dtype, int64_t rows, void *scratch, int dense, float cap, int64_t *out);

/* head_screen.c: a BF16 / F16 head's one-row greedy draw screened by an int8 copy, exact (the file's
 * top comment). head_screen_build: q [n, k] int8 (as bytes), scale [n], radius [n] from w; RV_ERR_DTYPE
 * where a weight is not finite. head_screen_argmax: out[0] = quant_matmul_argmax's index for the one
 * row x (not dense, no cap), out[1] = the candidates counted (-1: the full route ran), their rows and
 * exact values in cand / exact [max_cand]; approx: n floats of scratch. */
int head_screen_build(int type, const uint8_t *w, int64_t n, int64_t k, void *q, float *scale, float *radius);
int head_screen_argmax(int type, const uint8_t *w, int64_t n, int64_t k, const void *q, const float *scale,
                       const float *radius, const void *x, int x_dtype, int64_t max_cand, float *approx,
                       int64_t *cand, float *exact, int64_t *out);

/* moe.c */
int moe_experts(const moe_projection *proj, int64_t hidden, int64_t inner, const void *x, const int64_t *tokens,
                const void *weights, const int64_t *spans, int64_t n_spans, int64_t pairs, int64_t tokens_n,
                void *out, int dtype);
int moe_experts_clamped(const moe_projection *proj, int64_t hidden, int64_t inner, const void *x,
                        const int64_t *tokens, const void *weights, const int64_t *spans, int64_t n_spans,
                        int64_t pairs, int64_t tokens_n, void *out, int dtype, const void *gate_up_bias,
                        const void *down_bias, float alpha, float limit);
int moe_route(const void *x, int64_t rows, int64_t hidden, const void *w, int64_t n_experts, int64_t top_k,
              int norm_topk, int64_t *ids, void *weights, int dtype);
int moe_route_topk(const void *x, int64_t rows, int64_t hidden, const void *w, const void *bias, int64_t n_experts,
                   int64_t top_k, int64_t *ids, void *weights, int dtype);
int moe_group(const int64_t *ids, const void *weights, int64_t rows, int64_t top_k, int64_t n_experts,
              int64_t *tokens, void *w_sorted, int64_t *spans, int64_t *n_spans, int dtype);

/* decode_layers.c */
int decode_layers(const decode_layer *layers, int64_t n_layers, const decode_dims *dims, const void *x, void *out,
                  int64_t rows, const void *cos, const void *sin, const int64_t *q_rows, const int64_t *req_pool_idx,
                  const int64_t *kv_lens, const int64_t *page_table, int64_t pt_stride, int64_t page_size);

/* decode_mla.c: RV_ERR_DTYPE, RV_ERR_HEADS (a rope key past 256 values or odd, a pool row past 1024),
 * RV_ERR_NO_MEMORY, or a kernel's refusal */
int decode_mla(const mla_layer *layers, int64_t n_layers, const mla_dims *dims, const void *x, void *out,
               int64_t rows, const float *rope, const int64_t *q_rows, const int64_t *req_pool_idx,
               const int64_t *kv_lens, const int64_t *page_table, int64_t pt_stride, int64_t page_size);

/* decode_hybrid.c: a dense Qwen3.5 model's decoder layers over float32 decode rows, one token each
 * (slots: each row's state pool row), as decode_layers, from each row's token id (its embedding row of
 * the blocks embed; embed NULL: out holds the rows) and position (its rows of the rotary tables
 * [table_rows, rotary_dim]), then where final_norm is not NULL the final RMSNorm of out (weight
 * final_norm [hidden], 1 + w folded) into normed [rows, hidden]; RV_ERR_HEADS for an id, position or
 * slot out of range, or a kernel's refusal; and the small ops its gated attention shares
 * with the modules: rotary on each head's first rot_dim dims (heads head_stride apart), and out [rows,
 * heads, dim] = x * sigmoid(gate) (gate's rows gate_stride apart, its heads gate_head_stride). */
int decode_hybrid(const hybrid_layer *layers, int64_t n_layers, const hybrid_dims *dims, const int64_t *ids,
                  const uint8_t *embed, int embed_type, int64_t vocab, const int64_t *positions, int64_t table_rows,
                  const float *cos_table, const float *sin_table, float *out, int64_t rows, const int64_t *slots,
                  const int64_t *q_rows, const int64_t *req_pool_idx, const int64_t *kv_lens,
                  const int64_t *page_table, int64_t pt_stride, int64_t page_size, const float *final_norm,
                  float final_eps, float *normed);
void partial_rotary(void *x, int64_t x_stride, int64_t rows, int heads, int head_stride, int rot_dim, const void *cos,
                    const void *sin, int dtype);
void sigmoid_gate_mul(const void *x, const void *gate, int64_t gate_stride, int64_t gate_head_stride, void *out,
                      int64_t rows, int heads, int dim, int dtype);

/* gated_delta.c: RV_ERR_DTYPE, or RV_ERR_HEADS (head counts, head dims past MAX_HEAD_DIM, conv taps
 * past 8); prefill also RV_ERR_NO_MEMORY. States [slots, v_heads, dk, dv] float32, updated in place.
 * tiled: value head h reads key head h % k_heads (else h / (v_heads / k_heads)). */
int gated_delta_decode(const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                       int64_t v_stride, int dtype, const void *g, int64_t g_stride, int g_dtype, const void *beta,
                       int64_t beta_stride, int beta_dtype, float *state, const int64_t *slots,
                       const uint8_t *fresh, void *out, int64_t rows, int k_heads, int v_heads, int dk, int dv,
                       int tiled, int l2norm, float scale);
int gated_delta_prefill(const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                        int64_t v_stride, int dtype, const void *g, int64_t g_stride, int g_dtype, const void *beta,
                        int64_t beta_stride, int beta_dtype, float *state, const int64_t *slots,
                        const uint8_t *fresh, const int64_t *cu_seqlens, int64_t seqs, void *out, int k_heads,
                        int v_heads, int dk, int dv, int tiled, int l2norm, float scale);
int causal_conv1d(const void *x, int64_t x_stride, int dtype, void *out, void *conv_state, int state_dtype,
                  int64_t state_len, const int64_t *slots, const uint8_t *fresh, const int64_t *cu_seqlens,
                  int64_t seqs, const void *w, const void *bias, int64_t channels, int kernel, int silu);
/* A decode step's whole Gated DeltaNet block between its projections, float32, one token a row: the
 * conv1d and SiLU of mixed (q, k, v), the L2 norms and gates, the rule, the gated RMSNorm; out
 * [rows, v_heads * dv]; conv and recurrent states [pool_slots, ...] advanced at slots in place. */
int gated_delta_decode_step(const float *mixed, int64_t mixed_stride, const float *z, int64_t z_stride,
                            const float *b, int64_t b_stride, const float *a, int64_t a_stride, const float *conv_w,
                            int kernel, float *conv_state, int64_t state_len, float *state, int64_t pool_slots,
                            const int64_t *slots, int64_t rows, const float *a_log, const float *dt_bias,
                            const float *norm_w, float eps, int k_heads, int v_heads, int dk, int dv, int tiled,
                            float scale, float *scratch, float *out);

/* shm_allreduce.c (its dtype codes are shm_allreduce.py's: 0 float32, 2 float64) */
int64_t shm_region_bytes(int world, int64_t piece);
int shm_all_reduce(void *region, int rank, int world, int64_t piece, void *data, int64_t n, int dtype);

/* Whether the K-quants' tiles prefetch weights non-temporally (common.h's prefetch_weights); set
 * by kernels.py before any call. */
extern int weight_prefetch_nta;

/* quant.c: whether quant_matmul's outputs of its STREAM_BYTES or more (a many-row head's logits) go
 * to memory by streaming stores (1, the default; 0 times the plain stores in the same process). */
extern int quant_y_stream;

/* quant.c: whether quant_matmul_gated runs fused (1, the default) or as the quant_matmul and silu_mul
 * calls it stands for (0: both timed in one process by bench.worker_step --toggle quant_gated). */
extern int quant_gated;

/* quant.c: whether decode_layers.c's gated MLP writes the down projection's quantized rows straight
 * from its panels (1, the default; 0: its output written and quantized by the down's call; both timed
 * in one process by bench.worker_step --toggle quant_gated_q8). */
extern int quant_gated_q8;

/* head_screen.c: whether head_screen_argmax screens (1, the default) or runs the full route (0: the
 * screen off, or both timed in one process by bench.worker_step --toggle head_screen). */
extern int head_screen;

#endif
