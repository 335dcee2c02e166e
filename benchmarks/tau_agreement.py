"""Teacher-forced tau against engine tau on the same contexts: does training's held-out figure predict decoding?

    python -m benchmarks.tau_agreement <drafter dir> <distill data dir> [--prompts 32] [--new-tokens 128] \
        [--k K] [--temperatures 0 1] [--batch 8] [--json OUT]

`<drafter dir>` is a training run directory (config.yaml + drafter.json + params.npz or checkpoints/; an unfinished
run is read at its newest checkpoint, or `--step S`) or a drafter directory (drafter.json + params.npz, e.g.
drafters/trained/dspark_smollm2_mix). The kind comes from drafter.json, as `create_drafter(None, ..., path=)` reads it.
The target is the run's `model.name` (`--model`, default SmolLM2-135M-Instruct, for a drafter directory).

What it measures, on the held-out prompts of the data (`DistillData.split_indices(eval_examples)`, the split the
training run used: eval_examples from the run's config.yaml; a drafter directory without a config takes
`--eval-examples`, default 64 as the session-18 comparison runs, and then the split is only "not trained on" if the
drafter never saw that data):

1. **held-out data TF**: the training loop's own evaluation (`Run.evaluate`: `eval_step` with online target
   features, the drafter's `TrainTask`, k draft steps) on the held-out examples as stored (answers the target
   sampled at the data's temperature, 0.7 / top-p 0.95 for the SmolLM2 sets), truncated to the run's seq_len as in
   training: the run's own figure (all held-out examples) and the same on the first N only.
2. **engine tau**: `speculative_generate` on the first N held-out prompts, chain policy (greedy_chain at T=0,
   rejection_chain at T=1, top-p 1), fixed width k, every draft verified: tokens committed per verify round,
   bonus included.
3. **engine-output TF**: the same `Run.evaluate` on distill-style examples built from those prompts and the
   engine's own output (loss_mask 1 on the output, the prefill token and EOS included): the same contexts as the
   engine. Expected tau (temperature 1) is the figure for T=1, greedy tau (argmax agreement) the one for T=0.
4. **TF at the engine's anchors**: the same per-slot acceptance (`task.evaluate` + `expected_tau_sums`), but summed
   only over the positions where the engine actually started a round (and whose k labels are all inside the
   output, like every TF slot). At T=0 this must equal the engine's committed length of those rounds token for
   token (greedy drafting and greedy verification are both argmax), so it is also a check that training and
   engine run the same drafter.

Why TF and engine tau differ on the same text (the columns above separate these):

- **Which positions are counted.** Teacher forcing averages over every position of the response; the engine
  roots a round only where the previous round stopped: after a rejection (the target's correction is the root) or
  after a full accept. An easy stretch the drafter would predict from every position is one engine round, but
  many TF slots, each with a long accepted run: TF weights positions, the engine weights rounds, and easy
  positions are skipped over (an inspection-paradox bias upwards for TF). Positions just after a rejection are
  also where the drafter was just wrong. "TF at engine anchors" minus "engine-output TF" is this part.
- **The last round is cut.** Each row's last round stops at max_new_tokens or EOS and commits fewer tokens than
  it accepted; the engine counts it, TF counts no slot whose k labels run past the end. "engine tau without the
  last round" removes it.
- **The first token.** TF also scores the slot at the last prompt token (drafting the prefill token onward); the
  engine samples that token from the prefill and drafts from it.
- **T=1: expected against realised.** TF's alpha = sum_v min(p_d, p_t) is an expectation; the engine's accepted
  length is one draw, and TF conditions each step on the realised continuation (teacher forcing) while the engine's
  later draft steps condition on its own draws. With ~10^3 rounds the sampling noise is ~0.02-0.03.
- **Distribution.** The held-out data was sampled at 0.7 / top-p 0.95; the engine writes greedy (T=0: more
  predictable) or T=1 (less) text. That is the held-out-data column against the engine-output column.
- **Truncation.** The held-out data examples are cut at the run's seq_len, as in training; engine outputs never.

Everything the metric needs comes from the training code: `make_task` with the drafter's drafter.json config,
params and buffers loaded as `train.init_from` loads them (`loop.initial_weights`, in the fresh init's dtypes),
`StepSpec(stored=None)` for online features, `eval_step` / `Run.evaluate`, `slot_valid`, `expected_tau_sums`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import tempfile
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml

DEFAULT_EVAL_EXAMPLES = 64  # train.eval_examples of the session-18 comparison runs (configs/train/compare)
WIDTH_STEP = 64  # engine-output examples are padded to a multiple of this (padding does not change the sums)


# ---------------------------------------------------------------------------------------------------------
# Inputs: the drafter (frozen at one step), its run config, the held-out split
# ---------------------------------------------------------------------------------------------------------

def run_config(drafter_dir: Path) -> dict | None:
    """The training run's config.yaml (plain YAML: only train.* and drafter.* are read), None for a drafter
    directory without one."""
    path = drafter_dir / "config.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def check_drafter_dir(drafter_dir: Path) -> None:
    from specdec.train import checkpoint as ckpt

    if not drafter_dir.exists():
        raise SystemExit(f"drafter directory {drafter_dir} does not exist")
    if not (drafter_dir / ckpt.DRAFTER_FILE).is_file():
        raise SystemExit(f"{drafter_dir} has no {ckpt.DRAFTER_FILE}: pass a training run directory or a drafter "
                         "directory (drafter.json + params.npz)")


def frozen_drafter(drafter_dir: Path, step: int | None, tmp: Path) -> tuple[Path, str]:
    """(a copy of the drafter that no training job moves while we read it, where its weights came from): the
    final weights of a finished run or drafter directory, else the newest checkpoint (or `step`), so the engine
    and the teacher-forced evaluation load the very same weights."""
    from benchmarks.snapshot_drafter import snapshot
    from specdec.train import checkpoint as ckpt

    check_drafter_dir(drafter_dir)
    try:
        info = snapshot(drafter_dir, tmp / "drafter", step)
    except ckpt.CheckpointError as e:
        raise SystemExit(f"{drafter_dir}: {e}") from None
    return tmp / "drafter", info["source"]


def heldout_split(data, cfg: dict | None, data_dir: Path, eval_examples: int | None) -> tuple[np.ndarray, int]:
    """(held-out example indices, eval_examples): the run's own split when it has a config."""
    n_eval = eval_examples
    if cfg is not None:
        train_cfg = cfg.get("train") or {}
        run_eval = int(train_cfg.get("eval_examples") or 0)
        if eval_examples is not None and eval_examples != run_eval:
            raise SystemExit(f"--eval-examples {eval_examples}: the run held out train.eval_examples={run_eval}; "
                             "leave the flag out to use the run's split")
        n_eval = run_eval
        run_data = train_cfg.get("data_dir")
        if run_data and Path(run_data).resolve() != data_dir.resolve():
            raise SystemExit(f"the run trained on {run_data}, not {data_dir}: its held-out split is only held out "
                             "in its own data")
    if n_eval is None:
        n_eval = DEFAULT_EVAL_EXAMPLES
    if n_eval <= 0:
        raise SystemExit(f"no held-out examples: eval_examples={n_eval} (the run evaluated on nothing)")
    _, eval_idx = data.split_indices(n_eval)  # raises DataError when it would leave no training data
    return eval_idx, n_eval


