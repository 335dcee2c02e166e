"""Config-driven experiments: `specdec run` / `specdec sweep` end to end on the tiny model, resume, trackers
(memory and W&B offline), the dataset loader's layouts and errors, the task scorers, and a loud lossless
failure. Every run here shares one tiny-model shape, so the whole file compiles once."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from experiments import cli
from experiments.datasets import DatasetError, load_all, load_prompts
from experiments.lossless import LosslessError, check_greedy, two_sample_chi2
from experiments.plots import pareto_front
from experiments.quality import extract_final_number, gsm8k_correct, humaneval_passed, mbpp_passed, score_all
from experiments.run import RunInterrupted, batch_group, plan_batches, run_experiment
from experiments.store import make_record
from experiments.sweep import run_sweep
from specdec.config import DatasetConfig, ConfigError, load_config
from specdec.metrics import DecodeMetrics
from specdec.tracking import MemoryTracker

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "experiments" / "tiny.yaml"
TINY_SWEEP = ROOT / "configs" / "sweeps" / "tiny.yaml"


def tiny_cfg(tmp_path, name="run", *overrides):
    return load_config(TINY, [f"output.dir={tmp_path}", f"output.name={name}", *overrides])


def quiet(*_):
    pass


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------------ run


def test_run_end_to_end_with_memory_tracker(tmp_path):
    tracker = MemoryTracker("e2e")
    cfg = tiny_cfg(tmp_path, "e2e", "generation.batch_size=2")  # per-row records of a batch of 2
    summary = run_experiment(cfg, tracker=tracker, progress=False, echo=quiet)
    out = tmp_path / "e2e"
    for name in ("config.yaml", "summary.json", "table.md", "acceptance_by_position.png", "by_category.png",
                 "answers/autoregressive.jsonl", "answers/speculative.jsonl", "metrics/speculative.jsonl"):
        assert (out / name).is_file(), name
    assert json.loads((out / "summary.json").read_text()) == summary
    assert load_config(out / "config.yaml") == cfg

    # the summary schema
    for key in ("tau", "acceptance_rate", "tokens_per_second", "ar_tokens_per_second", "speedup",
                "acceptance_by_position", "draft_verify", "lossless", "by_category", "provenance", "seeds",
                "speculative", "autoregressive", "timing"):
        assert key in summary, key
    assert summary["status"] == "complete" and summary["prompts"] == 2
    assert summary["tau"] >= 1.0 and summary["speedup"] > 0
    acc = summary["acceptance_by_position"]
    assert {len(v) for v in acc.values()} == {4}
    assert summary["tau"] == pytest.approx(1 + sum(acc["survival"]))  # accepted counted from what was committed
    assert all(a <= e <= p for a, e, p in zip(acc["accepted"], acc["eligible"], acc["proposed"]))
    assert summary["draft_verify"]["draft_seconds"] is not None and summary["draft_verify"]["verify_seconds"] > 0
    assert summary["lossless"]["kind"] == "greedy" and summary["lossless"]["passed"] is True
    assert summary["lossless"]["prompts_checked"] == 2
    prov = summary["provenance"]
    assert {"git", "versions", "machine"} <= set(prov) and prov["versions"]["jax"]
    assert summary["quality"] is None  # built-in prompts have no scorer

    # Spec-Bench-compatible records, consistent with the metrics
    for method in ("autoregressive", "speculative"):
        records = read_jsonl(out / "answers" / f"{method}.jsonl")
        assert len(records) == 2
        for r in records:
            c = r["choices"][0]
            assert {"question_id", "category", "answer_id", "model_id", "choices"} <= set(r)
            assert c["new_tokens"][0] == len(r["token_ids"]) and c["wall_time"][0] > 0 and c["turns"][0] is not None
            assert len(c["accept_lengths"]) == c["decoding_steps"][0]
            assert sum(c["accept_lengths"]) == c["new_tokens"][0] - 1
    spec = read_jsonl(out / "answers" / "speculative.jsonl")
    assert sum(len(r["choices"][0]["accept_lengths"]) for r in spec) == summary["speculative"]["rounds"]

    # everything reached the tracker
    assert tracker.config["model"]["name"] == "tiny" and "provenance" in tracker.config
    assert tracker.summary["tau"] == summary["tau"]
    assert set(tracker.images) == {"acceptance_by_position", "by_category"}
    assert len(tracker.tables["records"][1]) == 4 and "by_category" in tracker.tables
    assert any("speculative/tokens_per_second" in m for _, m in tracker.metrics)


def test_verify_buckets_reach_the_engine(tmp_path, monkeypatch):
    """`verify.buckets` from the config is what the engine runs with (timed run, profiling pass and check)."""
    import specdec.engine

    seen = []
    real = specdec.engine.speculative_generate

    def spy(*args, **kwargs):
        seen.append(kwargs.get("verify_buckets"))
        return real(*args, **kwargs)

    monkeypatch.setattr(specdec.engine, "speculative_generate", spy)
    summary = run_experiment(tiny_cfg(tmp_path, "buckets", "verify.buckets=[0, 1]", "drafter.name=ngram",
                                      "drafter.params={}"),
                             progress=False, echo=quiet)
    assert seen and all(b == (0, 1) for b in seen), seen
    assert summary["lossless"]["passed"]


def test_effective_policy_takes_the_verify_options_and_the_tree_counterpart():
    """`verify.eps` / `verify.delta` become the typical policy's options (no longer refused); a chain policy on
    a tree drafter runs as its tree counterpart, with a note."""
    from types import SimpleNamespace

    from experiments.build import effective_policy
    from specdec.config import VerifyConfig
    from specdec.verify import get_policy

    chain, tree = SimpleNamespace(kind="chain", name="ngram"), SimpleNamespace(kind="tree", name="suffix")
    policy, note = effective_policy(VerifyConfig(policy="typical", eps=0.05, delta=0.2), chain)
    assert policy == get_policy("typical", epsilon=0.05, delta=0.2) and note is None
    assert effective_policy(VerifyConfig(policy="rejection_chain", eps=0.05), chain) == (
        get_policy("rejection_chain"), None)
    policy, note = effective_policy(VerifyConfig(policy="greedy_chain"), tree)
    assert policy == get_policy("greedy_tree") and "runs as greedy_tree" in note


def test_rerun_of_a_finished_run_is_skipped_and_a_changed_config_refused(tmp_path):
    cfg = tiny_cfg(tmp_path, "done", "data.datasets.0.limit=1")
    first = run_experiment(cfg, progress=False, echo=quiet)
    said = []
    assert run_experiment(cfg, progress=False, echo=said.append) == first
    assert "already complete" in said[0]
    with pytest.raises(ValueError, match="different config"):
        run_experiment(tiny_cfg(tmp_path, "done", "generation.max_new_tokens=8"), progress=False, echo=quiet)


def test_interrupted_run_resumes_without_redoing_recorded_prompts(tmp_path):
    cfg = tiny_cfg(tmp_path, "resume")
    out = tmp_path / "resume"
    with pytest.raises(RunInterrupted):
        run_experiment(cfg, progress=False, echo=quiet, max_batches=1)  # "killed" after one batch
    assert not (out / "summary.json").exists()
    assert len(read_jsonl(out / "answers" / "autoregressive.jsonl")) == 1
    with (out / "answers" / "autoregressive.jsonl").open("a") as f:
        f.write('{"question_id": 1, "categ')  # a write cut short by the kill
    summary = run_experiment(cfg, progress=False, echo=quiet)
    assert summary["records"]["autoregressive"] == {"prompts": 2, "reused_from_earlier_invocation": 1}
    assert summary["records"]["speculative"] == {"prompts": 2, "reused_from_earlier_invocation": 0}
    records = read_jsonl(out / "answers" / "autoregressive.jsonl")  # the torn line is gone, nothing duplicated
    assert sorted(r["question_id"] for r in records) == [0, 1]
    assert summary["lossless"]["passed"] is True


def test_broken_engine_output_fails_the_lossless_check_loudly(tmp_path, monkeypatch):
    import specdec.engine

    real = specdec.engine.speculative_generate

    def lossy(*args, **kwargs):
        out = real(*args, **kwargs)
        out.tokens = [t[:-1] + [(t[-1] + 1) % 256] for t in out.tokens]  # corrupt the last token of every row
        return out

    monkeypatch.setattr(specdec.engine, "speculative_generate", lossy)
    with pytest.raises(LosslessError, match="LOSSLESS CHECK FAILED"):
        run_experiment(tiny_cfg(tmp_path, "lossy"), progress=False, echo=quiet)
    out = tmp_path / "lossy"
    assert not (out / "summary.json").exists()  # not "complete": a rerun repeats the check
    failed = json.loads((out / "summary.failed.json").read_text())
    assert failed["lossless"]["passed"] is False and failed["status"].startswith("failed")
    assert failed["lossless"]["mismatches"][0]["position"] == 15


def test_check_greedy_and_chi_square():
    ok = check_greedy({"a": [1, 2, 3]}, {"a": [1, 2, 3]}, ["a"])
    assert ok.passed and "token for token" in ok.describe()
    bad = check_greedy({"a": [1, 2, 3], "b": [4]}, {"a": [1, 2, 9], "b": [4]}, ["a", "b"])
    assert bad.passed is False and bad.mismatches == [
        {"key": "a", "position": 2, "ar": 3, "spec": 9, "ar_len": 3, "spec_len": 3}]
    with pytest.raises(LosslessError, match="1 of 2 prompts differ"):
        bad.raise_if_failed()
    import random

    rng = random.Random(0)
    a = rng.choices(range(6), weights=[5, 4, 3, 2, 1, 1], k=2000)
    b = rng.choices(range(6), weights=[5, 4, 3, 2, 1, 1], k=2000)
    c = rng.choices(range(6), weights=[1, 1, 2, 3, 4, 5], k=2000)
    assert two_sample_chi2(a, b)["p_value"] > 1e-3
    assert two_sample_chi2(a, c)["p_value"] < 1e-12
    assert two_sample_chi2([1] * 50, [1] * 50)["p_value"] == 1.0  # one cell: nothing to distinguish


def test_sampled_check_flags_a_shifted_distribution(monkeypatch):
    """check_sampled's statistics and wiring, with stand-in decoders (the engine's exact distributional
    tests live in test_lossless_policies.py; compiling a 128-row sampled run here would cost a minute)."""
    import random
    import types

    import specdec.engine
    import specdec.generate
    from experiments.lossless import check_sampled

    def fake(weights):
        def decode(*args, seed=0, **kwargs):  # (target, batch, ...) or (target, drafter, batch, ...)
            batch = next(a for a in args if isinstance(a, list))
            batches.append(len(batch))
            rng = random.Random(seed)
            rows = [[7] + rng.choices(range(5), weights=weights, k=2) for _ in batch]
            return types.SimpleNamespace(tokens=rows)
        return decode

    batches = []
    monkeypatch.setattr(specdec.generate, "generate", fake([5, 3, 1, 1, 0.5]))
    monkeypatch.setattr(specdec.engine, "speculative_generate", fake([5, 3, 1, 1, 0.5]))
    ok = check_sampled(None, None, {"p": [1, 2], "q": [3]}, policy="rejection_chain", sampling=None, rows=400)
    assert ok.passed and ok.kind == "sampled" and ok.prompts_checked == 2 and len(ok.tests) == 4
    assert all(t["cells"] == 5 for t in ok.tests) and "consistent with" in ok.describe()
    # 400 rows per prompt and decoder, drawn in batches of at most 32 (the check's memory is a 32-row batch's)
    assert all(t["n_ar"] == t["n_spec"] == 400 for t in ok.tests) and max(batches) == 32 and sum(batches) == 1600
    monkeypatch.setattr(specdec.engine, "speculative_generate", fake([1, 1, 1, 3, 5]))
    bad = check_sampled(None, None, {"p": [1, 2]}, policy="rejection_chain", sampling=None, rows=400)
    assert bad.passed is False and "DIFFERS" in bad.describe()
    with pytest.raises(LosslessError):
        bad.raise_if_failed()


def test_per_row_records_and_batch_plan():
    """A batch-of-2 record: the row's own accept lengths in round order, its own steps, and its share of the
    batch's decode time (3 of the batch's 4 loop iterations)."""
    m = DecodeMetrics(new_tokens=13, rounds=7, accepted_draft_tokens=4, proposed_draft_tokens=20,
                      prefill_seconds=1.0, decode_seconds=8.0, batch_size=2)
    prompt = load_prompts(DatasetConfig("quickstart"))[0]
    r = make_record("speculative", "m", prompt, [7] * 6, "t", m, 2, 0, 3, [3, 1, 1], 4)
    c = r["choices"][0]
    assert c["accept_lengths"] == [3, 1, 1] and c["decoding_steps"] == [3]
    assert c["wall_time"] == [1.0 + 8.0 * 3 / 4] and r["batch_wall_time"] == 9.0
    prompts = load_prompts(DatasetConfig("quickstart")) + load_prompts(DatasetConfig("quickstart", category="x"))
    prompts[8:] = [dataclasses.replace(p, dataset="other") for p in prompts[8:]]
    batches = plan_batches(prompts, 3)
    assert all(len({p.dataset for p in b}) == 1 and len(b) <= 3 for b in batches)  # never mixes datasets
    assert sorted(p.key for b in batches for p in b) == sorted(p.key for p in prompts)
    assert [batch_group(b) for b in batches] == ["quickstart (mixed)", "quickstart (mixed)", "quickstart (mixed)",
                                                 "x", "x", "x"]
    assert [batch_group(b) for b in plan_batches(prompts[:8], 1)] == [p.category for p in prompts[:8]]


def test_cli_run_and_bad_input(tmp_path, capsys):
    assert cli.main(["run", str(TINY), f"output.dir={tmp_path}", "data.datasets.0.limit=1", "--no-progress"]) == 0
    assert (tmp_path / "tiny" / "summary.json").is_file()  # output.name defaults to the config's stem
    assert "| autoregressive |" in capsys.readouterr().out
    assert cli.main(["run", str(TINY), "generation.batch_sise=2"]) == 2
    assert "did you mean 'batch_size'" in capsys.readouterr().err
    assert cli.main(["run", str(TINY), f"output.dir={tmp_path}", "output.name=x", "scheduler.kind=prefix"]) == 2
    assert "scheduler.kind" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ sweep


def test_tiny_sweep_end_to_end_and_resume(tmp_path, monkeypatch):
    import experiments.sweep

    trackers, released = [], []
    monkeypatch.setattr(experiments.sweep, "release_memory", lambda: released.append(len(trackers)))

    def factory(name, cfg):
        trackers.append(MemoryTracker(name, cfg.tracking.group))
        return trackers[-1]

    report = run_sweep(TINY_SWEEP, [f"output.dir={tmp_path}"], progress=False, tracker_factory=factory, echo=quiet)
    sweep_dir = tmp_path / "tiny"
    names = ["num_draft_tokens=2", "num_draft_tokens=4"]
    for name in names:
        assert (sweep_dir / name / "summary.json").is_file()
    for name in ("report.md", "report.json", "tau_vs_throughput.png", "acceptance_by_position.png",
                 "speedup_by_category.png"):
        assert (sweep_dir / name).is_file(), name
    text = (sweep_dir / "report.md").read_text()
    assert "## Headline" in text and "num_draft_tokens=4" in text and "pass (greedy)" in text
    assert {t.group for t in trackers} == {"tiny"} and trackers[-1].name == "tiny-report"
    assert all(t.finished for t in trackers)
    assert "tau_vs_throughput" in trackers[-1].images and report["pareto_front"]
    s2 = report["summaries"][names[1]]
    assert s2["baseline_source"] == names[0]  # AR measured once, shared by the second run
    assert s2["num_draft_tokens"] == 4 and report["summaries"][names[0]]["num_draft_tokens"] == 2
    assert released == [1, 2]  # after each run, once its tracker finished (the sweep process must not grow)

    said = []
    run_sweep(TINY_SWEEP, [f"output.dir={tmp_path}"], progress=False, tracker_factory=factory, echo=said.append,
              only=["*=4"])
    assert sum("finished earlier, skipped" in s for s in said) == 2
    assert trackers[-1].name == "tiny-report" and len(trackers) == 4  # only the report tracker was new
    with pytest.raises(ValueError, match="matches none of the runs"):
        run_sweep(TINY_SWEEP, [f"output.dir={tmp_path}"], only=["nope*"], echo=quiet)


def test_codecs_apply_the_chat_template_when_the_tokenizer_has_one():
    from experiments.build import TokenizerCodec
    from specdec.models.tokenizer import ByteCodec

    class Tok:
        chat_template = "<chatml>"

        def encode(self, text):
            return [ord(c) for c in text]

        def encode_chat(self, text):
            return [0] + self.encode(text) + [1]

        def encode_messages(self, messages):
            return [0] + [i for m in messages for i in self.encode(m["role"][0] + m["content"])] + [1]

        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    codec = TokenizerCodec(Tok())
    assert codec.chat_template == "<chatml>"
    assert codec.encode("ab", chat=True) == [0, 97, 98, 1] and codec.encode("ab") == [97, 98]
    assert ByteCodec().chat_template is None and ByteCodec().encode("hé") == [104, 195, 169]
    assert ByteCodec().decode([2, 104, 195, 169]) == "hé"
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert codec.encode_messages(chat, chat=True) == [0, ord("s"), ord("s"), ord("u"), ord("u"), 1]
    # no template (or chat off): the turns' texts, blank-line separated
    assert codec.encode_messages(chat) == [ord("s"), 10, 10, ord("u")]
    assert ByteCodec().encode_messages(chat, chat=True) == [ord("s"), 10, 10, ord("u")]


def test_pareto_front():
    pts = [(1.0, 10.0), (2.0, 8.0), (1.5, 7.0), (3.0, 5.0), (0.5, 11.0), (float("nan"), 20.0)]
    assert pareto_front(pts) == [4, 0, 1, 3]


# ------------------------------------------------------------------------------------------------ datasets


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_completion_prompts_are_humaneval_shaped_stubs(tmp_path):
    """experiments.completion_prompts: an MBPP solution becomes its imports, signature and a docstring with the
    asserts as doctests, wrapped in the evaluation's own instruction; the MBPP test split is left out; an
    instruction / response record gives the first function of its code block; bad records are named."""
    from experiments import completion_prompts as C
    from experiments.datasets import HUMANEVAL_INSTRUCTION

    mbpp = [{"task_id": 2, "text": "Write a function to add   two numbers.", "test_list": [
                "assert add_two(1, 2) == 3", "assert add_two(0, 0)==0", "assert not add_two(0, 0)"],
             "code": ("import math\r\ndef helper(x):\r\n\treturn x\r\n"
                      "def add_two(a: int, b=1) -> int:\r\n\treturn a + b")},
            {"task_id": 11, "text": "test split", "test_list": ["assert f(1) == 1"], "code": "def f(x):\n    return x"},
            {"task_id": 3, "text": "does not parse", "test_list": ["assert g(1) == 1"], "code": "def g(x) return"}]
    (tmp_path / "mbpp.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mbpp))
    teacher = [{"instruction": "Reverse a string.", "input": "",
                "response": "Sure:\n```python\ndef rev(s):\n    return s[::-1]\n```\nprint(rev('ab'))"},
               {"instruction": "No Python here.", "input": "", "response": "console.log(1)"}]
    (tmp_path / "teacher.json").write_text(json.dumps(teacher))
    out = tmp_path / "out" / "prompts.jsonl"
    assert C.main(["--mbpp", str(tmp_path / "mbpp.jsonl"), "--gpteacher", str(tmp_path / "teacher.json"),
                   "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["source"]) for r in records] == [("mbpp-2", "mbpp_completion"),
                                                         ("gpteacher_completion-0", "gpteacher_completion")]
    body = ('import math\n\n\ndef add_two(a: int, b=1) -> int:\n    """ Write a function to add two numbers.\n'
            '    >>> add_two(1, 2)\n    3\n    >>> add_two(0, 0)\n    0\n    """\n')
    assert records[0]["prompt"] == HUMANEVAL_INSTRUCTION.format(prompt=body)
    compile(body + "    pass\n", "stub", "exec")  # the stub is the start of a valid function
    assert 'def rev(s):\n    """ Reverse a string.\n    """\n```' in records[1]["prompt"]
    assert len(C.mbpp_prompts(tmp_path / "mbpp.jsonl", keep_test=True)) == 2
    (tmp_path / "bad.jsonl").write_text(json.dumps({"task_id": 1, "text": "no code"}) + "\n")
    needs = r"bad.jsonl record 0: an MBPP record needs \['code', 'test_list'\]"
    with pytest.raises(C.CompletionPromptError, match=needs):
        C.mbpp_prompts(tmp_path / "bad.jsonl")
    (tmp_path / "bad.json").write_text(json.dumps([{"prompt": "x"}]))
    with pytest.raises(C.CompletionPromptError, match="bad.json record 0: needs 'instruction' and 'response'"):
        C.instruction_prompts(tmp_path / "bad.json", "x")


