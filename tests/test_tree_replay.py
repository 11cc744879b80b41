"""Tree rounds under the checkpoint policy (`checkpoints/tree_restore.py`): a
log replay along any root-to-input path, from the head or a snapshotted
ancestor, is the tree forward's state for that input bit for bit (the float64
torch forms on Mamba-2, Mamba-1 and GDN hybrids; the float32 C tree forms);
tree rounds under every policy (every input snapshotted, sparse, the last
only, a ring too small, no log) give plain output, greedy and coupled, with
state parity after every commit, replaying where the policy leaves the
accepted input without a snapshot; a round holds only its snapshots and log;
a round that fails inside a replay leaves every sequence as it was."""
import pytest
import torch

import hybridspec as hs
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.cache.tree_batch import TreeBatch
from hybridspec.checkpoints.policy import CheckpointPolicy
from hybridspec.checkpoints.restore import RestoreDecision, log_replay
from hybridspec.checkpoints.ring import plan_snapshots
from hybridspec.checkpoints.tree_restore import decide_path, path_log, tree_snapshot_inputs
from hybridspec.engine.engine import Engine
from hybridspec.rollback.observer import InjectedFault, RoundObserver, install_fault
from hybridspec.rollback.models import perturbed_copy, plain_outputs, tiny_model
from hybridspec.spec.tree import TreeShape
from native_cpu import x86_with_compiler
from test_tree_drafts import StateParity

FAMILIES = {"mamba2": ("mamba2", "attention", "mamba2"), "mamba1": ("mamba1", "attention", "mamba1"),
            "gdn": ("gdn", "attention", "gdn")}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [40, 41]]
PARENTS = [[-1, 0, 0, 1, 2, 3], [-1, 0, 1, 0]]
TOKENS = [[PROMPTS[0][-1], 20, 21, 22, 23, 24], [PROMPTS[1][-1], 30, 31, 32]]
SNAPSHOTS = [[2], [1]]  # row 0: input 2 (a child of the root off input 1's branch); row 1: input 1
POLICIES = {  # name -> (policy, what restores the accepted input: "hit", "log" or "token")
    "k=1": (CheckpointPolicy(snapshot_every=1), "hit"),
    "k=2": (CheckpointPolicy(snapshot_every=2), "log"),
    "k=0 ring 2": (CheckpointPolicy(snapshot_every=0, ring_slots=2), "log"),
    "ring too small": (CheckpointPolicy(snapshot_every=1, ring_slots=3), "log"),
    "log off": (CheckpointPolicy(snapshot_every=1, ring_slots=3, log_inputs=False), "token"),
    "k=0 ring 2 log off": (CheckpointPolicy(snapshot_every=0, ring_slots=2, log_inputs=False), "token"),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request):
    target = tiny_model(0, FAMILIES[request.param])
    return target, perturbed_copy(target, 0.3, 1)


