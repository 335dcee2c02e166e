"""Speculative decoding against AR, in ONE run on the current machine: each compared method an experiment config.

    python -m benchmarks.bench_speculative CONFIG.yaml [CONFIG.yaml ...] [section.key=value ...] [--repeats R]

Each config (the YAML of `specdec run`; configs/benchmarks/ holds the ones the docs use) is one compared method:
its drafter, verify and scheduler sections, built as `specdec run` builds them (experiments/build.py). A sweep
file counts as one method per run. The overrides apply to every config. All configs must agree on model, mesh,
data, generation and sampling (an error names the first key that differs): AR decodes the prompts of their
`data:` section once per pass, loaded and chat-templated as `specdec run` loads them, in batches of
`generation.batch_size` that never mix datasets.

Per dataset of `data:` it reports, for AR and each method: tau (bonus token counted), draft acceptance rate, decode
tok/s, tok/s including prefill, the speedup over AR (AR decode time per token / the method's) and how many
prompts' output equals AR's token for token (in every pass; counted under greedy sampling and, at any temperature,
for the policies that commit AR's own sampled tokens: invariant_chain / invariant_tree) and, for each prompt whose
output differs, the token index where it first differs (in the JSON: `first_divergence`).

What makes the figures trustworthy on a shared machine whose speed drifts by up to ~25% within minutes:
  * AR and the methods are interleaved batch by batch (each batch decoded by AR, then by every method, back to
    back; in the reverse order on odd passes), never one whole dataset after the other;
  * `--repeats R` passes over the prompts; the speedup is the median of the passes' speedups (all kept in the JSON
    as `speedup_by_pass`), printed with its distribution-free 90% interval when R >= 5 (`median_interval`): a
    method whose interval lies above 1 gains, one whose interval spans 1 is not resolved by R passes;
  * every call is warmed up first (the same compiled programs run for 2 tokens, untimed): no compile time;
  * the suffix drafter's global corpus is emptied at the start of each dataset in each pass, so within a pass it
    holds the outputs of that dataset's earlier prompts only, never an earlier pass's answers.
Under each adaptive row it prints the cost model's check (benchmarks/cost_fit.py): the round costs per verify
width that the timed calls imply, with standard errors, beside the profile they ran with.

    python -m benchmarks.bench_speculative configs/benchmarks/ngram.yaml configs/benchmarks/suffix.yaml
    python -m benchmarks.bench_speculative configs/benchmarks/hybrid.yaml generation.batch_size=8 --repeats 5
    python -m benchmarks.bench_speculative configs/benchmarks/ngram.yaml data.datasets.0.limit=1 \\
        generation.max_new_tokens=8                # a smoke test
Writes runs/benchmarks/bench_speculative/results.{json,md} (`--out`).
"""

from __future__ import annotations

import argparse
from typing import Callable

import numpy as np

from benchmarks.common import (Method, Prompts, Report, add_output_arg, build_methods, decode_ar, decode_method,
                               interval_text, load_config_prompts, median_interval, method_configs_of)
from benchmarks.cost_fit import fit_line, fit_round_costs
from experiments.sweep import trim_heap
from specdec.metrics import DecodeMetrics, merge, speedup

AR = "AR"
HEADER = ["dataset", "B", "method", "tau", "accept rate", "tok/s", "tok/s incl. prefill", "speedup vs AR",
          "predicted tok/s", "= AR"]


def interleaved_passes(target, methods: list[Method], prompts: Prompts, repeats: int,
                       log: Callable[[str], None] = print) -> list[dict]:
    """`repeats` passes; in each, every batch is decoded by AR and then by each method, back to back (odd passes
    in the reverse order). Returns, per pass, method name (or "AR") -> dataset -> [(batch, tokens, metrics)] per
    batch. A method's learned corpus (`Method.reset`) is emptied at the first batch of each dataset."""
    cfg = methods[0].cfg
    by_name = {m.name: m for m in methods}
    names = [AR, *by_name]
    passes = []
    for r in range(repeats):
        got: dict[str, dict[str, list]] = {name: {} for name in names}
        for i, batch in enumerate(prompts.batches):
            dataset = batch[0].dataset
            first = i == 0 or prompts.batches[i - 1][0].dataset != dataset
            ids, seed = prompts.batch_ids(batch), cfg.sampling.seed + i  # the seeds of `specdec run`'s batches
            limits = prompts.batch_limits(batch, cfg.generation.max_new_tokens)
            for name in (names if r % 2 == 0 else names[::-1]):
                if name == AR:
                    tokens, metrics = decode_ar(cfg, target, ids, seed, limits)
                else:
                    if first:
                        by_name[name].reset()
                    tokens, metrics = decode_method(by_name[name], target, ids, seed, limits)
                got[name].setdefault(dataset, []).append((batch, tokens, metrics))
                trim_heap()  # untimed: each call's freed caches would otherwise stay resident through the run
        passes.append(got)
        if repeats > 1:
            log(f"pass {r + 1}/{repeats} done")
    return passes


