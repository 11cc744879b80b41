"""Whole residual blocks of a decoder layer on CPU in C (`cpu/blocks.c`) for
float32 decoding, drafting and verification: the MLP block, the Mamba-2
mixer block and the attention block, each one call from norm to residual.

Why: on a small model a decode step is mostly host work, not arithmetic. The
MLP block (norm, three products, SiLU, product, residual) is about ten torch
operations and C calls, the Mamba-2 block about twenty-five (norm, in_proj,
split, copies, conv, softplus, recurrence, gated norm, out_proj, residual),
the attention block about twenty (norm, three products, rotary embedding,
K/V writes, attention, o_proj, residual). The C side chains the other native
kernels (`cpu/rows.c`, `cpu/norm.c`, `cpu/conv.c`, `cpu/mamba2.c`,
`cpu/rope.c`) in the same order, so the slots and pages written and every
product are the same as on the module path; SiLU (MLP), softplus (Δ), the
rotary angles and the attention's softmax are computed in C, within an ulp
or two of torch's.
Every value of a row depends only on that row (and a query only on the keys
it sees), so a row's bits do not depend on the batch, and a verify input
gets the bits a decode step at its position gets.

A block is made from the layer's descriptor (`kernels.descriptors`), by the
kind of each part (`LayerBlocks.of`: a Mamba-2 or attention mixer, a dense
MLP; never an MoE or a composed mixer), and only for a backend with the
blocks (`kernels.backend`). The weights' pointers and the checks that depend
only on the layer are made once per block (`_Static`, remade when a weight's
storage changes: `model.to(...)`); a call then checks only what changes per
forward.

`DecoderLayer` calls its blocks first (`mixer_block`, `mlp_block`); they return None
(and the modules run) unless every condition holds: the native kernels'
(`cpu_native.takes`; for the Mamba block every row runs all its inputs), at
most `BLOCK_ROWS` inputs per sequence (any batch), weights in panels or input-major
(`pack_for_cpu`), and the plain form of the block: a gated SiLU MLP without
biases or multipliers; a Mamba-2 mixer with RMSNorm(y ⊙ silu(z)), no
projection biases or multipliers and the default Δ limits (its inputs go to
the input log when the forward keeps one); attention without biases. A
block adds its update times the layer's residual multiplier (GraniteMoeHybrid's;
1 elsewhere), rounded as the modules' `h + update * m`.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from hybridspec.kernels.cpu import native as cpu_native
from hybridspec.kernels.descriptors import AttentionDesc, LayerDesc, Mamba2Desc, MLPDesc
from hybridspec.kernels.cpu.rows import MAX_ROWS
from hybridspec.kernels.cpu.panels import PanelWeight, out_features
from hybridspec.kernels.quant.weight import QuantWeight

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
    """What a block's C call takes that only the layer decides: `args` (weight
    pointers, sizes) when `ok` (the layer's own conditions hold)."""

    def __init__(self, tensors: list[torch.Tensor], ok: bool, args: tuple = ()):
        self.tensors, self.ptrs = tensors, [t.data_ptr() for t in tensors]
        self.ok, self.args = ok, args

    def current(self) -> bool:
        return [t.data_ptr() for t in self.tensors] == self.ptrs


class Block:
    """One native block of a decoder layer, made from the layer's descriptor:
    `static()` is what its C call takes that only the layer decides, made on
    first use and remade when a weight's storage moves."""

    def __init__(self, layer: LayerDesc, compute: torch.dtype = torch.float32):
        self.layer, self.compute, self._static = layer, compute, None

    def static(self) -> _Static:
        static = self._static
        if static is None or not static.current():
            static = self._static = self.make_static(self.layer, self.compute)
        return static

    @staticmethod
    def make_static(layer: LayerDesc, compute: torch.dtype) -> _Static:
        raise NotImplementedError


class MixerBlock(Block):
    def __call__(self, h: torch.Tensor, batch, cache) -> torch.Tensor | None:
        """h + mixer(norm(h)) in one C call, or None where it does not apply (`mixer_block`)."""
        return mixer_block(self, h, batch, cache)


class LayerBlocks(NamedTuple):
    """The native blocks of one decoder layer: `mixer` and `mlp` None where no
    block takes that part (its kind, a shared block feeding it). Each block adds
    its update times the layer's residual multiplier."""
    mixer: "Mamba2Block | AttentionBlock | None"
    mlp: "MLPBlock | None"

    @staticmethod
    def of(layer: LayerDesc, native: bool = True, compute: torch.dtype = torch.float32) -> "LayerBlocks":
        """The blocks the native path takes of `layer` (none unless `native`), their products in
        `compute` (`backend.select`)."""
        if not native:
            return NO_BLOCKS
        plain = not layer.shared_block
        mixer = None
        if plain and isinstance(layer.mixer, Mamba2Desc):
            mixer = Mamba2Block(layer, compute)
        elif plain and isinstance(layer.mixer, AttentionDesc):
            mixer = AttentionBlock(layer, compute)
        return LayerBlocks(mixer, MLPBlock(layer, compute) if plain and isinstance(layer.ffn, MLPDesc) else None)


NO_BLOCKS = LayerBlocks(None, None)


def _input_major(weight: torch.Tensor) -> bool:
    """Whether weight [out, in] is a layout the products read: panels, GGUF blocks, or its contiguous
    [in, out] transpose."""
    return isinstance(weight, (PanelWeight, QuantWeight)) or weight.t().is_contiguous()


def _float32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype is torch.float32 and t.is_cpu for t in tensors)


