"""The native C tree forward (`kernels/cpu/forward.c` with parents): on a tiny
float32 Mamba-2 + attention model packed for CPU, each tree input's logits,
states (in its ring slot) and K/V are a chain forward's over its path, bit for
bit; a chain passed as a tree is the chain; the torch tree forms agree within
float32 rounding (their products and exponentials are torch's, not the C
kernels'); greedy and coupled tree rounds give plain decoding's tokens with the invariant
checked after every commit, and the rounds ran native.

Mamba-1 and GDN hybrids (which the whole forward does not take) run a tree
layer by layer with the C tree forms of the recurrences (`cpu/tree.py`): the
first layer's states are the native chain's along each path bit for bit (the
later layers' within float32 rounding, after attention's torch tree form),
and their tree rounds give plain decoding's tokens."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.cache.tree_batch import TreeBatch
from hybridspec.checkpoints.ring import plan_snapshots
from hybridspec.engine.engine import Engine
from hybridspec.rollback.models import perturbed_copy, plain_outputs, random_model, random_mtp, tiny_model
from hybridspec.spec.mtp_drafter import MTPDrafter
from hybridspec.spec.tree import TreeShape
from native_cpu import one_thread, x86_with_compiler  # noqa: F401 (fixtures)
from native_switch import whole_forward_off
from test_tree_drafts import StateParity
from test_tree_proof import assert_rows_are_a_prefills, recorded_rows

pytestmark = x86_with_compiler

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [40, 41]]
PARENTS = [[-1, 0, 0, 1, 2, 3], [-1, 0, 1, 0]]
TOKENS = [[PROMPTS[0][-1], 20, 21, 22, 23, 24], [PROMPTS[1][-1], 30, 31, 32]]


@pytest.fixture(scope="module")
def model():
    return tiny_model(0, ("mamba2", "attention", "mamba2"), dtype=torch.float32).pack_for_cpu()


@pytest.fixture(scope="module", params=[8, 64], ids=["head_dim 8", "head_dim 64"])
def forward_model(request, model):
    """The model, and one whose attention heads take the AVX-512 value loops (head_dim ≥ 64)."""
    if request.param == model.config.attention.head_dim:
        return model
    config = model.config
    config = dataclasses.replace(config, attention=dataclasses.replace(config.attention, head_dim=request.param))
    return random_model(config, 0, torch.float32).pack_for_cpu()


def _cache(model) -> HybridCache:
    return HybridCache(model.config, max_seqs=4, num_blocks=24, block_size=4, ring_slots=8, dtype=model.dtype)


def _prefilled(model, rows: list[list[int]]) -> HybridCache:
    cache = _cache(model)
    model.prefill(cache, list(range(len(rows))), rows)
    return cache


def _snap(cache: HybridCache, seqs: list[int], counts: list[int], T: int) -> list[list[int]]:
    """[batch][T] a ring slot per input, none the head (what `Checkpointer.plan_tree` plans
    under k = 1 where the ring holds them)."""
    return [plan_snapshots(cache.states.ring_slots(s), cache.head(s), list(range(n)), T).snap_slot
            for s, n in zip(seqs, counts)]


def _kv_at(cache: HybridCache, seq: int, position: int) -> list[torch.Tensor]:
    """Every attention layer's K and V at `position` of `seq`."""
    bs = cache.block_size
    slot = cache.kv.block_table(seq)[position // bs] * bs + position % bs
    return [c.view(c.shape[0], -1, *c.shape[3:])[:, slot] for c in (cache.kv.k_cache, cache.kv.v_cache)]


def _states(cache: HybridCache, slot: int) -> list[torch.Tensor]:
    return [t[slot] for t in (*cache.states.ssm_states, *cache.states.conv_states)]


def _tree_forward(model, cache, tree: TreeBatch):
    snap = _snap(cache, [0, 1], [len(p) for p in PARENTS], len(TOKENS[0]))
    return model.extend(cache, [0, 1], TOKENS, tree=tree, snap_slot=snap), snap


def test_native_tree_forward_is_the_chain_along_each_path(forward_model):
    model = forward_model
    cache = _prefilled(model, [p[:-1] for p in PROMPTS[:2]])
    starts = [len(p) - 1 for p in PROMPTS[:2]]
    tree = TreeBatch(PARENTS, "cpu")
    logits, snap = _tree_forward(model, cache, tree)  # [2, 6, vocab]
    assert tree.in_ring and not tree.ssm  # the whole C forward ran it
    for b, parents in enumerate(PARENTS):
        for t in range(len(parents)):
            path = tree.plan.path_to(b, t)
            chain = _prefilled(model, [PROMPTS[b][:-1]])
            want = model.extend(chain, [0], [[TOKENS[b][i] for i in path]])[0, -1]
            assert torch.equal(logits[b, t], want)
            for got, expected in zip(_states(cache, snap[b][t]), _states(chain, chain.head(0))):
                assert torch.equal(got, expected)
            depth = len(path) - 1  # input t's K/V at start + t hold what the chain wrote at start + depth
            for got, expected in zip(_kv_at(cache, b, starts[b] + t), _kv_at(chain, 0, starts[b] + depth)):
                assert torch.equal(got, expected)


def test_a_chain_passed_as_a_tree_is_the_chain(forward_model):
    model = forward_model
    chain_parents = [[-1, 0, 1, 2], [-1, 0, 1, 2]]
    tokens = [[9, 20, 21, 22], [13, 30, 31, 32]]
    caches = [_prefilled(model, [p[:-1] for p in PROMPTS[:2]]) for _ in range(2)]
    snap = _snap(caches[0], [0, 1], [4, 4], 4)
    tree = TreeBatch(chain_parents, "cpu")
    as_tree = model.extend(caches[0], [0, 1], tokens, tree=tree, snap_slot=snap)
    as_chain = model.extend(caches[1], [0, 1], tokens, snap_slot=snap)
    assert tree.in_ring and torch.equal(as_tree, as_chain)
    for got, want in zip((*caches[0].states.ssm_states, *caches[0].states.conv_states, caches[0].kv.k_cache,
                          caches[0].kv.v_cache),
                         (*caches[1].states.ssm_states, *caches[1].states.conv_states, caches[1].kv.k_cache,
                          caches[1].kv.v_cache)):
        assert torch.equal(got, want)


def test_the_torch_tree_forms_agree_within_float32_rounding(forward_model):
    model = forward_model
    native_cache = _prefilled(model, [p[:-1] for p in PROMPTS[:2]])
    tree = TreeBatch(PARENTS, "cpu")
    native, snap = _tree_forward(model, native_cache, tree)
    with whole_forward_off(model):
        forms_cache = _prefilled(model, [p[:-1] for p in PROMPTS[:2]])
        forms = TreeBatch(PARENTS, "cpu")
        torch_logits, _ = _tree_forward(model, forms_cache, forms)
    assert not forms.in_ring and forms.ssm  # the torch forms kept every input's state
    for b, parents in enumerate(PARENTS):
        n = len(parents)
        torch.testing.assert_close(native[b, :n], torch_logits[b, :n], rtol=1e-4, atol=1e-4)
        for layer in forms.ssm:
            for t in range(n):
                for kept, pool in ((forms.ssm, native_cache.states.ssm_states),
                                   (forms.conv, native_cache.states.conv_states)):
                    torch.testing.assert_close(pool[layer][snap[b][t]], kept[layer][b, t].to(torch.float32),
                                               rtol=1e-4, atol=1e-5)
        start = len(PROMPTS[b]) - 1
        for t in range(n):
            for got, want in zip(_kv_at(native_cache, b, start + t), _kv_at(forms_cache, b, start + t)):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


class NativeRounds(StateParity):
    """StateParity, also counting the tree rounds whose forward ran in C (states in the ring)."""

    def __init__(self, engine: Engine):
        super().__init__(engine)
        self.native = 0

    def committed(self, round):
        self.native += round.tree is not None and round.tree.in_ring
        super().committed(round)


@pytest.mark.parametrize("verify,temperature", [("rejection", 0.0), ("coupled", 0.9)])
@pytest.mark.parametrize("shape", [(2,), (3, 2)])
def test_native_tree_rounds_equal_plain_output(model, verify, temperature, shape):
    draft = perturbed_copy(model, 0.3, 1)
    params = [hs.SamplingParams(max_new_tokens=n, temperature=temperature, seed=s)
              for n, s in ((16, 1), (11, 2), (13, 3))]
    engine = Engine(model, draft=draft, num_draft_tokens=4, verify=verify, block_size=4, tree=TreeShape(shape))
    engine.speculator.check = True  # the boundary invariant after every commit (HYBRIDSPEC_CHECK)
    rounds = NativeRounds(engine)
    engine.speculator.hooks.append(rounds)
    outputs = engine.generate(PROMPTS, params)
    expected = plain_outputs(model, PROMPTS, params)  # coupled: plain seeded sampling's tokens
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert rounds.native == rounds.tree_rounds > 0 and rounds.checked > 0


def test_native_tree_rounds_keep_the_hidden_states_an_mtp_drafter_reads(model):
    """The whole C forward takes an MTP drafter's trees too: every hidden-state row the
    drafter takes equals the target's at that position in a prefill of the committed
    tokens (float32: the prefill's products round differently), and the output is plain."""
    drafter = MTPDrafter(random_mtp(model, 3), dict(max_seqs=4, block_size=4, num_blocks=64))
    taken = recorded_rows(drafter)
    engine = Engine(model, draft=drafter, num_draft_tokens=4, block_size=4, tree=TreeShape((3, 2)))
    engine.speculator.check = True
    rounds = NativeRounds(engine)
    engine.speculator.hooks.append(rounds)
    params = hs.SamplingParams(max_new_tokens=14, ignore_eos=True)
    outputs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain_outputs(model, PROMPTS, params)]
    assert rounds.native == rounds.tree_rounds > 0 and len(taken) > 4
    assert_rows_are_a_prefills(model, PROMPTS, outputs, taken, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module", params=["mamba1", "gdn"])
def layered(request):
    return tiny_model(0, (request.param, "attention", request.param), dtype=torch.float32).pack_for_cpu()


def test_the_c_tree_forms_are_the_native_chain_along_each_path(layered):
    model = layered
    cache = _prefilled(model, [p[:-1] for p in PROMPTS[:2]])
    tree = TreeBatch(PARENTS, "cpu")
    logits = model.extend(cache, [0, 1], TOKENS, tree=tree)  # no snapshot slots: layer by layer
    assert not tree.in_ring and 0 in tree.ssm
    for b, parents in enumerate(PARENTS):
        for t in range(len(parents)):
            path = tree.plan.path_to(b, t)
            chain = _prefilled(model, [PROMPTS[b][:-1]])
            want = model.extend(chain, [0], [[TOKENS[b][i] for i in path]])[0, -1]
            torch.testing.assert_close(logits[b, t], want, rtol=1e-5, atol=1e-5)
            head = chain.head(0)
            assert torch.equal(tree.ssm[0][b, t], chain.states.ssm_states[0][head])
            assert torch.equal(tree.conv[0][b, t], chain.states.conv_states[0][head])
            for layer in tree.ssm:
                torch.testing.assert_close(tree.ssm[layer][b, t], chain.states.ssm_states[layer][head],
                                           rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("verify,temperature", [("rejection", 0.0), ("coupled", 0.9)])
def test_layered_native_tree_rounds_equal_plain_output(layered, verify, temperature):
    draft = perturbed_copy(layered, 0.3, 1)
    params = [hs.SamplingParams(max_new_tokens=n, temperature=temperature, seed=s)
              for n, s in ((16, 1), (11, 2), (13, 3))]
    engine = Engine(layered, draft=draft, num_draft_tokens=4, verify=verify, block_size=4, tree=TreeShape((2,)))
    engine.speculator.check = True
    rounds = TreeRounds()
    engine.speculator.hooks.append(rounds)
    outputs = engine.generate(PROMPTS, params)
    expected = plain_outputs(layered, PROMPTS, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert rounds.trees > 0


class TreeRounds:
    """A RoundHook counting the committed tree rounds."""

    def __init__(self):
        self.trees = 0

    def round_started(self, round): pass

    def phase_started(self, phase): pass

    def round_ended(self, round, error): pass

    def committed(self, round):
        self.trees += round.parents is not None