# ---------------------------------------------------------------------------------------------------------
# The training loop's evaluation
# ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Evaluator:
    """What `loop.Run.evaluate` needs, built once: the StepSpec (online features), params and consts."""

    spec: object
    params: object
    consts: dict
    target: object
    batch_size: int

    def evaluate(self, arrays: dict, rows: np.ndarray) -> dict:
        """The loop's held-out evaluation (`Run.evaluate`) over `rows` of the padded arrays, all at one width."""
        from specdec.train import loop

        width = arrays["tokens"].shape[1]
        batches = loop.Batches(arrays, (width,), None, None)
        examples = loop.Examples(arrays, np.arange(0), np.asarray(rows), None)
        # Run's other parts (checkpoint store, data order) are not used by evaluate; metrics go nowhere
        run = loop.Run(self.spec.task, self.target, types.SimpleNamespace(batch_size=self.batch_size), self.spec,
                       self.consts, examples, batches, None, None, loop.MetricsLog(Path(os.devnull), None), print)
        result = run.evaluate(types.SimpleNamespace(params=self.params), 0)
        run.metrics.close()
        return result

    def at_anchors(self, arrays: dict, anchors: np.ndarray) -> dict:
        """The same sums, over the slots `anchors` [N, T] marks only (and that `slot_valid` accepts)."""
        from specdec.train import loop

        width = arrays["tokens"].shape[1]
        batches = loop.Batches(arrays, (width,), None, None)
        sums: dict = {}
        n, b = len(anchors), self.batch_size
        for start in range(0, n, b):
            rows = np.arange(start, min(start + b, n))
            rows = np.concatenate([rows, np.repeat(rows[-1:], b - len(rows))])  # as Batches.heldout fills
            real = min(b, n - start)
            batch = batches(rows, real)
            mark = anchors[rows].copy()
            mark[real:] = False
            out = jax.device_get(_anchor_sums(self.spec, self.params, self.consts, self.target.params, batch,
                                              jnp.asarray(mark)))
            for key, v in out.items():
                sums[key] = sums.get(key, 0) + np.asarray(v, np.float64)
        slots = max(float(sums["slots"]), 1.0)
        return {"expected_tau": float(sums["tau"]) / slots, "greedy_tau": float(sums["greedy_tau"]) / slots,
                "acceptance_by_step": [round(float(a) / slots, 4) for a in sums["alpha"]],
                "slots": int(sums["slots"])}