def test_dataset_layouts(tmp_path):
    mt = write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
        {"question_id": 82, "category": "writing", "turns": ["Write an email."]},
        {"question_id": 91, "category": "roleplay", "turns": ["Pretend to be a cat."], "reference": ["meow"]}])
    items = load_prompts(DatasetConfig(mt))
    assert [(p.key, p.category, p.text, p.layout) for p in items] == [
        ("mt_bench/81", "writing", "Write a poem.", "mt_bench"),
        ("mt_bench/82", "writing", "Write an email.", "mt_bench"),
        ("mt_bench/91", "roleplay", "Pretend to be a cat.", "mt_bench")]
    assert items[2].reference == ["meow"]
    assert [p.question_id for p in load_prompts(DatasetConfig(mt, per_category=1))] == [81, 91]
    assert len(load_prompts(DatasetConfig(mt, limit=2))) == 2
    sampled = [p.question_id for p in load_prompts(DatasetConfig(mt, sample_seed=0))]
    assert sorted(sampled) == [81, 82, 91] and sampled == [91, 81, 82]  # permutation [2, 0, 1] of seed 0
    assert [p.question_id for p in load_prompts(DatasetConfig(mt, sample_seed=0, skip=1))] == [81, 82]
    with pytest.raises(ConfigError, match="skip"):
        DatasetConfig(mt, skip=-1)
    assert [p.question_id for p in load_prompts(DatasetConfig(mt, skip=2))] == [91]  # file order: the last one
    with pytest.raises(DatasetError, match=r"question.jsonl: skip 3 leaves no records \(there are 3\)"):
        load_prompts(DatasetConfig(mt, skip=3))
    # MBPP: skip counts within the split (test = task ids 11-510), so it takes the test prompts after the first N
    mbpp = write_jsonl(tmp_path / "mbpp.jsonl", [{"task_id": i, "text": f"task {i}", "test_list": [f"assert f({i})"]}
                                                 for i in (5, 11, 12, 13, 600)])
    assert [p.question_id for p in load_prompts(DatasetConfig(mbpp, skip=1, limit=1))] == [12]
    with pytest.raises(DatasetError, match=r"MBPP test split, task ids 11-510\): skip 3 leaves no records"):
        load_prompts(DatasetConfig(mbpp, skip=3))
    tagged = write_jsonl(tmp_path / "tagged.jsonl", [{"source": src, "prompt": f"p{i}"}
                                                     for i, src in enumerate(["code", "chat", "code", "math"])])
    assert [p.text for p in load_prompts(DatasetConfig(tagged, sources=("code", "math"), limit=2))] == ["p0", "p2"]
    with pytest.raises(DatasetError, match=r"no records of the sources \['poetry'\].*\['chat', 'code', 'math'\]"):
        load_prompts(DatasetConfig(tagged, sources=("poetry",)))
    with pytest.raises(ConfigError, match="sources"):
        DatasetConfig(tagged, sources=("",))

    gsm = write_jsonl(tmp_path / "test.jsonl", [{"question": "2+2?", "answer": "It is 4.\n#### 4"},
                                                 {"question": "How many?", "answer": "Lots.\n#### 1,234"}])
    items = load_prompts(DatasetConfig(gsm))
    assert [(p.key, p.category, p.text, p.reference) for p in items] == [
        ("gsm8k/0", "math", "2+2?", "4"), ("gsm8k/1", "math", "How many?", "1234")]

    he = write_jsonl(tmp_path / "HumanEval.jsonl", [{"task_id": "HumanEval/0", "prompt": "def f():\n", "test": "t",
                                                      "entry_point": "f", "canonical_solution": "x"}])
    raw, chat = load_prompts(DatasetConfig(he), chat=False)[0], load_prompts(DatasetConfig(he), chat=True)[0]
    assert raw.text == "def f():\n" and "def f():\n" in chat.text and chat.text.startswith("Complete")
    assert raw.reference == {"prompt": "def f():\n", "test": "t", "entry_point": "f"} and raw.category == "code"

    mbpp = write_jsonl(tmp_path / "mbpp.jsonl", [
        {"task_id": tid, "text": f"Task {tid}.", "code": "", "test_list": [f"assert f({tid}) == {tid}"],
         "test_setup_code": ""} for tid in (5, 11, 510, 600, 700)])
    assert [p.question_id for p in load_prompts(DatasetConfig(mbpp))] == [11, 510]  # test split by default
    assert [p.question_id for p in load_prompts(DatasetConfig(mbpp, split="train"))] == [700]
    first = load_prompts(DatasetConfig(mbpp))[0]
    assert "assert f(11) == 11" in first.text and first.reference["test_list"] == ["assert f(11) == 11"]
    with pytest.raises(DatasetError, match="unknown MBPP split"):
        load_prompts(DatasetConfig(mbpp, split="dev"))


