"""Tree drafts against chains at equal verify inputs on the embedded pair: tokens per round, tok/s.

Target and drafter: the embedded pair (`hs.embedded_paths()`, the Engine's
defaults otherwise), greedy. Drafters that branch: the draft model, suffix
decoding, prompt lookup (ngram), the MTP layer and the EAGLE-3 head (each
tried with a tree and skipped with the Engine's own note where it does not
branch or its weights are missing). Workloads: benches/drafters.py's code and
prose prompts (cuts of the standard-library files tools/train_embedded.py
holds out of training).

Variants per batch B (B prompts in one `generate` call, max_batch_size = B):
chains of γ ∈ CHAIN_GAMMAS drafts (`--chains`), trees `TreeShape(w)` of γ
nodes for (γ, w) in TREES: a tree of γ nodes verifies γ + 1 inputs, as the
chain of γ does (equal verify budget); and "auto", the engine's own choice
(`num_draft_tokens="auto"`, `max_draft_tokens=AUTO_MAX`, `tree="auto"`:
γ, and chain or tree, per round; `spec.tree_auto`), its picks counted over the
timed calls. Each Engine is built and warmed up once; then the variants
alternate call by call (their order rotating each pass) for `--repeats`
passes of new prompts. tok/s: new tokens over the call's wall seconds,
median of the passes with min–max; tokens per round and the verify forward's
ms per round are summed over the timed calls; every variant's tokens are
checked equal to the first chain's. The JSON is written after each batch, so
a long run cut short keeps what it measured.

Per (workload, batch) the summary compares, for each budget γ, the best tree
of γ nodes with the chain of γ (tokens per round) and with the best chain of
at most γ drafts (tok/s), and asks `spec.shape_choice.choose` for its pick:
tokens per round predicted by the closed forms (α from the γ chain's
measured acceptance, the rescue rate β assumed: `costs.tree_form`), round
seconds as measured. A second summary sets the auto engine beside the
fastest fixed chain and tree. Targets (reported met or missed, never
asserted): at batch 1 the best tree ≥ 1.15× the chain's tokens per round and
≥ 1.1× its tok/s; the pick never a tree whose tok/s range lies wholly below
the best chain's; the auto engine never losing so while most of its rounds
were trees.

    python benches/tree.py                       # batches 1 4 16 32, code and prose, every drafter
    python benches/tree.py --batches 1 4         # a subset
    python benches/tree.py --drafters suffix ngram --chains 2 4 6
    python benches/tree.py --quick               # a smoke run: batch 1, one code prompt, three variants
"""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from common import bench_parser, describe_machine, print_table, write_json
from drafters import add_pass_arguments, parsed_pass_arguments, target_and_pools, timed_passes

CHAIN_GAMMAS = (2, 3, 4, 6)
AUTO, AUTO_MAX = "auto", 6  # the engine's own choice, γ up to the grid's largest
TREES = ((4, (2,)), (6, (2,)), (6, (2, 2)), (6, (3,)))  # (γ nodes, widths)
WORKLOADS = ("code", "prose")
TARGET_TOKENS, TARGET_SPEED = 1.15, 1.1  # batch 1: best tree over the chain, tokens per round and tok/s


@dataclass
class Variant:
    """One Engine configuration and what its timed calls gave."""

    gamma: int | str  # "auto": the engine's own choice (num_draft_tokens="auto", tree="auto")
    widths: tuple[int, ...] | str | None  # None: a chain; "auto" with gamma "auto"
    engine: object
    seconds: dict[str, list[float]] = field(default_factory=dict)  # workload -> per-pass seconds
    stats: dict[str, object] = field(default_factory=dict)  # workload -> summed EngineStats
    same: dict[str, bool] = field(default_factory=dict)  # workload -> tokens equal the first chain's
    picks: dict[str, Counter] = field(default_factory=dict)  # workload -> the auto engine's picks, timed calls

    @property
    def name(self) -> str:
        if self.gamma == AUTO:
            return AUTO
        return f"chain γ={self.gamma}" if self.widths is None else \
            f"tree {','.join(map(str, self.widths))} γ={self.gamma}"


