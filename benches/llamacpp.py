"""Batch-1 greedy decode and prefill against llama.cpp on the same weights.

A random Granite-4.0-H-shaped model (212M parameters: hidden 1024, 12 layers
with attention at 5 and 11, no positional embedding, 32 Mamba-2 heads of 64,
d_state 128, a dense shared MLP of 2048, vocabulary 32,000, Granite's
multipliers) is built with `transformers.GraniteMoeHybridForCausalLM`
(nothing downloaded), saved, and converted with llama.cpp's own
`convert_hf_to_gguf.py` (f32, and bf16 for a copy whose every weight is a
bfloat16 value). hybridspec runs it through `hs.Engine` (weights packed for
CPU: the bf16 copy stored in 16 bits and widened exactly; as "bf16-compute",
the same copy under `compute="bfloat16"`, bfloat16 products as llama.cpp's), llama.cpp through
llama-cpp-python. Both get the same prompt ids; the table gives
hybridspec / llama.cpp tokens per second for decode (new tokens after the
first, per second) and prefill (prompt tokens per second), per weight type,
prompt length and thread count, runs interleaved (hybridspec, llama.cpp,
hybridspec, ...), medians of `--repeats` with min-max in the JSON. Before
timing, the runtimes are checked to agree on the model: the last prompt
position's float32 logits against HF's, and the greedy tokens.

Speculative rows for hybridspec (issue: "plain and speculative for us"): the
draft is the target's first `--draft-layers` layers with its embedding, final
norm and LM head (a layer-skip draft, copies of the weights), γ =
`--gamma`. Random weights give a random draft nothing to agree on, so, as
`e2e.py`'s random pair does, the target's later layers have their output
projections scaled by `--scale` (λ) for every run here, llama.cpp's
included (the same weights everywhere; a dense model's speed does not depend
on its values): λ = 0 makes the draft exact, larger λ lowers acceptance. The
table gives our speculative decode against llama.cpp's plain decode, the
acceptance rate reached, and whether the issue's target (≥ 1.5× llama.cpp
plain) is met; the speculative tokens are checked equal to the plain ones.

llama.cpp is not a dependency and nothing here builds it. To run the
comparison, once:

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36   # builds llama.cpp: ~11+ min on 2 cores
    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d SDIST_DIR  # its sdist carries the converter

then

    python benches/llamacpp.py --sdist SDIST_DIR/llama_cpp_python-0.3.36.tar.gz   # the table (minutes)
    python benches/llamacpp.py --quick            # a tiny model: hybridspec's side, llama.cpp's where installed

(`--converter DIR` takes an unpacked llama.cpp tree instead of the sdist; the
converter needs the `gguf` package, which the tree's gguf-py provides, and
numpy, tqdm and pyyaml.) Without llama_cpp or a converter, the llama.cpp
columns are left empty and the JSON says why.

Quantized weights (Q8_0, Q4_0, Q4_K_M, quantized by llama.cpp's own quantizer, the same file
in both runtimes, with agreement and resident memory): `llamacpp_quant.py`, which reuses this
module's model, converter and runners.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from common import bench_parser, describe_machine, print_table, write_json
from targets import SPEC_VS_LLAMA_MIN as SPEC_TARGET  # speculative decode at least this times llama.cpp's plain

GRANITE_MULTIPLIERS = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                           logits_scaling=4.0)
FULL = dict(hidden_size=1024, num_hidden_layers=12, attention_layers=(5, 11), intermediate_size=2048,
            num_attention_heads=16, num_key_value_heads=4, mamba_n_heads=32, mamba_d_head=64, mamba_d_state=128,
            vocab_size=32000)
QUICK = dict(hidden_size=64, num_hidden_layers=3, attention_layers=(1,), intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
             vocab_size=512)
# our name: the converter's --outtype. "bf16-compute" (asked for with --weights; a CPU with AVX512-BF16):
# the bfloat16 weights under our opt-in fast path (`compute="bfloat16"`: activations rounded to bfloat16,
# the BF16 dot product, as llama.cpp's bf16 does; not the float32 bits)
WEIGHTS = {"float32": "f32", "bfloat16": "bf16", "bf16-compute": "bf16"}
OUTPUT_PROJECTIONS = ("mamba.out_proj.weight", "self_attn.o_proj.weight", "shared_mlp.output_linear.weight")


def build_granite(shape: dict, seed: int = 0, bf16_values: bool = False, scale_from: int | None = None,
                  scale: float = 1.0):
    """A random float32 GraniteMoeHybridForCausalLM, dense shared MLP, no positional embedding
    (Granite-4.0-H's); the output projections of layers >= `scale_from` multiplied by `scale`
    (see the module docstring); with `bf16_values` every weight then rounded to a bfloat16 value."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    shape = dict(shape)
    attention = shape.pop("attention_layers")
    layer_types = ["attention" if i in attention else "mamba" for i in range(shape["num_hidden_layers"])]
    config = GraniteMoeHybridConfig(
        **shape, shared_intermediate_size=shape["intermediate_size"], layer_types=layer_types,
        num_local_experts=0, num_experts_per_tok=0, position_embedding_type="nope", mamba_n_groups=1,
        mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=64, max_position_embeddings=4096,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=None, eos_token_id=None, **GRANITE_MULTIPLIERS)
    torch.manual_seed(seed)
    model = GraniteMoeHybridForCausalLM(config).float().eval()
    if scale_from is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                parts = name.split(".")
                if name.endswith(OUTPUT_PROJECTIONS) and parts[1] == "layers" and int(parts[2]) >= scale_from:
                    p.mul_(scale)
    if bf16_values:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
    model.generation_config.eos_token_id = None
    return model


def layer_skip_draft(hf_target, draft_layers: int):
    """A GraniteMoeHybridForCausalLM of the target's first `draft_layers` layers, embedding, final
    norm and LM head (copies of the weights)."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    config = hf_target.config.to_dict()
    config.update(num_hidden_layers=draft_layers, layer_types=config["layer_types"][:draft_layers])
    draft = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**config)).float().eval()
    missing = draft.load_state_dict(hf_target.state_dict(), strict=False).missing_keys
    if missing:
        raise RuntimeError(f"layer-skip draft: no target weights for {missing}")
    draft.generation_config.eos_token_id = None
    return draft


# -- llama.cpp -------------------------------------------------------------------------------------

def llama_cpp_missing() -> str | None:
    """Why llama.cpp's side cannot run here, or None."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return f"llama_cpp is not importable ({exc}); see the docstring for the pip install step"
    return None


def converter_tree(sdist: Path | None, converter: Path | None, work: Path) -> Path:
    """The llama.cpp source tree holding convert_hf_to_gguf.py (unpacked from the sdist when given one)."""
    if converter is not None:
        return converter
    if sdist is None:
        raise FileNotFoundError("no --sdist or --converter given: llama.cpp's convert_hf_to_gguf.py is needed")
    if sdist.is_dir():
        trees = list(sdist.glob("**/vendor/llama.cpp/convert_hf_to_gguf.py"))
    else:
        with tarfile.open(sdist) as tar:
            tar.extractall(work / "sdist", filter="data")
        trees = list((work / "sdist").glob("*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not trees:
        raise FileNotFoundError(f"{sdist} holds no vendor/llama.cpp/convert_hf_to_gguf.py")
    return trees[0].parent


HUB_LAYER_TYPES = {"linear_attention": "mamba", "full_attention": "attention"}  # transformers 5 -> Granite's


def save_for_converter(model, model_dir: Path) -> None:
    """save_pretrained, with the layer types under the names Granite models on the Hub use
    (the converter reads "mamba" / "attention"; transformers 5 writes its own names)."""
    model.save_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["layer_types"] = [HUB_LAYER_TYPES.get(t, t) for t in config["layer_types"]]
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))


def convert(tree: Path, model_dir: Path, outtype: str) -> Path:
    """llama.cpp's converter on a saved HF model: the GGUF file's path."""
    out = model_dir / f"model-{outtype}.gguf"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(model_dir), "--outfile", str(out),
                    "--outtype", outtype], check=True, cwd=tree, env=env, capture_output=True)
    return out


