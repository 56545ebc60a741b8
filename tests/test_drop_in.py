"""Issue 21: scripts users cannot edit run unmodified, fail helpfully, and save like the others.

One end-to-end test runs tests/scripts/hf_clm.py (a run_clm.py-shaped Trainer script that does
not import ds_patrickstar) as a user would: without DeepSpeed (the reference), through
``python -m ds_patrickstar`` on one process with no launcher variables, resumed there, and
through ``torchrun -m ds_patrickstar`` on 2 processes resuming the 1-process checkpoint. The
other tests check one finding each. Hugging Face tests skip without transformers.
"""
import configparser
import json
import logging
import os
import shutil
import subprocess
import sys
import types
import zipfile

import pytest
import torch
from harness import make_config
from multiproc import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "hf_clm.py")
CONFIG = os.path.join(ROOT, "configs", "hf_patrickstar.json")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT = 300


def _env(**extra):
    """The environment of a user's shell: no launcher variables, the working tree importable."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1", **extra)
    return env


def _run(cmd, cwd=None, **extra):
    return subprocess.run(cmd, env=_env(**extra), cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)


def _start(cmd, cwd=None, **extra):
    return subprocess.Popen(cmd, env=_env(**extra), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _side_by_side(*procs):
    """What :func:`_run` gives for each of ``procs`` (from :func:`_start`): independent runs, side by
    side on the machine's cores; any still running when one times out is killed."""
    try:
        outputs = [p.communicate(timeout=TIMEOUT) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def _ok(done):
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return done


# ---- 1: python -m ds_patrickstar --------------------------------------------------------
_PROBE = """import json, sys, deepspeed
print(json.dumps({"argv": sys.argv, "file": __file__, "name": __name__, "path0": sys.path[0],
                  "registered": getattr(deepspeed.initialize, "_ds_patrickstar_wrapper", False)}))
sys.exit(int(sys.argv[1]))
"""


def test_main_runs_a_script_and_a_module_as_python_does(tmp_path):
    (tmp_path / "probe.py").write_text(_PROBE)
    script, module, missing = _side_by_side(
        _start([sys.executable, "-m", "ds_patrickstar", "probe.py", "3", "--flag"], cwd=tmp_path),
        _start([sys.executable, "-m", "ds_patrickstar", "-m", "probe", "0"], cwd=tmp_path),
        _start([sys.executable, "-m", "ds_patrickstar", "nope.py"], cwd=tmp_path))
    assert script.returncode == 3, script.stderr[-3000:]  # the script's exit status
    seen = json.loads(script.stdout.strip().splitlines()[-1])
    assert seen == {"argv": ["probe.py", "3", "--flag"], "file": str(tmp_path / "probe.py"), "name": "__main__",
                    "path0": str(tmp_path), "registered": True}
    seen = json.loads(_ok(module).stdout.strip().splitlines()[-1])
    assert seen["argv"] == [str(tmp_path / "probe.py"), "0"] and seen["name"] == "__main__" and seen["registered"]
    assert missing.returncode != 0 and "can't open file" in missing.stderr


# ---- 2: the forgotten import ------------------------------------------------------------
_FORGOT = """import site, sys
site.addsitedir(sys.argv[1])  # as site-packages: runs ds_patrickstar_autoload.pth
assert "torch" not in sys.modules and "ds_patrickstar" not in sys.modules, "the hook imported too much"
import deepspeed, torch
model = torch.nn.Linear(4, 2)
cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": "patrickstar", "chunk_size": 1024},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
engine = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]
print("engine:", type(engine).__name__)
"""


def test_installed_stage_registers_when_deepspeed_is_imported_and_can_be_turned_off(tmp_path):
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    with open(os.path.join(ROOT, "ds_patrickstar_autoload.pth")) as f:
        (site_dir / "ds_patrickstar_autoload.pth").write_text(f.read())
    (tmp_path / "forgot.py").write_text(_FORGOT)
    launched = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port())}  # turned off, no-launcher help is off too: DeepSpeed's error
    # a .pth left behind by a moved or removed checkout: start-up stays silent (no traceback per process)
    done, off, orphan = _side_by_side(
        _start([sys.executable, "forgot.py", str(site_dir)], cwd=tmp_path),
        _start([sys.executable, "forgot.py", str(site_dir)], cwd=tmp_path, DS_PATRICKSTAR_AUTOLOAD="0", **launched),
        _start([sys.executable, "-I", "-S", "-c", f"import site; site.addsitedir({str(site_dir)!r})"], cwd=tmp_path))
    assert "engine: PatrickStarEngine" in _ok(done).stdout
    assert off.returncode != 0, off.stderr[-2000:]
    assert "chunk_size" in off.stderr and "Extra inputs are not permitted" in off.stderr, off.stderr[-2000:]
    assert orphan.returncode == 0 and orphan.stderr == "", orphan.stderr


