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
       answers/autoregressive.jsonl    per-prompt records in Spec-Bench's answer-file format (RECORDS in
       answers/speculative.jsonl       experiments/store.py)
       metrics/<method>.jsonl          per-batch DecodeMetrics (what the summary is computed from)
       summary.json                    tau, acceptance by position, tok/s, speedup, draft/verify time,
                                       lossless check, quality, provenance (git, versions, machine, seeds)
       table.md                        the markdown table also printed at the end
       acceptance_by_position.png, by_category.png
     and logs the same to the tracker (W&B offline by default).

This file is the orchestration: the phases above, which share one `RunContext` (experiments/context.py). The files and records are
experiments/store.py's (`RunPaths`, `RecordStore`); the summary, the table and the plots experiments/report.py's.

Interrupted runs lose nothing: records are appended (and flushed) batch by batch, and a re-run with the same
config skips every prompt already recorded. A finished run (summary.json present) is not re-run.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Callable

import yaml

from experiments import report
from experiments.build import (build_drafter, build_scheduler, build_target, check_supported, codec_for, encode_prompt,
                               drafter_label, effective_policy)
from experiments.context import RunContext
from experiments.datasets import Prompt, fill_own_answers, load_all
from experiments.lossless import LosslessError, LosslessResult, check_greedy, check_sampled, skipped
from experiments.provenance import load_average
from experiments.quality import METRIC, score_all
from experiments.store import AR, SPEC, RecordStore, RunPaths, finite_or_none, make_record
from experiments.tracking import make_tracker
from specdec.config import ExperimentConfig, to_dict, to_yaml
from specdec.metrics import DecodeMetrics
from specdec.tracking import Tracker


class RunInterrupted(RuntimeError):
    """Raised by `max_batches` (tests) to stop a run the way a kill would, after a batch was recorded."""


# ---------------------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------------------

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
# Setting up
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
    label = drafter_label(drafter, dparams)
    batches = plan_batches(prompts, cfg.generation.batch_size)
    gen = cfg.generation
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
    ctx = RunContext(cfg=cfg, name=name, paths=paths, prompts=prompts, ids=ids, batches=batches, codec=codec, chat=chat,
                     target=target, drafter=drafter, label=label, policy=policy, policy_note=policy_note,
                     sampling=cfg.sampling.to_params(), compiled=compiled, engine_opts=engine_opts, tracker=tracker,
                     echo=echo, progress=progress, max_batches=max_batches, started=started, load_start=load_start)
    stores = {AR: RecordStore(paths, AR), SPEC: RecordStore(paths, SPEC)}
    try:
        try:
            baseline_source = _decode_all(ctx, stores, baseline_cache)
        except KeyboardInterrupt:
            done = {m: len(s.done) for m, s in stores.items()}
            echo(f"\ninterrupted: records kept in {paths.root} ({done}); run the same command again to resume")
            raise
        return _finish(ctx, stores, baseline_source)
    finally:
        if own_tracker:
            tracker.finish()


# ---------------------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------------------

def _decode_ar(ctx: RunContext, batch_ids: list[list[int]], seed: int):
    """(tokens, metrics, accept lengths) of AR decoding on one batch; AR commits one token per step."""
    from specdec.generate import ar_metrics, generate

    out = generate(ctx.target, batch_ids, ctx.cfg.generation.max_new_tokens, ctx.sampling, seed=seed,
                   max_seq_len=ctx.cfg.model.max_seq_len, warmup=ctx.cfg.eval.warmup)
    return out.tokens, ar_metrics(out), [[1] * max(len(t) - 1, 0) for t in out.tokens]


def _decode_spec(ctx: RunContext, batch_ids: list[list[int]], seed: int):
    """(tokens, metrics, accept lengths) of speculative decoding on one batch."""
    from specdec.engine import speculative_generate

    out = speculative_generate(ctx.target, ctx.drafter, batch_ids, policy=ctx.policy,
                               max_new_tokens=ctx.cfg.generation.max_new_tokens, sampling=ctx.sampling, seed=seed,
                               compiled=ctx.compiled, max_seq_len=ctx.cfg.model.max_seq_len,
                               warmup=ctx.cfg.eval.warmup, **ctx.engine_opts)
    return out.tokens, out.metrics, out.accept_lengths