class LlamaRunner:
    """llama-cpp-python over one GGUF at one thread count: greedy decode of one prompt."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int):
        from llama_cpp import Llama
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, n_ubatch=512, verbose=False)

    def last_logits(self) -> torch.Tensor:
        """The logits of the last input evaluated (llama.cpp's own buffer: `Llama.scores` holds them
        only with logits_all, which would make every prompt position's)."""
        import numpy as np
        vocab = self.llm.n_vocab()
        return torch.from_numpy(np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(vocab,)).copy())

    def run(self, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float]:
        """(greedy tokens, prefill seconds, decode seconds of the tokens after the first)."""
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(prompt)
        prefilled = time.perf_counter()
        tokens = [int(self.last_logits().argmax())]
        for _ in range(new_tokens - 1):
            self.llm.eval([tokens[-1]])
            tokens.append(int(self.last_logits().argmax()))
        return tokens, prefilled - start, time.perf_counter() - prefilled


# -- hybridspec ------------------------------------------------------------------------------------

def time_runners(runners: dict, prompt: list[int], threads: int, new_tokens: int, repeats: int) -> dict:
    """Interleaved runs: {name: (prefill tok/s samples, decode tok/s samples, tokens)}, the speculative
    runners' acceptance (median over all of them) and each one's (`acceptances`, by name)."""
    samples = {name: ([], [], None) for name in runners}
    accepted, by_name = [], {}
    for runner in runners.values():  # warm-up
        set_threads(threads)
        runner.run(prompt, min(new_tokens, 4))
    for _ in range(repeats):
        for name, runner in runners.items():
            set_threads(threads)
            tokens, prefill_s, decode_s = runner.run(prompt, new_tokens)
            prefill, decode, _ = samples[name]
            prefill.append(len(prompt) / prefill_s)
            decode.append((new_tokens - 1) / decode_s)
            samples[name] = (prefill, decode, tokens)
            if getattr(runner, "speculative", False):
                accepted.append(runner.acceptance_rate())
                by_name.setdefault(name, []).append(accepted[-1])
    return dict(samples=samples, acceptance=statistics.median(accepted) if accepted else None,
                acceptances={name: statistics.median(rates) for name, rates in by_name.items()})


