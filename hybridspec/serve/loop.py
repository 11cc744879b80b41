"""`EngineLoop`: the one thread that drives `Engine.step()` for a server.

Request handlers (asyncio) submit prompts and abort them through a command
queue; the loop thread adds them to the engine between steps, runs a step
whenever there is work, and hands every `StepOutput` to its request's
asyncio queue; a new request's first token as soon as its prefill made it,
before the step's round (`Engine.step(first_tokens=)`). A request's handler ends it (`abort`) when its client leaves,
so its pages and rings return to the pools at the next step boundary.

Tensor parallel: rank 0 serves HTTP and drives its engine as above; every
engine call it makes (add, abort, step) is sent to the other ranks before the
step that follows it, and each of them replays the calls on its own engine in
the same order (`follow`), so every rank's engine holds the same requests and
enters every step, and its collectives, together.

An exception inside `step()` fails the requests of that step (its batch,
`Engine.step_request_ids`: each gets an `EngineFailure`, the server answers
500) and aborts them so their pages and rings return; the requests still
waiting in the engine's queue run on, and the loop keeps serving.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass

from hybridspec.engine.engine import Engine, StepOutput
from hybridspec.sampling.sampler import SamplingParams
from hybridspec.serve.metrics import Metrics
from hybridspec.serve.protocol import ApiError

log = logging.getLogger("hybridspec.serve")

# How often the interpreter lock may pass between the engine thread and the HTTP thread while the server
# runs: Python's 5 ms default makes a request's first token wait behind the engine's Python work.
SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class EngineFailure:
    """What a request's queue receives when a step it was part of raised."""

    message: str


@dataclass
class _Sink:
    """Where one engine request's outputs go (an asyncio queue of `(request_id, item)`)."""

    queue: asyncio.Queue
    aloop: asyncio.AbstractEventLoop
    samples_left: int
    submitted_at: float
    last_token_at: float | None = None  # None until its first token: it waits

    def put(self, request_id: int, item) -> None:
        self.aloop.call_soon_threadsafe(self.queue.put_nowait, (request_id, item))


