"""The losslessness check every run performs, and its loud failure.

- Greedy decoding (temperature 0): speculative output must equal autoregressive output token for token. The
  run compares every prompt that has both outputs (at least `eval.lossless_check.samples`; when the AR
  baseline is off, AR is run on that many prompts just for the check).
- Sampling (temperature > 0): outputs differ run to run, so the check is statistical. For each of a few
  prompts, the prompt is replicated across batches of up to 32 rows and the first `prefix` (3) new tokens are
  drawn `rows` times by AR and by speculative decoding (independent seeds; each batch prefills the prompt
  once). Token 0 comes from the prefill in both; for each later position j (1, 2: produced by the first
  speculative rounds) the two empirical distributions of the token at j are compared with a two-sample
  chi-square test of homogeneity (tokens whose combined count is below 10, i.e. expected count below 5, are
  pooled into one cell). The check fails when any test's p-value is below alpha / number of tests
  (Bonferroni; alpha = 1e-3, so a correct engine fails about one run in a thousand). Power: it detects
  probability mass moved between likely tokens; with few rows and high-entropy outputs most tokens pool into
  one cell and the test is weak (each test reports its `cells`). The exact distributional tests of every
  policy live in tests/test_lossless_policies.py.
- Lossy policies (typical acceptance) skip the check, labelled as such.

A failed check raises `LosslessError` (after the run has recorded the result in its summary).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Hashable, Sequence

DEFAULT_ALPHA = 1e-3
DEFAULT_ROWS = 128
DEFAULT_PREFIX = 3  # the prefill token + two tokens produced by speculative rounds
# Rows are drawn this many at a time: the check's peak memory is that of a batch of 32 (at 128 rows in one batch,
# SmolLM2's KV caches, verify logits and a DSpark's context features took ~6.5 GB on top of the run's 2 GB).
CHUNK_ROWS = 32


class LosslessError(AssertionError):
    """Speculative decoding changed the output (greedy) or its distribution (sampled)."""


@dataclasses.dataclass
class LosslessResult:
    kind: str  # "greedy" | "sampled" | "skipped"
    passed: bool | None  # None when skipped
    prompts_checked: int = 0
    note: str = ""
    mismatches: list[dict] = dataclasses.field(default_factory=list)  # greedy: where outputs diverge
    tests: list[dict] = dataclasses.field(default_factory=list)  # sampled: one chi-square test per prompt and position
    alpha: float | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def raise_if_failed(self) -> None:
        if self.passed is False:
            raise LosslessError("LOSSLESS CHECK FAILED: " + self.describe())

    def describe(self) -> str:
        if self.kind == "skipped":
            return f"skipped ({self.note})"
        if self.kind == "greedy":
            if self.passed:
                return f"greedy: speculative == AR token for token on {self.prompts_checked} prompts"
            if not self.mismatches:
                return f"greedy: FAILED ({self.note})"
            m = self.mismatches[0]
            return (f"greedy: {len(self.mismatches)} of {self.prompts_checked} prompts differ from AR; first: "
                    f"prompt {m['key']} at new token {m['position']} (AR {m['ar']} vs speculative {m['spec']})")
        worst = min(self.tests, key=lambda t: t["p_value"]) if self.tests else None
        if worst is None:
            return "sampled: no prompts"
        verdict = "consistent with" if self.passed else "DIFFERS from"
        return (f"sampled: the distribution of new tokens 1-{max(t['position'] for t in self.tests)} is {verdict} "
                f"AR on {self.prompts_checked} prompts x {worst['rows']} samples (two-sample chi-square, "
                f"{len(self.tests)} tests, alpha={self.alpha:g} Bonferroni; smallest p={worst['p_value']:.3g} at "
                f"prompt {worst['key']} token {worst['position']})")


def skipped(note: str) -> LosslessResult:
    return LosslessResult("skipped", None, note=note)


def check_greedy(ar: dict[str, Sequence[int]], spec: dict[str, Sequence[int]], keys: Sequence[str]) -> LosslessResult:
    """Token equality of speculative vs AR outputs for `keys` (both dicts map prompt key -> new token ids)."""
    mismatches = []
    for key in keys:
        a, s = list(ar[key]), list(spec[key])
        if a != s:
            pos = next((i for i, (x, y) in enumerate(zip(a, s)) if x != y), min(len(a), len(s)))
            mismatches.append({"key": key, "position": pos, "ar": a[pos] if pos < len(a) else "<end>",
                               "spec": s[pos] if pos < len(s) else "<end>", "ar_len": len(a), "spec_len": len(s)})
    return LosslessResult("greedy", not mismatches, len(keys), mismatches=mismatches)


def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof): the regularised upper incomplete gamma function."""
    if dof <= 0:
        return 1.0
    from jax.scipy.special import gammaincc

    return float(gammaincc(dof / 2.0, max(stat, 0.0) / 2.0))


