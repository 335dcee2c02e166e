"""The adaptive verify width (specdec/adaptive.py): its decisions on golden cases, greedy equality with AR for
every kind of drafter (compiled and host-stepped loops, with and without state, chains and trees) with rounds
that choose width 0, the sampled output's distribution through the engine, and the measured-once round costs."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drafters import create_drafter
from specdec import adaptive, costs, engine
from specdec.adaptive import AdaptiveWidth
from specdec.config import ConfigError, apply_overrides, load_config
from specdec.drafter import Draft, Drafter
from specdec.engine import speculative_generate
from specdec.generate import generate
from specdec.testing import (NUM_SAMPLES, PROMPTS, SAMPLING, assert_lossless, distribution_target, peaky_target,
                             sampled_joint)

# Costs for widths (0, 1, 3, 4) (a 4-node draft with auto buckets) under which both skipping and verifying win,
# depending on a row's history: rounds of every width are exercised.
COSTS_4 = ((1.0, 1.25, 1.6, 1.8), 0.2)


def given_costs(costs):
    """AdaptiveWidth settings for given costs: ((seconds per round at each verify width), draft seconds)."""
    return {"round_costs": tuple(costs[0]), "draft_cost": costs[1]}


def state_with(sched, hits, reached, drafted, drafts, costs):
    """A state whose history (one evidence class) is the given counts [B, N]."""
    st = sched.init_state(len(hits), len(hits[0]), 1, costs)
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return dataclasses.replace(st, hits=f(hits)[:, None], reached=f(reached)[:, None], drafted=f(drafted),
                               drafts=f(drafts))


def one_class(counts):
    """[B, N] history counts as the [B, 1, N] of a drafter without evidence classes."""
    return jnp.asarray(counts, jnp.float32)[:, None]


def test_plan_and_refine_golden():
    """Row 0 always accepts, row 1 never: Theta(W) = sum_b value_b(W) / cost(W) (the throughput objective),
    values by hand."""
    sched = AdaptiveWidth(objective="throughput")
    widths = (0, 1, 3)
    hits = [[10, 10, 10], [0, 0, 0]]
    reached = [[10, 10, 10], [10, 0, 0]]
    drafted = [[10, 10, 10], [10, 10, 10]]
    drafts = [[10], [10]]
    active = jnp.asarray([True, True])
    st = state_with(sched, hits, reached, drafted, drafts, ((1.0, 1.2, 1.5), 0.1))
    # row 0: rates 1 -> value 1 + W; row 1: position 1 rate 1/11, later positions unobserved, so they inherit
    # the rate before them times prior_depth d: r, r d, r d^2, survival r, r^2 d, r^3 d^3
    r, d = 1 / 11, sched.prior_depth
    np.testing.assert_allclose(np.asarray(sched.acceptance(st))[1], [r, r * d, r * d * d], rtol=1e-6)
    theta = [2 / 1.0, (2 + 1 + r) / 1.2, (4 + 1 + r + r ** 2 * d + r ** 3 * d ** 3) / 1.5]
    assert int(sched.plan_width(st, widths, active, tree=False)) == int(np.argmax(theta)) == 2
    expensive = state_with(sched, hits, reached, drafted, drafts, ((1.0, 5.0, 10.0), 0.1))
    assert int(sched.plan_width(expensive, widths, active, tree=False)) == 0
    # only finished rows: nothing to gain, the narrowest width wins
    assert int(sched.plan_width(st, widths, jnp.asarray([False, False]), tree=False)) == 0

    # refine with the real lengths: row 0 drafted 1 node, row 1 none -> width 1 beats 3 once the draft is paid
    draft = Draft.chain(jnp.ones((2, 3), jnp.int32), valid=jnp.asarray([[True, False, False], [False] * 3]))
    cut, st2 = sched.refine_width(st, draft, jnp.asarray(2), jnp.asarray(True), widths, active, look=True, tree=False)
    assert np.asarray(cut.valid).tolist() == [[True, False, False], [False] * 3]
    assert np.asarray(st2.width_rounds).tolist() == [0, 1, 0]  # the round ran width 1
    np.testing.assert_allclose(float(st2.predicted_seconds), 1.2)
    # without looking (a sampled draft), the planned width stands: here 1, so the 3-node draft is cut to 1
    full = Draft.chain(jnp.ones((2, 3), jnp.int32))
    cut, st3 = sched.refine_width(st, full, jnp.asarray(1), jnp.asarray(True), widths, active, look=False, tree=False)
    assert np.asarray(cut.valid).tolist() == [[True, False, False]] * 2
    assert np.asarray(st3.width_rounds).tolist() == [0, 1, 0]
    # a skipped draft verifies nothing and costs a plain step
    cut, st4 = sched.refine_width(st, full, jnp.asarray(0), jnp.asarray(False), widths, active, look=True, tree=False)
    assert not np.any(np.asarray(cut.valid)) and int(st4.skipped_drafts) == 1
    np.testing.assert_allclose(float(st4.predicted_seconds), 1.0)


def test_plan_reads_the_evidence_class_known_before_drafting():
    """A drafter that knows its draft's evidence class before drafting (`Drafter.evidence_before_draft`, the
    hybrid's lookup match): the plan values the round with that class's history. Class 1 always accepts, class 0
    never; pooled they do not pay for a draft, class 1 alone pays for the widest width, class 0 alone for none."""
    sched = AdaptiveWidth()
    widths = (0, 1, 3)
    st = sched.init_state(1, 3, 2, ((1.0, 1.3, 2.0), 0.1))
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    st = dataclasses.replace(st, hits=f([[[0, 0, 0], [10, 10, 10]]]), reached=f([[[40, 0, 0], [10, 10, 10]]]),
                             drafted=f([[10, 10, 10]]), drafts=f([[10]]))
    active = jnp.asarray([True])
    assert int(sched.plan_width(st, widths, active, tree=False)) == 0  # pooled: 10 of 50 accepted at position 1
    assert int(sched.plan_width(st, widths, active, tree=False, evidence=jnp.asarray([1]))) == 2
    assert int(sched.plan_width(st, widths, active, tree=False, evidence=jnp.asarray([0]))) == 0


def test_makespan_values_a_round_by_the_row_that_would_finish_last():
    """The same two rows under the makespan objective: Theta(W) = min_b E[min(g_b(W), r_b)] / r_b / cost(W).
    With equal tokens left, the row that never accepts sets the batch's end and drafts do not pay; when it is
    nearly done, the accepting row is the one that would finish last and the widest width wins; a row with one
    token left gains nothing from a draft."""
    sched = AdaptiveWidth()
    widths, costs = (0, 1, 3), ((1.0, 1.2, 1.5), 0.1)
    hits, reached = [[10, 10, 10], [0, 0, 0]], [[10, 10, 10], [10, 0, 0]]
    drafted, drafts = [[10, 10, 10], [10, 10, 10]], [[10], [10]]
    st = state_with(sched, hits, reached, drafted, drafts, costs)
    active = jnp.asarray([True, True])
    r = 1 / 11  # row 1's acceptance at every position (test_plan_and_refine_golden)
    row1 = [1.0, 1 + r, 1 + r + r ** 2 + r ** 3]

    def theta(left):
        value = [min((1 + w) / left[0], row1[k] / left[1]) for k, w in enumerate(widths)]
        return [v / c / (1.0 if k == 0 else 1.05) for k, (v, c) in enumerate(zip(value, costs[0]))]

    for left, expected in (((20, 20), 0), ((20, 5), 2), ((20, 19), 0)):
        assert int(np.argmax(theta(left))) == expected, (left, theta(left))
        assert int(sched.plan_width(st, widths, active, tree=False, remaining=jnp.asarray(left))) == expected, left
    # one token left in the only active row: no draft position can be committed, so width 0
    assert int(sched.plan_width(st, widths, jnp.asarray([True, False]), tree=False, remaining=jnp.asarray([1, 5]))) == 0
    assert int(sched.plan_width(st, widths, jnp.asarray([True, False]), tree=False, remaining=jnp.asarray([2, 5]))) == 1
    # refine cuts by the same rule: row 0 drafted 3 nodes, with 3 tokens left only 2 of them can be committed
    full = Draft.chain(jnp.ones((2, 3), jnp.int32))
    cut, _ = sched.refine_width(st, full, jnp.asarray(2), jnp.asarray(True), widths, jnp.asarray([True, False]),
                          look=True, tree=False, remaining=jnp.asarray([3, 5]))
    assert np.asarray(cut.valid)[0].tolist() == [True, True, True]  # width 3 is the bucket that covers 2 nodes
    cut, _ = sched.refine_width(st, full, jnp.asarray(2), jnp.asarray(True), widths, jnp.asarray([True, False]),
                          look=True, tree=False, remaining=jnp.asarray([2, 5]))
    assert np.asarray(cut.valid)[0].tolist() == [True, False, False]
    with pytest.raises(ValueError, match="objective"):
        AdaptiveWidth(objective="latency")


def test_an_ordered_tree_may_be_verified_by_prefix():
    """A best-first tree (`Drafter.ordered_tree`: suffix decoding) may be cut to a prefix of its nodes, valued by
    the levels the prefix reaches; any other tree is verified whole or not at all. Row history: level 1 always
    accepted, level 2 never (level 3 inherits it): survival 1, 1/11, 1/121. Tree: nodes at depths 1, 2, 3, 1."""
    sched = AdaptiveWidth()
    widths, costs = (0, 1, 2, 4), ((1.0, 1.2, 1.6, 2.2), 0.0)
    st = state_with(sched, [[10, 0, 0, 0]], [[10, 10, 0, 0]], [[10] * 4], [[10]], costs)
    tree = Draft.tree(jnp.ones((1, 4), jnp.int32), jnp.asarray([[-1, 0, 1, 0]], jnp.int32))
    active = jnp.asarray([True])
    r = 1 / 11
    # prefixes of 1, 2, 4 nodes reach levels 1, 2, 3: Theta = 1 / 1.0, 2 / 1.2, (2 + r) / 1.6, (2 + r + r^2) / 2.2
    theta = [1.0, 2 / 1.2 / 1.05, (2 + r) / 1.6 / 1.05, (2 + r + r * r) / 2.2 / 1.05]
    assert int(np.argmax(theta)) == 1
    cut, st_ordered = sched.refine_width(st, tree, jnp.asarray(3), jnp.asarray(True), widths, active, look=True, tree=True,
                                   ordered=True)
    assert np.asarray(cut.valid).tolist() == [[True, False, False, False]]
    assert np.asarray(st_ordered.width_rounds).tolist() == [0, 1, 0, 0]
    # the same tree, not in priority order: whole (theta[3] < 1) or nothing, so nothing
    cut, st_whole = sched.refine_width(st, tree, jnp.asarray(3), jnp.asarray(True), widths, active, look=True, tree=True)
    assert not np.any(np.asarray(cut.valid)) and np.asarray(st_whole.width_rounds).tolist() == [1, 0, 0, 0]
    # exploring, an ordered tree verifies its narrowest prefix, any other tree the whole tree
    quiet = dataclasses.replace(st, quiet_rounds=jnp.asarray(99, jnp.int32))
    assert int(sched.plan_width(quiet, widths, active, tree=True, ordered=True)) == 1
    assert int(sched.plan_width(quiet, widths, active, tree=True)) == 3


def test_path_products_is_the_cumulative_product_along_each_path():
    accept = jnp.asarray([[0.5, 0.3, 0.8, 0.6]])
    tree = adaptive.path_products(accept, jnp.asarray([[-1, -1, 0, 1]]))  # two root children, one child each
    np.testing.assert_allclose(np.asarray(tree), [[0.5, 0.3, 0.4, 0.18]], rtol=1e-6)
    chain = adaptive.path_products(accept, jnp.asarray([[-1, 0, 1, 2]]))
    np.testing.assert_allclose(np.asarray(chain), np.cumprod(np.asarray(accept), axis=1), rtol=1e-6)


def test_the_nodes_model_buys_breadth_the_levels_model_cannot_see():
    """`tree_value: nodes` values a best-first tree's prefix by the sum over its nodes of P(node and its
    ancestors accepted), each node index with its own history; `levels` by the levels the prefix reaches. Tree:
    two candidates at depth 1 (nodes 0, 1), one child under each. The same counts, read per node: node 0
    accepted 5 of 10 times, node 1 4 of 10 (given the root), the children 1 of 10. Read per depth (levels):
    depth 1 at 5/10, depth 2 at 4/10."""
    widths, costs = (0, 1, 2, 4), ((1.0, 1.3, 1.5, 2.2), 0.0)
    tree = Draft.tree(jnp.ones((1, 4), jnp.int32), jnp.asarray([[-1, -1, 0, 1]], jnp.int32))
    active = jnp.asarray([True])
    counts = dict(hits=[[5, 4, 1, 1]], reached=[[10, 10, 10, 10]], drafted=[[10] * 4], drafts=[[10]])
    levels, nodes = AdaptiveWidth(), AdaptiveWidth(tree_value="nodes")
    # (hits + prior) / (reached + 1), a position's prior the estimate before it times prior_depth 0.8
    a0 = 6 / 11
    a1 = (4 + 0.8 * a0) / 11
    a2 = (1 + 0.8 * a1) / 11
    a3 = (1 + 0.8 * a2) / 11
    # levels: prefixes of 1 and 2 nodes both reach depth 1, so the second candidate is worth nothing
    theta_levels = [1.0, (1 + a0) / 1.3, (1 + a0) / 1.5, (1 + a0 + a0 * a1) / 2.2]
    theta_nodes = [1.0, (1 + a0) / 1.3, (1 + a0 + a1) / 1.5, (1 + a0 + a1 + a0 * a2 + a1 * a3) / 2.2]
    assert int(np.argmax(theta_levels)) == 1 and int(np.argmax(theta_nodes)) == 2
    for sched, want in ((levels, 1), (nodes, 2)):
        st = state_with(sched, costs=costs, **counts)
        cut, st2 = sched.refine_width(st, tree, jnp.asarray(3), jnp.asarray(True), widths, active, look=True, tree=True,
                                ordered=True)
        assert np.asarray(cut.valid).tolist() == [[True] * want + [False] * (4 - want)], sched.tree_value
        if sched.tree_value == "nodes":  # the expected accepted drafts it recorded: the two candidates' sum
            np.testing.assert_allclose(float(jnp.sum(st2.round_expected)), a0 + a1, rtol=1e-5)
            assert np.asarray(st2.last_parents).tolist() == [[-1, -1, 0, 1]]  # the shape the next plan expects
            assert int(sched.plan_width(st2, widths, active, tree=True, ordered=True)) == 2
    with pytest.raises(ValueError, match="tree_value"):
        AdaptiveWidth(tree_value="breadth")


def test_the_nodes_model_observes_each_node_whose_parent_was_accepted():
    """After a verified round of the tree above whose accepted path is node 1 then node 3: nodes 0 and 1 (the
    root's children) were observed, node 1 accepted; node 3 (under node 1) observed and accepted; node 2 (under
    the rejected node 0) not observed. A finished row keeps its counts."""
    sched = AdaptiveWidth(decay=0.5, tree_value="nodes")
    st = sched.init_state(2, 4, 1, ((1.0, 1.0), 0.0))
    parents = jnp.asarray([[-1, -1, 0, 1]] * 2, jnp.int32)
    valid = jnp.ones((2, 4), bool)
    path = jnp.asarray([[1, 3, -1, -1], [0, -1, -1, -1]], jnp.int32)
    st = dataclasses.replace(st, last_drafted_levels=valid, last_drafted=jnp.asarray(True))
    st = sched.observe_round(st, valid, jnp.asarray([2, 1]), jnp.asarray([True, False]), path=path, parents=parents)
    np.testing.assert_allclose(np.asarray(st.reached)[:, 0], [[1, 1, 0, 1], [0, 0, 0, 0]])
    np.testing.assert_allclose(np.asarray(st.hits)[:, 0], [[0, 1, 0, 1], [0, 0, 0, 0]])


def test_node_scores_value_a_drafted_tree_by_this_rounds_draft():
    """`score_bins`: a drafted tree's nodes valued by the drafter's scores times the row's realised / expected
    acceptance in each score's bin. The history per node index (2 of 10 accepted at every node) says the tree
    does not pay; confident scores (0.9 at each node) say it does, and a row whose bin realised half of what
    its scores expected halves them again. Nodes without a score (-1) keep the history."""
    widths, costs = (0, 1, 2, 4), ((1.0, 1.3, 1.5, 2.2), 0.0)
    parents = jnp.asarray([[-1, -1, 0, 1]], jnp.int32)
    active = jnp.asarray([True])
    counts = dict(hits=[[2, 2, 2, 2]], reached=[[10] * 4], drafted=[[10] * 4], drafts=[[10]])
    sched = AdaptiveWidth(tree_value="nodes", score_bins=(0.5,))
    assert sched.score_bins == (0.5,) and sched.num_score_bins == 2
    st = state_with(sched, costs=costs, **counts)

    def width(st, scores):
        tree = dataclasses.replace(Draft.tree(jnp.ones((1, 4), jnp.int32), parents),
                                   scores=jnp.asarray([scores], jnp.float32))
        cut, st2 = sched.refine_width(st, tree, jnp.asarray(3), jnp.asarray(True), widths, active, look=True,
                                tree=True, ordered=True)
        return int(np.sum(np.asarray(cut.valid))), st2

    assert width(st, [-1.0] * 4)[0] == 0  # no scores: the history's poor estimates, the draft is not verified
    n, st2 = width(st, [0.9, 0.05, 0.9, 0.05])
    # ratio (0 + 1) / (0 + 1) = 1: node values 0.9, 0.05, 0.81, 0.0025; Theta = 1.9 / 1.3 at one node beats
    # 1.95 / 1.5 and 2.76 / 2.2 (the history's own: 1.27 / 1.3, under a plain round's 1)
    assert n == 1
    np.testing.assert_allclose(np.asarray(st2.last_scores), [[0.9, 0.05, 0.9, 0.05]], rtol=1e-6)
    # the row's high bin realised 0.9 of the 5.4 its scores expected: ratio (0.9 + 1) / (5.4 + 1) = 0.297
    low = dataclasses.replace(st, score_expected=jnp.asarray([[[0.0, 5.4]]]),
                              score_realised=jnp.asarray([[[0.0, 0.9]]]))
    assert width(low, [0.9, 0.05, 0.9, 0.05])[0] == 0
    np.testing.assert_allclose(np.asarray(sched.scored_acceptance(low, jnp.asarray([0]), jnp.asarray([[0.9, 0.3]]))),
                               [[0.9 * 1.9 / 6.4, 0.3]], rtol=1e-5)


def test_node_scores_are_calibrated_by_the_nodes_observed():
    """`observe` adds each scored node whose parent was accepted to its score bin: its score to the expected
    acceptances, 1 to the realised ones if it was accepted; the counts decay per observation."""
    sched = AdaptiveWidth(decay=0.5, tree_value="nodes", score_bins=(0.5,))
    st = sched.init_state(1, 4, 1, ((1.0, 1.0), 0.0))
    parents = jnp.asarray([[-1, -1, 0, 1]], jnp.int32)
    valid = jnp.ones((1, 4), bool)
    st = dataclasses.replace(st, last_drafted_levels=valid, last_drafted=jnp.asarray(True),
                             last_scores=jnp.asarray([[0.8, 0.3, 0.6, -1.0]]),
                             score_expected=jnp.asarray([[[2.0, 4.0]]]), score_realised=jnp.asarray([[[1.0, 2.0]]]))
    # accepted path: node 0 then node 2; node 1 observed and rejected; node 3 (under node 1) not observed
    path = jnp.asarray([[0, 2, -1, -1]], jnp.int32)
    st = sched.observe_round(st, valid, jnp.asarray([2]), jnp.asarray([True]), path=path, parents=parents)
    # low bin: node 1 (0.3, rejected), decay 0.5 once; high bin: nodes 0 and 2 (0.8 + 0.6, both accepted), 0.25
    np.testing.assert_allclose(np.asarray(st.score_expected), [[[2.0 * 0.5 + 0.3, 4.0 * 0.25 + 1.4]]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(st.score_realised), [[[1.0 * 0.5, 2.0 * 0.25 + 2.0]]], rtol=1e-6)
    for bad in ((0.5, 0.2), (0.0, 0.5), ("x",)):
        with pytest.raises(ValueError, match="score_bins"):
            AdaptiveWidth(score_bins=bad)


def test_observe_counts_reached_and_accepted_positions():
    sched = AdaptiveWidth(decay=0.5)
    st = sched.init_state(2, 3, 1, ((1.0, 1.0), 0.0))
    draft = Draft.chain(jnp.ones((2, 3), jnp.int32), valid=jnp.asarray([[True, True, True], [True, True, False]]))
    st = dataclasses.replace(st, last_drafted_levels=draft.valid, last_drafted=jnp.asarray(True))  # a chain
    st = sched.observe_round(st, draft.valid, jnp.asarray([1, 2]), jnp.asarray([True, True]))
    # row 0 accepted 1 of 3: positions 1-2 reached, 1 hit; row 1 accepted both valid nodes: 1-2 reached and hit
    assert np.asarray(st.reached)[:, 0].tolist() == [[1, 1, 0], [1, 1, 0]]
    assert np.asarray(st.hits)[:, 0].tolist() == [[1, 0, 0], [1, 1, 0]]
    assert np.asarray(st.drafted).tolist() == [[1, 1, 1], [1, 1, 0]]
    st = sched.observe_round(st, draft.valid, jnp.asarray([0, 0]), jnp.asarray([True, False]))  # row 1 finished: kept
    # row 0 rejected position 1: only position 1 was observed, so only its counts decay
    assert np.asarray(st.reached)[:, 0].tolist() == [[1.5, 1, 0], [1, 1, 0]]
    assert np.asarray(st.hits)[:, 0].tolist() == [[0.5, 0, 0], [1, 1, 0]]
    assert np.asarray(st.drafted).tolist() == [[1.5, 1.5, 1.5], [1, 1, 0]]
    # a round that verified nothing (the draft skipped) decays nothing
    st = dataclasses.replace(st, last_drafted=jnp.asarray(False))
    same = sched.observe_round(st, jnp.zeros((2, 3), bool), jnp.asarray([0, 0]), jnp.asarray([True, True]))
    for name in ("hits", "reached", "drafted", "drafts"):
        assert np.array_equal(getattr(same, name), getattr(st, name)), name


def test_a_fresh_class_values_deeper_positions_less():
    """With no history a class's position 1 is the prior and each deeper position the one before times
    `prior_depth`; history at a position replaces the prior there (golden values)."""
    sched = AdaptiveWidth(prior_depth=0.8)
    fresh = state_with(sched, [[0, 0, 0, 0]], [[0, 0, 0, 0]], [[0, 0, 0, 0]], [[0]], ((1.0, 1.2), 0.0))
    np.testing.assert_allclose(np.asarray(sched.acceptance(fresh)), [[1.0, 0.8, 0.64, 0.512]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(sched.survival(fresh)), [[1.0, 0.8, 0.512, 0.262144]], rtol=1e-6)
    # one acceptance at position 1 and one rejection at position 2
    seen = state_with(sched, [[1, 0, 0, 0]], [[1, 1, 0, 0]], [[1, 1, 0, 0]], [[1]], ((1.0, 1.2), 0.0))
    r2 = (0 + 0.8 * 1.0) / (1 + 1)
    np.testing.assert_allclose(np.asarray(sched.acceptance(seen)), [[1.0, r2, 0.8 * r2, 0.64 * r2]], rtol=1e-6)
    old = AdaptiveWidth(prior_depth=1.0)  # every depth valued as the one before
    np.testing.assert_allclose(np.asarray(old.acceptance(fresh)), [[1.0] * 4])


def test_calibration_scales_expected_gains_by_realised_over_expected():
    """Each verified round records what the per-row estimates expected of it (uncalibrated) and what it realised;
    their decayed ratio scales every expected gain, so estimates that keep over-promising stop buying widths."""
    sched = AdaptiveWidth(calibration_weight=2.0, calibration_decay=0.5)
    widths = (0, 1, 3)
    active = jnp.asarray([True, True])
    # both rows accepted 9 of their last 10 drafts at every position: raw estimates favour verifying
    st = state_with(sched, [[9, 9, 9]] * 2, [[10, 10, 10]] * 2, [[10, 10, 10]] * 2, [[10], [10]],
                    ((1.0, 1.5, 1.9), 0.1))
    assert np.all(np.asarray(sched.calibration(st)) == 1.0)
    assert int(sched.plan_width(st, widths, active, tree=False)) == 2
    draft = Draft.chain(jnp.ones((2, 3), jnp.int32))
    _, st = sched.refine_width(st, draft, jnp.asarray(2), jnp.asarray(True), widths, active, look=True, tree=False)
    # conditional rates: position 1 from the prior 1, deeper ones from the position before times prior_depth (9 of
    # 10 each)
    d = sched.prior_depth
    r1 = (9 + 1) / (10 + 1)
    r2 = (9 + d * r1) / (10 + 1)
    r3 = (9 + d * r2) / (10 + 1)
    expected = 2 * (r1 + r1 * r2 + r1 * r2 * r3)  # two rows, three positions, survival products
    np.testing.assert_allclose(np.asarray(st.round_expected), [2 * r1, 2 * r1 * r2, 2 * r1 * r2 * r3], rtol=1e-6)
    # the round realises nothing: both rows reject position 1
    st = sched.observe_round(st, draft.valid, jnp.asarray([0, 0]), active)
    np.testing.assert_allclose([float(st.expected_accepted), float(st.realised_accepted)], [expected, 0.0],
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(sched.calibration(st)), [2.0 / (expected + 2.0)] * 3, rtol=1e-6)
    # a second such round, verified at the planned width (a sampled draft: refine does not look): the sums
    # decay by 0.5 before adding (the row counts moved too)
    _, st = sched.refine_width(st, draft, jnp.asarray(2), jnp.asarray(True), widths, active, look=False, tree=False)
    second = float(np.sum(st.round_expected))
    st = sched.observe_round(st, draft.valid, jnp.asarray([0, 0]), active)
    np.testing.assert_allclose(np.asarray(sched.calibration(st))[0], 2.0 / (0.5 * expected + second + 2.0),
                               rtol=1e-6)
    # with the row estimates put back to the optimistic ones, the calibrated plan no longer verifies
    optimistic = dataclasses.replace(st, hits=one_class(np.full((2, 3), 9.0)), reached=one_class(np.full((2, 3), 10.0)))
    assert int(sched.plan_width(optimistic, widths, active, tree=False)) == 0
    assert int(AdaptiveWidth(calibration_weight=0).plan_width(optimistic, widths, active, tree=False)) == 2
    # a single row is not calibrated (calibration_min_batch 2): its own history is its feedback
    one = jax.tree.map(lambda x: x[:1] if x.ndim >= 1 and x.shape[0] == 2 else x, optimistic)  # row 0 alone
    assert np.all(np.asarray(sched.calibration(one)) == 1.0)
    assert int(sched.plan_width(one, widths, active[:1], tree=False)) == 2
    # a round that verified nothing leaves the calibration alone
    _, quiet = sched.refine_width(optimistic, draft, jnp.asarray(0), jnp.asarray(False), widths, active, look=True,
                            tree=False)
    assert not np.any(np.asarray(quiet.round_expected))
    quiet = sched.observe_round(quiet, jnp.zeros((2, 3), bool), jnp.asarray([0, 0]), active)
    assert np.array_equal(sched.calibration(quiet), sched.calibration(st))


def test_exploration_verifies_after_a_run_of_quiet_rounds():
    """A hopeless history skips the draft, but after `explore_every` quiet rounds the plan and the refinement
    both must verify (the narrowest width > 0); a verifying round restarts the clock."""
    sched = AdaptiveWidth(explore_every=3, explore_budget=0)  # the cadence alone (no cost floor)
    widths = (0, 1, 3)
    st = sched.init_state(1, 3, 1, ((1.0, 1.5, 2.0), 0.1))
    st = dataclasses.replace(st, hits=one_class(np.zeros((1, 3))), reached=one_class(np.full((1, 3), 50.0)),
                             drafted=jnp.full((1, 3), 50.0), drafts=jnp.full((1, 1), 50.0))
    active = jnp.asarray([True])
    draft = Draft.chain(jnp.ones((1, 3), jnp.int32))
    plans = []
    for _ in range(5):
        k = sched.plan_width(st, widths, active, tree=False)
        plans.append(int(k))
        _, st = sched.refine_width(st, draft, k, k > 0, widths, active, look=True, tree=False)
    assert plans == [0, 0, 0, 1, 0]  # three quiet rounds, then one that verifies the narrowest width
    assert int(st.quiet_rounds) == 1

    # a history where, of the widths > 0, the widest would pay best (but width 0 still wins): the exploring
    # round still verifies the narrowest, the cheapest way to learn whether drafts are accepted again
    st = sched.init_state(1, 3, 1, ((1.0, 1.5, 1.6), 0.1))
    st = dataclasses.replace(st, hits=one_class(np.full((1, 3), 15.0)), reached=one_class(np.full((1, 3), 50.0)),
                             drafted=jnp.full((1, 3), 50.0), drafts=jnp.full((1, 1), 50.0),
                             quiet_rounds=jnp.asarray(3, jnp.int32))
    assert int(sched._best(jnp.asarray([1.0, 1.3, 1.42]), st.round_cost, jnp.asarray([False, True, True]))) == 2
    assert int(sched.plan_width(st, widths, active, tree=False)) == 1
    _, st = sched.refine_width(st, draft, jnp.asarray(1), jnp.asarray(True), widths, active, look=True, tree=False)
    assert st.width_rounds.tolist() == [0, 1, 0]


def test_exploration_backs_off_while_verified_drafts_fail():
    """Each verified round whose accepted drafts do not pay for its width doubles the quiet gap before the next
    exploration (up to explore_max); a round that pays resets it; width-0 rounds leave it alone."""
    sched = AdaptiveWidth(explore_every=2, explore_max=8, explore_budget=0)
    st = sched.init_state(2, 3, 1, ((1.0, 1.5, 2.0), 0.1))
    active = jnp.asarray([True, True])
    verified = jnp.asarray([[True, True, False], [True, False, False]])
    nothing = jnp.zeros((2, 3), bool)
    gaps = []
    for accepted, levels in ([0, 0], verified), ([0, 0], verified), ([0, 0], nothing), ([0, 0], verified), \
                            ([0, 0], verified), ([0, 1], verified):
        st = sched.observe_round(st, levels, jnp.asarray(accepted, jnp.int32), active)
        gaps.append(int(st.explore_gap))
    assert gaps == [4, 8, 8, 8, 8, 2]
    # a round must pay for its width to reset the gap: two rows at C(W) / C(0) = 1.75 need 1.5 accepted drafts
    st = dataclasses.replace(st, round_break_even=jnp.asarray(1.5, jnp.float32))
    assert int(sched.observe_round(st, verified, jnp.asarray([0, 1], jnp.int32), active).explore_gap) == 4
    assert int(sched.observe_round(st, verified, jnp.asarray([1, 1], jnp.int32), active).explore_gap) == 2
    # refine records the break-even of the width it runs: width 3 at cost 2.0 for two active rows
    _, ran3 = sched.refine_width(st, Draft.chain(jnp.ones((2, 3), jnp.int32)), jnp.asarray(2), jnp.asarray(True),
                           (0, 1, 3), active, look=False, tree=False)
    assert float(ran3.round_break_even) == 2 * (2.0 / 1.0 - 1.0)
    # the gap is what the plan waits for: 3 quiet rounds do not explore at gap 4, the 4th does
    st = dataclasses.replace(st, explore_gap=jnp.asarray(4, jnp.int32), hits=one_class(np.zeros((2, 3))),
                             reached=one_class(np.full((2, 3), 50.0)), drafted=jnp.full((2, 3), 50.0),
                             drafts=jnp.full((2, 1), 50.0))
    plans = []
    for _ in range(5):
        k = sched.plan_width(st, (0, 1, 3), active, tree=False)
        plans.append(int(k))
        _, st = sched.refine_width(st, Draft.chain(jnp.ones((2, 3), jnp.int32)), k, k > 0, (0, 1, 3), active,
                             look=True, tree=False)
    assert plans == [0, 0, 0, 0, 1]
    with pytest.raises(ValueError, match="explore_max"):
        AdaptiveWidth(explore_every=8, explore_max=4)


def test_exploration_waits_until_its_cost_fits_the_budget():
    """An exploring round that costs C(narrowest) / C(0) - 1 = 0.2 more than a plain one waits 0.2 /
    explore_budget = 10 quiet rounds, not explore_every; the floor is capped at explore_max."""
    widths = (0, 1, 3)
    active = jnp.asarray([True])
    draft = Draft.chain(jnp.ones((1, 3), jnp.int32))
    for round_costs, explore_max, first in (((1.0, 1.2, 2.0), 64, 10), ((1.0, 3.0, 4.0), 16, 16)):
        sched = AdaptiveWidth(explore_every=3, explore_max=explore_max, explore_budget=0.02)
        st = sched.init_state(1, 3, 1, (round_costs, 0.1))
        st = dataclasses.replace(st, hits=one_class(np.zeros((1, 3))), reached=one_class(np.full((1, 3), 50.0)),
                                 drafted=jnp.full((1, 3), 50.0), drafts=jnp.full((1, 1), 50.0))
        plans = []
        for _ in range(first + 1):
            k = sched.plan_width(st, widths, active, tree=False)
            plans.append(int(k))
            _, st = sched.refine_width(st, draft, k, k > 0, widths, active, look=True, tree=False)
        assert plans == [0] * first + [1], (round_costs, plans)
    with pytest.raises(ValueError, match="explore_budget"):
        AdaptiveWidth(explore_budget=1.0)


def test_history_is_kept_per_evidence_class():
    """A row whose one-token matches (class 0) always failed skips such drafts, but verifies its first 8-token
    match (class 4, no history: the optimistic prior); a verified round updates only its own class (the
    throughput objective: row 1's hopeless draft rides along in the round row 0's long match pays for)."""
    sched = AdaptiveWidth(objective="throughput")
    widths = (0, 1, 3)
    st = sched.init_state(2, 3, 5, ((1.0, 1.3, 1.6), 0.1))
    hopeless = np.zeros((2, 5, 3), np.float32)
    hopeless[:, 0] = 50.0  # class 0: reached 50 times, never accepted
    st = dataclasses.replace(st, hits=jnp.zeros((2, 5, 3)), reached=jnp.asarray(hopeless),
                             drafted=jnp.full((2, 3), 50.0), drafts=jnp.full((2, 1), 50.0))
    active = jnp.asarray([True, True])
    # position 1: class 4 has no history (the optimistic prior, 1), class 0 has 50 rejections; class 2 has no
    # history either; pooled over the classes, the row looks as hopeless as class 0
    np.testing.assert_allclose(np.asarray(sched.acceptance(st, jnp.asarray([4, 0])))[:, 0], [1.0, 1 / 51], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(sched.acceptance(st, jnp.asarray([2, 2])))[:, 0], [1.0] * 2, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(sched.acceptance(st))[:, 0], [1 / 51] * 2, rtol=1e-6)
    # pooled over the classes (the plan, before drafting): as hopeless as class 0
    assert int(sched.plan_width(st, widths, active, tree=False)) == 0
    short = Draft.chain(jnp.ones((2, 3), jnp.int32), evidence=jnp.asarray([0, 0]))
    cut, st_short = sched.refine_width(st, short, jnp.asarray(2), jnp.asarray(True), widths, active, look=True, tree=False)
    assert not np.any(np.asarray(cut.valid))  # drafted, but verifying pays for neither row
    long_row0 = Draft.chain(jnp.ones((2, 3), jnp.int32), evidence=jnp.asarray([4, 0]))
    cut, st_long = sched.refine_width(st, long_row0, jnp.asarray(2), jnp.asarray(True), widths, active, look=True,
                                tree=False)
    assert np.asarray(cut.valid).tolist() == [[True] * 3, [True] * 3]  # row 0's long match pays for the round
    assert np.asarray(st_long.last_class).tolist() == [4, 0]
    st_long = sched.observe_round(st_long, cut.valid, jnp.asarray([3, 0]), active)
    hits, reached = np.asarray(st_long.hits), np.asarray(st_long.reached)
    assert hits[0, 4].tolist() == [1, 1, 1] and reached[0, 4].tolist() == [1, 1, 1]  # row 0: class 4 only
    assert np.array_equal(reached[0, :4], hopeless[0, :4]) and not hits[0, :4].any()
    np.testing.assert_allclose(reached[1, 0], [50 * 0.9 + 1, 50, 50])  # row 1: class 0, position 1 reached
    assert not reached[1, 1:].any()


def test_a_nearly_free_draft_is_always_made_when_refine_can_look():
    """With a history that says skip, the plan still drafts when the draft costs <= free_draft of a plain round
    and refine will see it (a deterministic draft or greedy decoding); otherwise it skips."""
    widths = (0, 1, 3)
    active = jnp.asarray([True])
    hopeless = dict(hits=[[0, 0, 0]], reached=[[50, 50, 50]], drafted=[[50, 50, 50]], drafts=[[50]])
    cheap = state_with(AdaptiveWidth(), **hopeless, costs=((1.0, 1.3, 1.6), 0.02))
    dear = state_with(AdaptiveWidth(), **hopeless, costs=((1.0, 1.3, 1.6), 0.05))
    assert int(AdaptiveWidth().plan_width(cheap, widths, active, tree=False, look=True)) > 0
    assert int(AdaptiveWidth().plan_width(cheap, widths, active, tree=False, look=False)) == 0
    assert int(AdaptiveWidth().plan_width(dear, widths, active, tree=False, look=True)) == 0
    assert int(AdaptiveWidth(free_draft=0.0).plan_width(cheap, widths, active, tree=False, look=True)) == 0
    # only in batches of at most free_draft_max_batch rows (a batch of 2 decides from its history)
    pair = state_with(AdaptiveWidth(), **{k: v * 2 for k, v in hopeless.items()}, costs=((1.0, 1.3, 1.6), 0.02))
    both = jnp.asarray([True, True])
    assert int(AdaptiveWidth().plan_width(pair, widths, both, tree=False, look=True)) == 0
    assert int(AdaptiveWidth(free_draft_max_batch=2).plan_width(pair, widths, both, tree=False, look=True)) > 0
    with pytest.raises(ValueError, match="free_draft_max_batch"):
        AdaptiveWidth(free_draft_max_batch=0)
    with pytest.raises(ValueError, match="free_draft"):
        AdaptiveWidth(free_draft=1.0)


def test_ngram_evidence_is_the_match_length_class():
    """The n-gram drafter's evidence: how far back its chosen occurrence matches (classes 1, 2, 3, 4-7, 8+)."""
    target = peaky_target(0)
    drafter = create_drafter("ngram", target, 3, max_ngram=3)
    assert drafter.deterministic and drafter.evidence_classes == 5
    copy = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    seq = np.zeros((3, 40), np.int32)
    seq[0, :20] = copy + copy[:9]  # the last 9 tokens repeat the start: an 8+ token match
    seq[1, :6] = [5, 6, 9, 9, 5, 6]  # the last 2 tokens occurred before: class 1
    seq[2, :4] = [1, 2, 3, 4]  # no repeat: nothing drafted
    lengths = jnp.asarray([20, 6, 4], jnp.int32)
    ctx = engine.RoundContext(seq=jnp.asarray(seq), seq_len=lengths, done=jnp.zeros(3, bool))
    draft, _ = drafter.propose(drafter.params, (), ctx, SAMPLING, jax.random.PRNGKey(0))
    assert np.asarray(draft.evidence).tolist() == [4, 1, 0]
    assert np.asarray(draft.tokens)[0].tolist() == [14, 15, 5] and np.asarray(draft.valid)[0].all()
    assert np.asarray(draft.tokens)[1].tolist() == [9, 9, 5] and not np.asarray(draft.valid)[2].any()


