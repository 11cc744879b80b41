"""`process_logits` against an independent per-row reference written from the
definitions (temperature, top-k, top-p, min-p, renormalise), and `NgramDrafter.lookup`."""
import math

import pytest
import torch

import hybridspec as hs
from hybridspec.sampling.sampler import RowParams, process_logits


def reference(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """One row, in plain Python floats."""
    x = [v / (temperature if temperature > 0 else 1.0) for v in logits]
    if top_k > 0:
        kth = sorted(x, reverse=True)[min(top_k, len(x)) - 1]
        x = [v if v >= kth else -math.inf for v in x]
    top = max(x)
    weights = [math.exp(v - top) for v in x]
    probs = [w / sum(weights) for w in weights]
    keep = [True] * len(probs)
    if top_p < 1:
        order = sorted(range(len(probs)), key=lambda i: -probs[i])
        mass = 0.0
        for rank, i in enumerate(order):
            keep[i] = rank == 0 or mass < top_p
            mass += probs[i]
    if min_p > 0:
        floor = min_p * max(probs)
        keep = [k and p >= floor for k, p in zip(keep, probs)]
    kept = [p if k else 0.0 for p, k in zip(probs, keep)]
    return [p / sum(kept) for p in kept]


SETTINGS = [(0.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 3, 1.0, 0.0), (1.0, 0, 0.6, 0.0), (0.9, 0, 1.0, 0.2),
            (1.1, 5, 0.8, 0.05), (0.5, 1, 1.0, 0.0), (1.0, 40, 0.999, 0.0)]


def test_process_logits_matches_the_definitions_row_by_row():
    generator = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(len(SETTINGS), 23, generator=generator, dtype=torch.float64)  # [rows, vocab]
    params = [hs.SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in SETTINGS]
    rows = RowParams.of(params, list(range(len(params))), "cpu")
    got = process_logits(logits, rows)  # one batch, every row a different setting
    for b, (t, k, p, m) in enumerate(SETTINGS):
        want = torch.tensor(reference(logits[b].tolist(), t, k, p, m), dtype=torch.float64)
        assert torch.allclose(got[b], want, atol=1e-12), (b, SETTINGS[b])


def test_rows_are_independent_of_their_neighbours():
    logits = torch.randn(2, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    params = [hs.SamplingParams(temperature=0.8, top_p=0.5), hs.SamplingParams(temperature=1.0)]
    both = process_logits(logits, RowParams.of(params, [0, 1], "cpu"))
    alone = process_logits(logits[1:], RowParams.of(params[1:], [1], "cpu"))
    assert torch.equal(both[1:], alone)


@pytest.mark.parametrize("context, gamma, expected", [
    ([1, 2, 3, 9, 1, 2, 3], 2, [9, 1]),  # the trigram 1 2 3 occurred before: continue it
    ([1, 2, 3, 4, 5, 2, 3], 3, [4, 5, 2]),  # the longest suffix that matches is 2 3
    ([5, 6, 5, 7, 5], 2, [7, 5]),  # most recent earlier occurrence of "5" wins
    ([1, 2, 3, 4], 2, []),  # nothing repeats
    ([7], 3, []),  # too short to match anything
    ([4, 4, 4], 5, [4]),  # the continuation stops at the end of the context
])
def test_ngram_lookup(context, gamma, expected):
    assert hs.NgramDrafter(max_ngram=3).lookup(context, gamma) == expected


def test_ngram_min_ngram_skips_shorter_matches():
    assert hs.NgramDrafter(max_ngram=3, min_ngram=2).lookup([5, 6, 5, 7, 5], 2) == []
    assert hs.NgramDrafter(max_ngram=3, min_ngram=2).lookup([5, 6, 7, 5, 6], 2) == [7, 5]
