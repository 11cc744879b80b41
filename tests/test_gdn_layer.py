"""The gated DeltaNet layer on its own: the chunked form of the rule (prefill)
against the token-by-token reference, its state and log sizes, its input log,
and a GDN model's forwards on every backend path."""
import pytest
import torch

from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.config import GdnConfig
from hybridspec.kernels.triton.gdn_verify import gdn_verify_ref, per_value_head
from hybridspec.models.gdn_chunk import gdn_chunk_scan
from hybridspec.models.gdn_log import GdnInputLog
from hybridspec.rollback.models import tiny_model
from hybridspec.cache.state_specs import bytes_per_slot, log_bytes_per_input


def random_inputs(batch, T, HK, HV, d_k, d_v, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(batch, T, HK, d_k, generator=g, dtype=dtype), dim=-1)
            for _ in range(2))
    v = torch.randn(batch, T, HV, d_v, generator=g, dtype=dtype)
    gate = -torch.rand(batch, T, HV, generator=g, dtype=dtype) * 2  # log decays in (-2, 0]
    beta = torch.rand(batch, T, HV, generator=g, dtype=dtype)
    h0 = torch.randn(batch, HV, d_k, d_v, generator=g, dtype=dtype)
    return q * d_k ** -0.5, k, v, gate, beta, h0


@pytest.mark.parametrize("T,chunk", [(1, 4), (13, 4), (16, 16), (40, 16)])
def test_chunked_rule_equals_the_token_by_token_rule(T, chunk):
    batch, HK, HV, d_k, d_v = 2, 2, 4, 8, 6
    q, k, v, g, beta, h0 = random_inputs(batch, T, HK, HV, d_k, d_v, seed=T)
    states = torch.cat([h0, torch.zeros_like(h0)])  # slots 0, 1: the heads; 2, 3: the final states
    snap = torch.full((batch, T), -1)
    snap[:, T - 1] = torch.tensor([2, 3])
    o_ref = gdn_verify_ref(states, torch.tensor([0, 1]), snap, q, k, v, g, beta, torch.tensor([T, T]))
    o, final = gdn_chunk_scan(per_value_head(q, HV), per_value_head(k, HV), v, g, beta, h0, chunk)
    assert (o - o_ref).abs().max().item() < 1e-12
    assert (final - states[2:4]).abs().max().item() < 1e-12


def test_padding_with_no_decay_and_no_write_keeps_the_state():
    q, k, v, g, beta, h0 = random_inputs(1, 9, 1, 2, 4, 4, seed=1)
    _, short = gdn_chunk_scan(q[:, :5].expand(-1, -1, 2, -1), k[:, :5].expand(-1, -1, 2, -1), v[:, :5], g[:, :5],
                              beta[:, :5], h0, 4)
    live = (torch.arange(9) < 5)[None, :, None]
    _, padded = gdn_chunk_scan(q.expand(-1, -1, 2, -1), k.expand(-1, -1, 2, -1), v, g * live, beta * live, h0, 4)
    assert (short - padded).abs().max().item() < 1e-13


def test_state_and_log_sizes():
    cfg = GdnConfig(num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128)  # Qwen3-Next-80B
    spec = cfg.state_spec()
    assert spec.ssm == (32, 128, 128) and spec.conv == (2 * 16 * 128 + 32 * 128, 3)
    assert bytes_per_slot([spec], 4) == 4 * (32 * 128 * 128 + 8192 * 3)
    # xs (conv_dim) + k (HK·d_k) + v (HV·d_v) in the model dtype, g and β per value head in the state dtype
    assert log_bytes_per_input([spec], 2, 4) == 2 * (8192 + 2048 + 4096) + 4 * 64
    assert log_bytes_per_input([spec], 2, 4) * 25 < bytes_per_slot([spec], 4)  # a state is large, inputs small


def test_input_log_shifts_rows_and_counts_bytes():
    xs, k, v = torch.arange(12.).view(2, 3, 2), torch.zeros(2, 3, 1, 2), torch.zeros(2, 3, 2, 2)
    g = beta = torch.arange(12.).view(2, 3, 2)
    log = GdnInputLog(xs, k, v, g, beta)
    assert log.nbytes() == 4 * (12 + 12 + 24 + 12 + 12)
    shifted = log.shifted(torch.tensor([1, 0]))
    assert shifted.xs[0].tolist() == [[2., 3.], [4., 5.], [4., 5.]] and torch.equal(shifted.g[1], g[1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_gdn_model_prefills_like_it_decodes(dtype):
    """Prefill of 20 tokens (the chunked form) and decode steps (the token-by-token rule) agree."""
    model = tiny_model(seed=3, layer_types=("gdn", "attention", "gdn"), dtype=dtype)
    tokens = torch.randint(3, 97, (20,), generator=torch.Generator().manual_seed(3)).tolist()

    def cache():
        return HybridCache(model.config, max_seqs=1, num_blocks=16, block_size=8, dtype=dtype)
    full = model.prefill(cache(), [0], [tokens])[0]
    stepped = cache()
    model.prefill(stepped, [0], [tokens[:1]])
    rows = [model.decode(stepped, [0], [t])[0] for t in tokens[1:]]
    atol = 1e-12 if dtype == torch.float64 else 1e-4
    assert (torch.stack(rows) - full[1:]).abs().max().item() < atol
