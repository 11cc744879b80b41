"""mamba_ssm's `MambaLMHeadModel` weight layout, loaded by `hs.load`.

Oracles: HF transformers models whose forward is mamba_ssm's math, written
into mamba_ssm's layout by `save_mamba_ssm` below: BambaForCausalLM (Mamba2 +
MHA with half-width rotary + GatedMLP; trained with mamba_ssm), Mamba2ForCausalLM
and MambaForCausalLM (HF's loaders only rename `embedding` -> `embeddings`).
The fused tensors are also checked against the formulas of mamba_ssm's
modules (mha.py: q, k, v rows; mlp.py: `y, gate = fc1(x).chunk(2)`).
"""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import hybridspec as hs
from hybridspec.adapters import bamba as bamba_adapter
from hybridspec.adapters import mamba_ssm as adapter
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.config import AttentionConfig, HybridConfig, Mamba2Config, MLPConfig
from hybridspec.errors import UnsupportedModelError
from hybridspec.models.common import take
from oracles import float64_oracle, hf_greedy, randomize_


def save_mamba_ssm(path, config: HybridConfig, weights: dict, vocab_size: int | None = None,
                   pad_vocab_size_multiple: int = 1, binary: bool = False) -> None:
    """Write canonical HybridModel weights as a mamba_ssm model directory: config.json
    plus model.safetensors, or pytorch_model.bin holding both tied names as
    `MambaLMHeadModel.save_pretrained` does."""
    ssm_types = {t for t in config.layer_types if t != "attention"}
    assert len(ssm_types) <= 1 and set(config.ffn_types) in ({"mlp"}, {"none"})
    tied = config.tie_word_embeddings or "lm_head.weight" not in weights
    state = {"backbone.embedding.weight": weights["embed_tokens.weight"],
             "backbone.norm_f.weight": weights["final_norm.weight"]}
    state["lm_head.weight"] = weights["embed_tokens.weight"] if tied else weights["lm_head.weight"]
    for i, kind in enumerate(config.layer_types):
        dst, mixer = f"backbone.layers.{i}.", take(weights, f"layers.{i}.mixer")
        state[dst + "norm.weight"] = weights[f"layers.{i}.input_norm.weight"]
        if kind == "attention":
            for part in ("weight", "bias"):
                if f"q_proj.{part}" in mixer:
                    state[dst + f"mixer.in_proj.{part}"] = torch.cat([mixer[f"{p}_proj.{part}"] for p in "qkv"])
                if f"o_proj.{part}" in mixer:
                    state[dst + f"mixer.out_proj.{part}"] = mixer[f"o_proj.{part}"]
        else:
            state.update({dst + "mixer." + name: t for name, t in mixer.items()})
        if config.ffn_types[i] == "mlp":
            ffn = take(weights, f"layers.{i}.ffn")
            state[dst + "norm2.weight"] = weights[f"layers.{i}.ffn_norm.weight"]
            state[dst + "mlp.fc1.weight"] = torch.cat([ffn["up_proj.weight"], ffn["gate_proj.weight"]])
            state[dst + "mlp.fc2.weight"] = ffn["down_proj.weight"]
    cfg = {"d_model": config.hidden_size, "n_layer": config.num_layers,
           "d_intermediate": config.mlp.intermediate_size if "mlp" in config.ffn_types else 0,
           "vocab_size": vocab_size or config.vocab_size, "ssm_cfg": _ssm_cfg(config, ssm_types),
           "attn_layer_idx": config.attention_layers, "attn_cfg": _attn_cfg(config, weights),
           "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
           "pad_vocab_size_multiple": pad_vocab_size_multiple, "tie_embeddings": tied}
    (path / "config.json").write_text(json.dumps(cfg))
    if binary:
        torch.save(state, path / "pytorch_model.bin")
    else:
        if tied:
            del state["lm_head.weight"]  # safetensors stores a tensor once
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))


def _ssm_cfg(config: HybridConfig, ssm_types: set) -> dict:
    if ssm_types == {"mamba1"}:  # no "layer" key: mamba_ssm's default is Mamba1
        m = config.mamba1
        return {"d_state": m.d_state, "d_conv": m.d_conv, "expand": m.d_inner // config.hidden_size,
                "dt_rank": m.dt_rank, "conv_bias": m.conv_bias, "bias": m.proj_bias}
    m = config.mamba2
    assert m.expand * config.hidden_size == m.d_inner
    cfg = {"layer": "Mamba2", "d_state": m.d_state, "d_conv": m.d_conv, "expand": m.expand, "headdim": m.head_dim,
           "ngroups": m.n_groups, "conv_bias": m.conv_bias, "bias": m.proj_bias, "chunk_size": m.chunk_size}
    if m.time_step_limit != (0.0, float("inf")):
        cfg["dt_limit"] = list(m.time_step_limit)
    return cfg


