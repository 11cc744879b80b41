"""Round cost: draft cost c and verify cost per batch, for `hybridspec simulate --measured`.

Round cost: c (draft step / target step) and the verification cost of γ + 1
tokens (in target steps) at batch 1 … 32, written in the JSON that
`hybridspec simulate --measured` reads; the speedup the simulator predicts
from them against the speedup measured with the engine, per batch, and the
two crossover batches.

Target: a random float32 `transformers.BambaForCausalLM` (hidden 512, 8
layers with attention at layer 4, Mamba2 16 heads of headdim 64, d_state 128,
MLP 1536, vocabulary 4096). Drafter: the target's first layer with the same
embeddings, final norm and LM head (a one-layer Mamba model). The target's
other layers have their output projections (Mamba out_proj, attention o_proj,
MLP down_proj) scaled by ε, so they perturb the drafter's residual stream by
an amount ε controls; the acceptance it gives is measured. Nothing is downloaded.
Both are packed as `hs.load` packs on CPU (input-major linear weights, so the
few-row kernel of `kernels/cpu/rows.c` takes products of up to 96 rows).

Per batch B the terms of a plain step and of a round drafting γ are the
engine's own start-up measurement (`hybridspec.engine.startup_costs`, the terms
`num_draft_tokens="auto"` chooses from: forward, draft, sampling, commit,
host; process CPU seconds on scratch caches, as the engine runs are timed,
policy k = 1). Then the engine
generates the same tokens plainly and speculatively (k = 1); the measured
speedup is the ratio of the two CPU times of `generate` (prefill included in
both). Two predictions: "rounds" is `hybridspec simulate --measured`'s,
`hs.sim.round_speedup`: E[tokens](α) · plain step / round, each the sum of
its terms; "generate" (`hs.sim.generation_speedup`) adds what the timed
`generate` calls also pay: the target's prefill of the prompts (timed here,
fastest of the repeats) in both, and the drafter's absorption of the prompts
(the engine's start-up `absorb_s` per token) in the speculative one. α is
the acceptance rate pooled over all batches; "own α" uses each batch's own.

    python benches/round_cost.py            # the measurement (minutes)
    python benches/round_cost.py --quick    # tiny models, batch 1 and 2, seconds
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import hybridspec as hs
from common import bench_parser, describe_machine, out_dir, print_table, set_threads, write_json
from hybridspec.sim.measured import SCHEMA
from memory_vs_replay import build_bamba, prompts_for

FULL = dict(hidden_size=512, num_hidden_layers=8, attn_layer_indices=[4], intermediate_size=1536,
            num_attention_heads=8, num_key_value_heads=2, mamba_n_heads=16, mamba_d_head=64, mamba_d_state=128,
            vocab_size=4096)
QUICK = dict(hidden_size=64, num_hidden_layers=4, attn_layer_indices=[2], intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
             vocab_size=256)
GAMMA, DRAFT_LAYERS = 4, 1
OUTPUT_PROJECTIONS = ("mamba.out_proj.weight", "self_attn.o_proj.weight", "feed_forward.down_proj.weight")


def build_pair(shape: dict, epsilon: float):
    """(target, drafter) HF models: the drafter is the target's first DRAFT_LAYERS
    layers; the target's later layers write ε times their usual output."""
    target = build_bamba(shape)
    draft_shape = dict(shape, num_hidden_layers=DRAFT_LAYERS,
                       attn_layer_indices=[i for i in shape["attn_layer_indices"] if i < DRAFT_LAYERS])
    draft = build_bamba(draft_shape, seed=1)
    weights = target.state_dict()
    draft.load_state_dict({name: weights[name] for name in draft.state_dict()})
    with torch.no_grad():
        for name, param in target.named_parameters():
            layer = name.split(".")[2] if name.startswith("model.layers.") else None
            if layer is not None and int(layer) >= DRAFT_LAYERS and name.endswith(OUTPUT_PROJECTIONS):
                param.mul_(epsilon)
    return target, draft


class ScratchCache:  # the other benches' repeatable forwards
    """A cache of `model` holding `batch` prefilled prompts, rolled back to the
    prompt after every timed forward."""

    def __init__(self, model, batch: int):
        from hybridspec.cache.hybrid_cache import HybridCache
        self.model, self.ids = model, list(range(batch))
        from hybridspec.checkpoints.policy import ring_halves_by_default
        ring_slots = hs.CheckpointPolicy().ring_size(GAMMA, halves=ring_halves_by_default(model.device))  # as an engine
        self.cache = HybridCache(model.config, max_seqs=batch, num_blocks=batch * 2, block_size=16,
                                 ring_slots=ring_slots, dtype=model.dtype, device=model.device)
        model.prefill(self.cache, self.ids, prompts_for(batch, model.vocab_size), last_only=True)
        self.start = [self.cache.computed_len[s] for s in self.ids]
        self.heads = [self.cache.head(s) for s in self.ids]

    def forward(self, num_inputs: int) -> torch.Tensor:
        """One forward of `num_inputs` tokens per sequence with a snapshot after
        every input, in the slots a round would use (`plan_snapshots`); its logits."""
        from hybridspec.checkpoints.ring import plan_snapshots
        snap = torch.tensor([plan_snapshots(self.cache.states.ring_slots(s), h, list(range(num_inputs)),
                                            num_inputs).snap_slot for s, h in zip(self.ids, self.heads)])
        tokens = [[(3 * b + 5 * i + 1) % self.model.vocab_size for i in range(num_inputs)] for b in self.ids]
        logits = self.model.extend(self.cache, self.ids, tokens, last_only=num_inputs == 1, snap_slot=snap)
        for s, length, head in zip(self.ids, self.start, self.heads):
            self.cache.rewind_to(s, length, head)
        return logits


