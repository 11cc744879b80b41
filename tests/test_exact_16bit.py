"""Linear weights and embeddings stored in bfloat16 (or float16) where every
value is one (`pack_for_cpu`'s `exact_16bit`, `kernels/cpu/rows.c` "weight
storage"): a float32 model whose weights came from bf16 (fp16) weights
gives the same logits, bit for bit, with its linear weights and embedding in
half the memory — in every family, for prefills the blocks run and prefills past them
(torch's products of a widened copy), decode steps, snapshotted multi-input
forwards and generate, with the embedding tied to the LM head or not; weights
with other values and float64 models keep their storage, and the compute
dtype stays float32."""
from __future__ import annotations

import pytest
import torch

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.kernels.cpu import blocks as cpu_blocks
from hybridspec.kernels.cpu.panels import PanelWeight
from hybridspec.models.ffn import MoE
from hybridspec.models import packing
from hybridspec.models.packing import LINEAR_WEIGHTS
from native_cpu import one_thread, x86_with_compiler  # noqa: F401 (one_thread: an autouse fixture)
from oracles import bamba, falcon_h1, granite, jamba, nemotron_h, nemotron_h_moe, zamba2

pytestmark = x86_with_compiler


def half_valued(hf, half: torch.dtype = torch.bfloat16):
    """The HF model in float32 with every parameter rounded to a `half` value (bf16 / fp16 weights, widened)."""
    hf = hf.to(torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(half).to(torch.float32))
    return hf


HALVES = [torch.bfloat16, torch.float16]


def storable(model):
    """(name, tensor) of what pack_for_cpu may keep in bfloat16: linear weights, MoE routers and experts,
    the embedding."""
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            if name in LINEAR_WEIGHTS or name == "embed" or (isinstance(module, MoE)
                                                             and name in ("up", "down", "router")):
                yield f"{module_name}.{name}".lstrip("."), p


def stored(model) -> dict[str, torch.dtype]:
    return {name: p.dtype for name, p in storable(model)}


def forwards(model) -> list[torch.Tensor]:
    """A prefill past the blocks' rows and a short one, decode steps, a snapshotted 5-input forward."""
    long_prompt = [(5 * i + 3) % 90 + 3 for i in range(cpu_blocks.BLOCK_ROWS + 20)]
    cache = HybridCache(model.config, max_seqs=2, num_blocks=64, block_size=8, ring_slots=8, dtype=model.dtype)
    out = [model.prefill(cache, [0, 1], [long_prompt, [12, 13, 14]], last_only=True)]
    out += [model.decode(cache, [0, 1], [20 + t, 30 + t]) for t in range(3)]
    heads = [cache.head(s) for s in (0, 1)]
    snap = torch.tensor([[(h + 1 + t) % 8 for t in range(5)] for h in heads])
    out.append(model.extend(cache, [0, 1], [[40, 41, 42, 43, 44], [50, 51, 52, 53, 54]], snap_slot=snap))
    return out


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("build", [bamba, jamba, nemotron_h, nemotron_h_moe, granite, falcon_h1, zamba2])
def test_the_same_logits_from_half_the_weight_memory(build, half):
    hf = half_valued(build(seed=2), half)
    full = hs.from_hf(hf).pack_for_cpu(exact_16bit=False)
    compact = hs.from_hf(hf).pack_for_cpu()
    dtypes = stored(compact)
    assert dtypes and set(dtypes.values()) == {half}, dtypes
    assert set(stored(full).values()) == {torch.float32}
    assert compact.dtype is torch.float32 and compact.final_norm.weight.dtype is torch.float32

    def stored_bytes(model):
        return sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for _, p in storable(model)}.values())
    assert 2 * stored_bytes(compact) == stored_bytes(full)
    for want, got in zip(forwards(full), forwards(compact), strict=True):
        assert torch.equal(got, want)
    compact.pack_for_cpu()  # packing again changes nothing
    assert stored(compact) == dtypes


def test_plain_and_speculative_generate_give_the_same_tokens():
    """Greedy plain and speculative (a bf16-valued model drafter, γ = 3) generate."""
    hf = half_valued(bamba(seed=6, num_layers=4, attn_layers=(1, 3)))
    draft_hf = half_valued(bamba(seed=7, num_layers=1, attn_layers=()))
    params = hs.SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 14, 3, 22], [7, 8, 30]]
    tokens = []
    for exact_16bit in (False, True):
        target = hs.from_hf(hf).pack_for_cpu(exact_16bit=exact_16bit)
        draft = hs.from_hf(draft_hf).pack_for_cpu(exact_16bit=exact_16bit)
        engines = (hs.Engine(target, max_batch_size=2),
                   hs.Engine(target, draft=draft, num_draft_tokens=3, max_batch_size=2))
        tokens.append([[o.token_ids for o in engine.generate(prompts, params)] for engine in engines])
    assert tokens[0] == tokens[1]
    assert tokens[0][0] == tokens[0][1]  # speculative decoding is lossless either way


