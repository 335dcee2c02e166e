"""Recipes (experiments/recipe.py, `specdec recipe`) on the tiny random target: two data stages, two training
stages chained by init_from (the first snapshotted in float16, the second stopped early), an evaluation on two
small prompt sets and the model card, run end to end through the CLI's commands; run again, every stage is
skipped; a deleted or interrupted stage is resumed alone; a changed stage is refused; the card holds the
evaluation's figures, follows an evaluation made anew and refuses a results file that lacks one; every malformed
recipe is an error naming the stage; a prompts stage expands its paths and feeds its data stage. A second recipe
writing to the same folder finds the data stage it shares finished and measures another drafter (Medusa, with its
static tree) through the same eval and card stages; a drafter option, `init_from` or `tree` that does not fit the
stage's drafter is refused before anything runs. Every shipped recipe plans, its eval stage measures the method its
file is named after, and the data stages it shares with the DSpark recipe are the same stages; the DSpark recipe's
last training stage resolves to the shipped drafter's own config."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from experiments import cli
from experiments.card import CardError, check_results
from experiments.recipe import (RESULTS, RecipeError, evaluate, flatten_config, lineage, load_recipe, plan,
                                run_recipe, stage_dir, write_card)
from specdec.config import load_config

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "train" / "tiny.yaml")
SHIPPED = REPO / "configs" / "recipes" / "smollm2_135m_dspark.yaml"
RECIPES = sorted((REPO / "configs" / "recipes").glob("*.yaml"))
# both training stages share one schedule, so the second runs the train step the first compiled; EAGLE-3 with
# one training-time-test step compiles fastest
TRAIN = ["train.steps=6", "train.batch_size=4", "train.eval_examples=4", "train.eval_every=2",
         "train.checkpoint_every=2", "train.log_every=2", "train.drafter_options={ttt_steps: 1}"]


def tiny_recipe(work: Path, **changes) -> dict:
    """The test recipe as a mapping; `changes`: stage name -> keys to replace in that stage."""
    prompts = f"data.datasets=[{{name: {work / 'train_prompts.jsonl'}, limit: 20}}]"
    jobs = [
        {"name": "d1", "run": "data", "config": TINY,
         "set": [prompts, "train.shard_size=10", "generation.max_new_tokens=12"]},
        {"name": "d2", "run": "data", "config": TINY,
         "set": [prompts, "data.datasets.0.skip=20", "train.shard_size=10", "generation.max_new_tokens=12"]},
        {"name": "t1", "run": "train", "config": TINY, "data": ["d1"], "init_from": None,
         "set": TRAIN, "snapshot": {"step": None, "float16": True}},
        {"name": "t2", "run": "train", "config": TINY, "data": ["d2", "d1"], "init_from": "t1",
         "set": TRAIN, "stop_at": 4},
        {"name": "eval", "run": "eval", "config": str(work / "eval.yaml"), "drafter": "t2", "nodes": 3,
         "tree": {"tree_top_k": 2, "tree_depth": 2}, "untuned": ["second"]},
        {"name": "card", "run": "card", "eval": "eval"},
    ]
    for job in jobs:
        job.update(changes.get(job["name"], {}))
    return {"description": "tiny", "out": str(work / "out"), "jobs": jobs}


def write(path: Path, recipe: dict) -> str:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return str(path)


class Calls:
    """cli.main, recording each command it runs."""

    def __init__(self):
        self.argv = []

    def __call__(self, argv):
        self.argv.append(argv[:2])
        return cli.main(argv)


def eval_config(work: Path) -> None:
    """The data stages' prompts (a file: the target answers them, nothing else is generated), and the eval stage's
    experiment config: the tiny target, two small prompt sets, greedy, 8 new tokens. Prompts of one length and
    sets of one size, so that every set runs the programs the first one compiled."""
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    (work / "train_prompts.jsonl").write_text("".join(
        json.dumps({"prompt": f"{words[i % 8]} {words[i * 3 % 8]} {i}"}) + "\n" for i in range(40)))
    for name, texts in (("first", ["the cat sat on a mat", "one two three four 5"]),
                        ("second", ["def add(a, b): a + b", "return [x for x in y"])):
        assert {len(t) for t in texts} == {20}
        (work / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    (work / "eval.yaml").write_text(yaml.safe_dump({
        "model": {"name": "tiny", "max_seq_len": 256}, "sampling": {"temperature": 0.0},
        "generation": {"max_new_tokens": 8, "batch_size": 2},
        "data": {"datasets": [{"name": str(work / "first.jsonl")}, {"name": str(work / "second.jsonl")}],
                 "chat_template": False},
        "tracking": {"backend": "none"}}))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    work = tmp_path_factory.mktemp("recipe")
    eval_config(work)
    path = write(work / "tiny.yaml", tiny_recipe(work))
    logs = {"until": [], "all": []}
    first, rest = Calls(), Calls()
    assert run_recipe(path, first, until="t1", progress=False, log=logs["until"].append) == 0
    stages = {s["job"]["name"]: s["state"] for s in plan(load_recipe(path))}
    assert stages == {"d1": "finished", "d2": "finished", "t1": "finished", "t2": "to run", "eval": "to run",
                      "card": "to run"}
    assert run_recipe(path, rest, progress=False, log=logs["all"].append) == 0
    return {"work": work, "path": path, "recipe": load_recipe(path), "logs": logs, "calls": (first, rest)}


def test_tiny_recipe_runs_end_to_end(made):
    first, rest = made["calls"]
    assert first.argv == [["data", TINY], ["data", TINY], ["train", TINY]]
    assert rest.argv == [["train", TINY]]  # the stages the first call finished are skipped
    assert sum("finished, skipped" in line for line in made["logs"]["all"]) == 3
    recipe, out = made["recipe"], made["work"] / "out"
    t1 = np.load(out / "drafters" / "t1" / "params.npz")
    assert any(t1[k].dtype == np.float16 for k in t1.files)  # the snapshot's weight matrices
    summary = json.loads((out / "train" / "t2" / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["steps"] == 4  # stop_at, of a 6-step schedule
    config = yaml.safe_load((out / "train" / "t2" / "config.yaml").read_text())
    assert config["train"]["init_from"] == str(out / "drafters" / "t1")
    assert config["train"]["more_data"] == [{"data_dir": str(out / "data" / "d1"), "skip_shards": 0}]
    results = json.loads((stage_dir(recipe, recipe["jobs"][4]) / RESULTS).read_text())
    assert set(results["results"]) == {"drafter_chain", "drafter_tree", "ngram", "suffix"}
    assert results["sets"] == {"first": {"prompts": 2, "untuned": False}, "second": {"prompts": 2, "untuned": True}}
    for method in results["results"].values():
        for figures in method["sets"].values():
            assert figures["tau"] >= 1 and figures["same_as_ar"] is True  # greedy: every output is AR's
    assert [j["name"] for j in lineage(recipe, "t2")] == ["t1", "t2"]


def test_the_card_shows_the_evaluation_and_refuses_a_missing_figure(made):
    recipe, out = made["recipe"], made["work"] / "out"
    card = (out / "train" / "t2" / "README.md").read_text()
    results_path = out / "eval" / "eval" / RESULTS
    results = json.loads(results_path.read_text())
    assert "generated, never edited by hand" in card and "--only card" in card
    for method in results["results"].values():
        for figures in method["sets"].values():
            assert f"{figures['tau']:.2f}" in card and f"{figures['first_accept']:.2f}" in card
        assert f"**{method['mean']['tau']:.2f}**" in card
    assert "alone" in card and "chain" in card and "tree" in card and "verified nodes per round" in card
    data = json.loads((out / "data" / "d2" / "summary.json").read_text())
    assert f"{data['response_tokens']:,} response tokens" in card
    assert "4 of a 6-step schedule" in card
    prefix = "| n-gram prompt lookup (max_ngram 3) | lookup only | chain | 3 |"
    rows = [line for line in card.splitlines() if line.startswith(prefix)]  # its tau row, then its first-draft row
    got = results["results"]["ngram"]
    assert rows == [f"{prefix} {got['sets']['first'][f]:.2f} | **{got['mean'][f]:.2f}** | {got['sets']['second'][f]:.2f} |"
                    for f in ("tau", "first_accept")]
    saved = results_path.read_text()
    try:  # the card shows what the JSON says, and refuses a JSON without a figure
        got["sets"]["first"]["tau"], got["mean"]["tau"] = 1.2345, 1.875
        results_path.write_text(json.dumps(results))
        write_card(recipe, recipe["jobs"][5])
        assert "| 1.23 | **1.88** |" in (out / "train" / "t2" / "README.md").read_text()
        del got["sets"]["second"]["tau"]
        with pytest.raises(CardError, match="lacks results.ngram.sets.second.tau"):
            check_results(results)
        bare = json.loads(saved)
        del bare["sets"]["second"]["prompts"]  # a column head's figure
        with pytest.raises(CardError, match="lacks sets.second.prompts"):
            check_results(bare)
        results_path.write_text(json.dumps(results))
        with pytest.raises(CardError, match="lacks results.ngram.sets.second.tau"):
            write_card(recipe, recipe["jobs"][5])
    finally:
        results_path.write_text(saved)
    (out / "train" / "t2" / "README.md").unlink()
    assert run_recipe(made["path"], Calls(), only="card", progress=False, log=lambda _: None) == 0
    assert (out / "train" / "t2" / "README.md").read_text() == card  # the same card from the same evaluation


def test_the_card_follows_an_evaluation_made_anew(made):
    """The eval stage's results changed under the same job and config (made anew: the same key): the next run
    renders the card again and skips every other stage; the results restored, the card is rendered back."""
    out = made["work"] / "out"
    results_path, card_path = out / "eval" / "eval" / RESULTS, out / "train" / "t2" / "README.md"
    saved, card = results_path.read_text(), card_path.read_text()

    def no_command(argv):
        raise AssertionError(f"a finished stage ran again: {argv}")

    results = json.loads(saved)
    results["results"]["ngram"]["sets"]["first"]["tau"] = 9.8765  # no tau of a 3-node draft
    try:
        results_path.write_text(json.dumps(results))
        dry = []
        run_recipe(made["path"], no_command, dry_run=True, log=dry.append)
        assert sum(": finished" in line for line in dry) == 5 and any("card (card): to run" in line for line in dry)
        assert run_recipe(made["path"], no_command, progress=False, log=lambda _: None) == 0
        assert "| 9.88 |" in card_path.read_text()
    finally:
        results_path.write_text(saved)
    assert run_recipe(made["path"], no_command, progress=False, log=lambda _: None) == 0
    assert card_path.read_text() == card


def test_a_second_run_skips_every_stage(made):
    def no_command(argv):
        raise AssertionError(f"a finished stage ran again: {argv}")

    logs = []
    assert run_recipe(made["path"], no_command, progress=False, log=logs.append) == 0
    assert sum("finished, skipped" in line for line in logs) == 6
    dry = []
    assert run_recipe(made["path"], no_command, dry_run=True, log=dry.append) == 0
    assert sum(": finished" in line for line in dry) == 6 and "specdec train" in "\n".join(dry)


def test_an_interrupted_stage_resumes_alone_from_its_checkpoint(made):
    """t2's output deleted, then t2 cut at its time budget after one step: only t2 (and the card, which lives in
    t2's directory) run; the rerun resumes t2 from its step-1 checkpoint."""
    work, out = made["work"], made["work"] / "out"
    shutil.rmtree(out / "train" / "t2")
    budget = write(work / "budget.yaml", tiny_recipe(work, t2={"seconds": 0}))  # a budget is not a change
    calls, logs = Calls(), []
    assert run_recipe(budget, calls, progress=False, log=logs.append) == 1
    assert calls.argv == [["train", TINY]] and any("stopped at its time budget" in line for line in logs)
    assert json.loads((out / "train" / "t2" / "summary.json").read_text())["status"] == "time_limit"
    calls, logs = Calls(), []
    assert run_recipe(made["path"], calls, progress=False, log=logs.append) == 0
    assert calls.argv == [["train", TINY]]
    assert any("t2 (train): resuming" in line for line in logs)
    assert any("eval (eval): finished, skipped" in line for line in logs)
    summary = json.loads((out / "train" / "t2" / "summary.json").read_text())
    assert summary["resumed_from"] == 1 and summary["steps"] == 4 and summary["status"] == "stopped"
    assert (out / "train" / "t2" / "README.md").is_file()


