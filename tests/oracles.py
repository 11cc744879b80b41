"""Oracles nobody here wrote: HF transformers models with tiny random configs.

HF's plain-PyTorch paths downcast to float32 in places even for a float64
model (`A_log.float()`, `hidden_states.to(torch.float32)` in RMSNorm, the
chunked scan, `softmax(..., dtype=torch.float32)`, `x.type(torch.float32)` in
Nemotron-H's MoE router). `float64_oracle()` keeps
float64 tensors float64 inside those calls, so that a float64 HF forward is a
float64 oracle; it changes no other behaviour of HF's code.

Each model builder takes `**overrides`, further HF config fields (a
non-default `time_step_limit`, `rms_norm_eps`, ...).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

_to, _float, _type, _softmax = torch.Tensor.to, torch.Tensor.float, torch.Tensor.type, F.softmax


def _keep_f64_to(self, *args, **kwargs):
    out = _to(self, *args, **kwargs)
    if self.dtype == torch.float64 and out.dtype == torch.float32:
        return _to(out if out.device == self.device else self, device=out.device, dtype=torch.float64) \
            if out.device != self.device else self
    return out


def _keep_f64_float(self, *args, **kwargs):
    return self if self.dtype == torch.float64 else _float(self, *args, **kwargs)


def _keep_f64_type(self, dtype=None, *args, **kwargs):
    if self.dtype == torch.float64 and dtype in (torch.float32, "torch.FloatTensor"):
        return self
    return _type(self, dtype, *args, **kwargs)


def _keep_f64_softmax(x, *args, dtype=None, **kwargs):
    if x.dtype == torch.float64 and dtype == torch.float32:
        dtype = torch.float64
    return _softmax(x, *args, dtype=dtype, **kwargs)


@contextlib.contextmanager
def float64_oracle():
    patched = _keep_f64_to, _keep_f64_float, _keep_f64_type, _keep_f64_softmax
    torch.Tensor.to, torch.Tensor.float, torch.Tensor.type, F.softmax = patched
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, torch.Tensor.type, F.softmax = _to, _float, _type, _softmax


def randomize_(model, seed: int, scale: float = 0.5):
    """Give every parameter non-trivial random values (HF init leaves norms at
    1 and biases at 0, which would hide bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 2)
            elif "norm" in name or "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * scale / max(1, p.shape[-1]) ** 0.5)
    return model


def bamba(seed=0, attn_layers=(1,), num_layers=3, dtype=torch.float64, vocab=97, kv_heads=2, n_groups=1,
          hidden=32, heads=4, **overrides):
    from transformers import BambaConfig, BambaForCausalLM
    cfg = BambaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=48, num_hidden_layers=num_layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, attn_layer_indices=list(attn_layers),
                      mamba_n_heads=4, mamba_d_state=8, mamba_n_groups=n_groups, mamba_chunk_size=8,
                      max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2, **overrides)
    torch.manual_seed(seed)
    return randomize_(BambaForCausalLM(cfg), seed).to(dtype).eval()


def jamba(seed=0, num_layers=4, attn_period=2, attn_offset=1, expert_period=2, expert_offset=0, num_experts=4,
          top_k=2, kv_heads=2, dtype=torch.float64, vocab=97, **overrides):
    from transformers import JambaConfig, JambaForCausalLM
    cfg = JambaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, attn_layer_period=attn_period,
                      attn_layer_offset=attn_offset, expert_layer_period=expert_period,
                      expert_layer_offset=expert_offset, num_experts=num_experts, num_experts_per_tok=top_k,
                      mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
                      max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                      experts_implementation="eager", **overrides)  # grouped_mm has no float64
    torch.manual_seed(seed)
    return randomize_(JambaForCausalLM(cfg), seed).to(dtype).eval()