def test_generic_files_fields_and_sources(tmp_path, monkeypatch):
    path = tmp_path / "roles.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerows([["act", "prompt"], ["Poet", "Write verse."], ["Chef", "Cook."]])
    items = load_prompts(DatasetConfig(str(path), category="roleplay"))
    assert [(p.key, p.category, p.text) for p in items] == [("roles/0", "roleplay", "Write verse."),
                                                            ("roles/1", "roleplay", "Cook.")]
    assert [p.text for p in load_prompts(DatasetConfig(str(path), field="act"))] == ["Poet", "Chef"]
    with pytest.raises(DatasetError, match="field 'nope' not found"):
        load_prompts(DatasetConfig(str(path), field="nope"))

    js = tmp_path / "instr.json"
    js.write_text(json.dumps([{"instruction": "Translate.", "input": "Hallo", "response": "Hello"},
                              {"instruction": "Say hi.", "input": "", "response": "hi"}]))
    assert [p.text for p in load_prompts(DatasetConfig(str(js)))] == ["Translate.\n\nHallo", "Say hi."]
    split = tmp_path / "splits.json"
    split.write_text(json.dumps({"test": [{"prompt": "a"}], "train": [{"prompt": "b"}]}))
    assert load_prompts(DatasetConfig(str(split), split="train"))[0].text == "b"
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"foo": 1}])
    with pytest.raises(DatasetError, match="set `field`"):
        load_prompts(DatasetConfig(odd))

    monkeypatch.setenv("MY_DATA", str(tmp_path))
    assert len(load_prompts(DatasetConfig("${MY_DATA}/roles.csv"))) == 2
    monkeypatch.delenv("MY_DATA")
    with pytest.raises(DatasetError, match=r"uses \$MY_DATA, which is not set"):
        load_prompts(DatasetConfig("${MY_DATA}/roles.csv"))
    with pytest.raises(DatasetError, match="dataset file not found"):
        load_prompts(DatasetConfig(str(tmp_path / "missing.jsonl")))
    assert len(load_prompts(DatasetConfig("quickstart", limit=3))) == 3

    both = load_all([DatasetConfig(str(path)), DatasetConfig(str(path))])  # same file twice: distinct keys
    assert len({p.key for p in both}) == 4


