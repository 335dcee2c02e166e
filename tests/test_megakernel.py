"""The megakernel backend against the reference step, in Pallas' TPU interpreter on CPU.

Every kernel run has the race detector live and DMAs executed only when waited on
(`megakernel.race_check_params()`), and asserts the detector found nothing. Each distinct shape costs one
XLA compile of the interpreted program (~3-6 s on a 2-core machine); shapes are chosen so the suite stays
within a few minutes.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec.kernels import interpret_tools as it
from specdec.kernels import megakernel as mk
from specdec.kernels import roofline
from specdec.kernels import schedule as sch
from specdec.models import transformer
from specdec.models.config import ModelConfig, tiny_config

# Compiling the interpreted kernel at XLA's lowest backend optimisation level roughly halves compile time;
# fine for the tiny configs, where the interpreter's callbacks dominate run time anyway.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def random_params(cfg: ModelConfig, seed: int = 0, scale: float = 0.08) -> dict:
    """Random weights in the stacked layout (NumPy RNG: much faster than jax.random at 135M parameters);
    norms are ones plus noise so the norm weights matter."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))

    def draw(path, s):
        if str(path[-1].key).endswith("norm"):
            return jnp.asarray(1.0 + 0.1 * rng.standard_normal(s.shape, np.float32), s.dtype)
        return jnp.asarray(scale * rng.standard_normal(s.shape, np.float32), s.dtype)
    return jax.tree_util.tree_map_with_path(draw, shapes)


def random_cache(cfg: ModelConfig, lengths, capacity: int, seed: int = 1) -> transformer.KVCache:
    """A stacked cache full of random values (so stale slots past each row's length are not zeros)."""
    rng = np.random.default_rng(seed)
    shape = (cfg.num_layers, *transformer.cache_shape(len(lengths), capacity, cfg.num_kv_heads, cfg.head_dim))
    k = jnp.asarray(rng.standard_normal(shape, np.float32), cfg.jnp_dtype)
    v = jnp.asarray(rng.standard_normal(shape, np.float32), cfg.jnp_dtype)
    return transformer.KVCache(k=k, v=v, lengths=jnp.asarray(lengths, jnp.int32))


def tree_masks(parents_per_row) -> tuple[np.ndarray, np.ndarray]:
    """Ancestor-or-self masks [B, T, T] and depths [B, T] from parent lists (-1 = root)."""
    masks, depths = [], []
    for parents in parents_per_row:
        t = len(parents)
        m, d = np.zeros((t, t), bool), np.zeros(t, np.int32)
        for i in range(t):
            j = i
            while j >= 0:
                m[i, j] = True
                j = parents[j]
            d[i] = m[i].sum() - 1
        masks.append(m)
        depths.append(d)
    return np.stack(masks), np.stack(depths)


@functools.lru_cache(maxsize=None)
def _reference(cfg: ModelConfig, taps: tuple):
    return jax.jit(functools.partial(transformer.forward, cfg=cfg, taps=taps))


@functools.lru_cache(maxsize=None)
def kernel_fn(cfg: ModelConfig, taps: tuple = (), fast_compile: bool = True, **kernel_kwargs):
    """The jitted megakernel step under the race detector, shared by tests with equal static arguments (so
    equal shapes compile once). Tests that trace the interpreter need a fresh trace: call `.__wrapped__`."""
    return jax.jit(functools.partial(mk.forward, cfg=cfg, taps=taps, interpret=mk.race_check_params(), **kernel_kwargs),
                   compiler_options=FAST_COMPILE if fast_compile else None)


def run_kernel(params, cfg, cache, tokens, positions=None, tree_mask=None, *, taps=(), logits_at=None,
               fast_compile=True, fresh=False, **kernel_kwargs):
    """One megakernel step under the race detector; asserts no race was found."""
    fn = (kernel_fn.__wrapped__ if fresh else kernel_fn)(cfg, taps, fast_compile, **kernel_kwargs)
    out = fn(params, cache=cache, tokens=tokens, positions=positions, tree_mask=tree_mask, logits_at=logits_at)
    jax.block_until_ready(out)
    assert not it.races_found(), "the race detector flagged the megakernel"
    return out


