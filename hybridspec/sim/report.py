"""Everything `hybridspec simulate` reports, as one JSON-ready dict.
`hybridspec.sim.render` turns it into text; every figure carries its source."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from hybridspec.errors import ConfigError
from hybridspec.costs.closed_form import expected_tokens, optimal_gamma, speedup
from hybridspec.sim.cost_model import CostModel, break_even_alpha, crossover_batch
from hybridspec.sim.drafters import check_drafter_kind
from hybridspec.sim.measured import ASSUMED, MeasuredRun, measured_crossover, measured_rows
from hybridspec.sim.montecarlo import simulate_tree, simulate_with_stderr
from hybridspec.costs.tree_form import DEFAULT_RESCUE, tree_expected_tokens
from hybridspec.sim.presets import PRESETS, Preset, drafted
from hybridspec.sim.shapes import HybridShape
from hybridspec.costs.validation import check_alpha, check_cost, check_gamma, check_int

REPORT_SCHEMA = "hybridspec.simulate/v1"

# (label, snapshot_every, log_inputs): the checkpoint policies compared per preset
POLICIES = (("k=1", 1, False), ("k=2+log", 2, True), ("k=0+log", 0, True), ("k=0 token", 0, False))
# the batches at which each preset reports c, the α where speculation starts to pay, and the speedup at its prior
REPORT_BATCHES = (1, 8, 32)


@dataclass(frozen=True)
class SimulateSettings:
    """What `hybridspec simulate` evaluates; validated on construction."""

    alphas: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.9)
    gammas: tuple[int, ...] = tuple(range(1, 9))
    c: float = 0.05
    rounds: int = 100_000
    seed: int = 0
    context_len: int = 4096
    crossover_gamma: int = 4
    max_batch: int = 4096
    drafters: tuple[str, ...] = ("model",)
    tree: Optional[tuple[int, ...]] = None  # candidates per spine depth of a tree draft to compare with chains
    rescue: float = DEFAULT_RESCUE  # β of `costs.tree_form`: an alternative's catch rate after a miss

    def __post_init__(self) -> None:
        if not self.alphas or not self.gammas:
            raise ConfigError("alphas and gammas must each hold at least one value, e.g. --alphas 0.7,0.8")
        for alpha in self.alphas:
            check_alpha(alpha)
        for gamma in self.gammas:
            check_gamma(gamma)
        check_cost(self.c, "c")
        check_int(self.rounds, "rounds", minimum=2)
        check_int(self.seed, "seed", minimum=0)
        check_int(self.context_len, "context_len", minimum=0)
        check_gamma(self.crossover_gamma)
        check_int(self.max_batch, "max_batch", minimum=1)
        if not self.drafters or len(set(self.drafters)) != len(self.drafters):
            raise ConfigError(f"drafters={self.drafters}: name each drafter once, e.g. --drafter model,mtp,eagle3")
        for kind in self.drafters:
            check_drafter_kind(kind)
        if self.tree is not None and (not self.tree or any(isinstance(w, bool) or not isinstance(w, int) or w < 1
                                                           for w in self.tree)):
            raise ConfigError(f"tree={self.tree!r}: give one width >= 1 per spine depth, e.g. --tree 2,2,1")
        check_alpha(self.rescue, name="rescue")


def selected_presets(settings: SimulateSettings) -> list[Preset]:
    """Every preset with each drafter of `settings.drafters`, a preset's drafters side by side."""
    return [drafted(preset, kind) for preset in PRESETS.values() for kind in settings.drafters]


