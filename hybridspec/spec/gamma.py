"""Adaptive speculation (`Engine(num_draft_tokens="auto")`): each round, γ for
each sequence in 0 … γ_max, chosen to maximise the round's expected goodput

    goodput(G) = Σ_b E[tokens](α̂_b, γ_b) / cost(B, G),   γ_b = min(G, cap_b, g_b)

- E[tokens](α, γ) = 1 + α + … + α^γ (`hs.sim.expected_tokens`, capped-geometric
  acceptance); γ = 0 is a plain step inside the round (one token).
- α̂_b: the sequence's acceptance estimate, an exponentially weighted count of
  accepted drafts over drafts tried (a draft is tried up to the first
  rejection), shrunk toward the engine-wide estimate, itself shrunk toward
  `prior_alpha` and raised by `OPTIMISM_Z` standard deviations of its Beta
  posterior over the drafts ever tried (an upper confidence bound): while
  few drafts were tried, the prior or one unlucky round cannot stop drafting
  before rounds measure it, and the bound meets the estimate as drafts are
  tried. Rounds that draft nothing decay the counts (`IDLE_DECAY`),
  so an estimate drifts back to the prior. Probes keep a pessimistic
  estimate from freezing: after `PROBE_EVERY` rounds without drafts one
  round drafts G = γ_max / 2 anyway (the wait doubles after every probe up
  to `MAX_PROBE_EVERY`, so where speculation does not pay probing costs
  less and less), and only for the row a model drafter is least behind, so
  a probe does not pay every row's absorption. The first round drafts at
  least γ_max / 2 (where some G can pay, below), so the drafter's cost is
  measured at a G that can pay before rounds at G = 1 (whose steps cost the
  most each) price it out.
- cost(B, G) = hs.sim.round_seconds(terms(B, G), scale_B, draft_scale_B,G)
  + replay(B, G, ᾱ) + residual_B, replay the expected replay of the
  engine's checkpoint policy at the batch's mean acceptance estimate
  (`RoundCosts.replay`, 0 where every boundary is a snapshot); the terms:
  every term of a round (`hs.sim.RoundTerms`) measured at start-up by
  running the engine's own plain step and rounds on scratch caches
  (`hybridspec.engine.startup_costs`), linear between the measured batches and
  token counts: the target forward of G + 1 tokens per row (with the
  engine's snapshot writes), the drafter's part (catch-up and G steps, as
  the drafter runs them), sampling and acceptance, commit, and the round's
  own host bookkeeping; a round whose rows partly sample takes each of the
  sampling and draft terms that share of the way from the greedy rows'
  figure to the sampling rows' (`hs.sim.mixed_terms`). The forward and
  drafter scales (1 until a round is seen) and the residual (0: what the
  other terms missed, signed) are learned online per batch size from each
  round's phase times (exponential averages, scales in log space), so costs
  follow the machine's load and what start-up missed (filters and
  penalties, the engine's own loop).
  The forward's scale is learned apart for plain steps and verify forwards,
  because the two drift from start-up's figures differently; the round right
  after a prefill teaches neither, because its forward runs cold. While the
  engine drafts, plain steps are rare and most follow prefills, so after
  `PROBE_EVERY` rounds (doubling up to `MAX_PROBE_EVERY`) without a plain
  step that taught its scale one round is a plain step, unless drafting's
  goodput, predicted and (once measured, below) measured, is at least
  `PLAIN_PROBE_MARGIN` times plain steps' predicted one (then no price of a
  plain step could change the choice); the wait doubles only once plain
  steps' goodput is measured at the batch (`MIN_REALIZED` rounds, below),
  so the measured rule has both kinds to compare. The drafter's scale is
  learned per G (the nearest G's stands in until one is seen), because G
  steps do not cost G times one step (a greedy drafter's G steps run as one
  native call). The residuals are learned apart for rounds that draft and
  plain ones.
- measured rounds over the prior: each batch bucket keeps the realized
  goodput of each kind of round, log(emitted tokens / round seconds) per
  round (the round's wall time without the drafter's absorption, which
  `absorb` below charges), as an exponentially weighted mean m and
  variance v over its last n ≤ 1 / (1 − COST_DECAY) rounds (`_Realized`);
  drafting rounds are those where every row drafted, plain ones those where
  none did (mixed rounds, a one-row probe or rows at their caps, and rounds
  right after a prefill teach neither). The rule: where both kinds have `MIN_REALIZED` rounds and

      m_draft + REALIZED_Z · √(v_draft / n_draft + v_plain / n_plain) < m_plain,

  drafting was measured slower per token than plain steps, whatever the
  model predicts: a round the model would draft runs plain steps instead,
  except on the probe schedule above (`PROBE_EVERY` rounds without drafts,
  doubling up to `MAX_PROBE_EVERY`), where it drafts for every row as the
  model chose, so drafting is measured again. Where the measured kinds
  overlap (or one is unmeasured) the model decides.
- no γ pays: where even rounds that accept every draft (G + 1 tokens per
  row) would yield fewer tokens per second than plain steps at the current
  costs and at start-up's (the measured terms, nothing learned), every row
  runs a plain step and nothing is probed (the first round and the idle
  probes below only run where some G could pay). Where only the learned
  prices rule every G out, the idle probes go on: a price learned from one
  outlier round (a forward on memory the OS had not yet backed) could
  otherwise never be corrected, since no later round would draft.
- absorb: a model drafter behind a row by n tokens (a new prompt, or rounds
  that drafted nothing) absorbs them before it drafts for the row, one-off
  work plain decoding never does. A G ≥ 1 that drafts for the row is charged
  its share n · absorb_s · E[tokens_b] / (cap_b + 1): the absorption spread
  over the tokens the row has left, absorb_s the seconds per absorbed token
  measured at start-up (at the largest measured batch) and learned from past
  rounds (nothing is charged where neither has been seen). A row
  with few tokens left and a long way behind stays plain.
- cap_b: drafts the request can still use (max_new_tokens − generated − 1).
- g_b: a row's own cost. The forward pads every row to G + 1 inputs and the
  drafter steps the whole batch, so a row's drafts add only their snapshot
  writes (`row_draft_s`, 0 unless measured): a row keeps draft j while
  α̂_b^j ≥ λ · row_draft_s, λ the best goodput (tokens per second) of the
  previous round. With row_draft_s = 0 every row drafts G.

The batch's G is searched exhaustively (γ_max + 1 candidates); the whole
choice is O(B · γ_max) host arithmetic per round. The measurements behind
these choices are in docs/results/gamma.md.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridspec.costs.round_terms import RoundTerms, mixed_terms, round_seconds

from hybridspec.errors import ConfigError
from hybridspec.costs.round_costs import RoundCosts

if TYPE_CHECKING:  # a tree round's outcome, made by the engine from the round
    from hybridspec.spec.tree_auto import TreeOutcome

DEFAULT_MAX_DRAFT_TOKENS = 8
PRIOR_ALPHA = 0.6  # acceptance assumed before anything was measured
DECAY = 0.85  # weight of the past per round in the acceptance counts
COST_DECAY = 0.9  # the same for the learned cost scales and residuals
IDLE_DECAY = 0.98  # the same for acceptance counts in rounds that draft nothing
PROBE_EVERY = 32  # rounds in a row without drafts before one that drafts ...
MAX_PROBE_EVERY = 1024  # ... doubled after each probe, up to this, while drafting does not pay
PRIOR_TRIALS = 4.0  # pseudo-trials of the shrinkage toward the engine-wide estimate
OPTIMISM_Z = 1.0  # standard deviations the engine-wide estimate is raised by while few drafts were tried
MIN_REALIZED = 3  # rounds of each kind measured before measured goodputs overrule the model
REALIZED_Z = 2.0  # standard errors by which measured drafting must trail plain steps to overrule it
REPLAY_GRID = 64  # the expected replay is priced at α's nearest multiple of 1 / REPLAY_GRID
PLAIN_PROBE_MARGIN = 1.5  # plain steps are probed only where drafting wins by less (their price could be off a third)


@dataclass
class _Acceptance:
    """Exponentially weighted accepted drafts / drafts tried."""

    accepted: float = 0.0
    tried: float = 0.0

    seen: int = 0  # drafts tried ever, undecayed: how much the estimate rests on

    def decay(self, weight: float = DECAY) -> None:
        self.accepted *= weight
        self.tried *= weight

    def add(self, accepted: int, tried: int) -> None:
        self.decay()
        self.accepted += accepted
        self.tried += tried
        self.seen += tried

    def estimate(self, prior: float, strength: float = PRIOR_TRIALS) -> float:
        return (self.accepted + strength * prior) / (self.tried + strength)

    def optimistic(self, prior: float) -> float:
        """The estimate plus OPTIMISM_Z standard deviations of a Beta posterior
        with the drafts ever tried (an upper confidence bound): while few drafts
        were tried, a pessimistic prior or one unlucky round cannot stop
        drafting before rounds measure it; the bound meets the estimate as
        drafts are tried."""
        mean = self.estimate(prior)
        return min(1.0, mean + OPTIMISM_Z * math.sqrt(mean * (1.0 - mean) / (self.seen + PRIOR_TRIALS + 1.0)))


@dataclass
class _Realized:
    """One kind of round's measured goodput: log tokens per second per round,
    exponentially weighted mean and variance over its last `rounds` (≤ 1 / (1 −
    COST_DECAY): the effective count of the weighted average)."""

    mean: float = 0.0
    var: float = 0.0
    rounds: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        x = math.log(tokens / seconds)
        self.rounds = min(self.rounds + 1, round(1.0 / (1.0 - COST_DECAY)))
        weight = 1.0 / self.rounds  # a plain mean until the window fills, then exponential
        diff = x - self.mean
        self.mean += weight * diff
        self.var = (1.0 - weight) * (self.var + weight * diff * diff)

    def squared_error(self) -> float:
        return self.var / self.rounds


@dataclass
class _Learned:
    """Online corrections at one measured batch size."""

    draft_scale: dict[int, float] = field(default_factory=dict)  # G -> its learned scale
    # keyed by whether the round drafted: plain steps and verify forwards (module docstring)
    forward_scale: dict[bool, float | None] = field(default_factory=lambda: {False: None, True: None})
    # keyed by whether the round drafted: sampling and commit differ between the kinds
    residual_s: dict[bool, float | None] = field(default_factory=lambda: {False: None, True: None})
    # keyed by whether the round drafted: tokens per second as measured (module docstring)
    realized: dict[bool, _Realized] = field(default_factory=lambda: {False: _Realized(), True: _Realized()})

    def drafting_goodput(self, predicted: float) -> float:
        """Drafting's tokens per second: the lesser of the prediction and, once
        measured (`MIN_REALIZED` rounds), the measured rounds' (geometric) mean."""
        draft = self.realized[True]
        return predicted if draft.rounds < MIN_REALIZED else min(predicted, math.exp(draft.mean))

    def drafting_measured_slower(self) -> bool:
        """The rule of the module docstring: measured drafting trails plain steps beyond their spread."""
        plain, draft = self.realized[False], self.realized[True]
        if min(plain.rounds, draft.rounds) < MIN_REALIZED:
            return False
        return draft.mean + REALIZED_Z * math.sqrt(draft.squared_error() + plain.squared_error()) < plain.mean

    def draft_scale_at(self, G: int) -> float:
        """G's learned drafter scale, else the nearest learned G's (the larger on a tie), else 1."""
        if G in self.draft_scale:
            return self.draft_scale[G]
        if not self.draft_scale:
            return 1.0
        return self.draft_scale[min(self.draft_scale, key=lambda g: (abs(g - G), -g))]

    @staticmethod
    def mix(old: float | None, new: float) -> float:
        return new if old is None else COST_DECAY * old + (1.0 - COST_DECAY) * new

    @staticmethod
    def mix_ratio(old: float | None, new: float) -> float:
        """A scale's average in log space: one slow round (a pause, a busy core) moves it little."""
        if old is None:
            return new
        return math.exp(COST_DECAY * math.log(old) + (1.0 - COST_DECAY) * math.log(new))

    @staticmethod
    def get(values: dict[bool, float | None], drafted: bool, default: float) -> float:
        """The learned value of this kind of round, else the other kind's, else `default`."""
        for value in (values[drafted], values[not drafted]):
            if value is not None:
                return value
        return default


