"""A whole forward of few float32 rows on CPU in one C call (`cpu/forward.c`):
embeddings, every decoder layer's blocks (`cpu/blocks.c`), each row's kept
input, final norm and LM head.

Why: with each block one C call, a decode step of a small model still spends
most of its time in Python (the layer loop, each block's checks and pointers,
the norm and head calls). Here a table of every layer's weights (read from
the model's descriptors, `kernels.descriptors`) and of one cache's state
pools and K/V pages (`_Table`, ctypes structs) is made once per (model,
cache) and kept by the model's `WholeForward`; a forward fills one struct with its token ids, slot plan, K/V plan
and input logs and makes one call. The C side calls the functions the
per-layer path calls, with the same arguments, in the same order, so
logits, states, conv windows, K/V and logs are that path's, bit for bit,
and a row's bits still do not depend on the batch.

`HybridModel.extend` calls its `WholeForward` first (a backend with the whole
forward, `kernels.backend`); it returns None (and the layers run one by one,
the blocks where they apply) unless every layer runs whole (a block for the
kind of each part its descriptor names, and the blocks' own conditions:
`cpu_blocks`), each row's inputs (padded to the longest) fit
`cpu_blocks.BLOCK_ROWS`, at any batch, and the cache's tensors are
float32 and contiguous. A row of fewer inputs runs padded with token 0: its
padding writes no state and no K/V (slot -1 in both plans), attends to
nothing and its logits are not read, and the recurrence and conv window are causal, so
its real inputs get the bits they get alone. The LM head runs in C too, with
the kernel `linear` gives it at any row count (the head's weight in panels).

A forward over a tree of inputs (`batch.tree`, `cache.tree_batch`) runs here
too, its parents passed to C (`_tree_parents`): each input's state and conv
window from its parent's, its position start + depth, its attention over the
context and its ancestors, so each input gets the bits of the chain along its
path. Every input's state goes to its snapshot slot (the commit moves the
ring head there); a tree with an input without one, or of more than
`TREE_MAX_INPUTS` inputs, is declined (the torch forms run it).
"""
from __future__ import annotations

import copy
import ctypes
import weakref
from typing import NamedTuple

import torch

from hybridspec.kernels.cpu import blocks as cpu_blocks
from hybridspec.kernels.cpu import native as cpu_native
from hybridspec.kernels.descriptors import ModelDesc, MTPInput
from hybridspec.kernels.cpu.panels import PanelWeight, out_features
from hybridspec.kernels.quant.weight import QuantWeight

_f32_p, _i64_p = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int64)
_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

HS_NO_MIXER, HS_MAMBA2, HS_ATTENTION = 0, 1, 2  # hs_layer.mixer, as in cpu/kernels.h
TREE_MAX_INPUTS = 64  # HS_TREE_MAX_INPUTS: a tree input's visible inputs are the bits of one int64


class Layer(ctypes.Structure):
    """`hs_layer` of cpu/kernels.h: one decoder layer's weights, sizes and cache tensors."""
    _fields_ = [("mixer", _i64), ("mlp", _i64), ("mixer_norm", _p), ("mlp_norm", _p),
                ("mixer_eps", _f32), ("mlp_eps", _f32),
                ("in_t", _p), ("conv_w", _p), ("conv_b", _p), ("dt_bias", _p), ("A", _p), ("D", _p),
                ("gate_norm_w", _p), ("out_t", _p), ("conv_states", _p), ("ssm_states", _p),
                ("group", _i64), ("d_inner", _i64), ("nheads", _i64), ("head_dim", _i64), ("ngroups", _i64),
                ("d_state", _i64), ("d_conv", _i64),
                ("q_t", _p), ("k_t", _p), ("v_t", _p), ("o_t", _p), ("inv_freq", _p), ("k_cache", _p),
                ("v_cache", _p), ("half", _i64), ("heads", _i64), ("kv_heads", _i64), ("attn_head_dim", _i64),
                ("block_size", _i64), ("scale", _f32),
                ("gate_t", _p), ("up_t", _p), ("down_t", _p), ("inter", _i64), ("residual", _f32)]


