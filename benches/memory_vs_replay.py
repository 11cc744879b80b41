"""Memory versus replay: what each checkpoint policy costs in checkpoint bytes and in time.

Target: a random float32 `transformers.BambaForCausalLM` with Bamba-9B's
Mamba2 state proportions scaled to a CPU: headdim 64, d_state 128, one group,
expand 2, d_conv 4, one attention layer among eight (Bamba-9B: 3 in 32),
hidden 256 (8 heads), vocabulary 1024. Nothing is downloaded.

Drafter: `ControlledDrafter` proposes the target's own greedy continuation with
each draft replaced by a wrong token with probability 1 − α, independently.
Under greedy verification every draft is then accepted with probability α
(the simulator's i.i.d. model), every policy sees the same rounds, and drafting
costs nothing, so the table isolates the checkpoint costs. (A noisy copy of
the target as drafter would cost a full target step per draft on this CPU and
give an acceptance that varies with the text.) The acceptance each regime
gives is measured and printed.

Policies (γ = 4): k = 1, 2, 4, 0 (input log on); "ring small": k = 1 with 3
ring slots (2 snapshot slots, older boundaries log-replayed); "log off": k = 0
without the log (token replay); "auto" (no budget); "auto@k4": auto with the
budget that k = 4 uses. Per (α, batch, policy): peak checkpoint bytes, seconds
per round by phase (wall, from engine.stats), replayed tokens per round,
tokens/s. Tokens/s divides by the process CPU time of `generate` (one torch
thread; the machine is shared, so wall time also counts waiting for a core);
the wall figure is in the JSON. Side by side: the
verify forward with a snapshot after every input against the same forward
with only the final one, and the restore by snapshot hit (the commit phase of
k = 1, a ring-head move) as a fraction of the round.

    python benches/memory_vs_replay.py            # the measurement (minutes)
    python benches/memory_vs_replay.py --quick    # tiny model, batch 1, seconds
"""
from __future__ import annotations

import sys
import time
from functools import partial

import numpy as np
import torch

import hybridspec as hs
from hybridspec.checkpoints.auto import AutoCheckpointPolicy, expected_round_s
from hybridspec.cache.hybrid_cache import scratch_cache
from hybridspec.costs.checkpoint_costs import COST_FIELDS, CheckpointFootprint
from hybridspec.checkpoints.measure import measure_checkpoint_costs
from hybridspec.cache.state_specs import default_state_dtype
from hybridspec.sim import alpha_from_acceptance_rate
from common import (alternating_samples, bench_parser, describe_machine, print_table, save_png, set_threads,
                    write_json)

FULL = dict(hidden_size=256, num_hidden_layers=8, attn_layer_indices=[4], intermediate_size=768,
            num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=64, mamba_d_state=128,
            vocab_size=1024)
QUICK = dict(hidden_size=64, num_hidden_layers=3, attn_layer_indices=[1], intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
             vocab_size=256)
GAMMA, PROMPT_LEN = 4, 8
POLICY_NAMES = ("k=1", "k=2", "k=4", "k=0", "ring small", "log off", "auto", "auto@k4")