def test_chat_layouts_messages_and_sharegpt_conversations(tmp_path):
    messages = write_jsonl(tmp_path / "chats.jsonl", [
        {"id": "a", "category": "advice", "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Tips?"},
            {"role": "assistant", "content": "Sleep."}]},
        {"id": "b", "messages": [{"role": "user", "content": "One turn"}]}])
    a, b = load_prompts(DatasetConfig(messages))
    assert (a.key, a.layout, a.category, a.text, a.reference) == ("chat/a", "chat", "advice", "Tips?", "Sleep.")
    # the conversation up to its last user turn, the system message kept; the answer after it is the reference
    assert a.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Tips?"}]
    assert b.messages == [{"role": "user", "content": "One turn"}] and b.reference is None and b.category == "chat"

    sharegpt = write_jsonl(tmp_path / "sharegpt.jsonl", [{"id": "s1", "conversations": [
        {"from": "system", "value": "Be kind."}, {"from": "human", "value": "Hey"},
        {"from": "gpt", "value": "Hi!"}]}])
    (s1,) = load_prompts(DatasetConfig(sharegpt))
    assert s1.messages == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hey"}]
    assert (s1.text, s1.reference, s1.layout) == ("Hey", "Hi!", "chat")

    from experiments.build import encode_prompt
    from specdec.models.tokenizer import ByteCodec

    assert ByteCodec().decode(encode_prompt(ByteCodec(), s1, chat=False)) == "Be kind.\n\nHey"

    bad = {"no user": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "x"}],
           "has role 'robot'": [{"role": "robot", "content": "x"}],
           "has from 'bot'": [{"from": "bot", "value": "x"}],
           "message 1 is a str": [{"role": "user", "content": "x"}, "oops"],
           "has no text 'content'": [{"role": "user", "content": None}]}
    for i, (problem, conversation) in enumerate(bad.items()):
        path = write_jsonl(tmp_path / f"bad{i}.jsonl", [{"id": 1, "messages": conversation}])
        with pytest.raises(DatasetError, match=problem):
            load_prompts(DatasetConfig(path))


