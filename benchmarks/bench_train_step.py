"""Seconds per training step of a drafter task, and the share of it spent on the target's online features.

Builds the task of a training config (its drafter and `train.drafter_options`) on the real target, then times
on random tokens (the cost does not depend on their values) the jitted feature pass alone and the whole
`train_step` (features + loss + gradients + optimizer update), median of 3 calls after a warm-up, for each
padded length. Tokens/s is batch x length / step seconds: the quiet-machine speed to size a run by (the loop's
own `tokens_per_second` counts wall time from the loop's start, pauses included).

    python -m benchmarks.bench_train_step configs/train/dspark_mix.yaml [--lengths 192 256] [section.key=value ...]
Writes runs/benchmarks/bench_train_step/results.{json,md} (`--out`).
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

import drafters
from benchmarks.common import Report, add_output_arg, median_seconds
from experiments.build import build_target
from specdec.config import load_config
from specdec.train.loop import Hyper, StepSpec, TrainState, _features, train_step
from specdec.train.tasks import make_task


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--lengths", type=int, nargs="+", default=[192, 256])
    add_output_arg(ap, __file__)
    args = ap.parse_args(argv)
    report = Report(__file__, argv, args.out)
    cfg = load_config(args.config, args.overrides)
    target = build_target(cfg.model, cfg.mesh)
    drafters.available()  # drafter modules register their training tasks on import
    task = make_task(cfg.drafter.name, target, cfg.train.drafter_options)
    hyper = Hyper.from_config(cfg.train)
    spec = StepSpec(task=task, hyper=hyper, cfg=target.cfg, forward=target.forward, stored=None,
                    eval_steps=cfg.drafter.num_draft_tokens)
    params, buffers = task.init(jax.random.PRNGKey(0), np.ones(target.cfg.vocab_size))
    state = TrainState.create(params, buffers, hyper, seed=0)
    consts = {**task.frozen(target), **jax.tree.map(jnp.array, state.buffers)}
    batch_size = cfg.train.batch_size
    features = jax.jit(_features, static_argnums=(0, 3))
    print(f"{task.name}, batch {batch_size}, features {cfg.train.features} (timed online), "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for length in args.lengths:
        rng = np.random.default_rng(0)
        prompt = min(40, length // 4)  # a prompt without loss, the rest response
        batch = {"tokens": jnp.asarray(rng.integers(0, target.cfg.vocab_size, (batch_size, length)), jnp.int32),
                 "loss_mask": jnp.asarray(np.repeat((np.arange(length) >= prompt)[None], batch_size, 0), jnp.float32),
                 "lengths": jnp.full((batch_size,), length, jnp.int32)}
        feat_s = median_seconds(lambda: features(spec, target.params, batch, task.needs_target_logits))
        box = [state]

        def step():
            box[0], metrics = train_step(spec, box[0], consts, target.params, batch)
            return metrics
        step_s = median_seconds(step)
        print(f"length {length}: step {step_s:.2f} s ({batch_size * length / step_s:.0f} tokens/s), target features "
              f"{feat_s:.2f} s ({feat_s / step_s:.0%} of the step), load {os.getloadavg()[0]:.2f}", flush=True)
        rows.append({"length": length, "batch": batch_size, "step_seconds": step_s, "feature_seconds": feat_s,
                     "tokens_per_second": batch_size * length / step_s})
    report.finish()
    report.table(f"Training step: {task.name} ({args.config})",
                 ["padded length", "batch", "step s", "tokens/s", "target features s", "features share"],
                 [[r["length"], r["batch"], f"{r['step_seconds']:.2f}", f"{r['tokens_per_second']:.0f}",
                   f"{r['feature_seconds']:.2f}", f"{r['feature_seconds'] / r['step_seconds']:.0%}"] for r in rows],
                 note="median of 3 calls after a warm-up, random tokens, online target features")
    report.write({"task": task.name, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
