"""The prefix cache (`hybridspec.cache.prefix_cache`) on Bamba, Jamba and
Nemotron-H tiny float64 models: after a hit at every tail length every
layer's state equals a from-scratch prefill; greedy and coupled outputs, plain
and speculative (a model drafter with its own prefix cache), equal the outputs
with the cache off; the same prompt sent twice hits; a prefix shared up to a
position inside a page and past the last grid point hits with replay;
speculative rounds never write into cached pages or checkpoints."""
from dataclasses import replace

import pytest
import torch

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.cache.prefix_cache import PrefixStore, save_positions, plan_hit
from hybridspec.errors import ConfigError, InvalidRequestError
from hybridspec.rollback import perturbed_copy
from oracles import bamba, jamba, nemotron_h

FAMILIES = {"bamba": bamba, "jamba": jamba, "nemotron_h": nemotron_h}
ATOL = 1e-10


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def target(request):
    return hs.from_hf(FAMILIES[request.param](seed=0))


def random_tokens(n, seed, vocab=97):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def new_cache(model, block_size, max_seqs=4, num_blocks=64):
    return HybridCache(model.config, max_seqs=max_seqs, num_blocks=num_blocks, block_size=block_size, ring_slots=2,
                       dtype=model.dtype)


def layer_states(cache, seq_id, length):
    """SSM state and conv window at the head, K and V at positions < length, per layer."""
    out = {}
    if cache.states is not None:
        head = cache.head(seq_id)
        for i in range(len(cache.states.ssm_states)):
            out[f"ssm {i}"] = cache.states.ssm_states[i][head]
            out[f"conv {i}"] = cache.states.conv_states[i][head]
    if cache.kv is not None:
        table = torch.tensor(cache.kv.block_table(seq_id))
        positions = torch.arange(length)
        pages, offsets = table[positions // cache.block_size], positions % cache.block_size
        out["K"] = cache.kv.k_cache[:, pages, offsets]
        out["V"] = cache.kv.v_cache[:, pages, offsets]
    return out


def assert_matches_fresh_prefill(model, cache, seq_id, tokens, logits):
    """Every layer of `seq_id` and the first-token logits equal a from-scratch prefill of `tokens`."""
    n = len(tokens)
    assert cache.computed_len[seq_id] == n
    cache.check_invariant(seq_id, n)
    fresh = new_cache(model, cache.block_size, max_seqs=1)
    want_logits = model.prefill(fresh, [0], [tokens], last_only=True)[:, 0]
    assert (logits - want_logits).abs().max().item() <= ATOL
    want = layer_states(fresh, 0, n)
    for label, got in layer_states(cache, seq_id, n).items():
        assert (got - want[label]).abs().max().item() <= ATOL, label


# -- settings and requests --------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,name", [(dict(save_every=0), "save_every=0"),
                                         (dict(memory_budget_bytes=-1), "memory_budget_bytes=-1"),
                                         (dict(max_replay_tokens=1.5), "max_replay_tokens=1.5"),
                                         (dict(at_prompt_end="yes"), "at_prompt_end='yes'")])
def test_bad_settings_name_the_value(kwargs, name):
    with pytest.raises(ConfigError, match=name.replace("(", r"\(")):
        hs.PrefixCache(**kwargs)


def test_bad_engine_argument_and_marks_raise_before_anything_runs(target):
    with pytest.raises(ConfigError, match="prefix_cache='on'"):
        hs.Engine(target, prefix_cache="on")
    with pytest.raises(InvalidRequestError, match="save_states_at holds 0"):
        hs.SamplingParams(save_states_at=[0])
    engine = hs.Engine(target, prefix_cache=True, block_size=4)
    with pytest.raises(InvalidRequestError, match="position 9 lies past its 5"):
        engine.generate([[5, 6, 7, 8, 9]], hs.SamplingParams(max_new_tokens=2, save_states_at=(2, 9)))
    assert engine.prefix.index.nodes() == [] and engine.cache.kv.num_free_blocks == engine.cache.kv.num_blocks


def test_save_positions_and_hit_plan():
    settings = hs.PrefixCache(save_every=4)
    assert save_positions(10, 0, settings, (3,)) == [3, 4, 8, 9]
    assert save_positions(10, 4, settings, (3, 10)) == [8, 9, 10]
    assert save_positions(10, 0, hs.PrefixCache(at_prompt_end=False)) == []
    assert plan_hit(20, 16, None) == 20 and plan_hit(20, 16, 4) == 20 and plan_hit(20, 16, 3) == 16


