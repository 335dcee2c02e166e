"""How much of the target's real output a reduced draft vocabulary can draft at all.

A drafter with `draft_vocab_size: N` (EAGLE-3, DFlash, DSpark) proposes only the N most frequent response tokens of
its training data (the d2t map); a token outside the map is always rejected at its position. This script reads the
autoregressive answers of finished runs (every `answers/autoregressive.jsonl` under the given directories, each
distinct answer once, re-tokenised with the target's tokenizer) and prints, per dataset, the share of output tokens
inside the top-N map built from a distillation data directory's frequencies, for several N, and inside the saved
d2t map of each `--drafter` run.

    python -m benchmarks.vocab_coverage runs/data/smollm2_mix960 runs/parallel --sizes 4096 8192 16384 32768 \\
        --drafter runs/train/dspark_v8k
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from specdec.target import load_target
from specdec.train.data import load_distill_data
from specdec.train.tasks import reduced_vocab


def answer_tokens(dirs: list[Path], tokenizer) -> dict[str, np.ndarray]:
    """{dataset: token ids of every distinct AR answer found under `dirs`}."""
    seen, tokens = set(), defaultdict(list)
    for d in dirs:
        for path in sorted(d.rglob("answers/autoregressive.jsonl")):
            for line in path.read_text().splitlines():
                record = json.loads(line)
                dataset = record["answer_id"].split(":", 1)[1].split("/", 1)[0]
                for turn in record["choices"][0]["turns"]:
                    if (record["answer_id"], turn) not in seen:
                        seen.add((record["answer_id"], turn))
                        tokens[dataset].extend(tokenizer.encode(turn))
    if not tokens:
        raise SystemExit(f"no answers/autoregressive.jsonl under {', '.join(map(str, dirs))}")
    return {k: np.asarray(v) for k, v in sorted(tokens.items())}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data_dir", help="distillation data directory (`specdec data`) whose frequencies rank the ids")
    ap.add_argument("runs", nargs="+", type=Path, help="run or sweep directories holding answers")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--drafter", action="append", default=[], help="a trained run whose saved d2t map to check")
    args = ap.parse_args(argv)
    target = load_target()
    data = load_distill_data(args.data_dir)
    counts = data.token_counts(target.cfg.vocab_size)
    out = answer_tokens(args.runs, target.tokenizer)
    maps = {f"top {n}": reduced_vocab(counts, n, target.cfg.eos_token_ids) for n in args.sizes}
    for run in args.drafter:
        buffers = np.load(Path(run) / "params.npz")
        if "buffers/d2t" not in buffers.files:
            raise SystemExit(f"{run} has no d2t map (trained with the full vocabulary)")
        maps[f"{Path(run).name} d2t ({len(buffers['buffers/d2t'])})"] = buffers["buffers/d2t"]
    print(f"# {len(data)} examples, {int((counts > 0).sum())} distinct response tokens in {args.data_dir}; "
          + ", ".join(f"{k}: {len(v)} answer tokens" for k, v in out.items()))
    print("| draft vocabulary | " + " | ".join(out) + " |")
    print("|---|" + "---|" * len(out))
    rows = []
    for name, ids in maps.items():
        inside = np.zeros(target.cfg.vocab_size, bool)
        inside[np.asarray(ids)] = True
        share = {k: float(inside[v].mean()) for k, v in out.items()}
        rows.append({"vocabulary": name, **share})
        print(f"| {name} | " + " | ".join(f"{share[k]:.1%}" for k in out) + " |")
    return rows


if __name__ == "__main__":
    main()
