"""Every drafter may be skipped: a round whose draft the scheduler skips is a plain decode step that runs no drafter
code, and the drafter catches up on every token such rounds committed before it drafts again (specdec/drafter.py
`Drafter.update`, specdec/engine.py `plain_rounds` / `catch_up`).

Checked with a scheduler written against the protocol alone that skips on a fixed pattern (runs of 2 and runs
longer than the catch-up buffer, CATCH_UP): greedy output == AR for every drafter the registry offers, at batch
1 and at batch 3 with prompts of different lengths; the drafter's state and next proposal after a run of skipped
rounds equal those of a drafter that drafted every round, and a catch-up that misses the last skipped token
fails that check; the sampled output's law through the engine; the adaptive width now skips the draft LMs and
EAGLE-3."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drafters import available, create_drafter, dflash, eagle3, medusa
from drafters.draft_lm import DraftLMDrafter
from drafters.hybrid import HybridDrafter
from drafters.ngram import NgramDrafter
from specdec import engine
from specdec.adaptive import AdaptiveWidth
from specdec.drafter import CATCH_UP, RoundContext
from specdec.engine import speculative_generate
from specdec.generate import cache_capacity, generate, pad_prompts
from specdec.models.transformer import KVCache
from specdec.sampling import GREEDY, SamplingParams
from specdec.scheduler import Scheduler
from specdec.target import random_target
from specdec.testing import PROMPTS, NUM_SAMPLES, assert_lossless, distribution_target, peaky_target, sampled_joint
from specdec.verify import get_policy
from tests.test_scheduling import random_dspark

DRAFT, SKIP = True, False
# Runs of 2 skipped rounds between drafted ones, then a run longer than the catch-up buffer (the drafter catches
# up within it and after it), then drafted rounds back to back.
PATTERN = (SKIP, SKIP, DRAFT, SKIP, SKIP, DRAFT) + (SKIP,) * (CATCH_UP + 5) + (DRAFT, DRAFT, SKIP, DRAFT)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Counts:
    rounds: jax.Array  # int32 [] loop iterations so far (drafted or not)
    drafted: jax.Array  # int32 [] iterations that drafted
    skipped: jax.Array  # int32 [] iterations that skipped the draft


@dataclasses.dataclass(frozen=True)
class SkipPattern(Scheduler):
    """Draft and verify every node (True) or skip the draft (False) by `pattern` over the loop's iterations,
    repeated: a scheduler written against the protocol alone (specdec/scheduler.py); its decisions depend on the
    round count only, so sampled verification stays exact."""

    kind: ClassVar[str] = "skip_pattern"
    may_skip: ClassVar[bool] = True
    pattern: tuple[bool, ...] = PATTERN
    label: str = ""  # a distinct value compiles a loop of its own (a mutant under test)

    def verify_widths(self, num_draft_tokens, buckets):
        return (0, num_draft_tokens)

    def init_state(self, batch, num_nodes, classes, measured):
        return Counts(*[jnp.zeros((), jnp.int32) for _ in range(3)])

    def plan(self, spec, state):
        drafts = jnp.asarray(self.pattern)[state.sched.rounds % len(self.pattern)]
        return drafts.astype(jnp.int32)

    def refine(self, spec, state, draft, planned, drafted):
        keep = draft.valid & drafted
        c = state.sched
        counts = Counts(rounds=c.rounds + 1, drafted=c.drafted + drafted, skipped=c.skipped + ~drafted)
        return dataclasses.replace(draft, valid=keep), counts

    def skipped(self, spec, state):
        c = state.sched
        return dataclasses.replace(c, rounds=c.rounds + 1, skipped=c.skipped + 1)

    def metrics(self, spec, sched):
        return {"skipped_drafts": int(sched.skipped), "width_rounds": [int(sched.skipped), int(sched.drafted)]}


def noisy(params, seed, scale=0.05):
    """Random weights everywhere (init leaves norms at exactly 1 and heads at 0), so every input matters."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: x + jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype)
                        if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def random_eagle3(target, k=3, tree=False):
    task = eagle3.make_task(target, ttt_steps=1)
    params, buffers = task.init(jax.random.PRNGKey(0), np.ones(target.cfg.vocab_size))
    tree_args = (2, 2) if tree else ()
    return eagle3.Eagle3Drafter.from_trained(task.arch, noisy(params, 1), buffers, target, k, *tree_args)