# -- state parity after a hit -----------------------------------------------------------------

@pytest.mark.parametrize("block_size", [4, 16])
def test_state_parity_at_every_tail_length(target, block_size):
    """SavedState at C = 5 (inside a page), cached prefix C + t for t = 0 .. 2N (N = 4):
    the second prompt restores C and replays exactly t tokens over the cached K/V."""
    N, C = 4, 5
    base = random_tokens(40, seed=1)
    settings = hs.PrefixCache(save_every=None, at_prompt_end=False, at_request_end=False)
    for t in range(0, 2 * N + 1):
        cache = new_cache(target, block_size)
        store = PrefixStore(target, cache, settings)
        first = base[:C + t + 3]
        store.prefill([0], [first], [(C,)])
        second = base[:C + t] + [(base[C + t] + 1 - 3) % 94 + 3] + random_tokens(4, seed=t)
        logits = store.prefill([1], [second])
        assert (store.counts.prefix_hit_tokens, store.counts.prefix_replayed_tokens) == (C + t, t)
        assert store.counts.prefix_saved_state_hits == 1 and store.counts.prefill_computed_tokens == len(first) + len(second) - C
        assert_matches_fresh_prefill(target, cache, 1, second, logits)
        assert_matches_fresh_prefill(target, cache, 0, first, target.prefill(new_cache(target, block_size, 1), [0],
                                                                              [first], last_only=True)[:, 0])


def test_whole_prompt_cached_still_computes_the_last_token(target):
    """The same prompt again: every position's K/V is cached, the saved state at
    len - 1 is restored and the last token is run for the first-token logits."""
    cache = new_cache(target, 4)
    store = PrefixStore(target, cache, hs.PrefixCache())
    prompt = random_tokens(11, seed=2)
    store.prefill([0], [prompt])
    free_before = cache.kv.num_free_blocks
    logits = store.prefill([1], [prompt])
    assert (store.counts.prefix_hit_tokens, store.counts.prefix_replayed_tokens) == (11, 1)
    assert store.counts.prefill_computed_tokens == 11 + 1 and cache.kv.num_free_blocks == free_before
    assert cache.kv.block_table(1) == cache.kv.block_table(0)  # every page shared, none written
    assert_matches_fresh_prefill(target, cache, 1, prompt, logits)


def test_a_resumed_sequence_is_restored_whole(target):
    """Rows that want no logits (a preempted sequence absorbing its committed tokens again)
    restore the end state saved at their own cached tokens: nothing is run."""
    cache = new_cache(target, 4)
    store = PrefixStore(target, cache, hs.PrefixCache())
    prompt = random_tokens(9, seed=14)
    store.prefill([0], [prompt])
    committed = prompt + [50]  # the first token, sampled from the prefill's logits
    for token in random_tokens(4, seed=15):
        target.decode(cache, [0], [committed[-1]])
        committed.append(token)
    store.release([0], [committed])  # indexed up to computed_len = len(committed) - 1, end state saved there
    cache.free_sequences([0])
    logits = store.prefill([0, 1], [committed[:-1], prompt], None, [False, True])
    assert logits.shape == (1, target.vocab_size)
    assert store.counts.prefill_computed_tokens == 9 + 0 + 1  # the resend of the prompt runs its last token
    assert_matches_fresh_prefill(target, cache, 1, prompt, logits)
    fresh = new_cache(target, 4, max_seqs=1)
    target.prefill(fresh, [0], [committed[:-1]])
    for label, got in layer_states(cache, 0, len(committed) - 1).items():
        assert (got - layer_states(fresh, 0, len(committed) - 1)[label]).abs().max().item() <= ATOL, label


def test_the_saved_state_being_restored_is_not_evicted(target):
    """A budget of one saved state: the states a prompt's own prefill saves cannot
    evict the one it restored from (locked while in use); the next prompt can."""
    cache = new_cache(target, 4)
    store = PrefixStore(target, cache, hs.PrefixCache(memory_budget_bytes=cache.states.bytes_per_slot,
                                                      at_request_end=False))
    base = random_tokens(30, seed=16)
    store.prefill([0], [base[:10]])
    (first,) = store.index.saved_states()
    assert first.position == 9
    store.prefill([1], [base[:20]])  # restores 9; its own state saved at 19 does not fit
    assert store.index.saved_states() == [first] and store.counts.prefix_evictions == 0
    store.prefill([2], [random_tokens(8, seed=17)])  # unrelated: its state saved at 7 evicts 9
    assert [c.position for c in store.index.saved_states()] == [7] and store.counts.prefix_evictions == 1


