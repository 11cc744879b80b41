"""Rejection kernel versus ``rejection_ref``, and exact cases for every mode."""

import pytest
import torch

from hybridspec.kernels.keyed_random import PURPOSE_DRAFT, PURPOSE_RECOVER, PURPOSE_SAMPLE, gumbel_argmax
from hybridspec.kernels.reference import MODE_COUPLED, MODE_GREEDY, MODE_REJECTION, greedy_accept
from hybridspec.kernels.triton.rejection import rejection, rejection_ref

pytest.importorskip("triton")
# log(0) = -inf is intended (zero-probability tokens never win); numpy warns about it when interpreted.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


def verify_both(device, target_probs, draft_probs, draft_tokens, num_draft, row_mode, seeds, positions):
    """Run the kernel on ``device`` and the reference on CPU; assert they agree; return the result."""
    args = (target_probs, draft_probs, draft_tokens, num_draft, row_mode, seeds, positions)
    expected_tokens, expected_accepted = rejection_ref(*args)
    output_tokens, num_accepted = rejection(*(t if t is None else t.to(device) for t in args))
    assert torch.equal(output_tokens.cpu(), expected_tokens)
    assert torch.equal(num_accepted.cpu(), expected_accepted)
    return expected_tokens, expected_accepted


def random_batch(B, G, V, dtype, generator, sharpness=2.0):
    """Random p/q, drafts that match argmax p half the time, padding -1 past each row's γ."""
    p = torch.softmax(sharpness * torch.randn(B, G + 1, V, generator=generator), dim=2).to(dtype)  # [B, G+1, V]
    q = torch.softmax(sharpness * torch.randn(B, G, V, generator=generator), dim=2).to(dtype)  # [B, G, V]
    from_q = torch.multinomial(q.reshape(-1, V).double(), 1, generator=generator).view(B, G)
    is_greedy_pick = torch.rand(B, G, generator=generator) < 0.5
    draft_tokens = torch.where(is_greedy_pick, p[:, :G].argmax(2), from_q)  # [B, G]
    num_draft = torch.randint(0, G + 1, (B,), generator=generator)  # [B]
    draft_tokens[torch.arange(G)[None, :] >= num_draft[:, None]] = -1
    row_mode = torch.arange(B) % 3  # greedy, rejection and coupled rows in one launch
    seeds = torch.randint(0, 2**63 - 1, (B,), generator=generator)
    positions = torch.randint(0, 10_000, (B,), generator=generator)
    return p, q, draft_tokens, num_draft, row_mode, seeds, positions


@pytest.mark.parametrize(
    "B, G, V, dtype",
    [(6, 3, 40, torch.float32), (6, 3, 40, torch.float64), (4, 2, 2500, torch.float32), (3, 0, 17, torch.float64)],
)
def test_kernel_matches_ref_on_mixed_batches(B, G, V, dtype, triton_device):
    generator = torch.Generator().manual_seed(B * 1000 + G * 100 + V)
    for _ in range(2):
        verify_both(triton_device, *random_batch(B, G, V, dtype, generator))


def one_hot_drafts(draft_tokens, num_draft, V, dtype):
    """The q a drafter without probabilities means: one-hot at each drafted token, 0 past num_draft."""
    B, G = draft_tokens.shape
    is_draft = torch.arange(G)[None, :] < num_draft[:, None]  # [B, G]
    q = torch.zeros(B, G, V, dtype=dtype)
    q.scatter_(2, draft_tokens.clamp(min=0)[:, :, None], 1.0)
    return q * is_draft[:, :, None]


