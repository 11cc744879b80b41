"""The state kernels in C against the torch references they stand in for:
the Mamba-2 and Mamba-1 recurrences (`kernels/cpu/mamba2.c`, `cpu/mamba1.c`)
and the conv window (`kernels/cpu/conv.c`) give the same outputs and the same snapshot writes,
for decode and multi-input forwards, groups, steps without a snapshot, padded
rows (zeros out, nothing written after a row's last live input, even where its
plan names a slot), and in a model run whose states match the torch paths'."""
from __future__ import annotations

import pytest
import torch

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.kernels.cpu import blocks as cpu_blocks
from hybridspec.kernels.cpu import conv as cpu_conv
from hybridspec.kernels.cpu import mamba1 as cpu_mamba1
from hybridspec.kernels.cpu import mamba2 as cpu_mamba2
from hybridspec.kernels.triton.mamba1_verify import mamba1_verify_ref
from hybridspec.kernels.triton.conv_window import conv_window_update_ref
from hybridspec.kernels.triton.mamba2_verify import mamba2_verify_ref
from hybridspec.kernels.slot_plan import SlotPlan
from native_cpu import both_vector_paths, one_thread, x86_with_compiler  # noqa: F401 (fixtures; one_thread autouse)
from oracles import bamba, jamba

pytestmark = x86_with_compiler

CASES = [  # batch, T, nheads, headdim, d_state, ngroups
    (1, 1, 8, 64, 64, 1), (1, 5, 8, 64, 64, 1), (3, 5, 4, 16, 12, 2), (2, 3, 6, 8, 5, 3), (4, 1, 2, 4, 8, 1)]


def inputs(batch, T, nheads, headdim, d_state, ngroups, seed=0):
    g = torch.Generator().manual_seed(seed)
    per_row = T + 3
    pool = torch.randn(batch * per_row, nheads, headdim, d_state, generator=g)
    src = [b * per_row for b in range(batch)]
    # a snapshot after every other input and after the last; the others stay in scratch
    snap = [[b * per_row + 1 + t if t % 2 == 0 or t == T - 1 else -1 for t in range(T)] for b in range(batch)]
    x = torch.randn(batch, T, nheads, headdim, generator=g)
    dt = torch.rand(batch, T, nheads, generator=g)
    A = -torch.rand(nheads, generator=g) - 0.1
    B = torch.randn(batch, T, ngroups, d_state, generator=g)
    C = torch.randn(batch, T, ngroups, d_state, generator=g)
    D = torch.randn(nheads, generator=g)
    return pool, src, snap, (x, dt, A, B, C, D)


def lengths(batch: int, T: int, padded: bool) -> list[int]:
    """Live inputs per row: all, or every other row one or two short."""
    return [max(T - (b % 2) * (1 + b % 3), 0) if padded else T for b in range(batch)]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_same_outputs_and_snapshot_writes_as_the_reference(case, padded):
    batch, T = case[:2]
    pool, src, snap, args = inputs(*case)
    ref_pool, native_pool = pool.clone(), pool.clone()
    live = lengths(batch, T, padded)
    want = mamba2_verify_ref(ref_pool, None, None, *args, None, plan=SlotPlan(src, snap, live, "cpu"))
    plan = SlotPlan(src, snap, live, "cpu")
    assert cpu_mamba2.applies(native_pool, args[0], plan)
    got = cpu_mamba2.mamba2_steps(native_pool, plan, *args)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native_pool, ref_pool, rtol=1e-5, atol=1e-5)
    written = {s for row, n in zip(snap, live) for s in row[:n] if s >= 0}
    untouched = [s for s in range(len(pool)) if s not in written]
    assert torch.equal(native_pool[untouched], pool[untouched])  # sources and unplanned slots kept


@pytest.mark.parametrize("case", [(2, 5, 4, 64, 128, 1), (3, 4, 4, 16, 32, 2), (1, 3, 2, 8, 48, 1),
                                  (2, 3, 6, 8, 5, 3), (1, 2, 2, 6, 32, 1)])
