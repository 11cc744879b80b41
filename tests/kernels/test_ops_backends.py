"""Every op of `kernels.ops` on every backend this machine runs, against the torch
reference (the table's "torch" entry): the native C subclass (float32 CPU tensors;
float64 calls it declines run its torch form), the Triton subclass interpreted on
CPU tensors (TRITON_INTERPRET=1, conftest.py; tiny shapes), and the bfloat16-compute
products where the CPU has them. Each case's outputs and every tensor the op changes
in place (state slots, conv windows, K/V pages) are compared. The ops are found in
the module: a table (or single op object) without a case here fails the test."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybridspec.cache.paged_kv import KVWriteMeta
from hybridspec.cache.tree_plan import TreePlan
from hybridspec.kernels import ops
from hybridspec.kernels.cpu import native as cpu_native
from hybridspec.kernels.slot_plan import SlotPlan
from hybridspec.models.gdn_log import GdnInputLog
from hybridspec.models.mamba_log import MambaInputLog

KINDS = ("torch", "triton", "native")


def op_tables() -> dict[str, dict[str, object]]:
    """Every op of ops.py: its per-backend tables, and single op objects under their names."""
    found = {}
    for name, value in vars(ops).items():
        if isinstance(value, dict) and set(value) == set(KINDS):
            found[name] = value
        elif type(value).__module__ == ops.__name__ and not isinstance(value, type):
            found[name] = {"native": value}
    return found


def plan_batch(batch: int, T: int, live: list[int]) -> SimpleNamespace:
    """A forward's slots: row b's ring after its source slot, a snapshot after every other input and the last."""
    per_row = T + 3
    src = [b * per_row for b in range(batch)]
    snap = [[b * per_row + 1 + t if t % 2 == 0 or t == T - 1 else -1 for t in range(T)] for b in range(batch)]
    plan = SlotPlan(src, snap, live, "cpu")
    return SimpleNamespace(slots=plan, src_slot=plan.src, snap_slot=plan.snap, num_tokens=plan.num_tokens,
                           final_state_only=False, slots_count=batch * per_row)


def shapes(batch: int, T: int) -> list[tuple[int, int, list[int]]]:
    """Full rows, then padded rows (every other row one short)."""
    return [(batch, T, [T] * batch), (batch, T, [T - (b % 2) for b in range(batch)])]


def rand(g, *shape, dtype):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


# each case: (dtype, shape) -> (call(op, *tensors) -> output(s), tensors); tensors are cloned per backend
def linear_case(dtype, shape):
    g = torch.Generator().manual_seed(1)
    rows, k, n = shape
    return (lambda op, x, w, b: op(x, w, b)), [rand(g, rows, k, dtype=dtype), rand(g, n, k, dtype=dtype),
                                               rand(g, n, dtype=dtype)]


def norm_case(dtype, shape):
    g = torch.Generator().manual_seed(2)
    rows, hidden, group = shape
    return (lambda op, x, gate, w: (op.rms(x, w, 1e-6), op.gated(x, gate, w, group, 1e-6))), \
        [rand(g, 2, rows, hidden, dtype=dtype), rand(g, 2, rows, hidden, dtype=dtype), rand(g, hidden, dtype=dtype)]


def pointwise_case(dtype, shape):
    g = torch.Generator().manual_seed(3)
    return (lambda op, x: (op.softplus(x), op.sigmoid(x))), [rand(g, *shape, dtype=dtype) * 8]


def rotary_case(dtype, shape):
    g = torch.Generator().manual_seed(4)
    T, heads, head_dim, rotary_dim = shape
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    positions = torch.arange(3, 3 + T).view(1, T)
    return (lambda op, q: op(rotary_dim, head_dim, inv_freq.to(dtype), positions, dtype).apply(q)), \
        [rand(g, 1, T, heads, head_dim, dtype=dtype)]


def conv_window_case(dtype, shape):
    g = torch.Generator().manual_seed(5)
    batch, T, live = shape
    b = plan_batch(batch, T, live)
    conv_dim, d_conv = 12, 4
    return (lambda op, pool, xs, w, bias: op(pool, b, xs, w, bias, "silu")), [
        rand(g, b.slots_count, conv_dim, d_conv - 1, dtype=dtype), rand(g, batch, T, conv_dim, dtype=dtype),
        rand(g, conv_dim, d_conv, dtype=dtype), rand(g, conv_dim, dtype=dtype)]


def mamba2_inputs(g, dtype, batch, T, slots, nheads=2, headdim=4, d_state=8, ngroups=1):
    return [rand(g, slots, nheads, headdim, d_state, dtype=dtype), rand(g, batch, T, nheads, headdim, dtype=dtype),
            torch.rand(batch, T, nheads, generator=g, dtype=torch.float64).to(dtype),
            (-torch.rand(nheads, generator=g, dtype=torch.float64) - 0.1).to(dtype),
            rand(g, batch, T, ngroups, d_state, dtype=dtype), rand(g, batch, T, ngroups, d_state, dtype=dtype),
            rand(g, nheads, dtype=dtype)]


def mamba1_inputs(g, dtype, batch, T, slots, d_inner=6, d_state=8):  # d_state: the C loop takes multiples of 8
    return [rand(g, slots, d_inner, d_state, dtype=dtype), rand(g, batch, T, d_inner, dtype=dtype),
            torch.rand(batch, T, d_inner, generator=g, dtype=torch.float64).to(dtype),
            (-4 * torch.rand(d_inner, d_state, generator=g, dtype=torch.float64)).to(dtype),
            rand(g, batch, T, d_state, dtype=dtype), rand(g, batch, T, d_state, dtype=dtype),
            rand(g, d_inner, dtype=dtype)]


def gdn_inputs(g, dtype, batch, T, slots, heads=2, key_heads=1, d_k=8, d_v=8):
    q, k = (torch.nn.functional.normalize(rand(g, batch, T, key_heads, d_k, dtype=dtype), dim=-1) for _ in range(2))
    return [rand(g, slots, heads, d_k, d_v, dtype=dtype), q * d_k ** -0.5, k, rand(g, batch, T, heads, d_v, dtype=dtype),
            -torch.nn.functional.softplus(rand(g, batch, T, heads, dtype=dtype)),
            torch.sigmoid(rand(g, batch, T, heads, dtype=dtype))]


def mamba2_steps_case(dtype, shape):
    batch, T, live = shape
    b = plan_batch(batch, T, live)
    return (lambda op, pool, *args: op(pool, b, *args, None)), mamba2_inputs(torch.Generator().manual_seed(6), dtype,
                                                                          batch, T, b.slots_count)


def mamba1_steps_case(dtype, shape):
    batch, T, live = shape
    b = plan_batch(batch, T, live)
    return (lambda op, pool, *args: op(pool, b, *args)), mamba1_inputs(torch.Generator().manual_seed(7), dtype, batch,
                                                                    T, b.slots_count)


def gdn_steps_case(dtype, shape):
    batch, T, live = shape
    b = plan_batch(batch, T, live)
    return (lambda op, pool, *args: op(pool, b, *args, None)), gdn_inputs(torch.Generator().manual_seed(8), dtype,
                                                                       batch, T, b.slots_count)


def tree_forms_case(dtype, shape):
    """The conv window, each recurrence and attention over a tree per row (input t's parent (t - 1) // 2:
    two children a node, so siblings, a parent's state read back and depths past the conv window)."""
    batch, T, live = shape
    b = plan_batch(batch, T, live)
    tree = TreePlan([[(t - 1) // 2 if t else -1 for t in range(n)] for n in live], "cpu")
    g = torch.Generator().manual_seed(15)
    conv = [rand(g, b.slots_count, 12, 3, dtype=dtype), rand(g, batch, T, 12, dtype=dtype),
            rand(g, 12, 4, dtype=dtype), rand(g, 12, dtype=dtype)]
    tensors = (conv + mamba2_inputs(g, dtype, batch, T, b.slots_count)
               + mamba1_inputs(g, dtype, batch, T, b.slots_count) + gdn_inputs(g, dtype, batch, T, b.slots_count))
    meta, pages = kv_meta([n + 2 + row for row, n in enumerate(live)], live)
    tensors += [rand(g, batch, T, 4, 8, dtype=dtype), rand(g, pages, 4, 2, 8, dtype=dtype),
                rand(g, pages, 4, 2, 8, dtype=dtype)]

    def call(op, *tensors):
        conv, m2, m1, gdn, attention = tensors[:4], tensors[4:11], tensors[11:18], tensors[18:24], tensors[24:]
        return (*op.conv_window(conv[0], b.slots, tree, *conv[1:], "silu"), *op.mamba2(m2[0], b.slots, tree, *m2[1:]),
                *op.mamba1(m1[0], b.slots, tree, *m1[1:]), *op.gdn(gdn[0], b.slots, tree, *gdn[1:]),
                op.attention(*attention, meta, tree, 8 ** -0.5))
    return call, tensors


# replays: rows replay from their source slot over `steps` logged inputs from `first` into `dst` (-1: none)
def replay_rows(batch, T):
    slots = batch * (T + 3)
    src = torch.tensor([b * (T + 3) for b in range(batch)])
    dst = torch.tensor([b * (T + 3) + 1 if b != 1 else -1 for b in range(batch)])
    first = torch.tensor([b % 2 for b in range(batch)])
    steps = torch.tensor([T - b % 2 for b in range(batch)])
    return slots, src, dst, first, steps


def mamba_replay_case(inputs, seed):
    def case(dtype, shape):
        batch, T, _ = shape
        g = torch.Generator().manual_seed(seed)
        slots, src, dst, first, steps = replay_rows(batch, T)
        ssm, x, dt, A, B, C, D = inputs(g, dtype, batch, T, slots)
        conv_dim, d_conv = 10, 4
        conv, xs, w = (rand(g, slots, conv_dim, d_conv - 1, dtype=dtype), rand(g, batch, T, conv_dim, dtype=dtype),
                       rand(g, conv_dim, d_conv, dtype=dtype))

        def call(op, ssm, conv, xs, x, dt, B, C):
            op(ssm, conv, src, dst, first, steps, MambaInputLog(xs, x, dt, B, C), A, D, w, None)
        return call, [ssm, conv, xs, x, dt, B, C]
    return case


def gdn_replay_case(dtype, shape):
    batch, T, _ = shape
    g = torch.Generator().manual_seed(9)
    slots, src, dst, first, steps = replay_rows(batch, T)
    states, _, k, v, gate, beta = gdn_inputs(g, dtype, batch, T, slots)
    conv, xs = rand(g, slots, 10, 3, dtype=dtype), rand(g, batch, T, 10, dtype=dtype)

    def call(op, states, conv, xs, k, v, gate, beta):
        op(states, conv, src, dst, first, steps, GdnInputLog(xs, k, v, gate, beta))
    return call, [states, conv, xs, k, v, gate, beta]


def kv_meta(context, new, block_size=4):
    """Row b's pages laid end to end (row 1's reversed: a table that is not one run); its new tokens at the end."""
    tables, slots, page = [], [], 0
    for ctx, n in zip(context, new):
        pages = list(range(page, page + -(-ctx // block_size)))
        page += len(pages)
        tables.append(pages[::-1] if len(tables) == 1 else pages)
        slots.append([tables[-1][p // block_size] * block_size + p % block_size for p in range(ctx - n, ctx)]
                     + [-1] * (max(new) - n))
    return KVWriteMeta(range(len(context)), slots, tables, context, new, "cpu"), page


def paged_attention_case(dtype, shape):
    context, new = shape
    g = torch.Generator().manual_seed(10)
    meta, pages = kv_meta(context, new)
    heads, kv_heads, dim = 4, 2, 8
    return (lambda op, q, k, v: op(q, k, v, meta, dim ** -0.5)), [
        rand(g, len(context), max(new), heads, dim, dtype=dtype), rand(g, pages, 4, kv_heads, dim, dtype=dtype),
        rand(g, pages, 4, kv_heads, dim, dtype=dtype)]


def kv_write_case(dtype, shape):
    context, new = shape
    g = torch.Generator().manual_seed(11)
    meta, pages = kv_meta(context, new)
    return (lambda op, kf, vf, k, v: op(kf, vf, meta, k, v)), [
        rand(g, pages * 4, 2, 8, dtype=dtype), rand(g, pages * 4, 2, 8, dtype=dtype),
        rand(g, len(context), max(new), 2, 8, dtype=dtype), rand(g, len(context), max(new), 2, 8, dtype=dtype)]


def rejection_case(dtype, shape):
    batch, G, V = shape
    g = torch.Generator().manual_seed(12)
    target = torch.softmax(rand(g, batch, G + 1, V, dtype=dtype), -1)
    draft = torch.softmax(rand(g, batch, G, V, dtype=dtype), -1)
    tokens = torch.multinomial(draft.view(-1, V).double(), 1, generator=g).view(batch, G)
    num_draft = torch.tensor([G - b % 2 for b in range(batch)])
    mode = torch.tensor([b % 3 for b in range(batch)])  # greedy, rejection, coupled
    seeds, positions = torch.arange(batch, dtype=torch.long) + 5, torch.arange(batch, dtype=torch.long) * 7
    return (lambda op, t, d: op(t, d, tokens, num_draft, mode, seeds, positions)), [target, draft]


def bf16_linear_reference(x, w, b):
    """What NativeBf16Linear computes: x rounded to bfloat16 times the bfloat16 weight, float32 sums."""
    return ops.LINEAR["torch"](x.to(torch.bfloat16).to(x.dtype), w, b)


def bf16_linear_case(dtype, shape):
    call, (x, w, b) = linear_case(dtype, shape)
    return call, [x, w.to(torch.bfloat16), b]


# op -> (its case, the shapes it runs at)
CASES = {
    "LINEAR": (linear_case, [(1, 16, 8), (5, 40, 24)]),
    "NATIVE_BF16_LINEAR": (bf16_linear_case, [(1, 32, 16), (3, 64, 8)]),
    "NORM": (norm_case, [(1, 16, 4), (3, 40, 8)]),
    "POINTWISE": (pointwise_case, [(7,), (3, 37)]),
    "ROTARY": (rotary_case, [(1, 2, 8, 8), (3, 2, 16, 8)]),
    "CONV_WINDOW": (conv_window_case, shapes(1, 1) + shapes(3, 3)),
    "MAMBA2_STEPS": (mamba2_steps_case, shapes(1, 1) + shapes(3, 3)),
    "MAMBA1_STEPS": (mamba1_steps_case, shapes(1, 1) + shapes(3, 3)),
    "GDN_STEPS": (gdn_steps_case, shapes(1, 1) + shapes(3, 3)),
    "MAMBA2_REPLAY": (mamba_replay_case(mamba2_inputs, 13), [(1, 2, None), (3, 3, None)]),
    "MAMBA1_REPLAY": (mamba_replay_case(mamba1_inputs, 14), [(1, 2, None), (3, 3, None)]),
    "GDN_REPLAY": (gdn_replay_case, [(1, 2, None), (3, 3, None)]),
    "PAGED_ATTENTION": (paged_attention_case, [([3], [1]), ([9, 6, 4], [2, 3, 1])]),
    "KV_WRITE": (kv_write_case, [([3], [1]), ([9, 6, 4], [2, 3, 1])]),
    "REJECTION": (rejection_case, [(1, 2, 8), (3, 3, 16)]),
    "TREE_FORMS": (tree_forms_case, shapes(1, 1) + shapes(3, 7)),
}
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=0, atol=0)}
# where the project promises the torch form's bits in float32 too: the rotation (cpu/test_rope.py), the K/V scatter
EXACT = {"ROTARY", "KV_WRITE"}


def triton_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    from hybridspec.kernels.triton import rejection
    return isinstance(rejection._rejection_kernel, InterpretedFunction)


def runs_here(name: str, kind: str, dtype: torch.dtype) -> str | None:
    """Why (op, backend, dtype) cannot run on this machine, or None."""
    if kind == "native" and not cpu_native.available():
        return "the native kernels are not built here"
    if name == "NATIVE_BF16_LINEAR" and not cpu_native.bf16_compute_supported():
        return "no AVX512-BF16 here"
    if name == "NATIVE_BF16_LINEAR" and dtype is not torch.float32:
        return "bfloat16 compute is for float32 models"
    if kind == "triton" and dtype is not torch.float32:
        return "Triton runs in float32 here (interpreted)"
    if kind == "triton" and not triton_interpreted():
        return "the Triton kernels are compiled for a GPU, not interpreted"
    return None


def test_every_op_has_a_case():
    """Every op with more than one implementation (one object on every backend: nothing to compare)."""
    compared = {name for name, table in op_tables().items() if len({id(op) for op in table.values()}) > 1
                or len(table) == 1}
    assert compared == set(CASES), "ops without a case here (or cases without an op): " \
        f"{sorted(compared ^ set(CASES))}"


PARAMS = [pytest.param(name, kind, dtype, i, id=f"{name}-{kind}-{str(dtype)[6:]}-{i}")
          for name, table in op_tables().items() for kind in table if kind != "torch"
          for dtype in (torch.float32, torch.float64) for i in range(len(CASES.get(name, (None, []))[1]))]


def as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else () if out is None else (out,)


@pytest.mark.parametrize("name, kind, dtype, index", PARAMS)
def test_op_on_backend_matches_the_torch_reference(name, kind, dtype, index):
    why = runs_here(name, kind, dtype)
    if why:
        pytest.skip(why)
    make, case_shapes = CASES[name]
    call, tensors = make(dtype, case_shapes[index])
    ref_tensors, got_tensors = [t.clone() for t in tensors], [t.clone() for t in tensors]
    op = op_tables()[name][kind]
    if name == "NATIVE_BF16_LINEAR":
        want = as_tuple(bf16_linear_reference(*ref_tensors))
    else:
        want = as_tuple(call(op_tables()[name]["torch"], *ref_tensors))
    got = as_tuple(call(op, *got_tensors))
    tolerance = dict(rtol=0, atol=0) if name in EXACT else TOLERANCE[dtype]
    if name == "NATIVE_BF16_LINEAR":
        tolerance = dict(rtol=1e-4, atol=1e-4)  # float32 sums in another order
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, **tolerance, msg=lambda m: f"output {i}: {m}")
    for i, (g, w, before) in enumerate(zip(got_tensors, ref_tensors, tensors)):  # what each changed in place
        torch.testing.assert_close(g, w, **tolerance, msg=lambda m: f"argument {i}: {m}")
        assert torch.equal(g, before) == torch.equal(w, before), f"argument {i} changed by one side only"
