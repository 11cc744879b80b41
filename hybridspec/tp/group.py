"""`TensorParallel`: the process group a sharded model computes in, and the
collectives the runtime needs from it."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigError


@dataclass(frozen=True, eq=False)
class TensorParallel:
    """size ranks of `group` (None: the default group, the whole world); this
    process is `rank` among them."""

    size: int
    rank: int
    group: object | None = None

    @classmethod
    def of(cls, size: int, group=None) -> "TensorParallel":
        """The tensor-parallel group of this process: torch.distributed must be
        initialised (torchrun, or `dist.init_process_group` by the user) with
        `size` ranks in `group` (default: the world)."""
        if not isinstance(size, int) or size < 1:
            raise ConfigError(f"tensor_parallel_size={size!r} must be an integer >= 1")
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(f"tensor_parallel_size={size} needs a torch.distributed process group: launch with "
                              f"`torchrun --nproc-per-node {size} ...` or call "
                              "torch.distributed.init_process_group first")
        world = dist.get_world_size(group)
        if world != size:
            raise ConfigError(f"tensor_parallel_size={size} but the process group has {world} ranks; launch "
                              f"{size} processes (torchrun --nproc-per-node {size}) or pass tensor_parallel_size="
                              f"{world}")
        return cls(size, dist.get_rank(group), group)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of each rank's `partial` (in place; every rank gets the same bits)."""
        dist.all_reduce(partial, group=self.group)
        return partial

    def all_gather(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's `part` [..., n] side by side in rank order [..., size * n] (no arithmetic: exact)."""
        part = part.contiguous()
        parts = [torch.empty_like(part) for _ in range(self.size)]
        dist.all_gather(parts, part, group=self.group)
        return torch.cat(parts, dim=-1)

    def all_ok(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank (one small all-reduce)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def broadcast(self, value):
        """Rank 0's `value` (any picklable object) on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=self._global(0), group=self.group)
        return box[0]

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)
