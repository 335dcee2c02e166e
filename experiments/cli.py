"""The `specdec` command.

    specdec quickstart                      a small speculative-decoding experiment on the default model
    specdec generate "prompt" [options]     AR or speculative generation; prints the text and the metrics
    specdec models                          registered models and drafters
    specdec run <config.yaml> [k=v ...]     one experiment: AR baseline vs the configured drafter
    specdec sweep <sweep.yaml> [k=v ...]    every run of a sweep, then a combined report
    specdec data <config.yaml> [k=v ...]    distillation data: the target's responses to the config's prompts
    specdec train <config.yaml> [k=v ...]   train the config's drafter on that data (resumes when interrupted)
    specdec export <run> --format vllm|sglang <out>   the trained drafter in a serving engine's layout
    specdec export <run> --format inference <out>     ... or with only what decoding reads (what ships)
    specdec recipe <recipe.yaml> [--until S | --only S] [--dry-run]   the stages that make a drafter, its card
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml


def _parse_params(items: list[str]) -> dict:
    params = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"error: --param expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        params[key] = yaml.safe_load(value)
    return params


def _encode(target, text: str, chat: bool) -> list[int]:
    tok = target.tokenizer
    if tok is None:
        raise SystemExit("error: this model has no tokenizer; pass token ids via the Python API")
    return tok.encode_chat(text) if chat and tok.chat_template else tok.encode(text)


def _shipped_drafter_fits(target) -> str | None:
    """The shipped trained drafter's path if it was trained on `target` (same shapes), else None."""
    from drafters import SHIPPED_DRAFTER
    from specdec.train.checkpoint import DRAFTER_FILE, check_target

    try:
        info = json.loads((SHIPPED_DRAFTER / DRAFTER_FILE).read_text())
        check_target(info, target, str(SHIPPED_DRAFTER))
    except (OSError, ValueError):  # missing, unreadable, or trained on another target (CheckpointError)
        return None
    return str(SHIPPED_DRAFTER)


def cmd_quickstart(args) -> int:
    import drafters
    from experiments.compare import DrafterSpec, category_table, compare, table
    from specdec.adaptive import AdaptiveWidth
    from specdec.prompts import builtin
    from specdec.target import load_target

    print(f"loading {args.model} ...", flush=True)
    target = load_target(args.model, backend=args.backend)
    prompts = builtin("quickstart")
    encoded = [target.tokenizer.encode_chat(text) for _, text in prompts]
    # Every drafter with the adaptive verify width (each round verifies what pays on this machine, or skips the
    # draft). A fixed-width row (every drafted token verified) would cost a newcomer another loop compile and
    # timed pass for an ablation; `specdec generate --scheduler fixed` shows it.
    adaptive = AdaptiveWidth()
    specs = [DrafterSpec("ngram", 6, {"max_ngram": 3}, scheduler=adaptive),
             DrafterSpec("self_spec", 4, {"num_layers": 24}, scheduler=adaptive)]
    if "suffix" in drafters.available():
        specs.insert(1, DrafterSpec("suffix", 8, {}, policy="greedy_tree", scheduler=adaptive))
    shipped = _shipped_drafter_fits(target)
    if shipped:  # the trained drafter that ships with the repo, if it was trained on this target, drafting a
        # 7-node token tree from its block forward (engine tau 1.81 against its chain's 1.62, at batch 1 as fast
        # or faster: docs/BENCHMARKS.md)
        tree = {"path": shipped, "tree_top_k": 4, "tree_depth": 3}
        specs.append(DrafterSpec("dspark", 7, tree, policy="greedy_tree", scheduler=adaptive, label="dspark(shipped)"))
        # ... and with prompt lookup where the context repeats itself (drafters/hybrid.py)
        specs.append(DrafterSpec("hybrid", 7, {**tree, "min_match": 2}, policy="greedy_tree", scheduler=adaptive,
                                 label="hybrid(shipped+lookup)"))
    print(f"{len(prompts)} built-in prompts ({', '.join(sorted({c for c, _ in prompts}))}), batch 1, greedy, "
          f"{args.max_new_tokens} new tokens; AR baseline first, then each drafter (compile excluded; the adaptive "
          "width measures this machine's round costs once, cached, and compiled programs are cached for the next "
          "run)\n", flush=True)
    rows = compare(target, encoded, specs, max_new_tokens=args.max_new_tokens,
                   progress=lambda r: print(f"  done: {r.method} ({r.metrics.tokens_per_second:.1f} tok/s)",
                                            flush=True))
    print()
    print(table(rows))
    print("\nspeedup vs AR (tau) by prompt kind:\n")
    print(category_table(rows, [c for c, _ in prompts]))
    print("\nexample output (prompt 1):", repr(target.tokenizer.decode(rows[0].outputs[0])))
    if not all(r.matches_ar for r in rows):
        print("ERROR: a speculative output differed from AR under greedy decoding", file=sys.stderr)
        return 1
    return 0


