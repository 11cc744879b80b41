/* Declarations of the native kernels that `cpu/blocks.c` and `cpu/forward.c`
 * chain, and the layer table of a whole forward; each source that defines one
 * includes this file, so the compiler checks that the two agree. */
#ifndef HYBRIDSPEC_CPU_KERNELS_H
#define HYBRIDSPEC_CPU_KERNELS_H

#include <math.h>
#include <stdint.h>

/* cpu/pool.c: parts 0 … parts - 1 of a job over the helper threads; returns 1,
 * or 0 (nothing run) where it cannot split: the caller then runs the job itself */
typedef void (*hs_part_fn)(void *ctx, int part, int parts);
int hs_parallel(hs_part_fn fn, void *ctx, int parts);
int hs_parallel_long(hs_part_fn fn, void *ctx, int parts); /* the same, never taken back whole */
/* a job of `units` independent units whose parts are contiguous ranges of them (part p of P: units
 * units·p/P … units·(p + 1)/P − 1), `work` floats in all: 0 (the caller runs it) below min_work or
 * with one thread; a short job one part per thread (hs_parallel), a long one (a prefill's recurrence)
 * a few parts per thread (hs_parallel_long), so a helper that claims late delays it less */
int hs_parallel_units(hs_part_fn fn, void *ctx, int64_t units, int64_t work, int64_t min_work);
int hs_set_threads(int threads);
int hs_threads(void);
int hs_set_pinning(int on); /* bind each helper to one CPU (1) or not (0, the default) */

/* The products' weights (`w` here, the blocks' `*_t`, the LM head and the embedding): the
 * address of float32 data, or of bfloat16 / float16 data with HS_BF16_WEIGHT / HS_F16_WEIGHT
 * set (an exact copy of a float32 weight whose every value is a bfloat16 / float16 one; cpu/rows.c,
 * "weight storage"), and HS_PANELS set where the data lies in panels; at least 8-byte aligned, so
 * that the low bits are free for these tags. The other kernels pass them on. */
#define HS_BF16_WEIGHT 1
#define HS_F16_WEIGHT 2
#define HS_WEIGHT_TYPE 3 /* the bits that say the type */
/* both bits: bfloat16 data multiplied in bfloat16 compute (activations rounded to bfloat16, AVX512-BF16
 * dot products, float32 sums; not the float32 bits: the opt-in fast path, cpu/rows_bf16.c) */
#define HS_BF16_COMPUTE 3
/* the weight lies in panels (cpu/panels.c, what `pack_for_cpu` stores), not input-major: with the type's bits */
#define HS_PANELS 4
#define PANEL 64 /* columns per panel (`panels.PANEL`) */
#define HS_WEIGHT_TAGS 7 /* every bit an address carries, but HS_QUANT's */
/* a quantized weight (GGUF blocks, cpu/quant.c): the address of its header, int64 {format, the
 * blocks' address}, 16-byte aligned; no other tag with it */
#define HS_QUANT 8
#define HS_Q8_0 0 /* the formats' codes (`formats.BlockFormat.code`) */
#define HS_Q4_0 1
#define HS_Q4_K 2
#define HS_Q6_K 3
#define HS_X16 16 /* with a format's code: laid out for the products (`QuantWeight.interleaved`): Q4_K's rows
                   interleaved by 16 (cpu/quant.c), Q6_K's super-blocks in planes (cpu/quant_q6k.h) */
/* cpu/quant_rows.c: row `row` of a quantized weight [N, K] as float32 (`formats.dequantize`'s values) */
int hs_quant_row(const uint8_t *w, int fmt, int64_t K, int64_t row, float *out);
int hs_quant_matmul(const float *x, int64_t ldx, const uint8_t *w, int fmt, int64_t M, int64_t K, int64_t N,
                    float *y);
/* cpu/quant.c: a Q6_K product's rows' best `top` columns by a coarse pass, the product's outputs there,
   −∞ elsewhere, and each row's argmax (a greedy draft's LM head) */
