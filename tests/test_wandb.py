"""Weights & Biases tracking (experiments/tracking.py), offline: no account, no network.

W&B starts a service process and background threads that live until the interpreter exits, so in a pytest-xdist
worker they outlive the test. (They were alive in a worker CI saw die of a segmentation fault;
a later full run saw the same crash with no W&B thread, in XLA compiling tests/test_megakernel_engine.py, so they were
not its cause.) The W&B checks run in ONE child process started here (`python -m tests.test_wandb DIR`), which
runs every check and reports each result as JSON; the tests below assert one check each.

What the child proves:
- `specdec run` with `tracking.backend=wandb` writes one offline run (a non-empty run-*.wandb file) under
  `tracking.dir`;
- a tracker made again with the same `resume_dir` continues the same W&B run (the id kept in tracking.json);
  files become artifacts, a missing file is a clear error, and an input artifact offline is recorded in the
  run's config with its files' digests.
"""

from __future__ import annotations

import glob
import json
import sys
import traceback
from pathlib import Path

import pytest

from specdec.testing import child_result

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "experiments" / "tiny.yaml"
CHECKS = ("offline_run_directory", "run_resumes_by_stored_id_and_records_artifacts")


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    """Run every W&B check once in a child process; {check: "ok" | error text}."""
    work = tmp_path_factory.mktemp("wandb")
    return child_result("tests.test_wandb", str(work), env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})


@pytest.mark.parametrize("check", CHECKS)
def test_wandb(child, check):
    assert child.get(check) == "ok", f"W&B check {check}:\n{child.get(check)}"


# ------------------------------------------------------------------------------------------------------------
# The checks (run in the child)
# ------------------------------------------------------------------------------------------------------------


def check_offline_run_directory(work: Path) -> None:
    from experiments.run import run_experiment
    from specdec.config import load_config

    cfg = load_config(TINY, [f"output.dir={work}", "output.name=wb", "tracking.backend=wandb",
                             f"tracking.dir={work / 'wandb_dir'}", "tracking.group=g", "tracking.tags=[test]",
                             "data.datasets.0.limit=1"])
    run_experiment(cfg, progress=False, echo=lambda *a, **k: None)
    runs = glob.glob(str(work / "wandb_dir" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1 and Path(runs[0]).stat().st_size > 0, runs


def check_run_resumes_by_stored_id_and_records_artifacts(work: Path) -> None:
    from experiments.tracking import TRACKING_FILE, make_tracker
    from specdec.config import TrackingConfig

    cfg = TrackingConfig(backend="wandb", mode="offline", project="t")
    run_dir = work / "run"
    (work / "manifest.json").write_text('{"prompts_sha": "abc"}')
    with make_tracker(cfg, run_name="r", out_dir=run_dir, resume_dir=run_dir) as first:
        first.use_artifact("distill-data-x", "dataset", [work / "manifest.json"])
        first.log_artifact("drafter-x", "model", [work / "manifest.json"])
        first_id = first.run_id
        recorded = json.loads(first.run.config["inputs/distill-data-x"])
    assert recorded["files"]["manifest.json"] and recorded["kind"] == "dataset"
    assert json.loads((run_dir / TRACKING_FILE).read_text())["wandb_run_id"] == first_id
    with make_tracker(cfg, run_name="r", out_dir=run_dir, resume_dir=run_dir) as again:
        assert again.run_id == first_id
        try:
            again.log_artifact("drafter-x", "model", [work / "missing.bin"])
        except FileNotFoundError as err:
            assert "missing.bin" in str(err), err
        else:
            raise AssertionError("a missing artifact file was accepted")
    # both sessions write under the one run id (a directory per start, "-1" if in the same second): one run
    runs = glob.glob(str(run_dir / "wandb" / f"offline-run-*-{first_id}*"))
    assert runs and sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*"))) == sorted(runs)


def _child_main(work: str) -> None:
    results = {}
    for name in CHECKS:
        check_dir = Path(work) / name
        check_dir.mkdir(parents=True, exist_ok=True)
        try:
            globals()[f"check_{name}"](check_dir)
            results[name] = "ok"
        except Exception:  # report every check, not just the first failure
            results[name] = traceback.format_exc()[-3000:]
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    _child_main(sys.argv[1])
