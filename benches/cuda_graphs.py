"""CUDA graphs against eager launches on a GPU: ms per token, plain and speculative.

The same requests run both ways, interleaved. Also the decode forward alone (`HybridModel.decode` over a cache, no
sampling or scheduling), eager against graphed, ms per step and whether the
logits are the same bits. Target: a random float32 hybrid built in code with Bamba-9B's layer mix at a
GPU-friendly size (hidden 1024, 16 layers, one attention layer in eight,
Mamba-2 heads of 64 × 128, about 0.3B parameters); drafter: 4 layers of the
same shape. Nothing is downloaded, and transformers is not needed. Per batch size: ms per generated
token of plain decoding and of speculative decoding (γ = 4, greedy), eager
and with `Engine(cuda_graphs=True)`, the median of interleaved repeats
(min–max in the JSON), and whether both produced the same tokens.

    python benches/cuda_graphs.py            # on a GPU (about a minute)
    python benches/cuda_graphs.py --quick    # tiny models; without CUDA it runs the graphs' static
                                             # path on CPU, interpreted (a smoke run, not a measurement)

Writes benches/out/cuda_graphs.json.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

import hybridspec as hs
from common import bench_parser, describe_machine, out_dir, print_table, set_threads, write_json

GAMMA = 4


def config(layers: int, hidden: int, mamba_heads: int, d_state: int, mlp: int, vocab: int,
           attention_every: int = 8):
    """A Bamba-like stack built in code (no transformers needed on the GPU machine):
    Mamba-2 heads of 64 (expand 2), one attention layer in `attention_every`, a SwiGLU MLP after each."""
    from hybridspec.config import AttentionConfig, HybridConfig, Mamba2Config, MLPConfig
    types = tuple("attention" if i % attention_every == attention_every // 2 else "mamba2" for i in range(layers))
    return HybridConfig(
        vocab_size=vocab, hidden_size=hidden, layer_types=types, ffn_types=("mlp",) * layers,
        attention=AttentionConfig(num_heads=hidden // 64, num_kv_heads=max(1, hidden // 256), head_dim=64),
        mamba2=Mamba2Config(num_heads=mamba_heads, head_dim=2 * hidden // mamba_heads, d_state=d_state),
        mlp=MLPConfig(mlp), max_position_embeddings=4096, family="bench")


FULL = dict(layers=16, hidden=1024, mamba_heads=32, d_state=128, mlp=2816, vocab=32000)  # about 0.3B
DRAFT = dict(FULL, layers=4)
QUICK = dict(layers=3, hidden=64, mamba_heads=4, d_state=16, mlp=128, vocab=256, attention_every=2)
QUICK_DRAFT = dict(QUICK, layers=2)


def build(shape: dict, seed: int, device) -> hs.HybridModel:
    from hybridspec.rollback.models import random_model
    return random_model(config(**shape), seed, torch.float32, device)


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(engines: dict, prompts, params, repeats: int, device) -> tuple[dict, bool]:
    """Seconds per generated token per engine (interleaved; median, min, max) and whether all gave the same tokens."""
    samples = {name: [] for name in engines}
    outputs = {}
    for engine in engines.values():  # warm-up: compiles the kernels, captures the graphs
        engine.generate(prompts, params)
    for _ in range(repeats):
        for name, engine in engines.items():
            synchronize(device)
            start = time.perf_counter()
            out = engine.generate(prompts, params)
            synchronize(device)
            seconds = time.perf_counter() - start
            outputs[name] = [o.token_ids for o in out]
            samples[name].append(seconds / sum(len(t) for t in outputs[name]) * len(prompts))
    same = len({repr(o) for o in outputs.values()}) == 1
    return {name: (statistics.median(s), min(s), max(s)) for name, s in samples.items()}, same


def step_times(target, batch: int, steps: int, repeats: int, device) -> tuple[dict, bool]:
    """The decode forward alone (`HybridModel.decode`, no sampling or scheduling): seconds per step over
    `steps` steps, eager and graphed caches interleaved run by run (median, min, max), and whether their
    logits were the same."""
    from hybridspec.cache.hybrid_cache import HybridCache
    from hybridspec.models.graphs import ForwardGraphs
    caches, pages = {}, -(-(16 + steps * (repeats + 1)) // 16)  # the prompt, then every run's steps
    for graphed in (False, True):
        cache = HybridCache(target.config, max_seqs=batch, num_blocks=batch * pages, block_size=16, ring_slots=2,
                            dtype=target.dtype, device=device, spare="pair")
        if graphed:
            cache.graphs = ForwardGraphs(target, cache, batch, pages * 16)
        target.prefill(cache, list(range(batch)), [[3 + b] * 16 for b in range(batch)], last_only=True)
        caches[graphed] = cache
    ids, samples, last = list(range(batch)), {False: [], True: []}, {}
    for run in range(repeats + 1):  # run 0 warms up (and captures)
        for graphed, cache in caches.items():
            synchronize(device)
            start = time.perf_counter()
            for step in range(steps):
                last[graphed] = target.decode(cache, ids, [(5 * step + b) % target.vocab_size for b in ids])
            synchronize(device)
            if run:
                samples[graphed].append((time.perf_counter() - start) / steps)
    same = bool(torch.equal(last[False], last[True]))
    return {graphed: (statistics.median(s), min(s), max(s)) for graphed, s in samples.items()}, same


def result_row(batch: int, mode: str, times: dict, same: bool, graph_replays: int | None) -> dict:
    """One table row from {graphed: (median, min, max) seconds}: milliseconds, eager / graphs, ranges."""
    eager, graphed = times[False], times[True]
    return dict(batch=batch, mode=mode, eager_ms=eager[0] * 1e3, graphs_ms=graphed[0] * 1e3,
                speedup=eager[0] / graphed[0], eager_range_ms=[t * 1e3 for t in eager[1:]],
                graphs_range_ms=[t * 1e3 for t in graphed[1:]], same_tokens=same, graph_replays=graph_replays)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--tokens", type=int, default=None, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        if not args.quick:
            raise SystemExit("benches/cuda_graphs.py measures on a GPU; without CUDA only --quick runs (a smoke "
                             "run of the graphs' static path, interpreted)")
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("on CPU, --quick needs TRITON_INTERPRET=1 set before python starts")
        os.environ["HYBRIDSPEC_BACKEND"] = "triton"
    batches = args.batches or ([1] if args.quick else [1, 4, 16])
    tokens = args.tokens or (3 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 5)
    target = build(QUICK if args.quick else FULL, 0, device)
    draft = build(QUICK_DRAFT if args.quick else DRAFT, 1, device)
    print(describe_machine(), f"| {device}", flush=True)
    params = hs.SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    rows = []
    for batch in batches:
        prompts = [[(7 * b + 3 * i) % target.vocab_size for i in range(16)] for b in range(batch)]
        for mode, kwargs in (("plain", {}), ("speculative", dict(draft=draft, num_draft_tokens=GAMMA))):
            engines = {graphs: hs.Engine(target, max_batch_size=batch, max_model_len=256, cuda_graphs=graphs,
                                         **kwargs) for graphs in (False, True)}
            times, same = measure(engines, prompts, params, repeats, device)
            rows.append(result_row(batch, mode, times, same, engines[True].cache.graphs.replays))
        times, same = step_times(target, batch, tokens, repeats, device)
        rows.append(result_row(batch, "decode forward", times, same, None))
    print_table(rows, ["batch", "mode", ("eager_ms", "eager ms/token"), ("graphs_ms", "graphs ms/token"),
                       ("speedup", "eager / graphs"), ("same_tokens", "same tokens / logits")])
    write_json(args.out or out_dir() / "cuda_graphs.json",
               dict(device=str(device), quick=args.quick, tokens=tokens, repeats=repeats, rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
