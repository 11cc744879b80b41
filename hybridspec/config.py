"""`HybridConfig`: the typed description of a hybrid Mamba/attention model.

One sub-config per concern (attention, Mamba2, Mamba1, gated DeltaNet, MLP,
MoE). A layer is a pre-norm residual *mixer* (attention, mamba1, mamba2, gdn,
parallel, or none)
followed by a pre-norm residual *feed-forward* (mlp, moe, or none). Nemotron-H
puts the mixer and the MLP in separate layers; that is a layer with
`ffn="none"` and one with mixer `"none"`. A "parallel" mixer (Falcon-H1) runs
attention and Mamba2 side by side on the same normed input and adds their
outputs: the layer is an attention layer (KV pages) and a Mamba layer
(recurrent state) at once, and a round commits both to the same boundary.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Literal

from hybridspec.deprecated import renamed_attributes
from hybridspec.errors import ConfigError
from hybridspec.cache.state_specs import GdnStateSpec, Mamba1StateSpec, Mamba2StateSpec, RecurrentStateSpec

MixerType = Literal["attention", "mamba1", "mamba2", "gdn", "parallel", "none"]
FfnType = Literal["mlp", "moe", "none"]
Activation = Literal["silu", "gelu", "relu2"]

MIXER_TYPES = ("attention", "mamba1", "mamba2", "gdn", "parallel", "none")
RECURRENT_MIXERS = ("mamba1", "mamba2", "gdn", "parallel")  # mixers holding recurrent state
MAMBA2_NORMS = ("gate_then_norm", "norm_then_gate", "gate_only")
# mixer type -> the sub-configs it needs
_MIXER_NEEDS = {"attention": ("attention",), "mamba1": ("mamba1",), "mamba2": ("mamba2",), "gdn": ("gdn",),
                "parallel": ("attention", "mamba2"), "none": ()}
FFN_TYPES = ("mlp", "moe", "none")
ACTIVATIONS = ("silu", "gelu", "relu2")
MOE_ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_group_topk")


# int fields that may be 0 (every other int field must be >= 1)
_MINIMUM = {"shared_intermediate_size": 0, "eos_token_id": 0}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _check_types(config) -> None:
    """Every `int` field holds an integer (a bool is not one) >= its minimum,
    every `bool` field a bool, every `float` field a real number."""
    for f in fields(config):
        value = getattr(config, f.name)
        kind, optional = f.type.removesuffix(" | None"), f.type.endswith(" | None")
        if value is None and optional:
            continue
        where = f"{type(config).__name__}.{f.name}={value!r}"
        if kind == "int":
            minimum = _MINIMUM.get(f.name, 1)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
                     f"{where} must be an integer >= {minimum}")
        elif kind == "bool":
            _require(isinstance(value, bool), f"{where} must be true or false")
        elif kind == "float":
            _require(isinstance(value, (int, float)) and not isinstance(value, bool), f"{where} must be a number")


@dataclass(frozen=True)
class AttentionConfig:
    """Grouped-query attention; rotary embeddings on the first `rotary_dim` dims.
    Qwen3-Next / Qwen3.5: `qk_norm` (an RMSNorm over each head's q and k before
    the rotation) and `output_gate` (q_proj also yields a per-head gate:
    out = o_proj(attention ⊙ sigmoid(gate)))."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    use_rope: bool = True
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    scale: float | None = None  # None: head_dim ** -0.5
    bias: bool = False  # q, k, v (and o unless out_bias says otherwise) have biases
    out_bias: bool | None = None  # None: the same as bias (mamba_ssm's MHA sets the two apart)
    qk_norm: bool = False
    output_gate: bool = False

    def __post_init__(self):
        if self.out_bias is None:
            object.__setattr__(self, "out_bias", self.bias)
        _check_types(self)
        _require(self.num_heads % self.num_kv_heads == 0,
                 f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor) if self.use_rope else 0

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5 if self.scale is None else self.scale


