"""Freeze a training run's drafter into a drafter directory (drafter.json + params.npz) that no training job moves.

A run keeps only its newest `train.keep_checkpoints` states, so a learning curve measured in the engine (tau
against training tokens, docs/TRAINING.md) snapshots the steps it needs while the run goes on; the export check
(benchmarks/export_parity.py) freezes the drafter it reads the same way:

    python -m benchmarks.snapshot_drafter runs/train/dspark_mix runs/snapshots/dspark_mix_step350 [--step 350]

Without --step: the run's final weights (params.npz, with DSpark's calibrated confidences) if it finished, else
its newest checkpoint (also when a resumed run has checkpoints newer than the params.npz of its interruption).
The snapshot loads like any drafter (`drafter.path`); its drafter.json also records the run, the step, the
weights' source and (from a checkpoint) the examples seen at that step. The run's config.yaml is copied beside
it, and its summary.json with the final weights (an export's model card reads them). `--float16` stores the
weight matrices (parameters of 2 or more dimensions) as float16, which halves the file (the shipped drafter in
drafters/trained/ is written so); vectors (norm scales, biases) and buffers stay as trained. The drafter upcasts
on load. The work is `specdec.train.checkpoint.snapshot`, which `specdec recipe` calls too. A snapshot is a
full-format drafter (`train.init_from` continues it); what ships is written by
`specdec export <run> --format inference <out>` (only what decoding reads, docs/TRAINING.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.train import checkpoint as ckpt
from specdec.train.checkpoint import snapshot


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a training run directory (checkpoints/ and/or params.npz)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--step", type=int, help="checkpoint step (default: the final weights, else the newest checkpoint)")
    ap.add_argument("--float16", action="store_true", help="store the weight matrices as float16")
    args = ap.parse_args(argv)
    try:
        snapshot(args.run, args.out, args.step, args.float16)
    except ckpt.CheckpointError as e:
        raise SystemExit(str(e)) from None
    print(f"wrote {args.out}: {json.loads((args.out / ckpt.DRAFTER_FILE).read_text())['snapshot']}")


if __name__ == "__main__":
    main()
