"""Step-function consistency of the target: one function for prefill, decode and (tree) verification."""

import functools
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec.generate import generate
from specdec.models import transformer
from specdec.models.config import tiny_config
from specdec.sampling import SamplingParams
from specdec.target import Target, random_target

CAPACITY = 64


@functools.lru_cache(maxsize=None)
def _jitted(forward):
    return jax.jit(forward, static_argnums=(1,), static_argnames=("taps",))


def jit_forward(target: Target):
    """The target's step function, jitted (cfg and taps static): eager op-by-op dispatch of a whole forward per
    new shape made these tests slow (one small compile per primitive and shape)."""
    return _jitted(target.forward)


def full_forward(target: Target, tokens, taps=()):
    cache = target.init_cache(tokens.shape[0], CAPACITY)
    return jit_forward(target)(target.params, target.cfg, cache, jnp.asarray(tokens), taps=taps)


@pytest.fixture(scope="module", params=["reference", "scan"])
def target(request):
    return random_target(tiny_config(), seed=3, backend=request.param, scale=0.1)


def rel_err(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def test_prefill_then_decode_equals_full_forward(target):
    tokens = np.random.default_rng(0).integers(3, 256, size=(1, 20)).astype(np.int32)
    full = full_forward(target, tokens).logits
    cache = target.init_cache(1, CAPACITY)
    out = jit_forward(target)(target.params, target.cfg, cache, jnp.asarray(tokens[:, :12]))
    cache = out.cache.advance(12)
    pieces = [out.logits]
    for t in range(12, 20):
        out = jit_forward(target)(target.params, target.cfg, cache, jnp.asarray(tokens[:, t : t + 1]))
        cache = out.cache.advance(1)
        pieces.append(out.logits)
    assert rel_err(jnp.concatenate(pieces, axis=1), full) < 1e-5


def test_batch_rows_equal_single_runs_with_ragged_lengths(target):
    rng = np.random.default_rng(1)
    lengths = [5, 17, 11, 2]
    tokens = np.zeros((4, 17), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(3, 256, size=n)
    cache = target.init_cache(4, CAPACITY)
    batched = jit_forward(target)(target.params, target.cfg, cache, jnp.asarray(tokens))
    for i, n in enumerate(lengths):
        single = full_forward(target, tokens[i : i + 1, :n]).logits[0]
        assert rel_err(batched.logits[i, :n], single) < 1e-5
    # then decode one step per row at each row's own length
    cache = batched.cache.with_lengths(jnp.asarray(lengths))
    nxt = rng.integers(3, 256, size=(4, 1)).astype(np.int32)
    step = jit_forward(target)(target.params, target.cfg, cache, jnp.asarray(nxt))
    for i, n in enumerate(lengths):
        seq = np.concatenate([tokens[i, :n], nxt[i]])[None]
        assert rel_err(step.logits[i, 0], full_forward(target, seq).logits[0, -1]) < 1e-5


def test_tree_masked_verify_equals_separate_chains(target):
    """A tree [root, a, b | a] scored at once equals each root-to-leaf chain scored on its own."""
    rng = np.random.default_rng(2)
    prefix = rng.integers(3, 256, size=(1, 9)).astype(np.int32)
    root, a, b, c, d = (int(x) for x in rng.integers(3, 256, size=5))
    # nodes: 0=root, 1=a (child of root), 2=b (child of a), 3=c (child of root), 4=d (child of c)
    parents = [-1, 0, 1, 0, 3]
    tree_tokens = np.array([[root, a, b, c, d]], np.int32)
    depth = np.array([0, 1, 2, 1, 2])
    mask = np.zeros((5, 5), bool)
    for i in range(5):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    cache = target.init_cache(1, CAPACITY)
    out = jit_forward(target)(target.params, target.cfg, cache, jnp.asarray(prefix))
    cache = out.cache.advance(prefix.shape[1])
    positions = jnp.asarray(prefix.shape[1] + depth)[None]
    tree = jit_forward(target)(target.params, target.cfg, cache, jnp.asarray(tree_tokens), positions, jnp.asarray(mask),
                          taps=(1,))
    for chain_nodes in ([0, 1, 2], [0, 3, 4]):
        seq = np.concatenate([prefix[0], tree_tokens[0, chain_nodes]])[None]
        ref = full_forward(target, seq, taps=(1,))
        assert rel_err(tree.logits[0, chain_nodes], ref.logits[0, -3:]) < 1e-5
        assert rel_err(tree.taps[0, 0, chain_nodes], ref.taps[0, 0, -3:]) < 1e-5


def test_deferred_cache_write_equals_writing_first(target):
    """forward(write_cache=False) leaves the cache as it was and returns the new K/V; writing them afterwards
    (write_new_rows) gives the cache, logits and taps of the usual write-then-attend step (ragged rows; a tree of
    4 new tokens, and one new token, whose attention has a form of its own)."""
    rng = np.random.default_rng(4)
    prefix = rng.integers(3, 256, size=(2, 7)).astype(np.int32)
    cache = target.init_cache(2, CAPACITY)
    cache = jit_forward(target)(target.params, target.cfg, cache, jnp.asarray(prefix)).cache
    cache = cache.with_lengths(jnp.array([7, 4], jnp.int32))  # row 1 committed only 4 of its tokens
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)
    step = jax.jit(target.forward, static_argnums=(1,), static_argnames=("taps", "write_cache"))
    for mask, depth in ((tree, [0, 1, 1, 2]), (np.ones((1, 1), bool), [0])):
        new = jnp.asarray(rng.integers(3, 256, size=(2, len(depth))).astype(np.int32))
        positions = cache.lengths[:, None] + jnp.array(depth)[None]
        ref = step(target.params, target.cfg, cache, new, positions, jnp.asarray(mask), taps=(1, 2))
        out = step(target.params, target.cfg, cache, new, positions, jnp.asarray(mask), taps=(1, 2),
                   write_cache=False)
        for a, b in zip(jax.tree.leaves(out.cache), jax.tree.leaves(cache)):
            assert np.array_equal(a, b)
        written = transformer.write_new_rows(out.cache, out.new_kv)
        assert rel_err(out.logits, ref.logits) < 1e-5 and rel_err(out.taps, ref.taps) < 1e-5
        for a, b in zip(jax.tree.leaves(written), jax.tree.leaves(ref.cache)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_taps_follow_hidden_states_convention(target):
    tokens = np.arange(3, 13, dtype=np.int32)[None]
    out = full_forward(target, tokens, taps=(0, 1, 2))
    assert out.taps.shape == (3, 1, 10, target.cfg.hidden_size)
    embed = target.params["embed"][tokens]
    assert jnp.allclose(out.taps[0], embed)
    final = transformer.rms_norm(out.taps[2], target.params["final_norm"], target.cfg.rms_norm_eps)
    assert jnp.allclose(final, out.hidden, atol=1e-6)


def test_logits_at_selects_positions(target):
    tokens = np.arange(3, 19, dtype=np.int32).reshape(2, 8)
    full = full_forward(target, tokens).logits
    cache = target.init_cache(2, CAPACITY)
    sel = jit_forward(target)(target.params, target.cfg, cache, jnp.asarray(tokens), logits_at=jnp.array([[7], [3]]))
    assert rel_err(sel.logits[:, 0], jnp.stack([full[0, 7], full[1, 3]])) < 1e-6


def test_reference_and_scan_backends_agree():
    cfg = tiny_config()
    ref, scan = random_target(cfg, seed=5, scale=0.1), random_target(cfg, seed=5, backend="scan", scale=0.1)
    tokens = np.arange(3, 23, dtype=np.int32)[None]
    assert rel_err(full_forward(scan, tokens).logits, full_forward(ref, tokens).logits) < 1e-5


@pytest.mark.parametrize("flags", [dict(attention_bias=True), dict(qk_norm=True), dict(tie_word_embeddings=False),
                                   dict(rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0),
                                                      ("low_freq_factor", 1.0),
                                                      ("original_max_position_embeddings", 64),
                                                      ("rope_type", "llama3")))])
