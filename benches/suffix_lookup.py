"""Per-round proposal cost of NgramDrafter vs SuffixDrafter by context length, and their acceptance.

Cost: one sequence whose context is CONTEXT random byte-valued tokens; each
round commits 3 more tokens (untimed), then each drafter proposes γ = 4 for
it, the two alternating which goes first; a suffix round includes taking the
3 new tokens into its trie. The suffix drafter's one-off build of its trie
over the starting context (what `start` does at admission) is reported apart.

Acceptance: greedy generation with the embedded target and each drafter at
γ = 4 on prompts that repeat a block of Python (what prompt lookup and
suffix decoding are for); the suffix drafter runs the prompts twice on one
Engine, the second time with the first pass's outputs in its global trie.

    python benches/suffix_lookup.py            # 1k, 8k, 32k tokens; 30 rounds each
    python benches/suffix_lookup.py --quick    # a smoke run
"""
from __future__ import annotations

import random
import statistics
from types import SimpleNamespace

import common
from common import bench_parser, describe_machine, print_table, set_clock, set_threads, write_json

GAMMA = 4
COMMITTED_PER_ROUND = 3
SNIPPET = ("def total(items):\n    result = 0\n    for item in items:\n        result += item.price * item.count\n"
           "    return result\n\n")


def fake_request(prompt: list[int]):
    """What a drafter reads of an engine Request."""
    output = SimpleNamespace(prompt_token_ids=prompt, token_ids=[], finish_reason=None)
    return SimpleNamespace(seq_id=0, output=output, finished=False, last_token=prompt[-1])


def lookup_costs(context: int, rounds: int, seed: int = 0) -> dict:
    """Per-round propose seconds of both drafters at `context` tokens (see the module docstring)."""
    import hybridspec as hs
    rng = random.Random(seed)
    request = fake_request([rng.randrange(256) for _ in range(context)])
    ngram, suffix = hs.NgramDrafter(), hs.SuffixDrafter()
    start = common.clock()
    suffix.start([request])
    build = common.clock() - start
    drafters = {"ngram": ngram, "suffix": suffix}
    samples = {name: [] for name in drafters}
    for i in range(rounds):
        request.output.token_ids += [rng.randrange(256) for _ in range(COMMITTED_PER_ROUND)]
        for name in (("ngram", "suffix") if i % 2 == 0 else ("suffix", "ngram")):
            start = common.clock()
            drafters[name].propose([request], [GAMMA], None, [False])
            samples[name].append(common.clock() - start)
    row = {"context": context, "rounds": rounds, "suffix_build_ms": build * 1e3,
           "trie_nodes": suffix.sequences[0].trie.num_nodes}
    for name, seconds in samples.items():
        ms = [s * 1e3 for s in seconds]
        row[f"{name}_ms"], row[f"{name}_min_ms"], row[f"{name}_max_ms"] = statistics.median(ms), min(ms), max(ms)
    row["ngram_over_suffix"] = row["ngram_ms"] / row["suffix_ms"]
    return row


def acceptance_rows(max_new_tokens: int, num_prompts: int) -> list[dict]:
    """Acceptance and tokens per round of each drafter with the embedded target (greedy, γ = 4)."""
    import hybridspec as hs
    target = hs.load(hs.embedded_paths()[0])
    prompts = [list((SNIPPET * (2 + i % 2) + SNIPPET[:20 + 7 * i]).encode()) for i in range(num_prompts)]
    params = hs.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    runs = [("ngram", hs.NgramDrafter(), 1), ("suffix", hs.SuffixDrafter(), 2)]
    rows, reference = [], None
    for name, drafter, passes in runs:
        engine = hs.Engine(target, draft=drafter, num_draft_tokens=GAMMA, max_batch_size=num_prompts)
        for p in range(passes):
            tokens = [o.token_ids for o in engine.generate(prompts, params)]
            reference = reference or tokens
            s = engine.stats
            rows.append({"drafter": name if p == 0 else f"{name} (2nd pass, global trie)",
                         "acceptance": s.acceptance_rate,
                         "drafted_per_round": s.drafted_tokens / s.sequence_rounds,
                         "tokens_per_round": s.emitted_tokens / s.sequence_rounds,
                         "draft_ms_per_round": s.seconds.get("draft", 0.0) * 1e3 / s.rounds,
                         "same_tokens": tokens == reference})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="context lengths in tokens (default 1024 8192 32768; --quick: 256 1024)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per context (default 30)")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    set_clock(args.clock)
    contexts = args.contexts or ([256, 1024] if args.quick else [1024, 8192, 32768])
    rounds = args.rounds or (3 if args.quick else 30)
    cost = [lookup_costs(c, rounds) for c in contexts]
    print_table(cost, ["context", ("ngram_ms", "ngram ms"), ("ngram_min_ms", "min"), ("ngram_max_ms", "max"),
                       ("suffix_ms", "suffix ms"), ("suffix_min_ms", "min"), ("suffix_max_ms", "max"),
                       ("ngram_over_suffix", "ngram/suffix"), ("suffix_build_ms", "suffix build ms"),
                       ("trie_nodes", "trie nodes")],
                title=f"per-round propose cost, γ={GAMMA}, median of {rounds} rounds ({describe_machine()})")
    accept = acceptance_rows(16 if args.quick else 96, 2 if args.quick else 4)
    print_table(accept, ["drafter", "acceptance", ("drafted_per_round", "drafted/round"),
                         ("tokens_per_round", "tokens/round"), ("draft_ms_per_round", "draft ms/round"),
                         ("same_tokens", "same tokens")],
                title="embedded target, greedy, γ=4, repetitive Python prompts")
    write_json(args.out or "suffix_lookup.json", {"gamma": GAMMA, "cost": cost, "acceptance": accept})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