def assert_matches_reference(params, cfg, cache, tokens, positions=None, tree_mask=None, *, taps=(),
                             logits_at=None, trace=False, tol=2e-4, **kernel_kwargs):
    ref = _reference(cfg, taps)(params, cache=cache, tokens=tokens, positions=positions, tree_mask=tree_mask,
                                logits_at=logits_at)
    kernel_params = mk.prepare_params(params, cfg, subtile_cols=kernel_kwargs.pop("subtile_cols", None))
    if trace:
        with it.trace_interpreter() as tr:
            out = run_kernel(kernel_params, cfg, cache, tokens, positions, tree_mask, taps=taps,
                             logits_at=logits_at, fresh=True, **kernel_kwargs)
    else:
        tr, out = None, run_kernel(kernel_params, cfg, cache, tokens, positions, tree_mask, taps=taps,
                                   logits_at=logits_at, **kernel_kwargs)
    f32 = functools.partial(np.asarray, dtype=np.float32)
    tol = dict(rtol=tol, atol=tol)
    np.testing.assert_allclose(out.logits, ref.logits, **tol)
    np.testing.assert_allclose(f32(out.hidden), f32(ref.hidden), **tol)
    np.testing.assert_allclose(f32(out.cache.k), f32(ref.cache.k), **tol)  # new rows written, the rest untouched
    np.testing.assert_allclose(f32(out.cache.v), f32(ref.cache.v), **tol)
    np.testing.assert_array_equal(out.cache.lengths, cache.lengths)  # lengths are not advanced
    if taps:
        np.testing.assert_allclose(f32(out.taps), f32(ref.taps), **tol)
    assert out.logits.dtype == jnp.float32
    return out, tr


# ----------------------------------------------------------------------------------------------------------
# Numerical equivalence with the reference step (tiny config)
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_decode_single_token_batch1():
    """Decode (T=1) at B=1 (the same shape as the greedy test's decode steps, so they share one compile)."""
    cfg = tiny_config()
    params = random_params(cfg)
    assert_matches_reference(params, cfg, random_cache(cfg, [9], capacity=64), jnp.array([[17]], jnp.int32))


@pytest.mark.timeout(120)
def test_chain_verify_ragged_batch3_counts_dmas():
    """k=4 chain verify (T=5) at B=3 with ragged lengths: a row with two KV tiles, an empty row, a one-tile
    row. Also counts, in the interpreter, every byte the kernel DMAs and checks it against the minimum."""
    cfg = tiny_config()
    params = random_params(cfg, seed=2)
    lengths, capacity, T = [130, 0, 77], 256, 5
    cache = random_cache(cfg, lengths, capacity)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (3, T), 0, cfg.vocab_size)
    out, tr = assert_matches_reference(params, cfg, cache, tokens, taps=(0, 1, 2), trace=True)
    check_dma_bytes_and_order(tr, cfg, lengths, capacity, T, params)


@pytest.mark.timeout(120)
def test_tree_verify_ancestor_mask_batch3():
    """Tree verify: per-row token trees (ancestor masks [B, T, T]), RoPE positions = length + depth, logits
    only at chosen nodes; with Qwen-style q/k/v biases and per-head QK RMSNorm."""
    cfg = tiny_config(attention_bias=True, qk_norm=True)
    params = random_params(cfg, seed=3)
    parents = [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 2, 4]]
    mask, depth = tree_masks(parents)
    lengths = np.array([40, 3, 100], np.int32)
    cache = random_cache(cfg, lengths, capacity=128)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 6), 0, cfg.vocab_size)
    positions = jnp.asarray(lengths[:, None] + depth)
    logits_at = jnp.array([[0, 3, 5], [1, 4, 5], [2, 3, 5]], jnp.int32)
    out, _ = assert_matches_reference(params, cfg, cache, tokens, positions, jnp.asarray(mask), logits_at=logits_at)
    assert out.logits.shape == (3, 3, cfg.vocab_size)