def pooled(a: dict, b: dict | None) -> dict:
    """Two `Run.evaluate` results over disjoint examples as one (slot-weighted means: the loop's own average
    over all of them, without evaluating the first part twice); the loss, a mean over batches, is left out."""
    if b is None:
        return a
    slots = a["slots"] + b["slots"]
    mean = lambda x, y: (x * a["slots"] + y * b["slots"]) / slots
    return {"expected_tau": mean(a["expected_tau"], b["expected_tau"]),
            "greedy_tau": mean(a["greedy_tau"], b["greedy_tau"]),
            "acceptance_by_step": [round(mean(x, y), 4) for x, y in zip(a["acceptance_by_step"],
                                                                        b["acceptance_by_step"])],
            "slots": slots, "draft_len": a["draft_len"]}


@functools.partial(jax.jit, static_argnames=("spec",))
def _anchor_sums(spec, params, consts, tparams, batch, anchors):
    """`eval_step` with the valid slots narrowed to `anchors` (the engine's round roots)."""
    from specdec.train import loop
    from specdec.train.tasks import expected_tau_sums, slot_valid

    feats = loop._features(spec, tparams, batch, True)
    _, ev = spec.task.evaluate(params, consts, batch, feats, spec.eval_steps)
    return expected_tau_sums(ev, slot_valid(batch, spec.eval_steps) & anchors)


