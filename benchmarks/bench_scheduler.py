"""Verify-length scheduling against fixed draft lengths, batch 1 to 16: measured and predicted from SPS.

For a trained DSpark (or DFlash) drafter on the same --prompts prompts (MT-Bench first turns, GSM8K test and
HumanEval in turn, chat-templated), for each batch size B in --batches:
  * AR greedy: the baseline, in this process;
  * fixed draft length k for each k in --fixed (every round verifies k + 1 tokens per row);
  * the prefix scheduler (DSpark's hardware-aware greedy admission with the early stop) drafting --k tokens,
    with the engine's verify buckets (so a short schedule really runs a narrower target step) and the padded
    cost model; and the threshold scheduler (--threshold) with the same buckets.
Measured: decode tok/s and speedup over AR (same prompts, same process), tau, verified draft tokens per row-round.
Predicted: the SPS model the scheduler uses, with the measured acceptance: tok/s = B x (committed tokens per
row-round) x SPS(B x (1 + verified draft tokens per row-round)), SPS profiled on this machine (cached). It counts
verification only (no draft time) and assumes a ragged-batch backend, so it is an upper bound whose ranking of
the configurations is what to compare with the measured one.

    SPECDEC_CACHE=... python -m benchmarks.bench_scheduler runs/train/dspark [--drafter dspark] [--prompts 16] \
        [--batches 1 2 4 8 16] [--fixed 1 3 7] [--max-new-tokens 32] [--json docs/results/scheduler/summary.json]
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

import numpy as np

from benchmarks.common import (DEFAULT_DATA, SUBSETS, command_line, groups_of, load_prompts, run_ar, run_spec,
                               write_json)
from drafters import create_drafter
from specdec.metrics import speedup
from specdec.scheduling import Scheduler, load_or_measure_profile
from specdec.target import load_target


def predicted_tok_s(m, batch: int, sps) -> float:
    """B x committed tokens per row-round x SPS(B x (1 + verified draft tokens per row-round))."""
    per_round = (m.accepted_draft_tokens + m.rounds) / m.rounds
    verified = m.proposed_draft_tokens / m.rounds
    return batch * per_round * float(sps(np.asarray(batch * (1 + verified))))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="training run directory of the drafter")
    ap.add_argument("--drafter", default="dspark", choices=["dspark", "dflash"])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--prompts", type=int, default=16,
                    help="prompts in all, taken round-robin from the subsets' first ones (a multiple of every B)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--fixed", type=int, nargs="+", default=[1, 3, 7], help="fixed draft lengths")
    ap.add_argument("--k", type=int, default=7, help="draft length the schedulers choose within")
    ap.add_argument("--threshold", type=float, default=0.3, help="threshold scheduler's a_j cut ('' to skip: -1)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)

    target = load_target()
    tok = target.tokenizer
    per_subset = [load_prompts(s, args.prompts, args.data) for s in SUBSETS]
    prompts = [tok.encode_chat(t) for t in (x for row in zip(*per_subset) for x in row)][:args.prompts]
    profile = load_or_measure_profile(target, max(args.batches) * (args.k + 1))
    prefix = Scheduler("prefix", profile=profile)
    sps = prefix.sps
    configs = {f"fixed k={k}": (k, {}) for k in args.fixed}
    configs[f"prefix scheduler (k<={args.k}, buckets)"] = (args.k, {"scheduler": prefix, "buckets": "auto"})
    if args.threshold >= 0:
        configs[f"threshold {args.threshold:g} (k<={args.k}, buckets)"] = (
            args.k, {"scheduler": Scheduler("threshold", threshold=args.threshold), "buckets": "auto"})
    drafters = {k: create_drafter(args.drafter, target, k, path=args.path) for k in {k for k, _ in configs.values()}}
    summary = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
               "command": command_line(__file__, argv),
               "load_avg_at_start": os.getloadavg(), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
               "sps_profile": profile, "rows": []}
    print(f"# {len(prompts)} prompts, {args.max_new_tokens} new tokens, greedy; load {os.getloadavg()[0]:.1f}",
          flush=True)
    for batch in args.batches:
        groups = groups_of(prompts, batch)
        ar_tokens, ar = run_ar(target, groups, args.max_new_tokens)
        summary["rows"].append({"batch": batch, "method": "AR", "tok_s": ar.tokens_per_second, "speedup": 1.0})
        print(f"B={batch:2d} AR {ar.tokens_per_second:.1f} tok/s", flush=True)
        for name, (k, engine) in configs.items():
            tokens, m = run_spec(target, drafters[k], "greedy_chain", groups, args.max_new_tokens, **engine)
            row = {"batch": batch, "method": name, "tau": m.tau, "tok_s": m.tokens_per_second,
                   "speedup": speedup(ar, m), "verified_per_round": m.proposed_draft_tokens / m.rounds,
                   "predicted_tok_s": predicted_tok_s(m, batch, sps), "same_as_ar": tokens == ar_tokens}
            summary["rows"].append(row)
            print(f"B={batch:2d} {name:36s} tau {m.tau:.2f}  verified {row['verified_per_round']:.2f}/round  "
                  f"{row['tok_s']:6.1f} tok/s  x{row['speedup']:.2f}  predicted {row['predicted_tok_s']:.1f}  "
                  f"= AR {row['same_as_ar']}", flush=True)
    summary["load_avg_at_end"] = os.getloadavg()
    print()
    print("| B | method | tau | verified drafts / row-round | tok/s | speedup vs AR | predicted tok/s (SPS) | = AR |")
    print("|---|---|---|---|---|---|---|---|")
    for r in summary["rows"]:
        if r["method"] == "AR":
            print(f"| {r['batch']} | AR | 1.00 | - | {r['tok_s']:.1f} | 1.00x | - | - |")
        else:
            print(f"| {r['batch']} | {r['method']} | {r['tau']:.2f} | {r['verified_per_round']:.2f} | "
                  f"{r['tok_s']:.1f} | {r['speedup']:.2f}x | {r['predicted_tok_s']:.1f} | {r['same_as_ar']} |")
    print()
    print("| B | best fixed (measured) | scheduler (measured) | best fixed (predicted) | scheduler (predicted) |")
    print("|---|---|---|---|---|")
    for batch in args.batches:
        rows = [r for r in summary["rows"] if r["batch"] == batch and r["method"] != "AR"]
        fixed = [r for r in rows if r["method"].startswith("fixed")]
        sched = [r for r in rows if r["method"].startswith("prefix")]
        if not fixed or not sched:
            continue
        bm = max(fixed, key=lambda r: r["tok_s"])
        bp = max(fixed, key=lambda r: r["predicted_tok_s"])
        s = sched[0]
        print(f"| {batch} | {bm['method']} {bm['tok_s']:.1f} | {s['tok_s']:.1f} | {bp['method']} "
              f"{bp['predicted_tok_s']:.1f} | {s['predicted_tok_s']:.1f} |")
    write_json(args.json, summary)
    return summary


if __name__ == "__main__":
    main()
