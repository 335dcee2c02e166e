"""DFlash: a parallel block drafter. One bidirectional forward over [anchor, MASK x (g-1)] drafts a block of g
tokens, conditioned on the target's fused hidden states injected as keys/values into every draft layer.

Network (pure JAX; the draft layers have the target's widths and use its layer code's building blocks):
    ctx_p   = RMSNorm(fc(concat(taps_p)))        taps after target layers spaced from 1 to L-3 (never the last)
    x       = embed([anchor, MASK, ..., MASK])    the frozen target embedding, RoPE positions anchor_pos + j
    layer:  q, k, v from RMSNorm(x) as in a Llama block; the keys/values are concat(Wk ctx, Wk x) ("KV
            injection": the same ctx at every layer, through each layer's own Wk/Wv), attention bidirectional
            inside the block, over the context only at positions strictly before the anchor
    logits  = lm_head(RMSNorm(x))                 the frozen target lm_head (optionally only its columns of
                                                  the N most frequent response tokens: `draft_vocab_size`)
Layout (`block_layout`, fixed at training): "specdec" (the default; "anchor predicts next", the one convention of
`specdec.train.tasks`): slot j of a block anchored at position a predicts token a + j + 1, so a block of g slots
gives g drafts and, with the anchor (the engine's root), g + 1 verified tokens. "peer" (the layout of z-lab DFlash,
vLLM's DFlash proposer and the `sample_from_anchor: false` drafters of speculators / SGLang, which the export to
them needs): slot j >= 1 predicts the token at its own position a + j and the anchor slot's output is unused, so a
block gives g - 1 drafts. Both are one rule in draft terms: draft i (the hidden of slot i + `first_slot`) predicts
a + i + 1 with previous token x_{a+i}, so labels, weights and the heads below read `drafts` slots either way.

Training (`DFlashTask`, the shared loop): N anchors per sequence sampled inside the response; every block sees
the context strictly before its own anchor (original positions, not block ids) and its own slots, never another
block; CE against the target-generated tokens weighted exp(-j / decay), the loss mask read at the LABEL position
and multiplied cumulatively along the block. The training forward and the inference forward are the same
function (`block_forward`) with different anchors/visibility, which `tests/test_dflash.py` checks numerically.
With a reduced draft vocabulary (FR-Spec, docs/METHODS.md: the lm_head is ~20% of SmolLM2's weights and dominates a
block's memory traffic) the drafter proposes only the d2t ids, p_d is 0 elsewhere, and a label outside them
adds no CE (it cannot be drafted).

Inference (`DFlashDrafter`): the draft keeps a K/V cache of context positions only (`transformer.init_cache` /
`write_rows`, per draft layer); each round runs ONE block forward at the root, and `update` appends the
context K/V of the root and the accepted tokens (the verify step's taps), cropping the rest by length.
`draft_confidence` (for `specdec.scheduling`) is the prefix product of max_v q_j(v): it depends on the context
only, never on a sampled draft token, so every scheduler stays lossless with it.

`drafters/dspark.py` builds on this file (Markov head + confidence head) through the `head` hooks below.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from drafters import register
from specdec import trees
from specdec.drafter import (Draft, Drafter, PromptInfo, RoundContext, catch_up_width, draft_probs_to_target,
                             draft_to_target)
from specdec.models import transformer
from specdec.export.registry import register_architecture
from specdec.models.config import ModelConfig
from specdec.sampling import probabilities, sample_with_probs
from specdec.train import tasks as T
from specdec.train.checkpoint import load_trained, register_draft_vocab_axes, slice_draft_vocab

NAME = "dflash"
# Above temperature 0 a block drafter's token tree is sampled (`DFlashDrafter.sample_tree`), its fixed shape drawn
# up for this prior first-draw acceptance (`trees.rank_prior_tree`); 0: the top-k tree at every temperature
TREE_ACCEPT = 0.5
# How a tree is sampled above temperature 0: "fixed" = that shape (`sample_tree`); "dynamic" = the temperature-0
# tree's growth with sampled children ranked by q at their parent (`sampled_children`)
TREE_SAMPLINGS = ("fixed", "dynamic")
TREE_SAMPLING = "fixed"
MASK_TOKEN_NAME = "<empty_output>"  # SmolLM2: id 16, never produced in chat data
LAYOUTS = ("specdec", "peer")


def default_taps(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """`count` taps spaced evenly from layer 1 to L-3 (never the last layer), deduplicated."""
    hi = max(num_layers - 3, 1)
    return tuple(sorted({round(float(x)) for x in np.linspace(1, hi, count)}))


def default_mask_id(target) -> int:
    """The tokenizer's `<empty_output>` if it has one, else the last vocabulary id."""
    tok = getattr(target, "tokenizer", None)
    found = tok.backend.token_to_id(MASK_TOKEN_NAME) if tok is not None else None
    return int(found) if found is not None else target.cfg.vocab_size - 1


