"""`MTPLayer`: a checkpoint's multi-token-prediction (MTP) layer, the drafter
Qwen3-Next and Qwen3.5 ship (`mtp.*`; DeepSeek-V3's MTP, one module).

At position i it reads the target's hidden state h_i (the last layer's
output, before the final norm) and the embedding of the next token t_{i+1},
and predicts t_{i+2}:

    x_i   = fc([norm_e(embed(t_{i+1})) ; norm_h(h_i)])     fc: [hidden, 2·hidden]
    y_i   = decoder_layer(x_i)                              attention (own K/V) + MLP or MoE
    o_i   = norm(y_i);  logits_i = lm_head(o_i)

The embedding and LM head are the target's own (shared, never copied). For
more than one draft the layer runs again on its own output, o_i standing in
for the target's h (as the anchors apply it). Its attention keeps paged K/V in
a `HybridCache` of one attention layer (`config`), rolled back by length.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.config import HybridConfig
from hybridspec.errors import ConfigError
from hybridspec.kernels import backend as backends
from hybridspec.kernels.cpu import panels
from hybridspec.kernels.cpu.panels import PanelWeight
from hybridspec.kernels.descriptors import ModelDesc, MTPInput
from hybridspec.models.attention import rope_inv_freq
from hybridspec.models.common import Kernelled, RMSNorm, check_finite, param, take
from hybridspec.models.hybrid import DecoderLayer, HybridModel
from hybridspec.models.packing import LINEAR_WEIGHTS


def mtp_config(target: HybridConfig) -> HybridConfig:
    """One decoder layer of the target's attention and its last layer's feed-forward."""
    if target.attention is None:
        raise ConfigError(f"a {target.family} target has no attention layers; an MTP layer is an attention "
                          "layer of the target's kind, so this target cannot carry one")
    ffn = target.ffn_types[-1]
    if ffn == "none":
        raise ConfigError(f"the {target.family} target's last layer has no feed-forward, so the MTP layer's "
                          "cannot be inferred; hybridspec reads MTP layers of Qwen3-Next and Qwen3.5 layout")
    return dataclasses.replace(target, layer_types=("attention",), ffn_types=(ffn,), mamba2=None, mamba1=None,
                               gdn=None, parallel=None, shared_blocks=None,
                               mlp=target.mlp if ffn == "mlp" else None, moe=target.moe if ffn == "moe" else None,
                               family=f"{target.family}_mtp")


class DraftHead(Kernelled, nn.Module):
    """What a drafter layer over the target's hidden states shares (`MTPLayer`, `Eagle3Head`): its K/V
    cache, its device and dtype (its `norm`'s), and `extend` — one forward over a plan of its own cache,
    committed when it succeeds, aborted when it raises. A subclass writes `_forward(plan, token_lists,
    hidden_lists, cache) -> (logits [batch, V], out [batch, hidden])` and may map the logits
    (`target_logits`)."""

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def new_cache(self, **cache_kwargs) -> HybridCache:
        """A cache of this head's K/V (`cache_kwargs`: HybridCache's sizes)."""
        return HybridCache(self.config, ring_slots=1, **dict(cache_kwargs, dtype=self.dtype, device=self.device))

    @torch.inference_mode()
    def extend(self, cache: HybridCache, seq_ids: list[int], token_lists: list[list[int]],
               hidden_lists: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorb `token_lists[b]` (t_{i+1}) beside `hidden_lists[b]` ([n_b, hidden]: the state read
        beside each token) at each sequence's next positions; returns each row's last input's
        (logits [batch, target vocab], out [batch, hidden]: what the next step reads)."""
        plan = cache.plan_forward(seq_ids, [len(t) for t in token_lists], None)
        try:
            logits, out = self._forward(plan, token_lists, hidden_lists, cache)
            check_finite(logits.unsqueeze(1), plan.batch.num_tokens, True)
        except Exception:
            cache.abort_forward(plan)
            raise
        cache.commit_forward(plan)
        return self.target_logits(logits), out

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits over the target's vocabulary (a head over the target's own: themselves)."""
        return logits


class MTPLayer(DraftHead):
    """The MTP layer over `target` (its embedding and LM head) from canonical
    `weights`: fc.weight, pre_fc_norm_embedding.weight, pre_fc_norm_hidden.weight,
    norm.weight and layers.0.* (a decoder layer in the target family's canonical names)."""

    def __init__(self, target: HybridModel, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.config = config = mtp_config(target.config)
        eps, zero = config.rms_norm_eps, config.zero_centred_norms
        self.target = [target]  # a list: the target is not one of this module's submodules
        self.fc = param(weights["fc.weight"])  # [hidden, 2·hidden]
        self.norm_embedding = RMSNorm(weights["pre_fc_norm_embedding.weight"], eps, zero)
        self.norm_hidden = RMSNorm(weights["pre_fc_norm_hidden.weight"], eps, zero)
        inv_freq = rope_inv_freq(config.attention) if config.attention.use_rope else None
        self.layer = DecoderLayer(config, 0, take(weights, "layers.0"), inv_freq)
        self.norm = RMSNorm(weights["norm.weight"], eps, zero)
        self.bind_backend()

    def bind_backend(self) -> None:
        """Compute through the target's backend's ops: the decoder layer's native blocks where they run
        (a float32 CPU: its product weights and fc laid out in panels first), else the modules one by one."""
        backend = backends.select(self.device, self.dtype, self.target[0].backend_name)
        if self.dtype is torch.float32 and backend.reads_panels:
            self._pack_panels()
        for module in self.modules():
            if isinstance(module, Kernelled):
                module.ops = backend
        self.layer.blocks = backend.blocks_of(self.layer.describe())
        target = self.target[0]
        desc = ModelDesc(embed=target.embed, layers=(self.layer.describe(),), final_norm=self.norm.describe(),
                         lm_head=target.lm_head, embedding_multiplier=target.config.embedding_multiplier,
                         logits_scaling=target.config.logits_scaling, dtype=self.dtype)
        self.whole = backend.whole_forward_of(desc, [self.layer.blocks])  # a step in one C call, where it runs

    def _pack_panels(self) -> None:
        """Each 2-d product weight (the fc, the layer's projections) in panels, the layout the native
        few-row products stream (`kernels.cpu.panels`); values unchanged."""
        for module in self.modules():
            for name, weight in list(module.named_parameters(recurse=False)):
                if (name in LINEAR_WEIGHTS or module is self and name == "fc") and weight.dim() == 2 \
                        and not isinstance(weight, PanelWeight):
                    stored = torch.zeros(panels.panel_shape(*weight.shape, torch.float32), device=self.device)
                    setattr(module, name, panels.pack(weight.detach(), stored))

    def _forward(self, plan, token_lists, hidden_lists, cache) -> tuple[torch.Tensor, torch.Tensor]:
        target = self.target[0]
        bsz, T = len(token_lists), max(map(len, token_lists))
        h = torch.zeros(bsz, T, target.config.hidden_size, dtype=self.dtype, device=self.device)  # [batch, T, hidden]
        for b, rows in enumerate(hidden_lists):
            h[b, :len(rows)] = rows.to(self.dtype)
        out = torch.empty(bsz, target.config.hidden_size, dtype=self.dtype, device=self.device)  # [batch, hidden]
        whole = self.whole(token_lists, plan.batch, cache, True,
                           MTPInput(self.fc, self.norm_embedding.weight, self.norm_hidden.weight,
                                    self.config.rms_norm_eps, h, out))
        if whole is not None:  # one C call: the input stage, the layer, the norm and the LM head
            return whole.values[:, 0], out
        ids = plan.pad_tokens(token_lists, self.device)  # [batch, T]
        e = target.embed_tokens(ids.view(-1)).view(bsz, T, -1)  # [batch, T, hidden]
        if target.config.embedding_multiplier != 1.0:
            e = e * target.config.embedding_multiplier
        x = self.ops.linear(torch.cat([self.norm_embedding(e), self.norm_hidden(h)], -1), self.fc)
        y = self.layer(x, plan.batch, cache, e)
        last = y.view(bsz * T, -1).index_select(0, plan.batch.slots.last_index)  # [batch, hidden]
        out = self.norm(last)
        logits = self.ops.linear(out, target.lm_head)
        if target.config.logits_scaling != 1.0:
            logits = logits / target.config.logits_scaling
        return logits, out
