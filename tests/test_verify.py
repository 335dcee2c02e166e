"""Golden cases and cross-policy equivalences for the verification policies (specdec/verify).

Distributional losslessness of the sampling policies is tested separately in test_lossless_policies.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec.drafter import Draft
from specdec.sampling import SamplingParams
from specdec.trees import tree_from_paths
from specdec.verify import POLICY_NAMES, Policy, get_policy

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0)


@functools.lru_cache(maxsize=None)
def jitted(name: str, options: tuple = ()):
    """One jitted verify per policy, kept alive so its compilations are reused across tests."""
    return jax.jit(get_policy(name, **dict(options)).verify, static_argnums=2)


def run(name: str, draft: Draft, logits, sampling=GREEDY, seed: int = 0, **options):
    return jitted(name, tuple(sorted(options.items())))(draft, jnp.asarray(logits, jnp.float32), sampling,
                                                         jax.random.key(seed))


def softmax(x) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def sample_np(rng, probs) -> np.ndarray:
    """Categorical draws over the last axis in numpy (eager jax.random would cost a compile per shape)."""
    cdf = np.cumsum(probs, axis=-1)
    return np.minimum((rng.uniform(size=probs.shape[:-1] + (1,)) > cdf).sum(-1), probs.shape[-1] - 1)


def logits_with_argmax(argmax, vocab: int, seed: int = 0) -> np.ndarray:
    """Logits [B, T, V] whose argmax is `argmax` [B, T], with random noise elsewhere (so ties cannot occur)."""
    argmax = np.asarray(argmax)
    noise = np.random.default_rng(seed).uniform(0, 1, argmax.shape + (vocab,))
    return noise + 5.0 * np.eye(vocab)[argmax]


def check_invariants(result, draft: Draft):
    """Properties every VerifyResult must have, whatever the policy."""
    a = np.asarray(result.num_accepted)
    tokens, path = np.asarray(result.tokens), np.asarray(result.path)
    parents, valid, draft_tokens = (np.asarray(x) for x in (draft.parents, draft.valid, draft.tokens))
    b, n = draft_tokens.shape
    assert tokens.shape == (b, n + 1) and path.shape == (b, n) and a.shape == (b,)
    for row in range(b):
        assert 0 <= a[row] <= n
        assert (path[row, a[row]:] == -1).all() and (tokens[row, a[row] + 1:] == -1).all()
        assert tokens[row, a[row]] >= 0
        previous = -1
        for j in range(a[row]):
            node = path[row, j]
            assert valid[row, node], "an invalid node was accepted"
            assert parents[row, node] == previous, "accepted nodes do not form a root path"
            assert tokens[row, j] == draft_tokens[row, node]
            previous = node


def random_tree(rng, batch: int, n: int, vocab: int, distinct_siblings: bool = True):
    """Random topologically sorted trees (per row) with random tokens; siblings get distinct tokens."""
    parents = np.zeros((batch, n), np.int32)
    tokens = np.zeros((batch, n), np.int32)
    for row in range(batch):
        used: dict[int, list[int]] = {}
        for i in range(n):
            parents[row, i] = rng.integers(-1, i) if i else -1
            taken = used.setdefault(int(parents[row, i]), [])
            choices = [t for t in range(vocab) if t not in taken] if distinct_siblings else list(range(vocab))
            if not choices:  # parent already has `vocab` children: hang this node below the root's last child
                parents[row, i], choices = -1, [t for t in range(vocab) if t not in used[-1]] or list(range(vocab))
            tokens[row, i] = rng.choice(choices)
            used.setdefault(int(parents[row, i]), []).append(int(tokens[row, i]))
    return tokens, parents


def random_valid(rng, parents):
    """Random validity with the contract's rule: children of invalid nodes are invalid."""
    valid = rng.uniform(size=parents.shape) > 0.15
    for row in range(parents.shape[0]):
        for i in range(parents.shape[1]):
            if parents[row, i] >= 0 and not valid[row, parents[row, i]]:
                valid[row, i] = False
    return valid