int hs_quant_top(const float *x, int64_t ldx, const uint8_t *w, int fmt, int64_t M, int64_t K, int64_t N,
                 int64_t top, float *y, int64_t *best);
int hs_bf16_supported(void);
void hs_round_pairs(const float *x, int64_t ldx, int64_t M, int64_t K, uint32_t *xp);
void hs_panel_columns(const float *x, int64_t ldx, const uint32_t *xp, const void *w, int type, int64_t M,
                      int64_t K, float *y, int64_t ldy, int64_t c0, int64_t c1);
void hs_bf16_columns(const float *x, int64_t ldx, const uint16_t *w, int64_t M, int64_t K, int64_t N, float *y,
                     int64_t ldy, int64_t c0, int64_t c1);
int hs_rows_matmul(const float *x, int64_t ldx, const float *w, int64_t M, int64_t K, int64_t N, float *y);
int hs_rows_matmul_many(const float *x, int64_t ldx, int64_t M, int64_t K, int count, const float *const *w,
                        const int64_t *N, float *const *y);
int hs_rows_isa(int choice);
/* cpu/pointwise.c: softplus / sigmoid with every output the scalar libm value (see there) */
#define HS_SOFTPLUS 0
#define HS_SIGMOID 1
int hs_pointwise(int fn, const float *x, float *y, int64_t n);
/* softplus(v) as torch computes it with beta 1, threshold 20, in libm's scalar functions */
static inline float hs_softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }
int hs_rms_norm(const float *x, int64_t ldx, const float *gate, int64_t ldg, const float *w, float *out,
                int64_t rows, int64_t n, int64_t group, float eps);
/* A forward over a tree of inputs (NULL: a chain, input t's parent t - 1): per input b·T + t, its
 * parent input (`parents`: -1 for the row's head, slot src[b]; else an earlier input, whose state
 * the recurrences read from its snapshot slot dst[b·T + parent], or for t - 1 from their scratch),
 * its depth (the root's 0: its position is start + depth) and the inputs it sees (bit s: input s;
 * itself and its ancestors). The recurrences and the conv window take `parents` alone. */
#define HS_TREE_MAX_INPUTS 64
typedef struct {
    const int64_t *parents, *depths;
    const uint64_t *seen;
} hs_tree;
/* whether parents [batch, T] names a tree the recurrences can run: each parent -1 or an earlier
 * input, whose state is in its snapshot slot unless it is the input just before (NULL: a chain) */
static inline int hs_parents_ok(const int64_t *parents, const int64_t *dst, int64_t batch, int64_t T) {
    for (int64_t r = 0; parents && r < batch * T; ++r) {
        const int64_t t = r % T, p = parents[r];
        if (p < -1 || p >= t || (p >= 0 && p != t - 1 && dst[r - t + p] < 0)) return 0;
    }
    return 1;
}
int hs_conv_window_steps(float *states, const int64_t *src, const int64_t *dst,
                         const float *xs, int64_t sxb, int64_t sxt, const float *weight, const float *bias,
                         int64_t silu, float *out, int64_t batch, int64_t T, int64_t conv_dim, int64_t d_conv,
                         const int64_t *parents);
int hs_mamba2_steps(float *states, const int64_t *src, const int64_t *dst, float *scratch,
                    const float *x, int64_t sxb, int64_t sxt, int64_t sxh,
                    const float *dt, int64_t sdb, int64_t sdt,
                    const float *A, const float *D,
                    const float *B, int64_t sBb, int64_t sBt, int64_t sBg,
                    const float *C, int64_t sCb, int64_t sCt, int64_t sCg,
                    float *y, int64_t batch, int64_t T, int64_t nheads, int64_t headdim, int64_t d_state,
                    int64_t ngroups, const int64_t *parents);
int hs_mamba1_steps(float *states, const int64_t *src, const int64_t *dst,
                    const float *x, int64_t sxb, int64_t sxt, const float *dt, int64_t sdb, int64_t sdt,
                    const float *A, const float *B, int64_t sBb, int64_t sBt, const float *C, int64_t sCb,
                    int64_t sCt, const float *D, float *y, int64_t batch, int64_t T, int64_t d_inner,
                    int64_t d_state, const int64_t *parents);
