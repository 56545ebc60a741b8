"""Session setup for running DeepSpeed in-process on CPU with world size 1.

The environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT, thread counts) is set at
import time, before any test module imports deepspeed, so DeepSpeed's
accelerator detection and ``init_distributed`` see a consistent single-rank
world. The gloo process group itself is created lazily (by the ``dist``
fixture, or by :func:`harness.ensure_distributed` which ``run_training`` calls),
from a file store in a private temp dir, so no TCP rendezvous is needed.
"""
from __future__ import annotations

import gc
import os
import sys

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(_TESTS_DIR)
# tests/ for `import harness`; the repo root so the working tree's ds_patrickstar is the
# one tested (also with a bare `pytest`, which, unlike `python -m pytest`, adds no cwd).
for _p in (_REPO_ROOT, _TESTS_DIR):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import harness  # sets the environment and threads on import

harness.setup_single_process_env()

import pytest
import torch


def pytest_configure(config):
    # Also declared in pyproject.toml; repeating is harmless and keeps the
    # markers registered when pytest is run with a different rootdir/config.
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped on CPU-only machines)")
    config.addinivalue_line("markers", "slow: takes more than ~30 s on a 2-core CPU")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_collection_finish(session):
    # Every full collection (harness.run_training runs two per training run, to drop the engine's
    # hooked, partitioned model before the next run) walks every container object the process
    # holds: torch's, DeepSpeed's and transformers' modules and the test modules, ~0.2-0.8 s each
    # on this machine. They stay alive for the whole session anyway: freeze them out of the
    # collector's view, so a collection only walks what the tests made since.
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # The same before each test, before its fixtures: what the earlier tests left alive (modules
    # they imported lazily, kept results, module-scoped fixtures) goes out of the collector's view
    # too, after a collection that frees the cycles they dropped. A test's own objects stay in it.
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    # The worker pools of multiproc.run_ranks live for the whole session: end them here (an
    # atexit hook in multiproc does the same if this is skipped).
    multiproc = sys.modules.get("multiproc")
    if multiproc is not None:
        multiproc.shutdown()


@pytest.fixture(scope="session")
def dist():
    """Initialize the single-rank gloo process group (once) and DeepSpeed comm on it."""
    harness.ensure_distributed()
    yield
    # The group is left alive until interpreter exit: destroying and
    # re-creating a default process group in one process is fragile.
