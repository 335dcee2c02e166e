"""Rows that finish are refilled from the queue of pending prompts (specdec/engine.py `generate_refilled`).

A refilled row must start exactly as its prompt would alone: greedy output == AR per prompt (drafters with their
own per-row state: prompt lookup, a draft LM, DSpark's context K/V and taps), an oracle draft LM accepts every
draft of every round exactly as it does for the prompt alone (a stale or borrowed drafter state would not: the
negative control refills everything but the drafter's state and fails that check), and sampled output is keyed by
the prompt, not the row it lands in (same tokens as one batch of all the prompts)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from drafters import create_drafter
from drafters.draft_lm import DraftLMDrafter
from specdec import engine
from specdec.adaptive import AdaptiveWidth
from specdec.engine import generate_refilled, speculative_generate
from specdec.generate import generate
from specdec.sampling import SamplingParams
from specdec.testing import PROMPTS, peaky_target
from tests.test_scheduling import random_dspark

PROMPTS_10 = PROMPTS * 2 + [[4, 5, 4, 5, 4, 5], [7]]
LIMITS = [3, 11, 1, 7, 9, 2, 12, 5, 8, 4]  # rows end at different times (and at EOS, where the target stops)


def test_refilled_rows_give_ars_tokens_for_every_prompt():
    target = peaky_target(6)
    ar = generate(target, PROMPTS_10, max_new_tokens=LIMITS).tokens
    adaptive = AdaptiveWidth(round_costs=(1.0, 1.1, 1.3, 1.5), draft_cost=0.01, objective="throughput")
    cases = [(create_drafter("ngram", target, 4, max_ngram=2), adaptive, 2),
             (DraftLMDrafter(target.cfg, target.params, 3, name="oracle_lm"), None, 2),
             (random_dspark(target), None, 1)]
    for drafter, scheduler, refill in cases:
        out = generate_refilled(target, drafter, PROMPTS_10, batch_size=3, refill_rows=refill, max_new_tokens=LIMITS,
                                scheduler=scheduler)
        assert out.tokens == ar, (drafter.name, scheduler)
        m = out.metrics
        assert m.new_tokens == sum(map(len, ar)) and m.rounds == sum(map(len, out.accept_lengths))
        assert 0 <= m.idle_fraction < 0.5, (drafter.name, m.idle_fraction)
    with pytest.raises(ValueError, match="Python state"):
        generate_refilled(target, create_drafter("suffix", target, 4), PROMPTS_10, batch_size=3, policy="greedy_tree")


def _drafter_leaves(small) -> slice:
    """The positions of a LoopState's drafter-state leaves among its leaves (fields flatten in order)."""
    before = jax.tree.leaves((small.cache, small.seq, small.seq_len, small.num_new, small.done, small.limit))
    return slice(len(before), len(before) + len(jax.tree.leaves(small.drafter_state)))


@pytest.mark.parametrize("mutant", [False, True])
def test_a_refilled_row_drafts_from_its_own_state(monkeypatch, mutant):
    """The oracle draft LM (the target itself) accepts every draft when its cache holds the row's own prompt and
    tokens: each prompt's accept lengths under refill equal those of the prompt decoded alone. The mutant leaves
    the drafter's state out of the refill, so a refilled row drafts from the previous prompt's cache: caught."""
    target = peaky_target(6, eos_token_ids=())
    oracle = DraftLMDrafter(target.cfg, target.params, 3, name="oracle_lm")
    if mutant:
        real = engine._batch_axes

        def without_drafter(small, bigger):
            axes = list(real(small, bigger))
            span = _drafter_leaves(small)
            axes[span] = [None] * (span.stop - span.start)
            return tuple(axes)

        monkeypatch.setattr(engine, "_batch_axes", without_drafter)
    out = generate_refilled(target, oracle, PROMPTS_10, batch_size=3, max_new_tokens=LIMITS)
    alone = [speculative_generate(target, oracle, [p], max_new_tokens=n).accept_lengths[0]
             for p, n in zip(PROMPTS_10, LIMITS)]
    assert out.tokens == generate(target, PROMPTS_10, max_new_tokens=LIMITS).tokens  # greedy: exact either way
    assert (out.accept_lengths == alone) != mutant


def test_sampled_refill_is_keyed_by_the_prompt_not_the_row(monkeypatch):
    """Under the invariant policy a prompt's sampled tokens depend on its seed, its index and its tokens: refilled
    in any row, they are those of one batch of all the prompts. Keyed by the row it lands in instead, they differ."""
    target = peaky_target(6)
    drafter = create_drafter("ngram", target, 3, max_ngram=2)
    run = dict(policy="invariant_chain", sampling=SamplingParams(temperature=0.8), seed=5, max_new_tokens=LIMITS)
    together = speculative_generate(target, drafter, PROMPTS_10, **run).tokens
    assert generate_refilled(target, drafter, PROMPTS_10, batch_size=3, **run).tokens == together
    real = engine.prefilled
    monkeypatch.setattr(engine, "prefilled", lambda *a, rows=None, **k: real(*a, **k))  # rows 0..R-1
    assert generate_refilled(target, drafter, PROMPTS_10, batch_size=3, **run).tokens != together


def _compiles_after_the_timed_run_starts(monkeypatch, num_draft_tokens: int, **run) -> tuple[int, int]:
    """(programs traced or compiled before the timed run's first loop call, after it) in one `generate_refilled`
    call of an n-gram drafter drafting `num_draft_tokens` (drafters of equal settings share compiled programs). The
    timed run's loop calls are those with a limit above the warm-up's 2 tokens; its first batch's prefill repeats
    the warm-up's (the same prompts, the same program)."""
    events, marks = [], []

    def listen(event, duration, **kwargs):
        if event.startswith("/jax/core/compile"):
            events.append(event)

    real = engine.compiled_loop

    def loop(spec, tparams, dparams, state):
        if not marks and np.asarray(state.limit).max() > 2:  # numpy: a jnp reduction here would compile
            marks.append(len(events))
        return real(spec, tparams, dparams, state)

    monkeypatch.setattr(engine, "compiled_loop", loop)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        target = peaky_target(6)
        drafter = create_drafter("ngram", target, num_draft_tokens, max_ngram=3)
        out = generate_refilled(target, drafter, PROMPTS_10, batch_size=3, max_new_tokens=LIMITS, **run)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert out.tokens == generate(target, PROMPTS_10, max_new_tokens=LIMITS).tokens
    return marks[0], len(events) - marks[0]


@pytest.mark.parametrize("warmup", [True, False])
def test_a_warmed_up_refilled_run_compiles_nothing_while_timed(monkeypatch, warmup):
    """`warmup=True` runs every program of the run first (the loop, an insert of 2 prompts and one of 1: 10
    prompts, 3 rows, the queue's last insert holds 1), so the timed run traces and compiles nothing. Without it
    (the negative control; a drafter whose loop no test compiled before) the loop compiles in the timed run."""
    before, after = _compiles_after_the_timed_run_starts(monkeypatch, 5 if warmup else 6, refill_rows=2,
                                                         warmup=warmup)
    assert before > 0
    assert (after == 0) == warmup, after
