"""The model card of a recipe's drafter: its README.md, rendered by the template below from the results JSON of
the recipe's eval stage, the drafter's drafter.json (and summary.json) and the recipe with its stages' outputs
(examples and response tokens of each data stage, steps of each training stage). Every figure comes from those
files; a results JSON that lacks one is refused, naming it. `specdec recipe <recipe> --only <card stage>`
renders it again from an existing evaluation. experiments/recipe.py gathers those files; this module only
checks and renders (standard library only: tools/device_train.py imports the recipe module on a bare device).
"""

from __future__ import annotations

SET_NAMES = {"mt_bench": "MT-Bench", "gsm8k": "GSM8K", "humaneval": "HumanEval", "mbpp": "MBPP (test split)"}
FIGURES = ("tau", "first_accept")


class CardError(ValueError):
    """A results file that lacks a figure the card shows, or a stage output the card reads that is missing."""


def methods(kind: str, nodes: int, tree: dict) -> dict[str, dict]:
    """The methods an evaluation compares, as the card states each: alone or with lookup, chain or tree, and
    the verified nodes per round (the same for all)."""
    shape = ", ".join(f"{k} {v}" for k, v in tree.items())
    return {
        "drafter_chain": {"label": f"{kind} (this drafter)", "with_lookup": "alone", "shape": "chain",
                          "verified_nodes": nodes},
        "drafter_tree": {"label": f"{kind} (this drafter)", "with_lookup": "alone", "shape": f"tree ({shape})",
                         "verified_nodes": nodes},
        "ngram": {"label": "n-gram prompt lookup (max_ngram 3)", "with_lookup": "lookup only", "shape": "chain",
                  "verified_nodes": nodes},
        "suffix": {"label": "suffix decoding", "with_lookup": "lookup only", "shape": "tree",
                   "verified_nodes": nodes},
    }


def set_name(label: str) -> str:
    return SET_NAMES.get(label, label)


def _get(data, path: tuple, where: str):
    for key in path:
        if not isinstance(data, dict) or key not in data or data[key] is None:
            raise CardError(f"{where} lacks {'.'.join(map(str, path))}: the card shows only measured figures; "
                            "run the eval stage again to make a complete results file")
        data = data[key]
    return data


def check_results(results: dict, where: str = "results.json") -> None:
    """Every figure the card shows is in `results`, else a CardError naming the first one missing."""
    for path in (("drafter", "kind"), ("settings", "model"), ("settings", "max_new_tokens"),
                 ("settings", "batch_size"), ("settings", "nodes"), ("settings", "tree"), ("measured", "machine"),
                 ("measured", "date"), ("sets",), ("methods",), ("results",)):
        _get(results, path, where)
    if not results["sets"]:
        raise CardError(f"{where} lacks sets: no prompt set was measured")
    for s in results["sets"]:  # each set's column head: its prompt count, and whether it is untuned
        _get(results, ("sets", s, "prompts"), where)
        _get(results, ("sets", s, "untuned"), where)
    for method in methods("", 1, {}):
        for key in ("label", "with_lookup", "shape", "verified_nodes"):
            _get(results, ("methods", method, key), where)
        for s in results["sets"]:
            for figure in FIGURES:
                _get(results, ("results", method, "sets", s, figure), where)
            _get(results, ("results", method, "sets", s, "same_as_ar"), where)
        if _get(results, ("results", method, "mean", "over"), where):
            for figure in FIGURES:
                _get(results, ("results", method, "mean", figure), where)


def _table(results: dict, figure: str) -> list[str]:
    sets = results["sets"]
    tuned = [s for s in sets if not sets[s]["untuned"]]
    untuned = [s for s in sets if sets[s]["untuned"]]
    mean_over = results["results"]["drafter_chain"]["mean"]["over"]
    head = ["method", "alone / with lookup", "chain / tree", "verified nodes per round"]
    head += [f"{set_name(s)} ({sets[s]['prompts']})" for s in tuned]
    head += [f"mean of {', '.join(set_name(s) for s in mean_over)}"] if mean_over else []
    head += [f"{set_name(s)} ({sets[s]['prompts']}), untuned" for s in untuned]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, m in results["methods"].items():
        got = results["results"][method]
        cells = [m["label"], m["with_lookup"], m["shape"], str(m["verified_nodes"])]
        cells += [f"{got['sets'][s][figure]:.2f}" for s in tuned]
        cells += [f"**{got['mean'][figure]:.2f}**"] if mean_over else []
        cells += [f"{got['sets'][s][figure]:.2f}" for s in untuned]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _overrides(sets: list[str]) -> str:
    return f" `{' '.join(sets)}`" if sets else ""