#define GDN_MAX_DK 256 /* the largest d_k hs_gdn_steps takes (its scratch block is on the stack) */
int hs_gdn_steps(float *states, const int64_t *src, const int64_t *dst,
                 const float *q, int64_t sqb, int64_t sqt, int64_t sqh,
                 const float *k, int64_t skb, int64_t skt, int64_t skh,
                 const float *v, int64_t svb, int64_t svt, int64_t svh,
                 const float *g, int64_t sgb, int64_t sgt, const float *beta, int64_t sbb, int64_t sbt,
                 float *o, int64_t batch, int64_t T, int64_t heads, int64_t key_heads, int64_t d_k, int64_t d_v,
                 const int64_t *parents);
int hs_rope(const float *x, const float *cos, const float *sin, int64_t ldc, float *out, int64_t rows,
            int64_t heads, int64_t head_dim, int64_t half);

/* each block returns out = h + residual · update (residual: the layer's residual multiplier, 1 for most
 * models; update · residual rounded, then the sum, as torch's h + update * residual) */
int hs_mlp_block(const float *h, const float *norm_w, float eps, const float *gate_t, const float *up_t,
                 const float *down_t, float *work, float *out, int64_t rows, int64_t hidden, int64_t inter,
                 float residual);
int hs_mamba2_block(const float *h, const float *norm_w, float eps, const float *in_t,
                    float *conv_states, float *ssm_states, const int64_t *src, const int64_t *dst,
                    const float *conv_w, const float *conv_b, const float *dt_bias, const float *A, const float *D,
                    const float *gate_norm_w, int64_t group, const float *out_t, float *work, float *logged,
                    float *out, int64_t batch, int64_t T, int64_t hidden, int64_t d_inner, int64_t nheads,
                    int64_t headdim, int64_t ngroups, int64_t d_state, int64_t d_conv, float residual,
                    const hs_tree *tree);
int hs_attention_block(const float *h, const float *norm_w, float eps, const float *q_t, const float *k_t,
                       const float *v_t, const float *o_t, const float *inv_freq, int64_t half,
                       float *k_cache, float *v_cache, const int64_t *slot_mapping, const int64_t *block_tables,
                       int64_t max_blocks, int64_t block_size, const int64_t *context_lens,
                       const int64_t *query_lens, float scale, float *work, float *out, int64_t batch, int64_t T,
                       int64_t hidden, int64_t nheads, int64_t kv_heads, int64_t head_dim, float residual,
                       const hs_tree *tree);

/* The mixers and the MLP of one decoder layer (`cpu/forward.py` fills it from the
 * modules and one cache, once): the weights and sizes the blocks take, and the
 * layer's state pools or K/V pages. */
enum { HS_NO_MIXER = 0, HS_MAMBA2 = 1, HS_ATTENTION = 2 };
typedef struct {
    int64_t mixer, mlp;  /* mixer: HS_NO_MIXER, HS_MAMBA2 or HS_ATTENTION; mlp: 0 or 1 */
    const float *mixer_norm, *mlp_norm;
    float mixer_eps, mlp_eps;
    /* Mamba-2 mixer */
    const float *in_t, *conv_w, *conv_b, *dt_bias, *A, *D, *gate_norm_w, *out_t;
    float *conv_states, *ssm_states;
    int64_t group, d_inner, nheads, head_dim, ngroups, d_state, d_conv;
    /* attention mixer */
    const float *q_t, *k_t, *v_t, *o_t, *inv_freq;
    float *k_cache, *v_cache;
    int64_t half, heads, kv_heads, attn_head_dim, block_size;
    float scale;
    /* gated SiLU MLP */
    const float *gate_t, *up_t, *down_t;
    int64_t inter;
    float residual;  /* the residual multiplier of both blocks (1: none) */
} hs_layer;

