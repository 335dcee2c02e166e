"""Verification-length scheduling: per round, how many of each row's draft tokens the target verifies.

A scheduler reads the drafter's per-position prefix-survival estimates a[b, j] (non-increasing in j; e.g. DSpark's
calibrated confidence product prod_{i<=j} c_i, see `Drafter.draft_confidence`) and shortens each row's draft by
marking the nodes past its chosen length invalid (`Draft.valid`), so rows of one batch verify different lengths
in ONE target call. Kinds (config `scheduler.kind`):

- fixed      verify every drafted token (no-op).
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
`early_stop=False` is the biased ablation (best Theta over all admission counts), kept for the test that shows it.

Two cost models for the token count n in SPS(n):
- ragged (no `verify_widths`): n = sum_b (1 + l_b), a backend that verifies a ragged token batch (a paged-attention
  server). This engine's static-shape loop does not: without verify buckets it runs every row's N+1 slots, so the
  scheduler then changes what is verified (and the metrics), not the wall time.
- padded (`verify_widths`, set by the engine from `verify.buckets`): what this engine runs, n = B * (1 + W) with W
  the smallest verify width >= the longest admitted row (all B rows compute, finished ones too). Whether (b, j)
  is admitted still depends only on candidates ranked before it, so the early stop keeps it lossless.
See docs/PARALLEL_DRAFTING.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("fixed", "threshold", "prefix")


@dataclasses.dataclass(frozen=True)
class Scheduler:
    """Static (hashable) settings; `apply` is pure JAX and runs inside the compiled loop."""

    kind: str = "fixed"
    threshold: float = 0.5
    # prefix: the SPS profile as points (token batch size, steps per second), sizes increasing. Between points SPS
    # is interpolated linearly; past the last one the step time grows linearly with the token count.
    profile: tuple[tuple[int, float], ...] = ()
    early_stop: bool = True
    # prefix: the engine's verify widths (draft-node counts, ascending, ending at N) -> the padded cost model;
    # () -> the ragged one. speculative_generate fills this in from its verify_buckets.
    verify_widths: tuple[int, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"scheduler kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "threshold" and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"scheduler threshold must be in [0, 1], got {self.threshold!r}")
        if self.kind == "prefix":
            sizes = [n for n, _ in self.profile]
            if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1 or any(s <= 0 for _, s in self.profile):
                raise ValueError("the prefix scheduler needs a profile of (token batch size >= 1, steps/s > 0) "
                                 f"points with increasing sizes, got {self.profile!r}")

    @property
    def needs_confidence(self) -> bool:
        return self.kind != "fixed"

    def sps(self, tokens: jax.Array) -> jax.Array:
        """Profiled verify steps per second at token batch size `tokens` (any shape)."""
        n = jnp.asarray([p[0] for p in self.profile], jnp.float32)
        s = jnp.asarray([p[1] for p in self.profile], jnp.float32)
        x = tokens.astype(jnp.float32)
        inside = jnp.interp(x, n, s)
        beyond = s[-1] * n[-1] / jnp.maximum(x, 1.0)  # time per step grows linearly past the last point
        return jnp.where(x > n[-1], beyond, inside)

    def lengths(self, confidence: jax.Array, active: jax.Array) -> jax.Array:
        """Verify length per row, int32 [B], from prefix survival confidence [B, N] and active rows [B]."""
        b, n = confidence.shape
        if self.kind == "fixed":
            return jnp.full((b,), n, jnp.int32)
        if self.kind == "threshold":
            return jnp.sum(jnp.cumprod(confidence >= self.threshold, axis=1), axis=1).astype(jnp.int32)
        return prefix_lengths(confidence, active, self.sps, self.early_stop, self.verify_widths)

    def apply(self, draft, confidence: jax.Array, active: jax.Array):
        """The draft with nodes past each row's verify length marked invalid (chain drafts).

        The confidence is made non-increasing along j first (a cumulative minimum; a no-op for a drafter that
        keeps the contract of `Drafter.draft_confidence`): the prefix scheduler admits a row's positions in
        confidence order and counts them as a prefix, which is only the same thing for a non-increasing a.
        The other half of the contract, a[:, j] not reading x_j, cannot be checked here (see
        tests/test_scheduling.py for what breaking it does)."""
        if self.kind == "fixed":
            return draft
        length = self.lengths(jax.lax.cummin(confidence, axis=1), active)
        keep = jnp.arange(draft.num_nodes)[None, :] < length[:, None]
        return dataclasses.replace(draft, valid=draft.valid & keep)


def prefix_lengths(confidence: jax.Array, active: jax.Array, sps, early_stop: bool = True,
                   verify_widths: tuple[int, ...] = ()) -> jax.Array:
    """The greedy admission of the prefix scheduler (module docstring), vectorised: int32 [B]. With
    `verify_widths` the token count is the padded one this engine runs, else the ragged sum of lengths."""
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
    theta = value * sps(tokens)
    eligible = jnp.concatenate([jnp.ones(1, bool), a_sorted >= 0])  # never admit a done row's candidate
    theta = jnp.where(eligible, theta, -jnp.inf)
    if early_stop:
        better = theta[1:] > theta[:-1]
        count = jnp.sum(jnp.cumprod(better.astype(jnp.int32)))
    else:  # biased ablation: the admission count with the best Theta, looking past non-improvements
        count = jnp.argmax(theta)
    admitted = jnp.zeros((b * n,), bool).at[order].set(jnp.arange(b * n) < count)
    return jnp.sum(admitted.reshape(b, n), axis=1).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------------------
# Profiling SPS(n) on the current backend (cached)
# ---------------------------------------------------------------------------------------------------------

def profile_sizes(max_tokens: int) -> list[int]:
    sizes = {1, max_tokens}
    n = 2
    while n < max_tokens:
        sizes.add(n)
        n *= 2
    return sorted(sizes)


def measure_sps(target, sizes: Sequence[int], context: int = 128, repeats: int = 5) -> list[tuple[int, float]]:
    """Verify steps per second of `target` at each token batch size: one forward of n new tokens (one row,
    chain mask) after `context` cached positions, the fastest of `repeats` timed runs after a compile run.
    A bigger batch never takes less time than a smaller one: timing noise is removed by making the step time
    non-decreasing in n (SPS non-increasing)."""
    out = []
    for n in sizes:
        cache = target.init_cache(1, context + n)
        cache = cache.with_lengths(jnp.full((1,), context, jnp.int32))
        tokens = jnp.zeros((1, n), jnp.int32)
        step = jax.jit(lambda p, c, t: target.forward(p, target.cfg, c, t).logits)
        jax.block_until_ready(step(target.params, cache, tokens))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(step(target.params, cache, tokens))
            times.append(time.perf_counter() - t0)
        out.append(float(np.min(times)))
    step_time = np.maximum.accumulate(np.asarray(out))
    return [(int(n), 1.0 / float(t)) for n, t in zip(sizes, step_time)]


def _profile_key(target, max_tokens: int) -> str:
    dev = jax.devices()[0]
    backend = getattr(getattr(target, "backend", None), "name", "?")
    return f"{target.cfg.name}|{backend}|{dev.platform}:{dev.device_kind}|{max_tokens}"


def cache_root() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specdec"))


def default_profile_path() -> Path:
    return cache_root() / "sps_profiles.json"


def cached_measurement(file: Path, key: str, measure, option: str, remeasure: bool = False):
    """`measure()`'s result stored under `key` in the JSON table `file` (measured when absent or `remeasure`,
    written atomically); `option` names the config key of the path in the error for a corrupt file."""
    table = {}
    if file.is_file():
        try:
            table = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{option}: {file} is not valid JSON ({e})") from None
    if remeasure or key not in table:
        table[key] = measure()
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(".partial")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, file)
    return table[key]


def load_or_measure_profile(target, max_tokens: int, path: str | os.PathLike | None = None,
                            log=print) -> tuple[tuple[int, float], ...]:
    """The SPS profile of `target` on this backend for token batches up to `max_tokens`, measured once and
    cached in a JSON file (keyed by model, backend, device and size range)."""
    file = Path(path) if path else default_profile_path()

    def measure():
        log(f"profiling target verify throughput SPS(n) for n <= {max_tokens} (cached in {file})")
        return measure_sps(target, profile_sizes(max_tokens))

    profile = cached_measurement(file, _profile_key(target, max_tokens), measure, "scheduler.profile_path")
    return tuple((int(n), float(s)) for n, s in profile)


def make_scheduler(cfg, target=None, max_tokens: int | None = None, log=print) -> Scheduler | None:
    """A Scheduler from a `specdec.config.SchedulerConfig` (None for `fixed`: the engine's default path;
    `adaptive`: a `specdec.adaptive.AdaptiveWidth`, whose round costs the engine measures for its own loop).
    `prefix` profiles `target` for token batches up to `max_tokens` (batch size x (draft length + 1))."""
    if cfg.kind == "fixed":
        return None
    if cfg.kind == "adaptive":
        from specdec.adaptive import AdaptiveWidth
        return AdaptiveWidth(decay=float(cfg.decay), prior=float(cfg.prior), prior_depth=float(cfg.prior_depth),
                             reprofile=bool(cfg.reprofile),
                             cost_path=cfg.cost_path, explore_every=int(cfg.explore_every),
                             explore_max=int(cfg.explore_max), explore_budget=float(cfg.explore_budget),
                             margin=float(cfg.margin),
                             calibration_weight=float(cfg.calibration_weight),
                             calibration_decay=float(cfg.calibration_decay),
                             calibration_per_position=bool(cfg.calibration_per_position),
                             calibration_min_batch=int(cfg.calibration_min_batch),
                             free_draft=float(cfg.free_draft), free_draft_max_batch=int(cfg.free_draft_max_batch),
                             objective=str(cfg.objective), slow_start=bool(cfg.slow_start),
                             tree_value=str(cfg.tree_value),
                             score_bins=None if cfg.score_bins is None else tuple(cfg.score_bins))
    if cfg.kind == "threshold":
        return Scheduler("threshold", threshold=float(cfg.threshold))
    if target is None or not max_tokens:
        raise ValueError("the prefix scheduler needs the target and the largest token batch to profile")
    return Scheduler("prefix", profile=load_or_measure_profile(target, int(max_tokens), cfg.profile_path, log))
