"""Suffix decoding (`hs.SuffixDrafter`, `spec.suffix_trie`): the trie's counts
are the text's n-gram counts however they were built (appended token by
token, added whole, or left after other streams were removed), a proposal is
what a brute-force count over the context gives, the global trie stays
within its bound, and the Engine keeps its guarantees with it: greedy and
coupled output equal plain decoding's (embedded pair and a tiny random Jamba,
batches, rounds that draft nothing, preemption, the prefix cache on), and the
per-sequence trie holds exactly the committed tokens at every round."""
import json
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import hybridspec as hs
from hybridspec.errors import ConfigError
from hybridspec.spec.suffix_trie import Frontier, SuffixTrie
from hybridspec.spec.speculator import RoundHook  # its other calls do nothing
from oracles import jamba


# -- the trie ------------------------------------------------------------------------------------

def brute_counts(texts, depth):
    counts = Counter()
    for text in texts:
        for start in range(len(text)):
            for n in range(1, depth + 1):
                if start + n <= len(text):
                    counts[tuple(text[start:start + n])] += 1
    return dict(counts)


def best_children(trie):
    """n-gram -> its most frequent continuation token, for every node that has one."""
    out, stack = {}, [(0, ())]
    while stack:
        node, gram = stack.pop()
        if trie.best[node] >= 0:
            out[gram] = trie.token[trie.best[node]]
        child = trie.first[node]
        while child >= 0:
            stack.append((child, gram + (trie.token[child],)))
            child = trie.sibling[child]
    return out


def random_text(rng, length, vocab):
    return [rng.randrange(vocab) for _ in range(length)]


@pytest.mark.parametrize("depth", [1, 3, 6])
def test_counts_are_the_texts_ngram_counts_however_built(depth):
    rng = random.Random(depth)
    text = random_text(rng, 200, 5)
    streamed, frontier = SuffixTrie(depth), Frontier()
    for token in text:  # the per-round path: one token at a time
        streamed.append(frontier, token)
    whole = SuffixTrie(depth)
    whole.add(text)
    assert streamed.ngram_counts() == whole.ngram_counts() == brute_counts([text], depth)
    assert best_children(streamed) == best_children(whole)
    assert frontier.length == len(text)
    assert frontier.nodes == [whole.find(text[len(text) - k:]) for k in range(min(depth, len(text)))]


def test_removing_streams_leaves_what_the_others_alone_build():
    rng = random.Random(1)
    texts = [random_text(rng, rng.randint(1, 60), 4) for _ in range(8)]
    trie = SuffixTrie(5)
    for text in texts:
        trie.add(text)
    for gone in (0, 3, 5, 1):  # oldest first, then out of order
        trie.remove(texts[gone])
    kept = [t for i, t in enumerate(texts) if i not in (0, 3, 5, 1)]
    fresh = SuffixTrie(5)
    for text in kept:
        fresh.add(text)
    assert trie.ngram_counts() == fresh.ngram_counts() == brute_counts(kept, 5)
    assert best_children(trie) == best_children(fresh)  # best child: by count, then token, never by history
    assert trie.num_nodes == fresh.num_nodes
    for text in kept:
        trie.remove(text)
    assert trie.num_nodes == 1 and trie.edges == {} and trie.total[0] == 0


def brute_draft(context, depth, gamma, min_prob):
    """The drafter's rule from counts over the context alone: for each suffix
    (1..depth-1 tokens) seen before, follow the most frequent next token (ties:
    the smaller id) while the running product of count/total stays >= min_prob,
    within `depth` tokens of match plus draft; keep the best sum of the running
    products, ties to the longer match."""
    counts = brute_counts([context], depth)

    def nexts(gram):
        return {t: counts.get(gram + (t,), 0) for t in set(context)} if len(gram) < depth else {}

    best_tokens, best_score = [], 0.0
    for k in range(min(depth - 1, len(context)), 0, -1):
        gram, tokens, prob, score = tuple(context[-k:]), [], 1.0, 0.0
        while len(tokens) < gamma:
            options = {t: c for t, c in nexts(gram).items() if c}
            if not options:
                break
            token = min(options, key=lambda t: (-options[t], t))
            prob *= options[token] / sum(options.values())
            if prob < min_prob:
                break
            tokens.append(token)
            score += prob
            gram += (token,)
        if tokens and score > best_score:
            best_tokens, best_score = tokens, score
    return best_tokens


