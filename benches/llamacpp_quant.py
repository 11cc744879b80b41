"""Quantized GGUF files (Q8_0, Q4_0, Q4_K_M) against llama.cpp: one file, loaded by both runtimes.

The model is llamacpp.py's random 212M Granite-4.0-H-shaped one (λ-scaled later layers, the same
layer-skip draft idea), converted to an f32 GGUF with llama.cpp's converter, then quantized with
llama.cpp's own quantizer (`llama_cpp.llama_model_quantize`) to each `--formats` type; the draft (the
target's first `--draft-layers` layers) goes through the same two steps. Each quantized file is then:

- loaded by both runtimes (`hs.load(file)`, `llama_cpp.Llama(file)`): top-1 agreement over the
  prompt's positions and the max relative logit difference (max |a − b| / max |b| over every
  position's logits) between them, and each against HF's float32 model (unquantized);
- timed, runs interleaved, per prompt length and thread count: decode tok/s (new tokens after the
  first), prefill tok/s (prompt tokens), greedy tokens compared; hybridspec also speculative, each
  drafter of `--drafts` proposing γ tokens (`--gamma`: one or several values, each timed; the
  table's speculative column gives the fastest drafter and γ, every one's figure beside it), against
  llama.cpp's plain decode. The drafters: "file", the quantized draft file; "layers", the target's
  own first `--draft-layers` layers (`draft="layers:N"`, no second file). They differ where the
  quantizer's per-layer rule does: Q4_K_M gives some layers' tensors 6 bits by their place among the
  file's layers, so the 2-layer file's layers are not quantized as the target's first two are;
- measured for resident memory: each runtime loads the file in a fresh process (its modules imported
  before the baseline), the VmRSS delta after the load and after one 128-token prefill and 4 decoded
  tokens, against the file's tensor bytes; for hybridspec also the weights' own resident pages
  (mincore over the model's tensor storages: what the weights hold, apart from code and caches).

Files written by our own writer (`hybridspec quantize DIR OUT.gguf --type T`, the directory given a
small byte-level BPE tokenizer, which llama.cpp's loader needs) are loaded in llama.cpp as well: the
greedy tokens and the same agreement figures.

Without llama_cpp the quantized files are our writer's (Q4_K_M -> q4_k) and only hybridspec's side
runs; without a converter (`--sdist` / `--converter`, see llamacpp.py) the f32 source is our
writer's f32 file. The JSON says which.

    python benches/llamacpp_quant.py --sdist SDIST/llama_cpp_python-0.3.36.tar.gz   # the table (many minutes)
    python benches/llamacpp_quant.py --quick                                        # a tiny model
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

import torch

from common import bench_parser, describe_machine, print_table, write_json
from llamacpp import (FULL, QUICK, LlamaRunner, OursRunner, build_granite, converter_tree, convert,
                      layer_skip_draft, llama_cpp_missing, save_for_converter, set_threads, spread, time_runners)
from targets import LLAMA_MIN, SPEC_VS_LLAMA_MIN

# llama.cpp's file type -> our writer's block format (the fallback quantizer without llama_cpp)
FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_K_M": "q4_k"}
RESIDENT_WITHIN = 0.05  # target: resident weight memory within 5 % of the file's tensor bytes
PROBE_PROMPT, PROBE_NEW = 128, 4


# -- files ---------------------------------------------------------------------------------------------

def llama_quantize(source: Path, out: Path, ftype: str) -> Path:
    """llama.cpp's quantizer on a GGUF file (`LLAMA_FTYPE_MOSTLY_<ftype>`)."""
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize({source}, {ftype}) failed")
    return out


def our_quantize(directory: Path, out: Path, fmt: str | None) -> Path:
    """`hybridspec quantize DIR OUT --type fmt` (fmt None: f32)."""
    from hybridspec.cli.main import main as cli
    if cli(["quantize", str(directory), str(out), "--type", fmt or "f32"]) != 0:
        raise RuntimeError(f"hybridspec quantize {directory} {out} --type {fmt} failed")
    return out


