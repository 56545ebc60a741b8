"""A pytest plugin loaded into DeepSpeed's own test run by ``benchmarks/conformance.py``.

At collection it writes one JSON line per test id to the file named by
``DS_PATRICKSTAR_CONFORMANCE_IDS`` with whether the test is a stage-3 parametrization (see
[Note: which tests are stage 3] in conformance.py).
It imports nothing of DeepSpeed's tests: it reads the collected items.
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
