"""Verification-length schedulers: golden cases of the three kinds, the DSpark paper's appendix-A case (lossless
with the prefix scheduler's early stop, visibly biased without it), the whole engine's sampled output still
following the target distribution with DSpark drafts under every scheduler, and the cached SPS profile."""

import functools
import itertools
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drafters import create_drafter, dspark
from drafters.draft_lm import DraftLMDrafter, _prefix_layers
from specdec import costs
from specdec.config import load_config
from specdec.drafter import Draft
from specdec.engine import speculative_generate
from specdec.generate import generate
from specdec.sampling import SamplingParams
from specdec.scheduler import FixedWidth
from specdec.scheduling import PrefixSchedule, ThresholdSchedule, admitted_lengths, prefix_theta, sps
from specdec.testing import (MUTANT_ROWS, NUM_SAMPLES, PROMPT, assert_biased, assert_lossless, distribution_target,
                             sampled_joint)
from specdec.verify import get_policy

LINEAR = ((1, 1.0), (64, 1.0 / 1.63))  # step time 1 + 0.01 (n - 1): SPS falls slowly with the token batch


def confidence_state(confidence, sched=()):
    """A loop state and spec, as the schedulers read them, whose drafter's confidence is `confidence` [B, N]
    (`sched`: the scheduler's state)."""
    drafter = types.SimpleNamespace(draft_confidence=lambda dstate: dstate)
    spec = types.SimpleNamespace(drafter=drafter, verify_widths=())
    return types.SimpleNamespace(spec=spec, drafter_state=jnp.asarray(confidence), sched=sched,
                                 done=jnp.zeros(confidence.shape[0], bool))


def test_fixed_and_threshold_lengths():
    conf = jnp.asarray([[0.9, 0.8, 0.5, 0.2], [0.4, 0.3, 0.1, 0.0], [1.0, 1.0, 1.0, 1.0]])
    active = jnp.ones(3, bool)
    draft = Draft.chain(jnp.ones((3, 4), jnp.int32))
    state = confidence_state(conf)
    assert FixedWidth().refine(None, state, draft, 0, True)[0] is draft
    assert ThresholdSchedule(threshold=0.5).lengths(conf, active).tolist() == [3, 0, 4]
    d, _ = ThresholdSchedule(threshold=0.5).refine(state.spec, state, draft, 0, True)
    assert d.valid.tolist() == [[True, True, True, False], [False] * 4, [True] * 4]
    with pytest.raises(ValueError, match="threshold"):
        ThresholdSchedule(threshold=1.5)
    with pytest.raises(ValueError, match="profile"):
        PrefixSchedule(profile=((4, 1.0), (2, 1.0)))


def test_prefix_scheduler_golden():
    """Two rows; step time 1 + 0.25 (n - 2) from n = 2 tokens (SPS = 1 / that). By hand: Theta(0) = 2;
    admit (0,0) a=.9: 2.9 / 1.25 = 2.32; (1,0) a=.8: 3.7 / 1.5 = 2.47; (0,1) a=.6: 4.3 / 1.75 = 2.457 < 2.47 ->
    STOP (the later (0,2) a=.55 would give 4.85 / 2 = 2.425, and nothing is looked at after the stop)."""
    profile = tuple((n, 1.0 / (1 + 0.25 * (n - 2))) for n in range(2, 12))
    s = PrefixSchedule(profile=profile)
    conf = jnp.asarray([[0.9, 0.6, 0.55], [0.8, 0.1, 0.05]])
    assert s.lengths(conf, jnp.ones(2, bool)).tolist() == [1, 1]
    # cheap verification (flat SPS): everything is admitted; a done row is never admitted and not counted
    flat = PrefixSchedule(profile=((1, 1.0), (100, 1.0)))
    assert flat.lengths(conf, jnp.ones(2, bool)).tolist() == [3, 3]
    assert flat.lengths(conf, jnp.asarray([True, False])).tolist() == [3, 0]
    # the lengths always cover a prefix of each row, in confidence order
    key = jax.random.PRNGKey(0)
    for i in range(5):
        c = jnp.cumprod(jax.random.uniform(jax.random.fold_in(key, i), (6, 5)), axis=1)
        lengths = np.asarray(PrefixSchedule(profile=LINEAR).lengths(c, jnp.ones(6, bool)))
        admitted = np.arange(5)[None] < lengths[:, None]
        cnp = np.asarray(c)
        if admitted.any() and (~admitted).any():
            assert cnp[admitted].min() >= cnp[~admitted].max() - 1e-7