def test_a_changed_stage_is_refused(made):
    work = made["work"]
    changed = write(work / "changed.yaml", tiny_recipe(work, t1={"set": [*TRAIN, "train.lr=0.001"]}))
    with pytest.raises(RecipeError, match=r"stage t1 changed since its output .* \(config\.train\.lr.* delete"):
        run_recipe(changed, Calls(), progress=False, log=lambda _: None)
    dry = []
    run_recipe(changed, Calls(), dry_run=True, log=dry.append)
    assert any("t1 (train): changed: config.train.lr" in line for line in dry)
    d2 = tiny_recipe(work)["jobs"][1]["set"]
    regenerated = write(work / "regen.yaml", tiny_recipe(work, d2={"set": [*d2, "data.datasets.0.skip=24"]}))
    with pytest.raises(RecipeError, match=r"stage d2 changed .*data\.datasets\.0\.skip"):
        run_recipe(regenerated, Calls(), progress=False, log=lambda _: None)


BAD = [
    ("- {name: a, run: evaluate, config: TINY}", r"job 0 \(a\) must be \{run: prompts\|data\|train\|eval\|card"
                                                 r".*unknown stage kind"),
    ("- {name: a, run: data}", r"job 0 \(a\): `config` is missing"),
    ("- {name: a, run: data, config: no/such.yaml}", r"job 0 \(a\): config no/such.yaml does not exist"),
    ("- {name: a, run: data, config: TINY, steps: 3}", r"job 0 \(a\) has unknown key\(s\) \['steps'\]"),
    ("- {run: data, config: TINY}", r"job 0: every stage needs a `name`"),
    ("- {name: a, run: data, config: TINY, set: [train.data_dir=x]}", r"job 0 \(a\): `set` must not set "
                                                                      r"train.data_dir"),
    ("- {name: d, run: data, config: TINY}\n- {name: d, run: data, config: TINY}",
     r"two stages are named 'd' \(jobs 0 and 1\)"),
    ("- {name: d, run: data, config: TINY}\n- {name: t, run: train, config: TINY, data: [d], init_from: x}",
     r"stage t \(job 1\): `init_from` names 'x', which is no stage of the recipe \(d, t\)"),
    ("- {name: d, run: data, config: TINY}\n- {name: t, run: train, config: TINY, data: [d], init_from: u}\n"
     "- {name: u, run: train, config: TINY, data: [d]}", r"stage t \(job 1\): `init_from` names 'u', which comes "
                                                         r"later \(job 2\)"),
    ("- {name: d, run: data, config: TINY}\n- {name: t, run: train, config: TINY, data: [d], init_from: u}\n"
     "- {name: u, run: train, config: TINY, data: [d], init_from: t}", r"cycle \(t -> u -> t\)"),
    ("- {name: d, run: data, config: TINY}\n- {name: t, run: train, config: TINY, data: [d], init_from: t}",
     r"cycle \(t -> t\)"),
    ("- {name: d, run: data, config: TINY}\n- {name: t, run: train, config: TINY, data: [d]}\n"
     "- {name: u, run: train, config: TINY, data: [t]}", r"stage u \(job 2\): `data` names 't', a train stage; "
                                                         r"`data` takes a data stage"),
    ("- {name: d, run: data, config: TINY}\n- {name: c, run: card, eval: d}", r"stage c \(job 1\): `eval` names "
                                                                              r"'d', a data stage"),
    ("- {name: t, run: train, config: TINY, data: []}", r"job 0 \(t\): `data` must name the data stage"),
    ("- {name: e, run: eval, config: TINY, drafter: x, nodes: 0}", r"job 0 \(e\): `nodes` .* >= 1"),
    ("- {name: d, run: data, config: TINY}\n- {name: t, run: train, config: TINY, data: [d, d], "
     "set: [train.more_data.0.skip_shards=1]}", r"job 1 \(t\): `set` must not set train.more_data.0.skip_shards"),
    ("- {name: d, run: data, config: TINY}\n- {name: t, run: train, config: TINY, data: [d], snapshot: {step: true}}",
     r"job 1 \(t\): `snapshot` must be \{step: N or null"),
    # read as every config file is: a repeated key is an error, not silently the last one
    ("- {name: a, run: data, config: TINY, set: [data.seed=1], set: [data.seed=2]}", r"duplicate key 'set'"),
]


