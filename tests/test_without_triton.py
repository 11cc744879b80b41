"""A CPU install works without triton: triton is a dependency only where it
runs (the CUDA build of torch brings it; the [dev] extra keeps it for the
interpreted kernel tests), so `import hybridspec`, `hs.LLM()` and
`hybridspec generate` must run where `import triton` fails."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Makes `import triton` fail as it does where triton is not installed.
BLOCK_TRITON = """
import sys
class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoTriton())
"""


def run_without_triton(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HYBRIDSPEC_KERNELS")}
    return subprocess.run([sys.executable, "-c", BLOCK_TRITON + code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_the_blocker_blocks():
    child = run_without_triton("import triton")
    assert child.returncode != 0 and "No module named 'triton'" in child.stderr


def test_llm_and_generate_run_on_cpu_without_triton():
    child = run_without_triton(
        "import hybridspec as hs\n"
        "llm = hs.LLM(max_batch_size=1, max_model_len=64)\n"
        "[done] = llm.generate(['def f(x):'], hs.SamplingParams(max_new_tokens=8))\n"
        "print('llm', done.finish_reason, len(done.token_ids), llm.stats.drafted_tokens > 0)\n"
        "from hybridspec.cli.main import main\n"
        "print('cli', main(['generate', 'def g(y):', '-n', '8', '--repeats', '1', '--json']) == 0)\n"
        "print('triton modules', [m for m in sys.modules if m.split('.')[0] == 'triton'])\n")
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    assert "llm length 8 True" in lines
    assert "cli True" in lines and "triton modules []" in lines
    assert '"schema": "hybridspec.generate/v1"' in child.stdout


def test_triton_is_not_a_runtime_dependency():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda requirement: requirement.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip()
    assert "triton" not in map(name, project["dependencies"])
    assert "triton" in map(name, project["optional-dependencies"]["dev"])  # the interpreted kernel tests
