"""Model configuration: one frozen dataclass describes every supported decoder-only family.

A new family (Llama, Qwen2, Qwen3, SmolLM2, ...) is a set of flags here, never a new modeling file.
The config is hashable so it can be a static argument of jitted functions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # Qwen2: biases on the q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    # RoPE scaling as in Hugging Face configs; only None and {"rope_type": "llama3", ...} are supported.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    dtype: str = "float32"  # parameter and activation dtype; float32 on CPU, bfloat16 on TPU/GPU
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    name: str = "model"

    def __post_init__(self):
        problems = []
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim"):
            if getattr(self, field) <= 0:
                problems.append(f"{field} must be positive, got {getattr(self, field)}")
        if self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            problems.append(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            problems.append(f"dtype must be one of float32, bfloat16, float16; got {self.dtype!r}")
        if self.rope_scaling is not None:
            kind = dict(self.rope_scaling).get("rope_type", dict(self.rope_scaling).get("type"))
            if kind not in ("llama3", "default"):
                problems.append(f"unsupported rope_scaling type {kind!r} (supported: llama3)")
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def num_parameters(self) -> int:
        h, f, v, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * f + 2 * h
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        total = L * per_layer + v * h + h
        if not self.tie_word_embeddings:
            total += v * h
        return total


def tiny_config(**overrides) -> ModelConfig:
    """A small random-weight Llama-family config for fast tests (two layers, GQA, tied embeddings)."""
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1,
                eos_token_ids=(2,), pad_token_id=2, name="tiny")
    base.update(overrides)
    return ModelConfig(**base)
