"""Compare drafters against the AR baseline on the same prompts in the same process.

Used by the quickstart; every number in its table comes from one run: AR and each drafter decode the same
token-id prompts, compile time excluded by a warm-up (once per compiled shape), and greedy outputs are checked
token for token against AR.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from drafters import create_drafter
from specdec.engine import speculative_generate
from specdec.generate import ar_metrics, cache_capacity, generate, pad_prompts
from specdec.metrics import DecodeMetrics, merge, speedup
from specdec.sampling import GREEDY, SamplingParams
from specdec.target import Target


@dataclasses.dataclass
class DrafterSpec:
    name: str
    num_draft_tokens: int = 5
    params: dict = dataclasses.field(default_factory=dict)
    policy: str = "greedy_chain"
    label: str = ""
    buckets: object = None  # the engine's verify_buckets ("auto" / node counts); None: always verify all k + 1
    scheduler: object = None  # e.g. specdec.adaptive.AdaptiveWidth(); None: verify every drafted token

    @property
    def title(self) -> str:
        if self.label:
            return self.label
        extra = ",".join(f"{k}={v}" for k, v in self.params.items())
        if self.buckets is not None:
            extra += f"{',' if extra else ''}buckets={self.buckets}"
        if self.scheduler is not None:
            extra += f"{',' if extra else ''}{self.scheduler.kind}"
        return f"{self.name}(k={self.num_draft_tokens}{',' + extra if extra else ''})"


@dataclasses.dataclass
class Row:
    method: str
    policy: str
    metrics: DecodeMetrics
    speedup: float
    matches_ar: bool | None  # greedy: token equality with AR; None when sampling (checked statistically)
    outputs: list[list[int]]
    per_batch: list[DecodeMetrics] = dataclasses.field(default_factory=list)  # one per batch of prompts


def first_of_shape(batches, max_new_tokens: int, extra: int = 0) -> list[bool]:
    """Per batch of token-id prompts, whether it is the first with its compiled shapes (padded prompt width, batch
    size, cache capacity): only those need a warm-up, since every later batch of the same shapes runs the very
    programs the first one compiled."""
    seen, first = set(), []
    for batch in batches:
        lengths = [len(p) for p in batch]
        shape = (pad_prompts(batch, 0)[0].shape, cache_capacity(lengths, max_new_tokens, extra=extra))
        first.append(shape not in seen)
        seen.add(shape)
    return first


def run_ar(target: Target, prompts, max_new_tokens, sampling, batch_size=1):
    outputs, metrics = [], []
    batches = [prompts[start:start + batch_size] for start in range(0, len(prompts), batch_size)]
    for batch, warmup in zip(batches, first_of_shape(batches, max_new_tokens)):
        out = generate(target, batch, max_new_tokens, sampling, warmup=warmup)
        outputs += out.tokens
        metrics.append(ar_metrics(out))
    return outputs, metrics


def run_drafter(target: Target, spec: DrafterSpec, prompts, max_new_tokens, sampling, batch_size=1,
                compiled=None, drafter=None):
    drafter = drafter or create_drafter(spec.name, target, spec.num_draft_tokens, **spec.params)
    outputs, metrics = [], []
    batches = [prompts[start:start + batch_size] for start in range(0, len(prompts), batch_size)]
    for batch, warmup in zip(batches, first_of_shape(batches, max_new_tokens, extra=drafter.num_draft_tokens + 1)):
        out = speculative_generate(target, drafter, batch, policy=spec.policy,
                                   max_new_tokens=max_new_tokens, sampling=sampling, compiled=compiled,
                                   warmup=warmup, verify_buckets=spec.buckets, scheduler=spec.scheduler)
        outputs += out.tokens
        metrics.append(out.metrics)
    return outputs, metrics


def compare(target: Target, prompts: Sequence[Sequence[int]], specs: Sequence[DrafterSpec], *,
            max_new_tokens: int = 64, sampling: SamplingParams = GREEDY, batch_size: int = 1,
            progress=None) -> list[Row]:
    prompts = [list(p) for p in prompts]
    ar_out, ar_batches = run_ar(target, prompts, max_new_tokens, sampling, batch_size)
    ar = merge(ar_batches)
    rows = [Row("autoregressive", "-", ar, 1.0, True if sampling.greedy else None, ar_out, ar_batches)]
    if progress:
        progress(rows[-1])
    for spec in specs:
        out, batches = run_drafter(target, spec, prompts, max_new_tokens, sampling, batch_size)
        m = merge(batches)
        rows.append(Row(spec.title, spec.policy, m, speedup(ar, m), (out == ar_out) if sampling.greedy else None,
                        out, batches))
        if progress:
            progress(rows[-1])
    return rows


def table(rows: list[Row]) -> str:
    """A markdown table: the one researchers paste into notes."""
    lines = ["| method | policy | tau | accept rate | tok/s | speedup vs AR | predicted tok/s | output == AR |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r.metrics
        rate = "-" if r.method == "autoregressive" else f"{m.acceptance_rate:.2f}"
        same = {True: "yes", False: "NO", None: "n/a (sampled)"}[r.matches_ar]
        predicted = f"{m.predicted_tokens_per_second:.1f}" if m.predicted_seconds else "-"
        lines.append(f"| {r.method} | {r.policy} | {m.tau:.2f} | {rate} | {m.tokens_per_second:.1f} | "
                     f"{r.speedup:.2f}x | {predicted} | {same} |")
    return "\n".join(lines)


def category_table(rows: list[Row], categories: Sequence[str]) -> str:
    """Speedup vs AR (tau) per prompt category and method, from the per-batch metrics of `compare` run at
    batch size 1 (`categories[i]` is prompt i's); the AR row gives tok/s."""
    if any(len(r.per_batch) != len(categories) for r in rows):
        raise ValueError("category_table needs compare() at batch_size=1 (one metrics record per prompt)")
    kinds = list(dict.fromkeys(categories))
    lines = ["| kind | AR tok/s | " + " | ".join(r.method for r in rows[1:]) + " |",
             "|---" * (len(rows) + 1) + "|"]
    for kind in kinds:
        idx = [i for i, c in enumerate(categories) if c == kind]
        ar = merge([rows[0].per_batch[i] for i in idx])
        cells = []
        for r in rows[1:]:
            m = merge([r.per_batch[i] for i in idx])
            cells.append(f"{speedup(ar, m):.2f}x ({m.tau:.2f})")
        lines.append(f"| {kind} | {ar.tokens_per_second:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