def fake_request(seq_id, prompt, output=(), finish_reason=None):
    """What the drafter reads of an engine Request."""
    out = SimpleNamespace(prompt_token_ids=list(prompt), token_ids=list(output), finish_reason=finish_reason)
    return SimpleNamespace(seq_id=seq_id, output=out, finished=finish_reason is not None)


def propose(drafter, requests, gamma):
    return drafter.propose(requests, [gamma] * len(requests), None, [False] * len(requests)).tokens


@pytest.mark.parametrize("depth,min_prob", [(4, 0.1), (8, 0.3), (12, 0.0)])
def test_proposals_are_what_brute_force_counts_give(depth, min_prob):
    rng = random.Random(depth)
    drafter = hs.SuffixDrafter(max_depth=depth, min_prob=min_prob, global_tokens=0)
    for trial in range(30):
        motif = random_text(rng, rng.randint(2, 6), 6)
        prompt = (motif * 10)[:rng.randint(3, 30)] + random_text(rng, rng.randint(0, 4), 6)
        r = fake_request(trial, prompt)
        drafter.start([r])
        for _ in range(8):  # rounds: commit a few tokens, propose again
            gamma = rng.randint(1, 6)
            assert propose(drafter, [r], gamma) == [brute_draft(r.output.prompt_token_ids + r.output.token_ids,
                                                                depth, gamma, min_prob)]
            r.output.token_ids += random_text(rng, rng.randint(1, 3), 6)
        drafter.release([trial])


def test_known_strings():
    drafter = hs.SuffixDrafter(max_depth=12, min_prob=0.5, global_tokens=0)
    text = [ord(c) for c in "the cat sat. the cat sat. the cat"]
    assert propose(drafter, [fake_request(0, text)], 5) == [[ord(c) for c in " sat."]]
    assert propose(drafter, [fake_request(1, text)], 2) == [[ord(" "), ord("s")]]  # γ caps the draft
    # "ab" is followed by c, d, e once each: 1/3 < min_prob, so nothing is drafted
    assert propose(drafter, [fake_request(2, [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2])], 4) == [[]]
    assert propose(drafter, [fake_request(3, [7, 8, 9])], 4) == [[]]  # no repeat, no match
    loose = hs.SuffixDrafter(max_depth=6, min_prob=0.3, global_tokens=0)
    # at 0.3, 1/3 passes: the smallest of the tied continuations, then what followed it, 1/3 all the way
    assert propose(loose, [fake_request(2, [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2])], 4) == [[3, 1, 2, 4]]


def test_the_trie_follows_the_committed_tokens_only():
    """Tokens committed between rounds are appended; a draft is never put in;
    a sequence started again (preemption) is rebuilt from its tokens."""
    drafter = hs.SuffixDrafter(max_depth=5, global_tokens=0)
    r = fake_request(7, [1, 2, 3, 1, 2])
    drafter.start([r])
    for output in ([3], [3, 1, 2, 3], [3, 1, 2, 3, 9]):
        r.output.token_ids = list(output)
        drafts = propose(drafter, [r], 3)
        committed = r.output.prompt_token_ids + output
        assert drafter.sequences[7].trie.ngram_counts() == brute_counts([committed], 5), drafts
        drafter.check_invariant(7, len(committed) - 1)
    drafter.release([7])  # preempted: not finished, forgotten, not remembered
    assert 7 not in drafter.sequences and drafter.shared_tokens == 0
    drafter.start([r])
    assert drafter.sequences[7].trie.ngram_counts() == brute_counts([r.output.prompt_token_ids + r.output.token_ids], 5)