def assumptions(settings: SimulateSettings) -> list[str]:
    """One line per assumption behind the assumed figures."""
    lines = [
        "acceptance is i.i.d. per draft with probability alpha: accepted drafts follow a geometric law capped at gamma",
        f"one draft step costs c = {settings.c:g} plain target steps in the alpha x gamma table",
        "memory-bound regime: verifying gamma+1 tokens costs 1 plain step; compute-bound: it costs gamma+1",
        f"simulated = Monte Carlo mean of {settings.rounds} rounds (seed {settings.seed}) +- one standard error",
        "roofline at peak rates: step = max(bytes / bandwidth, FLOPs / peak); activations, launches and sampling ignored",
        "checkpoint traffic (extra snapshots, input log, replay) is charged as memory time on top of the forward",
        "the drafter's rollback is free: it keeps one state slot per draft step",
        f"{settings.context_len} tokens already cached per sequence; crossover and fit at gamma = {settings.crossover_gamma}",
        "fits = sequences whose KV, states, snapshot slots and log fit in HBM beside both models' weights",
    ]
    if settings.tree is not None:
        lines.append(f"tree drafts: past a missed spine token each next-ranked alternative is the target's with "
                     f"probability rescue = {settings.rescue:g}; a tree verify is priced by its nodes")
    presets = selected_presets(settings)
    sources = {preset.hardware.source for preset in presets}
    sources |= {shape.source for preset in presets for shape in (preset.target, preset.draft)}
    sources |= {preset.prior.source for preset in presets if preset.prior is not None}
    return lines + sorted(source.removeprefix("assumed: ") for source in sources)


def gain_table(settings: SimulateSettings) -> list[dict]:
    """α × γ rows: expected tokens (closed form, simulated) and speedup in both regimes."""
    rows = []
    for index, (alpha, gamma) in enumerate((a, g) for a in settings.alphas for g in settings.gammas):
        simulated = simulate_with_stderr(alpha, gamma, settings.rounds, seed=settings.seed + index)
        rows.append({
            "alpha": alpha,
            "gamma": gamma,
            "expected_tokens": expected_tokens(alpha, gamma),
            "simulated_tokens": simulated.mean,
            "simulated_stderr": simulated.stderr,
            "speedup_memory_bound": speedup(alpha, gamma, settings.c, verify_cost=1.0),
            "speedup_compute_bound": speedup(alpha, gamma, settings.c, verify_cost=gamma + 1.0),
            "source": ASSUMED,
        })
    return rows


def optimal_gammas(settings: SimulateSettings, max_gamma: int = 16) -> list[dict]:
    return [
        {
            "alpha": alpha,
            "memory_bound": optimal_gamma(alpha, settings.c, 1.0, max_gamma),
            "compute_bound": optimal_gamma(alpha, settings.c, lambda gamma: gamma + 1.0, max_gamma),
            "max_gamma": max_gamma,
            "source": ASSUMED,
        }
        for alpha in settings.alphas
    ]


def _shape_summary(shape: HybridShape) -> dict:
    cost = shape.model_cost()
    return {
        "name": shape.name,
        "layers": shape.num_layers,
        "mamba_layers": shape.num_mamba_layers,  # the recurrent layers, of `recurrent_kind`
        "recurrent_kind": shape.recurrent.kind,
        "attention_layers": shape.num_attention_layers,
        "params": shape.total_params(),
        "cost": asdict(cost),
    }


def _drafter_summary(preset: Preset, model: CostModel) -> dict:
    prior = preset.prior
    return {
        "kind": preset.drafter,
        "prior": None if prior is None else {"alpha": prior.alpha, "source": prior.source},
        "sharded": model.draft_sharded and model.all_reduce is not None,  # tensor-parallel like the target
    }


def _at_prior(preset: Preset, model: CostModel, gamma: int) -> Optional[list[dict]]:
    """Speedup at the drafter's prior α, per reported batch and policy (None without a prior)."""
    if preset.prior is None:
        return None
    return [
        {"batch": batch, "policy": label,
         "speedup": float(model.speedup(batch, gamma, preset.prior.alpha, k, log))}
        for batch in REPORT_BATCHES for label, k, log in POLICIES
    ]


