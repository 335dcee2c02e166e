"""The Drafter protocol: what the speculative engine asks of every drafter.

A drafter proposes a draft each round (a chain of k tokens, or a token tree), with the per-token draft
distributions (or none: deterministic, q = one-hot), and updates its state from what the target accepted.

Life cycle inside `specdec.engine.speculative_generate`:

    state = drafter.init(params, prompt)                      # once, after the target's prefill
    loop:
        draft, state = drafter.propose(params, state, ctx, sampling, key)  # ctx: committed tokens so far
        ... the target verifies [root, draft] in one step, the policy accepts a prefix/path ...
        state = drafter.update(params, state, ctx_after, result, taps)
    (a round whose draft the scheduler skips is a plain decode step that calls neither; the drafter catches up
    on the tokens such rounds committed in its next `update` or `propose`: see `Drafter.update`)

The two values that cross between drafter and policy live here too: the `Draft` a drafter proposes and the
`VerifyResult` a verification policy (specdec/verify/) returns and the drafter's `update` reads.

`params` is the drafter's array pytree (weights; `{}` for training-free drafters). It is passed explicitly,
never closed over, so jit sees it as an argument rather than baking hundreds of MB of constants into the
program. The drafter object itself is static configuration (hashable by identity).

A drafter whose `jittable` is True is written in pure JAX with static shapes and runs inside the compiled
`lax.while_loop`; otherwise (Python state, e.g. a suffix tree over a corpus) the engine runs a host-stepped
loop and calls `propose`/`update` with NumPy-convertible arrays.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specdec.sampling import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PromptInfo:
    """What the drafter sees once, after prefill."""

    tokens: jax.Array  # int32 [B, T] right-padded prompts
    lengths: jax.Array  # int32 [B]
    taps: jax.Array | None  # [n_taps, B, T, H] target hidden states at the prompt positions (if requested)
    first_token: jax.Array  # int32 [B] the token sampled from the prefill logits (the first root)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RoundContext:
    """The committed sequence at the start (or end) of a round."""

    seq: jax.Array  # int32 [B, C] prompt + generated tokens; only the first seq_len[b] are meaningful
    seq_len: jax.Array  # int32 [B]; seq[b, seq_len[b]-1] is the root: committed but not yet in the target cache
    done: jax.Array  # bool [B] rows that have finished
    # the target's KV cache (every committed position but the root), for a drafter built from the target's own
    # layers (self-speculation), whose K/V of those positions it already holds; None outside the loop
    cache: Any = None


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

    `evidence[b]` (optional, int32 [B] in [0, Drafter.evidence_classes)) is what the drafter knows about how
    good this row's draft is, as a class: for prompt lookup, how many tokens the matched context spans (a
    long match in copy-heavy text is accepted far more often than a one-token match in open chat). The
    adaptive verify width keeps each row's acceptance history per class (specdec/adaptive.py). It must be a
    function of the committed context alone, never of this round's random draws: whether a token is verified
    must not depend on its sampled value.

    `scores[b, i]` (optional, float32 [B, N]) is the drafter's own estimate that node i is accepted once its
    parent is: for a top-k tree, q of the node's token at its parent's context (`trees.grow_dynamic_tree`);
    negative = no estimate (the hybrid's lookup nodes). The adaptive width (`score_bins`) values a drafted
    deterministic tree by it, corrected by the row's history in the score's bin. Like `evidence` it may only
    depend on the committed context and the tokens above the node.
    """

    tokens: jax.Array  # int32 [B, N]
    parents: jax.Array  # int32 [B, N]
    probs: jax.Array | None  # float32 [B, N, V] or None (deterministic draft: q = one-hot at the token)
    valid: jax.Array  # bool [B, N]
    evidence: jax.Array | None = None  # int32 [B] a class of the draft's expected quality, or None (one class)
    scores: jax.Array | None = None  # float32 [B, N] the drafter's P(node accepted | parent accepted), or None

    @staticmethod
    def chain(tokens: jax.Array, probs: jax.Array | None = None, valid: jax.Array | None = None,
              evidence: jax.Array | None = None) -> "Draft":
        """A chain draft: node i's parent is node i-1. `valid` defaults to all True."""
        tokens = jnp.asarray(tokens, jnp.int32)
        b, n = tokens.shape
        parents = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) - 1, (b, n))
        return Draft.tree(tokens, parents, probs, valid, evidence)

    @staticmethod
    def tree(tokens: jax.Array, parents: jax.Array, probs: jax.Array | None = None,
             valid: jax.Array | None = None, evidence: jax.Array | None = None) -> "Draft":
        """A tree draft; `parents` may be [N] (one static tree for all rows) or [B, N]."""
        tokens = jnp.asarray(tokens, jnp.int32)
        parents = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), tokens.shape)
        valid = jnp.ones(tokens.shape, bool) if valid is None else jnp.asarray(valid, bool)
        probs = None if probs is None else jnp.asarray(probs, jnp.float32)
        evidence = None if evidence is None else jnp.asarray(evidence, jnp.int32)
        return Draft(tokens=tokens, parents=parents, probs=probs, valid=valid, evidence=evidence)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def prefix(self, num_nodes: int) -> "Draft":
        """The draft's first `num_nodes` nodes. Parents come before their children, so a prefix of a tree is a
        tree (what a narrow verify step runs when no valid node lies past it)."""
        cut = lambda x: None if x is None else x[:, :num_nodes]  # noqa: E731
        return dataclasses.replace(self, tokens=cut(self.tokens), parents=cut(self.parents), probs=cut(self.probs),
                                   valid=cut(self.valid))

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

    def padded(self, num_nodes: int) -> "VerifyResult":
        """This result of a verify over fewer nodes, as one over `num_nodes` (the padding is -1, as past the
        accepted path)."""
        extra = num_nodes - self.path.shape[1]
        pad = lambda x: jnp.pad(x, ((0, 0), (0, extra)), constant_values=-1)  # noqa: E731
        return VerifyResult(num_accepted=self.num_accepted, tokens=pad(self.tokens), path=pad(self.path))

    @property
    def num_committed(self) -> jax.Array:
        """Tokens committed this round: accepted drafts plus the target's token."""
        return self.num_accepted + 1


