"""Drafter registry: every drafter is created from config by name.

    create_drafter("ngram", target, num_draft_tokens=5, max_ngram=3)

Each drafter module registers a factory `make(target, num_draft_tokens, **params)`; unknown names and unknown
parameters are errors that list what is allowed.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Callable

_FACTORIES: dict[str, Callable] = {}
AUTO = "auto"  # create_drafter("auto", ..., path=...): the kind comes from the trained drafter's directory
# The trained drafter shipped with the repo (16-bit weights and a model card), for the default model
# (SmolLM2-135M-Instruct): create_drafter(None, target, 7, path=SHIPPED_DRAFTER).
SHIPPED_DRAFTER = Path(__file__).resolve().parent / "trained" / "dspark_smollm2_mix"
# Modules that register drafters, imported on first use (so importing `drafters` stays cheap).
_MODULES = ("drafters.ngram", "drafters.draft_lm", "drafters.suffix", "drafters.eagle3", "drafters.medusa",
            "drafters.distilled_lm", "drafters.dflash", "drafters.dspark", "drafters.hybrid")


def register(name: str):
    def deco(factory):
        _FACTORIES[name] = factory
        return factory
    return deco


def _load_all():
    for module in _MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:  # a real missing dependency inside the module
                raise


def available() -> list[str]:
    _load_all()
    return sorted(_FACTORIES)


def create_drafter(name: str | None, target, num_draft_tokens: int = 5, **params):
    """Build drafter `name` for `target`; `params` are the drafter's own options (config `drafter.params`).
    With `name` None (or "auto") and `path=<trained drafter dir>`, the kind is read from the directory (a
    training run's drafter.json or an export's config.json)."""
    _load_all()
    if name is None or name == AUTO:
        if not params.get("path"):
            raise ValueError("create_drafter needs a drafter name, or path=<trained drafter directory> to read it from")
        from specdec.train.checkpoint import drafter_kind

        name = drafter_kind(params["path"])
    accepted = parameters(name)
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"drafter {name!r} got unknown parameter(s) {', '.join(unknown)}; "
                         f"its parameters are: {', '.join(accepted) or '(none)'}")
    return _FACTORIES[name](target, num_draft_tokens, **params)


def parameters(name: str) -> list[str]:
    """The parameters drafter `name` takes (its factory's, beyond the target and num_draft_tokens)."""
    _load_all()
    if name not in _FACTORIES:
        raise ValueError(f"unknown drafter {name!r}; available drafters: {', '.join(sorted(_FACTORIES))}")
    return [p for p in inspect.signature(_FACTORIES[name]).parameters if p not in ("target", "num_draft_tokens")]
