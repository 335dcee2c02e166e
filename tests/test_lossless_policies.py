"""Distributional losslessness of the sampling verification policies, by Monte Carlo on a tiny vocabulary.

Setup: V = 5 tokens, a target whose next-token distribution depends on the whole prefix (seeded random logit
tables p(. | ()), p(. | t1), p(. | t1, t2)), and a draft with its own, different tables q. Each of B rows draws
a draft of depth 2 (a chain, or a tree with two children per node), verifies it in ONE jitted, batched call,
and reads off the first three output tokens: the committed tokens of the round, continued (when the round
committed fewer than three) by sampling the target itself, exactly as the next rounds would. A lossless policy
makes these three tokens distributed as p(t1) p(t2 | t1) p(t3 | t1, t2), which we know exactly.

The check (`assert_matches`): no sample in a zero-probability cell; a chi-square goodness-of-fit test over the
125 cells (cells with expected count < 5 pooled) with p-value > 1e-3; and total variation distance below
TV_TOLERANCE = 0.015. For an exact sampler with B = 200,000 the TV over these cells is about 0.007 with a
standard deviation of 0.0007 (multinomial simulation at temperature 1; less with top-k and top-p, fewer cells), so the
tolerance is ten standard deviations away, while the broken verifiers below land at TV 0.045 to 0.27 with
chi-square p-values of 0. Seeds are fixed, so the outcome is deterministic for a given JAX version; with a
fresh seed each chi-square check would fail by chance with probability 1e-3.

The broken verifiers (correction drawn from p instead of the residual; residual not renormalised before the
next sibling's test) must fail the same check, which shows the test has the power to catch those bugs.

Besides chains and trees of i.i.d. or top-k siblings, two shapes the drafters produce: a tree whose siblings are
drawn WITHOUT replacement (sampled DSpark / DFlash trees), and a deterministic lookup branch beside sampled
siblings (the hybrid drafter's `lookup_nodes`). Each has a negative control: the siblings claiming plain q.
"""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp
import scipy.stats

import specdec.verify.chain
import specdec.verify.tree
from specdec.drafter import Draft
from specdec.sampling import SamplingParams, probabilities
from specdec.verify import get_policy

V = 5
NUM_SAMPLES = 200_000
P_VALUE_MIN = 1e-3
TV_TOLERANCE = 0.015
SAMPLINGS = {
    "t1": SamplingParams(temperature=1.0),
    # all three transforms: top-k keeps 3 of the 5 tokens, then top-p cuts most of these rows to 2 or 1
    "t0.7-topk3-topp0.8": SamplingParams(temperature=0.7, top_k=3, top_p=0.8),
}


def logit_tables(seed: int):
    """Target logits L0 [V], L1 [V, V], L2 [V, V, V] (indexed by the prefix) and draft logits D0, D1 that are
    correlated with the target but clearly different (acceptance is neither ~0 nor ~1)."""
    rng = np.random.default_rng(seed)
    target = [rng.normal(0, 1.5, (V,) * d).astype(np.float32) for d in (1, 2, 3)]
    draft = [target[0] + rng.normal(0, 1.5, (V,)), target[1] + rng.normal(0, 1.5, (V, V))]
    return target, [d.astype(np.float32) for d in draft]


def prob_tables(logits, sampling) -> list[np.ndarray]:
    """The same tables after the sampling transform (computed once, outside the jitted harness)."""
    return [np.asarray(probabilities(jnp.asarray(t), sampling)) for t in logits]


def exact_joint(target, sampling) -> np.ndarray:
    p0, p1, p2 = (t.astype(np.float64) for t in prob_tables(target, sampling))
    return p0[:, None, None] * p1[:, :, None] * p2


def inverse_cdf(u: jax.Array, probs: jax.Array) -> jax.Array:
    """Sample token ids from probs [..., V] with uniforms u [...]. Used instead of jax.random.categorical:
    all the harness's randomness comes from one 1-D uniform draw, which keeps XLA:CPU compile time low."""
    cdf = jnp.cumsum(probs, axis=-1)
    cdf = cdf / cdf[..., -1:]
    return jnp.sum(u[..., None] >= cdf, axis=-1).astype(jnp.int32)  # zero-probability tokens are never hit