def test_a_skipped_round_is_recorded_as_refine_records_a_skipped_draft():
    """`plain_rounds` records each of its rounds with `skipped`, without a draft to refine: for random histories
    and remaining tokens, the state after it equals the state after refining an empty draft planned at 0, round
    after round (both objectives)."""
    rng = np.random.default_rng(0)
    widths = (0, 1, 3)
    active = jnp.asarray([True, True])
    empty = Draft.chain(jnp.zeros((2, 3), jnp.int32), valid=jnp.zeros((2, 3), bool))
    for objective in ("makespan", "throughput"):
        sched = AdaptiveWidth(explore_every=3, explore_max=12, objective=objective)
        for _ in range(10):
            reached = rng.uniform(0, 20, (2, 3))
            st = state_with(sched, reached * rng.uniform(0, 0.6, (2, 3)), reached, rng.uniform(0, 20, (2, 3)),
                            rng.uniform(10, 20, (2, 1)), ((1.0, 1.3, 1.7), 0.1))
            remaining = jnp.asarray(rng.integers(1, 40, 2), jnp.int32)
            for _ in range(5):
                _, by_refine = sched.refine_width(st, empty, jnp.asarray(0), jnp.asarray(False), widths, active,
                                            look=True, tree=False, remaining=remaining)
                st = sched.record_skip(st, active)
                for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(by_refine)):
                    np.testing.assert_allclose(np.asarray(a), np.asarray(b))
                remaining = remaining - 1