def mt_bench_file(tmp_path, turns=("Write a poem.", "Shorter.")):
    return write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": [f"{t} (81)" for t in turns]},
        {"question_id": 82, "category": "writing", "turns": [f"{t} (82)" for t in turns]},
        {"question_id": 91, "category": "roleplay", "turns": [f"{t} (91)" for t in turns]}])


def test_multi_turn_mt_bench_prompts(tmp_path):
    from experiments.datasets import fill_own_answers

    mt = mt_bench_file(tmp_path, ("One.", "Two.", "Three."))
    items = load_prompts(DatasetConfig(mt, turns=3, limit=2))  # limit counts questions, each gives 3 prompts
    assert [p.key for p in items] == ["mt_bench/81", "mt_bench/81/turn2", "mt_bench/81/turn3",
                                      "mt_bench/82", "mt_bench/82/turn2", "mt_bench/82/turn3"]
    first, second, third = items[:3]
    assert first.messages is None and first.text == "One. (81)"
    assert second.text == "Two. (81)" and second.category == "writing"
    assert second.messages == [{"role": "user", "content": "One. (81)"}, {"role": "assistant", "content": None},
                               {"role": "user", "content": "Two. (81)"}]

    asked = []

    def answer(conversations):  # a stand-in for the target: names what it was asked
        asked.append(conversations)
        return [f"A{len(c)}:" + c[-1]["content"] for c in conversations]

    assert fill_own_answers(items, answer) == 4  # 2 questions x (the first turn, the first two turns)
    assert asked[0] == [[{"role": "user", "content": "One. (81)"}], [{"role": "user", "content": "One. (82)"}]]
    assert third.messages == [{"role": "user", "content": "One. (81)"},
                              {"role": "assistant", "content": "A1:One. (81)"},
                              {"role": "user", "content": "Two. (81)"},
                              {"role": "assistant", "content": "A3:Two. (81)"},
                              {"role": "user", "content": "Three. (81)"}]
    assert second.messages[1] == third.messages[1]  # one answer to one conversation
    assert fill_own_answers(items, answer) == 0 and len(asked) == 2  # nothing left to answer

    assert [p.key for p in load_prompts(DatasetConfig(mt, turns=2, per_category=1))] == [
        "mt_bench/81", "mt_bench/81/turn2", "mt_bench/91", "mt_bench/91/turn2"]
    with pytest.raises(DatasetError, match=r"record 81 has 3 turn\(s\); `turns: 4` needs 4"):
        load_prompts(DatasetConfig(mt, turns=4))
    gsm = write_jsonl(tmp_path / "test.jsonl", [{"question": "2+2?", "answer": "#### 4"}])
    with pytest.raises(DatasetError, match="`turns: 2` needs MT-Bench-style records .* 'gsm8k'"):
        load_prompts(DatasetConfig(gsm, turns=2))
    with pytest.raises(ConfigError, match="data.datasets.0.turns"):
        load_config({}, ["data.datasets.0.turns=0"])


