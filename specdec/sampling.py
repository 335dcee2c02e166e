"""Sampling settings and the logits -> distribution transform shared by AR decoding and verification.

Lossless speculative sampling requires applying the same transform (temperature, top-k, top-p) to the target
and the draft distributions before the acceptance test; every caller goes through `probabilities` here.
`temperature == 0` means greedy: the distribution is the one-hot argmax.
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


def sample(key: jax.Array, logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """Draw token ids [...] from logits [..., V]."""
    if sp.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, processed_logits(logits, sp), axis=-1).astype(jnp.int32)
