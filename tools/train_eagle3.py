"""Train an EAGLE-3 head for hybridspec's embedded target, the target frozen.

The head (`hybridspec/models/eagle3.py` states its forward) reads the target's
hidden states at three layers (`--points`, each the input of that layer: HF's
`output_hidden_states` entry of that index) and the target's own embedding,
and drafts over the `--draft-vocab` most frequent bytes of the training stream.
Data and held-out split are `tools/train_embedded.py`'s (the Python standard
library's sources). The loss is EAGLE-3's training-time test: the head is
unrolled `--unroll` steps, step s at position p reading its own step s-1
output at p-1 and attending as it will when drafting (the step-1 keys up to
p-s+1, then one key of each later step), each step scored by cross-entropy
against the target's next-token distribution over the draft vocabulary,
weighted 0.8^(s-1). Written in the published format (config.json +
model.safetensors: fc, midlayer.*, norm, lm_head, d2t, t2d) for
`draft="eagle3:DIR"`; TRAINING.md beside the assets records the run.

    python tools/train_eagle3.py                  # the settings of the shipped head
    python tools/train_eagle3.py --steps 5 --out /tmp/head
    python tools/train_eagle3.py --evaluate-only     # held-out acceptance of the head in --out
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import BambaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_embedded import DEFAULT_OUT, HOLDOUT_EVERY, load_corpus, sample_windows, stdlib_files  # noqa: E402

HEADS, HEAD_DIM, INTERMEDIATE, EPS, THETA = 4, 64, 384, 1e-5, 10000.0


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (HF's rotate-half convention) at positions 0..T-1; x [B, heads, T, d]."""
    T, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (THETA ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.arange(T, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + half * sin


class Head(nn.Module):
    """The EAGLE-3 head in published names; `embed` the target's table (frozen)."""

    def __init__(self, hidden: int, draft_vocab: int, embed: torch.Tensor):
        super().__init__()
        H, q = hidden, HEADS * HEAD_DIM
        self.embed = embed
        lin = lambda o, i: nn.Parameter(torch.randn(o, i) * i ** -0.5)  # noqa: E731
        self.w = nn.ParameterDict({
            "fc": lin(H, 3 * H), "q": lin(q, 2 * H), "k": lin(q, 2 * H), "v": lin(q, 2 * H), "o": lin(H, q),
            "gate": lin(INTERMEDIATE, H), "up": lin(INTERMEDIATE, H), "down": lin(H, INTERMEDIATE),
            "lm_head": lin(draft_vocab, H),
            **{n: nn.Parameter(torch.ones(H)) for n in ("input_norm", "hidden_norm", "post_norm", "norm")}})

    def project(self, g: torch.Tensor, tokens: torch.Tensor):
        """(q, k, v [B, heads, T, d], residual) of inputs g [B, T, H] beside tokens [B, T]."""
        w, (B, T, _) = self.w, g.shape
        x = torch.cat([rms(self.embed[tokens], w["input_norm"]), rms(g, w["hidden_norm"])], -1)
        q, k, v = ((x @ w[n].T).view(B, T, HEADS, HEAD_DIM).transpose(1, 2) for n in "qkv")
        return rotate(q), rotate(k), v, g

    def finish(self, attended: torch.Tensor, residual: torch.Tensor):
        """(y [B, T, H], draft logits [B, T, Vd]) from attention outputs [B, heads, T, d]."""
        w, (B, _, T, _) = self.w, attended.shape
        r = residual + attended.transpose(1, 2).reshape(B, T, -1) @ w["o"].T
        m = rms(r, w["post_norm"])
        y = r + (F.silu(m @ w["gate"].T) * (m @ w["up"].T)) @ w["down"].T
        return y, rms(y, w["norm"]) @ w["lm_head"].T


def unrolled_logits(head: Head, feats: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Each step's draft logits [B, T, Vd]; feats [B, T, 3H] (position p: target's h_p),
    tokens [B, T] (t_{p+1}). Step s >= 2 at p reads step s-1's y at p-1 and attends
    to step-1 keys at positions <= p-s+1 and step j's key at p-(s-j), j = 2..s."""
    B, T, _ = feats.shape
    g = feats @ head.w["fc"].T
    keys, values, out = [], [], []
    scale = HEAD_DIM ** -0.5
    for s in range(1, steps + 1):
        q, k, v, residual = head.project(g, tokens)
        keys.append(k)
        values.append(v)
        rows = torch.arange(T)
        causal = rows[None, :] <= rows[:, None] - (s - 1)  # [T, T] step-1 keys at positions <= p-s+1
        scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
        for j in range(2, s + 1):  # one key of step j, at p-(s-j)
            shift = s - j
            kj = F.pad(keys[j - 1], (0, 0, shift, 0))[..., :T, :]
            scores.append((q * kj).sum(-1, keepdim=True) * scale)
        p = torch.softmax(torch.cat(scores, -1), -1).nan_to_num()  # rows p < s-1 see nothing: unused
        attended = p[..., :T] @ values[0]
        for j in range(2, s + 1):
            shift = s - j
            vj = F.pad(values[j - 1], (0, 0, shift, 0))[..., :T, :]
            attended = attended + p[..., T + j - 2:T + j - 1] * vj
        y, logits = head.finish(attended, residual)
        out.append(logits)
        g = F.pad(y, (0, 0, 1, 0))[:, :T]  # step s+1 at p reads y at p-1
    return out


@torch.no_grad()
def target_view(target: BambaForCausalLM, windows: torch.Tensor, points: list[int], draft_ids: torch.Tensor):
    """(feats [B, T, 3H] at positions 0..T-1, labels [B, T, Vd]: the target's next-token
    distribution at p+1 over the draft vocabulary, renormalised) for windows [B, T+2]."""
    out = target(windows[:, :-1], output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i][:, :-1] for i in points], -1)
    labels = torch.softmax(out.logits[:, 1:, draft_ids].float(), -1)
    return feats, labels


