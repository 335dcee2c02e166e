"""The benchmarks' own helpers (benchmarks/): the statistics their tables print and the cost model's check."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from benchmarks.common import Report, check_comparable, load_method_configs, median_interval, split_args
from benchmarks.cost_fit import fit_line, fit_round_costs
from specdec.config import load_config
from specdec.metrics import DecodeMetrics


def test_median_interval_is_the_sign_test_interval_and_covers():
    """benchmarks.common.median_interval: the order statistics of the sign test (n = 9 at 90%: the 2nd and 8th
    of the sorted values, which cover the median with probability 1 - 2 x 10/512 = 0.961), None when too few
    passes, and the coverage it promises on skewed draws."""
    assert median_interval([5, 1, 4, 2, 3]) == (1.0, 5.0)
    assert median_interval([9, 1, 8, 2, 7, 3, 6, 4, 5]) == (2.0, 8.0)
    assert median_interval([1, 2, 3, 4]) is None
    rng = np.random.default_rng(0)
    draws = rng.lognormal(size=(4000, 9))  # skewed: the true median is exp(0) = 1
    covered = np.mean([lo <= 1.0 <= hi for lo, hi in map(median_interval, draws)])
    assert 0.95 < covered < 0.975, covered


def test_fit_round_costs_recovers_the_costs_the_runs_paid():
    """`benchmarks.cost_fit.fit_round_costs` (the cost model's check bench_speculative prints): from runs whose decode seconds follow
    known costs per width and per unverified draft, in units of each run's own (rescaled) C(0), it recovers them;
    a width no run chose is None; too few runs give None; mixed verify widths are a clear error."""

    true_ratios, true_draft = [1.0, 1.5, 1.62, 1.9], 0.2
    rng = np.random.default_rng(0)
    runs = []
    for _ in range(12):
        c0 = 0.03 * (1 + 0.1 * rng.standard_normal())  # each run rescaled to the machine's speed then
        counts = [int(rng.integers(5, 60)), 0, int(rng.integers(0, 30)), int(rng.integers(0, 30))]
        unverified = int(rng.integers(0, min(5, counts[0]) + 1))
        skipped = counts[0] - unverified
        seconds = c0 * (float(np.dot(counts, true_ratios)) + unverified * true_draft)
        runs.append(DecodeMetrics(new_tokens=64, rounds=sum(counts), accepted_draft_tokens=0, proposed_draft_tokens=0,
                                  prefill_seconds=0.0, decode_seconds=seconds, verify_widths=[0, 1, 3, 7],
                                  width_rounds=counts, skipped_drafts=skipped, predicted_seconds=seconds,
                                  round_costs=[c0, 1.4 * c0, 1.5 * c0, 1.7 * c0], draft_cost=0.1 * c0))
    fit = fit_round_costs(runs)
    assert fit["runs"] == 12 and fit["ratios"][0] == pytest.approx(1.0)
    assert fit["ratios"][1] is None and fit["ratios_stderr"][1] is None
    for got, want in zip([fit["ratios"][i] for i in (0, 2, 3)], [1.0, 1.62, 1.9]):
        assert got == pytest.approx(want, rel=1e-6)
    assert fit["draft"] == pytest.approx(true_draft, rel=1e-6)
    assert fit["profile_ratios"] == pytest.approx([1.0, 1.4, 1.5, 1.7]) and fit["profile_draft"] == pytest.approx(0.1)
    assert "1.62+-0.00" in fit_line(fit) and "(profile 0.10)" in fit_line(fit)

    # a drafter that drafts every round: each width-0 round is an unverified draft, priced within C(0)
    always = [dataclasses.replace(m, skipped_drafts=0, decode_seconds=m.round_costs[0] * (
        float(np.dot(m.width_rounds, true_ratios)) + m.width_rounds[0] * true_draft)) for m in runs]
    fit = fit_round_costs(always)
    assert fit["draft"] is None and fit["ratios"][0] == pytest.approx(1.0 + true_draft)
    assert fit["ratios"][3] == pytest.approx(1.9, rel=1e-6)  # over the profile's C(0), not the fitted one

    # runs of ~2 plain rounds each (GSM8K's): C(0) is barely determined, so every figure stays over the profile's
    # C(0) (divided by a fitted C(0) near 0, a real fit printed negative ratios and errors)
    rng = np.random.default_rng(1)
    few = []
    for _ in range(24):
        counts = [int(rng.integers(1, 4)), 0, int(rng.integers(0, 8)), int(rng.integers(20, 30))]
        seconds = 0.025 * float(np.dot(counts, true_ratios)) * (1 + 0.03 * rng.standard_normal())
        few.append(dataclasses.replace(runs[0], width_rounds=counts, skipped_drafts=counts[0], decode_seconds=seconds,
                                       round_costs=[0.025, 0.035, 0.0375, 0.0425]))
    fit = fit_round_costs(few)
    assert fit["ratios_stderr"][0] > 0.2  # the plain round: hardly constrained by these runs
    assert abs(fit["ratios"][3] - 1.9) < 4 * fit["ratios_stderr"][3] < 0.2  # the width they mostly ran: priced
    assert all(e >= 0 for e in fit["ratios_stderr"] if e is not None)

    assert fit_round_costs(runs[:3]) is None  # 3 runs, 4 unknowns
    other = dataclasses.replace(runs[0], verify_widths=[0, 2, 7], width_rounds=[3, 4, 5], round_costs=[1.0, 1.5, 2.0])
    with pytest.raises(ValueError, match="different verify widths"):
        fit_round_costs(runs + [other])


# ---------------------------------------------------------------------------------------------------------
# Compared methods from experiment configs, and the result schema
# ---------------------------------------------------------------------------------------------------------

def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def tiny_configs(tmp_path):
    """A base on the tiny random target (built-in prompts, 8 new tokens) and two methods extending it."""
    _write(tmp_path / "base.yaml", """\
        model: {name: tiny, max_seq_len: 512}
        generation: {max_new_tokens: 8, batch_size: 1}
        data: {datasets: [{name: quickstart, limit: 3}]}
        tracking: {backend: none}
        """)
    ngram = _write(tmp_path / "ngram.yaml", """\
        extends: base.yaml
        drafter: {name: ngram, num_draft_tokens: 4, params: {max_ngram: 2}}
        scheduler: {kind: fixed}
        """)
    suffix = _write(tmp_path / "suffix.yaml", """\
        extends: base.yaml
        drafter: {name: suffix, num_draft_tokens: 4}
        verify: {policy: greedy_tree}
        scheduler: {kind: fixed}
        """)
    return ngram, suffix


def test_split_args_tells_configs_from_overrides(tmp_path):
    odd = _write(tmp_path / "a=b.yaml", "{}\n")  # an existing file is a config even with '=' in its name
    assert split_args(["x.yaml", "generation.batch_size=8", odd]) == (["x.yaml", odd], ["generation.batch_size=8"])


def test_method_configs_share_the_run_settings_or_name_the_key(tiny_configs):
    ngram, suffix = tiny_configs
    methods = load_method_configs([ngram, suffix], ["generation.batch_size=2"])
    assert [name for name, _ in methods] == ["ngram", "suffix"]
    assert all(cfg.generation.batch_size == 2 for _, cfg in methods)  # overrides apply to every config
    other = _write(Path(ngram).parent / "long.yaml", "extends: suffix.yaml\ngeneration: {max_new_tokens: 16}\n")
    with pytest.raises(ValueError, match=r"differ in generation\.max_new_tokens: ngram has 8, long has 16"):
        load_method_configs([ngram, other])
    with pytest.raises(ValueError, match=r"differ in data\.datasets\.0\.limit"):
        check_comparable([("a", load_config(ngram)), ("b", load_config(suffix, ["data.datasets.0.limit=2"]))])
    with pytest.raises(ValueError, match="both named ngram"):
        load_method_configs([ngram, ngram])


def test_the_shipped_benchmark_configs_load_and_compare():
    """configs/benchmarks/: every method config loads (its scheduler knobs exist) and they share the run settings,
    so one benchmark run can compare them all."""
    folder = Path(__file__).resolve().parents[1] / "configs" / "benchmarks"
    prompt_sets = ("base", "scaling", "untuned")  # not methods: what the methods' prompts and settings are
    paths = sorted(str(p) for p in folder.glob("*.yaml") if p.stem not in prompt_sets)
    methods = dict(load_method_configs(paths))
    assert {"ngram", "suffix", "self_spec", "draft_lm", "dspark_shipped", "hybrid"} <= set(methods)
    assert all(cfg.scheduler.kind == "adaptive" for cfg in methods.values())
    assert methods["dspark_shipped"].drafter.path == "drafters/trained/dspark_smollm2_mix"
    # draft_lm's model is the one checkpoint the registry names (the target), available offline once fetched
    from specdec.models.registry import REGISTRY

    assert methods["draft_lm"].drafter.params["model"] in REGISTRY
    assert methods["self_spec"].drafter.params == {"num_layers": 24}  # the quickstart's self-speculation row


def test_the_untuned_prompt_sets_skip_past_every_prompt_the_repo_reads():
    """configs/benchmarks/untuned.yaml: 8 prompts each of MBPP's test split, GSM8K test and HumanEval, each taken
    after the prompts every other config of the repo reads from that file (their `skip` + `limit`, and `limit`
    alone from the first record), and no training prompt set (GPTeacher, self-instruct, awesome-chatgpt-prompts)."""
    import yaml

    from benchmarks.common import prompt_overrides
    from specdec.config import load_config

    repo = Path(__file__).resolve().parents[1]
    untuned = load_config(repo / "configs" / "benchmarks" / "untuned.yaml")
    sets = {Path(d.name).name: d for d in untuned.data.datasets}
    assert set(sets) == {"mbpp.jsonl", "test.jsonl", "HumanEval.jsonl"}
    assert all(d.limit == 8 and d.sample_seed is None and d.split is None for d in sets.values())  # MBPP: test split

    def read_by_others(node):  # (file name, last record index read + 1) of every dataset entry in a config tree
        if isinstance(node, dict):
            if isinstance(node.get("name"), str) and node["name"].startswith("${SPECDEC_DATA}"):
                if node.get("sample_seed") is None:  # a seeded sample is checked by its ids in the config's comment
                    yield Path(node["name"]).name, node.get("skip", 0) + node.get("limit", 10 ** 9)
            for value in node.values():
                yield from read_by_others(value)
        elif isinstance(node, list):
            for value in node:
                yield from read_by_others(value)

    for path in (repo / "configs").rglob("*.yaml"):
        if path.name == "untuned.yaml" or "train" in path.parts:  # training data: a whole file, decontaminated
            continue
        for name, end in read_by_others(yaml.safe_load(path.read_text())):
            if name in sets and end < 10 ** 9:
                assert end <= sets[name].skip, f"{path} reads {name} up to record {end}"
    studies = repo / "configs" / "train" / "studies"
    for study in ("answers_eval_sets.yaml", "answers_untuned_sets.yaml"):  # evaluation data read by training runs
        for name, end in read_by_others(yaml.safe_load((studies / study).read_text())):
            if name in sets and end < 10 ** 9:
                assert end <= sets[name].skip, f"{study} reads {name} up to record {end}"
    overrides = prompt_overrides(str(repo / "configs" / "benchmarks" / "untuned.yaml"))
    assert overrides[1] == "generation.max_new_tokens=64" and '"skip": 192' in overrides[0]


def test_a_sweep_file_is_one_method_per_run(tiny_configs, tmp_path):
    ngram, _ = tiny_configs
    sweep = _write(tmp_path / "sweep.yaml", """\
        base: ngram.yaml
        runs:
          - {name: k2, drafter.num_draft_tokens: 2}
          - {name: k4}
        """)
    methods = load_method_configs([sweep])
    assert [(name, cfg.drafter.num_draft_tokens) for name, cfg in methods] == [("k2", 2), ("k4", 4)]


def test_bench_speculative_compares_config_methods_with_ar(tiny_configs, tmp_path):
    """The whole benchmark on the tiny target: one row per dataset and method (AR first), every greedy output
    equal to AR's in every pass, and results.json / results.md in the shared schema."""
    from benchmarks import bench_speculative

    ngram, suffix = tiny_configs
    out = tmp_path / "out"
    result = bench_speculative.main([ngram, suffix, "--repeats", "2", "--out", str(out)])
    rows = result["rows"]
    assert [r["method"] for r in rows] == ["AR", "ngram", "suffix"]
    assert all(r["same_as_ar"] == [3, 3] for r in rows[1:]), rows
    assert all(len(r["speedup_by_pass"]) == 2 for r in rows)
    data = json.loads((out / "results.json").read_text())
    meta = data["meta"]
    assert {"cpu", "cores"} <= set(meta["machine"]) and meta["commit"] and meta["date"]
    assert meta["load_avg_start"] is not None and meta["load_avg_end"] is not None
    assert meta["command"].startswith("python -m benchmarks.bench_speculative ") and "--repeats 2" in meta["command"]
    md = (out / "results.md").read_text()
    assert meta["commit"] in md and meta["command"] in md and "| quickstart | 1 | suffix |" in md


def test_batch_scaling_mixes_the_sources_and_reports_speedup_idle_and_crossover(tiny_configs, tmp_path):
    """The batch-scaling benchmark on the tiny target: the prompts of two sources as one mixed set (the largest
    batch is all of them, one batch), each prompt with its own number of new tokens, every output equal to AR's at
    every batch, the idle fraction of rows that ended early, the crossover and the plot."""
    from benchmarks import batch_scaling

    ngram, suffix = tiny_configs
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(json.dumps({"prompt": f"count {i} {i + 1} {i + 2} {i}"}) + "\n" for i in range(3)))
    prompts = _write(tmp_path / "prompts.yaml", f"""\
        generation: {{max_new_tokens: 9}}
        data: {{datasets: [{{name: quickstart, limit: 3}}, {{name: {extra}}}], chat_template: false}}
        """)
    out = tmp_path / "out"
    result = batch_scaling.main([ngram, suffix, "--prompts", prompts, "--batches", "1", "6", "--lengths", "2", "9",
                                 "--out", str(out)])
    by = {(c["method"], c["batch"]): c for c in result["cells"]}
    assert set(by) == {(m, b) for m in ("AR", "ngram", "suffix") for b in (1, 6)}
    assert all(c["same_as_ar"] == [6, 6] for (m, _), c in by.items() if m != "AR")
    assert by[("AR", 1)]["idle_fraction"] == 0  # a batch of one row never idles
    assert by[("AR", 6)]["idle_fraction"] > 0.3  # rows asking 2 tokens wait for those asking 9 (EOS aside)
    data = json.loads((out / "results.json").read_text())
    first = data["results"]["runs"]["batch_6"]["rows"][0]
    assert first["prompts"] == 6 and first["dataset"] == "mixed"
    assert (out / "speedup_vs_batch.png").stat().st_size > 0
    assert [row[0] for row in result["summary"]] == ["ngram", "suffix"]  # the floor / crossover rows, per method
    assert "crossover" in (out / "results.md").read_text()
    assert batch_scaling.crossover({1: 1.3, 8: 0.9, 16: 1.01, 32: 0.95, 64: 0.9}) == 32
    assert batch_scaling.crossover({1: 1.3, 64: 1.0}) is None and batch_scaling.crossover({1: 0.9, 4: 0.8}) == 1
    with pytest.raises(SystemExit):  # a length past the prompts config's max_new_tokens
        batch_scaling.main([ngram, "--prompts", prompts, "--lengths", "10", "--out", str(out)])