class OursRunner:
    """hs.Engine over the packed model, plain or with a draft (γ drafts per round): greedy
    decode of one prompt."""

    def __init__(self, target, max_len: int, draft=None, gamma: int = 4):
        import hybridspec as hs
        self.hs, self.target = hs, target
        self.speculative = draft is not None
        spec = dict(draft=draft, num_draft_tokens=gamma) if self.speculative else {}
        self.engine = hs.Engine(target, max_batch_size=1, max_model_len=max_len, prefix_cache=False, **spec)

    def run(self, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float]:
        """(greedy tokens, prefill seconds, decode seconds of the tokens after the first), from one
        request: the prefill ends when it emits the first token (`Engine.step`'s first_tokens,
        called before that step's round). The decode seconds are those of the steps after the
        first, scaled to the new_tokens - 1 tokens: the first step's round is where a draft
        absorbs the prompt (`ModelDrafter.start`), prefill work that at a long prompt outweighs
        the decode. When the first step ends the request, from the first token instead."""
        params = self.hs.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        tokens, first = [], []

        def on_first(outputs):
            first.append(time.perf_counter())
            tokens.extend(t for out in outputs for t in out.token_ids)
        self.engine.stats.reset()
        start = time.perf_counter()
        self.engine.add_request(prompt, params)
        steps = []  # (time, tokens so far) after each step
        while self.engine.has_unfinished_requests():
            for out in self.engine.step(first_tokens=on_first):
                tokens.extend(out.token_ids)
            steps.append((time.perf_counter(), len(tokens)))
        (after_first, emitted), end = steps[0], steps[-1][0]
        if len(tokens) > emitted:
            return tokens, first[0] - start, (end - after_first) * (new_tokens - 1) / (len(tokens) - emitted)
        return tokens, first[0] - start, end - first[0]

    def acceptance_rate(self) -> float | None:
        """The last generate's accepted / drafted tokens (None: plain)."""
        return self.engine.stats.as_dict()["acceptance_rate"] if self.speculative else None

    def last_logits(self, prompt: list[int]) -> torch.Tensor:
        from hybridspec.cache.hybrid_cache import HybridCache
        cache = HybridCache(self.target.config, max_seqs=1, num_blocks=len(prompt) // 16 + 2, block_size=16,
                            ring_slots=2, dtype=self.target.dtype)
        return self.target.prefill(cache, [0], [prompt], last_only=True)[0, -1]


