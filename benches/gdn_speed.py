"""GDN speed: plain decode against HF, snapshot and log overheads, speculative with a GDN drafter.

A Qwen3.5-shaped random model (float32, CPU, three gated-DeltaNet layers to
one gated-attention layer, vocabulary 32000) is built with transformers'
`Qwen3_5ForCausalLM` (random weights, nothing downloaded) and run through
`hs.from_hf(...).pack_for_cpu()` (what `hs.load` gives on CPU).

1. Plain decode per token: engine and HF `generate` decode the same greedy
   continuation of the same prompts; per-token time runs from the first
   new token's arrival to the last (`context_scaling`'s stamps: the prefill
   is not in it). The two alternate call by call (one warm-up each); the
   table gives the median and min–max of `--repeats`.
2. Verify forward of γ + 1 inputs with a snapshot after every input, and
   with the input log filled (the log policy), each against the same forward
   writing only the final state (`memory_vs_replay.snapshot_overhead`'s
   setup, fastest CPU time of alternating calls).
3. Speculative (γ = 4) against plain at batch 1, with three drafters: a small
   random Qwen3.5-shaped model (low acceptance: its weights are unrelated),
   a perturbed copy of the target (`rollback.perturbed_copy`), and (on a
   second target whose layers past the fourth are scaled by `--skip-scale`,
   as `e2e`'s random pair) that target's first four layers.

    python benches/gdn_speed.py            # the measurement (minutes)
    python benches/gdn_speed.py --quick    # tiny models, a few tokens
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from common import alternating_samples, bench_parser, describe_machine, print_table, set_threads, write_json
from context_scaling import LogitsStamps, Stamps
from memory_vs_replay import GAMMA, cpu_side_by_side, prompts_for
from plain_decode import engine_greedy, first_mismatch

FULL = dict(hidden_size=768, num_hidden_layers=12, intermediate_size=2048, num_attention_heads=8,
            num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
            linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=32000)
DRAFT = dict(FULL, hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=4,
             head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
             linear_value_head_dim=32)
QUICK = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=512)
QUICK_DRAFT = dict(QUICK, hidden_size=32, num_hidden_layers=4, intermediate_size=64)


def build_qwen3_5(shape: dict, seed: int = 0):
    """A random float32 Qwen3_5ForCausalLM, every fourth layer full attention, no EOS."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    layers = shape["num_hidden_layers"]
    config = Qwen3_5TextConfig(**shape, layer_types=["full_attention" if i % 4 == 3 else "linear_attention"
                                                      for i in range(layers)],
                               linear_conv_kernel_dim=4, max_position_embeddings=4096, tie_word_embeddings=False,
                               pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def layer_skip_pair(shape: dict, draft_layers: int, scale: float, seed: int = 0):
    """(target, draft) HF models: a random target whose layers past `draft_layers` write `scale` times
    their output (o_proj / out_proj and down_proj scaled), and a draft made of its first `draft_layers`
    layers with its embedding, final norm and head: the smaller `scale`, the more often they agree."""
    from transformers import Qwen3_5ForCausalLM
    target = build_qwen3_5(shape, seed)
    with torch.no_grad():
        for layer in target.model.layers[draft_layers:]:
            mixer = getattr(layer, "linear_attn", None) or layer.self_attn
            (mixer.out_proj if hasattr(mixer, "out_proj") else mixer.o_proj).weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    config = target.config.to_dict()
    config.update(num_hidden_layers=draft_layers, layer_types=config["layer_types"][:draft_layers])
    draft = Qwen3_5ForCausalLM(type(target.config)(**config)).float().eval()
    missing = draft.load_state_dict(target.state_dict(), strict=False).missing_keys
    if missing:
        raise RuntimeError(f"layer-skip draft: no target weights for {missing}")
    return target, draft


def spread(values: list[float], scale: float = 1e3) -> dict:
    return {"median": scale * statistics.median(values), "min": scale * min(values), "max": scale * max(values)}


def shown(s: dict) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def engine_stamped(engine, prompts: list[list[int]], num_tokens: int) -> tuple[list[list[int]], Stamps]:
    """One Engine.generate call, stamped as row 0's tokens arrive (every row decodes in the same steps)."""
    import hybridspec as hs
    stamps = Stamps()
    outs = engine.generate(prompts, hs.SamplingParams(max_new_tokens=num_tokens, temperature=0.0, ignore_eos=True),
                           stream=lambda i, tokens: stamps.stamp(len(tokens)) if i == 0 else None)
    return [o.token_ids for o in outs], stamps


def hf_stamped(model, prompts: list[list[int]], num_tokens: int) -> tuple[list[list[int]], Stamps]:
    """One HF generate call, stamped after every forward."""
    from transformers import LogitsProcessorList
    ids = torch.tensor(prompts)  # [batch, prompt_len]
    stamps = LogitsStamps()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                             logits_processor=LogitsProcessorList([stamps]))
    return out[:, ids.shape[1]:].tolist(), stamps


