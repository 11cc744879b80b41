"""Tensor parallel on CPU: per-rank memory and step time at TP = 1 and 2.

A random float32 Bamba (round_cost's FULL shape: hidden 512, 8 layers, 35.8M
parameters; --quick: its QUICK shape) is run three ways:
- one process, one torch thread (TP = 1);
- one process, two torch threads (what two cores give without sharding);
- TP = 2: two spawned processes of a gloo group, one thread each, every rank
  holding one shard (`hs.from_hf(..., tensor_parallel_size=2)`).
Per rank: the bytes of its weights, its KV pages and its state pool (states,
conv windows, rings; `HybridCache` at `--batch` sequences); and the wall time
of a plain decode step and of a verify forward of γ + 1 = 5 inputs with a
snapshot after every input (a speculative round's target pass; the drafter
runs whole on every rank, so TP does not change its cost), at `--batch`
sequences: median with min-max of `--repeats` after a warm-up (round_cost's
ScratchCache, rolled back after each forward). The one-process variants
alternate call by call; the TP = 2 ranks run afterwards (the group runs in
lockstep; rank 0's times, every rank's memory).

Two choices measured on the TP = 2 ranks (tables 2 and 3):
- the embedding and LM head replicated (every rank the whole table, no
  exchange) or vocab-parallel (each rank its rows; the lookups summed and the
  logits gathered across ranks), at the bench's vocabulary and at two larger
  ones, batch 1 and 16 (`--vocab-shapes`); the runtime splits them;
- the drafter replicated (whole on every rank) or sharded like the target:
  a speculative `generate` (γ = 4, round_cost's pair) with each, the same
  tokens, its wall time.

    python benches/tensor_parallel.py            # the measurement (a few minutes)
    python benches/tensor_parallel.py --quick    # tiny model, a smoke run
"""
from __future__ import annotations

import functools
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import bench_parser, describe_machine, out_dir, print_table, write_json
from threads import interleaved, spread

GAMMA = 4
SIZE = 2


def tensor_bytes(obj) -> int:
    """Bytes of the tensors an object holds in its attributes (tensors, or lists/tuples/dicts of them)."""
    def walk(value) -> int:
        if isinstance(value, torch.Tensor):
            return value.nbytes
        if isinstance(value, (list, tuple)):
            return sum(walk(v) for v in value)
        if isinstance(value, dict):
            return sum(walk(v) for v in value.values())
        return 0
    return sum(walk(v) for v in vars(obj).values())


def memory(model, scratch) -> dict:
    weights = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    return dict(weights_mb=weights / 2**20, kv_mb=tensor_bytes(scratch.cache.kv) / 2**20,
                states_mb=tensor_bytes(scratch.cache.states) / 2**20)


def time_forwards(scratch, repeats: int, threads: list[int]) -> dict:
    """{(part, threads): seconds samples}, alternating parts and thread counts call by call after a warm-up."""
    parts = {"plain decode step": 1, f"verify ({GAMMA + 1} inputs)": GAMMA + 1}
    return interleaved({part: functools.partial(scratch.forward, inputs) for part, inputs in parts.items()},
                       threads, repeats)


def build(quick: bool):
    from round_cost import FULL, QUICK
    from memory_vs_replay import build_bamba
    return build_bamba(QUICK if quick else FULL)


def one_process(quick: bool, batch: int, repeats: int) -> list[dict]:
    import hybridspec as hs
    from round_cost import ScratchCache
    model = hs.from_hf(build(quick))
    scratch = ScratchCache(model, batch)
    mem = memory(model, scratch)
    samples = time_forwards(scratch, repeats, [1, 2])
    torch.set_num_threads(1)
    return [dict(variant=f"TP=1, {t} thread{'s' * (t > 1)}", part=p, batch=batch, rank=0, **mem, **spread(s))
            for (p, t), s in samples.items()]


