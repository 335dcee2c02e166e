"""Drafter training end to end on the tiny random target: the `specdec data` / `specdec train` commands, every
trained drafter (loss falls and teacher-forced expected tau rises on held-out data, then greedy decoding with it
equals AR), a killed-and-resumed run ends bitwise equal to an uninterrupted one (with a NaN episode in between
that the guard stops without touching the checkpoints), cached features equal online ones, and bad
checkpoints / data / configs fail with clear errors.

All runs share one compiled train step per drafter (equal settings hash equal), so keep the overrides below in
step with each other."""

import dataclasses
import json
import os
import shutil
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import drafters
from benchmarks.snapshot_drafter import snapshot
from drafters import create_drafter
from experiments import cli
from experiments.build import build_target
from specdec.config import load_config
from specdec.engine import speculative_generate
from specdec import generate as G
from specdec.generate import generate
from specdec.sampling import SamplingParams
from specdec.target import Target
from specdec.testing import PROMPTS
from specdec.tracking import MemoryTracker
from specdec.train import checkpoint as ckpt
from specdec.train import data as D
from specdec.train.features import (build_feature_cache, cached_features, find_feature_cache,
                                    online_features, open_feature_cache)
from specdec.train.loop import TrainingDiverged, initial_weights, train
from specdec.train.tasks import make_task

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "train" / "tiny.yaml")
DRAFTERS = {  # name -> (overrides, draft length for greedy decoding)
    "eagle3": (["drafter.name=eagle3"], 3),
    "medusa": (["drafter.name=medusa", "train.drafter_options={num_heads: 3}", "train.lr=0.01"], 3),
    "distilled_lm": (["drafter.name=distilled_lm", "train.drafter_options={num_layers: 1}", "train.lr=0.003"], 3),
}


class SimulatedKill(Exception):
    pass


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="module")
def target():
    return build_target(load_config(CONFIG).model)


@pytest.fixture(scope="module")
def data_dir(work):
    out = work / "data"
    assert cli.main(["data", CONFIG, f"train.data_dir={out}", "--no-progress"]) == 0
    return out


def overrides(work, data_dir, name):
    return [f"train.data_dir={data_dir}", f"output.dir={work / 'runs'}", f"output.name={name}",
            *DRAFTERS[name][0]]


_RUNS: dict = {}


def trained(work, data_dir, name) -> Path:
    """Train `name` once per module through the CLI; returns its run directory."""
    if name not in _RUNS:
        assert cli.main(["train", CONFIG, *overrides(work, data_dir, name), "--no-progress"]) == 0
        _RUNS[name] = work / "runs" / name
    return _RUNS[name]


# ---------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------

def test_data_is_target_responses_with_response_mask_and_resumes(data_dir, target):
    data = D.load_distill_data(data_dir)
    summary = json.loads((data_dir / "summary.json").read_text())
    assert len(data) == summary["examples"] == summary["prompts"] > 80
    assert summary["decode_batch"] == 32 and 0 < summary["batch_utilisation"] <= 1
    # the summary rounds generate_seconds to 0.01 s, and the tiny model takes ~0.2 s: check the rate against
    # the interval that rounding allows, not a relative tolerance the rounding alone can exceed
    seconds, tokens = summary["generate_seconds"], summary["new_tokens_this_run"]
    assert tokens / (seconds + 0.005) <= summary["generate_tokens_per_second"] <= tokens / max(seconds - 0.005, 1e-3)
    for ids, mask, plen in zip(data.input_ids, data.loss_mask, data.prompt_lens):
        assert mask[:plen].sum() == 0 and mask[plen:].all() and len(ids) > plen
    assert len(set(data.ids)) == len(data)
    before = [x.copy() for x in data.input_ids]
    # a rerun skips finished shards; a lost shard is regenerated exactly
    shutil.rmtree(data_dir / "shards" / "shard_00001")
    assert cli.main(["data", CONFIG, f"train.data_dir={data_dir}", "--no-progress"]) == 0
    summary = json.loads((data_dir / "summary.json").read_text())
    assert 0 < summary["new_tokens_this_run"] < sum(len(x) for x in before)
    after = D.load_distill_data(data_dir).input_ids
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    with pytest.raises(D.DataError, match="other settings.*shard_size"):
        cli_args = ["data", CONFIG, f"train.data_dir={data_dir}", "train.shard_size=32", "--no-progress"]
        args = cli.build_parser().parse_args(cli_args)
        args.func(args)


def test_data_and_training_runs_log_the_data_artifact(work, data_dir, monkeypatch):
    """`specdec data` logs the data set (manifest + summary) as an artifact; `specdec train` declares it as its
    input and resumes its tracker from the run directory."""
    import experiments.tracking as tracking

    made = []

    def memory_tracker(cfg, *, run_name, out_dir, config=None, resume_dir=None):
        made.append((run_name, resume_dir, MemoryTracker(run_name)))
        return made[-1][2]

    monkeypatch.setattr(tracking, "make_tracker", memory_tracker)
    assert cli.main(["data", CONFIG, f"train.data_dir={data_dir}", "--no-progress"]) == 0
    name = f"distill-data-{data_dir.name}"
    logged = made[-1][2].artifacts[name]
    assert logged["kind"] == "dataset" and [Path(f).name for f in logged["files"]] == ["manifest.json", "summary.json"]
    # the second data set, pooled with train.more_data, is an input too, and the summary counts the pool
    other = work / "data_copy"
    if not other.exists():
        shutil.copytree(data_dir, other)
    assert cli.main(["train", CONFIG, *overrides(work, data_dir, "eagle3"), "output.name=artifact",
                     f"train.more_data=[{{data_dir: {other}}}]", "--no-progress"]) == 0
    run_name, resume_dir, tracker = made[-1]
    assert resume_dir == work / "runs" / "artifact" and name in tracker.inputs
    assert f"distill-data-{other.name}" in tracker.inputs
    summary = json.loads((resume_dir / "summary.json").read_text())
    assert summary["data_dirs"] == [str(data_dir), str(other)]
    assert summary["train_examples"] + summary["eval_examples"] == 2 * len(D.load_distill_data(data_dir))


