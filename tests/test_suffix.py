"""The suffix-decoding drafter (drafters/suffix.py): its index, its trees, and greedy equality in the engine.

Engine tests run on a tiny random target whose EOS is chosen so that greedy output stops inside the budget
for some rows (ragged lengths, EOS inside accepted drafts), and a global corpus is seeded with documents that
(a) continue past EOS and past max_new_tokens, and (b) carry corrupted copies of the true continuation more
often than the true one, so the accepted child is often NOT the first sibling.
"""

from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest

from drafters import create_drafter
from drafters.suffix import SuffixDrafter, SuffixIndex, grow_tree, stream_match
from specdec.drafter import PromptInfo, RoundContext
from specdec.engine import speculative_generate
from specdec.generate import generate
from specdec.models.config import tiny_config
from specdec.sampling import SamplingParams
from specdec.target import random_target

MAX_NEW = 28
NODES = 5
SCALE = 0.5


# ----------------------------------------------------------------------------------------------------------
# The index and the trees (pure Python, no model)
# ----------------------------------------------------------------------------------------------------------

def test_index_counts_and_longest_match():
    index = SuffixIndex(depth=6)
    stream = index.extend([], [1, 2, 3, 4, 1, 2, 3, 5, 1, 2])
    assert index.find([1, 2]).count == 3 and index.find([1, 2]).cont == 2  # the last [1, 2] has no successor
    assert index.find([1, 2, 3]).count == 2 and index.find([9]) is None
    node, m = stream_match(stream, max_match=4)  # suffix [3, 1, 2]? never continued; [1, 2] did
    assert m == 2 and node is index.find([1, 2])
    assert {t: c.count for t, c in node.children.items()} == {3: 2}
    # an independent walk over the same index agrees; max_match bounds the pattern
    assert index.match([7, 1, 2], max_match=4) == (node, 2)
    assert index.match([1, 2], max_match=1) == (index.find([2]), 1)
    assert index.match([9, 9], max_match=4) == (None, 0)
    # depth limit: nothing deeper than 6 tokens is stored
    assert index.find([1, 2, 3, 4, 1, 2]) is not None and index.find([1, 2, 3, 4, 1, 2, 3]) is None


def test_documents_do_not_join():
    index = SuffixIndex(depth=4)
    index.add_document([5, 6])
    index.add_document([7, 8])
    assert index.find([6, 7]) is None and index.find([5, 6]).cont == 0
    assert index.num_documents == 2 and index.num_tokens == 4


def test_incremental_equals_batch_build():
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 6, 300).tolist()
    whole, parts = SuffixIndex(7), SuffixIndex(7)
    whole.extend([], seq)
    stream = []
    for start in range(0, 300, 7):
        stream = parts.extend(stream, seq[start:start + 7])

    def dump(node, prefix=()):
        out = {prefix: (node.count, node.cont)}
        for t, child in (node.children or {}).items():
            out.update(dump(child, prefix + (t,)))
        return out

    assert dump(whole.root) == dump(parts.root)
    assert whole.num_nodes == parts.num_nodes


def test_frequency_tree():
    index = SuffixIndex(depth=8)
    # after [0, 1, 2]: 3 x [3, 4, 5, 0], 1 x [6, 7, 0, 1]
    stream = index.extend([], [0, 1, 2, 3, 4, 5] * 3 + [0, 1, 2, 6, 7] + [0, 1, 2])
    node, m = stream_match(stream, max_match=3)
    assert m == 3 and node is index.find([0, 1, 2]) and node.count == 5 and node.cont == 4
    tokens, parents, scores = grow_tree(node, budget=8, max_depth=4, min_score=0.1)
    assert tokens == [3, 4, 5, 0, 6, 7, 0, 1]
    assert parents == [-1, 0, 1, 2, -1, 4, 5, 6]
    np.testing.assert_allclose(scores, [0.75] * 4 + [0.25] * 4)
    assert all(p < i for i, p in enumerate(parents))  # topological
    assert all(a >= b for a, b in zip(scores, scores[1:]))  # best-first
    # the budget keeps the best nodes; max_depth cuts every path
    assert grow_tree(node, budget=3, max_depth=4, min_score=0.1)[0] == [3, 4, 5]
    t, p, _ = grow_tree(node, budget=8, max_depth=2, min_score=0.1)
    assert t == [3, 4, 6, 7] and p == [-1, 0, -1, 2]
    # min_score drops the rare branch
    assert grow_tree(node, budget=8, max_depth=4, min_score=0.3)[0] == [3, 4, 5, 0]


