"""`HybridModel`: the layer stack of every supported family, run by hybridspec
itself so that the runtime controls every state write.

Entry points (all batched over ragged sequences, rows right-padded):
- `prefill`: many tokens from an empty state;
- `extend`: many tokens continuing from the cached state (verification);
- `decode`: one token per sequence.
All three are one forward that advances every recurrent layer (Mamba-1,
Mamba-2, gated DeltaNet) from its ring head
and writes K/V for the new positions; only the bookkeeping differs.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hybridspec.checkpoints.input_log import InputLog
from hybridspec.checkpoints.recurrent import RecurrentLayer
from hybridspec.kernels import backend as backends
from hybridspec.kernels.cpu import panels

from hybridspec.kernels.descriptors import LayerDesc, ModelDesc
from hybridspec.kernels.cpu.panels import PanelWeight
from hybridspec.kernels.quant import formats
from hybridspec.kernels.quant.weight import QuantWeight

from hybridspec.config import HybridConfig
from hybridspec.errors import ConfigError

from hybridspec.models.attention import Attention, rope_inv_freq
from hybridspec.cache.forward_batch import ForwardBatch
from hybridspec.cache.tree_batch import TreeBatch
from hybridspec.models import packing, quantizing
from hybridspec.models.common import Kernelled, RMSNorm, check_finite, param, take
from hybridspec.models.ffn import MLP, MoE
from hybridspec.models.greedy_chain import GreedyChain
from hybridspec.models.mamba2 import Mamba2Mixer


class DecoderLayer(nn.Module):
    """h += r·mixer(norm(h)); h += r·ffn(norm(h))  (either part may be absent).
    At a shared block's occurrence (Zamba2) the mixer reads norm(h + t), t the
    occurrence's output, and the residual stays h."""

    def __init__(self, cfg: HybridConfig, index: int, weights: dict[str, torch.Tensor], inv_freq,
                 shared_blocks=None):
        super().__init__()
        self.shared = None
        if cfg.shared_blocks is not None and index in cfg.shared_blocks.occurrences:
            from hybridspec.models.shared_block import SharedBlockOccurrence
            self.shared = SharedBlockOccurrence(cfg, shared_blocks[cfg.shared_blocks.block_of(index)],
                                                take(weights, "shared"), index, inv_freq)
        mixer_type, ffn_type = cfg.layer_types[index], cfg.ffn_types[index]
        self.residual_multiplier = cfg.residual_multiplier
        zero_centred = cfg.zero_centred_norms
        self.input_norm = (RMSNorm(weights["input_norm.weight"], cfg.rms_norm_eps, zero_centred)
                           if mixer_type != "none" else None)
        self.ffn_norm = (RMSNorm(weights["ffn_norm.weight"], cfg.rms_norm_eps, zero_centred)
                         if ffn_type != "none" else None)
        mixer_weights = take(weights, "mixer")
        if mixer_type == "attention" and (cfg.attention.qk_norm or cfg.attention.output_gate):
            from hybridspec.models.gated_attention import GatedAttention
            self.mixer = GatedAttention(cfg.attention, mixer_weights, cfg.attention_layers.index(index), inv_freq,
                                        cfg.rms_norm_eps, cfg.zero_centred_norms)
        elif mixer_type == "attention":
            self.mixer = Attention(cfg.attention, mixer_weights, cfg.attention_layers.index(index), inv_freq)
        elif mixer_type == "mamba2":
            self.mixer = Mamba2Mixer(cfg.mamba2, mixer_weights, cfg.mamba_layers.index(index), cfg.rms_norm_eps)
        elif mixer_type == "parallel":
            from hybridspec.models.parallel_mixer import ParallelMixer
            self.mixer = ParallelMixer(cfg, mixer_weights, index, inv_freq)
        elif mixer_type == "mamba1":
            from hybridspec.models.mamba1 import Mamba1Mixer
            self.mixer = Mamba1Mixer(cfg.mamba1, mixer_weights, cfg.mamba_layers.index(index), cfg.rms_norm_eps)
        elif mixer_type == "gdn":
            from hybridspec.models.gated_deltanet import GatedDeltaNet
            self.mixer = GatedDeltaNet(cfg.gdn, mixer_weights, cfg.mamba_layers.index(index), cfg.rms_norm_eps)
        else:
            self.mixer = None
        ffn_weights = take(weights, "ffn")
        self.ffn = MLP(cfg.mlp, ffn_weights) if ffn_type == "mlp" else MoE(cfg.moe, ffn_weights) if ffn_type == "moe" else None
        self.blocks = backends.NO_BLOCKS  # its native blocks (`HybridModel.bind_backend`)
        self.reduce = None  # tensor parallel: the sum over ranks of the mixer's and ffn's partial outputs

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cache, embeddings: torch.Tensor) -> torch.Tensor:
        """h, embeddings (the scaled token embeddings, read by shared blocks) [batch, T, hidden]."""
        if self.mixer is not None:
            block = self.blocks.mixer if batch.tree is None else None  # the C blocks take chains only
            out = block(h, batch, cache) if block is not None else None  # one C call, where it runs
            if out is None:
                x = h if self.shared is None else h + self.shared(h, embeddings, batch, cache)
                out = h + self.scaled(self.summed(self.mixer(self.input_norm(x), batch, cache)))
            h = out
        if self.ffn is not None:
            block = self.blocks.mlp
            out = block(h) if block is not None else None  # one C call, where it runs
            h = out if out is not None else h + self.scaled(self.summed(self.ffn(self.ffn_norm(h))))
        return h

    def summed(self, update: torch.Tensor) -> torch.Tensor:
        """A row-parallel output summed over tensor-parallel ranks (itself on one device)."""
        return update if self.reduce is None else self.reduce(update)

    def describe(self) -> LayerDesc:
        return LayerDesc(mixer=None if self.mixer is None else self.mixer.describe(),
                         mixer_norm=None if self.input_norm is None else self.input_norm.describe(),
                         ffn=None if self.ffn is None else self.ffn.describe(),
                         ffn_norm=None if self.ffn_norm is None else self.ffn_norm.describe(),
                         residual_multiplier=self.residual_multiplier, shared_block=self.shared is not None)

    @property
    def recurrent(self) -> RecurrentLayer:
        """This layer's recurrent part: the mixer, or the Mamba2 half of a parallel mixer."""
        return getattr(self.mixer, "mamba", self.mixer)

    def scaled(self, update: torch.Tensor) -> torch.Tensor:
        """The residual update times residual_multiplier (GraniteMoeHybrid; 1 elsewhere)."""
        return update if self.residual_multiplier == 1.0 else update * self.residual_multiplier


