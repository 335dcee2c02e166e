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

One tree for both (`lookup_nodes` = n > 0, tree models only): a row that copies verifies the lookup's first n
tokens as one branch AND the model's best `num_draft_tokens - n` nodes beside it, so a lookup that is wrong at
its first token still leaves the model's alternatives (the choice "lookup or model" becomes "lookup first, the
model next"); `alone_match` = m keeps the lookup's whole chain alone where the match spans m tokens or more
(long copies, where the lookup's later tokens are worth more than the model's alternatives). The lookup's branch
comes first: `multidraft_tree` tries it before the model's children, and a
prefix of the tree (the adaptive width's) is the lookup's chain. Still lossless above temperature 0: the
lookup's tokens are deterministic (q one-hot), the model's children are drawn from its own q independently of
them, so each sibling's test is an ordinary rejection step against the residual the earlier ones left
(`specdec/verify/tree.py`). The model's forward is then skipped only in rounds where every row verifies the
lookup's chain alone.
"""

from __future__ import annotations

import dataclasses

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

    def __init__(self, model: Drafter, lookup: NgramDrafter, min_match: int, lookup_nodes: int = 0,
                 alone_match: int = 0):
        if not model.jittable:
            raise ValueError(f"hybrid: the trained drafter must draft in JAX; {model.name!r} does not")
        if min_match < 1:
            raise ValueError(f"hybrid: min_match must be >= 1, got {min_match}")
        if lookup_nodes and not (model.kind == "tree" and model.ordered_tree):
            raise ValueError(f"hybrid: lookup_nodes={lookup_nodes} puts the lookup's branch into the model's token "
                             f"tree; {model.name!r} drafts a chain here (give it tree_top_k / tree_depth)")
        if not 0 <= lookup_nodes < model.num_draft_tokens:
            raise ValueError(f"hybrid: lookup_nodes must be in [0, num_draft_tokens = {model.num_draft_tokens}) "
                             f"(0: the lookup's chain or the model's tree, per row), got {lookup_nodes}")
        self.model, self.lookup, self.min_match = model, lookup, int(min_match)
        if alone_match and not (lookup_nodes and alone_match > min_match):
            raise ValueError(f"hybrid: alone_match={alone_match} (the match from which the lookup's chain is verified "
                             f"alone) needs lookup_nodes > 0 and alone_match > min_match = {min_match}")
        self.lookup_nodes, self.alone_match = int(lookup_nodes), int(alone_match)
        self.num_draft_tokens = model.num_draft_tokens
        # a tree model (DSpark / DFlash with tree_top_k): the rows that copy carry the lookup's chain as a tree of
        # one branch; a chain's every prefix is the best tree of its size, so the order stays best first
        self.kind, self.ordered_tree = model.kind, model.ordered_tree
        self.taps, self.params = model.taps, model.params

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
        use, length = self.choose_lookup(ctx)
        shapes = jax.eval_shape(lambda: self.model.propose(params, state, ctx, sampling, key))

        def model_propose():
            return self.model.propose(params, state, ctx, sampling, key)

        def no_model():  # every active row verifies the lookup alone: the model's forward is skipped (its state
            # needs no proposal: it catches up in update or in its next propose, `Drafter.update`)
            kept = jax.tree.map(lambda s, x: jnp.asarray(x, s.dtype), shapes[1], state)
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[0]), kept

        # rows that verify the lookup's chain alone: every copying row, or with `lookup_nodes` only the matches of
        # >= alone_match tokens (none when it is 0)
        if not self.lookup_nodes:
            alone = use
        else:
            alone = use & (length >= self.alone_match) if self.alone_match else jnp.zeros_like(use)
        # a function of the committed context alone: sampled drafts stay exact
        model_draft, state = jax.lax.cond(jnp.all(alone | ctx.done), no_model, model_propose)
        if model_draft.probs is not None:  # sampled: the lookup's rows carry their one-hot q
            one_hot = jax.nn.one_hot(lookup_draft.tokens, model_draft.probs.shape[-1], dtype=model_draft.probs.dtype)
            lookup_draft = dataclasses.replace(lookup_draft, probs=one_hot)
        if self.lookup_nodes:  # the copying rows' tree: the lookup's branch beside the model's best nodes, or
            # (a match of >= alone_match tokens) the lookup's chain alone
            lookup_draft = rows_where(alone | ctx.done, lookup_draft, self.lookup_beside_model(lookup_draft,
                                                                                               model_draft))
        # finished rows take the lookup's draft: never the skipped model's zeros as q
        draft = rows_where(use | ctx.done, lookup_draft, model_draft)
        return dataclasses.replace(draft, evidence=self.evidence_before_draft(ctx)), state

    def lookup_beside_model(self, lookup: Draft, model: Draft) -> Draft:
        """One tree: the lookup's first `lookup_nodes` tokens as a chain from the root (nodes 0..n-1), then the
        model's best nodes (its first N - n: a prefix of a best-first tree is a tree), their parents shifted by
        n (the root stays -1)."""
        n, rest = self.lookup_nodes, self.num_draft_tokens - self.lookup_nodes
        join = lambda a, b: jnp.concatenate([a[:, :n], b[:, :rest]], axis=1)  # noqa: E731
        parents = join(lookup.parents, jnp.where(model.parents >= 0, model.parents + n, -1))
        probs = None if lookup.probs is None else join(lookup.probs, model.probs)
        scores = None if model.scores is None else join(lookup_scores(lookup), model.scores)
        return dataclasses.replace(Draft.tree(join(lookup.tokens, model.tokens), parents, probs=probs,
                                              valid=join(lookup.valid, model.valid)), scores=scores)

    def update(self, params, state, ctx, result, taps):
        return self.model.update(params, state, ctx, result, taps)

    def profiling(self):
        return self.model.profiling()

    def static_key(self) -> tuple:
        return (type(self).__qualname__, self.model.static_key(), self.lookup.static_key(), self.min_match,
                self.lookup_nodes, self.alone_match)

    def describe(self):
        out = {**self.model.describe(), "drafter": NAME, "model": self.model.name, "min_match": self.min_match,
               "max_ngram": self.lookup.max_ngram}
        if self.lookup_nodes:  # only then: a default hybrid's description (a cache key) is unchanged
            out["lookup_nodes"] = self.lookup_nodes
        if self.alone_match:
            out["alone_match"] = self.alone_match
        return out


def lookup_scores(draft: Draft) -> jax.Array:
    """The lookup's nodes carry no acceptance estimate of their own (`Draft.scores` < 0)."""
    return jnp.full(draft.tokens.shape, -1.0, jnp.float32) if draft.scores is None else draft.scores


def rows_where(rows: jax.Array, a: Draft, b: Draft) -> Draft:
    """Per row: draft `a` where `rows` (bool [B]) holds, else `b` (tokens, parents, q, validity, scores)."""
    pick = lambda x, y: jnp.where(rows.reshape(rows.shape + (1,) * (x.ndim - 1)), x, y)  # noqa: E731
    scores = None if b.scores is None else pick(lookup_scores(a), b.scores)
    return dataclasses.replace(Draft.tree(pick(a.tokens, b.tokens), pick(a.parents, b.parents),
                                          probs=None if b.probs is None else pick(a.probs, b.probs),
                                          valid=pick(a.valid, b.valid)), scores=scores)


@register(NAME)
def make(target, num_draft_tokens: int, path: str = str(SHIPPED_DRAFTER), min_match: int = 2,
         max_ngram: int = 3, tree_top_k: int = 0, tree_depth: int = 0, tree_accept: float | None = None,
         tree_sampling: str | None = None, lookup_nodes: int = 0, alone_match: int = 0):
    """`path`: a trained chain drafter's directory (the kind read from it; default: the shipped DSpark);
    `min_match`: the shortest lookup match (tokens) whose continuation is drafted instead of the model's (1, 2,
    3 and 4 gave mean engine tau 1.85, 1.88, 1.88 and 1.81 with an earlier shipped DSpark on MT-Bench / GSM8K /
    HumanEval, 2 ahead on MT-Bench and GSM8K; at 2, 1.94 and 1.98 with the next two retrained ones;
    docs/TRAINING.md);
    `max_ngram`: the lookup's longest n-gram (as the ngram drafter's);
    `tree_top_k` / `tree_depth`: the trained drafter drafts a token tree of `num_draft_tokens` nodes (block
    drafters; the rows that copy still take the lookup's chain), verified by the tree policies; `tree_accept`:
    the prior that shapes the model's sampled trees above temperature 0 (None: the model's default; 0: top-k);
    `tree_sampling`: "fixed" or "dynamic" (None: the model's default; `DFlashDrafter.sampled_children`);
    `lookup_nodes`: with a tree, the rows that copy verify the lookup's first `lookup_nodes` tokens and the
    model's best other nodes in one tree (0: the lookup's chain alone; 5 of 11 and 7 of 15 nodes with
    alone_match 4 and min_match 1 raised the mean T = 0 engine tau from 2.37 / 2.43 to 2.54 / 2.62, but not at
    T = 1, and at batch 1 under the adaptive width it is 2-5% slower, unless the width values a prefix by its
    nodes, `scheduler.tree_value: nodes`: then 5% faster on GSM8K and HumanEval, 4% slower on MT-Bench;
    docs/TRAINING.md, sessions 36 and 37);
    `alone_match`: with `lookup_nodes`, rows whose match spans at least this many tokens verify the lookup's
    whole chain alone (0: never)."""
    tree = {"tree_top_k": tree_top_k, "tree_depth": tree_depth} if tree_top_k or tree_depth else {}
    if tree_accept is not None:
        tree["tree_accept"] = tree_accept
    if tree_sampling is not None:
        tree["tree_sampling"] = tree_sampling
    model = create_drafter(None, target, num_draft_tokens, path=path, **tree)
    return HybridDrafter(model, NgramDrafter(num_draft_tokens, max_ngram=max_ngram), min_match, lookup_nodes,
                         alone_match)
