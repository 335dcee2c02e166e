"""Chain verification: one draft token per position, accepted left to right until the first failure.

On a chain every acceptance test can be evaluated at once (the tests are independent given the draft), and
the accepted length is the number of leading successes, so neither policy needs a loop. Both ignore
`draft.parents` and assume the chain topology [-1, 0, 1, ...]; use the tree policies for anything else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specdec.sampling import SamplingParams, probabilities
from specdec.drafter import Draft, VerifyResult
from specdec.verify.base import (Policy, commit, correction_noise, final_sample, rejection_noise, require_greedy,
                                 residual)


def _leading_true(ok: jax.Array) -> jax.Array:
    """Number of leading True values per row: [B, N] bool -> int32 [B]."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _chain_result(draft: Draft, num_accepted: jax.Array, next_token: jax.Array) -> VerifyResult:
    n = draft.num_nodes
    path = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), draft.tokens.shape)
    return commit(draft.tokens, path, num_accepted, next_token)


def greedy_chain(draft: Draft, target_logits: jax.Array, sampling: SamplingParams,
                 key: jax.Array) -> VerifyResult:
    """Accept while the draft equals the target argmax; then commit the target's argmax.

    The committed tokens are exactly what greedy decoding would produce, whatever the drafter proposed.
    """
    del key
    require_greedy("greedy_chain", sampling)
    return match_chain(draft, jnp.argmax(target_logits, axis=-1).astype(jnp.int32))


def match_chain(draft: Draft, target: jax.Array) -> VerifyResult:
    """Accept while the draft equals the target's token at each position (int32 [B, N+1], one per verified
    position); commit the target's token after the accepted prefix. The target's token is fixed before the
    draft is looked at (the argmax, or the keyed sample of `specdec.verify.invariant`)."""
    num_accepted = _leading_true(draft.valid & (draft.tokens == target[:, :-1]))
    next_token = jnp.take_along_axis(target, num_accepted[:, None], axis=1)[:, 0]
    return _chain_result(draft, num_accepted, next_token)


def rejection_chain(draft: Draft, target_logits: jax.Array, sampling: SamplingParams,
                    key: jax.Array) -> VerifyResult:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): lossless for any draft distribution.

    Position j accepts x_j with probability min(1, p_j(x_j) / q_j(x_j)). The first rejected position emits a
    token from norm(max(p_j - q_j, 0)), the part of p the draft under-proposes, which makes the emitted token
    exactly p_j-distributed. If the row ran out of draft (all accepted, or its remaining nodes are invalid)
    nothing was rejected, so the next token comes from p itself (the bonus). At temperature 0 p is one-hot at
    the argmax, which makes this identical to `greedy_chain`.
    """
    b, n = draft.tokens.shape
    vocab = target_logits.shape[-1]
    rows = jnp.arange(b)
    p = probabilities(target_logits, sampling)  # [B, N+1, V]
    p_x = jnp.take_along_axis(p[:, :n], draft.tokens[..., None], axis=-1)[..., 0]  # [B, N]
    q_x = draft.token_probs()

    u = rejection_noise(key, draft, jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)))
    # u < p/q, written without the division so q(x) = 0 (a token the draft could not have drawn) cannot NaN.
    accepted = draft.valid & (u * q_x < p_x)
    num_accepted = _leading_true(accepted)

    stop = jnp.minimum(num_accepted, n - 1)
    was_rejected = (num_accepted < n) & draft.valid[rows, stop]
    p_stop = p[rows, num_accepted]
    dist = jnp.where(was_rejected[:, None], residual(p_stop, draft.dist_at(stop, vocab)), p_stop)
    return _chain_result(draft, num_accepted, final_sample(correction_noise(key, num_accepted, vocab), dist))


GREEDY_CHAIN = Policy("greedy_chain", lossless=True, supports_trees=False, greedy_only=True, impl=greedy_chain,
                      tree_counterpart="greedy_tree")
REJECTION_CHAIN = Policy("rejection_chain", lossless=True, supports_trees=False, greedy_only=False,
                         impl=rejection_chain, tree_counterpart="multidraft_tree")