def _outputs(calls) -> dict[str, list[int]]:
    return {p.key: tokens for batch, rows, _ in calls for p, tokens in zip(batch, rows)}


def _metrics(calls) -> list[DecodeMetrics]:
    return [m for _, _, m in calls]


def same_as_ar(passes: list[dict], name: str, dataset: str) -> tuple[int, int]:
    """(prompts whose output equals AR's in every pass, prompts)."""
    keys = list(_outputs(passes[0][AR][dataset]))
    same = [all(_outputs(p[name][dataset])[k] == _outputs(p[AR][dataset])[k] for p in passes) for k in keys]
    return sum(same), len(keys)


def first_divergences(passes: list[dict], name: str, dataset: str) -> list[int]:
    """The token index where a prompt's output first differs from AR's, for each prompt whose output differs
    (first pass), ascending: where a float near-tie flipped a token, everything after it differs too."""
    ar, out = _outputs(passes[0][AR][dataset]), _outputs(passes[0][name][dataset])
    found = []
    for key, a in ar.items():
        b = out[key]
        if a != b:
            found.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return sorted(found)


def summarise(passes: list[dict], methods: list[Method], prompts: Prompts) -> list[dict]:
    """One row per dataset and method (AR first), with the figures the module docstring lists."""
    cfg = methods[0].cfg
    greedy = cfg.sampling.temperature == 0
    rows = []
    for dataset in prompts.datasets:
        base = {"dataset": dataset, "batch": cfg.generation.batch_size,
                "prompts": sum(1 for p in prompts.items if p.dataset == dataset)}
        ar = merge([m for p in passes for m in _metrics(p[AR][dataset])])
        rows.append({**base, "method": AR, "description": "autoregressive", **_figures(ar, ar),
                     "same_as_ar": None, "speedup_by_pass": [1.0] * len(passes)})
        for method in methods:
            calls = [m for p in passes for m in _metrics(p[method.name][dataset])]
            by_pass = [speedup(merge(_metrics(p[AR][dataset])), merge(_metrics(p[method.name][dataset])))
                       for p in passes]
            same, n = same_as_ar(passes, method.name, dataset)
            try:
                fit = fit_round_costs(calls)  # None unless the adaptive width ran
            except ValueError:
                fit = None
            exact = greedy or method.policy.same_tokens_as_ar  # else a sample of AR's law, not AR's sample
            rows.append({**base, "method": method.name, "description": method.description,
                         **_figures(merge(calls), ar), "speedup": float(np.median(by_pass)),
                         "speedup_interval": median_interval(by_pass), "speedup_by_pass": by_pass,
                         "same_as_ar": [same, n] if exact else None,
                         "first_divergence": first_divergences(passes, method.name, dataset) if exact else None,
                         "cost_fit": fit})
    return rows


def _figures(m: DecodeMetrics, ar: DecodeMetrics) -> dict:
    return {"tau": m.tau, "acceptance_rate": m.acceptance_rate, "tok_s": m.tokens_per_second,
            "tok_s_e2e": m.new_tokens / (m.decode_seconds + m.prefill_seconds), "speedup": speedup(ar, m),
            "new_tokens": m.new_tokens, "decode_s": m.decode_seconds, "prefill_s": m.prefill_seconds,
            "idle_fraction": m.idle_fraction, "skipped_drafts": m.skipped_drafts,
            "acceptance_survival": m.acceptance_by_position()["survival"],
            "predicted_tok_s": m.predicted_tokens_per_second if m.predicted_seconds else None,
            "verify_widths": m.verify_widths or None, "width_rounds": m.width_rounds or None,
            "round_costs": m.round_costs or None, "draft_cost": m.draft_cost, "row_steps": m.row_steps}