def test_a_width_must_beat_a_plain_step_by_the_margin():
    """Position 1 always drafted and accepted with prob 0.6: width 1 yields 1.6 tokens for cost 1.55, i.e. 3%
    more tokens/s than a plain step (1 token, cost 1.0). Without a margin it is chosen; with 5% it is not."""
    widths = (0, 1)
    for margin, expected in ((0.0, 1), (0.05, 0)):
        sched = AdaptiveWidth(margin=margin)
        st = state_with(sched, [[6000.0]], [[10000.0]], [[10000.0]], [[10000.0]], ((1.0, 1.55), 0.0))
        assert int(sched.plan_width(st, widths, jnp.asarray([True]), tree=False)) == expected, margin
    with pytest.raises(ValueError, match="margin"):
        AdaptiveWidth(margin=1.0)


def test_host_side_drafter_runs_width_0_rounds_in_compiled_bursts(monkeypatch):
    """The suffix drafter (Python state) skips runs of width-0 rounds in one compiled call, then syncs from the
    context once: the output stays AR's, and fewer host rounds run than tokens were committed."""
    target = peaky_target(3)
    ar = generate(target, PROMPTS, max_new_tokens=17)
    drafter = create_drafter("suffix", target, 4)
    calls = {"propose": 0, "burst": 0}
    propose, burst = drafter.propose, engine.host_plain_rounds

    def counting_propose(*a, **k):
        calls["propose"] += 1
        return propose(*a, **k)

    def counting_burst(*a, **k):
        calls["burst"] += 1
        return burst(*a, **k)

    monkeypatch.setattr(drafter, "propose", counting_propose)
    monkeypatch.setattr(engine, "host_plain_rounds", counting_burst)
    # verifying never pays: every round but the explorations is width 0 (a draft costing 10% of a plain round is
    # not made for nothing)
    costs = ((1.0, 5.0, 5.0, 5.0), 0.1)
    out = speculative_generate(target, drafter, PROMPTS, policy="greedy_tree", max_new_tokens=17,
                               scheduler=AdaptiveWidth(**given_costs(costs), explore_every=4))
    assert out.tokens == ar.tokens
    m = out.metrics
    assert calls["burst"] > 0 and m.width_rounds[0] > calls["burst"]  # several width-0 rounds per call
    assert calls["propose"] < m.width_rounds[0]


