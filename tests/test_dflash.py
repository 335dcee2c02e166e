"""DFlash: the batched multi-anchor training forward computes exactly the inference forward (after prefill and
after a verify round that appended context), no information leaks from later context or from other blocks, the
labels and loss masks line up (slot j <-> token anchor + j + 1), and the drafter is lossless inside the compiled
loop (greedy == AR for batch 1 and a ragged batch, every chain-capable policy; at temperature > 0 the output
follows the target distribution)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

from drafters import dflash
from specdec.drafter import PromptInfo, RoundContext
from specdec.engine import speculative_generate
from specdec.generate import generate, prefill
from specdec.models.config import tiny_config
from specdec.scheduling import ThresholdSchedule
from specdec.target import random_target
from specdec.testing import assert_draft_matches_its_q, assert_lossless, distribution_target, sampled_joint
from specdec.train.features import online_features

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12], [20, 21, 20, 21, 20, 21, 20, 21, 20, 21, 20], [3]]
G = 4


@pytest.fixture(scope="module")
def target():
    return random_target(tiny_config(num_layers=3), seed=3, scale=0.35)


def noisy(params, seed, scale=0.05):
    """Random weights everywhere (init leaves norms at exactly 1), so masks and positions matter. NumPy draws:
    one jax.random compile per leaf shape would cost seconds each on XLA:CPU."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: x + jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype), params)


@pytest.fixture(scope="module")
def setup(target):
    task = dflash.make_task(target, num_layers=2, block_size=G, taps=[1, 2], num_anchors=8)
    params, buffers = task.init(jax.random.PRNGKey(0), None)
    params = noisy(params, 1)
    consts = {**task.frozen(target), **buffers}
    drafter = dflash.DFlashDrafter.from_trained(task.arch, params, buffers, target, G)
    return task, params, consts, drafter


@functools.partial(jax.jit, static_argnames=("task", "cfg", "forward"))
def _train_logits(params, consts, tparams, tokens, anchors, *, task, cfg, forward):
    f = online_features(tparams, cfg, forward, tokens, task.taps, False)
    hidden, prev = task.forward(params, consts, tokens, f.taps, anchors)
    return task.slot_logits(params, consts, hidden, prev)


def train_logits(task, params, consts, target, tokens, anchors):
    """Training-path logits [B, N, G, V] for blocks at `anchors` over full sequences `tokens`."""
    return _train_logits(params, consts, target.params, jnp.asarray(tokens), jnp.asarray(anchors, jnp.int32),
                         task=task, cfg=target.cfg, forward=target.forward)


def test_training_forward_equals_inference_forward(target, setup):
    """Rows anchored at different positions (ragged prompts): the engine-side block forward after prefill, and
    after `update` appended a verify round's context (partial acceptance), equals the training forward's block
    at the same anchor over the whole sequence."""
    task, params, consts, drafter = setup
    rng = np.random.default_rng(0)
    seqs = rng.integers(3, 250, size=(2, 20)).astype(np.int32)
    prompt_lens = np.array([7, 4])
    accepted = np.array([2, 0])  # drafts accepted in the simulated round: the next root is at +accepted+1

    # inference: prefill the prompts (positions < P), the root x_P is the first committed-but-uncached token
    width = prompt_lens.max()
    toks = np.zeros((2, width), np.int32)
    for i, p in enumerate(prompt_lens):
        toks[i, :p] = seqs[i, :p]
    cache = target.init_cache(2, 64)
    _, taps, cache = prefill(target.params, cache, jnp.asarray(toks), jnp.asarray(prompt_lens),
                             forward=target.forward, cfg=target.cfg, taps=task.taps)
    roots = seqs[np.arange(2), prompt_lens]
    dparams = drafter.params
    prompt = PromptInfo(jnp.asarray(toks), jnp.asarray(prompt_lens), taps, jnp.asarray(roots))
    state = jax.jit(drafter.init, static_argnums=2)(dparams, prompt, 64)
    ctx = RoundContext(seq=jnp.asarray(seqs), seq_len=jnp.asarray(prompt_lens + 1), done=jnp.zeros(2, bool))
    block = jax.jit(drafter.block)
    hidden, _ = block(dparams, state, ctx)
    infer0 = drafter.head_logits(dparams, hidden)
    train0 = train_logits(task, params, consts, target, seqs, prompt_lens[:, None])[:, 0]
    np.testing.assert_allclose(infer0, train0, rtol=1e-4, atol=1e-4)

    # a verify round over [root, x_{P+1}, ..., x_{P+G}] (the true continuation as the "draft"), then update
    rows = np.arange(2)[:, None]
    verify_tokens = seqs[rows, prompt_lens[:, None] + np.arange(G + 1)]
    out = target.forward(target.params, target.cfg, cache, jnp.asarray(verify_tokens), taps=task.taps)
    new_len = prompt_lens + accepted + 1
    ctx = RoundContext(seq=jnp.asarray(seqs), seq_len=jnp.asarray(new_len + 1), done=jnp.zeros(2, bool))
    state = jax.jit(drafter.update)(dparams, state, ctx, None, out.taps)
    hidden, _ = block(dparams, state, ctx)
    infer1 = drafter.head_logits(dparams, hidden)
    train1 = train_logits(task, params, consts, target, seqs, new_len[:, None])[:, 0]
    np.testing.assert_allclose(infer1, train1, rtol=1e-4, atol=1e-4)
    assert not np.allclose(infer0, infer1, atol=1e-3)  # the anchors really differ


