"""Jamba through hybridspec's own runtime against HF transformers'
`JambaForCausalLM` (tiny random configs): logits, extend/decode, the input
log, shared weights, the Hub weight layout, and greedy generation."""
from __future__ import annotations

import functools
import json

import pytest
import torch

import hybridspec as hs
from hybridspec.adapters import jamba as jamba_adapter
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.errors import UnsupportedModelError
from hybridspec.kernels.triton.conv_window import conv_window_rebuild_ref
from hybridspec.kernels.triton.ssm_replay import mamba1_replay_ref

from oracles import float64_oracle, jamba

# name -> jamba() arguments; layer patterns are (mixers, feed-forwards)
CONFIGS = {
    # M A M A / moe mlp moe mlp, GQA (4 query heads, 2 KV heads)
    "gqa_moe": dict(),
    # M M A M M / mlp moe mlp moe mlp, MHA: Jamba-v0.1's layout, shortened
    "jamba_layout": dict(num_layers=5, attn_period=4, attn_offset=2, expert_period=2, expert_offset=1, kv_heads=4),
    # A M M, every layer MoE with top-1 routing, MQA
    "mqa_top1": dict(num_layers=3, attn_period=3, attn_offset=0, expert_period=1, expert_offset=0, top_k=1,
                     kv_heads=1),
    # M M, dense MLPs only, no attention layer (no KV cache)
    "mamba_only": dict(num_layers=2, attn_period=4, attn_offset=3, num_experts=1),
}
F64_TOL = 1e-9


@functools.lru_cache(maxsize=None)
def model_pair(name: str, dtype: torch.dtype = torch.float64):
    m = jamba(**CONFIGS[name], dtype=dtype)
    return m, hs.from_hf(m)


def new_cache(target, dtype=torch.float64, ring_slots=2):
    return HybridCache(target.config, max_seqs=4, num_blocks=32, block_size=4, ring_slots=ring_slots, dtype=dtype)


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in lengths]


def hf_logits(m, tokens: list[int]) -> torch.Tensor:
    """float64 oracle logits of one sequence: [len(tokens), vocab]. Without a
    cache: HF's cache cannot report a length when no layer is attention."""
    with torch.no_grad(), float64_oracle():
        return m(torch.tensor([tokens]), use_cache=False).logits[0]


def test_layer_pattern_matches_hf_config():
    from transformers import JambaConfig

    for periods in [(8, 4, 2, 1), (2, 1, 2, 0), (3, 0, 1, 0), (4, 3, 3, 2)]:
        ap, ao, ep, eo = periods
        cfg = JambaConfig(num_hidden_layers=9, attn_layer_period=ap, attn_layer_offset=ao,
                          expert_layer_period=ep, expert_layer_offset=eo, num_experts=4)
        mixers, ffns = jamba_adapter.layer_pattern(cfg.to_dict())
        assert mixers == tuple("attention" if t == "attention" else "mamba1" for t in cfg.layers_block_type)
        assert ffns == tuple("moe" if e > 1 else "mlp" for e in cfg.layers_num_experts)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_logits_match_hf_float64(name):
    m, target = model_pair(name)
    prompts = prompts_of([11, 11, 6, 1])  # an equal-length pair, then ragged rows
    cache = new_cache(target)
    out = target.prefill(cache, [0, 1, 2, 3], prompts)  # [4, 11, vocab]
    with torch.no_grad(), float64_oracle():
        ref = m(torch.tensor(prompts[:2]), use_cache=False).logits  # [2, 11, vocab]
    assert (out[:2] - ref).abs().max().item() <= F64_TOL
    for b in (2, 3):
        n = len(prompts[b])
        assert (out[b, :n] - hf_logits(m, prompts[b])).abs().max().item() <= F64_TOL


def test_prefill_logits_match_hf_float32_without_oracle():
    m, target = model_pair("gqa_moe", torch.float32)
    prompts = prompts_of([9, 9], seed=3)
    out = target.prefill(new_cache(target, torch.float32), [0, 1], prompts)
    with torch.no_grad():
        ref = m(torch.tensor(prompts)).logits
    assert out.dtype == torch.float32
    assert (out - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["gqa_moe", "jamba_layout"])
def test_extend_equals_prefill_of_the_whole(name):
    m, target = model_pair(name)
    whole = prompts_of([10, 7], seed=1)
    k = [3, 1]
    cache = new_cache(target)
    target.prefill(cache, [0, 1], [w[:-n] for w, n in zip(whole, k)])
    out = target.extend(cache, [0, 1], [w[-n:] for w, n in zip(whole, k)])  # [2, 3, vocab]
    full = target.prefill(new_cache(target), [0, 1], whole)  # [2, 10, vocab]
    for b, (w, n) in enumerate(zip(whole, k)):
        assert (out[b, :n] - full[b, len(w) - n:len(w)]).abs().max().item() <= 1e-12
        assert (out[b, :n] - hf_logits(m, w)[-n:]).abs().max().item() <= F64_TOL
    assert cache.computed_len == {0: 10, 1: 7}


@pytest.mark.parametrize("name", ["gqa_moe", "mqa_top1"])
def test_decode_steps_equal_full_forward(name):
    m, target = model_pair(name)
    whole = prompts_of([9, 6], seed=2)
    prompt_lens = [4, 2]
    cache = new_cache(target)
    target.prefill(cache, [0, 1], [w[:p] for w, p in zip(whole, prompt_lens)])
    refs = [hf_logits(m, w) for w in whole]
    for step in range(4):
        pos = [p + step for p in prompt_lens]
        logits = target.decode(cache, [0, 1], [w[i] for w, i in zip(whole, pos)])  # [2, vocab]
        for b in range(2):
            assert (logits[b] - refs[b][pos[b]]).abs().max().item() <= F64_TOL


