"""Train a multi-token-prediction (MTP) layer for the embedded target, in the layout
Qwen3-Next and Qwen3.5 checkpoints ship theirs (`mtp.*`), so that `draft="mtp"` runs
on the embedded default with nothing downloaded.

The target stays frozen. Its hidden states (the last layer's output, before the final
norm) come from hybridspec's own runtime (`cache.hidden_states`, the point an
`MTPDrafter` reads). The layer at position i reads h_i and the embedding of byte
t_{i+1} and is trained to predict t_{i+2} (cross-entropy through the target's LM
head); a second, unrolled step on its own output o_i and t_{i+2} predicting t_{i+3}
(weight `--second-step-weight`) trains it for the recursion a drafter applies for γ > 1.
Its decoder layer is HF's `BambaDecoderLayer` (an attention layer of the target's
shape), warm-started from the target's last attention layer, so its tensors carry the
names the target family stores and `adapters/mtp.py` maps them as for any layer.

Data: the embedded pair's (tools/train_embedded.py): the Python standard library,
every 20th file held out; the target's hidden states of a pool of random training
windows are computed once and batches drawn from it.

    python tools/train_mtp.py                      # the defaults used for the shipped layer
    python tools/train_mtp.py --steps 20 --out /tmp/mtp
"""

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.bamba.modeling_bamba import BambaDecoderLayer, BambaRMSNorm, BambaRotaryEmbedding

import hybridspec as hs
from hybridspec.cache.hidden_states import HiddenStates
from hybridspec.cache.hybrid_cache import HybridCache

from train_embedded import TrainSettings, heldout_windows, load_corpus, lr_at, sample_windows, seed_everything

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "hybridspec" / "assets" / "embedded" / "mtp"


