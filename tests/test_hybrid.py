"""The hybrid drafter (drafters/hybrid.py): prompt lookup's draft in the rows whose context ends in a long enough
match, the trained drafter's elsewhere. Checked: the per-row choice and what each row's draft carries (tokens,
validity, one-hot q for lookup rows at T > 0, evidence classes), greedy output == AR through the engine at fixed
and adaptive widths, the engine's exact distribution test at T=0.7 with both kinds of rows, and clear errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drafters import create_drafter
from drafters.hybrid import HybridDrafter
from drafters.ngram import NgramDrafter
from specdec.adaptive import AdaptiveWidth
from specdec.drafter import RoundContext, match_length_class
from specdec.engine import speculative_generate
from specdec.generate import generate
from specdec.sampling import SamplingParams
from specdec.testing import (PROMPTS, assert_lossless, distribution_target, peaky_target, prefill_for_drafter,
                             sampled_joint)
from tests.test_dspark import as_tree
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


@pytest.mark.parametrize("model", ["dspark", "self_spec", "dspark_tree"])
def test_greedy_output_equals_ar_at_fixed_and_adaptive_width(model):
    """DSpark (skippable: its forward is skipped when every row copies), self-speculation (not skippable: its
    propose catches up on the committed tokens, so it runs every round) and DSpark drafting a token tree (the
    copying rows carry the lookup's chain as a one-branch tree; the adaptive width may verify a prefix)."""
    target = peaky_target(1)  # its greedy continuations of PROMPTS repeat themselves within 40 tokens
    policy, costs = "greedy_chain", (1.0, 1.1, 1.3)  # one round cost per verify width: 0, 1, 3 drafts
    if model == "dspark":
        drafter = hybrid(target, min_match=1)
    elif model == "dspark_tree":
        tree = as_tree(random_dspark(target, 3), 6, top_k=2, depth=3)
        drafter, policy = HybridDrafter(tree, NgramDrafter(6, max_ngram=3), 1), "greedy_tree"
        costs = (1.0, 1.1, 1.3, 1.6)  # widths 0, 1, 3, 6
        assert drafter.kind == "tree" and drafter.ordered_tree
    else:
        drafter = HybridDrafter(create_drafter("self_spec", target, 3, num_layers=1), NgramDrafter(3), 1)
        assert not drafter.skippable
    ar = generate(target, PROMPTS, 40).tokens
    fixed = speculative_generate(target, drafter, PROMPTS, policy=policy, max_new_tokens=40)
    assert fixed.tokens == ar and fixed.metrics.accepted_draft_tokens > 0
    adaptive = speculative_generate(target, drafter, PROMPTS, policy=policy, max_new_tokens=40,
                                    verify_buckets="auto", scheduler=AdaptiveWidth(costs=(costs, 0.05)))
    assert adaptive.tokens == ar


def test_sampled_output_is_target_distribution():
    """`specdec/testing.py`'s exact check (the joint law of 9 tokens at T=0.7 with top-k and top-p). Every
    token of PROMPT occurs earlier in it, so lookup rows (one-hot q) and model rows (DSpark's sampled q) both
    occur, and rows change kind from round to round."""
    target = distribution_target()
    assert_lossless(*sampled_joint(target, hybrid(target, min_match=2), "rejection_chain"))


def test_bad_settings_are_clear_errors(tiny_target):
    with pytest.raises(ValueError, match="min_match must be >= 1"):
        hybrid(tiny_target, min_match=0)
    host_side = create_drafter("suffix", tiny_target, 4)
    with pytest.raises(ValueError, match="must draft in JAX"):
        HybridDrafter(host_side, NgramDrafter(4), 2)
    with pytest.raises(ValueError, match="unknown parameter"):
        create_drafter("hybrid", tiny_target, 3, min_macth=2)
