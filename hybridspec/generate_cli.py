"""`hybridspec generate [PROMPT]`: speculative decoding from the command line.

With no arguments it continues a short Python prompt with the embedded
byte-level pair (`hybridspec.embedded`), then decodes the same prompt plainly
with the same target and settings, and reports acceptance rate, mean tokens per
round, tokens/s and the speedup over plain decoding measured in this run.

On a terminal the speculative run's text streams as rounds commit (through
`Engine.generate(stream=...)`); with stdout not a terminal the text is written
once generation ends and a progress bar goes to stderr. The generated text goes
to stdout (after the prompt); the statistics go to stderr, or to stdout as one
JSON object with `--json`.
"""
from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from dataclasses import dataclass
from typing import Callable

DEFAULT_PROMPT = '''class Stack:
    """A last-in, first-out stack."""

    def __init__(self):
        self._items = []

    def push(self, item):
'''

POLICY_HELP = ("checkpoint policy: k1 (snapshot every verify input), k2, k4, ... (every k-th), k0 (round start "
               "and final only), auto, or key=value pairs such as snapshot_every=2,ring_slots=4,log_inputs=0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default=None,
                        help="text to continue (default: a short Python class)")
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="target checkpoint directory, anything hs.load reads (default: the embedded target)")
    parser.add_argument("--draft", metavar="DIR|ngram|none", default=None,
                        help="draft checkpoint directory, 'ngram' for prompt lookup, or 'none' for plain decoding "
                             "only (default: the embedded draft with the embedded target, else ngram)")
    parser.add_argument("--tokenizer", metavar="DIR", default=None,
                        help="local HF tokenizer directory for models that are not byte-level")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=256, help="tokens to generate (default 256)")
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens per round (default 4)")
    parser.add_argument("--policy", default="k1", help=POLICY_HELP + " (default k1)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None,
                        help="sampling seed (default: a random one, printed so the run can be repeated)")
    parser.add_argument("--verify", choices=("rejection", "coupled"), default="rejection",
                        help="'coupled' makes sampled output identical to plain decoding with the same seed")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: 1 for the embedded pair, whose matrices are too small "
                             "to gain from more threads; torch's default otherwise)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (text and statistics) to stdout")


@dataclass(frozen=True)
class Codec:
    """Text <-> token ids for one model."""

    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    stop_token_ids: tuple[int, ...] = ()


def byte_codec(vocab_size: int) -> Codec:
    from .errors import ConfigError
    if vocab_size != 256:
        raise ConfigError(f"the model's vocabulary has {vocab_size} tokens, not the 256 bytes of a byte-level "
                          "model; pass --tokenizer DIR with the model's HF tokenizer")
    return Codec("bytes", lambda text: list(text.encode("utf-8")),
                 lambda ids: bytes(ids).decode("utf-8", errors="replace"))


def tokenizer_codec(path: str) -> Codec:
    from .cli_args import load_tokenizer
    tokenizer = load_tokenizer("--tokenizer", path)
    stops = () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
    return Codec(path, lambda text: list(tokenizer.encode(text)), lambda ids: tokenizer.decode(ids), stops)


def parse_policy(text: str):
    """A `CheckpointPolicy` (or "auto") from "k1", "k0", "auto" or "snapshot_every=2,ring_slots=4,log_inputs=0"."""
    from hybridspec.checkpoints.policy import CheckpointPolicy
    from .errors import ConfigError
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
    return CheckpointPolicy(**fields)


def set_threads(threads: int | None) -> None:
    import torch
    from .errors import ConfigError
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"--threads={threads} must be >= 1")
        torch.set_num_threads(threads)


def load_models(args: argparse.Namespace):
    """(target, draft or None, target name, draft name) from --model / --draft."""
    import hybridspec as hs
    from .cli_args import load_checkpoint
    from .embedded import embedded_paths
    if args.model is None:
        target_dir, draft_dir = embedded_paths()
        target, target_name = hs.load(target_dir), "embedded target"
        draft_spec = args.draft if args.draft is not None else str(draft_dir)
    else:
        target, target_name = load_checkpoint("--model", args.model), args.model
        draft_spec = args.draft if args.draft is not None else "ngram"
    if draft_spec == "none":
        return target, None, target_name, "none"
    if draft_spec == "ngram":
        return target, hs.NgramDrafter(), target_name, "ngram (prompt lookup)"
    name = "embedded draft" if args.model is None and args.draft is None else draft_spec
    draft = load_checkpoint("--draft", draft_spec, also=" (or pass --draft ngram or --draft none)")
    return target, draft, target_name, name


class TextStream:
    """Writes the decoded text of the tokens emitted so far as they arrive,
    holding back a trailing incomplete character (U+FFFD) until it completes."""

    def __init__(self, codec: Codec, out):
        self.codec, self.out, self.ids, self.written = codec, out, [], 0

    def __call__(self, index: int, tokens: list[int]) -> None:
        self.ids.extend(tokens)
        self._write(self.codec.decode(self.ids).rstrip("\ufffd"))

    def finish(self) -> None:
        self._write(self.codec.decode(self.ids) + "\n")

    def _write(self, text: str) -> None:
        if len(text) > self.written:
            self.out.write(text[self.written:])
            self.out.flush()
            self.written = len(text)