def test_family_flags_keep_step_consistency(flags):
    target = random_target(tiny_config(**flags), seed=7, scale=0.1)
    tokens = np.arange(3, 15, dtype=np.int32)[None]
    full = full_forward(target, tokens).logits
    cache = target.init_cache(1, CAPACITY)
    out = jit_forward(target)(target.params, target.cfg, cache, jnp.asarray(tokens[:, :6]))
    out2 = jit_forward(target)(target.params, target.cfg, out.cache.advance(6), jnp.asarray(tokens[:, 6:]))
    assert rel_err(jnp.concatenate([out.logits, out2.logits], 1), full) < 1e-5


@pytest.mark.parametrize("flags", [dict(), dict(attention_bias=True, qk_norm=True), dict(tie_word_embeddings=False)])
def test_fused_layout_equals_standard_layout(flags):
    """The reference backend's fused [out, in] layout (`fuse_layers`) computes what the standard layout computes,
    through both product forms of `dense_t` (at most SKINNY_ROWS rows: W @ x^T; more: x @ W^T), and converts
    back exactly."""
    cfg = tiny_config(**flags)
    standard = transformer.unstack_layers(transformer.init_params(cfg, jax.random.PRNGKey(3), scale=0.1))
    fused = transformer.fuse_layers(standard)
    assert transformer.is_fused(fused["layers"][0]) and ("lm_head_t" in fused) == (not cfg.tie_word_embeddings)
    assert not any(k in fused["layers"][0] for k in transformer.LAYER_KEYS if not k.endswith("norm"))
    back = transformer.standard_layers(fused)
    assert jax.tree.structure(back) == jax.tree.structure(standard)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(standard)):
        np.testing.assert_array_equal(a, b)
    stacked = transformer.stack_layers(fused)  # stacking always gives the standard layout (scan, sharding)
    assert stacked["layers"]["wq"].shape == (cfg.num_layers, cfg.hidden_size, cfg.q_size)

    step = jax.jit(transformer.forward, static_argnums=(1,))
    rng = np.random.default_rng(0)
    for batch, width in ((1, 1), (1, 4), (3, 2), (2, 40)):  # 1, 4, 6 rows (skinny) and 80 rows
        cache = transformer.init_cache(cfg, batch, CAPACITY).with_lengths(jnp.array([5, 9, 2][:batch]))
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, width)), jnp.int32)
        want = step(standard, cfg, cache, tokens)
        got = step(fused, cfg, cache, tokens)
        assert rel_err(got.logits, want.logits) < 1e-5, (batch, width)
        for a, b in zip(jax.tree.leaves(got.cache.k), jax.tree.leaves(want.cache.k)):
            assert rel_err(a, b) < 1e-5


