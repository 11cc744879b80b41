"""Product weights in panels (`kernels/cpu/panels.py`, `kernels/cpu/panels.c`): packing keeps every
value, the products give the input-major kernel's bits for every type, row count, vector path and
thread count, an embedding tied to a packed LM head reads its rows, and the type survives copies."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.kernels.cpu import native as cpu_native
from hybridspec.kernels.cpu import rows as cpu_rows
from hybridspec.kernels.cpu import panels
from hybridspec.kernels.cpu.panels import PanelWeight
from native_cpu import both_vector_paths, one_thread, x86_with_compiler  # noqa: F401 (fixtures)
from oracles import bamba

# (out, in): a last panel narrower than 64 columns, an odd K (a bfloat16 pair with one row), one column;
# panels past STREAM_PANEL_BYTES (cpu/panels.c: in blocks) from 2,049 float32 and 4,097 bfloat16 inputs
SHAPES = [(1, 1), (7, 3), (13, 5), (8, 64), (257, 129), (1160, 256), (4101, 7), (130, 2048), (70, 2101),
          (65, 4201)]
TYPES = [torch.float32, torch.bfloat16, torch.float16]


def packed(weight: torch.Tensor) -> PanelWeight:
    return panels.pack(weight, torch.zeros(panels.panel_shape(*weight.shape, weight.dtype), dtype=weight.dtype))


@pytest.mark.parametrize("dtype", TYPES)
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_packing_keeps_every_value(out_features, in_features, dtype):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(out_features)).to(dtype)
    p = packed(weight)
    assert (p.out_features, p.in_features) == (out_features, in_features)
    assert torch.equal(panels.unpack(p), weight)
    assert torch.equal(panels.unpack_t(p, torch.float32), weight.t().float())
    ids = torch.tensor([0, out_features - 1, out_features // 2, 0])
    assert torch.equal(panels.rows(p, ids), weight[ids])
    assert int((p.detach() != 0).sum()) == int((weight != 0).sum())  # the padding is zero


def test_data_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match=r"not the panels of \[65, 3\]"):
        PanelWeight(torch.zeros(1, 3, 64), 65, 3)


@x86_with_compiler
@pytest.mark.parametrize("dtype", TYPES)
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_the_products_give_the_input_major_kernels_bits(both_vector_paths, out_features, in_features, dtype):
    g = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=g).to(dtype)
    p, weight_t = packed(weight), weight.t().contiguous()
    x = torch.randn(200, in_features, generator=g)

    def check():  # past CHUNK_ROWS too: `linear` gives panels any row count
        for M in (1, 2, 4, 5, 6, 7, 13, 40, cpu_rows.MAX_ROWS, 200):
            assert torch.equal(cpu_rows.rows_matmul(x[:M], p), cpu_rows.rows_matmul(x[:M], weight_t)), M
    both_vector_paths(check)


@x86_with_compiler
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_bfloat16_compute_gives_the_input_major_kernels_bits(out_features, in_features):
    if not cpu_native.bf16_compute_supported():
        pytest.skip("this CPU has no AVX512-BF16")
    g = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    p, weight_t = packed(weight), weight.t().contiguous()
    x = torch.randn(200, in_features, generator=g)
    for M in (1, 3, 6, 7, 97, 200):  # past CHUNK_ROWS too: bfloat16 compute takes any row count
        want = cpu_rows.rows_matmul(x[:M], weight_t, torch.bfloat16)
        assert torch.equal(cpu_rows.rows_matmul(x[:M], p, torch.bfloat16), want), M


@x86_with_compiler
def test_two_threads_give_one_threads_bits():
    g = torch.Generator().manual_seed(5)
    for dtype in TYPES:
        p = packed(torch.randn(1000, 512, generator=g).to(dtype))
        x = torch.randn(9, 512, generator=g)
        one = cpu_rows.rows_matmul(x, p)
        torch.set_num_threads(2)
        try:
            assert torch.equal(cpu_rows.rows_matmul(x, p), one), dtype
        finally:
            torch.set_num_threads(1)


def test_a_copy_or_a_pickle_stays_a_panel_weight():
    p = packed(torch.randn(70, 9))
    for twin in (copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
        assert isinstance(twin, PanelWeight) and (twin.out_features, twin.in_features) == (70, 9)
        assert torch.equal(twin, p) and twin.data_ptr() != p.data_ptr()


@x86_with_compiler
def test_a_float32_model_packs_in_panels_and_keeps_its_logits():
    tied = bamba(seed=3).to(torch.float32)
    tied.config.tie_word_embeddings = True
    tied.tie_weights()
    plain = hs.from_hf(tied)
    model = hs.from_hf(tied).pack_for_cpu(exact_16bit=False)
    assert isinstance(model.lm_head, PanelWeight) and model.embed is model.lm_head
    assert isinstance(model.layers[0].mixer.in_proj, PanelWeight)
    assert model.num_parameters() == plain.num_parameters()
    prompt = [5, 17, 3, 42, 8, 11, 2]

    def last_logits(m):
        cache = HybridCache(m.config, max_seqs=1, num_blocks=4, block_size=16, dtype=m.dtype)
        return m.prefill(cache, [0], [prompt], last_only=True)[0, -1]
    want = last_logits(plain)
    torch.testing.assert_close(last_logits(model), want, rtol=1e-5, atol=1e-5)
    twin = copy.deepcopy(model)
    assert isinstance(twin.lm_head, PanelWeight) and torch.equal(last_logits(twin), last_logits(model))
    model.to("meta")  # leaving the CPU: plain [out, in] weights again
    assert not any(isinstance(p, PanelWeight) for p in model.parameters())
    assert model.lm_head.shape == (model.vocab_size, model.config.hidden_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchs_product_by_panels_is_the_product(dtype):
    """`panels.matmul` (past MAX_ROWS with several threads, and wherever the kernel declines):
    panel by panel up to PANELWISE_MAX_ROWS rows (bfloat16 widened), on the unpacked weight past them."""
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(130, 70, generator=g).to(dtype)
    for M in (3, panels.PANELWISE_MAX_ROWS, panels.PANELWISE_MAX_ROWS + 1):
        x = torch.randn(M, 70, generator=g)
        torch.testing.assert_close(panels.matmul(x, packed(weight)), x @ weight.t().float(), rtol=1e-5, atol=1e-5)
