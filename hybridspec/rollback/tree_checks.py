"""The rollback suite's tree mode (`run_suite(tree=...)`, `hybridspec check --tree 2,1`): the
checks of `rollback.checks` run over tree rounds (docs/design.md, "Tree drafts"), and the batch
invariance of rows beside other rows' trees."""
from __future__ import annotations

from typing import Callable

from hybridspec.engine.engine import Engine
from hybridspec.models.hybrid import HybridModel
from hybridspec.rollback.checks import (POLICIES, CheckResult, _require, _run_check, failed_round,
                                        speculative_parity)
from hybridspec.rollback.models import branching_prompts, perturbed_copy, plain_outputs, sampled_params, workload
from hybridspec.rollback.observer import RoundObserver
from hybridspec.spec.suffix_drafter import SuffixDrafter
from hybridspec.spec.tree import TreeShape


def tree_batch_invariance(name: str, target: HybridModel, draft, tree: TreeShape, prompts, params) -> CheckResult:
    """Each seeded request's tokens alone (plain decoding) == in a batch of tree rounds ==
    in the reversed batch, where its neighbours draft other trees, chains or nothing;
    `draft()` makes a fresh drafter per engine."""
    def body():
        alone = [plain_outputs(target, [p], [q])[0].token_ids for p, q in zip(prompts, params)]
        trees = 0
        for order in (slice(None), slice(None, None, -1)):
            engine = Engine(target, draft=draft(), num_draft_tokens=4, block_size=4, tree=tree)
            observer = RoundObserver(engine)
            with observer:
                got = [o.token_ids for o in engine.generate(prompts[order], params[order])][order]
            trees += observer.tree_rounds
            for i, (a, b) in enumerate(zip(alone, got)):
                _require(a == b, f"request {i}: alone {a}, beside other rows' trees {b}")
        _require(trees > 0, "no round drafted a tree")
        return f"{len(prompts)} requests, {trees} tree rounds", {}
    return _run_check(name, body)


def tree_suite(target: HybridModel, draft, draft_name: str, tree: TreeShape, quick: bool = False, seed: int = 0,
               add: Callable[[CheckResult], None] = lambda result: None) -> list[CheckResult]:
    """The suite's tree mode: `draft` (it must branch: a draft model, "mtp", suffix decoding,
    prompt lookup) and suffix decoding proposing trees of `tree`'s shape, greedy and coupled
    parity with state parity under two policies (every input snapshotted; the smallest
    ring, two slots, which a tree round needs: it snapshots the root and replays the
    accepted path from there), then failed tree rounds at the draft, verify, replay
    (in that ring) and drafter-commit sites (a draft model's)."""
    vocab = target.vocab_size
    params = workload(vocab, seed, max_new_tokens=(12, 7, 10) if quick else (24, 13, 19))[1]
    prompts = branching_prompts(target, params, seed)  # model-free drafters branch from the first round
    expected = plain_outputs(target, prompts, params)
    sparams = sampled_params(seed + 100, (12, 7, 10, 9) if quick else (20, 14, 17, 11))
    sprompts = branching_prompts(target, sparams, seed + 1)
    sexpected = plain_outputs(target, sprompts, sparams)
    shape = ",".join(map(str, tree.widths))
    drafters = {draft_name: lambda: draft}
    if not isinstance(draft, SuffixDrafter):
        drafters["suffix"] = lambda: SuffixDrafter(min_prob=0.0)  # a fresh one per engine: it branches most
    results = []

    def done(result: CheckResult) -> None:
        results.append(result)
        add(result)

    for dname, make in drafters.items():
        for gamma, pname in ((4, "k=1"), (3, "ring too small")):
            done(speculative_parity(f"tree greedy parity · {dname} · {shape} · γ={gamma} · {pname}", target,
                                    make(), gamma, POLICIES[pname], prompts, params, expected, check_states=True,
                                    tree=tree))
            done(speculative_parity(f"tree coupled parity · {dname} · {shape} · γ={gamma} · {pname}", target,
                                    make(), gamma, POLICIES[pname], sprompts, sparams, sexpected, verify="coupled",
                                    check_states=True, tree=tree))
    mixed = sprompts[:2] + [p[-2:] for p in sprompts[2:]]  # rows that branch beside rows that barely can
    done(tree_batch_invariance(f"tree batch invariance · suffix · {shape}", target,
                               lambda: SuffixDrafter(min_prob=0.0), tree, mixed, sparams))
    model_draft = draft if isinstance(draft, HybridModel) else perturbed_copy(target, seed=seed)
    sites = (("draft", "k=1"), ("verify", "k=1"), ("replay", "ring too small"), ("drafter commit", "k=1"))
    for site, pname in sites[:3 if quick else 4]:
        done(failed_round(f"tree failed round · {site} · {shape}", target, model_draft, 4, POLICIES[pname],
                          prompts, params, site, expected=expected, tree=tree))
    return results