class ForwardArgs(ctypes.Structure):
    """`hs_forward_args` of cpu/kernels.h: one forward's pointers beside the table."""
    _fields_ = [("layers", ctypes.POINTER(Layer)), ("num_layers", _i64), ("ids", _p), ("embed", _p),
                ("embed_row", _i64), ("embed_col", _i64), ("batch", _i64), ("T", _i64), ("hidden", _i64),
                ("vocab", _i64), ("src", _p), ("snap", _p), ("slot_mapping", _p), ("block_tables", _p),
                ("context_lens", _p), ("query_lens", _p), ("max_blocks", _i64), ("logged", _p),
                ("last_index", _p), ("final_norm", _p), ("final_eps", _f32), ("lm_head_t", _p), ("work", _p),
                ("work_size", _i64), ("out", _p), ("embed_scale", _f32), ("logits_scale", _f32),
                ("hidden_points", _p), ("num_points", _i64), ("hidden_out", _p),
                ("mtp_fc", _p), ("mtp_norm_e", _p), ("mtp_norm_h", _p), ("mtp_eps", _f32), ("hidden_in", _p),
                ("normed_out", _p), ("parents", _p), ("head_top", _i64)]


DRAFT_HEAD_TOP = 128  # a greedy draft's Q6_K LM head: the columns a coarse pass ranks best, exact (`greedy_steps`)


