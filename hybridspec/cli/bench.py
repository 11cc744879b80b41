"""`hybridspec bench NAME [ARGS...]`: run one of the repository's benchmarks
(`benches/NAME.py`) with its own arguments, e.g. `hybridspec bench
memory_vs_replay --quick`. Benchmarks live in the source checkout, not in the
installed package: an installation without one says so and how to get it."""
from __future__ import annotations

import argparse
import ast
import runpy
import sys
from pathlib import Path

from hybridspec.errors import UsageError

BENCHES_DIR = Path(__file__).resolve().parents[2] / "benches"


def available() -> list[str]:
    return sorted(p.stem for p in BENCHES_DIR.glob("*.py") if p.stem != "common" and not p.stem.startswith("_"))


def summary(name: str) -> str:
    """The first line of benchmark `name`'s docstring: what it measures. Read
    from the source, not imported, so listing costs no torch import."""
    tree = ast.parse((BENCHES_DIR / f"{name}.py").read_text(encoding="utf-8"))
    doc = ast.get_docstring(tree) or ""
    return doc.strip().splitlines()[0] if doc.strip() else "(no docstring)"


def listing(names: list[str]) -> str:
    """One line per benchmark: its name, then what it measures."""
    width = max(map(len, names))
    return "\n".join(f"  {name:<{width}}  {summary(name)}" for name in names)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help="benchmark to run (omit to list them)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")


def run(args) -> int:
    if not BENCHES_DIR.is_dir():
        raise UsageError(f"the benchmarks are in the source checkout's benches/ folder, which this installation has "
                         f"not ({BENCHES_DIR} does not exist); clone the hybridspec repository, pip install -e . in "
                         "it and run hybridspec bench from that checkout")
    names = available()
    if not args.name:
        if not names:
            print(f"benchmarks: none found in {BENCHES_DIR}")
            return 0
        print(f"benchmarks (hybridspec bench NAME --help for a benchmark's flags):\n{listing(names)}")
        return 0
    if args.name not in names:
        print(f"hybridspec bench: unknown benchmark {args.name!r}; available: {', '.join(names) or 'none'} "
              f"(looked in {BENCHES_DIR}; benchmarks need the source checkout)", file=sys.stderr)
        return 2
    script = BENCHES_DIR / f"{args.name}.py"
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv, sys.path = [str(script), *args.args], [str(BENCHES_DIR), *sys.path]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        sys.argv, sys.path = saved_argv, saved_path
    return 0