@dataclasses.dataclass(frozen=True)
class BlockArch:
    """Static shape of a block drafter (hashable; part of the compiled programs' keys)."""

    cfg: ModelConfig  # the draft layers: the target's widths, `num_layers` draft layers, float32
    taps: tuple[int, ...]
    block_size: int  # g: slots per block = drafts per round at most
    mask_id: int
    markov_rank: int = 0  # DSpark's low-rank Markov head (0: none, plain DFlash)
    draft_vocab: int = 0  # N > 0: draft only the N most frequent response tokens (the `d2t` buffer)
    layout: str = "specdec"  # "peer": [anchor, MASK...] with slot j >= 1 predicting a + j (module docstring)
    qk_norm: bool | None = None  # per-head q/k RMSNorm in the draft layers (None: as the target's layers)

    @classmethod
    def build(cls, target_cfg: ModelConfig, *, num_layers: int = 2, taps=None, block_size: int = 7,
              mask_token_id: int = -1, intermediate_size: int | None = None, markov_rank: int = 0,
              draft_vocab_size: int = 0, block_layout: str = "specdec", qk_norm: bool | None = None) -> BlockArch:
        if block_layout not in LAYOUTS:
            raise ValueError(f"block_layout must be one of {', '.join(LAYOUTS)}, got {block_layout!r}")
        if block_layout == "peer" and block_size < 2:
            raise ValueError(f"block_layout 'peer' drafts block_size - 1 tokens per block (the anchor slot drafts "
                             f"none), so it needs block_size >= 2, got {block_size}")
        if qk_norm is not None and not isinstance(qk_norm, bool):
            raise ValueError(f"qk_norm must be true, false or null (as the target), got {qk_norm!r}")
        taps = tuple(int(t) for t in taps) if taps else default_taps(target_cfg.num_layers)
        bad = [t for t in taps if not 0 <= t <= target_cfg.num_layers]
        if bad:
            raise ValueError(f"block drafter taps {bad} outside [0, {target_cfg.num_layers}]")
        if num_layers < 1 or block_size < 1:
            raise ValueError(f"num_layers and block_size must be >= 1, got {num_layers}, {block_size}")
        if not 0 <= mask_token_id < target_cfg.vocab_size:
            raise ValueError(f"mask_token_id must be in [0, {target_cfg.vocab_size}), got {mask_token_id}")
        if not 0 <= draft_vocab_size <= target_cfg.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [0, {target_cfg.vocab_size}] (0: the full vocabulary), "
                             f"got {draft_vocab_size}")
        cfg = target_cfg.replace(num_layers=int(num_layers), dtype="float32", name=f"block[{target_cfg.name}]",
                                 intermediate_size=int(intermediate_size or target_cfg.intermediate_size),
                                 qk_norm=target_cfg.qk_norm if qk_norm is None else qk_norm)
        vocab = 0 if draft_vocab_size in (0, target_cfg.vocab_size) else int(draft_vocab_size)
        return cls(cfg=cfg, taps=taps, block_size=int(block_size), mask_id=int(mask_token_id),
                   markov_rank=int(markov_rank), draft_vocab=vocab, layout=block_layout, qk_norm=qk_norm)

    @property
    def first_slot(self) -> int:
        """The block slot whose output is draft 0 (the anchor's own slot in the specdec layout, the next one in
        the peer layout)."""
        return 1 if self.layout == "peer" else 0

    @property
    def drafts(self) -> int:
        """Drafts (predictions) per block: g, or g - 1 in the peer layout."""
        return self.block_size - self.first_slot

    def to_config(self) -> dict:
        config = {"num_layers": self.cfg.num_layers, "taps": list(self.taps), "block_size": self.block_size,
                  "mask_token_id": self.mask_id, "intermediate_size": self.cfg.intermediate_size,
                  "draft_vocab_size": self.draft_vocab}
        # Written only when not the default, so the drafter.json of a default drafter stays as it was (a
        # continued run, train.init_from, compares these configs key by key).
        if self.layout != "specdec":
            config["block_layout"] = self.layout
        if self.qk_norm is not None:
            config["qk_norm"] = self.qk_norm
        return config