def test_other_values_and_float64_keep_their_storage():
    rounded = half_valued(bamba(seed=3))
    with torch.no_grad():  # one value off the bfloat16 and float16 grids: that weight stays float32
        rounded.model.layers[0].feed_forward.up_proj.weight[0, 0] += 2.0 ** -20
    dtypes = stored(hs.from_hf(rounded).pack_for_cpu())
    assert dtypes["layers.0.ffn.up_proj"] is torch.float32
    assert dtypes["layers.0.ffn.gate_proj"] is torch.bfloat16
    assert set(stored(hs.from_hf(bamba(seed=3).to(torch.float32)).pack_for_cpu()).values()) == {torch.float32}
    assert set(stored(hs.from_hf(bamba(seed=3)).pack_for_cpu()).values()) == {torch.float64}


def test_an_embedding_tied_to_the_lm_head_is_stored_once_in_bfloat16():
    tied = bamba(seed=3)
    tied.config.tie_word_embeddings = True
    tied.tie_weights()
    hf = half_valued(tied)
    full, compact = hs.from_hf(hf).pack_for_cpu(exact_16bit=False), hs.from_hf(hf).pack_for_cpu()
    assert compact.lm_head is compact.embed and compact.embed.dtype is torch.bfloat16
    assert isinstance(compact.lm_head, PanelWeight) and compact.dtype is torch.float32  # panels: the kernels' layout
    for want, got in zip(forwards(full), forwards(compact), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("build", [bamba, jamba, nemotron_h_moe, falcon_h1, zamba2])
def test_16bit_weights_loaded_as_float32_keep_16bit_storage(tmp_path, build, half):
    """`hs.load(dir, dtype=torch.float32)` of a model directory saved in bfloat16
    (float16) keeps its linear weights, experts and embedding in that type
    (never widening them on the way) and everything else in float32; the
    logits are those of the float32 copy (`pack_for_cpu(exact_16bit=False)`)."""
    build(seed=8).to(half).save_pretrained(tmp_path)
    model = hs.load(tmp_path, dtype=torch.float32)
    assert model.dtype is torch.float32
    assert set(stored(model).values()) == {half}
    products = {p.data_ptr() for _, p in storable(model)}
    assert all(p.dtype is torch.float32 for p in model.parameters() if p.data_ptr() not in products)
    full = hs.load(tmp_path, dtype=torch.float32, pack=False).pack_for_cpu(exact_16bit=False)
    assert set(stored(full).values()) == {torch.float32}
    for want, got in zip(forwards(full), forwards(model), strict=True):
        assert torch.equal(got, want)


def test_mamba_ssm_fp16_weights_keep_float16_storage(tmp_path):
    """mamba_ssm's weights are float16 (`pytorch_model.bin`, the attention's
    fused in_proj split into q, k, v on load): float32 compute from float16
    linear weights, the float32 copy's logits."""
    from hybridspec.adapters import bamba as bamba_adapter
    from test_mamba_ssm_layout import bamba_oracle, hf_state, save_mamba_ssm
    m = bamba_oracle(7, (1,), 3, 2)
    weights = {k: v.to(torch.float16) for k, v in bamba_adapter.weights_from_state(hf_state(m)).items()}
    save_mamba_ssm(tmp_path, bamba_adapter.config_from_dict(m.config.to_dict()), weights, binary=True)
    model = hs.load(tmp_path, dtype=torch.float32)
    assert model.dtype is torch.float32 and set(stored(model).values()) == {torch.float16}
    full = hs.load(tmp_path, dtype=torch.float32, pack=False).pack_for_cpu(exact_16bit=False)
    for want, got in zip(forwards(full), forwards(model), strict=True):
        assert torch.equal(got, want)


def test_without_the_native_kernels_weights_stay_float32(monkeypatch):
    """torch's products would widen a 16-bit weight on every call: without the
    kernels (turned off, no compiler, not x86) packing keeps float32."""
    from hybridspec.kernels import backend
    with backend.using("torch"):
        model = hs.from_hf(half_valued(bamba(seed=2))).pack_for_cpu()
    assert set(stored(model).values()) == {torch.float32}


def test_leaving_the_cpu_widens_the_16bit_weights():
    """16-bit storage is for the CPU kernels: a float32 model moved elsewhere
    (here the meta device, where CUDA would be) widens those weights, every
    one its own (meta tensors share an address: ties go by the Parameter)."""
    model = hs.from_hf(half_valued(bamba(seed=3))).pack_for_cpu()
    assert set(stored(model).values()) == {torch.bfloat16}
    count = len(list(model.parameters()))
    model.to("meta")
    assert {p.dtype for p in model.parameters()} == {torch.float32} and model.dtype is torch.float32
    assert len(list(model.parameters())) == count


def test_widening_keeps_a_tied_embedding_tied():
    tied = bamba(seed=3)
    tied.config.tie_word_embeddings = True
    tied.tie_weights()
    model = hs.from_hf(half_valued(tied)).pack_for_cpu()
    packing.widen_16bit(model)  # what leaving the CPU does
    assert model.lm_head is model.embed and model.embed.dtype is torch.float32