def random_dflash(target, k=3):
    task = dflash.make_task(target, num_layers=1, block_size=k, taps=[1])
    params, buffers = task.init(jax.random.PRNGKey(0), None)
    return dflash.DFlashDrafter.from_trained(task.arch, noisy(params, 1), buffers, target, k)


def random_medusa(target, k=3):
    task = medusa.make_task(target, num_heads=k)
    params, _ = task.init(jax.random.PRNGKey(0), None)
    return medusa.MedusaDrafter.from_trained(task.arch, noisy(params, 1), target, k)


def random_draft_lm(target, k=3):
    """Another model sharing the target's vocabulary (what `draft_lm` loads from a checkpoint)."""
    small = random_target(target.cfg.replace(num_layers=1, name="draft"), seed=7, scale=0.35)
    return DraftLMDrafter(small.cfg, small.params, k, name="draft_lm")


# Every drafter the registry offers (trained ones with random weights), and the variants whose state or catch-up
# differs: token trees, and the hybrid over a drafter with state.
DRAFTERS = {
    "ngram": lambda t: create_drafter("ngram", t, 4, max_ngram=2),
    "suffix": lambda t: create_drafter("suffix", t, 4),
    "self_spec": lambda t: create_drafter("self_spec", t, 3, num_layers=1),
    "self_spec_tree": lambda t: create_drafter("self_spec", t, 4, num_layers=1, tree_top_k=2, tree_depth=2),
    "draft_lm": random_draft_lm,
    "eagle3": random_eagle3,
    "eagle3_tree": lambda t: random_eagle3(t, 4, tree=True),
    "medusa": random_medusa,
    "dflash": random_dflash,
    "dspark": random_dspark,
    "hybrid": lambda t: HybridDrafter(random_eagle3(t), NgramDrafter(3, max_ngram=2), 2),
}


def test_every_registered_drafter_is_covered():
    # prompt_lookup: the n-gram drafter's other name; distilled_lm: a trained DraftLMDrafter (drafters/distilled_lm.py
    # builds one from its checkpoint), whose catch-up draft_lm's one-layer DraftLMDrafter runs
    aliases = {"prompt_lookup", "distilled_lm"}
    assert set(available()) - aliases <= {name.removesuffix("_tree") for name in DRAFTERS}, available()


@pytest.fixture(scope="module")
def target():
    return peaky_target(3)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_equals_ar_with_skipped_rounds(target, name):
    """Batch 1, then 3 rows of prompt lengths 8, 4 and 11 (rows accept differently, so a drafted round finds
    each row's drafter a different number of tokens behind)."""
    drafter = DRAFTERS[name](target)
    policy = "greedy_tree" if drafter.kind == "tree" else "greedy_chain"
    for prompts in (PROMPTS[2:3], PROMPTS[:3]):
        ar = generate(target, prompts, max_new_tokens=48)
        out = speculative_generate(target, drafter, prompts, policy=policy, max_new_tokens=48,
                                   scheduler=SkipPattern())
        assert out.tokens == ar.tokens, (name, len(prompts))
        skipped, drafted = out.metrics.width_rounds
        assert skipped >= CATCH_UP + 9 and drafted >= 3, out.metrics.width_rounds


# ---------------------------------------------------------------------------------------------------------
# The state after a catch-up is the state of a drafter that drafted every round
# ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class VerifyFirst(SkipPattern):
    """Draft in every round, but verify the draft of the first round only: the reference a skipping drafter must
    match (the tokens committed are the same as with the first round verified and the rest skipped)."""

    kind: ClassVar[str] = "verify_first"
    pattern: tuple[bool, ...] = (DRAFT,)

    def refine(self, spec, state, draft, planned, drafted):
        first = state.sched.rounds == 0
        cut, counts = super().refine(spec, state, draft, planned, drafted)
        return dataclasses.replace(cut, valid=cut.valid & first), counts


def loop_start(target, drafter, prompts, scheduler, limit):
    """(the loop's static spec, its state after prefill) with per-row token limits `limit` and no EOS."""
    n = drafter.num_draft_tokens
    policy = get_policy("greedy_tree" if drafter.kind == "tree" else "greedy_chain")
    spec = engine.LoopSpec(cfg=target.cfg, forward=target.forward, drafter=drafter, policy=policy, sampling=GREEDY,
                           eos_ids=(), scheduler=scheduler, verify_widths=scheduler.verify_widths(n, None))
    tokens, lengths = pad_prompts(prompts, 0)
    limit = np.broadcast_to(np.asarray(limit, np.int32), (len(prompts),))
    capacity = cache_capacity(lengths, int(limit.max()), extra=n + 1)
    state = engine.start(spec, target, drafter, target.init_cache(len(prompts), capacity), tokens, lengths,
                         capacity, jnp.asarray(limit), 0, sched_state=scheduler.init_state(len(prompts), n, 1, None))
    return spec, state


