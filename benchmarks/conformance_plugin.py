"""A pytest plugin loaded into DeepSpeed's own test run by ``benchmarks/conformance.py``.

At collection it writes one JSON line per test id to the file named by
``DS_PATRICKSTAR_CONFORMANCE_IDS`` with whether the test is a stage-3 parametrization (see
[Note: which tests are stage 3] in conformance.py). While tests run it writes, to the file named by
``DS_PATRICKSTAR_CONFORMANCE_PROGRESS``, one line when a test starts and one per outcome as pytest
reports it, flushed at once: a pytest killed part way leaves no JUnit XML, and this says what
finished and which test was running (see [Note: a killed test run]).
It imports nothing of DeepSpeed's tests: it reads the collected items and the reports.
"""

from __future__ import annotations

import inspect
import json
import os
import re

_STAGE3_SOURCE = re.compile(r"""["']stage["']\s*:\s*3\b|\bzero_stage\s*=\s*3\b|\bstage\s*=\s*3\b""")


def _stage_params(item) -> dict:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return {}
    return {k: v for k, v in callspec.params.items() if "stage" in k.lower()}


def _globals_say_stage3(func) -> bool:
    """A module-level dict the test reads (by name) whose ``zero_optimization.stage`` is 3."""
    names = set(getattr(getattr(func, "__code__", None), "co_names", ()))
    module_globals = getattr(func, "__globals__", {})
    for name in names:
        value = module_globals.get(name)
        if isinstance(value, dict):
            zero = value.get("zero_optimization")
            if isinstance(zero, dict) and zero.get("stage") == 3:
                return True
    return False


def is_stage3(item) -> bool:
    stages = _stage_params(item)
    if stages:
        return any(v == 3 for v in stages.values())
    func = getattr(item, "function", None)
    if func is None:
        return False
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        source = ""
    return bool(_STAGE3_SOURCE.search(source)) or _globals_say_stage3(func)


def pytest_collection_finish(session):
    """After deselection (DeepSpeed's pytest.ini deselects its nightly and inference marks)."""
    out = os.environ.get("DS_PATRICKSTAR_CONFORMANCE_IDS")
    if not out:
        return
    with open(out, "a") as f:
        for item in session.items:
            f.write(json.dumps({"id": item.nodeid, "stage3": is_stage3(item)}) + "\n")


def _progress(record: dict) -> None:
    out = os.environ.get("DS_PATRICKSTAR_CONFORMANCE_PROGRESS")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_runtest_logstart(nodeid, location):
    _progress({"start": nodeid})


def pytest_runtest_logreport(report):
    """As JUnit counts them: a failed setup or teardown is an error, a failed call a failure."""
    if report.passed and report.when != "call":
        return
    outcome = "skipped" if report.skipped else "passed" if report.passed else "failed"
    if report.failed and report.when != "call":
        outcome = "error"
    _progress({"id": report.nodeid, "outcome": outcome})
