"""The recurrent-layer seam (checkpoints/recurrent.py, checkpoints/input_log.py):
checkpoints/, cache/ and spec/ name no recurrent kind (a new one is a model
module plus its kernels), and every recurrent layer of every family answers
the protocol, its input log included."""
import ast
from pathlib import Path

import pytest
import torch

from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.checkpoints.input_log import LayerInputLog
from hybridspec.checkpoints.recurrent import RecurrentLayer
from hybridspec.rollback.models import tiny_model

REPO = Path(__file__).resolve().parent.parent
SEAM_USERS = [REPO / "checkpoints", REPO / "hybridspec" / "cache", REPO / "hybridspec" / "spec"]


def test_the_runtime_names_no_recurrent_kind():
    found = []
    for root in SEAM_USERS:
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom):
                    names = [node.module or ""] + [a.name for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.Name | ast.Attribute):
                    names = [node.id if isinstance(node, ast.Name) else node.attr]
                found += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names
                          if "mamba" in n.lower() or n.startswith("Mamba")]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("kind", ["mamba2", "mamba1", "gdn"])
def test_every_recurrent_layer_answers_the_protocol(kind):
    model = tiny_model(layer_types=(kind, "attention", kind), dtype=torch.float32, seed=1)
    cache = HybridCache(model.config, max_seqs=1, num_blocks=8, block_size=8, ring_slots=4, dtype=model.dtype)
    model.prefill(cache, [0], [[3, 4, 5]])
    log = {}
    ring = cache.states.ring_slots(0)
    after_head = ring[(ring.index(cache.head(0)) + 1) % len(ring)]
    model.extend(cache, [0], [[6, 7]], snap_slot=torch.tensor([[-1, after_head]]), input_log=log)
    assert [layer.state_layer for layer in model.recurrent_layers] == sorted(log)
    for layer in model.recurrent_layers:
        assert isinstance(layer, RecurrentLayer)
        assert isinstance(log[layer.state_layer], LayerInputLog) and log[layer.state_layer].nbytes() > 0
