"""Recipes: the stages that make a trained drafter, run in order by one command and resumable at every stage.

    specdec recipe configs/recipes/smollm2_135m_dspark.yaml [--until STAGE] [--only STAGE] [--dry-run]

A recipe file (YAML, read as every config file is: `extends: <file>` merges it over another, a repeated key is
an error) has `jobs`, the stages in order, each with a unique `name`, and `out`, the folder all their outputs go
under (default runs/recipes/<file stem>; runs/ is never committed):

    run: prompts HumanEval-shaped completion prompts from the `mbpp` and / or `gpteacher` files
                 (experiments.completion_prompts), into <out>/prompts/<name>/prompts.jsonl
    run: data    `specdec data` of `config` with the `set` overrides, into <out>/data/<name>; with
                 `prompts: <prompts stage>`, that stage's file is the config's first dataset
    run: train   `specdec train` of `config` + `set` on the data of the data stages named in `data` (the first
                 is train.data_dir, the rest train.more_data), continuing the drafter of the train stage named in
                 `init_from` (null: from scratch), into <out>/train/<name>. `stop_at: N` ends the run at step N
                 although its learning-rate schedule spans train.steps (`specdec train --stop-at-step`);
                 `snapshot: {step: N, float16: true}` freezes its drafter (the weights at checkpoint N, else the
                 final ones; weight matrices in float16) into <out>/drafters/<name>. That directory, or the run
                 directory without `snapshot`, is the stage's drafter: what `init_from` and `drafter` read.
    run: eval    the engine tau of the drafter of the train stage named in `drafter`, on the prompts, model,
                 length and batch of the experiment config `config` (+ `set`), at T = 0 with every drafted node
                 verified: the drafter alone as a `nodes`-token chain and as a `nodes`-node tree (`tree`: the
                 drafter's own tree parameters, tree_top_k / tree_depth for the dynamic trees, tree_paths for
                 Medusa's static one; every method must draft `nodes` a round, checked before decoding), and
                 n-gram prompt lookup and suffix decoding at the same `nodes` per round,
                 measured by experiments.compare (the quickstart's comparison: AR first, each output checked
                 against AR's). `untuned` names the prompt sets no stage trained or was tuned on. One JSON:
                 <out>/eval/<name>/results.json.
    run: card    the README.md of that drafter's directory (its model card), rendered from the JSON of the eval
                 stage named in `eval`, the drafter's drafter.json and the recipe (experiments/card.py).

Data and train stages may carry `seconds`, a time budget per call (data.max_seconds / train.max_seconds): a stage
that reaches it stops, and the same command goes on with it.

Each stage's folder (<out>/<kind>/<name>) holds recipe_stage.json: the stage as it ran (the job, its resolved
config, the keys of the stages it read) and whether it finished. A finished stage whose record matches the recipe
is skipped; one begun and not finished runs again (data goes on from its finished shards, training from its last
checkpoint); a stage whose record differs from the recipe (its job, its config, or a stage it read was made
anew) is refused, the difference named: delete its folder to redo it. A card is derived from the rest alone: it
is rendered again whenever the card its inputs make differs from the one on disk (an evaluation made anew), and
`--only <card stage>` renders it again from the existing evaluation.

Before anything runs, every stage is checked: its kind and keys, its config, and the stages it reads (they must
exist, be of the right kind and come earlier: no cycles); a train stage's train.drafter_options must be options
of the drafter its drafter.name trains, its `init_from` a drafter of that kind, and an eval stage's `tree`
parameters of the drafter it measures; an error names the stage and the problem.

A stage's outputs are keyed by their folder: recipes that share `out` (the recipes of one target,
configs/recipes/smollm2_135m_*.yaml, all write under runs/recipes/smollm2_135m) share a data stage they both
list with the same name and job, so it is made once and every other recipe finds it finished; one listed under
the same name with another job is refused as changed.

The same format, without `out`, `name`s or the prompts / eval / card kinds, is a study for a lent accelerator
(tools/device_train.py, `load_study`): `data` / `train` jobs whose outputs go where their configs say, each with
its `seconds`, and `bring_back`. Both read jobs, their commands (`job_args`), where a job writes (`job_paths`) and
whether it finished (`finished`) here.

This module imports only the standard library at the top (and experiments/card.py, which does too):
tools/device_train.py imports it before the packages are installed on a bare device.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Callable

from experiments.card import methods, render

REPO = Path(__file__).resolve().parents[1]
KINDS = ("prompts", "data", "train", "eval", "card")
STUDY_KINDS = ("data", "train")  # a study for a lent device (tools/device_train.py)
STUDY_KEYS = ("name", "run", "config", "set", "seconds")
KEYS = {  # kind -> the keys a stage of that kind may have
    "prompts": ("name", "run", "mbpp", "gpteacher"),
    "data": (*STUDY_KEYS, "prompts"),
    "train": (*STUDY_KEYS, "data", "init_from", "stop_at", "snapshot"),
    "eval": ("name", "run", "config", "set", "drafter", "nodes", "tree", "untuned"),
    "card": ("name", "run", "eval"),
}
DEFAULT_TREE = {"tree_top_k": 4, "tree_depth": 3}  # with 7 nodes: the shipped drafter's 7-node tree
FOLDERS = {"prompts": "prompts", "data": "data", "train": "train", "eval": "eval", "card": "card"}
# per kind, the config keys the recipe sets itself (from the stage's name, `out`, `data`, `init_from`, `prompts`)
WIRED = {"data": ("train.data_dir",),
         "train": ("train.data_dir", "train.more_data", "train.init_from", "output.dir", "output.name")}
# settings that do not change what a stage makes: left out of its key (a budget may change between calls)
UNKEYED = ("train.max_seconds", "data.max_seconds")
RECORD = "recipe_stage.json"
RESULTS = "results.json"
CARD = "README.md"
PROMPTS = "prompts.jsonl"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class RecipeError(ValueError):
    """A recipe that cannot run as written: a malformed or inconsistent stage, a stage that changed since its
    output was made, a command that failed. The message names the stage and the problem."""


# ---------------------------------------------------------------------------------------------------------
# The file: jobs, checked
# ---------------------------------------------------------------------------------------------------------

def config_path(config: str) -> Path:
    """A job's config file, absolute: as given (relative to the working directory), else relative to the
    repository."""
    path = Path(config)
    return path.resolve() if path.is_file() or path.is_absolute() else REPO / path


def _names(value) -> list:
    return [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else [value]


def _check_job(path: str, i: int, job, kinds: tuple[str, ...], study: bool) -> dict:
    """The job with every key of its kind filled in, or a RecipeError naming the job and the problem."""
    named = f" ({job['name']})" if isinstance(job, dict) and isinstance(job.get("name"), str) else ""
    if not isinstance(job, dict) or job.get("run") not in kinds:
        got = f"run: {job.get('run')!r} (an unknown stage kind)" if isinstance(job, dict) else repr(job)
        raise RecipeError(f"{path}: job {i}{named} must be {{run: {'|'.join(kinds)}, config: ..., set: [...], "
                          f"seconds: N}}, got {got}")
    kind = job["run"]
    where = f"{path}: job {i}{named}"
    allowed = STUDY_KEYS if study else KEYS[kind]
    unknown = sorted(set(job) - set(allowed))
    if unknown:
        raise RecipeError(f"{where} has unknown key(s) {unknown} (a {kind} stage takes {', '.join(allowed)})")
    name = job.get("name")
    if not study and not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise RecipeError(f"{where}: every stage needs a `name` of letters, digits, '_', '.' or '-' (it names its "
                          f"output folder), got {name!r}")
    sets = job.get("set", [])
    if not isinstance(sets, list) or not all(isinstance(s, str) and "=" in s for s in sets):
        raise RecipeError(f"{where}: `set` must be a list of key=value, got {sets!r}")
    seconds = job.get("seconds")
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0):
        raise RecipeError(f"{where}: `seconds` must be a number of seconds >= 0, got {seconds!r}")
    out = {"name": name, "run": kind, "set": list(sets)}
    if kind not in ("card", "prompts"):
        if not isinstance(job.get("config"), str) or not job["config"]:
            raise RecipeError(f"{where}: `config` is missing (the {kind} stage's config file)")
        if not config_path(job["config"]).is_file():
            raise RecipeError(f"{where}: config {job['config']} does not exist")
        out["config"] = job["config"]
    if kind in STUDY_KINDS:
        out["seconds"] = seconds
    if study:
        return out
    wired = set(WIRED.get(kind, ())) | ({"data.datasets.0.name"} if kind == "data" and job.get("prompts") else set())
    keys = {s.split("=", 1)[0].strip() for s in sets}
    # a key under a wired one (train.more_data.0.skip_shards) would be replaced by the wiring without a word
    clash = sorted(k for k in keys if any(k == w or k.startswith(w + ".") for w in wired))
    if clash:
        raise RecipeError(f"{where}: `set` must not set {', '.join(clash)}: the recipe sets it (from the stage's "
                          "name, `out`, `data`, `init_from` or `prompts`)")
    if kind == "prompts":
        sources = {k: job[k] for k in ("mbpp", "gpteacher") if job.get(k) is not None}
        if not sources or not all(isinstance(v, str) for v in sources.values()):
            raise RecipeError(f"{where}: a prompts stage builds HumanEval-shaped completion prompts "
                              "(experiments.completion_prompts) from `mbpp` and / or `gpteacher` files; give at "
                              "least one path")
        out.update(mbpp=sources.get("mbpp"), gpteacher=sources.get("gpteacher"))
    elif kind == "data":
        if not (job.get("prompts") is None or isinstance(job["prompts"], str)):
            raise RecipeError(f"{where}: `prompts` must name a prompts stage, got {job['prompts']!r}")
        out["prompts"] = job.get("prompts")
    elif kind == "train":
        data = _names(job.get("data"))
        if not data or not all(isinstance(d, str) for d in data):
            raise RecipeError(f"{where}: `data` must name the data stage(s) it trains on, got {job.get('data')!r}")
        stop_at, snap = job.get("stop_at"), job.get("snapshot")
        if stop_at is not None and (isinstance(stop_at, bool) or not isinstance(stop_at, int) or stop_at < 1):
            raise RecipeError(f"{where}: `stop_at` must be a step >= 1 or null, got {stop_at!r}")
        if snap is not None and not (isinstance(snap, dict) and set(snap) <= {"step", "float16"}
                                     and (snap.get("step") is None or (isinstance(snap["step"], int)
                                                                       and not isinstance(snap["step"], bool)
                                                                       and snap["step"] >= 1))
                                     and isinstance(snap.get("float16", False), bool)):
            raise RecipeError(f"{where}: `snapshot` must be {{step: N or null, float16: true|false}}, got {snap!r}")
        if not (job.get("init_from") is None or isinstance(job["init_from"], str)):
            raise RecipeError(f"{where}: `init_from` must name a train stage or be null, got {job['init_from']!r}")
        out.update(data=data, init_from=job.get("init_from"), stop_at=stop_at,
                   snapshot=None if snap is None else {"step": snap.get("step"), "float16": bool(snap.get("float16"))})
    elif kind == "eval":
        nodes, tree, untuned = job.get("nodes", 7), job.get("tree", DEFAULT_TREE), job.get("untuned", [])
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise RecipeError(f"{where}: `nodes` (verified nodes per round) must be an integer >= 1, got {nodes!r}")
        if not isinstance(tree, dict) or not tree:
            raise RecipeError(f"{where}: `tree` must be the drafter's tree parameters, e.g. {DEFAULT_TREE}")
        if not isinstance(untuned, list) or not all(isinstance(u, str) for u in untuned):
            raise RecipeError(f"{where}: `untuned` must be a list of prompt-set names, got {untuned!r}")
        if not isinstance(job.get("drafter"), str):
            raise RecipeError(f"{where}: `drafter` must name the train stage whose drafter it measures")
        out.update(drafter=job["drafter"], nodes=nodes, tree=dict(tree), untuned=list(untuned))
    elif kind == "card":
        if not isinstance(job.get("eval"), str):
            raise RecipeError(f"{where}: `eval` must name the eval stage whose results the card shows")
        out["eval"] = job["eval"]
    return out


def references(job: dict) -> list[tuple[str, str, str]]:
    """(key, stage name, the kind it must be) for every stage `job` reads."""
    refs = [("data", d, "data") for d in job.get("data") or ()]
    if job["run"] == "data" and job.get("prompts"):
        refs.append(("prompts", job["prompts"], "prompts"))
    if job.get("init_from"):
        refs.append(("init_from", job["init_from"], "train"))
    if job["run"] == "eval":
        refs.append(("drafter", job["drafter"], "train"))
    if job["run"] == "card":
        refs.append(("eval", job["eval"], "eval"))
    return refs


def _cycle(jobs: dict[str, dict], start: str) -> list[str] | None:
    """A chain of references from `start` back to itself, if there is one."""
    def walk(name, chain):
        for _, ref, _ in references(jobs[name]) if name in jobs else ():
            if ref == start:
                return chain + [ref]
            if ref not in chain:
                found = walk(ref, chain + [ref])
                if found:
                    return found
        return None

    return walk(start, [start])


def _check_references(path: str, jobs: list[dict]) -> None:
    """Every stage a job reads exists, is of the kind it must be and comes earlier (stages run in order)."""
    at, named = {}, {}
    for i, job in enumerate(jobs):
        if job["name"] in at:
            raise RecipeError(f"{path}: two stages are named {job['name']!r} (jobs {at[job['name']]} and {i})")
        at[job["name"]], named[job["name"]] = i, job
    for i, job in enumerate(jobs):
        for key, ref, kind in references(job):
            where = f"{path}: stage {job['name']} (job {i}): `{key}` names {ref!r}"
            if ref not in at:
                raise RecipeError(f"{where}, which is no stage of the recipe ({', '.join(at)})")
            if at[ref] >= i:
                cycle = _cycle(named, job["name"])
                if cycle:
                    raise RecipeError(f"{where}: the stages read each other in a cycle ({' -> '.join(cycle)})")
                raise RecipeError(f"{where}, which comes later (job {at[ref]}): stages run in order, so a stage "
                                  "reads only earlier ones")
            if named[ref]["run"] != kind:
                got = named[ref]["run"]
                raise RecipeError(f"{where}, {_a(got)} {got} stage; `{key}` takes {_a(kind)} {kind} stage")


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _read_yaml(path: str) -> dict:
    """The file as the config system reads every YAML file (specdec.config.read_yaml: a repeated key is an error,
    not silently the last one)."""
    from specdec.config import read_yaml
    from specdec.errors import ConfigError

    try:
        return read_yaml(path)
    except ConfigError as e:
        raise RecipeError(str(e)) from None


def _jobs(path: str, text, kinds: tuple[str, ...], study: bool) -> list[dict]:
    jobs = text["jobs"]
    if not isinstance(jobs, list) or not jobs:
        raise RecipeError(f"{path}: `jobs` must be a non-empty list")
    return [_check_job(path, i, job, kinds, study) for i, job in enumerate(jobs)]


def load_recipe(path: str) -> dict:
    """{"path", "description", "out", "jobs"} of a recipe file, every stage checked (kinds, keys, configs, the
    stages each reads); a RecipeError names the first problem."""
    text = _read_yaml(path)
    if not (isinstance(text, dict) and "jobs" in text):
        raise RecipeError(f"{path}: a recipe is a mapping with `jobs`, the stages in order")
    unknown = sorted(set(text) - {"description", "out", "jobs"})
    if unknown:
        raise RecipeError(f"{path}: unknown key(s) {unknown} (a recipe has description, out and jobs)")
    for key in ("description", "out"):
        if not (text.get(key) is None or isinstance(text[key], str)):
            raise RecipeError(f"{path}: `{key}` must be text, got {text[key]!r}")
    jobs = _jobs(path, text, KINDS, study=False)
    _check_references(path, jobs)
    out = text.get("out") or f"runs/recipes/{Path(path).stem}"
    return {"path": str(path), "description": text.get("description") or "", "out": out, "jobs": jobs}


def load_study(path: str) -> dict:
    """A lent device's work as {"jobs": [...], "bring_back": [...]}. A study file (YAML with `jobs`) lists the jobs
    run in order, each {run: data | train, config: <config.yaml>, set: [key=value, ...], seconds: its budget},
    and in `bring_back` the output names of train jobs whose drafters come back (float16; two fit in a call's
    64 MiB). Any other config is one data job and one train job of it, its drafter brought back."""
    text = _read_yaml(path)
    if not (isinstance(text, dict) and "jobs" in text):
        return {"jobs": [{"name": None, "run": "data", "config": path, "set": [], "seconds": None},
                         {"name": None, "run": "train", "config": path, "set": [], "seconds": None}],
                "bring_back": None}
    jobs = _jobs(path, text, STUDY_KINDS, study=True)
    bring = text.get("bring_back") or []
    if not isinstance(bring, list):
        raise RecipeError(f"{path}: `bring_back` must be a list of train jobs' output names")
    return {"jobs": jobs, "bring_back": bring}


# ---------------------------------------------------------------------------------------------------------
# One job: its command, where it writes, whether it finished
# ---------------------------------------------------------------------------------------------------------

def job_args(job: dict, *more: str) -> list[str]:
    """The `specdec` command line of a data or train job (after `specdec`): its kind, config, `set` and `more`."""
    return [job["run"], str(config_path(job["config"])), *job["set"], *more]


def read_settings(config: str, sets: list[str], *keys: str) -> list:
    """Settings ("section.key") of `config` after the `sets` overrides."""
    from specdec.config import load_config, to_dict

    c = to_dict(load_config(str(config_path(config)), sets))
    return [c[s][k] for s, k in (key.split(".") for key in keys)]


def job_paths(job: dict, sets: list[str], workdir: Path | str = ".",
              settings: Callable[..., list] = read_settings) -> dict:
    """Where a data or train job writes, its relative paths taken relative to `workdir`: its data directory
    (train.data_dir) and its run directory (<output.dir>/<output.name or the config's stem>, as `specdec train`
    names it), after its `set` and `sets`. `settings`: how the config is read (a bare device reads it in a child
    process)."""
    data_dir, output_dir, output_name = settings(job["config"], job["set"] + list(sets), "train.data_dir",
                                                 "output.dir", "output.name")
    name = output_name or Path(job["config"]).stem  # as `specdec train` names its run
    return {"data_dir": Path(workdir, str(data_dir)), "run_dir": Path(workdir, str(output_dir), name), "name": name}


def finished(job: dict, paths: dict, ran_before: bool | None = None) -> bool:
    """Whether a data or train job has nothing left to do: a train job whose run ended complete (or stopped at
    the step it was asked to stop at); a data job whose data is complete, or, with `ran_before` (a lent
    device), that an earlier call ran and that wrote its summary, however far it got (data is made once there,
    so that every training run of a study sees the same examples)."""
    if job["run"] == "data":
        summary = paths["data_dir"] / "summary.json"
        if not summary.is_file():
            return False
        return ran_before if ran_before is not None else bool(json.loads(summary.read_text()).get("complete"))
    summary = paths["run_dir"] / "summary.json"
    if not summary.is_file():
        return False
    got = json.loads(summary.read_text())
    return got.get("status") == "complete" or (got.get("status") == "stopped" and job.get("stop_at") is not None
                                               and got.get("steps") == job["stop_at"])


# ---------------------------------------------------------------------------------------------------------
# Stages of a recipe: wiring, keys, records
# ---------------------------------------------------------------------------------------------------------

def stage_dir(recipe: dict, job: dict) -> Path:
    return Path(recipe["out"]) / FOLDERS[job["run"]] / job["name"]


def by_name(recipe: dict) -> dict[str, dict]:
    return {job["name"]: job for job in recipe["jobs"]}


def drafter_dir(recipe: dict, name: str) -> Path:
    """The drafter a train stage makes: its snapshot directory, or its run directory without a snapshot."""
    job = by_name(recipe)[name]
    return Path(recipe["out"]) / "drafters" / name if job.get("snapshot") else stage_dir(recipe, job)


def wiring(recipe: dict, job: dict) -> list[str]:
    """The overrides that put a data or train stage's output under `out` and feed it the stages it reads."""
    if job["run"] == "data":
        prompts = job.get("prompts")
        first = [f"data.datasets.0.name={stage_dir(recipe, by_name(recipe)[prompts]) / PROMPTS}"] if prompts else []
        return [*first, f"train.data_dir={stage_dir(recipe, job)}"]
    if job["run"] != "train":
        return []
    jobs = by_name(recipe)
    data = [str(stage_dir(recipe, jobs[d])) for d in job["data"]]
    init = str(drafter_dir(recipe, job["init_from"])) if job["init_from"] else "null"
    return [f"train.data_dir={data[0]}", f"train.more_data={json.dumps([{'data_dir': d} for d in data[1:]])}",
            f"train.init_from={init}", f"output.dir={stage_dir(recipe, job).parent}", f"output.name={job['name']}"]


