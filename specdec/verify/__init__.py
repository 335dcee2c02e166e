"""Verification policies: decide which drafted tokens the target accepts and what it commits after them.

Every policy has the signature `verify(draft, target_logits, sampling, key) -> VerifyResult` (see base.py;
`Draft` and `VerifyResult` live in specdec/drafter.py); pick one by name with `get_policy`. Lossless
policies: greedy_chain, greedy_tree (greedy decoding only), rejection_chain, multidraft_tree (the target's
distribution), invariant_chain, invariant_tree (AR's very tokens for the seed). Lossy: typical (Medusa).
"""

from specdec.verify.base import Policy
from specdec.verify.registry import POLICY_NAMES, get_policy

__all__ = ["Policy", "POLICY_NAMES", "get_policy"]