class TrainableMTP(nn.Module):
    """x_i = fc([norm_e(embed(t_{i+1})) ; norm_h(h_i)]); o_i = norm(layer(x_i)); logits = lm_head(o_i).
    The embedding and LM head are the frozen target's."""

    def __init__(self, target):
        super().__init__()
        cfg, hidden = target.config, target.config.hidden_size
        attention = max(cfg.attn_layer_indices)
        self.embed, self.lm_head = target.model.embed_tokens, target.lm_head
        self.rotary = BambaRotaryEmbedding(cfg)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = BambaRMSNorm(hidden, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = BambaRMSNorm(hidden, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([BambaDecoderLayer(cfg, attention, layer_type="full_attention")])
        self.layers[0].load_state_dict(target.model.layers[attention].state_dict())
        self.norm = BambaRMSNorm(hidden, cfg.rms_norm_eps)
        self.norm.load_state_dict(target.model.final_layernorm.state_dict())
        with torch.no_grad():  # start as "the hidden state, plus a little of the token"
            self.fc.weight.zero_()
            self.fc.weight[:, hidden:] = torch.eye(hidden)
            self.fc.weight[:, :hidden] = 0.1 * torch.eye(hidden)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [batch, T] (t_{i+1}), hidden [batch, T, hidden] (h_i) -> (logits, o) [batch, T, ...]."""
        e = self.embed(tokens)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden)], -1))
        T = tokens.shape[1]
        positions = torch.arange(T).unsqueeze(0).expand(tokens.shape[0], -1)
        causal = torch.full((T, T), float("-inf"), dtype=x.dtype).triu(1).view(1, 1, T, T)  # whichever attention HF picks
        y, _ = self.layers[0](x, attention_mask=causal, position_ids=positions,
                              position_embeddings=self.rotary(x, positions))
        o = self.norm(y)
        return self.lm_head(o), o

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The layer's own tensors under the stored names (`mtp.*`): not the target's embedding or LM head."""
        skip = ("embed.", "lm_head.", "rotary.")
        return {f"mtp.{k}": v.detach().contiguous().clone() for k, v in self.state_dict().items()
                if not k.startswith(skip)}


class TargetHidden:
    """The frozen target's last-layer hidden states of byte windows, from hybridspec's runtime."""

    def __init__(self, target_dir: Path, batch: int, seq_len: int):
        self.model = hs.load(target_dir)
        L = self.model.config.num_layers
        self.cache = HybridCache(self.model.config, ring_slots=2, max_seqs=batch, block_size=16,
                                 num_blocks=batch * (seq_len // 16 + 2), dtype=self.model.dtype)
        self.cache.hidden = HiddenStates((L,), L)

    def __call__(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [batch, T] -> h [batch, T, hidden] (positions 0..T-1)."""
        if windows.shape[0] > self.cache.max_seqs:
            return torch.cat([self(part) for part in windows.split(self.cache.max_seqs)])
        ids = list(range(windows.shape[0]))
        self.model.prefill(self.cache, ids, windows.tolist(), last_only=True)
        rows = [self.cache.hidden.take(s)[1][:, 0] for s in ids]
        self.cache.free_sequences(ids)
        return torch.stack(rows)


def mtp_loss(mtp: TrainableMTP, windows: torch.Tensor, hidden: torch.Tensor, second: float) -> torch.Tensor:
    """windows [batch, T + 1] bytes, hidden [batch, T, hidden] of windows[:, :T]: the loss of predicting
    t_{i+2} from (h_i, t_{i+1}), plus `second` times the unrolled second step's (t_{i+3} from (o_i, t_{i+2}))."""
    T = hidden.shape[1]
    logits, o = mtp(windows[:, 1:T - 1], hidden[:, :T - 2])  # position i = 0..T-3
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 2:T].reshape(-1))
    if second:
        logits2, _ = mtp(windows[:, 2:T], o)
        loss = loss + second * F.cross_entropy(logits2.reshape(-1, logits2.shape[-1]),
                                               windows[:, 3:T + 1].reshape(-1))
    return loss


def train(args) -> TrainableMTP:
    target_dir, _ = hs.embedded_paths()
    train_data, heldout_data, _, _ = load_corpus()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    seed_everything(args.seed)
    mtp = TrainableMTP(target)
    hidden_of = TargetHidden(target_dir, args.batch_size, args.seq_len)
    settings = TrainSettings(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                             seed=args.seed, warmup_steps=20)
    params = [p for p in mtp.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    start, recent = time.time(), []
    # the target's hidden states of a pool of windows, once: the frozen target costs as much as a step
    pool = sample_windows(train_data, args.pool, args.seq_len, generator)  # [pool, T + 1]
    pool_hidden = hidden_of(pool[:, :-1])  # [pool, T, hidden]
    print(f"[mtp] hidden states of {args.pool} windows in {time.time() - start:.0f}s", flush=True)
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        picked = torch.randint(0, args.pool, (args.batch_size,), generator=generator)
        windows, hidden = pool[picked], pool_hidden[picked]  # [batch, T + 1], [batch, T, hidden]
        loss = mtp_loss(mtp, windows, hidden, args.second_step_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        recent.append(loss.item())
        if (step + 1) % 50 == 0 or step + 1 == args.steps:
            print(f"[mtp] step {step + 1}/{args.steps}  loss {sum(recent) / len(recent):.4f}  "
                  f"{time.time() - start:.0f}s", flush=True)
            recent = []
    mtp.eval()
    windows = heldout_windows(heldout_data, 32, args.seq_len, seed=args.seed + 1)
    with torch.no_grad():
        hidden = hidden_of(windows[:, :-1])
        logits, _ = mtp(windows[:, 1:-2], hidden[:, :-2])
        top1 = (logits.argmax(-1) == windows[:, 2:-1]).double().mean().item()
        nats = mtp_loss(mtp, windows, hidden, 0.0).item()
    print(f"[mtp] held-out: {nats:.4f} nats/byte for t+2, top-1 {top1:.4f}", flush=True)
    return mtp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--pool", type=int, default=1024, help="training windows whose hidden states are kept")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--second-step-weight", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    mtp = train(args)
    args.out.mkdir(parents=True, exist_ok=True)
    state = mtp.trained_state()
    save_file(state, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    size = sum(t.numel() for t in state.values())
    print(f"[mtp] {size:,} parameters written to {args.out / 'model.safetensors'}", flush=True)


if __name__ == "__main__":
    main()
