"""Decode speed of quantized weights: float32 against Q8_0, Q4_0 and Q4_K (`hs.load(quantize=)`).

Models: the embedded target (a 4M-parameter Bamba, byte vocabulary: per-token overheads weigh) and,
unless --quick, a random 241M-parameter Mamba-2 / attention hybrid built in code (hidden 1024, 12
layers, attention in layers 3 and 9, MLP 2816, vocabulary 32000; nothing downloaded), where a
decode step reads its weights from memory. For each, plain greedy decoding of one prompt under
each format, alternating call by call (`common.alternating_samples`): decode tok/s is
(new tokens − 1) / (seconds of a call generating them − seconds of a call generating one), the
prompt's prefill cancelling out; median and min–max over `--repeats` pairs. The embedded target
also decodes speculatively with the embedded draft quantized alike (γ = 4), whose output the table
checks equals plain decoding. One torch thread by default.

    python benches/quant.py            # the measurement (minutes)
    python benches/quant.py --quick    # the embedded target, a few tokens
    python benches/quant.py --embedded-only --clock cpu   # the embedded target alone, CPU seconds
    python benches/quant.py --products --clock cpu        # the C products alone, µs per row
    python benches/quant.py --stream                      # the C products, weights streamed from memory
    python benches/quant.py --layouts                     # Q4_K's tiles: AVX2 plain / interleaved, VNNI
    python benches/quant.py --head                        # a Q6_K LM head: plain / interleaved, coarse argmax
"""
from __future__ import annotations

import functools
import statistics
import sys

import torch

from common import (alternating_samples, bench_parser, describe_machine, print_table, set_clock, set_threads, timed,
                    write_json)

FORMATS = ("float32", "q8_0", "q4_0", "q4_k")


def mid_model():
    """The random 241M-parameter hybrid (see the module), float32, packed as `hs.load` packs on CPU."""
    from hybridspec.config import AttentionConfig, HybridConfig, Mamba2Config, MLPConfig
    from hybridspec.rollback.models import random_model
    layers = tuple("attention" if i in (3, 9) else "mamba2" for i in range(12))
    config = HybridConfig(
        vocab_size=32000, hidden_size=1024, layer_types=layers, ffn_types=("mlp",) * len(layers),
        attention=AttentionConfig(num_heads=16, num_kv_heads=4, head_dim=64),
        mamba2=Mamba2Config(num_heads=32, head_dim=64, d_state=128, chunk_size=64), mlp=MLPConfig(2816),
        max_position_embeddings=4096, family="bench")
    return random_model(config, 0, torch.float32)


def models(quick: bool) -> dict:
    """name -> {format: loader}: the embedded target, and the mid-size model unless quick."""
    import hybridspec as hs
    target, _ = hs.embedded_paths()
    out = {"embedded": {f: (lambda f=f: hs.load(target, quantize=None if f == "float32" else f)) for f in FORMATS}}
    if not quick:
        def mid(fmt):
            model = mid_model()
            if fmt != "float32":
                model.quantize(fmt)
            return model.pack_for_cpu()
        out["mid"] = {f: (lambda f=f: mid(f)) for f in FORMATS}
    return out


def weight_bytes(model) -> int:
    """Bytes of the model's parameters as stored (quantized blocks count their bytes)."""
    return sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())


def decode_rows(name: str, loaders: dict, prompt: list[int], new_tokens: int, repeats: int) -> list[dict]:
    import hybridspec as hs
    engines = {f: hs.Engine(load(), max_batch_size=1) for f, load in loaders.items()}
    params = {n: hs.SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (1, new_tokens)}
    calls = {f"{f} {n}": (lambda e=e, n=n: e.generate([prompt], params[n])) for f, e in engines.items() for n in params}
    samples = alternating_samples(calls, repeats)
    rows = []
    for fmt, engine in engines.items():
        rates = [(new_tokens - 1) / (long - short)
                 for long, short in zip(samples[f"{fmt} {new_tokens}"], samples[f"{fmt} 1"])]
        rows.append(dict(model=name, format=fmt, weight_mb=weight_bytes(engine.target) / 2**20,
                         decode_tok_s=statistics.median(rates), min_tok_s=min(rates), max_tok_s=max(rates)))
    base = rows[0]["decode_tok_s"]
    for row in rows:
        row["vs_float32"] = row["decode_tok_s"] / base
    return rows


