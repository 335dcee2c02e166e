"""Checkpoints: orbax training states (for exact resume) and the exported drafter (for decoding).

Training run directory (`<output.dir>/<output.name>/`):
    config.yaml            the full experiment config of the run
    drafter.json           {"drafter": name, "config": the drafter's settings, "target": what it was trained on}
    params.npz             exported weights: "params/..." (trained) and "buffers/..." (saved non-trainable arrays)
    checkpoints/<step>/    orbax: {"state": params, buffers, optimiser state, step, rng; "meta": data position}
    metrics.jsonl, summary.json

`load_drafter(path)` accepts such a run directory (params.npz if the run exported, else the latest orbax
checkpoint: an unfinished run is usable too), any directory holding drafter.json + params.npz, or an EAGLE-3 /
DFlash / DSpark drafter in the vLLM / SGLang layout (`load_export`; `specdec export` writes them, specdec/export).
Missing or unreadable checkpoints raise `CheckpointError` with the path and what was found there.

A drafter directory comes in two formats (drafter.json's "format"; absent: "full"):
    full        every tensor training saved (what `train.init_from` continues from)
    inference   only what decoding reads (`export_inference`, `specdec export --format inference`): the tensors
                whose target-vocabulary axis decoding reads at the draft vocabulary's ids only (DSpark's Markov W2)
                cut to those entries in d2t order ("draft_vocab_cut"), weight matrices float16, and a list of
                every tensor with its shape and dtype ("tensors") that loading checks. What ships in git.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

DRAFTER_FILE = "drafter.json"
PARAMS_FILE = "params.npz"
CHECKPOINTS = "checkpoints"
FULL, INFERENCE = "full", "inference"  # drafter.json "format"
COPIED_FILES = ("config.yaml", "summary.json", "README.md")  # what describes a drafter, copied beside its weights
EXPORT_CONFIG = "config.json"  # an exported drafter directory (specdec/export) has this instead of drafter.json
EXPORT_META = "specdec_export.json"  # and this, when specdec wrote it: what a re-import needs (format, step, ...)


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, empty or unreadable."""


# ---------------------------------------------------------------------------------------------------------
# Orbax training checkpoints
# ---------------------------------------------------------------------------------------------------------