def test_batch_scaling_time_factors_multiply_to_the_speedup():
    """The three factors of a cell's time (fewer iterations, drafted rounds, plain round) multiply to AR's decode
    time over the method's, and each reads what it names: a cut draft costs the draft above a plain round, a round
    verified at width W costs C(W) / C(0) plain rounds, and the plain round is AR's step over the time per unit."""
    from benchmarks.batch_scaling import time_factors

    ar = {"row_steps": 8 * 100, "decode_s": 10.0}  # 100 steps of 0.1 s at batch 8
    # 90 iterations: 80 skipped, 4 cut (draft 0.02 s), 4 at width 1 (0.2 s), 2 at width 3 (0.3 s); C(0) = 0.1
    row = {"width_rounds": [84, 4, 2], "skipped_drafts": 80, "round_costs": [0.1, 0.2, 0.3], "draft_cost": 0.02}
    units = 80 + 4 * 1.2 + 4 * 2 + 2 * 3
    row["decode_s"] = units * 0.105  # plain rounds 5% above AR's step
    f = time_factors(row, ar, batch=8)
    assert (f["iterations"], f["cut_drafts"], f["verified_rounds"], f["ar_steps"]) == (90, 4, 6, 100)
    assert f["fewer_iterations"] == pytest.approx(100 / 90) and f["drafted_rounds"] == pytest.approx(90 / units)
    assert f["plain_round"] == pytest.approx(0.1 / 0.105)
    product = f["fewer_iterations"] * f["drafted_rounds"] * f["plain_round"]
    assert product == pytest.approx(ar["decode_s"] / row["decode_s"])
    assert time_factors({"width_rounds": None}, ar, 8) is None  # a fixed width: nothing to split
    assert time_factors({**row, "round_costs": None}, ar, 8) is None


