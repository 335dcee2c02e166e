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
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < sp.top_p  # the smallest set whose mass reaches top_p (>= 1 token)
        threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


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
