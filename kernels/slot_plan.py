"""Where one forward's torch paths read and write state slots, worked out once
on the host.

The Triton kernels read `src_slot`, `snap_slot` and `num_tokens` on the
device. The torch paths (`*_ref`, what runs on CPU) loop over the inputs on
the host; without a plan each recurrent layer would read those tensors back
(a host synchronisation on a GPU) and build the same index tensors again. A
`SlotPlan` is built once per forward from the Python lists the cache already
holds (`HybridCache.plan_forward`, `SlotPlan.of_lists`) and shared by every
recurrent layer; a reference called on its own builds one from the tensors
(`SlotPlan.of_tensors`, which reads them back once).

Index tensors are made on first use and kept, so a forward pays for the ones
its layers need, once.
"""
from __future__ import annotations

import functools

import torch


class StepWrites:
    """The snapshots written after one input t: `slots` [rows] in the pool,
    `rows` [rows] the batch rows that write (None: every row, in order), and
    `single`, the slot when the batch is one row (a step can compute its state
    straight into `pool[single]`, and no index tensor is ever made)."""

    def __init__(self, slots: list[int], rows: list[int] | None, single: int | None, device):
        self.slot_list, self.row_list, self.single, self.device = slots, rows, single, device

    @functools.cached_property
    def slots(self) -> torch.Tensor:
        return torch.tensor(self.slot_list, dtype=torch.long, device=self.device)

    @functools.cached_property
    def rows(self) -> torch.Tensor | None:
        return None if self.row_list is None else torch.tensor(self.row_list, dtype=torch.long, device=self.device)

    def write(self, pool: torch.Tensor, state: torch.Tensor) -> None:
        """pool[slots] = state [batch, ...] of the writing rows."""
        if self.single is not None:
            pool[self.single:self.single + 1] = state
            return
        pool.index_copy_(0, self.slots, (state if self.rows is None else state.index_select(0, self.rows))
                         .to(pool.dtype))


class SlotPlan:
    """src [batch] slot each row starts from; snap [batch][T] slot written after
    input t (-1: none); num_tokens [batch] live inputs per row (clamped to [0, T])."""

    def __init__(self, src: list[int], snap: list[list[int]], num_tokens: list[int], device):
        self.device = torch.device(device)
        self.src_list, self.snap_list = list(src), [list(r) for r in snap]
        self.batch = len(self.src_list)
        self.num_inputs = len(self.snap_list[0]) if self.snap_list else 0
        self.num_tokens_list = [min(max(int(n), 0), self.num_inputs) for n in num_tokens]
        self.all_live = all(n == self.num_inputs for n in self.num_tokens_list)

    @classmethod
    def of_lists(cls, src: list[int], snap: list[list[int]], num_tokens: list[int], device) -> "SlotPlan":
        return cls(src, snap, num_tokens, device)

    @classmethod
    def of_tensors(cls, src_slot: torch.Tensor, snap_slot: torch.Tensor, num_tokens: torch.Tensor) -> "SlotPlan":
        """From the kernels' arguments (reads them back to the host once)."""
        plan = cls(src_slot.tolist(), snap_slot.tolist(), num_tokens.tolist(), src_slot.device)
        plan.__dict__.update(src=src_slot, num_tokens=num_tokens)  # the caller's tensors, not copies
        return plan

    def live(self, b: int, t: int) -> bool:
        return t < self.num_tokens_list[b]

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    # -- tensors, made on first use ----------------------------------------------------------

    @functools.cached_property
    def src(self) -> torch.Tensor:  # [batch]
        return self._tensor(self.src_list)

    @functools.cached_property
    def num_tokens(self) -> torch.Tensor:  # [batch]
        return self._tensor(self.num_tokens_list)

    @functools.cached_property
    def is_live(self) -> torch.Tensor:  # [batch, T] bool
        return self._tensor([[self.live(b, t) for t in range(self.num_inputs)] for b in range(self.batch)],
                            torch.bool)

    @functools.cached_property
    def dead_inputs(self) -> torch.Tensor:  # [batch, T, 1] bool: padding inputs, for masking outputs
        return ~self.is_live[..., None]

    @functools.cached_property
    def steps(self) -> list[StepWrites | None]:
        """Per input t, the snapshots written after it (None: no live row writes).
        Within a step a slot names one row (the kernels' rule), so input order
        alone decides which write lands last."""
        out = []
        for t in range(self.num_inputs):
            rows = [b for b in range(self.batch) if self.live(b, t) and self.snap_list[b][t] >= 0]
            if not rows:
                out.append(None)
                continue
            slots = [self.snap_list[b][t] for b in rows]
            every = rows == list(range(self.batch))
            out.append(StepWrites(slots, None if every else rows, slots[0] if self.batch == 1 else None,
                                  self.device))
        return out

    @functools.cached_property
    def latest_writes(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat indices b·T + t, slots) of every live snapshot, the later input
        winning a slot named twice, for writing all steps' values at once
        (conv windows); None when nothing is written."""
        latest = {}
        for b in range(self.batch):
            for t in range(self.num_tokens_list[b]):
                if self.snap_list[b][t] >= 0:
                    latest[self.snap_list[b][t]] = b * self.num_inputs + t
        if not latest:
            return None
        return self._tensor(list(latest.values())), self._tensor(list(latest))

    @functools.cached_property
    def last_index(self) -> torch.Tensor:  # [batch] flat index b·T + num_tokens[b] - 1 of each row's last input
        return self._tensor([b * self.num_inputs + max(n - 1, 0) for b, n in enumerate(self.num_tokens_list)])

    def write_all(self, pool: torch.Tensor, values: torch.Tensor) -> None:
        """pool[snap[b, t]] = values[b, t] for every live snapshot (values [batch, T, ...])."""
        writes = self.latest_writes
        if writes is None:
            return
        flat_index, slots = writes
        if self.num_inputs == 1 and flat_index.numel() == self.batch:  # every row writes once, in row order
            pool.index_copy_(0, slots, values[:, 0].to(pool.dtype))
            return
        flat = values.reshape(self.batch * self.num_inputs, *values.shape[2:])
        pool.index_copy_(0, slots, flat.index_select(0, flat_index).to(pool.dtype))

    def read(self, pool: torch.Tensor) -> torch.Tensor:
        """The rows' source states pool[src] [batch, ...]: a view for one row, else a copy."""
        if self.batch == 1:
            s = self.src_list[0]
            return pool[s:s + 1]
        return pool.index_select(0, self.src)
