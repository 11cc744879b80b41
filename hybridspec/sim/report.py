"""Everything `hybridspec simulate` reports, as one JSON-ready dict.
`hybridspec.sim.render` turns it into text; every figure carries its source."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from hybridspec.errors import ConfigError
from hybridspec.costs.closed_form import expected_tokens, optimal_gamma, speedup
from hybridspec.sim.cost_model import crossover_batch
from hybridspec.sim.measured import ASSUMED, MeasuredRun, measured_crossover, measured_rows
from hybridspec.sim.montecarlo import simulate_with_stderr
from hybridspec.sim.presets import PRESETS, Preset
from hybridspec.sim.shapes import HybridShape
from hybridspec.costs.validation import check_alpha, check_cost, check_gamma, check_int

REPORT_SCHEMA = "hybridspec.simulate/v1"

# (label, snapshot_every, log_inputs): the checkpoint policies compared per preset
POLICIES = (("k=1", 1, False), ("k=2+log", 2, True), ("k=0+log", 0, True), ("k=0 token", 0, False))


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
    sources = {preset.hardware.source for preset in PRESETS.values()}
    sources |= {shape.source for preset in PRESETS.values() for shape in (preset.target, preset.draft)}
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


def preset_summary(preset: Preset, settings: SimulateSettings) -> dict:
    """Shapes, c at batch 1, the batch that fits and the crossover batch for
    each α and checkpoint policy."""
    model = preset.cost_model(settings.context_len)
    gamma = settings.crossover_gamma
    batch_1 = model.step_costs(1, gamma)
    return {
        "name": preset.name,
        "hardware": asdict(preset.hardware),
        "target": _shape_summary(preset.target),
        "draft": _shape_summary(preset.draft),
        "gamma": gamma,
        "c_at_batch_1": float(batch_1.draft_step_s / batch_1.plain_step_s),
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


def build_report(settings: SimulateSettings, measured: Optional[tuple[MeasuredRun, str]] = None) -> dict:
    """The whole report; `measured` is a loaded run and the path it came from."""
    return {
        "schema": REPORT_SCHEMA,
        "settings": asdict(settings),
        "assumptions": assumptions(settings),
        "table": gain_table(settings),
        "optimal_gamma": optimal_gammas(settings),
        "presets": [preset_summary(preset, settings) for preset in PRESETS.values()],
        "measured": None if measured is None else measured_summary(*measured),
    }
