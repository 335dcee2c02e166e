"""Top-p cost: `sampling.top_p_threshold` against the textbook full sort of the vocabulary, timed in one run.

For batches of SmolLM2-sized logits (49,152 entries) of two kinds: peaky rows (normal x 8: the top 256 hold the
nucleus, the prefix path) and flatter rows (normal x 3: some row's top 256 hold less than top_p, the bisection
path), the median of 5 jitted calls of each, and how many tokens the two keep differently. Both are float32
sums of the same rule, so a token whose mass-before lies within float32 rounding (~1e-6) of top_p may fall on
either side in either of them (tests/test_sampling.py compares with a float64 reference).

    python -m benchmarks.bench_sampling [--batches 1 8 64] [--top-p 0.95]
Writes runs/benchmarks/bench_sampling/results.{json,md} (`--out`).
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp

from benchmarks.common import Report, add_output_arg, median_seconds
from specdec.sampling import top_p_threshold


def sorted_threshold(logits, top_p):
    """The textbook nucleus threshold: sort the whole vocabulary (what `processed_logits` did before)."""
    desc = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(desc, axis=-1)
    keep = jnp.cumsum(probs, axis=-1) - probs < top_p
    return jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--vocab", type=int, default=49152)
    add_output_arg(ap, __file__)
    args = ap.parse_args(argv)
    report = Report(__file__, argv, args.out)
    rows = []
    print(f"vocab {args.vocab}, top_p {args.top_p}, load {os.getloadavg()[0]:.2f}", flush=True)
    full = jax.jit(lambda x: sorted_threshold(x, args.top_p))
    fast = jax.jit(lambda x: top_p_threshold(x, args.top_p))
    for scale, kind in [(8.0, "peaky (prefix)"), (3.0, "flatter (bisection)")]:
        for b in args.batches:
            x = jax.random.normal(jax.random.PRNGKey(b), (b, args.vocab)) * scale
            differ = int(jnp.sum((x >= full(x)) != (x >= fast(x))))
            t_full, t_fast = median_seconds(lambda: full(x), 5), median_seconds(lambda: fast(x), 5)
            print(f"{kind:20s} B={b:3d}: full sort {t_full * 1e3:8.2f} ms, top_p_threshold {t_fast * 1e3:7.2f} ms "
                  f"(x{t_full / t_fast:.0f}), tokens kept differently {differ}, load {os.getloadavg()[0]:.2f}", flush=True)
            rows.append({"logits": kind, "batch": b, "full_sort_ms": t_full * 1e3, "top_p_threshold_ms": t_fast * 1e3,
                         "kept_differently": differ})
    report.finish()
    report.table("Top-p threshold cost", ["logits", "B", "full sort ms", "top_p_threshold ms", "x faster",
                                          "tokens kept differently"],
                 [[r["logits"], r["batch"], f"{r['full_sort_ms']:.2f}", f"{r['top_p_threshold_ms']:.2f}",
                   f"{r['full_sort_ms'] / r['top_p_threshold_ms']:.0f}", r["kept_differently"]] for r in rows],
                 note=f"vocabulary {args.vocab}, top_p {args.top_p}, median of 5 jitted calls", echo=False)
    report.write({"rows": rows})
    return rows


if __name__ == "__main__":
    main()