def branching_drafters() -> tuple[dict[str, str], list[str]]:
    """(drafter name -> Engine draft argument) for the drafters an Engine lets branch; a note per other one."""
    import hybridspec as hs
    from hybridspec.errors import ConfigError
    target_dir, draft_dir = hs.embedded_paths()
    eagle = target_dir.parent / "eagle3"
    tried = {"draft model": str(draft_dir), "suffix": "suffix", "ngram": "ngram", "mtp": "mtp"}
    if eagle.is_dir():
        tried["eagle3"] = f"eagle3:{eagle}"
    target = hs.load(target_dir)
    out, notes = {}, []
    for name, arg in tried.items():
        try:
            hs.Engine(target, draft=arg, num_draft_tokens=2, tree=hs.TreeShape((2,)), max_batch_size=1,
                      max_model_len=64)
            out[name] = arg
        except ConfigError as error:
            notes.append(f"{name}: skipped, it does not branch yet ({error})")
    return out, notes


def build_variants(target, draft: str, grid: list[tuple[int, tuple | None]], batch: int, max_len: int):
    import hybridspec as hs
    sizes = dict(max_batch_size=batch, max_model_len=max_len)

    def engine(gamma, widths):
        if gamma == AUTO:
            return hs.Engine(target, draft=draft, num_draft_tokens=AUTO, max_draft_tokens=AUTO_MAX, tree=AUTO,
                             **sizes)
        return hs.Engine(target, draft=draft, num_draft_tokens=gamma,
                         tree=None if widths is None else hs.TreeShape(widths), **sizes)
    return [Variant(g, w, engine(g, w)) for g, w in grid]


def run_batch(target, draft, grid, prompts: dict[str, list[list[int]]], batch: int, args) -> list[Variant]:
    """Build every variant at `batch`, warm each up, then time the interleaved passes."""
    import hybridspec as hs
    params = hs.SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    max_len = max(len(p) for pool in prompts.values() for p in pool) + args.new_tokens + 8
    variants = build_variants(target, draft, grid, batch, max_len)
    timed_passes(variants, prompts, batch, params, args.repeats, around=count_picks)
    return variants


def count_picks(v: Variant):
    """The shapes `tree="auto"` picks during one run, added to `v.picks[workload]` after it."""
    auto = getattr(v.engine, "tree_auto", None)
    if auto is None:
        return None
    before = Counter(auto.picks)
    return lambda workload: v.picks.setdefault(workload, Counter()).update(auto.picks - before)


def row(v: Variant, drafter: str, workload: str, batch: int, new_tokens: int) -> dict:
    seconds, stats = v.seconds[workload], v.stats[workload]
    tok_s = [batch * new_tokens / s for s in seconds]
    rounds = max(stats.rounds, 1)
    return {"drafter": drafter, "workload": workload, "batch": batch, "variant": v.name, "gamma": v.gamma,
            "widths": v.widths, "acceptance": stats.acceptance_rate, "tokens_per_round": stats.tokens_per_round,
            "tok_s": statistics.median(tok_s), "tok_s_min": min(tok_s), "tok_s_max": max(tok_s),
            "round_ms": sum(seconds) * 1e3 / rounds, "verify_ms_per_round": stats.seconds["verify"] * 1e3 / rounds,
            "draft_ms_per_round": stats.seconds["draft"] * 1e3 / rounds, "rounds": stats.rounds,
            "passes": len(seconds), "same_tokens": v.same[workload],
            "picks": dict(v.picks.get(workload, {}))}


def auto_pick(rows: list[dict], budget: int):
    """`shape_choice.choose` over the rows of at most `budget` verify nodes: closed-form tokens
    (α from the γ = budget chain's acceptance, β assumed), measured round seconds."""
    import hybridspec as hs
    from hybridspec.costs.closed_form import alpha_from_acceptance_rate, expected_tokens
    from hybridspec.costs.tree_form import DEFAULT_RESCUE, tree_expected_tokens
    from hybridspec.spec.shape_choice import Candidate, choose, tree_widths
    chain = next(r for r in rows if r["widths"] is None and r["gamma"] == budget)
    alpha = alpha_from_acceptance_rate(min(max(chain["acceptance"], 0.0), 1.0), budget)
    options = []
    for r in rows:
        if r["gamma"] == AUTO or r["gamma"] > budget:
            continue
        tree = None if r["widths"] is None else hs.TreeShape(tuple(r["widths"]))
        tokens = expected_tokens(alpha, r["gamma"]) if tree is None else \
            tree_expected_tokens(alpha, tree_widths(tree, r["gamma"]), DEFAULT_RESCUE)
        options.append((Candidate(r["gamma"], tree, tokens, r["round_ms"] / r["batch"]), r))
    pick = choose([c for c, _ in options])
    return next(r for c, r in options if c is pick), alpha