def step_times(target, draft, batch: int, repeats: int) -> dict:
    """The engine's start-up terms at `batch` (plain step and a round of γ
    drafts per row, policy k = 1) as a `hybridspec.round_cost/v1` batch entry."""
    import functools
    from hybridspec.cache.hybrid_cache import scratch_cache
    from hybridspec.engine.engine import scratch_request
    from hybridspec.engine.startup_costs import measure_round_costs
    policy = hs.CheckpointPolicy(snapshot_every=1, log_inputs=False)
    new_cache = functools.partial(scratch_cache, target)
    costs = measure_round_costs(target, draft, policy, GAMMA, [batch], new_cache, scratch_request, repeats=repeats,
                                clock=time.process_time)  # CPU time: the machine is shared
    plain, spec = costs.terms(batch, 0), costs.terms(batch, GAMMA)
    prompts = prompts_for(batch, target.vocab_size)
    return {"batch": batch, "target_step_s": plain.forward_s, "draft_step_s": costs.draft_step(batch),
            "verify_s": spec.forward_s, "draft_s": spec.draft_s, "sampling_s": spec.sampling_s,
            "commit_s": spec.commit_s, "host_s": spec.host_s, "replay_s": spec.replay_s,
            "plain_sampling_s": plain.sampling_s, "plain_host_s": plain.host_s,
            "prefill_s": prefill_seconds(target, prompts, repeats),
            "absorb_s": costs.absorb(batch) * batch * len(prompts[0])}


def prefill_seconds(model, prompts: list[list[int]], repeats: int) -> float:
    """CPU seconds of the target's prefill of `prompts` (which gives each first token), fastest of `repeats`."""
    from hybridspec.cache.hybrid_cache import scratch_cache
    best = float("inf")
    for _ in range(repeats + 1):
        cache = scratch_cache(model, len(prompts), 2, max_len=len(prompts[0]) + 1)
        began = time.process_time()
        model.prefill(cache, list(range(len(prompts))), prompts, last_only=True)
        best = min(best, time.process_time() - began)
    return best


def generate_speedup(entry, step: dict, num_tokens: int, tokens_per_round: float) -> float:
    """The predicted speedup of the `generate` calls the bench times: prefill,
    the drafter's absorption of the prompts, then rounds (`hs.sim.generation_speedup`)."""
    return hs.sim.generation_speedup(num_tokens, tokens_per_round, entry.plain, entry.round,
                                     step["prefill_s"], step["absorb_s"])


