"""`ModelDrafter.propose` drafts each row up to its own γ_b and no further, in
a batch whose rows ask for different γ_b (adaptive γ, rows near
max_new_tokens): each row's drafter cache ends at committed_len + γ_b - 1
(what `scheduler.round_positions` reserves), and the drafts are what the row
drafts alone. Greedy rows take the native greedy chain (one call for the
steps every row takes, one per larger γ_b) with the bits of the step-by-step
loop; sampled rows with penalties take the loop."""
from types import SimpleNamespace

import pytest
import torch

import hybridspec as hs
from hybridspec.sampling.sampler import RowParams
from hybridspec.spec.model_drafter import ModelDrafter
from native_switch import backend_of
from oracles import bamba

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33, 34, 35]]
GAMMAS = [1, 3, 0, 2]
CACHE = dict(max_seqs=4, num_blocks=40, block_size=4)


def requests(params: hs.SamplingParams):
    return [SimpleNamespace(seq_id=s, params=params, seed=s,
                            output=SimpleNamespace(prompt_token_ids=p, token_ids=[]))
            for s, p in enumerate(PROMPTS)]


def propose(model, params, gammas, rows_of=None):
    """One proposal of a fresh drafter over the rows `rows_of` (default all)."""
    reqs = [requests(params)[b] for b in (rows_of or range(len(PROMPTS)))]
    drafter = ModelDrafter(model, 3, CACHE)
    drafter.start(reqs)
    rows = RowParams.of([r.params for r in reqs], [r.seed for r in reqs], model.device)
    proposal = drafter.propose(reqs, gammas, rows, coupled=[False] * len(reqs))
    return proposal, [drafter.cache.computed_len[r.seq_id] for r in reqs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["native", "torch"])
@pytest.mark.parametrize("params", [hs.SamplingParams(max_new_tokens=9),
                                    hs.SamplingParams(max_new_tokens=9, temperature=0.8, seed=1,
                                                      repetition_penalty=1.3)], ids=["greedy", "penalised"])
def test_rows_draft_their_own_gamma_and_step_no_further(dtype, params):
    model = hs.from_hf(bamba(seed=4, attn_layers=(1,), num_layers=3, dtype=dtype))
    if dtype == torch.float32:
        model.pack_for_cpu()
    proposal, lengths = propose(model, params, GAMMAS)
    assert [len(t) for t in proposal.tokens] == GAMMAS
    assert lengths == [len(p) + g - 1 if g else 0 for p, g in zip(PROMPTS, GAMMAS)]
    for b, g in enumerate(GAMMAS):  # each row's drafts are what it drafts alone
        if g:
            alone, _ = propose(model, params, [g], rows_of=[b])
            assert proposal.tokens[b] == alone.tokens[0]
            if proposal.probs is not None:  # the native products are row-independent bit for bit; MKL's are not
                torch.testing.assert_close(proposal.probs[b, :g], alone.probs[0, :g],
                                           **({} if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-15)))
                if dtype == torch.float32:
                    assert torch.equal(proposal.probs[b, :g], alone.probs[0, :g])


def test_the_greedy_chain_gives_the_step_by_step_bits():
    model = hs.from_hf(bamba(seed=4, attn_layers=(1,), num_layers=3, dtype=torch.float32)).pack_for_cpu()
    if model.greedy_chain is None:
        pytest.skip("no native whole forward on this machine")
    params = hs.SamplingParams(max_new_tokens=9)
    chained, _ = propose(model, params, GAMMAS)
    with backend_of(model, "native-blocks"):  # no whole forward: the step-by-step loop
        assert model.greedy_chain is None
        stepped, _ = propose(model, params, GAMMAS)
    assert chained.tokens == stepped.tokens


def test_greedy_chain_probabilities_beside_a_sampled_row():
    """Greedy drafting rows of mixed γ beside a sampled row that drafts nothing
    (the batch is not all greedy, so q is formed): each drafting row's tokens
    and q equal those it gets beside that sampled row alone, bit for bit (the
    native products are row-independent)."""
    model = hs.from_hf(bamba(seed=4, attn_layers=(1,), num_layers=3, dtype=torch.float32)).pack_for_cpu()
    if model.greedy_chain is None:
        pytest.skip("no native whole forward on this machine")
    greedy, sampled = hs.SamplingParams(max_new_tokens=9), hs.SamplingParams(max_new_tokens=9, temperature=0.8,
                                                                             seed=2)

    def run(rows_of, gammas):
        reqs = [requests(greedy)[b] for b in rows_of]
        for r in reqs:
            if r.seq_id == 2:  # γ 0: it drafts nothing, but the batch is not all greedy
                r.params = sampled
        drafter = ModelDrafter(model, 3, CACHE)
        drafter.start(reqs)
        rows = RowParams.of([r.params for r in reqs], [r.seed for r in reqs], model.device)
        return drafter.propose(reqs, gammas, rows, coupled=[False] * len(reqs))
    together = run(range(len(PROMPTS)), GAMMAS)
    assert together.probs is not None
    for b, g in enumerate(GAMMAS):
        if g:
            alone = run([b, 2], [g, 0])
            assert together.tokens[b] == alone.tokens[0]
            assert torch.equal(together.probs[b, :g], alone.probs[0, :g])