def test_batch_scaling_refill_smoke_has_a_refilled_row_per_method_and_ars_tokens(tiny_configs, tmp_path, capsys):
    """`--smoke --refill` on the tiny target: at batch 2 (of 4 prompts, one per source; batch 4 holds them all, no
    refill) AR and the n-gram method decode every prompt in refilled rows, each prompt's output equal to static
    AR's; suffix decoding (Python state) is named as not refilled. An adaptive method runs refilled with the
    throughput objective (the n-gram method's fixed width has none). Bad refill options are errors that name them."""
    from benchmarks import batch_scaling

    ngram, suffix = tiny_configs
    adaptive = _write(tmp_path / "ngram_adaptive.yaml", """\
        extends: ngram.yaml
        scheduler: {kind: adaptive}
        """)
    sources = []
    for s in range(3):
        sources.append(tmp_path / f"source{s}.jsonl")
        sources[-1].write_text(json.dumps({"prompt": f"count {s} {s + 1} {s + 2} {s} {s + 1}"}) + "\n")
    prompts = _write(tmp_path / "prompts.yaml", f"""\
        generation: {{max_new_tokens: 9}}
        data: {{datasets: [{{name: quickstart, limit: 3}}, {', '.join(f'{{name: {p}}}' for p in sources)}],
                chat_template: false}}
        """)
    out = tmp_path / "out"
    result = batch_scaling.main([ngram, suffix, "--prompts", prompts, "--smoke", "--refill", "--out", str(out)])
    refilled = {(c["method"], c["batch"]): c for c in result["refill_cells"]}
    assert set(refilled) == {("AR", 2), ("ngram", 2)}
    assert all(c["same_as_ar"] == [4, 4] and c["prompts"] == 4 and c["refill_rows"] == 1 for c in refilled.values())
    assert refilled[("AR", 2)]["vs_refilled_ar"] == 1.0 and refilled[("AR", 2)]["tau"] == 1.0
    assert {(c["method"], c["batch"]) for c in result["cells"]} == {
        (m, b) for m in ("AR", "ngram", "suffix") for b in (1, 2, 4)}  # the static cells as before
    data = json.loads((out / "results.json").read_text())
    assert data["results"]["refill"]["curves"] == {m: {"2": refilled[(m, 2)]["vs_static_ar"]} for m in ("AR", "ngram")}
    md = (out / "results.md").read_text()
    assert "Rows refilled from the queue" in md and "| ngram refilled | 2 |" in md
    assert "Not refilled: suffix" in md
    cfg = dict(load_method_configs([adaptive, ngram]))
    assert batch_scaling.with_throughput_objective(cfg["ngram_adaptive"]).scheduler.objective == "throughput"
    assert batch_scaling.with_throughput_objective(cfg["ngram"]) == cfg["ngram"]  # a fixed width has no objective
    for bad, message in [(["--refill-rows", "2"], "give --refill too"),
                         (["--refill", "--batches", "1"], "a batch of 2 or more"),
                         (["--refill", "--refill-rows", "3", "--batches", "2", "4"], "--refill-rows must be in"),
                         (["--refill", "--refill-rows", "0"], "--refill-rows must be in")]:
        with pytest.raises(SystemExit):
            batch_scaling.main([ngram, "--prompts", prompts, *bad, "--out", str(out)])
        assert message in capsys.readouterr().err


