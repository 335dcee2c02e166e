"""`specdec sweep <sweep.yaml> [section.key=value ...]`: every run of a sweep, then one combined report.

    report = run_sweep("configs/sweeps/headline.yaml", ["data.datasets.0.limit=4"])

- The runs come from `specdec.config.expand_sweep` (a grid and/or a list of runs over any config keys); run
  `name` lives in `<output.dir>/<sweep name>/<name>/` with the files of a single run (experiments/run.py).
- Resumable: runs whose summary.json exists are skipped; an interrupted run resumes prompt by prompt.
- All runs share one W&B group (`tracking.group`, which defaults to the sweep name), and a final
  `<sweep>-report` run in that group holds the combined table and plots.
- Runs that share the model, prompts, sampling and batch shape share one AR baseline measurement within a
  sweep process (the first such run measures it; the others record `baseline_source`).
- The combined report in the sweep directory: report.md (a table of every run and a headline table: the
  best drafter per batch size and temperature), tau_vs_throughput.png (acceptance length vs tokens/s with
  the Pareto frontier and the AR baselines), acceptance_by_position.png (survival and conditional, one curve
  per run), speedup_by_category.png, and report.json (the numbers behind them).
- A run that fails (including a failed lossless check) does not stop the others; the sweep raises
  `SweepError` naming the failed runs after writing the report of those that finished.
"""

from __future__ import annotations

import ctypes
import fnmatch
import gc
import json
import math
import traceback
from pathlib import Path
from typing import Callable, Sequence

import jax

from experiments import plots
from experiments.run import run_experiment
from experiments.tracking import make_tracker
from specdec.config import SweepConfig, expand_sweep, load_sweep, to_dict
from specdec.tracking import Tracker


class SweepError(RuntimeError):
    """Some runs of a sweep failed; the message names them and the report covers the rest."""


def release_memory() -> None:
    """Between runs: drop the compiled programs of the run that ended (they keep its drafter alive) and hand
    the freed heap back to the OS. Without it a sweep process only grew (temperature-1 tree rows: 9.4 GB held
    after the first, 12 GB after a second drafter, 16 GB in a longer sweep; with it 1.3 GB between
    rows): glibc keeps freed blocks below its mmap threshold in the heap, so a run's buffers stayed resident
    until `malloc_trim`, and the jit caches held each run's programs. Elsewhere than glibc the trim is skipped."""
    jax.clear_caches()
    trim_heap()


