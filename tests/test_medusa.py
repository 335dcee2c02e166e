"""Medusa: the heads the engine runs equal the heads the loss trains (same hidden state, after prefill and after
a verify round), head k's label is token t+k+1, static trees hold the right candidates, and drafting is
lossless (static tree under greedy_tree / typical at temperature 0; the trained chain drafter's greedy
equality is in test_train)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drafters import medusa
from specdec.drafter import PromptInfo, RoundContext, VerifyResult
from specdec.engine import speculative_generate
from specdec.generate import generate, prefill
from specdec.sampling import GREEDY
from specdec.testing import PROMPTS
from specdec.train.features import TargetFeatures, online_features


@pytest.fixture(scope="module")
def target(peaky_target):
    return peaky_target


def make(target, num_heads=3, shared_head=False, k=3, tree_paths=None):
    task = medusa.make_task(target, num_heads=num_heads, shared_head=shared_head)
    params, _ = task.init(jax.random.PRNGKey(0), None)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    params = jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(kk, x.shape) for x, kk in zip(leaves, keys)])
    return task, params, medusa.MedusaDrafter.from_trained(task.arch, params, target, k, tree_paths)


@functools.partial(jax.jit, static_argnames=("cfg", "forward", "taps"))
def _features(tparams, tokens, *, cfg, forward, taps):
    f = online_features(tparams, cfg, forward, tokens, taps, True)
    return f.taps, f.logits


@pytest.mark.parametrize("shared_head", [False, True])
def test_engine_heads_equal_training_heads(target, shared_head):
    task, params, drafter = make(target, shared_head=shared_head)
    consts = task.frozen(target)
    prompt = [5, 9, 14, 3, 77, 31, 8]
    tokens = np.full((1, 32), 2, np.int32)
    tokens[0, : len(prompt)] = prompt
    lengths = jnp.asarray([len(prompt)], jnp.int32)
    logits, taps, _ = prefill(target.params, target.init_cache(1, 64), jnp.asarray(tokens), lengths,
                              forward=target.forward, cfg=target.cfg, taps=drafter.taps)
    first = jnp.argmax(logits, -1)
    state = jax.jit(drafter.init, static_argnums=2)(drafter.params, PromptInfo(jnp.asarray(tokens), lengths, taps,
                                                                                 first), 48)
    seq = prompt + [int(first[0])]
    full = np.zeros((1, 32), np.int32)
    full[0, : len(seq) + 3] = seq + [40, 41, 42]
    ftaps, _ = _features(target.params, jnp.asarray(full), cfg=target.cfg, forward=target.forward, taps=drafter.taps)
    train_heads = jax.jit(lambda p, last: medusa.head_logits(task.arch, p, consts, last))(params, ftaps[0])  # [1, T, K, V]

    # after prefill: the heads read the hidden state of the last prompt position
    np.testing.assert_allclose(drafter.heads(drafter.params, state)[0], train_heads[0, len(prompt) - 1], atol=1e-4)
    ctx = RoundContext(jnp.asarray(full), jnp.asarray([len(seq)], jnp.int32), jnp.zeros((1,), bool))
    draft, _ = drafter.propose(drafter.params, state, ctx, GREEDY, jax.random.PRNGKey(0))
    np.testing.assert_array_equal(draft.tokens[0], jnp.argmax(train_heads[0, len(prompt) - 1], -1))

    # verify [root, 40, 41, 42]: two accepted -> the state is the hidden state at the second accepted node
    result = VerifyResult(jnp.asarray([2]), jnp.asarray([[40, 41, 7, -1]]), jnp.asarray([[0, 1, -1]]))
    verify_taps = ftaps[:, :, len(seq) - 1: len(seq) + 3]
    state = drafter.update(drafter.params, state, ctx, result, verify_taps)
    np.testing.assert_allclose(drafter.heads(drafter.params, state)[0], train_heads[0, len(seq) + 1], atol=1e-4)
    result0 = VerifyResult(jnp.asarray([0]), jnp.asarray([[7, -1, -1, -1]]), jnp.asarray([[-1, -1, -1]]))
    state0 = drafter.update(drafter.params, state, ctx, result0, verify_taps)
    np.testing.assert_allclose(drafter.heads(drafter.params, state0)[0], train_heads[0, len(seq) - 1], atol=1e-4)


def test_head_k_is_trained_on_token_t_plus_k_plus_1(target):
    task, params, drafter = make(target, num_heads=2, k=2)
    seq = np.array([5, 9, 14, 3, 77, 31, 8, 60, 61, 12], np.int32)
    mask = np.array([0, 0, 0, 1, 1, 1, 1, 1, 1, 1], np.int8)
    tokens = np.zeros((1, 32), np.int32)
    tokens[0, :10] = seq
    lmask = np.zeros((1, 32), np.int8)
    lmask[0, :10] = mask
    batch = {"tokens": jnp.asarray(tokens), "loss_mask": jnp.asarray(lmask), "lengths": jnp.asarray([10])}
    ftaps, flogits = _features(target.params, jnp.asarray(tokens), cfg=target.cfg, forward=target.forward,
                               taps=drafter.taps)
    consts = task.frozen(target)
    _, metrics = jax.jit(task.loss)(params, consts, batch, TargetFeatures(ftaps, flogits), None)
    heads = np.asarray(medusa.head_logits(task.arch, params, consts, ftaps[0]))[0]  # [T, K, V]
    for k in (1, 2):  # 1-based head k at hidden t predicts x_{t+k+1}
        ces = []
        for t in range(10):
            label = t + k + 1
            if label < 10 and mask[label]:
                logp = heads[t, k - 1] - np.log(np.sum(np.exp(heads[t, k - 1] - heads[t, k - 1].max()))) - heads[t, k - 1].max()
                ces.append(-logp[seq[label]])
        np.testing.assert_allclose(float(metrics[f"loss_head{k}"]), np.mean(ces), rtol=1e-4)


def test_static_tree_nodes_are_ranked_head_candidates(target):
    paths = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    _, _, drafter = make(target, num_heads=3, tree_paths=paths)
    assert drafter.kind == "tree" and drafter.num_draft_tokens == 6
    state = jnp.asarray(np.random.default_rng(0).normal(size=(2, target.cfg.hidden_size)), jnp.float32)
    ctx = RoundContext(jnp.zeros((2, 8), jnp.int32), jnp.asarray([3, 3]), jnp.zeros((2,), bool))
    draft, _ = drafter.propose(drafter.params, state, ctx, GREEDY, jax.random.PRNGKey(0))
    order = np.argsort(-np.asarray(drafter.heads(drafter.params, state)), axis=-1)  # [B, K, V]
    for i, path in enumerate(drafter.tree.paths):
        np.testing.assert_array_equal(draft.tokens[:, i], order[:, len(path) - 1, path[-1]])
    np.testing.assert_array_equal(draft.parents[0], [-1, -1, 0, 0, 1, 2])
    with pytest.raises(ValueError, match="tree depth 4 exceeds the 3 medusa heads"):
        make(target, num_heads=3, tree_paths=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="at most 3 tokens"):
        make(target, num_heads=3, k=4)


@pytest.mark.parametrize("policy", ["greedy_tree", "typical"])  # multidraft_tree: test_engine covers trees
def test_greedy_medusa_tree_equals_ar(target, policy):
    _, _, drafter = make(target, num_heads=3, tree_paths=[[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    ar = generate(target, PROMPTS, max_new_tokens=17)
    out = speculative_generate(target, drafter, PROMPTS, policy=policy, max_new_tokens=17)
    assert out.tokens == ar.tokens


def test_sampled_static_tree_draws_without_replacement_and_is_lossless():
    """Above temperature 0 node [r1, ..., rd] is head d's rd-th draw without replacement, with the target's noise
    at its position: siblings differ, every node of a depth has the same children (head d's q does not read the
    path, and they share the noise), each node carries head d's q less its earlier siblings, and a rank the
    top-k cut leaves empty is invalid. Through the engine, multidraft_tree's output law equals the exact one
    (`assert_lossless`, T = 0.7 with top-k 3 and top-p 0.9)."""
    from specdec.sampling import SamplingParams, probabilities
    from specdec.testing import assert_lossless, distribution_target, sampled_joint

    small = distribution_target()
    paths = [[0], [1], [0, 0], [1, 0], [0, 1], [0, 2], [0, 0, 0]]
    _, _, tree = make(small, num_heads=3, tree_paths=paths)
    assert [list(p) for p in tree.tree.paths] == [[0], [1], [0, 0], [0, 1], [0, 2], [1, 0], [0, 0, 0]]
    last = jnp.asarray(np.random.default_rng(1).normal(size=(64, small.cfg.hidden_size)), jnp.float32)
    ctx = RoundContext(jnp.zeros((64, 8), jnp.int32), jnp.full((64,), 3), jnp.zeros((64,), bool))
    sampling = SamplingParams(temperature=0.7, top_k=2)
    draft, _ = tree.propose(tree.params, last, ctx, sampling, jax.random.PRNGKey(3))
    tokens, probs, valid = (np.asarray(x) for x in (draft.tokens, draft.probs, draft.valid))
    q = np.asarray(probabilities(tree.heads(tree.params, last), sampling))  # [B, K, V]
    assert (tokens[:, 0] != tokens[:, 1]).all() and (tokens[:, 2] != tokens[:, 3]).all()
    np.testing.assert_array_equal(tokens[:, 2], tokens[:, 5])  # [0, 0] and [1, 0]: cousins, one draw
    assert valid[:, [0, 1, 2, 3, 5, 6]].all() and not valid[:, 4].any()  # top-k 2: no rank-2 draw
    np.testing.assert_allclose(probs[:, 0], q[:, 0], rtol=1e-6)
    rest = q[:, 0] * (np.arange(q.shape[-1]) != tokens[:, :1])  # q less the first sibling, renormalised
    np.testing.assert_allclose(probs[:, 1], rest / rest.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)
    assert (np.take_along_axis(probs, tokens[..., None], -1)[valid] > 0).all()
    assert_lossless(*sampled_joint(small, tree, "multidraft_tree"))


def test_medusa_samples_from_its_q(target):
    """The drafted tokens' frequencies match the returned q (T=0.7, top-k, top-p; specdec/testing.py)."""
    from specdec.testing import assert_draft_matches_its_q

    assert_draft_matches_its_q(target, make(target)[2])