def test_cache_layout_is_head_major():
    """[B, KVH, S, HD] per layer, [L, B, KVH, S, HD] stacked; the axis helpers name the same axes in both."""
    cfg = tiny_config()
    for stacked, lead in ((False, ()), (True, (cfg.num_layers,))):
        cache = transformer.init_cache(cfg, 3, 40, stacked=stacked)
        leaf = jax.tree.leaves(cache.k)[0]
        assert leaf.shape == lead + (3, cfg.num_kv_heads, 40, cfg.head_dim)
        assert leaf.shape[cache.batch_axis(leaf)] == 3 and leaf.shape[cache.seq_axis(leaf)] == 40
        assert leaf.shape[cache.head_axis(leaf)] == cfg.num_kv_heads and cache.capacity == 40


def test_write_rows_places_each_row_at_its_offset():
    b, t, kvh, s, hd = 3, 4, 2, 16, 5
    new = jnp.asarray(np.random.default_rng(0).standard_normal((b, t, kvh, hd)), jnp.float32)
    lengths = jnp.array([0, 7, 14])  # the last row would run past the end: shifted back to slots 12..15
    out = np.asarray(jax.jit(transformer.write_rows)(jnp.full((b, kvh, s, hd), -1.0), new, lengths))
    want = np.full((b, kvh, s, hd), -1.0, np.float32)
    for row, start in enumerate([0, 7, 12]):
        want[row, :, start:start + t] = np.swapaxes(np.asarray(new[row]), 0, 1)
    np.testing.assert_array_equal(out, want)


