"""What the schedulers measure on this machine, and the cache that keeps it (one module for both).

- Round costs (the adaptive width, specdec/adaptive.py): seconds per loop iteration at each verify width and what
  a draft adds, measured by running the real compiled loop with the width forced (`ForcedWidths`, driven by
  `specdec.engine.LoopProbe`), cached per machine / model / backend / drafter / batch / capacity / code version.
- SPS profiles (the prefix scheduler, specdec/scheduling.py): target verify steps per second at each token batch
  size, cached per model / backend / device / size range.

Both caches are JSON tables in the specdec cache dir ($SPECDEC_CACHE, default ~/.cache/specdec), written
atomically; a corrupt file is an error that names the config key of its path.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import ClassVar
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specdec.drafter import Drafter
from specdec.scheduler import Scheduler

COST_FILE = "round_costs.json"
PROFILE_ROUNDS = 16  # loop iterations per forced width when measuring round costs (width 0: always; CATCH_UP)
# A drafted width whose rounds are slow is timed over fewer of them, down to MIN_PROFILE_ROUNDS, so that each
# measurement spans about PROFILE_SECONDS: the machine's jitter is milliseconds per run, whatever the round costs.
# 16 self-speculation rounds (4 draft steps through 24 layers each) took ~2 s per width and pass, and 16 rounds
# per width at batch 32 (~0.5-1 s each on a 2-core CPU) made the profile minutes long before the first token.
PROFILE_SECONDS = 0.4
MIN_PROFILE_ROUNDS = 4


def profile_rounds(seconds_per_round: float, most: int = PROFILE_ROUNDS) -> int:
    """Loop iterations (or draft calls, `most` of them at most) that span about PROFILE_SECONDS at
    `seconds_per_round` each, between MIN_PROFILE_ROUNDS and `most`."""
    if seconds_per_round <= 0:
        return most
    return int(min(most, max(MIN_PROFILE_ROUNDS, np.ceil(PROFILE_SECONDS / seconds_per_round))))


def cache_root() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specdec"))


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



# ---------------------------------------------------------------------------------------------------------
# SPS profiles (the prefix scheduler)
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


def default_profile_path() -> Path:
    return cache_root() / "sps_profiles.json"


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



# ---------------------------------------------------------------------------------------------------------
# Round costs (the adaptive width)
# ---------------------------------------------------------------------------------------------------------

def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows: part of the round-cost key and
    of every recorded figure's machine (benchmarks, a recipe's model card)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _machine() -> str:
    cpu = cpu_model()
    dev = jax.devices()[0]
    return f"{dev.platform}:{dev.device_kind}|{cpu}|{os.cpu_count()}cpu"


@functools.lru_cache(maxsize=None)
def _code_version(*modules: str) -> str:
    """A digest of the source files that decide what a round costs (the step, the loop, the drafter): costs
    profiled by other code (an older specdec, a changed step layout) are measured again, not reused."""
    digest = hashlib.sha256()
    for name in modules:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:12]


def _drafter_modules(drafter) -> tuple[str, ...]:
    """The modules whose code decides what `drafter` costs a round: its class's and its base classes' (DSpark's
    forward is DFlash's), and those of the drafters it wraps (the hybrid's model and lookup)."""
    parts = [drafter] + [v for v in vars(drafter).values() if isinstance(v, Drafter)]
    names = {cls.__module__ for part in parts for cls in type(part).__mro__}
    return tuple(sorted(n for n in names if n != "builtins"))


def cost_key(target, drafter, policy: str, sampling, batch: int, capacity: int, widths) -> str:
    backend = getattr(getattr(target, "backend", None), "name", "?")
    draft = json.dumps(drafter.describe(), sort_keys=True, default=str)
    mode = "greedy" if sampling.greedy else "sampled"
    code = _code_version("specdec.models.transformer", "specdec.engine", "specdec.adaptive", __name__,
                         *_drafter_modules(drafter))
    return (f"{_machine()}|{target.cfg.name}|{backend}|{draft}|{policy}|{mode}|B={batch}|"
            f"S={capacity}|W={list(widths)}|code={code}")


def default_cost_path() -> Path:
    return cache_root() / COST_FILE


def measure_round_costs(run_forced, num_widths: int, repeats: int = 3, time_draft=None):
    """(round_cost [K], draft_cost): seconds per loop iteration with the width forced to each bucket (k = 0:
    the draft skipped), and what drafting adds to a round: `time_draft()` where the draft can be timed alone
    (pure-JAX drafters: `engine.LoopProbe.draft_seconds`), else measured as a round that drafts and verifies nothing minus
    a plain one. `run_forced(plan, refine)` runs the real compiled loop with the plan / refine decisions forced
    to those bucket indices and returns seconds per iteration.

    The passes are interleaved (every width once, `repeats` times over) and the median of each width counts:
    the cost model predicts a run's typical time, and on a shared machine the fastest of a few passes is the
    luckiest one (taking it made every prediction 10-15% optimistic), while a slow spell during one width's
    passes would skew that width against the others if they were not interleaved."""
    forced = [(k, k) for k in range(num_widths)]
    if time_draft is None:
        forced.append((num_widths - 1, 0))  # draft, verify nothing
    passes = [[run_forced(plan, refine) for plan, refine in forced] for _ in range(repeats)]
    median = [float(np.median(column)) for column in zip(*passes)]
    round_cost = median[:num_widths]
    if time_draft is not None:
        return round_cost, time_draft()
    return round_cost, max(median[num_widths] - round_cost[0], 0.0)


_REPROFILED: set[tuple[str, str]] = set()  # (cache file, key) measured again in this process (`reprofile`)


def load_or_measure_round_costs(key: str, measure, path=None, reprofile: bool = False):
    """(round_cost, draft_cost) for `key`, from the JSON cache or measured by `measure()` (then cached).
    `reprofile`: measured again the first time this process asks for `key`, then taken from the cache, so every
    run of a benchmark sitting uses the same fresh profile."""
    file = Path(path) if path else default_cost_path()
    again = reprofile and (str(file), key) not in _REPROFILED

    def timed():
        t0 = time.perf_counter()
        round_cost, draft_cost = measure()
        return {"round_cost": round_cost, "draft_cost": draft_cost, "measured_seconds": time.perf_counter() - t0}

    entry = cached_measurement(file, key, timed, "scheduler.cost_path", again)
    if again:
        _REPROFILED.add((str(file), key))
    return tuple(entry["round_cost"]), float(entry["draft_cost"])


def round_costs(probe, placeholder, cost_path=None, reprofile: bool = False, log=print):
    """(round_cost per verify width, draft_cost) of the loop `probe` describes (`specdec.engine.LoopProbe`),
    cached per machine, model, drafter, batch and capacity; measured on first use (or once per process with
    `reprofile`) by running that very loop with each width forced, on random prompts of the same shapes. A
    pure-JAX draft is timed alone (`probe.draft_seconds`): the difference of two noisy loop timings is larger
    than prompt lookup's whole draft, and once flipped its `free_draft` decision. `placeholder`: what the
    scheduler's `init_state` takes for the forced runs (their decisions are overridden). `log` says when a
    measurement starts and how long it took: at batch 32 on a 2-core CPU it takes minutes, before any output."""
    spec = probe.spec
    key = cost_key(probe.target, probe.drafter, spec.policy.name, spec.sampling, probe.batch, probe.capacity,
                   spec.verify_widths)
    alone = probe.draft_seconds if probe.drafter.jittable else None

    def measure():
        widths = len(spec.verify_widths)
        log(f"adaptive width: measuring the round costs of {probe.drafter.name} at batch {probe.batch} on this "
            f"machine (verify widths {list(spec.verify_widths)}, 3 passes of {MIN_PROFILE_ROUNDS}-{PROFILE_ROUNDS} "
            f"rounds each; cached in {Path(cost_path) if cost_path else default_cost_path()}) ...")
        t0 = time.perf_counter()
        out = measure_round_costs(lambda plan, refine: probe.run_forced(plan, refine, placeholder), widths,
                                  time_draft=alone)
        log(f"adaptive width: round costs measured in {time.perf_counter() - t0:.0f} s: "
            + ", ".join(f"W={w}: {c * 1e3:.1f} ms" for w, c in zip(spec.verify_widths, out[0])))
        return out

    return load_or_measure_round_costs(key, measure, cost_path, reprofile)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForcedState:
    base: object  # the wrapped scheduler's state, updated as in any run
    plan: jax.Array  # int32 [] the verify width to draft for (index into the loop's verify widths); -1: base's own
    refine: jax.Array  # int32 [] the verify width to run; -1: base's own


@dataclasses.dataclass(frozen=True)
class ForcedWidths(Scheduler):
    """A scheduler whose round costs are measured in the loop it runs in (`Scheduler.measured_in_loop`, the
    adaptive width), wrapped so that one compiled program serves the measurement and the run: with
    `state.plan` / `state.refine` >= 0 (traced: `forced`) the width is forced to those indices and every draft node
    up to it is verified, whatever the drafter proposed (random prompts give prompt lookup no matches); with -1
    (`init_state`) the wrapped scheduler decides, as if unwrapped. A second program for the measurement would
    cost a compile of the whole loop (~30 s on a 2-core CPU) and its memory, per drafter and shape."""

    base: Scheduler
    kind: ClassVar[str] = "forced"

    @property
    def may_skip(self) -> bool:
        return self.base.may_skip

    @property
    def needs_confidence(self) -> bool:
        return self.base.needs_confidence

    def verify_widths(self, num_draft_tokens: int, buckets) -> tuple[int, ...]:
        return self.base.verify_widths(num_draft_tokens, buckets)

    def prepare(self, probe):
        return self.base.prepare(probe)

    def init_state(self, batch: int, num_nodes: int, classes: int, measured) -> ForcedState:
        return ForcedState(base=self.base.init_state(batch, num_nodes, classes, measured),
                           plan=jnp.asarray(-1, jnp.int32), refine=jnp.asarray(-1, jnp.int32))

    def _inner(self, state):
        return dataclasses.replace(state, sched=state.sched.base)

    def plan(self, spec, state):
        forced = state.sched.plan
        return jnp.where(forced >= 0, forced, self.base.plan(spec, self._inner(state)))

    def refine(self, spec, state, draft, planned, drafted):
        chosen, base = self.base.refine(spec, self._inner(state), draft, planned, drafted)
        forced = state.sched.refine
        width = jnp.asarray(spec.verify_widths, jnp.int32)[jnp.maximum(forced, 0)]
        every_node = (jnp.arange(draft.num_nodes)[None, :] < width) & drafted
        keep = jnp.where(forced >= 0, every_node, chosen.valid)
        return dataclasses.replace(chosen, valid=keep), dataclasses.replace(state.sched, base=base)

    def observe(self, spec, state, draft, depth, result, active):
        base = self.base.observe(spec, self._inner(state), draft, depth, result, active)
        return dataclasses.replace(state.sched, base=base)

    def skipped(self, spec, state):
        return dataclasses.replace(state.sched, base=self.base.skipped(spec, self._inner(state)))

    def metrics(self, spec, sched) -> dict:
        return self.base.metrics(spec, sched.base)


def forced(state: ForcedState, plan: int, refine: int) -> ForcedState:
    """`ForcedWidths`' state with the plan and refine decisions forced to those indices into the verify widths."""
    return dataclasses.replace(state, plan=jnp.asarray(plan, jnp.int32), refine=jnp.asarray(refine, jnp.int32))
