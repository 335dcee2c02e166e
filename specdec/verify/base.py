"""The verification contract shared by every policy, and the few helpers the policies have in common.

A drafter proposes a `Draft` (a chain or a tree of tokens, with the draft distributions they were drawn
from); the target scores all of it in one forward; a policy turns (draft, target logits, sampling params,
rng key) into a `VerifyResult`: how many draft tokens each row keeps, the committed tokens (the accepted
ones plus one correction / bonus token from the target), and which tree nodes were accepted (the engine
needs that to compact the KV cache and update the drafter).

Everything here is batched with static shapes: rows accept different numbers of tokens, so results are
padded with -1 rather than sliced, and nothing loops over rows in Python.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from specdec.sampling import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Draft:
    """What a drafter proposes for one verification round, for every row of the batch.

    Node i of row b holds token `tokens[b, i]`; its parent is node `parents[b, i]` (-1 = the root, i.e. the last
    committed token). Nodes are topologically sorted (`parents[b, i] < i`), so one left-to-right pass visits a
    parent before its children; a chain is the tree whose parents are [-1, 0, 1, ...].

    `probs[b, i]` is the draft distribution node i was drawn from (q at its parent's context, after the same
    temperature / top-k / top-p transform the target gets). Lossless rejection sampling needs q(x); a
    deterministic drafter (n-gram lookup, argmax or top-k expansion) passes `probs=None`, meaning q is the
    one-hot at the proposed token. Do NOT pass the drafter's softmax for tokens that were picked by top-k:
    they were not drawn from it, and the rejection test would then be biased.

    `valid[b, i]` says the node exists: rows may propose fewer nodes than N. Invalid nodes are never accepted
    (and neither are their descendants, which must be invalid too).
    """

    tokens: jax.Array  # int32 [B, N]
    parents: jax.Array  # int32 [B, N]
    probs: jax.Array | None  # float32 [B, N, V] or None (deterministic draft: q = one-hot at the token)
    valid: jax.Array  # bool [B, N]

    @staticmethod
    def chain(tokens: jax.Array, probs: jax.Array | None = None, valid: jax.Array | None = None) -> "Draft":
        """A chain draft: node i's parent is node i-1. `valid` defaults to all True."""
        tokens = jnp.asarray(tokens, jnp.int32)
        b, n = tokens.shape
        parents = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) - 1, (b, n))
        return Draft.tree(tokens, parents, probs, valid)

    @staticmethod
    def tree(tokens: jax.Array, parents: jax.Array, probs: jax.Array | None = None,
             valid: jax.Array | None = None) -> "Draft":
        """A tree draft; `parents` may be [N] (one static tree for all rows) or [B, N]."""
        tokens = jnp.asarray(tokens, jnp.int32)
        parents = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), tokens.shape)
        valid = jnp.ones(tokens.shape, bool) if valid is None else jnp.asarray(valid, bool)
        probs = None if probs is None else jnp.asarray(probs, jnp.float32)
        return Draft(tokens=tokens, parents=parents, probs=probs, valid=valid)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def token_probs(self) -> jax.Array:
        """q(x_i) for every node's own token: float32 [B, N] (1 for a deterministic draft)."""
        if self.probs is None:
            return jnp.ones(self.tokens.shape, jnp.float32)
        return jnp.take_along_axis(self.probs, self.tokens[..., None], axis=-1)[..., 0]

    def dist_at(self, node: jax.Array, vocab_size: int) -> jax.Array:
        """The draft distribution of node `node[b]` in each row: float32 [B, V].

        Deterministic drafts build the one-hot here, for the few nodes that need it, rather than storing a
        [B, N, V] one-hot tensor (that would be as large as the target logits).
        """
        node = jnp.clip(node, 0, self.num_nodes - 1)
        rows = jnp.arange(self.batch_size)
        if self.probs is None:
            return jax.nn.one_hot(self.tokens[rows, node], vocab_size, dtype=jnp.float32)
        return self.probs[rows, node]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """The outcome of one verification round, per row.

    The engine commits `tokens[b, :num_accepted[b] + 1]` (always at least the target's own token), advances the
    cache by `1 + num_accepted` after compacting the accepted `path` into place, and tells the drafter.
    """

    num_accepted: jax.Array  # int32 [B]  draft tokens accepted, 0..N
    tokens: jax.Array  # int32 [B, N+1]  accepted draft tokens, then the correction / bonus token, then -1
    path: jax.Array  # int32 [B, N]  node indices of the accepted path (root's child first), then -1

    @property
    def num_committed(self) -> jax.Array:
        """Tokens committed this round: accepted drafts plus the target's token."""
        return self.num_accepted + 1


VerifyFn = Callable[..., VerifyResult]