# One sweep over the factors the kernel branches on: batch (one row / ragged rows with an empty one), width
# (decode / a 4-token verify), layout (a chain / a token tree with an ancestor mask and depth positions) and
# architecture (Llama / Qwen-style q/k/v biases with per-head QK RMSNorm). The five cases below cover every
# pair of factor levels (a pairwise design); the rest of the 16-case product runs with `pytest -m slow`.
SWEEP_PAIRWISE = {(1, 1, "chain", "llama"), (1, 4, "tree", "qwen"), (3, 1, "tree", "qwen"),
                  (3, 4, "chain", "qwen"), (3, 4, "tree", "llama")}
SWEEP = [pytest.param(*case, marks=() if case in SWEEP_PAIRWISE else pytest.mark.slow, id="-".join(map(str, case)))
         for case in itertools.product((1, 3), (1, 4), ("chain", "tree"), ("llama", "qwen"))]


def random_tree_parents(rng: np.random.Generator, width: int) -> list[int]:
    """A random token tree of `width` nodes in topological order: node i's parent is any earlier node."""
    return [-1] + [int(rng.integers(0, i)) for i in range(1, width)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch,width,layout,arch", SWEEP)
def test_matches_reference_sweep(batch, width, layout, arch):
    cfg = tiny_config(attention_bias=True, qk_norm=True) if arch == "qwen" else tiny_config()
    rng = np.random.default_rng(batch * 100 + width * 10 + len(layout))
    params = random_params(cfg, seed=int(rng.integers(1 << 16)))
    lengths = np.array([75] if batch == 1 else [130, 0, 33], np.int32)  # ragged: two KV tiles, empty, one
    cache = random_cache(cfg, lengths, capacity=192, seed=int(rng.integers(1 << 16)))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, width)), jnp.int32)
    if layout == "chain":
        assert_matches_reference(params, cfg, cache, tokens, taps=(0, 2))
        return
    mask, depth = tree_masks([random_tree_parents(rng, width) for _ in range(batch)])
    positions = jnp.asarray(lengths[:, None] + depth)
    assert_matches_reference(params, cfg, cache, tokens, positions, jnp.asarray(mask), taps=(0, 2))


@pytest.mark.timeout(120)
def test_streaming_ring_plan_counts_dmas():
    """A layer cut into 6 tiles streamed through a 3-bank ring (the plan a layer too big for VMEM gets):
    tiles straddle the wq/wk/wv/wo/... boundaries, the barrier ops fall mid-tile. In bfloat16 (the TPU dtype;
    tolerance of bf16 rounding). Same numbers, every weight byte copied exactly once, each tile's prefetch
    issued two tiles ahead."""
    cfg = tiny_config(dtype="bfloat16")
    params = random_params(cfg, seed=4)
    plan = sch.Plan(columns=sch.packed_columns(cfg), subtile_cols=96, subtiles_per_tile=1, num_banks=3, kv_tile=64)
    lengths, T = [70, 12], 3
    cache = random_cache(cfg, lengths, capacity=128)
    tokens = jnp.array([[5, 6, 7], [8, 9, 10]], jnp.int32)
    out, tr = assert_matches_reference(params, cfg, cache, tokens, taps=(1,), logits_at=jnp.array([[2], [2]]),
                                       subtile_cols=96, plan=plan, trace=True, tol=4e-2)
    check_dma_bytes_and_order(tr, cfg, lengths, 128, T, params, plan=plan)


