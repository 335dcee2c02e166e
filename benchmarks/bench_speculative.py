"""Speculative decoding with the training-free drafters against AR, in ONE run on the current machine.

For each subset (MT-Bench first turns, GSM8K test, HumanEval; the first --n prompts of each, chat-templated
with the target's own template) and each batch size (--batches, default 1 and 8):
  * AR greedy (`specdec.generate.generate`) on the same prompts in the same process: the baseline;
  * each drafter (--drafters; default prompt lookup / n-gram, suffix decoding, self-speculation), greedy:
    tau (bonus token counted), draft acceptance rate, decode tok/s, tok/s including prefill, speedup over
    AR (AR decode time per token / speculative decode time per token), and `lossless` = how many prompts'
    greedy output equals AR token for token;
  * transformers' prompt lookup (`generate(prompt_lookup_num_tokens=10, do_sample=False)`, same GGUF,
    float32) at batch 1 as the peer, compared on tok/s including prefill (transformers' generate times the
    whole call).
AR and the drafters are interleaved group by group (each batch of prompts decoded by AR, then by every drafter,
back to back; reversed on odd passes), because this VM's speed drifts by up to ~25% within minutes; with
`--repeats R` the prompts are decoded R times and the speedup is the median of the passes' speedups (all passes
are kept in the JSON as `speedup_by_pass`), printed with its distribution-free 90% interval when R >= 5
(`speedup_interval`, `benchmarks.common.median_interval`): a category whose interval lies above 0.97 does not
lose, one whose interval spans it is not resolved by R passes.
Under each adaptive row (scheduler=adaptive) it prints the cost model's check: the round costs per verify width
that its timed calls imply (`benchmarks.cost_fit.fit_round_costs`, with standard errors) beside the profile they
ran with; `reprofile=true` in a drafter spec re-measures that profile once for the run instead of using the cache.
Every call runs with `warmup=True` (the same compiled programs first run for 2 tokens, untimed), so timings
exclude compilation. The suffix drafter's global corpus is cleared at the start of each pass of each (subset,
batch): within it, it holds the outputs of the earlier prompts (batch 1) / earlier-finished rows (batch 8) of
that pass only.

Loop overhead (--overhead): for the compiled while_loop (n-gram drafter, one prompt repeated B times so
every row runs the same number of rounds), decode time per round against the bare jitted verify step
(`target.forward` on N+1 tokens with the chain mask, donated cache of the same capacity, at the run's mean
cache length). Goal: ratio < 1.05.

    SPECDEC_CACHE=... python -m benchmarks.bench_speculative [--n 8] [--max-new-tokens 128] [--json OUT]
    # drafters as name:key=value,... (k = num_draft_tokens, policy = verification policy)
    python -m benchmarks.bench_speculative --drafters ngram:k=3 suffix:k=8,min_score=0.2 self_spec:k=3,num_layers=26
    # the same drafter with the narrow verify steps of the engine's verify_buckets (A/B in one run)
    python -m benchmarks.bench_speculative --drafters ngram:k=5 ngram:k=5,buckets=auto --batches 1
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.cost_fit import fit_line, fit_round_costs
from benchmarks.common import (DEFAULT_DATA, QUICKSTART_SUBSETS, SUBSETS, DrafterSpec, command_line, groups_of,
                               interval_text, load_prompts, median_interval, run_ar, run_hf_prompt_lookup, run_spec,
                               write_json)
from drafters import create_drafter
from specdec import trees
from specdec.engine import speculative_generate
from specdec.generate import cache_capacity, generate
from specdec.metrics import DecodeMetrics, merge, speedup
from specdec.models import registry
from specdec.models.loading import load_checkpoint
from specdec.target import Target

DEFAULT_DRAFTERS = ("ngram:k=6,max_ngram=3,scheduler=adaptive", "ngram:k=3,max_ngram=3",
                    "suffix:k=8,scheduler=adaptive", "self_spec:k=3,num_layers=26,scheduler=adaptive")


# ----------------------------------------------------------------------------------------------------------
# Loop overhead: compiled while_loop round vs the bare verify step
# ----------------------------------------------------------------------------------------------------------

def make_verify_step(target: Target, n: int):
    """target.forward on [root, n chain nodes], with the engine's chain mask and positions, cache donated."""
    parents = jnp.arange(n, dtype=jnp.int32) - 1

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, cache, tokens):
        b = tokens.shape[0]
        mask, depth = trees.tree_attention(jnp.broadcast_to(parents, (b, n)), jnp.ones((b, n), bool))
        out = target.forward(params, target.cfg, cache, tokens, cache.lengths[:, None] + depth, mask)
        return out.logits, out.cache

    return step