@pytest.mark.parametrize("jobs,message", BAD)
def test_a_bad_recipe_is_an_error_naming_the_stage(tmp_path, jobs, message):
    path = tmp_path / "bad.yaml"
    path.write_text(f"out: {tmp_path / 'out'}\njobs:\n" + "\n".join("  " + line for line in
                                                                    jobs.replace("TINY", TINY).split("\n")))
    with pytest.raises(RecipeError, match=message):
        load_recipe(str(path))


def test_bad_flags_and_unfinished_inputs(tmp_path):
    eval_config(tmp_path)
    path = write(tmp_path / "r.yaml", tiny_recipe(tmp_path))
    with pytest.raises(RecipeError, match="--until zz: the recipe has no such stage"):
        run_recipe(path, Calls(), until="zz")
    with pytest.raises(RecipeError, match=r"--only card: the stage\(s\) it reads are not finished \(eval\)"):
        run_recipe(path, Calls(), only="card", log=lambda _: None)
    with pytest.raises(RecipeError, match="jobs` must be a non-empty list"):
        load_recipe(write(tmp_path / "empty.yaml", {"jobs": []}))
    with pytest.raises(RecipeError, match="`out` must be text, got \\['x'\\]"):
        load_recipe(write(tmp_path / "out.yaml", {"out": ["x"], "jobs": []}))
    record = tmp_path / "out" / "data" / "d1" / "recipe_stage.json"
    record.parent.mkdir(parents=True)
    record.write_text('{"stage": "d1", "key": ')  # cut short
    with pytest.raises(RecipeError, match=r"stage d1: .*recipe_stage.json is not a stage record \(JSON\): delete it"):
        plan(load_recipe(path))
    assert cli.main(["train", TINY, "--stop-at-step", "0"]) == 2  # a clear error, not a run