def adaptive_drafters(target):
    return {
        "ngram": create_drafter("ngram", target, 4, max_ngram=2),  # deterministic, stateless
        # a draft LM's tree: skipped rounds, then a catch-up (the chain draft LM is in the distribution test below)
        "tree": create_drafter("self_spec", target, 4, num_layers=1, tree_top_k=2, tree_depth=2),
        "suffix": create_drafter("suffix", target, 4),  # host-stepped loop
    }


def test_adaptive_greedy_equals_ar_with_rounds_of_every_width():
    target = peaky_target(3)
    ar = generate(target, PROMPTS, max_new_tokens=17)
    drafters = adaptive_drafters(target)
    # suffix decoding's best-first tree valued per node too (`tree_value: nodes`)
    runs = [(name, drafter, "levels") for name, drafter in drafters.items()] + [("suffix", drafters["suffix"], "nodes")]
    for name, drafter, tree_value in runs:
        policy = "greedy_tree" if drafter.kind == "tree" else "greedy_chain"
        # trees run widths 0 or 4 (then as narrow as the tree)
        costs = ((1.0, 1.5, 2.0, 2.5), 0.2) if name == "tree" else COSTS_4
        batch = speculative_generate(target, drafter, PROMPTS, policy=policy, max_new_tokens=17,
                                     scheduler=AdaptiveWidth(**given_costs(costs), explore_every=4, tree_value=tree_value))
        name = f"{name} ({tree_value})"
        assert batch.tokens == ar.tokens, name
        m = batch.metrics
        if tree_value == "nodes":  # its drafts pay on this target: every round verifies a prefix of the tree
            assert sum(m.width_rounds[1:-1]) > 0, (name, m.width_rounds)
            continue
        assert m.width_rounds[0] > 0 and sum(m.width_rounds[1:]) > 0, (name, m.width_rounds)
        assert sum(m.width_rounds) >= m.rounds / len(PROMPTS)  # loop iterations >= a row's mean rounds
        assert m.skipped_drafts > 0, (name, m.skipped_drafts)  # every drafter may be skipped
        assert m.predicted_seconds > 0 and m.verify_widths[0] == 0
        if drafter.ordered_tree:  # a best-first tree is verified by prefix too, not only whole
            assert sum(m.width_rounds[1:-1]) > 0, (name, m.width_rounds)