def nemotron_h(seed=0, pattern="M*M-", dtype=torch.float64, vocab=97, kv_heads=2, n_groups=2, **overrides):
    """Nemotron-H: one sublayer per layer; "M" Mamba2, "*" attention (no RoPE), "-" squared-ReLU MLP."""
    from transformers import NemotronHConfig, NemotronHForCausalLM
    cfg = NemotronHConfig(vocab_size=vocab, hidden_size=32, hybrid_override_pattern=pattern,
                          num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=8, intermediate_size=48,
                          mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=n_groups, chunk_size=8,
                          max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2, **overrides)
    torch.manual_seed(seed)
    return randomize_(NemotronHForCausalLM(cfg), seed).to(dtype).eval()


def nemotron_h_moe(seed=0, pattern="ME*EM", dtype=torch.float64, vocab=97, num_experts=8, top_k=3, n_group=4,
                   topk_group=2, norm_topk_prob=True, scaling=2.5, **overrides):
    """Nemotron-H with "E" blocks (Nemotron 3 Nano): squared-ReLU experts, sigmoid group routing with a
    random correction bias (HF initialises it to zero, which would hide its use), a shared expert."""
    from transformers import NemotronHConfig, NemotronHForCausalLM
    cfg = NemotronHConfig(vocab_size=vocab, hidden_size=32, hybrid_override_pattern=pattern,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                          mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2, chunk_size=8,
                          n_routed_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=16,
                          moe_shared_expert_intermediate_size=24, n_group=n_group, topk_group=topk_group,
                          norm_topk_prob=norm_topk_prob, routed_scaling_factor=scaling,
                          max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                          experts_implementation="eager", **overrides)  # grouped_mm has no float64
    torch.manual_seed(seed)
    m = randomize_(NemotronHForCausalLM(cfg), seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, buffer in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=g))
    return m.to(dtype).eval()


def granite(seed=0, layer_types=("mamba", "attention", "mamba"), rope=True, num_experts=4, top_k=2,
            dtype=torch.float64, vocab=97, kv_heads=2, n_groups=1, multipliers=(3.0, 0.6, 0.2, 2.5), **overrides):
    """GraniteMoeHybrid (Granite-4.0-H); multipliers = (embedding, residual, attention, logits_scaling)."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    embedding, residual, attention, logits = multipliers
    cfg = GraniteMoeHybridConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=16, shared_intermediate_size=24,
        num_hidden_layers=len(layer_types), layer_types=list(layer_types), num_attention_heads=4,
        num_key_value_heads=kv_heads, num_local_experts=num_experts, num_experts_per_tok=top_k,
        position_embedding_type="rope" if rope else None, mamba_n_heads=4, mamba_d_state=8,
        mamba_n_groups=n_groups, mamba_chunk_size=8, embedding_multiplier=embedding, residual_multiplier=residual,
        attention_multiplier=attention, logits_scaling=logits, max_position_embeddings=512, pad_token_id=0,
        eos_token_id=1, bos_token_id=2, experts_implementation="eager", **overrides)  # grouped_mm has no float64
    torch.manual_seed(seed)
    return randomize_(GraniteMoeHybridForCausalLM(cfg), seed).to(dtype).eval()


FALCON_MULTIPLIERS = dict(embedding_multiplier=1.7, lm_head_multiplier=0.6, key_multiplier=1.3,
                         attention_in_multiplier=0.8, attention_out_multiplier=1.2, ssm_in_multiplier=0.9,
                         ssm_out_multiplier=1.1, mlp_multipliers=[0.7, 1.4], ssm_multipliers=[1.2, 0.8, 0.6, 1.5, 0.7])


def falcon_h1(seed=0, num_layers=3, dtype=torch.float64, vocab=97, kv_heads=2, n_groups=2, rms_norm=True,
              norm_before_gate=True, multipliers=True, **overrides):
    """Falcon-H1: attention (RoPE) and Mamba2 in parallel in every layer, SwiGLU MLP, µP multipliers
    (none of them 1, so that each one is tested)."""
    from transformers import FalconH1Config, FalconH1ForCausalLM
    cfg = FalconH1Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=kv_heads, mamba_d_ssm=48, mamba_n_heads=4,
                         mamba_d_state=8, mamba_n_groups=n_groups, mamba_chunk_size=8, mamba_rms_norm=rms_norm,
                         mamba_norm_before_gate=norm_before_gate, max_position_embeddings=512, pad_token_id=0,
                         eos_token_id=1, bos_token_id=2, **(FALCON_MULTIPLIERS if multipliers else {}), **overrides)
    torch.manual_seed(seed)
    m = randomize_(FalconH1ForCausalLM(cfg), seed).to(dtype).eval()
    if dtype == torch.float64:
        _float64_mup_vectors_(m)
    return m


def _float64_mup_vectors_(m):
    """HF builds the µP vector in float32 (`torch.ones` times the multipliers), so a float64 model holds
    float32-rounded multipliers; the float64 oracle recomputes it in float64 with HF's own function."""
    from transformers.models.falcon_h1.modeling_falcon_h1 import compute_mup_vector
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        mup = compute_mup_vector(m.config)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.mamba.mup_vector.copy_(mup)


