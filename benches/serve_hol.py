"""Head-of-line blocking: how long one big request silences the other streams of `hybridspec serve`.

A server over the embedded pair (γ = 4, started in a process of its own on
127.0.0.1, so the clients here share no interpreter lock with it) streams one
long greedy completion; while it streams, one big request is sent, and the
longest gap between two chunks of the stream while that request is in flight
is recorded with the big request's status and answer time. Big requests: a
body over the server's size limit (413), a text prompt and a token-id prompt
of about the same size under the limit but longer than the context (400), and
none (the stream alone).

    python benches/serve_hol.py            # 10 MB bodies, a 16 MiB limit for the allowed ones
    python benches/serve_hol.py --quick    # 2 MB bodies (still over the default limit): a smoke run
"""
from __future__ import annotations

import json
import multiprocessing
import socket
import threading
import time

from common import bench_parser, print_table, write_json

STREAM_TOKENS = 4000


def serve(limit: int | None, ready) -> None:
    """The server process: the embedded pair behind `create_app` on an ephemeral port (its URL sent on `ready`)."""
    import uvicorn

    import hybridspec as hs
    from hybridspec.serve import create_app
    limits = {} if limit is None else {"max_body_bytes": limit}
    app = create_app(hs.LLM(num_draft_tokens=4, max_batch_size=4), served_model_name="bench", **limits)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=lambda: _announce(server, sock, ready), daemon=True).start()
    server.run(sockets=[sock])


def _announce(server, sock, ready) -> None:
    while not server.started:
        time.sleep(0.01)
    ready.send(f"http://127.0.0.1:{sock.getsockname()[1]}")


class Stream:
    """One long greedy streaming completion read in a thread; the arrival time of every chunk."""

    def __init__(self, url: str, model: str = "bench"):
        self.url, self.model, self.times, self.stop = url, model, [], threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        import httpx
        body = {"model": self.model, "prompt": "def main():", "max_tokens": STREAM_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.times.append(time.perf_counter())
                if self.stop.is_set():
                    return

    def longest_gap(self, start: float, end: float) -> float:
        """The longest silence between chunks that overlaps [start, end]."""
        times = self.times
        gaps = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
        return max(gaps, default=float("nan"))


def big_bodies(size: int) -> dict[str, bytes | None]:
    """The requests sent while the stream runs, about `size` bytes each (None: nothing sent)."""
    text = json.dumps({"model": "bench", "prompt": "x" * size, "max_tokens": 4}).encode()
    count = size // len("255, ")
    ids = json.dumps({"model": "bench", "prompt": [120] * count, "max_tokens": 4}).encode()
    return {"none": None, "text prompt over the context": text, "token-id prompt over the context": ids}


def measure(url: str, name: str, body: bytes | None, alone_s: float) -> dict:
    """One row: `body` sent while a stream runs (None: the stream alone for `alone_s`)."""
    import httpx
    stream = Stream(url)
    stream.thread.start()
    while len(stream.times) < 20:  # the stream is running
        time.sleep(0.01)
    began = time.perf_counter()
    status = None
    if body is None:
        time.sleep(alone_s)
    else:
        status = httpx.post(url + "/v1/completions", content=body, timeout=120,
                            headers={"content-type": "application/json"}).status_code
    answered = time.perf_counter()
    stream.stop.set()
    while stream.times[-1] < answered and stream.thread.is_alive():  # the first chunk after the answer
        time.sleep(0.01)
    stream.thread.join(timeout=120)
    return dict(request=name, body_mb=0 if body is None else len(body) / 1e6, status=status,
                answer_s=answered - began, longest_gap_s=stream.longest_gap(began, answered))


def run_server(limit: int | None):
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=serve, args=(limit, theirs), daemon=True)
    process.start()
    if not ours.poll(300):
        process.kill()
        raise RuntimeError("the server did not start")
    return process, ours.recv()


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--size", type=int, default=None, help="bytes of each big body (default 10 MB; --quick 2 MB)")
    parser.add_argument("--limit", type=int, default=16 << 20,
                        help="the server's --max-body-bytes for the allowed bodies (default 16 MiB); 0: the "
                             "server's own default")
    args = parser.parse_args(argv)
    size = args.size or (2_000_000 if args.quick else 10_000_000)
    rows = []
    for limit, bodies in ((args.limit or None, big_bodies(size)),
                          (None, {"body over the default limit": big_bodies(size)["text prompt over the context"]})):
        process, url = run_server(limit)
        try:
            rows += [measure(url, name, body, 0.2 if args.quick else 2.0) for name, body in bodies.items()]
        finally:
            process.kill()
    print_table(rows, ["request", "body_mb", "status", "answer_s", "longest_gap_s"])
    write_json(args.out or "serve_hol.json", {"size": size, "limit": args.limit, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
