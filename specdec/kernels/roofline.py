"""Roofline of one target step: the bytes it must move, the FLOPs it does, and the floor per chip.

For a decode / verify step at small batch the step is memory-bound: every weight is read once and every
committed KV position is read once per layer, whether the step carries 1 token per row or k+1. The floor is
bytes / HBM bandwidth; expected tokens/s (per sequence) = tokens committed per step / floor. These are the
numbers a user with a TPU measures the megakernel against (docs/MEGAKERNEL.md); nothing here is measured.

Bytes counted (logical, unpadded):
  layer weights     each layer's 7 matrices + norm vectors, once per step (what the megakernel streams)
  embedding rows    B*T rows of the embedding table (a gather)
  final norm + lm_head   the [V, H] head (the tied embedding for SmolLM2), read once
  KV cache read     2 (K, V) * L * sum_b ceil(len_b / kv_tile) * kv_tile * KVH * HD (the kernel reads whole tiles)
  KV cache write    2 * L * B * T * KVH * HD
Activations (a few KB..MB) are ignored. FLOPs = 2 * MACs of the matmuls (projections, attention, lm_head).
"""

from __future__ import annotations

import dataclasses
import math

from specdec.kernels import schedule as sch
from specdec.models.config import ModelConfig

# Chips for the floor: TPU per-core HBM bandwidth (schedule.CHIPS) plus a GPU for comparison.
BANDWIDTH = {name: chip.hbm_bytes_per_s for name, chip in sch.CHIPS.items()} | {"H200": 4.8e12}
PEAK_FLOPS = {name: chip.peak_flops for name, chip in sch.CHIPS.items()} | {"H200": 989e12}


def smollm2_135m_config(dtype: str = "bfloat16") -> ModelConfig:
    """The real SmolLM2-135M shape (docs/FACTS.md), no weights needed."""
    return ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                       num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                       max_position_embeddings=8192, tie_word_embeddings=True, dtype=dtype,
                       name="smollm2-135m-instruct")


def llama_1b_class_config(dtype: str = "bfloat16", num_layers: int = 16) -> ModelConfig:
    """Llama-3.2-1B-like shapes: a layer (121 MB in bf16) that does not fit VMEM twice."""
    return ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=num_layers,
                       num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=True, dtype=dtype, name="llama-1b-class")


def tiny_roofline_config(dtype: str = "bfloat16") -> ModelConfig:
    from specdec.models.config import tiny_config
    return tiny_config(dtype=dtype)


MODELS = {"smollm2-135m-instruct": smollm2_135m_config, "1b": llama_1b_class_config, "tiny": tiny_roofline_config}


@dataclasses.dataclass(frozen=True)
class StepCost:
    batch: int
    num_new: int  # tokens per row in the step (1 = decode, k+1 = chain verify, tree size)
    context: int  # committed positions per row
    weight_bytes: int
    head_bytes: int
    embed_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    flops: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.head_bytes + self.embed_bytes + self.kv_read_bytes + self.kv_write_bytes

    def floor_s(self, chip: str) -> float:
        """Bandwidth floor in seconds (the compute floor is reported separately)."""
        return self.total_bytes / BANDWIDTH[chip]

    def compute_s(self, chip: str) -> float:
        return self.flops / PEAK_FLOPS[chip]


def layer_weight_bytes(cfg: ModelConfig) -> int:
    """All decoder layers: the 7 matrices plus norm vectors (and biases / QK norms if any)."""
    size = sch.itemsize(cfg.dtype)
    h, L = cfg.hidden_size, cfg.num_layers
    per_layer = h * sch.packed_columns(cfg) + 2 * h
    if cfg.attention_bias:
        per_layer += cfg.q_size + 2 * cfg.kv_size
    if cfg.qk_norm:
        per_layer += 2 * cfg.head_dim
    return L * per_layer * size


def step_cost(cfg: ModelConfig, batch: int, num_new: int, context: int, kv_tile: int = 128) -> StepCost:
    size = sch.itemsize(cfg.dtype)
    L, H, V, HD = cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    KVH, NH = cfg.num_kv_heads, cfg.num_heads
    rows = batch * num_new
    tiles = math.ceil(context / kv_tile)
    kv_read = 2 * L * batch * tiles * kv_tile * KVH * HD * size
    kv_write = 2 * L * rows * KVH * HD * size
    head = V * H * size + H * size  # lm_head (or tied embedding) + final norm
    embed = rows * H * size
    matmul = 2 * rows * H * sch.packed_columns(cfg) * L  # QKV, O, gate, up, down
    attn = 2 * 2 * L * rows * NH * HD * (context + num_new)  # QK^T and PV over prefix + new tokens
    lm = 2 * rows * H * V
    return StepCost(batch, num_new, context, layer_weight_bytes(cfg), head, embed, kv_read, kv_write,
                    matmul + attn + lm)


