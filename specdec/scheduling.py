"""Verification-length scheduling: per round, how many of each row's draft tokens the target verifies.

A scheduler reads the drafter's per-position prefix-survival estimates a[b, j] (non-increasing in j; e.g. DSpark's
calibrated confidence product prod_{i<=j} c_i, see `Drafter.draft_confidence`) and shortens each row's draft by
marking the nodes past its chosen length invalid (`Draft.valid`), so rows of one batch verify different lengths
in ONE target call. Kinds (config `scheduler.kind`):

- fixed      verify every drafted token (`specdec.scheduler.FixedWidth`).
- threshold  verify position j while a[b, j] >= threshold.
- prefix     the hardware-aware prefix scheduler (DSpark). With SPS(n) = target verify steps per second at a
             token batch of n (profiled once on this backend, cached), pool the candidates (b, j) of the R active
             rows sorted by a (descending; ties by position, so a row's positions come in order), start from
             length 0 everywhere (Theta = R * SPS(R)), admit candidates one at a time while
             Theta = (sum_b 1 + sum_{j < l_b} a[b, j]) * SPS(sum_b (1 + l_b)) improves, and STOP at the first
             candidate that does not improve it.

Why the stop keeps rejection sampling lossless: a[b, j] may depend on the sampled token x_{j-1} (DSpark's
confidence reads it), so a rule that looks at later candidates before deciding about x_j (e.g. "pick the length
with the best Theta overall") decides whether to verify x_j from x_j itself. Appendix A of the DSpark paper:
target (0.7, 0.3), draft (0.5, 0.5) gives outputs (0.85, 0.15). With the stop, whether (b, j) is admitted depends
only on candidates ranked before it, i.e. on a values >= a[b, j], which never involve x_{b, j} (its own effect,
through a[b, j+1] <= a[b, j], ranks after it). Threshold and fixed decide position j from a[b, j] alone: lossless.
The biased rule (best Theta over all admission counts) is what tests/test_scheduling.py builds from
`prefix_theta` to show the bias.

Two cost models for the token count n in SPS(n):
- ragged (no verify widths): n = sum_b (1 + l_b), a backend that verifies a ragged token batch (a paged-attention
  server). This engine's static-shape loop does not: without verify buckets it runs every row's N+1 slots, so the
  scheduler then changes what is verified (and the metrics), not the wall time.
- padded (the loop's verify widths, from `verify.buckets`): what this engine runs, n = B * (1 + W) with W
  the smallest verify width >= the longest admitted row (all B rows compute, finished ones too). Whether (b, j)
  is admitted still depends only on candidates ranked before it, so the early stop keeps it lossless.
See docs/PARALLEL_DRAFTING.md.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from specdec import costs
from specdec.errors import require
from specdec.scheduler import Scheduler


def cut_to_lengths(draft, length: jax.Array):
    """The chain draft with the nodes past each row's verify length (int32 [B]) marked invalid."""
    keep = jnp.arange(draft.num_nodes)[None, :] < length[:, None]
    return dataclasses.replace(draft, valid=draft.valid & keep)


def _confidence(spec, state) -> jax.Array:
    """The drafter's prefix-survival confidence [B, N], made non-increasing along j (a cumulative minimum; a
    no-op for a drafter that keeps the contract of `Drafter.draft_confidence`): the prefix scheduler admits a
    row's positions in confidence order and counts them as a prefix, which is only the same thing for a
    non-increasing a. The other half of the contract, a[:, j] not reading x_j, cannot be checked here (see
    tests/test_scheduling.py for what breaking it does)."""
    return jax.lax.cummin(spec.drafter.draft_confidence(state.drafter_state), axis=1)


@dataclasses.dataclass(frozen=True)
class ThresholdSchedule(Scheduler):
    """Verify position j while the prefix-survival confidence a[b, j] >= `threshold` (`scheduler.kind:
    threshold`). Decides position j from a[b, j] alone: lossless."""

    kind: ClassVar[str] = "threshold"
    needs_confidence: ClassVar[bool] = True
    threshold: float = 0.5

    def __post_init__(self):
        require(0.0 <= self.threshold <= 1.0, "threshold", f"must be in [0, 1], got {self.threshold!r}")

    def lengths(self, confidence: jax.Array, active: jax.Array) -> jax.Array:
        """Verify length per row, int32 [B], from prefix survival confidence [B, N]."""
        return jnp.sum(jnp.cumprod(confidence >= self.threshold, axis=1), axis=1).astype(jnp.int32)

    def refine(self, spec, state, draft, planned, drafted):
        return cut_to_lengths(draft, self.lengths(_confidence(spec, state), ~state.done)), state.sched


