"""``import ds_patrickstar`` must leave stock DeepSpeed untouched: a stock training run
(ZeRO stage 0, 1, 2 or 3) is bit-identical with and without the import.

Stage 3 gets the broader set (several quirk models, fp32 and bf16); stages 0, 1 and 2
each run one small quirk model (tied weights, gradient accumulation, clipping, weight
decay) for 4 steps in fp32 and in bf16. All runs of the module share one subprocess pair
(one without the import, one with it) to keep the added runtime small. All four stages
run on DeepSpeed's CPU accelerator in both dtypes (with
DeepSpeed 0.19: stage 0 fp32 steps the bare optimizer and reports no global grad norm,
so it records ``None``; stage 0 bf16 wraps it in ``FP16_Optimizer``; stages 1 and 2 in
``DeepSpeedZeroOptimizer``).

The runs happen in fresh subprocesses (so nothing the import patches can leak into
the "without" runs; the "without" one sets ``DS_PATRICKSTAR_AUTOLOAD=0``, since an installed
package otherwise registers itself when DeepSpeed is imported); for each run they print its
per-micro-step losses, grad norms, LRs,
the optimizer class DeepSpeed picked and a SHA-256 of the final fp32 master and module
weights as JSON, and the two outputs must be equal run by run. If ``import ds_patrickstar`` fails, the
"with" subprocess fails and so does the test (intended: no skip).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
TIMEOUT_S = 600  # generous: a cold run JIT-builds DeepSpeed's CPU ops first
MARKER = "@@RESULT@@"

_SCRIPT = r"""
import sys, json, hashlib, warnings
IMPORT_PS = sys.argv[1] == "1"
if IMPORT_PS:
    import ds_patrickstar  # noqa: F401  -- imported first, as a user would
sys.path.insert(0, sys.argv[2])
warnings.filterwarnings("ignore")
import torch
import harness
harness.setup_single_process_env()
from harness import make_config, run_training
from quirk_models import QUIRK_MODELS

def digest(weights):
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().contiguous()
        h.update(name.encode()); h.update(str(t.dtype).encode()); h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()

out = {}
for label, model, stage, dtype, kw in json.loads(sys.argv[3]):
    r = run_training(QUIRK_MODELS[model], make_config(stage, dtype, **kw), 4, 7)
    out[label] = {
        "losses": [float.hex(x) for x in r.losses],
        "grad_norms": [None if g is None else float.hex(g) for g in r.grad_norms],
        "lrs": r.lrs,
        "optimizer": r.optimizer_class,
        "fp32_sha256": digest(r.fp32_weights),
        "lp_sha256": digest(r.lp_weights),
    }
out["ds_patrickstar_loaded"] = "ds_patrickstar" in sys.modules
print("@@RESULT@@" + json.dumps(out, sort_keys=True), flush=True)
"""

# [label, quirk model, ZeRO stage, dtype, make_config kwargs]
_TIED_KW = {"gas": 2, "clip": 0.1, "weight_decay": 0.1}
RUNS = {
    "fp32": [
        ["fp32-tied-ga2-clip", "tied", 3, "fp32", _TIED_KW],
        ["fp32-frozen", "frozen", 3, "fp32", {"scheduler": "WarmupLR"}],
    ],
    "bf16": [
        ["bf16-tied-ga2-clip", "tied", 3, "bf16", _TIED_KW],
        ["bf16-ckpt", "ckpt_reentrant", 3, "bf16", {}],
    ],
}
RUNS_STAGES_012 = [
    [f"stage{stage}-{dtype}-tied-ga2-clip", "tied", stage, dtype, _TIED_KW]
    for stage in (0, 1, 2) for dtype in ("fp32", "bf16")
]


def _start(import_ps: bool, runs) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    # a fresh port per child (conftest set one for this process); the group itself uses a file store
    env.pop("MASTER_PORT", None)
    # An installed package also registers itself when DeepSpeed is imported (ds_patrickstar_autoload.pth);
    # the baseline process turns that off, and its ds_patrickstar_loaded check shows the switch works.
    env["DS_PATRICKSTAR_AUTOLOAD"] = "0" if not import_ps else env.get("DS_PATRICKSTAR_AUTOLOAD", "1")
    return subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, "1" if import_ps else "0", TESTS_DIR, json.dumps(runs)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen, import_ps: bool) -> dict:
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    lines = [ln for ln in stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        pytest.fail(
            f"subprocess ({'with' if import_ps else 'without'} import ds_patrickstar) failed, rc={proc.returncode}\n"
            f"--- stderr (tail) ---\n{stderr[-4000:]}\n--- stdout (tail) ---\n{stdout[-2000:]}"
        )
    return json.loads(lines[-1][len(MARKER):])


ALL_RUNS = RUNS["fp32"] + RUNS["bf16"] + RUNS_STAGES_012


@pytest.fixture(scope="module")
def outputs():
    """Every run of this module in one subprocess without and one with the import (the same runs
    in the same order on both sides): two interpreter start-ups instead of six, run side by side
    (one thread each; separate processes, so neither run's numbers depend on the other)."""
    procs = {import_ps: _start(import_ps, ALL_RUNS) for import_ps in (False, True)}
    try:
        without, with_ps = (_result(procs[import_ps], import_ps) for import_ps in (False, True))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert without.pop("ds_patrickstar_loaded") is False
    assert with_ps.pop("ds_patrickstar_loaded") is True
    assert sorted(without) == sorted(with_ps) == sorted(r[0] for r in ALL_RUNS)
    return without, with_ps


def _assert_bit_identical(outputs, runs) -> None:
    without, with_ps = outputs
    for label, _, stage, _, _ in runs:
        assert with_ps[label] == without[label], (
            f"{label}: stock ZeRO stage {stage} changed by `import ds_patrickstar`:\n"
            f"  without: {without[label]}\n  with:    {with_ps[label]}"
        )


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_import_leaves_stock_stage3_bit_identical(outputs, dtype):
    _assert_bit_identical(outputs, RUNS[dtype])


def test_import_leaves_stock_stages_0_1_2_bit_identical(outputs):
    """Stages 0, 1 and 2, fp32 and bf16 each."""
    _assert_bit_identical(outputs, RUNS_STAGES_012)
