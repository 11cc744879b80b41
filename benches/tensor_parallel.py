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

    python benches/tensor_parallel.py            # the measurement (a minute or two)
    python benches/tensor_parallel.py --quick    # tiny model, a smoke run
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import bench_parser, describe_machine, out_dir, print_table, write_json

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


def spread(samples: list[float]) -> dict:
    return {"ms": 1e3 * statistics.median(samples), "min_ms": 1e3 * min(samples), "max_ms": 1e3 * max(samples)}


def time_forwards(scratch, repeats: int, threads: list[int]) -> dict:
    """{(part, threads): seconds samples}, alternating parts and thread counts call by call after a warm-up."""
    parts = {"plain decode step": 1, f"verify ({GAMMA + 1} inputs)": GAMMA + 1}
    samples = {(p, t): [] for p in parts for t in threads}
    for index in range(repeats + 1):
        for part, inputs in parts.items():
            for t in threads:
                torch.set_num_threads(t)
                start = time.perf_counter()
                scratch.forward(inputs)
                if index:
                    samples[(part, t)].append(time.perf_counter() - start)
    return samples


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


def _rank(rank: int, tmp: str, quick: bool, batch: int, repeats: int) -> None:
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
        torch.save(rows, os.path.join(tmp, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def sharded(quick: bool, batch: int, repeats: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(tmp, quick, batch, repeats), nprocs=SIZE, start_method="spawn")
        return [row for rank in range(SIZE) for row in torch.load(os.path.join(tmp, f"{rank}.pt"))]


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per variant (default 7; quick 2)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 7)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the spawned ranks import these benches
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)),
                                                             os.environ.get("PYTHONPATH")]))
    before = torch.get_num_threads()
    try:
        rows = one_process(args.quick, args.batch, repeats) + sharded(args.quick, args.batch, repeats)
    finally:
        torch.set_num_threads(before)
    base = {r["part"]: r["ms"] for r in rows if r["variant"].startswith("TP=1, 1 ")}
    for row in rows:
        row["vs_tp1"] = base[row["part"]] / row["ms"]
    print(describe_machine())
    print_table(rows, ["variant", "rank", "part", "batch", ("weights_mb", "weights MiB"), ("kv_mb", "KV MiB"),
                       ("states_mb", "states MiB"), "ms", "min_ms", "max_ms", ("vs_tp1", "speedup vs TP=1, 1 thr")])
    write_json(args.out or out_dir() / "tensor_parallel.json",
               dict(quick=args.quick, batch=args.batch, repeats=repeats, gamma=GAMMA, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
