"""Token trees: static tree shapes, the tree attention mask, dynamic (EAGLE-2) tree selection, the drawing of
sampled trees (each node's children drawn without replacement with the target's noise at their position, so the
first child is the coupled sample the invariant policies accept), and KV-cache compaction after a tree verify.

Conventions (shared with `specdec.drafter.Draft` and `specdec.models.transformer.forward`):
- A tree of N nodes hangs below a root, the last committed token. Node i has a parent index in [-1, i): -1 is
  the root, and parents always come before their children (topological order), so a single left-to-right
  pass sees every parent before its children.
- In a verify forward the root and the nodes are fed together as T = N + 1 new tokens, root first: token 0 is
  the root, token i + 1 is node i. The root is written at cache slot `lengths[b]`, node i at
  `lengths[b] + 1 + i`; the RoPE position of token t is `lengths[b] + depth[b, t]` (root depth 0).
- After verification only the accepted path keeps its K/V: `compact_cache` moves it to the slots a chain of
  the same tokens would have used, and the engine then advances the lengths by 1 + num_accepted.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specdec.drafter import Draft
from specdec.models.transformer import KVCache
from specdec.sampling import SamplingParams, gumbel_noise, probabilities


# ----------------------------------------------------------------------------------------------------------
# Static trees (Medusa / EAGLE-1 "choices")
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class StaticTree:
    """A fixed tree shape, built once on the host. Equal (and hashed) by its paths, so it can be static config.

    Node i corresponds to `paths[i]`, the list of top-k ranks from the root down to it: [0, 1] is the
    second-best continuation of the best first token. Nodes are in BFS order (by depth, then by ranks).
    """

    paths: tuple[tuple[int, ...], ...]
    parents: np.ndarray  # int32 [N], -1 = root
    depth: np.ndarray  # int32 [N], 1 for the root's children (the root itself has depth 0)
    rank: np.ndarray  # int32 [N], which candidate of its parent (0 = the parent's top-1 continuation)

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.num_nodes else 0

    @property
    def topk_per_depth(self) -> tuple[int, ...]:
        """How many candidates a drafter must produce at each depth (max rank + 1), e.g. one per Medusa head."""
        return tuple(int(self.rank[self.depth == d].max()) + 1 for d in range(1, self.max_depth + 1))

    def batched_parents(self, batch_size: int) -> jax.Array:
        """The parents as the int32 [B, N] array a `Draft` carries."""
        return jnp.broadcast_to(jnp.asarray(self.parents, jnp.int32), (batch_size, self.num_nodes))

    def __eq__(self, other) -> bool:
        return isinstance(other, StaticTree) and self.paths == other.paths

    def __hash__(self) -> int:
        return hash(self.paths)


def tree_from_paths(paths: Sequence[Sequence[int]], keep_order: bool = False) -> StaticTree:
    """Build a StaticTree from Medusa / EAGLE-1 style choices, e.g. [[0], [1], [0, 0], [0, 1], [1, 0]].

    The nodes come in BFS order, or with `keep_order` in the order given (which must list every path after its
    prefix and after its lower-ranked siblings: a priority order, see `rank_prior_tree`).
    Raises ValueError on an empty list, an empty or non-integer or negative path, a duplicate, or a path
    whose prefix is missing (every node needs its parent in the tree).
    """
    if len(paths) == 0:
        raise ValueError("a tree needs at least one path")
    clean = []
    for path in paths:
        path = tuple(path)
        if not path:
            raise ValueError("empty path: the root is implicit, every path names at least one node")
        if any(not isinstance(r, (int, np.integer)) or isinstance(r, bool) or r < 0 for r in path):
            raise ValueError(f"path {list(path)} must hold non-negative integer ranks")
        clean.append(tuple(int(r) for r in path))
    if len(set(clean)) != len(clean):
        dupes = sorted({p for p in clean if clean.count(p) > 1})
        raise ValueError(f"duplicate paths: {[list(p) for p in dupes]}")
    present = set(clean)
    for path in clean:
        for cut in range(1, len(path)):
            if path[:cut] not in present:
                raise ValueError(f"path {list(path)} needs its prefix {list(path[:cut])}, which is missing")

    ordered = sorted(clean, key=lambda p: (len(p), p))  # BFS: parents (shorter prefixes) come first
    if keep_order:
        seen = set()
        for path in clean:
            before = [path[:-1]] if len(path) > 1 else []
            before += [path[:-1] + (r,) for r in range(path[-1]) if path[:-1] + (r,) in present]
            if any(p not in seen for p in before):
                raise ValueError(f"keep_order: path {list(path)} comes before its prefix or a lower-ranked sibling")
            seen.add(path)
        ordered = clean
    index = {p: i for i, p in enumerate(ordered)}
    parents = np.array([index[p[:-1]] if len(p) > 1 else -1 for p in ordered], np.int32)
    depth = np.array([len(p) for p in ordered], np.int32)
    rank = np.array([p[-1] for p in ordered], np.int32)
    return StaticTree(paths=tuple(ordered), parents=parents, depth=depth, rank=rank)


def _prior_value(accept: float) -> Callable:
    log_hit, log_miss = float(np.log(accept)), float(np.log1p(-accept))
    return lambda path: sum(log_hit + r * log_miss for r in path)  # the log of a rank path's prior value


def _prior_order(top_k: int, depth: int, accept: float):
    """Every rank path (ranks < `top_k`, at most `depth` long) in falling prior value (`rank_prior_tree`): each
    after its parent and its lower-ranked siblings. Ties: shallower first, then by ranks."""
    value = _prior_value(accept)
    heap = [(-value((r,)), 1, (r,)) for r in range(top_k)]
    heapq.heapify(heap)
    while heap:
        _, length, path = heapq.heappop(heap)
        yield path
        if length < depth:
            for r in range(top_k):
                child = path + (r,)
                heapq.heappush(heap, (-value(child), length + 1, child))


def _check_prior(num_nodes: int, top_k: int, depth: int, accept: float) -> None:
    if num_nodes < 1 or top_k < 1 or depth < 1:
        raise ValueError(f"a sampled tree needs num_nodes, top_k and depth >= 1, got {num_nodes}, {top_k}, {depth}")
    if not 0.0 < accept < 1.0:
        raise ValueError(f"a sampled tree's prior acceptance (tree_accept) must be in (0, 1), got {accept}")


def rank_prior_tree(num_nodes: int, top_k: int, depth: int, accept: float = 0.5) -> StaticTree:
    """The fixed shape of a SAMPLED token tree: the `num_nodes` rank paths (ranks < `top_k`, at most `depth`
    long) of highest prior value, best first (Sequoia's tree under a position-independent acceptance vector).

    A node's value is the product over its path of `accept * (1 - accept) ** rank`: the assumed probability
    that the rank-r draw at its parent is the one accepted there, for a drafter whose first draw is accepted
    with probability `accept` and each later draw as often among what is left (0.5: 0.5, 0.25, 0.125, ...;
    a high `accept` gives a deep spine, a low one a bushy top). A sampled tree cannot be pruned by its drawn
    tokens' scores the way an EAGLE-2 tree is
    (`select_dynamic_tree`): keeping a node because of the value it drew would bias the rejection test, so the
    shape is fixed before any draw. Values fall along every path and along every sibling list, so the order
    is topological with siblings in draw order, and every prefix is the best smaller tree
    (`Drafter.ordered_tree`). Ties: shallower first, then by ranks.
    """
    _check_prior(num_nodes, top_k, depth, accept)
    capacity = sum(top_k ** d for d in range(1, depth + 1))
    if num_nodes > capacity:
        raise ValueError(f"num_nodes={num_nodes} exceeds the {capacity} nodes of a tree of top_k={top_k}, "
                         f"depth={depth}")
    return tree_from_paths(list(itertools.islice(_prior_order(top_k, depth, accept), num_nodes)), keep_order=True)


# ----------------------------------------------------------------------------------------------------------
# Sampled trees: children drawn without replacement, coupled to the target's sample
# ----------------------------------------------------------------------------------------------------------

PRIOR_ACCEPT = 0.5  # the prior first-draw acceptance (`rank_prior_tree`) a sampled dynamic tree is shaped by


def level_quotas(num_nodes: int, top_k: int, depth: int, accept: float = PRIOR_ACCEPT) -> tuple[int, ...]:
    """How many nodes each depth 1..`depth` of a SAMPLED dynamic tree keeps (`grow_dynamic_tree` with `draw`):
    the depth profile of `rank_prior_tree(num_nodes, top_k, depth, accept)`, each depth capped at what the
    growth offers there (`top_k` children of each of the at most `top_k` nodes expanded at the depth above).
    The quotas are fixed before any draw, so they say nothing about a draw."""
    check_tree_budget(num_nodes, top_k, depth)
    _check_prior(num_nodes, top_k, depth, accept)
    counts = [1] + [0] * depth  # counts[0]: the root
    for path in _prior_order(top_k, depth, accept):
        if sum(counts) - 1 == num_nodes:
            break
        d = len(path)
        if counts[d] < top_k * min(counts[d - 1], top_k):
            counts[d] += 1
    return tuple(counts[1:])


def draft_noise(key, offsets: jax.Array, vocab_size: int, d2t: jax.Array | None = None) -> jax.Array:
    """The target's Gumbel noise [B, ..., Vd] (`sampling.gumbel_noise`) at offsets int32 [B, ...] for the
    Vd = `vocab_size` tokens of a draft vocabulary (`d2t` [Vd]: their target ids; None: the target's own), so
    a drafter's draw gives each token the noise the target's own sample gives it at that position."""
    ids = jnp.arange(vocab_size, dtype=jnp.int32) if d2t is None else d2t
    return gumbel_noise(key, offsets, ids)


def without_earlier_draws(q: jax.Array, earlier: jax.Array) -> jax.Array:
    """q [..., V] with the tokens `earlier` [..., r] already drawn removed and renormalised (zeros when
    nothing is left): the distribution the next draw without replacement comes from."""
    left = q * (1.0 - jnp.sum(jax.nn.one_hot(earlier, q.shape[-1], dtype=q.dtype), axis=-2))
    total = jnp.sum(left, axis=-1, keepdims=True)
    return left / jnp.where(total > 0, total, 1.0)


def draw_children(q: jax.Array, k: int, gumbel: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`k` children drawn WITHOUT replacement from q [..., V] by the Gumbel-top-k trick with the noise `gumbel`
    (broadcast to q's shape), in draw order: their ids [..., k], the law each was drawn from [..., k, V] (q
    with the earlier draws removed and renormalised: what multidraft_tree's recursive rejection must divide
    by), and valid [..., k] (q had a token left to draw: top-k / top-p may leave fewer than k).

    With the noise of the children's position (`draft_noise`) the first child is Gumbel-max on log q with the
    target's noise there: the coupled draw, which is the target's own sample when q = p, and the next children
    are the next argmaxes (list matching, OpenReview GJbrk55Bt8), so an invariant policy finds the target's
    sample among them whenever it ranks high in q. The draws are taken on log q itself, so no token outside the
    returned q (q = 0) is ever drawn."""
    logq = jnp.where(q > 0, jnp.log(jnp.where(q > 0, q, 1.0)), -jnp.inf)
    scores, ids = jax.lax.top_k(logq + gumbel, k)
    dists = jnp.stack([without_earlier_draws(q, ids[..., :r]) for r in range(k)], axis=-2)
    return ids, dists, scores > -jnp.inf


def sampled_children(sampling: SamplingParams, key, top_k: int, d2t: jax.Array | None = None) -> Callable:
    """`grow_dynamic_tree`'s `draw` for a SAMPLED dynamic tree: each expanded node's `top_k` children drawn
    without replacement from q at that node (`probabilities` of its logits) with the target's noise at their
    position (`draw_children`; `d2t`: the draft vocabulary's target ids), the level's nodes sharing it. The
    rank-r child is ranked by the r-th largest log q at its parent, not by what it drew: its score (and so
    whether it is kept or expanded) does not depend on its own draw, and a child scores at most its parent
    and its earlier siblings (ties go to the lower index)."""

    def draw(logits, level):  # the children of the level's frontier: the tokens at offset `level`
        q = probabilities(logits, sampling)  # [B, n, Vd]
        offsets = jnp.full((q.shape[0], 1), level, jnp.int32)  # [B, 1]: every node of the level shares it
        ids, dists, valid = draw_children(q, top_k, draft_noise(key, offsets, q.shape[-1], d2t))
        logq = jnp.where(q > 0, jnp.log(jnp.where(q > 0, q, 1.0)), -jnp.inf)
        ranked = jax.lax.top_k(logq, top_k)[0]  # the score of the rank-r child, whatever it drew
        return jnp.where(valid, ranked, -jnp.inf), ids, dists, valid

    return draw


# ----------------------------------------------------------------------------------------------------------
# Ancestors, attention mask, depths
# ----------------------------------------------------------------------------------------------------------

def ancestor_matrix(parents: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """anc[b, i, j] = node j is node i or one of its ancestors (root excluded): bool [B, N, N].

    One pass in node order: a node's row is its parent's row plus itself, which topological order makes
    available. Invalid nodes are treated as children of the root, so whatever their parent field holds they
    only see themselves (and the root).
    """
    b, n = parents.shape
    parents = parents.astype(jnp.int32)
    if valid is not None:
        parents = jnp.where(valid, parents, -1)
    rows = jnp.arange(b)
    eye = jnp.eye(n, dtype=bool)

    def add_node(i, anc):
        parent = parents[:, i]
        parent_row = anc[rows, jnp.clip(parent, 0, n - 1)] & (parent >= 0)[:, None]
        return anc.at[:, i].set(parent_row | eye[i])

    return jax.lax.fori_loop(0, n, add_node, jnp.zeros((b, n, n), bool))


def tree_attention(parents: jax.Array, valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The `tree_mask` for `transformer.forward` over [root, nodes], and each token's depth.

    Returns mask bool [B, N+1, N+1] (token t may attend to token u: the root sees itself; node i sees the
    root, its ancestors and itself) and depth int32 [B, N+1] (root 0, its children 1, ...). The RoPE
    positions of the verify forward are `cache.lengths[:, None] + depth`, which gives every node the
    position it would have in a chain along its own path.
    """
    b, n = parents.shape
    anc = ancestor_matrix(parents, valid)
    node_rows = jnp.concatenate([jnp.ones((b, n, 1), bool), anc], axis=2)
    root_row = jnp.broadcast_to(jnp.arange(n + 1) == 0, (b, 1, n + 1))
    mask = jnp.concatenate([root_row, node_rows], axis=1)
    depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.sum(anc, axis=2, dtype=jnp.int32)], axis=1)
    return mask, depth


def levels_present(mask: jax.Array, depth: jax.Array) -> jax.Array:
    """bool [B, N]: whether any node in `mask` [B, N] sits at depth j + 1, from `tree_attention`'s depth
    [B, N+1] (for a chain, level j is node j)."""
    n = mask.shape[1]
    levels = jnp.arange(1, n + 1)[None, :, None]
    return jnp.any(mask[:, None, :] & (depth[:, None, 1:] == levels), axis=2)


# ----------------------------------------------------------------------------------------------------------
# Dynamic trees (EAGLE-2)
# ----------------------------------------------------------------------------------------------------------

def check_tree_budget(num_draft_tokens: int, top_k: int, depth: int) -> None:
    """A dynamic tree of `depth` levels expanding `top_k` frontier nodes by `top_k` children each must have at
    least `num_draft_tokens` candidates to keep (drafters that grow EAGLE-2 trees check this when built)."""
    if top_k < 1 or depth < 1:
        raise ValueError(f"tree drafting needs tree_top_k >= 1 and tree_depth >= 1, got {top_k}, {depth}")
    candidates = top_k + (depth - 1) * top_k * top_k
    if num_draft_tokens > candidates:
        raise ValueError(f"num_draft_tokens={num_draft_tokens} exceeds the {candidates} candidates a tree of "
                         f"top_k={top_k}, depth={depth} produces")


def dynamic_tree_write_width(top_k: int, depth: int) -> int:
    """The most draft K/V positions one level of an EAGLE-2 tree expansion writes past the committed ones:
    the last level re-runs every expanded node, (depth - 1) * top_k of them. A drafter's cache needs that
    much room after the longest committed context, or the write would be shifted back over committed K/V
    (`transformer.write_rows` keeps writes in bounds that way)."""
    return (depth - 1) * top_k


def select_dynamic_tree(tokens: jax.Array, parents: jax.Array, scores: jax.Array, num_nodes: int,
                        probs: jax.Array | None = None, valid: jax.Array | None = None,
                        best_first: bool = False) -> tuple[Draft, jax.Array]:
    """Keep the `num_nodes` candidates with the highest cumulative draft log-prob and renumber them as a Draft.

    Expected candidate layout (C candidates per row, in the order they were generated):
      tokens  int32 [B, C]    the candidate token
      parents int32 [B, C]    index of its parent among the candidates, -1 = the root; parents[b, c] < c.
                              EAGLE-2 order: the root's top-k children, then the children of the k nodes
                              expanded at depth 1, and so on; unexpanded candidates simply have no children.
      scores  float [B, C]    cumulative draft log-prob of the path root -> c (sum of log q along it)
      probs   float [B, C, V] optional: the distribution c was drawn from (q at its parent). Only pass it if
                              the candidate was *sampled* from it; top-k picks are deterministic, and lossless
                              verification must then treat them as one-hot (probs=None).
      valid   bool [B, C]     optional: candidates that exist (others are never selected as valid nodes)

    Why the result is always a tree: a child's score is its parent's plus a log-prob <= 0, so a kept node's
    ancestors score at least as high. To stay correct with ties (a child with log-prob 0) and with scores that
    are not exactly monotone, scores are first made monotone along every path (a node's score is capped by
    its parent's) and ties are broken by candidate index, so a parent (lower index) always outranks its
    children. The kept candidates are then sorted by index, which keeps the order topological; or, with
    `best_first`, left in score order (highest first, ties by index), which is topological for the same reason
    and makes every prefix of the draft the best tree of its size (`Drafter.ordered_tree`).

    Returns the Draft (N = num_nodes; `valid` False for slots filled with invalid candidates when a row has
    fewer than num_nodes valid ones) and `selected` int32 [B, num_nodes], the candidate index of each node
    (for the drafter to gather per-node state).
    """
    b, c = tokens.shape
    if num_nodes > c:
        raise ValueError(f"cannot keep num_nodes={num_nodes} out of {c} candidates")
    rows = jnp.arange(b)
    parents = parents.astype(jnp.int32)
    scores = scores.astype(jnp.float32)
    if valid is not None:
        scores = jnp.where(valid, scores, -jnp.inf)

    def cap_by_parent(i, s):
        parent = parents[:, i]
        parent_score = jnp.where(parent >= 0, s[rows, jnp.clip(parent, 0, c - 1)], jnp.inf)
        return s.at[:, i].set(jnp.minimum(s[:, i], parent_score))

    scores = jax.lax.fori_loop(0, c, cap_by_parent, scores)
    top_scores, chosen = jax.lax.top_k(scores, num_nodes)  # equal scores: lower index first
    if not best_first:  # index order
        order = jnp.argsort(chosen, axis=1)
        chosen, top_scores = (jnp.take_along_axis(x, order, axis=1) for x in (chosen, top_scores))
    chosen = chosen.astype(jnp.int32)
    kept_valid = top_scores > -jnp.inf

    new_index = jnp.full((b, c), -1, jnp.int32).at[rows[:, None], chosen].set(jnp.arange(num_nodes, dtype=jnp.int32))
    old_parent = jnp.take_along_axis(parents, chosen, axis=1)
    new_parent = jnp.where(old_parent >= 0,
                           jnp.take_along_axis(new_index, jnp.maximum(old_parent, 0), axis=1), -1)
    kept_probs = None if probs is None else jnp.take_along_axis(probs, chosen[..., None], axis=1)
    draft = Draft(tokens=jnp.take_along_axis(tokens, chosen, axis=1).astype(jnp.int32),
                  parents=new_parent.astype(jnp.int32), probs=kept_probs, valid=kept_valid)
    return draft, chosen


def grow_dynamic_tree(root_logits: jax.Array, expand: Callable, top_k: int, depth: int, num_nodes: int,
                      root_inputs: Any = None, to_target: Callable | None = None, best_first: bool = False,
                      draw: Callable | None = None, prior_accept: float = PRIOR_ACCEPT) -> Draft:
    """EAGLE-2's dynamic tree, grown from a drafter's logits at the root [B, V]: expand the `top_k` best nodes
    of each depth by their `top_k` most likely children for `depth` levels, then keep the `num_nodes`
    candidates with the highest cumulative draft log-probability (`select_dynamic_tree`).

    The drafter supplies one model step, `expand(tokens, depth, mask, inputs) -> (logits, outputs)`, run once per
    level over every node expanded so far, in expansion order: tokens int32 [B, W], depth int32 [B, W] below
    the root (1 = a child of the root), the ancestor mask bool [B, W, W], and the nodes' `inputs` (what their
    parents output; None for a drafter that needs none). It returns the logits [B, top_k, V] of the last
    `top_k` nodes (the frontier just expanded) and their `outputs` [B, top_k, ...] (or None), which become
    their children's inputs; `root_inputs` [B, top_k, ...] are the depth-1 nodes' inputs. `to_target` maps
    draft-vocabulary ids to target ids (a reduced draft vocabulary). Candidates are top-k picks, not samples,
    so the draft is deterministic (probs=None): multidraft_tree verifies it losslessly at any temperature.
    `best_first`: the nodes in score order (`select_dynamic_tree`), so any prefix is the best smaller tree.

    `draw(logits [B, n, V], level) -> (scores, ids, probs, valid)` replaces the top-k picks of every node's
    children: ids [B, n, k] the children's tokens, scores [B, n, k] their log-probs for the ranking, probs
    [B, n, k, V] the distribution each was drawn from, valid [B, n, k]. Children sampled without replacement
    with the target's noise at their position (`sampled_children`) make it a SAMPLED dynamic tree, which keeps
    its nodes level by level instead of by one cut over all levels: depth d keeps its best candidates by score,
    as many as the depth profile of the fixed sampled tree gives it (`level_quotas` with `prior_accept`; quota
    its candidates cannot fill, e.g. under top-p, passes to the next depth), and only kept nodes are expanded.
    The nodes then come level by level (siblings in draw order), whatever `best_first`. Why: every node's
    children at one depth are drawn with the same noise (the coupling), so cousins' draws are correlated, and a
    candidate one level deeper is scored by q at its parent, which reads the parent's draw. One cut over all
    levels would let a cousin's draw decide whether a node exists (or where a prefix cuts it off), so its
    existence would tell something about its own draw, and multidraft_tree's test, which divides by the q it
    was drawn from, would be biased. Level by level, whether and where a node exists depends only on the draws
    above its depth and its earlier siblings' draws (which the q of a draw without replacement excludes), and
    each child's score does not depend on its own draw (`sampled_children`).
    """
    k = top_k
    to_target = to_target or (lambda ids: ids)
    picks = draw is None
    if picks:  # every node's top-k tokens: picks, not samples
        draw = lambda logits, level: (*jax.lax.top_k(jax.nn.log_softmax(logits), k), None, None)
    front_score, front_ids, front_probs, front_valid = draw(root_logits[:, None], 0)  # the depth-1 frontier
    front_score, front_ids = front_score[:, 0], front_ids[:, 0]
    front_tokens = to_target(front_ids)
    batch = front_tokens.shape[0]
    rows = jnp.arange(batch)[:, None]
    front_cand = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (batch, k))
    at_root = jnp.full((batch, k), -1, jnp.int32)
    cand_tokens, cand_parents, cand_scores = [front_tokens], [at_root], [front_score]
    cand_probs = None if front_probs is None else [front_probs[:, 0]]
    cand_valid = None if front_valid is None else [front_valid[:, 0]]
    if not picks:  # a sampled tree's quota per depth: depth 1 keeps its best quota[0] existing candidates
        quota = level_quotas(num_nodes, k, depth, prior_accept)
        order_score, order = jax.lax.top_k(front_score, k)
        kept = (jnp.arange(k) < quota[0]) & (order_score > -jnp.inf)
        front_kept = jnp.zeros((batch, k), bool).at[rows, order].set(kept)  # [B, k] in candidate order
        left = quota[0] - jnp.sum(kept, axis=1)  # [B] quota passed to the next depth
        cand_valid[0] = front_kept
    exp_tokens, exp_parents, exp_inputs = front_tokens, at_root, root_inputs
    offset = k
    for level in range(1, depth):  # static loop over tree depth
        mask, node_depth = tree_attention(exp_parents)
        logits, outputs = expand(exp_tokens, node_depth[:, 1:], mask[:, 1:, 1:], exp_inputs)
        width = exp_tokens.shape[1]
        child_score, child_ids, child_probs, child_valid = draw(logits, level)  # [B, k, k]
        child_score = front_score[:, :, None] + child_score
        if not picks:  # only kept nodes have children
            child_score = jnp.where(front_kept[:, :, None], child_score, -jnp.inf)
        child_score = child_score.reshape(batch, k * k)
        child_tokens = to_target(child_ids).reshape(batch, k * k)
        cand_tokens.append(child_tokens)
        cand_parents.append(jnp.repeat(front_cand, k, axis=1))
        cand_scores.append(child_score)
        if cand_probs is not None:
            cand_probs.append(child_probs.reshape(batch, k * k, -1))
        order_score, order = jax.lax.top_k(child_score, k * k)  # the level's candidates, best first
        if not picks:  # the level keeps its best `quota` (+ what the level above left) candidates that exist
            kept = (jnp.arange(k * k) < (quota[level] + left)[:, None]) & (order_score > -jnp.inf)
            left = quota[level] + left - jnp.sum(kept, axis=1)
            cand_valid.append(jnp.zeros((batch, k * k), bool).at[rows, order].set(kept))
            front_kept = kept[:, :k]
        elif cand_valid is not None:
            cand_valid.append(child_valid.reshape(batch, k * k))
        front_score, pick = order_score[:, :k], order[:, :k]  # the next level expands the k best children
        front_cand = (offset + pick).astype(jnp.int32)
        parent = pick // k  # among the frontier just expanded
        exp_tokens = jnp.concatenate([exp_tokens, jnp.take_along_axis(child_tokens, pick, 1)], 1)
        exp_parents = jnp.concatenate([exp_parents, (width - k + parent).astype(jnp.int32)], 1)
        exp_inputs = jax.tree.map(lambda a, out: jnp.concatenate([a, jnp.take_along_axis(out, parent[..., None], 1)], 1),
                                  exp_inputs, outputs)
        offset += k * k
    cat = lambda parts: None if parts is None else jnp.concatenate(parts, 1)
    all_scores = cat(cand_scores)
    draft, chosen = select_dynamic_tree(cat(cand_tokens), cat(cand_parents), all_scores, num_nodes,
                                        probs=cat(cand_probs), valid=cat(cand_valid), best_first=best_first and picks)
    if not picks:
        return draft
    # top-k picks: each node's q at its parent's context (its path log-prob less its parent's), the drafter's
    # own estimate of its acceptance once the parent is accepted (`Draft.scores`)
    path = jnp.take_along_axis(all_scores, chosen, axis=1)
    above = jnp.where(draft.parents >= 0, jnp.take_along_axis(path, jnp.maximum(draft.parents, 0), axis=1), 0.0)
    q = jnp.exp(jnp.minimum(path - above, 0.0))
    return dataclasses.replace(draft, scores=jnp.where(draft.valid, q, 0.0).astype(jnp.float32))


# ----------------------------------------------------------------------------------------------------------
# KV-cache compaction
# ----------------------------------------------------------------------------------------------------------

def compact_cache(cache: KVCache, path: jax.Array, num_accepted: jax.Array) -> KVCache:
    """Move the K/V of the accepted path to where a chain would have put it.

    The verify forward wrote the root at slot lengths[b] and node i at lengths[b] + 1 + i. For j <
    num_accepted[b], node path[b, j] moves to slot lengths[b] + 1 + j; other slots are left as they are (they
    lie past the new length and will be overwritten). Lengths are unchanged: the engine advances them by
    1 + num_accepted afterwards. All sources are gathered before any write, so overlapping moves are safe.
    Works for per-layer [B, KVH, S, HD] arrays and stacked [L, B, KVH, S, HD] ones (the axes come from
    KVCache.batch_axis / seq_axis). For a chain (path = 0, 1, ...) it rewrites every slot with its own contents.
    """
    b, n = path.shape
    capacity = cache.capacity
    steps = jnp.arange(n, dtype=jnp.int32)[None, :]
    start = cache.lengths[:, None].astype(jnp.int32) + 1
    src = jnp.clip(start + jnp.maximum(path, 0), 0, capacity - 1)
    dst = jnp.where(steps < num_accepted[:, None], start + steps, capacity)  # capacity = out of range: dropped
    rows = jnp.arange(b)[:, None]

    def move(x):
        def at(slots):  # index (row, slot) pairs; every other axis whole
            index = [slice(None)] * x.ndim
            index[KVCache.batch_axis(x)], index[KVCache.seq_axis(x)] = rows, slots
            return tuple(index)
        return x.at[at(dst)].set(x[at(src)], mode="drop")

    return dataclasses.replace(cache, k=jax.tree.map(move, cache.k), v=jax.tree.map(move, cache.v))
