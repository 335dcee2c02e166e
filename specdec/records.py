"""Reading records (prompts, questions, tasks) from local files and the Hugging Face hub.

One reader serves both the experiments (`experiments/datasets.py`, which adds the MT-Bench / GSM8K /
HumanEval / MBPP layouts) and the distillation data (`specdec/train/data.py`):

    records, where, label = load_records("${SPECDEC_DATA}/gsm8k/test.jsonl")    # -> [dict, ...]
    text = record_text(records[0], field=None, where=where)                    # the prompt of a plain record
    chat = chat_messages(chat_list(records[0]), where)                         # a chat record's turns

Chat records hold their conversation as `messages` ([{"role": "user" | "assistant" | "system", "content"}])
or in ShareGPT's `conversations` ([{"from": "human" | "gpt" | "system", "value"}]); `chat_messages` gives
either as transformers' role / content messages.

A name is a local file when it ends in .jsonl / .json / .csv or names an existing path (`$VARS` and `~` are
expanded; an unset variable is an error that names it); a file that does not exist is an error, never a hub
lookup. Anything else is a `datasets` hub name ("owner/name" or "owner/name:config"), which fails at once and
says what to do when the hub is offline (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE) or unreachable.
"""

from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

FILE_SUFFIXES = (".jsonl", ".json", ".csv")
PROMPT_FIELDS = ("prompt", "instruction", "question", "text", "input", "query")
_OFFLINE_FLAGS = ("1", "true", "yes", "on")
_HUB_HINT = ("pass a local .jsonl/.json/.csv path instead (download the dataset on a machine with network access, "
             "e.g. `datasets.load_dataset(...).to_json('file.jsonl')`)")


class DataError(ValueError):
    """Data that cannot be loaded or built; the message names the source and what to do."""


def expand_path(name: str) -> Path:
    expanded = os.path.expanduser(os.path.expandvars(name))
    unset = re.findall(r"\$\{?([A-Za-z_]\w*)", expanded)
    if unset:
        raise DataError(f"dataset path {name!r} uses ${unset[0]}, which is not set; export it (e.g. "
                        f"export {unset[0]}=/path/to/data) or write the path out")
    return Path(expanded)


def is_file_name(name: str) -> bool:
    return name.lower().endswith(FILE_SUFFIXES) or Path(os.path.expanduser(os.path.expandvars(name))).exists()


def read_records(path: Path, split: str | None = None) -> list[dict]:
    """Plain records from a .jsonl / .json / .csv file. A JSON object holds them under the split name or 'data'."""
    if not path.is_file():
        raise DataError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        records = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
        return records
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
        if isinstance(data, dict):  # {"test": [...], "train": [...]} or {"data": [...]}
            key = split if split in data else ("data" if "data" in data else None)
            if key is None or not isinstance(data[key], list):
                raise DataError(f"{path}: a JSON object must hold the records under the split name or 'data'; "
                                f"found keys {sorted(data)}")
            data = data[key]
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a list of records, got {type(data).__name__}")
        return data
    if suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))
    raise DataError(f"{path}: unsupported file type {suffix!r}; use one of {', '.join(FILE_SUFFIXES)}")


