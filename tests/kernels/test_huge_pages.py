"""`kernels/huge_pages.py`: tensors side by side in one mapping advised for transparent huge
pages, and `pack_for_cpu` storing the product weights there."""
from __future__ import annotations

import dataclasses
import gc
import mmap
import sys

import pytest
import torch

import hybridspec as hs
from hybridspec.kernels import huge_pages
from oracles import bamba

SPECS = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((2, 4, 3), torch.float16), ((0, 4), torch.float32),
         ((33,), torch.uint8)]


def test_tensors_have_their_shapes_zeros_and_own_memory():
    tensors = huge_pages.zeros(SPECS, torch.device("cpu"))
    assert [(tuple(t.shape), t.dtype) for t in tensors] == [spec for spec in SPECS]
    assert all(torch.all(t == 0) for t in tensors)
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in tensors)
    assert all(t.data_ptr() % huge_pages.ALIGN == 0 for t in tensors if t.numel())
    for value, t in enumerate(tensors):  # no two overlap: each keeps what was written to it
        t.fill_(value + 1)
    for value, t in enumerate(tensors):
        assert torch.all(t == value + 1)


def test_a_tensor_keeps_the_mapping_alive():
    kept = huge_pages.zeros(SPECS, torch.device("cpu"))[2]
    gc.collect()
    kept.fill_(3.5)
    assert torch.all(kept == 3.5)


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(bound, 16) for bound in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="MADV_HUGEPAGE is Linux's")
def test_the_mapping_is_advised_for_huge_pages():
    tensor = huge_pages.zeros([((1 << 20,), torch.float32)], torch.device("cpu"))[0]
    assert "hg" in vm_flags(tensor.data_ptr())  # hg: advised MADV_HUGEPAGE
    assert "hg" not in vm_flags(torch.empty(1 << 20).data_ptr())  # torch's own memory is not


def test_packed_weights_share_one_advised_mapping_and_repacking_moves_them():
    model = hs.from_hf(bamba(seed=4)).pack_for_cpu()
    weights = [model.lm_head] + [p for name, p in model.named_parameters() if name.endswith("in_proj")]
    storages = {p.untyped_storage().data_ptr() for p in weights}
    assert len(weights) > 1 and len(storages) == 1
    before = [p.detach().clone() for p in weights]
    model.pack_for_cpu()
    after = [model.lm_head] + [p for name, p in model.named_parameters() if name.endswith("in_proj")]
    assert {p.untyped_storage().data_ptr() for p in after}.isdisjoint(storages)  # the old mapping is let go
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_quantized_weights_move_into_one_advised_mapping_with_their_values_and_ties():
    """Quantizing (and packing) puts every QuantWeight, the embedding included, side by side in one
    advised mapping; the values do not change, a tied embedding stays the LM head, and the model's
    logits are the same bits as before the move."""
    from hybridspec.cache.hybrid_cache import HybridCache
    from hybridspec.kernels.quant.weight import QuantWeight
    from hybridspec.models import packing
    from hybridspec.rollback.models import random_model
    from test_quantized_models import quantizable_model
    config = dataclasses.replace(quantizable_model().config, tie_word_embeddings=True)
    model = random_model(config, 3, torch.float32).quantize("q4_k")
    assert model.embed is model.lm_head
    quantized = {id(p): p for p in model.parameters() if isinstance(p, QuantWeight)}.values()
    assert len(quantized) > 2 and isinstance(model.embed, QuantWeight)
    assert len({p.untyped_storage().data_ptr() for p in quantized}) == 1
    if sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE"):
        assert "hg" in vm_flags(model.lm_head.data_ptr())
    values = {name: p.dequantize() for name, p in model.named_parameters() if isinstance(p, QuantWeight)}
    cache = HybridCache(model.config, max_seqs=1, num_blocks=4, block_size=16, ring_slots=2, dtype=model.dtype)
    before = model.prefill(cache, [0], [[5, 17, 3, 90]])
    packing.lay_out_quantized(model)
    model.bind_backend(model.backend_name)
    moved = {name: p for name, p in model.named_parameters() if isinstance(p, QuantWeight)}
    assert model.embed is model.lm_head
    assert moved.keys() == values.keys() and all(torch.equal(moved[n].dequantize(), v) for n, v in values.items())
    assert {p.untyped_storage().data_ptr() for p in moved.values()}.isdisjoint(
        {p.untyped_storage().data_ptr() for p in quantized})  # a new mapping; the old one let go
    cache = HybridCache(model.config, max_seqs=1, num_blocks=4, block_size=16, ring_slots=2, dtype=model.dtype)
    assert torch.equal(model.prefill(cache, [0], [[5, 17, 3, 90]]), before)


def test_a_load_returns_what_its_temporaries_freed_once_its_frames_are_gone(tmp_path, monkeypatch):
    """hs.load asks the C allocator to give back its free memory once, after the model is built and
    the loader's own frames (the reader's copies) are gone: the spy sees a finished model's
    weights still alive and no loader frame on the stack."""
    import inspect
    import hybridspec.adapters as adapters
    bamba(seed=0).save_pretrained(tmp_path)
    calls = []

    def spy():
        frames = [f.function for f in inspect.stack()]
        calls.append(("_load" in frames, "load" in frames))
        return True

    monkeypatch.setattr(huge_pages, "return_freed_memory", spy)
    model = adapters.load(tmp_path)
    assert calls == [(False, True)] and model.config.num_layers > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim: Linux")
def test_returning_freed_memory_asks_glibc():
    import platform
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    assert huge_pages.return_freed_memory() is True
