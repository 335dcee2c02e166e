"""Roofline report for the target step: bytes, FLOPs, the per-chip floor and expected tokens/s, plus the
megakernel's VMEM plan per TPU generation. Analytic (no weights, no device).

    python -m benchmarks.roofline [--model smollm2-135m-instruct|tiny|1b] [--context 1024] [--dtype bfloat16]
Writes runs/benchmarks/roofline/results.{json,md} (`--out`).
"""

from __future__ import annotations

import argparse

from benchmarks.common import Report, add_output_arg
from specdec.kernels import roofline
from specdec.kernels import schedule as sch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", choices=sorted(roofline.MODELS))
    ap.add_argument("--context", type=int, default=1024, help="committed positions per row")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    add_output_arg(ap, __file__)
    args = ap.parse_args(argv)
    report = Report(__file__, argv, args.out, title="roofline (analytic)")
    cfg = roofline.MODELS[args.model](dtype=args.dtype)
    report.section(f"Roofline: {cfg.name}", roofline.format_markdown(cfg, context=args.context,
                                                                     batches=tuple(args.batch)))
    for b, t in ((1, 1), (1, 8), (8, 8)):
        report.section(f"Megakernel VMEM plan, B={b}, T={t}",
                       roofline.format_budget_markdown(cfg, sch.Dims(batch=b, num_new=t, capacity=args.context + 64)))
    report.write({"model": args.model, "context": args.context, "dtype": args.dtype, "batches": args.batch})


if __name__ == "__main__":
    main()