def speculative_rows(prompt: list[int], new_tokens: int, repeats: int) -> list[dict]:
    """The embedded pair quantized alike: speculative (γ = 4) and plain decoding, tok/s and equality."""
    import hybridspec as hs
    target_dir, draft_dir = hs.embedded_paths()
    params = hs.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for fmt in FORMATS:
        quantize = None if fmt == "float32" else fmt
        target, draft = hs.load(target_dir, quantize=quantize), hs.load(draft_dir, quantize=quantize)
        plain, spec = hs.Engine(target), hs.Engine(target, draft=draft, num_draft_tokens=4)
        outputs = {}
        samples = alternating_samples({k: (lambda k=k, e=e: outputs.__setitem__(k, e.generate([prompt], params)))
                                       for k, e in (("plain", plain), ("spec", spec))}, repeats)
        tok_s = {k: new_tokens / statistics.median(v) for k, v in samples.items()}
        rows.append(dict(format=fmt, plain_tok_s=tok_s["plain"], spec_tok_s=tok_s["spec"],
                         speedup=tok_s["spec"] / tok_s["plain"],
                         acceptance=spec.stats.acceptance_rate,
                         equal=outputs["plain"][0].token_ids == outputs["spec"][0].token_ids))
    return rows


PRODUCT_ROWS = (1, 2, 5, 8, 16, 64)


def product_rows(size: int, repeats: int) -> list[dict]:
    """The C product (`cpu_quant.quant_matmul`) of a [size, size] weight in each quantized format at
    PRODUCT_ROWS rows: µs per call and per row, median of `repeats` (`common.clock`)."""
    from hybridspec.kernels.cpu import quant as cpu_quant
    from hybridspec.kernels.quant.weight import QuantWeight
    g = torch.Generator().manual_seed(0)
    rows = []
    for fmt in FORMATS[1:]:
        weight = QuantWeight.quantize(torch.randn(size, size, generator=g) * 0.05, fmt)
        for M in PRODUCT_ROWS:
            x = torch.randn(M, size, generator=g)
            seconds = timed(lambda: cpu_quant.quant_matmul(x, weight), repeats=repeats)
            rows.append(dict(format=fmt, rows=M, us=seconds * 1e6, us_per_row=seconds * 1e6 / M,
                             path=cpu_quant.vector_path()))
    return rows


STREAM_WEIGHTS, STREAM_SHAPES = 40, ((4384, 1024), (2048, 2048))  # a Mamba-2 in_proj's; a K of 2,048


def stream_rows(repeats: int) -> list[dict]:
    """The C products over STREAM_WEIGHTS different weights of each of STREAM_SHAPES in turn (80–190
    MB per format and shape, more than the caches hold: each weight comes from memory, as in a
    decode step), at PRODUCT_ROWS rows: ms per pass over all of them and the weights' GB/s, median
    of `repeats`. Both shapes: how far a row reaches (K) changes how the hardware's prefetch follows."""
    from hybridspec.kernels.cpu import quant as cpu_quant
    from hybridspec.kernels.quant.weight import QuantWeight
    g = torch.Generator().manual_seed(0)
    rows = []
    for shape in STREAM_SHAPES:
        for fmt in FORMATS[1:] + ("q6_k",):
            weights = [QuantWeight.quantize(torch.randn(*shape, generator=g) * 0.05, fmt)
                       for _ in range(STREAM_WEIGHTS)]
            nbytes = sum(w.numel() * w.element_size() for w in weights)
            for M in PRODUCT_ROWS:
                x = torch.randn(M, shape[1], generator=g)
                seconds = timed(lambda: [cpu_quant.quant_matmul(x, w) for w in weights], repeats=repeats)
                rows.append(dict(shape=f"{shape[0]} × {shape[1]}", format=fmt, rows=M, mb=nbytes / 1e6,
                                 ms=seconds * 1e3, gb_s=nbytes / seconds / 1e9, path=cpu_quant.vector_path()))
            del weights
    return rows


LAYOUT_ROWS = (1, 4, 128)  # decode, a verify of γ = 3, a prefill


