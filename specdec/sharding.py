"""Running past one device: a mesh from the config and the partition specs of everything that lives on it.

specdec does not communicate by itself. It places arrays on a `jax.sharding.Mesh` with `NamedSharding`s and lets
`jit` propagate those shardings through the unchanged step function, engine and training step; XLA inserts the
collectives. The mesh has two axes:

  data    data parallelism: token batches, KV-cache rows and training examples are split over it;
  model   tensor parallelism (Megatron-style) of the target: attention heads and MLP columns are split over it
          on the way in (wq/wk/wv, w_gate/w_up: column-parallel) and joined on the way out (wo, w_down:
          row-parallel), so each decoder block needs exactly two all-reduces; the embedding and the lm_head are
          split by vocabulary; the KV cache by KV heads, so attention never leaves its device.

    mesh = make_mesh(cfg.mesh)               # MeshConfig(data=2, model=4) -> 8 devices
    target = shard_target(target, mesh)      # the same Target, weights placed, caches created sharded
    speculative_generate(target, drafter, prompts)   # unchanged code: jit follows the input shardings

Drafters and training states use one simple rule (`drafter_specs`): every matrix's last dimension over the model
axis where it divides, everything else replicated; with `model=1` that is plain data parallelism.

Multi-host: every process runs the same command with the same config; `make_mesh` first calls
`jax.distributed.initialize()` when the environment asks for it (see `initialize_distributed`, docs/SHARDING.md).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from specdec.models import transformer
from specdec.models.config import ModelConfig
from specdec.target import Target

DATA, MODEL = "data", "model"
DISTRIBUTED_ENV = "SPECDEC_DISTRIBUTED"  # "1": call jax.distributed.initialize() with JAX's cluster auto-detection


class ShardingError(ValueError):
    """A mesh or a model that cannot be laid out as asked; the message names the sizes and what would fit."""


# ----------------------------------------------------------------------------------------------------------
# The mesh
# ----------------------------------------------------------------------------------------------------------

def initialize_distributed() -> bool:
    """Join a multi-process JAX cluster when the environment asks for it; True when running multi-process.

    Triggers: SPECDEC_DISTRIBUTED=1 (clusters JAX detects by itself: Cloud TPU pods, SLURM, Open MPI), or
    JAX_COORDINATOR_ADDRESS=host:port (read by JAX), with the process count and this process's id in
    SPECDEC_NUM_PROCESSES / SPECDEC_PROCESS_ID (JAX reads no variable for those). It must run before JAX touches a
    device, which is why `make_mesh` calls it first."""
    wanted = os.environ.get(DISTRIBUTED_ENV) == "1" or bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))
    if wanted and not jax.distributed.is_initialized():
        kwargs = {arg: int(os.environ[env]) for env, arg in (("SPECDEC_NUM_PROCESSES", "num_processes"),
                                                             ("SPECDEC_PROCESS_ID", "process_id"))
                  if os.environ.get(env)}
        try:
            jax.distributed.initialize(**kwargs)
        except (RuntimeError, ValueError) as e:
            raise ShardingError(f"jax.distributed.initialize({kwargs or ''}) failed ({e}); it must run before any JAX "
                                "computation and needs the coordinator address, process count and process id "
                                "(or a cluster JAX detects by itself); see docs/SHARDING.md") from None
    return jax.process_count() > 1


def make_mesh(mesh_cfg, devices=None) -> Mesh:
    """A (data, model) mesh over the first data*model devices. `mesh_cfg`: `specdec.config.MeshConfig` (or
    anything with `data`, `model` and optional `devices`); `devices`: an explicit device list (default: all)."""
    data, model = int(mesh_cfg.data), int(mesh_cfg.model)
    if data < 1 or model < 1:
        raise ShardingError(f"mesh: data and model must be >= 1, got data={data}, model={model}")
    initialize_distributed()
    devices = list(jax.devices()) if devices is None else list(devices)
    want = data * model
    declared = getattr(mesh_cfg, "devices", None)
    if declared is not None and declared != want:
        raise ShardingError(f"mesh.devices={declared} must equal mesh.data * mesh.model = {data} * {model} = {want}")
    if want > len(devices):
        platform = devices[0].platform if devices else "none"
        raise ShardingError(
            f"mesh: data={data} x model={model} needs {want} devices, but JAX sees {len(devices)} ({platform}). "
            f"Use a mesh with data * model <= {len(devices)}; on CPU simulate devices with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={want} set before JAX starts; across hosts start "
            "every process with jax.distributed (docs/SHARDING.md)")
    # Auto axes: jit propagates shardings from the inputs (the default Explicit axes would make every op's output
    # sharding part of its type, which the unchanged model code does not spell out).
    return jax.make_mesh((data, model), (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[:want])


def to_host(x) -> np.ndarray:
    """A (possibly sharded) array as one NumPy array on this host. With several processes an array split over
    devices of other hosts is gathered first (`np.asarray` refuses arrays that are not process-local)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def mesh_of(target) -> Mesh | None:
    """The mesh a target was placed on (None: a plain single-device target)."""
    return getattr(target, "mesh", None)


