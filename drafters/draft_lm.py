"""A draft language model (any causal LM sharing the target's tokenizer), and self-speculation.

Each round the draft model first catches up on the tokens committed since its last draft, however many (rounds
whose draft was skipped leave more than N + 1: they are fed in chunks of CATCH_UP tokens, then the last N + 1 in
one step), then drafts N tokens one at a time. It reads only the committed tokens, so a skipped round needs
no drafter work at all. Its KV cache keeps only committed tokens: drafted positions are overwritten by the next
catch-up. Draft distributions come from the same sampling transform the target
is verified with, so rejection sampling stays exact.

Self-speculation ("layer skipping") is the same drafter whose model is the target's first `num_layers`
layers + its final norm + lm_head: no training, no extra weights (the arrays are shared with the target). Its
chain keeps no cache of its own either: the target's KV cache already holds those layers' K/V of every committed
position but the root (`RoundContext.cache`, the same function of the same tokens), so it feeds only the root
and drafts on a copy of those layers' cache; nothing to catch up on after skipped rounds. (Its tree writes more
nodes past the committed length than the target's cache has room for: it keeps its own cache.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from drafters import register
from specdec.drafter import CATCH_UP, Draft, Drafter, PromptInfo, RoundContext
from specdec import trees
from specdec.models import transformer
from specdec.models.config import ModelConfig
from specdec.models.transformer import KVCache
from specdec.sampling import probabilities, sample


class DraftLMDrafter(Drafter):
    kind = "chain"
    jittable = True

    def __init__(self, cfg: ModelConfig, params, num_draft_tokens: int, name: str = "draft_lm",
                 shares_target_cache: bool = False):
        self.cfg, self.name, self.num_draft_tokens = cfg, name, num_draft_tokens
        self.params = transformer.unstack_layers(params)  # the fast layout on XLA:CPU
        # True: the model is the target's first layers, whose K/V the target's cache holds (self-speculation)
        self.shares_target_cache = shares_target_cache

    def cache_slack(self) -> int:
        """Draft cache slots past the engine's `capacity`: room for the drafted positions of a round and for a
        chunk of the catch-up."""
        return max(self.num_draft_tokens + 2, CATCH_UP)

    def init(self, params, prompt: PromptInfo, capacity: int):
        if self.shares_target_cache:
            return ()
        cache = transformer.init_cache(self.cfg, prompt.tokens.shape[0], capacity + self.cache_slack())
        out = transformer.forward(params, self.cfg, cache, prompt.tokens, logits_at=(prompt.lengths - 1)[:, None])
        return out.cache.with_lengths(prompt.lengths)

    def at_root(self, params, cache, ctx: RoundContext):
        """(the draft's logits at the root [B, V], a cache of the committed tokens to draft on: `catch_up`, or
        with `shares_target_cache` the target's cache of its layers with the root fed)."""
        if not self.shares_target_cache:
            return self.catch_up(params, cache, ctx)
        target, layers = ctx.cache, self.cfg.num_layers
        if isinstance(target.k, tuple):
            k, v = target.k[:layers], target.v[:layers]
        else:  # the stacked layout (scan / megakernel backends): the per-layer one this model runs
            k, v = tuple(target.k[i] for i in range(layers)), tuple(target.v[i] for i in range(layers))
        own = KVCache(k=k, v=v, lengths=ctx.seq_len - 1)
        root = jnp.take_along_axis(ctx.seq, (ctx.seq_len - 1)[:, None], axis=1)
        out = transformer.forward(params, self.cfg, own, root)
        return out.logits[:, 0], out.cache.advance(1)

    def catch_up(self, params, cache: transformer.KVCache, ctx: RoundContext):
        """Feed the committed tokens the draft cache has not seen (the root included), however many: while more
        than N + 1 are pending in some row, chunks of up to CATCH_UP (`replay`), then the last N + 1 or fewer in
        one step. Returns the draft's logits at the root [B, V] and the cache holding exactly the committed
        tokens."""
        width = self.num_draft_tokens + 1
        cache = self.replay(params, cache, ctx, ctx.seq_len - width)
        pending = ctx.seq_len - cache.lengths
        out = transformer.forward(params, self.cfg, cache, self._tokens(cache, ctx, width),
                                  logits_at=(pending - 1)[:, None])
        return out.logits[:, 0], out.cache.with_lengths(ctx.seq_len)

    def replay(self, params, cache: transformer.KVCache, ctx: RoundContext, upto: jax.Array):
        """The cache with the committed tokens up to position `upto` [B] (exclusive) fed, in steps of CATCH_UP
        tokens (a lax.while_loop: no step at all after a drafted round, where at most N + 1 are pending). Rows
        already there wait (their lanes write past their length, which the next step overwrites)."""
        def step(cache):
            count = jnp.clip(upto - cache.lengths, 0, CATCH_UP)
            out = transformer.forward(params, self.cfg, cache, self._tokens(cache, ctx, CATCH_UP),
                                      logits_at=jnp.zeros_like(cache.lengths)[:, None])
            return out.cache.advance(count)

        return jax.lax.while_loop(lambda c: jnp.any(upto > c.lengths), step, cache)

    @staticmethod
    def _tokens(cache: transformer.KVCache, ctx: RoundContext, width: int) -> jax.Array:
        """The committed tokens from each row's draft cache length on, `width` of them (clipped at the end)."""
        idx = jnp.clip(cache.lengths[:, None] + jnp.arange(width)[None, :], 0, ctx.seq.shape[1] - 1)
        return jnp.take_along_axis(ctx.seq, idx, axis=1)

    def propose(self, params, cache: transformer.KVCache, ctx: RoundContext, sampling, key):
        n = self.num_draft_tokens
        root_logits, committed = self.at_root(params, cache, ctx)
        # 2. draft n tokens autoregressively (n - 1 more draft steps); drafted K/V sit past the committed length.
        # Draft j is drawn at offset j with the target's noise there (Gumbel-max on its q): the coupling the
        # invariant policies accept by.
        def draw(logits, j):
            return sample(key, logits, sampling, j), (None if sampling.greedy else probabilities(logits, sampling))

        def step(carry, j):
            cache, token = carry
            nxt = transformer.forward(params, self.cfg, cache, token[:, None])
            new_token, q = draw(nxt.logits[:, 0], j)
            return (nxt.cache.advance(1), new_token), (new_token, q)

        first, q0 = draw(root_logits, 0)
        _, (rest, q_rest) = jax.lax.scan(step, (committed, first), jnp.arange(1, n, dtype=jnp.int32))
        drafted = jnp.concatenate([first[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)
        probs = None if q0 is None else jnp.concatenate([q0[:, None], jnp.swapaxes(q_rest, 0, 1)], axis=1)
        return Draft.chain(drafted, probs=probs), (cache if self.shares_target_cache else committed)

    def describe(self):
        out = {**super().describe(), "draft_layers": self.cfg.num_layers}
        if self.shares_target_cache:  # only then: a draft LM's description (a cost-cache key) is unchanged
            out["target_cache"] = True
        return out


class DraftLMTreeDrafter(DraftLMDrafter):
    """The draft LM growing a dynamic token tree (EAGLE-2, `specdec.trees.grow_dynamic_tree`): `top_k`
    children per expanded node, `depth` levels, the `num_draft_tokens` best candidates kept.

    Each level runs the draft model once over every node expanded so far, with their ancestor mask; the draft
    cache keeps only committed tokens, so nothing needs undoing. At temperature 0 the children are top-k picks
    (a deterministic draft). Above it they are drawn without replacement from q with the target's noise at
    their position (`trees.sampled_children`): a node's first child is the coupled draw the invariant policies
    accept (the target's own sample when q = p), and each child carries q less its earlier siblings, which
    multidraft_tree's recursive rejection divides by.
    """

    kind = "tree"

    def __init__(self, cfg, params, num_draft_tokens: int, top_k: int, depth: int, name: str = "draft_lm"):
        super().__init__(cfg, params, num_draft_tokens, name=name)
        trees.check_tree_budget(num_draft_tokens, top_k, depth)
        self.top_k, self.depth = top_k, depth

    def cache_slack(self) -> int:  # a level's expanded nodes are written after the committed tokens
        return max(super().cache_slack(), trees.dynamic_tree_write_width(self.top_k, self.depth))

    def propose(self, params, cache, ctx: RoundContext, sampling, key):
        k = self.top_k
        root_logits, committed = self.catch_up(params, cache, ctx)

        def expand(tokens, depth, mask, _):  # the draft model over the expanded nodes; logits at the frontier
            batch, width = tokens.shape
            out = transformer.forward(params, self.cfg, committed, tokens, ctx.seq_len[:, None] + depth - 1, mask,
                                      logits_at=jnp.broadcast_to(jnp.arange(width - k, width), (batch, k)))
            return out.logits, None

        draw = None if sampling.greedy else trees.sampled_children(sampling, key, k)
        return trees.grow_dynamic_tree(root_logits, expand, k, self.depth, self.num_draft_tokens, draw=draw), committed

    def describe(self):
        return {**super().describe(), "tree_top_k": self.top_k, "tree_depth": self.depth}


def _make(cfg, params, num_draft_tokens, name, tree_top_k, tree_depth, shares_target_cache=False):
    if tree_top_k or tree_depth:
        return DraftLMTreeDrafter(cfg, params, num_draft_tokens, tree_top_k, tree_depth, name=name)
    return DraftLMDrafter(cfg, params, num_draft_tokens, name=name, shares_target_cache=shares_target_cache)


def _prefix_layers(params, num_layers: int):
    layers = params["layers"]
    if isinstance(layers, dict):
        sliced = {k: v[:num_layers] for k, v in layers.items()}
    else:
        sliced = tuple(layers[:num_layers])
    return {**params, "layers": sliced}


@register("self_spec")
def make_self_spec(target, num_draft_tokens: int, num_layers: int = 8, tree_top_k: int = 0, tree_depth: int = 0):
    if not 1 <= num_layers < target.cfg.num_layers:
        raise ValueError(f"self_spec num_layers must be in [1, {target.cfg.num_layers - 1}], got {num_layers}")
    cfg = target.cfg.replace(num_layers=num_layers, name=f"{target.cfg.name}[:{num_layers}]")
    return _make(cfg, _prefix_layers(target.params, num_layers), num_draft_tokens, "self_spec", tree_top_k,
                 tree_depth, shares_target_cache=True)


@register("draft_lm")
def make_draft_lm(target, num_draft_tokens: int, model: str = "", dtype: str | None = None, tree_top_k: int = 0,
                  tree_depth: int = 0):
    from specdec.models.loading import load_checkpoint

    if not model:
        raise ValueError("draft_lm needs params.model: a registry name, .gguf file or Hugging Face directory")
    cfg, params, _ = load_checkpoint(model, dtype=dtype or target.cfg.dtype)
    if cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"draft model {model!r} has vocabulary {cfg.vocab_size}, the target "
                         f"{target.cfg.vocab_size}: a draft LM must share the target's tokenizer")
    params = jax.tree.map(lambda a: jnp.asarray(a, cfg.jnp_dtype), params)
    return _make(cfg, params, num_draft_tokens, "draft_lm", tree_top_k, tree_depth)