def preset_summary(preset: Preset, settings: SimulateSettings) -> dict:
    """Shapes, the drafter and its c, the batch that fits, the crossover batch
    for each α and checkpoint policy, the α from which speculation pays and the
    speedup at the drafter's prior α."""
    model = preset.cost_model(settings.context_len)
    gamma = settings.crossover_gamma
    c_at = {}
    for batch in REPORT_BATCHES:
        costs = model.step_costs(batch, gamma)
        c_at[str(batch)] = float(costs.draft_step_s / costs.plain_step_s)
    return {
        "name": preset.name,
        "hardware": asdict(preset.hardware),
        "target": _shape_summary(preset.target),
        "draft": _shape_summary(preset.draft),
        "drafter": _drafter_summary(preset, model),
        "gamma": gamma,
        "c_at_batch_1": c_at["1"],
        "c_at_batch": c_at,
        "fits": {label: model.max_batch(gamma, k, log) for label, k, log in POLICIES},
        "crossover": [
            {
                "alpha": alpha,
                "policy": label,
                "snapshot_every": k,
                "log_inputs": log,
                "batch": crossover_batch(model, alpha, gamma, k, log, settings.max_batch),
            }
            for alpha in settings.alphas
            for label, k, log in POLICIES
        ],
        "break_even_alpha": [
            {"batch": batch, "policy": label, "alpha": break_even_alpha(model, batch, gamma, k, log)}
            for batch in REPORT_BATCHES for label, k, log in POLICIES
        ],
        "at_prior": _at_prior(preset, model, gamma),
        "source": ASSUMED,
    }


def measured_summary(run: MeasuredRun, path: str) -> dict:
    rows = measured_rows(run)
    return {
        "file": path,
        "machine": run.machine,
        "model": run.model,
        "draft": run.draft,
        "gamma": run.gamma,
        "alpha": {"value": run.alpha, "source": "measured", "note": run.alpha_note},
        "tokens_per_round": {"value": run.tokens_per_round, "source": "measured", "note": run.tokens_note},
        "snapshot_every": run.snapshot_every,
        "log_inputs": run.log_inputs,
        "rows": rows,
        "crossover": measured_crossover(rows),
    }


def tree_summary(settings: SimulateSettings) -> Optional[dict]:
    """The tree of `settings.tree` against the chain of as many verify inputs (γ = its nodes):
    tokens per round per α (closed form and simulated), and each preset's speedup per
    reported batch, both kept every input's state (snapshot every input, no replay)."""
    if settings.tree is None:
        return None
    widths, nodes = settings.tree, sum(settings.tree)
    tokens = []
    for index, alpha in enumerate(settings.alphas):
        simulated = simulate_tree(alpha, widths, settings.rescue, settings.rounds, seed=settings.seed + index)
        tokens.append({"alpha": alpha, "chain_tokens": expected_tokens(alpha, nodes),
                       "tree_tokens": tree_expected_tokens(alpha, widths, settings.rescue),
                       "simulated_tokens": simulated.mean, "simulated_stderr": simulated.stderr})
    presets = []
    for preset in selected_presets(settings):
        model = preset.cost_model(settings.context_len)
        presets.append({"name": preset.name, "rows": [
            {"batch": batch, "alpha": alpha, "chain_speedup": float(model.speedup(batch, nodes, alpha, 1, False)),
             "tree_speedup": float(model.tree_speedup(batch, widths, alpha, settings.rescue))}
            for batch in REPORT_BATCHES for alpha in settings.alphas]})
    return {"widths": list(widths), "nodes": nodes, "spine": len(widths), "rescue": settings.rescue,
            "tokens": tokens, "presets": presets, "source": ASSUMED}


def build_report(settings: SimulateSettings, measured: Optional[tuple[MeasuredRun, str]] = None) -> dict:
    """The whole report; `measured` is a loaded run and the path it came from."""
    return {
        "schema": REPORT_SCHEMA,
        "settings": asdict(settings),
        "assumptions": assumptions(settings),
        "table": gain_table(settings),
        "optimal_gamma": optimal_gammas(settings),
        "presets": [preset_summary(preset, settings) for preset in selected_presets(settings)],
        "measured": None if measured is None else measured_summary(*measured),
        "tree": tree_summary(settings),
    }
