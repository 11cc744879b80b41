"""`hybridspec simulate`: text report, --json, --measured (schema and labels), --plot."""
import argparse
import json
import sys
from pathlib import Path

import pytest

from hybridspec.errors import ConfigError
import hybridspec.sim as hs_sim
from hybridspec.cli import simulate as simulate_cli
from hybridspec.sim import expected_tokens, measured_crossover, parse_measured
from hybridspec.sim.measured import measured_rows
from hybridspec.sim.presets import PRESETS

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "simulator_measured_example.json"
FAST = ["--rounds", "2000"]


def _run(argv, capsys):
    parser = argparse.ArgumentParser()
    simulate_cli.add_arguments(parser)
    code = simulate_cli.run(parser.parse_args(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_default_report_has_table_crossovers_and_assumptions(capsys):
    code, out, _ = _run(FAST, capsys)
    assert code == 0
    assert "assumed: acceptance is i.i.d." in out and "assumed: NVIDIA H200" in out
    assert "   0.70     5        2.9412" in out and "   0.80     4        3.3616" in out
    assert "2.35x" in out  # α = 0.7, γ = 5 memory-bound
    assert "bamba-9b on H200 SXM" in out and "nemotron-h-8b on H200 SXM" in out
    table_rows = [line for line in out.splitlines() if line.strip().startswith(("0.50 ", "0.90 ")) and line.endswith("x")]
    assert len(table_rows) == 2 * 8


def test_json_file_holds_everything(tmp_path, capsys):
    path = tmp_path / "sim.json"
    code, out, _ = _run(FAST + ["--json", str(path)], capsys)
    assert code == 0 and f"wrote {path}" in out
    report = json.loads(path.read_text())
    assert report["schema"] == "hybridspec.simulate/v1" and report["measured"] is None
    assert len(report["table"]) == 5 * 8 and {row["source"] for row in report["table"]} == {"assumed"}
    row = next(r for r in report["table"] if r["alpha"] == 0.8 and r["gamma"] == 4)
    assert row["expected_tokens"] == pytest.approx(expected_tokens(0.8, 4))
    assert abs(row["simulated_tokens"] - row["expected_tokens"]) < 5 * row["simulated_stderr"]
    assert {p["name"] for p in report["presets"]} == set(PRESETS)
    assert all(len(p["crossover"]) == 5 * 4 for p in report["presets"])


def test_json_to_stdout_replaces_the_text(capsys):
    code, out, _ = _run(FAST + ["--alphas", "0.7", "--gammas", "5", "--json", "-"], capsys)
    report = json.loads(out)
    assert code == 0 and len(report["table"]) == 1
    assert report["table"][0]["speedup_memory_bound"] == pytest.approx(2.3529, abs=1e-4)


def test_measured_example_is_labelled_measured(capsys):
    code, out, _ = _run(FAST + ["--measured", str(EXAMPLE), "--json", "-"], capsys)
    measured = json.loads(out)["measured"]
    assert code == 0 and measured["alpha"]["source"] == "measured"
    assert {row[key]["source"] for row in measured["rows"] for key in ("c", "speedup", "replay_cost")} == {"measured"}
    crossover = measured["crossover"]
    low, high = crossover["bracket"]
    assert crossover["source"] == "measured" and low < crossover["batch"] <= high
    code, out, _ = _run(FAST + ["--measured", str(EXAMPLE)], capsys)
    assert "(m) measured, (a) assumed" in out and "crossover batch" in out and " (m)" in out


def test_measured_tokens_follow_the_acceptance_rate():
    data = json.loads(EXAMPLE.read_text())
    run = parse_measured(data)
    # E[tokens] = 1 + γ · (accepted / drafted), whatever α's inversion gives
    assert run.tokens_per_round == pytest.approx(1 + data["gamma"] * data["acceptance_rate"], rel=1e-9)


def test_missing_replay_time_is_labelled_assumed():
    data = json.loads(EXAMPLE.read_text())
    del data["batches"][2]["replay_s"]
    rows = measured_rows(parse_measured(data))
    assert rows[2]["replay_cost"]["source"] == "assumed" and rows[2]["speedup"]["source"] == "assumed"
    assert rows[1]["speedup"]["source"] == "measured"
    assert measured_crossover(rows)["source"] == "assumed"


def test_measured_crossover_interpolates_and_bounds():
    def rows(*points):
        return [{"batch": b, "speedup": {"value": s, "source": "measured"}} for b, s in points]

    assert measured_crossover(rows((1, 2.0), (10, 1.5), (20, 0.5)))["batch"] == 15
    assert measured_crossover(rows((1, 2.0), (10, 1.5)))["batch"] is None
    assert measured_crossover(rows((4, 0.9), (8, 0.7)))["bracket"] == [None, 4]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(schema="other/v9"), "schema='other/v9'"),
        (lambda d: d.update(alpha=0.8), "exactly one of 'alpha' and 'acceptance_rate'"),
        (lambda d: d.pop("batches"), "'batches'"),
        (lambda d: d.update(gamma=0), "gamma=0"),
        (lambda d: d["batches"][0].update(verify_s=-1.0), "batches[0].verify_s=-1.0"),
        (lambda d: d["batches"][1].update(batch=1), "repeat"),
        (lambda d: d.update(tokens_per_round=9.0), "tokens_per_round=9.0"),
    ],
)
def test_bad_measured_files_raise_config_error(edit, message):
    data = json.loads(EXAMPLE.read_text())
    edit(data)
    with pytest.raises(ConfigError) as error:
        parse_measured(data)
    assert message in str(error.value)


