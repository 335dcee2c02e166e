"""The hybrid drafter (drafters/hybrid.py): prompt lookup's draft in the rows whose context ends in a long enough
match, the trained drafter's elsewhere. Checked: the per-row choice and what each row's draft carries (tokens,
validity, one-hot q for lookup rows at T > 0, evidence classes), greedy output == AR through the engine at fixed
and adaptive widths, the engine's exact distribution test at T=0.7 with both kinds of rows, and clear errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drafters import create_drafter, dspark
from drafters.hybrid import HybridDrafter
from drafters.ngram import NgramDrafter
from specdec.adaptive import AdaptiveWidth
from specdec.drafter import RoundContext, match_length_class
from specdec.engine import speculative_generate
from specdec.generate import generate
from specdec.sampling import SamplingParams
from specdec.testing import (MUTANT_ROWS, PROMPTS, assert_biased, assert_lossless, distribution_target,
                             peaky_target, prefill_for_drafter, sampled_joint)
from tests.test_adaptive import given_costs
from tests.test_dspark import as_tree, sampled_tree_drafters
from tests.test_scheduling import random_dspark


def hybrid(target, k=3, min_match=2, max_ngram=3):
    return HybridDrafter(random_dspark(target, k), NgramDrafter(k, max_ngram=max_ngram), min_match)


def test_each_row_gets_lookup_or_model_draft_by_its_match_length():
    target = peaky_target()
    drafter = hybrid(target, min_match=2)
    # row 0 ends in "5 6", seen before and followed by 7 8 9: a 2-token match; row 1 ends in a 1-token match;
    # row 2 ends in a token never seen before: no match
    rows = [[5, 6, 7, 8, 9, 4, 5, 6], [3, 4, 11, 12, 4], [1, 2, 3, 13]]
    tokens, lengths, _, state, _ = prefill_for_drafter(target, drafter, rows)
    ctx = RoundContext(seq=jnp.asarray(tokens), seq_len=lengths, done=jnp.zeros((3,), bool))
    use, length = drafter.choose_lookup(ctx)
    assert np.asarray(length).tolist() == [2, 1, 0] and np.asarray(use).tolist() == [True, False, False]
    sampling = SamplingParams(temperature=0.7)
    key = jax.random.PRNGKey(0)
    draft, _ = drafter.propose(drafter.params, state, ctx, sampling, key)
    model, _ = drafter.model.propose(drafter.params, state, ctx, sampling, key)
    assert np.asarray(draft.tokens[0]).tolist() == [7, 8, 9]  # the lookup's continuation
    np.testing.assert_array_equal(draft.tokens[1:], model.tokens[1:])  # the model's draft, same key
    np.testing.assert_allclose(draft.probs[1:], model.probs[1:], rtol=1e-5, atol=1e-12)
    np.testing.assert_array_equal(draft.probs[0], jax.nn.one_hot(draft.tokens[0], target.cfg.vocab_size))
    assert np.asarray(draft.evidence).tolist() == [1 + int(match_length_class(np.array(2))), 0, 0]
    # known before drafting, and equal to the draft's (what the adaptive width plans with)
    np.testing.assert_array_equal(drafter.evidence_before_draft(ctx), draft.evidence)
    # rows that all copy (or are done) skip the model's forward; the lookup row's draft is the same
    done = RoundContext(seq=ctx.seq, seq_len=ctx.seq_len, done=jnp.asarray([False, True, True]))
    copying, _ = drafter.propose(drafter.params, state, done, sampling, key)
    np.testing.assert_array_equal(copying.tokens[0], draft.tokens[0])
    np.testing.assert_array_equal(copying.probs[0], draft.probs[0])
    assert np.asarray(draft.valid).all()
    greedy, _ = drafter.propose(drafter.params, state, ctx, SamplingParams(temperature=0.0), key)
    assert greedy.probs is None


def test_rows_that_copy_verify_the_lookup_branch_beside_the_models_best_nodes():
    """lookup_nodes=n: a copying row's tree is the lookup's first n tokens as a chain from the root, then the
    model's first N - n nodes with their parents shifted by n (q one-hot on the lookup's nodes, the model's q on
    its own); a row whose match spans alone_match tokens or more keeps the lookup's whole chain; the other rows
    keep the model's tree; and the model drafts even when every row copies."""
    target = peaky_target()
    model = as_tree(random_dspark(target, 3), 6, top_k=2, depth=3, accept=0.6)
    drafter = HybridDrafter(model, NgramDrafter(6, max_ngram=3), min_match=2, lookup_nodes=2, alone_match=4)
    assert drafter.describe()["lookup_nodes"] == 2 and "lookup_nodes" not in hybrid(target).describe()
    # row 0 copies "7 8 9 4 5 6" after "5 6" (a 2-token match); row 1 cannot; row 2 matches "3 4 5 6" (4 tokens)
    rows = [[5, 6, 7, 8, 9, 4, 5, 6], [1, 2, 3, 13], [3, 4, 5, 6, 7, 8, 9, 1, 3, 4, 5, 6]]
    tokens, lengths, _, state, _ = prefill_for_drafter(target, drafter, rows)
    ctx = RoundContext(seq=jnp.asarray(tokens), seq_len=lengths, done=jnp.zeros((3,), bool))
    assert np.asarray(drafter.choose_lookup(ctx)[1]).tolist() == [2, 0, 4]
    key = jax.random.PRNGKey(0)
    for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)):
        draft, _ = drafter.propose(drafter.params, state, ctx, sampling, key)
        alone, _ = model.propose(drafter.params, state, ctx, sampling, key)
        assert np.asarray(draft.tokens[0, :2]).tolist() == [7, 8]
        np.testing.assert_array_equal(draft.tokens[0, 2:], alone.tokens[0, :4])
        shifted = np.where(np.asarray(alone.parents[0, :4]) >= 0, np.asarray(alone.parents[0, :4]) + 2, -1)
        assert np.asarray(draft.parents[0]).tolist() == [-1, 0] + shifted.tolist()
        np.testing.assert_array_equal(draft.valid[0], np.concatenate([[True, True], alone.valid[0, :4]]))
        np.testing.assert_array_equal(draft.tokens[1], alone.tokens[1])  # no match: the model's tree
        np.testing.assert_array_equal(draft.parents[1], alone.parents[1])
        assert np.asarray(draft.tokens[2]).tolist() == [7, 8, 9, 1, 3, 4]  # the lookup's chain alone
        assert np.asarray(draft.parents[2]).tolist() == [-1, 0, 1, 2, 3, 4] and np.asarray(draft.valid[2]).all()
        if sampling.greedy:
            assert draft.probs is None
            greedy = draft
            # the model's node scores ride along; the lookup's nodes carry none (-1)
            want = np.concatenate([[-1.0, -1.0], np.asarray(alone.scores[0, :4])])
            np.testing.assert_allclose(draft.scores[0], want, rtol=1e-6)
            np.testing.assert_allclose(draft.scores[1], alone.scores[1], rtol=1e-6)
            assert (np.asarray(draft.scores[2]) == -1).all()
        else:
            np.testing.assert_array_equal(draft.probs[0, :2], jax.nn.one_hot(jnp.asarray([7, 8]),
                                                                             target.cfg.vocab_size))
            np.testing.assert_allclose(draft.probs[0, 2:], alone.probs[0, :4], rtol=1e-5, atol=1e-12)
    copying = RoundContext(seq=ctx.seq, seq_len=ctx.seq_len, done=jnp.asarray([False, True, False]))
    both, _ = drafter.propose(drafter.params, state, copying, SamplingParams(temperature=0.0), key)
    np.testing.assert_array_equal(both.tokens[0], greedy.tokens[0])  # the model's nodes are still there


