"""Prompt lookup / n-gram drafting, in JAX inside the compiled loop.

Find the latest earlier occurrence of the last n committed tokens (n from `max_ngram` down to `min_ngram`)
and propose the tokens that followed it. Deterministic: the draft distribution is one-hot (probs=None),
which the rejection-sampling policies handle exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from drafters import register
from specdec.drafter import Draft, Drafter, RoundContext


def lookup_continuation(seq: jax.Array, seq_len: jax.Array, n: int) -> jax.Array:
    """Start index of the continuation after the latest earlier match of the last n tokens, or -1. [B]"""
    batch, capacity = seq.shape
    tail_idx = jnp.clip(seq_len[:, None] - n + jnp.arange(n)[None, :], 0, capacity - 1)
    tail = jnp.take_along_axis(seq, tail_idx, axis=1)  # [B, n]
    match = jnp.ones((batch, capacity), bool)
    for j in range(n):  # static loop over the n-gram width, not over tokens
        shifted = jnp.roll(seq, -j, axis=1)  # shifted[b, i] = seq[b, i + j]
        match = match & (shifted == tail[:, j : j + 1])
    start = jnp.arange(capacity)[None, :]
    # the match must end before the tail starts, so a continuation token exists inside the sequence
    allowed = (start + n <= seq_len[:, None] - 1) & (seq_len[:, None] > n)
    latest = jnp.max(jnp.where(match & allowed, start, -1), axis=1)
    return jnp.where(latest >= 0, latest + n, -1)


class NgramDrafter(Drafter):
    name = "ngram"
    kind = "chain"
    jittable = True

    def __init__(self, num_draft_tokens: int, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram drafter needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.num_draft_tokens, self.max_ngram, self.min_ngram = num_draft_tokens, max_ngram, min_ngram

    def propose(self, params, state, ctx: RoundContext, sampling, key):
        seq, seq_len = ctx.seq, ctx.seq_len
        cont = jnp.full(seq_len.shape, -1, jnp.int32)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):  # longest match wins
            found = lookup_continuation(seq, seq_len, n)
            cont = jnp.where(cont < 0, found, cont)
        idx = cont[:, None] + jnp.arange(self.num_draft_tokens)[None, :]
        valid = (cont[:, None] >= 0) & (idx < seq_len[:, None])
        tokens = jnp.take_along_axis(seq, jnp.clip(idx, 0, seq.shape[1] - 1), axis=1)
        return Draft.chain(jnp.where(valid, tokens, 0), probs=None, valid=valid), state

    def describe(self):
        return {**super().describe(), "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}


@register("ngram")
def make(target, num_draft_tokens: int, max_ngram: int = 3, min_ngram: int = 1):
    return NgramDrafter(num_draft_tokens, max_ngram=max_ngram, min_ngram=min_ngram)


register("prompt_lookup")(make)