def test_a_probe_does_not_disarm_the_import_hook(tmp_path, monkeypatch):
    """``importlib.util.find_spec`` (Hugging Face's ``is_deepspeed_available()``) finds the module
    without executing it: the hook must still fire, once, at the import that follows."""
    import importlib.util

    import ds_patrickstar_autoload

    (tmp_path / "probed_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    ds_patrickstar_autoload.after_import("probed_mod", seen.append)
    try:
        assert importlib.util.find_spec("probed_mod") is not None and importlib.util.find_spec("probed_mod")
        assert seen == [] and "probed_mod" not in sys.modules
        import probed_mod

        assert [m.__name__ for m in seen] == ["probed_mod"] and probed_mod.VALUE == 1
        assert not any(getattr(f, "name", None) == "probed_mod" for f in sys.meta_path)  # gone once it fired
    finally:
        sys.modules.pop("probed_mod", None)
        sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "name", None) != "probed_mod"]


_TRANSFORMERS_FIRST = """import site, sys
site.addsitedir(sys.argv[1])  # as site-packages: runs ds_patrickstar_autoload.pth
import transformers
from transformers.integrations import is_deepspeed_available
assert is_deepspeed_available() and "ds_patrickstar" not in sys.modules
""" + _FORGOT.split("the hook imported too much\"\n", 1)[1]


def test_stage_registers_when_transformers_probes_deepspeed_first(tmp_path):
    pytest.importorskip("transformers")
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    pth = os.path.join(ROOT, "ds_patrickstar_autoload.pth")
    (site_dir / "ds_patrickstar_autoload.pth").write_text(open(pth).read())
    (tmp_path / "hf_first.py").write_text(_TRANSFORMERS_FIRST)
    done = _ok(_run([sys.executable, "hf_first.py", str(site_dir)], cwd=tmp_path))
    assert "engine: PatrickStarEngine" in done.stdout


_REGISTERED = """import deepspeed
print("registered:", getattr(deepspeed.initialize, "_ds_patrickstar_wrapper", False))
"""

_PEFT_FIRST = """import importlib.util, site, sys
site.addsitedir(sys.argv[1])  # as site-packages: runs ds_patrickstar_autoload.pth
probes, find_spec = [], importlib.util.find_spec
importlib.util.find_spec = lambda name, *args: probes.append(name) or find_spec(name, *args)
import peft  # imports transformers and accelerate, whose is_deepspeed_available() probes deepspeed
importlib.util.find_spec = find_spec
assert "deepspeed" in probes and "deepspeed" not in sys.modules and "ds_patrickstar" not in sys.modules, probes
""" + _REGISTERED


