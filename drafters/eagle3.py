"""EAGLE-3: a one-layer drafter reading fused features from several target layers, trained with a
training-time test (TTT). Inference drafts a chain (or an EAGLE-2 dynamic tree) inside the compiled loop.

Network (Flax linen, `Eagle3Net`), with the target's widths:
    g_p   = fc(concat(taps_p))                       taps after target layers (2, L//2, L-3) at position p
    input = concat(norm_e(embed(x_p)), norm_h(g_{p-1}))   2H wide; embed = the frozen target embedding
    h_p   = g_{p-1} + Wo attn(q, k, v from input)    RoPE at position p, GQA like the target
    h_p  += MLP(mlp_norm(h_p));  logits_p = lm_head(norm(h_p)) over the draft vocabulary
The draft at position p (token x_p, feature g_{p-1}) predicts x_{p+1} (the one indexing convention of
`specdec.train.tasks`: root slot j, draft step k predicts x_{j+k+1}). For drafted positions the feature is
the draft's own previous output h (pre-norm) instead of the target's g.

Training-time test, unrolled `ttt_steps` (default 7) steps over the whole sequence: step k at slot j reads
token x_{j+k} and the hidden h^{k-1}_j of step k-1 (g_{j-1} at step 0), at RoPE position j+k, and attends to
the step-0 keys at slots 1..j (causal) plus the keys of steps 1..k at its own slot j. That is exactly what
inference computes when x_j is the root and x_{j+1..j+k} were drafted (the cache holds step-0 keys of every
committed position; drafted keys sit after it). Loss: soft cross-entropy against the target distribution at
position j+k (restricted to the draft vocabulary and renormalised), weighted 0.8^k, over slots whose label
x_{j+k+1} is a response token. `tests/test_eagle3.py` checks TTT logits == engine logits for steps 0..2.

Reduced vocabulary (FR-Spec): `draft_vocab_size: N` keeps the N most frequent response tokens of the
training data; `d2t` [N] maps draft ids to target ids (a saved buffer). lm_head is initialised from the
target's rows (tied embedding or lm_head), the output norm from the target's final norm.

Inference state: the draft layer's own KV cache (slot p-1 holds position p; only committed positions stay)
and its output h at the root, the last committed position. `update` fuses the verify step's taps at [root,
accepted path] and feeds the positions committed since (x_p with feature g_{p-1}, the new root last) through
the layer in one step; after a run of plain rounds (the draft skipped) the engine calls it once with the taps at
their roots (`specdec.drafter.Drafter.update`), so it catches up on every skipped token. `propose` drafts N
tokens (or grows the tree) from the root's output.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from drafters import register
from specdec import trees
from specdec.drafter import (Draft, Drafter, PromptInfo, RoundContext, catch_up_width, draft_probs_to_target,
                             draft_to_target)
from specdec.models import transformer
from specdec.models.config import ModelConfig
from specdec.export.registry import register_architecture
from specdec.sampling import sample_with_probs
from specdec.train import tasks as T
from specdec.train.checkpoint import load_trained

NAME = "eagle3"


def default_taps(num_layers: int) -> tuple[int, ...]:
    """(2, L//2, L-3) in Hugging Face hidden_states numbering (= our tap indices), clipped to [0, L]."""
    return tuple(min(max(t, 0), num_layers) for t in (2, num_layers // 2, num_layers - 3))


@dataclasses.dataclass(frozen=True)
class Eagle3Arch:
    cfg: ModelConfig  # the draft layer's widths (the target's, one layer)
    taps: tuple[int, ...]
    draft_vocab: int  # 0 = the target's full vocabulary

    @property
    def vocab(self) -> int:
        return self.draft_vocab or self.cfg.vocab_size

    @classmethod
    def build(cls, target_cfg: ModelConfig, taps=None, draft_vocab_size: int = 0, intermediate_size=None):
        taps = tuple(int(t) for t in taps) if taps else default_taps(target_cfg.num_layers)
        bad = [t for t in taps if not 0 <= t <= target_cfg.num_layers]
        if bad:
            raise ValueError(f"eagle3 taps {bad} outside [0, {target_cfg.num_layers}]")
        if not 0 <= draft_vocab_size <= target_cfg.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [0, {target_cfg.vocab_size}], got {draft_vocab_size}")
        cfg = target_cfg.replace(num_layers=1, dtype="float32", name=f"eagle3[{target_cfg.name}]",
                                 intermediate_size=intermediate_size or target_cfg.intermediate_size)
        vocab = 0 if draft_vocab_size in (0, target_cfg.vocab_size) else int(draft_vocab_size)
        return cls(cfg=cfg, taps=taps, draft_vocab=vocab)

    def to_config(self) -> dict:
        return {"taps": list(self.taps), "draft_vocab_size": self.draft_vocab,
                "intermediate_size": self.cfg.intermediate_size}


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        return transformer.rms_norm(x.astype(jnp.float32), scale, self.eps)


class Eagle3Net(nn.Module):
    arch: Eagle3Arch

    def setup(self):
        c = self.arch.cfg
        dense = lambda n: nn.Dense(n, use_bias=False, kernel_init=nn.initializers.normal(0.02))
        self.fc = dense(c.hidden_size)
        self.input_norm, self.hidden_norm = RMSNorm(c.rms_norm_eps), RMSNorm(c.rms_norm_eps)
        self.wq, self.wk, self.wv = dense(c.q_size), dense(c.kv_size), dense(c.kv_size)
        self.wo = dense(c.hidden_size)
        self.mlp_norm = RMSNorm(c.rms_norm_eps)
        self.w_gate, self.w_up, self.w_down = dense(c.intermediate_size), dense(c.intermediate_size), dense(c.hidden_size)
        self.norm = RMSNorm(c.rms_norm_eps)
        self.lm_head = dense(self.arch.vocab)

    def fuse(self, taps):
        """taps [n_taps, ..., H] -> g [..., H]."""
        return self.fc(jnp.concatenate([t.astype(jnp.float32) for t in taps], axis=-1))

    def project(self, emb, h_in, positions):
        """q [B, T, NH, HD], k, v [B, T, KVH, HD] (RoPE applied) for tokens `emb` and input features `h_in`."""
        c = self.arch.cfg
        b, t, _ = emb.shape
        x = jnp.concatenate([self.input_norm(emb), self.hidden_norm(h_in)], axis=-1)
        q = self.wq(x).reshape(b, t, c.num_heads, c.head_dim)
        k = self.wk(x).reshape(b, t, c.num_kv_heads, c.head_dim)
        v = self.wv(x).reshape(b, t, c.num_kv_heads, c.head_dim)
        cos, sin = transformer.rope_tables(c, positions)
        return transformer.apply_rope(q, cos, sin), transformer.apply_rope(k, cos, sin), v

    def finish(self, attn, h_in):
        """The rest of the layer after attention: residual on the input feature, then the MLP."""
        h = h_in.astype(jnp.float32) + self.wo(attn)
        n = self.mlp_norm(h)
        return h + self.w_down(jax.nn.silu(self.w_gate(n)) * self.w_up(n))

    def logits(self, h):
        return self.lm_head(self.norm(h)).astype(jnp.float32)

    def __call__(self, taps, emb, positions):  # touches every weight (used by init)
        g = self.fuse(taps)
        q, _, _ = self.project(emb, g, positions)
        return self.logits(self.finish(q.reshape(q.shape[0], q.shape[1], -1), g))


def _apply(arch: Eagle3Arch, params, method: str, *args):
    return Eagle3Net(arch).apply({"params": params}, *args, method=method)


# ---------------------------------------------------------------------------------------------------------
# Training-time test
# ---------------------------------------------------------------------------------------------------------

def ttt_attention(q, k0, v0, ek, ev, step_ok, key_ok):
    """Attention of step-k queries over the step-0 keys (mask `key_ok` [T, T]) plus, for each later step
    i = 1..k, the step-i key at the query's own slot. q [B, T, NH, HD]; k0/v0 [B, T, KVH, HD]; ek/ev
    [S, B, T, KVH, HD] hold the keys/values of steps 1..S, of which those with `step_ok` [S] are visible.
    Same arithmetic as `transformer.attend` over the draft cache at inference (masked = -1e30)."""
    b, t, nh, hd = q.shape
    kvh = k0.shape[2]
    qg = q.reshape(b, t, kvh, nh // kvh, hd)
    scale = 1.0 / np.sqrt(hd)
    s0 = jnp.einsum("btkgd,bskd->bkgts", qg, k0, preferred_element_type=jnp.float32) * scale
    s0 = jnp.where(key_ok[None, None, None], s0, -1e30)
    diag = jnp.einsum("btkgd,nbtkd->bkgtn", qg, ek, preferred_element_type=jnp.float32) * scale
    diag = jnp.where(step_ok[None, None, None, None, :], diag, -1e30)
    probs = jax.nn.softmax(jnp.concatenate([s0, diag], axis=-1), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs[..., :t], v0, preferred_element_type=jnp.float32)
    out = out + jnp.einsum("bkgtn,nbtkd->btkgd", probs[..., t:], ev, preferred_element_type=jnp.float32)
    return out.reshape(b, t, nh * hd)


def ttt_scan(arch: Eagle3Arch, params, embed, tokens, taps, num_steps: int, consume, pad_id: int = 0):
    """Run the training-time test for `num_steps` steps as a lax.scan (compile time independent of the
    number of steps) and return `consume(k, logits_k)` stacked over k (pytrees with a leading [num_steps]).
    logits_k [B, T, Vd] at slot j predicts x_{j+k+1}; k is traced for k >= 1. taps [n_taps, B, T, H] come
    from the target over `tokens` [B, T]."""
    b, t = tokens.shape
    g = _apply(arch, params, "fuse", taps)
    h_in = jnp.concatenate([jnp.zeros_like(g[:, :1]), g[:, :-1]], axis=1)  # slot j reads g_{j-1}
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    qi, ki = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    key_ok = (ki <= qi) & (ki >= 1)  # step-0 keys exist for positions >= 1 only (slot p-1 holds position p)
    extra = max(num_steps - 1, 1)
    c = arch.cfg
    ek = jnp.zeros((extra, b, t, c.num_kv_heads, c.head_dim), jnp.float32)
    ev = jnp.zeros_like(ek)
    none_visible = jnp.zeros((extra,), bool)

    q, k0, v0 = _apply(arch, params, "project", embed[tokens].astype(jnp.float32), h_in, pos)
    h = _apply(arch, params, "finish", ttt_attention(q, k0, v0, ek, ev, none_visible, key_ok), h_in)
    first = consume(0, _apply(arch, params, "logits", h))
    if num_steps == 1:
        return jax.tree.map(lambda a: a[None], first)
    tok_pad = jnp.concatenate([tokens, jnp.full((b, num_steps), pad_id, tokens.dtype)], axis=1)

    def body(carry, k):
        h_in, ek, ev = carry
        toks = jax.lax.dynamic_slice_in_dim(tok_pad, k, t, axis=1)  # x_{j+k}
        q, kk, vv = _apply(arch, params, "project", embed[toks].astype(jnp.float32), h_in, pos + k)
        ek = jax.lax.dynamic_update_index_in_dim(ek, kk, k - 1, 0)
        ev = jax.lax.dynamic_update_index_in_dim(ev, vv, k - 1, 0)
        attn = ttt_attention(q, k0, v0, ek, ev, jnp.arange(1, extra + 1) <= k, key_ok)
        h = _apply(arch, params, "finish", attn, h_in)
        return (h, ek, ev), consume(k, _apply(arch, params, "logits", h))

    _, rest = jax.lax.scan(body, (h, ek, ev), jnp.arange(1, num_steps))
    return jax.tree.map(lambda a, r: jnp.concatenate([a[None], r]), first, rest)


def ttt_logits(arch: Eagle3Arch, params, embed, tokens, taps, num_steps: int, pad_id: int = 0) -> list[jax.Array]:
    """Draft logits of every TTT step: a list of num_steps arrays [B, T, Vd] (tests; training consumes each
    step's logits inside the scan instead of keeping them)."""
    out = ttt_scan(arch, params, embed, tokens, taps, num_steps, lambda k, lg: lg, pad_id)
    return list(out)


@dataclasses.dataclass(frozen=True)
class Eagle3Task(T.TrainTask):
    arch: Eagle3Arch
    ttt_steps: int = 7
    step_weight: float = 0.8
    target: Any = dataclasses.field(default=None, compare=False, repr=False)

    name = NAME
    needs_target_logits = True
    training_keys = ("ttt_steps", "step_weight")  # may change in a continued run (train.init_from)
    max_eval_steps = None

    @property
    def taps(self) -> tuple[int, ...]:
        return self.arch.taps

    def config(self) -> dict:
        return {**self.arch.to_config(), "ttt_steps": self.ttt_steps, "step_weight": self.step_weight}

    def init(self, key, token_counts: np.ndarray):
        c, tcfg = self.arch.cfg, self.target.cfg
        n_taps = len(self.arch.taps)
        dummy_taps = jnp.zeros((n_taps, 1, 2, c.hidden_size), jnp.float32)
        params = Eagle3Net(self.arch).init(key, dummy_taps, jnp.zeros((1, 2, c.hidden_size)), jnp.zeros((1, 2), jnp.int32))
        params = jax.tree.map(jnp.asarray, params["params"])
        buffers = {}
        head = self.target.output_projection()  # [H, V]
        if self.arch.draft_vocab:
            d2t = T.reduced_vocab(token_counts, self.arch.draft_vocab, tcfg.eos_token_ids)
            buffers["d2t"] = jnp.asarray(d2t)
            head = head[:, d2t]
        params["lm_head"] = {"kernel": jnp.asarray(head, jnp.float32)}
        params["norm"] = {"scale": jnp.asarray(self.target.params["final_norm"], jnp.float32)}
        return params, buffers

    def frozen(self, target) -> dict:
        return {"embed": target.params["embed"]}

    def _run(self, params, consts, batch, feats, num_steps: int, with_eval: bool):
        """Per-step outputs of the TTT unroll: soft CE and top-1 agreement (and acceptance for eval)."""
        d2t = consts.get("d2t")
        tl = feats.logits.astype(jnp.float32)
        restricted = tl if d2t is None else jnp.take(tl, d2t, axis=-1)
        pt_all = jax.nn.softmax(restricted, axis=-1)  # renormalised over the draft vocabulary
        pt_full = jax.nn.softmax(tl, axis=-1) if d2t is not None else pt_all
        t_top = jnp.argmax(tl, axis=-1)
        max_k = num_steps

        def consume(k, lg):
            valid = T.label_valid(batch, k, min_slot=1, max_k=max_k)
            pt = T.shift_dynamic(pt_all, k, max_k)
            d_top = jnp.argmax(lg, axis=-1)
            out = {"ce": T.masked_mean(T.soft_cross_entropy(lg, pt), valid),
                   "acc": T.masked_mean(d_top == jnp.argmax(pt, axis=-1), valid)}
            if with_eval:
                pd = jax.nn.softmax(lg, axis=-1)
                ptf = T.shift_dynamic(pt_full, k, max_k)
                ptf = ptf if d2t is None else jnp.take(ptf, d2t, axis=-1)
                out["alpha"] = jnp.sum(jnp.minimum(pd, ptf), axis=-1)
                out["match"] = (d_top if d2t is None else d2t[d_top]) == T.shift_dynamic(t_top, k, max_k, -1)
            return out

        return ttt_scan(self.arch, params, consts["embed"], batch["tokens"], feats.taps, num_steps, consume,
                        self.target.cfg.pad_token_id or 0)

    def _weighted(self, ce):
        w = self.step_weight ** jnp.arange(self.ttt_steps, dtype=jnp.float32)
        return jnp.sum(w * ce[: self.ttt_steps]) / jnp.sum(w)

    def loss(self, params, consts, batch, feats, key):
        out = self._run(params, consts, batch, feats, self.ttt_steps, False)
        metrics = {}
        for k in range(self.ttt_steps):
            metrics[f"loss_step{k}"] = out["ce"][k]
            metrics[f"acc_step{k}"] = out["acc"][k]
        return self._weighted(out["ce"]), metrics

    def evaluate(self, params, consts, batch, feats, num_steps: int):
        out = self._run(params, consts, batch, feats, max(num_steps, self.ttt_steps), True)
        ev = T.DraftEval(jnp.moveaxis(out["alpha"][:num_steps], 0, -1), jnp.moveaxis(out["match"][:num_steps], 0, -1))
        return self._weighted(out["ce"]), ev


@T.register_task(NAME)
def make_task(target, taps: list | None = None, draft_vocab_size: int = 0, ttt_steps: int = 7,
              step_weight: float = 0.8, intermediate_size: int | None = None) -> Eagle3Task:
    if ttt_steps < 1:
        raise ValueError(f"eagle3 ttt_steps must be >= 1, got {ttt_steps}")
    arch = Eagle3Arch.build(target.cfg, taps, draft_vocab_size, intermediate_size)
    return Eagle3Task(arch=arch, ttt_steps=ttt_steps, step_weight=float(step_weight), target=target)


# ---------------------------------------------------------------------------------------------------------
# Inference
# ---------------------------------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Eagle3State:
    cache: transformer.KVCache  # the draft layer's K/V: slot p-1 = position p; `lengths` = positions fed
    h_root: jax.Array  # [B, H] the layer's output at the root (position `lengths`): the first draft's input


class Eagle3Drafter(Drafter):
    kind = "chain"
    jittable = True

    def __init__(self, arch: Eagle3Arch, params, num_draft_tokens: int, name: str = NAME):
        self.arch, self.num_draft_tokens, self.name = arch, num_draft_tokens, name
        self.taps = arch.taps
        self.params = params  # {"params": trained weights, "embed": target embedding[, "d2t": int32 [Vd]]}

    @classmethod
    def from_trained(cls, arch, trained, buffers, target, num_draft_tokens, tree_top_k=0, tree_depth=0):
        params = {"params": jax.tree.map(jnp.asarray, trained), "embed": target.params["embed"]}
        if buffers.get("d2t") is not None:
            params["d2t"] = jnp.asarray(buffers["d2t"], jnp.int32)
        if tree_top_k or tree_depth:
            return Eagle3TreeDrafter(arch, params, num_draft_tokens, tree_top_k, tree_depth)
        return cls(arch, params, num_draft_tokens)

    # -- pieces shared by chain and tree drafting -------------------------------------------------------
    def _layer(self, params, cache, tokens, h_in, positions, tree_mask):
        """The draft layer over new tokens written at slots cache.lengths...; returns (h, cache)."""
        emb = params["embed"][tokens].astype(jnp.float32)
        q, k, v = _apply(self.arch, params["params"], "project", emb, h_in, positions)
        kc = transformer.write_rows(cache.k[0], k, cache.lengths)
        vc = transformer.write_rows(cache.v[0], v, cache.lengths)
        mask = transformer.attention_mask(cache.lengths, cache.capacity, jnp.broadcast_to(
            tree_mask, (tokens.shape[0],) + tree_mask.shape[-2:]))
        attn = transformer.attend(q, kc, vc, mask)
        h = _apply(self.arch, params["params"], "finish", attn, h_in)
        return h, dataclasses.replace(cache, k=(kc,), v=(vc,))

    def _logits(self, params, h):
        return _apply(self.arch, params["params"], "logits", h)

    def _to_target(self, params, ids):
        return draft_to_target(ids, params.get("d2t"))

    def _draw(self, params, logits, sampling, key, offset):
        """Sample a draft token (target ids) at `offset` with the target's noise for each token, and its
        distribution over the target vocabulary (None: greedy)."""
        d2t = params.get("d2t")
        ids, q = sample_with_probs(key, logits, sampling, offset, ids=d2t)
        tok = self._to_target(params, ids)
        return tok, None if q is None else draft_probs_to_target(q, d2t, self.arch.cfg.vocab_size)

    def cache_slack(self) -> int:
        """Draft cache slots past the engine's `capacity`: room for the drafted positions of a round and for the
        positions an update feeds."""
        return max(self.num_draft_tokens + 2, catch_up_width(self.num_draft_tokens) + 1)

    def init(self, params, prompt: PromptInfo, capacity: int):
        b, t = prompt.tokens.shape
        c = self.arch.cfg
        shape = transformer.cache_shape(b, capacity + self.cache_slack(), c.num_kv_heads, c.head_dim)
        cache = transformer.KVCache(k=(jnp.zeros(shape, jnp.float32),), v=(jnp.zeros(shape, jnp.float32),),
                                    lengths=jnp.zeros((b,), jnp.int32))
        g = _apply(self.arch, params["params"], "fuse", prompt.taps)  # [B, T, H]
        if t > 1:  # positions 1..T-1 of the prompt (token x_p with feature g_{p-1})
            positions = jnp.broadcast_to(jnp.arange(1, t, dtype=jnp.int32), (b, t - 1))
            _, cache = self._layer(params, cache, prompt.tokens[:, 1:], g[:, :-1], positions,
                                   transformer.causal_mask(t - 1))
        cache = cache.with_lengths(prompt.lengths - 1)  # the prompt's last position is fed with the root
        last = jnp.take_along_axis(g, (prompt.lengths - 1)[:, None, None], axis=1)  # g_{P-1}
        return self.feed(params, cache, prompt.first_token[:, None], last, jnp.ones((b,), jnp.int32))

    def feed(self, params, cache: transformer.KVCache, tokens, feats, count) -> Eagle3State:
        """Feed the next `count` [B] positions after the last one fed (position p: token x_p, feature g_{p-1}):
        `tokens` [B, W] and `feats` [B, W, H] from the first of them on, each row's first `count` meant. Returns
        the state with them fed, its root output the last one's."""
        width = tokens.shape[1]
        positions = cache.lengths[:, None] + 1 + jnp.arange(width, dtype=jnp.int32)[None, :]
        h, cache = self._layer(params, cache, tokens, feats, positions, transformer.causal_mask(width))
        last = jnp.clip(count - 1, 0, width - 1)
        h_root = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
        return Eagle3State(cache=cache.advance(jnp.maximum(count, 0)), h_root=h_root)

    def draft_step(self, params, cache, token, h_prev):
        """One chain step after the root: token [B] at the next position, input feature h_prev [B, H].
        Returns (logits [B, Vd], h [B, H], cache advanced by one)."""
        positions = (cache.lengths + 1)[:, None]
        h, cache = self._layer(params, cache, token[:, None], h_prev[:, None], positions, jnp.ones((1, 1), bool))
        return self._logits(params, h[:, 0]), h[:, 0], cache.advance(1)

    def propose(self, params, state: Eagle3State, ctx: RoundContext, sampling, key):
        n = self.num_draft_tokens
        h_root, committed = state.h_root, state.cache
        first, q0 = self._draw(params, self._logits(params, h_root), sampling, key, 0)

        def step(carry, j):
            cache, token, h_prev = carry
            logits, h, cache = self.draft_step(params, cache, token, h_prev)
            tok, q = self._draw(params, logits, sampling, key, j)
            return (cache, tok, h), (tok, q)

        (cache, _, _), (rest, q_rest) = jax.lax.scan(step, (committed, first, h_root),
                                                     jnp.arange(1, n, dtype=jnp.int32))
        drafted = jnp.concatenate([first[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)
        probs = None if q0 is None else jnp.concatenate([q0[:, None], jnp.swapaxes(q_rest, 0, 1)], axis=1)
        # drafted K/V sit past the committed length; the next update overwrites them
        return Draft.chain(drafted, probs=probs), Eagle3State(cache=cache.with_lengths(committed.lengths),
                                                              h_root=h_root)

    def update(self, params, state: Eagle3State, ctx: RoundContext, result, taps):
        """Feed the positions committed since the root (the accepted drafts, then the new root) with the fused
        taps at the root and the accepted path as their features; after plain rounds the taps are at their roots
        and the path runs through them (`Drafter.update`)."""
        g = _apply(self.arch, params["params"], "fuse", taps)  # [B, W, H] at [root, nodes]
        idx = jnp.concatenate([jnp.zeros_like(result.path[:, :1]), jnp.where(result.path >= 0, result.path + 1, 0)], 1)
        feats = jnp.take_along_axis(g, idx[..., None], axis=1)  # g at root, then the accepted path
        cache = state.cache
        width = feats.shape[1]
        positions = cache.lengths[:, None] + 1 + jnp.arange(width, dtype=jnp.int32)[None, :]
        tokens = jnp.take_along_axis(ctx.seq, jnp.clip(positions, 0, ctx.seq.shape[1] - 1), axis=1)
        return self.feed(params, cache, tokens, feats, ctx.seq_len - 1 - cache.lengths)

    def describe(self):
        return {**super().describe(), "taps": list(self.taps), "draft_vocab": self.arch.vocab}


class Eagle3TreeDrafter(Eagle3Drafter):
    """EAGLE-3 growing an EAGLE-2 dynamic tree (`specdec.trees.grow_dynamic_tree`): `top_k` children per
    expanded node, `depth` levels, the `num_draft_tokens` best candidates kept. A node's input feature is its
    parent's output; every level re-runs all expanded nodes with their ancestor mask (the cache keeps only
    committed positions). At temperature 0 the candidates are top-k picks (deterministic drafts: probs=None);
    above it each node's children are drawn without replacement from q with the target's noise at their
    position (`trees.sampled_children`, as the draft LM's tree), each carrying q less its earlier siblings."""

    kind = "tree"

    def __init__(self, arch, params, num_draft_tokens: int, top_k: int, depth: int, name: str = NAME):
        super().__init__(arch, params, num_draft_tokens, name=name)
        trees.check_tree_budget(num_draft_tokens, top_k, depth)
        self.top_k, self.depth = top_k, depth

    def cache_slack(self) -> int:  # a level's expanded nodes are written after the committed positions
        return max(super().cache_slack(), trees.dynamic_tree_write_width(self.top_k, self.depth))

    def propose(self, params, state: Eagle3State, ctx: RoundContext, sampling, key):
        k = self.top_k
        h_root, committed = state.h_root, state.cache
        root_pos = ctx.seq_len - 1

        def expand(tokens, depth, mask, h_in):  # the draft layer over the expanded nodes (input: the parent's h)
            h, _ = self._layer(params, committed, tokens, h_in, root_pos[:, None] + depth, mask)
            front_h = h[:, tokens.shape[1] - k:]  # outputs of the current frontier
            return self._logits(params, front_h), front_h

        root_inputs = jnp.broadcast_to(h_root[:, None], (h_root.shape[0], k, h_root.shape[-1]))
        d2t = params.get("d2t")
        draw = None if sampling.greedy else trees.sampled_children(sampling, key, k, d2t)
        draft = trees.grow_dynamic_tree(self._logits(params, h_root), expand, k, self.depth, self.num_draft_tokens,
                                        root_inputs=root_inputs, to_target=lambda ids: self._to_target(params, ids),
                                        draw=draw)
        if draft.probs is not None:  # q over the draft vocabulary, as the target's
            draft = dataclasses.replace(draft, probs=draft_probs_to_target(draft.probs, d2t, self.arch.cfg.vocab_size))
        return draft, state

    def describe(self):
        return {**super().describe(), "tree_top_k": self.top_k, "tree_depth": self.depth}


@register_architecture(NAME)  # what `specdec export` rebuilds the drafter with
def arch_from_checkpoint(target, config: dict) -> Eagle3Arch:
    return Eagle3Arch.build(target.cfg, config.get("taps"), config.get("draft_vocab_size", 0),
                            config.get("intermediate_size"))


@register(NAME)
def make_eagle3(target, num_draft_tokens: int, path: str = "", tree_top_k: int = 0, tree_depth: int = 0):
    """A trained EAGLE-3 drafter: `path` = its training run directory (or an exported drafter directory)."""
    info = load_trained(path, NAME, target, "eagle3")
    arch = arch_from_checkpoint(target, info["config"])
    return Eagle3Drafter.from_trained(arch, info["params"], info["buffers"], target, num_draft_tokens,
                                      tree_top_k, tree_depth)