def layout_rows(repeats: int) -> list[dict]:
    """Q4_K's tiles side by side: STREAM_WEIGHTS weights of each of STREAM_SHAPES from memory, as
    GGUF lays them on AVX2 (a column at a time), interleaved on AVX2 (8 columns in the lanes, k8) and
    interleaved on AVX512-VNNI where the CPU has it (16 columns, k16); at LAYOUT_ROWS rows, the three
    passes alternated `repeats` times in one process: ms per pass (median, min) and each pass's ratio to
    the plain AVX2 pass beside it (median, min–max)."""
    import copy
    from hybridspec.kernels.cpu import quant as cpu_quant
    from hybridspec.kernels.quant.weight import QuantWeight
    first = cpu_quant.vector_path()
    paths = ["avx2"]
    try:
        cpu_quant.vector_path("avx512vnni")
        paths.append("avx512vnni")
    except ValueError:
        pass
    g = torch.Generator().manual_seed(0)
    rows = []
    try:
        for shape in STREAM_SHAPES:
            plain = [QuantWeight.quantize(torch.randn(*shape, generator=g) * 0.05, "q4_k") for _ in range(STREAM_WEIGHTS)]
            interleaved = [copy.deepcopy(w).interleave_() for w in plain]
            variants = {"avx2, plain": ("avx2", plain), "avx2, interleaved (k8)": ("avx2", interleaved)}
            if "avx512vnni" in paths:
                variants["avx512vnni, interleaved (k16)"] = ("avx512vnni", interleaved)
            for M in LAYOUT_ROWS:
                x = torch.randn(M, shape[1], generator=g)

                def run(path, weights):
                    cpu_quant.vector_path(path)
                    for w in weights:
                        cpu_quant.quant_matmul(x, w)
                samples = alternating_samples({name: functools.partial(run, *v) for name, v in variants.items()},
                                              repeats)
                base = samples["avx2, plain"]
                for name, seconds in samples.items():
                    ratios = [b / s for b, s in zip(base, seconds)]
                    rows.append(dict(shape=f"{shape[0]} × {shape[1]}", rows=M, variant=name,
                                     ms=statistics.median(seconds) * 1e3, min_ms=min(seconds) * 1e3,
                                     speedup=statistics.median(ratios), speedup_min=min(ratios),
                                     speedup_max=max(ratios)))
            del plain, interleaved
    finally:
        cpu_quant.vector_path(first)
    return rows


HEAD_SHAPE, HEAD_COPIES, HEAD_ROWS = (32000, 1024), 2, (1, 4, 128)  # the llamacpp bench's LM head; copies streamed