def tree_logits_matching(rng, tokens, parents, vocab, match_prob=0.6):
    """Target logits at [root, nodes] whose argmax often equals one of the children (so paths get accepted)."""
    b, n = tokens.shape
    argmax = rng.integers(0, vocab, (b, n + 1))
    for row in range(b):
        for t in range(n + 1):
            children = [i for i in range(n) if parents[row, i] == t - 1]
            if children and rng.uniform() < match_prob:
                argmax[row, t] = tokens[row, rng.choice(children)]
    return logits_with_argmax(argmax, vocab, seed=int(rng.integers(1 << 30)))


# ----------------------------------------------------------------------------------------------------------
# Golden chain cases: every policy at temperature 0 must give these results
# ----------------------------------------------------------------------------------------------------------

CHAIN_TOKENS = [[5, 6, 7]] * 4
CHAIN_VALID = [[True, True, True], [True, True, True], [True, True, True], [True, True, False]]
CHAIN_TARGET = [[5, 6, 7, 1],  # all accepted, bonus 1
                [2, 6, 7, 1],  # none accepted, correction 2
                [5, 6, 3, 4],  # mixed: two accepted, correction 3
                [5, 6, 7, 0]]  # the row's draft ends after two nodes: the target's own 7 follows
CHAIN_EXPECTED_A = [3, 0, 2, 2]
CHAIN_EXPECTED_TOKENS = [[5, 6, 7, 1], [2, -1, -1, -1], [5, 6, 3, -1], [5, 6, 7, -1]]
CHAIN_EXPECTED_PATH = [[0, 1, 2], [-1, -1, -1], [0, 1, -1], [0, 1, -1]]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_chain_golden_at_temperature_zero(name):
    draft = Draft.chain(jnp.array(CHAIN_TOKENS), valid=jnp.array(CHAIN_VALID))
    result = run(name, draft, logits_with_argmax(CHAIN_TARGET, vocab=8))
    np.testing.assert_array_equal(result.num_accepted, CHAIN_EXPECTED_A)
    np.testing.assert_array_equal(result.tokens, CHAIN_EXPECTED_TOKENS)
    np.testing.assert_array_equal(result.path, CHAIN_EXPECTED_PATH)
    np.testing.assert_array_equal(result.num_committed, np.array(CHAIN_EXPECTED_A) + 1)
    check_invariants(result, draft)


@pytest.mark.parametrize("name", ["rejection_chain", "multidraft_tree"])
def test_soft_draft_probs_at_temperature_zero_still_greedy(name):
    """A drafter that passes untransformed soft probabilities at temperature 0 must not change the output."""
    draft = Draft.chain(jnp.array(CHAIN_TOKENS), probs=np.full((4, 3, 8), 1 / 8), valid=jnp.array(CHAIN_VALID))
    result = run(name, draft, logits_with_argmax(CHAIN_TARGET, vocab=8))
    np.testing.assert_array_equal(result.tokens, CHAIN_EXPECTED_TOKENS)


# ----------------------------------------------------------------------------------------------------------
# Golden tree cases
# ----------------------------------------------------------------------------------------------------------

# nodes: 0 = [0] token 1, 1 = [1] token 2, 2 = [0,0] token 3, 3 = [0,1] token 4, 4 = [1,0] token 5
TREE = tree_from_paths([[0], [1], [0, 0], [0, 1], [1, 0]])
TREE_TOKENS = [[1, 2, 3, 4, 5]] * 4
# target argmax at [root, node0, node1, node2, node3, node4]
TREE_TARGET = [[2, 0, 5, 0, 0, 6],  # root -> node1 (2), node1 -> node4 (5), bonus 6 at node4
               [1, 4, 0, 0, 7, 0],  # root -> node0 (1), node0 -> node3 (4), bonus 7 at node3
               [6, 3, 5, 0, 0, 0],  # nothing matches at the root: correction 6
               [1, 7, 5, 0, 0, 0]]  # root -> node0, then no child matches: correction 7
TREE_EXPECTED_A = [2, 2, 0, 1]
TREE_EXPECTED_TOKENS = [[2, 5, 6, -1, -1, -1], [1, 4, 7, -1, -1, -1], [6, -1, -1, -1, -1, -1],
                        [1, 7, -1, -1, -1, -1]]
TREE_EXPECTED_PATH = [[1, 4, -1, -1, -1], [0, 3, -1, -1, -1], [-1] * 5, [0, -1, -1, -1, -1]]


