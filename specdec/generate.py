"""Autoregressive generation: the baseline every speculative result is compared with.

Prefill runs the right-padded prompts of a batch through the target in one step; the decode loop is one
compiled `lax.while_loop` (no host round trip per token). Rows finish independently at EOS or at
`max_new_tokens`; a finished row stops advancing its cache and its outputs are masked.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specdec.models.transformer import KVCache, init_cache
from specdec.sampling import GREEDY, SamplingParams, as_sample_key, processed_logits, sample, sample_key
from specdec.sharding import to_host
from specdec.target import Target

if TYPE_CHECKING:
    from specdec.metrics import DecodeMetrics

PROMPT_BUCKET = 32  # prompts are padded to a multiple of this, so a few compiled prefill shapes serve all
# Cache capacities are rounded up to a multiple of this: every compiled decode or speculative loop is specialised
# to its capacity (a speculative loop takes tens of seconds to compile on a 2-core CPU), so prompts of different
# lengths share one program per bucket. Slots beyond a row's length still cost a masked attention read each:
# ~0.5% of a SmolLM2-135M step per 64 slots at batch 1, but ~7% at batch 8 (docs/results/plain_round/batch8_*).
CAPACITY_BUCKET = 256
# A speculative loop's draft slack (`cache_capacity`'s `extra`) is rounded up to a multiple of this, not to a
# bucket: 8 divides it, as the megakernel's KV tiles need (specdec/kernels/schedule.py `kv_tile_for`).
SLACK_ALIGN = 16
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


def row_limits(max_new_tokens: int | Sequence[int], rows: int) -> tuple[int, np.ndarray]:
    """(the largest limit, int32 [rows] each row's limit) of `max_new_tokens`: one limit for every row, or one
    per row (requests that each ask for their own number of tokens end at different times)."""
    limits = np.broadcast_to(np.asarray(max_new_tokens, np.int64), (rows,)) if np.ndim(max_new_tokens) == 0 \
        else np.asarray(max_new_tokens, np.int64)
    if limits.shape != (rows,):
        raise ValueError(f"max_new_tokens gives {limits.size} limits for {rows} prompts: give one, or one per prompt")
    if rows and limits.min() < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {int(limits.min())}")
    return int(limits.max(initial=1)), limits.astype(np.int32)


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, bucket: int = PROMPT_BUCKET):
    """Right-pad prompts to a common bucketed length: (tokens int32 [B, T], lengths int32 [B])."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    width = int(-(-lengths.max() // bucket) * bucket)
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths


def cache_capacity(prompt_lengths: Sequence[int], max_new_tokens: int, extra: int = 0,
                   bucket: int = CAPACITY_BUCKET) -> int:
    """Cache slots needed: the padded prompt width is written in prefill, then the new tokens, rounded up to a
    bucket; then `extra` slots (a speculative loop's slack: its verify writes up to N + 1 positions past the last
    committed one) rounded up to SLACK_ALIGN only. Adding the slack after the bucket keeps the speculative loop's
    cache AR's plus a few slots: rounded together, a slack that crossed a bucket doubled the cache (512 slots
    against AR's 256), and at batch 8 a round that verifies nothing then cost 1.30x AR's step instead of 0.97x
    (docs/results/plain_round/batch8_prompt190 against batch8_prompt150)."""
    padded = -(-max(prompt_lengths) // PROMPT_BUCKET) * PROMPT_BUCKET
    need = max(padded, max(prompt_lengths) + max_new_tokens + 1)
    return int(-(-need // bucket) * bucket + -(-extra // SLACK_ALIGN) * SLACK_ALIGN)


@functools.partial(jax.jit, static_argnames=("forward", "cfg", "taps"), donate_argnames=("cache",))
def prefill(params, cache: KVCache, tokens, lengths, *, forward: Callable, cfg, taps=()):
    """Run right-padded prompts; commit each row's own length. Returns (last logits [B, V], taps, cache)."""
    out = forward(params, cfg, cache, tokens, taps=taps, logits_at=(lengths - 1)[:, None])
    return out.logits[:, 0], out.taps, out.cache.with_lengths(lengths)


def prefill_distinct(params, cache: KVCache, tokens, lengths, *, forward: Callable, cfg, taps=()):
    """`prefill` that runs each distinct prompt once: a row repeating an earlier row's prompt (n samples of one
    prompt, as in the sampled lossless check) gets that row's K/V, last logits and taps. The results are the
    same; the work and the activations' memory shrink by the repeat factor (the check used to prefill 128
    copies of each prompt: 257 s of a 300 s sweep row; now 86 s)."""
    rows = np.column_stack([np.asarray(tokens), np.asarray(lengths)])  # equal padded tokens AND equal length
    _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    if len(first) == len(rows):
        return prefill(params, cache, tokens, lengths, forward=forward, cfg=cfg, taps=taps)
    leaf = jax.tree.leaves(cache.k)[0]
    small = init_cache(cfg, len(first), cache.capacity, stacked=leaf.ndim == 5, dtype=leaf.dtype)
    logits, tapped, small = prefill(params, small, jnp.asarray(tokens)[first], jnp.asarray(lengths)[first],
                                    forward=forward, cfg=cfg, taps=taps)
    return _copy_rows(cache, small, logits, tapped, jnp.asarray(inverse.reshape(-1), jnp.int32))


@functools.partial(jax.jit, donate_argnames=("cache",))
def _copy_rows(cache: KVCache, small: KVCache, logits, taps, source):
    """Row i of the result is row source[i] of `small` / `logits` / `taps` ([num_taps, B, T, H]); written into
    the donated full-batch `cache`, so its buffers (and their sharding) are reused."""
    def put(big, part):
        return big.at[...].set(jnp.take(part, source, axis=KVCache.batch_axis(part)))

    full = KVCache(k=jax.tree.map(put, cache.k, small.k), v=jax.tree.map(put, cache.v, small.v),
                   lengths=small.lengths[source])
    return logits[source], None if taps is None else taps[:, source], full


@functools.partial(jax.jit, static_argnames=("forward", "cfg", "sampling", "max_new_tokens", "eos_ids"),
                   donate_argnames=("cache",))
def decode_loop(params, cache: KVCache, first_logits, key, limit, *, forward: Callable, cfg,
                sampling: SamplingParams, max_new_tokens: int, eos_ids: tuple[int, ...]):
    """Sample up to `limit` [B] (<= max_new_tokens, traced) tokens per row inside one while_loop. `key`: a
    `specdec.sampling.SampleKey` (its `start` unused): the token at position t of row r is drawn with the noise of
    (seed, r, t), which speculative decoding's invariant policies reproduce token for token.
    Returns (tokens [B, max_new_tokens] -1 padded, counts [B], cache). The cache is donated and returned so
    the loop updates it in place instead of copying every layer's buffers on entry."""
    batch = first_logits.shape[0]
    eos = jnp.asarray(eos_ids or (NO_EOS,), jnp.int32)
    key = as_sample_key(key, batch)

    def emit(state, logits):
        out, count, done, key, cache = state
        token = sample(key.at(cache.lengths), logits, sampling)  # the token lands at position cache.lengths
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


def generate(target: Target, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 64,
             sampling: SamplingParams = GREEDY, seed: int = 0, max_seq_len: int | None = None,
             warmup: bool = False) -> GenerationOutput:
    """Autoregressive generation for a batch of token-id prompts of any lengths, up to `max_new_tokens` each (one
    limit, or one per prompt). Sampled tokens are keyed by (seed, the prompt's index in `prompts`, absolute
    position): `specdec.sampling.SampleKey`.

    `warmup=True` first runs the same compiled programs for two tokens (untimed), so the reported times
    exclude compilation."""
    prompts = [list(p) for p in prompts]
    max_new_tokens, limits = row_limits(max_new_tokens, len(prompts))
    check_fits([len(p) for p in prompts], max_new_tokens, context_limit(target, max_seq_len))
    pad = target.cfg.pad_token_id if target.cfg.pad_token_id is not None else 0
    tokens, lengths = pad_prompts(prompts, pad)
    if warmup:
        _generate(target, tokens, lengths, max_new_tokens, np.minimum(limits, 2), sampling, seed)
    return _generate(target, tokens, lengths, max_new_tokens, limits, sampling, seed)


def _generate(target, tokens, lengths, max_new_tokens, limit, sampling, seed) -> GenerationOutput:
    cache = target.init_cache(len(tokens), cache_capacity(lengths, max_new_tokens))
    t0 = time.perf_counter()
    logits, _, cache = prefill_distinct(target.params, cache, tokens, lengths, forward=target.forward,
                                        cfg=target.cfg)
    logits.block_until_ready()
    t1 = time.perf_counter()
    out, counts, _ = decode_loop(target.params, cache, logits, sample_key(seed, len(tokens)),
                              jnp.broadcast_to(jnp.asarray(limit, jnp.int32), (len(tokens),)),
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
    steps = max((len(t) - 1 for t in output.tokens), default=0)  # the loop runs until its longest row ends
    return DecodeMetrics(new_tokens=output.num_new_tokens, rounds=output.num_new_tokens - rows, row_steps=rows * steps,
                         accepted_draft_tokens=0, proposed_draft_tokens=0,
                         prefill_seconds=output.prefill_seconds, decode_seconds=output.decode_seconds,
                         draft_seconds=0.0, verify_seconds=output.decode_seconds, batch_size=rows)


# ---------------------------------------------------------------------------------------------------------
# Continuous batching (throughput for distillation data)
# ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ContinuousShapes:
    """The fixed shapes of a continuous-batching run: every chunk and every insert reuses one program each."""

    batch_size: int  # decode rows
    insert_rows: int  # prompts prefilled per insert (a chunk returns to the host once this many rows are free)
    width: int  # padded prompt width (the longest prompt of the run, bucketed)
    capacity: int  # cache slots per row
    max_new_tokens: int


class DecodeState(NamedTuple):
    """Per-row decode state of the continuous batcher (all device arrays, fixed shapes)."""

    cache: KVCache
    token: jax.Array  # int32 [B] the last sampled token (the next step's input)
    out: jax.Array  # int32 [B, max_new_tokens] sampled tokens, -1 padded
    count: jax.Array  # int32 [B] tokens sampled so far
    done: jax.Array  # bool [B] finished (EOS / its limit) or holding no prompt
    limit: jax.Array  # int32 [B] the new tokens its prompt asks for (<= the run's max_new_tokens)
    keys: jax.Array  # uint32 [B, 2] the row's prompt key; token t is drawn with fold_in(key, t)
    row_steps: jax.Array  # int32 [] decode row-steps run (B per step), for the utilisation figure
    kept: jax.Array  # int32 [] decode row-steps that produced a kept token


def _row_sample(keys, counts, logits, sampling: SamplingParams):
    """One token per row [B] from logits [B, V], drawn with the row's own key folded with its token index: a
    prompt's tokens then depend only on its key, never on which rows share the batch or when it was inserted.

    Sampling is by inverse CDF (one uniform per row against the cumulative distribution of `sampling`'s
    processed logits), not `sample`'s Gumbel-max: the same distribution, but one random number per row instead
    of one per vocabulary entry. Drawing 64 x 49152 Gumbel variates took 44 ms of a 435 ms decode step."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    step_keys = jax.vmap(jax.random.fold_in)(keys, counts)
    cdf = jnp.cumsum(jax.nn.softmax(processed_logits(logits, sampling), axis=-1), axis=-1)
    # u > 0, so an entry of probability 0 (cdf equal to its predecessor's) is never the first cdf >= u
    tiny = jnp.finfo(jnp.float32).tiny
    u = jax.vmap(lambda k: jax.random.uniform(k, (), minval=tiny))(step_keys) * cdf[:, -1]
    return jnp.minimum(jnp.sum(cdf < u[:, None], axis=-1), logits.shape[-1] - 1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("forward", "cfg", "sampling", "eos_ids"), donate_argnames=("state",))
def insert_prompts(params, state: DecodeState, tokens, lengths, slots, prompt_keys, limits, *, forward: Callable,
                   cfg, sampling: SamplingParams, eos_ids: tuple[int, ...]) -> DecodeState:
    """Prefill R right-padded prompts (tokens [R, W], lengths [R]) and place them in decode rows `slots` [R]
    (a slot >= B is a padding entry and is dropped), each row to stop after `limits` [R] new tokens: their K/V go
    to cache positions 0..W-1 of those rows, their first token is sampled, and the rows restart. The state is
    donated, so the big cache is updated in place."""
    r, width = tokens.shape
    eos = jnp.asarray(eos_ids or (NO_EOS,), jnp.int32)
    stacked = jax.tree.leaves(state.cache.k)[0].ndim == 5
    small = init_cache(cfg, r, width, stacked=stacked, dtype=jax.tree.leaves(state.cache.k)[0].dtype)
    logits, _, prefilled = prefill(params, small, tokens, lengths, forward=forward, cfg=cfg)
    first = _row_sample(prompt_keys, jnp.zeros((r,), jnp.int32), logits, sampling)

    def place(big, new):  # new [.., R, KVH, W, HD] -> rows `slots`, positions 0..W-1 of big [.., B, KVH, S, HD]
        index = (slice(None),) * KVCache.batch_axis(big) + (slots, slice(None), slice(0, width))
        return big.at[index].set(new, mode="drop")

    cache = KVCache(k=jax.tree.map(place, state.cache.k, prefilled.k),
                    v=jax.tree.map(place, state.cache.v, prefilled.v),
                    lengths=state.cache.lengths.at[slots].set(lengths, mode="drop"))
    rows_out = jnp.full((r, state.out.shape[1]), -1, jnp.int32).at[:, 0].set(first)
    return state._replace(
        cache=cache, token=state.token.at[slots].set(first, mode="drop"),
        out=state.out.at[slots].set(rows_out, mode="drop"),
        count=state.count.at[slots].set(1, mode="drop"),
        done=state.done.at[slots].set(jnp.isin(first, eos) | (limits <= 1), mode="drop"),
        limit=state.limit.at[slots].set(limits, mode="drop"),
        keys=state.keys.at[slots].set(prompt_keys, mode="drop"))


@functools.partial(jax.jit, static_argnames=("forward", "cfg", "sampling", "eos_ids"), donate_argnames=("state",))
def decode_chunk(params, state: DecodeState, return_when_done, *, forward: Callable, cfg,
                 sampling: SamplingParams, eos_ids: tuple[int, ...]) -> DecodeState:
    """Decode every unfinished row, one token per step inside one while_loop, until at least
    `return_when_done` (traced) rows are finished or all are. Finished rows ride along masked (their cache
    does not advance) until the host refills them."""
    batch, max_new = state.out.shape
    eos = jnp.asarray(eos_ids or (NO_EOS,), jnp.int32)
    rows = jnp.arange(batch)

    def cond(s: DecodeState):
        finished = jnp.sum(s.done.astype(jnp.int32))
        return (finished < batch) & (finished < return_when_done)

    def body(s: DecodeState):
        step = forward(params, cfg, s.cache, s.token[:, None])
        live = ~s.done
        cache = step.cache.advance(live.astype(jnp.int32))
        token = _row_sample(s.keys, s.count, step.logits[:, 0], sampling)
        at = jnp.minimum(s.count, max_new - 1)
        out = s.out.at[rows, at].set(jnp.where(live, token, s.out[rows, at]))
        count = s.count + live.astype(jnp.int32)
        done = s.done | jnp.isin(token, eos) | (count >= s.limit)
        return DecodeState(cache, token, out, count, done, s.limit, s.keys, s.row_steps + batch,
                           s.kept + jnp.sum(live.astype(jnp.int32)))

    return jax.lax.while_loop(cond, body, state)


@dataclasses.dataclass
class ContinuousStats:
    """What a continuous-batching run did (host-side totals)."""

    new_tokens: int = 0  # tokens handed out (EOS included)
    decode_row_steps: int = 0  # B per decode step
    decode_kept: int = 0  # decode row-steps that produced a kept token
    chunks: int = 0
    inserts: int = 0
    seconds: float = 0.0  # wall time inside the generator (device work and host refill; not the consumer's)
    decode_seconds: float = 0.0  # the part of `seconds` spent in decode chunks (the rest: inserts and the host)

    @property
    def utilisation(self) -> float:
        """Fraction of decode row-steps that produced a kept token (1.0: no row ever idled)."""
        return self.decode_kept / self.decode_row_steps if self.decode_row_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def continuous_shapes(target: Target, prompt_lengths: Sequence[int], max_new_tokens: int, batch_size: int,
                      insert_rows: int = 8, max_seq_len: int | None = None) -> ContinuousShapes:
    """Shapes serving every prompt of a run (checked against the context; prompts are never truncated)."""
    if batch_size < 1 or insert_rows < 1:
        raise ValueError(f"batch_size and insert_rows must be >= 1, got {batch_size} and {insert_rows}")
    width = int(-(-max(prompt_lengths) // PROMPT_BUCKET) * PROMPT_BUCKET)
    check_fits(prompt_lengths, max_new_tokens, context_limit(target, max_seq_len))
    # a row's K/V end at its own prompt length + new tokens; only the insert needs all `width` slots
    capacity = cache_capacity(prompt_lengths, max_new_tokens)
    return ContinuousShapes(batch_size, min(insert_rows, batch_size), width, capacity, max_new_tokens)


def generate_continuous(target: Target, prompts: Sequence[Sequence[int]], prompt_seeds: Sequence[int],
                        shapes: ContinuousShapes, sampling: SamplingParams = GREEDY, seed: int = 0,
                        stats: ContinuousStats | None = None, warmup: bool = False,
                        max_new_tokens: Sequence[int] | None = None):
    """Continuous batching: yields (prompt index, new tokens with EOS if it stopped there) as each prompt ends.
    Prompt i stops after `max_new_tokens[i]` new tokens (default: `shapes.max_new_tokens` for every prompt).

    `batch_size` decode rows run in one compiled while_loop (`decode_chunk`) that returns to the host as soon
    as `insert_rows` of them are finished; the host then prefills the next prompts into those rows' cache slots
    (`insert_prompts`, one fixed-shape program) and decoding continues. Rows therefore idle for at most the
    few steps it takes `insert_rows` rows to finish, instead of until the batch's longest row ends, and the
    host works once per chunk, never per token. Results come out in completion order.

    Determinism: prompt i's token t is drawn with fold_in(fold_in(PRNGKey(seed), prompt_seeds[i]), t), so its
    response depends only on the prompt and its seed, not on the co-batched rows, the insertion time or
    the row it lands in (on a fixed-shape program every row runs the same arithmetic; the tests check this).
    At temperature 0 the responses are those of `generate`. `warmup=True` first compiles and runs both programs
    once with no effect (an insert whose rows are all dropped, a chunk of zero steps), outside `stats.seconds`.
    """
    if len(prompts) != len(prompt_seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(prompt_seeds)} prompt seeds")
    stats = stats if stats is not None else ContinuousStats()
    b, r, width = shapes.batch_size, shapes.insert_rows, shapes.width
    limits = np.full(len(prompts), shapes.max_new_tokens, np.int32) if max_new_tokens is None \
        else np.asarray(max_new_tokens, np.int32)
    if limits.shape != (len(prompts),) or (len(prompts) and not 1 <= limits.min() <= limits.max()
                                           <= shapes.max_new_tokens):
        raise ValueError(f"max_new_tokens must give each of the {len(prompts)} prompts a limit in [1, "
                         f"{shapes.max_new_tokens}] (the run's shapes), got {list(np.ravel(max_new_tokens))}")
    for i, p in enumerate(prompts):
        if not 1 <= len(p) <= width:
            raise ValueError(f"prompt {i} has {len(p)} tokens; the run's prompt width is {width}")
    pad = target.cfg.pad_token_id if target.cfg.pad_token_id is not None else 0
    eos_ids = tuple(target.eos_token_ids)
    base = jax.random.PRNGKey(seed)
    all_keys = np.asarray(jax.vmap(lambda s: jax.random.fold_in(base, s))(jnp.asarray(prompt_seeds, jnp.uint32)))
    state = DecodeState(cache=target.init_cache(b, shapes.capacity), token=jnp.zeros((b,), jnp.int32),
                        out=jnp.full((b, shapes.max_new_tokens), -1, jnp.int32), count=jnp.zeros((b,), jnp.int32),
                        done=jnp.ones((b,), bool), limit=jnp.full((b,), shapes.max_new_tokens, jnp.int32),
                        keys=jnp.zeros((b, 2), jnp.uint32),
                        row_steps=jnp.int32(0), kept=jnp.int32(0))
    if warmup:
        state = insert_prompts(target.params, state, jnp.full((r, width), pad, jnp.int32), jnp.ones((r,), jnp.int32),
                               jnp.full((r,), b, jnp.int32), jnp.zeros((r, 2), jnp.uint32), jnp.ones((r,), jnp.int32),
                               forward=target.forward, cfg=target.cfg, sampling=sampling, eos_ids=eos_ids)
        state = decode_chunk(target.params, state, jnp.int32(0), forward=target.forward, cfg=target.cfg,
                             sampling=sampling, eos_ids=eos_ids)
        state.out.block_until_ready()
    holder = [-1] * b  # prompt index held by each decode row (-1: free)
    queue = 0  # next prompt to insert
    t0 = time.perf_counter()
    while True:
        free = [row for row in range(b) if holder[row] < 0]
        while free and queue < len(prompts):  # fill the free rows, insert_rows prompts per program call
            take = list(range(queue, min(queue + r, queue + len(free), len(prompts))))
            slots = np.full((r,), b, np.int32)  # b: a padding entry, dropped by the scatter
            tokens = np.full((r, width), pad, np.int32)
            lengths = np.ones((r,), np.int32)
            keys = np.zeros((r, 2), np.uint32)
            row_limits = np.ones((r,), np.int32)
            for j, i in enumerate(take):
                slots[j], holder[free[j]] = free[j], i
                tokens[j, : len(prompts[i])] = prompts[i]
                lengths[j], keys[j], row_limits[j] = len(prompts[i]), all_keys[i], limits[i]
            state = insert_prompts(target.params, state, jnp.asarray(tokens), jnp.asarray(lengths),
                                   jnp.asarray(slots), jnp.asarray(keys), jnp.asarray(row_limits),
                                   forward=target.forward, cfg=target.cfg, sampling=sampling, eos_ids=eos_ids)
            free, queue = free[len(take):], queue + len(take)
            stats.inserts += 1
        if all(h < 0 for h in holder):
            break
        # with prompts waiting, come back once a full insert's worth of rows is free; at the end, drain. The
        # inserts are waited for first, so that their prefills count as the host's part, not the chunk's.
        jax.block_until_ready(state)
        t1 = time.perf_counter()
        state = decode_chunk(target.params, state, jnp.int32(r if queue < len(prompts) else b),
                             forward=target.forward, cfg=target.cfg, sampling=sampling, eos_ids=eos_ids)
        jax.block_until_ready(state)
        stats.decode_seconds += time.perf_counter() - t1
        stats.chunks += 1
        done, count, out = np.asarray(state.done), np.asarray(state.count), np.asarray(state.out)
        finished = []
        for row in range(b):
            if holder[row] >= 0 and done[row]:
                finished.append((holder[row], out[row, : count[row]].tolist()))
                holder[row] = -1
        stats.decode_row_steps, stats.decode_kept = int(state.row_steps), int(state.kept)
        stats.new_tokens += sum(len(t) for _, t in finished)
        stats.seconds += time.perf_counter() - t0
        yield from finished  # the consumer's time (e.g. writing a shard) is not generation time
        t0 = time.perf_counter()
    stats.seconds += time.perf_counter() - t0
