"""The rotary embedding in C (`kernels/cpu/rope.c`) against the torch form of
`Rotation.apply`: the same bits, full and partial rotary dims."""
import pytest
import torch

from hybridspec.config import AttentionConfig
from hybridspec.kernels.cpu import rope as cpu_rope
from hybridspec.kernels.rotary import NativeRotation, Rotation
from hybridspec.models.attention import rope_inv_freq
from native_cpu import x86_with_compiler

pytestmark = x86_with_compiler


def config(head_dim, rotary_dim):
    return AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=head_dim, partial_rotary_factor=rotary_dim / head_dim)


@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (64, 32), (24, 8), (10, 6)])
def test_the_c_rotation_gives_the_torch_bits(head_dim, rotary_dim):
    cfg = config(head_dim, rotary_dim)
    g = torch.Generator().manual_seed(head_dim + rotary_dim)
    positions = torch.tensor([[0, 1, 2, 3, 4], [900, 901, 902, 903, 904]])
    rotation = NativeRotation(cfg.rotary_dim, cfg.head_dim, rope_inv_freq(cfg), positions, torch.float32)
    x = torch.randn(2, 5, 3, head_dim, generator=g) * 4
    assert cpu_rope.applies(x, rotation.cos_half, rotation.sin_half)
    cos, sin, R = rotation.padded
    expected = x * cos + torch.mm(x.reshape(-1, head_dim), R).view(x.shape) * sin
    got = rotation.apply(x)
    assert torch.equal(got, expected)
    torch_form = Rotation(cfg.rotary_dim, cfg.head_dim, rope_inv_freq(cfg), positions, torch.float32)
    assert torch.equal(torch_form.apply(x), expected)  # a torch backend's rotation


def test_non_contiguous_or_float64_inputs_take_the_torch_form():
    cfg = config(16, 16)
    positions = torch.arange(3)[None]
    rotation = NativeRotation(cfg.rotary_dim, cfg.head_dim, rope_inv_freq(cfg), positions, torch.float32)
    x = torch.randn(1, 3, 2, 32)[..., ::2]  # a strided view
    assert not cpu_rope.applies(x, rotation.cos_half, rotation.sin_half)
    cos, sin, R = rotation.padded
    assert torch.equal(rotation.apply(x), x * cos + torch.mm(x.reshape(-1, 16), R).view(x.shape) * sin)
    r64 = NativeRotation(cfg.rotary_dim, cfg.head_dim, rope_inv_freq(cfg), positions, torch.float64)
    assert not cpu_rope.applies(x.double().contiguous(), r64.cos_half, r64.sin_half)
