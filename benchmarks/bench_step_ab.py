"""A/B of two source trees on the full SmolLM2 target step (decode T=1 / verify T=6, B=1 / 8, cache 512 / 2048),
interleaved in one run, e.g. the KV-cache layout change ([B, S, KVH, HD] at commit 691c889 -> [B, KVH, S, HD]):

    git worktree add --detach /tmp/old 691c889
    SPECDEC_CACHE=/tmp/sdcache python benchmarks/bench_step_ab.py --old /tmp/old --new . --rounds 10 --reps 3

Two long-lived worker processes (one per source tree, selected by PYTHONPATH) load the real model and compile
one step per (capacity, B, T): `target.forward` jitted with the cache donated, T new tokens per row at length
128, returning the logits and the written cache (what an engine step does). The driver then asks them for
timed blocks in alternating order (A B, B A, ...), so both see the same machine load; each block is `--reps`
steps after 2 warm-up steps, and the reported figures are medians over all rounds' steps, of wall time and
of the worker's CPU time (all its threads; less inflated than wall time when other jobs share the cores).
The first step's logits of both trees are compared (same weights, same inputs).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CONFIGS = [(cap, b, t) for cap in (512, 2048) for b in (1, 8) for t in (1, 6)]
START = 128


def worker():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import specdec
    from specdec.target import load_target
    target = load_target("smollm2-135m-instruct")
    steps = {}
    for cap, b, t in CONFIGS:
        cache = target.init_cache(b, cap).with_lengths(jnp.full((b,), START, jnp.int32))
        tokens = jnp.asarray(np.random.default_rng(0).integers(3, 40000, (b, t)), jnp.int32)

        def step(params, cache, tokens):
            out = target.forward(params, target.cfg, cache, tokens)
            return out.logits, out.cache
        f = jax.jit(step, donate_argnums=(1,))
        logits, cache = f(target.params, cache, tokens)
        steps[(cap, b, t)] = [f, cache, tokens]
        np.save(f"{os.environ['AB_OUT']}_{cap}_{b}_{t}.npy", np.asarray(logits))  # compared by the driver
    print(json.dumps({"ready": specdec.__file__}), flush=True)
    for line in sys.stdin:
        cap, b, t, reps = map(int, line.split())
        entry = steps[(cap, b, t)]
        f, cache, tokens = entry
        times = []
        for i in range(reps + 2):
            t0, c0 = time.perf_counter(), time.process_time()
            logits, cache = f(target.params, cache, tokens)
            logits.block_until_ready()
            if i >= 2:
                times.append((time.perf_counter() - t0, time.process_time() - c0))
        entry[1] = cache
        print(json.dumps(times), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import numpy as np
    procs, out_dir = {}, tempfile.mkdtemp(prefix="bench_step_ab_")
    for name, tree in (("old", args.old), ("new", args.new)):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), AB_OUT=os.path.join(out_dir, name))
        procs[name] = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"],
                                       cwd=os.path.abspath(tree), env=env, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
    for name, p in procs.items():
        print(name, json.loads(p.stdout.readline()), flush=True)
    for cfg in CONFIGS:
        a, b = (np.load(os.path.join(out_dir, "_".join(map(str, (name, *cfg))) + ".npy")) for name in ("old", "new"))
        print(f"cap={cfg[0]} B={cfg[1]} T={cfg[2]}: max |logit diff| {np.abs(a - b).max():.2e}, "
              f"argmax equal {bool((a.argmax(-1) == b.argmax(-1)).all())}", flush=True)
    samples = {(n, c): [] for n in procs for c in CONFIGS}
    t_start = time.time()
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for cfg in CONFIGS:
            for name in order:
                procs[name].stdin.write(" ".join(map(str, (*cfg, args.reps))) + "\n")
                procs[name].stdin.flush()
                samples[(name, cfg)] += json.loads(procs[name].stdout.readline())
        print(f"round {r + 1}/{args.rounds} done, {time.time() - t_start:.0f} s, load {os.getloadavg()[0]:.1f}",
              flush=True)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    print("\n| capacity | B | T | old [B,S,KVH,HD] ms | new [B,KVH,S,HD] ms | speedup | old p10-p90 | new p10-p90 "
          "| old CPU ms | new CPU ms | CPU speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for cfg in CONFIGS:
        o, n = (np.array(samples[(k, cfg)]) * 1e3 for k in ("old", "new"))
        (ow, oc), (nw, nc) = o.T, n.T
        print(f"| {cfg[0]} | {cfg[1]} | {cfg[2]} | {np.median(ow):.1f} | {np.median(nw):.1f} | "
              f"{np.median(ow) / np.median(nw):.2f}x | {np.percentile(ow, 10):.0f}-{np.percentile(ow, 90):.0f} | "
              f"{np.percentile(nw, 10):.0f}-{np.percentile(nw, 90):.0f} | "
              f"{np.median(oc):.1f} | {np.median(nc):.1f} | "
              f"{np.median(oc) / np.median(nc):.2f}x |")

if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        main()
