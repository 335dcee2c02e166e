"""Tree verification: the draft is a tree of alternatives, and at most one root-to-node path is accepted.

Two ways to pick the path:
- `greedy_tree` (and `typical`) decide each node on its own (does it match the target at its parent?), so
  every node can be judged at once and the longest fully-accepted path is taken.
- `multidraft_tree` is sequential by nature: whether a sibling is accepted depends on which siblings before
  it were rejected (the target distribution shrinks to a residual after each rejection). It walks the nodes
  once in index order; topological order guarantees a node's parent was decided before the node is reached.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specdec import trees
from specdec.sampling import SamplingParams, probabilities
from specdec.drafter import Draft, VerifyResult
from specdec.verify.base import (Policy, commit, correction_noise, final_sample, rejection_noise, require_greedy,
                                 residual)


def longest_accepted_path(parents: jax.Array, accepted: jax.Array,
                          path_score: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The deepest node whose whole path from the root is accepted, per row.

    accepted: bool [B, N], each node's own verdict (False for invalid nodes). Among equally deep candidates
    the one with the highest sum of `path_score` over its path wins (Medusa breaks ties by likelihood), else
    the lowest index. Returns (num_accepted int32 [B], path int32 [B, N] padded with -1, last node int32 [B],
    -1 when nothing was accepted).
    """
    b, n = parents.shape
    rows = jnp.arange(b)
    anc = trees.ancestor_matrix(parents)  # [B, N, N]
    reachable = ~jnp.any(anc & ~accepted[:, None, :], axis=2)
    depth = jnp.sum(anc, axis=2, dtype=jnp.int32)
    num_accepted = jnp.max(jnp.where(reachable, depth, 0), axis=1)
    best = reachable & (depth == num_accepted[:, None])
    tie = jnp.zeros((b, n)) if path_score is None else jnp.sum(jnp.where(anc, path_score[:, None, :], 0.0), axis=2)
    last = jnp.where(num_accepted > 0, jnp.argmax(jnp.where(best, tie, -jnp.inf), axis=1), -1).astype(jnp.int32)

    on_path = anc[rows, jnp.maximum(last, 0)] & (last >= 0)[:, None]
    slot = jnp.where(on_path, depth - 1, n)  # a path node at depth d goes to path[d - 1]; others to a dump slot
    path = jnp.full((b, n + 1), -1, jnp.int32).at[rows[:, None], slot].set(jnp.arange(n, dtype=jnp.int32))
    return num_accepted.astype(jnp.int32), path[:, :n], last


def greedy_tree(draft: Draft, target_logits: jax.Array, sampling: SamplingParams,
                key: jax.Array) -> VerifyResult:
    """Follow the target's argmax down the tree; commit the argmax at the last accepted node.

    A node is accepted if its token is the target's argmax at its parent and its parent was accepted. Siblings
    normally carry distinct tokens, so at most one child matches; if duplicates were proposed, the deeper
    subtree wins (the committed tokens are the greedy continuation either way).
    """
    del key
    require_greedy("greedy_tree", sampling)
    return match_tree(draft, jnp.argmax(target_logits, axis=-1).astype(jnp.int32))


def match_tree(draft: Draft, target: jax.Array) -> VerifyResult:
    """Follow the target's tokens down the tree (int32 [B, N+1]: index 0 at the root, i+1 at node i): a node is
    accepted iff its token is the target's token at its parent and its parent was accepted; commit the target's
    token at the last accepted node. The target's tokens are fixed before the draft is looked at (the argmax,
    or the keyed samples of `specdec.verify.invariant`)."""
    at_parent = jnp.take_along_axis(target, draft.parents + 1, axis=1)
    accepted = draft.valid & (draft.tokens == at_parent)
    num_accepted, path, last = longest_accepted_path(draft.parents, accepted)
    next_token = jnp.take_along_axis(target, (last + 1)[:, None], axis=1)[:, 0]
    return commit(draft.tokens, path, num_accepted, next_token)


def multidraft_tree(draft: Draft, target_logits: jax.Array, sampling: SamplingParams,
                    key: jax.Array) -> VerifyResult:
    """Recursive rejection sampling over siblings (SpecInfer's multi-step speculative sampling): lossless.

    Standing at an accepted node (initially the root) with target distribution p there, try its children in
    index order: accept child x with probability min(1, p(x) / q(x)) and move to it (p becomes the target at
    x); on rejection replace p by norm(max(p - q, 0)) and try the next sibling. Each try is an ordinary
    rejection-sampling step whose rejection branch hands the residual to the next one, so the token finally
    taken at this node (an accepted child, or a draw from the last residual when all children fail) is
    exactly p-distributed. That holds when each child was drawn from its own q independently of its
    siblings' test outcomes: i.i.d. samples (siblings with replacement), draws without replacement each
    carrying q less its earlier siblings (`trees.draw_children`), or deterministic picks (q one-hot:
    rejection zeroes that token in p and renormalises, so distinct top-k siblings work too); and when whether
    a child exists says nothing about its own draw (`trees.grow_dynamic_tree`). A node without
    children ends the walk with a bonus token from p. At temperature 0 this is `greedy_tree` (for siblings
    with distinct tokens).
    """
    b, n = draft.tokens.shape
    vocab = target_logits.shape[-1]
    rows = jnp.arange(b)
    p = probabilities(target_logits, sampling)  # [B, N+1, V]
    q_x = draft.token_probs()
    u = rejection_noise(key, draft)

    def visit(i, state):
        current, dist, num_accepted, path = state
        x = draft.tokens[:, i]
        is_child = draft.valid[:, i] & (draft.parents[:, i] == current)  # a sibling still in the running
        accept = is_child & (u[:, i] * q_x[:, i] < dist[rows, x])
        reject = is_child & ~accept
        node = jnp.full((b,), i, jnp.int32)
        dist = jnp.where(accept[:, None], p[:, i + 1],
                         jnp.where(reject[:, None], residual(dist, draft.dist_at(node, vocab)), dist))
        path = jnp.where(accept[:, None] & (jnp.arange(n) == num_accepted[:, None]), i, path)
        return (jnp.where(accept, i, current), dist, num_accepted + accept.astype(jnp.int32), path)

    init = (jnp.full((b,), -1, jnp.int32), p[:, 0], jnp.zeros((b,), jnp.int32), jnp.full((b, n), -1, jnp.int32))
    _, dist, num_accepted, path = jax.lax.fori_loop(0, n, visit, init)
    return commit(draft.tokens, path, num_accepted, final_sample(correction_noise(key, num_accepted, vocab), dist))


GREEDY_TREE = Policy("greedy_tree", lossless=True, supports_trees=True, greedy_only=True, impl=greedy_tree)
MULTIDRAFT_TREE = Policy("multidraft_tree", lossless=True, supports_trees=True, greedy_only=False,
                         impl=multidraft_tree)
