"""Negative controls through the whole engine: each mutant below makes a decision a lossless speculative decoder
must not make (it reads a token's own random draw before deciding whether that token is verified, or claims a
q it did not sample from), and `specdec/testing.py`'s exact check (`assert_lossless`: chi-squares of the first
token, the first two and the whole 9-token sequence at T=0.7 with top-k and top-p) must reject it, while the
correct configuration beside it passes. The mutants live here (subclasses), never in the library.

- the adaptive width choosing each row's width from its sampled draft tokens;
- the hybrid drafter choosing between lookup and model by the model's sampled token;
- a sampled tree's prefix cut by a score that reads each node's own draw;
- a draft q that forgets top-p (tokens drawn with it): a subtle bias.

And the power of the check itself: `first_token_power` (the figure in `assert_lossless`'s docstring) recomputed,
and checked by simulation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tests.test_adaptive
from drafters import create_drafter, dflash, dspark
from drafters.hybrid import HybridDrafter, rows_where
from drafters.ngram import NgramDrafter
from specdec import testing
from specdec.adaptive import AdaptiveWidth
from specdec.drafter import Draft
from specdec.sampling import SamplingParams, probabilities, sample
from specdec.testing import (MUTANT_ROWS, NUM_SAMPLES, assert_biased, assert_lossless, distribution_target,
                             lossless_pvalues, sampled_joint)
from tests.test_adaptive import given_costs
from tests.test_dflash import noisy
from tests.test_dspark import sampled_tree_drafters


# ---------------------------------------------------------------------------------------------------------
# The check's power
# ---------------------------------------------------------------------------------------------------------

def test_the_documented_power_is_the_computed_one():
    """`assert_lossless`'s docstring states the power of its chi-squares against the least favourable TV 0.03
    shift of the first token at NUM_SAMPLES rows: recomputed here (noncentral chi-square), >= 0.9 for the first
    token, and confirmed by simulating the test itself (4000 multinomial samples of the shifted law, the same
    pooling and threshold)."""
    doc = " ".join(testing.assert_lossless.__doc__.split())
    power = {name: testing.first_token_power(NUM_SAMPLES, statistic=name) for name in testing.STATISTICS}
    assert power["first token"] >= 0.9, power
    assert f"first token {power['first token']:.2f}, first two tokens {power['first two tokens']:.2f}, " \
           f"whole sequence {power['joint']:.2f}" in doc, (power, doc)
    assert f"NUM_SAMPLES = {NUM_SAMPLES} rows" in doc
    assert abs(testing.simulated_power(NUM_SAMPLES) - power["first token"]) < 0.02
    # the shift really is at TV 0.03, and smaller samples really have less power
    _, first = testing.exact_cells(testing.STATISTICS["first token"])
    assert 0.5 * np.abs(testing.least_favourable_shift(first, 0.03) - first).sum() == pytest.approx(0.03)
    assert testing.first_token_power(6000) < 0.9
    # tests/test_adaptive.py's sampled test states its own figures (its cases run NUM_SAMPLES rows)
    adaptive = " ".join(tests.test_adaptive.test_adaptive_sampled_output_matches_target_distribution.__doc__.split())
    assert f"NUM_SAMPLES = {NUM_SAMPLES} rows per case: power {power['first token']:.2f}" in adaptive
    assert f"({testing.first_token_power(3000):.2f} at the 3000 rows" in adaptive


def test_pooling_keeps_every_group_expected_five_times():
    expected = np.array([100.0, 40.0, 3.0, 1.0, 0.5])
    # the sparse cells' group is expected 4.5 < 5 times: joined to the smallest dense cell
    assert testing.pooled_cells(expected).tolist() == [0, 1, 1, 1, 1]
    assert np.bincount(testing.pooled_cells(expected), weights=expected).tolist() == [100.0, 44.5]
    assert testing.pooled_cells(np.array([100.0, 40.0, 3.0, 2.5])).tolist() == [0, 1, 2, 2]
    assert testing.pooled_cells(np.array([9.0, 8.0])).tolist() == [0, 1]


# ---------------------------------------------------------------------------------------------------------
# The adaptive width: each row's width chosen from its sampled draft
# ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _WidthFromTheDraw(AdaptiveWidth):
    """A mutant: after the adaptive width's own cut, each row verifies only the leading run of its draft whose
    sampled tokens are below LOW (a width chosen from the draw: a token is verified only if it is one of those)."""

    def refine(self, spec, state, draft, planned, drafted):
        draft, sched = super().refine(spec, state, draft, planned, drafted)
        run = jnp.cumprod((draft.tokens < LOW).astype(jnp.int32), axis=1).astype(bool)
        return dataclasses.replace(draft, valid=draft.valid & run), sched


# The mutants' token set: ids below 4. On this target and drafter it splits the draft's support after every
# first token (the even ids would not: after each first token the draft's first draw is either always even
# or always odd, so a choice by parity reads nothing a row's context does not already fix).
LOW = 4
# widths (0, 1, 3) of a 3-node chain: verifying pays on this target's acceptance, so most rounds verify
CHAIN_COSTS = ((1.0, 1.1, 1.3), 0.05)
# The width, hybrid and tree mutants run MUTANT_ROWS rows (smallest p-value 3e-21, 6e-24 and 4e-18 at that size);
# the subtle one runs NUM_SAMPLES.


def test_a_width_chosen_from_the_sampled_draft_is_caught():
    """Reading the draw fails. The correct adaptive width on the same drafter passes (tests/test_adaptive.py's
    sampled test; the hybrid's model below)."""
    target = distribution_target()
    drafter = create_drafter("self_spec", target, 3, num_layers=1)
    mutant = _WidthFromTheDraw(**given_costs(CHAIN_COSTS), objective="throughput", free_draft_max_batch=NUM_SAMPLES)
    counts, impossible, m = sampled_joint(target, drafter, "rejection_chain", MUTANT_ROWS, scheduler=mutant)
    assert sum(m.width_rounds[1:]) > 0, m.width_rounds
    assert_biased(counts, impossible)


# ---------------------------------------------------------------------------------------------------------
# The hybrid drafter: lookup or model, chosen by the model's sampled token
# ---------------------------------------------------------------------------------------------------------

class _ChoiceFromTheModelsDraw(HybridDrafter):
    """A mutant: a row whose model draft starts with a token >= LOW takes the lookup's draft instead (the choice
    reads the model's draw, so the model's draft is verified only when its first token is below LOW). Otherwise
    the hybrid's own choice (a chain: lookup rows where the match is long enough, the model's elsewhere)."""

    def propose(self, params, state, ctx, sampling, key):
        model, state = self.model.propose(params, state, ctx, sampling, key)
        lookup, _ = self.lookup.propose({}, (), ctx, sampling, key)
        lookup = dataclasses.replace(lookup, probs=jax.nn.one_hot(lookup.tokens, model.probs.shape[-1]))
        use = self.choose_lookup(ctx)[0] | ctx.done | (model.tokens[:, 0] >= LOW)
        return dataclasses.replace(rows_where(use, lookup, model), evidence=self.evidence_before_draft(ctx)), state


def hybrid_scheduler():
    return AdaptiveWidth(**given_costs(CHAIN_COSTS), objective="throughput", free_draft_max_batch=NUM_SAMPLES)


def test_adaptive_hybrid_is_lossless_and_a_choice_from_the_models_draw_is_not():
    """The hybrid (lookup rows with one-hot q, self-speculation rows with its sampled q, rows changing kind from
    round to round) under the adaptive width, which plans each row with its evidence class known before drafting:
    lossless. The mutant whose choice reads the model's draw: caught. (Self-speculation, not an untrained DSpark:
    its first draft token is accepted in the first round, so a choice there moves the first token's law, which the
    check sees best; an untrained DSpark's never is on this target.)"""
    target = distribution_target()
    k = 3
    drafter = HybridDrafter(create_drafter("self_spec", target, k, num_layers=1), NgramDrafter(k, max_ngram=3),
                            min_match=2)
    counts, impossible, m = sampled_joint(target, drafter, "rejection_chain", scheduler=hybrid_scheduler())
    assert m.width_rounds[0] > 0 and sum(m.width_rounds[1:]) > 0, m.width_rounds
    assert_lossless(counts, impossible, m)
    mutant = _ChoiceFromTheModelsDraw(drafter.model, drafter.lookup, min_match=2)
    assert_biased(*sampled_joint(target, mutant, "rejection_chain", MUTANT_ROWS, scheduler=hybrid_scheduler())[:2])


# ---------------------------------------------------------------------------------------------------------
# A sampled tree's prefix cut by a score
# ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _PrefixByOwnDraw(AdaptiveWidth):
    """A mutant: after the adaptive width's prefix, each row's tree is cut further before its first node whose
    score, the q of the token that node DREW, is under 0.3 (a cut that reads the node's own draw)."""

    def refine(self, spec, state, draft, planned, drafted):
        draft, sched = super().refine(spec, state, draft, planned, drafted)
        keep = jnp.cumprod((draft.token_probs() >= 0.3).astype(jnp.int32), axis=1).astype(bool)
        return dataclasses.replace(draft, valid=draft.valid & keep), sched


# widths (0, 1, 3, 6) of a 6-node tree: cheap narrow prefixes, so the width cuts the tree; calibration off (a
# batch's first, optimistic round would otherwise stop it verifying at all)
TREE_SCHEDULER = dict(**given_costs(((1.0, 1.05, 1.15, 1.5), 0.05)), objective="throughput",
                      free_draft_max_batch=NUM_SAMPLES, calibration_weight=0.0)


def test_adaptive_sampled_tree_cut_by_prefix_is_lossless_and_a_cut_by_the_draw_is_not():
    """DSpark's sampled tree (a fixed best-first shape, siblings drawn without replacement) under the adaptive
    width, which verifies prefixes of it (rounds at widths 1 and 3 of 6): lossless. Cutting each row's prefix
    further where a node's drawn token has q < 0.3: caught."""
    small, make = sampled_tree_drafters()
    tree = make(dspark.DSparkDrafter, tree_accept=0.5)
    assert tree.ordered_tree
    counts, impossible, m = sampled_joint(small, tree, "multidraft_tree", scheduler=AdaptiveWidth(**TREE_SCHEDULER))
    assert m.width_rounds[1] > 0 and m.width_rounds[2] > 0, m.width_rounds  # prefixes of the tree were verified
    assert_lossless(counts, impossible, m)
    assert_biased(*sampled_joint(small, tree, "multidraft_tree", MUTANT_ROWS,
                                 scheduler=_PrefixByOwnDraw(**TREE_SCHEDULER))[:2])


# ---------------------------------------------------------------------------------------------------------
# A draft q that forgets top-p
# ---------------------------------------------------------------------------------------------------------

class _TopPDraws(dflash.DFlashDrafter):
    """DFlash whose tokens are drawn from q with top-p applied (q computed with temperature and top-k only, then
    top-p'd here and sampled), returning that q (`forgets_top_p` False) or the q before top-p (True: the mutant).
    DFlash's q does not depend on the drafted tokens, so redrawing them keeps every other part of the draft."""

    forgets_top_p = False

    def propose(self, params, state, ctx, sampling, key):
        loose, state = super().propose(params, state, ctx, dataclasses.replace(sampling, top_p=1.0), key)
        nucleus = probabilities(jnp.log(loose.probs), SamplingParams(temperature=1.0, top_p=sampling.top_p))
        offsets = jnp.arange(nucleus.shape[1], dtype=jnp.int32)  # node j is the token at offset j (a chain)
        tokens = sample(key, jnp.log(nucleus), SamplingParams(temperature=1.0), offsets)
        return Draft.chain(tokens, probs=loose.probs if self.forgets_top_p else nucleus), state


class _ForgetsTopP(_TopPDraws):
    forgets_top_p = True


def test_a_draft_q_that_forgets_top_p_is_caught():
    """The subtle bias: the tokens are drawn with top-p, the q the verifier divides by is the one before it. The
    honest draw of the same construction passes. This drafter's first token is rarely accepted in the first round,
    so the bias shows in the whole-sequence chi-square (p 4e-11 here; < 1e-16 on each of 4 other seeds, where the
    honest draw passed on all 4), not in the first-token one."""
    small = distribution_target()
    task = dflash.make_task(small, num_layers=1, block_size=3, taps=[1])
    params, buffers = task.init(jax.random.PRNGKey(0), None)
    params = noisy(params, 2, 0.3)
    honest = _TopPDraws.from_trained(task.arch, params, buffers, small, 3)
    counts, impossible, m = sampled_joint(small, honest, "rejection_chain")
    assert_lossless(counts, impossible, m)
    mutant = _ForgetsTopP.from_trained(task.arch, params, buffers, small, 3)
    counts, impossible, _ = sampled_joint(small, mutant, "rejection_chain")
    print("forgets top-p:", lossless_pvalues(counts))
    assert_biased(counts, impossible)