def test_multi_turn_run_asks_turn_two_after_the_targets_own_answer(tmp_path):
    """Spec-Bench's MT-Bench on the tiny model: turn 2 is [user 1, the target's greedy AR answer, user 2]."""
    from experiments.build import build_target
    from specdec.models.tokenizer import ByteCodec
    from specdec.generate import generate
    from specdec.sampling import GREEDY

    mt = mt_bench_file(tmp_path)
    cfg = tiny_cfg(tmp_path, "mt2", f"data.datasets=[{{name: {mt}, turns: 2, limit: 2}}]", "generation.batch_size=2")
    summary = run_experiment(cfg, progress=False, echo=quiet)
    assert summary["prompts"] == 4 and summary["lossless"]["passed"]
    own = json.loads((tmp_path / "mt2" / "own_answers.json").read_text())
    target, codec = build_target(cfg.model), ByteCodec()
    expected = {}
    for qid in (81, 82):
        user1 = f"Write a poem. ({qid})"
        tokens = generate(target, [codec.encode(user1)], cfg.generation.max_new_tokens, GREEDY).tokens[0]
        expected[json.dumps([{"role": "user", "content": user1}])] = codec.decode(tokens).strip()
    assert own == expected and all(own.values())
    ar = {r["question_id"]: r for r in read_jsonl(tmp_path / "mt2" / "answers" / "autoregressive.jsonl")}
    assert set(ar) == {81, 82, "81/turn2", "82/turn2"}
    for qid in (81, 82):
        answer1 = expected[json.dumps([{"role": "user", "content": f"Write a poem. ({qid})"}])]
        turn2 = codec.encode(f"Write a poem. ({qid})\n\n{answer1}\n\nShorter. ({qid})")
        assert ar[f"{qid}/turn2"]["prompt_tokens"] == len(turn2)
        assert ar[qid]["prompt_tokens"] == len(codec.encode(f"Write a poem. ({qid})"))
        assert ar[qid]["choices"][0]["turns"][0].strip() == answer1  # the run's own greedy turn-1 answer