def without(q: jax.Array, drawn: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q [B, V] with the token `drawn` [B] removed and renormalised (what the next draw WITHOUT replacement comes
    from), and whether any mass was left [B] (top-k / top-p can leave a single token)."""
    left = q * (1.0 - jax.nn.one_hot(drawn, q.shape[-1], dtype=q.dtype))
    mass = jnp.sum(left, axis=-1, keepdims=True)
    return jnp.where(mass > 0, left / jnp.where(mass > 0, mass, 1.0), q), mass[:, 0] > 0


def first_three_tokens(policy_name: str, shape: str, sampling: SamplingParams, seed: int,
                       wrong_q: bool = False) -> np.ndarray:
    """Run NUM_SAMPLES independent rounds in one jitted call; return their first three output tokens [B, 3].

    shape: "chain-..." (two draft tokens, x1 ~ q, x2 ~ q(. | x1)) or "tree-..." (root children a, b, each with
    two children); "...-sampled" drafts i.i.d. from q (probs given), "...-top" takes q's top-k (probs None);
    "tree-withoutreplacement": the same tree with each node's two children drawn WITHOUT replacement (the second
    from q less the first, and carrying that q; a sampled DSpark tree); "tree-lookup": the hybrid drafter's shape,
    a deterministic lookup branch l1 -> l2 (q one-hot; here q's top tokens, so it often proposes what the
    sampled siblings draw) tried first, beside the model's root children a, b drawn without replacement and a's
    child. `wrong_q`: those two shapes' bug, each sibling claiming plain q (the second child as if drawn with
    replacement; the lookup's nodes as if drawn from the model's q).
    The tables are jit arguments, not closure constants: XLA would otherwise constant-fold [B, V] arrays.
    """
    policy = get_policy(policy_name)
    kind, drafting = shape.split("-")
    b = NUM_SAMPLES
    target, draft = logit_tables(seed)
    p_tables, q_tables = prob_tables(target, sampling), prob_tables(draft, sampling)
    ranked = [np.argsort(-q, axis=-1, kind="stable").astype(np.int32) for q in q_tables]  # for top-k drafts

    def run(key, target, p_tables, q_tables, ranked):
        (l0, l1, l2), (_, p1, p2), (q0, q1), (ranked0, ranked1) = target, p_tables, q_tables, ranked
        u = jax.random.uniform(key, (b * 8,)).reshape(b, 8)  # 6 for drafting, 2 for continuing
        q0 = jnp.broadcast_to(q0, (b, V))
        valid = None

        def children(column, q_rows, ranked_rows, count):
            """`count` children per row: i.i.d. draws from q_rows [B, V], or the top-`count` tokens of q."""
            if drafting == "sampled":
                return inverse_cdf(u[:, column:column + count], q_rows[:, None, :])
            return jnp.broadcast_to(ranked_rows[..., :count], (b, count))

        def two_without_replacement(column, q_rows):
            """Two children drawn without replacement from q_rows [B, V]: (first, second, the second's q, whether
            a second one was left to draw)."""
            first = inverse_cdf(u[:, column], q_rows)
            rest, left = without(q_rows, first)
            return first, inverse_cdf(u[:, column + 1], rest), q_rows if wrong_q else rest, left

        if kind == "chain":
            x1 = children(0, q0, ranked0, 1)[:, 0]
            x2 = children(1, q1[x1], ranked1[x1], 1)[:, 0]
            tokens, parents = jnp.stack([x1, x2], 1), jnp.array([-1, 0])
            probs = jnp.stack([q0, q1[x1]], 1)
            logits = jnp.stack([jnp.broadcast_to(l0, (b, V)), l1[x1], l2[x1, x2]], 1)
        elif drafting == "lookup":  # nodes: 0 = l1, 1 = l2 (child of l1); 2, 3 = a, b (root); 4 = child of a
            look1 = jnp.broadcast_to(ranked0[0], (b,))
            look2 = ranked1[look1, 0]
            a, bb, qb, left = two_without_replacement(0, q0)
            ca = inverse_cdf(u[:, 2], q1[a])
            tokens = jnp.stack([look1, look2, a, bb, ca], 1)
            parents = jnp.array([-1, 0, -1, -1, 2])
            one_hot = lambda x: jax.nn.one_hot(x, V, dtype=jnp.float32)  # noqa: E731
            lookup_q = [q0, q1[look1]] if wrong_q else [one_hot(look1), one_hot(look2)]
            probs = jnp.stack(lookup_q + [q0, qb, q1[a]], 1)
            valid = jnp.stack([jnp.ones((b,), bool), jnp.ones((b,), bool), jnp.ones((b,), bool), left,
                               jnp.ones((b,), bool)], 1)
            logits = jnp.stack([jnp.broadcast_to(l0, (b, V)), l1[look1], l2[look1, look2], l1[a], l1[bb],
                                l2[a, ca]], 1)
        else:  # nodes: 0 = a, 1 = b (root children); 2, 3 = children of a; 4, 5 = children of b
            if drafting == "withoutreplacement":
                a, bb, qb, left = two_without_replacement(0, q0)
                ca0, ca1, qa1, left_a = two_without_replacement(2, q1[a])
                cb0, cb1, qb1, left_b = two_without_replacement(4, q1[bb])
                ca, cb = jnp.stack([ca0, ca1], 1), jnp.stack([cb0, cb1], 1)
                probs = jnp.stack([q0, qb, q1[a], qa1, q1[bb], qb1], 1)
                true = jnp.ones((b,), bool)
                valid = jnp.stack([true, left, true, left_a, left, left & left_b], 1)
            else:
                top = children(0, q0, ranked0, 2)
                a, bb = top[:, 0], top[:, 1]
                ca, cb = children(2, q1[a], ranked1[a], 2), children(4, q1[bb], ranked1[bb], 2)
                probs = jnp.stack([q0, q0, q1[a], q1[a], q1[bb], q1[bb]], 1)
            tokens = jnp.stack([a, bb, ca[:, 0], ca[:, 1], cb[:, 0], cb[:, 1]], 1)
            parents = jnp.array([-1, -1, 0, 0, 1, 1])
            logits = jnp.stack([jnp.broadcast_to(l0, (b, V)), l1[a], l1[bb], l2[a, ca[:, 0]], l2[a, ca[:, 1]],
                                l2[bb, cb[:, 0]], l2[bb, cb[:, 1]]], 1)
        d = Draft.tree(tokens, parents, None if drafting == "top" else probs, valid)
        out = policy.verify(d, logits, sampling, jax.random.fold_in(key, 1)).tokens[:, :3]

        # continue with the target itself where the round committed fewer than three tokens
        t1 = out[:, 0]
        t2 = jnp.where(out[:, 1] >= 0, out[:, 1], inverse_cdf(u[:, 6], p1[t1]))
        t3 = jnp.where(out[:, 2] >= 0, out[:, 2], inverse_cdf(u[:, 7], p2[t1, t2]))
        return jnp.stack([t1, t2, t3], 1)

    return np.asarray(jax.jit(run)(jax.random.key(seed), target, p_tables, q_tables, ranked))


def fit(samples: np.ndarray, exact: np.ndarray) -> tuple[float, float, int]:
    """(chi-square p-value, total variation distance, samples in zero-probability cells)."""
    counts = np.zeros(exact.size)
    np.add.at(counts, np.ravel_multi_index(samples.T, exact.shape), 1)
    p = exact.ravel()
    n = len(samples)
    impossible = int(counts[p == 0].sum())
    expected = n * p
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (p > 0)].sum())
    exp = np.append(expected[big], expected[~big & (p > 0)].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    p_value = float(scipy.stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
    tv = 0.5 * float(np.abs(counts / n - p).sum())
    return p_value, tv, impossible


def assert_matches(samples, exact):
    p_value, tv, impossible = fit(samples, exact)
    assert impossible == 0, f"{impossible} samples where the target has probability 0"
    assert p_value > P_VALUE_MIN, f"chi-square rejects the target distribution: p = {p_value:.2e} (TV {tv:.4f})"
    assert tv < TV_TOLERANCE, f"total variation {tv:.4f} >= {TV_TOLERANCE}"


def assert_rejected(samples, exact):
    p_value, tv, impossible = fit(samples, exact)
    assert impossible > 0 or (p_value < 1e-6 and tv > TV_TOLERANCE), (
        f"the check failed to reject a broken verifier: p = {p_value:.2e}, TV = {tv:.4f}")


CASES = [("rejection_chain", "chain-sampled"), ("rejection_chain", "chain-top"),
         ("multidraft_tree", "tree-sampled"), ("multidraft_tree", "tree-top"),
         ("multidraft_tree", "tree-withoutreplacement"), ("multidraft_tree", "tree-lookup")]


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
@pytest.mark.parametrize("policy_name, shape", CASES)
def test_policy_is_lossless(policy_name, shape, sampling_name):
    sampling = SAMPLINGS[sampling_name]
    seed = 11
    samples = first_three_tokens(policy_name, shape, sampling, seed)
    assert_matches(samples, exact_joint(logit_tables(seed)[0], sampling))


def renormalise_skipped(p, q):
    return jnp.maximum(p - q, 0.0)


def correction_from_p(p, q):
    return p


@pytest.mark.parametrize("module, broken, policy_name, shape", [
    (specdec.verify.chain, correction_from_p, "rejection_chain", "chain-sampled"),
    (specdec.verify.tree, correction_from_p, "multidraft_tree", "tree-top"),
    (specdec.verify.tree, renormalise_skipped, "multidraft_tree", "tree-sampled"),
], ids=["chain-correction-from-p", "tree-topk-correction-from-p", "tree-residual-not-renormalised"])
def test_broken_verifier_is_caught(monkeypatch, module, broken, policy_name, shape):
    monkeypatch.setattr(module, "residual", broken)
    sampling = SAMPLINGS["t1"]
    seed = 11
    samples = first_three_tokens(policy_name, shape, sampling, seed)
    assert_rejected(samples, exact_joint(logit_tables(seed)[0], sampling))


@pytest.mark.parametrize("shape", ["tree-withoutreplacement", "tree-lookup"])
def test_siblings_claiming_plain_q_are_caught(shape):
    """The two sibling shapes' own bug: a second child drawn without replacement that claims plain q, and a
    lookup branch whose nodes claim the model's q instead of their one-hot."""
    sampling = SAMPLINGS["t1"]
    samples = first_three_tokens("multidraft_tree", shape, sampling, seed=11, wrong_q=True)
    assert_rejected(samples, exact_joint(logit_tables(11)[0], sampling))


def test_typical_acceptance_is_lossy_and_the_check_sees_it():
    """Documented as lossy: at temperature 1 its output is measurably not the target distribution."""
    sampling = SAMPLINGS["t1"]
    samples = first_three_tokens("typical", "tree-top", sampling, seed=11)
    assert_rejected(samples, exact_joint(logit_tables(11)[0], sampling))