def _attn_cfg(config: HybridConfig, weights: dict) -> dict:
    if not config.attention_layers:
        return {}
    a, first = config.attention, f"layers.{config.attention_layers[0]}.mixer"
    return {"num_heads": a.num_heads, "num_heads_kv": a.num_kv_heads, "head_dim": a.head_dim,
            "rotary_emb_dim": a.rotary_dim, "rotary_emb_base": a.rope_theta, "softmax_scale": a.scale,
            "qkv_proj_bias": f"{first}.q_proj.bias" in weights, "out_proj_bias": f"{first}.o_proj.bias" in weights,
            "causal": True}


def random_weights(config: HybridConfig, seed: int, biases: bool = False) -> dict[str, torch.Tensor]:
    """Canonical float64 weights for `config` (mamba2 / attention mixers, gated MLP)."""
    g = torch.Generator().manual_seed(seed)
    H = config.hidden_size

    def mat(rows, cols):
        return torch.randn(rows, cols, generator=g, dtype=torch.float64) * 0.5 / cols ** 0.5

    def norm(n):
        return 1 + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)

    w = {"embed_tokens.weight": mat(config.vocab_size, H), "final_norm.weight": norm(H)}
    if not config.tie_word_embeddings:
        w["lm_head.weight"] = mat(config.vocab_size, H)
    for i, kind in enumerate(config.layer_types):
        p = f"layers.{i}."
        w[p + "input_norm.weight"] = norm(H)
        if kind == "attention":
            a = config.attention
            sizes = {"q": a.num_heads * a.head_dim, "k": a.num_kv_heads * a.head_dim, "v": a.num_kv_heads * a.head_dim}
            for name, rows in sizes.items():
                w[p + f"mixer.{name}_proj.weight"] = mat(rows, H)
                if biases:
                    w[p + f"mixer.{name}_proj.bias"] = 0.1 * torch.randn(rows, generator=g, dtype=torch.float64)
            w[p + "mixer.o_proj.weight"] = mat(H, sizes["q"])
            if biases:
                w[p + "mixer.o_proj.bias"] = 0.1 * torch.randn(H, generator=g, dtype=torch.float64)
        else:
            m = config.mamba2
            nh = m.num_heads
            w[p + "mixer.in_proj.weight"] = mat(m.d_inner + m.conv_dim + nh, H)
            w[p + "mixer.conv1d.weight"] = mat(m.conv_dim * m.d_conv, 1).view(m.conv_dim, 1, m.d_conv)
            w[p + "mixer.conv1d.bias"] = 0.1 * torch.randn(m.conv_dim, generator=g, dtype=torch.float64)
            w[p + "mixer.dt_bias"] = torch.rand(nh, generator=g, dtype=torch.float64) * 2 - 2
            w[p + "mixer.A_log"] = torch.rand(nh, generator=g, dtype=torch.float64) * 2 - 1
            w[p + "mixer.D"] = torch.randn(nh, generator=g, dtype=torch.float64)
            w[p + "mixer.norm.weight"] = norm(m.d_inner)
            w[p + "mixer.out_proj.weight"] = mat(H, m.d_inner)
        if config.ffn_types[i] == "mlp":
            I = config.mlp.intermediate_size
            w[p + "ffn_norm.weight"] = norm(H)
            w.update({p + "ffn.gate_proj.weight": mat(I, H), p + "ffn.up_proj.weight": mat(I, H),
                      p + "ffn.down_proj.weight": mat(H, I)})
    return w


def make_cache(model, max_seqs=4):
    return HybridCache(model.config, max_seqs=max_seqs, num_blocks=64, block_size=4, ring_slots=2,
                       dtype=model.dtype)


def prefill(model, ids):
    return model.prefill(make_cache(model), list(range(ids.shape[0])), ids.tolist())


def max_err(a, b):
    return (a - b).abs().max().item()


def ids_for(vocab, seed, shape=(2, 13)):
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(seed))


# -- oracles: HF models that compute what mamba_ssm computes ----------------------------------------------


def bamba_oracle(seed, attn_layers, num_layers, kv_heads, **overrides):
    """Bamba with d_intermediate a multiple of 128, as mamba_ssm's GatedMLP requires."""
    from transformers import BambaConfig, BambaForCausalLM
    cfg = BambaConfig(vocab_size=97, hidden_size=32, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, attn_layer_indices=list(attn_layers),
                      mamba_n_heads=4, mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=8,
                      max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2, **overrides)
    torch.manual_seed(seed)
    return randomize_(BambaForCausalLM(cfg), seed).to(torch.float64).eval()


def hf_state(m):
    return dict(m.named_parameters()) | dict(m.named_buffers())


