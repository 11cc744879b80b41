"""Serving: request throughput and latency of `hybridspec serve` under Poisson arrivals.

For each server variant (plain decoding, a fixed γ, adaptive γ "auto"; the
embedded pair, started here on 127.0.0.1 in this process) and each request
rate, a fixed seeded workload (prompts cut from Python standard-library
files, output lengths drawn uniformly) is sent by streaming clients arriving
as a Poisson process from a process of their own (so that they do not take
the server's interpreter lock, as the anchors' load generators do not). Per run: request throughput, output tokens/s, time to
first token (TTFT) and inter-token latency (ITL: the rest of a request's
time over its other tokens) at p50 and p99, and the preemptions the server
counted. The offline reference is `generate` over the same workload.

    python benches/serve.py            # the measurement (several minutes)
    python benches/serve.py --quick    # a smoke run
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import common
from common import bench_parser, print_table, save_png, set_threads, write_json

VARIANTS = {"plain": dict(draft=None), "γ=4": dict(num_draft_tokens=4), "auto": dict(num_draft_tokens="auto")}


def workload(count: int, max_tokens: tuple[int, int], seed: int = 0) -> list[tuple[str, int]]:
    """`count` (prompt, max_tokens) pairs: 64-256 bytes of stdlib source each."""
    rng = random.Random(seed)
    text = Path(statistics.__file__).read_text()
    pairs = []
    for _ in range(count):
        length = rng.randint(64, 256)
        start = rng.randrange(len(text) - length)
        pairs.append((text[start:start + length], rng.randint(*max_tokens)))
    return pairs


class Server:
    """A uvicorn server of `create_app(llm)` on an ephemeral port, in a thread."""

    def __init__(self, llm):
        import uvicorn
        from hybridspec.serve import create_app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(llm, served_model_name="bench"), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.sock.close()


async def one_request(http, prompt: str, max_tokens: int) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    began, first, tokens = time.perf_counter(), None, 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            # parse only what is read (the first token's chunk, the usage chunk): a light client
            if not line.startswith("data: {") or (first is not None and '"usage": {' not in line):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    ended = time.perf_counter()
    return dict(ttft=first - began, itl=(ended - first) / max(1, tokens - 1), tokens=tokens, ended=ended)


async def poisson_run(url: str, pairs, rate: float, seed: int = 1) -> tuple[list[dict], float]:
    import httpx
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        began, tasks = time.perf_counter(), []
        for prompt, max_tokens in pairs:
            tasks.append(asyncio.create_task(one_request(http, prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    return results, max(r["ended"] for r in results) - began


def clients(url: str, pairs, rate: float) -> tuple[list[dict], float]:
    """`poisson_run` in a child process of its own (spawned: it shares no lock with the server)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(run_clients, (url, pairs, rate))


def run_clients(url: str, pairs, rate: float) -> tuple[list[dict], float]:
    return asyncio.run(poisson_run(url, pairs, rate))


def preemptions(url: str) -> int:
    import httpx
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("hybridspec_preemptions_total"):
            return int(float(line.split()[-1]))
    return 0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(llm, name: str, pairs, rates: list[float]) -> list[dict]:
    import hybridspec as hs
    params = [hs.SamplingParams(max_new_tokens=m, ignore_eos=True) for _, m in pairs]
    began = time.perf_counter()
    llm.generate([p for p, _ in pairs], params)
    offline = sum(m for _, m in pairs) / (time.perf_counter() - began)
    first_token = 1e3 * statistics.median(first_token_seconds(llm, prompt) for prompt, _ in pairs)
    rows = []
    with Server(llm) as server:
        for rate in rates:
            before = preemptions(server.url)
            results, seconds = clients(server.url, pairs, rate)
            ttft, itl = [r["ttft"] for r in results], [r["itl"] for r in results]
            rows.append(dict(variant=name, rate=rate, req_per_s=len(results) / seconds,
                             out_tok_per_s=sum(r["tokens"] for r in results) / seconds, offline_tok_per_s=offline,
                             offline_ttft_ms=first_token,
                             ttft_p50_ms=1e3 * pct(ttft, 0.5), ttft_p99_ms=1e3 * pct(ttft, 0.99),
                             itl_p50_ms=1e3 * pct(itl, 0.5), itl_p99_ms=1e3 * pct(itl, 0.99),
                             preemptions=preemptions(server.url) - before))
    return rows


