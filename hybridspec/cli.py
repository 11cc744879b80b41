"""`hybridspec` command line: generate | simulate | bench | check.

Each subcommand lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`; this file only wires them together.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS = {
    "generate": ("hybridspec.generate_cli", "generate text with speculative decoding (embedded byte-level model pair by default)"),
    "simulate": ("hybridspec.sim.cli", "speculative-decoding economics: tokens per round, speedup, crossover batch"),
    "check": ("hybridspec.check_cli", "run the rollback-correctness suite against a model"),
    "bench": ("hybridspec.bench_cli", "run a benchmark from benches/ (e.g. plain_decode --quick)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridspec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
