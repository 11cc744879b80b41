"""Whole residual blocks of a decoder layer on CPU in C (`cpu_blocks.c`) for
float32 decoding, drafting and verification: the MLP block, the Mamba-2
mixer block and the attention block, each one call from norm to residual.

Why: on a small model a decode step is mostly host work, not arithmetic. The
MLP block (norm, three products, SiLU, product, residual) is about ten torch
operations and C calls, the Mamba-2 block about twenty-five (norm, in_proj,
split, copies, conv, softplus, recurrence, gated norm, out_proj, residual),
the attention block about twenty (norm, three products, rotary embedding,
K/V writes, attention, o_proj, residual); the embedded target's decode step
spent about 0.2, 0.4 and 0.6 ms in each. The C side chains the other native
kernels (`cpu_rows.c`, `cpu_norm.c`, `cpu_conv.c`, `cpu_mamba2.c`,
`cpu_rope.c`) in the same order, so the slots and pages written and every
product are the same as on the module path; SiLU (MLP), softplus (Δ), the
rotary angles and the attention's softmax are computed in C, within an ulp
or two of torch's.
Every value of a row depends only on that row (and a query only on the keys
it sees), so a row's bits do not depend on the batch, and a verify input
gets the bits a decode step at its position gets.

The weights' pointers and the checks that depend only on the module are
made once per layer (`_Static`, remade when a weight's storage changes:
`model.to(...)`); a call then checks only what changes per forward.

`DecoderLayer` calls `mixer_block` and `mlp_block` first; they return None
(and the modules run) unless every condition holds: the native kernels'
(`cpu_native.takes`; for the Mamba block every row runs all its inputs), at
most `BLOCK_ROWS` rows (batch · inputs), input-major weights
(`pack_for_cpu`), and the plain form of the block: a gated SiLU MLP without
biases or multipliers; a Mamba-2 mixer with RMSNorm(y ⊙ silu(z)), no
projection biases or multipliers and the default Δ limits (its inputs go to
the input log when the forward keeps one); attention without biases.
"""
from __future__ import annotations

import threading

import torch

from hybridspec.kernels import cpu_native
from hybridspec.kernels.cpu_rows import MAX_ROWS

_enabled = True  # `set_enabled`: the whole-block path on or off (the other native kernels stay as they are)


def set_enabled(flag: bool) -> None:
    """Turn the whole-block path on or off for this process (benches compare the
    modules' path with the other native kernels against it)."""
    global _enabled
    _enabled = bool(flag)


_LOCAL = threading.local()  # per thread: the C calls release the GIL, so threads must not share scratch


def _work(size: int) -> torch.Tensor:
    """Scratch memory of at least `size` floats: one buffer per thread, reused by
    every block (they never nest) and doubled when a call needs more."""
    work = getattr(_LOCAL, "work", None)
    if work is None or work.numel() < size:
        work = _LOCAL.work = torch.empty(max(size, 2 * (0 if work is None else work.numel()), 1 << 16),
                                         dtype=torch.float32)
    return work


class _Static:
    """What a block's C call takes that only the module decides: `args` (weight
    pointers, sizes) when `ok` (the module's own conditions hold)."""

    def __init__(self, tensors: list[torch.Tensor], ok: bool, args: tuple = ()):
        self.tensors, self.ptrs = tensors, [t.data_ptr() for t in tensors]
        self.ok, self.args = ok, args

    def current(self) -> bool:
        return [t.data_ptr() for t in self.tensors] == self.ptrs


def forget(model) -> None:
    """Drop every layer's `_Static` and count a new generation of the model's
    parameters, which `cpu_forward`'s tables check (after parameters were replaced
    by new tensors: `HybridModel.pack_for_cpu` calls it)."""
    for module in model.modules():
        for key in STATIC_KEYS:
            module.__dict__.pop(key, None)
    model.__dict__[GENERATION_KEY] = model.__dict__.get(GENERATION_KEY, 0) + 1