@pytest.mark.parametrize("name", ["greedy_tree", "multidraft_tree", "typical"])
def test_tree_golden_at_temperature_zero(name):
    draft = Draft.tree(jnp.array(TREE_TOKENS), TREE.batched_parents(4))
    result = run(name, draft, logits_with_argmax(TREE_TARGET, vocab=8))
    np.testing.assert_array_equal(result.num_accepted, TREE_EXPECTED_A)
    np.testing.assert_array_equal(result.tokens, TREE_EXPECTED_TOKENS)
    np.testing.assert_array_equal(result.path, TREE_EXPECTED_PATH)
    check_invariants(result, draft)


@pytest.mark.parametrize("name", ["greedy_tree", "multidraft_tree", "typical"])
def test_tree_invalid_nodes_are_never_accepted(name):
    valid = np.ones((4, 5), bool)
    valid[0, 4] = False  # row 0 loses node4: stops at node1, whose argmax (5) is the correction
    valid[1, [0, 2, 3]] = False  # row 1 loses node0 and its children: nothing accepted, correction 1
    draft = Draft.tree(jnp.array(TREE_TOKENS), TREE.batched_parents(4), valid=jnp.array(valid))
    result = run(name, draft, logits_with_argmax(TREE_TARGET, vocab=8))
    np.testing.assert_array_equal(result.num_accepted, [1, 0, 0, 1])
    np.testing.assert_array_equal(result.tokens[:, :3], [[2, 5, -1], [1, -1, -1], [6, -1, -1], [1, 7, -1]])
    check_invariants(result, draft)


def test_greedy_tree_prefers_the_deeper_of_duplicate_siblings():
    # nodes 0 and 1 both carry token 3 at the root; only node 1 has a matching child
    draft = Draft.tree(jnp.array([[3, 3, 4]]), jnp.array([[-1, -1, 1]]))
    result = run("greedy_tree", draft, logits_with_argmax([[3, 0, 4, 2]], vocab=6))
    np.testing.assert_array_equal(result.tokens, [[3, 4, 2, -1]])
    np.testing.assert_array_equal(result.path, [[1, 2, -1]])


# ----------------------------------------------------------------------------------------------------------
# Equivalences on random inputs
# ----------------------------------------------------------------------------------------------------------

# The random cases share one shape and one sampling setting so that they share compilations.
RB, RN, RV = 64, 8, 4
SAMPLED_TOPK = SamplingParams(temperature=0.9, top_k=3)


def transformed_np(logits, sampling: SamplingParams) -> np.ndarray:
    """numpy twin of specdec.sampling.probabilities for temperature + top-k (test inputs without ties)."""
    scaled = logits / sampling.temperature
    kth = np.sort(scaled, axis=-1)[..., -sampling.top_k][..., None]
    return softmax(np.where(scaled < kth, -np.inf, scaled))


def random_chain_case(rng):
    """Chain drafts of random length whose tokens often equal the target argmax."""
    tokens = rng.integers(0, RV, (RB, RN))
    target = np.where(rng.uniform(size=(RB, RN + 1)) < 0.8, np.pad(tokens, ((0, 0), (0, 1))),
                      rng.integers(0, RV, (RB, RN + 1)))
    valid = np.arange(RN)[None, :] < rng.integers(0, RN + 1, (RB, 1))
    return tokens, valid, logits_with_argmax(target, RV, seed=int(rng.integers(1 << 30)))


def assert_same_result(a, b):
    for field in ("num_accepted", "tokens", "path"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)


def test_greedy_tree_equals_greedy_chain_on_chains():
    tokens, valid, logits = random_chain_case(np.random.default_rng(1))
    draft = Draft.chain(jnp.array(tokens), valid=jnp.array(valid))
    chain = run("greedy_chain", draft, logits)
    assert_same_result(chain, run("greedy_tree", draft, logits))
    assert 0 < np.asarray(chain.num_accepted).mean() < RN  # the case mixes acceptance lengths


