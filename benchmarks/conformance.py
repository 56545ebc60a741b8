"""DeepSpeed's own ZeRO-3 unit tests, run stock and for stage "patrickstar": a conformance table.

    python benchmarks/conformance.py --out /tmp/conformance      # the full run (an hour or more on 2 cores)
    python benchmarks/conformance.py --out DIR --ids 'unit/...::Test::test[3]' ...   # some ids

[Note: conformance runner]
The tests are DeepSpeed's (``../shared/peer/ds_tests_edaa722_subset.tgz``, or the file named by
``DS_PATRICKSTAR_PEER_TESTS``); they are unpacked into a temporary folder at run time, never copied
into this project. Each selected test file runs in its own pytest, twice: as written ("stock") and
with ``DS_PATRICKSTAR_CONFORMANCE_STAGE=patrickstar`` ("ours"), which makes our
``deepspeed.initialize`` wrapper read every stage-3 config as stage "patrickstar" (see
[Note: conformance stage rewrite] in ds_patrickstar/integration/registration.py; an environment
variable, because DeepSpeed's harness starts its ranks through a forkserver that a conftest does not
reach). ``deepspeed.zero.Init`` is left as the test wrote it. The environment is the one
DeepSpeed's tests need on a CPU: ``DS_ACCELERATOR=cpu LOCAL_SIZE=2 OMP_NUM_THREADS=1
DS_DISABLE_REUSE_DIST_ENV=1`` and ``DS_UNITTEST_TIMEOUT``. Results come from pytest's JUnit XML.

The output folder gets ``table.tsv`` (test id, stock, ours, and the reason when the test is in
``conformance_not_applicable.txt``), ``summary.json`` (the counts) and one log per file and variant.
The target: every test stock passes passes for ours, except the listed ones.

[Note: a killed test run]
A rank that dies in a test (a segfault, as reading a parameter whose chunk memory was released did
before [Note: released parameters read as empty]) takes its task with it: the harness's pool
starts a new worker, the result never comes, and after ``DS_UNITTEST_TIMEOUT`` the harness's
``pool.join()`` waits forever (the pool's worker handler runs while a task is outstanding). The pytest
is then killed past the file's limit, and a killed pytest writes no JUnit XML. So pytest runs with
``conformance_plugin``, which writes each test's start and outcome as they happen: the tests that
finished keep their results, the one running when the run was killed is ``timeout`` (``crashed``
where the log shows a fatal error: pytest runs with ``-s`` and ``PYTHONFAULTHANDLER=1``, so a dying
rank's Python traceback is in the log), and the ids after it run again. Without it the first id of
the run took the blame and the ids that had passed ran again, each new run killed by the same test
(five passing tests of ``test_zero_optimizer.py`` read as hung).

[Note: which tests are stage 3]
A test is selected (``conformance_plugin.py``) when a parameter named like ``*stage*`` is 3, or,
without such a parameter, when its function's source passes stage 3 (``"stage": 3``,
``zero_stage=3``) or reads a module-level config dict whose stage is 3.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

logger = logging.getLogger("conformance")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TARBALL_ENV = "DS_PATRICKSTAR_PEER_TESTS"
TARBALL_NAME = "ds_tests_edaa722_subset.tgz"
NOT_APPLICABLE = HERE / "conformance_not_applicable.txt"
TEST_DIRS = ("unit/runtime/zero", "unit/checkpoint", "unit/v1/zero")
VARIANTS = ("stock", "ours")
GRACE_S = 120  # a pytest runs at most DS_UNITTEST_TIMEOUT per id and this long beyond, then is killed


def find_tarball() -> Path | None:
    """The tests' tarball: ``$DS_PATRICKSTAR_PEER_TESTS``, else ``../shared/peer/`` beside the checkout."""
    named = os.environ.get(TARBALL_ENV)
    candidates = [Path(named)] if named else [REPO.parent / "shared" / "peer" / TARBALL_NAME]
    return next((p for p in candidates if p.is_file()), None)


def unpack(tarball: Path, dest: Path) -> Path:
    """Unpack into ``dest``; returns the folder holding DeepSpeed's ``pytest.ini`` (``tests``)."""
    with tarfile.open(tarball) as tar:
        tar.extractall(dest, filter="data")
    return dest / "tests"


def test_env(variant: str, timeout_s: int) -> dict[str, str]:
    env = dict(os.environ)
    # a PYTHONPATH already set comes first: a run may test a snapshot of the package
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO), str(HERE)]
    env.update(
        PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)),
        DS_ACCELERATOR="cpu",
        LOCAL_SIZE="2",
        OMP_NUM_THREADS="1",
        DS_DISABLE_REUSE_DIST_ENV="1",
        DS_UNITTEST_TIMEOUT=str(timeout_s),
        PYTHONFAULTHANDLER="1",
    )
    env.pop("DS_PATRICKSTAR_CONFORMANCE_STAGE", None)
    if variant == "ours":
        env["DS_PATRICKSTAR_CONFORMANCE_STAGE"] = "patrickstar"
    return env


