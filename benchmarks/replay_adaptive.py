"""The adaptive verify width's predicted speedup over AR, without timing anything: variants of its acceptance model
compared on the same prompts, deterministically, even beside other jobs.

Under greedy decoding a drafter's drafts and their acceptance are functions of the committed text, which is AR's
output whatever the widths chosen, and with its round costs given (`AdaptiveWidth.costs`) the adaptive width's
choices are functions of them too. So a run with fixed costs replays the same rounds on any machine at any load,
and its cost model prices them: `predicted_seconds` (the chosen widths x the costs; within 0-5% of the measured
time on a quiet machine, docs/BENCHMARKS.md session 22). AR's decode of the same tokens costs one plain round per
step (the loop's plain round measured 0.996x AR's step [0.97-1.04], session 23), so

    predicted speedup = sum over groups (longest row's new tokens - 1) x C(0)  /  sum over groups predicted_seconds

The VM's speed drifts by 10-30% between passes, so a timed A/B needs many passes to see a 3% difference; this
sees it in one. It ranks variants; a timed run (`bench_speculative --repeats 9`) confirms the chosen one.

Costs: for each drafter spec and batch size, this machine's cached profile (`round_costs.json`, measured first if
missing: on a quiet machine), or `--costs FILE` (this script's own JSON output, `costs` entry: replay another
machine's or session's costs exactly). Every output is checked against AR's.

    python -m benchmarks.replay_adaptive [--subsets quickstart-chat ... mt_bench gsm8k humaneval] [--n 8] \\
        [--batches 1 8] [--max-new-tokens 64] [--costs OLD.json] [--json OUT] \\
        --drafters ngram:k=5,scheduler=adaptive ngram:k=5,scheduler=adaptive,prior=0.7 ...
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os

import numpy as np

from benchmarks.common import (DEFAULT_DATA, QUICKSTART_SUBSETS, DrafterSpec, command_line, groups_of, load_prompts,
                               write_json)
from drafters import create_drafter
from specdec.engine import speculative_generate
from specdec.generate import cache_capacity, generate
from specdec.models import registry
from specdec.models.loading import load_checkpoint
from specdec.sampling import GREEDY
from specdec.target import Target

DEFAULT_SUBSETS = (*QUICKSTART_SUBSETS, "mt_bench", "gsm8k", "humaneval")


def cost_label(spec: DrafterSpec, group, max_new: int) -> str:
    """What a round's costs depend on: the drafter and its widths, the rows and the cache capacity (in the cost
    cache's buckets of 256), not the scheduler's options."""
    base = dataclasses.replace(spec, scheduler_options=())
    capacity = cache_capacity([len(p) for p in group], max_new, extra=spec.k + 1)
    return f"{base.label}|B={len(group)}|S={-(-capacity // 256) * 256}"


def measured_costs(target, drafter, spec: DrafterSpec, group, max_new: int):
    """(round costs, draft cost) of this machine's profile for the drafter at this batch (cached; measured if not)."""
    out = speculative_generate(target, drafter, group, policy=spec.policy_for(drafter), max_new_tokens=max_new,
                               sampling=GREEDY, verify_buckets=spec.buckets, scheduler=spec.make_scheduler())
    return list(out.metrics.round_costs), float(out.metrics.draft_cost)


