"""Keyed random numbers: determinism, batch independence, uniformity, torch == Triton."""

import pytest
import torch
from scipy import stats

from hybridspec.kernels.keyed_random import (
    PURPOSE_ACCEPT,
    PURPOSE_DRAFT,
    PURPOSE_RECOVER,
    PURPOSE_SAMPLE,
    gumbel_argmax,
    keyed_gumbel,
    keyed_uniform,
)
from hybridspec.kernels.triton.keyed_random import gumbel_dev, row_key_dev, uniform_dev

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

PURPOSES = (PURPOSE_SAMPLE, PURPOSE_ACCEPT, PURPOSE_RECOVER, PURPOSE_DRAFT)
# Seeds and positions that exercise both 32-bit halves.
EDGE_SEEDS = torch.tensor([0, 1, 2, 2**31, 2**32, 2**32 + 1, 2**62 + 12345, 2**63 - 1])
EDGE_POSITIONS = torch.tensor([0, 1, 7, 2**31 - 1, 2**32, 5, 2**40 + 3, 100_000])


def test_deterministic_and_keyed_by_every_field():
    seeds = torch.arange(50) * 1_000_003
    positions = torch.arange(50) + 10
    u = keyed_uniform(seeds, positions, PURPOSE_ACCEPT)  # [50]
    assert torch.equal(u, keyed_uniform(seeds.clone(), positions.clone(), PURPOSE_ACCEPT))
    others = [
        keyed_uniform(seeds + 1, positions, PURPOSE_ACCEPT),
        keyed_uniform(seeds + 2**32, positions, PURPOSE_ACCEPT),  # only the high half changes
        keyed_uniform(seeds, positions + 1, PURPOSE_ACCEPT),
        keyed_uniform(seeds, positions, PURPOSE_RECOVER),
        keyed_uniform(seeds, positions, PURPOSE_ACCEPT, torch.ones(50, dtype=torch.int64)),
    ]
    for other in others:
        assert not torch.isclose(u, other).any()


def test_row_values_do_not_depend_on_the_batch():
    seeds = torch.tensor([5, 2**40 + 1, 77, 2**63 - 1, 0])
    positions = torch.tensor([3, 9, 9, 1000, 0])
    purpose, vocab = PURPOSE_SAMPLE, 33
    full = keyed_gumbel(seeds, positions, purpose, vocab)  # [5, vocab]
    perm = torch.tensor([3, 0, 4, 1, 2])
    assert torch.equal(keyed_gumbel(seeds[perm], positions[perm], purpose, vocab), full[perm])
    for n in range(len(seeds)):
        assert torch.equal(keyed_gumbel(seeds[n : n + 1], positions[n : n + 1], purpose, vocab)[0], full[n])
    # A bigger vocabulary extends the noise; it does not change the first entries.
    assert torch.equal(keyed_gumbel(seeds, positions, purpose, 2 * vocab)[:, :vocab], full)
    probs = torch.softmax(torch.randn(5, vocab, generator=torch.Generator().manual_seed(0)), dim=1)
    tokens = gumbel_argmax(probs, seeds, positions, purpose)  # [5]
    assert torch.equal(gumbel_argmax(probs[perm], seeds[perm], positions[perm], purpose), tokens[perm])


def test_uniforms_are_in_the_open_interval_on_the_2_pow_minus_53_grid():
    u = keyed_uniform(torch.arange(20_000)[:, None], torch.zeros(1, 5, dtype=torch.int64), PURPOSE_ACCEPT)
    scaled = u * 2.0**53  # odd integers 2k + 1 with k < 2**52
    assert u.dtype == torch.float64
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert torch.equal(scaled, scaled.round())
    assert bool((scaled.long() % 2 == 1).all())


