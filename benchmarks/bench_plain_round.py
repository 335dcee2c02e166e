"""What a skipped draft costs: the speculative loop's plain round against AR's decode step, per drafter, in ONE run.

    python -m benchmarks.bench_plain_round CONFIG.yaml [CONFIG.yaml ...] [section.key=value ...] [--repeats R]

Each config (the YAML of `specdec run`, configs/benchmarks/) is one drafter with the adaptive width
(`scheduler.kind: adaptive`: the scheduler that skips drafts). The adaptive width can only promise "never slower
than AR" if a round whose draft it skips costs what AR's step costs; this benchmark measures, on random prompts of
`--prompt-len` tokens at the config's batch size and cache capacity, with AR timed right before each drafter's
rows:

  * AR step: seconds per token of AR's compiled decode loop (`specdec.generate`), the reference;
  * plain round: one round of the speculative loop with the draft skipped and no drafter code (`engine.plain_round`,
    the target's taps at its root recorded for the drafter's catch-up), over CATCH_UP rounds in one compiled call;
  * catch-up: the drafter's one update for CATCH_UP pending plain rounds (`engine.catch_up`), the extra work of the
    first drafted round after a run of skips (in AR steps), timed as the loop runs it: in place, only the
    drafter's state written (`drafter_catch_up`);
  * width-0 iteration: a loop iteration with the width forced to 0, as the adaptive width profiles it (its C(0):
    plain rounds with a catch-up every CATCH_UP of them, and the loop around them);
  * drafted round: a loop iteration with the widest verify width forced, as profiled (C(W_max)), for scale.

Every ratio is against the AR step measured in the same pass; the median of `--repeats` passes (interleaved: AR,
then each measurement, per drafter) is reported. Compilation is excluded (each program runs once first).

    python -m benchmarks.bench_plain_round configs/benchmarks/ngram.yaml configs/benchmarks/suffix.yaml \\
        configs/benchmarks/self_spec.yaml configs/benchmarks/dspark_shipped.yaml configs/benchmarks/hybrid.yaml
    python -m benchmarks.bench_plain_round configs/benchmarks/ngram.yaml --repeats 1 --prompt-len 16 \\
        generation.max_new_tokens=8          # a smoke test
Writes runs/benchmarks/bench_plain_round/results.{json,md} (`--out`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import numpy as np

from benchmarks.common import Report, add_output_arg, build_methods, method_configs_of
from specdec.costs import forced
from specdec.drafter import CATCH_UP
from specdec.engine import LoopProbe, LoopSpec, catch_up, host_plain_rounds, loop_setup, start
from specdec.generate import _generate, ar_metrics

HEADER = ["drafter", "B", "AR step ms", "plain round ms", "plain / AR", "catch-up (16 tokens) ms", "catch-up in AR steps",
          "width-0 iteration / AR", "widest round / AR", "verify widths"]


@dataclasses.dataclass
class Loop:
    """One drafter's loop with the adaptive width wrapped to be forced (`ForcedWidths`), on random prompts."""
    spec: LoopSpec
    probe: LoopProbe
    placeholder: tuple  # what the scheduler's init_state takes (forced decisions override it)

    def state(self, target, plan: int, limit: int):
        """A prefilled start state with the width forced to index `plan` for `limit` tokens."""
        p = self.probe
        sched = forced(self.spec.scheduler.init_state(p.batch, p.drafter.num_draft_tokens, p.drafter.evidence_classes,
                                                      self.placeholder), plan, plan)
        state = start(self.spec, target, p.drafter, target.init_cache(p.batch, p.capacity), p.random_prompts(),
                      p.lengths, p.capacity, limit, 0, sched_state=sched)
        return jax.block_until_ready(state)


def build_loop(target, method, cfg, prompt_len: int) -> Loop:
    """The loop `speculative_generate` would run for `method` (its spec from the same `loop_setup`), on random
    prompts."""
    scheduler = method.scheduler
    if not scheduler.measured_in_loop:
        raise ValueError(f"{method.name}: scheduler.kind is {cfg.scheduler.kind!r}; this benchmark measures the "
                         "adaptive width's plain rounds: set scheduler.kind: adaptive")
    drafter = method.drafter
    spec, tokens, lengths, _, capacity = loop_setup(
        target, drafter, [[1] * prompt_len] * cfg.generation.batch_size, method.policy,
        cfg.generation.max_new_tokens, cfg.sampling.to_params(), None, scheduler, cfg.verify.buckets)
    spec = dataclasses.replace(spec, eos_ids=())  # every round runs its course
    compiled = drafter.jittable if method.compiled is None else method.compiled
    probe = LoopProbe(spec, target, tokens, lengths, capacity, compiled)
    return Loop(spec, probe, (np.ones(len(spec.verify_widths)), 0.0))


def ar_step(target, loop: Loop, max_new_tokens: int) -> float:
    """Seconds per token of AR's compiled decode loop on the same random prompts (its own cache capacity for
    `max_new_tokens`), CATCH_UP + 1 tokens."""
    p = loop.probe
    out = _generate(target, p.random_prompts(), np.asarray(p.lengths), max_new_tokens, CATCH_UP + 1,
                    loop.spec.sampling, 0)
    m = ar_metrics(out)
    return m.decode_seconds / max(m.rounds / p.batch, 1)


