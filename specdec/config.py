"""Typed experiment configuration: one schema, YAML files, `section.key=value` overrides, sweeps.

Every entry point (run, sweep, train, benchmarks) takes one `ExperimentConfig`, built from a YAML file:

    cfg = load_config("configs/quickstart.yaml", ["sampling.temperature=0.7", "drafter.num_draft_tokens=4"])

The schema is a tree of frozen dataclasses; `from_dict` checks a plain dict against it and fails loudly with a
`ConfigError` that names the full dotted key (the same spelling an override uses, list items by index:
`data.datasets.0.limit`) and what is allowed: the known keys (with a "did you mean"), the choices of a
`Literal`, the expected type, or the valid range. Nothing is coerced silently: `"4"` is not an int in a YAML
file; only override strings are parsed (as YAML scalars / flow lists), and a number given to a `str` field
from an override is kept as the text typed. `to_dict`/`to_yaml` round-trip exactly.

A config file may say `extends: other.yaml` (relative to itself): the other file is loaded first and this
file's mappings are merged over it key by key (lists and scalars replace). A sweep file (one with a
top-level `grid` or `runs`) is a `SweepConfig`; `expand_sweep` turns it into named `ExperimentConfig`s.

Sequence fields are tuples so that configs stay immutable; YAML lists are accepted for them.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import hashlib
import itertools
import json
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from specdec.adaptive import AdaptiveWidth
from specdec.errors import ConfigError, _join, require
from specdec.scheduler import FixedWidth
from specdec.scheduling import PrefixSchedule, ThresholdSchedule
from specdec.verify.registry import POLICY_NAMES, get_policy
from specdec.verify.typical import DEFAULT_DELTA, DEFAULT_EPSILON


_require = require  # value checks in `__post_init__`; `key` is relative to the section, `from_dict` adds the prefix


def _at_least(obj: Any, low: float, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(value is None or value >= low, name, f"must be >= {low}, got {value!r}")


# ---------------------------------------------------------------------------------------------------------
# The schema. Defaults make a near-empty YAML file valid.
# ---------------------------------------------------------------------------------------------------------

PolicyName = Literal[POLICY_NAMES]  # the registered verification policies (specdec/verify/registry.py)


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """`model:` the target model."""
    name: str = "smollm2-135m-instruct"  # registry name, .gguf path, HF dir, or "tiny" (random test model)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    backend: Literal["reference", "scan", "megakernel"] = "reference"
    max_seq_len: int = 2048  # KV-cache capacity: prompt + new tokens + draft slack
    seed: int = 0  # weight seed for random models

    def __post_init__(self):
        _require(bool(self.name), "name", "must not be empty")
        _at_least(self, 1, "max_seq_len")


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """`drafter:` which drafter proposes tokens; `name` and `params` are checked by the drafter registry."""
    name: str = "ngram"
    num_draft_tokens: int = 5  # chain length k, or the node budget of a tree
    params: dict[str, Any] = dataclasses.field(default_factory=dict)  # drafter-specific options
    path: str | None = None  # checkpoint of a trained drafter

    def __post_init__(self):
        _require(bool(self.name), "name", "must not be empty")
        _at_least(self, 1, "num_draft_tokens")


@dataclasses.dataclass(frozen=True)
class DynamicTreeConfig:
    """A tree grown per round from draft probabilities (EAGLE-2 style)."""
    depth: int = 4
    top_k: int = 4  # children expanded per node
    num_nodes: int = 16  # nodes kept for verification

    def __post_init__(self):
        _at_least(self, 1, "depth", "top_k", "num_nodes")


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """`verify.tree:` a static tree (Medusa-style paths of child indices: [0], [0, 0], [1], ...) or a dynamic one."""
    paths: tuple[tuple[int, ...], ...] | None = None
    dynamic: DynamicTreeConfig | None = None

    def __post_init__(self):
        _require((self.paths is None) != (self.dynamic is None), "", "set exactly one of 'paths' and 'dynamic'")
        if self.paths is not None:
            seen = set(self.paths)
            _require(len(seen) == len(self.paths) > 0, "paths", "must be a non-empty list of distinct paths")
            for i, p in enumerate(self.paths):
                _require(len(p) > 0 and min(p) >= 0, f"paths.{i}", f"must be a non-empty list of indices >= 0, got {list(p)}")
                _require(len(p) == 1 or p[:-1] in seen, f"paths.{i}", f"parent path {list(p[:-1])} of {list(p)} is missing")


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
    """`verify:` the acceptance rule. `tree` is used by the tree policies (chain policies ignore it)."""
    policy: PolicyName = "greedy_chain"
    tree: TreeConfig | None = None
    eps: float = DEFAULT_EPSILON  # typical acceptance: hard posterior threshold (Medusa's epsilon)
    delta: float = DEFAULT_DELTA  # typical acceptance: entropy-adaptive threshold scale
    # Verify widths (specdec/engine.py `bucket_widths`): a round whose rows all have few valid draft nodes (an
    # n-gram miss, a short schedule) runs a narrower target step. "none": always all N + 1 positions; "auto":
    # 1, 2, 4, ... tokens per row, then N + 1; or a list of draft-node counts in [0, N].
    buckets: Literal["none", "auto"] | tuple[int, ...] = "none"

    def __post_init__(self):
        _require(0 < self.eps <= 1, "eps", f"must be in (0, 1], got {self.eps!r}")
        _require(isinstance(self.buckets, str) or all(w >= 0 for w in self.buckets), "buckets",
                 f"draft-node counts must be >= 0, got {self.buckets!r}")
        _at_least(self, 0, "delta")


# `scheduler:` how many of each round's draft nodes the target verifies (specdec/scheduler.py). `kind` picks the
# scheduler and the section's other keys are that scheduler's own fields: fixed (every drafted token), adaptive
# (specdec/adaptive.py: the verify width that pays on this machine, or none; any drafter), threshold and prefix
# (specdec/scheduling.py: from the draft confidences of dflash / dspark).
SCHEDULERS = {cls.kind: cls for cls in (FixedWidth, AdaptiveWidth, ThresholdSchedule, PrefixSchedule)}
SchedulerConfig = Union[FixedWidth, AdaptiveWidth, ThresholdSchedule, PrefixSchedule]


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """`sampling:` as `specdec.sampling.SamplingParams`, plus the sampling seed. temperature 0 = greedy."""
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int = 0

    def __post_init__(self):
        _at_least(self, 0, "temperature", "top_k")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")

    def to_params(self):
        from specdec.sampling import SamplingParams  # lazy: keeps this module free of JAX
        return SamplingParams(self.temperature, self.top_k, self.top_p)


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    batch_size: int = 1
    compiled_loop: bool = True  # one lax.while_loop over rounds (False: host-stepped, for debugging)
    # `specdec data` only: decode rows refilled at a time by continuous batching (a host round trip per refill;
    # raise it with batch_size on an accelerator, where a trip costs many decode steps)
    insert_rows: int = 8

    def __post_init__(self):
        _at_least(self, 1, "max_new_tokens", "batch_size", "insert_rows")


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
    """One prompt source: a built-in prompt set, a `datasets` hub name, or a .jsonl/.json/.csv path."""
    name: str
    split: str | None = None  # None: the loader's default for that dataset
    field: str | None = None  # prompt field; None: known layouts (MT-Bench, GSM8K, ...) are detected
    limit: int | None = None  # first N prompts; None = all
    category: str | None = None  # label used to group results ("code", "math", ...)
    per_category: int | None = None  # first N prompts of each of the records' own categories (before limit)
    # Shuffle the records with this seed before `per_category` / `limit`: a random sample instead of the file's
    # first N (files sorted by source, like the training prompts, otherwise give N of one source). None: file order.
    sample_seed: int | None = None
    # Leave out the first N records of that order (before `limit` and any exclusion): with the same sample_seed,
    # a second data set of fresh prompts that repeats none of a first one's `limit: N`. MBPP's are counted within
    # its split; N at or past the last record is an error when the records are read (`records.sample_order`).
    skip: int = 0
    # MT-Bench-style records (`turns` lists): answer the first N turns, each asked after the target's own greedy
    # (plain AR) answers to the turns before it, as Spec-Bench runs MT-Bench; every turn is one prompt.
    turns: int = 1
    # Distillation data only (`specdec data`). A response field makes the examples teacher-forced: the record's
    # own answer ("auto": response / answer / output / completion / code, or the last assistant turn of
    # `messages`) is used instead of generating one.
    response_field: str | None = None
    exclude_ids: tuple[str, ...] = ()  # record ids to leave out; "11-510" is a range of integer ids
    # Keep only the records whose `source` field (the file's label where a record has none) is one of these,
    # e.g. the code and chat prompts of train_prompts.jsonl. Applied in the sample's order, after `skip`, so
    # `limit` counts the records kept.
    sources: tuple[str, ...] = ()
    decontaminate: tuple[str, ...] = ()  # evaluation files: drop prompts sharing a 13-word n-gram with them
    # `name: self` only (the target writes the prompts): the temperature it writes them at (top-p 1, no top-k),
    # so that a data set of greedy answers (sampling.temperature 0) can still have varied prompts.
    # None: the `sampling` section's. Their seed is `sample_seed` (None: sampling.seed); `skip: N` gives the
    # prompts after the first N of that seed, as for a file.
    prompt_temperature: float | None = None

    def __post_init__(self):
        _require(bool(self.name), "name", "must not be empty")
        _at_least(self, 1, "limit", "per_category", "turns")
        _at_least(self, 0, "skip")
        if self.name != "self":  # data.SELF_PROMPTS (this module stays free of JAX)
            _require(self.prompt_temperature is None, "prompt_temperature",
                     f"applies only to prompts the target writes (name: self), not to {self.name!r}")
        if self.prompt_temperature is not None:
            _require(self.prompt_temperature > 0, "prompt_temperature", "must be > 0 (greedy decoding writes the "
                     f"same prompt every time), got {self.prompt_temperature!r}")
        for item in self.sources:
            _require(bool(str(item).strip()), "sources", "entries must be non-empty source names")
        for item in self.exclude_ids:
            _require(_id_range(item) is not None, "exclude_ids",
                     f"{item!r} is neither an id nor a range 'low-high' of integer ids")

    def excluded_ids(self) -> set[str]:
        return set().union(*(_id_range(item) for item in self.exclude_ids))


def _id_range(item) -> set[str] | None:
    """The ids an `exclude_ids` entry names: "11-510" is the integer ids 11..510, anything else one id;
    None for an empty entry or a malformed range."""
    text = str(item)
    lo, dash, hi = text.partition("-")
    if not dash:
        return {text} if text else None
    if not (lo.isdigit() and hi.isdigit() and int(lo) <= int(hi)):
        return None
    return {str(i) for i in range(int(lo), int(hi) + 1)}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    datasets: tuple[DatasetConfig, ...] = (DatasetConfig("quickstart"),)
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template
    # `specdec data`: stop answering after the shard that ends past this many seconds (None: no limit); the
    # finished shards train like any others and rerunning the command goes on with the rest
    max_seconds: float | None = None

    def __post_init__(self):
        _require(len(self.datasets) > 0, "datasets", "must list at least one dataset")
        _require(self.max_seconds is None or self.max_seconds >= 0, "max_seconds",
                 f"must be >= 0 seconds or null, got {self.max_seconds!r}")


@dataclasses.dataclass(frozen=True)
class LosslessCheckConfig:
    samples: int = 4  # prompts checked against AR decoding each run (0 = off)

    def __post_init__(self):
        _at_least(self, 0, "samples")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    baseline: bool = True  # also run plain autoregressive decoding (speedups need it)
    lossless_check: LosslessCheckConfig = dataclasses.field(default_factory=LosslessCheckConfig)
    warmup: bool = True  # compile and run once before timing


@dataclasses.dataclass(frozen=True)
class TrackingConfig:
    backend: Literal["wandb", "memory", "none"] = "wandb"
    project: str = "specdec"
    group: str | None = None  # sweeps set this to the sweep name when it is unset
    tags: tuple[str, ...] = ()
    mode: Literal["offline", "online"] = "offline"
    dir: str | None = None  # None: inside the run's output directory


@dataclasses.dataclass(frozen=True)
class OutputConfig:
    dir: str = "runs"
    name: str | None = None  # None: the runner derives one; sweeps set it to the run name


@dataclasses.dataclass(frozen=True)
class MoreDataConfig:
    """One more distillation data set (`specdec data` output) pooled with `train.data_dir` in a training run."""
    data_dir: str
    skip_shards: int = 0  # leave out its first N finished shards (already trained on), as train.skip_shards

    def __post_init__(self):
        _at_least(self, 0, "skip_shards")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """`train:` drafter training (AdamW, warmup then cosine decay)."""
    steps: int = 2000
    batch_size: int = 16
    lr: float = 6e-4
    warmup_frac: float = 0.05
    weight_decay: float = 0.1
    clip_norm: float = 1.0  # global-norm clipping; 0 = off
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    eval_every: int = 250
    seq_len: int = 512
    data_dir: str | None = None  # distillation data: written by `specdec data`, read by `specdec train`
    # Leave out the first N finished shards of data_dir: a run that continues a drafter already trained on them
    # (init_from) then trains, and holds out its eval examples, on the new shards only.
    skip_shards: int = 0
    # More data sets trained on together with data_dir (examples pooled, shuffled together, held-out examples
    # drawn from the pool by id hash); each must come from the same target. E.g. new data plus the shards of an
    # older set that the drafter being continued never saw.
    more_data: tuple[MoreDataConfig, ...] = ()
    seed: int = 0  # parameter init, data order and training rng
    drafter_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # architecture/loss options of the drafter's trainer
    eval_examples: int = 64  # held-out examples (by id hash) for eval loss and teacher-forced expected tau
    # More evaluation sets, each evaluated like the held-out examples at every evaluation and reported under its
    # directory's name: other `specdec data` outputs of the same target, e.g. its answers to the benchmark prompts
    # (is the drafter limited by its data's distance from them, or by what it can learn?). Online features.
    eval_data: tuple[str, ...] = ()
    # Also evaluate on the first N training examples (a "train" set beside the held-out one): with
    # `limit_examples` the overfit check (a drafter that cannot fit a few hundred answers has a bug).
    eval_train_examples: int = 0
    # Train on only the first N training examples (after the held-out split; null: all): the data-size axis of
    # a study, with everything else equal.
    limit_examples: int | None = None
    log_every: int = 10
    features: Literal["online", "cached"] = "online"  # target taps computed in the step, or cached on disk
    features_dir: str | None = None  # feature cache location; None: under data_dir/features/
    features_dtype: Literal["float16", "float32"] = "float16"
    shard_size: int = 64  # `specdec data`: prompts per stored shard (the unit of resumption)
    # A trained drafter (run directory or export) of the same kind and architecture whose parameters and buffers
    # start this run instead of a fresh init: continued training / fine-tuning on new data. A run that already
    # has checkpoints resumes from them instead.
    init_from: str | None = None
    # Batches of similar lengths, each padded only to the smallest of these lengths that holds its longest example
    # (seq_len is always the last bucket): the target's forward then runs on ~90% real tokens instead of padding.
    # Empty: every batch is padded to seq_len. Each length is one more compiled train step.
    length_buckets: tuple[int, ...] = ()
    # Wall-clock budget of the loop in this call (None: none): at the first step past it the run ends as at its
    # last step (saved, evaluated, calibrated; status "time_limit"), and rerunning continues towards `steps`.
    # The learning-rate schedule still spans `steps`, so size `steps` to the budget where you can.
    max_seconds: float | None = None

    def __post_init__(self):
        _require(self.max_seconds is None or self.max_seconds >= 0, "max_seconds",
                 f"must be >= 0 seconds or null, got {self.max_seconds!r}")
        _at_least(self, 1, "steps", "batch_size", "checkpoint_every", "keep_checkpoints", "eval_every", "seq_len",
                  "log_every", "shard_size")
        _require(all(0 < b < self.seq_len for b in self.length_buckets)
                 and list(self.length_buckets) == sorted(set(self.length_buckets)), "length_buckets",
                 f"must be increasing lengths below seq_len={self.seq_len}, got {list(self.length_buckets)}")
        _at_least(self, 0, "eval_examples", "skip_shards", "eval_train_examples")
        _require(self.limit_examples is None or self.limit_examples >= 1, "limit_examples",
                 f"must be >= 1 or null, got {self.limit_examples!r}")
        _at_least(self, 0, "weight_decay", "clip_norm")
        _require(self.lr > 0, "lr", f"must be > 0, got {self.lr!r}")
        _require(0 <= self.warmup_frac < 1, "warmup_frac", f"must be in [0, 1), got {self.warmup_frac!r}")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    model: int = 1
    devices: int | None = None  # how many devices to use; None = data * model

    def __post_init__(self):
        _at_least(self, 1, "data", "model")
        _require(self.devices is None or self.devices == self.data * self.model, "devices",
                 f"must equal data * model = {self.data * self.model}, got {self.devices!r}")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """Everything one run needs. Not hashable (dict fields); pass sections or their values to jitted code."""
    description: str = ""
    model: TargetConfig = dataclasses.field(default_factory=TargetConfig)
    drafter: DrafterConfig = dataclasses.field(default_factory=DrafterConfig)
    verify: VerifyConfig = dataclasses.field(default_factory=VerifyConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=FixedWidth)
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    tracking: TrackingConfig = dataclasses.field(default_factory=TrackingConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    def __post_init__(self):
        _require(not get_policy(self.verify.policy).greedy_only or self.sampling.temperature == 0, "verify.policy",
                 f"{self.verify.policy!r} is exact only at sampling.temperature 0 (got {self.sampling.temperature}); "
                 "use rejection_chain / multidraft_tree / invariant_chain / invariant_tree / typical for sampling")


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """A sweep file: `base` config (path relative to the sweep file, or inline mapping, which may `extends`),
    a `grid` of dotted key -> values (cartesian product) and/or explicit `runs` (dicts of dotted key -> value,
    optionally with a `name`); with both, every run is crossed with every grid point."""
    name: str = "sweep"
    base: str | dict[str, Any] = dataclasses.field(default_factory=dict)
    grid: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    runs: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        _require(bool(_SAFE_NAME.fullmatch(self.name)), "name", f"must match {_SAFE_NAME.pattern}, got {self.name!r}")
        for key, values in self.grid.items():
            _require(len(values) > 0, f"grid.{key}", "must list at least one value")


# ---------------------------------------------------------------------------------------------------------
# Dict <-> dataclass, with errors that name the key.
# ---------------------------------------------------------------------------------------------------------

@functools.cache
def _fields(cls: type) -> dict[str, Any]:
    """Field name -> resolved type annotation (annotations are strings under `from __future__`)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _unknown(key: Any, allowed: Iterable[str]) -> str:
    allowed = list(allowed)
    close = difflib.get_close_matches(str(key), allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown key; {hint}allowed keys: {', '.join(allowed)}"


def _type_name(tp: Any) -> str:
    if tp in (int, float, str, bool):
        return tp.__name__
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return str(tp).replace("typing.", "").replace("NoneType", "None")


def _describe(value: Any) -> str:
    text = repr(value)
    return "null" if value is None else f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _tags(tp: Any) -> dict[str, type] | None:
    """A tagged union (the `scheduler` section): a Union of dataclasses that each have a class-level `kind`,
    which the mapping's `kind` key picks (default: the first option's). None for any other type."""
    if not _is_union(tp):
        return None
    options = [a for a in typing.get_args(tp) if a is not type(None)]
    if not all(dataclasses.is_dataclass(a) and isinstance(getattr(a, "kind", None), str) for a in options):
        return None
    return {a.kind: a for a in options}


def _from_tagged(tags: dict[str, type], data: Any, path: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"expected a mapping, got {_describe(data)}", path)
    kind = data.get("kind", next(iter(tags)))
    if kind not in tags:
        raise ConfigError(f"must be one of {', '.join(map(repr, tags))}; got {kind!r}", _join(path, "kind"))
    fields = _fields(tags[kind])
    for key in data:
        if key != "kind" and key not in fields:
            raise ConfigError(f"not a setting of scheduler kind {kind!r}: " + _unknown(key, ["kind", *fields]),
                              _join(path, str(key)))
    return from_dict(tags[kind], {k: v for k, v in data.items() if k != "kind"}, path)


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from a plain mapping, validating keys, types, choices and values recursively."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"expected a mapping, got {_describe(data)}", path)
    fields = _fields(cls)
    for key in data:
        if key not in fields:
            raise ConfigError(_unknown(key, fields), _join(path, str(key)))
    kwargs = {key: _convert(value, fields[key], _join(path, key)) for key, value in data.items()}
    for f in dataclasses.fields(cls):
        if f.init and f.name not in kwargs and f.default is f.default_factory is dataclasses.MISSING:
            raise ConfigError("required key is missing", _join(path, f.name))
    try:
        return cls(**kwargs)
    except ConfigError as e:  # a __post_init__ check: make its key absolute
        raise e.under(path) from None


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if _tags(tp):
        return _from_tagged(_tags(tp), value, path)
    if _is_union(tp):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _convert(value, options[0], path)
        for option in options:
            try:
                return _convert(value, option, path)
            except ConfigError:
                pass
        raise ConfigError(f"expected {_type_name(tp)}, got {_describe(value)}", path)
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise ConfigError(f"must be one of {', '.join(map(repr, args))}; got {value!r}", path)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if tp in (bool, int, float, str):
        ok = isinstance(value, bool) if tp is bool else (
            isinstance(value, (int, float) if tp is float else tp) and not isinstance(value, bool))
        if not ok:
            raise ConfigError(f"expected {tp.__name__}, got {_describe(value)}", path)
        return float(value) if tp is float else value
    if tp in (list, tuple) or origin in (list, tuple):  # list[X] and tuple[X, ...]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"expected a list ({_type_name(tp)}), got {_describe(value)}", path)
        items = [_convert(v, args[0] if args else Any, f"{path}.{i}") for i, v in enumerate(value)]
        return tuple(items) if (origin or tp) is tuple else items
    if tp is dict or origin is dict:  # dict[str, X]
        if not isinstance(value, Mapping):
            raise ConfigError(f"expected a mapping ({_type_name(tp)}), got {_describe(value)}", path)
        for k in value:
            _require(isinstance(k, str), path, f"keys must be strings, got {k!r}")
        return {k: _convert(v, args[1] if args else Any, _join(path, k)) for k, v in value.items()}
    raise TypeError(f"unsupported type {tp!r} in the config schema at {path!r}")


def to_dict(obj: Any) -> Any:
    """Plain dicts/lists/scalars (tuples become lists); `from_dict(type(c), to_dict(c)) == c`."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if isinstance(getattr(type(obj), "kind", None), str):  # a tagged union's option: its kind, non-defaults
            default = type(obj)()
            return {"kind": obj.kind, **{f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                                         if getattr(obj, f.name) != getattr(default, f.name)}}
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def to_yaml(obj: Any) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False, default_flow_style=False)


# ---------------------------------------------------------------------------------------------------------
# Files, `extends`, and overrides.
# ---------------------------------------------------------------------------------------------------------

class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of silently keeping the last one."""


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    keys = [k.value for k, _ in node.value if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge"]
    for i, key in enumerate(keys):
        if key in keys[:i]:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", node.start_mark)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)
# PyYAML follows YAML 1.1, where `1e-3` (no dot) is a string; read it as the float everyone means (YAML 1.2).
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _merge(base: dict, over: Mapping) -> dict:
    """`over` on top of `base`: mappings merge key by key, everything else replaces."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
        out[key] = _merge(out[key], value) if both else value
    return out


def _read(source: str | Path | Mapping, base_dir: Path | None = None, chain: tuple[Path, ...] = ()) -> dict:
    """A raw config mapping from a YAML file or an inline mapping, with `extends` resolved."""
    if isinstance(source, Mapping):
        data, here = copy.deepcopy(dict(source)), base_dir or Path.cwd()
    else:
        path = (base_dir or Path.cwd()) / Path(source)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        resolved = path.resolve()
        if resolved in chain:
            raise ConfigError("circular extends: " + " -> ".join(str(p) for p in (*chain, resolved)))
        try:
            data = yaml.load(path.read_text(), Loader=_StrictLoader)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from None
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level, got {_describe(data)}")
        here, chain = resolved.parent, (*chain, resolved)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    _require(isinstance(parent, str), "extends", f"must be a path relative to this file, got {_describe(parent)}")
    return _merge(_read(parent, here, chain), data)


def read_yaml(path: str | Path) -> dict:
    """The top-level mapping of a YAML file, read as every config file is (duplicate keys refused, `1e-3` a
    float, `extends` resolved; a missing file or bad YAML is a ConfigError naming the file), for the file
    formats that are not an ExperimentConfig: recipes and device studies (experiments/recipe.py)."""
    return _read(path)


def is_sweep(data: Any) -> bool:
    """A sweep file is recognised by a top-level `grid` or `runs` key."""
    return isinstance(data, Mapping) and ("grid" in data or "runs" in data)


def key_type(dotted: str, cls: type | None = None) -> Any:
    """The schema type at a dotted key ("drafter.params.n", "data.datasets.0.limit"); unknown keys raise."""
    tp, walked = cls or ExperimentConfig, ""
    for part in dotted.split("."):
        where = _join(walked, part)
        if _tags(tp):  # a tagged union: the key of whichever option has it
            options = {**{"kind": Literal[tuple(_tags(tp))]},
                       **{k: v for cls in reversed(_tags(tp).values()) for k, v in _fields(cls).items()}}
            if part not in options:
                raise ConfigError(_unknown(part, options), where)
            tp, walked = options[part], where
            continue
        if _is_union(tp):  # Optional[X] -> X
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        origin = typing.get_origin(tp)
        if dataclasses.is_dataclass(tp):
            if part not in _fields(tp):
                raise ConfigError(_unknown(part, _fields(tp)), where)
            tp = _fields(tp)[part]
        elif tp in (list, tuple) or origin in (list, tuple):
            _require(part.isdigit(), where, f"{walked} is a list; expected an index, got {part!r}")
            tp = (typing.get_args(tp) or (Any,))[0]
        elif tp is dict or origin is dict:
            tp = (typing.get_args(tp) or (str, Any))[1]
        elif tp is not Any:
            raise ConfigError(f"{walked} is a {_type_name(tp)} and has no key {part!r}", where)
        walked = where
    return tp


_KEY = re.compile(r"[A-Za-z_][\w-]*(\.[\w-]+)*")
_SAFE_NAME = re.compile(r"[A-Za-z0-9._=+-]+")


def parse_override(text: str) -> tuple[str, Any]:
    """`"section.key=value"` -> (key, value): the value parsed as YAML; text kept for str-typed keys."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not _KEY.fullmatch(key):
        raise ConfigError(f"bad override {text!r}: expected section.key=value")
    tp = key_type(key)
    try:
        value = yaml.load(raw, Loader=_StrictLoader) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse override value {raw!r}: {e}", key) from None
    takes_str = tp is str or (_is_union(tp) and str in typing.get_args(tp))
    if takes_str and isinstance(value, (bool, int, float)):
        value = raw.strip()  # output.name=123 means the string "123"
    return key, value


def _set(data: dict, key: str, value: Any) -> None:
    """Set a dotted key in a plain nested dict (as made by to_dict), creating unset optional sections."""
    *parents, last = key.split(".")
    node = data
    for depth, part in enumerate([*parents, last]):
        where = ".".join([*parents, last][:depth + 1])
        if isinstance(node, list):
            _require(part.isdigit() and int(part) < len(node), where, f"index out of range (list has {len(node)} items)")
            part = int(part)
        elif not isinstance(node, dict):
            raise ConfigError(f"cannot set a key inside {_describe(node)}", where)
        if depth == len(parents):
            node[part] = value
        else:
            if isinstance(node, dict) and node.get(part) is None:
                node[part] = {}
            node = node[part]


def apply_overrides(cfg: ExperimentConfig, overrides: Iterable[str] | Mapping[str, Any]) -> ExperimentConfig:
    """A new config with `section.key=value` strings (or a {dotted key: value} mapping) applied in order."""
    if isinstance(overrides, str):  # a single "key=value", not an iterable of characters
        overrides = [overrides]
    items = overrides.items() if isinstance(overrides, Mapping) else [parse_override(o) for o in overrides]
    if not items:
        return cfg
    data = to_dict(cfg)
    for key, value in items:
        key_type(key)  # unknown keys fail here, with a suggestion
        _set(data, key, value)
    return from_dict(ExperimentConfig, data)


def load_config(source: str | Path | Mapping | ExperimentConfig, overrides: Iterable[str] = ()) -> ExperimentConfig:
    """An ExperimentConfig from a YAML path (or mapping, or config), with `extends` and overrides applied."""
    if isinstance(source, ExperimentConfig):
        return apply_overrides(source, overrides)
    data = _read(source)
    if is_sweep(data):
        raise ConfigError(f"{source} is a sweep file (it has 'grid' or 'runs'); load it with load_sweep")
    try:
        cfg = from_dict(ExperimentConfig, data)
    except ConfigError as e:
        where = "" if isinstance(source, Mapping) else f" (in {source})"
        raise ConfigError(e.reason + where, e.key) from None
    return apply_overrides(cfg, overrides)


# ---------------------------------------------------------------------------------------------------------
# Sweeps.
# ---------------------------------------------------------------------------------------------------------

def load_sweep(source: str | Path | Mapping) -> SweepConfig:
    """A SweepConfig; a `base` path (or inline `base.extends`) is made absolute relative to the sweep file,
    and `name` defaults to the file's stem."""
    data = _read(source)
    here = Path.cwd() if isinstance(source, Mapping) else Path(source).resolve().parent
    if not isinstance(source, Mapping):
        data.setdefault("name", Path(source).stem)
    base = data.get("base")
    if isinstance(base, str):
        data["base"] = str(here / base)
    elif isinstance(base, dict) and isinstance(base.get("extends"), str):
        data["base"] = {**base, "extends": str(here / base["extends"])}
    return from_dict(SweepConfig, data)


def _format_value(value: Any) -> str:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    return json.dumps(value, separators=(",", ":"), sort_keys=True)  # true, null, [2,4], {"a":1}


def _digest(overrides: Mapping) -> str:
    return hashlib.sha1(json.dumps(overrides, sort_keys=True, default=str).encode()).hexdigest()


def sweep_overrides(sweep: SweepConfig) -> list[tuple[str, dict[str, Any]]]:
    """(run name, {dotted key: value}) for every run, in a stable order; every key is checked first."""
    run_keys = [k for run in sweep.runs for k in run if k != "name"]
    keys = list(dict.fromkeys([*sweep.grid, *run_keys]))
    for key in keys:
        try:
            key_type(key)
        except ConfigError as e:
            raise ConfigError(f"{e.reason} (sweep {sweep.name!r})", e.key) from None
    points = [dict(zip(sweep.grid, values)) for values in itertools.product(*sweep.grid.values())]
    plan = []
    for i, run in enumerate(sweep.runs or [{}]):
        clash = sorted(set(run) & set(sweep.grid))
        _require(not clash, f"runs.{i}", f"keys {clash} are also in grid; set each key in one place")
        fixed = {k: v for k, v in run.items() if k != "name"}
        for point in points:
            overrides = {**fixed, **point}
            plan.append((run.get("name"), overrides, point if "name" in run else overrides))
    # A key is labelled by its last part ("num_draft_tokens") unless two swept keys share that last part.
    last = [k.rsplit(".", 1)[-1] for k in keys]
    label = {k: (l if last.count(l) == 1 else k) for k, l in zip(keys, last)}
    names = []
    for given, overrides, shown in plan:
        parts = ([str(given)] if given is not None else []) + [f"{label[k]}={_format_value(v)}" for k, v in shown.items()]
        name = re.sub(r"[^A-Za-z0-9._=+-]+", "-", "__".join(parts) or "base")
        if len(name) > 120:
            name = f"{name[:100]}-{_digest(overrides)[:8]}"
        names.append(name)
    # Distinct runs whose names collide (e.g. list values that sanitise alike) get a hash suffix.
    for name in {n for n in names if names.count(n) > 1}:
        idx = [i for i, n in enumerate(names) if n == name]
        digests = [_digest(plan[i][1]) for i in idx]
        _require(len(set(digests)) == len(digests), "runs", f"two runs of sweep {sweep.name!r} are identical ({name})")
        for i, d in zip(idx, digests):
            names[i] = f"{name}-{d[:6]}"
    return [(name, overrides) for name, (_, overrides, _) in zip(names, plan)]


def expand_sweep(sweep: SweepConfig | str | Path | Mapping, overrides: Iterable[str] = ()) -> list[tuple[str, ExperimentConfig]]:
    """(run name, config) for every run. Each config is base + run overrides, with `output.name` set to the run
    name (unless the run sets it) and `tracking.group` to the sweep name (unless set), then `overrides`
    (e.g. from the command line) on top."""
    if not isinstance(sweep, SweepConfig):
        sweep = load_sweep(sweep)
    base = load_config(sweep.base)
    overrides = [parse_override(o) for o in overrides]  # fail early on bad command-line overrides
    out = []
    for name, run_overrides in sweep_overrides(sweep):
        try:
            cfg = apply_overrides(base, run_overrides)
        except ConfigError as e:
            raise ConfigError(f"{e.reason} (sweep {sweep.name!r}, run {name!r})", e.key) from None
        defaults = {"output.name": name} if "output.name" not in run_overrides else {}
        if cfg.tracking.group is None:
            defaults["tracking.group"] = sweep.name
        out.append((name, apply_overrides(apply_overrides(cfg, defaults), dict(overrides))))
    return out