@pytest.mark.parametrize("attn_layers,num_layers,kv_heads", [((1,), 3, 2), ((0, 2), 3, 1), ((), 2, 4)])
def test_mamba2_mha_mlp_matches_hf_bamba(tmp_path, attn_layers, num_layers, kv_heads):
    m = bamba_oracle(num_layers + kv_heads, attn_layers, num_layers, kv_heads)
    config = bamba_adapter.config_from_dict(m.config.to_dict())
    save_mamba_ssm(tmp_path, config, bamba_adapter.weights_from_state(hf_state(m)))
    loaded = hs.load(tmp_path)
    ids = ids_for(97, 1, (3, 13))
    with torch.no_grad(), float64_oracle():
        ref = m(ids, use_cache=False).logits
    assert max_err(prefill(loaded, ids), ref) <= 1e-9


def test_engine_on_loaded_model_directory_matches_hf_generate(tmp_path):
    m = bamba_oracle(7, (1,), 3, 2)
    save_mamba_ssm(tmp_path, bamba_adapter.config_from_dict(m.config.to_dict()),
                   bamba_adapter.weights_from_state(hf_state(m)))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (6, 11, 3)]
    outs = hs.Engine(hs.load(tmp_path), max_batch_size=4).generate(
        prompts, hs.SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(m, prompts, 8)


def test_pure_mamba2_tied_padded_vocab_matches_hf_mamba2(tmp_path):
    from transformers import Mamba2Config as HFMamba2Config, Mamba2ForCausalLM
    cfg = HFMamba2Config(vocab_size=104, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                         state_size=8, n_groups=2, chunk_size=8, tie_word_embeddings=True)
    torch.manual_seed(8)
    m = randomize_(Mamba2ForCausalLM(cfg), 8).to(torch.float64).eval()
    state = {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in m.state_dict().items()}
    ssm_cfg = {"layer": "Mamba2", "d_state": 8, "d_conv": 4, "expand": 2, "headdim": 16, "ngroups": 2,
               "chunk_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(
        {"d_model": 32, "n_layer": 2, "d_intermediate": 0, "vocab_size": 100, "ssm_cfg": ssm_cfg,
         "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
         "fused_add_norm": True, "pad_vocab_size_multiple": 8, "tie_embeddings": True}))
    torch.save(state, tmp_path / "pytorch_model.bin")  # both tied names, as mamba_ssm saves
    loaded = hs.load(tmp_path)
    assert loaded.config.vocab_size == 104 and loaded.lm_head is loaded.embed
    ids = ids_for(100, 8)
    with torch.no_grad(), float64_oracle():
        ref = m(ids, use_cache=False).logits
    assert max_err(prefill(loaded, ids), ref) <= 1e-9


