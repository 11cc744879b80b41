"""CUDA graphs of the few-input forwards: decode steps, drafting steps and
verification.

A decode step of a hybrid model launches a few hundred small kernels; on a
GPU the host, not the device, then sets the pace. A captured CUDA graph
replays all of them with one launch. What a graph holds is fixed: tensor
addresses, shapes, and every value Python computed while it was captured. So
a forward is captured over **static buffers** that stand for everything that
changes from one forward to the next:

    tokens, positions, slot_mapping, snap   [B, T]
    src, num_tokens, last_index,
    context_lens, query_lens                [B]
    block_tables                            [B, W]

all int64 views of one device tensor, filled from the host by one copy per
forward (`StaticForward.fill`). B is the batch rounded up to a captured size
(`GRAPH_BATCH_SIZES`); the rows past the real ones are **padding**: no inputs
(num_tokens 0, query_lens 0), no writes (slot_mapping and snap -1), their
logits dropped. T is the forward's input count, captured as it comes (1 for
decode, γ + 1 for verification, up to `MAX_GRAPH_INPUTS`); W the block-table
width of `max_model_len`. The layers see these buffers through a
`ForwardBatch` whose slot plan holds tensors only (`StaticSlots`): the Triton
kernels read slots and lengths on the device, the K/V write is one
fixed-shape launch (`kernels.kv_write`), and nothing reads a value back to
the host, so the same graph serves every batch of its shape.

A shape is captured the first time a forward needs it: one warm-up run with
every row padding (it compiles the kernels and makes the cached constants,
and writes nothing), the capture, then the replay with the real buffers.
Graphs share one memory pool and run one at a time; each returns a copy of
its logits, since the next replay reuses the pool. A forward that keeps an
input log (a checkpoint policy that log-replays) runs a graph of its own
shape whose layers put their inputs' tensors in a dict while it is
captured; each replay hands the caller copies of them.

`Engine(cuda_graphs=True)` captures the target's and a model drafter's
forwards, or raises ConfigError for a model that cannot be captured; with the
default None, `HYBRIDSPEC_CUDA_GRAPHS=1` captures those that can be
(`graphed`). Forwards the graphs leave to the eager path: more inputs than
`MAX_GRAPH_INPUTS`, a prompt's prefill (a row from the empty state) and a
batch past the largest captured size.
Models with MoE layers are refused (routing reads the chosen experts back to
the host), and so are float64 models with attention (the Triton attention
has no float64).

Where CUDA is absent (tests: the Triton kernels interpreted on CPU tensors,
`HYBRIDSPEC_BACKEND=triton`) nothing is captured
and a "replay" runs the forward again over the same static buffers, so
everything but the capture itself is exercised: a value Python took from one
forward's lists instead of the buffers would be wrong in the next.
"""
from __future__ import annotations

import bisect
import os
import warnings
from dataclasses import dataclass, fields

import torch

from hybridspec.kernels.triton.paged_attention import SUPPORTED_DTYPES

from hybridspec.errors import ConfigError
from hybridspec.cache.forward_batch import ForwardBatch
from hybridspec.models.ffn import MoE

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
MAX_GRAPH_INPUTS = 8  # verification of γ ≤ 7; longer forwards run eagerly
GRAPHS_ENV = "HYBRIDSPEC_CUDA_GRAPHS"  # "1": an Engine left at cuda_graphs=None captures where it can


class StaticSlots:
    """A captured forward's slot plan: the tensors the Triton paths read, and
    nothing a host-side (CPU) path could take instead."""

    def __init__(self, batch: int, num_inputs: int, src, snap, num_tokens, last_index, device):
        self.batch, self.num_inputs, self.device = batch, num_inputs, device
        self.src, self.snap, self.num_tokens, self.last_index = src, snap, num_tokens, last_index


class StaticKV:
    """A captured forward's K/V plan (`KVWriteMeta`'s tensors)."""

    def __init__(self, batch: int, num_inputs: int, slot_mapping, context_lens, query_lens, block_tables):
        self.seq_ids, self.t_max = tuple(range(batch)), num_inputs  # shapes only: the rows are the buffers'
        self.slot_mapping, self.context_lens, self.query_lens = slot_mapping, context_lens, query_lens
        self.block_tables = block_tables


@dataclass
class _Entry:
    graph: object | None = None  # torch.cuda.CUDAGraph once captured
    out: torch.Tensor | None = None  # the captured forward's logits [B, T or 1, vocab]
    log: dict | None = None  # a logging shape's input log: each recurrent layer's log of the graph's tensors