def decode_rows(model, packed, vocab: int, batches, prompt_lens, num_tokens: int, repeats: int) -> list[dict]:
    """Engine and HF ms per decode step (from the first token's arrival to the last; the prefill is
    not in it) at each batch and prompt length, the two alternating call by call."""
    import hybridspec as hs
    rows = []
    for prompt_len in prompt_lens:
        engine = hs.Engine(packed, max_batch_size=max(batches), max_model_len=prompt_len + num_tokens + 1)
        for batch in batches:
            prompts = torch.randint(1, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(1)).tolist()
            calls = {"engine": lambda: engine_stamped(engine, prompts, num_tokens),
                     "hf": lambda: hf_stamped(model, prompts, num_tokens)}
            got, per = {}, {name: [] for name in calls}
            for index in range(repeats + 1):  # index 0: the warm-up
                for name, call in calls.items():
                    got[name], stamps = call()
                    if index:
                        per[name].append(stamps.timings(first=0)["wall"][1])
            mismatch = first_mismatch(got["engine"], got["hf"])
            e, h = spread(per["engine"]), spread(per["hf"])
            rows.append(dict(batch=batch, prompt_len=prompt_len, engine_ms_tok=e, hf_ms_tok=h,
                             engine=shown(e), hf=shown(h), speedup=h["median"] / e["median"],
                             tokens_equal=mismatch is None, first_mismatch=mismatch))
            print(f"prompt {prompt_len}, batch {batch}: engine {e['median']:.2f} ms/token, HF {h['median']:.2f}, "
                  f"HF/engine {rows[-1]['speedup']:.2f}, tokens equal: {mismatch is None}", flush=True)
    return rows


def overhead_rows(target, batches, repeats: int, ring_slots: int) -> list[dict]:
    """Snapshot after every input, and the input log filled, each against final state only."""
    from hybridspec.cache.hybrid_cache import HybridCache
    from hybridspec.checkpoints.ring import plan_snapshots
    rows = []
    for batch in batches:
        cache = HybridCache(target.config, max_seqs=batch, num_blocks=batch * 2, block_size=16,
                            ring_slots=ring_slots, dtype=target.dtype, device=target.device)
        ids = list(range(batch))
        target.prefill(cache, ids, prompts_for(batch, target.vocab_size), last_only=True)
        start, heads = [cache.computed_len[s] for s in ids], [cache.head(s) for s in ids]
        every = torch.tensor([plan_snapshots(cache.states.ring_slots(s), h, list(range(GAMMA + 1)),
                                             GAMMA + 1).snap_slot for s, h in zip(ids, heads)])  # [batch, γ + 1]
        final = torch.full_like(every, -1)
        final[:, -1] = every[:, -1]
        tokens = [[(5 * i + b) % target.vocab_size for i in range(GAMMA + 1)] for b in ids]

        def verify(snap: torch.Tensor, log: bool):
            target.extend(cache, ids, tokens, snap_slot=snap, input_log={} if log else None)
            for s, length, head in zip(ids, start, heads):
                cache.rewind_to(s, length, head)

        t = cpu_side_by_side({"final": lambda: verify(final, False), "every": lambda: verify(every, False),
                              "log": lambda: verify(final, True)}, repeats)
        rows.append(dict(batch=batch, ring_slots=ring_slots, final_only_ms=1e3 * t["final"],
                         every_input_ms=1e3 * t["every"], log_ms=1e3 * t["log"],
                         extra_fraction=t["every"] / t["final"] - 1.0, log_extra_fraction=t["log"] / t["final"] - 1.0))
    return rows


