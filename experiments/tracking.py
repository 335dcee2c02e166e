"""Experiment trackers: the interface and the no-service trackers are the library's (specdec/tracking.py);
here is Weights & Biases, and `make_tracker`, which builds the tracker a config's `tracking:` asks for.

    tracker = make_tracker(cfg.tracking, run_name="quickstart", out_dir=Path("runs/quickstart"), config=cfg_dict)
    tracker.log_metrics({"tau": 2.1}); tracker.log_summary(summary); tracker.log_table("records", cols, rows)
    tracker.log_image("acceptance_by_position", "runs/quickstart/acceptance_by_position.png"); tracker.finish()

- `WandbTracker`: Weights & Biases, offline by default (`tracking.mode`); runs land in
  `<tracking.dir or the run's output dir>/wandb/offline-run-*` and `wandb sync` uploads them later. Project,
  group and tags come from the config. With `resume_dir` (a training run's directory) the W&B run id is kept in
  `<resume_dir>/tracking.json`, so a resumed training run, and `specdec export` of it, continue the same W&B run.
- Artifacts: `log_artifact` stores files as a versioned W&B artifact of this run (the distillation data's
  manifest + summary, an exported drafter); `use_artifact` declares one as this run's input (W&B lineage: the
  data a drafter was trained on). W&B refuses `use_artifact` offline, so there the input is recorded in the run's
  config under `inputs/<name>` (its files' digests), which `wandb sync` uploads with the run.
- `MemoryTracker` (keeps everything; tests inspect it) and `NullTracker` (drops everything): specdec.tracking.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Sequence

from specdec.config import TrackingConfig
from specdec.tracking import MemoryTracker, NullTracker, Tracker, existing_files


def _flatten(d: dict, prefix: str = "") -> dict:
    """Nested dicts -> {"a/b": v}; lists of numbers are kept (W&B shows them as JSON in the summary)."""
    out = {}
    for key, value in d.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.update(_flatten(value, name))
        else:
            out[name] = value
    return out


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


class WandbTracker(Tracker):
    """A W&B run. `mode="offline"` (the default) needs no account and no network."""

    def __init__(self, *, project: str, name: str, group: str | None = None, tags: Sequence[str] = (),
                 mode: str = "offline", dir: str | Path = ".", config: dict | None = None,
                 run_id: str | None = None):
        import wandb

        self._wandb = wandb
        self.mode = mode
        Path(dir).mkdir(parents=True, exist_ok=True)
        # console="off": W&B does not wrap stdout/stderr (progress bars and tables stay as they are)
        resume = {"id": run_id, "resume": "allow"} if run_id else {}
        self.run = wandb.init(project=project, name=name, group=group, tags=list(tags) or None, mode=mode,
                              dir=str(dir), config=config or {}, reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True), **resume)
        self.run_id = self.run.id
        self.dir = Path(self.run.dir).parent  # .../wandb/offline-run-*/

    def log_config(self, config):
        self.run.config.update(config, allow_val_change=True)

    def log_metrics(self, metrics, step=None):
        self.run.log({k: _clean(v) for k, v in _flatten(metrics).items()}, step=step)

    def log_summary(self, summary):
        for key, value in _flatten(summary).items():
            self.run.summary[key] = _clean(value)

    def log_table(self, name, columns, rows):
        self.run.log({name: self._wandb.Table(columns=list(columns), data=[[_clean(v) for v in r] for r in rows])})

    def log_image(self, name, path):
        self.run.log({name: self._wandb.Image(str(path))})

    def _artifact(self, name, kind, files, metadata):
        artifact = self._wandb.Artifact(name, type=kind, metadata=dict(metadata or {}))
        for f in existing_files(files):
            artifact.add_file(f)
        return artifact

    def log_artifact(self, name, kind, files, metadata=None):
        self.run.log_artifact(self._artifact(name, kind, files, metadata))

    def use_artifact(self, name, kind, files, metadata=None):
        if self.mode == "online":
            self.run.use_artifact(self._artifact(name, kind, files, metadata))
        else:  # offline W&B has no artifact lineage: keep the reference (and the files' digests) in the config
            ref = {"kind": kind, "files": {Path(f).name: _digest(f) for f in existing_files(files)},
                   "metadata": dict(metadata or {})}
            self.run.config.update({f"inputs/{name}": json.dumps(ref, sort_keys=True)}, allow_val_change=True)

    def finish(self):
        if self.run is not None:
            self.run.finish()
            self.run = None


TRACKING_FILE = "tracking.json"


def make_tracker(cfg: TrackingConfig, *, run_name: str, out_dir: Path, config: dict | None = None,
                 resume_dir: Path | None = None) -> Tracker:
    """The tracker a config asks for; W&B files go to `tracking.dir` or else the run's output directory.

    `resume_dir`: a directory whose `tracking.json` holds the W&B run id of an earlier tracker of the same run
    (written on first use), so that run is continued instead of a new one started."""
    if cfg.backend == "none":
        return NullTracker()
    if cfg.backend == "memory":
        tracker = MemoryTracker(run_name, cfg.group, cfg.tags)
        if config:
            tracker.log_config(config)
        return tracker
    stored = Path(resume_dir) / TRACKING_FILE if resume_dir is not None else None
    run_id = None
    if stored is not None and stored.is_file():
        run_id = json.loads(stored.read_text()).get("wandb_run_id")
    tracker = WandbTracker(project=cfg.project, name=run_name, group=cfg.group, tags=cfg.tags, mode=cfg.mode,
                           dir=Path(cfg.dir) if cfg.dir else out_dir, config=config, run_id=run_id)
    if stored is not None and run_id is None:
        stored.parent.mkdir(parents=True, exist_ok=True)
        stored.write_text(json.dumps({"wandb_run_id": tracker.run_id, "project": cfg.project}, indent=2))
    return tracker