def test_no_leak_from_later_context_or_other_blocks(target, setup):
    task, params, consts, _ = setup
    rng = np.random.default_rng(1)
    seq = rng.integers(3, 250, size=(1, 24)).astype(np.int32)
    anchors = np.array([[5, 9, 10, 16]])
    base = np.asarray(train_logits(task, params, consts, target, seq, anchors))

    # 1. other blocks: each block alone computes exactly what it computes among others (overlapping ones too)
    for n in range(anchors.shape[1]):
        alone = np.asarray(train_logits(task, params, consts, target, seq, anchors[:, n:n + 1]))
        np.testing.assert_allclose(alone[:, 0], base[:, n], rtol=1e-5, atol=1e-5)

    # 2. later context: change every token after position 9 (the target's taps there change too)
    later = seq.copy()
    later[:, 10:] = rng.integers(3, 250, size=(1, 14))
    pert = np.asarray(train_logits(task, params, consts, target, later, anchors))
    np.testing.assert_allclose(pert[:, :2], base[:, :2], rtol=1e-5, atol=1e-5)  # anchors 5 and 9: unchanged
    assert not np.allclose(pert[:, 2:], base[:, 2:], atol=1e-3)  # anchors 10 and 16 read the changed tokens

    # 3. positive control: the context strictly before an anchor is read (position 8 changes block 9, not 5)
    before = seq.copy()
    before[:, 8] = (seq[:, 8] + 1) % 250 + 3
    pert = np.asarray(train_logits(task, params, consts, target, before, anchors))
    np.testing.assert_allclose(pert[:, 0], base[:, 0], rtol=1e-5, atol=1e-5)
    assert not np.allclose(pert[:, 1], base[:, 1], atol=1e-3)


def test_labels_and_loss_masks_line_up():
    tokens = np.arange(100, 116, dtype=np.int32)[None]  # token at position i is 100 + i
    mask = np.ones((1, 16), np.int8)
    mask[0, :4] = 0  # prompt: positions 0..3
    mask[0, 9] = 0  # a hole inside the response (e.g. a tool output)
    batch = {"tokens": jnp.asarray(tokens), "loss_mask": jnp.asarray(mask), "lengths": jnp.asarray([14])}
    anchors = jnp.asarray([[3, 6, 10, 12]], jnp.int32)
    labels, ok = dflash.block_labels(batch, anchors, jnp.ones((1, 4), bool), G)
    labels, ok = np.asarray(labels[0]), np.asarray(ok[0])
    for n, a in enumerate([3, 6, 10, 12]):
        for j in range(G):
            if a + j + 1 < 16:
                assert labels[n, j] == 100 + a + j + 1  # slot j predicts token anchor + j + 1
    # mask read at the label position, then cumulative: anchor 6 -> labels 7, 8 ok, 9 masked, 10 dropped after it
    assert ok.tolist() == [[True, True, True, True],     # labels 4..7
                           [True, True, False, False],   # labels 7, 8 | 9 masked | 10 after a masked label
                           [True, True, True, False],    # labels 11..13 | 14 is past the length
                           [True, False, False, False]]  # label 13 | 14 past the length
    # anchors are drawn only where the first label is a response token inside the example
    for seed in range(5):
        a, a_ok = dflash.sample_anchors(batch, 6, jax.random.PRNGKey(seed))
        a = np.asarray(a[0])[np.asarray(a_ok[0])]
        assert len(a) == 6 and len(set(a.tolist())) == 6
        assert all(mask[0, x + 1] == 1 and x + 1 < 14 and x >= 1 for x in a)


