"""Task scorers for the quality-preservation experiment: GSM8K accuracy, HumanEval and MBPP pass@1.

    gsm8k_correct("... so she makes $18 a day.", "18")            -> True
    humaneval_passed(completion, {"prompt", "test", "entry_point"}) -> (True, "")

Generated code is executed in a separate Python process (`python -I`, empty temporary working directory,
a wall-clock timeout; memory and CPU-time limits set by a prelude in the program itself, so no Python code
runs between fork and exec in this multithreaded process). This is the standard HumanEval harness practice, not a
sandbox: only run it on outputs of models you trust as much as any other untrusted snippet you'd run locally.
Speculative decoding is lossless, so at greedy decoding the scores with and without it must be identical.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Sequence

from experiments.datasets import Prompt

EXEC_TIMEOUT_S = 10.0
EXEC_MEMORY_BYTES = 2 << 30

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def _to_float(text: str) -> float | None:
    text = text.replace(",", "").replace("$", "").rstrip(".")
    try:
        return float(text)
    except ValueError:
        return None


def extract_final_number(text: str) -> str | None:
    """The final numeric answer of a completion: after '####' or 'answer is' if present, else the last number."""
    for marker in ("####", "answer is", "Answer:", "answer:"):
        if marker in text:
            found = _NUMBER.findall(text.rsplit(marker, 1)[1])
            if found:
                return found[0].replace(",", "").replace("$", "")
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").replace("$", "") if found else None


def gsm8k_correct(completion: str, reference: str) -> bool:
    got, want = extract_final_number(completion), _to_float(reference)
    value = None if got is None else _to_float(got)
    return value is not None and want is not None and abs(value - want) < 1e-6


_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(completion: str) -> str:
    """The first fenced code block (an unterminated one runs to the end), else the whole completion."""
    m = _FENCE.search(completion)
    return m.group(1) if m else completion


def _imports(source: str) -> str:
    return "\n".join(line for line in source.splitlines() if line.startswith(("import ", "from ")))


def humaneval_program(completion: str, ref: dict) -> str:
    """The program to run: the model's function (or the prompt + its continuation), the tests, check(...)."""
    code, entry = extract_code(completion), ref["entry_point"]
    if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
        body = f"{_imports(ref['prompt'])}\n{code}"
    else:  # a completion-style continuation of the prompt's function body
        body = ref["prompt"] + code
    return f"{body}\n\n{ref['test']}\n\ncheck({entry})\n"


def mbpp_program(completion: str, ref: dict) -> str:
    setup = ref.get("test_setup_code") or ""
    return f"{extract_code(completion)}\n\n{setup}\n" + "\n".join(ref["test_list"]) + "\n"


_PRELUDE = """\
try:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, ({mem}, {mem}))
    resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))
except Exception:
    pass
"""


def run_program(program: str, timeout: float = EXEC_TIMEOUT_S) -> tuple[bool, str]:
    """(exit status 0, the error tail) of `program` run in a fresh, isolated Python process."""
    with tempfile.TemporaryDirectory(prefix="specdec-exec-") as tmp:
        path = os.path.join(tmp, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(_PRELUDE.format(mem=EXEC_MEMORY_BYTES, cpu=int(timeout) + 1) + program)
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            proc = subprocess.run([sys.executable, "-I", path], cwd=tmp, env=env, capture_output=True, text=True,
                                  timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout:g} s"
    if proc.returncode == 0:
        return True, ""
    return False, (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1][:300]


def humaneval_passed(completion: str, ref: dict, timeout: float = EXEC_TIMEOUT_S) -> tuple[bool, str]:
    return run_program(humaneval_program(completion, ref), timeout)


def mbpp_passed(completion: str, ref: dict, timeout: float = EXEC_TIMEOUT_S) -> tuple[bool, str]:
    return run_program(mbpp_program(completion, ref), timeout)


METRIC = {"gsm8k": "accuracy", "humaneval": "pass@1", "mbpp": "pass@1"}


def score(prompt: Prompt, completion: str) -> bool | None:
    """Whether a completion solves its prompt, or None when the prompt's layout has no scorer."""
    if prompt.layout == "gsm8k":
        return gsm8k_correct(completion, prompt.reference)
    if prompt.layout == "humaneval":
        return humaneval_passed(completion, prompt.reference)[0]
    if prompt.layout == "mbpp":
        return mbpp_passed(completion, prompt.reference)[0]
    return None


def score_all(prompts: Sequence[Prompt], completions: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Per dataset: the metric for every method, and whether the per-prompt results are identical.
    `completions[method][prompt.key]` is the generated text."""
    out: dict[str, Any] = {}
    for dataset in dict.fromkeys(p.dataset for p in prompts if p.layout in METRIC):
        items = [p for p in prompts if p.dataset == dataset]
        entry: dict[str, Any] = {"metric": METRIC[items[0].layout], "n": len(items)}
        per_method = {}
        for method, texts in completions.items():
            per_method[method] = [score(p, texts[p.key]) if p.key in texts else None for p in items]
            vals = [v for v in per_method[method] if v is not None]
            entry[method] = sum(vals) / len(vals) if vals else None
        if len(per_method) > 1:
            first, *rest = per_method.values()
            entry["identical"] = all(r == first for r in rest)
        entry["per_prompt"] = {m: [int(v) if v is not None else None for v in vs] for m, vs in per_method.items()}
        out[dataset] = entry
    return out
