"""EAGLE-3: the training-time test computes exactly the logits the engine's drafting path computes (steps
0..2, after prefill and after a verify round with a partial acceptance, ragged batch, reduced vocabulary),
the loss's labels line up with an independent computation through the inference path, and the dynamic tree
drafter is lossless inside the compiled loop, greedy and sampled (the trained chain drafter's greedy equality is
in test_train)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drafters import eagle3
from specdec.drafter import PromptInfo, RoundContext, VerifyResult
from specdec.engine import speculative_generate
from specdec.generate import generate, prefill
from specdec.models import transformer
from specdec.sampling import GREEDY
from specdec.testing import PROMPTS, peaky_target
from specdec.train import tasks as T
from specdec.train.features import TargetFeatures, online_features

WIDTH = 16  # reference sequences are right-padded to one length (causal: padding never changes earlier slots)
STEPS = 3


@pytest.fixture(scope="module")
def target():
    return peaky_target(3)


def noisy(params, seed, scale=0.05):
    """Random weights everywhere (init leaves some at exactly 0/1), so masks and positions matter."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def make(target, draft_vocab_size=0, steps=STEPS, k=STEPS):
    task = eagle3.make_task(target, draft_vocab_size=draft_vocab_size, ttt_steps=steps)
    counts = np.bincount(np.arange(target.cfg.vocab_size) % 97, minlength=target.cfg.vocab_size)
    params, buffers = task.init(jax.random.PRNGKey(0), counts)
    params = noisy(params, 1)
    drafter = eagle3.Eagle3Drafter.from_trained(task.arch, params, buffers, target, k)
    return task, params, buffers, drafter


@functools.partial(jax.jit, static_argnames=("arch", "cfg", "forward", "taps"))
def ttt_reference(params, tparams, tokens, *, arch, cfg, forward, taps):
    """TTT logits [STEPS, B, WIDTH, Vd] over whole sequences, with the target's taps computed over them."""
    f = online_features(tparams, cfg, forward, tokens, taps, True)
    return jnp.stack(eagle3.ttt_logits(arch, params, tparams["embed"], tokens, f.taps, STEPS)), f.taps, f.logits


