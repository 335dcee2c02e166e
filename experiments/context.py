"""The context one `specdec run` shares between its phases (experiments/run.py) and its report
(experiments/report.py). It lives here, not in run.py, so that report.py can name it without importing run.py,
which imports report.py."""

from __future__ import annotations

import dataclasses
from typing import Callable

from experiments.datasets import Prompt
from experiments.store import RunPaths
from specdec.config import ExperimentConfig
from specdec.drafter import Drafter
from specdec.sampling import SamplingParams
from specdec.target import Target
from specdec.tracking import Tracker
from specdec.verify import Policy


@dataclasses.dataclass(frozen=True)
class RunContext:
    """One run as `run_experiment` set it up: the config and what was built from it, where it writes, and how it
    reports. Built once, after loading, and read by every later phase and by experiments/report.py; what changes
    during the run (the records) lives in the `RecordStore`s instead."""

    cfg: ExperimentConfig
    name: str  # output.name ("run" when unset)
    paths: RunPaths
    prompts: list[Prompt]
    ids: dict[str, list[int]]  # prompt key -> its token ids (chat-templated when `chat`)
    batches: list[list[Prompt]]  # run.plan_batches: batch i is decoded with seed sampling.seed + i
    codec: object  # text <-> token ids (experiments/build.py: ByteCodec or TokenizerCodec)
    chat: bool  # whether the prompts were chat-templated
    target: Target
    drafter: Drafter
    label: str  # drafter_label: how tables name the drafter
    policy: Policy
    policy_note: str | None  # effective_policy's note when the configured policy was replaced
    sampling: SamplingParams
    compiled: bool | None  # speculative_generate's `compiled` (None: the drafter decides)
    engine_opts: dict  # the engine's per-round choices of what to verify: scheduler and verify_buckets
    tracker: Tracker
    echo: Callable[[str], None]
    progress: bool  # progress bars
    max_batches: int | None  # tests: stop (RunInterrupted) after this many decoded batches
    started: float  # time.time() at the start
    load_start: list[float] | None  # load average at the start
