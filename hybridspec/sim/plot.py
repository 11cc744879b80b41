"""`hybridspec simulate --plot out.png`: speedup against batch size per preset,
one row of panels per drafter, one colour per α, crossovers marked; the
legend names each curve's drafter. matplotlib is imported only here, lazily."""
from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

from hybridspec.sim.presets import PRESETS
from hybridspec.sim.report import SimulateSettings, selected_presets

# (label, snapshot_every, log_inputs, line style) of the curves drawn per α
_CURVES = (("k=1", 1, False, "-"), ("k=0+log", 0, True, "--"))


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'hybridspec[plot]')"
        ) from error
    return Figure


def _draw_preset(axes, preset, settings: SimulateSettings, colors) -> None:
    model = preset.cost_model(settings.context_len)
    gamma = settings.crossover_gamma
    batches = np.unique(np.geomspace(1, settings.max_batch, 240).astype(np.int64))  # [num_points]
    for alpha, color in zip(settings.alphas, colors):
        for label, k, log, style in _CURVES:
            gains = model.speedup(batches, gamma, alpha, k, log)  # [num_points]
            axes.plot(batches, gains, style, color=color, label=f"{preset.drafter} alpha={alpha:g} {label}")
            losing = np.flatnonzero(gains <= 1.0)
            if losing.size:
                axes.plot(batches[losing[0]], gains[losing[0]], "o", color=color, markersize=5)
    fits = model.max_batch(gamma, 1, False)
    axes.axvline(fits, color="0.5", linestyle=":")
    axes.text(fits, 0.98, f" k=1 fits {fits} seqs", transform=axes.get_xaxis_transform(),
              va="top", fontsize=7, color="0.4")
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xscale("log")
    axes.set_xlabel("batch size (sequences)")
    axes.set_ylabel("speedup over plain decoding")
    costs = model.step_costs(1, gamma)
    c = float(costs.draft_step_s / costs.plain_step_s)
    axes.set_title(f"{preset.name} on {preset.hardware.name}\ndrafter {preset.drafter}, c={c:.3f} at batch 1, "
                   f"gamma={gamma} (assumed)", fontsize=9)
    axes.grid(True, which="both", alpha=0.3)


def _draw_measured(axes, measured: dict) -> None:
    batches = [row["batch"] for row in measured["rows"]]
    gains = [row["speedup"]["value"] for row in measured["rows"]]
    axes.plot(batches, gains, "o-", color="black", label=f"alpha={measured['alpha']['value']:.3f}")
    crossover = measured["crossover"]
    if crossover["batch"] is not None:
        axes.axvline(crossover["batch"], color="red", linestyle=":", label=f"crossover ~{crossover['batch']}")
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xscale("log")
    axes.set_xlabel("batch size (sequences)")
    machine = textwrap.shorten(measured["machine"], width=40, placeholder="...")
    axes.set_title(f"measured on {machine}, gamma={measured['gamma']}", fontsize=9)
    axes.grid(True, which="both", alpha=0.3)


def plot_speedup(report: dict, settings: SimulateSettings, path: str | Path) -> Path:
    """Draw speedup against batch size (solid: k=1, dashed: k=0 with log
    replay; dots: crossovers) for each preset, a row per drafter, plus the
    measured points when the report has them, and save a PNG at `path`."""
    figure_class = _figure_class()
    rows, columns = len(settings.drafters), len(PRESETS) + (report["measured"] is not None)
    figure = figure_class(figsize=(5.5 * columns, 4.5 * rows), layout="constrained")
    axes_grid = figure.subplots(rows, columns, squeeze=False)  # [drafter, preset]
    colors = [f"C{index}" for index in range(len(settings.alphas))]
    presets = selected_presets(settings)  # each preset's drafters side by side
    for index, preset in enumerate(presets):
        _draw_preset(axes_grid[index % rows][index // rows], preset, settings, colors)
    handles, labels = [], []
    for row in axes_grid:  # one legend entry per drafter, alpha and policy
        row_handles, row_labels = row[0].get_legend_handles_labels()
        handles, labels = handles + row_handles, labels + row_labels
    figure.legend(handles, labels, loc="outside right upper", fontsize=7)
    if report["measured"] is not None:
        _draw_measured(axes_grid[0][-1], report["measured"])
        axes_grid[0][-1].legend(fontsize=7)
        for row in axes_grid[1:]:
            row[-1].set_axis_off()
    path = Path(path)
    figure.savefig(path, dpi=120)
    return path