def loss_of(head, target, windows, points, draft_ids, steps) -> tuple[torch.Tensor, list[float]]:
    feats, labels = target_view(target, windows, points, draft_ids)
    tokens = windows[:, 1:-1]
    total, accs = 0.0, []
    for s, logits in enumerate(unrolled_logits(head, feats, tokens, steps)):
        valid = slice(s, None)  # step s+1 needs positions >= s
        lp = torch.log_softmax(logits[:, valid], -1)
        total = total + 0.8 ** s * -(labels[:, valid] * lp).sum(-1).mean()
        accs.append(float((logits[:, valid].argmax(-1) == labels[:, valid].argmax(-1)).float().mean()))
    return total, accs


def draft_vocabulary(stream: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent byte values of the stream, in increasing id order."""
    counts = torch.bincount(stream.long(), minlength=256)
    return counts.argsort(descending=True, stable=True)[:size].sort().values


def save_head(head: Head, out: Path, points: list[int], draft_ids: torch.Tensor, target_cfg: dict) -> None:
    """The published EAGLE-3 layout: config.json + model.safetensors."""
    w, H, V = head.w, target_cfg["hidden_size"], target_cfg["vocab_size"]
    names = {"fc": "fc.weight", "norm": "norm.weight", "lm_head": "lm_head.weight",
             "input_norm": "midlayer.input_layernorm.weight", "hidden_norm": "midlayer.hidden_norm.weight",
             "post_norm": "midlayer.post_attention_layernorm.weight",
             **{n: f"midlayer.self_attn.{n}_proj.weight" for n in "qkvo"},
             **{n: f"midlayer.mlp.{n}_proj.weight" for n in ("gate", "up", "down")}}
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors = {names[n]: p.detach().contiguous() for n, p in w.items()}
    tensors.update(d2t=(draft_ids - torch.arange(len(draft_ids))).contiguous(), t2d=t2d)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
              "target_hidden_size": H, "num_hidden_layers": 1, "num_attention_heads": HEADS,
              "num_key_value_heads": HEADS, "head_dim": HEAD_DIM, "intermediate_size": INTERMEDIATE,
              "hidden_act": "silu", "rms_norm_eps": EPS, "rope_theta": THETA, "max_position_embeddings": 4096,
              "vocab_size": V, "draft_vocab_size": len(draft_ids), "tie_word_embeddings": False,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": points, "use_aux_hidden_state": True}}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def heldout_prompts(count: int = 8, length: int = 64) -> list[list[int]]:
    """`length` bytes of each of the first `count` held-out files, from the first
    line starting past the file's middle."""
    prompts = []
    for path in [f for i, f in enumerate(stdlib_files()) if i % HOLDOUT_EVERY == 0][:count]:
        data = path.read_bytes()
        start = data.find(b"\n", len(data) // 2) + 1
        prompts.append(list(data[start:start + length]))
    return prompts


def held_out_acceptance(head: Path, new_tokens: int = 128) -> None:
    """Greedy acceptance of `hs.LLM(draft="eagle3:HEAD")` on the embedded target at
    γ = 1..4 over the held-out prompts; printed as a Markdown table."""
    import hybridspec as hs
    prompts = heldout_prompts()
    params = [hs.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)] * len(prompts)
    print("| γ | acceptance | accepted per round | tokens per round |\n| --- | --- | --- | --- |")
    for gamma in range(1, 5):
        llm = hs.LLM(draft=f"eagle3:{head}", num_draft_tokens=gamma, threads=1)
        llm.engine.generate(prompts, params)
        stats = llm.engine.stats
        print(f"| {gamma} | {stats.acceptance_rate:.3f} | {stats.accepted_tokens / stats.sequence_rounds:.2f} | "
              f"{stats.tokens_per_round:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=128)
    ap.add_argument("--points", type=int, nargs=3, default=[1, 3, 5])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT / "eagle3")
    ap.add_argument("--evaluate-only", action="store_true", help="only measure the head in --out")
    args = ap.parse_args()
    if args.evaluate_only:
        held_out_acceptance(args.out)
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    target = BambaForCausalLM.from_pretrained(DEFAULT_OUT / "target", dtype=torch.float32).eval()
    target.requires_grad_(False)
    train, heldout, _, _ = load_corpus()
    draft_ids = draft_vocabulary(train, args.draft_vocab)
    head = Head(target.config.hidden_size, len(draft_ids), target.get_input_embeddings().weight.detach())
    decay = [p for p in head.parameters() if p.dim() >= 2]
    rest = [p for p in head.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    gen, start = torch.Generator().manual_seed(args.seed), time.time()
    for step in range(1, args.steps + 1):
        progress = max(0.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        lr = args.lr * min(1.0, step / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        windows = sample_windows(train, args.batch_size, args.seq_len + 1, gen)  # [B, seq_len + 2]
        loss, accs = loss_of(head, target, windows, args.points, draft_ids, args.unroll)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps:
            print(f"step {step} loss {loss.item():.3f} top-1 agreement by step "
                  f"{' '.join(f'{a:.3f}' for a in accs)} ({time.time() - start:.0f} s)", flush=True)
    with torch.no_grad():
        windows = sample_windows(heldout, 32, args.seq_len + 1, torch.Generator().manual_seed(1))
        loss, accs = loss_of(head, target, windows, args.points, draft_ids, args.unroll)
    print(f"held-out: loss {float(loss):.3f}, top-1 agreement with the target by step "
          f"{' '.join(f'{a:.3f}' for a in accs)}")
    save_head(head, args.out, args.points, draft_ids, target.config.to_dict())
    print(f"wrote {args.out}")
    held_out_acceptance(args.out)


if __name__ == "__main__":
    main()
