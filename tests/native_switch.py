"""Switch a model between the compute paths a test compares (`kernels.backend`
names: "native" the whole forward, "native-blocks" the layers one by one with
the native blocks, "native-ops" the modules with the native ops, "torch" the
references)."""
from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def backend_of(model, name: str):
    """`model` bound to the backend `name` for the block, then to the process's choice again."""
    model.bind_backend(name)
    try:
        yield model
    finally:
        model.bind_backend()


def whole_forward_off(model):
    """The layers run one by one (the native blocks where they take a layer)."""
    return backend_of(model, "native-blocks")


def native_off(model):
    """No native kernel runs: the torch references."""
    return backend_of(model, "torch")