def test_adaptive_size():
    rng = np.random.default_rng(1)
    # a long pattern that always continued the same way -> a full-depth chain
    phrase = rng.integers(100, 200, 12).tolist()
    confident = SuffixIndex(16)
    s = confident.extend([], phrase + [0] + phrase + [1] + phrase[:8])
    node, m = stream_match(s, max_match=8)
    tokens, parents, scores = grow_tree(node, budget=10, max_depth=8, min_score=0.1)
    assert m == 8 and len(tokens) == 10
    assert tokens[:4] == phrase[8:] and parents[:4] == [-1, 0, 1, 2] and scores[:4] == [1.0] * 4
    assert sorted(tokens[4:6]) == [0, 1] and parents[4:6] == [3, 3] and scores[4:6] == [0.5, 0.5]
    # a pattern followed by 20 different tokens once each -> nothing reaches min_score 0.1
    ambiguous = SuffixIndex(16)
    s = []
    for t in range(20):
        s = ambiguous.extend(s, [7, 8, 9, 50 + t])
    s = ambiguous.extend(s, [7, 8, 9])
    node, m = stream_match(s, max_match=8)
    assert grow_tree(node, budget=10, max_depth=8, min_score=0.1) == ([], [], [])
    assert len(grow_tree(node, budget=10, max_depth=8, min_score=0.0)[0]) == 10
    # the drafter: same budget, more tokens for the confident match than for the ambiguous one
    d = SuffixDrafter(num_draft_tokens=10, use_global=False)
    sizes = []
    for seq in (phrase + [0] + phrase + [1] + phrase[:8], [x for t in range(20) for x in (7, 8, 9, 50 + t)] + [7, 8, 9]):
        _propose(d, [seq])
        sizes.append(int((d.last_scores > 0).sum()))
    assert sizes[0] >= 4 and sizes[1] == 0


def _propose(drafter, seqs, done=None):
    """Run init + propose on raw sequences (the whole sequence is treated as the prompt plus one token)."""
    b = len(seqs)
    width = max(len(s) for s in seqs) + 16
    seq = np.zeros((b, width), np.int32)
    for i, s in enumerate(seqs):
        seq[i, : len(s)] = s
    lens = np.array([len(s) for s in seqs], np.int32)
    prompt = PromptInfo(tokens=jnp.asarray(seq), lengths=jnp.asarray(lens - 1), taps=None,
                        first_token=jnp.asarray(seq[np.arange(b), lens - 1]))
    state = drafter.init(None, prompt, width)
    done = np.zeros(b, bool) if done is None else np.asarray(done)
    ctx = RoundContext(seq=jnp.asarray(seq), seq_len=jnp.asarray(lens), done=jnp.asarray(done))
    draft, _ = drafter.propose(None, state, ctx, SamplingParams(), None)
    return draft


def test_propose_shapes_padding_and_done_rows():
    d = SuffixDrafter(num_draft_tokens=6)
    seqs = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6], [1, 2, 3, 1, 2]]
    draft = _propose(d, seqs, done=[False, False, True])
    tokens, parents, valid = (np.asarray(x) for x in (draft.tokens, draft.parents, draft.valid))
    assert tokens.shape == parents.shape == valid.shape == (3, 6) and draft.probs is None
    # longest match [1, 2, 3, 1, 2] (at 0) continued only by [3, 1, 2] before the sequence ends
    assert valid[0].tolist() == [True] * 3 + [False] * 3 and tokens[0, :3].tolist() == [3, 1, 2]
    assert not valid[1].any() and not valid[2].any()  # nothing repeats in row 1; row 2 is done
    assert (parents[~valid] == -1).all() and (tokens[~valid] == 0).all()
    for row in range(3):
        assert all(parents[row, i] < i for i in range(6))
    assert d.last_source == ["request", "none", "none"]