def two_sample_chi2(a: Sequence[Hashable], b: Sequence[Hashable], min_combined: int = 10) -> dict[str, Any]:
    """Chi-square test that samples `a` and `b` come from the same categorical distribution.

    Categories whose combined count is below `min_combined` are pooled into one cell (merged into the
    smallest remaining cell if the pool itself is still too small). Returns stat, dof, p_value, cells."""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    if na == 0 or nb == 0:
        raise ValueError("two_sample_chi2 needs two non-empty samples")
    cells, pool = [], [0, 0]
    for cat in set(ca) | set(cb):
        x, y = ca.get(cat, 0), cb.get(cat, 0)
        if x + y >= min_combined:
            cells.append([x, y])
        else:
            pool[0] += x
            pool[1] += y
    if sum(pool):
        if sum(pool) >= min_combined or not cells:
            cells.append(pool)
        else:
            smallest = min(cells, key=sum)
            smallest[0] += pool[0]
            smallest[1] += pool[1]
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = n * total / (na + nb)
            stat += (observed - expected) ** 2 / expected
    dof = len(cells) - 1
    return {"stat": stat, "dof": dof, "p_value": chi2_sf(stat, dof), "cells": len(cells), "n_ar": na, "n_spec": nb}


def _at(tokens: Sequence[int], j: int):
    return tokens[j] if j < len(tokens) else "<ended>"  # a row that stopped at EOS earlier


def check_sampled(target, drafter, prompts: dict[str, Sequence[int]], *, policy, sampling,
                  rows: int = DEFAULT_ROWS, prefix: int = DEFAULT_PREFIX, seed: int = 0,
                  alpha: float = DEFAULT_ALPHA, max_seq_len: int | None = None, scheduler=None,
                  verify_buckets=None) -> LosslessResult:
    """The statistical check for temperature > 0 (see the module docstring); `policy` (a name or a
    `specdec.verify.Policy`), `scheduler` and `verify_buckets` as in the run."""
    from specdec.engine import speculative_generate
    from specdec.generate import generate

    tests = []
    chunks = -(-rows // CHUNK_ROWS)
    for i, (key, ids) in enumerate(prompts.items()):
        ar, spec = [], []
        for c in range(chunks):  # AR seeds even, speculative seeds odd: every chunk draws afresh
            batch = [list(ids)] * min(CHUNK_ROWS, rows - c * CHUNK_ROWS)
            n = i * chunks + c
            ar += generate(target, batch, prefix, sampling, seed=seed + 2 * n, max_seq_len=max_seq_len).tokens
            spec += speculative_generate(target, drafter, batch, policy=policy, max_new_tokens=prefix,
                                         sampling=sampling, seed=seed + 2 * n + 1, max_seq_len=max_seq_len,
                                         scheduler=scheduler, verify_buckets=verify_buckets).tokens
        for j in range(1, prefix):  # position 0 comes from the prefill in both: not speculative
            result = two_sample_chi2([_at(t, j) for t in ar], [_at(t, j) for t in spec])
            tests.append({"key": key, "position": j, "rows": rows, **result})
    threshold = alpha / max(len(tests), 1)
    passed = all(t["p_value"] >= threshold for t in tests)
    return LosslessResult("sampled", passed, len(prompts), tests=tests, alpha=alpha,
                          note=f"per-test threshold alpha / {len(tests)} tests = {threshold:.3g}")