def test_mamba1_default_layer_matches_hf_mamba(tmp_path):
    from transformers import MambaConfig as HFMambaConfig, MambaForCausalLM
    cfg = HFMambaConfig(vocab_size=97, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)
    torch.manual_seed(9)
    m = randomize_(MambaForCausalLM(cfg), 9).to(torch.float64).eval()
    state = {k.replace("backbone.embeddings.", "backbone.embedding."): v.contiguous()
             for k, v in m.state_dict().items() if k != "lm_head.weight"}
    (tmp_path / "config.json").write_text(json.dumps(  # no ssm_cfg["layer"]: mamba_ssm builds Mamba1
        {"d_model": 32, "n_layer": 2, "vocab_size": 97, "ssm_cfg": {"d_state": 8}, "rms_norm": True,
         "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 1}))
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = hs.load(tmp_path)
    assert loaded.config.layer_types == ("mamba1", "mamba1") and loaded.config.mamba1.dt_rank == 2
    ids = ids_for(97, 9)
    with torch.no_grad(), float64_oracle():
        ref = m(ids, use_cache=False).logits
    assert max_err(prefill(loaded, ids), ref) <= 1e-9


# -- features no HF model has: checked against the HybridModel the weights came from -----------------------


def biased_hybrid_config():
    """GQA with biased q/k/v/out projections, a 6-of-8 rotary span, an explicit
    softmax scale, a Δ limit and grouped Mamba2 (features of MHA / Mamba2 that
    Bamba does not use)."""
    return HybridConfig(
        vocab_size=104, hidden_size=32, layer_types=("mamba2", "attention", "mamba2", "attention"),
        ffn_types=("mlp",) * 4, rms_norm_eps=1e-5,
        attention=AttentionConfig(num_heads=4, num_kv_heads=1, head_dim=8, partial_rotary_factor=0.75,
                                  rope_theta=500.0, scale=0.3, bias=True),
        mamba2=Mamba2Config(num_heads=4, head_dim=16, d_state=8, n_groups=2, time_step_limit=(0.05, 2.0),
                            chunk_size=16),
        mlp=MLPConfig(128), tie_word_embeddings=True)


def test_round_trip_equals_source_model(tmp_path):
    config = biased_hybrid_config()
    weights = random_weights(config, seed=10, biases=True)
    save_mamba_ssm(tmp_path, config, weights, vocab_size=99, pad_vocab_size_multiple=8)
    loaded = hs.load(tmp_path)
    assert loaded.config.attention.rotary_dim == 6 and loaded.config.mamba2.time_step_limit == (0.05, 2.0)
    ids = ids_for(99, 10, (3, 11))
    assert max_err(prefill(loaded, ids), prefill(hs.HybridModel(config, weights), ids)) <= 1e-12


@pytest.mark.parametrize("head_dim,rotary_dim", [(8, 6), (88, 30), (104, 60), (168, 118)])
def test_rotary_span_is_exact(head_dim, rotary_dim):
    """rotary_emb_dim survives the factor round trip even where rotary_dim / head_dim is inexact."""
    attn_cfg = {"num_heads": 2, "head_dim": head_dim, "rotary_emb_dim": rotary_dim, "causal": True}
    assert adapter.config_from_dict(BASE | {"attn_cfg": attn_cfg}).attention.rotary_dim == rotary_dim


def test_fused_tensors_follow_mamba_ssm_modules(tmp_path):
    """mha.py: q, kv = in_proj(x).split; kv -> (two, h_kv, d); mlp.py: y, gate = fc1(x).chunk(2)."""
    config = biased_hybrid_config()
    save_mamba_ssm(tmp_path, config, random_weights(config, seed=11, biases=True), pad_vocab_size_multiple=8)
    loaded = hs.load(tmp_path)
    raw = load_file(str(tmp_path / "model.safetensors"))
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    fc1, fc2 = raw["backbone.layers.0.mlp.fc1.weight"], raw["backbone.layers.0.mlp.fc2.weight"]
    y, gate = F.linear(x, fc1).chunk(2, dim=-1)
    assert max_err(loaded.layers[0].ffn(x), F.linear(y * F.silu(gate), fc2)) <= 1e-12
    a, mixer = config.attention, loaded.layers[1].mixer
    qkv = F.linear(x, raw["backbone.layers.1.mixer.in_proj.weight"], raw["backbone.layers.1.mixer.in_proj.bias"])
    q, kv = qkv.split([a.num_heads * a.head_dim, 2 * a.num_kv_heads * a.head_dim], dim=-1)
    k, v = kv.view(5, 2, a.num_kv_heads, a.head_dim).unbind(dim=1)
    assert max_err(F.linear(x, mixer.q_proj, mixer.q_bias), q) <= 1e-12
    assert max_err(F.linear(x, mixer.k_proj, mixer.k_bias).view_as(k), k) <= 1e-12
    assert max_err(F.linear(x, mixer.v_proj, mixer.v_bias).view_as(v), v) <= 1e-12
    assert torch.equal(mixer.o_proj, raw["backbone.layers.1.mixer.out_proj.weight"])
    assert torch.equal(mixer.o_bias, raw["backbone.layers.1.mixer.out_proj.bias"])


# -- refusals ----------------------------------------------------------------------------------------------


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError) as info:
        hs.load(tmp_path)
    message = str(info.value)
    for name in ("LlamaForCausalLM", "BambaForCausalLM", "NemotronHForCausalLM", "GraniteMoeHybridForCausalLM",
                 "JambaForCausalLM", "mamba_ssm"):
        assert name in message


BASE = {"d_model": 32, "n_layer": 2, "vocab_size": 97, "ssm_cfg": {"layer": "Mamba2", "headdim": 16},
        "attn_layer_idx": [1], "attn_cfg": {"num_heads": 4, "causal": True}}


@pytest.mark.parametrize("change,fragment", [
    ({"rms_norm": False}, "rms_norm"),
    ({"ssm_cfg": {"layer": "Mamba3"}}, "Mamba3"),
    ({"ssm_cfg": {"layer": "Mamba2", "headdim": 16, "d_ssm": 32}}, "d_ssm"),
    ({"ssm_cfg": {"layer": "Mamba2", "headdim": 16, "norm_before_gate": True}}, "norm_before_gate"),
    ({"attn_cfg": {"num_heads": 4}}, "causal"),
    ({"attn_cfg": {"num_heads": 4, "causal": True, "mlp_dim": 64}}, "mlp_dim"),
    ({"attn_cfg": {"num_heads": 4, "causal": True, "rotary_emb_dim": 4, "rotary_emb_interleaved": True}},
     "interleaved")])
def test_unsupported_mamba_ssm_features_are_refused(change, fragment):
    with pytest.raises(UnsupportedModelError, match=fragment):
        adapter.config_from_dict(BASE | change)