def _products_take(*weights: torch.Tensor) -> bool:
    """The blocks' product weights: input-major, float32 or its exact 16-bit copy, or GGUF blocks, on the CPU."""
    return all(cpu_native.weight_dtype_ok(w) and _input_major(w) for w in weights)


def _weight(weight: torch.Tensor, compute: torch.dtype) -> int:
    """A product weight [out, in] as the kernels take it: its input-major data's tagged address."""
    return cpu_native.product_address(weight, compute)


# inputs per sequence up to which a block runs, whatever the batch: a sequence's bits then depend on
# its own inputs only, since the forward takes the blocks for it alone and in any batch (a forward
# mixing longer and shorter sequences runs as two, `HybridModel.extend`). The products take the
# kernel at any row count (weights in panels; the blocks call it directly for input-major ones).
# Longer sequences (a long prompt) take the modules: the attention's scores grow with inputs² and
# torch's attention is ahead there. One call saves the modules' host work, which a batch-16
# speculative round and a prefill of 64-96 tokens on the small targets gain from
BLOCK_ROWS = MAX_ROWS

# rows (batch · inputs) of a plain forward's one native call at most (`HybridModel.extend` splits a
# larger batch by sequences): the calls' scratch grows with their rows and stays allocated, and past
# these rows the products gain nothing more from sharing a weight's pass
CALL_ROWS = 16 * BLOCK_ROWS


def _takes_rows(h: torch.Tensor) -> bool:
    """The per-call conditions every block shares."""
    return (h.dim() == 3 and h.shape[0] > 0 and 0 < h.shape[1] <= BLOCK_ROWS and h.dtype is torch.float32 and h.is_cpu
            and h.is_contiguous() and not torch.is_grad_enabled() and cpu_native.available())


# -- MLP ----------------------------------------------------------------------------------------

class MLPBlock(Block):
    """h + mlp(norm(h)): a gated SiLU MLP without biases or multipliers."""

    def __call__(self, h: torch.Tensor) -> torch.Tensor | None:
        """h + mlp(norm(h)) in one C call, or None where it does not apply (`mlp_block`)."""
        return mlp_block(self, h)

    @staticmethod
    def make_static(layer: LayerDesc, compute: torch.dtype) -> _Static:
        mlp, norm = layer.ffn, layer.ffn_norm
        weights = [norm.weight, mlp.gate, mlp.up, mlp.down] if mlp.gate is not None else [norm.weight]
        ok = (mlp.gate is not None and mlp.activation == "silu" and mlp.up_bias is None and mlp.gate_bias is None
              and mlp.down_bias is None and mlp.gate_multiplier == 1.0 and mlp.down_multiplier == 1.0
              and _float32_cpu(norm.weight) and _products_take(*weights[1:]))
        if not ok:
            return _Static(weights, False)
        return _Static(weights, True, (norm.weight.data_ptr(), norm.eps, _weight(mlp.gate, compute),
                                       _weight(mlp.up, compute), _weight(mlp.down, compute), out_features(mlp.up)))