def make_evaluator(drafter_path: Path, target, k: int | None, batch_size: int) -> tuple[Evaluator, dict, int]:
    """The drafter's TrainTask (from its drafter.json config) with its weights loaded as `train.init_from`
    loads them (`loop.initial_weights`: checked against a fresh init, in its dtypes); and k (None: the
    drafter's whole block)."""
    import drafters
    from specdec.train import checkpoint as ckpt
    from specdec.train import loop
    from specdec.train.tasks import make_task

    drafters.available()  # drafter modules register their training tasks on import
    info = ckpt.load_drafter(drafter_path)
    task = make_task(info["drafter"], target, info["config"])
    if k is None:
        k = task.max_eval_steps
        if k is None:
            raise SystemExit(f"this {info['drafter']} drafter has no fixed block: pass --k")
    if task.max_eval_steps is not None and k > task.max_eval_steps:
        raise SystemExit(f"--k {k}: this {info['drafter']} drafter scores at most {task.max_eval_steps} draft steps "
                         "(its block)")
    fresh = task.init(jax.random.PRNGKey(0), np.zeros(target.cfg.vocab_size, np.int64))
    params, buffers = loop.initial_weights(str(drafter_path), task, target, *fresh)
    consts = {**task.frozen(target), **buffers}  # as train() builds them
    # Hyper only shapes train_step; eval_step never reads it (it is part of the static key only)
    spec = loop.StepSpec(task=task, hyper=loop.Hyper(1, 0.0, 0, 0.0, 0.0), cfg=target.cfg, forward=target.forward,
                         stored=None, eval_steps=k)
    return Evaluator(spec, params, consts, target, batch_size), info, k


# ---------------------------------------------------------------------------------------------------------
# The engine, and its output as distill-style examples
# ---------------------------------------------------------------------------------------------------------

def run_engine(target, drafter, prompts: list[list[int]], temperature: float, new_tokens: int, batch: int):
    """speculative_generate in batches: (merged metrics, per-row new tokens, per-row committed per round)."""
    from specdec.engine import speculative_generate
    from specdec.metrics import merge
    from specdec.sampling import GREEDY, SamplingParams

    if temperature == 0:
        policy, sampling = "greedy_chain", GREEDY
    else:
        policy, sampling = "rejection_chain", SamplingParams(temperature=temperature, top_p=1.0)
    metrics, tokens, commits = [], [], []
    for start in range(0, len(prompts), batch):
        out = speculative_generate(target, drafter, prompts[start:start + batch], policy=policy,
                                   max_new_tokens=new_tokens, sampling=sampling, seed=start)
        metrics.append(out.metrics)
        tokens += out.tokens
        commits += out.accept_lengths
    return merge(metrics), tokens, commits


