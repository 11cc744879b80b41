"""Sampled output of the drafters that do not run a model of their own
(suffix decoding, the MTP layer, the EAGLE-3 head) under rejection sampling
(no seed): the first two tokens' joint frequencies fit the target's
p(t1) · p(t2 | t1), computed exactly by the target, with a chi-square test.
The first token comes from the prefill (plain sampling); the second from the
first speculative round, whose drafts the drafter made."""
from pathlib import Path

import pytest
import torch

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache

PROMPT = list(b"    for i in ")
N = 500
EAGLE3 = Path(hs.embedded_paths()[0]).parent / "eagle3"


@pytest.fixture(scope="module")
def target():
    return hs.load(hs.embedded_paths()[0])


def joint_probabilities(target, temperature: float) -> torch.Tensor:
    """p(t1) · p(t2 | t1) [vocab, vocab] of the target at `temperature` after PROMPT, float64."""
    vocab = target.vocab_size
    cache = HybridCache(target.config, max_seqs=vocab, block_size=16, num_blocks=vocab * 5, ring_slots=2,
                        dtype=target.dtype)
    first = torch.softmax(target.prefill(cache, [0], [PROMPT], last_only=True)[0, 0].double() / temperature, -1)
    cache.free_sequences([0])
    ids = list(range(vocab))
    second = target.prefill(cache, ids, [PROMPT + [t] for t in ids], last_only=True)[:, 0]  # [vocab, vocab]
    return first[:, None] * torch.softmax(second.double() / temperature, -1)


@pytest.mark.parametrize("draft", ["suffix", "mtp", "eagle3"])
def test_the_first_round_token_follows_the_target(target, draft):
    from scipy import stats
    if draft == "eagle3" and not (EAGLE3 / "config.json").is_file():
        pytest.skip("no EAGLE-3 head shipped")
    temperature = 0.8
    engine = hs.Engine(target, draft=draft, num_draft_tokens=3, max_batch_size=64)
    params = hs.SamplingParams(max_new_tokens=4, temperature=temperature, ignore_eos=True)  # round 1: γ = 2
    outs = engine.generate([PROMPT] * N, params)
    assert engine.total_stats.drafted_tokens > N // 4 and engine.total_stats.accepted_tokens > 0
    counts = torch.zeros(target.vocab_size, target.vocab_size, dtype=torch.float64)
    for o in outs:
        counts[o.token_ids[0], o.token_ids[1]] += 1
    expected = N * joint_probabilities(target, temperature)
    big = expected >= 5  # cells a chi-square can judge; the rest lumped into one
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    wanted = torch.cat([expected[big], expected[~big].sum().view(1)])
    pvalue = stats.chisquare(observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item()).pvalue
    assert pvalue > 1e-3, (draft, pvalue, int(big.sum()))
