"""DSpark: with the Markov head zeroed it IS DFlash (same drafts, probabilities and verified output, sampled
and greedy); sequential temperature scaling recovers a known miscalibration; and on a toy language where the
continuation after a marker is one of two fixed phrases, DSpark trained through the shared training loop (with
calibration, export and loading by name) reaches at least 1.5x DFlash's acceptance length, because DFlash
drafts the slots of a block independently and cannot keep them on one phrase."""

import functools
import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drafters import create_drafter, dflash, dspark
from specdec import trees
from specdec.config import TrainConfig, load_config
from specdec.engine import speculative_generate
from specdec.generate import generate
from specdec.models import transformer
from specdec.models.config import tiny_config
from specdec.sampling import SamplingParams, probabilities
from specdec.target import Target, random_target
from specdec.train.data import DistillData
from specdec.train.loop import train
from specdec.train import tasks as T
from specdec.train.tasks import make_task

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "train"

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12], [20, 21, 20, 21, 20, 21, 20, 21, 20, 21, 20], [3]]
G = 4


@functools.partial(jax.jit, static_argnums=(0, 4))
def draw(drafter, params, hidden, root, sampling, key):
    return drafter.draw(params, hidden, root, sampling, key)


def test_zeroed_markov_head_equals_dflash():
    target = random_target(tiny_config(), seed=3, scale=0.35)
    task = dspark.make_task(target, num_layers=1, block_size=G, markov_rank=8)
    params, buffers = task.init(jax.random.PRNGKey(0), None)
    assert not np.any(params["markov"]["w2"])  # initialised at exactly DFlash
    params["markov"]["w1"] = params["markov"]["w1"] + 1.0  # the zero W2 must cancel whatever W1 holds
    spark = dspark.DSparkDrafter.from_trained(task.arch, params, buffers, target, G)
    flash = dflash.DFlashDrafter.from_trained(task.arch, {"backbone": params["backbone"]}, {}, target, G)
    sampling = SamplingParams(temperature=0.9, top_k=50)
    a = speculative_generate(target, spark, PROMPTS, policy="rejection_chain", sampling=sampling, max_new_tokens=12)
    b = speculative_generate(target, flash, PROMPTS, policy="rejection_chain", sampling=sampling, max_new_tokens=12)
    assert a.tokens == b.tokens
    assert (a.metrics.rounds, a.metrics.accepted_draft_tokens) == (b.metrics.rounds, b.metrics.accepted_draft_tokens)
    # the draws themselves: tokens and exact draft distributions, slot by slot
    hidden = jnp.asarray(np.random.default_rng(1).standard_normal((3, G, target.cfg.hidden_size)), jnp.float32)
    root = jnp.asarray([5, 9, 3])
    ts, qs, _ = draw(spark, spark.params, hidden, root, sampling, jax.random.PRNGKey(2))
    tf, qf, _ = draw(flash, flash.params, hidden, root, sampling, jax.random.PRNGKey(2))
    np.testing.assert_array_equal(ts, tf)
    np.testing.assert_array_equal(qs, qf)
    # ... and a nonzero W2 does change them (the comparison above can fail)
    params["markov"]["w2"] = jnp.asarray(np.random.default_rng(3).standard_normal(params["markov"]["w2"].shape),
                                         jnp.float32)
    spark2 = dspark.DSparkDrafter.from_trained(task.arch, params, buffers, target, G)
    _, q2, _ = draw(spark2, spark2.params, hidden, root, sampling, jax.random.PRNGKey(2))
    assert not np.allclose(q2, qf, atol=1e-3)