class HybridModel(Kernelled, nn.Module):
    """A hybrid recurrent/attention causal LM. Weights use hybridspec's canonical
    names (see `hybridspec.adapters`); tensors are shared, never copied (but
    zero-centred norm weights, held as 1 + w: `common.norm_weight`)."""

    def __init__(self, config: HybridConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.config = config
        self.embed = param(weights["embed_tokens.weight"])
        inv_freq = None
        if config.attention is not None and config.attention.use_rope:
            inv_freq = weights.get("rotary.inv_freq", rope_inv_freq(config.attention))
        shared_blocks = None
        if config.shared_blocks is not None:
            from hybridspec.models.shared_block import SharedBlock
            shared_blocks = nn.ModuleList(SharedBlock(config, take(weights, f"shared_blocks.{b}"))
                                          for b in range(config.shared_blocks.num_blocks))
        self.shared_blocks = shared_blocks
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, take(weights, f"layers.{i}"), inv_freq, shared_blocks)
            for i in range(config.num_layers))
        self.final_norm = RMSNorm(weights["final_norm.weight"], config.rms_norm_eps, config.zero_centred_norms)
        lm_head = weights.get("lm_head.weight")
        self.lm_head = self.embed if lm_head is None or config.tie_word_embeddings else param(lm_head)
        self._start(None, torch.float32)

    def _start(self, backend_name: str | None, compute: torch.dtype) -> None:
        """What a model built from its modules holds besides them (`__init__`, `first_layers`), then its backend."""
        self.compute = compute  # what the products multiply in (`set_compute`)
        self.tensor_parallel = None  # the TensorParallel group this model is a shard over (`shard_over`)
        self.vocab_shard: tuple[int, int] | None = None  # (first id, rows) of a vocab-parallel shard's tables
        self.load_report = None  # hybridspec.adapters.LoadReport after hs.from_hf / hs.load: tensors left unused
        self.source_dir = None  # the directory hs.load read (where draft="mtp" finds the MTP weights), else None
        self.bind_backend(backend_name)  # sets backend_name: a backend named for this model, else the process's

    def shard_over(self, tp) -> "HybridModel":
        """Mark this model, built from one rank's shard of the weights
        (`tp.shard_weights`), as that shard of `tp` (a `tp.TensorParallel`):
        its layers sum their partial outputs over the ranks, and the backend
        runs the modules (the native blocks and whole forward do not reduce)."""
        self.tensor_parallel = tp
        rows = panels.out_features(self.embed)  # the shard's rows of the vocab-parallel embedding and LM head
        if rows * tp.size < self.config.vocab_size:
            raise ConfigError(f"this shard's embedding has {rows} rows; tensor_parallel_size={tp.size} needs at "
                              f"least {self.config.vocab_size} / {tp.size} (build it with tp.shard_weights)")
        self.vocab_shard = (tp.rank * rows, rows)
        for layer in self.layers:
            layer.reduce = tp.all_reduce
            for part in (layer.mixer, getattr(layer.mixer, "mamba", None), layer.shared):
                if hasattr(part, "reduce"):
                    part.reduce = tp.all_reduce
        self.bind_backend(self.backend_name)
        return self

    def first_layers(self, n: int) -> "HybridModel":
        """This model's embedding, first `n` layers, final norm and LM head as a model of its own: a
        layer-skip (early-exit) draft of it, `draft="layers:N"`. The modules are this model's, no
        weight copied (a quantized target's draft reads the same blocks); its states and KV pages
        are its own cache's. Build it from the target as it will run (after `pack_for_cpu`,
        `set_compute`, `quantize`): those replace the target's weights under it. A ConfigError for
        `n` outside 1 … num_layers − 1 or a tensor-parallel shard."""
        cfg = self.config
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < cfg.num_layers:
            raise ConfigError(f"first_layers({n!r}): a layer-skip draft takes 1 to {cfg.num_layers - 1} of the "
                              f"target's {cfg.num_layers} layers")
        if self.tensor_parallel is not None:
            raise ConfigError("first_layers: this model is a tensor-parallel shard; draft with a model of its own, "
                              "'mtp', 'ngram' or 'suffix'")
        shared = cfg.shared_blocks
        if shared is not None:  # the occurrences among the first n (block_of stays what it was for them)
            kept = tuple(i for i in shared.occurrences if i < n)
            shared = dataclasses.replace(shared, occurrences=kept) if kept else None
        draft = HybridModel.__new__(HybridModel)
        nn.Module.__init__(draft)
        # recurrent and attention layers keep their slots: the first n layers' indices into mamba_layers
        # and attention_layers are the same in the shorter lists
        draft.config = dataclasses.replace(cfg, layer_types=cfg.layer_types[:n], ffn_types=cfg.ffn_types[:n],
                                           shared_blocks=shared)
        draft.embed = self.embed
        draft.shared_blocks = self.shared_blocks if shared is not None else None
        draft.layers = nn.ModuleList(self.layers[:n])
        draft.final_norm, draft.lm_head = self.final_norm, self.lm_head
        draft._start(self.backend_name, self.compute)
        return draft

    def describe(self) -> ModelDesc:
        """What the kernels see of this model (`kernels.descriptors`)."""
        return ModelDesc(embed=self.embed, layers=tuple(layer.describe() for layer in self.layers),
                         final_norm=self.final_norm.describe(), lm_head=self.lm_head,
                         embedding_multiplier=self.config.embedding_multiplier,
                         logits_scaling=self.config.logits_scaling, dtype=self.dtype)

    def bind_backend(self, name: str | None = None) -> None:
        """Choose the backend for this model's device and dtype (`kernels.backend`:
        `name`, else the process's choice) and describe the model to it: every
        module computes through its ops, the native blocks and the whole forward
        read the descriptors. Runs at construction and whenever the parameters
        are replaced (`pack_for_cpu`, `to`, which keep a `name` given here):
        never per forward."""
        self.backend_name = name
        backend = self.backend = backends.select(self.device, self.dtype, name,
                                                 sharded=self.tensor_parallel is not None, compute=self.compute)
        for module in self.modules():
            if isinstance(module, Kernelled):
                module.ops = backend
        desc = self.describe()
        blocks = [backend.blocks_of(layer) for layer in desc.layers]
        for layer, layer_blocks in zip(self.layers, blocks):
            layer.blocks = layer_blocks
        self.whole = backend.whole_forward_of(desc, blocks)
        self.greedy_chain = GreedyChain(self, self.whole) if backend.whole_forward else None

    def release_bindings(self) -> None:
        """Drop what `bind_backend` made (its descriptors point at the weights and keep them alive):
        a caller replacing the weights one at a time then lets each old one go as it goes, and runs
        `bind_backend` before the next forward."""
        for layer in self.layers:
            layer.blocks = backends.NO_BLOCKS
        self.whole, self.greedy_chain = backends.NO_WHOLE_FORWARD, None

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: the final norm's (the embedding and linear weights
        may be stored in 16 bits, `pack_for_cpu`)."""
        return self.final_norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def recurrent_layers(self) -> list[RecurrentLayer]:
        """The layers with recurrent state, in state-pool order (`state_layer` 0, 1, …)."""
        return [self.layers[i].recurrent for i in self.config.mamba_layers]

    @staticmethod
    def compute_for(compute: str | torch.dtype | None, device, dtype: torch.dtype | None) -> torch.dtype:
        """The products' compute `set_compute(compute)` takes for a model on `device` in `dtype`
        (`kernels.backend.check_compute`): a ConfigError where it cannot run, before a model is
        loaded or changed."""
        return backends.check_compute(compute, device, dtype)

    def set_compute(self, compute: str | torch.dtype | None) -> "HybridModel":
        """What the products (the linear layers, the LM head) multiply in: "float32"
        (None, the default: exact, bfloat16 weights widened as they load) or
        "bfloat16", the opt-in fast path on CPUs with AVX512-BF16: each product's
        activations rounded to bfloat16 and multiplied by bfloat16 weights with the
        CPU's BF16 dot product, float32 sums (`kernels/cpu/rows_bf16.c`). Close to
        float32, not its bits; within the path a row's bits do not depend on the other
        rows of its call nor on the thread count, so speculative output equals plain
        output and batches do not change a row. With "bfloat16" a product weight that
        is not a bfloat16 value is rounded to one (stored bf16 weights are already),
        and stays rounded after a later "float32". A ConfigError
        (`backend.check_compute`) before anything changes for an unknown value, a
        GPU, a non-float32 model or a CPU without AVX512-BF16. Returns self."""
        compute = self.compute_for(compute, self.device, self.dtype)
        self.compute = compute
        if compute is torch.bfloat16:
            return self.pack_for_cpu()  # the weights in bfloat16, rebound
        self.bind_backend(self.backend_name)
        return self

    def pack_for_cpu(self, exact_16bit: bool = True) -> "HybridModel":
        """Lay every linear weight out for the CPU's products: where the backend's
        products read panels (the native kernels, a float32 model) each 2-d one as
        a `kernels.panels.PanelWeight` (the layout a decode step streams fastest),
        else input-major ([out, in] with its transpose contiguous: one-row products
        then stream the weight in the order MKL's kernel reads fastest); a MoE's
        experts input-major. Values and outputs' meaning are unchanged.

        With `exact_16bit` (default), a float32 linear weight or embedding whose
        every value is a bfloat16 value (weights stored in bf16 and loaded
        as float32, as most hybrid models ship), or else a float16 value
        (mamba_ssm's fp16 weights), is stored in that type: the native
        products widen each weight exactly as they load it and the embedding
        lookup widens its rows, so the logits are the same bits from half the
        weight memory, and a decode step that streams its weights from
        memory reads half the bytes (`kernels/cpu/rows.c`, "weight storage";
        torch's products widen a copy). Only where the native CPU kernels run
        (the backend's products read them: `Backend.reads_16bit_weights`): elsewhere every weight is float32. The
        compute dtype (`dtype`) stays the final norm's; norms, biases and the
        other vectors keep theirs, and so does a weight that something other
        than a linear layer or the embedding also uses.

        The packed weights are copies: a model from `from_hf` stops sharing them
        with the HF model (one more copy while that lives); `load` packs on CPU
        by default, where nothing else holds them. On CPU they lie side by side in
        memory advised for transparent huge pages (`kernels/huge_pages.py`: a
        decode step streams them all), each call moving all of them. Tied weights stay tied. Under
        `set_compute("bfloat16")` every such linear weight is stored in bfloat16,
        rounded where it is not one. Returns self."""
        packing.pack(self, exact_16bit)
        return self

    def quantize(self, fmt: str) -> "HybridModel":
        """Quantize the decoder layers' linear weights (and the LM head, in Q8_0) into the GGUF block
        format `fmt` ("q8_0", "q4_0", "q4_k"; `models.quantizing` says which weights and why): the
        native backend's products then multiply them with activations rounded to int8 blocks
        (`kernels/cpu/quant.c`) in the native blocks, the whole forward and layer by layer alike;
        torch's on the same values elsewhere. A ConfigError before anything changes for an unknown
        format, a non-CPU or non-float32 model, or a shard. Not undone. Returns self."""
        quantizing.quantize(self, formats.format_named(fmt))
        return self

    def _apply(self, fn, recurse=True):
        """`nn.Module.to` and kin, then the backend of the new device and dtype: weights in panels
        are unpacked first (`fn` sees plain [out, in] tensors) and packed again where the new backend's
        products read panels; a float32 model whose new backend's products do not read 16-bit weights
        widens those `pack_for_cpu` kept (torch's products would widen them per call)."""
        had_panels = packing.unpack_panels(self)
        super()._apply(fn, recurse)
        self.bind_backend(self.backend_name)
        if self.dtype is torch.float32 and not self.backend.reads_16bit_weights and packing.has_16bit(self):
            packing.widen_16bit(self)
            self.bind_backend(self.backend_name)
        if had_panels and self.dtype is torch.float32 and self.backend.reads_panels:
            self.pack_for_cpu(exact_16bit=packing.has_16bit(self))
        return self

    def num_parameters(self) -> int:
        # by storage: a shared block's weights back one Parameter per occurrence
        return sum(p.out_features * p.in_features if isinstance(p, (PanelWeight, QuantWeight)) else p.numel()
                   for p in {(p.data_ptr(), p.shape): p for p in self.parameters()}.values())

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, cache, last_only: bool = False) -> torch.Tensor:
        """input_ids [batch, T] -> logits [batch, T or 1, vocab]; `last_only` keeps
        each row's logits at its last valid input."""
        bsz, T = input_ids.shape
        h = self.embed_tokens(input_ids.view(-1)).view(bsz, T, -1)  # [batch, T, hidden]
        if self.config.embedding_multiplier != 1.0:
            h = h * self.config.embedding_multiplier
        embeddings = h
        capture = batch.hidden
        kept = [] if capture is not None else None  # [batch, T, hidden] at each captured point
        for i, layer in enumerate(self.layers):
            if capture is not None and i in capture.points:
                kept.append(h)
            h = layer(h, batch, cache, embeddings)
        if capture is not None:
            capture.values = torch.stack(kept + [h] * (len(self.layers) in capture.points), 2)  # [batch, T, k, hidden]
        if last_only and T > 1:
            h = h.view(bsz * T, -1).index_select(0, batch.slots.last_index).view(bsz, 1, -1)
        return self.head(h)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings [n, hidden] (in the model's dtype) of token ids [n]; a
        vocab-parallel shard looks up the ids in its rows, zeros for the others,
        and sums over the ranks (one row is not zero: exact)."""
        if self.vocab_shard is None:
            return self._widened(self._table_rows(ids))
        start, rows = self.vocab_shard
        local = ids - start
        mine = (local >= 0) & (local < rows)
        h = self._widened(self._table_rows(local.clamp(0, rows - 1)))
        return self.tensor_parallel.all_reduce(h.masked_fill(~mine.unsqueeze(-1), 0))

    def _table_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the embedding table (the panels of an LM head it is tied to, `pack_for_cpu`;
        a quantized table's rows dequantized, those rows only)."""
        if isinstance(self.embed, PanelWeight):
            return panels.rows(self.embed, ids)
        if isinstance(self.embed, QuantWeight):
            return self.embed.rows(ids)
        return self.embed.index_select(0, ids)

    def _widened(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of a 16-bit table (`pack_for_cpu`) in the model's dtype (exact); others as they are."""
        return rows if rows.dtype == self.dtype else rows.to(self.dtype)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The logits [..., vocab] of final hidden states h [..., hidden]: final norm, LM head, scaling;
        a vocab-parallel shard's rows gathered from every rank."""
        logits = self.ops.linear(self.final_norm(h), self.lm_head)
        if self.vocab_shard is not None:
            logits = self.tensor_parallel.all_gather(logits)[..., :self.config.vocab_size]
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return logits

    # -- entry points -------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, cache, seq_ids: list[int], token_lists: list[list[int]], last_only: bool = False) -> torch.Tensor:
        """Run prompts from an empty state; returns logits [batch, T | 1, vocab]."""
        cache.add_sequences(seq_ids)
        try:
            return self.extend(cache, seq_ids, token_lists, last_only=last_only)
        except Exception:
            cache.free_sequences(seq_ids)
            raise

    @torch.inference_mode()
    def extend(self, cache, seq_ids: list[int], token_lists: list[list[int]], last_only: bool = False,
               snap_slot: torch.Tensor | list[list[int]] | None = None,
               input_log: InputLog | None = None, tree: TreeBatch | None = None) -> torch.Tensor:
        """Continue each sequence from its computed length over `token_lists[b]`.

        Without `snap_slot` the final state is written to a spare ring slot and
        becomes the head on success (a failed forward leaves every state as it
        was). With `snap_slot` ([batch, T], a tensor or lists) the caller owns the snapshot plan and
        the commit (speculative verification); `input_log`, when given, receives
        each Mamba layer's inputs. With `tree` (`cache.tree_batch`) the inputs
        form that tree: each input's state goes to its `snap_slot` (the whole C
        forward where it takes the tree, else the tree forms layer by layer,
        which also leave every input's state in `tree` when it keeps them);
        the caller commits (`Checkpointer.commit_tree`).

        A sequence's logits do not depend on the others of the call: where the
        native blocks run, a call mixing sequences of more inputs than they take
        (`Backend.block_inputs`) with sequences of at most that many runs as
        several forwards, each sequence on the path it takes alone, the shorter
        ones in groups of at most `Backend.block_call_rows` padded rows, all
        committed together."""
        if tree is not None and snap_slot is None:  # the caller commits a tree forward
            snap_slot = [[-1] * max(map(len, token_lists)) for _ in token_lists]
        parts = self._parts(token_lists) if snap_slot is None else None
        if parts is None:
            plan = cache.plan_forward(seq_ids, [len(t) for t in token_lists], snap_slot, tree)
            logits = self._run(cache, plan, token_lists, last_only, input_log)
            if snap_slot is None:
                cache.commit_forward(plan)
            return logits
        plans, outs = [], []
        try:
            for rows in parts:
                tokens = [token_lists[b] for b in rows]
                plans.append(cache.plan_forward([seq_ids[b] for b in rows], [len(t) for t in tokens], None))
                outs.append(self._run(cache, plans[-1], tokens, last_only, None))
        except Exception:
            for plan in plans[:len(outs)]:  # the failed part's own plan is aborted by `_run` or never made
                cache.abort_forward(plan)
            raise
        for plan in plans:
            cache.commit_forward(plan)
        T = 1 if last_only else max(map(len, token_lists))
        logits = outs[0].new_zeros(len(seq_ids), T, outs[0].shape[-1])  # [batch, T | 1, vocab]
        for rows, out in zip(parts, outs):
            logits[rows, :out.shape[1]] = out
        return logits

    def _parts(self, token_lists: list[list[int]]) -> list[list[int]] | None:
        """The batch rows of each forward of a plain call (`extend`): groups of the
        sequences the native blocks take, then the longer ones; None where the
        call runs as one forward."""
        limit = self.backend.block_inputs
        if limit is None:
            return None
        parts, group, longest = [], [], 0
        for b, tokens in enumerate(token_lists):
            if len(tokens) > limit:
                continue
            if group and (len(group) + 1) * max(longest, len(tokens)) > self.backend.block_call_rows:
                parts.append(group)
                group, longest = [], 0
            group.append(b)
            longest = max(longest, len(tokens))
        parts += [group] if group else []
        longer = [b for b, tokens in enumerate(token_lists) if len(tokens) > limit]
        parts += [longer] if longer else []
        return parts if len(parts) > 1 else None

    def _run(self, cache, plan, token_lists: list[list[int]], last_only: bool,
             input_log: InputLog | None) -> torch.Tensor:
        """The forward of `plan` (made by `cache.plan_forward`), uncommitted: a
        captured graph, one native call, or layer by layer; aborts the plan if it raises."""
        batch = plan.batch
        batch.input_log = input_log
        graphs = cache.graphs  # captured CUDA graphs of the few-input forwards (`models.graphs`), or None
        try:
            if graphs is not None and batch.hidden is None and batch.tree is None and graphs.takes(plan) and (
                    graphed := graphs.run(plan, token_lists, last_only, input_log)) is not None:
                logits, finite = graphed, False
            elif (whole := self.whole(token_lists, batch, cache, last_only)) is not None:
                logits, finite = whole.values, whole.finite  # one C call, where it applies (a tree's too)
                if batch.tree is not None:
                    batch.tree.in_ring = True  # the C forward wrote every input's state to its slot
            else:  # layer by layer (a tree forward: the backend's tree forms)
                with self.backend.torch_beside_kernels():
                    logits = self(plan.pad_tokens(token_lists, self.device), batch, cache, last_only)
                finite = False
            if not finite:
                check_finite(logits, batch.num_tokens, last_only)
            cache.record_hidden(plan)
            self.forward_done()
        except Exception:
            cache.abort_forward(plan)
            raise
        return logits

    def forward_done(self, forwards: int = 1) -> None:
        """Called once `forwards` forwards' writes are made and before the caller
        commits them, whichever path computed them (the layers, one native call,
        a captured graph, the greedy chain): the one seam where the rollback
        checker injects its faults (`rollback.observer.install_fault`). Does nothing."""

    def decode(self, cache, seq_ids: list[int], tokens: list[int]) -> torch.Tensor:
        """One token per sequence; returns logits [batch, vocab]."""
        return self.extend(cache, seq_ids, [[t] for t in tokens], last_only=True)[:, 0]