@pytest.mark.parametrize("probabilistic", [False, True])
def test_rejection_chain_at_temperature_zero_equals_greedy_chain(probabilistic):
    tokens, valid, logits = random_chain_case(np.random.default_rng(2))
    # at temperature 0 a consistent drafter's q is the one-hot of its own argmax, i.e. of the drafted token
    probs = np.eye(RV)[tokens] if probabilistic else None
    draft = Draft.chain(jnp.array(tokens), probs=probs, valid=jnp.array(valid))
    greedy = run("greedy_chain", draft, logits)
    for seed in range(3):
        assert_same_result(greedy, run("rejection_chain", draft, logits, seed=seed))


@pytest.mark.parametrize("name", ["multidraft_tree", "typical"])
def test_tree_policies_at_temperature_zero_equal_greedy_tree(name):
    rng = np.random.default_rng(3)
    tokens, parents = random_tree(rng, RB, RN, RV)
    valid = random_valid(rng, parents)
    draft = Draft.tree(jnp.array(tokens), jnp.array(parents), valid=jnp.array(valid))
    logits = tree_logits_matching(rng, tokens, parents, RV)
    greedy = run("greedy_tree", draft, logits)
    assert 0 < np.asarray(greedy.num_accepted).mean() and np.asarray(greedy.num_accepted).max() >= 3
    for seed in range(2):
        other = run(name, draft, logits, seed=seed)
        assert_same_result(greedy, other)
        check_invariants(other, draft)


@pytest.mark.parametrize("probabilistic", [False, True])
def test_multidraft_tree_on_a_chain_is_rejection_chain(probabilistic):
    """Same key, same uniforms: on a chain the two lossless policies must make identical decisions."""
    rng = np.random.default_rng(4)
    q = transformed_np(rng.normal(size=(RB, RN, RV)) * 1.5, SAMPLED_TOPK)
    tokens = sample_np(rng, q) if probabilistic else np.argmax(q, -1)
    valid = np.arange(RN)[None, :] < rng.integers(1, RN + 1, (RB, 1))
    draft = Draft.chain(tokens, probs=q if probabilistic else None, valid=jnp.array(valid))
    logits = rng.normal(size=(RB, RN + 1, RV)) * 1.5
    chain = run("rejection_chain", draft, logits, SAMPLED_TOPK, seed=7)
    assert_same_result(chain, run("multidraft_tree", draft, logits, SAMPLED_TOPK, seed=7))
    a = np.asarray(chain.num_accepted)
    assert (a == 0).any() and (a > 0).any()


@pytest.mark.parametrize("name", ["rejection_chain", "multidraft_tree", "typical"])
def test_sampling_policies_random_invariants(name):
    rng = np.random.default_rng(6)
    if name == "rejection_chain":
        tokens, parents = rng.integers(0, RV, (RB, RN)), np.tile(np.arange(RN) - 1, (RB, 1))
    else:
        tokens, parents = random_tree(rng, RB, RN, RV, distinct_siblings=False)
    valid = random_valid(rng, parents)
    probs = transformed_np(rng.normal(size=(RB, RN, RV)), SAMPLED_TOPK)
    draft = Draft.tree(jnp.array(tokens), jnp.array(parents), probs=probs, valid=jnp.array(valid))
    result = run(name, draft, rng.normal(size=(RB, RN + 1, RV)), SAMPLED_TOPK, seed=3)
    check_invariants(result, draft)


# ----------------------------------------------------------------------------------------------------------
# Rejection-sampling specifics at temperature > 0
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["rejection_chain", "multidraft_tree"])
def test_draft_equal_to_target_is_always_accepted(name):
    rng = np.random.default_rng(8)
    logits = rng.normal(size=(RB, RN + 1, RV))
    p = transformed_np(logits, SAMPLED_TOPK)
    tokens = sample_np(rng, p[:, :RN])
    result = run(name, Draft.chain(tokens, probs=p[:, :RN]), logits, SAMPLED_TOPK)
    np.testing.assert_array_equal(result.num_accepted, RN)