# ---------------------------------------------------------------------------------------------------------
# Appendix A: the early stop is what keeps confidence scheduling lossless
# ---------------------------------------------------------------------------------------------------------

APPENDIX_SAMPLES = 200_000
APPENDIX_PROFILE = ((1, 1.0), (2, 0.7), (3, 0.6))  # SPS(1), SPS(2), SPS(3)


def biased_lengths(confidence, active, profile):
    """The prefix scheduler WITHOUT its early stop (the admission count with the best Theta overall, looking past
    non-improvements): the rule appendix A shows is biased, built here from the library's own Theta."""
    theta, order = prefix_theta(confidence, active, lambda n: sps(profile, n))
    return admitted_lengths(order, jnp.argmax(theta), confidence.shape)


@functools.partial(jax.jit, static_argnames=("early_stop",))
def _appendix_run(key, c1_values, *, early_stop: bool):
    s = PrefixSchedule(profile=APPENDIX_PROFILE)
    profile = jnp.asarray(APPENDIX_PROFILE, jnp.float32)
    length_of = s.lengths if early_stop else functools.partial(biased_lengths, profile=profile)
    k1, k2 = jax.random.split(key)
    u = jax.random.uniform(k1, (APPENDIX_SAMPLES, 3))
    x = (u[:, :2] >= 0.5).astype(jnp.int32)  # x1, x2 ~ q
    c1 = c1_values[jnp.minimum((u[:, 2] * 2).astype(jnp.int32), 1)]
    c2 = jnp.where(x[:, 0] == 0, 1.0, 0.0)
    conf = jnp.stack([c1, c1 * c2], axis=1)  # prefix survival
    lengths = jax.vmap(lambda c: length_of(c[None], jnp.ones(1, bool))[0])(conf)
    q = jnp.full((APPENDIX_SAMPLES, 2, 2), 0.5)
    draft = Draft.chain(x, probs=q, valid=jnp.arange(2)[None] < lengths[:, None])
    logits = jnp.log(jnp.broadcast_to(jnp.asarray([[0.7, 0.3], [0.5, 0.5], [0.5, 0.5]]), (APPENDIX_SAMPLES, 3, 2)))
    out = get_policy("rejection_chain").verify(draft, logits, SamplingParams(temperature=1.0), k2)  # rows: requests
    return jnp.mean(out.tokens[:, 0] == 0), jnp.mean(lengths > 0)


