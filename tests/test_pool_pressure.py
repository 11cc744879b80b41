"""A full KV pool ends in admission waiting or preemption, never in
`CacheFullError` from inside a forward: the scheduler reserves what every
round writes (`hybridspec.engine.scheduler.round_positions`), in a model
drafter's cache too, where no row steps past its own γ. Random request streams over
random tiny pools (plain, fixed γ and "auto" engines, model and n-gram
drafters, prefix cache on and off, aborts, late arrivals) give every request
the tokens it has alone and leave every page and ring free."""
import random

import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

import hybridspec as hs
from hybridspec.rollback import perturbed_copy
from hybridspec.engine.scheduler import round_positions
from oracles import bamba


@pytest.fixture(scope="module")
def models():
    target = hs.from_hf(bamba(seed=0, attn_layers=(1,), num_layers=4, hidden=64))
    return target, perturbed_copy(target, seed=2)


_alone: dict = {}


def alone(target, prompt: list[int], params: hs.SamplingParams) -> list[list[int]]:
    """The tokens of each sample of `prompt` run by itself on a roomy plain engine."""
    key = (tuple(prompt), params)
    if key not in _alone:
        engine = hs.Engine(target, max_batch_size=params.n, block_size=4)
        _alone[key] = [o.token_ids for o in engine.generate([prompt], params)]
    return _alone[key]


def check_writes_against_the_rule(engine) -> None:
    """Make every K/V write of the engine's caches (prefill, drafter catch-up and
    drafts, verify, replay, prefix restores) fail unless it stays within the
    positions `round_positions` reserved for its sequence in that step."""
    scheduler, bounds = engine.scheduler, [{} for _ in engine.scheduler.caches]

    def reserve_bounds(tokens_per_round, admitted=()):
        admitted = {id(r) for r in admitted}
        for bound in bounds:
            bound.clear()
            bound.update((r.seq_id, round_positions(r.committed_len + (id(r) in admitted), tokens_per_round(r)))
                         for r in scheduler.running)

    def wrapped(method, after):
        def call(tokens_per_round):
            out = method(tokens_per_round)
            after(tokens_per_round, out if method.__name__ == "admit" else ())
            return out
        return call

    scheduler.admit = wrapped(scheduler.admit, reserve_bounds)
    scheduler.reserve = wrapped(scheduler.reserve, reserve_bounds)
    for cache, bound in zip(scheduler.caches, bounds):
        if cache.kv is None:
            continue

        def prepare_write(seq_ids, num_new, starts=None, kv=cache.kv, write=cache.kv.prepare_write, bound=bound):
            begins = [kv.kv_len(s) for s in seq_ids] if starts is None else starts
            for s, start, n in zip(seq_ids, begins, num_new):
                assert max(kv.kv_len(s), start + n) <= bound[s], (s, start + n, bound[s])
            return write(seq_ids, num_new, starts)

        cache.kv.prepare_write = prepare_write


def test_a_row_near_its_end_drafts_no_further_than_its_gamma(models):
    """The case traced in issue 35: three requests near their ends in a pool of 9
    pages. A drafter that stepped every drafting row max(γ_b) - 1 times, past the
    γ_b of a row with little left, wrote K/V the scheduler had not reserved and a
    forward raised CacheFullError (7 free pages reserved, 8 needed); now no
    drafter write leaves the rule's positions."""
    target, draft = models
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 97) for _ in range(n)] for n in (13, 9, 16)]
    params = [hs.SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (4, 2, 10)]
    engine = hs.Engine(target, draft=draft, num_draft_tokens=3, max_batch_size=3, block_size=4, num_blocks=9)
    check_writes_against_the_rule(engine)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [alone(target, p, q)[0] for p, q in zip(prompts, params)]
    assert engine.memory().is_idle()


