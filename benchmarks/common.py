"""What several benchmark scripts share: the evaluation prompts, drafter specs, the AR / speculative / transformers
runs they compare, a median timer, and how a script records itself and writes its JSON.

How the scripts are run: from the repo root, as modules,

    python -m benchmarks.bench_speculative --n 8

`benchmarks/` is a package for that (pyproject installs only specdec, drafters and experiments; it does not install
this one). `-m` puts the current directory, the repo root, first on sys.path, so a script imports the specdec of
the checkout it is run in (not another pip-installed copy) and these helpers as `benchmarks.common`, with no
sys.path edits. (`python benchmarks/bench_x.py` would put only benchmarks/ on sys.path: no `benchmarks` package.)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

from specdec.adaptive import AdaptiveWidth
from specdec.engine import speculative_generate
from specdec.generate import ar_metrics, generate
from specdec.metrics import merge
from specdec.prompts import builtin
from specdec.sampling import GREEDY
from specdec.target import Target

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = Path(os.environ.get("SPECDEC_DATA", REPO.parent / "shared" / "data"))
SUBSETS = ("mt_bench", "gsm8k", "humaneval")
# The quickstart's built-in prompts, one subset per kind (chat, code, math, rewrite, summarise): `quickstart-rewrite`.
QUICKSTART_SUBSETS = tuple(f"quickstart-{kind}" for kind in dict.fromkeys(k for k, _ in builtin("quickstart")))
DEFAULT_POLICY = {"chain": "greedy_chain", "tree": "greedy_tree"}
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole function in a Python "
                         "code block.\n\n```python\n{prompt}```")


# ----------------------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------------------

def _jsonl(path: Path, n: int) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if len(rows) == n:
                break
    return rows


def load_prompts(subset: str, n: int, data: Path) -> list[str]:
    """The first n user messages of a subset (MT-Bench: first turn only; `quickstart-<kind>`: the built-in prompts
    of that kind, which need no data folder)."""
    if subset in QUICKSTART_SUBSETS:
        kind = subset.removeprefix("quickstart-")
        return [text for k, text in builtin("quickstart") if k == kind][:n]
    if subset == "mt_bench":
        return [r["turns"][0] for r in _jsonl(data / "mt_bench" / "question.jsonl", n)]
    if subset == "gsm8k":
        return [r["question"] for r in _jsonl(data / "gsm8k" / "test.jsonl", n)]
    if subset == "humaneval":
        return [HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"])
                for r in _jsonl(data / "humaneval" / "HumanEval.jsonl", n)]
    raise ValueError(f"unknown subset {subset!r}; choose from {', '.join(SUBSETS + QUICKSTART_SUBSETS)}")


# ----------------------------------------------------------------------------------------------------------
# Drafter specs
# ----------------------------------------------------------------------------------------------------------

def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    name: str
    k: int
    policy: str | None
    params: tuple[tuple[str, object], ...]
    buckets: object = None  # the engine's verify_buckets ("auto" or node counts joined by '/'); None = off
    scheduler: str | None = None  # "adaptive": the adaptive verify width (specdec/adaptive.py); None = fixed
    # the adaptive width's options (fields of AdaptiveWidth, e.g. explore_every, margin, calibration_weight)
    scheduler_options: tuple[tuple[str, object], ...] = ()

    SCHEDULER_ALIASES = {"explore": "explore_every"}

    @classmethod
    def parse(cls, text: str) -> "DrafterSpec":
        """`name[:key=value,...]`; k = num_draft_tokens (default 5), policy = verification policy, buckets =
        verify widths (`auto`, or node counts like 0/1/3), scheduler = `adaptive` or `fixed`; with
        scheduler=adaptive, any AdaptiveWidth field sets that option (`explore` = explore_every), e.g.
        `scheduler=adaptive,explore=8,calibration_weight=0`. Every other key is a drafter parameter."""
        name, _, rest = text.partition(":")
        opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
        k = int(opts.pop("k", 5))
        policy = opts.pop("policy", None)
        buckets = opts.pop("buckets", None)
        if buckets not in (None, "auto"):
            buckets = tuple(int(w) for w in buckets.split("/"))
        scheduler = opts.pop("scheduler", None)
        if scheduler not in (None, "fixed", "adaptive"):
            raise ValueError(f"{text}: scheduler must be 'adaptive' or 'fixed', got {scheduler!r}")
        fields = {f.name for f in dataclasses.fields(AdaptiveWidth)} - {"costs", "cost_path"}
        sched_opts = {cls.SCHEDULER_ALIASES.get(key, key): _value(opts.pop(key))
                      for key in list(opts) if cls.SCHEDULER_ALIASES.get(key, key) in fields}
        if sched_opts and scheduler != "adaptive":
            raise ValueError(f"{text}: {', '.join(sorted(sched_opts))} are options of scheduler=adaptive")
        return cls(name, k, policy, tuple(sorted((key, _value(v)) for key, v in opts.items())), buckets,
                   None if scheduler == "fixed" else scheduler, tuple(sorted(sched_opts.items())))

    def policy_for(self, drafter) -> str:
        """The verification policy this spec names, or the greedy one for the drafter's kind (chain / tree)."""
        return self.policy or DEFAULT_POLICY[drafter.kind]

    def make_scheduler(self):
        return AdaptiveWidth(**dict(self.scheduler_options)) if self.scheduler else None

    @property
    def label(self) -> str:
        extra = "".join(f",{k}={v}" for k, v in self.params)
        if self.buckets is not None:
            extra += f",buckets={self.buckets if isinstance(self.buckets, str) else '/'.join(map(str, self.buckets))}"
        if self.scheduler:
            extra += f",{self.scheduler}"
        extra += "".join(f",{k}={v}" for k, v in self.scheduler_options)
        return f"{self.name}(k={self.k}{extra})"


