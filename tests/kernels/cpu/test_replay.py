"""Log replay on CPU in float32 runs the forward's own C loops
(`models/log_replay.py`): each replayed state, SSM and conv window, is bit for
bit the snapshot the verify forward wrote after the same input, for Mamba-2
and Mamba-1 layers, with rows that skip, copy, or start past the round's first
input; and it equals what the torch references give."""
from __future__ import annotations

import pytest
import torch

from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.kernels.cpu import native as cpu_native
from hybridspec.rollback.models import tiny_model
from native_switch import backend_of

T = 5  # a verify of γ + 1 inputs
ROWS = 3

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels not built here")


@pytest.fixture(params=["mamba2", "mamba1"])
def logged(request):
    """A float32 model with `request.param` mixers, its cache after a verify
    forward of T inputs per row with a snapshot after every input, the input
    log, and each row's (head, snapshot slots, spare slots)."""
    family = request.param
    model = tiny_model(layer_types=(family, "attention", family), dtype=torch.float32, seed=3)
    cache = HybridCache(model.config, max_seqs=ROWS, num_blocks=32, block_size=8, ring_slots=2 * T + 2,
                        dtype=torch.float32)
    ids = list(range(ROWS))
    model.prefill(cache, ids, [[(5 * b + 3 * i + 1) % model.vocab_size for i in range(6 + b)] for b in ids])
    heads = [cache.head(s) for s in ids]
    rings = [cache.states.ring_slots(s) for s in ids]

    def after_head(b: int, i: int) -> int:
        return rings[b][(rings[b].index(heads[b]) + i) % len(rings[b])]

    snaps = [[after_head(b, 1 + t) for t in range(T)] for b in ids]  # the state after input t
    spares = [[after_head(b, 1 + T + j) for j in range(T + 1)] for b in ids]
    log = {}
    drafts = [[(7 * b + 2 * t + 4) % model.vocab_size for t in range(T)] for b in ids]
    model.extend(cache, ids, drafts, snap_slot=torch.tensor(snaps), input_log=log)
    assert sorted(log) == list(range(len(model.recurrent_layers)))
    return model, cache, log, heads, snaps, spares


def replay_all(model, cache, log, src, dst, first, steps):
    tensor = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    for layer in model.recurrent_layers:
        layer.replay(cache.states, tensor(src), tensor(dst), tensor(first), tensor(steps), log[layer.state_layer])


def pools(cache):
    return [p.clone() for p in (*cache.states.ssm_states, *cache.states.conv_states)]


CASES = {  # (first, steps, dst -1 skips) per row; the source is the state before input `first`
    "from the head": ([0, 0, 0], [1, 3, 5], [True, True, True]),
    "other starts": ([0, 2, 1], [2, 3, 4], [True, True, True]),
    "skip and copy": ([1, 0, 3], [2, 0, 2], [False, True, True]),
    "one row": ([2, 0, 0], [3, 1, 1], [True, False, False]),
}


@pytest.mark.parametrize("case", CASES)
def test_replay_writes_the_forwards_snapshot_bits(logged, case, monkeypatch):
    model, cache, log, heads, snaps, spares = logged
    first, steps, writes = CASES[case]
    replay = getattr(model.backend, model.recurrent_layers[0].replay_op)  # the native replay op of its kind
    calls = []
    native = replay.steps
    monkeypatch.setattr(replay, "steps", lambda *a: calls.append(1) or native(*a))
    src = [heads[b] if first[b] == 0 else snaps[b][first[b] - 1] for b in range(ROWS)]
    dst = [spares[b][0] if writes[b] else -1 for b in range(ROWS)]
    before = pools(cache)
    replay_all(model, cache, log, src, dst, first, steps)
    assert calls, "the native replay did not run"
    written = {d for d in dst if d >= 0}
    for layer in range(len(model.recurrent_layers)):
        for pool, old in ((cache.states.ssm_states[layer], before[layer]),
                          (cache.states.conv_states[layer], before[len(model.recurrent_layers) + layer])):
            for b in range(ROWS):
                if writes[b]:
                    n = first[b] + steps[b]
                    expected = old[heads[b]] if n == 0 else old[snaps[b][n - 1]]
                    assert torch.equal(pool[dst[b]], expected), (case, layer, b)
            untouched = [s for s in range(pool.shape[0]) if s not in written]
            assert torch.equal(pool[untouched], old[untouched])


def test_the_references_replay_the_same_math(logged):
    """The torch references replay the same math: conv windows (copies of logged
    inputs) to the bit, SSM states within float32 rounding. The C loops' exp
    (glibc's expf, or Mamba-1's vector exp) and torch's vectorised exp differ in
    the last bit for some inputs, which inputs depending on the CPU's vector
    width, which is why a replay must run the forward's own loop for its state
    to be the snapshot (`test_replay_writes_the_forwards_snapshot_bits`)."""
    model, cache, log, heads, snaps, spares = logged
    first, steps = [0, 1, 2], [4, 2, 3]
    src = [heads[0], snaps[1][0], snaps[2][1]]
    replay_all(model, cache, log, src, [spares[b][1] for b in range(ROWS)], first, steps)
    with backend_of(model, "torch"):
        replay_all(model, cache, log, src, [spares[b][2] for b in range(ROWS)], first, steps)
    for layer in range(len(model.recurrent_layers)):
        for b in range(ROWS):
            native, reference = (cache.states.conv_states[layer][spares[b][k]] for k in (1, 2))
            assert torch.equal(native, reference), (layer, b)
            native, reference = (cache.states.ssm_states[layer][spares[b][k]] for k in (1, 2))
            torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-6)