def replay(target, drafter, spec: DrafterSpec, groups, ar_tokens, max_new: int, costs: dict) -> dict:
    """The spec's adaptive width on every group with given costs (`costs[cost_label(spec, rows)]`, measured into
    it where missing): predicted seconds and AR's, tau, rounds by width."""
    spec_s = ar_s = 0.0
    rounds = accepted = new = same = 0
    expected = realised = 0.0
    by_width = 0
    if hasattr(drafter, "clear_global"):
        drafter.clear_global()
    for group, ar in zip(groups, ar_tokens):
        label = cost_label(spec, group, max_new)
        if label not in costs:
            costs[label] = measured_costs(target, drafter, spec, group, max_new)
            if hasattr(drafter, "clear_global"):
                drafter.clear_global()
        round_cost, draft_cost = costs[label]
        sched = dataclasses.replace(spec.make_scheduler(), costs=(tuple(round_cost), draft_cost))
        out = speculative_generate(target, drafter, group, policy=spec.policy_for(drafter), max_new_tokens=max_new,
                                   sampling=GREEDY, verify_buckets=spec.buckets, scheduler=sched)
        m = out.metrics
        same += sum(a == b for a, b in zip(out.tokens, ar))
        spec_s += m.predicted_seconds
        ar_s += (max(len(t) for t in ar) - 1) * round_cost[0]
        rounds, accepted, new = rounds + m.rounds, accepted + m.accepted_draft_tokens, new + m.new_tokens
        by_width = np.add(by_width, m.width_rounds)
        expected, realised = expected + m.expected_accepted, realised + m.realised_accepted
    rows = sum(len(g) for g in groups)
    return {"predicted_speedup": ar_s / spec_s, "predicted_seconds": spec_s, "ar_predicted_seconds": ar_s,
            "tau": (new - rows) / rounds, "accepted": accepted, "width_rounds": by_width.tolist(),
            "expected_accepted": expected, "realised_accepted": realised, "lossless": f"{same}/{rows}"}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=registry.DEFAULT_MODEL)
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--subsets", nargs="+", default=list(DEFAULT_SUBSETS))
    ap.add_argument("--n", type=int, default=8, help="prompts per subset")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--drafters", nargs="+", required=True, help="DrafterSpec texts, each with scheduler=adaptive")
    ap.add_argument("--costs", help="a JSON written by this script: replay its costs instead of this machine's")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)

    specs = [DrafterSpec.parse(text) for text in args.drafters]
    for spec, text in zip(specs, args.drafters):
        if spec.scheduler != "adaptive":
            raise SystemExit(f"--drafters {text}: only the adaptive width is replayed (add scheduler=adaptive)")
    given = {}
    if args.costs:
        with open(args.costs) as f:
            given = json.load(f)["costs"]
    cfg, np_params, tokenizer = load_checkpoint(args.model)
    target = Target.from_params(cfg, np_params, tokenizer, backend="reference")
    summary = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": command_line(__file__, argv),
               "load_avg_at_start": os.getloadavg(), "costs": dict(given), "rows": []}
    drafters = {}
    for batch in args.batches:
        for subset in args.subsets:
            prompts = [tokenizer.encode_chat(t) for t in load_prompts(subset, args.n, args.data)]
            groups = groups_of(prompts, batch)
            ar_tokens = [generate(target, g, max_new_tokens=args.max_new_tokens, sampling=GREEDY).tokens
                         for g in groups]
            for spec, text in zip(specs, args.drafters):
                key = (spec.name, spec.k, spec.params)
                if key not in drafters:
                    drafters[key] = create_drafter(spec.name, target, spec.k, **dict(spec.params))
                drafter = drafters[key]
                row = {"subset": subset, "batch": batch, "drafter": text,
                       **replay(target, drafter, spec, groups, ar_tokens, args.max_new_tokens, summary["costs"])}
                summary["rows"].append(row)
                print(f"{subset:22s} B={batch} {spec.label:60s} predicted {row['predicted_speedup']:.3f}x  tau "
                      f"{row['tau']:.2f}  rounds by width {row['width_rounds']}  accepted expected / realised "
                      f"{row['expected_accepted']:.0f} / {row['realised_accepted']:.0f}  = AR {row['lossless']}",
                      flush=True)
    print("\nworst and mean predicted speedup over the subsets, per drafter spec and batch:")
    for batch in args.batches:
        for text in args.drafters:
            vals = [r["predicted_speedup"] for r in summary["rows"] if r["drafter"] == text and r["batch"] == batch]
            print(f"  B={batch} {text:70s} worst {min(vals):.3f}x  geomean {float(np.exp(np.mean(np.log(vals)))):.3f}x")
    summary["load_avg_at_end"] = os.getloadavg()
    write_json(args.json, summary)
    return summary


if __name__ == "__main__":
    main()