class _Table:
    """One model's layers with one cache's tensors as `Layer` structs; `ok` when
    every layer runs whole. `tensors` are every tensor whose memory the table
    names or whose layout decided `ok`: the table is remade when one of them
    moves (`current`)."""

    def __init__(self, whole: "WholeForward", cache):
        self.tensors = [whole.desc.embed, whole.desc.lm_head, whole.desc.final_norm.weight]  # + each layer's
        self.ok = self._build(whole.desc, whole.blocks, cache, whole.compute)
        self.ptrs = [t.data_ptr() for t in self.tensors]

    def _build(self, desc: ModelDesc, blocks: list[cpu_blocks.LayerBlocks], cache, compute: torch.dtype) -> bool:
        if desc.dtype is not torch.float32:
            return False
        final = desc.final_norm.weight
        # the embedding table: [vocab, hidden] at any strides, the panels of the LM head it is tied to, or blocks
        embed_panels = isinstance(desc.embed, PanelWeight)
        if not (cpu_blocks._float32_cpu(final) and cpu_native.weight_dtype_ok(desc.embed)
                and cpu_blocks._products_take(desc.lm_head)
                and final.is_contiguous() and (embed_panels or desc.embed.dim() == 2)
                and out_features(desc.embed) == out_features(desc.lm_head)):
            return False
        layers = (Layer * len(desc.layers))()
        tensors = self.tensors
        self.mamba_layers = []  # (index in the table, Mamba2Desc) of the Mamba-2 layers, for input logs
        for i, (layer, block) in enumerate(zip(desc.layers, blocks)):
            record = layers[i]
            record.residual = layer.residual_multiplier
            if layer.mixer is not None and not (block.mixer is not None
                                                and self._mixer(record, block.mixer, cache, tensors, i)):
                return False
            if layer.ffn is not None:
                if block.mlp is None:
                    return False
                static = block.mlp.static()
                tensors += static.tensors
                if not static.ok:
                    return False
                norm_w, eps, gate_t, up_t, down_t, inter = static.args
                record.mlp, record.mlp_norm, record.mlp_eps = 1, norm_w, eps
                record.gate_t, record.up_t, record.down_t, record.inter = gate_t, up_t, down_t, inter
        self.layers = layers
        self.head_t = cpu_native.product_address(desc.lm_head, compute)
        self.final_w, self.final_eps = final.data_ptr(), desc.final_norm.eps
        by_blocks = embed_panels or isinstance(desc.embed, QuantWeight)  # panels or GGUF blocks: cpu/forward.c's own
        self.hidden = desc.embed.in_features if by_blocks else desc.embed.shape[1]
        self.vocab = out_features(desc.lm_head)
        self.embed_strides = (0, 0) if by_blocks else desc.embed.stride()
        self.has_attention = any(r.mixer == HS_ATTENTION for r in layers)
        self.has_mamba = bool(self.mamba_layers)
        # scratch floats (an upper bound of what hs_forward computes): per row, the largest block's
        # intermediates; per forward, a Mamba head's state; per forward with attention, the scores
        # of the layer with the most query heads
        self.row_work = max([_row_work(r, self.hidden) for r in layers], default=0)
        self.fixed_work = max([r.head_dim * r.d_state for r in layers if r.mixer == HS_MAMBA2], default=0)
        attention = [r for r in layers if r.mixer == HS_ATTENTION]
        self.heads = max([r.heads for r in attention], default=0)
        return True

    def _mixer(self, record: Layer, block, cache, tensors: list, index: int) -> bool:
        static = block.static()
        tensors += static.tensors
        if not static.ok:
            return False
        if isinstance(block, cpu_blocks.Mamba2Block):
            mixer = block.layer.mixer
            ssm = cache.states.ssm_states[mixer.state_layer]
            conv = cache.states.conv_states[mixer.state_layer]
            if not (cpu_blocks._float32_cpu(ssm, conv) and ssm.is_contiguous() and conv.is_contiguous()):
                return False
            norm_w, eps, in_t, conv_w, conv_b, dt_bias, A, D, gate_w, group, out_t, sizes = static.args
            d_inner, nheads, head_dim, n_groups, d_state, d_conv, _conv_dim, _proj = sizes
            record.mixer, record.mixer_norm, record.mixer_eps = HS_MAMBA2, norm_w, eps
            record.in_t, record.conv_w, record.conv_b, record.dt_bias = in_t, conv_w, conv_b, dt_bias
            record.A, record.D, record.gate_norm_w, record.out_t = A, D, gate_w, out_t
            record.conv_states, record.ssm_states = conv.data_ptr(), ssm.data_ptr()
            record.group, record.d_inner, record.nheads, record.head_dim = group, d_inner, nheads, head_dim
            record.ngroups, record.d_state, record.d_conv = n_groups, d_state, d_conv
            tensors += [ssm, conv]
            self.mamba_layers.append((index, mixer))
            return True
        if cache.kv is None:
            return False
        norm_w, eps, q_t, k_t, v_t, o_t, inv_freq, half, scale, kv_layer, (heads, kv_heads, head_dim) = static.args
        k_cache, v_cache = cache.kv.k_cache[kv_layer], cache.kv.v_cache[kv_layer]
        if not (cpu_blocks._float32_cpu(k_cache, v_cache) and k_cache.is_contiguous() and v_cache.is_contiguous()):
            return False
        record.mixer, record.mixer_norm, record.mixer_eps = HS_ATTENTION, norm_w, eps
        record.q_t, record.k_t, record.v_t, record.o_t, record.inv_freq = q_t, k_t, v_t, o_t, inv_freq
        record.k_cache, record.v_cache, record.half, record.scale = (k_cache.data_ptr(), v_cache.data_ptr(),
                                                                     half, scale)
        record.heads, record.kv_heads, record.attn_head_dim = heads, kv_heads, head_dim
        record.block_size = k_cache.shape[1]
        tensors += [k_cache, v_cache]
        return True

    def current(self) -> bool:
        """Whether the tensors the table was made from are where they were."""
        return list(map(torch.Tensor.data_ptr, self.tensors)) == self.ptrs