def _phase(ctx: RunContext, store: RecordStore, decode, model_id: str, processed: int) -> int:
    """Decodes (`decode(ctx, batch_ids, seed)`) the prompts `store` has not recorded, batch by batch, appending
    each batch to the store as it finishes. `processed`: batches decoded so far in this invocation (counted
    against `max_batches`); returns it with this phase's added."""
    from tqdm.auto import tqdm

    method = store.method
    pending_total = sum(1 for b in ctx.batches for p in b if p.key not in store.done)
    if not pending_total:
        return processed
    bar = tqdm(total=pending_total, desc=f"{ctx.name}: {method}", unit="prompt", disable=not ctx.progress,
               file=sys.stderr, dynamic_ncols=True)
    try:
        for index, batch in enumerate(ctx.batches):
            pending = [p for p in batch if p.key not in store.done]
            if not pending:
                continue
            if ctx.max_batches is not None and processed >= ctx.max_batches:
                raise RunInterrupted(f"stopped after {processed} batches (max_batches)")
            seed = ctx.cfg.sampling.seed + index
            tokens, m, accepts = decode(ctx, [ctx.ids[p.key] for p in pending], seed)
            steps = max(len(a) for a in accepts)
            records = [make_record(method, model_id, p, t, ctx.codec.decode(t), m, len(pending), index,
                                   len(ctx.ids[p.key]), a, steps) for p, t, a in zip(pending, tokens, accepts)]
            store.append(records, {"batch": index, "dataset": pending[0].dataset,
                                   "category": batch_group(batch),
                                   "keys": [p.key for p in pending], "seed": seed,
                                   "metrics": dataclasses.asdict(m)})
            processed += 1
            ctx.tracker.log_metrics({f"{method}/tokens_per_second": finite_or_none(m.tokens_per_second),
                                     f"{method}/tau": finite_or_none(m.tau), f"{method}/batch": index})
            bar.update(len(pending))
            bar.set_postfix(tok_s=f"{m.tokens_per_second:.1f}", tau=f"{m.tau:.2f}")
    finally:
        bar.close()
    return processed


def _decode_all(ctx: RunContext, stores: dict[str, RecordStore], baseline_cache: dict | None) -> str:
    """The AR phase (unless eval.baseline is off) and the speculative one. A sweep's `baseline_cache` lends
    this run the AR records of an earlier run with the same `baseline_key`, and keeps this run's for later ones.
    Returns where the AR records came from: "this run" or the name of the run that decoded them."""
    baseline_source = "this run"
    processed = 0
    if ctx.cfg.eval.baseline:
        key = baseline_key(ctx.cfg)
        cached = None if baseline_cache is None else baseline_cache.get(key)
        if cached is not None and not stores[AR].done:
            for batch in cached["batches"]:
                keys = set(batch["keys"])
                stores[AR].append([r for r in cached["records"] if f"{r['dataset']}/{r['question_id']}" in keys],
                                  {**batch, "reused_from": cached["source"]})
            baseline_source = cached["source"]
        processed = _phase(ctx, stores[AR], _decode_ar, "autoregressive", processed)
        if baseline_cache is not None and key not in baseline_cache and baseline_source == "this run":
            baseline_cache[key] = {"records": list(stores[AR].records.values()),
                                   "batches": list(stores[AR].batches), "source": ctx.name}
    _phase(ctx, stores[SPEC], _decode_spec, ctx.label, processed)
    return baseline_source


# ---------------------------------------------------------------------------------------------------------
# After decoding: the time split, the checks, the report
# ---------------------------------------------------------------------------------------------------------

def _draft_verify_split(ctx: RunContext, spec_m: DecodeMetrics) -> dict:
    """Draft vs verify seconds: from the timed run when it was host-stepped, else from a profiling pass."""
    from specdec.engine import speculative_generate

    if spec_m.draft_seconds is not None and spec_m.verify_seconds is not None:
        d, v, source = spec_m.draft_seconds, spec_m.verify_seconds, "timed run (host-stepped loop)"
    else:
        cfg, paths = ctx.cfg, ctx.paths
        if paths.profile.exists():
            prof = json.loads(paths.profile.read_text())
        else:
            first = [ctx.ids[p.key] for p in ctx.batches[0]]
            ctx.echo(f"{ctx.name}: draft/verify profiling pass (host-stepped, {len(first)} prompts) ...")
            out = speculative_generate(ctx.target, ctx.drafter, first, policy=ctx.policy,
                                       max_new_tokens=cfg.generation.max_new_tokens, sampling=ctx.sampling,
                                       seed=cfg.sampling.seed, compiled=False, max_seq_len=cfg.model.max_seq_len,
                                       warmup=True, **ctx.engine_opts)
            prof = {"prompts": len(first), "draft_seconds": out.metrics.draft_seconds,
                    "verify_seconds": out.metrics.verify_seconds, "decode_seconds": out.metrics.decode_seconds}
            paths.profile.write_text(json.dumps(prof, indent=2))
        d, v = prof["draft_seconds"], prof["verify_seconds"]
        source = (f"host-stepped profiling pass over the first batch ({prof['prompts']} prompts); the timed "
                  "compiled loop has no split")
    total = (d or 0) + (v or 0)
    return {"draft_seconds": d, "verify_seconds": v, "draft_fraction": d / total if total else None, "source": source}


