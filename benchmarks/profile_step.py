"""Where the target's compiled decode step spends its time, op by op, from a `jax.profiler` trace (ONE run).

Runs `target.forward` jitted as bench_decode.py's step (donated cache, fed its own argmax) for --steps steps under
the profiler, reads the trace's per-op events (XLA:CPU's thunk executor names each HLO instruction), maps them
to the compiled HLO, and prints milliseconds per step by group:
  * each weight's products (summed over the layers): ms per step and the GB/s of weights they streamed;
  * attention (the products and fusions that read the KV cache), the cache writes, everything else;
  * the executor's total, so the sum of the groups can be checked against it.
The profiler adds a few microseconds per op, so the groups are a breakdown, not a timing: take step times from
bench_decode.py. Measure on a quiet machine (docs/BENCHMARKS.md).

    python -m benchmarks.profile_step [--batch 1] [--width 1] [--capacity 256] [--length 100] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import gzip
import json
import os
import re
import tempfile

import jax
import jax.numpy as jnp

from benchmarks.bench_decode import make_step
from benchmarks.common import command_line, write_json
from specdec.models import registry
from specdec.target import load_target


def op_groups(hlo_text: str, capacity: int) -> dict[str, str]:
    """HLO instruction name -> group: a weight's products (the layer index dropped), the other products (attention
    over the cache), the cache writes, the fusions over the cache slots (the attention's mask and softmax), and
    everything else (norms, RoPE, residual adds, the final argmax)."""
    groups = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = (\S+) (\w+)\((.*?)\)", line)
        if not m:
            continue
        name, shape, op, operands = m.groups()
        weight = re.search(r"params__(?:layers___\d+___)?(\w+?)__", operands)
        dims = re.findall(r"\d+", shape.split("{")[0])
        product = op == "dot" or name.startswith("ynn_fusion")  # XLA:CPU runs a dot of 2+ rows as a YNNPACK fusion
        if product and weight:
            groups[name] = f"products: {weight.group(1)}"
        elif op == "dot" or (product and str(capacity) in dims):
            groups[name] = "attention: products over the cache"
        elif "scatter" in name:
            groups[name] = "cache writes"
        elif str(capacity) in dims:
            groups[name] = "attention: mask and softmax over the cache slots"
        else:
            groups[name] = "other (norms, RoPE, residual adds, argmax)"
    return groups


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=registry.DEFAULT_MODEL)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--width", type=int, default=1, help="tokens per row (1: a decode step)")
    ap.add_argument("--capacity", type=int, default=256, help="KV cache slots (generate uses prompt + new, to 64)")
    ap.add_argument("--length", type=int, default=100, help="tokens already in the cache")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    if not 0 <= args.length <= args.capacity - args.width:
        raise SystemExit(f"error: --length must be in [0, capacity - width] = [0, {args.capacity - args.width}]")

    target = load_target(args.model)
    kind_bytes = collections.Counter()  # bytes of each weight, summed over the layers (the products' GB/s)
    for path, leaf in jax.tree_util.tree_flatten_with_path(target.params)[0]:
        kind_bytes[f"products: {getattr(path[-1], 'key', path[-1])}"] += leaf.nbytes
    cache = target.init_cache(args.batch, args.capacity).with_lengths(jnp.full((args.batch,), args.length, jnp.int32))
    tokens = jnp.ones((args.batch, args.width), jnp.int32)
    step = make_step(target.forward, target.cfg)
    compiled = step.lower(target.params, cache, tokens).compile()
    groups = op_groups(compiled.as_text(), args.capacity)
    # each step rewinds to --length with a fresh lengths array: the step donates the whole cache, lengths included
    for _ in range(5):
        tokens, cache = step(target.params, cache, tokens)
        cache = cache.with_lengths(jnp.full((args.batch,), args.length, jnp.int32))
    jax.block_until_ready(tokens)

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(args.steps):
                tokens, cache = step(target.params, cache, tokens)
                cache = cache.with_lengths(jnp.full((args.batch,), args.length, jnp.int32))
            jax.block_until_ready(tokens)
        path = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)[0]
        events = json.load(gzip.open(path))["traceEvents"]

    ms = collections.Counter()
    count = collections.Counter()
    executor = 0.0
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if e["name"] == "ThunkExecutor::Execute":
            executor += e["dur"]
        op = (e.get("args") or {}).get("hlo_op")
        if op and (e.get("args") or {}).get("hlo_module") == "jit_step" and op in groups:
            ms[groups[op]] += e["dur"] / 1e3 / args.steps
            count[groups[op]] += 1

    rows = []
    total = sum(ms.values())
    print(f"# {target.cfg.name}; B={args.batch} T={args.width} capacity {args.capacity} at length {args.length}; "
          f"jax {jax.__version__}, {os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.2f}")
    print("| group | ms per step | ops per step | share | weights GB/s |\n|---|---|---|---|---|")
    for group, t in sorted(ms.items(), key=lambda kv: -kv[1]):
        gbps = kind_bytes.get(group, 0) / (t / 1e3) / 1e9 if group in kind_bytes and t > 0 else None
        rows.append({"group": group, "ms": t, "ops": count[group] / args.steps, "share": t / total,
                     "weights_GBps": gbps})
        print(f"| {group} | {t:.2f} | {count[group] / args.steps:.0f} | {t / total:.0%} | "
              f"{'' if gbps is None else f'{gbps:.1f}'} |")
    print(f"sum of the ops {total:.2f} ms per step; the thunk executor {executor / 1e3 / args.steps:.2f} ms")
    summary = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": command_line(__file__, argv),
               "load_avg_at_start": os.getloadavg(), "batch": args.batch, "width": args.width,
               "capacity": args.capacity, "length": args.length, "rows": rows, "ops_ms": total,
               "executor_ms": executor / 1e3 / args.steps}
    if args.json:
        write_json(args.json, summary)
    return summary


if __name__ == "__main__":
    main()