def is_multi_device(mesh_cfg) -> bool:
    return mesh_cfg.data * mesh_cfg.model > 1


# ----------------------------------------------------------------------------------------------------------
# The target: Megatron-style tensor parallelism over `model`
# ----------------------------------------------------------------------------------------------------------

# The trailing dims of each weight ([in, out], or [V, H] for the embedding) -> mesh axes. A leading stacked-layer
# axis, and every weight not listed (norms, q/k norms), is replicated. q/k/v columns are head-major, so a
# contiguous block of columns is a block of whole heads (and of whole GQA groups, since the KV heads split too).
TP_RULES: dict[str, tuple] = {
    "embed": (MODEL, None),  # vocab-parallel lookup (one all-reduce) and, when tied, vocab-parallel logits
    "lm_head": (None, MODEL),
    "wq": (None, MODEL), "wk": (None, MODEL), "wv": (None, MODEL),  # column-parallel: heads
    "bq": (MODEL,), "bk": (MODEL,), "bv": (MODEL,),
    "wo": (MODEL, None),  # row-parallel: partial sums, one all-reduce
    "w_gate": (None, MODEL), "w_up": (None, MODEL),  # column-parallel
    "w_down": (MODEL, None),  # row-parallel: one all-reduce
}


def check_model_axis(cfg: ModelConfig, model: int) -> None:
    """Tensor parallelism splits heads, KV heads, MLP columns and the vocabulary over `model`: all must divide."""
    if model == 1:
        return
    sizes = {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
             "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}
    bad = [f"{k}={v}" for k, v in sizes.items() if v % model]
    if bad:
        allowed = [m for m in range(1, cfg.num_kv_heads + 1) if all(v % m == 0 for v in sizes.values())]
        raise ShardingError(
            f"mesh.model={model} does not divide {', '.join(bad)} of model {cfg.name!r}: tensor parallelism splits "
            f"its {cfg.num_heads} attention heads, {cfg.num_kv_heads} KV heads, MLP width and vocabulary over the "
            f"model axis. Allowed mesh.model sizes for this model: {', '.join(map(str, allowed))}; put the other "
            "devices on mesh.data")


def _key_name(path) -> str:
    last = path[-1] if path else None
    return str(getattr(last, "key", getattr(last, "name", "")))


def _pad_spec(rule: tuple, ndim: int) -> P:
    """`rule` for the trailing dims, the leading ones replicated; no rule: fully replicated, P()."""
    return P(*([None] * (ndim - len(rule))), *rule) if rule else P()


def param_specs(params) -> Any:
    """PartitionSpecs for target weights in either layout (stacked dict or per-layer tuple)."""
    return jax.tree_util.tree_map_with_path(lambda path, a: _pad_spec(TP_RULES.get(_key_name(path), ()), a.ndim),
                                            params)


@functools.lru_cache(maxsize=1)
def _kv_head_offset() -> int:
    """Position of the KV-head axis counted from the end of a cache array, read off `transformer.init_cache` on a
    probe whose sizes are all distinct, so the cache layout ([B, S, KVH, HD] or [B, KVH, S, HD]) is never
    hard-coded here."""
    probe = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=3,
                        num_kv_heads=3, head_dim=2)
    shape = jax.eval_shape(lambda: transformer.init_cache(probe, batch_size=1, capacity=5)).k[0].shape
    return len(shape) - shape.index(probe.num_kv_heads)


def kv_head_axis(ndim: int) -> int:
    """The KV-head axis of a per-layer ([B, ...], ndim 4) or stacked ([L, B, ...], ndim 5) cache array."""
    return ndim - _kv_head_offset()


def _batch_axis_name(mesh: Mesh, batch: int) -> str | None:
    """Rows go over `data` when they divide evenly; otherwise (a ragged last batch) they are replicated over it."""
    return DATA if batch % mesh.shape[DATA] == 0 else None


