"""The target model: a Llama-family decoder in plain JAX, and its one step function.

`forward` serves prefill, single-token decode and multi-token (chain or tree) verification alike:
given new tokens per row, their RoPE positions and an attention mask among the new tokens, it writes their
K/V into the preallocated cache at each row's own length and returns logits (and, on request, hidden
states after chosen layers). It does not advance the cache lengths: the caller commits how many of the new
tokens are kept (all of them in prefill and decode, the accepted prefix in verification).

Parameter layout. The canonical layout stacks each per-layer weight along a leading layer axis
(`params["layers"]["wq"]` has shape [L, H, Q]) so that `lax.scan` and the Pallas megakernel can walk the
layers and a mesh can shard them. XLA:CPU runs a Python-unrolled walk over per-layer arrays about 1.5x
faster than a scan (the scan copies each layer's weight slice every step; see docs/BENCHMARKS.md), so the
reference backend also accepts `params["layers"]` as a tuple of per-layer dicts (`unstack_layers`). The
function below handles both; which one a target uses is decided once, when it is built.

The reference backend goes one step further (`fuse_layers`, run once when its target is built): each layer's
q|k|v and gate|up weights are concatenated into one matrix, and every layer matrix (and an untied lm_head) is
stored [out, in]. Products of up to 64 rows (decode, verify) then run as `W @ x^T` (`dense_t`), which XLA:CPU
streams 1.05-3.7x faster than `x @ W` at 2-16 rows (docs/BENCHMARKS.md). `standard_layers`
converts back; `forward` accepts every layout.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec.models.config import ModelConfig

Params = dict[str, Any]

LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
BIAS_KEYS = ("bq", "bk", "bv")
QK_NORM_KEYS = ("q_norm", "k_norm")


def layer_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's weights, stored [in, out] so activations multiply on the left."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    shapes = {"attn_norm": (h,), "wq": (h, cfg.q_size), "wk": (h, cfg.kv_size), "wv": (h, cfg.kv_size),
              "wo": (cfg.q_size, h), "mlp_norm": (h,), "w_gate": (h, f), "w_up": (h, f), "w_down": (f, h)}
    if cfg.attention_bias:
        shapes.update(bq=(cfg.q_size,), bk=(cfg.kv_size,), bv=(cfg.kv_size,))
    if cfg.qk_norm:
        shapes.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
    return shapes


def init_params(cfg: ModelConfig, key: jax.Array, scale: float = 0.02) -> Params:
    """Random weights in the canonical (stacked) layout, for tests and for training from scratch."""
    dtype = cfg.jnp_dtype
    shapes = layer_param_shapes(cfg)
    keys = jax.random.split(key, len(shapes) + 2)
    layers = {}
    for k, (name, shape) in zip(keys[2:], sorted(shapes.items())):
        if name.endswith("norm"):
            layers[name] = jnp.ones((cfg.num_layers, *shape), dtype)
        else:
            layers[name] = (scale * jax.random.normal(k, (cfg.num_layers, *shape))).astype(dtype)
    params = {
        "embed": (scale * jax.random.normal(keys[0], (cfg.vocab_size, cfg.hidden_size))).astype(dtype),
        "final_norm": jnp.ones((cfg.hidden_size,), dtype),
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = (scale * jax.random.normal(keys[1], (cfg.hidden_size, cfg.vocab_size))).astype(dtype)
    return params


def unstack_layers(params: Params) -> Params:
    """Stacked layout -> tuple of per-layer dicts (the fast layout for XLA:CPU)."""
    layers = params["layers"]
    if isinstance(layers, (tuple, list)):
        return params
    num_layers = next(iter(layers.values())).shape[0]
    per_layer = tuple({k: v[i] for k, v in layers.items()} for i in range(num_layers))
    return {**params, "layers": per_layer}


def stack_layers(params: Params) -> Params:
    """Tuple of per-layer dicts (standard or fused) -> stacked standard layout (for scan, the megakernel and
    sharding)."""
    params = standard_layers(params)
    layers = params["layers"]
    if isinstance(layers, dict):
        return params
    stacked = {k: jnp.stack([layer[k] for layer in layers]) for k in layers[0]}
    return {**params, "layers": stacked}


FUSED_KEYS = ("wqkv_t", "wo_t", "w_gate_up_t", "w_down_t")  # [out, in] each; "bqkv" with attention biases


def is_fused(layer: dict) -> bool:
    return "wqkv_t" in layer


def fuse_layers(params: Params) -> Params:
    """Any layout -> per-layer dicts with q|k|v and gate|up fused and every matrix stored [out, in] (an untied
    lm_head too, as "lm_head_t" [V, H]): the reference backend's layout, the fastest on XLA:CPU."""
    params = unstack_layers(params)

    def fuse(w: dict) -> dict:
        if is_fused(w):
            return w
        out = {k: v for k, v in w.items() if k not in LAYER_KEYS + BIAS_KEYS or k.endswith("norm")}
        out["wqkv_t"] = jnp.concatenate([w["wq"], w["wk"], w["wv"]], axis=1).T
        out["wo_t"] = w["wo"].T
        out["w_gate_up_t"] = jnp.concatenate([w["w_gate"], w["w_up"]], axis=1).T
        out["w_down_t"] = w["w_down"].T
        if "bq" in w:
            out["bqkv"] = jnp.concatenate([w["bq"], w["bk"], w["bv"]])
        return out

    fused = {k: v for k, v in params.items() if k not in ("layers", "lm_head")}
    if "lm_head" in params:
        fused["lm_head_t"] = params["lm_head"].T
    fused["layers"] = tuple(fuse(w) for w in params["layers"])
    return fused


