"""One metrics schema for every decoding run (AR and speculative), as defined in docs/METHODS.md.

tau (acceptance length) counts the bonus token: committed tokens / verification rounds. AR decoding is the
special case of one token per round. Speedup is always AR time / speculative time measured in the same
process on the same prompts (`speedup`).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class DecodeMetrics:
    new_tokens: int  # generated tokens over all rows (the first, sampled from prefill, included)
    rounds: int  # target verification rounds over all rows (row-rounds); AR: one per token after the first
    accepted_draft_tokens: int
    proposed_draft_tokens: int
    prefill_seconds: float
    decode_seconds: float  # wall time of the decode loop (compile excluded when the caller warmed up)
    draft_seconds: float | None = None  # split measured by the host-stepped loop or a profiling pass
    verify_seconds: float | None = None
    # acceptance by position j (0-based draft position / tree depth j+1), summed over row-rounds:
    position_proposed: list[int] = dataclasses.field(default_factory=list)  # a draft node at depth j+1 existed
    position_accepted: list[int] = dataclasses.field(default_factory=list)  # position j accepted and committed
    # the verdict on j was observed: a candidate at depth j+1 below the accepted path, positions < j accepted
    # (and not cut off by EOS / max_new_tokens before j's verdict was committed)
    position_eligible: list[int] = dataclasses.field(default_factory=list)
    batch_size: int = 1
    # rows x loop iterations (AR: x decode steps): the row-rounds the batch computed, those of rows already finished
    # included (static shapes: a finished row's lane still runs until the batch's last row ends); None: unknown
    row_steps: int | None = None
    # the adaptive verify width (specdec/adaptive.py): loop iterations per verify width (draft nodes; 0 = a plain
    # decode step), how many skipped the draft, and the cost model's predicted decode time
    verify_widths: list[int] = dataclasses.field(default_factory=list)
    width_rounds: list[int] = dataclasses.field(default_factory=list)
    skipped_drafts: int = 0
    predicted_seconds: float | None = None
    # the costs it predicted with: seconds per loop iteration at each verify width, and what a draft adds
    round_costs: list[float] = dataclasses.field(default_factory=list)
    draft_cost: float | None = None
    # its acceptance model's check over the verified rounds: accepted drafts expected (uncalibrated) / realised
    expected_accepted: float | None = None
    realised_accepted: float | None = None

    @property
    def tau(self) -> float:
        """Mean tokens committed per round, bonus included (the first token from prefill excluded)."""
        committed = self.new_tokens - self.batch_size  # each row's first token comes from prefill
        return committed / self.rounds if self.rounds else float("nan")

    @property
    def idle_fraction(self) -> float:
        """The share of the batch's row-rounds spent on rows already finished (0: every row ran to the end)."""
        return 1.0 - self.rounds / self.row_steps if self.row_steps else float("nan")

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.proposed_draft_tokens if self.proposed_draft_tokens else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    @property
    def time_per_output_token_ms(self) -> float:
        return 1e3 * self.decode_seconds / self.new_tokens if self.new_tokens else float("nan")

    @property
    def predicted_tokens_per_second(self) -> float:
        """tok/s the adaptive width's cost model predicts for this run (its chosen widths x measured costs)."""
        if not self.predicted_seconds:
            return float("nan")
        return self.new_tokens / self.predicted_seconds

    def acceptance_by_position(self) -> dict[str, list]:
        """Per draft position / tree depth j (0-based), over row-rounds:

        proposed, accepted, eligible  the counts (see the fields)
        proposal_rate  proposed / rounds: how often the drafter (after any scheduler cut) offered position j
        survival       accepted / rounds = P(position j accepted), a never-proposed position counting as not
                       accepted (what tau sums: tau = 1 + sum_j survival[j])
        conditional    accepted / eligible = P(j accepted | j proposed and j-1 accepted): the per-position
                       acceptance of the drafter where it was put to the test (nan where never eligible)
        """
        rounds, width = self.rounds, len(self.position_accepted)
        eligible = self.position_eligible or [0] * width  # unknown (a hand-built record): conditional nan

        def ratio(a, b):
            return a / b if b else float("nan")

        return {"proposed": list(self.position_proposed), "accepted": list(self.position_accepted),
                "eligible": list(self.position_eligible),
                "proposal_rate": [ratio(p, rounds) for p in self.position_proposed],
                "survival": [ratio(a, rounds) for a in self.position_accepted],
                "conditional": [ratio(a, e) for a, e in zip(self.position_accepted, eligible)]}

    def summary(self) -> dict:
        out = {
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_second": self.tokens_per_second,
            "time_per_output_token_ms": self.time_per_output_token_ms,
            "new_tokens": self.new_tokens,
            "rounds": self.rounds,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "batch_size": self.batch_size,
            "row_steps": self.row_steps,
            "idle_fraction": self.idle_fraction,
        }
        if self.width_rounds:
            out.update(verify_widths=self.verify_widths, width_rounds=self.width_rounds,
                       skipped_drafts=self.skipped_drafts, predicted_seconds=self.predicted_seconds,
                       predicted_tokens_per_second=self.predicted_tokens_per_second,
                       round_costs=self.round_costs, draft_cost=self.draft_cost,
                       expected_accepted=self.expected_accepted, realised_accepted=self.realised_accepted)
        out.update({f"acceptance_{k}": v for k, v in self.acceptance_by_position().items()})
        return out


