"""`TensorParallel`: the process group a sharded model computes in, the
collectives the runtime needs from it, and how a fault on one rank fails a
step on every rank without a hang.

Two groups over the same ranks: the forwards' sums and gathers run in a data
group of their own; the step's agreement (`all_ok`) and rank 0's choices
(`broadcast`) run in the control group (the one the user or torchrun made).
A rank whose step raises aborts the data group (`abort`): a peer waiting in
a sum for it fails at once (PeerRankError) instead of waiting out the
timeout. Every engine step has two agreements on every rank, whatever
fails where: after admission and prefill, and at the end of the round (a
rank that raised earlier makes its remaining ones with "failed"). Where one
fails, every rank reverts what the step did, they make a new data group
together (`renew`), and the step raises on each (PeerRankError where the
fault was another rank's).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hybridspec.errors import ConfigError, PeerRankError

_GROUPS: dict = {}  # (control group, the world's group) -> its TensorParallel: a target and drafter share one
AGREEMENTS_PER_STEP = 2  # after admission and prefill; at the end of the round


class TensorParallel:
    """size ranks of `group` (None: the default group, the whole world); this
    process is `rank` among them."""

    def __init__(self, size: int, rank: int, group=None):
        self.size, self.rank, self.group = size, rank, group
        self.data = self._new_data_group() if size > 1 else group
        self.aborted = False  # this rank aborted the data group; it is unusable until `renew`
        # NCCL reduces CUDA tensors only: the agreement's flag lives on this rank's GPU there
        self.flag_device = torch.device("cuda", torch.cuda.current_device()) \
            if size > 1 and dist.get_backend(group) == "nccl" else torch.device("cpu")
        self.agreed = AGREEMENTS_PER_STEP  # agreements made in this step (`begin_step` starts a step)
        self.renewed = False  # a new data group was made in this step

    def __deepcopy__(self, memo) -> "TensorParallel":
        return self  # a copy of a sharded model computes in the same group

    @classmethod
    def of(cls, size: int, group=None) -> "TensorParallel":
        """The tensor-parallel group of this process (one object per process
        group): torch.distributed must be initialised (torchrun, or
        `dist.init_process_group` by the user) with `size` ranks in `group`
        (default: the world)."""
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
        key = (group, id(dist.group.WORLD))  # a group made anew (init after destroy) is another key
        tp = _GROUPS.get(key)
        if tp is None:
            tp = _GROUPS[key] = cls(size, dist.get_rank(group), group)
        return tp

    # -- the forwards' collectives (data group) ---------------------------------------------------

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of each rank's `partial` (in place; every rank gets the same bits)."""
        self._data_op(dist.all_reduce, partial, group=self.data)
        return partial

    def all_gather(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's `part` [..., n] side by side in rank order [..., size * n] (no arithmetic: exact)."""
        part = part.contiguous()
        parts = [torch.empty_like(part) for _ in range(self.size)]
        self._data_op(dist.all_gather, parts, part, group=self.data)
        return torch.cat(parts, dim=-1)

    def _data_op(self, op, *args, **kwargs) -> None:
        if self.aborted:
            raise PeerRankError("this rank's tensor-parallel step failed; its next step starts a new group")
        try:
            op(*args, **kwargs)
        except RuntimeError as error:  # a peer aborted the group (its step raised) or its process died
            raise PeerRankError(f"another tensor-parallel rank left the step ({error}); every rank reverts "
                                "the step") from error

    # -- the step's agreement and rank 0's choices (control group) --------------------------------

    def all_ok(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank (one small all-reduce)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.flag_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def broadcast(self, value):
        """Rank 0's `value` (any picklable object) on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=self._global(0), group=self.group)
        return box[0]

    # -- a step's agreements ---------------------------------------------------------------------

    def begin_step(self) -> None:
        self.agreed, self.renewed = 0, False

    def agree(self, ok: bool) -> bool:
        """The step's next agreement: whether every rank's part since the last
        one went well; where not, a new data group (once per step, every rank)."""
        self.agreed += 1
        everyone = self.all_ok(ok)
        if not everyone and not self.renewed:
            self.renew()
            self.renewed = True
        return everyone

    def end_step(self, ok: bool) -> bool:
        """The step's remaining agreements (none if the round made them);
        whether every one held."""
        everyone = True
        while self.agreed < AGREEMENTS_PER_STEP:
            everyone = self.agree(ok) and everyone
        return everyone

    # -- a fault ---------------------------------------------------------------------------------

    def abort(self) -> None:
        """This rank's step raised: close the data group, so a peer waiting in
        one of its sums fails now rather than at the timeout. Nothing once
        this step made a new one: every rank then knows, and it is the next
        step's."""
        if not self.aborted and not self.renewed and self.size > 1:
            self.aborted = True
            dist.destroy_process_group(self.data)
            self.data = None  # the last reference: the group's connections close with it

    def renew(self) -> None:
        """After a failed agreement, every rank together: a new data group
        (this rank's old one closed first, if it still stands)."""
        if self.size == 1:
            return
        if not self.aborted:
            dist.destroy_process_group(self.data)
        self.data = self._new_data_group()
        self.aborted = False

    def _new_data_group(self):
        ranks = list(range(self.size)) if self.group is None else dist.get_process_group_ranks(self.group)
        return dist.new_group(ranks, backend=dist.get_backend(self.group))

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)
