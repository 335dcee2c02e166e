"""The tracker interface: what an experiment or a training run logs through, and the two trackers that need
no service.

    tracker.log_config(cfg_dict); tracker.log_metrics({"train/loss": 0.5}, step=10)
    tracker.log_summary(summary); tracker.log_table("records", cols, rows); tracker.log_image(name, png)
    tracker.log_artifact(name, kind, files); tracker.use_artifact(name, kind, files); tracker.finish()

- `Tracker`: the protocol. Every method has a do-nothing default, so an implementation overrides what its
  service supports (the library never asks which kind of tracker it has).
- `NullTracker`: drops everything.
- `MemoryTracker`: keeps everything in Python lists (tests inspect it).

The Weights & Biases tracker and `make_tracker` (a tracker from the config's `tracking:` section) live in
experiments/tracking.py: the library (`specdec.train`) depends only on this interface, not on W&B.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, Sequence


class Tracker(Protocol):
    """What every experiment and training run logs through."""

    run_id: str | None = None  # the service's id of this run (W&B), so a resumed run can continue it

    def log_config(self, config: dict) -> None: ...

    def log_metrics(self, metrics: dict, step: int | None = None) -> None: ...

    def log_summary(self, summary: dict) -> None: ...

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None: ...

    def log_image(self, name: str, path: str | Path) -> None: ...

    def log_artifact(self, name: str, kind: str, files: Sequence[str | Path], metadata: dict | None = None) -> None:
        """Store `files` as a versioned artifact of this run (the distillation data, an exported drafter)."""

    def use_artifact(self, name: str, kind: str, files: Sequence[str | Path], metadata: dict | None = None) -> None:
        """Declare `files` an input of this run (lineage: the data a drafter was trained on)."""

    def finish(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finish()
        return False


class NullTracker(Tracker):
    """Drops everything (the protocol's defaults)."""


class MemoryTracker(Tracker):
    """Everything logged, in memory. `finished` says whether `finish` was called."""

    def __init__(self, name: str = "", group: str | None = None, tags: Sequence[str] = ()):
        self.name, self.group, self.tags = name, group, tuple(tags)
        self.config: dict = {}
        self.metrics: list[tuple[int | None, dict]] = []
        self.summary: dict = {}
        self.tables: dict[str, tuple[list[str], list[list[Any]]]] = {}
        self.images: dict[str, str] = {}
        self.artifacts: dict[str, dict] = {}  # logged: name -> {"kind", "files", "metadata"}
        self.inputs: dict[str, dict] = {}  # used
        self.finished = False

    def log_config(self, config):
        self.config.update(config)

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))

    def log_summary(self, summary):
        self.summary.update(summary)

    def log_table(self, name, columns, rows):
        self.tables[name] = (list(columns), [list(r) for r in rows])

    def log_image(self, name, path):
        if not Path(path).is_file():
            raise FileNotFoundError(f"image {path} does not exist")
        self.images[name] = str(path)

    def log_artifact(self, name, kind, files, metadata=None):
        self.artifacts[name] = {"kind": kind, "files": existing_files(files), "metadata": dict(metadata or {})}

    def use_artifact(self, name, kind, files, metadata=None):
        self.inputs[name] = {"kind": kind, "files": existing_files(files), "metadata": dict(metadata or {})}

    def finish(self):
        self.finished = True


def existing_files(files) -> list[str]:
    """The artifact's files as strings; a missing one is an error (an artifact never silently lacks a file)."""
    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"artifact files do not exist: {', '.join(missing)}")
    return [str(f) for f in files]
