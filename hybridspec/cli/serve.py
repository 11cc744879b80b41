"""`hybridspec serve`: the OpenAI-compatible server from the command line
(the embedded byte-level pair by default, on 127.0.0.1:8000)."""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from hybridspec.cli.args import DTYPE_NAMES, TREE_HELP, add_model_arguments, gamma_arg, tree_arg
from hybridspec.errors import UsageError
from hybridspec.serve import BYTES_PER_TOKEN, DEFAULT_MAX_N, ENVELOPE_BYTES

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: none required)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the model directory's name, or 'hybridspec')")
    parser.add_argument("--num-draft-tokens", type=gamma_arg, default="auto",
                        help="γ, drafts per sequence per round, or 'auto' (adaptive; default)")
    parser.add_argument("--max-draft-tokens", type=int, default=None, help="γ_max of 'auto' (default 8)")
    parser.add_argument("--tree", type=tree_arg, default=None, metavar="W1,W2,...|auto", help=TREE_HELP)
    parser.add_argument("--verify", choices=("rejection", "coupled"), default="rejection",
                        help="verification (default rejection: lossless rejection sampling for requests without a "
                             "seed, coupled for seeded ones; coupled: every sampled request)")
    parser.add_argument("--max-batch-size", type=int, default=16, help="most sequences running at once (default 16)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="most tokens per sequence (default: the model's limit, at most 4096)")
    parser.add_argument("--prefix-cache", action="store_true", help="reuse cached prompt prefixes across requests")
    parser.add_argument("--max-queue", type=int, default=256,
                        help="most requests waiting for their first token; more get 503 (default 256)")
    parser.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                        help=f"most choices per prompt a request may ask for (n); more get 400 "
                             f"(default {DEFAULT_MAX_N})")
    parser.add_argument("--max-body-bytes", type=int, default=None,
                        help=f"largest request body in bytes; larger ones get 413 before they are read (default: "
                             f"{BYTES_PER_TOKEN} bytes per token of --max-model-len plus {ENVELOPE_BYTES >> 20} MiB)")
    parser.add_argument("--chat-template", metavar="FILE|TEXT", default=None,
                        help="Jinja chat template (a file or the template itself) used instead of the tokenizer's")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=None, help="model dtype (default float32 on CPU)")
    parser.add_argument("--compute", choices=("float32", "bfloat16"), default=None,
                        help="what the products multiply in: float32 (default, exact) or bfloat16 (the fast path on CPUs with "
                             "AVX512-BF16: activations rounded to bf16, close to float32, not its bits)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads for CPU runs")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def run(args: argparse.Namespace) -> int:
    from hybridspec.serve import serve
    import fastapi, uvicorn  # noqa: F401,E401  (a missing [serve] extra ends the command here, before the model loads)
    if args.max_queue < 1:
        raise UsageError(f"--max-queue {args.max_queue} must be >= 1")
    if args.max_n < 1:
        raise UsageError(f"--max-n {args.max_n} must be >= 1")
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        raise UsageError(f"--max-body-bytes {args.max_body_bytes} must be >= 1 (leave it out for the default sized "
                         "to the context)")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from hybridspec.tp.launch import is_first_rank, join
    device = join(args.tensor_parallel_size, args.device)
    began = time.perf_counter()
    log.info("loading %s", args.model or "the embedded model pair")  # said before the wait, not after
    llm = build_llm(args, device)
    log.info("loaded in %.1f s", time.perf_counter() - began)
    if not is_first_rank():  # tensor parallel: rank 0 serves and tells this rank what to run
        from hybridspec.serve.loop import follow
        follow(llm.engine)
        return 0
    serve(llm, host=args.host, port=args.port, log_level=args.log_level, served_model_name=served_name(args),
          api_key=args.api_key, max_queue=args.max_queue, chat_template=chat_template(args.chat_template),
          max_n=args.max_n, max_body_bytes=args.max_body_bytes)
    return 0


def build_llm(args: argparse.Namespace, device: str):
    from hybridspec.cli.args import engine_config
    from hybridspec.llm import DEFAULT_DRAFT, LLM
    draft = DEFAULT_DRAFT if args.draft is None else None if args.draft == "none" else args.draft
    return LLM(args.model, draft=draft, tokenizer=args.tokenizer, config=engine_config(args), device=device,
               dtype=args.dtype, threads=args.threads, compute=args.compute)


def served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    return Path(args.model).name if args.model else "hybridspec"


def chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    return path.read_text() if len(value) < 4096 and path.is_file() else value