def budget(job: dict) -> list[str]:
    return [] if job.get("seconds") is None else [f"{job['run']}.max_seconds={job['seconds']}"]


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def flatten_config(value, prefix: str = "") -> dict:
    """A config dict as {dotted key: value}, lists of mappings indexed ("data.datasets.0.skip")."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in value):
        items = enumerate(value)
    else:
        return {prefix: value}
    out = {}
    for k, v in items:
        out.update(flatten_config(v, f"{prefix}.{k}" if prefix else str(k)))
    return out or {prefix: value}


def plan(recipe: dict) -> list[dict]:
    """Each stage with what it will run: its resolved config (data, train, eval), the keys of the stages it
    reads and its own key (a digest of its job, config and those keys: a stage made anew changes the keys of
    every stage that read it), its folder and its record's state ("finished", "to run", "to resume" or
    "changed: <what differs>")."""
    from specdec.config import load_config, to_dict

    keys: dict[str, str] = {}
    methods: dict[str, str] = {}  # train stage -> the drafter it trains
    out = []
    for job in recipe["jobs"]:
        config = None
        if job["run"] not in ("card", "prompts"):
            try:
                cfg = load_config(str(config_path(job["config"])), job["set"] + wiring(recipe, job))
            except (ValueError, OSError) as e:  # ConfigError is a ValueError
                raise RecipeError(f"stage {job['name']}: {job['config']}: {e}") from None
            config = {k: v for k, v in flatten_config(to_dict(cfg)).items() if k not in UNKEYED}
        if job["run"] == "train":
            methods[job["name"]] = _check_method(job, config, methods)
        elif job["run"] == "eval":
            _check_tree(job, methods[job["drafter"]])
        spec = {k: v for k, v in job.items() if k != "seconds"}
        if job["run"] == "card":  # the card shows the whole recipe: any stage's change changes it
            spec["recipe"] = [{k: v for k, v in j.items() if k != "seconds"} for j in recipe["jobs"]]
        inputs = {ref: keys[ref] for _, ref, _ in references(job)}
        # as JSON stores it (tuples as lists), so that a record read back compares equal
        record = json.loads(json.dumps({"stage": job["name"], "job": spec, "config": config, "inputs": inputs},
                                       default=str))
        keys[job["name"]] = _digest(record)
        record["key"] = keys[job["name"]]
        where = stage_dir(recipe, job)
        out.append({"job": job, "record": record, "dir": where, "state": _state(recipe, job, record, where)})
    return out


def _check_method(job: dict, config: dict, methods: dict[str, str]) -> str:
    """The drafter a train stage trains (its config's drafter.name), checked against the stage: every
    train.drafter_options key must be an option of that drafter's training task, and the drafter it continues
    (`init_from`) one of the same drafter. A mismatch is a RecipeError naming the stage and the field, before any
    stage runs (training would refuse it only after the data stages)."""
    import drafters
    from specdec.train.tasks import task_options

    drafters.available()  # drafter modules register their training tasks on import
    where, method = f"stage {job['name']}", config["drafter.name"]
    try:
        allowed = task_options(method)
    except ValueError as e:
        raise RecipeError(f"{where}: drafter.name: {e}") from None
    prefix = "train.drafter_options."
    unknown = sorted({k[len(prefix):].split(".")[0] for k in config if k.startswith(prefix)} - set(allowed))
    if unknown:
        raise RecipeError(f"{where}: {', '.join(prefix + u for u in unknown)}: not an option of drafter {method!r} "
                          f"(its drafter.name); the options of {method} are: {', '.join(allowed)}")
    source = job["init_from"]
    if source and methods[source] != method:
        raise RecipeError(f"{where}: `init_from` names {source!r}, which trains {methods[source]}, but this stage "
                          f"trains {method} (its drafter.name): a drafter continues only a drafter of its own kind")
    return method


def _check_tree(job: dict, method: str) -> None:
    """An eval stage's `tree` holds parameters of the drafter it measures (tree_top_k / tree_depth for the
    dynamic trees, tree_paths for Medusa's static one), else a RecipeError naming the stage and the key."""
    import drafters

    allowed = [p for p in drafters.parameters(method) if p != "path"]  # the recipe sets the path
    unknown = sorted(set(job["tree"]) - set(allowed))
    if unknown:
        raise RecipeError(f"stage {job['name']}: `tree` sets {', '.join(unknown)}, which drafter {method!r} (stage "
                          f"{job['drafter']}) does not take; its parameters are: {', '.join(allowed)}")


def _differences(old: dict, new: dict) -> list[str]:
    diff = []
    for part in ("config", "inputs", "job"):
        a, b = flatten_config(old.get(part) or {}), flatten_config(new.get(part) or {})
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if part == "inputs":
            diff += [f"stage {k} it reads was made anew" for k in keys]
        else:
            diff += [f"{part}.{k}" for k in keys]
    return diff


def outputs_exist(recipe: dict, job: dict) -> bool:
    """The files a finished stage leaves (a deleted output means the stage runs again)."""
    where = stage_dir(recipe, job)
    if job["run"] == "prompts":
        return (where / PROMPTS).is_file()
    if job["run"] == "data":
        return (where / "summary.json").is_file()
    if job["run"] == "train":
        snap = drafter_dir(recipe, job["name"])
        return (where / "summary.json").is_file() and (snap / "drafter.json").is_file()
    if job["run"] == "eval":
        return (where / RESULTS).is_file()
    return (card_path(recipe, job)).is_file()


def card_path(recipe: dict, job: dict) -> Path:
    eval_job = by_name(recipe)[job["eval"]]
    return drafter_dir(recipe, eval_job["drafter"]) / CARD


def _state(recipe: dict, job: dict, record: dict, where: Path) -> str:
    path = where / RECORD
    if not path.is_file():
        return "to run"
    try:
        old = json.loads(path.read_text())
    except ValueError:
        old = None
    if not isinstance(old, dict):
        raise RecipeError(f"stage {job['name']}: {path} is not a stage record (JSON): delete it, and the stage runs "
                          "again (data and training go on from what they saved)")
    if old.get("key") != record["key"]:
        if job["run"] == "card":  # derived from the others alone: rendered again
            return "to run"
        return "changed: " + (", ".join(_differences(old, record)) or "its key")
    if old.get("done") and outputs_exist(recipe, job):
        return "finished" if job["run"] != "card" or card_is_current(recipe, job) else "to run"
    return "to resume"


def _write_record(where: Path, record: dict, done: bool) -> None:
    where.mkdir(parents=True, exist_ok=True)
    partial = where / (RECORD + ".partial")  # written whole, then renamed: a kill mid-write leaves the old record
    partial.write_text(json.dumps({**record, "done": done, "when": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2,
                                  default=str))
    partial.replace(where / RECORD)


def _prompt_args(job: dict, expand: bool = False) -> list[str]:
    """The completion-prompt sources of a prompts stage as experiments.completion_prompts' arguments; `expand`:
    their $VARIABLES and ~ expanded as every data path is (specdec.records.expand_path: an unset variable is an
    error naming it). The record keeps them unexpanded, so the stage's key does not depend on where the data is."""
    from specdec.records import expand_path

    return [a for k in ("mbpp", "gpteacher") if job.get(k)
            for a in (f"--{k}", str(expand_path(job[k])) if expand else job[k])]


def command(recipe: dict, job: dict) -> str:
    """What a stage runs, as text (the dry run prints it)."""
    if job["run"] in STUDY_KINDS:
        extra = [f"--stop-at-step {job['stop_at']}"] if job.get("stop_at") else []
        text = "specdec " + " ".join(job_args(job, *budget(job), *wiring(recipe, job), *extra)).replace(
            str(REPO) + "/", "")
        if job.get("snapshot"):
            snap = job["snapshot"]
            text += (f"; snapshot of step {snap['step'] or 'final'}{' (float16)' if snap['float16'] else ''} -> "
                     f"{drafter_dir(recipe, job['name'])}")
        return text
    if job["run"] == "prompts":
        return (f"python -m experiments.completion_prompts {' '.join(_prompt_args(job))} --out "
                f"{stage_dir(recipe, job) / PROMPTS}")
    if job["run"] == "eval":
        return (f"engine tau of {drafter_dir(recipe, job['drafter'])} (chain and tree of {job['nodes']} nodes) and of "
                f"n-gram / suffix at {job['nodes']} nodes, on the prompts of {job['config']} -> "
                f"{stage_dir(recipe, job) / RESULTS}")
    eval_job = by_name(recipe)[job["eval"]]
    return f"model card {card_path(recipe, job)} from {stage_dir(recipe, eval_job) / RESULTS}"


# ---------------------------------------------------------------------------------------------------------
# Running a recipe
# ---------------------------------------------------------------------------------------------------------

def run_recipe(path: str, run_cli: Callable[[list[str]], int], *, until: str | None = None,
               only: str | None = None, dry_run: bool = False, progress: bool = True,
               log: Callable[[str], None] = print) -> int:
    """Run the recipe's stages in order (up to and including `until`; or `only` that one, whose inputs must be
    finished; a card is then rendered again even if it was). `run_cli(argv)` runs a `specdec` command and returns
    its exit status (experiments/cli.py's `main`). Returns 0 when every stage asked for finished, 1 when one
    stopped at its time budget (the same command goes on), 130 when one was interrupted; raises RecipeError."""
    recipe = load_recipe(path)
    names = [job["name"] for job in recipe["jobs"]]
    for flag, name in (("--until", until), ("--only", only)):
        if name is not None and name not in names:
            raise RecipeError(f"{flag} {name}: the recipe has no such stage ({', '.join(names)})")
    if until is not None and only is not None:
        raise RecipeError("--until and --only: give one of them")
    stages = plan(recipe)
    if only is not None:
        chosen = [s for s in stages if s["job"]["name"] == only]
    else:
        chosen = stages[:names.index(until) + 1] if until is not None else stages
    log(f"[recipe] {recipe['path']}: {len(stages)} stages, outputs under {recipe['out']}")
    if dry_run:
        for i, s in enumerate(stages):
            mark = "" if s in chosen else " (not asked for)"
            log(f"  {i + 1:2d}. {s['job']['name']} ({s['job']['run']}): {s['state']}{mark}\n"
                f"      {command(recipe, s['job'])}")
        return 0
    states = {s["job"]["name"]: s["state"] for s in stages}
    for s in chosen:
        job, state = s["job"], s["state"]
        if job["run"] == "card" and state == "finished" and not card_is_current(recipe, job):
            state = "to run"  # its evaluation was made anew by this call
        number = f"{names.index(job['name']) + 1}/{len(names)}"
        if state.startswith("changed"):
            raise RecipeError(f"stage {job['name']} changed since its output in {s['dir']} was made ({state[9:]}): "
                              f"delete {s['dir']} to make it anew (and the stages that read it), or restore the "
                              "stage as it was")
        if only is not None:
            missing = [ref for _, ref, _ in references(job) if states[ref] != "finished"]
            if missing:
                raise RecipeError(f"--only {only}: the stage(s) it reads are not finished ({', '.join(missing)}); "
                                  f"run the recipe up to them first")
        if state == "finished" and not (only is not None and job["run"] == "card"):
            log(f"[recipe] {number} {job['name']} ({job['run']}): finished, skipped")
            continue
        log(f"[recipe] {number} {job['name']} ({job['run']}): {'resuming' if state == 'to resume' else 'running'}: "
            f"{command(recipe, job)}")
        _write_record(s["dir"], s["record"], done=False)
        t0 = time.monotonic()
        status = _run_stage(recipe, job, run_cli, progress, log)
        if status != 0:
            return status
        _write_record(s["dir"], s["record"], done=True)
        states[job["name"]] = "finished"
        log(f"[recipe] {number} {job['name']} ({job['run']}): finished in {time.monotonic() - t0:.0f} s")
    log("[recipe] done" + (f" (up to {until})" if until else f" (only {only})" if only else ""))
    return 0


def _run_stage(recipe: dict, job: dict, run_cli, progress: bool, log) -> int:
    where = stage_dir(recipe, job)
    if job["run"] in STUDY_KINDS:
        extra = ["--stop-at-step", str(job["stop_at"])] if job.get("stop_at") else []
        argv = job_args(job, *budget(job), *wiring(recipe, job), *extra, *([] if progress else ["--no-progress"]))
        rc = run_cli(argv)
        if rc == 130:
            log(f"[recipe] {job['name']}: interrupted; the same command resumes it")
            return 130
        if rc != 0:
            raise RecipeError(f"stage {job['name']}: `specdec {' '.join(argv[:2])} ...` exited with status {rc} "
                              "(its output above says why)")
        paths = {"data_dir": where, "run_dir": where}
        if not finished(job, paths):
            log(f"[recipe] {job['name']}: stopped at its time budget (seconds: {job.get('seconds')}); the same "
                "command goes on with it")
            return 1
        if job["run"] == "train" and job.get("snapshot"):
            from specdec.train.checkpoint import snapshot

            snap = job["snapshot"]
            info = snapshot(where, drafter_dir(recipe, job["name"]), snap["step"], snap["float16"])
            log(f"[recipe] {job['name']}: drafter of step {info['step']} -> {drafter_dir(recipe, job['name'])}")
        return 0
    if job["run"] == "prompts":
        from experiments.completion_prompts import main as completion_prompts

        where.mkdir(parents=True, exist_ok=True)
        rc = completion_prompts([*_prompt_args(job, expand=True), "--out", str(where / PROMPTS)])
        if rc:
            raise RecipeError(f"stage {job['name']}: experiments.completion_prompts exited with status {rc}")
        return 0
    if job["run"] == "eval":
        from specdec.config import load_config

        cfg = load_config(str(config_path(job["config"])), job["set"])
        results = evaluate(cfg, drafter_dir(recipe, job["drafter"]), nodes=job["nodes"], tree=job["tree"],
                           untuned=job["untuned"], stage=job["name"], drafter_stage=job["drafter"], log=log)
        where.mkdir(parents=True, exist_ok=True)
        (where / RESULTS).write_text(json.dumps(results, indent=2))
        log(f"[recipe] {job['name']}: {where / RESULTS}")
        return 0
    card = write_card(recipe, job)
    log(f"[recipe] {job['name']}: {card}")
    return 0


def _read_output(path: Path, stage: str) -> dict:
    if not path.is_file():
        raise RecipeError(f"the output of stage {stage} ({path}) is missing: run the recipe up to it first")
    return json.loads(path.read_text())


def lineage(recipe: dict, last: str) -> list[dict]:
    """The train stages that made the drafter of train stage `last`, oldest first (its `init_from` chain)."""
    jobs, chain, name = by_name(recipe), [], last
    while name:
        chain.append(jobs[name])
        name = jobs[name]["init_from"]
    return chain[::-1]


def write_card(recipe: dict, job: dict) -> Path:
    """The card stage: README.md of the measured drafter's directory (`card_text`)."""
    path, text = card_text(recipe, job)
    path.write_text(text)
    return path


def card_is_current(recipe: dict, job: dict) -> bool:
    """Whether the card on disk is the one the card stage's inputs make now. Its key cannot tell: an evaluation
    made anew with the same job and config has the same key and other figures."""
    try:
        path, text = card_text(recipe, job)
        return path.is_file() and path.read_text() == text
    except (ValueError, OSError, KeyError, TypeError):  # an input missing or malformed: rendering it says what
        return False


def card_text(recipe: dict, job: dict) -> tuple[Path, str]:
    """Where the card stage writes and what: README.md of the measured drafter's directory, rendered
    (experiments/card.py) from the eval stage's results, drafter.json and the figures of the lineage's stages read
    from their outputs."""
    jobs = by_name(recipe)
    eval_job = jobs[job["eval"]]
    results_path = stage_dir(recipe, eval_job) / RESULTS
    results = _read_output(results_path, eval_job["name"])
    where = drafter_dir(recipe, eval_job["drafter"])
    drafter = _read_output(where / "drafter.json", eval_job["drafter"])
    trainable = None
    if (where / "summary.json").is_file():
        trainable = json.loads((where / "summary.json").read_text()).get("trainable_parameters")
    stages = []
    for train in lineage(recipe, eval_job["drafter"]):
        data = []
        for d in train["data"]:
            summary = _read_output(stage_dir(recipe, jobs[d]) / "summary.json", d)
            data.append({"name": d, "config": jobs[d]["config"], "set": jobs[d]["set"],
                         "examples": summary["examples"], "response_tokens": summary["response_tokens"],
                         "teacher_forced": summary.get("teacher_forced_examples") or 0})
        run = _read_output(stage_dir(recipe, train) / "summary.json", train["name"])
        config = _read_output(stage_dir(recipe, train) / RECORD, train["name"])["config"]
        stages.append({"name": train["name"], "config": train["config"], "set": train["set"], "steps": run["steps"],
                       "schedule_steps": config["train.steps"] if run.get("status") == "stopped" else None,
                       "lr": config["train.lr"], "batch_size": config["train.batch_size"],
                       "snapshot": train["snapshot"], "init_from": train["init_from"], "data": data})
    text = render(results=results, results_path=str(results_path), drafter=drafter, drafter_path=str(where),
                  trainable=trainable, recipe_path=recipe["path"], card_stage=job["name"], eval_stage=eval_job["name"],
                  drafter_stage=eval_job["drafter"], lineage=stages)
    return where / CARD, text


# ---------------------------------------------------------------------------------------------------------
# The evaluation: engine tau, the drafter alone and the lookup drafters at the same verified nodes
# ---------------------------------------------------------------------------------------------------------

def machine_text() -> str:
    """The CPU model and core count, for "measured on <machine>"."""
    import os

    from specdec.costs import cpu_model

    return f"{cpu_model()}, {os.cpu_count()} cores"


def evaluate(cfg, drafter_path: Path, *, nodes: int, tree: dict, untuned: list[str], stage: str = "eval",
             drafter_stage: str = "", log: Callable[[str], None] = print) -> dict:
    """Engine tau at T = 0, every drafted node verified, per prompt set of `cfg.data`: the trained drafter at
    `drafter_path` alone as a `nodes`-token chain and as a `nodes`-node tree (`tree`), n-gram prompt lookup and
    suffix decoding at `nodes` per round (experiments.compare: AR first; outputs checked against AR's). The
    figures are counts (tokens committed per verification round, rounds whose first draft was accepted), the
    same on any machine; no timings. Returns the results JSON."""
    from drafters import create_drafter
    from experiments.build import build_target, codec_for, encode_prompt
    from experiments.compare import DrafterSpec, compare
    from experiments.datasets import load_all
    from experiments.provenance import git_info
    from specdec.train.checkpoint import drafter_kind

    where = f"stage {stage}"
    if cfg.sampling.temperature != 0:
        raise RecipeError(f"{where}: the evaluation is greedy (T = 0); its config has sampling.temperature="
                          f"{cfg.sampling.temperature}")
    if not (Path(drafter_path) / "drafter.json").is_file():
        raise RecipeError(f"{where}: no trained drafter in {drafter_path}")
    kind = drafter_kind(str(drafter_path))
    target = build_target(cfg.model, cfg.mesh)
    codec = codec_for(target)
    chat = cfg.data.chat_template and codec.chat_template is not None
    prompts = load_all(cfg.data.datasets, chat=chat)
    sets = list(dict.fromkeys(p.dataset for p in prompts))
    missing = [u for u in untuned if u not in sets]
    if missing:
        raise RecipeError(f"{where}: `untuned` names {', '.join(missing)}, which are not prompt sets of its config "
                          f"({', '.join(sets)})")
    path = str(drafter_path)
    specs = {"drafter_chain": DrafterSpec(kind, nodes, {"path": path}, "greedy_chain"),
             "drafter_tree": DrafterSpec(kind, nodes, {"path": path, **tree}, "greedy_tree"),
             "ngram": DrafterSpec("ngram", nodes, {"max_ngram": 3}, "greedy_chain"),
             "suffix": DrafterSpec("suffix", nodes, {}, "greedy_tree")}
    for method, spec in specs.items():  # each drafts `nodes` a round, checked before anything is decoded
        try:
            drafts = create_drafter(spec.name, target, spec.num_draft_tokens, **spec.params).num_draft_tokens
        except ValueError as e:
            raise RecipeError(f"{where}: {method} ({spec.name}): {e}") from None
        if drafts != nodes:  # a static tree's size is its paths' count (Medusa's tree_paths), not `nodes`
            raise RecipeError(f"{where}: {method} drafts {drafts} nodes a round, not `nodes` ({nodes}): every method "
                              "is compared at the same verified nodes; give a `tree` of that size")
    results = {m: {"sets": {}} for m in specs}
    for name in sets:
        ids = [encode_prompt(codec, p, chat) for p in prompts if p.dataset == name]
        log(f"[recipe] {stage}: {name}: {len(ids)} prompts, AR and {len(specs)} methods ...")
        rows = compare(target, ids, list(specs.values()), max_new_tokens=cfg.generation.max_new_tokens,
                       batch_size=cfg.generation.batch_size)
        for method, row in zip(specs, rows[1:]):
            m = row.metrics
            survival = m.acceptance_by_position()["survival"]
            first = survival[0] if survival else 0.0
            results[method]["sets"][name] = {"tau": m.tau, "first_accept": first, "rounds": m.rounds,
                                             "tokens": m.new_tokens, "same_as_ar": bool(row.matches_ar)}
            log(f"    {method}: tau {m.tau:.3f}, first draft accepted {first:.3f}, output == AR: {row.matches_ar}")
    tuned = [s for s in sets if s not in untuned]
    for method in specs:
        got = results[method]["sets"]
        results[method]["mean"] = {"over": tuned,
                                   "tau": sum(got[s]["tau"] for s in tuned) / len(tuned) if tuned else None,
                                   "first_accept": (sum(got[s]["first_accept"] for s in tuned) / len(tuned)
                                                    if tuned else None)}
    return {
        "drafter": {"path": path, "kind": kind, "stage": drafter_stage},
        "settings": {"model": cfg.model.name, "temperature": 0.0, "max_new_tokens": cfg.generation.max_new_tokens,
                     "batch_size": cfg.generation.batch_size, "nodes": nodes, "tree": tree,
                     "verification": "greedy; every drafted node verified (fixed width)"},
        "sets": {s: {"prompts": sum(1 for p in prompts if p.dataset == s), "untuned": s in untuned} for s in sets},
        "methods": methods(kind, nodes, tree),
        "results": results,
        "measured": {"machine": machine_text(), "date": time.strftime("%Y-%m-%d", time.gmtime()),
                     "commit": git_info().get("commit")},
    }
