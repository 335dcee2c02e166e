"""How `export_run` rebuilds a trained drafter's architecture from its checkpoint config, per drafter kind.

The architectures live in drafters/, which specdec/ never imports (tests/test_layering.py). So the drafter module
that owns an exportable kind registers its builder when it is imported, as drafters register training tasks with
`specdec.train.tasks.register_task`:

    @register_architecture("eagle3")
    def arch_from_checkpoint(target, config: dict) -> Eagle3Arch

drafters/eagle3.py, drafters/dflash.py and drafters/dspark.py do; `drafters.available()` imports them all.
"""

from __future__ import annotations

from typing import Any, Callable

_ARCHITECTURES: dict[str, Callable[[Any, dict], Any]] = {}


def register_architecture(kind: str):
    def deco(arch_from_checkpoint):
        _ARCHITECTURES[kind] = arch_from_checkpoint
        return arch_from_checkpoint
    return deco


def registered_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def arch_from_checkpoint(kind: str, target, config: dict):
    """The architecture of a `kind` drafter trained on `target` with checkpoint config `config` (drafter.json's)."""
    if kind not in _ARCHITECTURES:
        known = ", ".join(registered_architectures()) or "(none: call drafters.available() first)"
        raise ValueError(f"no architecture registered for {kind!r} drafters; registered: {known}")
    return _ARCHITECTURES[kind](target, config)
