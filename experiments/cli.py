"""The `specdec` command.

    specdec quickstart                      a small speculative-decoding experiment on the default model
    specdec generate "prompt" [options]     AR or speculative generation; prints the text and the metrics
    specdec models                          registered models and drafters
"""

from __future__ import annotations

import argparse
import json
import sys

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


def cmd_quickstart(args) -> int:
    import drafters
    from experiments.compare import DrafterSpec, compare, table
    from specdec.prompts import builtin
    from specdec.target import load_target

    print(f"loading {args.model} ...", flush=True)
    target = load_target(args.model, backend=args.backend)
    prompts = builtin("quickstart")
    encoded = [target.tokenizer.encode_chat(text) for _, text in prompts]
    specs = [DrafterSpec("ngram", 6, {"max_ngram": 3}), DrafterSpec("self_spec", 4, {"num_layers": 24})]
    if "suffix" in drafters.available():
        specs.insert(1, DrafterSpec("suffix", 8, {}, policy="greedy_tree"))
    print(f"{len(prompts)} built-in prompts ({', '.join(sorted({c for c, _ in prompts}))}), batch 1, greedy, "
          f"{args.max_new_tokens} new tokens; AR baseline first, then each drafter (compile excluded)\n",
          flush=True)
    rows = compare(target, encoded, specs, max_new_tokens=args.max_new_tokens,
                   progress=lambda r: print(f"  done: {r.method} ({r.metrics.tokens_per_second:.1f} tok/s)",
                                            flush=True))
    print()
    print(table(rows))
    print("\nexample output (prompt 1):", repr(target.tokenizer.decode(rows[0].outputs[0])))
    if not all(r.matches_ar for r in rows):
        print("ERROR: a speculative output differed from AR under greedy decoding", file=sys.stderr)
        return 1
    return 0


def cmd_generate(args) -> int:
    from drafters import create_drafter
    from specdec.engine import speculative_generate
    from specdec.generate import ar_metrics, generate
    from specdec.sampling import SamplingParams
    from specdec.target import load_target

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    target = load_target(args.model, backend=args.backend)
    prompts = [_encode(target, p, not args.raw) for p in args.prompt]
    if args.drafter in (None, "none", "ar"):
        out = generate(target, prompts, args.max_new_tokens, sampling, seed=args.seed, warmup=args.warmup)
        tokens, metrics = out.tokens, ar_metrics(out)
    else:
        drafter = create_drafter(args.drafter, target, args.num_draft_tokens, **_parse_params(args.param))
        policy = args.policy or ("greedy_tree" if drafter.kind == "tree" else "greedy_chain")
        if not sampling.greedy and policy.startswith("greedy"):
            policy = "multidraft_tree" if drafter.kind == "tree" else "rejection_chain"
        out = speculative_generate(target, drafter, prompts, policy=policy, max_new_tokens=args.max_new_tokens,
                                   sampling=sampling, seed=args.seed, warmup=args.warmup)
        tokens, metrics = out.tokens, out.metrics
    for text, row in zip(args.prompt, tokens):
        print(f"### {text}\n{target.tokenizer.decode(row)}\n")
    summary = {k: v for k, v in metrics.summary().items() if v is not None}
    print(json.dumps(summary, indent=2) if args.json else
          "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()
                    if not isinstance(v, list)))
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
    g.add_argument("--drafter", default=None, help="drafter name (omit or 'none' for plain AR decoding)")
    g.add_argument("-k", "--num-draft-tokens", type=int, default=5)
    g.add_argument("--param", action="append", metavar="KEY=VALUE", help="drafter parameter (repeatable)")
    g.add_argument("--policy", default=None, help="verification policy (default: greedy for the drafter's kind)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--warmup", action="store_true", help="compile first so the metrics exclude compilation")
    g.add_argument("--json", action="store_true", help="print the metrics as JSON")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list registered models, drafters and policies")
    m.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
