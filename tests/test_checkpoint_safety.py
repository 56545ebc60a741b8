"""Our checkpoint files are read without pickle (issue 18, item 12; [Note: loading without pickle]):
a file carrying code is refused before the code runs, while a user's client_state objects still
come back through engine.load_checkpoint as DeepSpeed loads them for every stage. In-process."""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import pathlib
import subprocess
import sys

import harness
import pytest
import torch
from harness import make_config


@dataclasses.dataclass
class Note:
    """A user object in client_state (not a tensor, container or number)."""

    text: str


class _Touch:
    """Unpickling it creates ``path``: stands for any code a crafted checkpoint would run."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


def _engine_with_a_checkpoint(save_dir: pathlib.Path, client_state: dict | None = None):
    import deepspeed

    import ds_patrickstar  # noqa: F401

    harness.ensure_distributed()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    engine, *_ = deepspeed.initialize(model=model, config=make_config("patrickstar", "bf16", chunk_size=1024),
                                      model_parameters=model.parameters())
    engine.backward(engine(torch.randn(8, 8, dtype=torch.bfloat16)).float().sum())
    engine.step()
    engine.save_checkpoint(str(save_dir), tag="t", client_state=client_state or {})
    return engine


def test_a_checkpoint_file_that_carries_code_is_refused_before_it_runs(tmp_path):
    from ds_patrickstar import consolidate_fp32_state_dict
    from ds_patrickstar.io.checkpoint import CheckpointError
    from ds_patrickstar.io.commit import write_marker

    engine = _engine_with_a_checkpoint(tmp_path)
    ran = tmp_path / "code_ran"
    (optim,) = glob.glob(os.path.join(tmp_path, "t", "*optim_states.pt"))
    saved = torch.load(optim, weights_only=False)  # trusted: this test wrote it
    saved["optimizer_state_dict"]["extra"] = _Touch(ran)
    torch.save(saved, optim)
    write_marker(str(tmp_path), "t")  # sizes match again: what refuses the file is the loader
    with pytest.raises(CheckpointError, match=r"optim_states\.pt' holds objects .* weights-only"):
        engine.load_checkpoint(str(tmp_path), tag="t")
    with pytest.raises(CheckpointError, match="weights-only"):
        consolidate_fp32_state_dict(str(tmp_path), "t")
    assert not ran.exists()
    engine.destroy()


def test_client_state_objects_still_come_back(tmp_path):
    engine = _engine_with_a_checkpoint(tmp_path, client_state={"note": Note("kept"), "step": 7})
    _, client_state = engine.load_checkpoint(str(tmp_path), tag="t")
    assert client_state["note"] == Note("kept") and client_state["step"] == 7
    engine.destroy()


def test_a_save_into_an_existing_tag_that_dies_part_way_is_refused_not_loaded_mixed(tmp_path, monkeypatch):
    """[Note: crash-safe save]: tag "t" saved at step 1, a step, then a re-save of "t" that dies after
    DeepSpeed rewrote the model file and before the optimizer files (as a SIGKILL there would): the
    tag, and ``latest`` which names it, are refused (the old marker listed the same names and sizes,
    so the folder of new model and old optimizer states loaded). The re-save done again loads step 2."""
    from ds_patrickstar.io.checkpoint import CheckpointError

    engine = _engine_with_a_checkpoint(tmp_path)
    engine.backward(engine(torch.randn(8, 8, dtype=torch.bfloat16)).float().sum())
    engine.step()

    def killed(*args, **kwargs):
        raise RuntimeError("killed while saving the optimizer files")

    with monkeypatch.context() as patch:
        patch.setattr(engine, "_save_zero_checkpoint", killed)
        with pytest.raises(RuntimeError, match="killed"):
            engine.save_checkpoint(str(tmp_path), tag="t")
    for tag in ("t", None):
        with pytest.raises(CheckpointError, match="incomplete"):
            engine.load_checkpoint(str(tmp_path), tag=tag)
    engine.save_checkpoint(str(tmp_path), tag="t")
    expected = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.backward(engine(torch.randn(8, 8, dtype=torch.bfloat16)).float().sum())
    engine.step()
    engine.load_checkpoint(str(tmp_path))
    assert engine.global_steps == 2
    assert all(torch.equal(expected[k], v) for k, v in engine.module.state_dict().items())
    engine.destroy()


@pytest.mark.parametrize("damage", ["one_byte_of_optim", "one_byte_of_model", "optim_removed"])
def test_a_damaged_file_is_refused_naming_tag_file_problem_and_the_previous_tag(tmp_path, damage):
    """[Note: crash-safe save]: the marker holds each file's CRC-32, so one flipped byte (same size) is
    refused, naming the tag, the file, what is wrong and the complete tag to load instead, which loads."""
    from ds_patrickstar.io.checkpoint import CheckpointError

    engine = _engine_with_a_checkpoint(tmp_path)  # tag "t"
    engine.save_checkpoint(str(tmp_path), tag="prev")
    engine.backward(engine(torch.randn(8, 8, dtype=torch.bfloat16)).float().sum())
    engine.step()
    engine.save_checkpoint(str(tmp_path), tag="t")
    pattern = "*optim_states.pt" if damage != "one_byte_of_model" else "*model_states.pt"
    (path,) = (tmp_path / "t").glob(pattern)
    if damage == "optim_removed":
        path.unlink()
        problem = f"is missing {path.name}"
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        problem = f"has {path.name} whose crc32 is .* corrupted"
    for tag in ("t", None):  # None: `latest`, which names "t"
        with pytest.raises(CheckpointError, match=rf"tag 't' .*{problem}.*tag='prev'"):
            engine.load_checkpoint(str(tmp_path), tag=tag)
    engine.load_checkpoint(str(tmp_path), tag="prev")
    assert engine.global_steps == 1
    engine.destroy()


def test_a_resave_into_the_same_tag_killed_anywhere_is_refused_or_resumes_exactly(tmp_path):
    """Issue 32, item 1: tag "last" saved at step 2 (and "step2"), re-saved at step 4 and SIGKILLed at
    each of eight points of that save (tests/scripts/resave_kill.py). Until the new marker is in place
    the tag, and ``latest`` which names it, are refused, naming "step2" to load instead; once it is,
    "last" resumes at step 4 to the uninterrupted run's losses; "step2" always resumes exactly."""
    script = pathlib.Path(__file__).parent / "scripts" / "resave_kill.py"
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@RESULT@@")]
    result = json.loads(line[len("@@RESULT@@"):])
    reference = result.pop("reference")
    assert len(result) == 8
    for point, got in result.items():
        assert got["step2"] == {"global_steps": 2, "losses": reference[2:4]}, point
        latest = got["latest"]
        if "refused" not in latest:  # whatever loaded is one step's state: it trains as the run did
            step = latest["global_steps"]
            assert latest["losses"] == reference[step : step + 2], f"{point}: a mixed checkpoint loaded: {latest}"
        if point == "marker_written_latest_not":
            assert latest.get("global_steps") == 4, (point, latest)
        else:
            refused = latest.get("refused", "")
            assert "tag 'last'" in refused and "incomplete" in refused and "tag='step2'" in refused, (point, latest)


def test_a_decoupled_checkpoint_writer_is_refused_before_the_tag_is_touched(tmp_path, monkeypatch):
    """DeepSpeed's decoupled writers (and DataStates) write the files after save_checkpoint returns:
    the marker could not vouch for them, so the save is refused, naming the setting; the tag stays."""
    from ds_patrickstar.io.checkpoint import CheckpointError

    engine = _engine_with_a_checkpoint(tmp_path)  # tag "t", step 1
    monkeypatch.setattr(engine.checkpoint_engine, "is_decoupled", lambda: True)
    with pytest.raises(CheckpointError, match=r"after save_checkpoint returns.*'decoupled': true"):
        engine.save_checkpoint(str(tmp_path), tag="t")
    monkeypatch.undo()
    engine.load_checkpoint(str(tmp_path), tag="t")
    assert engine.global_steps == 1
    engine.destroy()
