"""The native CPU backend: C sources and headers, built on first use (native.py), and their ctypes
wrappers, one module per kernel family."""
