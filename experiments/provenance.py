"""What produced a result: git commit, package versions, machine, load. Recorded in every run's summary."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

PACKAGES = ("specdec", "jax", "jaxlib", "numpy", "tokenizers", "gguf", "wandb", "datasets", "matplotlib", "pyyaml")
REPO = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_info() -> dict:
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine() -> dict:
    info = {"hostname": platform.node(), "platform": platform.platform(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "load_average": load_average()}
    try:
        with open("/proc/meminfo") as f:
            total = next(line for line in f if line.startswith("MemTotal"))
        info["memory_gib"] = round(int(total.split()[1]) / 2**20, 1)
    except (OSError, StopIteration):
        pass
    try:
        import jax

        info["jax_backend"] = jax.default_backend()
        info["devices"] = [str(d.device_kind) for d in jax.devices()]
    except Exception:  # noqa: BLE001 - provenance must never fail a run
        pass
    return info


def provenance() -> dict:
    return {"git": git_info(), "versions": versions(), "machine": machine(), "argv": list(sys.argv)}