def test_replay_budget_stops_the_hit_at_the_saved_state(target):
    cache = new_cache(target, 4)
    store = PrefixStore(target, cache, hs.PrefixCache(save_every=4, max_replay_tokens=2))
    base = random_tokens(20, seed=3)
    store.prefill([0], [base])
    second = base[:15] + [(base[15] + 1 - 3) % 94 + 3, 50]
    logits = store.prefill([1], [second])
    assert (store.counts.prefix_hit_tokens, store.counts.prefix_replayed_tokens) == (12, 0)  # tail 15 - 12 > 2
    assert_matches_fresh_prefill(target, cache, 1, second, logits)


# -- through the Engine ----------------------------------------------------------------------

def chat_and_document_prompts(seed=4, doc_len=37):
    document = random_tokens(doc_len, seed)
    questions = [document + random_tokens(k, seed + k) for k in (3, 6, 1)]
    return document, questions


def run_workload(engine, params):
    """Three chat turns (each re-sends the conversation) and three questions over one
    document, one at a time, then the questions as one batch; returns every output."""
    _, questions = chat_and_document_prompts()
    outputs, conversation = [], random_tokens(9, seed=11)
    for turn in range(3):
        out = engine.generate([conversation], params)[0].token_ids
        outputs.append(out)
        conversation = conversation + out + random_tokens(4, seed=20 + turn)
    for q in questions:
        outputs.append(engine.generate([q], params)[0].token_ids)
    outputs += [o.token_ids for o in engine.generate(questions, params)]
    return outputs


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_plain_outputs_equal_with_the_cache_on(target, mode):
    params = hs.SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.0 if mode == "greedy" else 0.8,
                               seed=7)
    want = run_workload(hs.Engine(target, block_size=4), params)
    engine = hs.Engine(target, block_size=4, prefix_cache=hs.PrefixCache(save_every=8))
    engine.check_invariants = True
    assert run_workload(engine, params) == want
    totals = engine.total_stats
    assert totals.prefix_hit_tokens > 0 and totals.prefix_replayed_tokens > 0 and totals.prefix_saved_state_hits > 0


@pytest.mark.parametrize("verify", ["greedy", "coupled"])
def test_speculative_outputs_equal_with_the_cache_on(target, verify):
    params = hs.SamplingParams(max_new_tokens=7, ignore_eos=True, temperature=0.0 if verify == "greedy" else 0.8,
                               seed=3)
    want = run_workload(hs.Engine(target, block_size=4), params)
    draft = perturbed_copy(target, scale=0.03, seed=1)
    engine = hs.Engine(target, draft=draft, num_draft_tokens=3, block_size=4,
                       verify="coupled" if verify == "coupled" else "rejection",
                       prefix_cache=hs.PrefixCache(save_every=8))
    engine.check_invariants = engine.speculator.check = True
    assert run_workload(engine, params) == want
    assert engine.total_stats.prefix_hit_tokens > 0
    drafter = engine.speculator.drafter
    assert drafter.prefix.counts.prefix_hit_tokens > 0 and drafter.prefix.counts.prefix_saved_state_hits > 0


def test_same_prompt_twice_hits_on_the_second_send(target):
    engine = hs.Engine(target, block_size=16, prefix_cache=True)
    prompt, params = random_tokens(21, seed=5), hs.SamplingParams(max_new_tokens=4, ignore_eos=True)
    first = engine.generate([prompt], params)[0].token_ids
    assert engine.stats.prefix_hit_tokens == 0 and engine.stats.prefill_computed_tokens == 21
    assert engine.generate([prompt], params)[0].token_ids == first
    assert engine.stats.prefix_hit_tokens == 21 and engine.stats.prefix_saved_state_hits == 1
    assert engine.stats.prefill_computed_tokens == 1  # the last prompt token, for the first-token logits
    outs = engine.generate([prompt, prompt], params)  # within one batch too
    assert [o.token_ids for o in outs] == [first, first] and engine.stats.prefix_saved_state_hits == 2