@pytest.mark.parametrize("seed", [111, 260, 486])
def test_streams_whose_drafting_rows_near_their_ends_meet_a_full_pool(models, seed):
    """Streams drawn like the property test's below in which a model drafter's
    rows near their ends have fewer drafts to make than the batch's largest γ,
    in an exactly full pool (where a drafter stepping past a row's γ ran out of
    pages, about one random stream in seventy)."""
    target, draft = models
    rng = random.Random(seed)
    requests = [(rng.randint(1, 14), rng.randint(1, 9)) for _ in range(rng.randint(2, 8))]
    block_size, longest = rng.choice([2, 4, 8]), max(a + b for a, b in requests)
    gamma, max_batch_size, spare = rng.randint(1, 4), rng.randint(1, 5), rng.randint(0, 2)
    engine = hs.Engine(target, draft=draft, num_draft_tokens=gamma, max_batch_size=max_batch_size,
                       block_size=block_size, num_blocks=-(-longest // block_size) + spare)
    check_writes_against_the_rule(engine)
    prompts = [[rng.randrange(3, 97) for _ in range(a)] for a, _ in requests]
    params = [hs.SamplingParams(max_new_tokens=b, ignore_eos=True) for _, b in requests]
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [alone(target, p, q)[0] for p, q in zip(prompts, params)]
    assert engine.memory().is_idle()


requests_st = st.lists(st.tuples(st.integers(1, 14), st.integers(1, 9), st.integers(1, 2),
                                 st.integers(0, 3), st.one_of(st.none(), st.integers(1, 4))), min_size=2, max_size=8)


@settings(max_examples=25, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(requests=requests_st, block_size=st.sampled_from([2, 4, 8]), spare_pages=st.integers(0, 2),
       max_batch_size=st.integers(1, 5), mode=st.sampled_from(["plain", "fixed", "auto"]),
       gamma=st.integers(1, 4), ngram=st.booleans(), prefix_cache=st.booleans(), sampled=st.booleans(),
       seed=st.integers(0, 99))
def test_random_streams_over_tiny_pools_never_raise_and_leave_nothing(models, requests, block_size, spare_pages,
                                                                      max_batch_size, mode, gamma, ngram,
                                                                      prefix_cache, sampled, seed):
    """requests: (prompt length, max_new_tokens, n, arrival step, abort step or None).
    Greedy requests (n = 1) under rejection sampling, or seeded sampled ones
    (n samples) under coupled verification: either way the tokens of plain
    decoding alone, whatever γ each round takes."""
    target, draft = models
    rng = random.Random(seed)
    shared = [rng.randrange(3, 97) for _ in range(8)]  # a common prefix for the prefix cache to find
    prompts = [(shared + [rng.randrange(3, 97) for _ in range(length)])[-length:] for length, *_ in requests]
    longest = max(len(p) + r[1] for p, r in zip(prompts, requests))
    spec = {} if mode == "plain" else dict(draft=hs.NgramDrafter() if ngram else draft,
                                           num_draft_tokens="auto" if mode == "auto" else gamma,
                                           verify="coupled" if sampled else "rejection")
    if mode == "auto":
        spec["max_draft_tokens"] = gamma
    engine = hs.Engine(target, max_batch_size=max_batch_size, block_size=block_size,
                       num_blocks=-(-longest // block_size) + spare_pages, prefix_cache=prefix_cache or None, **spec)
    check_writes_against_the_rule(engine)
    params = [hs.SamplingParams(max_new_tokens=r[1], ignore_eos=True, n=r[2], temperature=0.8, seed=seed + k)
              if sampled else hs.SamplingParams(max_new_tokens=r[1], ignore_eos=True) for k, r in enumerate(requests)]
    ids, got, reasons, step = {}, {}, {}, 0
    while step == 0 or engine.has_unfinished_requests() or len(ids) < len(requests):
        for k, r in enumerate(requests):
            if r[3] == step:
                ids[k] = engine.add_request(prompts[k], params[k])
        for out in engine.step():  # no exception escapes
            got.setdefault((out.request_id, out.sample_index), []).extend(out.token_ids)
            if out.finished:
                assert (out.request_id, out.sample_index) not in reasons  # one final report
                reasons[out.request_id, out.sample_index] = out.finish_reason
        step += 1
        for k, r in enumerate(requests):
            if r[4] is not None and k in ids and r[3] + r[4] == step:
                engine.abort(ids[k])
    for k, r in enumerate(requests):
        for sample, want in enumerate(alone(target, prompts[k], params[k])):
            tokens, reason = got.get((ids[k], sample), []), reasons[ids[k], sample]
            if reason == "abort":
                assert r[4] is not None and tokens == want[:len(tokens)]
            else:
                assert tokens == want and reason == "length"
    memory = engine.memory()
    assert memory.is_idle() and not engine.has_unfinished_requests()
    assert memory.target.rings_free == memory.target.rings_total
