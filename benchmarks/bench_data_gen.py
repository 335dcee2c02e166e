"""Distillation data throughput: the static-batch generator against continuous batching, same prompts, one run.

Both paths answer the same chat-templated prompts (sampled from a prompt file) with the target, as
`specdec data` does:
  * static ("old"): prompts sorted by length, fixed batches of B, each batch decoded in one while_loop until
    its longest row ends (`specdec.train.data.generate_fixed`, the generator `specdec data` used before);
  * continuous ("new"): B decode rows, refilled `insert_rows` prompts at a time as rows finish
    (`specdec.generate.generate_continuous`, what `specdec data` uses now).
Throughput = response tokens (EOS included) / wall seconds, prefill and host work included, compilation
excluded (both paths are warmed up first). Utilisation = decode row-steps that produced a kept token / all
decode row-steps. The paths sample with different keys (per batch vs per prompt), so at temperature > 0 the
responses differ and so do the token totals; at --temperature 0 they are the same tokens.

Other jobs on the machine make the numbers meaningless: the load average before and after each timed path is
reported next to its figure. The prompts: --prompts (default $SPECDEC_DATA/prompts/train_prompts.jsonl).

    python -m benchmarks.bench_data_gen [--n 128] [--batches 64] [--paths static continuous]
Writes runs/benchmarks/bench_data_gen/results.{json,md} (`--out`).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks.common import Report, add_output_arg
from specdec.generate import ContinuousStats, continuous_shapes, generate_continuous
from specdec.sampling import SamplingParams
from specdec.target import load_target
from specdec.train.data import encode_prompt, generate_fixed, load_prompt_records

PROMPTS = os.path.join(os.environ.get("SPECDEC_DATA", "data"), "prompts", "train_prompts.jsonl")


def run_static(target, prompts, shapes, sampling, seed, warmup=True) -> dict:
    b = shapes.batch_size
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    batches = [order[k:k + b] for k in range(0, len(order), b)]

    def padded(idx):
        batch = [prompts[i] for i in idx]
        return batch + [batch[-1]] * (b - len(batch))  # fixed batch shape: one compiled program

    args = (shapes.width, shapes.capacity, shapes.max_new_tokens, sampling)
    if warmup:
        generate_fixed(target, padded(batches[0]), *args, seed, limit=2)
    tokens, row_steps, kept = 0, 0, 0
    t0 = time.perf_counter()
    for n, idx in enumerate(batches):
        rows = generate_fixed(target, padded(idx), *args, seed * 1_000_003 + n)
        counts = [len(r) for r in rows]
        tokens += sum(counts[:len(idx)])
        row_steps += b * (max(counts) - 1)  # the first token comes from the prefill, one decode step per next
        kept += sum(c - 1 for c in counts[:len(idx)])
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "utilisation": kept / max(row_steps, 1)}


def run_continuous(target, prompts, shapes, sampling, seed, warmup=True) -> dict:
    stats = ContinuousStats()
    out = dict(generate_continuous(target, prompts, list(range(len(prompts))), shapes, sampling, seed, stats,
                                   warmup=warmup))
    assert len(out) == len(prompts)
    return {"tokens": stats.new_tokens, "seconds": stats.seconds, "utilisation": stats.utilisation,
            "chunks": stats.chunks, "inserts": stats.inserts}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=PROMPTS)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--sample-seed", type=int, default=0)
    ap.add_argument("--max-prompt-len", type=int, default=256, help="longer prompts are skipped (as in specdec data)")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95, help="the shipped data configs sample with top_p 0.95")
    ap.add_argument("--batches", type=int, nargs="+", default=[64])
    ap.add_argument("--insert-rows", type=int, default=8)
    ap.add_argument("--paths", nargs="+", default=["static", "continuous"], choices=["static", "continuous"])
    ap.add_argument("--seed", type=int, default=0)
    add_output_arg(ap, __file__)
    args = ap.parse_args(argv)
    report = Report(__file__, argv, args.out)

    target = load_target("smollm2-135m-instruct")
    records = load_prompt_records(args.prompts, limit=args.n, sample_seed=args.sample_seed)
    prompts = [p for p in (encode_prompt(target, r, True) for r in records) if len(p) <= args.max_prompt_len]
    lengths = [len(p) for p in prompts]
    sampling = SamplingParams(args.temperature, top_p=args.top_p)
    print(f"{len(prompts)} prompts (length {min(lengths)}..{max(lengths)}, mean {np.mean(lengths):.0f}), "
          f"max_new_tokens {args.max_new_tokens}, temperature {args.temperature}, top_p {args.top_p}, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    results = []
    for b in args.batches:
        shapes = continuous_shapes(target, lengths, args.max_new_tokens, b, args.insert_rows)
        row = {"batch": b, "insert_rows": shapes.insert_rows, "width": shapes.width, "capacity": shapes.capacity}
        for path in args.paths:
            run = run_static if path == "static" else run_continuous
            load_before = os.getloadavg()[0]
            r = run(target, prompts, shapes, sampling, args.seed)
            r["load_before"], r["load_after"] = load_before, os.getloadavg()[0]
            r["tokens_per_second"] = r["tokens"] / r["seconds"]
            row[path] = r
            print(f"B={b:<4} {path:<10} {r['tokens']:6d} tokens in {r['seconds']:7.1f} s = "
                  f"{r['tokens_per_second']:6.1f} tok/s, utilisation {r['utilisation']:.3f}, "
                  f"load {r['load_before']:.2f} -> {r['load_after']:.2f}", flush=True)
        if "static" in row and "continuous" in row:
            row["ratio"] = row["continuous"]["tokens_per_second"] / row["static"]["tokens_per_second"]
            print(f"B={b:<4} continuous / static = {row['ratio']:.2f}x", flush=True)
        results.append(row)
    report.finish()
    report.table("Distillation data throughput", ["B", "path", "tokens", "seconds", "tok/s", "utilisation",
                                                  "load before -> after"],
                 [[row["batch"], path, row[path]["tokens"], f"{row[path]['seconds']:.1f}",
                   f"{row[path]['tokens_per_second']:.1f}", f"{row[path]['utilisation']:.3f}",
                   f"{row[path]['load_before']:.2f} -> {row[path]['load_after']:.2f}"]
                  for row in results for path in args.paths],
                 note=f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, temperature {args.temperature}, "
                      f"top_p {args.top_p}; continuous / static: "
                      + ", ".join(f"B={r['batch']} {r['ratio']:.2f}x" for r in results if "ratio" in r))
    report.write({"args": {k: v for k, v in vars(args).items() if k != "out"}, "results": results})
    return results


if __name__ == "__main__":
    main()
