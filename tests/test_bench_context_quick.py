"""benches/context_scaling.py runs in --quick mode (a smoke run, not a measurement)
and its rows hold what its tables print."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parent.parent / "benches"


def test_context_scaling_quick(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHES))
    __import__("context_scaling")
    out = tmp_path / "context.json"
    assert sys.modules["context_scaling"].main(["--quick", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    embedded, random = payload["workloads"].values()
    assert [r["length"] for r in embedded] == [32, 96] and [r["length"] for r in random] == [64, 192]
    for rows in (embedded, random):
        first = rows[0]
        for row in rows:
            assert row["plain_equals_hf"] is True and row["spec_equals_plain"] is True  # greedy: all agree
            for impl in ("engine", "spec", "hf"):
                for metric in ("ms_tok", "prefill_ms", "cpu_ms_tok"):
                    cell = row[f"{impl}_{metric}"]
                    assert 0 < cell["min"] <= cell["median"] <= cell["max"]
                growth = row[f"{impl}_ms_tok_growth"]
                assert growth == pytest.approx(row[f"{impl}_ms_tok"]["median"] / first[f"{impl}_ms_tok"]["median"])
            assert row["engine_vs_hf_ms_tok"] == pytest.approx(row["engine_ms_tok"]["median"]
                                                               / row["hf_ms_tok"]["median"])
    assert out.with_suffix(".png").stat().st_size > 0