def summary(rows: list[dict]) -> list[dict]:
    """Per (drafter, workload, batch, budget): the best tree against the chains, and the pick."""
    out = []
    groups = sorted({(r["drafter"], r["workload"], r["batch"]) for r in rows})
    for drafter, workload, batch in groups:
        here = [r for r in rows if (r["drafter"], r["workload"], r["batch"]) == (drafter, workload, batch)
                and r["gamma"] != AUTO]
        for budget in sorted({r["gamma"] for r in here if r["widths"] is not None}):
            trees = [r for r in here if r["widths"] is not None and r["gamma"] == budget]
            chain = next((r for r in here if r["widths"] is None and r["gamma"] == budget), None)
            if chain is None:
                continue
            fast = max((r for r in here if r["widths"] is None and r["gamma"] <= budget), key=lambda r: r["tok_s"])
            deep, quick = max(trees, key=lambda r: r["tokens_per_round"]), max(trees, key=lambda r: r["tok_s"])
            pick, alpha = auto_pick(here, budget)
            loses = pick["widths"] is not None and pick["tok_s_max"] < fast["tok_s_min"]
            out.append({"drafter": drafter, "workload": workload, "batch": batch, "budget": budget,
                        "alpha": alpha, "chain_tpr": chain["tokens_per_round"], "tree": deep["variant"],
                        "tree_tpr": deep["tokens_per_round"],
                        "tpr_ratio": deep["tokens_per_round"] / chain["tokens_per_round"],
                        "best_chain": fast["variant"], "chain_tok_s": fast["tok_s"], "fast_tree": quick["variant"],
                        "tree_tok_s": quick["tok_s"], "tok_s_ratio": quick["tok_s"] / fast["tok_s"],
                        "auto": pick["variant"], "auto_loses": loses})
    return out


def auto_summary(rows: list[dict]) -> list[dict]:
    """Per (drafter, workload, batch): the engine's own choice against the fastest fixed chain
    and tree. It loses where it chose trees in most rounds and its tok/s range lies wholly
    below the fastest chain's."""
    out = []
    for r in rows:
        if r["gamma"] != AUTO:
            continue
        here = [x for x in rows if (x["drafter"], x["workload"], x["batch"]) == (r["drafter"], r["workload"], r["batch"])]
        chain = max((x for x in here if x["widths"] is None), key=lambda x: x["tok_s"])
        tree = max((x for x in here if x["widths"] not in (None, AUTO)), key=lambda x: x["tok_s"])
        picks = r["picks"]
        trees = sum(n for name, n in picks.items() if name.startswith("tree"))
        share = trees / max(sum(picks.values()), 1)
        top = max(picks, key=picks.get) if picks else "plain steps"
        out.append({"drafter": r["drafter"], "workload": r["workload"], "batch": r["batch"],
                    "best_chain": chain["variant"], "chain_tok_s": chain["tok_s"], "fast_tree": tree["variant"],
                    "tree_tok_s": tree["tok_s"], "auto_tok_s": r["tok_s"], "auto_tpr": r["tokens_per_round"],
                    "auto_ratio": r["tok_s"] / chain["tok_s"], "tree_share": share, "top_pick": top,
                    "loses": share > 0.5 and r["tok_s_max"] < chain["tok_s_min"]})
    return out


def targets(summaries: list[dict], autos: list[dict] = ()) -> list[dict]:
    """The targets of the module docstring, met or missed, per drafter and workload."""
    out = []
    for drafter, workload in sorted({(s["drafter"], s["workload"]) for s in summaries}):
        here = [s for s in summaries if (s["drafter"], s["workload"]) == (drafter, workload)]
        at_one = [s for s in here if s["batch"] == 1]
        if at_one:
            tpr, speed = max(s["tpr_ratio"] for s in at_one), max(s["tok_s_ratio"] for s in at_one)
            out.append({"drafter": drafter, "workload": workload, "target": f"batch 1 tree/chain tok/round ≥ "
                        f"{TARGET_TOKENS}", "figure": tpr, "met": tpr >= TARGET_TOKENS})
            out.append({"drafter": drafter, "workload": workload, "target": f"batch 1 tree/chain tok/s ≥ "
                        f"{TARGET_SPEED}", "figure": speed, "met": speed >= TARGET_SPEED})
        losing = sum(s["auto_loses"] for s in here)
        out.append({"drafter": drafter, "workload": workload, "target": "shape_choice never picks a losing tree",
                    "figure": losing, "met": losing == 0})
        engine = [a for a in autos if (a["drafter"], a["workload"]) == (drafter, workload)]
        if engine:
            losing = sum(a["loses"] for a in engine)
            out.append({"drafter": drafter, "workload": workload, "target": "tree='auto' never loses by its trees",
                        "figure": losing, "met": losing == 0})
    return out


