"""Prompt sources for experiments: built-in prompt sets, local jsonl/json/csv files, and `datasets` hub names.

    load_prompts(DatasetConfig(name="${SPECDEC_DATA}/gsm8k/test.jsonl", limit=16))  -> [Prompt, ...]

A `DatasetConfig.name` is resolved in this order:
  1. a built-in prompt set (`specdec.prompts.PROMPT_SETS`: "quickstart", ...);
  2. a local file ending in .jsonl / .json / .csv (`$VARS` and `~` are expanded; relative paths are relative
     to the working directory); a path that does not exist is an error, never a hub lookup;
  3. otherwise a Hugging Face `datasets` hub name ("openai/gsm8k", optionally "name:config"); offline
     (HF_DATASETS_OFFLINE=1, or no network) this fails with a message naming the dataset.

Known record layouts are detected from their fields (or forced with `field`):

  layout      fields                                   prompt text            reference (for scoring)
  mt_bench    question_id, category, turns[, reference] turns[0] (first turn)   reference (if any)
  gsm8k       question, answer ("... #### 42")          question               the final number "42"
  humaneval   task_id, prompt, test, entry_point        prompt (*)             {prompt, test, entry_point}
  mbpp        task_id, text, test_list[, code]          text + the tests (**)  {test_list, test_setup_code}
  generic     `field`, or the first of prompt / instruction (+ input) / question / text / input

(*) with `data.chat_template` the code prompt is wrapped in a short instruction ("Complete the following
Python function ..."), since an instruction-tuned model answers a bare code prompt unpredictably.
(**) MBPP's standard prompt: the task text plus its assert statements, so the function name is known.
`per_category: N` keeps the first N prompts of each category (e.g. 2 of each of MT-Bench's 8), then `limit`.
`sample_seed: S` shuffles the records with seed S first (a random sample; the indices stay the file positions).
MBPP splits follow the paper: test = task_id 11-510 (default), validation 511-600, train 601-974, prompt 1-10.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from specdec.config import DatasetConfig
from specdec.records import DataError, load_records, record_text, sample_order
from specdec.prompts import PROMPT_SETS, builtin

MBPP_SPLITS = {"test": (11, 510), "validation": (511, 600), "train": (601, 974), "prompt": (1, 10)}
DatasetError = DataError  # one error class for unloadable data, experiments and distillation alike


@dataclasses.dataclass
class Prompt:
    dataset: str  # a short label of the source: the set name, the known layout's name, or the file stem
    question_id: Any  # the record's own id (question_id / task_id / id) or its index in the source
    category: str
    text: str
    reference: Any = None  # what a scorer needs (GSM8K final answer, HumanEval tests, ...) or None
    layout: str = "generic"  # mt_bench | gsm8k | humaneval | mbpp | builtin | generic

    @property
    def key(self) -> str:
        """Unique within a run: the dataset label and the id."""
        return f"{self.dataset}/{self.question_id}"


# ---------------------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------------------

def detect_layout(record: dict) -> str:
    keys = set(record)
    if "turns" in keys and isinstance(record.get("turns"), list):
        return "mt_bench"
    if {"question", "answer"} <= keys:
        return "gsm8k"
    if {"prompt", "test", "entry_point"} <= keys:
        return "humaneval"
    if {"text", "test_list"} <= keys:
        return "mbpp"
    return "generic"


def gsm8k_final_answer(answer: str) -> str:
    """The number after '####' in a GSM8K answer, normalised (commas removed)."""
    if "####" not in answer:
        raise DatasetError(f"GSM8K answer has no '#### N' final answer: {answer[-80:]!r}")
    return answer.split("####")[-1].strip().replace(",", "")


HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the complete function (including "
                         "the signature) in one ```python code block.\n\n```python\n{prompt}```")


def to_prompt(record: dict, index: int, *, label: str, layout: str, field: str | None, category: str | None,
              chat: bool, where: str) -> Prompt:
    """One record of a known layout as a Prompt."""
    qid = next((record[k] for k in ("question_id", "task_id", "id") if k in record), index)
    if field is not None and layout != "generic":
        layout = "generic"  # an explicit field wins over detection
    if layout == "mt_bench":
        turns = record["turns"]
        if not turns:
            raise DatasetError(f"{where}: record {qid!r} has no turns")
        return Prompt(label, qid, category or str(record.get("category", label)), str(turns[0]),
                      record.get("reference"), layout)
    if layout == "gsm8k":
        return Prompt(label, qid, category or "math", str(record["question"]),
                      gsm8k_final_answer(str(record["answer"])), layout)
    if layout == "humaneval":
        text = HUMANEVAL_INSTRUCTION.format(prompt=record["prompt"]) if chat else str(record["prompt"])
        ref = {"prompt": record["prompt"], "test": record["test"], "entry_point": record["entry_point"]}
        return Prompt(label, qid, category or "code", text, ref, layout)
    if layout == "mbpp":
        tests = list(record["test_list"])
        text = f"{record['text']}\nYour code should pass these tests:\n" + "\n".join(tests)
        ref = {"test_list": tests, "test_setup_code": record.get("test_setup_code", "")}
        return Prompt(label, qid, category or "code", text, ref, layout)
    cat = category or (str(record["category"]) if isinstance(record.get("category"), str) else label)
    return Prompt(label, qid, cat, record_text(record, field, where), None, "generic")


# ---------------------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------------------

def load_prompts(ds: DatasetConfig, *, chat: bool = True) -> list[Prompt]:
    """The prompts of one dataset entry (after split filtering and `limit`)."""
    name = ds.name
    if name in PROMPT_SETS:
        if ds.field is not None:
            raise DatasetError(f"dataset {name!r} is a built-in prompt set; `field` does not apply to it")
        items = [Prompt(name, i, ds.category or cat, text, None, "builtin")
                 for i, (cat, text) in sample_order(builtin(name), ds.sample_seed)]
        return _select(items, ds)
    records, where, label = load_records(name, ds.split, default_split="test")
    layout = detect_layout(records[0])
    if layout != "generic" and ds.field is None:
        label = layout  # gsm8k/0, humaneval/HumanEval/0, mt_bench/81, mbpp/11
    if layout == "mbpp":
        split = ds.split or "test"
        if split not in MBPP_SPLITS:
            raise DatasetError(f"{where}: unknown MBPP split {split!r}; allowed: {', '.join(MBPP_SPLITS)}")
        lo, hi = MBPP_SPLITS[split]
        if all("task_id" in r for r in records):
            records = [r for r in records if lo <= int(r["task_id"]) <= hi]
    prompts = []
    for i, record in sample_order(records, ds.sample_seed):
        if ds.limit and not ds.per_category and len(prompts) >= ds.limit:
            break
        prompts.append(to_prompt(record, i, label=label, layout=layout, field=ds.field, category=ds.category,
                                 chat=chat, where=where))
    return _select(prompts, ds)


def _select(prompts: list[Prompt], ds: DatasetConfig) -> list[Prompt]:
    """`per_category` (the first N of each category, in file order), then `limit`."""
    if ds.per_category:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] <= ds.per_category:
                kept.append(p)
        prompts = kept
    return prompts[: ds.limit] if ds.limit else prompts


def load_all(datasets: Sequence[DatasetConfig], *, chat: bool = True) -> list[Prompt]:
    """Every dataset entry of a config, in order; labels are made unique if two entries share one."""
    out: list[Prompt] = []
    seen: dict[str, int] = {}
    for ds in datasets:
        prompts = load_prompts(ds, chat=chat)
        if prompts:
            label = prompts[0].dataset
            seen[label] = seen.get(label, 0) + 1
            if seen[label] > 1:
                for p in prompts:
                    p.dataset = f"{label}.{seen[label]}"
        out += prompts
    keys = [p.key for p in out]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise DatasetError(f"duplicate prompt ids {dupes[:5]}: give each record a distinct id")
    return out
