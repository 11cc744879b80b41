"""Each Triton kernel against its torch reference and its memory bandwidth bound (CUDA).

The bandwidth reached is the bytes a kernel must move over its time.

    TRITON_INTERPRET=0 python benches/kernel_timing.py [--quick]

Prints a table and writes benches/out/kernel_timing.json. Needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch


def cuda_time(fn, repeats: int = 20) -> float:
    """Median seconds of fn() measured with CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


SIZES = {  # batch, T, nheads, headdim, d_state, ngroups, vocabulary
    "full": (32, 5, 128, 64, 128, 8, 128256),
    "quick": (4, 5, 32, 64, 128, 1, 4096),
    "tiny": (2, 3, 2, 8, 16, 1, 64),  # the test of the cases' arguments (interpreted on CPU)
}
GDN_SIZES = {  # value heads, key heads, d_k, d_v (Qwen3-Next's GDN layer; batch and T as above)
    "full": (32, 16, 128, 128),
    "quick": (32, 16, 128, 128),
    "tiny": (2, 1, 8, 16),
}


def cases(size: str, dev="cuda"):
    """(name, kernel call, reference call, bytes the kernel must move)."""
    from hybridspec.kernels.triton import conv_window
    from hybridspec.kernels.triton import mamba2_verify
    from hybridspec.kernels.triton import rejection
    from hybridspec.kernels.triton import ssm_replay
    f32 = torch.float32
    batch, T, nheads, headdim, d_state, ngroups, V = SIZES[size]
    slots = batch * (T + 1)
    states = torch.randn(slots, nheads, headdim, d_state, device=dev, dtype=f32)
    src = torch.arange(batch, device=dev) * (T + 1)
    snap = src[:, None] + 1 + torch.arange(T, device=dev)
    x = torch.randn(batch, T, nheads, headdim, device=dev, dtype=f32)
    dt = torch.rand(batch, T, nheads, device=dev, dtype=f32) * 0.1
    A = -torch.rand(nheads, device=dev, dtype=f32)
    B = torch.randn(batch, T, ngroups, d_state, device=dev, dtype=f32)
    C = torch.randn(batch, T, ngroups, d_state, device=dev, dtype=f32)
    D = torch.randn(nheads, device=dev, dtype=f32)
    ntok = torch.full((batch,), T, device=dev)
    state_bytes = states[0].numel() * 4 * batch
    args = (states, src, snap, x, dt, A, B, C, D, ntok)
    yield ("mamba2_verify", lambda: mamba2_verify.mamba2_verify(*args), lambda: mamba2_verify.mamba2_verify_ref(*args),
           state_bytes * (1 + T) + nbytes(x, dt, B, C) * 2)
    rargs = (states, src, snap[:, -1].contiguous(), ntok, x, dt, A, B, C)
    yield ("mamba2_replay", lambda: ssm_replay.mamba2_replay(*rargs), lambda: ssm_replay.mamba2_replay_ref(*rargs),
           state_bytes * 2 + nbytes(x, dt, B))
    conv_dim, d_conv = nheads * headdim + 2 * ngroups * d_state, 4
    conv = torch.randn(slots, conv_dim, d_conv - 1, device=dev, dtype=f32)
    xs = torch.randn(batch, T, conv_dim, device=dev, dtype=f32)
    w, bias = torch.randn(conv_dim, d_conv, device=dev, dtype=f32), torch.randn(conv_dim, device=dev, dtype=f32)
    cargs = (conv, src, snap, xs, w, bias, ntok, "silu")
    yield ("conv_window_update", lambda: conv_window.conv_window_update(*cargs),
           lambda: conv_window.conv_window_update_ref(*cargs), nbytes(xs) * 2 + conv[0].numel() * 4 * batch * (1 + T))
    yield from gdn_cases(size, dev, src, snap, ntok)
    G = 4
    p = torch.softmax(torch.randn(batch, G + 1, V, device=dev), -1)
    q = torch.softmax(torch.randn(batch, G, V, device=dev), -1)
    d = torch.randint(0, V, (batch, G), device=dev)
    modes = torch.arange(batch, device=dev) % 3
    seeds, pos = torch.arange(batch, device=dev) + 1, torch.full((batch,), 100, device=dev)
    nd = torch.full((batch,), G, device=dev)
    jargs = (p, q, d, nd, modes, seeds, pos)
    yield ("rejection", lambda: rejection.rejection(*jargs), lambda: rejection.rejection_ref(*jargs), nbytes(p, q))


def gdn_cases(size: str, dev, src, snap, ntok):
    """The GDN verify update and log replay over the same slot plan as Mamba-2's."""
    from hybridspec.kernels.triton import gdn_verify
    batch, T = snap.shape
    heads, key_heads, d_k, d_v = GDN_SIZES[size]
    states = torch.randn(batch * (T + 1), heads, d_k, d_v, device=dev)
    q, k = (torch.nn.functional.normalize(torch.randn(batch, T, key_heads, d_k, device=dev), dim=-1)
            for _ in range(2))
    v = torch.randn(batch, T, heads, d_v, device=dev)
    g = -torch.rand(batch, T, heads, device=dev)
    beta = torch.rand(batch, T, heads, device=dev)
    state_bytes = states[0].numel() * 4 * batch
    args = (states, src, snap, q, k, v, g, beta, ntok)
    yield ("gdn_verify", lambda: gdn_verify.gdn_verify(*args), lambda: gdn_verify.gdn_verify_ref(*args),
           state_bytes * (1 + T) + nbytes(q, k, v, g, beta, v))
    rargs = (states, src, snap[:, -1].contiguous(), ntok, k, v, g, beta)
    yield ("gdn_replay", lambda: gdn_verify.gdn_replay(*rargs), lambda: gdn_verify.gdn_replay_ref(*rargs),
           state_bytes * 2 + nbytes(k, v, g, beta))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_timing: no CUDA device; nothing to time", file=sys.stderr)
        return 0
    peak = float(torch.cuda.get_device_properties(0).total_memory)  # printed for context only
    rows = []
    for name, kernel, ref, moved in cases("quick" if args.quick else "full"):
        tk, tr = cuda_time(kernel), cuda_time(ref)
        rows.append(dict(kernel=name, kernel_us=tk * 1e6, ref_us=tr * 1e6, speedup_vs_ref=tr / tk,
                         bytes=moved, achieved_GBps=moved / tk / 1e9))
    print(f"{'kernel':<20}{'kernel us':>12}{'ref us':>12}{'x ref':>8}{'GB/s':>10}")
    for r in rows:
        print(f"{r['kernel']:<20}{r['kernel_us']:>12.1f}{r['ref_us']:>12.1f}{r['speedup_vs_ref']:>8.1f}"
              f"{r['achieved_GBps']:>10.1f}")
    print("GB/s = bytes the kernel must read and write / kernel time (H200 HBM3e peak ~4800 GB/s, assumed)")
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    payload = dict(device=torch.cuda.get_device_name(0), memory_bytes=peak, torch=torch.__version__,
                   platform=platform.platform(), rows=rows)
    (out / "kernel_timing.json").write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
