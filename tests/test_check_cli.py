"""`hybridspec check`: the rollback-correctness suite from the command line —
passes on healthy models (the built-in tiny one, model directories),
fails (exit 1) when rollback is broken, refuses (exit 2) models that do not
fit together; and the built-in tiny model itself."""
import sys

import pytest
import torch

import hybridspec as hs
from hybridspec.checkpoints.restore import RestoreDecision, decide
from hybridspec.cli.main import SUBCOMMANDS, build_parser, main
from hybridspec.rollback import perturbed_copy, tiny_model
from oracles import bamba


def table_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]


def test_check_is_a_subcommand():
    assert SUBCOMMANDS["check"][0] == "hybridspec.cli.check"
    args = build_parser().parse_args(["check", "--quick", "--draft", "ngram"])
    assert args.quick and args.draft == "ngram" and args.model is None and args.dtype == "float64"


def test_quick_check_on_the_builtin_model_passes(capsys):
    assert main(["check", "--quick"]) == 0
    out, err = capsys.readouterr()
    rows = table_rows(out)
    assert rows and all(r.startswith("PASS") for r in rows)
    # progress: one line per check on stderr as it ends (stderr is no terminal here), in the table's order
    progress = err.splitlines()
    assert [line.split(": ", 1)[0] for line in progress] == [f"check {i}" for i in range(1, len(rows) + 1)]
    assert all(line.split("  ", 1)[1].rsplit(" (", 1)[0] in row for line, row in zip(progress, rows))
    for kind in ("greedy parity", "coupled parity", "stop inside accepted run", "batch invariance", "bad input",
                 "failed round"):
        assert any(kind in r for r in rows), kind
    assert f"{len(rows)}/{len(rows)} checks passed" in out
    assert "acceptance of the perturbed drafter" in out


def test_check_model_and_draft_directories(tmp_path, capsys):
    bamba(seed=0).save_pretrained(tmp_path / "target")
    bamba(seed=1, attn_layers=(0,), num_layers=2).save_pretrained(tmp_path / "draft")
    assert main(["check", "--quick", "--model", str(tmp_path / "target"), "--draft", str(tmp_path / "draft")]) == 0
    out = capsys.readouterr().out
    assert "bamba" in out and all(r.startswith("PASS") for r in table_rows(out))


def test_check_takes_the_word_embedded_for_the_embedded_pair(capsys):
    """--model embedded / --draft embedded load the embedded pair (the suite on it takes a minute: the
    resolution is tested, not the run); --help names the word."""
    from hybridspec.adapters.embedded import embedded_paths
    from hybridspec.cli.check import load_models
    target_dir, draft_dir = embedded_paths()
    args = build_parser().parse_args(["check", "--quick", "--model", "embedded", "--draft", "embedded"])
    target, draft, name = load_models(args)
    assert name == "draft" and target.dtype == torch.float64
    for model, directory in ((target, target_dir), (draft, draft_dir)):
        expected = hs.load(directory, dtype=torch.float64)
        assert model.config == expected.config
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.state_dict().values()))
    assert target.config != draft.config
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    assert "'embedded'" in capsys.readouterr().out


def test_check_fails_when_a_replay_is_skipped(monkeypatch, capsys):
    """Sabotage: restore to the nearest earlier snapshot without replaying."""
    def skip_replay(plan, n, log_available):
        d = decide(plan, n, log_available)
        return d if d.path == "hit" else RestoreDecision("hit", d.src_input, d.src_slot, d.src_slot, n)

    monkeypatch.setattr("hybridspec.checkpoints.checkpointer.decide", skip_replay)
    assert main(["check", "--quick", "--draft", "ngram"]) == 1
    failed = [r for r in table_rows(capsys.readouterr().out) if r.startswith("FAIL")]
    assert any("k=0" in r and "differs by" in r for r in failed), failed
    assert not any("· k=1 " in r for r in failed)  # snapshot hits need no replay


def test_check_refuses_a_draft_with_another_vocabulary(tmp_path, capsys):
    bamba(seed=1, vocab=101).save_pretrained(tmp_path)
    assert main(["check", "--quick", "--draft", str(tmp_path)]) == 2
    assert "101" in capsys.readouterr().err


@pytest.mark.parametrize("layer_types", [("mamba2", "attention", "mamba2"), ("mamba1",), ("attention", "mamba1")])
def test_tiny_model(layer_types):
    model = tiny_model(0, layer_types)
    assert model.config.layer_types == layer_types and model.dtype == torch.float64
    prompts, params = [[5, 6, 7], [8, 9]], hs.SamplingParams(max_new_tokens=8)
    out = [o.token_ids for o in hs.Engine(model).generate(prompts, params)]
    assert out == [o.token_ids for o in hs.Engine(tiny_model(0, layer_types)).generate(prompts, params)]
    assert out != [o.token_ids for o in hs.Engine(tiny_model(1, layer_types)).generate(prompts, params)]
    assert len(set(out[0])) > 1  # not a degenerate model that repeats one token


def test_perturbed_copy_leaves_the_original():
    model = tiny_model(0)
    before = [p.clone() for p in model.parameters()]
    copy = perturbed_copy(model, scale=0.05)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    ratios = [(c / a).flatten() for a, c in zip(model.parameters(), copy.parameters())]
    spread = torch.cat(ratios).std().item()
    assert 0.03 < spread < 0.07


def test_progress_on_a_terminal_is_one_bar(capsys, monkeypatch):
    from hybridspec.cli.check import Progress
    from hybridspec.rollback.checks import CheckResult
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    progress = Progress()
    for name in ("first check", "second check"):
        progress(CheckResult(name, True, "", 0.1))
    progress.close()
    err = capsys.readouterr().err
    assert "checks" in err and "second check" in err and "check 1:" not in err
