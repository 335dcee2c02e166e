"""The quickstart's tokens do not change: the real model's greedy AR answers to the quickstart prompts (what
`specdec quickstart` compares every drafter against; decoded here as one batch of 8) equal the ones recorded in
tests/golden/.

A refactor or a faster step that changes the arithmetic can flip the argmax where the two best logits are
within float32 rounding of each other. So a row that differs must differ at a near-tie: teacher-forcing the
recorded answer, the recorded token's logit at the first differing position is within TIE_TOL of the best one
(after that point the rows are different conversations and are not compared).

    python tests/test_quickstart_tokens.py --write    # record the golden answers (after a deliberate change)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

GOLDEN = Path(__file__).parent / "golden" / "quickstart_ar_tokens.json"
MAX_NEW_TOKENS = 64  # the quickstart's default
TIE_TOL = 1e-3  # logits; a float32 step's rounding on these logits is ~1e-5


def quickstart_prompts(target) -> list[list[int]]:
    from specdec.prompts import builtin

    return [target.tokenizer.encode_chat(text) for _, text in builtin("quickstart")]


def greedy_answers(target) -> list[list[int]]:
    from specdec.generate import generate

    return generate(target, quickstart_prompts(target), MAX_NEW_TOKENS).tokens


def teacher_forced_logits(target, prompt: list[int], answer: list[int]) -> np.ndarray:
    """Logits [len(answer), V]: row i is the target's prediction of answer[i] given the prompt and answer[:i]."""
    seq = prompt + answer
    cache = target.init_cache(1, len(seq))
    out = target.forward(target.params, target.cfg, cache, jnp.asarray([seq], jnp.int32))
    return np.asarray(out.logits[0, len(prompt) - 1: len(seq) - 1], np.float32)


@pytest.mark.real_model
def test_quickstart_greedy_tokens_unchanged(real_target):
    golden = json.loads(GOLDEN.read_text())
    prompts = quickstart_prompts(real_target)
    assert golden["prompts"] == prompts, "the quickstart prompts or the tokenizer changed: re-record (--write)"
    for i, (got, want) in enumerate(zip(greedy_answers(real_target), golden["answers"], strict=True)):
        if got == want:
            continue
        first = next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        assert first < min(len(got), len(want)), f"prompt {i}: one answer is a prefix of the other"
        logits = teacher_forced_logits(real_target, prompts[i], want)[first]
        gap = float(logits.max() - logits[want[first]])
        assert gap <= TIE_TOL, (
            f"prompt {i}: token {first} changed from {want[first]} to {got[first]}, and the recorded token's logit "
            f"is {gap:.3g} below the best (not a near-tie): the step's output changed")


if __name__ == "__main__" and "--write" in sys.argv:
    from specdec.target import load_target

    target = load_target("smollm2-135m-instruct")
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({"max_new_tokens": MAX_NEW_TOKENS, "prompts": quickstart_prompts(target),
                                  "answers": greedy_answers(target)}) + "\n")
    print(f"wrote {GOLDEN}")