class EngineLoop:
    """engine: the Engine to drive; max_queue: most requests waiting for their
    first token (submitted beyond it: 503); metrics: where to count."""

    def __init__(self, engine: Engine, max_queue: int, metrics: Metrics):
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self.mirror = Mirror(engine.tensor_parallel)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[int, _Sink] = {}  # loop thread only
        self._lock = threading.Lock()
        self._num_waiting = 0  # submitted, no token yet (guarded by _lock)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="hybridspec-engine-loop", daemon=True)

    # -- from the request handlers (asyncio) -----------------------------------------------------

    def start(self) -> None:
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_S))
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.mirror.stop()
        sys.setswitchinterval(self._switch_interval)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    async def submit(self, prompt: list[int], params: SamplingParams, out: asyncio.Queue) -> int:
        """Queue `prompt`; returns its request id once the engine took it. Its
        outputs arrive on `out` as `(request_id, StepOutput | EngineFailure)`.
        ApiError 503 past max_queue; the engine's InvalidRequestError as is."""
        with self._lock:
            if self._num_waiting >= self.max_queue:
                raise ApiError(503, f"the server has {self._num_waiting} requests waiting (--max-queue "
                                    f"{self.max_queue}); retry later")
            self._num_waiting += 1
        aloop = asyncio.get_running_loop()
        accepted = aloop.create_future()
        sink = _Sink(out, aloop, params.n, time.perf_counter())
        self._commands.put(("add", prompt, params, sink, accepted))
        self._wake.set()
        return await accepted

    def abort(self, request_id: int) -> None:
        """End a request now (a client that left); nothing more reaches its queue."""
        self._commands.put(("abort", request_id))
        self._wake.set()

    # -- the loop thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._take_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            self.mirror.send("step")
            try:
                outputs = self.engine.step(first_tokens=self._hand_out)  # first tokens before the round
            except Exception as error:  # noqa: BLE001 - any failure of a step must not end the loop
                log.exception("engine step failed; failing its requests")
                self._fail_step(f"the engine failed while generating: {type(error).__name__}: {error}")
                continue
            self._hand_out(outputs)
            self.metrics.observe_engine(self.engine, len(self._sinks), self._num_waiting)
        self._take_commands()
        self._end_all("the server is shutting down")  # nothing stays in the engine after its loop

    def _take_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._add(*command[1:])
            else:
                self._drop(command[1], abort=True)

    def _add(self, prompt, params, sink: _Sink, accepted: asyncio.Future) -> None:
        try:
            request_id = self.engine.add_request(prompt, params)
        except Exception as error:  # noqa: BLE001 - handed to the handler (InvalidRequestError: a 400)
            self._stop_waiting(1)
            sink.aloop.call_soon_threadsafe(self._settle, accepted, None, error)
            return
        self.mirror.record("add", prompt, params)
        self._sinks[request_id] = sink
        self.metrics.prompt_tokens.inc(len(prompt))
        sink.aloop.call_soon_threadsafe(self._settle, accepted, request_id, None)

    def _drop(self, request_id: int, abort: bool) -> None:
        sink = self._sinks.pop(request_id, None)
        if sink is not None and sink.last_token_at is None:
            self._stop_waiting(1)
        if abort and sink is not None:  # its unfinished samples end here: /metrics counts them as aborted
            for _ in range(sink.samples_left):
                self.metrics.finished("abort")
        if abort:
            self.engine.abort(request_id)
            self.mirror.record("abort", request_id)

    def _stop_waiting(self, count: int) -> None:
        with self._lock:
            self._num_waiting -= count

    def _hand_out(self, outputs: list[StepOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:  # aborted: its client left
                continue
            if out.token_ids:
                self._time_tokens(sink, len(out.token_ids), now)
            sink.put(out.request_id, out)
            if out.finished:
                sink.samples_left -= 1
                self.metrics.finished(out.finish_reason)
                if sink.samples_left == 0:
                    self._drop(out.request_id, abort=False)

    def _time_tokens(self, sink: _Sink, count: int, now: float) -> None:
        self.metrics.generation_tokens.inc(count)
        if sink.last_token_at is None:
            self._stop_waiting(1)
            self.metrics.ttft.observe(now - sink.submitted_at)
        else:  # a round's tokens arrive together: each gets its share of the gap
            gap = (now - sink.last_token_at) / count
            for _ in range(count):
                self.metrics.itl.observe(gap)
        sink.last_token_at = now

    def _fail_step(self, message: str) -> None:
        """End the requests of the step that raised with `message`. One that
        raised before any request joined it ends them all: nothing else would
        end a failure that repeats every step."""
        self.metrics.engine_failures.inc()
        failed = self.engine.step_request_ids()
        if not failed:
            self._end_all(message)
        for request_id in failed:
            self._fail(request_id, message)

    def _end_all(self, message: str) -> None:
        for request_id in list(self._sinks):
            self._fail(request_id, message)

    def _fail(self, request_id: int, message: str) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:  # (None: its client left already)
            sink.put(request_id, EngineFailure(message))
        self._drop(request_id, abort=True)

    def _settle(self, future: asyncio.Future, request_id: int | None, error) -> None:
        """Answer a `submit` (on its event loop); a handler that left meanwhile gets its request aborted."""
        if future.cancelled():
            if request_id is not None:
                self.abort(request_id)
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(request_id)


class Mirror:
    """Rank 0's engine calls for the other tensor-parallel ranks (`follow`):
    recorded as they are made, sent as one message before each step (and
    "stop" at the end). Without tensor parallelism it does nothing."""

    def __init__(self, tp):
        self.tp, self._calls = tp, []

    def record(self, *call) -> None:
        if self.tp is not None:
            self._calls.append(call)

    def send(self, *call) -> None:
        """Send what was recorded, then `call` (which this rank makes next)."""
        if self.tp is not None:
            calls, self._calls = self._calls + [call], []
            self.tp.broadcast(calls)

    def stop(self) -> None:
        self.send("stop")


def follow(engine: Engine) -> None:
    """The engine loop of a tensor-parallel rank other than 0: make rank 0's
    engine calls, in its order, until it stops."""
    tp = engine.tensor_parallel
    while True:
        for call in tp.broadcast(None):
            kind, args = call[0], call[1:]
            if kind == "stop":
                return
            if kind == "add":
                engine.add_request(*args)
            elif kind == "abort":
                engine.abort(*args)
            else:
                try:
                    engine.step()
                except Exception:  # noqa: BLE001 - rank 0 fails the step's requests and tells us the aborts
                    log.exception("engine step failed on this rank")