def render(*, results: dict, results_path: str, drafter: dict, drafter_path: str, trainable: int | None,
           recipe_path: str, card_stage: str, eval_stage: str, drafter_stage: str, lineage: list[dict]) -> str:
    """The README.md text. `results`: the eval stage's JSON (checked: every figure shown must be there);
    `drafter`: the drafter's drafter.json; `lineage`: the train stages that made it, oldest first, each
    {name, config, set, steps, schedule_steps (when it was stopped early), lr, batch_size, snapshot, init_from,
    data: [{name, config, set, examples, response_tokens, teacher_forced}]}, their figures read from the stages'
    outputs."""
    check_results(results, results_path)
    s, measured, nodes = results["settings"], results["measured"], results["settings"]["nodes"]
    tree = ", ".join(f"{k}={v}" for k, v in s["tree"].items())
    untuned = [set_name(x) for x, v in results["sets"].items() if v["untuned"]]
    lines = [
        f"# {results['drafter']['kind']} drafter for {s['model']}",
        "",
        f"This card is generated, never edited by hand: `specdec recipe {recipe_path} --only {card_stage}` renders "
        f"it from the evaluation in `{results_path}` (stage `{eval_stage}`), this directory's drafter.json and the "
        "outputs of the recipe's stages. Change the recipe and run it again instead.",
        "",
        "Load it by path (the kind comes from drafter.json), as a chain or as the tree measured below:",
        "",
        f"    create_drafter(None, target, {nodes}, path=\"{drafter_path}\")",
        f"    create_drafter(None, target, {nodes}, path=\"{drafter_path}\", {tree})",
        "",
        f"## Engine tau (measured on {measured['machine']}, {measured['date']}; commit {measured.get('commit')})",
        "",
        f"{s['model']}, greedy (T = 0), {s['max_new_tokens']} new tokens per prompt, batch {s['batch_size']}, every "
        f"drafted node verified (fixed width): every row verifies at most {nodes} drafted nodes per round. tau = "
        "tokens committed per target verification round (the bonus token counted). The drafter runs **alone** "
        "(no prompt lookup beside it); n-gram and suffix decoding are the lookup drafters at the same verified "
        "nodes, in the same run. Counts, not timings: the same on any machine.",
        "",
        *_table(results, "tau"),
        "",
        "First draft accepted (the share of rounds whose first drafted token the target accepted), same runs:",
        "",
        *_table(results, "first_accept"),
        "",
    ]
    differ = [f"{results['methods'][m]['label']} ({results['methods'][m]['shape']}) on {set_name(x)}"
              for m, got in results["results"].items() for x, v in got["sets"].items() if not v["same_as_ar"]]
    lines.append("Every output equals AR's token for token." if not differ else
                 "**Outputs that differ from AR's** (float near-ties, or a bug): " + "; ".join(differ) + ".")
    if untuned:
        lines.append(f"Untuned: {', '.join(untuned)}: prompts no stage of the recipe trained on and no choice was "
                     "tuned on; the other sets are the ones drafters were developed and compared on.")
    target = drafter.get("target", {})
    lines += ["", "## The drafter", "",
              f"- {drafter['drafter']}, for {target.get('name', s['model'])} (hidden size {target.get('hidden_size')}, "
              f"{target.get('num_layers')} layers, vocabulary {target.get('vocab_size')}).",
              "- Settings (drafter.json): " + ", ".join(f"{k} {v}" for k, v in drafter.get("config", {}).items()) + "."]
    snap = drafter.get("snapshot")
    if snap:
        lines.append(f"- Weights: step {snap.get('step')} of stage `{drafter_stage}` ({snap.get('source')}).")
    if trainable:
        lines.append(f"- {trainable:,} trainable parameters.")
    lines += ["", "## How it was made", "",
              f"`specdec recipe {recipe_path}` runs the stages in order, a training stage continuing the drafter "
              "of the stage its `init_from` names (the last column; scratch: none); it resumes an interrupted stage "
              "and skips finished ones (docs/TRAINING.md, \"The recipe\"). The training stages that made this "
              "drafter:", "",
              "| stage | config (overrides) | data | steps, lr, batch | from |", "|---|---|---|---|---|"]
    total = 0
    for job in lineage:
        cells = []
        for d in job["data"]:
            total += int(d["response_tokens"])
            cells.append(f"`{d['name']}` (`{d['config']}`{_overrides(d['set'])}): {d['examples']:,} examples, "
                         f"{d['response_tokens']:,} response tokens"
                         + (f", {d['teacher_forced']:,} teacher-forced" if d["teacher_forced"] else ""))
        steps = (f"{job['steps']} of a {job['schedule_steps']}-step schedule" if job.get("schedule_steps")
                 else str(job["steps"]))
        snap_text = ""
        if job["snapshot"]:
            snap_text = f"; drafter: step {job['snapshot']['step'] or 'final'}" + (
                ", float16" if job["snapshot"]["float16"] else "")
        lines.append(f"| `{job['name']}` | `{job['config']}`{_overrides(job['set'])} | {'; '.join(cells)} | "
                     f"{steps}, {job['lr']:g}, {job['batch_size']}{snap_text} | "
                     f"{'`' + job['init_from'] + '`' if job['init_from'] else 'scratch'} |")
    lines += ["", f"Response tokens in the lineage's data: {total:,} (a data set counted once per stage that trains "
              "on it).", ""]
    return "\n".join(lines)
