"""Split a model's canonical weights (`hybridspec.adapters`' names) for one
tensor-parallel rank, and its config to that rank's sizes.

How each kind is split over `size` ranks (rank r takes the r-th of `size`
equal slices of what is split):
- attention: by KV-head groups: q/k/v rows (column-parallel) of the rank's
  query heads and their KV heads, o_proj columns (row-parallel);
- Mamba-2: by heads: the z, x and dt rows of in_proj, the x channels of the
  conv, dt_bias, A_log, D, the norm weight and out_proj's columns; B and C
  (rows of in_proj and conv channels) by groups when the ranks divide them,
  every rank holding all of them with one group (the heads of a group share
  its B and C); the gated RMSNorm's variance is summed across ranks when its
  group spans them (`Mamba2Config.norm_shards`);
- gated DeltaNet: by key-head groups: each rank its key heads and the value
  heads that read them (value head j reads key head j // (HV/HK)): the q, k,
  v, z, b and a rows of the fused in_proj, the q, k, v conv channels, dt_bias,
  A_log and out_proj's columns; the gated norm's weight is per value head's
  channels and shared by every head, so it is replicated and needs no sum;
- gated attention (Qwen3-Next, Qwen3.5): as attention, q_proj's rows per head
  being that head's query and then its gate; the q and k norms act within one
  head, so they are replicated and stay local;
- Mamba-1: by d_inner channels (x_proj is row-parallel: its dt, B, C are summed
  across ranks before the inner norms);
- MLP (Megatron): gate/up rows, down columns;
- MoE: by expert columns, every expert split like an MLP on every rank: the
  router and its choice are replicated, so routing needs no exchange and no
  rank waits for another's experts (an expert-parallel split would move tokens
  between ranks and balance only on average); a shared expert's sigmoid gate
  is replicated (one scalar per token, the same on every rank, scales each
  rank's partial sum);
- embeddings and the LM head: vocab-parallel, by rows (tied or not): each
  rank looks up the ids in its rows and the ranks sum the lookups, and each
  computes its rows' logits, gathered on every rank (`HybridModel.vocab_shard`);
  a vocabulary the ranks do not divide is padded with zero rows that the
  gathered logits drop. Every rank samples from the same gathered logits.
  Measured against replicated ones in docs/results/tensor_parallel.md;
- norms: replicated.
A row-parallel bias is kept on rank 0 only (the sum adds it once).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from hybridspec.config import AttentionConfig, GdnConfig, HybridConfig, Mamba1Config, Mamba2Config, MoEConfig
from hybridspec.errors import ConfigError


def shard_weights(config: HybridConfig, weights: dict[str, torch.Tensor], rank: int,
                  size: int) -> tuple[HybridConfig, dict[str, torch.Tensor]]:
    """(the config of rank `rank`'s shard, its weights); `weights` is read, never changed."""
    if size == 1:
        return config, weights
    out = dict(weights)
    split = _Split(rank, size)
    if config.shared_blocks is not None:
        _shared_blocks(out, config, split)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name in out:
            out[name] = _vocab_rows(out[name], split)
    for i, (mixer, ffn) in enumerate(zip(config.layer_types, config.ffn_types)):
        prefix = f"layers.{i}."
        if mixer in ("attention", "parallel"):
            _attention(out, prefix + ("mixer.attention." if mixer == "parallel" else "mixer."), config.attention,
                       split)
        if mixer in ("mamba2", "parallel"):
            _mamba2(out, prefix + ("mixer.mamba." if mixer == "parallel" else "mixer."), config.mamba2, split)
        if mixer == "mamba1":
            _mamba1(out, prefix + "mixer.", config.mamba1, split)
        if mixer == "gdn":
            _gdn(out, prefix + "mixer.", config.gdn, split)
        if ffn == "mlp":
            _mlp(out, prefix + "ffn.", config.mlp.intermediate_size, split)
        elif ffn == "moe":
            _moe(out, prefix + "ffn.", config.moe, split)
    return _config(config, split), out


class _Split:
    """Rank r of `size`: the r-th slice of a dimension split evenly."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def part(self, total: int, field: str) -> tuple[int, int]:
        """[start, stop) of this rank's share of `total` (a config `field`, named in the error)."""
        if total % self.size:
            raise ConfigError(f"{field}={total} is not divisible by tensor_parallel_size={self.size}; choose a "
                              f"tensor_parallel_size that divides it")
        share = total // self.size
        return self.rank * share, (self.rank + 1) * share


def _take(t: torch.Tensor, spans: list[tuple[int, int]], dim: int = 0) -> torch.Tensor:
    """The slices `spans` of `t` along `dim`, one after another (a copy: the full tensor can go)."""
    return torch.cat([t.narrow(dim, a, b - a) for a, b in spans], dim=dim).clone()


def vocab_rows(vocab: int, size: int) -> int:
    """The embedding / LM-head rows each of `size` ranks holds: the vocabulary
    split evenly, padded up to a multiple of `size`."""
    return -(-vocab // size)


def _vocab_rows(weight: torch.Tensor, split: _Split) -> torch.Tensor:
    """This rank's rows of a [vocab, hidden] table, zero rows past the vocabulary."""
    rows = vocab_rows(weight.shape[0], split.size)
    start = split.rank * rows
    mine = weight[start:start + rows]
    if mine.shape[0] == rows:
        return mine.clone()
    return torch.cat([mine, mine.new_zeros(rows - mine.shape[0], weight.shape[1])])


def _rows(out: dict, name: str, spans, dim: int = 0) -> None:
    if name in out:
        out[name] = _take(out[name], spans, dim)


def _rank0_bias(out: dict, name: str, split: _Split) -> None:
    """A row-parallel product's bias: added once, by rank 0."""
    if name in out and split.rank:
        out[name] = torch.zeros_like(out[name])


def _attention(out: dict, p: str, cfg: AttentionConfig, split: _Split) -> None:
    q = split.part(cfg.num_heads, "attention num_heads")
    kv = split.part(cfg.num_kv_heads, "attention num_kv_heads")
    q_span, kv_span = [(q[0] * cfg.head_dim, q[1] * cfg.head_dim)], [(kv[0] * cfg.head_dim, kv[1] * cfg.head_dim)]
    per_query = 2 * cfg.head_dim if cfg.output_gate else cfg.head_dim  # a gated head's rows: its query, its gate
    for name, span in (("q_proj", [(q[0] * per_query, q[1] * per_query)]), ("k_proj", kv_span), ("v_proj", kv_span)):
        _rows(out, f"{p}{name}.weight", span)
        _rows(out, f"{p}{name}.bias", span)
    _rows(out, p + "o_proj.weight", q_span, dim=1)
    _rank0_bias(out, p + "o_proj.bias", split)


def _mamba2_spans(cfg: Mamba2Config, split: _Split):
    """(this rank's channels of d_inner, of its heads, of its groups' d_state rows) as spans."""
    h0, h1 = split.part(cfg.num_heads, "mamba2 num_heads")
    if cfg.n_groups % split.size == 0:
        g0, g1 = split.part(cfg.n_groups, "mamba2 n_groups")
    elif cfg.n_groups == 1:
        g0, g1 = 0, 1  # one group: every rank's heads read its B and C
    else:
        raise ConfigError(f"mamba2 n_groups={cfg.n_groups} is neither 1 nor divisible by tensor_parallel_size="
                          f"{split.size}; choose a tensor_parallel_size that divides it")
    return (h0 * cfg.head_dim, h1 * cfg.head_dim), (h0, h1), (g0 * cfg.d_state, g1 * cfg.d_state)


def _mamba2(out: dict, p: str, cfg: Mamba2Config, split: _Split) -> None:
    (c0, c1), (h0, h1), (s0, s1) = _mamba2_spans(cfg, split)
    d, bc = cfg.d_inner, cfg.n_groups * cfg.d_state
    # in_proj rows: [z | x | B | C | dt]; conv channels: [x | B | C]
    in_spans = [(c0, c1), (d + c0, d + c1), (2 * d + s0, 2 * d + s1), (2 * d + bc + s0, 2 * d + bc + s1),
                (2 * d + 2 * bc + h0, 2 * d + 2 * bc + h1)]
    conv_spans = [(c0, c1), (d + s0, d + s1), (d + bc + s0, d + bc + s1)]
    for name in ("in_proj.weight", "in_proj.bias"):
        _rows(out, p + name, in_spans)
    for name in ("conv1d.weight", "conv1d.bias"):
        _rows(out, p + name, conv_spans)
    for name in ("dt_bias", "A_log", "D"):
        _rows(out, p + name, [(h0, h1)])
    _rows(out, p + "norm.weight", [(c0, c1)])
    _rows(out, p + "out_proj.weight", [(c0, c1)], dim=1)
    _rank0_bias(out, p + "out_proj.bias", split)


def _gdn(out: dict, p: str, cfg: GdnConfig, split: _Split) -> None:
    k0, k1 = split.part(cfg.num_key_heads, "gdn num_key_heads")
    per_key = cfg.num_value_heads // cfg.num_key_heads
    h0, h1 = k0 * per_key, k1 * per_key  # the value heads of this rank's key heads
    kd, vd, dk, dv = cfg.key_dim, cfg.value_dim, cfg.key_head_dim, cfg.value_head_dim
    q, k, v = (k0 * dk, k1 * dk), (kd + k0 * dk, kd + k1 * dk), (2 * kd + h0 * dv, 2 * kd + h1 * dv)
    conv = [q, k, v]  # conv channels: [q | k | v]
    # in_proj rows: [q | k | v | z | b | a]
    z, b, a = (cfg.conv_dim + h0 * dv, cfg.conv_dim + h1 * dv), (cfg.conv_dim + vd + h0, cfg.conv_dim + vd + h1), \
        (cfg.conv_dim + vd + cfg.num_value_heads + h0, cfg.conv_dim + vd + cfg.num_value_heads + h1)
    _rows(out, p + "in_proj.weight", conv + [z, b, a])
    for name in ("conv1d.weight", "conv1d.bias"):
        _rows(out, p + name, conv)
    for name in ("dt_bias", "A_log"):
        _rows(out, p + name, [(h0, h1)])
    _rows(out, p + "out_proj.weight", [(h0 * dv, h1 * dv)], dim=1)


def _mamba1(out: dict, p: str, cfg: Mamba1Config, split: _Split) -> None:
    c0, c1 = split.part(cfg.d_inner, "mamba1 d_inner")
    d = cfg.d_inner
    for name in ("in_proj.weight", "in_proj.bias"):  # rows [x | z]
        _rows(out, p + name, [(c0, c1), (d + c0, d + c1)])
    for name in ("conv1d.weight", "conv1d.bias", "dt_proj.weight", "dt_proj.bias", "A_log", "D"):
        _rows(out, p + name, [(c0, c1)])
    _rows(out, p + "x_proj.weight", [(c0, c1)], dim=1)
    _rows(out, p + "out_proj.weight", [(c0, c1)], dim=1)
    _rank0_bias(out, p + "out_proj.bias", split)


def _mlp(out: dict, p: str, intermediate: int, split: _Split, field: str = "intermediate_size") -> None:
    span = [split.part(intermediate, field)]
    for name in ("gate_proj", "up_proj"):
        _rows(out, f"{p}{name}.weight", span)
        _rows(out, f"{p}{name}.bias", span)
    _rows(out, p + "down_proj.weight", span, dim=1)
    _rank0_bias(out, p + "down_proj.bias", split)


def _moe(out: dict, p: str, cfg: MoEConfig, split: _Split) -> None:
    i0, i1 = split.part(cfg.intermediate_size, "moe intermediate_size")
    size = cfg.intermediate_size
    _rows(out, p + "experts.gate_up_proj", [(i0, i1), (size + i0, size + i1)], dim=1)  # [E, 2I, hidden]: gate, up
    _rows(out, p + "experts.up_proj", [(i0, i1)], dim=1)
    _rows(out, p + "experts.down_proj", [(i0, i1)], dim=2)  # [E, hidden, I]
    if cfg.shared_intermediate_size:
        _mlp(out, p + "shared.", cfg.shared_intermediate_size, split, "moe shared_intermediate_size")


def _shared_blocks(out: dict, config: HybridConfig, split: _Split) -> None:
    """Zamba2's shared blocks: each block's attention and MLP as the layers' are
    split; each occurrence's LoRA adapters by their up rows (the down matrices,
    rank r wide, on every rank), like the rows they add to; its output linear
    (hidden x hidden, after the MLP's summed output) on every rank."""
    shared, a = config.shared_blocks, config.attention
    for b in range(shared.num_blocks):
        _attention(out, f"shared_blocks.{b}.attention.", a, split)
        _mlp(out, f"shared_blocks.{b}.ffn.", shared.mlp.intermediate_size, split, "shared block intermediate_size")
    q0, q1 = split.part(a.num_heads, "attention num_heads")
    k0, k1 = split.part(a.num_kv_heads, "attention num_kv_heads")
    i0, i1 = split.part(shared.mlp.intermediate_size, "shared block intermediate_size")
    rows = {"q": [(q0 * a.head_dim, q1 * a.head_dim)], "k": [(k0 * a.head_dim, k1 * a.head_dim)],
            "v": [(k0 * a.head_dim, k1 * a.head_dim)],
            "gate_up": [(i0, i1), (shared.mlp.intermediate_size + i0, shared.mlp.intermediate_size + i1)]}
    for i in shared.occurrences:
        for name, spans in rows.items():
            _rows(out, f"layers.{i}.shared.adapters.{name}.up.weight", spans)


def _config(config: HybridConfig, split: _Split) -> HybridConfig:
    """The sizes one rank's shard has."""
    changes = {}
    if config.attention is not None:
        a = config.attention
        changes["attention"] = replace(a, num_heads=a.num_heads // split.size, num_kv_heads=a.num_kv_heads // split.size)
    if config.mamba2 is not None:
        changes["mamba2"] = _mamba2_config(config.mamba2, split)
    if config.gdn is not None:
        g = config.gdn
        changes["gdn"] = replace(g, num_key_heads=g.num_key_heads // split.size,
                                 num_value_heads=g.num_value_heads // split.size)
    if config.mamba1 is not None:
        changes["mamba1"] = replace(config.mamba1, d_inner=config.mamba1.d_inner // split.size)
    if config.mlp is not None:
        changes["mlp"] = replace(config.mlp, intermediate_size=config.mlp.intermediate_size // split.size)
    if config.moe is not None:
        m = config.moe
        changes["moe"] = replace(m, intermediate_size=m.intermediate_size // split.size,
                                 shared_intermediate_size=m.shared_intermediate_size // split.size)
    if config.shared_blocks is not None:
        sb = config.shared_blocks
        changes["shared_blocks"] = replace(sb, mlp=replace(sb.mlp, intermediate_size=sb.mlp.intermediate_size
                                                           // split.size))
    return replace(config, **changes)


def _mamba2_config(cfg: Mamba2Config, split: _Split) -> Mamba2Config:
    heads = cfg.num_heads // split.size
    groups = cfg.n_groups // split.size if cfg.n_groups % split.size == 0 else 1
    local, group = heads * cfg.head_dim, cfg.group_size
    if cfg.norm == "gate_only" or local % group == 0:  # each norm group within one rank
        return replace(cfg, num_heads=heads, n_groups=groups, norm_group_size=group)
    if group == cfg.d_inner:  # one group over every rank's channels
        return replace(cfg, num_heads=heads, n_groups=groups, norm_group_size=local, norm_shards=split.size)
    raise ConfigError(f"mamba2 norm_group_size={group} spans some but not all of tensor_parallel_size="
                      f"{split.size} ranks' {local} channels each; choose a tensor_parallel_size whose shards hold "
                      "whole norm groups")
