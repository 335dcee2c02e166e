"""The draft-vocabulary ceiling: the share of the target's answer tokens a reduced draft vocabulary can draft.

A drafter on a reduced draft vocabulary (FR-Spec: the K most frequent tokens of its training answers; the `d2t`
buffer maps draft ids to target ids) can never draft a token outside it. At T = 0 a first draft is accepted only
if it is the target's greedy token, so the share of greedy answer tokens inside the vocabulary bounds first-draft
acceptance from above (measured over every answer position; the engine's rounds start at a subset of them).

The vocabularies are built as training builds them: `specdec.train.tasks.reduced_vocab` (EOS always kept) on
`DistillData.token_counts` of the training examples of `--train`, less the `--eval-examples` that `specdec train`
holds out by id hash; one per `--sizes` K, and the full vocabulary. `--drafter` adds trained drafters' own d2t
(a drafter without one drafts from the full vocabulary). Coverage = answer tokens (the response tokens of
`specdec data`, loss_mask 1; prompt tokens never count) whose id is in the vocabulary / all answer tokens, for
the training examples, the held-out ones, and each `--eval` data directory, whole and per source (the prompt
file each record came from). A second table says, for each drafter's d2t and the smallest K, how many of the
tokens it misses occur in the example's prompt, or earlier in its context (what prompt lookup reads, so it could
still draft them), and which tokens it misses most.

    python -m benchmarks.vocab_coverage --train runs/data/smollm2_self_from2048 \\
        --eval runs/data/eval_sets_greedy runs/data/mbpp_test_greedy \\
        --drafter drafters/trained/dspark_smollm2_mix --out docs/results/ceiling/vocab_coverage

Reads the data, the drafters' d2t and the model's tokenizer (EOS ids and token texts); no target step runs.
Writes runs/benchmarks/vocab_coverage/results.{json,md} unless `--out` says otherwise.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

import numpy as np

from benchmarks.common import Report, add_output_arg
from specdec.models.registry import DEFAULT_MODEL
from specdec.train import checkpoint as ckpt
from specdec.train.data import DataError, DistillData, check_same_target, load_distill_data
from specdec.train.tasks import reduced_vocab

SIZES = (8192, 16384, 32768)
TOP_MISSED = 10


def full_label(vocab_size: int) -> str:
    return f"full {vocab_size}"


def vocabularies(counts: np.ndarray, sizes: Sequence[int], eos_ids: Sequence[int]) -> dict[str, np.ndarray]:
    """{label: d2t} of the reduced draft vocabularies training builds from response-token `counts` [V], one per
    size K (label "K"), then the full vocabulary."""
    vocab_size = len(counts)
    bad = [k for k in sizes if not 1 <= k < vocab_size]
    if bad:
        raise ValueError(f"draft vocabulary sizes {bad} are not between 1 and the vocabulary's {vocab_size - 1}")
    out = {str(k): reduced_vocab(counts, k, eos_ids) for k in sizes}
    out[full_label(vocab_size)] = np.arange(vocab_size, dtype=np.int32)
    return out


def membership(d2t, vocab_size: int) -> np.ndarray:
    """bool [V]: which target ids the draft vocabulary `d2t` (its target ids) holds."""
    d2t = np.asarray(d2t)
    if d2t.ndim != 1 or len(d2t) == 0 or d2t.min() < 0 or d2t.max() >= vocab_size:
        raise ValueError(f"a d2t map must be a non-empty list of target ids below {vocab_size}, got shape "
                         f"{d2t.shape} with ids {d2t.min() if d2t.size else '-'}..{d2t.max() if d2t.size else '-'}")
    inside = np.zeros(vocab_size, bool)
    inside[d2t] = True
    return inside


def coverage(counts: np.ndarray, inside: np.ndarray) -> float:
    """The share of the tokens counted in `counts` [V] whose id is inside the vocabulary (`membership`)."""
    total = int(counts.sum())
    if total == 0:
        raise DataError("no answer tokens to measure coverage on")
    return float(counts[inside].sum() / total)


def misses(data: DistillData, inside: np.ndarray, top: int = TOP_MISSED) -> dict:
    """The answer tokens outside the vocabulary: their share of all answer tokens; the shares of those that occur
    in the example's prompt, and earlier in its context (the prompt or the answer before them: what
    prompt lookup reads); and the `top` most frequent of them ([id, count])."""
    total = missed = in_prompt = in_context = 0
    counts = np.zeros(len(inside), np.int64)
    for ids, mask, plen in zip(data.input_ids, data.loss_mask, data.prompt_lens):
        where = np.flatnonzero(mask > 0)
        where = where[~inside[ids[where]]]  # the positions of the answer tokens outside
        out = ids[where]
        seen, first = np.unique(ids, return_index=True)
        first = first[np.searchsorted(seen, out)]  # where each one's id first occurs in the example
        total += int((mask > 0).sum())
        missed += len(out)
        in_prompt += int((first < plen).sum())
        in_context += int((first < where).sum())
        counts += np.bincount(out, minlength=len(inside))
    order = np.lexsort((np.arange(len(counts)), -counts))[:top]
    return {"answer_tokens": total, "missed": missed, "missed_share": missed / total if total else 0.0,
            "missed_in_prompt": in_prompt, "missed_in_prompt_share": in_prompt / missed if missed else 0.0,
            "missed_in_context": in_context, "missed_in_context_share": in_context / missed if missed else 0.0,
            "top_missed": [[int(i), int(counts[i])] for i in order if counts[i] > 0]}


def evaluation_sets(name: str, data: DistillData) -> list[tuple[str, DistillData]]:
    """The data set whole, then one subset per source when it holds more than one."""
    sources = sorted(set(data.sources))
    out = [(name, data)]
    if len(sources) > 1:
        out += [(f"{name} / {s}", data.subset([i for i, x in enumerate(data.sources) if x == s])) for s in sources]
    return out


def study(train: DistillData, evals: dict[str, DistillData], *, sizes: Sequence[int] = SIZES,
          eval_examples: int = 64, eos_ids: Sequence[int] = (), drafters: dict[str, np.ndarray] | None = None,
          train_name: str = "train") -> dict:
    """Coverage of every set's answer tokens by every vocabulary, and where the misses are.

    `train`: the data the vocabularies are counted on (less its `eval_examples` held out, as training does);
    `evals`: {name: data} measured against them; `drafters`: {label: d2t} of trained drafters. Returns
    {"vocabularies": {label: {"size", "built_from"}}, "overlap": {drafter: {K: shared ids}}, "rows": [{"set",
    "examples", "teacher_forced", "answer_tokens", "distinct", "coverage": {label: share}}], "misses": [{"set",
    "vocabulary", **`misses`}]}."""
    drafters = drafters or {}
    check_same_target([(train_name, train), *evals.items()], "compare")
    vocab_size = int(train.manifest["vocab_size"])
    train_idx, held_idx = train.split_indices(eval_examples)
    trained_on = train.subset(train_idx)
    vocabs = vocabularies(trained_on.token_counts(vocab_size), sizes, eos_ids)
    built = list(vocabs)
    for label, d2t in drafters.items():
        if label in vocabs:
            raise ValueError(f"drafter label {label!r} names a built vocabulary too")
        vocabs[label] = np.asarray(d2t)
    inside = {label: membership(d2t, vocab_size) for label, d2t in vocabs.items()}

    sets = [(f"{train_name} (counted)", trained_on)]
    if len(held_idx):
        sets.append((f"{train_name} (held out)", train.subset(held_idx)))
    whole = [name for name, _ in sets] + list(evals)
    for name, data in evals.items():
        sets += evaluation_sets(name, data)
    rows = []
    for name, data in sets:
        counts = data.token_counts(vocab_size)
        rows.append({"set": name, "examples": len(data), "teacher_forced": int(sum(data.teacher_forced)),
                     "answer_tokens": int(counts.sum()), "distinct": int((counts > 0).sum()),
                     "coverage": {label: coverage(counts, inside[label]) for label in vocabs}})
    explained = [*drafters, built[0]] if sizes else list(drafters)
    by_name = dict(sets)
    return {
        "vocab_size": vocab_size, "train_examples": len(train_idx), "held_out_examples": len(held_idx),
        "vocabularies": {label: {"size": int(inside[label].sum()),
                                 "built_from": train_name if label in built else "drafter"} for label in vocabs},
        "overlap": {d: {k: int((inside[d] & inside[k]).sum()) for k in built[:-1]} for d in drafters},
        "rows": rows,
        "misses": [{"set": name, "vocabulary": label, **misses(by_name[name], inside[label])}
                   for label in explained for name in whole],
    }


def drafter_vocab(path: str | Path, vocab_size: int, target_name: str) -> np.ndarray:
    """A trained drafter's draft vocabulary (its d2t buffer; all ids when it has none), read from its directory
    without building the target; it must have been trained on this target."""
    info = ckpt.load_drafter(path)
    target = info.get("target", {})
    for key, want in (("vocab_size", vocab_size), ("name", target_name)):
        if key in target and target[key] != want:
            raise ckpt.CheckpointError(f"{path} was trained on a target with {key} {target[key]!r}, not the "
                                       f"data's {want!r}")
    d2t = info["buffers"].get("d2t")
    return np.arange(vocab_size, dtype=np.int32) if d2t is None else np.asarray(d2t)


def token_text(tokenizer, token_id: int) -> str:
    """A token's text, quoted; a byte-level token holding part of a multi-byte character decodes to U+FFFD alone,
    so those are named by id."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return f"<id {token_id}: part of a character>" if "\ufffd" in text else repr(text)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=Path, required=True,
                    help="the `specdec data` directory the vocabularies are counted on (the training data)")
    ap.add_argument("--eval", type=Path, nargs="*", default=[], help="`specdec data` directories to measure")
    ap.add_argument("--drafter", type=Path, nargs="*", default=[], help="trained drafter directories (their d2t)")
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="draft vocabulary sizes K")
    ap.add_argument("--eval-examples", type=int, default=64,
                    help="training examples held out by id hash, as train.eval_examples (default 64)")
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help=f"the target the data came from: its EOS ids and token texts (default {DEFAULT_MODEL})")
    add_output_arg(ap, __file__)
    args = ap.parse_args(argv)
    if args.eval_examples < 0:
        ap.error(f"--eval-examples must be >= 0, got {args.eval_examples}")
    names = [p.name for p in [args.train, *args.eval]]
    if len(set(names)) != len(names):
        ap.error(f"the data directories must have distinct names, got {names}")
    report = Report(__file__, argv, args.out)

    from specdec.models.loading import load_checkpoint

    cfg, _, tokenizer = load_checkpoint(args.model)
    try:
        train = load_distill_data(args.train)
        for key, want in (("target", cfg.name), ("vocab_size", cfg.vocab_size)):
            if train.manifest.get(key) != want:
                raise DataError(f"{args.train} was made by a target with {key} {train.manifest.get(key)!r}, not "
                                f"{args.model}'s {want!r}")
        evals = {p.name: load_distill_data(p) for p in args.eval}
        drafters = {f"{p.name} d2t": drafter_vocab(p, cfg.vocab_size, cfg.name) for p in args.drafter}
        results = study(train, evals, sizes=args.sizes, eval_examples=args.eval_examples,
                        eos_ids=cfg.eos_token_ids, drafters=drafters, train_name=args.train.name)
    except (DataError, ckpt.CheckpointError, ValueError) as e:
        raise SystemExit(str(e)) from None
    report.finish()

    vocabs = results["vocabularies"]
    columns = [label if v["built_from"] != "drafter" else f"{label} ({v['size']})" for label, v in vocabs.items()]
    report.table(
        "Answer tokens inside the draft vocabulary",
        ["set", "examples", "teacher-forced", "answer tokens", "distinct", *columns],
        [[r["set"], r["examples"], r["teacher_forced"], r["answer_tokens"], r["distinct"],
          *[f"{r['coverage'][label]:.4f}" for label in vocabs]] for r in results["rows"]],
        note=f"share of the answer tokens (the responses of `specdec data`, prompts not counted) whose id is in the "
             f"draft vocabulary: an upper bound on first-draft acceptance at T = 0 on greedy answers. K columns: the "
             f"K most frequent response tokens of the {results['train_examples']} training examples of "
             f"{args.train.name} ({results['held_out_examples']} held out by id hash, as training does), EOS always "
             f"kept (`reduced_vocab`, as training builds d2t); d2t columns: the drafter's own map; teacher-forced: "
             f"examples whose response was given, not generated by the target.")
    overlap = "; ".join(f"{d}: " + ", ".join(f"{k} {n}" for k, n in shared.items())
                        for d, shared in results["overlap"].items())
    report.table(
        "The answer tokens a vocabulary misses",
        ["set", "vocabulary", "outside", "of those, in the prompt", "in the context before",
         f"most frequent outside (token, count; top {TOP_MISSED})"],
        [[m["set"], m["vocabulary"], f"{m['missed_share']:.4f}", f"{m['missed_in_prompt_share']:.3f}",
          f"{m['missed_in_context_share']:.3f}",
          ", ".join(f"{token_text(tokenizer, i)} {c}" for i, c in m["top_missed"])] for m in results["misses"]],
        note="outside: share of the set's answer tokens not in the vocabulary; of those, the share whose id occurs "
             "in the example's prompt, and earlier in its context (the prompt or the answer before it: what prompt "
             f"lookup reads). Overlap of each drafter's d2t with the built vocabularies (ids in both): {overlap}")
    for m in results["misses"]:
        m["top_missed"] = [[i, c, tokenizer.decode([i], skip_special_tokens=False)] for i, c in m["top_missed"]]
    report.write({"args": {k: v for k, v in vars(args).items() if k != "out"}, **results})
    return results


if __name__ == "__main__":
    main()