@pytest.mark.parametrize("B, G, V, dtype", [(6, 3, 40, torch.float64), (4, 2, 2500, torch.float32)])
def test_one_hot_flag_equals_an_explicit_one_hot_q(B, G, V, dtype, triton_device):
    """draft_probs=None (no [B, G, V] tensor) decides exactly as the one-hot q it stands for."""
    generator = torch.Generator().manual_seed(5 * B + G)
    for _ in range(3):
        p, _, draft_tokens, num_draft, row_mode, seeds, positions = random_batch(B, G, V, dtype, generator)
        explicit = rejection_ref(p, one_hot_drafts(draft_tokens, num_draft, V, dtype), draft_tokens, num_draft,
                                 row_mode, seeds, positions)
        flagged = verify_both(triton_device, p, None, draft_tokens, num_draft, row_mode, seeds, positions)
        assert all(torch.equal(a, b) for a, b in zip(explicit, flagged))


def test_kernel_matches_ref_on_strided_inputs(triton_device):
    generator = torch.Generator().manual_seed(7)
    p, q, draft_tokens, num_draft, row_mode, seeds, positions = random_batch(5, 3, 40, torch.float32, generator)
    wide_p = torch.cat([p, p[:, :1]], dim=1)  # [B, G + 2, V]: a view of its first G + 1 rows is strided
    wide_tokens = torch.cat([draft_tokens, draft_tokens], dim=1)  # [B, 2G]
    verify_both(triton_device, wide_p[:, :4], q, wide_tokens[:, :3], num_draft, row_mode, seeds, positions)