def test_a_prompts_stage_expands_its_paths_and_feeds_its_data_stage(tmp_path, monkeypatch):
    """A prompts stage's sources are expanded as every data path is ($VARIABLES: an unset one is an error naming
    it) and kept unexpanded in its record; its prompts.jsonl becomes the first dataset of the data stage that names
    it."""
    record = {"task_id": 601, "text": "Add two numbers.", "code": "def add(a, b):\n    return a + b",
              "test_list": ["assert add(1, 2) == 3"]}
    (tmp_path / "mbpp.jsonl").write_text(json.dumps(record) + "\n")
    path = write(tmp_path / "p.yaml", {"out": str(tmp_path / "out"), "jobs": [
        {"name": "p", "run": "prompts", "mbpp": "${RECIPE_TEST_DATA}/mbpp.jsonl"},
        {"name": "d", "run": "data", "config": TINY, "prompts": "p"}]})

    def no_command(argv):
        raise AssertionError(f"a prompts stage runs no specdec command: {argv}")

    monkeypatch.delenv("RECIPE_TEST_DATA", raising=False)
    with pytest.raises(ValueError, match=r"uses \$RECIPE_TEST_DATA, which is not set"):
        run_recipe(path, no_command, until="p", log=lambda _: None)
    monkeypatch.setenv("RECIPE_TEST_DATA", str(tmp_path))
    assert run_recipe(path, no_command, until="p", log=lambda _: None) == 0
    written = tmp_path / "out" / "prompts" / "p" / "prompts.jsonl"
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["mbpp-601"] and "def add(a, b):" in rows[0]["prompt"]
    stages = plan(load_recipe(path))
    assert [s["state"] for s in stages] == ["finished", "to run"]
    assert stages[0]["record"]["job"]["mbpp"] == "${RECIPE_TEST_DATA}/mbpp.jsonl"
    assert stages[1]["record"]["config"]["data.datasets.0.name"] == str(written)