def zamba2(seed=0, block_types=("mamba", "hybrid", "mamba", "hybrid", "hybrid"), num_mem_blocks=2, adapters=True,
           rope=True, dtype=torch.float64, vocab=97, kv_heads=4, **overrides):
    """Zamba2: Mamba2 layers; at "hybrid" layers a shared transformer block (num_mem_blocks weight sets used in
    turn, per-occurrence LoRA adapters, input [h, embeddings]) feeds the Mamba2 input."""
    from transformers import Zamba2Config, Zamba2ForCausalLM
    cfg = Zamba2Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=len(block_types),
                       layers_block_type=list(block_types), mamba_d_state=8, n_mamba_heads=4, mamba_ngroups=2,
                       chunk_size=8, num_attention_heads=4, num_key_value_heads=kv_heads, num_mem_blocks=num_mem_blocks,
                       use_shared_attention_adapter=adapters, adapter_rank=4, use_mem_rope=rope, intermediate_size=48,
                       max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2, **overrides)
    torch.manual_seed(seed)
    return randomize_(Zamba2ForCausalLM(cfg), seed).to(dtype).eval()


def hf_greedy(m, prompts, max_new_tokens):
    """HF generate on a left-padded ragged batch, with no stop token (like the
    engine with ignore_eos=True; `min_new_tokens` would instead forbid EOS)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    eos, m.generation_config.eos_token_id = m.generation_config.eos_token_id, None
    try:
        with torch.no_grad():
            out = m.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=0)
    finally:
        m.generation_config.eos_token_id = eos
    return out[:, width:].tolist()


def assert_split_forwards_match(target, make_cache, num_extend: int, seed: int = 3, atol: float = 1e-12):
    """Ragged prefill, then `extend` of `num_extend` tokens, then decode steps
    give the same logits as one prefill of each whole sequence.
    `make_cache(target, max_seqs)` builds an empty HybridCache."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (12, 7, 10)]
    full = [target.prefill(make_cache(target, 1), [0], [s])[0] for s in seqs]  # [len, vocab] each
    cache = make_cache(target, 3)
    split = [4, 2, 5]
    first = target.prefill(cache, [0, 1, 2], [s[:k] for s, k in zip(seqs, split)])
    ext = target.extend(cache, [0, 1, 2], [s[k:k + num_extend] for s, k in zip(seqs, split)])
    for b, k in enumerate(split):
        assert (first[b, :k] - full[b][:k]).abs().max() <= atol
        assert (ext[b, :num_extend] - full[b][k:k + num_extend]).abs().max() <= atol
    pos = [k + num_extend for k in split]
    while any(p < len(s) for p, s in zip(pos, seqs)):
        rows = [b for b in range(3) if pos[b] < len(seqs[b])]
        logits = target.decode(cache, rows, [seqs[b][pos[b]] for b in rows])
        for i, b in enumerate(rows):
            assert (logits[i] - full[b][pos[b]]).abs().max() <= atol
            pos[b] += 1


