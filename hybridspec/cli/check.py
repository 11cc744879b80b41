"""`hybridspec check`: run the rollback-correctness suite
(`hybridspec.rollback`) against a model and print a pass/fail table.

    hybridspec check                          # built-in tiny random hybrid model
    hybridspec check --model embedded --draft embedded --quick
    hybridspec check --model DIR --draft ngram --quick
    hybridspec check --tree 2,1 --quick       # tree mode: the drafter (and suffix decoding) propose trees

Each check is reported on stderr as it ends (on a terminal a bar that clears
itself before the table, elsewhere a line per check); the table goes to stdout.

Exit status: 0 all checks passed, 1 a check failed, 2 the models could not be
loaded or do not fit together (one line on stderr says why).
"""
from __future__ import annotations

import argparse
import sys

import torch

from hybridspec.cli.args import tree_shape
from hybridspec.errors import ConfigError, UsageError

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="DIR|embedded",
                        help="model directory hs.load reads, or 'embedded' for the embedded byte-level target "
                             "(default: a built-in tiny random hybrid model)")
    parser.add_argument("--draft", default="perturbed", metavar="DIR|embedded|ngram|suffix|mtp|layers:N|perturbed",
                        help="drafter: a model directory, 'embedded' for the embedded draft, prompt lookup "
                             "(ngram), suffix decoding (suffix), the target's first N layers (layers:N), or a copy of the target with 3%% multiplicative weight noise (perturbed, "
                             "the default)")
    parser.add_argument("--quick", action="store_true",
                        help="γ in {1, 4}, fewer drafters, shorter generations")
    parser.add_argument("--tree", metavar="W1,W2,...", type=tree_shape,
                        help="tree mode: the drafter proposes trees of these widths (candidates per depth, "
                             "hs.TreeShape), checked for parity, state parity and failed rounds instead of chains")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float64",
                        help="weights and states; float64 (default) makes every comparison exact to 1e-10")
    parser.add_argument("--device", default="cpu", help="torch device of the models (default: cpu)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tiny model, the weight noise and the prompts")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch (default 1: the suite's tensors are small, more threads "
                             "mostly add overhead)")


def load_models(args: argparse.Namespace):
    """(target, drafter, drafter name) from the arguments."""
    import hybridspec as hs
    from hybridspec.cli.args import load_model, model_path, reads_target, torch_device
    from hybridspec.rollback import perturbed_copy, tiny_model

    dtype, device = DTYPES[args.dtype], torch_device("--device", args.device)
    if args.model:
        target = load_model("--model", model_path("--model", args.model), dtype=dtype, device=device)
    else:
        target = tiny_model(args.seed, dtype=dtype, device=device)
    if args.draft == "perturbed":
        return target, perturbed_copy(target, seed=args.seed), "perturbed"
    if args.draft == "ngram":
        return target, hs.NgramDrafter(), "n-gram"
    if args.draft == "suffix":
        return target, hs.SuffixDrafter(), "suffix"
    if reads_target(args.draft):  # the Engine reads it from the target's checkpoint (or DIR)
        return target, args.draft, args.draft
    draft = load_model("--draft", model_path("--draft", args.draft, draft=True),
                       also=" (or pass --draft ngram, --draft suffix or --draft perturbed)", dtype=dtype,
                       device=device)
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"the drafter in {args.draft} has vocabulary {draft.vocab_size}, the target "
                          f"{target.vocab_size}; pass a drafter that shares the target's tokenizer")
    return target, draft, "draft"


def format_table(results) -> str:
    width = max(len(r.name) for r in results)
    lines = [f"{'result':6}  {'seconds':>7}  {'check':{width}}  detail"]
    for r in results:
        lines.append(f"{'PASS' if r.passed else 'FAIL':6}  {r.seconds:7.2f}  {r.name:{width}}  {r.detail}")
    return "\n".join(lines)


class Progress:
    """Each result on stderr as its check ends, so that a suite of minutes is not
    silent: on a terminal one bar, cleared when the suite ends (the table
    follows); elsewhere (a log) one line per check."""

    def __init__(self):
        from tqdm import tqdm
        self.bar = tqdm(desc="checks", unit=" checks", leave=False, file=sys.stderr, mininterval=0) \
            if sys.stderr.isatty() else None  # mininterval 0: every check redraws it (a few dozen draws)
        self.done = 0

    def __call__(self, result) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(result.name, refresh=False)
            self.bar.update()
        else:
            print(f"check {self.done}: {'PASS' if result.passed else 'FAIL'}  {result.name} ({result.seconds:.2f} s)",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args: argparse.Namespace) -> int:
    from hybridspec.rollback import run_suite

    if args.threads < 1:
        raise UsageError(f"--threads={args.threads} must be >= 1")
    torch.set_num_threads(args.threads)
    target, draft, draft_name = load_models(args)
    layers = ", ".join(f"{target.config.layer_types.count(t)} {t}" for t in dict.fromkeys(target.config.layer_types))
    print(f"target: {args.model or 'built-in tiny model'} ({target.config.family}: {layers}; {args.dtype}); "
          f"drafter: {draft_name}" + ("" if args.tree is None else f", trees {args.tree.widths}"), flush=True)
    progress = Progress()
    try:
        results = run_suite(target, draft, draft_name, quick=args.quick, seed=args.seed, progress=progress,
                            tree=args.tree)
    finally:
        progress.close()
    print(format_table(results))
    # the drafter's own agreement, not the acceptance the suite's forced rejections leave
    own = [r.stats.get("drafter_acceptance", r.stats.get("acceptance_rate")) for r in results
           if r.name.startswith(f"greedy parity · {draft_name} ·") and "acceptance_rate" in r.stats]
    if own:
        print(f"acceptance of the {draft_name} drafter (greedy, mean over γ and policies): {sum(own) / len(own):.2f}")
    failed = sum(not r.passed for r in results)
    print(f"{len(results) - failed}/{len(results)} checks passed in {sum(r.seconds for r in results):.1f} s")
    return 1 if failed else 0