def test_loss_targets_the_right_tokens(target, setup):
    """The training loss (one sampled anchor) is the exp(-j/4)-weighted CE of slot j against token anchor + j + 1,
    recomputed here by hand from that block's logits (which equal the inference logits: the first test)."""
    task, params, consts, _ = setup
    rng = np.random.default_rng(2)
    seq = rng.integers(3, 250, size=(1, 16)).astype(np.int32)
    mask = np.zeros((1, 16), np.int8)
    mask[0, 6:] = 1  # the response starts at 6: anchors 5..14
    batch = {"tokens": jnp.asarray(seq), "loss_mask": jnp.asarray(mask), "lengths": jnp.asarray([16])}
    one = dflash.DFlashTask(arch=task.arch, num_anchors=1, target=target)
    f = online_features(target.params, target.cfg, target.forward, jnp.asarray(seq), task.taps, False)
    loss_fn = jax.jit(one.loss)
    for seed in range(3):
        anchors, _ = dflash.sample_anchors(batch, 1, jax.random.PRNGKey(seed))
        a = int(anchors[0, 0])
        logits = np.asarray(train_logits(task, params, consts, target, seq, [[a]]))[0, 0]
        logp = scipy.special.log_softmax(logits.astype(np.float64), axis=-1)
        w = np.exp(-np.arange(G) / 4.0) * (a + 1 + np.arange(G) < 16)
        ce = np.array([-logp[j, seq[0, min(a + j + 1, 15)]] for j in range(G)])
        loss, _ = loss_fn(params, consts, batch, f, jax.random.PRNGKey(seed))
        np.testing.assert_allclose(float(loss), np.sum(w * ce) / np.sum(w), rtol=1e-4)


@pytest.mark.parametrize("policy", ["greedy_chain", "rejection_chain", "greedy_tree"])  # multidraft_tree: below
def test_greedy_speculative_equals_ar(target, setup, policy):
    _, _, _, drafter = setup
    ar = generate(target, PROMPTS, max_new_tokens=13)
    batch = speculative_generate(target, drafter, PROMPTS, policy=policy, max_new_tokens=13)
    assert batch.tokens == ar.tokens
    if policy == "greedy_chain":  # batch 1 (one more compilation: once is enough)
        single = speculative_generate(target, drafter, PROMPTS[1:2], policy=policy, max_new_tokens=13)
        assert single.tokens[0] == ar.tokens[1]
    assert batch.metrics.proposed_draft_tokens == G * batch.metrics.rounds


def test_sampled_output_is_target_distribution():
    """tests/test_engine.py's distribution check (`assert_lossless`: joint law of 9 tokens at T=0.7 with top-k
    and top-p vs exact enumeration) with DFlash drafts sampled in parallel, verified as a chain by the
    multi-draft tree policy, under the threshold scheduler fed by DFlash's context-only confidence, from a reduced
    draft vocabulary (5 of the 8 ids: the target's other 3 can only come from the residual)."""
    small = distribution_target()
    task = dflash.make_task(small, num_layers=1, block_size=3, taps=[1], draft_vocab_size=5)
    params, buffers = task.init(jax.random.PRNGKey(0), np.array([9, 1, 8, 2, 7, 3, 6, 5]))
    np.testing.assert_array_equal(buffers["d2t"], [0, 2, 4, 6, 7])
    drafter = dflash.DFlashDrafter.from_trained(task.arch, noisy(params, 2, 0.3), buffers, small, 3)
    counts, impossible, m = sampled_joint(small, drafter, "multidraft_tree",
                                          scheduler=ThresholdSchedule(threshold=0.2))
    assert 0 < m.proposed_draft_tokens < 3 * m.rounds
    assert_lossless(counts, impossible, m)


def test_dflash_samples_from_its_q(target, setup):
    """The drafted tokens' frequencies match the returned q (T=0.7, top-k, top-p; tests/test_engine.py)."""
    assert_draft_matches_its_q(target, setup[3])


def test_bad_input(target, setup):
    task, _, _, drafter = setup
    with pytest.raises(ValueError, match="num_draft_tokens must be in"):
        dflash.DFlashDrafter(task.arch, drafter.params, G + 1)
    with pytest.raises(ValueError, match="needs a trained checkpoint"):
        dflash.make_dflash(target, 3)
    with pytest.raises(ValueError, match="mask_token_id"):
        dflash.make_task(target, mask_token_id=10_000)
    with pytest.raises(ValueError, match="draft_vocab_size must be in"):
        dflash.make_task(target, draft_vocab_size=10_000)


# ---------------------------------------------------------------------------------------------------------
# The peer block layout (block_layout: peer): slot j >= 1 predicts the token at its own position a + j
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def peer(target, setup):
    """The setup's weights (the layout changes no shape) as a peer-layout drafter: G - 1 drafts per block."""
    _, params, consts, _ = setup
    task = dflash.make_task(target, num_layers=2, block_size=G, taps=[1, 2], num_anchors=8, block_layout="peer")
    drafter = dflash.DFlashDrafter.from_trained(task.arch, params, {}, target, G - 1)
    return task, params, consts, drafter


