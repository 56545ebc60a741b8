"""DeepSpeed's engine with this stage's checkpoints: DeepSpeed's folder layout and calls, our optimizer files,
each save a commit (see [Note: checkpoint format] in io/checkpoint.py, [Note: crash-safe save] and
[Note: checkpoint manifest] in io/commit.py). ``PatrickStarEngine`` derives from it."""

from __future__ import annotations

import os

from deepspeed import comm as dist
from deepspeed.runtime.engine import DeepSpeedEngine

from ..io import checkpoint, commit
from ..io.recovery_script import RECOVERY_SCRIPT
from .stage_answers import no_latest


class CheckpointingEngine(DeepSpeedEngine):
    """``save_checkpoint``/``load_checkpoint`` and the module state dict's frozen parameters for this stage."""

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        if self.checkpoint_engine.is_decoupled():
            raise commit.CheckpointError(
                f"{type(self.checkpoint_engine).__name__} writes the checkpoint's files after save_checkpoint "
                f"returns, so the completion marker could not list them whole (see [Note: crash-safe save]); "
                f"remove 'checkpoint': {{'writer': {{'decoupled': true}}}} or 'datastates_ckpt' from the config"
            )
        if self.global_rank == 0:
            commit.begin_save(save_dir, tag)
        dist.barrier()
        if getattr(self, "local_rank", 0) <= 0:  # see [Note: checkpoint manifest]
            commit.clear_rank_files(save_dir, tag)
        dist.barrier()
        self.optimizer.checkpoint_folder = os.path.join(save_dir, tag)  # see [Note: disk tier checkpoints]
        try:
            saved = super().save_checkpoint(
                save_dir,
                tag,
                client_state=client_state or {},
                save_latest=False,
                exclude_frozen_parameters=exclude_frozen_parameters,
            )
        finally:
            self.optimizer.checkpoint_folder = None
        if getattr(self, "local_rank", 0) <= 0:  # one rank per host (-1: unknown, so every rank)
            commit.sync_saved_files(save_dir, tag)
        dist.barrier()
        shares: list = [None] * dist.get_world_size()
        dist.all_gather_object(shares, commit.record_files(save_dir, tag, dist.get_rank(), dist.get_world_size()))
        if self.global_rank == 0:
            commit.write_marker(save_dir, tag, shares, _checkpoint_layout(self))
            if save_latest:
                commit.atomic_write_text(os.path.join(save_dir, "latest"), tag)
        dist.barrier()
        return saved

    def module_state_dict(self, destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False):
        """DeepSpeed's, with frozen groups not even gathered when they are left out (see [Note: frozen chunks])."""
        with self.optimizer.export.without_frozen(exclude_frozen_parameters):
            return super().module_state_dict(destination, prefix, keep_vars, exclude_frozen_parameters)

    def load_module_state_dict(self, checkpoint, strict=True, custom_load_fn=None, fetch_z3_params=False, **kwargs):
        """DeepSpeed's; a checkpoint saved with ``exclude_frozen_parameters=True`` (it holds none of the
        frozen parameters) leaves the model's own frozen values, and every other key must match."""
        frozen = self.optimizer.export.frozen_names(self.module)
        module = checkpoint["module"]
        if not strict or custom_load_fn is not None or not frozen or any(name in module for name in frozen):
            return super().load_module_state_dict(checkpoint, strict, custom_load_fn, fetch_z3_params, **kwargs)
        result = self.module.load_state_dict(module, strict=False)
        missing = sorted(set(result.missing_keys) - frozen)
        if missing or result.unexpected_keys:
            raise RuntimeError(
                f"checkpoint module state does not match the model: missing {missing[:5]}, "
                f"unexpected {sorted(result.unexpected_keys)[:5]}"
            )
        return None

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        if no_latest(load_dir, tag):
            return None, None
        tag = commit.resolve_tag(load_dir, tag)
        _verify_on_every_rank(load_dir, tag)
        checkpoint.check_model_file(self.optimizer.chunk_map, load_dir, tag)
        return super().load_checkpoint(load_dir, tag, **kwargs)

    def _copy_recovery_script(self, save_path):
        """Where DeepSpeed copies its zero_to_fp32.py, ours with DeepSpeed's command line (see [Note: the recovery
        script] in io/recovery_script.py)."""
        path = os.path.join(save_path, "zero_to_fp32.py")
        commit.atomic_write_text(path, RECOVERY_SCRIPT)
        os.chmod(path, 0o755)

    def _load_zero_checkpoint(self, load_dir, tag, load_optimizer_states=True):
        """The saved ranks' files this rank needs, one at a time: any world size can load (resharding)."""
        paths, world = checkpoint.optimizer_files(load_dir, tag)  # those the marker lists
        if not paths:
            raise checkpoint.CheckpointError(f"checkpoint {os.path.join(load_dir, tag)!r} has no optimizer files")
        saved = checkpoint.owned_optimizer_files(self.optimizer.chunk_map, paths, world)

        self.optimizer.load_state_dict(
            saved,
            load_optimizer_states=load_optimizer_states,
            load_from_fp32_weights=self.zero_load_from_fp32_weights(),
        )
        return True


def _checkpoint_layout(engine: CheckpointingEngine) -> dict[str, int]:
    """What the marker records of a save besides its files (see [Note: checkpoint manifest])."""
    chunk_map = engine.optimizer.chunk_map
    chunk_size = engine._patrickstar_config.chunk_size
    return {"world_size": chunk_map.world_size, "chunk_size": chunk_size, "chunks": len(chunk_map.chunks)}


def _verify_on_every_rank(load_dir: str, tag: str) -> None:
    """Each rank reads back its share of the tag's files; every rank raises the first problem found."""
    try:
        commit.verify_complete(load_dir, tag, dist.get_rank(), dist.get_world_size())
        problem = None
    except commit.CheckpointError as err:
        problem = str(err)
    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first:
        raise commit.CheckpointError(first)
