"""Run a function on every rank of a gloo process group spawned for a test
(`run_ranks`), and the rank-side bodies of tests/test_tensor_parallel.py.
Bounded in time: a rank that hangs fails the test instead of the suite.
HYBRIDSPEC_TP_BACKEND=nccl: an NCCL group instead, rank r computing on GPU r
(benches/gpu_check.sh's tp stage)."""
from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridspec.tp.launch import leave


def run_ranks(body: str, size: int = 2, timeout: float = 300.0, **kwargs) -> list:
    """`body(rank, **kwargs)` (a function of this module, by name) on each of
    `size` spawned ranks of a gloo group; returns each rank's result."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_rank_main, args=(size, tmp, body, kwargs), nprocs=size, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + timeout
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{body} on {size} ranks ran past {timeout:.0f} s")
        return [torch.load(os.path.join(tmp, f"{rank}.pt"), weights_only=False) for rank in range(size)]


def _rank_main(rank: int, size: int, tmp: str, body: str, kwargs: dict) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    torch.set_num_threads(1)
    backend = os.environ.get("HYBRIDSPEC_TP_BACKEND", "gloo")
    if backend == "nccl":  # benches/gpu_check.sh's tp stage: rank r on GPU r, what the bodies build there
        torch.cuda.set_device(rank)
        torch.set_default_device(f"cuda:{rank}")
    dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=size)
    result = globals()[body](rank, **kwargs)  # an exception ends the rank (spawn reports it), the group unjoined
    torch.save(result, os.path.join(tmp, f"{rank}.pt"))
    leave()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is written: skip interpreter teardown, where gloo's leftover threads may abort


# -- rank-side bodies --------------------------------------------------------------------------

FAMILIES = ("bamba", "jamba", "nemotron_h", "nemotron_h_moe", "granite", "falcon_h1", "qwen3_next", "qwen3_5",
            "qwen3_5_moe", "zamba2")
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [3, 3, 4, 9]]


def family_logits(rank: int) -> dict:
    """Per family: the sharded model's prefill, extend and decode logits beside
    one process's (float64), the hidden states a drafter reads (a middle point and
    the last layer's output), and greedy tokens of both."""
    import hybridspec as hs
    import oracles
    from hybridspec.cache.hidden_states import HiddenStates
    out = {}
    for name in FAMILIES:
        hf = getattr(oracles, name)(seed=0)
        logits, tokens, hidden = [], [], []
        for model in (hs.from_hf(hf), hs.from_hf(hf, tensor_parallel_size=dist.get_world_size())):
            cache = hs.Engine(model, max_batch_size=3).cache
            L = model.config.num_layers
            cache.hidden = HiddenStates((L // 2, L), L)
            ids = [0, 1, 2]
            logits.append(torch.cat([model.prefill(cache, ids, PROMPTS, last_only=True)[:, 0],
                                     model.extend(cache, ids, [[3, 4], [5, 6], [7, 8]], last_only=True)[:, 0],
                                     model.decode(cache, ids, [9, 10, 11])]))
            hidden.append(torch.cat([cache.hidden.take(s)[1] for s in ids]))
            engine = hs.Engine(model, max_batch_size=3)
            tokens.append([o.token_ids for o in engine.generate(PROMPTS, hs.SamplingParams(max_new_tokens=8,
                                                                                            ignore_eos=True))])
        out[name] = dict(single=logits[0], sharded=logits[1], tokens=tokens, hidden_single=hidden[0],
                         hidden_sharded=hidden[1])
    return out


def speculative(rank: int) -> dict:
    """Greedy and coupled speculative output under TP against plain TP output, for
    every checkpoint policy and fixed and adaptive γ, a model drafter run whole
    on every rank (and one sharded like the target); a pool tight enough to preempt, the prefix cache (a second
    run hits), each against the requests alone; and
    every sequence's state per shard against a prefill after every step."""
    import hybridspec as hs
    import oracles
    from hybridspec.rollback import perturbed_copy
    from test_adaptive_gamma import ScriptedGammas
    hf = oracles.bamba(seed=0)
    size = dist.get_world_size()
    target, draft = hs.from_hf(hf, tensor_parallel_size=size), perturbed_copy(hs.from_hf(hf), seed=2)
    greedy = hs.SamplingParams(max_new_tokens=12, ignore_eos=True)
    sampled = hs.SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, seed=7)
    plain = {p.temperature: [o.token_ids for o in hs.Engine(target, max_batch_size=3).generate(PROMPTS, p)]
             for p in (greedy, sampled)}
    runs = {}
    for checkpoint in (None, hs.CheckpointPolicy(snapshot_every=2), hs.CheckpointPolicy(snapshot_every=0),
                       hs.CheckpointPolicy(snapshot_every=0, log_inputs=False), "auto"):
        # every policy at a fixed γ; adaptive γ under the auto policy (rank 0's measured costs broadcast at
        # start-up, then rank 0's choice each round, from a script seeded differently on each rank): the
        # policies' restore paths under adaptive γ are the single-process tests'
        for gamma in (3, "auto") if checkpoint == "auto" else (3,):
            for params, verify in ((greedy, "rejection"), (sampled, "coupled")):
                engine = hs.Engine(target, draft=draft, num_draft_tokens=gamma, checkpoint=checkpoint, verify=verify,
                                   max_batch_size=3, tensor_parallel_size=size)
                if gamma == "auto":  # start-up's costs were timed and broadcast; rounds then follow a script
                    # seeded per rank, so the ranks run the same rounds only because rank 0's choice is broadcast
                    # (timings decide whether drafting pays, and a noisy machine may find it never does)
                    engine.gamma_controller = ScriptedGammas(engine.gamma_controller.gamma_max, seed=rank)
                got = [o.token_ids for o in engine.generate(PROMPTS, params)]
                runs[str(checkpoint), gamma, verify] = (got == plain[params.temperature], engine.stats.drafted_tokens)
    sharded_draft = perturbed_copy(hs.from_hf(hf, tensor_parallel_size=size), seed=2)  # a drafter split too
    for params, verify in ((greedy, "rejection"), (sampled, "coupled")):
        engine = hs.Engine(target, draft=sharded_draft, num_draft_tokens=3, verify=verify, max_batch_size=3)
        got = [o.token_ids for o in engine.generate(PROMPTS, params)]
        runs["sharded drafter", verify] = (got == plain[params.temperature], engine.stats.drafted_tokens)
    prompts = [p * 3 for p in PROMPTS] + [PROMPTS[0] * 3 + [1, 2]]
    tight = hs.Engine(target, draft=draft, num_draft_tokens=3, max_batch_size=4, block_size=4, num_blocks=14)
    cached = hs.Engine(target, draft=draft, num_draft_tokens=3, max_batch_size=4, block_size=4, prefix_cache=True)
    tight_out = [[o.token_ids for o in engine.generate(prompts, greedy)] for engine in (tight, cached, cached)]
    alone = [hs.Engine(target, max_batch_size=1, block_size=4).generate([p], greedy)[0].token_ids for p in prompts]
    problems = state_problems_every_step(target, draft, (9, 14, 11), rank)
    return dict(runs=runs, tight=tight_out == [alone] * 3, preemptions=tight.total_stats.preemptions,
                prefix_hits=cached.total_stats.prefix_hit_tokens, problems=problems)


def state_problems_every_step(target, draft, max_new_tokens, rank: int) -> list[str]:
    """Speculative steps (γ = 4, a snapshot every 2 inputs) over PROMPTS with these
    max_new_tokens; after every step, how each running sequence's shard of every
    layer's state differs from a prefill of its committed tokens."""
    import hybridspec as hs
    from hybridspec.rollback.observer import _state_problems
    engine = hs.Engine(target, draft=draft, num_draft_tokens=4, max_batch_size=3,
                       checkpoint=hs.CheckpointPolicy(snapshot_every=2))
    for prompt, n in zip(PROMPTS, max_new_tokens):
        engine.add_request(prompt, hs.SamplingParams(max_new_tokens=n, ignore_eos=True))
    problems = []
    while engine.has_unfinished_requests():
        engine.step()
        for r in engine.scheduler.running:
            committed = r.output.prompt_token_ids + r.output.token_ids
            problems += _state_problems(target, engine.cache, r.seq_id, committed[:-1], f"rank {rank}")
    return problems


def gdn_speculative(rank: int) -> dict:
    """A gated-DeltaNet hybrid (Qwen3.5 MoE) sharded: greedy and coupled
    speculative output against plain output under TP, with snapshots every 2
    inputs and with input-log replay, a model drafter run whole on every rank;
    and every shard's state against a prefill of its committed tokens after
    every step."""
    import hybridspec as hs
    import oracles
    from hybridspec.rollback import perturbed_copy
    hf = oracles.qwen3_5_moe(seed=0)
    size = dist.get_world_size()
    target, draft = hs.from_hf(hf, tensor_parallel_size=size), perturbed_copy(hs.from_hf(hf), seed=2)
    greedy = hs.SamplingParams(max_new_tokens=10, ignore_eos=True)
    sampled = hs.SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.9, seed=7)
    runs = {}
    for params, verify in ((greedy, "rejection"), (sampled, "coupled")):
        plain = [o.token_ids for o in hs.Engine(target, max_batch_size=3).generate(PROMPTS, params)]
        for checkpoint in (hs.CheckpointPolicy(snapshot_every=2), hs.CheckpointPolicy(snapshot_every=0)):
            engine = hs.Engine(target, draft=draft, num_draft_tokens=3, checkpoint=checkpoint, verify=verify,
                               max_batch_size=3, tensor_parallel_size=size)
            got = [o.token_ids for o in engine.generate(PROMPTS, params)]
            runs[str(checkpoint), verify] = (got == plain, engine.stats.drafted_tokens)
    return dict(runs=runs, problems=state_problems_every_step(target, draft, (7, 10, 9), rank))


