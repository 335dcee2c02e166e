"""One training loop for every drafter.

    summary = train(task, target, data, cfg.train, run_dir, tracker=tracker, eval_draft_len=5)

- optax AdamW (weight decay on matrices only) under linear warmup + cosine decay, global-norm clipping;
- the target's features for each batch computed online inside the jitted step (or read from a disk cache);
- orbax checkpoints every `checkpoint_every` steps (and at the end / on Ctrl-C or SIGTERM), the newest
  `keep_checkpoints` kept; a run whose directory holds checkpoints resumes exactly: the same step, parameters,
  optimiser state, data position (epoch, cursor of a seeded per-epoch permutation) and rng key, so a
  killed-and-resumed run ends with bitwise the parameters of an uninterrupted one (tests/test_train.py checks it);
- evaluation on held-out examples at the start, every `eval_every` steps and at the end: the loss and the
  teacher-forced expected tau (`specdec.train.tasks`);
- a NaN/inf guard: a step whose loss or gradient norm is not finite is not applied, and training stops with
  `TrainingDiverged` (the checkpoints on disk are all from finite steps);
- tracking through an injected `specdec.tracking.Tracker` (e.g. `experiments.tracking.make_tracker`'s W&B
  run), plus metrics.jsonl and summary.json in the run directory.

Whether a run directory that already holds a run may be resumed with a changed config is the caller's rule
(`specdec train` refuses one whose config differs outside a list of resumable keys, `experiments/cli.py`): this
loop resumes from whatever checkpoints `run_dir` holds.

The phases of `train()`, each a function below: the examples and their batches (`Examples`, `Batches`), the
features (`open_features`), the state (`initial_state`, then `resume` from a checkpoint), and the loop
(`_loop`: a jitted `train_step` per batch, with log / checkpoint / eval every N steps), evaluation and saving
through the `Run` they share.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specdec import sharding
from specdec.tracking import Tracker
from specdec.train import checkpoint as ckpt_lib
from specdec.train.data import DataError, DistillData, load_distill_data
from specdec.train.features import (FeatureCache, build_feature_cache, cached_features, data_fingerprint,
                                    find_feature_cache, online_features, open_feature_cache,
                                    stored_taps)
from specdec.train.tasks import TrainTask, expected_tau_sums, slot_valid, tree_size


class TrainingDiverged(RuntimeError):
    """The loss or the gradient became NaN/inf; the message names the step and the last good checkpoint."""


@dataclasses.dataclass(frozen=True)
class Hyper:
    steps: int
    lr: float
    warmup_steps: int
    weight_decay: float
    clip_norm: float

    @classmethod
    def from_config(cls, cfg) -> "Hyper":
        return cls(cfg.steps, cfg.lr, int(round(cfg.warmup_frac * cfg.steps)), cfg.weight_decay, cfg.clip_norm)


def learning_rate(h: Hyper):
    if h.warmup_steps >= h.steps:
        return optax.linear_schedule(0.0, h.lr, h.steps)
    return optax.warmup_cosine_decay_schedule(0.0, h.lr, h.warmup_steps, h.steps, end_value=0.0)


def make_optimizer(h: Hyper) -> optax.GradientTransformation:
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # no decay on norms / biases
    parts = [optax.clip_by_global_norm(h.clip_norm)] if h.clip_norm > 0 else []
    parts.append(optax.adamw(learning_rate(h), b1=0.9, b2=0.95, weight_decay=h.weight_decay, mask=decay_mask))
    return optax.chain(*parts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """What a train step changes and a checkpoint holds (with the data position, kept in the checkpoint's meta)."""

    params: Any  # the trainable pytree
    buffers: Any  # saved non-trainable arrays (a d2t map, DSpark's calibrated temperatures)
    opt_state: Any
    step: jax.Array  # int32 []: updates applied (a non-finite step is not applied and not counted)
    key: jax.Array  # the training rng, split once per step

    @classmethod
    def create(cls, params, buffers, hyper: Hyper, seed: int) -> "TrainState":
        """The state before step 1, in buffers of its own: the step donates the state, and a task's init may
        return arrays of the target's (which must survive)."""
        state = cls(params=params, buffers=buffers, opt_state=make_optimizer(hyper).init(params),
                    step=jnp.int32(0), key=jax.random.PRNGKey(seed + 1))
        return jax.tree.map(jnp.array, state)

    # Checkpoints hold the state as a dict of these five names (the layout of every saved run, which
    # `checkpoint.load_drafter` reads without this class), so the dataclass is converted at the orbax boundary.
    def to_checkpoint(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_checkpoint(cls, tree: dict) -> "TrainState":
        return cls(**{f.name: tree[f.name] for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Static settings of the compiled train/eval steps (hashable, so equal runs share one compilation)."""

    task: Any
    hyper: Hyper
    cfg: Any  # target ModelConfig
    forward: Callable
    stored: tuple[int, ...] | None  # layers in the feature cache; None = online features
    eval_steps: int


def _features(spec: StepSpec, tparams, batch, logits: bool):
    if spec.stored is None:
        return online_features(tparams, spec.cfg, spec.forward, batch["tokens"], spec.task.taps, logits)
    return cached_features(tparams, spec.cfg, batch["feats"], spec.task.taps, spec.stored, logits)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def train_step(spec: StepSpec, state: TrainState, consts, tparams, batch: dict):
    key, sub = jax.random.split(state.key)
    feats = _features(spec, tparams, batch, spec.task.needs_target_logits)
    grad_fn = jax.value_and_grad(spec.task.loss, has_aux=True)
    (loss, metrics), grads = grad_fn(state.params, consts, batch, feats, sub)
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    tx = make_optimizer(spec.hyper)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    new_state = dataclasses.replace(state, params=keep(params, state.params),
                                    opt_state=keep(opt_state, state.opt_state),
                                    step=state.step + ok.astype(jnp.int32), key=key)
    metrics = {**metrics, "loss": loss, "grad_norm": grad_norm, "finite": ok,
               "lr": learning_rate(spec.hyper)(state.step)}
    return new_state, metrics


@functools.partial(jax.jit, static_argnames=("spec",))
def eval_step(spec: StepSpec, params, consts, tparams, batch: dict):
    feats = _features(spec, tparams, batch, True)
    loss, ev = spec.task.evaluate(params, consts, batch, feats, spec.eval_steps)
    sums = expected_tau_sums(ev, slot_valid(batch, spec.eval_steps))
    return {**sums, "loss": loss}


# ---------------------------------------------------------------------------------------------------------
# Examples and batches
# ---------------------------------------------------------------------------------------------------------

class BatchOrder:
    """Indices of each batch: a seeded permutation per epoch, consumed in order (wrapping into the next epoch).
    Its position (epoch, cursor) is part of every checkpoint.

    With `lengths` (example lengths, indexed like the data), each window of GROUP_BATCHES batches of the
    permutation is sorted by length and its batches are shuffled again, so a batch holds examples of similar
    lengths (padded to its own bucket) while the epoch still visits every example once in a random order."""

    GROUP_BATCHES = 32

    def __init__(self, indices: np.ndarray, batch_size: int, seed: int, epoch: int = 0, cursor: int = 0,
                 lengths: np.ndarray | None = None):
        if len(indices) == 0:
            raise ValueError("no training examples")
        self.indices, self.batch_size, self.seed = np.asarray(indices), batch_size, seed
        self.epoch, self.cursor = epoch, cursor
        self.lengths = lengths
        self._cached: tuple[int, np.ndarray] | None = None

    def _perm(self, epoch: int) -> np.ndarray:
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        rng = np.random.default_rng([self.seed, epoch])
        perm = self.indices[rng.permutation(len(self.indices))]
        if self.lengths is not None:
            window = self.GROUP_BATCHES * self.batch_size
            parts = []
            for start in range(0, len(perm), window):
                group = perm[start:start + window]
                group = group[np.argsort(self.lengths[group], kind="stable")]
                batches = [group[i:i + self.batch_size] for i in range(0, len(group), self.batch_size)]
                parts += [batches[i] for i in rng.permutation(len(batches))]
            perm = np.concatenate(parts)
        self._cached = (epoch, perm)
        return perm

    def next(self) -> np.ndarray:
        out = []
        while len(out) < self.batch_size:
            perm = self._perm(self.epoch)
            take = perm[self.cursor: self.cursor + self.batch_size - len(out)]
            out.extend(take.tolist())
            self.cursor += len(take)
            if self.cursor >= len(perm):
                self.epoch, self.cursor = self.epoch + 1, 0
        return np.asarray(out)

    def position(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}


@dataclasses.dataclass(frozen=True)
class Examples:
    """The data as fixed-shape arrays (`DistillData.padded`), split into training and held-out indices."""

    arrays: dict[str, np.ndarray]  # tokens, loss_mask, lengths
    train_idx: np.ndarray
    eval_idx: np.ndarray  # sorted by length when batches are length-grouped (the eval sums do not depend on it)
    lengths: np.ndarray | None  # example lengths when batches are length-grouped (train.length_buckets), else None

    @classmethod
    def split(cls, data: DistillData, cfg, pad_id: int) -> "Examples":
        arrays = data.padded(cfg.seq_len, pad_id)
        train_idx, eval_idx = data.split_indices(cfg.eval_examples)
        if cfg.limit_examples is not None:
            if cfg.limit_examples > len(train_idx):
                raise DataError(f"train.limit_examples={cfg.limit_examples} is more than the "
                                f"{len(train_idx)} training examples the data holds")
            train_idx = train_idx[:cfg.limit_examples]
        lengths = arrays["lengths"] if cfg.length_buckets else None
        return cls(arrays, train_idx, by_length(eval_idx, lengths), lengths)


def by_length(idx: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
    """Evaluation rows in batches of similar lengths (when batches are length-grouped); the eval sums do not
    depend on the order."""
    return idx if lengths is None else idx[np.argsort(lengths[idx], kind="stable")]


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """Examples evaluated beside the held-out ones (`train.eval_data`, `train.eval_train_examples`)."""

    name: str
    batches: "Batches"
    idx: np.ndarray
    spec: "StepSpec"  # online features for a set outside the feature cache


class Batches:
    """Device batches of example rows, each padded to the smallest length bucket that holds its longest row."""

    def __init__(self, arrays: dict, buckets: tuple[int, ...], cache: FeatureCache | None, mesh):
        self.arrays, self.buckets, self.cache, self.mesh = arrays, buckets, cache, mesh

    def __call__(self, rows: np.ndarray, real: int | None = None) -> dict:
        arrays = self.arrays
        width = next(b for b in self.buckets if b >= arrays["lengths"][rows].max())  # this batch's padded length
        batch = {"tokens": arrays["tokens"][rows, :width], "loss_mask": arrays["loss_mask"][rows, :width].copy(),
                 "lengths": arrays["lengths"][rows].copy()}
        if real is not None:  # rows past `real` only pad the last eval batch: no valid labels
            batch["loss_mask"][real:] = 0
            batch["lengths"][real:] = 0
        if self.cache is not None:
            batch["feats"] = self.cache.batch(rows, batch["lengths"], width)
        if self.mesh is not None:  # data parallelism: rows split over the mesh's data axis
            return sharding.place_batch(batch, self.mesh)
        return {k: jnp.asarray(v) for k, v in batch.items()}

    def heldout(self, eval_idx: np.ndarray, batch_size: int) -> Iterator[dict]:
        """The held-out examples in full batches (the last one filled with copies of its last row, masked out)."""
        for start in range(0, len(eval_idx), batch_size):
            rows = eval_idx[start: start + batch_size]
            yield self(np.concatenate([rows, np.repeat(rows[-1:], batch_size - len(rows))]), len(rows))


def open_features(task: TrainTask, target, cfg, run: Path, examples: Examples, progress: bool,
                  log: Callable[[str], None]) -> tuple[tuple[int, ...] | None, FeatureCache | None]:
    """(stored layers, cache) of `train.features: cached` (built on first use, shared by runs over the same
    data); (None, None) for online features, computed in the step."""
    if cfg.features != "cached":
        return None, None
    logits = True  # eval needs logits, so the cache always keeps the last layer
    stored = stored_taps(task.taps, target.cfg.num_layers, logits)
    arrays, seq_len = examples.arrays, cfg.seq_len
    root = Path(cfg.data_dir or run) / "features"
    fdir = Path(cfg.features_dir) if cfg.features_dir else (
        root / f"taps{'-'.join(map(str, stored))}_len{seq_len}_{cfg.features_dtype}")
    same = {"target": target.cfg.name, "seq_len": seq_len,
            "data": data_fingerprint(arrays["tokens"], arrays["lengths"]), "dtype": cfg.features_dtype}
    cache = open_feature_cache(fdir, same, needed=stored)
    if cache is None and not cfg.features_dir:
        # any finished cache of the same data that holds these layers (e.g. the block drafters' six taps for an
        # EAGLE-3 run on three of them): one target pass serves every drafter trained on the data
        cache = find_feature_cache(root, same, stored)
        if cache is not None:
            log(f"reusing the feature cache {cache.path} (layers {cache.stored} hold this run's {stored})")
    if cache is None:
        log(f"caching target features ({len(stored)} taps: {stored}) in {fdir}")
        cache = build_feature_cache(target, arrays, task.taps, logits, fdir, dtype=cfg.features_dtype,
                                    batch_size=cfg.batch_size, progress=progress)
    log(f"feature cache: {cache.bytes_per_token} bytes/token, {cache.meta['num_tokens']} tokens, "
        f"{cache.bytes_per_token * cache.meta['num_tokens'] / 1e6:.1f} MB ({cache.path})")
    return cache.stored, cache


# ---------------------------------------------------------------------------------------------------------
# The state: a fresh init (or a trained drafter's weights), or a checkpoint to resume
# ---------------------------------------------------------------------------------------------------------

def initial_weights(path: str, task: TrainTask, target, params, buffers) -> tuple[Any, Any]:
    """The params and buffers of the trained drafter at `path`, checked against a fresh init of this task (same
    drafter, target, architecture config and array shapes), in the fresh init's dtypes. The task's
    `training_keys` (loss weights, anchors per sequence, ...) may differ; a buffer the source lacks (e.g. a d2t
    map of a draft vocabulary it did not use) comes from the fresh init. A source with fewer layers is grown
    (`TrainTask.grow`) where the drafter supports it (the block drafters). An inference-format drafter with cut
    tensors (`checkpoint.export_inference`) is refused, naming them."""
    info = ckpt_lib.load_drafter(path, expect_name=task.name)
    if info["draft_vocab_cut"]:  # an inference-format drafter: training would start from tensors it lacks
        vd = len(info["buffers"]["d2t"])
        lacks = ", ".join(f"params/{name} (all but the draft vocabulary's {vd} of its {cut['full']} entries on "
                          f"axis {cut['axis']})" for name, cut in info["draft_vocab_cut"].items())
        raise ckpt_lib.CheckpointError(f"train.init_from {path} is an inference-format drafter (`specdec export "
                                       f"--format inference`): it lacks the training tensors {lacks}; continue "
                                       "from the training run or full-format drafter directory it was exported "
                                       "from")
    ckpt_lib.check_target(info, target, f"train.init_from {path}")
    mine = task.config()
    theirs = info["config"]
    free = set(task.training_keys)
    differ = sorted(k for k in set(mine) | set(theirs) if k not in free and mine.get(k) != theirs.get(k))
    source_params = info["params"]
    if differ == ["num_layers"] and int(theirs["num_layers"]) < int(mine["num_layers"]):
        grown = task.grow(source_params, theirs)  # deeper than its source: None if the drafter cannot grow
        if grown is not None:
            source_params, differ = grown, []
    if differ:
        there = ", ".join(f"{k}={theirs.get(k)!r}" for k in differ)
        raise ckpt_lib.CheckpointError(f"train.init_from {path}: its drafter config differs from this run's in "
                                       f"{', '.join(differ)} ({there} there)")

    def same_shapes(fresh, loaded, what):
        flat_fresh, flat_loaded = ckpt_lib.flatten(fresh), ckpt_lib.flatten(loaded)
        bad = sorted(k for k in set(flat_fresh) | set(flat_loaded)
                     if k not in flat_fresh or k not in flat_loaded
                     or np.shape(flat_fresh[k]) != np.shape(flat_loaded[k]))
        if bad:
            raise ckpt_lib.CheckpointError(f"train.init_from {path}: {what} do not match this drafter's "
                                           f"({', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''})")
        return jax.tree.map(lambda f, x: jnp.asarray(x, dtype=jnp.asarray(f).dtype), fresh,
                            ckpt_lib.unflatten(flat_loaded) if flat_loaded else fresh)

    their_buffers = info["buffers"] or {}
    shared = {k: v for k, v in buffers.items() if k in their_buffers}  # the rest keep their fresh values
    loaded = same_shapes(shared, {k: their_buffers[k] for k in shared}, "buffers")
    return same_shapes(params, source_params, "parameters"), {**buffers, **loaded}


def initial_state(task: TrainTask, target, data: DistillData, examples: Examples, cfg, hyper: Hyper, mesh,
                  fresh_run: bool, log: Callable[[str], None]) -> TrainState:
    """The state before step 1: the task's init (from the training examples' token counts), or with
    `train.init_from` on a fresh run the weights of that trained drafter. On a sharded target's mesh it is
    placed there, so a restore onto it gets this mesh's shardings whatever mesh the checkpoint was saved from."""
    counts = data.subset(examples.train_idx).token_counts(target.cfg.vocab_size)
    params, buffers = task.init(jax.random.PRNGKey(cfg.seed), counts)
    if cfg.init_from and fresh_run:  # a resumed run continues from its own checkpoints
        params, buffers = initial_weights(cfg.init_from, task, target, params, buffers)
        log(f"initialised from {cfg.init_from}")
    return sharding.place_drafter_state(TrainState.create(params, buffers, hyper, cfg.seed), mesh)


def resume(store: ckpt_lib.CheckpointStore, step: int, like: TrainState, examples: Examples,
           cfg) -> tuple[TrainState, BatchOrder]:
    """The state and data position saved at `step`, restored onto `like`'s shapes, dtypes and shardings."""
    tree, meta = store.restore(step, like=like.to_checkpoint())
    state = TrainState.from_checkpoint(jax.tree.map(jnp.asarray, tree))
    order = BatchOrder(examples.train_idx, cfg.batch_size, cfg.seed, meta["epoch"], meta["cursor"],
                       lengths=examples.lengths)
    if int(state.step) != step or meta.get("train_examples") != len(examples.train_idx):
        raise ckpt_lib.CheckpointError(f"checkpoint {step} in {store.dir} does not match this data "
                                       f"(step {int(state.step)}, {meta.get('train_examples')} training "
                                       f"examples there, {len(examples.train_idx)} here)")
    return state, order


# ---------------------------------------------------------------------------------------------------------
# The run: evaluation, checkpoints, metrics, and the loop
# ---------------------------------------------------------------------------------------------------------

def _host(x) -> Any:
    x = np.asarray(x)
    return x.item() if x.ndim == 0 else x.tolist()


class MetricsLog:
    """metrics.jsonl in the run directory, and the tracker's metrics."""

    def __init__(self, path: Path, tracker: Tracker | None):
        # multi-host: one writer of the shared run directory (every process computes the same metrics)
        self.file = path.open("a") if jax.process_index() == 0 else open(os.devnull, "w")
        self.tracker = tracker

    def emit(self, kind: str, step: int, values: dict) -> None:
        self.file.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")
        self.file.flush()
        if self.tracker is not None:
            self.tracker.log_metrics({f"{kind}/{k}": v for k, v in values.items()
                                      if not isinstance(v, (list, str))}, step=step)

    def close(self) -> None:
        self.file.close()


@dataclasses.dataclass(frozen=True)
class Run:
    """What the phases of one `train()` share, everything but the state."""

    task: TrainTask
    target: Any
    cfg: Any  # TrainConfig
    spec: StepSpec
    consts: dict  # {**task.frozen(target), **buffers}: the loss's non-trainable inputs
    examples: Examples
    batches: Batches
    order: BatchOrder  # the data position: advanced by the loop, saved in every checkpoint
    store: ckpt_lib.CheckpointStore
    metrics: MetricsLog
    log: Callable[[str], None]
    history: list = dataclasses.field(default_factory=list)  # every evaluation, for the summary

    eval_sets: tuple[EvalSet, ...] = ()

    def _evaluate(self, params, spec: StepSpec, batches: "Batches", idx: np.ndarray) -> dict:
        sums: dict[str, Any] = {}
        n_batches = 0
        for batch in batches.heldout(idx, self.cfg.batch_size):
            out = jax.device_get(eval_step(spec, params, self.consts, self.target.params, batch))
            n_batches += 1
            for k, v in out.items():
                sums[k] = sums.get(k, 0) + np.asarray(v, np.float64)
        slots = max(float(sums["slots"]), 1.0)
        return {"loss": float(sums["loss"]) / n_batches, "expected_tau": float(sums["tau"]) / slots,
                "greedy_tau": float(sums["greedy_tau"]) / slots,
                "acceptance_by_step": [round(float(a) / slots, 4) for a in sums["alpha"]],
                "greedy_acceptance_by_step": [round(float(a) / slots, 4) for a in sums["match"]],
                "slots": int(sums["slots"]), "draft_len": spec.eval_steps}

    def evaluate(self, state: TrainState, step: int) -> dict | None:
        """The held-out loss, expected / greedy tau and acceptance by draft step (None without held-out data),
        and the same for each further evaluation set under "sets" (also logged as eval/<set>)."""
        if len(self.examples.eval_idx) == 0 and not self.eval_sets:
            return None
        result = {}
        if len(self.examples.eval_idx):
            result = self._evaluate(state.params, self.spec, self.batches, self.examples.eval_idx)
            self.metrics.emit("eval", step, result)
        if self.eval_sets:
            result["sets"] = {}
            for s in self.eval_sets:
                result["sets"][s.name] = self._evaluate(state.params, s.spec, s.batches, s.idx)
                self.metrics.emit(f"eval/{s.name}", step, result["sets"][s.name])
        self.history.append({"step": step, **result})
        return result

    def save(self, state: TrainState, step: int) -> None:
        meta = {"step": step, **self.order.position(), "train_examples": len(self.examples.train_idx),
                "seed": self.cfg.seed}
        self.store.save(step, state.to_checkpoint(), meta)

    def calibrate(self, state: TrainState) -> TrainState:
        """The state with the buffers `task.calibrate` fits on the held-out examples after training (DSpark's
        confidence temperatures); unchanged for a task that fits nothing or without held-out data."""
        if len(self.examples.eval_idx) == 0:
            return state
        feats_fn = jax.jit(_features, static_argnums=(0, 3))
        pairs = ((batch, feats_fn(self.spec, self.target.params, batch, True))
                 for batch in self.batches.heldout(self.examples.eval_idx, self.cfg.batch_size))
        fitted = self.task.calibrate(state.params, self.consts, pairs)  # draws on `pairs` only if it fits
        if fitted is None:
            return state
        self.log(f"calibrated {self.task.name} on {len(self.examples.eval_idx)} held-out examples")
        return dataclasses.replace(state, buffers={**state.buffers, **fitted})  # the other buffers (d2t) stay


def eval_sets(cfg, spec: StepSpec, examples: Examples, batches: Batches, mesh, target,
              manifest: dict) -> tuple[EvalSet, ...]:
    """`train.eval_train_examples` (the first training examples, as the run's own batches) and each
    `train.eval_data` directory (all its examples, online features), checked to come from the run's target."""
    out = []
    if cfg.eval_train_examples:
        idx = examples.train_idx[:cfg.eval_train_examples]
        out.append(EvalSet("train", batches, by_length(idx, examples.lengths), spec))
    pad = target.cfg.pad_token_id if target.cfg.pad_token_id is not None else 0
    for path in cfg.eval_data:
        data = load_distill_data(path)
        for key in ("target", "vocab_size"):
            if data.manifest.get(key) != manifest.get(key):
                raise DataError(f"train.eval_data: {path} comes from another target than the training data (its "
                                f"{key} is {data.manifest.get(key)!r}, not {manifest.get(key)!r})")
        arrays = data.padded(cfg.seq_len, pad)
        lengths = arrays["lengths"] if cfg.length_buckets else None
        set_batches = Batches(arrays, batches.buckets, None, mesh)
        out.append(EvalSet(Path(path).name, set_batches, by_length(np.arange(len(data)), lengths),
                           dataclasses.replace(spec, stored=None)))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise DataError(f"train.eval_data: two evaluation sets share a name ({', '.join(names)}); their "
                        "directories' names must differ")
    return tuple(out)


@dataclasses.dataclass
class LoopEnd:
    state: TrainState
    step: int
    status: str  # "complete", "time_limit" (train.max_seconds), "stopped" (the caller's `stop_at`) or
    # "interrupted" (Ctrl-C or SIGTERM): the step reached is saved
    tokens_seen: int  # real (unpadded) tokens trained on in this call


def _catch_sigterm(flag: list) -> Callable[[], None]:
    """Record SIGTERM in `flag` instead of dying; returns the function that puts the old handler back. Signal
    handlers can only be set from the main thread: elsewhere SIGTERM keeps its default."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: flag.append(signum))
    return lambda: signal.signal(signal.SIGTERM, previous)


def _loop(run: Run, state: TrainState, last_saved: int | None, terminated: list, progress: bool,
          hook: Callable[[int, dict], None] | None, stop_at: int | None = None) -> LoopEnd:
    """Train steps up to `train.steps`, or up to `stop_at` (status "stopped"). After each: the train metrics
    averaged over the last `log_every` steps, a checkpoint every `checkpoint_every` steps and an evaluation every
    `eval_every` steps (the last step is always logged and saved; its evaluation is the caller's final one), then
    `hook`. A non-finite step raises `TrainingDiverged`; Ctrl-C, or SIGTERM recorded in `terminated`, stops
    after the running step and saves it; so does `train.max_seconds` (status "time_limit")."""
    from tqdm.auto import tqdm

    cfg = run.cfg
    end_step = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    step = int(state.step)
    tokens_seen = 0
    window: list[dict] = []
    t_loop = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train {run.task.name}", disable=not progress, dynamic_ncols=True)
    try:
        while step < end_step:
            batch = run.batches(run.order.next())
            state, m = train_step(run.spec, state, run.consts, run.target.params, batch)
            m = jax.device_get(m)
            if not bool(m["finite"]):
                where = (f"the last good checkpoint is step {last_saved} in {run.store.dir}" if last_saved is not None
                         else "no checkpoint was saved yet")
                msg = (f"non-finite loss/gradient at step {step + 1} (loss={float(m['loss'])}, "
                       f"grad_norm={float(m['grad_norm'])}); training stopped and that update was not applied; "
                       f"{where}. Lower train.lr, raise train.warmup_frac or check the data.")
                run.metrics.emit("error", step + 1, {"message": msg})
                raise TrainingDiverged(msg)
            step += 1
            tokens_seen += int(sharding.to_host(batch["lengths"]).sum())  # rows may live on other hosts
            window.append({k: _host(v) for k, v in m.items() if k != "finite"})
            bar.update(1)
            if step % cfg.log_every == 0 or step == end_step:
                avg = {k: float(np.mean([w[k] for w in window])) for k in window[0]
                       if not isinstance(window[0][k], list)}
                avg["tokens_per_second"] = tokens_seen / max(time.perf_counter() - t_loop, 1e-9)
                run.metrics.emit("train", step, avg)
                bar.set_postfix(loss=f"{avg['loss']:.3f}", refresh=False)
                window = []
            if step % cfg.checkpoint_every == 0 or step == end_step:
                run.save(state, step)
                last_saved = step
            if step % cfg.eval_every == 0 and step != cfg.steps:
                run.evaluate(state, step)
            if hook is not None:
                hook(step, m)
            if cfg.max_seconds is not None and step < cfg.steps and time.perf_counter() - t_loop >= cfg.max_seconds:
                if last_saved != step:
                    run.save(state, step)
                run.log(f"\ntime limit: train.max_seconds={cfg.max_seconds} reached at step {step} of {cfg.steps}; "
                        "rerun the same command to go on")
                return LoopEnd(state, step, "time_limit", tokens_seen)
            if terminated:
                run.log(f"\nSIGTERM received at step {step}")
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        if last_saved != step:
            run.save(state, step)
        run.log(f"\ninterrupted at step {step}: checkpoint saved in {run.store.dir}; run the same command again "
                "to resume")
        return LoopEnd(state, step, "interrupted", tokens_seen)
    finally:
        bar.close()
    return LoopEnd(state, step, "complete" if step >= cfg.steps else "stopped", tokens_seen)


def train(task: TrainTask, target, data: DistillData, cfg, run_dir: str | Path, *, tracker: Tracker | None = None,
          progress: bool = True, eval_draft_len: int = 5, hook: Callable[[int, dict], None] | None = None,
          log: Callable[[str], None] = print, stop_at: int | None = None) -> dict:
    """Train `task` on `data` with the settings of `cfg` (a `specdec.config.TrainConfig`) into `run_dir`.

    Resumes from `run_dir/checkpoints` when it holds any. `hook(step, metrics)` runs after every step (tests
    use it to interrupt a run). `stop_at`: end the run at that step although its learning-rate schedule spans
    `train.steps` (status "stopped"), as a run stopped there by a signal ends: saved and exported, neither
    evaluated at the end nor calibrated; a later call with a larger `stop_at` (or none) goes on from it.
    Returns the summary (also written to run_dir/summary.json)."""
    t_start = time.perf_counter()
    run_path = Path(run_dir)
    run_path.mkdir(parents=True, exist_ok=True)
    mesh = sharding.mesh_of(target)  # None: one device
    sharding.check_batch(cfg.batch_size, mesh, "train.batch_size")
    examples = Examples.split(data, cfg, target.cfg.pad_token_id if target.cfg.pad_token_id is not None else 0)
    stored, cache = open_features(task, target, cfg, run_path, examples, progress, log)
    batches = Batches(examples.arrays, tuple(cfg.length_buckets) + (cfg.seq_len,), cache, mesh)
    hyper = Hyper.from_config(cfg)
    spec = StepSpec(task=task, hyper=hyper, cfg=target.cfg, forward=target.forward, stored=stored,
                    eval_steps=min(eval_draft_len, task.max_eval_steps or eval_draft_len))

    store = ckpt_lib.CheckpointStore(run_path / ckpt_lib.CHECKPOINTS, keep=cfg.keep_checkpoints)
    resumed_from = store.latest_step()
    if stop_at is not None and resumed_from is not None and resumed_from > stop_at:
        store.close()
        raise ValueError(f"{run_path} is already at step {resumed_from}, past the step to stop at ({stop_at})")
    state = initial_state(task, target, data, examples, cfg, hyper, mesh, resumed_from is None, log)
    order = BatchOrder(examples.train_idx, cfg.batch_size, cfg.seed, lengths=examples.lengths)
    ckpt_lib.write_drafter_config(run_path, task.name, task.config(), ckpt_lib.target_info(target))
    if resumed_from is not None:
        state, order = resume(store, resumed_from, state, examples, cfg)
        log(f"resuming {run_path} from step {resumed_from} (epoch {order.epoch}, example {order.cursor})")
    # copies: the state (which holds the buffers too) is donated to the step, consts are not
    consts = {**task.frozen(target), **jax.tree.map(jnp.array, state.buffers)}
    run = Run(task, target, cfg, spec, consts, examples, batches, order, store,
              MetricsLog(run_path / "metrics.jsonl", tracker), log,
              eval_sets=eval_sets(cfg, spec, examples, batches, mesh, target, data.manifest))

    step = int(state.step)
    log(f"training {task.name}: {tree_size(state.params):,} trainable parameters, {len(examples.train_idx)} train "
        f"/ {len(examples.eval_idx)} held-out examples, batch {cfg.batch_size} x {cfg.seq_len} tokens, steps "
        f"{step}->{cfg.steps}{f' (stopping at {stop_at})' if stop_at is not None else ''}, features {cfg.features}")
    t_loop = time.perf_counter()
    first_eval = final_eval = None
    # Preemption (SIGTERM, e.g. a spot VM or a cluster scheduler) stops like Ctrl-C: the running step finishes,
    # a checkpoint is saved and rerunning resumes. The flag is checked between steps so a signal never lands
    # between the state update and the step count.
    terminated: list[int] = []
    restore_sigterm = _catch_sigterm(terminated)
    try:
        first_eval = run.evaluate(state, step) if step == 0 else None
        t_loop = time.perf_counter()
        end = _loop(run, state, resumed_from, terminated, progress, hook, stop_at)
        state = end.state
        if end.status in ("complete", "time_limit"):  # a time limit ends the call like its last step
            final_eval = run.evaluate(state, end.step)
            state = run.calibrate(state)
        export = ckpt_lib.export_params(run_path, state.params, state.buffers, end.step)
    finally:
        restore_sigterm()
        run.metrics.close()
        store.close()
    elapsed = time.perf_counter() - t_loop
    summary = {
        "status": end.status, "drafter": task.name, "run_dir": str(run_path), "export": str(export),
        "steps": end.step, "resumed_from": resumed_from, "trainable_parameters": tree_size(state.params),
        "train_examples": len(examples.train_idx), "eval_examples": len(examples.eval_idx),
        "data_dirs": data.manifest.get("pooled_from"), "data_sources": data.source_counts(),
        "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "features": cfg.features,
        "seconds": round(time.perf_counter() - t_start, 1),
        "train_tokens_per_second": round(end.tokens_seen / elapsed, 1) if elapsed > 0 and end.tokens_seen else None,
        "first_eval": first_eval, "final_eval": final_eval,
        "bytes_per_token_cached": cache.bytes_per_token if cache is not None else None,
        "eval_history": run.history,
    }
    (run_path / "summary.json").write_text(json.dumps(summary, indent=2))
    if tracker is not None:
        tracker.log_summary({k: v for k, v in summary.items() if k != "eval_history"})
    if end.status == "interrupted":
        raise KeyboardInterrupt
    return summary
