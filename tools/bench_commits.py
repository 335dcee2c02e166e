"""The same decode and speculative measurements on several git commits, interleaved in one sitting.

For changes that must not slow anything down (a refactor): each commit is checked out into its own worktree
(under --trees, kept for reuse) and a probe process imports that commit's specdec (PYTHONPATH = the worktree)
and times, after a warm-up call each:
  * the bare target step (`target.forward`, donated cache): one token per row at batch 1 and 8, and 2 / 4 / 8
    tokens per row at batch 1 (4 at batch 8), the cost of a verify round against a decode step;
  * greedy AR (`specdec.generate.generate`) on 4 chat prompts at batch 1 and as one batch of 8;
  * greedy speculative decoding with the n-gram drafter at a fixed width (`speculative_generate`, no adaptive
    width, so no cost profile enters) on the same prompts and batches; its tokens must equal AR's;
  * the same with the adaptive width on given round costs (no profile: its choices are a function of the text,
    so every commit runs the same rounds), the loop a scheduler change could slow down;
  * a fingerprint of the compiled target step's HLO instructions (batch 1 and 8 at one token, batch 1 at four;
    source locations and other metadata dropped): equal fingerprints mean XLA compiled the same program, so
    any timing difference between those commits is the machine's noise.
The probe uses only long-standing APIs (`Target.forward`, `generate`, `speculative_generate`, the n-gram drafter),
so older commits run it too. Commits run in turn, the order reversed on every other pass (a machine whose speed
drifts then penalises no commit), and each figure is the median over passes; the table gives each commit's figures
as a ratio to the first commit's.

    python -m tools.bench_commits 204fbef 5e408db c3cbad3 HEAD --passes 2 [--json OUT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ("Write a short story about a robot who learns to paint.",
           "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
           "Rewrite this sentence in the passive voice: The committee approved the new budget on Monday, "
           "and the mayor signed it on Tuesday.",
           "Summarise in two sentences: The library will close for renovation from June to August. During that "
           "time, books can be borrowed from the branch on Elm Street, and returns are accepted at both sites.")


# ----------------------------------------------------------------------------------------------------------
# The probe: runs inside one commit's tree
# ----------------------------------------------------------------------------------------------------------

def _timed(fn, repeats: int, warm_up: bool = True) -> float:
    """benchmarks.common.median_seconds, repeated here: the probe runs against another commit's tree, whose
    benchmarks/ may not have it (and whose specdec may lack what common.py imports). `warm_up=False` when the
    caller already ran `fn` once (compilation done)."""
    import jax
    import numpy as np

    if warm_up:
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def hlo_fingerprint(target) -> str:
    """sha256 of the compiled target step's instructions (metadata, stack frames and attributes dropped)."""
    import re

    import jax
    import jax.numpy as jnp

    digest = hashlib.sha256()
    for batch, width in ((1, 1), (8, 1), (1, 4)):
        cache = target.init_cache(batch, 512).with_lengths(jnp.full((batch,), 128, jnp.int32))
        step = jax.jit(lambda params, c, x: target.forward(params, target.cfg, c, x))
        text = step.lower(target.params, cache, jnp.zeros((batch, width), jnp.int32)).compile().as_text()
        for line in text.splitlines():
            if " = " in line or line.startswith(("ENTRY", "}")):
                line = re.sub(r", metadata=\{[^}]*\}", "", line)
                digest.update(re.sub(r", (stack_frame_id|frontend_attributes)=[^,}]*", "", line).encode())
    return digest.hexdigest()[:16]


def given_cost_adaptive_width():
    """The adaptive width on fixed round costs for a 3-token chain (verify widths 0 / 1 / 3, the ratios of a
    2-core CPU), in the settings spelling of the commit it runs in."""
    from specdec.adaptive import AdaptiveWidth

    round_costs, draft_cost = (0.025, 0.030, 0.0303), 1e-6
    try:
        return AdaptiveWidth(round_costs=round_costs, draft_cost=draft_cost)
    except TypeError:  # before the Scheduler protocol: one `costs` pair
        return AdaptiveWidth(costs=(round_costs, draft_cost))


# (batch, tokens per row) of the bare steps timed: decode at batch 1 and 8, and verify widths at batch 1
STEP_SHAPES = ((1, 1), (1, 2), (1, 4), (1, 8), (8, 1), (8, 4))


