"""`hybridspec generate [PROMPT]`: text in, text out, from the command line.

With no arguments it continues a short Python prompt with the embedded
byte-level pair (`hybridspec.adapters.embedded`) and measures the speedup over plain
decoding: after one untimed warm-up each, plain and speculative runs of the
same prompt alternate `--repeats` times (3 by default), and the report gives
the median tokens/s of each, their ratio and the range of the per-pair
ratios. `--no-baseline` runs the speculative decoder once and skips the plain
runs. `PROMPT` `-` reads the prompt from stdin.

Stdout gets the prompt, a line `=== generated text ===` (`GENERATED_MARK`;
the prompt first ends its line) and the generated text, streamed and flushed
as rounds commit (into a file or a pipe too, so an interrupted run leaves
what it made), then the statistics go to stderr; `--json` prints one JSON
object (text and statistics) to stdout instead, when every run has ended.
The sampling flags are checked before the model loads; their errors name the
flags. Progress bars, labelled with the run, appear on stderr whenever
stderr is a terminal, never with `--json`; the run whose text streams to a
terminal has none (its text is its progress). The statistics are lines of
at most about `SUMMARY_WIDTH` characters, broken between phrases.
"""
from __future__ import annotations

import argparse
import json
import re
import secrets
import statistics
import sys
import time

from hybridspec.cli.args import DTYPE_NAMES, TREE_HELP, add_model_arguments, gamma_arg, tree_arg

DEFAULT_PROMPT = '''class Stack:
    """A last-in, first-out stack."""

    def __init__(self):
        self._items = []

    def push(self, item):
'''

GENERATED_MARK = "=== generated text ==="  # the line between the echoed prompt and the continuation

# SamplingParams' fields as the flags that set them, for errors the user can act on
SAMPLING_FLAGS = {"max_new_tokens": "-n/--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
                  "top_p": "--top-p", "min_p": "--min-p", "repetition_penalty": "--repetition-penalty",
                  "stop": "--stop", "seed": "--seed"}
# the fields whose SamplingParams message speaks Python (None, a list of strings, 2**63), in the command line's words
FLAG_MESSAGES = {"stop": "--stop needs a non-empty string; give each --stop its text, or leave it out",
                 "seed": "--seed {value} must be an integer >= 0 and below 2^63; leave it out for a random seed"}

