"""Decode ms per token and prefill ms against prompt length, engine against HF `generate`.

Workloads (greedy, batch 1):
- the embedded pair (`hybridspec.adapters.embedded`): prefixes of one held-out
  standard-library file (the prompts of `benches/e2e.py`), 128 ... 4,000 bytes;
  speculative decoding drafts with the embedded draft model;
- a random hybrid with Bamba-9B's proportions scaled to this CPU: its 32
  layers with attention at 9, 18 and 27, GQA 4:1, Mamba2 d_state 128 and
  head dim 64, MLP 3.5 x hidden, at hidden 256; prompts of random tokens,
  1k ... 16k tokens; the speculative draft is its first two layers with the
  later layers' output projections scaled by `--scale` (as in `benches/e2e.py`).

At each length the three implementations take turns call by call
(`--repeats` calls each; median, with min-max), after one warm-up call each
at the workload's first length. Each call
generates `--new-tokens` tokens after the prompt and stamps the time as tokens
arrive: HF through a logits processor (after every forward), the engine
through its `stream` callback (after every step, or every speculative round).
Prefill is the time to the first stamp; ms per token is the time from the
first stamp to the last over the tokens in between. Speculative decoding
prefills its draft after the first token, so its ms per token starts at the
end of its first round, and that round (the draft's prefill, one draft and
verify) is in neither column: taking its tokens off at the later rate left a
prefill below zero on a loaded machine. Each stamp also
reads the thread's CPU time (`time.thread_time`; one torch thread): CPU ms
per token, which other jobs on a shared machine disturb less than wall time.
"growth" is the ratio to the shortest prompt of the same column.

    python benches/context_scaling.py            # the measurement (many minutes)
    python benches/context_scaling.py --quick    # a smoke run
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common import bench_parser, describe_machine, print_table, save_png, set_threads, write_json
from e2e import heldout_prompts, layer_skip_draft, scale_later_layers_
from plain_decode import first_mismatch

EMBEDDED_LENS, EMBEDDED_LENS_QUICK = [128, 500, 1000, 2000, 3000, 4000], [32, 96]
RANDOM_LENS, RANDOM_LENS_QUICK = [1024, 2048, 4096, 8192, 16384], [64, 192]
RANDOM_HYBRID = dict(hidden_size=256, num_hidden_layers=32, attn_layer_indices=[9, 18, 27], intermediate_size=896,
                     num_attention_heads=4, num_key_value_heads=1, mamba_n_heads=8, mamba_d_head=64,
                     mamba_d_state=128, vocab_size=8192)
RANDOM_HYBRID_QUICK = dict(hidden_size=64, num_hidden_layers=4, attn_layer_indices=[1], intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=1, mamba_n_heads=4, mamba_d_head=32,
                           mamba_d_state=16, vocab_size=512)
IMPLEMENTATIONS = ("engine", "spec", "hf")


@dataclass
class Workload:
    name: str
    unit: str  # what a prompt length counts: "bytes" or "tokens"
    target: object  # hs.HybridModel
    draft: object  # hs.HybridModel
    hf: object  # the target as an HF model
    prompt: list[int]  # the longest prompt; shorter ones are its prefixes
    lengths: list[int]


# -- workloads --------------------------------------------------------------------------------

def embedded_workload(lengths: list[int]) -> Workload:
    import hybridspec as hs
    from hybridspec.adapters.embedded import embedded_paths
    from transformers import BambaForCausalLM
    target_dir, draft_dir = embedded_paths()
    hf = BambaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    no_eos(hf)
    prompt = heldout_prompts(1, max(lengths))[0]
    return Workload("embedded pair", "bytes", hs.load(target_dir), hs.load(draft_dir), hf, prompt, lengths)


def random_workload(shape: dict, lengths: list[int], new_tokens: int, scale: float) -> Workload:
    import hybridspec as hs
    from transformers import BambaConfig, BambaForCausalLM
    config = BambaConfig(**shape, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
                         max_position_embeddings=max(lengths) + new_tokens + 8, tie_word_embeddings=False,
                         pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(3)
    hf = BambaForCausalLM(config).float().eval()
    no_eos(hf)
    draft = layer_skip_draft(hf, 2)
    scale_later_layers_(hf, 2, scale)
    target = hs.from_hf(hf).pack_for_cpu()  # input-major copies, as hs.load gives on CPU; hf keeps its own
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(1, shape["vocab_size"], (max(lengths),), generator=g).tolist()
    name = f"random hybrid {target.num_parameters() / 1e6:.3g}M"
    return Workload(name, "tokens", target, hs.from_hf(draft).pack_for_cpu(), hf, prompt, lengths)


def no_eos(hf) -> None:
    """HF decodes exactly max_new_tokens."""
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0


# -- one call each ----------------------------------------------------------------------------

CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


class Stamps:
    """Times at which tokens arrive, on both clocks: `stamp(n)` after n more tokens."""

    def __init__(self):
        self.start = {name: clock() for name, clock in CLOCKS.items()}
        self.times: list[dict[str, float]] = []
        self.counts: list[int] = []  # tokens received by each stamp, cumulative

    def stamp(self, num_tokens: int) -> None:
        self.times.append({name: clock() for name, clock in CLOCKS.items()})
        self.counts.append((self.counts[-1] if self.counts else 0) + num_tokens)

    def timings(self, first: int) -> dict[str, tuple[float, float]]:
        """clock -> (prefill seconds, seconds per token), per token from stamp `first` to the last;
        prefill is the time to stamp 0 less its tokens after the first at that rate."""
        tokens = self.counts[-1] - self.counts[first]
        if tokens == 0:
            raise ValueError(f"no tokens arrived after stamp {first} of {len(self.counts)}; raise --new-tokens")
        out = {}
        for name in CLOCKS:
            per_token = (self.times[-1][name] - self.times[first][name]) / tokens
            to_first = self.times[0][name] - self.start[name]
            out[name] = (to_first - (self.counts[0] - 1) * per_token, per_token)
        return out


def engine_call(engine, prompt: list[int], new_tokens: int) -> tuple[list[int], dict]:
    """(tokens, timings) of one Engine.generate call; a speculative engine's rate starts after its first round."""
    import hybridspec as hs
    stamps = Stamps()
    (out,) = engine.generate([prompt], hs.SamplingParams(max_new_tokens=new_tokens, temperature=0.0),
                             stream=lambda i, tokens: stamps.stamp(len(tokens)))
    return out.token_ids, stamps.timings(first=0 if engine.speculator is None else 1)


