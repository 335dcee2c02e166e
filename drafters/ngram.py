"""Prompt lookup / n-gram drafting, in JAX inside the compiled loop.

Find the latest earlier occurrence of the last n committed tokens (n from `max_ngram` down to `min_ngram`)
and propose the tokens that followed it; report how far back that occurrence matches as the draft's evidence.
Deterministic: the draft distribution is one-hot (probs=None), which the rejection-sampling policies handle
exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from drafters import register
from specdec.drafter import MATCH_CLASS_STARTS, Draft, Drafter, RoundContext, match_length_class


def match_lengths(seq: jax.Array, seq_len: jax.Array, cap: int) -> jax.Array:
    """int32 [B, C]: for each slot i, how many tokens ending at i equal the tokens ending at the row's last
    committed token (seq_len - 1), up to `cap`; 0 where slot i + 1 (the continuation) is not committed yet."""
    batch, capacity = seq.shape
    slot = jnp.arange(capacity)[None, :]
    run = jnp.ones((batch, capacity), bool)
    length = jnp.zeros((batch, capacity), jnp.int32)
    for j in range(cap):  # static loop over the match's length, not over tokens
        back = seq_len[:, None] - 1 - j  # the tail's token j places back from its end
        tail_j = jnp.take_along_axis(seq, jnp.clip(back, 0, capacity - 1), axis=1)  # [B, 1]
        run = run & (jnp.roll(seq, j, axis=1) == tail_j) & (slot - j >= 0) & (back >= 0)  # seq[i - j] == tail_j
        length = length + run
    return jnp.where(slot <= seq_len[:, None] - 2, length, 0)


class NgramDrafter(Drafter):
    """Prompt lookup: the continuation of the latest occurrence of the longest n-gram (max_ngram down to
    min_ngram) that ends the committed sequence. The draft's evidence class is how far back that occurrence
    matches (`specdec.drafter.match_length_class`, up to 8 tokens, beyond max_ngram): in copy-heavy text a
    match runs on for many tokens, where open text matches one to three tokens by chance."""

    name = "ngram"
    kind = "chain"
    jittable = True
    deterministic = True
    evidence_classes = len(MATCH_CLASS_STARTS)

    def __init__(self, num_draft_tokens: int, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram drafter needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.num_draft_tokens, self.max_ngram, self.min_ngram = num_draft_tokens, max_ngram, min_ngram

    def _best_match(self, ctx: RoundContext):
        """(int32 [B] the matched occurrence's last slot, bool [B] found, int32 [B] how far back it matches, up
        to 8 tokens)."""
        seq, seq_len = ctx.seq, ctx.seq_len
        capacity = seq.shape[1]
        length = match_lengths(seq, seq_len, max(self.max_ngram, MATCH_CLASS_STARTS[-1]))
        # the longest n-gram (capped at max_ngram) wins, then the latest occurrence
        ngram = jnp.where(length >= self.min_ngram, jnp.minimum(length, self.max_ngram), 0)
        best = jnp.argmax(ngram * capacity + jnp.arange(capacity)[None, :], axis=1)  # [B] the match's last slot
        found = jnp.take_along_axis(ngram, best[:, None], axis=1)[:, 0] > 0
        return best, found, jnp.take_along_axis(length, best[:, None], axis=1)[:, 0] * found

    def match_length(self, ctx: RoundContext) -> jax.Array:
        """int32 [B]: how many tokens of committed context the drafted continuation's match spans (0: none)."""
        return self._best_match(ctx)[2]

    def propose(self, params, state, ctx: RoundContext, sampling, key):
        seq, seq_len = ctx.seq, ctx.seq_len
        capacity = seq.shape[1]
        best, found, matched = self._best_match(ctx)
        cont = jnp.where(found, best + 1, -1)
        idx = cont[:, None] + jnp.arange(self.num_draft_tokens)[None, :]
        valid = (cont[:, None] >= 0) & (idx < seq_len[:, None])
        tokens = jnp.take_along_axis(seq, jnp.clip(idx, 0, capacity - 1), axis=1)
        evidence = match_length_class(matched)
        return Draft.chain(jnp.where(valid, tokens, 0), probs=None, valid=valid, evidence=evidence), state

    def describe(self):
        return {**super().describe(), "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}


@register("ngram")
def make(target, num_draft_tokens: int, max_ngram: int = 3, min_ngram: int = 1):
    return NgramDrafter(num_draft_tokens, max_ngram=max_ngram, min_ngram=min_ngram)


register("prompt_lookup")(make)