POLICY_HELP = ("checkpoint policy: k1 (snapshot every verify input), k2, k4, ... (every k-th), k0 (round start "
               "and final only), auto, or key=value pairs such as snapshot_every=2,ring_slots=4,log_inputs=0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default=None,
                        help="text to continue; - reads it from stdin (default: a short Python class). Stdout "
                             f"echoes it, then a line '{GENERATED_MARK}', then the generated text")
    add_model_arguments(parser)
    parser.add_argument("-n", "--max-new-tokens", "--max-tokens", dest="max_new_tokens", type=int, default=256,
                        help="tokens to generate at most (default 256)")
    parser.add_argument("--gamma", type=gamma_arg, default=4,
                        help="draft tokens per round (default 4), or 'auto': chosen per round, 0..8")
    parser.add_argument("--tree", type=tree_arg, default=None, metavar="W1,W2,...|auto", help=TREE_HELP)
    parser.add_argument("--policy", default="k1", help=POLICY_HELP + " (default k1)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: off)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens below min-p times the most likely one's probability (default 0: off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="HF's repetition penalty (default 1: off)")
    parser.add_argument("--stop", action="append", metavar="TEXT", default=[],
                        help="stop when TEXT appears; the output is cut just before it (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate past the model's EOS token")
    parser.add_argument("--seed", type=int, default=None,
                        help="sampling seed (default: a random one, printed so the run can be repeated)")
    parser.add_argument("--verify", choices=("rejection", "coupled"), default="rejection",
                        help="'coupled' makes sampled output identical to plain decoding with the same seed (a seeded "
                             "request, as every sampled run here, is verified so under 'rejection' too)")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:N or mps (default cpu)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="replay decode and verify forwards as captured CUDA graphs (a CUDA --device; "
                             "models without MoE layers; default: HYBRIDSPEC_CUDA_GRAPHS=1 turns them on where "
                             "they can run)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                        help="dtype the model computes in (default: float32 on a CPU, where stored bf16 "
                             "linear weights stay bf16 in memory, exactly; the weights' stored dtype elsewhere)")
    parser.add_argument("--compute", choices=("float32", "bfloat16"), default=None,
                        help="what the products multiply in: float32 (default, exact) or bfloat16 (the fast path on CPUs with "
                             "AVX512-BF16: activations rounded to bf16, close to float32, not its bits)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads on CPU (default: 1 for models of hidden size < 2048 such as "
                             "the embedded pair, torch's default otherwise)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the plain-decoding runs (no speedup is measured)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed plain and speculative runs, interleaved, for the speedup (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (text and statistics) to stdout")


def read_prompt(prompt: str | None) -> str:
    """The prompt text: the argument, stdin for "-", or the default."""
    if prompt == "-":
        return sys.stdin.read()
    return DEFAULT_PROMPT if prompt is None else prompt


def parse_policy(text: str):
    """A `CheckpointPolicy` (or "auto") from "k1", "k0", "auto" or "snapshot_every=2,ring_slots=4,log_inputs=0"."""
    from hybridspec.checkpoints.policy import CheckpointPolicy
    from hybridspec.errors import ConfigError
    spec = text.strip().lower()
    if spec == "auto":
        return "auto"
    if spec.startswith("k") and spec[1:].isdigit():
        return CheckpointPolicy(snapshot_every=int(spec[1:]))
    fields = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in ("snapshot_every", "ring_slots", "log_inputs"):
            raise ConfigError(f"--policy {text!r}: cannot read {item!r}; " + POLICY_HELP)
        if key == "log_inputs" and value in ("0", "1", "true", "false"):
            fields[key] = value in ("1", "true")
        elif key == "ring_slots" and value == "none":
            fields[key] = None
        elif value.isdigit() and key != "log_inputs":
            fields[key] = int(value)
        else:
            raise ConfigError(f"--policy {text!r}: {key} takes an integer"
                              + (" or none" if key == "ring_slots" else "")
                              + ("; log_inputs takes 0 or 1" if key == "log_inputs" else ""))
    if not fields:
        raise ConfigError(f"--policy {text!r} is empty; " + POLICY_HELP)
    try:
        return CheckpointPolicy(**fields)
    except ConfigError as error:  # the policy's own checks; the command line spells Python's None "none"
        raise ConfigError(f"--policy {text!r}: {str(error).replace('None', 'none')}") from None


def load_models(args: argparse.Namespace, dtype, device: str):
    """(target, draft or None, target directory, target name, draft name) from --model / --draft."""
    import hybridspec as hs
    from hybridspec.cli.args import load_model, reads_target
    from hybridspec.adapters.embedded import embedded_paths
    kwargs = dict(dtype=dtype, device=device)
    shards = dict(kwargs, tensor_parallel_size=args.tensor_parallel_size, compute=args.compute)  # the target's
    if args.model is None:
        target_dir, draft_dir = embedded_paths()
        target, target_name = hs.load(target_dir, **shards), "embedded target"
        draft_spec = args.draft if args.draft is not None else str(draft_dir)
    else:
        target_dir = args.model
        target, target_name = load_model("--model", args.model, **shards), args.model
        draft_spec = args.draft if args.draft is not None else "ngram"
    if draft_spec == "none":
        return target, None, target_dir, target_name, "none"
    if draft_spec == "ngram":
        return target, hs.NgramDrafter(), target_dir, target_name, "ngram (prompt lookup)"
    if draft_spec == "suffix":
        return target, hs.SuffixDrafter(), target_dir, target_name, "suffix (suffix decoding)"
    if reads_target(draft_spec):  # the Engine reads it beside the target
        kind = ("EAGLE-3 head" if draft_spec.startswith("eagle3") else "layer-skip draft"
                if draft_spec.startswith("layers:") else "MTP layer")
        return target, draft_spec, target_dir, target_name, f"{draft_spec} ({kind})"
    name = "embedded draft" if args.model is None and args.draft is None else draft_spec
    draft = load_model("--draft", draft_spec, also=" (or pass --draft ngram, --draft suffix or --draft none)",
                       **kwargs)
    return target, draft, target_dir, target_name, name


def check_counts(args: argparse.Namespace) -> None:
    from hybridspec.errors import UsageError
    for flag, value in (("--threads", args.threads), ("--repeats", args.repeats)):
        if value is not None and value < 1:
            raise UsageError(f"{flag}={value} must be >= 1")


def build_llm(args: argparse.Namespace, policy):
    """(LLM, plain Engine or None, prompt text, prompt ids, names) for the arguments
    and the parsed --policy."""
    import hybridspec as hs
    from hybridspec.cli.args import engine_config, torch_device
    from hybridspec.text.codec import TokenizerCodec, load_tokenizer
    from hybridspec.llm import DTYPES, as_codec, load_dtype, model_eos_ids
    from hybridspec.tp.launch import join
    config = engine_config(args, checkpoint=policy)  # checked before any model is loaded
    prompt_text = read_prompt(args.prompt)
    device = join(args.tensor_parallel_size, torch_device("--device", args.device))
    target, draft, target_dir, target_name, draft_name = load_models(
        args, load_dtype(None if args.dtype is None else DTYPES[args.dtype], device), device)
    tokenizer = TokenizerCodec(load_tokenizer(args.tokenizer, "--tokenizer"), args.tokenizer) if args.tokenizer \
        else None
    codec = as_codec(tokenizer, args.model, target.vocab_size)
    prompt = codec.encode(prompt_text)
    check_length(len(prompt), args.max_new_tokens, target.config.max_position_embeddings)
    eos = sorted(set(codec.eos_token_ids) | set(model_eos_ids(target_dir, target)))
    length = min(target.config.max_position_embeddings, len(prompt) + args.max_new_tokens + config.gamma_max + 1)
    config = config.replace(max_batch_size=1, max_model_len=length, eos_token_ids=eos, decode=codec.decode)
    llm = hs.LLM(target, draft=draft, tokenizer=codec, threads=args.threads, config=config)
    plain = None if draft is None or args.no_baseline \
        else hs.Engine(target, config=config.replace(tree=None))  # no draft (nor tree): plain steps
    return llm, plain, prompt_text, prompt, dict(model=target_name, draft=draft_name, tokenizer=codec.name)


def check_length(prompt_tokens: int, max_new_tokens: int, limit: int) -> None:
    """A UsageError, in the user's own terms, when the prompt and -n do not fit the model's context."""
    from hybridspec.errors import UsageError
    if prompt_tokens + max_new_tokens <= limit:
        return
    fixes = [f"pass -n {limit - prompt_tokens} or less"] if prompt_tokens < limit else []
    if max_new_tokens < limit:
        fixes.append(f"shorten the prompt to at most {limit - max_new_tokens} tokens")
    fixes = fixes or [f"shorten the prompt and pass -n below {limit}"]
    raise UsageError(f"the prompt is {prompt_tokens} tokens and -n/--max-new-tokens asks for {max_new_tokens} more, "
                     f"{prompt_tokens + max_new_tokens} in all, past the model's context limit of {limit} tokens; "
                     + " or ".join(fixes))


def sampling_params(args: argparse.Namespace, seed: int | None):
    """The SamplingParams of the arguments; SamplingParams' own checks, their errors naming the flags."""
    import hybridspec as hs
    from hybridspec.errors import InvalidRequestError, UsageError
    if args.max_new_tokens < 1:  # (SamplingParams takes 0, to score a prompt: a generate run has nothing to show)
        raise UsageError(f"{SAMPLING_FLAGS['max_new_tokens']} {args.max_new_tokens} must be an integer >= 1")
    try:
        return hs.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, min_p=args.min_p, seed=seed, stop=tuple(args.stop),
                                 ignore_eos=args.ignore_eos, repetition_penalty=args.repetition_penalty)
    except InvalidRequestError as error:
        raise UsageError(flag_message(str(error))) from None