@pytest.mark.parametrize("misaligned", [False, True])
def test_the_avx512_recurrence_gives_the_avx2_bits(both_vector_paths, case, misaligned):
    """On AVX-512 the state's update takes 16 columns per vector and four rows
    of a head at a time, y's sums the AVX2 loop's 8-lane chains: the same y
    and the same snapshot bits. Bamba's 64 × 128 heads, groups, d_state 48 (a
    last vector of 8 columns), then shapes the AVX2 loop keeps (d_state 5,
    headdim 6); slots 64- and 32-byte aligned (the streaming stores' vectors)."""
    pool, src, snap, args = inputs(*case, seed=3)
    live = [case[1]] * case[0]

    def placed(states):  # a copy, its slots 64-byte aligned or 8 floats past such a boundary
        buffer = torch.empty(states.numel() + 16)
        skip = (-buffer.data_ptr() // 4) % 16 + (8 if misaligned else 0)
        out = buffer[skip:skip + states.numel()].view(states.shape).copy_(states)
        assert out.data_ptr() % 64 == (32 if misaligned else 0)
        return out

    def run():
        native_pool = placed(pool)
        y = cpu_mamba2.mamba2_steps(native_pool, SlotPlan(src, snap, live, "cpu"), *args)
        return y, native_pool

    (y2, pool2), (y16, pool16) = both_vector_paths(run)
    assert torch.equal(y2, y16) and torch.equal(pool2, pool16)


MAMBA1_CASES = [(1, 1, 64, 16), (1, 5, 512, 16), (3, 4, 12, 8), (2, 3, 7, 64)]  # batch, T, d_inner, d_state


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("case", MAMBA1_CASES)
def test_mamba1_same_outputs_and_snapshot_writes_as_the_reference(case, padded):
    batch, T, d_inner, d_state = case
    g = torch.Generator().manual_seed(d_inner + T)
    per_row = T + 3
    pool = torch.randn(batch * per_row, d_inner, d_state, generator=g)
    src = [b * per_row for b in range(batch)]
    snap = [[b * per_row + 1 + t if t % 2 == 0 or t == T - 1 else -1 for t in range(T)] for b in range(batch)]
    x, dt = torch.randn(batch, T, d_inner, generator=g), 2 * torch.rand(batch, T, d_inner, generator=g)
    A = -8 * torch.rand(d_inner, d_state, generator=g)  # exp(Δ·A) down to e^-16
    B, C = torch.randn(batch, T, d_state, generator=g), torch.randn(batch, T, d_state, generator=g)
    D = torch.randn(d_inner, generator=g)
    ref_pool, native_pool = pool.clone(), pool.clone()
    live = lengths(batch, T, padded)
    want = mamba1_verify_ref(ref_pool, None, None, x, dt, A, B, C, D, None, plan=SlotPlan(src, snap, live, "cpu"))
    plan = SlotPlan(src, snap, live, "cpu")
    assert cpu_mamba1.applies(native_pool, x, plan)
    got = cpu_mamba1.mamba1_steps(native_pool, plan, x, dt, A, B, C, D)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native_pool, ref_pool, rtol=1e-5, atol=1e-6)
    assert not cpu_mamba1.applies(torch.zeros(4, 3, 12), x, plan)  # d_state 12: not a multiple of 8


