"""Verification policies by name: what configs and the engine refer to. Each policy module declares its own
`Policy` objects; this is the list of them, and everything that needs the set of names (the config's allowed
values, the CLI's listing) or a policy's properties (greedy only, its tree counterpart) reads them here."""

from __future__ import annotations

from specdec.verify.base import Policy
from specdec.verify.chain import GREEDY_CHAIN, REJECTION_CHAIN
from specdec.verify.invariant import INVARIANT_CHAIN, INVARIANT_TREE
from specdec.verify.tree import GREEDY_TREE, MULTIDRAFT_TREE
from specdec.verify.typical import TYPICAL

_POLICIES: dict[str, Policy] = {p.name: p for p in (GREEDY_CHAIN, REJECTION_CHAIN, GREEDY_TREE, MULTIDRAFT_TREE,
                                                    TYPICAL, INVARIANT_CHAIN, INVARIANT_TREE)}

POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)


def get_policy(name: str, **options: float) -> Policy:
    """The policy called `name`, with `options` overriding its defaults (only `typical` has any:
    epsilon, delta). Unknown names and options are errors, never silently ignored."""
    if name not in _POLICIES:
        raise ValueError(f"unknown verification policy {name!r}; allowed: {', '.join(POLICY_NAMES)}")
    return _POLICIES[name].with_options(**options)