@dataclass(frozen=True)
class Mamba2Config:
    """Mamba2 mixer (Dao & Gu 2024): scalar decay per head, grouped B/C."""

    num_heads: int
    head_dim: int
    d_state: int
    n_groups: int = 1
    d_conv: int = 4
    expand: int = 2
    conv_bias: bool = True
    proj_bias: bool = False
    norm_group_size: int | None = None  # gated RMSNorm group; None: d_inner // n_groups
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    chunk_size: int = 64
    # how the output is gated and normed: RMSNorm(y ⊙ silu(z)) (Mamba2), RMSNorm(y) ⊙ silu(z) or y ⊙ silu(z)
    # with no norm weight (Falcon-H1's mamba_rms_norm / mamba_norm_before_gate)
    norm: Literal["gate_then_norm", "norm_then_gate", "gate_only"] = "gate_then_norm"
    # Falcon-H1's µP multipliers of the in_proj output slices (z, x, B, C, dt), times ssm_in_multiplier
    in_proj_multipliers: tuple[float, float, float, float, float] | None = None
    # tensor parallel (`hybridspec.tp`): the gated RMSNorm's one group spans this many ranks' channels, its
    # mean of squares summed across them
    norm_shards: int = 1

    def __post_init__(self):
        _check_types(self)
        _require(self.num_heads % self.n_groups == 0,
                 f"mamba2 num_heads={self.num_heads} must be a multiple of n_groups={self.n_groups}")
        _require(self.norm in MAMBA2_NORMS, f"mamba2 norm={self.norm!r}; expected one of {MAMBA2_NORMS}")
        _require(self.in_proj_multipliers is None or len(self.in_proj_multipliers) == 5,
                 f"mamba2 in_proj_multipliers={self.in_proj_multipliers!r} needs 5 numbers (z, x, B, C, dt)")

    @cached_property  # read by every forward: the spec is built once
    def d_inner(self) -> int:
        return self.state_spec().d_inner

    @cached_property
    def conv_dim(self) -> int:
        return self.state_spec().conv_window.channels

    @property
    def group_size(self) -> int:
        return self.norm_group_size or self.d_inner // self.n_groups

    def state_spec(self) -> Mamba2StateSpec:
        """SSM state, conv window and input-log sizes per sequence."""
        return Mamba2StateSpec(self.num_heads, self.head_dim, self.d_state, self.n_groups, self.d_conv)


@dataclass(frozen=True)
class Mamba1Config:
    """Mamba1 selective-scan mixer as in Jamba (with dt/B/C RMSNorms)."""

    d_inner: int
    d_state: int
    dt_rank: int
    d_conv: int = 4
    conv_bias: bool = True
    proj_bias: bool = False
    inner_layernorms: bool = True

    def __post_init__(self):
        _check_types(self)

    def state_spec(self) -> Mamba1StateSpec:
        """SSM state, conv window and input-log sizes per sequence."""
        return Mamba1StateSpec(self.d_inner, self.d_state, self.d_conv)