class CheckpointStore:
    """Training states under `directory`, one orbax step directory each, keeping the newest `keep`."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3, create: bool = True):
        import orbax.checkpoint as ocp

        self.dir = Path(directory).absolute()
        if not create and not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        if self.dir.exists() and not self.dir.is_dir():
            raise CheckpointError(f"checkpoint path {self.dir} is a file, not a directory")
        self._ocp = ocp
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create, enable_async_checkpointing=False)
        self.mgr = ocp.CheckpointManager(self.dir, options=options)

    def steps(self) -> list[int]:
        return sorted(self.mgr.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, meta: dict) -> None:
        ocp = self._ocp
        self.mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                      force=True)
        self.mgr.wait_until_finished()

    def restore(self, step: int | None = None, like: Any = None) -> tuple[Any, dict]:
        """(state, meta) at `step` (default: the latest). `like`: a pytree with the expected structure, shapes
        and dtypes (restores exactly those; without it the saved tree comes back as saved)."""
        ocp = self._ocp
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoints in {self.dir}")
        abstract = None if like is None else jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        try:
            out = self.mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 meta=ocp.args.JsonRestore()))
        except Exception as e:  # orbax raises many types for truncated / mismatched / foreign directories
            others = [s for s in self.steps() if s != step]
            raise CheckpointError(
                f"checkpoint step {step} in {self.dir} cannot be restored ({type(e).__name__}: {str(e)[:300]})"
                + (f"; other steps there: {others} (delete the broken step directory to resume from them)"
                   if others else "")) from None
        return out["state"], dict(out["meta"])

    def close(self) -> None:
        self.mgr.close()


# ---------------------------------------------------------------------------------------------------------
# Exported drafter: drafter.json + params.npz
# ---------------------------------------------------------------------------------------------------------

def flatten(tree: Any, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            if "/" in str(k):
                raise ValueError(f"parameter name {k!r} contains '/'")
            out.update(flatten(v, f"{prefix}/{k}" if prefix else str(k)))
    elif tree is None:
        pass
    else:
        out[prefix] = np.asarray(tree)
    return out


def unflatten(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for key, value in flat.items():
        node = tree
        *parents, last = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return tree


def write_drafter_config(run_dir: str | os.PathLike, name: str, config: dict, target_info: dict) -> None:
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / DRAFTER_FILE).write_text(json.dumps({"drafter": name, "config": config, "target": target_info},
                                                indent=2))


def export_params(run_dir: str | os.PathLike, params: Any, buffers: Any, step: int) -> Path:
    """Write params.npz atomically (a killed export never leaves a half file)."""
    from specdec.sharding import to_host

    path = Path(run_dir) / PARAMS_FILE
    # to_host gathers arrays sharded over other hosts' devices (a collective: every process runs it)
    flat = {f"params/{k}": v for k, v in flatten(jax.tree.map(to_host, params)).items()}
    flat.update({f"buffers/{k}": v for k, v in flatten(jax.tree.map(to_host, buffers)).items()})
    flat["step"] = np.asarray(step)
    if jax.process_index() == 0:  # multi-host: one writer of the shared run directory
        tmp = path.with_name("params.partial.npz")
        np.savez(tmp, **flat)
        os.replace(tmp, path)
    return path


def float16_matrices(params: Any) -> Any:
    """Weight matrices (ndim >= 2) as float16; vectors (norm scales, biases) and scalars as they are. The drafters
    widen them once at load (`DFlashDrafter.from_trained`)."""
    return jax.tree.map(lambda x: np.asarray(x, np.float16) if np.ndim(x) >= 2 else x, params)


# ---------------------------------------------------------------------------------------------------------
# The inference format: only what decoding reads
# ---------------------------------------------------------------------------------------------------------

# Per drafter kind, the trained tensors with a target-vocabulary axis of which decoding reads only the draft
# vocabulary's entries (the d2t buffer's target ids): {name inside params, e.g. "markov/w2": that axis}. The
# drafter modules register theirs (specdec never imports drafters/); only registered kinds have an inference
# format, so the tensors of a kind whose decoding inputs are not declared are never cut blindly.
_DRAFT_VOCAB_AXES: dict[str, dict[str, int]] = {}


def register_draft_vocab_axes(kind: str, axes: dict[str, int]) -> None:
    _DRAFT_VOCAB_AXES[kind] = dict(axes)


def draft_vocab_axes(kind: str) -> dict[str, int]:
    if kind not in _DRAFT_VOCAB_AXES:
        known = ", ".join(sorted(_DRAFT_VOCAB_AXES)) or "(none: import drafters first)"
        raise CheckpointError(f"no inference format for {kind!r} drafters (the kinds that declare what their "
                              f"decoding reads: {known}); ship such a drafter in the full format")
    return _DRAFT_VOCAB_AXES[kind]


def _leaf(tree: dict, name: str):
    """The leaf of nested dicts at a flattened name ("markov/w2")."""
    for key in name.split("/"):
        if not isinstance(tree, dict) or key not in tree:
            raise CheckpointError(f"the drafter has no tensor params/{name}")
        tree = tree[key]
    return tree


def _with_leaf(tree: dict, name: str, value) -> dict:
    head, _, rest = name.partition("/")
    return {**tree, head: _with_leaf(tree[head], rest, value) if rest else value}


def _along(axis: int, index) -> tuple:
    return (slice(None),) * axis + (index,)


def slice_draft_vocab(params: dict, d2t, axes: dict[str, int]) -> dict:
    """`params` with each tensor of `axes` ({name: axis}) cut to the draft vocabulary's entries along its axis, in
    d2t order (draft id i <-> target id d2t[i], the drafters' own map): what decoding reads of it. NumPy or JAX."""
    for name, axis in axes.items():
        params = _with_leaf(params, name, _leaf(params, name)[_along(axis, d2t)])
    return params


def widen_draft_vocab(info: dict, vocab_size: int) -> dict:
    """The params of a `load_drafter` dict with its cut tensors (an inference-format drafter) scattered back to
    the full vocabulary, zero at the entries decoding never reads: for a writer that indexes them by target id
    (the vLLM / SGLang export)."""
    params, d2t = info["params"], np.asarray(info["buffers"].get("d2t"))
    for name, cut in info["draft_vocab_cut"].items():
        x = np.asarray(_leaf(params, name))
        wide = np.zeros(x.shape[:cut["axis"]] + (vocab_size,) + x.shape[cut["axis"] + 1:], x.dtype)
        wide[_along(cut["axis"], d2t)] = x
        params = _with_leaf(params, name, wide)
    return params


def tensor_list(params: Any, buffers: Any) -> dict[str, dict]:
    """{params.npz name: {"shape", "dtype"}} of what `export_params` writes for these trees."""
    flat = {f"params/{k}": v for k, v in flatten(params).items()}
    flat.update({f"buffers/{k}": v for k, v in flatten(buffers).items()})
    return {k: {"shape": list(np.shape(v)), "dtype": str(np.asarray(v).dtype)} for k, v in flat.items()}


def make_export_dir(out: Path, overwrite: bool) -> None:
    """Create the directory an export writes into; a file there, or a directory that holds files without
    `overwrite`, is refused (FileExistsError)."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; the export writes a directory")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass --overwrite or choose another directory")
    out.mkdir(parents=True, exist_ok=True)


def export_inference(source: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write the drafter of `source` (a training run or a drafter directory: `load_drafter`) into `out` in the
    inference format (module docstring): only the tensors decoding reads, weight matrices float16; a run's
    checkpoints (optimiser state) are never copied. Its config.yaml, summary.json and README.md are copied
    beside it. `load_drafter` reads the result; `train.init_from` refuses it when tensors were cut."""
    src, out = Path(os.path.expanduser(str(source))), Path(os.path.expanduser(str(out)))
    info = load_drafter(src)
    kind, d2t = info["drafter"], info["buffers"].get("d2t")
    axes = draft_vocab_axes(kind)  # raises for a kind that does not declare what its decoding reads
    done = info["draft_vocab_cut"]  # an inference-format source: cut already
    todo = {} if d2t is None else {n: a for n, a in axes.items() if n not in done}
    cut = {**done, **{n: {"axis": a, "full": int(np.shape(_leaf(info["params"], n))[a])} for n, a in todo.items()}}
    params = float16_matrices(slice_draft_vocab(info["params"], np.asarray(d2t), todo))
    if out.exists() and out.resolve() == src.resolve():
        raise FileExistsError(f"{out} is the source directory; write the inference format into another one")
    make_export_dir(out, overwrite)
    export_params(out, params, info["buffers"], info["step"])
    meta = {"drafter": kind, "config": info["config"], "target": info["target"], "format": INFERENCE,
            "draft_vocab_cut": cut, "tensors": tensor_list(params, info["buffers"]),
            "exported_from": {"path": str(src), "weights": info["source"], "step": info["step"]}}
    (out / DRAFTER_FILE).write_text(json.dumps(meta, indent=2))
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
        elif (out / name).is_file():  # the overwritten drafter's: it would describe that one, not these weights
            (out / name).unlink()
    return out


def check_inference_tensors(where: Path, meta: dict, flat: dict[str, np.ndarray]) -> None:
    """An inference-format params.npz holds exactly the tensors its drafter.json lists, at their shapes and
    dtypes, and each cut tensor is as wide as d2t on its cut axis."""
    try:
        want = {str(k): (list(v["shape"]), str(v["dtype"])) for k, v in meta["tensors"].items()}
        cut = {str(k): int(v["axis"]) for k, v in meta.get("draft_vocab_cut", {}).items()}
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise CheckpointError(f"{where / DRAFTER_FILE} is corrupt: an inference-format drafter lists its tensors "
                              f"and its cut ones ({type(e).__name__}: {e})") from None
    have = {k: (list(v.shape), str(v.dtype)) for k, v in flat.items() if k != "step"}
    problems = []
    missing = sorted(set(want) - set(have))
    if missing:
        problems.append("missing " + ", ".join(missing))
    wrong = sorted(k for k in set(want) & set(have) if want[k] != have[k])
    problems += [f"{k} is {have[k][1]} {have[k][0]}, drafter.json says {want[k][1]} {want[k][0]}" for k in wrong]
    extra = sorted(set(have) - set(want))
    if extra:
        problems.append("not listed in drafter.json: " + ", ".join(extra))
    d2t = have.get("buffers/d2t", ([], ""))[0]
    for name, axis in cut.items():
        shape = have.get(f"params/{name}", ([], ""))[0]
        if len(d2t) != 1 or len(shape) <= axis or shape[axis] != d2t[0]:
            problems.append(f"params/{name} {shape} is listed as cut to the draft vocabulary on axis {axis}, "
                            f"which does not match buffers/d2t {d2t or '(absent)'}")
    if problems:
        raise CheckpointError(f"{where / PARAMS_FILE} is not the inference-format drafter {where / DRAFTER_FILE} "
                              "describes: " + "; ".join(problems))


def load_drafter(path: str | os.PathLike, expect_name: str | None = None, step: int | None = None) -> dict:
    """{"drafter", "config", "target", "params", "buffers", "step", "source", "format", "draft_vocab_cut"} of a
    trained drafter: its params.npz if it has one, else its newest checkpoint; `step`: that checkpoint (then also
    "examples_seen"). A run that was interrupted and resumed has a params.npz from the interruption and newer
    checkpoints since: then the newest checkpoint, not the stale weights. "format": "full" or "inference"
    (module docstring); "draft_vocab_cut": {name inside params: {"axis", "full"}} of the tensors an
    inference-format file holds at the draft vocabulary's entries only (empty for the full format)."""
    p = Path(os.path.expanduser(str(path)))
    if not p.exists():
        raise CheckpointError(f"drafter checkpoint {p} does not exist")
    if step is not None and not (p / CHECKPOINTS).is_dir():
        raise CheckpointError(f"{p} has no {CHECKPOINTS}/ to read step {step} from")
    if not (p / DRAFTER_FILE).is_file() and (p / EXPORT_CONFIG).is_file():
        return load_export(p, expect_name)  # a drafter exported for vLLM / SGLang (specdec/export)
    if not (p / DRAFTER_FILE).is_file():
        found = sorted(x.name for x in p.iterdir())[:10] if p.is_dir() else "a file"
        raise CheckpointError(f"{p} is not a trained drafter: no {DRAFTER_FILE} (found: {found}); pass a training "
                              "run directory (output.dir/output.name) or an exported drafter directory")
    try:
        info = json.loads((p / DRAFTER_FILE).read_text())
        name, config, target = info["drafter"], info["config"], info.get("target", {})
        fmt = info.get("format", FULL)
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{p / DRAFTER_FILE} is corrupt ({type(e).__name__}: {e})") from None
    if fmt not in (FULL, INFERENCE):
        raise CheckpointError(f"{p / DRAFTER_FILE} has format {fmt!r}; known: {FULL}, {INFERENCE}")
    if expect_name is not None and name != expect_name:
        raise CheckpointError(f"{p} holds a {name!r} drafter, not {expect_name!r}")
    if fmt == INFERENCE and not (p / PARAMS_FILE).is_file():
        raise CheckpointError(f"{p} is an inference-format drafter without its {PARAMS_FILE}")
    extra, flat = {}, None
    if step is None and (p / PARAMS_FILE).is_file():
        try:
            with np.load(p / PARAMS_FILE) as z:
                flat = {k: z[k] for k in z.files}
        except Exception as e:
            raise CheckpointError(f"{p / PARAMS_FILE} cannot be read ({type(e).__name__}: {e})") from None
        newest = _newest_checkpoint(p) if fmt == FULL and (p / CHECKPOINTS).is_dir() else None
        if newest is not None and newest > int(flat.get("step", -1)):
            flat = None  # a resumed run still training: its params.npz is from the interruption
    if flat is not None and fmt == INFERENCE:
        check_inference_tensors(p, info, flat)
    if flat is not None:
        tree = unflatten({k: v for k, v in flat.items() if k != "step"})
        step, source = int(flat.get("step", -1)), str(p / PARAMS_FILE)
        params, buffers = tree.get("params", {}), tree.get("buffers", {})
    elif (p / CHECKPOINTS).is_dir():
        store = CheckpointStore(p / CHECKPOINTS, create=False)
        try:
            state, meta = store.restore(step)
        finally:
            store.close()
        params, buffers, step = state["params"], state.get("buffers", {}), int(meta["step"])
        source = f"{p / CHECKPOINTS} (step {step})"
        extra["examples_seen"] = (int(meta.get("epoch", 0)) * int(meta.get("train_examples", 0))
                                  + int(meta.get("cursor", 0)))
    else:
        raise CheckpointError(f"{p} has {DRAFTER_FILE} but no weights ({PARAMS_FILE} or {CHECKPOINTS}/)")
    cut = {str(k): dict(v) for k, v in info.get("draft_vocab_cut", {}).items()} if fmt == INFERENCE else {}
    return {"drafter": name, "config": config, "target": target, "params": params, "buffers": buffers or {},
            "step": step, "source": source, "format": fmt, "draft_vocab_cut": cut, **extra}


def snapshot(run: str | os.PathLike, out: str | os.PathLike, step: int | None = None, float16: bool = False) -> dict:
    """Freeze a training run's drafter into the drafter directory `out` (drafter.json + params.npz), which no
    training job moves: the weights at checkpoint `step`, or (None) the run's final weights (params.npz, with
    DSpark's calibrated confidences) if it finished, else its newest checkpoint. `float16`: the weight matrices
    stored float16 (vectors and buffers as trained; the drafter upcasts on load). drafter.json also records the
    run, the step, the weights' source and (from a checkpoint) the examples seen; the run's config.yaml is copied
    beside it, and its summary.json with the final weights. Returns `load_drafter`'s dict of what was written.
    An inference-format source is refused: its drafter.json would lose the format, and its cut tensors would then
    load as full ones (cut again, by ids past their width)."""
    run, out = Path(run), Path(out)
    info = load_drafter(run, step=step)  # a resumed run still training: its newest checkpoint
    if info["format"] == INFERENCE:
        raise CheckpointError(f"{run} is an inference-format drafter (`specdec export --format inference`), not a "
                              "training run: use it as it is, or snapshot the run it was exported from")
    final = info["source"] == str(run / PARAMS_FILE)
    snap = {"run": str(run), "step": info["step"], "source": info["source"],
            **({"examples_seen": info["examples_seen"]} if "examples_seen" in info else {})}
    out.mkdir(parents=True, exist_ok=True)
    (out / DRAFTER_FILE).write_text(json.dumps({"drafter": info["drafter"], "config": info["config"],
                                                "target": info["target"], "snapshot": snap}, indent=2))
    params = float16_matrices(info["params"]) if float16 else info["params"]
    export_params(out, params, info["buffers"], info["step"])
    # the run's config holds at every step; its summary (final eval, steps) only for the final weights
    for name in ("config.yaml", "summary.json") if final else ("config.yaml",):
        if (run / name).is_file() and run.resolve() != out.resolve():
            shutil.copy2(run / name, out / name)
    return info


def _newest_checkpoint(run: Path) -> int | None:
    store = CheckpointStore(run / CHECKPOINTS, create=False)
    try:
        return store.latest_step()
    finally:
        store.close()


def load_trained(path: str | os.PathLike | None, name: str, target, config_stem: str) -> dict:
    """`load_drafter` + `check_target` for the drafter factories (`drafter.path` in a run config), with the error a
    user sees when no path was given: it names the training config that makes one."""
    if not path:
        raise ValueError(f"{name} needs a trained checkpoint: set drafter.path (or params.path) to a training run "
                         f"directory, e.g. runs/train/{config_stem} from `specdec train configs/train/{config_stem}.yaml`")
    info = load_drafter(path, expect_name=name)
    check_target(info, target, str(path))
    embed = info.get("embed")  # an imported checkpoint's own embedding: specdec drafters use the target's
    mine = np.asarray(target.params["embed"], np.float32)
    if embed is not None and (np.shape(embed) != mine.shape
                              or not np.allclose(np.asarray(embed, np.float32), mine, rtol=1e-3, atol=1e-3)):
        raise CheckpointError(f"{path} carries its own embed_tokens, which differ from the target's; specdec's "
                              f"{name} reads the target's embedding, so it cannot reproduce this drafter")
    head = info.get("head")  # an imported block drafter's lm_head [Vd, H]: specdec's uses the target's head
    if head is not None:
        mine = np.asarray(target.output_projection(), np.float32).T  # [V, H], as the imported head
        d2t = info["buffers"].get("d2t")
        mine = mine if d2t is None else mine[np.asarray(d2t)]
        if np.shape(head) != mine.shape or not np.allclose(np.asarray(head, np.float32), mine, rtol=1e-3, atol=1e-3):
            raise CheckpointError(f"{path} carries its own lm_head, which differs from the target's (on its draft "
                                  f"vocabulary); specdec's {name} reads the target's head, so it cannot reproduce "
                                  "this drafter")
    return info


def drafter_kind(path: str | os.PathLike) -> str:
    """The drafter name a trained drafter directory holds (drafter.json of a run, or an export's config.json):
    what `create_drafter(path=...)` and `specdec generate --drafter <dir>` build."""
    p = Path(os.path.expanduser(str(path)))
    if (p / DRAFTER_FILE).is_file():
        try:
            return str(json.loads((p / DRAFTER_FILE).read_text())["drafter"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{p / DRAFTER_FILE} is corrupt ({type(e).__name__}: {e})") from None
    kind = is_export(p)
    if kind:
        return kind
    if not p.exists():
        raise CheckpointError(f"drafter checkpoint {p} does not exist")
    raise CheckpointError(f"{p} is not a trained drafter: no {DRAFTER_FILE} and no EAGLE-3 / DFlash / DSpark "
                          f"{EXPORT_CONFIG}; pass a training run directory or a directory written by `specdec export`")


def check_target(info: dict, target, where: str) -> None:
    """A drafter trained on one target cannot serve another of a different shape."""
    from specdec.export.eagle3 import target_dims

    want = info.get("target", {})
    have = {**target_info(target), **target_dims(target.cfg)}
    # drafter.json records the first three; an imported export also the attention widths, RoPE and eps that
    # specdec's drafter takes from the target
    keys = ("hidden_size", "vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
            "rms_norm_eps", "rope_scaling")
    bad = [k for k in keys if k in want and want[k] != have[k]]
    if bad:
        raise CheckpointError(f"{where} was trained on a target with " + ", ".join(f"{k}={want[k]}" for k in bad)
                              + "; this target has " + ", ".join(f"{k}={have[k]}" for k in bad))


def target_info(target) -> dict:
    cfg = target.cfg
    return {"name": cfg.name, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "num_layers": cfg.num_layers}


# ---------------------------------------------------------------------------------------------------------
# Drafters in the vLLM / SGLang layouts: written by `specdec export` (specdec/export), or trained by a peer.
# The format modules specdec/export/eagle3.py and block.py are imported inside the functions: importing them
# runs specdec/export/__init__.py, which imports this module.
# ---------------------------------------------------------------------------------------------------------

def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of a directory's model.safetensors, or of the shards its index.json lists (the target
    loader's reader, `specdec.models.loading.read_safetensors_checkpoint`), its errors as CheckpointError."""
    from specdec.models.loading import read_safetensors_checkpoint
    from specdec.models.registry import CorruptCheckpointError, ModelNotFoundError, UnsupportedModelError

    try:
        return read_safetensors_checkpoint(path)
    except (CorruptCheckpointError, ModelNotFoundError, UnsupportedModelError) as e:
        raise CheckpointError(str(e)) from None


def export_kind(config: dict) -> str | None:
    """The drafter kind of a peer config.json ("eagle3", "dflash", "dspark"), or None."""
    from specdec.export import block as B
    from specdec.export import eagle3 as E

    if E.detect_format(config) is not None:
        return "eagle3"
    found = B.detect(config)
    return found[0] if found else None


def is_export(path: str | os.PathLike) -> str | None:
    """The drafter kind of an exported (or peer-trained) directory, or None."""
    p = Path(path) / EXPORT_CONFIG
    if not p.is_file():
        return None
    try:
        return export_kind(json.loads(p.read_text()))
    except (json.JSONDecodeError, AttributeError):
        return None


def load_export(path: str | os.PathLike, expect_name: str | None = None) -> dict:
    """An exported (or peer-trained) EAGLE-3 / DFlash / DSpark directory in `load_drafter`'s form: {"drafter",
    "config", "target", "params", "buffers", "step", "source"}, plus "embed" / "head" (a checkpoint's own
    embedding [V, H] / lm_head [Vd, H], None if absent: specdec's drafters use the target's)."""
    p = Path(path)
    try:
        config = json.loads((p / EXPORT_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p / EXPORT_CONFIG} cannot be read ({type(e).__name__}: {e})") from None
    kind = export_kind(config)
    if kind is None:
        raise CheckpointError(f"{p / EXPORT_CONFIG} is no EAGLE-3 / DFlash / DSpark drafter config (vLLM "
                              "speculators or SGLang)")
    if expect_name is not None and expect_name != kind:
        raise CheckpointError(f"{p} holds a {kind!r} drafter, not {expect_name!r}")
    from specdec.export import block as B
    from specdec.export import eagle3 as E

    out = (E if kind == "eagle3" else B).from_peer(config, read_tensors(p))
    meta = json.loads((p / EXPORT_META).read_text()) if (p / EXPORT_META).is_file() else {}
    target = {**out["dims"]}
    if "num_layers" in meta.get("target", {}):
        target["num_layers"] = meta["target"]["num_layers"]
    # DSpark's calibrated temperatures are not in the peer format; specdec's own export keeps them in the meta
    buffers = {**out["buffers"], **{k: np.asarray(v, np.float32) for k, v in meta.get("buffers", {}).items()}}
    return {"drafter": kind, "config": out["config"], "target": target, "params": out["params"],
            "buffers": buffers, "step": int(meta.get("step", -1)), "source": f"{p} ({out['format']} layout)",
            "format": FULL, "draft_vocab_cut": {}, "embed": out["embed"], "head": out.get("head")}
