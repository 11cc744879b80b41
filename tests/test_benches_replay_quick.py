"""The memory-versus-replay and round-cost benches run end to end in --quick mode."""
import json
import subprocess
import sys
from pathlib import Path

import hybridspec as hs

BENCHES = Path(__file__).resolve().parents[1] / "benches"


def run_bench(name: str, out: Path) -> str:
    done = subprocess.run([sys.executable, str(BENCHES / name), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_memory_vs_replay_quick(tmp_path):
    stdout = run_bench("memory_vs_replay.py", tmp_path / "mvr.json")
    report = json.loads((tmp_path / "mvr.json").read_text())
    assert "Auto against the best fixed policy" in stdout
    rows = report["rows"]
    assert {r["policy"] for r in rows} == {"k=1", "k=2", "k=4", "k=0", "ring small", "log off", "auto", "auto@k4"}
    assert all(r["equals_plain"] for r in rows)
    for alpha in {r["alpha"] for r in rows}:
        peak = {r["policy"]: r["peak_checkpoint_bytes"] for r in rows if r["alpha"] == alpha}
        assert peak["k=1"] > peak["k=2"] > peak["k=4"] > peak["k=0"] > peak["log off"] > 0
        assert peak["ring small"] == peak["k=4"]  # two snapshot slots and the log
        budgeted = next(r for r in rows if r["alpha"] == alpha and r["policy"] == "auto@k4")
        assert budgeted["peak_checkpoint_bytes"] <= budgeted["budget_bytes"] == peak["k=4"]
        replayed = {r["policy"]: r["replayed_per_round"] for r in rows if r["alpha"] == alpha}
        assert replayed["k=1"] == 0 and replayed["k=0"] >= replayed["k=4"]
    assert report["snapshot_overhead"][0]["final_only_ms"] > 0


def test_round_cost_quick_writes_what_simulate_reads(tmp_path):
    stdout = run_bench("round_cost.py", tmp_path / "rc.json")
    run = hs.sim.load_measured(tmp_path / "rc.json")
    assert [b.batch for b in run.batches] == [1, 2] and run.gamma == 4
    assert all(b.draft_step_s > 0 and b.verify_s > 0 for b in run.batches)
    assert "predicted crossover batch" in stdout and "measured crossover batch" in stdout
    report = json.loads((tmp_path / "rc_report.json").read_text())
    assert all(row["equals_plain"] for row in report["rows"])