def flag_message(message: str) -> str:
    """A SamplingParams error with its field named by its flag: "top_p=1.5 must be ..." -> "--top-p 1.5 must be
    ..."; a field of `FLAG_MESSAGES` gets the command line's own words."""
    match = re.match(r"(\w+)(=| holds )(\S*)", message)
    if match is None or match[1] not in SAMPLING_FLAGS:
        return message
    field, _, value = match.groups()
    if field in FLAG_MESSAGES:
        return FLAG_MESSAGES[field].format(value=value)
    return f"{SAMPLING_FLAGS[field]} {value}{message[match.end():]}"


def drawn_seed(args: argparse.Namespace) -> int | None:
    """--seed, else a random seed where sampling needs one (the same on every tensor-parallel rank)."""
    from hybridspec.tp.launch import rank0_value
    return args.seed if args.seed is not None or args.temperature == 0 else rank0_value(secrets.randbits(31))


def run(args: argparse.Namespace) -> int:
    from hybridspec.tp.launch import is_first_rank
    check_counts(args)
    sampling_params(args, args.seed)  # bad values fail here, before the model loads
    policy = parse_policy(args.policy)  # likewise
    llm, plain, prompt_text, prompt, names = build_llm(args, policy)
    params = sampling_params(args, drawn_seed(args))
    first = "speculative" if llm.engine.speculator is not None else "plain"
    engines = [(first, llm.engine)] + ([("plain", plain)] if plain is not None else [])
    speaks = is_first_rank()  # tensor parallel: every rank runs, rank 0 reports
    streaming = not args.json and speaks
    bars = sys.stderr.isatty() and not args.json and speaks
    repeats = args.repeats if len(engines) == 2 else 1
    runs = {name: [] for name, _ in engines}
    for name, engine in engines:
        warm_up(engine, prompt, params)
    for i in range(repeats):
        for name, engine in engines:
            streamed = streaming and i == 0 and name == first
            shown = streamed and sys.stdout.isatty()  # its text on the terminal is its progress
            label = f"{name} run {i + 1}/{repeats}" if bars and not shown else False
            runs[name].append(streamed_generate(engine, prompt, params, label, prompt_text, llm.codec.decode)
                              if streamed else timed_generate(engine, prompt, params, label))
    report = build_report(args, runs, names, llm, prompt_text, prompt, params.seed)
    if not speaks:
        return 0
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
        sys.stdout.flush()
    else:
        print(render_summary(report), file=sys.stderr)
    return 0