@pytest.mark.parametrize("name", ["rejection_chain", "multidraft_tree"])
def test_rejected_deterministic_token_is_never_the_correction(name):
    """q one-hot at x: the residual is p with x removed, so a rejected x cannot be emitted again."""
    b, v = 2000, 4
    draft = Draft.chain(jnp.zeros((b, 1), jnp.int32))
    result = run(name, draft, np.zeros((b, 2, v)), SAMPLED)  # p uniform: accept x=0 w.p. 1/4
    a, tokens = np.asarray(result.num_accepted), np.asarray(result.tokens)
    assert (tokens[a == 0, 0] != 0).all()
    assert abs((a == 1).mean() - 0.25) < 0.04
    # the three other tokens share the rejections evenly (each 1/4 of all rows)
    for t in (1, 2, 3):
        assert abs((tokens[a == 0, 0] == t).mean() - 1 / 3) < 0.05


@pytest.mark.parametrize("name", ["rejection_chain", "multidraft_tree"])
def test_token_masked_out_by_top_k_is_never_accepted(name):
    b, v = 500, 5
    logits = np.tile(np.array([3.0, 2.0, 1.0, 0.5, 0.0]), (b, 2, 1))
    draft = Draft.chain(jnp.full((b, 1), 4), probs=jnp.full((b, 1, v), 0.2))
    result = run(name, draft, logits, SamplingParams(temperature=1.0, top_k=2))
    assert (np.asarray(result.num_accepted) == 0).all()
    assert np.isin(np.asarray(result.tokens)[:, 0], [0, 1]).all()


@pytest.mark.parametrize("name", ["rejection_chain", "multidraft_tree"])
def test_invalid_node_gets_a_bonus_from_p_not_a_residual(name):
    """A row that proposed nothing must sample from p itself; treating the invalid slot as a rejection of its
    (garbage) token would remove that token from p."""
    b, v = 2000, 4  # the shape of the previous test: one compilation for both
    logits = np.tile(np.array([0.0, 0.0, 0.0, 30.0]), (b, 2, 1))  # p is (numerically) one-hot at token 3
    draft = Draft.chain(jnp.full((b, 1), 3), valid=jnp.zeros((b, 1), bool))
    result = run(name, draft, logits, SAMPLED)
    np.testing.assert_array_equal(result.num_accepted, 0)
    np.testing.assert_array_equal(np.asarray(result.tokens)[:, 0], 3)


def test_multidraft_acceptance_rate_with_two_deterministic_siblings():
    """p = (0.5, 0.3, 0.2), siblings 2 then 1: first accepted w.p. 0.2, else the second w.p. 0.3 / 0.8."""
    b = 20000
    logits = np.log(np.tile(np.array([0.5, 0.3, 0.2]), (b, 3, 1)))
    draft = Draft.tree(jnp.tile(jnp.array([2, 1]), (b, 1)), jnp.array([-1, -1]))
    result = run("multidraft_tree", draft, logits, SAMPLED)
    path0 = np.asarray(result.path)[:, 0]
    assert abs((path0 == 0).mean() - 0.2) < 0.015
    assert abs((path0 == 1).mean() - 0.8 * 0.3 / 0.8) < 0.015
    first = np.asarray(result.tokens)[:, 0]
    np.testing.assert_allclose([(first == t).mean() for t in range(3)], [0.5, 0.3, 0.2], atol=0.015)


# ----------------------------------------------------------------------------------------------------------
# Typical acceptance
# ----------------------------------------------------------------------------------------------------------

def test_typical_thresholds_golden():
    # row 0: p uniform over 4 -> threshold min(0.09, 0.3 * 1/4) = 0.075 < 0.25: accepted
    # row 1: p = (0.97, 0.01, 0.01, 0.01): threshold 0.09 > 0.01: token 1 rejected
    # row 2: same p, token 0 (0.97) accepted
    p = np.array([[0.25] * 4, [0.97, 0.01, 0.01, 0.01], [0.97, 0.01, 0.01, 0.01]])
    logits = np.log(np.repeat(p[:, None, :], 2, axis=1))
    draft = Draft.chain(jnp.array([[1], [1], [0]]))
    result = run("typical", draft, logits, SAMPLED)
    np.testing.assert_array_equal(result.num_accepted, [1, 0, 1])
    # a lower epsilon admits the 1% token of row 1
    result = run("typical", draft, logits, SAMPLED, epsilon=0.005)
    np.testing.assert_array_equal(result.num_accepted, [1, 1, 1])


