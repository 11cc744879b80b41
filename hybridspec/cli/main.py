"""`hybridspec` command line: generate | simulate | check | bench | serve | quantize.

Each subcommand lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`; this file only wires them together. Only the module of
the subcommand being run is imported (`hybridspec --help` and `--version`
import none, nor torch). A command whose optional dependency is missing
(transformers, fastapi, ...) ends with one line naming the extra that
installs it (`hybridspec.cli.extras`).
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from hybridspec import __version__
from hybridspec.cli.extras import missing_extra, missing_message
from hybridspec.errors import HybridSpecError

# subcommand -> (module, one-line help)
SUBCOMMANDS = {
    "generate": ("hybridspec.cli.generate", "generate text with speculative decoding (embedded byte-level model pair by default)"),
    "simulate": ("hybridspec.cli.simulate", "speculative-decoding economics: tokens per round, speedup, crossover batch"),
    "check": ("hybridspec.cli.check", "run the rollback-correctness suite against a model"),
    "bench": ("hybridspec.cli.bench", "run a benchmark from benches/ (e.g. plain_decode --quick)"),
    "serve": ("hybridspec.cli.serve", "an OpenAI-compatible HTTP server (embedded pair by default; needs the "
                                      "[serve] extra)"),
    "quantize": ("hybridspec.cli.quantize", "write a model directory as a GGUF file, its linear weights quantized "
                                            "(needs the [gguf] extra)"),
}


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, as every other user error
    of the CLI is: `hybridspec generate: error: --temperature: 'abc' is not a
    number`, exit status 2. argparse's own error prints the whole usage first,
    which buries the line that says what is wrong. Subparsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line_message(message, self.prog)}\n")


# argparse's wording for a value its `type` rejected, and ours
_TYPE_ERROR = re.compile(r"^argument (?P<flag>[^:]+): invalid (?P<type>\w+) value: (?P<value>.*)$")
_TYPE_WORDS = {"float": "a number", "int": "an integer"}


def one_line_message(message: str, prog: str) -> str:
    """argparse's error `message` as the CLI says it: the flag first, then what is wrong with its value."""
    match = _TYPE_ERROR.match(message)
    if match:
        expected = _TYPE_WORDS.get(match["type"], f"a valid {match['type']}")
        return f"{match['flag']}: {match['value']} is not {expected}"
    message = message.removeprefix("argument ")
    if message.startswith(("unrecognized arguments", "the following arguments are required")):
        message += f"; `{prog} --help` lists the arguments"
    return message


def build_parser(commands: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; the subparsers of `commands` (default: all) get their
    arguments, which imports their modules."""
    parser = OneLineParser(prog="hybridspec", description=f"hybridspec command line: {' | '.join(SUBCOMMANDS)}")
    parser.add_argument("--version", action="version", version=f"hybridspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if commands is None or name in commands:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(_run=module.run)
    return parser


def chosen_command(argv: list[str]) -> str | None:
    """The subcommand `argv` names (its first word that is one), or None."""
    return next((word for word in argv if word in SUBCOMMANDS), None)


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand. A user error (any HybridSpecError) and a missing optional
    dependency end with exit status 2 and one line on stderr, Ctrl-C with 130, a closed stdout (`| head`) quietly
    with 141 (128 + SIGPIPE, as the shell reports it); any other exception is an
    internal error and keeps its traceback."""
    argv = sys.argv[1:] if argv is None else argv
    command = chosen_command(argv)
    args = build_parser([] if command is None else [command]).parse_args(argv)
    try:
        return args._run(args)
    except HybridSpecError as error:
        print(f"hybridspec {args.command}: error: {error}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        extra = missing_extra(error)
        if extra is None:
            raise
        print(f"hybridspec {args.command}: error: {missing_message(error.name, extra)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hybridspec {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _discard_stdout()
        return 141


def _discard_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured in tests)
        pass


if __name__ == "__main__":
    sys.exit(main())
