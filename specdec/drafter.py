"""The Drafter protocol: what the speculative engine asks of every drafter.

A drafter proposes a draft each round (a chain of k tokens, or a token tree), with the per-token draft
distributions (or none: deterministic, q = one-hot), and updates its state from what the target accepted.

Life cycle inside `specdec.engine.speculative_generate`:

    state = drafter.init(params, prompt)                      # once, after the target's prefill
    loop:
        draft, state = drafter.propose(params, state, ctx, key)  # ctx: committed tokens so far
        ... the target verifies [root, draft] in one step, the policy accepts a prefix/path ...
        state = drafter.update(params, state, ctx_after, result, taps)

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


class Drafter:
    """Base class with the protocol's defaults. Subclasses override what they need."""

    name: str = "drafter"
    kind: str = "chain"  # "chain" or "tree"
    jittable: bool = True
    num_draft_tokens: int = 1  # N: draft nodes per round (chain length k, or the tree's node budget)
    taps: tuple[int, ...] = ()  # target layers whose hidden states the drafter reads (0 = embeddings)
    params: Any = None  # the array pytree the engine passes back into propose/update (None: no weights)
    has_confidence: bool = False  # True: draft_confidence() feeds the verify-length schedulers (specdec/scheduling.py)
    # True: a round may skip `propose` (the adaptive verify width's width 0) and still call `update`, i.e. the
    # state needs no proposal to stay right. False for drafters whose propose catches up on the committed tokens
    # (draft LMs, EAGLE-3): they draft every round, and a width-0 round verifies none of it.
    skippable: bool = True
    # True (host-side drafters, jittable False): `update` reads only the committed context `ctx` (it catches up
    # on every token committed since its last call), so under the adaptive width the engine may commit a run of
    # width-0 rounds in one compiled call and then call `update` once, with result=None and taps=None.
    syncs_from_context: bool = False

    def init(self, params, prompt: PromptInfo, capacity: int) -> Any:
        """Initial drafter state (a pytree) for a batch of prompts. `capacity` bounds sequence length."""
        return ()

    def propose(self, params, state, ctx: RoundContext, sampling: SamplingParams, key: jax.Array):
        """Return (Draft, new_state). Draft probabilities, when given, must come from the same
        `specdec.sampling.probabilities` transform the target will be verified with."""
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

    def update(self, params, state, ctx: RoundContext, result, taps) -> Any:
        """Fold the round's outcome into the state. `ctx` is the sequence after committing; `result` the
        policy's VerifyResult; `taps` [n_taps, B, N+1, H] target hidden states at [root, nodes] (or None)."""
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