def timed_generate(engine, prompt: list[int], params, progress: bool, stream=None):
    """(Output, wall seconds) of one generate call, from fresh statistics."""
    engine.stats.reset()
    start = time.perf_counter()
    output = engine.generate([prompt], params, progress=progress, stream=stream)[0]
    return output, time.perf_counter() - start


def warm_up(engine, prompt: list[int], params) -> None:
    """One short untimed call so the timed one pays no first-call costs."""
    import hybridspec as hs
    engine.generate([prompt], hs.SamplingParams(max_new_tokens=min(4, params.max_new_tokens),
                                                temperature=params.temperature, seed=params.seed))


def run(args: argparse.Namespace) -> int:
    import hybridspec as hs
    set_threads(args.threads if args.threads is not None else 1 if args.model is None else None)
    target, draft, target_name, draft_name = load_models(args)
    codec = tokenizer_codec(args.tokenizer) if args.tokenizer else byte_codec(target.vocab_size)
    prompt_text = DEFAULT_PROMPT if args.prompt is None else args.prompt
    prompt = codec.encode(prompt_text)
    seed = args.seed if args.seed is not None or args.temperature == 0 else secrets.randbits(31)
    params = hs.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               top_k=args.top_k, top_p=args.top_p, seed=seed,
                               stop_token_ids=codec.stop_token_ids)
    sizes = dict(max_batch_size=1, max_model_len=min(target.config.max_position_embeddings,
                                                      len(prompt) + args.max_new_tokens + args.gamma + 1))
    plain = hs.Engine(target, **sizes)
    spec = None if draft is None else hs.Engine(target, draft=draft, num_draft_tokens=args.gamma,
                                                 checkpoint=parse_policy(args.policy), verify=args.verify,
                                                 **sizes)
    streaming = sys.stdout.isatty() and not args.json
    progress = not streaming and not sys.stdout.isatty()
    runs, stream = {}, None
    for name, engine in (("speculative", spec), ("plain", plain)):
        if engine is not None:
            warm_up(engine, prompt, params)
            if streaming and not runs:  # the first timed run streams its text
                sys.stdout.write(prompt_text)
                stream = TextStream(codec, sys.stdout)
            runs[name] = timed_generate(engine, prompt, params, progress, stream if not runs else None) \
                + (engine.stats.as_dict(),)
            if stream is not None and len(runs) == 1:
                stream.finish()
    report = build_report(args, runs, target_name, draft_name, codec, prompt_text, prompt, seed)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        if stream is None:
            sys.stdout.write(prompt_text + report["text"] + "\n")
            sys.stdout.flush()
        print(render_summary(report), file=sys.stderr)
    return 0


def build_report(args, runs: dict, target_name: str, draft_name: str, codec: Codec, prompt_text: str,
                 prompt: list[int], seed: int | None) -> dict:
    import torch
    main = runs.get("speculative", runs["plain"])
    output = main[0]

    def timing(name: str) -> dict | None:
        if name not in runs:
            return None
        out, seconds, stats = runs[name]
        return dict(seconds=seconds, new_tokens=len(out.token_ids), tokens_per_s=len(out.token_ids) / seconds,
                    stats=stats)

    speculative, plain = timing("speculative"), timing("plain")
    exact = args.temperature == 0 or args.verify == "coupled"
    return {
        "schema": "hybridspec.generate/v1",
        "model": target_name, "draft": draft_name, "tokenizer": codec.name,
        "gamma": args.gamma, "policy": args.policy, "verify": args.verify, "threads": torch.get_num_threads(),
        "sampling": dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, seed=seed),
        "prompt": prompt_text, "prompt_tokens": len(prompt),
        "text": codec.decode(output.token_ids), "token_ids": output.token_ids,
        "finish_reason": output.finish_reason,
        "speculative": speculative, "plain": plain,
        "speedup": speculative["tokens_per_s"] / plain["tokens_per_s"] if speculative else None,
        # greedy and coupled outputs must equal plain decoding; rejection sampling draws differently
        "same_as_plain": runs["speculative"][0].token_ids == runs["plain"][0].token_ids
        if speculative and exact else None,
    }


def render_summary(report: dict) -> str:
    plain = report["plain"]
    lines = [f"--- {report['model']}, {report['prompt_tokens']} prompt tokens, {plain['new_tokens']} new tokens "
             f"({report['finish_reason']}), {report['threads']} thread(s)"]
    if report["sampling"]["seed"] is not None:
        lines[0] += f", seed {report['sampling']['seed']}"
    spec = report["speculative"]
    if spec is None:
        lines.append(f"plain decoding: {plain['tokens_per_s']:.1f} tok/s")
        return "\n".join(lines)
    stats = spec["stats"]
    lines.append(f"speculative: draft {report['draft']}, gamma {report['gamma']}, policy {report['policy']}, "
                 f"verify {report['verify']}")
    lines.append(f"acceptance rate {stats['acceptance_rate']:.3f}, {stats['tokens_per_round']:.2f} tokens per round, "
                 f"{spec['tokens_per_s']:.1f} tok/s")
    same = report["same_as_plain"]
    same_text = "n/a (rejection sampling)" if same is None else ("yes" if same else "NO")
    lines.append(f"plain decoding: {plain['tokens_per_s']:.1f} tok/s; speedup {report['speedup']:.2f}x; "
                 f"same tokens as plain: {same_text}")
    return "\n".join(lines)