def cmd_generate(args) -> int:
    from drafters import available, create_drafter
    from specdec.adaptive import AdaptiveWidth
    from specdec.engine import speculative_generate
    from specdec.generate import ar_metrics, generate
    from specdec.sampling import SamplingParams
    from specdec.target import load_target
    from specdec.verify import get_policy

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    target = load_target(args.model, backend=args.backend)
    prompts = [_encode(target, p, not args.raw) for p in args.prompt]
    if args.drafter in (None, "none", "ar"):
        out = generate(target, prompts, args.max_new_tokens, sampling, seed=args.seed, warmup=args.warmup)
        tokens, metrics = out.tokens, ar_metrics(out)
    else:
        params = _parse_params(args.param)
        name = args.drafter
        if name not in available() and Path(name).is_dir():  # a trained / exported drafter: kind from the dir
            name, params["path"] = None, name
        drafter = create_drafter(name, target, args.num_draft_tokens, **params)
        policy = args.policy or ("greedy_tree" if drafter.kind == "tree" else "greedy_chain")
        if not sampling.greedy and get_policy(policy).greedy_only:
            policy = "multidraft_tree" if drafter.kind == "tree" else "rejection_chain"
        if drafter.kind == "tree" and get_policy(policy).tree_counterpart:  # the same rule on a tree, as configs do
            policy = get_policy(policy).tree_counterpart
        scheduler = AdaptiveWidth() if args.scheduler == "adaptive" else None
        out = speculative_generate(target, drafter, prompts, policy=policy, max_new_tokens=args.max_new_tokens,
                                   sampling=sampling, seed=args.seed, warmup=args.warmup, scheduler=scheduler)
        tokens, metrics = out.tokens, out.metrics
    for text, row in zip(args.prompt, tokens):
        print(f"### {text}\n{target.tokenizer.decode(row)}\n")
    summary = {k: v for k, v in metrics.summary().items() if v is not None}
    print(json.dumps(summary, indent=2) if args.json else
          "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()
                    if not isinstance(v, list)))
    return 0