def probe(new_tokens: int, steps: int) -> dict:
    import jax
    import jax.numpy as jnp

    import specdec
    from drafters import create_drafter
    from specdec.engine import speculative_generate
    from specdec.generate import generate
    from specdec.models.loading import load_checkpoint
    from specdec.target import Target

    cfg, np_params, tokenizer = load_checkpoint("smollm2-135m-instruct")
    target = Target.from_params(cfg, np_params, tokenizer, backend="reference")
    prompts = [tokenizer.encode_chat(text) for text in PROMPTS]
    out = {"specdec": str(Path(specdec.__file__).resolve().parents[1]), "load_avg": os.getloadavg()[0],
           "step_hlo": hlo_fingerprint(target)}

    start = 128
    for batch, width in STEP_SHAPES:  # the bare step, T tokens per row (fed its own argmax), cache 512 filled to ~128
        def step(params, cache, tokens):
            out_ = target.forward(params, target.cfg, cache, tokens)
            cache = out_.cache.advance(1)
            cache = cache.with_lengths(jnp.where(cache.lengths >= start + 64, start, cache.lengths))
            best = jnp.argmax(out_.logits[:, -1], axis=-1).astype(jnp.int32)
            return jnp.broadcast_to(best[:, None], tokens.shape), cache

        step = jax.jit(step, donate_argnums=(1,))
        state = {"cache": target.init_cache(batch, 512).with_lengths(jnp.full((batch,), start, jnp.int32)),
                 "tokens": jnp.zeros((batch, width), jnp.int32)}

        def one():
            state["tokens"], state["cache"] = step(target.params, state["cache"], state["tokens"])
            return state["tokens"]

        out[f"step_ms_b{batch}_t{width}"] = 1e3 * _timed(one, steps)

    drafter = create_drafter("ngram", target, 3, max_ngram=3)
    adaptive = given_cost_adaptive_width()
    for batch, groups in ((1, [[p] for p in prompts]), (8, [prompts + prompts])):
        def ar():
            return [generate(target, g, max_new_tokens=new_tokens).tokens for g in groups]

        def spec():
            return [speculative_generate(target, drafter, g, max_new_tokens=new_tokens).tokens for g in groups]

        def spec_adaptive():
            return [speculative_generate(target, drafter, g, max_new_tokens=new_tokens, scheduler=adaptive).tokens
                    for g in groups]

        ar_tokens, spec_tokens, adaptive_tokens = ar(), spec(), spec_adaptive()  # warm-up; the tokens compared
        tokens = sum(len(row) for rows in ar_tokens for row in rows)
        out[f"ar_tok_s_b{batch}"] = tokens / _timed(ar, 2, warm_up=False)
        out[f"ngram_tok_s_b{batch}"] = tokens / _timed(spec, 2, warm_up=False)
        out[f"adaptive_tok_s_b{batch}"] = tokens / _timed(spec_adaptive, 2, warm_up=False)
        same = [[list(r) for r in g] for g in ar_tokens]
        out[f"ngram_same_as_ar_b{batch}"] = same == [[list(r) for r in g] for g in spec_tokens]
        out[f"adaptive_same_as_ar_b{batch}"] = same == [[list(r) for r in g] for g in adaptive_tokens]
    return out


# ----------------------------------------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------------------------------------

def worktree(commit: str, root: Path) -> tuple[str, Path]:
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout.strip()
    tree = root / sha[:12]
    if not (tree / "specdec").is_dir():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", "--force", str(tree), sha], cwd=REPO, check=True,
                       capture_output=True, text=True)
    return sha, tree


def run_probe(tree: Path, new_tokens: int, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", "--new-tokens", str(new_tokens),
           "--steps", str(steps)]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the probe failed in {tree} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1])
    if Path(result["specdec"]) != tree.resolve():
        raise RuntimeError(f"the probe in {tree} imported specdec from {result['specdec']}: another install "
                           "shadows PYTHONPATH")
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("commits", nargs="*", help="git commits (the first is the baseline)")
    ap.add_argument("--passes", type=int, default=2, help="passes over the commits (order reversed on odd ones)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100, help="timed bare steps per batch size (median)")
    ap.add_argument("--trees", type=Path, default=Path("/tmp/specdec_commits"), help="where the worktrees go")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # inside one commit's tree
    args = ap.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.new_tokens, args.steps)), flush=True)
        return
    if len(args.commits) < 2:
        ap.error("give at least two commits")
    if args.passes < 1:
        ap.error(f"--passes must be >= 1, got {args.passes}")

    trees = [worktree(c, args.trees) for c in args.commits]
    print(f"# load avg {os.getloadavg()[0]:.2f} at start; commits {', '.join(s[:8] for s, _ in trees)}", flush=True)
    results: dict[str, list[dict]] = {sha: [] for sha, _ in trees}
    for p in range(args.passes):
        for sha, tree in (trees if p % 2 == 0 else trees[::-1]):
            r = run_probe(tree, args.new_tokens, args.steps)
            results[sha].append(r)
            print(f"pass {p} {sha[:8]}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()
                                                     if isinstance(v, float)), flush=True)

    import numpy as np
    keys = [k for k, v in results[trees[0][0]][0].items() if isinstance(v, float) and k != "load_avg"]
    median = {sha: {k: float(np.median([r[k] for r in rs])) for k in keys} for sha, rs in results.items()}
    base = median[trees[0][0]]
    print("\n| commit | " + " | ".join(keys) + " | n-gram == AR | step HLO |")
    print("|---" * (len(keys) + 3) + "|")
    for sha, _ in trees:
        same = all(r[k] for r in results[sha] for k in r if k.startswith("ngram_same"))
        cells = [f"{median[sha][k]:.1f}" + ("" if sha == trees[0][0] else f" ({median[sha][k] / base[k]:.2f}x)")
                 for k in keys]
        hlo = results[sha][0]["step_hlo"]
        hlo = hlo if sha == trees[0][0] else ("same" if hlo == results[trees[0][0]][0]["step_hlo"] else hlo)
        print(f"| {sha[:8]} | " + " | ".join(cells) + f" | {same} | {hlo} |")
    print(f"# load avg {os.getloadavg()[0]:.2f} at end")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": "python -m tools.bench_commits " + " ".join(
            argv if argv is not None else sys.argv[1:]), "commits": [s for s, _ in trees], "passes": results,
            "median": median}, indent=1))


if __name__ == "__main__":
    main()
