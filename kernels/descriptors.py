"""What a model tells its kernels: one plain dataclass per layer part, of its
weights, sizes and state slots. Models build them (`describe()` on each
layer); the native whole-forward and block kernels read only these, never a
module's attributes, so a part's kind is its descriptor's type and a kernel
cannot take a part it was not written for (an MoE is never an MLP).

They live in `kernels/` because they are the kernels' vocabulary: models
import them, kernels never import models. Frozen and compared by identity:
a kernel may keep what it derived from one (weight addresses, checks) keyed
by the descriptor itself, and a model that replaces its parameters describes
itself again (`HybridModel.bind_backend`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch


@dataclass(frozen=True, eq=False)
class NormDesc:
    """RMSNorm: y = weight · x / sqrt(mean(x²) + eps)."""
    weight: torch.Tensor  # [hidden]
    eps: float


@dataclass(frozen=True, eq=False)
class MLPDesc:
    """A dense feed-forward: gated down(act(g·gate(x)) ⊙ up(x))·d, or plain down(act(up(x)))·d
    (`gate` None), g and d the multipliers. Weights [out, in]."""
    up: torch.Tensor
    down: torch.Tensor
    gate: torch.Tensor | None
    up_bias: torch.Tensor | None
    gate_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    activation: str  # "silu", "gelu" or "relu2"
    gate_multiplier: float
    down_multiplier: float


@dataclass(frozen=True, eq=False)
class MoEDesc:
    """Routed experts (+ a dense shared MLP): no native kernel takes it."""
    num_experts: int
    top_k: int
    shared: MLPDesc | None


@dataclass(frozen=True, eq=False)
class Mamba2Desc:
    """A Mamba-2 mixer (models/mamba2.py): weights, sizes and its state slots
    (`state_layer` in the cache's state pool). `A` is -exp(A_log) in float32.
    `make_log(xs, x, dt, B, C)` builds the input-log entry of one forward from
    views the kernel wrote (the recurrent layer's own log type)."""
    in_proj: torch.Tensor  # [d_inner + conv_dim + nheads, hidden]
    in_bias: torch.Tensor | None
    in_scale: torch.Tensor | None  # µP vector over the in_proj output (Falcon-H1)
    conv_kernel: torch.Tensor  # [conv_dim, d_conv]
    conv_bias: torch.Tensor | None
    dt_bias: torch.Tensor  # [nheads]
    A: torch.Tensor  # [nheads] float32
    D: torch.Tensor  # [nheads]
    norm_weight: torch.Tensor | None  # the gated norm's [d_inner]
    norm: str  # "gate_then_norm", "norm_then_gate" or "gate_only"
    group_size: int
    time_step_limit: tuple[float, float]
    out_proj: torch.Tensor  # [hidden, d_inner]
    out_bias: torch.Tensor | None
    d_inner: int
    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    d_conv: int
    conv_dim: int
    state_layer: int
    make_log: Callable


@dataclass(frozen=True, eq=False)
class Mamba1Desc:
    """A Mamba-1 mixer (models/mamba1.py): no native block takes it (its
    recurrence and conv window run natively inside the module path)."""
    d_inner: int
    d_state: int
    state_layer: int


@dataclass(frozen=True, eq=False)
class GdnDesc:
    """A gated DeltaNet mixer (models/gated_deltanet.py): weights, sizes and its
    state slots. No native block takes it yet (its recurrence runs through the
    backend's `gdn_steps` inside the module path), so a model with one runs
    layer by layer. `make_log(xs, k, v, g, beta)` builds its input-log entry."""
    in_proj: torch.Tensor  # [2·HK·d_k + 2·HV·d_v + 2·HV, hidden]: q, k, v, z, b, a
    conv_kernel: torch.Tensor  # [conv_dim, d_conv]
    dt_bias: torch.Tensor  # [HV]
    A_log: torch.Tensor  # [HV]
    norm_weight: torch.Tensor  # the gated norm's [d_v]
    out_proj: torch.Tensor  # [hidden, HV·d_v]
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    d_conv: int
    conv_dim: int
    state_layer: int
    make_log: Callable


@dataclass(frozen=True, eq=False)
class GatedAttentionDesc:
    """Attention with q/k RMSNorms and a sigmoid output gate (Qwen3-Next,
    Qwen3.5; models/gated_attention.py): no native block takes it."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_layer: int


@dataclass(frozen=True, eq=False)
class AttentionDesc:
    """Grouped-query attention over the paged K/V cache (`kv_layer`), rotary
    embedding over `rotary_dim` dims when `inv_freq` is set. Weights [out, in]."""
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    qkv_bias: bool
    o_bias: bool
    inv_freq: torch.Tensor | None  # [rotary_dim / 2] float32
    rotary_dim: int
    softmax_scale: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_layer: int


@dataclass(frozen=True, eq=False)
class ComposedMixerDesc:
    """A mixer made of several parts with multipliers between them (Falcon-H1's
    parallel attention + Mamba-2): no native block takes it."""
    parts: tuple


MixerDesc = Mamba2Desc | Mamba1Desc | GdnDesc | AttentionDesc | GatedAttentionDesc | ComposedMixerDesc
FFNDesc = MLPDesc | MoEDesc


@dataclass(frozen=True, eq=False)
class LayerDesc:
    """One decoder layer: h += r·mixer(mixer_norm(h)); h += r·ffn(ffn_norm(h)).
    `shared_block`: a Zamba2 shared block's occurrence feeds the mixer (no
    native block takes the layer's mixer then)."""
    mixer: MixerDesc | None
    mixer_norm: NormDesc | None
    ffn: FFNDesc | None
    ffn_norm: NormDesc | None
    residual_multiplier: float
    shared_block: bool


@dataclass(frozen=True, eq=False)
class ModelDesc:
    """A whole model: embedding [vocab, hidden] (its rows looked up), layers,
    final norm, LM head [vocab, hidden], and the scalings around them."""
    embed: torch.Tensor
    layers: tuple[LayerDesc, ...]
    final_norm: NormDesc
    lm_head: torch.Tensor
    embedding_multiplier: float
    logits_scaling: float
    dtype: torch.dtype

    @property
    def mamba2_layers(self) -> list[tuple[int, Mamba2Desc]]:
        """(layer index, mixer) of each Mamba-2 mixer, in layer order."""
        return [(i, layer.mixer) for i, layer in enumerate(self.layers) if isinstance(layer.mixer, Mamba2Desc)]


class MTPInput(NamedTuple):
    """An MTP layer's input stage (`models/mtp.py`) before the layers of a whole forward:
    fc([norm_e(embedding) ; norm_h(hidden)]). `hidden` [batch, T, hidden] float32 contiguous
    beside the inputs; `normed_out` [batch, hidden] receives the final-normed rows (o)."""
    fc: torch.Tensor  # a PanelWeight [hidden, 2 · hidden]
    norm_e: torch.Tensor  # [hidden]
    norm_h: torch.Tensor  # [hidden]
    eps: float
    hidden: torch.Tensor
    normed_out: torch.Tensor
