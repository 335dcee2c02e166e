"""The trained drafter shipped with the repo (drafters/trained/): it loads by path alone (the kind from its
metadata) onto the default model, the quickstart shows it only for the target it was trained on, and its
greedy output equals AR's through the adaptive loop, fixed-width rounds and skipped drafts alike."""

from __future__ import annotations

import pytest

from drafters import SHIPPED_DRAFTER, create_drafter
from experiments.cli import _shipped_drafter_fits
from specdec.adaptive import AdaptiveWidth
from specdec.engine import speculative_generate
from specdec.generate import generate
from specdec.prompts import builtin
from tests.test_adaptive import given_costs

# costs for the widths (0, 1, 3, 7) of a 7-token draft with auto buckets under which a history of accepted
# drafts verifies and one of rejected drafts skips: given, so the test measures nothing
COSTS = ((1.0, 1.1, 1.3, 1.6), 0.1)


def test_shipped_drafter_is_offered_only_for_its_target(tiny_target):
    assert SHIPPED_DRAFTER.is_dir() and (SHIPPED_DRAFTER / "README.md").is_file()
    assert _shipped_drafter_fits(tiny_target) is None  # another shape: no quickstart row


@pytest.mark.real_model
def test_shipped_drafter_greedy_equals_ar(real_target):
    assert _shipped_drafter_fits(real_target) == str(SHIPPED_DRAFTER)
    drafter = create_drafter(None, real_target, 7, path=str(SHIPPED_DRAFTER))
    assert drafter.name == "dspark"
    prompts = [real_target.tokenizer.encode_chat(text) for _, text in builtin("quickstart")[:2]]
    ar = generate(real_target, prompts, 24).tokens
    fixed = speculative_generate(real_target, drafter, prompts, max_new_tokens=24)
    assert fixed.tokens == ar
    assert fixed.metrics.accepted_draft_tokens > 0  # it drafts tokens the target accepts
    adaptive = speculative_generate(real_target, drafter, prompts, max_new_tokens=24, verify_buckets="auto",
                                    scheduler=AdaptiveWidth(**given_costs(COSTS)))
    assert adaptive.tokens == ar
    assert adaptive.metrics.width_rounds[0] > 0 and sum(adaptive.metrics.width_rounds[1:]) > 0