def test_reduced_draft_vocabulary_trains_and_drafts_the_same_distribution():
    """draft_vocab_size (FR-Spec): d2t holds the most frequent ids (and EOS); the drafter proposes only them, its q
    over the target vocabulary is 0 elsewhere and sums to 1, each slot's q is the training path's distribution
    (Markov head included, previous token = the drafted one); the loss's L1 and expected acceptance equal the
    full-vocabulary ones with p_d scattered to the target vocabulary; and CE skips labels it cannot draft. (The
    engine with a reduced vocabulary: tests/test_dflash.py's distribution test.)"""
    target = random_target(tiny_config(), seed=3, scale=0.35)
    vocab, eos = target.cfg.vocab_size, target.cfg.eos_token_ids
    counts = np.random.default_rng(0).integers(0, 1000, vocab)
    task = dspark.make_task(target, num_layers=1, block_size=G, markov_rank=8, draft_vocab_size=40)
    params, buffers = task.init(jax.random.PRNGKey(0), counts)
    d2t = np.asarray(buffers["d2t"])
    np.testing.assert_array_equal(d2t, T.reduced_vocab(counts, 40, eos))
    assert len(d2t) == 40 and set(eos) <= set(d2t.tolist())
    rng = np.random.default_rng(1)
    params["markov"]["w2"] = jnp.asarray(rng.standard_normal(params["markov"]["w2"].shape), jnp.float32)
    drafter = dspark.DSparkDrafter.from_trained(task.arch, params, buffers, target, G)
    consts = {**task.frozen(target), **buffers}

    hidden = jnp.asarray(rng.standard_normal((3, G, target.cfg.hidden_size)), jnp.float32)
    root = jnp.asarray([5, 9, 3])
    tokens, q, _ = draw(drafter, drafter.params, hidden, root, SamplingParams(temperature=1.0), jax.random.PRNGKey(2))
    tokens, q = np.asarray(tokens), np.asarray(q)
    assert set(tokens.ravel().tolist()) <= set(d2t.tolist()) and q.shape == (3, G, vocab)
    off = np.setdiff1d(np.arange(vocab), d2t)
    assert not q[..., off].any()
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
    prev = np.concatenate([np.asarray(root)[:, None], tokens[:, :-1]], axis=1)  # slot j's previous token
    train_q = jax.nn.softmax(task.slot_logits(params, consts, hidden, jnp.asarray(prev)), axis=-1)
    np.testing.assert_allclose(q[..., d2t], train_q, rtol=1e-5, atol=1e-6)

    labels = jnp.asarray(np.stack([d2t[:G], off[:G], d2t[-G:]]))  # the middle row: labels it cannot draft
    tl = jnp.asarray(rng.standard_normal((3, G, vocab)), jnp.float32)
    _, parts = task.slot_loss(params, consts, hidden, jnp.asarray(prev), labels, tl)
    pd = np.zeros((3, G, vocab), np.float32)
    pd[..., d2t] = train_q
    pt = np.asarray(jax.nn.softmax(tl, axis=-1))
    np.testing.assert_allclose(parts["l1"], np.abs(pd - pt).sum(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(parts["expected_accept"], np.minimum(pd, pt).sum(-1), rtol=1e-5, atol=1e-6)
    with np.errstate(divide="ignore"):  # -log 0 at the labels it cannot draft, masked out below
        want_ce = -np.log(np.take_along_axis(pd, np.asarray(labels)[..., None], -1)[..., 0])
    np.testing.assert_allclose(parts["ce"], np.where(np.isin(np.asarray(labels), d2t), want_ce, 0.0), rtol=1e-5)
    assert not np.asarray(parts["ce"])[1].any()


def test_sequential_temperature_scaling_recovers_known_temperatures():
    """Confidences whose true prefix survival is sigmoid(z_1 / 2), then x sigmoid(z_2 / 0.5): the fitted per-slot
    temperatures are ~2 and ~0.5, and calibration lowers the ECE."""
    rng = np.random.default_rng(0)
    z = rng.normal(0, 3, size=(20_000, 2))
    alpha = np.stack([1 / (1 + np.exp(-z[:, 0] / 2)), 1 / (1 + np.exp(-z[:, 1] / 0.5))], axis=1)
    temps = dspark.sequential_temperatures(z, alpha)
    assert abs(np.log(temps[0] / 2.0)) < 0.15 and abs(np.log(temps[1] / 0.5)) < 0.15, temps
    raw = dspark.ece(1 / (1 + np.exp(-z[:, 0])), alpha[:, 0])
    fitted = dspark.ece(1 / (1 + np.exp(-z[:, 0] / temps[0])), alpha[:, 0])
    assert fitted < 0.5 * raw


def test_confidence_is_calibrated_for_the_sampling_temperature(monkeypatch):
    """Two fits: against temperature-1 acceptance alpha (true temperature 2 here) and against greedy argmax
    agreement (Bernoulli labels, true temperature 0.5); drafting reads the greedy set at T = 0 only."""
    target = random_target(tiny_config(), seed=3, scale=0.35)
    task = dspark.make_task(target, num_layers=1, block_size=2, markov_rank=4)
    rng = np.random.default_rng(0)
    z = rng.normal(0, 3, size=(1, 20_000, 2)).astype(np.float32)
    alpha = 1 / (1 + np.exp(-z / 2))
    match = (rng.uniform(size=z.shape) < 1 / (1 + np.exp(-z / 0.5))).astype(np.float32)
    monkeypatch.setattr(dspark.DSparkTask, "calibration_stats",
                        lambda self, *a: (z, alpha, match, np.ones(z.shape, bool)))
    fitted = task.calibrate(None, None, [(None, None)])
    sampled, greedy = np.asarray(fitted["conf_temperature"]), np.asarray(fitted["conf_temperature_greedy"])
    assert np.all(np.abs(np.log(sampled[:1] / 2.0)) < 0.15) and np.all(np.abs(np.log(greedy[:1] / 0.5)) < 0.15)

    params, buffers = task.init(jax.random.PRNGKey(0), None)
    hidden = jnp.asarray(rng.standard_normal((3, 2, target.cfg.hidden_size)), jnp.float32)
    root, key = jnp.asarray([5, 9, 3]), jax.random.PRNGKey(2)

    def confidence(sampling, greedy_temperature):
        temps = {"conf_temperature": jnp.ones(2), "conf_temperature_greedy": jnp.full(2, greedy_temperature)}
        d = dspark.DSparkDrafter.from_trained(task.arch, params, {**buffers, **temps}, target, 2)
        return np.asarray(draw(d, d.params, hidden, root, sampling, key)[2])

    hot = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    assert not np.allclose(confidence(SamplingParams(), 1.0), confidence(SamplingParams(), 4.0))
    np.testing.assert_array_equal(confidence(hot, 1.0), confidence(hot, 4.0))


def test_dspark_samples_from_its_q():
    """The drafted tokens' frequencies match the returned q (T=0.7, top-k, top-p; tests/test_engine.py): the
    Markov head makes q_j depend on the drafted x_{j-1}, so this checks the sequential draws slot by slot."""
    from specdec.testing import assert_draft_matches_its_q
    from tests.test_scheduling import random_dspark

    target = random_target(tiny_config(), seed=3, scale=0.35)
    assert_draft_matches_its_q(target, random_dspark(target))


def test_training_configs_build_their_tasks():
    """configs/train/dflash.yaml and dspark.yaml (SmolLM2) parse and their drafter options build the tasks (on
    the tiny target here: the SmolLM2 taps/MASK id fall back to what the tiny model has)."""
    target = random_target(tiny_config(), seed=0)
    for name in ("dflash", "dspark"):
        cfg = load_config(str(CONFIGS / f"{name}.yaml"))
        assert cfg.drafter.name == name and cfg.train.drafter_options["block_size"] == 7
        task = make_task(name, target, cfg.train.drafter_options)
        assert task.name == name and task.arch.mask_id == 16 and task.arch.block_size == 7
    with pytest.raises(ValueError, match="unknown option"):
        make_task("dspark", target, {"markov_rnak": 4})


# ---------------------------------------------------------------------------------------------------------
# The toy two-phrase language
# ---------------------------------------------------------------------------------------------------------

V, H = 32, 64
MARKER = 3
PHRASES = ([4, 5, 6], [7, 8, 9])  # after the marker: one of two fixed phrases (50/50), then the marker again
BLOCK = 8


def two_phrase_target() -> tuple[Target, np.ndarray]:
    """A bigram target built from a tiny transformer: one-hot embeddings, attention and MLP outputs zeroed (the
    residual stream stays the embedding), and an lm_head whose rows are the bigram log-probabilities."""
    cfg = tiny_config(vocab_size=V, hidden_size=H, tie_word_embeddings=False, eos_token_ids=(), pad_token_id=0,
                      name="two_phrases")
    logp = np.full((V, V), -30.0, np.float32)
    logp[:, MARKER] = 0.0  # anything else (phrase ends, unused ids) -> marker
    logp[MARKER] = -30.0
    for phrase in PHRASES:
        logp[MARKER, phrase[0]] = 0.0
        for a, b in itertools.pairwise(phrase):
            logp[a] = -30.0
            logp[a, b] = 0.0
    p = transformer.init_params(cfg, jax.random.PRNGKey(0))
    head = np.zeros((H, V), np.float32)
    head[:V] = logp / np.sqrt(H)  # rms_norm(one-hot * sqrt(H)) = one-hot * sqrt(H)
    p = {**p, "embed": jnp.eye(V, H) * np.sqrt(H), "lm_head": jnp.asarray(head),
         "layers": {**p["layers"], "wo": jnp.zeros_like(p["layers"]["wo"]),
                    "w_down": jnp.zeros_like(p["layers"]["w_down"])}}
    return Target.from_params(cfg, p, None), logp


def two_phrase_data(logp: np.ndarray, n: int, length: int, seed: int = 0) -> DistillData:
    """Sequences sampled from the bigram itself (= what the target generates), 2 prompt tokens each."""
    rng = np.random.default_rng(seed)
    probs = np.exp(logp.astype(np.float64))
    probs /= probs.sum(1, keepdims=True)
    starts = [MARKER] + [t for ph in PHRASES for t in ph]
    cdf = np.cumsum(probs, axis=1)
    x = np.zeros((n, length), np.int32)
    x[:, 0] = rng.choice(starts, size=n)
    u = rng.random((n, length))
    for t in range(1, length):  # vectorised over sequences: inverse-CDF sampling of the next token
        x[:, t] = np.minimum((u[:, t:t + 1] > cdf[x[:, t - 1]]).sum(axis=1), V - 1)
    seqs = list(x)
    mask = [np.r_[np.zeros(2, np.int8), np.ones(length - 2, np.int8)] for _ in seqs]
    return DistillData([f"ex{i}" for i in range(n)], seqs, mask, [2] * n, [False] * n, {})


@pytest.fixture(scope="module")
def toy_runs(tmp_path_factory):
    target, logp = two_phrase_target()
    data = two_phrase_data(logp, 192, 32)
    cfg = TrainConfig(steps=120, batch_size=8, seq_len=32, lr=5e-3, warmup_frac=0.05, weight_decay=0.0,
                      checkpoint_every=10_000, eval_every=10_000, log_every=10_000, eval_examples=8)
    opts = {"num_layers": 1, "block_size": BLOCK, "taps": [1], "num_anchors": 12}
    runs = {}
    # DSpark drafts from the 16 most frequent of the 32 ids (a reduced vocabulary through training and export)
    for name, extra in (("dflash", {}), ("dspark", {"markov_rank": 8, "draft_vocab_size": 16})):
        module = dflash if name == "dflash" else dspark
        run_dir = tmp_path_factory.mktemp(name)
        summary = train(module.make_task(target, **opts, **extra), target, data, cfg, run_dir, progress=False,
                        eval_draft_len=BLOCK, log=lambda m: None)
        runs[name] = (summary, create_drafter(name, target, BLOCK, path=str(run_dir)))
    return target, runs


def test_toy_two_phrases_dspark_tau_at_least_1_5x_dflash(toy_runs):
    target, runs = toy_runs
    prompts = [[MARKER], [4], [7, 8], [MARKER, 4, 5, 6]] * 4
    sampling = SamplingParams(temperature=1.0)
    tau = {}
    for name, (summary, drafter) in runs.items():
        assert summary["final_eval"]["expected_tau"] > summary["first_eval"]["expected_tau"] + 0.5, name  # learnt
        out = speculative_generate(target, drafter, prompts, policy="rejection_chain", max_new_tokens=40,
                                   sampling=sampling, seed=0)
        tau[name] = out.metrics.tau
    print(f"toy two-phrase tau: {tau}")  # shown with -s
    assert tau["dspark"] >= 1.5 * tau["dflash"], tau
    # the calibration ran at the end of training and travelled with the checkpoint
    for name in ("conf_temperature", "conf_temperature_greedy"):  # sampled and greedy fits
        temps = np.asarray(runs["dspark"][1].params[name])
        assert temps.shape == (BLOCK,) and np.all(temps > 0) and not np.all(temps == 1.0), name
    # ... and so did the reduced vocabulary, holding every id the toy language uses
    spark = runs["dspark"][1].params
    assert spark["head_t"].shape == (16, H)
    assert {MARKER, *PHRASES[0], *PHRASES[1]} <= set(np.asarray(spark["d2t"]).tolist())


def test_peer_layout_trains_and_drafts_losslessly_on_the_toy_language(toy_runs, tmp_path):
    """DSpark in the peer block layout (block_layout: peer, the layout the export needs) trained like the
    toy_runs DSpark (same data, steps, options) with one more slot, so both draft BLOCK tokens per round: its
    held-out teacher-forced tau rises (it learns), the greedy engine output equals AR, and the two layouts' tau
    are printed side by side (-s). A two-phrase toy after 120 steps only indicates how the layouts compare."""
    target, runs = toy_runs
    logp = two_phrase_target()[1]
    data = two_phrase_data(logp, 192, 32)
    cfg = TrainConfig(steps=120, batch_size=8, seq_len=32, lr=5e-3, warmup_frac=0.05, weight_decay=0.0,
                      checkpoint_every=10_000, eval_every=10_000, log_every=10_000, eval_examples=8)
    task = dspark.make_task(target, num_layers=1, block_size=BLOCK + 1, taps=[1], num_anchors=12, markov_rank=8,
                            draft_vocab_size=16, block_layout="peer")
    summary = train(task, target, data, cfg, tmp_path, progress=False, eval_draft_len=BLOCK, log=lambda m: None)
    first, final = summary["first_eval"], summary["final_eval"]
    assert final["loss"] < first["loss"] and final["expected_tau"] > first["expected_tau"] + 0.5
    spec = runs["dspark"][0]["final_eval"]
    print(f"toy held-out tau after 120 steps, {BLOCK} drafts: specdec layout expected {spec['expected_tau']:.3f} "
          f"greedy {spec['greedy_tau']:.3f}; peer layout expected {final['expected_tau']:.3f} "
          f"greedy {final['greedy_tau']:.3f}")
    drafter = create_drafter(None, target, BLOCK, path=str(tmp_path))  # the layout comes from drafter.json
    assert drafter.arch.layout == "peer" and drafter.arch.drafts == BLOCK
    prompts = [[MARKER], [4], [7, 8], [MARKER, 4, 5, 6]]
    out = speculative_generate(target, drafter, prompts, policy="greedy_chain", max_new_tokens=24)
    assert out.tokens == generate(target, prompts, max_new_tokens=24).tokens
    assert out.metrics.tau > 1.5  # it drafts the phrases, not just the marker


# ---------------------------------------------------------------------------------------------------------
# Token trees from one block forward
# ---------------------------------------------------------------------------------------------------------

def as_tree(drafter, nodes: int, top_k: int, depth: int, accept: float = dflash.TREE_ACCEPT):
    """The same trained block drafter (arch and weights) drafting a tree of `nodes` nodes."""
    return type(drafter)(drafter.arch, drafter.params, nodes, tree_top_k=top_k, tree_depth=depth,
                         tree_accept=accept)


def test_tree_of_one_branch_is_the_greedy_chain_and_trees_are_lossless():
    """A tree with top_k=1 is the chain DSpark drafts greedily (slot d's logits plus the Markov bias of the node's
    own token at every depth); wider trees give greedy output == AR under both tree policies; and `update`
    writes the taps of the accepted PATH (root, then the path's nodes in order), as a chain update of those taps
    in that order would."""
    from specdec.drafter import PromptInfo, RoundContext, VerifyResult
    from specdec.testing import PROMPTS, peaky_target
    from tests.test_scheduling import random_dspark

    target = peaky_target(0)
    chain = random_dspark(target, k=4)
    hidden = jnp.asarray(np.random.default_rng(1).standard_normal((3, 4, target.cfg.hidden_size)), jnp.float32)
    root = jnp.asarray([5, 9, 3])
    tokens, _, _ = draw(chain, chain.params, hidden, root, SamplingParams(), jax.random.PRNGKey(0))
    line = as_tree(chain, 4, top_k=1, depth=4).propose_tree(chain.params, hidden, root)
    np.testing.assert_array_equal(line.tokens, tokens)
    np.testing.assert_array_equal(line.parents, np.broadcast_to(np.arange(4) - 1, (3, 4)))
    wide = as_tree(chain, 6, top_k=2, depth=3).propose_tree(chain.params, hidden, root)
    parents = np.asarray(wide.parents)
    assert np.asarray(wide.valid).all() and (parents < np.arange(6)).all()  # topologically ordered
    np.testing.assert_array_equal(np.asarray(wide.tokens)[:, 0], tokens[:, 0])  # the best root child comes first
    assert (parents != np.arange(6) - 1).any()  # branches, not a chain
    # each node's score is q of its token at its parent (`Draft.scores`): siblings share one distribution, so
    # their scores sum to at most 1, and the best-first order puts the root's likeliest child first
    scores = np.asarray(wide.scores)
    assert ((scores > 0) & (scores <= 1)).all()
    for row in range(3):
        for p in range(-1, 6):
            assert scores[row, parents[row] == p].sum() <= 1 + 1e-5
        assert scores[row, 0] == scores[row, parents[row] == -1].max()
    u = chain.head_logits(chain.params, hidden)[:, 0]
    first = jax.nn.softmax(chain.next_logits(chain.params, u[:, None], root[:, None])[:, 0], axis=-1).max(-1)
    np.testing.assert_allclose(np.asarray(line.scores)[:, 0], np.asarray(first), rtol=1e-5)

    ar = generate(target, PROMPTS, max_new_tokens=17)
    for policy in ("greedy_tree", "multidraft_tree"):
        out = speculative_generate(target, as_tree(chain, 6, top_k=2, depth=3), PROMPTS, policy=policy,
                                   max_new_tokens=17)
        assert out.tokens == ar.tokens, policy

    tree = as_tree(chain, 6, top_k=2, depth=3)
    b, t, n_taps, h = 2, 5, len(chain.taps), target.cfg.hidden_size
    rng = np.random.default_rng(2)
    prompt = PromptInfo(tokens=jnp.ones((b, t), jnp.int32), lengths=jnp.asarray([5, 3]),
                        taps=jnp.asarray(rng.standard_normal((n_taps, b, t, h)), jnp.float32),
                        first_token=jnp.ones((b,), jnp.int32))
    state = tree.init(tree.params, prompt, 32)
    taps = jnp.asarray(rng.standard_normal((n_taps, b, 7, h)), jnp.float32)  # [root, 6 nodes]
    path = jnp.asarray([[1, 3, -1, -1, -1, -1], [0, -1, -1, -1, -1, -1]])  # row 0: nodes 1 then 3; row 1: node 0
    accepted = jnp.asarray([2, 1])
    ctx = RoundContext(seq=jnp.zeros((b, 32), jnp.int32), seq_len=jnp.asarray([6, 4]) + accepted + 1,
                       done=jnp.zeros((b,), bool))
    result = VerifyResult(num_accepted=accepted, tokens=jnp.zeros((b, 7), jnp.int32), path=path)
    got = tree.update(tree.params, state, ctx, result, taps).cache
    order = jnp.asarray([[0, 2, 4, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0]])  # the root, then the path's nodes
    chain_result = VerifyResult(num_accepted=accepted, tokens=result.tokens,
                                path=jnp.asarray([[0, 1, -1, -1, -1, -1], [0, -1, -1, -1, -1, -1]]))
    want = chain.update(chain.params, state, ctx, chain_result,
                        jnp.take_along_axis(taps, order[None, :, :, None], axis=2)).cache
    np.testing.assert_array_equal(got.lengths, want.lengths)
    for a, w in zip(got.k + got.v, want.k + want.v):
        np.testing.assert_allclose(a, w, rtol=1e-6, atol=1e-6)


def test_tree_settings_are_checked():
    from specdec.testing import peaky_target
    from tests.test_scheduling import random_dspark

    chain = random_dspark(peaky_target(0), k=4)
    with pytest.raises(ValueError, match="tree_depth must be in \\[1, 4\\]"):
        as_tree(chain, 6, top_k=2, depth=5)
    with pytest.raises(ValueError, match="exceeds the 2 candidates"):
        as_tree(chain, 3, top_k=2, depth=1)


def sampled_tree_drafters():
    """The sampled-tree losslessness tests' target (`distribution_target`) and a maker of 6-node DSpark trees
    (top_k 3, depth 3) of one noisy set of weights: a reduced 5-id draft vocabulary and a random Markov head."""
    from specdec.testing import distribution_target
    from tests.test_dflash import noisy

    small = distribution_target()
    task = dspark.make_task(small, num_layers=1, block_size=3, taps=[1], markov_rank=4, draft_vocab_size=5)
    params, buffers = task.init(jax.random.PRNGKey(0), np.array([9, 1, 8, 2, 7, 3, 6, 5]))
    params = noisy(params, 2, 0.3)
    params["markov"]["w2"] = jnp.asarray(np.random.default_rng(3).standard_normal(params["markov"]["w2"].shape),
                                         jnp.float32)

    def make(cls, **tree):
        return cls.from_trained(task.arch, params, buffers, small, 6, tree_top_k=3, tree_depth=3, **tree)

    return small, make


class _RankedByItsDraw(dspark.DSparkDrafter):
    """A mutant of the dynamic sampled tree: each child ranked by the q of the token it DREW, so whether a node
    exists depends on its own draw (a likely draw survives the cut, an unlikely one is dropped)."""

    def sampled_children(self, sampling, key, d2t=None):
        honest = super().sampled_children(sampling, key, d2t)

        def draw(logits, level):
            scores, ids, dists, valid = honest(logits, level)
            q = probabilities(logits, sampling)
            own = jnp.log(jnp.maximum(jnp.take_along_axis(q, ids, axis=-1), 1e-30))
            return jnp.where(valid, own, -jnp.inf), ids, dists, valid

        return draw


def test_dynamic_sampled_tree_is_lossless_and_ranking_by_the_draw_is_not():
    """tree_sampling="dynamic": the temperature-0 tree's growth (expand the best nodes) with children drawn
    without replacement and ranked by the sorted q at their parent, kept level by level (quotas 2, 3, 1 from
    tree_accept 0.8), so the shape adapts to q row by row yet no node's existence depends on its own draw.
    Through the engine the joint law of 9 tokens at T=0.7 with top-k / top-p equals the exact one; the mutant
    that ranks each child by the q of what it drew (already at depth 1, which keeps 2 of 3 candidates) is
    biased and the check sees it (at NUM_SAMPLES rows: a subtle bias, whose smallest p-value at 2000 rows is 4e-4);
    a top-k = 2 cut leaves no valid rank-2 child."""
    from specdec.testing import assert_biased, assert_lossless, sampled_joint

    small, make = sampled_tree_drafters()
    make = functools.partial(make, tree_sampling="dynamic", tree_accept=0.8)
    assert trees.level_quotas(6, 3, 3, 0.8) == (2, 3, 1)
    tree = make(dspark.DSparkDrafter)
    assert tree.describe()["tree_sampling"] == "dynamic"
    hidden = jnp.asarray(np.random.default_rng(4).standard_normal((64, 3, small.cfg.hidden_size)), jnp.float32)
    two = tree.propose_tree(tree.params, hidden, jnp.arange(64) % 8, SamplingParams(temperature=0.7, top_k=2),
                            jax.random.PRNGKey(5))
    valid, parents, tokens = (np.asarray(x) for x in (two.valid, two.parents, two.tokens))
    assert valid.all(axis=1).any() and (parents < np.arange(6)).all()  # topological, rows of 6 valid nodes
    for row in range(64):  # siblings never repeat a token, and no node has a third (rank-2) child
        kids = [[i for i in range(6) if parents[row, i] == p and valid[row, i]] for p in range(-1, 6)]
        assert all(len(k) <= 2 and len(set(tokens[row, k])) == len(k) for k in kids), row
    np.testing.assert_allclose(np.asarray(two.probs)[valid].sum(-1), 1.0, rtol=1e-5)
    counts, impossible, m = sampled_joint(small, tree, "multidraft_tree")
    assert_lossless(counts, impossible, m)
    assert_biased(*sampled_joint(small, make(_RankedByItsDraw), "multidraft_tree")[:2])
    with pytest.raises(ValueError, match="tree_sampling must be one of fixed, dynamic"):
        make(dspark.DSparkDrafter, tree_sampling="adaptive")
    with pytest.raises(ValueError, match="tree_sampling dynamic .* needs tree_accept in \\(0, 1\\)"):
        make(dspark.DSparkDrafter, tree_accept=0.0)  # 0: the top-k tree at every temperature, no prior to keep


def test_toy_two_phrases_tree_covers_both_phrases(toy_runs):
    """At temperature 1 the chain bets on one of the two phrases after a marker; a tree of top_k=2 drafts both
    (the Markov head keeps each branch on its phrase), so multidraft_tree accepts more per round. This is the
    top-k tree (tree_accept=0), whose shape follows the scores into both phrases; the sampled trees reached 4.70
    (fixed shape) and 6.10 (the dynamic growth when it cut all levels at once, a biased cut that level-by-level
    quotas replace: docs/PARALLEL_DRAFTING.md) here, means of 3 seeds, and win on real text at T=1 (`sample_tree`)."""
    target, runs = toy_runs
    chain = runs["dspark"][1]
    prompts = [[MARKER], [4], [7, 8], [MARKER, 4, 5, 6]] * 4
    sampling = SamplingParams(temperature=1.0)
    tau_chain = speculative_generate(target, chain, prompts, policy="rejection_chain", max_new_tokens=40,
                                     sampling=sampling, seed=0).metrics.tau
    tree = as_tree(chain, 2 * BLOCK, top_k=2, depth=BLOCK, accept=0.0)  # the top-k tree at T=1 too
    tau_tree = speculative_generate(target, tree, prompts, policy="multidraft_tree", max_new_tokens=40,
                                    sampling=sampling, seed=0).metrics.tau
    print(f"toy two-phrase DSpark tau: chain {tau_chain:.2f}, tree {tau_tree:.2f}")  # shown with -s
    assert tau_tree >= 1.1 * tau_chain, (tau_chain, tau_tree)  # measured: 5.89 -> 7.01


def test_sampled_tree_is_lossless_and_its_q_excludes_earlier_siblings(monkeypatch):
    """Above temperature 0 a DSpark tree is sampled: a fixed best-first shape (`trees.rank_prior_tree`), each
    node's children drawn without replacement. Through the engine the joint law of 9 tokens at T=0.7 with top-k
    and top-p equals the exact one (`assert_lossless`), from a reduced draft vocabulary (5 of 8 ids) whose top-k
    cut leaves some rank-2 siblings nothing to draw (invalid). The negative control: the same tree whose
    siblings carry plain q instead of q without the earlier draws is biased, and the check sees it (at MUTANT_ROWS
    = 2000 rows: first-two-tokens p 3e-22)."""
    from specdec.testing import MUTANT_ROWS, assert_biased, assert_lossless, sampled_joint

    small, make = sampled_tree_drafters()
    tree = make(dspark.DSparkDrafter, tree_accept=0.5)
    assert tree.sampled_shape.paths == ((0,), (1,), (0, 0), (2,), (0, 1), (1, 0))
    hidden = jnp.asarray(np.random.default_rng(4).standard_normal((64, 3, small.cfg.hidden_size)), jnp.float32)
    two = tree.sample_tree(tree.params, hidden, jnp.arange(64) % 8, SamplingParams(temperature=0.7, top_k=2),
                           jax.random.PRNGKey(5))  # only 2 tokens to draw: the rank-2 child (node 3) is invalid
    valid = np.asarray(two.valid)
    assert valid[:, [0, 1, 2, 4, 5]].all() and not valid[:, 3].any()
    tokens = np.asarray(two.tokens)
    assert (tokens[:, 0] != tokens[:, 1]).all() and (tokens[:, 2] != tokens[:, 4]).all()  # without replacement
    np.testing.assert_allclose(np.asarray(two.probs)[:, [0, 1, 2, 4, 5]].sum(-1), 1.0, rtol=1e-5)
    counts, impossible, m = sampled_joint(small, tree, "multidraft_tree")
    assert_lossless(counts, impossible, m)
    # the mutant: each sampled sibling claims plain q, though it was drawn without its earlier siblings
    monkeypatch.setattr(trees, "without_earlier_draws", lambda q, earlier: q)
    jax.clear_caches()  # the compiled loop would otherwise reuse the correct code
    try:
        biased = sampled_joint(small, make(dspark.DSparkDrafter, tree_accept=0.5), "multidraft_tree", MUTANT_ROWS)
    finally:
        jax.clear_caches()
    assert_biased(*biased[:2])


def test_a_deeper_block_drafter_grows_from_a_trained_shallower_one(tmp_path):
    """`train.init_from` a DSpark of fewer layers: the grown drafter computes exactly what its source did (the new
    layer's output projections start at zero), the new layer is live (its wo changes the output), and a source
    deeper than the run, or another setting differing with the depth, is still refused."""
    from specdec.train import checkpoint as ckpt
    from specdec.train.loop import initial_weights

    target = random_target(tiny_config(), seed=3, scale=0.35)
    shallow = dspark.make_task(target, num_layers=1, block_size=G, markov_rank=8)
    params, buffers = shallow.init(jax.random.PRNGKey(0), None)
    rng = np.random.default_rng(5)  # every weight perturbed, the Markov head's zero W2 included
    params = jax.tree.map(lambda w: np.asarray(w) + 0.05 * rng.standard_normal(np.shape(w)).astype(np.float32),
                          params)
    source = tmp_path / "shallow"
    ckpt.write_drafter_config(source, shallow.name, shallow.config(), ckpt.target_info(target))
    ckpt.export_params(source, params, buffers, step=7)

    deep = dspark.make_task(target, num_layers=3, block_size=G, markov_rank=8)
    grown, _ = initial_weights(str(source), deep, target, *deep.init(jax.random.PRNGKey(1), None))
    layers = grown["backbone"]["layers"]
    assert layers["wq"].shape[0] == 3 and not np.any(layers["wo"][1:]) and not np.any(layers["w_down"][1:])
    np.testing.assert_array_equal(layers["wq"][2], params["backbone"]["layers"]["wq"][0])

    t = 14
    tokens = jnp.asarray(rng.integers(0, target.cfg.vocab_size, (2, t)), jnp.int32)
    taps = jnp.asarray(rng.standard_normal((len(deep.taps), 2, t, target.cfg.hidden_size)), jnp.float32)
    anchors = jnp.asarray([[2, 6], [4, 8]], jnp.int32)
    consts = deep.frozen(target)
    want, _ = shallow.forward(params, consts, tokens, taps, anchors)
    got, _ = deep.forward(grown, consts, tokens, taps, anchors)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    wo = np.array(layers["wo"])
    wo[2] = 0.05 * rng.standard_normal(wo[2].shape)
    live = {**grown, "backbone": {**grown["backbone"], "layers": {**layers, "wo": jnp.asarray(wo)}}}
    moved, _ = deep.forward(live, consts, tokens, taps, anchors)
    assert not np.allclose(moved, want, atol=1e-3)

    bigger = tmp_path / "deep"
    ckpt.write_drafter_config(bigger, deep.name, deep.config(), ckpt.target_info(target))
    ckpt.export_params(bigger, grown, buffers, step=7)
    with pytest.raises(ckpt.CheckpointError, match="differs from this run's in num_layers"):
        initial_weights(str(bigger), shallow, target, params, buffers)
    wider = dspark.make_task(target, num_layers=3, block_size=G, markov_rank=4)
    with pytest.raises(ckpt.CheckpointError, match="differs from this run's in markov_rank, num_layers"):
        initial_weights(str(source), wider, target, *wider.init(jax.random.PRNGKey(1), None))


# ---------------------------------------------------------------------------------------------------------
# The overfit check in miniature
# ---------------------------------------------------------------------------------------------------------

def test_dspark_memorises_the_greedy_answers_it_trains_on(tmp_path):
    """The overfit check (docs/TRAINING.md) in miniature, a guard on the whole training path (anchors, labels,
    features, the draft-vocabulary-free loss, the teacher-forced evaluation): DSpark from scratch, trained with
    cross-entropy on the labels for ~75 epochs on 8 of the tiny target's greedy answers, drafts the target's argmax
    as its first draft at nearly every position of those same answers (`train.eval_train_examples`), where the
    untrained drafter almost never does. (The shipped mix 0.1 CE + 0.9 L1 + 1.0 BCE reaches only ~0.4 here in the
    same budget, 0.1 CE + 0.9 L1 ~0.6: the L1 term's gradient vanishes on a peaked wrong draft; docs/TRAINING.md.)"""
    target = random_target(tiny_config(num_layers=3), seed=3, scale=0.35)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, target.cfg.vocab_size, 4).tolist() for _ in range(8)]
    answers = generate(target, prompts, max_new_tokens=20).tokens
    seqs = [np.asarray(p + a, np.int32) for p, a in zip(prompts, answers)]
    masks = [np.r_[np.zeros(len(p), np.int8), np.ones(len(a), np.int8)] for p, a in zip(prompts, answers)]
    data = DistillData([f"ex{i}" for i in range(8)], seqs, masks, [4] * 8, [False] * 8, {})
    cfg = TrainConfig(steps=150, batch_size=4, seq_len=24, lr=5e-3, warmup_frac=0.05, weight_decay=0.0,
                      checkpoint_every=10_000, eval_every=10_000, log_every=10_000, eval_examples=0,
                      eval_train_examples=8)
    task = dspark.make_task(target, num_layers=1, block_size=G, taps=[1, 2], num_anchors=8, markov_rank=8,
                            ce_weight=1.0, l1_weight=0.0, bce_weight=0.0)
    summary = train(task, target, data, cfg, tmp_path, progress=False, eval_draft_len=G, log=lambda m: None)
    first, final = summary["first_eval"]["sets"]["train"], summary["final_eval"]["sets"]["train"]
    print(f"greedy acceptance by draft step on the trained answers: {first['greedy_acceptance_by_step']} -> "
          f"{final['greedy_acceptance_by_step']}")
    assert first["greedy_acceptance_by_step"][0] < 0.3
    assert min(final["greedy_acceptance_by_step"]) >= 0.95
