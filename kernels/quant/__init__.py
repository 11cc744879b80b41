"""Quantized weights in GGUF's block formats: the formats (formats.py) and the weight type the
products take (weight.py); the CPU products are `kernels/cpu/quant.c`."""
