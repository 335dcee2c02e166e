"""Built-in prompt sets, so the quickstart and tests need no dataset files.

Each prompt has a category (chat, code, math, rewrite, summarise): speculative decoding behaves very
differently across them (lookup drafters shine on rewriting, struggle on open chat).
"""

from __future__ import annotations

QUICKSTART = [
    ("chat", "What is the capital of France? Answer in one sentence."),
    ("chat", "Give me three tips for staying focused while studying."),
    ("code", "Write a Python function `is_palindrome(s)` that returns True if the string s reads the same "
             "forwards and backwards, ignoring case. Include a docstring."),
    ("code", "Here is a function:\n\ndef add(a, b):\n    return a + b\n\nRewrite it with type hints and a "
             "docstring, keeping the same name and behaviour."),
    ("math", "A shop sells pencils at 3 dollars each. Tom buys 4 pencils and pays with a 20 dollar bill. "
             "How much change does he get? Explain step by step."),
    ("rewrite", "Rewrite the following sentence in the passive voice: The committee approved the new "
                "budget after a long discussion about the costs of the project."),
    ("rewrite", "Repeat the following list exactly, one item per line: apples, bananas, cherries, dates, "
                "elderberries, figs, grapes."),
    ("summarise", "Summarise in two sentences: The city council met on Tuesday to discuss the new park. "
                  "Residents spoke for and against the plan. Supporters said the park would give children a "
                  "safe place to play, while opponents worried about noise and parking. The council voted 5 "
                  "to 2 to approve the park, which will open next spring."),
]

PROMPT_SETS = {"quickstart": QUICKSTART}


def builtin(name: str) -> list[tuple[str, str]]:
    """(category, text) pairs of a built-in prompt set."""
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown built-in prompt set {name!r}; available: {', '.join(PROMPT_SETS)}")
    return list(PROMPT_SETS[name])