class LogitsStamps(Stamps):
    """As a logits processor: a stamp after every forward, scores unchanged."""

    def __call__(self, input_ids, scores):
        self.stamp(1)
        return scores


def hf_call(model, prompt: list[int], new_tokens: int) -> tuple[list[int], dict]:
    """(tokens, timings) of one HF generate call."""
    from transformers import LogitsProcessorList
    ids = torch.tensor([prompt])  # [1, prompt_len]
    stamps = LogitsStamps()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             logits_processor=LogitsProcessorList([stamps]))
    return out[0, ids.shape[1]:].tolist(), stamps.timings(first=0)


# -- measurement ------------------------------------------------------------------------------

def summary(values: list[float]) -> dict:
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def measure_length(w: Workload, length: int, args, warmup: bool) -> dict:
    """One row: the three implementations alternating call by call at one prompt length."""
    import hybridspec as hs
    prompt = w.prompt[:length]
    sizes = dict(max_batch_size=1, max_model_len=length + args.new_tokens + args.gamma + 1)
    engines = {"engine": hs.Engine(w.target, **sizes),
               "spec": hs.Engine(w.target, draft=w.draft, num_draft_tokens=args.gamma, **sizes)}
    calls = {name: (lambda e=e: engine_call(e, prompt, args.new_tokens)) for name, e in engines.items()}
    calls["hf"] = lambda: hf_call(w.hf, prompt, args.new_tokens)
    samples: dict[str, list[dict]] = {name: [] for name in calls}
    tokens = {}
    for repeat in range(-int(warmup), args.repeats):  # repeat -1: the warm-up
        for name, call in calls.items():
            tokens[name], timings = call()
            if repeat >= 0:
                samples[name].append(timings)
    row = dict(workload=w.name, unit=w.unit, length=length, new_tokens=args.new_tokens,
               plain_equals_hf=first_mismatch([tokens["engine"]], [tokens["hf"]]) is None,
               spec_equals_plain=first_mismatch([tokens["spec"]], [tokens["engine"]]) is None)
    for name, timings in samples.items():
        row[f"{name}_ms_tok"] = summary([1e3 * t["wall"][1] for t in timings])
        row[f"{name}_prefill_ms"] = summary([1e3 * t["wall"][0] for t in timings])
        row[f"{name}_cpu_ms_tok"] = summary([1e3 * t["cpu"][1] for t in timings])
        row[f"{name}_cpu_prefill_ms"] = summary([1e3 * t["cpu"][0] for t in timings])
    return row


def add_ratios(rows: list[dict]) -> None:
    """growth (to the workload's shortest prompt) per column, and engine / HF per length."""
    first = rows[0]
    for row in rows:
        for name in IMPLEMENTATIONS:
            for metric in ("ms_tok", "prefill_ms", "cpu_ms_tok", "cpu_prefill_ms"):
                key = f"{name}_{metric}"
                row[f"{key}_growth"] = row[key]["median"] / first[key]["median"]
        for metric in ("ms_tok", "prefill_ms", "cpu_ms_tok", "cpu_prefill_ms"):
            row[f"engine_vs_hf_{metric}"] = row[f"engine_{metric}"]["median"] / row[f"hf_{metric}"]["median"]


def flat(row: dict) -> dict:
    """The row with each {median, min, max} summary as a "median (min-max)" string, for the table."""
    return {k: f"{v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})" if isinstance(v, dict) else v
            for k, v in row.items()}


# -- output -----------------------------------------------------------------------------------