def _rank(rank: int, tmp: str, quick: bool, batch: int, repeats: int, vocab_shapes: list) -> None:
    import hybridspec as hs
    from round_cost import ScratchCache
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=SIZE)
    try:
        model = hs.from_hf(build(quick), tensor_parallel_size=SIZE)
        scratch = ScratchCache(model, batch)
        mem = memory(model, scratch)
        samples = time_forwards(scratch, repeats, [1])
        rows = [dict(variant=f"TP={SIZE}, 1 thread per rank", part=p, batch=batch, rank=rank, **mem, **spread(s))
                for (p, _), s in samples.items()]
        tables = vocab_tables(rank, vocab_shapes, repeats)
        drafters = drafter_placement(quick, repeats)
        torch.save((rows, tables, drafters), os.path.join(tmp, f"{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def timed(fn, samples: list[float]) -> None:
    """One call of fn after the ranks meet (so neither times the other's lag), its wall time appended."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    samples.append(time.perf_counter() - start)


def vocab_tables(rank: int, shapes: list[tuple[int, int]], repeats: int) -> list[dict]:
    """Per (vocab, hidden) and batch 1 / 16: the LM head's product over the whole
    table against one rank's half and the gather of every rank's logits, and the
    embedding lookup against one rank's masked lookup and the sum over ranks."""
    rows = []
    for vocab, hidden in shapes:
        g = torch.Generator().manual_seed(0)
        table = torch.randn(vocab, hidden, generator=g)  # [vocab, hidden]
        share = -(-vocab // SIZE)
        half = table[rank * share:(rank + 1) * share].contiguous()
        for batch in (1, 16):
            h = torch.randn(batch, hidden, generator=g)
            ids = torch.randint(0, vocab, (batch,), generator=g)

            def gathered():
                part = h @ half.T
                parts = [torch.empty_like(part) for _ in range(SIZE)]
                dist.all_gather(parts, part)
                torch.cat(parts, -1)

            def summed():
                local = ids - rank * share
                mine = (local >= 0) & (local < share)
                found = half.index_select(0, local.clamp(0, share - 1))
                dist.all_reduce(torch.where(mine.unsqueeze(-1), found, torch.zeros_like(found)))
            calls = {"LM head, replicated": lambda: h @ table.T, "LM head, vocab-parallel": gathered,
                     "embedding, replicated": lambda: table.index_select(0, ids), "embedding, vocab-parallel": summed}
            samples = {name: [] for name in calls}
            for index in range(repeats + 1):
                for name, fn in calls.items():
                    timed(fn, samples[name] if index else [])
            for name, s in samples.items():
                rows.append(dict(rank=rank, part=name, vocab=vocab, hidden=hidden, batch=batch,
                                 table_mb=(table if "replicated" in name else half).nbytes / 2**20, **spread(s)))
    return rows


def drafter_placement(quick: bool, repeats: int) -> list[dict]:
    """A speculative generate (γ = 4, 4 prompts, batch 4) on the sharded target
    with round_cost's drafter replicated and sharded: wall time, and whether
    both give the same tokens."""
    import hybridspec as hs
    from round_cost import FULL, QUICK, build_pair
    hf_target, hf_draft = build_pair(QUICK if quick else FULL, 0.03)
    target = hs.from_hf(hf_target, tensor_parallel_size=SIZE)
    drafts = {"replicated": hs.from_hf(hf_draft), "sharded": hs.from_hf(hf_draft, tensor_parallel_size=SIZE)}
    prompts = [[(7 * i + j) % 200 + 1 for j in range(32)] for i in range(4)]
    params = hs.SamplingParams(max_new_tokens=8 if quick else 32, ignore_eos=True)
    samples, tokens = {name: [] for name in drafts}, {}
    for index in range(repeats + 1):
        for name, draft in drafts.items():
            engine = hs.Engine(target, draft=draft, num_draft_tokens=GAMMA, max_batch_size=4,
                               tensor_parallel_size=SIZE)
            timed(lambda: tokens.__setitem__(name, [o.token_ids for o in engine.generate(prompts, params)]),
                  samples[name] if index else [])
    same = tokens["replicated"] == tokens["sharded"]
    return [dict(drafter=name, weights_mb=sum(p.nbytes for p in drafts[name].parameters()) / 2**20,
                 new_tokens=len(prompts) * params.max_new_tokens, same_tokens=same, **spread(s))
            for name, s in samples.items()]


def sharded(quick: bool, batch: int, repeats: int, vocab_shapes: list) -> tuple[list, list, list]:
    """(forward rows of every rank, rank 0's vocab-table rows, rank 0's drafter rows)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(tmp, quick, batch, repeats, vocab_shapes), nprocs=SIZE, start_method="spawn")
        ranks = [torch.load(os.path.join(tmp, f"{rank}.pt")) for rank in range(SIZE)]
    return [row for rows, _, _ in ranks for row in rows], ranks[0][1], ranks[0][2]


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per variant (default 7; quick 2)")
    parser.add_argument("--vocab-shapes", type=str, default=None,
                        help="vocab×hidden tables to time, e.g. 4096x512,32000x1024,151936x2048 (the default; "
                             "quick: 256x64)")
    args = parser.parse_args(argv)
    spec = args.vocab_shapes or ("256x64" if args.quick else "4096x512,32000x1024,151936x2048")
    vocab_shapes = [tuple(int(n) for n in shape.split("x")) for shape in spec.split(",")]
    repeats = args.repeats or (2 if args.quick else 7)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the spawned ranks import these benches
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)),
                                                             os.environ.get("PYTHONPATH")]))
    before = torch.get_num_threads()
    try:
        rows = one_process(args.quick, args.batch, repeats)
        tp_rows, tables, drafters = sharded(args.quick, args.batch, repeats, vocab_shapes)
        rows += tp_rows
    finally:
        torch.set_num_threads(before)
    base = {r["part"]: r["ms"] for r in rows if r["variant"].startswith("TP=1, 1 ")}
    for row in rows:
        row["vs_tp1"] = base[row["part"]] / row["ms"]
    print(describe_machine())
    print_table(rows, ["variant", "rank", "part", "batch", ("weights_mb", "weights MiB"), ("kv_mb", "KV MiB"),
                       ("states_mb", "states MiB"), "ms", "min_ms", "max_ms", ("vs_tp1", "speedup vs TP=1, 1 thr")])
    print(f"\nEmbedding and LM head at TP={SIZE}, rank 0 (replicated: the whole table; vocab-parallel: its rows "
          "and the exchange)")
    print_table(tables, ["part", "vocab", "hidden", "batch", ("table_mb", "table MiB"), "ms", "min_ms", "max_ms"])
    print(f"\nDrafter placement at TP={SIZE}, rank 0: speculative generate, γ = {GAMMA}")
    print_table(drafters, ["drafter", ("weights_mb", "weights MiB"), "new_tokens", "same_tokens", "ms", "min_ms",
                           "max_ms"])
    write_json(args.out or out_dir() / "tensor_parallel.json",
               dict(quick=args.quick, batch=args.batch, repeats=repeats, gamma=GAMMA, rows=rows,
                    vocab_tables=tables, drafters=drafters))
    return 0


if __name__ == "__main__":
    sys.exit(main())