def standard_layers(params: Params) -> Params:
    """The inverse of `fuse_layers` (per-layer dicts, [in, out] matrices, an [H, V] lm_head); any other layout
    is returned as it is."""
    layers = params["layers"]
    if isinstance(layers, dict) or not is_fused(layers[0]):
        return params

    def split(w: dict) -> dict:
        q, kv, f = w["wo_t"].shape[1], (w["wqkv_t"].shape[0] - w["wo_t"].shape[1]) // 2, w["w_down_t"].shape[1]
        out = {k: v for k, v in w.items() if k not in FUSED_KEYS + ("bqkv",)}
        wq, wk, wv = jnp.split(w["wqkv_t"].T, [q, q + kv], axis=1)
        gate, up = jnp.split(w["w_gate_up_t"].T, [f], axis=1)
        out.update(wq=wq, wk=wk, wv=wv, wo=w["wo_t"].T, w_gate=gate, w_up=up, w_down=w["w_down_t"].T)
        if "bqkv" in w:
            out.update(zip(BIAS_KEYS, jnp.split(w["bqkv"], [q, q + kv])))
        return out

    standard = {k: v for k, v in params.items() if k not in ("layers", "lm_head_t")}
    if "lm_head_t" in params:
        standard["lm_head"] = params["lm_head_t"].T
    standard["layers"] = tuple(split(w) for w in layers)
    return standard


# A product with at most this many rows (decode, verify, batch-64 data generation) runs as W @ x^T, more rows
# (prefill, training) as x @ W^T: at 2-16 rows XLA:CPU streams [out, in] weights 1.2-2x faster the first way, at
# 64 rows it is as fast or faster (`python -m benchmarks.bench_products`, docs/BENCHMARKS.md).
SKINNY_ROWS = 64


