"""A pytest plugin that reports how much of a test run XLA spent compiling, per process (each xdist worker and
the controller), with the functions whose compilations cost most. Counted this way, compiling is about half of
the test suite's time (docs/BENCHMARKS.md):

    python -m pytest -p tools.compile_time                        # the whole suite, two workers
    python -m pytest -q -n 0 -p tools.compile_time tests/test_hybrid.py

It sums JAX's `/jax/core/compile/backend_compile_duration` events (XLA's own compile, not tracing or lowering).
"""

from __future__ import annotations

import collections

import jax.monitoring
import pytest

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TOP = 8  # functions listed per process

_seconds: collections.Counter = collections.Counter()
_programs: collections.Counter = collections.Counter()
_worker_totals: list[dict] = []


def _listen(event: str, duration: float, **kwargs) -> None:
    if event == COMPILE_EVENT:
        name = str(kwargs.get("fun_name", "?"))
        _seconds[name] += duration
        _programs[name] += 1


jax.monitoring.register_event_duration_secs_listener(_listen)


def _totals(where: str) -> dict:
    return {"where": where, "programs": sum(_programs.values()), "seconds": round(sum(_seconds.values()), 1),
            "top": [[name, round(s, 2), _programs[name]] for name, s in _seconds.most_common(TOP)]}


def pytest_sessionfinish(session) -> None:
    out = getattr(session.config, "workeroutput", None)  # set on an xdist worker: sent to the controller
    if out is not None:
        out["compile_time"] = _totals(session.config.workerinput.get("workerid", "worker"))


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent without pytest-xdist
def pytest_testnodedown(node, error) -> None:
    totals = getattr(node, "workeroutput", {}).get("compile_time")
    if totals:
        _worker_totals.append(totals)


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.section("XLA compile time")
    for t in [*_worker_totals, _totals("this process")]:
        terminalreporter.write_line(f"{t['where']}: {t['programs']} programs compiled in {t['seconds']} s")
        for name, seconds, count in t["top"]:
            terminalreporter.write_line(f"    {seconds:8.2f} s  {count:5d}  {name}")
