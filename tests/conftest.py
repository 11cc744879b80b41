"""Test-wide settings. Triton kernels run interpreted on CPU tensors unless
the caller chose otherwise (benches/gpu_check.sh sets TRITON_INTERPRET=0);
the variable must be set before triton is first imported. Every test runs
with one torch thread: the tensors are tiny, and on a shared machine more
threads only add contention. Engines with num_draft_tokens="auto" time their
rounds fresh, as without a costs file (`hybridspec.engine.cost_cache`):
no test reads what another run on this machine kept."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["HYBRIDSPEC_COST_CACHE"] = "0"

import pytest  # noqa: E402  (after TRITON_INTERPRET)
import torch  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
