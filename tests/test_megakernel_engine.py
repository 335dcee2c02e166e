"""The speculative engine with `backend: megakernel` (Pallas TPU interpreter on CPU, race detector live) is
lossless: greedy output equals the reference backend's autoregressive output token for token."""

import pytest

from drafters import create_drafter
from specdec.engine import speculative_generate
from specdec.generate import generate
from specdec.kernels import interpret_tools as it
from specdec.kernels import megakernel as mk
from specdec.testing import peaky_target

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [20, 21, 20, 21, 20, 21, 20]]


@pytest.mark.timeout(300)
def test_greedy_speculative_megakernel_equals_reference_ar():
    reference = peaky_target(0)
    target = peaky_target(0, "megakernel")
    ar = generate(reference, PROMPTS, max_new_tokens=10)
    drafter = create_drafter("ngram", target, 4, max_ngram=2)
    with mk.interpret_mode(mk.race_check_params()):  # the engine's loops are traced here: race detector live
        out = speculative_generate(target, drafter, PROMPTS, policy="greedy_chain", max_new_tokens=10)
    assert not it.races_found()
    assert out.tokens == ar.tokens
