"""Drafters propose d_1..d_γ, with their post-processed probabilities
q_1..q_γ when they have them. Every drafter answers the `Drafter` protocol
(`spec.protocol`), which is all the Engine and the round ask of one: neither
ever asks which kind it holds.

- `NgramDrafter` (prompt lookup): continue the most recent earlier match of
  the longest suffix n-gram of the committed tokens; no probabilities (q is
  one-hot: `Proposal.probs` is None and the rejection kernel takes it so).
- `SuffixDrafter` (`spec.suffix_drafter`, suffix decoding): the most
  frequent continuation of the longest suffix seen before, in the sequence or
  in earlier requests' outputs, from incrementally kept n-gram counts; q is
  one-hot too.
- `ModelDrafter` (`spec.model_drafter`): any HybridModel with its own cache.
- `MTPDrafter` (`spec.mtp_drafter`): the target checkpoint's MTP layer, reading
  the target's hidden states.
- `Eagle3Drafter` (`spec.eagle3_drafter`): an EAGLE-3 head from its own
  directory, reading the target's hidden states at three layers.

`as_draft` normalises what `Engine(draft=...)` and `LLM(draft=...)` accept,
`as_drafter` makes the Engine's drafter of it.
"""
from __future__ import annotations

from pathlib import Path

import torch

from hybridspec.adapters import load
from hybridspec.adapters.eagle3 import load_eagle3
from hybridspec.adapters.mtp import load_mtp
from hybridspec.cache.prefix_cache import PrefixCache
from hybridspec.errors import ConfigError
from hybridspec.models.hybrid import HybridModel
from hybridspec.sampling.sampler import RowParams
from hybridspec.spec.eagle3_drafter import Eagle3Drafter
from hybridspec.spec.model_drafter import ModelDrafter
from hybridspec.spec.mtp_drafter import MTPDrafter
from hybridspec.spec.protocol import Drafter, Proposal, StatelessDrafter
from hybridspec.spec.suffix_drafter import SuffixDrafter
from hybridspec.spec.tree import TreeShape, checked_tree, fitted_tree, tree_parents

__all__ = ["Drafter", "Eagle3Drafter", "ModelDrafter", "NgramDrafter", "Proposal", "StatelessDrafter",
           "SuffixDrafter", "as_draft", "as_drafter"]


class NgramDrafter(StatelessDrafter):
    """Prompt-lookup drafting over the committed tokens of each sequence
    (prompt and output): find the most recent earlier occurrence of the
    longest suffix n-gram and propose the tokens that followed it. No model,
    no probabilities (q is one-hot); a round with no match drafts nothing.

    max_ngram: the longest suffix n-gram looked up, in tokens (default 3).
    min_ngram: the shortest (default 1); 1 <= min_ngram <= max_ngram.
    tree: None (chains, the default) or a `TreeShape` (`Engine(tree=...)` sets
        it): the most recent occurrence's continuation is the spine, and at
        each depth the tokens that followed the other occurrences agreeing
        with the spine so far (most recent first, at most `MAX_MATCHES`
        occurrences) are leaves beside it."""

    MAX_MATCHES = 8  # earlier occurrences a tree reads: a bounded scan, as many branches as a tree takes

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, tree: TreeShape | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"need 1 <= min_ngram={min_ngram} <= max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram, self.tree = max_ngram, min_ngram, checked_tree(tree)

    def lookup(self, context: list[int], gamma: int) -> list[int]:
        """Continuation of the most recent earlier occurrence of the longest suffix n-gram."""
        found = self.continuations(context, gamma, 1)
        return found[0] if found else []

    def continuations(self, context: list[int], gamma: int, limit: int) -> list[list[int]]:
        """The continuations (up to `gamma` tokens) of the `limit` most recent earlier
        occurrences of the longest suffix n-gram that occurred, most recent first."""
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            suffix, found = context[-n:], []
            for start in range(len(context) - n - 1, -1, -1):
                if context[start:start + n] == suffix:
                    found.append(context[start + n:start + n + gamma])
                    if len(found) == limit:
                        break
            if found:
                return found
        return []

    def propose(self, requests, gammas: list[int], rows: RowParams, coupled: list[bool]) -> Proposal:
        if self.tree is None:
            tokens = [self.lookup(r.output.prompt_token_ids + r.output.token_ids, g) if g > 0 else []
                      for r, g in zip(requests, gammas)]
            return Proposal(tokens, None)
        trees = [self._tree(r.output.prompt_token_ids + r.output.token_ids, g) for r, g in zip(requests, gammas)]
        return Proposal([tokens for tokens, _ in trees], None, parents=tree_parents(trees))

    def _tree(self, context: list[int], gamma: int) -> tuple[list[int], list[int]]:
        """One row's (tokens, parents): the occurrences' continuations as branches."""
        found = self.continuations(context, gamma, self.MAX_MATCHES) if gamma > 0 else []
        if not found:
            return [], []
        spine = found[0]
        ranked = [[c[k] for c in found if len(c) > k and c[:k] == spine[:k]] for k in range(len(spine))]
        return fitted_tree(spine, ranked, self.tree, self.tree.budget(gamma))