def set_threads(threads: int) -> None:
    from hybridspec.kernels.cpu import native as cpu_native
    torch.set_num_threads(threads)
    cpu_native.sync_threads()


def spread(samples: list[float]) -> dict:
    return dict(median=statistics.median(samples), min=min(samples), max=max(samples), samples=samples)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--sdist", type=Path, default=None, help="llama-cpp-python's sdist (.tar.gz or unpacked)")
    parser.add_argument("--converter", type=Path, default=None, help="a llama.cpp tree with convert_hf_to_gguf.py")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=None, help="default 128 2048")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 64")
    parser.add_argument("--thread-counts", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--weights", nargs="+", choices=tuple(WEIGHTS), default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=None, help="default 3")
    parser.add_argument("--draft-layers", type=int, default=None, help="the speculative draft's layers (default 2; 1 quick)")
    parser.add_argument("--gamma", type=int, default=4, help="drafts per round")
    parser.add_argument("--scale", type=float, default=0.01,
                        help="λ: the target's layers past the draft's have their output projections times λ")
    args = parser.parse_args(argv)
    import hybridspec as hs

    shape = QUICK if args.quick else FULL
    prompt_lens = args.prompt_lens or ([16] if args.quick else [128, 2048])
    new_tokens = args.new_tokens or (4 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)
    draft_layers = args.draft_layers or (1 if args.quick else 2)
    missing = llama_cpp_missing()
    threads_before = torch.get_num_threads()
    g = torch.Generator().manual_seed(1)
    prompts = {n: torch.randint(1, shape["vocab_size"], (n,), generator=g).tolist() for n in prompt_lens}
    rows, checks = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tree = None
        if missing is None:
            try:
                tree = converter_tree(args.sdist, args.converter, work)
            except (FileNotFoundError, tarfile.TarError) as exc:
                missing = str(exc)
        for weights in args.weights:
            hf = build_granite(shape, bf16_values=weights != "float32", scale_from=draft_layers, scale=args.scale)
            target = hs.from_hf(hf).pack_for_cpu()
            if weights == "bf16-compute":
                target.set_compute("bfloat16")
            ours = OursRunner(target, max(prompt_lens) + new_tokens + 8)
            draft = hs.from_hf(layer_skip_draft(hf, draft_layers)).pack_for_cpu()
            ours_spec = OursRunner(target, max(prompt_lens) + new_tokens + args.gamma + 8, draft, args.gamma)
            params = target.num_parameters()
            print(f"Granite-4.0-H-shaped random model: {params / 1e6:.1f}M parameters, {weights} weights; "
                  f"{describe_machine()}", flush=True)
            llamas = {}
            if missing is None:
                model_dir = work / weights
                save_for_converter(hf, model_dir)
                gguf = convert(tree, model_dir, WEIGHTS[weights])
                llamas = {t: LlamaRunner(gguf, t, max(prompt_lens) + new_tokens + 8) for t in args.thread_counts}
            # agreement: the last prompt position's logits against HF's, and the greedy tokens
            prompt = prompts[prompt_lens[0]]
            set_threads(1)
            with torch.inference_mode():
                reference = hf(torch.tensor([prompt])).logits[0, -1].float()
            check = dict(weights=weights, prompt_len=len(prompt),
                         ours_vs_hf=float((ours.last_logits(prompt) - reference).abs().max()))
            ours_tokens = ours.run(prompt, new_tokens)[0]
            check["spec_equals_plain"] = ours_spec.run(prompt, new_tokens)[0] == ours_tokens
            if llamas:
                llama = llamas[args.thread_counts[0]]
                llama.run(prompt, 1)  # the prompt alone: its last position's logits
                check["llama_vs_hf"] = float((llama.last_logits() - reference).abs().max())
                llama_tokens = llama.run(prompt, new_tokens)[0]
                check.update(tokens_equal=sum(a == b for a, b in zip(ours_tokens, llama_tokens)),
                             first_difference=next((i for i, (a, b) in enumerate(zip(ours_tokens, llama_tokens))
                                                    if a != b), None))
            check["new_tokens"] = new_tokens
            checks.append(check)
            print(f"agreement ({weights}): {check}", flush=True)
            for n, prompt in prompts.items():
                for threads in args.thread_counts:
                    runners = {"hybridspec": ours, "hybridspec speculative": ours_spec,
                               **({"llama.cpp": llamas[threads]} if llamas else {})}
                    timed = time_runners(runners, prompt, threads, new_tokens, repeats)
                    row = dict(weights=weights, prompt_len=n, threads=threads, draft_layers=draft_layers,
                               gamma=args.gamma, scale=args.scale, acceptance_rate=timed["acceptance"])
                    for name, (prefill, decode, _) in timed["samples"].items():
                        row[f"{name} decode tok/s"] = spread(decode)
                        row[f"{name} prefill tok/s"] = spread(prefill)
                    rows.append(row)
                    print(f"{weights}, prompt {n}, {threads} thread(s): " + ", ".join(
                        f"{name} decode {statistics.median(d):.1f} prefill {statistics.median(p):.0f} tok/s"
                        for name, (p, d, _) in timed["samples"].items()), flush=True)
            del llamas, ours, ours_spec, draft, target, hf
    set_threads(threads_before)
    table = []
    for row in rows:
        cells = dict(weights=row["weights"], prompt=row["prompt_len"], threads=row["threads"],
                     ours_decode=row["hybridspec decode tok/s"]["median"],
                     ours_prefill=row["hybridspec prefill tok/s"]["median"],
                     spec_decode=row["hybridspec speculative decode tok/s"]["median"],
                     acceptance=row["acceptance_rate"])
        if "llama.cpp decode tok/s" in row:
            cells.update(llama_decode=row["llama.cpp decode tok/s"]["median"],
                         llama_prefill=row["llama.cpp prefill tok/s"]["median"])
            cells.update(decode_ratio=cells["ours_decode"] / cells["llama_decode"],
                         prefill_ratio=cells["ours_prefill"] / cells["llama_prefill"],
                         spec_ratio=cells["spec_decode"] / cells["llama_decode"])
            cells["spec_target_met"] = cells["spec_ratio"] >= SPEC_TARGET
        table.append(cells)
    print_table(table, [("weights", "weights"), ("prompt", "prompt"), ("threads", "threads"),
                        ("ours_decode", "ours decode tok/s"), ("llama_decode", "llama.cpp decode tok/s"),
                        ("decode_ratio", "decode ×"), ("ours_prefill", "ours prefill tok/s"),
                        ("llama_prefill", "llama.cpp prefill tok/s"), ("prefill_ratio", "prefill ×")],
                title=f"batch-1 greedy, {new_tokens} new tokens, medians of {repeats} (hybridspec / llama.cpp)")
    print_table(table, [("weights", "weights"), ("prompt", "prompt"), ("threads", "threads"),
                        ("ours_decode", "ours plain tok/s"), ("spec_decode", "ours speculative tok/s"),
                        ("acceptance", "acceptance"), ("llama_decode", "llama.cpp plain tok/s"),
                        ("spec_ratio", "speculative / llama.cpp plain"),
                        ("spec_target_met", f"≥ {SPEC_TARGET}× (target)")],
                title=f"speculative decode: draft = the first {draft_layers} layers, γ = {args.gamma}, later "
                      f"layers' output projections × λ = {args.scale:g} (every runtime, the same weights)")
    if missing:
        print(f"llama.cpp side skipped: {missing}", flush=True)
    write_json(args.out or "llamacpp.json", dict(
        bench="llamacpp", quick=args.quick, model=dict(family="granitemoehybrid", **shape, **GRANITE_MULTIPLIERS),
        new_tokens=new_tokens, repeats=repeats, thread_counts=args.thread_counts, llama_cpp_skipped=missing,
        speculative=dict(draft_layers=draft_layers, gamma=args.gamma, scale=args.scale, target_vs_llama=SPEC_TARGET),
        checks=checks, rows=rows, table=table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
