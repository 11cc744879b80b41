"""Text rendering of a `build_report` dict. Each section says whether its
figures are assumed or measured; measured tables tag every column."""
from __future__ import annotations

from hybridspec.sim.report import POLICIES, REPORT_BATCHES

_TAG = {"measured": "(m)", "assumed": "(a)"}


def _format_crossover(batch: object, max_batch: int, fits: int) -> str:
    """'>max_batch' when no crossover was found; '*' when it lies beyond the batch that fits."""
    if batch is None:
        return f">{max_batch}*" if max_batch > fits else f">{max_batch}"
    return f"{batch}*" if batch > fits else str(batch)


def _or_unknown(value: object) -> str:
    return "?" if value is None else str(value)


def _cell(row: dict, key: str, fmt: str) -> str:
    """A labelled figure of a measured row: value and (m)/(a) tag."""
    return f"{row[key]['value']:{fmt}} {_TAG[row[key]['source']]}"


def render_assumptions(report: dict) -> list[str]:
    return ["Assumptions (every figure below not tagged (m) rests on these)"] + [
        f"  assumed: {line}" for line in report["assumptions"]
    ]


def render_table(report: dict) -> list[str]:
    c = report["settings"]["c"]
    lines = [
        f"Expected tokens per round and speedup at c = {c:g} (all figures assumed; alpha is a grid value)",
        f"  {'alpha':>5} {'gamma':>5} {'E[tok] closed':>13} {'E[tok] simulated':>21} "
        f"{'speedup memory-bound':>20} {'speedup compute-bound':>21}",
    ]
    for row in report["table"]:
        simulated = f"{row['simulated_tokens']:.4f} +- {row['simulated_stderr']:.4f}"
        lines.append(
            f"  {row['alpha']:>5.2f} {row['gamma']:>5d} {row['expected_tokens']:>13.4f} {simulated:>21} "
            f"{row['speedup_memory_bound']:>19.2f}x {row['speedup_compute_bound']:>20.2f}x"
        )
    best = ", ".join(
        f"alpha={row['alpha']:g}: {row['memory_bound']}/{row['compute_bound']}" for row in report["optimal_gamma"]
    )
    max_gamma = report["optimal_gamma"][0]["max_gamma"]
    lines.append(f"  optimal gamma in 1..{max_gamma} (memory-bound/compute-bound, assumed): {best}")
    return lines


def _draft_line(preset: dict) -> str:
    draft, drafter = preset["draft"], preset["drafter"]
    c = ", ".join(f"{value:.3f} at batch {batch}" for batch, value in preset["c_at_batch"].items())
    sharded = ", tensor-parallel like the target" if drafter["sharded"] else ""
    return f"  drafter {drafter['kind']}: {draft['name']}, {draft['params'] / 1e9:.2f}B{sharded}; c = {c}"


def _policy_rows(preset: dict, key: str, value: str, fmt) -> list[str]:
    """One row per reported batch of `preset[key]` entries, one column per policy."""
    labels = [label for label, _, _ in POLICIES]
    rows = []
    for batch in REPORT_BATCHES:
        cells = {entry["policy"]: entry[value] for entry in preset[key] if entry["batch"] == batch}
        title = f"batch {batch}"
        rows.append(f"  {title:>9} " + " ".join(f"{fmt(cells[label]):>10}" for label in labels))
    return rows


def render_presets(report: dict) -> list[str]:
    settings = report["settings"]
    max_batch = settings["max_batch"]
    labels = [label for label, _, _ in POLICIES]
    header = " ".join(f"{label:>10}" for label in labels)
    lines = [
        f"Crossover batch: smallest batch where speedup <= 1 (gamma = {settings['crossover_gamma']}, "
        f"context {settings['context_len']} tokens; all figures assumed)",
        "  policies: k=1 snapshot every input; k=2+log every 2nd + log replay; "
        "k=0+log round start and final + log replay; k=0 token: same, token replay",
    ]
    for preset in report["presets"]:
        target = preset["target"]
        cost = target["cost"]
        lines += [
            "",
            f"  {preset['name']} on {preset['hardware']['name']}: target {target['name']}, {target['layers']} layers "
            f"({target['mamba_layers']} {target['recurrent_kind']} + {target['attention_layers']} attention), "
            f"{target['params'] / 1e9:.2f}B params; state {cost['state_bytes'] / 2**20:.1f} MiB/seq, "
            f"input log {cost['log_bytes_per_token'] / 1024:.0f} KiB/verify input, "
            f"KV {cost['kv_bytes_per_token'] / 1024:.0f} KiB/token",
            _draft_line(preset),
            f"  {'alpha':>9} " + header,
        ]
        by_alpha: dict[float, dict[str, object]] = {}
        for entry in preset["crossover"]:
            by_alpha.setdefault(entry["alpha"], {})[entry["policy"]] = entry["batch"]
        fits = preset["fits"]
        for alpha, batches in by_alpha.items():
            cells = " ".join(f"{_format_crossover(batches[label], max_batch, fits[label]):>10}" for label in labels)
            lines.append(f"  {alpha:>9.2f} {cells}")
        lines.append(f"  {'fits':>9} " + " ".join(f"{fits[label]:>10}" for label in labels))
        lines.append("  pays from alpha (speedup > 1)")
        lines += _policy_rows(preset, "break_even_alpha", "alpha", lambda a: "never" if a is None else f"{a:.3f}")
        prior = preset["drafter"]["prior"]
        if prior is not None:
            lines.append(f"  speedup at the drafter's prior alpha = {prior['alpha']:.3f} ({prior['source']})")
            lines += _policy_rows(preset, "at_prior", "speedup", lambda s: f"{s:.2f}x")
    lines += [
        "",
        "  1 = no gain even at batch 1; * = beyond the batch that fits in HBM "
        "(speculation pays at every batch that fits); never = no gain even at alpha = 1",
    ]
    return lines