COLUMNS = ["workload", "batch", "variant", "acceptance", ("tokens_per_round", "tok/round"), ("tok_s", "tok/s"),
           ("tok_s_min", "min"), ("tok_s_max", "max"), ("round_ms", "round ms"),
           ("verify_ms_per_round", "verify ms/round"), ("draft_ms_per_round", "draft ms/round"),
           ("same_tokens", "same")]
SUMMARY = ["workload", "batch", "budget", "alpha", ("chain_tpr", "chain tok/round"), "tree",
           ("tree_tpr", "tree tok/round"), ("tpr_ratio", "ratio"), "best_chain", ("chain_tok_s", "tok/s"),
           "fast_tree", ("tree_tok_s", "tok/s"), ("tok_s_ratio", "ratio"), "auto", ("auto_loses", "auto loses")]


AUTO_SUMMARY = ["workload", "batch", "best_chain", ("chain_tok_s", "tok/s"), "fast_tree", ("tree_tok_s", "tok/s"),
                ("auto_tok_s", "auto tok/s"), ("auto_tpr", "auto tok/round"), ("auto_ratio", "auto/chain"),
                ("tree_share", "tree rounds"), ("top_pick", "top pick"), "loses"]


def grid(quick: bool, chains=None) -> list[tuple[int, tuple | None]]:
    if quick:
        return [(2, None), (2, (2,)), (AUTO, AUTO)]
    return [(g, None) for g in chains or CHAIN_GAMMAS] + list(TREES) + [(AUTO, AUTO)]


def main(argv: list[str] | None = None) -> int:
    import hybridspec as hs
    parser = bench_parser(__doc__)
    add_pass_arguments(parser)
    parser.add_argument("--drafters", nargs="+", default=None,
                        help="drafters by name (default every one that branches: draft model, suffix, ngram, mtp, "
                             "eagle3)")
    parser.add_argument("--chains", type=int, nargs="+", default=None,
                        help=f"chain γs (default {' '.join(map(str, CHAIN_GAMMAS))})")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=None,
                        help="workloads (default code and prose; --quick: code)")
    args = parsed_pass_arguments(parser, argv)
    workloads = args.workloads or (["code"] if args.quick else list(WORKLOADS))
    draft_args, notes = ({"draft model": str(hs.embedded_paths()[1])}, []) if args.quick else branching_drafters()
    if args.drafters:
        draft_args = {name: arg for name, arg in draft_args.items() if name in args.drafters}
    for note in notes:
        print(note, flush=True)
    target, pools = target_and_pools(workloads, args)
    rows = []
    for drafter, arg in draft_args.items():
        for batch in args.batches:
            variants = run_batch(target, arg, grid(args.quick, args.chains), pools, batch, args)
            rows += [row(v, drafter, w, batch, args.new_tokens) for w in pools for v in variants]
            print_table([r for r in rows if (r["drafter"], r["batch"]) == (drafter, batch)], COLUMNS,
                        title=f"{drafter}, batch {batch}: greedy, {args.new_tokens} new tokens, median of "
                              f"{args.repeats} passes ({describe_machine()})")
            summaries, autos = summary(rows), auto_summary(rows)
            goals = targets(summaries, autos)
            write_json(args.out or "tree.json", {
                "new_tokens": args.new_tokens, "repeats": args.repeats, "batches": args.batches,
                "workloads": workloads, "drafters": draft_args, "notes": notes, "clock": args.clock, "rows": rows,
                "summary": summaries, "auto": autos, "targets": goals})
    for drafter in draft_args:
        print_table([s for s in summaries if s["drafter"] == drafter], SUMMARY,
                    title=f"{drafter}: trees against chains at equal verify inputs (γ = budget)")
        print_table([a for a in autos if a["drafter"] == drafter], AUTO_SUMMARY,
                    title=f"{drafter}: tree='auto' (the engine's own choice) against the fastest fixed shapes")
    print_table(goals, ["drafter", "workload", "target", "figure", "met"], title="targets")
    same = all(r["same_tokens"] for r in rows)
    if not same:
        print("MISMATCH: some variant's tokens differ from the first chain's (see same_tokens)", flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
