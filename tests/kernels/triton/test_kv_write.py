"""kv_write: the fixed-shape scatter of new K/V into cache slots (kernel ==
reference == a loop), skipping -1; the same launch for any slots."""

import pytest
import torch

from hybridspec.kernels.triton.kv_write import kv_write, kv_write_ref

SLOTS = [[5, 6, 7], [12, -1, -1], [-1, -1, -1], [0, 1, 2]]  # row 1 padded, row 2 all padding


def make_case(dtype, device, heads=3, head_dim=40, num_slots=20, slots=SLOTS):
    gen = torch.Generator().manual_seed(7)
    batch, T = len(slots), len(slots[0])

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)

    return dict(k_flat=rand(num_slots, heads, head_dim), v_flat=rand(num_slots, heads, head_dim),
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                k=rand(batch, T, heads, head_dim), v=rand(batch, T, heads, head_dim))


def expected(case):
    k_flat, v_flat = case["k_flat"].clone(), case["v_flat"].clone()
    for b, row in enumerate(case["slot_mapping"].tolist()):
        for t, slot in enumerate(row):
            if slot >= 0:
                k_flat[slot], v_flat[slot] = case["k"][b, t], case["v"][b, t]
    return k_flat, v_flat


@pytest.mark.parametrize("heads, head_dim", [(3, 40), (8, 256)])  # 8·256: two blocks per row
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_and_reference_match_a_loop(dtype, heads, head_dim, triton_device):
    case = make_case(dtype, triton_device, heads, head_dim)
    want_k, want_v = expected(case)
    for write in (kv_write, kv_write_ref):
        k_flat, v_flat = case["k_flat"].clone(), case["v_flat"].clone()
        write(k_flat, v_flat, case["slot_mapping"], case["k"], case["v"])
        assert torch.equal(k_flat, want_k) and torch.equal(v_flat, want_v), write.__name__


def test_strided_inputs_are_read_as_laid_out(triton_device):
    """k and v as views of one projection (attention's q/k/v split) write the right values."""
    case = make_case(torch.float32, triton_device)
    both = torch.cat([case["k"], case["v"]], dim=-1)  # [batch, T, heads, 2·head_dim]
    k, v = both[..., :40], both[..., 40:]
    k_flat, v_flat = case["k_flat"].clone(), case["v_flat"].clone()
    kv_write(k_flat, v_flat, case["slot_mapping"], k, v)
    want_k, want_v = expected(case)
    assert torch.equal(k_flat, want_k) and torch.equal(v_flat, want_v)


@pytest.mark.parametrize("write", [kv_write, kv_write_ref])
def test_bad_arguments_raise_before_writing(write, triton_device):
    case = make_case(torch.float32, triton_device)
    before = case["k_flat"].clone()
    with pytest.raises(ValueError, match="slot_mapping has shape"):
        write(case["k_flat"], case["v_flat"], case["slot_mapping"][:, :2], case["k"], case["v"])
    with pytest.raises(ValueError, match="holds torch.float32 but k is torch.float64"):
        write(case["k_flat"], case["v_flat"], case["slot_mapping"], case["k"].double(), case["v"].double())
    assert torch.equal(case["k_flat"], before)