STATIC_KEYS = ("_hs_mlp_block", "_hs_mixer_block")
GENERATION_KEY = "_hs_generation"


def _static(layer, key: str, make) -> _Static:
    static = layer.__dict__.get(key)
    if static is None or not static.current():
        static = make()
        layer.__dict__[key] = static
    return static


def _input_major(weight: torch.Tensor) -> bool:
    """Whether weight [out, in] is stored as its contiguous [in, out] transpose."""
    return weight.t().is_contiguous()


def _float32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype is torch.float32 and t.is_cpu for t in tensors)


def _products_take(*weights: torch.Tensor) -> bool:
    """The blocks' product weights: input-major, float32 or its exact 16-bit copy, on the CPU."""
    return all(cpu_native.weight_dtype_ok(w) and _input_major(w) for w in weights)


def _weight(weight: torch.Tensor) -> int:
    """A product weight [out, in] as the kernels take it: its input-major data's tagged address."""
    return cpu_native.weight_address(weight.t())


# rows (batch · inputs) up to which a block runs: the rows `linear` gives the product kernel (the
# whole forward's LM head takes the same kernel), so that a verify of γ + 1 = 5 inputs runs whole up
# to batch 19 (the products in the kernel's streaming steps, from 10-16 rows its register tiles). One call
# saves the modules' host work: going from 48 to 96 rows took `benches/round_cost.py`'s batch-16
# speculative run from 0.54 to 0.81x plain (two alternating runs each; then padded batches still fell
# to the modules' torch recurrence, which c8c5e9a replaced with the C one); a prefill of 64-96 tokens
# took 0.78-0.87x the time on the embedded target and memory_vs_replay's, 1.04-1.07x on round_cost's
# 35.8M target (MKL is ahead there)
BLOCK_ROWS = MAX_ROWS


def _takes_rows(h: torch.Tensor) -> bool:
    """The per-call conditions every block shares."""
    return (_enabled and h.dim() == 3 and 0 < h.shape[0] * h.shape[1] <= BLOCK_ROWS and h.dtype is torch.float32 and h.is_cpu
            and h.is_contiguous() and not torch.is_grad_enabled() and cpu_native.available())


# -- MLP ----------------------------------------------------------------------------------------

def _mlp_static(layer) -> _Static:
    mlp, norm = layer.ffn, layer.ffn_norm
    cfg = mlp.cfg
    weights = [norm.weight, mlp.gate_proj, mlp.up_proj, mlp.down_proj] if cfg.gated else []
    ok = (bool(weights) and cfg.activation == "silu" and mlp.up_bias is None and mlp.gate_bias is None
          and cfg.gate_multiplier == 1.0 and cfg.down_multiplier == 1.0 and _float32_cpu(norm.weight)
          and _products_take(*weights[1:]))
    if not ok:
        return _Static(weights, False)
    return _Static(weights, True, (norm.weight.data_ptr(), norm.eps, _weight(mlp.gate_proj), _weight(mlp.up_proj),
                                   _weight(mlp.down_proj), mlp.up_proj.shape[0]))


def mlp_block(layer, h: torch.Tensor) -> torch.Tensor | None:
    """h + ffn(ffn_norm(h)) for h [batch, T, hidden] in one C call; None where it does not apply."""
    static = _static(layer, "_hs_mlp_block", lambda: _mlp_static(layer))
    if not (static.ok and _takes_rows(h)):
        return None
    norm_w, eps, gate_t, up_t, down_t, inter = static.args
    rows, hidden = h.shape[0] * h.shape[1], h.shape[2]
    out = torch.empty(h.shape, dtype=torch.float32)
    if cpu_native.library().hs_mlp_block(h.data_ptr(), norm_w, eps, gate_t, up_t, down_t,
                                         _work(rows * (hidden + 2 * inter)).data_ptr(), out.data_ptr(), rows, hidden,
                                         inter) != 0:
        raise ValueError(f"mlp_block: shapes not taken: h {tuple(h.shape)}, intermediate {inter}")
    return out