def roofline_rows(cfg: ModelConfig, batches=(1, 8), steps=(("decode", 1), ("verify k=7", 8)),
                  context: int = 1024, chips=("v5e", "v6e", "v7x", "H200")) -> list[dict]:
    """One row per (batch, step kind): bytes, FLOPs, and per chip the floor (ms) and expected tokens/s.
    Tokens/s for verify assumes every drafted token is accepted (the upper bound): k+1 tokens per row per step."""
    out = []
    for b in batches:
        for label, t in steps:
            c = step_cost(cfg, b, t, context)
            row = dict(step=label, batch=b, tokens=t, context=context, bytes=c.total_bytes,
                       kv_bytes=c.kv_read_bytes + c.kv_write_bytes, flops=c.flops)
            for chip in chips:
                floor = max(c.floor_s(chip), c.compute_s(chip))
                row[f"{chip}_ms"] = 1e3 * floor
                row[f"{chip}_bound"] = "mem" if c.floor_s(chip) >= c.compute_s(chip) else "compute"
                row[f"{chip}_tok_s"] = b * t / floor
            out.append(row)
    return out


def format_markdown(cfg: ModelConfig, context: int = 1024, batches=(1, 8)) -> str:
    chips = ("v5e", "v6e", "v7x", "H200")
    rows = roofline_rows(cfg, batches=batches, context=context, chips=chips)
    head_mb = cfg.vocab_size * cfg.hidden_size * sch.itemsize(cfg.dtype) / 1e6
    lines = [f"Model `{cfg.name}` ({cfg.dtype}): {cfg.num_parameters() / 1e6:.1f} M parameters, layer weights "
             f"{layer_weight_bytes(cfg) / 1e6:.1f} MB, lm_head {head_mb:.1f} MB; "
             f"context {context} committed positions per row.", "",
             "| step | B | MB moved | of which KV | GFLOP | "
             + " | ".join(f"{c} floor ms (tok/s)" for c in chips) + " |",
             "|---|---|---|---|---|" + "---|" * len(chips)]
    for r in rows:
        cells = [f"{r[f'{c}_ms']:.3f} ({r[f'{c}_tok_s']:,.0f})" + ("" if r[f"{c}_bound"] == "mem" else " C")
                 for c in chips]
        lines.append(f"| {r['step']} | {r['batch']} | {r['bytes'] / 1e6:.1f} | {r['kv_bytes'] / 1e6:.1f} | "
                     f"{r['flops'] / 1e9:.2f} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Floor = max(bytes / HBM bandwidth, FLOPs / peak bf16 FLOPs) per TensorCore (v5e 0.82, v6e 1.64, "
                 "v7x 3.7 TB/s; H200 4.8 TB/s); 'C' marks a compute-bound step. tok/s = B x tokens per step / floor, "
                 "i.e. for verify the bound when every draft token is accepted.")
    return "\n".join(lines)


def format_budget_markdown(cfg: ModelConfig, dims: sch.Dims) -> str:
    MiB = sch.MiB
    lines = [f"VMEM plan for `{cfg.name}` ({cfg.dtype}) at B={dims.batch}, T={dims.num_new}, "
             f"cache {dims.capacity}:", "",
             "| chip | VMEM | plan | weight banks | footprint | vmem_limit_bytes |", "|---|---|---|---|---|---|"]
    for r in sch.budget_table(cfg, dims):
        if r["footprint"] is None:
            lines.append(f"| {r['chip']} | {r['vmem'] / MiB:.0f} MiB | does not fit | | | refused |")
        else:
            lines.append(f"| {r['chip']} | {r['vmem'] / MiB:.0f} MiB | {r['plan']} | {r['banks'] / MiB:.1f} MiB | "
                         f"{r['footprint'] / MiB:.1f} MiB | {r['limit'] / MiB:.1f} MiB |")
    return "\n".join(lines)
