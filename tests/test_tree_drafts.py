"""Tree drafts (`spec.tree`): the tree forward at each node equals a chain
forward over that node's path (logits and every recurrent state); greedy and
coupled tree rounds give plain decoding's tokens on Mamba-2, Mamba-1 and GDN
hybrids, with the target's states after every commit equal to a fresh prefill
of the committed tokens; unseeded sampled rows run multi-draft acceptance;
chains are unchanged; the tree helpers' rules."""
import pytest
import torch

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.cache.tree_batch import TreeBatch
from hybridspec.engine.engine import Engine
from hybridspec.errors import ConfigError
from hybridspec.rollback.models import perturbed_copy, plain_outputs, tiny_model
from hybridspec.spec.tree import TreeShape, branch, chain_parents, input_parents, spine_boundary, spine_inputs, walk

FAMILIES = {"mamba2": ("mamba2", "attention", "mamba2"), "mamba1": ("mamba1", "attention", "mamba1"),
            "gdn": ("gdn", "attention", "gdn")}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [40, 41]]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request):
    target = tiny_model(0, FAMILIES[request.param])
    return target, perturbed_copy(target, 0.3, 1)


def _cache(model) -> HybridCache:
    return HybridCache(model.config, max_seqs=4, num_blocks=24, block_size=4, ring_slots=3, dtype=model.dtype)


def _kv(cache: HybridCache, seq: int, length: int) -> list[torch.Tensor]:
    """Every attention layer's K and V at positions 0 .. length - 1 of `seq`."""
    table, bs = cache.kv.block_table(seq), cache.block_size
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(length)])
    flat = [c.view(c.shape[0], -1, *c.shape[3:]) for c in (cache.kv.k_cache, cache.kv.v_cache)]
    return [f[:, slots] for f in flat]


def _prefilled(model, tokens: list[int]) -> HybridCache:
    cache = _cache(model)
    model.prefill(cache, [0], [tokens])
    return cache


def test_tree_forward_equals_chain_forward_per_node(pair):
    """The defining property: input t's logits and states are a chain forward's over its path."""
    target, _ = pair
    cache = _cache(target)
    target.prefill(cache, [0, 1], [PROMPTS[0][:-1], PROMPTS[1][:-1]])
    parents = [[-1, 0, 0, 1, 2, 3], [-1, 0, 1, 0]]
    tokens = [[PROMPTS[0][-1], 20, 21, 22, 23, 24], [PROMPTS[1][-1], 30, 31, 32]]
    tree = TreeBatch(parents, "cpu")
    logits = target.extend(cache, [0, 1], tokens, tree=tree)  # [2, 6, vocab]
    for b in range(2):
        for t in range(len(parents[b])):
            path = tree.plan.path_to(b, t)
            chain = _prefilled(target, PROMPTS[b][:-1])
            want = target.extend(chain, [0], [[tokens[b][i] for i in path]])[0, -1]
            torch.testing.assert_close(logits[b, t], want, rtol=0, atol=1e-12)
            head = chain.head(0)
            for layer in tree.ssm:
                for kept, pool in ((tree.ssm, chain.states.ssm_states), (tree.conv, chain.states.conv_states)):
                    torch.testing.assert_close(kept[layer][b, t], pool[layer][head], rtol=0, atol=1e-12)
    assert tree.ssm and tree.conv  # every recurrent layer kept its inputs' states


class StateParity:
    """A RoundHook: after every commit, each live row's target states and K/V equal a fresh
    prefill of its committed tokens (all but the pending one)."""

    def __init__(self, engine: Engine):
        self.engine, self.tree_rounds, self.checked = engine, 0, 0

    def round_started(self, round): pass

    def phase_started(self, phase): pass

    def round_ended(self, round, error): pass

    def committed(self, round):
        self.tree_rounds += round.parents is not None
        cache, target = self.engine.cache, self.engine.target
        for b in round.live:
            r, seq, boundary = round.requests[b], round.seq_ids[b], round.boundary(b)
            tokens = (r.output.prompt_token_ids + r.output.token_ids + round.results[b].tokens)[:boundary]
            fresh = _prefilled(target, tokens)
            for got, want in zip(_kv(cache, seq, boundary), _kv(fresh, 0, boundary)):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
            head, fresh_head = cache.head(seq), fresh.head(0)
            for mine, theirs in ((cache.states.ssm_states, fresh.states.ssm_states),
                                 (cache.states.conv_states, fresh.states.conv_states)):
                for got, want in zip(mine, theirs):
                    torch.testing.assert_close(got[head], want[fresh_head], rtol=0, atol=1e-10)
            self.checked += 1


