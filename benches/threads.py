"""Threads: what torch's intra-op thread count buys on CPU, measured side by side.

The native kernels' matrix products split their columns over torch's thread
count (`kernels/cpu/rows.c`, same bits at every count); the rest of a
forward (recurrences, conv windows, attention, norms, Python) runs on the
calling thread. This bench measures what that gives, per thread count
(`--thread-counts`, default 1 … os.cpu_count() up to 4), alternating the
counts call by call (wall clock: CPU time would add the helpers' time; median
with min–max of `--repeats` after a warm-up):

- the target's plain decode step and its verify forward of γ + 1 = 5 inputs
  with a snapshot after every input (the slots a round uses), at batch 1 and 4,
  for the embedded target and round_cost's 35.8M random Bamba (hidden 512,
  8 layers, weights out of cache);
- `Engine.generate` at batch 1 on the embedded pair, plain and speculative
  (γ = 4, its draft model), over held-out prompts: tokens per second;
- at the highest count, the same forwards with the native kernels off (the
  torch paths, whose products are MKL's with the same threads): what the
  kernels' threads stand against.

The speedup column is each count's median against one thread's.

    python benches/threads.py            # the measurement (a few minutes)
    python benches/threads.py --quick    # tiny models, a smoke run
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from common import bench_parser, describe_machine, print_table, set_threads, write_json

GAMMA = 4
FORWARD_BATCHES, FORWARD_BATCHES_QUICK = (1, 4), (1,)


def spread(samples: list[float]) -> dict:
    """Median and min-max of seconds, in ms."""
    return {"ms": 1e3 * statistics.median(samples), "min_ms": 1e3 * min(samples), "max_ms": 1e3 * max(samples)}


def interleaved(fns: dict, counts: list[int], repeats: int) -> dict:
    """{(name, threads): seconds samples}: every function at every thread count,
    alternating call by call after one warm-up each (wall clock)."""
    samples = {(name, t): [] for name in fns for t in counts}
    for index in range(repeats + 1):
        for name, fn in fns.items():
            for t in counts:
                torch.set_num_threads(t)
                start = time.perf_counter()
                fn()
                if index:
                    samples[(name, t)].append(time.perf_counter() - start)
    return samples


def forward_rows(label: str, model, counts: list[int], batches, repeats: int) -> list[dict]:
    """Plain step and verify forward of `model` per batch and thread count, and the torch paths at the last count."""
    from round_cost import ScratchCache
    rows = []
    for batch in batches:
        cache = ScratchCache(model, batch)
        fns = {"plain step": lambda: cache.forward(1), f"verify ({GAMMA + 1} inputs)": lambda: cache.forward(GAMMA + 1)}
        samples = interleaved(fns, counts, repeats)
        model.bind_backend("torch")
        try:
            torch_paths = interleaved(fns, counts[-1:], repeats)
        finally:
            model.bind_backend()
        for name in fns:
            one = statistics.median(samples[(name, counts[0])])
            for t in counts:
                rows.append(dict(model=label, batch=batch, part=name, threads=t, kernels="native",
                                 **spread(samples[(name, t)]), speedup=one / statistics.median(samples[(name, t)])))
            t = counts[-1]
            rows.append(dict(model=label, batch=batch, part=name, threads=t, kernels="torch",
                             **spread(torch_paths[(name, t)]), speedup=one / statistics.median(torch_paths[(name, t)])))
    return rows


def engine_rows(label: str, target, draft, prompts, new_tokens: int, counts: list[int], repeats: int) -> list[dict]:
    """generate tok/s at batch 1, plain and speculative, per thread count; the tokens are checked equal."""
    import hybridspec as hs
    sizes = dict(max_batch_size=1, max_model_len=max(map(len, prompts)) + new_tokens + GAMMA + 1)
    engines = {"plain": hs.Engine(target, **sizes), "speculative": hs.Engine(target, draft=draft, num_draft_tokens=GAMMA,
                                                                          **sizes)}
    params = hs.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    outputs: dict = {}

    def run(name):
        def fn():
            got = [engines[name].generate([p], params)[0].token_ids for p in prompts]
            outputs.setdefault((name, torch.get_num_threads()), got)
        return fn

    samples = interleaved({name: run(name) for name in engines}, counts, repeats)
    reference = outputs[("plain", counts[0])]
    rows = []
    for name in engines:
        one = statistics.median(samples[(name, counts[0])])
        for t in counts:
            if outputs[(name, t)] != reference:
                raise AssertionError(f"{label} {name} at {t} threads emitted other tokens than plain at {counts[0]}")
            s = samples[(name, t)]
            tokens = len(prompts) * new_tokens
            rows.append(dict(model=label, batch=1, part=f"generate, {name}", threads=t, kernels="native", **spread(s),
                             tok_s=tokens / statistics.median(s), speedup=one / statistics.median(s)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--thread-counts", type=int, nargs="+", default=None,
                        help="thread counts to compare (default 1 ... os.cpu_count(), at most 4)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per thread count (default 7; 2 quick)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per generate (default 48; 8 quick)")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    counts = args.thread_counts or list(range(1, min(os.cpu_count() or 1, 4) + 1))
    if any(t < 1 for t in counts):
        raise SystemExit(f"--thread-counts {counts}: each must be >= 1")
    if len(counts) == 1 and counts[0] == 1:
        counts = [1, 2]  # a one-CPU machine: still compare (the helpers share the core)
    repeats = args.repeats or (2 if args.quick else 7)
    new_tokens = args.new_tokens or (8 if args.quick else 48)
    print(describe_machine(), flush=True)
    print(f"thread counts {counts}, {repeats} timed calls each, alternating", flush=True)
    import hybridspec as hs
    from round_cost import FULL, QUICK, build_pair
    rows = []
    hf_target, hf_draft = build_pair(QUICK if args.quick else FULL, 0.03)
    random_target = hs.from_hf(hf_target).pack_for_cpu()
    label = f"random {random_target.num_parameters() / 1e6:.3g}M"
    if args.quick:
        random_draft = hs.from_hf(hf_draft).pack_for_cpu()
        rows += forward_rows(label, random_target, counts, FORWARD_BATCHES_QUICK, repeats)
        prompts = [[(7 * i + 3) % random_target.vocab_size for i in range(12)] for _ in range(2)]
        rows += engine_rows(label, random_target, random_draft, prompts, new_tokens, counts, repeats)
    else:
        from e2e import heldout_prompts
        from hybridspec.adapters.embedded import embedded_paths
        del hf_target, hf_draft
        target_dir, draft_dir = embedded_paths()
        target, draft = hs.load(target_dir), hs.load(draft_dir)
        rows += forward_rows("embedded", target, counts, FORWARD_BATCHES, repeats)
        rows += forward_rows(label, random_target, counts, FORWARD_BATCHES, repeats)
        rows += engine_rows("embedded", target, draft, heldout_prompts(4, 128), new_tokens, counts, repeats)
    torch.set_num_threads(args.threads)
    print_table(rows, ["model", "batch", "part", "threads", "kernels", "ms", ("min_ms", "min"), ("max_ms", "max"),
                       ("tok_s", "tok/s"), ("speedup", "x 1 thread")],
                title="wall ms per call, median (min-max); kernels 'torch': the native kernels off")
    write_json(args.out or ("threads_quick.json" if args.quick else "threads.json"),
               dict(bench="threads", quick=args.quick, thread_counts=counts, repeats=repeats, gamma=GAMMA,
                    new_tokens=new_tokens, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