def reference(task, params, target, rows):
    tokens = np.zeros((len(rows), WIDTH), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    return ttt_reference(params, target.params, jnp.asarray(tokens), arch=task.arch, cfg=target.cfg,
                         forward=target.forward, taps=task.taps)


@functools.partial(jax.jit, static_argnames=("drafter",))
def engine_round(drafter, params, state, ctx):
    """The engine's drafting path step by step (greedy), plus the drafter's own propose on the same state."""
    h, cache = state.h_root, state.cache  # the root's output: fed by init or by the last update
    logits = [drafter._logits(params, h)]
    tokens = [drafter._to_target(params, jnp.argmax(logits[-1], -1))]
    for _ in range(drafter.num_draft_tokens - 1):
        lg, h, cache = drafter.draft_step(params, cache, tokens[-1], h)
        logits.append(lg)
        tokens.append(drafter._to_target(params, jnp.argmax(lg, -1)))
    draft, new_state = drafter.propose(params, state, ctx, GREEDY, jax.random.PRNGKey(0))
    return jnp.stack(logits, 1), jnp.stack(tokens, 1), draft.tokens, new_state


def context(rows, cap=64):
    seq = np.zeros((len(rows), cap), np.int32)
    for i, r in enumerate(rows):
        seq[i, : len(r)] = r
    return RoundContext(jnp.asarray(seq), jnp.asarray([len(r) for r in rows], jnp.int32), jnp.zeros((len(rows),), bool))


def test_ttt_logits_equal_engine_logits(target):
    task, params, buffers, drafter = make(target, draft_vocab_size=64)
    dparams = drafter.params
    prompts = [[5, 9, 14, 3, 77, 31, 8], [40, 41, 42, 43]]
    tokens = np.full((2, 32), 2, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    logits, taps, _ = prefill(target.params, target.init_cache(2, 64), jnp.asarray(tokens), lengths,
                              forward=target.forward, cfg=target.cfg, taps=drafter.taps)
    first = np.asarray(jnp.argmax(logits, -1))
    state = jax.jit(drafter.init, static_argnums=2)(dparams, PromptInfo(jnp.asarray(tokens), lengths, taps,
                                                                         jnp.asarray(first)), 48)

    # round 1: the root is the prefill token
    rows = [p + [int(f)] for p, f in zip(prompts, first)]
    inf_logits, drafts, proposed, state = engine_round(drafter, dparams, state, context(rows))
    np.testing.assert_array_equal(proposed, drafts)
    drafts = np.asarray(drafts)
    ref, ref_taps, _ = reference(task, params, target, [r + drafts[i].tolist() for i, r in enumerate(rows)])
    for i, r in enumerate(rows):
        np.testing.assert_allclose(inf_logits[i], ref[:, i, len(r) - 1], atol=2e-4, rtol=1e-4, err_msg=f"round 1 row {i}")

    # verify [root, drafts]: row 0 accepts one draft then a bonus token, row 1 none
    accepted, bonus = [1, 0], [17, 23]
    n = drafts.shape[1]
    verify_taps = jnp.stack([ref_taps[:, i, len(r) - 1: len(r) + n] for i, r in enumerate(rows)], axis=1)
    path = np.full((2, n), -1, np.int32)
    out_tokens = np.full((2, n + 1), -1, np.int32)
    for i, m in enumerate(accepted):
        path[i, :m] = np.arange(m)
        out_tokens[i, :m] = drafts[i, :m]
        out_tokens[i, m] = bonus[i]
    result = VerifyResult(jnp.asarray(accepted, jnp.int32), jnp.asarray(out_tokens), jnp.asarray(path))
    rows2 = [r + drafts[i, :m].tolist() + [bonus[i]] for i, (r, m) in enumerate(zip(rows, accepted))]
    state = jax.jit(drafter.update)(dparams, state, context(rows2), result, verify_taps)

    # round 2: the update fed the accepted tokens and the bonus with the verify step's features
    inf_logits, drafts2, _, _ = engine_round(drafter, dparams, state, context(rows2))
    drafts2 = np.asarray(drafts2)
    ref, _, _ = reference(task, params, target, [r + drafts2[i].tolist() for i, r in enumerate(rows2)])
    for i, r in enumerate(rows2):
        np.testing.assert_allclose(inf_logits[i], ref[:, i, len(r) - 1], atol=2e-4, rtol=1e-4, err_msg=f"round 2 row {i}")


@functools.partial(jax.jit, static_argnames=("drafter",))
def inference_path_ce(drafter, params, seq, tlogits, g):
    """For every root slot j of `seq` (one row per slot): the cache holds positions 1..j, x_j fed with
    g_{j-1}; step 0 from the root, step 1 fed the teacher-forced x_{j+1}. Returns CE vs the target's
    distribution at j+k, [2, n-1] (slot j = row j-1)."""
    n = seq.shape[0]
    rows = n - 1
    c = drafter.arch.cfg
    shape = transformer.cache_shape(rows, n + 4, c.num_kv_heads, c.head_dim)
    cache = transformer.KVCache((jnp.zeros(shape),), (jnp.zeros(shape),), jnp.zeros((rows,), jnp.int32))
    toks = jnp.broadcast_to(seq[1:], (rows, n - 1))
    h_all, cache = drafter._layer(params, cache, toks, jnp.broadcast_to(g[: n - 1], (rows, n - 1, g.shape[-1])),
                                  jnp.broadcast_to(jnp.arange(1, n), (rows, n - 1)), transformer.causal_mask(n - 1))
    j = jnp.arange(1, n)
    cache = cache.with_lengths(j)  # later positions are in the buffer but invisible
    h = h_all[jnp.arange(rows), j - 1]
    lg0 = drafter._logits(params, h)
    lg1, _, _ = drafter.draft_step(params, cache, seq[jnp.minimum(j + 1, n - 1)], h)
    pt = jax.nn.softmax(tlogits, -1)
    ce0 = T.soft_cross_entropy(lg0, pt[j])
    ce1 = T.soft_cross_entropy(lg1, pt[jnp.minimum(j + 1, n - 1)])
    return jnp.stack([ce0, ce1])


def test_loss_labels_match_inference_path(target):
    """The vectorised TTT loss == per-slot cross-entropies computed through the engine's drafting path, with
    the label of step k from slot j being x_{j+k+1} (a response token) and the target at position j+k."""
    task, params, buffers, drafter = make(target, 0, steps=2, k=2)
    seq = [5, 9, 14, 3, 77, 31, 8, 60, 61, 12]
    mask = np.array([0, 0, 0, 1, 1, 1, 1, 1, 1, 1])
    n = len(seq)
    batch = {"tokens": jnp.asarray([seq], jnp.int32), "loss_mask": jnp.asarray([mask], jnp.int8),
             "lengths": jnp.asarray([n], jnp.int32)}
    f = online_features(target.params, target.cfg, target.forward, batch["tokens"], task.taps, True)
    loss, metrics = jax.jit(task.loss)(params, {"embed": target.params["embed"]}, batch, f, None)
    g = eagle3._apply(task.arch, params, "fuse", f.taps)[0]
    ce = np.asarray(inference_path_ce(drafter, drafter.params, jnp.asarray(seq), f.logits[0], g))
    per_step = []
    for k in range(2):
        slots = [j for j in range(1, n) if j + k + 1 < n and mask[j + k + 1]]
        per_step.append(np.mean([ce[k, j - 1] for j in slots]))
        np.testing.assert_allclose(float(metrics[f"loss_step{k}"]), per_step[k], rtol=2e-4)
    np.testing.assert_allclose(float(loss), (per_step[0] + 0.8 * per_step[1]) / 1.8, rtol=2e-4)


def test_reduced_vocab_keeps_most_frequent_and_eos():
    counts = np.array([5, 0, 0, 9, 1, 7, 7, 2])
    np.testing.assert_array_equal(T.reduced_vocab(counts, 4, always=(2,)), [2, 3, 5, 6])


def test_default_taps_follow_eagle3():
    assert eagle3.default_taps(30) == (2, 15, 27)
    assert eagle3.default_taps(2) == (2, 1, 0)


def test_greedy_eagle3_dynamic_tree_equals_ar(target):
    _, _, _, chain = make(target, 64, k=4)
    tree = eagle3.Eagle3TreeDrafter(chain.arch, chain.params, 6, top_k=2, depth=3)
    assert tree.kind == "tree"
    ar = generate(target, PROMPTS, max_new_tokens=17)
    out = speculative_generate(target, tree, PROMPTS, policy="greedy_tree", max_new_tokens=17)
    assert out.tokens == ar.tokens


def test_sampled_eagle3_tree_is_lossless():
    """Above temperature 0 EAGLE-3's dynamic tree is sampled (`trees.sampled_children`: children drawn without
    replacement with the target's noise, kept level by level), from a reduced draft vocabulary (5 of 8 ids, q
    mapped back to target ids): through the engine, multidraft_tree's output law equals the exact one
    (`assert_lossless`, T = 0.7 with top-k 3 and top-p 0.9), with a depth-3 tree whose node q reads its path."""
    from specdec.testing import assert_lossless, distribution_target, sampled_joint

    small = distribution_target()
    chain = make(small, 5, k=2)[3]
    tree = eagle3.Eagle3TreeDrafter(chain.arch, chain.params, 6, top_k=2, depth=3)
    assert tree.arch.vocab == 5
    assert_lossless(*sampled_joint(small, tree, "multidraft_tree"))


def test_eagle3_tree_levels_fit_at_the_context_edge(target, monkeypatch):
    from tests.test_engine import assert_tree_levels_fit_at_the_context_edge

    _, _, _, chain = make(target, 64, k=2)
    tree = eagle3.Eagle3TreeDrafter(chain.arch, chain.params, 2, top_k=3, depth=5)
    assert_tree_levels_fit_at_the_context_edge(target, tree, monkeypatch)


def test_eagle3_samples_from_its_q(target):
    """The drafted tokens' frequencies match the returned q (T=0.7, top-k, top-p; specdec/testing.py), with a
    reduced draft vocabulary (q mapped back to target ids)."""
    from specdec.testing import assert_draft_matches_its_q

    assert_draft_matches_its_q(target, make(target, 64, k=3)[3])