def cmd_export(args) -> int:
    """Write a trained drafter in the layout vLLM (speculators) or SGLang (SpecForge) loads (docs/EXPORT.md), or
    as specdec's inference-format drafter directory (only what decoding reads: docs/TRAINING.md)."""
    import drafters
    from experiments.build import build_target
    from specdec.config import load_config
    from specdec.export import INFERENCE, export_run

    run = Path(args.run_dir)
    if not run.is_dir():
        raise ValueError(f"{run} is not a directory; pass a training run directory (output.dir/output.name)")
    if args.format == INFERENCE:  # no target needed: the draft vocabulary's ids are the drafter's own d2t
        drafters.available()  # drafter modules declare what their decoding reads on import
        out = export_run(run, args.out_dir, INFERENCE, None, overwrite=args.overwrite)
        print(f"exported {run} in the inference format -> {out}")
        for f in sorted(out.iterdir()):
            print(f"  {f.name} ({f.stat().st_size:,} bytes)")
        return 0
    stored = run / "config.yaml"
    if args.model is None and not stored.is_file():
        raise ValueError(f"{run} has no config.yaml naming its target; pass --model")
    run_cfg = load_config(yaml.safe_load(stored.read_text())) if stored.is_file() else None
    model = run_cfg.model if run_cfg is not None else None
    if args.model is not None:
        model = load_config({"model": {"name": args.model}}).model
    print(f"loading target {model.name} ...", flush=True)
    target = build_target(model)
    drafters.available()  # drafter modules register their architectures for export on import
    out = export_run(run, args.out_dir, args.format, target, model_name=model.name,
                     num_draft_tokens=args.num_draft_tokens, overwrite=args.overwrite)
    print(f"exported {run} for {args.format} -> {out}")
    for note in json.loads((out / "specdec_export.json").read_text())["not_carried"]:
        print(f"warning: not carried by the {args.format} format: {note}", file=sys.stderr)
    if run_cfg is not None:  # the export becomes an artifact of the training run's own W&B run
        from experiments.tracking import make_tracker

        with make_tracker(run_cfg.tracking, run_name=run.name, out_dir=run, resume_dir=run) as tracker:
            tracker.log_artifact(f"{run.name}-{args.format}", "model", sorted(f for f in out.iterdir() if f.is_file()),
                                 {"format": args.format, "target": model.name})
    for f in sorted(out.iterdir()):
        print(f"  {f.name} ({f.stat().st_size:,} bytes)")
    return 0


def cmd_models(args) -> int:
    import drafters
    from specdec.models.registry import REGISTRY, cache_dir

    print("models (name -> source):")
    for entry in REGISTRY.values():
        print(f"  {entry.name}: {entry.description} [{entry.pip_requirement}]")
    print(f"  (cache: {cache_dir()}; any .gguf file or Hugging Face directory path also works)")
    print("drafters:", ", ".join(drafters.available()))
    from specdec.verify import POLICY_NAMES
    print("verification policies:", ", ".join(POLICY_NAMES))
    return 0


def cmd_run(args) -> int:
    from experiments.lossless import LosslessError
    from experiments.run import main_run

    try:
        summary = main_run(args.config, args.overrides, progress=not args.no_progress)
    except LosslessError as e:  # loud, with its own exit status
        print(f"\nERROR: {e}", file=sys.stderr)
        return 3
    return 0 if summary.get("status") == "complete" else 1


def cmd_sweep(args) -> int:
    from experiments.sweep import SweepError, run_sweep

    command = " ".join(["specdec", "sweep", args.sweep, *args.overrides]
                       + [f"--only '{p}'" for p in args.only or ()])
    try:
        run_sweep(args.sweep, args.overrides, progress=not args.no_progress, command=command, only=args.only or ())
    except SweepError as e:
        print(f"\nERROR: {e}", file=sys.stderr)
        return 3
    return 0


def _summary_lines(summary: dict, keys) -> str:
    width = max(len(k) for k in keys)
    return "\n".join(f"  {k:<{width}}  {summary[k]}" for k in keys if summary.get(k) is not None)