def _lossless(ctx: RunContext, stores: dict[str, RecordStore]) -> LosslessResult:
    cfg, policy, sampling = ctx.cfg, ctx.policy, ctx.sampling
    n = cfg.eval.lossless_check.samples
    if not policy.lossless:
        return skipped(f"policy {policy.name!r} is LOSSY (it accepts tokens the target would not sample with "
                       "the same probabilities); no losslessness check applies")
    if n == 0:
        return skipped("disabled (eval.lossless_check.samples = 0)")
    spec_tokens = stores[SPEC].tokens()
    keys = [p.key for p in ctx.prompts if p.key in spec_tokens]
    step = max(len(keys) // max(n, 1), 1)
    sample_keys = keys[::step][:n]
    if sampling.greedy:
        ar_tokens = stores[AR].tokens()
        if not cfg.eval.baseline:  # no AR phase: run AR on the sample just for the check
            for k in sample_keys:
                ar_tokens[k] = _decode_ar(ctx, [ctx.ids[k]], cfg.sampling.seed)[0][0]
        checked = [k for k in keys if k in ar_tokens]
        if len(checked) < min(n, len(keys)):
            raise RuntimeError("internal: fewer AR outputs than lossless_check.samples")
        return check_greedy(ar_tokens, spec_tokens, checked)
    return check_sampled(ctx.target, ctx.drafter, {k: ctx.ids[k] for k in sample_keys}, policy=policy,
                         sampling=sampling, seed=cfg.sampling.seed + 10_000, max_seq_len=cfg.model.max_seq_len,
                         **ctx.engine_opts)


def _finish(ctx: RunContext, stores: dict[str, RecordStore], baseline_source: str) -> dict:
    """The time split, the lossless and quality checks, then the summary and the report's files; raises
    `LosslessError` (after writing everything) when the check failed."""
    cfg = ctx.cfg
    groups: dict[str, int] = {}
    for batch in ctx.batches:
        groups[batch_group(batch)] = groups.get(batch_group(batch), 0) + len(batch)
    split = _draft_verify_split(ctx, stores[SPEC].merged())
    if not ctx.sampling.greedy and ctx.policy.lossless and cfg.eval.lossless_check.samples:
        ctx.echo(f"{ctx.name}: sampled lossless check ({cfg.eval.lossless_check.samples} prompts x 128 samples) ...")
    lossless = _lossless(ctx, stores)
    quality = None
    if any(p.layout in METRIC for p in ctx.prompts):
        texts = {m: s.texts() for m, s in stores.items() if s.records}
        quality = score_all(ctx.prompts, texts)
    summary = report.build_summary(ctx, stores, groups, split, lossless, quality, baseline_source)
    quality_mismatch = ctx.sampling.greedy and any(q.get("identical") is False for q in (quality or {}).values())
    if quality_mismatch and lossless.passed:
        lossless.passed = False
        summary["lossless"]["passed"] = False
        summary["lossless"]["description"] += "; but task scores DIFFER between AR and speculative"
    if lossless.passed is False:
        summary["status"] = "failed: lossless check"
    report.write_outputs(ctx, summary, stores)
    if lossless.passed is False:
        raise LosslessError(f"LOSSLESS CHECK FAILED in run {ctx.name!r}: {summary['lossless']['description']} "
                            f"(details: {ctx.paths.root / 'summary.failed.json'})")
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


__all__ = ["run_experiment", "main_run", "RunContext", "RunInterrupted", "plan_batches", "batch_group",
           "baseline_key", "own_answers", "default_name"]