def test_prefix_inside_a_page_past_the_last_grid_point_hits_with_replay(target):
    """Grid every 8 tokens, pages of 16: the prompts share 21 tokens (inside page 2,
    past grid point 16). A grid-only cache (vLLM's) would give 16, with no replay."""
    base = random_tokens(40, seed=6)
    a, b = base[:30], base[:21] + [(base[21] + 1 - 3) % 94 + 3] + random_tokens(6, seed=7)
    params = hs.SamplingParams(max_new_tokens=5, ignore_eos=True)
    want = [o.token_ids for o in hs.Engine(target, block_size=16).generate([a, b], params)]
    engine = hs.Engine(target, block_size=16, prefix_cache=hs.PrefixCache(save_every=8, at_prompt_end=False,
                                                                           at_request_end=False))
    assert engine.generate([a], params)[0].token_ids == want[0]
    assert engine.generate([b], params)[0].token_ids == want[1]
    stats = engine.stats
    assert (stats.prefix_hit_tokens, stats.prefix_replayed_tokens, stats.prefix_saved_state_hits) == (21, 5, 1)
    grid = hs.Engine(target, block_size=16, prefix_cache=hs.PrefixCache(
        save_every=8, at_prompt_end=False, at_request_end=False, at_hit=False, max_replay_tokens=0))
    grid.generate([a], params)
    assert grid.generate([b], params)[0].token_ids == want[1]
    assert (grid.stats.prefix_hit_tokens, grid.stats.prefix_replayed_tokens) == (16, 0)


def test_speculative_rounds_never_write_cached_pages_or_saved_states(target):
    draft = perturbed_copy(target, scale=0.05, seed=2)
    engine = hs.Engine(target, draft=draft, num_draft_tokens=4, block_size=4,
                       prefix_cache=hs.PrefixCache(save_every=4))
    document, questions = chat_and_document_prompts()
    params = hs.SamplingParams(max_new_tokens=9, ignore_eos=True)
    engine.generate([document], params)
    stores = [engine.prefix, engine.speculator.drafter.prefix]

    def contents(store):
        kv = store.cache.kv
        pages = {n.page: (kv.k_cache[:, n.page, :len(n.tokens)].clone(), kv.v_cache[:, n.page, :len(n.tokens)].clone())
                 for n in store.index.nodes()}
        states = {id(c): [t.clone() for t in (*c.state.ssm, *c.state.conv)] for c in store.index.saved_states()}
        return pages, states

    before = [contents(s) for s in stores]
    engine.generate(questions, params)
    assert engine.stats.prefix_hit_tokens >= 3 * len(document)
    for store, (pages, states) in zip(stores, before):
        now_pages, now_states = contents(store)
        for page, (k, v) in pages.items():
            assert torch.equal(now_pages[page][0], k) and torch.equal(now_pages[page][1], v)
        for key, tensors in states.items():
            assert all(torch.equal(a, b) for a, b in zip(now_states[key], tensors))


def test_finished_requests_leave_only_cached_pages(target):
    """After generate, every page in use is one the index holds (one holder each);
    clearing the cache frees the whole pool."""
    draft = perturbed_copy(target, scale=0.03, seed=1)
    engine = hs.Engine(target, draft=draft, num_draft_tokens=2, block_size=4, prefix_cache=True)
    _, questions = chat_and_document_prompts()
    engine.generate(questions, hs.SamplingParams(max_new_tokens=5, ignore_eos=True))
    for store in (engine.prefix, engine.speculator.drafter.prefix):
        pool = store.cache.kv.pool
        assert sorted(store.cached_pages()) == sorted(set(range(pool.num_blocks)) - set(pool.snapshot().free_blocks))
        assert all(pool.ref_count(p) == 1 for p in store.cached_pages())
        assert all(n.lock_count == 0 for n in store.index.nodes())
        store.clear()
        assert pool.num_free == pool.num_blocks and store.saved_state_bytes == 0


