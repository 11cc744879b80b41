"""Host overhead: aten operations per generated token and wall time outside operations.

Plain and speculative decoding on the embedded pair; time outside any operation is
Python and dispatch. Workload: one held-out 128-byte prompt (as `benches/e2e.py` cuts them), 64 new
tokens, greedy, batch 1, γ = 4, k = 1. Each engine generates once to warm up,
then once under `torch.profiler` (CPU activities). Counted: every `aten::`
event (nested ones included, as the profiler lists them); "top-level" are the
aten events with no aten parent, whose summed CPU time is the time inside
operations; the rest of the profiled wall time is outside them. Also a
breakdown by component of one target decode step (which module the
operations run in).

    python benches/host_overhead.py            # the measurement (seconds)
    python benches/host_overhead.py --quick    # 16 new tokens
"""
from __future__ import annotations

import collections
import sys
import time

from torch.profiler import ProfilerActivity, profile, record_function

from common import bench_parser, describe_machine, print_table, set_threads, write_json
from e2e import heldout_prompts

PROMPT_BYTES, GAMMA = 128, 4


def profiled(fn):
    """(aten events, top-level aten CPU seconds, wall seconds) of one call of `fn`."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        fn()
        wall = time.perf_counter() - start
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return events, sum(e.cpu_time_total for e in top) / 1e6, wall


def generation_row(name: str, engine, prompt: list[int], new_tokens: int) -> dict:
    import hybridspec as hs
    params = hs.SamplingParams(max_new_tokens=new_tokens)
    engine.generate([prompt], params)  # warm-up
    engine.stats.reset()
    events, inside_s, wall_s = profiled(lambda: engine.generate([prompt], params))
    rounds = engine.stats.rounds
    return {"decoding": name, "new_tokens": new_tokens, "rounds": rounds, "aten_ops": len(events),
            "ops_per_token": len(events) / new_tokens, "ops_per_round": len(events) / max(rounds, 1),
            "wall_ms": 1e3 * wall_s, "outside_ops_share": max(1.0 - inside_s / wall_s, 0.0),
            "acceptance_rate": engine.stats.acceptance_rate}


def decode_step_breakdown(target, prompt: list[int]) -> list[dict]:
    """aten operations of one target decode step, by the module they run in."""
    from hybridspec.cache.hybrid_cache import scratch_cache
    cache = scratch_cache(target, 1, 2, max_len=len(prompt) + 8)
    target.prefill(cache, [0], [prompt], last_only=True)
    labels, originals = [], []
    for i, layer in enumerate(target.layers):
        parts = [("mixer " + target.config.layer_types[i], layer.mixer), ("ffn", layer.ffn),
                 ("norm", layer.input_norm), ("norm", layer.ffn_norm)]
        for label, module in parts:
            if module is None:
                continue
            originals.append((module, module.forward))
            module.forward = _labelled(module.forward, label)
            labels.append(label)

    def step():
        target.decode(cache, [0], [prompt[-1]])
        cache.rewind_to(0, len(prompt), cache.head(0))

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    for module, forward in originals:
        module.forward = forward
    ranges = [e for e in prof.events() if e.name.startswith("X ")]
    counts = collections.Counter()
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        owners = [r for r in ranges if r.time_range.start <= e.time_range.start <= e.time_range.end <= r.time_range.end]
        counts[min(owners, key=lambda r: r.time_range.elapsed_us()).name[2:] if owners else "rest"] += 1
    per_module = collections.Counter(labels)
    return [{"component": name, "modules": per_module.get(name, 0), "aten_ops": n,
             "ops_per_module": n / per_module[name] if per_module.get(name) else None}
            for name, n in sorted(counts.items(), key=lambda kv: -kv[1])]


def _labelled(forward, label: str):
    def run(*args, **kwargs):
        with record_function("X " + label):
            return forward(*args, **kwargs)
    return run


def main(argv=None) -> int:
    args = bench_parser(__doc__).parse_args(argv)
    import hybridspec as hs
    from hybridspec.adapters.embedded import embedded_paths
    threads = set_threads(args.threads)
    print(describe_machine(), flush=True)
    new_tokens = 16 if args.quick else 64
    target_dir, draft_dir = embedded_paths()
    target, draft = hs.load(target_dir), hs.load(draft_dir)
    prompt = heldout_prompts(1, PROMPT_BYTES)[0]
    rows = [generation_row("plain", hs.Engine(target), prompt, new_tokens),
            generation_row("speculative (model drafter)", hs.Engine(target, draft=draft, num_draft_tokens=GAMMA),
                           prompt, new_tokens),
            generation_row("speculative (n-gram)", hs.Engine(target, draft=hs.NgramDrafter(), num_draft_tokens=GAMMA),
                           prompt, new_tokens)]
    print_table(rows, ["decoding", "rounds", ("aten_ops", "aten ops"), ("ops_per_token", "ops/token"),
                       ("ops_per_round", "ops/round"), ("wall_ms", "wall ms"), ("outside_ops_share", "outside ops"),
                       ("acceptance_rate", "accept")],
                title=f"embedded pair, {PROMPT_BYTES}-byte prompt, {new_tokens} new tokens, greedy, batch 1, "
                      f"gamma {GAMMA}, {threads} thread(s); prefill included")
    breakdown = decode_step_breakdown(target, prompt)
    print_table(breakdown, ["component", "modules", ("aten_ops", "aten ops"), ("ops_per_module", "ops/module")],
                title="one target decode step: aten operations by the module they run in")
    write_json(args.out or ("host_overhead_quick.json" if args.quick else "host_overhead.json"),
               {"bench": "host_overhead", "quick": args.quick, "prompt_bytes": PROMPT_BYTES, "gamma": GAMMA,
                "threads": threads, "rows": rows, "decode_step": breakdown})
    return 0


if __name__ == "__main__":
    sys.exit(main())