def test_stage_registers_when_peft_is_imported_first(tmp_path):
    """Issue 32, item 2: ``import peft`` (transformers, accelerate: find_spec("deepspeed") probes)
    before ``import deepspeed``, in a fresh interpreter: the stage registers on the real import."""
    pytest.importorskip("peft", reason="peft is not installed (pip install peft, or the hf extra)")
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shutil.copy(os.path.join(ROOT, "ds_patrickstar_autoload.pth"), site_dir)
    (tmp_path / "peft_first.py").write_text(_PEFT_FIRST)
    done = _ok(_run([sys.executable, "peft_first.py", str(site_dir)], cwd=tmp_path))
    assert "registered: True" in done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The package built as a wheel (once for this module), or a skip saying why it cannot be; built
    from a copy of the tree without build outputs (an in-tree build/ would carry stale files in)."""
    out, tree = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("tree") / "src"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                                               ".ruff_cache", ".benchmarks", "runs", "out", "*.png"))
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(tree), "-w",
                  str(out)])
    if built.returncode != 0:
        pytest.skip(f"cannot build a wheel here (pip wheel --no-build-isolation failed): {built.stderr[-500:]}")
    (path,) = out.glob("ds_patrickstar-*.whl")
    return path


def test_wheel_ships_the_autoload_hook_into_site_packages(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "ds_patrickstar_autoload.pth" in names and "ds_patrickstar_autoload.py" in names  # the wheel's root


_FROM_THE_WHEEL = """import site, sys
sys.path.extend(site.getsitepackages())  # torch and deepspeed, without running any .pth found there (-S)
assert "ds_patrickstar_autoload" not in sys.modules  # nothing on this interpreter's own paths installs it
site.addsitedir(sys.argv[1])  # the folder pip installed the wheel into, as site-packages: runs its .pth
hook = sys.modules["ds_patrickstar_autoload"]
assert hook.__file__.startswith(sys.argv[1]) and "ds_patrickstar" not in sys.modules, hook.__file__
""" + _REGISTERED + """import ds_patrickstar
assert ds_patrickstar.__file__.startswith(sys.argv[1]), ds_patrickstar.__file__
"""


def test_stage_registers_from_the_hook_a_wheel_installs(wheel, tmp_path):
    """Issue 32, item 2: the wheel installed by pip (``--target``, a folder then read as
    site-packages), in a fresh interpreter without the working tree on its path: the wheel's own
    .pth installs the hook, and ``import deepspeed`` registers the stage from the installed package."""
    target = tmp_path / "site"
    installed = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                      str(target), str(wheel)])
    if installed.returncode != 0:
        pytest.skip(f"pip cannot install the wheel into a folder here: {installed.stderr[-500:]}")
    (tmp_path / "from_wheel.py").write_text(_FROM_THE_WHEEL)
    env = {k: v for k, v in _env().items() if k != "PYTHONPATH"}
    # -S: site-packages' own .pth files (an editable install's hook and finder) must not run
    done = subprocess.run([sys.executable, "-S", "from_wheel.py", str(target)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert "registered: True" in _ok(done).stdout


# ---- 3: one process without a launcher --------------------------------------------------
def test_single_process_env_fills_only_what_is_missing():
    from ds_patrickstar.integration.launch_env import fill_single_process_env

    env = {"MASTER_PORT": "29999"}
    assert fill_single_process_env(env) == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                                            "MASTER_ADDR": "127.0.0.1"}
    assert env["MASTER_PORT"] == "29999"
    fresh: dict = {}
    assert int(fill_single_process_env(fresh)["MASTER_PORT"]) > 0
    for launched in ({"RANK": "1"}, {"WORLD_SIZE": "2"}, {"LOCAL_RANK": "0"}, {"OMPI_COMM_WORLD_SIZE": "2"}):
        before = dict(launched)
        assert fill_single_process_env(launched) == {} and launched == before


# ---- 4: tied weights saved once ---------------------------------------------------------
class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(50, 16)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.wte(ids))))


def _tied_engine(stage):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    torch.manual_seed(0)
    model = _Tied()
    cfg = make_config(stage, chunk_size=1024) if stage == "patrickstar" else {
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    return deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]


def test_tied_weight_is_one_tensor_through_accelerates_save_path(dist, tmp_path):
    """accelerate's get_state_dict for a DeepSpeed engine that is not stage 3 clones the state dict
    with DeepSpeed's clone_tensors_for_torch_save; the tied names must still share one tensor, so
    torch.save and safetensors store it once. Stock stages are not affected (still cloned)."""
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from safetensors.torch import load_file, save_model

    engine = _tied_engine("patrickstar")
    state = engine.module.state_dict()
    assert state["wte.weight"] is state["head.weight"]
    saved = clone_tensors_for_torch_save(state)  # what accelerate.get_state_dict does
    assert saved["wte.weight"] is saved["head.weight"]
    assert saved["body.weight"] is state["body.weight"]  # a private host copy is not copied again
    torch.save(saved, tmp_path / "sd.pt")
    loaded = torch.load(tmp_path / "sd.pt")
    assert loaded["wte.weight"].untyped_storage().data_ptr() == loaded["head.weight"].untyped_storage().data_ptr()
    torch.testing.assert_close(loaded["head.weight"], state["wte.weight"], rtol=0, atol=0)
    save_model(engine.module, str(tmp_path / "m.safetensors"))
    assert len(load_file(str(tmp_path / "m.safetensors"))) == 3  # wte/head once, body weight and bias
    stock = clone_tensors_for_torch_save(_tied_engine(0).module.state_dict())
    assert stock["wte.weight"] is not stock["head.weight"]  # DeepSpeed's function, unchanged


# ---- 6: the Trainer's scheduler, 8: the DeepSpeed range ----------------------------------
def test_hf_config_leaves_the_schedule_to_the_trainer():
    config = json.load(open(CONFIG))
    assert "scheduler" not in config and config["zero_optimization"]["stage"] == "patrickstar"


def test_deepspeed_requirement_is_a_tested_range_holding_the_installed_version():
    import deepspeed
    from packaging.requirements import Requirement

    parser = configparser.ConfigParser()
    parser.read(os.path.join(ROOT, "setup.cfg"))
    requires = [Requirement(r) for r in parser["options"]["install_requires"].split("\n") if r.strip()]
    (ds,) = [r for r in requires if r.name == "deepspeed"]
    assert len(ds.specifier) == 2 and {s.operator for s in ds.specifier} == {">=", "<="}, str(ds.specifier)
    assert ds.specifier.contains(deepspeed.__version__), (str(ds.specifier), deepspeed.__version__)
    oldest = [s.version for s in ds.specifier if s.operator == ">="][0]
    assert f"OLDEST_DEEPSPEED={oldest}\n" in open(os.path.join(ROOT, ".ci", "run")).read()  # CI tests the oldest


# ---- 7: the warning names the flag script users pass -------------------------------------
def test_lost_world_warning_names_the_use_cpu_flag(dist, monkeypatch, caplog):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level(logging.WARNING, logger="ds_patrickstar.integration.registration"):
        _tied_engine("patrickstar")
    messages = [r.getMessage() for r in caplog.records if r.name == "ds_patrickstar.integration.registration"]
    assert len(messages) == 1 and "--use_cpu" in messages[0] and "use_cpu=True" in messages[0], messages


# ---- the exit: gloo's workers let go of the last collective first (see [Note: gloo workers idle at exit]) --
def test_patrickstar_initialize_registers_the_exit_wait_once(dist, monkeypatch):
    from ds_patrickstar.integration import process_exit

    registered = []
    monkeypatch.setattr(process_exit, "_registered_in", None)
    monkeypatch.setattr(process_exit, "atexit", types.SimpleNamespace(register=registered.append))
    _tied_engine(3)  # a stock stage registers nothing
    assert registered == []
    _tied_engine("patrickstar")
    _tied_engine("patrickstar")
    assert registered == [process_exit.wait_for_gloo_workers]
    # the workers it waits for are found under the name the installed torch gives them, and settle
    torch.distributed.all_reduce(torch.ones(4))
    assert process_exit.gloo_worker_states(), "no pt_gloo_runloop thread found: torch renamed gloo's workers?"
    assert process_exit.wait_until_settled(process_exit.gloo_worker_states)


def test_exit_wait_needs_every_worker_blocked_for_an_unbroken_spell():
    from ds_patrickstar.integration.process_exit import wait_until_settled

    def run(samples, settle_s=0.05, timeout_s=1.0):
        now = [0.0]
        seen = iter(samples)
        done = wait_until_settled(lambda: next(seen, samples[-1]), clock=lambda: now[0],
                                  sleep=lambda s: now.__setitem__(0, now[0] + 0.01), settle_s=settle_s,
                                  timeout_s=timeout_s)
        return done, round(now[0], 2)

    # a worker running (R) breaks the spell: settled 0.05 s after the last break
    assert run([["S", "S"], ["S", "R"], *[["S", "S"]] * 10]) == (True, 0.07)
    assert run([["S", "S"]] * 10) == (True, 0.05)
    assert run([["R", "S"]]) == (False, 1.0)  # bounded: never holds the exit longer than the timeout
    assert run([[]]) == (True, 0.05)  # no workers: nothing to wait for


# ---- Hugging Face: 5 (evaluation only) and the end-to-end run ----------------------------
def _clm(out, *args, deepspeed=True, launcher=("-m", "ds_patrickstar"), **extra):
    """hf_clm.py started (see :func:`_side_by_side`) into ``out``."""
    cmd = [*launcher, SCRIPT, "--output_dir", str(out), "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
           "--logging_steps", "1", "--learning_rate", "3e-3", *args]
    return _start(cmd + (["--deepspeed", CONFIG] if deepspeed else []), **extra)


def test_evaluation_without_training_runs(tmp_path):
    """--do_eval without --do_train: the eval loss of the same script without DeepSpeed."""
    pytest.importorskip("transformers")
    ours, plain = map(_ok, _side_by_side(
        _clm(tmp_path / "eval", "--do_eval", launcher=(sys.executable, "-m", "ds_patrickstar")),
        _clm(tmp_path / "plain", "--do_eval", deepspeed=False, launcher=(sys.executable,))))
    assert "ZeRO inference only makes sense" not in ours.stderr
    run, ref = (json.load(open(tmp_path / d / "run.json")) for d in ("eval", "plain"))
    assert abs(run["eval_loss"] - ref["eval_loss"]) < 1e-4, (run, ref)


def _saved_tensors(folder):
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k).numel() for k in f.keys()}


def test_unmodified_hf_script_one_process_without_launcher_and_two_with_torchrun(tmp_path):
    pytest.importorskip("transformers")
    from transformers import GPT2LMHeadModel

    train = ("--do_train", "--do_eval", "--max_steps", "6", "--save_steps", "3")
    python = (sys.executable, "-m", "ds_patrickstar")
    plain, ours = _side_by_side(
        _clm(tmp_path / "plain", *train, "--per_device_train_batch_size", "4", deepspeed=False,
             launcher=(sys.executable,)),
        _clm(tmp_path / "ours", *train, "--per_device_train_batch_size", "4", launcher=python))
    for done in (plain, ours):
        _ok(done)
    assert "no launcher variables" in ours.stderr  # and what was set
    ref, run = (json.load(open(tmp_path / d / "run.json")) for d in ("plain", "ours"))
    assert run["world_size"] == 1 and set(run["losses"]) == {str(s) for s in range(1, 7)}
    # the Trainer's own schedule (no scheduler block): the same numbers as without DeepSpeed
    for step, loss in ref["losses"].items():
        assert abs(run["losses"][step] - loss) < 1e-4, (step, run["losses"][step], loss)
    assert abs(run["eval_loss"] - ref["eval_loss"]) < 1e-4
    # tied lm_head/wte stored once: as many tensors (and elements) as without DeepSpeed
    assert _saved_tensors(tmp_path / "ours") == _saved_tensors(tmp_path / "plain")
    assert GPT2LMHeadModel.from_pretrained(tmp_path / "ours").config.n_layer == 2
    # resume on 1 process: identical losses; and torchrun -m ds_patrickstar on 2 processes, resuming
    # the 1-process checkpoint (same global batch)
    ckpt = str(tmp_path / "ours" / "checkpoint-3")
    torchrun = ("torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "ds_patrickstar")
    again, _ = map(_ok, _side_by_side(
        _clm(tmp_path / "again", *train, "--per_device_train_batch_size", "4", "--resume_from_checkpoint", ckpt,
             launcher=python),
        _clm(tmp_path / "two", *train, "--per_device_train_batch_size", "2", "--resume_from_checkpoint", ckpt,
             launcher=torchrun)))
    resumed = json.load(open(tmp_path / "again" / "run.json"))
    assert {s: resumed["losses"][s] for s in "456"} == {s: run["losses"][s] for s in "456"}, again.stderr[-2000:]
    two = json.load(open(tmp_path / "two" / "run.json"))
    assert two["world_size"] == 2
    for step in "456":
        assert abs(two["losses"][step] - run["losses"][step]) < 1e-4, (step, two["losses"][step], run["losses"][step])
    assert abs(two["eval_loss"] - resumed["eval_loss"]) < 1e-4
    assert _saved_tensors(tmp_path / "two") == _saved_tensors(tmp_path / "plain")