@pytest.mark.parametrize("verify,temperature", [("rejection", 0.0), ("coupled", 0.9)])
@pytest.mark.parametrize("shape", [(2,), (3, 2)])
def test_tree_rounds_equal_plain_output_with_state_parity(pair, verify, temperature, shape):
    target, draft = pair
    params = [hs.SamplingParams(max_new_tokens=n, temperature=temperature, seed=s)
              for n, s in ((16, 1), (11, 2), (13, 3))]
    engine = Engine(target, draft=draft, num_draft_tokens=4, verify=verify, block_size=4, tree=TreeShape(shape))
    engine.speculator.check = True  # the boundary invariant after every commit (HYBRIDSPEC_CHECK)
    parity = StateParity(engine)
    engine.speculator.hooks.append(parity)
    outputs = engine.generate(PROMPTS, params)
    expected = plain_outputs(target, PROMPTS, params)  # coupled: plain seeded sampling's tokens
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert parity.tree_rounds > 0 and parity.checked > 0


def test_unseeded_rejection_rows_take_multi_draft_acceptance(pair):
    """Sampled rows without a seed are verified by recursive rejection over each node's
    children (`spec.tree_sampling`): rounds accept alternatives too, commit, and keep the
    invariant, state parity and the emitted tokens' log-probabilities."""
    target, draft = pair
    engine = Engine(target, draft=draft, num_draft_tokens=4, block_size=4, tree=TreeShape((2, 2)))
    engine.speculator.check = True
    parity = StateParity(engine)
    engine.speculator.hooks.append(parity)
    outputs = engine.generate(PROMPTS, [hs.SamplingParams(max_new_tokens=9, temperature=0.8, logprobs=2)] * 3)
    assert all(len(o.token_ids) == 9 and [lp.token_id for lp in o.logprobs] == o.token_ids for o in outputs)
    assert parity.tree_rounds > 0 and engine.stats.accepted_tokens > 0


def test_a_width_one_tree_is_the_chain(pair):
    """TreeShape((1,)) drafts the chain and runs the tree forward: the same tokens, the
    same acceptance as the chain round."""
    target, draft = pair
    params = [hs.SamplingParams(max_new_tokens=12)] * 3
    chain = Engine(target, draft=draft, num_draft_tokens=3, block_size=4)
    tree = Engine(target, draft=draft, num_draft_tokens=3, block_size=4, tree=TreeShape((1,)))
    got, want = tree.generate(PROMPTS, params), chain.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert (tree.stats.accepted_tokens, tree.stats.rounds) == (chain.stats.accepted_tokens, chain.stats.rounds)


def test_tree_helpers():
    assert chain_parents(3) == [-1, 0, 1] and input_parents([-1, 0, -1]) == [-1, 0, 1, 0]
    tokens, parents, rows = branch([7, 8, 9], torch.tensor([[0.1, 0.5, 0.4], [0.3, 0.3, 0.4], [1.0, 0, 0]]),
                                   TreeShape((3, 2)), budget=5)
    # the budget keeps the spine and the shallower alternatives: none at depth 2
    assert (tokens, parents, rows) == ([7, 1, 2, 8, 9], [-1, -1, -1, 0, 3], [0, 0, 0, 1, 2])
    tokens, parents, _ = branch([7, 8], torch.tensor([[0.1, 0.5, 0.4], [0.3, 0.3, 0.4]]), TreeShape((3, 2)), budget=6)
    assert (tokens, parents) == ([7, 1, 2, 8, 2], [-1, -1, -1, 0, 0])
    in_parents = input_parents(parents)  # inputs: 0 root, 1: 7, 2: 1, 3: 2, 4: 8 (under 7), 5: 2 (under 7)
    assert spine_inputs(in_parents) == [0, 1, 4]
    inputs = [-1] + tokens
    assert walk(in_parents, inputs, targets=[2, 2, 0, 0, 0, 0]) == [0, 3]  # root's target 2: the third child
    assert walk(in_parents, inputs, targets=[7, 2, 0, 0, 0, 0]) == [0, 1, 5]
    assert walk(in_parents, inputs, targets=[5, 0, 0, 0, 0, 0]) == [0]
    assert spine_boundary([0, 1, 5], in_parents, start_len=10) == 12  # the drafter keeps 7, not the leaf 2
    assert spine_boundary([0, 1, 4], in_parents, start_len=10) == 13
    assert spine_boundary([0, 3], in_parents, start_len=10) == 11
    assert TreeShape((2,)).spine_length(4) == 3 and TreeShape((3, 2)).spine_length(4) == 1
    assert TreeShape((2,), max_nodes=2).spine_length(4) == 1


@pytest.mark.parametrize("bad", [dict(widths=()), dict(widths=(0,)), dict(widths=(2,), max_nodes=0)])
def test_tree_shape_rejects_bad_values(bad):
    with pytest.raises(ConfigError):
        TreeShape(**bad)


def test_tree_needs_a_drafter_that_branches():
    target = tiny_model(0)
    with pytest.raises(ConfigError, match="does not branch"):
        Engine(target, draft=hs.StatelessDrafter(), tree=TreeShape((2,)))
    with pytest.raises(ConfigError, match="does not branch"):
        Engine(target, tree=TreeShape((2,)))