def plot(groups: dict[str, list[dict]], path) -> None:
    """ms per token (top) and prefill ms (bottom) against prompt length, per workload."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(groups), figsize=(4.2 * len(groups), 6.0), squeeze=False)
    labels = {"engine": "engine, plain", "spec": "engine, speculative", "hf": "HF generate"}
    for col, (name, rows) in enumerate(groups.items()):
        lengths = [r["length"] for r in rows]
        for row_index, (metric, ylabel) in enumerate([("ms_tok", "decode ms / token"), ("prefill_ms", "prefill ms")]):
            ax = axes[row_index][col]
            for impl in IMPLEMENTATIONS:
                ax.plot(lengths, [r[f"{impl}_{metric}"]["median"] for r in rows], marker="o", label=labels[impl])
            ax.set_xscale("log")
            ax.set_xticks(lengths, [f"{n:,}" for n in lengths], fontsize=7)
            ax.minorticks_off()
            ax.set_xlabel(f"prompt length ({rows[0]['unit']})", fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.set_title(name, fontsize=9)
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated per call (default 48; 16 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per implementation (default 3)")
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens per speculative round")
    parser.add_argument("--scale", type=float, default=0.03,
                        help="lambda of the random hybrid's later layers (acceptance of its layer-skip draft)")
    parser.add_argument("--embedded-lens", type=int, nargs="+", default=None, help="prompt bytes")
    parser.add_argument("--random-lens", type=int, nargs="+", default=None, help="prompt tokens")
    parser.add_argument("--skip", choices=("embedded", "random"), action="append", default=[],
                        help="leave out a workload")
    args = parser.parse_args(argv)
    args.new_tokens = args.new_tokens or (16 if args.quick else 48)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.embedded_lens = args.embedded_lens or (EMBEDDED_LENS_QUICK if args.quick else EMBEDDED_LENS)
    args.random_lens = args.random_lens or (RANDOM_LENS_QUICK if args.quick else RANDOM_LENS)
    threads = set_threads(args.threads)
    print(describe_machine(), flush=True)

    workloads = []
    if "embedded" not in args.skip:
        workloads.append(embedded_workload(args.embedded_lens))
    if "random" not in args.skip:
        shape = RANDOM_HYBRID_QUICK if args.quick else RANDOM_HYBRID
        workloads.append(random_workload(shape, args.random_lens, args.new_tokens, args.scale))
    groups = {}
    for w in workloads:
        rows = []
        for length in w.lengths:
            rows.append(measure_length(w, length, args, warmup=not rows))
            r = rows[-1]
            print(f"{w.name}, {length} {w.unit}: ms/token engine {r['engine_ms_tok']['median']:.2f}, speculative "
                  f"{r['spec_ms_tok']['median']:.2f}, HF {r['hf_ms_tok']['median']:.2f}; prefill ms engine "
                  f"{r['engine_prefill_ms']['median']:.0f}, HF {r['hf_prefill_ms']['median']:.0f}", flush=True)
        add_ratios(rows)
        groups[w.name] = rows
        print_table([flat(r) for r in rows], [
            ("length", w.unit), ("engine_ms_tok", "engine ms/tok"), ("spec_ms_tok", "spec ms/tok"),
            ("hf_ms_tok", "HF ms/tok"), ("engine_ms_tok_growth", "engine growth"),
            ("spec_ms_tok_growth", "spec growth"), ("hf_ms_tok_growth", "HF growth"),
            ("engine_vs_hf_ms_tok", "engine/HF"), ("plain_equals_hf", "plain=HF"), ("spec_equals_plain", "spec=plain"),
        ], title=f"{w.name}: decode ms per token, median (min-max) of {args.repeats}, {args.new_tokens} new tokens, "
                 f"{threads} thread(s)")
        print_table([flat(r) for r in rows], [
            ("length", w.unit), ("engine_prefill_ms", "engine prefill ms"), ("spec_prefill_ms", "spec prefill ms"),
            ("hf_prefill_ms", "HF prefill ms"), ("engine_prefill_ms_growth", "engine growth"),
            ("hf_prefill_ms_growth", "HF growth"), ("engine_vs_hf_prefill_ms", "engine/HF"),
        ], title=f"{w.name}: prefill ms (speculative: target and draft)")
        print_table(rows, [
            ("length", w.unit), ("engine_cpu_ms_tok_growth", "engine"), ("spec_cpu_ms_tok_growth", "spec"),
            ("hf_cpu_ms_tok_growth", "HF"), ("engine_vs_hf_cpu_ms_tok", "engine/HF ms/tok"),
            ("engine_vs_hf_cpu_prefill_ms", "engine/HF prefill"),
        ], title=f"{w.name}: the same on CPU time (thread_time): ms/token growth, and engine/HF")
    out = args.out or Path("context_scaling.json")
    write_json(out, dict(bench="context_scaling", quick=args.quick, new_tokens=args.new_tokens, repeats=args.repeats,
                         gamma=args.gamma, scale=args.scale, threads=threads,
                         random_hybrid=RANDOM_HYBRID_QUICK if args.quick else RANDOM_HYBRID, workloads=groups))
    plot(groups, Path(out).with_suffix(".png") if args.out else "context_scaling.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
