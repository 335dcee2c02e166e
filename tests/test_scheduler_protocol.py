"""The Scheduler protocol (specdec/scheduler.py): the loop calls every scheduler the same way, so a scheduler
written against the protocol alone (no engine change) steers the verify width, keeps its own state through the
compiled and the host-stepped loop, and reports metrics; `FixedWidth` changes nothing."""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drafters import create_drafter
from specdec.engine import speculative_generate
from specdec.generate import generate
from specdec.scheduler import FixedWidth, Scheduler
from specdec.testing import PROMPTS, peaky_target


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Calls:
    drafted: jax.Array  # int32 [] rounds that drafted, rounds that skipped the draft, verified rounds observed,
    plain: jax.Array  # and the nodes refine left valid in active rows
    observe: jax.Array
    verified_nodes: jax.Array


@dataclasses.dataclass(frozen=True)
class FirstNodesOnly(Scheduler):
    """Verify at most `nodes` draft nodes per row, and plan width 0 (skip the draft) on every `skip_every`-th
    round; count every call."""

    kind: ClassVar[str] = "first_nodes_only"
    may_skip: ClassVar[bool] = True
    nodes: int = 1
    skip_every: int = 3

    def verify_widths(self, num_draft_tokens, buckets):
        return (0, self.nodes, num_draft_tokens)

    def init_state(self, batch, num_nodes, classes, measured):
        assert measured == "prepared"
        return Calls(*[jnp.zeros((), jnp.int32) for _ in range(4)])  # one buffer each: the loop donates them

    def prepare(self, probe):
        assert probe.batch == len(PROMPTS) and probe.spec.verify_widths == (0, self.nodes, 4)
        return "prepared"

    def plan(self, spec, state):
        rounds = state.sched.drafted + state.sched.plain
        return jnp.where(rounds % self.skip_every == 0, 0, 1).astype(jnp.int32)

    def refine(self, spec, state, draft, planned, drafted):
        keep = draft.valid & (jnp.arange(draft.num_nodes)[None, :] < self.nodes) & drafted
        calls = state.sched
        calls = dataclasses.replace(calls, drafted=calls.drafted + drafted, plain=calls.plain + ~drafted,
                                    verified_nodes=calls.verified_nodes + jnp.sum(keep & ~state.done[:, None]))
        return dataclasses.replace(draft, valid=keep), calls

    def observe(self, spec, state, draft, depth, result, active):
        return dataclasses.replace(state.sched, observe=state.sched.observe + 1)

    def skipped(self, spec, state):
        return dataclasses.replace(state.sched, plain=state.sched.plain + 1)

    def metrics(self, spec, sched):
        return {"skipped_drafts": int(sched.plain), "width_rounds": [int(sched.drafted), int(sched.plain)],
                "realised_accepted": float(sched.verified_nodes), "expected_accepted": float(sched.observe)}


@pytest.mark.parametrize("compiled", [True, False])
def test_a_scheduler_written_against_the_protocol_alone_steers_the_loop(compiled):
    target = peaky_target(1)
    ar = generate(target, PROMPTS, max_new_tokens=17)
    drafter = create_drafter("ngram", target, 4, max_ngram=2)
    out = speculative_generate(target, drafter, PROMPTS, max_new_tokens=17, scheduler=FirstNodesOnly(),
                               compiled=compiled)
    assert out.tokens == ar.tokens
    m = out.metrics
    drafted_rounds, plain_rounds = m.width_rounds
    assert plain_rounds == m.skipped_drafts > 0 and drafted_rounds > 0  # both branches of the loop ran
    assert m.expected_accepted == drafted_rounds + plain_rounds  # observe: after every round, plain ones too
    # every row-round verified at most one node, and the metrics count exactly the nodes the scheduler left valid
    assert m.proposed_draft_tokens == m.realised_accepted <= drafted_rounds * len(PROMPTS)
    assert max(m.position_proposed[1:]) == 0
    assert 0 < m.accepted_draft_tokens <= m.proposed_draft_tokens


def test_fixed_width_is_the_default_and_changes_nothing():
    target = peaky_target(2)
    drafter = create_drafter("ngram", target, 4, max_ngram=2)
    default = speculative_generate(target, drafter, PROMPTS, max_new_tokens=17)
    fixed = speculative_generate(target, drafter, PROMPTS, max_new_tokens=17, scheduler=FixedWidth())
    assert fixed.tokens == default.tokens == generate(target, PROMPTS, max_new_tokens=17).tokens
    assert fixed.accept_lengths == default.accept_lengths
    assert np.array_equal(fixed.metrics.position_proposed, default.metrics.position_proposed)
    assert fixed.metrics.width_rounds == []  # a fixed width reports no choices
