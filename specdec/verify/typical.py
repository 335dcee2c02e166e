"""Typical acceptance (Medusa, Cai et al. 2024). LOSSY: the output is not distributed as the target.

Instead of a rejection test it accepts any token the target finds "typical enough":
    p(x) > min(epsilon, delta * exp(-H(p)))
so confident targets (low entropy) demand a high probability, uncertain ones accept more. It trades exactness
for longer acceptance at temperature > 0; at temperature 0 p is one-hot, the threshold is min(epsilon, delta)
< 1, and it reduces to `greedy_tree`.

Defaults follow Medusa's code: `posterior_threshold` epsilon = 0.09 and `posterior_alpha` delta = 0.3
(recommended there as sqrt(epsilon)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specdec.sampling import SamplingParams, probabilities
from specdec.drafter import Draft, VerifyResult
from specdec.verify.base import Policy, commit, correction_noise, final_sample
from specdec.verify.tree import longest_accepted_path

DEFAULT_EPSILON = 0.09
DEFAULT_DELTA = 0.3


def typical(draft: Draft, target_logits: jax.Array, sampling: SamplingParams, key: jax.Array, *,
            epsilon: float = DEFAULT_EPSILON, delta: float = DEFAULT_DELTA) -> VerifyResult:
    """Accept the longest path of typical tokens (ties: most likely path, as Medusa); bonus drawn from p there."""
    b, n = draft.tokens.shape
    rows = jnp.arange(b)[:, None]
    p = probabilities(target_logits, sampling)  # [B, N+1, V]
    entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
    threshold = jnp.minimum(epsilon, delta * jnp.exp(-entropy))  # [B, N+1]
    at_parent = draft.parents + 1
    p_x = p[rows, at_parent, draft.tokens]  # [B, N]: target prob of each node's token at its parent
    accepted = draft.valid & (p_x > threshold[rows, at_parent])

    num_accepted, path, last = longest_accepted_path(draft.parents, accepted,
                                                     path_score=jnp.log(jnp.maximum(p_x, 1e-30)))
    next_token = final_sample(correction_noise(key, num_accepted, p.shape[-1]), p[jnp.arange(b), last + 1])
    return commit(draft.tokens, path, num_accepted, next_token)


TYPICAL = Policy("typical", lossless=False, supports_trees=True, greedy_only=False, impl=typical,
                 options=(("delta", DEFAULT_DELTA), ("epsilon", DEFAULT_EPSILON)))