def write(out, text: str) -> None:
    """`text` on `out` now, not when its buffer fills: a file or pipe gets the text as it is made."""
    if text:
        out.write(text)
        out.flush()


def timed_generate(engine, prompt: list[int], params, progress: bool | str, stream=None):
    """(Output, wall seconds, the call's statistics) of one generate call."""
    start = time.perf_counter()
    output = engine.generate([prompt], params, progress=progress, stream=stream)[0]
    return output, time.perf_counter() - start, engine.stats.as_dict()


def streamed_generate(engine, prompt: list[int], params, progress: bool | str, prompt_text: str, decode):
    """`timed_generate`, writing to stdout the prompt, `GENERATED_MARK` and the text as it is made."""
    from hybridspec.text.stream import TextStream
    write(sys.stdout, prompt_text + ("" if prompt_text.endswith("\n") else "\n") + GENERATED_MARK + "\n")
    text = TextStream(decode, params.stop)
    result = timed_generate(engine, prompt, params, progress,
                            lambda index, tokens: write(sys.stdout, text.push(tokens)))
    write(sys.stdout, text.push([], True, result[0].stop_reason) + "\n")
    return result


def warm_up(engine, prompt: list[int], params) -> None:
    """One short untimed call so the timed ones pay no first-call costs."""
    import hybridspec as hs
    engine.generate([prompt], hs.SamplingParams(max_new_tokens=min(4, params.max_new_tokens),
                                                temperature=params.temperature, seed=params.seed))


def run_summary(runs: list | None) -> dict | None:
    """Median seconds and tokens/s of repeated runs; the first run's tokens and statistics."""
    if not runs:
        return None
    output, _, stats = runs[0]
    rates = [len(o.token_ids) / seconds for o, seconds, _ in runs]
    return dict(seconds=statistics.median(s for _, s, _ in runs), new_tokens=len(output.token_ids),
                tokens_per_s=statistics.median(rates), tokens_per_s_runs=rates, runs=len(runs), stats=stats)