def test_prompt_files_and_offline_hub(tmp_path, monkeypatch):
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "hi"}\n{"instruction": "do", "input": "this"}\n')
    (tmp_path / "p.csv").write_text("prompt\nfirst\nsecond\n")
    (tmp_path / "p.json").write_text('{"train": [{"question": "why?"}]}')
    recs = D.load_prompt_records(str(tmp_path / "p.jsonl"))
    assert [(r.id, r.text) for r in recs] == [("a", "hi"), ("p-1", "do\n\nthis")]
    assert [r.text for r in D.load_prompt_records(str(tmp_path / "p.csv"), limit=1)] == ["first"]
    assert [r.text for r in D.load_prompt_records(str(tmp_path / "p.json"), split="train")] == ["why?"]
    # sample_seed: a seeded random sample, not the file's head (a source-sorted file would give one source)
    (tmp_path / "many.jsonl").write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(50)))
    picked = [r.text for r in D.load_prompt_records(str(tmp_path / "many.jsonl"), limit=5, sample_seed=3)]
    assert picked == [r.text for r in D.load_prompt_records(str(tmp_path / "many.jsonl"), limit=5, sample_seed=3)]
    assert len(set(picked)) == 5 and picked != [f"p{i}" for i in range(5)]
    assert picked != [r.text for r in D.load_prompt_records(str(tmp_path / "many.jsonl"), limit=5, sample_seed=4)]
    # skip: the next 5 of the same order, none of the first 5 repeated
    later = [r.text for r in D.load_prompt_records(str(tmp_path / "many.jsonl"), limit=5, sample_seed=3, skip=5)]
    assert later == [r.text for r in D.load_prompt_records(str(tmp_path / "many.jsonl"), limit=10,
                                                            sample_seed=3)][5:]
    # sources: only the records of those sources, in the same sample order, `limit` counting the kept ones
    (tmp_path / "mixed.jsonl").write_text("".join(f'{{"source": "{"code" if i % 3 else "math"}", "prompt": "p{i}"}}\n'
                                                  for i in range(30)))
    everything = D.load_prompt_records(str(tmp_path / "mixed.jsonl"), sample_seed=3, skip=4)
    code = D.load_prompt_records(str(tmp_path / "mixed.jsonl"), sample_seed=3, skip=4, limit=6, sources=["code"])
    assert [r.text for r in code] == [r.text for r in everything if r.source == "code"][:6]
    with pytest.raises(D.DataError, match=r"no records of the sources \['chat'\].*sources are \['code', 'math'\]"):
        D.load_prompt_records(str(tmp_path / "mixed.jsonl"), sources=["chat"])
    with pytest.raises(D.DataError, match="not found"):
        D.load_prompt_records(str(tmp_path / "missing.jsonl"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(D.DataError, match="'someone/prompts' is a Hugging Face hub name.*offline"):
        D.load_prompt_records("someone/prompts")
    with pytest.raises(D.DataError, match="no distillation data"):
        D.load_distill_data(tmp_path / "nothing")


def test_self_written_prompts_keep_only_whole_fresh_turns(tmp_path, monkeypatch):
    """Magpie-style prompts: the target's user turns from the chat template's user prefix. A turn cut at
    max_new_tokens, one that runs on into the assistant's turn, an empty one, a repeat and a contaminated one
    are dropped; the cache keeps the turns before decontamination, so a changed filter applies on reuse."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    from specdec.models.tokenizer import Tokenizer

    words = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "plan", "a", "trip", "write", "poem",
             "sum", "two", "numbers"]
    backend = HFTokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
    tok = Tokenizer(backend, bos_token=None, eos_token="<|im_end|>", pad_token=None, chat_template=template)
    ids = {w: i for i, w in enumerate(words)}
    end = ids["<|im_end|>"]
    rows = [[ids["plan"], ids["a"], ids["trip"], end],                      # kept
            [ids["write"], ids["a"], ids["poem"], ids["poem"]],             # no EOS: cut at max_new_tokens
            [ids["write"], ids["<|im_start|>"], ids["assistant"], end],     # wrote the assistant's turn
            [end],                                                          # empty
            [ids["plan"], ids["a"], ids["trip"], end],                      # repeat
            [ids["sum"], ids["two"], ids["numbers"], end]]                  # kept, then decontaminated

    class FakeTarget:
        tokenizer = tok
        eos_token_ids = (end,)
        cfg = load_config("configs/train/tiny.yaml").model

    calls = []

    def fake_continuous(target, prompts, prompt_seeds, shapes, sampling, seed):
        calls.append((prompts[0], list(prompt_seeds), seed))
        for j in reversed(range(len(prompts))):  # completion order is not prompt order
            yield j, list(rows[prompt_seeds[j] % len(rows)])

    monkeypatch.setattr(G, "generate_continuous", fake_continuous)
    monkeypatch.setattr(G, "continuous_shapes", lambda *args: None)  # the fake target has no model to size
    cache = tmp_path / "self_prompts.jsonl"
    kwargs = dict(sampling=SamplingParams(1.0), seed=7, max_new_tokens=4, batch_size=6, cache_path=cache)
    got = D.self_generated_prompts(FakeTarget(), 6, **kwargs)
    assert [(p.id, p.text) for p in got] == [("self-7-0", "plan a trip"), ("self-7-5", "sum two numbers")]
    assert calls[0] == ([ids["<|im_start|>"], ids["user"]], list(range(6)), 7)  # the user prefix, nothing more
    no_sums = D.self_generated_prompts(FakeTarget(), 6, **kwargs, contaminated=lambda text: "sum" in text)
    assert [p.text for p in no_sums] == ["plan a trip"] and len(calls) == 1  # from the cache
    # skip: the turns after the first N of the same seed (here turns 4-5: a repeat no longer, then the sum)
    later = D.self_generated_prompts(FakeTarget(), 2, **{**kwargs, "skip": 4})
    assert [(p.id, p.text) for p in later] == [("self-7-4", "plan a trip"), ("self-7-5", "sum two numbers")]
    assert calls[-1][1] == [4, 5]
    with pytest.raises(D.DataError, match="need sampling"):
        D.self_generated_prompts(FakeTarget(), 6, **{**kwargs, "sampling": SamplingParams(0.0), "cache_path": None})
    # the config: the prompts' own temperature, only for prompts the target writes
    from specdec.config import ConfigError, DatasetConfig
    assert DatasetConfig("self", prompt_temperature=1.0).prompt_temperature == 1.0
    with pytest.raises(ConfigError, match="prompt_temperature.*only to prompts the target writes"):
        DatasetConfig("p.jsonl", prompt_temperature=1.0)
    with pytest.raises(ConfigError, match="prompt_temperature.*must be > 0"):
        DatasetConfig("self", prompt_temperature=0.0)


def test_teacher_forced_examples_mix_with_generated_ones(tmp_path, target):
    """Records with given answers become teacher-forced examples (no generation; the answer's bytes + EOS on the
    tiny byte-level target), mixed with generated ones in one data set with per-source counts; MBPP-style id
    ranges and 13-gram decontamination drop records; GSM8K's calculator annotations are removed."""
    gsm = [{"question": f"q{i} how many?", "answer": f"It is 2+{i} = <<2+{i}={2 + i}>>{2 + i}.\n#### {2 + i}"}
           for i in range(6)]
    (tmp_path / "gsm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm))
    code = [{"task_id": i, "text": f"write f{i}", "code": f"def f{i}(): return {i}"} for i in range(1, 7)]
    (tmp_path / "code.jsonl").write_text("".join(json.dumps(r) + "\n" for r in code))
    chat = [{"messages": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi there"}]}]
    (tmp_path / "chat.jsonl").write_text(json.dumps(chat[0]) + "\n")
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"prompt": "one two three four five six seven eight nine ten eleven twelve "
                                           "thirteen fourteen"}) + "\n")
    (tmp_path / "dirty.jsonl").write_text(json.dumps({"prompt": "so: one two three four five six seven eight nine "
                                                                "ten eleven twelve thirteen", "response": "x"})
                                          + "\n" + json.dumps({"prompt": "clean one", "response": "ok"}) + "\n")

    recs = D.load_prompt_records(str(tmp_path / "gsm.jsonl"), response_field="auto")
    assert recs[1].response == "It is 2+1 = 3.\n#### 3"  # annotation gone
    mbpp = D.load_prompt_records(str(tmp_path / "code.jsonl"), field="text", response_field="code",
                                 exclude_ids=[str(i) for i in range(2, 5)])
    assert [r.id for r in mbpp] == ["1", "5", "6"]
    assert D.load_prompt_records(str(tmp_path / "chat.jsonl"), response_field="auto")[0].response == "hi there"
    clean = D.load_prompt_records(str(tmp_path / "dirty.jsonl"), response_field="auto",
                                  contaminated=D.contamination_filter([str(evals)]))
    assert [r.text for r in clean] == ["clean one"]
    with pytest.raises(D.DataError, match="response field 'solution' not found"):
        D.load_prompt_records(str(tmp_path / "code.jsonl"), response_field="solution")
    with pytest.raises(ValueError, match="exclude_ids"):
        load_config(CONFIG, ["data.datasets=[{name: x.jsonl, exclude_ids: ['9-3']}]"])

    generated = D.load_prompt_records(str(tmp_path / "gsm.jsonl"), limit=3)
    out = tmp_path / "mixed"
    summary = D.build_distill_data(target, recs + mbpp + generated, out, sampling=SamplingParams(0.0),
                                   max_new_tokens=8, batch_size=4, shard_size=4, chat_template=False,
                                   max_total_len=40, progress=False)
    data = D.load_distill_data(out)
    assert len(data) == 12 and summary["teacher_forced_examples"] == 9 == sum(data.teacher_forced)
    assert summary["sources"]["code"] == {"examples": 3, "response_tokens": 3 * 19, "teacher_forced": 3}
    assert summary["new_tokens_this_run"] == sum(int(m.sum()) for m, f in zip(data.loss_mask, data.teacher_forced)
                                                 if not f)
    eos = target.eos_token_ids[0]
    for rec, ids, mask, plen in zip(recs, data.input_ids, data.loss_mask, data.prompt_lens):
        want = (list(rec.response.encode()) + [eos])[:40 - plen]
        assert ids[plen:].tolist() == want and mask[plen:].all() and not mask[:plen].any()
    assert not any(data.teacher_forced[-3:])  # the generated ones


# ---------------------------------------------------------------------------------------------------------
# The continuous-batching generator behind `specdec data`
# ---------------------------------------------------------------------------------------------------------

# prompts of very different lengths (1 to 90 tokens: three prompt-width buckets' worth)
MIXED_PROMPTS = [[3], [40, 41] * 45, [7, 8, 9], [11] * 33, [50 + i for i in range(64)], [12, 13, 14, 15, 16],
                 [99] * 2, [5, 6, 7, 5, 6, 7, 5, 6], [120 + i % 7 for i in range(47)], [30, 31], [200] * 17,
                 [9, 10, 11, 12], [20, 21] * 10]


@pytest.fixture(scope="module")
def eos_target(target):
    """The tiny target with an EOS id it actually emits (its greedy continuations' most common token), so that
    rows stop at different steps and get refilled."""
    rows = generate(target, MIXED_PROMPTS, max_new_tokens=24).tokens
    ids, counts = np.unique(np.concatenate([r[1:] for r in rows]), return_counts=True)
    eos = int(ids[np.argmax(counts)])
    return dataclasses.replace(target, cfg=dataclasses.replace(target.cfg, eos_token_ids=(eos,)))


def continuous(target, prompts, batch_size, insert_rows, sampling=SamplingParams(0.0), seed=0, seeds=None,
               max_new_tokens=24, limits=None):
    shapes = G.continuous_shapes(target, [len(p) for p in prompts], max_new_tokens, batch_size, insert_rows)
    stats = G.ContinuousStats()
    seeds = list(range(len(prompts))) if seeds is None else seeds
    out = dict(G.generate_continuous(target, prompts, seeds, shapes, sampling, seed, stats, max_new_tokens=limits))
    assert sorted(out) == list(range(len(prompts)))
    return [out[i] for i in range(len(prompts))], stats


def test_continuous_generation_equals_generate_at_temperature_0(eos_target):
    """Refilling rows never changes tokens: at T=0 every prompt gets what `generate` (and the static-batch
    path) gives it, whether the batch is smaller than the prompts (many refills) or larger (rows never used);
    rows end at EOS (kept, last) or exactly at max_new_tokens."""
    want = generate(eos_target, MIXED_PROMPTS, max_new_tokens=24).tokens
    eos = eos_target.eos_token_ids[0]
    stopped = [bool(r) and r[-1] == eos for r in want]
    assert 0 < sum(stopped) < len(want)  # both endings occur
    for r, s in zip(want, stopped):
        assert (eos not in r[:-1]) and (len(r) <= 24 if s else len(r) == 24)
    shapes = G.continuous_shapes(eos_target, [len(p) for p in MIXED_PROMPTS], 24, 4, 2)
    static = D.generate_fixed(eos_target, MIXED_PROMPTS, shapes.width, shapes.capacity, 24, SamplingParams(0.0), 0)
    assert static == want
    for batch_size, insert_rows in [(4, 2), (3, 1), (5, 3), (32, 8)]:
        got, stats = continuous(eos_target, MIXED_PROMPTS, batch_size, insert_rows)
        assert got == want, (batch_size, insert_rows)
        assert stats.new_tokens == sum(len(r) for r in want)
        assert stats.decode_kept == sum(len(r) - 1 for r in want)  # every token after the prefill's one
        assert 0 < stats.utilisation <= 1
    assert continuous(eos_target, MIXED_PROMPTS, 4, 2)[1].inserts > len(MIXED_PROMPTS) // 2  # refilled, not batched
    got, _ = continuous(eos_target, MIXED_PROMPTS, 4, 2, max_new_tokens=5)  # the cutoff
    assert got == [r[:5] for r in want]
    got, _ = continuous(eos_target, MIXED_PROMPTS, 4, 2, max_new_tokens=1)
    assert got == [r[:1] for r in want]


def test_continuous_generation_stops_each_prompt_at_its_own_limit(eos_target):
    """Per-prompt limits (the batch-scaling benchmark's refilled AR: prompts asking for different numbers of new
    tokens) give each prompt `generate`'s tokens for its own limit, in refilled rows; the run's one limit for all
    (the negative control) does not. Decode time is part of the generator's time."""
    limits = [3, 11, 1, 7, 24, 2, 12, 5][: len(MIXED_PROMPTS)] + [9] * max(0, len(MIXED_PROMPTS) - 8)
    want = generate(eos_target, MIXED_PROMPTS, max_new_tokens=limits).tokens
    got, stats = continuous(eos_target, MIXED_PROMPTS, 3, 1, limits=limits)
    assert got == want
    assert stats.decode_kept == sum(len(r) - 1 for r in want) and 0 < stats.decode_seconds <= stats.seconds
    assert continuous(eos_target, MIXED_PROMPTS, 3, 1)[0] != want
    with pytest.raises(ValueError, match=r"a limit in \[1, 24\]"):
        continuous(eos_target, MIXED_PROMPTS, 3, 1, limits=[25] * len(MIXED_PROMPTS))
    with pytest.raises(ValueError, match="max_new_tokens must give each of the"):
        continuous(eos_target, MIXED_PROMPTS, 3, 1, limits=[5])


def test_continuous_sampling_depends_only_on_the_prompt_and_its_seed(eos_target):
    """At T > 0 a prompt's response is a function of (prompt, its seed, the run seed): co-batched rows, the
    batch shape and the insertion order do not change it; another seed does."""
    sampling = SamplingParams(0.9, top_k=50)
    base, _ = continuous(eos_target, MIXED_PROMPTS, 4, 2, sampling, seed=7)
    assert continuous(eos_target, MIXED_PROMPTS, 6, 3, sampling, seed=7)[0] == base
    order = list(reversed(range(len(MIXED_PROMPTS))))[::2]
    part, _ = continuous(eos_target, [MIXED_PROMPTS[i] for i in order], 4, 2, sampling, seed=7, seeds=order)
    assert part == [base[i] for i in order]
    assert continuous(eos_target, MIXED_PROMPTS, 4, 2, sampling, seed=8)[0] != base
    greedy, _ = continuous(eos_target, MIXED_PROMPTS, 4, 2)
    assert base != greedy


def test_continuous_sampler_draws_the_processed_distribution():
    """The generator's inverse-CDF sampler draws from the temperature / top-k / top-p distribution of
    `specdec.sampling` (checked against `probabilities` on 40000 fixed draws) and never a masked token."""
    from specdec.sampling import probabilities

    logits = jnp.log(jnp.array([0.45, 0.25, 0.15, 0.1, 0.05]))
    n = 40000
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(0), i))(jnp.arange(n))
    for sp in [SamplingParams(0.7), SamplingParams(1.3, top_k=3), SamplingParams(1.0, top_p=0.8)]:
        drawn = np.asarray(G._row_sample(keys, jnp.zeros((n,), jnp.int32), jnp.broadcast_to(logits, (n, 5)), sp))
        want = np.asarray(probabilities(logits, sp))
        freq = np.bincount(drawn, minlength=5) / n
        assert np.abs(freq - want).max() < 0.01, (sp, freq, want)
        assert not freq[want == 0].any()


