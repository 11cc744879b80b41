"""The `hybridspec` command: main.py dispatches to one module per command (generate, check,
bench, serve, simulate); args.py holds the options they share,
extras.py the optional dependencies' install commands."""
