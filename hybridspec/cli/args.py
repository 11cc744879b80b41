"""Command-line arguments that several commands share: the model flags
(`add_model_arguments`) and the checks of arguments that name things outside
the program — model and tokenizer directories, output files, torch
devices — each failing with a `UsageError` that names the flag, the value and
the fix."""
from __future__ import annotations

import argparse
from pathlib import Path

from hybridspec.errors import ModelFilesError, UsageError

DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --draft and --tokenizer, as `generate` and `serve` take them."""
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="target model directory, anything hs.load reads (default: the embedded target)")
    parser.add_argument("--draft", metavar="DIR|ngram|suffix|mtp|eagle3[:DIR]|layers:N|none", default=None,
                        help="draft model directory, 'ngram' for prompt lookup, 'suffix' for suffix decoding, "
                             "'mtp' for the target checkpoint's MTP layer ('mtp:DIR': one trained beside it), "
                             "'eagle3:DIR' for an EAGLE-3 head ('eagle3': the embedded target's), 'layers:N' for "
                             "a layer-skip draft (the target's own first N layers and LM head), or "
                             "'none' for plain decoding only (default: the embedded draft with the embedded "
                             "target, else ngram)")
    parser.add_argument("--tokenizer", metavar="DIR", default=None,
                        help="local HF tokenizer directory (default: the model directory's own, or bytes for a "
                             "byte-level model)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="split the target over N processes started by `torchrun --nproc-per-node N -m "
                             "hybridspec ...` (the draft runs whole on each; default 1)")


# argparse dest -> EngineConfig setting, for the engine flags a command has (generate's --gamma is serve's
# --num-draft-tokens)
ENGINE_FLAGS = {"gamma": "num_draft_tokens", "num_draft_tokens": "num_draft_tokens",
                "max_draft_tokens": "max_draft_tokens", "verify": "verify", "max_batch_size": "max_batch_size",
                "max_model_len": "max_model_len", "prefix_cache": "prefix_cache", "cuda_graphs": "cuda_graphs",
                "tensor_parallel_size": "tensor_parallel_size", "tree": "tree"}
SWITCHES = ("prefix_cache", "cuda_graphs")  # store_true flags: left off means the Engine's default, None


def engine_config(args: argparse.Namespace, **settings):
    """The one `EngineConfig` of a command: its engine flags (the Engine's
    defaults for those it lacks) with `settings` the command derives itself
    (a parsed --policy, sizes from the prompt) over them."""
    from hybridspec.engine.config import EngineConfig
    flags = {setting: getattr(args, dest) for dest, setting in ENGINE_FLAGS.items() if hasattr(args, dest)}
    for switch in SWITCHES:
        if flags.get(switch) is False:
            flags[switch] = None
    return EngineConfig(**{**flags, **settings})


def gamma_arg(text: str) -> int | str:
    """γ on the command line: a positive integer or 'auto', checked as the
    arguments are read (an error naming the flag, before any model loads)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer or 'auto'")
    return value


def tree_shape(text: str):
    """`--tree 2,1` -> TreeShape((2, 1)): candidates per depth; argparse reports a bad value."""
    from hybridspec.errors import ConfigError
    from hybridspec.spec.tree import TreeShape
    try:
        return TreeShape(tuple(int(w) for w in text.split(",")))
    except (ValueError, ConfigError) as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of widths >= 1 like 2,1 ({error})") from None


def tree_arg(text: str):
    """An engine's --tree: widths as `tree_shape` reads them, or 'auto' (chain or tree per round)."""
    return text if text == "auto" else tree_shape(text)


TREE_HELP = ("verify a tree of drafts per round: W1,W2,... candidates per depth (e.g. 2), or 'auto' (chain or "
             "tree per round; needs an adaptive γ); default: chains")


EMBEDDED = "embedded"  # the word a model flag takes for the embedded pair (`hybridspec.adapters.embedded`)


def reads_target(spec: str) -> bool:
    """Whether a --draft value names a drafter built over the target itself by the Engine: one that
    reads its hidden states ("mtp", "mtp:DIR", "eagle3", "eagle3:DIR") or its first layers ("layers:N")."""
    return spec in ("mtp", "eagle3") or spec.startswith(("mtp:", "eagle3:", "layers:"))


def model_path(flag: str, text: str, draft: bool = False) -> str:
    """`text`, or for the word `embedded` the directory of the embedded target
    (`draft`: of the embedded draft), which no user knows the path of. A folder
    of that name is reached as ./embedded."""
    if text != EMBEDDED:
        return text
    from hybridspec.adapters.embedded import embedded_paths
    try:
        target_dir, draft_dir = embedded_paths()
    except ModelFilesError as error:
        raise UsageError(f"{flag} {EMBEDDED}: {error}") from None
    return str(draft_dir if draft else target_dir)


def load_model(flag: str, path: str, also: str = "", **kwargs):
    """hs.load(path, **kwargs), its ModelFilesError as a UsageError naming `flag`."""
    import hybridspec as hs
    try:
        return hs.load(path, **kwargs)
    except ModelFilesError as error:
        raise UsageError(f"{flag} {path}: {error}{also}") from None


def output_file(flag: str, path: str) -> Path:
    """`path` if a file can be created there: its folder exists and it is not a folder itself."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{flag} {path} is a folder; pass a file name such as {target / 'out'}")
    if not target.parent.is_dir():
        raise UsageError(f"{flag} {path}: the folder {target.parent} does not exist; create it first or pass a "
                         "path in an existing folder")
    return target


def write_text(flag: str, path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as error:
        raise UsageError(f"{flag} {path}: cannot write it ({error.strerror or error}); pass a writable path") from None


def torch_device(flag: str, text: str) -> str:
    """`text` if it names a device this torch build can use (cpu, cuda[:N], mps)."""
    import torch
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UsageError(f"{flag} {text!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            has_gpu_build = torch.version.cuda is not None or torch.version.hip is not None
            reason = "no CUDA GPU is visible" if has_gpu_build else "this torch build has no CUDA support"
            raise UsageError(f"{flag} {text}: {reason}; use {flag} cpu, or install a CUDA build of torch")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"{flag} {text}: there are {torch.cuda.device_count()} CUDA device(s); use cuda:0 to "
                             f"cuda:{torch.cuda.device_count() - 1}")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise UsageError(f"{flag} {text}: MPS is not available in this torch build or on this machine; use cpu")
    elif device.type != "cpu":
        raise UsageError(f"{flag} {text}: hybridspec runs on cpu, cuda or mps devices; use one of those")
    return text
