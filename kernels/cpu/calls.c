/* The entry points ctypes calls (`cpu_native.ARGUMENTS`): each takes one struct of
 * the arguments of the kernel of the same name, in its order, and calls it. The
 * kernels keep their plain arguments for the C callers that chain them
 * (`cpu/blocks.c`, `cpu/forward.c`). */
#include "kernels.h"

int hs_rms_norm_call(const hs_rms_norm_args *a) {
    return hs_rms_norm(
        a->x, a->ldx, a->gate, a->ldg, a->w, a->out, a->rows, a->n, a->group, a->eps);
}

int hs_conv_window_steps_call(const hs_conv_window_steps_args *a) {
    return hs_conv_window_steps(
        a->states, a->src, a->dst, a->xs, a->sxb, a->sxt, a->weight, a->bias, a->silu, a->out, a->batch,
        a->T, a->conv_dim, a->d_conv, a->parents);
}

int hs_mamba2_steps_call(const hs_mamba2_steps_args *a) {
    return hs_mamba2_steps(
        a->states, a->src, a->dst, a->scratch, a->x, a->sxb, a->sxt, a->sxh, a->dt, a->sdb, a->sdt,
        a->A, a->D, a->B, a->sBb, a->sBt, a->sBg, a->C, a->sCb, a->sCt, a->sCg, a->y, a->batch, a->T,
        a->nheads, a->headdim, a->d_state, a->ngroups, a->parents);
}

int hs_mamba1_steps_call(const hs_mamba1_steps_args *a) {
    return hs_mamba1_steps(
        a->states, a->src, a->dst, a->x, a->sxb, a->sxt, a->dt, a->sdb, a->sdt, a->A, a->B, a->sBb,
        a->sBt, a->C, a->sCb, a->sCt, a->D, a->y, a->batch, a->T, a->d_inner, a->d_state, a->parents);
}

int hs_gdn_steps_call(const hs_gdn_steps_args *a) {
    return hs_gdn_steps(
        a->states, a->src, a->dst, a->q, a->sqb, a->sqt, a->sqh, a->k, a->skb, a->skt, a->skh, a->v, a->svb,
        a->svt, a->svh, a->g, a->sgb, a->sgt, a->beta, a->sbb, a->sbt, a->o, a->batch, a->T, a->heads,
        a->key_heads, a->d_k, a->d_v, a->parents);
}

int hs_rope_call(const hs_rope_args *a) {
    return hs_rope(
        a->x, a->cos, a->sin, a->ldc, a->out, a->rows, a->heads, a->head_dim, a->half);
}

int hs_mlp_block_call(const hs_mlp_block_args *a) {
    return hs_mlp_block(
        a->h, a->norm_w, a->eps, a->gate_t, a->up_t, a->down_t, a->work, a->out, a->rows, a->hidden,
        a->inter, a->residual);
}

int hs_mamba2_block_call(const hs_mamba2_block_args *a) {
    return hs_mamba2_block(
        a->h, a->norm_w, a->eps, a->in_t, a->conv_states, a->ssm_states, a->src, a->dst, a->conv_w,
        a->conv_b, a->dt_bias, a->A, a->D, a->gate_norm_w, a->group, a->out_t, a->work, a->logged,
        a->out, a->batch, a->T, a->hidden, a->d_inner, a->nheads, a->headdim, a->ngroups, a->d_state,
        a->d_conv, a->residual, 0);
}

int hs_attention_block_call(const hs_attention_block_args *a) {
    return hs_attention_block(
        a->h, a->norm_w, a->eps, a->q_t, a->k_t, a->v_t, a->o_t, a->inv_freq, a->half, a->k_cache,
        a->v_cache, a->slot_mapping, a->block_tables, a->max_blocks, a->block_size, a->context_lens,
        a->query_lens, a->scale, a->work, a->out, a->batch, a->T, a->hidden, a->nheads, a->kv_heads,
        a->head_dim, a->residual, 0);
}