@dataclasses.dataclass(frozen=True)
class Policy:
    """A named verification policy. Hashable (by name and options), so it can be a static jit argument."""

    name: str
    lossless: bool  # output distribution == the target's (under the sampling params it accepts)
    supports_trees: bool  # False: assumes a chain (parents = [-1, 0, 1, ...]) and ignores `parents`
    greedy_only: bool  # True: implements greedy decoding and rejects temperature > 0
    impl: VerifyFn = dataclasses.field(compare=False, repr=False)
    options: tuple[tuple[str, float], ...] = ()

    def verify(self, draft: Draft, target_logits: jax.Array, sampling: SamplingParams,
               key: jax.Array) -> VerifyResult:
        """target_logits: float32 [B, N+1, V]; index 0 is at the root, index i+1 at node i."""
        b, n = draft.tokens.shape
        if n == 0:
            raise ValueError(f"{self.name}: a draft needs at least one node (a row that proposes nothing "
                             "marks its nodes invalid)")
        if target_logits.ndim != 3 or target_logits.shape[:2] != (b, n + 1):
            raise ValueError(f"{self.name}: target_logits must be [B, N+1, V] = [{b}, {n + 1}, V] for a draft "
                             f"of {n} nodes, got {tuple(target_logits.shape)}")
        if draft.probs is not None and draft.probs.shape != (b, n, target_logits.shape[2]):
            raise ValueError(f"{self.name}: draft.probs must be [B, N, V] = [{b}, {n}, {target_logits.shape[2]}], "
                             f"got {tuple(draft.probs.shape)}")
        return self.impl(draft, target_logits, sampling, key, **dict(self.options))


# ----------------------------------------------------------------------------------------------------------
# Helpers shared by the policies
# ----------------------------------------------------------------------------------------------------------

def require_greedy(name: str, sampling: SamplingParams) -> None:
    """Greedy policies would silently turn a sampled run into greedy decoding; refuse instead."""
    if not sampling.greedy:
        raise ValueError(f"policy {name!r} implements greedy decoding and needs temperature 0, got {sampling}; "
                         "use 'rejection_chain' or 'multidraft_tree' to verify sampled drafts losslessly")


def round_noise(key: jax.Array, batch_size: int, num_nodes: int, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """All the randomness of one verification round, from a single `jax.random.uniform` call.

    Returns the U(0, 1) variables of the acceptance tests, [B, N] (one per node, so per row and position),
    and Gumbel noise [B, V] for the final correction / bonus draw. Why one flat draw rather than a key per
    row and per purpose: on XLA:CPU each threefry call costs seconds of compile time, and a multi-dimensional
    (or vmapped) one several times more than a 1-D one; the values are equally random either way.
    """
    width = num_nodes + vocab_size
    u = jax.random.uniform(key, (batch_size * width,), minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)
    u = u.reshape(batch_size, width)
    return u[:, :num_nodes], -jnp.log(-jnp.log(u[:, num_nodes:]))


def final_sample(gumbel: jax.Array, dist: jax.Array) -> jax.Array:
    """Draw the correction / bonus token of each row from dist [B, V] (non-negative, maybe unnormalised) by
    the Gumbel-max trick: argmax(log dist + Gumbel) is distributed as dist, like `sample_from_probs`."""
    log_dist = jnp.where(dist > 0, jnp.log(jnp.where(dist > 0, dist, 1.0)), -jnp.inf)
    return jnp.argmax(log_dist + gumbel, axis=-1).astype(jnp.int32)


def residual(p: jax.Array, q: jax.Array) -> jax.Array:
    """norm(max(p - q, 0)): what is left of p after a draft from q was rejected. [..., V].

    Rejection only happens where p(x) < q(x), so in exact arithmetic the residual has positive mass whenever
    it is needed; if rounding (or an inconsistent q that proposed a q(x) = 0 token) leaves it empty, p itself
    is the only sensible fallback.
    """
    r = jnp.maximum(p - q, 0.0)
    mass = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(mass > 0, r / jnp.where(mass > 0, mass, 1.0), p)


def commit(draft_tokens: jax.Array, path: jax.Array, num_accepted: jax.Array,
           next_token: jax.Array) -> VerifyResult:
    """Assemble the padded result: tokens along the accepted path, then the target's token, then -1."""
    b, n = draft_tokens.shape
    num_accepted = num_accepted.astype(jnp.int32)
    path = jnp.where(jnp.arange(n) < num_accepted[:, None], path, -1).astype(jnp.int32)
    along_path = jnp.take_along_axis(draft_tokens, jnp.maximum(path, 0), axis=1)
    along_path = jnp.concatenate([along_path, jnp.zeros((b, 1), jnp.int32)], axis=1)
    pos = jnp.arange(n + 1)[None, :]
    a = num_accepted[:, None]
    tokens = jnp.where(pos < a, along_path, jnp.where(pos == a, next_token[:, None].astype(jnp.int32), -1))
    return VerifyResult(num_accepted=num_accepted, tokens=tokens.astype(jnp.int32), path=path)