def test_a_tiny_budget_evicts_saved_states_and_outputs_stay_equal(target):
    params = hs.SamplingParams(max_new_tokens=5, ignore_eos=True)
    want = run_workload(hs.Engine(target, block_size=4), params)
    slot_bytes = HybridCache(target.config, max_seqs=1, num_blocks=1, block_size=4, dtype=target.dtype).states \
        .bytes_per_slot
    engine = hs.Engine(target, block_size=4, num_blocks=40,
                       prefix_cache=hs.PrefixCache(memory_budget_bytes=2 * slot_bytes, save_every=4))
    assert run_workload(engine, params) == want
    assert engine.total_stats.prefix_evictions > 0 and engine.prefix.saved_state_bytes <= 2 * slot_bytes
    assert engine.prefix.num_saved_states() <= 2


def test_branch_point_saved_state_serves_the_next_question(target):
    """Questions over one document: the second replays the document from 0 and leaves a
    state where it branches off; the third restores it with no replay."""
    document, questions = chat_and_document_prompts(doc_len=30)
    params = hs.SamplingParams(max_new_tokens=3, ignore_eos=True)
    want = [o.token_ids for o in hs.Engine(target, block_size=4).generate(questions, params)]
    engine = hs.Engine(target, block_size=4, prefix_cache=True)
    got, seen = [], []
    for q in questions:
        got.append(engine.generate([q], params)[0].token_ids)
        seen.append((engine.stats.prefix_hit_tokens, engine.stats.prefix_replayed_tokens,
                     engine.stats.prefill_computed_tokens))
    assert got == want
    assert seen[1] == (30, 30, len(questions[1])) and seen[2] == (30, 0, len(questions[2]) - 30)


def test_marked_saved_state_serves_a_shared_system_prompt(target):
    system = random_tokens(13, seed=8)
    prompts = [system + random_tokens(5, seed=9), system + random_tokens(3, seed=10)]
    params = [hs.SamplingParams(max_new_tokens=3, ignore_eos=True, save_states_at=(13,))] * 2
    want = [o.token_ids for o in hs.Engine(target, block_size=4).generate(prompts, params)]
    engine = hs.Engine(target, block_size=4, prefix_cache=hs.PrefixCache(at_prompt_end=False, at_request_end=False))
    assert [engine.generate([p], q)[0].token_ids for p, q in zip(prompts, params)] == want
    assert (engine.stats.prefix_hit_tokens, engine.stats.prefix_replayed_tokens) == (13, 0)
    assert engine.stats.prefill_computed_tokens == 3


def test_pure_attention_model():
    """Without recurrent layers every position can be restored: a resend computes only its last token."""
    attention = hs.from_hf(bamba(seed=4, attn_layers=(0, 1), num_layers=2))
    assert not attention.config.mamba_layers
    prompt, params = random_tokens(10, seed=13), hs.SamplingParams(max_new_tokens=4, ignore_eos=True)
    want = hs.Engine(attention, block_size=4).generate([prompt], params)[0].token_ids
    engine = hs.Engine(attention, block_size=4, prefix_cache=True)
    assert [engine.generate([prompt], params)[0].token_ids for _ in range(2)] == [want, want]
    assert (engine.stats.prefix_hit_tokens, engine.stats.prefill_computed_tokens) == (10, 1)


def test_pure_mamba_and_sampled_n():
    """A model without attention layers (saved states only, no pages) and n > 1 samples."""
    mamba = hs.from_hf(bamba(seed=3, attn_layers=(), num_layers=2))
    prompt = random_tokens(12, seed=12)
    params = hs.SamplingParams(max_new_tokens=4, temperature=0.9, seed=5, n=2)
    want = [o.token_ids for o in hs.Engine(mamba).generate([prompt], params)]
    engine = hs.Engine(mamba, prefix_cache=True)
    assert [o.token_ids for o in engine.generate([prompt], params)] == want
    assert engine.stats.prefix_saved_state_hits == 1 and engine.stats.prefill_computed_tokens == 12 + 1
    assert [o.token_ids for o in engine.generate([prompt], replace(params, n=1))] == want[:1]


def test_llm_text_resent_hits():
    """`hs.LLM(prefix_cache=True)` on the embedded pair: the same text twice, the second from the cache."""
    llm = hs.LLM(prefix_cache=True)
    params = hs.SamplingParams(max_new_tokens=6)
    text = "def read_config(path):\n    with open(path) as f:\n"
    first = llm.generate([text], params)[0].text
    assert llm.generate([text], params)[0].text == first
    assert llm.stats.prefix_hit_tokens == len(text.encode()) and llm.stats.prefill_computed_tokens == 1
