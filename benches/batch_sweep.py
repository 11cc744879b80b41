"""Tokens/s of plain, fixed-γ and adaptive-γ decoding at batch 1 … 64, and the predicted speedup.

The variants run side by side; the prediction is the simulator's, from this
engine's measured costs. Workloads (greedy, so every variant emits the same tokens, which is checked):
- the embedded pair (byte-level target and its small draft), prompts cut from
  held-out standard-library files;
- a larger random Bamba pair with controlled acceptance (benches/e2e.py's
  construction): the draft is the target's first layers; the target's later
  layers have their output projections scaled by λ (small λ: high
  acceptance, larger: medium and low).

Per workload and concurrency B, `--requests-per-slot` × B requests (2 by
default) go through one `generate` call of an Engine with max_batch_size = B
(continuous batching). The four variants alternate call by call (one warm-up,
median of `--repeats`); tokens/s counts new tokens over wall seconds, or this
process's CPU seconds with `--clock cpu` (steadier on a shared machine);
prefill is included, the same for every variant. Each variant keeps one
Engine for the warm-up and the repeats, so the adaptive one has learned from
the warm-up call when it is timed. The predicted speedup at B is
`hs.sim.generation_speedup` at the better of the fixed γ the sweep runs:
per wave of B requests the target's prefill (timed here) in both, the
drafter's absorption of the prompts (start-up `absorb_s`) in the
speculative one, then the rounds, every term of the plain step and of the
round (forward, draft, sampling, commit, host) from the adaptive engine's
start-up measurement (`hybridspec.engine.startup_costs`, repeated on the bench's
clock at B), α from the fixed-γ = 4 run's acceptance
rate at B (`alpha_from_acceptance_rate`); the measured speedup it is set
against is the best fixed γ's over plain. The predicted and measured
crossovers are where each falls to 1 (`hs.sim.measured_crossover`).

Targets: adaptive ≥ 0.97 × plain at every point, and ≥ 0.95 × the
best fixed γ.

    python benches/batch_sweep.py            # the measurement (tens of minutes)
    python benches/batch_sweep.py --quick    # a smoke run
"""
from __future__ import annotations

import sys
import time

import torch

from common import (bench_parser, describe_machine, print_table, save_png, set_clock, set_threads, side_by_side,
                    write_json)
from e2e import RANDOM_PAIR_QUICK, heldout_prompts, layer_skip_draft, scale_later_layers_
from plain_decode import build_bamba

RANDOM_PAIR = dict(hidden_size=256, num_hidden_layers=8, attn_layer_indices=[1, 5], intermediate_size=768,
                   num_attention_heads=8, num_key_value_heads=4, mamba_n_heads=8, mamba_d_head=64,
                   mamba_d_state=32, vocab_size=4096)
VARIANTS = ("plain", "gamma=2", "gamma=4", "auto")


