"""The proof matrix of tree drafts (`spec.tree`) beyond the model drafter's:
greedy and coupled tree output equals plain output for every drafter that
branches (a draft model, suffix decoding, prompt lookup, the MTP layer, an
EAGLE-3 head) on
Mamba-2, Mamba-1 (Jamba's kind) and gated-DeltaNet hybrids under two
checkpoint policies with the invariant checks on; the hidden states an MTP
drafter reads after tree rounds are the accepted tokens' own; a row's tokens
do not depend on its neighbours' trees; and unseeded sampled output
(multi-draft rejection over the tree) follows the target's distribution,
computed exactly, by a chi-square test. Also the model-free drafters' trees
and the suite's tree mode (`hybridspec check --tree`)."""
from itertools import product

import pytest
import torch

import hybridspec as hs
from hybridspec.adapters.eagle3 import load_eagle3
from hybridspec.cache.hidden_states import HiddenStates
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.checkpoints.policy import CheckpointPolicy
from hybridspec.engine.engine import Engine
from hybridspec.rollback.models import branching_prompts, perturbed_copy, plain_outputs, random_mtp, tiny_model
from hybridspec.spec.drafters import NgramDrafter
from hybridspec.spec.eagle3_drafter import Eagle3Drafter
from hybridspec.spec.mtp_drafter import MTPDrafter
from hybridspec.spec.suffix_drafter import SuffixDrafter
from hybridspec.spec.suffix_trie import SuffixTrie
from hybridspec.spec.tree import TreeShape, fitted_tree, input_parents, spine_inputs, tree_parents
from test_eagle3_drafter import random_head, save

FAMILIES = {"mamba2": ("mamba2", "attention", "mamba2"), "mamba1": ("mamba1", "attention", "mamba1"),
            "gdn": ("gdn", "attention", "gdn")}
POLICIES = (CheckpointPolicy(snapshot_every=1), CheckpointPolicy(snapshot_every=0, ring_slots=2, log_inputs=False))
VOCAB = 16  # small: n-grams recur with several continuations, so the model-free drafters branch
MTP_CACHE = dict(max_seqs=8, block_size=4, num_blocks=96)


def drafters(target, directory) -> dict:
    """name -> a fresh drafter (or draft model) that branches, for one engine; an EAGLE-3
    head (random, a draft vocabulary of 10) is written to `directory` and read back."""
    head = save(directory / "eagle3", *random_head(target, draft_vocab=10, points=(0, 1, 3)))
    return {"model": lambda: perturbed_copy(target, 0.3, 1), "suffix": lambda: SuffixDrafter(min_prob=0.0),
            "ngram": NgramDrafter, "mtp": lambda: MTPDrafter(random_mtp(target, 3), MTP_CACHE),
            "eagle3": lambda: Eagle3Drafter(load_eagle3(target, head), MTP_CACHE)}


class TreeRounds:
    """A RoundHook counting tree rounds and the rows whose accepted path left the spine."""

    def __init__(self):
        self.trees = self.off_spine = 0

    def round_started(self, round): pass

    def phase_started(self, phase): pass

    def round_ended(self, round, error): pass

    def committed(self, round):
        if round.parents is None:
            return
        self.trees += 1
        for b in range(len(round.seq_ids)):
            spine = spine_inputs(input_parents(round.parents[b]))
            self.off_spine += round.paths[b] != spine[:len(round.paths[b])]


def watched(engine: Engine) -> TreeRounds:
    engine.speculator.check = True  # the boundary invariant, target and drafter, after every commit
    hook = TreeRounds()
    engine.speculator.hooks.append(hook)
    return hook


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_branching_drafter_gives_plain_output(family, tmp_path):
    """Greedy rows and seeded sampled rows (verified coupled) in one batch, per drafter and
    policy: tokens equal plain decoding's, invariants hold, trees were verified."""
    target = tiny_model(0, FAMILIES[family], vocab_size=VOCAB)
    params = [hs.SamplingParams(max_new_tokens=n, temperature=t, seed=s, ignore_eos=True)
              for n, t, s in ((14, 0.0, None), (9, 0.0, None), (12, 0.9, 5), (10, 1.0, 6))]
    prompts = branching_prompts(target, params, seed=2)
    expected = [o.token_ids for o in plain_outputs(target, prompts, params)]
    for (name, make), policy in product(drafters(target, tmp_path).items(), POLICIES):
        engine = Engine(target, draft=make(), num_draft_tokens=4, block_size=4, checkpoint=policy,
                        tree=TreeShape((3, 2)))
        rounds = watched(engine)
        got = [o.token_ids for o in engine.generate(prompts, params)]
        assert got == expected, (name, policy)
        assert rounds.trees > 0, name