def committed(dstate):
    """The drafter state's leaves, with every KV cache cut to the slots that hold committed positions (past them:
    drafts, or a catch-up's padding), as NumPy arrays."""
    out = []
    for leaf in jax.tree.leaves(dstate, is_leaf=lambda x: isinstance(x, KVCache)):
        if not isinstance(leaf, KVCache):
            out.append(np.asarray(leaf))
            continue
        lengths = np.asarray(leaf.lengths)
        out.append(lengths)
        for x in jax.tree.leaves((leaf.k, leaf.v)):
            seq_axis, batch_axis = KVCache.seq_axis(x), KVCache.batch_axis(x)
            slot = np.arange(x.shape[seq_axis]).reshape([-1 if a == seq_axis else 1 for a in range(x.ndim)])
            row = lengths.reshape([-1 if a == batch_axis else 1 for a in range(x.ndim)])
            out.append(np.where(slot < row, np.asarray(x), 0.0))
    return out


def skipped_and_reference(target, drafter, rounds=CATCH_UP + 5, label=""):
    """For 3 rows of different prompt lengths: a first round that verifies its whole draft (rows accept
    differently), then `rounds` rounds of one token each, skipped (the drafter catches up) or drafted and verified
    not at all (the reference: what a drafter that cannot be skipped did). Each row's limit ends it exactly there.
    Returns per run (committed tokens, the proposal's q at temperature 1 from the final state, the drafter state
    after that proposal with its caches cut to their committed slots)."""
    prompts = PROMPTS[:3]
    spec, state = loop_start(target, drafter, prompts, VerifyFirst(), 10_000)
    draft, state = engine._jit_propose(spec, drafter.params, state)
    state, _, _ = engine._jit_verify(spec, target.params, state, draft)
    limit = np.asarray(state.num_new) + rounds  # tokens after the first round, then `rounds` more
    sampling = SamplingParams(temperature=1.0)
    propose = jax.jit(lambda p, s, c: drafter.propose(p, s, c, sampling, jax.random.PRNGKey(5)))
    out = []
    for sched in (SkipPattern(pattern=(DRAFT,) + (SKIP,) * rounds, label=label), VerifyFirst(label=label)):
        spec, state = loop_start(target, drafter, prompts, sched, limit)
        state = engine.compiled_loop(spec, target.params, drafter.params, state)
        skipped, drafted = sched.metrics(spec, state.sched)["width_rounds"]
        assert (skipped, drafted) == ((rounds, 1) if sched.kind == "skip_pattern" else (0, rounds + 1))
        ctx = RoundContext(seq=state.seq, seq_len=state.seq_len, done=jnp.zeros_like(state.done), cache=state.cache)
        proposal, dstate = propose(drafter.params, state.drafter_state, ctx)
        seq = [row[:n].tolist() for row, n in zip(np.asarray(state.seq), np.asarray(state.seq_len))]
        out.append((seq, np.asarray(proposal.probs), committed(dstate)))
    return out


def same_state(a, b) -> bool:
    (seq_a, q_a, state_a), (seq_b, q_b, state_b) = a, b
    assert seq_a == seq_b  # the same tokens committed
    return np.allclose(q_a, q_b, atol=1e-5) and all(
        x.shape == y.shape and np.allclose(x, y, atol=1e-4) for x, y in zip(state_a, state_b))


STATEFUL = ["draft_lm", "self_spec", "eagle3", "dspark"]


@pytest.mark.parametrize("name", STATEFUL)
def test_catch_up_leaves_the_state_of_a_drafter_that_drafted_every_round(target, name):
    """After a run of CATCH_UP + 5 skipped rounds (the drafter catches up within it and after it), the drafter's
    state (its caches' committed slots, its features) and its next proposal equal those of the drafter that
    drafted in every one of those rounds."""
    drafter = DRAFTERS[name](target)
    skipped, reference = skipped_and_reference(target, drafter)
    assert same_state(skipped, reference), name