def head_rows(repeats: int, shape: tuple[int, int] = HEAD_SHAPE) -> list[dict]:
    """A Q6_K LM head of `shape`, HEAD_COPIES copies streamed from memory: on AVX512-VNNI as GGUF lays
    it and interleaved (`QuantWeight.interleave_`: the 16-column tiles at every row count), and at one
    row the coarse argmax a greedy draft step takes (`hs_quant_top`, `cpu_forward.DRAFT_HEAD_TOP`
    columns); on AVX2 as GGUF lays it. At HEAD_ROWS rows, the passes alternated `repeats` times in one
    process: ms per pass (median, min) and its ratio to the plain AVX512-VNNI pass beside it (median,
    min–max). Empty where the CPU has no AVX512-VNNI."""
    import copy
    from hybridspec.kernels.cpu import forward as cpu_forward
    from hybridspec.kernels.cpu import native as cpu_native
    from hybridspec.kernels.cpu import quant as cpu_quant
    from hybridspec.kernels.quant.weight import QuantWeight
    first = cpu_quant.vector_path()
    try:
        cpu_quant.vector_path("avx512vnni")
    except ValueError:
        return []
    g = torch.Generator().manual_seed(0)
    N, K = shape
    plain = [QuantWeight.quantize(torch.randn(N, K, generator=g) * 0.05, "q6_k") for _ in range(HEAD_COPIES)]
    interleaved = [copy.deepcopy(w).interleave_() for w in plain]
    rows = []
    try:
        for M in HEAD_ROWS:
            x = torch.randn(M, K, generator=g)
            y, best = torch.empty(M, N), torch.empty(M, dtype=torch.int64)

            def run(path, weights):
                cpu_quant.vector_path(path)
                for w in weights:
                    cpu_quant.quant_matmul(x, w)

            def coarse():
                cpu_quant.vector_path("avx512vnni")
                for w in interleaved:
                    cpu_native.library().hs_quant_top(x.data_ptr(), K, w.data_ptr(), w.code, M, K, N,
                                                      cpu_forward.DRAFT_HEAD_TOP, y.data_ptr(), best.data_ptr())
            variants = {"avx512vnni, plain": functools.partial(run, "avx512vnni", plain),
                        "avx512vnni, interleaved": functools.partial(run, "avx512vnni", interleaved),
                        "avx2, plain": functools.partial(run, "avx2", plain)}
            if M == 1:
                variants[f"avx512vnni, interleaved, coarse argmax (top {cpu_forward.DRAFT_HEAD_TOP})"] = coarse
            samples = alternating_samples(variants, repeats)
            base = samples["avx512vnni, plain"]
            for name, seconds in samples.items():
                ratios = [b / s for b, s in zip(base, seconds)]
                rows.append(dict(rows=M, variant=name, ms=statistics.median(seconds) * 1e3 / HEAD_COPIES,
                                 min_ms=min(seconds) * 1e3 / HEAD_COPIES, speedup=statistics.median(ratios),
                                 speedup_min=min(ratios), speedup_max=max(ratios)))
    finally:
        cpu_quant.vector_path(first)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per timed call (default 64)")
    parser.add_argument("--repeats", type=int, default=None, help="timed pairs per format (default 5)")
    parser.add_argument("--embedded-only", action="store_true",
                        help="the embedded target alone (its decode and the speculative table), not the 241M model")
    parser.add_argument("--products", action="store_true",
                        help="the C products alone: a 2048 × 2048 weight per format at 1 to 64 rows")
    parser.add_argument("--stream", action="store_true",
                        help=f"the C products alone over {STREAM_WEIGHTS} weights of each of {STREAM_SHAPES} "
                             "streamed from memory")
    parser.add_argument("--layouts", action="store_true",
                        help="Q4_K's tiles side by side: GGUF's layout on AVX2, interleaved on AVX2 and on "
                             "AVX512-VNNI, weights streamed from memory")
    parser.add_argument("--head", action="store_true",
                        help="a Q6_K LM head side by side: GGUF's layout and interleaved on AVX512-VNNI, the "
                             "coarse argmax of a greedy draft step, GGUF's layout on AVX2")
    args = parser.parse_args(argv)
    threads = set_threads(args.threads)
    set_clock(args.clock)
    if args.head:
        print(describe_machine(), flush=True)
        shape = (1024, 512) if args.quick else HEAD_SHAPE
        compared = head_rows(args.repeats or (1 if args.quick else 9), shape)
        print_table(compared, [("rows", "rows"), ("variant", "dot product, layout"), ("ms", "ms per head"),
                               ("min_ms", "min"), ("speedup", "plain VNNI ÷ this"), ("speedup_min", "min"),
                               ("speedup_max", "max")],
                    title=f"a Q6_K head {shape[0]} × {shape[1]}, {HEAD_COPIES} copies from memory, "
                          "passes alternated")
        write_json(args.out or "quant_head.json", dict(bench="quant_head", threads=threads, rows=compared))
        return 0
    if args.layouts:
        print(describe_machine(), flush=True)
        compared = layout_rows(args.repeats or (1 if args.quick else 9))
        print_table(compared, [("shape", "weight"), ("rows", "rows"), ("variant", "dot product, layout"),
                               ("ms", "ms per pass"), ("min_ms", "min"), ("speedup", "plain AVX2 ÷ this"),
                               ("speedup_min", "min"), ("speedup_max", "max")],
                    title=f"Q4_K products over {STREAM_WEIGHTS} weights of a shape from memory, passes alternated")
        write_json(args.out or "quant_layouts.json", dict(bench="quant_layouts", threads=threads, rows=compared))
        return 0
    if args.stream:
        print(describe_machine(), flush=True)
        streamed = stream_rows(args.repeats or (1 if args.quick else 7))
        print_table(streamed, [("shape", "weight"), ("format", "format"), ("path", "dot product"), ("rows", "rows"),
                               ("mb", "MB"), ("ms", "ms per pass"), ("gb_s", "GB/s")],
                    title=f"quantized products over {STREAM_WEIGHTS} weights of a shape from memory")
        write_json(args.out or "quant_stream.json", dict(bench="quant_stream", threads=threads, rows=streamed))
        return 0
    if args.products:
        print(describe_machine(), flush=True)
        products = product_rows(2048, args.repeats or (3 if args.quick else 31))
        print_table(products, [("format", "format"), ("path", "dot product"), ("rows", "rows"), ("us", "µs"),
                               ("us_per_row", "µs per row")], title="quantized products, 2048 × 2048")
        write_json(args.out or "quant_products.json", dict(bench="quant_products", threads=threads, rows=products))
        return 0
    new_tokens = args.new_tokens or (4 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 5)
    print(describe_machine(), flush=True)
    prompt = list(b"The quick brown fox jumps over the lazy dog. def main():\n    return")
    rows = []
    for name, loaders in models(args.quick or args.embedded_only).items():
        rows += decode_rows(name, loaders, prompt, new_tokens, repeats)
    print_table(rows, [("model", "model"), ("format", "format"), ("weight_mb", "weights MiB"),
                       ("decode_tok_s", "decode tok/s"), ("min_tok_s", "min"), ("max_tok_s", "max"),
                       ("vs_float32", "vs float32")],
                title=f"plain greedy decode, {new_tokens} new tokens, {threads} thread(s), median of {repeats}")
    spec = speculative_rows(prompt, new_tokens, repeats)
    print_table(spec, [("format", "format"), ("plain_tok_s", "plain tok/s"), ("spec_tok_s", "spec tok/s"),
                       ("speedup", "spec/plain"), ("acceptance", "acceptance"), ("equal", "spec == plain")],
                title="the embedded pair quantized alike, speculative (γ = 4) against plain")
    write_json(args.out or "quant.json", dict(bench="quant", quick=args.quick, new_tokens=new_tokens,
                                              repeats=repeats, threads=threads, rows=rows, speculative=spec))
    return 0 if all(r["equal"] for r in spec) else 1


if __name__ == "__main__":
    sys.exit(main())