def test_free_drafts_with_evidence_keep_greedy_equal_to_ar():
    """A nearly free n-gram draft is made every round and refine picks each width from its length and match
    class (width 0 included): the output is still AR's."""
    target = peaky_target(3)
    ar = generate(target, PROMPTS, max_new_tokens=17)
    drafter = create_drafter("ngram", target, 4, max_ngram=2)
    out = speculative_generate(target, drafter, PROMPTS, max_new_tokens=17,
                               scheduler=AdaptiveWidth(**given_costs(((1.0, 1.25, 1.6, 1.8), 0.01)), explore_every=4,
                                                       free_draft_max_batch=len(PROMPTS)))
    assert out.tokens == ar.tokens
    m = out.metrics
    assert m.skipped_drafts == 0 and m.width_rounds[0] > 0 and sum(m.width_rounds[1:]) > 0, m.width_rounds


def test_a_host_side_draft_is_never_free():
    """With the same near-zero draft cost, the pure-JAX n-gram drafter drafts every round (`free_draft`), while
    suffix decoding, a host-side drafter, still skips the draft when its history says so: its drafted rounds are
    host round trips where plain ones run in compiled bursts (counted free, it lost 17% on chat)."""
    target = peaky_target(3)
    ar = generate(target, PROMPTS[:1], max_new_tokens=17)
    costs = AdaptiveWidth(**given_costs(((1.0, 1.25, 1.6, 1.8), 0.001)), explore_every=4)
    lookup = speculative_generate(target, create_drafter("ngram", target, 4, max_ngram=2), PROMPTS[:1],
                                  max_new_tokens=17, scheduler=costs)
    suffix = speculative_generate(target, create_drafter("suffix", target, 4), PROMPTS[:1], max_new_tokens=17,
                                  policy="greedy_tree", scheduler=costs)
    assert lookup.tokens == suffix.tokens == ar.tokens
    assert lookup.metrics.skipped_drafts == 0, lookup.metrics.width_rounds
    assert suffix.metrics.skipped_drafts > 0, suffix.metrics.width_rounds


