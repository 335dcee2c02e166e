"""Sampling settings, the logits -> distribution transform, and the keyed randomness every draw shares.

Lossless speculative sampling requires applying the same transform (temperature, top-k, top-p) to the target
and the draft distributions before the acceptance test; every caller goes through `probabilities` here.
`temperature == 0` means greedy: the distribution is the one-hot argmax.

Every random draw of decoding (AR's token, a drafter's token, a verification policy's test) takes its noise
from `noise_bits`: a pure function of (seed, row, absolute position, token id, stream), never of the round
that draws it. A token at position t of row r is sampled by Gumbel-max over the processed logits with the
noise of (seed, r, t) (`sample`), so AR decoding and speculative decoding with an `invariant_*` policy commit
the same token whatever the drafter, the verify width or the batch (specdec/verify/invariant.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def processed_logits(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """Temperature, then top-k, then top-p (as Hugging Face orders them); masked entries become -inf."""
    logits = logits.astype(jnp.float32)
    if sp.greedy:
        return logits
    logits = logits / sp.temperature
    if sp.top_k > 0 and sp.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sp.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sp.top_p < 1.0:
        threshold = top_p_threshold(logits, sp.top_p)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


TOP_P_PREFIX = 256  # the largest logits sorted when applying top-p (enough for all but near-uniform rows)


def _order_key(x: jax.Array) -> jax.Array:
    """float32 -> int32 with the same order (the sign-magnitude bits made two's complement)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))


def _from_order_key(key: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(jnp.where(key >= 0, key, key ^ jnp.int32(0x7FFFFFFF)), jnp.float32)


def top_p_threshold(logits: jax.Array, top_p: float) -> jax.Array:
    """The smallest logit [..., 1] of the nucleus: the fewest largest-probability tokens whose mass reaches
    `top_p` (at least one token). Tokens whose logit is below it are dropped; ties with it are kept.

    Sorting the whole vocabulary is the textbook way, and on CPU that sort was most of a sampled decode step
    (benchmarks/bench_sampling.py). So the top `TOP_P_PREFIX` logits are sorted
    (`lax.top_k`): when they hold at least `top_p` of the mass, the nucleus lies inside them and the threshold
    read there is the full sort's. If any row's prefix holds less (a near-uniform row), the batch's thresholds
    come from a bisection instead: the threshold is the smallest logit value v with mass(logits > v) < top_p,
    and that mass only falls as v grows, so 32 halvings over the order-preserving integer image of float32
    find it. Both are the same rule as the sort; the masses are float32 sums taken in another order, so a token
    whose mass-before lies within float32 rounding (~1e-6) of top_p can fall on the other side than in a sort
    (1 token of 64 x 49,152 in benchmarks/bench_sampling.py), as it can between any two float32
    implementations. Every caller shares this function, so the target and the draft use the same nucleus."""
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    k = min(TOP_P_PREFIX, logits.shape[-1])
    desc = jax.lax.top_k(logits, k)[0]
    probs = jnp.exp(desc - lse)  # the prefix's probabilities in the whole distribution
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    threshold = jnp.min(jnp.where(mass_before < top_p, desc, jnp.inf), axis=-1, keepdims=True)
    if k == logits.shape[-1]:
        return threshold

    def bisection():
        all_probs = jnp.exp(logits - lse)

        def halve(_, bounds):  # invariant: mass(> hi) < top_p, and every key below lo fails
            lo, hi = bounds
            mid = (lo & hi) + ((lo ^ hi) >> 1)  # floor((lo + hi) / 2) without int32 overflow
            ok = jnp.sum(jnp.where(logits > _from_order_key(mid), all_probs, 0.0), axis=-1, keepdims=True) < top_p
            return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

        bounds = (_order_key(jnp.min(logits, axis=-1, keepdims=True)),
                  _order_key(jnp.max(logits, axis=-1, keepdims=True)))
        _, hi = jax.lax.fori_loop(0, 32, halve, bounds)
        return _from_order_key(hi)

    prefix_mass = mass_before[..., -1] + probs[..., -1]
    return jax.lax.cond(jnp.all(prefix_mass >= top_p), lambda: threshold, bisection)


def probabilities(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """The distribution the sampler draws from: softmax of the processed logits, one-hot argmax if greedy."""
    if sp.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(processed_logits(logits, sp), axis=-1)


# ---------------------------------------------------------------------------------------------------------
# Keyed randomness: the noise of a draw is a function of (seed, row, absolute position, token id, stream)
# ---------------------------------------------------------------------------------------------------------

# Streams: the noise AR, the invariant policies and the drafters share (a drafter that draws with the target's
# noise agrees with the target's sample as often as the coupling allows); the rejection policies' correction /
# bonus draws and their acceptance tests, each independent of the draft they judge and of each other.
SAMPLE_STREAM = 0
CORRECTION_STREAM = 1
TEST_STREAM = 2
_STREAM_SALT = (0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleKey:
    """Whose draws these are: the run's seed, each row's identity and the absolute position of the first token
    a call draws (offset 0; a draft node at depth d draws at offset d - 1, a verify position i at offset i).

    `rows` is each row's index in the caller's prompt list (`generate` / `speculative_generate` number the
    prompts 0..B-1 in the order given), so a prompt's sampled text depends on its seed, its place in the list
    and its tokens, never on the verify widths or drafts of a run. Positions are sequence indices: the first
    generated token of a prompt of length P sits at position P."""

    seed: jax.Array  # uint32 []
    rows: jax.Array  # int32 [B]
    start: jax.Array  # int32 [B] the absolute position of offset 0

    def at(self, start: jax.Array) -> "SampleKey":
        return SampleKey(seed=self.seed, rows=self.rows, start=jnp.asarray(start, jnp.int32))


def sample_key(seed: int, batch: int, start=0) -> SampleKey:
    """The key of a run with `seed` over `batch` prompts (rows 0..batch-1)."""
    return SampleKey(seed=jnp.uint32(int(seed) % 2**32), rows=jnp.arange(batch, dtype=jnp.int32),
                     start=jnp.broadcast_to(jnp.asarray(start, jnp.int32), (batch,)))


def as_sample_key(key, batch: int) -> SampleKey:
    """`key` as a SampleKey: a SampleKey is returned as is; a `jax.random` key stands for the seed drawn from it
    with rows 0..batch-1 at position 0 (unit tests and the policy harness hand policies plain keys)."""
    if isinstance(key, SampleKey):
        return key
    return SampleKey(seed=jax.random.bits(key, (), jnp.uint32), rows=jnp.arange(batch, dtype=jnp.int32),
                     start=jnp.zeros((batch,), jnp.int32))


def _mix(x: jax.Array) -> jax.Array:
    """A bijective avalanche mix of uint32 (Wellons' lowbias32): every input bit flips each output bit with
    probability ~1/2. Integer ops only: cheap to compile on XLA:CPU, unlike a threefry call per draw."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x21F0AAAD)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0xD35A2D97)
    return x ^ (x >> 15)


def noise_bits(seed, rows, positions, ids, stream: int = SAMPLE_STREAM) -> jax.Array:
    """uint32 bits of (seed, row, position, id) in `stream`, broadcast over the arguments' shapes. For a fixed
    (seed, row, position) distinct ids get distinct bits (each step is a bijection)."""
    u32 = lambda a: jnp.asarray(a).astype(jnp.uint32)  # noqa: E731
    x = _mix(u32(seed) ^ jnp.uint32(_STREAM_SALT[stream]))
    x = _mix(x ^ u32(rows))
    x = _mix(x ^ u32(positions))
    return _mix(_mix(x ^ u32(ids)))


def bits_to_uniform(bits: jax.Array) -> jax.Array:
    """uint32 -> float32 in (0, 1): w = (bits + 1/2) / 2^32, kept below 1."""
    w = bits.astype(jnp.float32) * jnp.float32(2.0 ** -32) + jnp.float32(2.0 ** -33)
    return jnp.minimum(w, jnp.float32(1.0 - 2.0 ** -24))


def gumbel_noise(key, offsets: jax.Array, ids, stream: int = SAMPLE_STREAM) -> jax.Array:
    """Gumbel(0, 1) noise [B, ..., V] for the tokens `ids` [V] at positions key.start + offsets (int [B, ...]);
    `key` a SampleKey or a `jax.random` key (`as_sample_key`). The one noise source of every sampled token.

    g = -log(-log1p(-w)): the exponential variate -log1p(-w) keeps full relative precision where it is small,
    which is where the largest Gumbel values (the ones an argmax picks) come from."""
    offsets = jnp.asarray(offsets, jnp.int32)
    key = as_sample_key(key, offsets.shape[0])
    lead = (-1,) + (1,) * (offsets.ndim - 1)
    positions = key.start.reshape(lead) + offsets
    w = bits_to_uniform(noise_bits(key.seed, key.rows.reshape(lead)[..., None], positions[..., None],
                                   jnp.asarray(ids), stream))
    return -jnp.log(-jnp.log1p(-w))


def verify_uniforms(key: SampleKey, offsets, slots) -> jax.Array:
    """U(0, 1) [B, N] for a rejection policy's tests: node `slots` [N] at position key.start + offsets [B, N]
    (its own slot, so siblings at one position get independent tests), in the test stream."""
    offsets = jnp.asarray(offsets, jnp.int32)
    key = as_sample_key(key, offsets.shape[0])
    rows = key.rows[:, None]
    positions = key.start[:, None] + offsets
    return bits_to_uniform(noise_bits(key.seed, rows, positions, jnp.asarray(slots), TEST_STREAM))


def _vocab_ids(logits: jax.Array, ids) -> jax.Array:
    return jnp.arange(logits.shape[-1], dtype=jnp.int32) if ids is None else ids


def sample_with_probs(key, logits: jax.Array, sp: SamplingParams, offsets=0, ids=None):
    """Token ids [B, ...] drawn from logits [B, ..., V] at positions key.start + offsets (broadcast to [B, ...]:
    a scalar, per-node [N], or per row and node [B, N]) by Gumbel-max over the
    processed logits, and the distribution they were drawn from (softmax of the same processed logits; None
    when greedy). `ids` [V]: the target token ids of the V logits (a reduced draft vocabulary), so a drafter's
    noise for a token is the target's noise for it. The token always has positive probability in the returned
    q: both come from one processed tensor."""
    if sp.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    key = as_sample_key(key, logits.shape[0])
    offsets = jnp.broadcast_to(jnp.asarray(offsets, jnp.int32), logits.shape[:-1])
    z = processed_logits(logits, sp)
    tokens = jnp.argmax(z + gumbel_noise(key, offsets, _vocab_ids(logits, ids)), axis=-1).astype(jnp.int32)
    return tokens, jax.nn.softmax(z, axis=-1)


def sample(key, logits: jax.Array, sp: SamplingParams, offsets=0, ids=None) -> jax.Array:
    """Draw token ids [B, ...] from logits [B, ..., V] at positions key.start + offsets (a `SampleKey`, or a
    `jax.random` key: `as_sample_key`). Greedy: the argmax. The AR sample at a position is this draw."""
    return sample_with_probs(key, logits, sp, offsets, ids)[0]
