"""Attention formulations at small T, timed in one run: the slot-rows dots (K [S, HD] x Q [HD, G*T] per row and
KV head, what `transformer.attend` runs), the query-rows dots (Q [G*T, HD] x K^T [HD, S], the form it ran for
T >= 2 until it measured 2.4x slower at batch 64 with 528 cache slots) and a broadcast multiply-and-reduce (XLA
loop fusions), 30 layers chained, rows at half the capacity, SmolLM2's head shapes (9 query heads, 3 KV heads,
HD 64). Prints the best of 3 x 5 calls per shape and
the largest output difference from the query-rows form. Measure on a quiet machine (docs/BENCHMARKS.md).

    python -m benchmarks.bench_attention
Writes runs/benchmarks/bench_attention/results.{json,md} (`--out`).
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import Report, add_output_arg
from specdec.models import transformer as T


def attend_multiply_sum(q, k_cache, v_cache, mask):
    """The same attention as `attend`, as broadcast products and sums (loop fusions instead of small dots)."""
    b, t, nh, hd = q.shape
    kvh, s = k_cache.shape[1], k_cache.shape[2]
    g = nh // kvh
    qm = q.reshape(b, t, kvh, g, hd).transpose(0, 2, 3, 1, 4)  # [B,KVH,G,T,HD]
    scores = jnp.sum(qm[:, :, :, :, None, :].astype(jnp.float32) * k_cache[:, :, None, None, :, :], axis=-1)  # [B,KVH,G,T,S]
    scores = scores * (1.0 / math.sqrt(hd))
    scores = jnp.where(mask[:, None, None, :, :], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.sum(probs[..., None] * v_cache[:, :, None, None, :, :], axis=-2)  # [B,KVH,G,T,HD]
    out = out.transpose(0, 3, 1, 2, 4)
    return out.reshape(b, t, nh * hd).astype(q.dtype)


def attend_query_rows(q, k_cache, v_cache, mask):
    """The same attention with the G*T query rows as the products' rows: [G*T, HD] x [HD, S] against each key slab."""
    b, t, nh, hd = q.shape
    kvh, s = k_cache.shape[1], k_cache.shape[2]
    g = nh // kvh
    qm = T._query_rows(q, kvh)
    scores = jnp.einsum("bkqd,bksd->bkqs", qm, k_cache, preferred_element_type=jnp.float32)
    scores = scores.reshape(b, kvh, g, t, s) * (1.0 / math.sqrt(hd))
    scores = jnp.where(mask[:, None, None, :, :], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype).reshape(b, kvh, g * t, s)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, v_cache, preferred_element_type=jnp.float32)
    return T._from_query_rows(out, q)


LAYERS = 30


# (batch, cache slots, tokens per row); 528 = the speculative loop's cache for 288-token prompts (512 + its slack)
SHAPES = [(64, 384, 1), (8, 512, 1), (8, 512, 4), (1, 512, 1), (1, 512, 4), (64, 528, 2), (64, 528, 4),
          (32, 528, 2), (8, 528, 2)]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_arg(ap, __file__)
    args = ap.parse_args(argv)
    report = Report(__file__, argv, args.out)
    rows = []
    for b, s, t in SHAPES:
        nh, kvh, hd = 9, 3, 64
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((b, t, nh, hd)), jnp.float32)
        ks = [jnp.asarray(rng.standard_normal((b, kvh, s, hd)), jnp.float32) for _ in range(LAYERS)]
        vs = [jnp.asarray(rng.standard_normal((b, kvh, s, hd)), jnp.float32) for _ in range(LAYERS)]
        lengths = jnp.full((b,), s // 2, jnp.int32)
        mask = T.attention_mask(lengths, s, jnp.broadcast_to(T.causal_mask(t), (b, t, t)))

        def run(fn):
            def f(q, ks, vs, mask):
                acc = q
                for k, v in zip(ks, vs):
                    o = fn(acc, k, v, mask)
                    acc = acc + 1e-3 * o.reshape(acc.shape)
                return acc
            return jax.jit(f)
        fns = {"query-rows": run(attend_query_rows), "multiply-sum": run(attend_multiply_sum),
               "slot-rows": run(T._attend_one if t == 1 else T._attend_slot_rows)}
        outs = {n: f(q, ks, vs, mask) for n, f in fns.items()}
        err = max(float(jnp.max(jnp.abs(outs["query-rows"] - o))) for o in outs.values())
        res = {}
        for rep in range(3):
            for n, f in fns.items():
                t0 = time.perf_counter()
                for _ in range(5):
                    jax.block_until_ready(f(q, ks, vs, mask))
                res.setdefault(n, []).append((time.perf_counter() - t0) / 5 * 1e3)
        print(f"B={b} S={s} T={t}: " + ", ".join(f"{n} {min(v):.2f} ms" for n, v in res.items()), f"maxdiff {err:.1e}",
              flush=True)
        rows.append({"batch": b, "slots": s, "tokens": t, "best_ms": {n: min(v) for n, v in res.items()},
                     "max_diff": err})
    report.finish()
    forms = ["query-rows", "slot-rows", "multiply-sum"]
    report.table(f"Attention formulations, {LAYERS} layers chained", ["B", "S", "T", *(f"{n} ms" for n in forms),
                                                                      "max diff"],
                 [[r["batch"], r["slots"], r["tokens"], *(f"{r['best_ms'][n]:.2f}" if n in r["best_ms"] else "-"
                                                          for n in forms), f"{r['max_diff']:.1e}"] for r in rows],
                 note="best of 3 x 5 calls", echo=False)
    report.write({"rows": rows})
    return rows


if __name__ == "__main__":
    main()
