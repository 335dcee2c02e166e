"""What the benchmark scripts share: one result schema, the compared methods built from experiment configs, the
AR / speculative / transformers runs they time, and the statistics their tables print.

How the scripts are run: from the repo root, as modules,

    python -m benchmarks.bench_speculative configs/benchmarks/ngram.yaml configs/benchmarks/suffix.yaml

`benchmarks/` is a package for that (pyproject installs only specdec, drafters and experiments; it does not install
this one). `-m` puts the current directory, the repo root, first on sys.path, so a script imports the specdec of
the checkout it is run in (not another pip-installed copy) and these helpers as `benchmarks.common`, with no
sys.path edits. (`python benchmarks/bench_x.py` would put only benchmarks/ on sys.path: no `benchmarks` package.)

The result schema (`Report`): every benchmark writes `<out>/results.json` and `<out>/results.md` (default `<out>`:
runs/benchmarks/<script>/), both opening with where the figures come from: the machine (CPU model, cores), the
commit (`+dirty` with uncommitted changes to tracked files), the load average at the start and at the end, the
date and the exact command line. Timings from another machine, another load or another commit are not comparable.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from specdec.costs import cpu_model

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path("runs") / "benchmarks"


# ----------------------------------------------------------------------------------------------------------
# The result schema: provenance, JSON and Markdown
# ----------------------------------------------------------------------------------------------------------

def git_commit() -> str:
    """`git rev-parse --short HEAD` of this checkout, `+dirty` when tracked files have uncommitted changes."""
    def git(*args):
        try:
            out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    if commit is None:
        return "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces this run of `script` (its `__file__`); `argv`: the arguments `main` was
    given, None = the command line's."""
    args = list(argv) if argv is not None else sys.argv[1:]
    return shlex.join(["python", "-m", f"benchmarks.{Path(script).stem}", *args])


def provenance(script: str, argv: Sequence[str] | None) -> dict:
    """Where a benchmark's figures come from, taken at its start (`Report.write` adds the end's load)."""
    return {"benchmark": Path(script).stem, "command": command_line(script, argv),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": git_commit(),
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "jax": jax.__version__,
                        "backend": jax.default_backend()},
            "load_avg_start": load_average()}


def machine_text(meta: dict) -> str:
    m = meta["machine"]
    return f"{m['cpu']} ({m['cores']} cores, {m['backend']})"


def load_text(meta: dict) -> str:
    """`0.52 -> 1.10`: the 1-minute load average at the start and at the end."""
    def one(load):
        return "?" if not load else f"{load[0]:.2f}"
    return f"{one(meta.get('load_avg_start'))} -> {one(meta.get('load_avg_end'))}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value):
        return str(value).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(lines)


def add_output_arg(ap, script: str) -> None:
    """`--out DIR`, where `Report.write` puts results.json and results.md (default runs/benchmarks/<script>)."""
    name = Path(script).stem
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT / name,
                    help=f"where results.json and results.md go (default {DEFAULT_OUT / name})")


