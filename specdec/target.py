"""The target model as the engine sees it: weights in a backend's layout plus one step function.

Backends share one signature (that of `specdec.models.transformer.forward`):
  reference   plain JAX; per-layer weights walked unrolled, q|k|v and gate|up fused, stored [out, in]
              (`transformer.fuse_layers`: fastest on XLA:CPU, also the GPU path)
  scan        plain JAX; stacked weights walked with lax.scan (small programs, the layout meshes shard)
  megakernel  Pallas TPU kernel, all layers in one program (interpret mode on CPU)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from specdec.models import transformer
from specdec.models.config import ModelConfig
from specdec.models.tokenizer import Tokenizer

BACKENDS = ("reference", "scan", "megakernel")


def _megakernel():
    from specdec.kernels import megakernel  # imported lazily: Pallas is only needed for this backend
    return megakernel


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    stacked: bool  # weights and cache in the stacked [L, ...] layout
    forward: Callable
    prepare: Callable | None = None  # (params, cfg) -> params in the backend's layout, run once at load


def get_backend(name: str) -> Backend:
    if name == "reference":
        return Backend("reference", False, transformer.forward, lambda p, cfg: transformer.fuse_layers(p))
    if name == "scan":
        return Backend("scan", True, transformer.forward)
    if name == "megakernel":
        mk = _megakernel()
        # keep the stacked layers beside the packed tiles: self-speculation and draft LMs read them
        return Backend("megakernel", True, mk.forward, lambda p, cfg: mk.prepare_params(p, cfg, keep_layers=True))
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")


@dataclasses.dataclass
class Target:
    """A loaded target: config, weights (in its backend's layout), tokenizer and step function."""

    cfg: ModelConfig
    params: Any
    tokenizer: Tokenizer | None
    backend: Backend

    @classmethod
    def from_params(cls, cfg: ModelConfig, params, tokenizer=None, backend: str = "reference") -> "Target":
        be = get_backend(backend)
        params = jax.tree.map(lambda a: jnp.asarray(a, cfg.jnp_dtype), params)
        params = transformer.stack_layers(params) if be.stacked else transformer.unstack_layers(params)
        if be.prepare is not None:
            params = be.prepare(params, cfg)
        return cls(cfg=cfg, params=params, tokenizer=tokenizer, backend=be)

    @property
    def forward(self) -> Callable:
        """forward(params, cfg, cache, tokens, positions=None, tree_mask=None, *, taps=(), logits_at=None)."""
        return self.backend.forward

    def output_projection(self) -> jax.Array:
        """The lm_head as [H, V] (the transposed embedding when the model ties them): what drafters that share
        or start from the target's head take (the step itself applies it in `transformer.final_logits`)."""
        p = self.params
        if self.cfg.tie_word_embeddings:
            return jnp.asarray(p["embed"]).T
        return jnp.asarray(p["lm_head_t"]).T if "lm_head_t" in p else jnp.asarray(p["lm_head"])

    def init_cache(self, batch_size: int, capacity: int) -> transformer.KVCache:
        return transformer.init_cache(self.cfg, batch_size, capacity, stacked=self.backend.stacked)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.cfg.eos_token_ids


def load_target(name_or_path: str = "smollm2-135m-instruct", *, backend: str = "reference",
                dtype: str = "float32") -> Target:
    """Load a registry model, a .gguf file or a Hugging Face-style directory as a ready target."""
    from specdec.models.loading import load_checkpoint

    get_backend(backend)  # fail on a bad name before the (slow) load
    cfg, params, tokenizer = load_checkpoint(name_or_path, dtype=dtype)
    return Target.from_params(cfg, params, tokenizer, backend=backend)


def random_target(cfg: ModelConfig, seed: int = 0, backend: str = "reference", scale: float = 0.02) -> Target:
    """A random-weight target (tests; tiny configs)."""
    params = transformer.init_params(cfg, jax.random.PRNGKey(seed), scale=scale)
    return Target.from_params(cfg, params, None, backend=backend)
