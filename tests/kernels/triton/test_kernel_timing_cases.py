"""benches/kernel_timing.py's cases (what gpu_check.sh times on a GPU) run here,
interpreted at tiny sizes: each kernel call takes its arguments and gives
what its reference gives."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benches"))
import kernel_timing  # noqa: E402


def test_every_case_runs_and_matches_its_reference(triton_device):
    names = []
    for name, kernel, ref, moved in kernel_timing.cases("tiny", triton_device):
        torch.manual_seed(0)
        out = kernel()
        torch.manual_seed(0)
        expected = ref()
        if isinstance(out, torch.Tensor):
            torch.testing.assert_close(out, expected)
        assert moved > 0
        names.append(name)
    assert names == ["mamba2_verify", "mamba2_replay", "conv_window_update", "gdn_verify", "gdn_replay",
                     "rejection"]