def engine_examples(prompts, outputs, commits, eos_ids, pad_id: int, min_width: int, k: int):
    """Distill-style arrays of prompt + engine output (loss_mask 1 on the output); the engine's anchors: True at
    each round's root (the last committed token when the round began: the prefill token, then every position the
    previous round stopped at); and the committed lengths of the rounds whose root TF scores."""
    from specdec.train.data import DistillData

    ids, masks, anchor_pos, scored = [], [], [], []
    for p, out, c in zip(prompts, outputs, commits):
        if sum(c) != len(out) - 1:  # each round commits accepted + 1; the prefill token is not a round
            raise RuntimeError(f"engine bookkeeping: rounds commit {sum(c)} tokens, the row has {len(out)} - 1")
        ids.append(np.asarray(p + out, np.int32))
        masks.append(np.asarray([0] * len(p) + [1] * len(out), np.int8))
        roots = len(p) + np.concatenate([[0], np.cumsum(c[:-1])]).astype(int) if c else np.zeros(0, int)
        anchor_pos.append(roots)
        # the rounds TF scores: all k labels x_{j+1..j+k} of root j inside the example (`slot_valid`)
        scored += [n for n, j in zip(c, roots) if j + k < len(p) + len(out)]
    longest = max(len(x) for x in ids)
    width = max(min_width, -(-longest // WIDTH_STEP) * WIDTH_STEP)
    data = DistillData([str(i) for i in range(len(ids))], ids, masks, [len(p) for p in prompts],
                       [bool(out and out[-1] in eos_ids) for out in outputs], manifest={})
    arrays = data.padded(width, pad_id)
    anchors = np.zeros(arrays["tokens"].shape, bool)
    for i, pos in enumerate(anchor_pos):
        anchors[i, pos] = True
    return arrays, anchors, scored


def engine_summary(m, commits, scored) -> dict:
    """Engine tau, and tau without each row's last round (the one max_new_tokens or EOS cuts short)."""
    body = [x for c in commits for x in c[:-1]]
    by_pos = m.acceptance_by_position()
    return {"tau": m.tau, "rounds": m.rounds, "new_tokens": m.new_tokens,
            "tau_without_last_round": sum(body) / len(body) if body else float("nan"),
            # the same rounds as "TF at engine anchors" (roots with k labels inside the output): at T=0 the two
            # agree exactly when engine and training run the same drafter
            "tau_on_tf_scored_rounds": sum(scored) / len(scored) if scored else float("nan"),
            "tf_scored_rounds": len(scored),
            "conditional_acceptance": [round(x, 4) for x in by_pos["conditional"]],
            "decode_seconds": round(m.decode_seconds, 1)}


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------

def no_nan(x):
    """JSON without NaN (a position the engine never reached has no conditional acceptance): null instead."""
    if isinstance(x, dict):
        return {k: no_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [no_nan(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


def _f(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def table(result: dict) -> str:
    held = result["heldout_data"]
    lines = [f"drafter {result['drafter']} ({result['kind']}, {result['weights']}), k={result['k']}, "
             f"{result['prompts']} held-out prompts x {result['new_tokens']} new tokens "
             f"(held out: {result['eval_examples']} of {result['data_dir']})",
             "",
             "| T | TF metric | held-out data TF, all held-out (run's figure) | held-out data TF, these prompts "
             "| engine-output TF | TF at engine anchors | engine tau, same rounds | engine tau w/o last round "
             "| engine tau | ratio engine / engine-output TF | ratio engine / held-out TF (all) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for t, r in result["temperatures"].items():
        metric = "greedy_tau" if float(t) == 0 else "expected_tau"
        eng = r["engine"]["tau"]
        lines.append(
            f"| {t} | {metric.replace('_', ' ')} | {_f(held['all'][metric])} | {_f(held['these_prompts'][metric])} "
            f"| {_f(r['tf_engine_output'][metric])} | {_f(r['tf_at_engine_anchors'][metric])} "
            f"| {_f(r['engine']['tau_on_tf_scored_rounds'])} | {_f(r['engine']['tau_without_last_round'])} "
            f"| {_f(eng)} | {_f(eng / r['tf_engine_output'][metric])} "
            f"| {_f(eng / held['all'][metric])} |")
    return "\n".join(lines)


T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.0f} s] {msg}", flush=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafter_dir", type=Path, help="training run directory or drafter directory")
    ap.add_argument("data_dir", type=Path, help="distillation data directory (specdec data)")
    ap.add_argument("--prompts", type=int, default=32, help="held-out prompts to decode (the first N of the split)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, help="draft length (default: the run's drafter.num_draft_tokens, else the "
                                          "drafter's block)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], choices=[0.0, 1.0],
                    help="0: greedy_chain vs greedy TF tau; 1: rejection_chain vs expected TF tau")
    ap.add_argument("--batch", type=int, default=8, help="engine and evaluation batch size")
    ap.add_argument("--step", type=int, help="checkpoint step of a training run (default: params.npz, else newest)")
    ap.add_argument("--eval-examples", type=int,
                    help=f"held-out examples of a drafter directory without config.yaml (default "
                         f"{DEFAULT_EVAL_EXAMPLES}); a run's own is always used")
    ap.add_argument("--seq-len", type=int, help="truncation of the held-out data examples (default: the run's "
                                                "train.seq_len, else the longest held-out example)")
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="the target of a drafter directory without config.yaml (a run's own model.name is used)")
    ap.add_argument("--json", metavar="OUT", type=Path)
    args = ap.parse_args(argv)
    if min(args.prompts, args.new_tokens, args.batch, 1 if args.k is None else args.k) < 1:
        raise SystemExit("--prompts, --new-tokens, --batch and --k must be >= 1")

    from drafters import create_drafter
    from specdec.records import DataError
    from specdec.target import load_target
    from specdec.train.data import load_distill_data

    check_drafter_dir(args.drafter_dir)  # before the slow loads
    cfg = run_config(args.drafter_dir)
    try:
        data = load_distill_data(args.data_dir)
        eval_idx, n_eval = heldout_split(data, cfg, args.data_dir, args.eval_examples)
    except DataError as e:  # no data there, or a split that leaves nothing to train on
        raise SystemExit(str(e)) from None
    if args.prompts > len(eval_idx):
        raise SystemExit(f"--prompts {args.prompts}: the split holds out only {len(eval_idx)} examples")
    k = args.k if args.k is not None else ((cfg or {}).get("drafter") or {}).get("num_draft_tokens")

    model = ((cfg or {}).get("model") or {}).get("name") or args.model  # the target the drafter was trained on
    say(f"loading target {model} ...")
    target = load_target(model)
    pad_id = target.cfg.pad_token_id if target.cfg.pad_token_id is not None else 0
    with tempfile.TemporaryDirectory() as tmp:
        path, weights = frozen_drafter(args.drafter_dir, args.step, Path(tmp))
        evaluator, info, k = make_evaluator(path, target, k, args.batch)
        drafter = create_drafter(None, target, k, path=str(path))  # the kind from drafter.json

    train_cfg = (cfg or {}).get("train") or {}
    lengths = np.array([len(data.input_ids[i]) for i in eval_idx])
    seq_len = args.seq_len or train_cfg.get("seq_len") or int(-(-lengths.max() // WIDTH_STEP) * WIDTH_STEP)
    result = {"command": " ".join(["python -m benchmarks.tau_agreement", *sys.argv[1:]]),
              "drafter": str(args.drafter_dir), "kind": info["drafter"], "weights": weights, "k": k,
              "data_dir": str(args.data_dir), "eval_examples": n_eval, "prompts": args.prompts,
              "new_tokens": args.new_tokens, "seq_len": seq_len,
              "heldout_examples_truncated": int((lengths > seq_len).sum()),
              "data_sampling": data.manifest.get("sampling"), "temperatures": {}}

    # 1. the held-out examples as stored: all of them (the run's own eval figure), and the N decoded here
    arrays = data.padded(seq_len, pad_id)
    say(f"teacher-forced on {len(eval_idx)} held-out examples (seq_len {seq_len}) ...")
    these = evaluator.evaluate(arrays, eval_idx[: args.prompts])
    rest = evaluator.evaluate(arrays, eval_idx[args.prompts:])  # None when all were decoded
    result["heldout_data"] = {"all": pooled(these, rest), "these_prompts": these}

    prompts = [data.input_ids[i][: data.prompt_lens[i]].tolist() for i in eval_idx[: args.prompts]]
    for t in args.temperatures:
        say(f"engine at T={t:g}: {len(prompts)} prompts x {args.new_tokens} tokens, k={k} ...")
        m, outputs, commits = run_engine(target, drafter, prompts, t, args.new_tokens, args.batch)
        ex, anchors, scored = engine_examples(prompts, outputs, commits, set(target.eos_token_ids), pad_id, seq_len, k)
        rows = np.arange(len(prompts))
        say(f"engine tau {m.tau:.3f}; teacher-forced on its output ...")
        result["temperatures"][f"{t:g}"] = {
            "engine": engine_summary(m, commits, scored),
            "tf_engine_output": evaluator.evaluate(ex, rows),
            "tf_at_engine_anchors": evaluator.at_anchors(ex, anchors),
            "ended_with_eos": int(sum(bool(o) and o[-1] in set(target.eos_token_ids) for o in outputs)),
        }

    print()
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(no_nan(result), indent=2))
        print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