def render_measured(measured: dict) -> list[str]:
    alpha, tokens = measured["alpha"], measured["tokens_per_round"]
    lines = [
        f"Measured round costs from {measured['file']} (machine: {measured['machine']}; "
        f"model: {measured['model'] or '?'}; draft: {measured['draft'] or '?'})   (m) measured, (a) assumed",
        f"  alpha {alpha['value']:.4f} (m) [{alpha['note']}], gamma {measured['gamma']}, "
        f"tokens per round {tokens['value']:.4f} (m) [{tokens['note']}], "
        f"policy snapshot_every={_or_unknown(measured['snapshot_every'])} "
        f"log_inputs={_or_unknown(measured['log_inputs'])}",
        f"  {'batch':>6} {'target step ms':>18} {'c':>10} {'verify cost':>14} {'replay cost':>14} {'speedup':>12}",
    ]
    for row in measured["rows"]:
        step_ms = f"{row['target_step_s']['value'] * 1e3:.3f} {_TAG[row['target_step_s']['source']]}"
        lines.append(
            f"  {row['batch']:>6} {step_ms:>18} {_cell(row, 'c', '.3f'):>10} {_cell(row, 'verify_cost', '.3f'):>14} "
            f"{_cell(row, 'replay_cost', '.3f'):>14} {_cell(row, 'speedup', '.2f'):>12}"
        )
    lines += render_terms(measured["rows"])
    crossover = measured["crossover"]
    value = "-" if crossover["batch"] is None else str(crossover["batch"])
    lines.append(f"  crossover batch {value} {_TAG[crossover['source']]}: {crossover['note']}")
    return lines


def render_terms(rows: list[dict]) -> list[str]:
    """One line per term of the plain step and of the round (ms, whole batch),
    one column per measured batch: the sums the speedup divides."""
    header = "  " + f"{'term (ms per step or round)':<30}" + "".join(f"{'batch ' + str(r['batch']):>16}" for r in rows)
    lines = ["  the terms of a plain step and of a round (hs.sim.RoundTerms; speedup = "
             "tokens per round x plain total / round total)", header]
    for name in rows[0]["terms"]:
        cells = "".join(f"{r['terms'][name]['value'] * 1e3:>12.4f} {_TAG[r['terms'][name]['source']]}" for r in rows)
        lines.append(f"  {name:<30}{cells}")
        if name.startswith("plain") and name.endswith("host_s") or name == "round host_s":
            kind = name.split()[0]
            total = "".join(f"{sum(v['value'] for k, v in r['terms'].items() if k.startswith(kind)) * 1e3:>16.4f}"
                            for r in rows)
            lines.append(f"  {kind + ' total':<30}{total}")
    return lines


def render_tree(tree: dict) -> list[str]:
    """Chain against tree at equal verify inputs: tokens per round, then speedups per preset."""
    widths = ",".join(map(str, tree["widths"]))
    lines = [f"Tree {widths} ({tree['nodes']} nodes, spine {tree['spine']}) against the chain of gamma = "
             f"{tree['nodes']} (equal verify inputs; rescue {tree['rescue']:g}; all figures assumed)",
             f"  {'alpha':>5} {'chain tok/round':>15} {'tree tok/round':>14} {'tree simulated':>21} {'ratio':>6}"]
    for row in tree["tokens"]:
        simulated = f"{row['simulated_tokens']:.4f} +- {row['simulated_stderr']:.4f}"
        lines.append(f"  {row['alpha']:>5.2f} {row['chain_tokens']:>15.4f} {row['tree_tokens']:>14.4f} "
                     f"{simulated:>21} {row['tree_tokens'] / row['chain_tokens']:>6.3f}")
    alphas = sorted({row["alpha"] for row in tree["tokens"]})
    lines.append("  speedup over plain decoding, chain / tree, both keeping every input's state")
    lines.append(f"  {'preset':<28} {'batch':>5} " + " ".join(f"{'alpha ' + format(a, 'g'):>15}" for a in alphas))
    for preset in tree["presets"]:
        for batch in REPORT_BATCHES:
            cells = {r["alpha"]: r for r in preset["rows"] if r["batch"] == batch}
            lines.append(f"  {preset['name']:<28} {batch:>5} " + " ".join(
                f"{cells[a]['chain_speedup']:>7.2f}/{cells[a]['tree_speedup']:<7.2f}" for a in alphas))
    return lines


def render_report(report: dict) -> str:
    lines = ["hybridspec simulate: speculative decoding economics", ""]
    lines += render_assumptions(report) + [""] + render_table(report) + [""] + render_presets(report)
    if report["measured"] is not None:
        lines += [""] + render_measured(report["measured"])
    if report.get("tree") is not None:
        lines += [""] + render_tree(report["tree"])
    return "\n".join(lines) + "\n"
