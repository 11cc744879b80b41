"""Operations (GPU kernel launches) per decode step and verify forward on the GPU path.

Device work per forward on the GPU path, counted on any machine: the
operations a decode step and a verify forward issue where the Triton kernels
run, which on a GPU are kernel launches, eager or captured in a CUDA graph.

The GPU path runs here on CPU tensors with the Triton kernels interpreted
(`HYBRIDSPEC_BACKEND=triton`); what is counted does
not depend on the device: every aten operation that is not a view (a view
launches nothing) issued outside a Triton kernel, and every Triton launch.
With `cuda_graphs=True` the forward is the same operations, replayed from
one graph launch; `ForwardGraphs.run` adds the copy of the static buffers
and the copy of the logits. Models: the embedded target and its draft
(--quick: the draft only, batch 1), batch 1 and 4, after a 20-token prompt.

    TRITON_INTERPRET=1 python benches/gpu_launches.py [--quick]

Prints a table and writes benches/out/gpu_launches.json.
"""
from __future__ import annotations

import os

import torch

from common import bench_parser, describe_machine, out_dir, print_table, set_threads, write_json

GAMMA = 4


class LaunchCounter:
    """Counts non-view aten operations outside Triton launches, and Triton launches, while active."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from triton.runtime.interpreter import InterpretedFunction
        counter = self
        self.ops = self.launches = 0
        self._inside = False
        self._function, self._run = InterpretedFunction, InterpretedFunction.run

        def run(kernel, *args, **kwargs):
            counter.launches += 1
            counter._inside = True
            try:
                return counter._run(kernel, *args, **kwargs)
            finally:
                counter._inside = False

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not counter._inside and not func.is_view:
                    counter.ops += 1
                return func(*args, **(kwargs or {}))

        self._run_wrapper, self._mode = run, Mode()

    def __enter__(self):
        self.ops = self.launches = 0
        self._function.run = self._run_wrapper
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._function.run = self._run


def forward_counts(model, batch: int, num_inputs: int) -> dict:
    """Operations and Triton launches of one forward of `num_inputs` inputs per
    row at `batch` (more than one: a verify forward with a snapshot after every
    input, as a round plans them), after the same forward once untimed."""
    from hybridspec.cache.hybrid_cache import HybridCache
    from hybridspec.checkpoints.ring import plan_snapshots
    cache = HybridCache(model.config, max_seqs=batch, num_blocks=batch * 8, block_size=16, ring_slots=GAMMA + 2,
                        dtype=model.dtype, device=model.device)
    ids = list(range(batch))
    model.prefill(cache, ids, [[65 + b] * 20 for b in ids], last_only=True)
    heads = [cache.head(b) for b in ids]
    snap = [plan_snapshots(cache.states.ring_slots(b), h, list(range(num_inputs)), num_inputs).snap_slot
            for b, h in zip(ids, heads)] if num_inputs > 1 else None
    tokens = [[66 + b] * num_inputs for b in ids]
    def forward():
        model.extend(cache, ids, tokens, last_only=num_inputs == 1, snap_slot=snap)
        for b, h in zip(ids, heads):  # back to the prompt
            cache.rewind_to(b, 20, h)

    forward()  # warm-up
    with LaunchCounter() as counter:
        forward()
    return dict(ops=counter.ops, triton_launches=counter.launches, launches=counter.ops + counter.launches)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("benches/gpu_launches.py counts on the interpreted GPU path: run it with "
                         "TRITON_INTERPRET=1 set before python starts")
    import hybridspec as hs
    from hybridspec.adapters.embedded import embedded_paths
    os.environ["HYBRIDSPEC_BACKEND"] = "triton"
    set_threads(args.threads)
    target_dir, draft_dir = embedded_paths()
    models = {} if args.quick else {"embedded target": hs.load(target_dir, dtype=torch.float32)}
    models["embedded draft"] = hs.load(draft_dir, dtype=torch.float32)
    print(describe_machine(), "| GPU path, interpreted", flush=True)
    rows = []
    for name, model in models.items():
        for batch in ([1] if args.quick else [1, 4]):
            for kind, num_inputs in (("decode step", 1), (f"verify, {GAMMA + 1} inputs", GAMMA + 1)):
                rows.append(dict(model=name, forward=kind, batch=batch, **forward_counts(model, batch, num_inputs)))
    print_table(rows, ["model", "forward", "batch", ("ops", "aten ops"), ("triton_launches", "Triton launches"),
                       ("launches", "launches, eager")])
    print("with cuda_graphs=True each is one graph launch, plus the copy of its static buffers and of its logits")
    write_json(args.out or out_dir() / "gpu_launches.json", dict(rows=rows, quick=args.quick))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
