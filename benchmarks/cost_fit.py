"""The cost model's check: the round costs that timed adaptive runs imply, beside the profile they ran with.

The adaptive verify width chooses each round's width from round costs measured on this machine (C(W) per verify
width W, and the cost a draft adds to a round that verifies nothing). `fit_round_costs` asks the other way
round: which costs explain the decode seconds that the timed calls actually took? `bench_speculative` prints the
fit under each adaptive row (`fit_line`); fitted ratios within their errors of the profile's mean the widths
were chosen on true prices.
"""

from __future__ import annotations

import numpy as np


def fit_round_costs(runs) -> dict | None:
    """The round costs that timed runs imply, beside the profile they ran with: a check of the cost model.

    Least squares of each run's decode seconds, in units of its own C(0) (a warmed-up run rescales the profile to
    the machine's speed), on its loop iterations per verify width and its drafted iterations that verified
    nothing. `runs`: DecodeMetrics of adaptive runs with one set of verify widths, one per call (merged runs mix
    their rescalings). Returns None with no more runs than unknowns, else {"ratios" / "ratios_stderr": fitted
    C(W) over the profile's C(0) per width (the first: the plain round's; None for a width no run chose),
    "draft" / "draft_stderr": the fitted cost a drafted round that verifies nothing adds, over the profile's
    C(0) (None if none did, or if every width-0 round drafted: then C(0) includes it), "profile_ratios",
    "profile_draft", "runs"}. Every figure is in the unit the seconds were divided by, the profile's C(0), never
    the fitted C(0): where the runs hold few plain rounds (GSM8K: ~2 per call) that one is barely determined, and
    dividing by it can turn the ratios negative."""
    runs = [m for m in runs if m.width_rounds and m.round_costs]
    if not runs:
        return None
    if len({tuple(m.verify_widths) for m in runs}) != 1:
        raise ValueError("fit_round_costs: the runs have different verify widths; fit each set apart")
    counts = np.asarray([[*m.width_rounds, m.width_rounds[0] - m.skipped_drafts] for m in runs], float)
    seconds = np.asarray([m.decode_seconds / m.round_costs[0] for m in runs])
    cols = np.flatnonzero(counts.sum(axis=0) > 0)
    if np.linalg.matrix_rank(counts[:, cols]) < len(cols):  # a drafter that drafted every round:
        cols = cols[cols < counts.shape[1] - 1]  # its unverified drafts are its width-0 rounds, priced as those
    if counts[:, 0].sum() == 0 or len(runs) <= len(cols):
        return None
    x = counts[:, cols]
    sol = np.linalg.lstsq(x, seconds, rcond=None)[0]
    resid = seconds - x @ sol
    variance = np.diag(resid @ resid / (len(runs) - len(cols)) * np.linalg.pinv(x.T @ x))
    stderr = np.sqrt(np.maximum(variance, 0.0))  # a nearly collinear fit can round a variance below 0
    fitted, err = [None] * counts.shape[1], [None] * counts.shape[1]
    for i, c in enumerate(cols):
        fitted[c], err[c] = float(sol[i]), float(stderr[i])
    profile = runs[0]
    return {"ratios": fitted[:-1], "ratios_stderr": err[:-1], "draft": fitted[-1],
            "draft_stderr": err[-1], "profile_ratios": [c / profile.round_costs[0] for c in profile.round_costs],
            "profile_draft": (profile.draft_cost or 0.0) / profile.round_costs[0], "runs": len(runs)}


def fit_line(fit: dict) -> str:
    """A `fit_round_costs` result in one line: the costs the timed calls imply against the profile they ran with,
    as multiples of the profile's plain round."""
    def ratio(value, err):
        return "-" if value is None else f"{value:.2f}+-{err:.2f}"
    fitted = " / ".join(ratio(v, e) for v, e in zip(fit["ratios"], fit["ratios_stderr"]))
    profile = " / ".join(f"{v:.2f}" for v in fit["profile_ratios"])
    return (f"round costs by width over the profile's C(0), fitted on {fit['runs']} calls: {fitted} (profile "
            f"{profile}); a draft not verified {ratio(fit['draft'], fit['draft_stderr'])} (profile "
            f"{fit['profile_draft']:.2f})")
