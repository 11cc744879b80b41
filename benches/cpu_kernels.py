"""The native CPU kernels: few-row products against MKL, and what they make of a step.

The native CPU kernels (`hybridspec/kernels/cpu/native.py`): few-row products,
`torch.mm` (MKL) against the kernel `linear` takes for 1 … 96 rows
(`cpu/rows.c`), with the weights out of cache as in a decode step; then what
the three kernels together (products, the Mamba-2 recurrence `cpu/mamba2.c`,
the conv window `cpu/conv.c`) make of one model step and of a verify forward
of γ + 1 = 5 tokens.

Products: the weight shapes of the embedded target (hidden 256) and of the
random Bamba of `benches/round_cost.py` (hidden 512), input-major float32.
Each timed call multiplies the same rows by `COPIES` different weights of
that shape (together larger than the last-level cache, so every weight comes
from memory); µs per product. The two implementations alternate call by call,
`repeats` rounds; the table gives the median and the min–max.

Steps: the embedded target's and draft's plain decode step (1 input) and a
forward of 5 inputs with a snapshot after every input (what a verify does),
at batch 1, with the native kernels off (backend "torch"), on under the
modules ("native-ops"), on with whole blocks layer by layer
("native-blocks") and on with the whole forward in one
call (the default), alternating; ms per forward.

    python benches/cpu_kernels.py            # about a minute
    python benches/cpu_kernels.py --quick    # seconds
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from common import bench_parser, describe_machine, print_table, set_threads, write_json

SHAPES = {"embedded in_proj": (256, 1160), "embedded MLP up": (256, 384), "embedded out_proj": (512, 256),
          "hidden 512 in_proj": (512, 2320), "hidden 512 MLP up": (512, 3072), "hidden 512 MLP down": (1536, 512)}
ROWS = (1, 2, 5, 8, 16, 20, 40, 64, 96)
COPIES_BYTES = 96 << 20  # weights per timed call: past any last-level cache this project runs on


def product_rows(shapes: dict, rows: tuple, repeats: int, copies_bytes: int) -> list[dict]:
    from hybridspec.kernels.cpu import native as cpu_native
    from hybridspec.kernels.cpu import rows as cpu_rows
    out = []
    for name, (K, N) in shapes.items():
        g = torch.Generator().manual_seed(K + N)
        copies = max(2, copies_bytes // (4 * K * N))
        weights = [torch.randn(K, N, generator=g) for _ in range(copies)]
        for M in rows:
            x = torch.randn(M, K, generator=g)
            fns = {"mkl": lambda: [torch.mm(x, w) for w in weights]}
            if M <= cpu_rows.MAX_ROWS:
                fns["kernel"] = lambda: [cpu_rows.rows_matmul(x, w) for w in weights]
            samples = {k: [] for k in fns}
            for fn in fns.values():
                fn()
            for _ in range(repeats):
                for key, fn in fns.items():
                    start = time.perf_counter()
                    fn()
                    samples[key].append(1e6 * (time.perf_counter() - start) / copies)
            row = {"product": name, "K": K, "N": N, "rows": M}
            for key, s in samples.items():
                row[f"{key}_us"], row[f"{key}_min"], row[f"{key}_max"] = statistics.median(s), min(s), max(s)
            row["speedup"] = row["mkl_us"] / row["kernel_us"] if "kernel_us" in row else None
            out.append(row)
    return out


MODES = (("torch", "torch"), ("kernels, modules", "native-ops"),  # name, backend (`hybridspec.kernels.backend`)
         ("kernels, whole blocks", "native-blocks"), ("kernels, whole forward", "native"))


def step_rows(repeats: int) -> list[dict]:
    """The embedded target and draft at batch 1: a decode step and a 5-input
    snapshotted forward, in each of MODES (all native kernels off; the kernels
    under the modules; the whole blocks layer by layer; the whole forward in
    one call), CPU seconds, alternating."""
    import hybridspec as hs
    from hybridspec.cache.hybrid_cache import HybridCache
    from hybridspec.checkpoints.policy import ring_halves_by_default
    from hybridspec.checkpoints.ring import plan_snapshots
    from hybridspec.adapters.embedded import embedded_paths
    prompt = list(b"def parse(self, text):\n    for line in text.splitlines():\n        if not line:" * 3)
    forwards, models = {}, {}
    for name, path in zip(("target", "draft"), embedded_paths()):
        model = models[name] = hs.load(path)
        ring = hs.CheckpointPolicy().ring_size(4, halves=ring_halves_by_default(model.device))
        cache = HybridCache(model.config, max_seqs=1, num_blocks=8, block_size=64, ring_slots=ring, dtype=model.dtype)
        model.prefill(cache, [0], [prompt], last_only=True)

        def forward(n: int, model=model, cache=cache, length=cache.computed_len[0], head=cache.head(0)):
            snap = torch.tensor([plan_snapshots(cache.states.ring_slots(0), head, list(range(n)), n).snap_slot])
            model.extend(cache, [0], [prompt[-n:]], last_only=n == 1, snap_slot=snap)
            cache.rewind_to(0, length, head)
        forwards[name] = forward
    cases = [(model, mode, n) for model in forwards for mode in MODES for n in (1, 5)]
    samples = {key: [] for key in cases}
    try:
        for _ in range(repeats + 1):
            for model, mode, n in cases:
                models[model].bind_backend(mode[1])
                start = time.process_time()
                forwards[model](n)
                samples[(model, mode, n)].append(time.process_time() - start)
    finally:
        for m in models.values():
            m.bind_backend()
    rows = []
    for model in forwards:
        for mode in MODES:
            step, verify = (statistics.median(samples[(model, mode, n)][1:]) for n in (1, 5))
            rows.append({"model": model, "kernels": mode[0], "step_ms": 1e3 * step, "verify_ms": 1e3 * verify,
                         "verify_steps": verify / step})
    return rows


def main(argv=None) -> int:
    args = bench_parser(__doc__).parse_args(argv)
    from hybridspec.kernels.cpu import native as cpu_native
    threads = set_threads(args.threads)
    print(describe_machine(), flush=True)
    if not cpu_native.available():
        print("the native CPU kernels cannot run here (see the warning); nothing to compare")
        return 1
    shapes = dict(list(SHAPES.items())[:1]) if args.quick else SHAPES
    products = product_rows(shapes, (1, 5, 97) if args.quick else ROWS, 2 if args.quick else 7,
                            4 << 20 if args.quick else COPIES_BYTES)
    print_table(products, ["product", "K", "N", "rows", ("mkl_us", "MKL µs"), ("mkl_min", "min"), ("mkl_max", "max"),
                           ("kernel_us", "kernel µs"), ("kernel_min", "min"), ("kernel_max", "max"),
                           ("speedup", "MKL / kernel")],
                title=f"products with weights out of cache, float32, {threads} thread(s), median of "
                      f"{2 if args.quick else 7} alternating calls (min–max)")
    steps = step_rows(3 if args.quick else 15)
    print_table(steps, ["model", "kernels", ("step_ms", "decode step ms"), ("verify_ms", "5-input forward ms"),
                        ("verify_steps", "forward / step")],
                title="embedded pair, batch 1, CPU ms (median, alternating)")
    write_json(args.out or ("cpu_kernels_quick.json" if args.quick else "cpu_kernels.json"),
               {"bench": "cpu_kernels", "quick": args.quick, "threads": threads, "products": products,
                "steps": steps})
    return 0


if __name__ == "__main__":
    sys.exit(main())
