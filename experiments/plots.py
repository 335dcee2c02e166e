"""PNG plots for runs and sweeps (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def _nan_gaps(values: Sequence) -> list[float]:
    """Undefined ratios (None or nan in a summary: no rounds, never eligible) as gaps in a plot."""
    return [v if _finite(v) else float("nan") for v in values]


def acceptance_by_position(acc: dict[str, Sequence[float]], title: str, path: Path) -> Path:
    """`DecodeMetrics.acceptance_by_position()` drawn: bars P(draft position j accepted) (survival over all
    rounds); lines P(j accepted | j proposed and j-1 accepted) and the rate at which j was proposed (below 1
    for variable-length drafts: n-gram misses, scheduler cuts, shallow tree rows)."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    survival = _nan_gaps(acc["survival"])
    pos = list(range(1, len(survival) + 1))
    ax.bar(pos, survival, color="#4C72B0", alpha=0.8, label="survival P(accept j)")
    ax.plot(pos, _nan_gaps(acc["conditional"]), "o-", color="#DD8452", label="conditional P(j | proposed, j-1)")
    ax.plot(pos, _nan_gaps(acc["proposal_rate"]), "s--", ms=3, color="#55A868", label="proposal rate P(j proposed)")
    ax.set_xlabel("draft position / tree depth j")
    ax.set_ylabel("probability")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(pos)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def by_category(categories: Sequence[str], tau: Sequence[float], ar_tps: Sequence[float],
                spec_tps: Sequence[float], title: str, path: Path) -> Path:
    """tau per category, and tokens/s per category for AR and speculative decoding."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    x = list(range(len(categories)))
    a1.bar(x, tau, color="#55A868")
    a1.set_xticks(x, categories, rotation=30, ha="right", fontsize=8)
    a1.set_ylabel("tau (tokens / round)")
    a1.set_title("acceptance length by category", fontsize=9)
    w = 0.4
    a2.bar([i - w / 2 for i in x], ar_tps, w, label="autoregressive", color="#8C8C8C")
    a2.bar([i + w / 2 for i in x], spec_tps, w, label="speculative", color="#4C72B0")
    a2.set_xticks(x, categories, rotation=30, ha="right", fontsize=8)
    a2.set_ylabel("tokens / s")
    a2.set_title("throughput by category", fontsize=9)
    a2.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points not dominated in (x, y), both higher-is-better, sorted by x."""
    idx = [i for i, (x, y) in enumerate(points) if _finite(x) and _finite(y)]
    front = [i for i in idx if not any(points[j][0] >= points[i][0] and points[j][1] >= points[i][1]
                                       and points[j] != points[i] for j in idx)]
    return sorted(front, key=lambda i: points[i][0])


def tau_vs_throughput(names: Sequence[str], tau: Sequence[float], tps: Sequence[float], path: Path, *,
                      baselines: dict[str, float] | None = None, title: str = "") -> Path:
    """Each run at (tau, tok/s); the Pareto frontier joined; AR baselines as dashed lines."""
    fig, ax = plt.subplots(figsize=(7.5, 5))
    pts = list(zip(tau, tps))
    ok = [i for i, (x, y) in enumerate(pts) if _finite(x) and _finite(y)]
    ax.scatter([pts[i][0] for i in ok], [pts[i][1] for i in ok], color="#4C72B0", zorder=3)
    for i in ok:
        ax.annotate(names[i], pts[i], fontsize=6, xytext=(3, 3), textcoords="offset points")
    front = pareto_front(pts)
    if front:
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "-", color="#C44E52", lw=1.5,
                label="Pareto frontier", zorder=2)
    for label, value in (baselines or {}).items():
        if _finite(value):
            ax.axhline(value, ls="--", lw=1, color="#8C8C8C")
            ax.text(ax.get_xlim()[0], value, f" AR {label}", fontsize=7, va="bottom", color="#555555")
    ax.set_xlabel("acceptance length tau (tokens / verification round)")
    ax.set_ylabel("throughput (tokens / s)")
    ax.set_title(title or "acceptance length vs throughput", fontsize=9)
    if front:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def acceptance_by_position_multi(curves: dict[str, dict[str, Sequence[float]]], path: Path, title: str = "") -> Path:
    """One line per run: prefix survival P(j accepted) (left) and conditional P(j accepted | j proposed and
    j-1 accepted) (right), from each run's summary `acceptance_by_position`."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for name, acc in curves.items():
        surv, cond = _nan_gaps(acc["survival"]), _nan_gaps(acc["conditional"])
        left.plot(range(1, len(surv) + 1), surv, "o-", ms=3, label=name)
        right.plot(range(1, len(cond) + 1), cond, "o-", ms=3, label=name)
    for ax, label in ((left, "P(position j accepted)"), (right, "P(j accepted | j proposed, j-1 accepted)")):
        ax.set_xlabel("draft position / tree depth j")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    left.set_ylim(0, 1.05)
    right.legend(fontsize=6, ncol=1 if len(curves) < 10 else 2)
    fig.suptitle(title or "acceptance by position", fontsize=9)
    return _save(fig, path)


def speedup_by_category(runs: dict[str, dict[str, float]], path: Path, title: str = "") -> Path:
    """Grouped bars: speedup over AR per category (x), one bar per run."""
    cats = sorted({c for per in runs.values() for c in per})
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(cats) + 3), 4.5))
    n = max(len(runs), 1)
    w = 0.8 / n
    for k, (name, per) in enumerate(runs.items()):
        ax.bar([i - 0.4 + w * (k + 0.5) for i in range(len(cats))], [per.get(c, float("nan")) for c in cats], w,
               label=name)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speedup vs AR")
    ax.set_title(title or "speedup by dataset category", fontsize=9)
    ax.legend(fontsize=6, ncol=1 if len(runs) < 10 else 2)
    return _save(fig, path)


def speedup_vs_batch(curves: dict[str, dict[int, float]], path: Path, title: str = "",
                     floor: float | None = None, dashed: dict[str, dict[int, float]] | None = None,
                     dashed_label: str = "refilled") -> Path:
    """Speedup over AR against the batch size (log-2 axis), one line per method ({method: {batch: speedup}}),
    with AR's 1.0 and, if given, the `floor` a method must not fall below. `dashed`: more curves of the same form,
    dashed, each in the colour of the method of its name (AR's: black), labelled "<name>, `dashed_label`"."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    dashed = dashed or {}
    batches = sorted({b for c in [*curves.values(), *dashed.values()] for b in c})
    colours = {"AR": "black"}
    for name, curve in curves.items():
        xs = sorted(curve)
        (line,) = ax.plot(xs, _nan_gaps([curve[b] for b in xs]), "o-", label=name)
        colours[name] = line.get_color()
    for name, curve in dashed.items():
        xs = sorted(curve)
        ax.plot(xs, _nan_gaps([curve[b] for b in xs]), "s--", color=colours.get(name), label=f"{name}, {dashed_label}")
    ax.axhline(1.0, color="black", lw=0.8, label="AR")
    if floor is not None:
        ax.axhline(floor, color="grey", lw=0.8, ls="--", label=f"{floor:g}x AR")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over AR (decode tok/s)")
    ax.set_title(title or "speculative decoding under load", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)