def test_the_global_trie_keeps_the_newest_outputs_within_its_bound():
    rng = random.Random(4)
    drafter = hs.SuffixDrafter(max_depth=4, global_tokens=50)
    outputs = []
    for i in range(12):
        output = random_text(rng, rng.randint(5, 20), 5)
        outputs.append(output)
        drafter.start([fake_request(i, [1])])
        drafter.release([i])  # still running when released: preempted, not remembered
        drafter.start([fake_request(i, [1], output, finish_reason="length")])
        drafter.release([i])
        assert drafter.shared_tokens <= 50
        kept = list(drafter.contributions)
        assert kept == outputs[len(outputs) - len(kept):]  # the newest, in order
        assert drafter.shared.ngram_counts() == brute_counts(kept, 4)
    assert sum(map(len, outputs)) > 50 and drafter.shared_tokens > 30


def test_earlier_outputs_are_drafted_from():
    drafter = hs.SuffixDrafter(max_depth=8, min_prob=0.5)
    drafter.start([fake_request(0, [9], [1, 2, 3, 4, 5, 6], finish_reason="stop")])
    drafter.release([0])
    assert propose(drafter, [fake_request(1, [7, 7, 2, 3])], 3) == [[4, 5, 6]]
    own = propose(drafter, [fake_request(2, [2, 3, 8, 2, 3])], 3)  # its own text says 8 after "2 3", longer match
    assert own == [[8, 2, 3]]


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_depth=1), r"max_depth=1 must be an int in 2\.\.64"),
    (dict(max_depth=3.0), r"max_depth=3\.0 must be an int"),
    (dict(min_prob=1.5), r"min_prob=1\.5 must be a number in \[0, 1\]"),
    (dict(min_prob="high"), r"min_prob='high'"),
    (dict(global_tokens=-1), r"global_tokens=-1 must be an int >= 0"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        hs.SuffixDrafter(**kwargs)


# -- in the Engine -------------------------------------------------------------------------------

class TrieWatch(RoundHook):
    """A RoundHook: when a round's drafts are in, every row's trie counts
    exactly its committed tokens' n-grams, and no draft was put in."""

    def __init__(self, drafter):
        self.drafter, self.rounds, self.empty_rows = drafter, 0, 0

    def round_ended(self, round, error):
        assert error is None
        self.rounds += 1
        self.empty_rows += sum(not d for d in round.drafts)
        for r in round.requests:  # the round's own tokens are not applied yet: the next propose takes them
            committed = r.output.prompt_token_ids + r.output.token_ids
            seq = self.drafter.sequences[r.seq_id]
            assert seq.frontier.length == len(committed)
            assert seq.trie.ngram_counts() == brute_counts([committed], self.drafter.max_depth)


@pytest.fixture(scope="module")
def embedded():
    target_dir, _ = hs.embedded_paths()
    return hs.load(target_dir, dtype=torch.float64)


@pytest.fixture(scope="module")
def tiny_jamba():
    return hs.from_hf(jamba(seed=0))


def repetitive_prompts(vocab, seed, count=5):
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        motif = random_text(rng, rng.randint(2, 5), vocab)
        prompts.append(motif * rng.randint(1, 4) + random_text(rng, rng.randint(1, 6), vocab))
    return prompts


def run(target, prompts, params, draft=None, watch=False, **kwargs):
    engine = hs.Engine(target, draft=draft, **kwargs)
    watcher = None
    if draft is not None:
        engine.check_invariants = engine.speculator.check = True
        if watch:
            watcher = TrieWatch(engine.speculator.drafter)
            engine.speculator.hooks.append(watcher)
    outs = [o.token_ids for o in engine.generate(prompts, params)]
    return outs, engine, watcher


@pytest.mark.parametrize("model", ["embedded", "tiny_jamba"])
@pytest.mark.parametrize("verify", ["greedy", "coupled"])
def test_speculative_output_is_plain_output(model, verify, request):
    """Batches of 5 at concurrency 3 (continuous batching), γ = 4, prefix cache
    on, early rounds that find no match, a second generate drafting from the
    first's outputs (the global trie): greedy and coupled-sampled tokens equal
    plain decoding's."""
    target = request.getfixturevalue(model)
    if verify == "greedy":
        params = [hs.SamplingParams(max_new_tokens=24, ignore_eos=True)] * 5
    else:
        params = [hs.SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8 + 0.1 * (i % 3), seed=i,
                                    top_k=0 if i % 2 else 20) for i in range(5)]
    kwargs = dict(max_batch_size=3, block_size=4, prefix_cache=True)
    drafter = hs.SuffixDrafter()
    spec = hs.Engine(target, draft=drafter, num_draft_tokens=4, verify="coupled" if verify == "coupled" else "rejection",
                     **kwargs)
    spec.check_invariants = spec.speculator.check = True
    watcher = TrieWatch(drafter)
    spec.speculator.hooks.append(watcher)
    plain = hs.Engine(target, **kwargs)
    for seed in (1, 2):
        prompts = repetitive_prompts(target.vocab_size, seed)
        assert [o.token_ids for o in spec.generate(prompts, params)] == \
               [o.token_ids for o in plain.generate(prompts, params)]
    assert spec.total_stats.drafted_tokens > 0 and spec.total_stats.accepted_tokens > 0
    assert watcher.empty_rows > 0 and watcher.rounds > 0
    assert drafter.sequences == {} and drafter.shared_tokens == 10 * 24  # every output remembered


