"""The native whole forward on every layer kind and feed-forward kind of every
family (float32, packed for CPU, the native kernels on): Mamba-1, Mamba-2,
attention, gated DeltaNet with Qwen's gated attention, Falcon-H1's parallel
mixer and Zamba2's shared blocks; dense
plain and gated MLPs, MoE with and without a shared expert; multipliers at
1.0 and not. Each model prefills, decodes and verifies with an input log;
the logits, states, conv windows, K/V and logs are the torch path's (native
kernels off) within float32 rounding, and the layer-by-layer path's (whole
forward off) bit for bit. Where the whole forward does not take a layer
(its descriptor's kind), it declines and the layers run: a model that
describes an MoE is never handed to the MLP block (the GraniteMoeHybrid and
Jamba models below raised AttributeError at the first prefill)."""
from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.kernels.cpu import forward as cpu_forward
from native_cpu import one_thread, x86_with_compiler  # noqa: F401 (fixtures)
from native_switch import native_off, whole_forward_off
from oracles import bamba, falcon_h1, granite, jamba, nemotron_h, nemotron_h_moe, qwen3_5, qwen3_5_moe, qwen3_next, zamba2

pytestmark = x86_with_compiler

ONES = (1.0, 1.0, 1.0, 1.0)
FAMILIES = {  # name: (HF model, whether the whole forward takes every layer)
    "bamba: mamba2, attention, gated MLP": (lambda: bamba(seed=1, dtype=torch.float32), True),
    "granite: dense gated MLP, multipliers 1": (
        lambda: granite(seed=2, layer_types=("mamba", "attention"), num_experts=0, multipliers=ONES,
                        dtype=torch.float32), True),
    "granite: MoE + shared expert, multipliers 1 (the issue's model)": (
        lambda: granite(seed=3, layer_types=("mamba", "attention"), num_experts=4, multipliers=ONES,
                        dtype=torch.float32), False),
    "granite: MoE + shared expert, multipliers not 1": (
        lambda: granite(seed=4, layer_types=("attention", "mamba", "mamba"), dtype=torch.float32), False),
    "granite: dense MLP, multipliers not 1": (
        lambda: granite(seed=5, layer_types=("mamba", "attention"), num_experts=0, dtype=torch.float32), True),
    "jamba: attention first, every layer MoE (the issue's model)": (
        lambda: jamba(seed=6, num_layers=2, attn_period=2, attn_offset=0, expert_period=1, expert_offset=0,
                      dtype=torch.float32), False),
    "jamba: mamba1, attention, gated MLP and MoE": (lambda: jamba(seed=7, dtype=torch.float32), False),
    "nemotron-h: mamba2, attention, squared-ReLU MLP": (lambda: nemotron_h(seed=8, dtype=torch.float32), False),
    "nemotron-h: MoE + shared expert": (lambda: nemotron_h_moe(seed=9).to(torch.float32), False),
    "falcon-h1: parallel mixer, multipliers": (lambda: falcon_h1(seed=10, dtype=torch.float32), False),
    "falcon-h1: parallel mixer, no multipliers": (
        lambda: falcon_h1(seed=11, dtype=torch.float32, multipliers=False), False),
    "zamba2: shared blocks": (lambda: zamba2(seed=12, dtype=torch.float32), False),
    "qwen3-next: gated DeltaNet, gated attention, MoE + gated shared expert": (
        lambda: qwen3_next(seed=13, dtype=torch.float32), False),
    "qwen3.5: gated DeltaNet, gated attention, gated MLP": (lambda: qwen3_5(seed=14, dtype=torch.float32), False),
    "qwen3.5 MoE": (lambda: qwen3_5_moe(seed=15, dtype=torch.float32), False),
}


def run(model):
    """Prefill two rows, three decode steps, one snapshotted verify of 4 inputs with an
    input log; returns (logits, cache, log)."""
    cache = HybridCache(model.config, max_seqs=2, num_blocks=16, block_size=8, ring_slots=6, dtype=model.dtype)
    ids, prompts = [0, 1], [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
    logits = [model.prefill(cache, ids, prompts, last_only=True)]
    for step in range(3):
        logits.append(model.decode(cache, ids, [20 + step, 30 + step]))
    log, snap = {}, None
    if cache.states is not None:
        ring = [cache.states.ring_slots(s) for s in ids]
        snap = torch.tensor([[r[(r.index(cache.head(s)) + 1 + t) % len(r)] for t in range(4)]
                             for s, r in zip(ids, ring)])
    logits.append(model.extend(cache, ids, [[40, 41, 42, 43], [50, 51, 52, 53]], snap_slot=snap, input_log=log))
    return logits, cache, log


def state_tensors(cache) -> list[torch.Tensor]:
    out = []
    if cache.states is not None:
        out += [*cache.states.ssm_states, *cache.states.conv_states]
    if cache.kv is not None:
        out += [cache.kv.k_cache, cache.kv.v_cache]
    return out


def log_tensors(log) -> list[torch.Tensor]:
    return [getattr(log[layer], field.name) for layer in sorted(log) for field in dataclasses.fields(log[layer])]


@pytest.fixture
def whole_calls(monkeypatch):
    counts = collections.Counter()
    original = cpu_forward.forward

    def counted(*args):
        out = original(*args)
        counts["ran" if out is not None else "declined"] += 1
        return out
    monkeypatch.setattr(cpu_forward, "forward", counted)
    return counts


@pytest.mark.parametrize("family", FAMILIES)
def test_native_forward_matches_the_torch_path_and_the_layers(family, whole_calls):
    make, runs_whole = FAMILIES[family]
    model = hs.from_hf(make()).pack_for_cpu()
    assert model.dtype is torch.float32
    native = run(model)
    assert whole_calls["ran"] == (5 if runs_whole else 0), dict(whole_calls)
    with whole_forward_off(model):
        layers = run(model)
    with native_off(model):
        reference = run(model)
    for a, b, c in zip(native[0], layers[0], reference[0], strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
    for a, b, c in zip(state_tensors(native[1]), state_tensors(layers[1]), state_tensors(reference[1]), strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
    assert native[1].bookkeeping() == layers[1].bookkeeping() == reference[1].bookkeeping()
    assert native[2].keys() == layers[2].keys() == reference[2].keys()
    for a, b, c in zip(log_tensors(native[2]), log_tensors(layers[2]), log_tensors(reference[2]), strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)


def test_the_issues_granite_model_loads_and_prefills(tmp_path):
    """A 2-layer GraniteMoeHybrid with gated MoE layers and multipliers at 1.0,
    saved and read with `hs.load` (float32, packed for CPU): its first prefill ran
    the MoE through the MLP block's table builder."""
    granite(seed=13, layer_types=("mamba", "attention"), num_experts=4, multipliers=ONES,
            dtype=torch.float32).save_pretrained(tmp_path)
    model = hs.load(tmp_path, dtype=torch.float32)
    cache = HybridCache(model.config, max_seqs=1, num_blocks=8, block_size=8, ring_slots=4, dtype=model.dtype)
    logits = model.prefill(cache, [0], [[3, 4, 5, 6]], last_only=True)
    assert logits.shape == (1, 1, 97) and torch.isfinite(logits).all()
