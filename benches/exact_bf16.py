"""Exact bfloat16 weight storage against float32: step time, tokens/s, memory, same logits.

Exact bfloat16 weight storage: a float32 model whose weights are bfloat16
values (bf16 weights loaded as float32, as hybrid models ship) with
its linear weights stored in float32 (`pack_for_cpu(exact_16bit=False)`) and
in bfloat16 (the default: the kernels widen each weight as they load it),
side by side in one process.

Models (random, nothing downloaded; every parameter rounded to bfloat16):
round_cost's 35.8M Bamba target (hidden 512, 8 layers; its weights stream
from memory) and its one-layer drafter; with `--hf`, also plain_decode's
185M Bamba against HF `generate` on the same float32 weights.

Per batch, alternating call by call (median and min–max of `--repeats`,
wall clock, one thread): a plain decode step and a verify forward of γ + 1
= 5 inputs with a snapshot after every input, and whether the two storages
gave the same logits bit for bit; then greedy `generate`, plain and
speculative (γ = 4), tokens/s and whether the tokens are the same; and the
parameters' memory (linear weights and embeddings in bfloat16; norms and the
other vectors stay float32).

    python benches/exact_bf16.py              # the measurement (minutes)
    python benches/exact_bf16.py --hf         # and the 185M model against HF
    python benches/exact_bf16.py --quick      # tiny models, seconds
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

import hybridspec as hs
from common import bench_parser, describe_machine, out_dir, print_table, set_threads, write_json

GAMMA = 4
STORAGES = ("float32", "bfloat16")


def bf16_valued_(hf):
    """Round every parameter of an HF model to its nearest bfloat16 value, in place (float32 kept)."""
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return hf


def both_storages(hf) -> dict[str, hs.HybridModel]:
    return {"float32": hs.from_hf(hf).pack_for_cpu(exact_16bit=False), "bfloat16": hs.from_hf(hf).pack_for_cpu()}


def weights_mib(model) -> float:
    """All parameters' memory (a tensor tied to two names counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20


