"""Keep a training run's drafter at one checkpoint step as a drafter directory (drafter.json + params.npz).

A run keeps only its newest `train.keep_checkpoints` states, so a learning curve measured in the engine (tau
against training tokens, docs/TRAINING.md) snapshots the steps it needs while the run goes on:

    python -m benchmarks.snapshot_drafter runs/train/dspark_mix runs/snapshots/dspark_mix_step350 [--step 350]

Without --step: the latest checkpoint. The snapshot loads like any drafter (`drafter.path`); its
drafter.json also records the step and the examples seen at that step. `--float16` stores the weight matrices
(parameters of 2 or more dimensions) as float16, which halves the file (the shipped drafter in drafters/trained/
is written so); vectors (norm scales, biases) and buffers stay as trained. The drafter upcasts on load.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import numpy as np

from specdec.train import checkpoint as ckpt


def halved(params):
    """Weight matrices (ndim >= 2) as float16; everything else as it is."""
    return jax.tree.map(lambda x: np.asarray(x, np.float16) if np.ndim(x) >= 2 else x, params)


def snapshot(run: Path, out: Path, step: int | None = None, float16: bool = False) -> Path:
    info = json.loads((run / ckpt.DRAFTER_FILE).read_text())
    store = ckpt.CheckpointStore(run / ckpt.CHECKPOINTS, create=False)
    try:
        state, meta = store.restore(step)
    finally:
        store.close()
    out.mkdir(parents=True, exist_ok=True)
    seen = int(meta.get("epoch", 0)) * int(meta.get("train_examples", 0)) + int(meta.get("cursor", 0))
    info["snapshot"] = {"run": str(run), "step": int(meta["step"]), "examples_seen": seen}
    (out / ckpt.DRAFTER_FILE).write_text(json.dumps(info, indent=2))
    params = halved(state["params"]) if float16 else state["params"]
    ckpt.export_params(out, params, state.get("buffers", {}), int(meta["step"]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a training run directory (with checkpoints/)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    ap.add_argument("--float16", action="store_true", help="store the weight matrices as float16")
    args = ap.parse_args(argv)
    out = snapshot(args.run, args.out, args.step, args.float16)
    print(f"wrote {out}: {json.loads((out / ckpt.DRAFTER_FILE).read_text())['snapshot']}")


if __name__ == "__main__":
    main()
