"""Whether `torch.compile` speeds up the runtime's per-token torch work on CPU.

The parts of a step that are not matrix multiplications (those already run in
MKL/oneDNN) and that a compiler could fuse: the Mamba-2 recurrence of a
verify forward (γ + 1 = 5 inputs, a snapshot after each, written into ring
slots), the same for one decode input, and the gated RMSNorm after the
scan. Each runs eagerly (the runtime's own code: `mamba2_verify_ref` over a
`SlotPlan` whose snapshot slots form a grid, as with ring halves, and
`gate_and_norm`) and as the same math in a plain function compiled by
`torch.compile(dynamic=False)` (inductor's C++ backend), which writes the
snapshots with `copy_` into the same slots. Shapes are Bamba-9B's per head
(headdim 64, d_state 128) with 16 heads; batch 1 / 4 / 8; float32; CPU
seconds of this process, interleaved, median of `--repeats` after a warm-up
(the first compiled call, compile included, is reported apart).

    python benches/compile_probe.py           # the measurement (about a minute)
    python benches/compile_probe.py --quick   # tiny shapes, batch 1
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from common import bench_parser, describe_machine, print_table, set_threads, write_json

FULL = dict(nheads=16, headdim=64, d_state=128, batches=(1, 4, 8), repeats=21)
QUICK = dict(nheads=2, headdim=8, d_state=16, batches=(1,), repeats=3)
NUM_INPUTS = 5  # γ + 1 for γ = 4


def recurrence(state, snapshots, x, dt, A, B, C, D):
    """h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t ⊗ B_t with h_t copied into snapshots[t];
    returns y [batch, T, nheads, headdim]. B, C [batch, T, 1, d_state] (one group)."""
    decay = torch.exp(dt * A)
    ys = []
    for t in range(x.shape[1]):
        state = state * decay[:, t, :, None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        snapshots[t].copy_(state)
        ys.append((state * C[:, t, :, None, :]).sum(-1) + D[:, None] * x[:, t])
    return torch.stack(ys, 1)


def gated_norm(y, gate, weight, eps: float = 1e-6):
    """RMSNorm(y ⊙ silu(gate)) · weight over the last dimension (Mamba-2's gated norm, one group)."""
    h = y * torch.nn.functional.silu(gate)
    return weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def case(shape: dict, batch: int, num_inputs: int) -> dict:
    from hybridspec.kernels.slot_plan import SlotPlan
    g = torch.Generator().manual_seed(batch)
    nheads, headdim, d_state = shape["nheads"], shape["headdim"], shape["d_state"]
    rand = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    src = list(range(batch))  # offset-major pool: the heads at offset 0, snapshots at offsets 1 … T
    snap = [[batch * (1 + t) + b for t in range(num_inputs)] for b in src]
    return dict(pool=rand(batch * (num_inputs + 1), nheads, headdim, d_state), x=rand(batch, num_inputs, nheads, headdim),
                dt=torch.rand(batch, num_inputs, nheads, generator=g) * 0.1, A=-torch.rand(nheads, generator=g),
                B=rand(batch, num_inputs, 1, d_state), C=rand(batch, num_inputs, 1, d_state), D=rand(nheads),
                plan=SlotPlan.of_lists(src, snap, [num_inputs] * batch, "cpu"))


def compare(name: str, batch: int, eager, compiled, repeats: int) -> dict:
    """Median CPU ms of each, interleaved; the first compiled call (compile included) apart."""
    start = time.process_time()
    got = compiled()
    compile_s = time.process_time() - start
    want = eager()
    samples = {"eager": [], "compiled": []}
    for _ in range(repeats):
        for key, fn in (("eager", eager), ("compiled", compiled)):
            start = time.process_time()
            fn()
            samples[key].append(time.process_time() - start)
    eager_ms, compiled_ms = (1e3 * statistics.median(samples[k]) for k in ("eager", "compiled"))
    return dict(part=name, batch=batch, eager_ms=eager_ms, compiled_ms=compiled_ms,
                speedup=eager_ms / compiled_ms, first_call_s=compile_s, max_abs_diff=(got - want).abs().max().item())


def probe(shape: dict, batch: int, repeats: int) -> list[dict]:
    from hybridspec.kernels.triton.mamba2_verify import mamba2_verify_ref
    from hybridspec.kernels import backend
    from hybridspec.models.mamba2 import gate_and_norm
    from hybridspec.config import Mamba2Config
    rows = []
    for num_inputs, name in ((NUM_INPUTS, f"verify recurrence, {NUM_INPUTS} inputs"), (1, "decode recurrence, 1 input")):
        c = case(shape, batch, num_inputs)
        plan, pool = c["plan"], c["pool"]
        args = [c[k] for k in ("x", "dt", "A", "B", "C", "D")]
        grid = plan.grid_view(pool, time_major=True)
        compiled_fn = torch.compile(recurrence, dynamic=False)
        rows.append(compare(name, batch,
                            lambda: mamba2_verify_ref(pool, None, None, *args, None, plan=plan),
                            lambda: compiled_fn(pool[:batch], grid, *args), repeats))
    d_inner = shape["nheads"] * shape["headdim"]
    cfg = Mamba2Config(num_heads=shape["nheads"], head_dim=shape["headdim"], d_state=shape["d_state"])
    g = torch.Generator().manual_seed(0)
    y, gate, weight = (torch.randn(*s, generator=g) for s in ((batch, NUM_INPUTS, d_inner),) * 2 + ((d_inner,),))
    compiled_norm = torch.compile(gated_norm, dynamic=False)
    norm = backend.select("cpu", torch.float32).norm  # a float32 CPU model's (native where built)
    rows.append(compare("gated RMSNorm", batch, lambda: gate_and_norm(norm, y, gate, weight, cfg, 1e-6),
                        lambda: compiled_norm(y, gate, weight, 1e-6), repeats))
    return rows


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    threads = set_threads(args.threads)
    shape = QUICK if args.quick else FULL
    repeats = args.repeats or shape["repeats"]
    print(describe_machine(), flush=True)
    rows = [row for batch in shape["batches"] for row in probe(shape, batch, repeats)]
    print_table(rows, ["part", "batch", ("eager_ms", "eager ms"), ("compiled_ms", "compiled ms"), "speedup",
                       ("first_call_s", "first call s"), ("max_abs_diff", "max |diff|")],
                title="torch.compile against the eager torch paths (CPU ms, median; speedup = eager / compiled)")
    write_json(args.out or ("compile_probe_quick.json" if args.quick else "compile_probe.json"),
               dict(bench="compile_probe", quick=args.quick, threads=threads, shape=shape, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