def numpy_rng(key: jax.Array) -> np.random.Generator:
    """A NumPy generator seeded by a JAX key. Initialisation draws with NumPy: on XLA:CPU every distinct shape
    drawn with jax.random costs a compilation (seconds), and these weights are drawn once."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.random.default_rng(np.asarray(key, np.uint32).ravel().tolist())


def init_backbone(arch: BlockArch, key: jax.Array, final_norm) -> dict:
    """Trainable backbone weights: fc, its norm, the draft layers (stacked, the target's layer layout and
    `transformer.layer_param_shapes`; norms at 1, matrices N(0, 0.02^2)), the output norm (from the target's)."""
    c = arch.cfg
    rng = numpy_rng(key)
    normal = lambda shape: jnp.asarray(0.02 * rng.standard_normal(shape), jnp.float32)
    layers = {name: jnp.ones((c.num_layers, *shape), jnp.float32) if name.endswith("norm")
              else normal((c.num_layers, *shape)) for name, shape in transformer.layer_param_shapes(c).items()}
    return {"fc": normal((len(arch.taps) * c.hidden_size, c.hidden_size)),
            "ctx_norm": jnp.ones((c.hidden_size,), jnp.float32),
            "layers": layers,
            "final_norm": jnp.asarray(final_norm, jnp.float32)}


# ---------------------------------------------------------------------------------------------------------
# The forward pass, shared by training and inference
# ---------------------------------------------------------------------------------------------------------

def fuse_context(arch: BlockArch, p: dict, taps: jax.Array) -> jax.Array:
    """taps [n_taps, B, T, H] -> ctx [B, T, H] = RMSNorm(fc(concat(taps)))."""
    x = jnp.concatenate([t.astype(jnp.float32) for t in taps], axis=-1)
    fc = x @ p["fc"] if "fc" in p else transformer.dense_t(x, p["fc_t"])
    return transformer.rms_norm(fc, p["ctx_norm"], arch.cfg.rms_norm_eps)


def _layer(p: dict, i: int) -> dict:
    """Draft layer i's weights: stacked (training) or per layer (`inference_layout`)."""
    layers = p["layers"]
    return layers[i] if isinstance(layers, (list, tuple)) else {k: v[i] for k, v in layers.items()}


def inference_layout(backbone: dict) -> dict:
    """The trained backbone as the speculative loop reads it: the draft layers one dict each with q|k|v and
    gate|up fused and matrices stored [out, in] (`transformer.fuse_layers`, the target's own fastest layout on
    XLA:CPU), fc stored [out, in] too. From the training layout (stacked [in, out] layers), every drafted round
    sliced each layer's weights out of the stack (XLA copies them, or converts them from a shipped float16
    drafter: ~14 copies a round) and ran its 7-8-row products in the slow x @ W form; at batch 1 the draft
    cost ~0.28 of a decode step (docs/BENCHMARKS.md). `block_forward`, `context_kv` and
    `fuse_context` read either layout."""
    out = {k: v for k, v in backbone.items() if k not in ("layers", "fc")}
    out["fc_t"] = backbone["fc"].T
    out["layers"] = transformer.fuse_layers({"layers": backbone["layers"]})["layers"]
    return out


def _rope(c: ModelConfig, x: jax.Array, positions: jax.Array) -> jax.Array:
    """RoPE for x [B, ..., heads, HD] at positions [B, ...] (any number of middle axes)."""
    lead = x.shape[:-2]
    flat = x.reshape((lead[0], -1) + x.shape[-2:])
    cos, sin = transformer.rope_tables(c, positions.reshape(lead[0], -1))
    return transformer.apply_rope(flat, cos, sin).reshape(x.shape)


def context_kv(arch: BlockArch, p: dict, ctx: jax.Array, positions: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    """Per draft layer, the injected keys/values of context features ctx [B, T, H] at `positions` [B, T]:
    (Wk ctx with RoPE, Wv ctx), each [B, T, KVH, HD] (the `write_rows` input layout)."""
    out = []
    for i in range(arch.cfg.num_layers):
        w = _layer(p, i)
        if transformer.is_fused(w):  # one fused product; its q part is dropped
            _, k, v = transformer.qkv_heads(arch.cfg, w, ctx)
        else:
            k, v = (transformer.project_heads(arch.cfg, w, ctx, name) for name in "kv")
        out.append((_rope(arch.cfg, k, positions), v))
    return out


def _as_cache(x: jax.Array) -> jax.Array:
    """[B, T, KVH, HD] -> the KV-cache layout (`transformer.cache_shape`), through the cache's own writer."""
    b, t, kvh, hd = x.shape
    return transformer.write_rows(jnp.zeros(transformer.cache_shape(b, t, kvh, hd), x.dtype), x,
                                  jnp.zeros((b,), jnp.int32))


def _to_bkvsd(cache_leaf: jax.Array) -> jax.Array:
    """A cache leaf as [B, KVH, S, HD] whatever the cache layout (a no-op for the current one)."""
    return jnp.moveaxis(cache_leaf, transformer.KVCache.seq_axis(cache_leaf), 2)


def block_attention(q, kb, vb, ctx_k, ctx_v, ctx_ok):
    """Attention of block queries over (visible context keys) + (all keys of their own block).

    q [B, N, G, NH, HD]; kb/vb [B, N, G, KVH, HD] (the N blocks' own keys); ctx_k/ctx_v [B, KVH, S, HD];
    ctx_ok bool [B, N, S] which context slots block n may see. Returns [B, N, G, NH*HD]. float32 scores.
    """
    b, n, g, nh, hd = q.shape
    kvh = kb.shape[3]
    qg = q.reshape(b, n, g, kvh, nh // kvh, hd)
    scale = 1.0 / math.sqrt(hd)
    s_ctx = jnp.einsum("bnikrd,bksd->bnkris", qg, ctx_k, preferred_element_type=jnp.float32) * scale
    s_ctx = jnp.where(ctx_ok[:, :, None, None, None, :], s_ctx, -1e30)
    s_blk = jnp.einsum("bnikrd,bnjkd->bnkrij", qg, kb, preferred_element_type=jnp.float32) * scale
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1)
    s = s_ctx.shape[-1]
    out = jnp.einsum("bnkris,bksd->bnikrd", probs[..., :s], ctx_v, preferred_element_type=jnp.float32)
    out = out + jnp.einsum("bnkrij,bnjkd->bnikrd", probs[..., s:], vb, preferred_element_type=jnp.float32)
    return out.reshape(b, n, g, nh * hd)


def block_forward(arch: BlockArch, p: dict, embed: jax.Array, block_tokens: jax.Array, block_pos: jax.Array,
                  ctx_kv: list, ctx_ok: jax.Array) -> jax.Array:
    """The draft layers over N blocks per row: block_tokens/block_pos int32 [B, N, G]; ctx_kv per layer
    (k, v) in the cache layout [.., S, ..]; ctx_ok [B, N, S]. Returns the normed hidden states [B, N, G, H]
    (what the lm_head reads).

    A draft layer is the target's pre-norm block (`transformer.decoder_layer`) but for its attention: block
    queries over injected context keys plus their own block, bidirectionally, instead of a causal KV cache. So
    it takes the target's projections, norm and MLP (`transformer.project_heads`, `rms_norm`, `mlp`: one
    implementation, the target's parameter names) and only the attention is its own."""
    c = arch.cfg
    x = embed[block_tokens].astype(jnp.float32)
    for i in range(c.num_layers):
        w = _layer(p, i)
        h = transformer.rms_norm(x, w["attn_norm"], c.rms_norm_eps)
        q, k, v = transformer.qkv_heads(c, w, h)
        q, k = _rope(c, q, block_pos), _rope(c, k, block_pos)
        ck, cv = ctx_kv[i]
        x = x + transformer.attention_output(w, block_attention(q, k, v, _to_bkvsd(ck), _to_bkvsd(cv), ctx_ok))
        x = x + transformer.mlp(w, transformer.rms_norm(x, w["mlp_norm"], c.rms_norm_eps))
    return transformer.rms_norm(x, p["final_norm"], c.rms_norm_eps)


def block_inputs(arch: BlockArch, tokens: jax.Array, anchors: jax.Array):
    """Block tokens [anchor, MASK...] and positions anchor + j for anchors [B, N] into tokens [B, T]:
    (block_tokens [B, N, G], block_pos [B, N, G], prev [B, N, G]) where prev[.., j] = x_{anchor + j} (the
    teacher-forced previous token of slot j: the anchor at j = 0)."""
    g = arch.block_size
    j = jnp.arange(g, dtype=jnp.int32)
    pos = anchors[..., None] + j  # [B, N, G]
    anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)
    block = jnp.where(j == 0, anchor_tok[..., None], arch.mask_id).astype(jnp.int32)
    t = tokens.shape[1]
    prev = jnp.take_along_axis(tokens[:, None, :], jnp.clip(pos, 0, t - 1), axis=2)
    return block, pos.astype(jnp.int32), prev


# ---------------------------------------------------------------------------------------------------------
# Training task
# ---------------------------------------------------------------------------------------------------------

def block_labels(batch: dict, anchors: jax.Array, anchor_ok: jax.Array, g: int):
    """Labels x_{a+j+1} [B, N, G] and their mask: the loss mask read at the LABEL position (inside the example),
    multiplied cumulatively along the block (a slot counts only if every earlier label is a response token)."""
    tokens, mask = batch["tokens"], batch["loss_mask"].astype(bool)
    t = tokens.shape[1]
    lab_pos = anchors[..., None] + 1 + jnp.arange(g)  # [B, N, G]
    inside = lab_pos < batch["lengths"][:, None, None]
    idx = jnp.clip(lab_pos, 0, t - 1)
    labels = jnp.take_along_axis(tokens[:, None, :], idx, axis=2)
    ok = inside & jnp.take_along_axis(mask[:, None, :], idx, axis=2) & anchor_ok[..., None]
    ok = jnp.cumprod(ok.astype(jnp.int32), axis=-1).astype(bool)
    return labels, ok


def sample_anchors(batch: dict, num_anchors: int, key: jax.Array):
    """Up to `num_anchors` distinct anchors per row, uniformly among positions a >= 1 whose first label x_{a+1}
    is a response token inside the example. Returns (anchors int32 [B, N] sorted, anchor_ok bool [B, N])."""
    mask = batch["loss_mask"].astype(bool)
    b, t = mask.shape
    pos = jnp.arange(t)[None, :]
    nxt = jnp.concatenate([mask[:, 1:], jnp.zeros((b, 1), bool)], axis=1)
    valid = nxt & (pos >= 1) & (pos + 1 < batch["lengths"][:, None])
    n = min(num_anchors, t)
    score = jnp.where(valid, jax.random.uniform(key, (b, t)), -1.0)
    top, idx = jax.lax.top_k(score, n)
    order = jnp.argsort(idx, axis=1)
    return (jnp.take_along_axis(idx, order, 1).astype(jnp.int32),
            jnp.take_along_axis(top, order, 1) >= 0)


@dataclasses.dataclass(frozen=True)
class DFlashTask(T.TrainTask):
    """The training side of DFlash (see the module docstring)."""

    arch: BlockArch
    num_anchors: int = 16
    position_decay: float = 4.0  # slot weight exp(-j / decay)
    eval_chunk: int = 64  # anchors per chunk in the all-anchors evaluation
    target: Any = dataclasses.field(default=None, compare=False, repr=False)

    name = NAME
    needs_target_logits = False
    # config keys that shape training only, not the weights: a continued run (train.init_from) may change them
    training_keys = ("num_anchors", "position_decay", "draft_vocab_size")

    @property
    def taps(self) -> tuple[int, ...]:
        return self.arch.taps

    @property
    def max_eval_steps(self) -> int:
        return self.arch.drafts

    def config(self) -> dict:
        return {**self.arch.to_config(), "num_anchors": self.num_anchors, "position_decay": self.position_decay}

    def init(self, key, token_counts: np.ndarray):
        buffers = {}
        if self.arch.draft_vocab:
            buffers["d2t"] = jnp.asarray(T.reduced_vocab(token_counts, self.arch.draft_vocab,
                                                         self.target.cfg.eos_token_ids))
        return {"backbone": init_backbone(self.arch, key, self.target.params["final_norm"])}, buffers

    def grow(self, params: dict, source_config: dict) -> dict:
        """A deeper drafter from a trained shallower one (`train.init_from`): its layers kept, each new layer on
        top a copy of its last with the output projections (wo, w_down) zeroed, so the new layer adds nothing
        to the residual stream and the grown drafter drafts exactly what its source did at step 0; training
        then moves the zeroed projections first (their gradients are the only nonzero ones of the new layer's
        at step 0), as in zero-initialised residual growth."""
        have, want = int(source_config["num_layers"]), self.arch.cfg.num_layers
        layers = params["backbone"]["layers"]
        extra = {name: np.repeat(np.asarray(w)[-1:], want - have, axis=0) for name, w in layers.items()}
        for name in ("wo", "w_down"):
            extra[name] = np.zeros_like(extra[name])
        grown = {name: np.concatenate([np.asarray(w), extra[name]], axis=0) for name, w in layers.items()}
        return {**params, "backbone": {**params["backbone"], "layers": grown}}

    def frozen(self, target) -> dict:
        return {"embed": target.params["embed"], "head": target.output_projection()}

    # -- heads (DSpark overrides these) -------------------------------------------------------------------
    def slot_logits(self, params, consts, hidden, prev):
        """Draft logits [..., Vd] of slots with normed hidden `hidden` and previous tokens `prev`."""
        head = consts["head"] if "d2t" not in consts else jnp.take(consts["head"], consts["d2t"], axis=1)
        return jnp.einsum("...h,hv->...v", hidden, head, preferred_element_type=jnp.float32)

    def label_ce(self, consts, logits, labels):
        """(CE of the target-id labels, argmax == label) per slot; labels outside the draft vocabulary: CE 0."""
        d2t = consts.get("d2t")
        if d2t is None:
            return T.hard_cross_entropy(logits, labels), jnp.argmax(logits, -1) == labels
        ids, known = T.to_draft_ids(labels, d2t, self.target.cfg.vocab_size)
        ce = jnp.where(known, T.hard_cross_entropy(logits, ids), 0.0)
        return ce, d2t[jnp.argmax(logits, -1)] == labels

    def slot_loss(self, params, consts, hidden, prev, labels, target_logits):
        """Per-slot loss [B, N, G] and metrics-to-average {name: [B, N, G]}."""
        ce, hit = self.label_ce(consts, self.slot_logits(params, consts, hidden, prev), labels)
        return ce, {"ce": ce, "acc": hit.astype(jnp.float32)}

    # -- shared machinery ---------------------------------------------------------------------------------
    def forward(self, params, consts, tokens, taps, anchors):
        """Hidden [B, N, D, H] and teacher-forced previous tokens [B, N, D] of the D = `arch.drafts` drafts of
        blocks at `anchors` [B, N] (draft i predicts x_{a+i+1})."""
        p = params["backbone"]
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        ctx = fuse_context(self.arch, p, taps)
        ctx_kv = [(_as_cache(k), _as_cache(v)) for k, v in context_kv(self.arch, p, ctx, positions)]
        block, pos, prev = block_inputs(self.arch, tokens, anchors)
        ctx_ok = jnp.arange(t)[None, None, :] < anchors[..., None]  # strictly before the anchor
        hidden = block_forward(self.arch, p, consts["embed"], block, pos, ctx_kv, ctx_ok)
        a = self.arch
        return hidden[..., a.first_slot:, :], prev[..., :a.drafts]  # draft i: slot i + first_slot, prev x_{a+i}

    def _weights(self, ok):
        g = self.arch.drafts
        return ok.astype(jnp.float32) * jnp.exp(-jnp.arange(g, dtype=jnp.float32) / self.position_decay)

    def _target_at(self, feats, anchors):
        """Target logits at positions anchor + j ([B, N, D, V]: the distribution of label j), or None."""
        if feats.logits is None:
            return None
        t = feats.logits.shape[1]
        idx = jnp.clip(anchors[..., None] + jnp.arange(self.arch.drafts), 0, t - 1)
        b, n, g = idx.shape
        out = jnp.take_along_axis(feats.logits, idx.reshape(b, n * g)[..., None], axis=1)
        return out.reshape(b, n, g, -1)

    def loss(self, params, consts, batch, feats, key):
        anchors, anchor_ok = sample_anchors(batch, self.num_anchors, key)
        labels, ok = block_labels(batch, anchors, anchor_ok, self.arch.drafts)
        hidden, prev = self.forward(params, consts, batch["tokens"], feats.taps, anchors)
        per_slot, parts = self.slot_loss(params, consts, hidden, prev, labels, self._target_at(feats, anchors))
        w = self._weights(ok)
        loss = jnp.sum(per_slot * w) / jnp.maximum(jnp.sum(w), 1e-6)
        metrics = {k: T.masked_mean(v, ok) for k, v in parts.items()}
        metrics["anchors"] = jnp.mean(jnp.sum(anchor_ok, axis=1).astype(jnp.float32))
        for j in range(min(self.arch.drafts, 4)):
            metrics[f"acc_slot{j}"] = T.masked_mean(parts["acc"][..., j], ok[..., j])
        return loss, metrics

    def evaluate(self, params, consts, batch, feats, num_steps: int):
        """Every position as an anchor (in chunks): the weighted loss and, per root slot and step k <
        num_steps, alpha = sum min(p_d, p_t) at temperature 1 and the argmax match (teacher-forced)."""
        tokens = batch["tokens"]
        b, t = tokens.shape
        chunk = min(self.eval_chunk, t)
        n_chunks = -(-t // chunk)
        all_anchors = jnp.arange(n_chunks * chunk, dtype=jnp.int32).reshape(n_chunks, chunk)

        def one(anchors):
            real = jnp.broadcast_to(anchors < t, (b, chunk))  # the last chunk is padded past the end
            anchors = jnp.broadcast_to(jnp.minimum(anchors, t - 1), (b, chunk))
            labels, ok = block_labels(batch, anchors, real, self.arch.drafts)
            hidden, prev = self.forward(params, consts, tokens, feats.taps, anchors)
            tl = self._target_at(feats, anchors)
            per_slot, _ = self.slot_loss(params, consts, hidden, prev, labels, tl)
            w = self._weights(ok)
            lg = self.slot_logits(params, consts, hidden, prev)[..., :num_steps, :]
            alpha, match = T.acceptance(lg, tl[..., :num_steps, :], consts.get("d2t"))
            return jnp.sum(per_slot * w), jnp.sum(w), alpha, match

        num, den, alpha, match = jax.lax.map(one, all_anchors)
        alpha = jnp.moveaxis(alpha, 0, 1).reshape(b, -1, num_steps)[:, :t]
        match = jnp.moveaxis(match, 0, 1).reshape(b, -1, num_steps)[:, :t]
        return jnp.sum(num) / jnp.maximum(jnp.sum(den), 1e-6), T.DraftEval(alpha, match)


def build_arch(target, num_layers, taps, block_size, mask_token_id, intermediate_size, markov_rank=0,
               draft_vocab_size=0, block_layout="specdec", qk_norm=None) -> BlockArch:
    """The BlockArch of the task options (mask_token_id < 0: `default_mask_id`)."""
    mask_id = default_mask_id(target) if mask_token_id is None or mask_token_id < 0 else int(mask_token_id)
    return BlockArch.build(target.cfg, num_layers=num_layers, taps=taps, block_size=block_size,
                           mask_token_id=mask_id, intermediate_size=intermediate_size, markov_rank=markov_rank,
                           draft_vocab_size=draft_vocab_size, block_layout=block_layout, qk_norm=qk_norm)


@T.register_task(NAME)
def make_task(target, num_layers: int = 2, taps: list | None = None, block_size: int = 7,
              mask_token_id: int = -1, intermediate_size: int | None = None, num_anchors: int = 16,
              position_decay: float = 4.0, draft_vocab_size: int = 0, block_layout: str = "specdec",
              qk_norm: bool | None = None) -> DFlashTask:
    """`block_layout: peer` and `qk_norm: true` train the drafter vLLM / SGLang can run (docs/EXPORT.md)."""
    if num_anchors < 1 or position_decay <= 0:
        raise ValueError(f"dflash: num_anchors must be >= 1 and position_decay > 0, got {num_anchors}, "
                         f"{position_decay}")
    arch = build_arch(target, num_layers, taps, block_size, mask_token_id, intermediate_size,
                      draft_vocab_size=draft_vocab_size, block_layout=block_layout, qk_norm=qk_norm)
    return DFlashTask(arch=arch, num_anchors=int(num_anchors), position_decay=float(position_decay), target=target)


# ---------------------------------------------------------------------------------------------------------
# Inference
# ---------------------------------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockState:
    cache: transformer.KVCache  # per draft layer: K/V of context positions; lengths = positions stored (= root's)
    confidence: jax.Array  # float32 [B, k] prefix survival a_j of the last proposal (for the schedulers)


class DFlashDrafter(Drafter):
    """Drafts the first `num_draft_tokens` (<= `arch.drafts`) drafts of one block per round."""

    kind = "chain"
    jittable = True
    has_confidence = True

    def __init__(self, arch: BlockArch, params, num_draft_tokens: int, name: str = NAME, tree_top_k: int = 0,
                 tree_depth: int = 0, tree_accept: float = TREE_ACCEPT, tree_sampling: str = TREE_SAMPLING):
        self.arch, self.num_draft_tokens, self.name = arch, int(num_draft_tokens), name
        self.taps = arch.taps
        # {"params": trained weights (`inference_layout`), "embed": target embedding, "head_t": [Vd, H],
        #  buffers (d2t: int32 [Vd])}
        self.params = params
        self.top_k, self.depth = int(tree_top_k), int(tree_depth)
        if self.top_k or self.depth:  # a token tree from the same block forward (`propose_tree`)
            if not 1 <= self.depth <= arch.drafts:
                raise ValueError(f"{name}: tree_depth must be in [1, {arch.drafts}] (the drafts of the block it was "
                                 f"trained with), got {tree_depth}")
            trees.check_tree_budget(self.num_draft_tokens, self.top_k, self.depth)
            # tree_accept > 0: above temperature 0 the tree is sampled (`sample_tree`), of this fixed shape
            self.tree_accept = float(tree_accept)
            if tree_sampling not in TREE_SAMPLINGS:
                raise ValueError(f"{name}: tree_sampling must be one of {', '.join(TREE_SAMPLINGS)}, "
                                 f"got {tree_sampling!r}")
            if tree_sampling == "dynamic" and not tree_accept:
                raise ValueError(f"{name}: tree_sampling dynamic keeps per depth what the prior tree of tree_accept "
                                 "has there (`trees.level_quotas`), which needs tree_accept in (0, 1); tree_accept 0 "
                                 "is the top-k tree at every temperature")
            self.tree_sampling = tree_sampling
            self.sampled_shape = trees.rank_prior_tree(self.num_draft_tokens, self.top_k, self.depth,
                                                       tree_accept) if tree_accept else None
            # instance attributes: a tree has no prefix survival per chain position for the schedulers; its
            # nodes come best first, so the adaptive width may verify any prefix of it
            self.kind, self.has_confidence, self.ordered_tree = "tree", False, True
        elif not 1 <= num_draft_tokens <= arch.drafts:
            why = f"block_size={arch.block_size}" if arch.layout == "specdec" else \
                f"block_size - 1 = {arch.drafts}: the peer layout's anchor slot drafts nothing"
            raise ValueError(f"{name}: num_draft_tokens must be in [1, {why}] (the block it was trained with), "
                             f"got {num_draft_tokens}")

    # trained tensors with a target-vocabulary axis that decoding reads at the draft vocabulary's ids only
    # ({name: axis}; DFlash: none, its head is the target's): cut once at load, and left out of the inference
    # format's file (specdec.train.checkpoint)
    draft_vocab_axes: dict[str, int] = {}

    @classmethod
    def from_trained(cls, arch, trained, buffers, target, num_draft_tokens, tree_top_k=0, tree_depth=0,
                     tree_accept=TREE_ACCEPT, tree_sampling=TREE_SAMPLING, cut=()):
        """`cut`: the `draft_vocab_axes` tensors that come cut already (an inference-format drafter's)."""
        buffers = {k: jnp.asarray(v) for k, v in (buffers or {}).items()}
        dtype = jnp.dtype(target.cfg.jnp_dtype)
        trained, head = jax.tree.map(jnp.asarray, trained), target.output_projection()
        if "d2t" in buffers:  # slice the vocabulary once here, not in every round
            todo = {name: axis for name, axis in cls.draft_vocab_axes.items() if name not in cut}
            head, trained = head[:, buffers["d2t"]], slice_draft_vocab(trained, buffers["d2t"], todo)
        # weights narrower than the target's dtype (a shipped float16 drafter) widened once, not in every round
        narrower = lambda x: jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < dtype.itemsize  # noqa: E731
        trained = jax.tree.map(lambda x: x.astype(dtype) if narrower(x) else x, trained)
        trained = {**trained, "backbone": inference_layout(trained["backbone"])}
        # the head stored [Vd, H]: its 7-row product runs W @ x^T (`transformer.dense_t`), 1.3-2x faster here
        params = {"params": trained, "embed": jnp.asarray(target.params["embed"]), "head_t": head.T, **buffers}
        return cls(arch, params, num_draft_tokens, tree_top_k=tree_top_k, tree_depth=tree_depth,
                   tree_accept=tree_accept, tree_sampling=tree_sampling)

    def _write_context(self, params, cache, taps, positions, at):
        """Append the context K/V of taps [n, B, W, H] at RoPE `positions` [B, W], starting at slot `at` [B]."""
        p = params["params"]["backbone"]
        kv = context_kv(self.arch, p, fuse_context(self.arch, p, taps), positions)
        k = tuple(transformer.write_rows(cache.k[i], kv[i][0], at) for i in range(len(kv)))
        v = tuple(transformer.write_rows(cache.v[i], kv[i][1], at) for i in range(len(kv)))
        return dataclasses.replace(cache, k=k, v=v)

    def init(self, params, prompt: PromptInfo, capacity: int):
        b, t = prompt.tokens.shape
        # slack past `capacity`: the block's positions, and the widest update (`catch_up_width`) at the root
        slack = max(self.arch.block_size, catch_up_width(self.num_draft_tokens)) + 2
        cache = transformer.init_cache(self.arch.cfg, b, capacity + slack, dtype=jnp.float32)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        cache = self._write_context(params, cache, prompt.taps, positions, jnp.zeros((b,), jnp.int32))
        return BlockState(cache=cache.with_lengths(prompt.lengths),
                          confidence=jnp.ones((b, self.num_draft_tokens), jnp.float32))

    def block(self, params, state: BlockState, ctx: RoundContext):
        """The block forward at each row's root: normed hidden [B, D, H] of the drafts (draft i predicts
        root_pos + i + 1)."""
        cache = state.cache
        b = cache.lengths.shape[0]
        root = jnp.take_along_axis(ctx.seq, (ctx.seq_len - 1)[:, None], axis=1)  # [B, 1]
        block, pos, _ = block_inputs(self.arch, root, jnp.zeros((b, 1), jnp.int32))
        pos = pos + cache.lengths[:, None, None]  # the root sits at position cache.lengths = seq_len - 1
        ctx_kv = list(zip(cache.k, cache.v))
        ctx_ok = (jnp.arange(cache.capacity)[None, :] < cache.lengths[:, None])[:, None, :]
        h = block_forward(self.arch, params["params"]["backbone"], params["embed"], block, pos, ctx_kv, ctx_ok)
        return h[:, 0, self.arch.first_slot:], root[:, 0]

    def head_logits(self, params, hidden):
        """The block's own logits U [B, D, V] (parallel, before any sequential head)."""
        return transformer.dense_t(hidden, params["head_t"], jnp.float32)

    def draw(self, params, hidden, root, sampling, key):
        """Draft tokens [B, k], their distributions ([B, k, V] or None when greedy), and the prefix survival
        confidence [B, k]. DFlash samples every slot in parallel, slot j at offset j with the target's noise
        there, from exactly the q it returns (both from one processed-logits tensor)."""
        k = self.num_draft_tokens
        logits = self.head_logits(params, hidden)[:, :k]
        d2t = params.get("d2t")
        tokens, q = sample_with_probs(key, logits, sampling, jnp.arange(k, dtype=jnp.int32), ids=d2t)
        tokens = draft_to_target(tokens, d2t)
        probs = None if q is None else draft_probs_to_target(q, d2t, self.arch.cfg.vocab_size)
        conf = jnp.cumprod(jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1), axis=-1)
        return tokens, probs, conf

    def next_logits(self, params, u, prev):
        """Draft logits [B, W, Vd] of the slots with block logits `u` [B, W, Vd] whose previous token is `prev`
        [B, W] (target ids). DFlash's slots ignore it; DSpark adds its Markov head's bias."""
        del params, prev
        return u

    def propose(self, params, state: BlockState, ctx: RoundContext, sampling, key):
        hidden, root = self.block(params, state, ctx)
        if self.kind == "tree":
            if not sampling.greedy and self.tree_sampling == "dynamic":
                return self.propose_tree(params, hidden, root, sampling, key), state
            if sampling.greedy or self.sampled_shape is None:
                return self.propose_tree(params, hidden, root), state
            return self.sample_tree(params, hidden, root, sampling, key), state
        tokens, probs, conf = self.draw(params, hidden, root, sampling, key)
        return Draft.chain(tokens, probs=probs), dataclasses.replace(state, confidence=conf)

    def propose_tree(self, params, hidden, root, sampling=None, key=None) -> Draft:
        """An EAGLE-2 dynamic tree (`specdec.trees.grow_dynamic_tree`) from ONE block forward: a node at depth d
        gets its children from slot d's logits (the block drafts every depth in parallel, so all nodes of a
        depth share them) through `next_logits` with the node's own token, which is where DSpark's Markov head
        makes siblings' subtrees differ. No extra network call per level: a tree costs the chain's block
        forward plus `top_k` head evaluations per level. Candidates are top-k picks, so the draft is
        deterministic (probs=None) and `greedy_tree` / `multidraft_tree` verify it losslessly. Used at
        temperature 0; above it `sample_tree` (fixed shape), or with `tree_sampling: dynamic` this growth with
        sampled children (`sampling`, `key`: `sampled_children`), or with `tree_accept: 0` these picks (whose
        node accepts only the target's mass on its top-k picks). The nodes come best first (highest cumulative
        draft log-prob; a sampled tree's level by level): the adaptive verify width may cut the tree anywhere."""
        k = self.top_k
        u = self.head_logits(params, hidden)  # [B, D, Vd]: the logits of every depth, before any previous token

        def expand(tokens, depth, mask, _):  # the frontier (the last k nodes expanded) asks for its children
            del mask
            front, front_depth = tokens[:, -k:], depth[:, -k:]  # depth d < tree_depth: its children are slot d's
            u_front = jnp.take_along_axis(u, front_depth[..., None], axis=1)
            return self.next_logits(params, u_front, front), None

        root_logits = self.next_logits(params, u[:, :1], root[:, None])[:, 0]
        draw = None if sampling is None else self.sampled_children(sampling, key, params.get("d2t"))
        draft = trees.grow_dynamic_tree(root_logits, expand, k, self.depth, self.num_draft_tokens,
                                        to_target=lambda ids: draft_to_target(ids, params.get("d2t")),
                                        best_first=True, draw=draw, prior_accept=self.tree_accept)
        if draft.probs is None:
            return draft
        probs = draft_probs_to_target(draft.probs, params.get("d2t"), self.arch.cfg.vocab_size)
        return dataclasses.replace(draft, probs=probs)

    def sampled_children(self, sampling, key, d2t=None):
        """`grow_dynamic_tree`'s `draw` for a SAMPLED dynamic tree (`trees.sampled_children`): each expanded
        node's `top_k` children drawn without replacement from q with the target's noise at their position,
        each ranked by the r-th largest q at its parent, not by what it drew, and kept level by level to the
        depth profile of `tree_accept` (`trees.grow_dynamic_tree`), so multidraft_tree's recursive rejection
        stays exact while the shape follows q from row to row (a flat q gets siblings, a peaked one a deeper
        spine). `d2t`: the draft vocabulary's target ids."""
        return trees.sampled_children(sampling, key, self.top_k, d2t)

    def sample_tree(self, params, hidden, root, sampling, key) -> Draft:
        """A SAMPLED token tree (temperature > 0) from the same block forward: the fixed shape
        `trees.rank_prior_tree` (a sampled tree cannot be pruned by what it drew), each node's children drawn
        WITHOUT replacement from q at that node (slot d's logits through `next_logits` with the node's token) by
        the Gumbel-top-k trick, in draw order. The rank-r child was drawn from q with its r earlier siblings
        removed and renormalised, and that is the q it carries: multidraft_tree's recursive rejection test
        then stays exact (Sequoia's sampling without replacement; after a rejection the residual is already
        0 at the rejected token, so no draw is wasted on it). Where q has fewer than r + 1 tokens (top-k /
        top-p), the rank-r child and its subtree are invalid. At temperature 1 with 7 nodes (a DSpark
        shipped earlier) it measured mean engine tau 1.57 against the top-k tree's 1.48 and the chain's 1.47 (a
        deeper spine, accept 0.65 at depth 4: also 1.57). On tests/test_dspark.py's two-phrase language the top-k
        tree wins (6.99 against this shape's 4.70, means of 3 seeds; the dynamic sampled tree reached 6.10 with one
        cut over all levels, a cut `trees.grow_dynamic_tree` shows to be biased): a shape that follows the scores
        reaches into both phrases, a fixed one cannot (docs/TRAINING.md)."""
        shape, d2t = self.sampled_shape, params.get("d2t")
        u = self.head_logits(params, hidden)  # [B, D, Vd]
        tokens, dists, valid = [None] * shape.num_nodes, [None] * shape.num_nodes, [None] * shape.num_nodes
        for d in range(1, shape.max_depth + 1):  # static loop over tree depth
            nodes = [i for i in range(shape.num_nodes) if shape.depth[i] == d]
            parents = sorted({int(shape.parents[i]) for i in nodes})  # -1: the root
            prev = jnp.stack([root if p < 0 else tokens[p] for p in parents], axis=1)  # [B, P] target ids
            u_d = jnp.broadcast_to(u[:, d - 1:d], (u.shape[0], len(parents), u.shape[-1]))
            q = probabilities(self.next_logits(params, u_d, prev), sampling)  # [B, P, Vd]
            ranks = int(shape.rank[nodes].max()) + 1
            offsets = jnp.full((q.shape[0], 1), d - 1, jnp.int32)  # every parent's children share the noise
            drawn, laws, drawn_valid = trees.draw_children(  # [B, P, ranks]
                q, ranks, trees.draft_noise(key, offsets, q.shape[-1], d2t))
            for i in nodes:
                parent, r = int(shape.parents[i]), int(shape.rank[i])
                j = parents.index(parent)
                dists[i] = laws[:, j, r]
                tokens[i] = draft_to_target(drawn[:, j, r], d2t)
                valid[i] = drawn_valid[:, j, r]  # q had a token left to draw
                if parent >= 0:
                    valid[i] = valid[i] & valid[parent]
        probs = draft_probs_to_target(jnp.stack(dists, axis=1), d2t, self.arch.cfg.vocab_size)
        return Draft.tree(jnp.stack(tokens, axis=1), shape.batched_parents(root.shape[0]), probs=probs,
                          valid=jnp.stack(valid, axis=1))

    def draft_confidence(self, state: BlockState) -> jax.Array:
        """[B, k] non-increasing prefix survival estimates of the last proposal (see specdec.scheduling).
        DFlash's: the running product of the top draft probability per slot; DSpark's: its calibrated head."""
        return state.confidence

    def update(self, params, state: BlockState, ctx: RoundContext, result, taps):
        """Append the context K/V of the root and the accepted path (positions root_pos + i); keep the committed
        ones only. The taps come in verify order [root, nodes]: a chain's are already in path order, a tree's
        accepted path is gathered first. After a run of plain rounds the taps are at their roots, in order
        (`Drafter.update`): one step writes the K/V of every skipped position."""
        cache = state.cache
        width = taps.shape[2]
        if self.kind == "tree":
            path = result.path[:, :width - 1]
            idx = jnp.concatenate([jnp.zeros_like(path[:, :1]), jnp.where(path >= 0, path + 1, 0)], axis=1)
            taps = jnp.take_along_axis(taps, idx[None, :, :, None], axis=2)
        positions = cache.lengths[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        cache = self._write_context(params, cache, taps, positions, cache.lengths)
        return dataclasses.replace(state, cache=cache.with_lengths(ctx.seq_len - 1))

    def describe(self):
        out = {**super().describe(), "taps": list(self.taps), "block_size": self.arch.block_size,
               "draft_layers": self.arch.cfg.num_layers, "draft_vocab": self.arch.draft_vocab or "full"}
        if self.kind == "tree":
            out.update(tree_top_k=self.top_k, tree_depth=self.depth)
            if self.sampled_shape is not None:
                out.update(tree_accept=self.tree_accept)
            if self.tree_sampling != TREE_SAMPLING:  # only then: a default tree's description is unchanged
                out.update(tree_sampling=self.tree_sampling)
        if self.arch.layout != "specdec":  # only then: a default drafter's description (a cache key) is unchanged
            out["block_layout"] = self.arch.layout
        return out


register_draft_vocab_axes(NAME, DFlashDrafter.draft_vocab_axes)  # what the inference format keeps


@register_architecture(NAME)  # what `specdec export` rebuilds the drafter with
def arch_from_checkpoint(target, config: dict) -> BlockArch:
    return BlockArch.build(target.cfg, num_layers=config["num_layers"], taps=config.get("taps"),
                           block_size=config["block_size"], mask_token_id=config["mask_token_id"],
                           intermediate_size=config.get("intermediate_size"),
                           markov_rank=config.get("markov_rank", 0),
                           draft_vocab_size=config.get("draft_vocab_size", 0),
                           block_layout=config.get("block_layout", "specdec"), qk_norm=config.get("qk_norm"))


@register(NAME)
def make_dflash(target, num_draft_tokens: int, path: str = "", tree_top_k: int = 0, tree_depth: int = 0,
                tree_accept: float = TREE_ACCEPT, tree_sampling: str = TREE_SAMPLING):
    """A trained DFlash drafter: `path` = its training run directory (or an exported drafter directory).
    `tree_top_k` / `tree_depth` > 0: draft a token tree of `num_draft_tokens` nodes, at temperature 0 a dynamic
    one (`propose_tree`), above it a sampled one of fixed shape (`sample_tree`) drawn up for the prior first-draw
    acceptance `tree_accept` (0: the top-k tree at every temperature), or with `tree_sampling: dynamic` grown
    like the temperature-0 tree from sampled children (`sampled_children`)."""
    info = load_trained(path, NAME, target, "dflash")
    arch = arch_from_checkpoint(target, info["config"])
    return DFlashDrafter.from_trained(arch, info["params"], info["buffers"], target, num_draft_tokens,
                                      tree_top_k, tree_depth, tree_accept, tree_sampling,
                                      cut=tuple(info["draft_vocab_cut"]))
