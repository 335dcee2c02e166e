"""`specdec run <config> [section.key=value ...]`: one experiment, AR baseline vs the configured drafter.

    summary = run_experiment(load_config("configs/experiments/headline.yaml", ["generation.batch_size=8"]))

What a run does, in order:
  1. loads the target, the drafter and the prompts of `data.datasets` (experiments/datasets.py); multi-turn
     prompts (`turns: 2`) first get the target's own greedy AR answers to their earlier turns (`own_answers`,
     kept in own_answers.json so a resumed run asks the same conversations);
  2. decodes every prompt with plain autoregressive decoding (`eval.baseline`) and with speculative decoding,
     `generation.batch_size` prompts at a time (batches never mix datasets; see `plan_batches`), each call
     warmed up first so compile time is excluded (`eval.warmup`);
  3. measures the draft/verify time split (a host-stepped profiling pass over the first batch when the
     timed loop is the compiled one, which has no split);
  4. checks losslessness (experiments/lossless.py) and, for datasets with a scorer, task quality
     (experiments/quality.py); a failed check raises after everything is written;
  5. writes, under `<output.dir>/<output.name>/`:
       config.yaml                     the resolved config
       own_answers.json                multi-turn runs: the conversations before later turns -> the answers
       answers/autoregressive.jsonl    per-prompt records in Spec-Bench's answer-file format (see RECORDS)
       answers/speculative.jsonl
       metrics/<method>.jsonl          per-batch DecodeMetrics (what the summary is computed from)
       summary.json                    tau, acceptance by position, tok/s, speedup, draft/verify time,
                                       lossless check, quality, provenance (git, versions, machine, seeds)
       table.md                        the markdown table also printed at the end
       acceptance_by_position.png, by_category.png
     and logs the same to the tracker (W&B offline by default).

Interrupted runs lose nothing: records are appended (and flushed) batch by batch, and a re-run with the same
config skips every prompt already recorded. A finished run (summary.json present) is not re-run.

RECORDS. One JSON line per prompt and method, compatible with Spec-Bench answer files:
  {"question_id", "category", "answer_id", "model_id", "tstamp",
   "choices": [{"index": 0, "turns": [text], "new_tokens": [n], "wall_time": [s], "decoding_steps": [r],
                "accept_lengths": [...]}],
   "dataset", "token_ids", "prompt_tokens", "batch_size", "batch", "batch_wall_time"}
  - wall_time: the prompt's own latency: prefill + its share of the batch's decode time, decode seconds x
    (the row's steps / the batch's loop iterations), every iteration costing about the same (static shapes; at
    batch size 1 it is the prompt's measured time). `batch_wall_time` is the whole batch's prefill + decode.
  - decoding_steps: target verification rounds after the prefill (AR: new_tokens - 1), per row at any batch size.
  - accept_lengths: tokens committed in each of the row's rounds, in round order (accepted drafts + 1; the
    engine's `SpecOutput.accept_lengths`): sum = new_tokens - 1, exactly the tokens the metrics count (a round
    cut at EOS or max_new_tokens lists what it committed). AR records hold [1] * decoding_steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

import yaml

from experiments import plots
from experiments.build import (build_drafter, build_scheduler, build_target, check_supported, codec_for, encode_prompt,
                               drafter_label, effective_policy)
from experiments.datasets import Prompt, fill_own_answers, load_all
from experiments.lossless import LosslessError, LosslessResult, check_greedy, check_sampled, skipped
from experiments.provenance import load_average, provenance
from experiments.quality import METRIC, score_all
from experiments.tracking import make_tracker
from specdec.config import ExperimentConfig, to_dict, to_yaml
from specdec.metrics import DecodeMetrics, merge, speedup
from specdec.tracking import Tracker

AR, SPEC = "autoregressive", "speculative"
SEED_NOTE = "batch i is decoded with seed sampling.seed + i (AR and speculative alike)"


class RunInterrupted(RuntimeError):
    """Raised by `max_batches` (tests) to stop a run the way a kill would, after a batch was recorded."""


# ---------------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def table(self) -> Path:
        return self.root / "table.md"

    @property
    def profile(self) -> Path:
        return self.root / "profile.json"

    @property
    def own_answers(self) -> Path:
        return self.root / "own_answers.json"

    def answers(self, method: str) -> Path:
        return self.root / "answers" / f"{method}.jsonl"

    def metrics(self, method: str) -> Path:
        return self.root / "metrics" / f"{method}.jsonl"


def _read_jsonl(path: Path) -> tuple[list[dict], bool]:
    """Records of a JSONL file and whether any line was unreadable (a write cut short by a kill)."""
    if not path.exists():
        return [], False
    out, bad = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                bad = True
    return out, bad


def _append_jsonl(path: Path, items: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False, default=_json_default) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _json_default(obj):
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _finite_or_none(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return _finite_or_none(obj)


class RecordStore:
    """The per-prompt records and per-batch metrics of one method, append-only on disk.

    A batch counts as done once its metrics line is written (after its records). On load, records without a
    metrics line (a kill between the two writes) and unreadable lines are dropped and the files rewritten."""

    def __init__(self, paths: RunPaths, method: str):
        self.method = method
        self.answers_path, self.metrics_path = paths.answers(method), paths.metrics(method)
        records, bad_r = _read_jsonl(self.answers_path)
        batches, bad_b = _read_jsonl(self.metrics_path)
        self.batches = batches
        self.done = {k for b in batches for k in b["keys"]}
        by_key = {}
        for r in records:
            key = f"{r['dataset']}/{r['question_id']}"
            if key in self.done:
                by_key[key] = r
        self.records = by_key
        if bad_r or bad_b or len(by_key) != len(records):
            self._rewrite()
        self.reused = len(self.done)

    def _rewrite(self) -> None:
        for path, items in ((self.answers_path, list(self.records.values())), (self.metrics_path, self.batches)):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items), encoding="utf-8")
            tmp.replace(path)

    def append(self, records: list[dict], batch: dict) -> None:
        _append_jsonl(self.answers_path, records)
        _append_jsonl(self.metrics_path, [batch])
        for r in records:
            self.records[f"{r['dataset']}/{r['question_id']}"] = r
        self.batches.append(batch)
        self.done.update(batch["keys"])

    def tokens(self) -> dict[str, list[int]]:
        return {k: r["token_ids"] for k, r in self.records.items()}

    def texts(self) -> dict[str, str]:
        return {k: r["choices"][0]["turns"][0] for k, r in self.records.items()}

    def merged(self, group: str | None = None, by: str = "category") -> DecodeMetrics | None:
        """All batches merged, or those whose `by` field equals `group` (a category, "<dataset> (mixed)", or with
        by="dataset" a dataset name)."""
        items = [DecodeMetrics(**b["metrics"]) for b in self.batches if group is None or b[by] == group]
        return merge(items) if items else None


# ---------------------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------------------

def make_record(method: str, model_id: str, prompt: Prompt, tokens: list[int], text: str, metrics: DecodeMetrics,
                batch_size: int, batch_index: int, prompt_tokens: int, accept_lengths: list[int],
                batch_steps: int) -> dict:
    """One answer record (RECORDS above). `accept_lengths`: the row's tokens per round (AR: [1] per step after
    the first token; speculative: `SpecOutput.accept_lengths`); `batch_steps`: the loop iterations its batch
    ran, i.e. the most steps of any of its rows."""
    steps = len(accept_lengths)
    share = steps / batch_steps if batch_steps else 1.0  # every step of the loop costs about the same
    return {
        "question_id": prompt.question_id, "category": prompt.category, "answer_id": f"{method}:{prompt.key}",
        "model_id": model_id, "tstamp": time.time(),
        "choices": [{"index": 0, "turns": [text], "new_tokens": [len(tokens)],
                     "wall_time": [metrics.prefill_seconds + share * metrics.decode_seconds],
                     "decoding_steps": [steps], "accept_lengths": list(accept_lengths)}],
        "dataset": prompt.dataset, "token_ids": list(tokens), "prompt_tokens": prompt_tokens,
        "batch_size": batch_size, "batch": batch_index,
        "batch_wall_time": metrics.prefill_seconds + metrics.decode_seconds,
    }


def plan_batches(prompts: list[Prompt], batch_size: int) -> list[list[Prompt]]:
    """Chunks of at most `batch_size` prompts that never mix datasets; within a dataset prompts are ordered by
    category (stable), so a batch mixes categories only where a category has fewer prompts than a batch."""
    by_dataset: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_dataset.setdefault(p.dataset, []).append(p)
    out = []
    for items in by_dataset.values():
        order = {c: i for i, c in enumerate(dict.fromkeys(p.category for p in items))}
        items = sorted(items, key=lambda p: order[p.category])
        out += [items[i: i + batch_size] for i in range(0, len(items), batch_size)]
    return out


def batch_group(batch: list[Prompt]) -> str:
    """What a batch's metrics are reported under: its category, or "<dataset> (mixed)" when it mixes several
    (per-category numbers cannot be separated inside one batch)."""
    cats = {p.category for p in batch}
    return batch[0].category if len(cats) == 1 else f"{batch[0].dataset} (mixed)"


# ---------------------------------------------------------------------------------------------------------
# Summary and table
# ---------------------------------------------------------------------------------------------------------

def _metrics_block(m: DecodeMetrics | None) -> dict | None:
    return None if m is None else _jsonable(m.summary())


def _category_block(ar: DecodeMetrics | None, spec: DecodeMetrics | None, n: int) -> dict:
    out = {"prompts": n}
    if spec is not None:
        out.update(tau=spec.tau, acceptance_rate=spec.acceptance_rate, tokens_per_second=spec.tokens_per_second)
    if ar is not None:
        out["ar_tokens_per_second"] = ar.tokens_per_second
    out["speedup"] = speedup(ar, spec) if ar is not None and spec is not None else None
    return _jsonable(out)


def _fmt(x, spec: str = ".2f", none: str = "-") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, spec)


def markdown_table(summary: dict) -> str:
    """The run's table: AR vs speculative overall, then per category, then the checks."""
    lines = [f"### {summary['run']}: {summary['drafter']} / {summary['policy']}, batch {summary['batch_size']}, "
             f"T={summary['temperature']}, {summary['max_new_tokens']} new tokens, {summary['prompts']} prompts", "",
             "| method | tau | accept rate | tok/s | ms/token | speedup vs AR |", "|---|---|---|---|---|---|"]
    ar, spec = summary.get("autoregressive"), summary["speculative"]
    if ar:
        lines.append(f"| autoregressive | 1.00 | - | {_fmt(ar['tokens_per_second'], '.1f')} | "
                     f"{_fmt(ar['time_per_output_token_ms'], '.1f')} | 1.00x |")
    lines.append(f"| {summary['drafter']} | {_fmt(spec['tau'])} | {_fmt(spec['acceptance_rate'])} | "
                 f"{_fmt(spec['tokens_per_second'], '.1f')} | {_fmt(spec['time_per_output_token_ms'], '.1f')} | "
                 f"{_fmt(summary['speedup'])}x |")
    lines += ["", "| category | prompts | tau | AR tok/s | spec tok/s | speedup |", "|---|---|---|---|---|---|"]
    for cat, c in summary["by_category"].items():
        lines.append(f"| {cat} | {c['prompts']} | {_fmt(c.get('tau'))} | {_fmt(c.get('ar_tokens_per_second'), '.1f')}"
                     f" | {_fmt(c.get('tokens_per_second'), '.1f')} | {_fmt(c.get('speedup'))}x |")
    dv = summary.get("draft_verify") or {}
    lines += ["", f"- draft / verify time: {_fmt(dv.get('draft_seconds'), '.2f')} s / "
                  f"{_fmt(dv.get('verify_seconds'), '.2f')} s (draft fraction {_fmt(dv.get('draft_fraction'))}; "
                  f"{dv.get('source', 'n/a')})",
              f"- lossless check: {summary['lossless']['description']}"]
    if spec.get("width_rounds"):  # the adaptive verify width: its choices and its cost model vs the measurement
        by_width = dict(zip(spec["verify_widths"], spec["width_rounds"]))
        lines.append(f"- adaptive width: loop iterations by verify width {by_width}, "
                     f"{spec['skipped_drafts']} skipped the draft; predicted "
                     f"{_fmt(spec.get('predicted_tokens_per_second'), '.1f')} tok/s vs measured "
                     f"{_fmt(spec['tokens_per_second'], '.1f')}")
    for name, q in (summary.get("quality") or {}).items():
        vals = ", ".join(f"{m} {_fmt(q.get(m), '.3f')}" for m in (AR, SPEC) if m in q)
        if summary["temperature"] == 0:
            same = {True: "identical", False: "DIFFERENT", None: "n/a"}[q.get("identical")]
        else:  # sampled outputs are not expected to match prompt by prompt
            same = {True: "same per-prompt results", False: "per-prompt results differ, as sampling allows",
                    None: "n/a"}[q.get("identical")]
        lines.append(f"- {name} {q['metric']} (n={q['n']}): {vals} ({same})")
    if summary.get("policy_note"):
        lines.append(f"- note: {summary['policy_note']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------

def _comparable(cfg_dict: dict) -> dict:
    """The parts of a config that decide what a run's records mean (tracking and naming do not)."""
    return {k: v for k, v in cfg_dict.items() if k not in ("tracking", "output", "description")}


def _check_or_write_config(paths: RunPaths, cfg: ExperimentConfig) -> None:
    current = to_dict(cfg)
    if paths.config.exists():
        stored = yaml.safe_load(paths.config.read_text()) or {}
        a, b = _comparable(stored), _comparable(current)
        if a != b:
            diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            raise ValueError(f"{paths.root} holds a run with a different config (sections differ: {', '.join(diff)}); "
                             "resuming would mix results. Choose another output.name or delete that directory.")
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.config.write_text(to_yaml(cfg))


def baseline_key(cfg: ExperimentConfig) -> str:
    """Runs with equal keys decode the same prompts the same way under AR, so a sweep measures AR once."""
    gen = dataclasses.replace(cfg.generation, compiled_loop=True)
    return json.dumps({"model": to_dict(cfg.model), "data": to_dict(cfg.data), "sampling": to_dict(cfg.sampling),
                       "generation": to_dict(gen), "warmup": cfg.eval.warmup}, sort_keys=True)


def own_answers(target, codec, chat: bool, cfg: ExperimentConfig, store: Path,
                echo: Callable[[str], None]) -> Callable[[list[list[dict]]], list[str]]:
    """The answerer `fill_own_answers` asks for the turns before a later MT-Bench turn, as Spec-Bench makes them:
    the target's greedy plain-AR answer (generation.max_new_tokens at most), decoded without special tokens and
    stripped. Answers are kept in `store` (conversation JSON -> answer) and reused, so a resumed run and its
    speculative and AR phases see the same conversations."""
    from specdec.generate import generate
    from specdec.sampling import GREEDY

    def answer(conversations: list[list[dict]]) -> list[str]:
        known = json.loads(store.read_text()) if store.exists() else {}
        todo = [c for c in conversations if json.dumps(c) not in known]
        if todo:
            echo(f"answering {len(todo)} earlier turn(s) with greedy AR decoding (multi-turn prompts)")
        size = cfg.generation.batch_size
        for start in range(0, len(todo), size):
            batch = todo[start: start + size]
            out = generate(target, [codec.encode_messages(c, chat=chat) for c in batch], cfg.generation.max_new_tokens,
                           GREEDY, max_seq_len=cfg.model.max_seq_len)
            known.update((json.dumps(c), codec.decode(t).strip()) for c, t in zip(batch, out.tokens))
            store.parent.mkdir(parents=True, exist_ok=True)
            store.write_text(json.dumps(known, indent=1, ensure_ascii=False))
        return [known[json.dumps(c)] for c in conversations]

    return answer


def run_experiment(cfg: ExperimentConfig, *, out_dir: str | Path | None = None, tracker: Tracker | None = None,
                   progress: bool = True, baseline_cache: dict | None = None, max_batches: int | None = None,
                   echo: Callable[[str], None] = print) -> dict:
    """Run (or resume) one experiment and return its summary; see the module docstring."""
    from tqdm.auto import tqdm

    from specdec.engine import speculative_generate
    from specdec.generate import ar_metrics, generate

    check_supported(cfg)
    name = cfg.output.name or "run"
    paths = RunPaths(Path(out_dir) if out_dir is not None else Path(cfg.output.dir) / name)
    _check_or_write_config(paths, cfg)
    if paths.summary.exists():
        echo(f"{paths.root}: already complete (summary.json present); delete it to run again")
        return json.loads(paths.summary.read_text())

    started, load_start = time.time(), load_average()
    target = build_target(cfg.model, cfg.mesh)
    codec = codec_for(target)
    chat = cfg.data.chat_template and codec.chat_template is not None
    prompts = load_all(cfg.data.datasets, chat=chat)
    fill_own_answers(prompts, own_answers(target, codec, chat, cfg, paths.own_answers, echo))
    ids = {p.key: encode_prompt(codec, p, chat) for p in prompts}
    drafter, dparams = build_drafter(cfg, target)
    policy, policy_note = effective_policy(cfg.verify, drafter)
    # the engine's per-round choices of what to verify: the scheduler and the verify-width buckets
    engine_opts = {"scheduler": build_scheduler(cfg, target, drafter, log=echo),
                   "verify_buckets": cfg.verify.buckets}
    sampling = cfg.sampling.to_params()
    label = drafter_label(drafter, dparams)
    batches = plan_batches(prompts, cfg.generation.batch_size)
    gen, max_len = cfg.generation, cfg.model.max_seq_len
    compiled = False if not gen.compiled_loop else (None if not drafter.jittable else True)

    counts = ", ".join(f"{d}: {sum(1 for p in prompts if p.dataset == d)}"
                       for d in dict.fromkeys(p.dataset for p in prompts))
    echo(f"{name}: {len(prompts)} prompts ({counts}); {label} / {policy.name}; batch {gen.batch_size}, "
         f"T={cfg.sampling.temperature:g}, {gen.max_new_tokens} new tokens -> {paths.root}/")
    own_tracker = tracker is None
    if own_tracker:
        tracker = make_tracker(cfg.tracking, run_name=name, out_dir=paths.root, config=to_dict(cfg))
    else:
        tracker.log_config(to_dict(cfg))
    stores = {AR: RecordStore(paths, AR), SPEC: RecordStore(paths, SPEC)}
    processed = 0

    def decode_ar(batch_ids, seed):
        out = generate(target, batch_ids, gen.max_new_tokens, sampling, seed=seed, max_seq_len=max_len,
                       warmup=cfg.eval.warmup)
        return out.tokens, ar_metrics(out), [[1] * max(len(t) - 1, 0) for t in out.tokens]

    def decode_spec(batch_ids, seed):
        out = speculative_generate(target, drafter, batch_ids, policy=policy, max_new_tokens=gen.max_new_tokens,
                                   sampling=sampling, seed=seed, compiled=compiled, max_seq_len=max_len,
                                   warmup=cfg.eval.warmup, **engine_opts)
        return out.tokens, out.metrics, out.accept_lengths

    def phase(method: str, decode, model_id: str):
        nonlocal processed
        store = stores[method]
        pending_total = sum(1 for b in batches for p in b if p.key not in store.done)
        if not pending_total:
            return
        bar = tqdm(total=pending_total, desc=f"{name}: {method}", unit="prompt", disable=not progress,
                   file=sys.stderr, dynamic_ncols=True)
        try:
            for index, batch in enumerate(batches):
                pending = [p for p in batch if p.key not in store.done]
                if not pending:
                    continue
                if max_batches is not None and processed >= max_batches:
                    raise RunInterrupted(f"stopped after {processed} batches (max_batches)")
                seed = cfg.sampling.seed + index
                tokens, m, accepts = decode([ids[p.key] for p in pending], seed)
                steps = max(len(a) for a in accepts)
                records = [make_record(method, model_id, p, t, codec.decode(t), m, len(pending), index, len(ids[p.key]),
                                       a, steps) for p, t, a in zip(pending, tokens, accepts)]
                store.append(records, {"batch": index, "dataset": pending[0].dataset,
                                       "category": batch_group(batch),
                                       "keys": [p.key for p in pending], "seed": seed,
                                       "metrics": dataclasses.asdict(m)})
                processed += 1
                tracker.log_metrics({f"{method}/tokens_per_second": _finite_or_none(m.tokens_per_second),
                                     f"{method}/tau": _finite_or_none(m.tau), f"{method}/batch": index})
                bar.update(len(pending))
                bar.set_postfix(tok_s=f"{m.tokens_per_second:.1f}", tau=f"{m.tau:.2f}")
        finally:
            bar.close()

    baseline_source = "this run"
    try:
        if cfg.eval.baseline:
            key = baseline_key(cfg)
            cached = None if baseline_cache is None else baseline_cache.get(key)
            if cached is not None and not stores[AR].done:
                for batch in cached["batches"]:
                    keys = set(batch["keys"])
                    stores[AR].append([r for r in cached["records"] if f"{r['dataset']}/{r['question_id']}" in keys],
                                      {**batch, "reused_from": cached["source"]})
                baseline_source = cached["source"]
            phase(AR, decode_ar, "autoregressive")
            if baseline_cache is not None and key not in baseline_cache and baseline_source == "this run":
                baseline_cache[key] = {"records": list(stores[AR].records.values()),
                                       "batches": list(stores[AR].batches), "source": name}
        phase(SPEC, decode_spec, label)
    except KeyboardInterrupt:
        done = {m: len(s.done) for m, s in stores.items()}
        echo(f"\ninterrupted: records kept in {paths.root} ({done}); run the same command again to resume")
        if own_tracker:
            tracker.finish()
        raise
    except BaseException:
        if own_tracker:
            tracker.finish()
        raise

    try:
        return _finish(cfg, name, paths, prompts, ids, stores, tracker, target, drafter, label, policy, policy_note,
                       sampling, batches, compiled, baseline_source, started, load_start, echo,
                       decode_ar if not cfg.eval.baseline else None, chat, engine_opts)
    finally:
        if own_tracker:
            tracker.finish()


def _draft_verify_split(paths, target, drafter, policy, sampling, batches, ids, cfg, spec_m, compiled, echo,
                        name, engine_opts) -> dict:
    """Draft vs verify seconds: from the timed run when it was host-stepped, else from a profiling pass."""
    from specdec.engine import speculative_generate

    if spec_m.draft_seconds is not None and spec_m.verify_seconds is not None:
        d, v, source = spec_m.draft_seconds, spec_m.verify_seconds, "timed run (host-stepped loop)"
    else:
        if paths.profile.exists():
            prof = json.loads(paths.profile.read_text())
        else:
            first = [ids[p.key] for p in batches[0]]
            echo(f"{name}: draft/verify profiling pass (host-stepped, {len(first)} prompts) ...")
            out = speculative_generate(target, drafter, first, policy=policy,
                                       max_new_tokens=cfg.generation.max_new_tokens, sampling=sampling,
                                       seed=cfg.sampling.seed, compiled=False, max_seq_len=cfg.model.max_seq_len,
                                       warmup=True, **engine_opts)
            prof = {"prompts": len(first), "draft_seconds": out.metrics.draft_seconds,
                    "verify_seconds": out.metrics.verify_seconds, "decode_seconds": out.metrics.decode_seconds}
            paths.profile.write_text(json.dumps(prof, indent=2))
        d, v = prof["draft_seconds"], prof["verify_seconds"]
        source = (f"host-stepped profiling pass over the first batch ({prof['prompts']} prompts); the timed "
                  "compiled loop has no split")
    total = (d or 0) + (v or 0)
    return {"draft_seconds": d, "verify_seconds": v, "draft_fraction": d / total if total else None, "source": source}


def _lossless(cfg, prompts, ids, stores, target, drafter, policy, sampling, decode_ar,
              engine_opts) -> LosslessResult:
    n = cfg.eval.lossless_check.samples
    if not policy.lossless:
        return skipped(f"policy {policy.name!r} is LOSSY (it accepts tokens the target would not sample with "
                       "the same probabilities); no losslessness check applies")
    if n == 0:
        return skipped("disabled (eval.lossless_check.samples = 0)")
    spec_tokens = stores[SPEC].tokens()
    keys = [p.key for p in prompts if p.key in spec_tokens]
    step = max(len(keys) // max(n, 1), 1)
    sample_keys = keys[::step][:n]
    if sampling.greedy:
        ar_tokens = stores[AR].tokens()
        if decode_ar is not None:  # baseline off: run AR on the sample just for the check
            for k in sample_keys:
                ar_tokens[k] = decode_ar([ids[k]], cfg.sampling.seed)[0][0]
        checked = [k for k in keys if k in ar_tokens]
        if len(checked) < min(n, len(keys)):
            raise RuntimeError("internal: fewer AR outputs than lossless_check.samples")
        return check_greedy(ar_tokens, spec_tokens, checked)
    return check_sampled(target, drafter, {k: ids[k] for k in sample_keys}, policy=policy, sampling=sampling,
                         seed=cfg.sampling.seed + 10_000, max_seq_len=cfg.model.max_seq_len,
                         **engine_opts)


def _finish(cfg, name, paths, prompts, ids, stores, tracker, target, drafter, label, policy, policy_note, sampling,
            batches, compiled, baseline_source, started, load_start, echo, decode_ar, chat, engine_opts) -> dict:
    ar_m, spec_m = stores[AR].merged(), stores[SPEC].merged()
    groups: dict[str, int] = {}
    for batch in batches:
        groups[batch_group(batch)] = groups.get(batch_group(batch), 0) + len(batch)
    categories = list(groups)
    by_category = {c: _category_block(stores[AR].merged(c), stores[SPEC].merged(c), n) for c, n in groups.items()}
    split = _draft_verify_split(paths, target, drafter, policy, sampling, batches, ids, cfg, spec_m, compiled,
                                echo, name, engine_opts)
    if not sampling.greedy and policy.lossless and cfg.eval.lossless_check.samples:
        echo(f"{name}: sampled lossless check ({cfg.eval.lossless_check.samples} prompts x 128 samples) ...")
    lossless = _lossless(cfg, prompts, ids, stores, target, drafter, policy, sampling, decode_ar, engine_opts)
    quality = None
    if any(p.layout in METRIC for p in prompts):
        texts = {m: s.texts() for m, s in stores.items() if s.records}
        quality = score_all(prompts, texts)
    acc = spec_m.acceptance_by_position()
    summary = _jsonable({
        "run": name, "description": cfg.description, "status": "complete",
        "model": cfg.model.name, "backend": cfg.model.backend, "dtype": cfg.model.dtype,
        "drafter": label, "drafter_name": drafter.name, "drafter_kind": drafter.kind,
        "num_draft_tokens": drafter.num_draft_tokens, "policy": policy.name, "policy_note": policy_note,
        "lossy": not policy.lossless, "temperature": cfg.sampling.temperature, "batch_size": cfg.generation.batch_size,
        "max_new_tokens": cfg.generation.max_new_tokens,
        "compiled_loop": bool(cfg.generation.compiled_loop and drafter.jittable),
        "chat_template_applied": bool(chat), "prompts": len(prompts),
        "datasets": {d: sum(1 for p in prompts if p.dataset == d) for d in dict.fromkeys(p.dataset for p in prompts)},
        # the headline numbers, flat (sweep reports and W&B read these)
        "tau": spec_m.tau, "acceptance_rate": spec_m.acceptance_rate, "tokens_per_second": spec_m.tokens_per_second,
        "ar_tokens_per_second": ar_m.tokens_per_second if ar_m else None,
        "speedup": speedup(ar_m, spec_m) if ar_m else None,
        "time_per_output_token_ms": spec_m.time_per_output_token_ms,
        "acceptance_by_position": acc,
        "draft_verify": split,
        "speculative": _metrics_block(spec_m), "autoregressive": _metrics_block(ar_m),
        "by_category": by_category,
        "lossless": {**lossless.to_dict(), "description": lossless.describe()},
        "quality": quality,
        "records": {m: {"prompts": len(s.done), "reused_from_earlier_invocation": s.reused} for m, s in stores.items()},
        "baseline_source": baseline_source if cfg.eval.baseline else None,
        "seeds": {"sampling.seed": cfg.sampling.seed, "model.seed": cfg.model.seed, "batches": SEED_NOTE,
                  "lossless_check": cfg.sampling.seed + 10_000},
        "provenance": provenance(),
        "timing": {"started": started, "finished": time.time(), "wall_seconds": time.time() - started,
                   "load_average_start": load_start, "load_average_end": load_average(),
                   "note": "tok/s = generated tokens / decode seconds (prefill excluded, compile excluded by "
                           "warm-up); the machine may be shared, see load_average"},
    })
    quality_mismatch = sampling.greedy and any(q.get("identical") is False for q in (quality or {}).values())
    if quality_mismatch and lossless.passed:
        lossless.passed = False
        summary["lossless"]["passed"] = False
        summary["lossless"]["description"] += "; but task scores DIFFER between AR and speculative"
    if lossless.passed is False:
        summary["status"] = "failed: lossless check"

    # Outputs: table, plots, summary (last, so its presence means "complete").
    table = markdown_table(summary)
    paths.table.write_text(table + "\n")
    images = {"acceptance_by_position": plots.acceptance_by_position(
        acc, f"{name}: {label} / {policy.name}",
        paths.root / "acceptance_by_position.png")}
    cats = [c for c in categories if by_category[c].get("tau") is not None]
    images["by_category"] = plots.by_category(
        cats, [by_category[c]["tau"] for c in cats],
        [by_category[c].get("ar_tokens_per_second") or 0.0 for c in cats],
        [by_category[c].get("tokens_per_second") or 0.0 for c in cats], f"{name}: {label}",
        paths.root / "by_category.png")
    summary["files"] = {"table": paths.table.name, "plots": {k: v.name for k, v in images.items()},
                        "answers": {m: str(paths.answers(m).relative_to(paths.root)) for m in stores}}

    tracker.log_summary({k: v for k, v in summary.items() if k not in ("provenance",)})
    tracker.log_config({"provenance": summary["provenance"]})
    rows = []
    for method, store in stores.items():
        for r in store.records.values():
            c = r["choices"][0]
            rows.append([method, r["dataset"], str(r["question_id"]), r["category"], c["new_tokens"][0],
                         c["wall_time"][0], r["batch_size"]])
    tracker.log_table("records", ["method", "dataset", "question_id", "category", "new_tokens", "wall_time",
                                  "batch_size"], rows)
    tracker.log_table("by_category", ["category", "prompts", "tau", "ar_tokens_per_second", "tokens_per_second",
                                      "speedup"],
                      [[c, b["prompts"], b.get("tau"), b.get("ar_tokens_per_second"), b.get("tokens_per_second"),
                        b.get("speedup")] for c, b in by_category.items()])
    for key, path in images.items():
        tracker.log_image(key, path)

    if lossless.passed is not False:
        paths.summary.write_text(json.dumps(summary, indent=2) + "\n")
    else:  # keep the evidence, but not as a finished run: a rerun repeats the check
        (paths.root / "summary.failed.json").write_text(json.dumps(summary, indent=2) + "\n")
    echo(table)
    echo(f"\nwrote {paths.root}/ (summary.json, table.md, answers/, plots)")
    if lossless.passed is False:
        raise LosslessError(f"LOSSLESS CHECK FAILED in run {name!r}: {summary['lossless']['description']} "
                            f"(details: {paths.root / 'summary.failed.json'})")
    return summary


def default_name(config_path: str | Path | None) -> str:
    return Path(config_path).stem if config_path else "run"


def main_run(config_path: str, overrides: list[str], *, progress: bool = True) -> dict:
    """The `specdec run` entry point: config file + overrides; output.name defaults to the file's stem."""
    from specdec.config import apply_overrides, load_config

    cfg = load_config(config_path, overrides)
    if cfg.output.name is None:
        cfg = apply_overrides(cfg, {"output.name": default_name(config_path)})
    return run_experiment(cfg, progress=progress)


__all__ = ["run_experiment", "main_run", "markdown_table", "RunInterrupted", "LosslessError", "AR", "SPEC",
           "RunPaths", "RecordStore", "make_record", "plan_batches", "baseline_key"]