def spec_rows(target, drafters: dict, vocab: int, prompt_len: int, num_tokens: int, repeats: int) -> list[dict]:
    """Speculative (γ = GAMMA) against plain, batch 1, each drafter; tokens must equal plain's."""
    import hybridspec as hs
    sizes = dict(max_batch_size=1, max_model_len=prompt_len + num_tokens + GAMMA + 2)
    plain = hs.Engine(target, **sizes)
    prompts = torch.randint(1, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(2)).tolist()
    engines = {name: hs.Engine(target, draft=d, num_draft_tokens=GAMMA, **sizes) for name, d in drafters.items()}
    got, stats = {}, {}

    def spec(name):
        params = hs.SamplingParams(max_new_tokens=num_tokens, temperature=0.0, ignore_eos=True)
        got[name] = [o.token_ids for o in engines[name].generate(prompts, params)]
        stats[name] = engines[name].stats.acceptance_rate

    fns = {"plain": lambda: got.__setitem__("plain", engine_greedy(plain, prompts, num_tokens))}
    fns.update({name: (lambda n=name: spec(n)) for name in drafters})
    t = alternating_samples(fns, repeats, timer=time.perf_counter)
    base = statistics.median(t["plain"])
    return [dict(drafter=name, batch=1, new_tokens=num_tokens, plain_tok_s=num_tokens / base,
                 spec_tok_s=num_tokens / statistics.median(t[name]), speedup=base / statistics.median(t[name]),
                 spec_ms=spread(t[name]), plain_ms=spread(t["plain"]), spec=shown(spread(t[name])),
                 plain=shown(spread(t["plain"])), acceptance_rate=stats[name],
                 spec_equals_plain=got[name] == got["plain"]) for name in drafters]


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--new-tokens", type=int, default=None, help="decoded tokens per sequence (default 32)")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=None, help="default 128 2048")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--verify-batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per implementation (default 3)")
    parser.add_argument("--skip-scale", type=float, default=0.01,
                        help="the layer-skip pair's scale on the target's later layers' outputs")
    parser.add_argument("--skip", nargs="*", default=[], choices=["decode", "overhead", "spec"])
    args = parser.parse_args(argv)
    import hybridspec as hs
    from hybridspec.rollback.models import perturbed_copy

    threads = set_threads(args.threads)
    shape, draft_shape = (QUICK, QUICK_DRAFT) if args.quick else (FULL, DRAFT)
    num_tokens = args.new_tokens or (4 if args.quick else 32)
    repeats = args.repeats or (1 if args.quick else 3)
    prompt_lens = args.prompt_lens or ([16] if args.quick else [128, 2048])
    model = build_qwen3_5(shape)
    target = hs.from_hf(model).pack_for_cpu()
    params = target.num_parameters()
    print(f"Qwen3.5-shaped random model: {params / 1e6:.1f}M parameters, float32; {describe_machine()}", flush=True)
    payload = dict(bench="gdn_speed", quick=args.quick, threads=threads, repeats=repeats, new_tokens=num_tokens,
                   model=dict(family="qwen3_5", parameters=params, dtype="float32", **shape))
    if "decode" not in args.skip:
        payload["decode"] = decode_rows(model, target, shape["vocab_size"], args.batches, prompt_lens, num_tokens,
                                        repeats)
        print_table(payload["decode"], ["prompt_len", "batch", ("engine", "engine ms/token"),
                                        ("hf", "HF ms/token"), ("speedup", "HF/engine"), "tokens_equal"],
                    title=f"plain decode per token, {threads} thread(s), median (min-max) of {repeats}")
    if "overhead" not in args.skip:
        payload["overhead"] = overhead_rows(target, args.verify_batches, 3 if args.quick else 9, 2 * (GAMMA + 1))
        print_table(payload["overhead"], ["batch", ("final_only_ms", "final only ms"),
                                          ("every_input_ms", "every input ms"), ("extra_fraction", "snapshot extra"),
                                          ("log_ms", "log ms"), ("log_extra_fraction", "log extra")],
                    title=f"verify of {GAMMA + 1} inputs: snapshot every input / input log vs final state only")
    if "spec" not in args.skip:
        draft = hs.from_hf(build_qwen3_5(draft_shape, seed=3)).pack_for_cpu()
        payload["draft_parameters"] = draft.num_parameters()
        drafters = {f"small GDN ({draft.num_parameters() / 1e6:.1f}M)": draft,
                    "perturbed target (0.03)": perturbed_copy(target, 0.03)}
        payload["spec"] = spec_rows(target, drafters, shape["vocab_size"], prompt_lens[0], 2 * num_tokens, repeats)
        skip_target, skip_draft = layer_skip_pair(shape, 4, args.skip_scale)
        skip = hs.from_hf(skip_draft).pack_for_cpu()
        label = f"first 4 layers ({skip.num_parameters() / 1e6:.1f}M), later x{args.skip_scale:g}"
        payload["spec"] += spec_rows(hs.from_hf(skip_target).pack_for_cpu(), {label: skip}, shape["vocab_size"],
                                     prompt_lens[0], 2 * num_tokens, repeats)
        print_table(payload["spec"], ["drafter", ("plain", "plain ms"), ("spec", "spec ms"),
                                      ("speedup", "spec/plain"), ("acceptance_rate", "acceptance"),
                                      "spec_equals_plain"], title=f"speculative (γ = {GAMMA}) vs plain, batch 1")
    write_json(args.out or "gdn_speed.json", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