# ----------------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------------

def groups_of(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    return [prompts[i:i + batch] for i in range(0, len(prompts), batch)]


def run_ar(target: Target, groups, max_new: int):
    """AR on each group; `warmup=True` first runs the same compiled programs for 2 tokens (untimed)."""
    outs = [generate(target, g, max_new_tokens=max_new, sampling=GREEDY, warmup=True) for g in groups]
    tokens = [row for o in outs for row in o.tokens]
    return tokens, merge([ar_metrics(o) for o in outs])


def run_spec(target: Target, drafter, policy: str, groups, max_new: int, buckets=None, scheduler=None,
             clear: bool = True):
    """The drafter on each group, warmed up like `run_ar`. The suffix drafter starts with an empty global
    corpus unless `clear=False` (it does not keep the 2-token warm-up outputs, see drafters/suffix.py)."""
    if clear and hasattr(drafter, "clear_global"):
        drafter.clear_global()
    outs = [speculative_generate(target, drafter, g, policy=policy, max_new_tokens=max_new, sampling=GREEDY,
                                 warmup=True, verify_buckets=buckets,
                                 scheduler=scheduler) for g in groups]
    tokens = [row for o in outs for row in o.tokens]
    return tokens, merge([o.metrics for o in outs])


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


# ----------------------------------------------------------------------------------------------------------
# Timing and output
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
    interval covers the true median with probability >= `level` whatever the passes' distribution. This VM's
    speed drifts by 10-30% between passes, so a median of a few passes alone cannot tell a 3% loss from noise.
    None when n is too small for that level (n < 5 at 0.9)."""
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


def command_line(script: str, argv: list[str] | None) -> str:
    """The command that reproduces this run of `script` (its `__file__`), for the JSON summary; `argv`: the
    arguments `main` was given, None = the command line's."""
    return " ".join(["python", "-m", f"benchmarks.{Path(script).stem}"] + (argv if argv is not None else sys.argv[1:]))


def write_json(path: str | None, summary) -> None:
    """A benchmark's JSON summary (`--json OUT`; parent folders made; nothing when path is None)."""
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"wrote {path}")