def dense_t(x: jax.Array, w_t: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., in] times a weight stored [out, in]: [..., out]."""
    rows = math.prod(x.shape[:-1])
    if rows <= SKINNY_ROWS:
        y = jnp.einsum("oi,ni->on", w_t, x.reshape(rows, x.shape[-1]), preferred_element_type=out_dtype)
        # the barrier keeps XLA from folding the transpose below into the product, which would turn it back
        # into the slow x @ W^T form ([rows, out] output) that this branch exists to avoid
        return jax.lax.optimization_barrier(y).T.reshape(x.shape[:-1] + (w_t.shape[0],))
    return jnp.einsum("...i,oi->...o", x, w_t, preferred_element_type=out_dtype)


# ----------------------------------------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------------------------------------

# The cache layout is [B, KVH, S, HD] per layer and [L, B, KVH, S, HD] stacked: each (row, KV head) owns a
# contiguous [S, HD] slab. Attention for one (row, KV head) is then two plain 2D matmuls over that slab with no
# relayout; with the sequence axis outside the heads ([B, S, KVH, HD]) XLA:CPU re-materialised every layer's
# cache in the dots' operand layout on every step (docs/BENCHMARKS.md). It is also the natural TPU layout
# (the megakernel DMAs [KVH, kv_tile, HD] tiles). Counted from the end, the axes are the same in both layouts;
# use these (or the KVCache helpers) instead of hard-coding positions.
CACHE_BATCH_AXIS = -4
CACHE_HEAD_AXIS = -3  # KV heads: what a mesh shards for tensor parallelism
CACHE_SEQ_AXIS = -2


def cache_shape(batch_size: int, capacity: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """Shape of one layer's K (or V) cache: [B, KVH, S, HD]."""
    return (batch_size, num_kv_heads, capacity, head_dim)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Preallocated keys and values plus the number of valid positions in each row.

    `k` and `v` are tuples of per-layer arrays [B, KVH, S, HD] (reference backend) or single stacked arrays
    [L, B, KVH, S, HD] (scan / megakernel). In both layouts the batch axis is `ndim - 4`, the KV-head axis
    `ndim - 3` and the sequence axis `ndim - 2` (CACHE_*_AXIS; `batch_axis(leaf)` etc. give them as
    non-negative ints), which is all that cache utilities (compaction, row reset, sharding) need to know.
    """

    k: Any
    v: Any
    lengths: jax.Array  # int32 [B]

    @staticmethod
    def batch_axis(leaf: jax.Array) -> int:
        return leaf.ndim + CACHE_BATCH_AXIS

    @staticmethod
    def head_axis(leaf: jax.Array) -> int:
        return leaf.ndim + CACHE_HEAD_AXIS

    @staticmethod
    def seq_axis(leaf: jax.Array) -> int:
        return leaf.ndim + CACHE_SEQ_AXIS

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        leaf = jax.tree.leaves(self.k)[0]
        return leaf.shape[self.seq_axis(leaf)]

    def advance(self, num_new: jax.Array) -> "KVCache":
        """Commit `num_new` [B] (or a scalar) of the positions just written by `forward`."""
        return dataclasses.replace(self, lengths=self.lengths + jnp.asarray(num_new, jnp.int32))

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))


def init_cache(cfg: ModelConfig, batch_size: int, capacity: int, stacked: bool = False,
               dtype=None) -> KVCache:
    dtype = dtype or cfg.jnp_dtype
    shape = cache_shape(batch_size, capacity, cfg.num_kv_heads, cfg.head_dim)
    if stacked:
        k = jnp.zeros((cfg.num_layers, *shape), dtype)
        v = jnp.zeros((cfg.num_layers, *shape), dtype)
    else:
        k = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
        v = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    return KVCache(k=k, v=v, lengths=jnp.zeros((batch_size,), jnp.int32))


# ----------------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------------

def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies, with Llama-3 style frequency scaling when the config asks for it."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(half, dtype=np.float64) * 2.0 / cfg.head_dim))
    if cfg.rope_scaling is not None and dict(cfg.rope_scaling).get("rope_type", "default") == "llama3":
        s = dict(cfg.rope_scaling)
        factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_ctx = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        scaled = np.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
        inv_freq = scaled
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x: [B, T, heads, HD]; cos/sin: [B, T, HD/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(cfg))
    return jnp.cos(angles), jnp.sin(angles)


def attention_mask(lengths: jax.Array, capacity: int, tree_mask: jax.Array) -> jax.Array:
    """Which cache slots each new token may attend to: [B, T, S] bool.

    Slots before a row's length hold its committed prefix (always visible). The T new tokens were written at
    slots lengths[b] .. lengths[b]+T-1; among them `tree_mask[b, t, u]` says whether token t sees token u
    (lower-triangular for a chain, the ancestor relation for a tree). Slots past the new tokens are stale.
    """
    num_new = tree_mask.shape[-1]
    slots = jnp.arange(capacity)[None, None, :]
    rel = slots - lengths[:, None, None]  # [B, 1, S]
    in_new = (rel >= 0) & (rel < num_new)
    rel_clipped = jnp.clip(rel, 0, num_new - 1)
    among_new = jnp.take_along_axis(tree_mask, jnp.broadcast_to(rel_clipped, tree_mask.shape[:2] + (capacity,)),
                                    axis=2)
    return (rel < 0) | (in_new & among_new)


def write_rows(cache_layer: jax.Array, new: jax.Array, lengths: jax.Array) -> jax.Array:
    """Write new [B, T, KVH, HD] into cache [B, KVH, S, HD] at each row's own offset (in place under jit).

    A write that would run past the end is shifted back to fit (dynamic_update_slice's rule, which the
    megakernel mirrors). Written as one scatter of B*KVH*T rows of HD values, which XLA:CPU performs in place on
    the donated buffer. Not a dynamic_update_slice: at B=1, T=1 (plain decode) XLA fuses a copy of the
    dynamic_update_slice into the attention dot's operand and then copies every layer's cache to keep both
    (4 cache-sized copies per layer); a (vmapped) scatter with a single index is rewritten into exactly that.
    Indexing each KV head separately keeps at least KVH indices, so the scatter stays a scatter.
    """
    b, t, kvh, _ = new.shape
    capacity = cache_layer.shape[CACHE_SEQ_AXIS]
    if t > capacity:  # static; the scatter below promises in-bounds indices
        raise ValueError(f"cannot write {t} new positions into a cache of capacity {capacity}")
    start = jnp.clip(lengths, 0, capacity - t)
    slots = start[:, None, None] + jnp.arange(t, dtype=start.dtype)[None, None, :]  # [B, 1, T]
    rows = jnp.arange(b)[:, None, None]
    heads = jnp.arange(kvh)[None, :, None]
    return cache_layer.at[rows, heads, slots].set(jnp.swapaxes(new, 1, 2).astype(cache_layer.dtype),
                                                  mode="promise_in_bounds", unique_indices=True)


def attend(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention of new queries over the whole (already updated) cache.

    q: [B, T, NH, HD]; caches: [B, KVH, S, HD]; mask: [B, T, S]. Returns [B, T, NH*HD].

    The cache slots are the rows of each product: per (row, KV head), scores [S, G*T] = K [S, HD] x Q [HD, G*T]
    (the G query heads sharing the KV head and the T new tokens merged into G*T columns), then out [G*T, HD] =
    P^T [G*T, S] x V [S, HD]; only the small query / output blocks are transposed, never the [S, HD] slabs.
    The other form, query rows ([G*T, HD] x [HD, S]), costs about the same at batch <= 32, but at batch 64 with
    the speculative loop's 528 cache slots XLA:CPU ran it 4.4x slower (30 layers at T = 2: 799 against 180 ms,
    `python -m benchmarks.bench_attention`), and a verify round cost 3.3 plain decode steps where its tokens' work
    is 1.5 (docs/BENCHMARKS.md).
    T = 1 (plain decode) keeps its own function (`_attend_one`). Scores, softmax and the value accumulation are
    float32.
    """
    if q.shape[1] == 1:
        return _attend_one(q, k_cache, v_cache, mask)
    return _attend_slot_rows(q, k_cache, v_cache, mask)


