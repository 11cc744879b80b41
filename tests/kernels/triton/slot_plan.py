"""The slot plan and tolerances shared by the state-kernel tests.

Row 0 snapshots every input; row 1 some, ending in place (snap == src); row 2
stops after 2 inputs (slot 8 must stay untouched); row 3 consumes nothing."""

import torch

SRC = [0, 5, 9, 12]
SNAP = [[1, 2, 3, 4], [-1, 6, -1, 5], [10, 11, -1, 8], [13, -1, 14, -1]]
NUM_TOKENS = [4, 4, 2, 0]
WRITTEN = {1, 2, 3, 4, 5, 6, 10, 11}
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-3),
}

# Aligned rings (the pool's offset-major layout with ring halves): each step's
# snapshot slots form one span of the pool, contiguous (consecutive rings) or
# strided, so the references compute the states in place.
SPANNED = {
    "contiguous": ([0, 1, 2], [[3 + 3 * t + b for t in range(4)] for b in range(3)]),
    "strided": ([0, 4, 8], [[1 + t + 4 * b for t in range(3)] for b in range(3)]),
}