class Report:
    """One benchmark run's results in the shared schema: `results.json` = {"meta": provenance, "tables": [{title,
    header, rows, note} or {title, markdown}], "results": the script's own data} and `results.md` = the provenance
    lines, then each table.

        report = Report(__file__, argv, args.out)     # at the start: the load average before any work
        report.table("Decode step", ["batch", "ms"], [[1, 12.3]], note="median of 300 steps")
        report.write({"rows": rows})                   # at the end: the load average after it
    """

    def __init__(self, script: str, argv: Sequence[str] | None, out: str | Path | None, title: str | None = None):
        self.meta = provenance(script, argv)
        self.out = Path(out) if out is not None else None
        self.title = title or self.meta["benchmark"]
        self.tables: list[dict] = []
        self._t0 = time.time()

    def table(self, title: str, header: Sequence[str], rows: Sequence[Sequence[Any]], note: str = "",
              echo: bool = True) -> str:
        """Adds a table (also printed unless `echo=False`); returns its Markdown."""
        rows = [list(r) for r in rows]
        self.tables.append({"title": title, "header": list(header), "rows": rows, "note": note})
        text = markdown_table(header, rows)
        if echo:
            print(f"\n{title}" + (f" ({note})" if note else "") + f"\n\n{text}", flush=True)
        return text

    def section(self, title: str, markdown: str, echo: bool = True) -> None:
        """Adds Markdown made elsewhere (e.g. a library's report) as a section of its own."""
        self.tables.append({"title": title, "markdown": markdown})
        if echo:
            print(f"\n{title}\n\n{markdown}", flush=True)

    def header_lines(self) -> list[str]:
        m = self.meta
        return [f"- machine: {machine_text(m)}; {m['machine']['platform']}, jax {m['machine']['jax']}",
                f"- commit: {m['commit']}", f"- load average (1 min) at start -> end: {load_text(m)}",
                f"- date: {m['date']}", f"- command: `{m['command']}`"]

    def markdown(self) -> str:
        parts = [f"# {self.title}", "\n".join(self.header_lines())]
        for t in self.tables:
            if "markdown" in t:
                parts.append(f"## {t['title']}\n\n{t['markdown'].strip()}")
            else:
                parts.append(f"## {t['title']}" + (f"\n\n{t['note']}" if t["note"] else "")
                             + "\n\n" + markdown_table(t["header"], t["rows"]))
        return "\n\n".join(parts) + "\n"

    def finish(self) -> None:
        """Records the end of the measurement (load average, wall seconds); `write` calls it if not done."""
        if "load_avg_end" not in self.meta:
            self.meta["load_avg_end"] = load_average()
            self.meta["wall_seconds"] = round(time.time() - self._t0, 1)

    def write(self, results: Any = None) -> tuple[Path, Path] | None:
        """Writes results.json and results.md under `out` (made if needed); nothing when `out` is None."""
        self.finish()
        if self.out is None:
            return None
        self.out.mkdir(parents=True, exist_ok=True)
        paths = self.out / "results.json", self.out / "results.md"
        data = _finite({"meta": self.meta, "tables": self.tables, "results": results})
        paths[0].write_text(json.dumps(data, indent=2, allow_nan=False, default=_json_default) + "\n")
        paths[1].write_text(self.markdown())
        print(f"wrote {paths[0]} and {paths[1]}", flush=True)
        return paths


def _finite(value):
    """`value` with every NaN / infinite float as None (JSON has neither)."""
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_default(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


# ----------------------------------------------------------------------------------------------------------
# Timing statistics
# ----------------------------------------------------------------------------------------------------------

def median_seconds(fn, repeats: int = 3) -> float:
    """Median wall seconds of `fn()` (its result blocked on) over `repeats` calls, after one untimed warm-up
    call (compilation)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def median_interval(values, level: float = 0.9) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median of `values` (per-pass ratios): the order statistics
    (x_(k), x_(n+1-k)) of the sign test, k the largest with P(Bin(n, 1/2) < k) <= (1 - level) / 2, so the
    interval covers the true median with probability >= `level` whatever the passes' distribution. A shared
    machine's speed drifts by 10-30% between passes, so a median of a few passes alone cannot tell a 3% loss from
    noise. None when n is too small for that level (n < 5 at 0.9)."""
    x = sorted(float(v) for v in values)
    n = len(x)
    tail = (1.0 - level) / 2.0
    k, below = 0, 0.0  # below = P(Bin(n, 1/2) < k + 1)
    while k < n // 2:
        below += math.comb(n, k) / 2 ** n
        if below > tail:
            break
        k += 1
    return None if k == 0 else (x[k - 1], x[n - k])


def interval_text(interval: tuple[float, float] | None) -> str:
    """` [lo-hi]` for a `median_interval`, or "" when there is none (too few passes)."""
    return f" [{interval[0]:.2f}-{interval[1]:.2f}]" if interval else ""


# ----------------------------------------------------------------------------------------------------------
# Compared methods from experiment configs
# ----------------------------------------------------------------------------------------------------------

# The sections every compared config must agree on: the same target decoding the same prompts the same way, so
# that one AR baseline serves them all. drafter / verify / scheduler are what a method is.
SHARED_SECTIONS = ("model", "mesh", "data", "generation", "sampling")


def split_args(items: Sequence[str]) -> tuple[list[str], list[str]]:
    """Command-line positionals -> (config paths, `section.key=value` overrides): an item is an override when it
    has a '=' and is not an existing file."""
    paths, overrides = [], []
    for item in items:
        (overrides if "=" in item and not Path(item).is_file() else paths).append(item)
    return paths, overrides


def load_method_configs(paths: Sequence[str], overrides: Sequence[str] = ()) -> list[tuple[str, Any]]:
    """(name, ExperimentConfig) per compared method: a config file is one method named after the file's stem, a
    sweep file one per run (named as its runs); `overrides` apply to every one. Raises ValueError when two
    methods share a name, or when they differ in a shared section (`check_comparable`)."""
    import yaml

    from specdec.config import expand_sweep, is_sweep, load_config

    methods = []
    for path in paths:
        with open(path) as f:
            top = yaml.safe_load(f)
        if is_sweep(top):
            methods += expand_sweep(path, overrides)
        else:
            methods.append((Path(path).stem, load_config(path, overrides)))
    if not methods:
        raise ValueError("name at least one config (configs/benchmarks/*.yaml) to compare with AR")
    names = [n for n, _ in methods]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"two compared methods are both named {', '.join(dupes)}: rename a config file")
    check_comparable(methods)
    return methods