def test_typical_breaks_length_ties_by_likelihood():
    # p at the root: token 1 has 0.35, token 2 has 0.45; both children accepted with one grandchild each
    root = np.log(np.array([0.2, 0.35, 0.45, 1e-9]))
    flat = np.zeros(4)
    logits = np.stack([root, flat, flat, flat, flat])[None]
    draft = Draft.tree(jnp.array([[1, 2, 0, 0]]), jnp.array([[-1, -1, 0, 1]]))
    result = run("typical", draft, logits, SAMPLED)
    np.testing.assert_array_equal(result.path, [[1, 3, -1, -1]])


def test_typical_is_declared_lossy():
    assert get_policy("typical").lossless is False
    assert all(get_policy(n).lossless for n in POLICY_NAMES if n != "typical")


# ----------------------------------------------------------------------------------------------------------
# Registry and API
# ----------------------------------------------------------------------------------------------------------

def test_registry_flags_and_errors():
    assert set(POLICY_NAMES) == {"greedy_chain", "rejection_chain", "greedy_tree", "multidraft_tree", "typical",
                                 "invariant_chain", "invariant_tree"}
    assert not any(get_policy(n).supports_trees for n in ("greedy_chain", "rejection_chain", "invariant_chain"))
    assert all(get_policy(n).supports_trees for n in ("greedy_tree", "multidraft_tree", "invariant_tree"))
    with pytest.raises(ValueError, match="allowed: greedy_chain, rejection_chain"):
        get_policy("nucleus")
    with pytest.raises(ValueError, match="no option"):
        get_policy("greedy_chain", epsilon=0.1)
    assert get_policy("typical") == get_policy("typical", epsilon=0.09, delta=0.3)
    assert hash(get_policy("typical", delta=0.2)) != hash(get_policy("typical"))
    assert isinstance(get_policy("typical"), Policy)


def test_tree_counterparts_keep_the_acceptance_rule():
    """A chain policy runs as its tree counterpart on tree drafters: a tree policy, greedy iff the chain one is,
    and lossless iff it is; every chain policy has one."""
    for name in POLICY_NAMES:
        policy = get_policy(name)
        assert (policy.tree_counterpart is None) == policy.supports_trees, name
        if policy.tree_counterpart is not None:
            tree = get_policy(policy.tree_counterpart)
            assert tree.supports_trees and (tree.greedy_only, tree.lossless) == (policy.greedy_only, policy.lossless)


@pytest.mark.parametrize("name", ["greedy_chain", "greedy_tree"])
def test_greedy_policies_refuse_sampling(name):
    draft = Draft.chain(jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="temperature 0"):
        get_policy(name).verify(draft, jnp.zeros((1, 3, 4)), SAMPLED, jax.random.key(0))


def test_shapes_are_checked():
    draft = Draft.chain(jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match=r"\[B, N\+1, V\]"):
        get_policy("greedy_chain").verify(draft, jnp.zeros((2, 3, 4)), GREEDY, jax.random.key(0))
    with pytest.raises(ValueError, match=r"draft.probs must be"):
        get_policy("rejection_chain").verify(Draft.chain(jnp.zeros((2, 3), jnp.int32), probs=jnp.ones((2, 3, 5))),
                                             jnp.zeros((2, 4, 4)), SAMPLED, jax.random.key(0))
    with pytest.raises(ValueError, match="at least one node"):
        get_policy("greedy_tree").verify(Draft.chain(jnp.zeros((2, 0), jnp.int32)), jnp.zeros((2, 1, 4)), GREEDY,
                                         jax.random.key(0))


def test_draft_chain_helper_and_pytree():
    draft = Draft.chain(jnp.array([[4, 5, 6]]))
    np.testing.assert_array_equal(draft.parents, [[-1, 0, 1]])
    assert draft.valid.dtype == bool and bool(draft.valid.all()) and draft.probs is None
    leaves = jax.tree.leaves(draft)
    assert len(leaves) == 3  # tokens, parents, valid (probs None is an empty subtree)
    doubled = jax.tree.map(lambda x: x * 2, Draft.chain(jnp.ones((1, 2), jnp.int32), probs=jnp.ones((1, 2, 3))))
    np.testing.assert_array_equal(doubled.probs, 2.0)