MODEL_FREE = {"ngram": NgramDrafter, "suffix": SuffixDrafter}  # the names that make a model-free drafter

DRAFT_FORMS = ('None (plain decoding), "ngram" (prompt lookup), "suffix" (suffix decoding), "mtp" (the target '
               'checkpoint\'s multi-token-prediction layer; "mtp:DIR": one trained beside it), "eagle3:DIR" '
               '(an EAGLE-3 head trained for the target, in the published format; "eagle3": the embedded '
               'target\'s), "layers:N" (a layer-skip draft: the target\'s own first N layers, final norm and '
               'LM head, no weight copied), a draft model '
               'directory, a HybridModel (hs.from_hf / hs.load) sharing the target\'s vocabulary, '
               'hs.NgramDrafter(...), hs.SuffixDrafter(...), or a Drafter: '
               'model, cache, prefix, start, backlog, propose, commit, revert, release and check_invariant '
               '(hybridspec.spec.Drafter; a subclass of hs.StatelessDrafter writes propose only)')


def as_draft(draft, dtype: torch.dtype | None = None, device=None) -> HybridModel | Drafter | None:
    """What an `Engine(draft=...)` or `LLM(draft=...)` argument names, in one of
    the forms an Engine runs: None, a HybridModel, or a Drafter. "ngram" is
    `NgramDrafter()`, "suffix" `SuffixDrafter()`; "mtp", "mtp:DIR", "eagle3", "eagle3:DIR" and
    "layers:N" stay strings, read over the target by `as_drafter`; any other string or path is a draft model directory,
    loaded (`hs.load`) in `dtype` on `device` (None: the weights' stored dtype, the CPU)."""
    if draft is None or isinstance(draft, (HybridModel, Drafter)):
        return draft
    if isinstance(draft, str) and draft in MODEL_FREE:
        return MODEL_FREE[draft]()
    if isinstance(draft, str) and (draft == "mtp" or draft.startswith("mtp:")):
        return draft  # read from the target's checkpoint by `as_drafter`
    if isinstance(draft, str) and (draft == "eagle3" or draft.startswith("eagle3:")):
        return draft  # read over the target by `as_drafter`
    if isinstance(draft, str) and draft.startswith("layers:"):
        layer_skip_layers(draft)  # checked here, built over the target by `as_drafter`
        return draft
    if isinstance(draft, (str, Path)):
        return load(draft, dtype=dtype, device="cpu" if device is None else device)
    raise ConfigError(f"draft={_short(draft)} ({type(draft).__name__}) is not a drafter; pass {DRAFT_FORMS}")


def as_drafter(draft, target: HybridModel, gamma: int, cache_kwargs: dict,
               prefix_cache: PrefixCache | None = None, tree: TreeShape | None = None) -> Drafter | None:
    """The Engine's drafter for its `draft` argument (`as_draft`; a model
    directory loads in the target's dtype, on its device): None for plain
    decoding, a HybridModel run as a `ModelDrafter` (with its own prefix cache
    when `prefix_cache` is set), or the Drafter itself. With `tree`, a drafter
    that branches (a draft model, the MTP layer, an EAGLE-3 head, suffix
    decoding, prompt lookup: those with a `tree` attribute) proposes trees of
    that shape; a ConfigError for one that does not."""
    if isinstance(draft, str) and (draft == "mtp" or draft.startswith("mtp:")):
        return MTPDrafter(load_mtp(target, draft[4:] or None), cache_kwargs, tree)
    if isinstance(draft, str) and (draft == "eagle3" or draft.startswith("eagle3:")):
        return Eagle3Drafter(load_eagle3(target, draft[len("eagle3:"):] or None), cache_kwargs, tree)
    if isinstance(draft, str) and draft.startswith("layers:"):
        return ModelDrafter(target.first_layers(layer_skip_layers(draft)), gamma, cache_kwargs, prefix_cache, tree)
    draft = as_draft(draft, target.dtype, target.device)
    if not isinstance(draft, HybridModel):
        if tree is not None:
            if draft is None or not hasattr(draft, "tree"):
                raise ConfigError(f"tree={tree!r}: the drafter {_short(draft)} does not branch; pass a draft "
                                  "model, 'mtp', 'eagle3:DIR', 'suffix' or 'ngram' (or tree=None for chains)")
            draft.tree = tree  # the Engine's shape: a drafter instance proposes its trees
        return draft
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"draft vocabulary ({draft.vocab_size}) differs from the target's "
                          f"({target.vocab_size}); the drafter must share the target's tokenizer")
    return ModelDrafter(draft, gamma, cache_kwargs, prefix_cache, tree)


def layer_skip_layers(draft: str) -> int:
    """N of a "layers:N" draft (the target's first N layers: `HybridModel.first_layers`)."""
    text = draft[len("layers:"):]
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"draft={draft!r}: a layer-skip draft is 'layers:N', N the count of the target's first "
                          "layers it runs (1 or more, fewer than the target has), e.g. 'layers:2'")
    return int(text)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
