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
MBPP splits follow the paper: test = task_id 11-510 (default), validation 511-600, train 601-974, prompt 1-10.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

from specdec.config import DatasetConfig
from specdec.prompts import PROMPT_SETS, builtin

FILE_SUFFIXES = (".jsonl", ".json", ".csv")
MBPP_SPLITS = {"test": (11, 510), "validation": (511, 600), "train": (601, 974), "prompt": (1, 10)}
GENERIC_FIELDS = ("prompt", "instruction", "question", "text", "input", "query")


class DatasetError(ValueError):
    """A prompt source that cannot be loaded; the message names the dataset and what to do."""


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


def _generic_text(record: dict, field: str | None, where: str) -> str:
    if field is not None:
        if field not in record:
            raise DatasetError(f"{where}: field {field!r} not found; the records have fields {sorted(record)}")
        return str(record[field])
    for name in GENERIC_FIELDS:
        if isinstance(record.get(name), str) and record[name].strip():
            text = record[name]
            if name == "instruction" and isinstance(record.get("input"), str) and record["input"].strip():
                text = f"{text}\n\n{record['input']}"
            return text
    raise DatasetError(f"{where}: cannot tell which field holds the prompt (fields: {sorted(record)}); "
                       f"set `field` in the dataset config")


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
    return Prompt(label, qid, cat, _generic_text(record, field, where), None, "generic")


# ---------------------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------------------

def resolve_path(name: str) -> Path:
    expanded = os.path.expanduser(os.path.expandvars(name))
    missing = re.findall(r"\$\{?([A-Za-z_]\w*)", expanded)
    if missing:
        raise DatasetError(f"dataset path {name!r} uses ${missing[0]}, which is not set; export it (e.g. "
                           f"export {missing[0]}=/path/to/data) or write the path out")
    return Path(expanded)


def looks_like_file(name: str) -> bool:
    return name.lower().endswith(FILE_SUFFIXES) or "/" in name and Path(os.path.expandvars(name)).exists()


def read_records(path: Path, split: str | None = None) -> list[dict]:
    """Plain records from a .jsonl / .json / .csv file."""
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        records = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DatasetError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
        return records
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
        if isinstance(data, dict):  # {"test": [...], "train": [...]} or {"data": [...]}
            key = split if split in data else ("data" if "data" in data else None)
            if key is None or not isinstance(data[key], list):
                raise DatasetError(f"{path}: a JSON object must hold the records under the split name or "
                                   f"'data'; found keys {sorted(data)}")
            data = data[key]
        if not isinstance(data, list):
            raise DatasetError(f"{path}: expected a list of records, got {type(data).__name__}")
        return data
    if suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))
    raise DatasetError(f"{path}: unsupported file type {suffix!r}; use one of {', '.join(FILE_SUFFIXES)}")


def load_hub(name: str, split: str | None) -> list[dict]:
    """Records of a `datasets` hub dataset ("owner/name" or "owner/name:config")."""
    repo, _, config = name.partition(":")
    offline = os.environ.get("HF_DATASETS_OFFLINE", "") in ("1", "true", "TRUE", "yes") or \
        os.environ.get("HF_HUB_OFFLINE", "") in ("1", "true", "TRUE", "yes")
    hint = ("pass a local .jsonl/.json/.csv path instead (download the dataset on a machine with network "
            "access, e.g. `datasets.load_dataset(...).to_json('file.jsonl')`)")
    if offline:
        raise DatasetError(f"dataset {name!r} is a Hugging Face hub name, but hub access is unavailable "
                           f"(HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set); {hint}")
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"dataset {name!r} looks like a hub name but the `datasets` package is not "
                           f"installed; {hint}") from None
    try:
        ds = datasets.load_dataset(repo, config or None, split=split or "test")
    except Exception as e:  # offline mode, no network, unknown name, missing split
        raise DatasetError(f"dataset {name!r} could not be loaded from the Hugging Face hub "
                           f"({type(e).__name__}: {str(e)[:200]}); {hint}") from None
    return [dict(r) for r in ds]


def load_prompts(ds: DatasetConfig, *, chat: bool = True) -> list[Prompt]:
    """The prompts of one dataset entry (after split filtering and `limit`)."""
    name = ds.name
    if name in PROMPT_SETS:
        if ds.field is not None:
            raise DatasetError(f"dataset {name!r} is a built-in prompt set; `field` does not apply to it")
        items = [Prompt(name, i, ds.category or cat, text, None, "builtin")
                 for i, (cat, text) in enumerate(builtin(name))]
        return _select(items, ds)
    if looks_like_file(name):
        path = resolve_path(name)
        records, label = read_records(path, ds.split), path.stem
        where = str(path)
    else:
        records, label, where = load_hub(name, ds.split), name.rsplit("/", 1)[-1].partition(":")[0], name
    if not records:
        raise DatasetError(f"{where}: no records")
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
    for i, record in enumerate(records):
        if ds.limit and not ds.per_category and len(prompts) >= ds.limit:
            break
        if not isinstance(record, dict):
            raise DatasetError(f"{where}: record {i} is a {type(record).__name__}, not an object")
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
