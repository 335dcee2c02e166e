"""The adaptive verify width: each round, verify as many draft tokens as pays on this machine, or none.

A round at verify width W (draft nodes run through the target; 0 = a plain one-token decode step that skips
the draft) costs C(W) seconds on this machine, backend, model, batch size and cache capacity, and commits
g_b(W) = 1 + (accepted drafts) tokens to row b, never more than the r_b tokens the row has left. Every round the
adaptive width picks the W of the loop's verify buckets that maximises (`objective`)

    makespan (default):  Theta(W) = min_b E[min(g_b(W), r_b)] / r_b / C(W)    over the active rows
    throughput:          Theta(W) = sum_b E[min(g_b(W), r_b)] / C(W)

with E[g_b(W)] = 1 + sum_{j < W} P_b(position j is drafted and accepted). A static batch ends when its last row
does, so a round is worth what it advances the row that would finish last (makespan; with one row both objectives
agree); summing over the rows is the objective of a server that refills finished rows (on a static batch it
verified drafts for rows that then idled: 0.91x AR on GSM8K at batch 8).

Inputs, both known before the target runs:
- C(W): measured in the compiled loop itself (specdec/costs.py: the same loop, forced to one width per pass,
  draft and loop overhead included), cached per machine / model / backend / drafter / batch / capacity.
- P_b: per-row running estimates from that row's own history (counts decayed when their position is observed,
  so a row's estimates follow its text): the acceptance of position j given j-1 was accepted, and how often
  position j is drafted at all (an n-gram miss drafts nothing), kept per evidence class of the draft
  (`Draft.evidence`: prompt lookup's and suffix decoding's match length; an 8-token match is accepted far more
  often than a one-token one).
- Calibration: the rounds that get verified are those whose noisy estimates looked best, a winner's curse that
  grows with the batch. Each verified round records the accepted drafts its estimates expected and the ones it
  accepted; their decayed ratio scales every expected gain. A batch of one row is not calibrated: its own history
  is its feedback, and a ratio updated only by verified rounds stays low after its text turns copy-heavy. The
  totals are reported (`expected_accepted`, `realised_accepted`), so a run shows how far the model was off.
- Exploration: after `explore_every` rounds in a row that verified nothing, one round verifies at the narrowest
  non-zero width, so a row whose text turns copy-heavy is noticed. A verified round whose accepted drafts do not
  pay for its width doubles that gap (up to `explore_max`) and one that pays resets it; the gap is never shorter
  than the exploring round's extra cost allows (`explore_budget` of the plain rounds' time).

A width > 0 must beat width 0 by `margin`: the measured costs are good to a few percent, so a predicted gain
smaller than that is as likely a loss.

Two decisions per round (the Scheduler protocol, specdec/scheduler.py):
1. `plan`, before drafting, from the history alone: if W = 0 wins the draft is skipped (any drafter: it catches
   up on the skipped rounds' tokens before it drafts again, `Drafter.update`), unless the draft costs at most
   `free_draft` of a plain round and `refine` will look at it: then it is always made.
2. `refine`, after drafting, for deterministic drafts (probs=None: n-gram, suffix, top-k trees) or greedy
   decoding: the actual draft lengths replace the drafted-rate estimates and the draft's cost is sunk, so W is
   chosen again (down to 0); for drafts sampled at temperature > 0 the planned W stands. A tree is verified
   whole or not at all, unless its nodes are in priority order (`Drafter.ordered_tree`), when a prefix may be
   verified, valued by the levels it reaches or (`tree_value: nodes`) by its nodes, each with its own history.
   With `score_bins` a drafted tree's nodes are valued by the drafter's own estimate (`Draft.scores`),
   calibrated per row by what nodes of that score realised.
The evidence for each default is in docs/DECISIONS.md.

Why this is lossless: whether draft position j is verified depends only on the past (history counts, the
calibration and the tokens each row has left, all from rounds already committed), the machine's costs and, in
`refine`, on draft lengths, tree shapes and node scores that are deterministic functions of the committed
context. It never depends on the sampled value of a draft token, so rejection sampling stays exact (the DSpark
paper's appendix A shows what goes wrong otherwise; specdec/scheduling.py). Under greedy decoding any choice is
exact.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np

from specdec import costs, trees
from specdec.drafter import RoundContext
from specdec.errors import require
from specdec.scheduler import Scheduler, bucket_widths



@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AdaptiveState:
    """Per-row history (decayed counts: acceptance float32 [B, C, N] per evidence class, drafted rates [B, N]),
    the measured costs and the loop's cost accounting."""

    hits: jax.Array  # [B, C, N] position j accepted, in rounds of evidence class c where j was verified and j-1
    reached: jax.Array  # accepted ("reached")
    drafted: jax.Array  # position j drafted (valid), in rounds that drafted
    drafts: jax.Array  # rounds that drafted ([B, 1])
    round_cost: jax.Array  # float32 [K] seconds of a round at widths[k] (k = 0: no draft)
    draft_cost: jax.Array  # float32 [] seconds a draft adds to a round (sunk once drafted)
    # what the round being verified drafted (set by `refine`, read by `observe`)
    last_drafted_levels: jax.Array  # bool [B, N] depths the drafter proposed, before the width cut
    last_drafted: jax.Array  # bool []
    last_class: jax.Array  # int32 [B] the draft's evidence class (`Draft.evidence`; 0 without one)
    last_parents: jax.Array  # int32 [B, N] the last drafted tree's parents: the shape `plan` expects (nodes model)
    last_scores: jax.Array  # float32 [B, N] the last drafted tree's `Draft.scores` (-1: none; `score_bins`)
    # `score_bins`: per row, evidence class and bin of the drafter's node scores, the scores of the nodes observed
    # (expected acceptances) and the nodes accepted, decayed per observation: their ratio calibrates the scores
    score_expected: jax.Array  # float32 [B, C, S]
    score_realised: jax.Array  # float32 [B, C, S]
    # accounting over the whole loop (the cost model's prediction, printed next to the measured time)
    width_rounds: jax.Array  # int32 [K] loop iterations per verify width
    skipped_drafts: jax.Array  # int32 [] iterations that skipped the draft
    predicted_seconds: jax.Array  # float32 []
    quiet_rounds: jax.Array  # int32 [] consecutive iterations that verified nothing (exploration clock)
    explore_gap: jax.Array  # int32 [] quiet iterations before the next exploring round (backs off on failures)
    # the acceptance model's own check: accepted drafts it expected (uncalibrated) in the round being verified
    # by draft position, both summed over the loop's verified rounds, and both decayed per verified round by
    # draft position (the calibration)
    round_expected: jax.Array  # float32 [N]
    # accepted drafts the round being verified needs to pay for its width: active rows x (C(W) / C(0) - 1)
    round_break_even: jax.Array  # float32 []
    expected_accepted: jax.Array  # float32 []
    realised_accepted: jax.Array  # float32 []
    calib_expected: jax.Array  # float32 [N]
    calib_realised: jax.Array  # float32 [N]


