"""How many torch threads a CPU run uses.

Measured on a 2-vCPU machine (docs/results_plain_e2e.md): the embedded pair
(hidden size 256) decodes fastest with one thread; its matrices are too small
for a second thread to pay for the hand-off, and on a shared machine torch's
default (every core) can be many times slower. Models of hidden size 1024 and
more keep torch's default. GPU runs are not affected.
"""
from __future__ import annotations

import torch

from .errors import ConfigError
from .models.hybrid import HybridModel

SMALL_HIDDEN_SIZE = 1024  # below this, one thread is fastest


def default_threads(model: HybridModel) -> int:
    """The torch intra-op threads a CPU run of `model` is fastest with."""
    return 1 if model.config.hidden_size < SMALL_HIDDEN_SIZE else torch.get_num_threads()


def use_threads(threads: int | None, model: HybridModel, what: str = "threads") -> int:
    """Set torch's intra-op threads (a process-wide setting) to `threads`, or to
    `default_threads(model)` when None and the model runs on a CPU; returns the count in use."""
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"{what}={threads!r} must be an integer >= 1, or None for the default")
        torch.set_num_threads(threads)
    elif model.device.type == "cpu":
        torch.set_num_threads(default_threads(model))
    return torch.get_num_threads()