class _KnowsAR(Drafter):
    """A deterministic drafter that drafts AR's own greedy continuation (`params`: each row's whole AR sequence,
    prompt then generated tokens, padded with -1): at T = 0 its drafts are always accepted, or never with
    `wrong` (each token shifted by one). Its acceptance is known, so the width each round should take is too."""

    name, kind, jittable, deterministic = "knows_ar", "chain", True, True

    def __init__(self, target, prompts, max_new_tokens: int, num_draft_tokens: int, wrong: bool = False):
        rows = [p + t for p, t in zip(prompts, generate(target, prompts, max_new_tokens=max_new_tokens).tokens)]
        table = np.full((len(rows), max(map(len, rows))), -1, np.int32)
        for i, row in enumerate(rows):
            table[i, :len(row)] = row
        self.params, self.num_draft_tokens = jnp.asarray(table), num_draft_tokens
        self.wrong, self.vocab_size = wrong, target.cfg.vocab_size

    def propose(self, params, state, ctx, sampling, key):
        idx = ctx.seq_len[:, None] + jnp.arange(self.num_draft_tokens)[None, :]
        tokens = jnp.take_along_axis(params, jnp.clip(idx, 0, params.shape[1] - 1), axis=1)
        valid = (idx < params.shape[1]) & (tokens >= 0)
        tokens = (tokens + 1) % self.vocab_size if self.wrong else tokens
        return Draft.chain(jnp.maximum(tokens, 0), valid=valid), state


