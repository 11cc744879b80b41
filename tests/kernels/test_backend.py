"""The one place that chooses kernels: `hybridspec.kernels.backend.select`."""
import pytest
import torch

from hybridspec.errors import ConfigError
from hybridspec.kernels import backend, ops
from hybridspec.kernels.cpu import native as cpu_native


def kinds(b: backend.Backend) -> tuple:
    return b.linear, b.conv_window, b.mamba2_steps, b.paged_attention, b.kv_write, b.rejection


def test_cpu_takes_the_references_or_the_native_kernels(monkeypatch):
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    auto = backend.select("cpu", torch.float32)
    native = cpu_native.available()
    assert auto.whole_forward == auto.native_blocks == native and not auto.writes_any_slot
    assert isinstance(auto.linear, ops.NativeLinear) == native
    float64 = backend.select("cpu", torch.float64)  # the parity runs: the references
    assert kinds(float64) == kinds(backend.select("cpu", torch.float32, "torch"))
    assert not float64.whole_forward and type(float64.conv_window) is ops.ConvWindow


def test_native_names_take_parts_of_the_native_path():
    if not cpu_native.available():
        pytest.skip("the native kernels cannot run here")
    blocks, single = backend.select("cpu", torch.float32, "native-blocks"), backend.select("cpu", torch.float32,
                                                                                         "native-ops")
    assert blocks.native_blocks and not blocks.whole_forward
    assert not single.native_blocks and not single.whole_forward and isinstance(single.linear, ops.NativeLinear)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_takes_triton_unless_references_are_forced():
    assert isinstance(backend.select("cuda", torch.float16).mamba2_steps, ops.TritonMamba2Steps)
    assert type(backend.select("cuda", torch.float16, "torch").mamba2_steps) is ops.Mamba2Steps


def test_triton_forces_the_kernels_on_every_device():
    b = backend.select("cpu", torch.float32, "triton")
    assert isinstance(b.conv_window, ops.TritonConvWindow) and b.writes_any_slot and b.graphable
    assert not b.captures and not b.whole_forward  # interpreted on CPU: nothing captured, no native path


def test_the_override_and_the_environment(monkeypatch):
    monkeypatch.setenv(backend.BACKEND_ENV, "torch")
    assert backend.choice() == "torch"
    with backend.using("triton"):
        assert backend.choice() == "triton"
    assert backend.choice() == "torch"
    monkeypatch.setenv(backend.BACKEND_ENV, "fast")
    with pytest.raises(ConfigError, match="HYBRIDSPEC_BACKEND='fast' must be one of"):
        backend.select("cpu", torch.float32)
    with pytest.raises(ConfigError, match="backend='fast'"):
        backend.select("cpu", torch.float32, "fast")