def test_bench_speculative_counts_ar_equality_at_temperature_for_the_invariant_policies(tiny_configs, tmp_path):
    """At T > 0 the invariant policies commit AR's own sampled tokens, so "= AR" is counted (every prompt equal,
    no first divergence); rejection sampling gives a sample of AR's law, not AR's sample: not counted."""
    from benchmarks import bench_speculative

    ngram, _ = tiny_configs
    sweep = _write(tmp_path / "policies.yaml", """\
        base: ngram.yaml
        grid:
          verify.policy: [rejection_chain, invariant_chain]
        """)
    result = bench_speculative.main([sweep, "sampling.temperature=0.7", "sampling.top_p=0.95",
                                     "--out", str(tmp_path / "out")])
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["policy=invariant_chain"]["same_as_ar"] == [3, 3]
    assert rows["policy=invariant_chain"]["first_divergence"] == []
    assert rows["policy=rejection_chain"]["same_as_ar"] is None
    assert rows["policy=rejection_chain"]["first_divergence"] is None


def test_first_divergences_are_the_first_differing_token_indices():
    from types import SimpleNamespace

    from benchmarks.bench_speculative import AR, first_divergences

    prompts = [SimpleNamespace(key=k) for k in "abcd"]
    ar = [[1, 2, 3, 4], [5, 6, 7], [8, 9], [1, 1, 1]]
    spec = [[1, 2, 9, 9], [5, 6, 7], [8], [0, 1, 1]]  # c: a prefix of AR's (stopped early) differs at its end
    passes = [{AR: {"d": [(prompts, ar, None)]}, "m": {"d": [(prompts, spec, None)]}}]
    assert first_divergences(passes, "m", "d") == [0, 1, 2]