@pytest.mark.parametrize(
    "layout",
    ["consecutive seeds", "consecutive positions", "consecutive indices", "high seed half only", "purposes"],
)
def test_uniforms_pass_ks_on_structured_keys(layout):
    n = 40_000
    ramp = torch.arange(n)
    zeros = torch.zeros(n, dtype=torch.int64)
    if layout == "consecutive seeds":
        u = keyed_uniform(ramp, zeros + 17, PURPOSE_SAMPLE)
    elif layout == "consecutive positions":
        u = keyed_uniform(zeros + 42, ramp, PURPOSE_ACCEPT)
    elif layout == "consecutive indices":
        u = keyed_uniform(zeros[:1] + 9, zeros[:1] + 3, PURPOSE_RECOVER, ramp)
    elif layout == "high seed half only":
        u = keyed_uniform(ramp << 32, zeros, PURPOSE_DRAFT)
    else:
        u = torch.cat([keyed_uniform(ramp[: n // 4], zeros[: n // 4], purpose) for purpose in PURPOSES])
    assert stats.kstest(u.numpy(), "uniform").pvalue > 0.001


def test_neighbouring_keys_are_uncorrelated():
    n = 40_000
    seeds = torch.arange(n)
    positions = torch.full((n,), 11)
    base = keyed_uniform(seeds, positions, PURPOSE_SAMPLE)
    neighbours = {
        "next seed": keyed_uniform(seeds + 1, positions, PURPOSE_SAMPLE),
        "next position": keyed_uniform(seeds, positions + 1, PURPOSE_SAMPLE),
        "other purpose": keyed_uniform(seeds, positions, PURPOSE_ACCEPT),
        "next index": keyed_uniform(seeds, positions, PURPOSE_SAMPLE, torch.ones(n, dtype=torch.int64)),
    }
    for name, other in neighbours.items():
        corr = torch.corrcoef(torch.stack([base, other]))[0, 1].item()
        assert abs(corr) < 4 / n**0.5, f"{name}: correlation {corr}"


def test_gumbel_argmax_samples_the_distribution():
    n = 20_000
    probs = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.25, 0.0, 0.2, 0.05], dtype=torch.float64)
    seeds = torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(1))
    positions = torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(2))
    # Unnormalised input (x3) samples the normalised distribution.
    tokens = gumbel_argmax(3 * probs.expand(n, -1), seeds, positions, PURPOSE_SAMPLE)  # [n]
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0
    support = probs > 0
    assert stats.chisquare(counts[support].numpy(), (n * probs[support]).numpy()).pvalue > 0.001


def test_gumbel_is_minus_log_minus_log_uniform():
    seeds, positions = EDGE_SEEDS, EDGE_POSITIONS
    u = keyed_uniform(seeds[:, None], positions[:, None], PURPOSE_RECOVER, torch.arange(12)[None, :])
    assert torch.equal(keyed_gumbel(seeds, positions, PURPOSE_RECOVER, 12), -torch.log(-torch.log(u)))


def test_rejects_non_int64_keys():
    with pytest.raises(TypeError, match="seeds must be an int64"):
        keyed_uniform(torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int64), PURPOSE_SAMPLE)
    with pytest.raises(ValueError, match="must both be"):
        keyed_gumbel(torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), PURPOSE_SAMPLE, 5)


@triton.jit
def _keyed_noise_kernel(
    seeds_ptr, positions_ptr, uniform_ptr, gumbel_ptr, V, PURPOSE: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    key_a, key_b = row_key_dev(tl.load(seeds_ptr + row), tl.load(positions_ptr + row), PURPOSE)
    offs = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        index = start + offs
        in_vocab = index < V
        tl.store(uniform_ptr + row * V + index, uniform_dev(key_a, key_b, index), mask=in_vocab)
        tl.store(gumbel_ptr + row * V + index, gumbel_dev(key_a, key_b, index), mask=in_vocab)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("purpose", PURPOSES)
def test_triton_device_functions_match_torch(purpose, triton_device):
    seeds, positions, vocab = EDGE_SEEDS.to(triton_device), EDGE_POSITIONS.to(triton_device), 70
    uniform = torch.empty(len(seeds), vocab, dtype=torch.float64, device=triton_device)  # [N, V]
    gumbel = torch.empty_like(uniform)
    _keyed_noise_kernel[(len(seeds),)](seeds, positions, uniform, gumbel, vocab, PURPOSE=purpose, BLOCK=32)
    expected = keyed_uniform(seeds[:, None], positions[:, None], purpose, torch.arange(vocab, device=triton_device))
    assert torch.equal(uniform, expected)  # bit for bit
    # log is the platform's (numpy or libdevice versus torch): equal up to an ulp or two.
    torch.testing.assert_close(gumbel, keyed_gumbel(seeds, positions, purpose, vocab), rtol=1e-15, atol=1e-15)
