"""End to end: speculative against plain decoding tokens/s, with HF `generate` on the same weights.

Workloads (greedy, so all three must produce the same tokens):
- embedded pair, model drafter: the shipped byte-level target and draft
  (`hybridspec.adapters.embedded`), prompts cut from the Python standard library files
  that `tools/train_embedded.py` holds out of training;
- embedded target, n-gram drafter (prompt lookup), same prompts;
- a larger random Bamba pair with controlled acceptance: the draft is the
  target's first `--draft-layers` layers (with its embedding, final norm and
  LM head); the target's later layers have their output projections (Mamba
  out_proj, attention o_proj, MLP down_proj) scaled by λ, so λ = 0 makes the
  draft exact (α = 1) and larger λ lowers acceptance; the target still runs
  every layer.

Per workload the three implementations alternate call by call (one warm-up,
median of `--repeats`); tokens/s counts new tokens over wall seconds of whole
generate calls (prefill included). A second table explains the speedup from
the engine's phase timers: c = draft seconds per round / (γ · plain step),
verification cost = (verify + accept + commit) seconds per round / plain step,
and the speedup `hs.sim.speedup` predicts from those and the measured α.

    python benches/e2e.py            # the measurement (many minutes)
    python benches/e2e.py --quick    # a smoke run
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import common
from common import bench_parser, describe_machine, print_table, save_png, set_threads, side_by_side, write_json
from plain_decode import build_bamba, first_mismatch, hf_greedy

REPO = Path(__file__).resolve().parent.parent
RANDOM_PAIR = dict(hidden_size=512, num_hidden_layers=12, attn_layer_indices=[1, 7], intermediate_size=1536,
                   num_attention_heads=8, num_key_value_heads=4, mamba_n_heads=16, mamba_d_head=64,
                   mamba_d_state=64, vocab_size=8192)
RANDOM_PAIR_QUICK = dict(hidden_size=64, num_hidden_layers=4, attn_layer_indices=[1], intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=32,
                         mamba_d_state=16, vocab_size=512)
OUTPUT_PROJECTIONS = ("mamba.out_proj.weight", "self_attn.o_proj.weight", "feed_forward.down_proj.weight")


@dataclass
class Workload:
    name: str
    drafter: str
    target: object  # hs.HybridModel
    draft: object  # hs.HybridModel or hs.NgramDrafter
    hf: object | None  # the target as an HF model, for the third column
    prompts: list[list[int]]


# -- prompts ----------------------------------------------------------------------------------

def heldout_prompts(num_prompts: int, prompt_len: int) -> list[list[int]]:
    """`prompt_len` bytes from each of the first `num_prompts` long enough held-out
    stdlib files of tools/train_embedded.py, starting at the first top-level def/class."""
    spec = importlib.util.spec_from_file_location("train_embedded", REPO / "tools" / "train_embedded.py")
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    prompts = []
    for i, path in enumerate(trainer.stdlib_files()):
        if i % trainer.HOLDOUT_EVERY != 0:
            continue
        text = path.read_bytes()
        starts = [s for s in (text.find(b"\ndef "), text.find(b"\nclass ")) if s >= 0]
        start = min(starts) + 1 if starts else 0
        if len(text) - start >= 4 * prompt_len:
            prompts.append(list(text[start:start + prompt_len]))
        if len(prompts) == num_prompts:
            return prompts
    raise RuntimeError(f"only {len(prompts)} held-out files are long enough for {prompt_len}-byte prompts")


# -- workloads --------------------------------------------------------------------------------

def embedded_workloads(args) -> list[Workload]:
    import hybridspec as hs
    from hybridspec.adapters.embedded import embedded_paths
    from transformers import BambaForCausalLM
    target_dir, draft_dir = (args.target, args.draft) if args.target else embedded_paths()
    target = hs.load(target_dir)
    hf = BambaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    prompts = heldout_prompts(args.prompts, args.prompt_len)
    name = "embedded" if not args.target else f"pair {Path(target_dir).name}"
    return [Workload(name, "model", target, hs.load(draft_dir), hf, prompts),
            Workload(name, "ngram", target, hs.NgramDrafter(), hf, prompts)]


def layer_skip_draft(hf_target, draft_layers: int):
    """An HF Bamba made of the target's first `draft_layers` layers, embedding,
    final norm and LM head (copies of the weights)."""
    from transformers import BambaConfig, BambaForCausalLM
    config = hf_target.config.to_dict()
    config.update(num_hidden_layers=draft_layers,
                  attn_layer_indices=[i for i in hf_target.config.attn_layer_indices if i < draft_layers])
    config.pop("layers_block_type", None)
    draft = BambaForCausalLM(BambaConfig(**config)).float().eval()
    missing = draft.load_state_dict(hf_target.state_dict(), strict=False).missing_keys
    if missing:
        raise RuntimeError(f"layer-skip draft: no target weights for {missing}")
    return draft


def scale_later_layers_(hf_target, first_layer: int, scale: float) -> None:
    """Multiply the output projections of layers >= first_layer by `scale` (in place)."""
    with torch.no_grad():
        for name, p in hf_target.named_parameters():
            parts = name.split(".")
            if name.endswith(OUTPUT_PROJECTIONS) and parts[1] == "layers" and int(parts[2]) >= first_layer:
                p.mul_(scale)


def random_pair_workloads(args) -> list[Workload]:
    import hybridspec as hs
    shape = RANDOM_PAIR_QUICK if args.quick else RANDOM_PAIR
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(1, shape["vocab_size"], (args.prompts, args.random_prompt_len), generator=g).tolist()
    workloads = []
    for scale in args.scales:
        hf = build_bamba(shape, seed=3)
        draft = layer_skip_draft(hf, args.draft_layers)
        scale_later_layers_(hf, args.draft_layers, scale)
        target = hs.from_hf(hf).pack_for_cpu()  # input-major copies, as hs.load gives on CPU; hf keeps its own
        name = f"random {target.num_parameters() / 1e6:.3g}M, lambda={scale:g}"
        workloads.append(Workload(name, f"layers 0-{args.draft_layers - 1}", target,
                                  hs.from_hf(draft).pack_for_cpu(), hf, prompts))
    return workloads


# -- measurement ------------------------------------------------------------------------------

def run_batches(engine_or_hf, prompts, batch: int, new_tokens: int) -> list[list[int]]:
    import hybridspec as hs
    tokens = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        if isinstance(engine_or_hf, hs.Engine):
            outs = engine_or_hf.generate(chunk, hs.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
            tokens += [o.token_ids for o in outs]
        else:
            tokens += hf_greedy(engine_or_hf, chunk, new_tokens)
    return tokens


def measure(w: Workload, args) -> dict:
    import hybridspec as hs
    sizes = dict(max_batch_size=args.batch, max_model_len=max(map(len, w.prompts)) + args.new_tokens + args.gamma + 1)
    spec = hs.Engine(w.target, draft=w.draft, num_draft_tokens=args.gamma, checkpoint=args.policy, **sizes)
    plain = hs.Engine(w.target, **sizes)
    results, engine_calls = {}, {"spec": [], "plain": []}

    def call(name, runner):
        def fn():
            if isinstance(runner, hs.Engine):
                runner.total_stats.reset()  # `stats` holds the last generate only; run_batches makes several
            start = common.clock()
            results[name] = run_batches(runner, w.prompts, args.batch, args.new_tokens)
            if isinstance(runner, hs.Engine):
                engine_calls[name].append((common.clock() - start, runner.total_stats.as_dict()))
        return fn

    fns = {"spec": call("spec", spec), "plain": call("plain", plain)}
    if w.hf is not None:
        fns["hf"] = call("hf", w.hf)
    seconds = side_by_side(fns, repeats=args.repeats)
    # the phase timers of the timed call with the median wall time, with that call's wall time
    median_call = {name: sorted(calls[-args.repeats:], key=lambda c: c[0])[(args.repeats - 1) // 2]
                   for name, calls in engine_calls.items()}
    stats = {name: stats for name, (_, stats) in median_call.items()}
    total = len(w.prompts) * args.new_tokens
    tps = {name: total / s for name, s in seconds.items()}
    row = dict(workload=w.name, drafter=w.drafter, gamma=args.gamma, batch=args.batch,
               acceptance_rate=stats["spec"]["acceptance_rate"], tokens_per_round=stats["spec"]["tokens_per_round"],
               spec_tok_s=tps["spec"], plain_tok_s=tps["plain"], hf_tok_s=tps.get("hf"),
               speedup=tps["spec"] / tps["plain"], spec_vs_hf=tps["spec"] / tps["hf"] if "hf" in tps else None,
               spec_equals_plain=first_mismatch(results["spec"], results["plain"]) is None,
               plain_equals_hf=first_mismatch(results["plain"], results["hf"]) is None if "hf" in results else None,
               spec_stats=stats["spec"], plain_stats=stats["plain"], seconds=seconds,
               call_seconds={name: wall for name, (wall, _) in median_call.items()})
    row.update(explain(row, args.gamma, len(w.prompts)))
    return row


def explain(row: dict, gamma: int, num_prompts: int) -> dict:
    """c, verification cost and the predicted speedup from the phase timers; the
    measured speedup of the decode phases alone; and the time per prompt spent
    outside the phases (prefill of the target, and of the draft model)."""
    import hybridspec as hs
    spec, plain = row["spec_stats"], row["plain_stats"]
    phases = {name: sum(row[f"{name}_stats"]["seconds"].values()) for name in ("spec", "plain")}
    # tokens emitted by rounds / decode steps: all but the one each prefill emits
    per_token = {name: phases[name] / max(row[f"{name}_stats"]["emitted_tokens"] - num_prompts, 1)
                 for name in ("spec", "plain")}
    outside = {name: (row["call_seconds"][name] - phases[name]) / num_prompts for name in ("spec", "plain")}
    plain_step = (plain["seconds"]["verify"] + plain["seconds"]["sampling"]) / max(plain["rounds"], 1)
    rounds = max(spec["rounds"], 1)
    draft_round = spec["seconds"]["draft"] / rounds
    verify_round = (spec["seconds"]["verify"] + spec["seconds"]["sampling"] + spec["seconds"]["commit"]) / rounds
    c, verify_cost = draft_round / (gamma * plain_step), verify_round / plain_step
    alpha = hs.sim.alpha_from_acceptance_rate(min(max(row["acceptance_rate"], 0.0), 1.0), gamma)
    return dict(plain_step_ms=plain_step * 1e3, draft_round_ms=draft_round * 1e3,
                verify_round_ms=verify_round * 1e3, c=c, verify_cost=verify_cost, alpha=round(alpha, 4),
                predicted_speedup=hs.sim.speedup(alpha, gamma, c, verify_cost) if row["drafter"] != "ngram" else None,
                decode_speedup=per_token["plain"] / per_token["spec"],
                spec_outside_ms=outside["spec"] * 1e3, plain_outside_ms=outside["plain"] * 1e3)


# -- output -----------------------------------------------------------------------------------

def plot(rows: list[dict], path: Path, title: str = "Speculative decoding speedup per workload") -> None:
    """Speedup of speculative decoding over plain decoding and over HF generate,
    one horizontal pair of bars per workload (labels on one line each, never overlapping)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['workload']} · {r['drafter']} drafter · acceptance {r['acceptance_rate']:.2f}" for r in rows]
    fig, ax = plt.subplots(figsize=(8.0, 0.9 + 0.45 * len(rows)))
    height = 0.38
    for k, (key, label) in enumerate([("speedup", "over plain decoding (same runtime)"),
                                      ("spec_vs_hf", "over HF generate")]):
        values = [r[key] or 0.0 for r in rows]
        y = [i + (k - 0.5) * height for i in range(len(rows))]
        bars = ax.barh(y, values, height, label=label)
        ax.bar_label(bars, fmt="%.2f×", fontsize=7, padding=2)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speculative tokens/s ÷ baseline tokens/s (1 = no gain)", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.margins(x=0.12)
    ax.legend(fontsize=7, loc="lower right")
    save_png(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--target", help="target model directory instead of the embedded target (byte-level Bamba)")
    parser.add_argument("--draft", help="draft model directory to go with --target")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--policy", default="k1", choices=("k1", "k2", "k0"),
                        help="checkpoint policy: snapshot every k-th verify input (default k1)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=None, help="per prompt (default 128)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per workload (default 4)")
    parser.add_argument("--prompt-len", type=int, default=256, help="bytes per embedded-pair prompt")
    parser.add_argument("--random-prompt-len", type=int, default=32, help="tokens per random-pair prompt")
    parser.add_argument("--scales", type=float, nargs="+", default=None,
                        help="lambda values of the random pair (default 0 0.01 0.03 0.1)")
    parser.add_argument("--draft-layers", type=int, default=2, help="layers of the random pair's draft")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per implementation (default 3)")
    parser.add_argument("--skip", choices=("embedded", "random"), action="append", default=[],
                        help="leave out a group of workloads")
    args = parser.parse_args(argv)
    import hybridspec as hs
    if (args.target is None) != (args.draft is None):
        parser.error("--target and --draft go together")
    args.new_tokens = args.new_tokens or (8 if args.quick else 128)
    args.prompts = args.prompts or (1 if args.quick else 4)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.scales = args.scales or ([0.03] if args.quick else [0.0, 0.01, 0.03, 0.1])
    if args.quick:
        args.prompt_len = min(args.prompt_len, 48)
        args.random_prompt_len = min(args.random_prompt_len, 8)
    args.policy = hs.CheckpointPolicy(snapshot_every=int(args.policy[1:]))
    threads = set_threads(args.threads)
    common.set_clock(args.clock)
    print(describe_machine(), flush=True)

    workloads = []
    if "embedded" not in args.skip:
        workloads += embedded_workloads(args)
    if "random" not in args.skip:
        workloads += random_pair_workloads(args)
    rows = []
    for w in workloads:
        rows.append(measure(w, args))
        r = rows[-1]
        print(f"{w.name}, {w.drafter} drafter: speculative {r['spec_tok_s']:.1f} tok/s, plain "
              f"{r['plain_tok_s']:.1f}, HF {r['hf_tok_s'] or 0:.1f}; acceptance {r['acceptance_rate']:.3f}", flush=True)

    caption = (f"greedy, batch {args.batch}, gamma {args.gamma}, policy k{args.policy.snapshot_every}, "
               f"{args.prompts} prompts x {args.new_tokens} new tokens, {threads} thread(s), "
               f"median of {args.repeats}, {args.clock} clock")
    print_table(rows, [("workload", "workload"), ("drafter", "drafter"), ("acceptance_rate", "accept"),
                       ("tokens_per_round", "tok/round"), ("spec_tok_s", "spec tok/s"), ("plain_tok_s", "plain tok/s"),
                       ("hf_tok_s", "HF tok/s"), ("speedup", "spec/plain"), ("spec_vs_hf", "spec/HF"),
                       ("spec_equals_plain", "spec=plain"), ("plain_equals_hf", "plain=HF")], title=caption)
    print_table(rows, [("workload", "workload"), ("drafter", "drafter"), ("plain_step_ms", "plain step ms"),
                       ("draft_round_ms", "draft ms/round"), ("verify_round_ms", "verify ms/round"), ("c", "c"),
                       ("verify_cost", "verify cost"), ("alpha", "alpha"), ("predicted_speedup", "predicted"),
                       ("decode_speedup", "decode"), ("speedup", "end to end"), ("spec_outside_ms", "spec prefill ms"),
                       ("plain_outside_ms", "plain prefill ms")],
                title="why: c = draft per round / (gamma * plain step); verify cost = verify+accept+commit per round "
                      "/ plain step; predicted = hs.sim.speedup(alpha, gamma, c, verify cost); decode = measured "
                      "speedup of the round/step phases alone; prefill ms = time outside them per prompt")
    out = args.out or Path("e2e.json")
    write_json(out, dict(bench="e2e", quick=args.quick, caption=caption, gamma=args.gamma, batch=args.batch,
                         policy=args.policy.snapshot_every, new_tokens=args.new_tokens, prompts=args.prompts,
                         repeats=args.repeats, threads=threads, random_pair=RANDOM_PAIR_QUICK if args.quick
                         else RANDOM_PAIR, draft_layers=args.draft_layers, rows=rows))
    plot(rows, Path(out).with_suffix(".png") if args.out else "e2e.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
