"""The speculative engine with `backend: megakernel` (Pallas TPU interpreter on CPU, race detector live) is
lossless: greedy output equals the reference backend's autoregressive output token for token.

The check runs in a child process (`python -m tests.test_megakernel_engine`). XLA:CPU once died of a
segmentation fault compiling this program, the largest of the suite, in an xdist worker that had already
compiled hundreds of others (96% into a full run; alone it compiles in ~10 s and passes). A fresh
process per check keeps one crash from taking down a worker and the rest of the run, and says which check it was.
"""

from __future__ import annotations

import json
import traceback

import pytest

from specdec.testing import child_result

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [20, 21, 20, 21, 20, 21, 20]]


def check_greedy_speculative_megakernel_equals_reference_ar() -> None:
    from drafters import create_drafter
    from specdec.engine import speculative_generate
    from specdec.generate import generate
    from specdec.kernels import interpret_tools as it
    from specdec.kernels import megakernel as mk
    from specdec.testing import peaky_target

    reference = peaky_target(0)
    target = peaky_target(0, "megakernel")
    ar = generate(reference, PROMPTS, max_new_tokens=10)
    drafter = create_drafter("ngram", target, 4, max_ngram=2)
    with mk.interpret_mode(mk.race_check_params()):  # the engine's loops are traced here: race detector live
        out = speculative_generate(target, drafter, PROMPTS, policy="greedy_chain", max_new_tokens=10)
    assert not it.races_found(), "the race detector found races"
    assert out.tokens == ar.tokens, (out.tokens, ar.tokens)
    assert out.metrics.accepted_draft_tokens > 0, "nothing accepted: the check would be vacuous"


@pytest.mark.timeout(300)
def test_greedy_speculative_megakernel_equals_reference_ar():
    assert child_result("tests.test_megakernel_engine", timeout=280) == "ok"


if __name__ == "__main__":
    try:
        check_greedy_speculative_megakernel_equals_reference_ar()
        outcome = "ok"
    except Exception:
        outcome = traceback.format_exc()[-3000:]
    print("RESULT " + json.dumps(outcome), flush=True)