def prompt_overrides(prompts_config: str, per_source: int | None = None) -> list[str]:
    """Overrides that give a method config the prompts config's `data` and `generation.max_new_tokens`
    (`per_source`: only the first N prompts of each dataset): one prompt set for every compared method, whatever
    its own config reads (batch_scaling's and results_table's `--prompts`)."""
    from specdec.config import load_config, to_dict

    cfg = load_config(prompts_config)
    data = to_dict(cfg.data)
    if per_source is not None:
        for d in data["datasets"]:
            d["limit"], d["per_category"] = per_source, None
    return [f"data={json.dumps(data)}", f"generation.max_new_tokens={cfg.generation.max_new_tokens}"]


def method_configs_of(ap, items: Sequence[str]) -> list[tuple[str, Any]]:
    """`load_method_configs` of a benchmark's command-line positionals (`split_args`); a bad config is the
    parser's error (exit status 2, the reason printed)."""
    paths, overrides = split_args(items)
    try:
        return load_method_configs(paths, overrides)
    except ValueError as e:
        ap.error(str(e))


def _flatten(value, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out or {prefix: {}}
    if isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in value):
        out = {}
        for i, item in enumerate(value):
            out.update(_flatten(item, f"{prefix}.{i}"))
        return out or {prefix: []}
    return {prefix: value}


def check_comparable(methods: Sequence[tuple[str, Any]]) -> None:
    """Every method decodes the same prompts with the same target and settings (`SHARED_SECTIONS`), else a
    ValueError naming the first key that differs and its values."""
    from specdec.config import to_dict

    first_name, first = methods[0]
    ref = {s: _flatten(to_dict(getattr(first, s)), s) for s in SHARED_SECTIONS}
    for name, cfg in methods[1:]:
        for section in SHARED_SECTIONS:
            mine = _flatten(to_dict(getattr(cfg, section)), section)
            for key in sorted(set(ref[section]) | set(mine)):
                a, b = ref[section].get(key, "<unset>"), mine.get(key, "<unset>")
                if a != b:
                    raise ValueError(
                        f"the compared configs differ in {key}: {first_name} has {a!r}, {name} has {b!r}; every "
                        f"config of one benchmark run must share {', '.join(SHARED_SECTIONS)} (AR runs once for "
                        f"all of them): make them agree, or override the key for all ({key}=...)")


@dataclasses.dataclass
class Method:
    """A compared method as built from its config, the way `specdec run` builds it (experiments/build.py)."""
    name: str
    cfg: Any  # ExperimentConfig
    drafter: Any
    label: str  # drafter_label: the drafter and its parameters
    policy: Any  # the Policy run (effective_policy: a chain policy on a tree drafter runs as its tree form)
    scheduler: Any  # build_scheduler's scheduler
    compiled: bool | None  # speculative_generate's `compiled`, as experiments/run.py sets it

    @property
    def description(self) -> str:
        return f"{self.label} / {self.policy.name} / scheduler {self.cfg.scheduler.kind}"

    def reset(self) -> None:
        """Empties what a drafter learns from earlier outputs (suffix decoding's global corpus), so that a pass
        does not find an earlier pass's answers in it."""
        if hasattr(self.drafter, "clear_global"):
            self.drafter.clear_global()


def build_methods(methods: Sequence[tuple[str, Any]], target, log: Callable[[str], None] = print,
                  drafters: dict | None = None) -> list[Method]:
    """`Method`s for `load_method_configs`' (name, config) pairs. `drafters`: a cache of built drafters by their
    config sections (drafter + verify), so a script that rebuilds methods for another batch size loads a trained
    drafter once."""
    from experiments.build import build_drafter, build_scheduler, drafter_label, effective_policy
    from specdec.config import to_dict

    out = []
    for name, cfg in methods:
        key = json.dumps({"drafter": to_dict(cfg.drafter), "verify": to_dict(cfg.verify)}, sort_keys=True)
        if drafters is not None and key in drafters:
            drafter, params = drafters[key]
        else:
            drafter, params = build_drafter(cfg, target)
            if drafters is not None:
                drafters[key] = drafter, params
        policy, note = effective_policy(cfg.verify, drafter)
        if note:
            log(f"{name}: {note}")
        compiled = False if not cfg.generation.compiled_loop else (None if not drafter.jittable else True)
        out.append(Method(name, cfg, drafter, drafter_label(drafter, params), policy,
                          build_scheduler(cfg, target, drafter, log=log), compiled))
    return out