def build_bamba(shape: dict, seed: int = 0):
    """A random float32 BambaForCausalLM (HF init), never downloaded."""
    from transformers import BambaConfig, BambaForCausalLM
    config = BambaConfig(**shape, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
                         max_position_embeddings=4096, tie_word_embeddings=False,
                         pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    return BambaForCausalLM(config).float().eval()


def prompts_for(batch: int, vocab: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(batch, PROMPT_LEN)).tolist()


class ControlledDrafter(hs.NgramDrafter):
    """Proposes each sequence's reference (the target's greedy continuation),
    replacing each draft by a wrong token with probability 1 − α, i.i.d.,
    keyed by (seed, prompt, position, draft index); q is one-hot, as for
    prompt lookup, whose `lookup(context, γ)` it replaces."""

    def __init__(self, references: list[list[int]], alpha: float, vocab: int, seed: int = 0):
        super().__init__()
        self.by_prompt = {tuple(ref[:PROMPT_LEN]): (row, ref) for row, ref in enumerate(references)}
        self.alpha, self.vocab, self.seed = alpha, vocab, seed

    def lookup(self, context: list[int], gamma: int) -> list[int]:
        row, ref = self.by_prompt[tuple(context[:PROMPT_LEN])]
        truth = ref[len(context):len(context) + gamma]
        rng = np.random.default_rng([self.seed, row, len(context)])
        wrong = rng.random(len(truth)) >= self.alpha
        shift = rng.integers(1, self.vocab, size=len(truth))
        return [int((t + s) % self.vocab) if w else int(t) for t, w, s in zip(truth, wrong, shift)]


def policies(target, batch: int, costs) -> dict:
    k4_bytes = CheckpointFootprint.of(target.config, target.dtype, default_state_dtype(target.dtype)).checkpoint_bytes(batch, GAMMA, 4, True)
    return {
        "k=1": hs.CheckpointPolicy(snapshot_every=1, log_inputs=False),
        "k=2": hs.CheckpointPolicy(snapshot_every=2),
        "k=4": hs.CheckpointPolicy(snapshot_every=4),
        "k=0": hs.CheckpointPolicy(snapshot_every=0),
        "ring small": hs.CheckpointPolicy(snapshot_every=1, ring_slots=3),
        "log off": hs.CheckpointPolicy(snapshot_every=0, log_inputs=False),
        "auto": AutoCheckpointPolicy(costs=costs),
        "auto@k4": AutoCheckpointPolicy(memory_budget_bytes=k4_bytes, costs=costs),
    }


def run_workload(target, batch: int, alpha: float, references, num_tokens: int, costs, repeats: int) -> list[dict]:
    """Every policy on one (α, batch), alternating call by call; fastest of `repeats`."""
    prompts = [ref[:PROMPT_LEN] for ref in references]
    params = hs.SamplingParams(max_new_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    engines = {name: hs.Engine(target, draft=ControlledDrafter(references, alpha, target.vocab_size),
                               num_draft_tokens=GAMMA, checkpoint=policy, max_batch_size=batch,
                               max_model_len=PROMPT_LEN + num_tokens + GAMMA + 2)
               for name, policy in policies(target, batch, costs).items()}
    walls, cpus = {name: [] for name in engines}, {name: [] for name in engines}
    phases = {name: [] for name in engines}
    expected = [ref[PROMPT_LEN:PROMPT_LEN + num_tokens] for ref in references]
    matches = dict.fromkeys(engines, True)
    for _ in range(repeats):
        for name, engine in engines.items():
            engine.stats.reset()
            start, cpu = time.perf_counter(), time.process_time()
            outs = engine.generate(prompts, params)
            walls[name].append(time.perf_counter() - start)
            cpus[name].append(time.process_time() - cpu)
            phases[name].append(dict(engine.stats.seconds))
            matches[name] &= [o.token_ids for o in outs] == expected
    return [summarize(name, engine, walls[name], cpus[name], phases[name], alpha, batch, costs)
            | {"equals_plain": matches[name]}
            for name, engine in engines.items()]


def summarize(name, engine, walls, cpus, phases, alpha, batch, costs) -> dict:
    """One table row, from the fastest of the repeats: phases are wall seconds
    (engine.stats), tokens/s uses the process CPU time of generate (the
    machine is shared) and the wall time. `predicted_ms`: the checkpoint +
    replay time per round that auto's cost model (`expected_round_s`, built on
    `hs.sim.round_time`) gives for the policy at the measured acceptance with
    the measured costs (the ring size is not modelled)."""
    stats, rounds = engine.stats, max(engine.stats.rounds, 1)
    fastest = min(range(len(cpus)), key=cpus.__getitem__)
    per_round = {p: s / rounds for p, s in phases[fastest].items()}
    row = {"alpha": alpha, "batch": batch, "policy": name,
           "acceptance_rate": stats.acceptance_rate, "tokens_per_round": stats.tokens_per_round,
           "peak_checkpoint_bytes": stats.peak_checkpoint_bytes,
           "peak_mib_per_seq": stats.peak_checkpoint_bytes / batch / 2**20,
           "round_ms": 1e3 * sum(per_round.values()),
           **{f"{p}_ms": 1e3 * s for p, s in per_round.items()},
           "replayed_per_round": (stats.log_replayed_tokens + stats.token_replayed_tokens) / rounds,
           "token_replayed_per_round": stats.token_replayed_tokens / rounds,
           "hits_per_round": stats.snapshot_hits / rounds,
           "tokens_per_s": stats.emitted_tokens / min(cpus),
           "wall_tokens_per_s": stats.emitted_tokens / min(walls)}
    policy = engine.speculator.policy
    if name.startswith("auto"):
        row["auto_choices"] = {f"k={k}{'+log' if log else ''}": n for (k, log), n in policy.decisions.items()}
        row["budget_bytes"] = policy.memory_budget_bytes
        k, log = max(policy.decisions, key=policy.decisions.get)
    else:
        k, log = policy.snapshot_every, policy.log_inputs
    if name != "ring small":
        alpha_measured = alpha_from_acceptance_rate(stats.acceptance_rate, GAMMA)
        row["predicted_ms"] = 1e3 * expected_round_s(costs, batch, GAMMA, alpha_measured, k, log)
    return row


def snapshot_overhead(target, batch: int, repeats: int, ring_slots: int = GAMMA + 2) -> dict:
    """Verify forward of γ + 1 inputs with a snapshot after every input against
    the same forward writing only the final state, alternating call by call.
    The slots are the engine's (`plan_snapshots` over rings of `ring_slots`):
    γ + 2 is the smallest ring for k = 1; 2(γ + 1) gives ring halves, where a
    batch's snapshot slots line up and the recurrence runs in them."""
    from hybridspec.cache.hybrid_cache import HybridCache
    from hybridspec.checkpoints.ring import plan_snapshots
    cache = HybridCache(target.config, max_seqs=batch, num_blocks=batch * 2, block_size=16,
                        ring_slots=ring_slots, dtype=target.dtype, device=target.device)
    ids = list(range(batch))
    target.prefill(cache, ids, prompts_for(batch, target.vocab_size), last_only=True)
    start, heads = [cache.computed_len[s] for s in ids], [cache.head(s) for s in ids]
    every = torch.tensor([plan_snapshots(cache.states.ring_slots(s), h, list(range(GAMMA + 1)), GAMMA + 1).snap_slot
                          for s, h in zip(ids, heads)])  # [batch, γ + 1]
    final = torch.full_like(every, -1)
    final[:, -1] = every[:, -1]
    tokens = [[(5 * i + b) % target.vocab_size for i in range(GAMMA + 1)] for b in ids]

    def verify(snap: torch.Tensor):
        target.extend(cache, ids, tokens, snap_slot=snap)
        for s, length, head in zip(ids, start, heads):
            cache.rewind_to(s, length, head)

    t = cpu_side_by_side({"final only": lambda: verify(final), "every input": lambda: verify(every)}, repeats)
    return {"batch": batch, "ring_slots": ring_slots, "final_only_ms": 1e3 * t["final only"],
            "every_input_ms": 1e3 * t["every input"], "extra_fraction": t["every input"] / t["final only"] - 1.0}


def cpu_side_by_side(fns: dict, repeats: int) -> dict[str, float]:
    """Fastest process CPU seconds of each function over `repeats` calls made
    alternately after one warm-up each (CPU time: other work on the shared
    machine counts less)."""
    return {name: min(values) for name, values in alternating_samples(fns, repeats, timer=time.process_time).items()}


def plot_frontier(rows: list[dict], path) -> None:
    """Per batch size: time per token against checkpoint memory of every policy,
    one colour per acceptance regime α (with its Pareto frontier) and one
    marker per policy; the two legends say which is which."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    batches = sorted({r["batch"] for r in rows})
    alphas = sorted({r["alpha"] for r in rows}, reverse=True)
    colors = dict(zip(alphas, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    markers = dict(zip(POLICY_NAMES, "os^vDPX*"))
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.8), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for alpha in alphas:
            cell = [r for r in rows if r["batch"] == batch and r["alpha"] == alpha]
            for r in cell:
                ax.scatter(r["peak_mib_per_seq"], 1e3 / r["tokens_per_s"], color=colors[alpha],
                           marker=markers[r["policy"]])
            front, best = [], float("inf")  # Pareto front: faster than every policy holding less memory
            for r in sorted(cell, key=lambda r: r["peak_mib_per_seq"]):
                if 1e3 / r["tokens_per_s"] < best:
                    best = 1e3 / r["tokens_per_s"]
                    front.append((r["peak_mib_per_seq"], best))
            ax.step(*zip(*front), where="post", color=colors[alpha], lw=1)
        ax.set(title=f"batch {batch}", xlabel="peak checkpoint MiB per sequence", ylabel="CPU ms per token (whole batch)")
        ax.grid(alpha=0.3)
    used = [p for p in POLICY_NAMES if any(r["policy"] == p for r in rows)]
    policy_keys = [Line2D([], [], color="dimgray", marker=markers[p], linestyle="", label=p) for p in used]
    alpha_keys = [Line2D([], [], color=colors[a], marker="o", label=f"α = {a} (line: frontier)") for a in alphas]
    last = axes[0][-1]  # legends beside the last panel, never over a point
    last.add_artist(last.legend(handles=policy_keys, title="policy", fontsize=7, title_fontsize=7,
                                loc="upper left", bbox_to_anchor=(1.02, 1.0)))
    last.legend(handles=alpha_keys, title="acceptance regime", fontsize=7, title_fontsize=7, loc="lower left",
                bbox_to_anchor=(1.02, 0.0))
    fig.suptitle("Checkpoint memory versus time per token, per checkpoint policy", fontsize=10)
    save_png(fig, path)


SAME_FIXED = {(1, False): "k=1", (2, True): "k=2", (4, True): "k=4", (0, True): "k=0", (0, False): "log off"}


def auto_gap(rows: list[dict]) -> list[dict]:
    """Auto's tokens/s against the best fixed policy (within its budget for
    auto@k4); `vs_same`: against the fixed policy auto chose in most rounds,
    the same work, so the difference is run-to-run noise; `model_best`: the
    fixed policy the cost model ranks first at the measured acceptance."""
    out = []
    for key in sorted({(r["alpha"], r["batch"]) for r in rows}):
        cell = {r["policy"]: r for r in rows if (r["alpha"], r["batch"]) == key}
        for name in ("auto", "auto@k4"):
            auto, budget = cell[name], cell[name]["budget_bytes"]
            fixed = [r for n, r in cell.items() if not n.startswith("auto")
                     and (budget is None or r["peak_checkpoint_bytes"] <= budget)]
            best = max(fixed, key=lambda r: r["tokens_per_s"])
            modelled = min((r for r in fixed if "predicted_ms" in r), key=lambda r: r["predicted_ms"])
            main_choice = max(auto["auto_choices"], key=auto["auto_choices"].get)
            same = cell.get(SAME_FIXED.get(_choice_key(main_choice)))
            out.append({"alpha": key[0], "batch": key[1], "auto": name, "chose": auto["auto_choices"],
                        "best_fixed": best["policy"], "model_best": modelled["policy"],
                        "auto_tok_s": auto["tokens_per_s"], "best_tok_s": best["tokens_per_s"],
                        "gap": 1.0 - auto["tokens_per_s"] / best["tokens_per_s"],
                        "vs_same": None if same is None else auto["tokens_per_s"] / same["tokens_per_s"] - 1.0})
    return out


def _choice_key(label: str) -> tuple[int, bool]:
    """'k=4+log' -> (4, True)."""
    k, _, log = label.removeprefix("k=").partition("+")
    return int(k), bool(log)


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--alphas", type=float, nargs="+", default=None)
    parser.add_argument("--tokens", type=int, default=None, help="new tokens per sequence (default by batch)")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    shape = QUICK if args.quick else FULL
    batches = args.batches or ([1] if args.quick else [1, 4, 16])
    alphas = args.alphas or ([0.9, 0.4] if args.quick else [0.9, 0.7, 0.4])
    target = hs.from_hf(build_bamba(shape)).pack_for_cpu()  # as hs.load on CPU
    print(f"target: {target.num_parameters() / 1e6:.1f}M parameters, Mamba layers {target.config.mamba_layers}; "
          f"γ = {GAMMA}; {describe_machine()}", flush=True)
    rows, overheads, measured_costs = [], [], []
    costs = measure_checkpoint_costs(target, GAMMA, batches, partial(scratch_cache, target), repeats=3 if args.quick else 15, clock=time.process_time)
    for batch in batches:
        num_tokens = args.tokens or (8 if args.quick else {1: 40, 4: 24}.get(batch, 12))
        repeats = args.repeats or (1 if args.quick else {1: 5, 4: 3}.get(batch, 2))
        plain = hs.Engine(target, max_batch_size=batch, max_model_len=PROMPT_LEN + num_tokens + 2 * GAMMA + 4)
        prompts = prompts_for(batch, target.vocab_size)
        start = time.process_time()
        outs = plain.generate(prompts, hs.SamplingParams(max_new_tokens=num_tokens + GAMMA + 1, temperature=0.0,
                                                         ignore_eos=True))
        plain_tok_s = batch * (num_tokens + GAMMA + 1) / (time.process_time() - start)
        references = [p + o.token_ids for p, o in zip(prompts, outs)]
        measured_costs.append({"batch": batch, **{f"{f[:-2]}_ms": 1e3 * costs.at(f, batch) for f in COST_FIELDS}})
        print_table(measured_costs[-1:], title="measured checkpoint costs at this batch (CPU ms; auto's inputs; "
                                               "see hybridspec.checkpoints.auto.CheckpointCosts)")
        for alpha in alphas:
            cell = run_workload(target, batch, alpha, references, num_tokens, costs, repeats)
            for r in cell:
                r["plain_tokens_per_s"] = plain_tok_s
            rows += cell
            print_table(cell, ["policy", ("acceptance_rate", "accept"), ("peak_mib_per_seq", "MiB/seq"),
                               ("round_ms", "ms/round"), ("draft_ms", "draft"), ("verify_ms", "verify"),
                               ("sampling_ms", "sampling"), ("commit_ms", "commit"),
                               ("replayed_per_round", "replayed/round"), ("tokens_per_s", "tok/s cpu"),
                               ("wall_tokens_per_s", "tok/s wall"), ("predicted_ms", "model ckpt ms"),
                               ("equals_plain", "= plain")],
                        title=f"α = {alpha}, batch {batch}, {num_tokens} new tokens per sequence "
                              f"(plain decoding: {plain_tok_s:.1f} tok/s)")
        for ring_slots in (GAMMA + 2, 2 * (GAMMA + 1)):  # the smallest ring for k = 1; ring halves
            overheads.append(snapshot_overhead(target, batch, repeats=3 if args.quick else 15, ring_slots=ring_slots))
    hits = [{"alpha": r["alpha"], "batch": r["batch"], "restore_hit_ms": r["commit_ms"],
             "round_ms": r["round_ms"], "fraction": r["commit_ms"] / r["round_ms"]}
            for r in rows if r["policy"] == "k=1"]
    print_table(overheads, ["batch", "ring_slots", ("final_only_ms", "verify, final only ms cpu"),
                            ("every_input_ms", "snapshot every input ms"), ("extra_fraction", "extra")],
                title="Snapshot writes: verify forward with a snapshot after every input vs final state only")
    print_table(hits, ["alpha", "batch", ("restore_hit_ms", "commit by head move ms"), ("round_ms", "round ms"),
                       "fraction"], title="Restore by snapshot hit (k = 1 commit phase) as a fraction of the round")
    gaps = auto_gap(rows)
    print_table(gaps, ["alpha", "batch", "auto", "chose", "best_fixed", "model_best", "auto_tok_s", "best_tok_s",
                       "gap", "vs_same"],
                title="Auto against the best fixed policy (within the same budget); gap = 1 - auto / best; "
                      "vs_same = auto / the fixed policy it chose - 1 (same work: run-to-run noise)")
    name = "memory_vs_replay_quick" if args.quick else "memory_vs_replay"
    write_json(args.out or f"{name}.json", {"bench": "memory_vs_replay", "gamma": GAMMA, "shape": shape,
                                           "rows": rows, "costs": measured_costs, "snapshot_overhead": overheads,
                                           "restore_hit": hits, "auto_gap": gaps})
    plot_frontier(rows, f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