class StaticForward:
    """The static buffers of one captured shape (B rows, T inputs, last_only)."""

    FIELDS_BT = ("tokens", "positions", "snap", "slot_mapping")
    FIELDS_B = ("src", "num_tokens", "last_index", "context_lens", "query_lens")

    def __init__(self, rows: int, num_inputs: int, width: int, device, pad_slot: int, has_kv: bool,
                 pin_memory: bool = False):
        self.rows, self.num_inputs, self.width, self.pad_slot, self.has_kv = rows, num_inputs, width, pad_slot, has_kv
        B, T = rows, num_inputs
        sizes = [B * T] * len(self.FIELDS_BT) + [B] * len(self.FIELDS_B) + [B * width]
        self.device_flat = torch.zeros(sum(sizes), dtype=torch.long, device=device)
        self.host_flat = torch.zeros(sum(sizes), dtype=torch.long, pin_memory=pin_memory)
        views = self.device_flat.split(sizes)
        for name, view in zip(self.FIELDS_BT, views):
            setattr(self, name, view.view(B, T))
        for name, view in zip(self.FIELDS_B, views[len(self.FIELDS_BT):]):
            setattr(self, name, view)
        self.block_tables = views[-1].view(B, width)

    def batch(self) -> ForwardBatch:
        """A ForwardBatch over the buffers (a new one per call: its `shared` values are per forward)."""
        B, T = self.rows, self.num_inputs
        slots = StaticSlots(B, T, self.src, self.snap, self.num_tokens, self.last_index, self.device_flat.device)
        kv = (StaticKV(B, T, self.slot_mapping, self.context_lens, self.query_lens, self.block_tables)
              if self.has_kv else None)
        batch = ForwardBatch(slots=slots, start_lens=[], kv=kv)
        batch.__dict__["positions"] = self.positions  # its cached property, preset
        return batch

    def fill(self, plan=None, token_lists=None) -> None:
        """Write one forward's values (`plan`: a `ForwardPlan`; None: every row padding) into the buffers."""
        B, T, W = self.rows, self.num_inputs, self.width
        n = 0 if plan is None else len(plan.seq_ids)
        tokens, positions, snap, src, num_tokens = [], [], [], [], []
        slot_mapping, context, query, table_rows = [-1] * (n * T), [0] * n, [0] * n, []
        if n:
            slots, kv = plan.batch.slots, plan.batch.kv
            for row, start in zip(token_lists, plan.start_lens):
                tokens += list(row) + [0] * (T - len(row))
                positions += range(start, start + T)
            snap = [slot for row in slots.snap_list for slot in row]
            src, num_tokens = list(slots.src_list), list(slots.num_tokens_list)
            if kv is not None:
                slot_mapping = [slot for row in kv.slot_rows for slot in row]
                context, query, table_rows = list(kv.context_list), list(kv.query_list), kv.table_rows
        pad = B - n  # padding rows: no inputs, no writes, attend to nothing, read pad_slot
        tokens += [0] * (pad * T)
        positions += [0] * (pad * T)
        snap += [-1] * (pad * T)
        slot_mapping += [-1] * (pad * T)
        src += [self.pad_slot] * pad
        num_tokens += [0] * pad
        context += [0] * pad
        query += [0] * pad
        last_index = [r * T + max(k - 1, 0) for r, k in enumerate(num_tokens)]
        host = self.host_flat.numpy()
        host[:-B * W] = tokens + positions + snap + slot_mapping + src + num_tokens + last_index + context + query
        tables = host[-B * W:].reshape(B, W)  # row by row into the array: W can be thousands of pages
        tables.fill(-1)
        for r, pages in enumerate(table_rows):
            tables[r, :len(pages)] = pages
        self.device_flat.copy_(self.host_flat)  # blocking: the host buffer is rewritten next forward


def graph_batch_size(rows: int) -> int | None:
    """The captured batch size a forward of `rows` rows runs at (None: too many)."""
    at = bisect.bisect_left(GRAPH_BATCH_SIZES, rows)
    return GRAPH_BATCH_SIZES[at] if at < len(GRAPH_BATCH_SIZES) else None


def check_graphable(model, device) -> None:
    """Raise ConfigError unless `model`'s few-input forwards can be captured on `device`."""
    if not model.backend.graphable:
        raise ConfigError(f"cuda_graphs=True needs the Triton kernels, which run on CUDA devices; the model is on "
                          f"{device} with the {model.backend.name!r} backend. Move it to a GPU or leave cuda_graphs "
                          "off (on a CPU, for tests: HYBRIDSPEC_BACKEND=triton under TRITON_INTERPRET=1)")
    if model.config.attention_layers and model.dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"cuda_graphs=True: a {model.dtype} model's attention runs the torch reference, which "
                          f"reads host-side plans; graphs need one of {SUPPORTED_DTYPES} (or leave cuda_graphs off)")
    if any(isinstance(m, MoE) for m in model.modules()):
        raise ConfigError("cuda_graphs=True: models with MoE layers are not captured (routing reads the chosen "
                          "experts back to the host); leave cuda_graphs off for this model")


