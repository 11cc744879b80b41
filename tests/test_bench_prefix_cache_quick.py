"""The prefix-cache bench runs end to end in --quick mode: every variant's outputs
equal the cache-off outputs, and the counts say what each variant can reuse."""
import json
import subprocess
import sys
from pathlib import Path

BENCHES = Path(__file__).resolve().parents[1] / "benches"


def test_prefix_cache_quick(tmp_path):
    out = tmp_path / "pc.json"
    done = subprocess.run([sys.executable, str(BENCHES / "prefix_cache.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = {(r["workload"], r["variant"]): r for r in json.loads(out.read_text())["rows"]}
    assert {v for _, v in rows} == {"off", "ends", "ends+64", "ends+256", "grid-256"}
    assert all(r["equal_to_off"] for r in rows.values())
    for workload in ("chat", "document"):
        off = rows[workload, "off"]
        assert off["computed"] == off["prompt_tokens"] and off["hit_tokens"] == 0 and off["saved_state_mib"] == 0
        assert rows[workload, "ends+64"]["computed"] < off["computed"]
        # quick prompts are shorter than the grid: a grid-only cache reuses nothing
        assert rows[workload, "grid-256"]["hit_tokens"] == 0
    chat = rows["chat", "ends"]
    assert chat["saved_state_hits"] == chat["requests"] - 1 and chat["replayed"] == 0
    assert "TTFT ms" in done.stdout and out.with_suffix(".png").stat().st_size > 0
