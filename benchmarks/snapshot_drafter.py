"""Keep a training run's drafter at one checkpoint step as a drafter directory (drafter.json + params.npz).

A run keeps only its newest `train.keep_checkpoints` states, so a learning curve measured in the engine (tau
against training tokens, docs/TRAINING.md) snapshots the steps it needs while the run goes on:

    python -m benchmarks.snapshot_drafter runs/train/dspark_mix runs/snapshots/dspark_mix_step350 [--step 350]

Without --step: the latest checkpoint. The snapshot loads like any drafter (`drafter.path`); its
drafter.json also records the step and the examples seen at that step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.train import checkpoint as ckpt


def snapshot(run: Path, out: Path, step: int | None = None) -> Path:
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
    ckpt.export_params(out, state["params"], state.get("buffers", {}), int(meta["step"]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a training run directory (with checkpoints/)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    args = ap.parse_args(argv)
    out = snapshot(args.run, args.out, args.step)
    print(f"wrote {out}: {json.loads((out / ckpt.DRAFTER_FILE).read_text())['snapshot']}")


if __name__ == "__main__":
    main()