@pytest.mark.parametrize("model", ["dspark", "self_spec", "dspark_tree", "lookup_beside_tree"])
def test_greedy_output_equals_ar_at_fixed_and_adaptive_width(model):
    """DSpark and self-speculation (the model's forward is skipped when every row copies; self-speculation's
    next propose catches up on the committed tokens), DSpark drafting a token tree (the
    copying rows carry the lookup's chain as a one-branch tree; the adaptive width may verify a prefix), and
    that tree with the lookup's branch beside the model's nodes (`lookup_nodes`; from a 4-token match the
    lookup's chain alone)."""
    target = peaky_target(1)  # its greedy continuations of PROMPTS repeat themselves within 40 tokens
    policy, costs = "greedy_chain", (1.0, 1.1, 1.3)  # one round cost per verify width: 0, 1, 3 drafts
    if model == "dspark":
        drafter = hybrid(target, min_match=1)
    elif model in ("dspark_tree", "lookup_beside_tree"):
        tree = as_tree(random_dspark(target, 3), 6, top_k=2, depth=3)
        beside = {"lookup_nodes": 3, "alone_match": 4} if "beside" in model else {}
        drafter = HybridDrafter(tree, NgramDrafter(6, max_ngram=3), 1, **beside)
        policy = "greedy_tree"
        costs = (1.0, 1.1, 1.3, 1.6)  # widths 0, 1, 3, 6
        assert drafter.kind == "tree" and drafter.ordered_tree
    else:
        drafter = HybridDrafter(create_drafter("self_spec", target, 3, num_layers=1), NgramDrafter(3), 1)
    ar = generate(target, PROMPTS, 40).tokens
    fixed = speculative_generate(target, drafter, PROMPTS, policy=policy, max_new_tokens=40)
    assert fixed.tokens == ar and fixed.metrics.accepted_draft_tokens > 0
    adaptive = speculative_generate(target, drafter, PROMPTS, policy=policy, max_new_tokens=40,
                                    verify_buckets="auto", scheduler=AdaptiveWidth(**given_costs((costs, 0.05))))
    assert adaptive.tokens == ar
    if drafter.kind == "tree":  # valued per node, by the model's node scores where it drafted
        scored = AdaptiveWidth(**given_costs((costs, 0.05)), tree_value="nodes", score_bins=(0.3, 0.7))
        out = speculative_generate(target, drafter, PROMPTS, policy=policy, max_new_tokens=40,
                                   verify_buckets="auto", scheduler=scored)
        assert out.tokens == ar


