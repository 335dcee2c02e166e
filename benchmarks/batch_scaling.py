"""Speculation under load: AR and each drafter at batch 1, 4, 8, 16, 32 and 64 on the same prompts.

    python -m benchmarks.batch_scaling                       # METHODS x BATCH_SIZES on configs/benchmarks/scaling.yaml
    python -m benchmarks.batch_scaling --smoke               # a check that it runs: 4 prompts, <= 8 tokens, batch 1-4
    python -m benchmarks.batch_scaling configs/benchmarks/ngram.yaml --batches 1 8 64
    python -m benchmarks.batch_scaling --refill              # and, beside each batch >= 2, its rows refilled

The prompts are those of `--prompts` (default configs/benchmarks/scaling.yaml: 16 each of MT-Bench, GSM8K,
HumanEval and MBPP), as ONE mixed set taken in turn from each source, so every batch mixes them and a batch of all
of them is one batch. Prompt i asks for lengths[i % len(lengths)] new tokens (`--lengths`), so the rows of a batch
end at different times (earlier where the model stops at EOS). The methods are the results table's (n-gram, suffix,
the shipped DSpark 7-node tree, hybrid: configs of configs/benchmarks/, each with the adaptive width) or the configs
given; every one runs with the prompts config's `data` and `generation.max_new_tokens`, and the overrides given.

For each batch size it runs bench_speculative's comparison (AR and the methods interleaved batch by batch, warm-ups
untimed, output == AR checked per prompt), and reports per (method, batch): decode tok/s, the speedup over AR, tau,
the share of loop iterations that skipped the draft, the idle fraction (row-steps spent on rows already finished,
AR's beside it: what refilling finished rows would win) and how many outputs equal AR's; per method the lowest
speedup (the floor: 0.97x AR) and the crossover batch, the smallest batch from which on it runs below AR; and
speedup_vs_batch.png. One process, one sitting: the ratios are comparable only within it (note the load average).

`--refill` adds, at each batch B >= 2 smaller than the prompt set, AR and each method decoding all the prompts (and
lengths) in B rows, a finished row refilled from the queue of the others: a server's batch. The methods run
`specdec.engine.generate_refilled` (with `scheduler.objective: throughput` where the scheduler is adaptive; drafters
with Python state, suffix decoding, cannot be refilled and are left out); "refilled AR" is AR's own decode step in
the continuous batcher `specdec.generate.generate_continuous` (what `specdec data` runs), whose loop returns to the
host for refills as `generate_refilled`'s does, `--refill-rows` rows at a time. Per (method, batch): decode tok/s,
tok/s including every prefill (the refills' included) and the host's work between loop calls, the speedup over
static AR and over refilled AR at that batch, tau, the idle fraction (the static cell's beside it) and outputs ==
AR per prompt (greedy); dashed lines in the plot.

Writes runs/benchmarks/batch_scaling/results.{json,md} and speedup_vs_batch.png (`--out`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from benchmarks import bench_speculative
from benchmarks.common import (DEFAULT_OUT, REPO, Report, build_methods, decode_ar_refilled, decode_refilled,
                               load_config_prompts, load_method_configs, load_text, prompt_overrides, split_args)
from benchmarks.results_table import CONFIGS, check_map_count, method_paths
from experiments.sweep import release_memory, trim_heap

BATCH_SIZES = (1, 4, 8, 16, 32, 64)
PROMPTS = CONFIGS / "scaling.yaml"
# New tokens per prompt, in turn: with the four sources in turn, five lengths give every source every length.
LENGTHS = (16, 24, 32, 48, 64)
FLOOR = 0.97  # never slower: the lowest speedup over AR a method may show at any batch
SMOKE = {"batches": (1, 2, 4), "lengths": (4, 8), "max_new_tokens": 8, "per_source": 1}
# Rows refilled per return of the loop to the host (`--refill-rows`). A return costs a host sync, the transfer of a
# few [B, capacity] int32 arrays and the refill's dispatches, small beside one decode step at batch 8-64 on a CPU
# (a plain round took 43-58 ms at batch 8, 178 ms at 32, 330 ms at 64 in the round-cost profiles of
# docs/results/batch_scaling/ngram_log.txt), whereas refilling R rows at a time makes each finished row wait for
# R - 1 others: on average (R - 1) / (2B) of the row-steps idle (6% at R = 2, B = 8). The prefills cost the same in
# total whatever R (each prompt once). So one row per return, unless returns cost a large share of a step, as on an
# accelerator whose steps take milliseconds.
REFILL_ROWS = 1


def crossover(curve: dict[int, float]) -> int | None:
    """The smallest batch from which on (every larger batch measured too) the speedup is below 1; None if the
    largest batch still gains."""
    out = None
    for batch in sorted(curve, reverse=True):
        if not curve[batch] < 1.0:
            break
        out = batch
    return out


def time_factors(row: dict, ar: dict, batch: int) -> dict | None:
    """Where a speculative cell's time went against AR's, as three factors whose product is its speedup (AR's
    decode time / the method's, the same tokens):

        speedup = (AR steps / loop iterations) x (iterations / plain-round units) x (AR step / plain round)

    - fewer iterations: what acceptance saved (AR's steps: its row-steps / batch, every call holding `batch` rows);
    - drafted rounds: each iteration in units of a plain round, from the adaptive width's own profiled costs
      (a round verified at width W counts C(W) / C(0); a round whose draft `refine` cut to width 0 counts
      1 + draft / C(0); a skipped draft 1), so this factor is what the drafted rounds cost above plain ones;
    - plain round: AR's step over the plain round the run implies (its decode time / its plain-round units): the
      loop's own overhead (the drafter's catch-up, the plan, the bookkeeping) where it skips the draft.
    None for AR and for a method without the adaptive width's counts."""
    widths, costs = row.get("width_rounds"), row.get("round_costs")
    if not widths or not costs or not ar.get("row_steps") or not row.get("decode_s"):
        return None
    iterations = sum(widths)
    cut = widths[0] - row["skipped_drafts"]  # drafted, then verified at width 0
    units = (row["skipped_drafts"] + cut * (1 + (row.get("draft_cost") or 0.0) / costs[0])
             + sum(n * c / costs[0] for n, c in zip(widths[1:], costs[1:])))
    ar_steps = ar["row_steps"] / batch
    plain = row["decode_s"] / units
    return {"ar_steps": ar_steps, "iterations": iterations, "cut_drafts": cut,
            "verified_rounds": iterations - widths[0], "fewer_iterations": ar_steps / iterations,
            "drafted_rounds": iterations / units, "plain_round": (ar["decode_s"] / ar_steps) / plain}


def cells(result: dict, batch: int, labels: dict[str, str]) -> list[dict]:
    """One cell per method (AR included) at this batch, from bench_speculative's rows."""
    rows = result["rows"]
    ar = next(r for r in rows if r["method"] == bench_speculative.AR)
    out = []
    for r in rows:
        iterations = sum(r["width_rounds"]) if r.get("width_rounds") else None
        out.append({"method": labels.get(r["method"], r["method"]), "batch": batch, "prompts": r["prompts"],
                    "tok_s": r["tok_s"], "tok_s_e2e": r["tok_s_e2e"], "ar_tok_s": ar["tok_s"], "speedup": r["speedup"],
                    "tau": r["tau"],
                    "skipped": r["skipped_drafts"] / iterations if iterations else None,
                    "idle_fraction": r["idle_fraction"], "ar_idle_fraction": ar["idle_fraction"],
                    "same_as_ar": r["same_as_ar"], "description": r["description"],
                    "time_factors": None if r is ar else time_factors(r, ar, batch)})
    return out


def factors_table(all_cells: list[dict]) -> tuple[list[str], list[list]]:
    """`time_factors` per speculative cell (one pass: with --repeats the sums of the passes)."""
    header = ["method", "batch", "AR steps", "iterations", "verified / cut / skipped", "x fewer iterations",
              "x drafted rounds", "x plain round", "= speedup"]
    rows = []
    for c in all_cells:
        f = c.get("time_factors")
        if not f:
            continue
        skipped = f["iterations"] - f["verified_rounds"] - f["cut_drafts"]
        rows.append([c["method"], c["batch"], f"{f['ar_steps']:.0f}", f["iterations"],
                     f"{f['verified_rounds']} / {f['cut_drafts']} / {skipped}", f"{f['fewer_iterations']:.3f}",
                     f"{f['drafted_rounds']:.3f}", f"{f['plain_round']:.3f}",
                     f"{f['fewer_iterations'] * f['drafted_rounds'] * f['plain_round']:.2f}x"])
    return header, rows


def _pct(x) -> str:
    return "-" if x is None or x != x else f"{100 * x:.0f}%"


def table(all_cells: list[dict]) -> tuple[list[str], list[list]]:
    header = ["method", "batch", "tok/s", "speedup vs AR", "tau", "draft skipped", "idle (AR idle)", "= AR"]
    rows = []
    for c in all_cells:
        ar = c["method"] == bench_speculative.AR
        same = "-" if c["same_as_ar"] is None else "{}/{}".format(*c["same_as_ar"])
        rows.append([c["method"], c["batch"], f"{c['tok_s']:.1f}", "1.00x" if ar else f"{c['speedup']:.2f}x",
                     "1.00" if ar else f"{c['tau']:.2f}", "-" if ar else _pct(c["skipped"]),
                     _pct(c["idle_fraction"]) if ar else f"{_pct(c['idle_fraction'])} ({_pct(c['ar_idle_fraction'])})",
                     same])
    return header, rows


def summary(all_cells: list[dict]) -> tuple[list[str], list[list], dict]:
    """Per method: its speedup by batch, the lowest, whether it holds the floor, and the crossover batch."""
    curves: dict[str, dict[int, float]] = {}
    for c in all_cells:
        if c["method"] != bench_speculative.AR:
            curves.setdefault(c["method"], {})[c["batch"]] = c["speedup"]
    header = ["method", *(f"B={b}" for b in sorted({c["batch"] for c in all_cells})), "lowest",
              f">= {FLOOR}x AR", "crossover batch"]
    rows = []
    for name, curve in curves.items():
        low = min(curve.values())
        cross = crossover(curve)
        rows.append([name, *(f"{curve[b]:.2f}x" if b in curve else "-" for b in sorted(curve)), f"{low:.2f}x",
                     "yes" if low >= FLOOR else "NO", "none (gains at the largest batch)" if cross is None else cross])
    return header, rows, curves


def with_throughput_objective(cfg):
    """`cfg` with `scheduler.objective: throughput` where its scheduler has that setting (the adaptive width): a
    batch that refills its rows is worth the tokens all its rows commit, not how soon its last row ends."""
    fields = {f.name for f in dataclasses.fields(cfg.scheduler)}
    if "objective" not in fields:
        return cfg
    return dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, objective="throughput"))