/* One forward of few rows: the per-forward pointers beside the static table. */
typedef struct {
    const hs_layer *layers;
    int64_t num_layers;
    const int64_t *ids;                 /* [batch, T] token ids */
    const float *embed;                 /* [vocab, hidden] at strides (embed_row, embed_col); HS_WEIGHT_TYPE,
                                           HS_PANELS or HS_QUANT (a quantized table's header) */
    int64_t embed_row, embed_col, batch, T, hidden, vocab;
    const int64_t *src, *snap;          /* the slot plan: [batch] and [batch, T] */
    const int64_t *slot_mapping, *block_tables, *context_lens, *query_lens;  /* the K/V plan */
    int64_t max_blocks;
    float *const *logged;               /* [num_layers]: where a Mamba-2 layer's inputs go, or NULL */
    const int64_t *last_index;          /* [batch] the input whose logits are kept; NULL: every input */
    const float *final_norm;
    float final_eps;
    const float *lm_head_t;             /* [hidden, vocab] input-major */
    float *work;
    int64_t work_size;                  /* floats at work */
    float *out;
    float embed_scale;                  /* the embeddings times it (1: none) */
    float logits_scale;                 /* the logits divided by it (1: none) */
    const int64_t *hidden_points;       /* [num_layers + 1]: point i (the stream entering layer i; num_layers:
                                           the last layer's output) goes to hidden_out's slot k, -1: not kept */
    int64_t num_points;                 /* slots per input of hidden_out */
    float *hidden_out;                  /* [batch, T, num_points, hidden], or NULL: no hidden state kept */
    /* an MTP layer's input (models/mtp.py), or NULL: the stream starts at fc([norm_e(embedding);
       norm_h(hidden_in)]) instead of the embedding */
    const float *mtp_fc;                /* [2 · hidden -> hidden] product weight (HS_WEIGHT_TYPE bits) */
    const float *mtp_norm_e, *mtp_norm_h;
    float mtp_eps;
    const float *hidden_in;             /* [batch, T, hidden] the hidden state beside each input */
    float *normed_out;                  /* [kept rows, hidden] the final-normed rows the LM head reads, or NULL */
    /* [batch, T] each input's parent input (hs_tree), or NULL: a chain. With it every input's state goes
       to its snapshot slot (snap), which a child reads, and T ≤ HS_TREE_MAX_INPUTS */
    const int64_t *parents;
    /* > 0, where the LM head is Q6_K and the vocabulary larger: only each kept row's argmax is wanted
       (a greedy draft's step), out gets the head's outputs at the head_top columns a coarse pass ranks
       best (`hs_quant_top`) and −∞ elsewhere; 0: every logit */
    int64_t head_top;
} hs_forward_args;

int hs_forward(const hs_forward_args *a);
int hs_greedy_steps(const hs_forward_args *a, int64_t steps, const int64_t *plan, int64_t *tokens, float *logits);
int hs_extend_greedy(const hs_forward_args *first, const hs_forward_args *a, int64_t steps, const int64_t *plan,
                     int64_t *tokens, float *logits);

/* One struct of each kernel's arguments, for ctypes (`cpu/calls.c`, `cpu_native.ARGUMENTS`). */
typedef struct {
    void *x;
    int64_t ldx;
    void *gate;
    int64_t ldg;
    void *w;
    void *out;
    int64_t rows;
    int64_t n;
    int64_t group;
    float eps;
} hs_rms_norm_args;
int hs_rms_norm_call(const hs_rms_norm_args *a);

typedef struct {
    void *states;
    void *src;
    void *dst;
    void *xs;
    int64_t sxb;
    int64_t sxt;
    void *weight;
    void *bias;
    int64_t silu;
    void *out;
    int64_t batch;
    int64_t T;
    int64_t conv_dim;
    int64_t d_conv;
    void *parents;
} hs_conv_window_steps_args;
int hs_conv_window_steps_call(const hs_conv_window_steps_args *a);

