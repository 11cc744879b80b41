/* A whole forward of few rows (decode, drafting, a verify) in one call, on
 * x86 CPUs: the token embeddings (times the embedding multiplier), every
 * decoder layer's blocks (the `cpu/blocks.c` functions, in the modules'
 * order, with the layer's residual multiplier), each row's kept input, the
 * final norm, the LM head and the logits scaling.
 *
 * The layer table (`hs_layer`, one per decoder layer) is made once per model
 * and cache by `cpu/forward.py`; the per-forward pointers (token ids, slot
 * plan, K/V plan, input logs) come in `hs_forward_args`. Every step is the
 * function the per-layer path calls with the same arguments, so the logits,
 * states, conv windows, K/V and logged inputs are the per-layer path's, bit
 * for bit. Returns 0 (all logits finite), 1 (done, some logit NaN or
 * infinite), -2 (a token id outside the vocabulary, nothing written) or -1
 * (arguments not taken: checked before anything is written, except what a
 * block finds wrong, when only the slots and pages the plan reserved for
 * this forward may have been written and the caller aborts it).
 *
 * With `parents` the inputs form a tree (`hs_tree`): each input's recurrent
 * state and conv window from its parent's, its position start + depth, its
 * attention over the context and its ancestors; every input's state goes to
 * its snapshot slot, so the commit of a tree round moves the ring head to
 * the accepted input's slot. An input gets the bits the chain along its
 * path gives it (a chain passed as a tree: the chain's bits).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* floats of work a layer's blocks take for `rows` rows (the sizes `cpu/blocks.py` computes) */
static int64_t layer_work(const hs_layer *l, const hs_forward_args *a, int64_t max_context) {
    const int64_t rows = a->batch * a->T;
    int64_t need = 0;
    if (l->mixer == HS_MAMBA2) {
        const int64_t conv_dim = l->d_inner + 2 * l->ngroups * l->d_state;
        const int64_t proj = l->d_inner + conv_dim + l->nheads;
        need = rows * (a->hidden + proj + conv_dim + l->nheads + 2 * l->d_inner) + l->head_dim * l->d_state;
    } else if (l->mixer == HS_ATTENTION) {
        need = rows * (a->hidden + 2 * (l->heads + l->kv_heads) * l->attn_head_dim + 2 * l->half)
               + a->T * l->heads * max_context;
    }
    if (l->mlp) need = max64(need, rows * (a->hidden + 2 * l->inter));
    return need;
}

/* the embedding table's value c of token t, widened from 16 bits: the table [vocab, hidden] at
 * strides (embed_row, embed_col), or (HS_PANELS) the LM head's panels it is tied to, where token t
 * is column t of the head's [hidden, vocab] (cpu/panels.c's layout, R rows side by side) */
static inline float embed_value(const hs_forward_args *a, const void *w, uintptr_t type, int panels, int64_t t,
                                int64_t c) {
    const int64_t R = type == HS_BF16_WEIGHT ? 2 : 1;
    const int64_t at = panels ? (t / PANEL * ((a->hidden + R - 1) / R) + c / R) * PANEL * R + t % PANEL * R + c % R
                              : t * a->embed_row + c * a->embed_col;
    return type == HS_F16_WEIGHT ? f16_value(((const uint16_t *)w)[at])
           : type == HS_BF16_WEIGHT ? bf16_value(((const uint16_t *)w)[at]) : ((const float *)w)[at];
}

/* point i of the layer stack (h: [batch · T, hidden]) into its slot of a->hidden_out, where kept */
static void keep_hidden(const hs_forward_args *a, int64_t point, const float *h) {
    if (!a->hidden_out || a->hidden_points[point] < 0) return;
    const int64_t rows = a->batch * a->T, hidden = a->hidden, k = a->hidden_points[point];
    for (int64_t r = 0; r < rows; ++r)
        memcpy(a->hidden_out + (r * a->num_points + k) * hidden, h + r * hidden, sizeof(float) * (size_t)hidden);
}