def test_global_corpus_and_use_global_flag():
    doc = [11, 12, 13, 14, 15, 16]
    for use_global in (True, False):
        d = SuffixDrafter(num_draft_tokens=4, use_global=use_global)
        d.observe(doc)
        draft = _propose(d, [[1, 2, 11, 12]])
        valid = np.asarray(draft.valid)[0]
        if use_global:
            assert np.asarray(draft.tokens)[0].tolist() == [13, 14, 15, 16] and valid.all()
            assert d.last_source == ["global"]
        else:
            assert not valid.any()
        d.clear_global()
        assert d.global_index.num_tokens == 0


def test_max_spec_factor_scales_the_tree_with_the_match_length():
    """SuffixDecoding's adaptive speculation: a tree below a pattern matched over m tokens holds at most
    max_spec_factor * m + max_spec_offset nodes; without a factor, the whole budget."""
    one = [5, 6, 7, 8, 9, 10, 11, 99, 5]  # only the last token matches earlier (followed by 6, 7, 8, ...)
    three = [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]  # [1, 2, 3] matches, followed by 4, 5, 6, ...
    cases = {None: (4, 4), 1: (1, 3), 2: (2, 4)}
    for factor, (n_one, n_three) in cases.items():
        d = SuffixDrafter(num_draft_tokens=4, max_spec_factor=factor, use_global=False)
        for seq, n, first in ((one, n_one, 6), (three, n_three, 4)):
            draft = _propose(d, [seq])
            valid = np.asarray(draft.valid)[0]
            assert valid.sum() == n, (factor, seq)
            assert np.asarray(draft.tokens)[0, :n].tolist() == list(range(first, first + n))
    d = SuffixDrafter(num_draft_tokens=4, max_spec_factor=1, max_spec_offset=1, use_global=False)
    assert np.asarray(_propose(d, [one]).valid)[0].sum() == 2
    assert d.describe()["max_spec_factor"] == 1.0 and "max_spec_factor" not in SuffixDrafter(4).describe()
    with pytest.raises(ValueError, match="max_spec_factor"):
        SuffixDrafter(num_draft_tokens=4, max_spec_factor=0)


def test_registry_and_parameters():
    d = create_drafter("suffix", None, num_draft_tokens=7, max_match=4, max_depth=None, min_score=0.2,
                       use_global=False)
    assert isinstance(d, SuffixDrafter) and d.kind == "tree" and not d.jittable
    assert d.max_depth == 7 and d.describe()["max_match"] == 4 and d.describe()["min_score"] == 0.2
    with pytest.raises(ValueError, match="unknown parameter"):
        create_drafter("suffix", None, num_draft_tokens=4, max_ngram=3)
    with pytest.raises(ValueError):
        create_drafter("suffix", None, num_draft_tokens=4, min_score=1.5)


