"""Run one benchmark in two checkouts side by side and report after/before ratios.

    python tools/ab_bench.py --before ../old --after . --runs 3 --keys spec_tok_s plain_tok_s \
        -- benches/e2e.py --skip random

Each checkout runs the benchmark with its own interpreter (`<checkout>/.venv/bin/python`
when present), alternating before/after `--runs` times so that a load change on
a shared machine hits both alike. Every run writes its JSON to a scratch
folder; rows are matched by position (the same command gives the same rows)
and, per key, the ratio after/before of the medians is printed with the
min–max of the per-run ratios. The ratios go to `--out` as JSON too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def interpreter(checkout: Path) -> str:
    venv = checkout / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def run_once(checkout: Path, command: list[str], out: Path) -> dict:
    # the checkout first on the path: an editable install would otherwise import one package for both
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))}
    subprocess.run([interpreter(checkout), *command, "--out", str(out)], cwd=checkout, check=True,
                   stdout=subprocess.DEVNULL, env=env)
    return json.loads(out.read_text())


def rows_of(payload: dict, table: str) -> list[dict]:
    return payload[table]


def label(row: dict, label_keys: list[str]) -> str:
    return ", ".join(f"{row.get(k)}" for k in label_keys)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="checkout of the old revision")
    parser.add_argument("--after", type=Path, required=True, help="checkout of the new revision")
    parser.add_argument("--runs", type=int, default=3, help="runs per checkout, alternating")
    parser.add_argument("--table", default="rows", help="the JSON list of rows to compare")
    parser.add_argument("--keys", nargs="+", required=True, help="numeric row fields to compare")
    parser.add_argument("--label", nargs="+", default=["workload", "drafter"], help="row fields naming a row")
    parser.add_argument("--out", type=Path, default=None, help="write the ratios here as JSON")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- benchmark script and its arguments")
    args = parser.parse_args(argv)
    command = [c for c in args.command if c != "--"]
    if not command:
        parser.error("give the benchmark after --, e.g. -- benches/e2e.py --quick")
    runs: dict[str, list[list[dict]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(args.runs):
            for side in ("before", "after"):
                checkout = getattr(args, side).resolve()
                payload = run_once(checkout, command, Path(scratch) / f"{side}-{i}.json")
                runs[side].append(rows_of(payload, args.table))
                print(f"run {i + 1}/{args.runs} {side} done", file=sys.stderr, flush=True)
    results = []
    for r, row in enumerate(runs["after"][0]):
        for key in args.keys:
            before = [rows[r][key] for rows in runs["before"]]
            after = [rows[r][key] for rows in runs["after"]]
            per_run = [a / b for a, b in zip(after, before) if b]
            results.append(dict(row=label(row, args.label), key=key, before=statistics.median(before),
                                after=statistics.median(after),
                                ratio=statistics.median(after) / statistics.median(before),
                                ratio_min=min(per_run), ratio_max=max(per_run)))
    width = max(len(x["row"]) for x in results)
    print(f"{'row':<{width}}  {'key':<20} {'before':>10} {'after':>10} {'after/before':>12}  min–max")
    for x in results:
        print(f"{x['row']:<{width}}  {x['key']:<20} {x['before']:>10.4g} {x['after']:>10.4g} {x['ratio']:>12.3f}  "
              f"{x['ratio_min']:.3f}–{x['ratio_max']:.3f}")
    if args.out:
        args.out.write_text(json.dumps(dict(command=command, runs=args.runs, results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
