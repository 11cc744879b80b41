"""`hybridspec quantize`: write a model directory as a GGUF file in llama.cpp's layout, its
linear weights quantized (`adapters.gguf.writer`).

    hybridspec quantize DIR OUT.gguf --type q4_k

`hs.load("OUT.gguf")` then gives the model `hs.load(DIR, quantize="q4_k")` gives, bit for bit.
Exit status: 0 written, 2 the directory cannot be read or written as GGUF (one line on stderr
says why; HybridSpecError's handler in cli/main.py prints it).
"""
from __future__ import annotations

import argparse
from pathlib import Path

TYPES = ("q8_0", "q4_0", "q4_k", "f32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="model directory (config.json + safetensors) hs.load reads")
    parser.add_argument("out", metavar="OUT.gguf", help="the GGUF file to write")
    parser.add_argument("--type", choices=TYPES, default="q8_0",
                        help="block format of the decoder layers' linear weights (the LM head takes q8_0); "
                             "f32 keeps every tensor float32 (default: q8_0)")


def run(args: argparse.Namespace) -> int:
    from hybridspec.adapters.gguf.writer import write_gguf
    out = write_gguf(Path(args.directory), Path(args.out), None if args.type == "f32" else args.type)
    print(f"wrote {out} ({args.type}, {out.stat().st_size / 2**20:.1f} MiB)")
    return 0
