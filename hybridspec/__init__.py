"""hybridspec: lossless speculative decoding for hybrid Mamba/attention models."""
