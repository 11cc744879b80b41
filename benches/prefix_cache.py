"""Prefix cache: time to first token and prefill work on two shared-prefix workloads.

Workloads, on the embedded pair (speculative decoding, greedy; the target and
the model drafter each have their own prefix cache), one request at a time:
- chat: a system prompt, then turns that each re-send the whole conversation
  (previous prompt + the model's answer + a new user message);
- document: many questions, each the same long document + its own question.
Text is bytes of Python standard library files (the embedded pair is
byte-level).

Variants: the cache off; states saved only at prompt and request ends and at
hits past their saved state ("ends"); ends plus every 64 / 256 prompt tokens;
and a block-grid-only cache
as vLLM keeps it ("grid-256": states only every 256 tokens, no end
states, hits only at a grid point, no replay).

Per variant and workload: mean time to first token (TTFT: generate call to
the first emitted token; also over the second and later requests), prompt
tokens the target's prefill actually ran, tokens replayed from saved states,
the hit rate (prompt tokens found in the cache / prompt tokens; their K/V is
shared), the prefill saved (1 - computed / prompt tokens: what the
saved states spared), saved-state memory (target + drafter, at the end),
and generated tokens/s over the whole run. Times are wall seconds, or this
process's CPU seconds with --clock cpu (steadier where other work shares the
machine). Every variant's outputs must equal the cache-off outputs.

    python benches/prefix_cache.py            # the measurement (a few minutes)
    python benches/prefix_cache.py --quick    # a smoke run
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

import common
from common import bench_parser, describe_machine, print_table, save_png, set_clock, set_threads, write_json

GRID = 256


def variants() -> dict[str, object]:
    import hybridspec as hs
    return {
        "off": None,
        "ends": hs.PrefixCache(),
        "ends+64": hs.PrefixCache(save_every=64),
        "ends+256": hs.PrefixCache(save_every=256),
        f"grid-{GRID}": hs.PrefixCache(save_every=GRID, at_prompt_end=False, at_request_end=False,
                                       at_hit=False, max_replay_tokens=0),
    }


def stdlib_text(name: str) -> list[int]:
    """The bytes of a standard library file, from its first top-level def or class."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / name).read_bytes()
    return list(text[text.find(b"\ndef ") + 1:])


def chat_messages(num_turns: int, system_len: int, message_len: int) -> tuple[list[int], list[list[int]]]:
    source = stdlib_text("textwrap.py")
    system = source[:system_len]
    messages = [source[system_len + i * 3 * message_len:][:message_len] for i in range(num_turns)]
    return system, messages


def document_prompts(num_questions: int, doc_len: int, question_len: int) -> list[list[int]]:
    document, questions = stdlib_text("json/decoder.py")[:doc_len], stdlib_text("string.py")
    return [document + questions[i * 2 * question_len:][:question_len] for i in range(num_questions)]


def run_chat(engine, params, system, messages, clock) -> tuple[list[list[int]], list[float], int]:
    outputs, ttfts, prompt_tokens, conversation = [], [], 0, list(system)
    for message in messages:
        conversation += message
        out, ttft = generate_timed(engine, conversation, params, clock)
        outputs.append(out)
        ttfts.append(ttft)
        prompt_tokens += len(conversation)
        conversation += out
    return outputs, ttfts, prompt_tokens


def run_document(engine, params, prompts, clock) -> tuple[list[list[int]], list[float], int]:
    results = [generate_timed(engine, p, params, clock) for p in prompts]
    return [r[0] for r in results], [r[1] for r in results], sum(map(len, prompts))


def generate_timed(engine, prompt, params, clock) -> tuple[list[int], float]:
    first = []
    start = clock()
    out = engine.generate([prompt], params, stream=lambda i, tokens: first or first.append(clock()))[0]
    return out.token_ids, first[0] - start


