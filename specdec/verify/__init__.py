"""Verification policies: decide which drafted tokens the target accepts and what it commits after them.

Every policy has the signature `verify(draft, target_logits, sampling, key) -> VerifyResult` (see base.py);
pick one by name with `get_policy`. Lossless policies: greedy_chain, greedy_tree (greedy decoding only),
rejection_chain, multidraft_tree. Lossy: typical (Medusa).
"""

from specdec.verify.base import Draft, Policy, VerifyResult
from specdec.verify.chain import greedy_chain, rejection_chain
from specdec.verify.registry import POLICY_NAMES, get_policy
from specdec.verify.tree import greedy_tree, longest_accepted_path, multidraft_tree
from specdec.verify.typical import typical

__all__ = ["Draft", "Policy", "VerifyResult", "POLICY_NAMES", "get_policy", "greedy_chain", "rejection_chain",
           "greedy_tree", "multidraft_tree", "typical", "longest_accepted_path"]