def trim_heap() -> None:
    """Hand the heap's freed blocks back to the OS (glibc keeps those below its mmap threshold: a batch-32 KV
    layer buffer is one); the compiled programs stay. Between the decode calls of one comparison, so the methods
    of a batch size do not stack their freed buffers. Elsewhere than glibc it does nothing."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _fmt(x, spec=".2f"):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


def _ok(s: dict) -> bool:
    return s.get("status") == "complete"


def headline_rows(summaries: dict[str, dict]) -> list[dict]:
    """The best run (by speculative tokens/s) per (batch size, temperature), with the AR baseline measured
    alongside it (the one its speedup is computed against)."""
    groups: dict[tuple, list[tuple[str, dict]]] = {}
    for name, s in summaries.items():
        if _ok(s):
            groups.setdefault((s["batch_size"], s["temperature"]), []).append((name, s))
    rows = []
    for (batch, temp), items in sorted(groups.items()):
        best_name, best = max(items, key=lambda kv: kv[1]["tokens_per_second"] or 0.0)
        rows.append({"batch_size": batch, "temperature": temp, "ar_tokens_per_second": best.get("ar_tokens_per_second"),
                     "best_run": best_name, "drafter": best["drafter"], "policy": best["policy"],
                     "tokens_per_second": best["tokens_per_second"], "tau": best["tau"], "speedup": best["speedup"],
                     "candidates": len(items)})
    return rows


def report_markdown(sweep: SweepConfig, summaries: dict[str, dict], failures: dict[str, str],
                    command: str | None = None) -> str:
    lines = [f"# Sweep `{sweep.name}`", ""]
    if command:
        lines += ["Made with:", "", f"    {command}", ""]
    first = next((s for s in summaries.values() if _ok(s)), None)
    if first:
        lines += [f"Model {first['model']} ({first['backend']}, {first['dtype']}), {first['prompts']} prompts "
                  f"({', '.join(f'{d}: {n}' for d, n in first['datasets'].items())}), {first['max_new_tokens']} "
                  "new tokens per prompt. tok/s = generated tokens / decode seconds (compile and prefill excluded); "
                  "speedup = AR time per token / speculative time per token, same prompts, same process.", ""]
    lines += ["## Headline: speculative decoding off and on, best drafter per batch size", "",
              "| batch | T | AR tok/s | best drafter | policy | spec tok/s | tau | speedup |",
              "|---|---|---|---|---|---|---|---|"]
    for r in headline_rows(summaries):
        lines.append(f"| {r['batch_size']} | {r['temperature']:g} | {_fmt(r['ar_tokens_per_second'], '.1f')} | "
                     f"{r['drafter']} | {r['policy']} | {_fmt(r['tokens_per_second'], '.1f')} | {_fmt(r['tau'])} | "
                     f"{_fmt(r['speedup'])}x |")
    lines += ["", "## All runs", "",
              "| run | drafter | policy | batch | T | tau | accept rate | tok/s | AR tok/s | speedup | draft share | "
              "lossless |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in summaries.items():
        if not _ok(s):
            continue
        ll = s["lossless"]
        check = {True: "pass", False: "FAIL", None: "skipped"}[ll["passed"]] + f" ({ll['kind']})"
        share = (s.get("draft_verify") or {}).get("draft_fraction")
        lines.append(f"| {name} | {s['drafter']} | {s['policy']}{' (lossy)' if s['lossy'] else ''} | "
                     f"{s['batch_size']} | {s['temperature']:g} | {_fmt(s['tau'])} | {_fmt(s['acceptance_rate'])} | "
                     f"{_fmt(s['tokens_per_second'], '.1f')} | {_fmt(s['ar_tokens_per_second'], '.1f')} | "
                     f"{_fmt(s['speedup'])}x | {_fmt(share)} | {check} |")
    quality = {n: s["quality"] for n, s in summaries.items() if _ok(s) and s.get("quality")}
    if quality:
        lines += ["", "## Task quality (AR vs speculative, same prompts; per-prompt identity is required at T=0 only)",
                  "", "| run | T | dataset | metric | n | AR | speculative | same per prompt |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, q in quality.items():
            for ds, e in q.items():
                lines.append(f"| {name} | {summaries[name]['temperature']:g} | {ds} | {e['metric']} | {e['n']} | "
                             f"{_fmt(e.get('autoregressive'), '.3f')} | {_fmt(e.get('speculative'), '.3f')} | "
                             f"{e.get('identical')} |")
    cats = sorted({c for s in summaries.values() if _ok(s) for c in s["by_category"]})
    if cats:
        lines += ["", "## Speedup by category", "", "| run | " + " | ".join(cats) + " |",
                  "|---|" + "---|" * len(cats)]
        for name, s in summaries.items():
            if _ok(s):
                lines.append(f"| {name} | " + " | ".join(
                    _fmt((s["by_category"].get(c) or {}).get("speedup")) for c in cats) + " |")
    loads = [s["timing"]["load_average_start"][0] for s in summaries.values()
             if _ok(s) and s.get("timing", {}).get("load_average_start")]
    if loads:
        lines += ["", f"Machine load (1-min load average at run start): {min(loads):.1f} to {max(loads):.1f} on "
                      f"{first['provenance']['machine'].get('cpu_count')} CPUs. Throughput numbers on a shared "
                      "machine are noisy; compare runs within one sweep, not across sweeps."]
    if failures:
        lines += ["", "## FAILED runs", ""] + [f"- {n}: {msg}" for n, msg in failures.items()]
    lines += ["", "Plots: tau_vs_throughput.png, acceptance_by_position.png, speedup_by_category.png"]
    return "\n".join(lines) + "\n"


def write_report(sweep_dir: Path, sweep: SweepConfig, summaries: dict[str, dict], failures: dict[str, str],
                 command: str | None = None) -> dict:
    """report.md, report.json and the three PNGs in `sweep_dir`; returns {"markdown", "plots", ...}."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    done = {n: s for n, s in summaries.items() if _ok(s)}
    names = list(done)
    baselines = {}
    for s in done.values():
        if s.get("ar_tokens_per_second"):
            baselines.setdefault(f"B={s['batch_size']}" + (f",T={s['temperature']:g}" if s["temperature"] else ""),
                                 s["ar_tokens_per_second"])
    files = {
        "tau_vs_throughput": plots.tau_vs_throughput(
            names, [done[n]["tau"] for n in names], [done[n]["tokens_per_second"] for n in names],
            sweep_dir / "tau_vs_throughput.png", baselines=baselines,
            title=f"{sweep.name}: acceptance length vs throughput (Pareto frontier in red)"),
        "acceptance_by_position": plots.acceptance_by_position_multi(
            {n: done[n]["acceptance_by_position"] for n in names}, sweep_dir / "acceptance_by_position.png",
            title=f"{sweep.name}: acceptance by draft position, per run"),
        "speedup_by_category": plots.speedup_by_category(
            {n: {c: b.get("speedup") for c, b in done[n]["by_category"].items() if b.get("speedup") is not None}
             for n in names}, sweep_dir / "speedup_by_category.png", title=f"{sweep.name}: speedup by category"),
    }
    markdown = report_markdown(sweep, summaries, failures, command)
    (sweep_dir / "report.md").write_text(markdown)
    front = plots.pareto_front([(done[n]["tau"], done[n]["tokens_per_second"]) for n in names])
    data = {"sweep": to_dict(sweep), "runs": {n: {k: s.get(k) for k in (
        "drafter", "policy", "batch_size", "temperature", "tau", "acceptance_rate", "tokens_per_second",
        "ar_tokens_per_second", "speedup", "status")} for n, s in summaries.items()},
            "pareto_front": [names[i] for i in front], "headline": headline_rows(summaries), "failures": failures}
    (sweep_dir / "report.json").write_text(json.dumps(data, indent=2) + "\n")
    return {"markdown": markdown, "plots": files, "pareto_front": data["pareto_front"], "dir": sweep_dir,
            "summaries": summaries, "failures": failures}