class Drafter:
    """Base class with the protocol's defaults. Subclasses override what they need."""

    name: str = "drafter"
    kind: str = "chain"  # "chain" or "tree"
    jittable: bool = True
    num_draft_tokens: int = 1  # N: draft nodes per round (chain length k, or the tree's node budget)
    taps: tuple[int, ...] = ()  # target layers whose hidden states the drafter reads (0 = embeddings)
    params: Any = None  # the array pytree the engine passes back into propose/update (None: no weights)
    has_confidence: bool = False  # True: draft_confidence() feeds the verify-length schedulers (specdec/scheduling.py)
    # True: `propose` returns probs=None (q one-hot) at every temperature, i.e. the draft is a function of the
    # committed context alone (n-gram, suffix), so the adaptive width may look at it before choosing the width.
    deterministic: bool = False
    # True (trees): the nodes are in priority order, parents first, so any prefix of them is a tree and the best
    # one of its size (suffix decoding's best-first tree): the adaptive width may verify a prefix instead of the
    # whole tree or nothing.
    ordered_tree: bool = False
    # Classes of `Draft.evidence` (1: the drafter gives none). The adaptive width keeps one acceptance history
    # per class and row.
    evidence_classes: int = 1
    # True: `update` reads only the committed context `ctx` (it catches up on every token committed since its last
    # call), so after a run of plain rounds the engine calls it once with result=None and taps=None; a host-side
    # drafter's run of plain rounds is then one compiled call (suffix decoding).
    syncs_from_context: bool = False

    def init(self, params, prompt: PromptInfo, capacity: int) -> Any:
        """Initial drafter state (a pytree) for a batch of prompts. `capacity` bounds sequence length."""
        return ()

    def propose(self, params, state, ctx: RoundContext, sampling: SamplingParams, key):
        """Return (Draft, new_state). Draft probabilities, when given, must come from the same
        `specdec.sampling.probabilities` transform the target will be verified with. `key`: a
        `specdec.sampling.SampleKey` whose offset 0 is the position after the root (ctx.seq_len); a drafter that
        samples draws a node at depth d with `sampling.sample_with_probs(key, logits, sampling, d - 1)`, i.e.
        Gumbel-max on its q with the target's noise at that position, so the invariant policies accept it
        whenever it is the target's own sample there; a tree drafter draws a node's children without replacement
        with that noise (`specdec.trees.draw_children`), the first child being that same coupled draw."""
        raise NotImplementedError

    def draft_confidence(self, state) -> jax.Array:
        """[B, k] estimates a[b, j] that draft positions 0..j all survive verification, for the proposal just
        made (`state` as returned by `propose`). The contract, which the verify-length schedulers
        (specdec/scheduling.py) need to stay lossless:

        - a[:, j] depends only on the context and the draft tokens BEFORE position j (x_0 .. x_{j-1}), never on
          x_j itself nor on the target's verdict: whether x_j is verified must not depend on x_j's value, or
          rejection sampling no longer corrects it (a confidence that reads x_j fails the engine's
          distribution test, tests/test_scheduling.py);
        - a[:, j] is non-increasing in j (a prefix survival probability). `Scheduler.apply` enforces this
          part with a cumulative minimum; the first part no code can check."""
        raise NotImplementedError(f"drafter {self.name!r} has no draft confidences")

    def evidence_before_draft(self, ctx: RoundContext) -> jax.Array | None:
        """int32 [B]: the evidence class (`Draft.evidence`) the next draft will carry, known from the committed
        context alone before drafting, cheaply; or None (the default: known only from the draft). The adaptive
        width then plans with that class's acceptance history instead of the history pooled over the classes, so
        a round it would skip on the pooled history is drafted when the row's class pays (the hybrid drafter: a
        long lookup match in a row whose model drafts rarely pay). It must equal the draft's `evidence`."""
        return None

    def update(self, params, state, ctx: RoundContext, result, taps) -> Any:
        """Fold the round's outcome into the state. `ctx` is the sequence after committing; `result` the
        policy's VerifyResult; `taps` [n_taps, B, T, H] target hidden states at [root, nodes] (or None), T = N + 1.

        Plain rounds (the draft skipped: the adaptive width's width 0) call no drafter code. The loop records
        them, and before the drafter drafts again (or once `CATCH_UP` of them are recorded) calls `update` once
        for the whole run of M of them, as for one round that committed their M tokens as a chain: the first
        plain round's root, then M - 1 accepted drafts and the last committed token as the bonus
        (`result.num_accepted` = M - 1, `result.path` = 0 .. M - 2, then -1), with `taps` the target's hidden
        states at the M roots, padded to T = CATCH_UP positions. So an update that folds in [root, accepted path]
        of any width catches up on every skipped token in one batched step; a drafter that reads only the
        committed tokens (a draft LM) may instead catch up on them in `propose`."""
        return state

    def profiling(self):
        """A context in which the engine runs throwaway rounds on random prompts to time them (the adaptive
        width's cost measurement); a drafter that learns across requests (suffix) must not learn from those."""
        return contextlib.nullcontext()

    # Drafters are static arguments of the compiled loop. A pure-JAX drafter is identified by its settings
    # (its weights travel separately in `params`), so two equal drafters share one compiled program; a drafter
    # with Python state is identified by the object itself.
    def static_key(self) -> tuple:
        settings = {k: v for k, v in vars(self).items() if k != "params"}
        return (type(self).__qualname__, repr(sorted(settings.items())))

    def __hash__(self) -> int:
        return hash(self.static_key()) if self.jittable else id(self)

    def __eq__(self, other) -> bool:
        if not self.jittable or not isinstance(other, Drafter) or not other.jittable:
            return self is other
        return self.static_key() == other.static_key()

    def describe(self) -> dict:
        """Settings that identify this drafter in results tables."""
        return {"drafter": self.name, "num_draft_tokens": self.num_draft_tokens}