def _row_work(r: Layer, hidden: int) -> int:
    """Scratch floats per row of one layer's blocks (the sizes of `cpu/blocks.py`)."""
    need = 0
    if r.mixer == HS_MAMBA2:
        conv_dim = r.d_inner + 2 * r.ngroups * r.d_state
        need = hidden + (r.d_inner + conv_dim + r.nheads) + conv_dim + r.nheads + 2 * r.d_inner
    elif r.mixer == HS_ATTENTION:
        need = hidden + 2 * (r.heads + r.kv_heads) * r.attn_head_dim + 2 * r.half
    return max(need, hidden + 2 * r.inter if r.mlp else 0)


class WholeForward:
    """The whole-forward kernel of one model: its descriptor and its layers'
    native blocks (`cpu_blocks.LayerBlocks`, shared with the layer-by-layer
    path), and a table per cache, made on first use and remade when a tensor it
    names has moved. A model that replaces its parameters makes a new one."""

    def __init__(self, desc: ModelDesc, blocks: list[cpu_blocks.LayerBlocks], compute: torch.dtype = torch.float32):
        self.desc, self.blocks, self.compute = desc, blocks, compute  # compute: the LM head's (the blocks' own)
        self._tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> _Table

    def __deepcopy__(self, memo) -> "WholeForward":
        """A copy over the copied descriptors (a deep-copied model's), with no tables: they name caches."""
        return WholeForward(copy.deepcopy(self.desc, memo), copy.deepcopy(self.blocks, memo), self.compute)

    def table(self, cache) -> _Table:
        table = self._tables.get(cache)
        if table is None or not table.current():
            table = self._tables[cache] = _Table(self, cache)
        return table

    def __call__(self, token_lists: list[list[int]], batch, cache, last_only: bool,
                 mtp: "MTPInput | None" = None) -> "Whole | None":
        """The forward in one C call, or None where it does not apply (`forward`)."""
        return forward(self, token_lists, batch, cache, last_only, mtp)

    def greedy_steps(self, cache, tokens: list[int], steps: int, plan, argmax_only: bool = False):
        """`greedy_steps` where it runs for these rows: `plan()` then gives
        (chains, K/V plan, starts), or None (nothing planned, nothing run).
        None where it declines, before `plan` is called. `argmax_only`: the
        caller reads only the tokens (`DRAFT_HEAD_TOP`)."""
        if not takes_greedy(self, cache, len(tokens)) or (planned := plan()) is None:
            return None
        return greedy_steps(self, cache, tokens, steps, *planned, head_top=DRAFT_HEAD_TOP if argmax_only else 0)

    def extend_greedy(self, cache, token_lists: list[list[int]], steps: int, plan, argmax_only: bool = False):
        """`extend_greedy`, planned and declined as `greedy_steps`."""
        if not takes_greedy(self, cache, len(token_lists), len(token_lists[0])) or (planned := plan()) is None:
            return None
        return extend_greedy(self, cache, token_lists, steps, *planned,
                             head_top=DRAFT_HEAD_TOP if argmax_only else 0)


class NoWholeForward:
    """A backend without the whole forward: every call declines."""

    def __call__(self, token_lists, batch, cache, last_only, mtp=None) -> None:
        return None


NO_WHOLE_FORWARD = NoWholeForward()


class Whole(NamedTuple):
    """What `forward` computed: `values` [batch, T or 1, vocab] logits;
    `finite`: every logit is finite (False when unknown)."""
    values: torch.Tensor
    finite: bool


