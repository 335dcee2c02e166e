"""Draft cost per round of trained drafters, next to the target's verify step, in one run.

For each drafter (label=path[:k], e.g. dspark=runs/train/dspark:7; the drafter kind is read from the run's
drafter.json, so the label is free: dspark_8k=runs/train/dspark_v8k:7) and batch size: the engine's jitted `propose`
(one drafting round: DFlash/DSpark one block forward + lm_head (+ DSpark's sequential Markov sampling);
EAGLE-3 k sequential draft-layer steps) and the target's verify forward on k + 1 tokens per row, both after a
real prompt's prefill, median of --reps timed calls after a compile call. Also the drafter's parameter count.
Greedy sampling; the drafter state is not advanced between calls (every call drafts the same round).

    SPECDEC_CACHE=... python -m benchmarks.bench_draft_cost dflash=runs/train/dflash:7 dspark=runs/train/dspark:7 \
        eagle3=runs/train/eagle3:5 [--batches 1 8] [--reps 10]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import jax

from benchmarks.common import DEFAULT_DATA, load_prompts, median_seconds
from drafters import create_drafter
from specdec import engine
from specdec.generate import cache_capacity, pad_prompts
from specdec.sampling import GREEDY
from specdec.target import load_target
from specdec.verify import get_policy


def median_ms(fn, reps: int) -> float:
    return 1e3 * median_seconds(fn, reps)


def round_costs(target, drafter, prompts, reps: int) -> dict:
    spec = engine.LoopSpec(cfg=target.cfg, forward=target.forward, drafter=drafter,
                           policy=get_policy("greedy_chain"), sampling=GREEDY, eos_ids=tuple(target.eos_token_ids))
    tokens, lengths = pad_prompts(prompts, target.cfg.pad_token_id or 0)
    capacity = cache_capacity(lengths, 64, extra=drafter.num_draft_tokens + 1)
    state = engine.start(spec, target, drafter, target.init_cache(len(prompts), capacity), tokens, lengths,
                         capacity, 64, seed=0)
    draft_ms = median_ms(lambda: engine._jit_propose(spec, drafter.params, state)[0].tokens, reps)
    draft, _ = engine._jit_propose(spec, drafter.params, state)
    verify = jax.jit(lambda s, d: engine.verify_step(spec, target.params, s, d)[0].logits)
    verify_ms = median_ms(lambda: verify(state, draft), reps)
    return {"draft_ms": draft_ms, "verify_ms": verify_ms}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafters", nargs="+", help="label=path[:k] (the kind comes from path/drafter.json)")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    target = load_target()
    texts = load_prompts("mt_bench", max(args.batches), args.data)
    rows = []
    print(f"# load avg {os.getloadavg()[0]:.1f}; median of {args.reps} calls")
    for item in args.drafters:
        name, _, rest = item.partition("=")
        path, _, k = rest.partition(":")
        drafter = create_drafter(None, target, int(k or 5), path=path)  # the kind comes from the directory
        for batch in args.batches:
            prompts = [target.tokenizer.encode_chat(t) for t in texts[:batch]]
            r = {"drafter": name, "k": drafter.num_draft_tokens, "batch": batch, **round_costs(target, drafter,
                                                                                              prompts, args.reps)}
            r["draft_over_verify"] = r["draft_ms"] / r["verify_ms"]
            rows.append(r)
            print(f"{name:8s} k={r['k']} B={batch:2d}: draft {r['draft_ms']:.1f} ms/round, verify ({r['k'] + 1} "
                  f"tokens/row) {r['verify_ms']:.1f} ms -> draft/verify {r['draft_over_verify']:.2f}", flush=True)
    print()
    print("| drafter | k | B | draft ms / round | verify ms (k+1 tokens/row) | draft / verify |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['drafter']} | {r['k']} | {r['batch']} | {r['draft_ms']:.1f} | {r['verify_ms']:.1f} | "
              f"{r['draft_over_verify']:.2f} |")
    return rows


if __name__ == "__main__":
    main()