def alternate(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Wall seconds of each function over `repeats` rounds, the order reversed every other round, after a warm-up."""
    for fn in fns.values():
        fn()
    samples = {name: [] for name in fns}
    order = list(fns)
    for index in range(repeats):
        for name in (order if index % 2 else order[::-1]):
            start = time.perf_counter()
            fns[name]()
            samples[name].append(time.perf_counter() - start)
    return samples


def spread(values: list[float], scale: float = 1e3) -> str:
    return f"{scale * min(values):.2f}–{scale * max(values):.2f}"


def step_rows(models: dict, batch: int, repeats: int) -> list[dict]:
    from round_cost import ScratchCache
    caches = {name: ScratchCache(model, batch) for name, model in models.items()}
    rows = []
    for forward, inputs in (("plain step", 1), ("verify, 5 inputs", GAMMA + 1)):
        fns = {name: (lambda c=cache: c.forward(inputs)) for name, cache in caches.items()}
        same = torch.equal(*(fn() for fn in fns.values()))
        samples = alternate(fns, repeats)
        med = {name: statistics.median(s) for name, s in samples.items()}
        rows.append({"batch": batch, "forward": forward, "float32_ms": 1e3 * med["float32"],
                     "float32_range": spread(samples["float32"]), "bfloat16_ms": 1e3 * med["bfloat16"],
                     "bfloat16_range": spread(samples["bfloat16"]), "bf16/f32": med["bfloat16"] / med["float32"],
                     "same_bits": same})
    return rows


def generate_rows(targets: dict, drafts: dict, batch: int, num_tokens: int, repeats: int) -> list[dict]:
    from memory_vs_replay import prompts_for
    prompts = prompts_for(batch, targets["float32"].vocab_size)
    params = hs.SamplingParams(max_new_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    length = dict(max_batch_size=batch, max_model_len=len(prompts[0]) + num_tokens + GAMMA + 2)
    engines = {(kind, name): (hs.Engine(targets[name], **length) if kind == "plain" else
                              hs.Engine(targets[name], draft=drafts[name], num_draft_tokens=GAMMA, **length))
               for kind in ("plain", "speculative") for name in STORAGES}
    tokens = {}

    def run(key):
        def fn():
            tokens[key] = [o.token_ids for o in engines[key].generate(prompts, params)]
        return fn
    samples = alternate({key: run(key) for key in engines}, repeats)
    rows = []
    for kind in ("plain", "speculative"):
        rate = {name: batch * num_tokens / statistics.median(samples[kind, name]) for name in STORAGES}
        rows.append({"batch": batch, "generate": kind, "float32_tok_s": rate["float32"],
                     "bfloat16_tok_s": rate["bfloat16"], "bf16/f32 speed": rate["bfloat16"] / rate["float32"],
                     "same_tokens": tokens[kind, "float32"] == tokens[kind, "bfloat16"] == tokens["plain", "float32"]})
    return rows


def hf_rows(quick: bool, num_tokens: int, repeats: int) -> list[dict]:
    """plain_decode's model: HF generate (float32 weights) against the engine with each storage."""
    from plain_decode import FULL, QUICK, build_bamba, engine_greedy, hf_greedy
    hf = bf16_valued_(build_bamba(QUICK if quick else FULL))
    models = both_storages(hf)
    rows = []
    for batch in (1, 4):
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(1, hf.config.vocab_size, (batch, 32), generator=g).tolist()
        engines = {name: hs.Engine(model, max_batch_size=batch) for name, model in models.items()}
        out = {}
        fns = {"hf": lambda: out.__setitem__("hf", hf_greedy(hf, prompts, num_tokens)),
               **{name: (lambda name=name: out.__setitem__(name, engine_greedy(engines[name], prompts, num_tokens)))
                  for name in STORAGES}}
        samples = alternate(fns, repeats)
        rate = {name: batch * num_tokens / statistics.median(s) for name, s in samples.items()}
        rows.append({"model": f"{models['float32'].num_parameters() / 1e6:.1f}M", "batch": batch,
                     "hf_tok_s": rate["hf"], "float32_tok_s": rate["float32"], "bfloat16_tok_s": rate["bfloat16"],
                     "float32/hf": rate["float32"] / rate["hf"], "bfloat16/hf": rate["bfloat16"] / rate["hf"],
                     "same_tokens": out["hf"] == out["float32"] == out["bfloat16"]})
    return rows


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--tokens", type=int, default=None, help="new tokens per sequence in generate (default 32)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--hf", action="store_true", help="also plain_decode's 185M model against HF generate")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    from round_cost import FULL, QUICK, build_pair
    batches = args.batches or ([1, 2] if args.quick else [1, 4, 8])
    repeats = args.repeats or (3 if args.quick else 11)
    num_tokens = args.tokens or (8 if args.quick else 32)
    target_hf, draft_hf = build_pair(QUICK if args.quick else FULL, 0.03)
    targets, drafts = both_storages(bf16_valued_(target_hf)), both_storages(bf16_valued_(draft_hf))
    print(f"round_cost target {targets['float32'].num_parameters() / 1e6:.1f}M parameters, bf16-valued; "
          f"{describe_machine()}", flush=True)
    steps, generates = [], []
    for batch in batches:
        steps += step_rows(targets, batch, repeats)
        generates += generate_rows(targets, drafts, batch, num_tokens, max(repeats // 3, 2))
        print(f"batch {batch} done", flush=True)
    memory = [{"model": "target", **{f"{n}_mib": weights_mib(m) for n, m in targets.items()}},
              {"model": "drafter", **{f"{n}_mib": weights_mib(m) for n, m in drafts.items()}}]
    print_table(steps, ["batch", "forward", ("float32_ms", "float32 ms"), ("float32_range", "min–max"),
                        ("bfloat16_ms", "bfloat16 ms"), ("bfloat16_range", "min–max"), "bf16/f32",
                        ("same_bits", "same logits")],
                title=f"one forward, median of {repeats} alternating calls, wall ms")
    print_table(generates, ["batch", "generate", ("float32_tok_s", "float32 tok/s"),
                            ("bfloat16_tok_s", "bfloat16 tok/s"), "bf16/f32 speed", ("same_tokens", "same tokens")],
                title=f"greedy generate, {num_tokens} new tokens per sequence (prefill included)")
    print_table(memory, ["model", ("float32_mib", "parameters MiB, float32 storage"),
                         ("bfloat16_mib", "bfloat16")], title="memory")
    versus_hf = hf_rows(args.quick, num_tokens, max(repeats // 3, 2)) if args.hf else []
    if versus_hf:
        print_table(versus_hf, ["model", "batch", ("hf_tok_s", "HF tok/s"), ("float32_tok_s", "engine float32"),
                                ("bfloat16_tok_s", "engine bfloat16"), "float32/hf", "bfloat16/hf",
                                ("same_tokens", "same tokens")], title="plain generate against HF, same weights")
    write_json(args.out or out_dir() / "exact_bf16.json",
               {"bench": "exact_bf16", "repeats": repeats, "new_tokens": num_tokens, "steps": steps,
                "generate": generates, "memory": memory, "versus_hf": versus_hf})
    return 0


if __name__ == "__main__":
    sys.exit(main())