def mapped_load(rank: int, path: str) -> dict:
    """A sharded load's reads: the weight file's pages resident in this
    process (its private mapping's Rss, the file first dropped from the page
    cache) after the rank's shard is copied out of the mapped tensors, against
    after every tensor is copied; and the logits of
    `hs.load(path, tensor_parallel_size=2)` beside one process's load."""
    from pathlib import Path

    import hybridspec as hs
    from hybridspec.adapters import bamba as adapter
    from hybridspec.adapters.model_files import read_config, read_weights
    from hybridspec.tp import shard_weights
    file = Path(path) / "model.safetensors"
    fd = os.open(file, os.O_RDONLY)
    try:  # out of the page cache: a page resident in the mapping afterwards is one this rank read
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    state, _ = read_weights(Path(path), "cpu", mapped=True)
    config = adapter.config_from_dict(read_config(Path(path)))
    shard_weights(config, adapter.weights_from_state(state), rank, dist.get_world_size())
    sliced = _mapped_rss(file)
    everything = [t.clone() for t in state.values()]
    whole = _mapped_rss(file)
    del state, everything
    logits = []
    for size in (1, dist.get_world_size()):
        model = hs.load(path, tensor_parallel_size=size)
        cache = hs.Engine(model, max_batch_size=3).cache
        logits.append(model.prefill(cache, [0, 1, 2], PROMPTS, last_only=True)[:, 0])
    return dict(sliced=sliced, whole=whole, size=file.stat().st_size, single=logits[0], sharded=logits[1])