def recorded_rows(drafter) -> list:
    """What the drafter's `hidden.take` hands it from now on: (seq, first position, rows [n, 1, hidden])."""
    taken, take = [], drafter.hidden.take

    def recording(seq_id):
        first, rows = take(seq_id)
        if rows is not None:
            taken.append((seq_id, first, rows.clone()))
        return first, rows
    drafter.hidden.take = recording
    return taken


def assert_rows_are_a_prefills(target, prompts, outputs, taken, **tolerance) -> None:
    """Every taken row equals the target's last-layer input at its position in a prefill of the
    committed tokens (prompt and output but the pending token)."""
    L = target.config.num_layers
    for seq, (prompt, out) in enumerate(zip(prompts, outputs)):
        cache = HybridCache(target.config, max_seqs=1, num_blocks=16, block_size=4, ring_slots=2, dtype=target.dtype)
        cache.hidden = HiddenStates((L,), L)
        target.prefill(cache, [0], [(prompt + out.token_ids)[:-1]])
        _, want = cache.hidden.take(0)  # [positions, 1, hidden]
        for s, first, rows in taken:
            if s == seq:
                torch.testing.assert_close(rows, want[first:first + len(rows)], **tolerance)


def test_an_mtp_drafter_reads_the_accepted_tokens_hidden_states_after_tree_rounds():
    """Every hidden-state row the MTP drafter takes after tree rounds equals the target's
    at that position in a prefill of the committed tokens (the tree's rows are laid out
    along the accepted path, `HiddenStates.follow_path`)."""
    target = tiny_model(0, FAMILIES["mamba2"], vocab_size=VOCAB)
    drafter = MTPDrafter(random_mtp(target, 3), MTP_CACHE)
    taken = recorded_rows(drafter)
    engine = Engine(target, draft=drafter, num_draft_tokens=4, block_size=4, tree=TreeShape((3, 2)))
    rounds = watched(engine)
    params = [hs.SamplingParams(max_new_tokens=16, temperature=t, seed=3, ignore_eos=True) for t in (0.0, 0.9)]
    prompts = [[1, 2, 3, 1, 2, 4, 1, 2], [5, 6, 7, 5]]
    outputs = engine.generate(prompts, params)
    assert rounds.trees > 0 and rounds.off_spine > 0 and len(taken) > 4
    assert_rows_are_a_prefills(target, prompts, outputs, taken, rtol=0, atol=1e-10)


def test_a_rows_tokens_do_not_depend_on_its_neighbours_trees():
    """Rows whose contexts branch (trees) beside rows that draft chains or nothing, under
    two widths: each row's tokens are those it gets alone in a chain engine, and plain's."""
    target = tiny_model(0, FAMILIES["gdn"], vocab_size=VOCAB)
    params = [hs.SamplingParams(max_new_tokens=n, temperature=0.9, seed=s, ignore_eos=True)
              for n, s in ((11, 1), (3, 2), (9, 3), (12, 4))]
    prompts = branching_prompts(target, params[:2], seed=4) + [[9, 10, 11], [12]]
    alone = [Engine(target, draft="suffix", num_draft_tokens=4, block_size=4).generate([p], [q])[0].token_ids
             for p, q in zip(prompts, params)]
    assert alone == [o.token_ids for o in plain_outputs(target, prompts, params)]
    for shape in ((2,), (3, 2)):
        for order in (slice(None), slice(None, None, -1)):
            engine = Engine(target, draft=SuffixDrafter(min_prob=0.0), num_draft_tokens=4, block_size=4,
                            tree=TreeShape(shape))
            rounds = watched(engine)
            got = [o.token_ids for o in engine.generate(prompts[order], params[order])][order]
            assert got == alone, shape
            assert rounds.trees > 0


