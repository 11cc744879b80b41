"""Context managers that switch a test between the compute paths it compares."""
from __future__ import annotations

from contextlib import contextmanager

from hybridspec.kernels import cpu_forward, cpu_native


@contextmanager
def whole_forward_off():
    """The layers run one by one (the native blocks where they take a layer)."""
    cpu_forward.set_enabled(False)
    try:
        yield
    finally:
        cpu_forward.set_enabled(True)


@contextmanager
def native_off():
    """No native kernel runs: the torch references."""
    cpu_native.set_enabled(False)
    try:
        yield
    finally:
        cpu_native.set_enabled(None)