def refill_cells(method_configs, batch: int, refill_rows: int, target, drafters: dict, lengths, ar_outputs: dict,
                 static: list[dict], labels: dict[str, str]) -> list[dict]:
    """AR and each method decoding every prompt in `batch` rows refilled from the queue (`refill_rows` rows per
    return to the host), one pass, AR first: one cell each, compared with this batch's static cells (`static`) and
    AR's outputs per prompt key (`ar_outputs`). No cells when the prompts fit one batch (nothing to refill)."""
    cfg = method_configs[0][1]
    prompts = load_config_prompts(cfg, target, mixed=True, lengths=lengths)
    keys = [p.key for p in prompts.items]
    ids = prompts.batch_ids(prompts.items)
    limits = prompts.batch_limits(prompts.items, cfg.generation.max_new_tokens)
    limits = [limits] * len(ids) if isinstance(limits, int) else limits
    if batch >= len(ids):
        print(f"batch {batch}: the {len(ids)} prompts fit one batch, nothing to refill", flush=True)
        return []
    print(f"batch {batch}, rows refilled ({refill_rows} per return):", flush=True)
    seed = cfg.sampling.seed
    runs = [(bench_speculative.AR, "AR's decode step, rows refilled (generate_continuous)",
             decode_ar_refilled(cfg, target, ids, batch, refill_rows, limits, seed))]
    trim_heap()
    served = [(name, with_throughput_objective(c)) for name, c in method_configs]
    for method in build_methods(served, target, drafters=drafters):
        if not method.drafter.jittable or method.compiled is False:  # rows are refilled in the compiled loop only
            why = "generation.compiled_loop is off" if method.drafter.jittable else "its drafter keeps Python state"
            print(f"  {method.name}: not refilled ({why})", flush=True)
            continue
        method.reset()
        runs.append((method.name, method.description,
                     decode_refilled(method, target, ids, batch, refill_rows, limits, seed)))
        trim_heap()
    here = {c["method"]: c for c in static if c["batch"] == batch}
    ar, ar_refilled = here[bench_speculative.AR], runs[0][2][1]
    greedy = cfg.sampling.temperature == 0

    def e2e(m):
        return m.new_tokens / (m.decode_seconds + m.prefill_seconds)

    out = []
    for name, description, (tokens, m) in runs:
        label = labels.get(name, name)
        same = sum(t == ar_outputs[k] for k, t in zip(keys, tokens))
        cell = {"method": label, "batch": batch, "prompts": len(ids), "refill_rows": refill_rows,
                "tok_s": m.tokens_per_second, "tok_s_e2e": e2e(m),
                "vs_static_ar": m.tokens_per_second / ar["tok_s"], "vs_static_ar_e2e": e2e(m) / ar["tok_s_e2e"],
                "vs_refilled_ar": m.tokens_per_second / ar_refilled.tokens_per_second,
                "vs_refilled_ar_e2e": e2e(m) / e2e(ar_refilled), "tau": m.tau, "idle_fraction": m.idle_fraction,
                "static_idle_fraction": here[label]["idle_fraction"] if label in here else None,
                "same_as_ar": [same, len(keys)] if greedy else None, "description": description}
        out.append(cell)
        print(f"  {label:16s} {cell['tok_s']:.1f} tok/s ({cell['tok_s_e2e']:.1f} incl. prefills)  "
              f"{cell['vs_static_ar']:.2f}x static AR  idle {_pct(cell['idle_fraction'])}  = AR "
              + ("n/a (sampled)" if cell["same_as_ar"] is None else "{}/{}".format(*cell["same_as_ar"])), flush=True)
    return out


