"""The chunked SSD prefill scan against the token-by-token recurrence, and
long-prompt prefill (which takes the chunked path) against HF."""
import pytest
import torch

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.kernels.triton.mamba2_verify import mamba2_verify_ref
from hybridspec.models.mamba2 import SSD_MIN_TOKENS
from hybridspec.models.ssd import ssd_chunk_scan
from oracles import bamba, float64_oracle


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_chunked_scan_equals_token_recurrence(chunk):
    g = torch.Generator().manual_seed(chunk)
    batch, T, heads, headdim, d_state, groups = 3, 37, 4, 8, 6, 2

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x, B, C = rand(batch, T, heads, headdim), rand(batch, T, groups, d_state), rand(batch, T, groups, d_state)
    dt = torch.rand(batch, T, heads, generator=g, dtype=torch.float64)
    A, D = -2 * torch.rand(heads, generator=g, dtype=torch.float64), rand(heads)
    pool = rand(8, heads, headdim, d_state)
    src, snap = torch.tensor([0, 1, 2]), torch.full((batch, T), -1)
    snap[:, -1] = torch.tensor([3, 4, 5])
    y_ref = mamba2_verify_ref(pool, src, snap, x, dt, A, B, C, D, torch.full((batch,), T))
    expand = heads // groups
    y, h = ssd_chunk_scan(x, dt, A, B.repeat_interleave(expand, 2), C.repeat_interleave(expand, 2), D, pool[src], chunk)
    assert (y - y_ref).abs().max() < 1e-12
    assert (h - pool[3:6]).abs().max() < 1e-12


def test_long_prompt_prefill_matches_hf_and_token_path():
    m = bamba(seed=21, attn_layers=(1,), num_layers=3, n_groups=2)
    target = hs.from_hf(m)
    g = torch.Generator().manual_seed(21)
    lengths = (45, 2 * SSD_MIN_TOKENS, 19)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in lengths]
    cache = HybridCache(target.config, max_seqs=3, num_blocks=64, block_size=8, ring_slots=2, dtype=torch.float64)
    logits = target.prefill(cache, [0, 1, 2], prompts)  # one ragged forward: the chunked scan
    for b, prompt in enumerate(prompts):
        with torch.no_grad(), float64_oracle():
            ref = m(torch.tensor([prompt]), use_cache=False).logits[0]
        assert (logits[b, :len(prompt)] - ref).abs().max() <= 1e-9
    # the states it leaves equal those of feeding the prompts token by token
    stepwise = HybridCache(target.config, max_seqs=3, num_blocks=64, block_size=8, ring_slots=2, dtype=torch.float64)
    target.prefill(stepwise, [0, 1, 2], [p[:1] for p in prompts])
    for t in range(1, max(lengths)):
        rows = [b for b, p in enumerate(prompts) if t < len(p)]
        target.decode(stepwise, rows, [prompts[b][t] for b in rows])
    for layer in range(len(target.config.mamba_layers)):
        for s in range(3):
            a = cache.states.ssm_states[layer][cache.head(s)]
            b = stepwise.states.ssm_states[layer][stepwise.head(s)]
            assert (a - b).abs().max() < 1e-10
