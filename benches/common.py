"""Shared helpers for the benchmarks in `benches/`: timing, tables, JSON with
machine info, PNGs, and the common command-line flags.

Every bench is a script (`python benches/<name>.py [--quick]`) with a
`main(argv) -> int`; running it from the repository root puts this folder on
`sys.path`, so benches import these helpers as `from common import ...`.
Results go to `benches/out/` (git-ignored) unless `--out` says otherwise.

    from common import bench_parser, print_table, side_by_side, write_json
    args = bench_parser(__doc__).parse_args(argv)
    threads = set_threads(args.threads)
    seconds = side_by_side({"engine": run_engine, "hf": run_hf}, repeats=3)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable, Sequence

OUT_DIR = Path(__file__).resolve().parent / "out"
CLOCKS = {"wall": lambda: time.perf_counter(), "cpu": lambda: time.process_time()}
clock = CLOCKS["wall"]  # what `timed` and `side_by_side` measure; `--clock` sets it


def out_dir() -> Path:
    """`benches/out/`, created on first use."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    return OUT_DIR


# -- command line -----------------------------------------------------------------------------

def bench_parser(description: str | None) -> argparse.ArgumentParser:
    """A parser with the flags every bench shares: --quick, --threads, --out."""
    from hybridspec.cli.main import OneLineParser  # a bad value is one line, as in every other command
    first_line = (description or "").strip().splitlines()[0] if description else None
    parser = OneLineParser(description=first_line)
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and few repeats: a smoke run for the test suite, not a measurement")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads for the whole run (default 1: the machine is shared)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON output path (default benches/out/<bench>.json)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="wall seconds (default) or this process's CPU seconds (steadier on a machine other "
                             "work shares: waiting for a core is not counted); set with set_clock")
    return parser


def set_clock(name: str) -> None:
    """Time with CLOCKS[name] from now on (see bench_parser's --clock)."""
    global clock
    clock = CLOCKS[name]


def set_threads(threads: int) -> int:
    """Fix torch's intra-op thread count for the run and print it; returns it."""
    import torch
    if threads < 1:
        raise ValueError(f"--threads={threads} must be >= 1")
    torch.set_num_threads(threads)
    print(f"torch.set_num_threads({threads}); os.cpu_count() = {os.cpu_count()}", flush=True)
    return threads


# -- timing -----------------------------------------------------------------------------------

def timed(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Median seconds (`clock`) of `fn()` over `repeats` calls after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = clock()
        fn()
        samples.append(clock() - start)
    return statistics.median(samples)


def side_by_side(fns: dict[str, Callable[[], object]], repeats: int = 3, warmup: int = 1) -> dict[str, float]:
    """Median seconds per function, measured by alternating them call by call
    (a, b, a, b, ...) so that a load change on a shared machine hits all alike.
    Each function is warmed up `warmup` times first."""
    return {name: statistics.median(s) for name, s in alternating_samples(fns, repeats, warmup).items()}


def alternating_samples(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
                        timer: Callable[[], float] | None = None) -> dict[str, list[float]]:
    """Seconds of every call of each function (`timer`, default `clock`), the
    functions alternating call by call (a, b, a, b, ...) after `warmup`
    untimed passes."""
    timer = timer or clock
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = timer()
            fn()
            samples[name].append(timer() - start)
    return samples


# -- output -----------------------------------------------------------------------------------

def _cell(value) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else ("yes" if value else "no")
    if isinstance(value, float):
        if value != value:  # NaN
            return "nan"
        magnitude = abs(value)
        if magnitude == 0:
            return "0"
        if magnitude >= 1000:
            return f"{value:,.0f}"
        if magnitude >= 10:
            return f"{value:.1f}"
        if magnitude >= 0.01:
            return f"{value:.3f}"
        return f"{value:.2e}"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10000 else str(value)
    return str(value)


def format_table(rows: Sequence[dict], columns: Sequence[str | tuple[str, str]] | None = None,
                 markdown: bool = False) -> str:
    """Rows of dicts as an aligned text table (or a Markdown table).

    `columns` lists keys, or (key, header) pairs; default: the first row's keys.
    Floats get 3-4 significant digits; missing keys print as "-"."""
    if columns is None:
        columns = list(rows[0]) if rows else []
    keys = [c if isinstance(c, str) else c[0] for c in columns]
    headers = [c if isinstance(c, str) else c[1] for c in columns]
    cells = [[_cell(row.get(k)) for k in keys] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    if markdown:
        line = lambda values: "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"
        rule = "| " + " | ".join("-" * w for w in widths) + " |"
    else:
        line = lambda values: "  ".join(v.rjust(w) for v, w in zip(values, widths))
        rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule] + [line(r) for r in cells])


def print_table(rows: Sequence[dict], columns: Sequence[str | tuple[str, str]] | None = None,
                title: str | None = None) -> None:
    if title:
        print(f"\n{title}")
    print(format_table(rows, columns), flush=True)


ENVIRONMENT = ("HYBRIDSPEC_BACKEND", "HYBRIDSPEC_PIN_THREADS", "OMP_WAIT_POLICY", "OMP_PROC_BIND")


def machine_info() -> dict:
    """Where a result was measured: OS, CPU, thread count, library versions, date, commit."""
    import torch
    info = {
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        # the settings that change how a CPU run uses its cores or which kernels it takes
        "environment": {name: os.environ.get(name) for name in ENVIRONMENT},
    }
    try:
        from hybridspec.kernels.cpu import native as cpu_native
        info["native_cpu_kernels"] = cpu_native.available()  # the C paths float32 CPU runs take on one thread
    except ImportError:
        info["native_cpu_kernels"] = None
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def describe_machine(info: dict | None = None) -> str:
    """One line naming the machine, for table captions."""
    info = info or machine_info()
    native = info.get("native_cpu_kernels")  # on at any torch thread count (cpu_native.sync_threads)
    native = "" if native is None else ", native CPU kernels on" if native else ", native CPU kernels off"
    return (f"{info['processor']}, {info['cpu_count']} CPUs ({info['torch_threads']} torch threads), "
            f"torch {info['torch']}, Python {info['python']}{native}")


def write_json(path: str | Path, payload: dict) -> Path:
    """Write `payload` plus a "machine" entry (machine_info()) as JSON.
    A bare file name goes to benches/out/."""
    path = Path(path)
    if path.parent == Path("."):
        path = out_dir() / path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**payload, "machine": machine_info()}, indent=2, default=str) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def save_png(fig, path: str | Path, dpi: int = 110) -> Path:
    """Save a matplotlib figure (small, tight); a bare file name goes to benches/out/."""
    path = Path(path)
    if path.parent == Path("."):
        path = out_dir() / path
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    print(f"wrote {path}", flush=True)
    return path
