"""How many torch threads a CPU run uses.

The native CPU kernels split each matrix product's columns, and the
Mamba-2 recurrence's heads and a long context's KV heads, over torch's
thread count (`kernels/cpu/pool.c`; their bits are the same at any count,
while a MoE's experts past 96 rows take MKL's products, whose bits may not be).
A model with large products gains from more threads; a small one, whose
products take microseconds, gains little, because its step is mostly the
serial work around them, and through torch's own threads (the kernels off,
as for the layers they do not take) it runs slower than on one thread with
the kernels. A helper on a core that other work holds delays the product it
took part of, so a shared machine gains less or loses. Models of hidden size
below 2048 therefore default to one thread; larger ones, whose products
split well, keep torch's default (one per core); pass `threads=` /
`--threads` to use more (measure first on a shared machine). GPU runs are
not affected. The measurements: docs/results/threads.md.
"""
from __future__ import annotations

import torch

from hybridspec.errors import ConfigError
from hybridspec.models.hybrid import HybridModel

SMALL_HIDDEN_SIZE = 2048  # below this, one thread by default (see above)


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
