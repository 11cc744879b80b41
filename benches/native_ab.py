"""The native CPU kernels of two revisions side by side in one process.

The same forwards run alternately, call by call, with this checkout's kernel
library and with one built from another git revision's kernel sources
(`--base`, default HEAD): a plain decode step and a verify forward over
γ + 1 = 5 inputs with a snapshot after every input (what `round_cost.py`
times), at each batch, on round_cost's 35.8M Bamba target (`--model
round_cost`; its 134 MB of weights stream from memory) or on the embedded
target (`--model embedded`; its weights fit in cache). One process and one
model, so the machine's slow and fast phases fall on both libraries alike,
where separate processes of each revision see different ones. One torch
thread only: each library keeps its own helper threads, and one library's
would still be spinning while the other's forward runs.

Per (batch, forward, library): median and min–max wall milliseconds; per
pair: new / base of the medians, and whether the two libraries gave the
same logits bit for bit (they do unless a kernel's chains changed); per
library: the verify in plain steps (the target: ≤ 1.5 up to batch 8). The libraries must agree on
the structs the forward passes (`cpu/forward.py`, `cpu/kernels.h`) and on
the functions' arguments (`cpu_native.SIGNATURES`): a revision where those
differ is refused.

    python benches/native_ab.py --base HEAD~1 --batches 1 2 4 8
    python benches/native_ab.py --quick    # the embedded target, batch 1, few repeats
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import hybridspec as hs
from common import bench_parser, describe_machine, out_dir, print_table, set_threads, write_json
from hybridspec.kernels.cpu import native as cpu_native

ROOT = Path(__file__).resolve().parent.parent
GAMMA = 4
SAME_LAYOUT = ("kernels/cpu/forward.py", "kernels/cpu/kernels.h")  # the structs, Python and C side


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout


def signatures_text(source: str) -> str:
    """The `SIGNATURES = {…}` table of a `cpu/native.py` source."""
    start = source.index("SIGNATURES = {")
    return source[start:source.index("\n}\n", start)]


def build_revision(rev: str, directory: Path, sources: Path | None = None):
    """The kernel library built from `rev`'s sources (the files `cpu_native`
    compiles, read from git), or from the same files in the folder `sources`,
    in `directory`, loaded and typed."""
    if sources is None:
        changed = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", rev, "--", *SAME_LAYOUT]).returncode
        here = signatures_text((ROOT / "kernels" / "cpu/native.py").read_text())
        if changed or signatures_text(git("show", f"{rev}:kernels/cpu/native.py")) != here:
            raise SystemExit(f"native_ab: {rev} differs from this checkout in {', '.join(SAME_LAYOUT)} or in "
                             "cpu_native.SIGNATURES; the forward's structs or the functions' arguments may not "
                             "match, so its library cannot stand in for this one")
    for path in (*cpu_native.SOURCES, *cpu_native.HEADERS):
        if sources is not None and not (sources / path.name).is_file():
            continue  # a file this checkout added: the base's sources do not include it
        if sources is None and subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{rev}:kernels/cpu/{path.name}"],
                                              capture_output=True).returncode:
            continue
        text = (sources / path.name).read_text() if sources else git("show", f"{rev}:kernels/cpu/{path.name}")
        (directory / path.name).write_text(text)
    target = directory / "base.so"
    cpu_native.compile_library(cpu_native.find_compiler(), [directory / p.name for p in cpu_native.SOURCES], target)
    return cpu_native.load(target)


def build_model(name: str, quick: bool):
    if name == "embedded":
        from hybridspec.adapters.embedded import embedded_paths
        return hs.load(embedded_paths()[0])
    from round_cost import FULL, QUICK, build_pair
    return hs.from_hf(build_pair(QUICK if quick else FULL, 0.03)[0]).pack_for_cpu()


def measure(model, batch: int, libraries: dict, repeats: int) -> dict:
    """Wall seconds of a plain step and a verify per library, alternating the
    libraries call by call (which goes first alternates too), after a warm-up."""
    from round_cost import ScratchCache
    scratch = ScratchCache(model, batch)
    forwards = {"plain": lambda: scratch.forward(1), "verify": lambda: scratch.forward(GAMMA + 1)}
    logits = {}
    for lib in libraries:  # the same forwards: equal logits unless a kernel's chains changed
        cpu_native._library = libraries[lib]
        logits[lib] = [fn() for fn in forwards.values()]
    same_bits = all(torch.equal(a, b) for a, b in zip(*logits.values()))
    samples = {(lib, fwd): [] for lib in libraries for fwd in forwards}
    order = list(libraries)
    for index in range(repeats + 1):
        for lib in (order if index % 2 else order[::-1]):
            cpu_native._library = libraries[lib]
            for fwd, fn in forwards.items():
                start = time.perf_counter()
                fn()
                if index:
                    samples[lib, fwd].append(time.perf_counter() - start)
    return samples, same_bits


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--base", default="HEAD", help="the git revision whose kernels are the baseline")
    parser.add_argument("--base-sources", type=Path, default=None,
                        help="a folder of kernel sources to build the baseline from instead (an experiment; "
                             "its structs must be this checkout's)")
    parser.add_argument("--model", choices=("round_cost", "embedded"), default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads != 1:  # each library keeps its own helper threads, which spin a while after a job
        parser.error(f"--threads {args.threads}: native_ab compares the libraries on one thread; with more, one "
                     "library's helpers would still be spinning while the other's forward runs")
    set_threads(args.threads)
    model_name = args.model or ("embedded" if args.quick else "round_cost")
    batches = args.batches or ([1] if args.quick else [1, 2, 4, 8])
    repeats = args.repeats or (3 if args.quick else 15)
    new = cpu_native.library()
    if not new:
        print("native_ab: the native CPU kernels cannot run here; nothing to compare")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        base = build_revision(args.base, Path(tmp), args.base_sources)
        model = build_model(model_name, args.quick)
        named = args.base_sources or f"{args.base} ({git('rev-parse', '--short', args.base).strip()})"
        print(f"{model_name}: {model.num_parameters() / 1e6:.1f}M parameters; base {named} against this "
              f"checkout; {describe_machine()}", flush=True)
        libraries = {"base": base, "new": new}
        rows = []
        try:
            for batch in batches:
                samples, same_bits = measure(model, batch, libraries, repeats)
                med = {key: statistics.median(values) for key, values in samples.items()}
                for fwd in ("plain", "verify"):
                    rows.append({"batch": batch, "forward": fwd,
                                 **{f"{lib}_ms": 1e3 * med[lib, fwd] for lib in libraries},
                                 **{f"{lib}_range": f"{1e3 * min(samples[lib, fwd]):.2f}–"
                                                    f"{1e3 * max(samples[lib, fwd]):.2f}" for lib in libraries},
                                 "new/base": med["new", fwd] / med["base", fwd], "same_bits": same_bits})
                rows.append({"batch": batch, "forward": "verify (plain steps)",
                             **{f"{lib}_ms": med[lib, "verify"] / med[lib, "plain"] for lib in libraries},
                             "new/base": (med["new", "verify"] / med["new", "plain"])
                             / (med["base", "verify"] / med["base", "plain"])})
                print(f"batch {batch} done", flush=True)
        finally:
            cpu_native._library = new
    print_table(rows, ["batch", "forward", ("base_ms", "base ms"), ("base_range", "min–max"), ("new_ms", "new ms"),
                       ("new_range", "min–max"), "new/base", ("same_bits", "same logits")],
                title=f"median of {repeats} alternating calls, wall ms (the 'plain steps' rows: verify / plain)")
    write_json(args.out or out_dir() / "native_ab.json",
               {"bench": "native_ab", "model": model_name, "base": str(args.base_sources or args.base),
                "repeats": repeats, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