def mlp_block(block: MLPBlock, h: torch.Tensor) -> torch.Tensor | None:
    """h + ffn(ffn_norm(h)) for h [batch, T, hidden] in one C call; None where it does not apply."""
    static = block.static()
    if not (static.ok and _takes_rows(h)):
        return None
    norm_w, eps, gate_t, up_t, down_t, inter = static.args
    rows, hidden = h.shape[0] * h.shape[1], h.shape[2]
    out = torch.empty(h.shape, dtype=torch.float32)
    if cpu_native.call("mlp_block", h.data_ptr(), norm_w, eps, gate_t, up_t, down_t,
                       _work(rows * (hidden + 2 * inter)).data_ptr(), out.data_ptr(), rows, hidden, inter,
                       block.layer.residual_multiplier) != 0:
        raise ValueError(f"mlp_block: shapes not taken: h {tuple(h.shape)}, intermediate {inter}")
    return out


# -- mixers ---------------------------------------------------------------------------------------

def mixer_block(block: "Mamba2Block | AttentionBlock", h: torch.Tensor, batch, cache) -> torch.Tensor | None:
    """h + mixer(input_norm(h)) for h [batch, T, hidden] in one C call (Mamba-2 or
    attention), the states, conv windows or K/V written where the plan says;
    None where it does not apply."""
    static = block.static()
    return block.run(static, h, batch, cache) if static.ok and _takes_rows(h) else None


class Mamba2Block(MixerBlock):
    """h + mamba2(norm(h)): RMSNorm(y ⊙ silu(z)), no projection biases or
    multipliers, the default Δ limits, a conv window of at most 16."""

    @staticmethod
    def make_static(layer: LayerDesc, compute: torch.dtype) -> _Static:
        m, norm = layer.mixer, layer.mixer_norm
        vectors = [m.dt_bias, m.A, m.D, *(() if m.norm_weight is None else (m.norm_weight,)),
                   *(() if m.conv_bias is None else (m.conv_bias,))]
        weights = [norm.weight, m.in_proj, m.out_proj, m.conv_kernel, *vectors]
        ok = (m.norm == "gate_then_norm" and m.in_scale is None and m.in_bias is None and m.out_bias is None
              and m.time_step_limit == (0.0, float("inf")) and m.d_conv <= 16
              and _float32_cpu(norm.weight, m.conv_kernel, *vectors) and _products_take(m.in_proj, m.out_proj)
              and m.conv_kernel.is_contiguous() and all(w.is_contiguous() for w in vectors))
        if not ok:
            return _Static(weights, False)
        sizes = (m.d_inner, m.num_heads, m.head_dim, m.n_groups, m.d_state, m.d_conv, m.conv_dim, out_features(m.in_proj))
        return _Static(weights, True, (
            norm.weight.data_ptr(), norm.eps, _weight(m.in_proj, compute), m.conv_kernel.data_ptr(),
            None if m.conv_bias is None else m.conv_bias.data_ptr(), m.dt_bias.data_ptr(), m.A.data_ptr(),
            m.D.data_ptr(), m.norm_weight.data_ptr(), m.group_size, _weight(m.out_proj, compute), sizes))

    def run(self, static: _Static, h: torch.Tensor, batch, cache) -> torch.Tensor | None:
        return _mamba2_block(self.layer.mixer, static, h, batch, cache, self.layer.residual_multiplier)


def _mamba2_block(mixer: Mamba2Desc, static: _Static, h: torch.Tensor, batch, cache,
                  residual: float) -> torch.Tensor | None:
    plan, states = batch.slots, cache.states
    ssm, conv = states.ssm_states[mixer.state_layer], states.conv_states[mixer.state_layer]
    if not (plan is not None and plan.all_live and plan.batch > 0 and _float32_cpu(ssm, conv)
            and ssm.is_contiguous() and conv.is_contiguous()):
        return None
    norm_w, eps, in_t, conv_w, conv_b, dt_bias, A, D, gate_w, group, out_t, sizes = static.args
    d_inner, nheads, head_dim, n_groups, d_state, d_conv, conv_dim, proj = sizes
    bsz, T, hidden = h.shape
    rows = bsz * T
    logged = None if batch.input_log is None else logged_inputs(mixer, batch, bsz, T)
    work = rows * (hidden + proj + conv_dim + nheads + 2 * d_inner) + head_dim * d_state
    out = torch.empty(h.shape, dtype=torch.float32)
    if cpu_native.call(
            "mamba2_block",
            h.data_ptr(), norm_w, eps, in_t, conv.data_ptr(), ssm.data_ptr(), plan.src.data_ptr(),
            plan.snap.data_ptr(), conv_w, conv_b, dt_bias, A, D, gate_w, group, out_t, _work(work).data_ptr(),
            None if logged is None else logged.data_ptr(), out.data_ptr(), bsz, T, hidden, d_inner, nheads,
            head_dim, n_groups, d_state, d_conv, residual) != 0:
        raise ValueError(f"mamba2_block: shapes not taken: h {tuple(h.shape)}, sizes {sizes}")
    return out