def _mapped_rss(file) -> int:
    """Bytes of `file`'s mappings resident in this process (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = fields[-1] == str(file)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def rollback_suite(rank: int) -> list:
    """`hybridspec check --quick` (the rollback suite as a library) on a sharded
    target, its drafter run whole on every rank."""
    import hybridspec as hs
    import oracles
    from hybridspec.rollback import perturbed_copy
    from hybridspec.rollback.checks import run_suite
    hf = oracles.bamba(seed=0)
    target = hs.from_hf(hf, tensor_parallel_size=dist.get_world_size())
    return [(r.name, r.passed, r.detail) for r in run_suite(target, perturbed_copy(hs.from_hf(hf), seed=2),
                                                            quick=True)]


def served(rank: int, prompts: list[str]) -> list | bool:
    """`hybridspec serve` under TP: rank 0 serves the embedded pair on an ephemeral
    port and answers completions (streamed and not) and a client that leaves
    mid-stream; rank 1 follows. Returns rank 0's texts, the offline texts of the
    same sharded LLM and whether its engine ended idle; rank 1, whether its did."""
    import asyncio

    import httpx
    import hybridspec as hs
    from hybridspec.serve.loop import follow
    llm = hs.LLM(tensor_parallel_size=dist.get_world_size(), max_batch_size=4, num_draft_tokens="auto")
    params = hs.SamplingParams(max_new_tokens=16)
    offline = [c.text for c in llm.generate(prompts, params)]  # every rank runs it: the same collectives
    if rank != 0:
        follow(llm.engine)
        return llm.engine.memory().is_idle()
    from test_serve import NAME, LiveServer
    with LiveServer(llm) as server:
        async def ask():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                bodies = [{"model": NAME, "prompt": p, "max_tokens": 16, "temperature": 0} for p in prompts]
                plain = await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))
                async with http.stream("POST", "/v1/completions", json={**bodies[0], "stream": True,
                                                                          "max_tokens": 64}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            break  # the client leaves after its first chunk
                return [reply.json()["choices"][0]["text"] for reply in plain]
        texts = asyncio.run(ask())
        deadline = time.monotonic() + 30
        while not llm.engine.memory().is_idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        idle = llm.engine.memory().is_idle()
    return [texts, offline, idle]  # (leaving the server stopped its loop, which told rank 1 to stop)


def sequences(engine) -> list:
    """What every sequence holds in the target's and the drafter's caches: lengths,
    K/V pages and the state at its head (a round may copy a head to another slot
    of its ring before it starts: `HybridCache.align_heads`; the state is what counts)."""
    out = []
    for cache in (engine.cache, engine.speculator.drafter.cache):
        book = cache.bookkeeping()
        kv, states = book["kv"], book["states"]
        heads = {s: [layer[cache.head(s)].clone() for layer in cache.states.ssm_states + cache.states.conv_states]
                 for s in book["computed_len"]}
        out.append((book["computed_len"], kv.block_tables, kv.kv_lens, states.head_positions,
                    {s: [t.tolist() for t in ts] for s, ts in heads.items()}))
    return out


def one_rank_fault(rank: int) -> dict:
    """A step that raises on rank 1 only, at each of three places: after the
    round's collectives (the drafter's commit), inside the target's verify
    forward (rank 0 waits in a sum for it), and inside a new request's prefill.
    Per place: what each rank raised (rank 0: PeerRankError; waiting out a
    collective's timeout would fail the test's own), whether every running sequence is as before the step, and
    whether the engine then finishes every other request with plain decoding's
    tokens (the request whose prefill failed is aborted, as a server does)."""
    import hybridspec as hs
    import oracles
    from hybridspec.errors import PeerRankError
    from hybridspec.rollback import perturbed_copy
    hf = oracles.bamba(seed=0)
    target = hs.from_hf(hf, tensor_parallel_size=dist.get_world_size())
    greedy = hs.SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = [o.token_ids for o in hs.Engine(target, max_batch_size=4).generate(PROMPTS, greedy)]
    draft = perturbed_copy(hs.from_hf(hf), seed=2)

    def fail(*args, **kwargs):
        raise RuntimeError("injected on rank 1")
    out = {}
    for place in ("drafter commit", "verify forward", "prefill"):
        engine = hs.Engine(target, draft=draft, num_draft_tokens=3, max_batch_size=4)
        ids = [engine.add_request(p, greedy) for p in PROMPTS]
        got = {i: [] for i in ids}
        for _ in range(2):
            for o in engine.step():
                got[o.request_id] += o.token_ids
        owner, name = (engine.speculator.drafter, "commit") if place == "drafter commit" else (target.layers[1], "forward")
        late = engine.add_request([4, 5, 6], greedy) if place == "prefill" else None
        if rank == 1:
            setattr(owner, name, fail)
        before = sequences(engine)
        raised = None
        try:
            engine.step()
        except (RuntimeError, PeerRankError) as error:
            raised = type(error).__name__
        if rank == 1:
            delattr(owner, name) if name == "forward" else setattr(owner, name, type(owner).commit.__get__(owner))
        unchanged = sequences(engine) == before
        if late is not None:
            engine.abort(late)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id in got:
                    got[o.request_id] += o.token_ids
        out[place] = dict(raised=raised, unchanged=unchanged,
                          tokens=[got[i] for i in ids] == plain)
    return out