def test_the_invariant_benchmark_sweeps_load():
    """configs/benchmarks/invariant/: the cost comparison (each drafter of configs/benchmarks/ under rejection
    sampling and the invariant policy, at T 0.7 top-p 0.95; DSpark as a tree and a chain) and the divergence
    count (greedy; invariant sampling by override) load and share the run settings."""
    folder = Path(__file__).resolve().parents[1] / "configs" / "benchmarks" / "invariant"
    cost = dict(load_method_configs([str(folder / f"{d}.yaml") for d in ("ngram", "suffix", "dspark", "hybrid")]))
    assert len(cost) == 10 and {c.verify.policy for c in cost.values()} == {"rejection_chain", "invariant_chain"}
    assert all(c.sampling.temperature == 0.7 and c.sampling.top_p == 0.95 for c in cost.values())
    assert cost["dspark_chain__policy=invariant_chain"].drafter.params == {}
    assert cost["dspark_tree__policy=invariant_chain"].drafter.params == {"tree_top_k": 4, "tree_depth": 3}
    hot = ["sampling.temperature=0.7", "sampling.top_p=0.95", "verify.policy=invariant_chain"]
    divergence = dict(load_method_configs([str(folder / "divergence.yaml")], hot))
    assert set(divergence) == {"ngram", "dspark_tree"}
    assert all(c.scheduler.kind == "fixed" and c.generation.batch_size == 8 for c in divergence.values())


