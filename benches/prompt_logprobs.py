"""Prompt log-probs: what scoring costs, and what recomputing a cached prefix costs.

Workload, on the embedded target (plain engine, one `generate` call of all
prompts, max_new_tokens=0): a multiple-choice item as lm-eval's
log-likelihood requests send it, one shared context followed by each of a few
continuations (bytes of Python standard library text: the embedded model is
byte-level).

Variants: the prefix cache off or on (emptied before each call, so that the
continuations after the first find the context cached, as an item's choices
do), each without and with `prompt_logprobs=1`. A request asking for prompt
log-probs takes no prefix hit (the cache holds K/V and states, not the logits
of every position), so "on + logprobs" recomputes the context that "on" finds
cached: the gap between the two is the price of recomputing instead of
storing per-position log-probs; the gap between "off" and "off + logprobs" is
the LM head and log_softmax over every prompt position.

Per variant: median seconds per call, the variants alternating call by call
(wall, or this process's CPU seconds with --clock cpu), prompt tokens the
prefill ran, prompt tokens found cached.

    python benches/prompt_logprobs.py            # the measurement (about a minute)
    python benches/prompt_logprobs.py --quick    # a smoke run
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

from common import bench_parser, describe_machine, print_table, set_clock, set_threads, side_by_side, write_json


def prompts(context_len: int, continuation_len: int, choices: int) -> list[list[int]]:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_bytes()
    context = list(text[:context_len])
    return [context + list(text[context_len + i * 97:][:continuation_len]) for i in range(choices)]


VARIANTS = {"off": (False, False), "off + logprobs": (False, True), "on": (True, False),
            "on + logprobs": (True, True)}  # name: (prefix cache, prompt log-probs)


def scoring_call(target, batch, prefix_cache: bool, logprobs: bool):
    """A function scoring `batch` in one generate call on an engine of its own (its prefix cache emptied first)."""
    import hybridspec as hs
    params = hs.SamplingParams(max_new_tokens=0, prompt_logprobs=1 if logprobs else None)
    engine = hs.Engine(target, max_batch_size=len(batch), prefix_cache=prefix_cache or None)

    def call():
        if engine.prefix is not None:
            engine.prefix.clear()
        return engine, engine.generate(batch, params)
    return call


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per variant (default 5; quick 1)")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    set_clock(args.clock)
    import hybridspec as hs
    target = hs.load(hs.embedded_paths()[0])
    sizes = dict(context=96, continuation=8, choices=2) if args.quick else dict(context=1024, continuation=24,
                                                                                 choices=4)
    repeats = args.repeats or (1 if args.quick else 5)
    batch = prompts(sizes["context"], sizes["continuation"], sizes["choices"])
    calls = {name: scoring_call(target, batch, *flags) for name, flags in VARIANTS.items()}
    seconds = side_by_side(calls, repeats=repeats, warmup=1)  # alternating call by call
    rows, scored = [], {}
    for name, call in calls.items():
        engine, outputs = call()
        scored[name] = [o.prompt_logprobs for o in outputs]
        rows.append(dict(variant=name, ms=seconds[name] * 1e3, vs_off=seconds[name] / seconds["off"],
                         computed=engine.stats.prefill_computed_tokens, hit_tokens=engine.stats.prefix_hit_tokens))
    equal = scored["on + logprobs"] == scored["off + logprobs"]
    columns = ["variant", ("ms", "ms / call"), ("vs_off", "x off"), ("computed", "prefill computed"),
               ("hit_tokens", "cached tokens")]
    print_table(rows, columns, title=f"prompt log-probs, embedded target, {sizes['choices']} prompts of "
                                     f"{sizes['context']} + {sizes['continuation']} tokens, max_new_tokens=0, "
                                     f"{args.clock} clock, median of {repeats} ({describe_machine()})")
    print(f"log-probs with the cache on equal those with it off: {equal}")
    out = args.out or Path("prompt_logprobs.json")
    write_json(out, {"sizes": sizes, "repeats": repeats, "clock": args.clock, "rows": rows,
                     "cache_on_equals_off": equal})
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