def test_kernel_matches_ref_on_hundreds_of_rows(triton_device):
    """The distribution tests run on rejection_ref; this ties the kernel to it on their kind of input."""
    B, V = 120, 6
    generator = torch.Generator().manual_seed(11)
    p = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1, 0.0], dtype=torch.float64)
    q = torch.tensor([0.0, 0.1, 0.1, 0.2, 0.3, 0.3], dtype=torch.float64)  # mass where p has none
    seeds = torch.randint(0, 2**62, (B,), generator=generator)
    positions = torch.full((B,), 31)
    draft_tokens = torch.stack(
        [gumbel_argmax(q.expand(B, V), seeds, positions + i, PURPOSE_DRAFT) for i in range(2)], dim=1
    )  # [B, 2]
    num_draft = torch.full((B,), 2)
    row_mode = torch.tensor([MODE_REJECTION, MODE_REJECTION, MODE_COUPLED]).repeat(B // 3)
    _, num_accepted = verify_both(
        triton_device, p.expand(B, 3, V), q.expand(B, 2, V), draft_tokens, num_draft, row_mode, seeds, positions
    )
    assert 0 < int(num_accepted.sum()) < 2 * B


def test_greedy_exact_cases(triton_device):
    V = 5
    one_hot_rows = [[2, 4, 1, 0], [2, 4, 1, 0], [2, 4, 1, 0], [0, 0, 0, 0], [3, 1, 1, 1], [2, 4, 1, 0]]
    target_probs = torch.full((6, 4, V), 0.1, dtype=torch.float32)  # [B, G + 1, V]
    for b, argmaxes in enumerate(one_hot_rows):
        for i, token in enumerate(argmaxes):
            target_probs[b, i, token] = 0.6
    target_probs[3, 0] = torch.tensor([0.4, 0.1, 0.4, 0.1, 0.0])  # tie: the lowest index wins
    draft_tokens = torch.tensor([[2, 4, 1], [2, 3, 1], [0, 4, 1], [2, -1, -1], [-1, -1, -1], [2, 4, -1]])
    num_draft = torch.tensor([3, 3, 3, 1, 0, 2])
    tokens, num_accepted = verify_both(
        triton_device,
        target_probs,
        torch.zeros(6, 3, V),
        draft_tokens,
        num_draft,
        torch.full((6,), MODE_GREEDY),
        torch.arange(6),
        torch.arange(6),
    )
    expected = [[2, 4, 1, 0], [2, 4, -1, -1], [2, -1, -1, -1], [0, -1, -1, -1], [3, -1, -1, -1], [2, 4, 1, -1]]
    assert tokens.tolist() == expected
    assert num_accepted.tolist() == [3, 1, 0, 0, 0, 2]


@pytest.mark.parametrize("B, G, V, dtype", [(7, 4, 30, torch.float32), (5, 3, 2500, torch.float64), (3, 0, 9, torch.float32)])
def test_greedy_accept_on_the_host_equals_the_reference(B, G, V, dtype):
    """The all-greedy host path gives rejection_ref's tokens and counts: drafts
    that match argmax p half the time, rows with fewer drafts, ties."""
    generator = torch.Generator().manual_seed(B * 100 + G)
    for trial in range(3):
        p, _, draft_tokens, num_draft, _, seeds, positions = random_batch(B, G, V, dtype, generator)
        if trial == 2:  # ties everywhere: the lowest index wins on both paths
            p = torch.full_like(p, 1.0 / V)
            draft_tokens[draft_tokens >= 0] = 0
        drafts = [row[:n].tolist() for row, n in zip(draft_tokens, num_draft.tolist())]
        expected_tokens, expected_accepted = rejection_ref(p, None, draft_tokens, num_draft,
                                                           torch.full((B,), MODE_GREEDY), seeds, positions)
        tokens, accepted = greedy_accept(p, drafts)
        assert tokens == expected_tokens.tolist()
        assert accepted == expected_accepted.tolist()


def test_greedy_accept_refuses_drafts_longer_than_the_verify():
    with pytest.raises(ValueError, match="do not fit"):
        greedy_accept(torch.rand(1, 2, 5), [[1, 2]])


def test_greedy_ties_across_vocab_blocks(triton_device):
    V = 2500  # three blocks of 1024
    target_probs = torch.full((2, 1, V), 1e-4, dtype=torch.float64)
    target_probs[0, 0, [2100, 900]] = 0.3  # across blocks
    target_probs[1, 0, [1700, 1100, 2400]] = 0.3  # inside a block and in the tail block
    empty = torch.zeros(2, 0, V, dtype=torch.float64)
    tokens, _ = verify_both(
        triton_device,
        target_probs,
        empty,
        torch.zeros(2, 0, dtype=torch.int64),
        torch.zeros(2, dtype=torch.int64),
        torch.full((2,), MODE_GREEDY),
        torch.arange(2),
        torch.arange(2),
    )
    assert tokens[:, 0].tolist() == [900, 1100]


def test_coupled_rows_emit_the_plain_sampled_tokens(triton_device):
    """Coupled output is the plain Gumbel-max sample at every position, whatever the drafts."""
    B, G, V = 6, 3, 40
    generator = torch.Generator().manual_seed(3)
    target_probs = torch.softmax(torch.randn(B, G + 1, V, generator=generator), dim=2)  # [B, G + 1, V]
    seeds = torch.randint(0, 2**62, (B,), generator=generator)
    positions = torch.randint(0, 500, (B,), generator=generator)
    plain = torch.stack(
        [gumbel_argmax(target_probs[:, i], seeds, positions + i, PURPOSE_SAMPLE) for i in range(G + 1)], dim=1
    )  # [B, G + 1]: what plain decoding with these seeds emits
    first_mismatch = torch.tensor([0, 1, 2, 3, 3, 1])
    num_draft = torch.tensor([3, 3, 3, 3, 2, 1])
    draft_tokens = plain[:, :G].clone()
    rows = torch.arange(B)[first_mismatch < G]
    draft_tokens[rows, first_mismatch[rows]] = (plain[rows, first_mismatch[rows]] + 1) % V
    tokens, num_accepted = verify_both(
        triton_device,
        target_probs,
        torch.rand(B, G, V),
        draft_tokens,
        num_draft,
        torch.full((B,), MODE_COUPLED),
        seeds,
        positions,
    )
    expected_accepted = torch.minimum(first_mismatch, num_draft)
    assert torch.equal(num_accepted, expected_accepted)
    for b in range(B):
        n = int(expected_accepted[b])
        assert tokens[b, : n + 1].tolist() == plain[b, : n + 1].tolist()


def test_rejection_rejects_drafts_the_drafter_could_not_sample(triton_device):
    B, V = 12, 8
    generator = torch.Generator().manual_seed(5)
    target_probs = torch.softmax(torch.randn(B, 2, V, generator=generator), dim=2)  # [B, 2, V]
    draft_probs = torch.softmax(torch.randn(B, 1, V, generator=generator), dim=2)  # [B, 1, V]
    draft_tokens = torch.randint(0, V, (B, 1), generator=generator)
    draft_probs[torch.arange(B), 0, draft_tokens[:, 0]] = 0.0  # q(d) = 0, p(d) > 0
    target_probs[torch.arange(B), 0, draft_tokens[:, 0]] = 0.9
    seeds, positions = torch.arange(B) * 101, torch.full((B,), 4)
    tokens, num_accepted = verify_both(
        triton_device,
        target_probs,
        draft_probs,
        draft_tokens,
        torch.ones(B, dtype=torch.int64),
        torch.full((B,), MODE_REJECTION),
        seeds,
        positions,
    )
    assert num_accepted.tolist() == [0] * B
    residual = torch.clamp(target_probs[:, 0] - draft_probs[:, 0], min=0)  # [B, V]
    assert torch.equal(tokens[:, 0], gumbel_argmax(residual, seeds, positions, PURPOSE_RECOVER))


def test_zero_residual_falls_back_to_the_target(triton_device):
    B, V = 8, 10
    generator = torch.Generator().manual_seed(6)
    p = torch.softmax(torch.randn(B, 2, V, generator=generator), dim=2)
    p[:, 0, 0] = 0.0  # d_1 = 0 has p = q = 0: rejected, and max(0, p - q) is all zero
    p[:, 0] /= p[:, 0].sum(1, keepdim=True)
    seeds, positions = torch.arange(B) + 2**40, torch.arange(B) * 3
    tokens, num_accepted = verify_both(
        triton_device,
        p,
        p[:, :1].clone(),
        torch.zeros(B, 1, dtype=torch.int64),
        torch.ones(B, dtype=torch.int64),
        torch.full((B,), MODE_REJECTION),
        seeds,
        positions,
    )
    assert num_accepted.tolist() == [0] * B
    assert torch.equal(tokens[:, 0], gumbel_argmax(p[:, 0], seeds, positions, PURPOSE_RECOVER))


def test_rejection_accepts_when_target_covers_draft_and_samples_the_bonus(triton_device):
    B, G, V = 6, 3, 12
    generator = torch.Generator().manual_seed(8)
    target_probs = torch.softmax(torch.randn(B, G + 1, V, generator=generator), dim=2)
    draft_tokens = torch.randint(0, V, (B, G), generator=generator)
    num_draft = torch.tensor([3, 2, 1, 0, 3, 2])
    seeds, positions = torch.arange(B) * 7 + 1, torch.arange(B) + 100
    tokens, num_accepted = verify_both(
        triton_device,
        target_probs,
        target_probs[:, :G].clone(),  # q = p: p(d) / q(d) = 1, always accepted
        draft_tokens,
        num_draft,
        torch.full((B,), MODE_REJECTION),
        seeds,
        positions,
    )
    assert torch.equal(num_accepted, num_draft)
    bonus_probs = target_probs[torch.arange(B), num_draft]  # [B, V]: p_{γ+1}
    bonus = gumbel_argmax(bonus_probs, seeds, positions + num_draft, PURPOSE_SAMPLE)
    assert torch.equal(tokens[torch.arange(B), num_draft], bonus)


def test_decisions_are_keyed_by_absolute_position_not_row_or_gamma(triton_device):
    """Row A verifies [d1, d2] at m with d1 surely accepted; row B verifies [d2] at m + 1: same tail."""
    V = 16
    generator = torch.Generator().manual_seed(9)
    p = torch.softmax(2 * torch.randn(3, V, generator=generator), dim=1)  # p_1, p_2, p_3
    q = torch.softmax(2 * torch.randn(2, V, generator=generator), dim=1)
    q[0] = p[0]  # d1 is always accepted
    results = []
    for mode in (MODE_REJECTION, MODE_COUPLED):
        for seed in range(10):
            d1 = int(gumbel_argmax(p[:1], torch.tensor([seed]), torch.tensor([50]), PURPOSE_SAMPLE))
            d2 = (seed * 5) % V
            padded_p = torch.stack([p, torch.cat([p[1:], p[2:]])])  # [2, 3, V]
            padded_q = torch.stack([q, torch.cat([q[1:], q[1:]])])  # [2, 2, V]
            tokens, num_accepted = verify_both(
                triton_device,
                padded_p,
                padded_q,
                torch.tensor([[d1, d2], [d2, -1]]),
                torch.tensor([2, 1]),
                torch.tensor([mode, mode]),
                torch.tensor([seed, seed]),
                torch.tensor([50, 51]),
            )
            assert int(num_accepted[0]) == int(num_accepted[1]) + 1
            assert tokens[0, 1:].tolist() == tokens[1, :2].tolist()
            results.append(int(num_accepted[1]))
    assert 0 < sum(results) < len(results)  # both outcomes of d2 occurred


def _valid_args():
    B, G, V = 2, 2, 5
    return dict(
        target_probs=torch.full((B, G + 1, V), 0.2),
        draft_probs=torch.full((B, G, V), 0.2),
        draft_tokens=torch.zeros(B, G, dtype=torch.int64),
        num_draft=torch.full((B,), G),
        row_mode=torch.zeros(B, dtype=torch.int64),
        seeds=torch.zeros(B, dtype=torch.int64),
        positions=torch.zeros(B, dtype=torch.int64),
    )


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(target_probs=torch.full((2, 3), 0.2)), ValueError, "target_probs must be"),
        (dict(draft_probs=torch.full((2, 3, 5), 0.2)), ValueError, r"draft_probs must have shape \(2, 2, 5\)"),
        (dict(draft_tokens=torch.zeros(2, 3, dtype=torch.int64)), ValueError, "draft_tokens must have shape"),
        (dict(seeds=torch.zeros(3, dtype=torch.int64)), ValueError, "seeds must have shape"),
        (dict(draft_probs=torch.full((2, 2, 5), 0.2, dtype=torch.float64)), TypeError, "both be float32"),
        (dict(positions=torch.zeros(2, dtype=torch.int32)), TypeError, "positions must be int64"),
        (dict(row_mode=torch.zeros(2)), TypeError, "row_mode must be an integer"),
        (dict(num_draft=torch.tensor([3, 0])), ValueError, r"num_draft must lie in \[0, 2\]"),
        (dict(row_mode=torch.tensor([0, 3])), ValueError, "row_mode values"),
        (dict(draft_tokens=torch.tensor([[0, 5], [0, 0]])), ValueError, r"draft_tokens .* \[0, 5\)"),
        (dict(seeds=torch.zeros(2, dtype=torch.int64, device="meta")), ValueError, "one device"),
    ],
)
@pytest.mark.parametrize("verify", [rejection, rejection_ref], ids=["kernel", "ref"])
def test_bad_arguments_raise_before_launch(verify, change, error, match):
    args = _valid_args() | change
    with pytest.raises(error, match=match):
        verify(**args)


def test_out_of_range_tokens_past_num_draft_are_ignored():
    args = _valid_args() | dict(draft_tokens=torch.tensor([[0, 99], [0, 0]]), num_draft=torch.tensor([1, 2]))
    tokens, num_accepted = rejection_ref(**args)
    assert tokens.shape == (2, 3) and num_accepted.tolist() == [1, 2]