def test_report_writes_json_and_markdown_with_provenance(tmp_path):
    report = Report("benchmarks/bench_x.py", ["--flag", "a b"], tmp_path)
    report.table("Step", ["batch", "ms"], [[1, 2.5], [8, float("nan")]], echo=False)
    report.write({"value": float("inf")})
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["meta"]["command"] == "python -m benchmarks.bench_x --flag 'a b'"
    assert data["results"] == {"value": None} and data["tables"][0]["rows"][1] == [8, None]
    md = (tmp_path / "results.md").read_text()
    assert md.startswith("# bench_x\n") and "| 1 | 2.5 |" in md and "load average" in md


# ---------------------------------------------------------------------------------------------------------
# The README's results table
# ---------------------------------------------------------------------------------------------------------

def test_the_results_table_names_the_benchmark_configs():
    from benchmarks.results_table import BATCH_SIZES, CONFIGS, METHODS

    assert BATCH_SIZES == (1, 8)
    assert list(METHODS.values()) == ["ngram.yaml", "suffix.yaml", "dspark_shipped.yaml", "hybrid.yaml"]
    methods = load_method_configs([str(CONFIGS / name) for name in METHODS.values()])
    assert all(cfg.generation.max_new_tokens == 64 and cfg.generation.batch_size == 1 for _, cfg in methods)