def _states(cache: HybridCache, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.states.ssm_states[layer][slot], cache.states.conv_states[layer][slot]


def assert_every_path_replays_exactly(model):
    """One tree forward snapshotting SNAPSHOTS and logging every input; then each input's state
    log-replayed along its path from its nearest snapshotted ancestor (or the head) into a free
    slot equals, bit for bit, the state the forward computed for it (kept by the TreeBatch)."""
    cache = HybridCache(model.config, max_seqs=2, num_blocks=16, block_size=4, ring_slots=6, dtype=model.dtype)
    model.prefill(cache, [0, 1], [p[:-1] for p in PROMPTS[:2]])
    T = len(TOKENS[0])
    plans = [plan_snapshots(cache.states.ring_slots(s), cache.head(s), SNAPSHOTS[s], T) for s in (0, 1)]
    tree, log = TreeBatch(PARENTS, "cpu"), {}
    model.extend(cache, [0, 1], TOKENS, snap_slot=[p.snap_slot for p in plans], input_log=log, tree=tree)
    assert not tree.in_ring and log and set(tree.ssm) == set(log)
    sources = set()
    for b, parents in enumerate(PARENTS):
        free = next(s for s in cache.states.ring_slots(b) if s != plans[b].head and s not in plans[b].snap_slot)
        for t in range(len(parents)):
            path = tree.plan.path_to(b, t)
            d = decide_path(plans[b], path, True, free)
            if d.path == "hit":
                continue
            sources.add(d.src_input >= 0)
            decisions = [None, None]
            decisions[b] = RestoreDecision("log", d.src_input, d.src_slot, free, d.boundary_input)
            log_replay(model, cache, decisions, path_log(log, [path if r == b else None for r in (0, 1)], T, "cpu"))
            for layer in tree.ssm:
                ssm, conv = _states(cache, layer, free)
                assert torch.equal(ssm, tree.ssm[layer][b, t].to(ssm.dtype)), (b, t, layer)
                assert torch.equal(conv, tree.conv[layer][b, t].to(conv.dtype)), (b, t, layer)
    assert sources == {True, False}  # replays from a snapshot and from the head


def test_log_replay_along_each_path_is_the_tree_forward_bit_for_bit(pair):
    assert_every_path_replays_exactly(pair[0])


@x86_with_compiler
@pytest.mark.parametrize("layers", [("mamba2", "attention", "mamba2"), ("mamba1", "attention", "gdn")])
def test_native_log_replay_along_each_path_is_the_c_tree_forms_bit_for_bit(layers):
    """float32 packed models: a tree with inputs without a slot runs layer by layer on the
    C tree forms (the whole C forward declines it), and the native replay matches them."""
    assert_every_path_replays_exactly(tiny_model(0, layers, dtype=torch.float32).pack_for_cpu())


def test_tree_snapshot_inputs_follow_the_policy_spine_first():
    depths, spine = [0, 1, 1, 2, 2, 3], [0, 1, 3, 5]
    assert tree_snapshot_inputs(depths, spine, [0, 1, 2, 3], 5) == [0, 1, 2, 3, 5]  # spine first, then input order
    assert tree_snapshot_inputs(depths, spine, [0, 1, 2, 3], 6) == [0, 1, 2, 3, 4, 5]
    assert tree_snapshot_inputs(depths, spine, [0, 2, 3], 9) == [0, 3, 4, 5]  # k = 2 over depth 3
    assert tree_snapshot_inputs(depths, spine, [3], 1) == [5]  # k = 0: the deepest
    assert tree_snapshot_inputs(depths, spine, [0, 1, 2, 3], 2) == [0, 1]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_tree_rounds_under_each_policy_give_plain_output_with_state_parity(pair, name):
    """Greedy rows and seeded sampled rows (coupled) in one batch; after every commit the
    invariant and each row's states and K/V equal a fresh prefill's; the accepted inputs
    without a snapshot were replayed the policy's way, and rounds held no input's state
    beside the ring."""
    target, draft = pair
    policy, restored = POLICIES[name]
    params = [hs.SamplingParams(max_new_tokens=n, temperature=t, seed=s)
              for n, t, s in ((16, 0.0, None), (11, 0.9, 2), (13, 0.0, None))]
    engine = Engine(target, draft=draft, num_draft_tokens=4, block_size=4, checkpoint=policy, tree=TreeShape((2,)))
    engine.speculator.check = True
    parity = StateParity(engine)
    engine.speculator.hooks.append(parity)
    held = Held(engine)
    engine.speculator.hooks.append(held)
    outputs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain_outputs(target, PROMPTS, params)]
    stats = engine.stats
    assert parity.tree_rounds > 0 and parity.checked > 0
    replayed = {"hit": 0, "log": stats.log_replayed_tokens, "token": stats.token_replayed_tokens}
    assert replayed[restored] > 0 if restored != "hit" else stats.log_replayed_tokens == 0
    assert sum(replayed.values()) == replayed[restored]
    assert held.kept == 0 and held.most == stats.peak_checkpoint_bytes > 0


class Held:
    """A RoundHook: each tree round's held checkpoint bytes (snapshots + log) and any input
    states kept beside the ring."""

    def __init__(self, engine: Engine):
        self.engine, self.most, self.kept = engine, 0, 0

    def round_started(self, round): pass

    def phase_started(self, phase): pass

    def round_ended(self, round, error): pass

    def committed(self, round):
        if round.tree is None:
            return
        cache = self.engine.cache
        snapshots = sum(len(p.survivors) for p in round.plans) * cache.states.bytes_per_slot
        logged = sum(log.nbytes() for log in (round.input_log or {}).values())
        assert self.engine.speculator.checkpointer.held_bytes(round) == snapshots + logged
        self.most, self.kept = max(self.most, snapshots + logged), self.kept + round.tree.nbytes()


class FailedRound:
    """A RoundHook keeping the round that raised."""

    round = None

    def round_started(self, round): pass

    def phase_started(self, phase): pass

    def committed(self, round): pass

    def round_ended(self, round, error):
        if error is not None:
            self.round = round


@pytest.mark.parametrize("name", ["k=0 ring 2", "k=0 ring 2 log off"])
def test_a_tree_round_failing_in_its_replay_leaves_every_sequence_as_it_was(name):
    """The rollback suite's failure injection at the replay site (the last recurrent layer's
    log replay, or the token replay's forward) of a tree round: bookkeeping, head states and
    K/V of every sequence, target and drafter, exactly as before the round."""
    target = tiny_model(0, FAMILIES["mamba2"])
    engine = Engine(target, draft=perturbed_copy(target, 0.3, 1), num_draft_tokens=4, block_size=4,
                    checkpoint=POLICIES[name][0], tree=TreeShape((2,)))
    observer, failed = RoundObserver(engine, capture=True), FailedRound()
    with observer, install_fault(engine, observer, "replay", 1):
        engine.speculator.hooks.append(failed)
        try:
            engine.generate(PROMPTS, [hs.SamplingParams(max_new_tokens=n, temperature=0.0) for n in (12, 9, 10)])
        except InjectedFault:  # the engine may also carry on past a failed round
            pass
    assert failed.round is not None and failed.round.parents is not None and observer.reverted == []
    replays = [d for d in failed.round.decisions if d is not None and d.path != "hit"]
    assert replays and all(d.path == POLICIES[name][1] for d in replays)
