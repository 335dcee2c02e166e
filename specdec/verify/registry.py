"""Verification policies by name: what configs and the engine refer to."""

from __future__ import annotations

from specdec.verify.base import Policy
from specdec.verify.chain import greedy_chain, rejection_chain
from specdec.verify.tree import greedy_tree, multidraft_tree
from specdec.verify.typical import DEFAULT_DELTA, DEFAULT_EPSILON, typical

# name -> (Policy with default options, the options it accepts)
_POLICIES: dict[str, tuple[Policy, tuple[str, ...]]] = {
    "greedy_chain": (Policy("greedy_chain", lossless=True, supports_trees=False, greedy_only=True,
                            impl=greedy_chain), ()),
    "rejection_chain": (Policy("rejection_chain", lossless=True, supports_trees=False, greedy_only=False,
                               impl=rejection_chain), ()),
    "greedy_tree": (Policy("greedy_tree", lossless=True, supports_trees=True, greedy_only=True,
                           impl=greedy_tree), ()),
    "multidraft_tree": (Policy("multidraft_tree", lossless=True, supports_trees=True, greedy_only=False,
                               impl=multidraft_tree), ()),
    "typical": (Policy("typical", lossless=False, supports_trees=True, greedy_only=False, impl=typical,
                       options=(("delta", DEFAULT_DELTA), ("epsilon", DEFAULT_EPSILON))), ("epsilon", "delta")),
}

POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)


def get_policy(name: str, **options: float) -> Policy:
    """The policy called `name`, with `options` overriding its defaults (only `typical` has any:
    epsilon, delta). Unknown names and options are errors, never silently ignored."""
    if name not in _POLICIES:
        raise ValueError(f"unknown verification policy {name!r}; allowed: {', '.join(POLICY_NAMES)}")
    policy, allowed = _POLICIES[name]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"policy {name!r} has no option(s) {unknown}; allowed: {list(allowed) or 'none'}")
    if not options:
        return policy
    merged = {**dict(policy.options), **{k: float(v) for k, v in options.items()}}
    return Policy(policy.name, policy.lossless, policy.supports_trees, policy.greedy_only, policy.impl,
                  tuple(sorted(merged.items())))