@dataclasses.dataclass(frozen=True)
class PrefixSchedule(Scheduler):
    """DSpark's hardware-aware prefix scheduler (the module docstring; `scheduler.kind: prefix`)."""

    kind: ClassVar[str] = "prefix"
    needs_confidence: ClassVar[bool] = True
    # The SPS profile as points (token batch size, steps per second), sizes increasing; between points SPS is
    # interpolated linearly, past the last one the step time grows linearly with the token count. Empty: profiled
    # once on this backend for token batches up to batch x (draft length + 1), cached in `profile_path`.
    profile: tuple[tuple[float, ...], ...] = ()
    profile_path: str | None = None  # JSON cache of measured profiles (default: the specdec cache dir)

    def __post_init__(self):
        object.__setattr__(self, "profile", tuple((int(n), float(v)) for n, v in self.profile))
        sizes = [n for n, _ in self.profile]
        require(not sizes or (sizes == sorted(set(sizes)) and sizes[0] >= 1 and all(v > 0 for _, v in self.profile)),
                "profile", f"must be (token batch size >= 1, steps/s > 0) points with increasing sizes, "
                f"got {self.profile!r}")

    def prepare(self, probe):
        """The SPS profile: given, or measured for this loop's largest token batch (cached)."""
        if self.profile:
            return self.profile
        max_tokens = probe.batch * (probe.drafter.num_draft_tokens + 1)
        return costs.load_or_measure_profile(probe.target, max_tokens, self.profile_path)

    def init_state(self, batch: int, num_nodes: int, classes: int, measured):
        return jnp.asarray(measured, jnp.float32)  # [P, 2] (token batch size, steps/s): traced, not compiled in

    def lengths(self, confidence: jax.Array, active: jax.Array, verify_widths: tuple[int, ...] = (),
                profile=None) -> jax.Array:
        """Verify length per row, int32 [B]. `profile` [P, 2] (default: this scheduler's own)."""
        profile = jnp.asarray(self.profile if profile is None else profile, jnp.float32)
        theta, order = prefix_theta(confidence, active, lambda n: sps(profile, n), verify_widths)
        count = jnp.sum(jnp.cumprod((theta[1:] > theta[:-1]).astype(jnp.int32)))  # stop at the first non-gain
        return admitted_lengths(order, count, confidence.shape)

    def refine(self, spec, state, draft, planned, drafted):
        length = self.lengths(_confidence(spec, state), ~state.done, spec.verify_widths, state.sched)
        return cut_to_lengths(draft, length), state.sched


def sps(profile: jax.Array, tokens: jax.Array) -> jax.Array:
    """Profiled verify steps per second at token batch size `tokens` (any shape), from profile [P, 2]."""
    n, s = profile[:, 0], profile[:, 1]
    x = tokens.astype(jnp.float32)
    inside = jnp.interp(x, n, s)
    beyond = s[-1] * n[-1] / jnp.maximum(x, 1.0)  # time per step grows linearly past the last point
    return jnp.where(x > n[-1], beyond, inside)


def prefix_theta(confidence: jax.Array, active: jax.Array, sps_of, verify_widths: tuple[int, ...] = ()):
    """The prefix scheduler's objective along its admission order (module docstring), vectorised: (Theta after
    admitting the first m candidates, m = 0 .. B * N [B * N + 1] (-inf where the m-th candidate is a done row's),
    the candidates' order: flat indices b * N + j [B * N]). With `verify_widths` the token count is the padded
    one this engine runs, else the ragged sum of lengths."""
    b, n = confidence.shape
    a = jnp.where(active[:, None], confidence.astype(jnp.float32), -1.0).reshape(-1)  # done rows never admitted
    order = jnp.argsort(-a, stable=True)  # flat index b * n + j: ties keep a row's positions in order
    a_sorted = a[order]
    rows = jnp.sum(active).astype(jnp.float32)
    m = jnp.arange(b * n + 1, dtype=jnp.float32)  # candidates admitted
    value = rows + jnp.concatenate([jnp.zeros(1), jnp.cumsum(jnp.maximum(a_sorted, 0.0))])
    if verify_widths:  # padded: B rows x (1 + the bucket of the longest admitted row)
        admitted_len = (order % n + 1).astype(jnp.int32)  # a row's positions are admitted in order
        longest = jnp.concatenate([jnp.zeros(1, jnp.int32), jax.lax.cummax(admitted_len)])
        widths = jnp.asarray(verify_widths, jnp.int32)
        width = widths[jnp.minimum(jnp.searchsorted(widths, longest), len(verify_widths) - 1)]
        tokens = b * (1 + width)
    else:  # ragged: one token per active row + the admitted candidates
        tokens = rows + m
    theta = value * sps_of(tokens)
    eligible = jnp.concatenate([jnp.ones(1, bool), a_sorted >= 0])  # never admit a done row's candidate
    return jnp.where(eligible, theta, -jnp.inf), order


def admitted_lengths(order: jax.Array, count: jax.Array, shape) -> jax.Array:
    """int32 [B]: each row's verify length when the first `count` candidates of `order` are admitted."""
    b, n = shape
    admitted = jnp.zeros((b * n,), bool).at[order].set(jnp.arange(b * n) < count)
    return jnp.sum(admitted.reshape(b, n), axis=1).astype(jnp.int32)
