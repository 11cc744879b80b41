"""`hs.sim`: does speculative decoding pay on this model, batch and hardware?

Closed forms under i.i.d. acceptance (`expected_tokens`, `speedup`,
`optimal_gamma`), a Monte Carlo that confirms them (`simulate`), the cost of
checkpoint policies on hybrid models (`expected_replay_steps`, ...), a roofline
`CostModel` with presets (each with a separate draft model, an MTP layer or an
EAGLE-3 head: `drafted`), the measured terms of a whole round
(`RoundTerms`, `round_seconds`: the one formula adaptive γ uses too) and `crossover_batch`, the batch where the gain
turns into a loss. Derivations: docs/simulator.md.
"""
from hybridspec.costs.checkpoint_terms import (
    expected_replay_steps,
    replay_probability,
    replay_steps,
    snapshot_positions,
    snapshot_writes_per_round,
)
from hybridspec.costs.closed_form import (
    accepted_distribution,
    alpha_from_acceptance_rate,
    expected_accepted,
    expected_tokens,
    optimal_gamma,
    speedup,
)
from hybridspec.costs.round_time import RoundTime, StepCosts, round_time
from hybridspec.sim.cost_model import AllReduceLink, CostModel, Hardware, ModelCost, break_even_alpha, crossover_batch
from hybridspec.sim.drafters import DRAFTER_KINDS, AcceptancePrior, eagle3_draft, mtp_draft
from hybridspec.sim.mixers import GdnMixer, Mamba2Mixer
from hybridspec.sim.measured import MeasuredRun, load_measured, measured_crossover, measured_rows, parse_measured
from hybridspec.sim.montecarlo import SimResult, simulate, simulate_replay_steps, simulate_with_stderr
from hybridspec.costs.round_terms import (TERMS, RoundTerms, generation_speedup, mixed_terms, round_seconds,
                                        round_speedup)
from hybridspec.sim.presets import BAMBA_9B, H200, NEMOTRON_H_8B, PRESETS, Preset, drafted, small_hybrid_draft
from hybridspec.sim.shapes import HybridShape

__all__ = [
    "BAMBA_9B",
    "DRAFTER_KINDS",
    "H200",
    "NEMOTRON_H_8B",
    "PRESETS",
    "AcceptancePrior",
    "AllReduceLink",
    "CostModel",
    "GdnMixer",
    "Hardware",
    "HybridShape",
    "Mamba2Mixer",
    "MeasuredRun",
    "ModelCost",
    "Preset",
    "RoundTerms",
    "RoundTime",
    "SimResult",
    "TERMS",
    "StepCosts",
    "accepted_distribution",
    "alpha_from_acceptance_rate",
    "break_even_alpha",
    "crossover_batch",
    "drafted",
    "eagle3_draft",
    "expected_accepted",
    "expected_replay_steps",
    "expected_tokens",
    "generation_speedup",
    "load_measured",
    "measured_crossover",
    "measured_rows",
    "mixed_terms",
    "mtp_draft",
    "optimal_gamma",
    "parse_measured",
    "replay_probability",
    "replay_steps",
    "round_seconds",
    "round_speedup",
    "round_time",
    "simulate",
    "simulate_replay_steps",
    "simulate_with_stderr",
    "small_hybrid_draft",
    "snapshot_positions",
    "snapshot_writes_per_round",
    "speedup",
]
