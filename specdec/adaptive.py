"""The adaptive verify width: each round, verify as many draft tokens as pays on this machine, or none.

A round at verify width W (draft nodes run through the target; 0 = a plain one-token decode step that skips
the draft) costs C(W) seconds on this machine, backend, model, batch size and cache capacity, and commits
g_b(W) = 1 + (accepted drafts) tokens to row b, never more than the r_b tokens the row has left. The adaptive
width picks, every round, the W of the engine's verify buckets that maximises one of two objectives
(`objective`):

    makespan (default):  Theta(W) = min_b E[min(g_b(W), r_b)] / r_b / C(W)    over the active rows
    throughput:          Theta(W) = sum_b E[min(g_b(W), r_b)] / C(W)

with E[g_b(W)] = 1 + sum_{j < W} P_b(position j is drafted and accepted). `speculative_generate` decodes a
static batch: it ends when its last row does, so a round is worth what it advances the row that would finish
last, the one with the most tokens left for its rate (makespan; with one row both objectives agree). Summing
over the rows (throughput) is the objective of a server that refills finished rows; on a static batch it
verified drafts accepted by rows that then idled until the slowest finished (GSM8K, batch 8: 141 accepted
drafts per pass saved 3 of the batch's rounds, 0.91x AR; docs/BENCHMARKS.md session 12). The cap at r_b means
a row one token from its limit gains nothing from a draft.

Inputs, both known before the target runs:
- C(W): measured inside the compiled loop itself (`measure_round_costs`: the same program, forced to one width
  per pass, draft and loop overhead included), cached per machine / model / backend / drafter / batch /
  capacity in the specdec cache dir (`round_costs.json`), re-measured on request; a warmed-up run rescales the
  cached costs to the machine's speed now (one fresh pass of plain rounds: `engine.round_costs`).
- P_b: per-row running estimates from that row's own history (exponentially decayed counts, decayed when the
  position is observed, so a row's estimates follow its text): the conditional acceptance of position j given
  j-1 was accepted, and how often position j is drafted at all (an n-gram miss drafts nothing). The acceptance
  counts are kept per evidence class of the draft (`Draft.evidence`: prompt lookup's and suffix decoding's match
  length), since an 8-token match is accepted far more often than a one-token one.
- Calibration: the per-row estimates are checked against what the rounds they chose realised. Each verified
  round records, by draft position, the accepted drafts its estimates expected (summed over active rows,
  uncalibrated) and the ones it accepted; the decayed ratio realised / expected (`calibration`, ratio 1 with
  no evidence) scales the expected gains. The rounds that get verified are those whose noisy estimates looked
  best (a winner's curse that grows with the batch: at batch 8 the summed estimates chose widths that lost 11%
  on GSM8K, session 10), and the ratio measures that bias on exactly those rounds (one ratio for the whole
  draft by default; `calibration_per_position` keeps one per depth). Batches of one row are not calibrated
  (`calibration_min_batch`): there the row's own history is the feedback, and the ratio, updated only by
  verified rounds, stayed low after a row's text turned copy-heavy (at batch 1 it cut n-gram's HumanEval tau
  from 1.35 to 1.13). Its totals are reported (`expected_accepted`,
  `realised_accepted` in the metrics), so a run shows how far its acceptance model was off.
- Exploration: after `explore_every` (8) rounds in a row that verified nothing, one round verifies at the
  narrowest non-zero width, so a row whose text turns copy-heavy is noticed. A verified round whose accepted
  drafts do not pay for its width doubles that gap (up to `explore_max`, 64) and one that pays resets it, so on
  text where drafts keep failing (open chat) exploring costs ~(C(1) - C(0)) / C(0) / 64 of a step instead of / 8
  (~4% here at 8). (Until session 11 any accepted token reset the gap: at batch 8 some row nearly always accepts
  one, so a tree drafter, whose narrowest width is the whole tree at ~2x a plain round, explored every 9th
  round and lost 22% on GSM8K.) (Session 6 let unobserved counts drift back to the optimistic prior instead: on
  open chat a third of the rounds then verified drafts accepted 11% of the time.) The gap is never shorter than
  the exploring round's extra cost allows (`explore_budget`, 2% of the plain rounds' time: at batch 8 suffix
  decoding's exploring round costs ~1.7 plain rounds, so it waits ~35 quiet rounds instead of 8).

A width > 0 must beat width 0 by `margin` (5%): the measured costs are good to a few percent, so a
predicted gain smaller than that is as likely a loss.

Two decisions per round:
1. `plan`, before drafting, from the history alone: if W = 0 wins, the draft is skipped (drafters whose state
   needs every proposal, `Drafter.skippable = False`, still draft, and verify nothing), unless the draft costs at
   most `free_draft` of a plain round and `refine` will look at it: then it is always made (pure-JAX drafters
   only: a host-side drafter's drafted round leaves the compiled bursts of plain rounds, `engine.adaptive_plan`).
2. `refine`, after drafting, for deterministic drafts (probs=None: n-gram, suffix, top-k trees) or greedy
   decoding: the actual draft lengths replace the drafted-rate estimates and the draft's cost is sunk, so W is
   chosen again (down to 0). For drafts sampled at temperature > 0 the planned W stands. A tree is verified
   whole or not at all, unless its nodes are in priority order (`Drafter.ordered_tree`: suffix decoding's
   best-first tree), which may be cut to a prefix valued by the levels it reaches, or (`tree_value: nodes`) by
   its nodes, each with its own history: a node's acceptance given its parent's. With `score_bins` a drafted
   tree's nodes are valued instead by the drafter's own estimate (`Draft.scores`: a top-k tree's q of each
   node's token at its parent), calibrated per row by what nodes of that score realised: the history says what
   rounds like this one were worth, the draft says whether this one is (at batch 1 on open chat the history
   expected 4.5x the accepted drafts that came; docs/BENCHMARKS.md session 39).

Why this is lossless: whether draft position j is verified depends only on the past (history counts, the
calibration and the tokens each row has left, all from rounds already committed), the machine's costs and, in
`refine`, on draft lengths, tree shapes and node scores that
are deterministic functions of the committed context. It never depends on the sampled value of a draft token,
so rejection sampling stays exact (the DSpark paper's appendix A shows what goes wrong otherwise;
specdec/scheduling.py). Under greedy decoding any choice is exact.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specdec import trees
from specdec.drafter import Drafter
from specdec.scheduling import cache_root, cached_measurement

COST_FILE = "round_costs.json"


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
    # profiling only (`measure_round_costs`): widths forced by index (-1 = chosen), every node up to W verified
    force_plan: jax.Array  # int32 []
    force_refine: jax.Array  # int32 []
    force_valid: jax.Array  # bool []
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

    def forced(self, plan: int, refine: int, valid: bool = False) -> "AdaptiveState":
        """This state with the plan and refine decisions forced to those indices into the verify widths (and,
        with `valid`, every draft node treated as drafted): the cost profile and the warm-up run fixed widths."""
        return dataclasses.replace(self, force_plan=jnp.asarray(plan, jnp.int32),
                                   force_refine=jnp.asarray(refine, jnp.int32), force_valid=jnp.asarray(valid))


@dataclasses.dataclass(frozen=True)
class AdaptiveWidth:
    """Static settings (hashable: part of the compiled loop's identity). Config `scheduler.kind: adaptive`."""

    decay: float = 0.9  # decay of a history count each time its position is observed (memory ~ 10 observations)
    # Prior acceptance / drafted rate of a position with no history, in pseudo-rounds of weight `prior_weight`.
    # Optimistic (1.0), so a row tries the draft from its first rounds; after that its own observations dominate,
    # and `explore_every` (not the prior) makes a row that stopped verifying try again. Starting a fresh row from
    # what the drafter's earlier requests realised instead measured worse (suffix on GSM8K: 1.16x -> 1.07x):
    # acceptance varies more between prompts than between evidence classes (docs/BENCHMARKS.md session 21).
    prior: float = 1.0
    prior_weight: float = 1.0
    # A deeper position's prior is the estimate of the position before it times this factor. With 1.0 (until
    # session 23) a fresh class valued every depth of its first draft as it valued the first: all accepted, so
    # its first rounds verified the widest draft, and on open chat at batch 1 n-gram's rounds expected 201
    # accepted drafts where 36 came (0.95x AR, session 22). At 0.8 a fresh class's first 5-token draft is worth
    # 1 + 0.8 + 0.51 + 0.26 + 0.11 accepted tokens, so it is tried at a narrower width, and widens as deeper
    # positions are accepted. Replayed with fixed costs on 8 prompt sets at batch 1 (benchmarks/replay_adaptive.py,
    # docs/BENCHMARKS.md session 23): n-gram's worst set 0.951x -> 0.982x AR, geomean 1.195x -> 1.263x; suffix
    # decoding unchanged (0.979x -> 0.980x, 1.152x -> 1.151x); 0.6 cost suffix its copy-heavy sets.
    prior_depth: float = 0.8
    explore_every: int = 8  # verify (the best width > 0) after this many rounds in a row that verified nothing
    explore_max: int = 64  # the gap doubles after each verified round that accepted nothing, up to this
    # An exploring round costs C(narrowest) - C(0) more than a plain one; explore at most every
    # (C(narrowest) / C(0) - 1) / explore_budget rounds, so exploring spends at most this share of the plain
    # rounds' time (within [explore_every, explore_max]). Suffix decoding at batch 8 explores at ~1.7 plain rounds
    # (its Python draft of 8 rows plus a width-1 verify): every 8th round, that was 9% of the loop's time on open
    # text at the start of a row, against ~2% for n-gram at batch 1 (C(1) ~ 1.35 C(0)). 0: no floor.
    explore_budget: float = 0.02
    # Verify only if the expected tokens/s beat a plain step's by this factor: the costs are measured to a few
    # percent, so a width predicted to win by less is as likely to lose (batch 8 picked such widths and lost 6%).
    margin: float = 0.05
    # Calibration of the acceptance model over the whole batch: the accepted drafts that verified rounds realised
    # over the ones the per-row estimates expected for them (decayed by `calibration_decay` per verified round,
    # starting from `calibration_weight` pseudo-tokens at ratio 1) scales every expected gain. The rounds that
    # get verified are the ones whose estimates looked best, so their estimates are biased upwards (at batch 8
    # the summed estimates chose widths that lost 11% on GSM8K); the ratio measures that bias on exactly those
    # rounds. 0 turns it off.
    calibration_decay: float = 0.95
    calibration_weight: float = 4.0
    # One ratio per draft position (True) or one for the whole draft (False, what session 11 measured): the bias
    # need not be the same at every depth, and one ratio for all of them also shrinks the positions whose
    # estimates were right (not yet measured).
    calibration_per_position: bool = False
    # Calibrate only batches of at least this many rows. A single row's estimates already are its own feedback,
    # and the ratio, updated only by verified rounds, stays low long after a row's text turns copy-heavy: at
    # batch 1 it cut n-gram's HumanEval tau from 1.35 to 1.13 (session 11), where batch 8 needs it.
    calibration_min_batch: int = 2
    # Always draft (and let `refine` choose the width from the draft) when a draft costs at most this fraction of
    # a plain round and `refine` may look at it: prompt lookup (~1% of a round) then verifies its long matches
    # even after a row's history of short ones said to skip (session 11's rewrite prompt: tau 1.00 where the
    # fixed width reached 4.25). 0: decide from the history alone.
    free_draft: float = 0.03
    # ... in batches of at most this many rows. At batch 8, once a draft really cost nothing there (session 15:
    # the verify path no longer argmaxes padded logits), drafting every round and letting `refine` verify the
    # rows' matches cost n-gram 9% on GSM8K and HumanEval (0.91x AR; the estimates expected 3-4x the drafts that
    # were accepted), where deciding from the history alone held 0.99x and 1.06x (docs/BENCHMARKS.md session 15).
    free_draft_max_batch: int = 1
    # "makespan": value a round by the progress of the row that would finish last (a static batch, as
    # `speculative_generate` decodes); "throughput": by the tokens it commits over all rows (a server that refills
    # finished rows). See the module docstring.
    objective: str = "makespan"
    # Measure the round costs again even if cached, once per process (a sitting): the widths' cost ratios drift
    # ~10% within an hour on a shared VM, and a stale profile over-verifies (docs/BENCHMARKS.md sessions 39-40).
    reprofile: bool = False
    # Round costs given instead of measured: ((seconds per round at each verify width), draft seconds), e.g. to
    # replay a run with another machine's costs, or in tests. None: measure (cached).
    costs: tuple[tuple[float, ...], float] | None = None
    cost_path: str | None = None  # JSON cache of measured round costs (default: the specdec cache dir)
    # Slow start: a row's estimates count only the draft positions up to twice the deepest one it has ever had
    # accepted (pooled over evidence classes; at least position 1), so its first verified rounds are narrow and
    # the width doubles as deeper drafts are accepted. The optimistic prior alone valued every position of a
    # fresh row's first draft at 1: on open text at batch 1 suffix decoding verified ~5 rounds per 64-token
    # answer at widths 3-7, each costing up to ~2 plain rounds, and lost 12% to AR (docs/BENCHMARKS.md
    # session 19). Measured worse (session 20): no gain on chat, and copy-heavy rows lost their first long
    # matches (rewrite with suffix decoding: 1.31x -> 0.94x). False (default): value every position at once.
    slow_start: bool = False
    # How a prefix of a best-first tree (`Drafter.ordered_tree`) is valued. "levels" (until session 37): by the
    # levels it reaches, the history kept per draft depth, so two prefixes that reach the same depth are worth
    # the same and breadth (a second guess beside the first, the lookup's branch beside the drafter's) is never
    # bought. "nodes": the history is kept per node index (node i's acceptance given its parent's), a node is
    # worth the product along its path, and a prefix the sum over its nodes (its expected accepted drafts, exact
    # under greedy verification, where at most one sibling is accepted). For a chain both are the same model.
    tree_value: str = "levels"
    # With the nodes model: value a drafted deterministic tree (greedy decoding) by the drafter's own estimate of
    # each node's acceptance (`Draft.scores`: a top-k tree's q of the node's token at its parent), times the
    # row's realised / expected acceptance of the nodes whose scores fell in the same bin (edges in (0, 1),
    # ratio 1 from `prior_weight` pseudo-nodes), instead of the node index's history alone: this round's draft
    # says which rounds are worth verifying, the history only what rounds like it were worth. Nodes without a
    # score (the hybrid's lookup) keep the history. `plan` (before drafting) is unchanged. None: off; (): one
    # ratio for all scores. Given as a sequence or as edges joined by '/'.
    score_bins: tuple[float, ...] | None = None

    kind = "adaptive"
    needs_confidence = False

    def __post_init__(self):
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"scheduler.decay must be in [0, 1), got {self.decay!r}")
        if not 0.0 < self.prior <= 1.0:
            raise ValueError(f"scheduler.prior must be in (0, 1], got {self.prior!r}")
        if self.costs is not None:
            round_cost, draft_cost = self.costs
            if not round_cost or any(c <= 0 for c in round_cost) or draft_cost < 0:
                raise ValueError("adaptive costs must be ((seconds per round > 0 at each verify width, ...), "
                                 f"draft seconds >= 0), got {self.costs!r}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"scheduler.margin must be in [0, 1), got {self.margin!r}")
        if not 0.0 <= self.calibration_decay < 1.0:
            raise ValueError(f"scheduler.calibration_decay must be in [0, 1), got {self.calibration_decay!r}")
        if not 0.0 <= self.free_draft < 1.0:
            raise ValueError(f"scheduler.free_draft must be in [0, 1), got {self.free_draft!r}")
        if self.objective not in ("makespan", "throughput"):
            raise ValueError(f"scheduler.objective must be 'makespan' or 'throughput', got {self.objective!r}")
        if self.free_draft_max_batch < 1:
            raise ValueError(f"scheduler.free_draft_max_batch must be >= 1, got {self.free_draft_max_batch!r}")
        if self.calibration_min_batch < 1:
            raise ValueError(f"scheduler.calibration_min_batch must be >= 1, got {self.calibration_min_batch!r}")
        if self.calibration_weight < 0:
            raise ValueError(f"scheduler.calibration_weight must be >= 0, got {self.calibration_weight!r}")
        if not 0.0 <= self.explore_budget < 1.0:
            raise ValueError(f"scheduler.explore_budget must be in [0, 1), got {self.explore_budget!r}")
        if not 0.0 < self.prior_depth <= 1.0:
            raise ValueError(f"scheduler.prior_depth must be in (0, 1], got {self.prior_depth!r}")
        if self.prior_weight <= 0:
            raise ValueError(f"scheduler.prior_weight must be > 0, got {self.prior_weight!r}")
        if self.tree_value not in ("levels", "nodes"):
            raise ValueError(f"scheduler.tree_value must be 'levels' or 'nodes', got {self.tree_value!r}")
        if self.explore_every < 1:
            raise ValueError(f"scheduler.explore_every must be >= 1, got {self.explore_every!r}")
        if self.score_bins is not None:
            edges = (self.score_bins,) if isinstance(self.score_bins, (int, float)) else self.score_bins
            try:
                edges = tuple(float(e) for e in (edges.split("/") if isinstance(edges, str) else edges) if e != "")
            except (TypeError, ValueError):
                raise ValueError(f"scheduler.score_bins must be increasing edges in (0, 1), got {edges!r}") from None
            if any(not 0.0 < e < 1.0 for e in edges) or list(edges) != sorted(set(edges)):
                raise ValueError(f"scheduler.score_bins must be increasing edges in (0, 1), got {self.score_bins!r}")
            object.__setattr__(self, "score_bins", edges)
        if self.explore_max < self.explore_every:
            raise ValueError(f"scheduler.explore_max ({self.explore_max!r}) must be >= explore_every "
                             f"({self.explore_every!r})")

    # -- state -------------------------------------------------------------------------------------------

    def init_state(self, batch: int, num_nodes: int, costs, classes: int = 1) -> AdaptiveState:
        """A fresh history for `batch` rows, `num_nodes` draft positions and `classes` evidence classes
        (`Drafter.evidence_classes`), with `costs` = (round_cost per verify width, draft_cost)."""
        round_cost, draft_cost = costs
        k = len(round_cost)
        def zeros(*shape):  # a fresh buffer per field: the loop donates its state, and a buffer can be donated once
            return jnp.zeros((batch, *shape, num_nodes), jnp.float32)

        return AdaptiveState(
            hits=zeros(classes), reached=zeros(classes), drafted=zeros(), drafts=jnp.zeros((batch, 1), jnp.float32),
            round_cost=jnp.asarray(round_cost, jnp.float32), draft_cost=jnp.asarray(draft_cost, jnp.float32),
            force_plan=jnp.asarray(-1, jnp.int32), force_refine=jnp.asarray(-1, jnp.int32),
            force_valid=jnp.asarray(False), last_drafted_levels=jnp.zeros((batch, num_nodes), bool),
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
        ratio = (realised + self.prior_weight) / (expected + self.prior_weight)  # [B, S]
        return jnp.minimum(scores * jnp.take_along_axis(ratio, self._score_bin(scores), axis=1), 1.0)

    def _rate(self, num, den, prior=None):
        prior = self.prior if prior is None else prior
        return (num + self.prior_weight * prior) / (den + self.prior_weight)

    def acceptance(self, st: AdaptiveState, evidence: jax.Array | None = None) -> jax.Array:
        """P(position j accepted | j verified and j-1 accepted), per row: [B, N], from the row's history in the
        draft's evidence class `evidence` [B] (None: pooled over the classes, what is known before drafting).
        Position 1's prior is `prior`; a deeper position's prior is the estimate of the position before it (times
        `prior_depth`), so positions a row never reaches (every draft rejected early) inherit its poor early
        estimate instead of an optimistic constant. Each class starts from the optimistic prior, so a row whose
        open text taught it that one-token matches fail still tries its first 8-token match. (Starting the
        classes without history from the row's other classes instead cost summarise tau 1.72 -> 1.26 on the
        quickstart and gained nothing on chat: docs/BENCHMARKS.md session 12.)"""
        if evidence is None:
            hits, reached = jnp.sum(st.hits, axis=1), jnp.sum(st.reached, axis=1)
        else:
            pick = jax.nn.one_hot(evidence, st.hits.shape[1], dtype=st.hits.dtype)[:, :, None]  # [B, C, 1]
            hits, reached = jnp.sum(st.hits * pick, axis=1), jnp.sum(st.reached * pick, axis=1)
        prior = jnp.full(hits.shape[:1], self.prior, jnp.float32)
        rates = []
        for j in range(hits.shape[1]):  # static loop over draft positions
            rate = self._rate(hits[:, j], reached[:, j], prior)
            rates.append(rate)
            prior = rate * self.prior_depth
        return jnp.stack(rates, axis=1)

    def survival(self, st: AdaptiveState, evidence: jax.Array | None = None,
                 parents: jax.Array | None = None, scores: jax.Array | None = None) -> jax.Array:
        """P(positions 1..j all accepted | drafted), from the conditional estimates: [B, N] (0 past a row's
        slow-start reach). With `parents` [B, N] (the nodes model, `tree_value`): P(node i and its ancestors all
        accepted), the estimates taken per node index, or for the nodes with `scores` >= 0 [B, N] (a drafted
        tree's `Draft.scores`, with `score_bins`) from their calibrated scores."""
        accept = self.acceptance(st, evidence)
        if scores is not None:
            accept = jnp.where(scores >= 0, self.scored_acceptance(st, evidence, scores), accept)
        survival = jnp.cumprod(accept, axis=1) if parents is None else path_products(accept, parents)
        return jnp.where(self.reach(st), survival, 0.0) if self.slow_start else survival

    def reach(self, st: AdaptiveState) -> jax.Array:
        """bool [B, N]: the draft positions `slow_start` lets a row value: up to twice the deepest position it
        has had accepted in any evidence class (counts decay but never reach 0), at least position 1."""
        n = st.hits.shape[2]
        depth = jnp.arange(1, n + 1)
        deepest = jnp.max(jnp.where(jnp.sum(st.hits, axis=1) > 0, depth[None, :], 0), axis=1)  # [B]
        return depth[None, :] <= jnp.maximum(2 * deepest, 1)[:, None]

    def calibration(self, st: AdaptiveState) -> jax.Array:
        """[N]: realised / expected accepted drafts at each draft position over the recent verified rounds (one
        ratio for all positions with `calibration_per_position` off; 1 with no evidence, when
        `calibration_weight` is 0, or for a batch below `calibration_min_batch` rows)."""
        n = st.calib_expected.shape[0]
        if self.calibration_weight == 0 or st.hits.shape[0] < self.calibration_min_batch:
            return jnp.ones((n,), jnp.float32)
        w = self.calibration_weight
        if self.calibration_per_position:
            return (st.calib_realised + w) / (st.calib_expected + w)
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

    def plan(self, st: AdaptiveState, widths: tuple[int, ...], active: jax.Array, tree: bool,
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
        return jnp.where(st.force_plan >= 0, st.force_plan, best)

    def refine(self, st: AdaptiveState, draft, planned: jax.Array, drafted: jax.Array, widths: tuple[int, ...],
               active: jax.Array, look: bool, tree: bool, remaining: jax.Array | None = None,
               ordered: bool = False):
        """The draft cut to the round's verify width, and the state recording what this round does.

        `drafted`: whether the drafter ran. `look` (static): the draft's lengths may steer the width
        (deterministic drafts, or greedy decoding). `remaining`, `ordered`: as in `plan`."""
        n = draft.num_nodes
        w = jnp.asarray(widths, jnp.int32)
        valid = jnp.where(st.force_valid, True, draft.valid)
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
        k = jnp.where(st.force_refine >= 0, st.force_refine, k)
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

    def skipped(self, st: AdaptiveState, active: jax.Array) -> AdaptiveState:
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

    def observe(self, st: AdaptiveState, verified: jax.Array, num_accepted: jax.Array,
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


# ----------------------------------------------------------------------------------------------------------
# Round costs, measured in the compiled loop (cached)
# ----------------------------------------------------------------------------------------------------------

def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dev = jax.devices()[0]
    return f"{dev.platform}:{dev.device_kind}|{cpu}|{os.cpu_count()}cpu"


@functools.lru_cache(maxsize=None)
def _code_version(*modules: str) -> str:
    """A digest of the source files that decide what a round costs (the step, the loop, the drafter): costs
    profiled by other code (an older specdec, a changed step layout) are measured again, not reused."""
    digest = hashlib.sha256()
    for name in modules:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:12]


def _drafter_modules(drafter) -> tuple[str, ...]:
    """The modules whose code decides what `drafter` costs a round: its class's and its base classes' (DSpark's
    forward is DFlash's), and those of the drafters it wraps (the hybrid's model and lookup)."""
    parts = [drafter] + [v for v in vars(drafter).values() if isinstance(v, Drafter)]
    names = {cls.__module__ for part in parts for cls in type(part).__mro__}
    return tuple(sorted(n for n in names if n != "builtins"))


def cost_key(target, drafter, policy: str, sampling, batch: int, capacity: int, widths) -> str:
    backend = getattr(getattr(target, "backend", None), "name", "?")
    draft = json.dumps(drafter.describe(), sort_keys=True, default=str)
    mode = "greedy" if sampling.greedy else "sampled"
    code = _code_version("specdec.models.transformer", "specdec.engine", __name__, *_drafter_modules(drafter))
    return (f"{_machine()}|{target.cfg.name}|{backend}|{draft}|{policy}|{mode}|B={batch}|"
            f"S={-(-capacity // 256) * 256}|W={list(widths)}|code={code}")


def default_cost_path() -> Path:
    return cache_root() / COST_FILE


def measure_round_costs(run_forced, num_widths: int, repeats: int = 3, time_draft=None):
    """(round_cost [K], draft_cost): seconds per loop iteration with the width forced to each bucket (k = 0:
    the draft skipped), and what drafting adds to a round: `time_draft()` where the draft can be timed alone
    (pure-JAX drafters: `engine.draft_seconds`), else measured as a round that drafts and verifies nothing minus
    a plain one. `run_forced(plan, refine)` runs the real compiled loop with the plan / refine decisions forced
    to those bucket indices and returns seconds per iteration.

    The passes are interleaved (every width once, `repeats` times over) and the median of each width counts:
    the cost model predicts a run's typical time, and on a shared machine the fastest of a few passes is the
    luckiest one (taking it made every prediction 10-15% optimistic), while a slow spell during one width's
    passes would skew that width against the others if they were not interleaved."""
    forced = [(k, k) for k in range(num_widths)]
    if time_draft is None:
        forced.append((num_widths - 1, 0))  # draft, verify nothing
    passes = [[run_forced(plan, refine) for plan, refine in forced] for _ in range(repeats)]
    median = [float(np.median(column)) for column in zip(*passes)]
    round_cost = median[:num_widths]
    if time_draft is not None:
        return round_cost, time_draft()
    return round_cost, max(median[num_widths] - round_cost[0], 0.0)


def fit_round_costs(runs) -> dict | None:
    """The round costs that timed runs imply, beside the profile they ran with: a check of the cost model.

    Least squares of each run's decode seconds, in units of its own C(0) (a warmed-up run rescales the profile to
    the machine's speed), on its loop iterations per verify width and its drafted iterations that verified
    nothing. `runs`: DecodeMetrics of adaptive runs with one set of verify widths, one per call (merged runs mix
    their rescalings). Returns None with no more runs than unknowns, else {"ratios" / "ratios_stderr": fitted
    C(W) over the profile's C(0) per width (the first: the plain round's; None for a width no run chose),
    "draft" / "draft_stderr": the fitted cost a drafted round that verifies nothing adds, over the profile's
    C(0) (None if none did, or if every width-0 round drafted: then C(0) includes it), "profile_ratios",
    "profile_draft", "runs"}. Every figure is in the unit the seconds were divided by, the
    profile's C(0), never over the fitted C(0): where the runs hold few plain rounds (GSM8K: ~2 per call) that
    one is barely determined, and dividing by it turned a session-41 fit into negative ratios. Session 40
    (docs/BENCHMARKS.md): a fit of 48 runs priced the widths within ~4% of the profile and an unverified draft
    at ~2.6x the profile's draft cost."""
    runs = [m for m in runs if m.width_rounds and m.round_costs]
    if not runs:
        return None
    if len({tuple(m.verify_widths) for m in runs}) != 1:
        raise ValueError("fit_round_costs: the runs have different verify widths; fit each set apart")
    counts = np.asarray([[*m.width_rounds, m.width_rounds[0] - m.skipped_drafts] for m in runs], float)
    seconds = np.asarray([m.decode_seconds / m.round_costs[0] for m in runs])
    cols = np.flatnonzero(counts.sum(axis=0) > 0)
    if np.linalg.matrix_rank(counts[:, cols]) < len(cols):  # a drafter that drafts every round (not skippable):
        cols = cols[cols < counts.shape[1] - 1]  # its unverified drafts are its width-0 rounds, priced as those
    if counts[:, 0].sum() == 0 or len(runs) <= len(cols):
        return None
    x = counts[:, cols]
    sol = np.linalg.lstsq(x, seconds, rcond=None)[0]
    resid = seconds - x @ sol
    variance = np.diag(resid @ resid / (len(runs) - len(cols)) * np.linalg.pinv(x.T @ x))
    stderr = np.sqrt(np.maximum(variance, 0.0))  # a nearly collinear fit can round a variance below 0
    fitted, err = [None] * counts.shape[1], [None] * counts.shape[1]
    for i, c in enumerate(cols):
        fitted[c], err[c] = float(sol[i]), float(stderr[i])
    profile = runs[0]
    return {"ratios": fitted[:-1], "ratios_stderr": err[:-1], "draft": fitted[-1],
            "draft_stderr": err[-1], "profile_ratios": [c / profile.round_costs[0] for c in profile.round_costs],
            "profile_draft": (profile.draft_cost or 0.0) / profile.round_costs[0], "runs": len(runs)}


_REPROFILED: set[tuple[str, str]] = set()  # (cache file, key) measured again in this process (`reprofile`)


def load_or_measure_round_costs(key: str, measure, path=None, reprofile: bool = False):
    """(round_cost, draft_cost) for `key`, from the JSON cache or measured by `measure()` (then cached).
    `reprofile`: measured again the first time this process asks for `key`, then taken from the cache, so every
    run of a benchmark sitting uses the same fresh profile."""
    file = Path(path) if path else default_cost_path()
    again = reprofile and (str(file), key) not in _REPROFILED

    def timed():
        t0 = time.perf_counter()
        round_cost, draft_cost = measure()
        return {"round_cost": round_cost, "draft_cost": draft_cost, "measured_seconds": time.perf_counter() - t0}

    entry = cached_measurement(file, key, timed, "scheduler.cost_path", again)
    if again:
        _REPROFILED.add((str(file), key))
    return tuple(entry["round_cost"]), float(entry["draft_cost"])
