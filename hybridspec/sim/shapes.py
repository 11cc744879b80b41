"""A hybrid model of recurrent (Mamba2 or GDN), attention, MLP and MoE
blocks described by its config dimensions, and the per-forward bytes and
FLOPs (`ModelCost`) that follow from them. The recurrent layers' own terms
(weights, state, input log, scan FLOPs; their symbols) come from
`hybridspec.sim.mixers`; a Mamba2 layer's d_inner is mamba_expand·d_model
unless mamba_d_inner says otherwise. Norms and biases are left out (well
under 0.1% of the weights).
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridspec.errors import ConfigError
from hybridspec.sim.cost_model import ModelCost
from hybridspec.sim.mixers import GdnMixer, Mamba2Mixer
from hybridspec.cache.state_specs import AttentionKVSpec, bytes_per_slot, log_bytes_per_input

MAMBA2_FIELDS = ("mamba_d_state", "mamba_headdim", "mamba_ngroups", "mamba_expand", "mamba_d_conv")


@dataclass(frozen=True, kw_only=True)
class HybridShape:
    """Dimensions of a hybrid model; counts of each block type, not their order.

    The recurrent layers (num_mamba_layers of them) are Mamba2 layers given by
    the mamba_* fields, or GDN layers given by `gdn` (a `GdnMixer`) with the
    mamba_* fields left unset.

    num_mlp_blocks: MLP blocks in the stack; separate_mlp_layers: False when
    each mixer layer holds its own MLP (Bamba), True when MLPs are layers of
    their own (Nemotron-H). mlp_matrices: 3 for a gated MLP (gate, up, down), 2
    for a plain one (up, down). weight_bytes: bytes per weight, KV and logged
    activation (the model dtype); state_bytes: bytes per SSM state and conv
    window element (the state dtype: float32 by default, as `Engine` keeps it).

    Optional, for the newer families (defaults describe Bamba/Nemotron-H):
    mamba_d_inner: the Mamba2 width when it is not mamba_expand·d_model
    (Nemotron 3 Nano, Falcon-H1's mamba_d_ssm). num_moe_blocks > 0: MoE layers
    of their own with moe_num_experts routed experts of width moe_intermediate
    (moe_top_k per token, moe_matrices each) plus a shared expert of width
    moe_shared_intermediate. parallel_mixers: each layer runs attention and
    Mamba2 side by side (Falcon-H1), so layers = Mamba layers = attention
    layers. attention_weight_copies / mlp_weight_copies: distinct weight sets
    when attention/MLP blocks share weights across occurrences (Zamba2: KV per
    occurrence, weights per shared block); attention_input_dim: the width
    q, k, v read (Zamba2's shared block reads [h, embeddings], 2·d_model);
    extra_params: other per-forward weights (Zamba2's per-occurrence linears
    and adapters). stack_layers: the layer count when the block counts do not
    give it (Zamba2's shared blocks run inside Mamba layers).
    attention_output_gate: q_proj also produces a per-channel output gate, as
    wide as the queries (Qwen3-Next's gated attention).
    lm_head_shared: the embedding and LM head are another model's (an MTP
    layer runs the target's): a forward still reads the LM head whole, but
    neither is held or counted among this model's parameters.
    """

    name: str
    d_model: int
    vocab_size: int
    num_mamba_layers: int
    num_attention_layers: int
    num_mlp_blocks: int
    mlp_intermediate: int
    mlp_matrices: int
    separate_mlp_layers: bool
    mamba_d_state: int | None = None
    mamba_headdim: int | None = None
    mamba_ngroups: int | None = None
    mamba_expand: int | None = None
    mamba_d_conv: int | None = None
    gdn: GdnMixer | None = None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_embeddings: bool
    weight_bytes: int = 2
    state_bytes: int = 4
    source: str = "assumed"
    mamba_d_inner: int | None = None
    num_moe_blocks: int = 0
    moe_num_experts: int = 0
    moe_top_k: int = 0
    moe_intermediate: int = 0
    moe_shared_intermediate: int = 0
    moe_matrices: int = 2
    parallel_mixers: bool = False
    attention_weight_copies: int | None = None
    mlp_weight_copies: int | None = None
    attention_input_dim: int | None = None
    extra_params: int = 0
    stack_layers: int | None = None
    attention_output_gate: bool = False
    lm_head_shared: bool = False

    def __post_init__(self) -> None:
        self._check_recurrent_kind()
        if self.parallel_mixers and self.num_mamba_layers != self.num_attention_layers:
            raise ConfigError(f"{self.name}: parallel_mixers needs one attention per Mamba layer, got "
                              f"{self.num_mamba_layers} Mamba and {self.num_attention_layers} attention layers")
        if self.num_moe_blocks and not 1 <= self.moe_top_k <= self.moe_num_experts:
            raise ConfigError(f"{self.name}: moe_top_k={self.moe_top_k} must be in 1..moe_num_experts="
                              f"{self.moe_num_experts}")
        if self.gdn is None and self.d_inner % self.mamba_headdim:
            raise ConfigError(
                f"{self.name}: mamba_expand·d_model={self.d_inner} is not a multiple of "
                f"mamba_headdim={self.mamba_headdim}; pick a headdim that divides it"
            )

    def _check_recurrent_kind(self) -> None:
        """Mamba2 fields or a GDN layer, exactly one of the two."""
        given = [name for name in MAMBA2_FIELDS if getattr(self, name) is not None]
        if self.gdn is not None and (given or self.mamba_d_inner is not None):
            raise ConfigError(f"{self.name}: gdn is set, so the recurrent layers are GDN layers; leave {given} "
                              "and mamba_d_inner unset")
        if self.gdn is None and len(given) < len(MAMBA2_FIELDS):
            missing = [name for name in MAMBA2_FIELDS if name not in given]
            raise ConfigError(f"{self.name}: Mamba2 layers need {missing}; set them, or set gdn=GdnMixer(...) "
                              "for gated-DeltaNet layers")

    @property
    def recurrent(self) -> Mamba2Mixer | GdnMixer:
        """The recurrent layer's shape: the GDN layer, or the Mamba2 layer of the mamba_* fields."""
        if self.gdn is not None:
            return self.gdn
        return Mamba2Mixer(self.d_inner, self.mamba_headdim, self.mamba_d_state, self.mamba_ngroups,
                           self.mamba_d_conv)

    @property
    def d_inner(self) -> int:
        """The Mamba2 width."""
        return self.mamba_d_inner or self.mamba_expand * self.d_model

    @property
    def mamba_nheads(self) -> int:
        return self.d_inner // self.mamba_headdim

    @property
    def conv_dim(self) -> int:
        return self.recurrent.conv_dim

    @property
    def num_layers(self) -> int:
        if self.stack_layers is not None:
            return self.stack_layers
        if self.parallel_mixers:
            return self.num_mamba_layers
        mixers = self.num_mamba_layers + self.num_attention_layers
        return mixers + self.num_mlp_blocks + self.num_moe_blocks if self.separate_mlp_layers else mixers

    def recurrent_params(self) -> int:
        """One recurrent mixer (`hybridspec.sim.mixers`)."""
        return self.recurrent.params(self.d_model)

    def attention_params(self) -> int:
        """One attention mixer: q (and its output gate), k, v, o projections."""
        d_in = self.attention_input_dim or self.d_model
        q_and_o = (d_in * (1 + self.attention_output_gate) + self.d_model) * self.num_heads * self.head_dim
        return q_and_o + 2 * d_in * self.num_kv_heads * self.head_dim

    def mlp_params(self) -> int:
        return self.mlp_matrices * self.d_model * self.mlp_intermediate

    def expert_params(self) -> int:
        """One routed expert of one MoE layer."""
        return self.moe_matrices * self.d_model * self.moe_intermediate

    def dense_params(self, per_occurrence: bool = True) -> int:
        """Every weight but the routed experts and the embeddings. A shared block
        counts once per occurrence (each occurrence reads and runs it again),
        or once per weight copy with per_occurrence=False (memory held)."""
        attention, mlp = self.num_attention_layers, self.num_mlp_blocks
        if not per_occurrence:
            attention = attention if self.attention_weight_copies is None else self.attention_weight_copies
            mlp = mlp if self.mlp_weight_copies is None else self.mlp_weight_copies
        shared_experts = self.num_moe_blocks * self.moe_matrices * self.d_model * self.moe_shared_intermediate
        routers = self.num_moe_blocks * self.moe_num_experts * self.d_model
        return (self.num_mamba_layers * self.recurrent_params() + attention * self.attention_params()
                + mlp * self.mlp_params() + shared_experts + routers + self.extra_params)

    def block_params(self) -> int:
        """Every mixer, MLP and expert weight held (shared blocks once), embeddings excluded."""
        return self.dense_params(per_occurrence=False) + self.num_moe_blocks * self.moe_num_experts * self.expert_params()

    def active_block_params(self) -> int:
        """The block weights one token runs through (top-k of the routed experts)."""
        return self.dense_params() + self.num_moe_blocks * self.moe_top_k * self.expert_params()

    def total_params(self) -> int:
        """Every weight held, embeddings included unless they are another model's."""
        embeddings = 0 if self.lm_head_shared else self.vocab_size * self.d_model
        return self.block_params() + embeddings * (1 if self.tie_embeddings else 2)

    def state_spec(self):
        """One recurrent layer's spec (a `RecurrentStateSpec`, `hybridspec.cache.state_specs`)."""
        return self.recurrent.state_spec()

    def state_bytes_per_layer(self) -> int:
        """SSM state plus conv window, in the state dtype (Mamba2: nheads·headdim·d_state
        and conv_dim·(d_conv − 1))."""
        return bytes_per_slot([self.state_spec()], self.state_bytes)

    def log_bytes_per_token_per_layer(self) -> int:
        """Input log of one token: activations in the model dtype, time steps in the
        state dtype (Mamba2: conv inputs, x, B and C; dt)."""
        return log_bytes_per_input([self.state_spec()], self.weight_bytes, self.state_bytes)

    def kv_bytes_per_token_per_layer(self) -> int:
        """K and V of one cached token in one attention layer, in the model dtype."""
        return AttentionKVSpec(self.num_kv_heads, self.head_dim).bytes_per_token(self.weight_bytes)

    def scan_flops_per_token_per_layer(self) -> int:
        return self.recurrent.scan_flops_per_token()

    def model_cost(self) -> ModelCost:
        """Bytes and FLOPs of one forward; the input embedding is a row gather
        (not read whole), the LM head is read whole."""
        read_params = self.dense_params() + self.vocab_size * self.d_model  # dense blocks + LM head
        active_params = self.active_block_params() + self.vocab_size * self.d_model
        conv_flops = self.recurrent.conv_flops_per_token()
        replay_flops = self.num_mamba_layers * (self.scan_flops_per_token_per_layer() + conv_flops)
        return ModelCost(
            name=self.name,
            param_bytes=float(read_params * self.weight_bytes),
            flops_per_token=float(2 * active_params + self.num_mamba_layers * self.scan_flops_per_token_per_layer()),
            attention_flops_per_context_token=float(4 * self.num_attention_layers * self.num_heads * self.head_dim),
            kv_bytes_per_token=float(self.num_attention_layers * self.kv_bytes_per_token_per_layer()),
            state_bytes=float(self.num_mamba_layers * self.state_bytes_per_layer()),
            log_bytes_per_token=float(self.num_mamba_layers * self.log_bytes_per_token_per_layer()),
            replay_flops_per_token=float(replay_flops),
            source=self.source,
            expert_bytes=float(self.num_moe_blocks * self.expert_params() * self.weight_bytes),
            resident_param_bytes=float((self.dense_params(per_occurrence=False)
                                        + (0 if self.lm_head_shared else self.vocab_size * self.d_model))
                                       * self.weight_bytes),
            num_experts=self.moe_num_experts if self.num_moe_blocks else 0,
            experts_per_token=self.moe_top_k if self.num_moe_blocks else 0,
            num_layers=self.num_layers,
            hidden_size=self.d_model,
            activation_bytes=self.weight_bytes,
        )
