"""A draft language model (any causal LM sharing the target's tokenizer), and self-speculation.

Each round the draft model first catches up on the tokens committed since its last round (at most N+1, in
one step), then drafts N tokens one at a time. Its KV cache keeps only committed tokens: drafted positions
are overwritten by the next catch-up. Draft distributions come from the same sampling transform the target
is verified with, so rejection sampling stays exact.

Self-speculation ("layer skipping") is the same drafter whose model is the target's first `num_layers`
layers + its final norm + lm_head: no training, no extra weights (the arrays are shared with the target).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from drafters import register
from specdec.drafter import Drafter, PromptInfo, RoundContext
from specdec.models import transformer
from specdec.models.config import ModelConfig
from specdec.sampling import probabilities, sample
from specdec.verify import Draft


class DraftLMDrafter(Drafter):
    kind = "chain"
    jittable = True

    def __init__(self, cfg: ModelConfig, params, num_draft_tokens: int, name: str = "draft_lm"):
        self.cfg, self.name, self.num_draft_tokens = cfg, name, num_draft_tokens
        self.params = transformer.unstack_layers(params)  # the fast layout on XLA:CPU

    def init(self, params, prompt: PromptInfo, capacity: int):
        cache = transformer.init_cache(self.cfg, prompt.tokens.shape[0], capacity + self.num_draft_tokens + 2)
        out = transformer.forward(params, self.cfg, cache, prompt.tokens, logits_at=(prompt.lengths - 1)[:, None])
        return out.cache.with_lengths(prompt.lengths)

    def propose(self, params, cache: transformer.KVCache, ctx: RoundContext, sampling, key):
        n = self.num_draft_tokens
        # 1. catch up on committed tokens the draft cache has not seen (the root included): at most n + 1
        width = n + 1
        pending = ctx.seq_len - cache.lengths
        idx = jnp.clip(cache.lengths[:, None] + jnp.arange(width)[None, :], 0, ctx.seq.shape[1] - 1)
        tokens = jnp.take_along_axis(ctx.seq, idx, axis=1)
        out = transformer.forward(params, self.cfg, cache, tokens, logits_at=(pending - 1)[:, None])
        committed = out.cache.with_lengths(ctx.seq_len)
        # 2. draft n tokens autoregressively (n - 1 more draft steps); drafted K/V sit past the committed length
        keys = jax.random.split(key, n)

        def draw(logits, k):
            return sample(k, logits, sampling), (None if sampling.greedy else probabilities(logits, sampling))

        def step(carry, k):
            cache, token = carry
            nxt = transformer.forward(params, self.cfg, cache, token[:, None])
            new_token, q = draw(nxt.logits[:, 0], k)
            return (nxt.cache.advance(1), new_token), (new_token, q)

        first, q0 = draw(out.logits[:, 0], keys[0])
        _, (rest, q_rest) = jax.lax.scan(step, (committed, first), keys[1:])
        drafted = jnp.concatenate([first[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)
        probs = None if q0 is None else jnp.concatenate([q0[:, None], jnp.swapaxes(q_rest, 0, 1)], axis=1)
        return Draft.chain(drafted, probs=probs), committed

    def describe(self):
        return {**super().describe(), "draft_layers": self.cfg.num_layers}


def _prefix_layers(params, num_layers: int):
    layers = params["layers"]
    if isinstance(layers, dict):
        sliced = {k: v[:num_layers] for k, v in layers.items()}
    else:
        sliced = tuple(layers[:num_layers])
    return {**params, "layers": sliced}


@register("self_spec")
def make_self_spec(target, num_draft_tokens: int, num_layers: int = 8):
    if not 1 <= num_layers < target.cfg.num_layers:
        raise ValueError(f"self_spec num_layers must be in [1, {target.cfg.num_layers - 1}], got {num_layers}")
    cfg = target.cfg.replace(num_layers=num_layers, name=f"{target.cfg.name}[:{num_layers}]")
    return DraftLMDrafter(cfg, _prefix_layers(target.params, num_layers), num_draft_tokens, name="self_spec")


@register("draft_lm")
def make_draft_lm(target, num_draft_tokens: int, model: str = "", dtype: str | None = None):
    from specdec.models.loading import load_checkpoint

    if not model:
        raise ValueError("draft_lm needs params.model: a registry name, .gguf file or Hugging Face directory")
    cfg, params, _ = load_checkpoint(model, dtype=dtype or target.cfg.dtype)
    if cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"draft model {model!r} has vocabulary {cfg.vocab_size}, the target "
                         f"{target.cfg.vocab_size}: a draft LM must share the target's tokenizer")
    params = jax.tree.map(lambda a: jnp.asarray(a, cfg.jnp_dtype), params)
    return DraftLMDrafter(cfg, params, num_draft_tokens, name="draft_lm")