def joint_second_third(target, prompt: list[int], temperature: float) -> torch.Tensor:
    """P(t2, t3) [vocab, vocab] of plain sampling after `prompt` at `temperature` (t1 summed
    out), exactly: every continuation of one and two tokens run through the target, float64."""
    V = target.vocab_size

    def next_probs(contexts):  # [len(contexts), vocab]
        cache = HybridCache(target.config, max_seqs=len(contexts), num_blocks=len(contexts) * 4, block_size=4,
                            ring_slots=2, dtype=target.dtype)
        logits = target.prefill(cache, list(range(len(contexts))), contexts, last_only=True)[:, 0]
        return torch.softmax(logits.double() / temperature, -1)

    p1 = next_probs([prompt])[0]  # [V]
    p2 = next_probs([prompt + [a] for a in range(V)])  # [V(t1), V(t2)]
    p3 = next_probs([prompt + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)  # [t1, t2, t3]
    return torch.einsum("a,ab,abc->bc", p1, p2, p3)


@pytest.mark.parametrize("draft", ["model", "suffix"])
def test_unseeded_tree_sampling_follows_the_target(draft):
    """Unseeded sampled rows, verified by recursive rejection over each node's children
    (`spec.tree_sampling`): the second and third emitted tokens (the first round's, drafted
    as a tree; the first comes from the prefill) fit the target's exact joint distribution.
    The rounds accepted alternatives off the spine too. (With the accept uniforms halved,
    a bias toward the drafts, both cases fail.)"""
    from scipy import stats
    layers = ("mamba2", "gdn")  # no attention: hundreds of rows' tree forwards stay fast
    target = tiny_model(0, layers, vocab_size=6)
    prompt, temperature, n = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2], 1.0, 400
    # an unrelated draft model (its spine often wrong: the alternatives decide often) or one-hot drafts
    drafter = tiny_model(7, layers, vocab_size=6) if draft == "model" else SuffixDrafter(min_prob=0.0)
    engine = Engine(target, draft=drafter, num_draft_tokens=4, block_size=4, max_batch_size=n,
                    tree=TreeShape((3, 2)))
    rounds = watched(engine)
    outputs = engine.generate([prompt] * n, hs.SamplingParams(max_new_tokens=6, temperature=temperature,
                                                                 ignore_eos=True))
    assert rounds.trees > 0 and rounds.off_spine > 0
    V = target.vocab_size
    counts = torch.zeros(V, V, dtype=torch.float64)
    for o in outputs:
        counts[o.token_ids[1], o.token_ids[2]] += 1
    expected = n * joint_second_third(target, prompt, temperature)
    big = expected >= 5  # cells a chi-square can judge; the rest lumped into one
    observed, wanted = counts[big], expected[big]
    if not big.all():
        observed = torch.cat([observed, counts[~big].sum().view(1)])
        wanted = torch.cat([wanted, expected[~big].sum().view(1)])
    pvalue = stats.chisquare(observed.numpy(), wanted.numpy() * n / wanted.sum().item()).pvalue
    assert pvalue > 1e-3, (draft, pvalue, int(big.sum()), rounds.off_spine)


def test_model_free_trees():
    """Suffix decoding's alternatives are the other continuations of the matched n-gram,
    most frequent first and above min_prob; prompt lookup's are the other occurrences'; a
    tree cuts its spine to fit the budget; rows that are all chains make no parents."""
    trie = SuffixTrie(4)
    trie.add([1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2, 5])
    node = trie.find([1, 2])
    assert trie.alternatives(node, [3, 1], 0.0, 3) == [[3, 4, 5], [1, 9]]  # 3 twice; after "1 2 3": 1 and 9, once each
    assert trie.alternatives(node, [3, 1], 0.3, 3) == [[3], []]  # 4, 5 and the second depth: 1/4 each
    assert trie.alternatives(node, [3, 1], 0.0, 2) == [[3, 4], [1, 9]]
    assert fitted_tree([3, 1, 2], [[3, 4, 5], [1, 9], [2]], TreeShape((3, 2)), budget=4) == ([3, 4, 5, 1],
                                                                                                  [-1, -1, -1, 0])
    assert fitted_tree([3, 1, 2], [[3], [1], [2]], TreeShape((3, 2)), budget=3) == ([3, 1, 2], [-1, 0, 1])
    assert tree_parents([([3, 1], [-1, 0]), ([], [])]) is None
    assert tree_parents([([3, 4], [-1, -1]), ([7], [-1])]) == [[-1, -1], [-1]]
    ngram = NgramDrafter(tree=TreeShape((3,)))
    context = [1, 2, 3, 8, 1, 2, 4, 8, 1, 2, 3, 7, 1, 2]
    assert ngram.continuations(context, 3, 8) == [[3, 7, 1], [4, 8, 1], [3, 8, 1]]
    assert ngram._tree(context, 3) == ([3, 4, 7], [-1, -1, 0])  # the spine cut to two: "4" beside "3"


def test_the_suite_in_tree_mode_passes(capsys):
    from hybridspec.cli.main import main
    assert main(["check", "--quick", "--tree", "2,1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert rows and all(r.startswith("PASS") for r in rows)
    for kind in ("tree greedy parity · perturbed", "tree coupled parity · suffix", "tree batch invariance",
                 "tree failed round"):
        assert any(kind in r for r in rows), kind
    with pytest.raises(SystemExit):
        main(["check", "--tree", "2,0"])