def cache_specs(mesh: Mesh, cache: transformer.KVCache) -> transformer.KVCache:
    """KV cache: rows over `data`, KV heads over `model` (each device keeps the K/V of its own heads)."""
    rows = _batch_axis_name(mesh, cache.batch_size)

    def spec(a):
        axes = [None] * a.ndim
        axes[a.ndim - 4] = rows  # batch axis: ndim - 4 in every layout
        axes[kv_head_axis(a.ndim)] = MODEL
        return P(*axes)

    return transformer.KVCache(k=jax.tree.map(spec, cache.k), v=jax.tree.map(spec, cache.v), lengths=P(rows))


def named(mesh: Mesh, specs) -> Any:
    """PartitionSpecs -> NamedShardings on `mesh` (same tree)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


@functools.lru_cache(maxsize=32)
def _cache_maker(cfg: ModelConfig, batch: int, capacity: int, stacked: bool, mesh: Mesh):
    make = functools.partial(transformer.init_cache, cfg, batch, capacity, stacked)
    return jax.jit(make, out_shardings=named(mesh, cache_specs(mesh, jax.eval_shape(make))))


@dataclasses.dataclass
class ShardedTarget(Target):
    """A `Target` whose weights live on `mesh` and whose caches are created there, already sharded (each device
    allocates only its slice). The step function is the backend's own: jit partitions it from these shardings."""

    mesh: Mesh | None = None

    def init_cache(self, batch_size: int, capacity: int) -> transformer.KVCache:
        return _cache_maker(self.cfg, batch_size, capacity, self.backend.stacked, self.mesh)()


def shard_target(target: Target, mesh: Mesh) -> ShardedTarget:
    """Place `target`'s weights on `mesh` with the tensor-parallel layout (clear errors for what cannot split)."""
    if target.backend.name == "megakernel":
        raise ShardingError("model.backend: the megakernel backend is one chip's Pallas program and is not sharded; "
                            "use backend 'scan' or 'reference' with a multi-device mesh")
    check_model_axis(target.cfg, mesh.shape[MODEL])
    # back to separate [in, out] matrices: a contiguous block of the fused q|k|v rows is not a block of whole heads
    params = transformer.standard_layers(target.params)
    params = jax.device_put(params, named(mesh, param_specs(params)))
    return ShardedTarget(cfg=target.cfg, params=params, tokenizer=target.tokenizer, backend=target.backend, mesh=mesh)


# ----------------------------------------------------------------------------------------------------------
# Drafters, training states and batches
# ----------------------------------------------------------------------------------------------------------

def drafter_specs(mesh: Mesh, tree) -> Any:
    """Drafter weights, and anything shaped like them (optimiser moments, whole training states): each matrix's
    last dimension over `model` where it divides, everything else replicated. Drafters are small next to the
    target, so this simple rule is enough; with model=1 it is plain data parallelism (replicated weights)."""
    m = mesh.shape[MODEL]

    def spec(a):
        if m > 1 and np.ndim(a) >= 2 and a.shape[-1] % m == 0:
            return _pad_spec((MODEL,), np.ndim(a))
        return P()

    return jax.tree.map(spec, tree)


def place_drafter_state(tree, mesh: Mesh | None):
    """Put a drafter's weights or training state on `mesh` with `drafter_specs` (unchanged without a mesh).
    Arrays already on this mesh keep their sharding (self-speculation reuses the target's own weights)."""
    if mesh is None:
        return tree
    def place(a, s):
        if isinstance(a, jax.Array) and isinstance(a.sharding, NamedSharding) and a.sharding.mesh == mesh:
            return a
        return jax.device_put(a, NamedSharding(mesh, s))
    return jax.tree.map(place, tree, drafter_specs(mesh, tree))


def check_batch(batch_size: int, mesh: Mesh | None, what: str) -> None:
    if mesh is not None and batch_size % mesh.shape[DATA]:
        raise ShardingError(f"{what}={batch_size} is not divisible by mesh.data={mesh.shape[DATA]}: data "
                            f"parallelism gives every data shard the same number of rows")


def batch_specs(tree) -> Any:
    """Token batches (and anything batch-major: masks, lengths, features): the leading axis over `data`."""
    return jax.tree.map(lambda a: P(DATA, *([None] * (np.ndim(a) - 1))), tree)


def place_batch(batch, mesh: Mesh | None):
    """Put a batch on `mesh`, its rows split over `data` (unchanged without a mesh)."""
    if mesh is None:
        return batch
    leading = {np.shape(a)[0] for a in jax.tree.leaves(batch)}
    for b in leading:
        check_batch(b, mesh, "batch size")
    return jax.device_put(batch, named(mesh, batch_specs(batch)))

