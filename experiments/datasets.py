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
  chat        messages (role/content) or ShareGPT       the conversation up to its last user turn (system kept),
              conversations (from/value, human/gpt)     chat-templated; its last assistant turn is the reference
  gsm8k       question, answer ("... #### 42")          question               the final number "42"
  humaneval   task_id, prompt, test, entry_point        prompt (*)             {prompt, test, entry_point}
  mbpp        task_id, text, test_list[, code]          text + the tests (**)  {test_list, test_setup_code}
  generic     `field`, or the first of prompt / instruction (+ input) / question / text / input

(*) with `data.chat_template` the code prompt is wrapped in a short instruction ("Complete the following
Python function ..."), since an instruction-tuned model answers a bare code prompt unpredictably.
(**) MBPP's standard prompt: the task text plus its assert statements, so the function name is known.
`per_category: N` keeps the first N prompts of each category (e.g. 2 of each of MT-Bench's 8), then `limit`.
`sample_seed: S` shuffles the records with seed S first (a random sample; the indices stay the file positions);
`skip: N` then leaves out the first N of that order (a second sample that repeats none of a first `limit: N`;
MBPP's counted within its split); a skip that leaves no record is an error.
MBPP splits follow the paper: test = task_id 11-510 (default), validation 511-600, train 601-974, prompt 1-10.

Multi-turn MT-Bench as Spec-Bench runs it (`turns: 2`): each question gives one prompt per turn; turn t is the
conversation [user 1, assistant 1, ..., user t] where the assistant turns are the target's own greedy (plain AR)
answers. Such prompts carry those answers as placeholders (assistant content None) until `fill_own_answers`
fills them in (experiments/run.py does, before the run); `limit` / `per_category` count questions.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Sequence

from specdec.config import DatasetConfig
from specdec.records import DataError, chat_list, chat_messages, load_records, record_text, sample_order
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
    layout: str = "generic"  # mt_bench | chat | gsm8k | humaneval | mbpp | builtin | generic
    # A conversation to render instead of `text` as one user turn: [{"role", "content"}, ...] ending in a user
    # turn; an assistant turn with content None stands for the target's own answer (see fill_own_answers).
    messages: list[dict] | None = None

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
    if chat_list(record) is not None:
        return "chat"
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
    if layout == "chat":
        messages = chat_messages(chat_list(record), f"{where} record {qid!r}")
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last_user is None:
            raise DatasetError(f"{where}: record {qid!r}: the conversation has no user turn to answer")
        answers = [m["content"] for m in messages[last_user + 1:] if m["role"] == "assistant"]
        cat = category or (str(record["category"]) if isinstance(record.get("category"), str) else label)
        return Prompt(label, qid, cat, messages[last_user]["content"], answers[0] if answers else None, layout,
                      messages=messages[: last_user + 1])
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
        if ds.field is not None or ds.sources:
            raise DatasetError(f"dataset {name!r} is a built-in prompt set; `field` and `sources` do not apply to it")
        order = sample_order(builtin(name), ds.sample_seed, ds.skip, where=f"prompt set {name!r}")
        items = [Prompt(name, i, ds.category or cat, text, None, "builtin") for i, (cat, text) in order]
        return _select(items, ds)
    records, where, label = load_records(name, ds.split, default_split="test")
    layout = detect_layout(records[0])
    if ds.turns > 1 and (layout != "mt_bench" or ds.field is not None):
        raise DatasetError(f"{where}: `turns: {ds.turns}` needs MT-Bench-style records with a `turns` list "
                           f"(these are {layout!r}{' read through `field`' if ds.field else ''})")
    if layout != "generic" and ds.field is None:
        label = layout  # gsm8k/0, humaneval/HumanEval/0, mt_bench/81, mbpp/11
    if layout == "mbpp":
        split = ds.split or "test"
        if split not in MBPP_SPLITS:
            raise DatasetError(f"{where}: unknown MBPP split {split!r}; allowed: {', '.join(MBPP_SPLITS)}")
        lo, hi = MBPP_SPLITS[split]
        if all("task_id" in r for r in records):
            records = [r for r in records if lo <= int(r["task_id"]) <= hi]
            where = f"{where} (MBPP {split} split, task ids {lo}-{hi})"
    prompts, turns = [], {}
    for i, record in sample_order(records, ds.sample_seed, ds.skip, sources=ds.sources, label=label, where=where):
        if ds.limit and not ds.per_category and len(prompts) >= ds.limit:
            break
        prompt = to_prompt(record, i, label=label, layout=layout, field=ds.field, category=ds.category,
                           chat=chat, where=where)
        prompts.append(prompt)
        turns[prompt.key] = record.get("turns")
    prompts = _select(prompts, ds)
    if ds.turns == 1:
        return prompts
    return [p for first in prompts for p in later_turns(first, turns[first.key], ds.turns, where)]


def later_turns(first: Prompt, turns: list, n: int, where: str) -> list[Prompt]:
    """The first `n` turns of an MT-Bench question as prompts: turn 1 as it is, turn t > 1 the conversation
    [user 1, <own answer>, ..., user t] (question id "<id>/turn<t>"), each own answer a placeholder."""
    if len(turns) < n:
        raise DatasetError(f"{where}: record {first.question_id!r} has {len(turns)} turn(s); `turns: {n}` needs {n}")
    out = [first]
    messages: list[dict] = []
    for t in range(1, n + 1):
        messages = messages + [{"role": "user", "content": str(turns[t - 1])}]
        if t > 1:
            out.append(dataclasses.replace(first, question_id=f"{first.question_id}/turn{t}", text=str(turns[t - 1]),
                                           messages=messages))
        messages = messages + [{"role": "assistant", "content": None}]
    return out


def fill_own_answers(prompts: Sequence[Prompt], answer: Callable[[list[list[dict]]], list[str]]) -> int:
    """Fill every own-answer placeholder (an assistant turn with content None) with the target's answer to the
    conversation before it: `answer(conversations)` -> one answer text per conversation. Earlier turns are filled
    first (a later answer is asked after them); a conversation shared by several prompts is answered once.
    Returns how many distinct conversations were answered."""
    answered: dict[str, str] = {}
    while True:
        cuts = {}  # conversation key -> the conversation before a prompt's first placeholder
        for p in prompts:
            i = _first_placeholder(p)
            if i is not None:
                cuts.setdefault(json.dumps(p.messages[:i]), p.messages[:i])
        if not cuts:
            return len(answered)
        todo = [key for key in cuts if key not in answered]
        texts = answer([cuts[key] for key in todo]) if todo else []
        if len(texts) != len(todo):
            raise DatasetError(f"own answers: asked for {len(todo)}, got {len(texts)}")
        answered.update(zip(todo, texts))
        for p in prompts:
            i = _first_placeholder(p)
            if i is not None:
                own = {"role": "assistant", "content": answered[json.dumps(p.messages[:i])]}
                p.messages = [*p.messages[:i], own, *p.messages[i + 1:]]


def _first_placeholder(prompt: Prompt) -> int | None:
    return next((i for i, m in enumerate(prompt.messages or ()) if m["role"] == "assistant" and m["content"] is None),
                None)


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
