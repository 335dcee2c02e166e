"""What a verification policy is (`Policy`), and the few helpers the policies have in common.

A drafter proposes a `Draft` (a chain or a tree of tokens, with the draft distributions they were drawn
from); the target scores all of it in one forward; a policy turns (draft, target logits, sampling params,
key) into a `VerifyResult`: how many draft tokens each row keeps, the committed tokens (the accepted
ones plus one correction / bonus token from the target), and which tree nodes were accepted (the engine
needs that to compact the KV cache and update the drafter). The key is a `specdec.sampling.SampleKey`: the
seed, the rows' ids and the absolute position of the root's successor, so every random draw of a policy is
keyed by (row, position), never by the round (a plain `jax.random` key stands for a seed, rows 0..B-1 at 0). `Draft` and `VerifyResult` are the drafter's
contract too and live beside the Drafter protocol (specdec/drafter.py); each policy module declares its own
`Policy` objects, and registry.py lists them.

Everything here is batched with static shapes: rows accept different numbers of tokens, so results are
padded with -1 rather than sliced, and nothing loops over rows in Python.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from specdec import trees
from specdec.drafter import Draft, VerifyResult
from specdec.sampling import CORRECTION_STREAM, SamplingParams, as_sample_key, gumbel_noise, verify_uniforms

VerifyFn = Callable[..., VerifyResult]


@dataclasses.dataclass(frozen=True)
class Policy:
    """A named verification policy. Hashable (by name and options), so it can be a static jit argument."""

    name: str
    lossless: bool  # output distribution == the target's (under the sampling params it accepts)
    supports_trees: bool  # False: assumes a chain (parents = [-1, 0, 1, ...]) and ignores `parents`
    greedy_only: bool  # True: implements greedy decoding and rejects temperature > 0
    impl: VerifyFn = dataclasses.field(compare=False, repr=False)
    options: tuple[tuple[str, float], ...] = ()  # keyword arguments of `impl`, sorted; the defaults name all it takes
    # A chain policy's tree policy with the same acceptance rule: what a chain policy runs as on a tree drafter.
    tree_counterpart: str | None = None
    # True: commits AR's very tokens for the same seed at every temperature, not only a sample of AR's law, so
    # speculative output == AR output is a check that can fail at temperature > 0 too (benchmarks count it).
    same_tokens_as_ar: bool = False

    def with_options(self, **options: float) -> Policy:
        """This policy with `options` overriding its defaults. An option it does not take is an error, never
        silently ignored."""
        allowed = dict(self.options)
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(f"policy {self.name!r} has no option(s) {unknown}; allowed: {list(allowed) or 'none'}")
        if not options:
            return self
        merged = {**allowed, **{k: float(v) for k, v in options.items()}}
        return dataclasses.replace(self, options=tuple(sorted(merged.items())))

    def verify(self, draft: Draft, target_logits: jax.Array, sampling: SamplingParams, key) -> VerifyResult:
        """target_logits: float32 [B, N+1, V]; index 0 is at the root, index i+1 at node i. key: a
        `specdec.sampling.SampleKey` (offset 0 = the position after the root), or a `jax.random` key."""
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


def node_offsets(parents: jax.Array) -> jax.Array:
    """Each node's draw offset [B, N]: its depth below the root minus 1 (a node at depth d is the token at
    position key.start + d - 1; see `specdec.sampling.SampleKey`)."""
    return jnp.sum(trees.ancestor_matrix(parents), axis=2, dtype=jnp.int32) - 1


def rejection_noise(key, draft: Draft, offsets: jax.Array | None = None) -> jax.Array:
    """The U(0, 1) variables of a rejection policy's acceptance tests [B, N]: node i's at its own position and
    slot, in the test stream (`specdec.sampling.verify_uniforms`), so they are independent of the draft the
    drafters drew with the sample stream and of the correction draw, and siblings at one position get
    independent tests. A position's
    variables decide only the round that commits that position, so reusing them by position is as fresh as a
    new key per round."""
    key = as_sample_key(key, draft.batch_size)
    offsets = node_offsets(draft.parents) if offsets is None else offsets
    return verify_uniforms(key, offsets, jnp.arange(draft.num_nodes, dtype=jnp.int32))


def correction_noise(key, offsets: jax.Array, vocab_size: int) -> jax.Array:
    """Gumbel noise [B, V] for a rejection policy's correction / bonus draw at offset `offsets` [B] (the position
    after the accepted path), in the correction stream."""
    key = as_sample_key(key, offsets.shape[0])
    return gumbel_noise(key, offsets, jnp.arange(vocab_size, dtype=jnp.int32), CORRECTION_STREAM)


def final_sample(gumbel: jax.Array, dist: jax.Array) -> jax.Array:
    """Draw the correction / bonus token of each row from dist [B, V] (non-negative, maybe unnormalised) by
    the Gumbel-max trick: argmax(log dist + Gumbel) is distributed as dist."""
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
