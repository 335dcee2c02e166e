"""What the adaptive loop costs per round beyond the target's step, in ONE run (greedy, n-gram drafter).

Per batch size (MT-Bench first turns, chat-templated; --new-tokens each), median over --passes interleaved
passes, milliseconds per loop iteration:
  * `AR step`: `specdec.generate.generate` (decode seconds / its steps);
  * `plain round`: the adaptive loop with round costs under which drafting never pays (every round is a plain
    decode round, the draft skipped: `engine.plain_rounds`);
  * `drafted, width 0`: costs under which the draft is free but verifying never pays, so every round drafts
    and `refine` then verifies nothing (what prompt lookup's free draft costs in a round that does not pay).
Also the adaptive width's `plan` alone, inside a compiled loop of 1,000 plans (B=8, 6 draft positions, 5 evidence
classes), in microseconds. Outputs equal AR's (checked).

    python -m benchmarks.bench_round_overhead [--batches 1 8] [--new-tokens 128] [--passes 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import DEFAULT_DATA, command_line, load_prompts, write_json
from drafters import create_drafter
from specdec.adaptive import AdaptiveWidth
from specdec.engine import speculative_generate
from specdec.generate import generate
from specdec.models import registry
from specdec.models.loading import load_checkpoint
from specdec.sampling import GREEDY
from specdec.target import Target

NEVER = 10 ** 6  # an exploration gap no run reaches: the given costs alone decide every round


def plan_microseconds(plans: int = 1000) -> float:
    """The plan inside a compiled loop whose rows' remaining tokens change every iteration (as in plain rounds)."""
    sched = AdaptiveWidth()
    widths = (0, 1, 2, 4, 6)
    st = sched.init_state(8, 6, ((0.066, 0.08, 0.09, 0.1, 0.12), 0.006), classes=5)

    @jax.jit
    def loop(st, remaining):
        def body(carry):
            i, st, total, remaining = carry
            k = sched.plan(st, widths, remaining > 0, tree=False, remaining=remaining)
            st = dataclasses.replace(st, quiet_rounds=st.quiet_rounds + 1)
            return i + 1, st, total + k, remaining - 1
        return jax.lax.while_loop(lambda c: c[0] < plans, body, (0, st, 0, remaining))[2]

    remaining = jnp.full((8,), 10 * plans, jnp.int32)
    loop(st, remaining).block_until_ready()
    t0 = time.perf_counter()
    loop(st, remaining).block_until_ready()
    return (time.perf_counter() - t0) / plans * 1e6


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=registry.DEFAULT_MODEL)
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)

    cfg, np_params, tokenizer = load_checkpoint(args.model)
    target = Target.from_params(cfg, np_params, tokenizer, backend="reference")
    drafter = create_drafter("ngram", target, 6, max_ngram=3)
    plain = AdaptiveWidth(costs=((1.0, 100.0, 100.0, 100.0), 100.0), explore_every=NEVER, explore_max=NEVER)
    drafted = AdaptiveWidth(costs=((1.0, 100.0, 100.0, 100.0), 0.0), explore_every=NEVER, explore_max=NEVER)
    summary = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": command_line(__file__, argv),
               "load_avg_at_start": os.getloadavg(), "rows": []}
    print(f"# {cfg.name}; jax {jax.__version__}, {os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.2f}", flush=True)

    summary["plan_us"] = plan_microseconds()
    print(f"plan in a compiled loop (B=8): {summary['plan_us']:.2f} us", flush=True)
    texts = load_prompts("mt_bench", max(args.batches), args.data)
    for batch in args.batches:
        prompts = [tokenizer.encode_chat(t) for t in texts[:batch]]
        ms = {"AR step": [], "plain round": [], "drafted, width 0": []}
        for _ in range(args.passes):
            ar = generate(target, prompts, max_new_tokens=args.new_tokens, sampling=GREEDY, warmup=True)
            ms["AR step"].append(ar.decode_seconds / (max(len(t) for t in ar.tokens) - 1) * 1e3)
            for label, sched in (("plain round", plain), ("drafted, width 0", drafted)):
                out = speculative_generate(target, drafter, prompts, max_new_tokens=args.new_tokens, sampling=GREEDY,
                                           warmup=True, scheduler=sched)
                assert out.tokens == ar.tokens, label
                ms[label].append(out.metrics.decode_seconds / sum(out.metrics.width_rounds) * 1e3)
        row = {"batch": batch, **{k: float(np.median(v)) for k, v in ms.items()}, "passes_ms": ms}
        summary["rows"].append(row)
        base = row["AR step"]
        print(f"B={batch}: " + ", ".join(f"{k} {row[k]:.2f} ms ({row[k] / base:.3f}x)" for k in ms), flush=True)
    summary["load_avg_at_end"] = os.getloadavg()
    write_json(args.json, summary)
    return summary


if __name__ == "__main__":
    main()
