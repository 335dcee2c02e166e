"""How XLA:CPU runs the target's skinny products, by formulation, in ONE run (what `transformer.dense_t` chose).

For each weight shape of a SmolLM2 layer (fused q|k|v 576->960, o 576->576, fused gate|up 576->3072,
down 1536->576) and its tied lm_head (576->49152), and for 1, 2, 4, 8, 16 and 64 rows (decode, verify widths,
batch 8 x verify, prefill), the median time of a chain of products over distinct weights (~100 MB, so nothing
stays in cache), as GB/s of weights streamed:
  * `x @ W`: the weight stored [in, out] (specdec's standard layout);
  * `x @ W^T`: stored [out, in], the product written with a [rows, out] result;
  * `W @ x^T`: stored [out, in], an [out, rows] result transposed afterwards, with XLA kept from folding the
    transpose into the product (`transformer.dense_t`'s form for at most `SKINNY_ROWS` rows);
  * `dense_t`: what the reference backend runs.

    python -m benchmarks.bench_products [--rows 1 2 4 8 16 64] [--megabytes 100] [--out DIR]
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import Report, add_output_arg, median_seconds
from specdec.models import transformer

SHAPES = {"q|k|v": (576, 960), "o": (576, 576), "gate|up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


def formulations():
    def w_xt(x, w):  # stored [out, in]; [out, rows] then transposed, the transpose kept out of the product
        y = jnp.einsum("oi,ni->on", w, x)
        return jax.lax.optimization_barrier(y).T

    return {
        "x @ W": (lambda x, w: x @ w, False),
        "x @ W^T": (lambda x, w: jnp.einsum("ni,oi->no", x, w), True),
        "W @ x^T": (w_xt, True),
        "dense_t": (transformer.dense_t, True),
    }


def chain(product):
    # every product's result feeds the sum, so none is dropped; the weights are distinct, so each is streamed
    return jax.jit(lambda ws, x: sum(product(x, w)[:, :8].sum() for w in ws))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    ap.add_argument("--megabytes", type=float, default=100.0, help="weights streamed per timed chain")
    ap.add_argument("--repeats", type=int, default=20)
    add_output_arg(ap, __file__)
    args = ap.parse_args(argv)

    report = Report(__file__, argv, args.out)
    summary = {"skinny_rows": transformer.SKINNY_ROWS, "rows": []}
    print(f"# jax {jax.__version__}, {os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.2f}; GB/s of weights "
          f"(dense_t uses W @ x^T up to {transformer.SKINNY_ROWS} rows)", flush=True)
    rng = np.random.default_rng(0)
    forms = formulations()
    print("| weight | rows | " + " | ".join(forms) + " |\n|---|---|" + "---|" * len(forms), flush=True)
    for name, (din, dout) in SHAPES.items():
        n = max(1, int(args.megabytes * 1e6 / (din * dout * 4)))
        stored_in_out = [jnp.asarray(rng.standard_normal((din, dout), dtype=np.float32)) for _ in range(n)]
        stored_out_in = [w.T.copy() for w in stored_in_out]
        for rows in args.rows:
            x = jnp.asarray(rng.standard_normal((rows, din), dtype=np.float32))
            row = {"weight": name, "shape_in_out": [din, dout], "rows": rows, "products": n}
            for label, (product, out_in) in forms.items():
                run, weights = chain(product), (stored_out_in if out_in else stored_in_out)
                seconds = median_seconds(lambda: run(weights, x), args.repeats)
                row[label] = {"us_per_product": seconds / n * 1e6, "gb_s": din * dout * 4 * n / seconds / 1e9}
            summary["rows"].append(row)
            print(f"| {name} {din}x{dout} | {rows} | "
                  + " | ".join(f"{row[k]['gb_s']:.1f}" for k in forms) + " |", flush=True)
    report.finish()
    report.table("GB/s of weights streamed, by formulation", ["weight", "rows", *forms],
                 [[f"{r['weight']} {r['shape_in_out'][0]}x{r['shape_in_out'][1]}", r["rows"],
                   *(f"{r[k]['gb_s']:.1f}" for k in forms)] for r in summary["rows"]],
                 note=f"median of {args.repeats} chains of ~{args.megabytes:g} MB; dense_t uses W @ x^T up to "
                      f"{transformer.SKINNY_ROWS} rows", echo=False)
    report.write(summary)
    return summary


if __name__ == "__main__":
    main()