def forward(whole: WholeForward, token_lists: list[list[int]], batch, cache, last_only: bool,
            mtp: MTPInput | None = None) -> Whole | None:
    """`HybridModel.forward` over `token_lists` (every row T tokens) in one C
    call; None where it does not apply (see the module docstring). The token ids and
    the forward's slot and K/V plans go to C as one int64 array made from the
    plans' host lists (no tensors of them are made)."""
    if torch.is_grad_enabled() or not cpu_native.available():
        return None
    bsz, lengths = len(token_lists), [len(tokens) for tokens in token_lists]
    T = max(lengths, default=0)
    if not (bsz > 0 and 0 < T <= cpu_blocks.BLOCK_ROWS) or min(lengths) < 1:
        return None
    if min(lengths) < T:  # rows of fewer inputs (a verify of rows with fewer drafts) padded with token 0
        token_lists = [tokens + [0] * (T - len(tokens)) for tokens in token_lists]
    table = whole.table(cache)
    if not table.ok:
        return None
    plan, meta = batch.slots, batch.kv
    if table.has_mamba and not (plan is not None and plan.batch == bsz and plan.num_inputs == T):
        return None
    if table.has_attention and meta is None:
        return None
    parents = None
    if batch.tree is not None:
        # hidden states are kept per input, in tree order (`HiddenStates.follow_path` lays out the path's)
        if (parents := _tree_parents(batch.tree.plan.parents, T, plan if table.has_mamba else None)) is None \
                or mtp is not None:
            return None
    logged = None
    if table.has_mamba and batch.input_log is not None:
        logged = [cpu_blocks.logged_inputs(mixer, batch, bsz, T) for _, mixer in table.mamba_layers]
    kv = (meta.slot_rows, meta.context_list, meta.query_list, meta.table_rows) if table.has_attention else None
    call = _Call(whole.desc, table, token_lists, plan.src_list if table.has_mamba else None,
                 plan.live_snap_list if table.has_mamba else None, kv, last_only, logged, lengths=lengths,
                 parents=parents)
    if batch.hidden is not None:
        _keep_hidden(call, batch.hidden, len(table.layers), bsz, T, table.hidden)
    if mtp is not None:
        if not (isinstance(mtp.fc, PanelWeight) and mtp.hidden.is_contiguous() and mtp.hidden.shape[:2] == (bsz, T)
                and last_only and mtp.normed_out.shape == (bsz, table.hidden)):
            return None
        args = call.args
        args.mtp_fc, args.mtp_eps = cpu_native.weight_address(mtp.fc), mtp.eps
        args.mtp_norm_e, args.mtp_norm_h = mtp.norm_e.data_ptr(), mtp.norm_h.data_ptr()
        args.hidden_in, args.normed_out = mtp.hidden.data_ptr(), mtp.normed_out.data_ptr()
        call.work += 4 * bsz * T * table.hidden
        args.work_size = call.work
    _give_work(call)
    status = cpu_native.library().hs_forward(ctypes.byref(call.args))
    if status == -2:
        _bad_tokens(token_lists, table.vocab)
    if status < 0:
        raise ValueError(f"cpu_forward: arguments not taken: {bsz} rows of {T} inputs, last_only {last_only}")
    return Whole(call.out, status == 0)


def _tree_parents(parents: list[list[int]], T: int, plan) -> list[int] | None:
    """A tree forward's parents as `hs_forward_args.parents` takes them ([batch · T]; a padding
    input's -1), or None where the C forward declines it: more than `TREE_MAX_INPUTS` inputs,
    or (`plan`, with Mamba-2 layers) some input without a snapshot slot, where its state
    would not outlive the forward (the torch forms keep it instead)."""
    if T > TREE_MAX_INPUTS:
        return None
    if plan is not None and any(slot < 0 for row, n in zip(plan.live_snap_list, plan.num_tokens_list)
                                for slot in row[:n]):
        return None
    return [p for row in parents for p in row + [-1] * (T - len(row))]


def _keep_hidden(call: "_Call", capture, num_layers: int, bsz: int, T: int, hidden: int) -> None:
    """Point `call` at a new `capture.values` [batch, T, k, hidden] that the C
    forward fills at the capture's points (`cache.hidden_states`)."""
    slots = [-1] * (num_layers + 1)
    for k, point in enumerate(capture.points):
        slots[point] = k
    call.points = (ctypes.c_int64 * len(slots))(*slots)
    capture.values = torch.empty(bsz, T, len(capture.points), hidden, dtype=torch.float32)
    call.args.hidden_points = ctypes.addressof(call.points)
    call.args.num_points, call.args.hidden_out = len(capture.points), capture.values.data_ptr()