@dataclasses.dataclass
class Prompts:
    """The prompts of a config's `data:` section, loaded and encoded as `specdec run` does, in its batches."""
    items: list  # experiments.datasets.Prompt
    ids: dict[str, list[int]]  # prompt key -> token ids
    batches: list[list]  # plan_batches: never mixing datasets (or, `mixed`, every batch a mix)
    limits: dict[str, int] = dataclasses.field(default_factory=dict)  # prompt key -> its own max new tokens

    @property
    def datasets(self) -> list[str]:
        return list(dict.fromkeys(p.dataset for p in self.items))

    def batch_ids(self, batch) -> list[list[int]]:
        return [self.ids[p.key] for p in batch]

    def batch_limits(self, batch, default: int) -> list[int] | int:
        """Each prompt's max new tokens (`limits`), or `default` for all when none has its own."""
        return [self.limits.get(p.key, default) for p in batch] if self.limits else default


MIXED = "mixed"  # the dataset label of `load_config_prompts(mixed=True)`'s prompts


def load_config_prompts(cfg, target, mixed: bool = False, lengths: Sequence[int] = ()) -> Prompts:
    """The prompts of `cfg.data` for `target`, chat-templated as `specdec run` templates them, batched by
    `generation.batch_size` without mixing datasets. Multi-turn prompts (`turns: 2`) need the target's own
    answers first, which only `specdec run` makes: refused here.

    `mixed`: all the prompts form one set (dataset label MIXED, each prompt's category its source dataset), taken
    in turn from each source, so that every batch mixes them and a batch of all the prompts is one batch (the
    batch-scaling benchmark). `lengths`: the prompts, in that order, ask for lengths[i % len(lengths)] new tokens
    each (`Prompts.limits`), so that the rows of a batch end at different times."""
    from experiments.build import codec_for, encode_prompt
    from experiments.datasets import load_all
    from experiments.run import plan_batches

    codec = codec_for(target)
    chat = cfg.data.chat_template and codec.chat_template is not None
    items = load_all(cfg.data.datasets, chat=chat)
    if any(p.messages and any(m.get("content") is None for m in p.messages) for p in items):
        raise ValueError("data.datasets: multi-turn prompts (turns > 1) need the target's own earlier answers; "
                         "benchmark them with `specdec run`")
    if any(n < 1 for n in lengths):
        raise ValueError(f"lengths: every prompt's new tokens must be >= 1, got {list(lengths)}")
    if mixed:
        sources: dict[str, list] = {}
        for p in items:
            sources.setdefault(p.dataset, []).append(p)
        turns = itertools.zip_longest(*sources.values())
        items = [dataclasses.replace(p, dataset=MIXED, question_id=p.key, category=p.dataset)
                 for turn in turns for p in turn if p is not None]
    ids = {p.key: encode_prompt(codec, p, chat) for p in items}
    limits = {p.key: lengths[i % len(lengths)] for i, p in enumerate(items)} if lengths else {}
    return Prompts(items, ids, plan_batches(items, cfg.generation.batch_size), limits)


def decode_ar(cfg, target, batch_ids: list[list[int]], seed: int, max_new_tokens: int | list[int] | None = None):
    """(tokens, DecodeMetrics) of AR decoding of one batch, warmed up first (the same compiled programs run for 2
    tokens, untimed), so compilation is excluded. `max_new_tokens`: one limit or one per prompt (default: the
    config's)."""
    from specdec.generate import ar_metrics, generate

    limit = cfg.generation.max_new_tokens if max_new_tokens is None else max_new_tokens
    out = generate(target, batch_ids, limit, cfg.sampling.to_params(), seed=seed,
                   max_seq_len=cfg.model.max_seq_len, warmup=True)
    return out.tokens, ar_metrics(out)


