"""`Eagle3Head`: an EAGLE-3 draft head (Li et al. 2025), the decoder layer
trained on a target's hidden states at three of its layers.

At position i it reads the target's hidden states at three points (low,
middle, high: `points`, each the residual stream entering that layer) and the
embedding of the next token t_{i+1}, and predicts t_{i+2}:

    g_i   = fc([h_low ; h_mid ; h_high])                    fc: [hidden, 3·target_hidden]
    x_i   = [input_norm(embed(t_{i+1})) ; hidden_norm(g_i)] width 2·hidden: the attention reads it
    r_i   = g_i + attention(x_i)                            (hidden_norm(g_i) when norm_before_residual)
    y_i   = r_i + mlp(post_norm(r_i))                       the pre-norm output, fed back for the next draft
    logits_i = lm_head(norm(y_i))                           over the draft vocabulary, Vd entries

The draft vocabulary maps into the target's: draft id j is target id
j + d2t[j]; the target's other ids get logit -inf (probability 0). For more
than one draft the head runs again on its own y standing in for g (no fc), as
EAGLE-3 applies it. The embedding is the target's unless the head ships one.
Its attention keeps paged K/V in a `HybridCache` of one attention layer
(`config`), rolled back by length.
"""
from __future__ import annotations

import torch

from hybridspec.config import HybridConfig
from hybridspec.kernels import backend as backends
from hybridspec.models.attention import Attention, rope_inv_freq
from hybridspec.models.common import Kernelled, RMSNorm, param, take
from hybridspec.models.ffn import MLP
from hybridspec.models.hybrid import HybridModel
from hybridspec.models.mtp import DraftHead


def default_points(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default capture layers (2, L//2, L-3), each the input of that layer,
    clamped into the target's layers 0..L-1. On a small target two may name the
    same layer (L = 6 gives 2, 3, 3): the fc still reads three slots, that point's
    state in both."""
    return tuple(min(max(p, 0), num_layers - 1) for p in (2, num_layers // 2, num_layers - 3))


class Eagle3Head(DraftHead):
    """An EAGLE-3 head over `target` from canonical `weights`: fc.weight,
    norm.weight, lm_head.weight, d2t, optionally embed_tokens.weight, and the
    layer's input_norm / hidden_norm / post_norm weights, attention.{q,k,v,o}_proj.weight,
    mlp.{gate,up,down}_proj.weight. `config`: the layer as a one-attention-layer
    HybridConfig of the target's vocabulary; `points`: the three capture points."""

    def __init__(self, target: HybridModel, config: HybridConfig, weights: dict[str, torch.Tensor],
                 points: tuple[int, int, int], norm_before_residual: bool = False):
        super().__init__()
        self.config, self.points, self.norm_before_residual = config, tuple(points), norm_before_residual
        self.target = [target]  # a list: the target is not one of this module's submodules
        eps = config.rms_norm_eps
        self.fc = param(weights["fc.weight"])  # [hidden, 3·target_hidden]
        self.embed = param(weights.get("embed_tokens.weight"))  # [vocab, hidden] or None: the target's
        self.input_norm = RMSNorm(weights["input_norm.weight"], eps)
        self.hidden_norm = RMSNorm(weights["hidden_norm.weight"], eps)
        self.post_norm = RMSNorm(weights["post_norm.weight"], eps)
        inv_freq = rope_inv_freq(config.attention) if config.attention.use_rope else None
        self.attention = Attention(config.attention, take(weights, "attention"), 0, inv_freq)
        self.mlp = MLP(config.mlp, take(weights, "mlp"))
        self.norm = RMSNorm(weights["norm.weight"], eps)
        self.lm_head = param(weights["lm_head.weight"])  # [Vd, hidden]
        d2t = weights["d2t"].to(torch.long)
        self.register_buffer("target_ids", torch.arange(len(d2t)) + d2t, persistent=False)  # [Vd]
        self.bind_backend()

    def bind_backend(self) -> None:
        """Compute through the target's backend's ops (the modules one by one: no whole forward)."""
        backend = backends.select(self.device, self.dtype, self.target[0].backend_name)
        for module in self.modules():
            if isinstance(module, Kernelled):
                module.ops = backend

    @torch.inference_mode()
    def fuse(self, low_mid_high: torch.Tensor) -> torch.Tensor:
        """g = fc([h_low ; h_mid ; h_high]): [n, 3, target_hidden] -> [n, hidden]."""
        return self.ops.linear(low_mid_high.to(self.dtype).flatten(1), self.fc)

    def _forward(self, plan, token_lists, hidden_lists, cache) -> tuple[torch.Tensor, torch.Tensor]:
        bsz, T = len(token_lists), max(map(len, token_lists))
        ids = plan.pad_tokens(token_lists, self.device)  # [batch, T]
        g = torch.zeros(bsz, T, self.fc.shape[0], dtype=self.dtype, device=self.device)  # [batch, T, hidden]
        for b, rows in enumerate(hidden_lists):
            g[b, :len(rows)] = rows.to(self.dtype)
        flat = ids.view(-1)  # the target's table as stored, without its embedding multiplier (EAGLE-3 shares it so)
        e = (self.embed[flat] if self.embed is not None else self.target[0].embed_tokens(flat)).view(bsz, T, -1)
        normed = self.hidden_norm(g)
        residual = normed if self.norm_before_residual else g
        r = residual + self.attention(torch.cat([self.input_norm(e), normed], -1), plan.batch, cache)
        y = r + self.mlp(self.post_norm(r))
        last = y.view(bsz * T, -1).index_select(0, plan.batch.slots.last_index)  # [batch, hidden]
        return self.ops.linear(self.norm(last), self.lm_head), last  # [batch, Vd], [batch, hidden]

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[rows, Vd] over the draft vocabulary -> [rows, target vocab], -inf off it."""
        full = draft_logits.new_full((draft_logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.target_ids] = draft_logits
        return full