def test_draft_work_is_bounded_by_the_tree_budget_not_the_sequence(monkeypatch):
    """A draft's work does not grow with the text indexed: the best-first tree pushes at most 1 / min_score
    children per expanded node (each must keep a min_score share of its parent's score), and expands at most
    the budget, on an 8k-token sequence with many repeats as on a 2k one. (Counted, not timed: tests never
    assert timings; the adaptive width's round-cost profile, printed by benchmarks/bench_speculative.py,
    times the drafter in its loop.)"""
    import heapq

    from drafters import suffix as suffix_module

    pushes = [0]
    push = heapq.heappush

    def counting_push(heap, item):
        pushes[0] += 1
        push(heap, item)

    monkeypatch.setattr(suffix_module.heapq, "heappush", counting_push)
    rng = np.random.default_rng(0)
    words = rng.integers(0, 3000, 300)
    seq = words[rng.integers(0, 300, 8192)].tolist()  # 8k tokens over a 300-token vocabulary: many matches
    per_draft = {}
    for length in (2048, 8192):
        d = SuffixDrafter(num_draft_tokens=8, min_score=0.1)
        d.observe(seq[:length // 2])
        _propose(d, [seq[:length]])
        row = d._rows[0]
        pushes[0] = 0
        drafted = 0
        for end in range(length - 200, length):
            tokens, *_ = d.draft_row(row, seq[:end][-8:])
            drafted += len(tokens)
        assert drafted > 0
        per_draft[length] = pushes[0] / 200
        # two trees (the request's own and the global index), each at most (budget + 1) x 1 / min_score pushes
        assert per_draft[length] <= 2 * (8 + 1) * 10, per_draft
    assert per_draft[8192] <= 2 * per_draft[2048], per_draft  # both fill the budget; more text, no more work


# ----------------------------------------------------------------------------------------------------------
# Greedy equality in the engine (tiny random target)
# ----------------------------------------------------------------------------------------------------------

PROMPTS = [np.random.default_rng(s).integers(3, 256, n).tolist() for s, n in ((0, 5), (1, 17), (2, 9))]


@pytest.fixture(scope="module")
def setup():
    """(target, drafter, AR reference per row at batch 3 and at batch 1, the greedy continuations past EOS).

    The target's EOS is a token that greedy decoding emits mid-way for row 0, so rows stop at different
    points. `probe` holds what greedy decoding would produce if it did not stop at that EOS, for MAX_NEW + 8
    tokens: corpus documents built from it continue correctly past EOS and past max_new_tokens, so drafts
    that cross them are accepted by the target and the engine has to cut them.
    """
    base = random_target(tiny_config(), scale=SCALE)  # same weights, EOS = 2 (never emitted here)
    probe = generate(base, PROMPTS, max_new_tokens=MAX_NEW + 8).tokens
    eos = int(probe[0][MAX_NEW // 2])
    target = random_target(tiny_config(eos_token_ids=(eos,)), scale=SCALE)
    ref3 = generate(target, PROMPTS, max_new_tokens=MAX_NEW).tokens
    ref1 = [generate(target, [p], max_new_tokens=MAX_NEW).tokens[0] for p in PROMPTS]
    assert ref3[0][-1] == eos and len(ref3[0]) < MAX_NEW, "row 0 must stop at EOS"
    assert any(len(r) == MAX_NEW for r in ref3), "some row must run to max_new_tokens"
    drafter = create_drafter("suffix", target, num_draft_tokens=NODES)
    return target, drafter, ref3, ref1, probe


def seed_corpus(drafter, probe):
    """For each row: a copy with one token wrong, then the true continuation (past EOS and past the budget).

    Both are seen once, the wrong one first, so at the corrupted position the tree holds two equally
    frequent children and the WRONG one is the first sibling: the true path goes through a later sibling.
    """
    drafter.clear_global()
    for b, doc in enumerate(probe):
        wrong = list(doc)
        cut = 2 + 3 * b
        wrong[cut] = (wrong[cut] + 1) % 256
        drafter.observe(wrong)
        drafter.observe(doc)


def run(target, drafter, prompts, policy, sampling=SamplingParams(), warmup=False, **options):
    return speculative_generate(target, drafter, prompts, policy=policy, max_new_tokens=MAX_NEW,
                                sampling=sampling, warmup=warmup, **options)


def run_recorded(target, drafter, prompts, policy):
    """`run`, counting the situations the equality test must cover (from the drafts and VerifyResults):
    accepted nodes that are not their parent's first child, accepted EOS with more accepted tokens after it,
    and rounds whose accepted tokens + bonus run past max_new_tokens."""
    eos = target.eos_token_ids[0]
    seen = {"later_sibling": 0, "eos_inside": 0, "past_max": 0}
    propose, update = drafter.propose, drafter.update
    rounds = []

    def rec_propose(params, state, ctx, sampling, key):
        draft, state = propose(params, state, ctx, sampling, key)
        rounds.append((draft, np.asarray(ctx.seq_len), np.asarray(ctx.done)))
        return draft, state

    def rec_update(params, state, ctx, result, taps):
        draft, seq_len, done = rounds[-1]
        tokens, parents, valid = (np.asarray(x) for x in (draft.tokens, draft.parents, draft.valid))
        path, accepted = np.asarray(result.path), np.asarray(result.num_accepted)
        for b in np.flatnonzero(~done):
            for j in range(accepted[b]):
                node = path[b, j]
                siblings = np.flatnonzero(valid[b] & (parents[b] == parents[b, node]))
                seen["later_sibling"] += int(siblings[0] != node)
                seen["eos_inside"] += int(tokens[b, node] == eos and j < accepted[b] - 1)
            seen["past_max"] += int(seq_len[b] - len(prompts[b]) + accepted[b] + 1 > MAX_NEW)
        return update(params, state, ctx, result, taps)

    drafter.propose, drafter.update = rec_propose, rec_update
    try:
        return run(target, drafter, prompts, policy), seen
    finally:
        del drafter.propose, drafter.update


@pytest.mark.parametrize("policy", ["greedy_tree", "multidraft_tree"])
def test_greedy_equality_batch3(setup, policy):
    target, drafter, ref3, _, probe = setup
    drafter.clear_global()
    fresh = run(target, drafter, PROMPTS, policy)  # per-request index only (+ rows finished earlier)
    assert fresh.tokens == ref3
    seed_corpus(drafter, probe)
    seeded, seen = run_recorded(target, drafter, PROMPTS, policy)
    assert seeded.tokens == ref3
    assert seen["later_sibling"] > 0 and seen["eos_inside"] > 0 and seen["past_max"] > 0, seen
    m = seeded.metrics
    assert m.tau > 2.0 and m.accepted_draft_tokens < m.proposed_draft_tokens  # long, but imperfect drafts
    assert m.accepted_draft_tokens > 0


@pytest.mark.parametrize("policy", ["greedy_tree", "multidraft_tree"])
def test_greedy_equality_batch1(setup, policy):
    target, drafter, _, ref1, probe = setup
    drafter.clear_global()
    assert [run(target, drafter, [p], policy).tokens[0] for p in PROMPTS] == ref1  # corpus grows per request
    seed_corpus(drafter, probe)
    assert [run(target, drafter, [p], policy).tokens[0] for p in PROMPTS] == ref1


def test_greedy_equality_with_verify_buckets(setup):
    """Ragged suffix trees (rows with few or no nodes) let rounds run a narrower verify step
    (`verify.buckets`): greedy output still equals AR, row 0 stopping at EOS and the others at max_new_tokens."""
    target, drafter, ref3, _, _ = setup
    drafter.clear_global()  # per-request index only: early rounds find few or no continuations
    widths = []

    def on_round(draft, conf, result, active):
        valid = np.asarray(draft.valid)[np.asarray(active)]
        widths.append(int(np.max(np.nonzero(valid.any(0))[0], initial=-1)) + 1)  # nodes the step needs

    out = run(target, drafter, PROMPTS, "greedy_tree", verify_buckets="auto", on_round=on_round, compiled=False)
    assert out.tokens == ref3
    assert min(widths) < NODES // 2 and max(widths) > NODES // 2, widths  # narrow and wide steps both ran


def test_global_corpus_raises_acceptance_on_repeated_request(setup):
    target, drafter, ref3, _, probe = setup
    drafter.clear_global()
    first = run(target, drafter, PROMPTS, "greedy_tree", warmup=True)
    # each finished row was added once; the engine's 2-token warm-up outputs were not
    assert drafter.global_index.num_documents == len(PROMPTS)
    second = run(target, drafter, PROMPTS, "greedy_tree")
    assert first.tokens == second.tokens == ref3
    assert second.metrics.tau > first.metrics.tau + 1.0
    assert second.metrics.rounds < first.metrics.rounds


def test_sampled_multidraft_runs(setup):
    target, drafter, ref3, _, probe = setup
    seed_corpus(drafter, probe)
    out = run(target, drafter, PROMPTS, "multidraft_tree", SamplingParams(temperature=1.0))
    eos = target.eos_token_ids[0]
    for row in out.tokens:
        assert 1 <= len(row) <= MAX_NEW and all(0 <= t < 256 for t in row)
        assert eos not in row[:-1] and (len(row) == MAX_NEW or row[-1] == eos)
    assert np.isfinite(out.metrics.tau)