class GammaController:
    """Chooses γ per sequence per round (module docstring) and learns from what
    each round cost and accepted. gamma_max: the most drafts per row; costs:
    the start-up measurements; prior_alpha: acceptance before any is seen."""

    def __init__(self, gamma_max: int, costs: RoundCosts, prior_alpha: float = PRIOR_ALPHA):
        if not isinstance(gamma_max, int) or isinstance(gamma_max, bool) or gamma_max < 1:
            raise ConfigError(f"max_draft_tokens={gamma_max!r} must be an integer >= 1 (8 is typical)")
        self.gamma_max, self.costs, self.prior_alpha = gamma_max, costs, prior_alpha
        self.engine_acceptance = _Acceptance()
        self.sequences: dict[int, _Acceptance] = {}
        self.learned = [_Learned() for _ in costs.batches]
        self.goodput = 0.0  # λ: tokens per second of the last round's choice
        # seconds per token a drafter absorbs (module docstring): start-up's at the largest batch, then learned
        self.absorb_s: float | None = costs.absorb(costs.batches[-1])
        self.probe_every = PROBE_EVERY  # idle rounds before the next probe
        self.idle_rounds = 0  # rounds in a row that drafted nothing
        self.rounds_seen = 0  # rounds observed so far (the first one probes)
        self.plain_probe_every = PROBE_EVERY  # rounds without a plain step that taught its scale before one
        self.unpriced_rounds = 0  # rounds since a plain step last taught its scale
        self._plain_probe_pending = False
        self._measured_at: dict[int, tuple[list[RoundTerms], list[RoundTerms]]] = {}  # batch -> greedy, sampled terms per G
        self._learned_at: dict[int, _Learned] = {}  # batch -> the corrections of its nearest measured batch
        self._replay_memo: dict[tuple[int, int, int], float] = {}  # (α on its grid, batch, G) -> seconds

    # -- the choice ---------------------------------------------------------------------------

    def alpha(self, seq_id: int) -> float:
        engine = self.engine_acceptance.optimistic(self.prior_alpha)
        own = self.sequences.get(seq_id)
        return engine if own is None else own.estimate(engine)

    def round_cost(self, batch: int, G: int, sampled: int = 0) -> float:
        """Predicted seconds of a round of `batch` rows drafting at most G, of
        which `sampled` sample (the rest greedy): the measured terms
        (`hs.sim.round_seconds`), the forward and the drafter scaled as
        learned, plus the learned residual of the other terms."""
        return self.shape_cost(batch, G, G, sampled)

    def shape_cost(self, batch: int, spine: int, nodes: int, sampled: int = 0) -> float:
        """`round_cost` of a round whose drafter steps `spine` drafts per row and whose
        forward verifies `nodes` + 1 inputs per row (a tree's; a chain's spine is its
        nodes), priced as a chain round's terms: the forward, sampling and commit of
        `nodes` drafts, the drafter's part of `spine` (`spec.tree_auto` scales it
        by what tree rounds measured)."""
        terms = self._terms(batch, nodes, sampled)
        if spine != nodes:
            terms = dataclasses.replace(terms, draft_s=self._terms(batch, spine, sampled).draft_s)
        learned = self._learned_at[batch]
        drafted = nodes > 0
        seconds = round_seconds(terms, learned.get(learned.forward_scale, drafted, 1.0),
                                learned.draft_scale_at(spine))
        return max(seconds + learned.get(learned.residual_s, drafted, 0.0), 0.0)

    def replay_s(self, batch: int, G: int, alpha: float) -> float:
        """Expected replay seconds of a round drafting G at acceptance α under
        the engine's checkpoint policy (`RoundCosts.replay`; 0 where it never
        replays), remembered on a grid of α (REPLAY_GRID)."""
        if self.costs.replay is None or G == 0:
            return 0.0
        key = (round(alpha * REPLAY_GRID), batch, G)
        if key not in self._replay_memo:
            self._replay_memo[key] = self.costs.replay.seconds(batch, G, key[0] / REPLAY_GRID)
        return self._replay_memo[key]

    def _terms(self, batch: int, G: int, sampled: int) -> RoundTerms:
        """The start-up terms of a round drafting G at `batch` with `sampled` sampling rows."""
        if batch not in self._measured_at:
            self._measured_at[batch] = tuple([self.costs.terms(batch, G, kind) for G in range(self.gamma_max + 1)]
                                             for kind in (False, True))
            self._learned_at[batch] = self.learned[self.costs.bucket(batch)]
        greedy, sampling = self._measured_at[batch]
        return mixed_terms(greedy[G], sampling[G], sampled / batch) if sampled else greedy[G]

    def choose(self, seq_ids: list[int], caps: list[int], behind: list[int] | None = None,
               sampled: int = 0) -> list[int]:
        """γ_b for each row (caps[b]: most drafts row b can use; behind[b]: tokens
        the drafter absorbs before drafting for it, None: none; `sampled`: how
        many rows sample, the rest being greedy)."""
        batch = len(seq_ids)
        cost = functools.cache(functools.partial(self.round_cost, batch, sampled=sampled))  # G -> seconds, once each
        plain_cost = cost(0)
        # "no G pays" below, bounded before the per-row work: every row drafting G, all accepted, nothing else charged;
        # only where start-up's prices agree (else a learned price, one outlier round's, would stop probing for good)
        if not any(_pays(G + 1, cost(G), 1.0, plain_cost) for G in range(1, self.gamma_max + 1)) \
                and not self._pays_at_startup(batch, sampled):
            self.goodput = batch / plain_cost if plain_cost > 0 else float(batch)
            return [0] * batch
        behind = [0] * batch if behind is None else behind
        charged = behind if self.absorb_s is not None else [0] * batch  # nothing learned: nothing charged
        engine, sequences = self.engine_acceptance.optimistic(self.prior_alpha), self.sequences  # once per round
        alphas = [engine if (own := sequences.get(s)) is None else own.estimate(engine) for s in seq_ids]
        row_draft = self.costs.row_draft(batch)
        row_cost = row_draft * self.goodput  # in tokens per draft: λ · row_draft_s
        limits = [max(0, min(cap, self._own_limit(a, row_cost))) for a, cap in zip(alphas, caps)]
        top = min(self.gamma_max, max(limits, default=0))
        tokens = [0.0] * (top + 1)  # tokens[G] = Σ_b E[tokens](α_b, min(G, limit_b))
        drafts = [0] * (top + 1)  # Σ_b min(G, limit_b)
        absorb = [0.0] * (top + 1)  # Σ_b of the rows drafting: their share of the absorption
        for alpha, limit, cap, n in zip(alphas, limits, caps, charged):
            term = total = 1.0
            share = n * self.absorb_s / (max(cap, 0) + 1) if n and limit else 0.0
            tokens[0] += 1.0
            for G in range(1, top + 1):
                if G <= limit:
                    term *= alpha
                    total += term
                tokens[G] += total
                drafts[G] += G if G <= limit else limit
                if share:
                    absorb[G] += share * total
        replay = functools.partial(self.replay_s, batch, alpha=sum(alphas) / batch)
        costs = [cost(G) + replay(G) + row_draft * drafts[G] + absorb[G] for G in range(top + 1)]
        options = [(tokens[G] / cost if cost > 0 else tokens[G], G) for G, cost in enumerate(costs)]
        if not any(_pays(batch + drafts[G], costs[G], tokens[0], costs[0]) for G in range(1, top + 1)) \
                and not self._pays_at_startup(batch, sampled):
            self.goodput = options[0][0]  # no G pays even if every draft were accepted: nothing to probe
            return [0] * batch
        goodput, G = max(options, key=lambda option: (option[0], -option[1]))  # fewer drafts on ties
        learned = self.learned[self.costs.bucket(batch)]
        probe = max(1, min(top, self.gamma_max // 2))  # enough drafts to learn from
        if not self.rounds_seen and top > 0 and G < probe:
            G, goodput = probe, options[probe][0]
        elif G == 0 and top > 0 and self.idle_rounds + 1 >= self.probe_every:
            self.goodput = options[probe][0]
            self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)
            if any(behind):  # one row drafts: the one the drafter is least behind (the others' backlogs wait)
                row = min((b for b, limit in enumerate(limits) if limit),
                          key=lambda b: (behind[b], -caps[b], b))
                return [min(probe, limits[b]) if b == row else 0 for b in range(batch)]
            return [min(probe, limit) for limit in limits]
        elif G > 0 and learned.drafting_measured_slower():
            if self.idle_rounds + 1 >= self.probe_every:  # on the probe schedule: draft, to measure drafting again
                self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)
                self.goodput = goodput
                return [min(G, limit) for limit in limits]
            self.goodput = options[0][0]
            return [0] * batch
        elif (G > 0 and self.unpriced_rounds + 1 >= self._plain_probe_wait(learned)
              and learned.drafting_goodput(goodput) < PLAIN_PROBE_MARGIN * options[0][0]):  # a plain step, to price it
            self._plain_probe_pending = True  # (until one teaches: the round after a prefill does not)
            self.goodput = options[0][0]
            return [0] * batch
        elif G > 0:
            self.probe_every = PROBE_EVERY
        self.goodput = goodput
        return [min(G, limit) for limit in limits]

    def _pays_at_startup(self, batch: int, sampled: int) -> bool:
        """Whether some G would pay at full acceptance at start-up's prices (the
        measured terms, nothing learned): where it would, a G that the learned
        prices rule out is still probed on the idle schedule."""
        plain = round_seconds(self._terms(batch, 0, sampled))
        return any(_pays(G + 1, round_seconds(self._terms(batch, G, sampled)), 1.0, plain)
                   for G in range(1, self.gamma_max + 1))

    def _plain_probe_wait(self, learned: _Learned) -> int:
        """Rounds without a priced plain step before one: `PROBE_EVERY` until plain
        steps' goodput is measured (`MIN_REALIZED` rounds), then the doubling wait."""
        return self.plain_probe_every if learned.realized[False].rounds >= MIN_REALIZED else PROBE_EVERY

    def _own_limit(self, alpha: float, row_cost: float) -> int:
        """Most drafts j with α^j ≥ row_cost (the row's marginal gain covers its own cost)."""
        if row_cost <= 0:
            return self.gamma_max
        if alpha <= 0 or row_cost > 1:
            return 0
        if alpha >= 1:
            return self.gamma_max
        return min(self.gamma_max, int(math.log(row_cost) / math.log(alpha)))

    # -- learning -----------------------------------------------------------------------------

    def observe(self, seq_ids: list[int], drafted: list[int], accepted: list[int], gammas: list[int],
                seconds: dict[str, float] | None = None, backlog_tokens: int = 0,
                after_prefill: bool = False, sampled: int = 0, tree: TreeOutcome | None = None) -> None:
        """One round's outcome: per row the drafts asked for (`gammas`),
        proposed and accepted; the round's phase seconds ("draft", "verify",
        "sampling", "commit"; "backlog", the drafter's absorption of
        `backlog_tokens` tokens, apart from "draft") and "round", its whole
        wall time (default: the phases' sum); None: learn acceptance only;
        `after_prefill`: a prefill ran just before the round (its forward's
        time teaches no scale); `sampled`: rows that sampled, as `choose`;
        `tree`: a tree round's outcome (None: a chain round). A tree round
        teaches α along each row's spine (the chain the drafter followed) and
        no chain cost: its price is `spec.tree_auto`'s to learn."""
        total_accepted = total_tried = 0
        along = (drafted, accepted) if tree is None else (tree.spine_drafted, tree.spine_accepted)
        for s, d, n in zip(seq_ids, *along):
            own = self.sequences.setdefault(s, _Acceptance())
            if d == 0:
                own.decay(IDLE_DECAY)
                continue
            tried = n + (1 if n < d else 0)  # drafts up to the first rejection
            own.add(n, tried)
            total_accepted, total_tried = total_accepted + n, total_tried + tried
        if total_tried:
            self.engine_acceptance.add(total_accepted, total_tried)
        else:
            self.engine_acceptance.decay(IDLE_DECAY)
        self.idle_rounds = 0 if max(gammas, default=0) else self.idle_rounds + 1
        self.rounds_seen += 1
        if seconds is not None:
            self.unpriced_rounds += 1
            if tree is None:
                self._learn_costs(len(seq_ids), max(gammas, default=0), seconds, not after_prefill, sampled)
            if not after_prefill:  # its forward runs cold: neither kind's goodput
                self._learn_goodput(len(seq_ids), gammas, accepted, seconds)
            if backlog_tokens > 0 and seconds.get("backlog", 0.0) > 0:
                self.absorb_s = _Learned.mix(self.absorb_s, seconds["backlog"] / backlog_tokens)

    def _learn_costs(self, batch: int, G: int, seconds: dict[str, float], learn_forward: bool = True,
                     sampled: int = 0) -> None:
        terms = self._terms(batch, G, sampled)
        forward, draft = terms.forward_s, terms.draft_s
        learned = self._learned_at[batch]
        if learn_forward and forward > 0 and seconds.get("verify", 0.0) > 0:
            learned.forward_scale[G > 0] = learned.mix_ratio(learned.forward_scale[G > 0], seconds["verify"] / forward)
            if G == 0:
                self.unpriced_rounds = 0
                if self._plain_probe_pending:
                    self.plain_probe_every = min(2 * self.plain_probe_every, MAX_PROBE_EVERY)
                    self._plain_probe_pending = False
        if draft > 0 and seconds.get("draft", 0.0) > 0:
            learned.draft_scale[G] = learned.mix_ratio(learned.draft_scale.get(G), seconds["draft"] / draft)
        phases = seconds.get("draft", 0.0) + seconds.get("verify", 0.0) + seconds.get("sampling", 0.0) \
            + seconds.get("commit", 0.0)
        total = seconds.get("round", phases)  # the whole round, host bookkeeping included
        others = round_seconds(terms, 0.0, 0.0)  # the measured terms besides the forward and the drafter
        others += self.replay_s(batch, G, self.engine_acceptance.estimate(self.prior_alpha))
        # what those terms missed (negative where they overestimate), on top of the observed forward and drafter
        residual = total - seconds.get("verify", 0.0) - (seconds.get("draft", 0.0) if G > 0 else 0.0) - others
        learned.residual_s[G > 0] = learned.mix(learned.residual_s[G > 0], max(residual, -others))

    def _learn_goodput(self, batch: int, gammas: list[int], accepted: list[int], seconds: dict[str, float]) -> None:
        """A round of one kind (every row drafted, or none) teaches its kind's measured goodput."""
        drafting = sum(g > 0 for g in gammas)
        if drafting not in (0, batch) or not batch:
            return
        total = seconds.get("round", sum(seconds.get(p, 0.0) for p in ("draft", "verify", "sampling", "commit")))
        if total > 0:
            self.learned[self.costs.bucket(batch)].realized[drafting > 0].add(batch + sum(accepted), total)

    def forget(self, seq_ids: list[int]) -> None:
        """Finished sequences leave the estimates (the engine-wide one keeps what they taught)."""
        for s in seq_ids:
            self.sequences.pop(s, None)


def _pays(best_tokens: float, cost: float, plain_tokens: float, plain_cost: float) -> bool:
    """Whether a round yielding at most `best_tokens` in `cost` seconds beats
    plain steps' `plain_tokens` in `plain_cost`: tokens per second compared."""
    return best_tokens * plain_cost > plain_tokens * cost
