"""How many torch threads a CPU run uses.

Measured on the development machine (2 shared vCPUs, AMD EPYC, torch 2.13
CPU; plain decoding, batch 1, 48 tokens, median of 3): the embedded target
(hidden size 256) made 136 tok/s with one thread and 14 tok/s with two; a
random Bamba of hidden size 1024 made 46 and 7. Small matrices do not pay for
the hand-off between threads, and a thread that shares a core with other work
stalls every step. So models of hidden size below 2048 default to one
thread; larger ones, whose matrix products can use several cores, keep
torch's default (one per core). GPU runs are not affected.
"""
from __future__ import annotations

import torch

from .errors import ConfigError
from .models.hybrid import HybridModel

SMALL_HIDDEN_SIZE = 2048  # below this, one thread is fastest (measured up to 1024)


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