def speedup(baseline: DecodeMetrics, candidate: DecodeMetrics) -> float:
    """AR time / speculative time for the same prompts and the same number of generated tokens."""
    base = baseline.decode_seconds / max(baseline.new_tokens, 1)
    cand = candidate.decode_seconds / max(candidate.new_tokens, 1)
    return base / cand if cand > 0 else float("nan")


def merge(metrics: list[DecodeMetrics]) -> DecodeMetrics:
    """Aggregate runs (e.g. prompts of one dataset) into one record: sums, so ratios weight by tokens."""
    width = max((len(m.position_proposed) for m in metrics), default=0)

    def pad(xs):
        return np.pad(np.asarray(xs, np.int64), (0, width - len(xs)))

    def total(name):
        vals = [getattr(m, name) for m in metrics]
        return None if any(v is None for v in vals) else float(sum(vals))

    return DecodeMetrics(
        new_tokens=sum(m.new_tokens for m in metrics), rounds=sum(m.rounds for m in metrics),
        accepted_draft_tokens=sum(m.accepted_draft_tokens for m in metrics),
        proposed_draft_tokens=sum(m.proposed_draft_tokens for m in metrics),
        prefill_seconds=sum(m.prefill_seconds for m in metrics),
        decode_seconds=sum(m.decode_seconds for m in metrics),
        draft_seconds=total("draft_seconds"), verify_seconds=total("verify_seconds"),
        position_proposed=sum((pad(m.position_proposed) for m in metrics), np.zeros(width, np.int64)).tolist(),
        position_accepted=sum((pad(m.position_accepted) for m in metrics), np.zeros(width, np.int64)).tolist(),
        position_eligible=sum((pad(m.position_eligible) for m in metrics), np.zeros(width, np.int64)).tolist(),
        batch_size=sum(m.batch_size for m in metrics),
        row_steps=None if any(m.row_steps is None for m in metrics) else sum(m.row_steps for m in metrics),
        **_merge_widths(metrics),
    )


def _merge_widths(metrics: list[DecodeMetrics]) -> dict:
    """The adaptive-width fields summed over runs that share one set of verify widths (else left empty)."""
    widths = {tuple(m.verify_widths) for m in metrics}
    if len(widths) != 1 or not metrics[0].width_rounds or any(m.predicted_seconds is None for m in metrics):
        return {}
    same_costs = len({(tuple(m.round_costs), m.draft_cost) for m in metrics}) == 1  # else they say nothing merged
    return {"verify_widths": list(metrics[0].verify_widths),
            "round_costs": list(metrics[0].round_costs) if same_costs else [],
            "draft_cost": metrics[0].draft_cost if same_costs else None,
            "width_rounds": np.sum([m.width_rounds for m in metrics], axis=0).astype(int).tolist(),
            "skipped_drafts": sum(m.skipped_drafts for m in metrics),
            "predicted_seconds": float(sum(m.predicted_seconds for m in metrics)),
            "expected_accepted": float(sum(m.expected_accepted or 0.0 for m in metrics)),
            "realised_accepted": float(sum(m.realised_accepted or 0.0 for m in metrics))}
