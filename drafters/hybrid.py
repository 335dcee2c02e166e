"""Hybrid drafting: prompt lookup where the context repeats itself, a trained drafter everywhere else.

Prompt lookup and a trained drafter fail in different places. Lookup is nearly free and is accepted for many
tokens in a row where the answer copies the prompt or itself (code that repeats a signature, a rewrite), but
drafts nothing useful in open text. A trained drafter (DSpark, DFlash, ...) predicts open text better, but
rarely guesses a long copied span as well as a lookup that has already seen it. Each round, per row, this
drafter proposes the lookup's continuation when the committed context ends in a match of at least
`min_match` tokens, and the trained drafter's draft otherwise. (Arctic Inference pairs suffix decoding with a
model drafter the same way, choosing by the suffix match's score.)

Why it stays lossless: the choice reads only the committed context (the match length), never a sampled draft
token, and each row's draft carries the distribution it was drawn from (the trained drafter's q, or the
one-hot of the deterministic lookup), so rejection sampling is exact for either.

The trained drafter's `update` folds in the target's hidden states of whatever was verified, every round, so
switching rows between the two drafts costs it nothing; its `propose` (the forward that costs) is skipped in
rounds where every active row copies. The draft's evidence class is known before drafting
(`evidence_before_draft`), so the adaptive verify width plans a row about to copy with the lookup's history and
drafts it even where the model's drafts have stopped paying.
The draft's evidence class (`Draft.evidence`, which the adaptive verify width keeps its acceptance history by)
is 0 for the trained drafter's draft and 1 + the lookup's match-length class for the lookup's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from drafters import SHIPPED_DRAFTER, create_drafter, register
from drafters.ngram import NgramDrafter
from specdec.drafter import MATCH_CLASS_STARTS, Draft, Drafter, RoundContext, match_length_class

NAME = "hybrid"


class HybridDrafter(Drafter):
    """Per row: the lookup's draft when the context ends in a match of >= `min_match` tokens, else `model`'s."""

    name = NAME
    jittable = True
    evidence_classes = 1 + len(MATCH_CLASS_STARTS)  # 0: the model's draft; 1 + c: the lookup's, match class c

    def __init__(self, model: Drafter, lookup: NgramDrafter, min_match: int):
        if not model.jittable:
            raise ValueError(f"hybrid: the trained drafter must draft in JAX; {model.name!r} does not")
        if min_match < 1:
            raise ValueError(f"hybrid: min_match must be >= 1, got {min_match}")
        self.model, self.lookup, self.min_match = model, lookup, int(min_match)
        self.num_draft_tokens = model.num_draft_tokens
        # a tree model (DSpark / DFlash with tree_top_k): the rows that copy carry the lookup's chain as a tree of
        # one branch; a chain's every prefix is the best tree of its size, so the order stays best first
        self.kind, self.ordered_tree = model.kind, model.ordered_tree
        self.taps, self.params, self.skippable = model.taps, model.params, model.skippable

    def init(self, params, prompt, capacity):
        return self.model.init(params, prompt, capacity)

    def choose_lookup(self, ctx: RoundContext) -> tuple[jax.Array, jax.Array]:
        """(bool [B] rows whose lookup draft is used, int32 [B] the lookup's match length), from the committed
        context alone."""
        length = self.lookup.match_length(ctx)
        return length >= self.min_match, length

    def evidence_before_draft(self, ctx: RoundContext) -> jax.Array:
        """The draft's evidence class, from the committed context alone (so the adaptive width plans with the
        lookup's history in a row about to copy, and with the model's elsewhere)."""
        use, length = self.choose_lookup(ctx)
        return jnp.where(use, 1 + match_length_class(length), 0)

    def propose(self, params, state, ctx: RoundContext, sampling, key):
        lookup_draft, _ = self.lookup.propose({}, (), ctx, sampling, key)
        use, _ = self.choose_lookup(ctx)
        shapes = jax.eval_shape(lambda: self.model.propose(params, state, ctx, sampling, key))

        def model_propose():
            return self.model.propose(params, state, ctx, sampling, key)

        def no_model():  # every active row copies: the model's forward is skipped (a skippable model's state
            # needs no proposal)
            kept = jax.tree.map(lambda s, x: jnp.asarray(x, s.dtype), shapes[1], state)
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[0]), kept

        if self.model.skippable:  # a function of the committed context alone: sampled drafts stay exact
            model_draft, state = jax.lax.cond(jnp.all(use | ctx.done), no_model, model_propose)
        else:  # its propose catches up on the committed tokens (EAGLE-3, draft LMs): it runs every round
            model_draft, state = model_propose()
        take = use | ctx.done  # finished rows take the lookup's draft: never the skipped model's zeros as q
        pick = lambda a, b: jnp.where(take.reshape(take.shape + (1,) * (a.ndim - 1)), a, b)  # noqa: E731
        probs = None
        if model_draft.probs is not None:  # sampled: the lookup's rows carry their one-hot q
            one_hot = jax.nn.one_hot(lookup_draft.tokens, model_draft.probs.shape[-1], dtype=model_draft.probs.dtype)
            probs = pick(one_hot, model_draft.probs)
        draft = Draft.tree(pick(lookup_draft.tokens, model_draft.tokens),
                           pick(lookup_draft.parents, model_draft.parents), probs=probs,
                           valid=pick(lookup_draft.valid, model_draft.valid), evidence=self.evidence_before_draft(ctx))
        return draft, state

    def update(self, params, state, ctx, result, taps):
        return self.model.update(params, state, ctx, result, taps)

    def profiling(self):
        return self.model.profiling()

    def static_key(self) -> tuple:
        return (type(self).__qualname__, self.model.static_key(), self.lookup.static_key(), self.min_match)

    def describe(self):
        return {**self.model.describe(), "drafter": NAME, "model": self.model.name, "min_match": self.min_match,
                "max_ngram": self.lookup.max_ngram}


@register(NAME)
def make(target, num_draft_tokens: int, path: str = str(SHIPPED_DRAFTER), min_match: int = 2,
         max_ngram: int = 3, tree_top_k: int = 0, tree_depth: int = 0, tree_accept: float | None = None,
         tree_sampling: str | None = None):
    """`path`: a trained chain drafter's directory (the kind read from it; default: the shipped DSpark);
    `min_match`: the shortest lookup match (tokens) whose continuation is drafted instead of the model's (1, 2,
    3 and 4 gave mean engine tau 1.85, 1.88, 1.88 and 1.81 with session 25's shipped DSpark on MT-Bench / GSM8K
    / HumanEval; 2 was ahead on MT-Bench and GSM8K; docs/TRAINING.md, session 25; at 2, 1.94 with session 26's
    and 1.98 with session 27's);
    `max_ngram`: the lookup's longest n-gram (as the ngram drafter's);
    `tree_top_k` / `tree_depth`: the trained drafter drafts a token tree of `num_draft_tokens` nodes (block
    drafters; the rows that copy still take the lookup's chain), verified by the tree policies; `tree_accept`:
    the prior that shapes the model's sampled trees above temperature 0 (None: the model's default; 0: top-k);
    `tree_sampling`: "fixed" or "dynamic" (None: the model's default; `DFlashDrafter.sampled_children`)."""
    tree = {"tree_top_k": tree_top_k, "tree_depth": tree_depth} if tree_top_k or tree_depth else {}
    if tree_accept is not None:
        tree["tree_accept"] = tree_accept
    if tree_sampling is not None:
        tree["tree_sampling"] = tree_sampling
    model = create_drafter(None, target, num_draft_tokens, path=path, **tree)
    return HybridDrafter(model, NgramDrafter(num_draft_tokens, max_ngram=max_ngram), min_match)
