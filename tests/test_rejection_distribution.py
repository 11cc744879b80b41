"""Speculative sampling is lossless: emitted tokens follow the target distribution.

Runs ``rejection_ref`` over many rows that share p and q but have distinct seeds
(so each row is an independent trial), with drafts sampled the way the drafter
samples them: Gumbel-max over q with PURPOSE_DRAFT noise (PURPOSE_SAMPLE in
coupled mode). ``tests/kernels/triton/test_rejection.py`` ties the Triton kernel to
``rejection_ref`` on this kind of input.
"""

import pytest
import torch
from scipy import stats

from hybridspec.kernels.keyed_random import PURPOSE_DRAFT, PURPOSE_SAMPLE, gumbel_argmax
from hybridspec.kernels.reference import MODE_COUPLED, MODE_REJECTION
from hybridspec.kernels.triton.rejection import rejection_ref

NUM_ROWS = 20_000
MASTER_SEED = 20240611
P_VALUE_FLOOR = 0.001


def distinct_seeds(n: int, master_seed: int) -> torch.Tensor:
    seeds = torch.randint(0, 2**63 - 1, (n,), generator=torch.Generator().manual_seed(master_seed))
    assert len(seeds.unique()) == n
    return seeds


def top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Softmax, keep the top_k most likely tokens, then the smallest prefix holding top_p; renormalise."""
    probs = torch.softmax(logits.double(), dim=-1)  # [V]
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    keep_sorted = (torch.arange(len(probs)) < top_k) & (mass_before < top_p)
    keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum()


def sample_drafts(q: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, purpose: int) -> torch.Tensor:
    """Drafts d_1..d_G for every row from q_1..q_G [G, V], as a drafter would; -> [N, G]."""
    n = len(seeds)
    return torch.stack([gumbel_argmax(q[i].expand(n, -1), seeds, positions + i, purpose) for i in range(len(q))], 1)


def verify(p: torch.Tensor, q: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, mode: int):
    """One round for every row with the same p_1..p_{G+1} [G + 1, V] and q_1..q_G [G, V]."""
    n, (G, V) = len(seeds), q.shape
    draft_purpose = PURPOSE_SAMPLE if mode == MODE_COUPLED else PURPOSE_DRAFT
    draft_tokens = sample_drafts(q, seeds, positions, draft_purpose)  # [N, G]
    return rejection_ref(
        p.expand(n, G + 1, V),
        q.expand(n, G, V),
        draft_tokens,
        torch.full((n,), G),
        torch.full((n,), mode),
        seeds,
        positions,
    )


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    """Chi-square goodness of fit of token samples to probs; tokens outside the support never occur."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"tokens outside the target's support: {counts[~support].tolist()}"
    expected = len(tokens) * probs[support]
    pvalue = stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue
    assert pvalue > P_VALUE_FLOOR, f"p-value {pvalue:.2e}; counts {counts.tolist()} expected {expected.tolist()}"


CASES = ("plain", "top-k/top-p", "draft outside target support", "one-hot draft")


def _case(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(p_1 and a bonus distribution [2, V], q_1 [1, V]) for one named setting."""
    generator = torch.Generator().manual_seed(MASTER_SEED + 10 + CASES.index(name))
    V = 10
    logits_p, logits_q, logits_bonus = (torch.randn(V, generator=generator) for _ in range(3))
    bonus = torch.softmax(logits_bonus.double(), dim=0)
    if name == "plain":
        p, q = torch.softmax(logits_p.double(), 0), torch.softmax(logits_q.double(), 0)
    elif name == "top-k/top-p":
        p, q = top_k_top_p(logits_p, 6, 0.85), top_k_top_p(logits_q, 4, 0.9)
    elif name == "draft outside target support":
        p = top_k_top_p(logits_p, 4, 1.0)
        q = torch.softmax(logits_q.double(), 0)
        q[p == 0] += 0.2  # at least half of q's mass is where p has none
        q /= q.sum()
    else:  # "one-hot draft": an n-gram drafter
        p = torch.softmax(logits_p.double(), 0)
        q = torch.nn.functional.one_hot(p.argsort()[-2], V).double()  # on the second most likely token
    return torch.stack([p, bonus]), q[None]


@pytest.mark.parametrize("name", CASES)
def test_first_emitted_token_follows_target(name):
    p, q = _case(name)
    seeds = distinct_seeds(NUM_ROWS, MASTER_SEED)
    positions = torch.randint(0, 2**20, (NUM_ROWS,), generator=torch.Generator().manual_seed(MASTER_SEED + 1))
    tokens, num_accepted = verify(p, q, seeds, positions, MODE_REJECTION)
    assert_follows(tokens[:, 0], p[0])
    # Leviathan et al. 2023, Thm 3.5: the acceptance rate is sum_v min(p(v), q(v)).
    alpha = torch.minimum(p[0], q[0]).sum().item()
    accepted = (num_accepted == 1).double().mean().item()
    standard_error = max(alpha * (1 - alpha) / NUM_ROWS, 1 / NUM_ROWS**2) ** 0.5
    assert abs(accepted - alpha) < 4 * standard_error, f"accepted {accepted:.4f}, expected {alpha:.4f}"
    # The bonus follows p_2.
    assert_follows(tokens[num_accepted == 1, 1], p[1])


@pytest.mark.parametrize("mode", [MODE_REJECTION, MODE_COUPLED], ids=["rejection", "coupled"])
def test_first_two_emitted_tokens_follow_target_jointly(mode):
    """With γ = 2 and context-free targets p_1, p_2, p_3, the tokens at m and m + 1 are p_1 ⊗ p_2.

    Rows that emit one token finish the next round, which starts at position m + 1.
    """
    V = 5
    generator = torch.Generator().manual_seed(MASTER_SEED + 2)
    p = torch.softmax(1.2 * torch.randn(4, V, generator=generator, dtype=torch.float64), dim=1)  # p_1..p_4
    p[1, 3] = 0.0  # a token p_2 never emits
    p[1] /= p[1].sum()
    q = torch.softmax(1.2 * torch.randn(3, V, generator=generator, dtype=torch.float64), dim=1)  # q_1..q_3
    seeds = distinct_seeds(NUM_ROWS, MASTER_SEED + 3)
    positions = torch.randint(0, 2**20, (NUM_ROWS,), generator=generator)

    tokens, num_accepted = verify(p[:3], q[:2], seeds, positions, mode)  # round 1 at m
    first, second = tokens[:, 0], tokens[:, 1].clone()
    is_cut = num_accepted == 0  # emitted one token; round 2 at m + 1 decides the second
    next_tokens, _ = verify(p[1:4], q[1:3], seeds[is_cut], positions[is_cut] + 1, mode)
    second[is_cut] = next_tokens[:, 0]
    assert 0.05 < is_cut.double().mean() < 0.95  # both paths are exercised

    joint = torch.outer(p[0], p[1]).flatten()  # [V * V]
    assert_follows(first * V + second, joint)