@pytest.mark.parametrize("case, round_costs, wrong, widths_chosen", [
    # C(4) < 5 C(0): the whole draft pays every round; the last round has 4 tokens left, which width 3 commits
    ("pays", (1.0, 1.1, 1.2, 1.3), False, [0, 0, 1, 2]),
    # C(W) >= 1.1 (1 + W) C(0): no width pays even when every draft is accepted; every round skips the draft
    ("never pays", (1.0, 2.2, 4.5, 5.5), False, [14, 0, 0, 0]),
    # width 1 pays (2 tokens for 1.5), wider ones do not: every round verifies one draft token
    ("width 1 only", (1.0, 1.5, 4.5, 6.0), False, [0, 7, 0, 0]),
    # paying costs, drafts never accepted: the first round verifies on the optimistic prior (width 3: 3.31
    # tokens for 1.2 against width 4's 3.57 for 1.3), finds nothing accepted, and every later round skips (the
    # failed round doubled the exploration gap to 16 quiet rounds, more than are left)
    ("never accepted", (1.0, 1.1, 1.2, 1.3), True, [13, 0, 1, 0]),
])
def test_the_width_chosen_follows_the_costs_and_the_acceptance(case, round_costs, wrong, widths_chosen):
    """At T = 0 every width gives AR's tokens, so only the recorded decisions (`width_rounds`: loop iterations per
    verify width 0, 1, 3, 4; `skipped_drafts`) can show a wrong one. A drafter whose acceptance is known (AR's
    own continuation, always accepted, or shifted, never) and given round costs: the widths are those the cost
    model must choose. 15 new tokens: the prefill's, then 14 from the rounds."""
    target = peaky_target(3)
    drafter = _KnowsAR(target, PROMPTS, 15, 4, wrong=wrong)
    out = speculative_generate(target, drafter, PROMPTS, max_new_tokens=15,
                               scheduler=AdaptiveWidth(**given_costs((round_costs, 0.0)), free_draft=0.0))
    assert out.tokens == generate(target, PROMPTS, max_new_tokens=15).tokens
    m = out.metrics
    assert m.verify_widths == [0, 1, 3, 4]
    assert m.width_rounds == widths_chosen, (case, m.width_rounds)
    assert m.skipped_drafts == widths_chosen[0], (case, m.skipped_drafts)  # a skippable drafter skips them
    # every row commits 14 tokens in sum(widths_chosen) rounds: one of each is the target's, the rest accepted
    assert m.accepted_draft_tokens == len(PROMPTS) * (14 - sum(widths_chosen)), case


def test_adaptive_sampled_output_matches_target_distribution():
    """Width chosen per round from the rows' history (rounds that skip and rounds that verify both occur): the
    joint law of 9 generated tokens (T=0.7, top-k, top-p) still equals the target's, for a sampled draft (a
    draft LM, which catches up on the skipped rounds' tokens) and a deterministic one (its lengths steer the
    width), with the calibration of the acceptance estimates on (self_spec). The exact law and the
    checks are `assert_lossless`'s, at its NUM_SAMPLES = 8000 rows per case: power 0.93 against the least
    favourable TV 0.03 shift of the first token (0.25 at the 3000 rows this test once ran)."""
    target = distribution_target()
    costs = ((1.0, 1.3, 2.0), None)  # widths (0, 1, 3) of a 3-node draft; draft costs below
    # The n-gram drafter's first verified round (all rows in one batch) accepts none of the drafts its prior
    # expected, so the calibration (on for self_spec, as by default) would stop it verifying: off for it.
    # The n-gram drafter twice: deciding from its history, and drafting every round (its draft nearly free)
    # with refine choosing each width from the draft's length and evidence class.
    # The last case makes width 1 (of 3) nearly free, so the sampled draft is cut to its first node and the verify
    # step's narrow branch runs the policy on that prefix alone (its own noise draws).
    self_spec = create_drafter("self_spec", target, 3, num_layers=1)
    for drafter, calibration, draft_cost, round_costs in ((self_spec, 4.0, 0.2, costs[0]),
                                                         (create_drafter("ngram", target, 3, max_ngram=1), 0.0, 0.2,
                                                          costs[0]),
                                                         (create_drafter("ngram", target, 3, max_ngram=1), 0.0, 0.01,
                                                          costs[0]),
                                                         (self_spec, 4.0, 0.2, (1.0, 1.01, 100.0))):
        # throughput: with thousands of rows in one batch, the makespan objective (the worst row) would verify only
        # exploring rounds; its decisions, too, depend only on the past (the history and tokens left)
        sched = AdaptiveWidth(**given_costs((round_costs, draft_cost)), explore_every=4, calibration_weight=calibration,
                              objective="throughput", free_draft_max_batch=NUM_SAMPLES)
        counts, impossible, m = sampled_joint(target, drafter, "rejection_chain", scheduler=sched)
        assert m.width_rounds[0] > 0 and sum(m.width_rounds[1:]) > 0, (drafter.name, m.width_rounds)
        if round_costs[1] < 1.1:
            assert m.width_rounds[1] > m.width_rounds[2], m.width_rounds
        assert_lossless(counts, impossible, m)