def logged_inputs(mixer: Mamba2Desc, batch, bsz: int, T: int) -> torch.Tensor:
    """Memory for a Mamba-2 block's in_proj output, conv output and Δ, kept by the
    forward's input log (the mixer's log entry gets views of it; the block writes them)."""
    d_inner, nheads, head_dim, n_groups, d_state, conv_dim = (mixer.d_inner, mixer.num_heads, mixer.head_dim,
                                                              mixer.n_groups, mixer.d_state, mixer.conv_dim)
    rows, proj = bsz * T, out_features(mixer.in_proj)
    logged = torch.empty(rows * (proj + conv_dim + nheads), dtype=torch.float32)
    projected, xbc, dt = logged.split([rows * proj, rows * conv_dim, rows * nheads])
    x, B, C = xbc.view(bsz, T, conv_dim).split([d_inner, n_groups * d_state, n_groups * d_state], dim=-1)
    batch.input_log[mixer.state_layer] = mixer.make_log(
        xs=projected.view(bsz, T, proj)[..., d_inner:d_inner + conv_dim], x=x.unflatten(-1, (nheads, head_dim)),
        dt=dt.view(bsz, T, nheads), B=B.unflatten(-1, (n_groups, d_state)), C=C.unflatten(-1, (n_groups, d_state)))
    return logged


class AttentionBlock(MixerBlock):
    """h + attention(norm(h)): no biases; the rotary embedding over its dims or none."""

    @staticmethod
    def make_static(layer: LayerDesc, compute: torch.dtype) -> _Static:
        a, norm = layer.mixer, layer.mixer_norm
        projections = [a.q_proj, a.k_proj, a.v_proj, a.o_proj]
        weights = [norm.weight, *projections]
        if a.inv_freq is not None:
            weights.append(a.inv_freq)
        ok = (not a.qkv_bias and not a.o_bias and _float32_cpu(norm.weight, *weights[len(projections) + 1:])
              and _products_take(*projections)
              and (a.inv_freq is None or (a.inv_freq.is_contiguous() and 2 * a.inv_freq.numel() == a.rotary_dim)))
        if not ok:
            return _Static(weights, False)
        return _Static(weights, True, (norm.weight.data_ptr(), norm.eps, *(_weight(w, compute) for w in projections),
                                       None if a.inv_freq is None else a.inv_freq.data_ptr(), a.rotary_dim // 2,
                                       a.softmax_scale, a.kv_layer, (a.num_heads, a.num_kv_heads, a.head_dim)))

    def run(self, static: _Static, h: torch.Tensor, batch, cache) -> torch.Tensor | None:
        return _attention_block(static, h, batch, cache, self.layer.residual_multiplier)


def _attention_block(static: _Static, h: torch.Tensor, batch, cache, residual: float) -> torch.Tensor | None:
    meta = batch.kv
    norm_w, eps, q_t, k_t, v_t, o_t, inv_freq, half, scale, kv_layer, (heads, kv_heads, head_dim) = static.args
    if meta is None:
        return None
    k_cache, v_cache = cache.kv.k_cache[kv_layer], cache.kv.v_cache[kv_layer]
    if not (_float32_cpu(k_cache, v_cache) and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    bsz, T, hidden = h.shape
    rows = bsz * T
    slot_mapping, context_lens, query_lens, tables = meta.packed  # one tensor
    block_size = k_cache.shape[1]
    work = rows * (hidden + 2 * (heads + kv_heads) * head_dim + 2 * half) + T * heads * max(meta.context_list)
    out = torch.empty(h.shape, dtype=torch.float32)
    if cpu_native.call(
            "attention_block",
            h.data_ptr(), norm_w, eps, q_t, k_t, v_t, o_t, inv_freq, half, k_cache.data_ptr(), v_cache.data_ptr(),
            slot_mapping.data_ptr(), tables.data_ptr(), tables.shape[1], block_size, context_lens.data_ptr(),
            query_lens.data_ptr(), scale, _work(work).data_ptr(), out.data_ptr(), bsz, T, hidden, heads,
            kv_heads, head_dim, residual) != 0:
        raise ValueError(f"attention_block: shapes not taken: h {tuple(h.shape)}, context {meta.context_list}")
    return out
