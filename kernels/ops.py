"""The op objects a `Backend` is made of (`kernels.backend`): one class per
operation with the torch reference as its base, and a native (C, float32 on
CPU) and a Triton subclass where those kernels exist. Each op takes the same
arguments in every implementation; a native op runs its torch form for a call
whose shapes or strides its kernel does not take (the per-call conditions
stay here: the caller never asks). Tables at the end: op name -> its
implementation per backend kind ("native", "triton", "torch")."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hybridspec.kernels.cpu import conv as cpu_conv
from hybridspec.kernels.cpu import gdn as cpu_gdn
from hybridspec.kernels.cpu import mamba1 as cpu_mamba1
from hybridspec.kernels.cpu import mamba2 as cpu_mamba2
from hybridspec.kernels.cpu import native as cpu_native
from hybridspec.kernels.cpu import norm as cpu_norm
from hybridspec.kernels.cpu import rows as cpu_rows
from hybridspec.kernels.cpu import tree as cpu_tree
from hybridspec.kernels.cpu import panels
from hybridspec.kernels.triton.conv_window import (conv_window_rebuild, conv_window_rebuild_ref, conv_window_update,
                                            conv_window_update_ref)
from hybridspec.kernels.triton.gdn_verify import gdn_replay, gdn_replay_ref, gdn_verify, gdn_verify_ref
from hybridspec.kernels.triton.kv_write import kv_write
from hybridspec.kernels.triton.mamba1_verify import mamba1_verify, mamba1_verify_ref
from hybridspec.kernels.triton.mamba2_verify import mamba2_verify, mamba2_verify_ref
from hybridspec.kernels.cpu.replay import replay_native
from hybridspec.kernels.cpu.panels import PanelWeight
from hybridspec.kernels.cpu import quant as cpu_quant
from hybridspec.kernels.quant import weight as quant_weight
from hybridspec.kernels.quant.weight import QuantWeight
from hybridspec.kernels.triton.paged_attention import SUPPORTED_DTYPES, paged_attention, paged_attention_cpu
from hybridspec.kernels.triton.rejection import rejection, rejection_ref
from hybridspec.kernels.rotary import NativeRotation, Rotation
from hybridspec.kernels.triton.ssm_replay import mamba1_replay, mamba1_replay_ref, mamba2_replay, mamba2_replay_ref
from hybridspec.kernels.triton import tree_recurrences, tree_verify
from hybridspec.kernels.triton.tree_attention import MAX_INPUTS as TREE_ATTENTION_MAX_INPUTS, tree_attention


@functools.cache
def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms, softmax and recurrences run in at least float32 (float64 stays float64).
    Cached: `torch.promote_types` is an operation."""
    return torch.promote_types(dtype, torch.float32)


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`; no operation when it already is."""
    return x if x.dtype == dtype else x.to(dtype)


_CONSTANTS: dict[tuple, torch.Tensor] = {}


def constant(value: float, dtype: torch.dtype, device) -> torch.Tensor:
    """`value` as a cached 0-d tensor: arithmetic with it is one operation."""
    key = (value, dtype, str(device))
    c = _CONSTANTS.get(key)
    if c is None:
        c = _CONSTANTS[key] = torch.tensor(value, dtype=dtype, device=device)
    return c


def torch_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [M, in] @ weight [out, in]ᵀ by torch: on the cached transposed view (a weight stored in
    16 bits, `pack_for_cpu`, widened exactly for it), or panel by panel (`panels.matmul`); a
    `QuantWeight` on the activations rounded as the quantized products round them (`quant_weight.matmul`)."""
    if isinstance(weight, PanelWeight):
        return panels.matmul(rows, weight)
    if isinstance(weight, QuantWeight):
        return quant_weight.matmul(rows, weight)
    weight_t = transposed(weight)
    return torch.mm(rows, weight_t if weight_t.dtype == rows.dtype else weight_t.to(rows.dtype))


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """weight.t(), a view made once per parameter and remade if its storage
    changes (`model.to(device)` swaps it); a `PanelWeight` or `QuantWeight` is its own
    operand (the products read its panels or blocks)."""
    if isinstance(weight, (PanelWeight, QuantWeight)):
        return weight
    view = getattr(weight, "_hs_transposed", None)
    if view is None or view.data_ptr() != weight.data_ptr() or view.device != weight.device:
        view = weight.t()
        weight._hs_transposed = view
    return view


# -- linear -----------------------------------------------------------------------------------------

class Linear:
    """F.linear(x, weight, bias) as one product over the flattened rows (`torch.mm`
    on a cached transposed view).  # [..., out]"""
    reads_16bit = False  # whether the products read a float32 weight's exact 16-bit copy
    reads_panels = False  # whether the products read weights in panels fastest (`panels`)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x if x.dim() == 2 else (x.view(-1, x.shape[-1]) if x.is_contiguous() else x.reshape(-1, x.shape[-1]))
        out = torch_product(rows, weight)
        if bias is not None:
            out += bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])

    def quant_layout(self, weight: QuantWeight) -> QuantWeight:
        """A quantized weight as these products read it fastest (torch's: as it is)."""
        return weight


class NativeLinear(Linear):
    """The few-row C kernel (`cpu_rows`) where it takes the operands; a `QuantWeight`'s products
    (`cpu_quant`) for one in GGUF blocks. The body
    repeats `Linear`'s rather than calling it: a linear runs about fifty times
    per layer-by-layer forward, and a second Python call each is host work on
    the decode path."""
    reads_16bit = True
    reads_panels = True

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x if x.dim() == 2 else (x.view(-1, x.shape[-1]) if x.is_contiguous() else x.reshape(-1, x.shape[-1]))
        weight_t = transposed(weight)
        if isinstance(weight, QuantWeight):
            out = cpu_quant.quant_matmul(rows, weight) if cpu_quant.applies(rows, weight) else \
                quant_weight.matmul(rows, weight)
        elif cpu_rows.applies(rows, weight_t):
            out = cpu_rows.rows_matmul(rows, weight_t)
        else:
            with cpu_native.torch_threads():  # MKL splits it well (a MoE's prefill)
                out = torch_product(rows, weight)
        if bias is not None:
            out += bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])

    def quant_layout(self, weight: QuantWeight) -> QuantWeight:
        """Interleaved where the C products read it so faster (`cpu_quant.laid_out`)."""
        return cpu_quant.laid_out(weight) if cpu_native.available() else weight


class NativeBf16Linear(NativeLinear):
    """The products in bfloat16 compute (the opt-in fast path, `compute="bfloat16"`): a
    bfloat16 weight multiplies x rounded to bfloat16 with float32 sums (`cpu/rows_bf16.c`,
    AVX512-BF16), at any row count; where the kernel declines a call (autograd), torch
    multiplies the same rounded values. A float32 weight (one a norm or another part also
    uses, `pack_for_cpu`) takes `NativeLinear`'s exact products."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x if x.dim() == 2 else (x.view(-1, x.shape[-1]) if x.is_contiguous() else x.reshape(-1, x.shape[-1]))
        if weight.dtype is not torch.bfloat16:
            return super().__call__(x, weight, bias)
        weight_t = transposed(weight)
        if cpu_rows.applies_bf16(rows, weight_t):
            out = cpu_rows.rows_matmul(rows, weight_t, torch.bfloat16)
        else:
            with cpu_native.torch_threads():
                out = torch_product(rows.to(torch.bfloat16).to(rows.dtype), weight)
        if bias is not None:
            out += bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


# -- softplus and sigmoid -------------------------------------------------------------------------

class Pointwise:
    """softplus (beta 1, threshold 20) and sigmoid, elementwise: torch's."""

    def softplus(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(x)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)


class NativePointwise(Pointwise):
    """The same functions in C (`cpu/pointwise.c`) for float32 CPU tensors: each output
    the scalar libm value of its input wherever the element lies. torch's can differ in
    the last bit between a tensor's vectorized body and its tail, which would make a
    row's Δ or gate depend on the rows beside it (batch invariance)."""

    def softplus(self, x: torch.Tensor) -> torch.Tensor:
        return self._native("softplus", x) if self._takes(x) else super().softplus(x)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return self._native("sigmoid", x) if self._takes(x) else super().sigmoid(x)

    @staticmethod
    def _takes(x: torch.Tensor) -> bool:
        return not (torch.is_grad_enabled() and x.requires_grad) and cpu_native.takes(x)

    @staticmethod
    def _native(name: str, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        cpu_native.library().hs_pointwise(cpu_native.POINTWISE_FUNCTIONS[name], x.data_ptr(), out.data_ptr(), x.numel())
        return out


# -- RMSNorm ----------------------------------------------------------------------------------------

class Norm:
    """RMSNorm, plain (`rms`) and gated (`gated`), statistics in the compute dtype."""

    def rms(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """y = w · x / sqrt(mean(x²) + eps): bit for bit what `h * rsqrt(h.pow(2).mean(-1) + eps)`
        gives (pow(·, 2) is h·h and mean is sum then divide), in a third of the operations.  # [..., hidden]"""
        cd = compute_dtype(x.dtype)
        h = as_dtype(x, cd)
        var = torch.sum(h * h, -1, keepdim=True).div_(constant(float(h.shape[-1]), cd, h.device))
        h = h * var.add_(constant(eps, cd, h.device)).rsqrt_()
        return as_dtype(h, x.dtype) if weight is None else weight * as_dtype(h, x.dtype)

    def gated(self, y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int,
              eps: float) -> torch.Tensor:
        """RMSNorm(y ⊙ silu(gate)) over groups of `group_size` channels.  # [batch, T, d_inner]"""
        cd = compute_dtype(y.dtype)
        h = as_dtype(y, cd) * F.silu(as_dtype(gate, cd))
        return weight * as_dtype(self.rms(h.view(*h.shape[:-1], -1, group_size), None, eps).view_as(h), y.dtype)


class NativeNorm(Norm):
    """One C call (`cpu_norm`) where it takes the rows."""

    def rms(self, x, weight, eps):
        if cpu_norm.applies(x, weight):
            out = cpu_norm.rms_norm(x, weight, eps)
            if out is not None:
                return out
        return super().rms(x, weight, eps)

    def gated(self, y, gate, weight, group_size, eps):
        if cpu_norm.applies(y, weight, gate):
            out = cpu_norm.rms_norm(y, weight, eps, gate=gate, group=group_size)
            if out is not None:
                return out
        return super().gated(y, gate, weight, group_size, eps)


# -- rotary embedding -------------------------------------------------------------------------------

class Rotary:
    """A forward's `Rotation` (angles of its positions; `apply` rotates q or k)."""
    rotation = Rotation

    def __call__(self, rotary_dim: int, head_dim: int, inv_freq: torch.Tensor, positions: torch.Tensor,
                 dtype: torch.dtype) -> Rotation:
        return self.rotation(rotary_dim, head_dim, inv_freq, positions, dtype)


class NativeRotary(Rotary):
    rotation = NativeRotation


# -- conv window ------------------------------------------------------------------------------------

class ConvWindow:
    """The causal conv window over a forward's inputs from each row's head slot,
    the windows written where `batch`'s plan says: xs [batch, T, conv_dim],
    weight [conv_dim, d_conv] -> [batch, T, conv_dim]."""

    def __call__(self, conv_states, batch, xs, weight, bias, activation):
        return conv_window_update_ref(conv_states, None, None, xs, weight, bias, None, activation, plan=batch.slots)


class NativeConvWindow(ConvWindow):
    def __call__(self, conv_states, batch, xs, weight, bias, activation):
        return cpu_conv.conv_window_update_cpu(conv_states, xs, weight, bias, activation, batch.slots)


class TritonConvWindow(ConvWindow):
    def __call__(self, conv_states, batch, xs, weight, bias, activation):
        return conv_window_update(conv_states, batch.src_slot, batch.snap_slot, xs, weight, bias, batch.num_tokens,
                                  activation)


# -- SSM multi-step updates -------------------------------------------------------------------------

# From this many inputs on, a forward that wants only the final state (prefill, a plain extend) uses the
# chunked scan the mixer passes, where no native recurrence takes the call (float64, padded batches, CUDA):
# on one CPU thread the C recurrence keeps one head's state in L1 and is faster.
SSD_MIN_TOKENS = 16


class Mamba2Steps:
    """The Mamba-2 recurrence over a forward's inputs from each row's head slot,
    writing the snapshots `batch`'s plan asks for -> y [batch, T, nheads,
    headdim]. `final_scan(ssm_states, batch, x, dt, A, B, C)`: the mixer's
    chunked scan, for a forward that keeps only each row's final state."""

    def __call__(self, ssm_states, batch, x, dt, A, B, C, D, final_scan):
        if batch.final_state_only and x.shape[1] >= SSD_MIN_TOKENS:
            return final_scan(ssm_states, batch, x, dt, A, B, C)
        return self.steps(ssm_states, batch, x, dt, A, B, C, D)

    @staticmethod
    def steps(ssm_states, batch, x, dt, A, B, C, D):
        return mamba2_verify_ref(ssm_states, None, None, x, dt, A, B, C, D, None, plan=batch.slots)


class NativeMamba2Steps(Mamba2Steps):
    """The C recurrence (`cpu_mamba2`) first, prefill included."""

    def __call__(self, ssm_states, batch, x, dt, A, B, C, D, final_scan):
        if cpu_mamba2.applies(ssm_states, x, batch.slots):
            return cpu_mamba2.mamba2_steps(ssm_states, batch.slots, x, dt, A, B, C, D)
        return super().__call__(ssm_states, batch, x, dt, A, B, C, D, final_scan)


class TritonMamba2Steps(Mamba2Steps):
    @staticmethod
    def steps(ssm_states, batch, x, dt, A, B, C, D):
        return mamba2_verify(ssm_states, batch.src_slot, batch.snap_slot, x, dt, A, B, C, D, batch.num_tokens)


class Mamba1Steps:
    """The Mamba-1 recurrence over a forward's inputs -> y [batch, T, d_inner]."""

    def __call__(self, ssm_states, batch, x, dt, A, B, C, D):
        return mamba1_verify_ref(ssm_states, None, None, x, dt, A, B, C, D, None, plan=batch.slots)


class NativeMamba1Steps(Mamba1Steps):
    def __call__(self, ssm_states, batch, x, dt, A, B, C, D):
        if cpu_mamba1.applies(ssm_states, x, batch.slots):
            return cpu_mamba1.mamba1_steps(ssm_states, batch.slots, x, dt, A, B, C, D)
        return super().__call__(ssm_states, batch, x, dt, A, B, C, D)


class TritonMamba1Steps(Mamba1Steps):
    def __call__(self, ssm_states, batch, x, dt, A, B, C, D):
        return mamba1_verify(ssm_states, batch.src_slot, batch.snap_slot, x, dt, A, B, C, D, batch.num_tokens)


class GdnSteps:
    """The gated delta rule over a forward's inputs from each row's head slot,
    writing the snapshots `batch`'s plan asks for (`kernels.gdn_verify`) ->
    o [batch, T, HV, d_v]. `final_scan(states, batch, q, k, v, g, beta)`: the
    mixer's chunked form, for a forward that keeps only each row's final state."""

    def __call__(self, states, batch, q, k, v, g, beta, final_scan):
        if batch.final_state_only and v.shape[1] >= SSD_MIN_TOKENS:
            return final_scan(states, batch, q, k, v, g, beta)
        return self.steps(states, batch, q, k, v, g, beta)

    @staticmethod
    def steps(states, batch, q, k, v, g, beta):
        return gdn_verify_ref(states, None, None, q, k, v, g, beta, None, plan=batch.slots)


class NativeGdnSteps(GdnSteps):
    """The C recurrence (`cpu_gdn`) first, prefill included: on one CPU thread
    it keeps a block of a head's state in L1 and is faster than the chunked form."""

    def __call__(self, states, batch, q, k, v, g, beta, final_scan):
        if cpu_gdn.applies(states, v, batch.slots):
            return cpu_gdn.gdn_steps(states, batch.slots, q, k, v, g, beta)
        return super().__call__(states, batch, q, k, v, g, beta, final_scan)


class TritonGdnSteps(GdnSteps):
    @staticmethod
    def steps(states, batch, q, k, v, g, beta):
        return gdn_verify(states, batch.src_slot, batch.snap_slot, q, k, v, g, beta, batch.num_tokens)


# -- log replay -------------------------------------------------------------------------------------

class LogReplay:
    """Advance the state (SSM and conv window) in src_slot[b] over logged inputs
    first[b] .. first[b] + num_steps[b] - 1 and write it to dst_slot[b] (-1:
    untouched); `log` has xs, x, dt, B, C and `shifted`; conv_weight [conv_dim, d_conv]."""

    def __init__(self, replay, rebuild):
        self.replay, self.rebuild = replay, rebuild

    def __call__(self, ssm, conv, src_slot, dst_slot, first, num_steps, log, A, D, conv_weight, conv_bias):
        log = log.shifted(first)
        self.replay(ssm, src_slot, dst_slot, num_steps, log.x, log.dt, A, log.B, log.C)
        self.rebuild(conv, src_slot, dst_slot, num_steps, log.xs)


class NativeLogReplay(LogReplay):
    """The forward's own C loops (`native_replay`), where they take the rows."""

    def __init__(self, replay, rebuild, steps, applies):
        super().__init__(replay, rebuild)
        self.steps, self.applies = steps, applies

    def __call__(self, ssm, conv, src_slot, dst_slot, first, num_steps, log, A, D, conv_weight, conv_bias):
        if cpu_native.takes(ssm, conv, log.x) and replay_native(self.steps, self.applies, ssm, conv, src_slot,
                                                                 dst_slot, first, num_steps, log, A, D,
                                                                 conv_weight, conv_bias):
            return
        super().__call__(ssm, conv, src_slot, dst_slot, first, num_steps, log, A, D, conv_weight, conv_bias)


class GdnLogReplay:
    """A GDN layer's log replay: the gated delta rule over logged k, v, g, β and
    the conv window over logged xs, from src_slot[b] over inputs first[b] ..
    first[b] + num_steps[b] - 1 into dst_slot[b] (-1: untouched); `log` has
    xs, k, v, g, beta and `shifted`."""

    def __init__(self, replay, rebuild):
        self.replay, self.rebuild = replay, rebuild

    def __call__(self, states, conv, src_slot, dst_slot, first, num_steps, log):
        log = log.shifted(first)
        self.replay(states, src_slot, dst_slot, num_steps, log.k, log.v, log.g, log.beta)
        self.rebuild(conv, src_slot, dst_slot, num_steps, log.xs)


# -- attention and K/V ------------------------------------------------------------------------------

class PagedAttention:
    """Attention of q [batch, T, heads, head_dim] over the paged K/V the plan
    `meta` names -> [batch, T, heads, head_dim] (torch: a sequence's consecutive
    pages read as one view of the cache)."""

    def __call__(self, q, k_cache, v_cache, meta, scale):
        return paged_attention_cpu(q, k_cache, v_cache, meta.page_runs, meta.context_list, meta.query_list, scale)


class NativePagedAttention(PagedAttention):
    """The torch form with torch's thread count, inside a native forward that runs
    torch's other operations on one thread (`cpu_native.torch_on_one_thread`):
    a prompt's attention splits well."""

    def __call__(self, q, k_cache, v_cache, meta, scale):
        with cpu_native.torch_threads():
            return super().__call__(q, k_cache, v_cache, meta, scale)


class TritonPagedAttention(PagedAttention):
    def __call__(self, q, k_cache, v_cache, meta, scale):
        if q.dtype not in SUPPORTED_DTYPES:  # float64: the torch form
            return super().__call__(q, k_cache, v_cache, meta, scale)
        return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_lens, scale)


class KVWrite:
    """Scatter new K/V [batch, T_max, kv_heads, head_dim] into one layer's pages
    (k_flat, v_flat [num_blocks · block_size, kv_heads, head_dim]) where `meta` says."""

    def __call__(self, k_flat, v_flat, meta, k, v):
        for flat, x in ((k_flat, k), (v_flat, v)):
            new = x.reshape(-1, *flat.shape[1:])  # [batch * T_max, heads, dim]
            if meta.write_rows is not None:
                new = new.index_select(0, meta.write_rows)
            flat.index_copy_(0, meta.write_index, new)


class TritonKVWrite(KVWrite):
    def __call__(self, k_flat, v_flat, meta, k, v):
        # one fixed-shape launch over slot_mapping (-1: skip): a CUDA graph can hold it
        kv_write(k_flat, v_flat, meta.slot_mapping, k, v)


class TreeForms:
    """A forward over a tree of inputs (`cache.tree_batch`) that runs layer by
    layer: each recurrence from its parent input's state, attention masked to
    each input's ancestors. The torch forms (`kernels/triton/tree_verify.py`);
    the whole C forward takes trees itself where it takes the model (`cpu/forward.py`)."""

    conv_window = staticmethod(tree_verify.conv_window_tree_ref)
    mamba2 = staticmethod(tree_verify.mamba2_tree_ref)
    mamba1 = staticmethod(tree_verify.mamba1_tree_ref)
    gdn = staticmethod(tree_verify.gdn_tree_ref)
    attention = staticmethod(tree_verify.tree_attention_ref)


class NativeTreeForms(TreeForms):
    """The C loops over the tree (`cpu/tree.py`) for the conv window and the
    recurrences where they take the call (float32 CPU tensors), else the torch
    forms; attention's torch form."""

    @staticmethod
    def conv_window(conv_states, slots, tree, xs, weight, bias, activation):
        if cpu_conv.applies(conv_states, xs, weight, bias, activation, slots):
            return cpu_tree.tree_steps(cpu_conv.conv_window_steps, conv_states, slots, tree, xs, weight, bias,
                                       activation)
        return tree_verify.conv_window_tree_ref(conv_states, slots, tree, xs, weight, bias, activation)

    @staticmethod
    def mamba2(ssm_states, slots, tree, x, dt, A, B, C, D):
        if cpu_mamba2.applies(ssm_states, x, slots):
            return cpu_tree.tree_steps(cpu_mamba2.mamba2_steps, ssm_states, slots, tree, x, dt, A, B, C, D)
        return tree_verify.mamba2_tree_ref(ssm_states, slots, tree, x, dt, A, B, C, D)

    @staticmethod
    def mamba1(ssm_states, slots, tree, x, dt, A, B, C, D):
        if cpu_mamba1.applies(ssm_states, x, slots):
            return cpu_tree.tree_steps(cpu_mamba1.mamba1_steps, ssm_states, slots, tree, x, dt, A, B, C, D)
        return tree_verify.mamba1_tree_ref(ssm_states, slots, tree, x, dt, A, B, C, D)

    @staticmethod
    def gdn(states, slots, tree, q, k, v, g, beta):
        if cpu_gdn.applies(states, v, slots):
            return cpu_tree.tree_steps(cpu_gdn.gdn_steps, states, slots, tree, q, k, v, g, beta)
        return tree_verify.gdn_tree_ref(states, slots, tree, q, k, v, g, beta)


class TritonTreeForms(TreeForms):
    """The Triton tree kernels (`triton/tree_recurrences.py`, `triton/tree_attention.py`);
    attention's torch form for float64 or a tree past the kernel's 64-input masks."""

    conv_window = staticmethod(tree_recurrences.conv_window_tree)
    mamba2 = staticmethod(tree_recurrences.mamba2_tree)
    mamba1 = staticmethod(tree_recurrences.mamba1_tree)
    gdn = staticmethod(tree_recurrences.gdn_tree)

    @staticmethod
    def attention(q, k_cache, v_cache, meta, tree, scale):
        if q.dtype not in SUPPORTED_DTYPES or tree.num_inputs > TREE_ATTENTION_MAX_INPUTS:
            return tree_verify.tree_attention_ref(q, k_cache, v_cache, meta, tree, scale)
        return tree_attention(q, k_cache, v_cache, meta, tree, scale)


class Rejection:
    """Verify a round's drafts against the target's probabilities (`kernels.rejection`)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)


# -- one table per op: backend kind -> implementation -----------------------------------------------

LINEAR = {"torch": Linear(), "triton": Linear(), "native": NativeLinear()}
NATIVE_BF16_LINEAR = NativeBf16Linear()  # the native products in bfloat16 compute (`backend.select`'s `compute`)
NORM = {"torch": Norm(), "triton": Norm(), "native": NativeNorm()}
POINTWISE = {"torch": Pointwise(), "triton": Pointwise(), "native": NativePointwise()}
ROTARY = {"torch": Rotary(), "triton": Rotary(), "native": NativeRotary()}
CONV_WINDOW = {"torch": ConvWindow(), "triton": TritonConvWindow(), "native": NativeConvWindow()}
MAMBA2_STEPS = {"torch": Mamba2Steps(), "triton": TritonMamba2Steps(), "native": NativeMamba2Steps()}
MAMBA1_STEPS = {"torch": Mamba1Steps(), "triton": TritonMamba1Steps(), "native": NativeMamba1Steps()}
MAMBA2_REPLAY = {"torch": LogReplay(mamba2_replay_ref, conv_window_rebuild_ref),
                 "triton": LogReplay(mamba2_replay, conv_window_rebuild),
                 "native": NativeLogReplay(mamba2_replay_ref, conv_window_rebuild_ref, cpu_mamba2.mamba2_steps,
                                           cpu_mamba2.applies)}
MAMBA1_REPLAY = {"torch": LogReplay(mamba1_replay_ref, conv_window_rebuild_ref),
                 "triton": LogReplay(mamba1_replay, conv_window_rebuild),
                 "native": NativeLogReplay(mamba1_replay_ref, conv_window_rebuild_ref, cpu_mamba1.mamba1_steps,
                                           cpu_mamba1.applies)}
GDN_STEPS = {"torch": GdnSteps(), "triton": TritonGdnSteps(), "native": NativeGdnSteps()}
GDN_REPLAY = {"torch": GdnLogReplay(gdn_replay_ref, conv_window_rebuild_ref),
              "triton": GdnLogReplay(gdn_replay, conv_window_rebuild),
              "native": GdnLogReplay(cpu_gdn.gdn_replay, conv_window_rebuild_ref)}
PAGED_ATTENTION = {"torch": PagedAttention(), "triton": TritonPagedAttention(), "native": NativePagedAttention()}
KV_WRITE = {"torch": KVWrite(), "triton": TritonKVWrite(), "native": KVWrite()}
TREE_FORMS = {"torch": TreeForms(), "triton": TritonTreeForms(), "native": NativeTreeForms()}
REJECTION = {"torch": Rejection(rejection_ref), "triton": Rejection(rejection), "native": Rejection(rejection_ref)}