def plain_and_catch_up(target, loop: Loop) -> tuple[float, float]:
    """(seconds per plain round over CATCH_UP of them in one compiled call, seconds of the drafter's catch-up on
    them)."""
    spec, drafter = loop.spec, loop.probe.drafter
    state = loop.state(target, 0, CATCH_UP + 1)
    t0 = time.perf_counter()
    state = jax.block_until_ready(host_plain_rounds(spec, target.params, state))
    plain = (time.perf_counter() - t0) / CATCH_UP
    if int(state.pending) != CATCH_UP:
        raise RuntimeError(f"expected {CATCH_UP} pending plain rounds, got {int(state.pending)}")
    t0 = time.perf_counter()
    if drafter.jittable:
        jax.block_until_ready(drafter_catch_up(spec, drafter.params, state.drafter_state,
                                               dataclasses.replace(state, drafter_state=None)))
    else:
        catch_up(spec, drafter.params, state)  # the drafter's Python update (the suffix index)
    return plain, time.perf_counter() - t0


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("drafter_state",))
def drafter_catch_up(spec: LoopSpec, dparams, drafter_state, state):
    """The drafter's catch-up (`engine.catch_up`) alone, as the compiled loop runs it: in place, the drafter's
    state donated and the only output. Returning the whole loop state from a program of its own made XLA copy
    the target's KV cache into the output (no buffer donated), which a drafter with no state at all (n-gram)
    then paid for: 87 ms at batch 16, more than an AR step. `state`: the loop state without the drafter's
    (`drafter_state=None`: a buffer cannot be both donated and passed again)."""
    return catch_up(spec, dparams, dataclasses.replace(state, drafter_state=drafter_state)).drafter_state


def measure(target, loop: Loop, max_new_tokens: int) -> dict:
    """One pass: AR's step, then the drafter's plain round, catch-up, width-0 and widest iterations."""
    ar = ar_step(target, loop, max_new_tokens)
    plain, caught = plain_and_catch_up(target, loop)
    widest = len(loop.spec.verify_widths) - 1
    zero = loop.probe.run_forced(0, 0, loop.placeholder)
    wide = loop.probe.run_forced(widest, widest, loop.placeholder)
    return {"ar": ar, "plain": plain, "catch_up": caught, "width0": zero, "widest": wide}


def run(method_configs, target, repeats: int, prompt_len: int, log=print) -> list[dict]:
    methods = build_methods(method_configs, target, log=log)
    rows = []
    for method in methods:
        cfg = method.cfg
        loop = build_loop(target, method, cfg, prompt_len)
        log(f"{method.name}: compiling ...")
        measure(target, loop, cfg.generation.max_new_tokens)  # compiles every program (untimed)
        passes = []
        for i in range(repeats):
            passes.append(measure(target, loop, cfg.generation.max_new_tokens))
            log(f"{method.name}: pass {i + 1}/{repeats}: " + ", ".join(f"{k} {v * 1e3:.2f} ms"
                                                                      for k, v in passes[-1].items()))
        ratio = {k: float(np.median([p[k] / p["ar"] for p in passes])) for k in passes[0]}
        rows.append({"method": method.name, "drafter": method.label, "batch": cfg.generation.batch_size,
                     "verify_widths": list(loop.spec.verify_widths),
                     "seconds": {k: float(np.median([p[k] for p in passes])) for k in passes[0]},
                     "ratio_to_ar": ratio, "passes": passes})
    return rows


def table_row(r: dict) -> list:
    s, q = r["seconds"], r["ratio_to_ar"]
    return [r["method"], r["batch"], f"{s['ar'] * 1e3:.2f}", f"{s['plain'] * 1e3:.2f}", f"{q['plain']:.3f}",
            f"{s['catch_up'] * 1e3:.2f}", f"{q['catch_up']:.2f}", f"{q['width0']:.3f}", f"{q['widest']:.2f}",
            str(r["verify_widths"])]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("items", nargs="+", metavar="CONFIG.yaml | section.key=value",
                    help="experiment configs with scheduler.kind: adaptive (one drafter each) and overrides applied "
                         "to every one")
    ap.add_argument("--repeats", type=int, default=5, help="passes; each ratio is the median over them")
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens of the random prompts")
    add_output_arg(ap, __file__)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.prompt_len < 1:
        ap.error(f"--prompt-len must be >= 1, got {args.prompt_len}")
    method_configs = method_configs_of(ap, args.items)
    from experiments.build import build_target

    report = Report(__file__, argv, args.out)
    cfg = method_configs[0][1]
    target = build_target(cfg.model, cfg.mesh)
    rows = run(method_configs, target, args.repeats, args.prompt_len)
    report.finish()
    report.table("Plain round vs AR step", HEADER, [table_row(r) for r in rows],
                 note=f"random prompts of {args.prompt_len} tokens, cache for {cfg.generation.max_new_tokens} new "
                      f"tokens, median of {args.repeats} pass(es); ratios against AR's step in the same pass; "
                      f"catch-up: the drafter's update for {CATCH_UP} plain rounds; width-0 iteration and widest "
                      "round: the adaptive width's profiled C(0) and C(W_max)")
    report.write({"rows": rows})
    return rows


if __name__ == "__main__":
    main()
