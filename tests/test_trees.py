"""Golden tests for specdec/trees.py: static trees, the tree attention mask, dynamic tree selection and KV-cache
compaction, plus one end-to-end check that a tree verify through the real transformer step equals the chain
it stands for."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec.models.config import tiny_config
from specdec.models.transformer import KVCache, forward, init_cache, init_params, unstack_layers
from specdec.trees import (StaticTree, ancestor_matrix, compact_cache, select_dynamic_tree, tree_attention,
                           tree_from_paths)

MEDUSA_LIKE = [[0], [1], [0, 0], [0, 1], [1, 0]]


# ----------------------------------------------------------------------------------------------------------
# Static trees
# ----------------------------------------------------------------------------------------------------------

def test_tree_from_paths_golden():
    tree = tree_from_paths([[1, 0], [0, 1], [0], [0, 0], [1]])  # any input order
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    np.testing.assert_array_equal(tree.parents, [-1, -1, 0, 0, 1])
    np.testing.assert_array_equal(tree.depth, [1, 1, 2, 2, 2])
    np.testing.assert_array_equal(tree.rank, [0, 1, 0, 1, 0])
    assert tree.num_nodes == 5 and tree.max_depth == 2 and tree.topk_per_depth == (2, 2)
    assert tree.parents.dtype == np.int32
    np.testing.assert_array_equal(tree.batched_parents(3), np.tile(tree.parents, (3, 1)))


def test_tree_from_paths_deeper_golden():
    tree = tree_from_paths([[0], [0, 0], [0, 0, 0], [1], [2], [0, 1], [0, 0, 1], [1, 0]])
    assert tree.paths == ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1))
    np.testing.assert_array_equal(tree.parents, [-1, -1, -1, 0, 0, 1, 3, 3])
    np.testing.assert_array_equal(tree.depth, [1, 1, 1, 2, 2, 2, 3, 3])
    np.testing.assert_array_equal(tree.rank, [0, 1, 2, 0, 1, 0, 0, 1])
    assert tree.topk_per_depth == (3, 2, 2)


def test_chain_of_paths_is_a_chain():
    tree = tree_from_paths([[0], [0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(tree.parents, [-1, 0, 1])


@pytest.mark.parametrize("paths, message", [
    ([], "at least one path"),
    ([[0], []], "empty path"),
    ([[0], [1, 0]], r"needs its prefix \[1\]"),
    ([[0], [0]], "duplicate"),
    ([[0], [-1]], "non-negative integer"),
    ([[0], [0.5]], "non-negative integer"),
])
def test_tree_from_paths_rejects_bad_input(paths, message):
    with pytest.raises(ValueError, match=message):
        tree_from_paths(paths)


def test_static_tree_is_hashable_by_paths():
    a, b = tree_from_paths(MEDUSA_LIKE), tree_from_paths(list(reversed(MEDUSA_LIKE)))
    assert a == b and hash(a) == hash(b) and a != tree_from_paths([[0]])
    assert isinstance(a, StaticTree)


# ----------------------------------------------------------------------------------------------------------
# Tree attention
# ----------------------------------------------------------------------------------------------------------

def test_tree_attention_golden():
    tree = tree_from_paths(MEDUSA_LIKE)
    mask, depth = tree_attention(tree.batched_parents(1))
    expected = np.array([
        # root n0 n1 n2 n3 n4
        [1, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0],  # n0 = [0]
        [1, 0, 1, 0, 0, 0],  # n1 = [1]
        [1, 1, 0, 1, 0, 0],  # n2 = [0, 0]
        [1, 1, 0, 0, 1, 0],  # n3 = [0, 1]
        [1, 0, 1, 0, 0, 1],  # n4 = [1, 0]
    ], bool)
    np.testing.assert_array_equal(mask[0], expected)
    np.testing.assert_array_equal(depth[0], [0, 1, 1, 2, 2, 2])
    assert mask.dtype == bool and depth.dtype == jnp.int32
    # RoPE positions for a row whose cache holds 7 tokens: the root at 7, depth-d nodes at 7 + d
    np.testing.assert_array_equal(jnp.array([7])[:, None] + depth, [[7, 8, 8, 9, 9, 9]])


def test_tree_attention_of_a_chain_is_causal():
    mask, depth = tree_attention(jnp.array([[-1, 0, 1, 2]]))
    np.testing.assert_array_equal(mask[0], np.tril(np.ones((5, 5), bool)))
    np.testing.assert_array_equal(depth[0], np.arange(5))


def test_tree_attention_per_row_trees_and_invalid_nodes():
    parents = jnp.array([[-1, 0, 1], [-1, -1, 0]])
    valid = jnp.array([[True, True, False], [True, True, True]])
    mask, depth = tree_attention(parents, valid)
    # row 0: node 2 is invalid: it sees only the root and itself, depth 1
    np.testing.assert_array_equal(mask[0, 3], [1, 0, 0, 1])
    np.testing.assert_array_equal(depth[0], [0, 1, 2, 1])
    # row 1: nodes 0 and 1 are siblings, node 2 is node 0's child
    np.testing.assert_array_equal(mask[1], [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]])
    np.testing.assert_array_equal(depth[1], [0, 1, 1, 2])


def test_ancestor_matrix_jits():
    anc = jax.jit(ancestor_matrix)(jnp.array([[-1, 0, 0, 2]]))
    np.testing.assert_array_equal(anc[0], [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]])


# ----------------------------------------------------------------------------------------------------------
# Dynamic tree selection (EAGLE-2)
# ----------------------------------------------------------------------------------------------------------

def test_select_dynamic_tree_golden():
    # candidates: 0, 1, 2 = root children; 3, 4 = children of 0; 5, 6 = children of 1
    tokens = jnp.array([[10, 11, 12, 13, 14, 15, 16],
                        [20, 21, 22, 23, 24, 25, 26]])
    parents = jnp.array([[-1, -1, -1, 0, 0, 1, 1]] * 2)
    scores = jnp.array([[-0.1, -1.0, -2.0, -0.3, -1.5, -1.2, -3.0],
                        [-2.0, -0.2, -0.5, -2.1, -2.5, -0.4, -0.3]])
    draft, selected = select_dynamic_tree(tokens, parents, scores, num_nodes=4)
    # row 0 keeps 0 (-0.1), 3 (-0.3), 1 (-1.0), 5 (-1.2); row 1 keeps 1, 6, 5, 2
    np.testing.assert_array_equal(selected, [[0, 1, 3, 5], [1, 2, 5, 6]])
    np.testing.assert_array_equal(draft.tokens, [[10, 11, 13, 15], [21, 22, 25, 26]])
    np.testing.assert_array_equal(draft.parents, [[-1, -1, 0, 1], [-1, -1, 0, 0]])
    assert bool(draft.valid.all()) and draft.probs is None
    # best first: the same nodes in score order, still parents before children, so every prefix is a tree
    draft, selected = select_dynamic_tree(tokens, parents, scores, num_nodes=4, best_first=True)
    np.testing.assert_array_equal(selected, [[0, 3, 1, 5], [1, 6, 5, 2]])
    np.testing.assert_array_equal(draft.tokens, [[10, 13, 11, 15], [21, 26, 25, 22]])
    np.testing.assert_array_equal(draft.parents, [[-1, 0, -1, 2], [-1, 0, 0, -1]])


def test_select_dynamic_tree_ties_and_non_monotone_scores_still_give_a_tree():
    # candidate 2 (child of 0) ties its parent; candidate 1 (child of 0 too) claims a higher score than its parent
    tokens = jnp.array([[5, 6, 7, 8]])
    parents = jnp.array([[-1, 0, 0, -1]])
    scores = jnp.array([[-1.0, -0.1, -1.0, -1.0]])
    draft, selected = select_dynamic_tree(tokens, parents, scores, num_nodes=2)
    np.testing.assert_array_equal(selected, [[0, 1]])  # node 1 is capped at -1.0; ties go to lower indices
    np.testing.assert_array_equal(draft.parents, [[-1, 0]])
    draft, selected = select_dynamic_tree(tokens, parents, scores, num_nodes=1)
    np.testing.assert_array_equal(selected, [[0]])


def test_select_dynamic_tree_with_invalid_candidates_and_probs():
    tokens = jnp.array([[1, 2, 3, 4]])
    parents = jnp.array([[-1, -1, 0, 1]])
    scores = jnp.array([[-0.5, -0.1, -0.7, -0.2]])
    valid = jnp.array([[True, False, True, False]])  # 1 invalid, so its child 3 cannot be used either
    probs = jnp.arange(4 * 3, dtype=jnp.float32).reshape(1, 4, 3)
    draft, selected = select_dynamic_tree(tokens, parents, scores, num_nodes=3, probs=probs, valid=valid)
    np.testing.assert_array_equal(selected, [[0, 1, 2]])
    np.testing.assert_array_equal(draft.valid, [[True, False, True]])
    np.testing.assert_array_equal(draft.parents, [[-1, -1, 0]])
    np.testing.assert_array_equal(draft.probs[0], probs[0, :3])


def test_select_dynamic_tree_random_eagle2_layout():
    """EAGLE-2 shaped candidates (k children per expanded node, k nodes expanded per level): the selection is a
    valid tree, and it is the global top-M by cumulative log-prob."""
    rng = np.random.default_rng(0)
    b, k, depth, m = 8, 3, 4, 10
    parents, logq = [-1] * k, list(np.log(rng.dirichlet(np.ones(5), size=b)[:, :k]).T)
    cum = [l for l in logq]
    frontier = list(range(k))
    for _ in range(depth - 1):
        new = []
        for f in frontier:
            child_logq = np.log(rng.dirichlet(np.ones(5), size=b)[:, :k])
            for j in range(k):
                parents.append(f)
                cum.append(cum[f] + child_logq[:, j])
                new.append(len(parents) - 1)
        frontier = new[:k]  # expand only k nodes per level, as EAGLE-2 does
    scores = np.stack(cum, axis=1)
    c = scores.shape[1]
    tokens = rng.integers(0, 100, (b, c))
    draft, selected = jax.jit(select_dynamic_tree, static_argnames="num_nodes")(
        jnp.array(tokens), jnp.tile(jnp.array(parents), (b, 1)), jnp.array(scores), num_nodes=m)
    new_parents = np.asarray(draft.parents)
    for row in range(b):
        assert (new_parents[row] < np.arange(m)).all()
        np.testing.assert_allclose(np.sort(scores[row, selected[row]]), np.sort(scores[row])[-m:], rtol=1e-6)
        for i in range(m):  # renumbered parent = the selected position of the original parent
            original_parent = parents[int(selected[row, i])]
            assert new_parents[row, i] == (-1 if original_parent < 0 else list(selected[row]).index(original_parent))
        np.testing.assert_array_equal(draft.tokens[row], tokens[row, selected[row]])


def test_select_dynamic_tree_rejects_too_many_nodes():
    with pytest.raises(ValueError, match="num_nodes"):
        select_dynamic_tree(jnp.zeros((1, 3), jnp.int32), jnp.full((1, 3), -1), jnp.zeros((1, 3)), num_nodes=4)


# ----------------------------------------------------------------------------------------------------------
# Cache compaction
# ----------------------------------------------------------------------------------------------------------

def labelled_cache(stacked: bool, lengths, b=4, s=12, layers=2, kvh=2, hd=2) -> KVCache:
    """A cache whose every entry names its own (layer, row, slot), so moves are easy to read back."""
    layer = np.arange(layers)[:, None, None, None, None]
    row = np.arange(b)[None, :, None, None, None]
    slot = np.arange(s)[None, None, None, :, None]
    k = np.broadcast_to(1000 * layer + 100 * row + slot, (layers, b, kvh, s, hd)).astype(np.float32)
    v = -k
    if stacked:
        return KVCache(k=jnp.array(k), v=jnp.array(v), lengths=jnp.array(lengths, jnp.int32))
    return KVCache(k=tuple(jnp.array(x) for x in k), v=tuple(jnp.array(x) for x in v),
                   lengths=jnp.array(lengths, jnp.int32))


def stacked_k(cache: KVCache) -> np.ndarray:
    """K as [L, B, KVH, S, HD]; every KV head holds the same labels."""
    k = np.stack(cache.k) if isinstance(cache.k, tuple) else np.asarray(cache.k)
    np.testing.assert_array_equal(k, np.broadcast_to(k[:, :, :1], k.shape))  # heads moved together
    return k


def slots_of(cache: KVCache) -> np.ndarray:
    """Which original slot each entry came from: [L, B, S]."""
    return stacked_k(cache)[:, :, 0, :, 0] % 100


@pytest.mark.parametrize("stacked", [False, True])
def test_compact_cache_golden(stacked):
    lengths = [2, 3, 0, 5]
    cache = labelled_cache(stacked, lengths)
    path = jnp.array([[1, 4, -1, -1, -1],   # row 0: tree path of two nodes
                      [0, 1, 2, 3, 4],      # row 1: a chain, all accepted: nothing moves
                      [-1, -1, -1, -1, -1],  # row 2: nothing accepted
                      [2, 3, 5, -1, -1]])   # row 3: three nodes, deeper ones far away
    num_accepted = jnp.array([2, 5, 0, 3])
    out = jax.jit(compact_cache)(cache, path, num_accepted)
    got = slots_of(out)
    expected = np.tile(np.arange(12), (4, 1))
    expected[0, 3:5] = [2 + 1 + 1, 2 + 1 + 4]  # node1 -> slot 3, node4 -> slot 4
    expected[3, 6:9] = [5 + 1 + 2, 5 + 1 + 3, 5 + 1 + 5]
    for layer in range(2):
        np.testing.assert_array_equal(got[layer], expected)
    np.testing.assert_array_equal(out.lengths, lengths)  # the engine advances them
    v = np.stack(out.v) if isinstance(out.v, tuple) else np.asarray(out.v)
    np.testing.assert_array_equal((-v[:, :, 0, :, 0]) % 100, got)  # values move with their keys
    k = stacked_k(out)[:, :, 0, :, 0]
    layer_of, row_of = k // 1000, (k % 1000) // 100
    np.testing.assert_array_equal(layer_of, np.broadcast_to(np.arange(2)[:, None, None], got.shape))  # no mixing
    np.testing.assert_array_equal(row_of, np.broadcast_to(np.arange(4)[None, :, None], got.shape))


def test_compact_cache_drops_moves_past_capacity():
    cache = labelled_cache(True, [9], b=1, s=12)
    out = compact_cache(cache, jnp.array([[1, 2, 3]]), jnp.array([3]))  # slots 10, 11, 12 (12 is out of range)
    np.testing.assert_array_equal(slots_of(out)[0, 0, 10:], [11, 11])


# ----------------------------------------------------------------------------------------------------------
# End to end with the transformer step
# ----------------------------------------------------------------------------------------------------------

def test_tree_verify_through_transformer_matches_chain():
    """Logits of every accepted node, and the cache after compaction, equal those of a chain forward of the same
    accepted tokens; one decode step afterwards agrees too. Rows have different prefix lengths and paths."""
    cfg = tiny_config()
    params = unstack_layers(init_params(cfg, jax.random.key(0), scale=0.2))
    step_fn = jax.jit(forward, static_argnums=1)
    b, capacity = 2, 24
    rng = np.random.default_rng(0)
    prompt = jnp.array(rng.integers(3, cfg.vocab_size, (b, 6)))
    cache = step_fn(params, cfg, init_cache(cfg, b, capacity), prompt).cache.with_lengths(jnp.array([6, 4]))

    tree = tree_from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [1, 0, 0]])  # parents [-1,-1,0,0,1,4]
    n = tree.num_nodes
    root = rng.integers(3, cfg.vocab_size, (b, 1))
    nodes = rng.integers(3, cfg.vocab_size, (b, n))
    mask, depth = tree_attention(tree.batched_parents(b))
    tree_out = step_fn(params, cfg, cache, jnp.array(np.concatenate([root, nodes], 1)),
                       cache.lengths[:, None] + depth, mask)

    path = np.array([[1, 4, 5], [0, 3, -1]])  # row 0 accepts [1] -> [1,0] -> [1,0,0]; row 1 [0] -> [0,1]
    num_accepted = np.array([3, 2])
    chain_tokens = np.concatenate([root, np.take_along_axis(nodes, np.maximum(path, 0), 1)], 1)
    chain_out = step_fn(params, cfg, cache, jnp.array(chain_tokens))

    tree_logits, chain_logits = np.asarray(tree_out.logits), np.asarray(chain_out.logits)
    close = dict(rtol=2e-4, atol=2e-4)
    for row in range(b):
        positions = [0] + [int(path[row, j]) + 1 for j in range(num_accepted[row])]  # root, then the path
        np.testing.assert_allclose(tree_logits[row, positions], chain_logits[row, :len(positions)], **close)

    compacted = compact_cache(tree_out.cache, jnp.array(path), jnp.array(num_accepted)).advance(1 + num_accepted)
    reference = chain_out.cache.advance(1 + num_accepted)
    for got, want in ((compacted.k, reference.k), (compacted.v, reference.v)):
        got, want = np.stack(got), np.stack(want)  # [L, B, KVH, S, HD]
        for row in range(b):
            end = 6 if row == 0 else 4
            end += 1 + num_accepted[row]
            np.testing.assert_allclose(got[:, row, :, :end], want[:, row, :, :end], **close)

    step = jnp.array(rng.integers(3, cfg.vocab_size, (b, 1)))
    np.testing.assert_allclose(step_fn(params, cfg, compacted, step).logits,
                               step_fn(params, cfg, reference, step).logits, **close)


def test_import_order_has_no_cycle():
    """specdec.trees and specdec.verify import each other's modules; both entry points must work."""
    for module in ("specdec.trees", "specdec.verify"):
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True, timeout=120)


