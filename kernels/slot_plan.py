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


def slot_span(slots: list[int]) -> slice | None:
    """The slice of the pool that is exactly `slots`, in order: an increasing
    arithmetic run (one slot, consecutive rings, or rings whose heads sit at
    the same ring offset); None otherwise."""
    step = slots[1] - slots[0] if len(slots) > 1 else 1
    if step <= 0 or any(b - a != step for a, b in zip(slots, slots[1:])):
        return None
    return slice(slots[0], slots[-1] + 1, step)


class StepWrites:
    """The snapshots written after one input t: `slots` [rows] in the pool,
    `rows` [rows] the batch rows that write (None: every row, in order), and
    `span`, the slice of the pool those slots form when every row writes and
    they run evenly (`slot_span`): a step can then compute its states straight
    into `pool[span]`, and no index tensor is ever made."""

    def __init__(self, slots: list[int], rows: list[int] | None, device):
        self.slot_list, self.row_list, self.device = slots, rows, device
        self.span = slot_span(slots) if rows is None else None

    def view(self, pool: torch.Tensor) -> torch.Tensor | None:
        """pool[slots] as a view [batch, ...] (None: the slots do not form a span)."""
        return None if self.span is None else pool[self.span]

    @functools.cached_property
    def slots(self) -> torch.Tensor:
        return torch.tensor(self.slot_list, dtype=torch.long, device=self.device)

    @functools.cached_property
    def rows(self) -> torch.Tensor | None:
        return None if self.row_list is None else torch.tensor(self.row_list, dtype=torch.long, device=self.device)

    def write(self, pool: torch.Tensor, state: torch.Tensor) -> None:
        """pool[slots] = state [batch, ...] of the writing rows."""
        if self.span is not None:
            pool[self.span].copy_(state)
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
        return self._src_and_snap[0]

    @functools.cached_property
    def snap(self) -> torch.Tensor:  # [batch, T], -1 where nothing is written
        return self._src_and_snap[1]

    @functools.cached_property
    def _src_and_snap(self) -> tuple[torch.Tensor, torch.Tensor]:
        """src and snap as views of one tensor (one host-to-device copy)."""
        flat = self._tensor(self.src_list + [slot for row in self.snap_list for slot in row])
        src, snap = flat.split([self.batch, self.batch * self.num_inputs])
        return src, snap.view(self.batch, self.num_inputs)

    @functools.cached_property
    def live_snap_list(self) -> list[list[int]]:
        """snap_list with -1 at every padding input: what the C kernels take (they
        run a row's padding too, after its live inputs, and write nothing there)."""
        if self.all_live:
            return self.snap_list
        return [[slot if t < n else -1 for t, slot in enumerate(row)]
                for row, n in zip(self.snap_list, self.num_tokens_list)]

    @functools.cached_property
    def live_snap(self) -> torch.Tensor:  # [batch, T], -1 where nothing is written or the input is padding
        return self.snap if self.all_live else self._tensor(self.live_snap_list).view(self.batch, self.num_inputs)

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
        out, written = [], self.live_snap_list
        for t in range(self.num_inputs):
            rows = [b for b in range(self.batch) if written[b][t] >= 0]
            if not rows:
                out.append(None)
                continue
            slots = [written[b][t] for b in rows]
            every = rows == list(range(self.batch))
            out.append(StepWrites(slots, None if every else rows, self.device))
        return out

    @functools.cached_property
    def latest_writes(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat indices b·T + t, slots) of every live snapshot, the later input
        winning a slot named twice, for writing all steps' values at once
        (conv windows); None when nothing is written."""
        latest = {}
        for b, row in enumerate(self.live_snap_list):
            for t, slot in enumerate(row):
                if slot >= 0:
                    latest[slot] = b * self.num_inputs + t
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

    @functools.cached_property
    def snapshot_grid(self) -> tuple[int, int, int] | None:
        """(first, per_input, per_row) when every row snapshots every input into
        slot first + t·per_input + b·per_row, all distinct and none a source
        slot (aligned ring halves in the offset-major pool); None otherwise."""
        snap, T = self.snap_list, self.num_inputs
        if not self.all_live or not T or any(s < 0 for row in snap for s in row):
            return None
        first = snap[0][0]
        per_input = snap[0][1] - first if T > 1 else 1
        per_row = snap[1][0] - first if self.batch > 1 else 1
        slots = {s for row in snap for s in row}
        if per_input <= 0 or per_row <= 0 or len(slots) != self.batch * T or slots & set(self.src_list):
            return None
        if any(snap[b][t] != first + t * per_input + b * per_row for b in range(self.batch) for t in range(T)):
            return None
        return first, per_input, per_row

    def grid_view(self, pool: torch.Tensor, time_major: bool) -> torch.Tensor | None:
        """The snapshot slots as one view of the pool, [T, batch, ...] (time_major)
        or [batch, T, ...]; a step computing into view[t] writes its snapshots
        in place. None without a `snapshot_grid`."""
        if self.snapshot_grid is None:
            return None
        first, per_input, per_row = self.snapshot_grid
        dims, strides = (self.num_inputs, self.batch), (per_input * pool.stride(0), per_row * pool.stride(0))
        if not time_major:
            dims, strides = dims[::-1], strides[::-1]
        return pool.as_strided((*dims, *pool.shape[1:]), (*strides, *pool.stride()[1:]),
                               pool.storage_offset() + first * pool.stride(0))

    @functools.cached_property
    def src_span(self) -> slice | None:
        return slot_span(self.src_list) if self.src_list else None

    def read(self, pool: torch.Tensor) -> torch.Tensor:
        """The rows' source states pool[src] [batch, ...]: a view when the
        source slots form a span (one row, or aligned rings), else a copy."""
        if self.src_span is not None:
            return pool[self.src_span]
        return pool.index_select(0, self.src)