# The prior acceptance / drafted rate of a position with no history, in pseudo-rounds of weight PRIOR_WEIGHT.
# Optimistic, so a row tries the draft from its first rounds; after that its own observations dominate, and
# exploration (not the prior) makes a row that stopped verifying try again. A fresh row starts from the prior, not
# from the drafter's earlier requests: acceptance varies more between prompts than between classes. Constants, not
# knobs: on held-out prompts a prior of 0.75 or a weight of 0.5 moved the replayed speedup by under 0.5%
# (docs/DECISIONS.md); a pessimistic prior (0.5) cost the hybrid 14% on its tuned sets.
PRIOR = 1.0
PRIOR_WEIGHT = 1.0


@dataclasses.dataclass(frozen=True)
class AdaptiveWidth(Scheduler):
    """The adaptive verify width (the module docstring), config `scheduler.kind: adaptive`. Its fields are the
    section's keys; static (hashable: part of the compiled loop's identity)."""

    kind: ClassVar[str] = "adaptive"
    may_skip: ClassVar[bool] = True
    measured_in_loop: ClassVar[bool] = True

    # Each knob's value and the measurement behind it: docs/DECISIONS.md.
    decay: float = 0.9  # decay of a history count each time its position is observed (memory ~ 10 observations)
    # A deeper position's prior is the estimate of the position before it times this factor, so a fresh class's
    # first draft is tried at a narrow width and widens as deeper positions are accepted (at 1.0 a fresh class
    # valued every depth as its first and verified the widest draft on open chat).
    prior_depth: float = 0.8
    explore_every: int = 8  # verify (the narrowest width > 0) after this many rounds in a row that verified nothing
    explore_max: int = 64  # the gap doubles after each verified round whose drafts did not pay, up to this
    # An exploring round costs C(narrowest) - C(0) more than a plain one; explore at most every
    # (C(narrowest) / C(0) - 1) / explore_budget rounds, so exploring spends at most this share of the plain
    # rounds' time (within [explore_every, explore_max]; a batch-8 suffix round costs ~1.7 plain ones). 0: no floor.
    explore_budget: float = 0.02
    # Verify only if the expected tokens/s beat a plain step's by this factor: the costs are measured to a few
    # percent, so a width predicted to win by less is as likely to lose.
    margin: float = 0.05
    # Calibration (the module docstring): the realised / expected accepted drafts of the verified rounds, decayed
    # by `calibration_decay` per verified round from `calibration_weight` pseudo-tokens at ratio 1, scales every
    # expected gain; only for batches of at least `calibration_min_batch` rows. Weight 0 turns it off.
    calibration_decay: float = 0.95
    calibration_weight: float = 4.0
    calibration_min_batch: int = 2
    # Always draft (and let `refine` choose the width from the draft) when a draft costs at most this fraction of
    # a plain round and `refine` may look at it, in batches of at most `free_draft_max_batch` rows: prompt lookup
    # (~1% of a round) then verifies its long matches even after a row's history of short ones said to skip. At
    # batch 8 drafting every round let the rows' matches buy widths that lost (0.91x AR). 0: decide from history.
    free_draft: float = 0.03
    free_draft_max_batch: int = 1
    # "makespan": value a round by the progress of the row that would finish last (a static batch, as
    # `speculative_generate` decodes); "throughput": by the tokens it commits over all rows (a server that refills
    # finished rows).
    objective: Literal["makespan", "throughput"] = "makespan"
    # Measure the round costs again even if cached, once per process (a sitting): on a shared VM the widths' cost
    # ratios drift ~10% within an hour, and a stale profile over-verifies.
    reprofile: bool = False
    # Round costs given instead of measured: seconds per round at each verify width (the loop's widths, 0 first)
    # and what a draft adds, e.g. to replay a run with another machine's costs, or in tests. None: measure (cached).
    round_costs: tuple[float, ...] | None = None
    draft_cost: float = 0.0
    cost_path: str | None = None  # JSON cache of measured round costs (default: the specdec cache dir)
    # How a prefix of a best-first tree (`Drafter.ordered_tree`) is valued. "levels": by the levels it reaches, the
    # history kept per draft depth, so breadth (a second guess beside the first, the lookup's branch beside the
    # drafter's) is never bought. "nodes": the history is kept per node index (node i's acceptance given its
    # parent's), a node is worth the product along its path, and a prefix the sum over its nodes (its expected
    # accepted drafts, exact under greedy verification). For a chain both are the same model.
    tree_value: Literal["levels", "nodes"] = "levels"
    # With the nodes model: value a drafted deterministic tree by the drafter's own estimate of each node's
    # acceptance (`Draft.scores`), times the row's realised / expected acceptance of the nodes whose scores fell in
    # the same bin (edges in (0, 1)): this round's draft says whether it is worth verifying, the history only what
    # rounds like it were worth. Nodes without a score (the hybrid's lookup) keep the history. None: off; []: one
    # ratio for all scores.
    score_bins: tuple[float, ...] | None = None

    def __post_init__(self):
        require(0.0 <= self.decay < 1.0, "decay", f"must be in [0, 1), got {self.decay!r}")
        require(0.0 < self.prior_depth <= 1.0, "prior_depth", f"must be in (0, 1], got {self.prior_depth!r}")
        require(self.explore_every >= 1, "explore_every", f"must be >= 1, got {self.explore_every!r}")
        require(self.explore_max >= self.explore_every, "explore_max",
                f"must be >= explore_every ({self.explore_every!r}), got {self.explore_max!r}")
        require(0.0 <= self.explore_budget < 1.0, "explore_budget", f"must be in [0, 1), got {self.explore_budget!r}")
        require(0.0 <= self.margin < 1.0, "margin", f"must be in [0, 1), got {self.margin!r}")
        require(0.0 <= self.calibration_decay < 1.0, "calibration_decay",
                f"must be in [0, 1), got {self.calibration_decay!r}")
        require(self.calibration_weight >= 0, "calibration_weight", f"must be >= 0, got {self.calibration_weight!r}")
        require(self.calibration_min_batch >= 1, "calibration_min_batch",
                f"must be >= 1, got {self.calibration_min_batch!r}")
        require(0.0 <= self.free_draft < 1.0, "free_draft", f"must be in [0, 1), got {self.free_draft!r}")
        require(self.free_draft_max_batch >= 1, "free_draft_max_batch",
                f"must be >= 1, got {self.free_draft_max_batch!r}")
        require(self.objective in ("makespan", "throughput"), "objective",
                f"must be 'makespan' or 'throughput', got {self.objective!r}")
        require(self.tree_value in ("levels", "nodes"), "tree_value",
                f"must be 'levels' or 'nodes', got {self.tree_value!r}")
        if self.score_bins is not None:
            edges = tuple(self.score_bins)
            require(all(isinstance(e, (int, float)) and 0.0 < e < 1.0 for e in edges)
                    and list(edges) == sorted(set(edges)), "score_bins",
                    f"must be increasing edges in (0, 1), got {self.score_bins!r}")
            object.__setattr__(self, "score_bins", tuple(float(e) for e in edges))
        if self.round_costs is not None:
            object.__setattr__(self, "round_costs", tuple(float(c) for c in self.round_costs))
            require(len(self.round_costs) > 0 and all(c > 0 for c in self.round_costs), "round_costs",
                    f"must be seconds > 0 per verify width, got {self.round_costs!r}")
        require(self.draft_cost >= 0, "draft_cost", f"must be >= 0 seconds, got {self.draft_cost!r}")

    # -- the Scheduler protocol (specdec/scheduler.py) -----------------------------------------------------

    def verify_widths(self, num_draft_tokens: int, buckets) -> tuple[int, ...]:
        """The verify buckets ("auto" unless given) plus width 0: a plain decode step is always a choice."""
        return tuple(sorted({0, *(bucket_widths(num_draft_tokens, buckets) or
                                  bucket_widths(num_draft_tokens, "auto"))}))

    def prepare(self, probe):
        """(round_cost per verify width, draft_cost): given (`round_costs`), else measured in the loop (cached)."""
        if self.round_costs is None:
            widths = probe.spec.verify_widths  # the forced runs' own decisions are overridden: any costs do
            return costs.round_costs(probe, (np.ones(len(widths)), 0.0), self.cost_path, self.reprofile)
        widths = probe.spec.verify_widths
        if len(self.round_costs) != len(widths):
            raise ValueError(f"scheduler.round_costs gives {len(self.round_costs)} round costs, but this loop's "
                             f"verify widths are {list(widths)}: give one cost per width")
        return self.round_costs, self.draft_cost

    def plan(self, spec, state) -> jax.Array:
        # `refine` will see the draft when decoding is greedy or the draft deterministic, so a draft that costs next
        # to nothing is always made (`free_draft`): never for a host-side drafter, whose every drafted round is a
        # host round trip where its plain rounds run in compiled bursts (its profiled draft cost, the difference of
        # two loop timings, read 0.7-6.4 ms; at 0.7 ms suffix decoding counted as free, drafted every round and
        # lost 17% on open chat).
        drafter = spec.drafter
        look = (spec.sampling.greedy or drafter.deterministic) and drafter.jittable
        ctx = RoundContext(seq=state.seq, seq_len=state.seq_len, done=state.done)
        return self.plan_width(state.sched, spec.verify_widths, ~state.done, drafter.kind == "tree", look,
                               remaining=state.limit - state.num_new, ordered=drafter.ordered_tree,
                               evidence=drafter.evidence_before_draft(ctx))

    def refine(self, spec, state, draft, planned, drafted):
        # The draft's lengths may steer the width under greedy decoding, and when sampling only if the draft is
        # deterministic (probs=None: a function of the committed context, never of this round's random draws).
        look = spec.sampling.greedy or draft.probs is None
        return self.refine_width(state.sched, draft, planned, drafted, spec.verify_widths, ~state.done, look,
                                 spec.drafter.kind == "tree", remaining=state.limit - state.num_new,
                                 ordered=spec.drafter.ordered_tree)

    def observe(self, spec, state, draft, depth, result, active):
        if self.values_nodes(spec.drafter.kind == "tree", spec.drafter.ordered_tree):  # per node index
            return self.observe_round(state.sched, draft.valid, result.num_accepted, active, path=result.path,
                                      parents=draft.parents)
        return self.observe_round(state.sched, trees.levels_present(draft.valid, depth), result.num_accepted,
                                  active)  # per draft depth

    def skipped(self, spec, state):
        return self.record_skip(state.sched, ~state.done)

    def metrics(self, spec, sched) -> dict:
        """Its choices and its cost model's prediction of the decode time (in the profile's seconds)."""
        return {"verify_widths": list(spec.verify_widths), "width_rounds": np.asarray(sched.width_rounds).tolist(),
                "skipped_drafts": int(sched.skipped_drafts), "predicted_seconds": float(sched.predicted_seconds),
                "round_costs": np.asarray(sched.round_cost).tolist(), "draft_cost": float(sched.draft_cost),
                "expected_accepted": float(sched.expected_accepted),
                "realised_accepted": float(sched.realised_accepted)}

    # -- state -------------------------------------------------------------------------------------------

    def init_state(self, batch: int, num_nodes: int, classes: int, measured) -> AdaptiveState:
        """A fresh history for `batch` rows, `num_nodes` draft positions and `classes` evidence classes
        (`Drafter.evidence_classes`), with `measured` = (round_cost per verify width, draft_cost)."""
        round_cost, draft_cost = measured
        k = len(round_cost)
        def zeros(*shape):  # a fresh buffer per field: the loop donates its state, and a buffer can be donated once
            return jnp.zeros((batch, *shape, num_nodes), jnp.float32)

        return AdaptiveState(
            hits=zeros(classes), reached=zeros(classes), drafted=zeros(), drafts=jnp.zeros((batch, 1), jnp.float32),
            round_cost=jnp.asarray(round_cost, jnp.float32), draft_cost=jnp.asarray(draft_cost, jnp.float32),
            last_drafted_levels=jnp.zeros((batch, num_nodes), bool),
            last_drafted=jnp.asarray(False), last_class=jnp.zeros((batch,), jnp.int32),
            last_parents=jnp.broadcast_to(jnp.arange(num_nodes, dtype=jnp.int32) - 1, (batch, num_nodes)),
            last_scores=jnp.full((batch, num_nodes), -1.0, jnp.float32),
            score_expected=jnp.zeros((batch, classes, self.num_score_bins), jnp.float32),
            score_realised=jnp.zeros((batch, classes, self.num_score_bins), jnp.float32),
            width_rounds=jnp.zeros((k,), jnp.int32), skipped_drafts=jnp.zeros((), jnp.int32),
            predicted_seconds=jnp.zeros((), jnp.float32), quiet_rounds=jnp.zeros((), jnp.int32),
            explore_gap=jnp.asarray(self.explore_every, jnp.int32),
            round_expected=jnp.zeros((num_nodes,), jnp.float32), round_break_even=jnp.zeros((), jnp.float32),
            expected_accepted=jnp.zeros((), jnp.float32), realised_accepted=jnp.zeros((), jnp.float32),
            calib_expected=jnp.zeros((num_nodes,), jnp.float32), calib_realised=jnp.zeros((num_nodes,), jnp.float32))

    @property
    def num_score_bins(self) -> int:
        return 1 if self.score_bins is None else len(self.score_bins) + 1

    def _score_bin(self, scores: jax.Array) -> jax.Array:
        """int32, the bin of each score (`score_bins`)."""
        if not self.score_bins:
            return jnp.zeros(scores.shape, jnp.int32)
        edges = jnp.asarray(self.score_bins, jnp.float32)
        return jnp.searchsorted(edges, scores, side="right").astype(jnp.int32)

    def scored_acceptance(self, st: AdaptiveState, evidence: jax.Array, scores: jax.Array) -> jax.Array:
        """[B, N]: each node's score times its row's realised / expected acceptance in the score's bin and the
        draft's evidence class (`score_bins`), at most 1."""
        pick = jax.nn.one_hot(evidence, st.score_expected.shape[1], dtype=jnp.float32)[:, :, None]  # [B, C, 1]
        expected, realised = jnp.sum(st.score_expected * pick, axis=1), jnp.sum(st.score_realised * pick, axis=1)
        ratio = (realised + PRIOR_WEIGHT) / (expected + PRIOR_WEIGHT)  # [B, S]
        return jnp.minimum(scores * jnp.take_along_axis(ratio, self._score_bin(scores), axis=1), 1.0)

    def _rate(self, num, den, prior=None):
        prior = PRIOR if prior is None else prior
        return (num + PRIOR_WEIGHT * prior) / (den + PRIOR_WEIGHT)

    def acceptance(self, st: AdaptiveState, evidence: jax.Array | None = None) -> jax.Array:
        """P(position j accepted | j verified and j-1 accepted), per row: [B, N], from the row's history in the
        draft's evidence class `evidence` [B] (None: pooled over the classes, what is known before drafting).
        Position 1's prior is `prior`; a deeper position's prior is the estimate of the position before it (times
        `prior_depth`), so positions a row never reaches (every draft rejected early) inherit its poor early
        estimate instead of an optimistic constant. Each class starts from the optimistic prior, so a row whose
        open text taught it that one-token matches fail still tries its first 8-token match. (Starting the
        classes without history from the row's other classes instead cost summarise tau 1.72 -> 1.26 on the
        quickstart and gained nothing on chat.)"""
        if evidence is None:
            hits, reached = jnp.sum(st.hits, axis=1), jnp.sum(st.reached, axis=1)
        else:
            pick = jax.nn.one_hot(evidence, st.hits.shape[1], dtype=st.hits.dtype)[:, :, None]  # [B, C, 1]
            hits, reached = jnp.sum(st.hits * pick, axis=1), jnp.sum(st.reached * pick, axis=1)
        prior = jnp.full(hits.shape[:1], PRIOR, jnp.float32)
        rates = []
        for j in range(hits.shape[1]):  # static loop over draft positions
            rate = self._rate(hits[:, j], reached[:, j], prior)
            rates.append(rate)
            prior = rate * self.prior_depth
        return jnp.stack(rates, axis=1)

    def survival(self, st: AdaptiveState, evidence: jax.Array | None = None,
                 parents: jax.Array | None = None, scores: jax.Array | None = None) -> jax.Array:
        """P(positions 1..j all accepted | drafted), from the conditional estimates: [B, N] (0 past a row's
        With `parents` [B, N] (the nodes model, `tree_value`): P(node i and its ancestors all
        accepted), the estimates taken per node index, or for the nodes with `scores` >= 0 [B, N] (a drafted
        tree's `Draft.scores`, with `score_bins`) from their calibrated scores."""
        accept = self.acceptance(st, evidence)
        if scores is not None:
            accept = jnp.where(scores >= 0, self.scored_acceptance(st, evidence, scores), accept)
        survival = jnp.cumprod(accept, axis=1) if parents is None else path_products(accept, parents)
        return survival

    def calibration(self, st: AdaptiveState) -> jax.Array:
        """[N]: realised / expected accepted drafts at each draft position over the recent verified rounds (one
        ratio for all positions with `calibration_per_position` off; 1 with no evidence, when
        `calibration_weight` is 0, or for a batch below `calibration_min_batch` rows)."""
        n = st.calib_expected.shape[0]
        if self.calibration_weight == 0 or st.hits.shape[0] < self.calibration_min_batch:
            return jnp.ones((n,), jnp.float32)
        w = self.calibration_weight
        return jnp.full((n,), (jnp.sum(st.calib_realised) + w) / (jnp.sum(st.calib_expected) + w))

    # -- decisions ---------------------------------------------------------------------------------------

    def _best(self, value: jax.Array, cost: jax.Array, allowed: jax.Array) -> jax.Array:
        """argmax_k value[k] / cost[k] over allowed widths (ties: the narrower); a width > 0 (index > 0) must
        beat width 0 by the factor 1 + margin."""
        theta = value / jnp.maximum(cost, 1e-9)
        theta = theta / jnp.where(jnp.arange(theta.shape[0]) > 0, 1.0 + self.margin, 1.0)
        return jnp.argmax(jnp.where(allowed, theta, -jnp.inf)).astype(jnp.int32)

    def _allowed(self, st: AdaptiveState, widths, num_nodes: int, tree: bool, ordered: bool) -> jax.Array:
        w = jnp.asarray(widths)
        # a tree is verified whole or not at all, unless its nodes are in priority order (`ordered`: any prefix
        # of them is a tree, and the best of its size)
        allowed = (w == 0) | (w == num_nodes) if tree and not ordered else jnp.ones(w.shape, bool)
        # An exploring round must verify something, and verifies the narrowest width allowed: it is there to
        # learn whether drafts are accepted again, and at batch 8 a wide round costs ~1.5 plain steps where the
        # narrowest costs ~1.1 (every row pays for the batch's exploration). A hit resets the gap and the next
        # plan widens on the evidence.
        narrowest = jnp.min(jnp.where(allowed & (w > 0), w, jnp.iinfo(jnp.int32).max))
        exploring = st.quiet_rounds >= jnp.maximum(st.explore_gap, self._explore_floor(st, w == narrowest))
        return jnp.where(exploring, allowed & (w == narrowest), allowed)

    def _explore_floor(self, st: AdaptiveState, is_narrowest: jax.Array) -> jax.Array:
        """Quiet rounds before an exploring round may run, from its extra cost (`explore_budget`)."""
        if self.explore_budget == 0:
            return jnp.asarray(self.explore_every, jnp.int32)
        extra = jnp.max(jnp.where(is_narrowest, st.round_cost, 0.0)) / st.round_cost[0] - 1.0
        floor = jnp.ceil(jnp.maximum(extra, 0.0) / self.explore_budget - 1e-3)  # 1e-3: float32 rounding
        return jnp.clip(floor, self.explore_every, self.explore_max).astype(jnp.int32)

    def values_nodes(self, tree: bool, ordered: bool) -> bool:
        """Whether a draft's history is kept per node index (`tree_value: nodes`, best-first trees) rather than
        per depth."""
        return tree and ordered and self.tree_value == "nodes"

    def _expected_by_width(self, st: AdaptiveState, widths, remaining, evidence=None, parents=None) -> jax.Array:
        """[B, K, N]: P(position j drafted and accepted) per row, for the positions a verify width of widths[k]
        covers and the row can still commit (j < r_b - 1: the round's own token comes first), 0 elsewhere;
        before drafting and uncalibrated. `evidence` [B]: the draft's evidence class if known before drafting
        (`Drafter.evidence_before_draft`), else None (pooled over the classes)."""
        gain = self._rate(st.drafted, st.drafts) * self.survival(st, evidence, parents)  # [B, N]
        upto = jnp.minimum(jnp.asarray(widths)[None, :], _room(remaining, gain.shape))  # [B, K]
        covered = jnp.arange(gain.shape[1])[None, None, :] < upto[:, :, None]  # [B, K, N]
        return jnp.where(covered, gain[:, None, :], 0.0)

    def _value(self, st: AdaptiveState, expected: jax.Array, active: jax.Array, remaining) -> jax.Array:
        """[K]: what a round at each width is worth (calibrated expected tokens; `objective`): the smallest
        fraction of its remaining tokens it commits to an active row (makespan), or the tokens it commits over
        the active rows (throughput)."""
        accepted = jnp.sum(expected * self.calibration(st)[None, None, :], axis=2)  # [B, K]
        tokens = 1.0 + accepted
        if self.objective == "throughput":
            return jnp.sum(jnp.where(active[:, None], tokens, 0.0), axis=0)
        left = jnp.ones_like(tokens) if remaining is None else jnp.maximum(remaining, 1)[:, None]
        progress = jnp.min(jnp.where(active[:, None], tokens / left, jnp.inf), axis=0)
        return jnp.where(jnp.any(active), progress, 1.0)  # no active row: any width (the loop is ending)

    def plan_width(self, st: AdaptiveState, widths: tuple[int, ...], active: jax.Array, tree: bool,
             look: bool = False, remaining: jax.Array | None = None, ordered: bool = False,
             evidence: jax.Array | None = None) -> jax.Array:
        """Index into `widths` to draft for, from the history alone (0: skip the draft). With `look` (`refine`
        will see the draft: a deterministic draft, or greedy decoding) a draft that costs at most `free_draft`
        of a plain round is always made: then `refine` chooses from the draft itself (its length, its evidence
        class), which the history cannot foresee, for next to nothing. `remaining` int32 [B]: the tokens each
        row may still commit (None: unbounded). `ordered` (trees): the drafter's nodes are in priority order
        (`Drafter.ordered_tree`), so a prefix of them may be verified. `evidence` int32 [B]: the coming draft's
        evidence class where the drafter knows it before drafting (`Drafter.evidence_before_draft`; None: the
        history pooled over the classes)."""
        n = st.hits.shape[2]
        if evidence is not None:
            evidence = jnp.clip(evidence, 0, st.hits.shape[1] - 1)
        parents = st.last_parents if self.values_nodes(tree, ordered) else None
        value = self._value(st, self._expected_by_width(st, widths, remaining, evidence, parents), active, remaining)
        best = self._best(value, st.round_cost, self._allowed(st, widths, n, tree, ordered))
        if look and self.free_draft > 0 and st.hits.shape[0] <= self.free_draft_max_batch:
            free = st.draft_cost <= self.free_draft * st.round_cost[0]
            best = jnp.where(free & (best == 0), len(widths) - 1, best)
        return best

    def refine_width(self, st: AdaptiveState, draft, planned: jax.Array, drafted: jax.Array, widths: tuple[int, ...],
               active: jax.Array, look: bool, tree: bool, remaining: jax.Array | None = None,
               ordered: bool = False):
        """The draft cut to the round's verify width, and the state recording what this round does.

        `drafted`: whether the drafter ran. `look` (static): the draft's lengths may steer the width
        (deterministic drafts, or greedy decoding). `remaining`, `ordered`: as in `plan`."""
        n = draft.num_nodes
        w = jnp.asarray(widths, jnp.int32)
        valid = draft.valid
        evidence = (jnp.zeros(valid.shape[:1], jnp.int32) if draft.evidence is None
                    else jnp.clip(draft.evidence, 0, st.hits.shape[1] - 1))
        nodes = self.values_nodes(tree, ordered)
        if tree:  # a valid node's depth does not depend on which other nodes are valid (its ancestors are)
            _, depth = trees.tree_attention(draft.parents, valid)
            drafted_levels = draft.valid if nodes else trees.levels_present(draft.valid, depth)
        else:
            drafted_levels = draft.valid
        k = planned
        parents = draft.parents if nodes else None
        # [B, K, N] per row and position (node), uncalibrated
        expected = self._expected_by_width(st, widths, remaining, parents=parents)
        if look:
            # [B, K]: the draft positions (tree levels) a round at each width reaches
            if nodes:  # a prefix of w nodes: each valid node within reach of the tokens left, by its path
                room = _room(remaining, valid.shape)[:, :, None]  # [B, 1, 1]
                covered = ((jnp.arange(n)[None, None, :] < w[None, :, None]) & valid[:, None, :]
                           & (depth[:, None, 1:] <= room))
            elif not tree:  # the drafted prefix, cut to the width
                lead = jnp.sum(jnp.cumprod(valid.astype(jnp.int32), axis=1), axis=1)
                upto = jnp.minimum(w[None, :], lead[:, None])
            elif ordered:  # a prefix of w nodes reaches the deepest level among them
                levels = jnp.where(valid, depth[:, 1:], 0)  # [B, N]
                reach = jnp.concatenate([jnp.zeros_like(levels[:, :1]), jax.lax.cummax(levels, axis=1)], axis=1)
                upto = reach[:, w]
            else:  # the whole tree: the levels it reaches, if verified at all
                lead = jnp.max(jnp.where(valid, depth[:, 1:], 0), axis=1)
                upto = jnp.minimum(w[None, :], lead[:, None])
            if not nodes:
                upto = jnp.minimum(upto, _room(remaining, valid.shape))
                covered = jnp.arange(n)[None, None, :] < upto[:, :, None]  # [B, K, N]
            survival = self.survival(st, evidence, parents, self._draft_scores(draft, nodes))[:, None, :]
            expected = jnp.where(drafted, jnp.where(covered, survival, 0.0), expected)
            value = self._value(st, expected, active, remaining)
            verify_only = jnp.where(w > 0, st.round_cost - st.draft_cost, st.round_cost)  # the draft is paid
            k = jnp.where(drafted, self._best(value, verify_only, self._allowed(st, widths, n, tree, ordered)),
                          planned)
        if tree and not ordered:  # a tree is verified whole or not at all
            keep = valid & (w[k] > 0) & drafted
        else:
            keep = valid & (jnp.arange(n)[None, :] < w[k]) & drafted
        last = jnp.max(jnp.where(keep & active[:, None], jnp.arange(1, n + 1)[None, :], 0))
        ran = jnp.searchsorted(w, last).astype(jnp.int32)  # the bucket the verify step will run
        cost = jnp.where(drafted, jnp.where(ran > 0, st.round_cost[ran], st.draft_cost + st.round_cost[0]),
                         st.round_cost[0])
        round_expected = jnp.sum(jnp.where(active[:, None], expected[:, k], 0.0), axis=0)
        st = self._record(st, active, ran, cost, drafted, drafted_levels & drafted, evidence, round_expected)
        if nodes:  # the shape the next plan expects
            st = dataclasses.replace(st, last_parents=jnp.where(drafted, draft.parents.astype(jnp.int32),
                                                                st.last_parents))
        scores = self._draft_scores(draft, nodes)
        if scores is not None:  # what `observe` calibrates the scores with
            st = dataclasses.replace(st, last_scores=jnp.where(drafted, scores, -1.0))
        return dataclasses.replace(draft, valid=keep), st

    def _draft_scores(self, draft, nodes: bool) -> jax.Array | None:
        """The draft's node scores where `score_bins` values them (the nodes model), else None."""
        if self.score_bins is None or not nodes or draft.scores is None:
            return None
        return jnp.where(draft.valid, draft.scores.astype(jnp.float32), -1.0)

    def record_skip(self, st: AdaptiveState, active: jax.Array) -> AdaptiveState:
        """What `refine` records for a round that skipped the draft, without a draft to refine (the loop of plain
        decode rounds)."""
        b, n = st.last_drafted_levels.shape
        return self._record(st, active, jnp.asarray(0, jnp.int32), st.round_cost[0], jnp.asarray(False),
                            jnp.zeros((b, n), bool), jnp.zeros((b,), jnp.int32), jnp.zeros((n,), jnp.float32))

    def _record(self, st: AdaptiveState, active, ran, cost, drafted, drafted_levels, evidence,
                round_expected) -> AdaptiveState:
        """The state after choosing a round: it runs verify bucket `ran` at predicted `cost` seconds; what was
        drafted (read by `observe`); the accepted drafts the uncalibrated estimates expect of it [N]."""
        any_active = jnp.any(active)
        return dataclasses.replace(
            st, last_drafted_levels=drafted_levels, last_drafted=drafted, last_class=evidence,
            width_rounds=st.width_rounds.at[ran].add(any_active.astype(jnp.int32)),
            skipped_drafts=st.skipped_drafts + (any_active & ~drafted).astype(jnp.int32),
            predicted_seconds=st.predicted_seconds + jnp.where(any_active, cost, 0.0),
            quiet_rounds=jnp.where(ran > 0, 0, st.quiet_rounds + any_active.astype(jnp.int32)),
            round_expected=jnp.where(ran > 0, round_expected, 0.0),
            round_break_even=jnp.sum(active) * (st.round_cost[ran] / st.round_cost[0] - 1.0))

    def observe_round(self, st: AdaptiveState, verified: jax.Array, num_accepted: jax.Array,
                active: jax.Array, path: jax.Array | None = None, parents: jax.Array | None = None) -> AdaptiveState:
        """Fold one verified round into each active row's history. `verified` [B, N]: the depths the target
        verified (`trees.levels_present` of the draft as verified); for the nodes model (`values_nodes`) the
        nodes it verified, with the accepted `path` [B, N] (node indices, -1 padded) and the tree's `parents`:
        node i is then observed when its parent was accepted, and accepted when it is on the path. A count
        decays only when its position is observed (acceptance: reached; drafted rates: a round that drafted), so
        what a row learnt is kept while it skips the draft; finished rows keep their counts. A round that
        verified something sets the exploration gap: back to `explore_every` if the drafts it accepted paid for
        its width (break-even: active rows x (C(W) / C(0) - 1) accepted drafts), else doubled."""
        was_drafted = st.last_drafted_levels
        pos = jnp.arange(verified.shape[1])[None, :]
        if path is None:
            reached = verified & (pos <= num_accepted[:, None]) & active[:, None]  # j verified and j-1 accepted
            hit = reached & (pos < num_accepted[:, None])
        else:
            on_path = jnp.any(path[:, None, :] == pos[:, :, None], axis=2)  # [B, N]
            above = jnp.take_along_axis(on_path, jnp.clip(parents, 0, None), axis=1)
            reached = verified & ((parents < 0) | above) & active[:, None]
            hit = reached & on_path
        in_class = jax.nn.one_hot(st.last_class, st.hits.shape[1], dtype=bool)[:, :, None]  # [B, C, 1]
        class_reached, class_hit = in_class & reached[:, None, :], in_class & hit[:, None, :]
        g_seen = jnp.where(class_reached, self.decay, 1.0)
        did = (st.last_drafted & active)[:, None]
        g_drafted = jnp.where(did, self.decay, 1.0)
        # the acceptance model's check: what this round realised against what it was expected to (if verified)
        checked = jnp.any(reached)
        realised = jnp.sum(hit, axis=0, dtype=jnp.float32)  # [N] by draft position
        paid = jnp.any(hit) & (jnp.sum(realised) >= st.round_break_even)
        gap = jnp.where(paid, self.explore_every, jnp.minimum(2 * st.explore_gap, self.explore_max))
        g_calib = jnp.where(checked, self.calibration_decay, 1.0)
        return dataclasses.replace(
            st, explore_gap=jnp.where(checked, gap, st.explore_gap).astype(jnp.int32),
            expected_accepted=st.expected_accepted + jnp.where(checked, jnp.sum(st.round_expected), 0.0),
            realised_accepted=st.realised_accepted + jnp.where(checked, jnp.sum(realised), 0.0),
            calib_expected=g_calib * st.calib_expected + jnp.where(checked, st.round_expected, 0.0),
            calib_realised=g_calib * st.calib_realised + jnp.where(checked, realised, 0.0),
            hits=g_seen * st.hits + class_hit, reached=g_seen * st.reached + class_reached,
            drafted=g_drafted * st.drafted + (did & was_drafted), drafts=g_drafted * st.drafts + did,
            **self._observe_scores(st, reached, hit, in_class))

    def _observe_scores(self, st: AdaptiveState, reached, hit, in_class) -> dict:
        """`score_bins`: the scored nodes observed this round, by bin ([B, N, S]), folded into each row's expected
        (their scores) and realised (1 if accepted) acceptances of the draft's class [B, C, S], decayed per
        observation. Nothing without `score_bins` (no node carries a score then)."""
        if self.score_bins is None:
            return {}
        in_bin = jax.nn.one_hot(self._score_bin(st.last_scores), self.num_score_bins, dtype=jnp.float32)
        in_bin = in_bin * (reached & (st.last_scores >= 0))[:, :, None]
        seen = jnp.einsum("bns->bs", in_bin)[:, None, :] * in_class
        expected = jnp.einsum("bns,bn->bs", in_bin, jnp.maximum(st.last_scores, 0.0))[:, None, :] * in_class
        realised = jnp.einsum("bns,bn->bs", in_bin, hit.astype(jnp.float32))[:, None, :] * in_class
        g = self.decay ** seen
        return {"score_expected": g * st.score_expected + expected, "score_realised": g * st.score_realised + realised}


def path_products(accept: jax.Array, parents: jax.Array) -> jax.Array:
    """[B, N]: for each node of a tree whose parents precede their children (`parents` [B, N], -1 = the root),
    the product of `accept` [B, N] over the node and its ancestors (`trees.ancestor_matrix`). For a chain
    (parents i - 1) the cumulative product."""
    return jnp.prod(jnp.where(trees.ancestor_matrix(parents), accept[:, None, :], 1.0), axis=2)


def _room(remaining, shape) -> jax.Array:
    """[B, 1]: the draft positions a row can still commit (r_b - 1: the round's own token comes first), or all
    of them (`remaining` None)."""
    if remaining is None:
        return jnp.full((shape[0], 1), shape[1], jnp.int32)
    return jnp.maximum(remaining - 1, 0)[:, None].astype(jnp.int32)