# -- mixers ---------------------------------------------------------------------------------------

def mixer_block(layer, h: torch.Tensor, batch, cache) -> torch.Tensor | None:
    """h + mixer(input_norm(h)) for h [batch, T, hidden] in one C call (Mamba-2 or
    attention), the states, conv windows or K/V written where the plan says;
    None where it does not apply."""
    if layer.mamba2:
        static = _static(layer, "_hs_mixer_block", lambda: _mamba2_static(layer))
        return _mamba2_block(layer, static, h, batch, cache) if static.ok and _takes_rows(h) else None
    if layer.attention:
        static = _static(layer, "_hs_mixer_block", lambda: _attention_static(layer))
        return _attention_block(static, h, batch, cache) if static.ok and _takes_rows(h) else None
    return None


def _mamba2_static(layer) -> _Static:
    mixer, norm = layer.mixer, layer.input_norm
    cfg = mixer.cfg
    vectors = [mixer.dt_bias, mixer.A_log, mixer.D, *(() if mixer.norm_weight is None else (mixer.norm_weight,)),
               *(() if mixer.conv_bias is None else (mixer.conv_bias,))]
    weights = [norm.weight, mixer.in_proj, mixer.out_proj, mixer.conv_weight, *vectors]
    ok = (cfg.norm == "gate_then_norm" and mixer.in_scale is None and mixer.in_bias is None
          and mixer.out_bias is None and cfg.time_step_limit == (0.0, float("inf")) and cfg.d_conv <= 16
          and _float32_cpu(norm.weight, mixer.conv_weight, *vectors) and _products_take(mixer.in_proj, mixer.out_proj)
          and mixer.conv_kernel().is_contiguous() and all(w.is_contiguous() for w in vectors))
    if not ok:
        return _Static(weights, False)
    A = mixer.decay_rate(torch.float32)  # kept by the mixer until A_log changes
    sizes = (cfg.d_inner, cfg.num_heads, cfg.head_dim, cfg.n_groups, cfg.d_state, cfg.d_conv, cfg.conv_dim,
             mixer.in_proj.shape[0])
    return _Static(weights + [A], True, (
        norm.weight.data_ptr(), norm.eps, _weight(mixer.in_proj), mixer.conv_kernel().data_ptr(),
        None if mixer.conv_bias is None else mixer.conv_bias.data_ptr(), mixer.dt_bias.data_ptr(), A.data_ptr(),
        mixer.D.data_ptr(), mixer.norm_weight.data_ptr(), cfg.group_size, _weight(mixer.out_proj), sizes))


def _mamba2_block(layer, static: _Static, h: torch.Tensor, batch, cache) -> torch.Tensor | None:
    plan, states = batch.slots, cache.states
    ssm, conv = states.ssm_states[layer.mixer.state_layer], states.conv_states[layer.mixer.state_layer]
    if not (plan is not None and plan.all_live and plan.batch > 0 and _float32_cpu(ssm, conv)
            and ssm.is_contiguous() and conv.is_contiguous()):
        return None
    norm_w, eps, in_t, conv_w, conv_b, dt_bias, A, D, gate_w, group, out_t, sizes = static.args
    d_inner, nheads, head_dim, n_groups, d_state, d_conv, conv_dim, proj = sizes
    bsz, T, hidden = h.shape
    rows = bsz * T
    logged = None if batch.input_log is None else logged_inputs(layer, batch, bsz, T)
    work = rows * (hidden + proj + conv_dim + nheads + 2 * d_inner) + head_dim * d_state
    out = torch.empty(h.shape, dtype=torch.float32)
    if cpu_native.library().hs_mamba2_block(
            h.data_ptr(), norm_w, eps, in_t, conv.data_ptr(), ssm.data_ptr(), plan.src.data_ptr(),
            plan.snap.data_ptr(), conv_w, conv_b, dt_bias, A, D, gate_w, group, out_t, _work(work).data_ptr(),
            None if logged is None else logged.data_ptr(), out.data_ptr(), bsz, T, hidden, d_inner, nheads,
            head_dim, n_groups, d_state, d_conv) != 0:
        raise ValueError(f"mamba2_block: shapes not taken: h {tuple(h.shape)}, sizes {sizes}")
    return out