def add_tokenizer(directory: Path, vocab_size: int) -> None:
    """A small byte-level BPE tokenizer.json in `directory` (our writer pads its vocabulary to the model's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 300), special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the cat sat on the mat", "hello world, def main(): return 0"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end|>").save_pretrained(directory)


def tensor_bytes(path: Path) -> tuple[int, dict[str, int]]:
    """(the file's tensor bytes, those bytes per ggml type)."""
    from gguf import GGUFReader
    by_type = Counter()
    for t in GGUFReader(path).tensors:
        by_type[t.tensor_type.name] += int(t.n_bytes)
    return sum(by_type.values()), dict(by_type)


# -- agreement -----------------------------------------------------------------------------------------

def ours_logits(model, prompt: list[int]) -> torch.Tensor:
    """Every prompt position's logits [T, vocab], float32."""
    from hybridspec.cache.hybrid_cache import HybridCache
    cache = HybridCache(model.config, max_seqs=1, num_blocks=len(prompt) // 16 + 2, block_size=16,
                        ring_slots=2, dtype=model.dtype)
    return model.prefill(cache, [0], [prompt])[0].float()


def llama_logits(path: Path, prompt: list[int]) -> torch.Tensor:
    """llama.cpp's logits at every prompt position [T, vocab] (a context with logits_all)."""
    from llama_cpp import Llama
    llm = Llama(model_path=str(path), n_ctx=len(prompt) + 8, n_batch=512, n_ubatch=512, logits_all=True,
                verbose=False)
    llm.eval(prompt)
    return torch.tensor(llm.scores[:len(prompt)]).float()


def agreement(a: torch.Tensor, b: torch.Tensor) -> dict:
    """a against the reference b, both [T, vocab]: top-1 agreement and max relative difference."""
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean()
    return dict(top1=float(top1), max_rel=float((a - b).abs().max() / b.abs().max()))


def same_tokens(a: list[int], b: list[int]) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(b)}"


# -- resident memory (a fresh process per runtime and file) --------------------------------------------

def vm_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


ISAS = ("native", "avx2")


def use_isa(isa: str) -> None:
    """Our native kernels' vector paths for the process (before a model loads: the products' weight
    layout follows the path): "avx2" sets the float products' and kernels' (`rows`) and the quantized
    products' (`quant`) to AVX2; "native" leaves each at the widest this CPU has."""
    if isa == "avx2":
        from hybridspec.kernels.cpu import quant, rows
        rows.vector_path("avx2")
        quant.vector_path("avx2")


def llama_system_info() -> str | None:
    """llama.cpp's own line of the instruction sets it was built with and uses (None without it)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.llama_print_system_info().decode(errors="replace").strip()


def probe_child(runtime: str, path: str, threads: int, isa: str = "native") -> None:
    """(run in a child) print {"load": bytes, "run": bytes}: VmRSS deltas after the load and a run."""
    prompt = torch.randint(1, 100, (PROBE_PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    if runtime == "llama.cpp":
        import llama_cpp  # noqa: F401  (the library's own memory before the baseline)
        before = vm_rss()
        runner = LlamaRunner(Path(path), threads, PROBE_PROMPT + PROBE_NEW + 8)
    else:
        import hybridspec as hs
        import hybridspec.adapters.gguf.loader  # noqa: F401  (the library's own modules before the baseline)
        use_isa(isa)
        set_threads(threads)
        before = vm_rss()
        model = hs.load(path)
        runner = OursRunner(model, PROBE_PROMPT + PROBE_NEW + 8)
    gc.collect()
    loaded = vm_rss()
    if runtime != "llama.cpp":  # the bytes the model's tensors hold (each storage once), and how many are resident
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in list(model.parameters()) + list(model.buffers())}
        weights = dict(model_tensor_bytes=sum(storages.values()), weights_resident=resident_bytes(storages))
    runner.run(prompt, PROBE_NEW)
    gc.collect()
    used = dict(load=loaded - before, run=vm_rss() - before)
    if runtime != "llama.cpp":
        used.update(weights)
    print(json.dumps(used))


def resident_bytes(ranges: dict[int, int]) -> int:
    """Bytes of the pages under these (address -> length) ranges that are in memory (mincore), each page
    once: the weights' own resident memory, whatever else the process holds."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    page = os.sysconf("SC_PAGE_SIZE")
    pages = set()
    for start, length in ranges.items():
        first, end = start // page * page, -(-(start + length) // page) * page
        count = (end - first) // page
        flags = (ctypes.c_ubyte * count)()
        if libc.mincore(first, end - first, flags) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        pages.update(first + i * page for i in range(count) if flags[i] & 1)
    return len(pages) * page


