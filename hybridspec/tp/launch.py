"""Joining the process group of a tensor-parallel run from the command line:
`torchrun --nproc-per-node N -m hybridspec generate --tensor-parallel-size N`
starts N processes with RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT
set; each joins the group here (gloo on CPU, NCCL on CUDA) before it loads
its shard. In Python, start the group yourself (`dist.init_process_group`)
and pass `tensor_parallel_size=N` to `hs.LLM` or `hs.load`."""
from __future__ import annotations

import atexit
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridspec.errors import UsageError

# a server's ranks wait in collectives while it is idle: far longer than torch's 10-minute default
IDLE_TIMEOUT = timedelta(days=7)


def join(size: int, device: str) -> str:
    """Join torchrun's process group for `size` ranks (nothing for 1, or when one
    is already up); returns the device this rank computes on (cuda: its
    LOCAL_RANK's)."""
    if size == 1:
        return device
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise UsageError(f"--tensor-parallel-size {size} needs one process per rank: launch with "
                             f"`torchrun --nproc-per-node {size} -m hybridspec ...`")
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=IDLE_TIMEOUT)
        atexit.register(leave)
    if torch.device(device).type == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    return device


def leave() -> None:
    """Leave the group `join` started, every rank together: a barrier (no rank
    closes its connections while a peer still talks on them), then the group's
    teardown while the interpreter is whole. Left to interpreter exit, gloo's
    worker threads outlive the objects they hold and a rank may die of SIGABRT
    after its work is done."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def is_first_rank() -> bool:
    """Whether this process prints and serves: rank 0, or the only process."""
    return not dist.is_initialized() or dist.get_rank() == 0


def rank0_value(value):
    """Rank 0's `value` on every rank of a launched group (a random seed drawn
    by each process); `value` itself without one."""
    if not dist.is_initialized():
        return value
    from hybridspec.tp.group import TensorParallel
    return TensorParallel.of(dist.get_world_size()).broadcast(value)