@dataclass(frozen=True)
class GdnConfig:
    """Gated DeltaNet mixer (Yang, Kautz & Hatamizadeh 2025; Qwen3-Next /
    Qwen3.5 linear attention): HK key heads of d_k (q and k), HV value heads of
    d_v (v, the output gate z, the gates a and b, one state [d_k, d_v] each),
    a causal conv of width `d_conv` over [q | k | v], and the output
    RMSNorm(o) ⊙ silu(z) per value head."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    d_conv: int = 4

    def __post_init__(self):
        _check_types(self)
        _require(self.num_value_heads % self.num_key_heads == 0,
                 f"gdn num_value_heads={self.num_value_heads} must be a multiple of "
                 f"num_key_heads={self.num_key_heads}")
        _require(self.d_conv >= 2, f"gdn d_conv={self.d_conv} must be >= 2 (the conv window keeps d_conv - 1)")

    @cached_property  # read by every forward: the spec is built once
    def key_dim(self) -> int:
        return self.state_spec().key_dim

    @cached_property
    def value_dim(self) -> int:
        return self.state_spec().value_dim

    @cached_property
    def conv_dim(self) -> int:
        return self.state_spec().conv_window.channels

    def state_spec(self) -> GdnStateSpec:
        """State, conv window and input-log sizes per sequence."""
        return GdnStateSpec(num_v_heads=self.num_value_heads, num_k_heads=self.num_key_heads,
                            head_k_dim=self.key_head_dim, head_v_dim=self.value_head_dim, d_conv=self.d_conv)


@dataclass(frozen=True)
class MLPConfig:
    intermediate_size: int
    activation: Activation = "silu"
    gated: bool = True
    bias: bool = False
    gate_multiplier: float = 1.0  # Falcon-H1 µP: act(gate_multiplier · gate(x))
    down_multiplier: float = 1.0  # Falcon-H1 µP: down(...) · down_multiplier

    def __post_init__(self):
        _check_types(self)
        _require(self.activation in ACTIVATIONS, f"activation={self.activation!r}; expected one of {ACTIVATIONS}")


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts. `router`: "softmax_topk" (softmax over all experts, keep
    the top-k weights unnormalised: Jamba), "topk_softmax" (softmax over the
    top-k logits: GraniteMoeHybrid) or "sigmoid_group_topk" (Nemotron 3 Nano,
    DeepSeek-V3 style: sigmoid scores s, choice by s + correction bias within
    the `topk_group` best of `n_group` expert groups, weights s of the chosen
    experts, renormalised when `norm_topk_prob`, times `routed_scaling_factor`).
    "softmax_topk" renormalises the kept weights too when `norm_topk_prob`
    (Qwen3-Next, Qwen3.5).
    `gated`: experts (and the shared expert) are act(gate)·up MLPs; ungated
    ones are act(up) (Nemotron-H's squared ReLU). `shared_gate`: the shared
    expert's output is scaled by sigmoid(w · x), w one row (Qwen3-Next, Qwen3.5)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    router: Literal["softmax_topk", "topk_softmax", "sigmoid_group_topk"] = "softmax_topk"
    activation: Activation = "silu"
    shared_intermediate_size: int = 0  # > 0: a dense shared MLP added to the routed output
    gated: bool = True
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    shared_gate: bool = False

    def __post_init__(self):
        _check_types(self)
        _require(self.activation in ACTIVATIONS, f"activation={self.activation!r}; expected one of {ACTIVATIONS}")
        _require(not self.shared_gate or self.shared_intermediate_size > 0,
                 "moe shared_gate=True needs a shared expert (shared_intermediate_size > 0)")
        _require(self.router in MOE_ROUTERS, f"moe router={self.router!r}; expected one of {MOE_ROUTERS}")
        _require(1 <= self.top_k <= self.num_experts,
                 f"moe top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        _require(self.num_experts % self.n_group == 0,
                 f"moe num_experts={self.num_experts} must be a multiple of n_group={self.n_group}")
        _require(1 <= self.topk_group <= self.n_group,
                 f"moe topk_group={self.topk_group} must be in 1..n_group={self.n_group}")
        if self.router == "sigmoid_group_topk":
            # groups are ranked by the sum of their two best scores, and the chosen groups must hold top_k experts
            _require(self.num_experts // self.n_group >= 2,
                     f"moe num_experts / n_group = {self.num_experts // self.n_group} experts per group; the "
                     "group ranking needs at least 2: lower n_group")
            _require(self.topk_group * (self.num_experts // self.n_group) >= self.top_k,
                     f"moe topk_group={self.topk_group} groups of {self.num_experts // self.n_group} experts "
                     f"hold fewer than top_k={self.top_k} experts: raise topk_group or lower top_k")


@dataclass(frozen=True)
class ParallelMixerConfig:
    """Falcon-H1's µP multipliers around a parallel mixer (attention and Mamba-2
    side by side on the same input; not tensor parallelism):
    m_ssm_out · Mamba2(x) + m_attn_out · Attention(m_attn_in · x)."""

    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    mamba_out_multiplier: float = 1.0

    def __post_init__(self):
        _check_types(self)


@dataclass(frozen=True)
class SharedBlockConfig:
    """Zamba2's shared transformer blocks: `num_blocks` blocks of weights, run
    at the layers in `occurrences` (occurrence j uses block j % num_blocks)
    before that layer's mixer. Each occurrence has its own KV pages (it is an
    attention layer of its own for the cache), its own output linear and its
    own LoRA adapters (rank `adapter_rank`) on the MLP's gate/up projection and,
    with `attention_adapters`, on q, k and v. The block reads [h, embeddings]
    (2·hidden wide); `mlp` is its gated MLP."""

    num_blocks: int
    occurrences: tuple[int, ...]
    mlp: MLPConfig
    adapter_rank: int
    attention_adapters: bool = False

    def __post_init__(self):
        object.__setattr__(self, "occurrences", tuple(self.occurrences))
        _check_types(self)
        _require(len(self.occurrences) > 0 and list(self.occurrences) == sorted(set(self.occurrences)),
                 f"shared block occurrences={self.occurrences} must be distinct layer indices in ascending order")

    def block_of(self, layer: int) -> int:
        """The shared block run at `layer` (one of `occurrences`)."""
        return self.occurrences.index(layer) % self.num_blocks


@dataclass(frozen=True)
class HybridConfig:
    vocab_size: int
    hidden_size: int
    layer_types: tuple[MixerType, ...]
    ffn_types: tuple[FfnType, ...]
    rms_norm_eps: float = 1e-6
    attention: AttentionConfig | None = None
    mamba2: Mamba2Config | None = None
    mamba1: Mamba1Config | None = None
    gdn: GdnConfig | None = None
    mlp: MLPConfig | None = None
    moe: MoEConfig | None = None
    parallel: ParallelMixerConfig | None = None  # multipliers of "parallel" mixers; None: all 1
    shared_blocks: SharedBlockConfig | None = None  # Zamba2: shared transformer blocks before some mixers
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0  # logits are divided by it (GraniteMoeHybrid)
    zero_centred_norms: bool = False  # the layer, final and q/k RMSNorm weights w are stored as y = (1 + w)·x̂ (Qwen)
    eos_token_id: int | None = None
    family: str = "hybrid"
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "ffn_types", tuple(self.ffn_types))
        _check_types(self)
        _require(len(self.layer_types) == len(self.ffn_types),
                 f"layer_types has {len(self.layer_types)} entries but ffn_types has {len(self.ffn_types)}")
        _require(len(self.layer_types) > 0, "a model needs at least one layer")
        for kind in self.layer_types:
            _require(kind in MIXER_TYPES, f"unknown mixer type {kind!r}; expected one of {MIXER_TYPES}")
        for kind in self.ffn_types:
            _require(kind in FFN_TYPES, f"unknown feed-forward type {kind!r}; expected one of {FFN_TYPES}")
        for kind in dict.fromkeys(self.layer_types):
            for sub in _MIXER_NEEDS[kind]:
                _require(getattr(self, sub) is not None, f"layer_types uses {kind!r} layers but HybridConfig.{sub} "
                                                          "is None")
        if self.shared_blocks is not None:
            _require(self.attention is not None, "shared_blocks run attention but HybridConfig.attention is None")
            bad = [i for i in self.shared_blocks.occurrences
                   if not 0 <= i < len(self.layer_types) or self.layer_types[i] != "mamba2"]
            _require(not bad, f"shared block occurrences {bad} are not Mamba2 layers; a shared block runs before a "
                              "Mamba2 mixer (Zamba2's hybrid layer)")
        for kind, sub in (("mlp", self.mlp), ("moe", self.moe)):
            _require(kind not in self.ffn_types or sub is not None,
                     f"ffn_types uses {kind!r} layers but HybridConfig.{kind} is None")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def layers_of(self, kind: MixerType) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == kind]

    @property
    def mamba_layers(self) -> list[int]:
        """Layers holding recurrent state, in state-pool order: Mamba-1, Mamba-2, gated DeltaNet (a parallel
        layer is one of them)."""
        return [i for i, t in enumerate(self.layer_types) if t in RECURRENT_MIXERS]

    @property
    def attention_layers(self) -> list[int]:
        """Layers holding KV pages: attention, parallel, and the layers a shared block runs at (one set of KV
        pages per occurrence)."""
        shared = set(self.shared_blocks.occurrences) if self.shared_blocks is not None else set()
        return [i for i, t in enumerate(self.layer_types) if t in ("attention", "parallel") or i in shared]

    def state_spec(self, layer: int) -> RecurrentStateSpec:
        """Recurrent-state sizes of recurrent layer `layer` (an index into layer_types)."""
        kind = self.layer_types[layer]
        sub = self.mamba1 if kind == "mamba1" else self.gdn if kind == "gdn" else self.mamba2
        return sub.state_spec()

    def recurrent_state_specs(self) -> list[RecurrentStateSpec]:
        """One entry per recurrent layer, in `mamba_layers` order (the state pool's layout)."""
        return [self.state_spec(layer) for layer in self.mamba_layers]


# the old name of ParallelMixerConfig, which read as tensor parallelism (`hybridspec.tp`)
__getattr__ = renamed_attributes(globals(), {"ParallelConfig": "ParallelMixerConfig"})
