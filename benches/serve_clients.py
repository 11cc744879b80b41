"""Real clients against `hybridspec serve`: lm-evaluation-harness and aiperf.

Each server is `python -m hybridspec serve` on the embedded pair, spawned here
on 127.0.0.1 and a free port and stopped at the end: the speculative default
(`num_draft_tokens="auto"`) and a plain one (`--draft none`); the
seconds from spawning it to its first answer to /health are recorded.

- lm-eval (`pip install lm-eval`): a generation task and a multiple-choice task
  on the local files `benches/data/serve_clients_{gen,mc}.jsonl` (tasks written
  as YAML here, datasets read offline), run once through `local-completions`
  against the speculative server (the tokenizer read from the embedded
  target's folder: lm-eval's `tokenizer_backend=auto` takes the server's
  only where it also answers vLLM's /tokenizer_info) and once through lm-eval's `hf` model
  on the same checkpoint (the embedded target folder, float32). Per item: the
  log-likelihood of every choice (target: within 1e-4 of HF's), the chosen
  answer (identical), the generated text; and each task's score.
- aiperf (`pip install aiperf`; its `aiperf` command found on PATH or given
  with `--aiperf`): streamed completions of about `--input-tokens` in and
  exactly `--output-tokens` out (`ignore_eos`) at each concurrency, against
  both servers: TTFT and inter-token latency percentiles, output tokens/s.
  Where aiperf is missing or fails, the error is recorded and the same
  measurement is made by this file's own client (httpx, async, one stream per
  concurrent slot; TTFT at the first chunk with text, ITL as aiperf computes
  it: (latency − TTFT) / (tokens − 1)).

    python benches/serve_clients.py            # the measurement
    python benches/serve_clients.py --quick    # own client only, servers in threads, tiny: a smoke run
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import bench_parser, describe_machine, print_table, write_json

DATA = Path(__file__).resolve().parent / "data"
SERVED_NAME = "bench"
PERCENTILES = (50, 90, 99)
GEN_TASK = """task: hs_serve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/serve_clients_gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 24
  do_sample: false
metric_list:
  - metric: exact_match
"""
MC_TASK = """task: hs_serve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/serve_clients_mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
"""


class Server:
    """`python -m hybridspec serve` on 127.0.0.1 and a free port, in a process of its own; stopped on exit."""

    def __init__(self, *flags: str):
        self.flags = flags

    def __enter__(self):
        import httpx
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "hybridspec", "serve", "--port", str(port), "--served-model-name",
                   SERVED_NAME, "--log-level", "warning", *self.flags]
        began = time.perf_counter()
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.process.stderr.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        self.ready_s = time.perf_counter() - began
        return self

    def __exit__(self, *exc):
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def serving(plain: bool, max_batch_size: int, in_process: bool):
    """The CLI's server in a process of its own, or (`in_process`, for a smoke run) the same app in a thread."""
    if not in_process:
        return Server("--max-batch-size", str(max_batch_size), *(("--draft", "none") if plain else ()))
    import hybridspec as hs
    from serve import Server as ThreadServer
    return ThreadServer(hs.LLM(max_batch_size=max_batch_size, **({"draft": None} if plain else {})))


# lm-evaluation-harness

def hf_model(target_dir: Path):
    """lm-eval's `hf` model on the embedded target, float32. Its tokenizer names no end-of-text token (the
    byte codec has none), which lm-eval's generation needs: the NUL byte, absent from the tasks, stands in."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(0)
    return HFLM(pretrained=str(target_dir), tokenizer=tokenizer, dtype="float32", device="cpu", batch_size=1)


def lm_eval_samples(model, model_args: str | None, tasks_dir: Path) -> dict:
    """{task: (score, [per-item responses by doc_id])} of one lm-eval run over the two local tasks."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    results = simple_evaluate(model=model, model_args=model_args, tasks=["hs_serve_gen", "hs_serve_mc"],
                              task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True,
                              batch_size=1)
    out = {}
    for task, metric in (("hs_serve_gen", "exact_match,none"), ("hs_serve_mc", "acc,none")):
        samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
        out[task] = (results["results"][task][metric], [s["filtered_resps"] for s in samples])
    return out