def test_parameters_are_shared_not_copied():
    m, target = model_pair("gqa_moe")
    hf_ptrs = {p.data_ptr() for p in m.parameters()}
    assert all(p.data_ptr() in hf_ptrs for p in target.parameters())
    assert target.num_parameters() == sum(p.numel() for p in m.parameters())
    mixer, hf_mixer = target.layers[0].mixer, m.model.layers[0].mamba
    assert mixer.A_log.data_ptr() == hf_mixer.A_log.data_ptr()
    assert mixer.dt_norm.weight.data_ptr() == hf_mixer.dt_layernorm.weight.data_ptr()
    ffn, hf_ffn = target.layers[0].ffn, m.model.layers[0].feed_forward
    assert ffn.up.data_ptr() == hf_ffn.experts.gate_up_proj.data_ptr()
    assert ffn.router.data_ptr() == hf_ffn.router.weight.data_ptr()


def test_input_log_replays_every_snapshot():
    """The logged (xs, x, dt, B, C) rebuild, from the round-start state, the
    SSM state and conv window the forward wrote after every input."""
    m, target = model_pair("jamba_layout")
    T = 4
    cache = new_cache(target, ring_slots=T + 2)
    target.prefill(cache, [0, 1], prompts_of([5, 3], seed=4))
    heads = [cache.head(0), cache.head(1)]
    rings = [cache.states.ring_slots(0), cache.states.ring_slots(1)]

    def after_head(b: int, i: int) -> int:  # the ring slot i places after row b's head
        return rings[b][(rings[b].index(heads[b]) + i) % len(rings[b])]

    snap = torch.tensor([[after_head(b, 1 + t) for t in range(T)] for b in range(2)])  # [2, T]
    log = {}
    drafts = prompts_of([T, 2], seed=5)
    target.extend(cache, [0, 1], drafts, snap_slot=snap, input_log=log)
    assert sorted(log) == list(range(len(target.config.mamba_layers)))
    num_tokens = torch.tensor([T, 2])
    scratch = torch.tensor([after_head(b, T + 1) for b in range(2)])  # the ring's one slot left
    for layer, entry in log.items():
        mixer = target.layers[target.config.mamba_layers[layer]].mixer
        A = -torch.exp(mixer.A_log)
        ssm, conv = cache.states.ssm_states[layer], cache.states.conv_states[layer]
        assert entry.x.shape == entry.xs.shape == entry.dt.shape == (2, T, target.config.mamba1.d_inner)
        for n in range(1, T + 1):
            steps = torch.minimum(torch.tensor(n), num_tokens)
            mamba1_replay_ref(ssm, torch.tensor(heads), scratch, steps, entry.x, entry.dt, A, entry.B, entry.C)
            conv_window_rebuild_ref(conv, torch.tensor(heads), scratch, steps, entry.xs)
            for b in range(2):
                written = snap[b, steps[b] - 1]
                assert torch.allclose(ssm[scratch[b]], ssm[written], rtol=0, atol=1e-12)
                assert torch.equal(conv[scratch[b]], conv[written])


def test_load_hub_layout_with_per_expert_weights(tmp_path):
    """Hub models keep experts.{e}.gate_proj/up_proj/down_proj; hs.load stacks them."""
    from safetensors.torch import save_file

    m, target = model_pair("gqa_moe")
    config = dict(m.config.to_dict(), architectures=["JambaForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {}
    for name, t in m.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix, (gate, up) = name[: -len("gate_up_proj")], t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                state[f"{prefix}{e}.gate_proj.weight"] = gate[e].clone()
                state[f"{prefix}{e}.up_proj.weight"] = up[e].clone()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                state[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = t[e].clone()
        else:
            state[name] = t.clone()
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = hs.load(tmp_path)
    prompts = prompts_of([7, 7], seed=6)
    out = loaded.prefill(new_cache(loaded), [0, 1], prompts)
    ref = target.prefill(new_cache(target), [0, 1], prompts)
    assert (out - ref).abs().max().item() <= 1e-12  # not bitwise: BLAS paths depend on alignment


def test_unsupported_activation_is_refused():
    m, _ = model_pair("gqa_moe")
    cfg = dict(m.config.to_dict(), hidden_act="gelu")
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'"):
        jamba_adapter.config_from_dict(cfg)


@pytest.mark.parametrize("name", ["gqa_moe", "jamba_layout"])
def test_greedy_generate_matches_hf_left_padded(name):
    """HF's padded Jamba path is exact here: padded inputs are zeroed before
    in_proj and after the conv, so the Mamba state stays zero over the padding,
    and attention (no RoPE) masks them."""
    m, target = model_pair(name)
    prompts = prompts_of([5, 9, 2], seed=7)
    eos = m.config.eos_token_id
    outs = hs.Engine(target).generate(prompts, hs.SamplingParams(max_new_tokens=8, stop_token_ids=(eos,)))
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (ids != 0).long()  # prompts hold ids >= 3, so 0 marks exactly the padding
    with torch.no_grad(), float64_oracle():
        generated = m.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8)[:, width:]
    for out, row in zip(outs, generated.tolist()):
        expected = row[: row.index(eos) + 1] if eos in row else row
        assert out.token_ids == expected