def test_the_shipped_recipe_loads_and_its_last_stage_is_the_shipped_drafters_config(tmp_path):
    recipe = load_recipe(str(SHIPPED))
    recipe["out"] = str(tmp_path)
    stages = plan(recipe)
    assert [s["job"]["run"] for s in stages].count("train") == 9 and all(s["state"] == "to run" for s in stages)
    assert [j["name"] for j in lineage(recipe, "magpie_s31")] == [
        "mix", "self_s9", "self_s10", "self_s23", "greedy", "greedy_s27", "completion_s30", "magpie", "magpie_s31"]
    last = next(s for s in stages if s["job"]["name"] == "magpie_s31")["record"]["config"]
    shipped = yaml.safe_load((REPO / "drafters" / "trained" / "dspark_smollm2_mix" / "config.yaml").read_text())
    expected = flatten_config({k: shipped[k] for k in ("train", "drafter", "sampling", "generation", "model", "data")})
    wired = ("train.data_dir", "train.more_data", "train.init_from")  # the recipe's own paths
    compared = [k for k in expected if not k.startswith(wired)]
    assert len(compared) >= 50
    for key in compared:
        assert last[key] == expected[key], key
    mix = next(s for s in stages if s["job"]["name"] == "mix")
    assert mix["job"]["stop_at"] == 606 and mix["record"]["config"]["train.steps"] == 4000