def resident(runtime: str, path: Path, threads: int, isa: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--probe", runtime, str(path), str(threads), isa],
                         check=True, capture_output=True, text=True, cwd=Path(__file__).parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- timing --------------------------------------------------------------------------------------------

def spec_label(source: str, gamma: int | str, draft_layers: int) -> str:
    """A speculative runner's label: its drafter ("file": the draft GGUF file; "layers": the target's
    own first layers, `draft="layers:N"`) and γ."""
    return f"{'draft file' if source == 'file' else f'layers:{draft_layers}'} γ={gamma}"


def spec_name(label: str) -> str:
    """The speculative runner of `label` (its name in the rows)."""
    return f"hybridspec {label}"


def timing_row(fmt: str, n: int, threads: int, labels: list[str], timed: dict) -> dict:
    s = timed["samples"]
    row = dict(format=fmt, prompt_len=n, threads=threads,
               acceptance_rates={label: timed["acceptances"][spec_name(label)] for label in labels})
    for name, (prefill, decode, _) in s.items():
        row[f"{name} decode tok/s"], row[f"{name} prefill tok/s"] = spread(decode), spread(prefill)
    if "llama.cpp" in s:
        row["plain tokens equal"] = same_tokens(s["hybridspec"][2], s["llama.cpp"][2])
    row["speculative equals plain"] = all(s[spec_name(label)][2] == s["hybridspec"][2] for label in labels)
    return row


def table_cells(row: dict) -> dict:
    med = {k: v["median"] for k, v in row.items() if isinstance(v, dict) and "median" in v}
    specs = {label: med[f"{spec_name(label)} decode tok/s"] for label in row["acceptance_rates"]}
    best = max(specs, key=specs.get)  # the fastest drafter and γ of those run (each one's figure kept beside it)
    cells = dict(format=row["format"], prompt=row["prompt_len"], threads=row["threads"],
                 ours_decode=med["hybridspec decode tok/s"], ours_prefill=med["hybridspec prefill tok/s"],
                 spec_decode=specs[best], drafter=best, acceptance=row["acceptance_rates"][best],
                 spec_by_drafter=", ".join(f"{label}: {v:.1f} ({row['acceptance_rates'][label]:.2f})"
                                           for label, v in specs.items()))
    if "llama.cpp decode tok/s" in med:
        cells.update(llama_decode=med["llama.cpp decode tok/s"], llama_prefill=med["llama.cpp prefill tok/s"],
                     tokens_equal=row["plain tokens equal"])
        cells.update(decode_ratio=cells["ours_decode"] / cells["llama_decode"],
                     prefill_ratio=cells["ours_prefill"] / cells["llama_prefill"],
                     spec_ratio=cells["spec_decode"] / cells["llama_decode"])
        cells.update(decode_met=cells["decode_ratio"] >= LLAMA_MIN, prefill_met=cells["prefill_ratio"] >= LLAMA_MIN,
                     spec_met=cells["spec_ratio"] >= SPEC_VS_LLAMA_MIN)
    return cells


# -- the run -------------------------------------------------------------------------------------------

def sources(args, shape: dict, work: Path):
    """(HF target, HF draft, {name: (target f32 GGUF, draft f32 GGUF, model directory)}, how)."""
    tree, how = None, "llama.cpp's convert_hf_to_gguf.py"
    try:
        tree = converter_tree(args.sdist, args.converter, work)
    except (FileNotFoundError, tarfile.TarError) as exc:
        how = f"hybridspec's writer (no converter: {exc})"
    hf = build_granite(shape, scale_from=args.draft_layers, scale=args.scale)
    draft = layer_skip_draft(hf, args.draft_layers)
    files = {}
    for name, model in (("target", hf), ("draft", draft)):
        directory = work / name
        shutil.rmtree(directory, ignore_errors=True)  # a kept folder's tokenizer.json (below) would stop the converter
        save_for_converter(model, directory)
        f32 = convert(tree, directory, "f32") if tree is not None else None
        add_tokenizer(directory, shape["vocab_size"])  # after the converter: it would want a known pre-tokenizer
        files[name] = (f32 or our_quantize(directory, directory / "model-ours-f32.gguf", None), directory)
    return hf, files, how


def gamma_arg(text: str) -> int | str:
    """--gamma: a positive integer or auto."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive integer or auto")
    return int(text)


def quantized(files: dict, fmt: str, work: Path, missing: str | None) -> dict[str, Path]:
    """{"target"|"draft": the file in format fmt}: llama.cpp's quantizer, or our writer without llama_cpp."""
    out = {}
    for name, (f32, directory) in files.items():
        path = work / f"{name}-{fmt}.gguf"
        out[name] = (our_quantize(directory, path, FORMATS[fmt]) if missing else llama_quantize(f32, path, fmt))
    return out


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--probe"]:
        probe_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return 0
    parser = bench_parser(__doc__)
    parser.add_argument("--sdist", type=Path, default=None, help="llama-cpp-python's sdist (.tar.gz or unpacked)")
    parser.add_argument("--converter", type=Path, default=None, help="a llama.cpp tree with convert_hf_to_gguf.py")
    parser.add_argument("--formats", nargs="+", choices=tuple(FORMATS), default=list(FORMATS))
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=None, help="default 128 2048 (quick: 16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 64 (quick: 4)")
    parser.add_argument("--thread-counts", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument("--draft-layers", type=int, default=None, help="the draft's layers (default 2; quick 1)")
    parser.add_argument("--gamma", type=gamma_arg, nargs="+", default=[4],
                        help="drafts per round, or auto (num_draft_tokens='auto': chosen per round, up to 8); "
                             "several: each timed, the fastest in the table's speculative column")
    parser.add_argument("--drafts", nargs="+", choices=("file", "layers"), default=["file", "layers"],
                        help="the drafters timed: 'file' the draft GGUF file (the first --draft-layers layers, "
                             "quantized by the same tool), 'layers' the target's own first layers "
                             "(draft='layers:N', the same file); default both")
    parser.add_argument("--scale", type=float, default=0.01, help="λ, as in llamacpp.py")
    parser.add_argument("--no-memory", action="store_true", help="skip the resident-memory probes")
    parser.add_argument("--keep", type=Path, default=None,
                        help="write the GGUF files into this folder and keep them (default: a temporary one)")
    parser.add_argument("--isa", choices=ISAS, default="native",
                        help="native: our kernels' widest paths on this CPU; avx2: every native kernel on its AVX2 "
                             "path (no AVX-512), standing in for a CPU without AVX-512 (Zen 2/3, Intel client "
                             "cores): pair it with a llama.cpp built without AVX-512 (PYTHONPATH)")
    args = parser.parse_args(argv)
    import hybridspec as hs
    use_isa(args.isa)

    shape = QUICK if args.quick else FULL
    prompt_lens = args.prompt_lens or ([16] if args.quick else [128, 2048])
    new_tokens = args.new_tokens or (4 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)
    args.draft_layers = args.draft_layers or (1 if args.quick else 2)
    missing = llama_cpp_missing()
    threads_before = torch.get_num_threads()
    g = torch.Generator().manual_seed(1)
    prompts = {n: torch.randint(1, shape["vocab_size"], (n,), generator=g).tolist() for n in prompt_lens}
    first = prompts[prompt_lens[0]]
    max_len = max(prompt_lens) + new_tokens + max(8 if g == "auto" else g for g in args.gamma) + 8
    llama_isa = None if missing else llama_system_info()
    print(f"Granite-4.0-H-shaped random model; {describe_machine()}; our kernels' paths: {args.isa}; "
          f"llama.cpp: {llama_isa}", flush=True)
    checks, rows, memory, writer = [], [], [], []

    def save(complete: bool) -> None:
        """The JSON so far (written after every row: a long run stopped early keeps its rows)."""
        write_json(args.out or "llamacpp_quant.json", dict(
            bench="llamacpp_quant", quick=args.quick, complete=complete, model=dict(family="granitemoehybrid", **shape),
            source=how, quantizer="hybridspec's writer" if missing else "llama.cpp's llama_model_quantize",
            llama_cpp_skipped=missing, isa=args.isa, llama_cpp_system_info=llama_isa, new_tokens=new_tokens, repeats=repeats, thread_counts=args.thread_counts,
            speculative=dict(draft_layers=args.draft_layers, gamma=args.gamma, drafts=args.drafts, scale=args.scale),
            targets=dict(decode=LLAMA_MIN, prefill=LLAMA_MIN, speculative=SPEC_VS_LLAMA_MIN,
                         resident_within=RESIDENT_WITHIN),
            checks=checks, memory=memory, writer=writer, rows=rows, table=[table_cells(r) for r in rows]))
    with contextlib.nullcontext(str(args.keep)) if args.keep else tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        hf, files, how = sources(args, shape, work)
        set_threads(1)
        with torch.inference_mode():
            reference = hf(torch.tensor([first])).logits[0].float()  # HF float32, every prompt position
        for fmt in ["F32"] + args.formats:
            paths = {"target": files["target"][0]} if fmt == "F32" else quantized(files, fmt, work, missing)
            total, by_type = tensor_bytes(paths["target"])
            target = hs.load(paths["target"])
            ours = ours_logits(target, first)
            check = dict(format=fmt, tensor_bytes=total, tensor_bytes_by_type=by_type,
                         ours_vs_hf=agreement(ours, reference))
            if not missing:
                theirs = llama_logits(paths["target"], first)
                check.update(llama_vs_hf=agreement(theirs, reference), ours_vs_llama=agreement(ours, theirs))
            checks.append(check)
            print(f"agreement ({fmt}): {check}", flush=True)
            if fmt == "F32":
                del target
                continue
            if not args.no_memory:
                for runtime in ("hybridspec",) + (() if missing else ("llama.cpp",)):
                    used = resident(runtime, paths["target"], 1, args.isa)
                    memory.append(dict(format=fmt, runtime=runtime, tensor_bytes=total, **used,
                                       load_vs_file=used["load"] / total, run_vs_file=used["run"] / total,
                                       **({"weights_vs_file": used["weights_resident"] / total}
                                          if "weights_resident" in used else {})))
                    print(f"resident ({fmt}, {runtime}): {memory[-1]}", flush=True)
            drafts = {"file": hs.load(paths["draft"]) if "file" in args.drafts else None,
                      "layers": f"layers:{args.draft_layers}"}
            labels = {spec_label(source, g, args.draft_layers): (drafts[source], g)
                      for source in args.drafts for g in args.gamma}
            ours_plain = OursRunner(target, max_len)
            ours_specs = {spec_name(label): OursRunner(target, max_len, draft, g) for label, (draft, g) in labels.items()}
            llamas = {} if missing else {t: LlamaRunner(paths["target"], t, max_len) for t in args.thread_counts}
            for n, prompt in prompts.items():
                for threads in args.thread_counts:
                    runners = {"hybridspec": ours_plain, **ours_specs,
                               **({"llama.cpp": llamas[threads]} if llamas else {})}
                    timed = time_runners(runners, prompt, threads, new_tokens, repeats)
                    rows.append(timing_row(fmt, n, threads, list(labels), timed))
                    print(f"{fmt}, prompt {n}, {threads} thread(s): {table_cells(rows[-1])}", flush=True)
                    save(False)
            del llamas, ours_plain, ours_specs, drafts, target
        writer.extend(writer_checks(args, files, work, first, reference, new_tokens, missing))
    set_threads(threads_before)
    report([table_cells(r) for r in rows], checks, memory, writer, new_tokens, repeats, args)
    if missing:
        print(f"llama.cpp side skipped: {missing}", flush=True)
    save(True)
    return 0


def writer_checks(args, files: dict, work: Path, prompt: list[int], reference: torch.Tensor, new_tokens: int,
                  missing: str | None) -> list[dict]:
    """Files from `hybridspec quantize` in llama.cpp: agreement and greedy tokens against ours."""
    import hybridspec as hs
    out = []
    directory = files["target"][1]
    set_threads(1)
    for fmt in args.formats:
        path = our_quantize(directory, work / f"ours-{FORMATS[fmt]}.gguf", FORMATS[fmt])
        model = hs.load(path)
        ours = ours_logits(model, prompt)
        row = dict(format=FORMATS[fmt], ours_vs_hf=agreement(ours, reference))
        if not missing:
            ours_tokens = OursRunner(model, len(prompt) + new_tokens + 8).run(prompt, new_tokens)[0]
            llama_tokens = LlamaRunner(path, 1, len(prompt) + new_tokens + 8).run(prompt, new_tokens)[0]
            row.update(ours_vs_llama=agreement(ours, llama_logits(path, prompt)),
                       greedy_tokens_equal=same_tokens(ours_tokens, llama_tokens))
        out.append(row)
        print(f"hybridspec quantize --type {FORMATS[fmt]} in llama.cpp: {row}", flush=True)
    return out


def report(table, checks, memory, writer, new_tokens, repeats, args) -> None:
    flat = [dict(format=c["format"], **{f"{k} {m}": v[m] for k, v in c.items() if isinstance(v, dict) and "top1" in v
                                       for m in ("top1", "max_rel")}) for c in checks + [
        dict(format=f"ours {w['format']}", **{k: v for k, v in w.items() if k != "format"}) for w in writer]]
    print_table(flat, title="logit agreement over the first prompt's positions (top-1, max |a-b| / max |b|)")
    print_table(memory, ["format", "runtime", "tensor_bytes", "model_tensor_bytes", "weights_resident", "load", "run",
                         "weights_vs_file", "load_vs_file", "run_vs_file"],
                title=f"resident memory: the weights' own pages (mincore), VmRSS delta of a fresh process after load / "
                      f"after a {PROBE_PROMPT}-token run")
    print_table(table, [("format", "format"), ("prompt", "prompt"), ("threads", "threads"),
                        ("ours_decode", "ours decode"), ("llama_decode", "llama.cpp decode"), ("decode_ratio", "×"),
                        ("ours_prefill", "ours prefill"), ("llama_prefill", "llama.cpp prefill"),
                        ("prefill_ratio", "×"), ("spec_decode", "ours speculative"), ("drafter", "drafter"),
                        ("acceptance", "acceptance"),
                        ("spec_ratio", "spec / llama.cpp plain"), ("tokens_equal", "tokens equal"),
                        ("spec_by_drafter", "speculative by drafter (acceptance)")],
                title=f"tok/s, {new_tokens} new tokens, medians of {repeats}; drafts: the first {args.draft_layers} "
                      f"layers ({' and '.join(args.drafts)}), γ = {' '.join(map(str, args.gamma))} (the fastest "
                      f"in the table), λ = {args.scale:g}")


if __name__ == "__main__":
    sys.exit(main())