def load_hub_records(name: str, split: str | None, default_split: str) -> list[dict]:
    """Records of a `datasets` hub dataset ("owner/name" or "owner/name:config")."""
    repo, _, config = name.partition(":")
    if any(os.environ.get(v, "").lower() in _OFFLINE_FLAGS for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")):
        raise DataError(f"dataset {name!r} is a Hugging Face hub name, but hub access is unavailable "
                        f"(HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set, i.e. offline); {_HUB_HINT}")
    try:
        import datasets
    except ImportError:
        raise DataError(f"dataset {name!r} looks like a hub name but the `datasets` package is not installed; "
                        f"{_HUB_HINT}") from None
    try:
        ds = datasets.load_dataset(repo, config or None, split=split or default_split)
    except Exception as e:  # offline, no network, unknown name, missing split
        raise DataError(f"dataset {name!r} could not be loaded from the Hugging Face hub "
                        f"({type(e).__name__}: {str(e)[:200]}); {_HUB_HINT}") from None
    return [dict(r) for r in ds]


def load_records(name: str, split: str | None = None, default_split: str = "test") -> tuple[list[dict], str, str]:
    """(records, where, label): the records of a file or hub name, a description of the source for error
    messages, and a short label (the file stem or the hub dataset's name)."""
    if is_file_name(name):
        path = expand_path(name)
        records, where, label = read_records(path, split), str(path), path.stem
    else:
        records, where, label = load_hub_records(name, split, default_split), name, name.rsplit("/", 1)[-1]
        label = label.partition(":")[0]
    if not records:
        raise DataError(f"{where}: no records")
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise DataError(f"{where}: record {i} is a {type(record).__name__}, not an object")
    return records, where, label


def record_text(record: dict, field: str | None, where: str) -> str:
    """The prompt of a plain record: `field`, else the first turn of `turns`, else the first of PROMPT_FIELDS
    (an instruction gets its `input` appended)."""
    if field is not None:
        if field not in record:
            raise DataError(f"{where}: field {field!r} not found; the records have fields {sorted(record)}")
        value = record[field]
        return str(value[0] if isinstance(value, list) and value else value)
    if isinstance(record.get("turns"), list) and record["turns"]:
        return str(record["turns"][0])
    for name in PROMPT_FIELDS:
        if isinstance(record.get(name), str) and record[name].strip():
            text = record[name]
            if name == "instruction" and isinstance(record.get("input"), str) and record["input"].strip():
                text = f"{text}\n\n{record['input']}"
            return text
    raise DataError(f"{where}: cannot tell which field holds the prompt (fields: {sorted(record)}); "
                    f"set `field` in the dataset config")


CHAT_ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
              "model": "assistant"}  # either layout's role name -> transformers' (what chat templates expect)


def chat_list(record: dict) -> list | None:
    """A record's conversation as stored (`messages`, else ShareGPT `conversations`); None when it has none."""
    messages = record.get("messages") or record.get("conversations")
    return messages if isinstance(messages, list) and messages else None


def message_role(message) -> str | None:
    """The transformers role of a message in either layout (None: not a message, or an unknown role)."""
    if not isinstance(message, dict):
        return None
    return CHAT_ROLES.get(message.get("role", message.get("from")))


def message_content(message: dict) -> str:
    return str(message.get("content", message.get("value", "")))


def first_user(messages: list, where: str) -> str:
    for m in messages:
        if message_role(m) == "user":
            return message_content(m)
    raise DataError(f"{where}: the messages hold no user turn")


def last_assistant(messages: list, where: str) -> str:
    for m in reversed(messages):
        if message_role(m) == "assistant":
            return message_content(m)
    raise DataError(f"{where}: the messages hold no assistant turn")


def chat_messages(messages: list, where: str) -> list[dict]:
    """A stored conversation as [{"role", "content"}] in transformers' role names (system / user / assistant);
    every message must be one: a dict with a known role and text content."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{where}: message {i} is a {type(m).__name__}, not an object with role and content")
        role_key, content_key = ("role", "content") if "role" in m else ("from", "value")
        role = CHAT_ROLES.get(m.get(role_key))
        if role is None:
            raise DataError(f"{where}: message {i} has {role_key} {m.get(role_key)!r}; known: {', '.join(CHAT_ROLES)} "
                            f"(`messages` use role/content, ShareGPT `conversations` use from/value)")
        if not isinstance(m.get(content_key), str):
            raise DataError(f"{where}: message {i} ({role}) has no text {content_key!r}")
        out.append({"role": role, "content": m[content_key]})
    return out


def sample_order(records: Sequence, seed: int | None, skip: int = 0, *, sources: Sequence[str] = (),
                 label: str = "", where: str = "") -> list[tuple[int, Any]]:
    """(file position, record) in file order, or in a permutation drawn from `seed` (a random sample when the
    caller then keeps the first N), without its first `skip` entries (a later sample that repeats none of an
    earlier one's N = skip). With `sources`, only the records whose `source` field (`label` where a record has
    none) is one of them, in the same order; none left is an error naming the sources the file (`where`) has, and
    so is a `skip` that leaves out every record."""
    if skip and skip >= len(records):
        raise DataError(f"{where or 'the records'}: skip {skip} leaves no records (there are {len(records)}); "
                        "skip must be below that")
    order = np.arange(len(records)) if seed is None else np.random.default_rng(seed).permutation(len(records))
    picked = [(int(i), records[int(i)]) for i in order[skip:]]
    if not sources:
        return picked
    def source(record) -> str:
        return str(record.get("source", label))

    kept = [(i, record) for i, record in picked if source(record) in sources]
    if not kept:
        raise DataError(f"{where}: no records of the sources {list(sources)} (after skip {skip}); the file's "
                        f"sources are {sorted({source(r) for r in records})}")
    return kept