def measure(target, draft, settings, workload, params, repeats: int, clock) -> dict:
    """Run `workload` on a fresh Engine `repeats` times; the run of median time counts."""
    import hybridspec as hs
    runs = []
    for _ in range(repeats):
        engine = hs.Engine(target, draft=draft, num_draft_tokens=4, prefix_cache=settings, max_batch_size=1,
                           max_model_len=4096)
        start = clock()
        outputs, ttfts, prompt_tokens = workload(engine, params)
        wall = clock() - start
        runs.append((wall, engine, outputs, ttfts, prompt_tokens))
    wall, engine, outputs, ttfts, prompt_tokens = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    stats = engine.total_stats
    stores = [s for s in (engine.prefix, engine.speculator.drafter.prefix) if s is not None]
    generated = sum(map(len, outputs))
    return dict(outputs=outputs, ttft_ms=1000 * sum(ttfts) / len(ttfts), first_ttft_ms=1000 * ttfts[0],
                later_ttft_ms=1000 * sum(ttfts[1:]) / max(1, len(ttfts) - 1), prompt_tokens=prompt_tokens,
                computed=stats.prefill_computed_tokens, replayed=stats.prefix_replayed_tokens,
                hit_tokens=stats.prefix_hit_tokens, hit_rate=stats.prefix_hit_tokens / prompt_tokens,
                prefill_saved=1 - stats.prefill_computed_tokens / prompt_tokens,
                saved_state_hits=stats.prefix_saved_state_hits, evictions=stats.prefix_evictions,
                saved_states=sum(s.num_saved_states() for s in stores),
                saved_state_mib=sum(s.saved_state_bytes for s in stores) / 2 ** 20,
                tok_s=generated / wall, wall_s=wall, requests=len(outputs))


def plot(rows, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, workload in zip(axes, ("chat", "document")):
        for row in (r for r in rows if r["workload"] == workload):
            ax.scatter(row["saved_state_mib"], row["ttft_ms"], s=30)
            ax.annotate(row["variant"], (row["saved_state_mib"], row["ttft_ms"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
        ax.set_title(f"{workload} workload")
        ax.set_xlabel("saved-state memory (MiB, target + drafter)")
        ax.set_ylabel("mean time to first token (ms)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    save_png(fig, path)


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=None, help="fresh-engine runs per variant (median wall)")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    set_clock(args.clock)
    import hybridspec as hs
    from hybridspec.adapters.embedded import embedded_paths

    target_dir, draft_dir = embedded_paths()
    target, draft = hs.load(target_dir), hs.load(draft_dir)
    if args.quick:
        sizes = dict(turns=3, system=96, message=24, questions=3, doc=200, question=16, new=4)
    else:
        sizes = dict(turns=8, system=384, message=80, questions=8, doc=1500, question=48, new=24)
    repeats = args.repeats or (1 if args.quick else 2)
    params = hs.SamplingParams(max_new_tokens=sizes["new"], ignore_eos=True)
    system, messages = chat_messages(sizes["turns"], sizes["system"], sizes["message"])
    questions = document_prompts(sizes["questions"], sizes["doc"], sizes["question"])
    clock = lambda: common.clock()  # noqa: E731 (--clock: wall or this process's CPU seconds)
    workloads = {"chat": lambda e, p: run_chat(e, p, system, messages, clock),
                 "document": lambda e, p: run_document(e, p, questions, clock)}
    hs.Engine(target, draft=draft).generate([questions[0][:64]], params)  # warm-up
    rows = []
    for workload, run in workloads.items():
        baseline = None
        for name, settings in variants().items():
            row = measure(target, draft, settings, run, params, repeats, clock)
            outputs = row.pop("outputs")
            baseline = outputs if baseline is None else baseline
            rows.append(dict(workload=workload, variant=name, equal_to_off=outputs == baseline, **row))
            print(f"{workload:8s} {name:9s} ttft {row['ttft_ms']:7.1f} ms  computed {row['computed']:6d}/"
                  f"{row['prompt_tokens']}  hit rate {row['hit_rate']:.3f}", flush=True)
    columns = ["workload", "variant", ("ttft_ms", "TTFT ms"), ("later_ttft_ms", "TTFT ms (2nd+)"),
               ("computed", "prefill computed"), ("prompt_tokens", "prompt tokens"), ("replayed", "replayed"),
               ("hit_rate", "hit rate"), ("prefill_saved", "prefill saved"), ("saved_state_hits", "state hits"), ("saved_state_mib", "state MiB"),
               ("tok_s", "tok/s"), ("equal_to_off", "= off")]
    print_table(rows, columns, title=f"prefix cache, embedded pair, γ=4, greedy, {args.clock} clock "
                                     f"({describe_machine()})")
    out = args.out or Path("prefix_cache.json")
    write_json(out, {"sizes": sizes, "repeats": repeats, "grid": GRID, "clock": args.clock, "rows": rows})
    plot(rows, Path(out).with_suffix(".png"))
    return 0 if all(r["equal_to_off"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