def test_a_second_recipe_shares_the_data_and_measures_medusa_with_its_static_tree(made):
    """Medusa's tree is its `tree_paths` (the eval's `tree` is the drafter's own parameters), its node count
    checked against `nodes` before anything is decoded."""
    work, out = made["work"], made["work"] / "out"
    medusa = ["drafter.name=medusa", "train.drafter_options={num_heads: 3}", *TRAIN[:-1], "train.steps=2"]
    paths = [[0], [1], [0, 0]]
    path = write(work / "medusa.yaml", {"out": str(out), "jobs": [
        tiny_recipe(work)["jobs"][0],  # d1, as the first recipe lists it
        {"name": "tm", "run": "train", "config": TINY, "data": ["d1"], "init_from": None, "set": medusa},
        {"name": "eval_medusa", "run": "eval", "config": str(work / "eval.yaml"), "drafter": "tm", "nodes": 3,
         "tree": {"tree_paths": paths}, "untuned": ["second"]},
        {"name": "card_medusa", "run": "card", "eval": "eval_medusa"}]})
    calls, logs = Calls(), []
    assert run_recipe(path, calls, progress=False, log=logs.append) == 0
    assert calls.argv == [["train", TINY]] and any("d1 (data): finished, skipped" in line for line in logs)
    results = json.loads((out / "eval" / "eval_medusa" / RESULTS).read_text())
    assert results["drafter"]["kind"] == "medusa"
    assert results["methods"]["drafter_tree"]["shape"] == f"tree (tree_paths {paths})"
    for method in results["results"].values():
        for figures in method["sets"].values():
            assert figures["tau"] >= 1 and figures["same_as_ar"] is True
    card = (out / "train" / "tm" / "README.md").read_text()
    assert card.startswith("# medusa drafter") and f"tree_paths={paths})" in card
    cfg = load_config(str(work / "eval.yaml"), [])
    with pytest.raises(RecipeError, match=r"stage eval: drafter_tree drafts 4 nodes a round, not `nodes` \(3\)"):
        evaluate(cfg, out / "train" / "tm", nodes=3, tree={"tree_paths": [*paths, [2]]}, untuned=[], log=print)
    with pytest.raises(RecipeError, match=r"stage eval: drafter_chain \(medusa\): medusa has 3 heads"):
        evaluate(cfg, out / "train" / "tm", nodes=4, tree={"tree_paths": paths}, untuned=[], log=print)


