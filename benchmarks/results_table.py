"""The README's results table: drafter x batch size x dataset, against AR in the same run.

    python -m benchmarks.results_table                     # the table below (METHODS x BATCH_SIZES)
    python -m benchmarks.results_table --smoke             # a check that it runs: 1 prompt per dataset, 8 tokens
    python -m benchmarks.results_table configs/benchmarks/ngram.yaml --batches 1   # another table, in runs/
    python -m benchmarks.results_table configs/benchmarks/ngram.yaml --batches 1 \\
        --prompts configs/benchmarks/untuned.yaml                # the same on prompt sets nobody tuned on

The table's rows are the methods of `METHODS` (row label -> an experiment config of configs/benchmarks/, the
configs `specdec run` and `bench_speculative` take), or the configs given; for each batch size (`--batches`) this
runs `bench_speculative`'s comparison of all the methods with the batch size overridden (AR and the methods interleaved batch by batch, warm-ups untimed, output == AR checked per
prompt), and reports per cell (method, batch, dataset): tau, the speedup over AR and how many prompts' output
equals AR's.

The prompts are the methods' own (their configs' `data`, configs/benchmarks/base.yaml's for METHODS), or with
`--prompts CONFIG` that config's `data` and `generation.max_new_tokens` for every method (e.g.
configs/benchmarks/untuned.yaml, prompt sets no setting was tuned on); the table then names that prompt set in
each dataset's column, and every cell records it (`prompt_set`).

The canonical run (the default methods and batch sizes, no overrides, --prompts, --smoke or --out) writes docs/results/results_table/results.json
and results.md and rewrites the README's table between `<!-- results-table:begin -->` and
`<!-- results-table:end -->`; every row carries the machine, the commit and the load average. Any other run
writes under runs/benchmarks/ and leaves the README alone, so a smoke test or a variant never replaces the table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import bench_speculative
from benchmarks.common import REPO, DEFAULT_OUT, Report, load_method_configs, load_text, prompt_overrides, split_args
from experiments.sweep import release_memory

# The README's table: row label -> the method's experiment config, and the batch sizes of its rows.
METHODS = {"n-gram": "ngram.yaml", "suffix": "suffix.yaml", "DSpark (shipped, 7-node tree)": "dspark_shipped.yaml",
           "hybrid": "hybrid.yaml"}
BATCH_SIZES = (1, 8)
CONFIGS = REPO / "configs" / "benchmarks"
CANONICAL_OUT = REPO / "docs" / "results" / "results_table"
README = REPO / "README.md"
BEGIN, END = "<!-- results-table:begin -->", "<!-- results-table:end -->"
DATASET_NAMES = {"mt_bench": "MT-Bench", "gsm8k": "GSM8K", "humaneval": "HumanEval", "mbpp": "MBPP"}


MAP_COUNT = Path("/proc/sys/vm/max_map_count")


def check_map_count(methods: int, needed: int = 200_000) -> None:
    """Every compiled XLA:CPU program holds memory mappings, and one process compiling each method's loop for each
    cache shape passed Linux's default limit of 65,530 (4 methods: ~38,000 mappings within batch 1; the process
    then dies in LLVM with "Unable to allocate section memory"). Says so before the run rather than after."""
    try:
        limit = int(MAP_COUNT.read_text())
    except (OSError, ValueError):
        return
    if methods >= 3 and limit < needed:
        print(f"warning: vm.max_map_count is {limit}; {methods} methods in one process may need more than that "
              f"(raise it with `sysctl -w vm.max_map_count={needed}`, or compare fewer methods per run)", flush=True)


def smoke_overrides(config: str) -> list[str]:
    """Overrides that shrink a run to a check that it works: one prompt per dataset (of `config`: a method's, or
    the `--prompts` config), 8 new tokens."""
    n = len(load_method_configs([config])[0][1].data.datasets)  # a config, or a sweep's first run
    return [f"data.datasets.{i}.limit=1" for i in range(n)] + ["generation.max_new_tokens=8"]


def cells(rows: list[dict], labels: dict[str, str], prompt_set: str | None = None) -> list[dict]:
    """One cell per (method, batch, dataset) from bench_speculative's rows; `prompt_set`: the `--prompts` config's
    name (None: the methods' own prompts)."""
    out = []
    for r in rows:
        if r["method"] == bench_speculative.AR:
            continue
        ar = next(a for a in rows if a["method"] == bench_speculative.AR and a["dataset"] == r["dataset"])
        out.append({"method": labels.get(r["method"], r["method"]), "config": r["method"], "batch": r["batch"],
                    "dataset": r["dataset"], "prompt_set": prompt_set, "prompts": r["prompts"], "tau": r["tau"], "speedup": r["speedup"],
                    "speedup_interval": r["speedup_interval"], "same_as_ar": r["same_as_ar"], "tok_s": r["tok_s"],
                    "ar_tok_s": ar["tok_s"], "description": r["description"]})
    return out


def cell_text(c: dict) -> str:
    same = "n/a" if c["same_as_ar"] is None else "{}/{}".format(*c["same_as_ar"])
    return f"{c['tau']:.2f} · {c['speedup']:.2f}x · {same}"


def column_name(prompt_set: str | None, dataset: str) -> str:
    """A dataset's column: its name, and the prompt set it was taken from unless it is the methods' own."""
    name = DATASET_NAMES.get(dataset, dataset)
    return f"{name}: tau · speedup · = AR" if prompt_set is None else f"{name} ({prompt_set}): tau · speedup · = AR"


def table_rows(all_cells: list[dict], meta: dict) -> tuple[list[str], list[list]]:
    """The README's table: one row per (method, batch), a column per (prompt set, dataset), then machine, commit
    and load."""
    datasets = list(dict.fromkeys((c.get("prompt_set"), c["dataset"]) for c in all_cells))
    header = ["drafter", "batch", *(column_name(*d) for d in datasets), "machine", "commit", "load avg"]
    m = meta["machine"]
    machine = f"{m['cpu']}, {m['cores']} cores"
    rows = []
    for key in dict.fromkeys((c["method"], c["batch"]) for c in all_cells):
        by_dataset = {(c.get("prompt_set"), c["dataset"]): c for c in all_cells if (c["method"], c["batch"]) == key}
        rows.append([key[0], key[1], *(cell_text(by_dataset[d]) if d in by_dataset else "-" for d in datasets),
                     machine, meta["commit"], load_text(meta)])
    return header, rows


def rewrite_readme(readme: Path, block: str) -> None:
    """Replaces what lies between the README's results-table markers with `block`."""
    text = readme.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{readme}: expected one {BEGIN} ... {END} pair around the results table")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    readme.write_text(f"{head}{BEGIN}\n{block.strip()}\n{END}{tail}")
    print(f"rewrote the results table in {readme}", flush=True)


def method_paths(paths) -> dict[str, str]:
    """{label: config path} of the compared methods: the configs given (labelled by their stems), else METHODS."""
    return ({Path(p).stem: str(Path(p).resolve()) for p in paths} if paths
            else {label: str(CONFIGS / name) for label, name in METHODS.items()})


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("items", nargs="*", metavar="CONFIG.yaml | section.key=value",
                    help="the methods' experiment configs (default: METHODS, configs/benchmarks/) and overrides "
                         "applied to every config")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCH_SIZES), help="batch sizes, one row each")
    ap.add_argument("--repeats", type=int, default=1, help="passes over the prompts (the speedup is their median)")
    ap.add_argument("--prompts", metavar="CONFIG", help="a config whose data and generation.max_new_tokens every "
                    "method runs with (e.g. configs/benchmarks/untuned.yaml; default: the methods' own)")
    ap.add_argument("--smoke", action="store_true", help="1 prompt per dataset and 8 new tokens: checks that it runs")
    ap.add_argument("--out", type=Path, help="where results.json and results.md go (default: docs/results/"
                                             "results_table for the canonical run, else runs/benchmarks/results_table)")
    args = ap.parse_args(argv)
    paths, overrides = split_args(args.items)
    if any(b < 1 for b in args.batches) or args.repeats < 1:
        ap.error(f"--batches and --repeats must be >= 1, got {args.batches} and {args.repeats}")
    canonical = (not paths and not overrides and not args.smoke and args.out is None and args.prompts is None
                 and tuple(args.batches) == BATCH_SIZES and args.repeats == 1)
    methods = method_paths(paths)
    prompt_set = None if args.prompts is None else Path(args.prompts).stem
    table = {"methods": methods, "batch_sizes": args.batches, "repeats": args.repeats, "prompts": args.prompts}
    try:
        labels = {Path(cfg).stem: label for label, cfg in table["methods"].items()}
        configs = list(table["methods"].values())
        if args.smoke:
            overrides = smoke_overrides(args.prompts or configs[0]) + overrides
        if args.prompts is not None:
            overrides = prompt_overrides(args.prompts) + overrides
        compared = load_method_configs(configs, overrides)  # fail now, not after the first batch size
    except ValueError as e:
        ap.error(str(e))
    check_map_count(len(compared))  # a sweep file is one method per run
    out = args.out or (CANONICAL_OUT if canonical else DEFAULT_OUT / ("results_table_smoke" if args.smoke
                                                                      else "results_table"))
    report = Report(__file__, argv, out, title="Results table")
    target, drafters, all_cells, results = None, {}, [], {}
    for batch in table["batch_sizes"]:
        method_configs = load_method_configs(configs, [*overrides, f"generation.batch_size={batch}"])
        if target is None:
            from experiments.build import build_target

            cfg = method_configs[0][1]
            target = build_target(cfg.model, cfg.mesh)
        result = bench_speculative.compare(method_configs, table["repeats"], target=target, drafters=drafters)
        results[f"batch_{batch}"] = result
        all_cells += cells(result["rows"], labels, prompt_set)
        release_memory()  # this batch size's programs and freed buffers (benchmarks/batch_scaling.py)
    report.finish()
    header, rows = table_rows(all_cells, report.meta)
    cfg = load_method_configs(configs, overrides)[0][1]
    note = (f"{cfg.generation.max_new_tokens} new tokens, temperature {cfg.sampling.temperature:g}, "
            f"{table['repeats']} pass(es); each cell: tau (tokens per target step) · speedup over AR (decode time "
            "per token, same run) · prompts whose output equals AR's"
            + ("" if args.prompts is None else f"; prompts: {args.prompts} ({prompt_set})"))
    markdown = report.table("Speculative decoding vs AR", header, rows, note=note)
    report.table("Methods", ["drafter", "config", "drafter / policy / scheduler"],
                 [[label, Path(path).relative_to(REPO) if Path(path).is_relative_to(REPO) else path,
                   next((c["description"] for c in all_cells if c["method"] == label), "-")]
                  for label, path in table["methods"].items()], echo=False)
    report.write({"cells": all_cells, "runs": results, "prompts": args.prompts})
    if canonical:
        rewrite_readme(README, f"{note}.\n\n{markdown}\n\nCommand: `{report.meta['command']}` "
                               f"({report.meta['date'][:10]}; details in docs/results/results_table/results.md).")
    else:
        print("not the canonical run (configs, overrides, --prompts, --batches, --repeats, --smoke or --out given): "
              "README.md left as it is", flush=True)
    return {"cells": all_cells}


if __name__ == "__main__":
    main()