def refill_table(cells_: list[dict]) -> tuple[list[str], list[list]]:
    header = ["method", "batch", "tok/s", "tok/s incl. prefills", "vs static AR", "vs refilled AR", "tau",
              "idle (static)", "= AR"]
    rows = []
    for c in cells_:
        ar = c["method"] == bench_speculative.AR
        same = "n/a (sampled)" if c["same_as_ar"] is None else "{}/{}".format(*c["same_as_ar"])
        rows.append([c["method"] + " refilled", c["batch"], f"{c['tok_s']:.1f}", f"{c['tok_s_e2e']:.1f}",
                     f"{c['vs_static_ar']:.2f}x / {c['vs_static_ar_e2e']:.2f}x",
                     f"{c['vs_refilled_ar']:.2f}x / {c['vs_refilled_ar_e2e']:.2f}x",
                     "1.00" if ar else f"{c['tau']:.2f}",
                     f"{_pct(c['idle_fraction'])} ({_pct(c['static_idle_fraction'])})", same])
    return header, rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("items", nargs="*", metavar="CONFIG.yaml | section.key=value",
                    help="the methods' experiment configs (default: the results table's METHODS) and overrides "
                         "applied to every config")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCH_SIZES), help="batch sizes")
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS),
                    help="new tokens per prompt, in turn (at most the prompts config's generation.max_new_tokens)")
    ap.add_argument("--prompts", default=str(PROMPTS), help="the config whose data and max_new_tokens every method "
                                                            "runs with (default configs/benchmarks/scaling.yaml)")
    ap.add_argument("--repeats", type=int, default=1, help="passes over the prompts (the speedup is their median)")
    ap.add_argument("--smoke", action="store_true", help=f"{SMOKE['per_source']} prompt per dataset, lengths "
                    f"{SMOKE['lengths']}, batches {SMOKE['batches']}: checks that it runs")
    ap.add_argument("--refill", action="store_true",
                    help="beside each batch of 2 or more rows, AR and each method with finished rows refilled from "
                         "the queue of the other prompts (the methods with scheduler.objective=throughput)")
    ap.add_argument("--refill-rows", type=int, help="with --refill: the loop returns to the host to refill once this "
                                                    f"many rows are done (default {REFILL_ROWS})")
    ap.add_argument("--out", type=Path, help="where results.json, results.md and the plot go "
                                             "(default runs/benchmarks/batch_scaling)")
    args = ap.parse_intermixed_args(argv)  # configs and overrides before or after the options
    paths, overrides = split_args(args.items)
    if args.smoke:
        args.batches, args.lengths = list(SMOKE["batches"]), list(SMOKE["lengths"])
    if any(b < 1 for b in args.batches) or any(n < 1 for n in args.lengths) or args.repeats < 1:
        ap.error(f"--batches, --lengths and --repeats must be >= 1, got {args.batches}, {args.lengths} and "
                 f"{args.repeats}")
    if args.refill_rows is not None and not args.refill:
        ap.error("--refill-rows sets how --refill refills rows: give --refill too")
    refill_rows = REFILL_ROWS if args.refill_rows is None else args.refill_rows
    refilled = sorted(b for b in args.batches if b >= 2) if args.refill else []
    if args.refill and not refilled:
        ap.error(f"--refill refills the rows of a batch of 2 or more, but --batches is {args.batches}")
    if refill_rows < 1 or (refilled and refill_rows > refilled[0]):
        ap.error(f"--refill-rows must be in [1, the smallest refilled batch], got {refill_rows} with batch "
                 f"{refilled[0] if refilled else '-'}: a batch refills at most its own rows (lower --refill-rows "
                 "or leave the smaller batches out of --batches)")
    methods = method_paths(paths)
    labels = {Path(cfg).stem: label for label, cfg in methods.items()}
    configs = list(methods.values())
    check_map_count(len(methods))
    try:
        shared = prompt_overrides(args.prompts, SMOKE["per_source"] if args.smoke else None)
        if args.smoke:
            shared.append(f"generation.max_new_tokens={SMOKE['max_new_tokens']}")
        overrides = shared + overrides
        cfg = load_method_configs(configs, overrides)[0][1]  # fail now, not after the first batch size
    except ValueError as e:
        ap.error(str(e))
    if max(args.lengths) > cfg.generation.max_new_tokens:
        ap.error(f"--lengths asks for up to {max(args.lengths)} new tokens, but generation.max_new_tokens is "
                 f"{cfg.generation.max_new_tokens}")
    out = args.out or DEFAULT_OUT / ("batch_scaling_smoke" if args.smoke else "batch_scaling")
    report = Report(__file__, argv, out, title="Batch scaling")
    target, drafters, all_cells, results, refill_all = None, {}, [], {}, []
    for batch in args.batches:
        method_configs = load_method_configs(configs, [*overrides, f"generation.batch_size={batch}"])
        if target is None:
            from experiments.build import build_target

            target = build_target(cfg.model, cfg.mesh)
        print(f"batch {batch}:", flush=True)
        result = bench_speculative.compare(method_configs, args.repeats, target=target, drafters=drafters,
                                           mixed=True, lengths=args.lengths, ar_outputs=batch in refilled)
        ar_outputs = result.pop("ar_outputs", None)
        results[f"batch_{batch}"] = result
        all_cells += cells(result, batch, labels)
        out.mkdir(parents=True, exist_ok=True)  # each batch's cells as it ends: a run killed later keeps them
        (out / "cells_so_far.json").write_text(json.dumps(all_cells, indent=1, default=str))
        if batch in refilled:
            refill_all += refill_cells(method_configs, batch, refill_rows, target, drafters, args.lengths,
                                       ar_outputs, all_cells, labels)
            (out / "refill_cells_so_far.json").write_text(json.dumps(refill_all, indent=1, default=str))
        # No program of this batch size runs again, and glibc keeps the freed buffers resident: one adaptive call at
        # batch 16 (389 MB caches) left the process at 3.9 GB RSS, 1.4 GB after the trim; the run that reached
        # batch 64 was killed at 21 GB.
        release_memory()
    report.finish()
    note = (f"{len(args.lengths)} lengths of new tokens in turn ({', '.join(map(str, args.lengths))}; rows end "
            f"there or at EOS), temperature {cfg.sampling.temperature:g}, {args.repeats} pass(es), load "
            f"{load_text(report.meta)}; speedup = AR decode time per token / the method's; draft skipped = loop "
            "iterations that ran a plain decode step; idle = row-steps spent on rows already finished (AR's in "
            "brackets); = AR: outputs equal to AR's token for token")
    report.table("Speculative decoding vs AR by batch size", *table(all_cells), note=note)
    header, rows, curves = summary(all_cells)
    report.table("Speedup by batch size, the floor and the crossover", header, rows,
                 note=f"crossover batch: the smallest batch from which on the method runs below AR; floor: "
                      f"{FLOOR}x AR at every batch")
    factors_header, factors_rows = factors_table(all_cells)
    if factors_rows:
        report.table("Where the time went", factors_header, factors_rows,
                     note="speedup = (AR steps / iterations) x (iterations / plain-round units) x (AR step / plain "
                          "round): what acceptance saved, what the drafted rounds cost above plain ones (from the "
                          "adaptive width's profiled round costs; a cut draft is one `refine` verified at width 0), "
                          "and the plain round the run implies against AR's step (`time_factors`)")
    report.table("Methods", ["method", "config", "drafter / policy / scheduler"],
                 [[label, Path(path).relative_to(REPO) if Path(path).is_relative_to(REPO) else path,
                   next((c["description"] for c in all_cells if c["method"] == label), "-")]
                  for label, path in methods.items()], echo=False)
    refill_curves: dict[str, dict[int, float]] = {}
    for c in refill_all:
        refill_curves.setdefault(c["method"], {})[c["batch"]] = c["vs_static_ar"]
    if args.refill:
        left_out = sorted(set(labels.values()) - set(refill_curves))
        report.table("Rows refilled from the queue", *refill_table(refill_all), note=(
            f"all {refill_all[0]['prompts'] if refill_all else '-'} prompts in B rows, a finished row refilled from "
            f"the queue of the others, the loop returning to the host once {refill_rows} row(s) are done; one pass "
            "per cell, run after the batch's static cells. Refilled AR: AR's own decode step (one target step per "
            "row and token, as in `generate`'s loop) in the continuous batcher `generate.generate_continuous`, "
            "refilled the same way; the methods: `engine.generate_refilled`, scheduler.objective=throughput where "
            "the scheduler is adaptive. tok/s incl. prefills: new tokens over the loop's time plus all the rest of "
            "the run (the first batch's and every refill's prefill, the host's reading of finished rows); vs static "
            "/ refilled AR: the ratio of decode tok/s / of tok/s incl. prefills (the static cells' incl. their own "
            "prefills); idle: row-steps spent on finished rows (the static cell's in brackets); a refilled batch's "
            "cache fits the longest prompt of all, a static batch's its own. = AR: outputs equal to static AR's at "
            "this batch, per prompt. Not refilled: " + (", ".join(left_out) or "none")))
    report.write({"cells": all_cells, "runs": results, "lengths": args.lengths, "prompts": args.prompts,
                  "refill": {"refill_rows": refill_rows, "cells": refill_all, "curves": refill_curves}
                  if args.refill else None})
    from experiments.plots import speedup_vs_batch

    plot = speedup_vs_batch(curves, out / "speedup_vs_batch.png", floor=FLOOR, dashed=refill_curves,
                            title=f"speedup over AR by batch size ({report.meta['commit']}, load "
                                  f"{load_text(report.meta)})" + ("; dashed: rows refilled" if refill_curves else ""))
    print(f"wrote {plot}", flush=True)
    return {"cells": all_cells, "summary": rows, "refill_cells": refill_all}


if __name__ == "__main__":
    main()