def test_resumed_multi_turn_run_reuses_its_own_answers(tmp_path):
    """An interrupted multi-turn run resumes with the earlier-turn answers of own_answers.json, never new ones: the
    conversations of its later turns stay the ones it started with (here marked, to see which were used)."""
    from specdec.models.tokenizer import ByteCodec

    mt = mt_bench_file(tmp_path)
    cfg = tiny_cfg(tmp_path, "mt2", f"data.datasets=[{{name: {mt}, turns: 2, limit: 2}}]", "generation.batch_size=1")
    with pytest.raises(RunInterrupted):
        run_experiment(cfg, progress=False, echo=quiet, max_batches=1)
    store = tmp_path / "mt2" / "own_answers.json"
    first = {r["question_id"] for r in read_jsonl(tmp_path / "mt2" / "answers" / "autoregressive.jsonl")}
    marked = {c: f"A KEPT ANSWER ({json.loads(c)[0]['content']})" for c in json.loads(store.read_text())}
    store.write_text(json.dumps(marked))
    said = []
    summary = run_experiment(cfg, progress=False, echo=said.append)
    assert summary["prompts"] == 4 and not [m for m in said if "answering" in m]  # nothing answered again
    assert json.loads(store.read_text()) == marked
    codec = ByteCodec()
    ar = {r["question_id"]: r for r in read_jsonl(tmp_path / "mt2" / "answers" / "autoregressive.jsonl")}
    resumed_turn2 = [q for q in (81, 82) if f"{q}/turn2" not in first]
    assert resumed_turn2, "the interruption should leave a second turn to decode"
    for qid in resumed_turn2:
        user1 = f"Write a poem. ({qid})"
        turn2 = codec.encode(f"{user1}\n\nA KEPT ANSWER ({user1})\n\nShorter. ({qid})")
        assert ar[f"{qid}/turn2"]["prompt_tokens"] == len(turn2)