typedef struct {
    void *states;
    void *src;
    void *dst;
    void *scratch;
    void *x;
    int64_t sxb;
    int64_t sxt;
    int64_t sxh;
    void *dt;
    int64_t sdb;
    int64_t sdt;
    void *A;
    void *D;
    void *B;
    int64_t sBb;
    int64_t sBt;
    int64_t sBg;
    void *C;
    int64_t sCb;
    int64_t sCt;
    int64_t sCg;
    void *y;
    int64_t batch;
    int64_t T;
    int64_t nheads;
    int64_t headdim;
    int64_t d_state;
    int64_t ngroups;
    void *parents;
} hs_mamba2_steps_args;
int hs_mamba2_steps_call(const hs_mamba2_steps_args *a);

typedef struct {
    void *states;
    void *src;
    void *dst;
    void *x;
    int64_t sxb;
    int64_t sxt;
    void *dt;
    int64_t sdb;
    int64_t sdt;
    void *A;
    void *B;
    int64_t sBb;
    int64_t sBt;
    void *C;
    int64_t sCb;
    int64_t sCt;
    void *D;
    void *y;
    int64_t batch;
    int64_t T;
    int64_t d_inner;
    int64_t d_state;
    void *parents;
} hs_mamba1_steps_args;
int hs_mamba1_steps_call(const hs_mamba1_steps_args *a);

typedef struct {
    void *states;
    void *src;
    void *dst;
    void *q;
    int64_t sqb;
    int64_t sqt;
    int64_t sqh;
    void *k;
    int64_t skb;
    int64_t skt;
    int64_t skh;
    void *v;
    int64_t svb;
    int64_t svt;
    int64_t svh;
    void *g;
    int64_t sgb;
    int64_t sgt;
    void *beta;
    int64_t sbb;
    int64_t sbt;
    void *o;
    int64_t batch;
    int64_t T;
    int64_t heads;
    int64_t key_heads;
    int64_t d_k;
    int64_t d_v;
    void *parents;
} hs_gdn_steps_args;
int hs_gdn_steps_call(const hs_gdn_steps_args *a);

typedef struct {
    void *x;
    void *cos;
    void *sin;
    int64_t ldc;
    void *out;
    int64_t rows;
    int64_t heads;
    int64_t head_dim;
    int64_t half;
} hs_rope_args;
int hs_rope_call(const hs_rope_args *a);

typedef struct {
    void *h;
    void *norm_w;
    float eps;
    void *gate_t;
    void *up_t;
    void *down_t;
    void *work;
    void *out;
    int64_t rows;
    int64_t hidden;
    int64_t inter;
    float residual;
} hs_mlp_block_args;
int hs_mlp_block_call(const hs_mlp_block_args *a);

typedef struct {
    void *h;
    void *norm_w;
    float eps;
    void *in_t;
    void *conv_states;
    void *ssm_states;
    void *src;
    void *dst;
    void *conv_w;
    void *conv_b;
    void *dt_bias;
    void *A;
    void *D;
    void *gate_norm_w;
    int64_t group;
    void *out_t;
    void *work;
    void *logged;
    void *out;
    int64_t batch;
    int64_t T;
    int64_t hidden;
    int64_t d_inner;
    int64_t nheads;
    int64_t headdim;
    int64_t ngroups;
    int64_t d_state;
    int64_t d_conv;
    float residual;
} hs_mamba2_block_args;
int hs_mamba2_block_call(const hs_mamba2_block_args *a);

typedef struct {
    void *h;
    void *norm_w;
    float eps;
    void *q_t;
    void *k_t;
    void *v_t;
    void *o_t;
    void *inv_freq;
    int64_t half;
    void *k_cache;
    void *v_cache;
    void *slot_mapping;
    void *block_tables;
    int64_t max_blocks;
    int64_t block_size;
    void *context_lens;
    void *query_lens;
    float scale;
    void *work;
    void *out;
    int64_t batch;
    int64_t T;
    int64_t hidden;
    int64_t nheads;
    int64_t kv_heads;
    int64_t head_dim;
    float residual;
} hs_attention_block_args;
int hs_attention_block_call(const hs_attention_block_args *a);

#endif