def appendix_first_token(early_stop: bool, c1_values, seed: int = 0) -> tuple[float, float]:
    """Target p = (0.7, 0.3), draft q = (0.5, 0.5) for the first token; the confidence of the first draft is c1
    (one of the two `c1_values` at random, independent of the draft), of the second 1 if x1 = 0 else 0 (it reads
    x1, like DSpark's). One request per sample; the prefix scheduler picks its verify length, rejection sampling
    verifies. Returns (frequency of first committed token 0, fraction of requests that verified a draft)."""
    c1 = jnp.asarray(list(c1_values) * (2 // len(c1_values)), jnp.float32)
    freq, verified = jax.device_get(_appendix_run(jax.random.PRNGKey(seed), c1, early_stop=early_stop))
    return float(freq), float(verified)


def test_appendix_a_lossless_with_early_stop_biased_without():
    se = np.sqrt(0.7 * 0.3 / APPENDIX_SAMPLES)  # ~0.001
    # the paper's case: c1 = 0.4. Without the stop, x1 = 0 makes verifying 2 tokens worth it, x1 = 1 verifying
    # none: the first token is 0 with probability 0.5 + 0.5 * 0.7 = 0.85.
    freq, _ = appendix_first_token(False, [0.4])
    assert abs(freq - 0.85) < 6 * se, freq
    freq, _ = appendix_first_token(True, [0.4])
    assert abs(freq - 0.7) < 6 * se, freq
    # c1 in {0.4, 0.9}: with the stop the first draft IS verified half of the time, and the output is exact
    freq, verified = appendix_first_token(True, [0.4, 0.9])
    assert 0.45 < verified < 0.55
    assert abs(freq - 0.7) < 6 * se, freq
    freq, _ = appendix_first_token(False, [0.4, 0.9])
    assert abs(freq - 0.775) < 6 * se, freq  # biased: 0.5 * 0.85 + 0.5 * 0.7


# ---------------------------------------------------------------------------------------------------------
# The whole engine with DSpark drafts under each scheduler
# ---------------------------------------------------------------------------------------------------------

def random_dspark(target, k=3, seed=0):
    """An untrained DSpark with every head clearly active (nonzero Markov head, spread confidences)."""
    task = dspark.make_task(target, num_layers=1, block_size=k, taps=[1], markov_rank=4)
    params, buffers = task.init(jax.random.PRNGKey(seed), None)
    rng = np.random.default_rng(seed + 1)
    params["markov"]["w2"] = jnp.asarray(rng.standard_normal(params["markov"]["w2"].shape), jnp.float32)
    params["conf"]["w"] = jnp.asarray(2.0 * rng.standard_normal(params["conf"]["w"].shape), jnp.float32)
    params["conf"]["b"] = jnp.asarray(1.0)
    return dspark.DSparkDrafter.from_trained(task.arch, params, buffers, target, k)


SCHEDULERS = {
    "fixed": FixedWidth(),
    "threshold": ThresholdSchedule(threshold=0.4),
    # token batches of NUM_SAMPLES rows x 1..4 tokens; verification gets slower past one token per row
    "prefix": PrefixSchedule(profile=((1, 1.0), (NUM_SAMPLES, 1.0), (4 * NUM_SAMPLES, 0.4))),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_engine_sampled_output_is_target_distribution_with_dspark(name):
    """specdec/testing.py's check (`assert_lossless`: the joint law of 9 tokens at T=0.7 with top-k and top-p
    vs exact enumeration, chi-square and TV) with DSpark drafts (sequential sampling, exact q) and the
    scheduler deciding the verify lengths."""
    target = distribution_target()
    counts, impossible, m = sampled_joint(target, random_dspark(target), "rejection_chain",
                                          scheduler=SCHEDULERS[name])
    if name != "fixed":  # the scheduler really shortened some rows' drafts, not all of them
        assert 0 < m.proposed_draft_tokens < 3 * m.rounds, (m.proposed_draft_tokens, m.rounds)
    assert_lossless(counts, impossible, m)


class ConfidenceReadsItsToken(DraftLMDrafter):
    """Breaks the draft_confidence contract: self-speculation (sampled drafts with spread-out q; with a
    near-deterministic q skipping verification would change nothing) whose position-j confidence is high
    exactly when x_j is q_j's most likely token, i.e. it reads the token it scores."""

    has_confidence = True

    def init(self, params, prompt, capacity):
        return super().init(params, prompt, capacity), jnp.ones((prompt.tokens.shape[0], self.num_draft_tokens))

    def propose(self, params, state, ctx, sampling, key):
        draft, cache = super().propose(params, state[0], ctx, sampling, key)
        mode = draft.tokens == jnp.argmax(draft.probs, axis=-1)
        return draft, (cache, jnp.cumprod(jnp.where(mode, 0.9, 0.1), axis=-1))

    def draft_confidence(self, state):
        return state[1]


def test_confidence_that_reads_its_token_fails_the_distribution_test():
    """Negative control for the contract of `Drafter.draft_confidence`: under the threshold scheduler such a
    confidence verifies x_j only when x_j is q's mode (else the target samples position j itself), and the
    output law is visibly not the target's (at MUTANT_ROWS = 2000 rows: whole-sequence p 7e-155)."""
    target = distribution_target()
    cfg = target.cfg.replace(num_layers=1)  # self-speculation from the target's first layer
    bad = ConfidenceReadsItsToken(cfg, _prefix_layers(target.params, 1), 2, name="reads_its_token")
    counts, impossible, m = sampled_joint(target, bad, "rejection_chain", MUTANT_ROWS,
                                          scheduler=SCHEDULERS["threshold"])
    assert 0 < m.proposed_draft_tokens < 2 * m.rounds  # it did cut drafts by the token
    assert_biased(counts, impossible)


def test_scheduler_makes_the_confidence_non_increasing():
    """A confidence that rises along j is read as its cumulative minimum: the prefix scheduler admits positions
    in confidence order, which is a prefix of the draft only for non-increasing values. Here the raw values
    would admit row 0's positions 1 and 2 (0.9) before its position 0 (0.2) and count them as a length of 2."""
    s = PrefixSchedule(profile=((1, 1.0), (2, 1.0), (4, 0.5)))
    rising = jnp.asarray([[0.2, 0.9, 0.9]])
    draft = Draft.chain(jnp.ones((1, 3), jnp.int32))
    active = jnp.ones(1, bool)
    assert s.lengths(rising, active).tolist() != s.lengths(jax.lax.cummin(rising, axis=1), active).tolist()
    profile = s.init_state(1, 3, 1, s.profile)
    state, floor = confidence_state(rising, profile), confidence_state(jax.lax.cummin(rising, axis=1), profile)
    assert s.refine(state.spec, state, draft, 0, True)[0].valid.tolist() == \
        s.refine(floor.spec, floor, draft, 0, True)[0].valid.tolist()


def test_padded_cost_model_counts_the_bucket_of_the_longest_row():
    """With the engine's verify widths the prefix scheduler prices B x (1 + bucket) tokens: admitting row 0's
    second token would move both rows to the 3-node bucket (8 tokens, twice the step time), so it stops at
    [1, 0]; the ragged model (2 + admitted tokens) admits it."""
    step = ((1, 1.0), (4, 1.0), (8, 0.5))  # step time 1 up to 4 tokens, 2 at 8
    conf = jnp.asarray([[0.9, 0.6, 0.5], [0.3, 0.2, 0.1]])
    active = jnp.ones(2, bool)
    assert PrefixSchedule(profile=step).lengths(conf, active, verify_widths=(0, 1, 3)).tolist() == [1, 0]
    assert PrefixSchedule(profile=step).lengths(conf, active).tolist() == [2, 0]


@pytest.mark.parametrize("buckets", [None, "auto"])
def test_greedy_with_prefix_scheduler_equals_ar(buckets):
    target = distribution_target()
    drafter = random_dspark(target, k=3, seed=2)
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:]]
    ar = generate(target, prompts, max_new_tokens=12)
    out = speculative_generate(target, drafter, prompts, max_new_tokens=12, scheduler=PrefixSchedule(profile=LINEAR),
                               verify_buckets=buckets)
    assert out.tokens == ar.tokens


def test_profile_is_measured_once_and_cached(tmp_path, monkeypatch):
    target = distribution_target()
    path = tmp_path / "sps.json"
    profile = costs.load_or_measure_profile(target, 4, path, log=lambda m: None)
    assert [n for n, _ in profile] == [1, 2, 4] and all(s > 0 for _, s in profile)
    assert all(a[1] >= b[1] for a, b in itertools.pairwise(profile))  # bigger batches are never faster
    assert len(json.loads(path.read_text())) == 1

    def fail(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(costs, "measure_sps", fail)
    assert costs.load_or_measure_profile(target, 4, path) == profile
    # the engine's first run of a prefix scheduler asks for the profile of its largest token batch: cached
    s = load_config({"scheduler": {"kind": "prefix", "profile_path": str(path)}}).scheduler
    assert isinstance(s, PrefixSchedule) and s.profile == ()
    probe = types.SimpleNamespace(batch=1, drafter=types.SimpleNamespace(num_draft_tokens=3), target=target)
    assert s.prepare(probe) == profile
    assert load_config({"scheduler": {"kind": "fixed"}}).scheduler == FixedWidth()
    assert load_config({"scheduler": {"kind": "threshold", "threshold": 0.3}}).scheduler.threshold == 0.3


def test_scheduler_needs_a_confidence_drafter():
    target = distribution_target()
    with pytest.raises(ValueError, match="draft confidences"):
        speculative_generate(target, create_drafter("ngram", target, 3), [PROMPT], max_new_tokens=4,
                             scheduler=SCHEDULERS["threshold"])