def engine_speedup(target, draft, batch: int, num_tokens: int, repeats: int) -> dict:
    """Plain against speculative generate (k = 1) of the same tokens, alternating;
    process CPU seconds of each generate call, fastest of `repeats`."""
    prompts = prompts_for(batch, target.vocab_size)
    params = hs.SamplingParams(max_new_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    length = dict(max_batch_size=batch, max_model_len=len(prompts[0]) + num_tokens + GAMMA + 2)
    plain = hs.Engine(target, **length)
    spec = hs.Engine(target, draft=draft, num_draft_tokens=GAMMA,
                     checkpoint=hs.CheckpointPolicy(snapshot_every=1, log_inputs=False), **length)
    cpu, outputs = {"plain": [], "spec": []}, {}
    for _ in range(repeats):
        for name, engine in (("plain", plain), ("spec", spec)):
            engine.stats.reset()
            start = time.process_time()
            outputs[name] = [o.token_ids for o in engine.generate(prompts, params)]
            cpu[name].append(time.process_time() - start)
    stats = spec.stats
    return {"batch": batch, "measured_speedup": min(cpu["plain"]) / min(cpu["spec"]),
            "plain_tok_s": batch * num_tokens / min(cpu["plain"]),
            "spec_tok_s": batch * num_tokens / min(cpu["spec"]),
            "accepted": stats.accepted_tokens, "drafted": stats.drafted_tokens,
            "acceptance_rate": stats.acceptance_rate, "replay_s": stats.seconds["commit"] / max(stats.rounds, 1),
            "equals_plain": outputs["plain"] == outputs["spec"]}


def crossover_of(rows: list[dict], key: str) -> dict:
    """`hs.sim.measured_crossover` over the speedups in `rows[key]`."""
    return hs.sim.measured_crossover([{"batch": r["batch"], "speedup": {"value": r[key], "source": "measured"}}
                                      for r in rows])


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--epsilon", type=float, default=0.03, help="scale of the target's non-draft layers' outputs")
    parser.add_argument("--tokens", type=int, default=None, help="new tokens per sequence in the engine runs")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    batches = args.batches or ([1, 2] if args.quick else [1, 2, 4, 8, 16, 32])
    hf_target, hf_draft = build_pair(QUICK if args.quick else FULL, args.epsilon)
    target, draft = hs.from_hf(hf_target).pack_for_cpu(), hs.from_hf(hf_draft).pack_for_cpu()  # as hs.load on CPU
    machine = describe_machine()
    print(f"target {target.num_parameters() / 1e6:.1f}M parameters, drafter {draft.num_parameters() / 1e6:.1f}M "
          f"(its first {DRAFT_LAYERS} layers), ε = {args.epsilon}, γ = {GAMMA}; {machine}", flush=True)
    steps, runs = [], []
    for batch in batches:
        num_tokens = args.tokens or (8 if args.quick else 24 if batch <= 8 else 16)
        repeats = args.repeats or (1 if args.quick else 3 if batch <= 8 else 2)
        steps.append(step_times(target, draft, batch, repeats=2 if args.quick else 3))
        runs.append(engine_speedup(target, draft, batch, num_tokens, repeats) | {"tokens": num_tokens})
        print(f"batch {batch}: {steps[-1]} {runs[-1]}", flush=True)
    rate = sum(r["accepted"] for r in runs) / max(sum(r["drafted"] for r in runs), 1)
    measured = {"schema": SCHEMA, "machine": machine, "model": f"random Bamba {target.num_parameters() / 1e6:.1f}M",
                "draft": f"its first {DRAFT_LAYERS} layers (ε = {args.epsilon})", "acceptance_rate": rate,
                "gamma": GAMMA, "snapshot_every": 1, "log_inputs": False,
                "batches": steps}
    run = hs.sim.parse_measured(measured)
    predicted = {row["batch"]: row for row in hs.sim.measured_rows(run)}
    entries = {entry.batch: entry for entry in run.batches}
    rows = []
    for s, r in zip(steps, runs):
        b = s["batch"]
        own_tokens = hs.sim.expected_tokens(hs.sim.alpha_from_acceptance_rate(r["acceptance_rate"], GAMMA), GAMMA)
        generate = generate_speedup(entries[b], s, r["tokens"], run.tokens_per_round)
        rows.append({"batch": b, "target_ms": 1e3 * s["target_step_s"], "c": predicted[b]["c"]["value"],
                     "verify_cost": predicted[b]["verify_cost"]["value"],
                     "round_ms": 1e3 * hs.sim.round_seconds(entries[b].round),
                     "predicted_rounds": predicted[b]["speedup"]["value"], "predicted": generate,
                     "measured": r["measured_speedup"], "error": r["measured_speedup"] / generate - 1.0,
                     "predicted_own": generate_speedup(entries[b], s, r["tokens"], own_tokens),
                     "tokens": r["tokens"], "acceptance": r["acceptance_rate"], "plain_tok_s": r["plain_tok_s"],
                     "spec_tok_s": r["spec_tok_s"], "equals_plain": r["equals_plain"]})
    print_table(rows, ["batch", ("target_ms", "target step ms"), "c", ("verify_cost", "verify (steps)"),
                       ("round_ms", "round ms (all terms)"), ("predicted_rounds", "predicted x, rounds"),
                       ("predicted", "predicted x, generate"), ("measured", "measured x"), "error", "acceptance",
                       ("predicted_own", "predicted x, own α"), "tokens", ("equals_plain", "= plain")],
                title=f"γ = {GAMMA}, pooled acceptance rate {rate:.3f} (α = {run.alpha:.3f}), "
                      f"E[tokens] = {run.tokens_per_round:.3f}; 'rounds': hybridspec simulate --measured's "
                      "(round_speedup); 'generate': with the prefill and the drafter's absorption of the prompts "
                      "(generation_speedup), what 'measured' times; 'own α': each batch's own acceptance")
    crossovers = {"predicted": crossover_of(rows, "predicted"), "measured": crossover_of(rows, "measured"),
                  "predicted_rounds": crossover_of(rows, "predicted_rounds"),
                  "predicted_own": crossover_of(rows, "predicted_own")}
    for name, cross in crossovers.items():
        print(f"{name} crossover batch: {cross['batch']} ({cross['note']})")
    name = "round_cost_quick" if args.quick else "round_cost"
    path = Path(args.out or out_dir() / f"{name}.json")
    path.write_text(json.dumps(measured, indent=2) + "\n")  # "machine" stays the schema's free-text line
    print(f"wrote {path} (hybridspec simulate --measured {path})")
    write_json(path.with_name(f"{path.stem}_report.json"), {"bench": "round_cost", "epsilon": args.epsilon,
                                                           "rows": rows, "crossover": crossovers})
    return 0


if __name__ == "__main__":
    sys.exit(main())
