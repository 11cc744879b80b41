"""How many torch threads a CPU run uses.

The native CPU kernels split each matrix product's columns, and the
Mamba-2 recurrence's heads and a long context's KV heads, over torch's
thread count (`kernels/cpu_pool.c`; their bits are the same at any count,
while prefills past 96 rows take MKL's products, whose bits may not be). Measured on a 2-vCPU Intel machine
with `benches/threads.py` (wall clock, two threads against one, in one run):
round_cost's 35.8M Bamba (hidden 512) decodes 1.58-1.62x faster and verifies
1.64-1.65x faster at batch 1 and 4; the embedded target (hidden 256), whose
products take microseconds, runs its steps 1.07-1.27x, and its generate
1.13x (plain) and 1.12x (speculative).
Through torch's own threads instead (the kernels off, as for the layers
they do not take) both ran slower than on one thread with the kernels (the
embedded target 4x slower), as they had on the AMD machine this project
started on (136 against 14 tok/s). A helper on a core that other work holds
delays the product it took part of, so a shared machine gains less or loses.
Models of hidden size below 2048 therefore default to one thread; larger
ones, whose products split well, keep torch's default (one per core); pass
`threads=` / `--threads` to use more (measure first on a shared machine).
GPU runs are not affected.
"""
from __future__ import annotations

import torch

from .errors import ConfigError
from .models.hybrid import HybridModel

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
