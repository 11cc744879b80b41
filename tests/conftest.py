"""Test-wide settings. Triton kernels run interpreted on CPU tensors unless
the caller chose otherwise (benches/gpu_check.sh sets TRITON_INTERPRET=0);
the variable must be set before triton is first imported."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