def test_hub_name_offline_gives_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DatasetError) as e:
        load_prompts(DatasetConfig("openai/gsm8k:main", split="test"))
    msg = str(e.value)
    assert "'openai/gsm8k:main'" in msg and "hub access is unavailable" in msg and "local .jsonl" in msg


def test_dataset_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="data.datasets.0.per_category"):
        load_config({}, ["data.datasets.0.per_category=0"])


# ------------------------------------------------------------------------------------------------ scorers

HE_REF = {"prompt": "from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    \"\"\"Sum of xs.\"\"\"\n",
          "test": "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n",
          "entry_point": "total"}


def test_humaneval_scorer_executes_the_tests():
    right = "Here you go:\n```python\ndef total(xs: List[int]) -> int:\n    return sum(xs)\n```\nDone."
    assert humaneval_passed(right, HE_REF) == (True, "")
    assert humaneval_passed("    return sum(xs)\n", HE_REF)[0]  # completion-style continuation of the prompt
    wrong = "```python\ndef total(xs):\n    return len(xs)\n```"
    passed, err = humaneval_passed(wrong, HE_REF)
    assert not passed and "AssertionError" in err
    assert not humaneval_passed("```python\ndef total(xs):\n    while True:\n        pass\n```", HE_REF, timeout=2)[0]
    assert not humaneval_passed("I cannot do that.", HE_REF)[0]
    assert mbpp_passed("```python\ndef f(x):\n    return x\n```", {"test_list": ["assert f(3) == 3"]})[0]
    assert not mbpp_passed("def f(x):\n    return -x\n", {"test_list": ["assert f(3) == 3"]})[0]


def test_gsm8k_scorer_and_quality_table():
    assert extract_final_number("She makes 9 * 2 = $18 every day.") == "18"
    assert extract_final_number("#### 1,234") == "1234" and extract_final_number("no numbers") is None
    assert gsm8k_correct("So the answer is 18.", "18") and not gsm8k_correct("It is 17", "18")
    assert gsm8k_correct("Total: 7.0", "7")
    from experiments.datasets import Prompt

    prompts = [Prompt("gsm8k", 0, "math", "q", "18", "gsm8k"), Prompt("gsm8k", 1, "math", "q", "5", "gsm8k")]
    texts = {"autoregressive": {"gsm8k/0": "18", "gsm8k/1": "4"}, "speculative": {"gsm8k/0": "18", "gsm8k/1": "4"}}
    q = score_all(prompts, texts)["gsm8k"]
    assert q["metric"] == "accuracy" and q["autoregressive"] == q["speculative"] == 0.5 and q["identical"]


def test_compare_rows_with_and_without_verify_buckets():
    """The quickstart's comparison: the same drafter with the engine's narrow verify steps is its own row, and
    both equal AR token for token."""
    from experiments.compare import DrafterSpec, compare, table
    from specdec.testing import peaky_target

    target = peaky_target(1)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12]]
    rows = compare(target, prompts, [DrafterSpec("ngram", 4, {"max_ngram": 2}),
                                     DrafterSpec("ngram", 4, {"max_ngram": 2}, buckets="auto")], max_new_tokens=12)
    assert [r.method for r in rows] == ["autoregressive", "ngram(k=4,max_ngram=2)",
                                        "ngram(k=4,max_ngram=2,buckets=auto)"]
    assert all(r.matches_ar for r in rows) and rows[1].outputs == rows[2].outputs
    assert "buckets=auto" in table(rows)


def test_compare_warms_up_once_per_compiled_shape(monkeypatch):
    """`compare` warms up only the first batch of each compiled shape (padded prompt width, batch size, cache
    capacity): later batches of that shape run programs already compiled. A negative control: a prompt of a new
    padded width is warmed up again."""
    from experiments import compare as cmp
    from specdec.generate import PROMPT_BUCKET
    from specdec.testing import peaky_target

    short, other_short, long_ = [5, 6, 7, 5], [9, 10, 11], list(range(3, 3 + PROMPT_BUCKET + 2))
    assert cmp.first_of_shape([[short], [other_short], [long_], [short]], 12) == [True, False, True, False]
    assert cmp.first_of_shape([[short, long_], [short]], 12) == [True, True]  # batch size is part of the shape

    seen = []
    real = cmp.speculative_generate
    monkeypatch.setattr(cmp, "speculative_generate", lambda *a, **k: seen.append(k["warmup"]) or real(*a, **k))
    rows = cmp.compare(peaky_target(1), [short, other_short, long_], [cmp.DrafterSpec("ngram", 4, {"max_ngram": 2})],
                       max_new_tokens=12)
    assert seen == [True, False, True] and all(r.matches_ar for r in rows)


def test_cli_keeps_compiled_programs_in_the_specdec_cache(monkeypatch, tmp_path):
    """The CLI points JAX's persistent compilation cache at $SPECDEC_CACHE/xla, unless JAX already has one (no
    program is compiled while the test has it set)."""
    import jax

    from experiments import cli

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        cli._persistent_compilation_cache()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
        jax.config.update("jax_compilation_cache_dir", "/elsewhere")
        cli._persistent_compilation_cache()
        assert jax.config.jax_compilation_cache_dir == "/elsewhere"
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