def test_sampled_output_is_target_distribution():
    """`specdec/testing.py`'s exact check (the joint law of 9 tokens at T=0.7 with top-k and top-p). Every
    token of PROMPT occurs earlier in it, so lookup rows (one-hot q) and model rows (DSpark's sampled q) both
    occur, and rows change kind from round to round."""
    target = distribution_target()
    assert_lossless(*sampled_joint(target, hybrid(target, min_match=2), "rejection_chain"))


class _LookupAsSampled(HybridDrafter):
    """A mutant: the lookup's nodes carry the model's q (as if the lookup's tokens had been drawn from it) instead
    of their one-hot, so the rejection test accepts a lookup token with min(1, p / q) instead of p."""

    def lookup_beside_model(self, lookup, model):
        tree = super().lookup_beside_model(lookup, model)
        n = self.lookup_nodes
        return dataclasses.replace(tree, probs=tree.probs.at[:, :n].set(model.probs[:, :n]))


def test_lookup_beside_a_sampled_tree_is_lossless_and_a_wrong_q_is_not():
    """The exact check with the lookup's branch (q one-hot, tried first) beside DSpark's sampled tree
    (`multidraft_tree` over siblings of both kinds, T=0.7 with top-k / top-p), rows changing kind from round to
    round (the model's tree, the lookup beside it, the lookup's chain alone from a 3-token match); the mutant
    whose lookup nodes carry the model's q is biased, and the check sees it (at MUTANT_ROWS = 2000 rows: whole-
    sequence p 2e-59)."""
    small, make = sampled_tree_drafters()
    tree = make(dspark.DSparkDrafter)
    drafter = HybridDrafter(tree, NgramDrafter(6, max_ngram=3), min_match=2, lookup_nodes=2, alone_match=3)
    counts, impossible, m = sampled_joint(small, drafter, "multidraft_tree")
    assert_lossless(counts, impossible, m)
    assert m.accepted_draft_tokens > 0
    assert_biased(*sampled_joint(small, _LookupAsSampled(tree, NgramDrafter(6, max_ngram=3), 2, 2),
                                 "multidraft_tree", MUTANT_ROWS)[:2])


def test_bad_settings_are_clear_errors(tiny_target):
    with pytest.raises(ValueError, match="min_match must be >= 1"):
        hybrid(tiny_target, min_match=0)
    host_side = create_drafter("suffix", tiny_target, 4)
    with pytest.raises(ValueError, match="must draft in JAX"):
        HybridDrafter(host_side, NgramDrafter(4), 2)
    with pytest.raises(ValueError, match="unknown parameter"):
        create_drafter("hybrid", tiny_target, 3, min_macth=2)
    with pytest.raises(ValueError, match="drafts a chain here"):
        HybridDrafter(random_dspark(tiny_target, 3), NgramDrafter(3), 2, lookup_nodes=1)
    tree = as_tree(random_dspark(tiny_target, 3), 6, top_k=2, depth=3)
    with pytest.raises(ValueError, match=r"lookup_nodes must be in \[0, num_draft_tokens = 6\)"):
        HybridDrafter(tree, NgramDrafter(6), 2, lookup_nodes=6)
    with pytest.raises(ValueError, match="alone_match=2 .* needs lookup_nodes > 0 and alone_match > min_match"):
        HybridDrafter(tree, NgramDrafter(6), 2, lookup_nodes=3, alone_match=2)
