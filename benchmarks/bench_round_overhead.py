"""What the adaptive loop costs per round beyond the target's step, in ONE run (greedy, n-gram drafter).

Per batch size (MT-Bench first turns, chat-templated; --new-tokens each), median over --passes interleaved
passes, milliseconds per loop iteration:
  * `AR step`: `specdec.generate.generate` (decode seconds / its steps);
  * `plain round`: the adaptive loop with round costs under which drafting never pays (every round is a plain
    decode round, the draft skipped: `engine.plain_rounds`);
  * `drafted, width 0`: costs under which the draft is free but verifying never pays, so every round drafts
    and `refine` then verifies nothing (what prompt lookup's free draft costs in a round that does not pay).
Also the adaptive width's `plan` alone, inside a compiled loop of 1,000 plans (B=8, 6 draft positions, 5 evidence
classes), in microseconds; and, per batch size, the parts a drafted width-0 round adds to a plain one, each alone
in a compiled loop on the first prompts' committed context (microseconds per call): the n-gram draft (`propose`)
and the adaptive width's `refine` of it. What the two do not explain of `drafted, width 0` - `plain round` is
the verify path itself (the bucket switch at width 0, the policy over N + 1 padded positions, the tree mask).
Outputs equal AR's (checked). Each method's
ratio to the AR step is taken pass by pass (the median of the per-pass ratios, with its 90% interval from 5
passes on): the VM's speed drifts by 10-30% between passes, which the per-method medians alone do not cancel.

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

from benchmarks.common import DEFAULT_DATA, command_line, interval_text, load_prompts, median_interval, write_json
from drafters import create_drafter
from specdec import engine
from specdec.adaptive import AdaptiveWidth
from specdec.engine import speculative_generate
from specdec.drafter import RoundContext
from specdec.generate import cache_capacity, generate, pad_prompts
from specdec.models import registry
from specdec.models.loading import load_checkpoint
from specdec.sampling import GREEDY
from specdec.target import Target
from specdec.verify import get_policy

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


def _per_call_microseconds(step, carry, calls: int = 500) -> float:
    """`step(carry) -> carry` run `calls` times in one compiled loop (a second run, after compilation)."""
    loop = jax.jit(lambda c: jax.lax.fori_loop(0, calls, lambda i, c: step(c), c))
    jax.block_until_ready(loop(carry))
    t0 = time.perf_counter()
    jax.block_until_ready(loop(carry))
    return (time.perf_counter() - t0) / calls * 1e6


def draft_parts_microseconds(target, drafter, prompts, new_tokens: int) -> dict:
    """The n-gram draft alone (`engine.draft_seconds`, what the cost profile uses) and the adaptive `refine` of
    it alone in a compiled loop, on the prompts' own tokens in a sequence of the loop's capacity (the committed
    length moves by one token per call, wrapping, so nothing is hoisted out of the loop)."""
    batch, n = len(prompts), drafter.num_draft_tokens
    tokens, lengths = pad_prompts(prompts, target.cfg.pad_token_id or 0)
    capacity = cache_capacity(lengths.tolist(), new_tokens, extra=n + 1)
    spec = engine.LoopSpec(cfg=target.cfg, forward=target.forward, drafter=drafter,
                           policy=get_policy("greedy_chain"), sampling=GREEDY, eos_ids=tuple(target.eos_token_ids))
    propose_us = engine.draft_seconds(spec, target, drafter, tokens, lengths, capacity) * 1e6

    seq = np.zeros((batch, capacity), np.int32)
    for b, p in enumerate(prompts):
        seq[b, : len(p)] = p
    done = jnp.zeros((batch,), bool)
    ctx = RoundContext(seq=jnp.asarray(seq), seq_len=jnp.asarray(lengths), done=done)
    draft = drafter.propose(None, None, ctx, GREEDY, jax.random.PRNGKey(0))[0]
    widths = (0, 1, 3, n)
    sched = AdaptiveWidth(costs=((1.0, 1.2, 1.4, 1.6), 0.01))
    st = sched.init_state(batch, n, sched.costs, drafter.evidence_classes)
    remaining = jnp.full((batch,), new_tokens, jnp.int32)

    def refine_step(carry):
        i, st = carry
        cut, st = sched.refine(st, draft, i % len(widths), jnp.asarray(True), widths, ~done, True, False,
                               remaining=remaining - i % 8)
        return i + 1, dataclasses.replace(st, quiet_rounds=st.quiet_rounds + jnp.sum(cut.valid))

    return {"propose_us": propose_us, "refine_us": _per_call_microseconds(refine_step, (jnp.int32(0), st))}


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
        # each pass's ratio to the AR step of the same pass: the VM's drift between passes cancels in it
        ratios = {k: [m / a for m, a in zip(v, ms["AR step"])] for k, v in ms.items() if k != "AR step"}
        row = {"batch": batch, **{k: float(np.median(v)) for k, v in ms.items()}, "passes_ms": ms,
               "ratio_to_ar": {k: float(np.median(v)) for k, v in ratios.items()},
               "ratio_to_ar_interval": {k: median_interval(v) for k, v in ratios.items()},
               **draft_parts_microseconds(target, drafter, prompts, args.new_tokens)}
        summary["rows"].append(row)
        print(f"B={batch}: AR step {row['AR step']:.2f} ms, " + ", ".join(
            f"{k} {row[k]:.2f} ms ({row['ratio_to_ar'][k]:.3f}x by pass{interval_text(row['ratio_to_ar_interval'][k])})"
            for k in ratios), flush=True)
        rest = (row["drafted, width 0"] - row["plain round"]) * 1e3 - row["propose_us"] - row["refine_us"]
        print(f"B={batch}: drafted - plain = {(row['drafted, width 0'] - row['plain round']) * 1e3:.0f} us: n-gram "
              f"propose {row['propose_us']:.0f} us, refine {row['refine_us']:.0f} us, the rest (verify path at "
              f"width 0) {rest:.0f} us", flush=True)
    summary["load_avg_at_end"] = os.getloadavg()
    write_json(args.json, summary)
    return summary


if __name__ == "__main__":
    main()