def test_peer_layout_drafts_from_the_slots_after_the_anchor(target, setup, peer):
    """The same block forward read one slot later: peer draft i is block slot i + 1 (the mask at a + i + 1,
    predicting the token there: its label is x_{a+i+1}), specdec's draft i is slot i (predicting the next
    token); the anchor slot drafts nothing. And the engine-side block at a row's root equals the training
    forward at that anchor, in the peer layout too."""
    task, params, consts, drafter = peer
    spec_task = setup[0]
    rng = np.random.default_rng(5)
    seqs = rng.integers(3, 250, size=(2, 20)).astype(np.int32)
    anchors = jnp.asarray([[4, 9], [6, 12]], jnp.int32)
    f = online_features(target.params, target.cfg, target.forward, jnp.asarray(seqs), task.taps, False)
    h_peer, prev_peer = jax.jit(task.forward)(params, consts, jnp.asarray(seqs), f.taps, anchors)
    h_spec, prev_spec = jax.jit(spec_task.forward)(params, consts, jnp.asarray(seqs), f.taps, anchors)
    assert h_peer.shape[2] == G - 1 and h_spec.shape[2] == G
    np.testing.assert_allclose(h_peer, h_spec[:, :, 1:], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(prev_peer, prev_spec[:, :, :G - 1])  # draft i's previous token: x_{a+i}
    batch = {"tokens": jnp.asarray(seqs), "loss_mask": jnp.ones((2, 20), jnp.int8), "lengths": jnp.asarray([20, 20])}
    labels, _ = dflash.block_labels(batch, anchors, jnp.ones((2, 2), bool), task.arch.drafts)
    a = np.asarray(anchors)
    np.testing.assert_array_equal(labels, seqs[np.arange(2)[:, None, None], a[..., None] + 1 + np.arange(G - 1)])

    # inference at the root (ragged prompts) == training at the same anchor
    prompt_lens = np.array([7, 4])
    toks = np.zeros((2, 7), np.int32)
    for i, p in enumerate(prompt_lens):
        toks[i, :p] = seqs[i, :p]
    _, taps, _ = prefill(target.params, target.init_cache(2, 64), jnp.asarray(toks), jnp.asarray(prompt_lens),
                         forward=target.forward, cfg=target.cfg, taps=task.taps)
    prompt = PromptInfo(jnp.asarray(toks), jnp.asarray(prompt_lens), taps, jnp.asarray(seqs[np.arange(2), prompt_lens]))
    state = jax.jit(drafter.init, static_argnums=2)(drafter.params, prompt, 64)
    ctx = RoundContext(seq=jnp.asarray(seqs), seq_len=jnp.asarray(prompt_lens + 1), done=jnp.zeros(2, bool))
    hidden, _ = jax.jit(drafter.block)(drafter.params, state, ctx)
    np.testing.assert_allclose(drafter.head_logits(drafter.params, hidden),
                               train_logits(task, params, consts, target, seqs, prompt_lens[:, None])[:, 0],
                               rtol=1e-4, atol=1e-4)


def test_peer_layout_greedy_speculative_equals_ar(target, peer):
    drafter = peer[3]
    ar = generate(target, PROMPTS, max_new_tokens=13)
    out = speculative_generate(target, drafter, PROMPTS, policy="greedy_chain", max_new_tokens=13)
    assert out.tokens == ar.tokens
    assert out.metrics.proposed_draft_tokens == (G - 1) * out.metrics.rounds


def test_peer_layout_options_and_errors(target, setup, peer):
    task, _, _, drafter = peer
    assert task.config()["block_layout"] == "peer" and task.max_eval_steps == G - 1
    assert drafter.describe()["block_layout"] == "peer"
    # a default drafter's config and description are what they were before the option (train.init_from compares
    # configs key by key; the adaptive profiles key on the description)
    assert "block_layout" not in setup[0].config() and "qk_norm" not in setup[0].config()
    assert "block_layout" not in setup[3].describe()
    with pytest.raises(ValueError, match="the peer layout's anchor slot drafts nothing"):
        dflash.DFlashDrafter(task.arch, drafter.params, G)
    with pytest.raises(ValueError, match="needs block_size >= 2"):
        dflash.make_task(target, block_size=1, block_layout="peer")
    with pytest.raises(ValueError, match="block_layout must be one of specdec, peer"):
        dflash.make_task(target, block_layout="zlab")
    with pytest.raises(ValueError, match="qk_norm must be true, false or null"):
        dflash.make_task(target, qk_norm="yes")
    qk = dflash.make_task(target, num_layers=1, block_size=G, taps=[1], qk_norm=True)
    params, _ = qk.init(jax.random.PRNGKey(0), None)
    assert params["backbone"]["layers"]["q_norm"].shape == (1, target.cfg.head_dim)
    assert qk.config()["qk_norm"] is True
    assert dflash.arch_from_checkpoint(target, qk.config()) == qk.arch
