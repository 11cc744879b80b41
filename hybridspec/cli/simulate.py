"""`hybridspec simulate`: the economics of speculative decoding on hybrid models.

With no arguments it prints the α × γ table of expected tokens per round
(closed form and simulated) and speedup in the memory-bound and compute-bound
regimes, the crossover batch of each preset for several checkpoint policies,
and one line per assumption. `--drafter model,mtp,eagle3` pairs each preset
with those drafters side by side (named '<preset>+mtp', '<preset>+eagle3'):
every preset is reported in one run, so the drafter is a list, as --alphas is.
`--tree 2,2,1` adds a tree draft (candidates per spine depth) against the
chain of as many verify inputs: tokens per round and speedup per preset.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from hybridspec.cli.args import output_file, write_text
from hybridspec.errors import ConfigError
from hybridspec.sim.measured import load_measured
from hybridspec.sim.render import render_report
from hybridspec.sim.report import SimulateSettings, build_report


def _list_of(convert: Callable[[str], object]) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        try:
            return tuple(convert(item) for item in text.split(",") if item.strip())
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list ({error})") from error

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = SimulateSettings()
    parser.add_argument("--alphas", type=_list_of(float), default=defaults.alphas,
                        help="comma-separated per-draft acceptance probabilities (default 0.5,0.6,0.7,0.8,0.9)")
    parser.add_argument("--gammas", type=_list_of(int), default=defaults.gammas,
                        help="comma-separated drafts per round for the table (default 1,...,8)")
    parser.add_argument("--c", type=float, default=defaults.c,
                        help="draft step cost in plain target steps for the table (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=defaults.rounds,
                        help="Monte Carlo rounds per table cell (default %(default)s)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="Monte Carlo seed (default %(default)s)")
    parser.add_argument("--context-len", type=int, default=defaults.context_len,
                        help="tokens already cached per sequence for the presets (default %(default)s)")
    parser.add_argument("--gamma", type=int, default=defaults.crossover_gamma,
                        help="drafts per round for the preset crossover batches (default %(default)s)")
    parser.add_argument("--max-batch", type=int, default=defaults.max_batch,
                        help="largest batch searched for a crossover (default %(default)s)")
    parser.add_argument("--drafter", type=_list_of(str.strip), default=defaults.drafters, metavar="KINDS",
                        help="comma-separated drafters to pair each preset with: model (a separate 0.43B hybrid "
                             "draft model), mtp (the target's MTP layer), eagle3 (an EAGLE-3 head); "
                             "default model")
    parser.add_argument("--tree", type=_list_of(int), default=defaults.tree, metavar="WIDTHS",
                        help="comma-separated candidates per spine depth of a tree draft (e.g. 2,2,1: an "
                             "alternative at depths 1 and 2) to compare with the chain of as many verify inputs")
    parser.add_argument("--rescue", type=float, default=defaults.rescue,
                        help="with --tree: the chance that each next-ranked alternative is the target's token "
                             "once the ones before missed (default %(default)s, assumed)")
    parser.add_argument("--measured", metavar="FILE.json",
                        help="round costs measured by the engine (schema hybridspec.round_cost/v1, "
                             "see docs/simulator.md); adds a section labelled measured")
    parser.add_argument("--plot", metavar="OUT.png", help="draw speedup against batch size (needs matplotlib)")
    parser.add_argument("--json", metavar="PATH",
                        help="write the whole report as JSON (schema hybridspec.simulate/v1) to PATH; "
                             "'-' writes it to stdout instead of the text report")


def _settings(args: argparse.Namespace) -> SimulateSettings:
    return SimulateSettings(
        alphas=tuple(args.alphas),
        gammas=tuple(args.gammas),
        c=args.c,
        rounds=args.rounds,
        seed=args.seed,
        context_len=args.context_len,
        crossover_gamma=args.gamma,
        max_batch=args.max_batch,
        drafters=tuple(args.drafter),
        tree=None if args.tree is None else tuple(args.tree),
        rescue=args.rescue,
    )


def run(args: argparse.Namespace) -> int:
    json_file = None if args.json in (None, "-") else output_file("--json", args.json)
    plot_file = None if args.plot is None else output_file("--plot", args.plot)
    try:
        settings = _settings(args)
        measured = None if args.measured is None else (load_measured(args.measured), args.measured)
        report = build_report(settings, measured)
        if args.plot is not None:
            from hybridspec.sim.plot import plot_speedup

            plot_speedup(report, settings, str(plot_file))
    except (ConfigError, ImportError) as error:
        print(f"hybridspec simulate: error: {error}", file=sys.stderr)
        return 2
    if args.json == "-":
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    if json_file is not None:
        write_text("--json", json_file, json.dumps(report, indent=2))
    sys.stdout.write(render_report(report))
    if json_file is not None:
        print(f"wrote {args.json}")
    if args.plot is not None:
        print(f"wrote {args.plot}")
    return 0