def decode_method(method: Method, target, batch_ids: list[list[int]], seed: int,
                  max_new_tokens: int | list[int] | None = None):
    """(tokens, DecodeMetrics) of speculative decoding of one batch by `method`, warmed up like `decode_ar`."""
    from specdec.engine import speculative_generate

    cfg = method.cfg
    limit = cfg.generation.max_new_tokens if max_new_tokens is None else max_new_tokens
    out = speculative_generate(target, method.drafter, batch_ids, policy=method.policy,
                               max_new_tokens=limit, sampling=cfg.sampling.to_params(),
                               seed=seed, compiled=method.compiled, max_seq_len=cfg.model.max_seq_len, warmup=True,
                               scheduler=method.scheduler, verify_buckets=cfg.verify.buckets)
    return out.tokens, out.metrics


def decode_ar_refilled(cfg, target, ids: list[list[int]], batch: int, refill_rows: int, limits: list[int],
                       seed: int = 0):
    """(tokens in prompt order, DecodeMetrics) of AR decoding all of `ids` in `batch` rows refilled from the queue:
    AR's own decode step in the continuous batcher (`specdec.generate.generate_continuous`, what `specdec data`
    runs), whose loop returns to the host once `refill_rows` rows are done, as `generate_refilled`'s does, and
    whose host prefills the next prompts into them. Warmed up (its two programs compiled, untimed). Decode time:
    the loop's; prefill time: all the rest (the prefills, the host's reading of finished rows)."""
    from specdec.generate import ContinuousStats, continuous_shapes, generate_continuous
    from specdec.metrics import DecodeMetrics

    shapes = continuous_shapes(target, [len(p) for p in ids], max(limits), batch, refill_rows,
                               max_seq_len=cfg.model.max_seq_len)
    stats = ContinuousStats()
    out = dict(generate_continuous(target, ids, list(range(len(ids))), shapes, cfg.sampling.to_params(), seed, stats,
                                   warmup=True, max_new_tokens=limits))
    metrics = DecodeMetrics(new_tokens=stats.new_tokens, rounds=stats.decode_kept, accepted_draft_tokens=0,
                            proposed_draft_tokens=0, prefill_seconds=stats.seconds - stats.decode_seconds,
                            decode_seconds=stats.decode_seconds, draft_seconds=0.0,
                            verify_seconds=stats.decode_seconds,
                            batch_size=len(ids), row_steps=stats.decode_row_steps)
    return [out[i] for i in range(len(ids))], metrics


def decode_refilled(method: Method, target, ids: list[list[int]], batch: int, refill_rows: int, limits: list[int],
                    seed: int = 0):
    """(tokens in prompt order, DecodeMetrics) of `method` decoding all of `ids` in `batch` rows refilled from the
    queue (`specdec.engine.generate_refilled`), warmed up like `decode_method`."""
    from specdec.engine import generate_refilled

    cfg = method.cfg
    out = generate_refilled(target, method.drafter, ids, batch_size=batch, refill_rows=refill_rows,
                            policy=method.policy, max_new_tokens=limits, sampling=cfg.sampling.to_params(), seed=seed,
                            max_seq_len=cfg.model.max_seq_len, scheduler=method.scheduler,
                            verify_buckets=cfg.verify.buckets, warmup=True)
    return out.tokens, out.metrics


# ----------------------------------------------------------------------------------------------------------
# transformers (the peer)
# ----------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def hf_model(gguf_path: str):
    import torch
    import transformers

    path = os.path.abspath(gguf_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                              gguf_file=os.path.basename(path),
                                                              dtype=torch.float32)
    return model.eval()


def run_hf_prompt_lookup(gguf_path: str, prompts: list[list[int]], max_new: int, eos: tuple[int, ...],
                         num_tokens: int = 10, threads: int = 0) -> tuple[list[list[int]], dict]:
    """transformers' prompt lookup decoding at batch 1; tok/s over the whole generate call (prefill included).
    threads: torch intra-op threads (0 = torch's default)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    model = hf_model(gguf_path)
    kwargs = dict(do_sample=False, num_beams=1, prompt_lookup_num_tokens=num_tokens, max_new_tokens=max_new,
                  eos_token_id=list(eos) or None, pad_token_id=eos[0] if eos else 0)
    outputs, tokens, seconds = [], 0, 0.0
    with torch.no_grad():
        warm = torch.tensor([prompts[0]])
        model.generate(warm, attention_mask=torch.ones_like(warm), **{**kwargs, "max_new_tokens": 8})
        for p in prompts:
            ids = torch.tensor([p])
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            seconds += time.perf_counter() - t0
            new = out[0, ids.shape[1]:].tolist()
            outputs.append(new)
            tokens += len(new)
    return outputs, {"new_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
                     "threads": torch.get_num_threads()}
