"""Train hybridspec's embedded default pair on the Python standard library's own source.

Both models are byte-level `BambaForCausalLM` models (vocabulary 256, token = byte
value, no tokenizer): a hybrid Mamba2 + attention target and a much smaller draft. They
are written in Hugging Face layout (config.json + model.safetensors) under
`hybridspec/assets/embedded/{target,draft}`; TRAINING.md there records the run.

Data: every `.py` file under `sysconfig.get_paths()["stdlib"]` outside `test`, `tests`,
`idlelib` and `site-packages` directories, read as bytes and sorted by path. The file
with sorted index i is held out when `i % HOLDOUT_EVERY == 0`; the rest are
concatenated into one training stream from which random windows are drawn.

    python tools/train_embedded.py              # the defaults used for the shipped assets
    python tools/train_embedded.py --target-steps 20 --draft-steps 20 --out /tmp/pair
"""

import argparse
import math
import random
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import BambaConfig, BambaForCausalLM

HOLDOUT_EVERY = 20
EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages"})
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "hybridspec" / "assets" / "embedded"


@dataclass
class TrainSettings:
    steps: int
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 50


def byte_config(hidden_size: int, num_layers: int, attn_layer_indices: list[int],
                intermediate_size: int, mamba_n_heads: int, mamba_d_state: int,
                num_attention_heads: int) -> BambaConfig:
    """A byte-level Bamba config: vocab 256, pad = byte 0, no bos/eos byte."""
    return BambaConfig(
        vocab_size=256, hidden_size=hidden_size, num_hidden_layers=num_layers,
        attn_layer_indices=attn_layer_indices, intermediate_size=intermediate_size,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_attention_heads,
        mamba_n_heads=mamba_n_heads, mamba_d_state=mamba_d_state, mamba_n_groups=1,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
        max_position_embeddings=4096, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )


def target_config() -> BambaConfig:
    # 6 layers, attention at 2 and 5; mamba head dim = 2 * 256 / 8 = 64.
    return byte_config(hidden_size=256, num_layers=6, attn_layer_indices=[2, 5],
                       intermediate_size=384, mamba_n_heads=8, mamba_d_state=64,
                       num_attention_heads=4)


def draft_config() -> BambaConfig:
    # 2 layers: one Mamba2 layer, then one attention layer (HF Bamba needs at least one
    # attention layer to build its generation cache); mamba head dim = 2 * 128 / 4 = 64.
    return byte_config(hidden_size=128, num_layers=2, attn_layer_indices=[1],
                       intermediate_size=256, mamba_n_heads=4, mamba_d_state=32,
                       num_attention_heads=2)


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not EXCLUDED_DIRS & set(p.relative_to(root).parts[:-1]))


def load_corpus() -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Returns (train bytes, held-out bytes, number of train files, number of held-out files)."""
    files = stdlib_files()
    train = [f.read_bytes() for i, f in enumerate(files) if i % HOLDOUT_EVERY != 0]
    heldout = [f.read_bytes() for i, f in enumerate(files) if i % HOLDOUT_EVERY == 0]
    as_tensor = lambda chunks: torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    return as_tensor(train), as_tensor(heldout), len(train), len(heldout)


def sample_windows(data: torch.Tensor, batch_size: int, seq_len: int,
                   generator: torch.Generator) -> torch.Tensor:
    """Random windows of seq_len + 1 bytes from a byte stream. Returns # [batch, seq_len + 1]."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    return data[starts[:, None] + offsets].long()


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warmup, then cosine decay from s.lr to s.min_lr_ratio * s.lr."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def next_byte_loss(model: BambaForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in nats per byte. windows: # [batch, seq_len + 1]"""
    logits = model(input_ids=windows[:, :-1], use_cache=False).logits  # [batch, seq_len, 256]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(config: BambaConfig, data: torch.Tensor, settings: TrainSettings, out_dir: Path,
          name: str = "model") -> tuple[BambaForCausalLM, list[float]]:
    """Trains a fresh model on random windows of `data` (uint8), saves it to out_dir in HF
    layout, and returns it with the per-step training losses."""
    seed_everything(settings.seed)
    model = BambaForCausalLM(config)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=settings.lr, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(settings.seed)
    losses, start = [], time.time()
    model.train()
    for step in range(settings.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        loss = next_byte_loss(model, sample_windows(data, settings.batch_size, settings.seq_len, generator))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % settings.log_every == 0 or step + 1 == settings.steps:
            recent = sum(losses[-settings.log_every:]) / len(losses[-settings.log_every:])
            print(f"[{name}] step {step + 1}/{settings.steps}  loss {recent:.4f} nats/byte  "
                  f"lr {lr_at(step, settings):.2e}  {time.time() - start:.0f}s", flush=True)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return model, losses


def heldout_windows(data: torch.Tensor, num_windows: int, seq_len: int, seed: int) -> torch.Tensor:
    """A fixed sample of held-out windows. Returns # [num_windows, seq_len + 1]"""
    return sample_windows(data, num_windows, seq_len, torch.Generator().manual_seed(seed))


@torch.no_grad()
def evaluate(model: BambaForCausalLM, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-byte loss in nats per byte over all positions of all windows."""
    total = sum(next_byte_loss(model, w).item() * w.shape[0] for w in windows.split(batch_size))
    return total / windows.shape[0]


@torch.no_grad()
def greedy_agreement(draft: BambaForCausalLM, target: BambaForCausalLM, windows: torch.Tensor,
                     batch_size: int = 8) -> float:
    """Fraction of positions where argmax draft == argmax target under teacher forcing:
    the per-token greedy acceptance rate of the draft."""
    agree = total = 0
    for w in windows.split(batch_size):
        inputs = w[:, :-1]  # [batch, seq_len]
        d = draft(input_ids=inputs, use_cache=False).logits.argmax(-1)   # [batch, seq_len]
        t = target(input_ids=inputs, use_cache=False).logits.argmax(-1)  # [batch, seq_len]
        agree += (d == t).sum().item()
        total += d.numel()
    return agree / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target-steps", type=int, default=1100)
    parser.add_argument("--draft-steps", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-windows", type=int, default=128)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)

    train_data, heldout_data, num_train, num_heldout = load_corpus()
    print(f"corpus: {num_train} train files ({train_data.numel():,} bytes), "
          f"{num_heldout} held-out files ({heldout_data.numel():,} bytes)", flush=True)
    windows = heldout_windows(heldout_data, args.eval_windows, 256, seed=args.seed + 1)

    models = {}
    for name, config, steps, lr in [("target", target_config(), args.target_steps, 2e-3),
                                    ("draft", draft_config(), args.draft_steps, 3e-3)]:
        start, cpu_start = time.time(), time.process_time()
        model, _ = train(config, train_data, TrainSettings(steps=steps, lr=lr, seed=args.seed),
                         args.out / name, name=name)
        seconds, cpu_seconds = time.time() - start, time.process_time() - cpu_start
        nats = evaluate(model, windows)
        params = sum(p.numel() for p in model.parameters())
        size = (args.out / name / "model.safetensors").stat().st_size
        print(f"[{name}] {params:,} params, {size / 1e6:.2f} MB, {steps} steps in {seconds / 60:.1f} min "
              f"(CPU {cpu_seconds / 60:.1f} min), "
              f"held-out {nats:.4f} nats/byte = {nats / math.log(2):.4f} bits/byte", flush=True)
        models[name] = model

    agreement = greedy_agreement(models["draft"], models["target"], windows)
    print(f"greedy agreement draft vs target on held-out windows: {agreement:.4f}", flush=True)


if __name__ == "__main__":
    main()