def cmd_data(args) -> int:
    """Prompts of `data.datasets` (files, hub names, or `name: self` = written by the target) -> the target's
    responses under `train.data_dir` (sampling: `sampling`; length and batch: `generation`)."""
    from experiments.build import build_target
    from specdec.config import load_config
    from specdec.sampling import SamplingParams
    from specdec.train.data import (SELF_PROMPTS, build_distill_data, contamination_filter, load_prompt_records,
                                    self_generated_prompts)

    cfg = load_config(args.config, args.overrides)
    tc = cfg.train
    if not tc.data_dir:
        raise ValueError("train.data_dir: set the directory the distillation data is written to")
    print(f"loading target {cfg.model.name} ...", flush=True)
    target = build_target(cfg.model, cfg.mesh)
    sampling = cfg.sampling.to_params()
    gen = cfg.generation
    prompts = []
    for ds in cfg.data.datasets:
        contaminated = contamination_filter(ds.decontaminate) if ds.decontaminate else None
        if ds.name == SELF_PROMPTS:
            seed = cfg.sampling.seed if ds.sample_seed is None else ds.sample_seed
            prompt_sampling = sampling if ds.prompt_temperature is None else \
                SamplingParams(temperature=ds.prompt_temperature)
            prompts += self_generated_prompts(
                target, ds.limit or 64, sampling=prompt_sampling, seed=seed, skip=ds.skip,
                max_new_tokens=min(gen.max_new_tokens, 128), batch_size=gen.batch_size,
                progress=not args.no_progress, contaminated=contaminated,
                cache_path=Path(tc.data_dir) / f"self_prompts-seed{seed}-skip{ds.skip}.jsonl")
        else:
            prompts += load_prompt_records(ds.name, split=ds.split, field=ds.field, limit=ds.limit,
                                          sample_seed=ds.sample_seed, skip=ds.skip, response_field=ds.response_field,
                                          exclude_ids=sorted(ds.excluded_ids()), contaminated=contaminated,
                                          sources=ds.sources)
    forced = sum(p.response is not None for p in prompts)
    max_prompt = tc.seq_len - gen.max_new_tokens if tc.seq_len > gen.max_new_tokens else tc.seq_len // 2
    print(f"{len(prompts)} prompts ({forced} with given responses: teacher-forced) -> responses of up to "
          f"{gen.max_new_tokens} tokens (temperature {sampling.temperature}, batch {gen.batch_size}) into "
          f"{tc.data_dir}", flush=True)
    summary = build_distill_data(target, prompts, tc.data_dir, sampling=sampling, seed=cfg.sampling.seed,
                                 max_new_tokens=gen.max_new_tokens, batch_size=gen.batch_size,
                                 shard_size=tc.shard_size, chat_template=cfg.data.chat_template,
                                 max_prompt_len=max_prompt, max_total_len=tc.seq_len, insert_rows=gen.insert_rows,
                                 max_seconds=cfg.data.max_seconds, progress=not args.no_progress)
    print("\ndistillation data:")
    print(_summary_lines(summary, ["data_dir", "prompts", "skipped_prompts", "examples", "prompt_tokens",
                                   "response_tokens", "teacher_forced_examples", "stopped_at_eos", "seconds",
                                   "generate_seconds", "generate_tokens_per_second", "batch_utilisation",
                                   "decode_batch", "shards"]))
    if not summary["complete"]:
        print(f"  data.max_seconds={cfg.data.max_seconds} reached: rerun the same command to answer the rest")
    for source, counts in summary["sources"].items():
        print(f"    {source}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    from experiments.tracking import make_tracker

    with make_tracker(cfg.tracking, run_name=f"data-{Path(tc.data_dir).name}", out_dir=Path(tc.data_dir)) as tracker:
        tracker.log_summary(summary)
        tracker.log_artifact(*data_artifact(tc.data_dir))
    return 0


def data_artifact(data_dir) -> tuple[str, str, list[Path], dict]:
    """(name, kind, files, metadata) of a distillation data set's W&B artifact: its manifest and summary (the
    shards stay on disk; the manifest's fingerprint identifies them)."""
    from specdec.train.data import MANIFEST

    d = Path(data_dir)
    files = [f for f in (d / MANIFEST, d / "summary.json") if f.is_file()]
    manifest = json.loads((d / MANIFEST).read_text()) if (d / MANIFEST).is_file() else {}
    return f"distill-data-{d.name}", "dataset", files, {"prompts_sha": manifest.get("prompts_sha"),
                                                         "num_prompts": manifest.get("num_prompts")}


# Config keys that may change when a training run is resumed (everything else must match the stored config):
# the run's length and bookkeeping, and what only decoding / evaluation with the trained drafter reads.
RESUMABLE_CHANGES = ("train.steps", "train.max_seconds", "train.eval_every", "train.checkpoint_every",
                     "train.keep_checkpoints", "train.log_every", "tracking", "output", "description", "eval",
                     "generation", "sampling", "data", "verify", "scheduler", "mesh", "drafter.num_draft_tokens",
                     "drafter.params", "drafter.path")


def _config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The dotted keys outside RESUMABLE_CHANGES whose values differ between two config dicts."""
    keys = sorted(set(old) | set(new))
    out = []
    for k in keys:
        name = f"{prefix}.{k}" if prefix else k
        if any(name == r or name.startswith(r + ".") for r in RESUMABLE_CHANGES):
            continue
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_diff(a, b, name)
        elif a != b:
            out.append(name)
    return out


def _claim_run_dir(run_dir: Path, config: dict) -> None:
    """Refuse a run directory that holds a run (checkpoints) of another config, up to RESUMABLE_CHANGES; then
    record `config` as the run's config.yaml. `train()` itself resumes from whatever checkpoints it finds."""
    from specdec.train.checkpoint import CHECKPOINTS

    run_dir.mkdir(parents=True, exist_ok=True)
    stored = run_dir / "config.yaml"
    if stored.exists() and (run_dir / CHECKPOINTS).is_dir():
        diff = _config_diff(yaml.safe_load(stored.read_text()) or {}, config)
        if diff:
            raise ValueError(f"{run_dir} holds a run with another config (differs in: {', '.join(diff)}); "
                             "use another output.name, or delete the directory to start over")
    stored.write_text(yaml.safe_dump(config, sort_keys=False))


def cmd_train(args) -> int:
    """Train `drafter.name` with `train.*` (options: train.drafter_options) on `train.data_dir`; the run goes to
    <output.dir>/<output.name or the config's stem>/ and resumes from its checkpoints when rerun."""
    import drafters
    from experiments.build import build_target
    from experiments.tracking import make_tracker
    from specdec.config import load_config, to_dict
    from specdec.train.data import load_distill_data, pool_distill_data
    from specdec.train.loop import TrainingDiverged, train
    from specdec.train.tasks import make_task

    cfg = load_config(args.config, args.overrides)
    if not cfg.train.data_dir:
        raise ValueError("train.data_dir: set the distillation data directory (made by `specdec data`)")
    if args.stop_at_step is not None and not 1 <= args.stop_at_step <= cfg.train.steps:
        raise ValueError(f"--stop-at-step {args.stop_at_step}: must be a step from 1 to train.steps="
                         f"{cfg.train.steps}")
    name = cfg.output.name or Path(args.config).stem
    run_dir = Path(cfg.output.dir) / name
    data = pool_distill_data([(d.data_dir, load_distill_data(d.data_dir, d.skip_shards))
                              for d in (cfg.train, *cfg.train.more_data)])
    print(f"loading target {cfg.model.name} ...", flush=True)
    target = build_target(cfg.model, cfg.mesh)
    drafters.available()  # drafter modules register their training tasks on import
    task = make_task(cfg.drafter.name, target, cfg.train.drafter_options)
    _claim_run_dir(run_dir, to_dict(cfg))  # before the tracker: a refused run leaves its W&B run alone
    # a resumed run continues its W&B run (the id is kept in the run directory), linked to its data
    tracker = make_tracker(cfg.tracking, run_name=name, out_dir=run_dir, config=to_dict(cfg), resume_dir=run_dir)
    for data_dir in (cfg.train.data_dir, *(d.data_dir for d in cfg.train.more_data)):
        tracker.use_artifact(*data_artifact(data_dir))
    try:
        summary = train(task, target, data, cfg.train, run_dir, tracker=tracker, progress=not args.no_progress,
                        eval_draft_len=cfg.drafter.num_draft_tokens, stop_at=args.stop_at_step)
    except TrainingDiverged as e:
        print(f"\nERROR: {e}", file=sys.stderr)
        return 3
    finally:
        tracker.finish()
    first, final = summary["first_eval"], summary["final_eval"]
    stopped = f" (stopped as asked; its schedule spans {cfg.train.steps})" if summary["status"] == "stopped" else ""
    print(f"\n{task.name} trained for {summary['steps']} steps{stopped} in {summary['seconds']} s -> {run_dir}")
    print(_summary_lines(summary, ["trainable_parameters", "train_examples", "eval_examples",
                                   "train_tokens_per_second", "bytes_per_token_cached"]))
    if final and "loss" in final:
        was = (lambda key: f"{first[key]:.4f} -> ") if first else (lambda key: "")
        print(f"  held-out loss            {was('loss')}{final['loss']:.4f}")
        print(f"  expected tau (k={final['draft_len']}, T=1) {was('expected_tau')}{final['expected_tau']:.4f}")
        print(f"  greedy tau               {was('greedy_tau')}{final['greedy_tau']:.4f}")
        print(f"  acceptance by step       {final['acceptance_by_step']}")
        print(f"  greedy acceptance        {final['greedy_acceptance_by_step']}")
    for name, ev in ((final or {}).get("sets") or {}).items():
        print(f"  {name}: expected tau {ev['expected_tau']:.4f}, greedy tau {ev['greedy_tau']:.4f}, acceptance by "
              f"step {ev['acceptance_by_step']}, greedy {ev['greedy_acceptance_by_step']}")
    print(f"  use it: drafter.name={task.name} drafter.path={run_dir}")
    return 0


def cmd_recipe(args) -> int:
    """Run a recipe's stages (experiments/recipe.py): data, training, evaluation, the model card."""
    from experiments.recipe import run_recipe

    return run_recipe(args.recipe, main, until=args.until, only=args.only, dry_run=args.dry_run,
                      progress=not args.no_progress)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Speculative decoding research framework (JAX)")
    sub = parser.add_subparsers(dest="command", required=True)

    q = sub.add_parser("quickstart", help="speculative decoding vs AR on built-in prompts, as a table")
    q.add_argument("--model", default="smollm2-135m-instruct")
    q.add_argument("--backend", default="reference", choices=["reference", "scan", "megakernel"])
    q.add_argument("--max-new-tokens", type=int, default=64)
    q.set_defaults(func=cmd_quickstart)

    g = sub.add_parser("generate", help="generate text, autoregressive or speculative")
    g.add_argument("prompt", nargs="+", help="prompt text(s); several form a batch")
    g.add_argument("--model", default="smollm2-135m-instruct", help="registry name, .gguf file or HF directory")
    g.add_argument("--backend", default="reference", choices=["reference", "scan", "megakernel"])
    g.add_argument("--drafter", default=None, help="drafter name, or a trained / exported drafter directory (its "
                   "kind is read from it); omit or 'none' for plain AR decoding")
    g.add_argument("-k", "--num-draft-tokens", type=int, default=5)
    g.add_argument("--param", action="append", metavar="KEY=VALUE", help="drafter parameter (repeatable)")
    g.add_argument("--policy", default=None, help="verification policy (default: greedy for the drafter's kind)")
    g.add_argument("--scheduler", default="adaptive", choices=["adaptive", "fixed"],
                   help="adaptive: verify each round what pays on this machine (or skip the draft); fixed: all k")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--warmup", action="store_true", help="compile first so the metrics exclude compilation")
    g.add_argument("--json", action="store_true", help="print the metrics as JSON")
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("export", help="export a trained drafter for vLLM or SGLang (config.json + safetensors), "
                                      "or with only what decoding reads (--format inference)",
                       description="Write the trained EAGLE-3, DFlash or DSpark drafter of RUN_DIR into OUT_DIR in "
                                   "the layout vLLM (speculators) or SGLang loads (docs/EXPORT.md); or, with "
                                   "--format inference, a DFlash / DSpark drafter directory holding only the "
                                   "tensors decoding reads, matrices float16: what ships (docs/TRAINING.md).")
    e.add_argument("run_dir", help="training run directory (output.dir/output.name), or a drafter directory")
    e.add_argument("--format", required=True, choices=["vllm", "sglang", "inference"])
    e.add_argument("out_dir", help="directory to write (must be empty unless --overwrite)")
    e.add_argument("--model", default=None, help="the target (default: model.name of the run's config.yaml)")
    e.add_argument("-k", "--num-draft-tokens", type=int, default=None,
                   help="speculative tokens written into the vLLM config (default: EAGLE-3: the run's "
                        "drafter.num_draft_tokens; DFlash / DSpark: block_size - 1)")
    e.add_argument("--overwrite", action="store_true")
    e.set_defaults(func=cmd_export)

    m = sub.add_parser("models", help="list registered models, drafters and policies")
    m.set_defaults(func=cmd_models)

    r = sub.add_parser("run", help="run an experiment config (AR baseline vs drafter; records, summary, plots)",
                       description="Run one experiment. Outputs go to <output.dir>/<output.name>/ (output.name "
                                   "defaults to the config file's stem); an interrupted run resumes where it "
                                   "stopped, a finished one is not re-run.")
    r.add_argument("config", help="experiment YAML file (e.g. configs/experiments/headline.yaml)")
    r.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("sweep", help="run every run of a sweep file, then write the combined report",
                       description="Run a sweep (grid and/or list of runs). Each run gets its own directory under "
                                   "<output.dir>/<sweep name>/; finished runs are skipped; report.md and the plots "
                                   "land in the sweep directory.")
    s.add_argument("sweep", help="sweep YAML file (e.g. configs/sweeps/headline.yaml)")
    s.add_argument("overrides", nargs="*", metavar="section.key=value", help="overrides applied to every run")
    s.add_argument("--only", action="append", metavar="PATTERN",
                   help="run only the runs whose name matches this shell pattern (repeatable); the report still "
                        "covers every finished run")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.set_defaults(func=cmd_sweep)

    d = sub.add_parser("data", help="generate distillation data: the target's responses to the config's prompts",
                       description="Prompts from data.datasets (.jsonl/.json/.csv, hub names, or `name: self` for "
                                   "prompts written by the target), responses from the target (sampling, "
                                   "generation.max_new_tokens / batch_size) stored under train.data_dir as a "
                                   "`datasets` dataset. Rerunning resumes: finished shards are kept.")
    d.add_argument("config", help="training YAML file (e.g. configs/train/eagle3.yaml)")
    d.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    d.set_defaults(func=cmd_data)

    t = sub.add_parser("train", help="train a drafter (eagle3, dflash, dspark, medusa, distilled_lm) on distillation data",
                       description="Train drafter.name on train.data_dir with train.* settings; checkpoints, "
                                   "metrics and the exported drafter go to <output.dir>/<output.name>/. Rerunning "
                                   "resumes exactly from the latest checkpoint. Use the result with "
                                   "drafter.path=<run dir>.")
    t.add_argument("config", help="training YAML file (e.g. configs/train/eagle3.yaml)")
    t.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.add_argument("--stop-at-step", type=int, default=None, metavar="N",
                   help="end the run at step N although its learning-rate schedule spans train.steps (saved and "
                        "exported, not calibrated, summary status 'stopped'); rerunning with a larger N goes on")
    t.set_defaults(func=cmd_train)

    c = sub.add_parser("recipe", help="run the stages that make a trained drafter (data, training, evaluation, "
                                      "model card); finished stages are skipped, an interrupted one resumes",
                       description="Run a recipe file (configs/recipes/): its data, train, eval and card stages in "
                                   "order, outputs under its `out` (runs/recipes/<name>/). A finished stage is "
                                   "skipped, an interrupted one resumes, a stage that changed since its output was "
                                   "made is refused (docs/TRAINING.md, \"The recipe\").")
    c.add_argument("recipe", help="recipe YAML file (e.g. configs/recipes/smollm2_135m_dspark.yaml)")
    c.add_argument("--until", metavar="STAGE", help="run the stages up to and including STAGE")
    c.add_argument("--only", metavar="STAGE", help="run STAGE alone, its inputs finished (a card stage: render the "
                   "model card again from the existing evaluation)")
    c.add_argument("--dry-run", action="store_true", help="print each stage, its command and whether it is "
                   "finished; run nothing")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_recipe)
    return parser


def _persistent_compilation_cache() -> None:
    """Keep compiled XLA programs in the specdec cache dir ($SPECDEC_CACHE/xla), so a second run of a command skips
    most of its compilation (the quickstart compiles a speculative loop per drafter, tens of seconds each on a
    2-core CPU). JAX keeps only programs that took over a second to compile. A cache dir set for JAX itself
    (JAX_COMPILATION_CACHE_DIR) is left as it is."""
    import jax

    from specdec.costs import cache_root

    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(cache_root() / "xla"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _persistent_compilation_cache()
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
