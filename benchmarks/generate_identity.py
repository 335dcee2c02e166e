"""`specdec generate` with and without a drafter, same seed, temperature > 0: under the drafter-invariant policies
each drafter prints AR's text for the seed, token for token, and a second run prints it again.

    python -m benchmarks.generate_identity                       # writes docs/results/invariant/identity/
    python -m benchmarks.generate_identity --prompts 1 --max-new-tokens 8 --out runs/benchmarks/identity  # a check

Each command is the real CLI in a process of its own (`python -m experiments.cli generate PROMPT ... --seed S
--temperature 0.7 --top-p 0.95`), all prompts in one call (one batch): plain AR; n-gram, the shipped DSpark as a
7-node tree, the hybrid and suffix decoding, each with `--policy invariant_chain` (a tree drafter runs it as
invariant_tree) at a fixed width; AR and the hybrid a second time; the DSpark chain; n-gram with the adaptive
width (its round costs timed on this machine). The prompts are ones no drafter or knob was tuned on: MBPP test
tasks and GPTeacher codegen instructions (a random sample). What is compared is everything the command prints
before its metrics (the prompts and the decoded texts). Correctness, not timed; exit status 1 when any text
differs from AR's. results.{json,md} are rewritten after each command, so a stopped run keeps what it did.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import REPO, Report

TITLE = "specdec generate: the same text with and without a drafter"
OUT = REPO / "docs" / "results" / "invariant" / "identity"
SHIPPED = "drafters/trained/dspark_smollm2_mix"
TREE = ["--param", "tree_top_k=4", "--param", "tree_depth=3"]
INVARIANT = ["--policy", "invariant_chain"]
# label -> the arguments after the prompts and the sampling flags; the drafters' settings of configs/benchmarks/.
# The verify width is fixed (every drafted token verified) but in the last run, where the adaptive width picks
# it from round costs it times on this machine first (minutes at batch > 1 on a busy 2-core CPU).
FIXED = ["--scheduler", "fixed"]
HYBRID = ["--drafter", "hybrid", "-k", "7", *TREE, "--param", "min_match=1", "--param", "lookup_nodes=3",
          "--param", "alone_match=4", *INVARIANT]
COMMANDS = {
    "AR": [],
    "n-gram": ["--drafter", "ngram", "-k", "5", "--param", "max_ngram=3", *INVARIANT, *FIXED],
    "DSpark 7-node tree": ["--drafter", SHIPPED, "-k", "7", *TREE, *INVARIANT, *FIXED],
    "hybrid": [*HYBRID, *FIXED],
    "suffix": ["--drafter", "suffix", "-k", "8", *INVARIANT, *FIXED],
    "AR, second run": [],
    "hybrid, second run": [*HYBRID, *FIXED],
    "DSpark chain": ["--drafter", SHIPPED, "-k", "7", *INVARIANT, *FIXED],
    "n-gram, adaptive width": ["--drafter", "ngram", "-k", "5", "--param", "max_ngram=3", *INVARIANT],
}


def untuned_prompts(n: int) -> list[str]:
    """`n` MBPP test tasks (with their first test, as MBPP's prompt has it) and `n` GPTeacher codegen
    instructions, sampled with seed 1, through the loaders `specdec run` uses."""
    from experiments.datasets import load_all
    from specdec.config import DatasetConfig

    data = Path(os.environ.get("SPECDEC_DATA", REPO.parent / "shared" / "data"))
    sets = [DatasetConfig(name=str(data / "mbpp" / "mbpp.jsonl"), split="test", sample_seed=1, limit=n),
            DatasetConfig(name=str(data / "gpteacher" / "codegen-instruct.json"), sample_seed=1, limit=n)]
    return [p.text for p in load_all(sets)]


def run_generate(prompts: list[str], args: list[str]) -> tuple[str, dict, float]:
    """(what the command printed before its metrics, the metrics, wall seconds) of one `specdec generate`."""
    cmd = [sys.executable, "-m", "experiments.cli", "generate", *prompts, *args, "--json"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args) or 'AR'} exited with {done.returncode}:\n{done.stderr[-2000:]}")
    text, sep, metrics = done.stdout.rpartition("\n{\n")  # --json prints the metrics last, as an indented object
    if not sep:
        raise RuntimeError(f"no metrics in the output of {' '.join(args) or 'AR'}:\n{done.stdout[-2000:]}")
    return text, json.loads("{\n" + metrics), seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per source (MBPP test, GPTeacher codegen)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--out", type=Path, default=OUT, help=f"where results.json and results.md go (default {OUT})")
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.max_new_tokens < 1 or args.temperature <= 0:
        ap.error("--prompts and --max-new-tokens must be >= 1 and --temperature > 0 (at 0 every policy is greedy)")
    report = Report(__file__, argv, args.out, title=TITLE)
    prompts = untuned_prompts(args.prompts)
    sampling = ["--seed", str(args.seed), "--temperature", str(args.temperature), "--top-p", str(args.top_p),
                "--max-new-tokens", str(args.max_new_tokens)]
    runs = {}
    for label, extra in COMMANDS.items():
        text, metrics, seconds = run_generate(prompts, [*sampling, *extra])
        runs[label] = {"args": [*sampling, *extra], "text": text, "metrics": metrics, "seconds": round(seconds, 1)}
        same = text == runs["AR"]["text"]
        print(f"{label}: {'same text as AR' if same else 'DIFFERENT text from AR'} "
              f"(tau {metrics.get('tau', 1.0):.2f}, {seconds:.0f} s)", flush=True)
        write(report, args, prompts, runs)
    return 0 if all(r["text"] == runs["AR"]["text"] for r in runs.values()) else 1


def write(report: Report, args, prompts: list[str], runs: dict) -> None:
    """results.json / results.md for the runs so far (rewritten after each, so a stopped run keeps them)."""
    report.meta.pop("load_avg_end", None)
    report.tables.clear()
    report.finish()
    ar = runs["AR"]["text"]
    rows = [[label, "yes" if r["text"] == ar else "**no**", f"{r['metrics'].get('tau', 1.0):.2f}",
             "-" if not math.isfinite(r["metrics"].get("acceptance_rate") or math.nan)
             else f"{r['metrics']['acceptance_rate']:.2f}",
             "`specdec generate PROMPTS " + " ".join(r["args"]) + "`"] for label, r in runs.items()]
    report.table("Text identical to AR's", ["run", "same text as AR", "tau", "accept rate", "command"], rows,
                 note=f"{len(prompts)} prompts in one batch ({args.prompts} MBPP test, {args.prompts} GPTeacher "
                      f"codegen, sampled with seed 1), {args.max_new_tokens} new tokens", echo=False)
    report.section("The text every run printed", "````\n" + ar.strip() + "\n````", echo=False)
    report.write({"prompts": prompts, "runs": runs})


if __name__ == "__main__":
    sys.exit(main())