# Plain rounds the loop records before the drafter catches up on them (`Drafter.update`): the width of its
# buffer of the target's taps at their roots, so an update's taps are at most max(N + 1, CATCH_UP) positions wide.
# Wider batches the catch-up of a long run of plain rounds into fewer steps; each needs that many cache slots of
# slack in a drafter that writes the positions it catches up on (`catch_up_width`).
CATCH_UP = 16


def catch_up_width(num_draft_tokens: int) -> int:
    """The most positions one `Drafter.update` folds in: N + 1 after a drafted round, CATCH_UP after plain ones."""
    return max(num_draft_tokens + 1, CATCH_UP)


# Match lengths (tokens of committed context that a lookup drafter matched) -> `Draft.evidence` classes:
# 1, 2, 3, 4-7, 8 and more tokens (0 tokens: nothing drafted, class 0 too). Copying a passage of the prompt
# matches 8+ tokens after its first few words; open text matches 1-3 tokens by chance.
MATCH_CLASS_STARTS = (1, 2, 3, 4, 8)


def match_length_class(length):
    """The evidence class of a match of `length` tokens (any shape; int32). A NumPy array in gives a NumPy array
    out (a host-side drafter's draft, without an eager device op per round)."""
    xp = np if isinstance(length, np.ndarray) else jnp
    starts = xp.asarray(MATCH_CLASS_STARTS[1:], xp.int32)
    return xp.sum(xp.asarray(length, xp.int32)[..., None] >= starts, axis=-1).astype(xp.int32)


# ---------------------------------------------------------------------------------------------------------
# Reduced draft vocabularies (FR-Spec): a drafter whose head covers only the ids d2t [Vd] of the target's
# vocabulary samples in draft ids; the engine sees target ids and distributions over the full vocabulary.
# ---------------------------------------------------------------------------------------------------------

def draft_to_target(ids: jax.Array, d2t: jax.Array | None) -> jax.Array:
    """Draft-vocabulary ids -> target ids (no map: unchanged)."""
    return ids if d2t is None else d2t[ids]


def draft_probs_to_target(q: jax.Array, d2t: jax.Array | None, vocab_size: int) -> jax.Array:
    """A distribution [..., Vd] over draft ids as one over the target's vocabulary [..., V] (0 off d2t): the q
    that rejection sampling needs, so verification stays lossless whatever the draft vocabulary."""
    if d2t is None:
        return q
    return jnp.zeros(q.shape[:-1] + (vocab_size,), q.dtype).at[..., d2t].set(q)