def build_report(args, runs: dict, names: dict, llm, prompt_text: str, prompt: list[int], seed: int | None) -> dict:
    from hybridspec.sampling.stopping import cut_text
    output = (runs.get("speculative") or runs["plain"])[0][0]
    speculative, plain = run_summary(runs.get("speculative")), run_summary(runs.get("plain"))
    exact = args.temperature == 0 or args.verify == "coupled" or seed is not None  # seeded rows verify coupled
    both = speculative is not None and plain is not None
    pairs = [s / p for s, p in zip(speculative["tokens_per_s_runs"], plain["tokens_per_s_runs"])] if both else []
    return {
        "schema": "hybridspec.generate/v1",
        **names,
        "gamma": args.gamma, "policy": args.policy, "verify": args.verify, "threads": llm.threads,
        "device": args.device, "dtype": str(llm.target.dtype).removeprefix("torch."),
        "sampling": dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                         stop=list(args.stop), ignore_eos=args.ignore_eos, seed=seed),
        "prompt": prompt_text, "prompt_tokens": len(prompt),
        "text": cut_text(llm.codec.decode(output.token_ids), output.stop_reason), "token_ids": output.token_ids,
        "finish_reason": output.finish_reason, "stop_reason": output.stop_reason,
        "speculative": speculative, "plain": plain,
        "speedup": speculative["tokens_per_s"] / plain["tokens_per_s"] if both else None,
        "speedup_range": [min(pairs), max(pairs)] if pairs else None,
        "speedup_method": f"median tok/s of {len(pairs)} interleaved plain and speculative runs each" if both
        else None,
        # greedy, coupled and seeded outputs must equal plain decoding; rejection sampling draws differently
        "same_as_plain": runs["speculative"][0][0].token_ids == runs["plain"][0][0].token_ids
        if both and exact else None,
    }


def render_summary(report: dict) -> str:
    """The statistics, each line wrapped between phrases to at most `SUMMARY_WIDTH` characters."""
    return "\n".join(part for line in summary_lines(report) for part in wrap_phrases(line))


def summary_lines(report: dict) -> list[str]:
    main = report["speculative"] or report["plain"]
    lines = [f"--- {report['model']}, {report['prompt_tokens']} prompt tokens, {main['new_tokens']} new tokens "
             f"({report['finish_reason']}), {report['device']} {report['dtype']}, {report['threads']} thread(s)"]
    if report["sampling"]["seed"] is not None:
        lines[0] += f", seed {report['sampling']['seed']}"
    spec, plain = report["speculative"], report["plain"]
    if spec is None:
        lines.append(f"plain decoding: {plain['tokens_per_s']:.1f} tok/s")
        return lines
    stats = spec["stats"]
    lines.append(f"speculative: draft {report['draft']}, gamma {report['gamma']}, policy {report['policy']}, "
                 f"verify {report['verify']}")
    lines.append(f"acceptance rate {stats['acceptance_rate']:.3f}, {stats['tokens_per_round']:.2f} tokens per round, "
                 f"{spec['tokens_per_s']:.1f} tok/s{_median_note(spec)}")
    if report["gamma"] == "auto" and stats.get("gamma_counts"):
        counts = sorted((int(g), n) for g, n in stats["gamma_counts"].items())
        lines.append("gamma chosen (rounds): " + ", ".join(f"{g}: {n}" for g, n in counts))
    if plain is None:
        lines.append("plain decoding: skipped (--no-baseline), no speedup measured")
        return lines
    same = report["same_as_plain"]
    same_text = "n/a (rejection sampling)" if same is None else ("yes" if same else "NO")
    low, high = report["speedup_range"]
    lines.append(f"plain decoding: {plain['tokens_per_s']:.1f} tok/s{_median_note(plain)}")
    lines.append(f"speedup {report['speedup']:.2f}x ({report['speedup_method']}; per pair {low:.2f}x-{high:.2f}x)")
    lines.append(f"same tokens as plain: {same_text}")
    return lines


SUMMARY_WIDTH = 100


def wrap_phrases(line: str, width: int = SUMMARY_WIDTH) -> list[str]:
    """`line` broken after its commas and semicolons into lines of at most `width`
    characters (a single phrase longer than that, a long path, stays whole);
    continuation lines are indented by two spaces."""
    phrases = re.findall(r"[^,;]+(?:[,;]|$)", line) or [line]
    lines = [phrases[0]]
    for phrase in phrases[1:]:
        if len(lines[-1]) + len(phrase) <= width:
            lines[-1] += phrase
        else:
            lines.append("  " + phrase.lstrip())
    return lines


def _median_note(run: dict) -> str:
    return f" (median of {run['runs']})" if run["runs"] > 1 else ""