def test_the_results_table_has_a_row_per_method_and_batch_with_provenance(tmp_path):
    from benchmarks.results_table import BEGIN, END, rewrite_readme, table_rows

    meta = {"machine": {"cpu": "Some CPU", "cores": 2}, "commit": "abc1234", "load_avg_start": [0.5, 0, 0],
            "load_avg_end": [1.25, 0, 0]}
    cells = [{"method": m, "batch": b, "dataset": d, "tau": 2.0, "speedup": 1.5, "same_as_ar": [8, 8]}
             for b in (1, 8) for m in ("n-gram", "hybrid") for d in ("mt_bench", "gsm8k")]
    header, rows = table_rows(cells, meta)
    assert header[:4] == ["drafter", "batch", "MT-Bench: tau · speedup · = AR", "GSM8K: tau · speedup · = AR"]
    assert [r[:2] for r in rows] == [["n-gram", 1], ["hybrid", 1], ["n-gram", 8], ["hybrid", 8]]
    assert rows[0][2:] == ["2.00 · 1.50x · 8/8", "2.00 · 1.50x · 8/8", "Some CPU, 2 cores", "abc1234", "0.50 -> 1.25"]
    # cells of another prompt set (`--prompts`) have columns of their own, named after it
    untuned = [{**c, "dataset": "mbpp", "prompt_set": "untuned"} for c in cells if c["dataset"] == "gsm8k"]
    header, rows = table_rows(cells + untuned, meta)
    assert header[2:5] == ["MT-Bench: tau · speedup · = AR", "GSM8K: tau · speedup · = AR",
                           "MBPP (untuned): tau · speedup · = AR"]

    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Results\n\n{BEGIN}\nold\n{END}\n\n## Next\n")
    rewrite_readme(readme, "| new |")
    assert readme.read_text() == f"# x\n\n## Results\n\n{BEGIN}\n| new |\n{END}\n\n## Next\n"
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="results-table"):
        rewrite_readme(readme, "| new |")


def test_the_results_table_runs_a_sweep_file(tiny_configs, tmp_path):
    """A sweep file is one row per run (configs/benchmarks/invariant/: one per policy), --smoke shrinks it, and a
    run that is not the canonical one leaves the README alone."""
    from benchmarks import results_table

    ngram, _ = tiny_configs
    sweep = _write(tmp_path / "policies.yaml", """\
        base: ngram.yaml
        grid:
          verify.policy: [rejection_chain, invariant_chain]
        """)
    readme = results_table.README.read_text()
    got = results_table.main([sweep, "sampling.temperature=0.7", "--batches", "1", "--smoke",
                              "--out", str(tmp_path / "out")])
    assert [(c["method"], c["batch"], c["prompts"]) for c in got["cells"]] == [
        ("policy=rejection_chain", 1, 1), ("policy=invariant_chain", 1, 1)]
    assert [c["same_as_ar"] for c in got["cells"]] == [None, [1, 1]]
    assert results_table.README.read_text() == readme


def test_the_results_table_runs_self_spec_and_draft_lm_on_a_prompts_config(tmp_path):
    """configs/benchmarks/self_spec.yaml and draft_lm.yaml build and decode on the tiny target (self_spec on its
    first layer, draft_lm on a tiny checkpoint of the same vocabulary), and `--prompts` gives every method another
    config's prompts in the smoke path: each column and cell names that prompt set, every output equals AR's, and
    the README is left alone. The fixed width keeps it fast (the adaptive width's skips and
    catch-ups for these drafters: tests/test_catch_up.py)."""
    from benchmarks import results_table
    from tests.test_loading import write_hf_dir

    configs = results_table.CONFIGS
    write_hf_dir(tmp_path / "draft_model")
    self_spec = _write(tmp_path / "self_spec.yaml", f"""\
        extends: {configs / "self_spec.yaml"}
        model: {{name: tiny, max_seq_len: 512}}
        drafter: {{params: {{num_layers: 1}}}}
        tracking: {{backend: none}}
        """)
    draft_lm = _write(tmp_path / "draft_lm.yaml", f"""\
        extends: {configs / "draft_lm.yaml"}
        model: {{name: tiny, max_seq_len: 512}}
        drafter: {{params: {{model: {tmp_path / "draft_model"}}}}}
        tracking: {{backend: none}}
        """)
    extra = tmp_path / "later.jsonl"
    extra.write_text("".join(json.dumps({"prompt": f"count {i} {i + 1} {i + 2} {i}"}) + "\n" for i in range(3)))
    prompts = _write(tmp_path / "held_out.yaml", f"""\
        generation: {{max_new_tokens: 16}}
        data: {{datasets: [{{name: quickstart, limit: 2}}, {{name: {extra}, skip: 2}}], chat_template: false}}
        """)
    readme = results_table.README.read_text()
    out = tmp_path / "out"
    got = results_table.main([self_spec, draft_lm, "scheduler.kind=fixed", "--prompts", prompts, "--batches", "1",
                              "--smoke", "--out", str(out)])
    assert sorted((c["method"], c["dataset"], c["prompt_set"], c["prompts"]) for c in got["cells"]) == sorted(
        (m, d, "held_out", 1) for m in ("self_spec", "draft_lm") for d in ("quickstart", "later"))
    assert all(c["same_as_ar"] == [1, 1] for c in got["cells"])
    md = (out / "results.md").read_text()
    assert "| quickstart (held_out): tau · speedup · = AR | later (held_out): tau · speedup · = AR |" in md
    assert f"prompts: {prompts} (held_out)" in md and "8 new tokens" in md  # --smoke's, not the prompts config's 16
    assert json.loads((out / "results.json").read_text())["results"]["prompts"] == prompts
    assert results_table.README.read_text() == readme
    with pytest.raises(SystemExit):  # a prompts config that does not load is the parser's error
        results_table.main([self_spec, "--prompts", str(tmp_path / "missing.yaml"), "--out", str(out)])


