"""Smoke test of tools/train_embedded.py: a few steps on a tiny config and corpus.

It never loads the shipped assets; it checks the training function itself.
"""

import importlib.util
import math
import sysconfig
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from transformers import BambaForCausalLM  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "train_embedded.py"
CORPUS = b"import os\n\ndef add(a, b):\n    return a + b\n\nclass Box:\n    pass\n" * 40


def load_script():
    spec = importlib.util.spec_from_file_location("train_embedded", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def te():
    torch.set_num_threads(1)
    return load_script()


def tiny_config(te):
    return te.byte_config(hidden_size=32, num_layers=2, attn_layer_indices=[1], intermediate_size=32,
                          mamba_n_heads=2, mamba_d_state=8, num_attention_heads=2)


def test_train_few_steps_saves_hf_layout(te, tmp_path):
    data = torch.frombuffer(bytearray(CORPUS), dtype=torch.uint8)
    settings = te.TrainSettings(steps=3, batch_size=2, seq_len=32, warmup_steps=1, log_every=1)
    model, losses = te.train(tiny_config(te), data, settings, tmp_path / "tiny")

    assert len(losses) == 3
    assert all(math.isfinite(loss) for loss in losses)
    assert (tmp_path / "tiny" / "config.json").is_file()
    assert (tmp_path / "tiny" / "model.safetensors").is_file()

    # The saved weights are the trained ones: same logits after a reload, and they moved
    # away from the seeded initialisation.
    windows = te.heldout_windows(data, num_windows=2, seq_len=32, seed=1)  # [2, 33]
    reloaded = BambaForCausalLM.from_pretrained(tmp_path / "tiny")
    with torch.no_grad():
        expected = model(input_ids=windows[:, :-1], use_cache=False).logits
        actual = reloaded(input_ids=windows[:, :-1], use_cache=False).logits
    torch.testing.assert_close(actual, expected)
    te.seed_everything(settings.seed)
    untrained = BambaForCausalLM(tiny_config(te))
    assert not torch.equal(untrained.lm_head.weight, reloaded.lm_head.weight)

    assert math.isfinite(te.evaluate(reloaded, windows))
    assert te.greedy_agreement(reloaded, model, windows) == 1.0


def test_heldout_split_is_deterministic_and_excludes_tests(te):
    files = te.stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert files == sorted(files)
    assert not any(te.EXCLUDED_DIRS & set(f.relative_to(root).parts) for f in files)
    assert te.EXCLUDED_DIRS == {"test", "tests", "idlelib", "site-packages"}
    _, heldout, num_train, num_heldout = te.load_corpus()
    assert num_heldout == math.ceil(len(files) / te.HOLDOUT_EVERY)
    assert num_train + num_heldout == len(files)
    assert heldout.numel() == sum(f.stat().st_size for f in files[:: te.HOLDOUT_EVERY])


def test_lr_schedule_warms_up_then_decays_to_floor(te):
    s = te.TrainSettings(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert te.lr_at(0, s) == pytest.approx(0.1)
    assert te.lr_at(9, s) == pytest.approx(1.0)
    assert te.lr_at(10, s) == pytest.approx(1.0)
    assert te.lr_at(99, s) == pytest.approx(0.1, abs=1e-3)
    assert all(te.lr_at(i, s) >= te.lr_at(i + 1, s) for i in range(10, 99))