def logged_inputs(layer, batch, bsz: int, T: int) -> torch.Tensor:
    """Memory for a Mamba-2 block's in_proj output, conv output and Δ, kept by the
    forward's input log (`log_inputs` gets views of it; the block writes them)."""
    cfg = layer.mixer.cfg
    d_inner, nheads, head_dim, n_groups, d_state, conv_dim = (cfg.d_inner, cfg.num_heads, cfg.head_dim,
                                                              cfg.n_groups, cfg.d_state, cfg.conv_dim)
    rows, proj = bsz * T, layer.mixer.in_proj.shape[0]
    logged = torch.empty(rows * (proj + conv_dim + nheads), dtype=torch.float32)
    projected, xbc, dt = logged.split([rows * proj, rows * conv_dim, rows * nheads])
    x, B, C = xbc.view(bsz, T, conv_dim).split([d_inner, n_groups * d_state, n_groups * d_state], dim=-1)
    layer.mixer.log_inputs(batch, projected.view(bsz, T, proj)[..., d_inner:d_inner + conv_dim],
                           x.unflatten(-1, (nheads, head_dim)), dt.view(bsz, T, nheads),
                           B.unflatten(-1, (n_groups, d_state)), C.unflatten(-1, (n_groups, d_state)))
    return logged


def _attention_static(layer) -> _Static:
    attention, norm = layer.mixer, layer.input_norm
    cfg = attention.cfg
    projections = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj]
    weights = [norm.weight, *projections]
    inv_freq = attention.inv_freq if cfg.use_rope else None
    if inv_freq is not None:
        weights.append(inv_freq)
    ok = (not cfg.bias and not cfg.out_bias and _float32_cpu(norm.weight, *weights[len(projections) + 1:])
          and _products_take(*projections)
          and (inv_freq is None or (inv_freq.is_contiguous() and 2 * inv_freq.numel() == cfg.rotary_dim)))
    if not ok:
        return _Static(weights, False)
    return _Static(weights, True, (norm.weight.data_ptr(), norm.eps, *map(_weight, projections),
                                   None if inv_freq is None else inv_freq.data_ptr(), cfg.rotary_dim // 2,
                                   cfg.softmax_scale, attention.kv_layer, cfg))


def _attention_block(static: _Static, h: torch.Tensor, batch, cache) -> torch.Tensor | None:
    meta = batch.kv
    norm_w, eps, q_t, k_t, v_t, o_t, inv_freq, half, scale, kv_layer, cfg = static.args
    if meta is None:
        return None
    k_cache, v_cache = cache.kv.k_cache[kv_layer], cache.kv.v_cache[kv_layer]
    if not (_float32_cpu(k_cache, v_cache) and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    bsz, T, hidden = h.shape
    rows, heads, kv_heads, head_dim = bsz * T, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    slot_mapping, context_lens, query_lens, tables = meta.packed  # one tensor
    block_size = k_cache.shape[1]
    work = rows * (hidden + 2 * (heads + kv_heads) * head_dim + 2 * half) + T * heads * max(meta.context_list)
    out = torch.empty(h.shape, dtype=torch.float32)
    if cpu_native.library().hs_attention_block(
            h.data_ptr(), norm_w, eps, q_t, k_t, v_t, o_t, inv_freq, half, k_cache.data_ptr(), v_cache.data_ptr(),
            slot_mapping.data_ptr(), tables.data_ptr(), tables.shape[1], block_size, context_lens.data_ptr(),
            query_lens.data_ptr(), scale, _work(work).data_ptr(), out.data_ptr(), bsz, T, hidden, heads,
            kv_heads, head_dim) != 0:
        raise ValueError(f"attention_block: shapes not taken: h {tuple(h.shape)}, context {meta.context_list}")
    return out
