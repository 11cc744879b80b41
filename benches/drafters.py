"""Every drafter on the embedded target by batch: acceptance, tokens per round, speedup over plain.

Target: the embedded default (`hs.embedded_paths()`, a byte-level 6-layer
Bamba trained on Python's standard library). Drafters: none (plain), the
embedded draft model, "ngram" (prompt lookup), "suffix" (suffix decoding,
default settings: its global trie keeps earlier requests' outputs), "mtp"
(the target's trained MTP layer) and "eagle3:DIR" when
`hybridspec/assets/embedded/eagle3/` exists (skipped with a note otherwise),
each at a fixed γ (`--gamma`, default 3) and with `num_draft_tokens="auto"`.

Workloads, all from the standard-library files tools/train_embedded.py holds
out of training (its own `stdlib_files` and `HOLDOUT_EVERY`, imported):
- code: PROMPT_LEN-byte cuts of each held-out file, the first at the file's
  start, later ones at its definitions (`def` / `class` lines), taken
  round-robin over the files;
- prose: PROMPT_LEN-byte cuts of each file's docstrings and comments (text
  only, `#` removed), joined by blank lines, round-robin over the files;
- agentic: a tool-call loop whose output repeats earlier output. Per
  SNIPPET_LEN-byte held-out code snippet (cut at a definition), the target's
  own greedy continuation of it (`--new-tokens`, plain decoding) is made
  first; the prompt is then a log of EARLIER_STEPS steps, each an
  `edit(...)` call holding the snippet and that continuation followed by a
  failing `run_tests(...)` call, and a last `edit(...)` call holding the
  snippet alone. The model continues the snippet again, so its output
  repeats spans of its context (earlier output), not word for word: the
  longer context changes some tokens. (A loop that only shows the snippet
  and asks the model to copy it does not work: this small target does not
  copy context it has not itself produced.)

Per batch B (B prompts in one `generate` call, max_batch_size = B, greedy,
`--new-tokens` each) every variant's Engine is built once, warmed up with one
call, then the variants alternate call by call (their order rotating each
repeat) over the workloads for `--repeats` passes. Each pass uses B new
prompts, so no call sees a prompt before (the prefix cache and the suffix
drafter's global trie hold only other prompts' tokens). tokens/s: new tokens
over the call's wall seconds (prefill included); speedup: the median over
passes of the variant's tokens/s over plain's in the same pass (min–max
beside it). Acceptance (accepted / drafted), tokens per round (per
sequence-round, the prefill's token not counted) and the drafter's and the
verify forward's seconds per round (`EngineStats.seconds["draft"]` and
["verify"] over batch rounds) are summed over the timed calls. Every
variant's tokens are checked equal to plain's.

    python benches/drafters.py                    # batches 1 4 16 32 (about 15 minutes on 2 loaded cores)
    python benches/drafters.py --batches 1 4      # a subset
    python benches/drafters.py --quick            # a smoke run: batch 1, one agentic prompt, ngram and suffix
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import io
import statistics
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import common
from common import bench_parser, describe_machine, print_table, set_clock, set_threads, write_json

REPO = Path(__file__).resolve().parent.parent
PROMPT_LEN = 256  # bytes (= tokens) per code and prose prompt
SNIPPET_LEN = 128  # bytes of held-out code each step of the agentic log edits
EARLIER_STEPS = 2  # the agentic log's earlier steps
WORKLOADS = ("code", "prose", "agentic")


def trainer():
    """tools/train_embedded.py as a module: the held-out split is its functions'."""
    spec = importlib.util.spec_from_file_location("train_embedded", REPO / "tools" / "train_embedded.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache  # the trainer's walk scans site-packages too: seconds on a loaded machine
def heldout_files() -> tuple[Path, ...]:
    t = trainer()
    return tuple(path for i, path in enumerate(t.stdlib_files()) if i % t.HOLDOUT_EVERY == 0)


# -- workloads --------------------------------------------------------------------------------

def round_robin(cuts_per_file: list[list[bytes]], count: int, workload: str) -> list[list[int]]:
    """The first `count` cuts taking one from each file in turn, as token lists."""
    out = []
    for k in range(max(map(len, cuts_per_file), default=0)):
        out += [list(cuts[k]) for cuts in cuts_per_file if k < len(cuts)]
    if len(out) < count:
        raise RuntimeError(f"the held-out files give {len(out)} {workload} prompts; {count} are needed "
                           "(ask for fewer --repeats or smaller --batches)")
    return out[:count]


def code_cuts(text: bytes, length: int) -> list[bytes]:
    """`length`-byte cuts starting at the file's start and at each top-level or method definition."""
    starts = [0] + [i + 1 for i in range(len(text)) if text.startswith((b"\ndef ", b"\nclass ", b"\n    def "), i)]
    cuts, end = [], 0
    for s in starts:
        if s >= end and len(text) - s >= length:  # cuts do not overlap
            cuts.append(text[s:s + length])
            end = s + length
    return cuts


def prose_text(text: bytes) -> bytes:
    """The file's docstrings and comments (without `#`), joined by blank lines; b"" where it does not parse."""
    try:
        tree = ast.parse(text)
        comments = [tok.string.lstrip("#").strip() for tok in tokenize.tokenize(io.BytesIO(text).readline)
                    if tok.type == tokenize.COMMENT]
    except (SyntaxError, tokenize.TokenError, UnicodeDecodeError):
        return b""
    docs = [ast.get_docstring(node) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    comment_text = "\n".join(c for c in comments if c and not c.startswith("!"))  # no shebangs
    return "\n\n".join([d for d in docs if d] + ([comment_text] if comment_text else [])).encode()


def agentic_prompts(target, seeds: list[tuple[Path, bytes]], new_tokens: int) -> list[list[int]]:
    """Per (file, code snippet): the target's greedy continuation of the snippet, then a log of
    EARLIER_STEPS edit / failing-test steps each holding the snippet and that continuation, and a
    last edit call holding the snippet, for the model to continue."""
    import hybridspec as hs
    engine = hs.Engine(target, max_batch_size=min(len(seeds), 32))
    params = hs.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    outputs = engine.generate([list(snippet) for _, snippet in seeds], params)
    prompts = []
    for (path, snippet), output in zip(seeds, outputs):
        call = f'\n>>> edit("{path.name}")\n'.encode()
        result = f'\n>>> run_tests("{path.name}")\nFAILED test_{path.stem}: AssertionError'.encode()
        step = call + snippet + bytes(output.token_ids) + result
        prompts.append(list(b"# agent log: tool calls and their results" + step * EARLIER_STEPS + call + snippet))
    return prompts


def workload_prompts(name: str, count: int, target, new_tokens: int) -> list[list[int]]:
    """`count` distinct prompts of workload `name` (see the module docstring)."""
    files = heldout_files()
    if name == "code":
        return round_robin([code_cuts(f.read_bytes(), PROMPT_LEN) for f in files], count, name)
    if name == "prose":
        cuts = []
        for f in files:
            prose = prose_text(f.read_bytes())
            cuts.append([prose[i:i + PROMPT_LEN] for i in range(0, len(prose) - PROMPT_LEN + 1, PROMPT_LEN)])
        return round_robin(cuts, count, name)
    tagged = [[(f, cut) for cut in code_cuts(f.read_bytes(), SNIPPET_LEN)[1:]] for f in files]  # definitions
    order = []
    for k in range(max(map(len, tagged))):
        order += [cuts[k] for cuts in tagged if k < len(cuts)]
    if len(order) < count:
        raise RuntimeError(f"the held-out files give {len(order)} agentic prompts; {count} are needed")
    return agentic_prompts(target, order[:count], new_tokens)


# -- variants ---------------------------------------------------------------------------------

def drafters(quick: bool) -> tuple[dict[str, object], list[str]]:
    """(drafter name -> Engine draft argument, notes)."""
    import hybridspec as hs
    target_dir, draft_dir = hs.embedded_paths()
    if quick:
        return {"ngram": "ngram", "suffix": "suffix"}, []
    out = {"draft model": str(draft_dir), "ngram": "ngram", "suffix": "suffix", "mtp": "mtp"}
    eagle = Path(target_dir).parent / "eagle3"
    notes = []
    if eagle.is_dir():
        out["eagle3"] = f"eagle3:{eagle}"
    else:
        notes.append(f"eagle3: skipped, no head at {eagle}")
    return out, notes


@dataclass
class Variant:
    """One Engine configuration and what its timed calls gave."""

    name: str
    drafter: str
    gamma: object  # an int, "auto", or None (plain)
    engine: object
    seconds: dict[str, list[float]] = field(default_factory=dict)  # workload -> per-pass seconds
    stats: dict[str, object] = field(default_factory=dict)  # workload -> summed EngineStats
    same: dict[str, bool] = field(default_factory=dict)  # workload -> tokens equal plain's in every pass


def build_variants(target, draft_args: dict[str, object], gamma: int, batch: int, max_len: int) -> list[Variant]:
    import hybridspec as hs
    sizes = dict(max_batch_size=batch, max_model_len=max_len)
    out = [Variant("plain", "none", None, hs.Engine(target, **sizes))]
    for name, arg in draft_args.items():
        for g in (gamma, "auto"):
            out.append(Variant(f"{name}, γ={g}", name, g, hs.Engine(target, draft=arg, num_draft_tokens=g, **sizes)))
    return out


def run_batch(target, draft_args, prompts: dict[str, list[list[int]]], batch: int, args) -> list[dict]:
    """Build every variant at `batch`, warm each up, then time the interleaved passes; rows per workload."""
    import hybridspec as hs
    params = hs.SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    max_len = max(len(p) for pool in prompts.values() for p in pool) + args.new_tokens + 8
    variants = build_variants(target, draft_args, args.gamma, batch, max_len)
    timed_passes(variants, prompts, batch, params, args.repeats)
    return [row(v, variants[0], workload, batch, args.new_tokens) for workload in prompts for v in variants]


def timed_passes(variants, prompts: dict[str, list[list[int]]], batch: int, params, repeats: int,
                 around: Callable | None = None) -> None:
    """Warm each variant up, then `repeats` passes over every workload, the variants in an order
    rotated each pass: per variant and workload its seconds, summed stats and whether its tokens
    are the first variant's (`v.seconds`, `v.stats`, `v.same`). `around(v)`, where given, is
    called before each timed run and its result (if any) after it with the workload."""
    from hybridspec.engine.stats import EngineStats
    warm = next(iter(prompts.values()))[:batch]  # pass r uses the prompts after these
    for v in variants:
        v.engine.generate(warm, params)
    for r in range(repeats):
        for workload, pool in prompts.items():
            batch_prompts = pool[(r + 1) * batch:(r + 2) * batch]
            tokens = {}
            shift = r % len(variants)
            for v in variants[shift:] + variants[:shift]:
                after = around(v) if around is not None else None
                start = common.clock()
                outputs = v.engine.generate(batch_prompts, params)
                v.seconds.setdefault(workload, []).append(common.clock() - start)
                if after is not None:
                    after(workload)
                v.stats.setdefault(workload, EngineStats()).add(v.engine.stats)
                tokens[v.name] = [o.token_ids for o in outputs]
            for v in variants:
                v.same[workload] = v.same.get(workload, True) and tokens[v.name] == tokens[variants[0].name]


def row(v: Variant, plain: Variant, workload: str, batch: int, new_tokens: int) -> dict:
    """The table's row of variant `v` on `workload` at `batch`."""
    seconds, stats = v.seconds[workload], v.stats[workload]
    tok_s = [batch * new_tokens / s for s in seconds]
    speedup = [p / s for p, s in zip(plain.seconds[workload], seconds)]  # the same pass's plain call
    rounds = max(stats.rounds, 1)
    drafted_rounds = sum(n for g, n in stats.gamma_counts.items() if g > 0)
    return {"workload": workload, "batch": batch, "variant": v.name, "drafter": v.drafter, "gamma": v.gamma,
            "acceptance": stats.acceptance_rate if v.gamma is not None else None,
            "tokens_per_round": stats.tokens_per_round,
            "mean_gamma": stats.drafted_tokens / drafted_rounds if drafted_rounds else 0.0,
            "drafting_share": drafted_rounds / stats.sequence_rounds if stats.sequence_rounds else 0.0,
            "tok_s": statistics.median(tok_s), "tok_s_min": min(tok_s), "tok_s_max": max(tok_s),
            "speedup": statistics.median(speedup), "speedup_min": min(speedup), "speedup_max": max(speedup),
            "draft_ms_per_round": stats.seconds.get("draft", 0.0) * 1e3 / rounds,
            "verify_ms_per_round": stats.seconds.get("verify", 0.0) * 1e3 / rounds,
            "rounds": stats.rounds, "passes": len(seconds), "same_tokens": v.same[workload]}


# -- main -------------------------------------------------------------------------------------

COLUMNS = ["workload", "batch", "variant", "acceptance", ("tokens_per_round", "tok/round"),
           ("mean_gamma", "mean γ"), ("tok_s", "tok/s"), ("tok_s_min", "min"), ("tok_s_max", "max"),
           "speedup", ("speedup_min", "min"), ("speedup_max", "max"), ("draft_ms_per_round", "draft ms/round"),
           ("verify_ms_per_round", "verify ms/round"), ("same_tokens", "same")]


def add_pass_arguments(parser) -> None:
    """--batches, --repeats and --new-tokens, as this bench and benches/tree.py take them."""
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="batch sizes (default 1 4 16 32; --quick: 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes per variant (default 3; --quick: 1)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens per prompt (default 64; --quick: 8)")


def parsed_pass_arguments(parser, argv: list[str] | None):
    """The parsed arguments with add_pass_arguments' defaults filled in (smaller under --quick), the
    threads and the clock set."""
    args = parser.parse_args(argv)
    set_threads(args.threads)
    set_clock(args.clock)
    args.batches = args.batches or ([1] if args.quick else [1, 4, 16, 32])
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.new_tokens = args.new_tokens or (8 if args.quick else 64)
    return args


def target_and_pools(workloads: list[str], args):
    """The embedded target and, per workload, prompts enough for every batch size's timed and
    warm-up passes (`workload_prompts`)."""
    import hybridspec as hs
    target = hs.load(hs.embedded_paths()[0])
    needed = max(args.batches) * (args.repeats + 1)
    return target, {w: workload_prompts(w, needed, target, args.new_tokens) for w in workloads}


def main(argv: list[str] | None = None) -> int:
    import hybridspec as hs
    parser = bench_parser(__doc__)
    add_pass_arguments(parser)
    parser.add_argument("--gamma", type=int, default=3, help="the fixed γ (default 3)")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=None,
                        help="workloads (default all three; --quick: agentic)")
    args = parsed_pass_arguments(parser, argv)
    workloads = args.workloads or (["agentic"] if args.quick else list(WORKLOADS))
    draft_args, notes = drafters(args.quick)
    for note in notes:
        print(note, flush=True)
    target, pools = target_and_pools(workloads, args)
    rows = []
    for batch in args.batches:
        rows += run_batch(target, draft_args, pools, batch, args)
        print_table([r for r in rows if r["batch"] == batch], COLUMNS,
                    title=f"batch {batch}: greedy, {args.new_tokens} new tokens, median of {args.repeats} passes "
                          f"({describe_machine()})")
    if not all(r["same_tokens"] for r in rows):
        print("MISMATCH: some variant's tokens differ from plain decoding's (see same_tokens)", flush=True)
    write_json(args.out or "drafters.json", {
        "gamma": args.gamma, "new_tokens": args.new_tokens, "repeats": args.repeats, "batches": args.batches,
        "prompt_len": PROMPT_LEN, "snippet_len": SNIPPET_LEN, "drafters": draft_args, "notes": notes,
        "clock": args.clock, "rows": rows})
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
