"""The draft-vocabulary coverage study (benchmarks/vocab_coverage.py): the arithmetic on data written by
`specdec data`'s own writer, prompts never counted, and the script's files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import vocab_coverage as V
from specdec.sampling import SamplingParams
from specdec.train import checkpoint as ckpt
from specdec.train import data as D

EOS = 2
A, B, C, Z, P = ord("a"), ord("b"), ord("c"), ord("z"), 200  # P: a prompt-only token
SHIPPED = Path(__file__).resolve().parents[1] / "drafters" / "trained" / "dspark_smollm2_mix"

# Teacher-forced records (given responses, so the writer runs no target step): a response is its UTF-8 bytes
# followed by EOS, the prompt the ids given. Training answers: a x8, b x3, EOS x3, c x1 (and P x30 in prompts).
TRAIN = [D.PromptRecord(id=f"t{i}", source="t", tokens=[P] * 10, response=r) for i, r in
         enumerate(["aaaa", "aaab", "abbc"])]
# Evaluation answers: a x3, b x2, EOS x2, c x1, z x1 (9 tokens); source x's prompt holds z, source y's P.
EVAL = [D.PromptRecord(id="x0", source="x", tokens=[Z] * 3, response="aabz"),
        D.PromptRecord(id="y0", source="y", tokens=[P] * 2, response="abc")]


def write(target, records, out: Path) -> D.DistillData:
    D.build_distill_data(target, records, out, sampling=SamplingParams(0.0), shard_size=2, chat_template=False,
                         progress=False, log=lambda _: None)
    return D.load_distill_data(out)


@pytest.fixture
def data(tiny_target, tmp_path):
    train, evals = write(tiny_target, TRAIN, tmp_path / "train"), write(tiny_target, EVAL, tmp_path / "evalset")
    assert len(list((tmp_path / "train" / "shards").iterdir())) == 2
    return train, evals


def rows(results) -> dict[str, dict]:
    return {r["set"]: r["coverage"] for r in results["rows"]}


def test_coverage_counts_the_answer_tokens_of_each_set_against_vocabularies_built_as_training_builds_them(data):
    train, evals = data
    everything_answered = [EOS, A, B, C, Z]
    results = V.study(train, {"evalset": evals}, sizes=[1, 3, 4], eval_examples=0, eos_ids=[EOS],
                      drafters={"all answers": everything_answered, "no a": [i for i in range(256) if i != A]})
    cov = rows(results)
    # K = 1 holds EOS alone (always kept); K = 3 the next two by count (EOS and b tie at 3: lower id first); c last
    assert [r["set"] for r in results["rows"]] == ["train (counted)", "evalset", "evalset / x", "evalset / y"]
    assert cov["train (counted)"] == {"1": 3 / 15, "3": 14 / 15, "4": 1.0, "full 256": 1.0, "all answers": 1.0,
                                      "no a": 7 / 15}
    assert cov["evalset"] == {"1": 2 / 9, "3": 7 / 9, "4": 8 / 9, "full 256": 1.0, "all answers": 1.0,
                              "no a": (9 - 3) / 9}  # missing the most frequent token costs exactly its share
    assert cov["evalset / x"]["3"] == 4 / 5 and cov["evalset / y"]["3"] == 3 / 4
    assert [r["answer_tokens"] for r in results["rows"]] == [15, 9, 5, 4]
    assert results["vocabularies"]["3"] == {"size": 3, "built_from": "train"}
    assert results["overlap"]["all answers"] == {"1": 1, "3": 3, "4": 4}

    misses = {(m["set"], m["vocabulary"]): m for m in results["misses"]}
    no_a = misses[("evalset", "no a")]  # the three a's: none in a prompt, the second of "aabz" earlier in its answer
    assert (no_a["missed"], no_a["missed_in_prompt"], no_a["missed_in_context"]) == (3, 0, 1)
    assert no_a["top_missed"] == [[A, 3]]
    only_eos = misses[("evalset", "1")]  # a a b z | a b c outside: z is in x's prompt, x's second a follows its first
    assert (only_eos["missed"], only_eos["missed_in_prompt"], only_eos["missed_in_context"]) == (7, 1, 2)
    assert only_eos["top_missed"] == [[A, 3], [B, 2], [C, 1], [Z, 1]]


def test_prompt_tokens_never_count_and_a_study_that_counted_them_would_fail(data):
    train, evals = data
    expected = {"1": 2 / 9, "3": 7 / 9, "4": 8 / 9}

    def coverage_of(train, evals):
        cov = rows(V.study(train, {"evalset": evals}, sizes=[1, 3, 4], eval_examples=0, eos_ids=[EOS]))["evalset"]
        return {k: cov[k] for k in expected}

    assert coverage_of(train, evals) == expected
    # negative controls: the prompts counted as answers, in the data the vocabulary is built from (P, 30 times,
    # displaces b from K = 3) or in the measured set (z and P inflate the denominator)
    leaky = lambda d: dataclasses.replace(d, loss_mask=[np.ones_like(m) for m in d.loss_mask])  # noqa: E731
    assert coverage_of(leaky(train), evals)["3"] == 5 / 9
    assert coverage_of(train, leaky(evals))["3"] == 7 / 14


def test_held_out_examples_are_left_out_of_the_counts_and_other_targets_refused(data):
    train, evals = data
    results = V.study(train, {}, sizes=[3], eval_examples=1, eos_ids=[EOS])
    counted, held = results["rows"]
    assert (counted["set"], held["set"]) == ("train (counted)", "train (held out)")
    assert counted["examples"] + held["examples"] == 3 and held["examples"] == 1
    _, held_idx = train.split_indices(1)
    assert held["answer_tokens"] == int(train.loss_mask[held_idx[0]].sum())
    other = dataclasses.replace(evals, manifest={**evals.manifest, "target": "another"})
    with pytest.raises(D.DataError, match="cannot compare train and evalset together: their target differs"):
        V.study(train, {"evalset": other}, eos_ids=[EOS], sizes=[3])
    with pytest.raises(ValueError, match=r"sizes \[256\]"):
        V.study(train, {}, sizes=[256], eval_examples=0, eos_ids=[EOS])


def test_the_shipped_drafters_vocabulary_is_read_from_its_directory():
    info = json.loads((SHIPPED / ckpt.DRAFTER_FILE).read_text())
    d2t = V.drafter_vocab(SHIPPED, 49152, info["target"]["name"])
    assert len(d2t) == info["config"]["draft_vocab_size"] == len(np.unique(d2t)) == 8192
    assert 0 <= d2t.min() and d2t.max() < 49152
    with pytest.raises(ckpt.CheckpointError, match="vocab_size 49152, not the data's 256"):
        V.drafter_vocab(SHIPPED, 256, info["target"]["name"])


def test_the_script_writes_its_tables(data, tiny_cfg, tmp_path, monkeypatch):
    class Bytes:  # the tiny target has no tokenizer: its token texts are bytes
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("latin-1")

    monkeypatch.setattr("specdec.models.loading.load_checkpoint", lambda name: (tiny_cfg, None, Bytes()))
    drafter = tmp_path / "drafter"
    ckpt.write_drafter_config(drafter, "dspark", {}, {"name": tiny_cfg.name, "vocab_size": 256})
    ckpt.export_params(drafter, {"w": np.zeros(1)}, {"d2t": np.asarray([EOS, A, B], np.int32)}, step=1)
    out = tmp_path / "out"
    V.main(["--train", str(tmp_path / "train"), "--eval", str(tmp_path / "evalset"), "--drafter", str(drafter),
            "--sizes", "3", "--eval-examples", "0", "--out", str(out)])
    saved = json.loads((out / "results.json").read_text())
    assert saved["meta"]["benchmark"] == "vocab_coverage"
    assert rows(saved["results"])["evalset"] == {"3": 7 / 9, "full 256": 1.0, "drafter d2t": 7 / 9}
    md = (out / "results.md").read_text()
    assert "| set | examples | teacher-forced | answer tokens | distinct | 3 | full 256 | drafter d2t (3) |" in md
    assert "| evalset | drafter d2t | 0.2222 | 0.500 | 0.500 | 'c' 1, 'z' 1 |" in md
    monkeypatch.setattr("specdec.models.loading.load_checkpoint",
                        lambda name: (dataclasses.replace(tiny_cfg, vocab_size=300), None, Bytes()))
    with pytest.raises(SystemExit, match="was made by a target with vocab_size 256"):
        V.main(["--train", str(tmp_path / "train"), "--out", str(out)])
