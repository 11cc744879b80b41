"""Multi-draft acceptance over a tree (`spec.tree_sampling`) is lossless: the
first emitted token follows the target's p over many seeds (chi-square), with
the spine's child drawn from q and fixed alternatives beside it, or fixed
candidates only (a one-hot drafter); and a tree of width one is verified as
`rejection_ref` verifies its chain, token for token."""
import pytest
import torch
from scipy import stats

from hybridspec.kernels.keyed_random import PURPOSE_DRAFT, gumbel_argmax
from hybridspec.kernels.reference import MODE_REJECTION
from hybridspec.kernels.triton.rejection import rejection_ref
from hybridspec.spec.tree_sampling import multi_draft_accept

V, NUM_SEEDS, P_VALUE_FLOOR = 6, 2000, 0.001


def _dist(seed: int, zero: tuple[int, ...] = ()) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, dim=0)
    p[list(zero)] = 0.0
    return p / p.sum()


def _drafts(q: torch.Tensor, seeds: torch.Tensor, position: int) -> list[int]:
    """The drafter's sample of q for each seed (its own keyed noise)."""
    return gumbel_argmax(q.expand(len(seeds), V), seeds, torch.full_like(seeds, position), PURPOSE_DRAFT).tolist()


@pytest.mark.parametrize("one_hot,zero", [(False, (0, 4)), (True, ())],
                         ids=["spine drawn from q, target zero on two tokens", "one-hot candidates"])
def test_first_token_follows_the_target(one_hot, zero):
    """Root children: the spine's draft (drawn from q0, or q1's most likely token) and the two
    most likely others of q1 as fixed alternatives; the spine's child drawn from q1."""
    p0, q0, q1 = _dist(1, zero), _dist(2), _dist(3)
    seeds = torch.arange(NUM_SEEDS)
    spine = [int(q1.argmax())] * NUM_SEEDS if one_hot else _drafts(q0, seeds, 10)
    below = _drafts(q1, seeds, 11)
    ranked = torch.argsort(q1, descending=True).tolist()
    p = torch.stack([p0] + [_dist(4 + t) for t in range(1, 5)])  # [T, vocab]
    q = None if one_hot else torch.stack([q0] * 3 + [q1])  # [T - 1, vocab]: each node's source
    drawn = [False, not one_hot, False, False, not one_hot]
    firsts = []
    for seed, first, second in zip(seeds.tolist(), spine, below):
        inputs = [-1, first, *[t for t in ranked if t != first][:2], second]
        path, final = multi_draft_accept(p, q, [-1, 0, 0, 0, 1], inputs, drawn, seed, [10, 11, 11, 11, 12])
        firsts.append(inputs[path[1]] if len(path) > 1 else final)
    counts = torch.bincount(torch.tensor(firsts), minlength=V).double()
    support = p0 > 0
    assert counts[~support].sum() == 0
    pvalue = stats.chisquare(counts[support].numpy(), (NUM_SEEDS * p0[support]).numpy()).pvalue
    assert pvalue > P_VALUE_FLOOR, f"p-value {pvalue:.2e}: counts {counts.tolist()}, p {p0.tolist()}"


def test_a_width_one_tree_is_verified_as_its_chain():
    p = torch.stack([_dist(20 + t) for t in range(4)])  # [G + 1, vocab]
    q = torch.stack([_dist(30 + t) for t in range(3)])  # [G, vocab]
    seeds = torch.arange(100)
    columns = [_drafts(q[j], seeds, 50 + j) for j in range(3)]
    for seed, drafts in zip(seeds.tolist(), map(list, zip(*columns))):
        path, final = multi_draft_accept(p, q, [-1, 0, 1, 2], [-1] + drafts, [False, True, True, True], seed,
                                         [50, 51, 52, 53])
        out, n = rejection_ref(p[None], q[None], torch.tensor([drafts]), torch.tensor([3]),
                               torch.tensor([MODE_REJECTION]), torch.tensor([seed]), torch.tensor([50]))
        assert len(path) - 1 == int(n) and drafts[:int(n)] + [final] == out[0, :int(n) + 1].tolist()
