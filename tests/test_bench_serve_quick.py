"""benches/serve.py --quick: servers started, Poisson clients served, a row per variant and rate."""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
BENCHES = Path(__file__).resolve().parent.parent / "benches"


def test_serve_bench_quick(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHES))
    __import__("serve")
    out = tmp_path / "serve.json"
    assert sys.modules["serve"].main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["rate"]) for r in rows] == [("plain", 4.0), ("plain", 32.0), ("γ=4", 4.0), ("γ=4", 32.0)]
    assert all(r["out_tok_per_s"] > 0 and 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["offline_ttft_ms"] > 0
               for r in rows)
    targets = json.loads(out.read_text())["targets"]
    assert [t["target"] for t in targets] == [
        "plain: served / offline tok/s at 32 req/s", "plain: p50 TTFT / offline first token at 4 req/s",
        "γ=4: served / offline tok/s at 32 req/s", "γ=4: p50 TTFT / offline first token at 4 req/s"]
    assert all(t["figure"] > 0 for t in targets)