def run_sweep(sweep_source: str | Path, overrides: Sequence[str] = (), *, progress: bool = True,
              tracker_factory: Callable[[str, object], Tracker] | None = None, command: str | None = None,
              only: Sequence[str] = (), echo: Callable[[str], None] = print) -> dict:
    """Run every not-yet-finished run of a sweep and write the combined report; see the module docstring.
    `only`: shell-style patterns of run names to run (the report still includes every finished run).
    `tracker_factory(run name, config)` overrides the configured trackers (tests pass memory trackers)."""
    sweep = load_sweep(sweep_source)
    runs = expand_sweep(sweep, overrides)
    sweep_dir = Path(runs[0][1].output.dir) / sweep.name
    selected = [n for n, _ in runs if not only or any(fnmatch.fnmatchcase(n, pat) for pat in only)]
    if only and not selected:
        raise ValueError(f"--only {list(only)} matches none of the runs of sweep {sweep.name!r}: "
                         + ", ".join(n for n, _ in runs))
    echo(f"sweep {sweep.name!r}: {len(runs)} runs ({len(selected)} selected) -> {sweep_dir}/")
    summaries: dict[str, dict] = {}
    failures: dict[str, str] = {}
    baseline_cache: dict = {}
    for i, (name, cfg) in enumerate(runs, 1):
        run_dir = sweep_dir / name
        if (run_dir / "summary.json").exists():
            echo(f"[{i}/{len(runs)}] {name}: finished earlier, skipped")
            summaries[name] = json.loads((run_dir / "summary.json").read_text())
            continue
        if name not in selected:
            continue
        echo(f"[{i}/{len(runs)}] {name}")
        tracker = tracker_factory(name, cfg) if tracker_factory else None
        try:
            summaries[name] = run_experiment(cfg, out_dir=run_dir, tracker=tracker, progress=progress,
                                             baseline_cache=baseline_cache, echo=echo)
        except KeyboardInterrupt:
            echo(f"interrupted during {name}; rerun the same command to resume")
            raise
        except Exception as e:  # noqa: BLE001 - one failed run must not lose the others
            failures[name] = f"{type(e).__name__}: {e}"
            echo(f"[{i}/{len(runs)}] {name} FAILED: {failures[name]}\n{traceback.format_exc(limit=3)}")
        finally:
            if tracker is not None:
                tracker.finish()
            release_memory()
    report = write_report(sweep_dir, sweep, summaries, failures, command)
    base = runs[0][1]
    report_tracker = tracker_factory(f"{sweep.name}-report", base) if tracker_factory else make_tracker(
        base.tracking, run_name=f"{sweep.name}-report", out_dir=sweep_dir, config={"sweep": to_dict(sweep)})
    try:
        rows = [[n, s.get("drafter"), s.get("policy"), s.get("batch_size"), s.get("temperature"), s.get("tau"),
                 s.get("tokens_per_second"), s.get("ar_tokens_per_second"), s.get("speedup")]
                for n, s in summaries.items() if _ok(s)]
        report_tracker.log_table("sweep", ["run", "drafter", "policy", "batch_size", "temperature", "tau",
                                           "tokens_per_second", "ar_tokens_per_second", "speedup"], rows)
        for key, path in report["plots"].items():
            report_tracker.log_image(key, path)
        report_tracker.log_summary({"runs": len(runs), "finished": len(summaries), "failed": len(failures),
                                    "pareto_front": report["pareto_front"]})
    finally:
        report_tracker.finish()
    echo(report["markdown"])
    echo(f"wrote {sweep_dir}/report.md and plots")
    if failures:
        raise SweepError(f"{len(failures)} of {len(runs)} runs of sweep {sweep.name!r} failed: "
                         + "; ".join(f"{n}: {m}" for n, m in failures.items()))
    return report
