"""Acceptance length and speedup per dataset for every finished run of a sweep directory.

Reads each run's per-batch metrics (`metrics/speculative.jsonl`, `metrics/autoregressive.jsonl`, written by
`specdec run` / `specdec sweep`) and merges them by the `dataset` of the batch: tau (bonus token counted),
speculative and AR decode tok/s and their ratio, and the mean of tau over the datasets (the issues' goals are
averages over MT-Bench, GSM8K and HumanEval). The JSON rows also carry each dataset's acceptance by draft
position, conditional on the position before it accepted (`DecodeMetrics.acceptance_by_position`).

    python -m benchmarks.tau_by_dataset runs/parallel [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.store import AR, SPEC, RecordStore, RunPaths


def by_dataset(run_dir: Path, method: str) -> dict:
    """{dataset: merged DecodeMetrics} of one method of a finished run (its per-batch metrics records)."""
    store = RecordStore(RunPaths(run_dir), method)
    return {d: store.merged(d, by="dataset") for d in dict.fromkeys(b["dataset"] for b in store.batches)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    rows = []
    for summary in sorted(args.sweep_dir.glob("*/summary.json")):
        run = summary.parent
        spec, ar = by_dataset(run, SPEC), by_dataset(run, AR)
        taus = {d: m.tau for d, m in spec.items()}
        speed = {d: m.tokens_per_second / ar[d].tokens_per_second for d, m in spec.items() if d in ar}
        accept = {d: m.acceptance_by_position()["conditional"] for d, m in spec.items()}
        rows.append({"run": run.name, "tau": taus, "speedup": speed, "mean_tau": sum(taus.values()) / len(taus),
                     "conditional_acceptance": accept})
    if not rows:
        sys.exit(f"no finished runs (summary.json) under {args.sweep_dir}")
    datasets = sorted({d for r in rows for d in r["tau"]})
    print("| run | " + " | ".join(f"tau {d}" for d in datasets) + " | mean tau | "
          + " | ".join(f"speedup {d}" for d in datasets) + " |")
    print("|---|" + "---|" * (2 * len(datasets) + 1))
    for r in rows:
        print(f"| {r['run']} | " + " | ".join(f"{r['tau'].get(d, float('nan')):.2f}" for d in datasets)
              + f" | {r['mean_tau']:.2f} | "
              + " | ".join(f"{r['speedup'].get(d, float('nan')):.2f}x" for d in datasets) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