static int forward(const hs_forward_args *a, const hs_tree *tree) {
    const int64_t rows = a->batch * a->T, hidden = a->hidden;
    if (rows < 1 || hidden < 1 || a->num_layers < 0 || (a->hidden_out && (!a->hidden_points || a->num_points < 1)))
        return -1;
    const int64_t kept = a->last_index ? a->batch : rows;
    int64_t max_context = 0;
    for (int64_t b = 0; a->context_lens && b < a->batch; ++b) max_context = max64(max_context, a->context_lens[b]);
    int64_t need = 0;
    for (int64_t i = 0; i < a->num_layers; ++i) {
        const hs_layer *l = a->layers + i;
        if (l->mixer == HS_ATTENTION && (!a->slot_mapping || l->kv_heads < 1 || l->heads % l->kv_heads)) return -1;
        if (l->mixer == HS_MAMBA2 && !a->src) return -1;
        need = max64(need, layer_work(l, a, max_context));
    }
    if (a->mtp_fc) need = max64(need, 4 * rows * hidden);  /* the MTP input: its two norms' rows, side by side */
    float *h = a->work, *next = h + rows * hidden, *normed = next + rows * hidden, *blocks = normed + kept * hidden;
    if (3 * rows * hidden + need > a->work_size) return -1;
    for (int64_t r = 0; r < rows; ++r)
        if (a->ids[r] < 0 || a->ids[r] >= a->vocab) return -2;
    const uintptr_t embed = (uintptr_t)a->embed, type = embed & HS_WEIGHT_TYPE;
    if (type == HS_WEIGHT_TYPE) return -1;
    const void *table = (const void *)(embed & ~(uintptr_t)(HS_QUANT | HS_WEIGHT_TAGS));
    const int panels = (embed & HS_PANELS) != 0;
    for (int64_t r = 0; r < rows; ++r) {  /* the embeddings, copied (a 16-bit table's widened, a quantized one's
                                             rows dequantized: the header {format, blocks}) */
        if (embed & HS_QUANT) {
            const int64_t *header = table;
            if (hs_quant_row((const uint8_t *)(uintptr_t)header[1], (int)header[0], hidden, a->ids[r], h + r * hidden))
                return -1;
        } else if (!type && !panels && a->embed_col == 1)
            memcpy(h + r * hidden, a->embed + a->ids[r] * a->embed_row, sizeof(float) * (size_t)hidden);
        else
            for (int64_t c = 0; c < hidden; ++c) h[r * hidden + c] = embed_value(a, table, type, panels, a->ids[r], c);
    }
    if (a->embed_scale != 1.0f)  /* the embedding multiplier: each value times it, as torch's h * m */
        for (int64_t i = 0; i < rows * hidden; ++i) h[i] *= a->embed_scale;
    if (a->mtp_fc) {  /* an MTP layer's input, in the blocks' scratch before any block runs */
        if (!a->hidden_in || !a->mtp_norm_e || !a->mtp_norm_h) return -1;
        float *e = blocks + 2 * rows * hidden, *hn = e + rows * hidden;  /* each norm's rows, then side by side */
        if (hs_rms_norm(h, hidden, 0, 0, a->mtp_norm_e, e, rows, hidden, hidden, a->mtp_eps)
            || hs_rms_norm(a->hidden_in, hidden, 0, 0, a->mtp_norm_h, hn, rows, hidden, hidden, a->mtp_eps))
            return -1;
        for (int64_t r = 0; r < rows; ++r) {
            memcpy(blocks + r * 2 * hidden, e + r * hidden, sizeof(float) * (size_t)hidden);
            memcpy(blocks + r * 2 * hidden + hidden, hn + r * hidden, sizeof(float) * (size_t)hidden);
        }
        if (hs_rows_matmul(blocks, 2 * hidden, a->mtp_fc, rows, 2 * hidden, hidden, h)) return -1;
    }
    for (int64_t i = 0; i < a->num_layers; ++i) {
        const hs_layer *l = a->layers + i;
        float *t;
        keep_hidden(a, i, h);
        if (l->mixer == HS_MAMBA2) {
            if (hs_mamba2_block(h, l->mixer_norm, l->mixer_eps, l->in_t, l->conv_states, l->ssm_states, a->src,
                                a->snap, l->conv_w, l->conv_b, l->dt_bias, l->A, l->D, l->gate_norm_w, l->group,
                                l->out_t, blocks, a->logged ? a->logged[i] : 0, next, a->batch, a->T, hidden,
                                l->d_inner, l->nheads, l->head_dim, l->ngroups, l->d_state, l->d_conv,
                                l->residual, tree)) return -1;
            t = h, h = next, next = t;
        } else if (l->mixer == HS_ATTENTION) {
            if (hs_attention_block(h, l->mixer_norm, l->mixer_eps, l->q_t, l->k_t, l->v_t, l->o_t, l->inv_freq,
                                   l->half, l->k_cache, l->v_cache, a->slot_mapping, a->block_tables, a->max_blocks,
                                   l->block_size, a->context_lens, a->query_lens, l->scale, blocks, next, a->batch,
                                   a->T, hidden, l->heads, l->kv_heads, l->attn_head_dim, l->residual, tree)) return -1;
            t = h, h = next, next = t;
        }
        if (l->mlp) {
            if (hs_mlp_block(h, l->mlp_norm, l->mlp_eps, l->gate_t, l->up_t, l->down_t, blocks, next, rows, hidden,
                             l->inter, l->residual)) return -1;
            t = h, h = next, next = t;
        }
    }
    keep_hidden(a, a->num_layers, h);
    if (a->last_index)  /* each row's kept input */
        for (int64_t b = 0; b < a->batch; ++b) {
            if (a->last_index[b] < 0 || a->last_index[b] >= rows) return -1;
            memcpy(next + b * hidden, h + a->last_index[b] * hidden, sizeof(float) * (size_t)hidden);
        }
    const float *last = a->last_index ? next : h;
    if (hs_rms_norm(last, hidden, 0, 0, a->final_norm, normed, kept, hidden, hidden, a->final_eps)) return -1;
    if (a->normed_out) memcpy(a->normed_out, normed, sizeof(float) * (size_t)(kept * hidden));
    const uintptr_t head = (uintptr_t)a->lm_head_t;
    const int64_t *head_header = (const int64_t *)(head & ~(uintptr_t)(HS_QUANT | HS_WEIGHT_TAGS));
    /* the argmax only: the head's best columns, −∞ elsewhere (−∞ stays −∞ when scaled) */
    const int coarse = a->head_top > 0 && a->vocab > a->head_top && (head & HS_QUANT)
                       && (head_header[0] & ~HS_X16) == HS_Q6_K && a->logits_scale > 0.0f;
    int status = 0; /* hs_quant_top's: 1 where a kept output is not finite */
    if (coarse) {
        status = hs_quant_top(normed, hidden, (const uint8_t *)(uintptr_t)head_header[1], (int)head_header[0],
                              kept, hidden, a->vocab, a->head_top, a->out, NULL);
        if (status < 0) return -1;
    } else if (hs_rows_matmul(normed, hidden, a->lm_head_t, kept, hidden, a->vocab, a->out)) {
        return -1;
    }
    if (a->logits_scale != 1.0f)  /* the logits scaling: each logit divided by it, as torch's logits / s */
        for (int64_t i = 0; i < kept * a->vocab; ++i) a->out[i] /= a->logits_scale;
    if (coarse) return status; /* the columns left out are −∞ */
    for (int64_t i = 0; i < kept * a->vocab; ++i)
        if (!isfinite(a->out[i])) return 1;
    return 0;
}