def test_cli_reports_bad_input_without_a_traceback(tmp_path, capsys):
    code, _, err = _run(FAST + ["--alphas", "0.7,1.5"], capsys)
    assert code == 2 and "alpha=1.5" in err and "[0, 1]" in err
    code, _, err = _run(FAST + ["--measured", str(tmp_path / "missing.json")], capsys)
    assert code == 2 and "no such file" in err


def test_plot_writes_a_png(tmp_path, capsys):
    path = tmp_path / "speedup.png"
    code, out, _ = _run(FAST + ["--alphas", "0.7,0.8", "--measured", str(EXAMPLE), "--plot", str(path)], capsys)
    assert code == 0 and f"wrote {path}" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    code, _, err = _run(FAST + ["--plot", str(tmp_path / "x.png")], capsys)
    assert code == 2 and "pip install matplotlib" in err
    assert not (tmp_path / "x.png").exists()


def test_hybridspec_cli_dispatches_simulate(capsys):
    from hybridspec.cli.main import main

    assert main(["simulate", "--rounds", "2000", "--alphas", "0.8", "--gammas", "4"]) == 0
    assert "3.3616" in capsys.readouterr().out


def test_every_round_term_has_its_own_line_in_simulate_measured(capsys):
    """Each term of `hs.sim.RoundTerms`, of the plain step and of the round, is
    a line of `simulate --measured` and a labelled figure of its JSON, and the
    speedup is `round_speedup` of those terms."""
    code, out, _ = _run(FAST + ["--measured", str(EXAMPLE)], capsys)
    assert code == 0
    for kind in ("plain", "round"):
        for term in hs_sim.TERMS:
            assert sum(line.split()[:2] == [kind, term] for line in out.splitlines()) == 1, (kind, term)
        assert sum(line.split()[:2] == [kind, "total"] for line in out.splitlines()) == 1
    run = parse_measured(json.loads(EXAMPLE.read_text()))
    for row, entry in zip(measured_rows(run), run.batches):
        assert set(row["terms"]) == {f"{kind} {term}" for kind in ("plain", "round") for term in hs_sim.TERMS}
        assert row["speedup"]["value"] == pytest.approx(
            run.tokens_per_round * hs_sim.round_seconds(entry.plain) / hs_sim.round_seconds(entry.round))


def test_the_speedup_counts_every_term():
    """Known terms give a known speedup; a term left out of the file is 0 and labelled assumed."""
    data = {"schema": "hybridspec.round_cost/v1", "machine": "test", "alpha": 1.0, "gamma": 2,
            "batches": [{"batch": 1, "target_step_s": 1.0, "draft_step_s": 0.5, "verify_s": 1.5, "draft_s": 0.8,
                         "sampling_s": 0.1, "commit_s": 0.2, "host_s": 0.3, "replay_s": 0.1,
                         "plain_sampling_s": 0.05, "plain_host_s": 0.15}]}
    [row] = measured_rows(parse_measured(data))
    assert row["speedup"] == {"value": pytest.approx(3 * 1.2 / 3.0), "source": "measured"}
    del data["batches"][0]["draft_s"], data["batches"][0]["host_s"]  # γ · draft_step stands in; host: 0, assumed
    [row] = measured_rows(parse_measured(data))
    assert row["terms"]["round draft_s"] == {"value": 1.0, "source": "measured"}
    assert row["terms"]["round host_s"] == {"value": 0.0, "source": "assumed"}
    assert row["speedup"] == {"value": pytest.approx(3 * 1.2 / 2.9), "source": "assumed"}


def test_tree_option_compares_a_tree_with_the_chain_of_as_many_inputs(capsys, tmp_path):
    path = tmp_path / "sim.json"
    code, out, _ = _run(FAST + ["--alphas", "0.5,0.9", "--tree", "2,2,1", "--rescue", "0.4", "--json", str(path)],
                        capsys)
    assert code == 0 and "Tree 2,2,1 (5 nodes, spine 3) against the chain of gamma = 5" in out
    tree = json.loads(path.read_text())["tree"]
    low, high = tree["tokens"]
    assert low["chain_tokens"] == pytest.approx(expected_tokens(0.5, 5))
    assert abs(low["tree_tokens"] - low["simulated_tokens"]) < 4 * low["simulated_stderr"]
    assert low["tree_tokens"] > low["chain_tokens"] and high["tree_tokens"] < high["chain_tokens"]  # depth wins at high α
    assert {p["name"] for p in tree["presets"]} == set(PRESETS)
    code, _, err = _run(FAST + ["--tree", "2,0"], capsys)
    assert code == 2 and "--tree 2,2,1" in err