def same_text(row: dict) -> str:
    if row["method"] == AR:
        return "-"
    return "n/a (sampled)" if row["same_as_ar"] is None else "{}/{}".format(*row["same_as_ar"])


def table_row(r: dict) -> list:
    ar = r["method"] == AR
    return [r["dataset"], r["batch"], r["method"], "1.00" if ar else f"{r['tau']:.2f}",
            "-" if ar or not np.isfinite(r["acceptance_rate"]) else f"{r['acceptance_rate']:.2f}", f"{r['tok_s']:.1f}", f"{r['tok_s_e2e']:.1f}",
            f"{r['speedup']:.2f}x{interval_text(r.get('speedup_interval'))}",
            f"{r['predicted_tok_s']:.1f}" if r.get("predicted_tok_s") else "-", same_text(r)]


def compare(method_configs, repeats: int = 1, log: Callable[[str], None] = print, target=None,
            drafters: dict | None = None, mixed: bool = False, lengths=(), ar_outputs: bool = False) -> dict:
    """The whole comparison for `load_method_configs`' (name, config) pairs: {"rows": summarise's rows,
    "methods": name -> its description and config}. `target` / `drafters`: reuse what an earlier call built
    (results_table runs one comparison per batch size). `mixed`, `lengths`: the prompts as one mixed set, each
    with its own number of new tokens (`load_config_prompts`; the batch-scaling benchmark). `ar_outputs`: also
    {"ar_outputs": prompt key -> AR's tokens (first pass)}, for runs compared with AR elsewhere."""
    from experiments.build import build_target
    from specdec.config import to_dict

    cfg = method_configs[0][1]
    if target is None:
        target = build_target(cfg.model, cfg.mesh)
    prompts = load_config_prompts(cfg, target, mixed=mixed, lengths=lengths)
    methods = build_methods(method_configs, target, log=log, drafters=drafters)
    counts = ", ".join(f"{d}: {sum(1 for p in prompts.items if p.dataset == d)}" for d in prompts.datasets)
    log(f"{len(prompts.items)} prompts ({counts}); batch {cfg.generation.batch_size}, "
        f"{cfg.generation.max_new_tokens} new tokens, temperature {cfg.sampling.temperature:g}; "
        f"{repeats} pass(es); methods: " + "; ".join(f"{m.name} = {m.description}" for m in methods))
    passes = interleaved_passes(target, methods, prompts, repeats, log)
    rows = summarise(passes, methods, prompts)
    for r in rows:
        cells = table_row(r)
        log(f"{cells[0]:10s} B={cells[1]} {cells[2]:16s} tau {cells[3]}  {cells[5]} tok/s ({cells[6]} incl. prefill)"
            f"  {cells[7]}  = AR {cells[9]}")
        if r.get("cost_fit"):
            log("    " + fit_line(r["cost_fit"]))
    result = {"rows": rows, "methods": {m.name: {"description": m.description, "config": to_dict(m.cfg)}
                                        for m in methods}}
    if ar_outputs:
        result["ar_outputs"] = {k: v for d in prompts.datasets for k, v in _outputs(passes[0][AR][d]).items()}
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("items", nargs="+", metavar="CONFIG.yaml | section.key=value",
                    help="experiment configs (one compared method each; a sweep file: one per run) and overrides "
                         "applied to every one")
    ap.add_argument("--repeats", type=int, default=1,
                    help="passes over the prompts; the speedup is the median of the passes' speedups")
    add_output_arg(ap, __file__)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    method_configs = method_configs_of(ap, args.items)
    report = Report(__file__, argv, args.out)
    result = compare(method_configs, args.repeats)
    report.finish()
    cfg = method_configs[0][1]
    report.table("Speculative decoding vs AR", HEADER, [table_row(r) for r in result["rows"]],
                 note=f"{cfg.generation.max_new_tokens} new tokens, temperature {cfg.sampling.temperature:g}, "
                      f"median of {args.repeats} pass(es); speedup = AR decode time per token / the method's; "
                      "= AR: prompts whose output equals AR's token for token")
    report.table("Methods", ["method", "drafter / policy / scheduler"],
                 [[name, m["description"]] for name, m in result["methods"].items()])
    fits = [[r["dataset"], r["method"], fit_line(r["cost_fit"])] for r in result["rows"] if r.get("cost_fit")]
    if fits:
        report.table("The cost model's check (adaptive width)", ["dataset", "method", "fit"], fits, echo=False)
    report.write(result)
    return result


if __name__ == "__main__":
    main()
