"""The maths of a hybrid model: `HybridModel` (hybrid.py) and its layers (attention, gated attention,
Mamba-1, Mamba-2, gated DeltaNet, MLP and MoE, Zamba2's shared blocks, Falcon-H1's parallel mixer),
each computing through its backend's op objects (`self.ops`) and describing itself to the kernels."""
