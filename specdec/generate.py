"""Autoregressive generation: the baseline every speculative result is compared with.

Prefill runs the right-padded prompts of a batch through the target in one step; the decode loop is one
compiled `lax.while_loop` (no host round trip per token). Rows finish independently at EOS or at
`max_new_tokens`; a finished row stops advancing its cache and its outputs are masked.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specdec.models.transformer import KVCache
from specdec.sampling import GREEDY, SamplingParams, sample
from specdec.sharding import to_host
from specdec.target import Target

PROMPT_BUCKET = 32  # prompts are padded to a multiple of this, so a few compiled prefill shapes serve all
# The EOS id set used when a model has none (AR and speculative loops alike): no token id is negative, and -1 is
# the padding of verify results and output buffers, so -2 can never match a token.
NO_EOS = -2


class ContextLengthError(ValueError):
    """A prompt (plus the requested new tokens) does not fit the model's context."""


def context_limit(target: Target, max_seq_len: int | None = None) -> int:
    limit = target.cfg.max_position_embeddings
    return min(limit, max_seq_len) if max_seq_len else limit


def check_fits(prompt_lengths: Sequence[int], max_new_tokens: int, limit: int, extra: int = 0) -> None:
    """Refuse (never truncate) prompts that do not fit: prompt + new tokens (+ draft slack) <= limit."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, n in enumerate(prompt_lengths):
        if n < 1:
            raise ValueError(f"prompt {i} is empty")
        if n + max_new_tokens + extra > limit:
            raise ContextLengthError(
                f"prompt {i} has {n} tokens; with max_new_tokens={max_new_tokens}"
                + (f" and {extra} draft slots" if extra else "")
                + f" it needs {n + max_new_tokens + extra} positions, but the context is {limit}. "
                "Shorten the prompt or lower max_new_tokens (prompts are never truncated silently).")


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, bucket: int = PROMPT_BUCKET):
    """Right-pad prompts to a common bucketed length: (tokens int32 [B, T], lengths int32 [B])."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    width = int(-(-lengths.max() // bucket) * bucket)
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths


def cache_capacity(prompt_lengths: Sequence[int], max_new_tokens: int, extra: int = 0, bucket: int = 64) -> int:
    """Cache slots needed: the padded prompt width is written in prefill, then new tokens (+ draft slack)."""
    padded = -(-max(prompt_lengths) // PROMPT_BUCKET) * PROMPT_BUCKET
    need = max(padded, max(prompt_lengths) + max_new_tokens + extra + 1)
    return int(-(-need // bucket) * bucket)


@functools.partial(jax.jit, static_argnames=("forward", "cfg", "taps"), donate_argnames=("cache",))
def prefill(params, cache: KVCache, tokens, lengths, *, forward: Callable, cfg, taps=()):
    """Run right-padded prompts; commit each row's own length. Returns (last logits [B, V], taps, cache)."""
    out = forward(params, cfg, cache, tokens, taps=taps, logits_at=(lengths - 1)[:, None])
    return out.logits[:, 0], out.taps, out.cache.with_lengths(lengths)


@functools.partial(jax.jit, static_argnames=("forward", "cfg", "sampling", "max_new_tokens", "eos_ids"),
                   donate_argnames=("cache",))
def decode_loop(params, cache: KVCache, first_logits, key, limit, *, forward: Callable, cfg,
                sampling: SamplingParams, max_new_tokens: int, eos_ids: tuple[int, ...]):
    """Sample up to `limit` (<= max_new_tokens, traced) tokens per row inside one while_loop.
    Returns (tokens [B, max_new_tokens] -1 padded, counts [B], cache). The cache is donated and returned so
    the loop updates it in place instead of copying every layer's buffers on entry."""
    batch = first_logits.shape[0]
    eos = jnp.asarray(eos_ids or (NO_EOS,), jnp.int32)

    def emit(state, logits):
        out, count, done, key, cache = state
        key, sub = jax.random.split(key)
        token = sample(sub, logits, sampling)
        out = out.at[jnp.arange(batch), jnp.minimum(count, max_new_tokens - 1)].set(
            jnp.where(done, out[jnp.arange(batch), jnp.minimum(count, max_new_tokens - 1)], token))
        count = count + (~done).astype(jnp.int32)
        done = done | jnp.isin(token, eos) | (count >= limit)
        return (out, count, done, key, cache), token

    def cond(carry):
        state, _ = carry
        return ~jnp.all(state[2])

    def body(carry):
        state, token = carry
        out, count, done, key, cache = state
        step = forward(params, cfg, cache, token[:, None])
        cache = step.cache.advance((~done).astype(jnp.int32))
        return emit((out, count, done, key, cache), step.logits[:, 0])

    init = (jnp.full((batch, max_new_tokens), -1, jnp.int32), jnp.zeros((batch,), jnp.int32),
            jnp.zeros((batch,), bool), key, cache)
    state, token = emit(init, first_logits)
    (out, count, _, _, cache), _ = jax.lax.while_loop(cond, body, (state, token))
    return out, count, cache


@dataclasses.dataclass
class GenerationOutput:
    tokens: list[list[int]]  # new tokens per row (EOS included when generation stopped at it)
    prompt_lengths: list[int]
    prefill_seconds: float
    decode_seconds: float

    @property
    def num_new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: new tokens over decode wall time (prefill excluded), summed over rows."""
        return self.num_new_tokens / max(self.decode_seconds, 1e-9)


def generate(target: Target, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
             sampling: SamplingParams = GREEDY, seed: int = 0, max_seq_len: int | None = None,
             warmup: bool = False) -> GenerationOutput:
    """Autoregressive generation for a batch of token-id prompts of any lengths.

    `warmup=True` first runs the same compiled programs for two tokens (untimed), so the reported times
    exclude compilation."""
    prompts = [list(p) for p in prompts]
    check_fits([len(p) for p in prompts], max_new_tokens, context_limit(target, max_seq_len))
    pad = target.cfg.pad_token_id if target.cfg.pad_token_id is not None else 0
    tokens, lengths = pad_prompts(prompts, pad)
    if warmup:
        _generate(target, tokens, lengths, max_new_tokens, 2, sampling, seed)
    return _generate(target, tokens, lengths, max_new_tokens, max_new_tokens, sampling, seed)


def _generate(target, tokens, lengths, max_new_tokens, limit, sampling, seed) -> GenerationOutput:
    cache = target.init_cache(len(tokens), cache_capacity(lengths, max_new_tokens))
    t0 = time.perf_counter()
    logits, _, cache = prefill(target.params, cache, jnp.asarray(tokens), jnp.asarray(lengths),
                               forward=target.forward, cfg=target.cfg)
    logits.block_until_ready()
    t1 = time.perf_counter()
    out, counts, _ = decode_loop(target.params, cache, logits, jax.random.PRNGKey(seed), jnp.int32(limit),
                              forward=target.forward,
                              cfg=target.cfg, sampling=sampling, max_new_tokens=max_new_tokens,
                              eos_ids=tuple(target.eos_token_ids))
    out, counts = to_host(out), to_host(counts)  # multi-host: gathers rows that live on other hosts
    t2 = time.perf_counter()
    rows = [out[i, : counts[i]].tolist() for i in range(len(tokens))]
    return GenerationOutput(rows, lengths.tolist(), t1 - t0, t2 - t1)


def ar_metrics(output: GenerationOutput) -> "DecodeMetrics":
    """AR decoding in the common schema: one target step per token after the first (tau = 1)."""
    from specdec.metrics import DecodeMetrics

    rows = len(output.tokens)
    return DecodeMetrics(new_tokens=output.num_new_tokens, rounds=output.num_new_tokens - rows,
                         accepted_draft_tokens=0, proposed_draft_tokens=0,
                         prefill_seconds=output.prefill_seconds, decode_seconds=output.decode_seconds,
                         draft_seconds=0.0, verify_seconds=output.decode_seconds, batch_size=rows)
