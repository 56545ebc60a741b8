"""Per-step counters: what moved where, readable from the engine and written to DeepSpeed's monitor."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StepCounters:
    """Reset at every optimizer step; every field is a count, bytes or seconds for the last step."""

    bytes_all_gathered: int = 0
    """bytes received by all-gathers of chunk groups (data parallel)"""
    bytes_reduce_scattered: int = 0
    """bytes sent to other ranks by reduce-scatters of gradients (data parallel)"""
    all_gathers: int = 0
    reduce_scatters: int = 0
    prefetched_all_gathers: int = 0
    """all-gathers issued ahead of use (data parallel, see [Note: gather order])"""
    prefetched_all_gather_hits: int = 0
    """prefetched all-gathers whose group was then used"""
    agreements: int = 0
    """all-reduces agreeing the gather plan across ranks (placement, see [Note: agreed gather plan])"""
    lockstep_checks: int = 0
    """small all-reduces agreeing each chunk-group collective before it is issued (data parallel, see
    [Note: ranks in lockstep]; ``zero_optimization.lockstep``)"""
    agreement_seconds: float = 0.0
    """seconds this rank spent in the ranks' agreements: the lockstep checks and ``agreements`` (waiting for
    the slowest rank included; see [Note: rank agreement])"""
    peak_kept_gathered_bytes: int = 0
    """highest bytes of chunk-group storage kept gathered between uses (see [Note: kept groups])"""
    bytes_to_device: int = 0
    """chunk bytes copied host -> accelerator (placement)"""
    bytes_to_host: int = 0
    """chunk bytes copied accelerator -> host (placement)"""
    accumulator_bytes_to_device: int = 0
    """fp32 gradient-accumulator bytes that moved host -> accelerator with their chunk (gradient accumulation; not in
    ``bytes_to_device``; an accumulator may also go alone, see [Note: accumulators kept])"""
    accumulator_bytes_to_host: int = 0
    """likewise accelerator -> host (not in ``bytes_to_host``)"""
    evictions: int = 0
    """chunks placement sent to the host to make room (and accumulators sent alone, see [Note: accumulators kept])"""
    clean_evictions: int = 0
    """of the evictions, those that copied nothing: the payload was as it came, its host buffer kept (see
    [Note: clean evictions])"""
    grads_released_in_backward: int = 0
    """chunks updated on the host sent to it during backward, once their last use this iteration was behind
    (see [Note: gradients leave in backward])"""
    host_updates_in_backward: int = 0
    """chunks whose host update began during backward, in spare buffers, and was kept at the step (see
    [Note: host updates in backward])"""
    spare_bytes_host: int = 0
    """host bytes of the spare buffers host updates begin in during backward (made once, kept; not model data)"""
    host_updates_redone: int = 0
    """host updates begun during backward and dropped (the step clipped, was skipped, or changed what they
    assumed): updated at the step instead"""
    stranded_bytes_released: int = 0
    """stranded allocator bytes given back before a budget error (see [Note: stranded bytes released])"""
    states_gave_way: int = 0
    """times a moment's chunks fit only once optimizer states moved from the accelerator to the host (the
    tide above the plan; see [Note: states give way])"""
    activations_gave_way: int = 0
    """times a moment's chunks fit only once saved activations the "auto" plan kept on the accelerator left for
    the host (the tide above the plan; see [Note: activations give way])"""
    planned_tide_set_aside: int = 0
    """times a moment's chunks did not fit beside the tide planned after it, whatever moved, but beside the memory
    reserved then, and the moment went on (see [Note: a forecast set aside])"""
    recompute_moments: int = 0
    """moments of activation-checkpoint recomputation (a module's forward run again inside backward;
    see [Note: recomputation in the trace])"""
    retraces_shape: int = 0
    """1 when this step's iteration was traced anew for inputs larger than every traced shape (see
    [Note: traces across input shapes])"""
    retraces_order: int = 0
    """1 when this step's iteration was traced anew for a different sequence of moments"""
    tide_replans: int = 0
    """1 when a batch's tide rose above the plan this step and the plans were made again from it"""
    activation_bytes_offloaded: int = 0
    """saved activation bytes copied accelerator -> host (see [Note: activation offload])"""
    activation_bytes_restored: int = 0
    """offloaded activation bytes copied back host -> accelerator"""
    prefetches: int = 0
    prefetch_hits: int = 0
    prefetches_beyond_next: int = 0
    """of ``prefetches``, chunks brought for a moment after the next one (see [Note: prefetch distance])"""
    prefetch_distance: int = 0
    """moments prefetched ahead, as the step-time model chose at the last plan (0: not chosen, one moment)"""
    eviction_order: int = 0
    """0: farthest next use first (Belady); 1: chunks whose eviction copies nothing first; 2 and 3: the same, evicted
    payloads leaving their gradient accumulators on the accelerator; as the step-time model chose at the last plan
    (see [Note: eviction order] and [Note: accumulators kept])"""
    adam_chunks_device: int = 0
    """chunks whose Adam update ran on the accelerator"""
    adam_chunks_host: int = 0
    """chunks whose Adam update ran on the host"""
    peak_model_bytes_device: int = 0
    """highest accelerator bytes held by the backend this step: chunks, gathered copies,
    accumulators, optimizer states, temporaries (the device ledger)"""
    peak_non_model_bytes_device: int = 0
    """highest non-model (activation) bytes seen at a moment this step (the tracer)"""
    peak_activation_bytes_device: int = 0
    """highest bytes of saved activations resident on the accelerator this step, as the saved-tensor
    hooks count them (the emulated accelerator's meter, or the activation offloader's; 0 on CUDA
    without offload_activations)"""
    peak_device_bytes: int = 0
    """highest backend + non-model accelerator bytes at a moment this step"""
    model_bytes_device: int = 0
    """model data on the accelerator at the end of the step (chunks, accumulators, optimizer states)"""
    model_bytes_host: int = 0
    """model data on the host at the end of the step (chunks, accumulators, optimizer states)"""
    frozen_bytes_device: int = 0
    """of ``model_bytes_device``, this rank's frozen chunks (see [Note: frozen chunks]): their payload only"""
    frozen_bytes_host: int = 0
    """of ``model_bytes_host``, this rank's frozen chunks"""
    frozen_bytes_disk: int = 0
    """this rank's frozen chunks whose values are only on disk at the end of the step (see [Note: frozen
    chunks on disk]); their reads count in ``disk_bytes_read``"""
    host_bytes_allocated: int = 0
    """host bytes the host pool holds at the end of the step: ``model_bytes_host`` as allocated
    (pinned on a GPU) plus at most one chunk's cached buffers, and the offloaded activations' slab (see [Note:
    pinned host memory], [Note: activation host stack])"""
    host_pinnings: int = 0
    """host buffers the host pool pinned since the previous step closed (the first step: since initialize made the
    accounts), each a ``cudaHostRegister`` on a GPU, a host cost in the step: 0 in a steady state, also with batches
    padded per step no longer than the longest seen (see [Note: activation host stack])"""

    disk_bytes_read: int = 0
    """bytes the disk tier read (spilled optimizer states, see [Note: disk tier], and frozen chunks, see
    [Note: frozen chunks on disk])"""
    disk_bytes_written: int = 0
    """bytes the disk tier wrote"""
    disk_io_seconds: float = 0.0
    """seconds the disk tier's I/O threads spent in reads and writes (summed over threads)"""
    disk_wait_seconds: float = 0.0
    """seconds the training waited on the disk tier's reads and writes (the I/O not hidden)"""
    disk_bytes_read_ahead: int = 0
    """of ``disk_bytes_read``, bytes whose reads were issued ahead of their use: optimizer states read
    before the optimizer step began (in the boundary micro-step's backward, see [Note: disk tier]) and
    frozen chunks read ahead of the module that uses them (see [Note: frozen use order])"""
    model_bytes_disk: int = 0
    """optimizer states in the disk tier's swap files at the end of the step"""
    disk_buffer_bytes: int = 0
    """host bytes of the disk tier's aligned buffers (the states' and the frozen chunks' read-ahead buffers)"""

    predicted_bytes_to_device: int = 0
    """bytes the placement planner's model of the driver predicts one iteration of the current trace brings to the
    accelerator, at steady state (see [Note: predicted moves]; at several ranks approximately; 0: not predicted,
    before a trace or without placement); ``bytes_to_device`` is what it measured"""
    predicted_bytes_to_host: int = 0
    """likewise, bytes back to the host (``bytes_to_host`` measured)"""
    predicted_accumulator_bytes_to_device: int = 0
    """with gradient accumulation, likewise the accumulators' bytes (``accumulator_bytes_to_device`` measured)"""
    predicted_accumulator_bytes_to_host: int = 0
    """likewise, back to the host (``accumulator_bytes_to_host`` measured)"""
    bytes_floor: int = 0
    """the fewest bytes, both ways, any placement of the current trace moves in a steady iteration (see [Note: the
    bytes floor]; 0: not computed yet (the traced step), or nothing need move; with several ranks, of this rank's
    chunks without their accumulators): the bytes measured each way, accumulators included, add up to at least
    this where the trace holds"""
    plan_seconds: float = 0.0
    """host seconds this step spent placing the optimizer states from a trace (the fill rule, and the step-time
    model's search where it chooses, see [Note: optimizer states by step time]): a one-time cost of the traced
    step and of each re-trace or re-plan, 0 in a steady step"""
    predicted_step_s: float = 0.0
    """seconds the step-time model predicts for this step (see [Note: step-time model]): the moves predicted, priced
    with the device profile, beside the moments' measured times of the previous step less the host's waits for host
    updates (0: not predicted, as the predicted bytes, or before two steps were timed)"""
    planned_step_s: float = 0.0
    """seconds the plan placement runs with predicted for a step when the step-time model chose it, plus the step's
    own time as last measured (see [Note: the plan checked on steady times]; 0: no plan chosen by the model)"""

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)