def test_level_quotas_follow_the_prior_depth_profile_within_what_the_growth_offers():
    """A sampled dynamic tree keeps per depth as many nodes as `rank_prior_tree` has there (7 nodes, top-k 4,
    depth 3: 3, 3, 1 as in the golden shape below), capped at top_k children of each of the at most top_k nodes
    expanded at the depth above (21 nodes, top-k 3, depth 3: the prior tree has more than 9 nodes at depth 3,
    the growth offers 3 x 3 there, so depth 2 takes the rest), within the dynamic tree's candidate budget."""
    from specdec.trees import level_quotas, rank_prior_tree

    assert level_quotas(7, 4, 3) == (3, 3, 1)
    assert level_quotas(6, 2, 3) == (2, 3, 1)
    assert level_quotas(4, 1, 4) == (1, 1, 1, 1)
    assert level_quotas(7, 4, 4, accept=0.65) == (2, 3, 1, 1)
    assert int(np.sum(rank_prior_tree(21, 3, 3).depth == 3)) > 9
    assert level_quotas(21, 3, 3) == (3, 9, 9)
    with pytest.raises(ValueError, match="exceeds the 10 candidates"):
        level_quotas(11, 2, 3)


def test_rank_prior_tree_golden_shapes_and_errors():
    """The sampled trees' fixed shapes: best first under the rank prior accept * (1 - accept) ** rank, so siblings
    come in draw order after their parent and a higher prior acceptance buys a deeper spine."""
    from specdec.trees import rank_prior_tree

    bushy = rank_prior_tree(7, 4, 3, accept=0.5)  # values .5, .25, .25, .125 x 4 (ties: shallower, then ranks)
    assert bushy.paths == ((0,), (1,), (0, 0), (2,), (0, 1), (1, 0), (0, 0, 0))
    np.testing.assert_array_equal(bushy.parents, [-1, -1, 0, -1, 0, 1, 2])
    deep = rank_prior_tree(7, 4, 4, accept=0.65)
    assert deep.paths == ((0,), (0, 0), (0, 0, 0), (1,), (0, 0, 0, 0), (0, 1), (1, 0))
    assert rank_prior_tree(4, 1, 4).paths == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))  # one rank: the chain
    with pytest.raises(ValueError, match="exceeds the 6 nodes"):
        rank_prior_tree(7, 2, 2)
    with pytest.raises(ValueError, match="must be in \\(0, 1\\)"):
        rank_prior_tree(3, 2, 2, accept=1.0)
    with pytest.raises(ValueError, match="comes before its prefix or a lower-ranked sibling"):
        tree_from_paths([[1], [0]], keep_order=True)
    with pytest.raises(ValueError, match="comes before its prefix"):
        tree_from_paths([[0, 0], [0]], keep_order=True)