def test_the_readme_has_the_results_table_markers():
    from benchmarks.results_table import BEGIN, END, README

    text = README.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1 and text.index(BEGIN) < text.index(END)
    assert "python -m benchmarks.results_table" in text


def test_bench_plain_round_prices_a_skipped_draft_against_ar(tiny_configs, tmp_path):
    """bench_plain_round on the tiny target: per adaptive config, AR's step, the plain round, the catch-up and the
    profiled width-0 / widest iterations, all positive, with the results in the shared schema; a config whose
    scheduler cannot skip drafts is refused by name."""
    from benchmarks import bench_plain_round

    ngram, _ = tiny_configs
    adaptive = _write(Path(ngram).parent / "ngram_adaptive.yaml", "extends: ngram.yaml\nscheduler: {kind: adaptive}\n")
    out = tmp_path / "out"
    rows = bench_plain_round.main([adaptive, "--repeats", "1", "--prompt-len", "8", "--out", str(out)])
    assert [r["method"] for r in rows] == ["ngram_adaptive"]
    assert set(rows[0]["seconds"]) == {"ar", "plain", "catch_up", "width0", "widest"}
    assert all(v > 0 for v in rows[0]["seconds"].values()) and rows[0]["verify_widths"][0] == 0
    assert "| ngram_adaptive | 1 |" in (out / "results.md").read_text()
    with pytest.raises(ValueError, match="scheduler.kind is 'fixed'"):
        bench_plain_round.main([ngram, "--repeats", "1", "--out", str(tmp_path / "x")])


def test_bench_plain_round_times_the_catch_up_without_copying_the_loop_state(tiny_configs):
    """The catch-up bench_plain_round times is the drafter's update alone, as the loop runs it in place: its
    program's output is the drafter's state (n-gram's: nothing), not the loop state with the target's KV cache,
    which XLA copies into the output of a program that returns it undonated (the negative control: `catch_up`
    jitted whole, as the benchmark timed it when n-gram's catch-up read 87 ms at batch 16)."""
    import jax

    from benchmarks import bench_plain_round
    from benchmarks.common import build_methods
    from experiments.build import build_target
    from specdec.drafter import CATCH_UP
    from specdec.engine import catch_up

    ngram, _ = tiny_configs
    adaptive = _write(Path(ngram).parent / "ngram_adaptive.yaml", "extends: ngram.yaml\nscheduler: {kind: adaptive}\n")
    method_configs = load_method_configs([adaptive], ["generation.batch_size=4"])
    cfg = method_configs[0][1]
    target = build_target(cfg.model, cfg.mesh)
    method = build_methods(method_configs, target, log=lambda _: None)[0]
    loop = bench_plain_round.build_loop(target, method, cfg, 8)
    state = loop.state(target, 0, CATCH_UP + 1)
    cache_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state.cache))
    params = method.drafter.params
    alone = bench_plain_round.drafter_catch_up.lower(
        loop.spec, params, state.drafter_state, dataclasses.replace(state, drafter_state=None)).compile()
    whole = jax.jit(catch_up, static_argnames=("spec",)).lower(loop.spec, params, state).compile()
    assert alone.memory_analysis().output_size_in_bytes < cache_bytes <= whole.memory_analysis().output_size_in_bytes
