"""The Scheduler protocol: how many of each round's draft nodes the target verifies.

The speculative loop (specdec/engine.py) calls every scheduler the same way. Once per call:

    widths = scheduler.verify_widths(num_draft_tokens, buckets)   # the verify widths the loop compiles
    measured = scheduler.prepare(probe)        # what it must measure on this machine first (round costs, SPS)
    state = scheduler.init_state(batch, num_nodes, classes, measured)   # its per-loop state (a pytree; () if none)

and every round:

    planned = scheduler.plan(spec, state)      # before drafting: an index into spec.verify_widths
    draft, sched = scheduler.refine(spec, state, draft, planned, drafted)   # after drafting: the nodes to verify
    ... the target verifies the draft, the policy accepts a path ...
    sched = scheduler.observe(spec, state, draft, depth, result, active)   # after verifying: learn from it

A scheduler whose `may_skip` is True may plan width 0 (`spec.verify_widths[planned] == 0`): the loop then skips the
draft, and either still calls `refine` (with `drafted` False and an empty draft) or, in a run of plain decode steps,
calls `sched = scheduler.skipped(spec, state)` instead, which must record what that `refine` would. `observe` follows
every round, plain ones included (with the empty draft).
After the loop, `scheduler.metrics(spec, sched)` gives the `DecodeMetrics` fields it reports.

`spec` is the loop's static `specdec.engine.LoopSpec` (drafter, policy, sampling, verify widths), `state` its
`LoopState` (committed tokens, rows done, tokens left per row; the scheduler's own state is `state.sched`).

The implementations:
- `FixedWidth` (here): verify every drafted token; the default.
- `ThresholdSchedule`, `PrefixSchedule` (specdec/scheduling.py): per-row verify lengths from the drafter's
  confidence (DFlash, DSpark).
- `AdaptiveWidth` (specdec/adaptive.py): the width that pays on this machine, or none.
Settings are frozen dataclasses (hashable: part of the compiled loop's identity), parsed straight from the
config's `scheduler:` section (`kind:` picks the class, the other keys are its fields); everything that changes
during a run lives in the state.

Lossless: a scheduler only marks draft nodes invalid (or skips the draft); it must decide whether to verify a
node without reading that node's sampled value (specdec/scheduling.py explains why; specdec/adaptive.py shows how).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol

import jax.numpy as jnp


def bucket_widths(num_draft_tokens: int, buckets) -> tuple[int, ...]:
    """The verify widths (draft nodes per target step) of `verify.buckets`: None, "none" or [] = always all N;
    "auto" = 1, 2, 4, ... tokens per row (root + 0, 1, 3, 7, ... nodes) below N, then N; or an explicit list of
    node counts in [0, N] (N is always added)."""
    n = num_draft_tokens
    if buckets is None or buckets == "none" or (not isinstance(buckets, str) and len(buckets) == 0):
        return ()
    if isinstance(buckets, str):
        if buckets != "auto":
            raise ValueError(f"verify.buckets must be 'none', 'auto' or a list of draft-node counts, got {buckets!r}")
        widths, tokens = set(), 1
        while tokens - 1 < n:
            widths.add(tokens - 1)
            tokens *= 2
    else:
        widths = {int(w) for w in buckets}
        bad = [w for w in widths if not 0 <= w <= n]
        if bad:
            raise ValueError(f"verify.buckets: widths must be draft-node counts in [0, {n}] (num_draft_tokens), "
                             f"got {sorted(bad)}")
    return tuple(sorted(widths | {n}))


class Scheduler(Protocol):
    """What the loop asks of a scheduler. The method bodies are the do-nothing behaviour `FixedWidth` has."""

    kind: ClassVar[str]
    # The loop builds the skip branch (a plain decode step instead of draft + verify) only for these.
    may_skip: ClassVar[bool] = False
    # `refine` reads the drafter's `draft_confidence` (only drafters with `has_confidence`).
    needs_confidence: ClassVar[bool] = False
    # `prepare` times this very loop at forced widths (`engine.LoopProbe.run_forced`): the loop then runs the
    # scheduler wrapped in `specdec.costs.ForcedWidths`, so measurement and run share one compiled program.
    measured_in_loop: ClassVar[bool] = False

    def verify_widths(self, num_draft_tokens: int, buckets) -> tuple[int, ...]:
        """The draft-node counts the loop's verify step may run (`bucket_widths`; () = always all N)."""
        return bucket_widths(num_draft_tokens, buckets)

    def prepare(self, probe) -> Any:
        """Measure what this scheduler needs on this machine before the run (`specdec.engine.LoopProbe`)."""
        return None

    def init_state(self, batch: int, num_nodes: int, classes: int, measured) -> Any:
        """The state for `batch` rows, `num_nodes` draft nodes and the drafter's `classes` evidence classes, from
        what `prepare` measured: a pytree of arrays, each its own buffer (the compiled loop donates its state)."""
        return ()

    def plan(self, spec, state) -> Any:
        """Index into `spec.verify_widths` to draft for (the widest: every drafted token)."""
        return jnp.int32(max(len(spec.verify_widths) - 1, 0))

    def refine(self, spec, state, draft, planned, drafted):
        """(the draft with the nodes not to verify marked invalid, the scheduler's state)."""
        return draft, state.sched

    def observe(self, spec, state, draft, depth, result, active):
        """The scheduler's state after the target verified `draft` (`depth` [B, N + 1] of [root, nodes],
        `result` the policy's VerifyResult, `active` the rows that were active)."""
        return state.sched

    def skipped(self, spec, state):
        """The scheduler's state after a plain round (the draft skipped)."""
        return state.sched

    def metrics(self, spec, sched) -> dict:
        """`DecodeMetrics` fields this scheduler reports, from its final state."""
        return {}


@dataclasses.dataclass(frozen=True)
class FixedWidth(Scheduler):
    """Verify every drafted token (config `scheduler.kind: fixed`)."""

    kind: ClassVar[str] = "fixed"