MISMATCH = [
    ({"t1": {"set": [*TRAIN, "train.drafter_options.markov_rank=64"]}},
     r"stage t1: train.drafter_options.markov_rank: not an option of drafter 'eagle3' \(its drafter.name\); the "
     r"options of eagle3 are: taps, draft_vocab_size, ttt_steps"),
    ({"t1": {"set": [*TRAIN, "drafter.name=ngram"]}}, r"stage t1: drafter.name: drafter 'ngram' has no training task"),
    ({"t2": {"set": [*TRAIN[:-1], "drafter.name=medusa", "train.drafter_options={num_heads: 3}"]}},
     r"stage t2: `init_from` names 't1', which trains eagle3, but this stage trains medusa"),
    ({"eval": {"tree": {"tree_paths": [[0], [1], [0, 0]]}}},
     r"stage eval: `tree` sets tree_paths, which drafter 'eagle3' \(stage t2\) does not take; its parameters are: "
     r"tree_top_k, tree_depth"),
]


@pytest.mark.parametrize("changes,message", MISMATCH)
def test_a_stage_that_does_not_fit_its_drafter_is_refused_before_anything_runs(tmp_path, changes, message):
    eval_config(tmp_path)
    path = write(tmp_path / "r.yaml", tiny_recipe(tmp_path, **changes))
    with pytest.raises(RecipeError, match=message):
        run_recipe(path, Calls(), dry_run=True, log=lambda _: None)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def dspark_keys():
    return {s["job"]["name"]: s["record"]["key"] for s in plan(load_recipe(str(SHIPPED)))}


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_shipped_recipe_plans_and_measures_its_method(path, dspark_keys, capsys):
    assert cli.main(["recipe", str(path), "--dry-run"]) == 0  # every stage checked, its command printed
    assert f"[recipe] {path}" in capsys.readouterr().out
    recipe = load_recipe(str(path))
    assert recipe["out"] == load_recipe(str(SHIPPED))["out"]  # the data stages' folders are the DSpark recipe's
    stages = {s["job"]["name"]: s for s in plan(recipe)}  # reads the stages' records, writes nothing
    method = path.stem.removeprefix("smollm2_135m_")
    evals = [s for s in stages.values() if s["job"]["run"] == "eval"]
    assert evals and all(stages[s["job"]["drafter"]]["record"]["config"]["drafter.name"] == method for s in evals)
    assert {s["job"]["run"] for s in stages.values()} >= {"data", "train", "eval", "card"}
    shared = [name for name, s in stages.items() if s["job"]["run"] == "data" and name in dspark_keys]
    assert shared  # a recipe of the same target reuses the DSpark recipe's data ...
    for name in shared:  # ... as the very same stage: made once, found finished by the other recipe
        assert stages[name]["record"]["key"] == dspark_keys[name], name
