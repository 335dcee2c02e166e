"""How well do draft confidences predict acceptance in real decoding? AUROC and ECE, before and after calibration.

For a trained DSpark drafter (and optionally DFlash, whose confidence is the heuristic running product of its top
draft probability), decode the first --n prompts of MT-Bench (first turns), GSM8K test and HumanEval with the
host-stepped engine loop, fixed draft length k, and record every round of every active row: the prefix-survival
estimate a_j (`Drafter.draft_confidence`) and whether the target accepted draft position j (a hit at j means
positions 0..j all survived). Then, pooled over rounds and positions and per position:

  AUROC  P(a of an accepted position > a of a rejected one) (ties count 1/2): does a rank acceptance?
  ECE    10 equal-width bins, sum of |mean a - accept rate| x bin share: is a a probability?

Each --temperatures value is reported separately: DSpark fits one set of per-slot temperatures for greedy
verification (T = 0: accepted iff the argmaxes agree) and one for sampled verification (T = 1), and drafts with
the set of the temperature in use (`dspark.confidence_temperatures`), so the T = 0 rows show the greedy fit's
ECE and the T > 0 rows the sampled fit's. "before calibration" is the same DSpark drafter with both sets of
temperatures at 1 (the raw confidence head); the temperatures change only confidences, never drafts, so both
see identical rounds.

    SPECDEC_CACHE=... python -m benchmarks.confidence_calibration runs/train/dspark [--dflash runs/train/dflash] \
        [--n 4] [--max-new-tokens 64] [--temperatures 0 1] [--json docs/results/confidence/summary.json]
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from scipy.stats import mannwhitneyu

from benchmarks.common import DEFAULT_DATA, SUBSETS, command_line, load_prompts, write_json
from drafters import create_drafter
from drafters.dspark import DSparkDrafter, ece
from specdec.engine import speculative_generate
from specdec.sampling import SamplingParams
from specdec.target import load_target


def auroc(score: np.ndarray, label: np.ndarray) -> float:
    """P(score of a positive > score of a negative), ties 1/2 (Mann-Whitney U / (n+ n-)); nan without both."""
    pos, neg = score[label], score[~label]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    return float(mannwhitneyu(pos, neg).statistic / (len(pos) * len(neg)))


def collect(target, drafter, prompts, max_new: int, sampling: SamplingParams, batch: int, seed: int = 0):
    """(confidence [R, k], accepted-position mask [R, k]) over all active row-rounds."""
    conf, hit = [], []

    def on_round(draft, confidence, result, active):
        act = np.asarray(active)
        k = confidence.shape[1]
        conf.append(np.asarray(confidence)[act])
        hit.append((np.arange(k)[None, :] < np.asarray(result.num_accepted)[:, None])[act])

    for i in range(0, len(prompts), batch):
        speculative_generate(target, drafter, prompts[i:i + batch], policy="rejection_chain",
                             max_new_tokens=max_new, sampling=sampling, seed=seed + i, compiled=False,
                             on_round=on_round)
    return np.concatenate(conf), np.concatenate(hit)


def scores(conf: np.ndarray, hit: np.ndarray) -> dict:
    per_pos = [{"position": j + 1, "auroc": auroc(conf[:, j], hit[:, j]), "ece": ece(conf[:, j], hit[:, j]),
                "mean_confidence": float(conf[:, j].mean()), "accept_rate": float(hit[:, j].mean())}
               for j in range(conf.shape[1])]
    return {"auroc": auroc(conf.ravel(), hit.ravel()), "ece": ece(conf.ravel(), hit.ravel()),
            "mean_confidence": float(conf.mean()), "accept_rate": float(hit.mean()), "rounds": int(len(conf)),
            "by_position": per_pos}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dspark", help="DSpark training run directory")
    ap.add_argument("--dflash", help="DFlash training run directory (its heuristic confidence, for comparison)")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--n", type=int, default=4, help="prompts per subset")
    ap.add_argument("--k", type=int, default=7, help="draft length")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)

    target = load_target()
    tok = target.tokenizer
    prompts = [tok.encode_chat(t) for s in SUBSETS for t in load_prompts(s, args.n, args.data)]
    calibrated = create_drafter("dspark", target, args.k, path=args.dspark)
    fitted = {k: v for k, v in calibrated.params.items() if k in ("conf_temperature", "conf_temperature_greedy")}
    raw_params = {**calibrated.params, **{k: jnp.ones_like(v) for k, v in fitted.items()}}
    variants = {"dspark calibrated": calibrated,
                "dspark before calibration": DSparkDrafter(calibrated.arch, raw_params, args.k)}
    if args.dflash:
        variants["dflash (top-prob heuristic)"] = create_drafter("dflash", target, args.k, path=args.dflash)
    summary = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
               "command": command_line(__file__, argv),
               "temperatures_fitted": {k: np.asarray(v).tolist() for k, v in fitted.items()},
               "prompts": len(prompts), "k": args.k, "max_new_tokens": args.max_new_tokens, "rows": []}
    for temp in args.temperatures:
        sampling = SamplingParams(temperature=temp)
        for name, drafter in variants.items():
            conf, hit = collect(target, drafter, prompts, args.max_new_tokens, sampling, args.batch)
            row = {"drafter": name, "temperature": temp, **scores(conf, hit)}
            summary["rows"].append(row)
            print(f"T={temp:g} {name:30s} AUROC {row['auroc']:.3f}  ECE {row['ece']:.3f}  mean a "
                  f"{row['mean_confidence']:.3f} vs accept {row['accept_rate']:.3f}  ({row['rounds']} row-rounds)",
                  flush=True)
    print()
    print("| T | confidence | AUROC | ECE | mean a | accept rate | AUROC / ECE by position (1..k) |")
    print("|---|---|---|---|---|---|---|")
    for r in summary["rows"]:
        pos = " ".join(f"{p['auroc']:.2f}/{p['ece']:.2f}" for p in r["by_position"])
        print(f"| {r['temperature']:g} | {r['drafter']} | {r['auroc']:.3f} | {r['ece']:.3f} | "
              f"{r['mean_confidence']:.3f} | {r['accept_rate']:.3f} | {pos} |")
    write_json(args.json, summary)
    return summary


if __name__ == "__main__":
    main()