/* depths and seen of the tree a->parents names (`hs_tree`), checked: each parent -1 or an earlier input
 * of the row, whose state a Mamba-2 layer finds in its snapshot slot (input t - 1's: in its scratch) */
static int tree_of(const hs_forward_args *a, int64_t *depths, uint64_t *seen) {
    const int64_t T = a->T;
    int mamba = 0;
    for (int64_t i = 0; i < a->num_layers; ++i) mamba |= a->layers[i].mixer == HS_MAMBA2;
    if (T > HS_TREE_MAX_INPUTS || (mamba && !a->snap)) return -1;
    for (int64_t b = 0; b < a->batch; ++b)
        for (int64_t t = 0; t < T; ++t) {
            const int64_t r = b * T + t, p = a->parents[r];
            if (p < -1 || p >= t || (p >= 0 && p != t - 1 && mamba && a->snap[b * T + p] < 0)) return -1;
            depths[r] = p < 0 ? 0 : depths[b * T + p] + 1;
            seen[r] = (p < 0 ? 0 : seen[b * T + p]) | (uint64_t)1 << t;
        }
    return 0;
}

int hs_forward(const hs_forward_args *a) {
    if (!a->parents) return forward(a, 0);
    const int64_t rows = a->batch * a->T;
    if (rows < 1) return -1;
    int64_t *depths = malloc(sizeof(int64_t) * (size_t)rows);
    uint64_t *seen = malloc(sizeof(uint64_t) * (size_t)rows);
    const hs_tree tree = {a->parents, depths, seen};
    const int status = !depths || !seen || tree_of(a, depths, seen) ? -1 : forward(a, &tree);
    free(depths);
    free(seen);
    return status;
}