def workloads(args) -> list[tuple[str, object, object, list[list[int]]]]:
    """(name, target, draft, prompt pool) per workload."""
    import hybridspec as hs
    from hybridspec.adapters.embedded import embedded_paths
    most = max(args.batches) * args.requests_per_slot
    target_dir, draft_dir = embedded_paths()
    text_prompts = heldout_prompts(min(most, 24), args.prompt_len)
    pool = [text_prompts[i % len(text_prompts)][i // len(text_prompts):] for i in range(most)]  # distinct cuts
    out = [("embedded", hs.load(target_dir), hs.load(draft_dir), pool)]
    shape = RANDOM_PAIR_QUICK if args.quick else RANDOM_PAIR
    g = torch.Generator().manual_seed(2)
    random_prompts = torch.randint(1, shape["vocab_size"], (most, args.prompt_len), generator=g).tolist()
    levels = ("high", "medium", "low") if len(args.scales) == 3 else ("",) * len(args.scales)
    for scale, level in zip(args.scales, levels):
        hf = build_bamba(shape, seed=3)
        draft = layer_skip_draft(hf, args.draft_layers)
        scale_later_layers_(hf, args.draft_layers, scale)
        target = hs.from_hf(hf).pack_for_cpu()  # input-major, as hs.load gives on CPU
        label = f"{level} (lambda={scale:g})" if level else f"lambda={scale:g}"
        out.append((f"random {target.num_parameters() / 1e6:.3g}M, {label}", target,
                    hs.from_hf(draft).pack_for_cpu(), random_prompts))
    return out


def predicted(costs, batch: int, alpha: float, num_tokens: int, prefill_s: float,
              prompt_len: int) -> tuple[float, int]:
    """(best predicted speedup of the timed generate calls over plain, its γ) at
    `batch` from the measured terms: each wave of `batch` requests pays the
    prefill (`prefill_s`, both) and the drafter's absorption of its prompts
    (speculative), then its rounds (`hs.sim.generation_speedup`)."""
    from hybridspec.sim import expected_tokens, generation_speedup
    plain = costs.terms(batch, 0)
    absorb_s = (costs.absorb(batch) or 0.0) * batch * prompt_len
    options = [(generation_speedup(num_tokens, expected_tokens(alpha, g), plain, costs.terms(batch, g), prefill_s,
                                   absorb_s), g)
               for g in (2, 4) if g + 1 <= costs.tokens[-1]]  # the fixed γ the sweep runs
    return max(options)


def terms_on_bench_clock(target, draft, engine):
    """The adaptive engine's start-up measurement (`hybridspec.engine.startup_costs`)
    repeated at its largest batch on the clock the bench times with (`--clock`)."""
    import functools
    import common
    from hybridspec.cache.hybrid_cache import scratch_cache
    from hybridspec.engine.engine import scratch_request
    from hybridspec.engine.startup_costs import measure_round_costs
    gamma_max, batch = engine.speculator.gamma, engine.max_batch_size
    new_cache = functools.partial(scratch_cache, target)
    return measure_round_costs(target, draft, engine.speculator.policy, gamma_max, [batch], new_cache,
                               scratch_request, clock=common.clock)


def prefill_seconds(model, prompts: list[list[int]], repeats: int = 2) -> float:
    """Seconds (the bench's clock) of the target's prefill of one wave of prompts, fastest of `repeats`."""
    import common
    from hybridspec.cache.hybrid_cache import scratch_cache
    best = float("inf")
    for _ in range(repeats + 1):
        cache = scratch_cache(model, len(prompts), 2, max_len=max(map(len, prompts)) + 1)
        began = common.clock()
        model.prefill(cache, list(range(len(prompts))), prompts, last_only=True)
        best = min(best, common.clock() - began)
    return best


def measure(name, target, draft, pool, batch: int, args) -> dict:
    import hybridspec as hs
    from hybridspec.sim import alpha_from_acceptance_rate
    prompts = pool[:batch * args.requests_per_slot]
    params = hs.SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    sizes = dict(max_batch_size=batch, max_model_len=args.prompt_len + args.new_tokens + 16)
    engines = {"plain": hs.Engine(target, **sizes),
               "gamma=2": hs.Engine(target, draft=draft, num_draft_tokens=2, **sizes),
               "gamma=4": hs.Engine(target, draft=draft, num_draft_tokens=4, **sizes),
               "auto": hs.Engine(target, draft=draft, num_draft_tokens="auto", **sizes)}
    outputs = {}

    def run(variant):
        def fn():
            outputs[variant] = [o.token_ids for o in engines[variant].generate(prompts, params)]
        return fn
    seconds = side_by_side({v: run(v) for v in VARIANTS}, repeats=args.repeats)
    same = all(outputs[v] == outputs["plain"] for v in VARIANTS)
    tokens = sum(map(len, outputs["plain"]))
    rate = {v: tokens / seconds[v] for v in VARIANTS}
    fixed4 = engines["gamma=4"].stats.acceptance_rate
    costs = terms_on_bench_clock(target, draft, engines["auto"])
    alpha = alpha_from_acceptance_rate(fixed4, 4) if fixed4 > 0 else 0.0
    pred, pred_gamma = predicted(costs, batch, alpha, args.new_tokens, prefill_seconds(target, prompts[:batch]),
                                 args.prompt_len)
    counts = engines["auto"].stats.gamma_counts
    best_fixed = max(rate["gamma=2"], rate["gamma=4"])
    return {"workload": name, "batch": batch, "requests": len(prompts), **{f"{v} tok/s": rate[v] for v in VARIANTS},
            "gamma=2 / plain": rate["gamma=2"] / rate["plain"], "gamma=4 / plain": rate["gamma=4"] / rate["plain"],
            "auto / plain": rate["auto"] / rate["plain"], "auto / best fixed": rate["auto"] / best_fixed,
            "predicted speedup": pred, "predicted gamma": pred_gamma, "acceptance (gamma=4)": fixed4,
            "measured speedup": best_fixed / rate["plain"],
            "prediction error": best_fixed / rate["plain"] / pred - 1.0,
            "auto mean gamma": sum(g * n for g, n in counts.items()) / max(sum(counts.values()), 1),
            "auto gamma counts": dict(sorted(counts.items())), "same tokens": same}


def plot(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        own = [r for r in rows if r["workload"] == name]
        batches = [r["batch"] for r in own]
        for key, style in (("gamma=2 / plain", "s--"), ("gamma=4 / plain", "^--"), ("auto / plain", "o-")):
            ax.plot(batches, [r[key] for r in own], style, label=key.split(" /")[0])
        ax.plot(batches, [r["predicted speedup"] for r in own], "k:", label="predicted (best γ)")
        crossing = next((r["batch"] for r in own if r["predicted speedup"] < 1), None)
        if crossing is not None:
            ax.axvline(crossing, color="grey", lw=0.8)
            ax.text(crossing, ax.get_ylim()[1], " predicted crossover", va="top", fontsize=7, color="grey")
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("concurrency (max_batch_size)")
        ax.set_ylabel("speedup over plain")
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)


def fidelity(rows: list[dict]) -> dict:
    """Per workload, the predicted and the measured crossover (best fixed γ over plain), printed."""
    from hybridspec.sim import measured_crossover
    out = {}
    for name in dict.fromkeys(r["workload"] for r in rows):
        own = [r for r in rows if r["workload"] == name]
        cross = {kind: measured_crossover([{"batch": r["batch"], "speedup": {"value": r[key], "source": "measured"}}
                                           for r in own])
                 for kind, key in (("predicted", "predicted speedup"), ("measured", "measured speedup"))}
        print(f"{name}: predicted crossover batch {cross['predicted']['batch']} ({cross['predicted']['note']}); "
              f"measured {cross['measured']['batch']} ({cross['measured']['note']})")
        out[name] = cross
    return out


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--requests-per-slot", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--scales", type=float, nargs="+", default=[0.0, 0.05, 0.15],
                        help="λ of the random pair's later layers: high, medium, low acceptance (about 1.0, 0.6, 0.2 at γ = 4)")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.new_tokens, args.prompt_len, args.scales, args.repeats = [1, 2], 8, 16, [0.0], 1
    threads = set_threads(args.threads)
    set_clock(args.clock)
    rows = []
    began = time.perf_counter()
    for name, target, draft, pool in workloads(args):
        for batch in args.batches:
            row = measure(name, target, draft, pool, batch, args)
            rows.append(row)
            print(f"[{time.perf_counter() - began:6.0f} s] {name} B={batch}: auto/plain {row['auto / plain']:.2f}, "
                  f"auto/best fixed {row['auto / best fixed']:.2f}", file=sys.stderr, flush=True)
    columns = ["workload", "batch", "plain tok/s", "gamma=2 / plain", "gamma=4 / plain", "auto / plain",
               "auto / best fixed", "auto mean gamma", "acceptance (gamma=4)", "predicted speedup", "predicted gamma",
               "measured speedup", "prediction error", "same tokens"]
    print_table(rows, columns)
    crossovers = fidelity(rows)
    misses = [r for r in rows if r["auto / plain"] < 0.97 or r["auto / best fixed"] < 0.95]
    print(f"targets (auto >= 0.97 x plain and >= 0.95 x best fixed): met at {len(rows) - len(misses)} of "
          f"{len(rows)} points")
    path = write_json(args.out or "batch_sweep.json",
                      {"machine": describe_machine(), "threads": threads, "args": {k: str(v) for k, v in vars(args).items()},
                       "rows": rows, "crossover": crossovers})
    plot(rows, path.with_suffix(".png"))
    return 0 if all(r["same tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