def collect(root: Path, dirs: tuple[str, ...] = TEST_DIRS) -> list[dict]:
    """Every test id under ``dirs`` with whether it is a stage-3 one (see [Note: which tests are stage 3])."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as out:
        env = test_env("stock", 60)
        env["DS_PATRICKSTAR_CONFORMANCE_IDS"] = out.name
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "conformance_plugin"]
        cmd += ["-p", "no:cacheprovider", *dirs]
        subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        return [json.loads(line) for line in out.read().splitlines() if line.strip()]


def junit_results(path: Path) -> dict[str, str]:
    """Test id -> passed / failed / error / skipped from pytest's JUnit XML."""
    results: dict[str, str] = {}
    if not path.is_file():
        return results
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        name = case.get("name", "")
        kinds = {child.tag for child in case}
        outcome = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
        results[_node_id(module, name)] = {"failure": "failed"}.get(outcome, outcome)
    return results


def _node_id(classname: list[str], name: str) -> str:
    """JUnit's ``unit.v1.zero.test_zero.TestX`` + ``test[3]`` -> ``unit/v1/zero/test_zero.py::TestX::test[3]``."""
    for i in range(len(classname), 0, -1):
        if classname[i - 1].startswith("test_"):
            path = "/".join(classname[:i]) + ".py"
            return "::".join([path, *classname[i:], name])
    return "::".join([*classname, name])


def progress_results(path: Path) -> tuple[dict[str, str], str | None]:
    """Test id -> outcome from ``conformance_plugin``'s progress file, and the test started but not reported
    (the one running when the run ended; None when there is none); see [Note: a killed test run]."""
    results: dict[str, str] = {}
    running: str | None = None
    lines = path.read_text().splitlines() if path.is_file() else []
    for record in (json.loads(line) for line in lines if line.strip()):
        if "start" in record:
            running = record["start"]
            continue
        test_id, outcome = record["id"], record["outcome"]
        if results.get(test_id, "passed") == "passed":  # a failed teardown after a passed call: an error
            results[test_id] = outcome
        running = None if test_id == running else running
    return results, running