def loop_overhead(target: Target, prompt: list[int], batch: int, spec: DrafterSpec, max_new: int,
                  reps: int = 5) -> dict:
    """Compiled-loop time per round vs the bare verify step, each as the best of `reps` interleaved repeats
    of (one whole generation) / (as many back-to-back verify steps as the generation had rounds)."""
    drafter = create_drafter(spec.name, target, spec.k, **dict(spec.params))
    if not drafter.jittable:
        raise ValueError("the loop-overhead measurement needs a jittable (compiled-loop) drafter")
    policy = spec.policy_for(drafter)
    prompts = [prompt] * batch
    n = drafter.num_draft_tokens
    step = make_verify_step(target, n)
    capacity = cache_capacity([len(prompt)] * batch, max_new, extra=n + 1)
    tokens = jnp.asarray(np.tile(np.asarray(prompt[-(n + 1):], np.int32), (batch, 1)))

    def generation():
        return speculative_generate(target, drafter, prompts, policy=policy, max_new_tokens=max_new)

    out = generation()  # compiles
    rounds = out.metrics.rounds // batch  # identical rows: every row is active in every round
    mid = len(prompt) + out.metrics.new_tokens // batch // 2  # mean cache length over the run
    cache = target.init_cache(batch, capacity).with_lengths(jnp.full((batch,), mid, jnp.int32))
    logits, cache = step(target.params, cache, tokens)  # compile
    jax.block_until_ready(logits)
    loop, bare = [], []
    for _ in range(reps):
        out = generation()
        loop.append(out.metrics.decode_seconds / (out.metrics.rounds // batch))
        t0 = time.perf_counter()
        for _ in range(rounds):
            logits, cache = step(target.params, cache, tokens)
        jax.block_until_ready(logits)
        bare.append((time.perf_counter() - t0) / rounds)
    loop_ms, bare_ms = 1e3 * min(loop), 1e3 * min(bare)
    return {"drafter": spec.label, "batch": batch, "rounds": rounds, "loop_ms_per_round": loop_ms,
            "bare_verify_ms": bare_ms, "ratio": loop_ms / bare_ms,
            "loop_ms_all": [1e3 * x for x in loop], "bare_ms_all": [1e3 * x for x in bare]}


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=registry.DEFAULT_MODEL, help="registry name, .gguf path or HF directory")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the shared data folder")
    ap.add_argument("--subsets", nargs="+", default=list(SUBSETS), choices=SUBSETS + QUICKSTART_SUBSETS,
                    help="the datasets (default), or the quickstart's built-in prompts by kind (quickstart-rewrite)")
    ap.add_argument("--n", type=int, default=8, help="prompts per subset")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--drafters", nargs="+", default=list(DEFAULT_DRAFTERS),
                    help="name:k=N,param=value,...,policy=P (default policy: greedy_chain / greedy_tree)")
    ap.add_argument("--hf-lookup-tokens", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch threads for transformers (0 = torch's default; 1 holds up better on a busy machine)")
    ap.add_argument("--overhead", default="ngram:k=3,max_ngram=3",
                    help="jittable drafter for the loop-overhead measurement ('' to skip)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="passes over the prompts; the speedup is the median of the passes' speedups")
    ap.add_argument("--json", metavar="OUT", help="write a JSON summary here")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")

    t_start = time.time()
    cfg, np_params, tokenizer = load_checkpoint(args.model)
    target = Target.from_params(cfg, np_params, tokenizer, backend="reference")
    specs = [DrafterSpec.parse(d) for d in args.drafters]
    drafters = {s: create_drafter(s.name, target, s.k, **dict(s.params)) for s in specs}
    summary = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "model": args.model,
               "command": command_line(__file__, argv),
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
                           "load_avg_at_start": os.getloadavg()},
               "n": args.n, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "rows": [], "transformers": [],
               "loop_overhead": []}
    print(f"# {cfg.name}; jax {jax.__version__}, {os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.2f}; "
          f"n={args.n} prompts/subset, max_new_tokens={args.max_new_tokens}", flush=True)

    for subset in args.subsets:
        prompts = [tokenizer.encode_chat(text) for text in load_prompts(subset, args.n, args.data)]
        mean_len = float(np.mean([len(p) for p in prompts]))
        ar_b1 = None
        for batch in args.batches:
            groups = groups_of(prompts, batch)
            passes = interleaved_passes(target, specs, drafters, groups, args.max_new_tokens, args.repeats)
            ar_tokens, ar = merged(passes, "AR")
            if batch == 1:
                ar_b1 = ar_tokens
            base = {"subset": subset, "batch": batch, "prompts": len(prompts), "mean_prompt_tokens": mean_len}
            rows = [{**base, "method": "AR", **_row(ar, ar, ar_tokens, ar_tokens)}]
            print(_line(rows[-1]), flush=True)
            for spec in specs:
                tokens, m = merged(passes, spec)
                by_pass = [speedup(p["AR"][1], p[spec][1]) for p in passes]
                fit = fit_round_costs([call for p in passes for call in p[spec][2]])  # None unless adaptive
                rows.append({**base, "method": spec.label, "policy": spec.policy_for(drafters[spec]),
                             **_row(m, ar, tokens, ar_tokens), "speedup": float(np.median(by_pass)),
                             "speedup_interval": median_interval(by_pass), "speedup_by_pass": by_pass,
                             "cost_fit": fit})
                print(_line(rows[-1]), flush=True)
                if fit:
                    print("          " + fit_line(fit), flush=True)
            summary["rows"].extend(rows)
        if not args.skip_transformers:
            gguf = registry.resolve(args.model)
            if gguf.suffix != ".gguf":
                print("transformers' prompt lookup needs a .gguf model: skipped")
            else:
                if ar_b1 is None:
                    ar_b1 = [generate(target, [p], max_new_tokens=args.max_new_tokens).tokens[0] for p in prompts]
                hf_tokens, r = run_hf_prompt_lookup(str(gguf), prompts, args.max_new_tokens,
                                                    tuple(cfg.eos_token_ids), args.hf_lookup_tokens,
                                                    args.torch_threads)
                ar1 = [row for row in summary["rows"] if row["subset"] == subset and row["batch"] == 1]
                r.update(subset=subset, method=f"transformers prompt lookup ({args.hf_lookup_tokens})",
                         batch=1, lossless=_same(hf_tokens, ar_b1))
                r["beats"] = {row["method"]: row["tok_s_e2e"] > r["tok_s"] for row in ar1}
                summary["transformers"].append(r)
                print(f"{subset:9s} B=1 transformers prompt lookup: {r['tok_s']:.1f} tok/s (incl. prefill), "
                      f"same as AR {r['lossless']}", flush=True)

    if args.overhead:
        spec = DrafterSpec.parse(args.overhead)
        prompt = tokenizer.encode_chat(load_prompts("mt_bench", 1, args.data)[0])
        for batch in args.batches:
            r = loop_overhead(target, prompt, batch, spec, args.max_new_tokens)
            summary["loop_overhead"].append(r)
            print(f"loop overhead {r['drafter']} B={batch}: {r['loop_ms_per_round']:.2f} ms/round vs bare verify "
                  f"{r['bare_verify_ms']:.2f} ms -> ratio {r['ratio']:.3f}", flush=True)

    summary["wall_seconds"] = time.time() - t_start
    summary["load_avg_at_end"] = os.getloadavg()
    print_tables(summary)
    write_json(args.json, summary)
    return summary


def interleaved_passes(target: Target, specs, drafters, groups, max_new: int, repeats: int) -> list[dict]:
    """`repeats` passes; in each, every group of prompts is decoded by AR and then by each drafter, back to back
    (odd passes in the reverse order). This VM's speed drifts by up to ~25% within minutes, so AR and the
    drafter are timed seconds apart on the same prompts, never one whole subset after the other.
    Returns, per pass, method ("AR" or a DrafterSpec) -> (tokens, merged metrics, each call's metrics). The suffix
    drafter's global corpus is cleared at the start of each pass (a later pass must not find this pass's answers
    in it)."""
    methods = ["AR", *specs]
    passes = []
    for r in range(repeats):
        got = {m: ([], []) for m in methods}
        for g, group in enumerate(groups):
            for m in (methods if r % 2 == 0 else methods[::-1]):
                if m == "AR":
                    tokens, metrics = run_ar(target, [group], max_new)
                else:
                    tokens, metrics = run_spec(target, drafters[m], m.policy_for(drafters[m]), [group], max_new,
                                               m.buckets, m.make_scheduler(), clear=g == 0)
                got[m][0].extend(tokens)
                got[m][1].append(metrics)
        passes.append({m: (tokens, merge(ms), ms) for m, (tokens, ms) in got.items()})
    return passes


def merged(passes: list[dict], method) -> tuple[list[list[int]], DecodeMetrics]:
    """The first pass's tokens (what `lossless` compares with AR) and the metrics summed over passes."""
    return passes[0][method][0], merge([p[method][1] for p in passes])


def _same(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def _row(m, ar, tokens, ar_tokens) -> dict:
    e2e = m.new_tokens / (m.decode_seconds + m.prefill_seconds)
    return {"tau": m.tau, "acceptance_rate": m.acceptance_rate, "tok_s": m.tokens_per_second, "tok_s_e2e": e2e,
            "speedup": speedup(ar, m), "lossless": _same(tokens, ar_tokens), "new_tokens": m.new_tokens,
            "decode_s": m.decode_seconds, "prefill_s": m.prefill_seconds, "draft_s": m.draft_seconds,
            "verify_s": m.verify_seconds, "acceptance_survival": m.acceptance_by_position()["survival"],
            "predicted_tok_s": m.predicted_tokens_per_second if m.predicted_seconds else None,
            "width_rounds": m.width_rounds or None, "expected_accepted": m.expected_accepted,
            "realised_accepted": m.realised_accepted}


def _line(r: dict) -> str:
    speedup = f"x{r['speedup']:.2f}{interval_text(r.get('speedup_interval'))}"
    return (f"{r['subset']:9s} B={r['batch']} {r['method']:38s} tau {r['tau']:.2f}  {r['tok_s']:6.1f} tok/s "
            f"({r['tok_s_e2e']:.1f} incl. prefill)  {speedup}  same as AR {r['lossless']}"
            + (f"  predicted {r['predicted_tok_s']:.1f} tok/s, rounds by width {r['width_rounds']}, accepted "
               f"drafts expected / realised {r['expected_accepted']:.0f} / {r['realised_accepted']:.0f}"
               if r.get("predicted_tok_s") else ""))


def print_tables(s: dict) -> None:
    print()
    print(f"n={s['n']} prompts per subset, max_new_tokens={s['max_new_tokens']}, greedy; {s['date']}")
    print()
    print("| subset | B | method | tau | accept rate | tok/s | tok/s incl. prefill | speedup vs AR | "
          "predicted tok/s | = AR (greedy) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in s["rows"]:
        rate = "-" if r["method"] == "AR" else f"{r['acceptance_rate']:.2f}"
        tau = "1.00" if r["method"] == "AR" else f"{r['tau']:.2f}"
        predicted = f"{r['predicted_tok_s']:.1f}" if r.get("predicted_tok_s") else "-"
        speedup = f"{r['speedup']:.2f}x{interval_text(r.get('speedup_interval'))}"
        print(f"| {r['subset']} | {r['batch']} | {r['method']} | {tau} | {rate} | {r['tok_s']:.1f} | "
              f"{r['tok_s_e2e']:.1f} | {speedup} | {predicted} | {r['lossless']} |")
    for r in s["transformers"]:
        print(f"| {r['subset']} | 1 | {r['method']} | - | - | - | {r['tok_s']:.1f} | - | {r['lossless']} |")
    if s["transformers"]:
        print()
        print("| subset | transformers prompt lookup tok/s | ours, tok/s incl. prefill (beats it?) |")
        print("|---|---|---|")
        for r in s["transformers"]:
            ours = [row for row in s["rows"] if row["subset"] == r["subset"] and row["batch"] == 1
                    and row["method"] != "AR"]
            cells = ", ".join(f"{row['method']} {row['tok_s_e2e']:.1f} ({'yes' if r['beats'][row['method']] else 'no'})"
                              for row in ours)
            print(f"| {r['subset']} | {r['tok_s']:.1f} | {cells} |")
    if s["loop_overhead"]:
        print()
        print("| compiled loop | B | rounds | ms/round (loop) | bare verify step ms | ratio (goal < 1.05) |")
        print("|---|---|---|---|---|---|")
        for r in s["loop_overhead"]:
            print(f"| {r['drafter']} | {r['batch']} | {r['rounds']} | {r['loop_ms_per_round']:.2f} | "
                  f"{r['bare_verify_ms']:.2f} | {r['ratio']:.3f} |")


if __name__ == "__main__":
    main()