def test_a_catch_up_that_misses_the_last_skipped_token_is_caught(target, monkeypatch):
    """Negative controls for the test above: a catch-up that leaves out the last skipped token changes the state
    and the proposal, for a drafter that catches up from the target's taps (the engine's replay, EAGLE-3) and for
    one that catches up from the committed tokens (its own replay, a draft LM)."""
    real_catch_up, real_replay = engine.catch_up, DraftLMDrafter.replay

    def drops_last_tap(spec, dparams, state):  # the last recorded round's taps never reach the drafter
        taps = state.pending_taps.at[:, :, jnp.maximum(state.pending - 1, 0)].set(0.0)
        return real_catch_up(spec, dparams, dataclasses.replace(state, pending_taps=taps))

    def stops_one_short(self, params, cache, ctx, upto):
        return real_replay(self, params, cache, ctx, upto - 1)

    monkeypatch.setattr(engine, "catch_up", drops_last_tap)
    skipped, reference = skipped_and_reference(target, DRAFTERS["eagle3"](target), label="mutant")
    assert not same_state(skipped, reference)
    monkeypatch.undo()
    monkeypatch.setattr(DraftLMDrafter, "replay", stops_one_short)
    skipped, reference = skipped_and_reference(target, DRAFTERS["draft_lm"](target), label="mutant")
    assert not same_state(skipped, reference)


def test_self_speculation_drafts_from_the_targets_cache_what_its_own_cache_gives(target):
    """Self-speculation's chain keeps no cache: the target's holds its layers' K/V of the committed positions. Its
    drafts equal those of the same model with a cache of its own that catches up on every token (the same accept
    lengths, round by round, with skipped rounds between), and it has no state to carry."""
    shared = create_drafter("self_spec", target, 3, num_layers=1)
    own = DraftLMDrafter(shared.cfg, shared.params, 3, name="self_spec")
    assert shared.shares_target_cache and not own.shares_target_cache
    outs = [speculative_generate(target, d, PROMPTS[:3], max_new_tokens=40, scheduler=SkipPattern())
            for d in (shared, own)]
    assert outs[0].tokens == outs[1].tokens == generate(target, PROMPTS[:3], max_new_tokens=40).tokens
    assert outs[0].accept_lengths == outs[1].accept_lengths and outs[0].metrics.accepted_draft_tokens > 0


# ---------------------------------------------------------------------------------------------------------
# Sampled output, and the adaptive width
# ---------------------------------------------------------------------------------------------------------

def test_sampled_output_follows_the_target_with_skipped_rounds():
    """specdec/testing.py's exact check of the engine's output law (9 tokens at T=0.7 with top-k and top-p,
    rejection sampling) with DSpark skipped and resumed on a fixed pattern: its catch-up replays the skipped
    rounds' taps, and its sampled drafts' q must still be exact. NUM_SAMPLES rows: the size whose first-token power
    test_testing checks (>= 0.9 against a TV 0.03 shift). (A draft LM skipped by the adaptive width is in
    tests/test_adaptive.py's distribution test.)"""
    target = distribution_target()
    sched = SkipPattern(pattern=(SKIP, DRAFT, SKIP, DRAFT, DRAFT))
    counts, impossible, m = sampled_joint(target, random_dspark(target), "rejection_chain",
                                          num_samples=NUM_SAMPLES, scheduler=sched)
    skipped, drafted = m.width_rounds
    assert skipped > 0 and drafted > 0, m.width_rounds
    assert_lossless(counts, impossible, m, num_samples=NUM_SAMPLES)


@pytest.mark.parametrize("name", ["draft_lm", "self_spec", "eagle3"])
def test_the_adaptive_width_skips_drafters_with_state(target, name):
    """Round costs under which a verified round rarely pays: the adaptive width now chooses width 0 for the
    drafters that could not be skipped before (the draft LMs, EAGLE-3), and the output is still AR's."""
    drafter = DRAFTERS[name](target)
    ar = generate(target, PROMPTS, max_new_tokens=40)
    sched = AdaptiveWidth(round_costs=(1.0, 2.5, 3.0), draft_cost=0.5, explore_every=4)  # widths 0, 1, 3
    out = speculative_generate(target, drafter, PROMPTS, max_new_tokens=40, scheduler=sched)
    assert out.tokens == ar.tokens
    m = out.metrics
    assert m.skipped_drafts > 0 and m.width_rounds[0] >= m.skipped_drafts, (m.width_rounds, m.skipped_drafts)
    assert sum(m.width_rounds[1:]) > 0, m.width_rounds  # exploring rounds verify
