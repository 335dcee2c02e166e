"""Function-completion training prompts shaped like HumanEval's, built from code solutions.

    python -m experiments.completion_prompts --mbpp $SPECDEC_DATA/mbpp/mbpp.jsonl \
        --gpteacher $SPECDEC_DATA/gpteacher/codegen-instruct.json --out runs/data/completion_prompts.jsonl

Why: a drafter is judged on HumanEval by the target's answers to "Complete the following Python function ...",
and those answers open by copying the prompt's signature (and often its docstring). An instruction prompt
("Write a function that ...") never asks for that copy, so a drafter distilled on answers to instruction prompts
never learns it, while prompt lookup gets it for free (docs/TRAINING.md). These prompts give the
target the evaluation's shape on problems that are not in it: each solution's function becomes a HumanEval-style
stub (its module imports, its `def` line, a docstring from the task text with doctest examples where the tests
give them), wrapped in the very instruction the evaluation uses (`experiments.datasets.HUMANEVAL_INSTRUCTION`).

Sources (both optional, at least one):
- MBPP records (text, code, test_list, task_id): the function the first test calls; its asserts
  `assert f(args) == value` become `>>> f(args)` / `value` examples. The test split (task ids 11-510) is left out
  unless `--keep-mbpp-test` (it is an evaluation set).
- Instruction / response records (GPTeacher codegen: instruction, input, response): the first top-level Python
  `def` of the response (its code block if it has one), with the instruction as the docstring.

Output: jsonl records {"id", "source", "prompt"} (the `prompts/train_prompts.jsonl` layout), so a data config
reads it like any prompt file; decontaminate it there (`decontaminate:` the evaluation files).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import textwrap
from pathlib import Path

from experiments.datasets import HUMANEVAL_INSTRUCTION, MBPP_SPLITS
from specdec.records import read_records

CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


class CompletionPromptError(ValueError):
    pass


def _function_source(code: str, name: str | None) -> tuple[list[str], ast.FunctionDef] | None:
    """(module import lines, the function `name`, or the first top-level function) of `code`; None if the code
    does not parse or has no such function."""
    code = code.replace("\r\n", "\n").replace("\t", "    ")
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    imports = [ast.get_source_segment(code, n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    chosen = next((f for f in funcs if name is None or f.name == name), None)
    return (imports, chosen) if chosen is not None else None


def _signature(fn: ast.FunctionDef) -> str:
    """The function's `def` line as written in HumanEval (annotations kept, body dropped)."""
    args = ast.unparse(fn.args)
    returns = f" -> {ast.unparse(fn.returns)}" if fn.returns is not None else ""
    return f"def {fn.name}({args}){returns}:"


def _docstring(description: str, examples: list[tuple[str, str]]) -> str:
    body = textwrap.wrap(" ".join(description.split()), 100) or [""]
    for call, value in examples:
        body += [f">>> {call}", value]
    text = "\n".join("    " + line for line in body)
    return f'    """ {text.lstrip()}\n    """\n'


def stub(imports: list[str], fn: ast.FunctionDef, description: str, examples: list[tuple[str, str]]) -> str:
    """A HumanEval-style prompt body: imports, two blank lines, the signature and a docstring."""
    head = "\n".join(imports) + "\n\n\n" if imports else ""
    return f"{head}{_signature(fn)}\n{_docstring(description, examples)}"


def _assert_example(test: str, name: str) -> tuple[str, str] | None:
    """`assert f(x) == y` -> ("f(x)", "y"); None for any other shape of test."""
    try:
        node = ast.parse(test.strip()).body[0]
    except (SyntaxError, IndexError):
        return None
    if not (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq) and isinstance(node.test.left, ast.Call)
            and isinstance(node.test.left.func, ast.Name) and node.test.left.func.id == name):
        return None
    return ast.unparse(node.test.left), ast.unparse(node.test.comparators[0])


def _called_name(test: str) -> str | None:
    found = re.search(r"assert\s+(?:not\s+)?\(?\s*(?:set\()?\s*([A-Za-z_]\w*)\s*\(", test)
    return found.group(1) if found else None


def mbpp_prompts(path: str | Path, keep_test: bool = False, max_examples: int = 2) -> list[dict]:
    test_lo, test_hi = MBPP_SPLITS["test"]
    out = []
    for i, record in enumerate(read_records(Path(path))):
        missing = [k for k in ("task_id", "text", "code", "test_list") if k not in record]
        if missing:
            raise CompletionPromptError(f"{path} record {i}: an MBPP record needs {missing}")
        if test_lo <= int(record["task_id"]) <= test_hi and not keep_test:
            continue
        tests = list(record["test_list"])
        name = _called_name(tests[0]) if tests else None
        found = _function_source(record["code"], name)
        if found is None:
            continue
        imports, fn = found
        examples = [e for e in (_assert_example(t, fn.name) for t in tests) if e is not None][:max_examples]
        out.append({"id": f"mbpp-{record['task_id']}", "source": "mbpp_completion",
                    "prompt": HUMANEVAL_INSTRUCTION.format(prompt=stub(imports, fn, record["text"], examples))})
    return out


def instruction_prompts(path: str | Path, source: str) -> list[dict]:
    out = []
    for i, record in enumerate(read_records(Path(path))):
        if not {"instruction", "response"} <= set(record):
            raise CompletionPromptError(f"{path} record {i}: needs 'instruction' and 'response' fields")
        response = str(record["response"])
        blocks = CODE_BLOCK.findall(response)
        found = _function_source(blocks[0] if blocks else response, None)
        if found is None:
            continue
        imports, fn = found
        out.append({"id": f"{source}-{i}", "source": source,
                    "prompt": HUMANEVAL_INSTRUCTION.format(prompt=stub(imports, fn, record["instruction"], []))})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mbpp", help="MBPP jsonl (text, code, test_list, task_id)")
    ap.add_argument("--gpteacher", help="JSON list of instruction / response records with Python code")
    ap.add_argument("--keep-mbpp-test", action="store_true", help="keep MBPP's test split (task ids 11-510)")
    ap.add_argument("--out", required=True, help="jsonl to write ({id, source, prompt} records)")
    args = ap.parse_args(argv)
    if not (args.mbpp or args.gpteacher):
        ap.error("give --mbpp and / or --gpteacher")
    records = []
    if args.mbpp:
        records += mbpp_prompts(args.mbpp, keep_test=args.keep_mbpp_test)
    if args.gpteacher:
        records += instruction_prompts(args.gpteacher, "gpteacher_completion")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    counts = {s: sum(r["source"] == s for r in records) for s in sorted({r["source"] for r in records})}
    print(f"{len(records)} completion prompts -> {out} ({counts})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
