"""The record store of a run: its files under `<output.dir>/<output.name>/`, and the per-prompt records and
per-batch metrics of each method, appended batch by batch so an interrupted run resumes where it stopped.

    store = RecordStore(RunPaths(Path("runs/tiny/tiny")), SPEC)
    store.merged().tau, store.tokens()["quickstart/0"]

(Not `specdec/records.py`, which reads the records of training data sets.)

RECORDS. One JSON line per prompt and method, compatible with Spec-Bench answer files:
  {"question_id", "category", "answer_id", "model_id", "tstamp",
   "choices": [{"index": 0, "turns": [text], "new_tokens": [n], "wall_time": [s], "decoding_steps": [r],
                "accept_lengths": [...]}],
   "dataset", "token_ids", "prompt_tokens", "batch_size", "batch", "batch_wall_time"}
  - wall_time: the prompt's own latency: prefill + its share of the batch's decode time, decode seconds x
    (the row's steps / the batch's loop iterations), every iteration costing about the same (static shapes; at
    batch size 1 it is the prompt's measured time). `batch_wall_time` is the whole batch's prefill + decode.
  - decoding_steps: target verification rounds after the prefill (AR: new_tokens - 1), per row at any batch size.
  - accept_lengths: tokens committed in each of the row's rounds, in round order (accepted drafts + 1; the
    engine's `SpecOutput.accept_lengths`): sum = new_tokens - 1, exactly the tokens the metrics count (a round
    cut at EOS or max_new_tokens lists what it committed). AR records hold [1] * decoding_steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

from experiments.datasets import Prompt
from specdec.metrics import DecodeMetrics, merge

# The two methods a run records, and the names of their files.
AR, SPEC = "autoregressive", "speculative"


@dataclasses.dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def table(self) -> Path:
        return self.root / "table.md"

    @property
    def profile(self) -> Path:
        return self.root / "profile.json"

    @property
    def own_answers(self) -> Path:
        return self.root / "own_answers.json"

    def answers(self, method: str) -> Path:
        return self.root / "answers" / f"{method}.jsonl"

    def metrics(self, method: str) -> Path:
        return self.root / "metrics" / f"{method}.jsonl"


# ---------------------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------------------

def _read_jsonl(path: Path) -> tuple[list[dict], bool]:
    """Records of a JSONL file and whether any line was unreadable (a write cut short by a kill)."""
    if not path.exists():
        return [], False
    out, bad = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                bad = True
    return out, bad


def _append_jsonl(path: Path, items: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False, default=_json_default) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _json_default(obj):
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def finite_or_none(x):
    """None for a NaN or infinite float (JSON has neither; e.g. the tau of a run without rounds), else x."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def jsonable(obj):
    """`obj` with every NaN / infinite float inside dicts, lists and tuples replaced by None."""
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return finite_or_none(obj)


# ---------------------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------------------

class RecordStore:
    """The per-prompt records and per-batch metrics of one method, append-only on disk.

    A batch counts as done once its metrics line is written (after its records). On load, records without a
    metrics line (a kill between the two writes) and unreadable lines are dropped and the files rewritten."""

    def __init__(self, paths: RunPaths, method: str):
        self.method = method
        self.answers_path, self.metrics_path = paths.answers(method), paths.metrics(method)
        records, bad_r = _read_jsonl(self.answers_path)
        batches, bad_b = _read_jsonl(self.metrics_path)
        self.batches = batches
        self.done = {k for b in batches for k in b["keys"]}
        by_key = {}
        for r in records:
            key = f"{r['dataset']}/{r['question_id']}"
            if key in self.done:
                by_key[key] = r
        self.records = by_key
        if bad_r or bad_b or len(by_key) != len(records):
            self._rewrite()
        self.reused = len(self.done)

    def _rewrite(self) -> None:
        for path, items in ((self.answers_path, list(self.records.values())), (self.metrics_path, self.batches)):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items), encoding="utf-8")
            tmp.replace(path)

    def append(self, records: list[dict], batch: dict) -> None:
        _append_jsonl(self.answers_path, records)
        _append_jsonl(self.metrics_path, [batch])
        for r in records:
            self.records[f"{r['dataset']}/{r['question_id']}"] = r
        self.batches.append(batch)
        self.done.update(batch["keys"])

    def tokens(self) -> dict[str, list[int]]:
        return {k: r["token_ids"] for k, r in self.records.items()}

    def texts(self) -> dict[str, str]:
        return {k: r["choices"][0]["turns"][0] for k, r in self.records.items()}

    def merged(self, group: str | None = None, by: str = "category") -> DecodeMetrics | None:
        """All batches merged, or those whose `by` field equals `group` (a category, "<dataset> (mixed)", or with
        by="dataset" a dataset name)."""
        items = [DecodeMetrics(**b["metrics"]) for b in self.batches if group is None or b[by] == group]
        return merge(items) if items else None


def make_record(method: str, model_id: str, prompt: Prompt, tokens: list[int], text: str, metrics: DecodeMetrics,
                batch_size: int, batch_index: int, prompt_tokens: int, accept_lengths: list[int],
                batch_steps: int) -> dict:
    """One answer record (RECORDS above). `accept_lengths`: the row's tokens per round (AR: [1] per step after
    the first token; speculative: `SpecOutput.accept_lengths`); `batch_steps`: the loop iterations its batch
    ran, i.e. the most steps of any of its rows."""
    steps = len(accept_lengths)
    share = steps / batch_steps if batch_steps else 1.0  # every step of the loop costs about the same
    return {
        "question_id": prompt.question_id, "category": prompt.category, "answer_id": f"{method}:{prompt.key}",
        "model_id": model_id, "tstamp": time.time(),
        "choices": [{"index": 0, "turns": [text], "new_tokens": [len(tokens)],
                     "wall_time": [metrics.prefill_seconds + share * metrics.decode_seconds],
                     "decoding_steps": [steps], "accept_lengths": list(accept_lengths)}],
        "dataset": prompt.dataset, "token_ids": list(tokens), "prompt_tokens": prompt_tokens,
        "batch_size": batch_size, "batch": batch_index,
        "batch_wall_time": metrics.prefill_seconds + metrics.decode_seconds,
    }
