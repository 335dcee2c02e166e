"""Drafter-invariant verification (Daliri et al. 2024, "Coupling without Communication and Drafter-Invariant
Speculative Decoding"): the committed tokens are AR's sampled tokens for the same seed, token for token.

The target's token at every verified position is fixed before any draft is looked at: the Gumbel-max sample of
its processed logits with the noise of (seed, row, absolute position) (`specdec.sampling.sample`), the very
draw AR decoding makes there. A draft node is accepted iff it equals the target's sample at its parent; the
correction / bonus token is the target's sample after the accepted path. So what is committed depends on the
drafter only through how many tokens each round commits, never through which: the same seed gives the same
text whatever the drafter, the verify widths the scheduler chose, the batch around a row (rows are keyed by
their index in the prompt list) or the round boundaries. Exactly so on exact arithmetic; on a real model the
verify forward over 1 + W positions and AR's 1-position forward differ by float rounding, which can flip a
near-tie between two tokens' perturbed logits (greedy decoding has the same caveat).

A drafter that samples with the same noise on its own q (Gumbel-max on log q at the node's position) proposes
the target's token whenever the two argmaxes agree, which is likely when q is close to p: the coupling of
Daliri et al. It accepts less than rejection sampling's min(1, p/q) on average (rejection sampling is the
optimal coupling), in exchange for outputs that can be compared token by token. In a tree the children of a
node share their position's noise; every sampling tree drafter (the draft LM's, self-speculation's, the
distilled draft LM's and EAGLE-3's dynamic trees, Medusa's static tree, DFlash / DSpark's fixed and dynamic
trees: `specdec.trees.draw_children`) draws them as the next argmaxes of log q + that noise (Gumbel top-k:
without replacement), so the first child is the coupled draw and the target's sample is among them when it
ranks high in q (list matching, OpenReview GJbrk55Bt8). A DFlash / DSpark fixed tree with `tree_accept: 0`
keeps its top-k picks at every temperature: still exact, but not coupled. At temperature 0 both policies are
`greedy_chain` / `greedy_tree`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specdec.drafter import Draft, VerifyResult
from specdec.sampling import SamplingParams, as_sample_key, sample
from specdec.verify.base import Policy, node_offsets
from specdec.verify.chain import match_chain
from specdec.verify.tree import match_tree


def target_samples(target_logits: jax.Array, sampling: SamplingParams, key, offsets: jax.Array) -> jax.Array:
    """The target's sample int32 [B, N+1] at every verified position: logits index i draws the token at offset
    `offsets[:, i]` (the root's successor at 0)."""
    return sample(as_sample_key(key, target_logits.shape[0]), target_logits, sampling, offsets)


def invariant_chain(draft: Draft, target_logits: jax.Array, sampling: SamplingParams, key) -> VerifyResult:
    """Accept while each draft token equals the target's keyed sample there; commit the target's sample after."""
    n = draft.num_nodes
    return match_chain(draft, target_samples(target_logits, sampling, key, jnp.arange(n + 1, dtype=jnp.int32)))


def invariant_tree(draft: Draft, target_logits: jax.Array, sampling: SamplingParams, key) -> VerifyResult:
    """Follow the target's keyed samples down the tree: a node is accepted iff its token is the target's sample
    at its parent (the sample of the parent's path at the parent's depth + 1) and its parent was accepted."""
    b = draft.batch_size
    offsets = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), node_offsets(draft.parents) + 1], axis=1)
    return match_tree(draft, target_samples(target_logits, sampling, key, offsets))


INVARIANT_CHAIN = Policy("invariant_chain", lossless=True, supports_trees=False, greedy_only=False,
                         impl=invariant_chain, tree_counterpart="invariant_tree", same_tokens_as_ar=True)
INVARIANT_TREE = Policy("invariant_tree", lossless=True, supports_trees=True, greedy_only=False, impl=invariant_tree,
                        same_tokens_as_ar=True)
