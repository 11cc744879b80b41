"""Roofline cost of a speculative round on a hybrid model, and the crossover batch.

A forward of `tokens` tokens per sequence at batch B takes
    max(bytes_moved / memory_bandwidth, flops / peak_flops)
with bytes_moved = weights + B·(KV read + KV written + state read + state written)
(for a MoE model, weights = the dense weights + the routed experts the B·tokens
tokens are expected to touch: `ModelCost.experts_read_bytes`)
and flops = B·tokens·(flops_per_token + attention over the context).
Under tensor parallelism (`AllReduceLink`) the hardware is the ranks taken as
one device, and every target layer adds two all-reduces of hidden·B·tokens
activations (its mixer's and its feed-forward's partial outputs), which do
not overlap the layer's own work; a separate draft model runs whole on every
rank, at one rank's bandwidth and FLOPs, while a drafter sharded with the
target (`draft_sharded`: an MTP layer over the target's vocabulary-parallel LM
head, an EAGLE-3 head at the target's tensor-parallel size) runs on all ranks
and pays its own layers' all-reduces.
A tree draft (`tree_round_s`) is priced by its nodes: its verify forward
reads every node, however shallow the tree.
The checkpoint traffic a policy adds on top (extra snapshot writes, the input
log, replay) is charged as separate memory time: it is done by the Mamba scan
and replay kernels, which are memory-bound on their own and do not hide under
the matmuls. docs/simulator.md derives every term.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence, Union

import numpy as np

from hybridspec.errors import ConfigError
from hybridspec.costs.checkpoint_terms import snapshot_writes_per_round
from hybridspec.costs.closed_form import expected_tokens
from hybridspec.costs.tree_form import tree_expected_tokens
from hybridspec.costs.round_time import Batch, RoundTime, StepCosts, check_batch, round_time
from hybridspec.costs.validation import check_cost, check_gamma, check_int


@dataclass(frozen=True)
class Hardware:
    """One accelerator: HBM bandwidth (bytes/s), dense peak FLOP/s and HBM
    capacity (bytes)."""

    name: str
    memory_bandwidth: float
    peak_flops: float
    memory_bytes: float
    source: str = "assumed"

    def __post_init__(self) -> None:
        check_cost(self.memory_bandwidth, "memory_bandwidth", positive=True)
        check_cost(self.peak_flops, "peak_flops", positive=True)
        check_cost(self.memory_bytes, "memory_bytes", positive=True)


@dataclass(frozen=True)
class AllReduceLink:
    """The interconnect of `ranks` tensor-parallel devices: an all-reduce of n
    bytes (ring: each rank sends and receives 2·(ranks − 1)/ranks · n) takes
        latency + 2·(ranks − 1)/ranks · n / bandwidth
    with bandwidth the bytes/s one device sends (one direction) and latency the
    fixed cost of one collective (launch and synchronisation)."""

    ranks: int
    bandwidth: float
    latency: float
    source: str = "assumed"

    def __post_init__(self) -> None:
        check_int(self.ranks, "ranks", minimum=2)
        check_cost(self.bandwidth, "bandwidth", positive=True)
        check_cost(self.latency, "latency")

    def time(self, nbytes) -> Union[float, np.ndarray]:
        """Seconds of one all-reduce of `nbytes` per rank."""
        return self.latency + 2 * (self.ranks - 1) / self.ranks * nbytes / self.bandwidth


@dataclass(frozen=True)
class ModelCost:
    """Cost figures of one model (target or draft); 'per sequence' unless said.

    param_bytes: weight bytes read once per forward for the whole batch.
    flops_per_token: FLOPs per token (matmuls, LM head, scan), attention over
        the context excluded.
    attention_flops_per_context_token: FLOPs per new token per cached token
        (QKᵀ and PV over every attention layer).
    kv_bytes_per_token: K and V bytes of every attention layer per cached token.
    state_bytes: recurrent state (SSM state + conv window) of every Mamba layer.
    log_bytes_per_token: input log of every Mamba layer per verify input.
    replay_flops_per_token: FLOPs of one log-replayed step (recurrence only).
    expert_bytes, num_experts, experts_per_token: routed experts (MoE models;
        0 for dense ones). expert_bytes is one expert's weights summed over
        every MoE layer; param_bytes excludes the routed experts, and a forward
        of n tokens reads the experts they touch (`experts_read_bytes`).
    resident_param_bytes: the dense weights held in memory when they differ
        from param_bytes (Zamba2's shared block is read per occurrence but held
        once); 0: the same as param_bytes.
    num_layers, hidden_size, activation_bytes: what a tensor-parallel
        forward all-reduces (two hidden-wide activations per layer and token);
        0 layers: none.
    """

    name: str
    param_bytes: float
    flops_per_token: float
    attention_flops_per_context_token: float
    kv_bytes_per_token: float
    state_bytes: float
    log_bytes_per_token: float
    replay_flops_per_token: float
    source: str = "assumed"
    expert_bytes: float = 0.0
    resident_param_bytes: float = 0.0
    num_experts: int = 0
    experts_per_token: int = 0
    num_layers: int = 0
    hidden_size: int = 0
    activation_bytes: int = 2

    def __post_init__(self) -> None:
        for field in fields(self):
            if field.name not in ("name", "source", "num_experts", "experts_per_token", "num_layers", "hidden_size",
                                  "activation_bytes"):
                check_cost(getattr(self, field.name), f"{self.name}.{field.name}")
        check_cost(self.param_bytes, f"{self.name}.param_bytes", positive=True)
        check_int(self.num_experts, f"{self.name}.num_experts", minimum=0)
        check_int(self.experts_per_token, f"{self.name}.experts_per_token", minimum=0)
        if self.experts_per_token > self.num_experts:
            raise ConfigError(f"{self.name}: experts_per_token={self.experts_per_token} exceeds "
                              f"num_experts={self.num_experts}; a token picks at most every expert")

    @property
    def resident_bytes(self) -> float:
        """Every weight byte held in memory, routed experts included."""
        return (self.resident_param_bytes or self.param_bytes) + self.expert_bytes * self.num_experts

    def experts_read_bytes(self, num_tokens) -> Union[float, np.ndarray]:
        """Expected routed-expert bytes a forward of `num_tokens` tokens (whole
        batch) reads, assuming each token picks k of E experts uniformly and
        independently: an expert is touched with probability 1 − (1 − k/E)^n.
        Skewed routing touches fewer; this is the upper end for a balanced router."""
        if self.num_experts == 0:
            return 0.0
        untouched = (1.0 - self.experts_per_token / self.num_experts) ** np.asarray(num_tokens, dtype=float)
        return self.expert_bytes * self.num_experts * (1.0 - untouched)


@dataclass(frozen=True)
class CostModel:
    """Roofline model of a target and a drafter (None: an n-gram drafter that
    costs nothing) on one accelerator, with `context_len` tokens per sequence
    already in the cache."""

    hardware: Hardware
    target: ModelCost
    draft: Optional[ModelCost]
    context_len: int = 4096
    all_reduce: Optional[AllReduceLink] = None  # tensor parallel over `hardware` (its ranks as one device)
    draft_sharded: bool = False  # the drafter tensor-parallel like the target, not whole on one rank

    def __post_init__(self) -> None:
        check_int(self.context_len, "context_len", minimum=0)

    def all_reduce_time(self, model: ModelCost, batch: Batch, tokens: int) -> Union[float, np.ndarray]:
        """The all-reduces of one tensor-parallel forward: two per layer of
        hidden·batch·tokens activations (0 without tensor parallelism)."""
        if self.all_reduce is None:
            return 0.0
        nbytes = model.hidden_size * check_batch(batch) * tokens * model.activation_bytes
        return model.num_layers * 2 * self.all_reduce.time(nbytes)

    def forward_time(self, model: ModelCost, batch: Batch, tokens: int) -> Union[float, np.ndarray]:
        """Roofline time of one forward of `tokens` tokens per sequence on the
        whole hardware, its all-reduces added under tensor parallelism."""
        return self._roofline(model, batch, tokens, 1) + self.all_reduce_time(model, batch, tokens)

    def draft_step_time(self, batch: Batch) -> Union[float, np.ndarray]:
        """One draft step (0 for a drafter that costs nothing): sharded like the
        target, or whole on one rank of a tensor-parallel target."""
        if self.draft is None:
            return 0.0
        if self.draft_sharded or self.all_reduce is None:
            return self.forward_time(self.draft, batch, 1)
        return self._roofline(self.draft, batch, 1, self.all_reduce.ranks)

    def _roofline(self, model: ModelCost, batch: Batch, tokens: int, share: int) -> Union[float, np.ndarray]:
        """Roofline time on 1/share of the hardware."""
        batch = check_batch(batch)
        tokens = check_int(tokens, "tokens", minimum=1)
        per_sequence_bytes = (
            (self.context_len + tokens) * model.kv_bytes_per_token  # KV read + new KV written
            + 2 * model.state_bytes  # state read, final state written
        )
        moved = model.param_bytes + model.experts_read_bytes(batch * tokens) + batch * per_sequence_bytes
        attended = self.context_len + (tokens + 1) / 2  # mean cached tokens a new token attends to
        flops = batch * tokens * (model.flops_per_token + attended * model.attention_flops_per_context_token)
        return np.maximum(share * moved / self.hardware.memory_bandwidth, share * flops / self.hardware.peak_flops)

    def step_costs(self, batch: Batch, gamma: int) -> StepCosts:
        """Roofline `StepCosts` at `batch` (int or integer array) and γ."""
        gamma = check_gamma(gamma)
        bandwidth, peak = self.hardware.memory_bandwidth, self.hardware.peak_flops
        target = self.target
        attention_flops = self.context_len * target.attention_flops_per_context_token
        return StepCosts(
            batch=batch,
            plain_step_s=self.forward_time(target, batch, 1),
            draft_step_s=self.draft_step_time(batch),
            verify_s=self.forward_time(target, batch, gamma + 1),
            snapshot_write_s=batch * target.state_bytes / bandwidth,
            log_write_s=batch * target.log_bytes_per_token / bandwidth,
            restore_s=2 * target.state_bytes / bandwidth,
            log_replay_step_s=max(target.log_bytes_per_token / bandwidth, target.replay_flops_per_token / peak),
            # a token replay re-reads the weights: the dense ones and (MoE) the experts of ~one token per sequence
            token_replay_fixed_s=(target.param_bytes + target.experts_read_bytes(batch)) / bandwidth,
            token_replay_step_s=(target.flops_per_token + attention_flops) / peak,
        )

    def max_batch(self, gamma: int, snapshot_every: int = 1, log_inputs: bool = True) -> int:
        """Sequences that fit in HBM beside both models' weights (activations
        and workspace ignored). Per sequence: KV for context + γ + 1 tokens of
        both models; the target's round-start state plus one slot per snapshot
        write; its input log when on; the drafter's state for each draft step."""
        gamma = check_gamma(gamma)
        slots = 1 + snapshot_writes_per_round(gamma, snapshot_every)
        tokens = self.context_len + gamma + 1
        models = (self.target,) if self.draft is None else (self.target, self.draft)
        per_sequence = sum(model.kv_bytes_per_token * tokens for model in models)
        per_sequence += slots * self.target.state_bytes + (gamma + 1) * self.target.log_bytes_per_token * log_inputs
        if self.draft is not None:
            per_sequence += (gamma + 1) * self.draft.state_bytes
        if per_sequence <= 0:
            raise ConfigError("the models keep no KV and no state per sequence, so memory bounds no batch size")
        free = self.hardware.memory_bytes - sum(model.resident_bytes for model in models)
        return max(int(free // per_sequence), 0)

    def round_time(
        self, batch: Batch, gamma: int, alpha: float, snapshot_every: int = 1, log_inputs: bool = True
    ) -> RoundTime:
        return round_time(self.step_costs(batch, gamma), gamma, alpha, snapshot_every, log_inputs)

    def speedup(
        self, batch: Batch, gamma: int, alpha: float, snapshot_every: int = 1, log_inputs: bool = True
    ) -> Union[float, np.ndarray]:
        """E[tokens] · plain step / round time, at each batch size."""
        costs = self.step_costs(batch, gamma)
        rounds = round_time(costs, gamma, alpha, snapshot_every, log_inputs)
        return expected_tokens(alpha, gamma) * costs.plain_step_s / rounds.total_s

    def tree_round_s(self, batch: Batch, widths: Sequence[int]) -> Union[float, np.ndarray]:
        """Seconds of one tree round, priced by its nodes (verify inputs), not its
        depth: the drafter steps its spine (len(widths) steps), the target's forward
        reads nodes + 1 inputs per row, and every node's state is kept (one state
        write per node, as the chain's snapshot-every-input policy writes one per
        input); nothing is replayed, the accepted node's state being kept."""
        nodes = sum(check_int(w, "width", minimum=1) for w in widths)
        costs = self.step_costs(batch, nodes)
        return len(widths) * costs.draft_step_s + costs.verify_s + nodes * costs.snapshot_write_s

    def tree_speedup(self, batch: Batch, widths: Sequence[int], alpha: float,
                     rescue: float) -> Union[float, np.ndarray]:
        """E[tokens] of the tree (`costs.tree_form`) · plain step / tree round time.
        Compare with `speedup(batch, γ = nodes, α, snapshot_every=1, log_inputs=False)`:
        the chain of as many verify inputs, keeping every input's state too."""
        tokens = tree_expected_tokens(alpha, widths, rescue)
        return tokens * self.forward_time(self.target, batch, 1) / self.tree_round_s(batch, widths)


def crossover_batch(
    model: CostModel,
    alpha: float,
    gamma: int,
    snapshot_every: int = 1,
    log_inputs: bool = True,
    max_batch: int = 4096,
) -> Optional[int]:
    """The smallest batch B in 1..max_batch where speculation stops paying,
    `model.speedup(B) <= 1`; None when it still pays at max_batch. A return of
    1 means it never pays."""
    max_batch = check_int(max_batch, "max_batch", minimum=1)
    batches = np.arange(1, max_batch + 1)  # [max_batch]
    gains = model.speedup(batches, gamma, alpha, snapshot_every, log_inputs)  # [max_batch]
    losing = np.flatnonzero(gains <= 1.0)
    return int(batches[losing[0]]) if losing.size else None


def break_even_alpha(
    model: CostModel,
    batch: int,
    gamma: int,
    snapshot_every: int = 1,
    log_inputs: bool = True,
    tolerance: float = 1e-4,
) -> Optional[float]:
    """The smallest α (within `tolerance`) at which speculation pays at `batch`,
    `model.speedup > 1`; None when it does not pay even at α = 1. Bisection:
    the speedup grows with α (more tokens per round, fewer replays)."""
    def pays(alpha: float) -> bool:
        return bool(model.speedup(batch, gamma, alpha, snapshot_every, log_inputs) > 1.0)

    if not pays(1.0):
        return None
    low, high = 0.0, 1.0  # pays(high), and low = 0 never pays: a round then yields one token for more work
    while high - low > tolerance:
        mid = 0.5 * (low + high)
        low, high = (low, mid) if pays(mid) else (mid, high)
    return high