def assert_prefill_matches_hf(m, make_cache, batch: int, length: int, seed: int, atol: float):
    """`hs.from_hf(m)` prefill logits of a random [batch, length] batch equal
    HF's forward within `atol`; a float64 model is compared with HF under
    `float64_oracle()`, any other dtype with HF as shipped."""
    import hybridspec as hs
    target = hs.from_hf(m)
    ids = torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(seed))
    oracle = float64_oracle() if target.dtype == torch.float64 else contextlib.nullcontext()
    with torch.no_grad(), oracle:
        ref = m(ids, use_cache=False).logits
    out = target.prefill(make_cache(target), list(range(batch)), ids.tolist())
    assert (out - ref).abs().max().item() <= atol


QWEN_GDN = dict(vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_conv_kernel_dim=4, max_position_embeddings=512, pad_token_id=0, eos_token_id=1,
                bos_token_id=2)


def qwen3_next(seed=0, layer_types=("linear_attention", "full_attention", "linear_attention", "linear_attention"),
               mlp_only_layers=(2,), dtype=torch.float64, norm_topk_prob=True):
    """Qwen3-Next: gated DeltaNet ("linear_attention") and gated attention layers (q/k norms, output gate,
    a quarter of each head rotated), MoE feed-forwards with a gated shared expert but at `mlp_only_layers`."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    cfg = Qwen3NextConfig(**QWEN_GDN, num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                          intermediate_size=48, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=24, mlp_only_layers=list(mlp_only_layers),
                          norm_topk_prob=norm_topk_prob, experts_implementation="eager")  # grouped_mm: no float64
    torch.manual_seed(seed)
    return randomize_(Qwen3NextForCausalLM(cfg), seed).to(dtype).eval()


def qwen3_5(seed=0, layer_types=("linear_attention", "full_attention", "linear_attention"), dtype=torch.float64,
            tie=False):
    """Qwen3.5 dense text model: split GDN projections, a SwiGLU MLP after every mixer."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    cfg = Qwen3_5TextConfig(**QWEN_GDN, num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                            intermediate_size=48, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return randomize_(Qwen3_5ForCausalLM(cfg), seed).to(dtype).eval()


def qwen3_5_moe(seed=0, layer_types=("full_attention", "linear_attention", "linear_attention"),
                dtype=torch.float64):
    """Qwen3.5 MoE text model: a MoE (renormalised top-k, gated shared expert) after every mixer."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    cfg = Qwen3_5MoeTextConfig(**QWEN_GDN, num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                               shared_expert_intermediate_size=24, experts_implementation="eager")
    torch.manual_seed(seed)
    return randomize_(Qwen3_5MoeForCausalLM(cfg), seed).to(dtype).eval()


def qwen3_5_multimodal(seed=0, moe=False, dtype=torch.float64):
    """The released Qwen3.5 layout: `Qwen3_5(Moe)ForConditionalGeneration`, a tiny vision encoder beside
    the text model (`model.language_model.`), the text config under `text_config`."""
    from transformers import (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                              Qwen3_5MoeForConditionalGeneration)
    text = dict(QWEN_GDN, num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"])
    text |= (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
             if moe else dict(intermediate_size=48))
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32)
    config, model = ((Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if moe
                     else (Qwen3_5Config, Qwen3_5ForConditionalGeneration))
    kwargs = dict(experts_implementation="eager") if moe else {}
    torch.manual_seed(seed)
    return randomize_(model(config(text_config=text, vision_config=vision, **kwargs)), seed).to(dtype).eval()