def first_token_seconds(llm, prompt: str) -> float:
    """Offline time to first token: one request alone, prefill and its first token."""
    import hybridspec as hs
    began = time.perf_counter()
    llm.generate([prompt], hs.SamplingParams(max_new_tokens=1, ignore_eos=True))
    return time.perf_counter() - began


def verdicts(rows: list[dict]) -> list[dict]:
    """The serving targets: output tok/s at the highest rate >= 0.9x offline; auto >= plain output tok/s at
    every rate; p50 TTFT at the lowest rate <= 1.2x the offline time to first token."""
    out, by = [], {(r["variant"], r["rate"]): r for r in rows}
    top, low = max(r["rate"] for r in rows), min(r["rate"] for r in rows)
    for name in dict.fromkeys(r["variant"] for r in rows):
        r = by[name, top]
        out.append(dict(target=f"{name}: served / offline tok/s at {top:g} req/s", figure=r["out_tok_per_s"]
                        / r["offline_tok_per_s"], threshold=">= 0.9"))
        r = by[name, low]
        out.append(dict(target=f"{name}: p50 TTFT / offline first token at {low:g} req/s",
                        figure=r["ttft_p50_ms"] / r["offline_ttft_ms"], threshold="<= 1.2"))
    for rate in sorted({r["rate"] for r in rows}):
        if ("auto", rate) in by and ("plain", rate) in by:
            out.append(dict(target=f"auto / plain output tok/s at {rate:g} req/s", threshold=">= 1",
                            figure=by["auto", rate]["out_tok_per_s"] / by["plain", rate]["out_tok_per_s"]))
    return out


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        left.plot([r["rate"] for r in mine], [r["out_tok_per_s"] for r in mine], marker="o", label=name)
        right.plot([r["rate"] for r in mine], [r["ttft_p99_ms"] for r in mine], marker="o", label=name)
    left.set(xlabel="request rate (1/s)", ylabel="output tokens/s")
    right.set(xlabel="request rate (1/s)", ylabel="p99 TTFT (ms)")
    left.legend()
    save_png(fig, path)


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--rates", type=float, nargs="+", default=None, help="request rates (requests/s)")
    parser.add_argument("--requests", type=int, default=None, help="requests per rate (default 96; --quick 6)")
    parser.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=None,
                        help="servers to measure (default all; --quick plain and γ=4)")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    import hybridspec as hs

    if args.quick:
        pairs, rates, variants = workload(6, (4, 12)), [4.0, 32.0], {k: VARIANTS[k] for k in ("plain", "γ=4")}
    else:
        pairs, rates, variants = workload(96, (32, 160)), [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0], VARIANTS
    rates = args.rates or rates
    if args.requests:
        pairs = workload(args.requests, (4, 12) if args.quick else (32, 160))
    if args.variants:
        variants = {k: VARIANTS[k] for k in args.variants}
    rows = []
    for name, settings in variants.items():
        rows += measure(hs.LLM(max_batch_size=16, **settings), name, pairs, rates)
    print_table(rows, title=f"hybridspec serve, embedded pair, {len(pairs)} requests per rate; "
                            f"{common.describe_machine()}")
    targets = verdicts(rows)
    print_table(targets, title="serving targets (figure against threshold)")
    out = args.out or Path("serve.json")
    write_json(out, {"rows": rows, "requests": len(pairs), "targets": targets})
    plot(rows, Path(out).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
