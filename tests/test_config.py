"""The typed experiment config: round-trips, overrides, every error path, extends, sweeps, shipped configs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from specdec.config import (ConfigError, DatasetConfig, ExperimentConfig, SamplingConfig, SweepConfig, TreeConfig,
                            apply_overrides, expand_sweep, from_dict, is_sweep, key_type, load_config, load_sweep,
                            parse_override, sweep_overrides, to_dict, to_yaml)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def rich_config() -> ExperimentConfig:
    """A config with every kind of field set away from its default."""
    return from_dict(ExperimentConfig, {
        "description": "rich",
        "model": {"name": "tiny", "dtype": "bfloat16", "backend": "scan", "max_seq_len": 512, "seed": 3},
        "drafter": {"name": "eagle", "num_draft_tokens": 8, "params": {"layers": 1, "nested": {"a": [1, 2]}},
                    "path": "ckpt/eagle"},
        "verify": {"policy": "multidraft_tree", "tree": {"paths": [[0], [1], [0, 0], [0, 1]]}, "eps": 0.2},
        "scheduler": {"kind": "adaptive", "prior_depth": 0.9, "score_bins": [0.5], "tree_value": "nodes"},
        "sampling": {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "seed": 5},
        "generation": {"max_new_tokens": 32, "batch_size": 8, "compiled_loop": False},
        "data": {"datasets": [{"name": "gsm8k", "split": "test", "field": "question", "limit": 10,
                               "category": "math"}, {"name": "data/prompts.jsonl"}], "chat_template": False},
        "eval": {"baseline": False, "lossless_check": {"samples": 0}, "warmup": False},
        "tracking": {"backend": "memory", "project": "p", "group": "g", "tags": ["a", "b"], "mode": "online",
                     "dir": "wb"},
        "output": {"dir": "out", "name": "rich"},
        "train": {"steps": 10, "lr": 1e-3, "warmup_frac": 0.1},
        "mesh": {"data": 2, "model": 4, "devices": 8},
    })


# ----------------------------------------------------------------------------------------------- round trips

def test_defaults_and_empty_file(tmp_path):
    cfg = load_config(write(tmp_path / "empty.yaml", ""))
    assert cfg == ExperimentConfig()
    assert cfg.sampling.temperature == 0.0 and cfg.data.datasets == (DatasetConfig("quickstart"),)


@pytest.mark.parametrize("cfg", [ExperimentConfig(), rich_config()], ids=["default", "rich"])
def test_round_trip(cfg, tmp_path):
    assert from_dict(ExperimentConfig, to_dict(cfg)) == cfg
    assert from_dict(ExperimentConfig, yaml.safe_load(to_yaml(cfg))) == cfg
    assert load_config(write(tmp_path / "c.yaml", to_yaml(cfg))) == cfg


def test_types_are_normalised():
    cfg = rich_config()
    assert cfg.verify.tree.paths == ((0,), (1,), (0, 0), (0, 1))  # lists become tuples
    assert cfg.tracking.tags == ("a", "b")
    assert from_dict(SamplingConfig, {"temperature": 1}).temperature == 1.0  # int accepted for float
    assert isinstance(from_dict(SamplingConfig, {"temperature": 1}).temperature, float)
    assert cfg.sampling.to_params().top_k == 20


# ------------------------------------------------------------------------------------------------- overrides

def test_overrides_nested_lists_bools_and_strings():
    cfg = load_config(CONFIGS / "tiny.yaml", [
        "sampling.temperature=0.7", "verify.policy=rejection_chain", "generation.compiled_loop=false",
        "tracking.tags=[x, y]", "drafter.params.max_ngram=3", "data.datasets.0.limit=1",
        "verify.tree.dynamic.depth=3", "output.name=123", "drafter.path=", "model.seed=7",
    ])
    assert cfg.sampling.temperature == 0.7 and cfg.verify.policy == "rejection_chain"
    assert cfg.generation.compiled_loop is False
    assert cfg.tracking.tags == ("x", "y")
    assert cfg.drafter.params == {"max_ngram": 3}
    assert cfg.data.datasets[0].limit == 1
    assert cfg.verify.tree.dynamic.depth == 3 and cfg.verify.tree.paths is None
    assert cfg.output.name == "123"  # a number typed for a str field stays the text typed
    assert cfg.drafter.path is None and cfg.model.seed == 7
    # exponents without a dot are floats (YAML 1.1 would read `8e-4` as a string), on the command line and in files
    cfg = load_config({}, ["train.lr=8e-4", "sampling.top_p=1E0"])
    assert cfg.train.lr == 8e-4 and cfg.sampling.top_p == 1.0


def test_overrides_later_wins_and_whole_section():
    cfg = load_config({}, ["generation.batch_size=2", "generation.batch_size=4"])
    assert cfg.generation.batch_size == 4
    cfg = load_config({}, ["data.datasets=[{name: gsm8k, limit: 5}, {name: humaneval}]"])
    assert [d.name for d in cfg.data.datasets] == ["gsm8k", "humaneval"] and cfg.data.datasets[0].limit == 5
    cfg = apply_overrides(ExperimentConfig(), {"sampling.top_p": 0.5})
    assert cfg.sampling.top_p == 0.5


# ----------------------------------------------------------------------------------------------- error paths

def error(fn, *args) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args)
    return info.value


def test_unknown_top_level_key():
    e = error(load_config, {"modle": {"name": "tiny"}})
    assert e.key == "modle" and "did you mean 'model'" in str(e) and "sampling" in str(e)


def test_unknown_nested_key_with_suggestion():
    e = error(load_config, {"sampling": {"temprature": 0.5}})
    assert e.key == "sampling.temprature"
    assert "did you mean 'temperature'" in str(e) and "top_p" in str(e)  # lists the allowed keys
    e = error(load_config, {"data": {"datasets": [{"name": "a"}, {"name": "b", "limt": 3}]}})
    assert e.key == "data.datasets.1.limt" and "did you mean 'limit'" in str(e)


@pytest.mark.parametrize("data, key, expected", [
    ({"generation": {"batch_size": "4"}}, "generation.batch_size", "expected int, got str '4'"),
    ({"generation": {"batch_size": 2.5}}, "generation.batch_size", "expected int"),
    ({"generation": {"compiled_loop": 1}}, "generation.compiled_loop", "expected bool"),
    ({"generation": {"max_new_tokens": True}}, "generation.max_new_tokens", "expected int"),
    ({"sampling": {"temperature": "0.5"}}, "sampling.temperature", "expected float"),
    ({"model": {"name": 5}}, "model.name", "expected str"),
    ({"tracking": {"tags": "a"}}, "tracking.tags", "expected a list"),
    ({"tracking": {"tags": ["a", 1]}}, "tracking.tags.1", "expected str"),
    ({"drafter": {"params": [1]}}, "drafter.params", "expected a mapping"),
    ({"sampling": 0.5}, "sampling", "expected a mapping"),
    ({"data": {"datasets": [{"split": "test"}]}}, "data.datasets.0.name", "required key is missing"),
])
def test_wrong_types(data, key, expected):
    e = error(load_config, data)
    assert e.key == key and expected in str(e)


def test_bad_literal_lists_choices():
    e = error(load_config, {"verify": {"policy": "greedy"}})
    assert e.key == "verify.policy"
    for choice in ("greedy_chain", "rejection_chain", "greedy_tree", "multidraft_tree", "typical"):
        assert choice in str(e)
    e = error(load_config, {}, ["model.dtype=fp8"])
    assert e.key == "model.dtype" and "'bfloat16'" in str(e)


@pytest.mark.parametrize("override, key", [
    ("sampling.temperature=-0.1", "sampling.temperature"),
    ("sampling.top_p=0", "sampling.top_p"),
    ("sampling.top_p=1.5", "sampling.top_p"),
    ("generation.batch_size=0", "generation.batch_size"),
    ("drafter.num_draft_tokens=0", "drafter.num_draft_tokens"),
    ("data.datasets.0.limit=0", "data.datasets.0.limit"),
    ("data.datasets=[]", "data.datasets"),
    ("train.warmup_frac=1.0", "train.warmup_frac"),
    ("mesh.devices=3", "mesh.devices"),
    ("verify.tree={paths: [[0], [0, 0, 1]]}", "verify.tree.paths.1"),  # parent [0, 0] missing
    ("verify.tree={paths: [[0]], dynamic: {depth: 2}}", "verify.tree"),  # both set
    ("verify.tree.dynamic.top_k=0", "verify.tree.dynamic.top_k"),
    ("sampling.temperature=0.7", "verify.policy"),  # greedy_chain is exact only at temperature 0
])
def test_out_of_range_values(override, key):
    e = error(load_config, {}, [override])
    assert e.key == key, str(e)


@pytest.mark.parametrize("override", ["sampling.temperature", "=3", "sampling..top_p=1", "sampling.top_p =[1"])
def test_bad_override_syntax(override):
    e = error(load_config, {}, [override])
    assert "override" in str(e) or "cannot parse" in str(e)


def test_unknown_override_key_names_it():
    e = error(load_config, {}, ["sampling.temprature=0.5"])
    assert e.key == "sampling.temprature" and "did you mean 'temperature'" in str(e)
    e = error(load_config, {}, ["model.name.x=1"])
    assert e.key == "model.name.x" and "has no key" in str(e)
    e = error(load_config, {}, ["data.datasets.5.limit=1"])
    assert e.key == "data.datasets.5" and "out of range" in str(e)
    assert key_type("drafter.params.anything.deep") is not None  # drafter params are free-form


def test_missing_file_and_bad_yaml(tmp_path):
    e = error(load_config, tmp_path / "nope.yaml")
    assert "not found" in str(e) and "nope.yaml" in str(e)
    e = error(load_config, write(tmp_path / "bad.yaml", "model: [unclosed\n"))
    assert "invalid YAML" in str(e)
    e = error(load_config, write(tmp_path / "dup.yaml", "model:\n  name: a\n  name: b\n"))
    assert "duplicate key 'name'" in str(e)
    e = error(load_config, write(tmp_path / "list.yaml", "- a\n"))
    assert "mapping" in str(e)
    e = error(load_config, write(tmp_path / "k.yaml", "model: {nmae: x}\n"))
    assert e.key == "model.nmae" and "k.yaml" in str(e)  # errors name the file


def test_extends(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path / "base.yaml", "model: {name: tiny, seed: 1}\ntracking: {tags: [a, b]}\n")
    write(tmp_path / "sub" / "mid.yaml", "extends: ../base.yaml\nmodel: {seed: 2}\ngeneration: {batch_size: 4}\n")
    child = write(tmp_path / "sub" / "child.yaml", "extends: mid.yaml\ntracking: {tags: [c]}\n")
    cfg = load_config(child, ["generation.max_new_tokens=8"])
    assert cfg.model.name == "tiny" and cfg.model.seed == 2  # mappings merge key by key
    assert cfg.tracking.tags == ("c",)  # lists replace
    assert cfg.generation.batch_size == 4 and cfg.generation.max_new_tokens == 8
    write(tmp_path / "loop_a.yaml", "extends: loop_b.yaml\n")
    write(tmp_path / "loop_b.yaml", "extends: loop_a.yaml\n")
    assert "circular extends" in str(error(load_config, tmp_path / "loop_a.yaml"))
    assert "not found" in str(error(load_config, write(tmp_path / "m.yaml", "extends: missing.yaml\n")))
    assert error(load_config, write(tmp_path / "e.yaml", "extends: [a]\n")).key == "extends"


# ------------------------------------------------------------------------------------------------------ sweeps

def test_sweep_grid_product(tmp_path):
    sweep = write(tmp_path / "s.yaml", f"base: {CONFIGS / 'tiny.yaml'}\ngrid:\n"
                  "  drafter.num_draft_tokens: [2, 4]\n  sampling.temperature: [0.0, 0.7]\n"
                  "  verify.policy: [rejection_chain]\n")
    runs = expand_sweep(sweep, ["generation.max_new_tokens=4"])
    assert [name for name, _ in runs] == [
        f"num_draft_tokens={k}__temperature={t}__policy=rejection_chain" for k in (2, 4) for t in (0.0, 0.7)]
    assert [(c.drafter.num_draft_tokens, c.sampling.temperature) for _, c in runs] == [
        (2, 0.0), (2, 0.7), (4, 0.0), (4, 0.7)]
    for name, cfg in runs:
        assert cfg.output.name == name and cfg.tracking.group == "s" and cfg.generation.max_new_tokens == 4
        assert cfg.model.name == "tiny"
    assert [n for n, _ in expand_sweep(sweep)] == [n for n, _ in runs]  # stable


def test_sweep_explicit_runs_crossed_with_grid():
    sweep = load_sweep({"name": "drafters", "base": {"extends": str(CONFIGS / "tiny.yaml")},
                        "runs": [{"name": "ngram", "drafter.name": "ngram"},
                                 {"drafter.name": "eagle", "drafter.params": {"layers": 1}}],
                        "grid": {"generation.batch_size": [1, 8]}})
    runs = expand_sweep(sweep)
    names = [n for n, _ in runs]
    assert names == ["ngram__batch_size=1", "ngram__batch_size=8",
                     'name=eagle__params=-layers-1-__batch_size=1', 'name=eagle__params=-layers-1-__batch_size=8']
    assert runs[3][1].drafter.params == {"layers": 1} and runs[3][1].generation.batch_size == 8
    assert runs[0][1].tracking.group == "drafters"


def test_sweep_names_unique_filesystem_safe_and_disambiguated():
    sweep = SweepConfig(name="trees", grid={"verify.tree.paths": [[[0], [1]], [[0], [0, 0]]],
                                            "generation.batch_size": [1], "train.batch_size": [2]})
    names = [n for n, _ in sweep_overrides(sweep)]
    assert len(set(names)) == 2 and all("/" not in n and " " not in n for n in names)
    assert all("generation.batch_size=1" in n and "train.batch_size=2" in n for n in names)  # ambiguous labels
    plan = sweep_overrides(sweep)
    assert plan == sweep_overrides(sweep)
    assert sweep_overrides(SweepConfig()) == [("base", {})]


def test_sweep_errors(tmp_path):
    e = error(expand_sweep, SweepConfig(grid={"drafter.num_draft_tokns": [1, 2]}))
    assert e.key == "drafter.num_draft_tokns" and "did you mean 'num_draft_tokens'" in str(e)
    e = error(expand_sweep, SweepConfig(runs=[{"sampling.temprature": 1.0}]))
    assert e.key == "sampling.temprature"
    e = error(expand_sweep, SweepConfig(grid={"generation.batch_size": [1, 0]}))
    assert e.key == "generation.batch_size" and "run 'batch_size=0'" in str(e)
    e = error(sweep_overrides, SweepConfig(runs=[{"model.seed": 1}, {"model.seed": 1}]))
    assert "identical" in str(e)
    e = error(sweep_overrides, SweepConfig(runs=[{"model.seed": 1}], grid={"model.seed": [2]}))
    assert e.key == "runs.0"
    assert error(load_sweep, {"grid": {"model.seed": []}}).key == "grid.model.seed"
    assert error(load_sweep, {"grid": {}, "name": "a/b"}).key == "name"
    assert error(load_sweep, {"grid": {}, "bse": "x"}).key == "bse"
    e = error(load_config, write(tmp_path / "sw.yaml", "grid: {model.seed: [1]}\n"))
    assert "sweep file" in str(e)
    assert "not found" in str(error(expand_sweep, write(tmp_path / "s2.yaml", "base: nope.yaml\ngrid: {}\n")))


def test_sweep_round_trip():
    sweep = load_sweep(CONFIGS / "sweeps" / "draft_length.yaml")
    assert from_dict(SweepConfig, yaml.safe_load(to_yaml(sweep))) == sweep
    assert sweep.name == "draft_length" and Path(sweep.base).is_absolute()


# ------------------------------------------------------------------------------------------- shipped configs

SHIPPED = sorted(CONFIGS.rglob("*.yaml")) + sorted(CONFIGS.rglob("*.yml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(CONFIGS)) for p in SHIPPED])
def test_every_shipped_config_loads(path):
    text = yaml.safe_load(path.read_text())
    if path.parent.name == "recipes" and isinstance(text, dict) and "jobs" in text:
        from experiments.recipe import load_recipe, plan  # a recipe: every stage checked, every config resolved

        assert [s["record"]["key"] for s in plan(load_recipe(str(path)))]
    elif isinstance(text, dict) and "jobs" in text:  # a study for a lent device (tools/device_train.py)
        from tools.device_train import load_study

        for job in load_study(str(path))["jobs"]:
            cfg = load_config(Path(__file__).resolve().parents[1] / job["config"], job["set"])
            assert from_dict(ExperimentConfig, to_dict(cfg)) == cfg
    elif is_sweep(text):
        runs = expand_sweep(path)
        assert runs and len({name for name, _ in runs}) == len(runs)
        for _, cfg in runs:
            assert from_dict(ExperimentConfig, to_dict(cfg)) == cfg
    else:
        cfg = load_config(path)
        assert from_dict(ExperimentConfig, to_dict(cfg)) == cfg


def test_shipped_examples_say_what_they_should():
    quick = load_config(CONFIGS / "quickstart.yaml")
    assert (quick.model.name, quick.drafter.name, quick.verify.policy) == ("smollm2-135m-instruct", "ngram", "greedy_chain")
    assert quick.generation.max_new_tokens == 64 and quick.generation.batch_size == 1
    assert quick.data.datasets[0].name == "quickstart"
    assert load_config(CONFIGS / "tiny.yaml").model.name == "tiny"
    runs = expand_sweep(CONFIGS / "sweeps" / "draft_length.yaml")
    assert [(c.drafter.num_draft_tokens, c.scheduler.kind) for _, c in runs] == [
        (k, kind) for k in (2, 4, 6, 8) for kind in ("fixed", "adaptive")]
    assert quick.scheduler.kind == "adaptive"  # the default the quickstart shows


def test_configs_are_immutable():
    cfg = ExperimentConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.sampling.temperature = 1.0  # type: ignore[misc]
    assert hash(cfg.sampling) == hash(SamplingConfig()) and hash(TreeConfig(paths=((0,),)))


def test_single_override_string_is_not_split_into_characters():
    assert load_config({}, "generation.batch_size=3").generation.batch_size == 3


def test_exponent_floats_in_files(tmp_path):
    (tmp_path / "c.yaml").write_text("train:\n  lr: 3e-4\n")
    assert load_config(tmp_path / "c.yaml").train.lr == 3e-4