def check_dma_bytes_and_order(tr: it.Trace, cfg, lengths, capacity, T, params, plan=None):
    """Bytes the interpreter actually copied == the analytic minimum; prefetch issued before compute."""
    plan = plan or sch.choose_plan(cfg, sch.Dims(len(lengths), T, capacity), "v5e", sch.default_subtile_cols(cfg))
    L, H, KVH, HD = cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
    size = sch.itemsize(cfg.dtype)
    (w_key,) = tr.keys_with_shape((L, plan.num_subtiles, H, plan.subtile_cols), "hbm")
    cache_keys = tr.keys_with_shape((L, *transformer.cache_shape(len(lengths), capacity, KVH, HD)), "hbm")
    (bank_key,) = tr.keys_with_shape((plan.num_banks, plan.subtiles_per_tile, H, plan.subtile_cols), "vmem")
    assert len(cache_keys) == 2

    # weights: each matrix byte exactly once per step
    matrices = sum(int(params["layers"][n].size) for n in sch.SEGMENTS) * size
    assert tr.bytes_from([w_key]) == matrices
    weight_copies = [(src_range[0], src_range[1].start) for src, src_range, _, _ in tr.copies if src == w_key]
    assert len(weight_copies) == len(set(weight_copies)) == L * plan.tiles_per_layer

    # ... which with the norm vectors (VMEM inputs, copied once by the pallas_call prologue) is the roofline's count
    norms = sum(int(params["layers"][n].size) for n in ("attn_norm", "mlp_norm")) * size
    assert matrices + norms == roofline.layer_weight_bytes(cfg)

    # KV cache: each needed tile (ceil(len / kv_tile) per row and layer) read exactly once; new rows written once
    tk = plan.kv_tile
    tiles = sum(-(-n // tk) for n in lengths)
    assert tr.bytes_from(cache_keys) == 2 * L * tiles * tk * KVH * HD * size
    assert tr.bytes_from(cache_keys) == sum(roofline.step_cost(cfg, 1, T, n, tk).kv_read_bytes for n in lengths)
    assert tr.bytes_to(cache_keys) == roofline.step_cost(cfg, len(lengths), T, 0, tk).kv_write_bytes
    seq = transformer.CACHE_SEQ_AXIS % 5  # (layer, row, KV heads, positions, HD)
    kv_reads = [(src, r[0], r[1], r[seq].start) for src, r, _, _ in tr.copies if src in cache_keys]
    assert len(kv_reads) == len(set(kv_reads)) == 2 * L * tiles
    assert tr.bytes_to(cache_keys) == 2 * L * len(lengths) * T * KVH * HD * size

    # runtime order: group the kernel's loads from the weight banks into tiles (consecutive loads of one
    # bank); the DMA of global tile g + NB - 1 must have been started before tile g's first load
    order = []  # ("start", g) / ("compute", g)
    computed, last_bank = -1, None
    for ev in tr.events:
        if ev[0] == "dma_start" and ev[1] == w_key:
            layer, sub = ev[2][0], ev[2][1].start
            order.append(("start", layer * plan.tiles_per_layer + sub // plan.subtiles_per_tile))
        elif ev[0] == "load" and ev[1] == bank_key and ev[2][0] != last_bank:
            computed, last_bank = computed + 1, ev[2][0]
            order.append(("compute", computed))
    total = L * plan.tiles_per_layer
    assert computed == total - 1
    position = {ev: i for i, ev in enumerate(order)}
    for g in range(total):
        ahead = min(g + plan.num_banks - 1, total - 1)
        assert position[("start", ahead)] < position[("compute", g)], (g, ahead)


# ----------------------------------------------------------------------------------------------------------
# The static schedule
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("model,chip", [("smollm2-135m-instruct", "v5e"), ("smollm2-135m-instruct", "v7x"),
                                        ("1b", "v7x"), ("1b", "v5e")])
def test_schedule_prefetch_distance(model, chip):
    cfg = roofline.MODELS[model]()
    plan = sch.choose_plan(cfg, sch.Dims(1, 8, 1024), chip, sch.default_subtile_cols(cfg))
    if model == "1b":
        assert not plan.whole_layer  # a 1B layer (121 MB bf16) cannot be double-buffered whole
    else:
        assert plan.whole_layer and plan.num_banks == 2
    events = sch.unrolled_schedule(cfg, plan)
    P, L = plan.tiles_per_layer, cfg.num_layers
    pos = {}
    for i, ev in enumerate(events):
        key = ev[:3] if ev[0] in ("start", "wait") else None
        if key:
            assert key not in pos, f"{key} issued twice"
            pos[key] = i
        if ev[0] == "piece":
            pos.setdefault(("first_piece", ev[1], ev[2]), i)
    # every tile started once, and waited after its start
    assert {k for k in pos if k[0] == "start"} == {("start", l, s) for l in range(L) for s in range(P)}
    for l in range(L):
        for s in range(P):
            assert pos[("start", l, s)] < pos[("wait", l, s)] < pos[("first_piece", l, s)]
    # prefetch distance: NB - 1 tiles ahead; for whole-layer double buffering, layer l+1 before layer l computes
    for g in range(L * P):
        ahead = min(g + plan.num_banks - 1, L * P - 1)
        assert pos[("start", *divmod(ahead, P))] < pos[("first_piece", *divmod(g, P))]
    if plan.whole_layer:
        for l in range(L - 1):
            assert pos[("start", l + 1, 0)] < pos[("first_piece", l, 0)]


@pytest.mark.timeout(30)
def test_layer_events_cover_every_column_once():
    cfg = tiny_config()
    for sub, k in [(576, 1), (96, 1), (96, 2), (64, 3), (192, 3)]:
        plan = sch.Plan(sch.packed_columns(cfg), sub, k, 3, 64)
        events = sch.layer_events(cfg, plan)
        widths = sch.segment_widths(cfg)
        for seg in sch.SEGMENTS:
            cols = sorted((e.seg_col, e.seg_col + e.width) for e in events if e.kind == "piece" and e.seg == seg)
            assert cols[0][0] == 0 and cols[-1][1] == widths[seg]
            assert all(a[1] == b[0] for a, b in zip(cols, cols[1:]))
        names = [e.name for e in events if e.kind == "op"]
        assert names == ["attn_norm", "attention", "mlp_norm", "act", "layer_end"]


# ----------------------------------------------------------------------------------------------------------
# VMEM budget
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_vmem_budget():
    assert sch.padded_bytes((3, 64), "float32") == 8 * 128 * 4
    assert sch.padded_bytes((3, 64), "bfloat16") == 16 * 128 * 2
    assert sch.padded_bytes((2, 9, 130), "float32") == 2 * 16 * 256 * 4
    assert sch.padded_bytes((576,), "float32") == 8 * 640 * 4

    smol = roofline.smollm2_135m_config()
    dims = sch.Dims(batch=1, num_new=8, capacity=2048)
    for chip in sch.CHIPS:
        plan = sch.choose_plan(smol, dims, chip, sch.default_subtile_cols(smol))
        limit = sch.vmem_limit_bytes(smol, plan, dims, chip)
        assert plan.whole_layer
        assert sch.vmem_footprint(smol, plan, dims) + sch.VMEM_RESERVE <= limit <= sch.CHIPS[chip].vmem_bytes

    big = roofline.llama_1b_class_config()
    sub = sch.default_subtile_cols(big)
    whole = sch.Plan(sch.packed_columns(big), sub, sch.packed_columns(big) // sub, 2, 128)
    with pytest.raises(sch.VmemBudgetError, match="v7x has 64 MiB"):
        sch.vmem_limit_bytes(big, whole, dims, "v7x")
    # a prefill far too large for any plan is refused with a clear error
    with pytest.raises(sch.VmemBudgetError, match="no megakernel plan fits"):
        sch.choose_plan(big, sch.Dims(batch=8, num_new=4096, capacity=8192), "v7x", sch.default_subtile_cols(big))


@pytest.mark.timeout(30)
def test_forward_refuses_a_plan_that_does_not_fit():
    cfg = tiny_config()
    params = mk.prepare_params(random_params(cfg), cfg)
    cache = random_cache(cfg, [3], capacity=64)
    with pytest.raises(sch.VmemBudgetError):
        mk.forward(params, cfg, cache, jnp.zeros((1, 5000), jnp.int32), chip="v7x")


# ----------------------------------------------------------------------------------------------------------
# The race detector is live: deliberate bugs in the real kernel are caught
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("bug", mk.BUGS)
def test_race_detector_catches_injected_bug(bug):
    """read_before_wait: each weight tile is read before its DMA is waited on (the wait moved after the
    compute). skip_cache_write_wait: the per-layer wait for the cache-write DMAs is dropped (they are all
    waited at the end), so the next layer overwrites the staging buffer a DMA is still reading."""
    cfg = tiny_config()
    params = mk.prepare_params(random_params(cfg), cfg)
    cache = random_cache(cfg, [20], capacity=64)
    tokens = jnp.array([[3, 4]], jnp.int32)
    fn = jax.jit(functools.partial(mk.forward, cfg=cfg, interpret=mk.race_check_params(), bug=bug),
                 compiler_options=FAST_COMPILE)
    # the detector gives each DMA a random vector-clock slot from numpy's global generator: pin it, so the
    # verdict does not depend on which tests moved the generator before this one (race_check_params' docstring)
    numpy_state = np.random.get_state()
    np.random.seed(0)
    try:
        jax.block_until_ready(fn(params, cache=cache, tokens=tokens))
        assert it.races_found(), f"injected bug {bug!r} went unnoticed"
    finally:
        np.random.set_state(numpy_state)
        it.reset()


# ----------------------------------------------------------------------------------------------------------
# Greedy decoding through the kernel == reference, token for token
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_greedy_decode_loop_matches_reference():
    cfg = tiny_config()
    params = random_params(cfg, seed=5, scale=0.3)  # peaked enough logits that argmax is well separated
    kparams = mk.prepare_params(params, cfg)
    prompt = jnp.array([[1, 45, 99, 7, 12, 200, 31]], jnp.int32)  # batch 2 runs through the engine test
    steps = 8

    def greedy(fwd, p, cache, check_races=False):
        def step(**kw):
            out = jax.block_until_ready(fwd(p, cache=cache, **kw))
            assert not (check_races and it.races_found())
            return out, jnp.argmax(out.logits[:, -1], axis=-1)[:, None].astype(jnp.int32)

        out, tok = step(tokens=prompt, logits_at=jnp.full((1, 1), prompt.shape[1] - 1))  # prefill
        cache = out.cache.advance(prompt.shape[1])
        generated = [tok]
        for _ in range(steps - 1):  # decode
            out, tok = step(tokens=tok)
            cache = out.cache.advance(1)
            generated.append(tok)
        return np.concatenate(generated, axis=1), cache

    ref_fwd, mk_fwd = _reference(cfg, ()), kernel_fn(cfg)
    ref_tokens, ref_cache = greedy(ref_fwd, params, transformer.init_cache(cfg, 1, 64, stacked=True))
    mk_tokens, mk_cache = greedy(mk_fwd, kparams, transformer.init_cache(cfg, 1, 64, stacked=True), True)
    np.testing.assert_array_equal(mk_tokens, ref_tokens)
    np.testing.assert_allclose(mk_cache.k, ref_cache.k, rtol=2e-4, atol=2e-4)
    assert len(set(ref_tokens[0].tolist())) > 1  # not a degenerate repeat


# ----------------------------------------------------------------------------------------------------------
# Real sizes: SmolLM2-135M shape (30 layers) once; a 1B-class layer streamed through the ring
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.timeout(600)
def test_real_smollm2_shape_30_layers():
    """One chain-verify step at the real SmolLM2-135M shape with random weights (slow in the interpreter:
    ~5-10 s of CPU; kept to one call)."""
    cfg = roofline.smollm2_135m_config(dtype="float32")
    params = random_params(cfg, scale=0.05)
    lengths, capacity = [130, 7], 256
    cache = random_cache(cfg, lengths, capacity)
    tokens = jnp.array([[1, 500, 9000, 42], [1, 2, 3, 4]], jnp.int32)
    plan = sch.choose_plan(cfg, sch.Dims(2, 4, capacity), "v5e", sch.default_subtile_cols(cfg))
    assert plan.whole_layer and plan.num_banks == 2
    assert_matches_reference(params, cfg, cache, tokens, fast_compile=False)


@pytest.mark.timeout(600)
def test_1b_class_layer_streams_through_ring():
    """Llama-1B layer shapes (hidden 2048, FFN 8192, Q 2048 / KV 512 columns; here as 16 x 128 query heads and
    4 KV heads to keep the interpreted program small; 2 layers, small vocab), budgeted for v7x: a layer
    (243 MB in f32) cannot be double-buffered, so it streams through a 3-bank ring, one 8 MiB tile per DMA."""
    cfg = roofline.llama_1b_class_config(dtype="float32", num_layers=2).replace(
        vocab_size=512, num_heads=16, num_kv_heads=4, head_dim=128)
    plan = sch.choose_plan(cfg, sch.Dims(1, 2, 128), "v7x", subtile_cols=1024)
    assert not plan.whole_layer and plan.num_banks == 3 and plan.tiles_per_layer == 29
    params = random_params(cfg, scale=0.02)
    cache = random_cache(cfg, [37], capacity=128)
    tokens = jnp.array([[3, 300]], jnp.int32)
    assert_matches_reference(params, cfg, cache, tokens, chip="v7x", subtile_cols=1024, fast_compile=False)


# ----------------------------------------------------------------------------------------------------------
# Lowering for TPU
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "1b"])
def test_lowers_for_tpu(model):
    """jax.export for platform "tpu" (compiled, not interpreted): the kernel lowers to a Mosaic custom call for
    every generation's VMEM plan. (Mosaic's own compilation needs libtpu; not checked here.)"""
    cfg = roofline.MODELS[model](dtype="bfloat16")
    pshape = jax.eval_shape(lambda: mk.prepare_params(transformer.init_params(cfg, jax.random.PRNGKey(0)), cfg))
    cshape = jax.eval_shape(lambda: transformer.init_cache(cfg, 2, 1024, stacked=True))
    cases = [(chip, t) for chip in sch.CHIPS for t in (1, 8)] if model != "1b" else [("v7x", 8)]
    for chip, t in cases:
        fn = jax.jit(functools.partial(mk.forward, cfg=cfg, interpret=False, chip=chip))
        exported = jax.export.export(fn, platforms=["tpu"])(
            pshape, cache=cshape, tokens=jax.ShapeDtypeStruct((2, t), jnp.int32))
        text = exported.mlir_module()
        assert text.count("tpu_custom_call") == 1
        assert exported.platforms == ("tpu",)


# ----------------------------------------------------------------------------------------------------------
# Module settings
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_interpret_defaults():
    if jax.default_backend() != "tpu":
        assert isinstance(mk.resolve_interpret(), mk.pltpu.InterpretParams)
    with mk.interpret_mode(mk.race_check_params(), chip="v7x"):
        assert mk.resolve_interpret().detect_races
        assert mk.resolve_chip() == "v7x"
    assert mk.resolve_interpret(False) is False
    assert mk.resolve_chip("v6e") == "v6e"