@pytest.mark.parametrize("case", [(2, 5, 64, 16), (1, 3, 7, 32), (2, 4, 5, 48), (1, 2, 6, 8)])
@pytest.mark.parametrize("misaligned", [False, True])
def test_the_avx512_mamba1_recurrence_gives_the_avx2_bits(both_vector_paths, case, misaligned):
    """On AVX-512 two channels at a time, their state rows in 16-lane vectors
    with exp16 and y's sums as the AVX2 loop's 8-lane chains: the same y and
    snapshots, bit for bit. d_state 16, 32 (an odd channel left to the AVX2
    loop), 48 and 8 (AVX2 only); slots 64-byte aligned or 8 floats past, and
    decays down to e^-16 and below (exp's clamp)."""
    batch, T, d_inner, d_state = case
    g = torch.Generator().manual_seed(d_inner * T + d_state)
    per_row = T + 2
    pool = torch.randn(batch * per_row, d_inner, d_state, generator=g)
    src = [b * per_row for b in range(batch)]
    snap = [[b * per_row + 1 + t if t % 2 == 0 or t == T - 1 else -1 for t in range(T)] for b in range(batch)]
    x, dt = torch.randn(batch, T, d_inner, generator=g), 4 * torch.rand(batch, T, d_inner, generator=g)
    A = -30 * torch.rand(d_inner, d_state, generator=g)
    B, C = torch.randn(batch, T, d_state, generator=g), torch.randn(batch, T, d_state, generator=g)
    D = torch.randn(d_inner, generator=g)

    def run():
        buffer = torch.empty(pool.numel() + 16)
        skip = (-buffer.data_ptr() // 4) % 16 + (8 if misaligned else 0)
        states = buffer[skip:skip + pool.numel()].view(pool.shape).copy_(pool)
        y = cpu_mamba1.mamba1_steps(states, SlotPlan(src, snap, [T] * batch, "cpu"), x, dt, A, B, C, D)
        return y, states

    (y2, pool2), (y16, pool16) = both_vector_paths(run)
    assert torch.equal(y2, y16) and torch.equal(pool2, pool16)


CONV_CASES = [  # batch, T, conv_dim, d_conv, bias, activation
    (1, 1, 640, 4, True, "silu"), (1, 5, 640, 4, True, "silu"), (3, 4, 7, 3, False, None), (2, 2, 5, 4, True, None),
    (2, 40, 21, 4, True, "silu")]  # a prefill's length, channels past the last multiple of 8


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("case", CONV_CASES)
def test_conv_window_same_outputs_and_windows_as_the_reference(case, padded):
    batch, T, conv_dim, d_conv, has_bias, activation = case
    g = torch.Generator().manual_seed(conv_dim + T)
    per_row = T + 3
    pool = torch.randn(batch * per_row, conv_dim, d_conv - 1, generator=g)
    src = [b * per_row for b in range(batch)]
    snap = [[b * per_row + 1 + t if t % 2 == 0 or t == T - 1 else -1 for t in range(T)] for b in range(batch)]
    xs = torch.randn(batch, T, conv_dim, generator=g)
    weight = torch.randn(conv_dim, d_conv, generator=g)
    bias = torch.randn(conv_dim, generator=g) if has_bias else None
    ref_pool, native_pool = pool.clone(), pool.clone()
    live = lengths(batch, T, padded)
    want = conv_window_update_ref(ref_pool, None, None, xs, weight, bias, None, activation,
                                  plan=SlotPlan(src, snap, live, "cpu"))
    plan = SlotPlan(src, snap, live, "cpu")
    assert cpu_conv.applies(native_pool, xs, weight, bias, activation, plan)
    got = cpu_conv.conv_window_steps(native_pool, plan, xs, weight, bias, activation)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(native_pool, ref_pool)  # windows are copies of inputs: bit for bit


def test_conv_window_prefill_gets_the_bits_of_steps_one_by_one():
    """An output of the conv depends only on its own inputs: one call over 40 inputs
    gives the bits of 40 one-input calls, each starting from the window the last wrote."""
    g = torch.Generator().manual_seed(7)
    conv_dim, d_conv, T = 21, 4, 40
    xs = torch.randn(1, T, conv_dim, generator=g)
    weight, bias = torch.randn(conv_dim, d_conv, generator=g), torch.randn(conv_dim, generator=g)
    pool = torch.randn(2, conv_dim, d_conv - 1, generator=g)
    whole_pool, step_pool = pool.clone(), pool.clone()
    whole = cpu_conv.conv_window_steps(whole_pool, SlotPlan([0], [[-1] * (T - 1) + [1]], [T], "cpu"), xs, weight,
                                       bias, "silu")
    steps = []
    for t in range(T):  # ping-pong between the two slots
        plan = SlotPlan([t % 2], [[(t + 1) % 2]], [1], "cpu")
        steps.append(cpu_conv.conv_window_steps(step_pool, plan, xs[:, t:t + 1].contiguous(), weight, bias, "silu"))
    assert torch.equal(whole, torch.cat(steps, 1))
    assert torch.equal(whole_pool[1], step_pool[T % 2])


def test_float64_and_no_plan_take_the_reference_more_threads_do_not():
    pool, src, snap, args = inputs(2, 3, 2, 4, 8, 1)
    assert cpu_mamba2.applies(pool, args[0], SlotPlan(src, snap, [3, 2], "cpu"))  # a padded row: the C loop
    assert not cpu_mamba2.applies(pool.double(), args[0].double(), SlotPlan(src, snap, [3, 3], "cpu"))
    assert not cpu_mamba2.applies(pool, args[0], None)
    conv_pool, xs, weight = torch.zeros(8, 4, 3), torch.zeros(2, 3, 4), torch.zeros(4, 4)
    assert cpu_conv.applies(conv_pool, xs, weight, None, "silu", SlotPlan(src, snap, [3, 2], "cpu"))
    assert cpu_conv.applies(conv_pool, xs, weight, None, "silu", SlotPlan(src, snap, [3, 3], "cpu"))
    torch.set_num_threads(2)  # the state kernels run at any thread count (on the calling thread)
    assert cpu_mamba2.applies(pool, args[0], SlotPlan(src, snap, [3, 3], "cpu"))
    assert cpu_conv.applies(conv_pool, xs, weight, None, "silu", SlotPlan(src, snap, [3, 3], "cpu"))


@pytest.mark.parametrize("build", [bamba, jamba])
def test_a_float32_model_keeps_the_torch_paths_states(monkeypatch, build):
    """Prefill, then decode and a 4-input snapshotted forward through the C
    recurrence and conv: the ring holds what the torch paths write, to float32 rounding."""
    model = hs.from_hf(build(seed=4, dtype=torch.float32)).pack_for_cpu()
    prompt = [5, 17, 3, 42, 8, 11, 2, 9, 30]

    def run():
        cache = HybridCache(model.config, max_seqs=1, num_blocks=4, block_size=16, ring_slots=8, dtype=model.dtype)
        model.prefill(cache, [0], [prompt], last_only=True)
        decoded = model.decode(cache, [0], [7])
        head = cache.head(0)
        snap = torch.tensor([[head + 1 + t if head + 1 + t < 8 else head + 1 + t - 8 for t in range(4)]])
        verified = model.extend(cache, [0], [[1, 2, 3, 4]], snap_slot=snap)
        return decoded, verified, [s.clone() for s in (*cache.states.ssm_states, *cache.states.conv_states)]

    calls = []
    model.bind_backend("native-ops")  # the modules' C paths (test_blocks: the blocks)
    for module, name in ((cpu_mamba2, "mamba2_steps"), (cpu_mamba1, "mamba1_steps"), (cpu_conv, "conv_window_steps")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    native = run()
    recurrence = "mamba2_steps" if build is bamba else "mamba1_steps"
    assert recurrence in calls and "conv_window_steps" in calls  # the C paths ran (decode and the 4 inputs)
    calls.clear()
    model.bind_backend("torch")
    reference = run()
    assert not calls
    for a, b in zip(native[:2], reference[:2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for a, b in zip(native[2], reference[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_float32_prefill_runs_the_c_recurrence_where_the_torch_path_takes_the_chunked_scan(monkeypatch):
    """A prefill past `SSD_MIN_TOKENS` and past the whole forward's rows (the
    modules run) runs the Mamba-2 recurrence in C over all its inputs; its
    logits and final states are the chunked SSD scan's (the torch path), to
    float32 rounding."""
    from hybridspec.models import mamba2
    model = hs.from_hf(bamba(seed=5, dtype=torch.float32)).pack_for_cpu()
    prompt = [(7 * i + 3) % 50 + 1 for i in range(cpu_blocks.BLOCK_ROWS + 8)]
    assert len(prompt) >= mamba2.SSD_MIN_TOKENS

    def run():
        cache = HybridCache(model.config, max_seqs=1, num_blocks=8, block_size=16, ring_slots=8, dtype=model.dtype)
        logits = model.prefill(cache, [0], [prompt], last_only=True)
        return logits, [s.clone() for s in (*cache.states.ssm_states, *cache.states.conv_states)]

    lengths, scans = [], []
    real_steps, real_scan = cpu_mamba2.mamba2_steps, mamba2.Mamba2Mixer.chunked_scan
    monkeypatch.setattr(cpu_mamba2, "mamba2_steps", lambda *a: lengths.append(a[2].shape[1]) or real_steps(*a))
    monkeypatch.setattr(mamba2.Mamba2Mixer, "chunked_scan", lambda *a: scans.append(1) or real_scan(*a))
    native = run()
    assert lengths and set(lengths) == {len(prompt)} and not scans
    native_calls = len(lengths)
    model.bind_backend("torch")
    reference = run()
    assert scans and len(lengths) == native_calls  # the torch path scanned, without the C recurrence
    torch.testing.assert_close(native[0], reference[0], rtol=1e-4, atol=1e-4)
    for a, b in zip(native[1], reference[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