/* tokens[b] = argmax of logits[b] ([batch, vocab]), the first of ties winning as in torch.argmax */
static void argmax_rows(const float *logits, int64_t batch, int64_t vocab, int64_t *tokens) {
    for (int64_t b = 0; b < batch; ++b) {
        const float *row = logits + b * vocab;
        int64_t best = 0;
        for (int64_t v = 1; v < vocab; ++v)
            if (row[v] > row[best]) best = v;
        tokens[b] = best;
    }
}

/* `steps` greedy decode steps of one input per row, each step's input the
 * argmax of the last step's logits (the first ties win, as torch.argmax), in
 * one call: a drafter's γ - 1 forwards after its catch-up. `a` is set up as for
 * one decode step (T = 1, the LM head in C, no input logs); per step s,
 * `plan` holds [src | snap | slot_mapping | context_lens] of the batch (4 ·
 * batch values), and `tokens` [steps + 1, batch] starts with the first inputs
 * and receives each step's argmax; `logits` [steps, batch, vocab]. Returns
 * what `hs_forward` returns for the first step that is not 0, else 0. */
int hs_greedy_steps(const hs_forward_args *a, int64_t steps, const int64_t *plan, int64_t *tokens, float *logits) {
    if (a->T != 1 || a->parents || !a->lm_head_t || a->logged || a->last_index || a->hidden_out || steps < 1) return -1;
    const int64_t batch = a->batch, vocab = a->vocab;
    for (int64_t s = 0; s < steps; ++s) {
        hs_forward_args step = *a;
        const int64_t *at = plan + 4 * batch * s;
        step.ids = tokens + s * batch;
        if (a->src) step.src = at, step.snap = at + batch;
        if (a->slot_mapping) step.slot_mapping = at + 2 * batch, step.context_lens = at + 3 * batch;
        step.out = logits + s * batch * vocab;
        const int status = hs_forward(&step);
        if (status) return status;
        argmax_rows(step.out, batch, vocab, tokens + (s + 1) * batch);
    }
    return 0;
}

/* A greedy drafter's catch-up and its greedy steps in one call: `first` one
 * forward (any T; each row's last input kept, the LM head in C) whose logits
 * go to logits[0] ([batch, vocab]) and whose argmax becomes tokens[0 … batch);
 * then `steps` steps of `hs_greedy_steps` from those tokens (`a`, plan,
 * tokens, logits + batch · vocab). Returns what the first call that is not 0
 * returns, else 0. */
int hs_extend_greedy(const hs_forward_args *first, const hs_forward_args *a, int64_t steps, const int64_t *plan,
                     int64_t *tokens, float *logits) {
    if (first->parents || !first->lm_head_t || first->logged || first->hidden_out || first->batch != a->batch
        || first->vocab != a->vocab || (first->T > 1 && !first->last_index) || steps < 0) return -1;
    const int64_t batch = a->batch, vocab = a->vocab;
    hs_forward_args f = *first;
    f.out = logits;
    const int status = hs_forward(&f);
    if (status) return status;
    argmax_rows(logits, batch, vocab, tokens);
    return steps ? hs_greedy_steps(a, steps, plan, tokens, logits + batch * vocab) : 0;
}