def graphed(cuda_graphs: bool | None, models) -> list:
    """The models whose forwards an Engine captures: with True every one (a
    ConfigError for one that cannot be, `check_graphable`), with False none,
    with None those that can be when `HYBRIDSPEC_CUDA_GRAPHS=1` (none when it
    is unset or "0"; `EngineConfig` has checked it is one of these)."""
    if cuda_graphs is None:
        setting = os.environ.get(GRAPHS_ENV, "0")
        if setting not in ("0", "1"):
            raise ConfigError(f"{GRAPHS_ENV}={setting!r} must be 0 or 1; unset it for 0")
        if setting == "0":
            return []
    elif not cuda_graphs:
        return []
    out = []
    for model in models:
        try:
            check_graphable(model, model.device)
        except ConfigError:
            if cuda_graphs:
                raise
            continue
        out.append(model)
    return out


class ForwardGraphs:
    """The captured forwards of one model over one cache (`HybridCache.graphs`;
    `HybridModel.extend` asks `takes` and calls `run`)."""

    def __init__(self, model, cache, max_batch_size: int, max_model_len: int,
                 max_inputs: int = MAX_GRAPH_INPUTS):
        check_graphable(model, cache.device)
        self.model, self.cache = model, cache
        self.max_rows = min(max_batch_size, GRAPH_BATCH_SIZES[-1])
        self.max_inputs = max_inputs
        self.width = max(1, -(-max_model_len // cache.block_size))
        self.capture = model.backend.captures
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        # (B, T, last_only, logs) -> its buffers and graph
        self.forwards: dict[tuple[int, int, bool, bool], tuple[StaticForward, _Entry] | None] = {}  # None: eager
        self.replays = 0  # forwards run through the graphs (for tests and benchmarks)

    def takes(self, plan) -> bool:
        """Whether this forward runs through a graph: not a prompt's prefill
        (a row from the empty state; each prompt length would be a capture
        replayed rarely), nor a forward past the captured sizes."""
        rows, T = len(plan.seq_ids), max(plan.num_new)
        if T > self.max_inputs or rows > self.max_rows or 0 in plan.start_lens:
            return False
        kv = plan.batch.kv
        return kv is None or all(len(r) <= self.width for r in kv.table_rows)

    def run(self, plan, token_lists: list[list[int]], last_only: bool, input_log=None) -> torch.Tensor | None:
        """The forward's logits [rows, T or 1, vocab] (a copy), the states and K/V
        written as the eager forward writes them; `input_log` (a dict, or None)
        receives copies of each Mamba layer's inputs, as the eager forward's.
        None, with nothing written, where its shape could not be captured (a
        warning names the error once; that shape then runs eagerly)."""
        rows, T = len(plan.seq_ids), max(plan.num_new)
        key = (graph_batch_size(rows), T, last_only and T > 1, input_log is not None)
        if key not in self.forwards:
            try:
                self.forwards[key] = self._capture(*key)
            except Exception as error:  # the warm-up wrote nothing and a capture runs nothing: eager is safe
                warnings.warn(f"CUDA graph capture of {key[0]} rows x {T} inputs failed ({type(error).__name__}: "
                              f"{error}); that shape runs eagerly. Engine(cuda_graphs=False) turns graphs off",
                              RuntimeWarning, stacklevel=3)
                self.forwards[key] = None
        if self.forwards[key] is None:
            return None
        static, entry = self.forwards[key]
        static.fill(plan, token_lists)
        if entry.graph is not None:
            entry.graph.replay()
            out, log = entry.out, entry.log
        else:  # no CUDA: run the forward over the same buffers
            log = {} if input_log is not None else None
            out = self._forward(static, key[2], log)
        if input_log is not None:  # copies: the next replay reuses the pool
            for layer, inputs in log.items():  # a MambaInputLog, a GdnInputLog: rows along dim 0 of every field
                input_log[layer] = type(inputs)(*(getattr(inputs, f.name)[:rows].clone()
                                                  for f in fields(inputs)))
        self.replays += 1
        return out[:rows].clone()

    def _forward(self, static: StaticForward, last_only: bool, input_log: dict | None) -> torch.Tensor:
        batch = static.batch()
        batch.input_log = input_log
        return self.model(static.tokens, batch, self.cache, last_only)

    def _capture(self, rows: int, T: int, last_only: bool, logs: bool) -> tuple[StaticForward, _Entry]:
        has_kv = self.cache.kv is not None
        static = StaticForward(rows, T, self.width, self.cache.device, pad_slot=0, has_kv=has_kv,
                               pin_memory=self.capture)
        entry = _Entry()
        if not self.capture:
            return static, entry
        static.fill()  # every row padding: the warm-up writes nothing
        stream = torch.cuda.Stream(self.cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream):
            self._forward(static, last_only, {} if logs else None)
        torch.cuda.current_stream(self.cache.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        entry.log = {} if logs else None  # the layers put the graph's log tensors in it while it is captured
        with torch.cuda.graph(graph, pool=self.pool):
            entry.out = self._forward(static, last_only, entry.log)
        entry.graph = graph
        return static, entry