def _columns_mask(mask: jax.Array, groups: int) -> jax.Array:
    """A [B, T, K] mask (new token t may see key k) as [B, 1, K, G*T], the layout of slot-row scores: column
    g*T + t is query head g of new token t (`_query_rows`)."""
    b, t, k = mask.shape
    return jnp.broadcast_to(jnp.swapaxes(mask, 1, 2)[:, None, :, None, :], (b, 1, k, groups, t)).reshape(
        b, 1, k, groups * t)


def _attend_slot_rows(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, mask: jax.Array) -> jax.Array:
    b, t, nh, hd = q.shape
    kvh = k_cache.shape[1]
    qm = _query_rows(q, kvh)  # [B, KVH, G*T, HD]
    scores = jnp.einsum("bksd,bkqd->bksq", k_cache, qm, preferred_element_type=jnp.float32) * (1.0 / math.sqrt(hd))
    scores = jnp.where(_columns_mask(mask, nh // kvh), scores, -1e30)
    probs = jax.nn.softmax(scores, axis=2).astype(v_cache.dtype)
    out = jnp.einsum("bksq,bksd->bkqd", probs, v_cache, preferred_element_type=jnp.float32)
    return _from_query_rows(out, q)


def _attend_one(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, mask: jax.Array) -> jax.Array:
    """`attend` for one new token per row (plain decode), with the cache slots as the rows of each product:
    scores [S, G] = K [S, HD] x q [HD, G], then out [G, HD] = p^T [G, S] x V [S, HD]. The same sums as `attend`'s
    [G, HD] x [HD, S] products. XLA:CPU ran 30 chained layers of it 1.5x faster at batch 64 and 1.2x at batch 8,
    and 0.9x at batch 1, ~0.3 ms of a ~30 ms step (benchmarks/bench_attention.py, docs/BENCHMARKS.md).
    `_attend_slot_rows` is the same form for T new tokens."""
    b, _, nh, hd = q.shape
    kvh = k_cache.shape[1]
    qm = q.reshape(b, kvh, nh // kvh, hd)  # query head kvh*G + g is the g-th head of KV head kvh
    scores = jnp.einsum("bksd,bkgd->bksg", k_cache, qm, preferred_element_type=jnp.float32) * (1.0 / math.sqrt(hd))
    scores = jnp.where(mask[:, 0, None, :, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=2).astype(v_cache.dtype)
    out = jnp.einsum("bksg,bksd->bkgd", probs, v_cache, preferred_element_type=jnp.float32)
    return out.reshape(b, 1, nh * hd).astype(q.dtype)


def _query_rows(q: jax.Array, kvh: int) -> jax.Array:
    """[B, T, KVH*G, HD] -> [B, KVH, G*T, HD]: query head kvh*G + g is the g-th head of KV head kvh."""
    b, t, nh, hd = q.shape
    g = nh // kvh
    return q.reshape(b, t, kvh, g, hd).transpose(0, 2, 3, 1, 4).reshape(b, kvh, g * t, hd)


def _from_query_rows(out: jax.Array, q: jax.Array) -> jax.Array:
    """The inverse of `_query_rows` for the attention output [B, KVH, G*T, HD] -> [B, T, NH*HD] in q's dtype."""
    b, t, nh, hd = q.shape
    kvh = out.shape[1]
    out = out.reshape(b, kvh, nh // kvh, t, hd).transpose(0, 3, 1, 2, 4)  # [B, T, KVH, G, HD]
    return out.reshape(b, t, nh * hd).astype(q.dtype)


def attend_with_new(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, k_new: jax.Array, v_new: jax.Array,
                    lengths: jax.Array, tree_mask: jax.Array) -> jax.Array:
    """`attend` over the committed cache (read only) and the new tokens' own K/V, without writing them.

    q, k_new, v_new: [B, T, heads, HD]; caches [B, KVH, S, HD]; tree_mask [B, T, T]. One softmax over the
    S committed slots (those before each row's length) and the T new tokens (as `tree_mask` allows): the same
    attention as writing first and attending over the updated cache, but the cache is never modified, so a
    conditional (the verify bucket switch) whose branches call this passes it through untouched instead of
    copying every layer's cache in and out."""
    b, t, nh, hd = q.shape
    kvh, s = k_cache.shape[1], k_cache.shape[2]
    g = nh // kvh
    if t == 1:
        return _attend_one_with_new(q, k_cache, v_cache, k_new, v_new, lengths)
    qm = _query_rows(q, kvh)  # [B, KVH, G*T, HD]; slot-row products as in `attend`
    kn = jnp.swapaxes(k_new, 1, 2).astype(k_cache.dtype)  # [B, KVH, T, HD]
    vn = jnp.swapaxes(v_new, 1, 2).astype(v_cache.dtype)
    old = jnp.einsum("bksd,bkqd->bksq", k_cache, qm, preferred_element_type=jnp.float32)  # [B, KVH, S, G*T]
    new = jnp.einsum("bkud,bkqd->bkuq", kn, qm, preferred_element_type=jnp.float32)  # [B, KVH, T, G*T]
    committed = jnp.arange(s)[None, None, :, None] < lengths[:, None, None, None]
    old = jnp.where(committed, old, -1e30)
    new = jnp.where(_columns_mask(tree_mask, g), new, -1e30)
    probs = jax.nn.softmax(jnp.concatenate([old, new], axis=2) * (1.0 / math.sqrt(hd)), axis=2)
    out = (jnp.einsum("bksq,bksd->bkqd", probs[:, :, :s].astype(v_cache.dtype), v_cache,
                      preferred_element_type=jnp.float32)
           + jnp.einsum("bkuq,bkud->bkqd", probs[:, :, s:].astype(v_cache.dtype), vn,
                        preferred_element_type=jnp.float32))
    return _from_query_rows(out, q)


def _attend_one_with_new(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, k_new: jax.Array, v_new: jax.Array,
                         lengths: jax.Array) -> jax.Array:
    """`attend_with_new` for one new token per row (the verify switch's width-0 branch, a plain decode step):
    the cache slots as the products' rows, as in `_attend_one`, plus the token's own key and value."""
    b, _, nh, hd = q.shape
    kvh, s = k_cache.shape[1], k_cache.shape[2]
    qm = q.reshape(b, kvh, nh // kvh, hd)  # query head kvh*G + g is the g-th head of KV head kvh
    kn = k_new.reshape(b, kvh, 1, hd).astype(k_cache.dtype)
    vn = v_new.reshape(b, kvh, 1, hd).astype(v_cache.dtype)
    old = jnp.einsum("bksd,bkgd->bksg", k_cache, qm, preferred_element_type=jnp.float32)  # [B, KVH, S, G]
    new = jnp.einsum("bkud,bkgd->bkug", kn, qm, preferred_element_type=jnp.float32)  # [B, KVH, 1, G]
    committed = jnp.arange(s)[None, None, :, None] < lengths[:, None, None, None]
    scores = jnp.concatenate([jnp.where(committed, old, -1e30), new], axis=2) * (1.0 / math.sqrt(hd))
    probs = jax.nn.softmax(scores, axis=2)
    out = (jnp.einsum("bksg,bksd->bkgd", probs[:, :, :s].astype(v_cache.dtype), v_cache,
                      preferred_element_type=jnp.float32)
           + jnp.einsum("bkug,bkud->bkgd", probs[:, :, s:].astype(v_cache.dtype), vn,
                        preferred_element_type=jnp.float32))
    return out.reshape(b, 1, nh * hd).astype(q.dtype)


def project_heads(cfg: ModelConfig, w: dict, x: jax.Array, name: str) -> jax.Array:
    """One attention projection of a layer in the standard layout, `name` "q", "k" or "v": x [..., H] @ w{name}
    (+ b{name}) split into heads [..., heads, HD], per-head RMSNorm'd for q and k when the config has qk-norm;
    not yet RoPE'd. Shared with the draft layers of drafters/dflash.py, which project other inputs (its context
    features) with the same weights."""
    y = x @ w[f"w{name}"]
    if cfg.attention_bias:
        y = y + w[f"b{name}"]
    return _heads(cfg, y, name, w)


def _heads(cfg: ModelConfig, y: jax.Array, name: str, w: dict) -> jax.Array:
    """A projection [..., heads * HD] -> [..., heads, HD], q and k per-head RMSNorm'd under qk-norm."""
    heads = cfg.num_heads if name == "q" else cfg.num_kv_heads
    y = y.reshape(y.shape[:-1] + (heads, cfg.head_dim))
    if cfg.qk_norm and name != "v":
        y = rms_norm(y, w[f"{name}_norm"], cfg.rms_norm_eps)
    return y


def qkv_heads(cfg: ModelConfig, w: dict, h: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [..., NH, HD], k and v [..., KVH, HD] of the normed residual stream h, in either layer layout (the
    fused one runs a single product)."""
    if not is_fused(w):
        return tuple(project_heads(cfg, w, h, name) for name in "qkv")
    y = dense_t(h, w["wqkv_t"])
    if cfg.attention_bias:
        y = y + w["bqkv"]
    parts = jnp.split(y, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
    return tuple(_heads(cfg, part, name, w) for part, name in zip(parts, "qkv"))


def attention_output(w: dict, a: jax.Array) -> jax.Array:
    """The attention output projection of a layer, either layout."""
    return dense_t(a, w["wo_t"]) if is_fused(w) else a @ w["wo"]


def mlp(w: dict, h: jax.Array) -> jax.Array:
    """A layer's SwiGLU MLP on the normed residual stream h [..., H], either layout."""
    if not is_fused(w):
        return (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
    gate, up = jnp.split(dense_t(h, w["w_gate_up_t"]), 2, axis=-1)
    return dense_t(jax.nn.silu(gate) * up, w["w_down_t"])


def decoder_layer(cfg: ModelConfig, w: dict, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                  lengths: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array,
                  tree_mask: jax.Array | None = None):
    """One pre-norm decoder block. Writes the new K/V first, then attends over the updated buffer: attending
    to the old cache and writing afterwards makes XLA copy the whole cache every step (docs/FACTS.md).

    With `tree_mask` [B, T, T] the cache is only read (`attend_with_new`) and the new K/V [B, T, KVH, HD]
    come back in place of the updated caches, for the caller to write once (`write_new_rows`)."""
    h = rms_norm(x, w["attn_norm"], cfg.rms_norm_eps)
    q, k, v = qkv_heads(cfg, w, h)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if tree_mask is not None:
        x = x + attention_output(w, attend_with_new(q, k_cache, v_cache, k, v, lengths, tree_mask))
        k_cache, v_cache = k, v  # the new rows, not written
    else:
        k_cache = write_rows(k_cache, k, lengths)
        v_cache = write_rows(v_cache, v, lengths)
        x = x + attention_output(w, attend(q, k_cache, v_cache, mask))
    x = x + mlp(w, rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps))
    return x, k_cache, v_cache


class StepOutput(NamedTuple):
    logits: jax.Array  # float32 [B, T or P, V]
    hidden: jax.Array  # final-normed hidden states [B, T or P, H] (what the lm_head reads)
    taps: jax.Array | None  # [num_taps, B, T, H] residual stream after the chosen layers, or None
    cache: KVCache  # with the new K/V written (write_cache=True), else the cache as it was passed in
    new_kv: Any = None  # write_cache=False: (k, v) new rows [B, T, KVH, HD] per layer (stacked: [L, ...])


def write_new_rows(cache: KVCache, new_kv) -> KVCache:
    """Write `StepOutput.new_kv` of a `forward(..., write_cache=False)` into the cache at each row's length
    (lengths unchanged), as `forward` itself would have."""
    new_k, new_v = new_kv
    if isinstance(cache.k, (tuple, list)):
        k = tuple(write_rows(c, n, cache.lengths) for c, n in zip(cache.k, new_k))
        v = tuple(write_rows(c, n, cache.lengths) for c, n in zip(cache.v, new_v))
    else:  # stacked [L, ...]: one write per layer of the same rows
        write = jax.vmap(write_rows, in_axes=(0, 0, None))
        k, v = write(cache.k, new_k, cache.lengths), write(cache.v, new_v, cache.lengths)
    return dataclasses.replace(cache, k=k, v=v)


def causal_mask(num_new: int) -> jax.Array:
    return jnp.tril(jnp.ones((num_new, num_new), bool))


def lm_head(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """float32 logits [..., V] of the final-normed hidden states [..., H]."""
    if cfg.tie_word_embeddings:
        return dense_t(hidden, params["embed"], out_dtype=jnp.float32)
    if "lm_head_t" in params:
        return dense_t(hidden, params["lm_head_t"], out_dtype=jnp.float32)
    return jnp.einsum("...h,hv->...v", hidden, params["lm_head"], preferred_element_type=jnp.float32)


def final_logits(params: Params, cfg: ModelConfig, x: jax.Array,
                 logits_at: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The target's head on the residual stream after the last block, x [B, T, H]: the final RMSNorm, then the
    lm_head. Returns (hidden [B, T or P, H] in the model dtype, float32 logits); `logits_at` int32 [B, P] keeps
    only those positions, gathered before the lm_head (every backend's step and the cached-feature logits)."""
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps).astype(cfg.jnp_dtype)
    if logits_at is not None:
        hidden = jnp.take_along_axis(hidden, logits_at[..., None], axis=1)
    return hidden, lm_head(params, cfg, hidden)


def forward(params: Params, cfg: ModelConfig, cache: KVCache, tokens: jax.Array,
            positions: jax.Array | None = None, tree_mask: jax.Array | None = None, *,
            taps: tuple[int, ...] = (), logits_at: jax.Array | None = None, write_cache: bool = True) -> StepOutput:
    """Run T new tokens per row through the target, writing their K/V at slots lengths[b] + t.

    tokens: int32 [B, T]. positions: int32 [B, T] RoPE positions (default lengths[b] + t; a tree passes
    lengths[b] + depth). tree_mask: bool [T, T] or [B, T, T], token t may attend to new token u (default
    causal). taps: static layer indices whose residual-stream output to return (0 = embeddings, l = after
    block l, Hugging Face's `hidden_states[l]` convention for l < L). logits_at: optional int32 [B, P]
    indices into the T new tokens; only there are logits computed (prefill needs just the last one).
    The cache comes back with the K/V written and `lengths` unchanged. write_cache=False leaves the cache
    untouched and returns the new K/V in `new_kv` instead (same logits; see `attend_with_new`).
    """
    b, t = tokens.shape
    lengths = cache.lengths
    if positions is None:
        positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    if tree_mask is None:
        tree_mask = causal_mask(t)
    if tree_mask.ndim == 2:
        tree_mask = jnp.broadcast_to(tree_mask, (b, t, t))
    mask = attention_mask(lengths, cache.capacity, tree_mask) if write_cache else None
    deferred = None if write_cache else tree_mask
    cos, sin = rope_tables(cfg, positions)

    x = params["embed"][tokens].astype(cfg.jnp_dtype)
    tapped = {0: x} if 0 in taps else {}
    layers = params["layers"]
    if isinstance(layers, dict):  # stacked layout: scan over layers, cache stacked too
        def body(x, layer):
            w, kc, vc = layer
            x, kc, vc = decoder_layer(cfg, w, x, kc, vc, lengths, cos, sin, mask, deferred)
            return x, (x, kc, vc) if taps else (None, kc, vc)
        x, (per_layer_x, new_k, new_v) = jax.lax.scan(body, x, (layers, cache.k, cache.v))
        for l in taps:
            if l > 0:
                tapped[l] = per_layer_x[l - 1]
    else:  # per-layer layout: unrolled walk (fastest on XLA:CPU)
        new_k, new_v = [], []
        for i, w in enumerate(layers):
            x, kc, vc = decoder_layer(cfg, w, x, cache.k[i], cache.v[i], lengths, cos, sin, mask, deferred)
            new_k.append(kc)
            new_v.append(vc)
            if i + 1 in taps:
                tapped[i + 1] = x
        new_k, new_v = tuple(new_k), tuple(new_v)
    new_kv = None
    if write_cache:
        new_cache = dataclasses.replace(cache, k=new_k, v=new_v)
    else:
        new_cache, new_kv = cache, (new_k, new_v)

    hidden, logits = final_logits(params, cfg, x, logits_at)
    tap_stack = jnp.stack([tapped[l] for l in taps]) if taps else None
    return StepOutput(logits=logits, hidden=hidden, taps=tap_stack, cache=new_cache, new_kv=new_kv)


# Backends whose step function can leave the cache untouched (`write_cache=False`) carry this mark; the engine's
# verify bucket switch uses it to keep the KV cache out of the conditional.
forward.defers_cache_writes = True
