"""Float64 log-probability parity with HF transformers for every family.

A divergence smaller than the greedy margin (a clamp read from the wrong
config field, an epsilon, a multiplier) leaves greedy tokens unchanged and
every token-level test green; log-probabilities show it. Each family runs a
tiny random float64 model with the fields such a divergence would hide behind
set away from their defaults, through a ragged prefill, an extend and decode
steps; every position's log_softmax must equal that of HF's full forward of
the whole sequence (`use_cache=False`, under `float64_oracle()`) to 1e-12.

The reference is the full forward: HF's single-token cached step skips the
Δ clamp of `time_step_limit` (its chunked scan applies it), whereas
hybridspec clamps in every path, so that a verify of γ + 1 tokens and γ + 1
decode steps give the same bits.
"""
import pytest
import torch

import hybridspec as hs
from hybridspec.adapters import bamba as bamba_adapter
from hybridspec.cache.hybrid_cache import HybridCache
from oracles import bamba, falcon_h1, float64_oracle, granite, jamba, nemotron_h, nemotron_h_moe, zamba2
from test_mamba_ssm_layout import bamba_oracle, hf_state, save_mamba_ssm

ATOL = 1e-12
LENGTHS, PREFILL, EXTEND = (14, 9, 12), (5, 3, 6), 3  # each row then decodes >= 3 tokens
# A Δ window that softplus(dt + dt_bias) crosses on both sides (oracles.randomize_ draws dt_bias in [-2, 0]).
DT_LIMIT = (0.3, 0.9)

FAMILIES = {
    # time_step_min above most Δ: a clamp read from it instead of time_step_limit changes every position
    "nemotron_h": lambda: nemotron_h(seed=1, pattern="M*M-", time_step_min=0.5, layer_norm_epsilon=1e-2),
    "nemotron_h_limit": lambda: nemotron_h(seed=2, pattern="M-*M", time_step_limit=DT_LIMIT,
                                           layer_norm_epsilon=1e-3),
    "nemotron_h_moe": lambda: nemotron_h_moe(seed=3, time_step_min=0.5, time_step_limit=DT_LIMIT,
                                             layer_norm_epsilon=1e-2),
    "bamba": lambda: bamba(seed=4, time_step_min=0.5, time_step_limit=DT_LIMIT, rms_norm_eps=1e-2),
    "jamba": lambda: jamba(seed=5, rms_norm_eps=1e-2),
    "granitemoehybrid": lambda: granite(seed=6, time_step_min=0.5, time_step_limit=DT_LIMIT, rms_norm_eps=1e-2),
    "falcon_h1": lambda: falcon_h1(seed=7, time_step_min=0.5, time_step_limit=DT_LIMIT, rms_norm_eps=1e-2),
    # Zamba2's mixer clamps at (time_step_min, inf) and runs with rms_norm_eps 1e-5 only
    "zamba2": lambda: zamba2(seed=8, time_step_min=0.5),
}


def make_cache(model, max_seqs):
    return HybridCache(model.config, max_seqs=max_seqs, num_blocks=64, block_size=4, ring_slots=2,
                       dtype=model.dtype)


def sequences(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in LENGTHS]


def hf_logprobs(m, seqs) -> list[torch.Tensor]:
    """HF's full forward of each whole sequence: [len, vocab] log-probabilities each."""
    with torch.no_grad(), float64_oracle():
        return [torch.log_softmax(m(torch.tensor([s]), use_cache=False).logits[0], -1) for s in seqs]


def split_logprobs(target, seqs) -> list[torch.Tensor]:
    """Ragged prefill of PREFILL tokens, an extend of EXTEND, then one decode
    step per remaining token: [len, vocab] log-probabilities each."""
    rows = list(range(len(seqs)))
    cache = make_cache(target, len(seqs))
    first = target.prefill(cache, rows, [s[:k] for s, k in zip(seqs, PREFILL)])
    ext = target.extend(cache, rows, [s[k:k + EXTEND] for s, k in zip(seqs, PREFILL)])
    out = [[first[b, :k], ext[b, :EXTEND]] for b, k in enumerate(PREFILL)]
    pos = [k + EXTEND for k in PREFILL]
    while any(p < len(s) for p, s in zip(pos, seqs)):
        live = [b for b in rows if pos[b] < len(seqs[b])]
        logits = target.decode(cache, live, [seqs[b][pos[b]] for b in live])
        for i, b in enumerate(live):
            out[b].append(logits[i][None])
            pos[b] += 1
    return [torch.log_softmax(torch.cat(parts), -1) for parts in out]


def assert_logprobs_match(target, m, seed: int) -> None:
    seqs = sequences(seed)
    for b, (ours, ref) in enumerate(zip(split_logprobs(target, seqs), hf_logprobs(m, seqs))):
        assert ours.shape == ref.shape
        err = (ours - ref).abs().max(-1).values  # [len]
        assert err.max().item() <= ATOL, f"row {b}: max |Δ log p| per position {err.tolist()}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logprobs_match_hf_float64(family):
    m = FAMILIES[family]()
    assert_logprobs_match(hs.from_hf(m), m, seed=len(family))


def test_mamba_ssm_layout_logprobs_match_hf_float64(tmp_path):
    """mamba_ssm's layout, its `dt_limit` written from the oracle's `time_step_limit`."""
    m = bamba_oracle(9, (1,), 3, 2, time_step_limit=DT_LIMIT)
    config = bamba_adapter.config_from_dict(m.config.to_dict())
    save_mamba_ssm(tmp_path, config, bamba_adapter.weights_from_state(hf_state(m)))
    loaded = hs.load(tmp_path)
    assert loaded.config.mamba2.time_step_limit == DT_LIMIT
    assert_logprobs_match(loaded, m, seed=9)