def _args(desc: ModelDesc, table: _Table, bsz: int, T: int) -> ForwardArgs:
    """The fields every call's `ForwardArgs` takes from the model and its table."""
    args = ForwardArgs()
    args.layers, args.num_layers = table.layers, len(table.layers)
    args.embed, args.batch, args.T = cpu_native.weight_address(desc.embed), bsz, T
    args.embed_row, args.embed_col = table.embed_strides
    args.hidden, args.vocab = table.hidden, table.vocab
    args.embed_scale, args.logits_scale = desc.embedding_multiplier, desc.logits_scaling
    return args


def _give_work(*calls) -> None:
    """Point the calls of one C entry point at the thread's scratch memory, sized
    for the largest (taken once: a later, larger request would move it)."""
    work = cpu_blocks._work(max(call.work for call in calls)).data_ptr()
    for call in calls:
        call.args.work = work


def _bad_tokens(token_lists: list[list[int]], vocab: int):
    """Raise the IndexError C reported (status -2) with the ids outside the vocabulary."""
    bad = sorted({t for tokens in token_lists for t in tokens if not 0 <= t < vocab})
    raise IndexError(f"token ids {bad[:8]} lie outside the vocabulary [0, {vocab})")


class _Call:
    """One forward's `ForwardArgs` and the memory it points at (kept alive with it):
    `token_lists` [batch][T] ids; the slot plan `src` [batch] and `snap` [batch][T]
    (None without Mamba layers); the K/V plan `kv` = (slot rows [batch][T],
    context lengths, query lengths, block table rows) (None without attention);
    `logged` each Mamba layer's input-log buffer (or None). `out` receives the
    logits [batch, T or 1, vocab]. `lengths`: each row's real
    inputs where rows are padded to T (the last one is the row's kept input).
    `parents`: a tree forward's [batch · T] parent inputs (`_tree_parents`), None for a chain.
    `work`: the scratch floats it needs (`_give_work` points it there)."""

    def __init__(self, desc: ModelDesc, table: _Table, token_lists, src, snap, kv, last_only: bool, logged=None,
                 out: torch.Tensor | None = None, lengths: list[int] | None = None,
                 parents: list[int] | None = None):
        bsz, T = len(token_lists), len(token_lists[0])
        rows = bsz * T
        ints = [token for tokens in token_lists for token in tokens]  # [batch, T] ids, then the plans
        args = self.args = _args(desc, table, bsz, T)
        hidden, vocab = table.hidden, table.vocab
        work = 3 * rows * hidden + rows * table.row_work + table.fixed_work  # floats; hs_forward checks it
        at = {}  # field -> offset in `ints`
        if table.has_mamba:
            at["src"], at["snap"] = len(ints), len(ints) + bsz
            ints += src
            for row in snap:
                ints += row
            if logged is not None:
                pointers = self.pointers = (ctypes.c_void_p * len(table.layers))()
                for (index, _), buffer in zip(table.mamba_layers, logged):
                    pointers[index] = buffer.data_ptr()
                args.logged = ctypes.cast(pointers, ctypes.c_void_p)
        if table.has_attention:
            slot_rows, context_lens, query_lens, table_rows = kv
            width = max(1, max(map(len, table_rows)))
            at["slot_mapping"] = len(ints)
            for row in slot_rows:
                ints += row
            at["context_lens"], at["query_lens"] = len(ints), len(ints) + bsz
            at["block_tables"] = len(ints) + 2 * bsz
            ints += context_lens
            ints += query_lens
            for row in table_rows:
                ints += row
                ints += [-1] * (width - len(row))
            args.max_blocks = width
            work += T * table.heads * max(context_lens)
        if parents is not None:
            at["parents"] = len(ints)
            ints += parents
        kept = bsz if last_only else rows
        if last_only and T > 1:  # each row's last input
            at["last_index"] = len(ints)
            ints += range(T - 1, rows, T) if lengths is None else [b * T + n - 1 for b, n in enumerate(lengths)]
        buffer = self.buffer = (ctypes.c_int64 * len(ints))(*ints)
        base = ctypes.addressof(buffer)
        args.ids = base
        for field, offset in at.items():
            setattr(args, field, base + 8 * offset)
        args.final_norm, args.final_eps, args.lm_head_t = table.final_w, table.final_eps, table.head_t
        if out is None:
            out = torch.empty(bsz, kept // bsz, vocab, dtype=torch.float32)
        self.out, self.work = out, work
        args.work_size, args.out = work, out.data_ptr()


def takes_greedy(whole: WholeForward, cache, batch: int, T: int = 1) -> bool:
    """Whether `greedy_steps` runs for `batch` rows of the model on `cache`, and
    `extend_greedy` for a catch-up of T inputs per row before them."""
    return (not torch.is_grad_enabled() and 0 < batch * T <= cpu_blocks.BLOCK_ROWS and cpu_native.available()
            and whole.table(cache).ok)


def greedy_steps(whole: WholeForward, cache, tokens: list[int], steps: int, chains: list[list[int]] | None, meta,
                 starts: list[int], head_top: int = 0) -> tuple[list[list[int]], torch.Tensor, bool]:
    """`steps` decode steps of one input per row in one C call (`hs_greedy_steps`),
    each step's input the argmax of the last step's logits; the caller checked
    `takes_greedy` and planned the steps: `chains[b]` the ring slots row b's
    state passes through (steps + 1: the head, then the slot written by each
    step), `meta` the K/V plan of the `steps` new positions from `starts`.
    Returns (each row's next tokens [batch][steps], logits [batch, steps, vocab],
    whether every logit is finite). `head_top` > 0: each step's LM head, where
    it is Q6_K, only its head_top columns a coarse pass ranks best, the others
    −∞ (`hs_forward_args.head_top`: the argmax where the best column is among
    them; the tokens are a draft's, which verification makes exact)."""
    table = whole.table(cache)
    bsz, vocab = len(tokens), table.vocab
    call = _Steps(whole.desc, table, steps, chains, meta, 0, starts, tokens)
    call.args.head_top = head_top
    _give_work(call)
    logits = torch.zeros(steps, bsz, vocab, dtype=torch.float32)
    status = cpu_native.library().hs_greedy_steps(ctypes.byref(call.args), steps, call.plan_address,
                                                  call.token_address, logits.data_ptr())
    if status == -2:
        _bad_tokens([tokens], vocab)
    if status < 0:
        raise ValueError(f"cpu_forward: greedy steps not taken: {bsz} rows, {steps} steps")
    return call.drafts(), logits.transpose(0, 1), status == 0


def extend_greedy(whole: WholeForward, cache, token_lists: list[list[int]], steps: int, chains: list[list[int]] | None, meta,
                  starts: list[int], head_top: int = 0) -> tuple[list[int], list[list[int]], torch.Tensor, bool]:
    """A greedy drafter's catch-up and its `steps` greedy steps in one C call
    (`hs_extend_greedy`): the forward over `token_lists` (every row T tokens;
    each row's last logits), then the steps from its argmax, as `forward` and
    `greedy_steps` run them. The caller checked `takes_greedy` and the rows'
    shapes and planned it: `chains[b]` the ring slots row b's state passes
    through (steps + 2: the head, the catch-up's slot, then each step's),
    `meta` the K/V plan of the T + steps new positions from `starts`.
    Returns (each row's catch-up argmax [batch], the steps' tokens
    [batch][steps], logits [batch, steps + 1, vocab], whether every logit is
    finite); `head_top` as `greedy_steps`."""
    table = whole.table(cache)
    bsz, T, vocab = len(token_lists), len(token_lists[0]), table.vocab
    logits = torch.zeros(steps + 1, bsz, vocab, dtype=torch.float32)
    src = snap = kv = None
    if table.has_mamba:
        src, snap = [chain[0] for chain in chains], [[-1] * (T - 1) + [chain[1]] for chain in chains]
    if table.has_attention:
        kv = ([row[:T] for row in meta.slot_rows], [start + T for start in starts], [T] * bsz, meta.table_rows)
    first = _Call(whole.desc, table, token_lists, src, snap, kv, True, out=logits[0])
    call = _Steps(whole.desc, table, steps, chains and [chain[1:] for chain in chains], meta, T,
                  [start + T for start in starts], [0] * bsz)
    first.args.head_top = call.args.head_top = head_top
    _give_work(first, call)
    status = cpu_native.library().hs_extend_greedy(ctypes.byref(first.args), ctypes.byref(call.args), steps,
                                                   call.plan_address, call.token_address, logits.data_ptr())
    if status == -2:
        _bad_tokens(token_lists, vocab)
    if status < 0:
        raise ValueError(f"cpu_forward: catch-up and greedy steps not taken: {bsz} rows of {T}, {steps} steps")
    return list(call.tokens[:bsz]), call.drafts(), logits.transpose(0, 1), status == 0


class _Steps:
    """The `ForwardArgs` and per-step plan of `steps` greedy steps of one input
    per row (`hs_greedy_steps`) and the memory they point at: `chains[b]` the
    ring slots of row b from the first step's source on, `meta` a K/V plan whose
    positions from `offset` on are the steps' (row b's first at `starts[b]`),
    `first` the first step's input tokens; `work` the scratch floats it needs."""

    def __init__(self, desc: ModelDesc, table: _Table, steps: int, chains, meta, offset: int, starts: list[int],
                 first: list[int]):
        bsz = self.bsz = len(starts)
        self.steps = steps
        args = self.args = _args(desc, table, bsz, 1)
        hidden = table.hidden
        args.final_norm, args.final_eps, args.lm_head_t = table.final_w, table.final_eps, table.head_t
        work = 3 * bsz * hidden + bsz * table.row_work + table.fixed_work
        plan = []  # per step: src, snap, slot_mapping, context_lens of the batch
        for s in range(steps):
            plan += [chain[s] for chain in chains] if chains else [0] * bsz
            plan += [chain[s + 1] for chain in chains] if chains else [0] * bsz
            plan += [row[offset + s] for row in meta.slot_rows] if meta else [0] * bsz
            plan += [start + s + 1 for start in starts]
        fixed = [1] * bsz  # query_lens, then the block tables
        if table.has_attention:
            width = max(1, max(map(len, meta.table_rows)))
            for row in meta.table_rows:
                fixed += row
                fixed += [-1] * (width - len(row))
            args.max_blocks = width
            work += table.heads * (max(starts) + steps)
        self.plan = (ctypes.c_int64 * max(1, len(plan)))(*plan)
        self.fixed = (ctypes.c_int64 * len(fixed))(*fixed)
        self.tokens = (ctypes.c_int64 * ((steps + 1) * bsz))(*first)
        self.plan_address, self.token_address = ctypes.addressof(self.plan), ctypes.addressof(self.tokens)
        if table.has_mamba:  # the per-step pointers are set in C; non-NULL says the layers are there
            args.src = args.snap = self.plan_address
        if table.has_attention:
            args.slot_mapping = args.context_lens = self.plan_address
            args.query_lens = ctypes.addressof(self.fixed)
            args.block_tables = ctypes.addressof(self.fixed) + 8 * bsz
        self.work = args.work_size = work

    def drafts(self) -> list[list[int]]:
        """Each row's step tokens [batch][steps], read back after the call."""
        bsz, tokens = self.bsz, self.tokens
        return [[tokens[(s + 1) * bsz + b] for s in range(self.steps)] for b in range(bsz)]