def lm_eval_comparison(url: str) -> dict:
    """The two tasks through `local-completions` at `url` and through `hf`, compared item by item."""
    from hybridspec.adapters.embedded import embedded_paths
    target_dir = embedded_paths()[0]
    with tempfile.TemporaryDirectory() as tasks_dir:
        for name, text in (("gen", GEN_TASK), ("mc", MC_TASK)):
            Path(tasks_dir, f"hs_serve_{name}.yaml").write_text(text.format(data=DATA))
        served = lm_eval_samples("local-completions",
                                 f"model={SERVED_NAME},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                                 f"tokenizer={target_dir},num_concurrent=1,max_retries=1", Path(tasks_dir))
        hf = lm_eval_samples(hf_model(target_dir), None, Path(tasks_dir))
    served_ll = [[ll for ll, _ in item] for item in served["hs_serve_mc"][1]]
    hf_ll = [[ll for ll, _ in item] for item in hf["hs_serve_mc"][1]]
    answers = [(max(range(len(a)), key=a.__getitem__), max(range(len(b)), key=b.__getitem__))
               for a, b in zip(served_ll, hf_ll)]
    texts = list(zip(served["hs_serve_gen"][1], hf["hs_serve_gen"][1]))
    return {
        "items (generation, multiple choice)": [len(texts), len(served_ll)],
        "max |log-likelihood served − HF|": max(abs(x - y) for a, b in zip(served_ll, hf_ll) for x, y in zip(a, b)),
        "same answers": sum(a == b for a, b in answers), "same generated text": sum(a == b for a, b in texts),
        "served scores": {task: score for task, (score, _) in served.items()},
        "hf scores": {task: score for task, (score, _) in hf.items()},
        "served log-likelihoods": served_ll, "hf log-likelihoods": hf_ll,
        "generated": [{"served": a, "hf": b} for a, b in texts]}


# aiperf, and the own client standing in for it

def aiperf_run(aiperf: str, url: str, concurrency: int, requests: int, input_tokens: int, output_tokens: int,
               tokenizer: Path) -> dict:
    """aiperf's TTFT / ITL percentiles and output tokens/s (raises RuntimeError with aiperf's error text)."""
    with tempfile.TemporaryDirectory() as artifacts:
        command = [aiperf, "profile", "--model", SERVED_NAME, "--url", url, "--endpoint-type", "completions",
                   "--streaming", "--concurrency", str(concurrency), "--request-count", str(requests),
                   "--prompt-input-tokens-mean", str(input_tokens), "--prompt-input-tokens-stddev", "0",
                   "--prompt-output-tokens-mean", str(output_tokens), "--prompt-output-tokens-stddev", "0",
                   "--extra-inputs", "ignore_eos:true", "--tokenizer", str(tokenizer),
                   "--output-artifact-dir", artifacts, "--ui-type", "none", "--warmup-request-count", "1",
                   "--no-auto-plot"]
        # aiperf's offline mode looks a local tokenizer folder up as a Hub snapshot and fails
        # ("Repo id must be in the form 'repo_name'"); online, an absolute path is read as a folder
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
        found = sorted(Path(artifacts).rglob("profile_export_aiperf.json"))
        if done.returncode != 0 or not found:
            raise RuntimeError((done.stderr or done.stdout)[-1500:])
        metrics = json.loads(found[0].read_text())
    def stat(name: str, scale: float) -> dict:
        values = metrics[name]
        return {f"p{q}": values[f"p{q}"] * scale for q in PERCENTILES}
    return {"ttft_ms": stat("time_to_first_token", 1.0), "itl_ms": stat("inter_token_latency", 1.0),
            "output tok/s": metrics["output_token_throughput"]["avg"]}


async def one_stream(http, prompt: list[int], output_tokens: int) -> tuple[float, float, int]:
    """(TTFT s, ITL s, tokens) of one streamed greedy completion of exactly `output_tokens`."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    began, first, tokens = time.perf_counter(), None, 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    latency = time.perf_counter() - began
    return first - began, (latency - (first - began)) / max(1, tokens - 1), tokens


async def own_client(url: str, concurrency: int, requests: int, input_tokens: int, output_tokens: int) -> dict:
    """The aiperf measurement by hand: `concurrency` slots each streaming one request after another."""
    import httpx
    prompts = [[32 + (7 * r + i) % 95 for i in range(input_tokens)] for r in range(requests)]  # printable bytes
    queue = list(reversed(prompts))
    results = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await one_stream(http, prompts[0], 2)  # warm-up

        async def slot():
            while queue:
                results.append(await one_stream(http, queue.pop(), output_tokens))
        began = time.perf_counter()
        await asyncio.gather(*(slot() for _ in range(concurrency)))
        wall = time.perf_counter() - began
    def pct(values: list[float]) -> dict:
        cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
        return {f"p{q}": cuts[q - 1] * 1e3 for q in PERCENTILES}
    return {"ttft_ms": pct([r[0] for r in results]), "itl_ms": pct([r[1] for r in results]),
            "output tok/s": sum(r[2] for r in results) / wall}


def load_rows(url: str, server: str, args, aiperf: str | None, errors: dict) -> list[dict]:
    """One row per concurrency: aiperf's figures, or the own client's where aiperf cannot run."""
    from hybridspec.adapters.embedded import embedded_paths
    rows = []
    for concurrency in args.concurrency:
        requests = max(args.requests, concurrency)
        measured, tool = None, "own client"
        if aiperf is not None and "aiperf" not in errors:
            try:
                measured, tool = aiperf_run(aiperf, url, concurrency, requests, args.input_tokens,
                                            args.output_tokens, embedded_paths()[0]), "aiperf"
            except (RuntimeError, subprocess.TimeoutExpired, KeyError) as error:
                errors["aiperf"] = f"{type(error).__name__}: {error}"
        if measured is None:
            measured = asyncio.run(own_client(url, concurrency, requests, args.input_tokens, args.output_tokens))
        rows.append({"server": server, "concurrency": concurrency, "requests": requests, "tool": tool,
                     **{f"TTFT p{q} ms": measured["ttft_ms"][f"p{q}"] for q in PERCENTILES},
                     **{f"ITL p{q} ms": measured["itl_ms"][f"p{q}"] for q in PERCENTILES},
                     "output tok/s": measured["output tok/s"]})
    return rows


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency (at least the concurrency)")
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--aiperf", default=shutil.which("aiperf"), help="the aiperf command (default: on PATH)")
    parser.add_argument("--skip-lm-eval", action="store_true")
    args = parser.parse_args(argv)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # lm-eval and aiperf read local files only
    aiperf, errors = args.aiperf, {}
    if args.quick:
        args.concurrency, args.requests, args.input_tokens, args.output_tokens = [1, 2], 2, 16, 4
        aiperf, args.skip_lm_eval = None, True
    if aiperf is None and not args.quick:
        errors["aiperf"] = "not installed (pip install aiperf), or give its command with --aiperf"
    rows, lm_eval, ready = [], None, {}
    for server, plain in (("speculative (auto)", False), ("plain", True)):
        with serving(plain, max(args.concurrency), args.quick) as running:
            ready[server] = getattr(running, "ready_s", None)
            if server.startswith("speculative") and not args.skip_lm_eval:
                try:
                    lm_eval = lm_eval_comparison(running.url)
                except ImportError as error:
                    errors["lm-eval"] = f"not installed (pip install lm-eval): {error}"
            rows += load_rows(running.url, server, args, aiperf, errors)
    print_table(rows, ["server", "concurrency", "tool", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "ITL p50 ms",
                       "ITL p90 ms", "ITL p99 ms", "output tok/s"])
    top = max(args.concurrency)
    by = {r["server"]: r["output tok/s"] for r in rows if r["concurrency"] == top}
    ratio = by["speculative (auto)"] / by["plain"]
    print(f"speculative / plain output tok/s at concurrency {top}: {ratio:.2f}; ready in "
          + ", ".join(f"{k} {v:.1f} s" for k, v in ready.items() if v is not None))
    if lm_eval is not None:
        print(json.dumps({k: v for k, v in lm_eval.items() if "log-likelihoods" not in k and k != "generated"}))
    for tool, error in errors.items():
        print(f"{tool}: {error}", file=sys.stderr)
    write_json(args.out or "serve_clients.json",
               {"machine": describe_machine(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                "speculative / plain at top concurrency": ratio, "ready_s": ready, "lm_eval": lm_eval,
                "errors": errors})
    return 0 if lm_eval is None or lm_eval["same answers"] == lm_eval["items (generation, multiple choice)"][1] \
        else 1


if __name__ == "__main__":
    sys.exit(main())
