"""The speculative engine is lossless: greedy output equals AR token for token, sampled output follows the
target distribution, and stopping (EOS inside an accepted draft, max_new_tokens) is exact."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drafters import create_drafter
from drafters.draft_lm import DraftLMDrafter, DraftLMTreeDrafter
from specdec.drafter import Draft
from specdec.engine import speculative_generate
from specdec.generate import ar_metrics, generate
from specdec.models.config import tiny_config
from specdec.sampling import GREEDY, SamplingParams
from specdec.scheduler import bucket_widths
from specdec.target import random_target
from specdec.testing import (MUTANT_ROWS, NUM_SAMPLES, PROMPTS, assert_biased, assert_draft_matches_its_q,
                             assert_lossless, distribution_target, draft_fit, peaky_target, sampled_joint)
from specdec.verify import get_policy


def drafters_for(target):
    """Chain drafters of every kind: deterministic lookup, a weak draft LM, and a perfect one."""
    return {
        "ngram": create_drafter("ngram", target, 4, max_ngram=2),
        "self_spec": create_drafter("self_spec", target, 3, num_layers=1),
        "oracle_lm": DraftLMDrafter(target.cfg, target.params, 4, name="oracle_lm"),
    }


@pytest.mark.parametrize("policy", ["greedy_chain", "rejection_chain", "greedy_tree", "multidraft_tree"])
def test_greedy_speculative_equals_ar(policy):
    """Many random models x every chain drafter, batch 4 with ragged acceptance and batch 1.
    (Drafters hash by settings, so each (drafter, policy, shape) compiles once across seeds; three models per
    policy, as in the dynamic-tree test below, keep the suite near its 10-minute budget.)"""
    for seed in range(3):
        target = peaky_target(seed)
        ar = generate(target, PROMPTS, max_new_tokens=17)
        for name, drafter in drafters_for(target).items():
            batch = speculative_generate(target, drafter, PROMPTS, policy=policy, max_new_tokens=17)
            assert batch.tokens == ar.tokens, (seed, name, policy)
            single = speculative_generate(target, drafter, PROMPTS[1:2], policy=policy, max_new_tokens=17)
            assert single.tokens[0] == ar.tokens[1], (seed, name, policy)


@pytest.mark.parametrize("policy", ["greedy_tree", "multidraft_tree"])
def test_dynamic_tree_drafts_are_lossless_and_compacted(policy):
    """EAGLE-2 style trees from a draft LM: greedy output equals AR, so compaction kept the right K/V."""
    for seed in range(3):
        target = peaky_target(seed)
        ar = generate(target, PROMPTS, max_new_tokens=17)
        for drafter in (create_drafter("self_spec", target, 6, num_layers=1, tree_top_k=2, tree_depth=3),
                        DraftLMTreeDrafter(target.cfg, target.params, 8, top_k=2, depth=4, name="oracle_tree")):
            out = speculative_generate(target, drafter, PROMPTS, policy=policy, max_new_tokens=17)
            assert out.tokens == ar.tokens, (seed, drafter.name, policy)


def tree_scores_at_the_context_edge(target, drafter, capacity: int, monkeypatch) -> np.ndarray:
    """The candidate scores of one tree proposal right after prefill, from a context as long as the engine
    allows in `capacity` slots (P prompt tokens + the first token = 64 - N - 2, the engine's bound for 64),
    captured where the drafter hands them to `trees.select_dynamic_tree` (and returned from the same jit)."""
    from specdec import trees
    from specdec.drafter import PromptInfo, RoundContext
    from specdec.generate import pad_prompts, prefill

    length = 64 - drafter.num_draft_tokens - 3
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 200, length)]
    tokens, lengths = (jnp.asarray(x) for x in pad_prompts([prompt], 0))
    logits, taps, _ = prefill(target.params, target.init_cache(1, capacity), tokens, lengths,
                              forward=target.forward, cfg=target.cfg, taps=drafter.taps)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    state = drafter.init(drafter.params, PromptInfo(tokens, lengths, taps, first), capacity)
    seq = jnp.zeros((1, capacity), jnp.int32).at[0, :length].set(jnp.asarray(prompt)).at[0, length].set(first[0])
    seen, select = [], trees.select_dynamic_tree
    monkeypatch.setattr(trees, "select_dynamic_tree", lambda t, p, scores, n, **kw: seen.append(scores)
                        or select(t, p, scores, n, **kw))

    @jax.jit
    def scores(params, state, ctx):
        drafter.propose(params, state, ctx, GREEDY, jax.random.PRNGKey(0))
        return seen[-1]

    out = scores(drafter.params, state, RoundContext(seq, lengths + 1, jnp.zeros(1, bool)))
    monkeypatch.undo()
    return np.asarray(out)


def assert_tree_levels_fit_at_the_context_edge(target, drafter, monkeypatch):
    """At the longest context the engine allows in a 64-slot cache, a tree proposal scores its candidates as
    it does with room to spare (128 slots). A 3-wide, 5-deep expansion writes 12 nodes past the committed
    tokens, more than the 2 (N + 2) slots of the engine's slack plus the chain's N + 2 of draft-cache slack: a
    cache sized for the chain had its last level's writes shifted back over committed K/V (`write_rows`),
    and the deep scores changed."""
    assert drafter.num_draft_tokens == 2 and (drafter.top_k, drafter.depth) == (3, 5)
    edge = tree_scores_at_the_context_edge(target, drafter, 64, monkeypatch)
    roomy = tree_scores_at_the_context_edge(target, drafter, 128, monkeypatch)
    np.testing.assert_allclose(edge, roomy, rtol=1e-5, atol=1e-5)


def test_draft_lm_tree_levels_fit_at_the_context_edge(monkeypatch):
    target = peaky_target(3, eos_token_ids=())
    drafter = DraftLMTreeDrafter(target.cfg, target.params, 2, top_k=3, depth=5, name="oracle_tree")
    assert_tree_levels_fit_at_the_context_edge(target, drafter, monkeypatch)


def test_oracle_tree_with_every_candidate_accepts_full_depth():
    target = peaky_target(1, eos_token_ids=())
    drafter = DraftLMTreeDrafter(target.cfg, target.params, 14, top_k=2, depth=4, name="oracle_tree")
    out = speculative_generate(target, drafter, PROMPTS, policy="greedy_tree", max_new_tokens=21)
    assert out.tokens == generate(target, PROMPTS, max_new_tokens=21).tokens
    # depth 1 always accepted (wherever the verdict was committed: a max_new_tokens cut may leave no room)
    assert out.metrics.acceptance_by_position()["conditional"][0] == 1.0
    assert out.metrics.tau > 3.5


def test_host_stepped_loop_equals_compiled_loop(monkeypatch):
    """Same output and metrics; `on_round` sees every round, and its time is billed to nothing (a clock that
    only moves inside the callback leaves draft, verify and decode time at 0)."""
    from specdec import engine

    target = peaky_target(4)
    drafter = create_drafter("self_spec", target, 3, num_layers=1)
    a = speculative_generate(target, drafter, PROMPTS, max_new_tokens=12, compiled=True)
    seen, clock = [], [0.0]

    def on_round(draft, conf, result, active):
        clock[0] += 100.0
        seen.append((conf, int(np.sum(np.asarray(result.num_accepted)[np.asarray(active)])), int(np.sum(active))))

    monkeypatch.setattr(engine, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    b = speculative_generate(target, drafter, PROMPTS, max_new_tokens=12, compiled=False, on_round=on_round)
    assert a.tokens == b.tokens and a.accept_lengths == b.accept_lengths
    timing = ("prefill_seconds", "decode_seconds", "draft_seconds", "verify_seconds")
    counts = [{k: v for k, v in dataclasses.asdict(m).items() if k not in timing} for m in (a.metrics, b.metrics)]
    assert counts[0] == counts[1]
    # on_round saw every round: its active rows add up to the rounds, its accepted drafts bound the committed
    assert sum(n for _, _, n in seen) == b.metrics.rounds and all(c is None for c, _, _ in seen)
    assert sum(acc for _, acc, _ in seen) >= b.metrics.accepted_draft_tokens
    assert (b.metrics.draft_seconds, b.metrics.verify_seconds, b.metrics.decode_seconds) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="on_round needs the host-stepped loop"):
        speculative_generate(target, drafter, PROMPTS, max_new_tokens=12, on_round=print)


def test_narrow_verify_step_equals_the_full_step_on_its_positions():
    """`target_verify` with need=w runs only [root, w nodes] (the smallest width >= w) and pads back: its
    logits/taps equal the full step's on those positions, are 0 past them, and only those cache rows change."""
    from specdec import engine, trees
    from specdec.drafter import Draft

    target = peaky_target(8)
    drafter = types.SimpleNamespace(taps=(1, 2))  # what target_verify reads: the taps to return
    widths = bucket_widths(4, "auto")
    assert widths == (0, 1, 3, 4)
    spec = engine.LoopSpec(cfg=target.cfg, forward=target.forward, drafter=drafter, policy=None, sampling=None,
                           eos_ids=(), verify_widths=widths)
    cache = target.init_cache(2, 32).with_lengths(jnp.asarray([5, 9], jnp.int32))
    tokens = jnp.asarray([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], jnp.int32)
    mask, depth = trees.tree_attention(Draft.chain(tokens[:, 1:]).parents)
    positions = cache.lengths[:, None] + depth
    full = target.forward(target.params, target.cfg, cache, tokens, positions, mask, taps=drafter.taps)
    verify = jax.jit(lambda c, n: engine.target_verify(spec, target.params, c, tokens, positions, mask, n))
    for need, width in [(0, 0), (1, 1), (2, 3), (3, 3), (4, 4)]:
        out = verify(cache, jnp.asarray(need))
        t = width + 1
        # 1e-4: XLA:CPU blocks a product of 1 + W rows differently from one of N + 1 (one VM: 2.7e-5 apart)
        np.testing.assert_allclose(out.logits[:, :t], full.logits[:, :t], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(out.taps[:, :, :t], full.taps[:, :, :t], rtol=1e-4, atol=1e-4)
        assert not np.any(np.asarray(out.logits[:, t:])) and not np.any(np.asarray(out.taps[:, :, t:]))
        for row, start in enumerate([5, 9]):
            got, want = np.asarray(out.cache.k[0][row]), np.asarray(full.cache.k[0][row])
            np.testing.assert_allclose(got[:, start:start + t], want[:, start:start + t], rtol=1e-5, atol=1e-5)
            assert not np.any(got[:, start + t:])
    with pytest.raises(ValueError, match=r"verify.buckets.*\[0, 4\].*\[5\]"):
        bucket_widths(4, [1, 5])
    assert bucket_widths(4, None) == bucket_widths(4, "none") == ()
    assert bucket_widths(7, [2]) == (2, 7)


def test_bucketed_verify_is_lossless():
    """Narrow verify steps (n-gram misses leave rows with few or no valid nodes) change no output: greedy ==
    AR at batch 4 and 1 (rejection_chain at T=0 is greedy verification). A narrow step also verifies only the
    draft's prefix (its own noise draws), so sampled output is not the unbucketed loop's draw for draw: its
    law is checked at a narrow width in test_adaptive's distribution test; here, the rounds are the same."""
    target = peaky_target(9)
    drafter = create_drafter("ngram", target, 4, max_ngram=2)
    policy = "rejection_chain"
    ar = generate(target, PROMPTS, max_new_tokens=17)
    out = speculative_generate(target, drafter, PROMPTS, policy=policy, max_new_tokens=17, verify_buckets="auto")
    assert out.tokens == ar.tokens
    assert speculative_generate(target, drafter, PROMPTS[1:2], policy=policy, max_new_tokens=17,
                                verify_buckets=[0, 2]).tokens[0] == ar.tokens[1]
    sampling = SamplingParams(temperature=1.0)
    a = speculative_generate(target, drafter, PROMPTS, policy=policy, max_new_tokens=17, sampling=sampling, seed=5)
    b = speculative_generate(target, drafter, PROMPTS, policy=policy, max_new_tokens=17, sampling=sampling, seed=5,
                             verify_buckets="auto")
    assert b.tokens == speculative_generate(target, drafter, PROMPTS, policy=policy, max_new_tokens=17,
                                            sampling=sampling, seed=5, verify_buckets="auto").tokens
    assert [len(t) for t in b.tokens] == [len(t) for t in a.tokens] == [17] * len(PROMPTS)


def test_a_policy_object_brings_its_options_to_the_engine():
    """`policy` may be a `Policy` with options: typical acceptance with epsilon 0 accepts every token the target
    gives any probability, so at T=1 every verdict observed is an acceptance; with its default epsilon not."""
    target = peaky_target(9)
    drafter = create_drafter("ngram", target, 4, max_ngram=2)

    def conditional(policy):
        out = speculative_generate(target, drafter, PROMPTS, policy=policy, max_new_tokens=17,
                                   sampling=SamplingParams(temperature=1.0), seed=5)
        return [c for c in out.metrics.acceptance_by_position()["conditional"] if c == c]  # nan: never tested

    everything = conditional(get_policy("typical", epsilon=0.0))
    assert everything and everything == [1.0] * len(everything)
    assert min(conditional("typical")) < 1.0


def test_eos_inside_accepted_draft_ends_row_exactly_there():
    target = peaky_target(5, eos_token_ids=())
    free = generate(target, PROMPTS, max_new_tokens=16).tokens
    eos = free[0][6]  # a token the target itself emits at step 6 of row 0
    target = peaky_target(5, eos_token_ids=(eos,))
    ar = generate(target, PROMPTS, max_new_tokens=16)
    assert ar.tokens[0] == free[0][: free[0].index(eos) + 1]
    oracle = DraftLMDrafter(target.cfg, target.params, 5, name="oracle_lm")  # accepts everything
    out = speculative_generate(target, oracle, PROMPTS, max_new_tokens=16)
    assert out.tokens == ar.tokens
    # the oracle's drafts are always accepted (wherever a verdict was committed), and row 0 ended inside
    # its first round's accepted drafts: it committed fewer than the N + 1 tokens a full round does
    assert out.metrics.acceptance_by_position()["conditional"] == [1.0] * 5
    assert out.accept_lengths[0] == [len(ar.tokens[0]) - 1] and len(ar.tokens[0]) - 1 < 6


@pytest.mark.parametrize("max_new", [1, 2, 7, 11])
def test_max_new_tokens_respected_exactly_when_drafts_run_past_it(max_new):
    target = peaky_target(6, eos_token_ids=())
    oracle = DraftLMDrafter(target.cfg, target.params, 5, name="oracle_lm")
    out = speculative_generate(target, oracle, PROMPTS, max_new_tokens=max_new)
    assert [len(t) for t in out.tokens] == [max_new] * len(PROMPTS)
    assert out.tokens == generate(target, PROMPTS, max_new_tokens=max_new).tokens


def test_a_limit_per_prompt_ends_each_row_there_and_counts_the_idle_row_steps():
    """`max_new_tokens` per prompt: each row stops at its own limit (AR and speculative alike, outputs equal), and
    the metrics count the row-steps the batch spent on rows already finished (`idle_fraction`)."""
    target = peaky_target(6, eos_token_ids=())
    limits = [3, 11, 1, 7]
    ar = generate(target, PROMPTS, max_new_tokens=limits)
    assert [len(t) for t in ar.tokens] == limits
    assert ar.tokens == [generate(target, [p], max_new_tokens=n).tokens[0] for p, n in zip(PROMPTS, limits)]
    out = speculative_generate(target, create_drafter("ngram", target, 4), PROMPTS, max_new_tokens=limits)
    assert out.tokens == ar.tokens
    m, steps = out.metrics, max(map(len, out.accept_lengths))
    assert m.row_steps == len(PROMPTS) * steps and m.idle_fraction == pytest.approx(1 - m.rounds / m.row_steps)
    a = ar_metrics(ar)  # AR: the loop runs 10 steps (the longest row's 11 tokens), rows used 2 + 10 + 0 + 6
    assert (a.rounds, a.row_steps) == (18, 40) and a.idle_fraction == pytest.approx(1 - 18 / 40)
    with pytest.raises(ValueError, match="one per prompt"):
        generate(target, PROMPTS, max_new_tokens=[3, 4])


def test_ragged_acceptance_metrics_are_consistent():
    target = peaky_target(7)
    out = speculative_generate(target, create_drafter("ngram", target, 4), PROMPTS, max_new_tokens=20)
    m = out.metrics
    assert m.new_tokens == sum(len(t) for t in out.tokens)
    # every committed token after the prefill token is an accepted draft or the one target token of its round
    assert m.new_tokens - len(PROMPTS) == m.accepted_draft_tokens + m.rounds
    assert [sum(a) for a in out.accept_lengths] == [len(t) - 1 for t in out.tokens]
    assert sum(len(a) for a in out.accept_lengths) == m.rounds
    assert all(a >= b for a, b in zip(m.position_accepted, m.position_accepted[1:]))
    assert m.accepted_draft_tokens == sum(m.position_accepted)
    assert all(a <= e <= p for a, e, p in zip(m.position_accepted, m.position_eligible, m.position_proposed))
    assert m.position_proposed[0] < m.rounds  # n-gram misses: the per-position counts see unproposed rounds
    assert m.tau == pytest.approx(1 + sum(m.acceptance_by_position()["survival"]))


class ScriptedDrafter:
    """A host-side chain drafter that plays a script: in its r-th active round row b proposes `valid` nodes
    of which the first `correct` are the target's own greedy continuation (`oracle`, free of EOS) and the rest
    wrong, with confidences `conf` (for the threshold scheduler). Every round's outcome is then known."""

    def __new__(cls, oracle, script, num_draft_tokens=4, vocab=256):
        from specdec.drafter import Drafter

        class Scripted(Drafter):
            name, kind, jittable, has_confidence = "scripted", "chain", False, True

            def init(self, params, prompt, capacity):
                return {"round": [0] * len(oracle), "prompt": np.asarray(prompt.lengths).tolist(), "conf": None}

            def propose(self, params, state, ctx, sampling, key):
                n, done, seq_len = num_draft_tokens, np.asarray(ctx.done), np.asarray(ctx.seq_len)
                tokens, valid = np.zeros((len(oracle), n), np.int32), np.zeros((len(oracle), n), bool)
                conf = np.ones((len(oracle), n), np.float32)
                for b in range(len(oracle)):
                    if done[b]:
                        continue
                    v, c, cf = script[b][state["round"][b]]
                    at = seq_len[b] - state["prompt"][b]  # tokens generated so far
                    truth = oracle[b][at: at + n]
                    tokens[b] = [t if i < c else (t + 1) % vocab for i, t in enumerate(truth)]
                    valid[b, :v], conf[b] = True, cf
                    state["round"][b] += 1
                return Draft.chain(tokens, valid=valid), {**state, "conf": conf}

            def draft_confidence(self, state):
                return jnp.asarray(state["conf"])

        d = Scripted()
        d.num_draft_tokens = num_draft_tokens
        return d


def test_metrics_golden_position_by_position():
    """Two rows, greedy, a threshold scheduler. Row 0 stops at an EOS inside accepted drafts, row 1 at
    max_new_tokens = 14 cutting its last round. Per round (valid nodes, correct nodes -> accepted, committed):
      row 0: (4, 1 -> 1, 2); (2 varying length, 4 -> 2, 3); (4 but the scheduler keeps 3, 4 -> 3, 4);
             (4, 4 -> 4, but EOS is the 3rd draft: commits 3, counted as 2 accepted + the round's token)
      row 1: (0 an empty draft -> 0, 1); (4, 0 -> 0, 1); (4, 4 -> 4, 5); (4, 2 -> 2, 3);
             (4, 4 -> 4, but 3 tokens are left: commits 3, counted 2 + 1)
    Per position j: proposed = rounds with a node at j; accepted = rounds that committed draft j; eligible =
    rounds where j was proposed and j-1 accepted with j's verdict committed (not in a cut's shadow)."""
    from specdec.scheduling import ThresholdSchedule

    free = generate(peaky_target(5, eos_token_ids=()), PROMPTS[:2], max_new_tokens=20).tokens
    eos = free[0][12]
    assert eos not in free[0][:12] and eos not in free[1][:14]  # row 0 ends at token 12, row 1 never
    target = peaky_target(5, eos_token_ids=(eos,))
    ones, cut3 = [1.0] * 4, [0.9, 0.8, 0.7, 0.1]
    script = [[(4, 1, ones), (2, 4, ones), (4, 4, cut3), (4, 4, ones)],
              [(0, 0, ones), (4, 0, ones), (4, 4, ones), (4, 2, ones), (4, 4, ones)]]
    out = speculative_generate(target, ScriptedDrafter(free, script), PROMPTS[:2], max_new_tokens=14,
                               scheduler=ThresholdSchedule(threshold=0.5))
    assert out.tokens == generate(target, PROMPTS[:2], max_new_tokens=14).tokens
    assert out.tokens == [free[0][:13], free[1][:14]]
    assert out.accept_lengths == [[2, 3, 4, 3], [1, 1, 5, 3, 3]]
    m = out.metrics
    assert (m.rounds, m.new_tokens, m.accepted_draft_tokens, m.proposed_draft_tokens) == (9, 27, 16, 29)
    assert m.position_proposed == [8, 8, 7, 6]
    assert m.position_accepted == [7, 6, 2, 1]
    assert m.position_eligible == [8, 7, 3, 1]
    acc = m.acceptance_by_position()
    assert acc["survival"] == [7 / 9, 6 / 9, 2 / 9, 1 / 9]
    assert acc["conditional"] == [7 / 8, 6 / 7, 2 / 3, 1.0]
    assert acc["proposal_rate"] == [8 / 9, 8 / 9, 7 / 9, 6 / 9]
    assert m.tau == 1 + m.accepted_draft_tokens / m.rounds


def test_unknown_drafter_and_bad_params_are_clear_errors():
    target = peaky_target(0)
    with pytest.raises(ValueError, match="unknown drafter 'nope'.*ngram"):
        create_drafter("nope", target)
    with pytest.raises(ValueError, match="unknown parameter.*max_gram.*max_ngram"):
        create_drafter("ngram", target, 3, max_gram=2)
    with pytest.raises(ValueError, match="unknown policy|unknown verification policy"):
        speculative_generate(target, create_drafter("ngram", target), PROMPTS, policy="nope")


# ---------------------------------------------------------------------------------------------------------
# Distributional losslessness through the whole engine
# ---------------------------------------------------------------------------------------------------------

def distribution_drafter(name, target):
    return {"self_spec": lambda: create_drafter("self_spec", target, 2, num_layers=1),
            "ngram": lambda: create_drafter("ngram", target, 3, max_ngram=1),
            # two sampled siblings: a sampled tree commits more per round than a top-k one, and a deeper one falls
            # under assert_lossless's 4 rounds per row (the deep sampled trees: test_eagle3, test_dspark, test_medusa)
            "tree": lambda: create_drafter("self_spec", target, 2, num_layers=1, tree_top_k=2, tree_depth=1),
            }[name]()


@pytest.mark.parametrize("drafter_name,policy", [("self_spec", "rejection_chain"), ("ngram", "rejection_chain"),
                                                 ("self_spec", "multidraft_tree"), ("tree", "multidraft_tree")])
def test_sampled_speculative_output_matches_target_distribution(drafter_name, policy):
    """The joint law of the first 9 tokens through the whole engine (prefill token, then >= 4 verify rounds per
    row on average, with probabilistic, deterministic and tree drafts) equals the target's at T=0.7 with top-k
    and top-p, enumerated exactly (`assert_lossless`)."""
    target = distribution_target()
    assert_lossless(*sampled_joint(target, distribution_drafter(drafter_name, target), policy))


def q_without_top_p(logits, sampling):
    """A subtly wrong draft q: temperature and top-k applied, top-p forgotten (the drafted token is still
    sampled with all three). The q the verifier divides by is then off on the tokens top-p removes."""
    from specdec.sampling import processed_logits

    return jax.nn.softmax(processed_logits(logits, dataclasses.replace(sampling, top_p=1.0)), axis=-1)


@pytest.mark.parametrize("module,name,broken,rows", [
    ("specdec.verify.chain", "residual", lambda p, q: p, MUTANT_ROWS),
    ("drafters.draft_lm", "probabilities", q_without_top_p, NUM_SAMPLES),
], ids=["correction-from-p", "draft-q-without-top-p"])
def test_biased_engines_fail_the_distribution_test(monkeypatch, module, name, broken, rows):
    """Negative controls, through the same check: drawing the correction token from p instead of the residual
    (a gross bias: at MUTANT_ROWS = 2000 rows whole-sequence p 8e-74), and a drafter whose q forgets top-p (a
    subtle one, at NUM_SAMPLES rows: the observed TV rises only from ~0.12, the noise of 6000 samples over ~1700
    outcomes, to ~0.14, yet the chi-square p-value falls to ~1e-9)."""
    import importlib

    monkeypatch.setattr(importlib.import_module(module), name, broken)
    jax.clear_caches()  # the compiled loop would otherwise reuse the correct code
    try:
        target = distribution_target()
        counts, impossible, _ = sampled_joint(target, distribution_drafter("self_spec", target), "rejection_chain",
                                              rows)
    finally:
        jax.clear_caches()
    assert_biased(counts, impossible)


# ---------------------------------------------------------------------------------------------------------
# Drafters sample from the q they return
# ---------------------------------------------------------------------------------------------------------

def test_draft_lm_samples_from_its_q(monkeypatch):
    """... and the check has power: a q that forgets top-p (tokens still drawn with it) fails it."""
    target = peaky_target(1)
    drafter = create_drafter("self_spec", target, 3, num_layers=1)
    assert_draft_matches_its_q(target, drafter)
    import drafters.draft_lm

    monkeypatch.setattr(drafters.draft_lm, "probabilities", q_without_top_p)
    jax.clear_caches()
    try:
        p_value, *_ = draft_fit(target, drafter)
    finally:
        jax.clear_caches()
    assert p_value < 1e-6, p_value


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks XLA:CPU's compiled program")
@pytest.mark.parametrize("backend", ["reference", "scan"])
def test_bucketed_verify_keeps_the_cache_out_of_the_switch(backend):
    """The verify bucket switch (a data-dependent width) must not copy the KV cache: its branches only read
    it and the new rows are written once after the switch. Counted in the compiled HLO (donated cache): no
    copy the size of a layer's cache (with the cache inside the switch there were 4 per layer and width)."""
    import re

    from specdec import engine, trees

    target = random_target(tiny_config(), seed=1, backend=backend)
    drafter = types.SimpleNamespace(taps=())
    spec = engine.LoopSpec(cfg=target.cfg, forward=target.forward, drafter=drafter, policy=None, sampling=None,
                           eos_ids=(), verify_widths=bucket_widths(4, "auto"))
    tokens = jnp.ones((2, 5), jnp.int32)
    mask, depth = trees.tree_attention(Draft.chain(tokens[:, 1:]).parents)

    def verify(cache, need):
        out = engine.target_verify(spec, target.params, cache, tokens, cache.lengths[:, None] + depth, mask, need)
        return out.logits, out.cache

    cache = target.init_cache(2, 64)
    text = jax.jit(verify, donate_argnums=(0,)).lower(cache, jnp.int32(2)).compile().as_text()
    assert "conditional" in text  # the switch is there
    layer_cache = jax.tree.leaves(cache.k)[0].shape[-4:]
    dims = sorted(d for d in layer_cache if d > 1)
    hits = [line.strip() for line in text.splitlines()
            if (m := re.search(r"= \w+\[([\d,]+)\]\S* copy\(", line))
            and sorted(d for d in map(int, m.group(1).split(",")) if d > 1)[-len(dims):] == dims]
    assert not hits, hits[:3]


@pytest.mark.parametrize("backend", ["reference", "scan"])
def test_prefill_runs_each_distinct_prompt_once(backend, monkeypatch):
    """Rows repeating a prompt (n samples of one prompt; the sampled lossless check's copies) copy the K/V,
    logits and taps of one prefilled row; a prompt that differs only by a trailing pad token is its own row."""
    from specdec import generate as gen
    from specdec.generate import pad_prompts, prefill, prefill_distinct

    target = random_target(tiny_config(), backend=backend)
    a, b = [5, 9, 17, 3], [7, 7, 2]
    prompts = [a, b, a, a, b + [0], b]  # pad id 0: b + [0] pads like b but is one token longer
    tokens, lengths = pad_prompts(prompts, 0)
    capacity, taps = 48, (1, 2)
    batches = []
    inner = gen.prefill
    monkeypatch.setattr(gen, "prefill", lambda *args, **kw: batches.append(args[2].shape[0]) or inner(*args, **kw))
    got = prefill_distinct(target.params, target.init_cache(len(prompts), capacity), tokens, lengths,
                           forward=target.forward, cfg=target.cfg, taps=taps)
    want = prefill(target.params, target.init_cache(len(prompts), capacity), jnp.asarray(tokens),
                   jnp.asarray(lengths), forward=target.forward, cfg=target.cfg, taps=taps)
    assert batches == [3]  # a, b and b + [0]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[2].lengths), [4, 3, 4, 4, 4, 3])


def test_speculative_cache_is_ar_cache_plus_its_slack():
    """The speculative loop's cache is AR's (the bucketed prompt + new tokens) plus the draft slack rounded to
    SLACK_ALIGN, never a whole bucket more: attention reads every slot, and at batch 8 a slack that doubled the
    cache (512 slots against AR's 256) made a round that verifies nothing cost 1.30x AR's step."""
    from specdec import engine
    from specdec.generate import CAPACITY_BUCKET, SLACK_ALIGN, cache_capacity

    for prompt in (1, 100, 190, 191, 250, 400):
        ar = cache_capacity([prompt, 5], 64)
        assert ar % CAPACITY_BUCKET == 0 and ar >= prompt + 64 + 1
        for n in (1, 7, 8, 15, 16):
            spec = cache_capacity([prompt, 5], 64, extra=n + 1)
            assert spec >= prompt + 64 + 1 + n + 1  # the last verify writes N + 1 slots past the last token
            assert spec - ar == -(-(n + 1) // SLACK_ALIGN) * SLACK_ALIGN and spec % 8 == 0
    target = peaky_target(3, eos_token_ids=())
    drafter = create_drafter("ngram", target, 7)
    prompt = [[1 + i % 50 for i in range(190)]]
    *_, capacity = engine.loop_setup(target, drafter, prompt, "greedy_chain", 64, GREEDY, None, None, "none")
    assert capacity == cache_capacity([190], 64) + SLACK_ALIGN == CAPACITY_BUCKET + SLACK_ALIGN
    # a smaller bucket (the exact distribution check's: 11-token prompts padded to 32, 9 new tokens) and a bad one
    *_, capacity = engine.loop_setup(target, drafter, [[1] * 11], "greedy_chain", 9, GREEDY, None, None, "none",
                                     capacity_bucket=32)
    assert capacity == 32 + SLACK_ALIGN
    with pytest.raises(ValueError, match="capacity_bucket must be >= 1, got 0"):
        engine.loop_setup(target, drafter, [[1] * 11], "greedy_chain", 9, GREEDY, None, None, "none",
                          capacity_bucket=0)


def test_starting_a_loop_allocates_no_second_cache(monkeypatch):
    """The started state holds the prefilled KV cache itself: `_initial_state` takes it donated (returned
    without donation, XLA copied every layer's cache: two caches alive, 3.1 GB at batch 64 with 528 slots), and
    `start` hands the state the Prefilled's own buffers (it starts one run) where the round-cost profile's runs,
    which share one Prefilled, get copies. The output is unchanged (AR's)."""
    from specdec import engine
    from specdec.sampling import sample_key

    target = peaky_target(3)
    drafter = create_drafter("ngram", target, 4, max_ngram=2)
    spec, tokens, lengths, limits, capacity = engine.loop_setup(target, drafter, PROMPTS, "greedy_chain", 9, GREEDY,
                                                                None, None, None)
    cache = target.init_cache(len(tokens), capacity)
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves((cache.k, cache.v)))
    logits = jnp.zeros((len(tokens), target.cfg.vocab_size), jnp.float32)
    compiled = engine._initial_state.lower(spec, tokens, lengths, logits, cache, sample_key(0, len(tokens)), 2,
                                           capacity=capacity).compile()
    assert compiled.memory_analysis().alias_size_in_bytes >= cache_bytes  # the cache goes through in place
    copied = []
    copy = engine._copy
    monkeypatch.setattr(engine, "_copy", lambda x: copied.append(x) or copy(x))
    state = engine.start(spec, target, drafter, cache, tokens, lengths, capacity, limits, 0)
    assert not copied
    ready = engine.prefilled(spec, target, drafter, target.init_cache(len(tokens), capacity), tokens, lengths,
                             capacity, 0)
    ready.state(limits)
    assert copied  # a Prefilled that starts several runs still copies for each
    out = engine._decode(spec, target, drafter, state, lengths, True)
    assert out.tokens == generate(target, PROMPTS, max_new_tokens=9).tokens