def test_attend_matches_per_head_reference():
    """Grouped-query attention with the merged (group, token) query axis equals a per-query-head loop."""
    b, t, nh, kvh, s, hd = 2, 3, 6, 2, 10, 8
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(shape).astype(np.float32)
               for shape in ((b, t, nh, hd), (b, kvh, s, hd), (b, kvh, s, hd)))
    mask = rng.random((b, t, s)) < 0.6
    mask[..., 0] = True  # at least one visible slot per query
    got = np.asarray(transformer.attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask)))
    want = np.zeros((b, t, nh, hd), np.float32)
    for row in range(b):
        for head in range(nh):
            kv_head = head // (nh // kvh)
            scores = q[row, :, head] @ k[row, kv_head].T / np.sqrt(hd)  # [T, S]
            scores = np.where(mask[row], scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            want[row, :, head] = (p / p.sum(-1, keepdims=True)) @ v[row, kv_head]
    np.testing.assert_allclose(got, want.reshape(b, t, nh * hd), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks XLA:CPU's compiled program")
@pytest.mark.parametrize("batch,new_tokens", [(1, 1), (2, 1), (1, 4), (2, 4)])
def test_compiled_step_does_not_copy_the_cache(batch, new_tokens):
    """The jitted step with a donated cache updates it in place: no copy or transpose the size of a layer's cache
    (with the old [B, S, KVH, HD] layout XLA:CPU re-laid out every layer's cache for attention on every step)."""
    import re

    target = random_target(tiny_config(), seed=3)
    cache = target.init_cache(batch, CAPACITY)
    step = jax.jit(lambda p, c, x: target.forward(p, target.cfg, c, x), donate_argnums=(1,))
    text = step.lower(target.params, cache, jnp.ones((batch, new_tokens), jnp.int32)).compile().as_text()
    cache_dims = sorted(d for d in cache.k[0].shape if d > 1)
    hits = [line.strip() for line in text.splitlines()
            if (m := re.search(r"= \w+\[([\d,]+)\]\S* (?:copy|transpose)\(", line))
            and sorted(d for d in map(int, m.group(1).split(",")) if d > 1) == cache_dims]
    assert not hits, hits[:3]


def test_generate_batch_equals_single_and_stops_at_eos():
    target = random_target(tiny_config(), seed=11, scale=0.5)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20]]
    batch = generate(target, prompts, max_new_tokens=12)
    for p, row in zip(prompts, batch.tokens):
        assert generate(target, [p], max_new_tokens=12).tokens[0] == row
        assert len(row) <= 12
        if len(row) < 12:
            assert row[-1] in target.eos_token_ids
    sampled = generate(target, prompts, max_new_tokens=8, sampling=SamplingParams(1.0, top_k=20), seed=1)
    again = generate(target, prompts, max_new_tokens=8, sampling=SamplingParams(1.0, top_k=20), seed=1)
    assert sampled.tokens == again.tokens


def test_bad_model_config_is_refused():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tiny_config(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        tiny_config(dtype="int8")


@pytest.mark.real_model
def test_real_model_answers_paris(real_target):
    tok = real_target.tokenizer
    out = generate(real_target, [tok.encode_chat("What is the capital of France?")], max_new_tokens=24)
    assert "Paris" in tok.decode(out.tokens[0])