def test_round_costs_are_measured_in_the_loop_once_and_cached(tmp_path, monkeypatch):
    target = peaky_target(4)
    drafter = create_drafter("ngram", target, 4, max_ngram=2)
    path = tmp_path / "costs.json"
    sched = AdaptiveWidth(cost_path=str(path))
    out = speculative_generate(target, drafter, PROMPTS, max_new_tokens=9, scheduler=sched)
    assert out.tokens == generate(target, PROMPTS, max_new_tokens=9).tokens
    (entry,) = json.loads(path.read_text()).values()
    assert len(entry["round_cost"]) == 4 and all(c > 0 for c in entry["round_cost"]) and entry["draft_cost"] >= 0

    def fail(*a, **k):
        raise AssertionError("measured again although cached")

    monkeypatch.setattr(costs, "measure_round_costs", fail)
    speculative_generate(target, drafter, PROMPTS, max_new_tokens=9, scheduler=sched)

    # reprofile: measured again the first time this process asks, then the fresh entry is reused (a sitting)
    monkeypatch.undo()
    measured, real = [], costs.measure_round_costs
    monkeypatch.setattr(costs, "measure_round_costs", lambda *a, **k: measured.append(1) or real(*a, **k))
    again = AdaptiveWidth(cost_path=str(path), reprofile=True)
    for _ in range(2):
        out = speculative_generate(target, drafter, PROMPTS, max_new_tokens=9, scheduler=again)
        assert out.tokens == generate(target, PROMPTS, max_new_tokens=9).tokens
    assert len(measured) == 1


def test_an_adaptive_call_prefills_its_prompts_three_times(tmp_path, monkeypatch):
    """The round-cost profile (every verify width, 3 passes, plus the draft timing) and the warm-up (every path)
    start their runs from one prefill each: with a prefill per run, one adaptive call at batch 32 on a 2-core CPU
    spent ~15 minutes prefilling (31 prefills of ~28 CPU-seconds) before its first timed token. Three prefills:
    the profile's random prompts, the warm-up's, the timed run's; the output stays AR's, for a jittable drafter
    and for the host-stepped suffix drafter (whose Python state each warm-up path initialises afresh)."""
    target = peaky_target(4)
    prompts = PROMPTS * 2
    calls, real = [], engine.prefill_distinct
    monkeypatch.setattr(engine, "prefill_distinct", lambda *a, **k: calls.append(1) or real(*a, **k))
    ar = generate(target, prompts, max_new_tokens=9).tokens
    ngram = create_drafter("ngram", target, 4, max_ngram=2)
    run = dict(max_new_tokens=9, scheduler=AdaptiveWidth(cost_path=str(tmp_path / "costs.json")), warmup=True)
    assert speculative_generate(target, ngram, prompts, **run).tokens == ar
    assert len(calls) == 3, len(calls)
    calls.clear()
    assert speculative_generate(target, ngram, prompts, **run).tokens == ar
    assert len(calls) == 2, len(calls)  # costs cached: the warm-up's and the timed run's
    # the host-stepped loop's warm-up paths, from one prefill (round costs given: no profile)
    calls.clear()
    sched = AdaptiveWidth(round_costs=(1.0, 1.1, 1.3, 1.5), draft_cost=0.1)
    out = speculative_generate(target, create_drafter("suffix", target, 4), prompts, policy="greedy_tree",
                               max_new_tokens=9, scheduler=sched, warmup=True)
    assert out.tokens == ar and len(calls) == 2, len(calls)


def test_a_pure_jax_drafts_cost_is_timed_alone(tmp_path, monkeypatch):
    """A jittable drafter's draft cost is `draft_seconds` (its propose alone in a compiled loop), not the difference
    of two loop timings, whose noise made prompt lookup's ~1 us draft look like 14% of a round."""
    target = peaky_target(4)
    drafter = create_drafter("ngram", target, 4, max_ngram=2)
    seen, real = [], engine.LoopProbe.draft_seconds

    def timed_alone(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return 1.25e-6

    monkeypatch.setattr(engine.LoopProbe, "draft_seconds", timed_alone)
    path = tmp_path / "costs.json"
    out = speculative_generate(target, drafter, PROMPTS, max_new_tokens=9, scheduler=AdaptiveWidth(cost_path=str(path)))
    assert out.tokens == generate(target, PROMPTS, max_new_tokens=9).tokens
    (entry,) = json.loads(path.read_text()).values()
    assert entry["draft_cost"] == 1.25e-6 and out.metrics.draft_cost == pytest.approx(1.25e-6)
    assert len(seen) == 1 and seen[0] > 0  # the real timing ran on the loop's own state


def test_adaptive_config_and_bad_inputs():
    """The `scheduler:` section parses straight into AdaptiveWidth: every field is a key, each checked once, and a
    bad value is an error that names its full key."""
    cfg = load_config({"scheduler": {"kind": "adaptive", "decay": 0.8, "free_draft": 0.0,
                                     "prior_depth": 0.7, "free_draft_max_batch": 8}})
    s = cfg.scheduler
    assert isinstance(s, AdaptiveWidth) and (s.decay, s.free_draft, s.prior_depth) == (0.8, 0.0, 0.7)
    assert s.free_draft_max_batch == 8
    assert apply_overrides(cfg, ["scheduler.score_bins=[0.5]"]).scheduler.score_bins == (0.5,)
    for override, key in [("scheduler.prior_depth=0.0", "scheduler.prior_depth"),
                          ("scheduler.free_draft=-0.1", "scheduler.free_draft"),
                          ("scheduler.decay=1.0", "scheduler.decay"),
                          ("scheduler.objective=fastest", "scheduler.objective"),
                          ("scheduler.score_bins=[0.7, 0.2]", "scheduler.score_bins"),
                          ("scheduler.threshold=0.5", "scheduler.threshold"),  # a key of another kind
                          ("scheduler.prior_weight=2", "scheduler.prior_weight")]:  # a constant, not a key
        with pytest.raises(ConfigError) as err:
            apply_overrides(cfg, [override])
        assert err.value.key == key, (override, err.value)
    with pytest.raises(ValueError, match="prior_depth"):
        AdaptiveWidth(prior_depth=1.5)
    with pytest.raises(ValueError, match="round_costs"):
        AdaptiveWidth(**given_costs(((1.0, -1.0), 0.0)))
    target = peaky_target(0)
    with pytest.raises(ValueError, match=r"3 round costs.*\[0, 1, 3, 4\]"):
        speculative_generate(target, create_drafter("ngram", target, 4), PROMPTS, max_new_tokens=5,
                             scheduler=AdaptiveWidth(**given_costs(((1.0, 1.0, 1.0), 0.0))))
    assert costs.cost_key(target, create_drafter("ngram", target, 4), "greedy_chain", SAMPLING, 2, 300,
                          (0, 1)).count("|") >= 8


def test_a_slow_drafted_width_is_profiled_over_fewer_rounds():
    """`costs.profile_rounds`: a measurement spans about PROFILE_SECONDS, within [MIN_PROFILE_ROUNDS, most]; a
    cheap round keeps every round (and a non-positive first timing falls back to all of them)."""
    from specdec.costs import MIN_PROFILE_ROUNDS, PROFILE_ROUNDS, PROFILE_SECONDS, profile_rounds

    assert profile_rounds(1e-3) == PROFILE_ROUNDS
    assert profile_rounds(0.0) == PROFILE_ROUNDS
    assert profile_rounds(PROFILE_SECONDS / 6) == 6
    assert profile_rounds(10.0) == MIN_PROFILE_ROUNDS
    assert profile_rounds(1e-6, most=64) == 64 and profile_rounds(PROFILE_SECONDS / 10, most=64) == 10