def test_continuous_generation_refuses_bad_inputs(eos_target):
    shapes = G.continuous_shapes(eos_target, [4, 9], 8, 4)
    with pytest.raises(ValueError, match="prompt 1 has 40 tokens; the run's prompt width is 32"):
        list(G.generate_continuous(eos_target, [[1, 2], [3] * 40], [0, 1], shapes))
    with pytest.raises(ValueError, match="2 prompts but 1 prompt seeds"):
        list(G.generate_continuous(eos_target, [[1, 2], [3]], [0], shapes))
    with pytest.raises(ValueError, match="batch_size and insert_rows must be >= 1"):
        G.continuous_shapes(eos_target, [4], 8, 0)
    with pytest.raises(G.ContextLengthError):
        G.continuous_shapes(eos_target, [250], 24, 4, max_seq_len=256)


class DiskFull(Exception):
    pass


def test_interrupted_data_run_resumes_to_the_same_shards(eos_target, tmp_path, monkeypatch):
    """Sampled data (T=1), generated and teacher-forced rows mixed, shards smaller than the decode batch so rows
    of several shards share it: a run killed while writing its third shard, then resumed (with another batch
    size's co-batching), ends with exactly the shards of an uninterrupted run."""
    import datasets

    prompts = [D.PromptRecord(id=f"p{i}", source="mix", tokens=p,
                              response="given answer" if i % 4 == 1 else None)
               for i, p in enumerate(MIXED_PROMPTS * 2)]
    kwargs = dict(sampling=SamplingParams(1.0), seed=3, max_new_tokens=16, shard_size=5, chat_template=False,
                  progress=False, log=lambda _: None)
    full = D.build_distill_data(eos_target, prompts, tmp_path / "full", batch_size=6, insert_rows=2, **kwargs)
    assert full["examples"] == len(prompts) and 0 < full["batch_utilisation"] <= 1
    assert full["decode_batch"] == 6 and full["insert_rows"] == 2
    assert full["new_tokens_this_run"] == full["response_tokens"] - sum(
        len(D.encode_response(eos_target, p, p.tokens, False)[:16]) for p in prompts if p.response is not None)
    assert full["generate_tokens_per_second"] > 0

    save, writes = datasets.Dataset.save_to_disk, []

    def failing_save(self, path, *a, **k):
        writes.append(path)
        if len(writes) == 3:
            raise DiskFull(path)
        return save(self, path, *a, **k)

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", failing_save)
    with pytest.raises(DiskFull):
        D.build_distill_data(eos_target, prompts, tmp_path / "resumed", batch_size=6, insert_rows=2, **kwargs)
    monkeypatch.setattr(datasets.Dataset, "save_to_disk", save)
    assert len(list((tmp_path / "resumed" / "shards").glob("shard_?????"))) == 2
    again = D.build_distill_data(eos_target, prompts, tmp_path / "resumed", batch_size=6, insert_rows=3, **kwargs)
    assert 0 < again["new_tokens_this_run"] < full["new_tokens_this_run"]
    a, b = D.load_distill_data(tmp_path / "full"), D.load_distill_data(tmp_path / "resumed")
    assert a.ids == b.ids and a.teacher_forced == b.teacher_forced and a.stopped == b.stopped
    assert all(np.array_equal(x, y) for x, y in zip(a.input_ids, b.input_ids))
    assert 0 < sum(b.stopped) < len(b)
    # skip_shards: a continued run reads only the shards after the first N, in order
    later = D.load_distill_data(tmp_path / "full", skip_shards=2)
    assert later.ids == a.ids[10:] and all(np.array_equal(x, y) for x, y in zip(later.input_ids, a.input_ids[10:]))
    with pytest.raises(D.DataError, match="skip_shards=6 leaves no data.*6 finished shards"):
        D.load_distill_data(tmp_path / "full", skip_shards=6)
    # train.more_data: data sets pooled in order, from one target only
    pooled = D.pool_distill_data([("later", later), ("resumed", b)])
    assert pooled.ids == later.ids + b.ids and pooled.sources == later.sources + b.sources
    assert all(np.array_equal(x, y) for x, y in zip(pooled.input_ids, later.input_ids + b.input_ids))
    assert pooled.manifest["pooled_from"] == ["later", "resumed"] and D.pool_distill_data([("a", a)]) is a
    other = dataclasses.replace(b, manifest={**b.manifest, "target": "another model"})
    with pytest.raises(D.DataError, match="cannot train on later and other together: their target differs"):
        D.pool_distill_data([("later", later), ("other", other)])
    # data made by the per-batch-key generator (no "generator" in its manifest) is not resumed with this one
    manifest = json.loads((tmp_path / "full" / D.MANIFEST).read_text())
    del manifest["generator"]
    (tmp_path / "full" / D.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(D.DataError, match="differs in: generator"):
        D.build_distill_data(eos_target, prompts, tmp_path / "full", batch_size=6, insert_rows=2, **kwargs)


def test_data_time_limit_stops_after_a_shard_and_the_rerun_finishes_the_same_data(eos_target, tmp_path):
    """data.max_seconds: the call ends at the first shard written past the budget (here 0 s: the first one),
    says it is incomplete, and a rerun without a limit ends with the shards of an uninterrupted run."""
    prompts = [D.PromptRecord(id=f"p{i}", source="mix", tokens=p) for i, p in enumerate(MIXED_PROMPTS)]
    kwargs = dict(sampling=SamplingParams(0.0), max_new_tokens=12, shard_size=3, batch_size=4, insert_rows=2,
                  chat_template=False, progress=False, log=lambda _: None)
    shards = -(-len(prompts) // 3)
    cut = D.build_distill_data(eos_target, prompts, tmp_path / "cut", max_seconds=0.0, **kwargs)
    assert cut["complete"] is False and cut["shards"] == f"1/{shards}" and cut["examples"] == 3
    rest = D.build_distill_data(eos_target, prompts, tmp_path / "cut", **kwargs)
    full = D.build_distill_data(eos_target, prompts, tmp_path / "full", **kwargs)
    assert rest["complete"] and full["complete"] and rest["shards"] == f"{shards}/{shards}"
    a, b = D.load_distill_data(tmp_path / "full"), D.load_distill_data(tmp_path / "cut")
    assert a.ids == b.ids and all(np.array_equal(x, y) for x, y in zip(a.input_ids, b.input_ids))


# ---------------------------------------------------------------------------------------------------------
# Training end to end, and decoding with what was trained
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(DRAFTERS))
def test_trained_drafter_improves_and_decodes_losslessly(work, data_dir, target, name):
    run = trained(work, data_dir, name)
    summary = json.loads((run / "summary.json").read_text())
    first, final = summary["first_eval"], summary["final_eval"]
    assert summary["status"] == "complete" and summary["steps"] == 200
    assert final["loss"] < 0.9 * first["loss"], (first, final)
    assert final["expected_tau"] > first["expected_tau"] + 0.05, (first, final)
    drafter = create_drafter(name, target, DRAFTERS[name][1], path=str(run))
    ar = generate(target, PROMPTS, max_new_tokens=17)
    out = speculative_generate(target, drafter, PROMPTS, max_new_tokens=17)
    assert out.tokens == ar.tokens
    assert out.metrics.tau >= 1.0


def test_killed_and_resumed_equals_uninterrupted_with_a_nan_episode(work, data_dir, target):
    reference = trained(work, data_dir, "medusa")  # uninterrupted, through the CLI
    cfg = load_config(CONFIG, overrides(work, data_dir, "medusa"))
    task = make_task("medusa", target, cfg.train.drafter_options)
    data = D.load_distill_data(data_dir)
    run = work / "runs" / "medusa_killed"
    tracker = MemoryTracker()

    def kill(step, metrics):
        if step == 75:  # after the checkpoint at 50, before the one at 100
            raise SimulatedKill

    with pytest.raises(SimulatedKill):
        train(task, target, data, cfg.train, run, tracker=tracker, progress=False, eval_draft_len=3, hook=kill,
              log=lambda s: None)
    assert ckpt.CheckpointStore(run / "checkpoints").steps() == [50]
    assert any("eval/expected_tau" in m for _, m in tracker.metrics)
    assert any("train/loss" in m for _, m in tracker.metrics)

    # a NaN episode: the guard stops at the first bad step and leaves the checkpoints alone
    bad = Target(target.cfg, {**target.params, "embed": target.params["embed"] * jnp.nan}, None, target.backend)
    with pytest.raises(TrainingDiverged, match=r"non-finite loss/gradient at step 51.*last good checkpoint is step 50"):
        train(task, bad, data, cfg.train, run, progress=False, eval_draft_len=3, log=lambda s: None)
    assert ckpt.CheckpointStore(run / "checkpoints").steps() == [50]

    summary = train(task, target, data, cfg.train, run, progress=False, eval_draft_len=3, log=lambda s: None)
    assert summary["resumed_from"] == 50 and summary["steps"] == 200
    a, b = ckpt.load_drafter(reference), ckpt.load_drafter(run)
    flat_a, flat_b = ckpt.flatten(a["params"]), ckpt.flatten(b["params"])
    assert flat_a.keys() == flat_b.keys()
    for key in flat_a:
        np.testing.assert_array_equal(flat_a[key], flat_b[key], err_msg=key)  # bitwise


def test_sigterm_saves_a_checkpoint_like_ctrl_c(work, data_dir, target):
    """Preemption: SIGTERM mid-run finishes the step, saves it, and the rerun resumes from there."""
    drafters.available()  # registers the training tasks
    cfg = load_config(CONFIG, overrides(work, data_dir, "medusa"))
    task = make_task("medusa", target, cfg.train.drafter_options)
    data = D.load_distill_data(data_dir)
    run = work / "runs" / "medusa_sigterm"
    before = signal.getsignal(signal.SIGTERM)

    def preempt(step, metrics):
        if step == 75:  # between the checkpoints at 50 and 100
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(KeyboardInterrupt):
        train(task, target, data, cfg.train, run, progress=False, eval_draft_len=3, hook=preempt, log=lambda s: None)
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the run's only
    assert ckpt.CheckpointStore(run / "checkpoints").steps() == [50, 75]
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"
    # a snapshot of the interrupted run: its newest weights, or any kept step
    assert snapshot(run, work / "snap75")["step"] == 75
    info = snapshot(run, work / "snap50", step=50)
    assert info["step"] == 50 and "checkpoints (step 50)" in info["source"]
    seen = json.loads((work / "snap50" / ckpt.DRAFTER_FILE).read_text())["snapshot"]["examples_seen"]
    assert seen == 50 * cfg.train.batch_size
    assert ckpt.load_drafter(work / "snap50")["step"] == 50 and not (work / "snap50" / "summary.json").exists()
    summary = train(task, target, data, cfg.train, run, progress=False, eval_draft_len=3, log=lambda s: None)
    assert summary["resumed_from"] == 75 and summary["steps"] == 200 and summary["status"] == "complete"
    assert snapshot(run, work / "snap200")["source"].endswith("params.npz")  # the final weights
    # a params.npz older than the newest checkpoint (a resumed run still training): the checkpoint wins
    final = ckpt.load_drafter(run)
    ckpt.export_params(run, final["params"], final["buffers"], 120)
    assert snapshot(run, work / "snap_newest")["step"] == 200
    assert ckpt.load_drafter(run)["step"] == 200  # also for `drafter.path=<run>`


def test_time_limit_ends_the_call_like_its_last_step_and_the_rerun_goes_on(work, data_dir, target):
    """train.max_seconds: the loop stops at the first step past the budget, saves it, evaluates and writes the
    final weights (status "time_limit"); the same command again continues to train.steps."""
    drafters.available()
    cfg = load_config(CONFIG, overrides(work, data_dir, "medusa"))
    tcfg = dataclasses.replace(cfg.train, steps=12, checkpoint_every=100, eval_every=100, max_seconds=0.0)
    task = make_task("medusa", target, cfg.train.drafter_options)
    data = D.load_distill_data(data_dir)
    run = work / "runs" / "medusa_time_limit"
    first = train(task, target, data, tcfg, run, progress=False, eval_draft_len=3, log=lambda s: None)
    assert first["status"] == "time_limit" and first["steps"] == 1 and first["final_eval"] is not None
    assert ckpt.CheckpointStore(run / "checkpoints").steps() == [1] and ckpt.load_drafter(run)["step"] == 1
    second = train(task, target, data, dataclasses.replace(tcfg, max_seconds=None), run, progress=False,
                   eval_draft_len=3, log=lambda s: None)
    assert second["status"] == "complete" and second["resumed_from"] == 1 and second["steps"] == 12
    with pytest.raises(ValueError, match="max_seconds: must be >= 0"):
        load_config(CONFIG, ["train.max_seconds=-1"])


def test_init_from_a_trained_drafter_starts_from_its_weights(work, data_dir, target):
    reference = trained(work, data_dir, "medusa")
    cfg = load_config(CONFIG, overrides(work, data_dir, "medusa"))
    task = make_task("medusa", target, cfg.train.drafter_options)
    data = D.load_distill_data(data_dir)
    tcfg = dataclasses.replace(cfg.train, init_from=str(reference), steps=1)
    summary = train(task, target, data, tcfg, work / "runs" / "medusa_continued", progress=False, eval_draft_len=3,
                    log=lambda s: None)
    final = json.loads((reference / "summary.json").read_text())["final_eval"]
    assert summary["first_eval"]["loss"] == pytest.approx(final["loss"], rel=1e-5)  # step 0 = the loaded weights
    # a rerun resumes from the run's own checkpoints and never reads init_from again
    gone = dataclasses.replace(tcfg, init_from=str(work / "runs" / "no_such_drafter"))
    assert train(task, target, data, gone, work / "runs" / "medusa_continued", progress=False, eval_draft_len=3,
                 log=lambda s: None)["resumed_from"] == 1
    # a training-only key (the loss weighting) may change; the weights still come from the source
    reweighted = make_task("medusa", target, {**cfg.train.drafter_options, "head_weight": 0.5})
    fresh_params, fresh_buffers = reweighted.init(jax.random.PRNGKey(9), data.token_counts(target.cfg.vocab_size))
    params, _ = initial_weights(str(reference), reweighted, target, fresh_params, fresh_buffers)
    loaded = ckpt.flatten(params)
    for key, value in ckpt.flatten(ckpt.load_drafter(reference)["params"]).items():
        np.testing.assert_array_equal(loaded[key], value, err_msg=key)
    other = make_task("medusa", target, {**cfg.train.drafter_options, "num_heads": 2})
    with pytest.raises(ckpt.CheckpointError, match="init_from .*differs from this run's in num_heads"):
        train(other, target, data, tcfg, work / "runs" / "medusa_other", progress=False, log=lambda s: None)
    with pytest.raises(ckpt.CheckpointError, match="holds a 'medusa' drafter, not 'eagle3'"):
        train(make_task("eagle3", target, {}), target, data, tcfg, work / "runs" / "eagle3_other", progress=False,
              log=lambda s: None)


def test_resume_refuses_another_config(work, data_dir, target):
    run = trained(work, data_dir, "eagle3")
    with pytest.raises(ValueError, match="another config.*train.lr"):
        args = cli.build_parser().parse_args(["train", CONFIG, *overrides(work, data_dir, "eagle3"), "train.lr=0.5",
                                              "--no-progress"])
        args.func(args)
    assert (run / "params.npz").is_file()


def test_bad_checkpoints_are_clear_errors(work, data_dir, target, tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.load_drafter(tmp_path / "nope")
    with pytest.raises(ckpt.CheckpointError, match="not a trained drafter"):
        create_drafter("eagle3", target, 3, path=str(tmp_path))
    with pytest.raises(ValueError, match="needs a trained checkpoint"):
        create_drafter("medusa", target, 3)
    run = trained(work, data_dir, "medusa")
    with pytest.raises(ckpt.CheckpointError, match="holds a 'medusa' drafter, not 'eagle3'"):
        create_drafter("eagle3", target, 3, path=str(run))
    # an unreadable orbax checkpoint (no params.npz: load falls back to it)
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    (broken / "params.npz").unlink()
    last = max(int(p.name) for p in (broken / "checkpoints").iterdir() if p.name.isdigit())
    for f in (broken / "checkpoints" / str(last) / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    with pytest.raises(ckpt.CheckpointError, match=f"step {last}.*cannot be restored"):
        ckpt.load_drafter(broken)
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.CheckpointStore(tmp_path / "absent", create=False)


def test_cached_features_equal_online_ones(data_dir, target, tmp_path):
    drafters.available()
    task = make_task("eagle3", target, {"ttt_steps": 1, "taps": [1]})
    arrays = D.load_distill_data(data_dir).padded(192, 2)  # longer than any example: the build cuts each batch
    small = {k: v[:5] for k, v in arrays.items()}
    assert small["lengths"].max() <= 128
    # a cache of more layers than the task's (as the block drafters' cache serves an EAGLE-3 run): it is found
    # under the features folder and read by layer
    every = tuple(range(target.cfg.num_layers + 1))
    cache = build_feature_cache(target, small, every, True, tmp_path / "f" / "wide", dtype="float32", batch_size=2,
                                progress=False)
    stored = cache.stored
    assert stored == every and set(task.taps) < set(every)
    assert cache.bytes_per_token == len(stored) * target.cfg.hidden_size * 4
    expect = {k: cache.meta[k] for k in ("target", "seq_len", "data", "dtype")}
    needed = (*task.taps, target.cfg.num_layers)
    assert find_feature_cache(tmp_path / "f", expect, needed).path == cache.path
    assert find_feature_cache(tmp_path / "f", {**expect, "seq_len": 64}, needed) is None  # other data: not it
    absent = target.cfg.num_layers + 1
    assert find_feature_cache(tmp_path / "f", expect, (absent,)) is None
    with pytest.raises(ValueError, match=rf"holds layers .* also needs \[{absent}\]"):
        open_feature_cache(cache.path, expect, (absent,))
    # every row, whichever length-sorted batch and cut width the build gave it, against the full-width online pass
    rows = np.arange(5)
    feats = jax.jit(lambda tp, f: cached_features(tp, target.cfg, f, task.taps, stored, True))(
        target.params, jnp.asarray(cache.batch(rows, small["lengths"][rows], 192)))
    ref = jax.jit(lambda tp, t: online_features(tp, target.cfg, target.forward, t, task.taps, True))(
        target.params, jnp.asarray(small["tokens"][rows]))
    valid = np.arange(192)[None, :] < small["lengths"][rows][:, None]
    np.testing.assert_allclose(np.asarray(feats.taps)[:, valid], np.asarray(ref.taps)[:, valid], rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(np.asarray(feats.logits)[valid], np.asarray(ref.logits)[valid], rtol=1e-5, atol=1e-3)


def test_length_grouped_batch_order_visits_each_example_once_and_resumes():
    from specdec.train.loop import BatchOrder

    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 400, size=1000)
    idx = np.arange(0, 1000, 2)  # a training subset
    order = BatchOrder(idx, 4, seed=3, lengths=lengths)
    epoch = [order.next() for _ in range(len(idx) // 4)]
    assert sorted(np.concatenate(epoch).tolist()) == idx.tolist() and order.epoch == 1 and order.cursor == 0
    spread = np.mean([np.ptp(lengths[b]) for b in epoch])
    plain = BatchOrder(idx, 4, seed=3)
    random_spread = np.mean([np.ptp(lengths[plain.next()]) for _ in range(len(idx) // 4)])
    assert spread < random_spread / 5  # similar lengths share a batch
    # a new BatchOrder at a saved position continues exactly
    a = BatchOrder(idx, 4, seed=3, lengths=lengths)
    for _ in range(37):
        a.next()
    b = BatchOrder(idx, 4, seed=3, epoch=a.epoch, cursor=a.cursor, lengths=lengths)
    assert all(np.array_equal(a.next(), b.next()) for _ in range(200))
    with pytest.raises(ValueError, match="length_buckets"):
        load_config(CONFIG, ["train.length_buckets=[64, 32]"])


def test_evaluation_sets_and_example_limit_for_studies(work, data_dir, target):
    """train.limit_examples trains on the first N examples only; train.eval_train_examples and train.eval_data
    are evaluated beside the held-out set at every evaluation (the overfit check: the examples trained on score
    above the held-out ones); bad values are clear errors."""
    drafters.available()
    cfg = load_config(CONFIG, overrides(work, data_dir, "medusa"))
    tcfg = dataclasses.replace(cfg.train, steps=40, checkpoint_every=100, eval_every=20, limit_examples=8,
                               eval_train_examples=8, eval_data=(str(data_dir),))
    task = make_task("medusa", target, cfg.train.drafter_options)
    data = D.load_distill_data(data_dir)
    run = work / "runs" / "medusa_study"
    summary = train(task, target, data, tcfg, run, progress=False, eval_draft_len=3, log=lambda s: None)
    assert summary["train_examples"] == 8
    final = summary["final_eval"]
    train_set, whole = final["sets"]["train"], final["sets"][Path(data_dir).name]
    assert train_set["expected_tau"] > final["expected_tau"] + 0.05, (train_set, final)
    assert whole["slots"] > final["slots"] > 0 and train_set["slots"] > 0
    kinds = {json.loads(line)["kind"] for line in (run / "metrics.jsonl").read_text().splitlines()}
    assert {"eval", "eval/train", f"eval/{Path(data_dir).name}"} <= kinds
    with pytest.raises(D.DataError, match="limit_examples=100000 is more than"):
        train(task, target, data, dataclasses.replace(tcfg, limit_examples=100000), work / "runs" / "x",
              progress=False, log=lambda s: None)
    with pytest.raises(D.DataError, match="share a name"):
        train(task, target, data, dataclasses.replace(tcfg, eval_data=(str(data_dir), str(data_dir))),
              work / "runs" / "y", progress=False, log=lambda s: None)
    with pytest.raises(ValueError, match="limit_examples: must be >= 1"):
        load_config(CONFIG, ["train.limit_examples=0"])
