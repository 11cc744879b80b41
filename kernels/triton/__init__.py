"""The Triton backend: one file per kernel, each holding the kernel, its launcher and the torch reference."""
