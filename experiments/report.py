"""What a finished run reports: summary.json's dictionary, the markdown table (table.md, also printed), the
plots, and the same logged to the tracker. experiments/run.py gathers the numbers; this module only arranges
and writes them."""

from __future__ import annotations

import json
import math
import time

from experiments import plots
from experiments.context import RunContext
from experiments.lossless import LosslessResult
from experiments.provenance import load_average, provenance
from experiments.store import AR, SPEC, RecordStore, jsonable
from specdec.metrics import DecodeMetrics, speedup

SEED_NOTE = "batch i is decoded with seed sampling.seed + i (AR and speculative alike)"


# ---------------------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------------------

def _metrics_block(m: DecodeMetrics | None) -> dict | None:
    return None if m is None else jsonable(m.summary())


def _category_block(ar: DecodeMetrics | None, spec: DecodeMetrics | None, n: int) -> dict:
    out = {"prompts": n}
    if spec is not None:
        out.update(tau=spec.tau, acceptance_rate=spec.acceptance_rate, tokens_per_second=spec.tokens_per_second)
    if ar is not None:
        out["ar_tokens_per_second"] = ar.tokens_per_second
    out["speedup"] = speedup(ar, spec) if ar is not None and spec is not None else None
    return jsonable(out)


def build_summary(ctx: RunContext, stores: dict[str, RecordStore], groups: dict[str, int], split: dict,
                  lossless: LosslessResult, quality: dict | None, baseline_source: str) -> dict:
    """summary.json's dictionary (without "files", which `write_outputs` adds). `groups`: what the batches
    are reported under (`run.batch_group`) -> their prompts; `split`: the draft/verify time split."""
    cfg, drafter, policy, prompts = ctx.cfg, ctx.drafter, ctx.policy, ctx.prompts
    ar_m, spec_m = stores[AR].merged(), stores[SPEC].merged()
    by_category = {c: _category_block(stores[AR].merged(c), stores[SPEC].merged(c), n) for c, n in groups.items()}
    return jsonable({
        "run": ctx.name, "description": cfg.description, "status": "complete",
        "model": cfg.model.name, "backend": cfg.model.backend, "dtype": cfg.model.dtype,
        "drafter": ctx.label, "drafter_name": drafter.name, "drafter_kind": drafter.kind,
        "num_draft_tokens": drafter.num_draft_tokens, "policy": policy.name, "policy_note": ctx.policy_note,
        "lossy": not policy.lossless, "temperature": cfg.sampling.temperature, "batch_size": cfg.generation.batch_size,
        "max_new_tokens": cfg.generation.max_new_tokens,
        "compiled_loop": bool(cfg.generation.compiled_loop and drafter.jittable),
        "chat_template_applied": bool(ctx.chat), "prompts": len(prompts),
        "datasets": {d: sum(1 for p in prompts if p.dataset == d) for d in dict.fromkeys(p.dataset for p in prompts)},
        # the headline numbers, flat (sweep reports and W&B read these)
        "tau": spec_m.tau, "acceptance_rate": spec_m.acceptance_rate, "tokens_per_second": spec_m.tokens_per_second,
        "ar_tokens_per_second": ar_m.tokens_per_second if ar_m else None,
        "speedup": speedup(ar_m, spec_m) if ar_m else None,
        "time_per_output_token_ms": spec_m.time_per_output_token_ms,
        "acceptance_by_position": spec_m.acceptance_by_position(),
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
        "timing": {"started": ctx.started, "finished": time.time(), "wall_seconds": time.time() - ctx.started,
                   "load_average_start": ctx.load_start, "load_average_end": load_average(),
                   "note": "tok/s = generated tokens / decode seconds (prefill excluded, compile excluded by "
                           "warm-up); the machine may be shared, see load_average"},
    })


# ---------------------------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------------------------

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
# Files and tracker
# ---------------------------------------------------------------------------------------------------------

def write_outputs(ctx: RunContext, summary: dict, stores: dict[str, RecordStore]) -> None:
    """table.md, the plots, the tracker's summary / tables / images, and last summary.json, so that its presence
    means "complete" (summary.failed.json instead when the lossless check failed: a rerun repeats the check).
    Adds summary["files"]."""
    paths, name, by_category = ctx.paths, ctx.name, summary["by_category"]
    table = markdown_table(summary)
    paths.table.write_text(table + "\n")
    # the plots take the unrounded acceptance (NaN where a position was never eligible; the summary has None)
    acc = stores[SPEC].merged().acceptance_by_position()
    images = {"acceptance_by_position": plots.acceptance_by_position(
        acc, f"{name}: {ctx.label} / {ctx.policy.name}",
        paths.root / "acceptance_by_position.png")}
    cats = [c for c in by_category if by_category[c].get("tau") is not None]
    images["by_category"] = plots.by_category(
        cats, [by_category[c]["tau"] for c in cats],
        [by_category[c].get("ar_tokens_per_second") or 0.0 for c in cats],
        [by_category[c].get("tokens_per_second") or 0.0 for c in cats], f"{name}: {ctx.label}",
        paths.root / "by_category.png")
    summary["files"] = {"table": paths.table.name, "plots": {k: v.name for k, v in images.items()},
                        "answers": {m: str(paths.answers(m).relative_to(paths.root)) for m in stores}}

    tracker = ctx.tracker
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

    if summary["lossless"]["passed"] is not False:
        paths.summary.write_text(json.dumps(summary, indent=2) + "\n")
    else:  # keep the evidence, but not as a finished run: a rerun repeats the check
        (paths.root / "summary.failed.json").write_text(json.dumps(summary, indent=2) + "\n")
    ctx.echo(table)
    ctx.echo(f"\nwrote {paths.root}/ (summary.json, table.md, answers/, plots)")
