"""``engine.offload_states()`` / ``engine.reload_states()``: everything the engine holds on the accelerator goes
to the host, and back.

[Note: parked engines]
OpenRLHF and other RLHF loops park a training engine between rollouts so that an inference engine gets the
accelerator (stock ZeRO-3's ``offload_states``/``reload_states``). Here what the engine holds on the accelerator
is its chunks and their optimizer states: ``offload_states`` first empties the partition cache (the gathered
groups go, see [Note: the partition cache]), then moves every owned chunk on the accelerator (its low-precision
payload and any gradient accumulator) to the host through placement (so placement knows where they are), and
every optimizer state (fp32 master, ``exp_avg``, ``exp_avg_sq``) to the host, each copy waited on: the
accelerator ledger holds nothing of the engine afterwards. ``reload_states`` brings back exactly what was moved:
the same chunks (room made by placement) and the same optimizer states, so the steps that follow run as they
would have without the parking, bit for bit. Without either call the engine still works: a chunk a forward uses
is brought back by placement, the optimizer states by the step's placement plan.

Stock's arguments: ``include`` names stock's buffers; here the chunks are ``lp_params`` (their accumulators,
``lp_grads``, go with them), the optimizer states ``optim_states`` and ``hp_params`` (one record per chunk:
naming either moves both); ``contiguous_grad_buffer`` names nothing held between steps. ``device`` must be
``cpu`` (``none`` warns and returns, ``nvme`` raises, as stock); ``pin_memory`` and ``non_blocking`` are
ignored: host buffers come from the engine's host pool (pinned where the accelerator is a GPU) and the copies
complete before the call returns. It is refused inside a forward or backward, and between a backward and the
step (the slots hold gradients then); with no accelerator to leave (a CPU run without the emulated one) it does
nothing and says so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

from ..chunks.state import TensorState
from .assembly import ChunkedModel

logger = logging.getLogger(__name__)

_CHUNKS = {OffloadStateTypeEnum.lp_params, OffloadStateTypeEnum.lp_grads}
_STATES = {OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params}


class StateParking:
    """What ``offload_states`` moved, for ``reload_states``; see [Note: parked engines]."""

    def __init__(self, parts: ChunkedModel) -> None:
        self.parts = parts
        self.chunks: list[int] = []  # owned chunks moved to the host
        self.states: set[int] = set()  # chunks whose optimizer states were moved to the host

    def _check_between_steps(self, what: str) -> None:
        run, infos = self.parts.run, self.parts.chunk_map.infos()
        if run.mid_iteration() or any(info.state is TensorState.HOLD_AFTER_BWD for info in infos):
            raise RuntimeError(
                f"engine.{what}() was called inside an iteration (a forward, a backward, or between a backward "
                f"and the step); call it after engine.step()"
            )

    def offload(self, include: Iterable[Any] | None, device: Any) -> None:
        if OffloadDeviceEnum(device) is OffloadDeviceEnum.none:
            logger.warning("No device specified for offloading states.")
            return
        if OffloadDeviceEnum(device) is not OffloadDeviceEnum.cpu:
            raise ValueError("stage 'patrickstar' offloads states to the host only (device='cpu')")
        self._check_between_steps("offload_states")
        parts = self.parts
        parts.manager.empty_cache()
        if not parts.store.movable:
            logger.info("ds_patrickstar: offload_states(): the chunks live on the host already (no accelerator)")
            return
        wanted = {OffloadStateTypeEnum(item) for item in include} if include is not None else _CHUNKS | _STATES
        if wanted & _STATES:
            moved = set(parts.optim_states.on_device)
            parts.optim_states.settle()
            parts.optim_states.all_to_host()
            self.states |= moved
        if wanted & _CHUNKS:
            for chunk in parts.chunk_map.owned_chunks():
                if not chunk.on_host:
                    self.chunks.append(chunk.chunk_id)
                    parts.placement.evict(chunk)
            for chunk in parts.chunk_map.owned_chunks():
                chunk.wait_pending()
            parts.accel.reclaim()  # the copies are over: the accelerator buffers behind them are freed now

    def reload(self) -> None:
        self._check_between_steps("reload_states")
        parts, chunks = self.parts, self.parts.chunk_map.chunks
        keep = set(self.chunks)
        for chunk_id in self.chunks:
            parts.placement.bring(chunks[chunk_id], keep)
        if self.states:
            parts.optim_states.place(set(parts.optim_states.on_device) | self.states)
        self.chunks, self.states = [], set()
