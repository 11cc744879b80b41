"""tools/train_eagle3.py trains what the runtime drafts with: a head the tool
saves loads with `load_eagle3`, and the tool's unrolled training forward gives
the runtime head's logits, step 1 over the target's features and step 2 on
the head's own output (as a draft round computes them), on a tiny Bamba."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import hybridspec as hs  # noqa: E402
from hybridspec.adapters.eagle3 import load_eagle3  # noqa: E402
from oracles import bamba  # noqa: E402

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def load_tool():
    sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location("train_eagle3", TOOLS / "train_eagle3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_training_forward_is_the_runtime_forward(tmp_path):
    tool = load_tool()
    torch.manual_seed(0)
    hf = bamba(seed=1, attn_layers=(1,), num_layers=3, vocab=12, dtype=torch.float32)
    target = hs.from_hf(hf)
    draft_ids = torch.tensor([1, 3, 4, 6, 7, 8, 10, 11])
    head = tool.Head(32, len(draft_ids), hf.get_input_embeddings().weight.detach())
    with torch.no_grad():
        for name in ("input_norm", "hidden_norm", "post_norm", "norm"):
            head.w[name].add_(0.3 * torch.randn(32))
    T, points = 9, [0, 2, 1]
    windows = torch.randint(0, 12, (1, T + 2))
    feats, _ = tool.target_view(hf, windows, points, draft_ids)  # [1, T, 3·32]
    tokens = windows[0, 1:-1].tolist()
    with torch.no_grad():
        step1, step2 = tool.unrolled_logits(head, feats, windows[:, 1:-1], 2)
    tool.save_head(head, tmp_path / "head", points, draft_ids, hf.config.to_dict())
    runtime = load_eagle3(target, tmp_path / "head")
    g = runtime.fuse(feats[0].view(T, 3, 32))
    for p in (0, 4, T - 1):  # step 1 at p: positions 0..p with the target's features
        logits, _ = runtime.extend(new_cache(runtime), [0], [tokens[:p + 1]], [g[:p + 1]])
        torch.testing.assert_close(logits[0, draft_ids], step1[0, p], rtol=1e-4, atol=1e-4)
    for p in (1, 5, T - 1):  # step 2 at p: 0..p-1 absorbed, then t_{p+1} beside the head's own y at p-1
        cache = new_cache(runtime)
        _, y = runtime.extend(cache, [0], [tokens[:p]], [g[:p]])
        logits, _ = runtime.extend(cache, [0], [tokens[p:p + 1]], [y])
        torch.testing.assert_close(logits[0, draft_ids], step2[0, p], rtol=1e-4, atol=1e-4)


def new_cache(head):
    cache = head.new_cache(max_seqs=1, num_blocks=8, block_size=4)
    cache.add_sequences([0])
    return cache