@pytest.mark.parametrize("verify", ["rejection", "coupled"])
def test_preemption_changes_no_token(tiny_jamba, verify):
    """A pool that holds the prompts but not their growth: the newest requests
    are preempted, forgotten by the drafter and rebuilt when they resume."""
    target = tiny_jamba
    prompts = repetitive_prompts(target.vocab_size, 3, count=4)
    params = [hs.SamplingParams(max_new_tokens=14, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=i)
              for i in range(4)]
    pages = -(-max(len(p) + 14 for p in prompts) // 4) + 2
    kwargs = dict(max_batch_size=4, block_size=4, num_blocks=pages)
    # rejection-sampled rows repeat only under the same drafts: each sequence's own tokens then, no global trie
    drafter = hs.SuffixDrafter(global_tokens=0 if verify == "rejection" else 16384)
    outs, engine, watcher = run(target, prompts, params, draft=drafter, watch=True, num_draft_tokens=3,
                                verify=verify, **kwargs)
    assert engine.stats.preemptions > 0 and engine.stats.drafted_tokens > 0
    if verify == "coupled":  # coupled output is plain output, greedy or sampled
        alone = [hs.Engine(target, block_size=4).generate([p], [q])[0].token_ids for p, q in zip(prompts, params)]
    else:  # rejection: greedy rows are plain output; sampled rows are the spec engine's without preemption
        alone = [hs.Engine(target, draft=hs.SuffixDrafter(global_tokens=0), num_draft_tokens=3, block_size=4)
                 .generate([p], [q])[0].token_ids for p, q in zip(prompts, params)]
        greedy = [o for o, q in zip(outs, params) if q.temperature == 0.0]
        assert greedy == [hs.Engine(target, block_size=4).generate([p], [q])[0].token_ids
                          for p, q in zip(prompts, params) if q.temperature == 0.0]
        alone = [a if q.temperature else o for a, o, q in zip(alone, outs, params)]
    assert outs == alone
    assert engine.speculator.drafter.sequences == {}


def test_the_engine_llm_and_cli_take_the_name(capsys):
    assert isinstance(hs.Engine(hs.from_hf(jamba(seed=1)), draft="suffix").speculator.drafter, hs.SuffixDrafter)
    llm = hs.LLM(draft="suffix", num_draft_tokens=4)
    assert isinstance(llm.engine.speculator.drafter, hs.SuffixDrafter)
    from hybridspec.cli.main import build_parser, main
    assert build_parser().parse_args(["serve", "--draft", "suffix"]).draft == "suffix"
    assert main(["generate", "abcabcabcabc", "--draft", "suffix", "-n", "12", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["draft"] == "suffix (suffix decoding)" and report["same_as_plain"]
    # the rollback suite with it: parity under every policy, faults injected at every phase of a round
    assert main(["check", "--draft", "suffix", "--quick"]) == 0
    assert "checks passed" in capsys.readouterr().out