def _pytest(root: Path, ids: list[str], variant: str, out: Path, timeout_s: int, attempt: int) -> dict[str, str]:
    """The results of one pytest over ``ids``; where it did not finish, the test it was running is ``timeout``
    (``crashed`` where the log shows a fatal error) and the ids it did not reach have none."""
    stem = ids[0].split("::")[0].replace("/", "_").removesuffix(".py") + (f".{attempt}" if attempt else "")
    xml, log = out / f"{stem}.{variant}.xml", out / f"{stem}.{variant}.log"
    progress = out / f"{stem}.{variant}.progress.jsonl"
    progress.unlink(missing_ok=True)
    env = {**test_env(variant, timeout_s), "DS_PATRICKSTAR_CONFORMANCE_PROGRESS": str(progress)}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "conformance_plugin", "-s", "--color=no"]
    cmd += ["-rA", f"--junitxml={xml}", *ids]
    with open(log, "w") as f:
        try:
            subprocess.run(
                cmd, cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT,
                timeout=timeout_s * len(ids) + GRACE_S, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            f.write("\n[conformance] killed past the file's limit\n")
    results, running = progress_results(progress)
    results.update(junit_results(xml))
    if running is not None and running not in results:
        results[running] = "crashed" if "Fatal Python error" in log.read_text(errors="replace") else "timeout"
    return results


def run_file(root: Path, ids: list[str], variant: str, out: Path, timeout_s: int) -> dict[str, str]:
    """One pytest over ``ids`` (one file's). DeepSpeed's harness ends the whole pytest when a test hangs past
    ``DS_UNITTEST_TIMEOUT`` (or the pytest is killed past the file's limit): the test it was running is
    ``timeout`` (or ``crashed``), and the ids it did not reach run again in a new pytest (see
    [Note: a killed test run]); where no test even started, the first id is ``timeout``."""
    started, results, todo, attempt = time.monotonic(), {}, list(ids), 0
    while todo:
        got = _pytest(root, todo, variant, out, timeout_s, attempt)
        results.update({i: got[i] for i in todo if i in got})
        missing = [i for i in todo if i not in got]
        if missing and len(missing) == len(todo):  # nothing started (a collection error, say)
            results[missing[0]] = "timeout"
            missing = missing[1:]
        todo, attempt = missing, attempt + 1
    stem = ids[0].split("::")[0]
    logger.info("%s %s: %s in %.0f s", variant, stem, dict(Counter(results.values())), time.monotonic() - started)
    return results


def not_applicable(path: Path = NOT_APPLICABLE) -> dict[str, str]:
    """Test id (or a prefix ending in ``::`` or ``[``) -> why it does not apply to our stage."""
    table: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            test_id, _, reason = line.partition("  # ")
            table[test_id.strip()] = reason.strip()
    return table


def reason_for(test_id: str, table: dict[str, str]) -> str:
    return next((why for key, why in table.items() if test_id == key or test_id.startswith(key)), "")


def summarize(rows: list[tuple[str, str, str, str]]) -> dict:
    stock_pass = [r for r in rows if r[1] == "passed"]
    missing = [r[0] for r in stock_pass if r[2] != "passed" and not r[3]]
    return {
        "selected": len(rows),
        "stock_passed": len(stock_pass),
        "ours_passed": sum(r[2] == "passed" for r in rows),
        "ours_passed_of_stock_passed": sum(r[2] == "passed" for r in stock_pass),
        "not_applicable_listed": sum(bool(r[3]) for r in rows),
        "stock_passed_ours_not_and_not_listed": missing,
    }


def _stock_did_not_pass(out: Path, ids: list[str]) -> list[str]:
    saved = out / "results.stock.json"
    stock = json.loads(saved.read_text()) if saved.is_file() else {}
    return [i for i in ids if i in stock and stock[i] != "passed"]


def run(
    root: Path, ids: list[str], out: Path, variants: tuple[str, ...], timeout_s: int, only_stock_passed: bool = False
) -> dict:
    """Run ``ids`` for ``variants``, file by file; each variant's results are saved as they come
    (``results.<variant>.json``), so two runners (one per variant) may share ``out``; the table is
    written from whatever results ``out`` holds. ``only_stock_passed``: "ours" skips the ids whose
    stock result is already known and not a pass (``not run``)."""
    out.mkdir(parents=True, exist_ok=True)
    by_file: dict[str, list[str]] = {}
    for test_id in ids:
        by_file.setdefault(test_id.split("::")[0], []).append(test_id)
    for variant in variants:
        saved = out / f"results.{variant}.json"
        results = json.loads(saved.read_text()) if saved.is_file() else {}
        for file_ids in by_file.values():
            todo = [i for i in file_ids if results.get(i, "timeout") == "timeout"]  # a rerun retries timeouts
            if variant == "ours" and only_stock_passed:
                results.update(dict.fromkeys(_stock_did_not_pass(out, todo), "not run"))
                todo = [i for i in todo if results.get(i, "timeout") == "timeout"]
            if todo:
                results.update(run_file(root, todo, variant, out, timeout_s))
                saved.write_text(json.dumps(results, indent=0))
    return write_table(out, ids)


def write_table(out: Path, ids: list[str]) -> dict:
    """The table of ``ids`` and of every other id ``out`` holds a result for."""
    results = {v: json.loads(p.read_text()) for v in VARIANTS if (p := out / f"results.{v}.json").is_file()}
    ids = list(dict.fromkeys([*ids, *(i for r in results.values() for i in r)]))
    table = not_applicable()
    stock, ours = results.get("stock", {}), results.get("ours", {})
    rows = [(i, stock.get(i, "-"), ours.get(i, "-"), reason_for(i, table)) for i in ids]
    with open(out / "table.tsv", "w") as f:
        f.write("test id\tstock\tours\tnot applicable because\n")
        f.writelines("\t".join(r) + "\n" for r in rows)
    summary = summarize(rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for table.tsv, summary.json and the logs")
    parser.add_argument("--ids", nargs="*", help="these test ids only (default: every stage-3 one)")
    parser.add_argument("--files", nargs="*", help="the stage-3 ids of these files only (paths under tests/)")
    parser.add_argument("--variants", default="stock,ours", help="stock, ours or both (comma-separated)")
    parser.add_argument(
        "--only-stock-passed", action="store_true", help="ours: skip ids stock is known not to pass (saves time)"
    )
    parser.add_argument("--timeout", type=int, default=300, help="DS_UNITTEST_TIMEOUT, seconds per test")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    tarball = find_tarball()
    if tarball is None:
        logger.error("DeepSpeed's tests not found: set %s to %s", TARBALL_ENV, TARBALL_NAME)
        return 2
    with tempfile.TemporaryDirectory(prefix="ds_conformance_") as tmp:
        root = unpack(tarball, Path(tmp))
        ids = args.ids or [t["id"] for t in collect(root, tuple(args.files or TEST_DIRS)) if t["stage3"]]
        logger.info("%d test ids from %s", len(ids), tarball)
        summary = run(root, ids, args.out, tuple(args.variants.split(",")), args.timeout, args.only_stock_passed)
    logger.info("%s", json.dumps({k: v for k, v in summary.items() if not isinstance(v, list)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
